"""mHC's hc_pre at V4-Flash width (4 streams of 4096, 24 mixes, 20 Sinkhorn iterations) on one GPU: today's kernels
(openinfer/layers/triton_mhc.py) against another version of that file (`--old`, e.g. `git show REV:openinfer/layers/
triton_mhc.py > /tmp/triton_mhc_old.py`), same run: graph-replayed µs per call at 1 .. 8,192 rows, and the largest
difference of pre, post and comb between the two.

    python benchmarks/gpu_mhc_pre_ab.py --old /tmp/triton_mhc_old.py [--out PATH]
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from openinfer.layers import triton_mhc  # noqa: E402


def replayed_us(fn, n: int = 20) -> float:
    """µs per call of `fn` captured in a CUDA graph, over `n` replays."""
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(n):
        g.replay()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / n * 1e3


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--old", required=True, help="another triton_mhc.py to time beside today's")
    ap.add_argument("--rows", default="1,2,32,128,1024,8192")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "benchmarks/results"),
                                                  f"gpu_mhc_pre_ab_{datetime.date.today()}.json"))
    args = ap.parse_args()
    spec = importlib.util.spec_from_file_location("triton_mhc_old", args.old)
    old = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(old)
    n, H = 4, 4096
    mix = (2 + n) * n
    g = torch.Generator(device="cuda").manual_seed(0)
    fn = torch.randn(mix, n * H, device="cuda", generator=g) / 128
    base = torch.randn(mix, device="cuda", generator=g)
    scale = torch.rand(3, device="cuda", generator=g) + 0.5
    res = dict(device=torch.cuda.get_device_name(), date=str(datetime.date.today()), torch=torch.__version__,
               old=args.old, rows=[])
    for T in (int(r) for r in args.rows.split(",")):
        x = torch.randn(T, n, H, device="cuda", generator=g).bfloat16()
        row = {"rows": T}
        outs = {}
        for name, mod in (("old", old), ("new", triton_mhc)):
            outs[name] = mod.hc_pre(x, fn, base, scale, 20, 1e-6, 1e-6)
            row[f"{name}_us"] = replayed_us(lambda: mod.hc_pre(x, fn, base, scale, 20, 1e-6, 1e-6))
        row["speedup"] = row["old_us"] / row["new_us"]
        row["max_weight_diff"] = max((a - b).abs().max().item() for a, b in zip(outs["old"][:3], outs["new"][:3]))
        res["rows"].append(row)
        print(json.dumps(row), flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
