"""What travels between a prefill (or `both`) instance and a vision-encoder instance (EPD, docs/vision.md): one image
out, its span's rows back, both as safetensors bytes (tensors with their dtype and shape, no pickling), over
`POST /v1/encode`.

- Out: the preprocessed image as the prefill side holds it (`ImageSpan`): `patches` [n_h * n_w, 3, p, p] (bf16, as
  the image processor made them), `grid` [2] (n_h, n_w) and `token_types` [num_tokens] (the span's layout), with the
  image's digest in the `X-Image-Digest` header. The encoder recomputes the digest from what it received and refuses
  a mismatch: the digest is its cache key, and two sides that disagree on it disagree on the image.
- Back: `embeds` [num_tokens, dim] in the encoder's model dtype: the span's input rows as the whole model's
  `embed_image` computes them (the prefill side casts them to its own dtype).

`model_identity` is what an encoder and its clients must agree on before any image travels: a digest of the model's
config.json (same architecture and tower shape; the weights themselves are the operator's to keep equal).
"""

from __future__ import annotations

import hashlib
import json

import torch
from safetensors.torch import load, save

from openinfer.multimodal import ImageSpan

ENCODE_PATH = "/v1/encode"
DIGEST_HEADER = "x-image-digest"
CACHE_HEADER = "x-encoder-cache"          # hit | miss: whether the encoder computed the rows for this call
CONTENT_TYPE = "application/octet-stream"


def model_identity(hf_config: dict) -> str:
    return hashlib.sha256(json.dumps(hf_config, sort_keys=True).encode()).hexdigest()[:16]


def pack_image(image: ImageSpan) -> bytes:
    return save({"patches": image.patches.contiguous(), "grid": torch.tensor(image.grid, dtype=torch.int64),
                 "token_types": torch.tensor(image.token_types, dtype=torch.uint8)})


def unpack_image(body: bytes, digest_hex: str | None) -> ImageSpan:
    """The image a client sent; ValueError naming what is wrong with it."""
    try:
        t = load(body)
    except Exception as e:          # safetensors raises its own error types for bad bytes
        raise ValueError(f"the body is not safetensors bytes ({type(e).__name__}: {e})") from None
    missing = sorted({"patches", "grid", "token_types"} - t.keys())
    if missing:
        raise ValueError(f"the body lacks the tensor(s) {missing}")
    grid, types = t["grid"], t["token_types"]
    if tuple(grid.shape) != (2,) or grid.dtype != torch.int64 or types.dim() != 1:
        raise ValueError(f"grid must be int64 [2] and token_types 1-D, got {grid.dtype} {tuple(grid.shape)} and "
                         f"{tuple(types.shape)}")
    image = ImageSpan.make(0, types.tolist(), t["patches"], tuple(grid.tolist()))
    if digest_hex is not None and image.digest.hex() != digest_hex:
        raise ValueError(f"the image's digest is {image.digest.hex()}, the client sent {digest_hex}: the two sides "
                         f"disagree on what the image is (another openinfer version?)")
    return image


def pack_embeds(embeds: torch.Tensor) -> bytes:
    return save({"embeds": embeds.detach().contiguous().cpu()})


def unpack_embeds(body: bytes, image: ImageSpan) -> torch.Tensor:
    """The rows an encoder sent back for `image`; ValueError unless they are one floating-point row per position."""
    try:
        embeds = load(body)["embeds"]
    except Exception as e:
        raise ValueError(f"the encoder's answer is not safetensors bytes with 'embeds' ({type(e).__name__}: {e})") \
            from None
    if embeds.dim() != 2 or embeds.shape[0] != image.num_tokens or not embeds.is_floating_point():
        raise ValueError(f"the encoder sent embeddings of shape {tuple(embeds.shape)} ({embeds.dtype}) for a "
                         f"{image.num_tokens}-position span")
    return embeds
