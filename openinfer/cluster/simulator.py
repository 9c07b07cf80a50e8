"""A deterministic discrete-event simulator of a prefill/decode cluster (issue 15, item 4), to weigh the
autoscaling policy (`cluster/autoscale.py`, spec 003 §2) against static P:D splits before any cluster exists.

What it models, and from what:
- **Prefill instances** run FIFO queues in steps of up to `prefill_chunk_tokens` new tokens; a step costs the
  fitted `StepCostModel` (engine/cost_model.py, `cost(q, c) = a·q² + b·q·c + d·q + e`), so cached tokens (c)
  cost only their attention from the new ones. The default coefficients are `fit` over H200 / Llama-3-8B-shape
  measurements in BENCHMARKS.md (`H200_LLAMA8B_PREFILL_SAMPLES`, each sample's source beside it).
- **Decode instances** run continuous batches; a step over B requests holding K KV tokens costs
  `e + B·d + b·K` (the same StepCostModel over q = 1 rows), from BENCHMARKS.md's H200 decode rows
  (`h200_llama8b_decode_cost`). Batches are advanced in closed form between events (a request joining or
  finishing), never step by step, so a simulated day runs in seconds.
- **Routing** through the router's balancers (serving/balancers.py): length buckets + most quota left for
  prefill, count/KV for decode. **KV hand-over** P→D: latency + prompt KV bytes / bandwidth.
- **Workload**: a diurnal arrival rate (a sinusoid over `day_s`, which compresses a day into any span),
  short/long prompt mix, multi-turn conversations whose next turn comes a think time after the previous
  answer and hits its whole context in the prefix store (full blocks), so only the new tokens cost prefill.
- **Policy**: a static P and D count, or the autoscaler every `interval_s` (rate limits, bounds, the 80% rule,
  ready pool or over-provisioning, a decode drain's grace period then KV migration).

Out: GPUs held over time (prefill, decode, ready pool), queueing delay, TTFT/TPOT percentiles, SLO attainment,
GPU-hours. These are simulated from single-GPU measurements, not measured on a cluster.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import asdict, dataclass, field
from functools import lru_cache

import numpy as np

from openinfer.cluster import autoscale
from openinfer.cluster.autoscale import AutoscaleConfig, DecodeDrain, PoolSignals
from openinfer.engine.cost_model import StepCostModel, fit
from openinfer.serving.balancers import (InstanceState, QuotaRounds, assign_buckets, bucket_of, pick_decode,
                                         pick_prefill, prefill_cost)

# ---- H200 / Llama-3-8B-shape costs (BENCHMARKS.md) -----------------------------------------------------------
# Prefill steps as ([(q new tokens, c cached)], ms), from "GPU: prefill over cached prefixes", table "Cached TTFT
# through LLM.generate", column "paged, run 2 (a38f4db)" (one request, max_tokens=1: one prefill step plus the
# host's launch overhead, which is the fit's e), and the cold 8,192-token prompt of the same run (229.6 ms).
H200_LLAMA8B_PREFILL_SAMPLES = (
    ([(128, 8064)], 23.4),      # 8,192 prompt, 8,064 cached (whole blocks: 128 computed)
    ([(512, 7680)], 24.0),
    ([(2048, 6144)], 70.8),
    ([(512, 15488)], 34.1),     # 16,000 prompt, 15,488 cached
    ([(8192, 0)], 229.6),       # cold 8,192
)
# Held out: the cold 16,000-token prompt of that run, two chunks (8,192 cold, then 7,808 over 8,192): 526.0 ms.
# Decode steps as (batch, context per request, ms): "GPU: Llama-3-8B shape on one H200", async scheduling column
# (commit 476172a, benchmarks/results/gpu_llama8b_h200_2026-11-29.json).
H200_LLAMA8B_DECODE_STEPS = ((1, 1024, 4.884), (8, 1024, 5.344), (64, 1024, 7.140), (256, 1024, 15.067))
# Those rows share one context, so the per-KV-token cost comes from the profile in the same section: the paged
# decode kernel reads b=256 × 1K context (262,144 tokens) in 9.5 ms.
H200_DECODE_MS_PER_KV_TOKEN = 9.5 / 262_144
H200_KV_BYTES_PER_TOKEN = 131_072           # Llama-3-8B shape, bf16 (BENCHMARKS.md: "128 KB per token")
# Assumed, not measured: 100 GiB of the H200's 141 GB for the KV pool (16 GB of weights, activations, graphs).
H200_DECODE_KV_CAPACITY_TOKENS = 100 * 2**30 // H200_KV_BYTES_PER_TOKEN     # 819,200


@lru_cache(maxsize=None)
def h200_llama8b_prefill_cost() -> StepCostModel:
    return fit(list(H200_LLAMA8B_PREFILL_SAMPLES))[0]


@lru_cache(maxsize=None)
def h200_llama8b_decode_cost() -> StepCostModel:
    """The decode step as a StepCostModel over q = 1 rows (e + Σ(a + b·c + d)): the KV term b from the kernel
    profile, the rest fitted over the batch rows once that term is taken off (a q = 1 row cannot tell a from
    d, so their sum is kept as d)."""
    g = H200_DECODE_MS_PER_KV_TOKEN
    samples = [([(1, 0)] * batch, ms - g * batch * ctx) for batch, ctx, ms in H200_LLAMA8B_DECODE_STEPS]
    rows = fit(samples)[0]
    return StepCostModel(a=0.0, b=g, d=rows.a + rows.d, e=rows.e)


# ---- workload ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class WorkloadConfig:
    seed: int = 0
    duration_s: float = 3600.0          # conversations start in [0, duration_s)
    day_s: float = 3600.0               # one diurnal period: 86,400 is a real day; less compresses it
    peak_rate: float = 4.0              # requests/s at the daily peak (turns included)
    trough_fraction: float = 0.15       # the rate at the trough, as a fraction of the peak
    long_fraction: float = 0.2          # conversations that open with a long prompt
    short_prompt_tokens: tuple[int, int] = (256, 2048)
    long_prompt_tokens: tuple[int, int] = (8192, 32768)
    output_tokens: tuple[int, int] = (64, 512)
    turns: int = 1                      # mean turns per conversation (1 .. 2·turns − 1, uniform)
    turn_message_tokens: tuple[int, int] = (32, 512)   # what a later turn adds besides the previous context
    think_time_s: tuple[float, float] = (5.0, 60.0)    # from an answer to the next turn
    max_context_tokens: int = 131_072   # a conversation ends before its context would pass this

    def rate(self, t: float) -> float:
        """Requests/s at time t: trough at t = 0, peak at half a day."""
        swing = (1 - math.cos(2 * math.pi * t / self.day_s)) / 2
        return self.peak_rate * (self.trough_fraction + (1 - self.trough_fraction) * swing)


@dataclass
class Conversation:
    start: float
    first_prompt: int
    outputs: list[int]                  # per turn
    messages: list[int]                 # per later turn: tokens added to the previous context
    think_s: list[float]                # per later turn


def make_conversations(w: WorkloadConfig) -> list[Conversation]:
    """The trace: conversation starts by thinning a Poisson process at the peak conversation rate."""
    rng = np.random.default_rng(w.seed)
    conv_peak = w.peak_rate / max(w.turns, 1)
    out, t = [], 0.0
    while True:
        t += rng.exponential(1 / conv_peak)
        if t >= w.duration_s:
            return out
        if rng.random() * w.peak_rate > w.rate(t):
            continue
        n = int(rng.integers(1, 2 * max(w.turns, 1)))
        lo, hi = w.long_prompt_tokens if rng.random() < w.long_fraction else w.short_prompt_tokens
        out.append(Conversation(
            start=t, first_prompt=int(rng.integers(lo, hi + 1)),
            outputs=rng.integers(w.output_tokens[0], w.output_tokens[1] + 1, size=n).tolist(),
            messages=rng.integers(w.turn_message_tokens[0], w.turn_message_tokens[1] + 1, size=n).tolist(),
            think_s=rng.uniform(*w.think_time_s, size=n).tolist()))


# ---- cluster ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ClusterConfig:
    prefill_instances: int = 2          # static counts, and the autoscaler's starting point
    decode_instances: int = 2
    autoscale: AutoscaleConfig | None = None
    prefill_cost: StepCostModel = field(default_factory=h200_llama8b_prefill_cost)
    decode_cost: StepCostModel = field(default_factory=h200_llama8b_decode_cost)
    gpus_per_instance: int = 1
    prefill_chunk_tokens: int = 8192
    decode_max_seqs: int = 256
    decode_kv_capacity_tokens: int = H200_DECODE_KV_CAPACITY_TOKENS
    block_size: int = 128               # prefix hits are whole blocks
    kv_bytes_per_token: int = H200_KV_BYTES_PER_TOKEN
    # P→D hand-over; assumed one 400 Gb/s NIC per GPU (50 GB/s), not measured
    kv_transfer_bytes_per_s: float = 50e9
    kv_transfer_latency_s: float = 0.002
    slo_ttft_s: float = 2.0
    slo_tpot_s: float = 0.05
    request_timeout_s: float = 120.0    # dropped if its prefill has not started by then
    meter_interval_s: float = 10.0      # the autoscaler's signals are sampled this often
    sample_interval_s: float = 60.0     # the timeline's resolution


class Request:
    __slots__ = ("id", "conv", "turn", "arrival", "prompt", "cached", "output", "prefill_start", "first_token",
                 "finish", "dropped", "done_tokens", "left", "generated", "ctx_at_join", "join_step", "need",
                 "decode_arrival", "decode_start", "migrations")

    def __init__(self, rid, conv, turn, arrival, prompt, cached, output):
        self.id, self.conv, self.turn, self.arrival = rid, conv, turn, arrival
        self.prompt, self.cached, self.output = prompt, cached, output
        self.prefill_start = self.first_token = self.finish = self.decode_arrival = self.decode_start = None
        self.dropped = False
        self.done_tokens = cached           # prompt tokens whose KV exists
        self.left = output - 1              # decode steps still to run (prefill gives the first token)
        self.generated = 0
        self.ctx_at_join = self.join_step = self.need = 0
        self.migrations = 0


# instance states
STARTING, ONLINE, DRAINING, GONE = "starting", "online", "draining", "gone"


class PrefillInstance:
    def __init__(self, idx: int, status: str):
        self.idx, self.status = idx, status
        self.state = InstanceState(url=f"p{idx}")
        self.queue: deque[Request] = deque()
        self.busy = False
        self.queued_uncached = 0


class DecodeInstance:
    """A continuous batch advanced in closed form: from step `s0` at time `t0` with B requests holding K0 KV
    tokens, step i (0-based) takes e + B·d + b·(K0 + i·B) (each step appends one token per request)."""

    def __init__(self, idx: int, status: str, cost: StepCostModel, max_seqs: int, kv_capacity: int):
        self.idx, self.status = idx, status
        self.state = InstanceState(url=f"d{idx}", kv_capacity_tokens=kv_capacity)
        self.e, self.per_row, self.per_kv = cost.e / 1e3, (cost.a + cost.d) / 1e3, cost.b / 1e3
        self.max_seqs, self.kv_capacity = max_seqs, kv_capacity
        self.t0, self.s0, self.B, self.K0 = 0.0, 0, 0, 0
        self.finishing: list[tuple[int, int, Request]] = []     # heap of (finish step, request id, request)
        self.waiting: deque[Request] = deque()
        self.reserved = 0                   # KV reserved by admitted requests (context + what is left)
        self.version = 0

    def steps_time(self, n: int) -> float:
        return n * (self.e + self.per_row * self.B + self.per_kv * self.K0) + self.per_kv * self.B * n * (n - 1) / 2

    def rebase(self, step: int) -> None:
        n = step - self.s0
        self.t0 += self.steps_time(n)
        self.K0 += self.B * n
        self.s0 = step

    def next_boundary(self, now: float) -> int:
        """The first step boundary at or after `now` (the step in flight finishes first)."""
        elapsed = now - self.t0
        if self.B == 0 or elapsed <= 0:
            return self.s0
        half = self.per_kv * self.B / 2
        lin = self.e + self.per_row * self.B + self.per_kv * self.K0 - half
        n = int((-lin + math.sqrt(lin * lin + 4 * half * elapsed)) / (2 * half)) if half > 0 else int(elapsed / lin)
        while self.steps_time(n) < elapsed:
            n += 1
        while n > 0 and self.steps_time(n - 1) >= elapsed:
            n -= 1
        return self.s0 + n

    def kv_now(self) -> int:
        return self.K0


@dataclass
class SimResult:
    summary: dict
    timeline: dict
    requests: list[Request] = field(repr=False, default_factory=list)


# event kinds (ints: heap tuples compare them after the time and sequence number, never the payload)
_ARRIVE, _PREFILL_DONE, _KV_ARRIVED, _DECODE, _ONLINE, _READY, _MIGRATE, _METER, _SAMPLE, _AUTOSCALE = range(10)


class Simulator:
    def __init__(self, workload: WorkloadConfig, cluster: ClusterConfig):
        self.w, self.c = workload, cluster
        self.a = cluster.autoscale
        self.events: list = []
        self.seq = 0
        self.now = 0.0
        self.requests: list[Request] = []
        self.prefill: list[PrefillInstance] = []
        self.decode: list[DecodeInstance] = []
        self.rounds = QuotaRounds(round_s=10.0)
        self.active = 0                     # requests arrived and not finished or dropped
        self.pending_turns = 0              # conversations with a turn still to come
        # GPU accounting: instances held (starting, online, draining) and ready machines
        self.gpu_s = {"prefill": 0.0, "decode": 0.0, "ready_pool": 0.0}
        self._last_account = 0.0
        self.ready = self.a.ready_pool_size if self.a and self.a.redundancy == autoscale.READY_POOL else 0
        self.ready_refilling = 0
        # the autoscaler's meters over the current interval
        self._uncached_in_window = 0.0
        self._predicted_s_in_window = 0.0
        self._meter_prefill: list[float] = []   # uncached tokens/s per meter window
        self._meter_decode: list[tuple[int, int]] = []   # (requests, KV reserved) per meter tick
        self._interval_uncached = 0.0
        self._interval_predicted_s = 0.0
        self.timeline: dict[str, list] = {k: [] for k in (
            "t", "prefill_gpus", "decode_gpus", "ready_gpus", "prefill_online", "decode_online", "arrival_rate",
            "prefill_queue_tokens", "decode_running")}
        self._arrivals_in_sample = 0
        self.scale_events: list[dict] = []
        self._targets = {autoscale.PREFILL: deque(maxlen=16), autoscale.DECODE: deque(maxlen=16)}
        self.blocked_scale_ins = 0
        self.migrated_requests = 0
        self.migrated_kv_tokens = 0
        for _ in range(cluster.prefill_instances):
            self.prefill.append(PrefillInstance(len(self.prefill), ONLINE))
        for _ in range(cluster.decode_instances):
            self._new_decode(ONLINE)

    # ---- plumbing -------------------------------------------------------------------------------------------
    def push(self, t: float, kind: int, *payload) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, payload))

    def _new_decode(self, status: str) -> DecodeInstance:
        inst = DecodeInstance(len(self.decode), status, self.c.decode_cost, self.c.decode_max_seqs,
                              self.c.decode_kv_capacity_tokens)
        self.decode.append(inst)
        return inst

    def _account(self) -> None:
        dt = self.now - self._last_account
        if dt > 0:
            g = self.c.gpus_per_instance
            self.gpu_s["prefill"] += dt * g * sum(1 for p in self.prefill if p.status != GONE)
            self.gpu_s["decode"] += dt * g * sum(1 for d in self.decode if d.status != GONE)
            self.gpu_s["ready_pool"] += dt * g * (self.ready + self.ready_refilling)
        self._last_account = self.now

    def _running(self) -> bool:
        return self.now < self.w.duration_s or self.active > 0 or self.pending_turns > 0

    # ---- run --------------------------------------------------------------------------------------------------
    def run(self) -> SimResult:
        convs = make_conversations(self.w)
        for ci, conv in enumerate(convs):
            self.pending_turns += 1
            self.push(conv.start, _ARRIVE, ci, 0, 0)
        self.convs = convs
        self.push(0.0, _SAMPLE)
        self.push(self.c.meter_interval_s, _METER)
        if self.a is not None:
            self.push(self.a.interval_s, _AUTOSCALE)
        handlers = {_ARRIVE: self.on_arrive, _PREFILL_DONE: self.on_prefill_done, _KV_ARRIVED: self.on_kv_arrived,
                    _DECODE: self.on_decode, _ONLINE: self.on_online, _READY: self.on_ready,
                    _MIGRATE: self.on_migrate, _METER: self.on_meter, _SAMPLE: self.on_sample,
                    _AUTOSCALE: self.on_autoscale}
        events = self.events
        while events:
            t, _, kind, payload = heapq.heappop(events)
            self.now = t
            handlers[kind](*payload)
        self._account()
        return SimResult(self.summary(), self.timeline, self.requests)

    # ---- arrivals and prefill ----------------------------------------------------------------------------------
    def on_arrive(self, ci: int, turn: int, prev_context: int) -> None:
        conv = self.convs[ci]
        self.pending_turns -= 1
        if turn == 0:
            prompt, cached = conv.first_prompt, 0
        else:   # the previous turn's whole context is in the store, its full blocks hit
            prompt = prev_context + conv.messages[turn]
            cached = prev_context // self.c.block_size * self.c.block_size
        req = Request(len(self.requests), ci, turn, self.now, prompt, cached, max(conv.outputs[turn], 2))
        self.requests.append(req)
        self.active += 1
        self._arrivals_in_sample += 1
        q = prompt - cached
        self._uncached_in_window += q
        self._interval_uncached += q
        self._interval_predicted_s += self._predicted_prefill_s(q, cached)
        online = [p for p in self.prefill if p.status == ONLINE]
        cost = prefill_cost(q, cached)
        bucket = bucket_of(prompt)
        self.rounds.add(bucket, cost, self.now)
        buckets = assign_buckets([p.state.url for p in online], self.rounds.demand(self.now))
        state = pick_prefill([p.state for p in online], prompt, buckets)
        inst = self.prefill[int(state.url[1:])]
        inst.queue.append(req)
        inst.queued_uncached += q
        inst.state.quota_load += cost
        inst.state.num_requests += 1
        if not inst.busy:
            self._prefill_step(inst)

    def _predicted_prefill_s(self, q: int, c: int) -> float:
        m, chunk = self.c.prefill_cost, self.c.prefill_chunk_tokens
        return (m.seq_cost(q, c) + m.e * math.ceil(q / chunk)) / 1e3

    def _prefill_step(self, inst: PrefillInstance) -> None:
        """One step: up to `prefill_chunk_tokens` new tokens from the head of the queue."""
        budget, seqs, work = self.c.prefill_chunk_tokens, [], []
        for req in inst.queue:
            if budget == 0:
                break
            if req.prefill_start is None:
                req.prefill_start = self.now
            q = min(req.prompt - req.done_tokens, budget)
            seqs.append((q, req.done_tokens))
            work.append((req, q))
            budget -= q
        if not work:
            inst.busy = False
            if inst.status == DRAINING:
                self._release(inst)
            return
        inst.busy = True
        self.push(self.now + self.c.prefill_cost.step_cost(seqs) / 1e3, _PREFILL_DONE, inst.idx, work)

    def on_prefill_done(self, idx: int, work: list) -> None:
        inst = self.prefill[idx]
        for req, q in work:
            before = req.done_tokens
            req.done_tokens += q
            inst.queued_uncached -= q
            inst.state.quota_load -= prefill_cost(req.prompt - before, before) - prefill_cost(
                req.prompt - req.done_tokens, req.done_tokens)
            if req.done_tokens == req.prompt:
                inst.queue.popleft()        # the step's finished requests are at the head, in order
                inst.state.num_requests -= 1
                req.first_token = self.now
                if req.left == 0:
                    self._finish(req)
                else:
                    self._send_to_decode(req, self.c.kv_transfer_latency_s
                                         + req.prompt * self.c.kv_bytes_per_token / self.c.kv_transfer_bytes_per_s)
        if not inst.queue:
            inst.state.quota_load = 0.0
        self._drop_timed_out(inst)
        self._prefill_step(inst)

    def _drop_timed_out(self, inst: PrefillInstance) -> None:
        """A request whose prefill has not started within the timeout is dropped (the server's 408)."""
        limit = self.now - self.c.request_timeout_s
        keep = deque()
        for req in inst.queue:
            if req.prefill_start is None and req.arrival < limit:
                req.dropped = True
                inst.queued_uncached -= req.prompt - req.done_tokens
                inst.state.quota_load -= prefill_cost(req.prompt - req.done_tokens, req.done_tokens)
                inst.state.num_requests -= 1
                self._end(req)
            else:
                keep.append(req)
        inst.queue = keep

    # ---- decode -------------------------------------------------------------------------------------------------
    def _send_to_decode(self, req: Request, delay: float) -> None:
        online = [d for d in self.decode if d.status == ONLINE]
        for d in online:
            d.state.num_requests = d.B + len(d.waiting)
            d.state.kv_tokens = d.reserved
        state = pick_decode([d.state for d in online], req.prompt + req.generated + req.left)
        self.push(self.now + delay, _KV_ARRIVED, int(state.url[1:]), req)

    def on_kv_arrived(self, idx: int, req: Request) -> None:
        inst = self.decode[idx]
        if inst.status != ONLINE:           # it started draining while the KV was on the way
            self._send_to_decode(req, 0.0)
            return
        req.decode_arrival = self.now if req.decode_arrival is None else req.decode_arrival
        inst.waiting.append(req)
        if inst.B > 0 and inst.t0 <= self.now:
            inst.rebase(inst.next_boundary(self.now))
        elif inst.B == 0:
            inst.t0 = max(inst.t0, self.now)
        self._admit(inst)
        self._schedule_decode(inst)

    def _admit(self, inst: DecodeInstance) -> None:
        """Join waiting requests at the current boundary (s0, t0) while seats and KV allow."""
        while inst.waiting:
            req = inst.waiting[0]
            need = req.prompt + req.generated + req.left
            if inst.B >= inst.max_seqs or (inst.B and inst.reserved + need > inst.kv_capacity):
                return
            inst.waiting.popleft()
            if req.decode_start is None:
                req.decode_start = inst.t0
            req.need, req.join_step, req.ctx_at_join = need, inst.s0, req.prompt + req.generated
            inst.reserved += need
            inst.B += 1
            inst.K0 += req.ctx_at_join
            heapq.heappush(inst.finishing, (inst.s0 + req.left, req.id, req))

    def _schedule_decode(self, inst: DecodeInstance) -> None:
        inst.version += 1
        if inst.finishing:
            step = inst.finishing[0][0]
            self.push(inst.t0 + inst.steps_time(step - inst.s0), _DECODE, inst.idx, inst.version)

    def _leave_batch(self, inst: DecodeInstance, req: Request) -> None:
        inst.B -= 1
        inst.K0 -= req.ctx_at_join + (inst.s0 - req.join_step)
        inst.reserved -= req.need
        req.generated += inst.s0 - req.join_step
        req.left -= inst.s0 - req.join_step

    def on_decode(self, idx: int, version: int) -> None:
        inst = self.decode[idx]
        if version != inst.version:
            return
        inst.rebase(inst.finishing[0][0])
        self._pop_finished(inst)
        self._admit(inst)
        self._schedule_decode(inst)
        if inst.status == DRAINING and inst.B == 0:     # done before its grace period ended: nothing to move
            self._release(inst)

    def _pop_finished(self, inst: DecodeInstance) -> None:
        while inst.finishing and inst.finishing[0][0] <= inst.s0:
            req = heapq.heappop(inst.finishing)[2]
            self._leave_batch(inst, req)
            req.finish = inst.t0
            self._finish(req)

    def _finish(self, req: Request) -> None:
        if req.finish is None:
            req.finish = self.now
        self._end(req)
        conv = self.convs[req.conv]
        nxt = req.turn + 1
        if nxt < len(conv.outputs) and req.prompt + req.output + conv.messages[nxt] + conv.outputs[nxt] \
                <= self.w.max_context_tokens:
            self.pending_turns += 1
            self.push(req.finish + conv.think_s[nxt], _ARRIVE, req.conv, nxt, req.prompt + req.output)

    def _end(self, req: Request) -> None:
        self.active -= 1

    # ---- scaling --------------------------------------------------------------------------------------------
    def on_online(self, pool: str, idx: int) -> None:
        inst = (self.prefill if pool == autoscale.PREFILL else self.decode)[idx]
        if inst.status == STARTING:
            inst.status = ONLINE
            if pool == autoscale.DECODE:
                inst.t0 = self.now

    def on_ready(self) -> None:
        self._account()
        self.ready_refilling -= 1
        self.ready += 1

    def _release(self, inst) -> None:
        """An instance leaves: its machine goes back to the ready pool while the pool is short, else away."""
        self._account()
        inst.status = GONE
        if self.a is not None and self.a.redundancy == autoscale.READY_POOL \
                and self.ready + self.ready_refilling < self.a.ready_pool_size:
            self.ready += 1

    def on_migrate(self, idx: int) -> None:
        """End of a decode instance's grace period: what it still runs moves, KV and all, to other instances."""
        inst = self.decode[idx]
        if inst.status != DRAINING:
            return
        if inst.B:
            inst.rebase(inst.next_boundary(self.now))
        self._pop_finished(inst)
        moving = [entry[2] for entry in inst.finishing]
        inst.finishing.clear()
        for req in moving:
            self._leave_batch(inst, req)
            kv = req.prompt + req.generated
            req.migrations += 1
            self.migrated_requests += 1
            self.migrated_kv_tokens += kv
            self._send_to_decode(req, max(inst.t0 - self.now, 0.0) + autoscale.migration_seconds(kv, self.a))
        inst.version += 1
        self._release(inst)

    def _signals(self) -> tuple[PoolSignals, PoolSignals]:
        interval = self.a.interval_s
        p_online = sum(1 for p in self.prefill if p.status in (ONLINE, STARTING))
        d_online = sum(1 for d in self.decode if d.status in (ONLINE, STARTING))
        # prefill: uncached tokens/s; capacity = uncached tokens per predicted busy second of the interval's mix
        if self._interval_predicted_s > 0:
            cap = self._interval_uncached / self._interval_predicted_s
        else:
            chunk = self.c.prefill_chunk_tokens
            cap = chunk / (self.c.prefill_cost.step_cost([(chunk, 0)]) / 1e3)
        backlog = sum(p.queued_uncached for p in self.prefill if p.status != GONE)
        demand = self._interval_uncached / interval + backlog / interval
        peak = max(self._meter_prefill, default=0.0) + backlog / interval
        prefill = PoolSignals(demand=demand, capacity_per_instance=cap,
                              quota_use=peak / (max(p_online, 1) * cap))
        # decode: requests (running + waiting) against the batch that meets the TPOT SLO at their mean context
        snaps = self._meter_decode or [(0, 0)]
        reqs = sum(s[0] for s in snaps) / len(snaps)
        kv = sum(s[1] for s in snaps) / len(snaps)
        ctx = kv / reqs if reqs else 1024
        m = self.c.decode_cost
        per_instance = min(self.c.decode_max_seqs,
                           max(1.0, (self.c.slo_tpot_s * 1e3 - m.e) / (m.a + m.d + m.b * ctx)))
        kv_cap = self.c.decode_kv_capacity_tokens
        use = max(max(s[0] for s in snaps) / per_instance, max(s[1] for s in snaps) / kv_cap)
        decode = PoolSignals(demand=reqs, capacity_per_instance=per_instance, quota_use=use / max(d_online, 1),
                             kv_tokens=kv, kv_capacity_per_instance=kv_cap)
        return prefill, decode

    def on_autoscale(self) -> None:
        if not self._running():
            return
        prefill_sig, decode_sig = self._signals()
        for pool, sig, insts in ((autoscale.PREFILL, prefill_sig, self.prefill),
                                 (autoscale.DECODE, decode_sig, self.decode)):
            online = sum(1 for i in insts if i.status in (ONLINE, STARTING))
            history = self._targets[pool]
            dec = autoscale.decide(self.a, pool, sig, online, self.ready, history)
            history.append(dec.target)
            if dec.scale_in_blocked:
                self.blocked_scale_ins += 1
            if dec.add or dec.remove:
                self.scale_events.append({"t": round(self.now, 1), "pool": pool, "online": online,
                                          "add_ready": dec.add_from_ready_pool, "add_cold": dec.add_cold,
                                          "remove": dec.remove, "reason": dec.reason})
            self._apply(pool, dec)
        self._interval_uncached = self._interval_predicted_s = 0.0
        self._meter_prefill, self._meter_decode = [], []
        self.push(self.now + self.a.interval_s, _AUTOSCALE)

    def _apply(self, pool: str, dec: autoscale.ScaleDecision) -> None:
        self._account()
        for k in range(dec.add):
            warm = k < dec.add_from_ready_pool
            if warm:
                self.ready -= 1
                self.ready_refilling += 1           # the pool starts a replacement
                self.push(self.now + self.a.cold_start_s, _READY)
            if pool == autoscale.PREFILL:
                inst = PrefillInstance(len(self.prefill), STARTING)
                self.prefill.append(inst)
            else:
                inst = self._new_decode(STARTING)
            self.push(self.now + (self.a.warm_start_s if warm else self.a.cold_start_s), _ONLINE, pool, inst.idx)
        for _ in range(dec.remove):
            if pool == autoscale.PREFILL:
                live = [p for p in self.prefill if p.status in (ONLINE, STARTING)]
                victim = min(live, key=lambda p: (p.status == ONLINE, p.state.quota_load, -p.idx))
                victim.status = DRAINING
                if not victim.busy:
                    self._release(victim)
            else:
                live = [d for d in self.decode if d.status in (ONLINE, STARTING)]
                starting = [d for d in live if d.status == STARTING]
                if starting:                        # cancel a start before draining a working instance
                    self._release(starting[-1])
                    continue
                victim = self.decode[autoscale.pick_drain_victim({d.idx: d.reserved for d in live})]
                victim.status = DRAINING
                for req in list(victim.waiting):    # not started there: routed again at once
                    victim.waiting.remove(req)
                    self._send_to_decode(req, 0.0)
                drain = DecodeDrain(victim.idx, self.now, self.a.grace_period_s)
                self.push(drain.migrate_at, _MIGRATE, victim.idx)

    # ---- meters and timeline -----------------------------------------------------------------------------------
    def on_meter(self) -> None:
        if not self._running():
            return
        self._meter_prefill.append(self._uncached_in_window / self.c.meter_interval_s)
        self._uncached_in_window = 0.0
        live = [d for d in self.decode if d.status == ONLINE]
        self._meter_decode.append((sum(d.B + len(d.waiting) for d in live),
                                   sum(d.reserved + sum(r.prompt + r.generated + r.left for r in d.waiting)
                                       for d in live)))
        self.push(self.now + self.c.meter_interval_s, _METER)

    def on_sample(self) -> None:
        g = self.c.gpus_per_instance
        tl = self.timeline
        tl["t"].append(self.now)
        tl["prefill_gpus"].append(g * sum(1 for p in self.prefill if p.status != GONE))
        tl["decode_gpus"].append(g * sum(1 for d in self.decode if d.status != GONE))
        tl["ready_gpus"].append(g * (self.ready + self.ready_refilling))
        tl["prefill_online"].append(sum(1 for p in self.prefill if p.status == ONLINE))
        tl["decode_online"].append(sum(1 for d in self.decode if d.status == ONLINE))
        tl["arrival_rate"].append(self._arrivals_in_sample / self.c.sample_interval_s)
        tl["prefill_queue_tokens"].append(sum(p.queued_uncached for p in self.prefill if p.status != GONE))
        tl["decode_running"].append(sum(d.B for d in self.decode if d.status != GONE))
        self._arrivals_in_sample = 0
        if self._running():
            self.push(self.now + self.c.sample_interval_s, _SAMPLE)

    # ---- results ------------------------------------------------------------------------------------------------
    def summary(self) -> dict:
        reqs = self.requests
        done = [r for r in reqs if r.finish is not None and not r.dropped]
        dropped = sum(r.dropped for r in reqs)
        ttft = np.array([r.first_token - r.arrival for r in done])
        tpot = np.array([(r.finish - r.first_token) / (r.output - 1) for r in done])
        queue = np.array([r.prefill_start - r.arrival for r in done])
        decode_wait = np.array([r.decode_start - r.decode_arrival for r in done if r.decode_start is not None])
        ok = int(np.sum((ttft <= self.c.slo_ttft_s) & (tpot <= self.c.slo_tpot_s))) if done else 0
        hours = {k: v / 3600 for k, v in self.gpu_s.items()}
        prompt_tokens = sum(r.prompt for r in reqs)

        def pct(x, p):
            return round(float(np.percentile(x, p)) * 1e3, 2) if len(x) else None

        span = max(self.now, 1e-9)
        return {
            "requests": len(reqs), "finished": len(done), "dropped": int(dropped),
            "unfinished": len(reqs) - len(done) - int(dropped),
            "conversations": len(self.convs),
            "slo_ttft_ms": self.c.slo_ttft_s * 1e3, "slo_tpot_ms": self.c.slo_tpot_s * 1e3,
            "slo_attainment": round(ok / len(reqs), 4) if reqs else None,
            "ttft_ms_p50": pct(ttft, 50), "ttft_ms_p99": pct(ttft, 99),
            "tpot_ms_p50": pct(tpot, 50), "tpot_ms_p99": pct(tpot, 99),
            "queue_ms_p50": pct(queue, 50), "queue_ms_p99": pct(queue, 99),
            "decode_wait_ms_p50": pct(decode_wait, 50), "decode_wait_ms_p99": pct(decode_wait, 99),
            "prefix_hit_rate": round(sum(r.cached for r in reqs) / prompt_tokens, 4) if prompt_tokens else 0.0,
            "uncached_prompt_tokens": int(sum(r.prompt - r.cached for r in reqs)),
            "output_tokens": int(sum(r.output for r in done)),
            "gpu_hours_prefill": round(hours["prefill"], 3), "gpu_hours_decode": round(hours["decode"], 3),
            "gpu_hours_ready_pool": round(hours["ready_pool"], 3),
            "gpu_hours_total": round(sum(hours.values()), 3),
            "mean_prefill_gpus": round(self.gpu_s["prefill"] / span, 2),
            "mean_decode_gpus": round(self.gpu_s["decode"] / span, 2),
            "peak_prefill_gpus": max(self.timeline["prefill_gpus"], default=0),
            "peak_decode_gpus": max(self.timeline["decode_gpus"], default=0),
            "pd_ratio_gpu_hours": round(hours["prefill"] / hours["decode"], 3) if hours["decode"] else None,
            "scale_events": len(self.scale_events), "blocked_scale_ins": self.blocked_scale_ins,
            "migrated_requests": self.migrated_requests,
            "migrated_kv_gb": round(self.migrated_kv_tokens * self.c.kv_bytes_per_token / 1e9, 3),
            "simulated_s": round(self.now, 1),
        }


def simulate(workload: WorkloadConfig, cluster: ClusterConfig) -> SimResult:
    return Simulator(workload, cluster).run()


def compare(workload: WorkloadConfig, static: ClusterConfig, autoscaled: ClusterConfig) -> dict:
    """Static vs autoscaled on the same trace: both summaries and timelines."""
    return {"static": simulate(workload, static), "autoscale": simulate(workload, autoscaled)}


def coefficients(cluster: ClusterConfig) -> dict:
    return {"prefill_ms": asdict(cluster.prefill_cost), "decode_ms": asdict(cluster.decode_cost),
            "prefill_samples": [[s, ms] for s, ms in H200_LLAMA8B_PREFILL_SAMPLES],
            "decode_steps": [list(r) for r in H200_LLAMA8B_DECODE_STEPS],
            "decode_ms_per_kv_token": H200_DECODE_MS_PER_KV_TOKEN,
            "decode_kv_capacity_tokens": cluster.decode_kv_capacity_tokens,
            "kv_bytes_per_token": cluster.kv_bytes_per_token}


__all__ = ["WorkloadConfig", "ClusterConfig", "Simulator", "SimResult", "simulate", "compare", "coefficients",
           "make_conversations", "h200_llama8b_prefill_cost", "h200_llama8b_decode_cost"]


# ---- results on disk ------------------------------------------------------------------------------------------
def write_plots(prefix: str, runs: dict[str, SimResult]) -> list[str]:
    """`{prefix}_gpus.png` (arrival rate, prefill and decode GPUs over time, per run) and `{prefix}_latency.png`
    (TTFT and TPOT distributions per run), drawn with matplotlib; returns the paths written."""
    from openinfer.tools.plots import pyplot

    plt = pyplot()
    first = next(iter(runs.values()))
    hours = lambda tl: [t / 3600 for t in tl["t"]]          # noqa: E731
    fig, axes = plt.subplots(3, 1, figsize=(9, 7.2), sharex=True, layout="constrained")
    axes[0].plot(hours(first.timeline), first.timeline["arrival_rate"], label="arrivals")
    axes[0].set_title("arrival rate (requests/s)")
    for ax, key, title in ((axes[1], "prefill_gpus", "prefill GPUs held"),
                           (axes[2], "decode_gpus", "decode GPUs held (ready pool not included)")):
        for name, r in runs.items():
            ax.plot(hours(r.timeline), r.timeline[key], label=name)
        ax.set_title(title)
    axes[2].set_xlabel("simulated hours")
    for ax in axes:
        ax.set_ylim(bottom=0)
        ax.legend(loc="upper right")
    paths = [f"{prefix}_gpus.png"]
    fig.savefig(paths[0], dpi=100)
    plt.close(fig)
    fig, axes = plt.subplots(2, 1, figsize=(9, 4.8), layout="constrained")
    for ax, (title, value) in zip(axes, (
            ("TTFT CDF (fraction of requests)", lambda r: r.first_token - r.arrival),
            ("TPOT CDF (fraction of requests)", lambda r: (r.finish - r.first_token) / (r.output - 1)))):
        for name, res in runs.items():
            ms = np.sort([value(r) * 1e3 for r in res.requests if r.finish is not None and not r.dropped])
            if len(ms):
                ax.plot(ms, np.arange(1, len(ms) + 1) / len(ms), label=name)
        ax.set_xscale("log")
        ax.set_title(title)
        ax.set_xlabel("ms (log scale)")
        ax.legend(loc="lower right")
    paths.append(f"{prefix}_latency.png")
    fig.savefig(paths[1], dpi=100)
    plt.close(fig)
    return paths


def _downsample(timeline: dict, points: int = 400) -> dict:
    step = max(1, len(timeline["t"]) // points)
    return {k: v[::step] for k, v in timeline.items()}


def results_payload(workload: WorkloadConfig, clusters: dict[str, ClusterConfig], runs: dict[str, SimResult],
                    commit: str | None, date: str) -> dict:
    first = next(iter(clusters.values()))
    return {"benchmark": "openinfer simulate", "date": date, "commit": commit,
            "note": "simulated from single-GPU H200 measurements (BENCHMARKS.md), not measured on a cluster",
            "coefficients": coefficients(first), "workload": asdict(workload),
            "runs": {name: {"cluster": {k: v for k, v in asdict(clusters[name]).items()
                                        if k not in ("prefill_cost", "decode_cost")},
                            "summary": res.summary,
                            "timeline": _downsample(res.timeline)}
                     for name, res in runs.items()}}
