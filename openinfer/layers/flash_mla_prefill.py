"""DeepSeek-V4 prefill attention through FlashMLA's SM90 sparse prefill kernel: an optional accelerator for
`sparse_attention.sparse_prefill_attention`'s contract (PyPI `sgl-flash-mla`, its legacy kernels, which keep SM90).

FlashMLA's `flash_mla_sparse_fwd` takes one bf16 key tensor `kv` [N, 1, 512] (K = V) and per query a list of row
indices into it (-1: none), and returns the output with its log-sum-exp. A V4 query's keys live in two places, so
a layer takes two calls and one merge:
- the window: `kv` = each chunk's W history rows gathered from the ring, then the step's own keys (a copy of
  C * W + T rows); a query at position P reads the W rows of positions P - W + 1 .. P, -1 before the sequence
  start or the chunk's floor;
- the compressed entries: `kv` = the paged cache itself (no copy), the query's `rows` (-1 where not valid);
- the merge (`_merge_kernel`): out = (o_w e^{lse_w} + o_c e^{lse_c}) / (e^{lse_w} + e^{lse_c} + e^{sink}),
  which is the softmax over both key sets and the sink (V4's, `attend_v4`). A call whose query has no valid key
  contributes nothing.

The outputs of the two calls are rounded to bf16 before the merge: one more bf16 rounding than the fused Triton
kernel (`triton_sparse_prefill.py`), measured against the contract in benchmarks/gpu_sparse_prefill_attention.py
and held by tests/test_gpu_flash_mla.py.

Everything the kernel does not take goes to the Triton kernel (`applies` says why): V4.1's softmax, stored codecs
(V4's FlashMLA FP8 rows, V4.1's FP8/FP4 rows), dtypes other than bf16, head dims other than 512, head counts other
than 64 or 128 (tensor parallelism's slices), and devices other than SM90.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from openinfer.layers import triton_sparse_prefill
from openinfer.layers.sparse_attention import SOFTMAXES, V4_SOFTMAX
from openinfer.quantization.kv_formats import KVCodec

HEAD_DIM = 512
HEADS = (64, 128)
INDEX_BLOCK = 128          # index lists are padded with -1 to a multiple of the kernel's key block


@functools.cache
def load_error() -> str | None:
    """None when `flash_mla` (sgl-flash-mla) imports with its SM90 kernels on this machine's GPU, else why not."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    if torch.cuda.get_device_capability() != (9, 0):
        return f"FlashMLA's sparse prefill here is for SM90; this GPU is SM{''.join(map(str, torch.cuda.get_device_capability()))}"
    try:
        import flash_mla
    except Exception as e:          # not installed, or its library does not load on this torch
        return f"flash_mla does not import: {type(e).__name__}: {e}"
    if not flash_mla.has_legacy():
        return "flash_mla was built without its legacy (SM90) kernels"
    return None


def applies(q: torch.Tensor, softmax: str, ring: torch.Tensor, ring_codec: KVCodec | None,
            cache: torch.Tensor | None, cache_codec: KVCodec | None) -> str | None:
    """None when FlashMLA computes this call, else the reason the Triton kernel does."""
    T, H, D = q.shape
    if softmax != V4_SOFTMAX:
        return "V4.1's softmax (the max over keys only) is not FlashMLA's"
    if q.dtype != torch.bfloat16:
        return f"{q.dtype} queries (FlashMLA takes bf16)"
    if D != HEAD_DIM or H not in HEADS:
        return f"{H} heads of {D} (FlashMLA takes {' or '.join(map(str, HEADS))} heads of {HEAD_DIM})"
    if ring_codec is not None or ring.dtype != q.dtype:
        return "a ring stored in a codec"
    if cache is not None and (cache_codec is not None or cache.dtype != q.dtype or cache.stride(-1) != 1):
        return "a compressed cache stored in a codec"
    if not q.is_cuda:
        return "not on CUDA"
    return load_error()


def window_rows(positions: torch.Tensor, cu_seqlens: torch.Tensor, ring: torch.Tensor, slots: torch.Tensor,
                kv: torch.Tensor, window: int, floors: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(keys [C * W + T, D], indices [T, W] int32): each chunk's W history rows (positions start - W .. start - 1,
    read from its ring row p % R), then the step's own keys `kv`; query t at position P reads positions
    P - W + 1 .. P, -1 where a position is before 0 or the chunk's floor. On the device, no host sync."""
    T, C, W, R = kv.shape[0], slots.shape[0], window, ring.shape[1]
    dev = kv.device
    t = torch.arange(T, device=dev)
    chunk = torch.searchsorted(cu_seqlens[1:].contiguous(), t, right=True)
    first = cu_seqlens.long()[chunk]
    start = positions.long() - (t - first)                              # each query's chunk start
    starts = positions.long()[cu_seqlens[:-1].long().clamp(max=T - 1)]   # (an empty chunk's rows are unused)
    hist = starts[:, None] - W + torch.arange(W, device=dev)
    keys = torch.cat((ring[slots.long()[:, None], hist % R].reshape(C * W, -1), kv))
    p = positions.long()[:, None] - (W - 1) + torch.arange(W, device=dev)  # [T, W] key positions
    before = p < start[:, None]
    idx = torch.where(before, chunk[:, None] * W + (p - start[:, None] + W), C * W + t[:, None] - (positions.long()[:, None] - p))
    lo = torch.zeros_like(start) if floors is None else floors.long()[chunk].clamp(min=0)
    return keys, torch.where(p >= lo[:, None], idx, -1).to(torch.int32)


@triton.jit(do_not_specialize=["T", "C", "R"])
def _window_kernel(pos_ptr, cu_ptr, slot_ptr, floor_ptr, ring_ptr, kv_ptr, keys_ptr, idx_ptr, T, C, R,
                   stride_rs, stride_rr, stride_kv, stride_keys, stride_idx,
                   W: tl.constexpr, KW: tl.constexpr, KW_PAD: tl.constexpr, D: tl.constexpr, BLOCK_R: tl.constexpr,
                   HAS_FLOOR: tl.constexpr):
    """`window_rows` in one launch: programs 0 .. T-1 write query t's indices (row t of idx [T, KW], -1 past W) and
    copy its own key to keys[C * W + t]; programs T .. T+C-1 gather chunk c's W history rows into keys[c * W ..]."""
    pid = tl.program_id(0)
    d = tl.arange(0, D)
    if pid < T:
        t = pid.to(tl.int64)
        c = tl.zeros([], tl.int64)
        for i in range(C):                              # the chunk: how many chunk ends are at or before t
            c += (tl.load(cu_ptr + i + 1) <= t).to(tl.int64)
        first = tl.load(cu_ptr + c).to(tl.int64)
        P = tl.load(pos_ptr + t).to(tl.int64)
        start = P - (t - first)
        lo = tl.zeros([], tl.int64)
        if HAS_FLOOR:
            lo = tl.maximum(tl.load(floor_ptr + c).to(tl.int64), 0)
        j = tl.arange(0, KW_PAD)
        p = P - (W - 1) + j
        idx = tl.where(p < start, c * W + (p - start + W), C * W + t - (P - p))
        idx = tl.where((j < W) & (p >= lo), idx, -1)
        tl.store(idx_ptr + t * stride_idx + j, idx.to(tl.int32), mask=j < KW)
        tl.store(keys_ptr + (C * W + t) * stride_keys + d, tl.load(kv_ptr + t * stride_kv + d))
    else:
        c = (pid - T).to(tl.int64)
        lo_row = tl.load(cu_ptr + c)
        if tl.load(cu_ptr + c + 1) > lo_row:            # an empty chunk's rows are never read
            start = tl.load(pos_ptr + lo_row).to(tl.int64)
            slot = tl.load(slot_ptr + c).to(tl.int64)
            for i0 in range(0, W, BLOCK_R):
                i = i0 + tl.arange(0, BLOCK_R)
                row = ((start - W + i) % R + R) % R
                ok = i < W
                vals = tl.load(ring_ptr + slot * stride_rs + row[:, None] * stride_rr + d[None, :], mask=ok[:, None])
                tl.store(keys_ptr + (c * W + i)[:, None] * stride_keys + d[None, :], vals, mask=ok[:, None])


def window_plan(positions: torch.Tensor, cu_seqlens: torch.Tensor, ring: torch.Tensor, slots: torch.Tensor,
                kv: torch.Tensor, window: int, floors: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """`window_rows`' keys and its indices as FlashMLA takes them ([T, 1, W rounded up to INDEX_BLOCK], -1 padded):
    one Triton launch on CUDA, `window_rows` + `_padded` elsewhere (the reference)."""
    if not kv.is_cuda:
        keys, idx = window_rows(positions, cu_seqlens, ring, slots, kv, window, floors)
        return keys, _padded(idx)
    T, D = kv.shape
    C, W = slots.shape[0], window
    if D & (D - 1) or kv.stride(-1) != 1 or ring.stride(-1) != 1:
        raise ValueError(f"window_plan takes power-of-two rows of unit stride, got {D}")
    kw = -(-W // INDEX_BLOCK) * INDEX_BLOCK
    keys = torch.empty(C * W + T, D, dtype=kv.dtype, device=kv.device)
    idx = torch.empty(T, kw, dtype=torch.int32, device=kv.device)
    _window_kernel[(T + C,)](positions, cu_seqlens, slots, positions if floors is None else floors, ring, kv, keys,
                             idx, T, C, ring.shape[1], ring.stride(0), ring.stride(1), kv.stride(0), keys.stride(0),
                             idx.stride(0), W=W, KW=kw, KW_PAD=triton.next_power_of_2(kw), D=D, BLOCK_R=8,
                             HAS_FLOOR=floors is not None, num_warps=4)
    return keys, idx[:, None, :]


def _padded(idx: torch.Tensor) -> torch.Tensor:
    """[T, k] -> [T, 1, k rounded up to INDEX_BLOCK], padded with -1."""
    k = idx.shape[1]
    pad = -k % INDEX_BLOCK
    if pad or k == 0:
        idx = torch.nn.functional.pad(idx, (0, pad if k else INDEX_BLOCK), value=-1)
    return idx.to(torch.int32).contiguous()[:, None, :]


@triton.jit
def _merge_kernel(ow_ptr, lw_ptr, oc_ptr, lc_ptr, sink_ptr, out_ptr, H, stride_o, stride_oh, stride_l,
                  D: tl.constexpr, BLOCK_H: tl.constexpr):
    """One query's heads: the two calls' outputs weighted by their e^lse and normalized with the sink."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = h < H
    d = tl.arange(0, D)
    lw = tl.load(lw_ptr + t * stride_l + h, mask=ok, other=float("-inf"))
    lc = tl.load(lc_ptr + t * stride_l + h, mask=ok, other=float("-inf"))
    lw = tl.where((lw == lw) & (lw < float("inf")), lw, float("-inf"))     # no valid key: NaN or +inf -> nothing
    lc = tl.where((lc == lc) & (lc < float("inf")), lc, float("-inf"))
    s = tl.load(sink_ptr + h, mask=ok, other=0.0)
    m = tl.maximum(tl.maximum(lw, lc), s)
    a = tl.exp(lw - m)
    b = tl.exp(lc - m)
    inv = 1.0 / (a + b + tl.exp(s - m))
    off = t * stride_o + h[:, None] * stride_oh + d[None, :]
    ow = tl.load(ow_ptr + off, mask=ok[:, None], other=0.0).to(tl.float32)
    oc = tl.load(oc_ptr + off, mask=ok[:, None], other=0.0).to(tl.float32)
    out = (ow * (a * inv)[:, None] + oc * (b * inv)[:, None]).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + t * stride_o + h[:, None] * stride_oh + d[None, :], out, mask=ok[:, None])


def merge(o_w: torch.Tensor, lse_w: torch.Tensor, o_c: torch.Tensor, lse_c: torch.Tensor, sinks: torch.Tensor,
          out: torch.Tensor) -> torch.Tensor:
    """out [T, H, D] = the softmax over both calls' keys and the sink, from their normalized outputs and natural-log
    lse [T, H] (a row with no valid key: -inf, +inf or NaN, contributes nothing). o_w, o_c and out share strides.
    One Triton launch on CUDA, `merge_reference` elsewhere."""
    T, H, D = out.shape
    if T == 0:
        return out
    if not out.is_cuda:
        return out.copy_(merge_reference(o_w, lse_w, o_c, lse_c, sinks))
    if not (o_w.stride() == out.stride() == o_c.stride() and lse_w.stride() == lse_c.stride()):
        raise ValueError("merge takes outputs of one layout and lse of one layout")
    _merge_kernel[(T, triton.cdiv(H, 16))](o_w, lse_w, o_c, lse_c, sinks.float().contiguous(), out, H,
                                           out.stride(0), out.stride(1), lse_w.stride(0), D=D, BLOCK_H=16,
                                           num_warps=4)
    return out


def merge_reference(o_w, lse_w, o_c, lse_c, sinks) -> torch.Tensor:
    """`merge` in torch (float32 math, the result in the outputs' dtype)."""
    def finite(lse):
        return torch.where(torch.isfinite(lse), lse, float("-inf"))
    lw, lc = finite(lse_w.float()), finite(lse_c.float())
    s = sinks.float()[None, :].expand_as(lw)
    m = torch.maximum(torch.maximum(lw, lc), s)
    a, b = torch.exp(lw - m), torch.exp(lc - m)
    inv = 1.0 / (a + b + torch.exp(s - m))
    out = o_w.float() * (a * inv)[..., None] + o_c.float() * (b * inv)[..., None]
    return out.to(o_w.dtype)


def sparse_prefill_attention(q: torch.Tensor, *, sinks: torch.Tensor, scale: float, softmax: str, kv: torch.Tensor,
                             positions: torch.Tensor, cu_seqlens: torch.Tensor, ring: torch.Tensor,
                             slots: torch.Tensor, window: int, ring_codec: KVCodec | None = None,
                             cache: torch.Tensor | None = None, rows: torch.Tensor | None = None,
                             valid: torch.Tensor | None = None, cache_codec: KVCodec | None = None,
                             floors: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """`sparse_attention.sparse_prefill_attention`'s contract through FlashMLA where `applies`, else the Triton
    kernel's (`triton_sparse_prefill.sparse_prefill_attention`)."""
    if softmax not in SOFTMAXES:
        raise ValueError(f"softmax must be one of {SOFTMAXES}, got {softmax!r}")
    args = dict(sinks=sinks, scale=scale, softmax=softmax, kv=kv, positions=positions, cu_seqlens=cu_seqlens,
                ring=ring, slots=slots, window=window, ring_codec=ring_codec, cache=cache, rows=rows, valid=valid,
                cache_codec=cache_codec, floors=floors, out=out)
    T, H, D = q.shape
    if T == 0 or applies(q, softmax, ring, ring_codec, cache, cache_codec) is not None:
        return triton_sparse_prefill.sparse_prefill_attention(q, **args)
    from flash_mla import flash_mla_sparse_fwd

    def fwd(q, kv, indices, scale, sink=None):
        out, _, lse = flash_mla_sparse_fwd(q, kv, indices, scale, HEAD_DIM, attn_sink=sink, use_legacy=True)
        return out, lse

    return two_calls(q, fwd, **args)


def two_calls(q: torch.Tensor, fwd, *, sinks: torch.Tensor, scale: float, softmax: str, kv: torch.Tensor,
              positions: torch.Tensor, cu_seqlens: torch.Tensor, ring: torch.Tensor, slots: torch.Tensor,
              window: int, ring_codec: KVCodec | None = None, cache: torch.Tensor | None = None,
              rows: torch.Tensor | None = None, valid: torch.Tensor | None = None,
              cache_codec: KVCodec | None = None, floors: torch.Tensor | None = None,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """The contract (V4 softmax, keys stored as values) from a sparse attention `fwd(q [T, H, D], kv [N, 1, D],
    indices [T, 1, k] (-1: none), scale, sink [H] float32 or None) -> (out [T, H, D], lse [T, H] natural log)`:
    FlashMLA's on the GPU, a torch one in the CPU tests."""
    T, H, D = q.shape
    if window > ring.shape[1]:
        raise ValueError(f"window {window} exceeds the ring's {ring.shape[1]} rows")
    if kv.shape != (T, D):
        raise ValueError(f"kv must be [{T}, {D}], got {tuple(kv.shape)}")
    if out is None:
        out = torch.empty_like(q)
    q = q.contiguous()
    keys, widx = window_plan(positions, cu_seqlens, ring, slots, kv.to(q.dtype), window, floors)
    if cache is None:                       # the window alone: the kernel applies the sink itself
        o, _ = fwd(q, keys[:, None, :], widx, scale, sinks.float().contiguous())
        out.copy_(o)
        return out
    o_w, lse_w = fwd(q, keys[:, None, :], widx, scale, None)
    cidx = rows if valid is None else torch.where(valid, rows, -1)
    o_c, lse_c = fwd(q, cache.reshape(-1, 1, D), _padded(cidx), scale, None)
    if out.stride() != o_w.stride():
        out.copy_(merge(o_w, lse_w, o_c, lse_c, sinks, torch.empty_like(o_w)))
        return out
    return merge(o_w, lse_w, o_c, lse_c, sinks, out)
