"""The engine core in a process of its own, and the client the server talks to it through.

`openinfer serve` runs its engine here, not in the server's process: the HTTP side (request parsing, protocol
conversion through deepseek-recipe, tokenization, SSE framing of every stream) and the engine loop (scheduling,
the runner's host work, detokenization and stop checks) then hold two interpreters, and neither waits for the
other's Python (vLLM v1 splits its engine core off for the same reason; SGLang splits tokenizer, scheduler and
detokenizer). The core runs a busy loop: it takes what arrived (adds, aborts, calls) without waiting while it has
work, steps the engine, and sends the step's outputs back in one message; idle, it sleeps on its pipe.

The channel is a `multiprocessing` pipe (a Unix socket pair) carrying pickled messages; an output batch is one
message per step, and outputs leave the prompt out (the client has it). Messages:

    client -> core   ("add", kwargs)  ("abort", request_id)  ("call", call_id, method, args)  ("shutdown",)
    core -> client   ("ready", info)  ("outputs", outputs, stats, adds_taken)  ("refused", request_id, message)
                     ("reply", call_id, ok, value)  ("error", traceback)

Several ranks: the core hosts the multi-process front end (executor/multiproc.py), whose workers it starts; a
one-rank engine is an `LLMEngine` in the core. A core that dies (or fails) is reported by the client as
`EngineCoreError` with the core's traceback when it sent one; the core exits with the process that started it.

Several clients (`openinfer serve --api-server-count N`, serving/api_servers.py): a core started with
`accept_clients` also takes clients that connect to it (`EngineCoreClient.connect`: a Unix socket in a private
directory, an auth key). Each client has a number (0: the one that started the core), sent in its "ready"; its
request ids carry it, and the core still refuses an id already live. The core keeps which client added each live
request: a step's outputs go to their own clients only, every connected client gets the core's stats every step
(its /metrics and /load read the core's numbers), an abort touches only the aborting client's requests, a call is
answered to its caller. A connected client that goes away has its requests aborted (their KV blocks freed); the one
that started the core going away stops it. One `multiprocessing.connection.wait` over every connection per step
finds what arrived, so more clients do not cost the busy loop a poll each.
"""

from __future__ import annotations

import itertools
import multiprocessing
import multiprocessing.connection as mpc
import os
import queue
import secrets
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
import weakref
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Callable

from openinfer.config import EngineConfig
from openinfer.executor.worker import end_process
from openinfer.models.interface import ResolvedModel
from openinfer.outputs import RequestOutput
from openinfer.sampling_params import SamplingParams

_IDLE_POLL_S = 0.5        # an idle core wakes this often to notice a gone parent


class EngineCoreError(RuntimeError):
    """The engine core process failed or died; the message carries its traceback when it sent one."""


@dataclass(frozen=True)
class CoreAddress:
    """Where further clients reach a core that takes them: a Unix socket in a directory only this user can enter,
    and the key a client proves itself with (messages are pickles: only our own processes may send them)."""
    path: str
    authkey: bytes


# ---- the core's side --------------------------------------------------------------------------------------------
def core_main(config: EngineConfig, model: ResolvedModel, conn, parent_pid: int, num_threads: int,
              address: CoreAddress | None = None) -> None:
    """The engine core process: build the engine, report ready, then serve its clients until shutdown.
    `num_threads`: the CPU threads its torch may use (the starting process's own: the core does the compute that
    process would have done). `address`: where further clients connect (None: the one client on `conn` only)."""
    from openinfer.executor.worker import _exit_with_parent

    _exit_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)      # Ctrl-C is the server's to handle
    # the core is a daemon of the server's process (it must not outlive it), yet starts the ranks' processes of a
    # multi-rank engine: multiprocessing refuses children to a daemonic process, so the core is not one in its own
    # eyes (its ranks stop with it: their own watch, and the stop on shutdown)
    multiprocessing.current_process()._config["daemon"] = False
    import torch

    torch.set_num_threads(num_threads)
    engine = None
    try:
        if config.world_size > 1:
            from openinfer.executor.multiproc import MultiprocEngine

            engine = MultiprocEngine(config, model)
        else:
            from openinfer.engine.llm_engine import LLMEngine

            engine = LLMEngine(config, model=model)
            if config.device != "cpu":     # kernels compile now, not under the first requests
                print(f"[openinfer] warmed up (kernels compiled) in {engine.warm_up():.1f}s", file=sys.stderr,
                      flush=True)
        info = {"model_config": engine.model_config, "max_model_len": engine.max_model_len,
                "kv_store_namespace": engine.kv_store_namespace(), "async_scheduling": engine.async_scheduling}
        doorway = _Doorway(address) if address is not None else None    # open before anyone learns we are ready
        conn.send(("ready", {**info, "stats": engine.stats(), "client_index": 0}))
        _serve(engine, conn, info, doorway)
    except (EOFError, KeyboardInterrupt, BrokenPipeError):
        pass                                           # the client is gone
    except BaseException:
        try:
            conn.send(("error", traceback.format_exc()))
        except OSError:
            pass
        os._exit(1)
    finally:
        if engine is not None:
            engine.shutdown()


class _Client:
    """A client as the core sees it: its connection, its number, the adds of it the core took, and whether it gets
    the core's stats every step (a front end serving /metrics) or only with its own outputs (a supervisor)."""
    __slots__ = ("conn", "index", "taken", "every_step")

    def __init__(self, conn, index: int, every_step: bool = True):
        self.conn, self.index, self.taken, self.every_step = conn, index, 0, every_step


class _Doorway:
    """Further clients coming in: a thread accepts them (the listener checks their key) and wakes the busy loop
    through a pipe, so the loop never waits on a handshake."""

    def __init__(self, address: CoreAddress):
        self._listener = mpc.Listener(address.path, family="AF_UNIX", authkey=address.authkey)
        self._arrived: queue.SimpleQueue = queue.SimpleQueue()
        self.wake, self._wake_w = os.pipe()
        threading.Thread(target=self._accept, name="openinfer-core-accept", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn = self._listener.accept()
            except mpc.AuthenticationError:
                continue
            except OSError:
                return
            self._arrived.put(conn)
            os.write(self._wake_w, b"\0")

    def take(self) -> list:
        """The connections that arrived (call when `wake` is readable)."""
        os.read(self.wake, 4096)
        conns = []
        while True:
            try:
                conns.append(self._arrived.get_nowait())
            except queue.Empty:
                return conns


def _serve(engine, primary, info: dict, doorway: _Doorway | None) -> None:
    clients = [_Client(primary, 0, every_step=doorway is None)]
    owner: dict[str, _Client] = {}                 # live request id -> the client that added it
    next_index = itertools.count(1)
    while True:
        busy = engine.has_unfinished_requests()
        waitables = [c.conn for c in clients] + ([doorway.wake] if doorway is not None else [])
        ready = mpc.wait(waitables, timeout=0 if busy else _IDLE_POLL_S)
        for client in [c for c in clients if c.conn in ready]:      # everything that arrived, before the next step
            status = _take_messages(engine, client, owner)
            if status == "stop":
                return
            if status == "gone":
                if client.index == 0:
                    return                         # the client that started the core is gone: so is the core
                _drop(engine, client, clients, owner)
        if doorway is not None and doorway.wake in ready:
            for conn in doorway.take():
                client = _Client(conn, next(next_index))
                try:
                    conn.send(("ready", {**info, "stats": engine.stats(), "client_index": client.index}))
                except OSError:
                    conn.close()
                    continue
                clients.append(client)
        if engine.has_unfinished_requests():
            outputs = engine.step()
            mine: dict[_Client, list[RequestOutput]] = {}
            for out in outputs:
                out.prompt_token_ids, out.prompt = None, None    # the client has each prompt; not sent every step
                client = owner.pop(out.request_id, None) if out.finished else owner.get(out.request_id)
                if client is not None:
                    mine.setdefault(client, []).append(out)
            _send_step(engine, clients, owner, mine)
        elif busy:                        # the last work just went (aborted): say so, so the clients' stats move
            _send_step(engine, clients, owner, {})


def _take_messages(engine, client: _Client, owner: dict) -> str:
    """Handle what `client` sent; "ok", "gone" (its connection closed) or "stop" (shut the core down)."""
    conn = client.conn
    try:
        while conn.poll(0):
            msg = conn.recv()
            kind = msg[0]
            if kind == "add":
                client.taken += 1
                rid = msg[1]["request_id"]
                try:
                    engine.add_request(**msg[1])
                except (ValueError, TypeError) as e:      # this request fails alone; the core keeps serving
                    conn.send(("refused", rid, str(e)))
                else:
                    owner[rid] = client
            elif kind == "abort":
                if owner.get(msg[1]) is client:           # a client stops only its own requests
                    del owner[msg[1]]
                    engine.abort_request(msg[1])
            elif kind == "call":
                _, call_id, method, args = msg
                try:
                    value = getattr(engine, method)(*args)
                    conn.send(("reply", call_id, True, value))
                except Exception as e:                     # reported to the caller, not fatal
                    conn.send(("reply", call_id, False, f"{type(e).__name__}: {e}"))
            elif kind == "shutdown":
                return "stop" if client.index == 0 else "gone"
            else:
                raise ValueError(f"unknown command {kind!r}")
    except (EOFError, OSError):
        return "gone"
    return "ok"


def _send_step(engine, clients: list[_Client], owner: dict, mine: dict) -> None:
    """A step's message to each client: its own outputs, the core's stats (one dict for all), its adds taken. A
    client other than the first whose connection broke is dropped; the first's breaking stops the core."""
    stats = engine.stats()
    gone = []
    for client in clients:
        outs = mine.get(client)
        if outs is None and not client.every_step:
            continue
        try:
            client.conn.send(("outputs", outs or [], stats, client.taken))
        except OSError:
            if client.index == 0:
                raise
            gone.append(client)
    for client in gone:
        _drop(engine, client, clients, owner)


def _drop(engine, client: _Client, clients: list[_Client], owner: dict) -> None:
    """A client went away: abort its requests (their blocks are free at once) and forget it."""
    clients.remove(client)
    for rid in [rid for rid, c in owner.items() if c is client]:
        del owner[rid]
        engine.abort_request(rid)
    client.conn.close()


# ---- the client's side ------------------------------------------------------------------------------------------
class EngineCoreClient:
    """The engine interface the server needs, over an engine core in its own process. Requests go out as they
    come; outputs come back on a reader thread, which hands each step's outputs to `on_outputs` (set by the
    server) in one call. Calls (`call`) are answered in the order the core takes them, between its steps.

    `EngineCoreClient(config)` starts a core of its own (stopped by `shutdown`); with `accept_clients` that core
    also takes the clients `EngineCoreClient.connect(config, model, client.address)` makes in other processes."""

    is_multiprocess = True        # the live requests are in another process (serving/load.py)

    def __init__(self, config: EngineConfig, model: ResolvedModel | None = None, accept_clients: bool = False):
        from openinfer.executor.worker import rank_process_context
        from openinfer.models.registry import check_layout, resolve

        model = model or resolve(config)                       # fetched / converted once, here
        check_layout(model, config)                            # a bad layout fails here, not in the core
        self._setup(config, model)
        self.address: CoreAddress | None = None
        self._address_dir: str | None = None
        if accept_clients:        # a socket in a directory of our own (mkdtemp: this user only)
            self._address_dir = tempfile.mkdtemp(prefix="openinfer-core-")
            self.address = CoreAddress(os.path.join(self._address_dir, "core.sock"), secrets.token_bytes(32))
        ctx = rank_process_context()
        self._conn, child = ctx.Pipe()
        import torch

        self._proc = ctx.Process(target=core_main, args=(config, self.model_source, child, os.getpid(),
                                                         torch.get_num_threads(), self.address),
                                 name="openinfer-engine-core", daemon=True)
        self._proc.start()
        child.close()
        self._finalizer = weakref.finalize(self, _stop_core, self._proc, self._conn, self._address_dir)
        self._start()

    @classmethod
    def connect(cls, config: EngineConfig, model: ResolvedModel, address: CoreAddress) -> "EngineCoreClient":
        """A client of a core another process started (that process's `address`): a connection of its own; the
        core is not this client's to stop (`shutdown` closes the connection, and the core aborts what this client
        left running)."""
        self = cls.__new__(cls)
        self._setup(config, model)
        self.address, self._proc = address, None
        self._conn = mpc.Client(address.path, family="AF_UNIX", authkey=address.authkey)
        self._finalizer = weakref.finalize(self, _leave_core, self._conn)
        self._start()
        return self

    def _setup(self, config: EngineConfig, model: ResolvedModel) -> None:
        from openinfer.tokenizer import Tokenizer

        self.config = config
        self.model_source = model
        self.model_dir = model.path
        self.tokenizer = Tokenizer.from_dir(self.model_dir, model.family.vocabulary, model.hf_config)
        # set by the server: a step's outputs (and the core's stats), a request the core refused (its error),
        # the core's death
        self.on_outputs: Callable[[list[RequestOutput], dict], None] | None = None
        self.on_refused: Callable[[str, Exception], None] | None = None
        self.on_death: Callable[[BaseException], None] | None = None
        self.error: BaseException | None = None
        self._prompts: dict[str, tuple[list[int], str | None]] = {}   # live request id -> (prompt ids, text)
        self._calls: dict[int, Future] = {}
        self._call_ids = itertools.count()
        # messages go out through a writer thread: a full pipe (the core in a long step) never blocks a caller
        # (the server's event loop)
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._writer: threading.Thread | None = None
        self._sent = 0                    # adds sent
        self._taken = 0                   # adds the core has taken (from its last message)
        self._structured = None
        self._closing = False             # shutdown began: the connection's end is no death to report

    def _start(self) -> None:
        """Wait for the core's "ready", then start the reader and writer threads."""
        try:
            info = self._wait_ready(self.config.worker_start_timeout_s)
        except BaseException:
            self.shutdown()
            raise
        self.model_config, self.max_model_len = info["model_config"], info["max_model_len"]
        self._stats = info["stats"]
        self._namespace = info["kv_store_namespace"]
        self.async_scheduling = info["async_scheduling"]     # as the core's engine resolved it
        self.client_index: int = info["client_index"]        # 0: the client that started the core
        self._reader = threading.Thread(target=self._read, name="openinfer-core-reader", daemon=True)
        self._reader.start()
        self._writer = threading.Thread(target=self._write, name="openinfer-core-writer", daemon=True)
        self._writer.start()

    @property
    def sentinel(self) -> int | None:
        """Readable once the core process this client started has exited (None: a connected client)."""
        return None if self._proc is None else self._proc.sentinel

    def _wait_ready(self, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        watched = [self._conn] + ([self._proc.sentinel] if self._proc is not None else [])
        while True:
            ready = mpc.wait(watched, timeout=max(0.0, deadline - time.monotonic()))
            if self._conn in ready:
                try:
                    msg = self._conn.recv()
                except EOFError:
                    raise EngineCoreError(f"the engine core died ({self._exit_status()}) while starting") from None
                if msg[0] == "ready":
                    return msg[1]
                if msg[0] == "error":
                    raise EngineCoreError(f"the engine core failed to start:\n{msg[1]}")
                continue
            if self._proc is not None and self._proc.sentinel in ready:
                raise EngineCoreError(f"the engine core died ({self._exit_status()}) while starting")
            raise EngineCoreError(f"the engine core did not start within {timeout_s:g} s")

    def _exit_status(self) -> str:
        if self._proc is None:
            return "its connection closed"
        return f"exit code {self._proc.exitcode}"

    # ---- requests -------------------------------------------------------------------------------------------
    def validate_prompt(self, prompt_token_ids: list[int]) -> None:
        from openinfer.engine.llm_engine import LLMEngine

        LLMEngine.validate_prompt(self, prompt_token_ids)

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams, prompt: str | None = None,
                    request_id: str | None = None, arrival_time: float | None = None, images: tuple = ()) -> str:
        """Queue a request in the core (validated here first: a bad one is a ValueError and sends nothing;
        `images`, the prompt's image spans, are checked by the core's engine and travel with the request)."""
        self._check_alive()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        if request_id is None or request_id in self._prompts:
            raise ValueError(f"request_id {request_id!r} is missing or already in use")
        self.validate_prompt(prompt_token_ids)
        self._prompts[request_id] = (list(prompt_token_ids), prompt)
        self._send(("add", dict(prompt_token_ids=list(prompt_token_ids), params=params, prompt=prompt,
                                request_id=request_id, arrival_time=arrival_time or time.time(),
                                **({"images": tuple(images)} if images else {}))))
        self._sent += 1
        return request_id

    def abort_request(self, request_id: str) -> None:
        if self._prompts.pop(request_id, None) is not None and self.error is None:
            self._send(("abort", request_id))

    @property
    def requests(self) -> dict:
        return self._prompts

    @property
    def num_untaken(self) -> int:
        """Adds sent that the core has not taken yet (they wait in the pipe)."""
        return max(0, self._sent - self._taken)

    def has_unfinished_requests(self) -> bool:
        return bool(self._prompts)

    # ---- the rest of the interface -----------------------------------------------------------------------------
    def stats(self) -> dict:
        """The core's numbers as of its last message (every step sends them)."""
        return self._stats

    def kv_store_namespace(self) -> str | None:
        return self._namespace

    @property
    def structured_output(self):
        """A grammar compiler here, to reject a bad grammar before its request goes to the core (the core compiles
        again for its masks, from its cache after the first time), as the multi-process front end does."""
        if self._structured is None:
            from openinfer.engine.llm_engine import LLMEngine

            self._structured = LLMEngine._make_structured_output(self)
        return self._structured

    def call(self, method: str, *args, timeout_s: float = 600.0):
        """`engine.<method>(*args)` in the core, between its steps; its result (a failure raises here)."""
        self._check_alive()
        call_id = next(self._call_ids)
        future: Future = Future()
        self._calls[call_id] = future
        self._send(("call", call_id, method, args))
        ok, value = future.result(timeout=timeout_s)
        if not ok:
            raise EngineCoreError(f"{method} failed in the engine core: {value}")
        return value

    def touch_cache_pages(self) -> None:
        self.call("touch_cache_pages")

    def flush_kv_store(self, timeout_s: float | None = None) -> bool:
        return self.call("flush_kv_store", timeout_s, timeout_s=600.0 if timeout_s is None else timeout_s + 60)

    def shutdown(self) -> None:
        """Stop the core (politely, then by force) and free its device; a connected client leaves it (the core
        aborts what it left running). Idempotent."""
        self._closing = True
        self._prompts.clear()
        if self._proc is None:              # a connected client says goodbye; the core closes its end
            self._outbox.put(("shutdown",))
        self._outbox.put(None)              # the writer stops after what it has; then shutdown goes on the pipe
        writer = self._writer                           # (none yet when the core failed to start)
        if writer is not None and threading.current_thread() is not writer:
            writer.join(timeout=10)
            if self._proc is None and threading.current_thread() is not self._reader:
                self._reader.join(timeout=10)          # (its connection is not closed under it)
        self._finalizer()
        if self._structured is not None:
            self._structured.pool.shutdown()
            self._structured = None

    # ---- transport ------------------------------------------------------------------------------------------
    def _send(self, msg) -> None:
        self._check_alive()
        self._outbox.put(msg)

    def _write(self) -> None:
        while True:
            msg = self._outbox.get()
            if msg is None:
                return
            try:
                self._conn.send(msg)
            except (OSError, ValueError):   # the core is gone: the reader reports it
                return

    def _check_alive(self) -> None:
        if self.error is not None:
            raise self.error

    def _read(self) -> None:
        """The reader thread: outputs to `on_outputs`, replies to their callers, a death to everyone."""
        try:
            while True:
                msg = self._conn.recv()
                kind = msg[0]
                if kind == "outputs":
                    _, outputs, stats, taken = msg
                    self._stats, self._taken = stats, taken
                    kept = []
                    for out in outputs:
                        known = (self._prompts.pop(out.request_id, None) if out.finished
                                 else self._prompts.get(out.request_id))
                        # an output of a request aborted here while its step ran in the core: nobody waits for it
                        if known is not None:
                            out.prompt_token_ids, out.prompt = known
                            kept.append(out)
                    if self.on_outputs is not None:
                        self.on_outputs(kept, stats)
                elif kind == "refused":
                    self._prompts.pop(msg[1], None)
                    if self.on_refused is not None:
                        self.on_refused(msg[1], ValueError(msg[2]))
                elif kind == "reply":
                    future = self._calls.pop(msg[1], None)
                    if future is not None:
                        future.set_result((msg[2], msg[3]))
                elif kind == "error":
                    raise EngineCoreError(f"the engine core failed:\n{msg[1]}")
        except (EOFError, OSError) as e:
            if self._proc is not None:
                self._proc.join(timeout=5)
            error = EngineCoreError(f"the engine core died ({self._exit_status()}): {e!r}")
        except EngineCoreError as e:
            error = e
        self.error = error
        for future in list(self._calls.values()):
            future.set_result((False, str(error)))
        self._calls.clear()
        if self.on_death is not None and not self._closing:
            self.on_death(error)


def _stop_core(proc, conn, address_dir: str | None) -> None:
    try:
        conn.send(("shutdown",))
    except (OSError, ValueError):
        pass
    proc.join(timeout=30)
    end_process(proc)
    conn.close()
    if address_dir is not None:
        shutil.rmtree(address_dir, ignore_errors=True)


def _leave_core(conn) -> None:
    """A connected client's goodbye: the core drops it (and aborts its requests) and closes its end."""
    try:
        conn.send(("shutdown",))
    except (OSError, ValueError):
        pass
    conn.close()
