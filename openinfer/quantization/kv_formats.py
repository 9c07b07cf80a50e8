"""Quantized KV-cache formats of DeepSeek-V4.1: exact quantize-dequantize (QDQ) and packed storage codecs.

DeepSeek's inference code keeps three kinds of cache entries quantized. It simulates the storage with an
in-place QDQ on bf16 tensors; the functions here reproduce that arithmetic bit for bit, and the codecs
store the same information packed into uint8 rows, so a cache can hold the real bytes and decode gathered
rows back to exactly the QDQ values.

- FP8 block (`fp8_block_qdq`, `Fp8BlockCodec`): FP8 E4M3 values, one power-of-two (E8M0) scale per
  `block` = 32 consecutive values of the last dim. Scale = 2^ceil(log2(amax * fp32(1/448))) with amax
  floored at 1e-4; values x / scale rounded to nearest-even E4M3, saturating at +-448. DeepSeek uses it
  for the sliding-window KV (`act_quant(kv, 32, "ue8m0", float8_e8m0fnu, inplace=True)`, on the whole
  post-RoPE vector, RoPE tail included). head_dim 512: 512 value bytes + 16 scale bytes = 528 bytes/entry.
- FP4 block, E4M3 scales (`fp4_block_qdq(x, 16, "e4m3")`, `Fp4BlockCodec(16, "e4m3")`): FP4 E2M1 values
  (0, 0.5, 1, 1.5, 2, 3, 4, 6 and negatives), groups of 16, scale = E4M3(amax / 6) with amax floored at
  6 * 2^-9 (so the scale is never zero); x / scale is clamped to +-6 and rounded to nearest E2M1, ties to the
  even code. DeepSeek uses it for the compressed KV (`fp4_act_quant(latent, 16, True, float8_e4m3fn)`).
  head_dim 512: 256 value bytes + 32 scale bytes = 288 bytes/entry.
- FP4 block, E8M0 scales (`fp4_block_qdq(x, 32, "e8m0")`, `Fp4BlockCodec(32, "e8m0")`): as above with
  groups of 32 and scale = 2^ceil(log2(amax * fp32(1/6))), amax floored at 6 * 2^-126. DeepSeek uses it for
  the indexer keys (cached) and the indexer queries (`fp4_act_quant(k, 32, True)`). index_head_dim 128:
  64 value bytes + 4 scale bytes = 68 bytes/entry.

All arithmetic is done in float32 (as DeepSeek's kernels do for their bf16 inputs); the result is cast to the
input dtype once at the end, so bf16 input gives the reference's bf16 output, float32 input the unrounded
float32 values. Power-of-two scales are made with exponent-bit arithmetic, and E2M1 values with
`torch.round` (half to even) on a power-of-two grid, not lookup tables: exact on every backend, pure tensor
ops (no host synchronisation, static shapes), so encode/decode can run inside CUDA graphs.

Packed rows (`encode` output, uint8 [..., stored_dim]): the values, then one byte per scale.
FP8 values are the float8_e4m3fn bits; FP4 values are two E2M1 codes per byte (bit 3 = sign), the even
element in the low nibble. E8M0 scale bytes are the biased exponent (scale = 2^(byte - 127)); E4M3 scale
bytes are the float8_e4m3fn bits.

DeepSeek-V4's own cache format (`Fp8DsMlaCodec`, `kv_cache_dtype="fp8_ds_mla"`, vLLM's name) is FlashMLA's
"MODEL1" FP8 sparse layout, 584 bytes per entry of head_dim 512: see the class.

The FP8 KV cache of the Llama family and Gemma-3 (`kv_cache_dtype="fp8"`, `fp8_kv_quantize` /
`fp8_kv_dequantize`) is a different, simpler format: E4M3 values with one float32 scale per K or V row of
head_dim values (per token, per K/V, per KV head), scale = amax / 448. See docs/kv_cache_fp8.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from .formats import FP8_MAX

FP4_MAX = 6.0
# DeepSeek's kernels multiply amax by these reciprocals as float32 constants (python floats holding the exact
# float32 values, so the multiplication rounds once, to the same float32 product).
_FP8_MAX_INV = float(torch.tensor(1.0 / FP8_MAX, dtype=torch.float32))
_FP4_MAX_INV = float(torch.tensor(1.0 / FP4_MAX, dtype=torch.float32))
_FP8_AMAX_FLOOR = 1e-4
_FP4_E4M3_AMAX_FLOOR = 6 * 2.0**-9      # smallest E4M3 subnormal times 6: the scale stays nonzero
_FP4_E8M0_AMAX_FLOOR = 6 * 2.0**-126    # smallest normal float32 times 6
_MANTISSA_BITS = 23
SCALE_FORMATS = ("e8m0", "e4m3")


# ---- scales -----------------------------------------------------------------------------------------------
def _pow2_ceil_exponent(t: torch.Tensor) -> torch.Tensor:
    """Biased exponent (int32) of 2^ceil(log2(t)) for non-negative finite float32 t, from the bit pattern.

    Adding 2^23 - 1 to the bits carries into the exponent field exactly when the mantissa is nonzero. For
    subnormal t this gives 1 (2^-126), for 0 it gives 0, like the kernel's exponent/mantissa test. Unlike
    `formats.pow2_ceil` (frexp/ldexp, i.e. a `pow` call), this is exact on every backend.
    """
    return (t.contiguous().view(torch.int32) + ((1 << _MANTISSA_BITS) - 1)) >> _MANTISSA_BITS


def _exponent_to_float(e: torch.Tensor) -> torch.Tensor:
    """Biased exponent (any integer dtype, 1..254) -> float32 2^(e - 127), exactly."""
    return (e.to(torch.int32) << _MANTISSA_BITS).view(torch.float32)


def _group_amax(xg: torch.Tensor) -> torch.Tensor:
    return xg.abs().amax(dim=-1)


def _fp8_scale(xg: torch.Tensor) -> torch.Tensor:
    """Groups [..., n, block] float32 -> biased E8M0 exponents [..., n] (int32)."""
    return _pow2_ceil_exponent(_group_amax(xg).clamp_min(_FP8_AMAX_FLOOR) * _FP8_MAX_INV)


def _fp4_scale(xg: torch.Tensor, scale_fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Groups [..., n, group] float32 -> (float32 scales [..., n], scale bytes uint8 [..., n])."""
    amax = _group_amax(xg)
    if scale_fmt == "e4m3":
        # amax >= 0, so saturating at +448 before the (nearest-even) cast is all satfinite needs
        s8 = (amax.clamp_min(_FP4_E4M3_AMAX_FLOOR) / FP4_MAX).clamp_max(FP8_MAX).to(torch.float8_e4m3fn)
        return s8.float(), s8.view(torch.uint8)
    e = _pow2_ceil_exponent(amax.clamp_min(_FP4_E8M0_AMAX_FLOOR) * _FP4_MAX_INV)
    return _exponent_to_float(e), e.to(torch.uint8)


def _fp4_scale_from_bytes(b: torch.Tensor, scale_fmt: str) -> torch.Tensor:
    if scale_fmt == "e4m3":
        return b.view(torch.float8_e4m3fn).float()
    return _exponent_to_float(b)


# ---- E2M1 -------------------------------------------------------------------------------------------------
def _e2m1_round_magnitude(mag: torch.Tensor) -> torch.Tensor:
    """|v| in [0, 6] (float32) -> nearest E2M1 magnitude, ties to the even code.

    E2M1 spacing is 0.5 below 2, 1 in [2, 4), 2 in [4, 6]; on each stretch the code's parity is the parity
    of magnitude / spacing, so half-to-even `round` of magnitude / spacing is the round-to-nearest-even
    of the format (0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4). All exact.
    """
    step = torch.where(mag < 2, 0.5, torch.where(mag < 4, 1.0, 2.0)).to(mag.dtype)
    return torch.round(mag / step) * step


def _e2m1_magnitude_code(r: torch.Tensor) -> torch.Tensor:
    """E2M1 magnitude (float32, on the grid) -> 3-bit code (uint8)."""
    return torch.where(r < 2, r * 2, torch.where(r < 4, r + 2, r * 0.5 + 4)).to(torch.uint8)


def _e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """4-bit E2M1 codes (uint8, bit 3 = sign) -> float32 (code 8 is -0.0)."""
    c = (codes & 0x7).float()
    mag = torch.where(c < 4, c * 0.5, torch.where(c < 6, c - 2, c * 2 - 8))
    return torch.where((codes & 0x8) != 0, -mag, mag)


def _fp4_scaled(xg: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return (xg / s.unsqueeze(-1)).clamp(-FP4_MAX, FP4_MAX)


# ---- QDQ --------------------------------------------------------------------------------------------------
def _check_divisible(dim: int, block: int, what: str) -> None:
    if dim % block:
        raise ValueError(f"last dim {dim} is not divisible by the {what} size {block}")


def _groups(x: torch.Tensor, block: int, what: str) -> torch.Tensor:
    _check_divisible(x.shape[-1], block, what)
    return x.float().unflatten(-1, (-1, block))


def fp8_block_qdq(x: torch.Tensor, block: int = 32) -> torch.Tensor:
    """FP8 E4M3 quantize-dequantize with one power-of-two scale per `block` values of the last dim.

    Returns a new tensor of x's dtype; bf16 input is bit-identical to DeepSeek's
    `act_quant(x, block, "ue8m0", float8_e8m0fnu, inplace=True)`.
    """
    xg = _groups(x, block, "FP8 block")
    s = _exponent_to_float(_fp8_scale(xg)).unsqueeze(-1)
    q = (xg / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return (q.float() * s).flatten(-2).to(x.dtype)


def fp4_block_qdq(x: torch.Tensor, group: int, scale_fmt: str) -> torch.Tensor:
    """FP4 E2M1 quantize-dequantize with one scale per `group` values of the last dim; `scale_fmt` "e8m0"
    (power of two) or "e4m3" (E4M3 of amax / 6).

    Returns a new tensor of x's dtype; bf16 input is bit-identical to DeepSeek's
    `fp4_act_quant(x, group, True, scale_dtype=float8_e8m0fnu / float8_e4m3fn)`.
    """
    _check_scale_fmt(scale_fmt)
    xg = _groups(x, group, "FP4 group")
    s, _ = _fp4_scale(xg, scale_fmt)
    v = _fp4_scaled(xg, s)
    q = torch.copysign(_e2m1_round_magnitude(v.abs()), v)
    return (q * s.unsqueeze(-1)).flatten(-2).to(x.dtype)


def _check_scale_fmt(scale_fmt: str) -> None:
    if scale_fmt not in SCALE_FORMATS:
        raise ValueError(f"scale_fmt must be one of {SCALE_FORMATS}, got {scale_fmt!r}")


# ---- storage codecs ---------------------------------------------------------------------------------------
class KVCodec(Protocol):
    """How a cache stores entries of `dim` values: `storage_dtype` [..., stored_dim(dim)] rows."""

    storage_dtype: torch.dtype

    def stored_dim(self, dim: int) -> int: ...

    def encode(self, x: torch.Tensor) -> torch.Tensor: ...

    def decode(self, stored: torch.Tensor, dtype: torch.dtype) -> torch.Tensor: ...

    def qdq(self, x: torch.Tensor) -> torch.Tensor: ...


def _dim_from_stored(codec: KVCodec, stored: int, num: int, den: int) -> int:
    """Invert stored_dim = dim * den / num (checked by recomputing it)."""
    dim = stored * num // den
    if stored * num % den or codec.stored_dim(dim) != stored:
        raise ValueError(f"stored row of {stored} bytes is not a valid {codec} entry")
    return dim


@dataclass(frozen=True)
class IdentityCodec:
    """Unquantized cache: entries are stored as `dtype` itself."""

    dtype: torch.dtype

    @property
    def storage_dtype(self) -> torch.dtype:
        return self.dtype

    def stored_dim(self, dim: int) -> int:
        return dim

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.dtype)

    def decode(self, stored: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return stored.to(dtype)

    def qdq(self, x: torch.Tensor) -> torch.Tensor:
        """The values a round trip through storage gives (rounding to `dtype`), in x's dtype."""
        return x.to(self.dtype).to(x.dtype)


@dataclass(frozen=True)
class Fp8BlockCodec:
    """FP8 E4M3 values + E8M0 scale byte per `block` values: uint8 rows of dim + dim / block bytes."""

    block: int = 32

    def __post_init__(self) -> None:
        if self.block <= 0:
            raise ValueError(f"FP8 block size must be positive, got {self.block}")

    @property
    def storage_dtype(self) -> torch.dtype:
        return torch.uint8

    def stored_dim(self, dim: int) -> int:
        _check_divisible(dim, self.block, "FP8 block")
        return dim + dim // self.block

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        xg = _groups(x, self.block, "FP8 block")
        e = _fp8_scale(xg)
        q = (xg / _exponent_to_float(e).unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return torch.cat((q.flatten(-2).view(torch.uint8), e.to(torch.uint8)), dim=-1)

    def decode(self, stored: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        dim = _dim_from_stored(self, stored.shape[-1], self.block, self.block + 1)
        q = stored[..., :dim].view(torch.float8_e4m3fn).float().unflatten(-1, (-1, self.block))
        s = _exponent_to_float(stored[..., dim:]).unsqueeze(-1)
        return (q * s).flatten(-2).to(dtype)

    def qdq(self, x: torch.Tensor) -> torch.Tensor:
        return fp8_block_qdq(x, self.block)


@dataclass(frozen=True)
class Fp4BlockCodec:
    """FP4 E2M1 values (two per byte) + one E8M0 or E4M3 scale byte per `group` values: uint8 rows of
    dim / 2 + dim / group bytes."""

    group: int
    scale_fmt: str

    def __post_init__(self) -> None:
        if self.group <= 0 or self.group % 2:
            raise ValueError(f"FP4 group size must be positive and even (two values per byte), got {self.group}")
        _check_scale_fmt(self.scale_fmt)

    @property
    def storage_dtype(self) -> torch.dtype:
        return torch.uint8

    def stored_dim(self, dim: int) -> int:
        _check_divisible(dim, self.group, "FP4 group")
        return dim // 2 + dim // self.group

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        xg = _groups(x, self.group, "FP4 group")
        s, s_bytes = _fp4_scale(xg, self.scale_fmt)
        v = _fp4_scaled(xg, s).flatten(-2)
        codes = _e2m1_magnitude_code(_e2m1_round_magnitude(v.abs())) | (torch.signbit(v).to(torch.uint8) << 3)
        packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
        return torch.cat((packed, s_bytes), dim=-1)

    def decode(self, stored: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        dim = _dim_from_stored(self, stored.shape[-1], 2 * self.group, self.group + 2)
        packed = stored[..., : dim // 2]
        codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2)
        q = _e2m1_decode(codes).unflatten(-1, (-1, self.group))
        s = _fp4_scale_from_bytes(stored[..., dim // 2:], self.scale_fmt).unsqueeze(-1)
        return (q * s).flatten(-2).to(dtype)

    def qdq(self, x: torch.Tensor) -> torch.Tensor:
        return fp4_block_qdq(x, self.group, self.scale_fmt)


def _ds_mla_scale_bytes(tiles: int) -> int:
    """Scale bytes of an `Fp8DsMlaCodec` row: one per tile, zero-padded to a multiple of 8 (V4: 7 + 1 = 8)."""
    return -(-tiles // 8) * 8


@dataclass(frozen=True)
class Fp8DsMlaCodec:
    """DeepSeek-V4's KV entries as FlashMLA's sparse FP8 decode reads them ("MODEL1_FP8Sparse"; vLLM's
    kv_cache_dtype "fp8_ds_mla"): the first dim - `rope_dim` ("NoPE") values FP8 E4M3 with one power-of-two (UE8M0)
    scale per `tile` values, the last `rope_dim` (the RoPE part) kept as bf16. One uint8 row per entry:

        [0, nope)                          E4M3 bytes of the NoPE values
        [nope, nope + 2*rope_dim)          the RoPE values' bf16 bits, little-endian
        [nope + 2*rope_dim, stored_dim)    one E8M0 byte per tile (scale = 2^(byte - 127)), zero bytes to a
                                           multiple of 8

    V4 (head_dim 512, rope_dim 64, tile 64): 448 + 128 + 7 + 1 = 584 bytes/entry. Source: deepseek-ai/FlashMLA at
    9241ae3ef9ba — csrc/api/sparse_decode.h (d_qk 512: bytes_per_token = 448 + 64*2 + (448/64)*1 + 1),
    csrc/sm90/decode/sparse_fp8/splitkv_mla.cuh (a token's 576 value bytes at rel_idx * 576 in its page block, its 8
    scale bytes at page_block_size * 576 + rel_idx * 8) and tests/quant.py (quantize_k_cache, MODEL1_FP8Sparse).
    FlashMLA puts a page block's scale bytes after all its value bytes; with page_block_size = 1 that is this row
    exactly, so a cache of these rows viewed as (rows, 1, 1, 584) with flat row indices is a FlashMLA MODEL1 cache
    as it is (num_blocks = rows; the sm90 kernel reads the scales with one 8-byte load, so rows stay 8-aligned).

    Scales are DeepSeek's V4 inference arithmetic (`act_quant(kv[..., :-rd], 64, "ue8m0", ..., inplace=True)`, as
    `fp8_block_qdq(., tile)`): 2^ceil(log2(max(amax, 1e-4) * fp32(1/448))). FlashMLA's test quantizer floors
    amax / 448 at 1e-4 instead, so tiles with amax < 0.0448 get a coarser scale there; the bytes decode the same
    way either way (value * 2^(byte - 127), exact in bf16). Small heads (the tiny test models) use a smaller `tile`
    that divides their NoPE width (`for_head`)."""

    rope_dim: int = 64
    tile: int = 64

    def __post_init__(self) -> None:
        if self.rope_dim <= 0 or self.tile <= 0:
            raise ValueError(f"rope_dim and tile must be positive, got {self.rope_dim}, {self.tile}")

    @classmethod
    def for_head(cls, head_dim: int, rope_dim: int) -> "Fp8DsMlaCodec":
        """FlashMLA's tile of 64 where it divides the NoPE width, else the largest power of two below it that does."""
        nope = head_dim - rope_dim
        if nope <= 0:
            raise ValueError(f"head_dim {head_dim} leaves no NoPE values beside rope_dim {rope_dim}")
        return cls(rope_dim, min(64, nope & -nope))

    @property
    def storage_dtype(self) -> torch.dtype:
        return torch.uint8

    def _nope(self, dim: int) -> int:
        nope = dim - self.rope_dim
        if nope <= 0:
            raise ValueError(f"entries of {dim} values leave no NoPE values beside rope_dim {self.rope_dim}")
        _check_divisible(nope, self.tile, "FP8 tile")
        return nope

    def stored_dim(self, dim: int) -> int:
        nope = self._nope(dim)
        return nope + 2 * self.rope_dim + _ds_mla_scale_bytes(nope // self.tile)

    def dim_of(self, stored: int) -> int:
        """The entry width whose rows are `stored` bytes wide."""
        for tiles in range(1, stored // self.tile + 1):
            if tiles * self.tile + 2 * self.rope_dim + _ds_mla_scale_bytes(tiles) == stored:
                return tiles * self.tile + self.rope_dim
        raise ValueError(f"stored row of {stored} bytes is not a valid {self} entry")

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        nope = self._nope(x.shape[-1])
        xg = _groups(x[..., :nope], self.tile, "FP8 tile")
        e = _fp8_scale(xg)
        q = (xg / _exponent_to_float(e).unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        rope = x[..., nope:].to(torch.bfloat16).contiguous().view(torch.uint8)
        pad = e.new_zeros((*e.shape[:-1], _ds_mla_scale_bytes(e.shape[-1]) - e.shape[-1]))
        return torch.cat((q.flatten(-2).view(torch.uint8), rope, e.to(torch.uint8), pad.to(torch.uint8)), dim=-1)

    def decode(self, stored: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        dim = self.dim_of(stored.shape[-1])
        nope, end = dim - self.rope_dim, dim + self.rope_dim
        q = stored[..., :nope].view(torch.float8_e4m3fn).float().unflatten(-1, (-1, self.tile))
        s = _exponent_to_float(stored[..., end:end + nope // self.tile]).unsqueeze(-1)
        rope = stored[..., nope:end].contiguous().view(torch.bfloat16)
        return torch.cat(((q * s).flatten(-2).to(dtype), rope.to(dtype)), dim=-1)

    def qdq(self, x: torch.Tensor) -> torch.Tensor:
        nope = self._nope(x.shape[-1])
        return torch.cat((fp8_block_qdq(x[..., :nope], self.tile), x[..., nope:].to(torch.bfloat16).to(x.dtype)), -1)


# ---- FP8 KV cache of the Llama family and Gemma-3 (kv_cache_dtype="fp8") -----------------------------------
def fp8_kv_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of the last dim -> (float8_e4m3fn values [..., D], float32 scales [...]), one scale per row.

    In float32: scale = amax / 448 (1.0 where that is 0: an all-zero row, or an amax so small that the
    quotient underflows, which only float32 input can have); values = (x / scale) clamped to +-448 (the
    quotient of the amax element can round to just above 448, and E4M3 has no infinity), then cast to E4M3
    (round to nearest even). A division, not a multiplication by 1 / scale: a kernel matching this must
    divide too. The amax element becomes +-448 exactly.
    """
    xf = x.float()
    scale = xf.abs().amax(dim=-1) / FP8_MAX
    scale = torch.where(scale == 0, 1.0, scale)
    q = (xf / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def fp8_kv_dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Inverse of fp8_kv_quantize: q.float() * scale (float32), then one cast to `dtype`."""
    return (q.float() * scale.unsqueeze(-1)).to(dtype)
