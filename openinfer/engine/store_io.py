"""StoreIO: bytes between the cache pool and the prefix-KV store's tiers (kv_cache/kv_store.py, docs/kv_cache.md).

A block's bytes are every paged kind's rows for it, layer by layer (sliding-window models: the full-attention
layers' only; the windowed layers' travel as window state, kv_cache/bounded_replay.py). Per-request state at a
stored block boundary travels as one entry of every snapshot kind's rows. Before a step's forward, what the KV
manager read from the store is written into freshly allocated blocks and slots (and snapshots restored into
slots); after it, snapshots are taken and the blocks the step completed are queued for the store's writer thread:
on the CPU as a copy made now, on CUDA as a copy queued on the stream into pinned memory, which the writer waits
for, so a step never waits for the store.
"""

from __future__ import annotations

import torch

from openinfer.device_io import h2d
from openinfer.engine.cache_pool import CachePool
from openinfer.kv_cache.spec import PagedCacheSpec


class StoreIO:
    def __init__(self, pool: CachePool, ttl_s: float):
        self.pool, self.device, self.ttl_s = pool, pool.device, ttl_s
        # the engine sets these: the prefix-KV store blocks go to, where the per-request state at a stored block
        # boundary goes (models with state slots), and the host-memory tier of sliding-window models' window state
        self.kv_store = None
        self.state_store = None
        self.swa_state = None

    # ---- around a step's forward ------------------------------------------------------------------------------
    def before_forward(self, copies) -> None:
        """What the KV manager read for this step (`SchedulerOutput.state_copies`) into its blocks and slots."""
        self._load_blocks(copies.kv_loads)
        self._load_window_state(copies.swa_loads)
        self.pool.copy_states(copies.restores, restore=True)
        self._load_states(copies.state_loads)

    def after_forward(self, copies) -> None:
        """Snapshots this step keyed, and the blocks it completed, on their way to the store."""
        self.pool.copy_states(copies.saves, restore=False)
        if copies.state_saves and self.state_store is not None:
            self._save_states(copies.state_saves)
        if copies.kv_saves and self.kv_store is not None:
            self._save_blocks(copies.kv_saves)

    # ---- blocks -----------------------------------------------------------------------------------------------
    def block_rows(self, block_id: int, window_layers: bool = False) -> list[torch.Tensor]:
        """A block's rows in the full group's kinds, or (`window_layers`) in the window group's (block ids of
        that group)."""
        return [t[block_id] for s in self.pool.specs if isinstance(s, PagedCacheSpec)
                and (s.window is not None) == window_layers for t in self.pool.caches[s.name]]

    def block_bytes(self) -> int:
        """Bytes of one block in the prefix-KV store."""
        return sum(r.numel() * r.element_size() for r in self.block_rows(0))

    def _load_blocks(self, loads: list[tuple[int, bytes]], window_layers: bool = False) -> None:
        """Write blocks read from the store into their (freshly allocated) pool blocks, before the forward."""
        for block_id, payload in loads:
            self._unpack(payload, self.block_rows(block_id, window_layers))

    def _save_blocks(self, saves: list[tuple[int, bytes, float]]) -> None:
        """Queue blocks this step completed for the store's writer thread, after the forward (a block is read
        before any later step can reuse it)."""
        store = self.kv_store
        for block_id, key, ttl in saves:
            if not store.can_accept():
                store.dropped_writes += 1      # the writer is behind: drop rather than make the step wait
                continue
            flat = torch.cat([row.reshape(-1).view(torch.uint8) for row in self.block_rows(block_id)])
            store.put(key, self._to_host(flat)[1], ttl)

    # ---- per-request state ------------------------------------------------------------------------------------
    def _load_states(self, loads: list[tuple[int, bytes]]) -> None:
        """State read from the store into request slots, before the forward (the layout of `_save_states`)."""
        for slot, payload in loads:
            self._unpack(payload, [live[slot] for name in self.pool.snapshots for live in self.pool.caches[name]])

    def _save_states(self, saves: list[tuple[int, bytes, float]]) -> None:
        """Snapshots keyed this step into the store (after the step's slot -> snapshot copies)."""
        for snap, key, ttl in saves:
            if not self.state_store.can_accept():
                self.state_store.dropped_writes += 1
                continue
            flat = torch.cat([t[snap].reshape(-1).view(torch.uint8) for snaps in self.pool.snapshots.values()
                              for t in snaps])
            self.state_store.put(key, self._to_host(flat)[1], ttl)

    # ---- window state (sliding-window models) -----------------------------------------------------------------
    def _load_window_state(self, loads: list[tuple[list[int | None], bytes]]) -> None:
        """Window state from host memory into the hit's blocks that lack their windowed rows (None: keeps its own)."""
        for block_ids, payload in loads:
            per_block = len(payload) // len(block_ids)
            self._load_blocks([(b, memoryview(payload)[i * per_block:(i + 1) * per_block])
                               for i, b in enumerate(block_ids) if b is not None], window_layers=True)

    def save_window_state(self, saves: list[tuple[list[int], bytes]]) -> None:
        """The windowed rows of ended requests' last windows into the host-memory tier, when they end (the engine
        calls it before the next schedule can reuse their blocks). On CUDA the copy is queued on the stream into
        pinned memory (it reads the blocks before any later step can write them) and stored once it is done
        (`DeferredPutTier.put_later`): no wait for the step in flight."""
        for block_ids, key in saves:
            rows = [r.reshape(-1).view(torch.uint8) for b in block_ids for r in self.block_rows(b, window_layers=True)]
            ready, read = self._to_host(torch.cat(rows))
            if self.device.type == "cpu":
                self.swa_state.put(key, read(), self.ttl_s)
            else:
                self.swa_state.put_later(key, ready, read, self.ttl_s)

    # ---- bytes ------------------------------------------------------------------------------------------------
    def _unpack(self, payload, rows: list[torch.Tensor]) -> None:
        """Copy the bytes of `payload` into `rows`, one after another."""
        buf = payload if not memoryview(payload).readonly else bytearray(payload)
        flat = h2d(torch.frombuffer(buf, dtype=torch.uint8), self.device)
        offset = 0
        for row in rows:
            n = row.numel() * row.element_size()
            part = flat[offset:offset + n]
            if offset % row.element_size():
                part = part.clone()          # a view as a wider dtype needs an aligned start
            row.copy_(part.view(row.dtype).view(row.shape))
            offset += n

    def _to_host(self, flat: torch.Tensor):
        """(ready, read) for a uint8 tensor's bytes: on the CPU a copy now; on CUDA a copy queued on the stream into
        pinned memory (it reads the tensor before any later step changes it), `read` waits for it."""
        if self.device.type == "cpu":
            payload = flat.numpy().tobytes()
            return (lambda: True), (lambda: payload)
        host = torch.empty(flat.shape, dtype=torch.uint8, pin_memory=True)
        host.copy_(flat, non_blocking=True)
        event = torch.cuda.Event()
        event.record()

        def read() -> bytes:
            event.synchronize()
            return host.numpy().tobytes()
        return event.query, read
