"""All-to-all dispatch and combine for expert parallelism (the token -> expert-rank exchange of DeepEP, spec §4
Wide-EP), with a static capacity per destination so that every size is known without a host sync and the
exchange is capturable in CUDA graphs.

Dispatch: each of this rank's n rows goes to every rank that holds one of its experts' chosen replicas (once per
rank, carrying all k physical slot ids and weights; the receiver computes the ones it holds). Rows bound for
rank d are compacted, in row order, into block d of a send buffer of `ep x capacity` rows; the rest of the block
is padding (slot id -1: no compute). `index[d, c]` remembers which row sits at (d, c). One all_to_all_single
delivers block d to rank d. Combine: each rank sends back its partial sums for the rows it received, block by
block, and the row's rank adds the blocks at `index` (padding adds into a dropped row).

Capacity: exact needs the worst case, every row to one destination, so capacity = n (the step's agreed rows per
rank): then the padded buffers move as many bytes as the all-gather path (`expert_parallel.AllGather`) and win
nothing on the wire — what a rank receives is still ep x n rows. A capacity below n would cut the bytes by
ep / (expected distinct ranks per row) at wide EP, but rows beyond it would have to be dropped or sent again,
which is not exact; DeepEP's low-latency kernels avoid the dilemma by writing only the real rows into the
padded buffers with one-sided (NVSHMEM) puts, which torch collectives cannot do. docs/parallelism.md has the
measured bytes and times per EP size and what is left.

Compaction is computed on the device with a cumulative sum and a scatter (no `nonzero`, no host sync).
"""

from __future__ import annotations

import torch

DISPATCHES = ("all_gather", "all_to_all")


def pick_dispatch(setting: str, ep_size: int, rows_per_rank: int, backend: str) -> str:
    """The exchange for a step: `setting` ("auto", "all_gather" or "all_to_all", `EngineConfig.moe_dispatch`),
    the EP size, the step's agreed rows per rank and the collectives' backend (every rank passes the same values,
    so every rank picks the same). auto, from what was measured (BENCHMARKS.md, "Expert parallelism on the CPU"):
    with gloo, all-to-all from EP4 on (1.4-2x faster per layer at 1, 16 and 128 rows: gloo's all-gather and
    reduce-scatter walk a ring of ep - 1 steps, its all-to-all exchanges pairwise), all-gather at EP2 (neither
    wins consistently: the bytes are the same); with NCCL the all-gather until the GPU sweep
    (benchmarks/gpu_deepseek_v4_ep.py, which reports both) has measured the all-to-all."""
    if setting in DISPATCHES:
        return setting
    if setting != "auto":
        raise ValueError(f"moe_dispatch must be auto, all_gather or all_to_all, got {setting!r}")
    return "all_to_all" if backend == "gloo" and ep_size >= 4 else "all_gather"


def dispatch_layout(rows: torch.Tensor, phys: torch.Tensor, slots_per_rank: int, ep_size: int, capacity: int):
    """rows [n, B] (packed, the physical slot ids inside), phys [n, k] physical slots (-1: none) -> (send
    [ep x capacity, B]: block d holds the rows with a slot on rank d, in order, then padding rows; index
    [ep, capacity]: the row at each place, n for padding). capacity >= n (the worst case: exact; a smaller one
    would drop rows, so it is refused)."""
    n = rows.shape[0]
    if capacity < n:
        raise ValueError(f"all-to-all capacity {capacity} < {n} rows per rank would drop rows")
    dev = rows.device
    dest = torch.where(phys >= 0, phys // slots_per_rank, ep_size)                       # [n, k]; ep: none
    need = torch.zeros(n, ep_size + 1, dtype=torch.bool, device=dev)
    need.scatter_(1, dest, True)
    need = need[:, :ep_size]                                                              # [n, ep]
    place = torch.cumsum(need.long(), 0) - 1                                              # [n, ep]
    place = torch.where(need, place, capacity)                                            # capacity: none
    index = torch.full((ep_size, capacity + 1), n, dtype=torch.long, device=dev)
    index.scatter_(1, place.t(), torch.arange(n, device=dev).expand(ep_size, n))
    index = index[:, :capacity]
    padded = torch.cat([rows, _padding_row(rows, phys.shape[1])])
    return padded[index.flatten()], index


def _padding_row(rows: torch.Tensor, k: int) -> torch.Tensor:
    """A padding row in the packed layout [hidden bytes, int32 slot ids, float32 weights]: ids -1."""
    pad = torch.zeros(1, rows.shape[1], dtype=rows.dtype, device=rows.device)
    ids_at = rows.shape[1] - 8 * k
    pad[:, ids_at:ids_at + 4 * k] = 255
    return pad


def combine_layout(back: torch.Tensor, index: torch.Tensor, n: int) -> torch.Tensor:
    """back [ep x capacity, H] the partial sums returned for the rows at `index` -> [n, H] their sum per row
    (index n: padding)."""
    out = back.new_zeros(n + 1, back.shape[1])
    out.index_add_(0, index.flatten(), back)
    return out[:n]
