"""Paged attention: metadata, the backend interface, and the torch reference backend.

The reference backend is plain torch (SDPA over K/V gathered from the paged cache). It is correct on CPU
and CUDA for any mix of decodes and prefill chunks (with or without prefix-cache hits), and it is what every
faster kernel is tested against.

Cache layout per layer: [num_blocks, block_size, 2, num_kv_heads, head_dim] (K at [:, :, 0], V at [:, :, 1]).
Batch layout: decode rows (one query token per sequence) come first and run as one padded SDPA call; each
prefill chunk then runs on its own with a causal mask offset by the tokens already in its context.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F


@dataclass
class PrefillChunk:
    query_start: int        # first row of this chunk in the flattened batch
    query_len: int
    context_len: int        # tokens in the cache after this step (cached prefix + this chunk)
    block_ids: torch.Tensor  # [ceil(context_len / block_size)] long


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor            # [num_tokens] flat cache slot of each new token
    num_decode_tokens: int = 0            # rows [0, num_decode_tokens) are single-token sequences
    decode_block_tables: torch.Tensor | None = None   # [num_decodes, max_blocks] (padded with 0)
    decode_context_lens: torch.Tensor | None = None   # [num_decodes]
    prefills: list[PrefillChunk] = field(default_factory=list)


class AttentionBackend(Protocol):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """q [T, H, D], k/v [T, KVH, D] for the new tokens; writes k/v into kv_cache; returns [T, H, D]."""
        ...


def write_kv(kv_cache: torch.Tensor, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    flat = kv_cache.view(-1, *kv_cache.shape[2:])
    flat[slot_mapping] = torch.stack((k, v), dim=1).to(kv_cache.dtype)


class TorchPagedAttention:
    """Reference backend (see module docstring)."""

    def forward(self, q, k, v, kv_cache, meta, scale):
        write_kv(kv_cache, meta.slot_mapping, k, v)
        out = torch.empty_like(q)
        nd = meta.num_decode_tokens
        if nd:
            ctx = kv_cache[meta.decode_block_tables].flatten(1, 2)          # [B, L, 2, KVH, D]
            keys, vals = ctx[:, :, 0].transpose(1, 2), ctx[:, :, 1].transpose(1, 2)  # [B, KVH, L, D]
            valid = torch.arange(ctx.shape[1], device=q.device) < meta.decode_context_lens[:, None]
            o = F.scaled_dot_product_attention(q[:nd].unsqueeze(2), keys, vals, attn_mask=valid[:, None, None, :],
                                               scale=scale, enable_gqa=True)
            out[:nd] = o.squeeze(2)
        for p in meta.prefills:
            ctx = kv_cache[p.block_ids].flatten(0, 1)[:p.context_len]       # [L, 2, KVH, D]
            keys, vals = ctx[:, 0].transpose(0, 1), ctx[:, 1].transpose(0, 1)   # [KVH, L, D]
            rows = slice(p.query_start, p.query_start + p.query_len)
            qs = q[rows].transpose(0, 1)                                     # [H, q, D]
            if p.query_len == p.context_len:
                o = F.scaled_dot_product_attention(qs, keys, vals, is_causal=True, scale=scale, enable_gqa=True)
            else:
                q_pos = torch.arange(p.context_len - p.query_len, p.context_len, device=q.device)
                mask = torch.arange(p.context_len, device=q.device)[None, :] <= q_pos[:, None]
                o = F.scaled_dot_product_attention(qs, keys, vals, attn_mask=mask, scale=scale, enable_gqa=True)
            out[rows] = o.transpose(0, 1)
        return out
