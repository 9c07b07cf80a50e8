"""CUDA graphs for a drafter's per-step call (issue: speculation must not fall back to eager).

A model drafter's `propose` is a dozen small kernels per layer over a batch of a few requests: eager, its launch
overhead is what a draft step costs (the SmolLM2 draft head: ~3.5 ms per step on the H200 against ~1 ms for the
target's graphed decode step). `BatchGraphs` replays such a call from CUDA graphs, one per batch bucket (powers
of two up to `max_batch`), captured the first time a bucket is needed: the call's per-request inputs [B, ...] are
copied into static buffers, rows past B are padding: zeros, or the input's `pad_values` entry (every input must
make a valid padding row: a position 0, a token 0; a request slot that is only read may be 0, one the call writes
must be a scratch slot), and the outputs (a tensor or a tuple/NamedTuple of tensors, each
[bucket, ...]) come back sliced to B. They are the graph's own buffers, valid until the next call; the callers
read them (to the host) before drafting again. The captured function must not sync with the host nor allocate
outside the graph's pool after capture (plain torch ops on device tensors satisfy both).
"""

from __future__ import annotations

from typing import Callable

import torch


def _buckets(max_batch: int) -> list[int]:
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 2
    return out + [max_batch]


class BatchGraphs:
    def __init__(self, fn: Callable, max_batch: int, pad_values: tuple[float, ...] | None = None):
        self.fn, self.buckets, self.pad_values = fn, _buckets(max_batch), pad_values
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, list[torch.Tensor], object]] = {}
        self.pool = torch.cuda.graph_pool_handle()
        self.replays = 0

    def __call__(self, *inputs: torch.Tensor):
        B = inputs[0].shape[0]
        bucket = next((b for b in self.buckets if b >= B), None)
        if bucket is None:
            raise ValueError(f"batch {B} is above the {self.buckets[-1]} requests the drafter's graphs hold")
        if bucket not in self.graphs:
            self.graphs[bucket] = self._capture(bucket, inputs)
        graph, static, out = self.graphs[bucket]
        for i, (buf, x) in enumerate(zip(static, inputs)):
            buf[:B].copy_(x)
            buf[B:].fill_(self.pad_values[i] if self.pad_values else 0)
        graph.replay()
        self.replays += 1
        if isinstance(out, torch.Tensor):
            return out[:B]
        return type(out)(*(t[:B] for t in out))

    def _capture(self, bucket: int, examples: tuple[torch.Tensor, ...]):
        static = [torch.full((bucket, *x.shape[1:]), self.pad_values[i] if self.pad_values else 0, dtype=x.dtype,
                             device=x.device) for i, x in enumerate(examples)]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):            # warm up (lazy inits, autotuning) outside the capture
            self.fn(*static)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self.fn(*static)
        return graph, static, out
