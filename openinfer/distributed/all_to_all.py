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

Exact sizes (eager steps: prefill chunks, anything not replayed from a graph): the same compaction, then one tiny
all-to-all of the per-destination row counts and one host read of them (per MoE layer and micro-batch: a layer's
routing depends on the previous layer's output, so the counts cannot be known once per step), and
`all_to_all_single` with those split sizes moves only the real rows, there and back. A rank then receives the
rows that route to it — n x (distinct ranks per row) in all instead of ep x n — and padding rows (expert id -1)
go nowhere. The rows are the padded path's in the same order, so the outputs are the same bits.
"""

from __future__ import annotations

import torch

DISPATCHES = ("all_gather", "all_to_all", "all_to_all_exact")
EXACT_MIN_EP = 4      # auto: exact sizes for eager steps from this EP size on (BENCHMARKS.md; GPU numbers pending)


def pick_dispatch(setting: str, ep_size: int, rows_per_rank: int, backend: str, captured: bool = False) -> str:
    """The exchange for a step: `setting` (`EngineConfig.moe_dispatch`: auto, all_gather, all_to_all or
    all_to_all_exact), the EP size, the step's agreed rows per rank, the collectives' backend and whether the step
    is a graph replay (every rank passes the same values, so every rank picks the same). A captured step cannot
    read counts on the host, so all_to_all_exact runs the padded all-to-all there. auto, from what was measured
    (BENCHMARKS.md, "Expert parallelism on the CPU"): eager steps from EP `EXACT_MIN_EP` on take exact sizes (the
    bytes fall to the padded ones' share of other ranks a row reaches: 83% at EP4, 56% at EP8, 9% at EP64 for
    top-6 of 256; at EP4 on gloo exact was 2-4x faster at 512 rows per rank in both runs and mixed below; at EP2,
    with nothing to save, slower at every size: the count round trip); otherwise with gloo the padded all-to-all
    from EP4 on
    (1.4-2x faster per layer at 1, 16 and 128 rows: gloo's all-gather and reduce-scatter walk a ring of ep - 1
    steps, its all-to-all exchanges pairwise), all-gather at EP2 (neither wins consistently: the bytes are the
    same); with NCCL the all-gather until the GPU sweep (benchmarks/gpu_deepseek_v4_ep.py, which reports all
    three) has measured the all-to-alls."""
    if setting == "all_to_all_exact":
        return "all_to_all" if captured else setting
    if setting in DISPATCHES:
        return setting
    if setting != "auto":
        raise ValueError(f"moe_dispatch must be auto, {', '.join(DISPATCHES)}, got {setting!r}")
    if not captured and ep_size >= EXACT_MIN_EP:
        return "all_to_all_exact"
    return "all_to_all" if backend == "gloo" and ep_size >= 4 else "all_gather"


def dispatch_layout(rows: torch.Tensor, phys: torch.Tensor, slots_per_rank: int, ep_size: int, capacity: int):
    """rows [n, B] (packed, the physical slot ids inside), phys [n, k] physical slots (-1: none) -> (send
    [ep x capacity, B]: block d holds the rows with a slot on rank d, in order, then padding rows; index
    [ep, capacity]: the row at each place, n for padding). capacity >= n (the worst case: exact; a smaller one
    would drop rows, so it is refused)."""
    n = rows.shape[0]
    if capacity < n:
        raise ValueError(f"all-to-all capacity {capacity} < {n} rows per rank would drop rows")
    index, _ = dispatch_index(phys, slots_per_rank, ep_size, capacity)
    padded = torch.cat([rows, _padding_row(rows, phys.shape[1])])
    return padded[index.flatten()], index


def dispatch_index(phys: torch.Tensor, slots_per_rank: int, ep_size: int, capacity: int):
    """phys [n, k] physical slots (-1: none) -> (index [ep, capacity]: the rows with a slot on rank d, in order,
    then n; counts [ep]: how many rows each rank needs), on the device without a host sync."""
    n, dev = phys.shape[0], phys.device
    dest = torch.where(phys >= 0, phys // slots_per_rank, ep_size)                       # [n, k]; ep: none
    need = torch.zeros(n, ep_size + 1, dtype=torch.bool, device=dev)
    need.scatter_(1, dest, True)
    need = need[:, :ep_size]                                                              # [n, ep]
    place = torch.cumsum(need.long(), 0) - 1                                              # [n, ep]
    place = torch.where(need, place, capacity)                                            # capacity: none
    index = torch.full((ep_size, capacity + 1), n, dtype=torch.long, device=dev)
    index.scatter_(1, place.t(), torch.arange(n, device=dev).expand(ep_size, n))
    return index[:, :capacity], need.sum(0)


def exact_rows(index: torch.Tensor, counts: list[int]) -> torch.Tensor:
    """index [ep, capacity] (`dispatch_index`) and its counts read on the host -> the row sent at each place of an
    exact send buffer: block d (counts[d] rows) holds index[d, :counts[d]]; no further host sync."""
    ep, capacity = index.shape
    dev = index.device
    total = sum(counts)
    c = torch.tensor(counts, dtype=torch.long).to(dev, non_blocking=True)
    start = torch.arange(ep, device=dev) * capacity - (torch.cumsum(c, 0) - c)       # flat place minus send place
    place = torch.repeat_interleave(start, c, output_size=total) + torch.arange(total, device=dev)
    return index.flatten()[place]


def _padding_row(rows: torch.Tensor, k: int) -> torch.Tensor:
    """A padding row in the packed layout [hidden bytes, int32 slot ids, float32 weights]: ids -1."""
    pad = torch.zeros(1, rows.shape[1], dtype=rows.dtype, device=rows.device)
    ids_at = rows.shape[1] - 8 * k
    pad[:, ids_at:ids_at + 4 * k] = 255
    return pad


def exact_combine(back: torch.Tensor, rows: torch.Tensor, n: int) -> torch.Tensor:
    """back [m, H] the partial sums returned for the exact send buffer's rows (`exact_rows`) -> [n, H] their sum
    per row, added in the padded path's order (destination by destination)."""
    out = back.new_zeros(n, back.shape[1])
    out.index_add_(0, rows, back)
    return out


def combine_layout(back: torch.Tensor, index: torch.Tensor, n: int) -> torch.Tensor:
    """back [ep x capacity, H] the partial sums returned for the rows at `index` -> [n, H] their sum per row
    (index n: padding)."""
    out = back.new_zeros(n + 1, back.shape[1])
    out.index_add_(0, index.flatten(), back)
    return out[:n]
