"""The W4A8 grouped GEMMs (openinfer/quantization/triton_w4a8.py: per 32-group, and folded per 128) against
`reference.grouped_gemm_a8`, and the
W4A16 grouped GEMM's `tl.dot_scaled` tiles against `reference.grouped_gemm`, on random small shapes: 1 x 32 and
1 x 128 activation groups, ragged routing with empty experts, K not a multiple of the activation group or of the
tile, weight groups whose scales differ by many binades.

Used by tests/test_quant_kernels_interpreted.py (Triton's interpreter on the CPU, a subprocess with
TRITON_INTERPRET=1); tests/test_gpu_quant.py holds the kernels to the same references on CUDA at full width.
What the interpreter cannot check, the GPU tests do: its float -> FP8 casts do not round to nearest even (so
here the GEMM gets rows quantized by `formats.quantize_activations`, through its `grouped_gemm_w4a8_quantized`
entry, not by the activation kernel), its fp32 -> bf16 casts truncate (the `tl.dot_scaled` case's bound allows
that), and it computes bf16 arithmetic on the raw uint16 bits (so the weight-only kernel's own decode, which
scales bf16 weight tiles, runs on the GPU only). Run directly it prints one line per case.
"""

from __future__ import annotations

import random
import sys

import torch

from openinfer.quantization import formats, reference
from openinfer.quantization import triton_w4a8


def every_code_weight(fmt: str, block: int, k: int, g: torch.Generator, device: str):
    """(weight [1, 64, K] stored as `fmt`, its E8M0 scales) holding every byte value — every E2M1 pair (MXFP4), every
    non-NaN E4M3 code (FP8) — with scales drawn over a wide range (2^-107 .. 2^72): the exact-decoding cases of the
    GPU tests (test_gpu_quant.py, test_gpu_dequant_gemm.py)."""
    if fmt == "mxfp4":
        weight = torch.arange(256, device=device, dtype=torch.uint8).repeat(64, k // 512)[None]
        scale = torch.randint(20, 200, (1, 64, k // 32), generator=g, device=device, dtype=torch.uint8)
    else:
        codes = torch.arange(256, device=device, dtype=torch.uint8).repeat(64, k // 256)
        codes[(codes & 0x7F) == 0x7F] = 0                                                     # no NaNs
        weight = codes.view(torch.float8_e4m3fn)[None]
        scale = torch.randint(20, 200, (1, -(-64 // block), k // block), generator=g, device=device,
                              dtype=torch.uint8)
    return weight, scale.view(torch.float8_e8m0fnu)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _routing(rng: random.Random, experts: int, rows: int) -> tuple[list[int], torch.Tensor]:
    """Random expert counts summing to `rows`, some experts empty; (counts, offs)."""
    cuts = sorted(rng.randint(0, rows) for _ in range(experts - 1))
    counts = [b - a for a, b in zip([0] + cuts, cuts + [rows])]
    return counts, torch.tensor(counts).cumsum(0).to(torch.int32)


def _experts(g: torch.Generator, e: int, n: int, k: int):
    w = torch.randn(e, n, k, generator=g) * 0.05
    w[:, :, :32] *= 2.0 ** 12                                # groups whose scales differ by 12 binades
    return formats.quantize_mxfp4(w)


def w4a8_case(rng: random.Random, act_block: int) -> float:
    """The W4A8 GEMM on FP8 rows (quantized by the reference) vs reference.grouped_gemm_a8, fp32 out: only the
    summation order differs, so 1e-5 holds it; rows past offs[-1] are not the GEMM's."""
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    e, n, k = rng.choice([(3, 48, 256), (4, 80, 64), (2, 16, 160)])
    m = rng.randint(1, 40)
    counts, offs = _routing(rng, e, m)
    weight, scale = _experts(g, e, n, k)
    spread = 2.0 ** torch.randint(-6, 7, (1, k // 32), generator=g).repeat_interleave(32, 1)   # per 32 of K
    rows = (torch.randn(m + 2, k, generator=g) * spread * rng.choice([0.01, 1.0, 30.0])).to(torch.bfloat16)
    rows[0, : min(k, act_block)] = 0                          # an all-zero group: the amax floor
    a, a_scale = formats.quantize_activations(rows, act_block)
    block_k = rng.choice([act_block] if act_block != 32 else [32, 64, 128])
    cfg = triton_w4a8.W4A8Config(rng.choice([16, 32]), rng.choice([16, 32, 64]), block_k, 4, 1)
    out = triton_w4a8.grouped_gemm_w4a8_quantized(a, a_scale, offs, weight, scale, act_block, torch.float32, cfg)
    ref = reference.grouped_gemm_a8(rows.float(), offs, weight, scale, "mxfp4", act_block)
    assert out.shape == (m + 2, n)
    rel = _rel(out[:m], ref[:m])
    assert rel < 1e-5, (rel, counts, cfg)
    return rel


def folded_case(rng: random.Random) -> float:
    """The folded W4A8 kernel's plain-Triton decode (the interpreter cannot run its inline PTX; the GPU tests hold
    the two bit for bit) on rows in its K order vs reference.grouped_gemm_a8 with 1 x 128 groups, fp32 out,
    weight groups up to FOLD_SPREAD binades below their block's largest, both products."""
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    e, n, k = rng.choice([(3, 48, 256), (4, 80, 128), (2, 16, 384)])
    m = rng.randint(1, 40)
    counts, offs = _routing(rng, e, m)
    w = torch.randn(e, n, k, generator=g) * 0.05
    w *= 2.0 ** -torch.randint(0, triton_w4a8.FOLD_SPREAD - 2, (1, 1, k // 32), generator=g).repeat_interleave(32, -1)
    weight, scale = formats.quantize_mxfp4(w)
    assert triton_w4a8.fold_exact(scale)
    spread = 2.0 ** torch.randint(-6, 7, (1, k // 32), generator=g).repeat_interleave(32, 1)
    rows = (torch.randn(m + 2, k, generator=g) * spread * rng.choice([0.01, 1.0, 30.0])).to(torch.bfloat16)
    a, a_scale = formats.quantize_activations(rows, 128)
    a = triton_w4a8.w4a8_order(a.view(torch.uint8)).view(torch.float8_e4m3fn)
    cfg = triton_w4a8.FoldedConfig(rng.choice([16, 32]), rng.choice([16, 32, 64]), 4, 1,
                                   swap_ab=rng.random() < 0.5, use_asm=False)
    out = triton_w4a8.grouped_gemm_w4a8_folded_quantized(a, a_scale, offs, weight, scale, torch.float32, cfg)
    ref = reference.grouped_gemm_a8(rows.float(), offs, weight, scale, "mxfp4", 128)
    assert out.shape == (m + 2, n)
    rel = _rel(out[:m], ref[:m])
    assert rel < 1e-5, (rel, counts, cfg)
    return rel


def dot_scaled_case(rng: random.Random) -> float:
    """The W4A16 grouped GEMM's `tl.dot_scaled` tiles (GroupedConfig.dot_scaled, plain and swapped) vs
    reference.grouped_gemm on bf16 rows: the weights decode exactly, so only the fp32 summation order and the
    final bf16 rounding differ."""
    from openinfer.quantization import triton_kernels

    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    e, n, k = rng.choice([(3, 48, 256), (4, 80, 64), (2, 16, 160)])
    m = rng.randint(1, 40)
    counts, offs = _routing(rng, e, m)
    weight, scale = _experts(g, e, n, k)
    rows = (torch.randn(m + 2, k, generator=g) * rng.choice([0.01, 1.0, 30.0])).to(torch.bfloat16)
    cfg = triton_kernels.GroupedConfig(rng.choice([16, 32]), rng.choice([16, 32, 64]), rng.choice([32, 64, 128]),
                                       4, 1, swap_ab=rng.random() < 0.5, dot_scaled=True)
    out = triton_kernels.grouped_gemm_with(rows, offs, weight, scale, "mxfp4", 32, cfg)
    assert out.shape == (m + 2, n) and out.dtype == torch.bfloat16
    ref = reference.grouped_gemm(rows.float(), offs, weight, scale, "mxfp4", 32)[:m]       # fp32, unrounded
    size = reference.grouped_gemm(rows.float().abs(), offs, _magnitudes(weight), scale,
                                  "mxfp4", 32)[:m]
    # the interpreter casts fp32 -> bf16 by truncation (< 1 ulp, 2^-7 relative), and the fp32 sums' order
    # differs (K * 2^-24 of the sum of magnitudes)
    err = (out[:m].float() - ref).abs()
    bound = 2.0 ** -7 * ref.abs() + k * 2.0 ** -24 * size
    assert bool((err <= bound).all()), ((err - bound).max().item(), counts, cfg)
    return _rel(out[:m], ref)


def _magnitudes(packed: torch.Tensor) -> torch.Tensor:
    """MXFP4 bytes with both codes' sign bits cleared: the weights' magnitudes."""
    return (packed.view(torch.uint8) & 0x77).view(packed.dtype)


def run(seed: int = 0, quick: bool = False) -> None:
    rng = random.Random(seed)
    reps = 3 if quick else 10
    cases = [("w4a8 act 1x32", lambda: w4a8_case(rng, 32)), ("w4a8 act 1x128", lambda: w4a8_case(rng, 128)),
             ("w4a8 folded", lambda: folded_case(rng)),
             ("w4a16 dot_scaled", lambda: dot_scaled_case(rng))]
    for name, case in cases:
        for _ in range(reps):
            print(f"{name}: rel {case():.2e}")
    print("all cases pass")


if __name__ == "__main__":
    from tests.triton_interpreter import patch_lang_once_per_launch

    patch_lang_once_per_launch()
    run(quick="--quick" in sys.argv)
