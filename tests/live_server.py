"""A real openinfer server on loopback (uvicorn in a background thread of the test process) over an engine core in
its own process, as `openinfer serve` runs it; tests talk HTTP to it and read the core's numbers (its block pool,
queues, prefix-cache counters) through the client (`engine.stats()` as of its last step, `engine.call("stats")`
now)."""

from __future__ import annotations

import socket
import subprocess
import threading
import time

import httpx
import uvicorn

from openinfer.config import EngineConfig
from openinfer.executor.engine_core import EngineCoreClient
from openinfer.serving.api_server import ServerConfig, build_app
from openinfer.serving.http_server import uvicorn_config


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(base_url: str, timeout: float, proc=None, ok: tuple[int, ...] = (200,)) -> bool:
    """Poll `base_url`/health until it answers a status in `ok` (True), or `proc` (a server process) exits or
    `timeout` seconds pass (False). One client for every poll: `httpx.get` builds a client and an SSL context each
    time (~35 ms of CPU every 0.2 s, a sixth of a core taken from the server starting beside it)."""
    deadline = time.time() + timeout
    with httpx.Client(timeout=1) as client:
        while time.time() < deadline and (proc is None or proc.poll() is None):
            try:
                if client.get(base_url + "/health").status_code in ok:
                    return True
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
    return False


def wait_up(base: str, timeout: float, proc: subprocess.Popen | None = None, log: str | None = None) -> None:
    """Until `base`/health answers (200 or 503); RuntimeError with the log's tail if `proc` exits first or time runs
    out."""
    if wait_healthy(base, timeout, proc, ok=(200, 503)):
        return
    if proc is not None and proc.poll() is not None:
        raise RuntimeError(f"{base} exited with {proc.returncode}: {open(log).read()[-3000:] if log else ''}")
    raise RuntimeError(f"{base} did not come up" + (f": {open(log).read()[-3000:]}" if log else ""))


class LiveServer:
    owns_engine = False         # whether __exit__ shuts the engine down (subclasses may serve an engine they keep)

    def __init__(self, model: str, served_model_name: str | None = None, api_key: str | None = None,
                 max_waiting: int | None = None, server_options: dict | None = None, **engine_options):
        """`server_options`: more ServerConfig fields (role, encoders, ...)."""
        self.engine = EngineCoreClient(EngineConfig(model=model, device="cpu", **engine_options))
        self.owns_engine = True
        self.tokenizer = self.engine.tokenizer
        self.port = _free_port()
        self.config = ServerConfig(port=self.port, api_key=api_key, served_model_name=served_model_name,
                                   max_waiting=max_waiting, graceful_shutdown_s=2, **(server_options or {}))
        self.app = build_app(self.engine, self.config, model)
        self.served = self.app.state.served_model_name
        self.base_url = f"http://127.0.0.1:{self.port}"
        self._server = uvicorn.Server(uvicorn_config(self.app, "127.0.0.1", self.port,      # as run_server's
                                                     self.config.timeout_keep_alive_s, log_level="warning"))
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    def __enter__(self) -> "LiveServer":
        self._thread.start()
        if wait_healthy(self.base_url, 60):
            return self
        raise RuntimeError("server did not come up")

    def __exit__(self, *exc) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=30)
        if self.owns_engine:
            self.engine.shutdown()

    def wait_idle(self, timeout: float = 20.0) -> bool:
        """True once no request is left (here or in the core) and every KV block is free again."""
        deadline = time.time() + timeout
        while time.time() < deadline:
            # the core's numbers now (an engine in this process: its own)
            st = self.engine.call("stats") if isinstance(self.engine, EngineCoreClient) else self.engine.stats()
            if (not self.engine.has_unfinished_requests() and st["num_running"] == st["num_waiting"] == 0
                    and st["kv_blocks_free"] == st["kv_blocks_total"]):
                return True
            time.sleep(0.05)
        return False
