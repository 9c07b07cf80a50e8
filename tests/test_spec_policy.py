"""The speculative-decoding verification-length policies (openinfer/spec_decode/policy.py): DSpark's confidence
scheduling (spec 000 §6.3.3, §6.5) against its properties, an independent greedy, and a brute-force optimum."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from openinfer.spec_decode.policy import (
    VERIFY_POLICIES,
    VerifyPolicy,
    confidence_lengths,
    confidence_mask,
    fixed_lengths,
    lengths_for,
)


def _random_case(rng: random.Random, max_b: int, max_k: int):
    """Confidences mixing continuous values with 0, 1 and repeated values, so gains tie often."""
    b = rng.randint(0, max_b)
    k = rng.randint(1, max_k)
    pool = [0.0, 0.25, 0.5, 1.0, 1.0]
    conf = [[rng.choice(pool) if rng.random() < 0.5 else rng.random() for _ in range(k)] for _ in range(b)]
    num = [rng.randint(0, k) for _ in range(b)]
    budget = rng.randint(0, b * k + 2)
    return torch.tensor(conf, dtype=torch.float32).reshape(b, k), torch.tensor(num, dtype=torch.long), budget


def _gains(conf: torch.Tensor) -> list[list[float]]:
    return torch.cumprod(conf.float().clamp(0, 1), dim=1).tolist()


def _reference_greedy(conf: torch.Tensor, num: torch.Tensor, budget: int) -> list[int]:
    """The documented rule, written independently in Python: first drafts first, then the remaining budget to the
    largest gains, ties by (earlier position, earlier request)."""
    g = _gains(conf)
    n = num.tolist()
    lengths = [1 if x > 0 else 0 for x in n]
    remaining = max(budget - sum(lengths), 0)
    cands = sorted(((-g[b][i], i, b) for b in range(len(n)) for i in range(1, n[b])))
    for _, _, b in cands[:remaining]:
        lengths[b] += 1
    return lengths


def _value(g: list[list[float]], lengths) -> float:
    return sum(sum(g[b][:L]) for b, L in enumerate(lengths))


def _brute_force_best(conf: torch.Tensor, num: torch.Tensor, budget: int) -> float:
    """Max of sum_b sum_{i<L_b} gain[b][i] over all L with 1 <= L_b <= n_b (0 when n_b == 0), sum(L) <= cap."""
    g = _gains(conf)
    n = num.tolist()
    cap = max(budget, sum(1 for x in n if x > 0))
    ranges = [range(1, x + 1) if x > 0 else range(0, 1) for x in n]
    best = None
    for lengths in itertools.product(*ranges):
        if sum(lengths) <= cap:
            v = _value(g, lengths)
            best = v if best is None else max(best, v)
    return best


def _check_invariants(lengths: torch.Tensor, num: torch.Tensor, budget: int) -> None:
    assert lengths.dtype == torch.long and lengths.shape == num.shape
    has = num > 0
    r = int(has.sum())
    assert torch.all(lengths[~has] == 0)
    assert torch.all(lengths[has] >= 1)
    assert torch.all(lengths <= num.clamp_min(0))
    assert int(lengths.sum()) == min(max(budget, r), int(num.clamp_min(0).sum()))
    if budget >= r:
        assert int(lengths.sum()) <= budget


def test_spec_example_two_requests_budget_six():
    # 003's example: A and B draft 5 each, the host allows 6 -> cumprod, topk(6) of 10, remap 10 -> 6
    conf = torch.tensor([[0.9, 0.9, 0.5, 0.5, 0.5], [0.2, 0.9, 0.9, 0.9, 0.9]])
    # gains A: .9 .81 .405 .2025 .10125; B: .2 .18 .162 .1458 .13122 -> firsts A0 B0, then A1 A2 A3 B1
    assert confidence_lengths(conf, torch.tensor([5, 5]), 6).tolist() == [4, 2]
    # a budget of 2 = the number of requests: a plain global top-2 would take A0 and A1 and leave B with nothing;
    # the per-request minimum (§6.3.3: l in {1..5}) verifies one draft of each
    assert confidence_lengths(conf, torch.tensor([5, 5]), 2).tolist() == [1, 1]
    assert confidence_lengths(conf, torch.tensor([5, 5]), 10).tolist() == [5, 5]


def test_random_invariants_and_reference_greedy():
    rng = random.Random(1234)
    for _ in range(400):
        conf, num, budget = _random_case(rng, max_b=8, max_k=6)
        lengths = confidence_lengths(conf, num, budget)
        _check_invariants(lengths, num, budget)
        assert lengths.tolist() == _reference_greedy(conf, num, budget)


def test_picks_are_prefixes():
    rng = random.Random(321)
    for _ in range(400):
        conf, num, budget = _random_case(rng, max_b=8, max_k=6)
        mask = confidence_mask(conf, num, budget)
        lengths = confidence_lengths(conf, num, budget)
        assert mask.dtype == torch.bool and mask.shape == conf.shape
        assert torch.equal(mask, torch.arange(conf.shape[1]) < lengths.unsqueeze(1))
    # equal gains inside one request (confidence exactly 1): draft 1 is taken before draft 2
    conf = torch.tensor([[0.5, 1.0, 1.0, 0.1], [0.6, 0.1, 0.1, 0.1]])
    assert confidence_mask(conf, torch.tensor([4, 4]), 3).tolist() == [[True, True, False, False],
                                                                        [True, False, False, False]]


def test_optimal_against_brute_force():
    rng = random.Random(99)
    for _ in range(300):
        conf, num, budget = _random_case(rng, max_b=4, max_k=4)
        lengths = confidence_lengths(conf, num, budget)
        best = _brute_force_best(conf, num, budget)
        if best is None:  # empty batch
            assert lengths.numel() == 0
            continue
        assert _value(_gains(conf), lengths.tolist()) == pytest.approx(best, abs=1e-6)


def test_all_ones_large_budget_equals_fixed():
    rng = random.Random(7)
    for _ in range(50):
        b, k = rng.randint(1, 16), rng.randint(1, 8)
        num = torch.tensor([rng.randint(0, k) for _ in range(b)])
        conf = torch.ones(b, k)
        for budget in (int(num.sum()), int(num.sum()) + rng.randint(1, 20)):
            assert torch.equal(confidence_lengths(conf, num, budget), fixed_lengths(num))


def test_budget_below_request_count_keeps_the_minimum():
    conf = torch.rand(5, 4, generator=torch.Generator().manual_seed(0))
    num = torch.tensor([4, 0, 2, 3, 1])
    for budget in (0, 1, 3, 4):
        assert confidence_lengths(conf, num, budget).tolist() == [1, 0, 1, 1, 1]
    assert confidence_lengths(conf, num, -5).tolist() == [1, 0, 1, 1, 1]


def test_monotone_in_budget():
    g = torch.Generator().manual_seed(3)
    conf = torch.rand(6, 5, generator=g)
    num = torch.tensor([5, 3, 0, 5, 1, 4])
    prev = None
    for budget in range(0, 20):
        cur = confidence_lengths(conf, num, budget)
        if prev is not None:
            assert torch.all(cur >= prev)
        prev = cur
    assert torch.equal(prev, num)


def test_ties_are_deterministic_and_position_first():
    # all gains 1: the budget is spread depth by depth, earlier requests taking a depth's surplus
    ones = torch.ones(3, 5)
    assert confidence_lengths(ones, torch.tensor([5, 5, 5]), 8).tolist() == [3, 3, 2]
    assert confidence_lengths(ones, torch.tensor([5, 5, 5]), 4).tolist() == [2, 1, 1]
    # a tie between A's draft 2 and B's draft 1 (both gain .5): the earlier position wins, whichever request
    # comes first in the batch
    a, b = [1.0, 1.0, 0.5], [1.0, 0.5, 0.5]
    num = torch.tensor([3, 3])
    assert confidence_lengths(torch.tensor([a, b]), num, 4).tolist() == [2, 2]
    assert confidence_lengths(torch.tensor([b, a]), num, 4).tolist() == [2, 2]
    # a confidence of exactly 1 repeats the previous gain: the pick stays a prefix (draft 1 before draft 2)
    conf = torch.tensor([[0.5, 1.0, 1.0, 0.1], [0.6, 0.1, 0.1, 0.1]])
    assert confidence_lengths(conf, torch.tensor([4, 4]), 3).tolist() == [2, 1]
    assert confidence_lengths(conf, torch.tensor([4, 4]), 4).tolist() == [3, 1]
    # repeated calls agree
    rng = random.Random(5)
    for _ in range(20):
        c, n, bud = _random_case(rng, max_b=10, max_k=5)
        assert torch.equal(confidence_lengths(c, n, bud), confidence_lengths(c.clone(), n.clone(), bud))


def test_batch_permutation_without_ties_permutes_the_result():
    g = torch.Generator().manual_seed(11)
    for _ in range(30):
        conf = torch.rand(9, 5, generator=g) * 0.98 + 0.01  # continuous: no equal gains
        num = torch.randint(0, 6, (9,), generator=g)
        budget = int(torch.randint(0, 40, (), generator=g))
        perm = torch.randperm(9, generator=g)
        base = confidence_lengths(conf, num, budget)
        assert torch.equal(confidence_lengths(conf[perm], num[perm], budget), base[perm])


def test_padding_past_num_drafts_is_ignored():
    g = torch.Generator().manual_seed(2)
    conf = torch.rand(4, 6, generator=g)
    num = torch.tensor([2, 6, 0, 3])
    junk = conf.clone()
    for b, n in enumerate(num.tolist()):
        junk[b, n:] = torch.tensor([1.0, float("nan"), 0.0, 5.0, -1.0, 1.0])[: 6 - n]
    for budget in range(0, 14):
        assert torch.equal(confidence_lengths(junk, num, budget), confidence_lengths(conf, num, budget))


def test_empty_batch_and_no_drafts():
    out = confidence_lengths(torch.empty(0, 5), torch.empty(0, dtype=torch.long), 8)
    assert out.shape == (0,) and out.dtype == torch.long
    assert confidence_lengths(torch.rand(3, 5), torch.zeros(3, dtype=torch.long), 8).tolist() == [0, 0, 0]
    assert fixed_lengths(torch.empty(0, dtype=torch.long)).shape == (0,)


def test_budget_as_tensor_dtypes_and_clamping():
    g = torch.Generator().manual_seed(4)
    conf = torch.rand(7, 5, generator=g)
    num = torch.tensor([5, 1, 0, 4, 5, 2, 3], dtype=torch.int32)
    for budget in range(0, 22):
        want = confidence_lengths(conf, num.long(), budget)
        assert torch.equal(confidence_lengths(conf, num, torch.tensor(budget)), want)
        assert torch.equal(confidence_lengths(conf.to(torch.float64), num, budget), want)
    # bf16 confidences: the gains are taken in float32 from the bf16 values
    conf16 = conf.to(torch.bfloat16)
    assert torch.equal(confidence_lengths(conf16, num, 9), confidence_lengths(conf16.float(), num, 9))
    # num_drafts above k clamps to k; confidences outside [0, 1] clamp
    assert confidence_lengths(torch.ones(2, 3), torch.tensor([7, 3]), 100).tolist() == [3, 3]
    wild = torch.tensor([[2.0, 3.0, -1.0], [0.5, 0.5, 0.5]])
    assert confidence_lengths(wild, torch.tensor([3, 3]), 4).tolist() == [2, 2]  # gains [1, 1, 0] vs [.5, .25, ...]
    # above 1: B's gains are [.4, .4] (unclamped .4 * 3 = 1.2 would beat A's .6)
    assert confidence_lengths(torch.tensor([[1.0, 0.6], [0.4, 3.0]]), torch.tensor([2, 2]), 3).tolist() == [2, 1]
    # below 0: A's gains are [0, 0] (unclamped (-1) * (-1) = 1 would beat B's .01)
    assert confidence_lengths(torch.tensor([[-1.0, -1.0], [0.1, 0.1]]), torch.tensor([2, 2]), 3).tolist() == [1, 2]


def test_no_host_sync_on_meta_tensors():
    # meta tensors have no data: .item(), .tolist(), bool(tensor) and nonzero raise on them, so any host sync in
    # the policy fails here
    conf = torch.rand(6, 5).to("meta")
    num = torch.tensor([5, 0, 3, 5, 1, 2]).to("meta")
    for budget in (7, torch.tensor(7, device="meta"), torch.tensor(7)):
        out = confidence_lengths(conf, num, budget)
        assert out.device.type == "meta" and out.shape == (6,) and out.dtype == torch.long
    assert fixed_lengths(num).device.type == "meta"
    assert lengths_for("confidence", num, conf, 7).device.type == "meta"
    with pytest.raises(RuntimeError):  # the probe is meaningful: a host read on meta does raise
        conf.sum().item()


def test_dispatch_and_bad_input():
    num = torch.tensor([3, 0, 2])
    conf = torch.tensor([[0.9, 0.1, 0.1], [0.5, 0.5, 0.5], [0.8, 0.8, 0.1]])
    assert VERIFY_POLICIES == ("fixed", "confidence")
    assert lengths_for("fixed", num).tolist() == [3, 0, 2]
    assert lengths_for("confidence", num, conf, 3).tolist() == [1, 0, 2]
    assert VerifyPolicy("confidence").lengths(num, conf, 3).tolist() == [1, 0, 2]
    assert VerifyPolicy().lengths(num).tolist() == [3, 0, 2]
    assert VerifyPolicy("confidence").needs_confidences and not VerifyPolicy("fixed").needs_confidences
    with pytest.raises(ValueError, match="unknown verify policy"):
        VerifyPolicy("greedy")
    with pytest.raises(ValueError, match="unknown verify policy"):
        lengths_for("topk", num)
    with pytest.raises(ValueError, match="needs"):
        lengths_for("confidence", num, conf)
    with pytest.raises(ValueError, match="needs"):
        lengths_for("confidence", num, None, 3)
    with pytest.raises(ValueError):
        confidence_lengths(conf[0], num, 3)
    with pytest.raises(ValueError):
        confidence_lengths(conf, num[:2], 3)
    with pytest.raises(ValueError):
        confidence_lengths(conf, num, torch.tensor([3]))
    with pytest.raises(TypeError):
        confidence_lengths(conf, num, 3.5)
    with pytest.raises(ValueError):
        fixed_lengths(conf)
