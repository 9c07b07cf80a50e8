"""TieredKVStore: the prefix-KV store behind the GPU pool (docs/kv_cache.md).

Blocks are addressed by the prefix cache's hash chain (a block's hash covers every token before it), and the
tiers keep them under a namespace digest of whatever makes the bytes of a block differ (model, dtypes, block
size, cache layout, rank layout), so two models never share an entry.

- `get` (the scheduler, when a request's prefix misses the GPU pool) asks the tiers fastest first and copies
  a hit into the faster tiers (host at once, the slower ones through the writer). `prefetch` does the same
  for a request's blocks on a background thread as the request arrives.
- `put` (the runner, after the step that computed a block) hands a block to one writer thread through a
  queue bounded in bytes (`queue_bytes`: a long prompt registers hundreds of blocks in one step, and they all
  must fit); a full queue drops the write and counts it: a step never waits for the store.
- A tier that raises (directory unwritable or full, Redis down or slow, ...) is logged once per kind of
  fault, counted, and left out for `backoff_s`; the request recomputes what the store could not give.
"""

from __future__ import annotations

import atexit
import hashlib
import logging
import os
import queue
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable

from openinfer.kv_cache.tiers import KVTier

logger = logging.getLogger("openinfer.kv_store")

def namespace_digest(**parts) -> bytes:
    """sha256 over the sorted parts' reprs: everything that changes a block's bytes for the same tokens."""
    return hashlib.sha256(repr(sorted(parts.items())).encode()).digest()


class TieredKVStore:
    def __init__(self, tiers: list[KVTier], payload_bytes: int, default_ttl_s: float, queue_bytes: int = 1 << 30,
                 backoff_s: float = 10.0):
        self.tiers = tiers
        self.payload_bytes = payload_bytes
        self.default_ttl_s = default_ttl_s
        self.backoff_s = backoff_s
        self.dropped_writes = 0
        self.read_threads = max(1, min(8, os.cpu_count() or 1))
        self._readers: ThreadPoolExecutor | None = None      # made on the first multi-block read
        self._prefetcher: ThreadPoolExecutor | None = None   # made on the first prefetch
        self._down_until = {t.name: 0.0 for t in tiers}
        self._logged: set[tuple[str, str]] = set()
        # blocks waiting for the writer, at most queue_bytes of them (at least one block)
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, queue_bytes // max(payload_bytes, 1)))
        self._writer = threading.Thread(target=self._write_loop, name="openinfer-kv-store-writer", daemon=True)
        self._writer.start()
        atexit.register(_close_at_exit, weakref.ref(self))   # a process ending without shutdown() keeps its writes

    # ---- reads (scheduler thread, or the prefetch thread) ------------------------------------------------------
    def prefetch(self, keys: list[bytes]) -> Future:
        """`get_prefix(keys)` on a background thread, started when a request arrives, so that a slow tier delays
        that request only, not the steps of every other (the scheduler looks at the result when it is done)."""
        if self._prefetcher is None:
            self._prefetcher = ThreadPoolExecutor(1, thread_name_prefix="openinfer-kv-prefetch")
        return self._prefetcher.submit(self.get_prefix, keys)

    def get_prefix(self, keys: list[bytes]) -> list:
        """The payloads of the longest run of `keys`, in order, found in the store. Up to `read_threads` blocks
        are read at once (file reads, checksums and copies release the GIL): one thread reads ~1 GB/s on the
        H200's host, below what recomputing a dense model's KV costs (BENCHMARKS.md, prefix-KV store)."""
        out: list = []
        for i in range(0, len(keys), self.read_threads):
            batch = keys[i:i + self.read_threads]
            if len(batch) == 1 or self.read_threads == 1:
                found = [self.get(k) for k in batch]
            else:
                if self._readers is None:
                    self._readers = ThreadPoolExecutor(self.read_threads, thread_name_prefix="openinfer-kv-read")
                found = list(self._readers.map(self.get, batch))
            for payload in found:
                if payload is None:
                    return out
                out.append(payload)
        return out

    def get(self, key: bytes) -> bytes | None:
        for i, tier in enumerate(self.tiers):
            if not self._up(tier):
                continue
            try:
                payload = tier.get(key)
            except Exception as e:       # OSError, redis errors: a fault, never a failed request
                self._fault(tier, e)
                continue
            if payload is None:
                continue
            if len(payload) != self.payload_bytes:     # cannot happen with a sound namespace; treat as a miss
                tier.stats.add(corrupt=1)
                continue
            if i > 0:
                self._promote(key, payload, self.tiers[:i])
            return payload
        return None

    def _promote(self, key: bytes, payload: bytes, faster: list[KVTier]) -> None:
        if faster[0].name == "host":
            faster[0].put(key, payload, self.default_ttl_s)
            faster = faster[1:]
        if faster:
            self._enqueue((key, lambda: payload, self.default_ttl_s, faster))

    # ---- writes (runner thread -> writer thread) -----------------------------------------------------------
    def can_accept(self) -> bool:
        """Whether a put now would be queued (the runner skips the device-to-host copy otherwise)."""
        return not self._queue.full()

    def put(self, key: bytes, read_payload: Callable[[], bytes], ttl_s: float | None = None) -> None:
        """Queue a block; `read_payload` runs on the writer thread (it may wait for a device copy)."""
        self._enqueue((key, read_payload, ttl_s or self.default_ttl_s, self.tiers))

    def _enqueue(self, item) -> None:
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            self.dropped_writes += 1

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                key, read_payload, ttl_s, tiers = item
                payload = None
                for tier in tiers:
                    if not self._up(tier):
                        continue
                    try:
                        if tier.name != "host" and tier.contains(key):
                            continue        # another process (or an earlier life of this one) wrote it
                        if payload is None:
                            payload = read_payload()
                        tier.put(key, payload, ttl_s)
                    except Exception as e:
                        self._fault(tier, e)
            except Exception as e:            # a failed device copy: lose this write, keep the writer
                logger.warning("kv store: a write failed: %r", e)
            finally:
                self._queue.task_done()

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every write queued so far is done (tests, shutdown, a prefill instance before it answers:
        docs/serving.md); True if so, False if `timeout` seconds passed first (the writes go on)."""
        if timeout is None:
            self._queue.join()
            return True
        deadline = time.monotonic() + timeout
        with self._queue.all_tasks_done:
            while self._queue.unfinished_tasks:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._queue.all_tasks_done.wait(left)
        return True

    def close(self) -> None:
        if self._prefetcher is not None:
            self._prefetcher.shutdown(wait=True, cancel_futures=True)
            self._prefetcher = None
        if self._readers is not None:
            self._readers.shutdown(wait=True)
            self._readers = None
        if self._writer.is_alive():
            self._queue.put(None)
            self._writer.join()

    # ---- faults and stats -----------------------------------------------------------------------------------
    def _up(self, tier: KVTier) -> bool:
        return time.monotonic() >= self._down_until[tier.name]

    def _fault(self, tier: KVTier, error: Exception) -> None:
        tier.stats.add(faults=1)
        self._down_until[tier.name] = time.monotonic() + self.backoff_s
        kind = (tier.name, type(error).__name__)
        if kind not in self._logged:
            self._logged.add(kind)
            logger.warning("kv store: %s tier fault (%r); serving on without it for %.0f s at a time (logged once)",
                           tier.name, error, self.backoff_s)

    def stats(self) -> dict:
        return {"kv_store_tiers": {t.name: t.stats.as_dict() for t in self.tiers},
                "kv_store_dropped_writes": self.dropped_writes}


def _close_at_exit(ref: weakref.ref) -> None:
    store = ref()
    if store is not None:
        store.close()
