"""Batch-invariant mode on CUDA (see `batch_invariant.py` for the why): a GEMM and an attention backend whose
per-row results do not depend on the batch.

- `matmul`: x @ W.T (+ bias) with one tile shape for every M and no split-K. Each output element is the sum,
  in K order, of the same MMA partials whatever the other rows are; cuBLAS instead picks kernels (tile shapes,
  split-K) by M, so a row's bits change with the batch size.
- `BatchInvariantTritonAttention`: every row goes through the paged prefill kernel with one launch
  configuration and no context split -- decode rows as one-token chunks. The kernel walks each query's keys in
  BLOCK_N blocks aligned to position 0 of the sequence (the windowed start is aligned too), every block through
  the masked path (the unmasked path's arithmetic may be fused differently by the compiler: found on the H200 in
  fp32, where a chunk starting past a block boundary changed a row's last bits), and the keys a row may not see
  add exact zeros to its online softmax, so neither the chunk it came in, the tile it shares nor the rest of the
  step changes its result. The flash-decoding kernel is not used: its split count follows
  the batch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from openinfer.layers.attention import AttentionMetadata
from openinfer.layers.triton_attention import (TritonPagedAttention, _dot_precision, _prefill_tiles,
                                               paged_prefill_attention)


@triton.jit
def _matmul_kernel(a_ptr, w_ptr, bias_ptr, c_ptr, M, N, K,
                   stride_am, stride_ak, stride_wn, stride_wk, stride_cm, stride_cn,
                   HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   GROUP_M: tl.constexpr, PRECISION: tl.constexpr):
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    # grouped order: GROUP_M row tiles share each weight tile while it is in L2
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rm[:, None].to(tl.int64) * stride_am + rk[None, :] * stride_ak
    w_ptrs = w_ptr + rn[None, :].to(tl.int64) * stride_wn + rk[:, None] * stride_wk
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_left = K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=(rm[:, None] < M) & (rk[None, :] < k_left), other=0.0)
        w = tl.load(w_ptrs, mask=(rn[None, :] < N) & (rk[:, None] < k_left), other=0.0)
        acc = tl.dot(a, w, acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        w_ptrs += BLOCK_K * stride_wk
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    c_ptrs = c_ptr + rm[:, None].to(tl.int64) * stride_cm + rn[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=(rm[:, None] < M) & (rn[None, :] < N))


def _matmul_launch(dtype: torch.dtype) -> dict:
    """The one launch shape per dtype (never per M: that is the point)."""
    if dtype == torch.float32:
        return {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "num_warps": 4, "num_stages": 3}
    return {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3}


def matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           launch: dict | None = None) -> torch.Tensor:
    """x [..., K] @ weight [N, K].T (+ bias [N]) -> [..., N] in x's dtype, fp32 accumulation; `launch`
    overrides the tile shape (tests and benchmarks only)."""
    shape = x.shape
    a = x.reshape(-1, shape[-1])
    M, K = a.shape
    N = weight.shape[0]
    c = torch.empty(M, N, dtype=x.dtype, device=x.device)
    cfg = {**_matmul_launch(x.dtype), **(launch or {})}
    grid = (triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(N, cfg["BLOCK_N"]),)
    _matmul_kernel[grid](a, weight, bias if bias is not None else c, c, M, N, K,
                         a.stride(0), a.stride(1), weight.stride(0), weight.stride(1), c.stride(0), c.stride(1),
                         HAS_BIAS=bias is not None, GROUP_M=8,
                         PRECISION=_dot_precision(x.dtype), **cfg)
    return c.view(*shape[:-1], N)


class BatchInvariantTritonAttention(TritonPagedAttention):
    """Every row through the paged prefill kernel, one configuration, no split (module docstring). Decode
    rows are one-token chunks whose metadata is made on the device from the decode tables and lengths, so
    CUDA-graph captures of decode steps replay with the live lengths."""

    def decode_into(self, q, kv_cache, meta: AttentionMetadata, scale, out, window=None, kv_scale=None):
        nd = meta.num_decode_tokens
        block_m = _prefill_tiles(q.shape[-1], q.dtype, kv_cache.shape[1])[0]
        rows = torch.arange(nd, dtype=torch.int32, device=q.device)
        chunk_info = torch.stack([rows, torch.ones_like(rows), meta.decode_context_lens.to(torch.int32)], 1)
        tile_info = torch.stack([rows, torch.zeros_like(rows)], 1)
        paged_prefill_attention(q[:nd], kv_cache, meta.decode_block_tables, chunk_info, tile_info, scale,
                                out[:nd], block_m, window=window, kv_scale=kv_scale, num_splits=1,
                                all_masked=True)

    def prefill_into(self, q, kv_cache, meta: AttentionMetadata, scale, out, window=None, kv_scale=None):
        block_m = _prefill_tiles(q.shape[-1], q.dtype, kv_cache.shape[1])[0]
        tables, chunk_info, tile_info = self._prefill_plan(meta, block_m)
        paged_prefill_attention(q, kv_cache, tables, chunk_info, tile_info, scale, out, block_m, window=window,
                                kv_scale=kv_scale, first_row=meta.num_decode_tokens, num_splits=1,
                                all_masked=True)

