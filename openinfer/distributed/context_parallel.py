"""Balanced context parallelism for long prefill (spec §4.5): one step's prefill chunks split over the CP ranks
of a DP group, each rank a front and a back piece of every chunk (zigzag), K/V exchanged by all-gather.

The split. A chunk of `n` new tokens (after `c` cached ones) is cut into `2·cp` consecutive pieces whose
boundaries are `⌊i·n / 2cp⌋`; CP rank `r` takes pieces `r` and `2cp − 1 − r`. A query at position `p` attends to
`p + 1` keys, so a piece's causal work grows with its place in the chunk; pairing the i-th piece from the front
with the i-th from the back makes every rank's sum the same: with equal pieces of `s` tokens each rank's work is
`s·(2c + 2cp·s + 1)` keys, independent of `r`. Rounding makes pieces differ by at most one token, so the busiest
rank does at most `≈ 2·(c + n)` more key visits than the mean (`attention_work` computes it exactly; the tests
assert it from the assignment). A contiguous split (rank r the r-th n/cp tokens) gives the last rank
`(2cp − 1)/cp` of the mean with no prefix: 1.5× at CP2, 1.75× at CP4. Tokens per rank (the linear layers' work)
differ by at most two.

The step. Decode rows are not split: every CP rank runs all of them (a decode-only step does not use CP at all:
decode is unchanged). A rank's rows are the decode rows, then its pieces of each chunk in chunk order. Each
attention layer computes q, k, v for its own rows, all-gathers the rotated k and v of the prefill rows over the CP
group, writes the whole chunk's K/V into its own pool, and attends its own queries; after the last layer the
hidden rows are all-gathered the same way, so every CP rank holds the whole step's hidden states, computes the
same logits and samples the same tokens (the CP ranks of a group share one seeded generator, as TP ranks do).

Where KV lands: in every CP rank's pool, whole (the CP ranks of a DP group share one schedule and one block
table, as TP ranks do). Decode then runs on each CP rank as on one process. The pool is not divided by CP: the
cost is cp copies of the KV, the gain that decode needs no change and no exchange.

Why all-gather and not a ring: measured on the CPU (benchmarks/cpu_context_parallel.py, BENCHMARKS.md), the two
are even at CP2 and the all-gather takes 0.72-0.89x the ring's time at CP4 on gloo; it is also one collective. A
ring pays off when each step's transfer hides behind a block of attention (GPU, NVLink, long chunks) —
`ring_all_gather` is the exchange such a kernel would use and is tested equal to the all-gather.

DeepSeek-V4/V4.1 (models/deepseek_v4, deepseek_v41): their attention's KV side (window ring, compressor groups,
indexer keys) crosses piece boundaries, so its input rows are gathered and the KV side runs over the whole step on
every rank; queries, the indexer's picks and attention then run on this rank's pieces only (`query_spans`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from openinfer.distributed.parallel_state import ParallelContext

_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


# ---- the assignment ------------------------------------------------------------------------------------------
def zigzag_pieces(n: int, cp: int) -> list[list[tuple[int, int]]]:
    """Per CP rank, its pieces `(a, b)` (token offsets in the chunk, b exclusive): pieces r and 2cp−1−r of 2cp."""
    edges = [i * n // (2 * cp) for i in range(2 * cp + 1)]
    return [[(edges[r], edges[r + 1]), (edges[2 * cp - 1 - r], edges[2 * cp - r])] for r in range(cp)]


def contiguous_pieces(n: int, cp: int) -> list[list[tuple[int, int]]]:
    """The naive split, for comparison: rank r takes the r-th of cp consecutive slices."""
    edges = [i * n // cp for i in range(cp + 1)]
    return [[(edges[r], edges[r + 1])] for r in range(cp)]


def attention_work(pieces: list[tuple[int, int]], cached: int = 0) -> int:
    """Key visits of causal attention over these pieces of a chunk after `cached` tokens: the query at position p
    visits p + 1 keys."""
    return sum((cached + a + cached + b + 1) * (b - a) // 2 for a, b in pieces)


# ---- one step ------------------------------------------------------------------------------------------------
@dataclass
class ContextParallelStep:
    """A step's CP plan on one rank: which of the step's rows are local, and how gathered prefill rows go back
    to the step's order. Built identically on every CP rank from the same schedule."""
    ctx: ParallelContext
    num_decode: int                 # rows [0, num_decode) of the step: local on every rank
    local_rows: np.ndarray          # the step's rows this rank computes (decode rows first), in local order
    pieces: list[list[tuple[int, int, int]]]   # per chunk: (local query start, a, b) of this rank's pieces
    max_prefill_rows: int           # the most prefill rows any rank holds (the gather's padded size)
    order: torch.Tensor             # gathered (rank-major, padded) prefill rows -> the step's prefill rows
    # the whole step as one process sees it (set by the runner): cache slots, positions and token ids on the
    # device, its chunks and AttentionMetadata (for models whose attention's KV side runs over the whole step:
    # DeepSeek-V4/V4.1, `query_spans`)
    slot_mapping: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    input_ids: torch.Tensor | None = None
    chunks: list | None = None      # the whole step's PrefillChunks
    meta: object = None
    local_index: torch.Tensor | None = None    # local_rows on the device
    image_rows: torch.Tensor | None = None     # the step's rows inside image spans (vision models), on the device

    @classmethod
    def plan(cls, ctx: ParallelContext, num_decode: int, chunk_lens: list[int], device) -> "ContextParallelStep":
        cp, me = ctx.cp_size, ctx.cp_rank
        rank_rows: list[list[np.ndarray]] = [[] for _ in range(cp)]     # each rank's prefill rows (step rows)
        counts = [0] * cp
        mine: list[list[tuple[int, int, int]]] = []
        start = num_decode
        for n in chunk_lens:
            here = []
            for r, pieces in enumerate(zigzag_pieces(n, cp)):
                for a, b in pieces:
                    if b > a:
                        if r == me:
                            here.append((num_decode + counts[r], a, b))
                        rank_rows[r].append(np.arange(start + a, start + b))
                        counts[r] += b - a
            mine.append(here)
            start += n
        rows = [np.concatenate(r) if r else np.zeros(0, dtype=np.int64) for r in rank_rows]
        width = max(1, *counts)
        # gathered position r * width + i holds rank r's i-th prefill row; order[j] = where step row num_decode+j is
        where = np.empty(start - num_decode, dtype=np.int64)
        for r, own in enumerate(rows):
            where[own - num_decode] = r * width + np.arange(len(own))
        local = np.concatenate([np.arange(num_decode), rows[me]])
        return cls(ctx, num_decode, local, mine, width,
                   torch.from_numpy(where).to(device, non_blocking=True))

    def local_of(self, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Of the step's rows `rows`, those this rank computes: (their indices in `rows`, their local rows)."""
        local = np.full(int(max(rows.max(initial=-1), self.local_rows.max(initial=-1))) + 1, -1, dtype=np.int64)
        local[self.local_rows] = np.arange(len(self.local_rows))
        at = local[rows]
        keep = np.flatnonzero(at >= 0)
        return keep, at[keep]

    def localize(self, ids: list[int], pos: torch.Tensor, slots: torch.Tensor, chunks: list):
        """The step's inputs cut to this rank's rows: token ids, positions and slots, and each chunk's
        `PrefillChunk` (layers/attention.py) replaced by one per local piece (a piece [a, b) of a chunk that ends
        at context_len attends as a chunk of b − a queries ending at context_len − query_len + b)."""
        rows = torch.from_numpy(self.local_rows)
        local_chunks = [dataclasses.replace(c, query_start=qs, query_len=b - a,
                                            context_len=c.context_len - c.query_len + b)
                        for c, pieces in zip(chunks, self.pieces) for qs, a, b in pieces]
        return [ids[i] for i in self.local_rows.tolist()], pos[rows], slots[rows], local_chunks

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's rows [len(local_rows), ...] -> the step's rows [num_decode + prefill rows, ...]: decode rows from
        here (every rank has them), prefill rows all-gathered over the CP group and put back in step order."""
        d = self.num_decode
        mine = x[d:]
        pad = self.max_prefill_rows - mine.shape[0]
        if pad:
            mine = torch.cat([mine, mine.new_zeros((pad, *mine.shape[1:]))])
        gathered = cp_all_gather(mine, self.ctx)
        return torch.cat([x[:d], gathered.index_select(0, self.order)])


def cp_all_gather(x: torch.Tensor, ctx: ParallelContext) -> torch.Tensor:
    """[T, ...] on each CP rank -> [cp_size * T, ...], rank-major (every rank passes the same T)."""
    x = x.contiguous()
    out = x.new_empty((ctx.cp_size * x.shape[0], *x.shape[1:]))
    _gather(out, x, group=ctx.cp_group)
    return out


def ring_all_gather(x: torch.Tensor, ctx: ParallelContext) -> torch.Tensor:
    """The same result as `cp_all_gather` by cp − 1 ring steps (send to the next rank, receive from the
    previous): the exchange a ring-attention kernel overlaps with its blocks. Kept for the measurement."""
    cp, me = ctx.cp_size, ctx.cp_rank
    ranks = dist.get_process_group_ranks(ctx.cp_group)
    out = x.new_empty((cp, *x.shape))
    out[me] = x
    block = x.contiguous()
    for step in range(1, cp):
        recv = torch.empty_like(block)
        ops = [dist.P2POp(dist.isend, block, ranks[(me + 1) % cp], group=ctx.cp_group),
               dist.P2POp(dist.irecv, recv, ranks[(me - 1) % cp], group=ctx.cp_group)]
        for w in dist.batch_isend_irecv(ops):
            w.wait()
        out[(me - step) % cp] = recv
        block = recv
    return out.view(cp * x.shape[0], *x.shape[1:])


def query_spans(meta, cp: ContextParallelStep | None, device) -> list[tuple[slice, slice, torch.Tensor | None, object]]:
    """A step's attention spans for models whose KV side runs over the whole step (DeepSeek): per span — the decode
    rows, then each prefill chunk of `meta` (the whole step's AttentionMetadata) — (its rows in the step, its
    queries' rows, which of the span's rows query or None for all, its PrefillChunk or None). Without `cp` the
    queries are the span's rows; with it a chunk's queries are this rank's pieces, consecutive in its rows."""
    nd = meta.num_decode_tokens
    spans = [(slice(0, nd), slice(0, nd), None, None)] if nd else []
    for i, p in enumerate(meta.prefills):
        sl = slice(p.query_start, p.query_start + p.query_len)
        if cp is None:
            spans.append((sl, sl, None, p))
            continue
        pieces = cp.pieces[i]
        first = pieces[0][0] if pieces else nd
        sel = torch.cat([torch.arange(a, b) for _, a, b in pieces]) if pieces else torch.zeros(0, dtype=torch.long)
        spans.append((sl, slice(first, first + len(sel)), sel.to(device), p))
    return spans
