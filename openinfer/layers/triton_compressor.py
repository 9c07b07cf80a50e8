"""Triton kernels of DeepSeek's compressors for decode rows (one token per sequence): one launch per compressor
and step does what V4's `RunningCompressor.close_decode` (HCA) and `OverlappingCompressor.close_decode` (CSA and the
lightning indexer's keys) do in some thirty torch kernels — fold the new row into the request's state, and for a
row that closes its window pool the window, apply kv_norm's RMSNorm and the interleaved RoPE of the window's first
position, and write the entry into the paged cache. V4.1's KV sources take two launches around the index keys'
projection (`v41_compress_decode`, `v41_index_keys_decode`), their entries FP4-packed in the kernel as the caches'
codecs pack them (quantization/triton_kv_formats.py).

One program per decode row, all channels in registers as even/odd halves (the RoPE pairs are adjacent channels).
Divisions and the square root round as torch's do (IEEE); exp is the GPU's approximate one (a last-bit difference).
Rows that close no window write no entry: the torch path writes theirs to the scratch block, whose contents nothing
reads as an entry. Positions, slots and block tables are device tensors and the table's width a runtime argument
Triton does not specialize on: no host synchronization, no new variant per context bucket (CUDA-graph capturable).
The models' torch code is the reference (tests/test_sparse_decode_indexer.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from openinfer.quantization.kv_formats import Fp8DsMlaCodec
from openinfer.quantization.triton_kv_formats import ds_mla_store, fp4_store, round_to


@triton.jit
def _rms_norm(x_e, x_o, i, w_ptr, eps, dt, D: tl.constexpr):
    """RMSNorm of one row given as even/odd channels (float32): x / sqrt(mean(x^2) + eps) times the float32 weight,
    rounded to dt once (V4's `RMSNorm`)."""
    inv = tl.div_rn(1.0, tl.sqrt_rn((tl.sum(x_e * x_e, 0) + tl.sum(x_o * x_o, 0)) / D + eps))
    return (round_to(tl.load(w_ptr + 2 * i) * (x_e * inv), dt), round_to(tl.load(w_ptr + 2 * i + 1) * (x_o * inv), dt))


@triton.jit
def _rope(y_e, y_o, i, inv_freq_ptr, pos, rope_scale, dt, cs_dt, HALF: tl.constexpr, ROPE_HALF: tl.constexpr):
    """`apply_rope` at position `pos` on the last 2 * ROPE_HALF channels (pairs 2i, 2i + 1), cos/sin rounded to cs_dt
    (V4: the entry dtype; V4.1: float32), the result rounded to dt."""
    j = i - (HALF - ROPE_HALF)
    rot = j >= 0
    f = pos.to(tl.float32) * tl.load(inv_freq_ptr + j, mask=rot, other=0.0)
    c = round_to(tl.cos(f) * rope_scale, cs_dt)
    s = round_to(tl.sin(f) * rope_scale, cs_dt)
    return (round_to(tl.where(rot, y_e * c - y_o * s, y_e), dt), round_to(tl.where(rot, y_o * c + y_e * s, y_o), dt))


@triton.jit
def _entry_store(x_e, x_o, i, dst, w_ptr, inv_freq_ptr, eps, pos, rope_scale, dt, D: tl.constexpr,
                 HALF: tl.constexpr, ROPE_HALF: tl.constexpr, DS_NOPE: tl.constexpr, DS_TILE: tl.constexpr):
    """A V4 entry: the pooled channels (float32 holding the entry dtype dt's values) through kv_norm and the
    interleaved RoPE of position `pos` (cos/sin rounded to dt, as `InterleavedRope.cos_sin` gives them), stored at
    `dst`: as dt values, or (DS_NOPE > 0) as the `Fp8DsMlaCodec` row of DS_NOPE FP8 values per DS_TILE scale."""
    y_e, y_o = _rms_norm(x_e, x_o, i, w_ptr, eps, dt, D)
    r_e, r_o = _rope(y_e, y_o, i, inv_freq_ptr, pos, rope_scale, dt, dt, HALF, ROPE_HALF)
    if DS_NOPE > 0:
        ds_mla_store(dst, r_e, r_o, D, DS_NOPE, DS_TILE)
    else:
        tl.store(dst + 2 * i, r_e.to(dt))
        tl.store(dst + 2 * i + 1, r_o.to(dt))


@triton.jit
def _own_or_ring(ring, new_rows, t, p, back, q, R, stride_rr, stride_nt):
    """The row of position q (at most p): this step's own rows (positions p - back .. p, rows t - back .. t) from
    `new_rows`, where the launch also writes them into the ring; older ones from the ring (row q % R)."""
    return tl.where(q >= p - back, new_rows + (t - (p - q)) * stride_nt, ring + ((q + R) % R) * stride_rr)


@triton.jit
def _entry_row(cache_ptr, tables_ptr, b, stride_tb, entry, epb, ROW: tl.constexpr):
    """Where sequence b's entry `entry` lives in a paged cache of ROW-element rows (`model.entry_index`)."""
    page = tl.load(tables_ptr + b * stride_tb + entry // epb).to(tl.int64)
    return cache_ptr + (page * epb + entry % epb) * ROW


@triton.jit
def _online_merge(pm, ps, pa, g, kv, fresh):
    """`RunningCompressor._merge` of a running state (pm, ps, pa) with one row (max gate g, sum 1, sum kv); a fresh
    window is the row itself."""
    m = tl.maximum(pm, g)
    safe = tl.where(tl.abs(m) == float("inf"), 0.0, m)
    wa = tl.exp(pm - safe)
    wb = tl.exp(g - safe)
    return (tl.where(fresh, g, m), tl.where(fresh, 1.0, ps * wa + wb), tl.where(fresh, kv, pa * wa + kv * wb))


@triton.jit(do_not_specialize=["stride_tb"])
def _hca_decode_kernel(state_ptr, cache_ptr, rows_ptr, pos_ptr, slot_ptr, tables_ptr, w_ptr, inv_freq_ptr, eps,
                       rope_scale, ratio, L, epb, stride_ss, stride_sl, stride_sk, stride_rt, stride_tb,
                       D: tl.constexpr, HALF: tl.constexpr, ROPE_HALF: tl.constexpr, ROW: tl.constexpr,
                       DT: tl.constexpr, DS_NOPE: tl.constexpr, DS_TILE: tl.constexpr):
    t = tl.program_id(0)
    p = tl.load(pos_ptr + t).to(tl.int64)
    i = tl.arange(0, HALF)
    row = rows_ptr + t * stride_rt                                      # [kv (D) | gate + position bias (D)]
    st = state_ptr + tl.load(slot_ptr + t).to(tl.int64) * stride_ss     # [L, 3, D]: max gate, sum exp, sum exp * kv
    fresh = p % ratio == 0
    keep = i < tl.where(p % ratio != 0, HALF, 0)                        # the window opened before p
    prev = st + ((p - 1 + L) % L) * stride_sl
    m_e, s_e, a_e = _online_merge(tl.load(prev + 2 * i, mask=keep, other=float("-inf")),
                                  tl.load(prev + stride_sk + 2 * i, mask=keep, other=0.0),
                                  tl.load(prev + 2 * stride_sk + 2 * i, mask=keep, other=0.0),
                                  tl.load(row + D + 2 * i), tl.load(row + 2 * i), fresh)
    m_o, s_o, a_o = _online_merge(tl.load(prev + 2 * i + 1, mask=keep, other=float("-inf")),
                                  tl.load(prev + stride_sk + 2 * i + 1, mask=keep, other=0.0),
                                  tl.load(prev + 2 * stride_sk + 2 * i + 1, mask=keep, other=0.0),
                                  tl.load(row + D + 2 * i + 1), tl.load(row + 2 * i + 1), fresh)
    if (p + 1) % ratio == 0:
        window = (p + 1) // ratio - 1
        _entry_store(round_to(tl.div_rn(a_e, s_e), DT), round_to(tl.div_rn(a_o, s_o), DT), i,
                     _entry_row(cache_ptr, tables_ptr, t, stride_tb, window, epb, ROW), w_ptr, inv_freq_ptr, eps,
                     window * ratio, rope_scale, DT, D, HALF, ROPE_HALF, DS_NOPE, DS_TILE)
    # written last, after every thread's loads: with one state row (L = 1) it is the row read above
    tl.debug_barrier()
    cur = st + (p % L) * stride_sl
    tl.store(cur + 2 * i, m_e)
    tl.store(cur + 2 * i + 1, m_o)
    tl.store(cur + stride_sk + 2 * i, s_e)
    tl.store(cur + stride_sk + 2 * i + 1, s_o)
    tl.store(cur + 2 * stride_sk + 2 * i, a_e)
    tl.store(cur + 2 * stride_sk + 2 * i + 1, a_o)


@triton.jit
def _window_slot(ring, new_rows, t, p, back, window, j, ratio, R, stride_rr, stride_nt, i, D: tl.constexpr,
                 HALF: tl.constexpr):
    """Slot j of window `window`'s 2 * ratio pooled slots: (the row of its position q, where in that row its kv
    series starts, the channels' load mask). j < ratio: position (window - 1) * ratio + j, the previous window's
    first series (none for window 0); else window * ratio + j - ratio, the second series (`_own_or_ring`)."""
    row = _own_or_ring(ring, new_rows, t, p, back, (window - 1) * ratio + j, R, stride_rr, stride_nt)
    return row, (j >= ratio) * D, i < tl.where((j >= ratio) | (window > 0), HALF, 0)


@triton.jit(do_not_specialize=["stride_tb"])
def _csa_decode_kernel(ring_ptr, cache_ptr, rows_ptr, pos_ptr, slot_ptr, tables_ptr, off_ptr, w_ptr, inv_freq_ptr,
                       eps, rope_scale, ratio, R, epb, stride_rs, stride_rr, stride_nt, stride_tb,
                       D: tl.constexpr, HALF: tl.constexpr, ROPE_HALF: tl.constexpr, HAS_OFFSETS: tl.constexpr,
                       ROW: tl.constexpr, DT: tl.constexpr, DS_NOPE: tl.constexpr, DS_TILE: tl.constexpr):
    t = tl.program_id(0)
    p = tl.load(pos_ptr + t).to(tl.int64)
    ring = ring_ptr + tl.load(slot_ptr + t).to(tl.int64) * stride_rs     # [R, 4D]: [kv (2D) | gate (2D)]
    c4 = tl.arange(0, 4 * D)
    tl.store(ring + (p % R) * stride_rr + c4, tl.load(rows_ptr + t * stride_nt + c4))
    if (p + 1) % ratio == 0:
        back = 0
        if HAS_OFFSETS:
            back = tl.load(off_ptr + t)
        window = (p + 1) // ratio - 1
        i = tl.arange(0, HALF)
        # a softmax over the 2 * ratio slots per channel (max, then sum, then the weighted kv: the reference's
        # order), the gate of slot j at 2D past its kv series
        max_e = tl.full((HALF,), float("-inf"), tl.float32)
        max_o = tl.full((HALF,), float("-inf"), tl.float32)
        for j in range(0, 2 * ratio):
            row, col, on = _window_slot(ring, rows_ptr, t, p, back, window, j, ratio, R, stride_rr, stride_nt, i, D,
                                        HALF)
            max_e = tl.maximum(max_e, tl.load(row + 2 * D + col + 2 * i, mask=on, other=float("-inf")))
            max_o = tl.maximum(max_o, tl.load(row + 2 * D + col + 2 * i + 1, mask=on, other=float("-inf")))
        sum_e = tl.zeros((HALF,), tl.float32)
        sum_o = tl.zeros((HALF,), tl.float32)
        for j in range(0, 2 * ratio):
            row, col, on = _window_slot(ring, rows_ptr, t, p, back, window, j, ratio, R, stride_rr, stride_nt, i, D,
                                        HALF)
            sum_e += tl.exp(tl.load(row + 2 * D + col + 2 * i, mask=on, other=float("-inf")) - max_e)
            sum_o += tl.exp(tl.load(row + 2 * D + col + 2 * i + 1, mask=on, other=float("-inf")) - max_o)
        dt = DT
        acc_e = tl.zeros((HALF,), tl.float32)
        acc_o = tl.zeros((HALF,), tl.float32)
        # kv, probabilities and their products in the cache dtype (a product of two rounded values is exact in
        # float32, so rounding it is the dt multiply), summed in float32
        for j in range(0, 2 * ratio):
            row, col, on = _window_slot(ring, rows_ptr, t, p, back, window, j, ratio, R, stride_rr, stride_nt, i, D,
                                        HALF)
            pr_e = tl.div_rn(tl.exp(tl.load(row + 2 * D + col + 2 * i, mask=on, other=float("-inf")) - max_e), sum_e)
            pr_o = tl.div_rn(tl.exp(tl.load(row + 2 * D + col + 2 * i + 1, mask=on, other=float("-inf")) - max_o),
                             sum_o)
            kv_e = round_to(tl.load(row + col + 2 * i, mask=on, other=0.0), dt)
            kv_o = round_to(tl.load(row + col + 2 * i + 1, mask=on, other=0.0), dt)
            acc_e += round_to(kv_e * round_to(pr_e, dt), dt)
            acc_o += round_to(kv_o * round_to(pr_o, dt), dt)
        _entry_store(round_to(acc_e, dt), round_to(acc_o, dt), i,
                     _entry_row(cache_ptr, tables_ptr, t, stride_tb, window, epb, ROW), w_ptr, inv_freq_ptr, eps,
                     window * ratio, rope_scale, dt, D, HALF, ROPE_HALF, DS_NOPE, DS_TILE)


_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def _entry_format(cache: torch.Tensor, D: int, codec, dtype) -> dict:
    """The kernels' entry constexprs: the stored row width, the entries' dtype (the cache's, or `dtype` for `codec`
    rows) and the `Fp8DsMlaCodec` NoPE width and tile (0: plain rows); checks the cache rows hold them."""
    if codec is None:
        return dict(ROW=D, DT=_DTYPES[cache.dtype], DS_NOPE=0, DS_TILE=1)
    if (not isinstance(codec, Fp8DsMlaCodec) or cache.dtype != torch.uint8 or dtype not in _DTYPES
            or (D - codec.rope_dim) % codec.tile or codec.rope_dim % codec.tile or codec.tile % 2):
        raise ValueError(f"the fused compressor writes Fp8DsMlaCodec rows with whole tiles of RoPE channels into a "
                         f"uint8 cache, entries in float32/bf16/fp16 (got {codec!r}, a {cache.dtype} cache, {dtype})")
    return dict(ROW=codec.stored_dim(D), DT=_DTYPES[dtype], DS_NOPE=D - codec.rope_dim, DS_TILE=codec.tile)


def _check(cache: torch.Tensor, rows: torch.Tensor, state: torch.Tensor, inv_freq: torch.Tensor, row_width: int,
           state_row: tuple, D: int, fmt: dict) -> None:
    """What the kernels assume: a power-of-two entry dim, a contiguous paged cache of its rows, float32 rows and state
    with contiguous channels, at most dim/2 RoPE pairs."""
    if (D & (D - 1) or D < 4 or not cache.is_contiguous() or cache.shape[-1] != fmt["ROW"]
            or inv_freq.numel() > D // 2
            or rows.dtype != torch.float32 or rows.stride(-1) != 1 or rows.shape[-1] != row_width * D
            or state.dtype != torch.float32 or state.stride(-1) != 1 or tuple(state.shape[2:]) != state_row):
        raise ValueError(f"the fused compressor needs a power-of-two entry dim (got {D}), a contiguous cache of "
                         f"{fmt['ROW']}-wide rows, float32 rows [T, {row_width} * dim] and state rows {state_row} with "
                         "contiguous channels, and at most dim/2 RoPE pairs")


def v4_hca_decode(state, cache, rows, positions, slots, tables, norm_weight, eps, inv_freq, rope_scale, ratio,
                  codec=None, dtype=None):
    """`RunningCompressor.close_decode` for plain decode rows in one launch: state [S, L, 3, D] float32 (the running
    state after position p at row p % L), cache [blocks, entries_per_block, D], rows [T, 2D] float32 (kv | gate),
    positions/slots [T], tables [T, W]; kv_norm's weight [D] and eps, the compress RoPE's inv_freq [rd/2] and scale,
    the window size `ratio`. `codec` (an `Fp8DsMlaCodec`): the cache holds its rows [..., stored_dim(D)], the entries
    made in `dtype` and encoded in the kernel."""
    T, D = rows.shape[0], norm_weight.numel()
    fmt = _entry_format(cache, D, codec, dtype)
    _check(cache, rows, state, inv_freq, 2, (3, D), D, fmt)
    if T:
        _hca_decode_kernel[(T,)](state, cache, rows, positions, slots, tables, norm_weight, inv_freq, eps, rope_scale,
                                 ratio, state.shape[1], cache.shape[1], state.stride(0), state.stride(1),
                                 state.stride(2), rows.stride(0), tables.stride(0), D=D, HALF=D // 2,
                                 ROPE_HALF=inv_freq.numel(), **fmt)


def v4_csa_decode(ring, cache, rows, positions, slots, tables, offsets, norm_weight, eps, inv_freq, rope_scale, ratio,
                  codec=None, dtype=None):
    """`OverlappingCompressor.close_decode` in one launch: ring [S, R, 4D] float32 (row p % R: position p's
    [kv | gate]), cache [blocks, entries_per_block, D], rows [T, 4D] float32, positions/slots [T], tables [T, W];
    `offsets` [T] (a verify step: row t's place among its request's rows this step, which are consecutive) or None;
    kv_norm's weight [D] and eps, the compress RoPE's inv_freq [rd/2] and scale, the window size `ratio`; `codec`,
    `dtype` as `v4_hca_decode`'s."""
    T, D = rows.shape[0], norm_weight.numel()
    fmt = _entry_format(cache, D, codec, dtype)
    _check(cache, rows, ring, inv_freq, 4, (4 * D,), D, fmt)
    if T:
        _csa_decode_kernel[(T,)](ring, cache, rows, positions, slots, tables, positions if offsets is None else offsets,
                                 norm_weight, inv_freq, eps, rope_scale, ratio, ring.shape[1], cache.shape[1],
                                 ring.stride(0), ring.stride(1), rows.stride(0), tables.stride(0), D=D, HALF=D // 2,
                                 ROPE_HALF=inv_freq.numel(), HAS_OFFSETS=offsets is not None, **fmt)


# ---- DeepSeek-V4.1: a KV source's groups and its index keys ---------------------------------------------------
@triton.jit
def _store_entry(dst, r_e, r_o, i, dt, D: tl.constexpr, FP4: tl.constexpr, GROUP: tl.constexpr, E4M3: tl.constexpr):
    """An entry row at `dst`: FP4-packed as the cache's codec stores it, or the values in the cache dtype."""
    if FP4:
        fp4_store(dst, r_e, r_o, D, GROUP, E4M3)
    else:
        tl.store(dst + 2 * i, r_e.to(dt))
        tl.store(dst + 2 * i + 1, r_o.to(dt))


@triton.jit(do_not_specialize=["stride_tb"])
def _v41_compress_kernel(ring_ptr, cache_ptr, rows_ptr, lat_ptr, pos_ptr, slot_ptr, tables_ptr, off_ptr, w_ptr,
                         inv_freq_ptr, eps, rope_scale, ratio, R, epb, stride_rs, stride_rr, stride_nt, stride_lt,
                         stride_tb, D: tl.constexpr, HALF: tl.constexpr, ROPE_HALF: tl.constexpr, ROW: tl.constexpr,
                         POOL: tl.constexpr, HAS_OFFSETS: tl.constexpr, FP4: tl.constexpr):
    t = tl.program_id(0)
    p = tl.load(pos_ptr + t).to(tl.int64)
    i = tl.arange(0, HALF)
    dt = lat_ptr.dtype.element_ty
    lat = lat_ptr + t * stride_lt
    if POOL:        # ratio > 1: the row joins its group's ring [R, 2D] (kv | score); a closing row pools the group
        ring = ring_ptr + tl.load(slot_ptr + t).to(tl.int64) * stride_rs
        c2 = tl.arange(0, 2 * D)
        tl.store(ring + (p % R) * stride_rr + c2, tl.load(rows_ptr + t * stride_nt + c2))
        if (p + 1) % ratio != 0:
            tl.store(lat + 2 * i, tl.zeros((HALF,), dt))        # no entry: zeros for the index keys' GEMM
            tl.store(lat + 2 * i + 1, tl.zeros((HALF,), dt))
            return
        back = 0
        if HAS_OFFSETS:
            back = tl.load(off_ptr + t)
        first = p + 1 - ratio
        # a float32 softmax of the scores over the group's rows per channel, then the weighted kv sum
        max_e = tl.full((HALF,), float("-inf"), tl.float32)
        max_o = tl.full((HALF,), float("-inf"), tl.float32)
        for j in range(0, ratio):
            row = _own_or_ring(ring, rows_ptr, t, p, back, first + j, R, stride_rr, stride_nt)
            max_e = tl.maximum(max_e, tl.load(row + D + 2 * i))
            max_o = tl.maximum(max_o, tl.load(row + D + 2 * i + 1))
        sum_e = tl.zeros((HALF,), tl.float32)
        sum_o = tl.zeros((HALF,), tl.float32)
        for j in range(0, ratio):
            row = _own_or_ring(ring, rows_ptr, t, p, back, first + j, R, stride_rr, stride_nt)
            sum_e += tl.exp(tl.load(row + D + 2 * i) - max_e)
            sum_o += tl.exp(tl.load(row + D + 2 * i + 1) - max_o)
        acc_e = tl.zeros((HALF,), tl.float32)
        acc_o = tl.zeros((HALF,), tl.float32)
        for j in range(0, ratio):
            row = _own_or_ring(ring, rows_ptr, t, p, back, first + j, R, stride_rr, stride_nt)
            acc_e += tl.load(row + 2 * i) * tl.div_rn(tl.exp(tl.load(row + D + 2 * i) - max_e), sum_e)
            acc_o += tl.load(row + 2 * i + 1) * tl.div_rn(tl.exp(tl.load(row + D + 2 * i + 1) - max_o), sum_o)
        x_e, x_o = round_to(acc_e, dt), round_to(acc_o, dt)
    else:           # ratio 1: every row is its own entry
        x_e = tl.load(rows_ptr + t * stride_nt + 2 * i).to(tl.float32)
        x_o = tl.load(rows_ptr + t * stride_nt + 2 * i + 1).to(tl.float32)
    y_e, y_o = _rms_norm(x_e, x_o, i, w_ptr, eps, dt, D)
    tl.store(lat + 2 * i, y_e.to(dt))
    tl.store(lat + 2 * i + 1, y_o.to(dt))
    group = (p + 1) // ratio - 1
    r_e, r_o = _rope(y_e, y_o, i, inv_freq_ptr, group * ratio, rope_scale, dt, tl.float32, HALF, ROPE_HALF)
    _store_entry(_entry_row(cache_ptr, tables_ptr, t, stride_tb, group, epb, ROW), r_e, r_o, i,
                 cache_ptr.dtype.element_ty, D, FP4, 16, True)


@triton.jit(do_not_specialize=["stride_tb"])
def _v41_index_keys_kernel(cache_ptr, keys_ptr, pos_ptr, tables_ptr, w_ptr, inv_freq_ptr, eps, rope_scale, ratio, epb,
                           stride_kt, stride_tb, D: tl.constexpr, HALF: tl.constexpr, ROPE_HALF: tl.constexpr,
                           ROW: tl.constexpr, FP4: tl.constexpr):
    t = tl.program_id(0)
    p = tl.load(pos_ptr + t).to(tl.int64)
    if (p + 1) % ratio == 0:
        i = tl.arange(0, HALF)
        dt = keys_ptr.dtype.element_ty
        x_e = tl.load(keys_ptr + t * stride_kt + 2 * i).to(tl.float32)
        x_o = tl.load(keys_ptr + t * stride_kt + 2 * i + 1).to(tl.float32)
        y_e, y_o = _rms_norm(x_e, x_o, i, w_ptr, eps, dt, D)
        group = (p + 1) // ratio - 1
        r_e, r_o = _rope(y_e, y_o, i, inv_freq_ptr, group * ratio, rope_scale, dt, tl.float32, HALF, ROPE_HALF)
        _store_entry(_entry_row(cache_ptr, tables_ptr, t, stride_tb, group, epb, ROW), r_e, r_o, i,
                     cache_ptr.dtype.element_ty, D, FP4, 32, False)


def _v41_layout(cache: torch.Tensor, D: int, group: int, inv_freq: torch.Tensor) -> bool:
    """Whether `cache` holds FP4 rows (uint8: D/2 value bytes + D/group scale bytes) or plain ones; checks what the
    kernels assume."""
    fp4 = cache.dtype == torch.uint8
    row = D // 2 + D // group if fp4 else D
    if D & (D - 1) or D < group or cache.shape[-1] != row or not cache.is_contiguous() or inv_freq.numel() > D // 2:
        raise ValueError(f"the fused V4.1 compressor needs a power-of-two dim of at least {group} (got {D}), "
                         f"contiguous cache rows of {row}, and at most dim/2 RoPE pairs")
    return fp4


def v41_compress_decode(ring, cache, rows, positions, slots, tables, offsets, norm_weight, eps, inv_freq, rope_scale,
                        ratio, dtype) -> torch.Tensor:
    """V4.1's `Compressor.decode` and the entry half of `Attention._close_groups` for decode rows, in one launch:
    rows [T, 2D] float32 (kv | score; ratio 1: [T, D] in the model dtype) join the group ring [S, R, 2D] (ratio >
    1), a row that closes its group pools it, RMS-norms it (the compressor's norm) and writes the entry, roped at
    the group's first position, into `cache` [blocks, entries_per_block, row] (FP4 with E4M3 scales per 16 when
    uint8, as `Fp4BlockCodec(16, "e4m3")`; else plain). Returns the normed latents [T, D] in `dtype` (zeros for rows
    that close nothing), from which the index keys are made. `offsets`: a verify step's rows, as V4's."""
    T, D = rows.shape[0], norm_weight.numel()
    fp4 = _v41_layout(cache, D, 16, inv_freq)
    latents = torch.empty(T, D, dtype=dtype, device=rows.device)
    if T:
        pool = ratio > 1
        _v41_compress_kernel[(T,)](
            ring if pool else rows, cache, rows, latents, positions, slots, tables,
            positions if offsets is None else offsets, norm_weight, inv_freq, eps, rope_scale, ratio,
            ring.shape[1] if pool else 1, cache.shape[1], ring.stride(0) if pool else 0, ring.stride(1) if pool else 0,
            rows.stride(0), latents.stride(0), tables.stride(0), D=D, HALF=D // 2, ROPE_HALF=inv_freq.numel(),
            ROW=cache.shape[-1], POOL=pool, HAS_OFFSETS=offsets is not None, FP4=fp4)
    return latents


def v41_index_keys_decode(cache, keys, positions, tables, norm_weight, eps, inv_freq, rope_scale, ratio) -> None:
    """The index-key half of V4.1's `_close_groups` for decode rows: keys [T, Di] (the latents through `wk`) of rows
    that close their group, RMS-normed (`k_norm`), roped at the group's first position and written into `cache`
    (FP4 with E8M0 scales per 32 when uint8, as `Fp4BlockCodec(32, "e8m0")`; else plain), in one launch."""
    T, D = keys.shape
    fp4 = _v41_layout(cache, D, 32, inv_freq)
    if T:
        _v41_index_keys_kernel[(T,)](cache, keys, positions, tables, norm_weight, inv_freq, eps, rope_scale, ratio,
                                     cache.shape[1], keys.stride(0), tables.stride(0), D=D, HALF=D // 2,
                                     ROPE_HALF=inv_freq.numel(), ROW=cache.shape[-1], FP4=fp4)


# ---- DeepSeek-V4: a compressor's input rows ---------------------------------------------------------------------
@triton.jit
def _v4_rows_kernel(kv_ptr, gate_ptr, bias_ptr, pos_ptr, out_ptr, ratio, W, stride_kt, stride_gt, stride_bt,
                    stride_ot, SUM_DT: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = c < W
    p = tl.load(pos_ptr + t).to(tl.int64)
    bias = bias_ptr + ((p % ratio + ratio) % ratio) * stride_bt
    kv = tl.load(kv_ptr + t.to(tl.int64) * stride_kt + c, mask=m, other=0.0).to(tl.float32)
    gate = tl.load(gate_ptr + t.to(tl.int64) * stride_gt + c, mask=m, other=0.0).to(tl.float32)
    gate = round_to(gate + tl.load(bias + c, mask=m, other=0.0).to(tl.float32), SUM_DT)
    out = out_ptr + t.to(tl.int64) * stride_ot
    tl.store(out + c, kv, mask=m)
    tl.store(out + W + c, gate, mask=m)


def v4_compressor_rows(kv: torch.Tensor, gate: torch.Tensor, position_bias: torch.Tensor, positions: torch.Tensor,
                       ratio: int) -> torch.Tensor:
    """V4's `Compressor.rows` after its two projections, in one launch: kv, gate [T, W] (the projections' outputs),
    position_bias [ratio, W], positions [T] -> float32 [T, 2W] = [kv | gate + position_bias[positions % ratio]], the
    sum rounded to the dtype torch's addition gives (the model dtype, or float32 where either term is float32), as
    `torch.cat((kv.float(), (gate + bias[...]).float()), -1)` (the remainder, gather, add, casts and cat: five
    kernels). Bit-exact: the sum of two values widened to float32 is rounded once, as torch's kernels do."""
    T, W = kv.shape
    if gate.shape != kv.shape or position_bias.shape != (ratio, W) or kv.stride(-1) != 1 or gate.stride(-1) != 1 \
            or not position_bias.is_contiguous():
        raise ValueError(f"compressor rows need kv and gate [T, W] and a contiguous position bias [ratio, W] with unit "
                         f"channel strides (got {tuple(kv.shape)}, {tuple(gate.shape)}, {tuple(position_bias.shape)})")
    out = torch.empty(T, 2 * W, dtype=torch.float32, device=kv.device)
    if T:
        # torch's promotion over these dtypes (computed here: torch.promote_types is a dispatched ATen op)
        sum_dt = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[
            gate.dtype if gate.dtype == position_bias.dtype else torch.float32]
        block = min(triton.next_power_of_2(W), 1024)
        _v4_rows_kernel[(T, triton.cdiv(W, block))](kv, gate, position_bias, positions, out, ratio, W, kv.stride(0),
                                                    gate.stride(0), position_bias.stride(0), out.stride(0),
                                                    SUM_DT=sum_dt, BLOCK=block)
    return out
