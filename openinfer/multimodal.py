"""Images in a prompt, as plain data the engine, the KV manager and the runner share (docs/vision.md).

An image occupies a span of prompt positions (DeepSeek-V4.1: `[IMAGE_START] + ([IMAGE] * w + [IMAGE_NEW_LINE]) * h +
[IMAGE_END]`, every position carrying the model's image token id). What the span's positions mean is the model's
business; what crosses the engine is an `ImageSpan`: where the span starts, the kind of each of its positions, the
preprocessed pixels as ViT patches, and a digest of them. The digest stands for the image wherever tokens alone
would not: prefix-cache block hashes (`block_image_key`) and the encoder-output cache. A span may come with its
embeddings already computed by a vision-encoder instance (EPD, docs/vision.md); the model then places those instead
of encoding the patches itself.

A span crossing a process boundary (to the engine-core process, to a rank's process of the multi-process executor,
over a pipe or a TCP connection to another host or a Ray actor) is pickled with its tensors as raw bytes (dtype,
shape, the buffer: one copy each way), never through torch's shared-memory reductions, which `multiprocessing`
would pick for a tensor: those hand over a file descriptor through the sender's resource sharer, which a rank on
another host cannot reach, and hold one descriptor per tensor. The digest travels as computed; nobody hashes the
pixels again.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch


@dataclass(frozen=True, eq=False)
class ImageSpan:
    offset: int                     # prompt position of the span's first token
    token_types: tuple[int, ...]    # per span position, the model's kinds (V4.1: 0 start, 1 image, 2 newline, 3 end)
    patches: torch.Tensor           # [n_h * n_w, 3, p, p]: the preprocessed image cut into ViT patches
    grid: tuple[int, int]           # (n_h, n_w) patches
    digest: bytes                   # image_digest(patches, grid)
    embeds: torch.Tensor | None = None   # [num_tokens, dim]: the span's input rows, encoded elsewhere (EPD); None:
                                         # the model encodes the patches (the digest never covers these)

    @property
    def num_tokens(self) -> int:
        return len(self.token_types)

    @property
    def end(self) -> int:
        return self.offset + len(self.token_types)

    @property
    def num_patches(self) -> int:
        return self.grid[0] * self.grid[1]

    def __reduce__(self):
        return _rebuild_span, (self.offset, self.token_types, tensor_to_wire(self.patches), self.grid, self.digest,
                               None if self.embeds is None else tensor_to_wire(self.embeds))

    @classmethod
    def make(cls, offset: int, token_types, patches: torch.Tensor, grid: tuple[int, int]) -> "ImageSpan":
        types = tuple(int(t) for t in token_types)
        return cls(int(offset), types, patches, (int(grid[0]), int(grid[1])), image_digest(patches, grid, types))


def tensor_to_wire(t: torch.Tensor) -> tuple[str, tuple[int, ...], bytes]:
    """(dtype name, shape, raw bytes) of a tensor (on the host): what a pickled `ImageSpan` carries."""
    t = t.detach().contiguous().cpu()
    return str(t.dtype).removeprefix("torch."), tuple(t.shape), t.view(torch.uint8).numpy().tobytes()


def tensor_from_wire(wire: tuple[str, tuple[int, ...], bytes]) -> torch.Tensor:
    dtype, shape, data = wire
    flat = torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
    return flat.view(getattr(torch, dtype)).reshape(shape)


def _rebuild_span(offset, token_types, patches, grid, digest, embeds) -> ImageSpan:
    return ImageSpan(offset, token_types, tensor_from_wire(patches), grid, digest,
                     None if embeds is None else tensor_from_wire(embeds))


def image_digest(patches: torch.Tensor, grid: tuple[int, int], token_types: tuple[int, ...] = ()) -> bytes:
    """sha256 of the preprocessed pixels, their grid and the span layout: two images hash alike only if the model
    would see the same thing."""
    h = hashlib.sha256(b"openinfer-image:")
    h.update(f"{tuple(grid)}:{str(patches.dtype)}:{tuple(patches.shape)}:".encode())
    h.update(bytes(token_types))
    h.update(patches.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return h.digest()


def block_image_key(images: tuple[ImageSpan, ...], start: int, end: int) -> bytes:
    """What a block of positions [start, end) holds beyond its token ids: the digest and offset of every image span
    that overlaps it (empty: none), so the same tokens over another image hash differently."""
    key = b""
    for img in images:
        if img.offset < end and img.end > start:
            key += img.digest + img.offset.to_bytes(8, "little", signed=True)
    return key


def check_spans(images: tuple[ImageSpan, ...], prompt_len: int) -> None:
    """Raise ValueError unless the spans lie inside the prompt, in order, without overlapping."""
    prev_end = 0
    for i, img in enumerate(images):
        if not isinstance(img, ImageSpan):
            raise ValueError(f"image {i}: expected an ImageSpan, got {type(img).__name__}")
        if img.num_tokens == 0 or img.offset < prev_end or img.end > prompt_len:
            raise ValueError(f"image {i}: its span [{img.offset}, {img.end}) must lie inside the {prompt_len}-token "
                             f"prompt, after the previous image's")
        prev_end = img.end
