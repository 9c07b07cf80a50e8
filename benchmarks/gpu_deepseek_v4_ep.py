"""The whole DeepSeek-V4-Flash on several GPUs: attention data parallelism + MoE expert parallelism.

V4-Flash's shape (43 layers: 2 sliding-window, then CSA/HCA alternating; hash routing in the first 3; 256
routed experts top-6; one MTP layer), published formats (FP8 128 x 128 dense weights, MXFP4 experts), random
values (`load_format="dummy"`), DP = EP = number of GPUs, through `LLM` (one worker process per GPU).

Measures, in one run: the copy-bandwidth / bf16-matmul ceilings; weights and KV capacity per GPU; start-up
time; an InferenceX-style sweep (random prompts of --input-len tokens, --output-len tokens each, EOS ignored,
all requests of a concurrency level submitted at once): output tok/s per GPU, TTFT and TPOT p50/p99,
`moe_lb`, the steady decode step vs its floor (bytes each GPU must read per step: the replicated weights,
the experts the step's tokens touch among this GPU's, its requests' KV / measured copy bandwidth) and the
roofline output rate (tokens per step / floor). Writes JSON to $OUT (or benchmarks/results/).

The sweep runs once per MoE exchange variant (`--dispatch` x `--tbo`: all-gather, padded all-to-all or the
exact-size all-to-all on eager steps (prefill; decode graphs keep the padded one), two-batch overlap off or on;
one engine each; `--two-batch-split requests`: the halves are whole requests through every layer, overlapping
attention too), and reports per variant the host time each rank spent agreeing on the
step's shape (`--step-sync-channel`: shm, the default on one host, or gloo) per step.

    python benchmarks/gpu_deepseek_v4_ep.py --tokenizer-json PATH [--gpus 2] [--layers 43]
        [--concurrency 1,8,32,128] [--input-len 8192] [--output-len 1024] [--eplb]
        [--dispatch all_gather,all_to_all,all_to_all_exact] [--tbo off,on] [--two-batch-split rows|requests]
        [--step-sync-channel shm]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from gpu_deepseek_v4 import PUBLISHED, floor_ms, model_dir  # noqa: E402
from gpu_llama8b import ceilings  # noqa: E402

from openinfer import LLM, SamplingParams  # noqa: E402
from openinfer.models.deepseek_v4.config import CSA, HCA, SLIDING, DeepseekV4Config  # noqa: E402
from openinfer.models.deepseek_v4.loader import published_formats  # noqa: E402
from openinfer.models.deepseek_v4.model import DeepseekV4ForCausalLM  # noqa: E402
from openinfer.quantization.checkpoint import QuantScheme  # noqa: E402
from openinfer.sampling_params import RequestOutputKind  # noqa: E402


def flash_layout(n: int) -> dict:
    """V4-Flash's schedule: two sliding-window layers, then CSA / HCA alternating; hash routing first 3."""
    types = [SLIDING] * min(2, n) + [CSA if i % 2 == 0 else HCA for i in range(max(0, n - 2))]
    return dict(num_hidden_layers=n, layer_types=types,
                mlp_layer_types=["hash_moe"] * min(3, n) + ["moe"] * max(0, n - 3))


def meta_model(path: Path, mtp: bool = True) -> DeepseekV4ForCausalLM:
    """The one-process model on the meta device in the published formats (byte counts for floors)."""
    hf = json.loads((path / "config.json").read_text())
    if not mtp:
        hf["num_nextn_predict_layers"] = 0
    with torch.device("meta"):
        m = DeepseekV4ForCausalLM(DeepseekV4Config.from_hf(hf)).cast(torch.bfloat16)
        m.quantize(published_formats(m, QuantScheme.from_hf(hf)), 128)
    return m


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))] if xs else float("nan")


def sweep_point(llm: LLM, c: int, input_len: int, output_len: int, gpus: int, floor, seed: int) -> dict:
    """One InferenceX point: `c` random prompts submitted at once. `floor(per_gpu requests, context, routed
    tokens)` -> (ms, detail): one GPU's decode-step floor (the model's own byte and flop counts)."""
    eng = llm.engine
    g = torch.Generator().manual_seed(seed)
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True,
                            output_kind=RequestOutputKind.DELTA)
    t0 = time.perf_counter()
    ids = [eng.add_request(torch.randint(100, 128000, (input_len,), generator=g).tolist(), params)
           for _ in range(c)]
    first, done, ntok = {}, {}, {rid: 0 for rid in ids}
    decode_steps = []        # wall time of steps once every request has its first token
    steps = 0
    while len(done) < c:
        ts = time.perf_counter()
        outs = eng.step()
        te = time.perf_counter()
        steps += 1
        all_started = len(first) == c
        for o in outs:
            n = len(o.outputs[0].token_ids)
            if n and o.request_id not in first:
                first[o.request_id] = te
            ntok[o.request_id] += n
            if o.finished:
                done[o.request_id] = te
        if all_started and len(done) == 0:
            decode_steps.append(te - ts)
    wall = time.perf_counter() - t0
    ttft = [first[r] - t0 for r in ids]
    tpot = [(done[r] - first[r]) / max(1, ntok[r] - 1) for r in ids]
    steady = decode_steps[16:] or decode_steps
    step_ms = 1e3 * sum(steady) / max(1, len(steady))
    # floor of one decode step on one GPU: its c/gpus requests at mid-generation context, all c tokens routed
    per_gpu = max(1, c // gpus)
    ctx = input_len + output_len // 2
    fl, detail = floor(per_gpu, ctx, c)
    stats = eng.stats()
    out_tokens = sum(ntok.values())
    return {"concurrency": c, "requests": c, "input_len": input_len, "output_len": output_len, "wall_s": wall,
            "steps": steps, "output_tok_s_per_gpu": out_tokens / wall / gpus,
            "ttft_ms_p50": 1e3 * pct(ttft, 0.5), "ttft_ms_p99": 1e3 * pct(ttft, 0.99),
            "tpot_ms_p50": 1e3 * pct(tpot, 0.5), "tpot_ms_p99": 1e3 * pct(tpot, 0.99),
            "decode_step_ms": step_ms, "decode_floor_ms": fl, "decode_ratio_to_floor": step_ms / fl,
            "roofline_output_tok_s_per_gpu": per_gpu / (fl / 1e3),
            "decode_tok_s_per_gpu": per_gpu / (step_ms / 1e3),
            "moe_lb": stats.get("moe_lb"), "eplb_rebalances": stats.get("eplb_rebalances"),
            "floor_detail": detail}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer-json", required=True)
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--layers", type=int, default=43)
    ap.add_argument("--concurrency", default="1,8,32,128")
    ap.add_argument("--input-len", type=int, default=8192)
    ap.add_argument("--output-len", type=int, default=1024)
    ap.add_argument("--eplb", action="store_true", help="EPLB on (window and interval below)")
    ap.add_argument("--eplb-interval", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--tag", default="")
    ap.add_argument("--dispatch", default="all_gather,all_to_all,all_to_all_exact",
                    help="MoE exchanges to sweep (EngineConfig.moe_dispatch values)")
    ap.add_argument("--tbo", default="off,on", help="two-batch overlap settings to sweep")
    ap.add_argument("--two-batch-split", default="rows", choices=["rows", "requests"],
                    help="EngineConfig.two_batch_split: halves of rows (the MoE alone) or of whole requests")
    ap.add_argument("--step-sync-channel", default="auto", choices=["auto", "shm", "gloo"])
    args = ap.parse_args()
    out_dir = Path(os.environ.get("OUT") or Path(__file__).parent / "results")
    out_dir.mkdir(parents=True, exist_ok=True)
    result = {"benchmark": "gpu_deepseek_v4_ep", "date": datetime.date.today().isoformat(),
              "commit": os.environ.get("OPENINFER_COMMIT") or subprocess.run(
                  ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
              "device": f"{args.gpus} x {torch.cuda.get_device_name(0)}", "torch": torch.__version__,
              "args": vars(args)}
    name = f"gpu_deepseek_v4_ep{args.gpus}{args.tag}.json"

    def save():
        (out_dir / name).write_text(json.dumps(result, indent=1, default=str))

    result["ceilings"] = ceil = ceilings()
    torch.cuda.empty_cache()
    print("ceilings", ceil, flush=True)
    path = model_dir(args.tokenizer_json, **PUBLISHED, **flash_layout(args.layers), num_nextn_predict_layers=1,
                     num_hash_layers=3)
    floor_model = meta_model(path, mtp=False)

    def floor(per_gpu: int, ctx: int, routed: int):
        return floor_ms(floor_model, [1] * per_gpu, [ctx] * per_gpu, ceil, routed_tokens=routed,
                        expert_share=1.0 / args.gpus)
    max_len = args.input_len + args.output_len + 128
    max_c = max(int(c) for c in args.concurrency.split(","))
    result["sweep"] = []
    for dispatch in args.dispatch.split(","):
        for tbo in args.tbo.split(","):
            if not run_variant(args, path, floor, max_len, max_c, dispatch, tbo == "on", result, save):
                return


def agreement_per_rank(llm: LLM) -> list[tuple[float, int]]:
    return [(s.get("step_sync_s", 0.0), s.get("step_sync_rounds", 0)) for s in llm.engine.stats()["per_rank"]]


def run_variant(args, path, floor, max_len, max_c, dispatch: str, tbo: bool, result, save) -> bool:
    """One engine with this exchange; its sweep points appended to result["sweep"]. False on an error."""
    t0 = time.perf_counter()
    llm = LLM(str(path), load_format="dummy", data_parallel_size=args.gpus, enable_expert_parallel=True,
              enable_eplb=args.eplb, eplb_window_steps=args.eplb_interval,
              eplb_rebalance_interval_steps=args.eplb_interval, max_model_len=max_len,
              max_num_seqs=max(1, max_c // args.gpus), max_num_batched_tokens=args.max_num_batched_tokens,
              moe_dispatch=dispatch, two_batch_overlap=tbo, two_batch_split=args.two_batch_split,
              step_sync_channel=args.step_sync_channel)
    variant = {"dispatch": dispatch, "two_batch_overlap": tbo, "two_batch_split": args.two_batch_split,
               "step_sync_channel": args.step_sync_channel}
    result.setdefault("startup_s", {})[f"{dispatch}/tbo={'on' if tbo else 'off'}"] = time.perf_counter() - t0
    mem = llm.engine.call_ranks("memory_stats")
    result["per_gpu"] = mem
    print("startup", variant, result["startup_s"], json.dumps(mem), flush=True)
    save()
    try:
        for i, c in enumerate(int(x) for x in args.concurrency.split(",")):
            before = agreement_per_rank(llm)
            row = {**variant, **sweep_point(llm, c, args.input_len, args.output_len, args.gpus, floor, seed=i)}
            after = agreement_per_rank(llm)
            row["agreement_ms_per_step_per_rank"] = [1e3 * (a[0] - b[0]) / max(1, a[1] - b[1])
                                                     for a, b in zip(after, before)]
            row["moe_lb_per_rank"] = [s.get("moe_lb") for s in llm.engine.stats()["per_rank"]]
            row["two_batch_steps_per_rank"] = [s.get("two_batch_steps") for s in llm.engine.stats()["per_rank"]]
            result["sweep"].append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "floor_detail"}), flush=True)
            save()
    except Exception:
        result["error"] = traceback.format_exc()
        print(result["error"], flush=True)
        return False
    finally:
        llm.shutdown()
        save()
    return True


if __name__ == "__main__":
    main()
