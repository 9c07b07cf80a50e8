"""The collectives models call, each a no-op for a group of one. Tensors stay where they are (NCCL on
CUDA, gloo on CPU); all are capturable in CUDA graphs on NCCL."""

from __future__ import annotations

import torch
import torch.distributed as dist

from openinfer.distributed.parallel_state import ParallelContext

_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def tp_all_reduce(x: torch.Tensor, ctx: ParallelContext) -> torch.Tensor:
    """Sum over the tensor-parallel group (row-parallel linears); in place."""
    if ctx.tp_size > 1:
        dist.all_reduce(x, group=ctx.tp_group)
    return x


def tp_all_gather(x: torch.Tensor, ctx: ParallelContext, dim: int = -1) -> torch.Tensor:
    """Concatenate the TP ranks' shards along `dim` (rank order)."""
    if ctx.tp_size == 1:
        return x
    return _all_gather(x, ctx.tp_size, ctx.tp_group, dim)


def ep_all_gather(x: torch.Tensor, ctx: ParallelContext, async_op: bool = False):
    """[T, ...] on each EP rank -> [ep_size * T, ...], rank-major (every rank passes the same T). `async_op`:
    (output, work) with the collective in flight (work None for a group of one)."""
    if ctx.ep_size == 1:
        return (x, None) if async_op else x
    if not async_op:
        return _all_gather(x, ctx.ep_size, ctx.ep_group, 0)
    x = x.contiguous()
    out = x.new_empty((ctx.ep_size * x.shape[0], *x.shape[1:]))
    return out, _gather(out, x, group=ctx.ep_group, async_op=True)


def ep_reduce_scatter(x: torch.Tensor, ctx: ParallelContext, async_op: bool = False):
    """[ep_size * T, ...] partial sums on each EP rank -> this rank's [T, ...] slice of their sum. `async_op`: as
    `ep_all_gather`."""
    if ctx.ep_size == 1:
        return (x, None) if async_op else x
    out = x.new_empty((x.shape[0] // ctx.ep_size, *x.shape[1:]))
    work = _reduce_scatter(out, x.contiguous(), group=ctx.ep_group, async_op=async_op)
    return (out, work) if async_op else out


def ep_all_reduce(x: torch.Tensor, ctx: ParallelContext) -> torch.Tensor:
    """Sum over the EP group, in place."""
    if ctx.ep_size > 1:
        dist.all_reduce(x, group=ctx.ep_group)
    return x


def ep_all_to_all(x: torch.Tensor, ctx: ParallelContext, async_op: bool = False):
    """[ep_size * C, ...] on each EP rank, block d for rank d -> [ep_size * C, ...], block s from rank s (equal
    blocks). `async_op`: (output, work) with the collective in flight; else the output."""
    x = x.contiguous()
    out = torch.empty_like(x)
    if ctx.ep_size == 1:
        out.copy_(x)
        return (out, None) if async_op else out
    work = dist.all_to_all_single(out, x, group=ctx.ep_group, async_op=async_op)
    return (out, work) if async_op else out


def ep_all_to_all_sizes(x: torch.Tensor, send: list[int], recv: list[int], ctx: ParallelContext,
                        async_op: bool = False):
    """[sum(send), ...] on each EP rank, send[d] rows for rank d in rank order -> [sum(recv), ...], recv[s] rows
    from rank s (uneven blocks; the sizes on the host, as `all_to_all_single` needs them). `async_op`: as
    `ep_all_to_all`."""
    x = x.contiguous()
    out = x.new_empty((sum(recv), *x.shape[1:]))
    if ctx.ep_size == 1:
        out.copy_(x)
        return (out, None) if async_op else out
    work = dist.all_to_all_single(out, x, output_split_sizes=recv, input_split_sizes=send, group=ctx.ep_group,
                                  async_op=async_op)
    return (out, work) if async_op else out


def _all_gather(x: torch.Tensor, n: int, group, dim: int) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((n * x.shape[0], *x.shape[1:]))
    _gather(out, x, group=group)
    if dim in (0, -x.dim()):
        return out
    return torch.cat(out.chunk(n, dim=0), dim=dim)
