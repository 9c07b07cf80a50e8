"""CUDA attention backend: a Triton paged-decode kernel; prefill chunks run through the reference path.

Decode reads K/V straight from the paged cache (no gather copy): one program per (sequence, KV head) walks
the sequence's pages with an online softmax, and the query heads sharing that KV head ride together as the
rows of one tile (GQA without expanding K/V). Tested against `TorchPagedAttention` (tests/test_gpu.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from openinfer.layers.attention import AttentionMetadata, TorchPagedAttention
from openinfer.layers.triton_ops import write_kv as triton_write_kv


@triton.jit
def _paged_decode_kernel(
    q_ptr, cache_ptr, tables_ptr, lens_ptr, out_ptr,
    scale,
    stride_qb, stride_qh,
    stride_cblock, stride_cpos, stride_ckv, stride_ch,
    stride_tb,
    stride_ob, stride_oh,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    ctx_len = tl.load(lens_ptr + b)
    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, HEAD_DIM)
    g_mask = g < GROUP
    heads = kvh * GROUP + g
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=g_mask[:, None], other=0.0)
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    n = tl.arange(0, BLOCK_N)
    for start in range(0, ctx_len, BLOCK_N):
        pos = start + n
        valid = pos < ctx_len
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
    out = acc / l_i[:, None]
    tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + d[None, :], out.to(out_ptr.dtype.element_ty),
             mask=g_mask[:, None])


def paged_decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                           context_lens: torch.Tensor, scale: float, out: torch.Tensor) -> torch.Tensor:
    """q [B, H, D] (one token per sequence); kv_cache [blocks, page, 2, KVH, D]; block_tables [B, max_blocks];
    context_lens [B] (>= 1). Writes and returns out [B, H, D]."""
    B, H, D = q.shape
    _, page, _, kvh, _ = kv_cache.shape
    group = H // kvh
    block_n = min(64, page) if D >= 128 else min(128, page)
    _paged_decode_kernel[(B, kvh)](
        q, kv_cache, block_tables, context_lens, out, scale,
        q.stride(0), q.stride(1),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), HEAD_DIM=D, PAGE=page, BLOCK_N=block_n,
        num_warps=4, num_stages=2,
    )
    return out


class TritonPagedAttention(TorchPagedAttention):
    """KV write and decode rows through Triton kernels; prefill chunks through the reference (SDPA) path."""

    def write(self, kv_cache, slot_mapping, k, v):
        triton_write_kv(kv_cache, slot_mapping, k, v)

    def decode_into(self, q, kv_cache, meta: AttentionMetadata, scale, out):
        nd = meta.num_decode_tokens
        paged_decode_attention(q[:nd], kv_cache, meta.decode_block_tables, meta.decode_context_lens, scale, out[:nd])
