"""A MAX all-reduce of a few small host integers between the ranks of one host, through shared memory: the step
agreement of expert parallelism (`step_sync.py`) without a gloo round trip (measured in BENCHMARKS.md: a gloo
all-reduce of 4 ints costs 0.1-0.8 ms per step on loopback TCP, this a few microseconds when ranks arrive together).

Layout: one int64 word per (parity, rank, value), two parities. Rank r publishes round s's values in parity
`s % 2`, each word tagged with the round (`s << 32 | value`), so a reader needs no memory fence: a word is either
this round's or not, and 8-byte aligned stores are atomic on every 64-bit machine. A rank waits until every rank's
words carry round s, then takes the maximum. Two parities suffice: a rank that writes round s + 2 (over round s's
words) has seen every rank's round s + 1, so every rank has finished reading round s.

Waiting polls, then yields, then sleeps in growing steps (up to 0.2 ms): ranks usually arrive within microseconds
of each other at a steady decode step, and a rank waiting for a long prefill elsewhere must leave the cores to it.
While it sleeps it checks every 50 ms that the ranks it waits for are alive, and raises if one has exited (as a
gloo collective fails with "Connection closed by peer"), so the front end hears from every rank.

Values must fit in 32 bits (non-negative). Rank 0 creates the segment and hands its name to the others over the
gloo group once, at start; after everyone attached it unlinks the name (nothing is left in /dev/shm even if a rank
is killed; the mapping lives until the last rank exits).
"""

from __future__ import annotations

import os
import time
from multiprocessing import shared_memory

import numpy as np
import torch.distributed as dist

_ROUND_SHIFT = 32
_VALUE_MASK = (1 << _ROUND_SHIFT) - 1


class ShmMaxAgreement:
    def __init__(self, rank: int, world_size: int, num_values: int, group):
        """Collective: every rank of `group` (gloo, all on this host) constructs it at the same time."""
        self.rank, self.world, self.n = rank, world_size, num_values
        nbytes = 2 * world_size * num_values * 8
        if rank == 0:
            shm = shared_memory.SharedMemory(create=True, size=nbytes)
            np.ndarray((nbytes // 8,), dtype=np.int64, buffer=shm.buf)[:] = -1
            name = [shm.name]
        else:
            name = [None]
        dist.broadcast_object_list(name, src=0, group=group)
        if rank != 0:
            # (attaching registers the name with the resource tracker too: the ranks, forked from one fork
            # server, share one tracker, and rank 0's unlink below unregisters it for all)
            shm = shared_memory.SharedMemory(name=name[0])
        pids = [None] * world_size
        dist.all_gather_object(pids, os.getpid(), group=group)
        self._pids = pids
        if rank == 0:
            shm.unlink()
        self._shm = shm
        self._words = np.ndarray((2, world_size, num_values), dtype=np.int64, buffer=shm.buf)
        self._round = 0

    def all_reduce_max(self, values) -> list[int]:
        self._round += 1
        s = self._round
        tag = s << _ROUND_SHIFT
        words = self._words[s % 2]
        for i, v in enumerate(values):
            v = int(v)
            if not 0 <= v <= _VALUE_MASK:
                raise ValueError(f"shared-memory agreement carries integers in 0..2**32-1, got {v}")
            words[self.rank, i] = tag | v
        spins = 0
        delay = 0.0
        next_check = None
        while True:
            rounds = words >> _ROUND_SHIFT
            if int(rounds.min()) >= s:                       # every rank's words are this round's
                break
            spins += 1
            if spins < 200:
                continue
            if spins < 400:
                os.sched_yield()
                continue
            delay = min(2e-4, delay * 2 if delay else 5e-6)
            time.sleep(delay)
            now = time.monotonic()
            if next_check is None:
                next_check = now + 0.05
            elif now >= next_check:
                next_check = now + 0.05
                self._check_alive([r for r in range(self.world) if int(rounds[r].min()) < s])
        return [int(x) for x in (words & _VALUE_MASK).max(axis=0)]

    def _check_alive(self, waiting_for: list[int]) -> None:
        for r in waiting_for:
            try:
                os.kill(self._pids[r], 0)
            except ProcessLookupError:
                raise RuntimeError(f"rank {r} (pid {self._pids[r]}) exited while rank {self.rank} waited for it "
                                   f"in the step agreement (shared memory)") from None
            except PermissionError:
                pass

    def close(self) -> None:
        self._words = None
        self._shm.close()
