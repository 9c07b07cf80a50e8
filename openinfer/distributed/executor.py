"""MultiprocEngine: one front-end object over one worker process per rank.

The front end (in the caller's process: `LLM`, the server) keeps the tokenizer, validates requests, assigns
each to a data-parallel group and forwards it to that group's ranks; every `step()` steps all ranks once and
collects what their drivers (TP rank 0) report. A worker is an `LLMEngine` for its rank (`worker.py`).

Why one step for all ranks: MoE layers with expert parallelism exchange tokens between ranks, so every rank
runs a forward whenever any rank has work (an idle rank runs a padding row, see `step_sync.py`); TP ranks run
the same schedule (they receive the same commands in the same order and schedule deterministically).

Lifecycle: workers start before anything loads, report `ready` (or the error, naming the rank), and stop on
`shutdown()`, on the front end's exit (a finalizer) and on its death (the kernel's parent-death signal on
Linux, and a closed pipe elsewhere), so no orphans are left after an exception, Ctrl-C or SIGTERM. A worker
that dies is reported as an error naming its rank and exit code, never a hang.
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import multiprocessing.connection as mpc
import socket
import time
import weakref

from openinfer.config import EngineConfig
from openinfer.engine.llm_engine import LLMEngine
from openinfer.loader.model_source import resolve_model_dir
from openinfer.outputs import RequestOutput
from openinfer.sampling_params import SamplingParams
from openinfer.tokenizer import Tokenizer

_START_TIMEOUT_S = 1800.0     # loading a 150 GB checkpoint takes minutes
_STEP_TIMEOUT_S = 600.0
_SUM_STATS = ("num_running", "num_waiting", "kv_blocks_total", "kv_blocks_free", "prefix_cache_hit_tokens",
              "prefix_cache_queried_tokens", "num_preemptions")


class WorkerError(RuntimeError):
    """A worker process failed or died; the message names its rank."""


def free_local_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MultiprocEngine:
    """The `LLMEngine` interface over `config.world_size` worker processes."""

    is_multiprocess = True

    def __init__(self, config: EngineConfig):
        from openinfer.distributed.layout import check_layout
        from openinfer.distributed.worker import worker_main

        self.config = config
        self.requests: dict[str, int] = {}        # live request id -> DP group
        self._prompts: dict[str, tuple] = {}        # live request id -> (prompt token ids, prompt text)
        self.model_dir = resolve_model_dir(config.model, config.cache_path)   # fetch/convert once, here
        check_layout(config, self.model_dir)          # before any worker starts loading
        self.tokenizer = Tokenizer.from_dir(self.model_dir)
        init_method = config.distributed_init_method or f"tcp://127.0.0.1:{free_local_port()}"
        ctx = mp.get_context("spawn")
        self._procs, self._conns = [], []
        for rank in range(config.world_size):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=worker_main, args=(config, rank, init_method, child),
                            name=f"openinfer-rank{rank}", daemon=True)
            p.start()
            child.close()
            self._procs.append(p)
            self._conns.append(parent)
        self._finalizer = weakref.finalize(self, _stop_workers, self._procs, self._conns)
        try:
            infos = self._gather_replies(range(config.world_size), _START_TIMEOUT_S, "start")
        except BaseException:
            self.shutdown()
            raise
        info = infos[0]
        self.model_config, self.max_model_len = info["model_config"], info["max_model_len"]
        self.kv_blocks_per_rank = info["num_blocks"]
        tp = config.tensor_parallel_size
        self._groups = [list(range(d * tp, (d + 1) * tp)) for d in range(config.data_parallel_size)]
        self._ids = itertools.count()
        self._rank_busy = [False] * config.world_size
        self._rank_stats: list[dict] = [info["stats"] for info in infos]
        self._structured = None

    # ---- requests ---------------------------------------------------------------------------------------
    validate_prompt = LLMEngine.validate_prompt

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, prompt: str | None = None,
                    request_id: str | None = None, arrival_time: float | None = None) -> str:
        """Validate here (the workers only see valid requests), pick the DP group with the fewest live
        requests (then the most free KV blocks), and send the request to each of its ranks."""
        self._check_alive()
        if request_id is None:
            request_id = str(next(self._ids))
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        self.validate_prompt(prompt_token_ids)
        if params.structured_outputs is not None:   # a bad grammar fails here, not on a worker
            self.structured_output.pool.compile_blocking(params.structured_outputs)
        load = [0] * len(self._groups)
        for g in self.requests.values():
            load[g] += 1
        group = min(range(len(self._groups)),
                    key=lambda g: (load[g], -self._rank_stats[self._groups[g][0]].get("kv_blocks_free", 0), g))
        msg = ("add", dict(prompt_token_ids=list(prompt_token_ids), params=params, prompt=prompt,
                           request_id=request_id, arrival_time=arrival_time or time.time()))
        for rank in self._groups[group]:
            self._send(rank, msg)
        self.requests[request_id] = group
        self._prompts[request_id] = (prompt_token_ids, prompt)
        return request_id

    def abort_request(self, request_id: str) -> None:
        """Stop a request on its ranks now (their blocks are freed before their next step)."""
        group = self.requests.pop(request_id, None)
        self._prompts.pop(request_id, None)
        if group is not None:
            for rank in self._groups[group]:
                self._send(rank, ("abort", request_id))

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or any(self._rank_busy)

    def step(self) -> list[RequestOutput]:
        """Step every rank once; outputs come from each DP group's driver rank."""
        self._check_alive()
        ranks = range(self.config.world_size)
        for rank in ranks:
            self._send(rank, ("step",))
        replies = self._gather_replies(ranks, _STEP_TIMEOUT_S, "step")
        outputs = []
        for rank, (outs, busy, stats) in enumerate(replies):
            self._rank_busy[rank], self._rank_stats[rank] = busy, stats
            for out in outs:
                # workers leave the prompt out of their outputs (it would cross the pipe every step)
                known = self._prompts.pop(out.request_id, None) if out.finished else self._prompts.get(out.request_id)
                if out.finished:
                    self.requests.pop(out.request_id, None)
                if known is not None:
                    out.prompt_token_ids, out.prompt = known
                outputs.append(out)
        return outputs

    # ---- the rest of the engine interface ---------------------------------------------------------------
    @property
    def structured_output(self):
        """A grammar compiler here, to reject bad grammars before a request reaches the workers (each worker
        compiles again for its own masks, from its cache after the first time)."""
        if self._structured is None:
            self._structured = LLMEngine._make_structured_output(self)
        return self._structured

    def stats(self) -> dict:
        """Summed over DP groups (each group's driver), usage over the whole pool; `moe_lb` from rank 0."""
        drivers = [self._rank_stats[g[0]] for g in self._groups]
        out = {k: sum(s.get(k, 0) for s in drivers) for k in _SUM_STATS}
        used = out["kv_blocks_total"] - out["kv_blocks_free"]
        out["kv_usage"] = used / out["kv_blocks_total"] if out["kv_blocks_total"] else 0.0
        q = out["prefix_cache_queried_tokens"]
        out["prefix_cache_hit_rate"] = out["prefix_cache_hit_tokens"] / q if q else 0.0
        for k in ("moe_lb", "eplb_rebalances"):
            if k in self._rank_stats[0]:
                out[k] = self._rank_stats[0][k]
        out["per_rank"] = [dict(s) for s in self._rank_stats]
        return out

    def touch_cache_pages(self) -> None:
        for rank in range(self.config.world_size):
            self._send(rank, ("touch",))
        self._gather_replies(range(self.config.world_size), _START_TIMEOUT_S, "touch")

    def call_ranks(self, method: str, *args) -> list:
        """Run `LLMEngine.<method>(*args)` on every rank (tests, benchmarks); returns each rank's result."""
        ranks = range(self.config.world_size)
        for rank in ranks:
            self._send(rank, ("call", method, args))
        return self._gather_replies(ranks, _STEP_TIMEOUT_S, method)

    def shutdown(self) -> None:
        """Stop every worker (politely, then by force) and free their GPUs. Idempotent."""
        self.requests.clear()
        self._prompts.clear()
        self._finalizer()

    # ---- transport --------------------------------------------------------------------------------------
    def _send(self, rank: int, msg) -> None:
        try:
            self._conns[rank].send(msg)
        except (BrokenPipeError, OSError, EOFError):
            self._fail(rank, "its pipe closed")

    def _gather_replies(self, ranks, timeout_s: float, what: str) -> list:
        pending = {self._conns[r]: r for r in ranks}
        sentinels = {self._procs[r].sentinel: r for r in ranks}
        replies: dict[int, object] = {}
        deadline = time.monotonic() + timeout_s
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                self._fail(next(iter(pending.values())), f"no reply to {what!r} within {timeout_s:g} s")
            for ready in mpc.wait([*pending, *sentinels], timeout=left):
                rank = pending.get(ready, sentinels.get(ready))
                conn = self._conns[rank]
                if conn not in pending:
                    continue                     # exited after replying (shutdown)
                if ready is not conn and not conn.poll():
                    self._fail(rank, f"died (exit code {self._procs[rank].exitcode}) during {what!r}")
                try:
                    kind, payload = conn.recv()
                except (EOFError, OSError):
                    self._fail(rank, f"died (exit code {self._procs[rank].exitcode}) during {what!r}")
                if kind == "error":
                    self._fail(rank, f"raised during {what!r}:\n{payload}")
                replies[rank] = payload
                del pending[conn]
        return [replies[r] for r in ranks]

    def _check_alive(self) -> None:
        if not self._finalizer.alive:
            raise RuntimeError("this engine was shut down; create a new one")
        for rank, p in enumerate(self._procs):
            if not p.is_alive():
                self._fail(rank, f"died (exit code {p.exitcode})")

    def _fail(self, rank: int, why: str):
        self.shutdown()
        raise WorkerError(f"worker rank {rank} {why}; the engine was shut down")


def _stop_workers(procs, conns) -> None:
    for conn in conns:
        try:
            conn.send(("shutdown",))
        except (BrokenPipeError, OSError, EOFError):
            pass
    deadline = time.monotonic() + 30
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)
    for conn in conns:
        conn.close()


def make_engine(config: EngineConfig):
    """The one-process `LLMEngine`, or the multi-process front end when the config asks for several ranks."""
    return MultiprocEngine(config) if config.world_size > 1 else LLMEngine(config)
