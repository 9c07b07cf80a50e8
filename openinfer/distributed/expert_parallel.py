"""MoE expert parallelism: each EP rank holds `slots_per_rank` physical expert slots; a token's routed
experts run on the ranks holding them and the results come back to the token's rank.

Two exchanges with sizes fixed by the step's agreed row count (no counts exchanged first, no host sync,
capturable in CUDA graphs): one all-gather and one reduce-scatter per MoE layer (the "all-gather dispatch" of
Megatron and vLLM's naive backend: every rank receives every rank's tokens with their routing, computes its own
slots' share, the partial sums are reduce-scattered back), or two all-to-alls (`all_to_all.py`: each token only
to the ranks of its experts, padded blocks per destination); and for eager steps a third, two all-to-alls of
exact sizes after a tiny one of the counts (one host read per layer and micro-batch). The runner picks one per
step (`all_to_all.pick_dispatch`) and may split the step's rows in two overlapped micro-batches (two-batch
overlap); docs/parallelism.md has the numbers.

Routing (logical expert ids from the router) is packed with the hidden rows into one byte tensor so one
collective carries both. Padding rows (ranks run the same number of rows: the step's maximum) carry
expert id -1 and cost nothing. With all-gather every rank sees all tokens' routing, so the per-expert load
statistics EPLB needs are identical on every rank without a reduction; with all-to-all each rank counts its own
rows and EplbController sums the counts over the ranks after the step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from openinfer.distributed.all_to_all import (combine_layout, dispatch_index, dispatch_layout, exact_combine,
                                              exact_rows, pick_dispatch)
from openinfer.distributed.collectives import ep_all_gather, ep_all_to_all, ep_all_to_all_sizes, ep_reduce_scatter
from openinfer.distributed.eplb import ExpertPlacement, num_physical_experts
from openinfer.distributed.parallel_state import ParallelContext


class ExpertRouting(nn.Module):
    """One MoE layer's map from logical experts to physical slots (updated in place by EPLB, so captured
    CUDA graphs stay valid) and its token counter per logical expert."""

    def __init__(self, num_logical: int, max_replicas: int, slots_per_rank: int, ep_rank: int):
        super().__init__()
        self.slots_per_rank, self.ep_rank = slots_per_rank, ep_rank
        self.register_buffer("replica_table", torch.zeros(num_logical, max_replicas, dtype=torch.long),
                             persistent=False)
        self.register_buffer("replica_count", torch.ones(num_logical, dtype=torch.long), persistent=False)
        self.register_buffer("load", torch.zeros(num_logical, dtype=torch.long), persistent=False)

    def set_replicas(self, table: torch.Tensor, count: torch.Tensor) -> None:
        """table [E, R'] physical slots of each expert's replicas (R' <= max_replicas), count [E]."""
        self.replica_table.zero_()
        self.replica_table[:, :table.shape[1]].copy_(table)
        self.replica_count.copy_(count)

    def physical_slots(self, experts: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Logical ids [N, k] (-1: none) -> the physical slot of the replica each row uses (-1: none). Row n
        (its index `rows[n]` in the step's rank-major layout: source rank x rows per rank + position, the same
        whichever exchange carries it) uses replica (n mod count), so an expert's tokens split evenly over its
        replicas; counts the load as a side effect."""
        valid = experts >= 0
        e = experts.clamp(min=0)
        self.load.index_add_(0, e.flatten(), valid.flatten().long())
        phys = self.replica_table[e, rows[:, None] % self.replica_count[e]]
        return torch.where(valid, phys, -1)

    def local_of(self, phys: torch.Tensor) -> torch.Tensor:
        """Physical slots (-1: none) -> this rank's local slot ids, -1 for slots on other ranks."""
        local = phys - self.ep_rank * self.slots_per_rank
        return torch.where((phys >= 0) & (local >= 0) & (local < self.slots_per_rank), local, -1)

    def local_slots(self, experts: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Logical ids [N, k] -> this rank's slot of the replica each row uses, -1 elsewhere (counts the load)."""
        if rows is None:
            rows = torch.arange(experts.shape[0], device=experts.device)
        return self.local_of(self.physical_slots(experts, rows))


def initial_layout(num_layers: int, num_logical: int, ctx: ParallelContext):
    """(placement, (slots per rank, most replicas one expert can have)) of `num_layers` expert-parallel MoE
    layers, first as a plain checkpoint split (`ExpertPlacement.initial`); None without expert parallelism.
    The placement is a host tensor even while the model is built on "meta"."""
    if ctx.ep_size == 1:
        return None
    physical = num_physical_experts(num_logical, ctx.num_redundant_experts, ctx.ep_size)
    with torch.device("cpu"):
        placement = ExpertPlacement.initial(num_layers, num_logical, physical, ctx.ep_size)
    return placement, (placement.slots_per_rank, physical - num_logical + 1)


def checkpoint_slots(placement: ExpertPlacement, ep_rank: int) -> dict[int, list[int]]:
    """Logical expert -> this rank's slots holding it (in the initial placement every layer's is the same):
    where a loader copies checkpoint expert e; an expert absent here is skipped."""
    slots: dict[int, list[int]] = {}
    for slot, e in enumerate(placement.local_logical(ep_rank)[0].tolist()):
        slots.setdefault(e, []).append(slot)
    return slots


def expert_parallel_moe(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, routing: ExpertRouting,
                        routed, meta, ctx: ParallelContext) -> torch.Tensor:
    """One MoE layer's routed experts under expert parallelism: exchange every rank's rows with their routing,
    `routed(rows, local slot ids [N, k] (-1: another rank's), weights)` computes this rank's slots' partial
    sums, and the partial sums of this rank's T rows come back summed. `meta`: the step's AttentionMetadata
    (moe_rows_per_rank, moe_valid_rows, moe_communicate: the lockstep sizes the runner agreed on;
    moe_exchange: which dispatch, and whether two micro-batches overlap, `MoeExchange`).

    Micro-batches: a step of R >= TBO_MIN_ROWS rows per rank runs its exchange and experts in two fixed halves
    (`split_rows`, the same on every rank), with or without two-batch overlap, so that overlap changes no bit:
    CPU and GPU GEMM libraries pick kernels by the row count, so a half's expert GEMMs round differently from the
    whole's (1 ulp, measured), and the halves must be the same computation either way. With two-batch overlap
    (`micro_batches=2`) the second half's dispatch is in flight while the first half's experts compute, and the
    first half's combine while the second's compute (asynchronous collectives: on NCCL its stream, waited on by
    the compute stream through events, no host wait; on gloo its threads); without, each half's collectives are
    waited for in turn. Each row's replica choice follows its place in the rank-major layout of the whole step,
    not its half."""
    T = x.shape[0]
    R = meta.moe_rows_per_rank or T
    exchange = meta.moe_exchange or MoeExchange()
    path = EXCHANGES[exchange.dispatch]
    halves = split_rows(R)
    packed = pack_rows(x, valid_experts(experts, meta), weights, R)
    comm = meta.moe_communicate
    if exchange.micro_batches == 2:
        # the dispatches go out first; each half's experts run as soon as its rows arrive
        flights = [path.dispatch(packed, x, o, n, R, routing, ctx, comm, True) for o, n in halves]
        combines = [path.combine(f, routed, routing, ctx, comm, True) for f in flights]
        outs = [path.finish(c) for c in combines]
    else:
        outs = [path.finish(path.combine(path.dispatch(packed, x, o, n, R, routing, ctx, comm, False), routed,
                                         routing, ctx, comm, False)) for o, n in halves]
    return (torch.cat(outs) if len(outs) > 1 else outs[0])[:T]


def valid_experts(experts: torch.Tensor, meta) -> torch.Tensor:
    """Expert ids [T, k] with the rows at or past `meta.moe_valid_rows` (an idle rank's padding row) made -1."""
    if meta.moe_valid_rows is None:
        return experts
    return torch.where(torch.arange(experts.shape[0], device=experts.device)[:, None] < meta.moe_valid_rows,
                       experts, -1)


def send_micro_batch(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, routing: ExpertRouting,
                     meta, ctx: ParallelContext):
    """Two-batch overlap across attention (two_batch.py): one micro-batch's rows, whole (padded to its agreed
    `meta.moe_rows_per_rank`, exchanged by `meta.moe_exchange.dispatch`), sent to their experts' ranks
    asynchronously; `receive_micro_batch` computes this rank's slots' share and brings the sums back."""
    T = x.shape[0]
    R = meta.moe_rows_per_rank or T
    path = EXCHANGES[meta.moe_exchange.dispatch]
    packed = pack_rows(x, valid_experts(experts, meta), weights, R)
    return path, path.dispatch(packed, x, 0, R, R, routing, ctx, meta.moe_communicate, True), T, meta.moe_communicate


def receive_micro_batch(flight, routed, routing: ExpertRouting, ctx: ParallelContext) -> torch.Tensor:
    """The micro-batch's routed-expert output [T, H] (`routed` as in `expert_parallel_moe`): waits for its rows,
    computes this rank's share, sends the partial sums back and waits for its own rows' sums."""
    path, sent, T, communicate = flight
    return path.finish(path.combine(sent, routed, routing, ctx, communicate, True))[:T]


@dataclass(frozen=True)
class MoeExchange:
    """A step's choice of MoE exchange (the runner picks it from agreed values, so every rank picks the same):
    `dispatch` "all_gather", "all_to_all" or "all_to_all_exact", `micro_batches` 1 or 2 (two-batch overlap)."""
    dispatch: str = "all_gather"
    micro_batches: int = 1

    @property
    def counts_own_rows(self) -> bool:
        """Each rank counted only its own rows' expert load (the all-to-alls): EPLB sums the counts after the step."""
        return self.dispatch != "all_gather"


def step_exchange(dispatch: str, two_batch_overlap: bool, ep_size: int, rows_per_rank: int,
                  backend: str, captured: bool = False) -> MoeExchange:
    """The exchange of a step whose ranks agreed on `rows_per_rank` (EngineConfig.moe_dispatch and
    two_batch_overlap; the same on every rank); `captured`: a CUDA-graph bucket's (no exact sizes there)."""
    return MoeExchange(pick_dispatch(dispatch, ep_size, rows_per_rank, backend, captured),
                       2 if two_batch_overlap else 1)


TBO_MIN_ROWS = 32     # rows per rank from which a step runs in two halves (below, nothing worth overlapping)


def split_rows(R: int) -> list[tuple[int, int]]:
    """(offset, rows) of each micro-batch of R rows per rank: two halves from TBO_MIN_ROWS on, else one."""
    if R < TBO_MIN_ROWS:
        return [(0, R)]
    first = (R + 1) // 2
    return [(0, first), (first, R - first)]


def pack_rows(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, R: int) -> torch.Tensor:
    """This rank's T rows as one byte tensor [R, H bytes + 4k (int32 expert ids) + 4k (float32 weights)],
    padded to R rows (expert id -1: no compute)."""
    T, H = x.shape
    k = experts.shape[1]
    nx = H * x.element_size()
    packed = torch.empty(R, nx + 8 * k, dtype=torch.uint8, device=x.device)
    packed[:T, :nx] = x.contiguous().view(torch.uint8)
    packed[:T, nx:nx + 4 * k] = experts.to(torch.int32).view(torch.uint8)
    packed[:T, nx + 4 * k:] = weights.float().contiguous().view(torch.uint8)
    if R > T:
        packed[T:].zero_()
        packed[T:, nx:nx + 4 * k] = 255          # int32 -1
    return packed


def unpack_rows(packed: torch.Tensor, dtype: torch.dtype, H: int, k: int):
    nx = H * torch.empty((), dtype=dtype).element_size()
    xa = packed[:, :nx].contiguous().view(dtype)
    ea = packed[:, nx:nx + 4 * k].contiguous().view(torch.int32).long()
    wa = packed[:, nx + 4 * k:].contiguous().view(torch.float32)
    return xa, ea, wa


def _wait(work) -> None:
    if work is not None:
        work.wait()


class AllGather:
    """Every rank receives every rank's rows with their routing, computes its slots' share, and the partial sums
    are reduce-scattered back: sizes fixed by the step's rows (no counts, no host sync, capturable). At EP2 with
    top-6 routing a token needs both ranks 97% of the time, so this moves what two all-to-alls would."""

    @staticmethod
    def dispatch(packed, x, o, n, R, routing, ctx, communicate, overlap):
        part = packed[o:o + n]
        if not communicate:           # the warm-up before a graph capture: same shapes, no collective
            return part.repeat(ctx.ep_size, 1), None, (x.dtype, x.shape[1], o, n, R)
        everyone, work = ep_all_gather(part, ctx, async_op=True) if overlap else (ep_all_gather(part, ctx), None)
        return everyone, work, (x.dtype, x.shape[1], o, n, R)

    @staticmethod
    def combine(flight, routed, routing, ctx, communicate, overlap):
        everyone, work, (dtype, H, o, n, R) = flight
        _wait(work)
        k = (everyone.shape[1] - H * torch.empty((), dtype=dtype).element_size()) // 8
        xa, ea, wa = unpack_rows(everyone, dtype, H, k)
        j = torch.arange(everyone.shape[0], device=everyone.device)
        rows = (j // n) * R + o + j % n                  # place in the rank-major layout of the whole step
        partial = routed(xa, routing.local_slots(ea, rows), wa)
        if not communicate:
            return partial[ctx.ep_rank * n:(ctx.ep_rank + 1) * n], None
        return ep_reduce_scatter(partial, ctx, async_op=True) if overlap else (ep_reduce_scatter(partial, ctx), None)

    @staticmethod
    def finish(combine):
        mine, work = combine
        _wait(work)
        return mine


def physical_part(packed, x, o, n, R, routing, ctx):
    """The micro-batch's rows of `packed` (a copy) with their logical expert ids replaced by the physical slots of
    the replicas they use (-1: none), the slots [n, k] and k; counts this rank's rows' load (summed after the
    step)."""
    nx = x.shape[1] * x.element_size()
    k = (packed.shape[1] - nx) // 8
    part = packed[o:o + n].clone()
    ids = part[:, nx:nx + 4 * k].contiguous().view(torch.int32).long()
    rows = ctx.ep_rank * R + o + torch.arange(n, device=packed.device)
    phys = routing.physical_slots(ids, rows)
    part[:, nx:nx + 4 * k] = phys.to(torch.int32).view(torch.uint8)
    return part, phys, k


class AllToAll:
    """all_to_all.py: each row goes only to the ranks holding its experts' replicas, in blocks of a fixed
    capacity per destination; partial sums come back the same way and add up on the row's rank."""

    @staticmethod
    def dispatch(packed, x, o, n, R, routing, ctx, communicate, overlap):
        H, dtype = x.shape[1], x.dtype
        part, phys, k = physical_part(packed, x, o, n, R, routing, ctx)
        send, index = dispatch_layout(part, phys, routing.slots_per_rank, ctx.ep_size, capacity=n)
        if not communicate:
            return send, None, index, (dtype, H, k)
        recv, work = ep_all_to_all(send, ctx, async_op=True) if overlap else (ep_all_to_all(send, ctx), None)
        return recv, work, index, (dtype, H, k)

    @staticmethod
    def combine(flight, routed, routing, ctx, communicate, overlap):
        recv, work, index, (dtype, H, k) = flight
        _wait(work)
        xa, pa, wa = unpack_rows(recv, dtype, H, k)
        partial = routed(xa, routing.local_of(pa), wa)
        if not communicate:
            return partial, None, index
        back, work = ep_all_to_all(partial, ctx, async_op=True) if overlap else (ep_all_to_all(partial, ctx), None)
        return back, work, index

    @staticmethod
    def finish(combine):
        back, work, index = combine
        _wait(work)
        return combine_layout(back, index, index.shape[1])


class AllToAllExact:
    """all_to_all.py with exact sizes (eager steps only): the rows each rank sends to each other rank are counted
    on the device, the counts exchanged (a tiny all-to-all) and read once on the host, and only real rows travel,
    there and back; the partial sums add up on the row's rank in the padded path's order."""

    @staticmethod
    def dispatch(packed, x, o, n, R, routing, ctx, communicate, overlap):
        part, phys, k = physical_part(packed, x, o, n, R, routing, ctx)
        index, counts = dispatch_index(phys, routing.slots_per_rank, ctx.ep_size, n)
        send, recv = torch.stack([counts, ep_all_to_all(counts, ctx)]).tolist()      # the one host read
        rows = exact_rows(index, send)
        out, work = ep_all_to_all_sizes(part[rows], send, recv, ctx, async_op=True) if overlap else (
            ep_all_to_all_sizes(part[rows], send, recv, ctx), None)
        return out, work, (rows, send, recv, n), (x.dtype, x.shape[1], k)

    @staticmethod
    def combine(flight, routed, routing, ctx, communicate, overlap):
        got, work, sizes, (dtype, H, k) = flight
        _wait(work)
        xa, pa, wa = unpack_rows(got, dtype, H, k)
        partial = routed(xa, routing.local_of(pa), wa)
        rows, send, recv, n = sizes
        back, work = ep_all_to_all_sizes(partial, recv, send, ctx, async_op=True) if overlap else (
            ep_all_to_all_sizes(partial, recv, send, ctx), None)
        return back, work, rows, n

    @staticmethod
    def finish(combine):
        back, work, rows, n = combine
        _wait(work)
        return exact_combine(back, rows, n)


EXCHANGES = {"all_gather": AllGather, "all_to_all": AllToAll, "all_to_all_exact": AllToAllExact}
