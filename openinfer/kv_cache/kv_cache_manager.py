"""KVCacheManager: decides *where* a request's cache lives; owns block tables, hashes and state slots.

The scheduler asks it two things: which prefix of a new request is already cached, and whether the slots
for N more tokens can be had. It never touches tensors; the runner maps block ids to memory.

Prefix caching: block i of a request is keyed by sha256(hash of block i-1 || its token ids), so a hit on
block i implies the whole prefix before it matches. A block is registered once all its tokens are
scheduled; within one step every layer writes the whole batch's KV before any attention reads it, so a
request scheduled after the writer in the same step may already share the block.
"""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import dataclass

from openinfer.engine.request import Request
from openinfer.kv_cache.block_pool import BlockPool, KVBlock


def hash_block(parent: bytes | None, token_ids: list[int]) -> bytes:
    h = hashlib.sha256(parent or b"")
    h.update(array("q", token_ids).tobytes())
    return h.digest()


@dataclass
class PrefixCacheStats:
    queried_tokens: int = 0
    hit_tokens: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool, num_state_slots: int = 0):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.prefix_stats = PrefixCacheStats()
        self._blocks: dict[str, list[KVBlock]] = {}
        self._block_ids: dict[str, list[int]] = {}   # the same tables as ids (what the runner reads)
        self._num_registered: dict[str, int] = {}   # leading blocks already offered to the prefix cache
        self._free_state_slots = list(range(num_state_slots - 1, -1, -1))
        self._state_slot: dict[str, int] = {}
        self.num_state_slots = num_state_slots

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
        self._extend_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        self.prefix_stats.queried_tokens += request.num_tokens
        self.prefix_stats.hit_tokens += len(hits) * self.block_size
        return hits, len(hits) * self.block_size

    def can_fit(self, num_tokens: int) -> bool:
        """Whether a request of this many tokens could ever be held, with the pool otherwise empty."""
        return -(-num_tokens // self.block_size) <= self.pool.num_blocks

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       computed_blocks: list[KVBlock] | None = None) -> bool:
        """Make room for `num_new_tokens` more tokens after the computed ones (plus cache hits); False if the
        pool can't, in which case nothing changed."""
        rid = request.request_id
        blocks = self._blocks.get(rid)
        if blocks is not None and not computed_blocks:
            # fast path (most decode steps): the tokens fit the last block and no block fills up
            total = request.num_computed_tokens + num_new_tokens
            if (total <= len(blocks) * self.block_size and (self.num_state_slots == 0 or rid in self._state_slot)
                    and (not self.enable_prefix_caching
                         or min(total, request.num_tokens) // self.block_size <= self._num_registered.get(rid, 0))):
                return True
        computed_blocks = computed_blocks or []
        blocks = self._blocks.setdefault(rid, [])
        total = request.num_computed_tokens + len(computed_blocks) * self.block_size + num_new_tokens
        need = -(-total // self.block_size) - len(blocks) - len(computed_blocks)
        reclaimed = sum(1 for b in computed_blocks if b.ref_cnt == 0)   # hits now sitting in the free queue
        need_slot = self.num_state_slots > 0 and rid not in self._state_slot
        if max(need, 0) > self.pool.num_free_blocks - reclaimed or (need_slot and not self._free_state_slots):
            if not blocks:
                del self._blocks[rid]
            return False
        self.pool.touch(computed_blocks)
        new_blocks = computed_blocks + (self.pool.allocate(need) if need > 0 else [])
        blocks.extend(new_blocks)
        self._block_ids.setdefault(rid, []).extend(b.block_id for b in new_blocks)
        if need_slot:
            self._state_slot[rid] = self._free_state_slots.pop()
        if self.enable_prefix_caching:
            self._extend_hashes(request)
            start = self._num_registered.get(rid, 0)
            full = min(total, request.num_tokens) // self.block_size
            for i in range(start, full):
                self.pool.cache(blocks[i], request.block_hashes[i])
            self._num_registered[rid] = max(start, full)
        return True

    def free(self, request: Request) -> None:
        rid = request.request_id
        self.pool.free(list(reversed(self._blocks.pop(rid, []))))
        self._block_ids.pop(rid, None)
        self._num_registered.pop(rid, None)
        slot = self._state_slot.pop(rid, None)
        if slot is not None:
            self._free_state_slots.append(slot)

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()
