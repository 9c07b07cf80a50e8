"""DeepSeek-V4.1's vision tower alone: what a vision-encoder instance of the spec's EPD split runs (`openinfer serve
--role encoder`, docs/vision.md). It holds the ViT, the Aligner and the three delimiter embeddings under the
checkpoint's own names (`vision.*`, `aligner.*`, `image_start`, `image_newline`, `image_end`), in the dtypes the
whole model gives them, and computes a span's rows with the whole model's own code (`vision.embed_span`): the rows it
returns are the bits the prefill instance would compute itself. Only those tensors are read from the checkpoint;
the decoder's (attention, experts, Engram tables, heads) are never read or allocated.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from openinfer.loader.weights import iter_safetensors, materialize
from openinfer.models.deepseek_v41.config import DeepseekV41Config
from openinfer.models.deepseek_v41.loader import load_weights
from openinfer.models.deepseek_v41.model import keeps_float32
from openinfer.models.deepseek_v41.vision import Aligner, ViT, check_span, embed_span
from openinfer.multimodal import ImageSpan
from openinfer.quantization.checkpoint import read_headers

TOWER_NAMES = ("vision", "aligner", "image_start", "image_end", "image_newline")   # top-level checkpoint names


def is_tower_tensor(name: str) -> bool:
    return name.split(".", 1)[0] in TOWER_NAMES


class ImageEncoder(nn.Module):
    expert_placement = None     # (loader.load_weights: no routed experts here)

    def __init__(self, cfg: DeepseekV41Config):
        super().__init__()
        self.config = cfg
        self.vision = ViT(cfg)
        self.aligner = Aligner(cfg)
        self.image_start = nn.Parameter(torch.zeros(cfg.dim))
        self.image_end = nn.Parameter(torch.zeros(cfg.dim))
        self.image_newline = nn.Parameter(torch.zeros(cfg.dim))

    def cast(self, dtype: torch.dtype) -> "ImageEncoder":
        """The whole model's dtypes (`DeepseekV41ForCausalLM.cast`): float32 where it keeps float32, else `dtype`."""
        for name, p in self.named_parameters():
            p.data = p.data.float() if keeps_float32(name) else p.data.to(dtype)
        return self

    def check_image(self, image: ImageSpan) -> None:
        check_span(self.config, image)

    @torch.inference_mode()
    def embed_image(self, image: ImageSpan) -> torch.Tensor:
        return embed_span(self, image)


def load_image_encoder(cfg: DeepseekV41Config, path: Path, dtype: torch.dtype, device) -> ImageEncoder:
    """The tower of the checkpoint in `path`: its tensors' names, shapes and formats checked against the headers
    before anything is allocated (as the whole model's are), then read alone."""
    with torch.device("meta"):
        enc = ImageEncoder(cfg).cast(dtype)
    load_weights(enc, ((n, t.meta()) for n, t in read_headers(path).items() if is_tower_tensor(n)), dry_run=True)
    enc = materialize(enc, device)
    load_weights(enc, iter_safetensors(path, keep=is_tower_tensor))
    for p in enc.parameters():
        p.requires_grad_(False)
    return enc.eval()
