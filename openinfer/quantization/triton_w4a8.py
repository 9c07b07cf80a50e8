"""MXFP4 routed experts on the FP8 tensor cores (W4A8), as DeepSeek's inference multiplies them (`fp4_gemm`):
activations quantized to E4M3 per token in groups of the checkpoint's FP8 block (`act_quant`: 1 x 128 in V4,
1 x 32 in V4.1, whose `linear` passes its `fp8_block_size` to both), weights E2M1 with an E8M0 scale per 32
along K; the same products as `reference.grouped_gemm_a8`, summed in another order. Two kernels:

**The folded kernel** (`grouped_gemm_w4a8_folded`, 1 x 128 activation groups: V4). Within each 128-wide block of
K a weight row's four E8M0 scales are folded into the E4M3 values: a 32-group whose scale lies d binades below
the block's largest gets its values' exponents lowered by d. That is exact while every value stays a normal
E4M3 (d <= 11, `fold_exact`, checked once per expert tensor at load: `QuantizedExperts.weights_changed`). The
block's product then runs as whole wgmmas accumulated in the MMA and is promoted to fp32 once per 128 of K,
scaled by one activation scale per row and one power of two per column (DeepSeek's promotion interval).
- The decode is inline PTX, about 13 instructions per 8 codes (`_fold_asm`): a byte permute looks 4 codes'
  magnitudes up at once in an 8-entry table of E4M3 bytes made from the group's exponent offset, a second one
  spreads their signs, a `lop3` joins them. The 8 codes of a 32-bit word come out as two words (codes 0-3,
  4-7), so each 128 of K is two K = 64 dots; the activation kernel writes every row in that K order
  (`w4a8_order`). `_fold_codes` is the same decode in plain Triton (the interpreter's; the GPU tests hold the
  two bit for bit).
- Few rows per expert (decode) take the transposed product: the decoded weights are the wgmma's A operand,
  straight from registers, and the rows its narrow N side.
- H200, V4-Flash's expert GEMMs: 1.4-1.9x the W4A16 kernel from 1 to 4K tokens, and at 8K tokens 310-316
  TFLOP/s against the bf16 dequant route's 210-220 (`kernel_choice.FOLDED_EXPERT_KERNEL_BY_ROWS_PER_EXPERT`).

**The per-32-group kernel** (`grouped_gemm_w4a8`, any group that is whole 32-groups: V4.1's 1 x 32). Each 32-wide
group is its own FP8 dot (K = 32, one wgmma) whose fp32 result is scaled per column (and per row with 1 x 32
activation groups) and added: exact fp32 promotion per group, but 22-29 TFLOP/s on an H200, so no table picks
it today. Its decode places the code's bits (E2M1 value x 2^-6 as an E4M3; 2^6 given back at the end).

Both are grouped over experts as the W4A16 kernel is (`_expert_row_tile`): a static upper-bound grid, each
program finds its expert and rows from `offs` on the device; no host sync, CUDA-graph capturable. The rows
are quantized by one kernel before the GEMM (`quantize_activations`, bit for bit `formats.quantize_activations`).

`grouped_gemm_a8` is the `LayerOps.grouped_gemm_a8` of the CUDA ops: per rows per expert it takes a W4A8 kernel,
"round the activations, then the W4A16 kernel", or "round them, dequantize the experts to bf16,
torch._grouped_mm" (`dequant_gemm.py`), by the measured tables in `kernel_choice.py`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from openinfer.quantization import dequant_gemm, formats, kernel_choice
from openinfer.quantization.formats import MXFP4_GROUP
from openinfer.quantization.triton_kernels import (_e8m0_to_f32, _expert_row_tile, _store_rows, grouped_gemm,
                                                   quantize_activations, quantize_dequantize_activations)


@triton.jit
def _e2m1_to_e4m3(packed, ROWS: tl.constexpr, COLS: tl.constexpr):
    """Packed MXFP4 bytes [ROWS, COLS] (uint8, even element in the low nibble) -> float8e4nv [ROWS, 2 * COLS]
    in element order, each the E2M1 value times 2^-6 exactly (the byte's two codes re-placed, see the module
    docstring)."""
    lo = ((packed & 0x07) << 2) | ((packed & 0x08) << 4)
    hi = ((packed >> 2) & 0x1C) | (packed & 0x80)
    return tl.reshape(tl.join(lo, hi), (ROWS, 2 * COLS)).to(tl.float8e4nv, bitcast=True)


@triton.jit
def _grouped_w4a8_kernel(a_ptr, as_ptr, offs_ptr, w_ptr, s_ptr, out_ptr, N, K, E,
                         stride_am, stride_asm, stride_we, stride_wn, stride_se, stride_sn, stride_om,
                         ACT_BLOCK: tl.constexpr, E_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program (t, j): row tile t over all experts times output columns [j * BLOCK_N, (j + 1) * BLOCK_N).

    a [M, K] e4m3 and as [M, ceil(K / ACT_BLOCK)] fp32: the quantized rows; w [E, N, K/2] packed E2M1 bytes,
    s [E, N, K/32] E8M0 bytes. K advances BLOCK_K per step (BLOCK_K == ACT_BLOCK, or ACT_BLOCK == 32), in
    BLOCK_K / 32 FP8 dots of K = 32 each."""
    t = tl.program_id(0)
    pid_n = tl.program_id(1)
    e, rm, m_mask, total = _expert_row_tile(offs_ptr, t, E, E_PAD, BLOCK_M)
    if t >= total:
        return
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rn < N
    G: tl.constexpr = 32                                    # the MXFP4 scale group
    a_rows = a_ptr + rm.to(tl.int64)[:, None] * stride_am
    as_rows = as_ptr + rm.to(tl.int64) * stride_asm
    w_rows = w_ptr + e.to(tl.int64) * stride_we + rn.to(tl.int64)[:, None] * stride_wn
    s_rows = s_ptr + e.to(tl.int64) * stride_se + rn.to(tl.int64) * stride_sn
    kk = tl.arange(0, G)
    kb = tl.arange(0, G // 2)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        block = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for j in tl.static_range(BLOCK_K // G):
            kg = k0 + j * G                                 # K is a multiple of 32: a group is all in or out
            a = tl.load(a_rows + (kg + kk)[None, :], mask=m_mask[:, None] & (kg + kk < K)[None, :], other=0.0)
            packed = tl.load(w_rows + (kg // 2 + kb)[None, :], mask=n_mask[:, None] & (kg + 2 * kb < K)[None, :],
                             other=0)
            w_scale = _e8m0_to_f32(tl.load(s_rows + kg // G, mask=n_mask & (kg + 0 * rn < K), other=0))
            part = tl.dot(a, tl.trans(_e2m1_to_e4m3(packed, BLOCK_N, G // 2)))
            if ACT_BLOCK == G:
                a_scale = tl.load(as_rows + kg // G, mask=m_mask & (kg + 0 * rm < K), other=0.0)
                acc += part * (a_scale[:, None] * w_scale[None, :])
            else:
                block += part * w_scale[None, :]
        if ACT_BLOCK != G:
            acc += block * tl.load(as_rows + k0 // ACT_BLOCK, mask=m_mask, other=0.0)[:, None]
    out = out_ptr + rm.to(tl.int64)[:, None] * stride_om + rn[None, :]
    tl.store(out, (acc * 64.0).to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


# ---- the folded kernel: one FP8 scale per 128 of K ------------------------------------------------------
# The per-32 kernel above runs one K = 32 wgmma per scale group and rescales the accumulator after each: 22-29
# TFLOP/s on an H200. Here each weight row's four E8M0 scales of a 128-wide K block are folded into the E4M3
# values themselves: a group whose scale is d binades below the block's largest has its values' exponents
# lowered by d, which is exact while the E4M3 result stays normal (d <= 11: `fold_exact`). The block's FP8
# product then runs as whole wgmmas accumulated in the MMA, promoted to fp32 once per 128 of K with one
# activation scale per row and one weight scale per column (DeepSeek's promotion interval).
FOLD_BLOCK = 128
FOLD_SPREAD = 11          # the most binades a 32-group's scale may lie below its 128-block's largest
_FOLD_BIAS = 12           # folded exponent field = code's E2M1 exponent + (scale - block max) + 12


def fold_exact(scale: torch.Tensor) -> bool:
    """Whether the folded kernel reproduces MXFP4 experts with these E8M0 scales [..., K/32] exactly: within every
    128-wide K block the four scales lie within FOLD_SPREAD binades of the largest, and the largest is in
    7 .. 243 (its block scale 2^(s - 133) a normal float, s + 12 within a byte). One reduction and one host
    read: `DeepseekV4ForCausalLM.check_w4a8_folds` calls it once per expert tensor at load."""
    s = scale.view(torch.uint8)
    if s.shape[-1] % (FOLD_BLOCK // MXFP4_GROUP):
        return False
    blocks = s.reshape(*s.shape[:-1], -1, FOLD_BLOCK // MXFP4_GROUP).to(torch.int16)
    hi, lo = blocks.amax(-1), blocks.amin(-1)
    bad = (hi - lo > FOLD_SPREAD) | (hi < 7) | (hi > 243)
    return not bool(bad.any())


def fold_reference(weight: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """What the folded kernel multiplies, in torch: MXFP4 [..., N, K/2] + E8M0 [..., N, K/32] -> (E4M3 values
    [..., N, K] in K order, fp32 block scales [..., N, K/128]) with values * block scale == the dequantized
    weights exactly when `fold_exact(scale)`."""
    s = scale.view(torch.uint8).to(torch.int32)
    blocks = s.reshape(*s.shape[:-1], -1, FOLD_BLOCK // MXFP4_GROUP)
    hi = blocks.amax(-1)
    shift = (blocks - hi[..., None]).reshape(s.shape).repeat_interleave(MXFP4_GROUP, -1)      # <= 0, per value
    vals = formats.unpack_e2m1(weight.view(torch.uint8)) * torch.exp2((shift + 6).float())
    return vals.to(torch.float8_e4m3fn), torch.exp2((hi - 133).float())


def w4a8_order(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] -> the K order the folded kernel reads activations in: within every 128, the values k with
    k % 8 < 4 first (in order), then those with k % 8 >= 4 (`quantize_activations(..., w4a8_order=True)`
    writes its FP8 rows so)."""
    lead = x.shape[:-1]
    y = x.reshape(*lead, -1, FOLD_BLOCK // 8, 2, 4)
    return y.transpose(-3, -2).reshape(x.shape)


@triton.jit
def _fold_codes(codes, d8):
    """E2M1 codes (int32, 0..15) and their group's folded exponent offset d8 = ((s - smax + 12) << 3) -> the
    E4M3 byte of code * 2^(s - smax + 6): 0 stays (signed) zero, 0.5 becomes 2^(s - smax + 5) (a normal E4M3,
    exponent field s - smax + 12), and 1.0 .. 6.0 add their E2M1 exponent and mantissa bit. The plain-Triton
    form of `_fold_asm` (the interpreter's, and the GPU tests' reference for it)."""
    x = codes & 7
    mag = tl.where(x >= 2, ((x >> 1) << 3) + ((x & 1) << 2) + d8, d8)
    return (tl.where(x == 0, 0, mag) | ((codes & 8) << 4)).to(tl.uint8)


@triton.jit
def _fold_asm(packed, d8):
    """`_fold_codes` on 4 packed bytes (8 codes) per 32-bit register, in ~13 instructions: a byte permute
    (`prmt`) looks the 3 magnitude bits of 4 codes at once up in an 8-entry table of E4M3 bytes built from
    the group's exponent offset; a second `prmt` in sign-replicate mode spreads the 4 sign bits; one `lop3`
    joins them. Out: two uint8 tensors of packed's shape; in each 4 bytes, the first holds codes 0-3 of the
    8, the second codes 4-7 (the activations are read in the same order: `w4a8_order`)."""
    return tl.inline_asm_elementwise(
        asm="""
        {
        .reg .b32 lut_lo, lut_hi, sel_a, sel_b, mag_a, mag_b, r4, sgn_a, sgn_b;
        and.b32 lut_lo, $3, 0xFFFFFF00;
        add.u32 lut_lo, lut_lo, 0x0C080000;
        add.u32 lut_hi, $3, 0x1C181410;
        and.b32 sel_a, $2, 0x7777;
        shr.u32 sel_b, $2, 16;
        and.b32 sel_b, sel_b, 0x7777;
        prmt.b32 mag_a, lut_lo, lut_hi, sel_a;
        prmt.b32 mag_b, lut_lo, lut_hi, sel_b;
        shl.b32 r4, $2, 4;
        prmt.b32 sgn_a, r4, $2, 0xD9C8;
        prmt.b32 sgn_b, r4, $2, 0xFBEA;
        lop3.b32 $0, mag_a, sgn_a, 0x80808080, 0xF8;
        lop3.b32 $1, mag_b, sgn_b, 0x80808080, 0xF8;
        }
        """,
        constraints="=r,=r,r,r", args=[packed, d8], dtype=(tl.uint8, tl.uint8), is_pure=True, pack=4)


@triton.jit
def _folded_w4a8_kernel(a_ptr, as_ptr, offs_ptr, w_ptr, s_ptr, out_ptr, N, K, E,
                        stride_am, stride_asm, stride_we, stride_wn, stride_se, stride_sn, stride_om,
                        E_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SWAP_AB: tl.constexpr,
                        USE_ASM: tl.constexpr):
    """Program (t, j): row tile t over all experts x output columns [j * BLOCK_N, (j + 1) * BLOCK_N).

    a [M, K] e4m3 in `w4a8_order`, as [M, K/128] fp32; w [E, N, K/2] packed E2M1, s [E, N, K/32] E8M0; K a
    multiple of 128. Per 128 of K: the weight tile's 64 bytes per row decode into two [BLOCK_N, 64] E4M3
    halves (codes k % 8 < 4 and >= 4), two wgmmas accumulate their products with the matching activation
    halves, and the block's sum is promoted: acc += part * a_scale[row] * 2^(smax[col] - 133).
    SWAP_AB: the product taken transposed (the decoded weights are the MMA's A operand, straight from
    registers; the rows its N side) and stored transposed. USE_ASM: decode by `_fold_asm`, else `_fold_codes`."""
    t = tl.program_id(0)
    pid_n = tl.program_id(1)
    e, rm, m_mask, total = _expert_row_tile(offs_ptr, t, E, E_PAD, BLOCK_M)
    if t >= total:
        return
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rn < N
    HALF: tl.constexpr = 64
    GROUPS: tl.constexpr = 4                                   # 32-groups per 128 of K
    kh = tl.arange(0, HALF)
    a_rows = a_ptr + rm.to(tl.int64)[:, None] * stride_am
    as_rows = as_ptr + rm.to(tl.int64) * stride_asm
    w_rows = w_ptr + e.to(tl.int64) * stride_we + rn.to(tl.int64)[:, None] * stride_wn
    s_rows = s_ptr + e.to(tl.int64) * stride_se + rn.to(tl.int64)[:, None] * stride_sn
    if not USE_ASM:                                           # each half's codes: k = 8 (c // 4) + c % 4 (+ 4)
        byte = 4 * (kh // 4) + (kh % 4) // 2
        nib = 4 * (kh % 2)
    acc = tl.zeros((BLOCK_N, BLOCK_M) if SWAP_AB else (BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, 128):
        a1 = tl.load(a_rows + (k0 + kh)[None, :], mask=m_mask[:, None], other=0.0)
        a2 = tl.load(a_rows + (k0 + HALF + kh)[None, :], mask=m_mask[:, None], other=0.0)
        sc = tl.load(s_rows + (k0 // 32 + tl.arange(0, GROUPS))[None, :], mask=n_mask[:, None], other=127)
        sc = sc.to(tl.int32)
        smax = tl.max(sc, axis=1)
        d8 = (sc - smax[:, None] + 12) << 3                                    # [BLOCK_N, 4]
        d8 = tl.reshape(tl.broadcast_to(d8[:, :, None], (BLOCK_N, GROUPS, HALF // GROUPS)), (BLOCK_N, HALF))
        if USE_ASM:
            packed = tl.load(w_rows + (k0 // 2 + kh)[None, :], mask=n_mask[:, None], other=0)
            w1, w2 = _fold_asm(packed, d8.to(tl.uint8))
        else:
            p1 = tl.load(w_rows + (k0 // 2 + byte)[None, :], mask=n_mask[:, None], other=0).to(tl.int32)
            p2 = tl.load(w_rows + (k0 // 2 + byte + 2)[None, :], mask=n_mask[:, None], other=0).to(tl.int32)
            w1 = _fold_codes((p1 >> nib[None, :]) & 15, d8)
            w2 = _fold_codes((p2 >> nib[None, :]) & 15, d8)
        w1 = w1.to(tl.float8e4nv, bitcast=True)
        w2 = w2.to(tl.float8e4nv, bitcast=True)
        a_scale = tl.load(as_rows + k0 // 128, mask=m_mask, other=0.0)
        w_scale = ((smax - 6) << 23).to(tl.float32, bitcast=True)              # 2^(smax - 133)
        if SWAP_AB:
            part = tl.dot(w1, tl.trans(a1))
            part = tl.dot(w2, tl.trans(a2), part)
            acc += part * (w_scale[:, None] * a_scale[None, :])
        else:
            part = tl.dot(a1, tl.trans(w1))
            part = tl.dot(a2, tl.trans(w2), part)
            acc += part * (a_scale[:, None] * w_scale[None, :])
    _store_rows(out_ptr, acc, rm, rn, m_mask, n_mask, stride_om, SWAP_AB)


@dataclass(frozen=True)
class FoldedConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    swap_ab: bool = False
    use_asm: bool = True


def folded_config(m: int, n: int, e: int) -> FoldedConfig:
    """Tiles by rows per expert hit (M / experts hit, as `grouped_config`). From the H200 sweep at V4-Flash's shapes
    (gpu_expert_gemm.py --sweep, 2026-12-03): up to 32 rows per expert the transposed product on 64-column weight
    tiles (the decoded weights the wgmma's A operand, the few rows its N side), 4 warps, 4 stages: 1.5-1.9x the
    W4A16 kernel; from 64 rows on, 64 x 128 tiles, 4 warps, 3 stages (317-329 TFLOP/s at 8K tokens, where
    128-row tiles with 8 warps gave 157-180)."""
    hit = max(1, min(e, m))
    bm = min(64, max(16, triton.next_power_of_2(triton.cdiv(m, hit))))
    if bm <= 32:
        return FoldedConfig(bm, 64, 4, 4, swap_ab=True)
    return FoldedConfig(bm, 128, 4, 3)


def grouped_gemm_w4a8_folded_quantized(a: torch.Tensor, a_scale: torch.Tensor, offs: torch.Tensor,
                                       weight: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype,
                                       cfg: FoldedConfig | None = None) -> torch.Tensor:
    """The folded GEMM on rows already quantized per 1 x 128 and laid out in `w4a8_order`: a [M, K]
    float8_e4m3fn, a_scale [M, K/128] fp32, MXFP4 experts [E, N, K/2] + [E, N, K/32] whose scales
    `fold_exact` accepts -> [M, N] out_dtype."""
    m, k = a.shape
    e, n = weight.shape[:2]
    if k % FOLD_BLOCK:
        raise ValueError(f"the folded W4A8 kernel needs K ({k}) a multiple of {FOLD_BLOCK}")
    cfg = cfg or folded_config(m, n, e)
    out = torch.empty(m, n, dtype=out_dtype, device=a.device)
    if m == 0:
        return out
    w, s = weight.view(torch.uint8), scale.view(torch.uint8)
    grid = (triton.cdiv(m, cfg.block_m) + min(e, m), triton.cdiv(n, cfg.block_n))
    _folded_w4a8_kernel[grid](
        a, a_scale, offs, w, s, out, n, k, e, a.stride(0), a_scale.stride(0), w.stride(0), w.stride(1), s.stride(0),
        s.stride(1), out.stride(0), E_PAD=triton.next_power_of_2(e), BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        SWAP_AB=cfg.swap_ab, USE_ASM=cfg.use_asm, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out


def grouped_gemm_w4a8_folded(rows: torch.Tensor, offs: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                             cfg: FoldedConfig | None = None) -> torch.Tensor:
    """rows [M, K] (bf16, sorted by expert) -> [M, N]: `reference.grouped_gemm_a8` with 1 x 128 activation
    groups, through the folded kernel (the caller has checked `fold_exact(scale)`)."""
    a, a_scale = quantize_activations(rows, FOLD_BLOCK, w4a8_order=True)
    return grouped_gemm_w4a8_folded_quantized(a, a_scale, offs, weight, scale, rows.dtype, cfg)


@dataclass(frozen=True)
class W4A8Config:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def w4a8_config(m: int, n: int, e: int, act_block: int) -> W4A8Config:
    """Tiles: BLOCK_M covers the rows an expert typically gets (M / experts hit, as `grouped_config`), up to
    128 at prefill; 128-wide column tiles; K steps of 128 (V4: one activation group per step)."""
    hit = max(1, min(e, m))
    bm = min(128, max(16, triton.next_power_of_2(triton.cdiv(m, hit))))
    return W4A8Config(bm, 128, 128 if act_block in (32, 128) else act_block, 8 if bm == 128 else 4, 3)


def grouped_gemm_w4a8_quantized(a: torch.Tensor, a_scale: torch.Tensor, offs: torch.Tensor, weight: torch.Tensor,
                                scale: torch.Tensor, act_block: int, out_dtype: torch.dtype,
                                cfg: W4A8Config | None = None) -> torch.Tensor:
    """The GEMM on already-quantized rows: a [M, K] float8_e4m3fn, a_scale [M, ceil(K / act_block)] fp32
    (`formats.quantize_activations`' output), MXFP4 experts [E, N, K/2] + [E, N, K/32] -> [M, N] out_dtype."""
    m, k = a.shape
    e, n = weight.shape[:2]
    if k % MXFP4_GROUP or act_block % MXFP4_GROUP:
        raise ValueError(f"W4A8 needs K ({k}) and the activation group ({act_block}) multiples of {MXFP4_GROUP}")
    cfg = cfg or w4a8_config(m, n, e, act_block)
    if cfg.block_k % MXFP4_GROUP or act_block not in (MXFP4_GROUP, cfg.block_k):
        raise ValueError(f"W4A8 tile K {cfg.block_k} must equal the activation group {act_block} or step 32-groups "
                         f"of it")
    out = torch.empty(m, n, dtype=out_dtype, device=a.device)
    if m == 0:
        return out
    w, s = weight.view(torch.uint8), scale.view(torch.uint8)
    grid = (triton.cdiv(m, cfg.block_m) + min(e, m), triton.cdiv(n, cfg.block_n))
    _grouped_w4a8_kernel[grid](
        a, a_scale, offs, w, s, out, n, k, e, a.stride(0), a_scale.stride(0), w.stride(0), w.stride(1), s.stride(0),
        s.stride(1), out.stride(0), ACT_BLOCK=act_block, E_PAD=triton.next_power_of_2(e), BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return out


def grouped_gemm_w4a8(rows: torch.Tensor, offs: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                      act_block: int, cfg: W4A8Config | None = None) -> torch.Tensor:
    """rows [M, K] (bf16, sorted by expert), offs [E] int32 -> [M, N]: `reference.grouped_gemm_a8` for MXFP4."""
    a, a_scale = quantize_activations(rows, act_block)
    return grouped_gemm_w4a8_quantized(a, a_scale, offs, weight, scale, act_block, rows.dtype, cfg)


def grouped_gemm_a8(rows: torch.Tensor, offs: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, fmt: str,
                    block: int, host_offs=None, w4a8_foldable: bool = False) -> torch.Tensor:
    """`LayerOps.grouped_gemm_a8` on CUDA: rows quantized per token in groups of `block`, then either the W4A8
    kernel, the weight-only kernel on the rounded rows, or the rounded rows times the experts dequantized to bf16
    through torch._grouped_mm (`dequant_gemm`), whichever `kernel_choice` measured faster at this many rows per
    expert (block-FP8 experts, and activation groups that are not whole 32-groups, never take the W4A8 kernel;
    inside a CUDA-graph capture the dequant route runs only if every expert fits its scratch at once, W4A16
    otherwise). `host_offs` (a `device_io.ReadOnce` of `offs`, or None): what the dequant route reads offs through,
    so that calls sharing the offsets read them once. `w4a8_foldable`: the caller checked `fold_exact(scale)`;
    with 1 x 128 groups such experts take `FOLDED_EXPERT_KERNEL_BY_ROWS_PER_EXPERT`, whose W4A8 route is the
    folded kernel (the per-32-group kernel otherwise)."""
    folded = w4a8_foldable and fmt == "mxfp4" and block == FOLD_BLOCK and rows.shape[1] % FOLD_BLOCK == 0
    route = kernel_choice.expert_kernel(rows.shape[0], weight.shape[0], folded)
    if route == "w4a8" and folded:
        return grouped_gemm_w4a8_folded(rows, offs, weight, scale)
    if fmt == "mxfp4" and block % MXFP4_GROUP == 0 and route == "w4a8":
        return grouped_gemm_w4a8(rows, offs, weight, scale, block)
    capturing = rows.is_cuda and torch.cuda.is_current_stream_capturing()
    if route == "bf16_dequant" and (not capturing or dequant_gemm.fits_capture(weight, fmt)):
        return dequant_gemm.grouped_gemm_dequant(quantize_dequantize_activations(rows, block), offs, weight, scale,
                                                 fmt, block, host_offs=host_offs)
    return grouped_gemm(quantize_dequantize_activations(rows, block), offs, weight, scale, fmt, block)
