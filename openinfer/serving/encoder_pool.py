"""The prefill side of EPD (spec 003 §1.3, docs/vision.md): a prefill (or `both`, or decode) instance started with
`--encoder URL...` sends each image of a request to a vision-encoder instance (`openinfer serve --role encoder`) and
hands the engine the span's rows it got back; the engine places them as the image's rows instead of encoding the
image itself (`ImageSpan.embeds`, the model's `embed_image`).

- **Which encoder**: the prefill side picks, as the spec says: the encoder GPU with the fewest patches in flight
  (`EncoderLoads`), counting both what the instance last reported on `/load` (every client's images) and this
  instance's own images since. A request's images go out together, each picked in turn, while the request waits
  for them before it enters the engine (the engine's steps never wait on the network).
- **Health**: every encoder's `/load` is read every `health_interval_s` (serving/upstream.py, as the router does):
  a refused or dropped connection or a 503 drains it at once, timeouts after `health_failures` in a row; it is back
  when it answers. An instance of another role or another model (its config.json's `model_identity`) is refused at
  start and kept out.
- **Failures cost no request**: an image whose encoder fails (refused, dropped, drained meanwhile, 429/5xx, an
  answer that is not one row per position) goes to the next encoder; when none is left it is encoded here, by the
  engine's own tower, as without encoders. An image the engine already holds (its encoder cache, a prefix hit) is
  still sent: the prefill side cannot see the engine core's caches, and the encoder's own cache makes a repeat cost
  the transfer only.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging

import httpx
from prometheus_client import CollectorRegistry, Counter, Gauge

from openinfer.multimodal import ImageSpan
from openinfer.serving.balancers import EncoderGpu, EncoderLoads
from openinfer.serving.encoder_wire import CONTENT_TYPE, DIGEST_HEADER, ENCODE_PATH, pack_image, unpack_embeds
from openinfer.serving.upstream import HealthChecked, InstanceDown, Upstream, poll_load, why

logger = logging.getLogger("openinfer.encoders")

_RETRY_STATUS = frozenset({429, 500, 502, 503, 504})


class EncoderPool(HealthChecked):
    def __init__(self, urls: list[str], identity: str, timeout_s: float = 60.0, health_interval_s: float = 2.0,
                 health_timeout_s: float = 2.0, health_failures: int = 2, registry: CollectorRegistry | None = None,
                 transport: httpx.AsyncBaseTransport | None = None, sync_transport: httpx.BaseTransport | None = None):
        """`identity`: this instance's `model_identity`; encoders must report the same. `timeout_s`: the longest
        silence from an encoder on one image (queueing there included)."""
        self.instances = {u.rstrip("/"): Upstream(u) for u in urls}
        self.loads = EncoderLoads([EncoderGpu(u, 0, healthy=False) for u in self.instances])
        self.identity = identity
        self.timeout_s, self.health_interval_s = timeout_s, health_interval_s
        self.health_timeout_s, self.health_failures = health_timeout_s, health_failures
        self._transport, self._sync_transport = transport, sync_transport
        r = registry or CollectorRegistry()
        self.m_sent = Counter("openinfer:encoder_images_sent", "Images whose rows an encoder instance returned.",
                              ["instance"], registry=r)
        self.m_retries = Counter("openinfer:encoder_retries", "Images sent again to another encoder after one "
                                 "failed.", registry=r)
        self.m_local = Counter("openinfer:encoder_local_fallbacks", "Images encoded here because no encoder "
                               "instance answered.", registry=r)
        healthy = Gauge("openinfer:encoder_instance_healthy", "1 if the encoder instance is used, 0 if drained.",
                        ["instance"], registry=r)
        for inst in self.instances.values():
            healthy.labels(inst.url).set_function(lambda inst=inst: float(inst.healthy))

    # ---- health ----------------------------------------------------------------------------------------------
    def _mismatch(self, load: dict) -> str | None:
        if load.get("role") != "encoder":
            return f"its role is {load.get('role', 'both')!r}, not 'encoder' (start it with --role encoder)"
        if load.get("model_identity") != self.identity:
            return (f"it serves another model ({load.get('model')!r}, config digest {load.get('model_identity')}; "
                    f"this instance's is {self.identity})")
        return None

    def _sync(self, inst: Upstream) -> None:
        self.loads.mark(inst.url, inst.healthy, inst.load.get("image_patches_in_flight", 0) if inst.healthy else None)

    def verify(self) -> None:
        """At start: read every encoder's /load once; refuse (ValueError) one of another role or model. Those not
        answering yet start drained, and are used once they answer."""
        problems = []
        with httpx.Client(timeout=self.health_timeout_s, transport=self._sync_transport) as client:
            for inst in self.instances.values():
                try:
                    r = client.get(inst.url + "/load")
                    r.raise_for_status()
                    load = r.json()
                except (httpx.HTTPError, ValueError) as e:
                    inst.reason = f"not answering at start: {why(e) if isinstance(e, httpx.TransportError) else e}"
                    logger.warning("encoder %s %s", inst.url, inst.reason)
                    self._sync(inst)
                    continue
                problem = self._mismatch(load)
                if problem:
                    problems.append(f"{inst.url}: {problem}")
                    continue
                inst.mark_up(load)
                self._sync(inst)
        if problems:
            raise ValueError("refusing these --encoder instances: " + "; ".join(problems))

    def polled(self) -> list[Upstream]:
        return list(self.instances.values())

    async def poll(self, inst: Upstream) -> None:
        await poll_load(self.client, inst, self.health_timeout_s, self.health_failures, self._mismatch)
        self._sync(inst)

    async def start(self) -> None:
        await self.start_polling(httpx.AsyncClient(transport=self._transport, timeout=httpx.Timeout(
            self.timeout_s, connect=self.health_timeout_s)), self.health_interval_s)

    def describe(self) -> list[dict]:
        return [{"url": g.url, "healthy": self.instances[g.url].healthy,
                 **({} if self.instances[g.url].healthy else {"reason": self.instances[g.url].reason}),
                 "patches_in_flight": g.patches_in_flight, "reported_patches": g.reported_patches}
                for g in self.loads.gpus]

    # ---- images ----------------------------------------------------------------------------------------------
    async def encode(self, images: tuple[ImageSpan, ...]) -> tuple[ImageSpan, ...]:
        """The request's images, each with its rows from an encoder, or as it was (the engine encodes it) when no
        encoder could."""
        return tuple(await asyncio.gather(*(self._encode(image) for image in images)))

    async def _encode(self, image: ImageSpan) -> ImageSpan:
        body = pack_image(image)                    # (before the first await: images are picked in request order)
        headers = {DIGEST_HEADER: image.digest.hex(), "content-type": CONTENT_TYPE}
        tried: set[str] = set()
        while (gpu := self.loads.take(image.num_patches, exclude=tried)) is not None:
            inst = self.instances[gpu.url]
            if tried:
                self.m_retries.inc()
            tried.add(inst.url)
            try:
                r = await inst.until_down(self.client.post(inst.url + ENCODE_PATH, content=body, headers=headers))
                if r.status_code == 200:
                    embeds = unpack_embeds(r.content, image)
                    self.m_sent.labels(inst.url).inc()
                    return dataclasses.replace(image, embeds=embeds)
                problem = f"answered {r.status_code}: {r.text[:200]}"
                if r.status_code == 503:
                    inst.mark_down(problem)
                elif r.status_code not in _RETRY_STATUS:
                    logger.error("encoder %s refused an image: %s", inst.url, problem)
            except (httpx.HTTPError, InstanceDown) as e:
                inst.failed(e, self.health_failures)
                problem = why(e)
            except ValueError as e:                 # an answer that is not the span's rows
                problem = str(e)
                logger.error("encoder %s: %s", inst.url, problem)
            finally:
                self.loads.give_back(gpu, image.num_patches)
                self._sync(inst)
            logger.warning("encoder %s failed on an image (%s); trying another", inst.url, problem)
        self.m_local.inc()
        return image
