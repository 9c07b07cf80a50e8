"""`openinfer router`: one OpenAI/Anthropic-compatible front door over prefill, decode and whole-request
instances (docs/serving.md).

A request (`/v1/chat/completions`, `/v1/completions`, `/v1/messages`) goes:
  1. when there are prefill instances, to one of them (`pick_prefill`) with one output token and no stream:
     it computes the prompt and leaves its full KV blocks in the prefix-KV store the instances share;
  2. as the client sent it, to a decode (or `both`) instance (`pick_decode`), which finds those blocks in the
     store, computes only the prompt's last partial block and generates; its answer, SSE streams included,
     goes back to the client event by event.
A prefill step that fails (no prefill instance answers) is skipped: the decode instance recomputes, output
unchanged. The store is the only KV transport; nothing moves KV through the router.

Health: a background task reads every instance's `GET /load` every `health_interval_s`. A refused connection,
a dropped one or a 503 drains the instance at once, other failures after `health_failures` in a row; it
comes back when it answers again. Requests in flight on a drained instance are cut: before the first byte
went to the client they are retried on another instance (nothing was sent, so retrying is safe), after it
the client gets a clean error event and the end of the stream. No instance of a needed role: 503 with the
reasons. Instances that disagree on the model, announce another role than the router was told, or (with
prefill instances) do not share the prefill instances' KV store namespace are refused at start, and kept
out if they turn up later.
"""

from __future__ import annotations

import json
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest

from openinfer.serving.balancers import (InstanceState, QuotaRounds, assign_buckets, bucket_of, pick_decode,
                                         pick_prefill, prefill_cost)
from openinfer.serving.disconnect import CancelOnDisconnect
from openinfer.serving.errors import APIError, parse_json_object
from openinfer.serving.http_server import DEFAULT_KEEP_ALIVE_S, check_keep_alive, uvicorn_config
from openinfer.serving.load import prefill_body
from openinfer.serving.upstream import HealthChecked, InstanceDown, Upstream, poll_load, why

logger = logging.getLogger("openinfer.router")

ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/messages")
_FORWARD_HEADERS = ("authorization", "x-api-key", "anthropic-version", "anthropic-beta", "content-type")
_RETRY_STATUS = frozenset({429, 500, 502, 503, 504})     # another instance may answer (nothing sent yet)
DEFAULT_OUTPUT_TOKENS = 256     # decode length estimate of a request without max_tokens


@dataclass
class RouterConfig:
    prefill: list[str] = field(default_factory=list)
    decode: list[str] = field(default_factory=list)
    both: list[str] = field(default_factory=list)
    host: str = "127.0.0.1"
    port: int = 8080
    health_interval_s: float = 2.0
    health_timeout_s: float = 2.0
    health_failures: int = 2            # failed polls in a row (timeouts, errors) that drain an instance
    connect_timeout_s: float = 2.0
    upstream_timeout_s: float = 600.0   # longest silence from an instance mid-request
    quota_round_s: float = 10.0         # the prefill balancer's round (level 1)
    timeout_keep_alive_s: float = DEFAULT_KEEP_ALIVE_S   # idle client connections outlast clients' pools

    def __post_init__(self):
        if not (self.decode or self.both):
            raise ValueError("the router needs at least one --decode or --both instance (prefill instances only "
                             "compute prompts)")
        urls = [u.rstrip("/") for u in self.prefill + self.decode + self.both]
        if len(set(urls)) != len(urls):
            raise ValueError(f"an instance is listed twice: {urls}")
        bad = [u for u in urls if not u.startswith(("http://", "https://"))]
        if bad:
            raise ValueError(f"instance URLs must start with http:// or https://, got {bad}")
        check_keep_alive(self.timeout_keep_alive_s)
        for name in ("health_interval_s", "health_timeout_s", "connect_timeout_s", "upstream_timeout_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.health_failures < 1:
            raise ValueError(f"health_failures must be >= 1, got {self.health_failures}")


class Instance(Upstream):
    def __init__(self, url: str, role: str):
        super().__init__(url)
        self.role = role                  # what the router was told: prefill | decode | both
        self.inflight = 0                 # the router's own view, between two /load reports
        self.inflight_tokens = 0
        self.inflight_cost = 0.0

    def state(self) -> InstanceState:
        ld = self.load
        reported_requests = ld.get("num_requests_running", 0) + ld.get("num_requests_waiting", 0)
        return InstanceState(self.url, num_requests=max(reported_requests, self.inflight),
                             kv_tokens=max(ld.get("kv_tokens", 0), self.inflight_tokens),
                             kv_capacity_tokens=ld.get("kv_capacity_tokens", 0),
                             quota_load=max(float(ld.get("prefill_tokens_queued", 0)), self.inflight_cost),
                             busy=ld.get("busy_fraction", 0.0))

    def describe(self) -> dict:
        keys = ("num_requests_running", "num_requests_waiting", "kv_tokens", "prefill_tokens_queued", "busy_fraction")
        return {"url": self.url, "role": self.role, "healthy": self.healthy,
                **({} if self.healthy else {"reason": self.reason}), "inflight": self.inflight,
                "load": {k: self.load.get(k) for k in keys} if self.load else None}


def estimate_prompt_tokens(body: dict) -> int:
    """The prompt's length without a tokenizer round trip: characters / 4 over its text (prompt, messages,
    system, tools), plus one per token id given as such."""
    chars = ids = 0
    stack = [body.get(k) for k in ("prompt", "messages", "system", "tools")]
    while stack:
        x = stack.pop()
        if isinstance(x, str):
            chars += len(x)
        elif isinstance(x, int) and not isinstance(x, bool):
            ids += 1
        elif isinstance(x, list):
            stack.extend(x)
        elif isinstance(x, dict):
            stack.extend(x.values())
    return ids + (chars + 3) // 4


def _max_output_tokens(body: dict) -> int:
    for key in ("max_completion_tokens", "max_tokens"):
        v = body.get(key)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return DEFAULT_OUTPUT_TOKENS


class Router(HealthChecked):
    def __init__(self, config: RouterConfig, transport: httpx.AsyncBaseTransport | None = None,
                 sync_transport: httpx.BaseTransport | None = None):
        self.config = config
        self.instances = [Instance(u, role) for role in ("prefill", "decode", "both") for u in getattr(config, role)]
        self.prefill_pool = [i for i in self.instances if i.role == "prefill"]
        self.decode_pool = [i for i in self.instances if i.role != "prefill"]
        self.model: str | None = None
        self.namespace: str | None = None        # the prefill instances' KV store namespace
        self.rounds = QuotaRounds(config.quota_round_s)
        self._transport, self._sync_transport = transport, sync_transport
        r = self.registry = CollectorRegistry()
        self.m_requests = Counter("openinfer:router_requests", "Requests answered, by route and status.",
                                  ["route", "status"], registry=r)
        self.m_routed = Counter("openinfer:router_routed", "Requests sent to an instance (retries included).",
                                ["instance", "role"], registry=r)
        self.m_retries = Counter("openinfer:router_retries", "Requests sent again to another instance after one "
                                 "failed before answering.", ["role"], registry=r)
        self.m_fallbacks = Counter("openinfer:router_prefill_fallbacks", "Requests decoded without a prefill "
                                   "step (no prefill instance answered): the decode instance recomputed.", registry=r)
        self.m_cut = Counter("openinfer:router_streams_cut", "Streams ended with an error event because their "
                             "instance failed after the first byte.", registry=r)
        healthy = Gauge("openinfer:router_instance_healthy", "1 if the instance is routed to, 0 if drained.",
                        ["instance", "role"], registry=r)
        for inst in self.instances:
            healthy.labels(inst.url, inst.role).set_function(lambda inst=inst: float(inst.healthy))

    # ---- instance checks ---------------------------------------------------------------------------------
    def _mismatch(self, inst: Instance, load: dict) -> str | None:
        role = load.get("role", "both")
        if role == "encoder":
            return ("its role is 'encoder' (a vision encoder: list it in the prefill or both instances' --encoder, "
                    "not in the router)")
        if inst.role == "prefill" and role != "prefill":
            return f"given as --prefill but its role is {role!r} (start it with --role prefill)"
        if inst.role != "prefill" and role == "prefill":
            return f"given as --{inst.role} but its role is 'prefill' (it would answer with one token)"
        if self.model is not None and load.get("model") != self.model:
            return f"serves model {load.get('model')!r}, the others {self.model!r}"
        if self.prefill_pool and inst.role == "decode":
            ns = load.get("kv_store_namespace")
            if ns is None:
                return ("a decode instance without a shared prefix-KV store (--kv-store-dir / --kv-store-url): "
                        "it would recompute every prompt the prefill instances computed")
            if self.namespace is not None and ns != self.namespace:
                return (f"its KV store namespace {ns} differs from the prefill instances' {self.namespace} "
                        f"(another model, dtype, block size or store): their blocks would never be hits here")
        return None

    def _accept(self, inst: Instance, load: dict) -> None:
        if self.model is None:
            self.model = load.get("model")
        if inst.role == "prefill" and self.namespace is None:
            self.namespace = load.get("kv_store_namespace")

    def verify(self) -> None:
        """At start: read every instance's /load once; refuse (ValueError) instances that disagree. Those not
        answering yet start drained (and are checked when they answer)."""
        loads = {}
        with httpx.Client(timeout=self.config.health_timeout_s, transport=self._sync_transport) as client:
            for inst in self.instances:
                try:
                    r = client.get(inst.url + "/load")
                    r.raise_for_status()
                    loads[inst.url] = r.json()
                except (httpx.HTTPError, ValueError) as e:
                    inst.reason = f"not answering at start: {why(e) if isinstance(e, httpx.TransportError) else e}"
                    logger.warning("router: %s %s", inst.url, inst.reason)
        models = {url: ld.get("model") for url, ld in loads.items()}
        if len(set(models.values())) > 1:
            raise ValueError(f"the instances serve different models: {models}")
        ordered = self.prefill_pool + self.decode_pool          # the prefill instances set the store namespace
        problems = []
        for inst in ordered:
            if inst.url not in loads:
                continue
            problem = self._mismatch(inst, loads[inst.url])
            if problem:
                problems.append(f"{inst.url}: {problem}")
                continue
            self._accept(inst, loads[inst.url])
            inst.load, inst.healthy, inst.reason = loads[inst.url], True, ""
        if problems:
            raise ValueError("refusing to route over mismatched instances: " + "; ".join(problems))

    async def poll(self, inst: Instance) -> None:
        c = self.config
        load = await poll_load(self.client, inst, c.health_timeout_s, c.health_failures,
                               lambda load: self._mismatch(inst, load))
        if load is not None:
            self._accept(inst, load)

    def polled(self) -> list[Instance]:
        return self.instances

    async def start(self) -> None:
        c = self.config
        await self.start_polling(httpx.AsyncClient(
            transport=self._transport, limits=httpx.Limits(max_connections=1000, max_keepalive_connections=100),
            timeout=httpx.Timeout(c.upstream_timeout_s, connect=c.connect_timeout_s)), c.health_interval_s)

    # ---- requests ----------------------------------------------------------------------------------------
    def _candidates(self, pool: list[Instance], tried: set[str]) -> list[Instance]:
        return [i for i in pool if i.healthy and i.url not in tried]

    async def _prefill(self, path: str, body: dict, tokens: int, headers: dict) -> Response | None:
        """Step 1. None when done (or skipped: the decode instance then recomputes); a Response for the client
        when the prefill instance refused the request itself (bad input answers the same everywhere)."""
        pbody = prefill_body(path, body, stream=False)
        cost = prefill_cost(tokens)
        now = time.monotonic()
        self.rounds.add(bucket_of(tokens), cost, now)
        tried: set[str] = set()
        while cands := self._candidates(self.prefill_pool, tried):
            healthy = sorted(i.url for i in self.prefill_pool if i.healthy)
            pick = pick_prefill([i.state() for i in cands], tokens, assign_buckets(healthy, self.rounds.demand(now)))
            inst = next(i for i in cands if i.url == pick.url)
            tried.add(inst.url)
            if len(tried) > 1:
                self.m_retries.labels("prefill").inc()
            self.m_routed.labels(inst.url, "prefill").inc()
            inst.inflight += 1
            inst.inflight_cost += cost
            try:
                r = await inst.until_down(self.client.post(inst.url + path, json=pbody, headers=headers))
            except (httpx.HTTPError, InstanceDown) as e:
                inst.failed(e, self.config.health_failures)
                continue
            finally:
                inst.inflight -= 1
                inst.inflight_cost -= cost
            if r.status_code == 200:
                return None
            if r.status_code not in _RETRY_STATUS:
                return Response(r.content, r.status_code, media_type=r.headers.get("content-type"))
        self.m_fallbacks.inc()
        return None

    async def _decode(self, path: str, raw: bytes, body: dict, tokens: int, headers: dict) -> Response:
        """Step 2: the request as sent, to the decode pool; retried on another instance while nothing has
        reached the client."""
        stream = body.get("stream") is True
        need = tokens + _max_output_tokens(body)
        tried: set[str] = set()
        reasons, last = [], None
        while cands := self._candidates(self.decode_pool, tried):
            pick = pick_decode([i.state() for i in cands], need)
            inst = next(i for i in cands if i.url == pick.url)
            tried.add(inst.url)
            if len(tried) > 1:
                self.m_retries.labels("decode").inc()
            self.m_routed.labels(inst.url, inst.role).inc()
            inst.inflight += 1
            inst.inflight_tokens += need
            handed_over = False
            try:
                req = self.client.build_request("POST", inst.url + path, content=raw, headers=headers)
                r = await inst.until_down(self.client.send(req, stream=True))
                if r.status_code == 200 and stream:
                    events = _sse_events(r.aiter_bytes())
                    try:
                        first = await inst.until_down(events.__anext__())
                    except StopAsyncIteration:
                        first = b""
                    except BaseException:
                        await r.aclose()
                        raise
                    handed_over = True
                    return StreamingResponse(self._relay(inst, r, events, first, path, need),
                                             media_type=r.headers.get("content-type", "text/event-stream"),
                                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
                try:
                    await inst.until_down(r.aread())
                finally:
                    await r.aclose()
            except (httpx.HTTPError, InstanceDown) as e:
                inst.failed(e, self.config.health_failures)
                reasons.append(f"{inst.url}: {why(e)}")
                continue
            finally:
                if not handed_over:
                    inst.inflight -= 1
                    inst.inflight_tokens -= need
            if r.status_code in _RETRY_STATUS:
                reasons.append(f"{inst.url}: answered {r.status_code}")
                last = r
                continue
            return Response(r.content, r.status_code, media_type=r.headers.get("content-type"))
        if last is not None:           # every instance refused (busy, failing): the last one's answer
            return Response(last.content, last.status_code, media_type=last.headers.get("content-type"))
        down = [f"{i.url}: {i.reason}" for i in self.decode_pool if not i.healthy and i.url not in tried]
        raise APIError(503, "no healthy decode instance (" + "; ".join(reasons + down) + ")")

    async def _relay(self, inst: Instance, r: httpx.Response, events, first: bytes, path: str, need: int):
        """The instance's SSE events to the client; if the instance fails now, an error event and the end."""
        try:
            if first:
                yield first
            while True:
                try:
                    event = await inst.until_down(events.__anext__())
                except StopAsyncIteration:
                    return
                yield event
        except (httpx.HTTPError, InstanceDown) as e:
            inst.failed(e, self.config.health_failures)
            self.m_cut.inc()
            err = APIError(502, f"the instance serving this stream failed mid-answer ({inst.url}: {why(e)}); "
                                f"the answer is incomplete")
            if path == "/v1/messages":
                yield f"event: error\ndata: {json.dumps(err.body(True))}\n\n".encode()
            else:
                yield f"data: {json.dumps(err.body(False))}\n\ndata: [DONE]\n\n".encode()
        finally:
            inst.inflight -= 1
            inst.inflight_tokens -= need
            await r.aclose()

    async def handle(self, request: Request, path: str) -> Response:
        raw = await request.body()
        body = parse_json_object(raw)
        headers = {k: v for k in _FORWARD_HEADERS if (v := request.headers.get(k)) is not None}
        tokens = estimate_prompt_tokens(body)
        if self.prefill_pool:
            answer = await self._prefill(path, body, tokens, headers)
            if answer is not None:
                return answer
        return await self._decode(path, raw, body, tokens, headers)


async def _sse_events(chunks):
    """Whole SSE events (up to and including their blank line) from a byte stream cut anywhere, so an error
    event sent after a failure never lands inside a half-sent one."""
    buf = b""
    async for chunk in chunks:
        buf += chunk
        while (end := buf.find(b"\n\n")) >= 0:
            yield buf[:end + 2]
            buf = buf[end + 2:]
    if buf:
        yield buf


def build_router_app(router: Router) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await router.start()
        yield
        await router.stop()

    app = FastAPI(title="openinfer router", lifespan=lifespan)
    app.state.router = router

    @app.exception_handler(APIError)
    async def _api_error(request: Request, err: APIError):
        router.m_requests.labels(request.url.path, str(err.status)).inc()
        return JSONResponse(err.body(request.url.path == "/v1/messages"), status_code=err.status)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, err: Exception):
        return JSONResponse(APIError(500, f"router error: {type(err).__name__}: {err}").body(
            request.url.path == "/v1/messages"), status_code=500)

    app.add_middleware(CancelOnDisconnect, paths=frozenset(ROUTES), on_disconnect=lambda path: None)

    def route(path: str):
        async def handler(request: Request):
            response = await router.handle(request, path)
            router.m_requests.labels(path, str(response.status_code)).inc()
            return response
        handler.__name__ = "route_" + path.strip("/").replace("/", "_")
        return handler

    for path in ROUTES:
        app.post(path)(route(path))

    @app.get("/health")
    async def health():
        ok = any(i.healthy for i in router.decode_pool)
        return JSONResponse({"status": "ok" if ok else "unavailable", "model": router.model,
                             "instances": [i.describe() for i in router.instances]}, status_code=200 if ok else 503)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": router.model, "object": "model", "created": int(time.time()),
                                            "owned_by": "openinfer"}] if router.model else []}

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(router.registry), media_type=CONTENT_TYPE_LATEST)

    return app


def run_router(config: RouterConfig) -> None:
    import uvicorn

    router = Router(config)
    router.verify()
    uvicorn.Server(uvicorn_config(build_router_app(router), config.host, config.port,
                                  config.timeout_keep_alive_s)).run()
