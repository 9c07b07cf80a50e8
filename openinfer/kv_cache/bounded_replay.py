"""Sliding-window state on a prefix hit: the hit rule and bounded replay (spec 000 §5.3–5.7, docs/kv_cache.md).

A model with sliding-window layers (Gemma-3) needs two things from a cached prefix of L1 tokens: the
full-attention layers' KV of every position (block KV: the pool, or the prefix-KV store, which keeps only
these rows), and the windowed layers' KV of the last window before L1 (the SWA state). Blocks read from the
store lack their windowed rows, so a hit can have exact block KV and no window state. The hit rule (§5.7):

1. block KV decides the hit length L1 (whole blocks);
2. if the windowed rows the first query after L1 reads (keys L1-W+1 .. L1-1) are all present, in the pool or
   in the host-memory SWA state tier (saved when a request ends, at its last block boundary), hit = L1;
3. else the request **replays** the end of its prefix: its computed tokens start earlier, the replayed rows
   rebuild only the windowed layers' KV, and the full-attention layers' block KV is reused untouched (never
   rewritten).

Replay modes (`EngineConfig.swa_replay`):
- `"bounded"` (the spec's §5.4): replay only the window before L1. A replayed query at position i in a windowed
  layer attends to keys max(s, i-W+1) .. i, where s is where the window's blocks begin: keys before s would
  need windowed rows that are missing, so they are dropped. Cost: one window of tokens, whatever L1 is; the
  result is approximate (measured in BENCHMARKS.md, "Bounded replay").
- `"exact"`: replay from the first block whose windowed rows are missing, with full windows (every key a
  query's window reaches is present or recomputed): equal to no cache, at up to the cost of the whole prefix.

Windowed rows that are present (pool blocks another request computed) are read but never rewritten by a
replay, so a replay cannot change what another running request sees.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

REPLAY_MODES = ("bounded", "exact")


@dataclass(frozen=True)
class SlidingWindowLayout:
    """Which layers of a model attend through a window, as the model declares it (`swa_layout()`)."""
    window: int                        # W: a query at p sees keys p-W < j <= p
    window_layers: tuple[int, ...]     # layer indices with a window; the others attend to everything

    def full_layers(self, num_layers: int) -> tuple[int, ...]:
        return tuple(i for i in range(num_layers) if i not in self.window_layers)


def window_blocks(num_hit_blocks: int, block_size: int, window: int) -> range:
    """Blocks holding the keys (before L1 = num_hit_blocks * block_size) that the first query at L1 reads
    through a window: positions L1-W+1 .. L1-1."""
    first = max(0, (num_hit_blocks * block_size - window + 1) // block_size)
    return range(first, num_hit_blocks)


@dataclass(frozen=True)
class ReplayPlan:
    """How a request rebuilds its windowed rows after a hit of `end` tokens (all multiples of the block size)."""
    start: int                 # first recomputed position: the request's computed tokens start here
    end: int                   # L1: positions before it keep their full-attention KV (not rewritten)
    window_floor: int          # windowed layers see no key before this position (0: no truncation)
    kept_blocks: frozenset[int] = frozenset()   # blocks in [start, end) whose windowed rows are present

    @property
    def num_replayed_tokens(self) -> int:
        return self.end - self.start


def plan_replay(windowed_rows_present: list[bool], block_size: int, window: int, mode: str) -> ReplayPlan | None:
    """The hit rule's step 3 for hit blocks whose windowed rows are present or not (one flag per hit block,
    in order); None when the window before the hit is complete (nothing to replay)."""
    if mode not in REPLAY_MODES:
        raise ValueError(f"swa_replay must be one of {REPLAY_MODES}, got {mode!r}")
    n = len(windowed_rows_present)
    needed = window_blocks(n, block_size, window)
    if all(windowed_rows_present[i] for i in needed):
        return None
    if mode == "exact":
        first_missing, floor = windowed_rows_present.index(False), 0
    else:
        first_missing = next(i for i in needed if not windowed_rows_present[i])
        floor = needed.start * block_size
    kept = frozenset(i for i in range(first_missing, n) if windowed_rows_present[i])
    return ReplayPlan(first_missing * block_size, n * block_size, floor, kept)


def replay_slot_mappings(positions: np.ndarray, slots: np.ndarray, plan: ReplayPlan, block_size: int,
                         scratch_slot: int) -> tuple[np.ndarray, np.ndarray]:
    """A replaying chunk's cache slots for (full-attention layers, windowed layers): rows whose KV must not be
    rewritten go to the scratch slot (full layers: every position before `end`; windowed layers: positions in
    kept blocks)."""
    full = np.where(positions < plan.end, scratch_slot, slots)
    kept = np.isin(positions // block_size, np.fromiter(plan.kept_blocks, dtype=np.int64, count=len(plan.kept_blocks)))
    return full, np.where(kept & (positions < plan.end), scratch_slot, slots)


def window_layer_chunk(chunk, plan: ReplayPlan):
    """The prefill chunk as windowed layers see it: a sequence starting at `window_floor` (a block boundary), so
    no key before it is visible. Attention depends on positions only through the causal offset, and rotary
    embeddings were applied before the cache, so shifting the context start is exactly the truncation."""
    if plan.window_floor == 0:
        return chunk
    skip = plan.window_floor // chunk.block_size
    return dataclasses.replace(chunk, block_ids=chunk.block_ids[skip:], context_len=chunk.context_len - plan.window_floor)
