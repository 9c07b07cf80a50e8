"""BlockPool's free queue made lazily (blocks never handed out are created on first allocation) against the queue
written the obvious way (every block queued at start): the same block ids handed out in the same order, the same
free counts, hashes evicted exactly when their block is reused, through random allocate / free / touch / cache."""

from __future__ import annotations

import random

from openinfer.kv_cache.block_pool import BlockPool


class QueuedAtStart:
    def __init__(self, n: int):
        self.queue, self.ref, self.hash = list(range(n)), [0] * n, {}

    def allocate(self, k: int) -> list[int]:
        ids, self.queue = self.queue[:k], self.queue[k:]
        for i in ids:
            self.ref[i] = 1
            self.hash.pop(i, None)
        return ids

    def free(self, ids: list[int]) -> None:
        for i in ids:
            self.ref[i] -= 1
            if self.ref[i] == 0:
                self.queue.append(i)

    def touch(self, ids: list[int]) -> None:
        for i in ids:
            if self.ref[i] == 0:
                self.queue.remove(i)
            self.ref[i] += 1


def test_lazy_free_queue_hands_out_what_a_queue_filled_at_start_would():
    rng = random.Random(0)
    for n in (1, 7, 64):
        pool, ref = BlockPool(n, enable_caching=True), QueuedAtStart(n)
        held: list[list] = []            # per "request": its blocks, in order
        for step in range(400):
            op = rng.random()
            if op < 0.45 and pool.num_free_blocks:
                k = rng.randint(1, pool.num_free_blocks)
                got = pool.allocate(k)
                assert [b.block_id for b in got] == ref.allocate(k)
                for j, b in enumerate(got):
                    if rng.random() < 0.5:
                        assert pool.cache(b, f"{step}-{j}".encode())
                        ref.hash[b.block_id] = f"{step}-{j}"
                held.append(got)
            elif op < 0.8 and held:
                blocks = held.pop(rng.randrange(len(held)))
                pool.free(blocks[::-1])
                ref.free([b.block_id for b in blocks[::-1]])
            elif ref.hash:
                bid, h = rng.choice(sorted(ref.hash.items()))
                block = pool.lookup(h.encode())
                assert block is not None and block.block_id == bid
                pool.touch([block])
                ref.touch([bid])
                held.append([block])
            assert pool.num_free_blocks == len(ref.queue)
            assert {h: b.block_id for h, b in pool._cached.items()} == {v.encode(): k for k, v in ref.hash.items()}
        for blocks in held:
            pool.free(blocks[::-1])
        assert pool.num_free_blocks == n and pool.reset_prefix_cache() and pool.num_cached_blocks == 0
