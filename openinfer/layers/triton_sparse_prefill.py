"""DeepSeek-V4 / V4.1 prefill attention: every prefill chunk of a step in one Triton launch per layer.

`sparse_prefill_attention` computes what `layers/sparse_attention.py:sparse_prefill_attention` computes (its
contract is documented there) without gathering keys: a program takes BLOCK_H heads of one query (MQA: every head
of a query attends to the same K = V rows, so the heads are the rows of its tiles, as in FlashMLA's sparse prefill
and our decode kernel) and reads
- its window keys by position: those before its chunk's first position from the request's ring (slot, row p % R;
  V4.1's FP8 rows decoded in registers), those of its own chunk from the step's new keys `kv`;
- its compressed keys through its row indices into the paged cache (V4.1's FP4 rows decoded in registers);
and runs the decode kernel's online softmax (`triton_sparse_decode.py`: the same tile step, sink and rounding in
both softmax conventions). Chunks of any length and start share the launch: a query finds its chunk's first row
through `cu_seqlens` (a per-query chunk id computed on the device, no host sync).

The grid is (head blocks, queries): a step of T prefill tokens is T * ceil(H / BLOCK_H) programs, enough to fill the
GPU without splitting the keys. Consecutive queries of a chunk read overlapping window tiles, served from L2.

Tested against the torch contract in Triton's interpreter (tests/test_sparse_prefill_attention.py) and on the GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from openinfer.layers.sparse_attention import SOFTMAXES, V41_SOFTMAX
from openinfer.layers.triton_sparse_decode import _LOG2E, PLAIN, _attend_tile, _cast, _finish, _format, _load_keys
from openinfer.quantization.kv_formats import KVCodec


@triton.jit(do_not_specialize=["K", "stride_rows", "stride_valid"])
def _sparse_prefill_kernel(
    q_ptr, out_ptr, sink_ptr, kv_ptr, pos_ptr, chunk_ptr, cu_ptr, slot_ptr, floor_ptr,
    ring_ptr, cache_ptr, rows_ptr, valid_ptr,
    qk_scale, W, R, K,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_kv,
    stride_ring_slot, stride_ring_row, stride_cache, stride_rows, stride_valid,
    H: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    WIN_FMT: tl.constexpr, WIN_GROUP: tl.constexpr, COMP_FMT: tl.constexpr, COMP_GROUP: tl.constexpr,
    WIN_NOPE: tl.constexpr, COMP_NOPE: tl.constexpr,
    HAS_COMP: tl.constexpr, HAS_VALID: tl.constexpr, HAS_FLOOR: tl.constexpr, V41: tl.constexpr,
    PRECISION: tl.constexpr, UPCAST: tl.constexpr,
):
    hb = tl.program_id(0)                           # head block: fastest, so a query's programs share its tiles
    t = tl.program_id(1).to(tl.int64)
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    h_ok = heads < H
    d = tl.arange(0, D_PAD)
    q = tl.load(q_ptr + t * stride_qt + heads[:, None] * stride_qh + d[None, :],
                mask=h_ok[:, None] & (d < D)[None, :], other=0.0)
    dtype = q_ptr.dtype.element_ty
    c = tl.load(chunk_ptr + t)
    first = tl.load(cu_ptr + c).to(tl.int64)        # the chunk's first row in the step
    pos = tl.load(pos_ptr + t).to(tl.int64)
    start = pos - (t - first)                       # the chunk's first position
    slot = tl.load(slot_ptr + c).to(tl.int64)
    lo = tl.zeros([], tl.int64)
    if HAS_FLOOR:
        lo = tl.maximum(tl.load(floor_ptr + c).to(tl.int64), 0)
    m_i = tl.full([BLOCK_H], -1e30, tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, D_PAD], tl.float32)
    n = tl.arange(0, BLOCK_N)
    for w0 in range(0, W, BLOCK_N):
        i = w0 + n
        kpos = pos - W + 1 + i                      # positions P-W+1 .. P
        ok = (i < W) & (kpos >= lo)
        old = ok & (kpos < start)                   # history: the ring (not yet overwritten by this chunk)
        off = slot * stride_ring_slot + (tl.where(old, kpos, 0) % R) * stride_ring_row
        k_old = _load_keys(ring_ptr, off, old, d, D, WIN_FMT, WIN_GROUP, dtype, WIN_NOPE)
        new = ok & (kpos >= start)                  # the chunk's own keys: row t - (P - p) of the step
        k_new = _load_keys(kv_ptr, tl.where(new, t - pos + kpos, 0) * stride_kv, new, d, D, 0, 1, dtype)
        k = tl.where(new[:, None], k_new, k_old)
        acc, m_i, l_i = _attend_tile(q, k, ok, acc, m_i, l_i, qk_scale, PRECISION, UPCAST)
    if HAS_COMP:
        for j0 in range(0, K, BLOCK_N):
            j = j0 + n
            ok = j < K
            if HAS_VALID:
                ok = ok & (tl.load(valid_ptr + t * stride_valid + j, mask=ok, other=0) != 0)
            row = tl.load(rows_ptr + t * stride_rows + j, mask=ok, other=0).to(tl.int64)
            k = _load_keys(cache_ptr, row * stride_cache, ok, d, D, COMP_FMT, COMP_GROUP, dtype, COMP_NOPE)
            acc, m_i, l_i = _attend_tile(q, k, ok, acc, m_i, l_i, qk_scale, PRECISION, UPCAST)
    sink = tl.load(sink_ptr + heads, mask=h_ok, other=0.0).to(tl.float32) * 1.4426950408889634
    out = _finish(acc, m_i, l_i, sink, V41)
    tl.store(out_ptr + t * stride_ot + heads[:, None] * stride_oh + d[None, :], _cast(out, dtype, UPCAST),
             mask=h_ok[:, None] & (d < D)[None, :])


def prefill_launch(heads: int, head_dim: int, itemsize: int = 2) -> dict:
    """Tile sizes: BLOCK_H heads of a query share each key tile (as `decode_launch`); untuned on the device so far
    (benchmarks/gpu_sparse_prefill_attention.py --sweep measures the alternatives). float32 at head_dim 512 takes
    16 x 16 tiles: 32 x 32 ones asked the H200 for 266 KB of shared memory (232 KB there; 2026-12-03)."""
    if itemsize >= 4 and head_dim >= 256:
        return {"BLOCK_H": 16, "BLOCK_N": 16, "num_warps": 8, "num_stages": 2}
    return {"BLOCK_H": min(32, max(16, triton.next_power_of_2(heads))), "BLOCK_N": 32 if head_dim >= 256 else 64,
            "num_warps": 8 if head_dim >= 256 else 4, "num_stages": 2}


def sparse_prefill_attention(q: torch.Tensor, *, sinks: torch.Tensor, scale: float, softmax: str, kv: torch.Tensor,
                             positions: torch.Tensor, cu_seqlens: torch.Tensor, ring: torch.Tensor,
                             slots: torch.Tensor, window: int, ring_codec: KVCodec | None = None,
                             cache: torch.Tensor | None = None, rows: torch.Tensor | None = None,
                             valid: torch.Tensor | None = None, cache_codec: KVCodec | None = None,
                             floors: torch.Tensor | None = None, out: torch.Tensor | None = None,
                             tuning: dict | None = None) -> torch.Tensor:
    """The fused kernel for `sparse_attention.sparse_prefill_attention`'s contract (same arguments; `tuning`
    overrides `prefill_launch`'s choices, for benchmarks)."""
    if softmax not in SOFTMAXES:
        raise ValueError(f"softmax must be one of {SOFTMAXES}, got {softmax!r}")
    T, H, D = q.shape
    if out is None:
        out = torch.empty_like(q)
    if T == 0:
        return out
    if window > ring.shape[1]:
        raise ValueError(f"window {window} exceeds the ring's {ring.shape[1]} rows")
    if kv.shape != (T, D) or kv.stride(-1) != 1:
        raise ValueError(f"kv must be [{T}, {D}] with unit last stride, got {tuple(kv.shape)}")
    kv = kv.to(q.dtype)
    win_fmt, win_group, win_nope = _format(ring_codec, D, ring)
    has_comp = cache is not None
    if has_comp:
        cache = cache.view(-1, cache.shape[-1])
        comp_fmt, comp_group, comp_nope = _format(cache_codec, D, cache)
        K = rows.shape[1]
    else:
        cache, rows, comp_fmt, comp_group, comp_nope, K = ring, positions[:, None], PLAIN, 1, 0, 0   # unused stand-ins
    # each query's chunk: the number of chunk ends at or before its row (on the device: no host sync)
    chunk = torch.searchsorted(cu_seqlens[1:].contiguous(), torch.arange(T, device=q.device), right=True)
    launch = prefill_launch(H, D, q.element_size())
    launch.update(tuning or {})
    d_pad = max(16, triton.next_power_of_2(D))
    has_valid = has_comp and valid is not None
    valid_arg = valid if has_valid else rows
    has_floor = floors is not None
    _sparse_prefill_kernel[(triton.cdiv(H, launch["BLOCK_H"]), T)](
        q, out, sinks, kv, positions, chunk, cu_seqlens, slots, floors if has_floor else slots,
        ring, cache, rows, valid_arg,
        scale * _LOG2E, window, ring.shape[1], K,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1), kv.stride(0),
        ring.stride(0), ring.stride(1), cache.stride(0), rows.stride(0), valid_arg.stride(0),
        H=H, D=D, D_PAD=d_pad, WIN_FMT=win_fmt, WIN_GROUP=win_group, COMP_FMT=comp_fmt, COMP_GROUP=comp_group,
        WIN_NOPE=win_nope, COMP_NOPE=comp_nope,
        HAS_COMP=has_comp, HAS_VALID=has_valid, HAS_FLOOR=has_floor, V41=softmax == V41_SOFTMAX,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", UPCAST=q.device.type != "cuda", **launch)
    return out
