"""DeepSeek-V4 on one GPU, in one device call: a V4-Flash-width model (hidden 4096, 64 heads of 512, q-LoRA
1024, 256 routed experts top-6, grouped output projection, mHC x4, CSA/HCA) with fewer layers and random
weights in bf16 and in DeepSeek's published formats (FP8 128 x 128 block-scaled dense weights, MXFP4 routed
experts; `--weights`), through the engine.

Measures, in the same run: the copy-bandwidth and bf16-matmul ceilings; then
 (a) decode step time at batch 1/32/128 with 1K context vs the floor max(bytes/BW, flops/peak), bytes being
     the weights a step must read (experts: the expected number a batch touches) plus the cache it reads;
 (b) prefill of batch 1/32/128 requests of 1K tokens (8K-token steps) vs the same floor;
 (c) fidelity: the same config with 16 experts and index_topk 64 (so the indexer selects), weights shared
     through a bf16 checkpoint: CUDA bf16 prompt logits vs the CPU fp32 path.
Writes JSON to $OUT (or benchmarks/results/).

    python benchmarks/gpu_deepseek_v4.py --tokenizer-json PATH [--layers 4] [--ops next] [--kv-cache-dtype fp8_ds_mla]

`--ops next`: the engine's ops with the kernels of TRITON_OPS_NEXT not yet in TRITON_OPS (layers/triton_ops.py says
which); the default, the engine's own choice. `--kv-cache-dtype fp8_ds_mla`: V4's window and compressed entries as
FlashMLA's FP8 rows (docs/deepseek_v4.md), the floor counting their 584 bytes.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from deepseek_probe import InWindow, first_traffic, start_up  # noqa: E402
from gpu_llama8b import ceilings, start_decoding  # noqa: E402

from openinfer import LLM, SamplingParams  # noqa: E402
from openinfer.layers import flash_mla_prefill  # noqa: E402
from openinfer.models.deepseek_v4.config import CSA, HCA  # noqa: E402
from openinfer.quantization import kernel_choice  # noqa: E402

FLASH_WIDTH = dict(
    model_type="deepseek_v4", architectures=["DeepseekV4ForCausalLM"], vocab_size=129280, hidden_size=4096,
    moe_intermediate_size=2048, num_attention_heads=64, head_dim=512, q_lora_rank=1024, partial_rotary_factor=0.125,
    num_experts_per_tok=6, n_routed_experts=256, n_shared_experts=1, scoring_func="sqrtsoftplus",
    routed_scaling_factor=1.5, sliding_window=128, o_groups=8, o_lora_rank=1024, index_n_heads=64,
    index_head_dim=128, index_topk=512, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, swiglu_limit=10.0,
    compress_rates={CSA: 4, HCA: 128}, rope_theta=10000.0, compress_rope_theta=160000.0,
    rope_parameters={"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536,
                     "beta_fast": 32, "beta_slow": 1},
    max_position_embeddings=1 << 20, rms_norm_eps=1e-6, num_nextn_predict_layers=0, bos_token_id=0, eos_token_id=1,
    tie_word_embeddings=False)


def model_dir(tokenizer_json: str, **overrides) -> Path:
    d = Path(tempfile.mkdtemp(prefix="v4-flash-width-"))
    (d / "config.json").write_text(json.dumps({**FLASH_WIDTH, **overrides}))
    shutil.copy(tokenizer_json, d / "tokenizer.json")
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<｜end▁of▁sentence｜>"}))
    return d


def layout(n: int) -> dict:
    types = [CSA if i % 2 == 0 else HCA for i in range(n)]
    return dict(num_hidden_layers=n, layer_types=types, mlp_layer_types=["hash_moe"] + ["moe"] * (n - 1))


# the published formats (V4-Flash: FP8 128 x 128 block scales, MXFP4 routed experts)
PUBLISHED = dict(quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128], "scale_fmt": "ue8m0",
                                      "fmt": "e4m3", "activation_scheme": "dynamic"}, expert_dtype="fp4")


def weight_bytes(model, params: bool = False) -> dict:
    """Bytes of the weights as stored (scales included): experts apart (a step reads only those it routes
    to), embedding apart. `params`: count parameters instead (a packed FP4 byte holds two)."""
    experts = other = embed = 0
    for name, p in model.named_parameters():
        if params:
            b = 0 if name.endswith("_scale") else p.numel() * (2 if p.dtype == torch.uint8 else 1)
        else:
            b = p.numel() * p.element_size()
        if ".experts." in name:
            experts += b
        elif name.startswith("embed_tokens"):
            embed += b
        else:
            other += b
    return {"experts": experts, "other": other, "embed": embed}


def floor_ms(model, tokens_per_seq: list[int], contexts: list[int], ceil: dict, routed_tokens: int | None = None,
             expert_share: float = 1.0) -> tuple[float, dict]:
    """max(bytes/BW, flops/peak) for one forward over sequences with `tokens_per_seq` new tokens ending at
    `contexts` tokens. Expert parallelism: `expert_share` of the experts live here and `routed_tokens` (all
    ranks' tokens) route to them; the flops counted are this rank's tokens' (an upper bound for the
    experts, which split across ranks)."""
    c = model.config
    wb = weight_bytes(model)
    T = sum(tokens_per_seq)
    E, k = c.n_routed_experts, c.num_experts_per_tok
    n_moe = c.num_hidden_layers
    per_expert = wb["experts"] / n_moe / E
    touched = expert_share * E * (1 - (1 - k / E) ** (T if routed_tokens is None else routed_tokens))
    bytes_w = wb["other"] + n_moe * touched * per_expert
    bytes_kv = flops_attn = 0.0
    D, H, Di, Hi, W = c.head_dim, c.num_attention_heads, c.index_head_dim, c.index_n_heads, c.sliding_window
    codec = getattr(model, "kv_codec", None)       # kv_cache_dtype="fp8_ds_mla": 584 B entries, else bf16
    entry_bytes = codec.stored_dim(D) if codec is not None else D * 2
    for t in c.layer_types:
        r = c.compress_rates.get(t, 0)
        for n, ctx in zip(tokens_per_seq, contexts):
            entries = ctx // r if r else 0
            attended = min(W, ctx) + (min(entries, c.index_topk) if t == CSA else entries)
            bytes_kv += (min(W, ctx) + (entries if t == HCA else min(entries, c.index_topk))) * entry_bytes
            if t == CSA:
                bytes_kv += entries * Di * 2
                flops_attn += 2 * n * Hi * Di * entries
            flops_attn += 4 * n * H * D * attended
    wp = weight_bytes(model, params=True)
    active = wp["other"] + n_moe * k * wp["experts"] / n_moe / E    # parameters a token multiplies
    flops = 2 * active * T + flops_attn
    t_bytes = (bytes_w + bytes_kv) / (ceil["copy_TBps"] * 1e12)
    t_flops = flops / (ceil["bf16_matmul_TFLOPs"] * 1e12)
    return max(t_bytes, t_flops) * 1e3, {"bytes_GB": (bytes_w + bytes_kv) / 1e9, "TFLOP": flops / 1e12,
                                         "experts_touched_per_layer": touched}


def decode_steps(llm: LLM, batch: int, ctx: int, ceil: dict, steps: int = 12) -> dict:
    eng = llm.engine
    start_decoding(eng, batch, ctx, steps + 10, warmup=4)
    torch.cuda.synchronize()
    with InWindow(eng) as window:
        t0 = time.perf_counter()
        for _ in range(steps):
            eng.step()
        torch.cuda.synchronize()
        step = (time.perf_counter() - t0) / steps
    # where the time goes: GPU kernel time and kernel count per step (the rest is host work)
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            eng.step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    gpu_ms = sum(e.device_time for e in kernels) / 1e3 / 3
    top = top_kernels(kernels, 3)
    # the timed and the profiled steps ran the whole batch (no request finished: start_decoding's budget)
    assert len(eng.scheduler.running) == batch, (len(eng.scheduler.running), batch)
    for rid in list(eng.requests):
        eng.abort_request(rid)
    fl, detail = floor_ms(eng.runner.model, [1] * batch, [ctx + 3 + steps // 2] * batch, ceil)
    layers = eng.runner.model.config.num_hidden_layers
    return {"batch": batch, "context": ctx, "step_ms": step * 1e3, "floor_ms": fl, "ratio_to_floor": step * 1e3 / fl,
            "gpu_kernel_ms_per_step": gpu_ms, "kernels_per_step": len(kernels) / 3,
            "kernels_per_layer": len(kernels) / 3 / layers, **window.result, "top_kernels": top, **detail}


def top_kernels(kernels, steps: int, n: int = 12) -> list:
    """Where a step's GPU time goes: (kernel name, launches per step, us per step), the largest first."""
    acc: dict[str, list] = {}
    for e in kernels:
        a = acc.setdefault(e.name[:90], [0, 0.0])
        a[0] += 1
        a[1] += e.device_time
    rows = sorted(acc.items(), key=lambda kv: -kv[1][1])[:n]
    return [(name, c / steps, round(t / steps, 1)) for name, (c, t) in rows]


def prefill(llm: LLM, batch: int, n: int, ceil: dict) -> dict:
    eng = llm.engine
    g = torch.Generator().manual_seed(1000 + batch)
    for _ in range(batch):
        eng.add_request(torch.randint(100, 128000, (n,), generator=g).tolist(), SamplingParams(max_tokens=1))
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    steps = 0
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in eng.requests.values()):
        eng.step()
        steps += 1
    torch.cuda.synchronize()
    t = time.perf_counter() - t0
    while eng.has_unfinished_requests():
        eng.step()
    per_step = eng.config.max_num_batched_tokens // n
    # where one full prefill step's GPU time goes (a separate, untimed step)
    from torch.profiler import ProfilerActivity, profile
    for _ in range(min(batch, per_step)):
        eng.add_request(torch.randint(100, 128000, (n,), generator=g).tolist(), SamplingParams(max_tokens=1))
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        eng.step()
        torch.cuda.synchronize()
    step_kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    top = top_kernels(step_kernels, 1)
    gpu_ms = sum(e.device_time for e in step_kernels) / 1e3        # the rest of a step's time is host work
    while eng.has_unfinished_requests():
        eng.step()
    host = host_ops(eng, batch, per_step, n, g)
    fl = 0.0
    for s in range(steps):   # each step: `per_step` sequences' whole prompts (n <= budget)
        seqs = min(per_step, batch - s * per_step)
        fl += floor_ms(eng.runner.model, [n] * seqs, [n] * seqs, ceil)[0]
    return {"batch": batch, "prompt_tokens": n, "steps": steps, "time_ms": t * 1e3, "ms_per_step": t * 1e3 / steps,
            "floor_ms": fl, "ratio_to_floor": t * 1e3 / fl, "tokens_per_s": batch * n / t,
            "gpu_kernel_ms_one_step": gpu_ms, "top_kernels_one_step": top, "kernels_one_step": len(step_kernels),
            "kernels_per_layer_one_step": len(step_kernels) / len(layout_of(eng)), **host}


def layout_of(eng) -> list:
    return eng.runner.model.config.layer_types


def host_ops(eng, batch: int, per_step: int, n: int, g: torch.Generator, top: int = 15) -> dict:
    """Where a prefill step's host time goes: one more untimed step under the profiler (its overhead inflates the
    times; the counts are exact): the host-side events (torch ops, CUDA runtime and driver calls) with the most
    self CPU time (name, calls, ms), and the kernel launches the host issued (cudaLaunchKernel, cuLaunchKernelEx:
    torch's and Triton's kernels)."""
    from torch.profiler import ProfilerActivity, profile
    for _ in range(min(batch, per_step)):
        eng.add_request(torch.randint(100, 128000, (n,), generator=g).tolist(), SamplingParams(max_tokens=1))
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        eng.step()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    while eng.has_unfinished_requests():
        eng.step()
    acc: dict[str, list] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            continue
        a = acc.setdefault(e.name[:80], [0, 0.0])
        a[0] += 1
        a[1] += e.self_cpu_time_total
    launches = sum(c for name, (c, _) in acc.items() if "LaunchKernel" in name)    # runtime and driver launches
    rows = sorted(acc.items(), key=lambda kv: -kv[1][1])[:top]
    return {"host_profiled_step_ms": wall * 1e3, "host_launches_one_step": launches,
            "host_top_ops_one_step": [(name, c, round(t / 1e3, 2)) for name, (c, t) in rows],
            "host_syncs_one_step": host_syncs(eng, batch, per_step, n, g),
            "host_python_one_step": host_python(eng, batch, per_step, n, g)}


def host_python(eng, batch: int, per_step: int, n: int, g: torch.Generator, top: int = 25) -> list:
    """Where a prefill step's Python time goes: cProfile over one more step, the openinfer functions with the most
    cumulative time (file:line function, calls, ms; the profiler's own overhead inflates them, evenly per call)."""
    import cProfile
    import pstats
    for _ in range(min(batch, per_step)):
        eng.add_request(torch.randint(100, 128000, (n,), generator=g).tolist(), SamplingParams(max_tokens=1))
    prof = cProfile.Profile()
    prof.enable()
    eng.step()
    torch.cuda.synchronize()
    prof.disable()
    while eng.has_unfinished_requests():
        eng.step()
    stats = pstats.Stats(prof).stats
    rows = [(f"{path.split('/openinfer/')[-1]}:{line} {fn}", calls, cum * 1e3)
            for (path, line, fn), (_, calls, _, cum, _) in stats.items() if "/openinfer/" in path]
    return [(name, calls, round(ms, 2)) for name, calls, ms in sorted(rows, key=lambda r: -r[2])[:top]]


def host_syncs(eng, batch: int, per_step: int, n: int, g: torch.Generator) -> dict:
    """The torch ops that made a prefill step wait for the GPU (torch.cuda.set_sync_debug_mode("warn") on one more
    step), counted per openinfer source line: each stalls the host until the GPU drains, so the step's host and
    GPU times add up instead of overlapping."""
    import traceback
    import warnings
    for _ in range(min(batch, per_step)):
        eng.add_request(torch.randint(100, 128000, (n,), generator=g).tolist(), SamplingParams(max_tokens=1))
    where: dict[str, int] = {}
    shown = warnings.showwarning

    def record(message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack()[:-1] if "/openinfer/" in f.filename]
        at = frames[-1] if frames else None
        key = f"{at.filename.split('/openinfer/')[-1]}:{at.lineno}" if at else f"{filename}:{lineno}"
        where[key] = where.get(key, 0) + 1

    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            eng.step()
    finally:
        warnings.showwarning = shown
        torch.cuda.set_sync_debug_mode("default")
    while eng.has_unfinished_requests():
        eng.step()
    return dict(sorted(where.items(), key=lambda kv: -kv[1]))


def fidelity(tokenizer_json: str) -> dict:
    from safetensors.torch import save_file

    from openinfer.models.deepseek_v4.loader import init_random as init_deepseek_v4_random
    from openinfer.models.deepseek_v4.config import DeepseekV4Config
    from openinfer.models.deepseek_v4.model import DeepseekV4ForCausalLM

    over = {**layout(2), "n_routed_experts": 16, "index_topk": 64}
    d = model_dir(tokenizer_json, **over)
    with torch.device("meta"):
        m = DeepseekV4ForCausalLM(DeepseekV4Config.from_hf({**FLASH_WIDTH, **over}))
    m = m.to_empty(device="cpu")
    init_deepseek_v4_random(m, seed=0)
    save_file({k: v.to(torch.bfloat16 if v.is_floating_point() else v.dtype).contiguous()
               for k, v in m.state_dict().items() if not k.endswith("inv_freq")}, str(d / "model.safetensors"))
    del m
    gc.collect()
    prompt = [(i * 7919) % 120000 + 100 for i in range(600)]   # 150 CSA entries > 2 x top-64, 4 HCA entries
    out = {}
    # the bar for bf16: our CPU bf16 path's own distance from fp32 (the CPU suite holds that to transformers'
    # bf16 error; the device's transformers cannot run V4 in bf16)
    for device, dtype in (("cpu", "float32"), ("cpu_bf16", "bfloat16"), ("cuda", "bfloat16")):
        llm = LLM(str(d), device=device.removesuffix("_bf16"), dtype=dtype, max_num_batched_tokens=1024,
                  enforce_eager=True, enable_prefix_caching=False)
        rows = []
        model = llm.engine.runner.model
        hook = model.register_forward_hook(lambda mod, i, o: rows.append(o.detach()))
        t0 = time.perf_counter()
        llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(max_tokens=1), use_tqdm=False)
        hook.remove()
        with torch.no_grad():
            out[device] = model.compute_logits(rows[0]).float().cpu()
        out[device + "_s"] = time.perf_counter() - t0
        greedy = llm.generate(prompt_token_ids=[prompt], use_tqdm=False,
                              sampling_params=SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))
        out[device + "_tokens"] = greedy[0].outputs[0].token_ids
        del llm, model, rows
        gc.collect()
        torch.cuda.empty_cache()
    a, b = out["cuda"], out["cpu"]
    agree = next((i for i, (x, y) in enumerate(zip(out["cuda_tokens"], out["cpu_tokens"])) if x != y), 16)
    shutil.rmtree(d, ignore_errors=True)
    return {"positions": len(prompt), "relative_logit_error": ((a - b).norm() / b.norm()).item(),
            "max_abs_logit_diff": (a - b).abs().max().item(), "logit_std": b.std().item(),
            "top1_agreement": (a.argmax(-1) == b.argmax(-1)).float().mean().item(),
            "greedy_agreeing_prefix_of_16": agree, "cpu_fp32_prefill_s": out["cpu_s"],
            "cpu_bf16_vs_cpu_fp32": ((out["cpu_bf16"] - b).norm() / b.norm()).item(),
            "cuda_bf16_vs_cpu_bf16": ((a - out["cpu_bf16"]).norm() / out["cpu_bf16"].norm()).item(),
            "cpu_bf16_top1_agreement": (out["cpu_bf16"].argmax(-1) == b.argmax(-1)).float().mean().item(),
            "cuda_bf16_prefill_s": out["cuda_s"]}


def use_next_ops() -> None:
    """The engine's ops plus TRITON_OPS_NEXT's kernels not yet in TRITON_OPS (for every LLM this process builds)."""
    import dataclasses

    from openinfer.engine import llm_engine
    from openinfer.layers.triton_ops import TRITON_OPS, TRITON_OPS_NEXT

    pending = {f.name: getattr(TRITON_OPS_NEXT, f.name) for f in dataclasses.fields(TRITON_OPS)
               if getattr(TRITON_OPS_NEXT, f.name) is not getattr(TRITON_OPS, f.name)}
    make = llm_engine.make_kernels

    def kernels(config):
        backend, ops = make(config)
        return backend, dataclasses.replace(ops, **pending)
    llm_engine.make_kernels = kernels


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ops", choices=("engine", "next"), default="engine",
                    help="next: add TRITON_OPS_NEXT's kernels (not yet in TRITON_OPS) to the engine's ops")
    ap.add_argument("--tokenizer-json", required=True)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batches", default="1,32,128")
    ap.add_argument("--skip-fidelity", action="store_true")
    ap.add_argument("--only-fidelity", action="store_true")
    ap.add_argument("--weights", default="bf16,fp8", help="bf16 and/or fp8 (published FP8 + MXFP4), same run")
    ap.add_argument("--max-model-len", type=int, default=16384,
                    help="bounds the context buckets captured at start (the probe's longest request is 2,240 tokens)")
    ap.add_argument("--skip-first-traffic", action="store_true")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=("auto", "fp8_ds_mla"),
                    help="fp8_ds_mla: DeepSeek-V4's own cache format (FlashMLA's FP8 rows)")
    ap.add_argument("--expert-route", choices=("table", "w4a16", "bf16_dequant"), default="table",
                    help="force the MXFP4 experts' GEMM route at every size (kernel_choice's table by default)")
    ap.add_argument("--flash-mla", choices=("auto", "off"), default="auto",
                    help="EngineConfig.flash_mla: FlashMLA's SM90 sparse prefill where installed (auto) or not")
    ap.add_argument("--part-out", default=None, help="internal: run one weights kind, write its results here")
    ap.add_argument("--ceilings-json", default=None, help="internal: the ceilings measured by the parent run")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    if args.ops == "next":
        use_next_ops()
    if args.expert_route != "table":
        kernel_choice.EXPERT_KERNEL_BY_ROWS_PER_EXPERT = ((0, args.expert_route),)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    res = {"device": torch.cuda.get_device_name(), "date": datetime.date.today().isoformat(), "commit": commit,
           "torch": torch.__version__, "ops": args.ops, "kv_cache_dtype": args.kv_cache_dtype,
           "flash_mla": args.flash_mla if args.flash_mla == "off" else (flash_mla_prefill.load_error() or "on"),
           "config": {**FLASH_WIDTH, **layout(args.layers)}}
    if args.only_fidelity:
        res["fidelity"] = fidelity(args.tokenizer_json)
        print("fidelity", json.dumps(res["fidelity"]), flush=True)
        out = Path(os.environ.get("OUT", "benchmarks/results"))
        out.mkdir(parents=True, exist_ok=True)
        (out / f"gpu_deepseek_v4_fidelity_{res['date']}_{commit}.json").write_text(json.dumps(res, indent=1))
        return
    res["ceilings"] = ceil = json.loads(args.ceilings_json) if args.ceilings_json else ceilings()
    print(json.dumps(res["ceilings"]), flush=True)
    kinds = args.weights.split(",")
    if len(kinds) > 1 and args.part_out is None:
        # one process per kind: each engine gets the whole GPU (an engine's memory is not returned on `del`
        # yet, see issue 10), and the ceilings measured above serve both
        for weights in kinds:
            part = Path(tempfile.mkdtemp()) / "part.json"
            subprocess.run([sys.executable, __file__, "--tokenizer-json", args.tokenizer_json, "--layers",
                            str(args.layers), "--batches", args.batches, "--weights", weights, "--part-out", str(part),
                            "--max-model-len", str(args.max_model_len), "--ops", args.ops,
                            "--kv-cache-dtype", args.kv_cache_dtype, "--flash-mla", args.flash_mla,
                            *(["--skip-first-traffic"] if args.skip_first_traffic else []),
                            "--ceilings-json", json.dumps(ceil)], check=False)
            res.setdefault("runs", {})[weights] = (json.loads(part.read_text()) if part.is_file()
                                                   else {"error": "the benchmark process failed; see its output"})
        kinds = []
    for weights in kinds:
        over = {**layout(args.layers), **(PUBLISHED if weights == "fp8" else {})}
        d = model_dir(args.tokenizer_json, **over)
        t0 = time.perf_counter()
        llm = LLM(str(d), device="cuda", dtype="bfloat16", load_format="dummy", max_num_seqs=max(batches),
                  max_num_batched_tokens=8192, enable_prefix_caching=False, max_model_len=args.max_model_len,
                  kv_cache_dtype=args.kv_cache_dtype, flash_mla=args.flash_mla)
        run = res.setdefault("runs", {})[weights] = {}
        # a fresh engine as `openinfer serve` starts it (graphs captured, warm-up), then its first users
        run["start_up"] = start_up(llm, time.perf_counter() - t0)
        print(weights, "start_up", json.dumps(run["start_up"]), flush=True)
        if not args.skip_first_traffic:
            run["first_traffic"] = first_traffic(llm.engine, FLASH_WIDTH["vocab_size"])
            print(weights, "first_traffic", json.dumps(run["first_traffic"]), flush=True)
        run["weights_GB"] = {k: v / 1e9 for k, v in weight_bytes(llm.engine.runner.model).items()}
        run["kv_blocks"] = llm.engine.runner.num_blocks
        for name, fn in (("decode", lambda b: decode_steps(llm, b, 1024, ceil)),
                         ("prefill", lambda b: prefill(llm, b, 1024, ceil))):
            run[name] = []
            for b in batches:
                try:
                    r = fn(b)
                except Exception:
                    r = {"batch": b, "error": traceback.format_exc()[-2000:]}
                    for rid in list(llm.engine.requests):
                        llm.engine.abort_request(rid)
                run[name].append(r)
                print(weights, name, json.dumps(r), flush=True)
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    if args.part_out is not None:
        Path(args.part_out).write_text(json.dumps(res["runs"][args.weights]))
        return
    if not args.skip_fidelity:
        try:
            res["fidelity"] = fidelity(args.tokenizer_json)
        except Exception:
            res["fidelity"] = {"error": traceback.format_exc()[-3000:]}
        print("fidelity", json.dumps(res["fidelity"]), flush=True)
    out = Path(os.environ.get("OUT", "benchmarks/results"))
    out.mkdir(parents=True, exist_ok=True)
    tag = (("_next" if args.ops == "next" else "") + ("" if args.expert_route == "table" else f"_{args.expert_route}")
           + ("_fp8_ds_mla" if args.kv_cache_dtype == "fp8_ds_mla" else "")
           + ("_no_flash_mla" if args.flash_mla == "off" else ""))
    (out / f"gpu_deepseek_v4_{res['date']}_{commit}{tag}.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
