"""Prefill GEMMs on DeepSeek's quantized weights through cuBLAS: the weight is dequantized to bf16 by one Triton
kernel (exact: an E4M3 or E2M1 value times a power of two fits bf16), then multiplied by cuBLAS' bf16 GEMM
(`F.linear`) or grouped GEMM (`torch._grouped_mm`). The values are those of the reference (`reference.py`) up to
fp32 summation order, as the fused Triton routes in `triton_kernels.py` / `triton_w4a8.py` compute them.

Why: at prefill sizes the GEMM is compute-bound and cuBLAS' bf16 GEMM runs far closer to the bf16 peak than our
fused kernels (H200, V4.1's 32 x 32 FP8 linears at M >= 256: 646-668 TFLOP/s including the dequant, against
255-263 for the W8A8 Triton kernel); the dequant re-reads the weight once and writes it once per call, which
only a large M amortizes. Which route runs at which size is `kernel_choice.py`'s table ("bf16_dequant").

Memory, alive only while a call runs (the caching allocator hands it to the next call or layer):
- `fp8_linear_dequant`: one bf16 copy of the weight, N x K x 2 bytes (V4.1's largest, wq_b and wo_b: 80 MiB),
  beside the rounded activations (M x K x 2); `grouped_linear_dequant` (V4's grouped `wo_a`) the same (64 MiB
  at V4-Flash width).
- `grouped_gemm_dequant`: bf16 experts in chunks of at most `scratch_bytes` (default `SCRATCH_BYTES`, 1 GiB;
  always at least one expert), one chunk alive at a time, plus a chunk's output rows. Eager, it reads `offs` on
  the host (one sync per call; none where the caller's `host_offs` already holds them: a MoE's two GEMMs read
  them once), dequantizes only experts that got rows, and runs one `torch._grouped_mm` per chunk
  on that chunk's rows.
Neither is in the KV pool's accounting: `cache_pool._kv_budget` keeps back 1 GiB plus the logits for activations
and (1 - gpu_memory_utilization) of the GPU. 80 MiB fits that; the experts' 1 GiB competes with a prefill's own
activations, so when `kernel_choice` turns the expert route on, `SCRATCH_BYTES` belongs in that reserve.

CUDA graphs: these routes are meant for prefill, which runs eagerly (the engine captures decode steps), but a
capture does not break them (a decode batch of 256+ rows does capture `fp8_linear_dequant`, by the FP8 table).
Allocation during capture comes from the graph's private pool. `fp8_linear_dequant` has no host sync.
`grouped_gemm_dequant` cannot read `offs` while capturing: it then dequantizes every expert in one chunk and
runs one grouped GEMM over all rows (no host values needed) when they fit `scratch_bytes` (`fits_capture`), else
refuses; its dispatcher (`triton_w4a8.grouped_gemm_a8`) then takes the capturable W4A16 / W8A16 Triton kernel,
which computes the same values.

Known limit (as the Triton kernels): an E8M0 scale byte 0 (2^-127) dequantizes to 0.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from openinfer.device_io import ReadOnce, h2d
from openinfer.quantization.formats import MXFP4_GROUP
from openinfer.quantization.triton_act_quant import _e8m0_to_f32, quantize_dequantize_activations

SCRATCH_BYTES = 1 << 30


# ---- dequantization kernels ---------------------------------------------------------------------------
@triton.jit
def _dequant_fp8_kernel(w_ptr, s_ptr, ids_ptr, out_ptr, N, K, stride_we, stride_wn, stride_se, stride_sn,
                        stride_oe, stride_on, BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program (i, j, c): tile [i * BLOCK_N, j * BLOCK_K] of expert ids[c] -> out[c]: E4M3 value times its
    BLOCK x BLOCK tile's E8M0 scale, computed in fp32 and stored as bf16 (exact)."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    c = tl.program_id(2)
    e = tl.load(ids_ptr + c).to(tl.int64)
    mask = (rn < N)[:, None] & (rk < K)[None, :]
    rn64 = rn.to(tl.int64)
    v = tl.load(w_ptr + e * stride_we + rn64[:, None] * stride_wn + rk[None, :], mask=mask, other=0.0)
    s = tl.load(s_ptr + e * stride_se + (rn // BLOCK)[:, None] * stride_sn + (rk // BLOCK)[None, :], mask=mask,
                other=0)
    w = v.to(tl.float32) * _e8m0_to_f32(s)
    tl.store(out_ptr + c.to(tl.int64) * stride_oe + rn64[:, None] * stride_on + rk[None, :],
             w.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _mxfp4_to_bf16_bits(codes, s):
    """4-bit E2M1 codes and their E8M0 scale bytes (int32, same shape) -> the bf16 bits of code value x 2^(s-127),
    by integer ops alone (exact, and the same in Triton's interpreter, whose bf16 arithmetic is not IEEE): a normal
    code (magnitude bits e m, e > 0) is 2^(e-1) (1 + m/2), so its bits are the magnitude bits shifted under the
    exponent plus (s - 1) in the exponent; 0.5 is 2^(s-128) (the bf16 subnormal 2^-127 at s = 1); s = 0 gives 0
    (the known limit the GEMM kernels share)."""
    mag = codes & 7
    normal = (mag << 6) + ((s - 1) << 7)
    half = tl.where(s >= 2, (s - 1) << 7, tl.where(s == 1, 0x40, 0))
    bits = tl.where(mag == 0, 0, tl.where(mag == 1, half, normal))
    bits = tl.where(s == 0, 0, bits) | ((codes & 8) << 12)
    return bits.to(tl.int16)


@triton.jit
def _dequant_mxfp4_kernel(w_ptr, s_ptr, ids_ptr, out_ptr, N, K, stride_we, stride_wn, stride_se, stride_sn,
                          stride_oe, stride_on, GROUP: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr):
    """Program (i, j, c): output tile [i * BLOCK_N, j * BLOCK_K] of expert ids[c] (BLOCK_K / 2 packed bytes, the
    even element in the low nibble; BLOCK_K a multiple of GROUP) -> out[c]: E2M1 value times its group's E8M0
    scale, as bf16 bits made by integer ops (`_mxfp4_to_bf16_bits`)."""
    HALF: tl.constexpr = BLOCK_K // 2
    G: tl.constexpr = BLOCK_K // GROUP
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    kb = tl.program_id(1) * HALF + tl.arange(0, HALF)
    rk = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    kg = tl.program_id(1) * G + tl.arange(0, G)
    c = tl.program_id(2)
    e = tl.load(ids_ptr + c).to(tl.int64)
    rn64 = rn.to(tl.int64)
    n_mask = (rn < N)[:, None]
    b = tl.load(w_ptr + e * stride_we + rn64[:, None] * stride_wn + kb[None, :],
                mask=n_mask & (kb < K // 2)[None, :], other=0).to(tl.int32)
    codes = tl.reshape(tl.join(b & 0xF, (b >> 4) & 0xF), (BLOCK_N, G, GROUP))     # low nibble first
    s = tl.load(s_ptr + e * stride_se + rn64[:, None] * stride_sn + kg[None, :],
                mask=n_mask & (kg < K // GROUP)[None, :], other=0).to(tl.int32)
    bits = _mxfp4_to_bf16_bits(codes, s[:, :, None])
    w = tl.reshape(bits, (BLOCK_N, BLOCK_K)).to(tl.bfloat16, bitcast=True)
    tl.store(out_ptr + c.to(tl.int64) * stride_oe + rn64[:, None] * stride_on + rk[None, :],
             w.to(out_ptr.dtype.element_ty), mask=n_mask & (rk < K)[None, :])


def dequantize_to_bf16(weight: torch.Tensor, scale: torch.Tensor, fmt: str, block: int,
                       experts: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Stored weight(s) -> bf16 of the logical shape, equal to `reference.dequantize_weight(...).to(bfloat16)`.

    One weight ([N, K] FP8 / [N, K/2] MXFP4) gives [N, K]. Stacked experts ([E, N, ...]) give [C, N, K] for
    `experts` (int32 [C] indices on the weight's device; all E when None), into `out` when given (a [C, N, K] bf16
    buffer: the scratch the caller bounds). Scales must be E8M0 (float8_e8m0fnu or their uint8 bytes)."""
    if fmt not in ("fp8", "mxfp4"):
        raise ValueError(f"unknown quantized weight format {fmt!r} (fp8, mxfp4)")
    single = weight.dim() == 2
    w, s = (weight[None], scale[None]) if single else (weight, scale)
    n = w.shape[1]
    k = w.shape[2] * (2 if fmt == "mxfp4" else 1)
    if experts is None:
        experts = torch.arange(w.shape[0], dtype=torch.int32, device=w.device)
    c = experts.shape[0]
    if out is None:
        out = torch.empty(c, n, k, dtype=torch.bfloat16, device=w.device)
    elif out.shape != (c, n, k) or out.stride(-1) != 1:
        raise ValueError(f"out must be [{c}, {n}, {k}] with unit stride along K, got {tuple(out.shape)}")
    w = w if w.stride(-1) == 1 else w.contiguous()           # the kernels index the last dim with stride 1
    s = s.view(torch.uint8) if s.stride(-1) == 1 else s.contiguous().view(torch.uint8)
    if c:
        block_n, block_k = 32, 256      # a row's slice is 128+ bytes of stored weight, 512 of bf16
        grid = (triton.cdiv(n, block_n), triton.cdiv(k, block_k), c)
        args = (w.view(torch.uint8) if fmt == "mxfp4" else w, s, experts, out, n, k, w.stride(0), w.stride(1),
                s.stride(0), s.stride(1), out.stride(0), out.stride(1))
        if fmt == "fp8":
            _dequant_fp8_kernel[grid](*args, BLOCK=block, BLOCK_N=block_n, BLOCK_K=block_k)
        else:
            _dequant_mxfp4_kernel[grid](*args, GROUP=MXFP4_GROUP, BLOCK_N=block_n, BLOCK_K=block_k)
    return out[0] if single else out


# ---- the routes ---------------------------------------------------------------------------------------
def fp8_linear_dequant(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: int,
                       quantize_input: bool = True) -> torch.Tensor:
    """x [M, K] @ FP8 block-scaled weight [N, K] -> [M, N] in x's dtype (`reference.fp8_linear`): the activations
    rounded to their FP8 values as `triton_kernels.fp8_linear`'s "bf16" route rounds them
    (`quantize_dequantize_activations`), the weight dequantized to a bf16 buffer, then cuBLAS."""
    a = quantize_dequantize_activations(x, block) if quantize_input else x
    w = dequantize_to_bf16(weight, scale, "fp8", block)
    return F.linear(a, w.to(a.dtype))


def grouped_linear_dequant(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: int) -> torch.Tensor:
    """x [T, g, K] through a block-diagonal FP8 projection (`Fp8Linear.forward_groups`: group i multiplies by rows
    [i*N/g, (i+1)*N/g) of weight [N, K]) -> [T, g, N/g] in x's dtype, weight-only (`reference.fp8_linear` on each
    group's unrounded rows): the weight dequantized to one bf16 buffer (scale tile r // block for row r, whatever
    the group width), then one cuBLAS batched GEMM over the groups."""
    t, g, k = x.shape
    w = dequantize_to_bf16(weight, scale, "fp8", block).view(g, -1, k)
    return torch.bmm(x.transpose(0, 1), w.to(x.dtype).transpose(1, 2)).transpose(0, 1)


def fits_capture(weight: torch.Tensor, fmt: str, scratch_bytes: int | None = None) -> bool:
    """Whether `grouped_gemm_dequant` can run inside a CUDA-graph capture on these stacked experts: all of them
    dequantized at once fit `scratch_bytes` (default `SCRATCH_BYTES`; the routing cannot be read on the host while
    capturing)."""
    scratch_bytes = SCRATCH_BYTES if scratch_bytes is None else scratch_bytes
    e, n, k = weight.shape[0], weight.shape[1], weight.shape[2] * (2 if fmt == "mxfp4" else 1)
    return e * n * k * 2 <= scratch_bytes


def grouped_gemm_dequant(rows: torch.Tensor, offs: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                         fmt: str, block: int, scratch_bytes: int | None = None,
                         host_offs: ReadOnce | None = None) -> torch.Tensor:
    """rows [M, K] sorted by expert, offs [E] int32 cumulative counts -> [M, N] (`reference.grouped_gemm`,
    weight-only): experts dequantized to bf16 in chunks of at most `scratch_bytes` (default `SCRATCH_BYTES`, read
    at the call), a `torch._grouped_mm` per chunk (see the module docstring for memory and CUDA graphs). Rows past
    offs[-1] are left unwritten. `host_offs`: `offs` read on the host at most once for every call that shares them
    (a MoE's two GEMMs: one sync for both); None: read here."""
    m, k = rows.shape
    e, n = weight.shape[:2]
    scratch_bytes = SCRATCH_BYTES if scratch_bytes is None else scratch_bytes
    chunk = max(1, scratch_bytes // (n * k * 2))
    if rows.is_cuda and torch.cuda.is_current_stream_capturing():
        if not fits_capture(weight, fmt, scratch_bytes):
            raise RuntimeError(f"grouped_gemm_dequant cannot be captured: {e} experts of {n} x {k} exceed "
                               f"scratch_bytes={scratch_bytes} and the routing cannot be read while capturing")
        w = dequantize_to_bf16(weight, scale, fmt, block)
        return torch._grouped_mm(rows, w.transpose(1, 2), offs=offs)
    out = torch.empty(m, n, dtype=rows.dtype, device=rows.device)
    if m == 0:
        return out
    ends = (host_offs or ReadOnce(offs)).tolist()          # the one host sync (none if another call read them)
    starts = [0] + ends[:-1]
    hit = [i for i in range(e) if ends[i] > starts[i]]      # experts with rows, in row order
    if not hit:
        return out
    # every chunk's expert ids, then its group ends (relative to its first row), in one copy that does not wait for
    # the GPU (a plain copy of host values drains the stream: with one per chunk the host would wait for each
    # chunk's GEMM before launching the next)
    group_ends = [ends[j] - starts[hit[i - i % chunk]] for i, j in enumerate(hit)]
    table = h2d(torch.tensor(hit + group_ends, dtype=torch.int32), rows.device)
    ids, group_ends_dev = table[:len(hit)], table[len(hit):]
    scratch = torch.empty(min(chunk, len(hit)), n, k, dtype=torch.bfloat16, device=rows.device)
    for i in range(0, len(hit), chunk):
        part = hit[i:i + chunk]
        r0, r1 = starts[part[0]], ends[part[-1]]
        w = dequantize_to_bf16(weight, scale, fmt, block, ids[i:i + len(part)], scratch[:len(part)])
        y = torch._grouped_mm(rows[r0:r1].to(torch.bfloat16), w.transpose(1, 2),
                              offs=group_ends_dev[i:i + len(part)])
        if r0 == 0 and r1 == m and y.dtype == out.dtype:
            return y                                        # one chunk over every row: no copy
        out[r0:r1] = y
    return out
