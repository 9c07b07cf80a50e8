"""Reference (CPU) kernels for the quantized layers, in float32 with DeepSeek's kernels' accumulation order:
each K block's product of stored values is scaled by its (power-of-two) scales and added in K order, so the CPU
engine equals DeepSeek's inference code (its CPU ports accumulate exactly so) and not only approximately. They
define what the fast kernels (`triton_kernels.py`) must compute and are what the CPU engine runs.

The two entry points have the signatures every backend implements (`LayerOps.fp8_linear`,
`LayerOps.grouped_gemm`):
- `fp8_linear(x, weight, scale, block)`: x [M, K] -> [M, N] in x's dtype; activations quantized per token
  in groups of `block` channels (DeepSeek's `act_quant`, power-of-two scales) unless `quantize_input=False`.
- `grouped_gemm(rows, offs, weight, scale, fmt, block)`: rows [M, K] sorted by expert, offs [E] int32 the
  cumulative row counts (torch._grouped_mm's convention); expert e multiplies rows offs[e-1]:offs[e] by its
  weight [N, K] stored as `fmt` ("mxfp4": packed [E, N, K/2] + [E, N, K/32]; "fp8": [E, N, K] + block
  scales). Activations stay in their dtype (weight-only dequantization, W4A16 / W8A16).
- `grouped_gemm_a8(rows, offs, weight, scale, fmt, block)`: the same with the rows first quantized to FP8 per
  token in groups of `block` (W4A8 / W8A8: DeepSeek's `act_quant` before its `fp4_gemm`).
"""

from __future__ import annotations

import torch

from openinfer.quantization.formats import (MXFP4_GROUP, dequantize_activations, dequantize_fp8, dequantize_mxfp4,
                                            e8m0_to_float, quantize_activations, unpack_e2m1)


def dequantize_weight(weight: torch.Tensor, scale: torch.Tensor, fmt: str, block: int) -> torch.Tensor:
    """Any stored quantized weight (one or stacked) -> float32 of its logical shape."""
    if fmt == "mxfp4":
        return dequantize_mxfp4(weight, scale)
    if fmt == "fp8":
        return dequantize_fp8(weight, scale, block)
    raise ValueError(f"unknown quantized weight format {fmt!r} (fp8, mxfp4)")


def _scales(scale: torch.Tensor) -> torch.Tensor:
    return e8m0_to_float(scale) if scale.dtype in (torch.float8_e8m0fnu, torch.uint8) else scale.float()


def block_scaled_matmul(a: torch.Tensor, values: torch.Tensor, row_scales: torch.Tensor, block: int) -> torch.Tensor:
    """a [M, K] float32 @ (values [N, K] float32, the stored weight unscaled; row_scales [N, K/block]).T, one K block
    at a time, each block's partial product scaled and accumulated in K order (powers of two scale exactly, so an
    FP8-quantized `a` may come in already multiplied by its scales)."""
    acc = torch.zeros(a.shape[0], values.shape[0], dtype=torch.float32, device=a.device)
    for k in range(0, a.shape[1], block):
        acc += (a[:, k:k + block] @ values[:, k:k + block].T) * row_scales[:, k // block]
    return acc


def _stored_values(weight: torch.Tensor, scale: torch.Tensor, fmt: str, block: int):
    """(values [N, K] unscaled float32, per-row scales [N, K/group], group) of one stored weight."""
    if fmt == "mxfp4":
        return unpack_e2m1(weight), _scales(scale), MXFP4_GROUP
    if fmt == "fp8":
        n = weight.shape[0]
        return weight.float(), _scales(scale).repeat_interleave(block, dim=0)[:n], block
    raise ValueError(f"unknown quantized weight format {fmt!r} (fp8, mxfp4)")


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: int,
               quantize_input: bool = True) -> torch.Tensor:
    a = x.float()
    if quantize_input:
        a = dequantize_activations(*quantize_activations(a, block), block)
    return block_scaled_matmul(a, *_stored_values(weight, scale, "fp8", block)).to(x.dtype)


def grouped_gemm(rows: torch.Tensor, offs: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, fmt: str,
                 block: int, host_offs=None) -> torch.Tensor:
    """`host_offs`: a `device_io.ReadOnce` of `offs` shared with other calls (read once for all), or None."""
    out = torch.empty(rows.shape[0], weight.shape[1], dtype=rows.dtype, device=rows.device)
    start = 0
    for e, end in enumerate((host_offs or offs).tolist()):
        if end > start:
            out[start:end] = block_scaled_matmul(rows[start:end].float(),
                                                 *_stored_values(weight[e], scale[e], fmt, block)).to(rows.dtype)
        start = end
    return out


def grouped_gemm_a8(rows: torch.Tensor, offs: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, fmt: str,
                    block: int, host_offs=None, w4a8_foldable: bool = False) -> torch.Tensor:
    """`w4a8_foldable`: a kernel choice of the CUDA ops (`triton_w4a8.fold_exact`), the same values here."""
    a = dequantize_activations(*quantize_activations(rows.float(), block), block)
    return grouped_gemm(a, offs, weight, scale, fmt, block, host_offs).to(rows.dtype)


def weight_only_fp8_linear(grouped_gemm):
    """An `fp8_linear` that leaves activations unquantized (W8A16), built from a backend's weight-only
    `grouped_gemm` with one group."""
    def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: int) -> torch.Tensor:
        offs = torch.full((1,), x.shape[0], dtype=torch.int32, device=x.device)
        return grouped_gemm(x, offs, weight[None], scale[None], "fp8", block)
    return fp8_linear
