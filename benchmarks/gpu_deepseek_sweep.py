"""The serving sweep (`openinfer bench sweep`) for DeepSeek-V4 at V4-Flash width on one GPU: the model of
`gpu_deepseek_v4.py` (random weights in the published formats, `--layers` of the real 43), served by `openinfer
serve` on loopback and loaded at each concurrency; writes NAME.json and NAME.png (output tok/s per GPU against
tok/s per user) to $OUT or benchmarks/results/. An earlier sweep's JSON (`--previous`) is drawn beside it.

    python benchmarks/gpu_deepseek_sweep.py --tokenizer-json PATH [--layers 4] [--previous OLD.json]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from gpu_deepseek_v4 import PUBLISHED, layout, model_dir  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer-json", required=True)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--concurrency", default="1,8,32,64,128,256")
    ap.add_argument("--input-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--previous", action="append", default=[])
    ap.add_argument("--name", default=None)
    ap.add_argument("--label", default=None, help="this run's line (default: the model and its layers)")
    args = ap.parse_args()
    d = model_dir(args.tokenizer_json, **layout(args.layers), **PUBLISHED)
    out = os.environ.get("OUT", str(Path(__file__).parent / "results"))
    name = args.name or f"sweep_deepseek_v4_flash_{args.layers}l"
    cmd = [sys.executable, "-m", "openinfer", "bench", "sweep", "--model", str(d), "--load-format", "dummy",
           "--max-num-seqs", "256", "--max-num-batched-tokens", "8192", "--max-model-len", "4096",
           "--concurrency", args.concurrency, "--input-len", str(args.input_len), "--output-len",
           str(args.output_len), "--label", args.label or f"V4-Flash width, {args.layers} layers, 1 GPU", "--out", out,
           "--name", name, *[a for p in args.previous for a in ("--previous", p)]]
    print(" ".join(cmd), flush=True)
    return subprocess.run(cmd).returncode


if __name__ == "__main__":
    sys.exit(main())
