"""Pixels -> what DeepSeek-V4.1's vision path reads (docs/vision.md): an image already sized by deepseek-recipe's
preprocessing (V4.1's resize plan: at least `vision_min_pixels`, at most `vision_max_n_token` tokens, sides a
multiple of the patch size) is cut into ViT patches (RGB scaled to [-1, 1], reading order), and each image
placeholder of an encoded prompt becomes the image's span of image-token positions.
"""

from __future__ import annotations

import numpy as np
import torch

from openinfer.models.deepseek_v41.config import DeepseekV41Config
from openinfer.models.deepseek_v41.vision import check_prompt_image, image_token_types, token_grid
from openinfer.multimodal import ImageSpan


class ImageProcessor:
    def __init__(self, cfg: DeepseekV41Config):
        self.config = cfg
        self.patch_size, self.ratio = cfg.vision_patch_size, cfg.vision_downsample_ratio
        self.image_token_id = cfg.image_token_id

    def check(self, image: ImageSpan, prompt_token_ids: list[int]) -> None:
        """ValueError naming the problem unless the model reads `image` in this prompt (as its `check_image`; for a
        front end that holds no model: the multi-process executor's)."""
        check_prompt_image(self.config, image, prompt_token_ids)

    def patches(self, pixels: np.ndarray) -> tuple[torch.Tensor, tuple[int, int]]:
        """RGB uint8 [H, W, 3] -> (patches [n_h * n_w, 3, p, p] bf16, (n_h, n_w)); sides that are not a multiple of
        the patch size are padded with mid-grey, the image centred (as DeepSeek's preprocessing pads)."""
        p = self.patch_size
        h, w = pixels.shape[:2]
        H, W = -(-h // p) * p, -(-w // p) * p
        if (H, W) != (h, w):
            canvas = np.full((H, W, 3), 127, dtype=np.uint8)
            top, left = (H - h) // 2, (W - w) // 2
            canvas[top:top + h, left:left + w] = pixels
            pixels = canvas
        x = torch.from_numpy(np.ascontiguousarray(pixels, dtype=np.float32)).permute(2, 0, 1) / 255
        x = ((x - 0.5) / 0.5).to(torch.bfloat16)
        n_h, n_w = H // p, W // p
        return x.reshape(3, n_h, p, n_w, p).permute(1, 3, 0, 2, 4).reshape(n_h * n_w, 3, p, p), (n_h, n_w)

    def expand(self, prompt_token_ids: list[int], images: list[np.ndarray]) -> tuple[list[int], tuple[ImageSpan, ...]]:
        """The prompt with each image placeholder (the image token id, in order) replaced by its image's span, and
        the spans. ValueError when placeholders and images do not pair up."""
        count = sum(t == self.image_token_id for t in prompt_token_ids)
        if count != len(images):
            raise ValueError(f"the prompt has {count} image placeholders for {len(images)} images")
        out, spans, it = [], [], iter(images)
        for t in prompt_token_ids:
            if t != self.image_token_id:
                out.append(t)
                continue
            patches, grid = self.patches(next(it))
            types = image_token_types(*token_grid(grid, self.ratio))
            spans.append(ImageSpan.make(len(out), types, patches, grid))
            out += [self.image_token_id] * len(types)
        return out, tuple(spans)
