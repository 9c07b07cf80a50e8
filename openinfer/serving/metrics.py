"""Prometheus metrics in the spirit of vLLM's names (`openinfer:` prefix).

Two kinds of series:
- the engine core's own numbers (requests running and waiting, KV blocks, prefix-cache and store counters, its
  steps and their time, preemptions; /load's signals; the server's role) are read from the engine's `stats()`
  when scraped (`CoreStatsCollector`): an engine core in its own process sends its stats with every step, so they
  are current even when no step runs (e.g. after the last request was aborted), and the counters are the core's
  own totals, the same whichever API server is asked;
- per-request series (tokens generated, finished requests, latencies, speculative-decoding tokens, aborts) are
  counted where the request's outputs arrive: `observe_outputs` after each step, `observe_abort` when the server
  stops a request (client disconnect, request timeout).

With several API servers over one core (`--api-server-count`, serving/api_servers.py) each counts the requests it
served; given `multiprocess_dir`, their per-request series are written there by prometheus_client's multiprocess
mode (PROMETHEUS_MULTIPROC_DIR, set in each API server before prometheus_client is imported) and `render` sums
them over every API server, beside the core's numbers of this one."""

from __future__ import annotations

import os
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest, values
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from openinfer.engine.llm_engine import LLMEngine
from openinfer.outputs import RequestOutput

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0)

# (name, help, read from stats)
_CORE_GAUGES = (
    ("openinfer:num_requests_running", "Requests in the running batch.", lambda st: st["num_running"]),
    ("openinfer:num_requests_waiting", "Requests waiting for a seat.", lambda st: st["num_waiting"]),
    ("openinfer:kv_cache_usage_perc", "Fraction of KV blocks in use (0-1).", lambda st: st["kv_usage"]),
    ("openinfer:kv_cache_blocks_in_use", "KV blocks held by requests (0 when idle: else a leak).",
     lambda st: st["kv_blocks_total"] - st["kv_blocks_free"]),
    ("openinfer:prefix_cache_hit_rate", "Prefix-cache hit rate (tokens).", lambda st: st["prefix_cache_hit_rate"]))
# (name, help, stats key): the core's totals since it started (warm-up leaves them at zero)
_CORE_COUNTERS = (
    ("openinfer:prefix_cache_queries", "Prompt tokens looked up.", "prefix_cache_queried_tokens"),
    ("openinfer:prefix_cache_hits", "Prompt tokens found cached.", "prefix_cache_hit_tokens"),
    ("openinfer:num_preemptions", "Requests preempted (recompute).", "num_preemptions"),
    # the engine's own view of its loop (beside what clients measure): steps, their host wall time, and the steps
    # that ran prefill chunks
    ("openinfer:engine_steps", "Engine steps run.", "num_steps"),
    ("openinfer:engine_step_seconds", "Host wall time inside engine steps (with async scheduling a step waits for "
     "the one before it on the device).", "step_time_s"),
    ("openinfer:engine_prefill_steps", "Engine steps that ran a prefill chunk.", "num_prefill_steps"))
# prefix-KV store (docs/kv_cache.md): per tier
_KV_STORE_COUNTERS = (
    ("hits", "openinfer:kv_store_hits", "Prefix-KV store: blocks found, per tier."),
    ("misses", "openinfer:kv_store_misses", "Prefix-KV store: blocks looked up and not found (corrupt, truncated "
     "and expired entries included), per tier."),
    ("bytes_read", "openinfer:kv_store_read_bytes", "Prefix-KV store: block bytes read, per tier."),
    ("bytes_written", "openinfer:kv_store_written_bytes", "Prefix-KV store: bytes written, per tier."),
    ("faults", "openinfer:kv_store_faults", "Prefix-KV store: tier errors (unwritable or full directory, Redis down "
     "or slow); the engine recomputes instead."))
# sliding-window models with a store (kv_cache/bounded_replay.py): how prefix hits got their window rows
_SWA_COUNTERS = (
    ("openinfer:swa_state_hits", "Prefix hits whose window state came from host memory.", "swa_state_hits"),
    ("openinfer:swa_replays", "Prefix hits that replayed the end of their prefix (window state missing).",
     "swa_replays"),
    ("openinfer:swa_replayed_tokens", "Tokens recomputed by those replays.", "swa_replayed_tokens"))
# /load's signals (serving/load.py): (key, name, help)
_LOAD_GAUGES = (
    ("kv_tokens", "openinfer:kv_tokens", "Tokens whose KV the unfinished requests hold."),
    ("prefill_tokens_queued", "openinfer:prefill_tokens_queued", "Prompt tokens of unfinished requests not "
     "computed yet (uncached prefill work)."),
    ("busy_fraction", "openinfer:engine_busy_fraction", "Fraction of the last window the engine thread spent in "
     "steps (the router's compute-quota proxy)."))


class CoreStatsCollector:
    """The engine core's numbers, from one `stats()` per scrape: gauges, its counters (totals as the core counts
    them), the prefix-KV store's and window-state counters when it has them, /load's signals and the role."""

    def __init__(self, model_name: str, stat: Callable[[], dict]):
        self.model, self.stat = model_name, stat
        self.load: Callable[[], dict] | None = None
        self.role: str | None = None

    def collect(self):
        st, m = self.stat(), self.model
        for name, doc, read in _CORE_GAUGES:
            yield _one(GaugeMetricFamily(name, doc, labels=["model_name"]), [m], read(st))
        counters = list(_CORE_COUNTERS) + [c for c in _SWA_COUNTERS if c[2] in st]
        for name, doc, key in counters:
            yield _one(CounterMetricFamily(name, doc, labels=["model_name"]), [m], st[key])
        if "kv_store_tiers" in st:
            tiers = dict(st["kv_store_tiers"])
            if st.get("swa_state_tier") is not None:
                tiers["swa_state"] = st["swa_state_tier"]
            for key, name, doc in _KV_STORE_COUNTERS:
                family = CounterMetricFamily(name, doc, labels=["model_name", "tier"])
                for tier, counts in tiers.items():
                    family.add_metric([m, tier], counts[key])
                yield family
            yield _one(CounterMetricFamily("openinfer:kv_store_dropped_writes", "Prefix-KV store: block writes "
                                           "dropped because the writer was behind.", labels=["model_name"]),
                       [m], st["kv_store_dropped_writes"])
        if self.load is not None:
            load = self.load()
            for key, name, doc in _LOAD_GAUGES:
                yield _one(GaugeMetricFamily(name, doc, labels=["model_name"]), [m], load[key])
        if self.role is not None:
            yield _one(GaugeMetricFamily("openinfer:server_role", "1, labelled by this server's role (prefill, "
                                         "decode or both).", labels=["model_name", "role"]), [m, self.role], 1)


def _one(family, labels: list[str], value):
    family.add_metric(labels, value)
    return family


class EngineMetrics:
    def __init__(self, model_name: str, engine: LLMEngine, multiprocess_dir: str | None = None):
        if multiprocess_dir is not None and (values.ValueClass is values.MutexValue or
                                             os.environ.get("PROMETHEUS_MULTIPROC_DIR") != multiprocess_dir):
            raise RuntimeError(f"per-request metrics summed over API servers need PROMETHEUS_MULTIPROC_DIR="
                               f"{multiprocess_dir} set before prometheus_client is imported")
        self.multiprocess_dir = multiprocess_dir
        self.registry = CollectorRegistry()    # every series of this process
        self.live = CollectorRegistry()        # those read from the core at scrape time (the same in every process)
        # one process, an engine core's client (its stats as of the core's last step), or the multi-process front
        # end (its last step's numbers)
        self.core = CoreStatsCollector(model_name, engine.stats)
        collectors = [self.core] + ([ExpertLoadCollector(model_name, engine.stats)] if "moe_lb" in engine.stats()
                                    else [])
        for collector in collectors:
            self.registry.register(collector)
            self.live.register(collector)
        label = {"labelnames": ["model_name"], "registry": self.registry}
        self.prompt_tokens = Counter("openinfer:prompt_tokens", "Prompt tokens of finished requests.", **label)
        self.generation_tokens = Counter("openinfer:generation_tokens", "Generated tokens.", **label)
        self.draft_tokens = Counter("openinfer:spec_decode_num_draft_tokens", "Speculative decoding: draft "
                                    "tokens verified (finished requests).", **label)
        self.accepted_tokens = Counter("openinfer:spec_decode_num_accepted_tokens", "Speculative decoding: "
                                       "draft tokens the target kept (finished requests).", **label)
        self.success = Counter("openinfer:request_success", "Finished requests.",
                               labelnames=["model_name", "finished_reason"], registry=self.registry)
        self.aborted = Counter("openinfer:request_aborted", "Requests the server stopped: reason is "
                               "client_disconnect (the HTTP client hung up) or timeout (--request-timeout).",
                               labelnames=["model_name", "reason"], registry=self.registry)
        hist = {"labelnames": ["model_name"], "registry": self.registry, "buckets": _LATENCY_BUCKETS}
        self.ttft = Histogram("openinfer:time_to_first_token_seconds", "Time to first token.", **hist)
        self.tpot = Histogram("openinfer:time_per_output_token_seconds", "Mean time per output token "
                              "after the first, per request.", **hist)
        self.e2e = Histogram("openinfer:e2e_request_latency_seconds", "Arrival to finish.", **hist)
        self.queue = Histogram("openinfer:request_queue_time_seconds", "Arrival to first scheduled (time waiting "
                               "for a seat).", **hist)
        self.model = model_name
        for series in (self.generation_tokens, self.queue):
            series.labels(model_name)          # at 0 from the start: a scrape before any step reads them too
        self._num_out: dict[str, int] = {}

    def add_load_gauges(self, load: Callable[[], dict], role: str) -> None:
        """The load signals the router reads from `GET /load` (serving/load.py), as gauges read at scrape time,
        and the server's role (prefill | decode | both) as a constant 1 labelled by it."""
        self.core.load, self.core.role = load, role

    def render(self) -> bytes:
        """The exposition text of /metrics: this process's series, or with several API servers their per-request
        series summed (prometheus_client's multiprocess collector over their directory) and the core's numbers."""
        if self.multiprocess_dir is None:
            return generate_latest(self.registry)
        from prometheus_client.multiprocess import MultiProcessCollector

        summed = CollectorRegistry()
        MultiProcessCollector(summed, path=self.multiprocess_dir)
        return generate_latest(summed) + generate_latest(self.live)

    def observe_abort(self, reason: str) -> None:
        self.aborted.labels(self.model, reason).inc()

    def observe_outputs(self, outputs: list[RequestOutput]) -> None:
        """A step's outputs (those of this process's requests): tokens generated, and the finished requests."""
        m = self.model
        for out in outputs:
            n_new = sum(len(c.token_ids) for c in out.outputs)     # (n > 1: every sequence's new tokens)
            self.generation_tokens.labels(m).inc(n_new)
            total = self._num_out[out.request_id] = self._num_out.get(out.request_id, 0) + n_new
            if out.finished:
                self._num_out.pop(out.request_id, None)
                self.observe_finished(out, total)

    def observe_finished(self, out: RequestOutput, num_output_tokens: int) -> None:
        m, mt = self.model, out.metrics
        self.prompt_tokens.labels(m).inc(len(out.prompt_token_ids))
        self.success.labels(m, out.outputs[0].finish_reason or "abort").inc()
        if mt is None:
            return
        if mt.num_draft_tokens:
            self.draft_tokens.labels(m).inc(mt.num_draft_tokens)
            self.accepted_tokens.labels(m).inc(mt.num_accepted_tokens)
        if mt.finished_time is None:
            return
        self.e2e.labels(m).observe(mt.finished_time - mt.arrival_time)
        if mt.first_scheduled_time is not None:
            self.queue.labels(m).observe(mt.first_scheduled_time - mt.arrival_time)
        if mt.first_token_time is not None:
            self.ttft.labels(m).observe(mt.first_token_time - mt.arrival_time)
            if num_output_tokens > 1:
                self.tpot.labels(m).observe((mt.finished_time - mt.first_token_time) / (num_output_tokens - 1))


class ExpertLoadCollector:
    """Expert parallelism's load, from one `stats()` per scrape (the engine's live EPLB window: every step counts,
    before and between rebalances): `openinfer:moe_lb`, tokens on the busiest EP rank / the mean (1 = balanced;
    NaN before the first step); the tokens each EP rank computes (`ep_rank` label) and each logical expert drew
    (`expert` label), over the window's steps and summed over MoE layers; the rebalances so far."""

    def __init__(self, model_name: str, stat: Callable[[], dict]):
        self.model, self.stat = model_name, stat

    def collect(self):
        st, m = self.stat(), self.model
        lb = GaugeMetricFamily("openinfer:moe_lb", "Expert parallelism: tokens on the busiest EP rank / the mean "
                               "over the EPLB window (1 = balanced; NaN before the first step).", labels=["model_name"])
        lb.add_metric([m], st["moe_lb"])
        ranks = GaugeMetricFamily("openinfer:moe_rank_load", "Expert parallelism: tokens each EP rank computes over "
                                  "the EPLB window, under the current placement (summed over MoE layers).",
                                  labels=["model_name", "ep_rank"])
        for r, v in enumerate(st["moe_rank_load"]):
            ranks.add_metric([m, str(r)], v)
        experts = GaugeMetricFamily("openinfer:moe_expert_load", "Expert parallelism: tokens each logical expert "
                                    "drew over the EPLB window (summed over MoE layers).",
                                    labels=["model_name", "expert"])
        for e, v in enumerate(st["moe_expert_load"]):
            experts.add_metric([m, str(e)], v)
        moves = CounterMetricFamily("openinfer:eplb_rebalances", "Expert parallelism: EPLB placements adopted "
                                    "(experts moved).", labels=["model_name"])
        moves.add_metric([m], st["eplb_rebalances"])
        yield from (lb, ranks, experts, moves)
