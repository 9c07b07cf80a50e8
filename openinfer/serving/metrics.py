"""Prometheus metrics in the spirit of vLLM's names (`openinfer:` prefix).

Gauges are read from the engine at scrape time (so they are current even when no step runs, e.g. after the
last request was aborted); counters and histograms are updated by the engine thread after each step, and
aborts by the server when it stops a request (client disconnect, request timeout)."""

from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from openinfer.engine.llm_engine import LLMEngine
from openinfer.outputs import RequestOutput

_LATENCY_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                    20.0, 40.0, 80.0, 160.0)


class EngineMetrics:
    def __init__(self, model_name: str, engine: LLMEngine):
        self.registry = CollectorRegistry()
        label = {"labelnames": ["model_name"], "registry": self.registry}
        stat = engine.stats    # one process, or the multi-process front end (its last step's numbers)
        gauges = [("openinfer:num_requests_running", "Requests in the running batch.", lambda: stat()["num_running"]),
                  ("openinfer:num_requests_waiting", "Requests waiting for a seat.", lambda: stat()["num_waiting"]),
                  ("openinfer:kv_cache_usage_perc", "Fraction of KV blocks in use (0-1).", lambda: stat()["kv_usage"]),
                  ("openinfer:kv_cache_blocks_in_use", "KV blocks held by requests (0 when idle: else a leak).",
                   lambda: stat()["kv_blocks_total"] - stat()["kv_blocks_free"]),
                  ("openinfer:prefix_cache_hit_rate", "Prefix-cache hit rate (tokens).",
                   lambda: stat()["prefix_cache_hit_rate"])]
        for name, doc, read in gauges:
            Gauge(name, doc, **label).labels(model_name).set_function(read)
        if "moe_lb" in stat():
            self.registry.register(ExpertLoadCollector(model_name, stat))
        self.prefix_queries = Counter("openinfer:prefix_cache_queries", "Prompt tokens looked up.", **label)
        self.prefix_hits = Counter("openinfer:prefix_cache_hits", "Prompt tokens found cached.", **label)
        self.preemptions = Counter("openinfer:num_preemptions", "Requests preempted (recompute).", **label)
        # the engine's own view of its loop (beside what clients measure): steps, their host wall time, and the
        # steps that ran prefill chunks
        self.steps = Counter("openinfer:engine_steps", "Engine steps run.", **label)
        self.step_seconds = Counter("openinfer:engine_step_seconds", "Host wall time inside engine steps (with "
                                    "async scheduling a step waits for the one before it on the device).", **label)
        self.prefill_steps = Counter("openinfer:engine_prefill_steps", "Engine steps that ran a prefill chunk.",
                                     **label)
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
        for series in (self.steps, self.step_seconds, self.prefill_steps, self.generation_tokens, self.queue):
            series.labels(model_name)          # at 0 from the start: a scrape before any step reads them too
        self._seen = {"preemptions": 0, "queries": 0, "hits": 0}
        st = stat()
        self._seen.update(steps=st["num_steps"], step_seconds=st["step_time_s"], prefill_steps=st["num_prefill_steps"])
        # prefix-KV store (docs/kv_cache.md): per tier, what the engine's stats() count since start
        self.kv_store = {}
        if "kv_store_tiers" in stat():
            tier = {"labelnames": ["model_name", "tier"], "registry": self.registry}
            self.kv_store = {key: Counter(name, doc, **tier) for key, name, doc in (
                ("hits", "openinfer:kv_store_hits", "Prefix-KV store: blocks found, per tier."),
                ("misses", "openinfer:kv_store_misses", "Prefix-KV store: blocks looked up and not found (corrupt, "
                 "truncated and expired entries included), per tier."),
                ("bytes_read", "openinfer:kv_store_read_bytes", "Prefix-KV store: block bytes read, per tier."),
                ("bytes_written", "openinfer:kv_store_written_bytes", "Prefix-KV store: bytes written, per tier."),
                ("faults", "openinfer:kv_store_faults", "Prefix-KV store: tier errors (unwritable or full "
                 "directory, Redis down or slow); the engine recomputes instead."))}
            self.kv_store_dropped = Counter("openinfer:kv_store_dropped_writes", "Prefix-KV store: block writes "
                                            "dropped because the writer was behind.", **label)
        # sliding-window models with a store (kv_cache/bounded_replay.py): the window-state tier is exported as
        # tier="swa_state" above; how prefix hits got their window rows
        self.swa = {}
        if "swa_replays" in stat():
            self.swa = {key: Counter(name, doc, **label) for key, name, doc in (
                ("swa_state_hits", "openinfer:swa_state_hits", "Prefix hits whose window state came from host "
                 "memory."),
                ("swa_replays", "openinfer:swa_replays", "Prefix hits that replayed the end of their prefix (window "
                 "state missing)."),
                ("swa_replayed_tokens", "openinfer:swa_replayed_tokens", "Tokens recomputed by those replays."))}
        self._num_out: dict[str, int] = {}

    def add_load_gauges(self, load: Callable[[], dict], role: str) -> None:
        """The load signals the router reads from `GET /load` (serving/load.py), as gauges read at scrape time,
        and the server's role (prefill | decode | both) as a constant 1 labelled by it."""
        for key, name, doc in (
                ("kv_tokens", "openinfer:kv_tokens", "Tokens whose KV the unfinished requests hold."),
                ("prefill_tokens_queued", "openinfer:prefill_tokens_queued", "Prompt tokens of unfinished "
                 "requests not computed yet (uncached prefill work)."),
                ("busy_fraction", "openinfer:engine_busy_fraction", "Fraction of the last window the engine "
                 "thread spent in steps (the router's compute-quota proxy).")):
            Gauge(name, doc, labelnames=["model_name"], registry=self.registry).labels(self.model).set_function(
                lambda key=key: load()[key])
        Gauge("openinfer:server_role", "1, labelled by this server's role (prefill, decode or both).",
              labelnames=["model_name", "role"], registry=self.registry).labels(self.model, role).set(1)

    def observe_abort(self, reason: str) -> None:
        self.aborted.labels(self.model, reason).inc()

    def observe_step(self, engine: LLMEngine, outputs: list[RequestOutput]) -> None:
        m, st = self.model, engine.stats()
        for key, counter, value in (("preemptions", self.preemptions, st["num_preemptions"]),
                                    ("steps", self.steps, st["num_steps"]),
                                    ("step_seconds", self.step_seconds, st["step_time_s"]),
                                    ("prefill_steps", self.prefill_steps, st["num_prefill_steps"]),
                                    ("queries", self.prefix_queries, st["prefix_cache_queried_tokens"]),
                                    ("hits", self.prefix_hits, st["prefix_cache_hit_tokens"])):
            counter.labels(m).inc(max(value - self._seen[key], 0))
            self._seen[key] = value
        if self.kv_store:
            tiers = dict(st["kv_store_tiers"])
            if st.get("swa_state_tier") is not None:
                tiers["swa_state"] = st["swa_state_tier"]
            for name, counts in tiers.items():
                for key, counter in self.kv_store.items():
                    seen = self._seen.get((name, key), 0)
                    counter.labels(m, name).inc(max(counts[key] - seen, 0))
                    self._seen[(name, key)] = counts[key]
            dropped = st["kv_store_dropped_writes"]
            self.kv_store_dropped.labels(m).inc(max(dropped - self._seen.get("dropped", 0), 0))
            self._seen["dropped"] = dropped
        for key, counter in self.swa.items():
            counter.labels(m).inc(max(st[key] - self._seen.get(key, 0), 0))
            self._seen[key] = st[key]
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
