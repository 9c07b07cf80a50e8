"""A real openinfer server on loopback (uvicorn in a background thread of the test process), so tests can
talk HTTP to it and still look at the engine's block pool."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import uvicorn

from openinfer import LLM
from openinfer.serving.api_server import ServerConfig, build_app


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LiveServer:
    def __init__(self, model: str, served_model_name: str | None = None, api_key: str | None = None,
                 max_waiting: int | None = None, **engine_options):
        self.llm = LLM(model, device="cpu", **engine_options)
        self.engine = self.llm.engine
        self.port = _free_port()
        self.config = ServerConfig(port=self.port, api_key=api_key, served_model_name=served_model_name,
                                   max_waiting=max_waiting, graceful_shutdown_s=2)
        self.app = build_app(self.engine, self.config, model)
        self.served = self.app.state.served_model_name
        self.base_url = f"http://127.0.0.1:{self.port}"
        self._server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning"))
        self._thread = threading.Thread(target=self._server.run, daemon=True)

    def __enter__(self) -> "LiveServer":
        self._thread.start()
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                if httpx.get(self.base_url + "/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                time.sleep(0.1)
        raise RuntimeError("server did not come up")

    def __exit__(self, *exc) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=30)

    def wait_idle(self, timeout: float = 20.0) -> bool:
        """True once no request is left and every KV block is free again."""
        deadline = time.time() + timeout
        kv = self.engine.kv_manager
        while time.time() < deadline:
            if not self.engine.has_unfinished_requests() and kv.num_free_blocks == kv.num_blocks:
                return True
            time.sleep(0.05)
        return False
