"""The router's load balancers (docs/serving.md): pure functions over what the router knows of each instance.

They adapt DeepInfer's (spec 003 §1.1 and §1.2):

Prefill (§1.1), on `prefill_cost(q, c)`, the compute a prompt of q uncached tokens after c cached ones needs
(the spec's compute-quota):
  1. `assign_buckets`: prompts fall into four buckets by length (<16K / 16-64K / 64-256K / ≥256K tokens);
     each bucket gets a share of the instances proportional to its share of the compute-quota demand of the
     last round (`QuotaRounds`).
  2. `pick_prefill`: within the bucket, the instance with the most quota left, i.e. the least outstanding
     prefill compute. No prefix affinity: every instance hits every prefix through the shared store.
  3. Within an instance, its DP ranks: the engine's own dispatch (not the router's business here).
  (4. the step's time budget is the engine's `prefill_step_budget_ms`.)
Decode (§1.2), `pick_decode`: balance both the request count (a step's batch) and the total KV length (its
attention): long requests go to the instance with the least KV, short ones to the least busy by count,
preferring among those the one holding the most KV.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Sequence

BUCKET_EDGES = (16 * 1024, 64 * 1024, 256 * 1024)     # <16K / 16-64K / 64-256K / >=256K prompt tokens
NUM_BUCKETS = len(BUCKET_EDGES) + 1
# the cost proxy: a new token attending over this many earlier ones costs as much again as its dense layers
ATTENTION_TOKENS = 8192
LONG_REQUEST_TOKENS = 8192    # decode: prompt + output at least this long is a "long" request


@dataclass
class InstanceState:
    url: str
    num_requests: int = 0            # running + waiting
    kv_tokens: int = 0               # tokens whose KV it holds for unfinished requests
    kv_capacity_tokens: int = 0      # 0: unknown
    quota_load: float = 0.0          # outstanding prefill compute, in prefill_cost units
    busy: float = 0.0                # fraction of recent time spent computing (0-1)


def bucket_of(prompt_tokens: int) -> int:
    return bisect.bisect_right(BUCKET_EDGES, prompt_tokens)


def prefill_cost(q: int, c: int = 0) -> float:
    """The spec's cost(q, c), a quadratic: q tokens through the dense layers, each attending over the c cached
    tokens and, on average, half of the new ones."""
    return q * (1.0 + (c + (q + 1) / 2) / ATTENTION_TOKENS)


class QuotaRounds:
    """Level 1's input: each bucket's compute-quota demand over the last complete round of `round_s` seconds."""

    def __init__(self, round_s: float = 10.0):
        self.round_s = round_s
        self._start: float | None = None
        self._current = [0.0] * NUM_BUCKETS
        self.last = [0.0] * NUM_BUCKETS

    def add(self, bucket: int, cost: float, now: float) -> None:
        self._roll(now)
        self._current[bucket] += cost

    def demand(self, now: float) -> list[float]:
        self._roll(now)
        return list(self.last)

    def _roll(self, now: float) -> None:
        if self._start is None:
            self._start = now
        elapsed = now - self._start
        if elapsed >= self.round_s:
            self.last = self._current if elapsed < 2 * self.round_s else [0.0] * NUM_BUCKETS
            self._current = [0.0] * NUM_BUCKETS
            self._start += self.round_s * int(elapsed // self.round_s)


def assign_buckets(urls: Sequence[str], demand: Sequence[float]) -> list[list[str]]:
    """Level 1: the instances (in the given order) split among the buckets in proportion to each bucket's
    demand, by largest remainders, at least one each for a bucket with demand. A bucket without demand last
    round may use every instance (it gets a share of its own next round); so may every bucket when there was
    no demand at all, or fewer instances than buckets with demand."""
    urls = list(urls)
    wanted = [i for i, d in enumerate(demand) if d > 0]
    if not wanted or len(urls) < len(wanted):
        return [list(urls) for _ in range(NUM_BUCKETS)]
    total = sum(demand[i] for i in wanted)
    spare = len(urls) - len(wanted)                     # beyond the one each demanded bucket gets
    exact = {i: spare * demand[i] / total for i in wanted}
    counts = {i: 1 + int(exact[i]) for i in wanted}
    left = len(urls) - sum(counts.values())
    for i in sorted(wanted, key=lambda i: (-(exact[i] - int(exact[i])), i))[:left]:
        counts[i] += 1
    out, start = [], 0
    for b in range(NUM_BUCKETS):
        if b in counts:
            out.append(urls[start:start + counts[b]])
            start += counts[b]
        else:
            out.append(list(urls))
    return out


def pick_prefill(instances: Sequence[InstanceState], prompt_tokens: int,
                 buckets: Sequence[Sequence[str]] | None = None) -> InstanceState | None:
    """Levels 1-2: among the healthy `instances` in the prompt's bucket (all of them when none of the
    bucket's is healthy), the one with the most compute quota left: the least outstanding prefill compute;
    ties go to the less busy, then to the one with fewer requests."""
    if not instances:
        return None
    pool = list(instances)
    if buckets is not None:
        mine = set(buckets[bucket_of(prompt_tokens)])
        pool = [s for s in instances if s.url in mine] or pool
    return min(pool, key=lambda s: (s.quota_load, s.busy, s.num_requests))


def pick_decode(instances: Sequence[InstanceState], request_tokens: int,
                long_tokens: int = LONG_REQUEST_TOKENS) -> InstanceState | None:
    """§1.2: a long request (prompt + output >= `long_tokens`) goes to the instance holding the least KV
    (ties: fewer requests); a short one to the lowest request count, and among the instances within one
    request of it, to the one holding the most KV (short requests even out the batches of the instances
    long contexts made heavy; the light ones stay free for long requests). Instances whose free KV cannot
    hold the request are passed over while another can."""
    if not instances:
        return None
    fits = [s for s in instances
            if not s.kv_capacity_tokens or s.kv_capacity_tokens - s.kv_tokens >= request_tokens]
    pool = fits or list(instances)
    if request_tokens >= long_tokens:
        return min(pool, key=lambda s: (s.kv_tokens, s.num_requests))
    least = min(s.num_requests for s in pool)
    near = [s for s in pool if s.num_requests <= least + 1]
    return max(near, key=lambda s: (s.kv_tokens, -s.num_requests))


# ---- the vision-encoder pool (spec 003 §1.3) ---------------------------------------------------------------------
def image_patches(width: int, height: int, patch_size: int) -> int:
    """An image's cost to the vision encoder, as the spec counts it: (width / patch_size) x (height / patch_size)."""
    return (width // patch_size) * (height // patch_size)


@dataclass
class EncoderGpu:
    """One GPU of a vision-encoder instance and the patches of the images it is encoding."""
    url: str
    gpu: int
    patches_in_flight: int = 0       # what this client sent there and has not heard back about
    healthy: bool = True
    reported_patches: int = 0        # what the instance last reported in flight (every client's images)

    @property
    def load(self) -> int:
        """Patches in flight there: the larger of the instance's last report and this client's own count (a burst
        between two reports is not all sent to one GPU; other clients' images count once reported)."""
        return max(self.patches_in_flight, self.reported_patches)


class EncoderLoads:
    """§1.3: an image goes to the encoder GPU with the fewest patches in flight (ties: the earlier listed). `take`
    counts the image's patches on the chosen GPU until `give_back` (the embeddings came back, or the call failed);
    unhealthy GPUs (their instance failed its health check) and those of `exclude`d instances (already tried for
    this image) are passed over."""

    def __init__(self, gpus: Sequence[EncoderGpu]):
        self.gpus = list(gpus)

    def take(self, patches: int, exclude: frozenset[str] | set[str] = frozenset()) -> EncoderGpu | None:
        pool = [g for g in self.gpus if g.healthy and g.url not in exclude]
        if not pool:
            return None
        best = min(pool, key=lambda g: g.load)
        best.patches_in_flight += patches
        return best

    def give_back(self, gpu: EncoderGpu, patches: int) -> None:
        gpu.patches_in_flight = max(0, gpu.patches_in_flight - patches)

    def mark(self, url: str, healthy: bool, reported_patches: int | None = None) -> None:
        """An instance's health (and its reported load) as the last health check or call found it."""
        for g in self.gpus:
            if g.url == url:
                g.healthy = healthy
                if reported_patches is not None:
                    g.reported_patches = reported_patches
