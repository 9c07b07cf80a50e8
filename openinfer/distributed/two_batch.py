"""Two-batch overlap across attention (DeepSeek's TBO; docs/parallelism.md, "Two-batch overlap across attention").

With expert parallelism (`EngineConfig.two_batch_split="requests"`) a step of at least TBO_MIN_ROWS rows per rank
runs as two micro-batches of whole requests, each with its own AttentionMetadata, through layers split at the MoE
exchange: `attend(streams, half) -> (streams, flight)` (attention up to the MoE dispatch, sent asynchronously) and
`finish(streams, flight)` (the routed experts, the combine, the merge). With overlap the halves run staggered, so one
half's exchange is in flight while the other's attention or experts compute:

    attend(A, 0); attend(B, 0)
    finish(A, l); attend(A, l + 1); finish(B, l); attend(B, l + 1)    for each layer l

Without overlap the same halves run one after the other, so on = off bit for bit by construction (kernels see the
same row counts either way). The halves are two index ranges of the step's rows (decode rows first, then the
prefill chunks), cut at a request boundary (a prefill chunk's attention needs all its rows): concatenating the
outputs restores the step's order. Every rank runs both halves (an empty one exchanges padding rows only), with
each half's rows per rank agreed across ranks (step_sync.py) for the fixed-size exchanges.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from openinfer.distributed.expert_parallel import TBO_MIN_ROWS


def cut(request_starts: list[int], num_rows: int) -> int:
    """The row where the second micro-batch starts: the request boundary (the first row of a request, in
    `request_starts`, the first being row 0) that splits the step's rows most evenly — decode rows split by count,
    a prefill chunk whole on one side; ties to the earlier boundary. `num_rows` (everything in the first half) when
    no boundary lies inside the step (one request, or no rows)."""
    candidates = [s for s in request_starts if 0 < s < num_rows] + [num_rows]
    return min(candidates, key=lambda s: (abs(2 * s - num_rows), s))


def agreed_halves(max_rows: int, half_rows: tuple[int, int]) -> tuple[int, int] | None:
    """The rows per rank of the step's two micro-batches (the maxima over the ranks, agreed), or None: one batch
    (fewer than TBO_MIN_ROWS rows on every rank, or a half empty on every rank)."""
    if max_rows < TBO_MIN_ROWS or min(half_rows) == 0:
        return None
    return half_rows


@dataclass
class TwoBatch:
    """A step's two micro-batches: rows [0, cut) and [cut, T), each with its AttentionMetadata (its rows per rank
    and exchange in `moe_rows_per_rank` / `moe_exchange`), and whether they overlap."""
    cut: int
    metas: tuple
    overlap: bool

    @property
    def rows(self) -> tuple[slice, slice]:
        return slice(0, self.cut), slice(self.cut, None)

    def run(self, streams: torch.Tensor, num_layers: int, attend: Callable, finish: Callable) -> torch.Tensor:
        """`streams` [T, ...] through `num_layers` layers: `attend(layer, streams, half) -> (streams, flight)`,
        `finish(layer, streams, flight) -> streams`; the two halves' outputs concatenated (the step's order)."""
        s = [streams[r] for r in self.rows]
        if self.overlap:
            flights = [None, None]
            for h in (0, 1):
                s[h], flights[h] = attend(0, s[h], h)
            for layer in range(num_layers):
                for h in (0, 1):
                    s[h] = finish(layer, s[h], flights[h])
                    if layer + 1 < num_layers:
                        s[h], flights[h] = attend(layer + 1, s[h], h)
        else:
            for h in (0, 1):
                for layer in range(num_layers):
                    s[h], flight = attend(layer, s[h], h)
                    s[h] = finish(layer, s[h], flight)
        return torch.cat(s)
