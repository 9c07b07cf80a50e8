"""Triton kernels of DeepSeek's lightning indexer for decode rows: the scores of one query per sequence against its
paged index keys (`index_scores`), and their top-k without a sort (`index_topk`). Two launches per indexer layer
replace the gather, the per-head einsum, relu/weights/sum, the mask and the full-row sort of the torch path.

- `index_scores`: one program per (sequence, block of entries) walks the block table to the entries' rows, loads
  each key once (bf16/fp32 rows, or V4.1's FP4 rows decoded in registers) and scores it against every head with one
  tensor-core dot: sum_h w_h * relu(q_h . k) * scale, -inf past the sequence's closed entries.
- `index_topk`: one program per row finds the k-th largest order key (layers/index_topk.py: the float's monotone
  bits; ties go to the earlier entry) by an 8-bit radix select (four histogram passes over the row), then emits the
  entries above it, and the earliest entries equal to it, in position order with running prefix sums.

Both take their sizes as runtime arguments that Triton does not specialize on, so a new context bucket is not a
new kernel variant (engine/compile_watch.py), and neither synchronizes with the host (CUDA-graph capturable). The
torch paths they replace are the references (tests/test_sparse_decode_indexer.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from openinfer.quantization.triton_kv_formats import round_to


@triton.jit
def _order_key(x):
    """float32 -> uint32 of the same order as a stable descending sort compares (layers/index_topk.order_keys
    without the entry bits): -0.0 ties +0.0, every NaN ranks above +inf."""
    x = tl.where(x == 0, 0.0, x)
    x = tl.where(x != x, float("nan"), x)
    bits = x.to(tl.uint32, bitcast=True)
    return tl.where((bits >> 31) != 0, ~bits, bits | 0x80000000)


@triton.jit(do_not_specialize=["n", "k", "stride_s", "stride_o"])
def _index_topk_kernel(scores_ptr, limit_ptr, picks_ptr, valid_ptr, n, k, stride_s, stride_o,
                       HAS_LIMIT: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    src = scores_ptr + row.to(tl.int64) * stride_s
    dst = row.to(tl.int64) * stride_o
    if HAS_LIMIT:
        limit = tl.load(limit_ptr + row)
    if k >= n:                          # every entry: no selection
        for start in range(0, n, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            m = offs < n
            if HAS_LIMIT:
                ok = offs < limit
            else:
                ok = tl.load(src + offs, mask=m, other=0.0) > float("-inf")
            tl.store(picks_ptr + dst + offs, offs.to(tl.int64), mask=m)
            tl.store(valid_ptr + dst + offs, ok.to(tl.int8), mask=m)
        return
    # radix select: the k-th largest key, 8 bits at a time from the top
    bins = tl.arange(0, 256)
    prefix = tl.zeros((), dtype=tl.uint32)
    rem = k                             # how many of the keys matching `prefix` so far are still to take
    for i in tl.static_range(4):
        shift = 24 - 8 * i
        hist = tl.zeros((256,), dtype=tl.int32)
        for start in range(0, n, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            m = offs < n
            key = _order_key(tl.load(src + offs, mask=m, other=0.0))
            if i > 0:
                m = m & ((key >> (shift + 8)) == (prefix >> (shift + 8)))
            hist += tl.histogram(((key >> shift) & 0xFF).to(tl.int32), 256, mask=m)
        # the largest digit with at least `rem` matching keys at or above it
        at_or_above = tl.sum(hist, 0) - tl.cumsum(hist, 0) + hist
        digit = tl.max(tl.where(at_or_above >= rem, bins, 0), 0)
        rem -= tl.sum(tl.where(bins > digit, hist, 0), 0)
        prefix = prefix | (digit.to(tl.uint32) << shift)
    # emit, in position order: keys above the threshold, and the first `rem` keys equal to it
    taken = 0
    ties = 0
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        m = offs < n
        x = tl.load(src + offs, mask=m, other=0.0)
        key = _order_key(x)
        eq = m & (key == prefix)
        take = (m & (key > prefix)) | (eq & (ties + tl.cumsum(eq.to(tl.int32), 0) <= rem))
        pos = taken + tl.cumsum(take.to(tl.int32), 0) - 1
        if HAS_LIMIT:
            ok = offs < limit
        else:
            ok = x > float("-inf")
        tl.store(picks_ptr + dst + pos, offs.to(tl.int64), mask=take)
        tl.store(valid_ptr + dst + pos, ok.to(tl.int8), mask=take)
        taken += tl.sum(take.to(tl.int32), 0)
        ties += tl.sum(eq.to(tl.int32), 0)


def index_topk(scores: torch.Tensor, k: int, limit: torch.Tensor | None = None):
    """`layers/index_topk.torch_index_topk` in one launch: scores [T, N] float32 -> (picks [T, min(k, N)] int64 in
    position order, valid bool); `limit` [T]: valid below it, else valid where the score is above -inf."""
    T, n = scores.shape
    k = min(k, n)
    picks = torch.empty(T, k, dtype=torch.int64, device=scores.device)
    valid = torch.empty(T, k, dtype=torch.bool, device=scores.device)
    if T:
        _index_topk_kernel[(T,)](scores, scores if limit is None else limit, picks, valid.view(torch.int8), n, k,
                                 scores.stride(0), picks.stride(0), HAS_LIMIT=limit is not None, BLOCK=1024,
                                 num_warps=8)
    return picks, valid


@triton.jit
def _e2m1(codes):
    """4-bit E2M1 codes (bit 3 = sign) -> float32, as quantization/kv_formats.py decodes them."""
    c = (codes & 0x7).to(tl.float32)
    mag = tl.where(c < 4, c * 0.5, tl.where(c < 6, c - 2, c * 2 - 8))
    return tl.where((codes & 0x8) != 0, -mag, mag)


# `epb` is not specialized: Triton would otherwise take each key row's start (entry * ROW bytes) to be as aligned
# as the first row of a 16-entry run and load V4.1's 68-byte FP4 rows 16 bytes at a time (a misaligned address on the
# H200); unspecialized, it proves only ROW's own alignment.
@triton.jit(do_not_specialize=["n", "stride_tb", "stride_cb", "stride_ob", "epb"])
def _index_scores_kernel(q_ptr, w_ptr, cache_ptr, tables_ptr, closed_ptr, cand_ptr, out_ptr, n, scale, w_scale,
                         stride_qb, stride_qh, stride_wb, stride_tb, stride_cb, stride_ob, epb, cand_block,
                         H: tl.constexpr, BLOCK_H: tl.constexpr, D: tl.constexpr, ROW: tl.constexpr,
                         BLOCK_N: tl.constexpr, FP4: tl.constexpr, ROUND: tl.constexpr, CANDIDATES: tl.constexpr,
                         PRECISION: tl.constexpr):
    b = tl.program_id(0)
    e = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    closed = tl.load(closed_ptr + b)
    if tl.program_id(1) * BLOCK_N >= closed:          # past this sequence's closed entries (a shorter context)
        tl.store(out_ptr + b * stride_ob + e, tl.full((BLOCK_N,), float("-inf"), tl.float32), mask=e < n)
        return
    ok = (e < closed) & (e < n)
    if CANDIDATES:
        ok = ok & (tl.load(cand_ptr + b * stride_cb + e // cand_block, mask=ok, other=0) != 0)
    page = tl.load(tables_ptr + b * stride_tb + e // epb, mask=ok, other=0)
    row = cache_ptr + (page.to(tl.int64) * epb + e % epb) * ROW
    dt = q_ptr.dtype.element_ty
    if FP4:     # D/2 bytes of two E2M1 codes (the even element low) + one E8M0 scale byte per 32 values
        packed = tl.load(row[:, None] + tl.arange(0, D // 2)[None, :], mask=ok[:, None], other=0)
        vals = tl.reshape(tl.join(_e2m1(packed & 0xF), _e2m1(packed >> 4)), (BLOCK_N, D // 32, 32))
        sb = tl.load(row[:, None] + D // 2 + tl.arange(0, D // 32)[None, :], mask=ok[:, None], other=0)
        s = (sb.to(tl.int32) << 23).to(tl.float32, bitcast=True)
        keys = tl.reshape(vals * s[:, :, None], (BLOCK_N, D)).to(dt)
    else:
        keys = tl.load(row[:, None] + tl.arange(0, D)[None, :], mask=ok[:, None], other=0.0).to(dt)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    d = tl.arange(0, D)
    for h0 in tl.static_range(0, H, BLOCK_H):
        hs = h0 + tl.arange(0, BLOCK_H)
        hm = hs < H
        qh = tl.load(q_ptr + b * stride_qb + hs[:, None] * stride_qh + d[None, :], mask=hm[:, None], other=0.0)
        s = tl.dot(qh, tl.trans(keys), input_precision=PRECISION)              # [BLOCK_H, BLOCK_N] float32
        w = (tl.load(w_ptr + b * stride_wb + hs, mask=hm, other=0.0).to(tl.float32) * w_scale)[:, None]
        if ROUND:       # V4.1: the dot and each weighted head rounded to the model dtype, as its bf16 einsum
            s = round_to(s, dt)
            acc += tl.sum(round_to(tl.maximum(s, 0.0) * scale * w, dt), 0)
        else:
            acc += tl.sum(tl.maximum(s, 0.0) * scale * w, 0)
    if ROUND:
        acc = round_to(acc, dt)
    tl.store(out_ptr + b * stride_ob + e, tl.where(ok, acc, float("-inf")), mask=e < n)


def index_scores(q: torch.Tensor, weights: torch.Tensor, cache: torch.Tensor, tables: torch.Tensor, n: int,
                 num_closed: torch.Tensor, scale: float, *, fp4: bool = False, round_products: bool = False,
                 candidates: torch.Tensor | None = None, candidate_block: int = 1,
                 weight_scale: float = 1.0) -> torch.Tensor:
    """Decode rows' indexer scores [B, n] float32: sum_h w[b, h] * relu(q[b, h] . key_e) * scale, w = the float32
    weights[b, h] * weight_scale (V4's `weights_proj(x).float() * heads ** -0.5`, from the bf16 projection), for entries
    e < num_closed[b] of the paged index cache `cache` [blocks, entries_per_block, row] (entry e of sequence b at
    tables[b, e // entries_per_block]), -inf elsewhere and, with `candidates` [B, ceil(n / candidate_block)] bool,
    outside the candidate blocks. `fp4`: rows are V4.1's FP4 index keys (E2M1 pairs, E8M0 scale per 32), decoded to
    q's dtype; `round_products`: V4.1's roundings (the dot, each weighted head and the sum to q's dtype).
    q [B, H, D] (D a power of two), weights [B, H]."""
    B, H, D = q.shape
    if q.stride(2) != 1 or not cache.is_contiguous():
        raise ValueError("index_scores needs q's rows and the paged cache contiguous")
    out = torch.empty(B, n, dtype=torch.float32, device=q.device)
    if B:
        block_n = 64
        cand = num_closed if candidates is None else candidates.view(torch.int8)
        _index_scores_kernel[(B, triton.cdiv(n, block_n))](
            q, weights, cache, tables, num_closed, cand, out, n, scale, weight_scale, q.stride(0), q.stride(1),
            weights.stride(0),
            tables.stride(0), cand.stride(0) if candidates is not None else 0, out.stride(0), cache.shape[1],
            candidate_block, H=H, BLOCK_H=max(16, min(64, triton.next_power_of_2(H))), D=D, ROW=cache.shape[2],
            BLOCK_N=block_n, FP4=fp4, ROUND=round_products, CANDIDATES=candidates is not None,
            PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=4)
    return out
