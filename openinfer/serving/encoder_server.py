"""`openinfer serve MODEL --role encoder`: a vision-encoder instance of the spec's EPD split (spec 003 §1.3,
docs/vision.md). It runs the model's vision tower alone (for DeepSeek-V4.1 the ViT, the Aligner and the span
delimiters; no decoder weight is read or allocated) on one device and answers `POST /v1/encode`: a preprocessed
image in, its span's rows out (serving/encoder_wire.py), the rows the prefill instance's own tower would compute.

- **Cache**: rows by image digest in an LRU bounded in bytes (`encoder_cache_bytes`, engine/encoder_cache.py), kept
  in host memory: a repeated image (another prefill instance sending the same picture, a decode instance of the P/D
  path re-sending what the prefill instance sent) costs the transfer only.
- **Queue**: images are encoded one at a time, in arrival order, on one worker thread (the device runs one image at
  a time anyway), off the event loop. `max_waiting` bounds the images queued or running: beyond it, 429 (the
  client tries another encoder or encodes the image itself).
- **Load**: `GET /load` reports `image_patches_in_flight` (patches of the images queued or running here), which the
  prefill side's balancer (`EncoderLoads`) reads: the GPU with the fewest patches in flight gets the next image.
- `/health`, `/load`, `/metrics`, `/v1/models` as the other roles; SIGTERM lets the images in flight finish.
"""

from __future__ import annotations

import asyncio
import secrets
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager

import torch
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from openinfer.config import EngineConfig
from openinfer.engine.encoder_cache import EncoderCache
from openinfer.models.interface import ResolvedModel
from openinfer.multimodal import ImageSpan
from openinfer.serving.api_server import ServerConfig
from openinfer.serving.encoder_wire import (CACHE_HEADER, CONTENT_TYPE, DIGEST_HEADER, ENCODE_PATH, model_identity,
                                            pack_embeds, unpack_image)
from openinfer.serving.errors import APIError
from openinfer.serving.http_server import uvicorn_config
from openinfer.serving.load import BusyMeter

# options of `openinfer serve` an encoder instance reads; any other engine option is refused by name
ENCODER_ENGINE_OPTIONS = frozenset({"model", "device", "dtype", "cache_dir", "encoder_cache_bytes"})


class EncoderService:
    """The tower on one device, its cache, its queue and what it reports."""

    def __init__(self, tower, config: EngineConfig, model: ResolvedModel):
        self.tower, self.config, self.model = tower, config, model
        self.identity = model_identity(model.hf_config)
        self.cache = EncoderCache(config.encoder_cache_bytes)
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="openinfer-encoder")
        self.images_in_flight = 0        # queued or running (read and written on the event loop only)
        self.patches_in_flight = 0
        self.images_encoded = 0          # computed here (cache misses)
        self.busy = BusyMeter()

    @classmethod
    def load(cls, config: EngineConfig, model: ResolvedModel) -> "EncoderService":
        device = torch.device(config.device)
        tower = model.family.build_image_encoder(model, config, device)
        if tower is None:
            raise ValueError(f"--role encoder: model {model.name!r} takes no images (it has no vision encoder)")
        return cls(tower, config, model)

    async def encode(self, image: ImageSpan) -> tuple[torch.Tensor, bool]:
        """The span's rows (on the host) and whether they came from the cache."""
        self.images_in_flight += 1
        self.patches_in_flight += image.num_patches
        try:
            return await asyncio.get_running_loop().run_in_executor(self._worker, self._encode, image)
        finally:
            self.images_in_flight -= 1
            self.patches_in_flight -= image.num_patches

    def _encode(self, image: ImageSpan) -> tuple[torch.Tensor, bool]:
        t0, misses = time.perf_counter(), self.cache.misses
        rows = self.cache.get_or_encode(image.digest, lambda: self.tower.embed_image(image).cpu())
        hit = self.cache.misses == misses
        self.images_encoded += not hit
        self.busy.record(time.perf_counter() - t0)
        return rows, hit

    def shutdown(self) -> None:
        self._worker.shutdown(wait=False, cancel_futures=True)


def build_encoder_app(service: EncoderService, config: ServerConfig, model_name: str) -> FastAPI:
    served = config.served_model_name or model_name
    registry = CollectorRegistry()
    label = {"labelnames": ["model_name"], "registry": registry}
    m_images = Counter("openinfer:encoder_images", "Images answered, by whether the encoder cache held their rows.",
                       labelnames=["model_name", "cache"], registry=registry)
    m_patches = Counter("openinfer:encoder_patches", "ViT patches encoded (cache misses).", **label)
    m_seconds = Histogram("openinfer:encoder_request_seconds", "Time from an image's arrival to its rows' answer "
                          "(queueing included).", **label)
    for name, doc, read in (
            ("openinfer:image_patches_in_flight", "Patches of the images queued or running (the balancer's load).",
             lambda: service.patches_in_flight),
            ("openinfer:images_in_flight", "Images queued or running.", lambda: service.images_in_flight),
            ("openinfer:encoder_cache_bytes", "Bytes the encoder cache holds.", lambda: service.cache.bytes),
            ("openinfer:engine_busy_fraction", "Fraction of the last window spent encoding.",
             lambda: service.busy.fraction())):
        Gauge(name, doc, **label).labels(served).set_function(read)
    Gauge("openinfer:server_role", "1, labelled by this server's role.", labelnames=["model_name", "role"],
          registry=registry).labels(served, "encoder").set(1)
    state = {"accepting": True}

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        state["accepting"] = False
        service.shutdown()

    app = FastAPI(title="openinfer vision encoder", lifespan=lifespan)
    app.state.service = service

    @app.exception_handler(APIError)
    async def _api_error(request: Request, err: APIError):
        return JSONResponse(err.body(False), status_code=err.status)

    @app.middleware("http")
    async def _guard(request: Request, call_next):
        if not state["accepting"] and request.url.path not in ("/health", "/metrics"):
            return JSONResponse(APIError(503, "server is shutting down").body(False), status_code=503)
        if config.api_key and request.url.path.startswith("/v1/"):
            auth = request.headers.get("authorization", "")
            given = auth[7:] if auth.lower().startswith("bearer ") else request.headers.get("x-api-key", "")
            if not secrets.compare_digest(given.encode(), config.api_key.encode()):
                return JSONResponse(APIError(401, "missing or invalid API key").body(False), status_code=401)
        return await call_next(request)

    @app.post(ENCODE_PATH)
    async def encode(request: Request):
        t0 = time.perf_counter()
        if config.max_waiting is not None and service.images_in_flight >= config.max_waiting:
            raise APIError(429, f"encoder busy: {service.images_in_flight} images in flight "
                                f"(max_waiting={config.max_waiting}); try another encoder")
        try:
            image = unpack_image(await request.body(), request.headers.get(DIGEST_HEADER))
            service.tower.check_image(image)
        except ValueError as e:
            raise APIError(400, f"bad image: {e}") from None
        rows, hit = await service.encode(image)
        m_images.labels(served, "hit" if hit else "miss").inc()
        if not hit:
            m_patches.labels(served).inc(image.num_patches)
        m_seconds.labels(served).observe(time.perf_counter() - t0)
        return Response(pack_embeds(rows), media_type=CONTENT_TYPE,
                        headers={DIGEST_HEADER: image.digest.hex(), CACHE_HEADER: "hit" if hit else "miss"})

    @app.get("/health")
    async def health():
        return {"status": "ok", "role": "encoder"}

    @app.get("/load")
    async def load():
        cache = service.cache
        return {"role": "encoder", "model": served, "model_identity": service.identity,
                "device": str(service.config.device), "dtype": str(service.config.torch_dtype).removeprefix("torch."),
                "image_patches_in_flight": service.patches_in_flight, "images_in_flight": service.images_in_flight,
                "images_encoded": service.images_encoded, "encoder_cache_hits": cache.hits,
                "encoder_cache_entries": len(cache), "encoder_cache_bytes": cache.bytes,
                "busy_fraction": round(service.busy.fraction(), 4), "busy_window_s": service.busy.window_s}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": served, "object": "model", "created": int(time.time()),
                                            "owned_by": "openinfer"}]}

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return app


def run_encoder_server(config: EngineConfig, server: ServerConfig, model: ResolvedModel) -> int:
    """Serve until SIGINT/SIGTERM (images in flight finish, up to graceful_shutdown_s), then return 0."""
    import uvicorn

    service = EncoderService.load(config, model)
    params = sum(p.numel() for p in service.tower.parameters())
    print(f"[openinfer] vision encoder of {model.name} on {config.device}: the tower alone, {params / 1e6:.1f} M "
          f"parameters (no decoder weight read)", file=sys.stderr, flush=True)
    app = build_encoder_app(service, server, model.name)
    uv = uvicorn.Server(uvicorn_config(app, server.host, server.port, server.timeout_keep_alive_s,
                                       graceful_shutdown_s=server.graceful_shutdown_s))
    previous = signal.signal(signal.SIGTERM, lambda *_: None)   # as run_server: a clean exit 0 after SIGTERM
    try:
        uv.run()
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0
