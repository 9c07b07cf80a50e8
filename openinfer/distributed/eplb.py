"""EPLB: the expert-parallel load balancer (DeepSeek's technique, as in DeepSeek-V3's serving and vLLM).

With expert parallelism every MoE layer is a barrier: each EP rank computes the tokens routed to the experts
it holds, then all ranks exchange results, so every layer runs at the speed of its *busiest* rank. Routing
is skewed (a few experts draw many times the mean), so the plain checkpoint split (rank r holds experts
[r*S, (r+1)*S)) leaves most ranks waiting for the one holding the hot experts. EPLB fixes that in three parts:

* **Redundant experts.** Each rank holds S = P / ep_size *physical slots* per layer, P = E logical (routed)
  experts + R redundant slots (R at least `num_redundant_experts`, rounded up so P divides by the EP size:
  `num_physical_experts`). A redundant slot holds a second (third...) replica of a hot expert; routing sends
  a token to replica `token_index % count` of the expert it picked, so the expert's tokens split evenly
  over its replicas (`ExpertPlacement.replicas`).
* **Load statistics.** Each step the model's routers count the tokens sent to each logical expert; a
  `LoadWindow` keeps the last `window_steps` steps on the host (copied back behind the step's device work, so
  no step waits for it) with their running sum, which `moe_lb` and the placements are computed from.
* **Periodic rebalancing.** Every `rebalance_interval` steps, the window's counts (summed over the EP group,
  so every rank sees the same numbers) give a new placement (`balanced_placement`); `plan_moves` lists the
  slots whose expert changed and where to copy their weights from, and `apply_moves` copies them (locally
  or by point-to-point sends between ranks). `rebalance` bundles the decision, skipping a new placement that
  would not lower the imbalance enough to be worth moving weights.

The placement policy, per layer: (1) replicate the heaviest: each redundant slot goes, greedily, to the
expert with the highest load *per replica* (ties to the lower expert id); (2) pack: the replicas, heaviest
first, each go to the least-loaded rank that still has a free slot (ties to the lower rank), avoiding a rank
that already holds that expert when another is free; every rank ends with exactly S slots. This is the
greedy longest-processing-time heuristic for the makespan (the busiest rank's load), which is the quantity
that matters, since all ranks wait for the busiest one at every MoE layer. The imbalance is reported as
`moe_lb` = busiest rank / mean rank (1.0 = perfect). Everything is deterministic (stable orders, no
randomness), so all ranks compute the same placement from the same counts without further agreement.
"""

from __future__ import annotations

import heapq
from collections import Counter, deque
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from openinfer.device_io import D2HCopy


def num_physical_experts(num_logical: int, num_redundant_min: int, ep_size: int) -> int:
    """E + redundant, redundant being the smallest number >= `num_redundant_min` that makes the total divisible
    by `ep_size` (each rank holds the same number of slots)."""
    if num_logical < 1:
        raise ValueError(f"num_logical experts must be >= 1, got {num_logical}")
    if num_redundant_min < 0:
        raise ValueError(f"num_redundant_experts must be >= 0, got {num_redundant_min}")
    if ep_size < 1:
        raise ValueError(f"ep_size must be >= 1, got {ep_size}")
    if ep_size > num_logical:
        raise ValueError(f"ep_size {ep_size} > {num_logical} logical experts: some rank would hold no expert of "
                         f"its own (only redundant copies); use at most {num_logical} EP ranks")
    total = num_logical + num_redundant_min
    return -(-total // ep_size) * ep_size


@dataclass(eq=False)
class ExpertPlacement:
    """Which logical expert each physical slot holds, per MoE layer. Slots [r*S, (r+1)*S) live on EP rank r."""

    phys_to_logical: torch.Tensor     # [L, P] int64; every logical expert has >= 1 slot in each layer
    ep_size: int
    num_logical: int | None = field(default=None)   # None: max id + 1

    def __post_init__(self) -> None:
        p2l = self.phys_to_logical
        if p2l.dim() != 2:
            raise ValueError(f"phys_to_logical must be [layers, physical], got shape {tuple(p2l.shape)}")
        if p2l.dtype != torch.int64:
            self.phys_to_logical = p2l = p2l.to(torch.int64)
        num_layers, num_phys = p2l.shape
        if self.ep_size < 1 or num_phys % self.ep_size:
            raise ValueError(f"{num_phys} physical slots do not divide over ep_size {self.ep_size}")
        if num_phys == 0:
            raise ValueError("a placement needs at least one physical slot")
        if self.num_logical is None:
            self.num_logical = int(p2l.max()) + 1 if p2l.numel() else 0
        if p2l.numel():
            if int(p2l.min()) < 0 or int(p2l.max()) >= self.num_logical:
                raise ValueError(f"phys_to_logical holds ids outside [0, {self.num_logical})")
            counts = self._counts()
            if bool((counts == 0).any()):
                layer, expert = (counts == 0).nonzero()[0].tolist()
                raise ValueError(f"layer {layer}: logical expert {expert} has no physical slot")

    # ------------------------------------------------------------------ shape
    @property
    def num_layers(self) -> int:
        return self.phys_to_logical.shape[0]

    @property
    def num_physical(self) -> int:
        return self.phys_to_logical.shape[1]

    @property
    def slots_per_rank(self) -> int:
        return self.num_physical // self.ep_size

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ExpertPlacement):
            return NotImplemented
        return (self.ep_size == other.ep_size and self.num_logical == other.num_logical
                and self.phys_to_logical.shape == other.phys_to_logical.shape
                and torch.equal(self.phys_to_logical.cpu(), other.phys_to_logical.cpu()))

    def to(self, device: torch.device | str) -> "ExpertPlacement":
        return ExpertPlacement(self.phys_to_logical.to(device), self.ep_size, self.num_logical)

    # ------------------------------------------------------------------ construction
    @classmethod
    def initial(cls, num_layers: int, num_logical: int, num_physical: int, ep_size: int) -> "ExpertPlacement":
        """Logical e in slot e (with no redundancy rank r holds experts [r*S, (r+1)*S), the layout of a plain
        checkpoint split); the extra slots replicate experts 0, 1, 2, ... in order."""
        if num_physical < num_logical:
            raise ValueError(f"{num_physical} physical slots cannot hold {num_logical} logical experts")
        row = torch.arange(num_physical, dtype=torch.int64) % num_logical
        return cls(row.unsqueeze(0).repeat(num_layers, 1), ep_size, num_logical)

    # ------------------------------------------------------------------ views
    def _counts(self) -> torch.Tensor:
        p2l = self.phys_to_logical
        counts = torch.zeros(p2l.shape[0], self.num_logical, dtype=torch.int64, device=p2l.device)
        return counts.scatter_add_(1, p2l, torch.ones_like(p2l))

    def replicas(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(table [L, E, R] int64: the physical slots of each logical expert, in increasing order, padded by
        repeating the first; count [L, E] int64). Routing sends a token to `table[l, e, token_index % count]`."""
        p2l = self.phys_to_logical
        num_layers, num_phys = p2l.shape
        counts = self._counts()
        max_rep = int(counts.max())
        order = torch.sort(p2l, dim=1, stable=True).indices                 # slots grouped by expert, ascending
        sorted_experts = torch.gather(p2l, 1, order)
        starts = torch.cumsum(counts, dim=1) - counts                         # [L, E] first index of each group
        pos = torch.arange(num_phys, device=p2l.device).expand(num_layers, -1) - torch.gather(starts, 1,
                                                                                              sorted_experts)
        first = torch.gather(order, 1, starts)                                # [L, E] first replica
        table = first.unsqueeze(-1).repeat(1, 1, max_rep)
        layer_idx = torch.arange(num_layers, device=p2l.device).unsqueeze(1).expand(-1, num_phys)
        table[layer_idx, sorted_experts, pos] = order
        return table, counts

    def local_logical(self, ep_rank: int) -> torch.Tensor:
        """[L, S]: the logical expert in each of this rank's slots."""
        if not 0 <= ep_rank < self.ep_size:
            raise ValueError(f"ep_rank {ep_rank} outside [0, {self.ep_size})")
        s = self.slots_per_rank
        return self.phys_to_logical[:, ep_rank * s:(ep_rank + 1) * s]


# ---------------------------------------------------------------------------------------------- statistics

def rank_loads(load: torch.Tensor, placement: ExpertPlacement) -> torch.Tensor:
    """[L, E] tokens per logical expert -> [L, ep_size] expected tokens per rank (float64) when each expert's
    tokens split evenly over its replicas."""
    if load.shape != (placement.num_layers, placement.num_logical):
        raise ValueError(f"load shape {tuple(load.shape)} != (layers, logical experts) "
                         f"{(placement.num_layers, placement.num_logical)}")
    p2l = placement.phys_to_logical.to(load.device)
    counts = placement._counts().to(load.device)
    per_replica = load.to(torch.float64) / counts
    slot_load = torch.gather(per_replica, 1, p2l)                             # [L, P]
    return slot_load.view(placement.num_layers, placement.ep_size, placement.slots_per_rank).sum(-1)


def moe_lb(rank_loads: torch.Tensor) -> float:
    """Imbalance: max rank load / mean rank load, averaged over layers weighted by each layer's total load
    (1.0 = perfect; 1.0 when there is no load)."""
    loads = rank_loads.to(torch.float64)
    if loads.dim() == 1:
        loads = loads.unsqueeze(0)
    total = float(loads.sum())
    if total <= 0:
        return 1.0
    # sum_l total_l * (max_l / (total_l / n)) / sum_l total_l == n * sum_l max_l / sum_l total_l
    return loads.shape[1] * float(loads.max(dim=1).values.sum()) / total


class LoadWindow:
    """Tokens per logical expert over the last `window_steps` steps, on the host: a ring buffer [window, L, E] and
    its running sum, so reading the window costs O(L * E) whatever its length (stats read it after every step).

    `record` never waits for the device: counts on a GPU are copied to pinned memory behind the work queued so
    far (`device_io.D2HCopy`) and enter the window once that copy is done — checked at the next `record` or read
    (`settle`). A read with `wait=True` first takes in every step recorded (a host sync: rebalancing); with
    `wait=False` it sees the steps whose counts have arrived (stats while the latest step still runs)."""

    def __init__(self, num_layers: int, num_logical: int, window_steps: int, dtype: torch.dtype = torch.int32) -> None:
        if window_steps < 1:
            raise ValueError(f"window_steps must be >= 1, got {window_steps}")
        self.window_steps = window_steps
        self.buffer = torch.zeros(window_steps, num_layers, num_logical, dtype=dtype)
        self._sum = torch.zeros(num_layers, num_logical, dtype=torch.int64)
        self._in_flight: deque[D2HCopy] = deque()     # device counts on their way to the host, oldest first
        self._next = 0
        self._recorded = 0

    @property
    def num_recorded(self) -> int:
        """Steps in the window now (at most window_steps; steps whose counts are still in flight not included)."""
        return min(self._recorded, self.window_steps)

    def record(self, step_counts: torch.Tensor) -> None:
        """Add one step's [L, E] counts (any device); the caller may reuse `step_counts` at once."""
        if step_counts.shape != self.buffer.shape[1:]:
            raise ValueError(f"step counts shape {tuple(step_counts.shape)} != (layers, logical experts) "
                             f"{tuple(self.buffer.shape[1:])}")
        self.settle()
        if step_counts.device.type == "cpu":
            self._add(step_counts)
        else:
            self._in_flight.append(D2HCopy({"counts": step_counts}))

    def settle(self, wait: bool = False) -> None:
        """Take in the recorded steps whose counts have reached the host (`wait`: all of them, waiting)."""
        while self._in_flight and (wait or self._in_flight[0].ready()):
            self._add(self._in_flight.popleft().wait()["counts"])

    def _add(self, counts: torch.Tensor) -> None:
        slot = self.buffer[self._next]
        self._sum -= slot                    # the step that leaves the window
        slot.copy_(counts)
        self._sum += slot
        self._next = (self._next + 1) % self.window_steps
        self._recorded += 1

    def total(self, wait: bool = True) -> torch.Tensor:
        """[L, E] int64 sum over the steps in the window (after `settle(wait)`)."""
        self.settle(wait)
        return self._sum.clone()

    def reset(self) -> None:
        self._in_flight.clear()
        self.buffer.zero_()
        self._sum.zero_()
        self._next = 0
        self._recorded = 0


def all_reduce_load(load: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Sum each rank's [L, E] counts over `group` (use the gloo `cpu_group` for a CPU tensor) so that every
    rank plans from the same numbers; returns a CPU int64 tensor. The identity without a group."""
    out = load.to(torch.int64).cpu().clone()
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(out, group=group)
    return out


# ---------------------------------------------------------------------------------------------- placement

def _replica_counts(loads: list[float], num_redundant: int, ep_size: int) -> list[int]:
    """Greedy: each redundant slot to the expert with the highest load per replica (ties: fewer replicas,
    then the lower id). An expert gets at most ep_size replicas (one per rank) unless every expert has that."""
    num_logical = len(loads)
    counts = [1] * num_logical
    heap = [(-loads[e], 1, e) for e in range(num_logical)]
    heapq.heapify(heap)
    cap = ep_size
    for _ in range(num_redundant):
        while True:
            if not heap:                    # every expert is on every rank: replicas must double up
                cap += ep_size
                heap = [(-loads[e] / counts[e], counts[e], e) for e in range(num_logical)]
                heapq.heapify(heap)
            _, _, e = heapq.heappop(heap)
            if counts[e] < cap:
                break
        counts[e] += 1
        if counts[e] < cap:
            heapq.heappush(heap, (-loads[e] / counts[e], counts[e], e))
    return counts


def _order_slots(experts: list[int], previous: list[int] | None) -> list[int]:
    """This rank's experts in slot order: an expert the rank already held keeps its slot (no weight copy),
    the rest fill the free slots in ascending expert order."""
    remaining = Counter(experts)
    slots: list[int | None] = [None] * len(experts)
    if previous is not None:
        for s, e in enumerate(previous):
            if remaining[e] > 0:
                slots[s] = e
                remaining[e] -= 1
    rest = iter(sorted(remaining.elements()))
    return [e if e is not None else next(rest) for e in slots]


def balanced_placement(load: torch.Tensor, num_physical: int, ep_size: int,
                       previous: ExpertPlacement | None = None) -> ExpertPlacement:
    """A placement for the [L, E] token counts `load`, per layer: redundant slots to the experts with the
    highest load per replica, then the replicas, heaviest first, each to the least-loaded rank with a free slot
    (ties to the lower rank; a rank already holding the expert only when no other has room). Deterministic.
    With `previous`, an expert that stays on a rank keeps its slot there, so fewer weights move."""
    if load.dim() != 2:
        raise ValueError(f"load must be [layers, logical experts], got shape {tuple(load.shape)}")
    num_layers, num_logical = load.shape
    if num_physical < num_logical or num_physical % ep_size:
        raise ValueError(f"{num_physical} physical slots must be >= {num_logical} logical experts and divisible "
                         f"by ep_size {ep_size}")
    if previous is not None and (previous.phys_to_logical.shape != (num_layers, num_physical)
                                 or previous.ep_size != ep_size):
        raise ValueError("previous placement has a different shape or EP size")
    slots_per_rank = num_physical // ep_size
    loads_all = load.detach().to("cpu", torch.float64).tolist()
    prev_all = previous.phys_to_logical.cpu().tolist() if previous is not None else None
    rows = []
    for layer in range(num_layers):
        loads = loads_all[layer]
        counts = _replica_counts(loads, num_physical - num_logical, ep_size)
        replicas = [(loads[e] / counts[e], e) for e in range(num_logical) for _ in range(counts[e])]
        replicas.sort(key=lambda r: (-r[0], r[1]))
        rank_load = [0.0] * ep_size
        rank_experts: list[list[int]] = [[] for _ in range(ep_size)]
        held: list[set[int]] = [set() for _ in range(ep_size)]
        for weight, e in replicas:
            best = None
            for avoid_dup in (True, False):
                for r in range(ep_size):
                    if len(rank_experts[r]) == slots_per_rank or (avoid_dup and e in held[r]):
                        continue
                    if best is None or rank_load[r] < rank_load[best]:
                        best = r
                if best is not None:
                    break
            rank_load[best] += weight
            rank_experts[best].append(e)
            held[best].add(e)
        row = []
        for r in range(ep_size):
            prev = prev_all[layer][r * slots_per_rank:(r + 1) * slots_per_rank] if prev_all is not None else None
            row.extend(_order_slots(rank_experts[r], prev))
        rows.append(row)
    return ExpertPlacement(torch.tensor(rows, dtype=torch.int64).view(num_layers, num_physical), ep_size,
                           num_logical)


# ---------------------------------------------------------------------------------------------- moving weights

@dataclass(frozen=True)
class SlotMove:
    """Copy the weights of `src_rank`'s slot `src_slot` (old placement) into `dst_rank`'s slot `dst_slot`."""
    layer: int
    dst_rank: int
    dst_slot: int      # local to dst_rank, in [0, S)
    src_rank: int
    src_slot: int      # local to src_rank


def plan_moves(old: ExpertPlacement, new: ExpertPlacement) -> list[SlotMove]:
    """For every physical slot whose logical expert changes, a source slot of the old placement holding the new
    expert: on the destination rank itself if it has one, else on the lowest rank (lowest slot). Ordered by
    layer then physical slot; deterministic."""
    if old.phys_to_logical.shape != new.phys_to_logical.shape or old.ep_size != new.ep_size:
        raise ValueError(f"placements differ in shape {tuple(old.phys_to_logical.shape)} vs "
                         f"{tuple(new.phys_to_logical.shape)} or EP size {old.ep_size} vs {new.ep_size}")
    s = old.slots_per_rank
    old_rows = old.phys_to_logical.cpu().tolist()
    new_rows = new.phys_to_logical.cpu().tolist()
    moves = []
    for layer, (old_row, new_row) in enumerate(zip(old_rows, new_rows)):
        where: dict[int, list[int]] = {}
        for p, e in enumerate(old_row):
            where.setdefault(e, []).append(p)       # ascending: lowest rank, lowest slot first
        for p, (was, e) in enumerate(zip(old_row, new_row)):
            if was == e:
                continue
            if e not in where:
                raise ValueError(f"layer {layer}: logical expert {e} is in no slot of the old placement")
            dst_rank = p // s
            sources = where[e]
            src = next((q for q in sources if q // s == dst_rank), sources[0])
            moves.append(SlotMove(layer, dst_rank, p % s, src // s, src % s))
    return moves


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous flat uint8 view (a copy only if `t` is not contiguous): any dtype travels on any backend."""
    return t.contiguous().reshape(-1).view(torch.uint8)


def apply_moves(tensors_per_layer: list[list[torch.Tensor]], moves: list[SlotMove], ep_rank: int,
                ep_group: dist.ProcessGroup | None) -> None:
    """Execute `moves` on this rank's weights: `tensors_per_layer[layer]` are the layer's stacked per-slot
    tensors, each [S, ...] (gate_up weight, its scale, down weight, ...). Every EP rank calls this with the
    same moves. Copies within the rank are local; between ranks they go by point-to-point sends
    (`batch_isend_irecv`, gloo or NCCL), paired in the same order on both sides. Every source is read from the
    old contents (received into temporaries, written after all of the layer's transfers), so chains and swaps
    are correct. One layer at a time, which bounds the temporary memory to one layer's moved slots."""
    by_layer: dict[int, list[SlotMove]] = {}
    for m in moves:
        by_layer.setdefault(m.layer, []).append(m)

    def peer(r: int) -> int:
        if ep_group is None or ep_group is dist.group.WORLD:
            return r
        return dist.get_global_rank(ep_group, r)

    for layer in sorted(by_layer):
        tensors = tensors_per_layer[layer]
        layer_moves = by_layer[layer]
        ops: list[dist.P2POp] = []
        pending: list[tuple[torch.Tensor, int, torch.Tensor]] = []    # (tensor, dst_slot, bytes to write)
        for m in layer_moves:
            if m.dst_rank == ep_rank and m.src_rank == ep_rank:
                for t in tensors:
                    pending.append((t, m.dst_slot, _as_bytes(t[m.src_slot]).clone()))
            elif m.dst_rank == ep_rank:
                for t in tensors:
                    buf = torch.empty(t[m.dst_slot].numel() * t.element_size(), dtype=torch.uint8,
                                      device=t.device)
                    ops.append(dist.P2POp(dist.irecv, buf, peer(m.src_rank), ep_group))
                    pending.append((t, m.dst_slot, buf))
            elif m.src_rank == ep_rank:
                for t in tensors:
                    ops.append(dist.P2POp(dist.isend, _as_bytes(t[m.src_slot]), peer(m.dst_rank), ep_group))
        if ops:
            if not dist.is_initialized():
                raise RuntimeError(f"layer {layer}: expert moves between ranks need an initialised process group")
            for req in dist.batch_isend_irecv(ops):
                req.wait()
        for t, slot, data in pending:
            target = t[slot]
            target.copy_(data.view(t.dtype).view(target.shape))


def rebalance(load: torch.Tensor, current: ExpertPlacement,
              min_improvement: float = 0.05) -> tuple[ExpertPlacement, list[SlotMove]] | None:
    """The periodic decision: a balanced placement for the window's (group-summed) `load` and the moves to reach
    it, or None when it would lower `moe_lb` by less than `min_improvement` (moving weights costs time)."""
    new = balanced_placement(load, current.num_physical, current.ep_size, previous=current)
    before = moe_lb(rank_loads(load, current))
    after = moe_lb(rank_loads(load, new))
    if before - after < min_improvement:
        return None
    return new, plan_moves(current, new)
