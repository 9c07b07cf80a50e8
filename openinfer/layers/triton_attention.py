"""CUDA attention backend: a Triton paged-decode kernel; prefill chunks run through the reference path.

Decode reads K/V straight from the paged cache (no gather copy): one program per (sequence, KV head, split)
walks its share of the sequence's pages with an online softmax, and the query heads sharing that KV head
ride together as the rows of one tile (GQA without expanding K/V). With few sequences the context is split
across programs (flash-decoding) and a second kernel merges the partial softmaxes. Tested against
`TorchPagedAttention` (tests/test_gpu.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from openinfer.layers.attention import AttentionMetadata, TorchPagedAttention
from openinfer.layers.triton_ops import write_kv as triton_write_kv


@triton.jit
def _paged_decode_kernel(
    q_ptr, cache_ptr, tables_ptr, lens_ptr, out_ptr, part_acc_ptr, part_ml_ptr,
    scale,
    stride_qb, stride_qh,
    stride_cblock, stride_cpos, stride_ckv, stride_ch,
    stride_tb,
    stride_ob, stride_oh,
    H: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    ctx_len = tl.load(lens_ptr + b)
    # this program's share of the context (flash-decoding split when few sequences would leave SMs idle)
    chunk = tl.cdiv(tl.cdiv(ctx_len, SPLITS), BLOCK_N) * BLOCK_N
    lo = split * chunk
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
        page = tl.load(tables_ptr + b * stride_tb + pos // PAGE, mask=valid, other=0)
        base = page.to(tl.int64) * stride_cblock + (pos % PAGE) * stride_cpos + kvh * stride_ch
        k = tl.load(cache_ptr + base[:, None] + d[None, :], mask=valid[:, None], other=0.0)
        v = tl.load(cache_ptr + base[:, None] + stride_ckv + d[None, :], mask=valid[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k)) * scale
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
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
    """Enough programs to cover the SMs about twice; 1 when the batch already does."""
    idx = device.index or 0
    if idx not in _NUM_SMS:
        _NUM_SMS[idx] = torch.cuda.get_device_properties(device).multi_processor_count
    want = 2 * _NUM_SMS[idx] // max(1, batch * kv_heads)
    return 1 if want < 2 else min(16, triton.next_power_of_2(want))


def paged_decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, scale: float, out: torch.Tensor,
                           num_splits: int | None = None) -> torch.Tensor:
    """q [B, H, D] (one token per sequence); kv_cache [blocks, page, 2, KVH, D]; block_tables [B, max_blocks];
    context_lens [B] (>= 1). Writes and returns out [B, H, D]."""
    B, H, D = q.shape
    _, page, _, kvh, _ = kv_cache.shape
    group = H // kvh
    block_n = min(64, page) if D >= 128 else min(128, page)
    splits = num_splits or _num_splits(B, kvh, q.device)
    assert splits & (splits - 1) == 0, "num_splits must be a power of two"
    if splits > 1:
        part_acc = torch.empty(B * H * splits, D, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(B * H * splits, 2, dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out
    _paged_decode_kernel[(B, kvh, splits)](
        q, kv_cache, block_tables, context_lens, out, part_acc, part_ml, scale,
        q.stride(0), q.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        H=H, GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=D, PAGE=page,
        BLOCK_N=block_n, SPLITS=splits, num_warps=4, num_stages=2,
    )
    if splits > 1:
        _merge_splits_kernel[(B, H)](part_acc, part_ml, out, out.stride(0), out.stride(1), H=H, HEAD_DIM=D,
                                     SPLITS=splits)
    return out


class TritonPagedAttention(TorchPagedAttention):
    """KV write and decode rows through Triton kernels; prefill chunks through the reference (SDPA) path.
    No sliding windows yet (the decode kernel has no window bound): models with window layers refuse this
    backend at build time and name attention_backend='torch' instead."""

    supports_window = False

    def write(self, kv_cache, slot_mapping, k, v):
        triton_write_kv(kv_cache, slot_mapping, k, v)

    def decode_into(self, q, kv_cache, meta: AttentionMetadata, scale, out):
        nd = meta.num_decode_tokens
        paged_decode_attention(q[:nd], kv_cache, meta.decode_block_tables, meta.decode_context_lens, scale, out[:nd])
