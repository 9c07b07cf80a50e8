"""EncoderCache: image embeddings already computed, by image digest, in an LRU bounded in bytes (docs/vision.md).

A prompt's image is encoded (ViT + Aligner) when the first chunk that reads its span runs; the later chunks of the
same prompt, a preempted request computing again, and any later request holding the same image (another
conversation, a second turn past a prefix hit's end) take the rows from here. What does not fit is evicted least
recently used first; an entry larger than the whole budget is used once and not kept.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable

import torch


class EncoderCache:
    def __init__(self, capacity_bytes: int):
        self.capacity_bytes = capacity_bytes
        self._entries: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self.bytes = 0
        self.hits = 0
        self.misses = 0

    def get_or_encode(self, digest: bytes, encode: Callable[[], torch.Tensor]) -> torch.Tensor:
        out = self._entries.get(digest)
        if out is not None:
            self._entries.move_to_end(digest)
            self.hits += 1
            return out
        self.misses += 1
        out = encode()
        size = out.numel() * out.element_size()
        if size <= self.capacity_bytes:
            while self.bytes + size > self.capacity_bytes:
                _, old = self._entries.popitem(last=False)
                self.bytes -= old.numel() * old.element_size()
            self._entries[digest] = out
            self.bytes += size
        return out

    def __len__(self) -> int:
        return len(self._entries)
