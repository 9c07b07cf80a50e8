"""DeepSeek's published weight formats as tensors, and their exact arithmetic (the reference every kernel
is tested against).

- FP8 block-scaled (`quant_method: fp8`, `scale_fmt: ue8m0`): weight [N, K] float8_e4m3fn, one power-of-two
  scale per `block` x `block` tile (128 in V4, 32 in V4.1) as float8_e8m0fnu [ceil(N/b), ceil(K/b)];
  w = fp8 value * 2^(e - 127).
- MXFP4 (`expert_dtype: fp4`): E2M1 values packed two per byte, the even element in the low nibble
  ([N, K/2], an int8/uint8 container), one E8M0 scale per 32 consecutive input-channel values ([N, K/32]).
- Activations of FP8 GEMMs are quantized the way DeepSeek's inference code does (`act_quant`): per token,
  groups of `block` channels, scale = 2^ceil(log2(amax * fp32(1/448))) (amax floored at 1e-4), values rounded to
  nearest-even E4M3 and clamped to +-448.
"""

from __future__ import annotations

import torch

FP8_MAX = 448.0
_FP8_MAX_INV = torch.tensor(1.0 / FP8_MAX, dtype=torch.float32)
MXFP4_GROUP = 32
E8M0_BIAS = 127
# E2M1 by 4-bit code (bit 3 is the sign)
E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


# ---- E8M0 scales --------------------------------------------------------------------------------------
def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """float8_e8m0fnu (or its raw uint8 bytes) -> float32 powers of two."""
    e = scale.view(torch.uint8).to(torch.int32)
    return torch.ldexp(torch.ones_like(e, dtype=torch.float32), e - E8M0_BIAS)


def float_to_e8m0(pow2: torch.Tensor) -> torch.Tensor:
    """Exact powers of two (float32) -> float8_e8m0fnu."""
    e = torch.frexp(pow2.float()).exponent - 1 + E8M0_BIAS
    return e.clamp(0, 254).to(torch.uint8).view(torch.float8_e8m0fnu)


def pow2_ceil(x: torch.Tensor) -> torch.Tensor:
    """2^ceil(log2(x)) for positive float32 x, exactly (no log rounding)."""
    mant, exp = torch.frexp(x.float())                 # x = mant * 2^exp, mant in [0.5, 1)
    return torch.ldexp(torch.ones_like(mant), exp - (mant == 0.5).to(exp.dtype))


# ---- FP8 block-scaled ---------------------------------------------------------------------------------
def fp8_scale_shape(shape: tuple[int, ...], block: int) -> tuple[int, ...]:
    """Scale shape of an FP8 weight [..., N, K] with block x block tiles."""
    *lead, n, k = shape
    return (*lead, -(-n // block), -(-k // block))


def _expand_blocks(s: torch.Tensor, n: int, k: int, block: int) -> torch.Tensor:
    return s.repeat_interleave(block, dim=-2)[..., :n, :].repeat_interleave(block, dim=-1)[..., :k]


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor, block: int) -> torch.Tensor:
    """FP8 weight [..., N, K] with E8M0 (or float32) block scales -> float32 [..., N, K]."""
    n, k = weight.shape[-2:]
    s = e8m0_to_float(scale) if scale.dtype in (torch.float8_e8m0fnu, torch.uint8) else scale.float()
    return weight.float() * _expand_blocks(s, n, k, block)


def quantize_fp8(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float weight [..., N, K] -> (float8_e4m3fn [..., N, K], float8_e8m0fnu block scales): the smallest
    power-of-two scale that keeps each tile within +-448 (how DeepSeek's checkpoints are made)."""
    n, k = w.shape[-2:]
    pad = (0, -k % block, 0, -n % block)
    wp = torch.nn.functional.pad(w.float(), pad)
    tiles = wp.unflatten(-1, (-1, block)).unflatten(-3, (-1, block))      # [..., N/b, b, K/b, b]
    amax = tiles.abs().amax(dim=(-3, -1)).clamp(min=1e-12)
    scale = pow2_ceil(amax / FP8_MAX)
    q = (w.float() / _expand_blocks(scale, n, k, block)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, float_to_e8m0(scale)


def quantize_activations(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (float8_e4m3fn [M, K], float32 power-of-two scales [M, ceil(K/block)]): DeepSeek's
    `act_quant` semantics with `scale_fmt="ue8m0"` (see the module docstring)."""
    m, k = x.shape
    xg = torch.nn.functional.pad(x.float(), (0, -k % block)).view(m, -1, block)
    # times float32(1/448) as DeepSeek's kernel does (for every bf16 amax this equals dividing by 448)
    scale = pow2_ceil(xg.abs().amax(-1).clamp(min=1e-4) * _FP8_MAX_INV)
    q = (xg / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.flatten(1)[:, :k], scale


def dequantize_activations(q: torch.Tensor, scale: torch.Tensor, block: int) -> torch.Tensor:
    return q.float() * scale.repeat_interleave(block, dim=-1)[:, :q.shape[1]]


# ---- MXFP4 --------------------------------------------------------------------------------------------
def mxfp4_scale_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Scale shape of an MXFP4 weight whose logical shape is [..., N, K]."""
    *lead, n, k = shape
    return (*lead, n, k // MXFP4_GROUP)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """[..., K/2] bytes (low nibble = even element) -> float32 [..., K]."""
    b = packed.view(torch.uint8)
    table = E2M1_VALUES.to(b.device)
    return torch.stack((table[(b & 0xF).long()], table[(b >> 4).long()]), dim=-1).flatten(-2)


def dequantize_mxfp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """MXFP4 [..., N, K/2] + E8M0 scales [..., N, K/32] -> float32 [..., N, K]."""
    return unpack_e2m1(packed) * e8m0_to_float(scale).repeat_interleave(MXFP4_GROUP, dim=-1)


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float [..., N, K] -> (uint8 [..., N, K/2] packed E2M1, float8_e8m0fnu [..., N, K/32]); the scale of
    a group is the power of two that maps its amax to at most 6, values round to the nearest E2M1."""
    wg = w.float().unflatten(-1, (-1, MXFP4_GROUP))
    scale = pow2_ceil(wg.abs().amax(-1).clamp(min=2.0 ** -120) / 6.0)
    v = (wg / scale[..., None]).clamp(-6.0, 6.0).flatten(-2)
    mags = E2M1_VALUES[:8].to(v.device)
    code = (v.abs()[..., None] - mags).abs().argmin(-1).to(torch.uint8)   # nearest magnitude (ties: lower)
    code |= (v < 0).to(torch.uint8) << 3
    return (code[..., 0::2] | (code[..., 1::2] << 4)).contiguous(), float_to_e8m0(scale)
