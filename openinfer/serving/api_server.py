"""`openinfer serve`: the FastAPI app (OpenAI- and Anthropic-compatible) over one AsyncLLMEngine.

Routes: /health, /load, /v1/models, /v1/completions, /v1/chat/completions, /v1/responses, /v1/messages,
/metrics, /tokenize, /detokenize. Errors are OpenAI-shaped (Anthropic-shaped on /v1/messages); bad input is a 4xx,
never a 5xx or a hang. A client that disconnects aborts its request, streaming or not (`disconnect.py`); its
KV blocks are freed. `request_timeout_s` bounds a request's life (queueing included): past it the request is
aborted and answers 408 (or, once streaming, an error event).

Roles (prefill/decode disaggregation through the shared prefix-KV store, docs/serving.md): `both` serves
requests whole; `prefill` (needs a shared store tier) runs each request to one output token, waits until the
store holds its prompt's full blocks and answers; `decode` serves requests whole, its prompts' full blocks
found in the store. `/load` reports what the router balances on (serving/load.py). (`encoder`, the vision tower
alone, is another app: serving/encoder_server.py.) With `encoders` (EPD, docs/vision.md), a request's images are
sent to those vision-encoder instances before it enters the engine (serving/encoder_pool.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import signal
import socket
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from openinfer.engine.llm_engine import LLMEngine
from openinfer.executor.engine_core import EngineCoreClient
from openinfer.serving.async_engine import AsyncLLMEngine, EngineDeadError, QueueFullError, RequestTimeoutError
from openinfer.serving.chat import ChatFrontend
from openinfer.serving.completions import CompletionsFrontend
from openinfer.serving.disconnect import CancelOnDisconnect
from openinfer.serving.errors import APIError, parse_json_object
from openinfer.serving.http_server import DEFAULT_KEEP_ALIVE_S, check_keep_alive, uvicorn_config
from openinfer.serving.encoder_pool import EncoderPool
from openinfer.serving.encoder_wire import model_identity
from openinfer.serving.images import ImageInputs, has_image_parts
from openinfer.serving.load import ROLES, BusyMeter, engine_load, prefill_body
from openinfer.serving.metrics import EngineMetrics

logger = logging.getLogger("openinfer.serving")


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    served_model_name: str | None = None   # default: the --model argument
    max_waiting: int | None = None         # requests allowed to wait for a seat; more get 429
    graceful_shutdown_s: float = 30.0      # on SIGTERM: time in-flight requests get to finish
    request_timeout_s: float | None = None  # a request still unfinished this long after arrival is aborted (408)
    role: str = "both"                     # both | prefill | decode (docs/serving.md) | encoder (docs/vision.md)
    prefill_flush_timeout_s: float = 10.0  # prefill role: longest wait for the store's writes before answering
    api_server_count: int = 1              # API-server processes over the one engine core (serving/api_servers.py)
    encoders: list[str] = field(default_factory=list)   # vision-encoder instances' URLs (EPD: docs/vision.md)
    encoder_timeout_s: float = 60.0        # longest silence from an encoder on one image (its queue included)
    encoder_health_interval_s: float = 2.0
    timeout_keep_alive_s: float = DEFAULT_KEEP_ALIVE_S   # idle connections outlast clients' pools (http_server.py)

    def __post_init__(self):
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {list(ROLES)}, got {self.role!r}")
        if not (isinstance(self.api_server_count, int) and self.api_server_count >= 1):
            raise ValueError(f"api_server_count must be a whole number >= 1 (API-server processes over one engine "
                             f"core), got {self.api_server_count!r}")
        urls = [u.rstrip("/") for u in self.encoders]
        if urls and self.role == "encoder":
            raise ValueError("--encoder lists the vision-encoder instances a prefill, decode or both instance sends "
                             "its images to; an encoder instance (--role encoder) takes none")
        if len(set(urls)) != len(urls) or any(not u.startswith(("http://", "https://")) for u in urls):
            raise ValueError(f"--encoder URLs must be distinct and start with http:// or https://, got {urls}")
        for name in ("encoder_timeout_s", "encoder_health_interval_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.role == "encoder" and self.api_server_count != 1:
            raise ValueError("an encoder instance (--role encoder) runs one process; api_server_count must be 1")
        check_keep_alive(self.timeout_keep_alive_s)
        if self.request_timeout_s is not None and not self.request_timeout_s > 0:
            raise ValueError(f"request timeout must be > 0 seconds, got {self.request_timeout_s}")


GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages"})


def _is_anthropic(request: Request) -> bool:
    return request.url.path.startswith("/v1/messages")


def _error_response(request: Request, err: APIError) -> JSONResponse:
    return JSONResponse(err.body(_is_anthropic(request)), status_code=err.status)


async def _json_body(request: Request) -> dict:
    raw = await request.body()
    body = parse_json_object(raw)
    if b"\\u" in raw:    # a JSON escape can spell a lone UTF-16 surrogate ("\udcff"): not text, tokenizers reject it
        try:
            json.dumps(body, ensure_ascii=False).encode()
        except UnicodeEncodeError as e:
            raise APIError(400, f"request body is not valid Unicode text: a lone surrogate "
                                f"{e.object[e.start:e.end]!r} (a \\uD800-\\uDFFF escape without its pair)") from None
    return body


def build_app(engine: LLMEngine | EngineCoreClient, config: ServerConfig, model_name: str,
              metrics_dir: str | None = None) -> FastAPI:
    """The app over `engine`: an engine core in its own process (what `openinfer serve` runs) or an engine in
    this process (tests that look inside it). `metrics_dir`: one of several API servers over one core, whose
    per-request metrics are summed there (serving/metrics.py)."""
    served = config.served_model_name or model_name
    if engine.tokenizer.is_deepseek:
        # the recipe's protocols only take DeepSeek's own model names, and the name picks the version's prompt
        # encoding and output parsing: a model is served under its own version's name
        own = engine.tokenizer.deepseek_model
        if config.served_model_name is None:
            served = own
        elif served != own:
            raise ValueError(f"this DeepSeek model is served as {own!r} (deepseek-recipe's name for its version), "
                             f"not {served!r} (--served-model-name)")
    if config.role == "encoder":
        raise ValueError("role 'encoder' runs the vision tower alone, not an engine: serving/encoder_server.py")
    if config.role == "prefill" and not (engine.config.kv_store_dir or engine.config.kv_store_url):
        raise ValueError("role 'prefill' hands its KV blocks over through a shared prefix-KV store: give it "
                         "--kv-store-dir (a directory the decode instances share) or --kv-store-url")
    metrics = EngineMetrics(served, engine, metrics_dir)
    busy = BusyMeter()

    def on_step(engine_, outputs) -> None:
        metrics.observe_outputs(outputs)
        st = engine_.stats()                  # the core's work, not only this API server's requests
        busy.on_step(st["num_running"] + st["num_waiting"] > 0)

    async_engine = AsyncLLMEngine(engine, config.max_waiting, on_step=on_step,
                                  request_timeout_s=config.request_timeout_s)

    source = engine.model_source
    images = ImageInputs(engine.config, source.family.image_processor(source.hf_config), served)
    encoders = None
    if config.encoders:
        if images.processor is None:
            raise ValueError(f"--encoder: model {served!r} takes no images (it has no vision encoder)")
        encoders = EncoderPool(config.encoders, model_identity(source.hf_config), config.encoder_timeout_s,
                               config.encoder_health_interval_s, registry=metrics.registry)
        encoders.verify()

    def load() -> dict:
        out = engine_load(engine, async_engine, config.role, served, busy)
        return out if encoders is None else {**out, "encoders": encoders.describe()}
    metrics.add_load_gauges(load, config.role)
    chat = ChatFrontend(async_engine, engine.tokenizer, str(engine.model_dir / "tokenizer.json"), served, images)
    completions = CompletionsFrontend(async_engine, engine.tokenizer, served)
    state = {"accepting": True}

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        async_engine.start()
        if encoders is not None:
            await encoders.start()
        yield
        state["accepting"] = False
        if encoders is not None:
            await encoders.stop()
        async_engine.shutdown()

    app = FastAPI(title="openinfer", lifespan=lifespan)
    app.state.async_engine = async_engine
    app.state.encoders = encoders
    app.state.served_model_name = served
    app.state.role = config.role

    @app.exception_handler(APIError)
    async def _api_error(request: Request, err: APIError):
        return _error_response(request, err)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, err: StarletteHTTPException):
        msg = f"no route {request.method} {request.url.path}" if err.status_code == 404 else str(err.detail)
        return _error_response(request, APIError(err.status_code, msg))

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, err: RequestValidationError):
        return _error_response(request, APIError(400, str(err.errors()[:1])))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, err: Exception):
        return _error_response(request, APIError(500, f"internal error: {type(err).__name__}: {err}"))

    @app.middleware("http")
    async def _guard(request: Request, call_next):
        path = request.url.path
        if not state["accepting"] and path not in ("/health", "/metrics"):
            return _error_response(request, APIError(503, "server is shutting down"))
        if config.api_key and path.startswith(("/v1/", "/tokenize", "/detokenize")):
            auth = request.headers.get("authorization", "")
            given = auth[7:] if auth.lower().startswith("bearer ") else request.headers.get("x-api-key", "")
            if not secrets.compare_digest(given.encode(), config.api_key.encode()):
                return _error_response(request, APIError(401, "missing or invalid API key"))
        return await call_next(request)

    # outermost, so it sees the server's own receive(): a hang-up cancels the route, which aborts the request
    app.add_middleware(CancelOnDisconnect, paths=GENERATION_PATHS,
                       on_disconnect=lambda path: metrics.observe_abort("client_disconnect"))

    def check_model(body: dict) -> None:
        model = body.get("model")
        if not isinstance(model, str):
            raise APIError(400, "'model' is required (a string)", param="model")
        if model != served:
            raise APIError(404, f"model {model!r} does not exist; this server serves {served!r}", param="model")

    def api_error(e: Exception) -> APIError:
        """What an engine-side failure means to the client."""
        if isinstance(e, APIError):
            return e
        if isinstance(e, RequestTimeoutError):
            metrics.observe_abort("timeout")
            return APIError(408, str(e))
        status = {QueueFullError: 429, EngineDeadError: 503}.get(type(e), 400)   # else ValueError: bad input
        return APIError(status, str(e))

    def engine_errors(fn):
        async def wrapped(request: Request):
            try:
                return await fn(request)
            except (QueueFullError, EngineDeadError, RequestTimeoutError, ValueError) as e:
                raise api_error(e) from None
        wrapped.__name__ = fn.__name__
        return wrapped

    async def settle() -> None:
        """Prefill role, once a request's token is out: wait until the store holds what it computed (the
        decode instance reads it from there); past the timeout a decode instance recomputes what is missing."""
        if config.role == "prefill" and not await asyncio.to_thread(engine.flush_kv_store,
                                                                    config.prefill_flush_timeout_s):
            logger.warning("prefill: the prefix-KV store's writes took over %.0f s; answering anyway (the decode "
                           "instance recomputes the blocks not written yet)", config.prefill_flush_timeout_s)

    def sse(events: AsyncIterator[tuple[str | None, str]], done: str | None) -> StreamingResponse:
        async def gen():
            try:
                async for name, data in events:
                    yield (f"event: {name}\n" if name else "") + f"data: {data}\n\n"
            except (QueueFullError, EngineDeadError, RequestTimeoutError, ValueError, APIError) as e:
                yield f"data: {json.dumps(api_error(e).body(False))}\n\n"
            await settle()
            if done is not None:
                yield f"data: {done}\n\n"
        return StreamingResponse(gen(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def first_then_rest(agen: AsyncIterator):
        """Pull the first item before answering, so queue-full / bad input become a proper HTTP status."""
        first = await agen.__anext__()

        async def rest():
            yield first
            async for item in agen:
                yield item
        return rest()

    # ---- routes -----------------------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        if async_engine.error is not None:
            return JSONResponse({"status": "error", "error": repr(async_engine.error)}, status_code=503)
        return {"status": "ok"} if config.role == "both" else {"status": "ok", "role": config.role}

    @app.get("/load")
    async def load_route():
        """What the router balances on (serving/load.py, docs/serving.md)."""
        if async_engine.error is not None:
            return JSONResponse({"status": "error", "error": repr(async_engine.error)}, status_code=503)
        return load()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": served, "object": "model", "created": int(time.time()),
                                            "owned_by": "openinfer", "max_model_len": engine.max_model_len}]}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    async def chat_like(request: Request, protocol: str):
        body = await _json_body(request)
        check_model(body)
        if config.role == "prefill":
            body = prefill_body(request.url.path, body)
        if has_image_parts(body):     # images are fetched and decoded: off the event loop
            prepared = await asyncio.to_thread(chat.prepare, protocol, body)
        else:
            prepared = chat.prepare(protocol, body)
        if prepared.images and encoders is not None:     # EPD: the rows from the encoder instances
            prepared.images = await encoders.encode(prepared.images)
        if not prepared.stream:
            answer = await chat.complete(prepared)
            await settle()
            return Response(answer, media_type="application/json")
        events = chat.events(prepared)
        try:
            events = await first_then_rest(events)
        except StopAsyncIteration:
            events = _empty()

        async def named():
            async for ev in events:
                yield chat.sse_name(protocol, ev), ev.to_json()
        return sse(named(), chat.sse_done(protocol))

    def chat_route(protocol: str):
        async def route(request: Request):
            return await chat_like(request, protocol)
        route.__name__ = f"{protocol}_route"
        return engine_errors(route)

    for path, protocol in (("/v1/chat/completions", "chat"), ("/v1/responses", "responses"),
                           ("/v1/messages", "messages")):
        app.post(path)(chat_route(protocol))

    @app.post("/v1/completions")
    @engine_errors
    async def completions_route(request: Request):
        body = await _json_body(request)
        check_model(body)
        if config.role == "prefill":
            body = prefill_body(request.url.path, body)
        prepared = completions.prepare(body)
        if not prepared.req.stream:
            answer = await completions.complete(prepared)
            await settle()
            return JSONResponse(answer)
        chunks = await first_then_rest(completions.stream(prepared))

        async def named():
            async for c in chunks:
                yield None, json.dumps(c)
        return sse(named(), "[DONE]")

    @app.post("/tokenize")
    async def tokenize(request: Request):
        body = await _json_body(request)
        if "model" in body:
            check_model(body)
        if isinstance(body.get("prompt"), str):
            ids = engine.tokenizer.encode(body["prompt"], add_special_tokens=bool(body.get("add_special_tokens", True)))
        elif isinstance(body.get("messages"), list):
            chat_body = {"model": served, "messages": body["messages"]}
            if has_image_parts(chat_body):     # images are fetched and decoded: off the event loop
                ids = (await asyncio.to_thread(chat.prepare, "chat", chat_body)).prompt_token_ids
            else:
                ids = chat.prepare("chat", chat_body).prompt_token_ids
        else:
            raise APIError(400, "give 'prompt' (a string) or 'messages' (a list)", param="prompt")
        return {"tokens": ids, "count": len(ids), "max_model_len": engine.max_model_len}

    @app.post("/detokenize")
    async def detokenize(request: Request):
        body = await _json_body(request)
        if "model" in body:
            check_model(body)
        ids = body.get("tokens")
        vocab = engine.model_config.vocab_size
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab
                                                for t in ids):
            raise APIError(400, f"'tokens' must be a list of token ids in [0, {vocab})", param="tokens")
        return {"prompt": engine.tokenizer.decode(ids, skip_special_tokens=False)}

    return app


async def _empty():
    return
    yield  # pragma: no cover


def run_server(engine: LLMEngine | EngineCoreClient, config: ServerConfig, model_name: str,
               sock: socket.socket | None = None, metrics_dir: str | None = None,
               on_ready: Callable[[], None] | None = None) -> int:
    """Serve until SIGINT/SIGTERM: then stop accepting, let in-flight requests finish (up to
    graceful_shutdown_s; the rest are aborted) and return 0. The caller makes the KV pool resident first
    (`touch_cache_pages`), so the server's memory starts at its steady-state size instead of creeping up as blocks
    are first used.

    If the engine core dies, every request in flight gets its error (a 503 for those not streaming yet),
    /health answers 503, and the server stops and returns 1 (a supervisor restarts it: a dead core is not
    restarted in place, its device memory and requests are gone with it).

    One of several API servers (serving/api_servers.py): `sock` is its bound socket (listened on here),
    `metrics_dir` where the API servers' per-request metrics are summed, `on_ready` is called once the app is built,
    just before serving."""
    import uvicorn

    app = build_app(engine, config, model_name, metrics_dir)
    server = uvicorn.Server(uvicorn_config(app, config.host, config.port, config.timeout_keep_alive_s,
                                           graceful_shutdown_s=config.graceful_shutdown_s))
    died: list[BaseException] = []

    def core_died(error: BaseException) -> None:
        logger.error("the engine core died; stopping the server: %s", error)
        died.append(error)
        server.should_exit = True
    app.state.async_engine.on_dead = core_died
    if on_ready is not None:
        on_ready()
    # uvicorn re-raises a caught SIGTERM once its graceful shutdown is done; with this handler in place
    # (uvicorn restores it before re-raising) that ends as a clean exit 0 instead of death by signal.
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        server.run(sockets=None if sock is None else [sock])
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 1 if died else 0
