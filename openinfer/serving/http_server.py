"""The uvicorn server every openinfer HTTP process runs (API servers, the encoder role, the router), with one
keep-alive rule: an idle connection is kept open longer than clients keep it in their pools.

HTTP/1.1 lets either side close an idle keep-alive connection, and a client may send its next request on a pooled
connection at the moment the server closes it: the request meets a closed socket, and the client sees a connection
reset before any response (httpx: `ReadError` or `RemoteProtocolError`; a POST is not retried). Only the side
that closes first can avoid this, and that must be the client: the server's idle timeout has to outlast the
client's with a margin. uvicorn's default (5 s) equals httpx's `keepalive_expiry` (5 s; the OpenAI and Anthropic
SDKs are httpx clients), and the client's clock starts later than the server's, when it has read the response's
end (on a busy client, seconds later), so under load such a client reuses connections the server has just closed.
Measured on `openinfer bench serve` at 256 streams (BENCHMARKS.md, "The server at the engine's speed"): the failed
request of issue 41 is this race.

`DEFAULT_KEEP_ALIVE_S` outlasts the common clients and proxies (httpx and the SDKs over it 5 s, aiohttp 15 s,
nginx's upstream and AWS ALB's idle timeouts 60 s, Go's net/http 90 s, libcurl 118 s); behind a proxy that keeps
idle connections longer, raise `--timeout-keep-alive` above its timeout.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import uvicorn

DEFAULT_KEEP_ALIVE_S = 120.0


def check_keep_alive(seconds: float) -> None:
    if not (isinstance(seconds, (int, float)) and seconds > 0):
        raise ValueError(f"the keep-alive timeout (--timeout-keep-alive) must be > 0 seconds, got {seconds!r}")


def uvicorn_config(app, host: str, port: int, keep_alive_s: float, log_level: str = "info",
                   graceful_shutdown_s: float | None = None) -> "uvicorn.Config":
    """uvicorn's config for `app` on (host, port): idle connections kept `keep_alive_s` seconds."""
    import uvicorn

    check_keep_alive(keep_alive_s)
    return uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_keep_alive=keep_alive_s,
                          timeout_graceful_shutdown=graceful_shutdown_s)
