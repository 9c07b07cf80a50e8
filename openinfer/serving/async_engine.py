"""AsyncLLMEngine: the engine every HTTP request shares, behind coroutines.

Two ways to hold it, the same to the routes:
- an engine core in its own process (`executor/engine_core.py`, what `openinfer serve` runs): requests go to it
  as they come (the client's writer thread sends them), and each step's outputs come back on the client's reader
  thread, which hands them to the event loop in one call; the engine loop's host work and the HTTP side's never
  share an interpreter;
- an `LLMEngine` (or the multi-process front end) stepping in a background thread of this process: coroutines
  post commands (add / abort) to an inbox the engine thread drains between steps.

Either way each request receives DELTA RequestOutputs on its own asyncio.Queue. A stream that ends early (client
gone, task cancelled, request timeout) aborts its request, which frees its KV blocks at the next step boundary.
"""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time
from typing import AsyncIterator, Callable

from openinfer.engine.llm_engine import LLMEngine
from openinfer.executor.engine_core import EngineCoreClient
from openinfer.outputs import RequestOutput
from openinfer.sampling_params import RequestOutputKind, SamplingParams


class QueueFullError(RuntimeError):
    """Too many requests are waiting for a seat; the client should retry later."""


class EngineDeadError(RuntimeError):
    """The engine loop crashed; the server cannot serve requests."""


class RequestTimeoutError(RuntimeError):
    """The request ran past the server's request timeout and was aborted."""


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine | EngineCoreClient, max_waiting: int | None = None,
                 on_step: Callable[[LLMEngine, list[RequestOutput]], None] | None = None,
                 request_timeout_s: float | None = None):
        self.engine = engine
        self.core = engine if isinstance(engine, EngineCoreClient) else None   # None: stepped here
        self.on_dead: Callable[[BaseException], None] | None = None   # the server's: the engine core died
        self.max_waiting = max_waiting
        self.request_timeout_s = request_timeout_s   # from submission (queueing included) to the last output
        self.on_step = on_step
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._num_pending = 0           # submitted, not yet taken by the engine thread
        self._pending_lock = threading.Lock()
        self._wake = threading.Event()
        self._stopping = False
        self._ids = itertools.count()
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name="openinfer-engine", daemon=True)

    # ---- lifecycle --------------------------------------------------------------------------------------
    def start(self) -> None:
        if self.core is None:
            self._thread.start()
            return
        self.core.on_outputs = self._core_outputs
        self.core.on_refused = self._deliver
        self.core.on_death = self._core_died

    def shutdown(self) -> None:
        """Abort what is still running and stop the engine thread."""
        self._stopping = True
        if self.core is None:
            self._wake.set()
            self._thread.join(timeout=30)
            return
        for rid in list(self.core.requests):
            self.core.abort_request(rid)
            self._deliver(rid, EngineDeadError("server is shutting down"))

    @property
    def num_waiting(self) -> int:
        if self.core is not None:       # waiting in the core, and still in the pipe to it
            return self.core.stats()["num_waiting"] + self.core.num_untaken
        return self.engine.stats()["num_waiting"] + self._num_pending

    def new_request_id(self, prefix: str) -> str:
        """A request id unique among the requests of the engine: where several API servers share one engine core,
        each one's ids carry its client number (from the core, never reused)."""
        if self.core is not None and self.core.client_index:
            return f"{prefix}-{self.core.client_index}-{next(self._ids)}"
        return f"{prefix}-{next(self._ids)}"

    # ---- requests ---------------------------------------------------------------------------------------
    async def generate(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str,
                       prompt: str | None = None, images: tuple = ()) -> AsyncIterator[RequestOutput]:
        """Stream DELTA outputs of one request; aborts it if the consumer stops early or the request runs
        past `request_timeout_s` (then RequestTimeoutError). `images`: the prompt's image spans."""
        if self.error is not None:
            raise EngineDeadError(f"engine loop failed: {self.error!r}")
        if self._stopping:
            raise EngineDeadError("server is shutting down")
        if self.max_waiting is not None and self.num_waiting >= self.max_waiting:
            raise QueueFullError(f"server busy: {self.num_waiting} requests already waiting "
                                 f"(max_waiting={self.max_waiting}); retry later")
        self.engine.validate_prompt(prompt_token_ids)
        params.output_kind = RequestOutputKind.DELTA
        q: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), q)
        if self.core is not None:
            try:
                self.core.add_request(prompt_token_ids, params, prompt=prompt, request_id=request_id,
                                      **({"images": images} if images else {}))
            except BaseException:
                self._streams.pop(request_id, None)
                raise
        else:
            with self._pending_lock:
                self._num_pending += 1
            self._inbox.put(("add", request_id, prompt_token_ids, params, prompt, images))
            self._wake.set()
        finished = False
        timeout = self.request_timeout_s
        deadline = None if timeout is None else time.monotonic() + timeout
        held = None           # an item taken while joining deltas, to hand out next
        try:
            while True:
                if held is not None:
                    item, held = held, None
                elif deadline is None:
                    item = await q.get()
                else:
                    try:
                        item = await asyncio.wait_for(q.get(), deadline - time.monotonic())
                    except asyncio.TimeoutError:
                        raise RequestTimeoutError(f"request aborted: it ran past the server's request timeout of "
                                                  f"{timeout:g} s (--request-timeout)") from None
                # a consumer that fell behind (many streams on one event loop) gets what waits as one delta:
                # one chunk to frame and send instead of one per step, so the HTTP side keeps up with the engine
                while not isinstance(item, BaseException) and not item.finished and not q.empty():
                    later = q.get_nowait()
                    if isinstance(later, BaseException):
                        held = later
                        break
                    item = item.followed_by(later)
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        if self.core is not None:
            self.core.abort_request(request_id)
            return
        self._inbox.put(("abort", request_id))
        self._wake.set()

    # ---- an engine core in its own process (the client's reader thread calls these) ---------------------
    def _core_outputs(self, outputs: list[RequestOutput], stats: dict) -> None:
        """A step's outputs to their streams: one hand-over to each event loop for the whole step."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for out in outputs:
            target = self._streams.get(out.request_id)
            if target is not None:
                by_loop.setdefault(target[0], []).append((target[1], out))
        for loop, items in by_loop.items():
            loop.call_soon_threadsafe(_put_all, items)
        if self.on_step is not None:
            self.on_step(self.engine, outputs)

    def _core_died(self, error: BaseException) -> None:
        self.error = error
        for rid in list(self._streams):
            self._deliver(rid, EngineDeadError(f"engine core failed: {error}"))
        if self.on_dead is not None:
            self.on_dead(error)

    # ---- engine thread ----------------------------------------------------------------------------------
    def _deliver(self, request_id: str, item) -> None:
        target = self._streams.get(request_id)
        if target is not None:
            loop, q = target
            loop.call_soon_threadsafe(q.put_nowait, item)

    def _drain_inbox(self) -> None:
        while True:
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "add":
                _, rid, ids, params, prompt, images = cmd
                with self._pending_lock:
                    self._num_pending -= 1
                if rid not in self._streams:      # consumer already gone
                    continue
                try:
                    self.engine.add_request(ids, params, prompt=prompt, request_id=rid,
                                            **({"images": images} if images else {}))
                except Exception as e:          # bad input caught late: report, keep serving
                    self._deliver(rid, e)
            else:
                self.engine.abort_request(cmd[1])

    def _loop(self) -> None:
        try:
            while not self._stopping:
                self._drain_inbox()
                if not self.engine.has_unfinished_requests():
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
                    continue
                outputs = self.engine.step()
                for out in outputs:
                    self._deliver(out.request_id, out)
                if self.on_step is not None:
                    self.on_step(self.engine, outputs)
        except BaseException as e:  # surface to every waiting stream instead of hanging them
            self.error = e
            for rid in list(self._streams):
                self._deliver(rid, EngineDeadError(f"engine loop failed: {e!r}"))
            raise
        finally:
            for rid in list(self.engine.requests):
                self.engine.abort_request(rid)
            for rid in list(self._streams):     # (a request with n > 1 runs under its sequences' ids)
                self._deliver(rid, EngineDeadError("server is shutting down"))


def _put_all(items: list[tuple[asyncio.Queue, object]]) -> None:
    for q, item in items:
        q.put_nowait(item)
