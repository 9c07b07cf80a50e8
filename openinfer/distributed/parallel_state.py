"""Where one process sits among the ranks of an engine, and its process groups.

Layout (docs/parallelism.md): `world = data_parallel_size x context_parallel_size x tensor_parallel_size` ranks,
rank `r = (dp_rank * cp_size + cp_rank) * tp_size + tp_rank`. Tensor-parallel ranks of one DP group share requests
and split every matrix; context-parallel ranks share requests and split a step's prefill tokens
(distributed/context_parallel.py); data-parallel groups own their requests and KV pools. With expert parallelism
the routed experts are split over all `world` ranks (the EP group is the world, as in vLLM and DeepInfer's
attention-DP + EP).

A `ParallelContext` is built once per process and handed to the model and the runner; nothing reads ranks
from globals. `ParallelContext.single()` is the one-process context (every collective is the identity).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass
class ParallelContext:
    world_size: int = 1
    rank: int = 0
    dp_size: int = 1
    dp_rank: int = 0
    tp_size: int = 1
    tp_rank: int = 0
    cp_size: int = 1            # context parallelism: ranks of a DP group splitting prefill chunks
    cp_rank: int = 0
    ep_size: int = 1            # 1: experts replicated (no expert parallelism)
    ep_rank: int = 0
    num_redundant_experts: int = 0   # EP: the lower bound of extra expert slots (EPLB replicas)
    tp_group: dist.ProcessGroup | None = None
    cp_group: dist.ProcessGroup | None = None
    ep_group: dist.ProcessGroup | None = None
    # gloo over all ranks, for host-side agreement (step sizes, EPLB decisions): never waits for the device
    cpu_group: dist.ProcessGroup | None = None
    backend: str = "gloo"
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @classmethod
    def single(cls, device: torch.device | str = "cpu") -> "ParallelContext":
        return cls(device=torch.device(device))

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_driver(self) -> bool:
        """The rank of its DP group whose outputs the front end reads (TP rank 0 of CP rank 0)."""
        return self.tp_rank == 0 and self.cp_rank == 0


def rank_layout(dp_size: int, tp_size: int, rank: int, cp_size: int = 1) -> tuple[int, int, int]:
    """(dp_rank, tp_rank, cp_rank) of a global rank."""
    return rank // (tp_size * cp_size), rank % tp_size, rank // tp_size % cp_size


def init_parallel(dp_size: int, tp_size: int, enable_expert_parallel: bool, rank: int, device: torch.device,
                  init_method: str = "env://", timeout_s: float = 600.0,
                  num_redundant_experts: int = 0, cp_size: int = 1) -> ParallelContext:
    """Join the process group (NCCL for CUDA devices, gloo for CPU) and make the TP, CP, EP and host groups.
    Every rank calls this with the same sizes; `init_method` is `env://` (torchrun's variables: MASTER_ADDR,
    MASTER_PORT) or `tcp://host:port`."""
    world = dp_size * cp_size * tp_size
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = datetime.timedelta(seconds=timeout_s)
    kwargs = {"device_id": device} if device.type == "cuda" else {}
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world, timeout=timeout,
                            **kwargs)
    dp_rank, tp_rank, cp_rank = rank_layout(dp_size, tp_size, rank, cp_size)
    tp_group = cp_group = None
    for d in range(dp_size):        # every rank creates every group, in the same order
        for c in range(cp_size):
            g = dist.new_group([(d * cp_size + c) * tp_size + t for t in range(tp_size)], timeout=timeout)
            if (d, c) == (dp_rank, cp_rank):
                tp_group = g
        if cp_size > 1:
            for t in range(tp_size):
                g = dist.new_group([(d * cp_size + c) * tp_size + t for c in range(cp_size)], timeout=timeout)
                if (d, t) == (dp_rank, tp_rank):
                    cp_group = g
    world_group = dist.group.WORLD
    cpu_group = world_group if backend == "gloo" else dist.new_group(list(range(world)), backend="gloo",
                                                                      timeout=timeout)
    ep = enable_expert_parallel and world > 1
    return ParallelContext(world_size=world, rank=rank, dp_size=dp_size, dp_rank=dp_rank, tp_size=tp_size,
                           tp_rank=tp_rank, cp_size=cp_size, cp_rank=cp_rank, ep_size=world if ep else 1,
                           ep_rank=rank if ep else 0, num_redundant_experts=num_redundant_experts if ep else 0,
                           tp_group=tp_group, cp_group=cp_group, ep_group=world_group if ep else None,
                           cpu_group=cpu_group,
                           backend=backend, device=device)


def destroy_parallel() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
