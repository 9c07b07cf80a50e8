"""DeepSeek-V4.1's FP4/FP8 cache rows (quantization/kv_formats.py's `Fp4BlockCodec`, `Fp8BlockCodec`) and V4's
FlashMLA rows (`Fp8DsMlaCodec`) encoded inside Triton kernels, bit for bit: a kernel that makes an entry writes its
packed row directly instead of handing the values to the codec's torch ops. Every rounding is done on the bits (E4M3
and E2M1 to nearest even, E8M0 a power-of-two ceiling, bf16 to nearest even), so the bytes are the codec's on the GPU
and in Triton's interpreter alike; tested against the codec through the kernels that use it
(tests/test_sparse_decode_indexer.py)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def round_to(x, dt):
    """float32 x rounded to dt (to nearest, ties to even, as torch casts), kept in float32. bf16 by its bits: the
    GPU's conversion rounds so too, Triton's interpreter truncates."""
    if dt == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    return x.to(dt).to(tl.float32)


@triton.jit
def _rint(t):
    """Round to the nearest integer, ties to even, for 0 <= t < 2^22 (adding 2^23 leaves no fraction bits)."""
    return (t + 8388608.0) - 8388608.0


@triton.jit
def _e2m1_codes(v):
    """v in [-6, 6] (float32) -> 4-bit E2M1 codes (uint8, bit 3 the sign, set for -0.0 too) of v rounded to the
    nearest E2M1 value, ties to the even code (kv_formats._e2m1_round_magnitude / _e2m1_magnitude_code)."""
    mag = tl.abs(v)
    step = tl.where(mag < 2, 0.5, tl.where(mag < 4, 1.0, 2.0))
    r = _rint(mag / step) * step
    code = tl.where(r < 2, r * 2, tl.where(r < 4, r + 2, r * 0.5 + 4)).to(tl.uint8)
    return code | ((v.to(tl.uint32, bitcast=True) >> 31) << 3).to(tl.uint8)


@triton.jit
def _e4m3_scale(amax):
    """kv_formats._fp4_scale's E4M3 scale of groups with largest magnitude `amax`: E4M3(max(amax, 6 * 2^-9) / 6)
    (at most 448, to nearest even) -> (its value, its byte)."""
    q = tl.minimum(tl.div_rn(tl.maximum(amax, 0.01171875), 6.0), 448.0)
    bits = q.to(tl.uint32, bitcast=True)
    rb = (bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000                # 3 mantissa bits, to nearest even
    normal = q >= 0.015625                                                 # 2^-6; below, multiples of 2^-9
    sub = _rint(q * 512.0)
    byte = tl.where(normal, ((((rb >> 23) - 120) << 3) | ((rb >> 20) & 7)), sub.to(tl.uint32))
    return tl.where(normal, rb.to(tl.float32, bitcast=True), sub * 0.001953125), byte.to(tl.uint8)


@triton.jit
def _e8m0_scale(amax):
    """kv_formats._fp4_scale's E8M0 scale: 2^ceil(log2(max(amax, 6 * 2^-126) * fp32(1/6))) -> (value, byte)."""
    t = tl.maximum(amax, 7.052966104933725e-38) * 0.1666666716337204
    e = (t.to(tl.uint32, bitcast=True) + 0x7FFFFF) >> 23
    return (e << 23).to(tl.float32, bitcast=True), e.to(tl.uint8)


@triton.jit
def fp4_store(row, x_e, x_o, D: tl.constexpr, GROUP: tl.constexpr, E4M3: tl.constexpr):
    """`Fp4BlockCodec(GROUP, "e4m3" if E4M3 else "e8m0").encode` of one row of D values given as its even and odd
    channels x_e, x_o [D/2] (float32), stored at `row` (uint8): D/2 bytes of two codes (the even channel low), then
    one scale byte per GROUP values."""
    NG: tl.constexpr = D // GROUP
    ge = tl.reshape(x_e, (NG, GROUP // 2))
    go = tl.reshape(x_o, (NG, GROUP // 2))
    amax = tl.maximum(tl.max(tl.abs(ge), axis=1), tl.max(tl.abs(go), axis=1))
    if E4M3:
        s, sbyte = _e4m3_scale(amax)
    else:
        s, sbyte = _e8m0_scale(amax)
    ce = _e2m1_codes(tl.minimum(tl.maximum(tl.div_rn(ge, s[:, None]), -6.0), 6.0))
    co = _e2m1_codes(tl.minimum(tl.maximum(tl.div_rn(go, s[:, None]), -6.0), 6.0))
    tl.store(row + tl.arange(0, D // 2), tl.reshape(ce | (co << 4), (D // 2,)))
    tl.store(row + D // 2 + tl.arange(0, NG), sbyte)


@triton.jit
def _e4m3_bytes(v):
    """v in [-448, 448] (float32) -> float8_e4m3fn bytes of v rounded to nearest even (torch's cast), by the bits."""
    mag = tl.abs(v)
    bits = mag.to(tl.uint32, bitcast=True)
    rb = (bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000                # 3 mantissa bits, to nearest even
    normal = mag >= 0.015625                                               # 2^-6; below, multiples of 2^-9
    sub = _rint(mag * 512.0)                                               # (8: the smallest normal's byte)
    byte = tl.where(normal, (((rb >> 23) - 120) << 3) | ((rb >> 20) & 7), sub.to(tl.uint32))
    return (byte | ((v.to(tl.uint32, bitcast=True) >> 31) << 7)).to(tl.uint8)


@triton.jit
def fp8_store(row, x_e, x_o, D: tl.constexpr, BLOCK: tl.constexpr):
    """`Fp8BlockCodec(BLOCK).encode` of one row of D values given as its even and odd channels x_e, x_o [D/2] (float32),
    stored at `row` (uint8): D E4M3 bytes, then one E8M0 scale byte (2^ceil(log2(max(amax, 1e-4) / 448))) per BLOCK
    values."""
    NG: tl.constexpr = D // BLOCK
    be, bo, e = _fp8_tiles(x_e, x_o, D, BLOCK)
    i = tl.arange(0, D // 2)
    tl.store(row + 2 * i, be)
    tl.store(row + 2 * i + 1, bo)
    tl.store(row + D + tl.arange(0, NG), e.to(tl.uint8))


@triton.jit
def _fp8_tiles(x_e, x_o, D: tl.constexpr, TILE: tl.constexpr):
    """A row's even and odd channels x_e, x_o [D/2] (float32) as E4M3 bytes [D/2] each, one E8M0 exponent per TILE
    values (2^ceil(log2(max(amax, 1e-4) / 448)), as kv_formats) -> (even bytes, odd bytes, exponents [D / TILE])."""
    NT: tl.constexpr = D // TILE
    ge = tl.reshape(x_e, (NT, TILE // 2))
    go = tl.reshape(x_o, (NT, TILE // 2))
    amax = tl.maximum(tl.max(tl.abs(ge), axis=1), tl.max(tl.abs(go), axis=1))
    t = tl.maximum(amax, 1e-4) * 0.0022321429569274187                     # float32(1 / 448), as kv_formats
    e = (t.to(tl.uint32, bitcast=True) + 0x7FFFFF) >> 23
    s = (e << 23).to(tl.float32, bitcast=True)
    be = tl.reshape(_e4m3_bytes(tl.minimum(tl.maximum(tl.div_rn(ge, s[:, None]), -448.0), 448.0)), (D // 2,))
    bo = tl.reshape(_e4m3_bytes(tl.minimum(tl.maximum(tl.div_rn(go, s[:, None]), -448.0), 448.0)), (D // 2,))
    return be, bo, e


@triton.jit
def ds_mla_store(row, x_e, x_o, D: tl.constexpr, NOPE: tl.constexpr, TILE: tl.constexpr):
    """`Fp8DsMlaCodec(D - NOPE, TILE).encode` of one row of D values given as its even and odd channels x_e, x_o [D/2]
    (float32), stored at `row` (uint8): NOPE E4M3 bytes (one E8M0 scale per TILE values, `fp8_store`'s), the RoPE
    part's bf16 bits (low byte first), the NOPE / TILE scale bytes, zero bytes to a multiple of 8. Needs whole tiles
    of RoPE channels too (D - NOPE a multiple of TILE); they are quantized here but not stored."""
    NT: tl.constexpr = D // TILE
    NS: tl.constexpr = NOPE // TILE
    PAD: tl.constexpr = (NS + 7) // 8 * 8 - NS
    be, bo, e = _fp8_tiles(x_e, x_o, D, TILE)
    i = tl.arange(0, D // 2)
    nope = 2 * i < NOPE
    tl.store(row + 2 * i, be, mask=nope)
    tl.store(row + 2 * i + 1, bo, mask=nope)
    r_e = round_to(x_e, tl.bfloat16).to(tl.uint32, bitcast=True) >> 16
    r_o = round_to(x_o, tl.bfloat16).to(tl.uint32, bitcast=True) >> 16
    off = row + NOPE + 2 * tl.where(nope, 0, 2 * i - NOPE)                 # channel c at NOPE + 2 (c - NOPE)
    tl.store(off, (r_e & 0xFF).to(tl.uint8), mask=~nope)
    tl.store(off + 1, (r_e >> 8).to(tl.uint8), mask=~nope)
    tl.store(off + 2, (r_o & 0xFF).to(tl.uint8), mask=~nope)
    tl.store(off + 3, (r_o >> 8).to(tl.uint8), mask=~nope)
    k = tl.arange(0, NT)
    scales = row + 2 * D - NOPE
    tl.store(scales + k, e.to(tl.uint8), mask=k < NS)
    for j in tl.static_range(PAD):
        tl.store(scales + NS + j, tl.zeros((), tl.uint8))


@triton.jit
def fp4_qdq_e8m0(x_e, x_o, D: tl.constexpr, GROUP: tl.constexpr):
    """`fp4_block_qdq(x, GROUP, "e8m0")` of one row of D values given as its even and odd channels x_e, x_o [D/2]
    (float32): each value rounded to E2M1 (nearest, ties to even) times its group's E8M0 scale, kept float32 (exact
    in any dtype the row is then stored in)."""
    NG: tl.constexpr = D // GROUP
    ge = tl.reshape(x_e, (NG, GROUP // 2))
    go = tl.reshape(x_o, (NG, GROUP // 2))
    s, _ = _e8m0_scale(tl.maximum(tl.max(tl.abs(ge), axis=1), tl.max(tl.abs(go), axis=1)))
    ve = tl.minimum(tl.maximum(tl.div_rn(ge, s[:, None]), -6.0), 6.0)
    vo = tl.minimum(tl.maximum(tl.div_rn(go, s[:, None]), -6.0), 6.0)
    me, mo = tl.abs(ve), tl.abs(vo)
    se = tl.where(me < 2, 0.5, tl.where(me < 4, 1.0, 2.0))
    so = tl.where(mo < 2, 0.5, tl.where(mo < 4, 1.0, 2.0))
    qe = tl.where(ve.to(tl.uint32, bitcast=True) >> 31 != 0, -1.0, 1.0) * (_rint(me / se) * se)
    qo = tl.where(vo.to(tl.uint32, bitcast=True) >> 31 != 0, -1.0, 1.0) * (_rint(mo / so) * so)
    return tl.reshape(qe * s[:, None], (D // 2,)), tl.reshape(qo * s[:, None], (D // 2,))
