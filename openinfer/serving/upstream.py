"""An upstream instance's health as a client of it sees it (docs/serving.md, "Health, retries, errors"): the router
over its prefill and decode instances, and a prefill instance over its vision-encoder instances (docs/vision.md,
EPD), both read each instance's `GET /load` every few seconds and drain it on failure.

- `Upstream`: one instance's state. A refused or dropped connection, or a 503, drains it at once; other failures
  (timeouts) after `failures_to_drain` in a row. It is back as soon as `/load` answers again, unless it was found
  to be the wrong instance (`excluded`: another model or role), which keeps it out.
- `until_down`: a call to the instance that gives up as soon as the instance is drained (a health check failed
  meanwhile), instead of waiting for its socket timeout.
- `poll_load`: one health check; `HealthChecked`: a client of several instances, polling them all in a task.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable, Sequence

import httpx

logger = logging.getLogger("openinfer.upstream")


class InstanceDown(Exception):
    """The instance was drained while a request waited on it."""


def why(e: Exception) -> str:
    """A failed call, in a few words (for /health's reasons and 503 messages)."""
    if isinstance(e, InstanceDown):
        return f"drained ({e})"
    if isinstance(e, httpx.ConnectError):
        return "connection refused"
    if isinstance(e, httpx.TimeoutException):
        return f"no answer in time ({type(e).__name__})"
    return f"connection lost ({type(e).__name__})"


class Upstream:
    def __init__(self, url: str):
        self.url = url.rstrip("/")
        self.healthy = False
        self.reason = "not checked yet"
        self.failures = 0
        self.excluded: str | None = None  # a mismatch (model, role, store): never used
        self.load: dict = {}              # its last /load report
        self.down = asyncio.Event()       # set while drained; calls waiting on it give up

    def mark_down(self, reason: str) -> None:
        self.reason = reason
        if self.healthy:
            logger.warning("draining %s (%s)", self.url, reason)
            self.healthy = False
            self.down.set()

    def mark_up(self, load: dict) -> None:
        self.load, self.failures = load, 0
        if not self.healthy:
            logger.info("%s is back", self.url)
            self.down = asyncio.Event()
            self.healthy, self.reason = True, ""

    def failed(self, e: Exception, failures_to_drain: int) -> None:
        """A poll or a call failed: refused, dropped or drained meanwhile drains it at once; other failures
        (timeouts) after `failures_to_drain` in a row."""
        if isinstance(e, InstanceDown):
            return
        self.failures += 1
        definitive = isinstance(e, (httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError,
                                    httpx.WriteError))
        if definitive or self.failures >= failures_to_drain:
            self.mark_down(why(e))

    async def until_down(self, awaitable):
        """Await `awaitable` unless this instance is drained first (then InstanceDown, and the call is cancelled)."""
        task = asyncio.ensure_future(awaitable)
        down = asyncio.ensure_future(self.down.wait())
        try:
            done, _ = await asyncio.wait({task, down}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            task.cancel()
            raise
        finally:
            down.cancel()
        if task in done:
            return task.result()
        task.cancel()
        raise InstanceDown(self.reason)


async def poll_load(client: httpx.AsyncClient, inst: Upstream, timeout_s: float, failures_to_drain: int,
                    mismatch: Callable[[dict], str | None]) -> dict | None:
    """One health check: `inst`'s /load, or None when it failed (the instance drained as `failed` says, or at once
    when it answered 503, no JSON, or something `mismatch` names: that one is excluded for good)."""
    try:
        r = await client.get(inst.url + "/load", timeout=timeout_s)
    except httpx.HTTPError as e:
        inst.failed(e, failures_to_drain)
        return None
    if r.status_code != 200:
        inst.failures += 1
        if r.status_code == 503 or inst.failures >= failures_to_drain:
            inst.mark_down(f"/load answered {r.status_code}")
        return None
    try:
        load = r.json()
    except ValueError:
        inst.mark_down("/load answered no JSON")
        return None
    problem = inst.excluded or mismatch(load)
    if problem:
        inst.excluded = problem
        inst.mark_down(problem)
        return None
    inst.mark_up(load)
    return load


class HealthChecked:
    """A client of several upstream instances: one HTTP client, and a task that health-checks every instance
    (`poll`) every `interval_s` seconds, from `start_polling` until `stop`."""
    client: httpx.AsyncClient | None = None
    _health_task: asyncio.Task | None = None

    def polled(self) -> Sequence[Upstream]:
        raise NotImplementedError

    async def poll(self, inst: Upstream) -> None:
        raise NotImplementedError

    async def start_polling(self, client: httpx.AsyncClient, interval_s: float) -> None:
        self.client = client

        async def loop():
            while True:
                await asyncio.gather(*(self.poll(i) for i in self.polled()))
                await asyncio.sleep(interval_s)
        self._health_task = asyncio.create_task(loop())

    async def stop(self) -> None:
        if self._health_task is not None:
            self._health_task.cancel()
        if self.client is not None:
            await self.client.aclose()
