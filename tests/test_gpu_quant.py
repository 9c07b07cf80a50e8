"""GPU tests of the quantized-weight Triton kernels (`pytest -m gpu tests/test_gpu_quant.py`, on the device):
each against `openinfer.quantization.reference` on the same inputs, the activation quantization bit for bit,
and CUDA-graph replay against eager."""

from __future__ import annotations

import random

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from openinfer.quantization import formats, reference  # noqa: E402
from openinfer.quantization import triton_kernels as tk  # noqa: E402
from tests.quant_kernel_cases import every_code_weight  # noqa: E402


def _gen():
    return torch.Generator(device="cuda").manual_seed(random.randrange(1 << 30))   # fresh inputs each run


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _offs(counts):
    return torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)


def _experts(fmt, e, n, k, block, g):
    w = torch.randn(e, n, k, generator=g, device="cuda") * 0.05
    return formats.quantize_mxfp4(w) if fmt == "mxfp4" else formats.quantize_fp8(w, block)


@pytest.mark.parametrize("m, k, block", [(1, 4096, 128), (37, 96, 32), (300, 4096, 128), (5, 300, 128),
                                         (64, 1024, 32)])
def test_activation_quant_is_bit_exact(m, k, block):
    g = _gen()
    x = (torch.randn(m, k, generator=g, device="cuda") * 3).to(torch.bfloat16)
    x[0, :40] = 0                                  # an all-zero group: amax floored at 1e-4
    x[-1] *= 1e-6                                  # tiny and large tokens
    x[m // 2] *= 1e4
    ref_q, ref_s = formats.quantize_activations(x, block)
    for column_major in (False, True):
        q, s = tk.quantize_activations(x, block, scales_column_major=column_major)
        assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))
        assert torch.equal(s, ref_s)


@pytest.mark.parametrize("block", [128, 32])
@pytest.mark.parametrize("n, k", [(1024, 4096), (512, 4096), (200, 96), (4096, 8192)])
@pytest.mark.parametrize("m", [1, 5, 16, 33, 64, 130, 512])
def test_fp8_linear_matches_reference(m, n, k, block):
    g = _gen()
    weight, scale = formats.quantize_fp8(torch.randn(n, k, generator=g, device="cuda") * 0.05, block)
    x = torch.randn(m, k, generator=g, device="cuda", dtype=torch.bfloat16)
    out = tk.fp8_linear(x, weight, scale, block)
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    assert _rel(out, reference.fp8_linear(x, weight, scale, block)) < 1e-2


@pytest.mark.parametrize("m", [1, 5, 130, 1024])
def test_scaled_mm_route_matches_reference(m):
    """cuBLAS' blockwise path (fp8_linear takes it for block 128 from a few hundred tokens), every M."""
    g = _gen()
    weight, scale = formats.quantize_fp8(torch.randn(1024, 4096, generator=g, device="cuda") * 0.05, 128)
    x = torch.randn(m, 4096, generator=g, device="cuda", dtype=torch.bfloat16)
    assert _rel(tk.scaled_mm_fp8(x, weight, scale), reference.fp8_linear(x, weight, scale, 128)) < 1e-2


@pytest.mark.parametrize("fmt, block", [("mxfp4", 32), ("fp8", 128), ("fp8", 32)])
@pytest.mark.parametrize("counts", [[0, 1, 0, 0], [1, 0, 3, 2], [0, 17, 0, 0], [40, 0, 129, 7], [300, 1, 0, 60]])
@pytest.mark.parametrize("n, k", [(256, 512), (96, 96)])
def test_grouped_gemm_matches_reference(counts, fmt, block, n, k):
    g = _gen()
    weight, scale = _experts(fmt, len(counts), n, k, block, g)
    m = sum(counts)
    rows = torch.randn(m + 3, k, generator=g, device="cuda", dtype=torch.bfloat16)   # 3 rows past offs[-1]
    offs = _offs(counts)
    out = tk.grouped_gemm(rows, offs, weight, scale, fmt, block)
    assert out.shape == (m + 3, n)
    assert _rel(out[:m], reference.grouped_gemm(rows, offs, weight, scale, fmt, block)[:m]) < 1e-2


@pytest.mark.parametrize("tokens", [1, 32, 300])
def test_grouped_gemm_top6_of_256_experts(tokens):
    """V4's routing shape: top-6 of 256 experts, most experts empty or with a few rows."""
    g = _gen()
    weight, scale = _experts("mxfp4", 256, 128, 256, 32, g)
    idx = torch.rand(tokens, 256, generator=g, device="cuda").argsort(-1)[:, :6].flatten()
    offs = torch.bincount(idx, minlength=256).cumsum(0).to(torch.int32)
    rows = torch.randn(idx.numel(), 256, generator=g, device="cuda", dtype=torch.bfloat16)
    out = tk.grouped_gemm(rows, offs, weight, scale, "mxfp4", 32)
    assert _rel(out, reference.grouped_gemm(rows, offs, weight, scale, "mxfp4", 32)) < 1e-2


@pytest.mark.parametrize("fmt, block", [("mxfp4", 32), ("fp8", 128)])
@pytest.mark.parametrize("counts", [[0, 1, 0, 0], [1, 0, 3, 2], [0, 17, 0, 0], [40, 0, 129, 7]])
@pytest.mark.parametrize("bm, bn, bk", [(16, 64, 256), (16, 128, 128), (32, 128, 128), (64, 128, 128)])
def test_grouped_gemm_swapped_product_equals_the_plain_one(counts, fmt, block, bm, bn, bk):
    """SWAP_AB (w @ x^T, stored transposed) against the plain tile order at the same tiles: the same products
    and sums, and both against the reference."""
    g = _gen()
    n, k = 256, 512
    weight, scale = _experts(fmt, len(counts), n, k, block, g)
    m = sum(counts)
    rows = torch.randn(m, k, generator=g, device="cuda", dtype=torch.bfloat16)
    offs = _offs(counts)
    plain = tk.grouped_gemm_with(rows, offs, weight, scale, fmt, block, tk.GroupedConfig(bm, bn, bk, 4, 3))
    swapped = tk.grouped_gemm_with(rows, offs, weight, scale, fmt, block, tk.GroupedConfig(bm, bn, bk, 4, 3, True))
    assert _rel(swapped, plain) < 1e-5
    assert _rel(swapped, reference.grouped_gemm(rows, offs, weight, scale, fmt, block)) < 1e-2
    eye = torch.eye(k, device="cuda", dtype=torch.bfloat16)
    weight, scale = every_code_weight(fmt, block, k, g, "cuda")
    one = torch.tensor([k], device="cuda", dtype=torch.int32)
    out = tk.grouped_gemm_with(eye, one, weight, scale, fmt, block, tk.GroupedConfig(bm, bn, bk, 4, 3, True))
    assert torch.equal(out.float(), reference.dequantize_weight(weight[0], scale[0], fmt, block).T)


@pytest.mark.parametrize("swap", [False, True])
@pytest.mark.parametrize("counts", [[0, 1, 0, 0], [1, 0, 3, 2], [0, 17, 0, 0], [40, 0, 129, 7], [300, 1, 0, 60]])
@pytest.mark.parametrize("bm, bn, bk, warps", [(16, 64, 256, 4), (16, 128, 128, 4), (64, 128, 128, 4),
                                               (128, 256, 64, 8), (128, 128, 128, 8)])
def test_grouped_gemm_dot_scaled_equals_the_plain_one(counts, bm, bn, bk, warps, swap):
    """MXFP4 through tl.dot_scaled (GroupedConfig.dot_scaled, plain and swapped) against today's decode at the
    same tiles and against the reference; one-hot rows read every code back exactly."""
    g = _gen()
    n, k = 256, 512
    weight, scale = _experts("mxfp4", len(counts), n, k, 32, g)
    m = sum(counts)
    rows = torch.randn(m + 3, k, generator=g, device="cuda", dtype=torch.bfloat16)
    offs = _offs(counts)
    plain = tk.grouped_gemm_with(rows, offs, weight, scale, "mxfp4", 32, tk.GroupedConfig(bm, bn, bk, warps, 3))
    cfg = tk.GroupedConfig(bm, bn, bk, warps, 3, swap_ab=swap, dot_scaled=True)
    out = tk.grouped_gemm_with(rows, offs, weight, scale, "mxfp4", 32, cfg)
    assert _rel(out[:m], plain[:m]) < 1e-3
    assert _rel(out[:m], reference.grouped_gemm(rows, offs, weight, scale, "mxfp4", 32)[:m]) < 1e-2
    eye = torch.eye(k, device="cuda", dtype=torch.bfloat16)
    weight, scale = every_code_weight("mxfp4", 32, k, g, "cuda")
    one = torch.tensor([k], device="cuda", dtype=torch.int32)
    out = tk.grouped_gemm_with(eye, one, weight, scale, "mxfp4", 32, cfg)
    assert torch.equal(out.float(), reference.dequantize_weight(weight[0], scale[0], "mxfp4", 32).T)


@pytest.mark.parametrize("fmt, block", [("mxfp4", 32), ("fp8", 32), ("fp8", 128)])
def test_grouped_gemm_decodes_every_code_exactly(fmt, block):
    """Every byte value (every E2M1 pair; every non-NaN E4M3 code) times scales over a wide range: one-hot
    rows read the dequantized weight back, which must equal the reference's bit for bit (MXFP4's 0.5 goes
    through a bf16 subnormal on its way)."""
    g = _gen()
    k = 512
    weight, scale = every_code_weight(fmt, block, k, g, "cuda")
    eye = torch.eye(k, device="cuda", dtype=torch.bfloat16)
    out = tk.grouped_gemm(eye, torch.tensor([k], device="cuda", dtype=torch.int32), weight, scale, fmt, block)
    assert torch.equal(out.float(), reference.dequantize_weight(weight[0], scale[0], fmt, block).T)


def test_cuda_graph_replay_equals_eager():
    """Both ops captured once, replayed on new activations and a new routing (the row tiles per expert are
    found on the device, so a replay with other expert counts must still be right)."""
    g = _gen()
    w8, s8 = formats.quantize_fp8(torch.randn(512, 1024, generator=g, device="cuda") * 0.05, 128)
    w4, s4 = _experts("mxfp4", 8, 256, 1024, 32, g)
    x = torch.randn(4, 1024, generator=g, device="cuda", dtype=torch.bfloat16)
    rows = torch.randn(24, 1024, generator=g, device="cuda", dtype=torch.bfloat16)
    offs = _offs([3, 0, 5, 0, 0, 16, 0, 0])

    def step():
        return tk.fp8_linear(x, w8, s8, 128), tk.grouped_gemm(rows, offs, w4, s4, "mxfp4", 32)

    step()                                          # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y_lin, y_grp = step()
    for counts in ([24, 0, 0, 0, 0, 0, 0, 0], [1, 2, 3, 4, 5, 6, 0, 3], [0, 0, 0, 0, 0, 0, 0, 24]):
        x.copy_(torch.randn(x.shape, generator=g, device="cuda"))
        rows.copy_(torch.randn(rows.shape, generator=g, device="cuda"))
        offs.copy_(_offs(counts))
        graph.replay()
        eager_lin, eager_grp = step()
        assert torch.equal(y_lin, eager_lin)
        assert torch.equal(y_grp, eager_grp)


# ---- W4A8 experts, the bf16-core FP8 linear, the per-M kernel choice -----------------------------------
# routed experts (count, hidden, intermediate) and the activation group DeepSeek's inference quantizes them with
# (its FP8 block): V4-Flash, and V4.1-Flash as /work/shared/reference/deepseek_v41/config.json gives it; top-6 both
EXPERT_SHAPES = {"v4_flash": (256, 4096, 2048, 128), "v41_flash": (384, 5120, 2304, 32)}


def _random_mxfp4(e, n, k, g):
    """Random E2M1 codes with scales near the init std's (quantizing full-width experts from floats would
    need far more memory than the codes)."""
    w = torch.randint(0, 256, (e, n, k // 2), generator=g, device="cuda", dtype=torch.uint8)
    s = torch.randint(118, 125, (e, n, k // 32), generator=g, device="cuda", dtype=torch.uint8)
    return w, s.view(torch.float8_e8m0fnu)


def _top6_offs(tokens, experts, g):
    idx = torch.rand(tokens, experts, generator=g, device="cuda").argsort(-1)[:, :6].flatten()
    return torch.bincount(idx, minlength=experts).cumsum(0).to(torch.int32), idx.numel()


def test_quantize_dequantize_activations_is_bit_exact():
    g = _gen()
    x = (torch.randn(37, 1000, generator=g, device="cuda") * 3).to(torch.bfloat16)
    x[0, :40] = 0
    x[5] *= 1e4
    for block in (32, 128):
        want = formats.dequantize_activations(*formats.quantize_activations(x, block), block).to(torch.bfloat16)
        assert torch.equal(tk.quantize_dequantize_activations(x, block), want)


@pytest.mark.parametrize("act_block", [32, 128])
@pytest.mark.parametrize("counts", [[0, 1, 0, 0], [1, 0, 3, 2], [40, 0, 129, 7], [300, 1, 0, 60], [0, 0, 0, 513]])
def test_w4a8_grouped_gemm_matches_reference(counts, act_block):
    """The W4A8 kernel (activation quantization kernel + FP8 GEMM) against the reference with the same
    activation rounding (fp32 summation order and bf16 output apart), and against the dequantized fp32 product
    without it within the documented W8A8 bound (E4M3's 3 mantissa bits: 2.3% measured for one FP8 linear)."""
    from openinfer.quantization import triton_w4a8

    g = _gen()
    weight, scale = _experts("mxfp4", len(counts), 256, 512, 32, g)
    m = sum(counts)
    rows = torch.randn(m + 3, 512, generator=g, device="cuda", dtype=torch.bfloat16)
    offs = _offs(counts)
    out = triton_w4a8.grouped_gemm_w4a8(rows, offs, weight, scale, act_block)
    assert out.shape == (m + 3, 256) and out.dtype == torch.bfloat16
    assert _rel(out[:m], reference.grouped_gemm_a8(rows, offs, weight, scale, "mxfp4", act_block)[:m]) < 1e-2
    exact = reference.grouped_gemm(rows.float(), offs, weight, scale, "mxfp4", act_block)[:m]
    assert 1e-3 < _rel(out[:m], exact) < 0.05


@pytest.mark.parametrize("model", sorted(EXPERT_SHAPES))
@pytest.mark.parametrize("tokens", [1, 2048])
def test_w4a8_at_full_width(model, tokens):
    """Both expert GEMMs of V4-Flash (1 x 128 activation groups) and V4.1-Flash (1 x 32) at their real widths,
    top-6 routing: the W4A8 kernel, the W4A16 kernel on rounded rows and the dispatcher against the reference."""
    from openinfer.quantization import triton_w4a8

    g = _gen()
    e, h, i, act_block = EXPERT_SHAPES[model]
    offs, m = _top6_offs(tokens, e, g)
    for n, k in ((2 * i, h), (h, i)):                      # gate_up, down
        weight, scale = _random_mxfp4(e, n, k, g)
        rows = torch.randn(m, k, generator=g, device="cuda", dtype=torch.bfloat16)
        ref = reference.grouped_gemm_a8(rows, offs, weight, scale, "mxfp4", act_block)
        assert _rel(triton_w4a8.grouped_gemm_w4a8(rows, offs, weight, scale, act_block), ref) < 1e-2
        w4a16 = tk.grouped_gemm(tk.quantize_dequantize_activations(rows, act_block), offs, weight, scale, "mxfp4",
                                act_block)
        assert _rel(w4a16, ref) < 1e-2
        assert _rel(triton_w4a8.grouped_gemm_a8(rows, offs, weight, scale, "mxfp4", act_block), ref) < 1e-2
        del weight, scale


@pytest.mark.parametrize("folded", [False, True])
def test_w4a8_cuda_graph_replay_equals_eager(folded):
    """The W4A8 kernels (per 32-group; folded per 128) captured once and replayed on new rows and a new routing
    (tiles found on the device)."""
    from openinfer.quantization import triton_w4a8

    g = _gen()
    weight, scale = _experts("mxfp4", 8, 256, 1024, 32, g)
    assert triton_w4a8.fold_exact(scale)
    rows = torch.randn(24, 1024, generator=g, device="cuda", dtype=torch.bfloat16)
    offs = _offs([3, 0, 5, 0, 0, 16, 0, 0])

    def step():
        if folded:
            return triton_w4a8.grouped_gemm_w4a8_folded(rows, offs, weight, scale)
        return triton_w4a8.grouped_gemm_w4a8(rows, offs, weight, scale, 128)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = step()
    for counts in ([24, 0, 0, 0, 0, 0, 0, 0], [1, 2, 3, 4, 5, 6, 0, 3], [0, 0, 0, 0, 0, 0, 0, 24]):
        rows.copy_(torch.randn(rows.shape, generator=g, device="cuda"))
        offs.copy_(_offs(counts))
        graph.replay()
        assert torch.equal(y, step())


V41_FP8_SHAPES = {"wq_a": (1280, 5120), "wq_b": (32768, 1280), "wkv": (512, 5120), "wo_b": (5120, 8192),
                  "shared_w13": (2304, 5120), "shared_w2": (5120, 2304), "index_wq_b": (4096, 1280)}   # (N, K)


@pytest.mark.parametrize("name", sorted(V41_FP8_SHAPES))
@pytest.mark.parametrize("m", [1, 77, 4096])
def test_fp8_bf16_core_linear_matches_reference(name, m):
    """V4.1's FP8 32 x 32 linears through the bf16-tensor-core kernel: W8A16 against the reference without
    activation rounding, and with rounded activations (fp8_linear's bf16 route) against the W8A8 reference."""
    g = _gen()
    n, k = V41_FP8_SHAPES[name]
    weight, scale = formats.quantize_fp8(torch.randn(n, k, generator=g, device="cuda") * 0.05, 32)
    x = torch.randn(m, k, generator=g, device="cuda", dtype=torch.bfloat16)
    cfg = tk.fp8_bf16_config(m, n, k, 32)
    w8a16 = tk.fp8_bf16_gemm(x, weight, scale, 32, cfg)
    assert _rel(w8a16, reference.fp8_linear(x, weight, scale, 32, quantize_input=False)) < 1e-2
    w8a8 = tk.fp8_bf16_gemm(tk.quantize_dequantize_activations(x, 32), weight, scale, 32, cfg)
    assert _rel(w8a8, reference.fp8_linear(x, weight, scale, 32)) < 1e-2


@pytest.mark.parametrize("m", [1, 300, 3000])
def test_fp8_linear_routes_agree(m, monkeypatch):
    """fp8_linear's routes for 32-wide blocks (the W8A8 FP8 kernel, the bf16-core kernel on rounded activations,
    the weight dequantized to bf16 then cuBLAS on the same activations) compute the same values: each table entry forced in turn, both against the reference."""
    from openinfer.quantization import kernel_choice

    g = _gen()
    weight, scale = formats.quantize_fp8(torch.randn(2304, 5120, generator=g, device="cuda") * 0.05, 32)
    x = torch.randn(m, 5120, generator=g, device="cuda", dtype=torch.bfloat16)
    ref = reference.fp8_linear(x, weight, scale, 32)
    for route in ("fp8", "bf16", "bf16_dequant"):
        monkeypatch.setattr(kernel_choice, "FP8_FINE_BLOCK_BY_M", ((0, route),))
        assert _rel(tk.fp8_linear(x, weight, scale, 32), ref) < 1e-2


@pytest.mark.parametrize("rows_per_group, block", [(16, 128), (48, 32), (1024, 128)])
def test_grouped_wo_a_with_narrow_groups_on_the_grouped_kernel(rows_per_group, block):
    """`Fp8Linear.forward_groups` on the Triton ops with groups inside one scale tile, straddling two, or whole
    tiles (V4-Flash's 1024-row groups), against the same layer on the reference ops."""
    from openinfer.layers.basic import TORCH_OPS
    from openinfer.layers.fp8_linear import Fp8Linear
    from openinfer.layers.triton_ops import TRITON_OPS

    g = _gen()
    groups, k = 8, 512
    lin = Fp8Linear(k, groups * rows_per_group, block).cuda()
    lin.weight.data, lin.weight_scale.data = formats.quantize_fp8(
        torch.randn(groups * rows_per_group, k, generator=g, device="cuda")
        * torch.rand(groups * rows_per_group, 1, generator=g, device="cuda"), block)
    x = torch.randn(33, groups, k, generator=g, device="cuda", dtype=torch.bfloat16)
    lin.ops = TORCH_OPS
    ref = lin.forward_groups(x)
    lin.ops = TRITON_OPS
    assert _rel(lin.forward_groups(x), ref) < 1e-2


@pytest.mark.parametrize("m", [1, 7, 64, 300])
@pytest.mark.parametrize("k, rows, block", [(4096, (1024, 512), 128),     # V4-Flash: wq_a + wkv, 128 x 128 tiles
                                            (5120, (1280, 512), 32)])     # V4.1-Flash: 32 x 32 tiles
def test_joined_wq_a_wkv_at_flash_widths(m, k, rows, block):
    """The attention's wq_a and wkv joined (fp8_linear.join_linears: one Triton FP8 GEMM) against the two GEMMs
    it replaces and the reference: the same values up to the GEMM's own rounding (its split over K may follow N, so
    the float32 sums may round to the neighbouring bf16), each part's columns where the separate GEMM put them."""
    from openinfer.layers.basic import TORCH_OPS
    from openinfer.layers.fp8_linear import Fp8Linear, join_linears
    from openinfer.layers.triton_ops import TRITON_OPS

    g = _gen()
    parent = torch.nn.Module()
    for name, n in zip(("wq_a", "wkv"), rows):
        lin = Fp8Linear(k, n, block, TRITON_OPS).cuda()
        lin.weight.data, lin.weight_scale.data = formats.quantize_fp8(
            torch.randn(n, k, generator=g, device="cuda") * k ** -0.5, block)
        setattr(parent, name, lin)
    x = torch.randn(m, k, generator=g, device="cuda", dtype=torch.bfloat16)
    want = torch.cat((parent.wq_a(x), parent.wkv(x)), dim=-1)
    assert join_linears(parent, ("wq_a", "wkv"), "wq_a_kv") and parent.wq_a_kv.one_gemm
    got = parent.wq_a_kv(x)
    q_a, kv = parent.wq_a_kv.split(got)
    assert q_a.shape == (m, rows[0]) and kv.shape == (m, rows[1])
    ulp = torch.ldexp(torch.ones_like(want.float()), torch.frexp(want.float().abs().clamp_min(1e-30))[1] - 8)
    assert bool(((got.float() - want.float()).abs() <= ulp).all()), "joined GEMM off by more than a bf16 ulp"
    parent.wq_a_kv.ops = TORCH_OPS
    assert _rel(got, parent.wq_a_kv(x)) < 1e-2
    print(f"m={m}: {float((got == want).float().mean()):.4f} of the values bit-equal to the two GEMMs'")
