"""GPU tests of the dequantize-to-bf16 routes (`pytest -m gpu tests/test_gpu_dequant_gemm.py`, on the device):
the dequantization kernels bit for bit against the reference at V4 (128 x 128) and V4.1 (32 x 32) FP8 shapes and
MXFP4 experts, the routes against `openinfer.quantization.reference` at DeepSeek's shapes with empty experts and
chunked scratch, the dispatchers with the route forced, and CUDA-graph capture of both routes."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from openinfer.quantization import dequant_gemm, formats, kernel_choice, reference  # noqa: E402
from openinfer.quantization import triton_kernels as tk  # noqa: E402
from tests.quant_kernel_cases import every_code_weight  # noqa: E402
from openinfer.quantization import triton_w4a8  # noqa: E402

# V4.1-Flash's FP8 linears (N, K) with 32 x 32 blocks; V4-Flash's with 128 x 128 (dim 4096)
V41_FP8_SHAPES = {"wq_a": (1280, 5120), "wq_b": (32768, 1280), "wkv": (512, 5120), "wo_b": (5120, 8192),
                  "shared_w13": (2304, 5120), "shared_w2": (5120, 2304), "index_wq_b": (4096, 1280)}
V4_FP8_SHAPES = {"wq_a": (1024, 4096), "wo_b": (4096, 8192), "shared_w2": (4096, 2048)}
# routed experts (count, hidden, intermediate, activation group)
EXPERT_SHAPES = {"v4_flash": (256, 4096, 2048, 128), "v41_flash": (384, 5120, 2304, 32)}


def _gen():
    return torch.Generator(device="cuda").manual_seed(random.randrange(1 << 30))


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _offs(counts):
    return torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)


def _random_mxfp4(e, n, k, g):
    w = torch.randint(0, 256, (e, n, k // 2), generator=g, device="cuda", dtype=torch.uint8)
    s = torch.randint(118, 125, (e, n, k // 32), generator=g, device="cuda", dtype=torch.uint8)
    return w, s.view(torch.float8_e8m0fnu)


def _random_counts(rng, e, m):
    """Random counts summing to m over e experts, about half of them empty."""
    live = rng.sample(range(e), max(1, e // 2))
    counts = [0] * e
    for _ in range(m):
        counts[rng.choice(live)] += 1
    return counts


@pytest.mark.parametrize("block, shapes", [(32, V41_FP8_SHAPES), (128, V4_FP8_SHAPES)])
def test_fp8_dequant_is_bit_exact(block, shapes):
    g = _gen()
    for n, k in shapes.values():
        w, s = formats.quantize_fp8(torch.randn(n, k, generator=g, device="cuda") * 0.05, block)
        got = dequant_gemm.dequantize_to_bf16(w, s, "fp8", block)
        assert torch.equal(got, formats.dequantize_fp8(w, s, block).to(torch.bfloat16)), (n, k)


@pytest.mark.parametrize("fmt, block", [("mxfp4", 32), ("fp8", 32), ("fp8", 128)])
def test_dequant_decodes_every_code_exactly(fmt, block):
    g = _gen()
    k = 512
    weight, scale = every_code_weight(fmt, block, k, g, "cuda")
    got = dequant_gemm.dequantize_to_bf16(weight, scale, fmt, block)
    assert torch.equal(got.float(), reference.dequantize_weight(weight, scale, fmt, block))


def test_mxfp4_expert_subset_dequant_is_bit_exact():
    g = _gen()
    e, n, k = 16, 512, 1024
    w, s = _random_mxfp4(e, n, k, g)
    ids = [3, 0, 15, 7]
    got = dequant_gemm.dequantize_to_bf16(w, s, "mxfp4", 32, torch.tensor(ids, dtype=torch.int32, device="cuda"))
    assert torch.equal(got.float(), formats.dequantize_mxfp4(w[ids], s[ids]))


@pytest.mark.parametrize("block, shapes", [(32, V41_FP8_SHAPES), (128, V4_FP8_SHAPES)])
@pytest.mark.parametrize("m", [1, 256, 4096])
def test_fp8_linear_dequant_matches_reference(block, shapes, m):
    """W8A8 values (activations rounded inside the route) against the reference, and against fp8_linear's
    bf16-core route, which multiplies the same operands."""
    g = _gen()
    for n, k in shapes.values():
        w, s = formats.quantize_fp8(torch.randn(n, k, generator=g, device="cuda") * 0.05, block)
        x = torch.randn(m, k, generator=g, device="cuda", dtype=torch.bfloat16)
        out = dequant_gemm.fp8_linear_dequant(x, w, s, block)
        assert out.shape == (m, n) and out.dtype == torch.bfloat16
        assert _rel(out, reference.fp8_linear(x, w, s, block)) < 1e-2, (n, k)
        same_operands = tk.fp8_bf16_gemm(tk.quantize_dequantize_activations(x, block), w, s, block,
                                         tk.fp8_bf16_config(m, n, k, block))
        assert _rel(out, same_operands) < 2e-3, (n, k)


@pytest.mark.parametrize("fmt, block", [("mxfp4", 32), ("fp8", 128), ("fp8", 32)])
@pytest.mark.parametrize("counts", [[0, 1, 0, 0], [1, 0, 3, 2], [0, 17, 0, 0], [40, 0, 129, 7], [300, 1, 0, 60],
                                    [0, 0, 0, 0]])
@pytest.mark.parametrize("experts_per_chunk", [1, 2, 4])
def test_grouped_gemm_dequant_matches_reference(counts, fmt, block, experts_per_chunk):
    g = _gen()
    n, k = 256, 512
    w = torch.randn(len(counts), n, k, generator=g, device="cuda") * 0.05
    weight, scale = formats.quantize_mxfp4(w) if fmt == "mxfp4" else formats.quantize_fp8(w, block)
    m = sum(counts)
    rows = torch.randn(m + 3, k, generator=g, device="cuda", dtype=torch.bfloat16)   # 3 rows past offs[-1]
    offs = _offs(counts)
    out = dequant_gemm.grouped_gemm_dequant(rows, offs, weight, scale, fmt, block,
                                            scratch_bytes=experts_per_chunk * n * k * 2)
    assert out.shape == (m + 3, n)
    if m:
        assert _rel(out[:m], reference.grouped_gemm(rows, offs, weight, scale, fmt, block)[:m]) < 1e-2


@pytest.mark.parametrize("model", sorted(EXPERT_SHAPES))
@pytest.mark.parametrize("tokens", [1, 700])
def test_grouped_gemm_a8_dequant_route_at_full_width(model, tokens, monkeypatch):
    """Both expert GEMMs of V4-Flash and V4.1-Flash at their widths, random routing with empty experts, through
    the dispatcher with the route forced (default scratch, and chunks of 7 experts) against the reference."""
    rng = random.Random(random.randrange(1 << 30))
    g = _gen()
    e, h, i, act_block = EXPERT_SHAPES[model]
    m = tokens * 6
    offs = _offs(_random_counts(rng, e, m))
    monkeypatch.setattr(kernel_choice, "EXPERT_KERNEL_BY_ROWS_PER_EXPERT", ((0, "bf16_dequant"),))
    for n, k in ((2 * i, h), (h, i)):
        weight, scale = _random_mxfp4(e, n, k, g)
        rows = torch.randn(m, k, generator=g, device="cuda", dtype=torch.bfloat16)
        ref = reference.grouped_gemm_a8(rows, offs, weight, scale, "mxfp4", act_block)
        assert _rel(triton_w4a8.grouped_gemm_a8(rows, offs, weight, scale, "mxfp4", act_block), ref) < 1e-2
        chunked = dequant_gemm.grouped_gemm_dequant(tk.quantize_dequantize_activations(rows, act_block), offs,
                                                    weight, scale, "mxfp4", act_block, scratch_bytes=7 * n * k * 2)
        assert _rel(chunked, ref) < 1e-2
        del weight, scale


@pytest.mark.parametrize("m", [1, 300, 3000])
def test_fp8_linear_dequant_route_forced(m, monkeypatch):
    g = _gen()
    w, s = formats.quantize_fp8(torch.randn(2304, 5120, generator=g, device="cuda") * 0.05, 32)
    x = torch.randn(m, 5120, generator=g, device="cuda", dtype=torch.bfloat16)
    monkeypatch.setattr(kernel_choice, "FP8_FINE_BLOCK_BY_M", ((0, "bf16_dequant"),))
    assert _rel(tk.fp8_linear(x, w, s, 32), reference.fp8_linear(x, w, s, 32)) < 1e-2


@pytest.mark.parametrize("experts_fit", [True, False])
def test_routes_captured_in_a_cuda_graph(experts_fit, monkeypatch):
    """Both dispatchers with the dequant route forced, captured once, replayed on new activations and new routings
    (with empty experts), each replay against the reference and the eager route. While capturing, `offs` cannot be
    read: the experts are dequantized whole when they fit the scratch, else the capturable W4A16 kernel runs."""
    g = _gen()
    e, n, k = 8, 256, 1024
    w8, s8 = formats.quantize_fp8(torch.randn(512, k, generator=g, device="cuda") * 0.05, 32)
    w4, s4 = _random_mxfp4(e, n, k, g)
    x = torch.randn(300, k, generator=g, device="cuda", dtype=torch.bfloat16)
    rows = torch.randn(24, k, generator=g, device="cuda", dtype=torch.bfloat16)
    offs = _offs([3, 0, 5, 0, 0, 16, 0, 0])
    monkeypatch.setattr(kernel_choice, "FP8_FINE_BLOCK_BY_M", ((0, "bf16_dequant"),))
    monkeypatch.setattr(kernel_choice, "EXPERT_KERNEL_BY_ROWS_PER_EXPERT", ((0, "bf16_dequant"),))
    monkeypatch.setattr(dequant_gemm, "SCRATCH_BYTES", (e if experts_fit else 2) * n * k * 2)
    assert dequant_gemm.fits_capture(w4, "mxfp4") == experts_fit

    def step():
        return tk.fp8_linear(x, w8, s8, 32), triton_w4a8.grouped_gemm_a8(rows, offs, w4, s4, "mxfp4", 32)

    step()                                          # compile outside the capture
    tk.grouped_gemm(rows, offs, w4, s4, "mxfp4", 32)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_lin, y_grp = step()
    for counts in ([24, 0, 0, 0, 0, 0, 0, 0], [1, 2, 3, 4, 5, 6, 0, 3], [0, 0, 0, 0, 0, 0, 0, 24]):
        x.copy_(torch.randn(x.shape, generator=g, device="cuda"))
        rows.copy_(torch.randn(rows.shape, generator=g, device="cuda"))
        offs.copy_(_offs(counts))
        graph.replay()
        assert _rel(y_lin, reference.fp8_linear(x, w8, s8, 32)) < 1e-2
        assert _rel(y_grp, reference.grouped_gemm_a8(rows, offs, w4, s4, "mxfp4", 32)) < 1e-2
        eager_lin, eager_grp = step()
        assert _rel(y_lin, eager_lin) < 2e-3 and _rel(y_grp, eager_grp) < 2e-3


@pytest.mark.parametrize("per_group, block", [(1024, 128), (64, 128), (1024, 32)])
@pytest.mark.parametrize("tokens", [1, 130, 2048])
def test_grouped_linear_dequant_matches_the_grouped_kernel_and_the_reference(per_group, block, tokens):
    """V4's block-diagonal `wo_a` (8 groups over 4096 columns; V4-Flash's 1024 rows per group, and groups narrower
    than a 128-row scale tile): the dequant route, the grouped W8A16 kernel `Fp8Linear.forward_groups` runs below
    it, and each group's rows times its rows of the dequantized weight in fp32."""
    from openinfer.layers.fp8_linear import Fp8Linear
    from openinfer.layers.triton_ops import TRITON_OPS

    g, k = 8, 4096
    gen = _gen()
    w, s = formats.quantize_fp8(torch.randn(g * per_group, k, generator=gen, device="cuda") * 0.05, block)
    x = torch.randn(tokens, g, k, generator=gen, device="cuda", dtype=torch.bfloat16)
    dense = reference.dequantize_weight(w, s, "fp8", block).view(g, per_group, k)
    ref = torch.einsum("tgk,gnk->tgn", x.float(), dense)
    lin = Fp8Linear(k, g * per_group, block, dataclasses.replace(TRITON_OPS, fp8_grouped_dequant=None)).cuda()
    lin.weight.data, lin.weight_scale.data = w, s
    kernel = lin.forward_groups(x)
    out = dequant_gemm.grouped_linear_dequant(x, w, s, block)
    assert out.shape == kernel.shape == (tokens, g, per_group)
    assert _rel(out, ref) < 1e-2 and _rel(kernel, ref) < 1e-2 and _rel(out, kernel) < 1e-2
