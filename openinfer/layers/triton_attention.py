"""CUDA attention backend: Triton kernels that read K/V straight from the paged cache (no gather copy).

- Decode rows: one program per (sequence, KV head, split) walks its share of the sequence's pages with an
  online softmax; the query heads sharing that KV head ride together as the rows of one tile (GQA without
  expanding K/V). With few sequences the context is split across programs (flash-decoding) and a second
  kernel merges the partial softmaxes.
- Prefill chunks (varlen): one launch per layer for every chunk of the step. A program owns BLOCK_M new
  tokens of one chunk and one query head, and walks that chunk's pages up to its last query's position:
  blocks wholly before the tile's first query need no mask, only the diagonal blocks (and, with a sliding
  window, the blocks at the window's edge) are masked. A prefix-cache hit is just a context longer than the
  chunk: nothing is gathered into contiguous tensors first.
- Sliding windows (a query at p sees keys p-W < j <= p, as `TorchPagedAttention`) and the FP8 KV cache (e4m3
  entries with one float32 scale per token, K/V and head: `quantization.kv_formats.fp8_kv_quantize`) in both
  kernels: the scales multiply the scores and the probabilities, so no dequantized copy is made.

Every kernel is tested against `TorchPagedAttention` (tests/test_paged_prefill.py runs them in Triton's
interpreter on the CPU; tests/test_gpu.py on the GPU).
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

from openinfer.device_io import h2d
from openinfer.layers.attention import AttentionMetadata, TorchPagedAttention
from openinfer.layers.triton_ops import rotary_write_kv as triton_rotary_write_kv
from openinfer.layers.triton_ops import write_kv as triton_write_kv
from openinfer.layers.triton_ops import write_kv_fp8 as triton_write_kv_fp8

_LOG2E = 1.4426950408889634


# the table stride is the step's widest table (1 for short contexts): not specialized on, so a step's
# context lengths do not make a new kernel variant under traffic (engine/compile_watch.py)
@triton.jit(do_not_specialize=["stride_tb"])
def _paged_decode_kernel(
    q_ptr, cache_ptr, scale_ptr, tables_ptr, lens_ptr, out_ptr, part_acc_ptr, part_ml_ptr,
    sm_scale, window,
    stride_qb, stride_qh,
    stride_cblock, stride_cpos, stride_ckv, stride_ch,
    stride_sblock, stride_spos, stride_skv, stride_sh,
    stride_tb,
    stride_ob, stride_oh,
    H: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, WINDOWED: tl.constexpr, FP8: tl.constexpr,
    PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    ctx_len = tl.load(lens_ptr + b)
    first = 0
    if WINDOWED:
        first = tl.maximum(ctx_len - window, 0)
    # this program's share of the context (flash-decoding split when few sequences would leave SMs idle)
    chunk = tl.cdiv(tl.cdiv(ctx_len - first, SPLITS), BLOCK_N) * BLOCK_N
    lo = first + split * chunk
    hi = tl.minimum(lo + chunk, ctx_len)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM)
    g_mask = g < GROUP
    heads = kvh * GROUP + g
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=g_mask[:, None], other=0.0)
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    n = tl.arange(0, BLOCK_N)
    for start in range(lo, hi, BLOCK_N):
        pos = start + n
        valid = pos < hi
        page = tl.load(tables_ptr + b * stride_tb + pos // PAGE, mask=valid, other=0).to(tl.int64)
        base = page * stride_cblock + (pos % PAGE) * stride_cpos + kvh * stride_ch
        k = tl.load(cache_ptr + base[:, None] + d[None, :], mask=valid[:, None], other=0.0)
        v = tl.load(cache_ptr + base[:, None] + stride_ckv + d[None, :], mask=valid[:, None], other=0.0)
        if FP8:
            k, v = k.to(q.dtype), v.to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * sm_scale
        if FP8:
            sbase = page * stride_sblock + (pos % PAGE) * stride_spos + kvh * stride_sh
            s = s * tl.load(scale_ptr + sbase, mask=valid, other=0.0)[None, :]
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if FP8:
            p = p * tl.load(scale_ptr + sbase + stride_skv, mask=valid, other=0.0)[None, :]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    if SPLITS == 1:
        out = acc / l_i[:, None]
        tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None])
    else:
        row = (b * H + heads) * SPLITS + split                   # partials laid out [B, H, SPLITS, ...]
        tl.store(part_acc_ptr + row[:, None] * HEAD_DIM + d[None, :], acc, mask=g_mask[:, None])
        tl.store(part_ml_ptr + row * 2, m_i, mask=g_mask)
        tl.store(part_ml_ptr + row * 2 + 1, l_i, mask=g_mask)


@triton.jit
def _merge_splits_kernel(part_acc_ptr, part_ml_ptr, out_ptr, stride_ob, stride_oh,
                         H: tl.constexpr, HEAD_DIM: tl.constexpr, SPLITS: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    sp = tl.arange(0, SPLITS)
    d = tl.arange(0, HEAD_DIM)
    rows = (b * H + h) * SPLITS + sp
    m = tl.load(part_ml_ptr + rows * 2)
    l = tl.load(part_ml_ptr + rows * 2 + 1)
    m_max = tl.max(m, 0)
    w = tl.where(m > float("-inf"), tl.exp(m - m_max), 0.0)
    acc = tl.load(part_acc_ptr + rows[:, None] * HEAD_DIM + d[None, :])
    out = tl.sum(acc * w[:, None], 0) / tl.sum(l * w, 0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d, out.to(out_ptr.dtype.element_ty))


_NUM_SMS: dict[int, int] = {}


def _num_splits(batch: int, kv_heads: int, device: torch.device) -> int:
    """Enough programs to cover the SMs about twice; 1 when the batch already does (Triton's CPU interpreter:
    as for a GPU of 8 SMs, so tests there exercise the split path)."""
    if device.type != "cuda":
        sms = 8
    else:
        idx = device.index or 0
        if idx not in _NUM_SMS:
            _NUM_SMS[idx] = torch.cuda.get_device_properties(device).multi_processor_count
        sms = _NUM_SMS[idx]
    want = 2 * sms // max(1, batch * kv_heads)
    return 1 if want < 2 else min(16, triton.next_power_of_2(want))


def _dot_precision(dtype: torch.dtype) -> str:
    """fp32 models attend in true fp32 (the reference's numbers); bf16/fp16 in the tensor cores' own format."""
    return "ieee" if dtype == torch.float32 else "tf32"


def _check_head_dim(d: int) -> None:
    if d & (d - 1) or d < 16:
        raise ValueError(f"the Triton attention kernels need a power-of-two head_dim >= 16, got {d}; "
                         f"use attention_backend='torch'")


def _scale_args(kv_scale: torch.Tensor | None, kv_cache: torch.Tensor) -> tuple:
    """(scale tensor, its four strides) for the kernels; the cache itself stands in when there are no scales."""
    if kv_scale is None:
        return (kv_cache, 0, 0, 0, 0)
    return (kv_scale, *kv_scale.stride())


def _decode_launch(head_dim: int, splits: int, fp8: bool) -> dict:
    """Key block and launch shape, from a sweep on the H200 (Llama-3-8B attention shape, 2026-11-30): with one
    program per (sequence, KV head) long key blocks stream best (b=256, 1K context: 308 us bf16 vs 360 us with
    64-key blocks; FP8 289 vs 452 us); with a flash-decoding split each program's share is short and 64-key
    blocks with 8 warps win (b=1, 8K context: 72 vs 95 us). Key blocks may span pages: each row finds its
    own page."""
    if head_dim < 128:
        return {"BLOCK_N": 128, "num_warps": 4, "num_stages": 2}
    if splits == 1:
        return {"BLOCK_N": 128, "num_warps": 4 if fp8 else 8, "num_stages": 2}
    return {"BLOCK_N": 64, "num_warps": 8, "num_stages": 3 if fp8 else 2}


def paged_decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, scale: float, out: torch.Tensor,
                           num_splits: int | None = None, window: int | None = None,
                           kv_scale: torch.Tensor | None = None, tuning: dict | None = None) -> torch.Tensor:
    """q [B, H, D] (one token per sequence); kv_cache [blocks, page, 2, KVH, D]; block_tables [B, max_blocks];
    context_lens [B] (>= 1); `window`: sliding window (each row attends to its last `window` positions);
    kv_scale [blocks, page, 2, KVH] float32 for an FP8 cache. Writes and returns out [B, H, D]."""
    B, H, D = q.shape
    _, page, _, kvh, _ = kv_cache.shape
    _check_head_dim(D)
    group = H // kvh
    splits = num_splits or _num_splits(B, kvh, q.device)
    assert splits & (splits - 1) == 0, "num_splits must be a power of two"
    launch = {**_decode_launch(D, splits, kv_scale is not None), **(tuning or {})}   # tuning: benchmarks
    if splits > 1:
        part_acc = torch.empty(B * H * splits, D, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(B * H * splits, 2, dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out
    sargs = _scale_args(kv_scale, kv_cache)
    _paged_decode_kernel[(B, kvh, splits)](
        q, kv_cache, sargs[0], block_tables, context_lens, out, part_acc, part_ml,
        scale, window or 0,
        q.stride(0), q.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        *sargs[1:],
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        H=H, GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=D, PAGE=page,
        SPLITS=splits, WINDOWED=window is not None, FP8=kv_scale is not None, PRECISION=_dot_precision(q.dtype),
        **launch,
    )
    if splits > 1:
        _merge_splits_kernel[(B, H)](part_acc, part_ml, out, out.stride(0), out.stride(1), H=H, HEAD_DIM=D,
                                     SPLITS=splits)
    return out


@triton.jit
def _attend_block(q, acc, m_i, l_i, start, end, tables_row, cache_ptr, scale_ptr, q_pos, window, qk_scale,
                  stride_cblock, stride_cpos, stride_ckv, kv_off, stride_sblock, stride_spos, stride_skv, s_off,
                  d, n, PAGE: tl.constexpr, MASKED: tl.constexpr, WINDOWED: tl.constexpr, FP8: tl.constexpr,
                  PRECISION: tl.constexpr):
    """Keys [start, start + BLOCK_N) (only those before `end` exist) into the online softmax, scores in log2
    units. Unmasked blocks lie wholly inside every query's causal (and window) range."""
    pos = start + n
    if MASKED:
        exists = pos < end
        page = tl.load(tables_row + pos // PAGE, mask=exists, other=0).to(tl.int64)
    else:
        page = tl.load(tables_row + pos // PAGE).to(tl.int64)
    base = page * stride_cblock + (pos % PAGE) * stride_cpos + kv_off
    if MASKED:
        k = tl.load(cache_ptr + base[:, None] + d[None, :], mask=exists[:, None], other=0.0)
    else:
        k = tl.load(cache_ptr + base[:, None] + d[None, :])
    if FP8:
        k = k.to(q.dtype)
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
    if FP8:
        sbase = page * stride_sblock + (pos % PAGE) * stride_spos + s_off
        s = s * tl.load(scale_ptr + sbase)[None, :]
    if MASKED:
        visible = pos[None, :] <= q_pos[:, None]
        if WINDOWED:
            visible = visible & (pos[None, :] > q_pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if MASKED:   # a row that has seen no key yet keeps m = -inf; exponents against 0 then give exact zeros
        m_use = tl.where(m_new > float("-inf"), m_new, 0.0)
    else:
        m_use = m_new
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if MASKED:
        v = tl.load(cache_ptr + base[:, None] + stride_ckv + d[None, :], mask=exists[:, None], other=0.0)
    else:
        v = tl.load(cache_ptr + base[:, None] + stride_ckv + d[None, :])
    if FP8:
        v = v.to(q.dtype)
        p = p * tl.load(scale_ptr + sbase + stride_skv)[None, :]
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return acc, m_new, l_i


# the table stride is the step's widest table (1 for short contexts): not specialized on, so a step's
# context lengths do not make a new kernel variant under traffic (engine/compile_watch.py)
@triton.jit(do_not_specialize=["stride_tb"])
def _paged_prefill_kernel(
    q_ptr, cache_ptr, scale_ptr, tables_ptr, chunk_info_ptr, tile_info_ptr, out_ptr, part_acc_ptr, part_ml_ptr,
    qk_scale, window,
    stride_qt, stride_qh,
    stride_cblock, stride_cpos, stride_ckv, stride_ch,
    stride_sblock, stride_spos, stride_skv, stride_sh,
    stride_tb,
    stride_ot, stride_oh,
    H: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, WINDOWED: tl.constexpr, FP8: tl.constexpr,
    PRECISION: tl.constexpr, ALL_MASKED: tl.constexpr = False,
):
    tile = tl.program_id(0)
    h = tl.program_id(1)
    split = tl.program_id(2)
    chunk = tl.load(tile_info_ptr + 2 * tile)
    m0 = tl.load(tile_info_ptr + 2 * tile + 1)             # first new token of the tile, within its chunk
    q_start = tl.load(chunk_info_ptr + 3 * chunk)
    q_len = tl.load(chunk_info_ptr + 3 * chunk + 1)
    ctx_len = tl.load(chunk_info_ptr + 3 * chunk + 2)
    kvh = h // GROUP
    rows = m0 + tl.arange(0, BLOCK_M)
    row_ok = rows < q_len
    q_pos = ctx_len - q_len + rows                          # absolute positions of the tile's queries
    d = tl.arange(0, HEAD_DIM)
    n = tl.arange(0, BLOCK_N)
    q = tl.load(q_ptr + (q_start + rows).to(tl.int64)[:, None] * stride_qt + h * stride_qh + d[None, :],
                mask=row_ok[:, None], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    tables_row = tables_ptr + chunk.to(tl.int64) * stride_tb
    first_q = ctx_len - q_len + m0
    last_q = ctx_len - q_len + tl.minimum(m0 + BLOCK_M, q_len) - 1
    kv_off = kvh * stride_ch
    s_off = kvh * stride_sh
    # the keys this program reads: with SPLITS > 1 (few tiles over long contexts) the tile's key blocks are
    # shared out among programs, flash-decoding style, and a second kernel merges their partial softmaxes
    lo = 0
    if WINDOWED:
        lo = tl.maximum(first_q - window + 1, 0) // BLOCK_N * BLOCK_N
    per = tl.cdiv(tl.cdiv(last_q + 1 - lo, BLOCK_N), SPLITS) * BLOCK_N
    ks = lo + split * per
    ke = tl.minimum(ks + per, last_q + 1)
    if WINDOWED:
        # keys (first_q - window, last_q]: all masked (the window's edge moves with the query), few blocks
        for start in range(ks, ke, BLOCK_N):
            acc, m_i, l_i = _attend_block(
                q, acc, m_i, l_i, start, last_q + 1, tables_row, cache_ptr, scale_ptr, q_pos, window, qk_scale,
                stride_cblock, stride_cpos, stride_ckv, kv_off, stride_sblock, stride_spos, stride_skv, s_off, d, n,
                PAGE, True, True, FP8, PRECISION)
    else:
        # keys every query of the tile sees, then the diagonal blocks
        full_hi = (first_q + 1) // BLOCK_N * BLOCK_N
        if ALL_MASKED:   # batch-invariant mode: one code path for every block (the compiler may fuse the
            full_hi = ks  # unmasked path's scale and exponent differently), whatever the chunk's start
        for start in range(ks, tl.minimum(full_hi, ke), BLOCK_N):
            acc, m_i, l_i = _attend_block(
                q, acc, m_i, l_i, start, last_q + 1, tables_row, cache_ptr, scale_ptr, q_pos, window, qk_scale,
                stride_cblock, stride_cpos, stride_ckv, kv_off, stride_sblock, stride_spos, stride_skv, s_off, d, n,
                PAGE, False, False, FP8, PRECISION)
        for start in range(tl.maximum(full_hi, ks), ke, BLOCK_N):
            acc, m_i, l_i = _attend_block(
                q, acc, m_i, l_i, start, last_q + 1, tables_row, cache_ptr, scale_ptr, q_pos, window, qk_scale,
                stride_cblock, stride_cpos, stride_ckv, kv_off, stride_sblock, stride_spos, stride_skv, s_off, d, n,
                PAGE, True, False, FP8, PRECISION)
    if SPLITS == 1:
        out = acc / l_i[:, None]
        tl.store(out_ptr + (q_start + rows).to(tl.int64)[:, None] * stride_ot + h * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None])
    else:   # partials laid out [rows of the step, H, SPLITS, ...] as the decode kernel's; m in natural log
        part = ((q_start + rows).to(tl.int64) * H + h) * SPLITS + split
        tl.store(part_acc_ptr + part[:, None] * HEAD_DIM + d[None, :], acc, mask=row_ok[:, None])
        tl.store(part_ml_ptr + part * 2, m_i / 1.4426950408889634, mask=row_ok)
        tl.store(part_ml_ptr + part * 2 + 1, l_i, mask=row_ok)


def _prefill_tiles(head_dim: int, dtype: torch.dtype, page: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages): what fits Hopper's shared memory per head size and dtype.
    A key block may span pages (each key row finds its own page), so any page size works."""
    wide = head_dim * (4 if dtype == torch.float32 else 2)      # bytes per K or V row
    if wide <= 128:
        bm, bn, warps, stages = 128, 64, 4, 3
    elif wide <= 256:
        # H200 sweep (head_dim 128, bf16, 2026-11-30): 128-key blocks, 8 warps, 2 stages: cold 8K chunk
        # 1.41 ms vs 1.85 ms with 64-key blocks / 3 stages; FP8 cache 2.59 vs 3.70 ms
        bm, bn, warps, stages = 128, 128, 8, 2
    else:
        bm, bn, warps, stages = 64, 32, 4, 2
    return bm, bn, warps, stages


def paged_prefill_attention(q: torch.Tensor, kv_cache: torch.Tensor, tables: torch.Tensor,
                            chunk_info: torch.Tensor, tile_info: torch.Tensor, scale: float, out: torch.Tensor,
                            block_m: int, window: int | None = None,
                            kv_scale: torch.Tensor | None = None, tuning: dict | None = None,
                            num_splits: int | None = None, first_row: int = 0,
                            all_masked: bool = False) -> torch.Tensor:
    """Varlen paged prefill. q/out [T, H, D] (rows of the whole step); tables [chunks, max_blocks];
    chunk_info [chunks, 3] int32 (first row in q, new tokens, context length after this step); tile_info
    [tiles, 2] int32 (chunk, first new token of the tile), tiles of `block_m` tokens (see `prefill_tile_plan`).
    Only the rows of the chunks are written. `all_masked`: every key block takes the masked path (batch-invariant
    mode: a row's bits then do not depend on where its chunk starts)."""
    T, H, D = q.shape
    _, page, _, kvh, _ = kv_cache.shape
    _check_head_dim(D)
    assert tile_info.dim() == 2 and tile_info.shape[1] == 2 and chunk_info.shape[1] == 3
    bm, bn, warps, stages = _prefill_tiles(D, q.dtype, page)
    assert block_m == bm, "tile_info was planned for another BLOCK_M"
    launch = {"BLOCK_N": bn, "num_warps": warps, "num_stages": stages, **(tuning or {})}   # tuning: benchmarks
    sargs = _scale_args(kv_scale, kv_cache)
    tiles = tile_info.shape[0]
    splits = num_splits or _num_splits(tiles, H, q.device)
    assert splits & (splits - 1) == 0, "num_splits must be a power of two"
    if splits > 1:
        part_acc = torch.empty(T * H * splits, D, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(T * H * splits, 2, dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out
    _paged_prefill_kernel[(tiles, H, splits)](
        q, kv_cache, sargs[0], tables, chunk_info, tile_info, out, part_acc, part_ml,
        scale * _LOG2E, window or 0,
        q.stride(0), q.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        *sargs[1:],
        tables.stride(0),
        out.stride(0), out.stride(1),
        H=H, GROUP=H // kvh, HEAD_DIM=D, PAGE=page, BLOCK_M=bm, SPLITS=splits, WINDOWED=window is not None,
        FP8=kv_scale is not None, PRECISION=_dot_precision(q.dtype), ALL_MASKED=all_masked, **launch,
    )
    if splits > 1:
        # rows [first, T) are the chunks' (decode rows come first in a step; their partials stay unused)
        _merge_splits_kernel[(T - first_row, H)](part_acc[first_row * H * splits:],
                                                 part_ml[first_row * H * splits:], out[first_row:],
                                                 out.stride(0), out.stride(1), H=H, HEAD_DIM=D, SPLITS=splits)
    return out


def prefill_tile_plan(chunks: list[tuple[int, int, int]], block_m: int) -> tuple[np.ndarray, np.ndarray]:
    """chunk_info [chunks, 3] and tile_info [tiles, 2] (int32) for (first row, new tokens, context length)
    chunks. Tiles are ordered by how many keys they read, most first: the long ones start early and the short
    ones fill the gaps at the end of the launch."""
    chunk_info = np.asarray(chunks, dtype=np.int32).reshape(-1, 3)
    tiles = [(c, m0, ctx - n + min(m0 + block_m, n)) for c, (_, n, ctx) in enumerate(chunks)
             for m0 in range(0, n, block_m)]
    tiles.sort(key=lambda t: -t[2])
    tile_info = np.asarray([t[:2] for t in tiles], dtype=np.int32).reshape(-1, 2)
    return chunk_info, tile_info


class TritonPagedAttention(TorchPagedAttention):
    """KV write, decode rows and prefill chunks through the Triton kernels above; sliding windows and the FP8
    KV cache in all of them."""

    supports_window = True
    supports_fp8_kv = True

    def write(self, kv_cache, slot_mapping, k, v, kv_scale=None):
        if kv_scale is None:
            triton_write_kv(kv_cache, slot_mapping, k, v)
        else:
            triton_write_kv_fp8(kv_cache, kv_scale, slot_mapping, k, v)

    def rotate_and_write(self, kv_cache, slot_mapping, rotary, q, k, v, kv_scale=None):
        """RoPE on q and k and the KV write in one launch (the FP8 cache: the RoPE module, then its write)."""
        rope, positions = rotary
        if kv_scale is not None or q.shape[-1] != rope.head_dim or not (q.stride(-1) == k.stride(-1) == 1):
            return super().rotate_and_write(kv_cache, slot_mapping, rotary, q, k, v, kv_scale)
        triton_rotary_write_kv(kv_cache, slot_mapping, positions, rope.cos, rope.sin, q, k, v)
        return q, k

    def decode_into(self, q, kv_cache, meta: AttentionMetadata, scale, out, window=None, kv_scale=None):
        nd = meta.num_decode_tokens
        paged_decode_attention(q[:nd], kv_cache, meta.decode_block_tables, meta.decode_context_lens, scale,
                               out[:nd], window=window, kv_scale=kv_scale)

    def prefill_into(self, q, kv_cache, meta: AttentionMetadata, scale, out, window=None, kv_scale=None):
        block_m = _prefill_tiles(q.shape[-1], q.dtype, kv_cache.shape[1])[0]
        tables, chunk_info, tile_info = self._prefill_plan(meta, block_m)
        paged_prefill_attention(q, kv_cache, tables, chunk_info, tile_info, scale, out, block_m, window=window,
                                kv_scale=kv_scale, first_row=meta.num_decode_tokens)

    @staticmethod
    def _prefill_plan(meta: AttentionMetadata, block_m: int):
        """The step's prefill chunks as kernel arguments, made once per step (every layer reuses them)."""
        plans = meta.__dict__.setdefault("_prefill_plans", {})
        if block_m not in plans:
            chunks = [(p.query_start, p.query_len, p.context_len) for p in meta.prefills]
            chunk_info, tile_info = prefill_tile_plan(chunks, block_m)
            dev = meta.slot_mapping.device
            both = h2d(torch.from_numpy(np.concatenate([chunk_info.ravel(), tile_info.ravel()])), dev)
            tables = torch.nn.utils.rnn.pad_sequence([p.block_ids for p in meta.prefills], batch_first=True)
            plans[block_m] = (tables, both[:chunk_info.size].view(-1, 3), both[chunk_info.size:].view(-1, 2))
        return plans[block_m]
