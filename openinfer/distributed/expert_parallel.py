"""MoE expert parallelism: each EP rank holds `slots_per_rank` physical expert slots; a token's routed
experts run on the ranks holding them and the results come back to the token's rank.

The exchange is one all-gather and one reduce-scatter per MoE layer (the "all-gather dispatch" of
Megatron and vLLM's naive backend) rather than two all-to-alls: every rank receives every rank's tokens
with their routing, computes its own slots' share, and the partial sums are reduce-scattered back. At
EP2 with top-6 routing a token needs both ranks 97% of the time, so the volume equals all-to-all's; the
sizes are fixed by the step's token count (no counts exchanged first, no host sync), which keeps the step
capturable in CUDA graphs. Wider EP wants all-to-all; docs/parallelism.md has the numbers.

Routing (logical expert ids from the router) is packed with the hidden rows into one byte tensor so one
collective carries both. Padding rows (ranks run the same number of rows: the step's maximum) carry
expert id -1 and cost nothing. Every rank sees all tokens' routing, so the per-expert load statistics
EPLB needs are identical on every rank without a reduction.
"""

from __future__ import annotations

import torch
from torch import nn

from openinfer.distributed.collectives import ep_all_gather, ep_reduce_scatter
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

    def local_slots(self, experts: torch.Tensor) -> torch.Tensor:
        """Logical ids [N, k] (-1: none) -> this rank's slot of the replica each row uses, -1 elsewhere.
        Row n uses replica (n mod count), so an expert's tokens split evenly over its replicas; counts the
        load as a side effect."""
        valid = experts >= 0
        e = experts.clamp(min=0)
        self.load.index_add_(0, e.flatten(), valid.flatten().long())
        row = torch.arange(experts.shape[0], device=experts.device)[:, None]
        phys = self.replica_table[e, row % self.replica_count[e]]
        local = phys - self.ep_rank * self.slots_per_rank
        here = valid & (local >= 0) & (local < self.slots_per_rank)
        return torch.where(here, local, -1)


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
    (moe_rows_per_rank, moe_valid_rows, moe_communicate: the lockstep sizes the runner agreed on)."""
    T = x.shape[0]
    xa, ea, wa = exchange_tokens(x, experts, weights, meta.moe_rows_per_rank or T, meta.moe_valid_rows, ctx,
                                 meta.moe_communicate)
    return combine_tokens(routed(xa, routing.local_slots(ea), wa), T, ctx, meta.moe_communicate)


def exchange_tokens(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, rows_per_rank: int,
                    valid_rows: torch.Tensor | None, ctx: ParallelContext, communicate: bool = True):
    """Pack (hidden, expert ids, weights) of this rank's T rows, pad to `rows_per_rank`, all-gather.
    Returns every rank's rows: x [ep * rows_per_rank, H], experts (-1 on padding), weights. `valid_rows`
    (a device scalar) marks rows at or past it as padding too (CUDA-graph padding). `communicate=False`
    (the warm-up run before a graph capture) repeats the local rows instead: same shapes, no collective."""
    T, H = x.shape
    k = experts.shape[1]
    if valid_rows is not None:
        experts = torch.where(torch.arange(T, device=x.device)[:, None] < valid_rows, experts, -1)
    nx = H * x.element_size()
    packed = torch.empty(rows_per_rank, nx + 8 * k, dtype=torch.uint8, device=x.device)
    packed[:T, :nx] = x.contiguous().view(torch.uint8)
    packed[:T, nx:nx + 4 * k] = experts.to(torch.int32).view(torch.uint8)
    packed[:T, nx + 4 * k:] = weights.float().contiguous().view(torch.uint8)
    if rows_per_rank > T:
        packed[T:].zero_()
        packed[T:, nx:nx + 4 * k] = 255          # int32 -1
    everyone = ep_all_gather(packed, ctx) if communicate else packed.repeat(ctx.ep_size, 1)
    xa = everyone[:, :nx].contiguous().view(x.dtype)
    ea = everyone[:, nx:nx + 4 * k].contiguous().view(torch.int32).long()
    wa = everyone[:, nx + 4 * k:].contiguous().view(torch.float32)
    return xa, ea, wa


def combine_tokens(partial: torch.Tensor, T: int, ctx: ParallelContext, communicate: bool = True) -> torch.Tensor:
    """Partial expert outputs for every rank's rows [ep * rows_per_rank, H] -> this rank's summed [T, H]."""
    if communicate:
        mine = ep_reduce_scatter(partial, ctx)
    else:
        n = partial.shape[0] // ctx.ep_size
        mine = partial[ctx.ep_rank * n:(ctx.ep_rank + 1) * n]
    return mine[:T]
