"""The MXFP4 (W4A16) grouped expert GEMM on one GPU: the tile plan `grouped_config` picks against alternatives
over a few tile shapes, in one run (issue 34: at b = 32 the expert GEMM is 3.8 of the 5.4 ms V4-Flash-width step,
at 0.24-0.44 of the copy ceiling; issue 35: 74 of a 152 ms 32 x 1K prefill step, at ~150 TFLOP/s).

`--plans dot_scaled` (default): the same kernel with `GroupedConfig.dot_scaled` (Triton's `tl.dot_scaled` upcasts
the E2M1 codes after they reach the tensor-core operand layout, so the layout change moves packed bytes, not
bf16 values), plain and swapped, over a few tiles. `--plans swap`: the transposed product with the kernel's own
decode (`GroupedConfig.swap_ab`: the dequantized weight tile as the wide A operand), measured slower on
2026-12-03. Token counts from 1 to 128 are decode batches; larger ones are prefill steps (TFLOP/s reported).

V4-Flash (256 experts, gate_up 4096 x 4096, down 4096 x 2048) and V4.1-Flash (384 experts, gate_up 4608 x 5120,
down 5120 x 2304) with top-6 routing of T tokens. Every time is the median of CUDA-event-timed replays of a CUDA
graph holding one call per routing copy (benchmarks/gpu_quant_kernels.py's method: enough copies that the weights
read exceed the L2); GB/s counts the bytes of the distinct experts hit, against a 2 GiB copy measured in the run
(bytes read + written; the run's read-only ceiling is in the JSON too).
Writes JSON to $OUT (or benchmarks/results/) and prints the best plan per size.

    python benchmarks/gpu_expert_decode_tiles.py [--tokens 1,32,128,1024,8192] [--models v4_flash,v41_flash]
        [--plans dot_scaled|swap]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.gpu_quant_kernels import ceilings, copies_for, run_header, try_time  # noqa: E402
from openinfer.quantization import triton_kernels as tk  # noqa: E402

MODELS = {"v4_flash": (256, 4096, 2048), "v41_flash": (384, 5120, 2304)}     # experts, hidden, intermediate
TOP_K = 6
SWAPPED = [(bn, bk, w, st) for bn in (64, 128) for bk in (128, 256) for w in (4,) for st in (3, 4)]
DOT_SCALED_DECODE = [(64, 256, 4, 3), (128, 128, 4, 3), (128, 256, 4, 4), (256, 128, 4, 3)]
DOT_SCALED_PREFILL = [(256, 64, 8, 3), (128, 128, 8, 3), (256, 128, 8, 3), (128, 64, 4, 4)]


def plans_for(base: "tk.GroupedConfig", which: str) -> dict:
    plans = {"today": base}
    if which == "swap":
        for bn, bk, warps, stages in SWAPPED:
            plans[f"swap_bm{base.block_m}_bn{bn}_bk{bk}_w{warps}_s{stages}"] = tk.GroupedConfig(
                base.block_m, bn, bk, warps, stages, True)
        return plans
    plans["ds_today_tiles"] = tk.GroupedConfig(base.block_m, base.block_n, base.block_k, base.num_warps,
                                               base.num_stages, dot_scaled=True)
    for bn, bk, warps, stages in (DOT_SCALED_PREFILL if base.block_m >= 64 else DOT_SCALED_DECODE):
        for swap in (False, True):
            name = f"ds{'_swap' if swap else ''}_bm{base.block_m}_bn{bn}_bk{bk}_w{warps}_s{stages}"
            plans[name] = tk.GroupedConfig(base.block_m, bn, bk, warps, stages, swap_ab=swap, dot_scaled=True)
    return plans


def routing(tokens: int, experts: int, gen: torch.Generator):
    idx = torch.rand(tokens, experts, generator=gen, device="cuda").argsort(-1)[:, :TOP_K].flatten()
    counts = torch.bincount(idx, minlength=experts)
    return counts.cumsum(0).to(torch.int32), int((counts > 0).sum())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,32,128,1024,8192")
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--plans", default="dot_scaled", choices=("dot_scaled", "swap"))
    args = ap.parse_args()
    date = datetime.date.today().isoformat()
    res = {**run_header(date), "benchmark": "gpu_expert_decode_tiles", "rows": []}
    ceiling, read = ceilings()
    res["copy_GBps"], res["read_GBps"] = ceiling, read
    out = Path(os.environ.get("OUT", "benchmarks/results")) / f"gpu_expert_decode_tiles_{date}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    for model in args.models.split(","):
        e, h, inter = MODELS[model]
        for proj, (n, k) in (("gate_up", (2 * inter, h)), ("down", (h, inter))):
            w = torch.randint(0, 256, (e, n, k // 2), dtype=torch.uint8, device="cuda")
            s = torch.randint(118, 125, (e, n, k // 32), dtype=torch.uint8, device="cuda").view(torch.float8_e8m0fnu)
            per_expert = n * k // 2 + n * k // 32
            for tokens in (int(t) for t in args.tokens.split(",")):
                m = tokens * TOP_K
                routings = [routing(tokens, e, gen) for _ in range(copies_for(per_expert * min(e, m)))]
                xs = [torch.randn(m, k, device="cuda", dtype=torch.bfloat16) for _ in routings]
                hit = sum(c for _, c in routings) / len(routings)
                nbytes = hit * per_expert + 2 * m * k
                base = tk.grouped_config(m, n, k, e, "mxfp4", 32)
                plans = plans_for(base, args.plans)
                times = {}
                for name, cfg in plans.items():
                    t = try_time([lambda x=x, o=o, cfg=cfg: tk.grouped_gemm_with(x, o, w, s, "mxfp4", 32, cfg)
                                  for x, (o, _) in zip(xs, routings)])
                    times[name] = t * 1e6 if isinstance(t, float) else t
                ok = {c: v for c, v in times.items() if isinstance(v, float)}
                best = min(ok, key=ok.get)
                row = dict(model=model, proj=proj, N=n, K=k, tokens=tokens, M=m, experts_hit=hit,
                           today=base.__dict__, us=times, bytes=nbytes, best=best,
                           today_of_copy=nbytes / (ok["today"] * 1e-6) / 1e9 / ceiling if "today" in ok else None,
                           best_of_copy=nbytes / (ok[best] * 1e-6) / 1e9 / ceiling,
                           TFLOPs={c: 2 * m * n * k / (v * 1e-6) / 1e12 for c, v in ok.items()})
                res["rows"].append(row)
                out.write_text(json.dumps(res, indent=1))
                print(f"{model} {proj:7s} T={tokens:4d} ({hit:5.1f} experts): today {fmt(times['today'])} "
                      f"({row['today_of_copy'] or 0:.2f} of copy) | best {best} {ok[best]:8.1f} us "
                      f"({row['best_of_copy']:.2f} of copy; {row['TFLOPs'][best]:.0f} vs "
                      f"{row['TFLOPs'].get('today', 0):.0f} TFLOP/s)", flush=True)
    print(f"wrote {out}")


def fmt(v) -> str:
    return f"{v:8.1f} us" if isinstance(v, float) else f"n/a ({v})"


if __name__ == "__main__":
    main()
