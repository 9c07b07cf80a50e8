"""DeepSeek's activation quantization on the GPU (`act_quant`: per token, groups of `block` channels, power-of-two
scales, E4M3 values), bit for bit `formats.quantize_activations`, and the E8M0 scale decoding the quantized-weight
kernels share. Its own module so that every GEMM module can use it (`triton_kernels`, `triton_w4a8`,
`dequant_gemm`) without importing another GEMM's module."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from openinfer.quantization.formats import FP8_MAX

_FP8_MAX = tl.constexpr(FP8_MAX)


# ---- shared device helpers ----------------------------------------------------------------------------
@triton.jit
def _e8m0_to_f32(s):
    """E8M0 scale bytes -> fp32 2^(s-127) by placing the byte in the exponent field (s=0 gives 0.0)."""
    return (s.to(tl.int32) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _quantize_groups(x):
    """x [R, G] fp32, one quantization group per row -> (float8e4nv [R, G], fp32 scales [R]).

    Same result as `formats.quantize_activations` (which multiplies amax by fp32(1/448), as DeepSeek's kernel
    does; for every bf16 amax that equals this IEEE-rounded division, and `TRITON_OPS` feeds bf16):
    scale = 2^ceil(log2(max(amax, 1e-4) / 448)), values scaled by the exact reciprocal power of two,
    clamped, rounded to nearest even E4M3. pow2-ceil reads the exponent off the float bits (a non-zero mantissa rounds up)."""
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-4)
    ratio = tl.math.div_rn(amax, _FP8_MAX).to(tl.int32, bitcast=True)
    exp = ((ratio >> 23) & 0xFF) + ((ratio & 0x7FFFFF) != 0).to(tl.int32)
    scale = (exp << 23).to(tl.float32, bitcast=True)
    inv = ((254 - exp) << 23).to(tl.float32, bitcast=True)
    q = tl.clamp(x * inv[:, None], -_FP8_MAX, _FP8_MAX).to(tl.float8e4nv)
    return q, scale


# ---- activation quantization --------------------------------------------------------------------------
@triton.jit
def _act_quant_kernel(x_ptr, q_ptr, s_ptr, M, M_OUT, K, stride_xm, stride_qm, stride_sm, stride_sg,
                      BLOCK: tl.constexpr, ROWS: tl.constexpr, DEQUANT: tl.constexpr, W4A8_ORDER: tl.constexpr = False):
    """One program: ROWS tokens x one group of BLOCK channels; one read of x, fp8 values + fp32 scales out
    (DEQUANT: the values times their scale in q's dtype instead, no scales). Rows M..M_OUT (padding) come
    out as zeros. W4A8_ORDER (BLOCK 128): the group's values stored in the folded W4A8 kernel's K order (those
    with k % 8 < 4 first, then the rest: `triton_w4a8.w4a8_order`)."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    g = tl.program_id(1)
    cols = g * BLOCK + tl.arange(0, BLOCK)
    rows64 = rows.to(tl.int64)
    x = tl.load(x_ptr + rows64[:, None] * stride_xm + cols[None, :], mask=(rows < M)[:, None] & (cols < K)[None, :],
                other=0.0).to(tl.float32)
    q, s = _quantize_groups(x)
    out_mask = (rows < M_OUT)[:, None] & (cols < K)[None, :]
    if DEQUANT:
        tl.store(q_ptr + rows64[:, None] * stride_qm + cols[None, :],
                 (q.to(tl.float32) * s[:, None]).to(q_ptr.dtype.element_ty), mask=out_mask)
    else:
        if W4A8_ORDER:          # permuted in registers, so that the store stays contiguous
            q = tl.reshape(tl.permute(tl.reshape(q, (ROWS, BLOCK // 8, 2, 4)), (0, 2, 1, 3)), (ROWS, BLOCK))
        tl.store(q_ptr + rows64[:, None] * stride_qm + cols[None, :], q, mask=out_mask)
        tl.store(s_ptr + rows * stride_sm + g * stride_sg, s, mask=rows < M_OUT)


def quantize_activations(x: torch.Tensor, block: int, scales_column_major: bool = False, rows: int | None = None,
                         w4a8_order: bool = False):
    """x [M, K] -> (float8_e4m3fn [rows, K], float32 scales [rows, ceil(K/block)]), bit-identical to
    `formats.quantize_activations` (rows past M, if `rows` > M, are zero). `scales_column_major` lays the
    scales out token-fastest (what torch._scaled_mm's 1x128 blockwise scaling expects). `w4a8_order` (block
    128, K a multiple of it): the values in the folded W4A8 kernel's K order (`triton_w4a8.w4a8_order`)."""
    m, k = x.shape
    rows = m if rows is None else rows
    x = x if x.stride(-1) == 1 else x.contiguous()
    groups = triton.cdiv(k, block)
    q = torch.empty(rows, k, dtype=torch.float8_e4m3fn, device=x.device)
    s = (torch.empty(groups, rows, dtype=torch.float32, device=x.device).t() if scales_column_major
         else torch.empty(rows, groups, dtype=torch.float32, device=x.device))
    if w4a8_order and (block != 128 or k % block):
        raise ValueError(f"the W4A8 K order is defined for 1 x 128 groups over whole groups (block {block}, K {k})")
    tile = max(1, 4096 // block)
    _act_quant_kernel[(triton.cdiv(rows, tile), groups)](x, q, s, m, rows, k, x.stride(0), q.stride(0), s.stride(0),
                                                         s.stride(1), BLOCK=block, ROWS=tile, DEQUANT=False,
                                                         W4A8_ORDER=w4a8_order)
    return q, s


def quantize_dequantize_activations(x: torch.Tensor, block: int) -> torch.Tensor:
    """x [M, K] -> the values an FP8 GEMM multiplies, in x's dtype: `formats.dequantize_activations` of
    `formats.quantize_activations` in one pass (exact in bf16: an E4M3 value times a power of two). Feeds
    the weight-only kernels when the activations are to be rounded as DeepSeek's W8A8 / W4A8 GEMMs do."""
    m, k = x.shape
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = torch.empty_like(x)
    tile = max(1, 4096 // block)
    _act_quant_kernel[(triton.cdiv(m, tile), triton.cdiv(k, block))](x, out, x, m, m, k, x.stride(0), out.stride(0),
                                                                     0, 0, BLOCK=block, ROWS=tile, DEQUANT=True)
    return out
