"""DeepSeek-V4 / V4.1 decode attention in one Triton launch per layer (plus a small combine when split).

`sparse_decode_attention` computes what `layers/sparse_attention.py:sparse_decode_attention` computes (its
contract is documented there) without gathering keys into new tensors: each program reads its keys straight from
the window ring (by slot and position) and from the paged compressed cache (through the row indices), decodes
quantized rows in registers (V4.1's FP8 window keys with E8M0 scales per 32, FP4 E2M1 entries with E4M3 or E8M0
scales, V4's FlashMLA rows of FP8 NoPE values with E8M0 scales per 64 and a bf16 RoPE part: the values
`quantization/kv_formats.py`'s codecs decode, bit for bit), and runs an online softmax.

- MQA: all heads of a row attend to the same K = V rows, so a program holds BLOCK_H heads of one row as the rows of
  its tiles: each key tile is loaded (and decoded) once for all of them and serves both QK^T and PV.
- Split-K (flash-decoding): with few rows the key tiles of a row (window tiles, then compressed tiles) are shared
  out among `splits` programs whose partial softmaxes a second kernel merges; the sink enters once, at the end.
- Softmax semantics (`softmax`): V4's sink is one more logit of the softmax (the running max starts from it);
  V4.1's max is the keys' own (floored at -1e30) and the sink enters the denominator only, so a row with no valid
  key gives exact zeros — DeepSeek's sparse_attn. In both, probabilities are rounded to the value dtype for the PV
  product (relative to the running max, as DeepSeek's kernel does) and summed in float32 for the denominator.
- Capturable and compile-stable: no host syncs; the grid depends on shapes only; the sizes that grow with the
  context (K compressed rows per query, its row stride) are runtime arguments that Triton does not specialize on,
  so a new context bucket is no new kernel variant (engine/compile_watch.py).

Tested against the torch reference in Triton's interpreter (tests/test_sparse_decode_attention.py) and on the GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from openinfer.layers.sparse_attention import SOFTMAXES, V41_SOFTMAX
from openinfer.quantization.kv_formats import Fp4BlockCodec, Fp8BlockCodec, Fp8DsMlaCodec, IdentityCodec, KVCodec
from openinfer.quantization.triton_kernels import num_sms

_LOG2E = 1.4426950408889634
# how a cache stores its rows (FMT constexpr): the value dtype itself, one of V4.1's codecs, or V4's FlashMLA rows
PLAIN, FP8_E8M0, FP4_E4M3, FP4_E8M0, FP8_DS_MLA = 0, 1, 2, 3, 4


@triton.jit
def _e8m0(e):
    """E8M0 scale bytes -> float32 2^(e - 127), exactly (byte 0 gives 0: only masked-out rows load it)."""
    return (e.to(tl.int32) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _load_keys(ptr, row_off, ok, d, D: tl.constexpr, FMT: tl.constexpr, GROUP: tl.constexpr, DTYPE: tl.constexpr,
               NOPE: tl.constexpr = 0):
    """Key rows starting at element offsets `row_off` [N] (rows where `ok` is False read as 0) -> [N, D_PAD] in
    DTYPE. Quantized rows are [values | scale bytes] uint8 (kv_formats' packed layout) and decode as the codecs do:
    value * scale in float32, one rounding to DTYPE. FP8_DS_MLA rows (`Fp8DsMlaCodec`): NOPE E4M3 bytes, the
    RoPE part's bf16 bits (two bytes each, low first), then one E8M0 byte per GROUP NoPE values."""
    base = ptr + row_off[:, None]
    m = ok[:, None] & (d < D)[None, :]
    if FMT == 0:
        k = tl.load(base + d[None, :], mask=m, other=0.0)
    elif FMT == 4:
        nope = (d < NOPE)[None, :]
        v = tl.load(base + d[None, :], mask=m & nope, other=0)
        e = tl.load(base + (2 * D - NOPE) + d[None, :] // GROUP, mask=m & nope, other=0)
        r = NOPE + 2 * tl.where(d < NOPE, 0, d - NOPE)[None, :]
        lo = tl.load(base + r, mask=m & ~nope, other=0).to(tl.uint32)
        hi = tl.load(base + r + 1, mask=m & ~nope, other=0).to(tl.uint32)
        rope = ((hi << 24) | (lo << 16)).to(tl.float32, bitcast=True)      # bf16 bits -> float32, exactly
        k = tl.where(nope, v.to(tl.float8e4nv, bitcast=True).to(tl.float32) * _e8m0(e), rope)
    elif FMT == 1:
        v = tl.load(base + d[None, :], mask=m, other=0)
        e = tl.load(base + D + d[None, :] // GROUP, mask=m, other=0)
        k = v.to(tl.float8e4nv, bitcast=True).to(tl.float32) * _e8m0(e)
    else:
        b = tl.load(base + d[None, :] // 2, mask=m, other=0).to(tl.int32)
        code = (b >> ((d[None, :] % 2) * 4)) & 0xF                     # even element in the low nibble
        c = (code & 0x7).to(tl.float32)
        mag = tl.where(c < 4, c * 0.5, tl.where(c < 6, c - 2, c * 2 - 8))
        val = tl.where((code & 0x8) != 0, -mag, mag)
        sb = tl.load(base + D // 2 + d[None, :] // GROUP, mask=m, other=0)
        if FMT == 2:
            s = sb.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        else:
            s = _e8m0(sb)
        k = val * s
    return k.to(DTYPE)


@triton.jit
def _mm(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """a @ b with float32 accumulation. UPCAST (Triton's CPU interpreter, whose bf16 dots are wrong): the same
    bf16 values multiplied in float32, where their products are exact — what the tensor cores compute."""
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PRECISION)


@triton.jit
def _cast(x, DTYPE: tl.constexpr, UPCAST: tl.constexpr):
    """float32 -> DTYPE, rounding to nearest even. UPCAST (the interpreter, which truncates to bf16): rounded in
    the bits first, so the cast itself is exact."""
    if UPCAST and DTYPE == tl.bfloat16:
        bits = x.to(tl.int32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -65536
        x = bits.to(tl.float32, bitcast=True)
    return x.to(DTYPE)


@triton.jit
def _attend_tile(q, k, ok, acc, m_i, l_i, qk_scale, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """One key tile (K = V) into the online softmax of BLOCK_H heads; scores and max in log2 units."""
    s = _mm(q, tl.trans(k), PRECISION, UPCAST) * qk_scale
    s = tl.where(ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))          # m_i starts at -1e30: exponents of -inf give exact zeros
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)               # float32 probabilities in the denominator
    acc = acc * alpha[:, None] + _mm(_cast(p, k.dtype, UPCAST), k, PRECISION, UPCAST)
    return acc, m_new, l_i


@triton.jit
def _finish(acc, m_i, l_i, sink, V41: tl.constexpr):
    """Normalize with the sink (log2 units): V4 takes it into the max, V4.1 into the denominator only."""
    if V41:
        return acc / (l_i + tl.exp2(sink - m_i))[:, None]
    m = tl.maximum(m_i, sink)
    alpha = tl.exp2(m_i - m)
    return acc * (alpha / (l_i * alpha + tl.exp2(sink - m)))[:, None]


# K (compressed rows per query) and the row tensors' strides grow with the context: not specialized on, so a new
# context bucket reuses the kernel (engine/compile_watch.py)
@triton.jit(do_not_specialize=["K", "stride_rows", "stride_valid"])
def _sparse_decode_kernel(
    q_ptr, out_ptr, sink_ptr, part_acc_ptr, part_ml_ptr,
    ring_ptr, slot_ptr, pos_ptr, cache_ptr, rows_ptr, valid_ptr,
    qk_scale, W, R, K,
    stride_qb, stride_qh, stride_ob, stride_oh,
    stride_ring_slot, stride_ring_row, stride_cache, stride_rows, stride_valid,
    H: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    WIN_FMT: tl.constexpr, WIN_GROUP: tl.constexpr, COMP_FMT: tl.constexpr, COMP_GROUP: tl.constexpr,
    WIN_NOPE: tl.constexpr, COMP_NOPE: tl.constexpr,
    HAS_COMP: tl.constexpr, HAS_VALID: tl.constexpr, V41: tl.constexpr, PRECISION: tl.constexpr,
    UPCAST: tl.constexpr,
):
    hb = tl.program_id(0)                           # head block: fastest, so a row's programs share its tiles in L2
    b = tl.program_id(1)
    split = tl.program_id(2)
    n_splits = tl.num_programs(2)
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = heads < H
    d = tl.arange(0, D_PAD)
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=h_ok[:, None] & (d < D)[None, :], other=0.0)
    dtype = q_ptr.dtype.element_ty
    pos = tl.load(pos_ptr + b).to(tl.int64)
    slot = tl.load(slot_ptr + b).to(tl.int64)
    # this program's tiles: window tiles [0, n_wt), then compressed tiles [n_wt, n_wt + n_ct)
    n_wt = tl.cdiv(W, BLOCK_N)
    n_tiles = n_wt
    if HAS_COMP:
        n_tiles += tl.cdiv(K, BLOCK_N)
    per = tl.cdiv(n_tiles, n_splits)
    t0 = split * per
    t1 = tl.minimum(t0 + per, n_tiles)
    m_i = tl.full([BLOCK_H], -1e30, tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, D_PAD], tl.float32)
    n = tl.arange(0, BLOCK_N)
    for t in range(t0, tl.minimum(t1, n_wt)):
        i = t * BLOCK_N + n
        kpos = pos - W + 1 + i                      # positions P-W+1 .. P, ring row p % R
        ok = (i < W) & (kpos >= 0)
        off = slot * stride_ring_slot + (tl.where(ok, kpos, 0) % R) * stride_ring_row
        k = _load_keys(ring_ptr, off, ok, d, D, WIN_FMT, WIN_GROUP, dtype, WIN_NOPE)
        acc, m_i, l_i = _attend_tile(q, k, ok, acc, m_i, l_i, qk_scale, PRECISION, UPCAST)
    if HAS_COMP:
        for t in range(tl.maximum(t0, n_wt), t1):
            j = (t - n_wt) * BLOCK_N + n
            ok = j < K
            if HAS_VALID:
                ok = ok & (tl.load(valid_ptr + b * stride_valid + j, mask=ok, other=0) != 0)
            row = tl.load(rows_ptr + b * stride_rows + j, mask=ok, other=0).to(tl.int64)
            k = _load_keys(cache_ptr, row * stride_cache, ok, d, D, COMP_FMT, COMP_GROUP, dtype, COMP_NOPE)
            acc, m_i, l_i = _attend_tile(q, k, ok, acc, m_i, l_i, qk_scale, PRECISION, UPCAST)
    # a runtime branch, not a variant: whether a step splits depends on its batch and context
    if n_splits > 1:                                # partials [B, H, splits, ...]; the sink is the combine's
        part = (b * H + heads) * n_splits + split
        tl.store(part_acc_ptr + part[:, None] * D_PAD + d[None, :], acc, mask=h_ok[:, None])
        tl.store(part_ml_ptr + part * 2, m_i, mask=h_ok)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=h_ok)
    else:
        sink = tl.load(sink_ptr + heads, mask=h_ok, other=0.0).to(tl.float32) * 1.4426950408889634
        out = _finish(acc, m_i, l_i, sink, V41)
        tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :], _cast(out, dtype, UPCAST),
                 mask=h_ok[:, None] & (d < D)[None, :])


@triton.jit(do_not_specialize=["n_splits"])
def _combine_kernel(part_acc_ptr, part_ml_ptr, sink_ptr, out_ptr, n_splits, stride_ob, stride_oh,
                    H: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, V41: tl.constexpr, UPCAST: tl.constexpr):
    """Program (row, head): merge the splits' partial softmaxes, then the sink."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    d = tl.arange(0, D_PAD)
    first = (b * H + h) * n_splits
    m_i = tl.full([1], -1e30, tl.float32)
    l_i = tl.zeros([1], tl.float32)
    acc = tl.zeros([1, D_PAD], tl.float32)
    for s in range(n_splits):
        ms = tl.load(part_ml_ptr + (first + s) * 2 + tl.zeros([1], tl.int32))
        ls = tl.load(part_ml_ptr + (first + s) * 2 + 1 + tl.zeros([1], tl.int32))
        m_new = tl.maximum(m_i, ms)
        wa, wb = tl.exp2(m_i - m_new), tl.exp2(ms - m_new)
        acc = acc * wa[:, None] + tl.load(part_acc_ptr + (first + s) * D_PAD + d)[None, :] * wb[:, None]
        l_i = l_i * wa + ls * wb
        m_i = m_new
    sink = tl.load(sink_ptr + h + tl.zeros([1], tl.int32)).to(tl.float32) * 1.4426950408889634
    out = _finish(acc, m_i, l_i, sink, V41)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d[None, :], _cast(out, out_ptr.dtype.element_ty, UPCAST),
             mask=(d < D)[None, :])


def _format(codec: KVCodec | None, dim: int, stored: torch.Tensor) -> tuple[int, int, int]:
    """(FMT, group, NoPE width: FP8_DS_MLA's, else 0) of a cache's rows, checked against the stored row width."""
    nope = 0
    if codec is None or isinstance(codec, IdentityCodec):
        fmt, group, width = PLAIN, 1, dim
    elif isinstance(codec, Fp8BlockCodec):
        fmt, group, width = FP8_E8M0, codec.block, codec.stored_dim(dim)
    elif isinstance(codec, Fp4BlockCodec):
        fmt, group = (FP4_E4M3 if codec.scale_fmt == "e4m3" else FP4_E8M0), codec.group
        width = codec.stored_dim(dim)
    elif isinstance(codec, Fp8DsMlaCodec):
        fmt, group, width, nope = FP8_DS_MLA, codec.tile, codec.stored_dim(dim), dim - codec.rope_dim
    else:
        raise ValueError(f"the sparse decode kernel cannot read {codec!r} rows")
    if stored.shape[-1] != width or stored.stride(-1) != 1:
        raise ValueError(f"rows of {stored.shape[-1]} (stride {stored.stride(-1)}) do not hold {codec!r} entries of "
                         f"{dim} values")
    if fmt != PLAIN and stored.dtype != torch.uint8:
        raise ValueError(f"{codec!r} rows must be uint8, got {stored.dtype}")
    return fmt, group, nope


def decode_launch(batch: int, heads: int, head_dim: int, keys: int, device: torch.device) -> dict:
    """Tile sizes and split count for rows of `keys` keys (window + compressed). BLOCK_H heads share each key tile
    (32: the [32, head_dim] float32 accumulator of a 512-wide head stays in registers at 8 warps); splits give a
    small batch about two programs per SM, at least two key tiles each. Untuned on the device so far:
    benchmarks/gpu_sparse_decode_attention.py --sweep measures the alternatives."""
    block_h = min(32, max(16, triton.next_power_of_2(heads)))
    block_n = 32 if head_dim >= 256 else 64
    programs = batch * triton.cdiv(heads, block_h)
    splits = max(1, min(2 * num_sms(device) // programs, triton.cdiv(keys, block_n) // 2, 16))
    return {"BLOCK_H": block_h, "BLOCK_N": block_n, "num_warps": 8 if head_dim >= 256 else 4, "num_stages": 2,
            "splits": splits}


def sparse_decode_attention(q: torch.Tensor, *, sinks: torch.Tensor, scale: float, softmax: str,
                            ring: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, window: int,
                            ring_codec: KVCodec | None = None, cache: torch.Tensor | None = None,
                            rows: torch.Tensor | None = None, valid: torch.Tensor | None = None,
                            cache_codec: KVCodec | None = None, out: torch.Tensor | None = None,
                            tuning: dict | None = None) -> torch.Tensor:
    """The fused kernel for `sparse_attention.sparse_decode_attention`'s contract (same arguments; `tuning`
    overrides `decode_launch`'s choices, for benchmarks)."""
    if softmax not in SOFTMAXES:
        raise ValueError(f"softmax must be one of {SOFTMAXES}, got {softmax!r}")
    B, H, D = q.shape
    if out is None:
        out = torch.empty_like(q)
    if B == 0:
        return out
    if window > ring.shape[1]:
        raise ValueError(f"window {window} exceeds the ring's {ring.shape[1]} rows")
    win_fmt, win_group, win_nope = _format(ring_codec, D, ring)
    has_comp = cache is not None
    if has_comp:
        cache = cache.view(-1, cache.shape[-1])
        comp_fmt, comp_group, comp_nope = _format(cache_codec, D, cache)
        K = rows.shape[1]
    else:
        cache, rows, comp_fmt, comp_group, comp_nope, K = ring, slots, PLAIN, 1, 0, 0   # unused stand-ins
    launch = decode_launch(B, H, D, window + K, q.device)
    launch.update(tuning or {})
    splits = launch.pop("splits")
    d_pad = max(16, triton.next_power_of_2(D))
    # (unsplit: float32 stand-ins, so both launches share one signature, hence one compiled variant)
    part_acc = torch.empty(B * H * splits if splits > 1 else 1, d_pad, dtype=torch.float32, device=q.device)
    part_ml = torch.empty(B * H * splits if splits > 1 else 1, 2, dtype=torch.float32, device=q.device)
    has_valid = has_comp and valid is not None
    valid_arg = valid if has_valid else rows
    v41 = softmax == V41_SOFTMAX
    precision = "ieee" if q.dtype == torch.float32 else "tf32"     # fp32 models: true fp32, as the reference
    _sparse_decode_kernel[(triton.cdiv(H, launch["BLOCK_H"]), B, splits)](
        q, out, sinks, part_acc, part_ml,
        ring, slots, positions, cache, rows, valid_arg,
        scale * _LOG2E, window, ring.shape[1], K,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        ring.stride(0), ring.stride(1), cache.stride(0), rows.stride(0), valid_arg.stride(0),
        H=H, D=D, D_PAD=d_pad, WIN_FMT=win_fmt, WIN_GROUP=win_group, COMP_FMT=comp_fmt, COMP_GROUP=comp_group,
        WIN_NOPE=win_nope, COMP_NOPE=comp_nope,
        HAS_COMP=has_comp, HAS_VALID=has_valid, V41=v41, PRECISION=precision,
        UPCAST=q.device.type != "cuda", **launch)
    if splits > 1:
        _combine_kernel[(B, H)](part_acc, part_ml, sinks, out, splits, out.stride(0), out.stride(1), H=H, D=D,
                                D_PAD=d_pad, V41=v41, UPCAST=q.device.type != "cuda")
    return out
