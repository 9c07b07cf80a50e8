"""The fused DeepSeek-V4/V4.1 attention glue (layers/triton_v4_glue.v4_norm_rope) against the models' torch code it
replaces (`RopeRows` with the torch ops: V4's `RMSNorm`, `unweighted_rms_norm`, `InterleavedRope.cos_sin`,
`apply_rope`), on the same inputs.

Used by tests/test_v4_glue.py: in Triton's interpreter on the CPU (a subprocess with TRITON_INTERPRET=1; `python
tests/v4_glue_cases.py [kernels|models]` runs them and prints "all cases pass") and on CUDA (the `-m gpu` tests call
the same functions). Each check raises AssertionError naming what differs and returns the largest error measured.

What "equal" means: every element is the torch path's value, or (where the float32 value before the last rounding
sits within float32 noise of a rounding boundary of the model dtype) its neighbour — at most one ulp of the model
dtype apart, and such elements rare. The float32 noise: the sum of squares in another order, cos/sin of another
library, CUDA's approximate rsqrt in torch, FMA contraction of the rotation on the GPU (triton_v4_glue's docstring).
"""

from __future__ import annotations

import dataclasses
import sys

import torch

from openinfer.layers.basic import TORCH_OPS
from openinfer.models.deepseek_v4.model import InterleavedRope, RMSNorm, RopeRows
from openinfer.quantization.kv_formats import Fp8BlockCodec, Fp8DsMlaCodec, fp4_block_qdq

YARN = {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536, "beta_fast": 32, "beta_slow": 1,
        "rope_theta": 10000.0}


def fused_ops():
    from openinfer.layers.triton_ops import TRITON_OPS
    return TRITON_OPS


def next_ops():
    from openinfer.layers.triton_ops import TRITON_OPS_NEXT
    return TRITON_OPS_NEXT


def _ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    mant = {torch.float32: 23, torch.bfloat16: 7, torch.float16: 10}[dtype]
    return torch.ldexp(torch.ones_like(x), torch.frexp(x.abs().clamp_min(1e-30))[1] - 1 - mant)


def check_close(got: torch.Tensor, ref: torch.Tensor, name: str, max_share: float = 0.02) -> dict:
    """`got` is `ref` but for elements at most one ulp of the dtype away (plus float32 noise where rotated channels
    cancel: 2^-20 of the row's largest value), and those (in a narrower dtype than float32) at most `max_share` of
    all."""
    g, r = got.float().reshape(-1, got.shape[-1]), ref.float().reshape(-1, ref.shape[-1])
    noise = r.abs().amax(-1, keepdim=True) * 2.0 ** -20
    diff = (g - r).abs()
    assert torch.isfinite(g).all(), f"{name}: non-finite values"
    bad = diff > _ulp(r, ref.dtype) + noise
    assert not bad.any(), (f"{name}: {int(bad.sum())} elements more than one ulp apart (largest difference "
                           f"{diff.max().item():.3e})")
    share = (diff > 0).float().mean().item()
    # float32 results: a norm factor one ulp apart moves the whole row by an ulp, so only the bound above holds
    assert share <= max_share or ref.dtype == torch.float32, f"{name}: {share:.2%} of the elements differ (at most {max_share:.0%} expected)"
    return {"max_abs": diff.max().item(), "share_differing": share}


def check_norm_rope(ops, device, dtype, T: int, H: int, D: int, rope_dim: int, seed: int = 0,
                    cs_dtype: torch.dtype | None = None) -> dict:
    """Every call shape the models make, on random rows at scattered positions: weighted norm then RoPE (kv), the
    unweighted norm then RoPE (V4's query heads), RoPE alone (V4.1's queries, the indexer's), the inverse RoPE (the
    output) and the weighted norm alone (q_a_norm, the layer norms); cos/sin in `cs_dtype` (V4: the model dtype;
    V4.1: float32)."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    cs_dtype = cs_dtype or dtype
    rope = InterleavedRope(YARN, rope_dim, 1 << 20).to(device)
    rope.reset(torch.device(device))
    positions = torch.randint(0, 1 << 20, (T,), generator=g).to(device)
    positions[: min(T, 3)] = torch.tensor([0, 1, 65535])[: min(T, 3)].to(device)
    norm = RMSNorm(D, 1e-6).to(device)
    norm.weight.data = (1 + 0.3 * torch.randn(D, generator=g)).to(device)       # float32, as the models keep it
    x = (torch.randn(T, H, D, generator=g) * 3).to(device, dtype)
    x2 = x[:, 0].contiguous()
    fused_norm = RMSNorm(D, 1e-6, ops).to(device)
    fused_norm.weight.data = norm.weight.data
    ref_at = RopeRows(rope, positions, cs_dtype, TORCH_OPS)
    got_at = RopeRows(rope, positions, cs_dtype, ops)
    errs = {}
    pairs = {
        "kv: norm + rope": (lambda at, n: at(x2, n)),
        "q heads: unweighted norm + rope": (lambda at, n: at(x, 1e-6)),
        "queries: rope": (lambda at, n: at(x)),
        "output: inverse rope": (lambda at, n: at(x, inverse=True)),
        "norm alone": (lambda at, n: n(x2)),
        "norm alone, [T, H, D]": (lambda at, n: n(x)),
    }
    for name, call in pairs.items():
        ref = call(ref_at, norm)
        got = call(got_at, fused_norm)
        assert got.shape == ref.shape and got.dtype == ref.dtype, f"{name}: {got.shape} {got.dtype} vs {ref.shape}"
        errs[name] = check_close(got, ref, f"{name} ({dtype}, T={T} H={H} D={D} rope={rope_dim})")
    if D % 32 == 0 and D & (D - 1) == 0:      # V4.1's window keys as its ring stores them (FP8, E8M0 per 32)
        codec = Fp8BlockCodec(32)
        got, plain = got_at(x2, fused_norm, codec=codec), got_at(x2, fused_norm)
        ref, ref_plain = ref_at(x2, norm, codec=codec), ref_at(x2, norm)
        errs["kv: norm + rope, FP8 rows"] = check_close(plain, ref_plain, f"kv before FP8 ({dtype})")
        assert torch.equal(got, codec.encode(plain)), "FP8 rows: not the codec's bytes of the op's own values"
        same = (plain == ref_plain).all(-1)
        assert torch.equal(got[same], ref[same]), "FP8 rows: bytes differ where the values are equal"
        # V4.1's indexer queries: RoPE, then FP4-rounded (E8M0 scale per 32)
        got, plain = got_at(x, fp4_group=32), got_at(x)
        ref, ref_plain = ref_at(x, fp4_group=32), ref_at(x)
        errs["queries: rope, FP4-rounded"] = check_close(plain, ref_plain, f"queries before FP4 ({dtype})")
        assert torch.equal(got, fp4_block_qdq(plain, 32, "e8m0")), "FP4 queries: not fp4_block_qdq of the op's values"
        same = (plain == ref_plain).all(-1)
        assert torch.equal(got[same], ref[same]), "FP4 queries: differ where the values before rounding are equal"
    # a strided view of rows (the model's q_b output viewed as heads; CP's rows of this rank)
    sub = torch.arange(0, T, 2, device=device)
    errs["take"] = check_close(got_at.take(sub)(x[sub], 1e-6), ref_at.take(sub)(x[sub], 1e-6), f"take ({dtype})")
    return errs


def check_fp8_rows(ops, device, seed: int = 0) -> dict:
    """The op's FP8 packing alone (no norm, no RoPE) against `Fp8BlockCodec(32).encode`, byte for byte, over values
    that reach every branch: groups of very different scales (the scale's floor, huge and tiny amax), E4M3
    subnormals, exact rounding ties, zeros and negative zeros."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(6, 128, generator=g) * torch.logspace(-9, 4, 6)[:, None]
    x[0, :32] = 0.0
    x[0, 32:64] = -0.0
    x[1, :32] = torch.arange(32) * 2.0 ** -9 * 0.5 * (1e-4 / 448)           # ties below the smallest subnormal
    x[2, :16] = torch.tensor([448.0, -448.0, 1.0625, 1.1875, 0.0146484375, 2 ** -10, 3 * 2 ** -10, 2 ** -6] * 2)
    x[3, 64:96] *= 1e6
    x = x.to(device)
    got = ops.v4_norm_rope(x, fp8_block=32)
    ref = Fp8BlockCodec(32).encode(x)
    assert torch.equal(got, ref), f"FP8 rows: {int((got != ref).sum())} bytes differ from the codec's"
    return {"bytes": got.numel()}


def check_fp4_qdq(ops, device, seed: int = 0) -> dict:
    """The op's FP4 rounding alone against `fp4_block_qdq(x, 32, "e8m0")`, bit for bit: every E2M1 tie (0.25, 0.75,
    1.25, 1.75, 2.5, 3.5, 5 times the scale), values past 6 x scale, zeros, negative zeros, the scale's floor."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randn(5, 64, generator=g) * torch.logspace(-30, 3, 5)[:, None]
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, -2.5, -5.0, 0.0, -0.0, 5.5, 4.5, 3.0])
    x[0, :16], x[0, 16:32] = ties, -ties                  # amax 6: scale 1
    x[1, 32:64] = 0.0
    x = x.to(device)
    for dtype in (torch.float32, torch.bfloat16):
        got, ref = ops.v4_norm_rope(x.to(dtype), fp4_group=32), fp4_block_qdq(x.to(dtype), 32, "e8m0")
        assert torch.equal(got, ref), f"FP4 rounding ({dtype}): {int((got != ref).sum())} values differ"
    return {"values": x.numel()}


def check_kv_ring(ops, device, dtype, T: int, n_ring: int, R: int, D: int, rope_dim: int, fp8: bool = False,
                  seed: int = 0, cs_dtype: torch.dtype | None = None, slots: int = 5, ds_mla: bool = False) -> dict:
    """`ops.v4_kv_ring` (the window keys' norm + RoPE with the decode rows' ring write in its epilogue) against
    `ops.v4_norm_rope` then the models' torch write `ring[slots, positions % R] = kv[:n]` (V4: `.to(ring.dtype)`; V4.1:
    the FP8 rows; `ds_mla`: V4's FlashMLA rows, `Fp8DsMlaCodec.encode`): the returned rows and every byte of the ring
    equal, rows past the decode rows and other slots and
    ring rows untouched; and the rows within one rounding of the torch path (`RopeRows` with TORCH_OPS). Positions
    past R (the ring wraps), slots in any order."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    cs_dtype = cs_dtype or dtype
    rope = InterleavedRope(YARN, rope_dim, 1 << 20).to(device)
    rope.reset(torch.device(device))
    positions = torch.randint(0, 1 << 20, (T,), generator=g)
    positions[: min(T, 3)] = torch.tensor([0, R - 1, R])[: min(T, 3)]
    positions = positions.to(device)
    norm = RMSNorm(D, 1e-6).to(device)
    norm.weight.data = (1 + 0.3 * torch.randn(D, generator=g)).to(device)
    x = (torch.randn(T, D, generator=g) * 3).to(device, dtype)
    slot_ids = torch.randperm(slots, generator=g)[:n_ring].to(device)
    codec = Fp8BlockCodec(32) if fp8 else None
    ring_codec = Fp8DsMlaCodec.for_head(D, rope_dim) if ds_mla else None
    width = D + D // 32 if fp8 else (ring_codec.stored_dim(D) if ds_mla else D)
    if fp8 or ds_mla:
        ring = torch.randint(0, 256, (slots, R, width), generator=g, dtype=torch.uint8).to(device)
    else:
        ring = torch.randn(slots, R, width, generator=g).to(device, dtype)
    got_ring, ref_ring = ring.clone(), ring.clone()
    at = RopeRows(rope, positions, cs_dtype, ops)
    got = at(x, norm, codec=codec, ring=(got_ring, slot_ids), ring_codec=ring_codec)
    ref = at(x, norm, codec=codec)               # the same op without the ring, then the models' torch write
    ref_ring[slot_ids, positions[:n_ring] % R] = (ref[:n_ring].to(ring.dtype) if ring_codec is None
                                                  else ring_codec.encode(ref[:n_ring]))
    name = f"kv ring ({dtype}, T={T} n={n_ring} R={R} D={D} fp8={fp8} ds_mla={ds_mla})"
    assert torch.equal(got, ref), f"{name}: the rows differ from v4_norm_rope's"
    changed = int((got_ring != ring).any(-1).sum())
    assert torch.equal(got_ring, ref_ring), (f"{name}: {int((got_ring != ref_ring).any(-1).sum())} ring rows differ "
                                             f"from the torch write ({changed} rows written)")
    plain = RopeRows(rope, positions, cs_dtype, TORCH_OPS)(x, norm)
    mine = at(x, norm)
    err = check_close(mine, plain, f"{name} against the torch path")
    return {"ring_rows_written": changed, **err}


def ring_cases(ops, device: str) -> list:
    return [
        ("kv ring, fp32", lambda: check_kv_ring(ops, device, torch.float32, 5, 3, 7, 64, 16)),
        ("kv ring, bf16, all rows decode", lambda: check_kv_ring(ops, device, torch.bfloat16, 4, 4, 6, 32, 8, seed=1)),
        ("kv ring, bf16, odd half width", lambda: check_kv_ring(ops, device, torch.bfloat16, 6, 2, 5, 48, 16, seed=2)),
        ("kv ring, no decode rows", lambda: check_kv_ring(ops, device, torch.bfloat16, 3, 0, 4, 32, 8, seed=3)),
        ("kv ring, bf16 FP8 rows, float32 cos/sin (V4.1)",
         lambda: check_kv_ring(ops, device, torch.bfloat16, 6, 5, 9, 64, 16, fp8=True, seed=4, cs_dtype=torch.float32)),
        ("kv ring, fp32 FP8 rows, one row", lambda: check_kv_ring(ops, device, torch.float32, 1, 1, 3, 128, 64, fp8=True,
                                                                  seed=5, cs_dtype=torch.float32)),
    ] + ds_mla_ring_cases(ops, device)


def ds_mla_ring_cases(ops, device: str) -> list:
    """V4's window keys into a ring of FlashMLA rows (kv_cache_dtype="fp8_ds_mla")."""
    return [
        ("kv ring, fp32 FlashMLA rows", lambda: check_kv_ring(ops, device, torch.float32, 5, 3, 7, 64, 16, seed=6,
                                                              ds_mla=True)),
        ("kv ring, bf16 FlashMLA rows, tiny V4 width", lambda: check_kv_ring(ops, device, torch.bfloat16, 4, 4, 6, 32,
                                                                             8, seed=7, ds_mla=True)),
    ]


def flash_ring_cases(ops, device: str, T: int) -> list:
    """The Flash window keys (512 wide, 64 RoPE channels; V4.1's as FP8 rows) into a ring of 128 + 7 rows."""
    return [
        ("V4 flash kv ring", lambda: check_kv_ring(ops, device, torch.bfloat16, T, T, 135, 512, 64, seed=T,
                                                   slots=max(T, 2))),
        ("V4.1 flash kv ring, FP8", lambda: check_kv_ring(ops, device, torch.bfloat16, T, max(T - 1, 1), 135, 512, 64,
                                                          fp8=True, seed=T, cs_dtype=torch.float32, slots=max(T, 2))),
        ("V4 flash kv ring, FlashMLA rows", lambda: check_kv_ring(ops, device, torch.bfloat16, T, T, 135, 512, 64,
                                                                  seed=T, slots=max(T, 2), ds_mla=True)),
    ]


def check_compressor_rows(ops, device, dtype, T: int, hidden: int, dim: int, ratio: int, overlapping: bool,
                          bias_dtype: torch.dtype = torch.float32, seed: int = 0) -> dict:
    """`ops.v4_compressor_rows` through V4's `Compressor.rows` against the same module's torch code (`TORCH_OPS`), on
    the same weights: every float32 bit equal. The position bias float32 (as the models keep it: the sum in float32)
    or in the model dtype (the sum rounded to it); positions in every window slot, past 2^20."""
    from openinfer.models.deepseek_v4.model import OverlappingCompressor, RunningCompressor

    g = torch.Generator(device="cpu").manual_seed(seed)
    kind = OverlappingCompressor if overlapping else RunningCompressor
    ref_mod, got_mod = kind(hidden, dim, ratio, 1e-6), kind(hidden, dim, ratio, 1e-6, ops)
    for m in (ref_mod, got_mod):
        m.to(device, dtype)
    ref_mod.position_bias.data = torch.randn(ratio, ref_mod.width, generator=g).to(device, bias_dtype)
    # kv and gate stacked in one projection: the op reads the halves of its output rows (strided views)
    ref_mod.kv_gate_proj.weight.data = torch.cat([torch.randn(ref_mod.width, hidden, generator=g) / hidden ** 0.5
                                                  for _ in ("kv", "gate")]).to(device, dtype)
    got_mod.load_state_dict(ref_mod.state_dict())
    got_mod.position_bias.data = ref_mod.position_bias.data
    x = (torch.randn(T, hidden, generator=g) * 2).to(device, dtype)
    positions = torch.randint(0, 1 << 21, (T,), generator=g)
    positions[: min(T, ratio)] = torch.arange(min(T, ratio))
    positions = positions.to(device)
    ref, got = ref_mod.rows(x, positions), got_mod.rows(x, positions)
    name = f"compressor rows ({dtype}, bias {bias_dtype}, T={T} width={ref_mod.width} ratio={ratio})"
    assert got.dtype == ref.dtype == torch.float32 and got.shape == ref.shape, f"{name}: {got.shape} {got.dtype}"
    diff = got != ref
    assert not diff.any(), f"{name}: {int(diff.sum())} values differ (largest {(got - ref).abs().max().item():.3e})"
    return {"values": got.numel()}


def check_entry_rows(ops, device, T: int, W: int, n: int, epb: int, dtype=torch.int32, seed: int = 0) -> dict:
    """`ops.entry_rows` against `entry_index(tables, arange(n).expand(T, n), epb)`, on a strided view of a wider
    block table (the runner's tables are the first columns of a padded one), every value equal."""
    from openinfer.models.deepseek_v4.model import entry_index

    g = torch.Generator(device="cpu").manual_seed(seed)
    wide = torch.randint(0, 5000, (T, W + 3), generator=g).to(device, dtype)
    tables = wide[:, :W]
    got = ops.entry_rows(tables, n, epb)
    ref = entry_index(tables, torch.arange(n, device=device).expand(T, -1), epb)
    assert got.dtype == ref.dtype and got.shape == ref.shape, f"entry rows: {got.shape} {got.dtype} vs {ref.shape}"
    assert torch.equal(got, ref), f"entry rows (T={T} n={n} epb={epb}): {int((got != ref).sum())} differ"
    return {"values": got.numel()}


def decode_glue_cases(ops, device: str) -> list:
    """The compressor rows and the entry rows, at the tiny models' shapes and some wider ones."""
    return [
        ("compressor rows, CSA, bf16", lambda: check_compressor_rows(ops, device, torch.bfloat16, 9, 64, 16, 4, True)),
        ("compressor rows, HCA, bf16", lambda: check_compressor_rows(ops, device, torch.bfloat16, 5, 64, 16, 8, False,
                                                                     seed=1)),
        ("compressor rows, bf16 bias", lambda: check_compressor_rows(ops, device, torch.bfloat16, 6, 32, 24, 4, True,
                                                                     bias_dtype=torch.bfloat16, seed=2)),
        ("compressor rows, fp32", lambda: check_compressor_rows(ops, device, torch.float32, 3, 48, 40, 4, True,
                                                                seed=3)),
        ("compressor rows, one row, width past a block", lambda: check_compressor_rows(
            ops, device, torch.bfloat16, 1, 16, 600, 4, False, seed=4)),
        ("entry rows", lambda: check_entry_rows(ops, device, 3, 4, 10, 4)),
        ("entry rows, one block", lambda: check_entry_rows(ops, device, 2, 1, 1, 32, seed=1)),
        ("entry rows, int64, long", lambda: check_entry_rows(ops, device, 4, 5, 600, 128, torch.int64, seed=2)),
    ]


def flash_decode_glue_cases(ops, device: str, T: int) -> list:
    """Flash widths: hidden 4096, CSA compressor 2 x 512 (ratio 4), its indexer 2 x 128, HCA 512 (ratio 128); entry
    rows of 1M-token contexts (256K CSA entries, 64 per block)."""
    return [
        ("flash CSA rows", lambda: check_compressor_rows(ops, device, torch.bfloat16, T, 4096, 512, 4, True, seed=T)),
        ("flash indexer rows", lambda: check_compressor_rows(ops, device, torch.bfloat16, T, 4096, 128, 4, True,
                                                             seed=T + 1)),
        ("flash HCA rows", lambda: check_compressor_rows(ops, device, torch.bfloat16, T, 4096, 512, 128, False,
                                                         seed=T + 2)),
        ("1M-context entry rows", lambda: check_entry_rows(ops, device, T, 4096, 1 << 18, 64, seed=T)),
    ]


def kernel_cases(ops, device: str) -> list:
    return [
        ("FP4 rounding", lambda: check_fp4_qdq(ops, device)),
        ("FP8 rows", lambda: check_fp8_rows(ops, device)),
        ("fp32, pow2 width", lambda: check_norm_rope(ops, device, torch.float32, 5, 3, 64, 16)),
        ("bf16, pow2 width", lambda: check_norm_rope(ops, device, torch.bfloat16, 7, 4, 32, 8, seed=1)),
        ("bf16, odd half width", lambda: check_norm_rope(ops, device, torch.bfloat16, 3, 2, 48, 16, seed=2)),
        ("bf16, rope over all channels", lambda: check_norm_rope(ops, device, torch.bfloat16, 4, 1, 16, 16, seed=3)),
        ("bf16, float32 cos/sin (V4.1)", lambda: check_norm_rope(ops, device, torch.bfloat16, 6, 3, 64, 16, seed=4,
                                                                 cs_dtype=torch.float32)),
        ("fp32, one row", lambda: check_norm_rope(ops, device, torch.float32, 1, 1, 24, 8, seed=5)),
    ]


def flash_cases(ops, device: str, T: int) -> list:
    """The V4-Flash / V4.1-Flash call shapes: 64 query heads of 512 with 64 RoPE channels, the index queries (64 of
    128), q_lora_rank 1024 (V4) and 1536 (V4.1) under the norm, hidden 4096 / 5120 (the layer norms)."""
    return [
        ("V4 flash heads", lambda: check_norm_rope(ops, device, torch.bfloat16, T, 64, 512, 64, seed=T)),
        ("V4.1 flash heads", lambda: check_norm_rope(ops, device, torch.bfloat16, T, 64, 512, 64, seed=T,
                                                     cs_dtype=torch.float32)),
        ("index heads", lambda: check_norm_rope(ops, device, torch.bfloat16, T, 64, 128, 64, seed=T + 1)),
        ("q_lora 1536", lambda: check_norm_rope(ops, device, torch.bfloat16, T, 1, 1536, 64, seed=T + 2)),
        ("hidden 5120", lambda: check_norm_rope(ops, device, torch.bfloat16, T, 1, 5120, 64, seed=T + 3)),
    ]


def check_tiny_models(device: str = "cpu", dtype: str = "float32", tol: float = 1e-4, same_tokens: bool = True,
                      op: str = "v4_norm_rope", engine_kwargs: dict | None = None) -> dict:
    """deepseek-v4-tiny and deepseek-v41-tiny through the engine with the runtime's ops without `v4_norm_rope` (the
    models' torch glue), and with it: the same greedy tokens, prompt and sampled logprobs within `tol`, over a
    batched prefill and batched decode steps that cross compression windows (4 tokens after prompts of 14 and 5:
    decode positions 14-16 and 5-7 close V4's HCA window (ratio 16: 15) and CSA windows (ratio 4: 15, 7), V4.1's at
    every step, and wrap the 16-row sliding window). `same_tokens` False (bf16 on a GPU,
    where a last-bit difference may flip a near-tie of the random model): the prompt logprobs within `tol`, the
    sampled ones up to the first token that differs, and the share of equal tokens reported.

    `op` "v4_kv_ring" ("v4_compressor_rows", "entry_rows", "moe_combine_add"): both runs with `v4_norm_rope`, one with
    that op and one
    without (the models' torch code). `engine_kwargs`: more EngineConfig fields (a small
    max_num_batched_tokens makes steps that mix decode rows and prefill chunks)."""
    from unittest import mock

    from openinfer import LLM, SamplingParams
    from openinfer.engine import llm_engine
    from openinfer.layers.triton_compressor import v4_compressor_rows
    from openinfer.layers.triton_moe_routing import moe_combine
    from openinfer.layers.triton_v4_glue import entry_rows, v4_kv_ring, v4_norm_rope

    make_kernels = llm_engine.make_kernels
    fused = {"v4_norm_rope": v4_norm_rope, "v4_kv_ring": v4_kv_ring, "v4_compressor_rows": v4_compressor_rows,
             "entry_rows": entry_rows, "moe_combine_add": moe_combine}[op]
    common = {"v4_norm_rope": v4_norm_rope} if op != "v4_norm_rope" else {}

    def glue_kernels(config):
        backend, base = make_kernels(config)
        return backend, dataclasses.replace(base, **common, **{op: fused})

    def torch_glue_kernels(config):      # the runtime's ops with the models' torch glue (TRITON_OPS includes the op)
        backend, base = make_kernels(config)
        return backend, dataclasses.replace(base, **common, **{op: None})

    prompts = [[(i * 7919 + 13 * k) % 120000 + 100 for i in range(n)] for k, n in enumerate((14, 5))]
    sp = SamplingParams(temperature=0, max_tokens=4, logprobs=2, prompt_logprobs=0, ignore_eos=True)
    errs = {}
    for model in ("deepseek-v4-tiny", "deepseek-v41-tiny"):
        runs = []
        for kernels in (torch_glue_kernels, glue_kernels):
            with mock.patch.object(llm_engine, "make_kernels", kernels):
                llm = LLM(model, device=device, dtype=dtype, enable_prefix_caching=False, **(engine_kwargs or {}),
                          **({"gpu_memory_utilization": 0.3} if device == "cuda" else {}))
                runs.append(llm.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False))
                llm.shutdown()
        worst, equal, total = 0.0, 0, 0
        for ref, got in zip(*runs):
            gt, rt = got.outputs[0].token_ids, ref.outputs[0].token_ids
            assert not same_tokens or gt == rt, f"{model}: greedy tokens differ"
            k = next((i for i, (a, b) in enumerate(zip(gt, rt)) if a != b), len(rt))
            equal, total = equal + k, total + len(rt)
            pairs = [(a[t].logprob, b[t].logprob) for a, b in zip(got.prompt_logprobs[1:], ref.prompt_logprobs[1:])
                     for t in b]
            pairs += [(a[t].logprob, b[t].logprob) for a, b in zip(got.outputs[0].logprobs[:k + 1],
                                                                   ref.outputs[0].logprobs[:k + 1]) for t in b if t in a]
            worst = max([worst] + [abs(a - b) for a, b in pairs])
        assert worst < tol or worst == tol == 0, f"{model}: logprobs differ by {worst:.2e} (bound {tol:.0e})"
        errs[model] = {"max_logprob_diff": worst, "equal_token_prefix_share": equal / total}
    return errs


def run(which: str = "kernels") -> list[str]:
    ops = fused_ops()
    cases = {
        "kernels": lambda: kernel_cases(ops, "cpu"),
        "models": lambda: [("tiny models", lambda: check_tiny_models())],
        "ring_kernels": lambda: ring_cases(next_ops(), "cpu"),
        # the same bytes in the ring: the logprobs equal exactly; then steps mixing decode rows and prefill chunks
        "ring_models": lambda: [("tiny models, kv ring", lambda: check_tiny_models(tol=0.0, op="v4_kv_ring")),
                                ("tiny models, kv ring, mixed steps", lambda: check_tiny_models(
                                    tol=0.0, op="v4_kv_ring", engine_kwargs={"max_num_batched_tokens": 8}))],
        "decode_glue_kernels": lambda: decode_glue_cases(next_ops(), "cpu"),
        # bit-exact ops: the logprobs equal exactly
        "decode_glue_models": lambda: [(f"tiny models, {op}", lambda op=op: check_tiny_models(tol=0.0, op=op))
                                       for op in ("v4_compressor_rows", "entry_rows")],
    }[which]()
    fails = []
    for name, case in cases:
        try:
            print(f"{name}: ok {case()}", flush=True)
        except AssertionError as e:
            fails.append(f"{name}: {e}")
    return fails


if __name__ == "__main__":
    from tests.triton_interpreter import patch_lang_once_per_launch

    patch_lang_once_per_launch()
    fails = run(*sys.argv[1:2])
    print("\n".join(fails) or "all cases pass")
