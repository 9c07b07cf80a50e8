"""Fused Triton kernels for the CUDA path: residual-add + RMSNorm, RMSNorm, rotary (in place), SiLU·mul, and
the paged KV write; DeepSeek-V4's mHC weights (sigmoids, softmax and all Sinkhorn iterations in one kernel). Each
replaces several small torch kernels (the decode step is launch-bound at small batch); each is tested against the
torch reference ops in `layers/basic.py` (tests/test_gpu.py). `TRITON_OPS` gathers them with the quantized GEMMs,
DeepSeek's fused mHC (triton_mhc.py), MoE routing (triton_moe_routing.py) decode attention
(triton_sparse_decode.py) and sparse decode pieces (triton_indexer.py, triton_compressor.py)."""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from openinfer.layers import triton_compressor, triton_indexer, triton_mhc, triton_moe_routing, triton_v4_glue
from openinfer.layers.basic import LayerOps
from openinfer.layers.triton_mhc import sinkhorn
from openinfer.layers.triton_sparse_decode import sparse_decode_attention
from openinfer.layers.triton_sparse_prefill import sparse_prefill_attention
from openinfer.quantization import triton_kernels as quant_kernels
from openinfer.quantization import dequant_gemm, triton_w4a8


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, n_cols, eps, stride_x, stride_r, stride_o,
                     HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        x = x + tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        x = x.to(res_ptr.dtype.element_ty)        # the residual stream keeps the model dtype, as in eager
        tl.store(res_ptr + row * stride_r + cols, x, mask=mask)
        x = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, 0) / n_cols + eps)
    y = (x * inv).to(out_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_o + cols, w * y, mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    out = torch.empty_like(x)
    _rms_norm_kernel[(x.shape[0],)](x, x, weight, out, x.shape[1], eps, x.stride(0), 0, out.stride(0),
                                    HAS_RES=False, BLOCK=triton.next_power_of_2(x.shape[1]))
    return out


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
    """residual += x (in place); returns (rms_norm(residual) * weight, residual)."""
    out = torch.empty_like(x)
    _rms_norm_kernel[(x.shape[0],)](x, residual, weight, out, x.shape[1], eps, x.stride(0), residual.stride(0),
                                    out.stride(0), HAS_RES=True, BLOCK=triton.next_power_of_2(x.shape[1]))
    return out, residual


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, n, stride_x, stride_o, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + n + cols, mask=mask, other=0.0).to(tl.float32)
    y = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    n = x.shape[1] // 2
    out = torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    block = 1024
    _silu_mul_kernel[(x.shape[0], triton.cdiv(n, block))](x, out, n, x.stride(0), out.stride(0), BLOCK=block)
    return out


@triton.jit
def _rotary_kernel(x_ptr, pos_ptr, cos_ptr, sin_ptr, stride_t, stride_h, stride_cs, HALF: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    pos = tl.load(pos_ptr + t)
    i = tl.arange(0, HALF)
    base = x_ptr + t * stride_t + h * stride_h
    x1 = tl.load(base + i).to(tl.float32)
    x2 = tl.load(base + HALF + i).to(tl.float32)
    c = tl.load(cos_ptr + pos * stride_cs + i)
    s = tl.load(sin_ptr + pos * stride_cs + i)
    tl.store(base + i, (x1 * c - x2 * s).to(x_ptr.dtype.element_ty))
    tl.store(base + HALF + i, (x2 * c + x1 * s).to(x_ptr.dtype.element_ty))


def rotary(positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *xs: torch.Tensor):
    """Neox-style RoPE applied in place to each [T, heads, D] tensor (views with unit last stride)."""
    for x in xs:
        T, H, D = x.shape
        if T:
            _rotary_kernel[(T, H)](x, positions, cos, sin, x.stride(0), x.stride(1), cos.stride(0), HALF=D // 2)
    return xs


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, cache_ptr, slot_ptr, stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_cslot, stride_ckv, stride_ch, D: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    d = tl.arange(0, D)
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d)
    dst = cache_ptr + slot * stride_cslot + h * stride_ch + d
    tl.store(dst, k.to(cache_ptr.dtype.element_ty))
    tl.store(dst + stride_ckv, v.to(cache_ptr.dtype.element_ty))


def write_kv(kv_cache: torch.Tensor, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Scatter new K/V rows [T, KVH, D] into the paged cache [blocks, page, 2, KVH, D] at flat slots."""
    T, H, D = k.shape
    if T:
        flat = kv_cache.view(-1, *kv_cache.shape[2:])
        _write_kv_kernel[(T, H)](k, v, flat, slot_mapping, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                                 flat.stride(0), flat.stride(1), flat.stride(2), D=D)


@triton.jit
def _rotary_write_kv_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, cos_ptr, sin_ptr, cache_ptr, slot_ptr, stride_qt, stride_qh,
                            stride_kt, stride_kh, stride_vt, stride_vh, stride_cs, stride_cslot, stride_ckv,
                            stride_ch, NUM_Q_HEADS: tl.constexpr, HALF: tl.constexpr):
    """Program (t, h): h < NUM_Q_HEADS rotates query head h of token t in place; else KV head h - NUM_Q_HEADS:
    rotates its key in place and writes key and value into the token's cache slot (the rotation is
    `_rotary_kernel`'s, the write `_write_kv_kernel`'s: the same values, one launch instead of three)."""
    t = tl.program_id(0)
    h = tl.program_id(1)
    pos = tl.load(pos_ptr + t)
    i = tl.arange(0, HALF)
    c = tl.load(cos_ptr + pos * stride_cs + i)
    s = tl.load(sin_ptr + pos * stride_cs + i)
    if h < NUM_Q_HEADS:
        base = q_ptr + t * stride_qt + h * stride_qh
        x1 = tl.load(base + i).to(tl.float32)
        x2 = tl.load(base + HALF + i).to(tl.float32)
        tl.store(base + i, (x1 * c - x2 * s).to(q_ptr.dtype.element_ty))
        tl.store(base + HALF + i, (x2 * c + x1 * s).to(q_ptr.dtype.element_ty))
    else:
        j = h - NUM_Q_HEADS
        base = k_ptr + t * stride_kt + j * stride_kh
        x1 = tl.load(base + i).to(tl.float32)
        x2 = tl.load(base + HALF + i).to(tl.float32)
        r1 = (x1 * c - x2 * s).to(k_ptr.dtype.element_ty)
        r2 = (x2 * c + x1 * s).to(k_ptr.dtype.element_ty)
        tl.store(base + i, r1)
        tl.store(base + HALF + i, r2)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        dst = cache_ptr + slot * stride_cslot + j * stride_ch
        tl.store(dst + i, r1.to(cache_ptr.dtype.element_ty))
        tl.store(dst + HALF + i, r2.to(cache_ptr.dtype.element_ty))
        d = tl.arange(0, 2 * HALF)
        v = tl.load(v_ptr + t * stride_vt + j * stride_vh + d)
        tl.store(dst + stride_ckv + d, v.to(cache_ptr.dtype.element_ty))


def rotary_write_kv(kv_cache: torch.Tensor, slot_mapping: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor,
                    sin: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """`rotary` on q and k (in place) and `write_kv` of the rotated k and v, in one launch."""
    T, H, D = q.shape
    if T:
        flat = kv_cache.view(-1, *kv_cache.shape[2:])
        _rotary_write_kv_kernel[(T, H + k.shape[1])](
            q, k, v, positions, cos, sin, flat, slot_mapping, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
            v.stride(0), v.stride(1), cos.stride(0), flat.stride(0), flat.stride(1), flat.stride(2),
            NUM_Q_HEADS=H, HALF=D // 2)


@triton.jit
def _fp8_row(x, FP8_MAX: tl.constexpr):
    """One K or V row quantized as `quantization.kv_formats.fp8_kv_quantize` does: scale = amax / 448 (1 for an
    all-zero row), x / scale clamped to +-448, rounded to nearest even."""
    scale = tl.max(tl.abs(x), 0) / FP8_MAX
    scale = tl.where(scale == 0, 1.0, scale)
    q = tl.minimum(tl.maximum(x / scale, -FP8_MAX), FP8_MAX)
    return q.to(tl.float8e4nv), scale


@triton.jit
def _write_kv_fp8_kernel(k_ptr, v_ptr, cache_ptr, scale_ptr, slot_ptr, stride_kt, stride_kh, stride_vt,
                         stride_vh, stride_cslot, stride_ckv, stride_ch, stride_sslot, stride_skv, stride_sh,
                         D: tl.constexpr, FP8_MAX: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    d = tl.arange(0, D)
    k8, ks = _fp8_row(tl.load(k_ptr + t * stride_kt + h * stride_kh + d).to(tl.float32), FP8_MAX)
    v8, vs = _fp8_row(tl.load(v_ptr + t * stride_vt + h * stride_vh + d).to(tl.float32), FP8_MAX)
    dst = cache_ptr + slot * stride_cslot + h * stride_ch + d
    tl.store(dst, k8)
    tl.store(dst + stride_ckv, v8)
    sdst = scale_ptr + slot * stride_sslot + h * stride_sh
    tl.store(sdst, ks)
    tl.store(sdst + stride_skv, vs)


def write_kv_fp8(kv_cache: torch.Tensor, kv_scale: torch.Tensor, slot_mapping: torch.Tensor, k: torch.Tensor,
                 v: torch.Tensor) -> None:
    """FP8 KV cache: quantize new K/V rows [T, KVH, D] per (token, K/V, head) into the e4m3 cache
    [blocks, page, 2, KVH, D] and their scales into kv_scale [blocks, page, 2, KVH] (float32), in one launch."""
    T, H, D = k.shape
    if T:
        flat = kv_cache.view(-1, *kv_cache.shape[2:])
        sflat = kv_scale.view(-1, *kv_scale.shape[2:])
        _write_kv_fp8_kernel[(T, H)](k, v, flat, sflat, slot_mapping, k.stride(0), k.stride(1), v.stride(0),
                                     v.stride(1), flat.stride(0), flat.stride(1), flat.stride(2), sflat.stride(0),
                                     sflat.stride(1), sflat.stride(2), D=D, FP8_MAX=448.0)


@triton.jit
def _hc_weights_kernel(mix_ptr, base_ptr, scale_ptr, pre_ptr, post_ptr, comb_ptr, T, stride_m, iters, eps,
                       N: tl.constexpr, BLOCK_T: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    rmask = rows < T
    c = tl.arange(0, N)
    s0, s1, s2 = tl.load(scale_ptr), tl.load(scale_ptr + 1), tl.load(scale_ptr + 2)
    m = mix_ptr + rows[:, None] * stride_m
    pre = tl.load(m + c[None, :], mask=rmask[:, None], other=0.0) * s0 + tl.load(base_ptr + c)[None, :]
    post = tl.load(m + N + c[None, :], mask=rmask[:, None], other=0.0) * s1 + tl.load(base_ptr + N + c)[None, :]
    tl.store(pre_ptr + rows[:, None] * N + c[None, :], tl.sigmoid(pre) + eps, mask=rmask[:, None])
    tl.store(post_ptr + rows[:, None] * N + c[None, :], 2 * tl.sigmoid(post), mask=rmask[:, None])
    cc = tl.arange(0, N * N)
    w = tl.load(m + 2 * N + cc[None, :], mask=rmask[:, None], other=0.0) * s2 + tl.load(base_ptr + 2 * N + cc)[None, :]
    comb = sinkhorn(tl.reshape(w, (BLOCK_T, N, N)), iters, eps, 2, 1)
    tl.store(comb_ptr + rows[:, None] * (N * N) + cc[None, :], tl.reshape(comb, (BLOCK_T, N * N)), mask=rmask[:, None])


def hc_weights(mixes: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, n: int, iters: int, eps: float):
    """Fused `torch_hc_weights` (needs n a power of two; the reference op otherwise)."""
    if n & (n - 1):
        from openinfer.layers.basic import torch_hc_weights

        return torch_hc_weights(mixes, base, scale, n, iters, eps)
    T = mixes.shape[0]
    mixes = mixes.float()
    pre = torch.empty(T, n, device=mixes.device, dtype=torch.float32)
    post = torch.empty_like(pre)
    comb = torch.empty(T, n, n, device=mixes.device, dtype=torch.float32)
    block = 16
    _hc_weights_kernel[(triton.cdiv(T, block),)](mixes, base.float(), scale.float(), pre, post, comb, T,
                                                mixes.stride(0), iters, eps, N=n, BLOCK_T=block)
    return pre, post, comb


def _bf16_io(kernel):
    """The quantized-weight kernels take bf16 activations (tensor-core operands); other dtypes go through bf16."""
    def run(x, *args, **kwargs):
        if x.dtype == torch.bfloat16:
            return kernel(x, *args, **kwargs)
        return kernel(x.to(torch.bfloat16), *args, **kwargs).to(x.dtype)
    return run


TRITON_OPS = LayerOps(rms_norm=rms_norm, add_rms_norm=add_rms_norm, silu_mul=silu_mul, rotary=rotary,
                      hc_weights=hc_weights, fp8_linear=_bf16_io(quant_kernels.fp8_linear),
                      grouped_gemm=_bf16_io(quant_kernels.grouped_gemm),
                      fp8_grouped_dequant=_bf16_io(dequant_gemm.grouped_linear_dequant),
                      grouped_gemm_a8=_bf16_io(triton_w4a8.grouped_gemm_a8), hc_pre=triton_mhc.hc_pre,
                      hc_head=triton_mhc.hc_head, hc_post=triton_mhc.hc_post, route=triton_moe_routing.route,
                      expert_order=triton_moe_routing.expert_order, moe_act=triton_moe_routing.moe_act,
                      moe_combine=triton_moe_routing.moe_combine, moe_combine_add=triton_moe_routing.moe_combine,
                      sparse_decode_attention=sparse_decode_attention,
                      sparse_prefill_attention=sparse_prefill_attention,
                      index_topk=triton_indexer.index_topk, index_scores=triton_indexer.index_scores,
                      v4_hca_decode=triton_compressor.v4_hca_decode, v4_csa_decode=triton_compressor.v4_csa_decode,
                      v41_compress_decode=triton_compressor.v41_compress_decode,
                      v41_index_keys_decode=triton_compressor.v41_index_keys_decode,
                      v4_norm_rope=triton_v4_glue.v4_norm_rope, v4_kv_ring=triton_v4_glue.v4_kv_ring,
                      v4_compressor_rows=triton_compressor.v4_compressor_rows, entry_rows=triton_v4_glue.entry_rows)


# TRITON_OPS and the kernels that pass their tests in the interpreter but not yet on a GPU (`--ops next` in the GPU
# benchmarks), joining TRITON_OPS once their GPU tests pass. Today: V4's and V4.1's prefill indexer scores through
# the paged `index_scores` kernel (V4 `Indexer.select_chunk`, V4.1 `_index_paged`; interpreter cases and both tiny
# engines in tests/test_sparse_decode_indexer.py; its GPU case is in the same file's GPU test). Earlier ones (the batched prefill
# attention, the ring write in v4_norm_rope's epilogue, V4's compressor rows, `entry_rows`, the combine that adds the
# shared expert) joined TRITON_OPS on 2026-12-03 (their GPU tests on the H200; BENCHMARKS.md, issues 34 and 35).
TRITON_OPS_NEXT = dataclasses.replace(TRITON_OPS, index_prefill_scores=triton_indexer.index_scores)
