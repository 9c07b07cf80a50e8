"""The dequantize-then-cuBLAS routes (openinfer/quantization/dequant_gemm.py) against the reference on small random
shapes: the dequantization kernels bit for bit (FP8 with 32 x 32 and 128 x 128 blocks, edges not a multiple of the
block or the tile; MXFP4 experts, any subset of them; every E2M1 / E4M3 code), the routes within the bf16 GEMM's
bound on ragged routings with empty experts and chunks of one or several experts.

Used by tests/test_dequant_gemm.py (Triton's interpreter on the CPU, a subprocess with TRITON_INTERPRET=1). The
interpreter's float -> FP8 casts do not round to nearest even, so activations are rounded here by
`formats.quantize_activations` and the routes run with that rounding off (`quantize_input=False`, or the weight-only
`grouped_gemm_dequant`); tests/test_gpu_dequant_gemm.py checks the rounding inside the routes on CUDA. Run directly
it prints one line per case.
"""

from __future__ import annotations

import random
import sys

import torch

from openinfer.device_io import ReadOnce
from openinfer.quantization import dequant_gemm, formats, reference


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _routing(rng: random.Random, experts: int, rows: int) -> torch.Tensor:
    """offs of random counts summing to `rows` over `experts`, about a third of the experts (at least one, the
    first or the last sometimes) empty, the rest with at least one row each."""
    empty = set(rng.sample(range(experts), max(1, experts // 3)))
    live = [i for i in range(experts) if i not in empty]
    counts = [0] * experts
    for i in live:
        counts[i] = 1
    for _ in range(rows - len(live)):
        counts[rng.choice(live)] += 1
    return torch.tensor(counts).cumsum(0).to(torch.int32)


def _rounded_rows(g: torch.Generator, m: int, k: int, block: int) -> torch.Tensor:
    x = (torch.randn(m, k, generator=g) * 3).to(torch.bfloat16)
    return formats.dequantize_activations(*formats.quantize_activations(x, block), block).to(torch.bfloat16)


def fp8_dequant_case(rng: random.Random) -> None:
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    block = rng.choice([32, 128])
    n, k = rng.choice([(70, 100), (33, 160), (130, 256)])
    w, s = formats.quantize_fp8(torch.randn(n, k, generator=g) * 2.0 ** rng.randint(-8, 8), block)
    got = dequant_gemm.dequantize_to_bf16(w, s, "fp8", block)
    assert torch.equal(got, reference.dequantize_weight(w, s, "fp8", block).to(torch.bfloat16)), (n, k, block)


def mxfp4_dequant_case(rng: random.Random) -> None:
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    e, n, k = rng.choice([(3, 40, 96), (5, 17, 64), (2, 8, 320)])
    w = torch.randn(e, n, k, generator=g) * 0.05
    w[:, :, :32] *= 2.0 ** 12                                # groups whose scales differ by 12 binades
    wq, sq = formats.quantize_mxfp4(w)
    ids = rng.sample(range(e), rng.randint(1, e))
    got = dequant_gemm.dequantize_to_bf16(wq, sq, "mxfp4", 32, torch.tensor(ids, dtype=torch.int32))
    ref = reference.dequantize_weight(wq, sq, "mxfp4", 32)[ids].to(torch.bfloat16)
    assert torch.equal(got, ref), (e, n, k, ids)


def every_code_case() -> None:
    """Every byte (every E2M1 pair; every non-NaN E4M3 code) with scales over a wide range, bit for bit."""
    g = torch.Generator().manual_seed(0)
    packed = torch.arange(256, dtype=torch.uint8).repeat(8, 1)[None]                   # [1, 8, 256] -> K 512
    scale = torch.randint(20, 200, (1, 8, 512 // 32), generator=g, dtype=torch.uint8)
    scale[0, :, :3] = torch.tensor([1, 2, 250], dtype=torch.uint8)      # 0.5 x 2^-126 is the bf16 subnormal 2^-127
    scale = scale.view(torch.float8_e8m0fnu)
    got = dequant_gemm.dequantize_to_bf16(packed, scale, "mxfp4", 32)
    assert torch.equal(got, reference.dequantize_weight(packed, scale, "mxfp4", 32).to(torch.bfloat16))
    codes = torch.arange(256, dtype=torch.uint8).repeat(8, 1)
    codes[(codes & 0x7F) == 0x7F] = 0                                                   # no NaNs
    scale = torch.randint(100, 150, (1, 8), generator=g, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    w = codes.view(torch.float8_e4m3fn)
    got = dequant_gemm.dequantize_to_bf16(w, scale, "fp8", 32)
    assert torch.equal(got, reference.dequantize_weight(w, scale, "fp8", 32).to(torch.bfloat16))


def fp8_linear_case(rng: random.Random) -> float:
    """The route on rounded activations vs reference.fp8_linear: bf16 operands exact, so only the bf16 output
    rounding and the summation order differ (the GPU tests' 1e-2 bound)."""
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    block = rng.choice([32, 128])
    m, n, k = rng.randint(1, 40), rng.choice([48, 130]), rng.choice([96, 256])
    w, s = formats.quantize_fp8(torch.randn(n, k, generator=g) * 0.05, block)
    x = _rounded_rows(g, m, k, block)
    out = dequant_gemm.fp8_linear_dequant(x, w, s, block, quantize_input=False)
    ref = reference.fp8_linear(x, w, s, block)                 # rounding rounded values changes nothing
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    rel = _rel(out, ref)
    assert rel < 1e-2, rel
    return rel


def grouped_case(rng: random.Random, fmt: str) -> float:
    """grouped_gemm_dequant vs reference.grouped_gemm with empty experts, in one chunk or chunks of one and two
    experts (scratch_bytes: with 3+ live experts, a chunk that starts past row 0), rows past offs[-1] not the
    GEMM's."""
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    block = 32 if fmt == "mxfp4" else rng.choice([32, 128])
    e, n, k = rng.choice([(5, 48, 64), (7, 32, 128), (6, 64, 96)])
    m = rng.randint(e, 60)           # every live expert gets a row; chunks of two split
    offs = _routing(rng, e, m)
    w = torch.randn(e, n, k, generator=g) * 0.05
    weight, scale = formats.quantize_mxfp4(w) if fmt == "mxfp4" else formats.quantize_fp8(w, block)
    rows = (torch.randn(m + 2, k, generator=g)).to(torch.bfloat16)
    ref = reference.grouped_gemm(rows, offs, weight, scale, fmt, block)
    rels = []
    host = ReadOnce(offs)       # read on the first call, the same values reused by the next (a MoE's two GEMMs)
    for experts_per_chunk in (1, 2, e):
        out = dequant_gemm.grouped_gemm_dequant(rows, offs, weight, scale, fmt, block,
                                                scratch_bytes=experts_per_chunk * n * k * 2, host_offs=host)
        assert out.shape == (m + 2, n)
        rels.append(_rel(out[:m], ref[:m]))
        assert rels[-1] < 1e-2, (rels, offs.tolist())
    return max(rels)


def grouped_linear_case(rng: random.Random) -> float:
    """grouped_linear_dequant (V4's block-diagonal `wo_a`) vs each group's rows times its rows of the dequantized
    weight, groups whole tiles or narrower than one (a group's rows then share a tile's scale row)."""
    g = torch.Generator().manual_seed(rng.randrange(1 << 30))
    block = rng.choice([32, 128])
    groups, per_group, k = rng.choice([(2, 64, 96), (4, 48, 64), (3, 32, 128), (8, 16, 64)])
    t = rng.randint(1, 9)
    w, s = formats.quantize_fp8(torch.randn(groups * per_group, k, generator=g) * 0.05, block)
    x = torch.randn(t, groups, k, generator=g).to(torch.bfloat16)
    dense = reference.dequantize_weight(w, s, "fp8", block).view(groups, per_group, k)
    ref = torch.einsum("tgk,gnk->tgn", x.float(), dense)
    out = dequant_gemm.grouped_linear_dequant(x, w, s, block)
    assert out.shape == (t, groups, per_group) and out.dtype == torch.bfloat16
    rel = _rel(out, ref)
    assert rel < 1e-2, rel
    return rel


def run(seed: int = 0, quick: bool = False) -> None:
    rng = random.Random(seed)
    reps = 3 if quick else 10
    every_code_case()
    print("every code: exact")
    for name, case in (("fp8 dequant", lambda: fp8_dequant_case(rng)),
                       ("mxfp4 dequant", lambda: mxfp4_dequant_case(rng))):
        for _ in range(reps):
            case()
        print(f"{name}: exact x{reps}")
    cases = [("fp8_linear_dequant", lambda: fp8_linear_case(rng)),
             ("grouped_linear_dequant", lambda: grouped_linear_case(rng)),
             ("grouped_gemm_dequant mxfp4", lambda: grouped_case(rng, "mxfp4")),
             ("grouped_gemm_dequant fp8", lambda: grouped_case(rng, "fp8"))]
    for name, case in cases:
        for _ in range(reps):
            print(f"{name}: rel {case():.2e}")
    print("all cases pass")


if __name__ == "__main__":
    from tests.triton_interpreter import patch_lang_once_per_launch

    patch_lang_once_per_launch()
    run(quick="--quick" in sys.argv)
