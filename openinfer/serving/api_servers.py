"""Several API-server processes over one engine core: `openinfer serve --api-server-count N` (vLLM's option).

One API-server process (HTTP, protocol conversion, tokenization, SSE framing) frames a chunk per stream per step;
on the H200 at 256 streams that is ~22K chunks/s, more than one interpreter keeps up with, and the engine loop
waited on it (BENCHMARKS.md, "The server at the engine's speed"). N processes share that work; one engine core
(executor/engine_core.py) serves them all.

- **This process supervises.** It binds the sockets, starts the engine core (`EngineCoreClient(...,
  accept_clients=True)`) and makes its KV pool resident, then starts N API servers from the fork server the core
  came from (torch already imported: a start or restart takes seconds). It serves no HTTP itself.
- **One port, N sockets.** N TCP sockets are bound here to the address with SO_REUSEPORT (Linux), one handed to
  each API server, which listens on it once its app is built. The kernel spreads new connections over the
  listening sockets by a hash of their addresses: a burst of connections lands evenly (one shared socket would give
  most of a burst to whichever process woke first: asyncio accepts in a loop), and no connection waits on an API
  server still starting. The supervisor keeps its copies, so a restarted API server takes over its socket and the
  connections queued on it.
- **Each API server is a client of the core** (`EngineCoreClient.connect`) with a number of its own: its request ids
  carry it, the core sends it only its requests' outputs (and the core's stats, every step), its aborts touch only
  its requests, its calls (stats, flush, ...) are answered to it.
- **Metrics.** The core's numbers (gauges, step and prefix-cache counters, /load) come from the core's stats, which
  every API server holds as of the last step: any of them answers the same. Per-request series (tokens, finished
  requests, latencies, aborts) are counted by the API server that served the request and summed over all of them
  at scrape time by prometheus_client's multiprocess mode, over a directory of this server's (serving/metrics.py).
- **Lifecycle.** SIGTERM or SIGINT: every API server stops accepting and lets its requests finish (up to the
  graceful timeout), then the core stops; exit 0, no process left. An API server that dies after it came up is
  restarted (the core aborted its requests when its connection closed: their clients see the connection drop); one
  that fails while starting, or a fourth death within a minute, stops the server with exit 1 (a bug to see, not to
  hide). The core dying: every API server answers 503 to what it has in flight and exits, and so does this process,
  with 1 (as one API server does: a supervisor restarts the instance).
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import multiprocessing.connection as mpc
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from typing import TYPE_CHECKING

from openinfer.config import EngineConfig
from openinfer.executor.engine_core import CoreAddress, EngineCoreClient
from openinfer.executor.worker import rank_process_context
from openinfer.models.interface import ResolvedModel

if TYPE_CHECKING:      # (not imported here: an API server imports prometheus_client only once its mode is set)
    from openinfer.serving.api_server import ServerConfig

logger = logging.getLogger("openinfer.serving")

_RESTARTS_PER_MINUTE = 3


def bind_sockets(host: str, port: int, n: int) -> list[socket.socket]:
    """`n` TCP sockets bound to (host, port) with SO_REUSEPORT, not listening yet (each API server listens when it
    is ready). The address is first bound without SO_REUSEPORT and let go, so a port another server listens on is
    refused here ("address in use") rather than shared with it; port 0 picks one free port for all `n`."""
    family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                      flags=socket.AI_PASSIVE)[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        probe.bind(addr)
        addr = probe.getsockname()
    socks: list[socket.socket] = []
    try:
        for _ in range(n):
            s = socket.socket(family, kind, proto)
            socks.append(s)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            s.bind(addr)
    except BaseException:
        for s in socks:
            s.close()
        raise
    return socks


def run_api_servers(engine_config: EngineConfig, config: ServerConfig, model_name: str) -> int:
    """Serve with `config.api_server_count` API servers over one engine core until SIGTERM/SIGINT (0) or the
    core's death (1)."""
    socks = bind_sockets(config.host, config.port, config.api_server_count)
    metrics_dir = tempfile.mkdtemp(prefix="openinfer-metrics-")
    core = None
    try:
        core = EngineCoreClient(engine_config, accept_clients=True)
        core.touch_cache_pages()
        return _Supervisor(core, config, model_name, socks, metrics_dir).run()
    finally:
        for s in socks:
            s.close()
        if core is not None:
            core.shutdown()
        shutil.rmtree(metrics_dir, ignore_errors=True)


class _Supervisor:
    def __init__(self, core: EngineCoreClient, config: ServerConfig, model_name: str, socks: list[socket.socket],
                 metrics_dir: str):
        self.core, self.config, self.model_name = core, config, model_name
        self.socks, self.metrics_dir = socks, metrics_dir
        self.ctx = rank_process_context()
        n = len(socks)
        self.procs: list = [None] * n
        self.up_pipes: list = [None] * n      # each API server says "up" here once its app is built
        self.is_up = [False] * n
        self.restarts: collections.deque[float] = collections.deque()
        self.signals = 0

    def run(self) -> int:
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            for i in range(len(self.socks)):
                self._start(i)
            return self._watch()
        finally:
            self._stop()
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _on_signal(self, *_) -> None:
        self.signals += 1          # the first: a graceful stop; a second one while stopping: no more waiting

    def _start(self, i: int) -> None:
        up_r, up_w = self.ctx.Pipe(duplex=False)
        proc = self.ctx.Process(target=api_server_main, name=f"openinfer-api-server-{i}", daemon=True,
                                args=(i, self.core.config, self.core.model_source, dataclasses.asdict(self.config),
                                      self.model_name, self.socks[i], self.core.address, self.metrics_dir, up_w,
                                      os.getpid()))
        proc.start()
        up_w.close()
        self.procs[i], self.up_pipes[i], self.is_up[i] = proc, up_r, False

    def _core_dead(self) -> bool:
        return self.core.error is not None or bool(mpc.wait([self.core.sentinel], timeout=0))

    def _watch(self) -> int:
        announced = False
        while not self.signals:
            if self._core_dead():
                logger.error("the engine core died: the API servers answer 503 to what they have in flight; "
                             "stopping the server")
                return 1
            pipes = [p for p in self.up_pipes if p is not None]
            mpc.wait([p.sentinel for p in self.procs] + pipes + [self.core.sentinel], timeout=0.2)
            for i, pipe in enumerate(self.up_pipes):
                if pipe is not None and pipe.poll(0):
                    try:
                        pipe.recv()
                        self.is_up[i] = True
                    except EOFError:       # gone before it came up: its sentinel says so below
                        pass
                    pipe.close()
                    self.up_pipes[i] = None
            if not announced and all(self.is_up):
                announced = True
                host, port = self.socks[0].getsockname()[:2]
                print(f"[openinfer] {len(self.procs)} API servers on http://{host}:{port} over one engine core",
                      file=sys.stderr, flush=True)
            for i, proc in enumerate(self.procs):
                if proc.is_alive() or self.signals or self._core_dead():
                    continue
                if not self.is_up[i]:
                    logger.error("API server %d failed while starting (exit code %s); stopping the server", i,
                                 proc.exitcode)
                    return 1
                now = time.monotonic()
                while self.restarts and self.restarts[0] < now - 60:
                    self.restarts.popleft()
                if len(self.restarts) >= _RESTARTS_PER_MINUTE:
                    logger.error("API server %d died (exit code %s), the %d-th death within a minute; stopping "
                                 "the server", i, proc.exitcode, len(self.restarts) + 1)
                    return 1
                self.restarts.append(now)
                logger.warning("API server %d (pid %d) died (exit code %s); the core aborted its requests; "
                               "restarting it", i, proc.pid, proc.exitcode)
                self._start(i)
        return 0

    def _stop(self) -> None:
        """Every API server stops gracefully (SIGTERM: in-flight requests finish, up to the graceful timeout), a
        second signal or the timeout past, by force."""
        for s in self.socks:      # nothing new queues on a socket no API server will accept from
            s.close()
        alive = [p for p in self.procs if p is not None and p.is_alive()]
        for p in alive:
            p.terminate()
        deadline = time.monotonic() + self.config.graceful_shutdown_s + 10
        for p in alive:
            while p.is_alive() and time.monotonic() < deadline and self.signals < 2:
                p.join(timeout=0.2)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)


def api_server_main(index: int, engine_config: EngineConfig, model: ResolvedModel, server_options: dict,
                    model_name: str, sock: socket.socket, address: CoreAddress, metrics_dir: str, up,
                    parent_pid: int) -> None:
    """One API server: a client of the core, the app over it on `sock`; says "up" on `up` once the app is built.
    Its server options come as a dict: the ServerConfig class lives beside prometheus_client's first import, which
    must come after PROMETHEUS_MULTIPROC_DIR is set (prometheus_client reads it once, when imported)."""
    from openinfer.executor.worker import _exit_with_parent

    _exit_with_parent(parent_pid)
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics_dir
    from openinfer.serving.api_server import ServerConfig, run_server

    # Ctrl-C reaches every process of the terminal's group: uvicorn takes it as SIGTERM while serving; before and
    # after, the supervisor's SIGTERM is the one that counts
    signal.signal(signal.SIGINT, lambda *_: None)
    client = EngineCoreClient.connect(engine_config, model, address)
    try:
        code = run_server(client, ServerConfig(**server_options), model_name, sock=sock, metrics_dir=metrics_dir,
                          on_ready=lambda: up.send(index))
    finally:
        client.shutdown()
    sys.exit(code)
