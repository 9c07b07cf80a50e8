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
"""

from __future__ import annotations

import itertools
import multiprocessing
import os
import queue
import signal
import sys
import threading
import time
import traceback
import weakref
from concurrent.futures import Future
from typing import Callable

from openinfer.config import EngineConfig
from openinfer.executor.worker import end_process
from openinfer.models.interface import ResolvedModel
from openinfer.outputs import RequestOutput
from openinfer.sampling_params import SamplingParams

_IDLE_POLL_S = 0.5        # an idle core wakes this often to notice a gone parent


class EngineCoreError(RuntimeError):
    """The engine core process failed or died; the message carries its traceback when it sent one."""


# ---- the core's side --------------------------------------------------------------------------------------------
def core_main(config: EngineConfig, model: ResolvedModel, conn, parent_pid: int, num_threads: int) -> None:
    """The engine core process: build the engine, report ready, then serve the client until shutdown.
    `num_threads`: the CPU threads its torch may use (the starting process's own: the core does the compute that
    process would have done)."""
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
        conn.send(("ready", {"model_config": engine.model_config, "max_model_len": engine.max_model_len,
                             "stats": engine.stats(), "kv_store_namespace": engine.kv_store_namespace(),
                             "async_scheduling": engine.async_scheduling}))
        _serve(engine, conn)
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


def _serve(engine, conn) -> None:
    taken = 0                     # adds taken so far (the client counts what it sent, so it knows what waits)
    while True:
        busy = engine.has_unfinished_requests()
        if not busy and not conn.poll(_IDLE_POLL_S):
            continue
        while conn.poll(0):       # everything that arrived, before the next step
            msg = conn.recv()
            kind = msg[0]
            if kind == "add":
                taken += 1
                try:
                    engine.add_request(**msg[1])
                except (ValueError, TypeError) as e:      # this request fails alone; the core keeps serving
                    conn.send(("refused", msg[1]["request_id"], str(e)))
            elif kind == "abort":
                engine.abort_request(msg[1])
            elif kind == "call":
                _, call_id, method, args = msg
                try:
                    value = getattr(engine, method)(*args)
                    conn.send(("reply", call_id, True, value))
                except Exception as e:                     # reported to the caller, not fatal
                    conn.send(("reply", call_id, False, f"{type(e).__name__}: {e}"))
            elif kind == "shutdown":
                return
            else:
                raise ValueError(f"unknown command {kind!r}")
        if engine.has_unfinished_requests():
            outputs = engine.step()
            for out in outputs:           # the client has each prompt; don't send it every step
                out.prompt_token_ids, out.prompt = None, None
            conn.send(("outputs", outputs, engine.stats(), taken))
        elif busy:                        # the last work just went (aborted): say so, so the client's stats move
            conn.send(("outputs", [], engine.stats(), taken))


# ---- the client's side ------------------------------------------------------------------------------------------
class EngineCoreClient:
    """The engine interface the server needs, over an engine core in its own process. Requests go out as they
    come; outputs come back on a reader thread, which hands each step's outputs to `on_outputs` (set by the
    server) in one call. Calls (`call`) are answered in the order the core takes them, between its steps."""

    is_multiprocess = True        # the live requests are in another process (serving/load.py)

    def __init__(self, config: EngineConfig, model: ResolvedModel | None = None):
        from openinfer.executor.worker import rank_process_context
        from openinfer.models.registry import check_layout, resolve
        from openinfer.tokenizer import Tokenizer

        self.config = config
        self.model_source = model or resolve(config)          # fetched / converted once, here
        self.model_dir = self.model_source.path
        check_layout(self.model_source, config)                # a bad layout fails here, not in the core
        self.tokenizer = Tokenizer.from_dir(self.model_dir, self.model_source.family.vocabulary,
                                            self.model_source.hf_config)
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
        ctx = rank_process_context()
        self._conn, child = ctx.Pipe()
        import torch

        self._proc = ctx.Process(target=core_main, args=(config, self.model_source, child, os.getpid(),
                                                         torch.get_num_threads()),
                                 name="openinfer-engine-core", daemon=True)
        self._proc.start()
        child.close()
        self._finalizer = weakref.finalize(self, _stop_core, self._proc, self._conn)
        try:
            info = self._wait_ready(config.worker_start_timeout_s)
        except BaseException:
            self.shutdown()
            raise
        self.model_config, self.max_model_len = info["model_config"], info["max_model_len"]
        self._stats = info["stats"]
        self._namespace = info["kv_store_namespace"]
        self.async_scheduling = info["async_scheduling"]     # as the core's engine resolved it
        self._reader = threading.Thread(target=self._read, name="openinfer-core-reader", daemon=True)
        self._reader.start()
        self._writer = threading.Thread(target=self._write, name="openinfer-core-writer", daemon=True)
        self._writer.start()

    def _wait_ready(self, timeout_s: float) -> dict:
        import multiprocessing.connection as mpc

        deadline = time.monotonic() + timeout_s
        while True:
            ready = mpc.wait([self._conn, self._proc.sentinel], timeout=max(0.0, deadline - time.monotonic()))
            if self._conn in ready:
                try:
                    msg = self._conn.recv()
                except EOFError:
                    raise EngineCoreError(f"the engine core died (exit code {self._proc.exitcode}) while "
                                          f"starting") from None
                if msg[0] == "ready":
                    return msg[1]
                if msg[0] == "error":
                    raise EngineCoreError(f"the engine core failed to start:\n{msg[1]}")
                continue
            if self._proc.sentinel in ready:
                raise EngineCoreError(f"the engine core died (exit code {self._proc.exitcode}) while starting")
            raise EngineCoreError(f"the engine core did not start within {timeout_s:g} s")

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
        """Stop the core (politely, then by force) and free its device. Idempotent."""
        self._prompts.clear()
        self._outbox.put(None)              # the writer stops after what it has; then shutdown goes on the pipe
        writer = self._writer                           # (none yet when the core failed to start)
        if writer is not None and threading.current_thread() is not writer:
            writer.join(timeout=10)
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
                    for out in outputs:
                        known = (self._prompts.pop(out.request_id, None) if out.finished
                                 else self._prompts.get(out.request_id))
                        if known is not None:
                            out.prompt_token_ids, out.prompt = known
                    if self.on_outputs is not None:
                        self.on_outputs(outputs, stats)
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
            self._proc.join(timeout=5)
            error = EngineCoreError(f"the engine core died (exit code {self._proc.exitcode}): {e!r}")
        except EngineCoreError as e:
            error = e
        self.error = error
        for future in list(self._calls.values()):
            future.set_result((False, str(error)))
        self._calls.clear()
        if self.on_death is not None:
            self.on_death(error)


def _stop_core(proc, conn) -> None:
    try:
        conn.send(("shutdown",))
    except (OSError, ValueError):
        pass
    proc.join(timeout=30)
    end_process(proc)
    conn.close()
