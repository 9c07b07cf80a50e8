"""BlockPool: reference-counted KV blocks, the prefix-cache hash table, and LRU eviction.

A block whose ref count drops to zero goes to the tail of the free queue but keeps its hash, so a later
request with the same prefix can take it back (a prefix-cache hit). Allocation takes from the head of the
free queue: the least recently freed block, whose hash (if any) is evicted then.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool):
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        # Blocks never handed out are made when first allocated (ids `_next_fresh` on): a CPU pool of a tiny
        # model holds up to millions of blocks, and making them all at start cost seconds per engine. They are
        # the head of the free queue, in id order, ahead of every freed block, as if all were queued at start.
        self._next_fresh = 0
        self._free: OrderedDict[int, KVBlock] = OrderedDict()     # blocks freed at least once, LRU first
        self._cached: dict[bytes, KVBlock] = {}
        self.num_evictions = 0

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (free, cached-but-unreferenced included)."""
        return self.num_blocks - self._next_fresh + len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def lookup(self, block_hash: bytes) -> KVBlock | None:
        return self._cached.get(block_hash)

    def allocate(self, n: int) -> list[KVBlock]:
        if n > self.num_free_blocks:
            raise RuntimeError(f"asked for {n} blocks, {self.num_free_blocks} free")
        fresh = min(n, self.num_blocks - self._next_fresh)
        out = [KVBlock(i, ref_cnt=1) for i in range(self._next_fresh, self._next_fresh + fresh)]
        self._next_fresh += fresh
        for _ in range(n - fresh):
            _, block = self._free.popitem(last=False)
            if block.block_hash is not None:
                del self._cached[block.block_hash]
                block.block_hash = None
                self.num_evictions += 1
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: list[KVBlock]) -> None:
        """Take a reference on cache-hit blocks, pulling free ones out of the eviction queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free(self, blocks: list[KVBlock]) -> None:
        """Drop one reference each; pass blocks tail-first so a sequence's tail is evicted before its head."""
        for block in blocks:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, f"block {block.block_id} freed twice"
            if block.ref_cnt == 0:
                self._free[block.block_id] = block

    def cache(self, block: KVBlock, block_hash: bytes) -> bool:
        """Register a full, computed block under its hash (first writer wins on duplicates); True if this
        call registered it."""
        if not self.enable_caching or block.block_hash is not None:
            return False
        if block_hash in self._cached:
            return False
        block.block_hash = block_hash
        self._cached[block_hash] = block
        return True

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; only possible when no block is referenced."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in self._cached.values():
            block.block_hash = None
        self._cached.clear()
        return True
