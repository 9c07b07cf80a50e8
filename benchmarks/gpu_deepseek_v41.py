"""DeepSeek-V4.1 on one GPU: the tiny model's GPU path against the CPU path, and a V4.1-Flash-width layer subset.

1. Fidelity (`deepseek-v41-tiny`, published formats): greedy tokens and top-20 logprobs on CUDA (Triton FP8 /
   MXFP4 GEMMs, CUDA graphs) against the CPU path (the reference-equal one, tests/test_deepseek_v41.py), read
   from --cpu-ref (written by `--write-cpu-ref` on a CPU machine); graphs vs eager; YOCO vs exact.
2. V4.1-Flash width (hidden 5120, 64 x 512 heads, q rank 1280, 384 experts top-6 of width 2304, window 128,
   index top-512 of 32 x 128 heads, candidates 2048 x 8, hc 4) on a layer subset that fits one GPU with the
   schedule's every block kind: window-only, ratio-2 KV+index source (+ Engram), two ratio-2 readers, the ratio-1
   candidate source (the CED split: the decoder's global KV), a ratio-1 reader, a ratio-1 index source scoring
   inside the candidates, a reader. Published formats (FP8 32 x 32, MXFP4), random values
   (`load_format="dummy"`), Engram tables shrunk to --engram-rows-m million rows each (the release: 384 M).
   Measures weights and KV capacity, start-up, decode steps at batch 1 / 32 / 128 vs their floor (bytes the step
   must read / measured copy bandwidth, or flops / measured bf16 peak), and prefill of --prefill-len tokens in
   exact and YOCO (keep 140) mode vs the prefill floor and the prefill FLOPs YOCO saves.

    python benchmarks/gpu_deepseek_v41.py --tokenizer-json PATH [--cpu-ref FILE] [--layers 8]
    python benchmarks/gpu_deepseek_v41.py --write-cpu-ref FILE          (CPU: the fidelity reference)

`--ops next`: the engine's ops with TRITON_OPS_NEXT's kernels not yet in TRITON_OPS (layers/triton_ops.py says
which), for every engine of the run; the default, the engine's own choice.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))

from openinfer import LLM, SamplingParams  # noqa: E402
from openinfer.models.deepseek_v4.model import QuantizedExperts  # noqa: E402

RELEASED = Path(__file__).resolve().parents[2] / "shared" / "reference" / "deepseek_v41" / "config.json"
TINY_PROMPTS = [(100, 1), (37, 2), (200, 3)]


def tiny_prompts() -> list[list[int]]:
    out = []
    for n, seed in TINY_PROMPTS:
        g = torch.Generator().manual_seed(seed)
        out.append(torch.randint(2, 129000, (n,), generator=g).tolist())
    return out


TINY = "deepseek-v41-tiny"      # --tiny-dir: the CPU reference's own files (a generator on another torch may differ)


def tiny_run(llm: LLM, max_tokens: int = 32) -> list[dict]:
    outs = llm.generate(prompt_token_ids=tiny_prompts(), sampling_params=SamplingParams(
        temperature=0, ignore_eos=True, max_tokens=max_tokens, logprobs=20), use_tqdm=False)
    return [{"tokens": o.outputs[0].token_ids,
             "logprobs": [{str(t): lp.logprob for t, lp in step.items()} for step in o.outputs[0].logprobs]}
            for o in outs]


def compare(a: list[dict], b: list[dict]) -> dict:
    """Greedy agreement (steps until the first differing token), the largest top-20 logprob difference on the
    steps before it, and on the first step (the prompt's last position: same inputs whatever came after)."""
    first_diff, max_lp, first_step = [], 0.0, []
    for x, y in zip(a, b):
        n = next((i for i, (s, t) in enumerate(zip(x["tokens"], y["tokens"])) if s != t), len(x["tokens"]))
        first_diff.append(n)
        for i in range(max(n, 1)):
            common = set(x["logprobs"][i]) & set(y["logprobs"][i])       # token ids as strings (JSON keys)
            d = max([0.0] + [abs(x["logprobs"][i][t] - y["logprobs"][i][t]) for t in common])
            if i == 0:
                first_step.append(round(d, 4))
            if i < n:
                max_lp = max(max_lp, d)
    return {"equal_tokens_until": first_diff, "max_logprob_diff_before_divergence": max_lp,
            "first_step_max_logprob_diff": first_step}


SMOOTH = dict(kv_cache_dtype="bfloat16", quantize_activations=False)   # no FP8/FP4 rounding of activations/caches


def fidelity(cpu_ref: str | None) -> dict:
    out = {}
    smooth = LLM(TINY, device="cuda", enforce_eager=True, **SMOOTH)
    out["smooth"] = tiny_run(smooth)
    smooth.shutdown()
    eager = LLM(TINY, device="cuda", enforce_eager=True)
    out["eager"] = tiny_run(eager)
    eager.shutdown()
    graphs = LLM(TINY, device="cuda")
    out["graphs_captured"] = graphs.engine.runner.decode_graphs is not None
    out["graphs"] = tiny_run(graphs)
    graphs.shutdown()
    yoco = LLM(TINY, device="cuda", v41_prefill_mode="yoco", v41_prefill_keep_tokens=64)
    out["yoco64"] = tiny_run(yoco)
    yoco.shutdown()
    res = {"graphs_vs_eager": compare(out["graphs"], out["eager"]),
           "yoco64_vs_exact": compare(out["yoco64"], out["eager"])}
    if cpu_ref and Path(cpu_ref).is_file():
        ref = json.loads(Path(cpu_ref).read_text())
        res["cuda_outputs"] = {k: [r["tokens"][:8] for r in v] for k, v in out.items() if isinstance(v, list)}
        res["cpu_outputs"] = {k: [r["tokens"][:8] for r in v] for k, v in ref.items()}
        res["cuda_vs_cpu"] = compare(out["eager"], ref["published"])
        res["cuda_vs_cpu_unquantized_activations_and_caches"] = compare(out["smooth"], ref["smooth"])
    return res


# ---- V4.1-Flash width ---------------------------------------------------------------------------------
def flash_subset(tokenizer_json: str, layers: int, engram_rows_m: float, root: Path, released: Path) -> Path:
    """A V4.1-Flash-width config over `layers` (>= 8) layers: the released dims, the schedule's block kinds."""
    cfg = json.loads(released.read_text())
    r2 = max(3, layers // 2 - 1)            # ratio-2 layers 1 .. r2-1, ratio-1 from r2 (the CED split)
    cfg.update(n_layers=layers, n_mtp_layers=0, dspark_block_size=0, dspark_target_layer_ids=[],
               compress_ratios=[0] + [2] * (r2 - 1) + [1] * (layers - r2),
               kv_source_layers=[1, r2], index_source_layers=[1, r2, r2 + 2], candidate_source_layer=r2,
               engram_layer_ids=[1, r2 - 1], vision_n_layers=0)
    shrink_engram(cfg, engram_rows_m)
    return write_model_dir(cfg, tokenizer_json, root / f"v41-flash-{layers}l")


def shrink_engram(cfg: dict, engram_rows_m: float) -> None:
    """Engram tables of about `engram_rows_m` million rows each (the release: 384 M): bucket ranges start above
    engram_vocab_size, so it shrinks with them."""
    from openinfer.layers.engram import EngramLayout

    n_buckets = (cfg["engram_max_ngram_size"] - 1) * cfg["engram_n_heads"]
    cfg["engram_vocab_size"] = int(engram_rows_m * 1e6 / n_buckets)
    ids = cfg["engram_layer_ids"]
    layout = EngramLayout.build(ids, cfg["engram_max_ngram_size"], cfg["engram_n_heads"], cfg["engram_head_dim"],
                                cfg["engram_vocab_size"], [1 << 40] * len(ids))
    cfg["engram_num_embeddings"] = [sum(p for per in layer for p in per) for layer in layout.primes]


def write_model_dir(cfg: dict, tokenizer_json: str, path: Path) -> Path:
    """A dummy-weights model directory: the config and the tokenizer (Engram hashes its compressed vocabulary)."""
    import shutil

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg, indent=1))
    shutil.copy(tokenizer_json, path / "tokenizer.json")
    return path


def weight_bytes(model) -> dict:
    """Bytes by kind: routed experts, Engram tables and the embedding (read by row), the rest (read whole)."""
    out = {"experts": 0, "engram_tables": 0, "embedding": 0, "other": 0}
    for name, p in model.named_parameters():
        b = p.numel() * p.element_size()
        key = "experts" if ".ffn.experts." in name else "engram_tables" if ".engram.embed." in name else \
            "embedding" if name == "embed.weight" else "other"
        out[key] += b
    return out


def floor_ms(model, tokens_per_seq: list[int], contexts: list[int], ceil: dict, routed_tokens: int | None = None,
             expert_share: float = 1.0) -> tuple[float, dict]:
    """max(bytes / copy BW, flops / bf16 peak) of one forward: the dense weights, the experts the step's tokens
    touch, every sequence's cache reads (window rows FP8 528 B, picked compressed entries FP4 288 B, the index
    keys an index source scores, 68 B each), Engram rows; flops of the active parameters and the attention.
    Expert parallelism (as gpu_deepseek_v4.floor_ms): `expert_share` of the experts live here and `routed_tokens`
    (all ranks' tokens) route to them. `model`: the one-process model (meta tensors are fine)."""
    c = model.config
    wb = weight_bytes(model)
    T = sum(tokens_per_seq)
    E, k = c.n_routed_experts, c.n_activated_experts
    per_expert = wb["experts"] / c.n_layers / E
    touched = E * (1 - (1 - k / E) ** (routed_tokens or T))
    bytes_w = wb["other"] + c.n_layers * touched * per_expert * expert_share
    bytes_kv = flops_attn = 0.0
    D, H, Di, Hi, W = c.head_dim, c.n_heads, c.index_head_dim, c.index_n_heads, c.window_size
    for i in range(c.n_layers):
        r = c.ratio(i)
        for n, ctx in zip(tokens_per_seq, contexts):
            entries = ctx // r if r else 0
            picked = min(entries, c.index_topk)
            bytes_kv += min(W, ctx) * 528 + picked * 288
            flops_attn += 4 * n * H * D * (min(W, ctx) + picked)
            if i in c.index_source_layers:
                scored = entries if not c.uses_candidates(i) else min(entries, c.candidate_topk_blocks
                                                                     * c.candidate_block_size)
                bytes_kv += entries * 68
                flops_attn += 2 * n * Hi * Di * scored
    bytes_engram = T * len(c.engram_layer_ids) * (c.engram_max_ngram_size - 1) * c.engram_n_heads * (
        c.engram_head_dim + c.engram_head_dim // 32)
    active = sum(p.numel() for n, p in model.named_parameters() if ".ffn.experts." not in n
                 and ".engram.embed." not in n and not n.startswith(("embed.", "head.")))
    expert_params = sum(p.numel() for n, p in model.named_parameters() if n.endswith("experts.gate_up_proj")
                        or n.endswith("experts.down_proj")) * 2      # packed two per byte
    active += k * expert_params / E + c.dim * c.vocab_size             # + the head
    flops = 2 * active * T + flops_attn
    t_bytes = (bytes_w + bytes_kv + bytes_engram) / (ceil["copy_TBps"] * 1e12)
    t_flops = flops / (ceil["bf16_matmul_TFLOPs"] * 1e12)
    return max(t_bytes, t_flops) * 1e3, {"bytes_GB": (bytes_w + bytes_kv + bytes_engram) / 1e9,
                                         "TFLOP": flops / 1e12, "experts_touched_per_layer": touched}


def decode(llm: LLM, batch: int, ctx: int, ceil: dict, steps: int = 10) -> dict:
    from gpu_deepseek_v4 import top_kernels
    from gpu_llama8b import start_decoding

    eng = llm.engine
    t0 = time.perf_counter()
    # max_tokens: no request may finish inside the timed steps (the first ones decode while the last prefill)
    start_decoding(eng, batch, ctx, steps + 300, warmup=8)   # warm-up: the step that captures the graph is untimed
    prefill_s = time.perf_counter() - t0
    torch.cuda.synchronize()
    runner, counts = eng.runner, {"graph": 0, "eager": 0, "captures": 0}
    dg = runner.decode_graphs           # (CUDA graphs of decode: engine/cuda_graphs.py)
    originals = dg.replay, runner._eager_forward, dg.capture

    def counted(key, fn):
        def wrapper(*a, **k):
            counts[key] += 1
            return fn(*a, **k)
        return wrapper
    dg.replay, runner._eager_forward, dg.capture = (
        counted("graph", originals[0]), counted("eager", originals[1]), counted("captures", originals[2]))
    from deepseek_probe import InWindow

    with InWindow(eng) as window:
        t0 = time.perf_counter()
        for _ in range(steps):
            eng.step()
        torch.cuda.synchronize()
        step = (time.perf_counter() - t0) / steps
    dg.replay, runner._eager_forward, dg.capture = originals
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            eng.step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    for rid in list(eng.requests):
        eng.abort_request(rid)
    fl, detail = floor_ms(eng.runner.model, [1] * batch, [ctx + 3 + steps // 2] * batch, ceil)
    return {"batch": batch, "context": ctx, "step_ms": step * 1e3, "floor_ms": fl, "ratio_to_floor": step * 1e3 / fl,
            "gpu_kernel_ms_per_step": sum(e.device_time for e in kernels) / 1e3 / 2,
            "kernels_per_step": len(kernels) / 2, "kernels_per_layer": len(kernels) / 2 / eng.runner.model.config.n_layers,
            **window.result, "top_kernels": top_kernels(kernels, 2),
            "setup_prefill_s": prefill_s, "timed_forwards": counts, **detail}


def prefill(llm: LLM, n: int, ceil: dict, keep: int | None, reps: int = 2) -> dict:
    """One request of n tokens, prefilled alone (chunks of max_num_batched_tokens), `reps` times (first = warm-up).
    `keep`: YOCO with that tail (the runner's switch flipped for the measurement), None: exact."""
    eng = llm.engine
    eng.runner.yoco_keep = keep
    g = torch.Generator().manual_seed(7)
    times = []
    for _ in range(reps):
        eng.add_request(torch.randint(100, 128000, (n,), generator=g).tolist(), SamplingParams(max_tokens=1))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        while eng.has_unfinished_requests():
            eng.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    eng.runner.yoco_keep = None
    c = eng.runner.model.config
    chunk = eng.config.max_num_batched_tokens
    fl = sum(floor_ms(eng.runner.model, [min(chunk, n - s)], [min(s + chunk, n)], ceil)[0] for s in range(0, n, chunk))
    t = min(times[1:] or times)
    split = c.yoco_split
    dec_share = (c.n_layers - split) / c.n_layers if keep else 0.0
    return {"prompt_tokens": n, "mode": f"yoco keep {keep}" if keep else "exact", "time_ms": t * 1e3,
            "tokens_per_s": n / t, "exact_floor_ms": fl, "ratio_to_exact_floor": t * 1e3 / fl,
            "decoder_layer_share": (c.n_layers - split) / c.n_layers,
            "layer_token_work_vs_exact": 1 - dec_share * (1 - min(keep or n, n) / n)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer-json")
    ap.add_argument("--cpu-ref")
    ap.add_argument("--write-cpu-ref")
    ap.add_argument("--released-config", default=str(RELEASED), help="DeepSeek's released V4.1 inference config")
    ap.add_argument("--tiny-dir", help="the deepseek-v41-tiny directory the CPU reference used")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--engram-rows-m", type=float, default=8.0)
    ap.add_argument("--batches", default="1,32,128")
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--prefill-len", type=int, default=8192)
    ap.add_argument("--max-model-len", type=int, default=16384, help="bounds the context buckets captured at start")
    ap.add_argument("--skip", default="", help="comma list of parts to skip: fidelity,flash,prefill,first_traffic")
    ap.add_argument("--ops", choices=("engine", "next"), default="engine",
                    help="next: add TRITON_OPS_NEXT's kernels (not yet in TRITON_OPS) to the engine's ops")
    args = ap.parse_args()
    if args.ops == "next":
        from gpu_deepseek_v4 import use_next_ops
        use_next_ops()
    global TINY
    TINY = args.tiny_dir or TINY
    if args.write_cpu_ref:
        ref = {"published": tiny_run(LLM(TINY, device="cpu", dtype="bfloat16")),
               "smooth": tiny_run(LLM(TINY, device="cpu", dtype="bfloat16", **SMOOTH))}
        Path(args.write_cpu_ref).write_text(json.dumps(ref))
        return
    from gpu_llama8b import ceilings

    out_dir = Path(os.environ.get("OUT", Path(__file__).parent / "results"))
    commit = os.environ.get("OPENINFER_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    res = {"benchmark": "gpu_deepseek_v41", "device": torch.cuda.get_device_name(), "date": str(datetime.date.today()),
           "commit": commit, "torch": torch.__version__, "ops": args.ops}
    path = out_dir / f"gpu_deepseek_v41_{commit}{'_next' if args.ops == 'next' else ''}.json"

    def save():
        path.write_text(json.dumps(res, indent=1, default=str))
        print(json.dumps(res, indent=1, default=str)[-3000:], flush=True)

    skip = set(args.skip.split(","))
    if "fidelity" not in skip:
        try:
            res["fidelity"] = fidelity(args.cpu_ref)
        except Exception:
            res["fidelity_error"] = traceback.format_exc()
        save()
    if "flash" in skip:
        return
    res["ceilings"] = ceil = ceilings()
    model_path = flash_subset(args.tokenizer_json, args.layers, args.engram_rows_m, Path("/tmp/v41_models"),
                              Path(args.released_config))
    t0 = time.perf_counter()
    llm = LLM(str(model_path), device="cuda", load_format="dummy", max_num_seqs=max(map(int, args.batches.split(","))),
              max_num_batched_tokens=8192, enable_prefix_caching=False, max_model_len=args.max_model_len)
    res["startup_s"] = time.perf_counter() - t0
    from deepseek_probe import first_traffic, start_up

    # a fresh engine as `openinfer serve` starts it (graphs captured, warm-up), then its first users
    res["start_up"] = start_up(llm, res["startup_s"])
    save()
    if "first_traffic" not in skip:
        res["first_traffic"] = first_traffic(llm.engine, llm.engine.runner.model.config.vocab_size)
        save()
    model = llm.engine.runner.model
    res["weights_GB"] = {k: v / 1e9 for k, v in weight_bytes(model).items()}
    res["kv_blocks"] = llm.engine.runner.num_blocks
    res["kv_bytes_per_token"] = llm.engine.runner.pool.bytes_per_block() / llm.engine.config.block_size
    res["state_bytes_per_request"] = sum(s.bytes_per_slot() for s in llm.engine.runner.cache_specs
                                         if hasattr(s, "bytes_per_slot"))
    res["config"] = {"layers": args.layers, "yoco_split": model.config.yoco_split,
                     "engram_rows": model.config.engram_num_embeddings,
                     "experts_quantized": all(isinstance(b.ffn.experts, QuantizedExperts) for b in model.layers)}
    res["cuda_graphs"] = llm.engine.config.use_cuda_graphs and model.traits.cuda_graph_decode
    save()
    res["prefill"] = []
    for keep in ((None, 140) if "prefill" not in skip else ()):
        try:
            res["prefill"].append(prefill(llm, args.prefill_len, ceil, keep))
        except Exception:
            res["prefill"].append({"mode": keep, "error": traceback.format_exc()})
        save()
    res["decode"] = []
    for b in map(int, args.batches.split(",")):
        try:
            res["decode"].append(decode(llm, b, args.context if b <= 32 else args.context // 2, ceil))
        except Exception:
            res["decode"].append({"batch": b, "error": traceback.format_exc()})
        save()
        gc.collect()


if __name__ == "__main__":
    main()
