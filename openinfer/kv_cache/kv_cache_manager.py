"""KVCacheManager: decides *where* a request's cache lives; owns block tables, hashes and state slots.

The scheduler asks it two things: which prefix of a new request is already cached, and whether the slots
for N more tokens can be had. It never touches tensors; the runner maps block ids to memory.

Prefix caching: block i of a request is keyed by sha256(hash of block i-1 || its token ids), so a hit on
block i implies the whole prefix before it matches. Models with per-request state (a sliding-window ring,
compressor rows) also need that state as it was at the end of the hit: a step that ends a request's
computed tokens on a block boundary queues a copy of its state slot into a snapshot slot keyed by that
block's hash (spec 003 §3.2: saved at 128-token boundaries only), and a hit counts only up to the last
block with a snapshot, which is copied into the new request's slot before the step runs (§3.3). A block is registered once all its tokens are
scheduled; within one step every layer writes the whole batch's KV before any attention reads it, so a
request scheduled after the writer in the same step may already share the block.

With a prefix-KV store (kv_store.py, docs/kv_cache.md) the lookup goes on where the GPU pool's hits stop:
the following full blocks are read from the store *here*, at schedule time, and their bytes travel to the
runner with the step (`StateCopies.kv_loads`), which writes them into freshly allocated blocks before the
forward. Reading at schedule time leaves no window for an entry to vanish between "hit" and "load": a hit is
bytes in hand, or a miss. Each block registered in the prefix cache for the first time (not one just loaded)
is queued for saving (`StateCopies.kv_saves`); the runner copies it out after the step's forward.
Models with per-request state are not stored yet (their window state would need a tier of its own).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field

from openinfer.engine.request import Request
from openinfer.kv_cache.block_pool import BlockPool, KVBlock
from openinfer.kv_cache.kv_store import TieredKVStore, resolve_ttl


def hash_block(parent: bytes | None, token_ids: list[int]) -> bytes:
    h = hashlib.sha256(parent or b"")
    h.update(array("q", token_ids).tobytes())
    return h.digest()


@dataclass
class PrefixCacheStats:
    queried_tokens: int = 0
    hit_tokens: int = 0
    store_hit_tokens: int = 0     # of hit_tokens, those read from the prefix-KV store

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


@dataclass
class StateCopies:
    """Copies for the runner: restores (snapshot -> slot) before the step's forward, saves (slot -> snapshot)
    after it; with a prefix-KV store, kv_loads (block id, its bytes from the store) before the forward and
    kv_saves (block id, block hash, TTL in seconds) after it."""
    restores: list[tuple[int, int]] = field(default_factory=list)
    saves: list[tuple[int, int]] = field(default_factory=list)
    kv_loads: list[tuple[int, bytes]] = field(default_factory=list)
    kv_saves: list[tuple[int, bytes, float]] = field(default_factory=list)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool, num_state_slots: int = 0,
                 num_state_snapshots: int = 0, min_uncached_tokens: int = 1, store: TieredKVStore | None = None):
        """`min_uncached_tokens`: a prefix hit leaves at least this many tokens to compute (1: the token that
        yields the logits; DeepSeek-V4.1's YOCO prefill needs its decoder tail, spec 000 §5.6).
        `store`: the prefix-KV store behind the pool (models without per-request state only)."""
        if store is not None and (num_state_slots or not enable_prefix_caching):
            raise ValueError("a prefix-KV store needs prefix caching and a model without per-request state")
        self.store = store
        self._store_hits: dict[str, list[bytes]] = {}          # request -> store blocks after its pool hits
        self._fetched: dict[str, dict[bytes, bytes]] = {}      # request -> blocks read so far (retries reuse)
        self.block_size = block_size
        self.min_uncached_tokens = min_uncached_tokens
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.prefix_stats = PrefixCacheStats()
        self._blocks: dict[str, list[KVBlock]] = {}
        self._block_ids: dict[str, list[int]] = {}   # the same tables as ids (what the runner reads)
        self._num_registered: dict[str, int] = {}   # leading blocks already offered to the prefix cache
        self._free_state_slots = list(range(num_state_slots - 1, -1, -1))
        self._state_slot: dict[str, int] = {}
        self.num_state_slots = num_state_slots
        # block hash -> snapshot slot, least recently used first
        self._snapshots: OrderedDict[bytes, int] = OrderedDict()
        self._free_snapshots = list(range(num_state_snapshots - 1, -1, -1))
        self.num_state_snapshots = num_state_snapshots
        self._restore: dict[str, int] = {}      # request -> snapshot slot to restore once it has a slot
        self._unkeyed: dict[str, tuple[int, int]] = {}   # request -> (block index, snapshot) awaiting its hash
        self.state_copies = StateCopies()       # drained by the scheduler into each step's output

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def block_ids(self, request_id: str) -> list[int]:
        """The request's block table as ids (a live view: read it, don't keep or change it)."""
        return self._block_ids.get(request_id, [])

    def state_slot(self, request_id: str) -> int | None:
        return self._state_slot.get(request_id)

    def _extend_hashes(self, request: Request) -> None:
        bs = self.block_size
        hashes = request.block_hashes
        for i in range(len(hashes), request.num_tokens // bs):
            hashes.append(hash_block(hashes[-1] if hashes else None, request.token_ids_slice(i * bs, (i + 1) * bs)))

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """Longest cached prefix of full blocks, leaving at least one token to compute (it yields the logits).

        Requests asking for prompt_logprobs skip the lookup: cached positions would have no logits.
        """
        if not self.enable_prefix_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        if self.num_state_slots and not self.num_state_snapshots:
            return [], 0
        self._extend_hashes(request)
        max_blocks = max(request.num_tokens - self.min_uncached_tokens, 0) // self.block_size
        hits: list[KVBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        store_hits = 0
        if self.store is not None:
            found = self._store_lookup(request, len(hits), max_blocks)
            self._store_hits[request.request_id] = found
            store_hits = len(found)
            self.prefix_stats.store_hit_tokens += store_hits * self.block_size
        if self.num_state_slots:   # usable up to the last hit block whose end state was kept
            while hits and request.block_hashes[len(hits) - 1] not in self._snapshots:
                hits.pop()
            if hits:
                h = request.block_hashes[len(hits) - 1]
                self._snapshots.move_to_end(h)
                self._restore[request.request_id] = self._snapshots[h]
        self.prefix_stats.queried_tokens += request.num_tokens
        self.prefix_stats.hit_tokens += (len(hits) + store_hits) * self.block_size
        return hits, (len(hits) + store_hits) * self.block_size

    def _store_lookup(self, request: Request, start: int, end: int) -> list[bytes]:
        """Blocks start.. of the request found in the store, in order, as bytes; no more than the pool could
        take now. A request that waits (no room yet) keeps what was read for its next try."""
        fetched = self._fetched.setdefault(request.request_id, {})
        wanted = request.block_hashes[start:min(end, start + self.pool.num_free_blocks)]
        out: list[bytes] = []
        for block_hash in wanted:                  # what an earlier try read already
            if block_hash not in fetched:
                break
            out.append(fetched[block_hash])
        for block_hash, payload in zip(wanted[len(out):], self.store.get_prefix(wanted[len(out):])):
            fetched[block_hash] = payload
            out.append(payload)
        return out

    def can_fit(self, num_tokens: int) -> bool:
        """Whether a request of this many tokens could ever be held, with the pool otherwise empty."""
        return -(-num_tokens // self.block_size) <= self.pool.num_blocks

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed_blocks: list[KVBlock] | None = None) -> bool:
        """Make room for `num_new_tokens` more tokens after the computed ones (plus cache hits); False if the
        pool can't, in which case nothing changed."""
        rid = request.request_id
        blocks = self._blocks.get(rid)
        if blocks is not None and not computed_blocks and rid not in self._store_hits:
            # fast path (most decode steps): the tokens fit the last block and no block fills up
            total = request.num_computed_tokens + num_new_tokens
            if (total <= len(blocks) * self.block_size and (self.num_state_slots == 0 or rid in self._state_slot)
                    and (not self.enable_prefix_caching
                         or min(total, request.num_tokens) // self.block_size <= self._num_registered.get(rid, 0))
                    and not (self.num_state_snapshots and (total % self.block_size == 0 or rid in self._unkeyed))):
                return True
        computed_blocks = computed_blocks or []
        loaded = self._store_hits.get(rid, []) if self.store is not None else []
        blocks = self._blocks.setdefault(rid, [])
        total = request.num_computed_tokens + (len(computed_blocks) + len(loaded)) * self.block_size + num_new_tokens
        need = -(-total // self.block_size) - len(blocks) - len(computed_blocks)
        reclaimed = sum(1 for b in computed_blocks if b.ref_cnt == 0)   # hits now sitting in the free queue
        need_slot = self.num_state_slots > 0 and rid not in self._state_slot
        if max(need, 0) > self.pool.num_free_blocks - reclaimed or (need_slot and not self._free_state_slots):
            if not blocks:
                del self._blocks[rid]
            return False
        self.pool.touch(computed_blocks)
        new_blocks = computed_blocks + (self.pool.allocate(need) if need > 0 else [])
        no_save = 0                  # leading blocks of the table that came from the store (saved already)
        if loaded:
            no_save = len(computed_blocks) + len(loaded)
            for block, payload in zip(new_blocks[len(computed_blocks):], loaded):
                self.state_copies.kv_loads.append((block.block_id, payload))
        if self.store is not None:
            self._store_hits.pop(rid, None)
            self._fetched.pop(rid, None)
        blocks.extend(new_blocks)
        self._block_ids.setdefault(rid, []).extend(b.block_id for b in new_blocks)
        if need_slot:
            self._state_slot[rid] = self._free_state_slots.pop()
        snapshot = self._restore.pop(rid, None)
        if snapshot is not None and computed_blocks:
            self.state_copies.restores.append((snapshot, self._state_slot[rid]))
        if self.enable_prefix_caching:
            self._extend_hashes(request)
            start = self._num_registered.get(rid, 0)
            full = min(total, request.num_tokens) // self.block_size
            for i in range(start, full):
                if self.pool.cache(blocks[i], request.block_hashes[i]) and self.store is not None and i >= no_save:
                    ttl = resolve_ttl(request.sampling_params.cache_ttl, self.store.default_ttl_s)
                    self.state_copies.kv_saves.append((blocks[i].block_id, request.block_hashes[i], ttl))
            self._num_registered[rid] = max(start, full)
            if self.num_state_snapshots:
                self._snapshot_state(request, total)
        return True

    def _snapshot_state(self, request: Request, total: int) -> None:
        """After this step the request's state is at `total` tokens: keep a copy when that is a block
        boundary. Under async scheduling the block's last token may still be on the device: the copy is
        taken now and keyed once the token (so the block hash) is known."""
        rid, hashes = request.request_id, request.block_hashes
        unkeyed = self._unkeyed.get(rid)
        if unkeyed is not None and len(hashes) > unkeyed[0]:
            del self._unkeyed[rid]
            self._key_snapshot(hashes[unkeyed[0]], unkeyed[1])
        if total % self.block_size or total == 0:
            return
        index = total // self.block_size - 1
        if index < len(hashes) and hashes[index] in self._snapshots:
            self._snapshots.move_to_end(hashes[index])
            return
        if self._free_snapshots:
            snap = self._free_snapshots.pop()
        elif self._snapshots:
            snap = self._snapshots.popitem(last=False)[1]
        else:
            return
        self.state_copies.saves.append((self._state_slot[rid], snap))
        if index < len(hashes):
            self._key_snapshot(hashes[index], snap)
        else:
            self._unkeyed[rid] = (index, snap)

    def _key_snapshot(self, block_hash: bytes, snap: int) -> None:
        if block_hash in self._snapshots:      # another request kept the same state meanwhile
            self._free_snapshots.append(snap)
        else:
            self._snapshots[block_hash] = snap

    def take_state_copies(self) -> StateCopies:
        copies, self.state_copies = self.state_copies, StateCopies()
        return copies

    def free(self, request: Request) -> None:
        rid = request.request_id
        self._restore.pop(rid, None)
        self._store_hits.pop(rid, None)
        self._fetched.pop(rid, None)
        unkeyed = self._unkeyed.pop(rid, None)
        if unkeyed is not None:
            self._free_snapshots.append(unkeyed[1])
        self.pool.free(list(reversed(self._blocks.pop(rid, []))))
        self._block_ids.pop(rid, None)
        self._num_registered.pop(rid, None)
        slot = self._state_slot.pop(rid, None)
        if slot is not None:
            self._free_state_slots.append(slot)

    def reset_prefix_cache(self) -> bool:
        ok = self.pool.reset_prefix_cache()
        if ok:
            self._free_snapshots.extend(self._snapshots.values())
            self._snapshots.clear()
        return ok
