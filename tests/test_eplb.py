"""EPLB (openinfer/distributed/eplb.py): slot counts, placements, load statistics, the balancing policy, and
weight moves executed for real between two gloo processes."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from openinfer.distributed.eplb import (ExpertPlacement, LoadWindow, SlotMove, apply_moves, balanced_placement,
                                        moe_lb, num_physical_experts, plan_moves, rank_loads, rebalance)


def zipf_load(num_layers: int, num_logical: int, seed: int, s: float = 1.1, tokens: int = 100_000) -> torch.Tensor:
    """[L, E] skewed counts: Zipf weights over a random permutation of the experts per layer."""
    g = torch.Generator().manual_seed(seed)
    w = 1.0 / torch.arange(1, num_logical + 1, dtype=torch.float64) ** s
    rows = []
    for _ in range(num_layers):
        perm = torch.randperm(num_logical, generator=g)
        rows.append((w[perm] / w.sum() * tokens).round().to(torch.int64))
    return torch.stack(rows)


def check_valid(p: ExpertPlacement, num_logical: int) -> None:
    """Every logical expert in every layer has a slot; ids in range; each rank has S slots."""
    p2l = p.phys_to_logical
    assert p2l.dtype == torch.int64
    assert p2l.shape[1] == p.slots_per_rank * p.ep_size
    for layer in range(p2l.shape[0]):
        assert set(p2l[layer].tolist()) == set(range(num_logical)), f"layer {layer} misses an expert"


# ---------------------------------------------------------------------------------------------- sizes

@pytest.mark.parametrize("num_logical,min_red,ep,expected", [
    (256, 0, 2, 256), (256, 1, 2, 258), (256, 30, 2, 286),
    (256, 0, 8, 256), (256, 1, 8, 264), (256, 30, 8, 288), (256, 32, 8, 288),
    (256, 0, 3, 258), (256, 1, 3, 258), (256, 30, 3, 288),
    (64, 0, 1, 64), (64, 5, 1, 69),
])
def test_num_physical_rounding(num_logical, min_red, ep, expected):
    assert num_physical_experts(num_logical, min_red, ep) == expected


@pytest.mark.parametrize("args,words", [((4, 0, 8), ("8", "4")), ((0, 0, 1), ("0",)), ((8, -1, 2), ("-1",)),
                                        ((8, 0, 0), ("0",))])
def test_num_physical_rejects(args, words):
    with pytest.raises(ValueError) as err:
        num_physical_experts(*args)
    for w in words:
        assert w in str(err.value)


# ---------------------------------------------------------------------------------------------- placement

def test_initial_layout_no_redundancy():
    p = ExpertPlacement.initial(num_layers=3, num_logical=16, num_physical=16, ep_size=4)
    assert p.slots_per_rank == 4
    for r in range(4):
        assert p.local_logical(r).tolist() == [list(range(4 * r, 4 * r + 4))] * 3
    table, count = p.replicas()
    assert count.tolist() == [[1] * 16] * 3
    assert table.shape == (3, 16, 1) and table[..., 0].tolist() == [list(range(16))] * 3


def test_initial_layout_redundant_and_replicas():
    p = ExpertPlacement.initial(num_layers=2, num_logical=6, num_physical=10, ep_size=2)
    assert p.phys_to_logical.tolist() == [[0, 1, 2, 3, 4, 5, 0, 1, 2, 3]] * 2
    assert p.local_logical(0).tolist() == [[0, 1, 2, 3, 4]] * 2
    assert p.local_logical(1).tolist() == [[5, 0, 1, 2, 3]] * 2
    table, count = p.replicas()
    assert count.tolist() == [[2, 2, 2, 2, 1, 1]] * 2
    assert table[0].tolist() == [[0, 6], [1, 7], [2, 8], [3, 9], [4, 4], [5, 5]]
    # more redundant slots than experts wrap around
    q = ExpertPlacement.initial(1, 3, 9, 3)
    assert q.phys_to_logical.tolist() == [[0, 1, 2, 0, 1, 2, 0, 1, 2]]
    with pytest.raises(ValueError):
        q.local_logical(3)


def test_replicas_consistent_with_random_placement():
    g = torch.Generator().manual_seed(3)
    num_logical, num_phys, layers = 12, 20, 4
    rows = []
    for _ in range(layers):
        extra = torch.randint(0, num_logical, (num_phys - num_logical,), generator=g)
        row = torch.cat([torch.arange(num_logical), extra])
        rows.append(row[torch.randperm(num_phys, generator=g)])
    p = ExpertPlacement(torch.stack(rows), ep_size=4)
    table, count = p.replicas()
    assert table.shape == (layers, num_logical, int(count.max()))
    for layer in range(layers):
        for e in range(num_logical):
            slots = (p.phys_to_logical[layer] == e).nonzero().flatten().tolist()
            c = int(count[layer, e])
            assert c == len(slots) >= 1
            assert table[layer, e, :c].tolist() == slots                      # every replica, ascending
            assert set(table[layer, e, c:].tolist()) <= {slots[0]}            # padding repeats the first
    # routing by token % count lands on slots that hold the expert
    tok = torch.arange(50)
    e = torch.randint(0, num_logical, (50,), generator=g)
    slot = table[1, e, tok % count[1, e]]
    assert torch.equal(p.phys_to_logical[1, slot], e)


def test_placement_validation():
    with pytest.raises(ValueError, match="no physical slot"):
        ExpertPlacement(torch.tensor([[0, 0, 2, 2]]), ep_size=2)          # expert 1 missing
    with pytest.raises(ValueError):
        ExpertPlacement(torch.tensor([[0, 1, 2]]), ep_size=2)             # 3 slots over 2 ranks
    a = ExpertPlacement.initial(2, 4, 6, 2)
    assert a == ExpertPlacement.initial(2, 4, 6, 2)
    assert a != ExpertPlacement.initial(2, 4, 6, 3)


# ---------------------------------------------------------------------------------------------- statistics

def test_rank_loads_and_moe_lb():
    p = ExpertPlacement(torch.tensor([[0, 1, 0, 2]]), ep_size=2)        # expert 0 on both ranks
    load = torch.tensor([[10, 4, 6]])
    rl = rank_loads(load, p)
    assert rl.tolist() == [[9.0, 11.0]]                                   # 5 + 4 | 5 + 6
    assert moe_lb(rl) == pytest.approx(11.0 / 10.0)
    assert moe_lb(torch.zeros(3, 4)) == 1.0
    assert moe_lb(torch.tensor([[5.0, 5.0], [1.0, 3.0]])) == pytest.approx((10 * 1.0 + 4 * 1.5) / 14)
    big = zipf_load(5, 32, seed=1)
    q = ExpertPlacement.initial(5, 32, 40, 4)
    rl = rank_loads(big, q)
    assert rl.shape == (5, 4)
    assert torch.allclose(rl.sum(1), big.sum(1).to(torch.float64))


def test_load_window_drops_old_steps():
    w = LoadWindow(num_layers=2, num_logical=3, window_steps=3)
    assert w.num_recorded == 0 and w.total().tolist() == [[0, 0, 0]] * 2
    steps = [torch.full((2, 3), i + 1, dtype=torch.int64) for i in range(5)]  # values 1..5
    for s in steps[:2]:
        w.record(s)
    assert w.num_recorded == 2 and w.total().tolist() == [[3, 3, 3]] * 2
    for s in steps[2:]:
        w.record(s)
    assert w.num_recorded == 3
    assert w.total().tolist() == [[12, 12, 12]] * 2                       # 3 + 4 + 5: steps 1, 2 dropped
    assert w.total().dtype == torch.int64
    with pytest.raises(ValueError):
        w.record(torch.zeros(3, 2))
    w.reset()
    assert w.num_recorded == 0 and int(w.total().sum()) == 0


def test_load_window_running_sum_equals_the_last_steps():
    """The running sum (what stats read after every step, O(L * E) however long the window) equals a fresh sum
    of the last `window_steps` steps through many wraps; the caller may reuse its counter at once."""
    g = torch.Generator().manual_seed(4)
    w = LoadWindow(num_layers=3, num_logical=5, window_steps=7)
    seen = []
    counter = torch.zeros(3, 5, dtype=torch.int64)
    for n in range(1, 41):
        counter.copy_(torch.randint(0, 1000, (3, 5), generator=g))
        seen.append(counter.clone())
        w.record(counter)
        counter.zero_()                                                   # as the controller does after each step
        want = torch.stack(seen[-7:]).sum(0)
        assert w.num_recorded == min(n, 7)
        assert torch.equal(w.total(wait=False), want) and torch.equal(w.total(), want), n


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA: counts copied back behind queued work")
def test_load_window_takes_cuda_counts_without_waiting():
    """A step's counts on the GPU enter the window once their copy (queued behind the step's work) is done: a read
    that may not wait leaves them out while the GPU is busy, one that waits has them; the counter is reused at once."""
    w = LoadWindow(num_layers=2, num_logical=4, window_steps=3)
    counter = torch.zeros(2, 4, dtype=torch.int64, device="cuda")
    w.record(counter)
    assert int(w.total().sum()) == 0 and w.num_recorded == 1              # (waits; the pinned pool is warm now)
    counter.copy_(torch.arange(8, device="cuda").view(2, 4))
    torch.cuda._sleep(200_000_000)                                        # ~0.1 s of queued GPU work
    w.record(counter)
    counter.zero_()
    assert w.num_recorded == 1 and int(w.total(wait=False).sum()) == 0
    assert w.total().tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]] and w.num_recorded == 2
    for _ in range(4):
        counter.fill_(1)
        w.record(counter)
        counter.zero_()
    torch.cuda.synchronize()
    assert w.total(wait=False).tolist() == [[3] * 4] * 2 and w.num_recorded == 3


# ---------------------------------------------------------------------------------------------- balancing

def test_balanced_placement_lowers_imbalance():
    layers, num_logical, ep = 4, 64, 8
    num_phys = num_physical_experts(num_logical, 16, ep)
    load = zipf_load(layers, num_logical, seed=7)
    init = ExpertPlacement.initial(layers, num_logical, num_phys, ep)
    before = moe_lb(rank_loads(load, init))
    assert before > 1.5
    new = balanced_placement(load, num_phys, ep)
    after = moe_lb(rank_loads(load, new))
    assert after < 1.1, (before, after)
    check_valid(new, num_logical)
    assert new.slots_per_rank == num_phys // ep
    assert new == balanced_placement(load.clone(), num_phys, ep)          # deterministic
    _, count = new.replicas()
    for layer in range(layers):
        order = torch.argsort(load[layer], descending=True, stable=True)
        assert int(count[layer, order[0]]) >= 3                          # the hottest expert is replicated
        assert int(count[layer, order[-1]]) == 1                          # the coldest is not
        assert int(count[layer].sum()) == num_phys
        for r in range(ep):                                               # no rank holds an expert twice
            local = new.local_logical(r)[layer].tolist()
            assert len(set(local)) == len(local)


def test_balanced_placement_exact_small_case():
    """Worked by hand: redundant slots to 0 (8 -> 4 per replica) then 3 (6 -> 3); replicas 4,4,3,3,1,1 packed
    heaviest first to the least-loaded rank (ties to rank 0), never twice on one rank: 0,3,1 | 0,3,2."""
    p = balanced_placement(torch.tensor([[8, 1, 1, 6]]), 6, 2)
    assert p.phys_to_logical.tolist() == [[0, 1, 3, 0, 2, 3]]
    assert rank_loads(torch.tensor([[8, 1, 1, 6]]), p).tolist() == [[8.0, 8.0]]
    # equal load per replica: the lower expert id first
    _, count = balanced_placement(torch.tensor([[5, 5, 1, 1]]), 6, 2).replicas()
    assert count.tolist() == [[2, 2, 1, 1]]


def test_balanced_placement_without_redundancy_and_with_zero_load():
    load = zipf_load(2, 32, seed=11)
    init = ExpertPlacement.initial(2, 32, 32, 4)
    new = balanced_placement(load, 32, 4)
    check_valid(new, 32)
    assert moe_lb(rank_loads(load, new)) < moe_lb(rank_loads(load, init))
    # no load: the contiguous split, redundant slots replicating 0, 1, ...
    zero = balanced_placement(torch.zeros(2, 8, dtype=torch.int64), 12, 2)
    check_valid(zero, 8)
    _, count = zero.replicas()
    assert count.tolist() == [[2, 2, 2, 2, 1, 1, 1, 1]] * 2
    with pytest.raises(ValueError):
        balanced_placement(load, 30, 4)


def test_balanced_placement_keeps_slots_of_previous():
    load = zipf_load(3, 32, seed=5)
    init = ExpertPlacement.initial(3, 32, 40, 4)
    plain = balanced_placement(load, 40, 4)
    kept = balanced_placement(load, 40, 4, previous=init)
    # the same experts on each rank, only reordered within ranks to keep slots
    for r in range(4):
        assert torch.equal(plain.local_logical(r).sort(1).values, kept.local_logical(r).sort(1).values)
    assert len(plan_moves(init, kept)) < len(plan_moves(init, plain))
    out = rebalance(load, init)
    assert out is not None and out[0] == kept and out[1] == plan_moves(init, kept)
    assert rebalance(load, kept) is None                                  # already balanced: nothing to do


# ---------------------------------------------------------------------------------------------- moves

def test_plan_moves_sources():
    old = ExpertPlacement(torch.tensor([[0, 1, 2, 3, 0, 4]]), ep_size=2)   # S=3; rank0: 0 1 2, rank1: 3 0 4
    new = ExpertPlacement(torch.tensor([[0, 3, 2, 0, 1, 4]]), ep_size=2)
    moves = plan_moves(old, new)
    assert moves == [
        SlotMove(layer=0, dst_rank=0, dst_slot=1, src_rank=1, src_slot=0),   # 3 only on rank 1
        SlotMove(layer=0, dst_rank=1, dst_slot=0, src_rank=1, src_slot=1),   # 0: on the destination rank
        SlotMove(layer=0, dst_rank=1, dst_slot=1, src_rank=0, src_slot=1),   # 1 only on rank 0
    ]
    assert plan_moves(old, old) == []
    with pytest.raises(ValueError):
        plan_moves(old, ExpertPlacement.initial(1, 5, 6, 3))


def _reference(num_layers: int, num_logical: int) -> list[list[torch.Tensor]]:
    """Full stacks of every logical expert's tensors, per layer, from a fixed seed: [E, ...] each."""
    g = torch.Generator().manual_seed(1234)
    out = []
    for _ in range(num_layers):
        out.append([
            torch.randn(num_logical, 6, 4, generator=g),                                 # gate_up weight
            torch.rand(num_logical, generator=g).to(torch.bfloat16),                     # per-expert scale
            torch.randint(0, 256, (num_logical, 3, 5), generator=g, dtype=torch.uint8),  # packed down weight
            torch.randn(num_logical, 3, dtype=torch.float64, generator=g),               # its scale
        ])
    return out


def _move_placements():
    """(old, new) over 3 layers, E=6, P=8, ep=2: a balanced re-placement, a swap chain across ranks, no change."""
    num_logical, num_phys, ep = 6, 8, 2
    old = ExpertPlacement.initial(3, num_logical, num_phys, ep)          # 0 1 2 3 | 4 5 0 1
    load = torch.tensor([[1, 2, 3, 4, 900, 500]])
    balanced = balanced_placement(load, num_phys, ep).phys_to_logical[0]
    rotated = torch.tensor([4, 5, 0, 1, 0, 1, 2, 3])                      # both ranks' halves swapped
    new = ExpertPlacement(torch.stack([balanced, rotated, old.phys_to_logical[2]]), ep, num_logical)
    return old, new


def _moves_worker(rank: int, world: int, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        old, new = _move_placements()
        ref = _reference(old.num_layers, old.num_logical)
        mine = [[full[old.local_logical(rank)[layer]].clone() for full in ref[layer]]
                for layer in range(old.num_layers)]
        untouched = [[t.clone() for t in tensors] for tensors in mine]
        moves = plan_moves(old, new)
        apply_moves(mine, moves, rank, dist.group.WORLD)
        for layer in range(new.num_layers):
            want = new.local_logical(rank)[layer]
            for t, full in zip(mine[layer], ref[layer]):
                assert t.dtype == full.dtype and t.shape == (new.slots_per_rank, *full.shape[1:])
                assert torch.equal(t, full[want]), f"rank {rank} layer {layer}: {want.tolist()}"
        assert all(torch.equal(a, b) for a, b in zip(mine[2], untouched[2]))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_apply_moves_between_two_gloo_ranks():
    old, new = _move_placements()
    moves = plan_moves(old, new)
    # the plan exercises both local copies and sends in both directions, and a real change on layer 0
    assert any(m.src_rank == m.dst_rank for m in moves)
    assert {(m.src_rank, m.dst_rank) for m in moves if m.src_rank != m.dst_rank} == {(0, 1), (1, 0)}
    assert {m.layer for m in moves} == {0, 1}
    assert moe_lb(rank_loads(torch.tensor([[1, 2, 3, 4, 900, 500]] * 3)[:1],
                             ExpertPlacement(new.phys_to_logical[:1], 2))) < 1.1
    mp.spawn(_moves_worker, args=(2, _free_port()), nprocs=2, join=True)


def test_apply_moves_local_only_without_process_group():
    """ep_size 1 (or moves inside one rank): no process group needed; a swap reads the old contents."""
    old = ExpertPlacement(torch.tensor([[0, 1, 2, 0]]), ep_size=1)
    new = ExpertPlacement(torch.tensor([[2, 0, 1, 2]]), ep_size=1)
    ref = _reference(1, 3)[0]
    mine = [[full[old.local_logical(0)[0]].clone() for full in ref]]
    apply_moves(mine, plan_moves(old, new), 0, None)
    for t, full in zip(mine[0], ref):
        assert torch.equal(t, full[new.local_logical(0)[0]])
