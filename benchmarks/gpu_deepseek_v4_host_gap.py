"""GPU: where a DeepSeek-V4 decode step's host time goes, and whether async scheduling hides it (openinfer issue 34).

The V4-Flash-width engine of gpu_deepseek_v4.py (random weights, bf16, `--layers` layers), `--batches` requests of
`--context` tokens decoding greedily. Per batch, in one run:
- `step_ms`: wall time per step (steps back to back, no sync between them), and its spread;
- `host_ms`: host time per step in each phase (schedule; execute = building inputs and queueing the step;
  process = reading the previous step back and the per-request bookkeeping, of which `readback_wait` is waiting
  for the GPU); `gc_ms`: Python's garbage collector;
- `gpu_kernel_ms_per_step`: the kernels' own time (torch profiler, 3 steps at the same batch);
- `gpu_step_ms`: from the GPU reaching a step's first queued work to its last (CUDA events around `execute`):
  more than the kernels' time means the GPU waited inside the step for the host to queue the rest;
  `gpu_idle_between_steps_ms`: the GPU idle between one step's last work and the next step's first (the host
  had not queued it yet: host work not hidden);
- `syncs`: operations that made the host wait for the GPU inside a step (torch.cuda.set_sync_debug_mode), with
  where they were called; an event wait on the previous step's sample is the only one async scheduling expects;
- `profile`: cProfile of 5 steps by own time.
If step ≈ gpu_step: the GPU is the limit; if gpu_idle_between_steps is large: the host's work per step
(schedule + execute + process − readback_wait) is longer than the GPU's, or a sync serializes them.

    python benchmarks/gpu_deepseek_v4_host_gap.py --tokenizer-json PATH [--layers 4] [--batches 1,32,128] \
        [--weights fp8]

Writes JSON to $OUT (or benchmarks/results/).
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import gc
import io
import json
import os
import pstats
import subprocess
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from gpu_deepseek_v4 import PUBLISHED, layout, model_dir  # noqa: E402
from gpu_llama8b import start_decoding  # noqa: E402

from openinfer import LLM  # noqa: E402
from openinfer.device_io import D2HCopy  # noqa: E402


class Observe:
    """Observers around the engine's phases (the originals still run): host seconds per phase, CUDA events
    around each `execute`, garbage-collector time."""

    def __init__(self, eng):
        self.eng = eng
        self.host = {"schedule": 0.0, "execute": 0.0, "process": 0.0, "readback_wait": 0.0, "gc": 0.0}
        self.events = []
        self._originals = (eng.scheduler.schedule, eng.runner.execute, eng._process, D2HCopy.wait)
        self._gc_start = None

    def _timed(self, key, fn, mark=False):
        def wrapper(*a, **k):
            t = time.perf_counter()
            if mark:
                start = torch.cuda.Event(enable_timing=True)
                start.record()
            r = fn(*a, **k)
            if mark:
                end = torch.cuda.Event(enable_timing=True)
                end.record()
                self.events.append((start, end))
            self.host[key] += time.perf_counter() - t
            return r
        return wrapper

    def _gc(self, phase, info):
        if phase == "start":
            self._gc_start = time.perf_counter()
        elif self._gc_start is not None:
            self.host["gc"] += time.perf_counter() - self._gc_start

    def __enter__(self):
        eng, (schedule, execute, process, wait) = self.eng, self._originals
        eng.scheduler.schedule = self._timed("schedule", schedule)
        eng.runner.execute = self._timed("execute", execute, mark=True)
        eng._process = self._timed("process", process)
        timed_wait = self._timed("readback_wait", wait)
        D2HCopy.wait = lambda copy: timed_wait(copy)
        gc.callbacks.append(self._gc)
        return self

    def __exit__(self, *exc):
        eng = self.eng
        eng.scheduler.schedule, eng.runner.execute, eng._process, D2HCopy.wait = self._originals
        gc.callbacks.remove(self._gc)
        return False


def sync_points(eng, steps: int) -> list[dict]:
    """Operations inside `steps` steps that synchronize with the GPU (torch's sync debug mode), by call site."""
    seen: dict[str, dict] = {}
    original = warnings.showwarning

    def show(message, category, filename, lineno, file=None, line=None):
        stack = [f"{f.filename.split('openinfer/')[-1]}:{f.lineno} {f.name}" for f in traceback.extract_stack()[:-1]
                 if "/openinfer/" in f.filename and "site-packages" not in f.filename]
        key = " <- ".join(reversed(stack[-4:])) or f"{filename}:{lineno}"
        entry = seen.setdefault(key, {"where": key, "message": str(message)[:160], "count": 0})
        entry["count"] += 1

    warnings.showwarning = show
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = show
            torch.cuda.set_sync_debug_mode("warn")
            try:
                for _ in range(steps):
                    eng.step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
    finally:
        warnings.showwarning = original
    torch.cuda.synchronize()
    return sorted(seen.values(), key=lambda e: -e["count"])


def decode(llm: LLM, batch: int, ctx: int, steps: int) -> dict:
    eng = llm.engine
    start_decoding(eng, batch, ctx, steps + 24, warmup=4)   # timed, profiled, sync-checked, cProfiled
    torch.cuda.synchronize()
    walls = []
    with Observe(eng) as obs:
        t0 = time.perf_counter()
        for _ in range(steps):
            t = time.perf_counter()
            eng.step()
            walls.append(time.perf_counter() - t)
        torch.cuda.synchronize()
        step = (time.perf_counter() - t0) / steps
    ev = obs.events
    gpu_steps = [s.elapsed_time(e) for s, e in ev]
    gaps = [max(0.0, ev[i - 1][1].elapsed_time(ev[i][0])) for i in range(1, len(ev))]
    ms = sorted(w * 1e3 for w in walls)
    res = {"batch": batch, "context": ctx, "steps": steps, "step_ms": step * 1e3,
           "step_host_wall_ms": {"p10": ms[len(ms) // 10], "p50": ms[len(ms) // 2], "max": ms[-1]},
           "host_ms": {k: v / steps * 1e3 for k, v in obs.host.items()},
           "gpu_step_ms": sum(gpu_steps) / len(gpu_steps),
           "gpu_idle_between_steps_ms": sum(gaps) / max(1, len(gaps))}
    # the kernels' own time per step at this batch (torch profiler, 3 steps): step_ms against it is the host's share
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as tprof:
        for _ in range(3):
            eng.step()
        torch.cuda.synchronize()
    kernels = [e for e in tprof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    res["gpu_kernel_ms_per_step"] = sum(e.device_time for e in kernels) / 1e3 / 3
    res["syncs"] = sync_points(eng, 4)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(5):
        eng.step()
    torch.cuda.synchronize()
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
    res["profile_5_steps"] = buf.getvalue()[-6000:]
    assert len(eng.scheduler.running) == batch, (len(eng.scheduler.running), batch)    # the batch stayed whole
    for rid in list(eng.requests):
        eng.abort_request(rid)
    while eng.has_unfinished_requests():
        eng.step()
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer-json", required=True)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batches", default="1,32,128")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--weights", choices=["fp8", "bf16"], default="fp8",
                    help="fp8: DeepSeek's published formats (FP8 dense, MXFP4 experts), as issue 34's run; bf16")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    res = {"date": datetime.date.today().isoformat(), "commit": commit, "device": torch.cuda.get_device_name(),
           "layers": args.layers, "weights": args.weights, "decode": []}
    d = model_dir(args.tokenizer_json, **layout(args.layers), **(PUBLISHED if args.weights == "fp8" else {}))
    llm = LLM(str(d), device="cuda", dtype="bfloat16", load_format="dummy", max_num_seqs=max(batches),
              max_num_batched_tokens=8192, enable_prefix_caching=False, max_model_len=args.max_model_len)
    llm.engine.warm_up()
    for b in batches:
        try:
            r = decode(llm, b, args.context, args.steps)
        except Exception:
            r = {"batch": b, "error": traceback.format_exc()[-3000:]}
            for rid in list(llm.engine.requests):
                llm.engine.abort_request(rid)
        res["decode"].append(r)
        print(json.dumps({k: v for k, v in r.items() if k != "profile_5_steps"}), flush=True)
        if "profile_5_steps" in r:
            print(r["profile_5_steps"], flush=True)
    out = Path(os.environ.get("OUT", "benchmarks/results"))
    out.mkdir(parents=True, exist_ok=True)
    (out / f"gpu_deepseek_v4_host_gap_{res['date']}_{commit}.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
