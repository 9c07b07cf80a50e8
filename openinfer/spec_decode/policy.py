"""How many of each request's draft tokens the target verifies this step (DSpark's confidence scheduling).

Two policies:

- ``fixed``: verify every proposed draft (``L_b = num_drafts[b]``).
- ``confidence``: the DeepInfer/DSpark rule (spec ``000`` §6.3.3 and §6.5, ``003`` "Dspark"). The draft model's
  confidence head predicts, for draft ``i`` of request ``b``, the probability ``c[b, i]`` that the target accepts
  it given that drafts ``< i`` were accepted. Verification is prefix-shaped (a rejection at ``i`` voids every
  later draft), so the expected number of accepted drafts when request ``b`` verifies a prefix of length ``L`` is
  ``sum_{i < L} prod_{j <= i} c[b, j]``: draft ``i``'s marginal gain is the cumulative product ``g[b, i]``. The host
  fixes one verification budget for the whole batch per step; the device spends it on the drafts with the
  largest gains: cumprod -> global top-k -> remap to per-request lengths (§6.5; ``003``'s example: two requests with
  5 drafts each and a budget of 6 -> cumprod, topk(6) of the 10, remap 10 -> 6).

Everything here is pure torch over fixed shapes with no host synchronisation (no ``.item()``, ``.tolist()``,
``nonzero``, or Python branching on tensor values), so it runs on whatever device the confidences live on, inside a
CUDA-graph capture, and under async scheduling while the previous step's confidences are still on the GPU (§6.5:
"CPU 调度只固定总预算; 每个请求的具体验证长度, 由 GPU ... 计算"). The budget may be a Python int or a 0-d tensor on
the confidences' device (or the CPU), so a budget computed on the device needs no sync either. Inside a captured CUDA
graph pass it as a device tensor updated in place before each replay: a Python int or a CPU tensor is read once, at
capture, and frozen into the graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from openinfer.config import SPECULATIVE_POLICIES

__all__ = ["VERIFY_POLICIES", "VerifyPolicy", "confidence_lengths", "confidence_mask", "fixed_lengths", "lengths_for"]

VERIFY_POLICIES = SPECULATIVE_POLICIES


def fixed_lengths(num_drafts: torch.Tensor) -> torch.Tensor:
    """[B] long: verify every proposed draft (``num_drafts[b] <= k``); negative counts read as 0."""
    if num_drafts.dim() != 1:
        raise ValueError(f"num_drafts must be 1-D [B], got shape {tuple(num_drafts.shape)}")
    return num_drafts.to(torch.long).clamp_min(0)


def confidence_lengths(
    confidences: torch.Tensor, num_drafts: torch.Tensor, budget: int | torch.Tensor
) -> torch.Tensor:
    """Per-request verification lengths from draft confidences under one global budget.

    Args:
        confidences: ``[B, k]`` float, the draft model's predicted probability that the target accepts draft ``i``
            given that drafts ``< i`` are accepted. Values are clamped to ``[0, 1]``; NaN reads as 0. Entries at
            ``i >= num_drafts[b]`` are ignored.
        num_drafts: ``[B]`` integer, how many drafts request ``b`` actually has (clamped to ``[0, k]``).
        budget: total draft tokens to verify this step over the whole batch, set by the host per step: a Python
            int or a 0-d integer tensor (on the confidences' device or the CPU). Negative reads as 0.

    Returns:
        ``[B]`` long ``L`` on the confidences' device, with

        - ``L[b] == 0`` where ``num_drafts[b] == 0``;
        - ``1 <= L[b] <= num_drafts[b]`` otherwise;
        - ``sum(L) == min(max(budget, R), sum(num_drafts))`` where ``R`` is the number of requests with drafts.

    The rule:

    1. **Minimum first.** Spec ``000`` §6.3.3 has every request choose a verification prefix length
       ``l ∈ {1..5}``: the minimum is one *draft*, not just the target's own token (which every request gets
       anyway: the bonus/correction token of §6.1 step 3). So each request with drafts verifies its first draft
       unconditionally, and these ``R`` drafts are charged to the budget first. If ``budget < R`` the minimum wins
       and ``sum(L) == R`` exceeds the budget by ``R - budget``; the host should budget at least one draft per
       drafting request.
    2. **The rest by global top-k.** The remaining ``max(budget - R, 0)`` slots go to the drafts ``i >= 1`` with the
       largest gains ``g[b, i] = prod_{j <= i} c[b, j]`` over the whole batch (§6.3.3 "按预期接受率排序", §6.5
       "累积乘积 (cumprod)、全局排序取 top-k、融合 remap scatter"). With a cost linear in verified tokens (the
       verify_cost of §6.3.3's sketch, one query token per draft) and gains non-increasing along ``i`` (a product of
       factors in [0, 1]), this greedy choice maximizes the expected number of accepted drafts
       ``sum_b sum_{i < L[b]} g[b, i]`` among all length vectors with ``L[b] >= 1`` and ``sum(L) <= max(budget, R)``.
       Exactly ``min(remaining, available)`` drafts are picked, even drafts with gain 0, so the verify shape is
       the budget whenever enough drafts exist.
    3. **Ties** are broken by earlier draft position first, then earlier request (a stable sort over a
       position-major flattening). Earlier-position-first keeps every request's pick a prefix when a confidence
       is exactly 1 (equal consecutive gains) and, among equal gains, spreads the budget across requests depth by
       depth (e.g. all confidences 1, equal ``num_drafts``: lengths differ by at most one, the surplus going to the
       earlier requests) instead of filling the first requests to k.
    4. **Remap.** A request's picks are a prefix, so ``L[b] = 1 + (number of picks in row b)``. The top-k is done as
       a rank threshold (sort once, scatter each entry's rank back to its ``(b, i)`` slot, keep ``rank <
       remaining``) so ``k`` can stay a device tensor: ``torch.topk`` would need it as a host int.

    With all confidences 1 and ``budget >= sum(num_drafts)`` the result equals :func:`fixed_lengths`.
    """
    return confidence_mask(confidences, num_drafts, budget).sum(dim=1)


def confidence_mask(
    confidences: torch.Tensor, num_drafts: torch.Tensor, budget: int | torch.Tensor
) -> torch.Tensor:
    """``[B, k]`` bool: which drafts :func:`confidence_lengths` verifies (same arguments and rule). Row ``b`` is
    always a prefix, ``mask[b] == (arange(k) < L[b])``: the drafts handed to the verify step."""
    if confidences.dim() != 2:
        raise ValueError(f"confidences must be 2-D [B, k], got shape {tuple(confidences.shape)}")
    batch, k = confidences.shape
    if num_drafts.shape != (batch,):
        raise ValueError(f"num_drafts must have shape [{batch}], got {tuple(num_drafts.shape)}")
    if not isinstance(budget, torch.Tensor) and not isinstance(budget, int):
        raise TypeError(f"budget must be an int or a 0-d tensor, got {type(budget).__name__}")
    if isinstance(budget, torch.Tensor) and budget.dim() != 0:
        raise ValueError(f"budget tensor must be 0-d, got shape {tuple(budget.shape)}")
    device = confidences.device

    n = num_drafts.to(device=device, dtype=torch.long).clamp(0, k)
    has_drafts = n > 0
    pos = torch.arange(k, device=device)
    # drafts competing for the shared budget: real drafts past each request's first (the first is the minimum)
    extra = (pos.unsqueeze(0) < n.unsqueeze(1)) & (pos.unsqueeze(0) >= 1)

    conf = torch.nan_to_num(confidences.float(), nan=0.0).clamp(0.0, 1.0)
    gain = torch.cumprod(conf, dim=1)  # padding sits after a request's drafts, so it never enters a real gain
    score = torch.where(extra, gain, torch.full_like(gain, float("-inf")))

    # position-major flattening (flat index = i * B + b) + a stable descending sort: equal gains are taken
    # earlier position first, then earlier request
    flat = score.t().reshape(-1)
    order = torch.sort(flat, descending=True, stable=True).indices
    rank_flat = torch.empty_like(order).scatter_(0, order, torch.arange(flat.numel(), device=device))
    rank = rank_flat.view(k, batch).t()

    remaining = (budget - has_drafts.sum()).clamp_min(0)
    picked = extra & (rank < remaining)
    picked[:, :1] |= has_drafts.unsqueeze(1)  # the per-request minimum: every drafting request's first draft
    return picked


def lengths_for(
    policy: str | VerifyPolicy,
    num_drafts: torch.Tensor,
    confidences: torch.Tensor | None = None,
    budget: int | torch.Tensor | None = None,
) -> torch.Tensor:
    """Dispatch on the policy name: ``"fixed"`` ignores confidences and budget; ``"confidence"`` needs both."""
    name = policy.name if isinstance(policy, VerifyPolicy) else policy
    if name == "fixed":
        return fixed_lengths(num_drafts)
    if name == "confidence":
        if confidences is None or budget is None:
            raise ValueError("the 'confidence' verify policy needs the drafts' confidences and a budget")
        return confidence_lengths(confidences, num_drafts, budget)
    raise ValueError(f"unknown verify policy {name!r}; expected one of {VERIFY_POLICIES}")


@dataclass(frozen=True)
class VerifyPolicy:
    """A named verification-length policy (``"fixed"`` or ``"confidence"``)."""

    name: str = "fixed"

    def __post_init__(self) -> None:
        if self.name not in VERIFY_POLICIES:
            raise ValueError(f"unknown verify policy {self.name!r}; expected one of {VERIFY_POLICIES}")

    @property
    def needs_confidences(self) -> bool:
        return self.name == "confidence"

    def lengths(
        self,
        num_drafts: torch.Tensor,
        confidences: torch.Tensor | None = None,
        budget: int | torch.Tensor | None = None,
    ) -> torch.Tensor:
        return lengths_for(self, num_drafts, confidences, budget)
