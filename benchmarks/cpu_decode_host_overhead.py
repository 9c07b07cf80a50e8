"""CPU: the engine's host work per decode step at a wide batch (openinfer issue 34), DeepSeek-V4-tiny.

On the GPU a decode step's device work (the graph replay, the LM head, the sampler) is queued and runs while the
host schedules, prepares and processes; what the host spends per step beyond that shows as a gap between the
step's wall time and its kernels' time. Here, on the CPU, that device work runs synchronously, so it is timed
apart and subtracted: `host_ms` = a step's wall time minus the time spent inside the model's forward, its
`compute_logits` and the sampler. Async scheduling is on, as on the GPU (the step queues step N+1 before reading
step N back). Per step: wall, device (forward + logits + sampler) and host ms, the phases' host ms, and the step's
CPU time on this thread (with --stub the host work; less disturbed by other load on a shared machine than wall
time); `--profile` adds Python function calls per step (deterministic) and the functions with the most
cumulative time (cProfile, device work included under its callers: read it together with the device column).

    PYTHONPATH=. python benchmarks/cpu_decode_host_overhead.py [--batch 128] [--context 256] [--steps 20] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import time

import torch


class DeviceTimer:
    """Wraps the runner's device-work entry points (model forward, compute_logits, sampler) and sums their time.
    `stub`: replace them with near-free stand-ins (zeros hidden rows, one-column logits, token 7 sampled), so a
    step's wall time is its host work (cProfile then shows the host alone); outputs are then meaningless."""

    def __init__(self, runner, stub: bool = False):
        self.seconds = 0.0
        model = runner.model
        if stub:
            from openinfer.sampling.sampler import SamplerOutput

            hidden = model.config.hidden_size
            model.forward = lambda ids, *a, **k: torch.zeros(ids.shape[0], hidden)
            model.compute_logits = lambda h: torch.zeros(h.shape[0], 1)
            runner.sampler = lambda logits, meta, gen=None: SamplerOutput(
                token_ids=torch.full((logits.shape[0],), 7, dtype=torch.long))
        model.forward = self._timed(model.forward)
        model.compute_logits = self._timed(model.compute_logits)
        runner.sampler = self._timed(runner.sampler)

    def _timed(self, fn):
        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.seconds += time.perf_counter() - t
        return wrapper


def build(batch: int, context: int, steps: int, model: str):
    from openinfer import LLM, SamplingParams

    llm = LLM(model, device="cpu", dtype="float32", max_num_seqs=batch, max_num_batched_tokens=max(2048, batch),
              enable_prefix_caching=False, async_scheduling=True)
    eng = llm.engine
    g = torch.Generator().manual_seed(batch)
    for _ in range(batch):
        eng.add_request(torch.randint(100, 128000, (context,), generator=g).tolist(),
                        SamplingParams(temperature=0, max_tokens=3 * steps + 16, ignore_eos=True))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in eng.requests.values()):
        eng.step()
    for _ in range(4):
        eng.step()
    return eng


def measure(eng, steps: int, profile: bool, timer: "DeviceTimer") -> dict:
    # the step's phases (host time; execute's device work is subtracted per step)
    phases = {"schedule": 0.0, "execute": 0.0, "process": 0.0}
    originals = (eng.scheduler.schedule, eng.runner.execute, eng._process)

    def timed(key, fn):
        def wrapper(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                phases[key] += time.perf_counter() - t
        return wrapper

    eng.scheduler.schedule, eng.runner.execute, eng._process = (timed(k, f) for k, f in zip(phases, originals))
    walls, devices, per_step, cpu = [], [], [], []
    prof = cProfile.Profile() if profile else None
    for _ in range(steps):
        d0, p0 = timer.seconds, dict(phases)
        t, c = time.perf_counter(), time.thread_time()
        if prof is not None:
            prof.enable()
        eng.step()
        if prof is not None:
            prof.disable()
        walls.append(time.perf_counter() - t)
        cpu.append(time.thread_time() - c)
        devices.append(timer.seconds - d0)
        per_step.append({k: phases[k] - p0[k] for k in phases})
        per_step[-1]["execute"] -= devices[-1]        # the execute phase's host work
    eng.scheduler.schedule, eng.runner.execute, eng._process = originals
    host = sorted((w - d) * 1e3 for w, d in zip(walls, devices))
    res = {"steps": steps, "wall_ms": sum(walls) / steps * 1e3, "device_ms": sum(devices) / steps * 1e3,
           "host_ms_mean": sum(host) / steps, "host_ms_median": host[steps // 2], "host_ms_min": host[0],
           # the step's CPU time on this thread (with --stub: its host work), robust to other load on the machine
           "step_thread_cpu_ms_median": sorted(cpu)[steps // 2] * 1e3,
           "phase_ms_median": {k: sorted(p[k] for p in per_step)[steps // 2] * 1e3 for k in phases}}
    if prof is not None:
        s = io.StringIO()
        stats = pstats.Stats(prof, stream=s)
        res["python_calls_per_step"] = stats.total_calls / steps     # deterministic: a noise-free proxy
        stats.sort_stats("cumulative").print_stats(45)
        res["profile"] = s.getvalue()
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--model", default="deepseek-v4-tiny")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--stub", action="store_true", help="near-free stand-ins for the forward, LM head and sampler")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    eng = build(args.batch, args.context, args.steps, args.model)
    timer = DeviceTimer(eng.runner, args.stub)
    res = {"batch": args.batch, "context": args.context, "model": args.model, "stub": args.stub,
           **measure(eng, args.steps, False, timer)}
    if args.profile:
        prof = measure(eng, min(args.steps, 8 if not args.stub else args.steps), True, timer)
        res["python_calls_per_step"], res["profile"] = prof["python_calls_per_step"], prof["profile"]
    profile = res.pop("profile", None)
    print(json.dumps(res, indent=1))
    if profile:
        print(profile)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({**res, **({"profile": profile} if profile else {})}, f, indent=1)


if __name__ == "__main__":
    main()
