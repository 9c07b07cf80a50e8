"""Tiers of the prefix-KV store: where a full KV block lives once it left (or besides) the GPU pool.

Every tier answers `get`, `put`, `contains` and keeps `TierStats`; the store (kv_store.py) chains them.
- `HostMemoryTier`: blocks in this process's RAM, LRU; past a high watermark it evicts down to a low one
  (a few blocks per put, never a sweep of the whole tier).
- `DirectoryTier`: one file per block under a directory: local disk, or a shared mount (3FS, NFS, Lustre)
  that makes a prefix computed on one machine a hit on every other. Each file is an *entry*: a header
  (magic, version, namespace digest, payload length, expiry time, CRC-32 of the payload) and the payload.
  Written to a temporary file in the same directory, then `os.replace`d: a reader sees the old entry, the
  new one or none, never a torn one, whichever processes write the same block at once. A truncated,
  corrupt, expired or foreign-namespace entry is a miss, and its file is removed.
- `RedisTier`: the same entries as values of a Redis server (`redis://…`), expiry by Redis' own TTL.

Tiers raise OSError (and Redis' errors) as they come; the store counts them as faults and serves on.
"""

from __future__ import annotations

import os
import struct
import threading
import time
import zlib
from collections import OrderedDict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, ClassVar, Protocol

MAGIC = b"OIKVBLK1"
VERSION = 2   # 2: CRC-32 checksums (1: BLAKE2b, 4x slower to check than reading the entry)
# magic, version, namespace digest, payload length, expiry (unix seconds), CRC-32 of the payload
_HEADER = struct.Struct("<8sH32sQdI")
HEADER_BYTES = _HEADER.size


@dataclass
class TierStats:
    hits: int = 0
    misses: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    faults: int = 0
    corrupt: int = 0          # entries found truncated, corrupt or foreign (counted as misses too)
    evictions: int = 0
    # the store reads blocks from several threads at once (TieredKVStore.get_prefix): counts go through `add`
    _lock: ClassVar[threading.Lock] = threading.Lock()

    def add(self, **deltas: int) -> None:
        with TierStats._lock:
            for name, n in deltas.items():
                setattr(self, name, getattr(self, name) + n)

    def as_dict(self) -> dict:
        return asdict(self)


class KVTier(Protocol):
    name: str
    stats: TierStats

    def get(self, key: bytes) -> bytes | None: ...

    def put(self, key: bytes, payload: bytes, ttl_s: float) -> None: ...

    def contains(self, key: bytes) -> bool: ...


def _checksum(payload: bytes | memoryview) -> int:
    """CRC-32 of the payload: it guards against truncated or damaged entries (not against tampering), and at
    several GB/s it costs about what reading the entry does (a 16 MB block: 4 ms vs 18 ms for BLAKE2b)."""
    return zlib.crc32(payload)


def entry_header(namespace: bytes, payload: bytes, ttl_s: float) -> bytes:
    return _HEADER.pack(MAGIC, VERSION, namespace, len(payload), time.time() + ttl_s, _checksum(payload))


def pack_entry(namespace: bytes, payload: bytes, ttl_s: float) -> bytes:
    return entry_header(namespace, payload, ttl_s) + payload


def unpack_entry(namespace: bytes, entry: bytes) -> tuple[bytes | None, str]:
    """(payload, "") for a sound entry, else (None, why): "corrupt" (short, bad magic/version/length/checksum,
    another namespace) or "expired"."""
    if len(entry) < HEADER_BYTES:
        return None, "corrupt"
    magic, version, ns, length, expiry, digest = _HEADER.unpack_from(entry)
    payload = memoryview(entry)[HEADER_BYTES:]
    if magic != MAGIC or version != VERSION or ns != namespace or len(payload) != length:
        return None, "corrupt"
    if expiry < time.time():
        return None, "expired"
    if _checksum(payload) != digest:
        return None, "corrupt"
    return payload, ""          # a view: no copy (a writable one when `entry` is a bytearray)


class DeferredPutTier:
    """A tier whose puts may wait for a device-to-host copy still on the stream (the SWA state a request leaves on
    CUDA, kv_cache/bounded_replay.py): `put_later(key, ready, read, ttl)` keeps the entry pending; `settle()` stores
    those whose copy is done (each step, without waiting), and `get` / `contains` see pending entries too (`get`
    waits for that one copy). So saving costs the step nothing and a lookup never misses a saved state."""

    def __init__(self, tier):
        self.tier = tier
        self._pending: dict[bytes, tuple[Callable[[], bool], Callable[[], bytes], float]] = {}

    @property
    def name(self) -> str:
        return self.tier.name

    @name.setter
    def name(self, value: str) -> None:
        self.tier.name = value

    @property
    def stats(self) -> "TierStats":
        return self.tier.stats

    def put(self, key: bytes, payload: bytes, ttl_s: float) -> None:
        self._pending.pop(key, None)
        self.tier.put(key, payload, ttl_s)

    def put_later(self, key: bytes, ready: Callable[[], bool], read: Callable[[], bytes], ttl_s: float) -> None:
        self._pending[key] = (ready, read, ttl_s)

    def settle(self, wait: bool = False) -> None:
        for key, (ready, read, ttl_s) in list(self._pending.items()):
            if wait or ready():
                del self._pending[key]
                self.tier.put(key, read(), ttl_s)

    def get(self, key: bytes) -> bytes | None:
        item = self._pending.pop(key, None)
        if item is not None:
            self.tier.put(key, item[1](), item[2])
        return self.tier.get(key)

    def contains(self, key: bytes) -> bool:
        return key in self._pending or self.tier.contains(key)


class HostMemoryTier:
    """Blocks in host RAM, least recently used first; thread-safe (the writer thread fills it)."""

    name = "host"
    namespace = None        # process-local: nothing to keep apart from other models' entries

    def __init__(self, capacity_bytes: int, high_watermark: float = 0.95, low_watermark: float = 0.85,
                 max_evictions_per_put: int = 16):
        self.capacity = capacity_bytes
        self.high, self.low = int(capacity_bytes * high_watermark), int(capacity_bytes * low_watermark)
        self.max_evictions_per_put = max_evictions_per_put
        self._blocks: OrderedDict[bytes, tuple[bytes, float]] = OrderedDict()   # key -> (payload, expiry)
        self.used = 0
        self.stats = TierStats()
        self._lock = threading.Lock()
        self._evicting = False

    def get(self, key: bytes) -> bytes | None:
        with self._lock:
            item = self._blocks.get(key)
            if item is not None and item[1] < time.time():
                self._drop(key)
                item = None
            if item is None:
                self.stats.add(misses=1)
                return None
            self._blocks.move_to_end(key)
            self.stats.add(hits=1)
            self.stats.add(bytes_read=len(item[0]))
            return item[0]

    def contains(self, key: bytes) -> bool:
        with self._lock:
            return key in self._blocks

    def put(self, key: bytes, payload: bytes, ttl_s: float) -> None:
        if len(payload) > self.low:
            return
        with self._lock:
            if key in self._blocks:
                self._drop(key)
            self._blocks[key] = (payload, time.time() + ttl_s)
            self.used += len(payload)
            self.stats.add(bytes_written=len(payload))
            # gradual: once past the high watermark, each put evicts a few blocks until under the low one;
            # the hard capacity is never exceeded
            if self.used > self.high:
                self._evicting = True
            budget = self.max_evictions_per_put
            while self._blocks and (self.used > self.capacity or (self._evicting and budget > 0)):
                self._drop(next(iter(self._blocks)))
                self.stats.add(evictions=1)
                budget -= 1
                if self.used <= self.low:
                    self._evicting = False
                    break

    def _drop(self, key: bytes) -> None:
        payload, _ = self._blocks.pop(key)
        self.used -= len(payload)


class DirectoryTier:
    """One entry file per block under `root/<namespace>/<2 hex>/<key hex>`. `capacity_bytes` caps what this
    process has seen there (its own writes plus a scan at start); past the high watermark the least recently
    used files (by mtime: a hit touches its file, so every process sharing the directory votes) are removed
    a few per write until under the low one."""

    name = "dir"

    def __init__(self, root: str | os.PathLike, namespace: bytes, capacity_bytes: int | None = None,
                 high_watermark: float = 0.95, low_watermark: float = 0.85, max_evictions_per_put: int = 16):
        self.namespace = namespace
        self.dir = Path(root) / namespace.hex()[:32]
        self.capacity = capacity_bytes
        self.high = None if capacity_bytes is None else int(capacity_bytes * high_watermark)
        self.low = None if capacity_bytes is None else int(capacity_bytes * low_watermark)
        self.max_evictions_per_put = max_evictions_per_put
        self.stats = TierStats()
        self._sizes: dict[Path, int] | None = None    # files known to this process (None: not scanned yet)
        self.used = 0
        self._evicting = False
        self._seq = 0
        self._lock = threading.Lock()

    def _path(self, key: bytes) -> Path:
        h = key.hex()
        return self.dir / h[:2] / h

    def contains(self, key: bytes) -> bool:
        return self._path(key).exists()

    def get(self, key: bytes) -> bytes | None:
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                # into a bytearray: the payload view is then writable, so the runner wraps it without a copy
                entry = bytearray(os.fstat(f.fileno()).st_size)
                del entry[f.readinto(entry):]      # shorter if the file shrank meanwhile (then: corrupt)
        except FileNotFoundError:       # never written, evicted, or removed by another process meanwhile
            self.stats.add(misses=1)
            return None
        payload, why = unpack_entry(self.namespace, entry)
        if payload is None:
            self.stats.add(misses=1)
            self.stats.add(corrupt=why == "corrupt")
            self._remove(path)
            return None
        try:
            os.utime(path)              # LRU across processes: a hit is a recent use
        except OSError:
            pass
        self.stats.add(hits=1)
        self.stats.add(bytes_read=len(payload))
        return payload

    def put(self, key: bytes, payload: bytes, ttl_s: float) -> None:
        path = self._path(key)
        header = entry_header(self.namespace, payload, ttl_s)    # written apart: no copy of the payload
        path.parent.mkdir(parents=True, exist_ok=True)
        with self._lock:
            self._seq += 1
            tmp = path.parent / f".{path.name}.{os.getpid()}.{threading.get_ident()}.{self._seq}.tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(header)
                f.write(payload)
            os.replace(tmp, path)       # atomic: readers see the old entry or the new one, never a torn one
        except BaseException:
            self._remove(tmp)
            raise
        self.stats.add(bytes_written=len(header) + len(payload))
        if self.capacity is not None:
            self._account(path, len(header) + len(payload))

    def _account(self, path: Path, size: int) -> None:
        with self._lock:
            if self._sizes is None:
                self._sizes = self._scan()
                self.used = sum(self._sizes.values())
            self.used += size - self._sizes.pop(path, 0)
            self._sizes[path] = size       # dict order: oldest first (the scan sorted by mtime)
            if self.used > self.high:
                self._evicting = True
            budget = self.max_evictions_per_put
            while self._evicting and budget > 0 and self._sizes:
                victim = next(iter(self._sizes))
                self.used -= self._sizes.pop(victim)
                self._remove(victim)
                self.stats.add(evictions=1)
                budget -= 1
                if self.used <= self.low:
                    self._evicting = False

    def _scan(self) -> dict[Path, int]:
        found = []
        for sub in self.dir.iterdir() if self.dir.exists() else ():
            for f in sub.iterdir() if sub.is_dir() else ():
                if not f.name.startswith("."):
                    try:
                        st = f.stat()
                    except OSError:
                        continue
                    found.append((st.st_mtime, f, st.st_size))
        found.sort()
        return {f: size for _, f, size in found}

    @staticmethod
    def _remove(path: Path) -> None:
        try:
            os.unlink(path)
        except OSError:
            pass


class RedisTier:
    """Entries as Redis values under `openinfer:kv:<namespace>:<key>`, expiring by Redis' TTL. Short socket
    timeouts: a slow server costs a step at most that long before the store takes the tier out for a while."""

    name = "redis"

    def __init__(self, url: str, namespace: bytes, timeout_s: float = 0.25):
        try:
            import redis
        except ImportError as e:
            raise ImportError("kv_store_url needs the 'redis' package (pip install 'redis>=5', or the "
                              "openinfer[redis] extra)") from e
        self.namespace = namespace
        self.client = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self.prefix = b"openinfer:kv:" + namespace.hex()[:32].encode() + b":"
        self.stats = TierStats()

    def contains(self, key: bytes) -> bool:
        return bool(self.client.exists(self.prefix + key.hex().encode()))

    def get(self, key: bytes) -> bytes | None:
        k = self.prefix + key.hex().encode()
        entry = self.client.get(k)
        payload = None
        if entry is not None:
            payload, why = unpack_entry(self.namespace, entry)
            if payload is None:
                self.stats.add(corrupt=why == "corrupt")
                self.client.delete(k)
        if payload is None:
            self.stats.add(misses=1)
            return None
        self.stats.add(hits=1)
        self.stats.add(bytes_read=len(payload))
        return payload

    def put(self, key: bytes, payload: bytes, ttl_s: float) -> None:
        entry = pack_entry(self.namespace, payload, ttl_s)
        self.client.set(self.prefix + key.hex().encode(), entry, px=max(1, int(ttl_s * 1000)))
        self.stats.add(bytes_written=len(entry))
