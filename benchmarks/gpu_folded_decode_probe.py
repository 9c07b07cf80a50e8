"""Where the folded W4A8 expert GEMM's time goes at decode sizes (issue 34): copies of
`triton_w4a8._folded_w4a8_kernel` (the transposed product, V4-Flash's experts) that each change one thing, timed in
CUDA graphs against the production kernel on the same random routing. Not kept in the library: a probe.

MODE 0 = the production math (asserted bit-equal to `grouped_gemm_w4a8_folded_quantized`); 1 = a constant fold offset
(no scale load, no per-word table build: an upper bound, wrong values); 2 = no decode at all (the packed bytes
multiplied as they are: the memory and MMA path alone); 3 = the group scale gathered per packed byte; 4 = two 128-blocks
per loop iteration; 5 = the packed tile loaded as [BN, 4 groups, 16 bytes] with the scale broadcast, then reshaped;
6 = the block's 4 scale bytes as one int32 word per row, the group picked inside the PTX by a per-byte shift;
7 = the same word, the group's byte shifted out in registers; 8 = 6 with the words stored transposed ([E, K/128, N]:
one coalesced load per tile); 9 = 8 with the next block's words loaded one iteration ahead. Modes 3-9 are checked
bit-equal to production.

    python benchmarks/gpu_folded_decode_probe.py [--modes 0,1,2,...] [--out PATH]
"""
import argparse
import datetime
import json
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.gpu_expert_gemm import top6  # noqa: E402
from benchmarks.gpu_quant_kernels import run_header, try_time  # noqa: E402
from openinfer.quantization import triton_w4a8  # noqa: E402
from openinfer.quantization.triton_kernels import _expert_row_tile, _store_rows  # noqa: E402
from openinfer.quantization.triton_w4a8 import _fold_asm  # noqa: E402


@triton.jit
def _fold_asm_word(packed, d8w, shift):
    return tl.inline_asm_elementwise(
        asm="""
        {
        .reg .b32 dd, sh, lut_lo, lut_hi, sel_a, sel_b, mag_a, mag_b, r4, sgn_a, sgn_b;
        and.b32 sh, $7, 0xFF;
        shr.u32 dd, $3, sh;
        prmt.b32 dd, dd, 0, 0x0000;
        and.b32 lut_lo, dd, 0xFFFFFF00;
        add.u32 lut_lo, lut_lo, 0x0C080000;
        add.u32 lut_hi, dd, 0x1C181410;
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
        constraints="=r,=r,r,r,r,r,r,r", args=[packed, d8w, shift], dtype=(tl.uint8, tl.uint8), is_pure=True, pack=4)


@triton.jit
def _k(a_ptr, as_ptr, offs_ptr, w_ptr, s_ptr, out_ptr, N, K, E,
       stride_am, stride_asm, stride_we, stride_wn, stride_se, stride_sn, stride_om, s32_ptr, s32_se, s32_sn,
       E_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MODE: tl.constexpr):
    t = tl.program_id(0)
    pid_n = tl.program_id(1)
    e, rm, m_mask, total = _expert_row_tile(offs_ptr, t, E, E_PAD, BLOCK_M)
    if t >= total:
        return
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = rn < N
    HALF: tl.constexpr = 64
    GROUPS: tl.constexpr = 4
    kh = tl.arange(0, HALF)
    a_rows = a_ptr + rm.to(tl.int64)[:, None] * stride_am
    as_rows = as_ptr + rm.to(tl.int64) * stride_asm
    w_rows = w_ptr + e.to(tl.int64) * stride_we + rn.to(tl.int64)[:, None] * stride_wn
    s_rows = s_ptr + e.to(tl.int64) * stride_se + rn.to(tl.int64)[:, None] * stride_sn
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    if MODE == 9:      # mode 8 with the next block's scale words loaded one iteration ahead
        st_rows = s32_ptr + e.to(tl.int64) * s32_se + rn
        sw_next = tl.load(st_rows, mask=n_mask, other=0x7F7F7F7F)
        shift = ((kh // 16) * 8).to(tl.uint8)
        for k0 in range(0, K, 128):
            sw = sw_next
            sw_next = tl.load(st_rows + (k0 // 128 + 1) * s32_sn, mask=n_mask & (k0 + 128 < K), other=0x7F7F7F7F)
            a1 = tl.load(a_rows + (k0 + kh)[None, :], mask=m_mask[:, None], other=0.0)
            a2 = tl.load(a_rows + (k0 + HALF + kh)[None, :], mask=m_mask[:, None], other=0.0)
            packed = tl.load(w_rows + (k0 // 2 + kh)[None, :], mask=n_mask[:, None], other=0)
            b0 = sw & 0xFF
            b1 = (sw >> 8) & 0xFF
            b2 = (sw >> 16) & 0xFF
            b3 = (sw >> 24) & 0xFF
            smax = tl.maximum(tl.maximum(b0, b1), tl.maximum(b2, b3))
            d8w = (((b0 - smax + 12) << 3) | (((b1 - smax + 12) << 3) << 8) | (((b2 - smax + 12) << 3) << 16)
                   | (((b3 - smax + 12) << 3) << 24))
            w1, w2 = _fold_asm_word(packed, tl.broadcast_to(d8w[:, None], (BLOCK_N, HALF)),
                                    tl.broadcast_to(shift[None, :], (BLOCK_N, HALF)))
            w_scale = ((smax - 6) << 23).to(tl.float32, bitcast=True)
            w1 = w1.to(tl.float8e4nv, bitcast=True)
            w2 = w2.to(tl.float8e4nv, bitcast=True)
            a_scale = tl.load(as_rows + k0 // 128, mask=m_mask, other=0.0)
            part = tl.dot(w1, tl.trans(a1))
            part = tl.dot(w2, tl.trans(a2), part)
            acc += part * (w_scale[:, None] * a_scale[None, :])
        _store_rows(out_ptr, acc, rm, rn, m_mask, n_mask, stride_om, True)
        return
    if MODE == 4:      # production math, two 128-blocks per loop iteration
        for k00 in range(0, K, 256):
            for u in tl.static_range(2):
                k0 = k00 + u * 128
                a1 = tl.load(a_rows + (k0 + kh)[None, :], mask=m_mask[:, None], other=0.0)
                a2 = tl.load(a_rows + (k0 + HALF + kh)[None, :], mask=m_mask[:, None], other=0.0)
                packed = tl.load(w_rows + (k0 // 2 + kh)[None, :], mask=n_mask[:, None], other=0)
                sc = tl.load(s_rows + (k0 // 32 + tl.arange(0, GROUPS))[None, :], mask=n_mask[:, None], other=127)
                sc = sc.to(tl.int32)
                smax = tl.max(sc, axis=1)
                d8 = (sc - smax[:, None] + 12) << 3
                d8 = tl.reshape(tl.broadcast_to(d8[:, :, None], (BLOCK_N, GROUPS, HALF // GROUPS)), (BLOCK_N, HALF))
                w1, w2 = _fold_asm(packed, d8.to(tl.uint8))
                w_scale = ((smax - 6) << 23).to(tl.float32, bitcast=True)
                w1 = w1.to(tl.float8e4nv, bitcast=True)
                w2 = w2.to(tl.float8e4nv, bitcast=True)
                a_scale = tl.load(as_rows + k0 // 128, mask=m_mask, other=0.0)
                part = tl.dot(w1, tl.trans(a1))
                part = tl.dot(w2, tl.trans(a2), part)
                acc += part * (w_scale[:, None] * a_scale[None, :])
        _store_rows(out_ptr, acc, rm, rn, m_mask, n_mask, stride_om, True)
        return
    for k0 in range(0, K, 128):
        a1 = tl.load(a_rows + (k0 + kh)[None, :], mask=m_mask[:, None], other=0.0)
        a2 = tl.load(a_rows + (k0 + HALF + kh)[None, :], mask=m_mask[:, None], other=0.0)
        packed = tl.load(w_rows + (k0 // 2 + kh)[None, :], mask=n_mask[:, None], other=0)
        if MODE == 0:      # production
            sc = tl.load(s_rows + (k0 // 32 + tl.arange(0, GROUPS))[None, :], mask=n_mask[:, None], other=127)
            sc = sc.to(tl.int32)
            smax = tl.max(sc, axis=1)
            d8 = (sc - smax[:, None] + 12) << 3
            d8 = tl.reshape(tl.broadcast_to(d8[:, :, None], (BLOCK_N, GROUPS, HALF // GROUPS)), (BLOCK_N, HALF))
            w1, w2 = _fold_asm(packed, d8.to(tl.uint8))
            w_scale = ((smax - 6) << 23).to(tl.float32, bitcast=True)
        elif MODE == 1:    # constant fold offset: no scale load or broadcast
            w1, w2 = _fold_asm(packed, tl.full((BLOCK_N, HALF), 96, tl.uint8))
            w_scale = tl.full((BLOCK_N,), 1.0, tl.float32)
        elif MODE == 2:    # no decode at all
            w1 = packed
            w2 = packed
            w_scale = tl.full((BLOCK_N,), 1.0, tl.float32)
        elif MODE == 6 or MODE == 7 or MODE == 8:    # the 4 scales of the block as one int32 word per row
            if MODE == 8:    # words transposed [E, K/128, N]: a tile's words one coalesced load
                sw = tl.load(s32_ptr + e.to(tl.int64) * s32_se + (k0 // 128) * s32_sn + rn, mask=n_mask,
                             other=0x7F7F7F7F)
            else:
                sw = tl.load(s32_ptr + e.to(tl.int64) * s32_se + rn.to(tl.int64) * s32_sn + k0 // 128, mask=n_mask,
                             other=0x7F7F7F7F)
            b0 = sw & 0xFF
            b1 = (sw >> 8) & 0xFF
            b2 = (sw >> 16) & 0xFF
            b3 = (sw >> 24) & 0xFF
            smax = tl.maximum(tl.maximum(b0, b1), tl.maximum(b2, b3))
            d8w = (((b0 - smax + 12) << 3) | (((b1 - smax + 12) << 3) << 8) | (((b2 - smax + 12) << 3) << 16)
                   | (((b3 - smax + 12) << 3) << 24))
            shift = ((kh // 16) * 8).to(tl.uint8)
            if MODE == 6 or MODE == 8:
                w1, w2 = _fold_asm_word(packed, tl.broadcast_to(d8w[:, None], (BLOCK_N, HALF)),
                                        tl.broadcast_to(shift[None, :], (BLOCK_N, HALF)))
            else:
                d8 = ((d8w[:, None] >> shift.to(tl.int32)[None, :]) & 0xFF).to(tl.uint8)
                w1, w2 = _fold_asm(packed, d8)
            w_scale = ((smax - 6) << 23).to(tl.float32, bitcast=True)
        elif MODE == 5:    # the packed tile loaded as [BN, 4 groups, 16 bytes]: the scale broadcast, no reshape
            g4 = tl.arange(0, GROUPS)
            j16 = tl.arange(0, 16)
            w3 = (w_ptr + e.to(tl.int64) * stride_we + rn.to(tl.int64)[:, None, None] * stride_wn
                  + (k0 // 2 + g4[None, :, None] * 16 + j16[None, None, :]))
            packed3 = tl.load(w3, mask=n_mask[:, None, None], other=0)
            sc = tl.load(s_rows + (k0 // 32 + g4)[None, :], mask=n_mask[:, None], other=127).to(tl.int32)
            smax = tl.max(sc, axis=1)
            d8 = ((sc - smax[:, None] + 12) << 3).to(tl.uint8)
            w1, w2 = _fold_asm(packed3, tl.broadcast_to(d8[:, :, None], (BLOCK_N, GROUPS, 16)))
            w1 = tl.reshape(w1, (BLOCK_N, HALF))
            w2 = tl.reshape(w2, (BLOCK_N, HALF))
            w_scale = ((smax - 6) << 23).to(tl.float32, bitcast=True)
        else:              # MODE 3: scale gathered straight into the packed layout
            sc = tl.load(s_rows + (k0 // 32 + tl.arange(0, GROUPS))[None, :], mask=n_mask[:, None], other=127)
            smax = tl.max(sc.to(tl.int32), axis=1)
            scb = tl.load(s_rows + (k0 // 32 + kh // 16)[None, :], mask=n_mask[:, None], other=127).to(tl.int32)
            d8 = (scb - smax[:, None] + 12) << 3
            w1, w2 = _fold_asm(packed, d8.to(tl.uint8))
            w_scale = ((smax - 6) << 23).to(tl.float32, bitcast=True)
        w1 = w1.to(tl.float8e4nv, bitcast=True)
        w2 = w2.to(tl.float8e4nv, bitcast=True)
        a_scale = tl.load(as_rows + k0 // 128, mask=m_mask, other=0.0)
        part = tl.dot(w1, tl.trans(a1))
        part = tl.dot(w2, tl.trans(a2), part)
        acc += part * (w_scale[:, None] * a_scale[None, :])
    _store_rows(out_ptr, acc, rm, rn, m_mask, n_mask, stride_om, True)


_TRANSPOSED_WORDS = {}     # scale tensor -> its int32 words transposed (modes 8, 9), made once per tensor


def run(a, a_scale, offs, w, s, mode, bm, bn, warps, stages):
    m, k = a.shape
    e, n = w.shape[:2]
    out = torch.empty(m, n, dtype=torch.bfloat16, device=a.device)
    w8, s8 = w.view(torch.uint8), s.view(torch.uint8)
    s32 = s8.view(torch.int32)
    if mode in (8, 9):
        key = s.data_ptr()
        if key not in _TRANSPOSED_WORDS:
            _TRANSPOSED_WORDS[key] = s32.transpose(1, 2).contiguous()
        s32 = _TRANSPOSED_WORDS[key]
    grid = (triton.cdiv(m, bm) + min(e, m), triton.cdiv(n, bn))
    _k[grid](a, a_scale, offs, w8, s8, out, n, k, e, a.stride(0), a_scale.stride(0), w8.stride(0), w8.stride(1),
             s8.stride(0), s8.stride(1), out.stride(0), s32, s32.stride(0), s32.stride(1), E_PAD=triton.next_power_of_2(e), BLOCK_M=bm, BLOCK_N=bn,
             MODE=mode, num_warps=warps, num_stages=stages)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--modes", default="0,1,2,3,4,5,6,7,8,9")
    ap.add_argument("--tiles", default="64x4x4,64x4x6", help="BLOCK_N x warps x stages, comma-separated")
    ap.add_argument("--out", default="benchmarks/results/gpu_folded_decode_probe.json")
    args = ap.parse_args()
    modes = [int(m) for m in args.modes.split(",")]
    tiles = [tuple(int(v) for v in t.split("x")) for t in args.tiles.split(",")]
    result = run_header(datetime.date.today().isoformat())
    result["rows"] = rows = []
    gen = torch.Generator(device="cuda").manual_seed(0)
    e_count, hidden, inter = 256, 4096, 2048          # V4-Flash's routed experts
    for proj, (n, k) in (("gate_up", (2 * inter, hidden)), ("down", (hidden, inter))):
        w = torch.randint(0, 256, (e_count, n, k // 2), generator=gen, device="cuda", dtype=torch.uint8)
        s = torch.randint(118, 125, (e_count, n, k // 32), generator=gen, device="cuda",
                          dtype=torch.uint8).view(torch.float8_e8m0fnu)
        per_expert = n * k // 2 + n * k // 32
        for tokens in (1, 32, 128):
            m = tokens * 6
            offs = [top6(tokens, e_count, gen, m) for _ in range(8)]
            xs = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _ in offs]
            q = [triton_w4a8.quantize_activations(x, 128, w4a8_order=True) for x in xs]
            hit = sum(int((torch.diff(o, prepend=o.new_zeros(1)) > 0).sum()) for o in offs) / len(offs)
            gb = hit * per_expert / 1e9
            prod = triton_w4a8.grouped_gemm_w4a8_folded_quantized(q[0][0], q[0][1], offs[0], w, s, torch.bfloat16)
            row = dict(proj=proj, tokens=tokens, experts_hit=hit, GB=gb)
            for mode in modes:
                if mode not in (1, 2):
                    row[f"mode{mode}_equals_production"] = bool(torch.equal(
                        run(q[0][0], q[0][1], offs[0], w, s, mode, 16, 64, 4, 4), prod))
                for bn, warps, stages in tiles:
                    t = try_time([lambda qq=qq, o=o: run(qq[0], qq[1], o, w, s, mode, 16, bn, warps, stages)
                                  for qq, o in zip(q, offs)])
                    row[f"m{mode}_bn{bn}_w{warps}_s{stages}"] = (
                        dict(us=round(t * 1e6, 1), GBps=round(gb / t, 0)) if isinstance(t, float) else t)
            print(json.dumps(row), flush=True)
            rows.append(row)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    json.dump(result, open(args.out, "w"), indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
