"""A request's images, from the protocol's parts to the model's image spans (docs/vision.md).

deepseek-recipe does the protocol side: its conversion collects each message's image parts (OpenAI `image_url`,
Anthropic `image`, Responses `input_image`) as image sources; its `ImageResolver` reads data URLs and fetches
http(s) URLs (`ReqwestImageFetcher`, capped at `max_image_bytes`), and its `OpenCvImagePreprocessor` validates,
decodes and resizes each image to the model's plan (`ImageQuota` counts what one request resolved). Here: the
engine's limits, a deadline on the whole resolution (`image_fetch_timeout_s`), decoding the preprocessed bytes to
pixels, and handing them to the model family's image processor, which expands each placeholder of the encoded
prompt into its image's span. Every failure is a 400 naming the image (its path in the request) and the problem.
"""

from __future__ import annotations

import io
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

import deepseek_recipe as dr
import numpy as np

from openinfer.config import EngineConfig
from openinfer.multimodal import ImageSpan
from openinfer.serving.errors import APIError


def image_sources(conv: dr.ConversationRequest) -> list:
    """The conversation's image sources in prompt order (the order of their placeholders)."""
    return [s for m in conv.conversation.messages for s in m.image_sources]


def has_image_parts(body: dict) -> bool:
    """Whether a request body holds an image part anywhere in its messages or input (cheap: no parsing)."""
    def walk(x) -> bool:
        if isinstance(x, dict):
            if x.get("type") in ("image_url", "image", "input_image"):
                return True
            return any(walk(v) for v in x.values() if isinstance(v, (dict, list)))
        if isinstance(x, list):
            return any(walk(v) for v in x)
        return False
    return walk(body.get("messages")) or walk(body.get("input"))


class ImageInputs:
    """The engine's image limits and the model's image processor (None: the model takes no images)."""

    def __init__(self, config: EngineConfig, processor, served_name: str):
        self.processor, self.served_name = processor, served_name
        self.max_images, self.max_bytes = config.max_images_per_prompt, config.max_image_bytes
        self.timeout_s = config.image_fetch_timeout_s
        if processor is not None:
            self.resolver = dr.ImageResolver(dr.ReqwestImageFetcher.with_max_bytes(self.max_bytes),
                                             dr.OpenCvImagePreprocessor())
            self._pool = ThreadPoolExecutor(2, thread_name_prefix="openinfer-images")

    def expand(self, sources: list, prompt_token_ids: list[int]) -> tuple[list[int], tuple[ImageSpan, ...]]:
        """The prompt with its images' spans, and the spans; APIError 400 for anything wrong with an image."""
        if not sources:
            return prompt_token_ids, ()
        if self.processor is None:
            raise APIError(400, f"model {self.served_name!r} does not take images (it has no vision encoder); "
                                f"{sources[0].path or 'the request'} is an image", param="messages")
        if len(sources) > self.max_images:
            raise APIError(400, f"the request holds {len(sources)} images; this server takes at most "
                                f"{self.max_images} per request (max_images_per_prompt)", param="messages")
        for s in sources:
            size = len(s.data_url) * 3 // 4 if s.data_url else len(s.data) if s.data else 0
            if size > self.max_bytes:
                raise APIError(400, f"{s.path or 'an image'}: about {size} bytes, more than this server's "
                                    f"max_image_bytes ({self.max_bytes})", param="messages")
        future = self._pool.submit(self.resolver.resolve, sources, dr.ImageQuota())
        try:
            resolved = future.result(timeout=self.timeout_s)
        except FutureTimeout:
            raise APIError(400, f"the request's images could not be fetched and read within "
                                f"{self.timeout_s:g} s (image_fetch_timeout_s)", param="messages") from None
        except dr.ImageError as e:
            raise APIError(400, f"bad image ({e.kind}): {e}", param="messages") from None
        pixels = [self._decode(info, s) for info, s in zip(resolved.images, sources)]
        try:
            return self.processor.expand(prompt_token_ids, pixels)
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from None

    @staticmethod
    def _decode(info: dr.ImageInfo, source) -> np.ndarray:
        from PIL import Image

        try:
            with Image.open(io.BytesIO(info.data)) as im:
                return np.asarray(im.convert("RGB"), dtype=np.uint8)
        except Exception as e:        # the recipe validated it: a failure here is its output's format, not the user's
            raise APIError(400, f"{source.path or 'an image'}: the preprocessed image could not be read ({e})",
                           param="messages") from None
