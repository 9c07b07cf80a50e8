"""MultiprocEngine: one front-end object over one worker process per rank (or one Ray actor per rank).

The front end (in the caller's process: `LLM`, the server) keeps the tokenizer, validates requests, assigns
each to a data-parallel group and forwards it to that group's ranks; every `step()` steps all ranks once and
collects what their drivers (TP rank 0) report. A worker is an `LLMEngine` for its rank (`worker.py`).

Why one step for all ranks: MoE layers with expert parallelism exchange tokens between ranks, so every rank
runs a forward whenever any rank has work (an idle rank runs a padding row, see `step_sync.py`); TP ranks run
the same schedule (they receive the same commands in the same order and schedule deterministically).

Lifecycle: workers start before anything loads, report `ready` (or the error, naming the rank), and stop on
`shutdown()`, on the front end's exit (a finalizer) and on its death (the kernel's parent-death signal on
Linux, and a closed pipe elsewhere), so no orphans are left after an exception, Ctrl-C or SIGTERM. A worker
that fails is reported as a `WorkerError` naming its rank, never a hang: with the error it sent (its traceback:
read from its connection even when its exit is noticed first, since a pipe keeps what a process wrote before it
exited), else its exit code. A rank whose peer failed fails too, at its next collective, so the rank named is the
likeliest cause (`_fail_with_cause`), the others' errors following it.

Threads: commands to the ranks and their replies are exchanged under one lock, so `call_ranks` may come from
another thread while a server's engine thread steps (it runs between two steps).

Several hosts: the front end spawns ranks 0..num_local_ranks-1; the other ranks run under `openinfer worker
--connect HOST:PORT --ranks ...` on other hosts and connect to `worker_listen_address` with
`multiprocessing.connection` (TCP, HMAC challenge with the shared authkey; the stdlib's Listener/Client
protocol). A remote worker sends ("hello", rank) and receives ("config", config, init_method, model) (the model
as the front end resolved it: its directory must exist on that host too); from then on
its connection is used exactly like a local pipe. Tensors go through torch.distributed as before (the
rendezvous must then be env:// or tcp://host:port reachable from every host). A remote rank has no process
here: its liveness is its connection (closed or reset: an error naming the rank); shutdown sends
("shutdown",) and closes the connection, which ends the remote process.

Ray (`distributed_executor_backend="ray"`, `ray_ranks.py`): every rank is a remote rank of this kind, started by
Ray as an actor in a placement group instead of by hand; it connects to a listener on this node's address with a
key made for the engine. Ray adds what a hand-started rank lacks: a rank that ends before it connects is reported
with Ray's error, a dead one with Ray's account of its death, and shutdown kills the actors and removes the
placement groups.
"""

from __future__ import annotations

import itertools
import multiprocessing.connection as mpc
import os
import queue
import secrets
import select
import socket
import threading
import time
import weakref
from multiprocessing.reduction import ForkingPickler

from openinfer.config import EngineConfig, parse_host_port
from openinfer.engine.llm_engine import LLMEngine
from openinfer.executor.ray_ranks import RayRanks
from openinfer.executor.worker import WorkerError, end_process
from openinfer.models.registry import check_layout, resolve
from openinfer.multimodal import check_spans
from openinfer.outputs import RequestOutput
from openinfer.sampling_params import SamplingParams
from openinfer.tokenizer import Tokenizer

_STEP_TIMEOUT_S = 600.0
_PEER_GRACE_S = 1.0       # after one rank fails, how long the others get to show whether they are failing too
_SUM_STATS = ("num_running", "num_waiting", "kv_blocks_total", "kv_blocks_free", "prefix_cache_hit_tokens",
              "prefix_cache_queried_tokens", "num_preemptions", "prompt_tokens_computed")
_EXPERT_STATS = ("moe_lb", "moe_rank_load", "moe_expert_load", "moe_load_steps", "eplb_rebalances")


def free_local_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MultiprocEngine:
    """The `LLMEngine` interface over `config.world_size` worker processes."""

    is_multiprocess = True

    def __init__(self, config: EngineConfig, model=None):
        """`model`: the model as resolved already (models/interface.py: ResolvedModel); None: resolved here."""
        from openinfer.executor.worker import rank_process_context, worker_main

        self.config = config
        self.requests: dict[str, int] = {}        # live request id -> DP group
        self._prompts: dict[str, tuple] = {}        # live request id -> (prompt token ids, prompt text)
        self.model_source = model or resolve(config)   # fetch/convert/generate once, here; its config read once
        self.model_dir = self.model_source.path
        check_layout(self.model_source, config)       # before any worker starts loading
        self.tokenizer = Tokenizer.from_dir(self.model_dir, self.model_source.family.vocabulary,
                                            self.model_source.hf_config)
        start_deadline = time.monotonic() + config.worker_start_timeout_s
        # under Ray every rank is an actor, placed (and removed again if that fails) before anything else starts
        self._ray = RayRanks(config, start_deadline) if config.uses_ray else None
        if self._ray is not None:
            init_method = config.distributed_init_method or self._ray.rendezvous
        else:
            init_method = config.distributed_init_method or f"tcp://127.0.0.1:{free_local_port()}"
        ctx = rank_process_context()
        # one entry per rank; a remote rank (another host's, or a Ray actor) has no process here (None) and its
        # connection arrives later
        self._procs: list = [None] * config.world_size
        self._conns: list = [None] * config.world_size
        # until every rank is ready, a failure stops the others at once: they may be waiting in the rendezvous
        # for a rank that will never come, not reading their commands
        self._stop_opts = {"grace_s": 2.0}
        self._finalizer = weakref.finalize(self, _stop_workers, self._procs, self._conns, self._stop_opts, self._ray)
        self._lock = threading.Lock()     # one exchange with the ranks at a time (see the module's docstring)
        try:
            for rank in range(config.local_ranks):
                parent, child = ctx.Pipe()
                p = ctx.Process(target=worker_main, args=(config, self.model_source, rank, init_method, child,
                                                          os.getpid()),
                                name=f"openinfer-rank{rank}", daemon=True)
                p.start()
                child.close()
                self._procs[rank], self._conns[rank] = p, parent
            if self._ray is not None:
                # the actors connect here with a key made for this engine, which Ray hands them
                authkey = secrets.token_bytes(32)
                server = _listen(self._ray.driver_ip, 0)
                self._ray.start(server.getsockname()[:2], authkey, config.worker_start_timeout_s)
                self._accept_remote(server, authkey, init_method, start_deadline)
            elif config.local_ranks < config.world_size:
                host, port = parse_host_port(config.worker_listen_address, "worker_listen_address")
                self._accept_remote(_listen(host, port), config.resolved_worker_authkey.encode(), init_method,
                                    start_deadline)
            infos = self._gather_replies(range(config.world_size), max(0.0, start_deadline - time.monotonic()),
                                         "start")
        except BaseException:
            self._stop()
            raise
        self._stop_opts["grace_s"] = 30.0
        self.async_scheduling = config.use_async_scheduling     # (the ranks' own: speculation is one-process)
        info = infos[0]
        self.model_config, self.max_model_len = info["model_config"], info["max_model_len"]
        self.kv_blocks_per_rank = info["num_blocks"]
        g = config.ranks_per_dp_group       # a DP group's TP x CP ranks share its requests
        self._groups = [list(range(d * g, (d + 1) * g)) for d in range(config.data_parallel_size)]
        self._ids = itertools.count()
        self._rank_busy = [False] * config.world_size
        self._rank_stats: list[dict] = [info["stats"] for info in infos]
        self._structured = None
        self._image_processor = self.model_source.family.image_processor(self.model_source.hf_config)

    # ---- requests ---------------------------------------------------------------------------------------
    validate_prompt = LLMEngine.validate_prompt

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, prompt: str | None = None,
                    request_id: str | None = None, arrival_time: float | None = None, images: tuple = ()) -> str:
        """Validate here (the workers only see valid requests), pick the DP group with the fewest live
        requests (then the most free KV blocks), and send the request to each of its ranks. `images`: the prompt's
        image spans (multimodal.py), checked here and sent with the request, pixels as tensors (their digests as
        computed): the ranks that own the request encode them (see `validate_images`)."""
        images = tuple(images)
        with self._lock:
            return self._add_request(prompt_token_ids, params, prompt, request_id, arrival_time, images)

    def validate_images(self, prompt_token_ids: list[int], images: tuple) -> None:
        """Raise ValueError naming the problem unless the model reads these image spans in this prompt — here,
        through the family's image processor, without the model: the front end holds no weights. The encoder runs
        in the ranks of the DP group that owns the request, in the step that first reads a span, as in one process
        (its encoder cache by digest, EPD rows taken as given): the tower is on every rank already, the front end
        has no device, each DP group encodes only its own requests' images, and the patches that travel are about
        the size of the rows they become (docs/vision.md)."""
        if self._image_processor is None:
            raise ValueError(f"this model ({self.config.model}) does not take images: it has no vision encoder")
        check_spans(images, len(prompt_token_ids))
        for image in images:
            self._image_processor.check(image, prompt_token_ids)

    def _add_request(self, prompt_token_ids, params, prompt, request_id, arrival_time, images) -> str:
        self._check_alive("add")
        if request_id is None:
            request_id = str(next(self._ids))
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        self.validate_prompt(prompt_token_ids)
        if images:
            self.validate_images(prompt_token_ids, images)
        if params.structured_outputs is not None:   # a bad grammar fails here, not on a worker
            self.structured_output.pool.compile_blocking(params.structured_outputs)
        load = [0] * len(self._groups)
        for g in self.requests.values():
            load[g] += 1
        group = min(range(len(self._groups)),
                    key=lambda g: (load[g], -self._rank_stats[self._groups[g][0]].get("kv_blocks_free", 0), g))
        msg = ("add", dict(prompt_token_ids=list(prompt_token_ids), params=params, prompt=prompt,
                           request_id=request_id, arrival_time=arrival_time or time.time(),
                           **({"images": images} if images else {})))
        ranks = self._groups[group]
        pickled = ForkingPickler.dumps(msg) if len(ranks) > 1 else None    # (images: their bytes once per group)
        for rank in ranks:
            self._send(rank, msg, pickled)
        self.requests[request_id] = group
        self._prompts[request_id] = (prompt_token_ids, prompt)
        return request_id

    def abort_request(self, request_id: str) -> None:
        """Stop a request on its ranks now (their blocks are freed before their next step)."""
        with self._lock:
            group = self.requests.pop(request_id, None)
            self._prompts.pop(request_id, None)
            if group is not None:
                for rank in self._groups[group]:
                    self._send(rank, ("abort", request_id))

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or any(self._rank_busy)

    def step(self) -> list[RequestOutput]:
        """Step every rank once; outputs come from each DP group's driver rank."""
        with self._lock:
            self._check_alive("step")
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
        """Summed over DP groups (each group's driver), usage over the whole pool, as of the last step; expert
        load (`moe_lb`, per rank and per expert) from rank 0: every EP rank counts every rank's routing."""
        drivers = [self._rank_stats[g[0]] for g in self._groups]
        out = {k: sum(s.get(k, 0) for s in drivers) for k in _SUM_STATS}
        used = out["kv_blocks_total"] - out["kv_blocks_free"]
        out["kv_usage"] = used / out["kv_blocks_total"] if out["kv_blocks_total"] else 0.0
        q = out["prefix_cache_queried_tokens"]
        out["prefix_cache_hit_rate"] = out["prefix_cache_hit_tokens"] / q if q else 0.0
        for k in ("num_steps", "step_time_s", "num_prefill_steps"):     # the ranks step together: rank 0's
            out[k] = self._rank_stats[0].get(k, 0)
        for k in _EXPERT_STATS:
            if k in self._rank_stats[0]:
                out[k] = self._rank_stats[0][k]
        out["per_rank"] = [dict(s) for s in self._rank_stats]
        return out

    def kv_store_namespace(self) -> None:
        return None          # the prefix-KV store is a one-process feature (EngineConfig refuses it here)

    def touch_cache_pages(self) -> None:
        with self._lock:
            for rank in range(self.config.world_size):
                self._send(rank, ("touch",))
            self._gather_replies(range(self.config.world_size), self.config.worker_start_timeout_s, "touch")

    def call_ranks(self, method: str, *args) -> list:
        """Run `LLMEngine.<method>(*args)` on every rank (tests, benchmarks, `rebalance_experts` on request);
        returns each rank's result. Any thread may call it: it runs between two steps."""
        with self._lock:
            ranks = range(self.config.world_size)
            for rank in ranks:
                self._send(rank, ("call", method, args))
            return self._gather_replies(ranks, _STEP_TIMEOUT_S, method)

    def shutdown(self) -> None:
        """Stop every worker (politely, then by force) and free their GPUs. Idempotent. A rank that reports an
        error while it stops — or one that failed between commands and was not heard yet — raises WorkerError
        naming it, once every worker has stopped."""
        errors = self._stop()
        if errors:
            cause = min(errors, key=lambda r: (errors[r][1], r))
            also = "".join(f"\n(rank {r} failed too: {_last_line(errors[r][0])})" for r in sorted(errors)
                           if r != cause)
            raise WorkerError(f"worker rank {cause} raised during 'shutdown':\n{errors[cause][0].rstrip()}{also}; "
                              f"every worker has stopped")

    def _stop(self) -> dict[int, tuple[str, float]]:
        """Stop every worker without raising (for paths already reporting a failure); the errors ranks sent."""
        self.requests.clear()
        self._prompts.clear()
        return self._finalizer() or {}

    # ---- remote ranks -----------------------------------------------------------------------------------
    def _accept_remote(self, server: socket.socket, authkey: bytes, init_method: str, deadline: float) -> None:
        """Accept the ranks this process did not spawn (other hosts' `openinfer worker`, or Ray actors) on `server`
        until every one has connected (or the start timeout: an error naming the missing ranks). Each connection
        is authenticated with the stdlib's HMAC challenge (both ways, as `multiprocessing.connection.Listener`
        does), in a thread of its own so a silent or slow client holds up nobody; then it names its rank and gets
        the config. Closes `server`."""
        config = self.config
        host, port = server.getsockname()[:2]
        remote = set(range(config.local_ranks, config.world_size))
        results: queue.Queue = queue.Queue()
        handshaking: list[tuple[socket.socket, threading.Event]] = []   # to cut off unfinished handshakes
        problems: list[str] = []
        try:
            while any(self._conns[r] is None for r in remote):
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(r for r in remote if self._conns[r] is None)
                    how = (f"their Ray actors are running: can their nodes reach {host}:{port}?"
                           if self._ray is not None else
                           f"start `openinfer worker --connect {host}:{port} --ranks {','.join(map(str, missing))}` "
                           f"on their hosts, with the same OPENINFER_WORKER_AUTHKEY")
                    raise WorkerError(
                        f"worker rank(s) {missing} did not connect to {host}:{port} within "
                        f"{config.worker_start_timeout_s:g} s ({how})" + "".join(f"; {p}" for p in problems)
                        + "; the engine was shut down")
                for r in range(config.local_ranks):    # a local rank that fails while we wait: say so now
                    if not self._procs[r].is_alive():
                        self._gather_replies([r], 1.0, "start")
                if self._ray is not None:              # an actor that ended before it connected: say why now
                    ended = self._ray.ended_before_connecting([r for r in remote if self._conns[r] is None])
                    if ended is not None:
                        self._fail(ended[0], f"({self._ray.describe(ended[0])}) ended before it connected to the "
                                             f"front end:\n{ended[1]}")
                if select.select([server], [], [], min(left, 0.05))[0]:
                    sock, addr = server.accept()
                    sock.setblocking(True)
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)   # a vanished host shows
                    done = threading.Event()
                    handshaking.append((sock, done))
                    threading.Thread(target=_handshake, args=(sock, addr, authkey, left, results, done),
                                     daemon=True, name="openinfer-accept").start()
                while True:
                    try:
                        addr, conn, rank, problem = results.get_nowait()
                    except queue.Empty:
                        break
                    where = f"{addr[0]}:{addr[1]}"
                    if problem is None and rank not in remote:
                        problem = (f"the connection from {where} asked for rank {rank!r}, not one of the remote "
                                   f"ranks {sorted(remote)}")
                    elif problem is None and self._conns[rank] is not None:
                        problem = f"the connection from {where} asked for rank {rank}, already connected"
                    if problem is not None:
                        problems.append(problem)
                        if conn is not None:
                            try:
                                conn.send(("refused", problem))
                            except OSError:
                                pass
                            conn.close()
                        continue
                    try:
                        conn.send(("config", config, init_method, self.model_source))
                    except OSError as e:
                        problems.append(f"rank {rank} from {where}: the connection failed ({e})")
                        conn.close()
                        continue
                    self._conns[rank] = conn
        finally:
            server.close()
            for sock, done in handshaking:    # wake any handshake still waiting; close our copy of the socket
                if not done.is_set():
                    try:
                        sock.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
                sock.close()
            while True:                       # connections that arrived after the last rank (duplicates)
                try:
                    _, conn, _, _ = results.get_nowait()
                except queue.Empty:
                    break
                if conn is not None and conn not in self._conns:
                    conn.close()

    # ---- transport --------------------------------------------------------------------------------------
    def _send(self, rank: int, msg, pickled: bytes | None = None) -> None:
        """`pickled`: `msg` pickled already (a message to several ranks, pickled once: `Connection.send`'s own
        pickler, so the rank's `recv` reads it as any other)."""
        try:
            if pickled is None:
                self._conns[rank].send(msg)
            else:
                self._conns[rank].send_bytes(pickled)
        except (BrokenPipeError, OSError, EOFError):
            self._fail_with_cause(rank, self._last_words(rank), self._others(rank), f"before {msg[0]!r}")

    def _gather_replies(self, ranks, timeout_s: float, what: str) -> list:
        pending = {self._conns[r]: r for r in ranks}
        sentinels = {self._procs[r].sentinel: r for r in ranks if self._procs[r] is not None}
        replies: dict[int, object] = {}
        deadline = time.monotonic() + timeout_s
        try:
            return self._gather(ranks, pending, sentinels, replies, deadline, timeout_s, what)
        except WorkerError:
            raise
        except BaseException:
            # interrupted (Ctrl-C) with replies still in the pipes: later replies would be read one command
            # late, so the engine cannot be used any more; stop it now rather than answer out of step
            self._stop()
            raise

    def _gather(self, ranks, pending, sentinels, replies, deadline, timeout_s, what) -> list:
        when = f"during {what!r}"
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                self._fail(next(iter(pending.values())), f"no reply to {what!r} within {timeout_s:g} s")
            for ready in mpc.wait([*pending, *sentinels], timeout=left):
                rank = pending.get(ready, sentinels.get(ready))
                conn = self._conns[rank]
                others = [r for r in pending.values() if r != rank]
                # replied, then died (e.g. a collective watchdog); or exited with nothing more to say
                if conn not in pending or (ready is not conn and not conn.poll()):
                    self._fail_with_cause(rank, self._last_words(rank), others, when)
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    self._fail_with_cause(rank, None, others, when)
                if msg[0] == "error":
                    self._fail_with_cause(rank, _error_of(msg), others, when)
                replies[rank] = msg[1]
                del pending[conn]
        return [replies[r] for r in ranks]

    def _last_words(self, rank: int) -> tuple[str, float] | None:
        """The error `rank` sent before it stopped, if it managed to: (its traceback, when it failed), read from
        its connection now — what a process wrote stays in the pipe after it exits, and its exit (the sentinel, a
        closed pipe, a peer's error) is often noticed first. Replies read here are dropped: the engine is
        failing anyway."""
        conn = self._conns[rank]
        try:
            while conn.poll():
                msg = conn.recv()
                if msg[0] == "error":
                    return _error_of(msg)
        except (EOFError, OSError):
            pass
        return None

    def _others(self, rank: int) -> list[int]:
        return [r for r in range(self.config.world_size) if r != rank and self._conns[r] is not None]

    def _fail_with_cause(self, rank: int, words: tuple[str, float] | None, others, when: str):
        """`rank` failed `when` ("during 'step'"): `words` is the error it sent, None if it died without one. A
        rank whose peer failed fails too, at its next collective (a reset connection), so the first to be noticed
        is not always the cause: `others` get up to `_PEER_GRACE_S` to show whether they are failing as well.
        Raises WorkerError naming the likeliest cause — a rank that died without a word (killed, crashed: its
        peers' errors follow from it), else the rank whose error happened first — then the others' last lines."""
        failed = {rank: words}
        watch = {(self._procs[r].sentinel if self._procs[r] is not None else self._conns[r]): r for r in others}
        deadline = time.monotonic() + _PEER_GRACE_S
        while watch:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            for ready in mpc.wait(list(watch), timeout=left):
                r = watch.pop(ready)
                if self._procs[r] is not None:          # a local rank exited: what it said is in its pipe
                    failed[r] = self._last_words(r)
                    continue
                try:                                    # a remote rank: its connection said something
                    msg = self._conns[r].recv()
                except (EOFError, OSError):
                    failed[r] = None
                    continue
                if msg[0] == "error":
                    failed[r] = _error_of(msg)          # (a reply: alive, dropped: the engine is failing)
        cause = min(failed, key=lambda r: (failed[r] is not None, failed[r][1] if failed[r] else 0.0, r))
        also = "".join(f"\n(rank {r} failed too: {self._summary(r, failed[r])})" for r in sorted(failed)
                       if r != cause)
        words = failed[cause]
        self._fail(cause, (f"raised {when}:\n{words[0].rstrip()}" if words else self._how_ended(cause, when)) + also)

    def _how_ended(self, rank: int, when: str) -> str:
        p = self._procs[rank]
        if p is None and self._ray is not None:
            return f"({self._ray.describe(rank)}) closed its connection {when}: {self._ray.outcome(rank)}"
        if p is None:
            return f"(on another host) closed its connection {when}"
        p.join(timeout=5)            # its pipe can close before the process is reaped: wait for the exit code
        return f"died (exit code {p.exitcode}) {when}"

    def _summary(self, rank: int, words: tuple[str, float] | None) -> str:
        if words is not None:
            return _last_line(words[0])
        return self._how_ended(rank, "").strip()

    def _check_alive(self, what: str) -> None:
        if not self._finalizer.alive:
            raise RuntimeError("this engine was shut down; create a new one")
        for rank, p in enumerate(self._procs):
            if p is not None and not p.is_alive():
                self._fail_with_cause(rank, self._last_words(rank), self._others(rank), f"before {what!r}")

    def _fail(self, rank: int, why: str):
        self._stop()
        raise WorkerError(f"worker rank {rank} {why}; the engine was shut down")


def _error_of(msg) -> tuple[str, float]:
    """("error", traceback[, time it failed]) -> (traceback, time); a rank that sent no time sorts last."""
    return msg[1], (msg[2] if len(msg) > 2 else float("inf"))


def _last_line(text: str) -> str:
    """A traceback's last line (the exception and its message)."""
    lines = [line for line in str(text).strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else ""


def _handshake(sock: socket.socket, addr, authkey: bytes, timeout_s: float, results: queue.Queue,
               done: threading.Event) -> None:
    """One accepted connection: the HMAC challenge both ways (what `Listener.accept` does with an authkey),
    then the worker's ("hello", rank). Reports (addr, conn, rank, None) or (addr, None, None, problem)."""
    import os

    conn = None
    try:
        conn = mpc.Connection(os.dup(sock.fileno()))    # our own descriptor; `sock` stays to cut it off
        mpc.deliver_challenge(conn, authkey)
        mpc.answer_challenge(conn, authkey)
        if not conn.poll(timeout_s):
            raise TimeoutError("no hello")
        hello = conn.recv()
        if not (isinstance(hello, tuple) and len(hello) == 2 and hello[0] == "hello"):
            raise ValueError(f"unexpected first message {hello!r}")
        done.set()
        results.put((addr, conn, hello[1], None))
    except mpc.AuthenticationError as e:
        results.put((addr, None, None, f"the connection from {addr[0]}:{addr[1]} failed authentication ({e}): "
                                       f"is OPENINFER_WORKER_AUTHKEY the same on both hosts?"))
    except Exception as e:
        results.put((addr, None, None, f"the connection from {addr[0]}:{addr[1]} failed ({type(e).__name__}: {e})"))
    finally:
        if conn is not None and not done.is_set():
            conn.close()


def _listen(host: str, port: int) -> socket.socket:
    """The listening socket remote ranks connect to (port 0: any free port)."""
    return socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET, backlog=64)


def _stop_workers(procs, conns, opts, ray_ranks=None) -> dict[int, tuple[str, float]]:
    """Stop every rank: ("shutdown",), up to `grace_s` for them to exit, then by force (no orphans; Ray actors
    killed and their placement groups removed). Returns the errors ranks sent meanwhile, by rank ((traceback,
    time it failed)): a rank that fails while it stops says why, and so does one that failed earlier between
    commands and was not heard yet. Connections are read while the ranks stop, so none blocks writing to a full
    pipe."""
    for conn in conns:
        if conn is None:
            continue
        try:
            conn.send(("shutdown",))
        except (BrokenPipeError, OSError, EOFError):
            pass
    errors: dict[int, tuple[str, float]] = {}

    def read(rank: int, conn) -> bool:
        """Every message waiting on `conn`; False once it is closed."""
        try:
            while conn.poll():
                msg = conn.recv()
                if isinstance(msg, tuple) and msg and msg[0] == "error":
                    errors.setdefault(rank, _error_of(msg))
        except (EOFError, OSError):
            return False
        return True

    sentinels = {p.sentinel: r for r, p in enumerate(procs) if p is not None}
    # a local rank has stopped when its process exits, a remote rank when its end of the connection closes
    open_conns = {conn: r for r, conn in enumerate(conns) if conn is not None}
    deadline = time.monotonic() + opts["grace_s"]
    while sentinels or any(procs[r] is None for r in open_conns.values()):
        left = deadline - time.monotonic()
        if left <= 0:
            break
        for ready in mpc.wait([*sentinels, *open_conns], timeout=left):
            if ready in sentinels:
                rank = sentinels.pop(ready)
                if conns[rank] is not None:
                    read(rank, conns[rank])         # what it wrote before it exited
                    open_conns.pop(conns[rank], None)
            elif ready in open_conns and not read(open_conns[ready], ready):
                del open_conns[ready]
    for p in procs:
        if p is not None:
            end_process(p)
    for conn in conns:
        if conn is not None:
            conn.close()
    if ray_ranks is not None:
        ray_ranks.stop()
    return errors
