"""DeepSeek's quantized GEMMs at prefill sizes on one GPU, against bf16, in one run (issue 35, items 2-3):

 - the ceilings first: a bf16 and an FP8 (tensorwise torch._scaled_mm) 8192^3 matrix product;
 - the routed-expert grouped GEMM, MXFP4 weights, top-6 routing of T tokens (T = 1 .. 32K: decode to prefill;
   rows M = 6T), both projections (gate_up N = 2I, K = H; down N = H, K = I) of V4-Flash (256 experts, H 4096,
   I 2048, activations 1 x 128) and V4.1-Flash (384 experts, H 5120, I 2304, activations 1 x 32): the two routes
   `LayerOps.grouped_gemm_a8` chooses between ("w4a16": rows rounded to FP8 values by one kernel, then the
   weight-only W4A16 kernel; "w4a8": the activation quantization kernel, then the FP8 tensor-core GEMM;
   "bf16_dequant": rows rounded, the experts with rows dequantized to bf16 in chunks of at most 1 GiB, then
   torch._grouped_mm per chunk, quantization/dequant_gemm.py), the W4A16 kernel alone, and bf16
   torch._grouped_mm on experts dequantized beforehand (the ceiling: no dequant in the time);
 - V4.1's FP8 linears with 32 x 32 blocks at its shapes, M = 1 .. 16K: the two routes of `fp8_linear` ("fp8":
   the W8A8 Triton kernel; "bf16": activations rounded by one kernel, then weight tiles dequantized to bf16
   inside a bf16 GEMM; "bf16_dequant": activations rounded, the whole weight dequantized to a bf16 buffer, then
   F.linear), the bf16-core kernel alone (W8A16), and bf16 F.linear on a weight dequantized beforehand.
Throughput is TFLOP/s dense-equivalent (2 M N K over the time). Every time is the median of CUDA-event-timed
replays of a CUDA graph holding one call per input copy, with enough copies (weights, routings) that the weights
read exceed the L2 (benchmarks/gpu_quant_kernels.py's method). The expert "bf16_dequant" route reads the routing on
the host, which a graph would freeze (captured, it takes another path), so it is timed eagerly: CUDA events around
the same calls run in sequence, its host sync and launch gaps included (a graph hides the others' launch costs:
small against the milliseconds of prefill sizes, not against decode's microseconds). Last, the tables for openinfer/quantization/kernel_choice.py that these times give
(`recommended_tables` in the JSON): the fastest route at each measured size, summed over the shapes of a layer,
from the size where it starts winning.

    python benchmarks/gpu_expert_gemm.py [--out PATH] [--only experts|fp8] [--sweep] [--max-tokens N]
    python benchmarks/gpu_expert_gemm.py --quick     # ~2 min on an H200: V4.1 shapes, M = 64 .. 16384 rows

--quick times V4.1-Flash only (its FP8 32 x 32 linears, and its routed experts at M routed rows, top-6 routing of
ceil(M / 6) tokens cut to M rows), the routes and the bf16 ceilings, M in QUICK_MS, no kernel-only peers, 20 graph
replays per time instead of 50.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import sys
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks import gpu_quant_kernels  # noqa: E402
from benchmarks.gpu_quant_kernels import Saved, copies_for, graph_time, run_header, try_time  # noqa: E402
from openinfer.quantization import dequant_gemm, formats, kernel_choice  # noqa: E402
from openinfer.quantization import triton_kernels as tk  # noqa: E402
from openinfer.quantization import triton_w4a8  # noqa: E402

# (experts, hidden, moe intermediate, activation group = the checkpoint's FP8 block); top-6 in both
EXPERT_MODELS = {"v4_flash": (256, 4096, 2048, 128), "v41_flash": (384, 5120, 2304, 32)}
TOKENS = [1, 8, 32, 128, 512, 1024, 2048, 4096, 8192, 16384, 32768]
TOP_K = 6
# V4.1-Flash's FP8 linears (N, K), from /work/shared/reference/deepseek_v41/config.json: wq_a dim -> q_lora_rank,
# wq_b q_lora_rank -> heads x head_dim, wkv dim -> head_dim, wo_b o_groups x o_lora_rank -> dim, the shared expert,
# the indexer's wq_b q_lora_rank -> index heads x index head_dim
V41_FP8_SHAPES = {"wq_a": (1280, 5120), "wq_b": (32768, 1280), "wkv": (512, 5120), "wo_b": (5120, 8192),
                  "shared_w1": (2304, 5120), "shared_w2": (5120, 2304), "index_wq_b": (4096, 1280)}
FP8_MS = [1, 16, 64, 256, 1024, 2048, 4096, 8192, 16384]
QUICK_MS = [64, 256, 1024, 4096, 16384]
SWEEP_TOKENS = {128, 4096}
SWEEP_MS = {1024, 4096}


def ceilings() -> dict:
    """TFLOP/s of an 8192^3 bf16 matrix product and of the same in FP8 (tensorwise scales): the matrix units'
    measured rates on this device."""
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    out = {"bf16_mm_TFLOPs": 2 * n ** 3 / graph_time([lambda: a @ b.t()]) / 1e12}
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn)
    one = torch.ones((), device="cuda")
    t = try_time([lambda: torch._scaled_mm(a8, b8.t(), one, one, out_dtype=torch.bfloat16)])
    out["fp8_scaled_mm_TFLOPs"] = 2 * n ** 3 / t / 1e12 if isinstance(t, float) else t
    return out


def tflops(flops: float, t) -> float | str:
    return flops / t / 1e12 if isinstance(t, float) else t


def eager_time(calls: list, reps: int = 7) -> float | str:
    """Seconds per call, run eagerly (for routes that sync with the host): median over `reps` runs of `calls` in
    sequence between two CUDA events."""
    try:
        for c in calls:
            c()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(reps):
            start.record()
            for c in calls:
                c()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        return sorted(times)[len(times) // 2] / len(calls)
    except Exception as e:                                 # a route that does not run on this shape
        return f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"


# ---- routed experts -----------------------------------------------------------------------------------
def top6(tokens: int, experts: int, gen: torch.Generator, rows: int | None = None) -> torch.Tensor:
    """offs [E] int32 of a random top-6 routing of `tokens` (distinct experts per token), cut to the first
    `rows` routed rows when given."""
    idx = torch.rand(tokens, experts, generator=gen, device="cuda").argsort(-1)[:, :TOP_K].flatten()[:rows]
    return torch.bincount(idx, minlength=experts).cumsum(0).to(torch.int32)


def random_mxfp4(e: int, n: int, k: int, gen: torch.Generator):
    """Random E2M1 codes, scales near a 0.02-std init (quantizing hundreds of full-width experts from floats
    would take far more memory), and the bf16 dequantized copy for the bf16 peer."""
    w = torch.randint(0, 256, (e, n, k // 2), generator=gen, device="cuda", dtype=torch.uint8)
    s = torch.randint(118, 125, (e, n, k // 32), generator=gen, device="cuda", dtype=torch.uint8)
    s = s.view(torch.float8_e8m0fnu)
    dense = torch.empty(e, n, k, dtype=torch.bfloat16, device="cuda")
    for i in range(e):
        dense[i] = formats.dequantize_mxfp4(w[i], s[i])
    return w, s, dense


EAGER_ROUTES = {"bf16_dequant", "bf16_dequant_4g"}        # timed by eager_time, the rest in CUDA graphs


def expert_variants(w, s, dense, act_block, quick: bool = False):
    """name -> call(rows, offs): the routes and peers timed for the expert GEMM."""
    dt = dense.transpose(1, 2)
    out = {
        "w4a8": lambda x, o: w4a8_route(x, o, w, s, act_block),
        "w4a8_per32": lambda x, o: triton_w4a8.grouped_gemm_w4a8(x, o, w, s, act_block),
        "w4a16": lambda x, o: tk.grouped_gemm(tk.quantize_dequantize_activations(x, act_block), o, w, s, "mxfp4",
                                              act_block),
        "bf16_dequant": lambda x, o: dequant_gemm.grouped_gemm_dequant(
            tk.quantize_dequantize_activations(x, act_block), o, w, s, "mxfp4", act_block),
        "bf16_dequant_4g": lambda x, o: dequant_gemm.grouped_gemm_dequant(
            tk.quantize_dequantize_activations(x, act_block), o, w, s, "mxfp4", act_block, 4 << 30),
        "w4a16_kernel_only": lambda x, o: tk.grouped_gemm(x, o, w, s, "mxfp4", act_block),
        "bf16_grouped_mm": lambda x, o: torch._grouped_mm(x, dt, offs=o),
    }
    if quick:
        del out["w4a16_kernel_only"], out["bf16_dequant_4g"], out["w4a8_per32"]
    return out


def w4a8_route(x, o, w, s, act_block):
    """The W4A8 route as the dispatcher takes it: the folded kernel for 1 x 128 activation groups (these random
    scales span 7 binades, so `fold_exact` holds), the per-32-group kernel otherwise."""
    if act_block == triton_w4a8.FOLD_BLOCK:
        return triton_w4a8.grouped_gemm_w4a8_folded(x, o, w, s)
    return triton_w4a8.grouped_gemm_w4a8(x, o, w, s, act_block)


def bench_experts(models: list[str], max_tokens: int, sweep: bool, rows_out, quick: bool = False,
                  tokens_list: list[int] | None = None, keep: set[str] | None = None) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    for model in models:
        e, h, inter, act_block = EXPERT_MODELS[model]
        for proj, (n, k) in (("gate_up", (2 * inter, h)), ("down", (h, inter))):
            w, s, dense = random_mxfp4(e, n, k, gen)
            per_expert = n * k // 2 + n * k // 32
            # the dequant kernel alone: every expert to bf16 (stored bytes read + bf16 written, over the time)
            t = try_time([lambda: dequant_gemm.dequantize_to_bf16(w, s, "mxfp4", act_block, out=dense)])
            if isinstance(t, float):
                gbps = (e * per_expert + dense.numel() * 2) / t / 1e9
                rows_out.append(dict(op="mxfp4_dequant", model=model, proj=proj, N=n, K=k, experts=e, us=t * 1e6,
                                     GBps=gbps))
                print(f"{model:9s} {proj:7s} dequant of {e} experts: {t * 1e6:.0f} us, {gbps:.0f} GB/s")
            variants = {name: fn for name, fn in expert_variants(w, s, dense, act_block, quick).items()
                        if keep is None or name in keep}
            sizes = ([(-(-m // TOP_K), m) for m in QUICK_MS] if quick
                     else [(t, t * TOP_K) for t in (tokens_list or TOKENS) if t <= max_tokens])
            for tokens, m in sizes:
                copies = copies_for(per_expert * min(e, m))
                offs = [top6(tokens, e, gen, m) for _ in range(copies)]
                xs = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _ in offs]
                flops = 2 * m * n * k
                row = dict(op="expert_gemm", model=model, proj=proj, N=n, K=k, experts=e, act_block=act_block,
                           tokens=tokens, M=m, w4a8_config=(triton_w4a8.folded_config(m, n, e).__dict__
                                                            if act_block == triton_w4a8.FOLD_BLOCK else
                                                            triton_w4a8.w4a8_config(m, n, e, act_block).__dict__),
                           w4a16_config=tk.grouped_config(m, n, k, e, "mxfp4", act_block).__dict__,
                           route_now=kernel_choice.expert_kernel(m, e))
                for name, fn in variants.items():
                    timer = eager_time if name in EAGER_ROUTES else try_time
                    t = timer([lambda x=x, o=o, fn=fn: fn(x, o) for x, o in zip(xs, offs)])
                    row[name + "_us"] = t * 1e6 if isinstance(t, float) else t
                    row[name + "_TFLOPs"] = tflops(flops, t)
                if sweep and tokens in SWEEP_TOKENS:
                    row["w4a8_sweep"] = (sweep_folded(xs, offs, w, s, m, n, e) if act_block == triton_w4a8.FOLD_BLOCK
                                         else sweep_w4a8(xs, offs, w, s, act_block, m, n, e))
                rows_out.append(row)
                print(f"{model:9s} {proj:7s} T={tokens:6d} M={m:6d}: " + "  ".join(
                    f"{v} {fmt_tf(row[v + '_TFLOPs'])}" for v in variants) + f"  (table: {row['route_now']})")
                del xs, offs
            del w, s, dense, variants
            gc.collect()
            torch.cuda.empty_cache()


def sweep_w4a8(xs, offs, w, s, act_block, m, n, e) -> dict:
    out = {}
    base = triton_w4a8.w4a8_config(m, n, e, act_block)
    block_ks = (128,) if act_block == 128 else (64, 128)
    for bm in sorted({base.block_m, 64, 128}):
        for bn in (64, 128, 256):
            for bk in block_ks:
                for warps in (4, 8):
                    for stages in (2, 3, 4):
                        cfg = triton_w4a8.W4A8Config(bm, bn, bk, warps, stages)
                        t = try_time([lambda x=x, o=o: triton_w4a8.grouped_gemm_w4a8(x, o, w, s, act_block, cfg)
                                      for x, o in zip(xs, offs)])
                        out[f"bm{bm}_bn{bn}_bk{bk}_w{warps}_s{stages}"] = t * 1e6 if isinstance(t, float) else t
    best = min((v, c) for c, v in out.items() if isinstance(v, float))
    print(f"    w4a8 sweep best {best[1]}: {best[0]:.1f} us")
    return out


def sweep_folded(xs, offs, w, s, m, n, e) -> dict:
    """The folded W4A8 kernel's tiles around its default (GEMM only: the rows quantized once beforehand)."""
    quantized = [triton_w4a8.quantize_activations(x, 128, w4a8_order=True) for x in xs]
    base = triton_w4a8.folded_config(m, n, e)
    out = {}
    for bm in sorted({base.block_m, max(16, base.block_m // 2), min(128, base.block_m * 2)}):
        for bn in (64, 128, 256):
            for warps in (4, 8):
                for stages in (3, 4):
                    for swap in (False, True):
                        cfg = triton_w4a8.FoldedConfig(bm, bn, warps, stages, swap)
                        t = try_time([lambda q=q, o=o: triton_w4a8.grouped_gemm_w4a8_folded_quantized(
                            q[0], q[1], o, w, s, torch.bfloat16, cfg) for q, o in zip(quantized, offs)])
                        out[f"bm{bm}_bn{bn}_w{warps}_s{stages}{'_swap' if swap else ''}"] = (
                            t * 1e6 if isinstance(t, float) else str(t)[:80])
    best = min((v, c) for c, v in out.items() if isinstance(v, float))
    print(f"    folded sweep best {best[1]}: {best[0]:.1f} us (default {base})")
    return out


# ---- V4.1's FP8 32 x 32 linears -----------------------------------------------------------------------
def fp8_variants(w, s, dense, quick: bool = False):
    def fp8_route(x):
        m, k = x.shape
        return tk.fp8_gemm(x, w, s, 32, tk.fp8_config(m, w.shape[0], k, 32, tk.num_sms(x.device)))

    def bf16_route(x):
        m, k = x.shape
        return tk.fp8_bf16_gemm(tk.quantize_dequantize_activations(x, 32), w, s, 32,
                                tk.fp8_bf16_config(m, w.shape[0], k, 32))

    def bf16_core_only(x):
        m, k = x.shape
        return tk.fp8_bf16_gemm(x, w, s, 32, tk.fp8_bf16_config(m, w.shape[0], k, 32))

    out = {"fp8": fp8_route, "bf16": bf16_route,
           "bf16_dequant": lambda x: dequant_gemm.fp8_linear_dequant(x, w, s, 32),
           "bf16_core_kernel_only": bf16_core_only, "bf16_linear": lambda x: F.linear(x, dense)}
    if quick:
        del out["bf16_core_kernel_only"]
    return out


def bench_fp8(max_m: int, sweep: bool, rows_out, quick: bool = False) -> None:
    for name, (n, k) in V41_FP8_SHAPES.items():
        w, s = formats.quantize_fp8(torch.randn(n, k, device="cuda") * 0.05, 32)
        dense = formats.dequantize_fp8(w, s, 32).to(torch.bfloat16)
        copies = [(w.clone(), s.clone(), dense.clone()) for _ in range(copies_for(w.numel() + s.numel()))]
        per_copy = [fp8_variants(*c, quick=quick) for c in copies]
        for m in [m for m in (QUICK_MS if quick else FP8_MS) if m <= max_m]:
            xs = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _ in copies]
            flops = 2 * m * n * k
            row = dict(op="fp8_linear_b32", shape=name, N=n, K=k, M=m, route_now=kernel_choice.fp8_fine_block_kernel(m),
                       fp8_config=tk.fp8_config(m, n, k, 32, tk.num_sms(torch.device("cuda"))).__dict__,
                       bf16_config=tk.fp8_bf16_config(m, n, k, 32).__dict__)
            for variant in per_copy[0]:
                t = try_time([lambda x=x, f=variants[variant]: f(x) for x, variants in zip(xs, per_copy)])
                row[variant + "_us"] = t * 1e6 if isinstance(t, float) else t
                row[variant + "_TFLOPs"] = tflops(flops, t)
            if sweep and m in SWEEP_MS:
                row["bf16_sweep"] = sweep_fp8_bf16(xs, copies, m, n, k)
            rows_out.append(row)
            print(f"fp8 b32 {name:10s} N={n:6d} K={k:5d} M={m:6d}: " + "  ".join(
                f"{v} {fmt_tf(row[v + '_TFLOPs'])}" for v in per_copy[0])
                + f"  (table: {row['route_now']})")
        del copies, per_copy, dense
        gc.collect()
        torch.cuda.empty_cache()


def sweep_fp8_bf16(xs, copies, m, n, k) -> dict:
    out = {}
    for bm in (64, 128):
        for bn in (128, 256):
            for bk in (32, 64, 128):
                for warps in (4, 8):
                    for stages in (3, 4):
                        cfg = tk.Fp8Bf16Config(bm, bn, bk, warps, stages)
                        t = try_time([lambda x=x, c=c: tk.fp8_bf16_gemm(tk.quantize_dequantize_activations(x, 32),
                                                                        c[0], c[1], 32, cfg)
                                      for x, c in zip(xs, copies)])
                        out[f"bm{bm}_bn{bn}_bk{bk}_w{warps}_s{stages}"] = t * 1e6 if isinstance(t, float) else t
    best = min((v, c) for c, v in out.items() if isinstance(v, float))
    print(f"    bf16-core sweep best {best[1]}: {best[0]:.1f} us")
    return out


# ---- V4's grouped wo_a ------------------------------------------------------------------------------------
# V4-Flash's `wo_a`: o_groups x o_lora_rank rows over num_heads x head_dim / o_groups columns, FP8 128 x 128
WO_A = (8, 1024, 4096, 128)
WO_A_TOKENS = [1, 8, 32, 64, 128, 256, 512, 2048, 8192, 32768]
WO_A_SWEEP_TOKENS = {1, 32, 128}


def bench_wo_a(sweep: bool, rows_out) -> None:
    """The block-diagonal FP8 `wo_a` through `Fp8Linear.forward_groups` by each route: "w8a16" (the grouped Triton
    kernel, a group per "expert"), "bf16_dequant" (dequant_gemm.grouped_linear_dequant), and the peer
    "bf16_bmm_only" (the same batched GEMM on a weight dequantized beforehand: the cuBLAS part alone)."""
    g, rows_per_group, k, block = WO_A
    n = g * rows_per_group
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_bps = 2 * src.numel() / try_time([lambda: dst.copy_(src)])       # bytes read + written per second
    del src, dst
    w, s = formats.quantize_fp8(torch.randn(n, k, device="cuda") * 0.05, block)
    copies = [(w.clone(), s.clone()) for _ in range(copies_for(w.numel() + s.numel()))]
    dense = [dequant_gemm.dequantize_to_bf16(cw, cs, "fp8", block).view(g, rows_per_group, k) for cw, cs in copies]

    def w8a16(x, cw, cs):
        t = x.shape[0]
        rows = x.transpose(0, 1).reshape(g * t, k)
        offs = torch.arange(1, g + 1, dtype=torch.int32, device=x.device) * t
        return tk.grouped_gemm(rows, offs, cw.view(g, rows_per_group, k), cs.view(g, -1, cs.shape[-1]), "fp8", block)

    routes = {"w8a16": w8a16,
              "bf16_dequant": lambda x, cw, cs: dequant_gemm.grouped_linear_dequant(x, cw, cs, block)}
    for tokens in WO_A_TOKENS:
        xs = [torch.randn(tokens, g, k, device="cuda", dtype=torch.bfloat16) for _ in copies]
        ref = w8a16(xs[0], *copies[0]).view(g, tokens, rows_per_group).transpose(0, 1).float()
        got = routes["bf16_dequant"](xs[0], *copies[0]).float()
        flops = 2 * tokens * n * k
        row = dict(op="fp8_grouped_wo_a", groups=g, N=n, K=k, M=tokens, route_now=kernel_choice.fp8_grouped_kernel(tokens),
                   w8a16_config=tk.grouped_config(g * tokens, rows_per_group, k, g, "fp8", block).__dict__,
                   bf16_dequant_vs_w8a16_rel=float((got - ref).norm() / ref.norm()),
                   weight_floor_us=(w.numel() + s.numel()) / copy_bps * 1e6)
        for name, fn in routes.items():
            t = try_time([lambda x=x, c=c, fn=fn: fn(x, *c) for x, c in zip(xs, copies)])
            row[name + "_us"] = t * 1e6 if isinstance(t, float) else t
            row[name + "_TFLOPs"] = tflops(flops, t)
        t = try_time([lambda x=x, d=d: torch.bmm(x.transpose(0, 1), d.transpose(1, 2)) for x, d in zip(xs, dense)])
        row["bf16_bmm_only_us"] = t * 1e6 if isinstance(t, float) else t
        if sweep and tokens in WO_A_SWEEP_TOKENS:
            out = {}
            for bn in (32, 64, 128):
                for bk in (128, 256):
                    for warps in (4,):
                        for stages in (3, 4):
                            for swap in (False, True):
                                cfg = tk.GroupedConfig(16 if tokens <= 16 else min(128, tokens), bn, bk, warps,
                                                       stages, swap)
                                t = try_time([lambda x=x, c=c: tk.grouped_gemm_with(
                                    x.transpose(0, 1).reshape(g * tokens, k),
                                    torch.arange(1, g + 1, dtype=torch.int32, device="cuda") * tokens,
                                    c[0].view(g, rows_per_group, k), c[1].view(g, -1, c[1].shape[-1]), "fp8", block,
                                    cfg) for x, c in zip(xs, copies)])
                                out[f"bm{cfg.block_m}_bn{bn}_bk{bk}_w{warps}_s{stages}{'_swap' if swap else ''}"] = (
                                    t * 1e6 if isinstance(t, float) else str(t)[:80])
            row["w8a16_sweep"] = out
            best = min((v, c) for c, v in out.items() if isinstance(v, float))
            print(f"    w8a16 sweep best {best[1]}: {best[0]:.1f} us")
        rows_out.append(row)
        print(f"wo_a T={tokens:6d}: " + "  ".join(f"{v} {row[v + '_us']:.1f} us" for v in
                                                   ("w8a16", "bf16_dequant", "bf16_bmm_only")
                                                   if isinstance(row[v + "_us"], float))
              + f"  floor {row['weight_floor_us']:.1f} us  rel {row['bf16_dequant_vs_w8a16_rel']:.1e}"
              + f"  (table: {row['route_now']})")
        del xs


# ---- the tables for kernel_choice.py ------------------------------------------------------------------
def fmt_tf(v) -> str:
    return f"{v:6.1f}" if isinstance(v, float) else f"n/a ({str(v)[:60]})"


def route_table(sizes: dict[int, dict[str, float]], routes: tuple[str, ...]) -> tuple[tuple[int, str], ...]:
    """sizes: size -> {route: seconds summed over a layer's shapes}. The fastest of `routes` at each measured size,
    an entry where it changes (the smallest measured size's from 0): the table `kernel_choice.choose` reads."""
    table: list[tuple[int, str]] = []
    for size in sorted(sizes):
        best = min(routes, key=lambda r: sizes[size].get(r, float("inf")))
        if not table or table[-1][1] != best:
            table.append((size if table else 0, best))
    return tuple(table)


def _summed(rows: list[dict], routes: tuple[str, ...]) -> dict[int, dict[str, float]]:
    sizes: dict[int, dict[str, float]] = {}
    for r in rows:
        for route in routes:
            t = r.get(route + "_us")
            d = sizes.setdefault(r["M"], {})
            d[route] = d.get(route, 0.0) + t if isinstance(t, float) else float("inf")
    return sizes


EXPERT_ROUTES = ("w4a16", "w4a8", "bf16_dequant")
FP8_ROUTES = ("fp8", "bf16", "bf16_dequant")
WO_A_ROUTES = ("w8a16", "bf16_dequant")


def recommended_tables(result: dict) -> dict:
    out = {}
    for model in EXPERT_MODELS:
        sizes = _summed([r for r in result.get("experts", []) if r["model"] == model and r["op"] == "expert_gemm"],
                        EXPERT_ROUTES)
        if sizes:
            experts = EXPERT_MODELS[model][0]
            per_expert = {m // experts: times for m, times in sizes.items()}
            # "w4a8" is the folded kernel for 1 x 128 activation groups (its own table), the per-32 one otherwise
            name = ("FOLDED_EXPERT_KERNEL_BY_ROWS_PER_EXPERT" if EXPERT_MODELS[model][3] == triton_w4a8.FOLD_BLOCK
                    else "EXPERT_KERNEL_BY_ROWS_PER_EXPERT")
            out[f"{name} ({model})"] = route_table(per_expert, EXPERT_ROUTES)
    sizes = _summed(result.get("fp8", []), FP8_ROUTES)
    if sizes:
        out["FP8_FINE_BLOCK_BY_M"] = route_table(sizes, FP8_ROUTES)
    sizes = _summed(result.get("wo_a", []), WO_A_ROUTES)
    if sizes:
        out["FP8_GROUPED_BY_TOKENS"] = route_table(sizes, WO_A_ROUTES)
    return out


def main():
    date = datetime.date.today().isoformat()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=f"benchmarks/results/gpu_expert_gemm_{date}.json")
    ap.add_argument("--only", choices=["experts", "fp8", "wo_a"], help="run one part")
    ap.add_argument("--models", default=",".join(EXPERT_MODELS), help="expert shapes: v4_flash, v41_flash")
    ap.add_argument("--max-tokens", type=int, default=max(TOKENS), help="largest T for the experts")
    ap.add_argument("--tokens", help="comma-separated T for the experts (default: TOKENS)")
    ap.add_argument("--variants", help="comma-separated expert routes/peers to time (default: all)")
    ap.add_argument("--max-m", type=int, default=max(FP8_MS), help="largest M for the FP8 linears")
    ap.add_argument("--sweep", action="store_true", help="also time alternative tile configs")
    ap.add_argument("--sweep-tokens", help=f"comma-separated T to sweep at (default {sorted(SWEEP_TOKENS)})")
    ap.add_argument("--quick", action="store_true", help="V4.1 shapes at M in QUICK_MS, the routes only (~2 min)")
    args = ap.parse_args()
    if args.quick:
        args.models = "v41_flash" if args.models == ",".join(EXPERT_MODELS) else args.models
        if args.out == ap.get_default("out"):
            args.out = f"benchmarks/results/gpu_expert_gemm_quick_{date}.json"
        args.sweep = False
        gpu_quant_kernels.REPLAYS = 20
    if args.sweep_tokens:
        SWEEP_TOKENS.clear()
        SWEEP_TOKENS.update(int(t) for t in args.sweep_tokens.split(","))
    result = run_header(date)
    result["tables_in_code"] = {"EXPERT_KERNEL_BY_ROWS_PER_EXPERT": kernel_choice.EXPERT_KERNEL_BY_ROWS_PER_EXPERT,
                                "FP8_FINE_BLOCK_BY_M": kernel_choice.FP8_FINE_BLOCK_BY_M}
    result.update(ceilings())
    print(f"{result['device']}  torch {result['torch']}  triton {result['triton']}  {result['git']}  bf16 mm "
          f"{fmt_tf(result['bf16_mm_TFLOPs'])} TFLOP/s  fp8 mm {fmt_tf(result['fp8_scaled_mm_TFLOPs'])} TFLOP/s")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tokens = [int(t) for t in args.tokens.split(",")] if args.tokens else None
    parts = (("experts", lambda rows: bench_experts(args.models.split(","), args.max_tokens, args.sweep, rows,
                                                    args.quick, tokens,
                                                    set(args.variants.split(",")) if args.variants else None)),
             ("fp8", lambda rows: bench_fp8(args.max_m, args.sweep, rows, args.quick)),
             ("wo_a", lambda rows: bench_wo_a(args.sweep, rows)))
    for part, fn in parts:
        if args.only and part != args.only:
            continue
        result[part] = rows = []
        try:
            fn(Saved(rows, out, result))
        except Exception:
            result[part + "_error"] = traceback.format_exc()
            print(result[part + "_error"])
        out.write_text(json.dumps(result, indent=1))
    result["recommended_tables"] = recommended_tables(result)
    out.write_text(json.dumps(result, indent=1))
    print("tables for openinfer/quantization/kernel_choice.py from this run:")
    for name, table in result["recommended_tables"].items():
        print(f"  {name} = {table!r}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
