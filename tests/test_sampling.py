"""Sampling: exact masks, HF/vLLM penalties, seeded reproducibility across batches, stops, logprobs. (The engine
runs the tiny random Llama where the property does not depend on what the weights say; EOS on SmolLM2.)"""

from __future__ import annotations

import math

import pytest
import torch

from openinfer import LLM, SamplingParams
from openinfer.sampling.sampler import apply_min_p, apply_penalties, apply_top_k, apply_top_p
from tests.conftest import assert_pool_idle

NEG = float("-inf")


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), device="cpu", max_num_seqs=16)
    yield llm
    llm.shutdown()


def test_top_k_keeps_exactly_k():
    logits = torch.tensor([[1.0, 5.0, 3.0, 4.0, 2.0], [0.0, 1.0, 2.0, 3.0, 4.0]])
    out = apply_top_k(logits, torch.tensor([2, 0]))
    assert out[0].tolist() == [NEG, 5.0, NEG, 4.0, NEG]
    assert out[1].tolist() == logits[1].tolist()          # 0 disables


def test_top_p_keeps_smallest_set_reaching_mass():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log()
    keep = lambda p: (apply_top_p(logits, torch.tensor([p]))[0] > NEG).tolist()  # noqa: E731
    assert keep(0.5) == [True, False, False, False]       # 0.5 reached by the first token alone
    assert keep(0.51) == [True, True, False, False]
    assert keep(0.8) == [True, True, False, False]
    assert keep(0.81) == [True, True, True, False]
    assert keep(1.0) == [True, True, True, True]
    assert keep(0.01) == [True, False, False, False]      # never empty


def test_top_p_matches_hf_warper():
    from transformers.generation.logits_process import TopPLogitsWarper

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 50, generator=g) * 3
    for p in (0.1, 0.5, 0.9, 0.99):
        ours = apply_top_p(logits, torch.full((4,), p))
        ref = TopPLogitsWarper(top_p=p)(None, logits.clone())
        assert torch.equal(ours > NEG, ref > NEG)


def test_min_p_relative_to_top_token():
    probs = torch.tensor([[0.6, 0.25, 0.1, 0.05]])
    out = apply_min_p(probs.log(), torch.tensor([0.2]))   # threshold 0.12
    assert (out[0] > NEG).tolist() == [True, True, False, False]


def test_repetition_penalty_matches_hf():
    from transformers.generation.logits_process import RepetitionPenaltyLogitsProcessor

    logits = torch.tensor([[2.0, -1.0, 0.5, -3.0, 1.0]])
    seen = torch.tensor([[0, 1, 3]])
    ref = RepetitionPenaltyLogitsProcessor(1.3)(seen, logits.clone())
    prompt_mask = torch.zeros(1, 5, dtype=torch.bool)
    prompt_mask[0, [0, 1]] = True
    counts = torch.zeros(1, 5)
    counts[0, 3] = 1
    ours = apply_penalties(logits, prompt_mask, counts, torch.zeros(1), torch.zeros(1), torch.tensor([1.3]))
    torch.testing.assert_close(ours, ref)


def test_presence_and_frequency_penalties_on_output_only():
    logits = torch.zeros(1, 4)
    prompt_mask = torch.tensor([[True, False, False, False]])
    counts = torch.tensor([[0.0, 3.0, 1.0, 0.0]])
    ours = apply_penalties(logits, prompt_mask, counts, torch.tensor([0.5]), torch.tensor([0.2]), torch.tensor([1.0]))
    assert ours[0].tolist() == pytest.approx([0.0, -0.5 - 0.6, -0.5 - 0.2, 0.0])


def test_seeded_requests_reproduce_whatever_the_batch(llm):
    sp = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=20, ignore_eos=True)
    alone = llm.generate("Write a sentence about cats.", sp, use_tqdm=False)[0].outputs[0].token_ids
    others = ["Tell me about rockets.", "List three fruits:", "Why do birds sing?", "x" * 40]
    params = [SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True, seed=s) for s in (None, 7, None, 9)]
    outs = llm.generate(others[:2] + ["Write a sentence about cats."] + others[2:], params[:2] + [sp] + params[2:],
                        use_tqdm=False)
    assert outs[2].outputs[0].token_ids == alone
    other_seed = SamplingParams(temperature=0.9, top_p=0.95, seed=4321, max_tokens=20, ignore_eos=True)
    assert llm.generate("Write a sentence about cats.", other_seed, use_tqdm=False)[0].outputs[0].token_ids != alone


def _find_boundary_stop(llm, prompt, n=40):
    """A stop string that starts inside one generated token and ends inside a later one."""
    out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)[0]
    ids = out.outputs[0].token_ids
    texts = [llm.tokenizer.decode(ids[:k]) for k in range(len(ids) + 1)]
    for k in range(3, len(ids) - 1):
        a, b = texts[k], texts[k + 1]
        if len(b) - len(a) >= 2 and len(a) - len(texts[k - 1]) >= 2 and b.startswith(a):
            stop = a[-2:] + b[len(a):len(a) + 2]
            if out.outputs[0].text.find(stop) == len(a) - 2:
                return out.outputs[0].text, stop, len(a) - 2
    pytest.fail("no token boundary usable for the test")


def test_stop_string_across_token_boundary(llm):
    prompt = "Once upon a time, in a small village by the sea,"
    full, stop, idx = _find_boundary_stop(llm, prompt)
    o = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=40, stop=[stop]), use_tqdm=False)[0].outputs[0]
    assert o.finish_reason == "stop" and o.stop_reason == stop
    assert o.text == full[:idx]
    o2 = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=40, stop=[stop], include_stop_str_in_output=True),
                      use_tqdm=False)[0].outputs[0]
    assert o2.text == full[:idx + len(stop)]
    assert_pool_idle(llm.engine)


def test_stop_token_ids_and_min_tokens(llm):
    prompt = "The capital of France is"
    first = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=5), use_tqdm=False)[0].outputs[0].token_ids[0]
    o = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=5, stop_token_ids=[first]), use_tqdm=False)[0]
    assert o.outputs[0].token_ids == [first] and o.outputs[0].stop_reason == first
    o = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=5, min_tokens=3, stop_token_ids=[first]),
                     use_tqdm=False)[0]
    assert len(o.outputs[0].token_ids) >= 3 and first not in o.outputs[0].token_ids[:3]


def test_eos_stops_unless_ignored(smollm_dir):
    """On SmolLM2: a real model's chat ends on its EOS token."""
    llm = LLM(str(smollm_dir), device="cpu", dtype="float32")
    conv = [{"role": "user", "content": "Say hello."}]
    o = llm.chat(conv, SamplingParams(temperature=0, max_tokens=200), use_tqdm=False)[0].outputs[0]
    assert o.finish_reason == "stop" and o.token_ids[-1] in llm.tokenizer.eos_token_ids
    assert "<|im_end|>" not in o.text
    o = llm.chat(conv, SamplingParams(temperature=0, max_tokens=len(o.token_ids) + 5, ignore_eos=True),
                 use_tqdm=False)[0].outputs[0]
    assert o.finish_reason == "length"


@pytest.mark.parametrize("mode", ["raw_logprobs", "processed_logprobs"])
def test_logprobs_are_log_softmax_of_the_logits_used(tiny_llama_dir, mode):
    llm = LLM(str(tiny_llama_dir), device="cpu", logprobs_mode=mode)
    captured = []
    execute = llm.engine.runner.execute

    def recording_execute(sched, *rest):   # observe the real runner's output
        out = execute(sched, *rest)
        if out.logits is not None:
            captured.append(out.logits[0].clone())
        return out

    llm.engine.runner.execute = recording_execute
    temp = 0.7
    o = llm.generate("The weather today is", SamplingParams(temperature=temp, seed=3, max_tokens=6, logprobs=4,
                                                             ignore_eos=True), use_tqdm=False)[0].outputs[0]
    assert len(o.logprobs) == len(o.token_ids) == len(captured) == 6
    total = 0.0
    for tok, entry, logits in zip(o.token_ids, o.logprobs, captured):
        ref = (logits if mode == "raw_logprobs" else logits / temp).log_softmax(-1)
        assert tok in entry and len(entry) in (4, 5)
        assert entry[tok].logprob == pytest.approx(ref[tok].item(), abs=1e-5)
        assert entry[tok].rank == int((ref > ref[tok]).sum()) + 1
        top = ref.topk(4)
        for r, tid in enumerate(top.indices.tolist(), start=1):
            assert entry[tid].rank == r and entry[tid].logprob == pytest.approx(ref[tid].item(), abs=1e-5)
        total += ref[tok].item()
    assert o.cumulative_logprob == pytest.approx(total, abs=1e-4)
    assert math.isfinite(o.cumulative_logprob)


def test_greedy_is_argmax_even_with_top_k_set(llm):
    a = llm.generate("Hello", SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0].outputs[0].token_ids
    b = llm.generate("Hello", SamplingParams(temperature=0, top_k=3, top_p=0.5, max_tokens=8),
                     use_tqdm=False)[0].outputs[0].token_ids
    assert a == b
