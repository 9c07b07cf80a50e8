"""The window group: sliding-window layers' KV in their own block pool, released past the window.

A model's windowed layers (Gemma-3's sliding layers; `PagedCacheSpec.window`) read only the last W positions,
so keeping every block of theirs would make a request's memory grow with its length for nothing. Their paged
kinds form a second group (vLLM v1's "KV cache groups"): its own `BlockPool`, its own cache tensors (one page
more, the scratch page, as the full group's), and per request a second block table with the same logical
indexing (entry i covers tokens [i*B, (i+1)*B)). The KV manager drives it beside the full group's table.

What is held: when a step starts at position s (the request's computed tokens; a replay's start), no query of
this or any later step reads a key before the window of the last block boundary at or before s
(`window_blocks(s // B, B, W)`; a verify step's rejected drafts are rolled back to positions >= s, never
before). Entries before that block are released (a reference dropped; the block keeps its hash, so a prefix hit
can still find it until the pool reuses it) and point at the scratch page (`null_id`) in the table; the kernels
mask those positions (the decode kernel starts at the window, the prefill kernel never lets a pre-window key
into its sums). So a running request holds at most ceil((W-1)/B) + 1 blocks of window plus the blocks of the
chunk it runs: its window-group memory is bounded by the window, not its length.

Prefix hits: a window block is registered under the same block hash as its full-group block once its rows are
computed (or loaded). A hit of n blocks has its windowed rows when this pool still holds the blocks of
`window_blocks(n, B, W)` (`rows_present`); otherwise the hit rule of bounded_replay.py applies (SWA state from
host memory, or a replay), with fresh window blocks for the missing rows.
"""

from __future__ import annotations

from openinfer.kv_cache.block_pool import BlockPool, KVBlock
from openinfer.kv_cache.bounded_replay import window_blocks


class WindowGroup:
    def __init__(self, num_blocks: int, block_size: int, window: int, enable_caching: bool):
        self.pool = BlockPool(num_blocks, enable_caching)
        self.block_size, self.window = block_size, window
        self.null_id = num_blocks                     # the scratch page: released entries point at it
        self._blocks: dict[str, list[KVBlock | None]] = {}
        self._ids: dict[str, list[int]] = {}
        self._released: dict[str, int] = {}           # leading entries released (None; later None entries: not
        #                                               allocated yet, a replay's rows not reached)
        self._registered: dict[str, int] = {}         # leading entries offered to the prefix cache

    def block_ids(self, request_id: str) -> list[int]:
        """The request's window table as ids (a live view), released entries at `null_id`."""
        return self._ids.get(request_id, [])

    def num_held(self, request_id: str) -> int:
        """Window blocks the request holds now (the bound tests check)."""
        return sum(b is not None for b in self._blocks.get(request_id, ()))

    def first_needed(self, start: int, floor: int = 0) -> int:
        """The first table entry a step starting at `start` (and every later step) may read: the window of the
        last block boundary at or before it; `floor`: a bounded replay's window floor (nothing before it)."""
        return max(window_blocks(start // self.block_size, self.block_size, self.window).start,
                   floor // self.block_size)

    def rows_present(self, hashes: list[bytes]) -> list[bool]:
        """Per hit block: whether this pool still holds its windowed rows."""
        return [self.pool.lookup(h) is not None for h in hashes]

    def plan(self, request_id: str, num_entries: int, first: int, upto: int,
             hashes: list[bytes]) -> dict[int, KVBlock | None]:
        """What the entries from `first` on of a table of `num_entries` would take: a cached block found under its
        hash (entries below len(hashes), at admission: a replay's kept blocks are taken then, before the pool can
        reuse them), or None for a fresh block, for entries below `upto` (those the step writes or loads). Entries
        held already are left out; the others stay unallocated (at `null_id`) until a step reaches them."""
        table = self._blocks.get(request_id, [])
        out: dict[int, KVBlock | None] = {}
        for i in range(first, num_entries):
            if i < len(table) and table[i] is not None:
                continue
            block = self.pool.lookup(hashes[i]) if i < len(hashes) else None
            if block is not None or i < upto:
                out[i] = block
        return out

    def can_take(self, planned: dict[int, KVBlock | None]) -> bool:
        fresh = sum(b is None for b in planned.values())
        reclaimed = sum(1 for b in planned.values() if b is not None and b.ref_cnt == 0)   # cached, in the free queue
        return fresh <= self.pool.num_free_blocks - reclaimed

    def extend(self, request_id: str, num_entries: int, first: int,
               planned: dict[int, KVBlock | None]) -> dict[int, int]:
        """Grow the table to `num_entries` and take the planned blocks (entries before `first` released); returns
        {entry: block id} of the fresh blocks."""
        table = self._blocks.setdefault(request_id, [])
        ids = self._ids.setdefault(request_id, [])
        table.extend([None] * (num_entries - len(table)))
        ids.extend([self.null_id] * (num_entries - len(ids)))
        self.pool.touch([b for b in planned.values() if b is not None])
        fresh = iter(self.pool.allocate(sum(b is None for b in planned.values())))
        new: dict[int, int] = {}
        for i, block in planned.items():
            if block is None:
                block = next(fresh)
                new[i] = block.block_id
            table[i], ids[i] = block, block.block_id
        self.release(request_id, first)
        return new

    def release(self, request_id: str, first: int) -> None:
        """Entries before `first` go back to the pool (oldest first: they are evicted first), hashes kept."""
        table = self._blocks.get(request_id)
        done = self._released.get(request_id, 0)
        if table is None or first <= done:
            return
        ids = self._ids[request_id]
        gone = []
        for i in range(done, min(first, len(table))):
            if table[i] is not None:
                gone.append(table[i])
                table[i], ids[i] = None, self.null_id
        self.pool.free(gone)
        self._released[request_id] = max(done, min(first, len(table)))

    def register(self, request_id: str, hashes: list[bytes], upto: int) -> None:
        """Offer the prefix cache the held entries below `upto` whose rows are computed (or loaded)."""
        table = self._blocks.get(request_id, [])
        start = self._registered.get(request_id, 0)
        for i in range(start, min(upto, len(table), len(hashes))):
            if table[i] is not None:
                self.pool.cache(table[i], hashes[i])
        self._registered[request_id] = max(start, min(upto, len(table), len(hashes)))

    def window_ids(self, request_id: str, entries: range) -> list[int] | None:
        """The block ids of these entries, None if any was released."""
        table = self._blocks.get(request_id, [])
        if entries.stop > len(table) or any(table[i] is None for i in entries):
            return None
        return [table[i].block_id for i in entries]

    def free(self, request_id: str) -> None:
        self.pool.free([b for b in reversed(self._blocks.pop(request_id, [])) if b is not None])
        self._ids.pop(request_id, None)
        self._released.pop(request_id, None)
        self._registered.pop(request_id, None)
