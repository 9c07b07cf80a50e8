"""GPU tests of the folded W4A8 expert GEMM (openinfer/quantization/triton_w4a8.py, `pytest -m gpu`): the inline-PTX
decode bit for bit against its plain-Triton form, both against `reference.grouped_gemm_a8`, every E2M1 code and
every fold distance decoded exactly, the activation K order, V4-Flash's widths (CUDA-graph replay:
tests/test_gpu_quant.py)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from openinfer.quantization import formats, reference, triton_w4a8  # noqa: E402
from openinfer.quantization.triton_act_quant import quantize_activations  # noqa: E402


from tests.test_gpu_quant import _gen, _offs, _rel  # noqa: E402


def _weights(e, n, k, g, spread=triton_w4a8.FOLD_SPREAD):
    """Every byte value (so every E2M1 code in both nibbles) over random rows, scales spanning `spread` binades
    inside each 128 of K (the most `fold_exact` accepts by default)."""
    w = torch.randint(0, 256, (e, n, k // 2), generator=g, device="cuda", dtype=torch.uint8)
    w[0, 0, :256] = torch.arange(256, device="cuda", dtype=torch.uint8)[: min(256, k // 2)]
    s = torch.randint(120 - spread, 121, (e, n, k // 32), generator=g, device="cuda", dtype=torch.uint8)
    s[..., ::4] = 120                                  # each block's largest at 120, the rest up to `spread` below
    return w, s.view(torch.float8_e8m0fnu)


CONFIGS = [triton_w4a8.FoldedConfig(bm, bn, warps, 3, swap, asm) for bm, bn, warps, swap in
           [(16, 64, 4, True), (32, 128, 4, True), (64, 128, 4, False), (128, 128, 8, False), (128, 64, 4, False),
            (64, 128, 8, True)] for asm in (True, False)]


@pytest.mark.parametrize("counts", [[0, 1, 0, 0], [1, 0, 3, 2], [40, 0, 129, 7], [300, 1, 0, 60]])
def test_folded_kernel_equals_reference_and_its_plain_form(counts):
    """Every tile shape, both products, the PTX decode and the plain-Triton one: the same bits (fp32 out) for
    the same tile shape, and near the reference: the products are exact, but Hopper's FP8 MMA sums a 128-block
    with a shorter mantissa than fp32 (DeepSeek-V3's report: ~14 bits; 2.2e-4 measured on an H200), which
    the promotion to fp32 every 128 of K keeps from growing along K."""
    g = _gen()
    k, n = 512, 192
    weight, scale = _weights(len(counts), n, k, g)
    assert triton_w4a8.fold_exact(scale)
    m = sum(counts)
    rows = (torch.randn(m + 3, k, generator=g, device="cuda") * 2.0 ** torch.randint(
        -6, 7, (1, k), generator=g, device="cuda")).to(torch.bfloat16)
    offs = _offs(counts)
    a, a_scale = quantize_activations(rows, 128, w4a8_order=True)
    ref = reference.grouped_gemm_a8(rows.float(), offs, weight, scale, "mxfp4", 128)[:m]
    by_tile = {}
    for cfg in CONFIGS:
        out = triton_w4a8.grouped_gemm_w4a8_folded_quantized(a, a_scale, offs, weight, scale, torch.float32, cfg)
        assert _rel(out[:m], ref) < 1e-3, (cfg, _rel(out[:m], ref))
        key = (cfg.block_m, cfg.block_n, cfg.num_warps, cfg.swap_ab)
        if key in by_tile:
            assert torch.equal(by_tile[key], out[:m]), cfg
        by_tile[key] = out[:m]


@pytest.mark.parametrize("spread", [0, 5, triton_w4a8.FOLD_SPREAD])
def test_every_code_at_every_fold_distance_decodes_exactly(spread):
    """One-hot activations read single weights back: out[r, n] = weight[n, k_r] exactly, for all 16 codes at
    fold distances 0 .. spread (the kernel's values times their block scale are the dequantized weights)."""
    g = _gen()
    k, n = 256, 64
    weight, scale = _weights(1, n, k, g, spread)
    dense = formats.dequantize_mxfp4(weight, scale)[0]                       # [n, k] fp32, exact
    rows = torch.zeros(k, k, device="cuda", dtype=torch.bfloat16)
    rows.fill_diagonal_(1.0)
    offs = _offs([k])
    for cfg in (triton_w4a8.FoldedConfig(64, 64, 4, 3, False, True),
                triton_w4a8.FoldedConfig(32, 64, 4, 3, True, True)):
        out = triton_w4a8.grouped_gemm_w4a8_folded(rows, offs, weight, scale, cfg)
        assert torch.equal(out.float(), dense.T.to(torch.bfloat16).float()), cfg


def test_fold_reference_matches_the_dequantized_weights_and_fold_exact_refuses_wide_blocks():
    g = _gen()
    weight, scale = _weights(2, 64, 512, g)
    vals, block = triton_w4a8.fold_reference(weight, scale)
    assert torch.equal(vals.float() * block.repeat_interleave(128, -1), formats.dequantize_mxfp4(weight, scale))
    wide = scale.view(torch.uint8).clone()
    wide[1, 5, 9] = 120 - triton_w4a8.FOLD_SPREAD - 1
    assert triton_w4a8.fold_exact(scale) and not triton_w4a8.fold_exact(wide.view(torch.float8_e8m0fnu))


def test_activation_quantization_in_w4a8_order_is_the_permuted_quantization():
    g = _gen()
    x = (torch.randn(37, 1024, generator=g, device="cuda") * 3).to(torch.bfloat16)
    x[0, :128] = 0
    q, s = quantize_activations(x, 128, w4a8_order=True)
    q0, s0 = formats.quantize_activations(x, 128)
    assert torch.equal(s, s0)
    assert torch.equal(q.view(torch.uint8), triton_w4a8.w4a8_order(q0.view(torch.uint8)))


@pytest.mark.parametrize("tokens", [1, 32, 2048, 8192])
def test_folded_at_v4_flash_width(tokens):
    """Both V4-Flash expert GEMMs (256 experts, H 4096, I 2048, top-6) at the default tiles against the
    reference with the same activation rounding, bf16 out."""
    g = _gen()
    e, h, i = 256, 4096, 2048
    idx = torch.rand(tokens, e, generator=g, device="cuda").argsort(-1)[:, :6].flatten()
    offs, m = torch.bincount(idx, minlength=e).cumsum(0).to(torch.int32), idx.numel()
    for n, k in ((2 * i, h), (h, i)):
        w = torch.randint(0, 256, (e, n, k // 2), generator=g, device="cuda", dtype=torch.uint8)
        s = torch.randint(118, 125, (e, n, k // 32), generator=g, device="cuda", dtype=torch.uint8)
        s = s.view(torch.float8_e8m0fnu)
        rows = torch.randn(m, k, generator=g, device="cuda", dtype=torch.bfloat16)
        ref = reference.grouped_gemm_a8(rows, offs, w, s, "mxfp4", 128)
        out = triton_w4a8.grouped_gemm_w4a8_folded(rows, offs, w, s)
        assert _rel(out, ref) < 5e-3, (n, k, _rel(out, ref))
        del w, s
