"""Cache kinds a model declares; the KV manager and runner size and allocate from these alone.

Two kinds cover the DeepInfer models (spec 003 §3, 000 §5.2):
- `PagedCacheSpec`: state that grows with the sequence, paged in blocks of `block_size` tokens and shareable
  across requests through the prefix cache: full-attention K/V (`tokens_per_entry=1`) or compressed
  entries (one entry per `tokens_per_entry` tokens, e.g. V4's CSA ratio 4 / HCA ratio 128, indexer keys).
  Paged kinds share one block table: block i of a request covers tokens [i*B, (i+1)*B) in every kind. Kinds
  with a `window` (sliding-window layers: a query at p reads keys p-W < j <= p) form the window group: their own
  pool and table, with the same indexing, whose blocks before the window are released (window_group.py).
- `RequestStateSpec`: fixed-size state per running request, independent of length (a sliding-window ring,
  a compressor's partial state across chunk boundaries). One slot per running request; not prefix-cached.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class PagedCacheSpec:
    name: str
    num_layers: int
    entry_shape: tuple[int, ...]     # one entry, e.g. (2, num_kv_heads, head_dim) for K and V
    dtype: torch.dtype
    tokens_per_entry: int = 1
    window: int | None = None        # sliding-window layers' kinds: the window group (window_group.py)

    def block_shape(self, block_size: int) -> tuple[int, ...]:
        if block_size % self.tokens_per_entry:
            raise ValueError(f"block_size {block_size} must be a multiple of {self.name}'s "
                             f"tokens_per_entry {self.tokens_per_entry}")
        return (block_size // self.tokens_per_entry, *self.entry_shape)

    def bytes_per_block(self, block_size: int) -> int:
        return self.num_layers * _nbytes(self.block_shape(block_size), self.dtype)


@dataclass(frozen=True)
class RequestStateSpec:
    name: str
    num_layers: int
    state_shape: tuple[int, ...]
    dtype: torch.dtype
    # False when the state is empty at every block boundary (nothing to keep for prefix reuse), e.g. a
    # compressor whose windows divide the block size
    needed_at_block_boundary: bool = True

    def bytes_per_slot(self) -> int:
        return self.num_layers * _nbytes(self.state_shape, self.dtype)


CacheSpec = PagedCacheSpec | RequestStateSpec
