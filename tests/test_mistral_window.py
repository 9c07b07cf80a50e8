"""Llama-family models with a sliding window (models/llama.py): Mistral-style (every layer windowed) and
transformers-5 `layer_types` (Qwen2's windowed upper layers), against HF transformers fp32 on the same weights.

1. A tiny random Mistral (window 8, blocks of 4): prompts several windows long, in 8-token chunks, batched
   decode, equal HF's logits; every layer's KV lives in the window group, so a long request holds at most its
   window's blocks and the full group holds no bytes at all.
2. A shared prefix hits the window blocks (no replay) and gives the cold engine's tokens; a prefix-KV store,
   which keeps only full-attention rows, is refused for such a model (it would keep nothing).
3. A tiny Qwen2 with `use_sliding_window` and `max_window_layers`: full and windowed layers side by side.
"""

from __future__ import annotations

import pytest
import torch

from openinfer import LLM
from openinfer.config import EngineConfig
from openinfer.engine.llm_engine import LLMEngine
from tests.conftest import assert_pool_idle
from tests.test_gemma3 import _run_recording
from tests.test_window_group import BS, W, _bound, greedy_run, shared_prefix_prompts

TINY = dict(vocab_size=49152, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=512, sliding_window=W, rope_theta=10000.0,
            tie_word_embeddings=False)


def _save(model, path, smollm_dir):
    import shutil

    torch.manual_seed(0)
    with torch.no_grad():  # larger-than-init weights so differences (a wrong window) would show
        for p in model.parameters():
            p.mul_(4.0) if p.dim() > 1 else p.add_(torch.randn_like(p) * 0.3)
    model.save_pretrained(path)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm_dir / f, path / f)
    return path, model


def make_tiny_mistral(path, smollm_dir):
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    return _save(MistralForCausalLM(MistralConfig(**TINY)).eval(), path, smollm_dir)


def _prompts(seed: int, lengths=(29, 3, 45)) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 49152, (n,), generator=g).tolist() for n in lengths]


def _assert_equals_hf(engine, hf, prompts, max_tokens=8):
    for prompt, (logits, out) in zip(prompts, _run_recording(engine, prompts, max_tokens=max_tokens)):
        with torch.no_grad():
            ref = hf(torch.tensor([prompt + out[:-1]])).logits[0, len(prompt) - 1:]
        torch.testing.assert_close(torch.stack(logits), ref, atol=1e-4, rtol=0)
    assert_pool_idle(engine)


def test_tiny_mistral_equals_hf_with_every_layer_in_the_window_group(tmp_path, smollm_dir):
    path, hf = make_tiny_mistral(tmp_path / "mistral", smollm_dir)
    engine = LLMEngine(EngineConfig(model=str(path), device="cpu", block_size=BS, max_num_batched_tokens=8))
    runner, kv = engine.runner, engine.kv_manager
    assert [(s.name, s.window) for s in runner.cache_specs] == [("kv_window", W)]
    assert runner.pool.bytes_per_block(window=False) == 0 and "kv" not in runner.caches
    assert runner.swa_layout.window_layers == (0, 1, 2)
    assert engine.max_model_len == 512            # not clipped to the window: every layer runs it for real
    held = []
    execute = runner.execute

    def recording_execute(sched, *rest):   # observe the real runner; nothing is replaced
        held.extend(kv.window.num_held(s.request.request_id) for s in sched.scheduled)
        return execute(sched, *rest)
    runner.execute = recording_execute
    _assert_equals_hf(engine, hf, _prompts(1))
    assert max(held) <= _bound(8) < 45 // BS


def test_the_window_matters(tmp_path, smollm_dir):
    """HF without the window gives other logits for these prompts: the equality above tests the window."""
    from transformers import MistralConfig, MistralForCausalLM

    path, hf = make_tiny_mistral(tmp_path / "mistral", smollm_dir)
    unwindowed = MistralForCausalLM(MistralConfig(**{**TINY, "sliding_window": None})).eval()
    unwindowed.load_state_dict(hf.state_dict())
    prompt = _prompts(1)[0]
    with torch.no_grad():
        a, b = (m(torch.tensor([prompt])).logits[0, -1] for m in (hf, unwindowed))
    assert (a - b).abs().max() > 0.1


def test_a_shared_prefix_hits_the_window_blocks(tmp_path, smollm_dir):
    path, _ = make_tiny_mistral(tmp_path / "mistral", smollm_dir)
    prompts, _ = shared_prefix_prompts()
    run = greedy_run
    cold = LLM(str(path), device="cpu", dtype="float32", block_size=BS, enable_prefix_caching=False)
    expected = run(cold, prompts[1])
    llm = LLM(str(path), device="cpu", dtype="float32", block_size=BS, max_num_batched_tokens=16)
    run(llm, prompts[0])
    tokens, lps = run(llm, prompts[1])
    stats = llm.engine.stats()
    assert stats["prefix_cache_hit_tokens"] == 40 and stats["swa_replays"] == 0
    assert tokens == expected[0] and max(abs(a - b) for a, b in zip(lps, expected[1])) < 1e-4
    assert_pool_idle(llm.engine)


def test_speculation_under_async_scheduling_keeps_the_window_a_rejection_rolls_back_to(tmp_path, smollm_dir):
    """Async scheduling with speculation: a step is queued on the guess that the verify step in flight keeps all
    its drafts, so the computed count the window group sees may fall back by k when that step is read back. Blocks
    are released only past what that fallback could need: greedy tokens and logprobs equal plain decoding (a
    scripted drafter rejecting at every depth; guesses kept and dropped) and the window blocks stay bounded."""
    from openinfer import SamplingParams
    from tests.test_spec_rollback import ScriptedDrafter

    path, _ = make_tiny_mistral(tmp_path / "mistral", smollm_dir)
    prompts, k = _prompts(3, lengths=(21, 6, 34)), 4
    sp = SamplingParams(temperature=0, ignore_eos=True, max_tokens=40, logprobs=1)
    opts = dict(device="cpu", dtype="float32", block_size=BS, max_num_batched_tokens=16)
    plain = LLM(str(path), **opts).generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)
    llm = LLM(str(path), **opts, async_scheduling=True,
              speculative_config={"method": "ngram", "num_speculative_tokens": k})
    spec = llm.engine.speculator
    spec.proposer = spec.proposer_ahead = ScriptedDrafter([p + o.outputs[0].token_ids for p, o in zip(prompts, plain)],
                                                          k, vocab_size=TINY["vocab_size"])
    kv, held = llm.engine.kv_manager, []
    execute = llm.engine.runner.execute

    def recording_execute(sched, *rest):   # observe the real runner; nothing is replaced
        held.extend(kv.window.num_held(s.request.request_id) for s in sched.scheduled)
        return execute(sched, *rest)
    llm.engine.runner.execute = recording_execute
    got = llm.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)
    for a, b in zip(got, plain):
        a, b = a.outputs[0], b.outputs[0]
        assert a.token_ids == b.token_ids
        assert max(abs(x[t].logprob - y[t].logprob) for x, y, t in zip(a.logprobs, b.logprobs, b.token_ids)) < 1e-4
    assert sum(o.outputs[0].num_accepted_tokens for o in got) > 20
    guessed = sum(o.metrics.num_guessed_steps for o in got)
    assert guessed > sum(o.metrics.num_guessed_steps_dropped for o in got) > 0
    assert max(held) <= _bound(16) + -(-(2 * k + 1) // BS)     # the window's blocks + the room a guess needs
    assert_pool_idle(llm.engine)


def test_tiny_qwen2_with_windowed_upper_layers_equals_hf(tmp_path, smollm_dir):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(**TINY, use_sliding_window=True, max_window_layers=1)
    assert cfg.layer_types == ["full_attention", "sliding_attention", "sliding_attention"]
    path, hf = _save(Qwen2ForCausalLM(cfg).eval(), tmp_path / "qwen2", smollm_dir)
    engine = LLMEngine(EngineConfig(model=str(path), device="cpu", block_size=BS, max_num_batched_tokens=8))
    assert [(s.name, s.window) for s in engine.runner.cache_specs] == [("kv", None), ("kv_window", W)]
    _assert_equals_hf(engine, hf, _prompts(2))


def test_a_prefix_store_is_refused_when_every_layer_is_windowed(tmp_path, smollm_dir):
    path, _ = make_tiny_mistral(tmp_path / "mistral", smollm_dir)
    with pytest.raises(ValueError, match=r"every layer of this LlamaForCausalLM attends through a sliding window"):
        LLM(str(path), device="cpu", dtype="float32", block_size=BS, kv_store_dir=str(tmp_path / "store"))
