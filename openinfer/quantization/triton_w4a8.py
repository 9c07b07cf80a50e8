"""MXFP4 routed experts on the FP8 tensor cores (W4A8), as DeepSeek's inference multiplies them (`fp4_gemm`):
activations quantized to E4M3 per token in groups of the checkpoint's FP8 block (`act_quant`: 1 x 128 in V4,
1 x 32 in V4.1, whose `linear` passes its `fp8_block_size` to both), weights E2M1 with an E8M0 scale per 32
along K, each 32-wide K group's FP8 product scaled by both scales and added into fp32 in K order.

Why: the weight-only W4A16 kernel (`triton_kernels.grouped_gemm`) decodes every weight into a bf16 tile and
runs bf16 MMAs; at prefill sizes that is ALU- and bf16-MMA-bound (147-154 TFLOP/s on an H200). Here the
decode is a few integer ops per byte and the MMA runs at the FP8 rate.

- E2M1 -> E4M3 is exact and needs no float arithmetic: a code's sign goes to bit 7 and its three magnitude
  bits to bits 4..2, which reads as the E2M1 value times 2^-6 (0.5, the E2M1 subnormal, lands on the E4M3
  subnormal 2^-7); the 2^6 is given back once, to the fp32 accumulator, at the end.
- Scales: the weight's E8M0 scale varies per output column and per 32 of K, so each 32-wide group is its own
  FP8 dot (K = 32, one wgmma) whose fp32 result is scaled per column and added. With 1 x 128 activation
  groups (V4) the four groups' sum is scaled per row once per 128; with 1 x 32 (V4.1) every group is.
- Activations are quantized by one small kernel before the GEMM (`triton_kernels.quantize_activations`, bit
  for bit `formats.quantize_activations`): FP8 rows are half the bytes the GEMM then re-reads per column tile.
- Grouped over experts as the W4A16 kernel is (`_expert_row_tile`): a static upper-bound grid, each program
  finds its expert and rows from `offs` on the device; no host sync, CUDA-graph capturable.

`grouped_gemm_a8` is the `LayerOps.grouped_gemm_a8` of the CUDA ops: per row count it takes this kernel or
"round the activations, then the W4A16 kernel" or "round them, dequantize the experts to bf16, torch._grouped_mm"
(`dequant_gemm.py`) (the same values up to fp32 summation order), by the measured table in `kernel_choice.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from openinfer.quantization import dequant_gemm, kernel_choice
from openinfer.quantization.formats import MXFP4_GROUP
from openinfer.quantization.triton_kernels import (_e8m0_to_f32, _expert_row_tile, grouped_gemm,
                                                   quantize_activations, quantize_dequantize_activations)


@triton.jit
def _e2m1_to_e4m3(packed, ROWS: tl.constexpr, COLS: tl.constexpr):
    """Packed MXFP4 bytes [ROWS, COLS] (uint8, even element in the low nibble) -> float8e4nv [ROWS, 2 * COLS]
    in element order, each the E2M1 value times 2^-6 exactly (the byte's two codes re-placed, see the module
    docstring)."""
    lo = ((packed & 0x07) << 2) | ((packed & 0x08) << 4)
    hi = ((packed >> 2) & 0x1C) | (packed & 0x80)
    return tl.reshape(tl.join(lo, hi), (ROWS, 2 * COLS)).to(tl.float8e4nv, bitcast=True)


@triton.jit
def _grouped_w4a8_kernel(a_ptr, as_ptr, offs_ptr, w_ptr, s_ptr, out_ptr, N, K, E,
                         stride_am, stride_asm, stride_we, stride_wn, stride_se, stride_sn, stride_om,
                         ACT_BLOCK: tl.constexpr, E_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program (t, j): row tile t over all experts times output columns [j * BLOCK_N, (j + 1) * BLOCK_N).

    a [M, K] e4m3 and as [M, ceil(K / ACT_BLOCK)] fp32: the quantized rows; w [E, N, K/2] packed E2M1 bytes,
    s [E, N, K/32] E8M0 bytes. K advances BLOCK_K per step (BLOCK_K == ACT_BLOCK, or ACT_BLOCK == 32), in
    BLOCK_K / 32 FP8 dots of K = 32 each."""
    t = tl.program_id(0)
    pid_n = tl.program_id(1)
    e, rm, m_mask, total = _expert_row_tile(offs_ptr, t, E, E_PAD, BLOCK_M)
    if t >= total:
        return
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rn < N
    G: tl.constexpr = 32                                    # the MXFP4 scale group
    a_rows = a_ptr + rm.to(tl.int64)[:, None] * stride_am
    as_rows = as_ptr + rm.to(tl.int64) * stride_asm
    w_rows = w_ptr + e.to(tl.int64) * stride_we + rn.to(tl.int64)[:, None] * stride_wn
    s_rows = s_ptr + e.to(tl.int64) * stride_se + rn.to(tl.int64) * stride_sn
    kk = tl.arange(0, G)
    kb = tl.arange(0, G // 2)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        block = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for j in tl.static_range(BLOCK_K // G):
            kg = k0 + j * G                                 # K is a multiple of 32: a group is all in or out
            a = tl.load(a_rows + (kg + kk)[None, :], mask=m_mask[:, None] & (kg + kk < K)[None, :], other=0.0)
            packed = tl.load(w_rows + (kg // 2 + kb)[None, :], mask=n_mask[:, None] & (kg + 2 * kb < K)[None, :],
                             other=0)
            w_scale = _e8m0_to_f32(tl.load(s_rows + kg // G, mask=n_mask & (kg + 0 * rn < K), other=0))
            part = tl.dot(a, tl.trans(_e2m1_to_e4m3(packed, BLOCK_N, G // 2)))
            if ACT_BLOCK == G:
                a_scale = tl.load(as_rows + kg // G, mask=m_mask & (kg + 0 * rm < K), other=0.0)
                acc += part * (a_scale[:, None] * w_scale[None, :])
            else:
                block += part * w_scale[None, :]
        if ACT_BLOCK != G:
            acc += block * tl.load(as_rows + k0 // ACT_BLOCK, mask=m_mask, other=0.0)[:, None]
    out = out_ptr + rm.to(tl.int64)[:, None] * stride_om + rn[None, :]
    tl.store(out, (acc * 64.0).to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@dataclass(frozen=True)
class W4A8Config:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def w4a8_config(m: int, n: int, e: int, act_block: int) -> W4A8Config:
    """Tiles: BLOCK_M covers the rows an expert typically gets (M / experts hit, as `grouped_config`), up to
    128 at prefill; 128-wide column tiles; K steps of 128 (V4: one activation group per step)."""
    hit = max(1, min(e, m))
    bm = min(128, max(16, triton.next_power_of_2(triton.cdiv(m, hit))))
    return W4A8Config(bm, 128, 128 if act_block in (32, 128) else act_block, 8 if bm == 128 else 4, 3)


def grouped_gemm_w4a8_quantized(a: torch.Tensor, a_scale: torch.Tensor, offs: torch.Tensor, weight: torch.Tensor,
                                scale: torch.Tensor, act_block: int, out_dtype: torch.dtype,
                                cfg: W4A8Config | None = None) -> torch.Tensor:
    """The GEMM on already-quantized rows: a [M, K] float8_e4m3fn, a_scale [M, ceil(K / act_block)] fp32
    (`formats.quantize_activations`' output), MXFP4 experts [E, N, K/2] + [E, N, K/32] -> [M, N] out_dtype."""
    m, k = a.shape
    e, n = weight.shape[:2]
    if k % MXFP4_GROUP or act_block % MXFP4_GROUP:
        raise ValueError(f"W4A8 needs K ({k}) and the activation group ({act_block}) multiples of {MXFP4_GROUP}")
    cfg = cfg or w4a8_config(m, n, e, act_block)
    if cfg.block_k % MXFP4_GROUP or act_block not in (MXFP4_GROUP, cfg.block_k):
        raise ValueError(f"W4A8 tile K {cfg.block_k} must equal the activation group {act_block} or step 32-groups "
                         f"of it")
    out = torch.empty(m, n, dtype=out_dtype, device=a.device)
    if m == 0:
        return out
    w, s = weight.view(torch.uint8), scale.view(torch.uint8)
    grid = (triton.cdiv(m, cfg.block_m) + min(e, m), triton.cdiv(n, cfg.block_n))
    _grouped_w4a8_kernel[grid](
        a, a_scale, offs, w, s, out, n, k, e, a.stride(0), a_scale.stride(0), w.stride(0), w.stride(1), s.stride(0),
        s.stride(1), out.stride(0), ACT_BLOCK=act_block, E_PAD=triton.next_power_of_2(e), BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out


def grouped_gemm_w4a8(rows: torch.Tensor, offs: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                      act_block: int, cfg: W4A8Config | None = None) -> torch.Tensor:
    """rows [M, K] (bf16, sorted by expert), offs [E] int32 -> [M, N]: `reference.grouped_gemm_a8` for MXFP4."""
    a, a_scale = quantize_activations(rows, act_block)
    return grouped_gemm_w4a8_quantized(a, a_scale, offs, weight, scale, act_block, rows.dtype, cfg)


def grouped_gemm_a8(rows: torch.Tensor, offs: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, fmt: str,
                    block: int, host_offs=None) -> torch.Tensor:
    """`LayerOps.grouped_gemm_a8` on CUDA: rows quantized per token in groups of `block`, then either the W4A8
    kernel, the weight-only kernel on the rounded rows, or the rounded rows times the experts dequantized to bf16
    through torch._grouped_mm (`dequant_gemm`), whichever `kernel_choice` measured faster at this many rows per
    expert (block-FP8 experts, and activation groups that are not whole 32-groups, never take the W4A8 kernel;
    inside a CUDA-graph capture the dequant route runs only if every expert fits its scratch at once, W4A16
    otherwise). `host_offs` (a `device_io.ReadOnce` of `offs`, or None): what the dequant route reads offs through,
    so that calls sharing the offsets read them once."""
    route = kernel_choice.expert_kernel(rows.shape[0], weight.shape[0])
    if fmt == "mxfp4" and block % MXFP4_GROUP == 0 and route == "w4a8":
        return grouped_gemm_w4a8(rows, offs, weight, scale, block)
    capturing = rows.is_cuda and torch.cuda.is_current_stream_capturing()
    if route == "bf16_dequant" and (not capturing or dequant_gemm.fits_capture(weight, fmt)):
        return dequant_gemm.grouped_gemm_dequant(quantize_dequantize_activations(rows, block), offs, weight, scale,
                                                 fmt, block, host_offs=host_offs)
    return grouped_gemm(quantize_dequantize_activations(rows, block), offs, weight, scale, fmt, block)
