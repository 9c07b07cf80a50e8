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
Models with per-request state (DeepSeek-V4/V4.1) keep it in the store too: a snapshot keyed by a block hash is
also written to `state_store` (same tiers, its own key: `state_key`), and a hit through the store ends at the last
block whose state is found, in a snapshot slot or in the store (`StateCopies.state_loads`, written into the
request's slot before the forward).

Sliding-window models (Gemma-3; kv_cache/window_group.py, bounded_replay.py): the windowed layers' KV lives in a
second block pool, the window group, with a second table per request whose entries before the window are released
as the request advances (`window_block_ids`). Admission checks both pools and changes neither when one cannot take
the request. A hit's windowed rows are present when the window group still holds the blocks of its last window
(registered under the same hashes); blocks from the prefix-KV store never have them (it keeps only the
full-attention layers' rows). A hit whose last window misses rows gets them from the host-memory SWA state tier
(saved when a request ends, at its last block boundary: `StateCopies.swa_saves` / `swa_loads`) or replays the end
of its prefix (`replay_plan`; without a store always "exact": the pool alone never approximates).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field

from openinfer.kv_cache.block_pool import BlockPool, KVBlock
from openinfer.kv_cache.bounded_replay import ReplayPlan, SlidingWindowLayout, plan_replay, window_blocks
from openinfer.kv_cache.kv_store import TieredKVStore
from openinfer.kv_cache.window_group import WindowGroup
from openinfer.multimodal import block_image_key
from openinfer.request import Request
from openinfer.sampling_params import resolve_ttl


def hash_block(parent: bytes | None, token_ids: list[int], extra: bytes = b"") -> bytes:
    """`extra`: what the block holds beyond its tokens (the digests of the images it overlaps)."""
    h = hashlib.sha256(parent or b"")
    h.update(array("q", token_ids).tobytes())
    if extra:
        h.update(b"images:" + extra)
    return h.digest()


@dataclass
class PrefixCacheStats:
    queried_tokens: int = 0
    hit_tokens: int = 0
    store_hit_tokens: int = 0     # of hit_tokens, those read from the prefix-KV store
    # sliding-window models: hits whose window state came from host memory, and replays (bounded_replay.py)
    swa_state_hits: int = 0
    swa_replays: int = 0
    swa_replayed_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


@dataclass
class StateCopies:
    """Copies for the runner: restores (snapshot -> slot) before the step's forward, saves (slot -> snapshot)
    after it; with a prefix-KV store, kv_loads (block id, its bytes from the store) before the forward and
    kv_saves (block id, block hash, TTL in seconds) after it. Sliding-window models: swa_saves (the window's
    block ids, the hash of its last block), the windowed rows of a request that ended, which the engine copies
    out at once (LLMEngine._keep_window_state); swa_loads (one block id per window block, None for a block that
    keeps its rows, the state's bytes), written before the forward."""
    restores: list[tuple[int, int]] = field(default_factory=list)
    saves: list[tuple[int, int]] = field(default_factory=list)
    kv_loads: list[tuple[int, bytes]] = field(default_factory=list)
    kv_saves: list[tuple[int, bytes, float]] = field(default_factory=list)
    swa_saves: list[tuple[list[int], bytes]] = field(default_factory=list)
    swa_loads: list[tuple[list[int | None], bytes]] = field(default_factory=list)
    # models with per-request state and a store: (slot, state bytes) before the forward; (snapshot, key, TTL)
    # after it (after that step's saves)
    state_loads: list[tuple[int, bytes]] = field(default_factory=list)
    state_saves: list[tuple[int, bytes, float]] = field(default_factory=list)


def state_key(block_hash: bytes) -> bytes:
    """The store key of the per-request state at the end of this block (apart from the block's own key)."""
    return hashlib.sha256(b"openinfer-request-state:" + block_hash).digest()


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool, num_state_slots: int = 0,
                 num_state_snapshots: int = 0, min_uncached_tokens: int = 1, store: TieredKVStore | None = None,
                 swa: SlidingWindowLayout | None = None, swa_state=None, swa_replay: str = "bounded",
                 state_store: TieredKVStore | None = None, num_window_blocks: int = 0):
        """`min_uncached_tokens`: a prefix hit leaves at least this many tokens to compute (1: the token that
        yields the logits; DeepSeek-V4.1's YOCO prefill needs its decoder tail, spec 000 §5.6).
        `store`: the prefix-KV store behind the pool; `state_store`: where models with per-request state keep it
        at stored block boundaries (required for them with a store).
        `swa`: the model's sliding-window layers, whose KV lives in the window group of `num_window_blocks` blocks
        (window_group.py); `swa_state`: the host-memory tier (tiers.HostMemoryTier) for window state, or None;
        `swa_replay`: the replay mode for a hit without it (bounded_replay.py; "exact" without a store)."""
        if swa is not None and num_window_blocks < 1:
            raise ValueError("a model with sliding-window layers needs a window group (num_window_blocks >= 1)")
        if store is not None and (not enable_prefix_caching or (
                num_state_slots and (state_store is None or not num_state_snapshots))):
            raise ValueError("a prefix-KV store needs prefix caching, and for a model with per-request state, state "
                             "snapshots and a state store")
        self.store = store
        self.state_store = state_store if num_state_slots else None
        self._state_loads: dict[str, bytes] = {}             # request -> state read from the store for its hit
        self.swa = swa
        self.swa_state = swa_state if swa is not None else None
        self.swa_replay = swa_replay if store is not None else "exact"
        self.window = (WindowGroup(num_window_blocks, block_size, swa.window, enable_prefix_caching)
                       if swa is not None else None)
        self._replay: dict[str, ReplayPlan] = {}             # request -> its replay, until computed past its end
        self._swa_loads: dict[str, bytes] = {}               # request -> window state found for its hit
        self._store_hits: dict[str, list[bytes]] = {}          # request -> store blocks after its pool hits
        self._fetched: dict[str, dict[bytes, bytes | None]] = {}   # request -> blocks read so far (None: a miss)
        self._prefetch: dict[str, tuple[list[bytes], Future]] = {}  # request -> its store read in flight
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
        # request -> [(block index, snapshot)] awaiting the block's hash (two under async scheduling with
        # speculation: the verify step read back next, and the one queued after it)
        self._unkeyed: dict[str, list[tuple[int, int]]] = {}
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

    def window_block_ids(self, request_id: str) -> list[int] | None:
        """Sliding-window models: the request's window-group table (released entries at the scratch page); else
        None."""
        return self.window.block_ids(request_id) if self.window is not None else None

    def state_slot(self, request_id: str) -> int | None:
        return self._state_slot.get(request_id)

    def _extend_hashes(self, request: Request) -> None:
        bs = self.block_size
        hashes = request.block_hashes
        for i in range(len(hashes), request.num_tokens // bs):
            extra = block_image_key(request.images, i * bs, (i + 1) * bs) if request.images else b""
            hashes.append(hash_block(hashes[-1] if hashes else None, request.token_ids_slice(i * bs, (i + 1) * bs),
                                     extra))

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """Longest cached prefix of full blocks, leaving at least one token to compute (it yields the logits).

        Requests asking for prompt_logprobs skip the lookup (cached positions would have no logits), unless they
        ask for them from a later position on (`prompt_logprobs_start`): the hit stops before the row that
        predicts it.
        """
        params = request.sampling_params
        if not self.enable_prefix_caching or (params.prompt_logprobs is not None and params.prompt_logprobs_start < 2):
            return [], 0
        if self.num_state_slots and not self.num_state_snapshots:
            return [], 0
        self._extend_hashes(request)
        max_blocks = self._max_hit_blocks(request)
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
        num_cached = (len(hits) + store_hits) * self.block_size
        if self.swa is not None:
            num_cached = self._window_hit(request, self.window.rows_present(
                request.block_hashes[:len(hits) + store_hits]))
        if self.num_state_slots:   # usable up to the last hit block whose end state was kept
            n = self._state_hit(request, len(hits) + store_hits)
            del hits[n:]
            if self.store is not None:
                found = self._store_hits[request.request_id]
                del found[max(n - len(hits), 0):]
                self.prefix_stats.store_hit_tokens -= (store_hits - len(found)) * self.block_size
                store_hits = len(found)
            num_cached = (len(hits) + store_hits) * self.block_size
        self.prefix_stats.queried_tokens += request.num_tokens
        self.prefix_stats.hit_tokens += num_cached
        return hits, num_cached

    def _state_hit(self, request: Request, n: int, store_tries: int = 4) -> int:
        """How many of the n hit blocks are usable: up to the last one whose end state is kept — in a snapshot slot
        (restored before the step) or, with a store, in the store (read now; at most `store_tries` reads, newest
        block first)."""
        rid = request.request_id
        self._restore.pop(rid, None)
        self._state_loads.pop(rid, None)
        tries = 0
        while n:
            h = request.block_hashes[n - 1]
            if h in self._snapshots:
                self._snapshots.move_to_end(h)
                self._restore[rid] = self._snapshots[h]
                return n
            if self.state_store is not None and tries < store_tries:
                tries += 1
                fetched = self._fetched.setdefault(rid, {})      # a waiting request's next try reads no more
                key = state_key(h)
                if key not in fetched:
                    fetched[key] = self.state_store.get(key)
                payload = fetched[key]
                if payload is not None:
                    self._state_loads[rid] = payload
                    return n
            n -= 1
        return 0

    def _window_hit(self, request: Request, rows_present: list[bool]) -> int:
        """The hit rule (bounded_replay.py) for a hit of len(rows_present) blocks: its length when the last window's
        rows are present or in the SWA state tier (then loaded), else where its replay starts."""
        rid, n, bs = request.request_id, len(rows_present), self.block_size
        self._replay.pop(rid, None)
        self._swa_loads.pop(rid, None)
        if n == 0 or all(rows_present[i] for i in window_blocks(n, bs, self.swa.window)):
            return n * bs
        if self.swa_state is not None:
            payload = self.swa_state.get(request.block_hashes[n - 1])
            if payload is not None:
                self._swa_loads[rid] = payload
                return n * bs
        if self.swa_replay == "exact":
            # start at the last block boundary whose window is complete (the blocks before it need no rows)
            k = next(k for k in range(n, -1, -1)
                     if all(rows_present[i] for i in window_blocks(k, bs, self.swa.window)))
            rows_present = [True] * k + rows_present[k:]
        plan = plan_replay(rows_present, bs, self.swa.window, self.swa_replay)
        self._replay[rid] = plan
        return plan.start

    def replay_plan(self, request_id: str) -> ReplayPlan | None:
        """The request's replay while its computed tokens have not passed the replayed segment (the runner builds
        the step's per-layer views from it)."""
        return self._replay.get(request_id)

    def prefetch(self, request: Request) -> None:
        """A request arrives: start reading the blocks after its pool hits from the store in the background
        (TieredKVStore.prefetch). Until the read is done the scheduler leaves the request waiting, without
        holding up the requests behind it (`store_read_pending`), so a slow tier (a busy shared filesystem, a
        slow Redis) delays that request only."""
        params = request.sampling_params
        if self.store is None or (params.prompt_logprobs is not None and params.prompt_logprobs_start < 2):
            return
        self._extend_hashes(request)
        end = self._max_hit_blocks(request)
        start = 0
        while start < end and self.pool.lookup(request.block_hashes[start]) is not None:
            start += 1
        keys = request.block_hashes[start:end]
        if keys:
            self._prefetch[request.request_id] = (keys, self.store.prefetch(keys))

    def store_read_pending(self, request: Request) -> bool:
        """Whether the request's prefetch is still reading; once done, its blocks (and the first miss) are what
        the lookup uses."""
        item = self._prefetch.get(request.request_id)
        if item is None:
            return False
        keys, future = item
        if not future.done():
            return True
        del self._prefetch[request.request_id]
        payloads = future.result()           # get_prefix turns tier errors into misses: it does not raise
        fetched = self._fetched.setdefault(request.request_id, {})
        fetched.update(zip(keys, payloads))
        if len(payloads) < len(keys):
            fetched[keys[len(payloads)]] = None
        return False

    def wait_for_store_reads(self, timeout: float) -> None:
        """Block until a prefetch finishes or `timeout` seconds pass (a step with nothing to run, instead of a
        busy loop); returns at once when none is in flight."""
        if self._prefetch:
            wait([f for _, f in self._prefetch.values()], timeout, return_when=FIRST_COMPLETED)

    def _max_hit_blocks(self, request: Request) -> int:
        params = request.sampling_params
        max_blocks = max(request.num_tokens - self.min_uncached_tokens, 0) // self.block_size
        if params.prompt_logprobs is not None:
            max_blocks = min(max_blocks, (params.prompt_logprobs_start - 1) // self.block_size)
        return max_blocks

    def _store_lookup(self, request: Request, start: int, end: int) -> list[bytes]:
        """Blocks start.. of the request found in the store, in order, as bytes; no more than the pool could
        take now. A request that waits (no room yet) keeps what was read for its next try, and what its
        prefetch read (a miss it saw ends the hit: not read again)."""
        fetched = self._fetched.setdefault(request.request_id, {})
        wanted = request.block_hashes[start:min(end, start + self.pool.num_free_blocks)]
        out: list[bytes] = []
        for block_hash in wanted:                  # what an earlier try or the prefetch read already
            if block_hash not in fetched:
                break
            if fetched[block_hash] is None:
                return out
            out.append(fetched[block_hash])
        for block_hash, payload in zip(wanted[len(out):], self.store.get_prefix(wanted[len(out):])):
            fetched[block_hash] = payload
            out.append(payload)
        return out

    def can_fit(self, num_tokens: int) -> bool:
        """Whether a request of this many tokens could ever be held, with the pool otherwise empty."""
        return -(-num_tokens // self.block_size) <= self.pool.num_blocks

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed_blocks: list[KVBlock] | None = None, num_drafts: int = 0) -> bool:
        """Make room for `num_new_tokens` more tokens after the computed ones (plus cache hits); False if the
        pool can't, in which case nothing changed. `num_drafts`: how many of them are speculative drafts (a
        verify step), which the next step may roll back."""
        rid = request.request_id
        blocks = self._blocks.get(rid)
        plan = self._replay.get(rid)
        if plan is not None and request.num_computed_tokens >= plan.end and blocks is not None:
            del self._replay[rid]        # replayed: the rows of its blocks were rebuilt
            plan = None
        if blocks is not None and not computed_blocks and rid not in self._store_hits and plan is None:
            # fast path (most decode steps): the tokens fit the last block and no block fills up
            total = request.num_computed_tokens + num_new_tokens
            if (total <= len(blocks) * self.block_size and (self.num_state_slots == 0 or rid in self._state_slot)
                    and (not self.enable_prefix_caching
                         or min(total, request.num_tokens) // self.block_size <= self._num_registered.get(rid, 0))
                    and not (self.num_state_snapshots and (total % self.block_size == 0 or rid in self._unkeyed
                                                           or (num_drafts and total // self.block_size
                                                               > request.num_computed_tokens // self.block_size)))):
                if self.window is not None:    # (not past what the verify step in flight may roll back to)
                    self.window.release(rid, self.window.first_needed(request.num_computed_tokens
                                                                      - request.num_unconfirmed_drafts))
                return True
        computed_blocks = computed_blocks or []
        loaded = self._store_hits.get(rid, []) if self.store is not None else []
        blocks = self._blocks.setdefault(rid, [])
        hit_tokens = (len(computed_blocks) + len(loaded)) * self.block_size
        admitting = bool(hit_tokens)
        # a replaying request holds its hit blocks but computes from the replay's start
        cached = (plan.start if plan is not None else hit_tokens) if admitting else 0
        total = request.num_computed_tokens + cached + num_new_tokens
        need = -(-max(total, hit_tokens) // self.block_size) - len(blocks) - len(computed_blocks)
        reclaimed = sum(1 for b in computed_blocks if b.ref_cnt == 0)   # hits now sitting in the free queue
        need_slot = self.num_state_slots > 0 and rid not in self._state_slot
        planned = None
        if self.window is not None:   # the window group's entries from the step's first query's window on
            first_w = self.window.first_needed(request.num_computed_tokens + cached - request.num_unconfirmed_drafts,
                                               plan.window_floor if plan is not None else 0)
            self.window.release(rid, first_w)     # no step reads them again (a refused step is preempted)
            upto = -(-max(total, hit_tokens if plan is None else 0) // self.block_size)
            planned = self.window.plan(rid, len(blocks) + len(computed_blocks) + max(need, 0), first_w, upto,
                                       request.block_hashes[:hit_tokens // self.block_size])
        if (max(need, 0) > self.pool.num_free_blocks - reclaimed or (need_slot and not self._free_state_slots)
                or (planned is not None and not self.window.can_take(planned))):
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
        if self.window is not None:
            fresh = self.window.extend(rid, len(blocks), first_w, planned)
            self._window_rows_back(request, fresh, hit_tokens, plan)
        if need_slot:
            self._state_slot[rid] = self._free_state_slots.pop()
        snapshot = self._restore.pop(rid, None)
        if snapshot is not None and (computed_blocks or loaded):
            self.state_copies.restores.append((snapshot, self._state_slot[rid]))
        state = self._state_loads.pop(rid, None)
        if state is not None and (computed_blocks or loaded):
            self.state_copies.state_loads.append((self._state_slot[rid], state))
        if self.enable_prefix_caching:
            self._extend_hashes(request)
            start = self._num_registered.get(rid, 0)
            full = max(min(total, request.num_tokens), hit_tokens) // self.block_size
            for i in range(start, full):
                if self.pool.cache(blocks[i], request.block_hashes[i]) and self.store is not None and i >= no_save:
                    ttl = resolve_ttl(request.sampling_params.cache_ttl, self.store.default_ttl_s)
                    self.state_copies.kv_saves.append((blocks[i].block_id, request.block_hashes[i], ttl))
            self._num_registered[rid] = max(start, full)
            if self.window is not None:   # replayed rows count once scheduled, loaded ones at once
                upto = max(min(total, request.num_tokens), hit_tokens if plan is None else 0)
                self.window.register(rid, request.block_hashes, upto // self.block_size)
            if self.num_state_snapshots:
                self._snapshot_state(request, total, num_drafts)
        return True

    def _window_rows_back(self, request: Request, fresh: dict[int, int], hit_tokens: int,
                          plan: ReplayPlan | None) -> None:
        """Windowed rows a hit lacks come back into fresh window blocks: from the SWA state (at admission: the
        window's blocks the group still holds keep theirs), or as the replay's tokens are computed."""
        payload = self._swa_loads.pop(request.request_id, None)
        if payload is not None:
            window = window_blocks(hit_tokens // self.block_size, self.block_size, self.swa.window)
            self.state_copies.swa_loads.append(([fresh.get(i) for i in window], payload))
            self.prefix_stats.swa_state_hits += 1
        if plan is not None and hit_tokens:
            self.prefix_stats.swa_replays += 1
            self.prefix_stats.swa_replayed_tokens += plan.num_replayed_tokens

    def save_window_state(self, request: Request) -> None:
        """A request ends: keep the windowed rows of its last window (at its last block boundary) in host memory,
        so a later hit on this prefix through the store needs no replay (spec 000 §5.3: saved at request end,
        rounded down to a block boundary). Skipped when the window is incomplete or already kept."""
        blocks = self._blocks.get(request.request_id)
        if self.swa_state is None or not blocks:
            return
        self._extend_hashes(request)
        n = min(request.num_computed_tokens, request.num_tokens, len(blocks) * self.block_size) // self.block_size
        n = min(n, len(request.block_hashes))
        if n == 0:
            return
        ids = self.window.window_ids(request.request_id, window_blocks(n, self.block_size, self.swa.window))
        key = request.block_hashes[n - 1]
        if ids is None or self.swa_state.contains(key):
            return
        self.state_copies.swa_saves.append((ids, key))

    def _snapshot_state(self, request: Request, total: int, num_drafts: int = 0) -> None:
        """After this step the request's state is at `total` tokens: keep a copy when that is a block
        boundary. Under async scheduling the block's last token may still be on the device: the copy is
        taken now and keyed once the token (so the block hash) is known.

        A verify step (`num_drafts` > 0) keeps a copy when its tokens cross a boundary: the state rings hold
        the boundary's state for up to `rollback_rows` positions past it (a restored request reads only
        positions before the boundary), so the copy is good if the drafts up to the boundary are accepted —
        known once the step is read back; the next schedule after that keys it or lets it go
        (`_resolve_unkeyed`). Under async scheduling a step queued on the guess that the verify step in flight
        keeps its drafts may take a copy too; both wait, and the guessed one is let go if the guess was wrong."""
        rid, hashes, bs = request.request_id, request.block_hashes, self.block_size
        self._resolve_unkeyed(request)
        if num_drafts:
            boundary = total // bs * bs
            if boundary <= request.num_computed_tokens:
                return
        elif total % bs or total == 0:
            return
        else:
            boundary = total
        index = boundary // bs - 1
        if index < len(hashes) and hashes[index] in self._snapshots:
            self._snapshots.move_to_end(hashes[index])
            return
        if self._free_snapshots:
            snap = self._free_snapshots.pop()
        elif self._snapshots:
            snap = self._snapshots.popitem(last=False)[1]
            # a store write of its old content not yet made would read the new one: drop it
            self.state_copies.state_saves = [s for s in self.state_copies.state_saves if s[0] != snap]
        else:
            return
        self.state_copies.saves.append((self._state_slot[rid], snap))
        if index < len(hashes):
            self._key_snapshot(hashes[index], snap, request)
        else:
            self._unkeyed.setdefault(rid, []).append((index, snap))

    def _register_computed(self, request: Request) -> None:
        """A request leaves (finished or preempted): offer the prefix cache the blocks its computed tokens filled
        since its last schedule — with speculative decoding, drafts accepted in its last step can fill a block
        that no later schedule registers — and key a verify step's snapshot whose drafts were accepted. (GPU pool
        only: the block is free from now on, so it is not queued for the store.)"""
        self._extend_hashes(request)
        blocks, hashes = self._blocks[request.request_id], request.block_hashes
        start = self._num_registered.get(request.request_id, 0)
        full = min(request.num_computed_tokens, request.num_tokens, len(blocks) * self.block_size) // self.block_size
        for i in range(start, min(full, len(hashes))):
            self.pool.cache(blocks[i], hashes[i])
        if self.window is not None:
            self.window.register(request.request_id, hashes, full)
        self._resolve_unkeyed(request)

    def _resolve_unkeyed(self, request: Request) -> None:
        """Key a pending snapshot once its block's hash is known, or drop it if the request's computed tokens
        fell back before its boundary (a verify step's drafts there were rejected)."""
        unkeyed = self._unkeyed.get(request.request_id)
        if unkeyed is None:
            return
        waiting = []
        for index, snap in unkeyed:
            if request.num_computed_tokens < (index + 1) * self.block_size:
                self._free_snapshots.append(snap)
            elif len(request.block_hashes) > index:
                self._key_snapshot(request.block_hashes[index], snap, request)
            else:
                waiting.append((index, snap))
        if waiting:
            self._unkeyed[request.request_id] = waiting
        else:
            del self._unkeyed[request.request_id]

    def _key_snapshot(self, block_hash: bytes, snap: int, request: Request) -> None:
        if block_hash in self._snapshots:      # another request kept the same state meanwhile
            self._free_snapshots.append(snap)
            return
        self._snapshots[block_hash] = snap
        if self.state_store is not None:
            ttl = resolve_ttl(request.sampling_params.cache_ttl, self.state_store.default_ttl_s)
            self.state_copies.state_saves.append((snap, state_key(block_hash), ttl))

    def take_state_copies(self) -> StateCopies:
        copies, self.state_copies = self.state_copies, StateCopies()
        return copies

    def free(self, request: Request) -> None:
        rid = request.request_id
        self._restore.pop(rid, None)
        self._replay.pop(rid, None)
        self._swa_loads.pop(rid, None)
        self._state_loads.pop(rid, None)
        self._store_hits.pop(rid, None)
        self._fetched.pop(rid, None)
        prefetch = self._prefetch.pop(rid, None)
        if prefetch is not None:
            prefetch[1].cancel()                 # not started yet: never read; else its result is dropped
        if self.enable_prefix_caching and rid in self._blocks:
            self._register_computed(request)
        self._free_snapshots.extend(snap for _, snap in self._unkeyed.pop(rid, ()))
        self.pool.free(list(reversed(self._blocks.pop(rid, []))))
        if self.window is not None:
            self.window.free(rid)
        self._block_ids.pop(rid, None)
        self._num_registered.pop(rid, None)
        slot = self._state_slot.pop(rid, None)
        if slot is not None:
            self._free_state_slots.append(slot)

    def reset_prefix_cache(self) -> bool:
        if self.window is not None and self.window.pool.num_free_blocks != self.window.pool.num_blocks:
            return False
        ok = self.pool.reset_prefix_cache() and (self.window is None or self.window.pool.reset_prefix_cache())
        if ok:
            self._free_snapshots.extend(self._snapshots.values())
            self._snapshots.clear()
        return ok
