"""Reference (CPU) kernels for the quantized layers: dequantize, then multiply in float32. They define what
the fast kernels (`triton_kernels.py`) must compute and are what the CPU engine runs.

The two entry points have the signatures every backend implements (`LayerOps.fp8_linear`,
`LayerOps.grouped_gemm`):
- `fp8_linear(x, weight, scale, block)`: x [M, K] -> [M, N] in x's dtype; activations quantized per token
  in groups of `block` channels (DeepSeek's `act_quant`, power-of-two scales) unless `quantize_input=False`.
- `grouped_gemm(rows, offs, weight, scale, fmt, block)`: rows [M, K] sorted by expert, offs [E] int32 the
  cumulative row counts (torch._grouped_mm's convention); expert e multiplies rows offs[e-1]:offs[e] by its
  weight [N, K] stored as `fmt` ("mxfp4": packed [E, N, K/2] + [E, N, K/32]; "fp8": [E, N, K] + block
  scales). Activations stay in their dtype (weight-only dequantization, W4A16 / W8A16).
"""

from __future__ import annotations

import torch

from openinfer.quantization.formats import (dequantize_activations, dequantize_fp8, dequantize_mxfp4,
                                            quantize_activations)


def dequantize_weight(weight: torch.Tensor, scale: torch.Tensor, fmt: str, block: int) -> torch.Tensor:
    """Any stored quantized weight (one or stacked) -> float32 of its logical shape."""
    if fmt == "mxfp4":
        return dequantize_mxfp4(weight, scale)
    if fmt == "fp8":
        return dequantize_fp8(weight, scale, block)
    raise ValueError(f"unknown quantized weight format {fmt!r} (fp8, mxfp4)")


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: int,
               quantize_input: bool = True) -> torch.Tensor:
    a = x.float()
    if quantize_input:
        a = dequantize_activations(*quantize_activations(a, block), block)
    return (a @ dequantize_fp8(weight, scale, block).T).to(x.dtype)


def grouped_gemm(rows: torch.Tensor, offs: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, fmt: str,
                 block: int) -> torch.Tensor:
    out = torch.empty(rows.shape[0], weight.shape[1], dtype=rows.dtype, device=rows.device)
    start = 0
    for e, end in enumerate(offs.tolist()):
        if end > start:
            w = dequantize_weight(weight[e], scale[e], fmt, block)
            out[start:end] = (rows[start:end].float() @ w.T).to(rows.dtype)
        start = end
    return out


def weight_only_fp8_linear(grouped_gemm):
    """An `fp8_linear` that leaves activations unquantized (W8A16), built from a backend's weight-only
    `grouped_gemm` with one group."""
    def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: int) -> torch.Tensor:
        offs = torch.full((1,), x.shape[0], dtype=torch.int32, device=x.device)
        return grouped_gemm(x, offs, weight[None], scale[None], "fp8", block)
    return fp8_linear
