"""Small building blocks shared by decoder models: RMSNorm, rotary embedding, SiLU-gated MLP."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rope_inv_freq(rotary_dim: int, theta: float, scaling: dict | None) -> torch.Tensor:
    """Inverse frequencies for RoPE: default, linear and llama3 scaling (HF `rope_parameters` semantics)."""
    # float32 throughout, as HF computes it, so positions far out agree with the reference
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64, device="cpu").float() / rotary_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / scaling["factor"]
    if kind == "llama3":
        factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
        old_len = scaling["original_max_position_embeddings"]
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"unsupported rope scaling type {kind!r} (supported: default, linear, llama3)")


class RotaryEmbedding(nn.Module):
    """Neox-style (rotate-half) RoPE with a precomputed cos/sin table indexed by position."""

    def __init__(self, head_dim: int, max_positions: int, theta: float, scaling: dict | None):
        super().__init__()
        self.head_dim, self.max_positions, self.theta, self.scaling = head_dim, max_positions, theta, scaling
        self.register_buffer("cos", torch.empty(0), persistent=False)
        self.register_buffer("sin", torch.empty(0), persistent=False)
        self.reset_tables(torch.empty(0).device)   # the default device (meta while building for a checkpoint)

    def reset_tables(self, device: torch.device) -> None:
        """(Re)compute the float32 tables on `device` (after meta-device construction or a dtype cast)."""
        inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling).to(device)
        freqs = torch.outer(torch.arange(self.max_positions, dtype=torch.float32, device=device), inv_freq)
        self.cos, self.sin = freqs.cos(), freqs.sin()

    def forward(self, positions: torch.Tensor, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        cos = self.cos[positions].unsqueeze(1)   # [T, 1, D/2]
        sin = self.sin[positions].unsqueeze(1)
        out = []
        for x in xs:                              # [T, heads, D]
            x1, x2 = x.float().chunk(2, dim=-1)
            out.append(torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype))
        return tuple(out)


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), with gate and up fused into one matmul."""

    def __init__(self, hidden: int, intermediate: int, bias: bool = False):
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)
