"""Autoscaling policy for a prefill/decode cluster (spec `003_…txt` §2; `000_…txt` §11.1 and §14.7; `004_…txt`
on the 1:1 P:D ratio): plain decisions over numbers the router already has, no I/O.

Why (§2): with prefill and decode on separate instances, the ratio of what the two need moves with the traffic
(long prompts load prefill, long answers load decode); a static P:D split queues on one side while the other
idles, so the cluster follows the traffic by resizing each pool on its own signal:

- **Prefill** is sized by **uncached** prompt tokens per second (§2 "统计未命中 token 数"): cached tokens come
  from the shared store and cost no compute (§14.7: non-cached input = input × (1 − hit rate)), against one
  instance's prefill capacity in uncached tokens/s.
- **Decode** is sized by the **running requests** (§2 "在计算的请求数") against what one instance holds at its
  TPOT target, and by their KV against its KV pool (the decode balancer's two dimensions, §1.2).
- Each resize is **rate-limited** (at most so many instances added / removed per interval) and kept within
  **bounds** (§2 "调整有限速和上下界"); a scale-in also goes no lower than the recent intervals' targets
  (a stabilization window: without it, the interval after a scale-out often asks for one less).
- **Never scale in while quota use is above 80%** (§2, and §14.7 "quota 利用率 > 0.8 时禁止缩容"): traffic that
  rebounds right after a scale-in would find too little capacity.
- **Redundant quota** (§2 "冗余配额"), one of two ways: a pool of **ready** (started, unassigned) machines that
  a scale-out takes first, online in seconds instead of a cold start; or **over-provisioning**, more instances
  online than the computed minimum.
- **Scale-in of a decode instance** (§2): it takes no new requests and gets a **grace period of 1 minute** to
  finish what it runs; whatever is still running then moves, with its KV, to other decode instances in one go
  (a long-tail request would otherwise hold a whole instance). `migration_seconds` is what that move costs.
  A prefill instance has no long tail (a prompt is one or a few steps): it stops taking requests and leaves
  once its queue is empty.

`decide` is one interval's decision for one pool; `DecodeDrain` is one draining decode instance's clock. The
cluster simulator (`cluster/simulator.py`) drives both.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Sequence

PREFILL, DECODE = "prefill", "decode"
READY_POOL, OVER_PROVISION = "ready_pool", "over_provision"


@dataclass(frozen=True)
class PoolBounds:
    """One pool's (prefill or decode) bounds and rate limits, in instances."""
    min_instances: int = 1
    max_instances: int = 64
    max_add_per_interval: int = 4       # scale-out rate limit
    max_remove_per_interval: int = 1    # scale-in rate limit (slower: giving capacity back is the risky way)


@dataclass(frozen=True)
class AutoscaleConfig:
    interval_s: float = 60.0            # one decision per pool per interval
    prefill: PoolBounds = field(default_factory=PoolBounds)
    decode: PoolBounds = field(default_factory=PoolBounds)
    # size each pool so its demand would use this share of its capacity (headroom for bursts within an interval)
    target_utilization: float = 0.7
    scale_in_max_quota_use: float = 0.8     # §2: above this quota use, no scale-in
    # a scale-in goes no lower than the largest target of this many recent intervals (one quiet interval
    # between two busy ones gives nothing back; the cold start it would cost later is minutes)
    scale_in_stabilization_intervals: int = 5
    # §2 redundant quota: READY_POOL keeps `ready_pool_size` started machines unassigned; OVER_PROVISION keeps
    # `over_provision_fraction` more instances online than needed
    redundancy: str = READY_POOL
    ready_pool_size: int = 2
    over_provision_fraction: float = 0.2
    cold_start_s: float = 180.0         # a new machine: allocate, load weights, warm up (graphs, compile)
    warm_start_s: float = 10.0          # a ready machine: join the router
    grace_period_s: float = 60.0        # §2: a draining decode instance's last minute before its requests move
    # the migration of a draining instance's requests: KV bytes over the P/D network
    kv_bytes_per_token: int = 131_072
    migration_bandwidth_bytes_per_s: float = 50e9
    migration_latency_s: float = 0.005

    def bounds(self, pool: str) -> PoolBounds:
        return self.prefill if pool == PREFILL else self.decode

    def __post_init__(self):
        if self.redundancy not in (READY_POOL, OVER_PROVISION):
            raise ValueError(f"redundancy must be {READY_POOL!r} or {OVER_PROVISION!r}, not {self.redundancy!r}")


@dataclass(frozen=True)
class PoolSignals:
    """What one pool asks for over the last interval, in the pool's own unit: prefill in uncached prompt
    tokens/s; decode in running (+ waiting) requests, with the KV they hold as a second dimension.

    `demand` sizes the pool; `quota_use` (the busiest moment of the interval as a share of the online
    capacity, backlog included) decides whether a scale-in is allowed."""
    demand: float                       # tokens/s (prefill) or requests (decode)
    capacity_per_instance: float        # the same unit, one instance at its SLO
    quota_use: float                    # 0-1+, of the online instances' capacity
    kv_tokens: float = 0.0              # decode: KV of the running requests
    kv_capacity_per_instance: float = 0.0   # decode: one instance's KV pool (0: not a limit)


@dataclass(frozen=True)
class ScaleDecision:
    pool: str
    online: int                         # serving now (starting instances included, draining ones not)
    needed: int                         # the minimum for the demand at the target utilization, within bounds
    target: int                         # what the policy aims at (needed, plus over-provisioning)
    add_from_ready_pool: int = 0        # online after warm_start_s
    add_cold: int = 0                   # online after cold_start_s
    remove: int = 0
    scale_in_blocked: bool = False      # a scale-in was due but quota use was above the limit
    reason: str = ""

    @property
    def add(self) -> int:
        return self.add_from_ready_pool + self.add_cold


def instances_needed(signals: PoolSignals, target_utilization: float) -> int:
    """The fewest instances that serve the demand at the target utilization (both dimensions for decode)."""
    usable = signals.capacity_per_instance * target_utilization
    n = math.ceil(signals.demand / usable - 1e-9) if usable > 0 else 0
    if signals.kv_capacity_per_instance > 0:
        n = max(n, math.ceil(signals.kv_tokens / (signals.kv_capacity_per_instance * target_utilization) - 1e-9))
    return n


def decide(config: AutoscaleConfig, pool: str, signals: PoolSignals, online: int,
           ready_available: int = 0, recent_targets: Sequence[int] = ()) -> ScaleDecision:
    """One interval's decision for one pool (`online`: instances serving or starting, not draining;
    `ready_available`: ready machines a scale-out can take now; `recent_targets`: this pool's targets of the
    previous intervals, newest last, of which the last `scale_in_stabilization_intervals - 1` bound a
    scale-in from below)."""
    bounds = config.bounds(pool)
    needed = min(max(instances_needed(signals, config.target_utilization), bounds.min_instances),
                 bounds.max_instances)
    target = needed
    if config.redundancy == OVER_PROVISION:
        target = min(math.ceil(needed * (1 + config.over_provision_fraction) - 1e-9), bounds.max_instances)
        target = max(target, min(needed + 1, bounds.max_instances))   # at least one spare
    base = dict(pool=pool, online=online, needed=needed, target=target)
    if target > online:
        add = min(target - online, bounds.max_add_per_interval)
        warm = min(add, ready_available) if config.redundancy == READY_POOL else 0
        return ScaleDecision(**base, add_from_ready_pool=warm, add_cold=add - warm,
                             reason=f"scale out: {signals.demand:.4g} asks for {target}")
    keep = config.scale_in_stabilization_intervals - 1
    scale_in_to = max([target, *list(recent_targets)[-keep:]]) if keep > 0 else target
    if scale_in_to < online:
        if signals.quota_use > config.scale_in_max_quota_use:
            return ScaleDecision(**base, scale_in_blocked=True,
                                 reason=f"scale-in blocked: quota use {signals.quota_use:.0%} > "
                                        f"{config.scale_in_max_quota_use:.0%}")
        remove = min(online - scale_in_to, bounds.max_remove_per_interval)
        return ScaleDecision(**base, remove=remove, reason=f"scale in: {signals.demand:.4g} asks for {target}")
    return ScaleDecision(**base, reason="steady")


def migration_seconds(kv_tokens: int, config: AutoscaleConfig) -> float:
    """What moving a request's KV to another decode instance costs (§2's one-shot hand-over at the end of the
    grace period): a fixed latency plus its KV bytes over the P/D network."""
    return config.migration_latency_s + kv_tokens * config.kv_bytes_per_token / config.migration_bandwidth_bytes_per_s


@dataclass
class DecodeDrain:
    """A decode instance told to go: no new requests from `started_at`; at `started_at + grace_period_s` the
    requests it still runs move, with their KV, to other instances, and the instance is released."""
    instance: int
    started_at: float
    grace_period_s: float = 60.0

    @property
    def migrate_at(self) -> float:
        return self.started_at + self.grace_period_s

    def due(self, now: float) -> bool:
        return now >= self.migrate_at


def pick_drain_victim(kv_tokens_by_instance: dict[int, int]) -> int:
    """The decode instance to take out: the one holding the least KV (fewest requests left to finish or move
    at the end of the grace period); ties go to the highest id (the newest)."""
    return min(kv_tokens_by_instance, key=lambda i: (kv_tokens_by_instance[i], -i))
