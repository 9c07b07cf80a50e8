"""DeepSeek-V4.1's vision tower (docs/vision.md): a ViT that reads one image as a grid of patches (bidirectional
attention over the whole image, 2D RoPE: half of each head's rotation follows the patch row, half its column), and
the Aligner, which folds each r x r neighbourhood of ViT outputs into one LLM token (zero padding at the grid's
right and bottom edges) through a GELU MLP.

The LLM sees an image as the span `[IMAGE_START] + ([IMAGE] * cols + [IMAGE_NEW_LINE]) * rows + [IMAGE_END]`: the
IMAGE positions take the Aligner's rows in reading order, the delimiters learned embeddings (the model's
`image_start`, `image_newline`, `image_end`). Parameter names are the published checkpoint's (`vision.*`,
`aligner.*`); its linears are bf16 with biases, its norms float32. Numerics follow DeepSeek's reference (the test
oracle): norms and the rotation in float32, everything else in the model dtype.

`check_span` and `embed_span` are what the whole model (`model.py`) and the encoder alone (`image_encoder.py`, the
`--role encoder` server of EPD) share: both hold the tower under the same names.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from openinfer.models.deepseek_v41.config import DeepseekV41Config
from openinfer.multimodal import ImageSpan

IMAGE_START, IMAGE, IMAGE_NEW_LINE, IMAGE_END = range(4)      # the kinds of an image span's positions


def token_grid(grid: tuple[int, int], ratio: int) -> tuple[int, int]:
    """(rows, cols) of LLM tokens the Aligner makes from a (rows, cols) patch grid."""
    return math.ceil(grid[0] / ratio), math.ceil(grid[1] / ratio)


def image_token_types(rows: int, cols: int) -> tuple[int, ...]:
    """The kinds of an image span's positions for a (rows, cols) token grid."""
    return (IMAGE_START,) + ((IMAGE,) * cols + (IMAGE_NEW_LINE,)) * rows + (IMAGE_END,)


def rope_2d(n_h: int, n_w: int, width: int, theta: float, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [n_h * n_w, 1, width] (patches in reading order): the first width/2 angles turn with the patch's
    row, the last width/2 with its column, at frequencies theta^(-2i/width)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, width, 2, dtype=torch.float32, device=device) / width))
    rows = torch.arange(n_h, device=device).repeat_interleave(n_w).float()
    cols = torch.arange(n_w, device=device).repeat(n_h).float()
    angles = torch.cat((rows[:, None] * inv_freq, cols[:, None] * inv_freq), dim=-1)
    return angles.cos()[:, None], angles.sin()[:, None]


def rotate_halves(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (i, i + d/2) of each head of x [N, H, d] by the angles of cos/sin [N, 1, d/2], in float32."""
    a, b = x.float().chunk(2, dim=-1)
    return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1).to(x.dtype)


class VisionNorm(nn.Module):
    """RMSNorm computed in float32, the weight applied before casting back."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (self.weight.float() * (xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.eps))).to(x.dtype)


class PatchEmbed(nn.Module):
    def __init__(self, cfg: DeepseekV41Config):
        super().__init__()
        self.proj = nn.Linear(3 * cfg.vision_patch_size ** 2, cfg.vision_dim)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        return self.proj(patches.flatten(1))


class VisionAttention(nn.Module):
    """Multi-head attention over every patch of the image (no mask), q and k rotated by their 2D position."""

    def __init__(self, cfg: DeepseekV41Config):
        super().__init__()
        self.n_heads = cfg.vision_n_heads
        self.head_dim = cfg.vision_dim // cfg.vision_n_heads
        self.wqkv = nn.Linear(cfg.vision_dim, 3 * cfg.vision_dim)
        self.wo = nn.Linear(cfg.vision_dim, cfg.vision_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = (t.view(n, self.n_heads, self.head_dim) for t in self.wqkv(x).chunk(3, dim=-1))
        q, k = rotate_halves(q, cos, sin), rotate_halves(k, cos, sin)
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))
        if x.is_cuda:
            # [1, H, N, d]: torch's fused SDPA kernels (flash, memory-efficient) take 4-D inputs only; 3-D ones run
            # the math path, which materializes the [H, N, N] scores (the H200 tower ran at 5-12% of its matmul
            # floor so). On the CPU the math path stays: in bf16 it gives DeepSeek's reference's bits, the CPU
            # flash kernel other roundings
            out = F.scaled_dot_product_attention(q[None], k[None], v[None])[0]
        else:
            out = F.scaled_dot_product_attention(q, k, v)
        return self.wo(out.transpose(0, 1).reshape(n, -1))


class VisionMLP(nn.Module):
    """SwiGLU with gate and up fused in `w1` (gate first), no biases."""

    def __init__(self, cfg: DeepseekV41Config):
        super().__init__()
        self.w1 = nn.Linear(cfg.vision_dim, 2 * cfg.vision_inter_dim, bias=False)
        self.w2 = nn.Linear(cfg.vision_inter_dim, cfg.vision_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w1(x).chunk(2, dim=-1)
        return self.w2(F.silu(gate) * up)


class VisionBlock(nn.Module):
    def __init__(self, cfg: DeepseekV41Config):
        super().__init__()
        self.norm1, self.norm2 = VisionNorm(cfg.vision_dim), VisionNorm(cfg.vision_dim)
        self.attn = VisionAttention(cfg)
        self.mlp = VisionMLP(cfg)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.norm1(x), cos, sin)
        return x + self.mlp(self.norm2(x))


class ViT(nn.Module):
    """Patches [n_h * n_w, 3, p, p] (reading order) -> features [n_h * n_w, vision_dim]."""

    def __init__(self, cfg: DeepseekV41Config):
        super().__init__()
        self.rope_width = cfg.vision_dim // cfg.vision_n_heads // 2
        self.theta = cfg.vision_rope_theta
        self.patch_embed = PatchEmbed(cfg)
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.vision_n_layers))
        self.norm = VisionNorm(cfg.vision_dim)

    def forward(self, patches: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        x = self.patch_embed(patches)
        cos, sin = rope_2d(grid[0], grid[1], self.rope_width, self.theta, x.device)
        for block in self.blocks:
            x = block(x, cos, sin)
        return self.norm(x)


class Aligner(nn.Module):
    """ViT features [n_h * n_w, vision_dim] -> LLM rows [ceil(n_h/r) * ceil(n_w/r), dim]: each r x r neighbourhood
    (channels outermost, then its rows, then its columns: `F.unfold`'s order) through w1, GELU, w2."""

    def __init__(self, cfg: DeepseekV41Config):
        super().__init__()
        self.ratio = cfg.vision_downsample_ratio
        self.w1 = nn.Linear(cfg.vision_dim * self.ratio ** 2, cfg.dim)
        self.w2 = nn.Linear(cfg.dim, cfg.dim)

    def forward(self, feats: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        r, (n_h, n_w) = self.ratio, grid
        x = feats.view(n_h, n_w, -1).permute(2, 0, 1)                       # [C, n_h, n_w]
        x = F.pad(x, (0, -n_w % r, 0, -n_h % r))
        cells = F.unfold(x.unsqueeze(0), r, stride=r)[0].transpose(0, 1)     # [cells, C * r * r]
        return self.w2(F.gelu(self.w1(cells)))


def check_span(cfg: DeepseekV41Config, image: ImageSpan) -> None:
    """Raise ValueError unless `image` is a span this tower reads: patches of the configured size, its grid's token
    layout; embeddings given with it (encoded elsewhere: EPD) one `dim`-wide row per position."""
    p = cfg.vision_patch_size
    if tuple(image.patches.shape) != (image.num_patches, 3, p, p):
        raise ValueError(f"image at {image.offset}: patches of shape {tuple(image.patches.shape)}, expected "
                         f"({image.num_patches}, 3, {p}, {p}) for its {image.grid[0]}x{image.grid[1]} grid")
    if image.token_types != image_token_types(*token_grid(image.grid, cfg.vision_downsample_ratio)):
        raise ValueError(f"image at {image.offset}: its span's token layout does not match its "
                         f"{image.grid[0]}x{image.grid[1]} patch grid")
    e = image.embeds
    if e is not None and (tuple(e.shape) != (image.num_tokens, cfg.dim) or not e.is_floating_point()):
        raise ValueError(f"image at {image.offset}: embeddings of shape {tuple(e.shape)} ({e.dtype}), expected "
                         f"({image.num_tokens}, {cfg.dim}) floating point rows for its span")


def check_prompt_image(cfg: DeepseekV41Config, image: ImageSpan, prompt_token_ids: list[int]) -> None:
    """`check_span`, and every position of the span carries the image token id: what the whole model checks at
    `add_request`, and a front end without the model (the multi-process executor's) through the image processor."""
    check_span(cfg, image)
    if any(t != cfg.image_token_id for t in prompt_token_ids[image.offset:image.end]):
        raise ValueError(f"image at {image.offset}: every position of its span must carry the image token id "
                         f"{cfg.image_token_id}")


def embed_span(tower: nn.Module, image: ImageSpan) -> torch.Tensor:
    """The span's input rows [num_tokens, dim] in the tower's dtype, on its device: the Aligner's outputs at the IMAGE
    positions (reading order), the learned delimiter embeddings elsewhere. `tower`: a module holding `vision`,
    `aligner`, `image_start`, `image_newline` and `image_end` (the whole model, or the encoder alone)."""
    start = tower.image_start
    dev, dt = start.device, start.dtype
    feats = tower.aligner(tower.vision(image.patches.to(dev, dt), image.grid), image.grid).to(dt)
    types = torch.tensor(image.token_types, device=dev)
    out = torch.empty((image.num_tokens, start.shape[0]), dtype=dt, device=dev)
    out[types == IMAGE_START] = start
    out[types == IMAGE_END] = tower.image_end.to(dt)
    out[types == IMAGE_NEW_LINE] = tower.image_newline.to(dt)
    out[types == IMAGE] = feats
    return out
