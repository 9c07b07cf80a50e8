"""GPU tests (`pytest -m gpu`, 2 GPUs): the multi-process engine over NCCL.

- DeepSeek-V4 (tiny, published FP8/MXFP4 formats) with attention DP2 + EP2 follows one process: one request
  (the other rank idling on padding rows / graphs) gives identical greedy tokens and logprobs, CUDA graphs or
  eager; a batch's teacher-forced prompt logprobs stay within bf16 batch noise (greedy tokens of a random
  tiny model part at near-ties: measured 2026-11-30, 87% of 120 tokens before divergence);
- the same with the exact-size all-to-all (prefill exact, decode graphs padded), and that exchange alone over
  NCCL returns the padded one's bits;
- two-batch overlap across attention (`two_batch_split="requests"`): overlapped = one after the other, bit for bit,
  and one process within the same bound;
- Llama (tiny) with TP2 follows one process the same way (teacher-forced)."""

from __future__ import annotations

import pytest
import torch

from openinfer import LLM, SamplingParams
from tests.test_deepseek_v4 import V4_TOKENIZER_DIR
from tests.test_ep_exchange import exchange_worker, run_ranks
from tests.test_quantization import TINY_PUBLISHED, write_published

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")]

PROMPTS = [[(i * 7919 + j * 104729) % 120000 + 100 for j in range(n)] for i, n in enumerate([150, 9, 300, 40, 77])]


def _greedy(llm: LLM, prompts, n=24):
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(temperature=0, max_tokens=n,
                                                                                 logprobs=1), use_tqdm=False)
    return [(o.outputs[0].token_ids, [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
            for o in outs]


def _prompt_logprobs(llm: LLM, prompts) -> list[list[float]]:
    """Teacher-forced: each prompt position's logprob of the actual next prompt token (no divergence)."""
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(max_tokens=1, prompt_logprobs=0),
                        use_tqdm=False)
    return [[d[t].logprob for d, t in zip(o.prompt_logprobs[1:], p[1:])] for o, p in zip(outs, prompts)]


def _max_gap(a, b) -> float:
    return max(abs(x - y) for u, v in zip(a, b) for x, y in zip(u, v))


def _agree(a, b):
    """Fraction of tokens equal up to each sequence's first divergence, and the largest logprob gap there."""
    same = total = 0
    gap = 0.0
    for (ta, la), (tb, lb) in zip(a, b):
        total += len(ta)
        for x, y, u, v in zip(ta, tb, la, lb):
            if x != y:
                break
            same += 1
            gap = max(gap, abs(u - v))
    return same / total, gap


@pytest.fixture(scope="module")
def published_dir(tmp_path_factory):
    return write_published(tmp_path_factory.mktemp("pub") / "ckpt", TINY_PUBLISHED, std=0.1)


def test_exact_all_to_all_over_nccl_equals_padded_and_one_process():
    """The MoE exchanges alone over NCCL (tests/test_ep_exchange.py's check: an idle rank, one and two halves,
    overlap on and off): the exact-size all-to-all returns the padded one's bits and the one-process sum."""
    run_ranks(exchange_worker, 2, "cuda")


# moe_dispatch: auto (the all-gather at EP2) and the exact all-to-all (prefill steps exact; with graphs, decode
# replays the padded all-to-all)
@pytest.mark.parametrize("enforce_eager,dispatch", [(False, "auto"), (True, "auto"), (False, "all_to_all_exact")])
def test_dp2_ep2_published_v4_follows_one_process(published_dir, enforce_eager, dispatch):
    opts = dict(device="cuda", dtype="bfloat16", gpu_memory_utilization=0.3, enforce_eager=enforce_eager,
                max_num_batched_tokens=256)
    one = LLM(str(published_dir), **opts)
    ref = _prompt_logprobs(one, PROMPTS)
    one_bf16_noise = _max_gap(ref, _prompt_logprobs(one, PROMPTS[::-1])[::-1])   # same engine, other batch order
    single_prompt = _greedy(one, PROMPTS[:1])    # one request: the other rank idles (padding rows / graphs)
    one.shutdown()
    two = LLM(str(published_dir), data_parallel_size=2, enable_expert_parallel=True, moe_dispatch=dispatch, **opts)
    got = _prompt_logprobs(two, PROMPTS)
    got_single = _greedy(two, PROMPTS[:1])
    stats = two.engine.stats()
    two.shutdown()
    gap = _max_gap(ref, got)
    print(f"EP2 vs one process (eager={enforce_eager}, {dispatch}): prompt logprob gap {gap:.4f} (one process, batch "
          f"reordered: {one_bf16_noise:.4f}); one request identical: {single_prompt == got_single}")
    # DP splits the batch, so bf16 GEMMs see other shapes: within a few times one process's own batch noise
    assert gap < max(0.05, 4 * one_bf16_noise)
    # one request: rank 0 runs exactly one process's batch, the idle rank adds zeros (measured: bit-identical)
    assert single_prompt == got_single
    assert all(s["num_running"] == 0 and s["kv_blocks_free"] == s["kv_blocks_total"] for s in stats["per_rank"])


def test_dp2_ep2_two_batches_across_attention_over_nccl(published_dir):
    """two_batch_split="requests" over NCCL, CUDA graphs on (decode replays are never split): the split steps
    (prefill: each rank's chunks in two halves) overlapped give the bits of the same halves one after the other,
    and one process within the bound above."""
    opts = dict(device="cuda", dtype="bfloat16", gpu_memory_utilization=0.3, max_num_batched_tokens=256)
    one = LLM(str(published_dir), **opts)
    ref = _prompt_logprobs(one, PROMPTS)
    one_bf16_noise = _max_gap(ref, _prompt_logprobs(one, PROMPTS[::-1])[::-1])
    one.shutdown()
    runs = []
    for overlap in (False, True):
        two = LLM(str(published_dir), data_parallel_size=2, enable_expert_parallel=True, two_batch_split="requests",
                  two_batch_overlap=overlap, **opts)
        runs.append((_prompt_logprobs(two, PROMPTS), _greedy(two, PROMPTS),
                     [s["two_batch_steps"] for s in two.engine.stats()["per_rank"]]))
        two.shutdown()
    gap = _max_gap(ref, runs[1][0])
    print(f"EP2 two batches across attention vs one process: prompt logprob gap {gap:.4f} (one process, batch "
          f"reordered: {one_bf16_noise:.4f}); split steps per rank {runs[1][2]}; on = off: {runs[0] == runs[1]}")
    assert min(runs[1][2]) > 0
    assert runs[0] == runs[1]
    assert gap < max(0.05, 4 * one_bf16_noise)


def _tiny_llama(path):
    """A tiny Llama saved by transformers, with DeepSeek's tokenizer files (present on the device)."""
    import shutil

    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=129280, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=2048,
                                   attention_bias=True, tie_word_embeddings=True)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4.0) if p.dim() > 1 else p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(path)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(V4_TOKENIZER_DIR / f, path / f)
    return path


def test_tp2_llama_follows_one_process(tmp_path):
    path = _tiny_llama(tmp_path / "llama")
    opts = dict(device="cuda", dtype="bfloat16", gpu_memory_utilization=0.3, block_size=16)
    prompts = [[t % 49000 for t in p] for p in PROMPTS]
    one = LLM(str(path), **opts)
    ref = _prompt_logprobs(one, prompts)
    noise = _max_gap(ref, _prompt_logprobs(one, prompts[::-1])[::-1])
    one.shutdown()
    two = LLM(str(path), tensor_parallel_size=2, **opts)
    got = _prompt_logprobs(two, prompts)
    two.shutdown()
    gap = _max_gap(ref, got)
    print(f"TP2 vs one process: prompt logprob gap {gap:.4f} (one process, batch reordered: {noise:.4f})")
    # TP rounds each rank's partial sums of o_proj and down_proj to bf16 before the all-reduce adds them (one
    # process rounds the fp32 accumulation once): on this model (weights x4) that alone moves prompt logprobs by
    # 0.048 (HF, one process, the two GEMMs split as TP2 splits them), and TP2 on the CPU with gloo by 0.063 while
    # its fp32 gap is 3e-6 (benchmarks/cpu_tp2_bf16_gap.py, 2026-12-02); measured 0.058 on 2 x H200. Noise, not a
    # bug: the bound is 1.5x the largest measured
    assert gap < max(0.1, 4 * noise)
