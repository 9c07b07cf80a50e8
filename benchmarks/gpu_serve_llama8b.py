"""The server at the engine's speed (issue 41), in one device call: `openinfer serve` (engine core in its own
process) with the Llama-3-8B shape (random bf16, `--load-format dummy`, `--max-num-seqs 256`) under
`openinfer bench serve --endpoint completions --input-len 512 --output-len 512 --ignore-eos --compare-offline`:
each case runs the same prompts through `LLM` first (the engine alone), then starts the server with the same engine
options and loads it, so the server's share of the offline throughput is a number of the same call. Cases:
concurrency 1 (16 prompts), 32 (64), 256 (512), then a soak at 256 streams for `--soak-s` seconds (every request
must succeed). The server's log of each case is kept (its first request and its warm-up time are in it).
`--api-server-count 1,2,4` runs each case once per count of API-server processes over the one engine core
(`openinfer serve --api-server-count`; the soak uses the last count):

    python benchmarks/gpu_serve_llama8b.py --tokenizer-json PATH [--soak-s 180] [--tiny] [--out DIR]
    python benchmarks/gpu_serve_llama8b.py --tokenizer-json PATH --concurrency 256 --api-server-count 1,2,4 --soak-s 0

Writes `gpu_serve_llama8b.json` (and the server logs) to --out / $OUT, prints a table last.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_llama8b import LLAMA3_8B, LLAMA_TINY, model_dir  # noqa: E402

CASES = [(1, 16), (32, 64), (256, 512)]


def bench(args, model: Path, concurrency: int, prompts: int, out: Path, name: str, api_servers: int = 1) -> dict:
    result_json = Path(tempfile.mkdtemp()) / f"{name}.json"      # (all of it goes into the one JSON below)
    cmd = [sys.executable, "-m", "openinfer", "bench", "serve", "--model", str(model), "--load-format", "dummy",
           "--max-num-seqs", str(args.max_num_seqs), "--endpoint", "completions", "--input-len", str(args.input_len),
           "--output-len", str(args.output_len), "--ignore-eos", "--num-prompts", str(prompts),
           "--max-concurrency", str(concurrency), "--result-json", str(result_json)]
    if args.tiny:
        cmd += ["--device", "cpu", "--max-model-len", "2048"]
    cmd += ["--compare-offline", "--api-server-count", str(api_servers)]
    t = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    print(proc.stdout[-3000:], proc.stderr[-3000:], sep="\n", flush=True)
    if proc.returncode != 0:
        return {"error": proc.stderr[-4000:], "wall_s": time.perf_counter() - t}
    res = json.loads(result_json.read_text())
    res["wall_s"] = time.perf_counter() - t
    log = res.get("server_log")
    if log and Path(log).is_file():
        if name.startswith(("serve_c1", "soak_c256")):   # (the device returns few files: the first and the soak)
            shutil.copy(log, out / f"{name}_server.log")
        res["warm_up_lines"] = [line for line in Path(log).read_text(errors="replace").splitlines()
                                if "warmed up" in line or "captured CUDA graphs" in line]
    return res


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--tokenizer-json", required=True)
    p.add_argument("--soak-s", type=float, default=180.0, help="seconds of the c=256 soak (0: none)")
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=512)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--tiny", action="store_true", help="a toy model on the CPU (checking the script)")
    p.add_argument("--concurrency", default=None, help="a comma list of the cases to run (default: 1,32,256)")
    p.add_argument("--api-server-count", default="1", help="a comma list: each case once per count of API-server "
                                                           "processes (openinfer serve --api-server-count)")
    p.add_argument("--out", default=os.environ.get("OUT") or "benchmarks/results")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = model_dir(args.tokenizer_json, LLAMA_TINY if args.tiny else LLAMA3_8B)
    cases = [(2, 4), (8, 16)] if args.tiny else CASES
    if args.concurrency:
        wanted = {int(c) for c in args.concurrency.split(",")}
        cases = [(c, n) for c, n in cases if c in wanted]
    results = {"benchmark": "gpu_serve_llama8b", "date": datetime.date.today().isoformat(),
               "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                        text=True).stdout.strip() or None,
               "device": "cpu" if args.tiny else _gpu_name(), "shape": "toy" if args.tiny else "Llama-3-8B (bf16 dummy)",
               "input_len": args.input_len, "output_len": args.output_len, "cases": {}}
    counts = [int(k) for k in args.api_server_count.split(",")]
    results["api_server_counts"] = counts

    def key(c: int, k: int) -> str:          # (one count: the keys of earlier runs)
        return f"c{c}" if len(counts) == 1 else f"c{c}_asc{k}"

    for c, n in cases:
        for k in counts:
            results["cases"][key(c, k)] = bench(args, model, c, n, out, f"serve_{key(c, k)}", k)
            (out / "gpu_serve_llama8b.json").write_text(json.dumps(results, indent=1))
    if args.soak_s > 0:
        c, k = cases[-1][0], counts[-1]
        # a c=256 soak: as many 512/512 requests as fit in soak_s at the rate the c=256 case measured
        rate = results["cases"][key(c, k)].get("request_throughput") or 1.0
        n = max(c, int(rate * args.soak_s))
        results["soak"] = bench(args, model, c, n, out, f"soak_c{c}", k)
        results["soak"]["target_s"] = args.soak_s
    (out / "gpu_serve_llama8b.json").write_text(json.dumps(results, indent=1))
    print(f"{'case':10s} {'ok':>6s} {'fail':>5s} {'out tok/s':>10s} {'offline':>9s} {'share':>6s} "
          f"{'TTFT p50/p90/p99 ms':>24s} {'TPOT p50':>9s} {'step ms':>8s} {'busy':>5s}")
    for name, r in [*results["cases"].items(), *([("soak", results["soak"])] if "soak" in results else [])]:
        if "error" in r:
            print(f"{name:10s} error: {r['error'][-300:]}")
            continue
        t, eng = r["ttft_ms"], r.get("engine") or {}
        print(f"{name:10s} {r['completed']:6d} {r['failed']:5d} {r['output_throughput']:10.1f} "
              f"{r['offline']['output_throughput']:9.1f} {r['server_over_offline']:6.0%} "
              f"{t['p50']:8.1f}/{t['p90']:7.1f}/{t['p99']:7.1f} {r['tpot_ms']['p50']:9.2f} "
              f"{(eng.get('mean_step_ms') or 0):8.2f} {(eng.get('step_busy_fraction') or 0):5.0%}")


def _gpu_name() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


if __name__ == "__main__":
    main()
