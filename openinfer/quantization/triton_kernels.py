"""Triton kernels for DeepSeek's quantized weights on Hopper (the CUDA `LayerOps.fp8_linear` and
`LayerOps.grouped_gemm`); `reference.py` defines what they compute and tests/test_gpu_quant.py holds them to it.

- `fp8_linear`: W8A8 on the FP8 tensor cores. Activations are quantized per token per `block` channels
  exactly as `formats.quantize_activations` does (bit for bit); each K-block's FP8 product is scaled by
  act_scale * weight_scale and accumulated in fp32 (DeepSeek's promotion every block). Decode (M <= 64)
  quantizes the activation tile inside the GEMM (one launch) and splits K when the output tiles alone would
  leave most SMs idle; larger M quantizes once in a separate kernel, and with block 128 from a few
  hundred tokens on goes to cuBLAS' blockwise FP8 GEMM (torch._scaled_mm), which is faster there. Finer
  blocks (V4.1's 32) can instead take `fp8_bf16_gemm` on activations rounded to their FP8 values
  (`quantize_dequantize_activations`): weight tiles dequantized to bf16 inside a bf16 GEMM, no rescale per
  block; or (`dequant_gemm.py`) dequantize the whole weight to bf16 and call cuBLAS; which one runs at which M
  is `kernel_choice.py`'s table.
- `grouped_gemm`: MoE experts with weight-only dequantization in registers (W4A16 for MXFP4, W8A16 for FP8):
  packed weights are decoded to bf16 next to the dot, never written back. The row tiles per expert depend
  on the routing, so the grid is a static upper bound and each program finds its (expert, rows) from `offs`
  on the device: no host sync, CUDA-graph capturable. (`triton_w4a8.py` holds the W4A8 expert GEMM.)

Known limits: an E8M0 scale byte 0 (2^-127) reads as 0 (real checkpoints stay far from it);
`grouped_gemm` leaves output rows past offs[-1] unwritten, as the reference does.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from openinfer.quantization import dequant_gemm, kernel_choice
from openinfer.quantization.formats import MXFP4_GROUP
from openinfer.quantization.triton_act_quant import (_e8m0_to_f32, _quantize_groups, quantize_activations,
                                                     quantize_dequantize_activations)


# ---- FP8 block-scaled linear (W8A8) -------------------------------------------------------------------
@triton.jit
def _swizzled_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Program pid -> (row tile, column tile), GROUP_M row tiles sweeping the columns together so that their
    weight tiles are reused from L2."""
    grid_n = tl.cdiv(N, BLOCK_N)
    width = GROUP_M * grid_n
    first_m = (pid // width) * GROUP_M
    group_rows = tl.minimum(tl.cdiv(M, BLOCK_M) - first_m, GROUP_M)
    return first_m + (pid % width) % group_rows, (pid % width) // group_rows


# SPLIT_K is a runtime argument: the split count follows the step's token count (fp8_config), and as a constexpr
# each count would compile its own variant under traffic (engine/compile_watch.py)
@triton.jit(do_not_specialize=["SPLIT_K", "stride_os"])
def _fp8_gemm_kernel(a_ptr, as_ptr, w_ptr, ws_ptr, out_ptr, M, N, K,
                     stride_am, stride_asm, stride_ask, stride_wn, stride_wsn, stride_os, stride_om, SPLIT_K,
                     BLOCK: tl.constexpr, QUANT_A: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     GROUP_M: tl.constexpr):
    """out[split] = sum over this split's K-blocks of dot(a_q, w_q^T) * a_scale * w_scale (fp32).

    K advances one quantization block per step, so every dot has a single scale per (row, column) and is
    promoted into the fp32 accumulator right away. QUANT_A: `a_ptr` is the bf16 input and each tile is
    quantized here (decode: saves a launch and a round trip; the tile is tiny); else a_ptr/as_ptr hold the
    FP8 activations and their scales. SPLIT_K > 1 writes fp32 partials [SPLIT_K, M, N] for
    `_sum_splits_kernel`."""
    split = tl.program_id(1)
    pid_m, pid_n = _swizzled_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK)
    m_mask = rm < M
    n_mask = rn < N
    a_rows = a_ptr + rm.to(tl.int64)[:, None] * stride_am
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_wn
    ws_rows = ws_ptr + (rn // BLOCK) * stride_wsn

    k_blocks = tl.cdiv(K, BLOCK)
    per_split = tl.cdiv(k_blocks, SPLIT_K)
    kb_end = tl.minimum(k_blocks, (split + 1) * per_split)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(split * per_split, kb_end):
        k = kb * BLOCK + rk
        k_mask = k < K
        if QUANT_A:
            x = tl.load(a_rows + k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            a, a_scale = _quantize_groups(x.to(tl.float32))
        else:
            a = tl.load(a_rows + k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            a_scale = tl.load(as_ptr + rm * stride_asm + kb * stride_ask, mask=m_mask, other=0.0)
        w = tl.load(w_rows + k[None, :], mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        w_scale = _e8m0_to_f32(tl.load(ws_rows + kb, mask=n_mask, other=0))
        acc += tl.dot(a, tl.trans(w)) * (a_scale[:, None] * w_scale[None, :])

    out = out_ptr + split * stride_os + rm.to(tl.int64)[:, None] * stride_om + rn[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit(do_not_specialize=["SPLIT_K"])
def _sum_splits_kernel(part_ptr, out_ptr, numel, SPLIT_K, BLOCK: tl.constexpr):
    """out = sum of the SPLIT_K fp32 partials [SPLIT_K, numel], in a fixed order (deterministic)."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < numel
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(SPLIT_K):
        acc += tl.load(part_ptr + s * numel + i, mask=mask, other=0.0)
    tl.store(out_ptr + i, acc.to(out_ptr.dtype.element_ty), mask=mask)


@dataclass(frozen=True)
class Fp8GemmConfig:
    block_m: int
    block_n: int
    split_k: int
    num_warps: int
    num_stages: int
    fused_quant: bool      # quantize activations inside the GEMM (decode) vs a separate kernel


@functools.lru_cache(maxsize=None)
def num_sms(device: torch.device) -> int:
    if device.type != "cuda":       # the interpreter (CPU tests): an H200's count
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


def _split_k(tiles: int, k_blocks: int, target: int, sms: int) -> int:
    """Split K until about `target` programs (memory-bound decode needs many loads in flight), keeping at
    least 4 K-blocks per split so each program still streams a useful run of its weights."""
    if tiles >= sms:
        return 1
    return max(1, min(triton.cdiv(target, tiles), k_blocks // 4, 16))


def fp8_config(m: int, n: int, k: int, block: int, sms: int = 132) -> Fp8GemmConfig:
    """Deterministic tile choice (no autotuning, so nothing is benchmarked during graph capture); the
    numbers come from sweeps on an H200 (benchmarks/gpu_quant_kernels.py --sweep).

    M <= 64 (decode) is bound by streaming the weight: the smallest M tile that covers the batch, the
    widest N tile (128, else 64, 32) that still gives 16 output tiles, and split-K up to about two
    programs per SM (four with 32-wide blocks, whose shorter K steps keep fewer bytes in flight).
    Larger M: 128x128 tiles, eight warps (Hopper wgmma), split-K only when the output tiles cannot fill
    the SMs."""
    k_blocks = triton.cdiv(k, block)
    if m <= 64:
        bm = max(16, triton.next_power_of_2(m))
        bn = next((b for b in (128, 64) if triton.cdiv(n, b) >= 16), 32)
        tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
        target = (2 if block >= 128 else 4) * sms
        return Fp8GemmConfig(bm, bn, _split_k(tiles, k_blocks, target, sms), 4, 3 if block >= 128 else 5, True)
    bm, bn = 128, 128
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    return Fp8GemmConfig(bm, bn, _split_k(tiles, k_blocks, 2 * sms, sms), 8, 3 if block >= 128 else 4, False)


def fp8_gemm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: int,
             cfg: Fp8GemmConfig) -> torch.Tensor:
    """The Triton W8A8 path of `fp8_linear` with an explicit config (the benchmark sweeps these)."""
    m, k = x.shape
    n = weight.shape[0]
    x = x if x.stride(-1) == 1 else x.contiguous()
    if cfg.fused_quant:
        a, a_scale = x, x                    # the scale pointer is unused when quantizing in the kernel
        stride_asm, stride_ask = 0, 0
    else:
        a, a_scale = quantize_activations(x, block)
        stride_asm, stride_ask = a_scale.stride()
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    target = out if cfg.split_k == 1 else torch.empty(cfg.split_k, m, n, dtype=torch.float32, device=x.device)
    ws = scale.view(torch.uint8)
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n), cfg.split_k)
    _fp8_gemm_kernel[grid](
        a, a_scale, weight, ws, target, m, n, k, a.stride(0), stride_asm, stride_ask, weight.stride(0),
        ws.stride(0), target.stride(0) if cfg.split_k > 1 else 0, n, cfg.split_k, BLOCK=block,
        QUANT_A=cfg.fused_quant, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, GROUP_M=8,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if cfg.split_k > 1:
        numel = m * n
        _sum_splits_kernel[(triton.cdiv(numel, 1024),)](target, out, numel, cfg.split_k, BLOCK=1024)
    return out


def scaled_mm_fp8(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """block == 128 through cuBLAS' blockwise FP8 GEMM (torch._scaled_mm with 1x128 activation scales laid
    out token-fastest and 128x128 weight scales, both float32): the same arithmetic. cuBLAS refuses a token
    count that is not a multiple of 4 (CUBLAS_STATUS_NOT_SUPPORTED on torch 2.11), so the quantized
    activations are padded with zero rows."""
    m = x.shape[0]
    q, a_scale = quantize_activations(x, 128, scales_column_major=True, rows=-(-m // 4) * 4)
    w_scale = (scale.view(torch.uint8).to(torch.int32) << 23).view(torch.float32)
    return torch._scaled_mm(q, weight.t(), a_scale, w_scale.t(), out_dtype=x.dtype)[:m]


def use_scaled_mm(m: int, n: int, k: int, block: int) -> bool:
    """cuBLAS wins from a few hundred tokens on (1.3-2x at 512-4096 on an H200); below that its fixed
    cost (~19 us at any small M) loses to the Triton kernel. Its scale layout wants 128 | N and the
    weight's K blocks a multiple of 4."""
    return block == 128 and m >= 256 and m * n * k >= 1 << 31 and n % 128 == 0 and k % 512 == 0


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: int) -> torch.Tensor:
    """x [M, K] bf16 @ FP8 block-scaled weight [N, K] -> [M, N] (reference.fp8_linear, quantize_input=True).
    Blocks under 128 (V4.1's 32) take the FP8 kernel, the bf16 one on rounded activations, or the same rounded
    activations times the weight dequantized to bf16 through cuBLAS (`dequant_gemm`), by M, as `kernel_choice`
    measured (the same values up to fp32 summation order)."""
    m, k = x.shape
    n = weight.shape[0]
    if x.is_cuda and use_scaled_mm(m, n, k, block):
        return scaled_mm_fp8(x, weight, scale)
    route = kernel_choice.fp8_fine_block_kernel(m) if block < 128 else "fp8"
    if route == "bf16":
        return fp8_bf16_gemm(quantize_dequantize_activations(x, block), weight, scale, block,
                             fp8_bf16_config(m, n, k, block))
    if route == "bf16_dequant":
        return dequant_gemm.fp8_linear_dequant(x, weight, scale, block)
    return fp8_gemm(x, weight, scale, block, fp8_config(m, n, k, block, num_sms(x.device)))


# ---- grouped expert GEMM, weight-only (W4A16 / W8A16) -------------------------------------------------
@triton.jit
def _e8m0_to_bf16(s):
    """E8M0 scale bytes -> bf16 2^(s-127), exactly (same exponent field; s=0 gives 0.0)."""
    return (s.to(tl.int16) << 7).to(tl.bfloat16, bitcast=True)


@triton.jit
def _fp8_tile_to_bf16(vals, scale):
    """E4M3 weight tile [R, G * GK] and bf16 scales [R, G, 1] (one per GK columns) -> bf16 [R, G * GK]:
    an E4M3 value times a power of two is exact in bf16."""
    R: tl.constexpr = vals.shape[0]
    G: tl.constexpr = scale.shape[1]
    return tl.reshape(tl.reshape(vals.to(tl.bfloat16), (R, G, vals.shape[1] // G)) * scale, (R, vals.shape[1]))


@triton.jit
def _mxfp4_words_to_bf16(words, scale):
    """MXFP4 words [R, G, 4] (int32: 8 codes each, 4 words per 32-value group) and bf16 group scales
    [R, G, 1] -> bf16 values [R, G * 32], the 8 values of each word in the order 0 4 2 6 1 5 3 7 (the
    activations are loaded in the same order, which the dot's sum does not care about).

    Codes 4 apart sit 16 bits apart in a word, so one shift + mask moves two of them into the two bf16
    halves of a 32-bit lane at once: the 3 magnitude bits land at the bottom of the bf16 exponent and top
    of the mantissa, the sign on the sign bit, which reads as value * 2^-126 (code 1, 0.5, lands on a bf16
    subnormal, which bf16x2 multiplies keep); one multiply by 2^126 restores it and one by the power-of-two
    scale finishes, both exact. Two values per integer op and per multiply: dequantization is the inner
    loop's ALU cost, which decides how close W4A16 decode gets to the memory bound."""
    MAG: tl.constexpr = 0x01C001C0
    SIGN: tl.constexpr = 0x80008000
    w = words.to(tl.uint32, bitcast=True)
    p04 = ((w << 6) & MAG) | ((w << 12) & SIGN)
    p15 = ((w << 2) & MAG) | ((w << 8) & SIGN)
    p26 = ((w >> 2) & MAG) | ((w << 4) & SIGN)
    p37 = ((w >> 6) & MAG) | (w & SIGN)
    pairs = tl.join(tl.join(p04, p15), tl.join(p26, p37))                    # [R, G, 4, 2, 2]: 0 2 1 3 / +4
    halves = tl.join(pairs.to(tl.uint16), (pairs >> 16).to(tl.uint16))     # [R, G, 4, 2, 2, 2]
    vals = tl.reshape(halves.to(tl.bfloat16, bitcast=True), (words.shape[0], words.shape[1], 32))
    vals = vals * 8.507059173023462e37 * scale
    return tl.reshape(vals, (words.shape[0], words.shape[1] * 32))


@triton.jit
def _expert_row_tile(offs_ptr, t, E, E_PAD: tl.constexpr, BLOCK_M: tl.constexpr):
    """Row tile t of a grouped GEMM over expert-sorted rows (experts in order, ceil(count / BLOCK_M) tiles
    each) -> (expert, rows [BLOCK_M], row mask, total tiles; t >= total: past the last real tile). Per-expert
    tile counts from `offs` (cumulative row counts), then a prefix sum, all in registers: no host sync."""
    idx = tl.arange(0, E_PAD)
    ends = tl.load(offs_ptr + idx, mask=idx < E, other=0)
    starts = tl.load(offs_ptr + idx - 1, mask=(idx > 0) & (idx < E), other=0)
    counts = ends - starts
    tiles = (counts + BLOCK_M - 1) // BLOCK_M
    before = tl.cumsum(tiles, 0) <= t                      # experts wholly before tile t
    e = tl.sum(before.to(tl.int32), 0)
    first_tile = tl.sum(tl.where(before, tiles, 0), 0)
    row_start = tl.sum(tl.where(before, counts, 0), 0)
    row_end = row_start + tl.sum(tl.where(idx == e, counts, 0), 0)
    rm = row_start + (t - first_tile) * BLOCK_M + tl.arange(0, BLOCK_M)
    return e, rm, rm < row_end, tl.sum(tiles, 0)


@triton.jit
def _grouped_gemm_kernel(x_ptr, offs_ptr, w_ptr, s_ptr, out_ptr, N, K, E,
                         stride_xm, stride_we, stride_wn, stride_se, stride_sn, stride_om,
                         MXFP4: tl.constexpr, SCALE_N: tl.constexpr, SCALE_K: tl.constexpr, GROUP_K: tl.constexpr,
                         E_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         EVEN_K: tl.constexpr, SWAP_AB: tl.constexpr = False, DOT_SCALED: tl.constexpr = False):
    """Program (t, j): the t-th row tile over all experts (experts in order, ceil(count / BLOCK_M) tiles
    each) times output columns [j * BLOCK_N, (j + 1) * BLOCK_N). Programs past the last real tile exit.

    MXFP4: w [E, N, K/8] int32 words (the packed bytes), s [E, N, K/32]; FP8: w [E, N, K] e4m3,
    s [E, N/block, K/block]. A scale
    covers SCALE_N rows x SCALE_K columns of the weight; the tile applies it per GROUP_K columns
    (min(SCALE_K, BLOCK_K)). The weight tile is dequantized to bf16 in registers and multiplied with the
    bf16 rows, fp32 accumulation (every product of the reference's float32 arithmetic is exact in it).
    SWAP_AB: the product is taken transposed, w [BLOCK_N, K] @ x^T [K, BLOCK_M] (decode's few rows: the weight
    tile is the tensor-core instruction's wide A operand, which can stay in registers where it was dequantized,
    and the rows its narrow N side), then stored transposed; the same products and sums.
    DOT_SCALED (MXFP4 only): w is read as the packed bytes [E, N, K/2] and the product is Triton's `tl.dot_scaled`
    (E2M1 with E8M0 scales per 32 of K against bf16 rows): the compiler upcasts the codes after they reach the
    tensor-core operand layout, so the layout change moves packed bytes rather than bf16 values. Same values:
    each weight is its E2M1 value times its power-of-two scale, exact in bf16, fp32 accumulation."""
    t = tl.program_id(0)
    pid_n = tl.program_id(1)
    e, rm, m_mask, total = _expert_row_tile(offs_ptr, t, E, E_PAD, BLOCK_M)
    if t >= total:
        return
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rn < N
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm
    w_rows = w_ptr + e.to(tl.int64) * stride_we + rn[:, None] * stride_wn
    s_rows = s_ptr + e.to(tl.int64) * stride_se + (rn // SCALE_N)[:, None] * stride_sn
    GROUPS: tl.constexpr = BLOCK_K // GROUP_K
    acc = tl.zeros((BLOCK_N, BLOCK_M) if SWAP_AB else (BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        kg = (k0 + tl.arange(0, GROUPS) * GROUP_K) // SCALE_K
        k_mask = (k < K)[None, :] | EVEN_K
        x = tl.load(x_rows + k[None, :], mask=m_mask[:, None] & k_mask, other=0.0)
        g_mask = (k0 + tl.arange(0, GROUPS) * GROUP_K < K)[None, :]
        codes = tl.load(s_rows + kg[None, :], mask=n_mask[:, None] & g_mask, other=0)
        if MXFP4 and DOT_SCALED:
            kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)            # packed bytes of 2 values
            packed = tl.load(w_rows + kb[None, :], mask=n_mask[:, None] & ((kb < K // 2)[None, :] | EVEN_K), other=0)
            if SWAP_AB:
                acc += tl.dot_scaled(packed, codes, "e2m1", tl.trans(x), None, "bf16")
            else:
                acc += tl.dot_scaled(x, None, "bf16", tl.trans(packed), codes, "e2m1")
        else:
            scale = _e8m0_to_bf16(codes)[:, :, None]
            if MXFP4:
                kw = k0 // 8 + tl.arange(0, BLOCK_K // 8)          # int32 words of 8 values
                words = tl.load(w_rows + kw[None, :], mask=n_mask[:, None] & ((kw < K // 8)[None, :] | EVEN_K),
                                other=0)
                w = _mxfp4_words_to_bf16(tl.reshape(words, (BLOCK_N, GROUPS, GROUP_K // 8)), scale)
                # the activations in the same order within each group of 8 (0 4 2 6 1 5 3 7: a bit reversal)
                x = tl.reshape(tl.permute(tl.reshape(x, (BLOCK_M, BLOCK_K // 8, 2, 2, 2)), (0, 1, 4, 3, 2)),
                               (BLOCK_M, BLOCK_K))
            else:
                w = _fp8_tile_to_bf16(tl.load(w_rows + k[None, :], mask=n_mask[:, None] & k_mask, other=0.0), scale)
            if SWAP_AB:
                acc += tl.dot(w, tl.trans(x))
            else:
                acc += tl.dot(x, tl.trans(w))
    _store_rows(out_ptr, acc, rm, rn, m_mask, n_mask, stride_om, SWAP_AB)


@triton.jit
def _store_rows(out_ptr, acc, rm, rn, m_mask, n_mask, stride_om, SWAP_AB: tl.constexpr):
    """A grouped GEMM's output tile: acc [BLOCK_M, BLOCK_N] into rows rm, columns rn of out, or acc
    [BLOCK_N, BLOCK_M] (the transposed product, SWAP_AB) stored transposed."""
    if SWAP_AB:
        out = out_ptr + rm.to(tl.int64)[None, :] * stride_om + rn[:, None]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[None, :] & n_mask[:, None])
    else:
        out = out_ptr + rm.to(tl.int64)[:, None] * stride_om + rn[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@dataclass(frozen=True)
class GroupedConfig:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    swap_ab: bool = False       # the transposed product (the kernel's SWAP_AB)
    dot_scaled: bool = False    # MXFP4 through tl.dot_scaled (the kernel's DOT_SCALED)


def grouped_config(m: int, n: int, k: int, e: int, fmt: str, block: int) -> GroupedConfig:
    """BLOCK_M covers the rows an expert typically gets (M / experts hit, assuming routing spreads evenly)
    so each weight byte is read once per column tile; decode gets 16-row tiles (top-6 of 256 experts puts a
    few rows on each), prefill up to 128 (tensor-core bound there). From H200 sweeps at V4-Flash shapes:
    128-wide column tiles (the activation tile, re-read per column tile, costs less per weight byte),
    except with only a handful of experts hit (batch 1-2), where 64 x 256 tiles spread the few experts'
    weights over more programs."""
    hit = max(1, min(e, m))
    bm = min(128, max(16, triton.next_power_of_2(triton.cdiv(m, hit))))
    if fmt == "fp8" and hit <= 16 and bm <= 32:     # V4's grouped wo_a at decode (8 groups of 1024 x 4096, H200):
        return GroupedConfig(bm, 32 if bm == 16 else 64, 128, 4, 4 if bm == 16 else 3)   # 25.4 / 40.0 us vs 34 / 43
    if bm <= 32:
        return GroupedConfig(bm, 64, 256, 4, 3) if hit <= 16 else GroupedConfig(bm, 128, 128, 4, 3)
    if bm == 128:       # prefill (~190 rows per expert at 8K tokens): 128 x 256 tiles, 147-154 vs 100-105 TFLOP/s
        return GroupedConfig(bm, 256, 64, 8, 3)
    return GroupedConfig(bm, 128, 128, 4, 3)


def grouped_gemm_with(rows: torch.Tensor, offs: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                      fmt: str, block: int, cfg: GroupedConfig) -> torch.Tensor:
    """`grouped_gemm` with an explicit config (the benchmark sweeps these)."""
    m, k = rows.shape
    e, n = weight.shape[:2]
    if fmt not in ("mxfp4", "fp8"):
        raise ValueError(f"unknown quantized weight format {fmt!r} (fp8, mxfp4)")
    rows = rows if rows.stride(-1) == 1 else rows.contiguous()
    out = torch.empty(m, n, dtype=rows.dtype, device=rows.device)
    if m == 0:
        return out
    s = scale.view(torch.uint8)
    if cfg.dot_scaled and (fmt != "mxfp4" or rows.dtype != torch.bfloat16):
        raise ValueError(f"dot_scaled tiles take MXFP4 weights and bf16 rows, not {fmt} and {rows.dtype}")
    # MXFP4 is read as words of 8 values, or as its packed bytes by tl.dot_scaled
    w = (weight.view(torch.uint8) if cfg.dot_scaled else weight.view(torch.int32)) if fmt == "mxfp4" else weight
    max_tiles = triton.cdiv(m, cfg.block_m) + min(e, m)
    grid = (max_tiles, triton.cdiv(n, cfg.block_n))
    scale_n, scale_k = (1, MXFP4_GROUP) if fmt == "mxfp4" else (block, block)
    _grouped_gemm_kernel[grid](
        rows, offs, w, s, out, n, k, e, rows.stride(0), w.stride(0), w.stride(1), s.stride(0), s.stride(1),
        out.stride(0), MXFP4=fmt == "mxfp4", SCALE_N=scale_n, SCALE_K=scale_k,
        GROUP_K=min(scale_k, cfg.block_k), E_PAD=triton.next_power_of_2(e), BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, EVEN_K=k % cfg.block_k == 0, SWAP_AB=cfg.swap_ab,
        DOT_SCALED=cfg.dot_scaled,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out


def grouped_gemm(rows: torch.Tensor, offs: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, fmt: str,
                 block: int, host_offs=None) -> torch.Tensor:
    """rows [M, K] bf16 sorted by expert, offs [E] int32 cumulative counts -> [M, N] (reference.grouped_gemm;
    `host_offs` unused: no host read)."""
    m, k = rows.shape
    e, n = weight.shape[:2]
    return grouped_gemm_with(rows, offs, weight, scale, fmt, block, grouped_config(m, n, k, e, fmt, block))


# ---- FP8 block-scaled linear on bf16 tensor cores -----------------------------------------------------
@triton.jit
def _fp8_bf16_gemm_kernel(x_ptr, w_ptr, ws_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_wsn, stride_om,
                          BLOCK: tl.constexpr, GK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """out = x @ (w * block scales)^T with the scales inside the operand: each weight tile [BLOCK_N, BLOCK_K]
    (E4M3) is dequantized to bf16 in registers (exact) and the K loop is one bf16 dot per step into an fp32
    accumulator, no rescale per K block. Why: with 32-wide blocks the W8A8 kernel rescales its accumulator every
    32 of K (fp32 ALU work as large as the MMA's); here there is none, at the bf16 MMA rate. x is bf16: the
    activations already rounded to their FP8 values when the linear is W8A8. A scale covers GK = min(BLOCK,
    BLOCK_K) columns of a tile. Tiles sweep the columns in GROUP_M-row bands (weight tiles reused from L2), as
    `_fp8_gemm_kernel`."""
    pid_m, pid_n = _swizzled_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = rm < M
    n_mask = rn < N
    x_rows = x_ptr + rm.to(tl.int64)[:, None] * stride_xm
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_wn
    ws_rows = ws_ptr + (rn // BLOCK)[:, None] * stride_wsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        kg = k0 + tl.arange(0, BLOCK_K // GK) * GK
        x = tl.load(x_rows + k[None, :], mask=m_mask[:, None] & (k < K)[None, :], other=0.0)
        vals = tl.load(w_rows + k[None, :], mask=n_mask[:, None] & (k < K)[None, :], other=0.0)
        scale = _e8m0_to_bf16(tl.load(ws_rows + (kg // BLOCK)[None, :], mask=n_mask[:, None] & (kg < K)[None, :],
                                      other=0))
        acc += tl.dot(x, tl.trans(_fp8_tile_to_bf16(vals, scale[:, :, None])))
    out = out_ptr + rm.to(tl.int64)[:, None] * stride_om + rn[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@dataclass(frozen=True)
class Fp8Bf16Config:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def fp8_bf16_config(m: int, n: int, k: int, block: int) -> Fp8Bf16Config:
    """128 x 256 x 64 tiles with eight warps at large M (a bf16 GEMM's Hopper shape; the weight tile's dequant
    is shared by 128 rows), 64-row tiles below 128 tokens."""
    if m <= 64:
        return Fp8Bf16Config(max(16, triton.next_power_of_2(m)), 128, 128, 4, 4)
    return Fp8Bf16Config(128, 256, 64, 8, 3)


def fp8_bf16_gemm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: int,
                  cfg: Fp8Bf16Config) -> torch.Tensor:
    """x [M, K] bf16 @ (FP8 weight [N, K] with block x block E8M0 scales)^T -> [M, N] on bf16 tensor cores:
    `reference.fp8_linear(x, ..., quantize_input=False)` (W8A16; feed it `quantize_dequantize_activations(x)`
    for the W8A8 values)."""
    m, k = x.shape
    n = weight.shape[0]
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    ws = scale.view(torch.uint8)
    grid = (triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n),)
    _fp8_bf16_gemm_kernel[grid](x, weight, ws, out, m, n, k, x.stride(0), weight.stride(0), ws.stride(0),
                                out.stride(0), BLOCK=block, GK=min(block, cfg.block_k), BLOCK_M=cfg.block_m,
                                BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=8, num_warps=cfg.num_warps,
                                num_stages=cfg.num_stages)
    return out
