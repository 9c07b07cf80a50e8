"""Hopper benchmark in one device call: a Llama-3-8B-shaped model with random bf16 weights through the engine.

Measures, in the same run: copy bandwidth and bf16 matmul peak (the ceilings), then
 (a) decode step time at batch 1/8/64/256 with 1K context vs the floor max(bytes/BW, flops/peak),
 (b) prefill MFU for one 8K-token chunk,
 (c) OW-256x512 offline throughput (256 requests, prompts U[100,1024] seed 0, 512 output tokens, EOS ignored),
     and HF transformers `generate_batch` (continuous batching) on a model of the same shape,
 (d) GPU idle fraction of a decode step: 1 - (forward time, the captured graph replayed back to back) / (step
     time, steps run back to back), with async scheduling on and off (decode and OW run in both modes),
 (e) `cached_ttft`: time to first token of one request over a cached prefix vs the same prompt cold
     (8K and 16K prompts, its own engine with max_model_len 16384),
 (f) `mixed_host`: host time vs GPU forward time of mixed steps (256 decode rows + one 512- or 2048-token
     prefill chunk), async scheduling on.
Writes JSON to $OUT (or benchmarks/results/) and prints a table last.

    python benchmarks/gpu_llama8b.py --tokenizer-json PATH [--hf-requests 64] [--skip-hf] [--only JOB ...]

Jobs (--only picks some; default all): decode prefill_8k ow_256x512 mixed_host decode_sync ow_256x512_sync
cached_ttft hf_generate_batch. `--only-decode` = `--only decode`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import tempfile
import time
import traceback
from pathlib import Path
from statistics import median

import torch

from openinfer import LLM, SamplingParams
from openinfer.benchmarks.offline import OfflineWorkload, run_offline

LLAMA3_8B = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256, hidden_size=4096,
                 intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                 head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=8192,
                 tie_word_embeddings=False, bos_token_id=0, eos_token_id=1)
# --tiny (hidden, CPU debugging of the job functions): the same family at toy size, the same vocabulary
LLAMA_TINY = dict(LLAMA3_8B, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16)

JOBS = ["decode", "prefill_8k", "ow_256x512", "mixed_host", "decode_sync", "ow_256x512_sync", "cached_ttft",
        "hf_generate_batch"]


def timed(fn, reps: int = 20) -> float:
    """Median seconds of `fn` on the GPU over `reps` runs (CUDA events), after one warm-up run."""
    fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(reps):
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) / 1e3)
    return sorted(times)[len(times) // 2]


def ceilings() -> dict:
    x = torch.empty(1 << 30, dtype=torch.bfloat16, device="cuda").normal_()   # 2 GiB
    y = torch.empty_like(x)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    t_copy = timed(lambda: y.copy_(x), 10)
    t_mm = timed(lambda: a @ b, 10)
    return {"copy_TBps": 2 * x.numel() * 2 / t_copy / 1e12, "bf16_matmul_TFLOPs": 2 * 8192**3 / t_mm / 1e12}


def model_dir(tokenizer_json: str, config: dict | None = None, max_position_embeddings: int | None = None) -> Path:
    cfg = dict(config or LLAMA3_8B)
    if max_position_embeddings is not None:
        cfg["max_position_embeddings"] = max_position_embeddings
    d = Path(tempfile.mkdtemp(prefix="llama3-8b-shape-"))
    (d / "config.json").write_text(json.dumps(cfg))
    shutil.copy(tokenizer_json, d / "tokenizer.json")
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<｜end▁of▁sentence｜>"}))
    return d


def param_count(llm: LLM) -> tuple[int, int]:
    m = llm.engine.runner.model
    total = sum(p.numel() for p in m.parameters())
    return total, total - m.embed_tokens.weight.numel()   # the embedding is a lookup, not a matmul


_BATCHES: list[int] = []


def args_batches() -> list[int]:
    return _BATCHES


def start_decoding(eng, batch: int, ctx: int, max_tokens: int, warmup: int) -> None:
    """`batch` random prompts of `ctx` tokens, prefilled, then `warmup` decode steps (graphs captured); after that
    every request can still decode `max_tokens` tokens. With chunked prefill the first requests decode while the
    last are prefilled (17 steps for 128 x 1K at 8K tokens a step): their budget counts those steps and the warm-up
    too, so no request finishes inside the caller's measured steps and the batch stays `batch` wide."""
    budget = eng.config.max_num_batched_tokens
    prefill_steps = -(-batch * ctx // max(1, budget - batch)) + 1     # (decode rows take part of each step's budget)
    g = torch.Generator().manual_seed(batch)
    for _ in range(batch):
        eng.add_request(torch.randint(100, 128000, (ctx,), generator=g).tolist(),
                        SamplingParams(temperature=0, max_tokens=max_tokens + prefill_steps + warmup, ignore_eos=True))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in eng.requests.values()):
        eng.step()
    for _ in range(warmup):
        eng.step()
    assert len(eng.scheduler.running) == batch, (len(eng.scheduler.running), batch)


def decode_steps(llm: LLM, batch: int, ctx: int, ceil: dict, steps: int = 30) -> dict:
    eng = llm.engine
    start_decoding(eng, batch, ctx, steps + 20, warmup=3)
    torch.cuda.synchronize()
    torch.cuda.synchronize()
    # observers (the originals still run): host time per phase, and CUDA events around each step's queued
    # work — the GPU reaches step k's start event only when step k-1 is done AND the host has queued k, so
    # elapsed(end of k-1, start of k) is time the GPU sat idle between steps
    events, host = [], {"schedule": 0.0, "execute": 0.0, "process": 0.0}
    originals = (eng.scheduler.schedule, eng.runner.execute, eng._process)

    def timed(key, fn, mark=False):
        def wrapper(*a, **k):
            t = time.perf_counter()
            if mark:
                start = torch.cuda.Event(enable_timing=True)
                start.record()
            r = fn(*a, **k)
            if mark:
                end = torch.cuda.Event(enable_timing=True)
                end.record()
                events.append((start, end))
            host[key] += time.perf_counter() - t
            return r
        return wrapper

    eng.scheduler.schedule = timed("schedule", originals[0])
    eng.runner.execute = timed("execute", originals[1], mark=True)
    eng._process = timed("process", originals[2])
    t0 = time.perf_counter()
    for _ in range(steps):          # no sync per step: async scheduling overlaps consecutive steps
        eng.step()
    torch.cuda.synchronize()
    step = (time.perf_counter() - t0) / steps
    eng.scheduler.schedule, eng.runner.execute, eng._process = originals
    gaps = sum(max(0.0, events[i - 1][1].elapsed_time(events[i][0])) for i in range(1, len(events)))
    span = events[0][0].elapsed_time(events[-1][1])
    idle_measured = gaps / span if span > 0 else float("nan")
    # GPU time of the forward alone: the captured graph replayed back to back (device saturated)
    runner = eng.runner
    bucket = next((k for k in sorted(runner.decode_graphs.graphs) if k[0] >= batch), None)
    fwd = float("nan")
    if bucket is not None:
        graph = runner.decode_graphs.graphs[bucket][0]
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        graph.replay()
        s.record()
        for _ in range(10):
            graph.replay()
        e.record()
        e.synchronize()
        fwd = s.elapsed_time(e) / 1e3 / 10
    profile = None
    if batch == max(args_batches()):
        import cProfile
        import io
        import pstats
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(5):
            eng.step()
        torch.cuda.synchronize()
        prof.disable()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(14)
        profile = buf.getvalue()[-3500:]
    for rid in list(eng.requests):
        eng.abort_request(rid)
    total, nonembed = param_count(llm)
    c = eng.model_config
    kv_bytes_per_token = c.num_hidden_layers * 2 * c.num_key_value_heads * c.head_dim * 2
    avg_ctx = ctx + 3 + steps / 2
    bytes_moved = nonembed * 2 + batch * avg_ctx * kv_bytes_per_token
    flops = 2 * nonembed * batch + 4 * batch * avg_ctx * c.num_attention_heads * c.head_dim * c.num_hidden_layers
    floor = max(bytes_moved / (ceil["copy_TBps"] * 1e12), flops / (ceil["bf16_matmul_TFLOPs"] * 1e12))
    return {"batch": batch, "context": ctx, "step_ms": step * 1e3, "floor_ms": floor * 1e3,
            "ratio_to_floor": step / floor, "graph_forward_ms": fwd * 1e3, "forward_ratio_to_floor": fwd / floor,
            "gpu_idle_fraction": max(0.0, 1 - fwd / step), "gpu_idle_between_steps_measured": idle_measured,
            "host_ms_per_step": {k: v / steps * 1e3 for k, v in host.items()}, "cpu_profile_5_steps": profile}


def prefill_mfu(llm: LLM, n: int, ceil: dict) -> dict:
    eng = llm.engine
    g = torch.Generator().manual_seed(7)
    times = []
    for _ in range(3):
        eng.add_request(torch.randint(0, 128000, (n,), generator=g).tolist(), SamplingParams(max_tokens=1))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        eng.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        while eng.has_unfinished_requests():
            eng.step()
    c = eng.model_config
    _, nonembed = param_count(llm)
    flops = 2 * nonembed * n + 2 * n * n * c.num_attention_heads * c.head_dim * c.num_hidden_layers  # causal QK+PV
    t = min(times)
    return {"tokens": n, "time_ms": t * 1e3, "TFLOPs": flops / t / 1e12,
            "mfu_vs_measured_peak": flops / t / (ceil["bf16_matmul_TFLOPs"] * 1e12)}


# ---- helpers shared by the cached-TTFT and mixed-step jobs (CPU-safe, for --device cpu --tiny) --------------
def _cuda() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def _sync() -> None:
    if _cuda():
        torch.cuda.synchronize()


class _HostEvent:
    """A stand-in for torch.cuda.Event on the CPU (host clock): the job functions run there too (--tiny)."""

    def record(self) -> None:
        self.t = time.perf_counter()

    def elapsed_time(self, other: "_HostEvent") -> float:
        return (other.t - self.t) * 1e3

    def synchronize(self) -> None:
        pass


def _event():
    return torch.cuda.Event(enable_timing=True) if _cuda() else _HostEvent()


def prefill_flops(nonembed: int, n_layers: int, n_heads: int, head_dim: int, cached: int, total: int) -> float:
    """FLOPs of computing prompt positions [cached, total) over a cached prefix of `cached` tokens.

    The formula of `prefill_mfu`, with the attention term summed exactly over the computed tokens:
        linear    = 2 * nonembed * n                                   (n = total - cached: ~ new tokens)
        attention = 2 * 2 * H * D * L * sum_{i=cached+1}^{total} i     (QK^T and PV, causal: token i sees i
                  = 2 * H * D * L * (total*(total+1) - cached*(cached+1))    positions; ~ new tokens x context)
    `nonembed` counts every parameter but the embedding (the lm_head included, although prefill computes
    logits for the last row only: the same overcount as prefill_mfu). For cached=0 the attention term is
    2*H*D*L*n*(n+1), prefill_mfu's 2*n*n*H*D*L up to the diagonal."""
    n = total - cached
    return 2.0 * nonembed * n + 2.0 * n_heads * head_dim * n_layers * (total * (total + 1) - cached * (cached + 1))


def cached_ttft(llm: LLM, cases: list[tuple[int, int]], reps: int = 3, seed: int = 11) -> list[dict]:
    """Time to first token through `LLM.generate` (SamplingParams(max_tokens=1), one request at a time) of a
    prompt of P tokens: cold (fresh random tokens, nothing of it cached) vs cached (a warming request with
    prompt A first, then A[:P-new] + `new` fresh tokens). The prefix cache matches whole blocks, so
    floor((P-new)/block)*block tokens are cached and P minus that are computed; the cached count reported is
    the engine's (`RequestOutput.num_cached_tokens`). Median of `reps` timings, each on different prompts; one
    untimed cold + cached pair per case first (kernel warm-up)."""
    eng = llm.engine
    c = eng.model_config
    bs, chunk = eng.config.block_size, eng.config.max_num_batched_tokens
    _, nonembed = param_count(llm)
    g = torch.Generator().manual_seed(seed)

    def rand(n: int) -> list[int]:
        return torch.randint(100, 128000, (n,), generator=g).tolist()

    def ttft(prompt: list[int]) -> tuple[float, int]:
        _sync()
        t0 = time.perf_counter()
        out = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(max_tokens=1), use_tqdm=False)
        _sync()
        return time.perf_counter() - t0, out[0].num_cached_tokens

    def cached_run(p: int, new: int) -> tuple[float, int, int]:
        a = rand(p)
        _, warm_cached = ttft(a)                      # the warming request: its blocks enter the prefix cache
        t, n_cached = ttft(a[:p - new] + rand(new))
        return t, n_cached, warm_cached

    rows = []
    for p, new in cases:
        ttft(rand(p))
        cached_run(p, new)
        cold = [ttft(rand(p)) for _ in range(reps)]
        cached = [cached_run(p, new) for _ in range(reps)]
        n_cached = sorted({r[1] for r in cached})
        expected = (p - new) // bs * bs
        cached_tokens = n_cached[0]
        f_cold = prefill_flops(nonembed, c.num_hidden_layers, c.num_attention_heads, c.head_dim, 0, p)
        f_cached = prefill_flops(nonembed, c.num_hidden_layers, c.num_attention_heads, c.head_dim, cached_tokens, p)
        cold_s, cached_s = median(t for t, _ in cold), median(t for t, _, _ in cached)
        rows.append({
            "prompt_tokens": p, "new_tokens": new, "cached_tokens": cached_tokens,
            "cached_tokens_expected": expected, "cached_tokens_all_runs": n_cached,
            "cached_tokens_source": "RequestOutput.num_cached_tokens",
            "cold_cached_tokens_all_runs": sorted({n for _, n in cold} | {r[2] for r in cached}),
            "computed_tokens": p - cached_tokens,
            "max_num_batched_tokens": chunk, "cold_chunks": -(-p // chunk),
            "cached_chunks": -(-(p - cached_tokens) // chunk),
            "cold_ms": cold_s * 1e3, "cached_ms": cached_s * 1e3, "ratio_cached_to_cold": cached_s / cold_s,
            "compute_fraction": f_cached / f_cold, "cold_TFLOPs": f_cold / cold_s / 1e12,
            "cached_TFLOPs": f_cached / cached_s / 1e12,
            "cold_ms_all": [t * 1e3 for t, _ in cold], "cached_ms_all": [t * 1e3 for t, _, _ in cached]})
        print("cached_ttft", json.dumps(rows[-1]), flush=True)
    return rows


def mixed_host(llm: LLM, batch: int = 256, ctx: int = 1024, prompt_lens: tuple[int, ...] = (512, 2048),
               reps: int = 5, decode_between: int = 3, sleep_cycles: int = 200_000_000) -> dict:
    """Host overhead of mixed prefill+decode steps: `batch` requests decoding at ~`ctx` context (EOS ignored),
    then one request with a prompt of P tokens (max_tokens=1), so that the next step is mixed: `batch` decode
    rows + the P-token prefill chunk (eager forward: no CUDA graph). Async scheduling as the engine has it.

    Per mixed step, with the originals wrapped (they still run), `decode_steps`' approach:
      host_queue_ms     host time of the step's schedule() + execute() (Python until the step's device work is
                        queued; CUDA calls inside execute return without waiting for the GPU), split into
                        schedule_ms, execute_ms, of which forward_launch_ms (the `_eager_forward` call itself)
      process_ms        reading the step back in the next step() call (the wait for its GPU work included)
      forward_ms        CUDA events around `_eager_forward`: GPU time of the model forward, plus any time the GPU
                        waited for the host to launch its kernels
      forward_gpu_ms    the same events in extra steps where the GPU is first held busy (torch.cuda._sleep)
                        while the host queues the whole forward: GPU time of the forward alone
      step_gpu_ms       events around execute(): all the step's device work (inputs, forward, logits, sampling)
      gpu_idle_before_ms  GPU idle between the previous step's work and this one's (events, as decode_steps)
      wall_ms           the step's period: end of the next step() call (which reads this step back) minus end
                        of this one; under async scheduling the time the pipeline spends on this step
    and the same for the decode-only steps in between (`decode_only`, the steady-state reference). The
    scheduler's max_num_seqs is raised to batch + 1 for the job so the prompt is admitted next to the batch."""
    eng, runner = llm.engine, llm.engine.runner
    sched_orig_seqs = eng.scheduler.max_num_seqs
    eng.scheduler.max_num_seqs = max(sched_orig_seqs, batch + 1)
    steps_needed = 3 + len(prompt_lens) * (reps * 2 + 1) * (decode_between + 2) + 10
    start_decoding(eng, batch, ctx, steps_needed + 100, warmup=3)
    _sync()
    g = torch.Generator().manual_seed(1234)
    cur: dict = {}
    state = {"saturate": False}
    originals = {"schedule": eng.scheduler.schedule, "execute": runner.execute, "_process": eng._process,
                 "_eager_forward": runner._eager_forward,
                 "_graph_forward": runner.decode_graphs.replay if runner.decode_graphs is not None else None}

    def schedule(*a, **k):
        t = time.perf_counter()
        out = originals["schedule"](*a, **k)
        cur["schedule_s"] = time.perf_counter() - t
        cur["decode_rows"] = sum(1 for x in out.scheduled if x.num_new_tokens == 1)
        cur["prefill_tokens"] = sum(x.num_new_tokens for x in out.scheduled if x.num_new_tokens > 1)
        return out

    def execute(*a, **k):
        t = time.perf_counter()
        s, e = _event(), _event()
        s.record()
        out = originals["execute"](*a, **k)
        e.record()
        cur["execute_s"] = time.perf_counter() - t
        cur["step_events"] = (s, e)
        return out

    def process(*a, **k):
        t = time.perf_counter()
        out = originals["_process"](*a, **k)
        cur["process_s"] = cur.get("process_s", 0.0) + time.perf_counter() - t
        return out

    def forward(key):
        def wrapper(*a, **k):
            if state["saturate"] and _cuda():
                torch.cuda._sleep(sleep_cycles)    # the GPU busy while the host queues the forward
            t = time.perf_counter()
            s, e = _event(), _event()
            s.record()
            out = originals[key](*a, **k)
            e.record()
            cur["forward_launch_s"] = time.perf_counter() - t
            cur["forward_events"] = (s, e)
            cur["forward_kind"] = key
            return out
        return wrapper

    eng.scheduler.schedule, runner.execute, eng._process = schedule, execute, process
    runner._eager_forward = forward("_eager_forward")
    if originals["_graph_forward"] is not None:
        runner.decode_graphs.replay = forward("_graph_forward")
    records: list[dict] = []

    def step(tag: str) -> None:
        cur.clear()
        cur["tag"] = tag
        eng.step()
        cur["end"] = time.perf_counter()
        records.append(dict(cur))

    res: dict = {"batch": batch, "context": ctx, "reps": reps,
                 "async_scheduling": eng.config.use_async_scheduling, "cases": []}
    try:
        for _ in range(decode_between):
            step("decode")
        for p in prompt_lens:
            case_records: list[tuple[int, str]] = []
            for rep in range(-1, 2 * reps):     # rep -1: warm-up; reps..2*reps-1: GPU saturated (forward_gpu_ms)
                kind = "warmup" if rep < 0 else ("natural" if rep < reps else "saturated")
                eng.add_request(torch.randint(100, 128000, (p,), generator=g).tolist(),
                                SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
                state["saturate"] = kind == "saturated"
                step(f"mixed_{kind}")
                state["saturate"] = False
                case_records.append((len(records) - 1, kind))
                for _ in range(decode_between):
                    step("decode")
            _sync()
            res["cases"].append({"prompt_tokens": p, "records": case_records})
    finally:
        eng.scheduler.schedule, runner.execute, eng._process = (originals["schedule"], originals["execute"],
                                                                originals["_process"])
        runner._eager_forward = originals["_eager_forward"]
        if originals["_graph_forward"] is not None:
            runner.decode_graphs.replay = originals["_graph_forward"]
        eng.scheduler.max_num_seqs = sched_orig_seqs
        for rid in list(eng.requests):
            eng.abort_request(rid)
        eng.step()             # read back the step still in flight
    _sync()

    def measures(i: int) -> dict:
        r, nxt, prv = records[i], records[i + 1], records[i - 1]
        m = {"decode_rows": r["decode_rows"], "prefill_tokens": r["prefill_tokens"],
             "forward_kind": r.get("forward_kind"),
             "schedule_ms": r["schedule_s"] * 1e3, "execute_ms": r["execute_s"] * 1e3,
             "forward_launch_ms": r.get("forward_launch_s", float("nan")) * 1e3,
             "host_queue_ms": (r["schedule_s"] + r["execute_s"]) * 1e3,
             "process_ms": nxt.get("process_s", float("nan")) * 1e3,
             "wall_ms": (nxt["end"] - r["end"]) * 1e3}
        if "forward_events" in r:
            m["forward_ms"] = r["forward_events"][0].elapsed_time(r["forward_events"][1])
        s, e = r["step_events"]
        m["step_gpu_ms"] = s.elapsed_time(e)
        if "step_events" in prv:
            m["gpu_idle_before_ms"] = max(0.0, prv["step_events"][1].elapsed_time(s))
        return m

    def summary(ms: list[dict]) -> dict:
        keys = [k for k in ms[0] if isinstance(ms[0][k], float)]
        return {k: median(m[k] for m in ms) for k in keys} | {
            "decode_rows": ms[0]["decode_rows"], "prefill_tokens": ms[0]["prefill_tokens"],
            "forward_kind": ms[0]["forward_kind"]}

    res["sleep_ms"] = float("nan")
    if _cuda():      # how long the GPU is held busy before the forward in the saturated steps
        s, e = _event(), _event()
        s.record()
        torch.cuda._sleep(sleep_cycles)
        e.record()
        e.synchronize()
        res["sleep_ms"] = s.elapsed_time(e)
    decode_idx = [i for i, r in enumerate(records[:-1]) if r["tag"] == "decode" and i > 0
                  and records[i - 1]["tag"] == "decode" and records[i + 1]["tag"] == "decode"]
    res["decode_only"] = summary([measures(i) for i in decode_idx])
    for case in res.pop("cases"):
        natural = [measures(i) for i, k in case["records"] if k == "natural"]
        saturated = [measures(i) for i, k in case["records"] if k == "saturated"]
        row = summary(natural)
        row["forward_gpu_ms"] = median(m["forward_ms"] for m in saturated) if _cuda() else float("nan")
        # valid only if the host queued the whole forward before the GPU finished sleeping
        row["saturated_forward_launch_ms"] = max(m["forward_launch_ms"] for m in saturated)
        row["forward_gpu_ms_valid"] = _cuda() and row["saturated_forward_launch_ms"] < 0.8 * res["sleep_ms"]
        row["all_natural"] = natural
        res.setdefault("mixed", []).append({"prompt_tokens": case["prompt_tokens"], **row})
        print("mixed_host", case["prompt_tokens"], json.dumps({k: v for k, v in row.items() if k != "all_natural"}),
              flush=True)
    res["mixed_rows_ok"] = all(m["decode_rows"] == batch and m["prefill_tokens"] == m_p["prompt_tokens"]
                               for m_p in res["mixed"] for m in m_p["all_natural"])
    return res


def hf_generate_batch(d: Path, num_requests: int) -> dict:
    import transformers
    from transformers import GenerationConfig

    cfg = transformers.LlamaConfig(**{k: v for k, v in LLAMA3_8B.items() if k != "architectures"})
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    wl = OfflineWorkload(num_requests, (100, 1024), (512, 512), seed=0)
    prompts, _ = wl.build(128000)
    gen_cfg = GenerationConfig(max_new_tokens=512, min_new_tokens=512, do_sample=False, eos_token_id=-1,
                               pad_token_id=0)
    # generate_batch runs its own worker thread (no inference_mode around it: its tensors are updated in place)
    model.generate_batch(inputs=[p[:16] for p in prompts[:4]], generation_config=GenerationConfig(
        max_new_tokens=4, do_sample=False, eos_token_id=-1, pad_token_id=0), progress_bar=False)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = model.generate_batch(inputs=prompts, generation_config=gen_cfg, progress_bar=False)
    torch.cuda.synchronize()
    el = time.perf_counter() - t0
    n_out = sum(len(r.generated_tokens) for r in out.values())
    del model
    torch.cuda.empty_cache()
    return {"requests": num_requests, "output_tokens": n_out, "elapsed_s": el, "output_tok_per_s": n_out / el}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer-json", required=True)
    ap.add_argument("--hf-requests", type=int, default=64)
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 256])
    ap.add_argument("--only", nargs="+", choices=JOBS, metavar="JOB",
                    help=f"run only these jobs (default: all): {' '.join(JOBS)}")
    ap.add_argument("--only-decode", action="store_true", help="async decode steps only (quick) = --only decode")
    ap.add_argument("--prefill-path", choices=("paged", "sdpa"), default="paged",
                    help="sdpa: prefill chunks through the previous path (K/V gathered out of the pages, one SDPA "
                         "call per chunk), the peer of the paged Triton kernel in the same device call")
    ap.add_argument("--rotary-path", choices=("fused", "separate"), default="fused",
                    help="separate: RoPE on q and k and the KV write as three launches per layer (the previous "
                         "path), the peer of the fused rotate-and-write kernel in the same device call")
    ap.add_argument("--kv-cache-dtype", default="auto", help="the engines' kv_cache_dtype (e.g. fp8)")
    ap.add_argument("--device", default="cuda", help=argparse.SUPPRESS)   # debugging: --device cpu --tiny
    ap.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)  # toy model, prompts scaled down 8x
    args = ap.parse_args()
    _BATCHES[:] = args.batches
    if args.prefill_path == "sdpa":
        from openinfer.layers.attention import TorchPagedAttention
        from openinfer.layers.triton_attention import TritonPagedAttention

        TritonPagedAttention.prefill_into = TorchPagedAttention.prefill_into
    if args.rotary_path == "separate":
        from openinfer.layers.triton_attention import TritonPagedAttention

        TritonPagedAttention.applies_rotary = False          # the model rotates, the backend writes
    selected = set(args.only or ([] if args.only_decode else JOBS))
    if args.only_decode:
        selected.add("decode")
    if args.skip_hf:
        selected.discard("hf_generate_batch")
    cuda = args.device.startswith("cuda")
    scale = 8 if args.tiny else 1
    out_dir = Path(os.environ.get("OUT") or "benchmarks/results")
    res = {"benchmark": "gpu_llama8b", "gpu": torch.cuda.get_device_name() if cuda else "cpu",
           "date": datetime.date.today().isoformat(), "torch": torch.__version__, "jobs": sorted(selected, key=JOBS.index)}
    if args.tiny:
        res["tiny"] = True
    res["prefill_path"], res["kv_cache_dtype"] = args.prefill_path, args.kv_cache_dtype
    res["rotary_path"] = args.rotary_path
    suffix = "".join(f"_{x}" for x in (args.prefill_path, args.kv_cache_dtype, args.rotary_path)
                     if x not in ("paged", "auto", "fused"))
    # the device's copy of the tree may carry a stale .git: the caller's OPENINFER_COMMIT wins
    res["commit"] = os.environ.get("OPENINFER_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip() or "unknown"

    def save():
        (out_dir / f"gpu_llama8b{suffix}.json").write_text(json.dumps(res, indent=2) + "\n")

    def run_job(key, fn, *a):
        try:
            t0 = time.perf_counter()
            res[key] = fn(*a)
            print(key, json.dumps(res[key]), f"({time.perf_counter() - t0:.0f}s)", flush=True)
        except Exception:
            res[key] = {"error": traceback.format_exc()[-2000:]}
            print(key, "FAILED", res[key]["error"], flush=True)
        save()

    ceil = res["ceilings"] = ceilings() if cuda else {"copy_TBps": float("nan"), "bf16_matmul_TFLOPs": float("nan")}
    print("ceilings", ceil, flush=True)
    model_cfg = LLAMA_TINY if args.tiny else LLAMA3_8B
    engine_kw = dict(device=args.device, dtype="bfloat16" if cuda else "float32", load_format="dummy",
                     gpu_memory_utilization=0.85, kv_cache_dtype=args.kv_cache_dtype)
    d = model_dir(args.tokenizer_json, model_cfg)
    mixed_kw = dict(batch=16, ctx=128, prompt_lens=(64, 256), reps=2) if args.tiny else {}
    for mode in ("async", "sync"):
        jobs = [("decode", lambda m: [decode_steps(m, b, 1024, ceil) for b in args.batches]),
                ("prefill_8k", lambda m: prefill_mfu(m, 8192, ceil)),
                ("ow_256x512", lambda m: run_offline(m, OfflineWorkload(256, (100, 1024), (512, 512), seed=0),
                                                     use_tqdm=False)),
                ("mixed_host", lambda m: mixed_host(m, **mixed_kw))]
        if mode == "sync":
            jobs = [(f"{name}_sync", fn) for name, fn in jobs if name in ("decode", "ow_256x512")]
        jobs = [(name, fn) for name, fn in jobs if name in selected]
        if not jobs:
            continue
        t0 = time.perf_counter()
        llm = LLM(str(d), max_num_seqs=256, max_num_batched_tokens=8192, max_model_len=8192,
                  async_scheduling=mode == "async", **engine_kw)
        res[f"engine_startup_s_{mode}"] = time.perf_counter() - t0
        for name, fn in jobs:
            run_job(name, fn, llm)
        llm.shutdown()
        del llm
    if "cached_ttft" in selected:
        # its own engine: a 16000-token prompt needs max_model_len > 16000 (and the positions for it); with
        # max_num_batched_tokens 8192 a cold 16000-token prompt runs as two chunks (8192 + 7808)
        long_len = 16384 // scale
        t0 = time.perf_counter()
        llm = LLM(str(model_dir(args.tokenizer_json, model_cfg, max_position_embeddings=long_len)),
                  max_num_batched_tokens=8192 // scale, max_model_len=long_len, **engine_kw)
        res["engine_startup_s_cached_ttft"] = time.perf_counter() - t0
        cases = [(p // scale, n // scale) for p, n in ((8192, 64), (8192, 512), (8192, 2048), (16000, 512))]
        run_job("cached_ttft", cached_ttft, llm, cases)
        llm.shutdown()
        del llm
    if "hf_generate_batch" in selected:
        try:
            res["hf_generate_batch"] = hf_generate_batch(d, args.hf_requests)
            print("hf", json.dumps(res["hf_generate_batch"]), flush=True)
        except Exception:
            res["hf_generate_batch"] = {"error": traceback.format_exc()[-2000:]}
            print("hf FAILED", res["hf_generate_batch"]["error"], flush=True)
    save()
    print("\n| measure | value | floor / peak | ratio |\n|---|---|---|---|")
    for r in res.get("decode", []) if isinstance(res.get("decode"), list) else []:
        print(f"| decode b={r['batch']} ctx=1K | step {r['step_ms']:.2f} ms, forward {r['graph_forward_ms']:.2f} ms | "
              f"{r['floor_ms']:.2f} ms | {r['ratio_to_floor']:.2f}x (forward {r['forward_ratio_to_floor']:.2f}x, "
              f"outside graph {r['gpu_idle_fraction']:.0%}, idle measured {r['gpu_idle_between_steps_measured']:.1%}, "
              f"host ms {json.dumps({k: round(v, 2) for k, v in r['host_ms_per_step'].items()})}) |")
    p = res.get("prefill_8k", {})
    if "mfu_vs_measured_peak" in p:
        print(f"| prefill 8K | {p['time_ms']:.1f} ms, {p['TFLOPs']:.0f} TFLOP/s | {ceil['bf16_matmul_TFLOPs']:.0f} | "
              f"MFU {p['mfu_vs_measured_peak']:.2%} |")
    for r in res.get("decode_sync", []) if isinstance(res.get("decode_sync"), list) else []:
        print(f"| decode b={r['batch']} SYNC | step {r['step_ms']:.2f} ms | {r['floor_ms']:.2f} ms | "
              f"{r['ratio_to_floor']:.2f}x (idle {r['gpu_idle_fraction']:.0%}) |")
    for key in ("ow_256x512", "ow_256x512_sync"):
        o = res.get(key, {})
        if "output_tok_per_s" in o:
            print(f"| OW-256x512 openinfer {key} | {o['output_tok_per_s']:.0f} out tok/s | | |")
    for r in res.get("cached_ttft", []) if isinstance(res.get("cached_ttft"), list) else []:
        chunks = (f", cold = {r['cold_chunks']} chunks of <= {r['max_num_batched_tokens']}" if r["cold_chunks"] > 1
                  else "")
        print(f"| TTFT P={r['prompt_tokens']} new={r['new_tokens']} (cached {r['cached_tokens']}, computed "
              f"{r['computed_tokens']}{chunks}) | cold {r['cold_ms']:.1f} ms, cached {r['cached_ms']:.1f} ms | "
              f"compute fraction {r['compute_fraction']:.1%} | cached/cold {r['ratio_cached_to_cold']:.1%} |")
    mh = res.get("mixed_host", {})
    if "mixed" in mh:
        dec = mh["decode_only"]
        print(f"| decode-only step b={mh['batch']} ctx~{mh['context']} (reference) | wall {dec['wall_ms']:.2f} ms, "
              f"host queue {dec['host_queue_ms']:.2f} ms, forward {dec['forward_ms']:.2f} ms | | |")
        for r in mh["mixed"]:
            print(f"| mixed step b={mh['batch']} + {r['prompt_tokens']}-token prefill | wall {r['wall_ms']:.2f} ms, "
                  f"host queue {r['host_queue_ms']:.2f} ms (launch {r['forward_launch_ms']:.2f}), forward "
                  f"{r['forward_ms']:.2f} ms (GPU alone {r['forward_gpu_ms']:.2f}), GPU idle before "
                  f"{r.get('gpu_idle_before_ms', float('nan')):.2f} ms | | host/forward "
                  f"{r['host_queue_ms'] / r['forward_gpu_ms']:.2f} |")
    h = res.get("hf_generate_batch", {})
    if "output_tok_per_s" in h:
        print(f"| HF generate_batch ({h['requests']} req) | {h['output_tok_per_s']:.0f} out tok/s | | |")


if __name__ == "__main__":
    main()
