"""Weight-only int4 linear layers for the CPU (`quantization="int4"`).

A decode step on the CPU is bound by streaming the weights (BENCHMARKS.md: 48.9 ms of pure fp32 matmuls
per SmolLM2 token on 2 cores). Packed int4 weights with bf16 activations run through torch's CPU kernel
(`_weight_int4pack_mm_for_cpu`) instead. Quantization is asymmetric per group of 32 input columns:
w ≈ (q − 8)·scale + zero with q in [0, 15] and (scale, zero) in bf16, which is how llama.cpp's Q4_1 stores
weights (q·d + m with the block's min and max on the grid), so a Q4_1 GGUF is represented up to rounding
its fp16 scales to bf16. Tested against dense bf16 with the dequantized weights (tests/test_int4.py).
"""

from __future__ import annotations

import torch
from torch import nn

GROUP = 32


def quantize_int4(w: torch.Tensor, group: int = GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] (float) -> (q [N, K] int32 in [0, 15], scales_and_zeros [K/group, N, 2] bf16)."""
    n, k = w.shape
    if k % group:
        raise ValueError(f"int4 quantization needs in_features divisible by {group}, got {k}")
    wg = w.float().reshape(n, k // group, group)
    lo, hi = wg.amin(-1, keepdim=True), wg.amax(-1, keepdim=True)
    scale = ((hi - lo) / 15).clamp(min=1e-10)
    q = ((wg - lo) / scale).round().clamp(0, 15).to(torch.int32).reshape(n, k)
    sz = torch.stack([scale.squeeze(-1), (lo + 8 * scale).squeeze(-1)], dim=-1)   # [N, K/group, 2]
    return q, sz.transpose(0, 1).contiguous().to(torch.bfloat16)


def dequantize_int4(q: torch.Tensor, sz: torch.Tensor, group: int = GROUP) -> torch.Tensor:
    """The weights an Int4Linear computes with, as a dense float32 [N, K] matrix (the reference)."""
    n, k = q.shape
    s = sz.float().transpose(0, 1)                                   # [N, K/group, 2]
    wg = (q.float().reshape(n, k // group, group) - 8) * s[..., :1] + s[..., 1:]
    return wg.reshape(n, k)


class Int4Linear(nn.Module):
    def __init__(self, linear: nn.Linear, group: int = GROUP):
        super().__init__()
        q, sz = quantize_int4(linear.weight.data, group)
        self.in_features, self.out_features, self.group = linear.in_features, linear.out_features, group
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1))
        self.register_buffer("scales_and_zeros", sz)
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.data.to(torch.bfloat16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.reshape(-1, shape[-1]).to(torch.bfloat16), self.packed,
                                                       self.group, self.scales_and_zeros)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*shape[:-1], self.out_features)


def quantize_linears(model: nn.Module, skip: tuple[str, ...] = ("lm_head",)) -> int:
    """Replace every nn.Linear (but `skip`) by an Int4Linear built from its current (full-precision) weights."""
    count = 0
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if isinstance(child, nn.Linear) and not any(full.endswith(s) for s in skip):
                setattr(module, child_name, Int4Linear(child))
                count += 1
    return count
