"""cancel_on_disconnect: a request whose client hangs up is cancelled, streaming or not.

An ASGI middleware around the generation routes. Once the route has read the whole request body, a
watcher waits on the server's `receive()` for `http.disconnect`; if that comes before the response is
complete, the route's task is cancelled. The cancellation unwinds through `AsyncLLMEngine.generate`, whose
`finally` aborts the engine request, so its KV blocks go back to the pool at the next step boundary. This is
one mechanism for every endpoint and both response kinds (vLLM aborts a request when its HTTP client
disconnects, streaming or not); polling `Request.is_disconnected()` from each route is not needed.
"""

from __future__ import annotations

import asyncio
from typing import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send


class CancelOnDisconnect:
    def __init__(self, app: ASGIApp, paths: frozenset[str], on_disconnect: Callable[[str], None]):
        self.app = app
        self.paths = paths                  # routes to guard (exact paths)
        self.on_disconnect = on_disconnect  # called with the path of each request cancelled this way

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] not in self.paths:
            await self.app(scope, receive, send)
            return
        body_read = asyncio.Event()
        response_done = False

        async def receive_body() -> Message:
            message = await receive()
            if message["type"] != "http.request" or not message.get("more_body", False):
                body_read.set()             # from now on only a disconnect can arrive: safe to watch
            return message

        async def send_response(message: Message) -> None:
            nonlocal response_done
            if message["type"] == "http.response.body" and not message.get("more_body", False):
                response_done = True
            await send(message)

        route = asyncio.ensure_future(self.app(scope, receive_body, send_response))

        async def watch() -> None:
            await body_read.wait()
            while (await receive())["type"] != "http.disconnect":
                pass
            if not response_done:           # cut short (the route may already have noticed: then a no-op)
                self.on_disconnect(scope["path"])
                route.cancel()

        watcher = asyncio.ensure_future(watch())
        try:
            await asyncio.shield(route)
        except asyncio.CancelledError:
            if not route.cancelled():       # this middleware itself was cancelled (server shutdown)
                route.cancel()
                raise
        finally:
            watcher.cancel()
