"""Hopper benchmark in one device call: a Llama-3-8B-shaped model with random bf16 weights through the engine.

Measures, in the same run: copy bandwidth and bf16 matmul peak (the ceilings), then
 (a) decode step time at batch 1/8/64/256 with 1K context vs the floor max(bytes/BW, flops/peak),
 (b) prefill MFU for one 8K-token chunk,
 (c) OW-256x512 offline throughput (256 requests, prompts U[100,1024] seed 0, 512 output tokens, EOS ignored),
     and HF transformers `generate_batch` (continuous batching) on a model of the same shape,
 (d) GPU idle fraction of a decode step: 1 - (forward time, the captured graph replayed back to back) / (step
     time, steps run back to back), with async scheduling on and off (decode and OW run in both modes).
Writes JSON to $OUT (or benchmarks/results/) and prints a table last.

    python benchmarks/gpu_llama8b.py --tokenizer-json PATH [--hf-requests 64] [--skip-hf]
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

import torch

from openinfer import LLM, SamplingParams
from openinfer.benchmarks.offline import OfflineWorkload, run_offline

LLAMA3_8B = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256, hidden_size=4096,
                 intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                 head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=8192,
                 tie_word_embeddings=False, bos_token_id=0, eos_token_id=1)


def ceilings() -> dict:
    x = torch.empty(1 << 30, dtype=torch.bfloat16, device="cuda").normal_()   # 2 GiB
    y = torch.empty_like(x)
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)

    def timed(fn, reps):
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
    t_copy = timed(lambda: y.copy_(x), 10)
    t_mm = timed(lambda: a @ b, 10)
    return {"copy_TBps": 2 * x.numel() * 2 / t_copy / 1e12, "bf16_matmul_TFLOPs": 2 * 8192**3 / t_mm / 1e12}


def model_dir(tokenizer_json: str) -> Path:
    d = Path(tempfile.mkdtemp(prefix="llama3-8b-shape-"))
    (d / "config.json").write_text(json.dumps(LLAMA3_8B))
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
    """`batch` random prompts of `ctx` tokens, prefilled, then `warmup` decode steps (graphs captured)."""
    g = torch.Generator().manual_seed(batch)
    for _ in range(batch):
        eng.add_request(torch.randint(100, 128000, (ctx,), generator=g).tolist(),
                        SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in eng.requests.values()):
        eng.step()
    for _ in range(warmup):
        eng.step()


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
    bucket = next((k for k in sorted(runner.graphs) if k[0] >= batch), None)
    fwd = float("nan")
    if bucket is not None:
        graph = runner.graphs[bucket][0]
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
    ap.add_argument("--only-decode", action="store_true", help="async decode steps only (quick)")
    args = ap.parse_args()
    _BATCHES[:] = args.batches
    out_dir = Path(os.environ.get("OUT") or "benchmarks/results")
    res = {"benchmark": "gpu_llama8b", "gpu": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(),
           "torch": torch.__version__}
    try:
        res["commit"] = subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True).strip()
    except Exception:
        res["commit"] = os.environ.get("OPENINFER_COMMIT", "unknown")

    def save():
        (out_dir / "gpu_llama8b.json").write_text(json.dumps(res, indent=2) + "\n")

    ceil = res["ceilings"] = ceilings()
    print("ceilings", ceil, flush=True)
    d = model_dir(args.tokenizer_json)
    for mode in ("async",) if args.only_decode else ("async", "sync"):
        t0 = time.perf_counter()
        llm = LLM(str(d), device="cuda", dtype="bfloat16", load_format="dummy", max_num_seqs=256,
                  max_num_batched_tokens=8192, max_model_len=8192, gpu_memory_utilization=0.85,
                  async_scheduling=mode == "async")
        res[f"engine_startup_s_{mode}"] = time.perf_counter() - t0
        jobs = [("decode", lambda m: [decode_steps(m, b, 1024, ceil) for b in args.batches]),
                ("ow_256x512", lambda m: run_offline(m, OfflineWorkload(256, (100, 1024), (512, 512), seed=0),
                                                     use_tqdm=False))]
        if args.only_decode:
            jobs = jobs[:1]
        elif mode == "async":
            jobs.insert(1, ("prefill_8k", lambda m: prefill_mfu(m, 8192, ceil)))
        for name, fn in jobs:
            key = name if mode == "async" else f"{name}_sync"
            try:
                t0 = time.perf_counter()
                res[key] = fn(llm)
                print(key, json.dumps(res[key]), f"({time.perf_counter() - t0:.0f}s)", flush=True)
            except Exception:
                res[key] = {"error": traceback.format_exc()[-2000:]}
                print(key, "FAILED", res[key]["error"], flush=True)
            save()
        del llm
        torch.cuda.empty_cache()
    if not args.skip_hf and not args.only_decode:
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
    h = res.get("hf_generate_batch", {})
    if "output_tok_per_s" in h:
        print(f"| HF generate_batch ({h['requests']} req) | {h['output_tok_per_s']:.0f} out tok/s | | |")


if __name__ == "__main__":
    main()
