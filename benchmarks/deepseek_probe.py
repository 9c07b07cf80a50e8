"""What a fresh DeepSeek engine does to its first users, and what runs inside a timed window (issue 34, item 5).

Shared by `gpu_deepseek_v4.py` and `gpu_deepseek_v41.py`:
- `start_up(llm)`: the engine's own start-up figures (graphs captured at start and their seconds, the warm-up's
  seconds and the Triton compiles it took), after running `LLMEngine.warm_up` as `openinfer serve` does;
- `first_traffic(eng, ...)`: online-like traffic right after start-up (requests arriving in waves, prompts and
  outputs of many lengths), every step timed; the same traffic again for the steady step times; reports the
  steps over 100 ms, the slowest step, the total, the steady p99, and the compiles and captures during each round
  (the issue's targets: no step over 3x the steady p99 and none over 250 ms after start-up returns);
- `InWindow`: Triton compiles and graph captures inside a timed window (must be 0).
"""

from __future__ import annotations

import time

import torch

from openinfer import SamplingParams


def _counters(eng) -> tuple[int | None, int]:
    """(Triton compiles so far, or None where no counter is installed (no GPU), graph captures so far)."""
    s = eng.stats()
    return s["jit_compiles"], s["graph_captures"]


def _moved(a: int | None, b: int | None) -> int | None:
    return None if a is None or b is None else b - a


class InWindow:
    """`with InWindow(eng) as w: ...` then `w.result`: compiles and captures while the block ran."""

    def __init__(self, eng):
        self.eng = eng

    def __enter__(self):
        self.start = _counters(self.eng)
        return self

    def __exit__(self, *exc):
        end = _counters(self.eng)
        self.result = {"jit_compiles_in_window": _moved(self.start[0], end[0]),
                       "graph_captures_in_window": end[1] - self.start[1]}
        return False


def start_up(llm, construct_s: float) -> dict:
    """Run the server's warm-up on a just-built engine; the engine's start-up figures."""
    eng = llm.engine
    before = eng.stats()
    warm_s = eng.warm_up()
    after = eng.stats()
    return {"construct_s": construct_s, "graph_captures_at_start": before["graph_captures"],
            "graph_capture_s": before["graph_capture_s"], "jit_compiles_before_warm_up": before["jit_compiles"],
            "warm_up_s": warm_s, "jit_compiles_in_warm_up": _moved(before["jit_compiles"], after["jit_compiles"])}


def _traffic(eng, n_requests: int, waves: int, steps_between: int, vocab: int, seed: int,
             prompt_range: tuple[int, int], output_range: tuple[int, int]) -> dict:
    g = torch.Generator().manual_seed(seed)
    per_wave = -(-n_requests // waves)
    pending = []
    for i in range(n_requests):
        n = int(torch.randint(*prompt_range, (1,), generator=g))
        out = int(torch.randint(*output_range, (1,), generator=g))
        pending.append((torch.randint(100, vocab, (n,), generator=g).tolist(),
                        SamplingParams(max_tokens=out, ignore_eos=True, temperature=0.0 if i % 2 else 0.8)))
    c0 = _counters(eng)
    steps, added, k = [], 0, 0
    t_all = time.perf_counter()
    while added < n_requests or eng.has_unfinished_requests():
        if added < n_requests and k % steps_between == 0:
            for prompt, params in pending[added:added + per_wave]:
                eng.add_request(prompt, params)
            added = min(n_requests, added + per_wave)
        torch.cuda.synchronize()
        t = time.perf_counter()
        eng.step()
        torch.cuda.synchronize()
        steps.append(time.perf_counter() - t)
        k += 1
    total = time.perf_counter() - t_all
    c1 = _counters(eng)
    ms = sorted(s * 1e3 for s in steps)
    return {"steps": len(steps), "total_s": total, "slowest_ms": ms[-1], "p50_ms": ms[len(ms) // 2],
            "p99_ms": ms[min(len(ms) - 1, int(0.99 * len(ms)))], "steps_over_100ms": sum(m > 100 for m in ms),
            "seconds_in_steps_over_100ms": sum(m for m in ms if m > 100) / 1e3,
            "jit_compiles": _moved(c0[0], c1[0]), "graph_captures": c1[1] - c0[1]}


def first_traffic(eng, vocab: int, n_requests: int = 96, waves: int = 6, steps_between: int = 24,
                  prompt_range: tuple[int, int] = (64, 2048), output_range: tuple[int, int] = (32, 192)) -> dict:
    """The traffic twice on the same engine: `first` right after start-up, `again` with everything warm (its p99 is
    the steady step); `max_over_steady_p99` is the issue's ratio (target <= 3, and no first step over 250 ms)."""
    first = _traffic(eng, n_requests, waves, steps_between, vocab, 1, prompt_range, output_range)
    again = _traffic(eng, n_requests, waves, steps_between, vocab, 1, prompt_range, output_range)
    return {"requests": n_requests, "waves": waves, "prompt_range": prompt_range, "output_range": output_range,
            "first": first, "again": again, "max_over_steady_p99": first["slowest_ms"] / again["p99_ms"]}
