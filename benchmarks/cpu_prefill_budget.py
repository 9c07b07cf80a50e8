"""Time-budgeted vs token-budgeted chunked prefill on mixed traffic, in one run (issue 15 item 1).

A steady stream of short chat-like requests (prompt 32-96 tokens, 48 output tokens) with long prompts mixed in
(--long-len tokens, 16 output tokens) arrives by a Poisson process; the engine runs them with (1) the token
budget (`max_num_batched_tokens`) alone and (2) `prefill_step_budget_ms` (the step cost fitted by `calibrate`
on this machine, in the same run). Reports TTFT p50/p99 (short and long requests apart) and ITL p50/p99 of the
short requests' tokens (the gaps a user sees while long prompts are being prefilled), and tokens/s.

    python benchmarks/cpu_prefill_budget.py [--model smollm2-135m-instruct] [--budget-ms 60] [--duration 60]
    python benchmarks/cpu_prefill_budget.py --device cuda --model DIR --load-format dummy --dtype bfloat16 \
        --rate 16 --long-len 8000 --budget-ms 30 --out results/gpu_prefill_budget.json     # e.g. the 8B shape
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import time
from pathlib import Path

import numpy as np
import torch

from openinfer.config import EngineConfig
from openinfer.engine.cost_model import load_or_calibrate
from openinfer.engine.llm_engine import LLMEngine
from openinfer.sampling_params import RequestOutputKind, SamplingParams


def workload(seed: int, duration: float, rate: float, long_every: int, long_len: int, vocab: int):
    rng = np.random.default_rng(seed)
    t, out, i = 0.0, [], 0
    while t < duration:
        t += rng.exponential(1.0 / rate)
        long = i % long_every == long_every - 1
        n = long_len if long else int(rng.integers(32, 97))
        out.append((t, rng.integers(10, vocab - 1, size=n).tolist(), 16 if long else 48, long))
        i += 1
    return out


def pct(xs, q):
    return float(np.percentile(xs, q)) if xs else float("nan")


def warm_up(engine: LLMEngine, reqs) -> None:
    """The workload's first few seconds, untimed: kernel compiles and autotuning for its shapes happen here, not in
    whichever engine runs first (an H200 run without it gave the first engine multi-second stalls)."""
    for _, prompt, out_len, _ in reqs[:24]:
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()


def run(engine: LLMEngine, reqs) -> dict:
    t0 = time.perf_counter()
    pending = list(reqs)
    first, last, gaps, kinds, ntok = {}, {}, [], {}, 0
    arrival = {}
    while pending or engine.has_unfinished_requests():
        now = time.perf_counter() - t0
        while pending and pending[0][0] <= now:
            at, prompt, out_len, long = pending.pop(0)
            rid = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=out_len, ignore_eos=True,
                                                            output_kind=RequestOutputKind.DELTA))
            arrival[rid], kinds[rid] = t0 + at, long
        if not engine.has_unfinished_requests():
            time.sleep(min(0.002, max(0.0, pending[0][0] - now)))
            continue
        outs = engine.step()
        te = time.perf_counter()
        for o in outs:
            n = len(o.outputs[0].token_ids)
            if not n:
                continue
            ntok += n
            rid = o.request_id
            if rid not in first:
                first[rid] = te
            elif not kinds[rid]:
                gaps.append((te - last[rid]) / n)
            last[rid] = te
    wall = time.perf_counter() - t0
    short = [first[r] - arrival[r] for r in first if not kinds[r]]
    long = [first[r] - arrival[r] for r in first if kinds[r]]
    return {"requests": len(first), "output_tok_s": ntok / wall, "wall_s": wall,
            "ttft_short_ms_p50": 1e3 * pct(short, 50), "ttft_short_ms_p99": 1e3 * pct(short, 99),
            "ttft_long_ms_p50": 1e3 * pct(long, 50), "ttft_long_ms_p99": 1e3 * pct(long, 99),
            "itl_short_ms_p50": 1e3 * pct(gaps, 50), "itl_short_ms_p99": 1e3 * pct(gaps, 99)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--budget-ms", type=float, default=60.0)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--rate", type=float, default=4.0, help="requests per second")
    ap.add_argument("--long-every", type=int, default=8)
    ap.add_argument("--long-len", type=int, default=1800)
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--out", default=None, help="default: results/cpu_prefill_budget.json")
    args = ap.parse_args()
    torch.manual_seed(0)
    common = dict(model=args.model, device=args.device, max_num_batched_tokens=args.max_num_batched_tokens,
                  max_num_seqs=64, load_format=args.load_format, dtype=args.dtype)
    if args.device != "cpu":
        common["kv_cache_memory_bytes"] = 32 << 30     # two engines share the GPU
    device = (torch.cuda.get_device_name() if args.device != "cpu" else f"cpu, {os.cpu_count()} cores")
    result = {"benchmark": "prefill_budget", "date": datetime.date.today().isoformat(),
              "commit": os.environ.get("OPENINFER_COMMIT") or subprocess.run(
                  ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
              "device": device, "args": vars(args)}
    token_engine = LLMEngine(EngineConfig(**common))
    model, path = load_or_calibrate(token_engine, refit=True)
    result["cost_model_ms"] = model.__dict__ | {"path": str(path)}
    result["cost_model_rel_rms_error"] = json.loads(path.read_text())["rel_rms_error"]
    reqs = workload(0, args.duration, args.rate, args.long_every, args.long_len, token_engine.model_config.vocab_size)
    warm_up(token_engine, reqs)
    result["token_budget"] = run(token_engine, reqs)
    print("token budget", json.dumps(result["token_budget"]), flush=True)
    timed = LLMEngine(EngineConfig(**common, prefill_step_budget_ms=args.budget_ms))   # loads the fit just saved
    warm_up(timed, reqs)
    result["time_budget"] = run(timed, reqs)
    print("time budget", json.dumps(result["time_budget"]), flush=True)
    out = Path(args.out) if args.out else Path(__file__).parent / "results" / "cpu_prefill_budget.json"
    out.write_text(json.dumps(result, indent=1))
    print(out)


if __name__ == "__main__":
    main()
