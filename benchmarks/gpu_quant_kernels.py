"""The quantized-weight Triton kernels (openinfer/quantization/triton_kernels.py) on one GPU, in one run.

Measures, in the same run:
 - the ceilings: copy bandwidth of a 2 GiB tensor (bytes read + written) and read bandwidth (a 2 GiB
   max-reduction; these kernels only read their weights);
 - fp8_linear at DeepSeek-V4-Flash shapes (wq_a, wq_b, wkv, wo_b, a square 4096), block 128 and 32, M from 1
   (decode) to 4096 (prefill): time, bytes it must read (fp8 weight + scales + bf16 activations) and the
   GB/s that makes against the copy ceiling, TFLOP/s; peers: bf16 F.linear on the dequantized weight, and
   torch._scaled_mm blockwise (block 128);
 - grouped_gemm MXFP4 at V4-Flash expert shapes (256 experts, gate_up 4096x4096, down 4096x2048) with top-6
   routing of T tokens: time, bytes of the distinct experts hit, against the ceiling; peer: bf16
   torch._grouped_mm on the dequantized experts.
Every timing is the median of CUDA-event-timed replays of a CUDA graph that holds one call per weight copy
(or routing), enough copies that the weights read exceed the 60 MB L2: decode numbers are DRAM numbers.
`--sweep` also times alternative tile configs (what the heuristics in triton_kernels.py were chosen from).

    python benchmarks/gpu_quant_kernels.py [--out PATH] [--sweep]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import subprocess
import sys
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from openinfer.quantization import formats  # noqa: E402
from openinfer.quantization import triton_kernels as tk  # noqa: E402

FP8_SHAPES = {"wq_a": (1024, 4096), "wq_b": (32768, 1024), "wkv": (512, 4096), "wo_b": (4096, 8192),
              "square": (4096, 4096)}                      # name: (N, K)
FP8_MS = [1, 8, 32, 128, 512, 4096]
EXPERTS, HIDDEN, INTER, TOP_K = 256, 4096, 2048, 6
GROUPED_SHAPES = {"gate_up": (2 * INTER, HIDDEN), "down": (HIDDEN, INTER)}
TOKENS = [1, 8, 32, 128, 512]
SWEEP_FP8 = {(1, 128), (32, 128), (1, 32)}                 # (M, block) swept with --sweep
SWEEP_TOKENS = {1, 32, 512}
L2_BYTES = 60 << 20
REPLAYS = 50


def ceilings() -> tuple[float, float]:
    """GB/s of a 2 GiB device copy (bytes read + written) and of a 2 GiB read (a max-reduction): the kernels
    here only read weights, so the second is the tighter bound for them."""
    x = torch.empty(1 << 30, dtype=torch.bfloat16, device="cuda").normal_()
    y = torch.empty_like(x)
    t_copy = graph_time([lambda: y.copy_(x)])
    t_read = graph_time([lambda: torch.amax(x)])
    return 2 * x.numel() * 2 / t_copy / 1e9, x.numel() * 2 / t_read / 1e9


def graph_time(calls: list) -> float:
    """Seconds per call: median over REPLAYS replays of one CUDA graph holding `calls` in sequence."""
    for c in calls:                                        # compile / warm up outside the capture
        c()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in calls:
            c()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(REPLAYS):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del graph
    return sorted(times)[len(times) // 2] / len(calls)


def copies_for(nbytes: int) -> int:
    return max(1, min(64, math.ceil(3 * L2_BYTES / nbytes)))


def try_time(calls):
    try:
        return graph_time(calls)
    except Exception as e:                                 # a peer that does not run on this shape
        return f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"


# ---- fp8_linear ---------------------------------------------------------------------------------------
def bench_fp8(ceiling: float, sweep: bool, rows: list) -> None:
    for block in (128, 32):
        for name, (n, k) in FP8_SHAPES.items():
            w, s = formats.quantize_fp8(torch.randn(n, k, device="cuda") * 0.05, block)
            wbytes = w.numel() + s.numel()
            copies = [(w.clone(), s.clone()) for _ in range(copies_for(wbytes))]
            dense = formats.dequantize_fp8(w, s, block).to(torch.bfloat16)
            dense_copies = [dense.clone() for _ in range(copies_for(2 * w.numel()))]
            del dense
            for m in FP8_MS:
                xs = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _ in range(len(copies))]
                nbytes = wbytes + 2 * m * k
                flops = 2 * m * n * k
                cfg = ("torch._scaled_mm" if tk.use_scaled_mm(m, n, k, block)
                       else tk.fp8_config(m, n, k, block, tk.num_sms(torch.device("cuda"))).__dict__)
                t = graph_time([lambda x=x, w=w, s=s: tk.fp8_linear(x, w, s, block) for x, (w, s) in zip(xs, copies)])
                row = dict(op="fp8_linear", shape=name, N=n, K=k, block=block, M=m, config=cfg, us=t * 1e6,
                           bytes=nbytes, GBps=nbytes / t / 1e9, of_copy_ceiling=nbytes / t / 1e9 / ceiling,
                           TFLOPs=flops / t / 1e12)
                xd = xs[0]
                t_bf16 = try_time([lambda d=d: F.linear(xd, d) for d in dense_copies])
                row["bf16_linear_us"] = t_bf16 * 1e6 if isinstance(t_bf16, float) else t_bf16
                if block == 128:
                    t_smm = try_time([lambda x=x, w=w, s=s: tk.scaled_mm_fp8(x, w, s) for x, (w, s) in zip(xs, copies)])
                    row["scaled_mm_us"] = t_smm * 1e6 if isinstance(t_smm, float) else t_smm
                if sweep and (m, block) in SWEEP_FP8:
                    row["sweep"] = sweep_fp8(xs, copies, m, n, k, block)
                rows.append(row)
                print_fp8(row)
            del copies, dense_copies
            torch.cuda.empty_cache()


def sweep_fp8(xs, copies, m, n, k, block) -> dict:
    """Decode configs: N tile x split-K x pipeline depth, the M tile fixed at the heuristic's."""
    out = {}
    k_blocks = triton.cdiv(k, block)
    bm = max(16, triton.next_power_of_2(m))
    for bn in (32, 64, 128):
        tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
        for split in sorted({1, 4, 16, tk._split_k(tiles, k_blocks, (2 if block >= 128 else 4) * 132, 132)}):
            if split > 1 and k_blocks // split < 2:
                continue
            for stages in (3, 5):
                cfg = tk.Fp8GemmConfig(bm, bn, split, 4, stages, True)
                t = try_time([lambda x=x, w=w, s=s: tk.fp8_gemm(x, w, s, block, cfg) for x, (w, s) in zip(xs, copies)])
                out[f"bm{bm}_bn{bn}_split{split}_s{stages}"] = t * 1e6 if isinstance(t, float) else t
    best = min((v, c) for c, v in out.items() if isinstance(v, float))
    print(f"    sweep best {best[1]}: {best[0]:.1f} us")
    return out


def print_fp8(r):
    peers = f"bf16 {fmt_us(r['bf16_linear_us'])}" + (f"  scaled_mm {fmt_us(r['scaled_mm_us'])}" if "scaled_mm_us" in r else "")
    print(f"fp8_linear {r['shape']:7s} N={r['N']:6d} K={r['K']:5d} b={r['block']:3d} M={r['M']:5d}: "
          f"{r['us']:9.1f} us {r['GBps']:7.0f} GB/s ({r['of_copy_ceiling']:.2f} of copy) {r['TFLOPs']:6.1f} TFLOP/s"
          f" | {peers}")


def fmt_us(v):
    return f"{v:9.1f} us" if isinstance(v, float) else f"n/a ({v})"


# ---- grouped_gemm -------------------------------------------------------------------------------------
def routing(tokens: int, gen: torch.Generator):
    """Top-6 of 256 by random scores: (offs [E] int32, number of distinct experts hit)."""
    idx = torch.rand(tokens, EXPERTS, generator=gen, device="cuda").argsort(-1)[:, :TOP_K].flatten()
    counts = torch.bincount(idx, minlength=EXPERTS)
    return counts.cumsum(0).to(torch.int32), int((counts > 0).sum())


def bench_grouped(ceiling: float, sweep: bool, rows: list) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name, (n, k) in GROUPED_SHAPES.items():
        # random codes and scales near 1 (quantizing 256 random experts would take far more memory)
        w = torch.randint(0, 256, (EXPERTS, n, k // 2), dtype=torch.uint8, device="cuda")
        s = torch.randint(118, 125, (EXPERTS, n, k // 32), dtype=torch.uint8, device="cuda").view(torch.float8_e8m0fnu)
        dense = torch.empty(EXPERTS, n, k, dtype=torch.bfloat16, device="cuda")
        for e in range(EXPERTS):
            dense[e] = formats.dequantize_mxfp4(w[e], s[e])
        per_expert = n * k // 2 + n * k // 32
        for tokens in TOKENS:
            m = tokens * TOP_K
            routings = [routing(tokens, gen) for _ in range(copies_for(per_expert * min(EXPERTS, m)))]
            xs = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _ in routings]
            hit = sum(h for _, h in routings) / len(routings)
            nbytes = hit * per_expert + 2 * m * k
            cfg = tk.grouped_config(m, n, k, EXPERTS, "mxfp4", 32)
            t = graph_time([lambda x=x, o=o: tk.grouped_gemm(x, o, w, s, "mxfp4", 32) for x, (o, _) in zip(xs, routings)])
            row = dict(op="grouped_gemm_mxfp4", shape=name, N=n, K=k, tokens=tokens, M=m, experts_hit=hit,
                       config=cfg.__dict__, us=t * 1e6, bytes=nbytes, GBps=nbytes / t / 1e9,
                       of_copy_ceiling=nbytes / t / 1e9 / ceiling, TFLOPs=2 * m * n * k / t / 1e12)
            dt = dense.transpose(1, 2)
            t_bf16 = try_time([lambda x=x, o=o: torch._grouped_mm(x, dt, offs=o) for x, (o, _) in zip(xs, routings)])
            row["bf16_grouped_mm_us"] = t_bf16 * 1e6 if isinstance(t_bf16, float) else t_bf16
            if sweep and tokens in SWEEP_TOKENS:
                row["sweep"] = sweep_grouped(xs, routings, w, s, m, n, k)
            rows.append(row)
            print(f"grouped mxfp4 {name:7s} N={n} K={k} T={tokens:4d} (M={m:5d}, {hit:5.1f} experts): {row['us']:8.1f} us "
                  f"{row['GBps']:7.0f} GB/s ({row['of_copy_ceiling']:.2f} of copy) | bf16 _grouped_mm "
                  f"{fmt_us(row['bf16_grouped_mm_us'])}")


def sweep_grouped(xs, routings, w, s, m, n, k) -> dict:
    out = {}
    base = tk.grouped_config(m, n, k, EXPERTS, "mxfp4", 32)
    for bn in (64, 128, 256):
        for bk in (128, 256):
            for stages in (3, 4):
                cfg = tk.GroupedConfig(base.block_m, bn, bk, base.num_warps, stages)
                t = try_time([lambda x=x, o=o: tk.grouped_gemm_with(x, o, w, s, "mxfp4", 32, cfg)
                              for x, (o, _) in zip(xs, routings)])
                out[f"bm{base.block_m}_bn{bn}_bk{bk}_s{stages}"] = t * 1e6 if isinstance(t, float) else t
    best = min((v, c) for c, v in out.items() if isinstance(v, float))
    print(f"    sweep best {best[1]}: {best[0]:.1f} us")
    return out


class Saved:
    """Appending a result row rewrites the JSON file (a run cut short keeps what it measured)."""

    def __init__(self, rows: list, path: Path, result: dict):
        self.rows, self.path, self.result = rows, path, result

    def append(self, row):
        self.rows.append(row)
        self.path.write_text(json.dumps(self.result, indent=1))


def run_header(date: str) -> dict:
    """What every result file starts with: device, torch and Triton versions, date, commit."""
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        rev = "unknown"
    return dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__, date=date,
                git=rev)


def main():
    date = datetime.date.today().isoformat()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=f"benchmarks/results/gpu_quant_kernels_{date}.json")
    ap.add_argument("--sweep", action="store_true", help="also time alternative tile configs")
    ap.add_argument("--only", choices=["fp8", "grouped"], help="run one half")
    args = ap.parse_args()
    result = run_header(date)
    result["copy_GBps"], result["read_GBps"] = ceiling, read = ceilings()
    print(f"{result['device']}  torch {result['torch']}  triton {result['triton']}  {result['git']}  copy "
          f"{ceiling:.0f} GB/s  read {read:.0f} GB/s")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for part, fn in (("fp8_linear", bench_fp8), ("grouped_gemm", bench_grouped)):
        if args.only and not part.startswith(args.only):
            continue
        result[part] = rows = []
        try:
            fn(ceiling, args.sweep, Saved(rows, out, result))
        except Exception:
            result[part + "_error"] = traceback.format_exc()
            print(result[part + "_error"])
        out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
