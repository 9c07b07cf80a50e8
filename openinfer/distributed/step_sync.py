"""The step protocol between ranks whose forwards exchange data (expert parallelism).

Each EP rank schedules its own requests, yet MoE layers exchange tokens with every other rank, so all
ranks must run a forward in the same steps with the same exchange sizes. Before each forward the ranks
agree, in one all-reduce (MAX) of six host integers (no device sync) — through shared memory when every rank
is on this host (`shm_agreement.py`: microseconds), else over the gloo group (a TCP round trip):
- whether any rank has work (if none, nobody runs);
- the rows each rank passes to the MoE exchange: the step's largest token count;
- whether every rank can replay a decode CUDA graph, and then the largest decode batch, so all replay
  graphs of one batch bucket (a graph's exchange size is its bucket);
- the rows of each of the step's two micro-batches of whole requests (two_batch.py; 0 when not asked for).
A rank without requests runs a padding row (eager) or a graph of padding rows, so collectives line up.
"""

from __future__ import annotations

from dataclasses import dataclass

import time

import torch
import torch.distributed as dist

from openinfer.distributed.parallel_state import ParallelContext
from openinfer.distributed.shm_agreement import ShmMaxAgreement


@dataclass
class StepPlan:
    any_work: bool
    max_tokens: int          # the largest token count of any rank this step
    graph_batch: int         # > 0: every rank replays a decode graph covering this batch; 0: all run eager
    half_rows: tuple[int, int] = (0, 0)   # the largest rows of each two-batch half (two_batch.py) of any rank


class StepSync:
    def __init__(self, ctx: ParallelContext, channel: str = "gloo"):
        """`channel`: "shm" (every rank on this host) or "gloo"; collective (every rank builds it together)."""
        if channel not in ("shm", "gloo"):
            raise ValueError(f"step agreement channel must be 'shm' or 'gloo', got {channel!r}")
        self.ctx = ctx
        self.channel = channel
        self._buf = torch.zeros(6, dtype=torch.long)
        self._shm = ShmMaxAgreement(ctx.rank, ctx.world_size, 6, ctx.cpu_group) if channel == "shm" else None
        self.wait_s = 0.0        # host time spent agreeing (includes waiting for slower ranks)
        self.rounds = 0

    def exchange(self, num_tokens: int, graph_batch: int | None, half_rows: tuple[int, int] = (0, 0)) -> StepPlan:
        """`graph_batch`: this rank's decode batch if it could replay a graph (0 when idle), None if it must
        run eager (prefill rows, or a batch beyond the graphs); `half_rows`: the rows of its two-batch halves."""
        mine = (int(num_tokens > 0), num_tokens, int(graph_batch is None), graph_batch or 0, *half_rows)
        t = time.perf_counter()
        if self._shm is not None:
            any_work, max_tokens, some_eager, batch, half_a, half_b = self._shm.all_reduce_max(mine)
        else:
            b = self._buf
            b.copy_(torch.tensor(mine))
            dist.all_reduce(b, op=dist.ReduceOp.MAX, group=self.ctx.cpu_group)
            any_work, max_tokens, some_eager, batch, half_a, half_b = b.tolist()
        self.wait_s += time.perf_counter() - t
        self.rounds += 1
        return StepPlan(bool(any_work), max_tokens, 0 if some_eager else max(batch, 1), (half_a, half_b))
