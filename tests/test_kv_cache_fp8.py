"""FP8 KV cache (`kv_cache_dtype="fp8"`): E4M3 K/V with a float32 scale per token, K/V and KV head.

1. The format: round trip within half an E4M3 step of each value (so within amax / 28 of each row), round to
   nearest even, the amax element on +-448, zero rows and underflowing scales give zeros, never NaN.
2. The torch backend over an FP8 cache is exactly attention over the dequantized K/V (decode rows, prefill
   chunks with cached context, GQA, a window), and backends with the old method signatures still work.
3. The engine: with FP8 caches, SmolLM2's and a tiny Gemma-3's (windows) one-pass prefill equal HF transformers
   whose attention reads the same quantize-dequantized K/V. Where the engine's K/V come from differently shaped
   matmuls than HF's (batched prompts, chunks, decode, preemption, prefix-cache hits), last-bit differences
   move some values across an E4M3 rounding boundary, a step of up to 1/14 of a row's amax, so there SmolLM2
   stays within the bounds that hold against the unquantized cache (greedy choice and logprobs) and Gemma-3
   within 0.1 of HF's logits over the quantized K/V, far from what a wrong scale, slot or window gives. A block
   holds the predicted bytes.
4. Refusals: models other than the Llama family and Gemma-3, backends without FP8 reads, unknown values.
"""

from __future__ import annotations

import math

import pytest
import torch

from openinfer import LLM, SamplingParams
from openinfer.config import EngineConfig
from openinfer.engine.llm_engine import LLMEngine
from openinfer.layers.attention import AttentionMetadata, PrefillChunk, TorchPagedAttention, gather_kv
from openinfer.models.registry import load_model
from openinfer.quantization.kv_formats import fp8_kv_dequantize, fp8_kv_quantize
from tests.conftest import assert_pool_idle
from tests.test_gemma3 import _run_recording, make_tiny_gemma3

HF_FP8_ATTENTION = "openinfer_fp8_kv_sdpa"
E4M3 = torch.float8_e4m3fn


def qdq(x: torch.Tensor) -> torch.Tensor:
    return fp8_kv_dequantize(*fp8_kv_quantize(x), x.dtype)


# ---- 1. the format ------------------------------------------------------------------------------------------
def _rows(seed: int, n: int = 4096, d: int = 64) -> torch.Tensor:
    """Rows spanning magnitudes 1e-6..1e6, some with one outlier channel (as keys have)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g) * torch.logspace(-6, 6, n)[torch.randperm(n, generator=g)][:, None]
    x[::7, 3] *= 40
    return x


def test_round_trip_is_within_half_an_e4m3_step():
    """E4M3 has 3 mantissa bits: a normal value y in [2^e, 2^(e+1)) rounds to a multiple of 2^(e-3), so by at
    most 2^(e-4) <= |y| / 16; below 2^-6 (subnormal) the step is 2^-9, the error at most 2^-10. In units of the
    row (x = y * scale, scale = amax / 448): |x - x'| <= max(|x| / 16, scale / 1024) (+ float32 rounding of the
    division and product). The largest values, in [256, 448], have step 32: |x - x'| <= 16 * scale = amax / 28."""
    x = _rows(0)
    q, scale = fp8_kv_quantize(x)
    assert q.dtype == E4M3 and scale.dtype == torch.float32 and scale.shape == x.shape[:-1]
    err = (fp8_kv_dequantize(q, scale, torch.float32) - x).abs()
    bound = torch.maximum(x.abs() / 16, scale[:, None] / 1024) + x.abs() * 2.0**-20
    assert (err <= bound).all()
    amax = x.abs().amax(-1)
    row_err = err.amax(-1) / amax
    assert (row_err <= 1 / 28 * (1 + 2.0**-20)).all()
    assert row_err.max() > 0.9 / 28          # the bound is tight: the row bound is nearly reached
    normal = x.abs() >= scale[:, None] * 2.0**-6
    assert (err / x.abs())[normal].max() > 0.055   # and so is 1/16 of the value (worst case 1/17 at 1.0625)


def test_rounding_is_nearest_even_on_the_e4m3_grid():
    """Every quantized value is the E4M3 value nearest x / scale; ties go to the even code."""
    x = _rows(1, n=512)
    q, scale = fp8_kv_quantize(x)
    y = (x / scale[:, None]).clamp(-448, 448)
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(E4M3)
    grid = codes.float()
    finite = ~grid.isnan()
    grid, bits = grid[finite], torch.arange(256)[finite]
    dist = (y.reshape(-1, 1) - grid).abs()
    best = dist.min(-1, keepdim=True).values
    tied = dist == best
    # among the nearest grid values, the one whose code is even (of +0/-0 either is fine)
    even_pick = torch.where(tied & (bits % 2 == 0), grid, torch.nan).nan_to_num(nan=float("inf"))
    want = torch.where(tied.sum(-1) > 1, even_pick.abs().min(-1).values * y.reshape(-1).sign(),
                       grid[dist.argmin(-1)])
    assert torch.equal(q.float().reshape(-1).abs(), want.abs())
    assert (tied.sum(-1) > 1).any()           # ties happen in the sample (the tie rule is exercised)


def test_amax_goes_to_448_and_zero_rows_stay_zero():
    x = _rows(2, n=1024)
    x[5] = 0.0
    x[9, 7] = -x[9].abs().max() * 2       # the amax element negative
    q, scale = fp8_kv_quantize(x)
    idx = x.abs().argmax(-1)
    top = q.float().gather(-1, idx[:, None])[:, 0]
    nonzero = x.abs().amax(-1) > 0
    assert torch.equal(top[nonzero].abs(), torch.full_like(top[nonzero], 448.0))
    assert top[9] == -448.0
    assert scale[5] == 1.0 and (q[5].float() == 0).all()
    assert (fp8_kv_dequantize(q, scale, torch.float32)[5] == 0).all()
    # back to the amax within one float32 rounding (448 * (amax / 448)); exactly once cast to bfloat16
    amax = x.abs().amax(-1)
    back = fp8_kv_dequantize(q, scale, torch.float32).abs().gather(-1, idx[:, None])[:, 0]
    assert ((back - amax).abs() <= amax * 2.0**-23).all()
    xb = x.bfloat16()
    qb, sb = fp8_kv_quantize(xb)
    backb = fp8_kv_dequantize(qb, sb, torch.bfloat16).gather(-1, idx[:, None])[:, 0]
    assert torch.equal(backb, xb.gather(-1, idx[:, None])[:, 0])


def test_never_nan_for_finite_input():
    """The quotient of the amax element can round to just above 448 (clamped); a float32 amax so small that
    amax / 448 underflows to 0 gets scale 1 (else 0 / 0 = NaN for its zero entries)."""
    x = _rows(3)
    y = x / (x.abs().amax(-1, keepdim=True) / 448)
    assert (y.abs() > 448).any()               # the clamp is needed on this sample
    tiny = torch.tensor([[1e-44, 0.0, -5e-45, 0.0], [3e-43, 0.0, 1e-45, -2e-43], [3e38, -3.4e38, 0.0, 1.0]])
    for rows in (x, tiny, x.bfloat16(), (x * 1e-4).half()):
        q, scale = fp8_kv_quantize(rows)
        back = fp8_kv_dequantize(q, scale, rows.dtype)
        assert not q.float().isnan().any() and back.isfinite().all() and (scale > 0).all()
    q, scale = fp8_kv_quantize(tiny)
    assert scale[0] == 1.0 and (q[0].float() == 0).all()


# ---- 2. the torch backend over an FP8 cache ---------------------------------------------------------------
BS, KVH, H, D = 4, 2, 6, 16


def _meta(tables: dict[str, list[int]], decodes: list[tuple[str, int]],
          prefills: list[tuple[str, int, int]]) -> AttentionMetadata:
    """Decode rows (seq, context length) first, then prefill chunks (seq, query length, context length)."""
    def slot(seq, pos):
        return tables[seq][pos // BS] * BS + pos % BS

    slots = [slot(s, n - 1) for s, n in decodes]
    chunks, start = [], len(decodes)
    for s, qlen, ctx in prefills:
        slots += [slot(s, p) for p in range(ctx - qlen, ctx)]
        chunks.append(PrefillChunk(start, qlen, ctx, torch.tensor(tables[s][:math.ceil(ctx / BS)]), BS))
        start += qlen
    meta = AttentionMetadata(BS, torch.tensor(slots), num_decode_tokens=len(decodes), prefills=chunks)
    if decodes:
        width = max(math.ceil(n / BS) for _, n in decodes)
        meta.decode_block_tables = torch.tensor([tables[s] + [0] * (width - len(tables[s])) for s, _ in decodes])
        meta.decode_context_lens = torch.tensor([n for _, n in decodes])
        meta.max_decode_context_len = max(n for _, n in decodes)
    return meta


class OldSignatures(TorchPagedAttention):
    """A faster backend as written before FP8 caches: no kv_scale in its methods (and no FP8 support)."""

    supports_fp8_kv = False

    def write(self, kv_cache, slot_mapping, k, v):
        super().write(kv_cache, slot_mapping, k, v)

    def decode_into(self, q, kv_cache, meta, scale, out, window=None):
        super().decode_into(q, kv_cache, meta, scale, out, window)

    def prefill_into(self, q, kv_cache, meta, scale, out, window=None):
        super().prefill_into(q, kv_cache, meta, scale, out, window)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, 3])
def test_fp8_cache_attention_equals_attention_over_dequantized_kv(dtype, window):
    """Step 1 prefills three sequences; step 2 mixes two decode rows and a chunk with 6 cached tokens. The FP8
    backend's output equals, bit for bit, the same backend over an unquantized cache holding qdq(K), qdq(V);
    the whole dequantized FP8 cache equals that cache (nothing written elsewhere)."""
    g = torch.Generator().manual_seed(0)
    tables = {"a": [3, 7], "b": [1, 9, 4], "c": [12, 2, 5]}
    steps = [_meta(tables, [], [("a", 7, 7), ("b", 10, 10), ("c", 6, 6)]),
             _meta(tables, [("a", 8), ("b", 11)], [("c", 5, 11)])]
    backend = TorchPagedAttention()
    fp8_cache = torch.zeros(16, BS, 2, KVH, D, dtype=E4M3)
    scales = torch.zeros(16, BS, 2, KVH)
    ref_cache = torch.zeros(16, BS, 2, KVH, D, dtype=dtype)
    raw_cache = torch.zeros(16, BS, 2, KVH, D, dtype=dtype)
    extra = {} if window is None else {"window": window}
    for meta in steps:
        T = len(meta.slot_mapping)
        q, k, v = (torch.randn(T, n, D, generator=g).to(dtype) * 3 for n in (H, KVH, KVH))
        out = backend.forward(q, k, v, fp8_cache, meta, 0.25, kv_scale=scales, **extra)
        ref = backend.forward(q, qdq(k), qdq(v), ref_cache, meta, 0.25, **extra)
        raw = backend.forward(q, k, v, raw_cache, meta, 0.25, **extra)
        assert out.dtype == dtype and torch.equal(out, ref)
        assert (out - raw).abs().max() > 0           # the cache is really quantized
    every = torch.arange(16 * BS)
    for a, b in zip(gather_kv(fp8_cache, every, scales, dtype), gather_kv(ref_cache, every)):
        assert torch.equal(a, b)


def test_backends_with_old_signatures_still_run_unquantized_caches():
    g = torch.Generator().manual_seed(1)
    meta = _meta({"a": [0, 1, 2]}, [], [("a", 9, 9)])
    q, k, v = (torch.randn(9, n, D, generator=g) for n in (H, KVH, KVH))
    outs = [b.forward(q, k, v, torch.zeros(4, BS, 2, KVH, D), meta, 0.25, window=4)
            for b in (TorchPagedAttention(), OldSignatures())]
    assert torch.equal(*outs)


# ---- 3. the engine ----------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def hf_fp8_attention():
    """HF transformers' SDPA attention reading qdq(K) and qdq(V) (K after RoPE, per token and KV head), with
    SDPA's masks (sliding windows included: transformers builds no mask for an implementation it does not know)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    def fp8_kv_sdpa(module, query, key, value, *args, **kwargs):
        return sdpa_attention_forward(module, query, qdq(key), qdq(value), *args, **kwargs)

    AttentionInterface.register(HF_FP8_ATTENTION, fp8_kv_sdpa)
    AttentionMaskInterface.register(HF_FP8_ATTENTION, sdpa_mask)
    return HF_FP8_ATTENTION


@pytest.fixture(scope="module")
def hf_smollm_fp8(smollm_dir, hf_fp8_attention):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(smollm_dir), dtype=torch.float32,
                                                attn_implementation=hf_fp8_attention).eval()


@pytest.fixture(scope="module")
def fp8_llm(smollm_dir):
    llm = LLM(str(smollm_dir), device="cpu", dtype="float32", kv_cache_dtype="fp8", max_num_seqs=16)
    yield llm
    llm.shutdown()


TEXTS = ["Once upon a time, in a small village by the sea, there lived an old fisherman who",
         "Q: What is the boiling point of water at sea level?\nA:",
         "import numpy as np\n\n# compute the mean of a list of numbers\ndef mean(xs):\n    return",
         "The three primary colors are"]


def _hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0]


def assert_close_to_reference(chosen_lp: list[tuple[float, float]], same_top1: list[bool]) -> None:
    """(our logprob, the reference's) of each chosen token and whether the top-1 tokens agree: the FP8 cache
    moves them this little against the unquantized cache (benchmarks/cpu_fp8_kv_accuracy.py measured a mean
    of 0.027, a max of 0.54 and 97.6% top-1 agreement over 1152 positions); a wrong scale or slot moves them
    by nats."""
    d = torch.tensor([abs(a - b) for a, b in chosen_lp])
    assert sum(same_top1) / len(same_top1) >= 0.9, same_top1
    assert d.mean() < 0.1 and d.max() < 1.5, d


def test_smollm2_fp8_one_pass_prefill_equals_hf_over_quantized_kv(fp8_llm, hf_smollm_fp8):
    """One prompt, one prefill: the engine's K/V come from the same matmul shapes as HF's, so its prompt
    logprobs equal HF's over qdq(K), qdq(V) (to float32 rounding of everything after attention)."""
    for text in TEXTS[:2]:
        ids = fp8_llm.tokenizer.encode(text * 2)
        out = fp8_llm.generate(prompt_token_ids=[ids], sampling_params=SamplingParams(max_tokens=1, prompt_logprobs=0),
                               use_tqdm=False)[0]
        ours = torch.tensor([out.prompt_logprobs[i][ids[i]].logprob for i in range(1, len(ids))])
        ref = _hf_logits(hf_smollm_fp8, ids).log_softmax(-1)[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=0)


def test_smollm2_fp8_through_chunks_and_preemption_stays_close_to_hf_over_quantized_kv(smollm_dir, hf_smollm_fp8):
    """32-token prefill chunks mixed with decodes and a pool of 6 blocks of 16 (preemption, recompute)."""
    engine = LLMEngine(EngineConfig(model=str(smollm_dir), device="cpu", dtype="float32", kv_cache_dtype="fp8",
                                    block_size=16, num_kv_blocks=6, max_num_batched_tokens=32,
                                    enable_prefix_caching=False))
    assert engine.runner.caches["kv"][0].dtype == E4M3 and engine.runner.caches["kv_scale"][0].dtype == torch.float32
    prompts = [engine.tokenizer.encode(t) for t in TEXTS]
    results = _run_recording(engine, prompts, max_tokens=12)
    assert engine.scheduler.num_preemptions > 0
    chosen, same = [], []
    for prompt, (logits, out) in zip(prompts, results):
        ours = torch.stack(logits).log_softmax(-1)
        ref = _hf_logits(hf_smollm_fp8, prompt + out[:-1])[len(prompt) - 1:].log_softmax(-1)
        chosen += [(ours[i, t].item(), ref[i, t].item()) for i, t in enumerate(out)]
        same += (ours.argmax(-1) == ref.argmax(-1)).tolist()
    assert_close_to_reference(chosen, same)
    assert_pool_idle(engine)


def test_smollm2_fp8_prefix_cache_hit_stays_close_to_hf_over_quantized_kv(fp8_llm, hf_smollm_fp8):
    """A prompt extending a finished one reads its cached FP8 block (scales included)."""
    base = fp8_llm.tokenizer.encode(TEXTS[0] * 8)
    assert len(base) > 128
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=1)
    fp8_llm.generate(prompt_token_ids=[base], sampling_params=greedy, use_tqdm=False)
    longer = base + fp8_llm.tokenizer.encode(" and then")
    out = fp8_llm.generate(prompt_token_ids=[longer], sampling_params=greedy, use_tqdm=False)[0]
    assert out.num_cached_tokens == 128
    toks = out.outputs[0].token_ids
    ref = _hf_logits(hf_smollm_fp8, longer + toks[:-1])[len(longer) - 1:].log_softmax(-1)
    lps = out.outputs[0].logprobs
    assert_close_to_reference([(lp[t].logprob, ref[i, t].item()) for i, (lp, t) in enumerate(zip(lps, toks))],
                              [min(lp, key=lambda t: lp[t].rank) == ref[i].argmax().item() for i, lp in enumerate(lps)])
    assert_pool_idle(fp8_llm.engine)


def test_smollm2_fp8_against_the_unquantized_cache(llm, fp8_llm):
    """Teacher forcing on the unquantized cache's greedy continuations (32 tokens of 4 prompts), then free-running
    greedy: the tokens generated before the first divergence."""
    prompts = [llm.tokenizer.encode(t) for t in TEXTS]
    greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    conts = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=greedy,
                                                           use_tqdm=False)]
    scored = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    seqs = [p + c for p, c in zip(prompts, conts)]
    runs = [e.generate(prompt_token_ids=seqs, sampling_params=scored, use_tqdm=False) for e in (fp8_llm, llm)]
    chosen, same = [], []
    for p, seq, ours, ref in zip(prompts, seqs, *runs):
        for i in range(len(p), len(seq)):
            a, b = ours.prompt_logprobs[i], ref.prompt_logprobs[i]
            chosen.append((a[seq[i]].logprob, b[seq[i]].logprob))
            same.append(min(a, key=lambda t: a[t].rank) == min(b, key=lambda t: b[t].rank))
    assert_close_to_reference(chosen, same)
    assert sum(abs(a - b) for a, b in chosen) / len(chosen) > 1e-3     # the FP8 cache is really in use
    fp8_greedy = fp8_llm.generate(prompt_token_ids=prompts, sampling_params=greedy, use_tqdm=False)
    agree = [next((i for i, (x, y) in enumerate(zip(c, o.outputs[0].token_ids)) if x != y), len(c))
             for c, o in zip(conts, fp8_greedy)]
    assert sum(agree) / len(agree) >= 6, agree


def test_fp8_block_holds_the_predicted_bytes(llm, fp8_llm):
    """Per token and layer: 2*KVH*D one-byte values + 2*KVH float32 scales, against 2*KVH*D values of the model
    dtype; the pool of the same byte budget holds that many more blocks."""
    cfg = fp8_llm.engine.model_config
    kvh, d, layers, bs = cfg.num_key_value_heads, cfg.head_dim, cfg.num_hidden_layers, 128
    assert (kvh, d) == (3, 64)
    fp8, ref = fp8_llm.engine.runner, llm.engine.runner
    assert fp8.pool.bytes_per_block() == layers * bs * (2 * kvh * d + 2 * kvh * 4)
    assert fp8.pool.bytes_per_block() / ref.pool.bytes_per_block() == (2 * kvh * d + 2 * kvh * 4) / (2 * kvh * d * 4) == 0.265625
    bf16 = sum(s.bytes_per_block(bs) for s in llm.engine.runner.model.cache_specs(torch.bfloat16))
    assert fp8.pool.bytes_per_block() / bf16 == (2 * kvh * d + 2 * kvh * 4) / (2 * kvh * d * 2) == 0.53125
    assert fp8.num_blocks == (2 << 30) // fp8.pool.bytes_per_block() and ref.num_blocks == (2 << 30) // ref.pool.bytes_per_block()


def test_tiny_gemma3_fp8_one_pass_prefill_equals_hf_over_quantized_kv(tmp_path, smollm_dir, hf_fp8_attention):
    """Sliding-window and global layers over prompts longer than the window, each prompt in one prefill (the
    same matmul shapes as HF's): the first token's logits equal HF's over qdq(K), qdq(V)."""
    path, hf = make_tiny_gemma3(tmp_path, smollm_dir)
    hf.set_attn_implementation(hf_fp8_attention)
    engine = LLMEngine(EngineConfig(model=str(path), device="cpu", block_size=4, max_num_batched_tokens=64,
                                    kv_cache_dtype="fp8_e4m3"))
    # the full layer's kinds, then the sliding layers' (the window group, kv_cache/window_group.py)
    assert [(s.name, s.window) for s in engine.runner.cache_specs] == [
        ("kv", None), ("kv_scale", None), ("kv_window", 8), ("kv_window_scale", 8)]
    g = torch.Generator().manual_seed(1)
    for n in (13, 21):
        prompt = torch.randint(0, 49152, (n,), generator=g).tolist()
        [(logits, _)] = _run_recording(engine, [prompt], max_tokens=1)
        torch.testing.assert_close(logits[0], _hf_logits(hf, prompt)[-1], atol=1e-4, rtol=0)
    assert_pool_idle(engine)


def test_tiny_gemma3_fp8_through_chunks_and_decode_stays_close_to_hf_over_quantized_kv(tmp_path, smollm_dir,
                                                                                     hf_fp8_attention):
    """8-token chunks and batched decode: the engine's K/V rows come from other matmul shapes than HF's (M=8 or
    3 rows against 13..26), so last-bit differences can move a value across an E4M3 rounding boundary. HF
    alone shows it: the same 8 tokens computed as 8 rows and as 13 rows differ by 1.7e-6 in layer 2's V, one
    element of which then rounds to the neighbouring E4M3 value (0.069 apart after qdq), moving the logits by
    0.023 (torch 2.13 CPU, measured 2026-12-01). So: within 0.1 of HF over the quantized K/V and the same
    greedy tokens, while HF over the unquantized K/V is 0.31 away (a skipped quantization, wrong scale, slot
    or window is far outside)."""
    path, hf = make_tiny_gemma3(tmp_path, smollm_dir)
    engine = LLMEngine(EngineConfig(model=str(path), device="cpu", block_size=4, max_num_batched_tokens=8,
                                    kv_cache_dtype="fp8_e4m3"))
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 49152, (n,), generator=g).tolist() for n in (13, 3, 21)]
    worst_quantized, worst_unquantized = 0.0, 0.0
    for prompt, (logits, out) in zip(prompts, _run_recording(engine, prompts, max_tokens=6)):
        ours = torch.stack(logits)
        hf.set_attn_implementation(hf_fp8_attention)
        ref = _hf_logits(hf, prompt + out[:-1])[len(prompt) - 1:]
        hf.set_attn_implementation("sdpa")
        unquantized = _hf_logits(hf, prompt + out[:-1])[len(prompt) - 1:]
        assert ours.argmax(-1).tolist() == ref.argmax(-1).tolist() == out
        worst_quantized = max(worst_quantized, (ours - ref).abs().max().item())
        worst_unquantized = max(worst_unquantized, (ours - unquantized).abs().max().item())
    assert worst_quantized < 0.1 < worst_unquantized, (worst_quantized, worst_unquantized)
    assert_pool_idle(engine)


# ---- 4. refusals ------------------------------------------------------------------------------------------
def test_fp8_kv_cache_is_refused_for_deepseek_v41():
    with pytest.raises(ValueError, match=r"kv_cache_dtype='fp8'.*Llama-family.*Gemma-3.*DeepSeek-V4.1"):
        LLM("deepseek-v41-tiny", device="cpu", kv_cache_dtype="fp8")


def test_fp8_kv_cache_needs_a_backend_that_reads_it(smollm_dir):
    for backend in (OldSignatures(), object()):
        with pytest.raises(ValueError, match=r"does not read FP8 KV caches.*attention_backend='torch'"):
            load_model(smollm_dir, EngineConfig(device="cpu", dtype="float32", kv_cache_dtype="fp8"), backend=backend)


@pytest.mark.parametrize("value", ["fp8_e5m2", "int8", "FP8", "float8"])
def test_unknown_kv_cache_dtype_is_refused(value):
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be 'auto', one of \['fp8', 'fp8_e4m3'\]"):
        EngineConfig(device="cpu", kv_cache_dtype=value)
