"""`openinfer serve` vs `transformers serve --continuous-batching`, same model directory, same load, same run.

Each server is started as a process on loopback, loaded by `openinfer bench serve` (chat endpoint, greedy,
random-word prompts), then stopped.

    python benchmarks/cpu_serve_vs_hf.py --num-prompts 32 --max-concurrency 8 --input-len 128 --output-len 64
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from cpu_offline_vs_hf import commit, machine  # noqa: E402

from openinfer.benchmarks.serve import ServeBenchConfig, run_serve_bench  # noqa: E402
from openinfer.config import default_cache_dir  # noqa: E402
from openinfer.loader.model_source import resolve_model_dir  # noqa: E402


def serve_and_bench(cmd: list[str], port: int, cfg: ServeBenchConfig) -> dict:
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    try:
        deadline = time.time() + 300
        while time.time() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        # warm-up (HF serve loads lazily on first request)
        run_serve_bench(ServeBenchConfig(**{**cfg.__dict__, "num_prompts": 2, "max_concurrency": 2,
                                            "output_len": 4}), quiet=True)
        return run_serve_bench(cfg)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--max-concurrency", type=int, default=8)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--slo-ttft-ms", type=float, default=3000)
    ap.add_argument("--slo-tpot-ms", type=float, default=200)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    model_dir = str(resolve_model_dir("smollm2-135m-instruct", default_cache_dir()))
    results = {}
    for name, port, cmd in (
        ("openinfer", 8031, [sys.executable, "-m", "openinfer.entrypoints.cli", "serve", "--model", model_dir,
                             "--device", "cpu", "--port", "8031", "--max-num-seqs", str(args.max_concurrency)]),
        ("transformers_serve_cb", 8032, [str(Path(sys.executable).parent / "transformers"), "serve", model_dir,
                                         "--continuous-batching", "--port", "8032"]),
    ):
        cfg = ServeBenchConfig(base_url=f"http://127.0.0.1:{port}", endpoint="chat", model=model_dir,
                               num_prompts=args.num_prompts, max_concurrency=args.max_concurrency,
                               input_len=args.input_len, output_len=args.output_len,
                               slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms)
        print(f"== {name}", flush=True)
        results[name] = serve_and_bench(cmd, port, cfg)
    date = datetime.date.today().isoformat()
    out = Path(args.out or f"benchmarks/results/cpu_serve_vs_hf_{date}.json")
    out.write_text(json.dumps({"benchmark": "cpu_serve_vs_hf", "model": "SmolLM2-135M-Instruct (Q4_1 GGUF dequantized), fp32",
                               "machine": machine(), "date": date, "commit": commit(), "results": results},
                              indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
