"""What batch-invariant mode (EngineConfig.batch_invariant) costs: default vs invariant engines on the same
requests, in one process, through `LLM.generate` (EOS ignored).

- prefill: one prompt of --prefill-tokens, max_tokens=1: the wall time (its TTFT).
- decode at batch b: b prompts of 32 tokens, run once with max_tokens=1 and once with 1 + --decode-steps; the
  per-step time is the difference / --decode-steps (so prefill and start-up cancel).

CPU: the default model (SmolLM2-135M-Instruct, fp32). CUDA: the Llama-3-8B shape with random bf16 weights and
a real tokenizer (`--tokenizer-json`, model_dir() of gpu_llama8b.py), CUDA graphs and async scheduling as by
default. Each number is the best of --repeats runs; ratios are invariant / default in the same run.

    python benchmarks/batch_invariant_cost.py                       # CPU
    python benchmarks/batch_invariant_cost.py --device cuda --tokenizer-json PATH
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from openinfer import LLM, SamplingParams  # noqa: E402


def _best(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def measure(model: str, engine_kw: dict, prefill_tokens: int, batches: list[int], steps: int, repeats: int,
            vocab: int) -> dict:
    llm = LLM(model, **engine_kw)
    g = torch.Generator().manual_seed(0)
    ids = lambda n: torch.randint(100, vocab - 100, (n,), generator=g).tolist()  # noqa: E731
    one = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0)
    long_prompt = ids(prefill_tokens)
    run = lambda prompts, sp: llm.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False)  # noqa: E731
    run([long_prompt], one)                                             # warm-up (graphs, kernels)
    out = {"prefill_s": _best(lambda: run([long_prompt], one), repeats)}
    many = SamplingParams(max_tokens=1 + steps, ignore_eos=True, temperature=0)
    for b in batches:
        prompts = [ids(32) for _ in range(b)]
        run(prompts, many)
        t1 = _best(lambda: run(prompts, one), repeats)
        tn = _best(lambda: run(prompts, many), repeats)
        out[f"decode_b{b}_step_ms"] = (tn - t1) / steps * 1e3
    llm.shutdown()
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tokenizer-json", help="CUDA: the Llama-3-8B shape with this tokenizer, random weights")
    ap.add_argument("--prefill-tokens", type=int)
    ap.add_argument("--batches", type=int, nargs="+")
    ap.add_argument("--decode-steps", type=int)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cuda = args.device.startswith("cuda")
    if cuda:
        from gpu_llama8b import LLAMA3_8B, model_dir

        model = str(model_dir(args.tokenizer_json, LLAMA3_8B))
        kw = dict(device=args.device, dtype="bfloat16", load_format="dummy", max_num_seqs=256, enable_prefix_caching=False,
                  gpu_memory_utilization=0.85)
        vocab = LLAMA3_8B["vocab_size"]
        defaults = (8192, [1, 64], 64)
    else:
        model = "smollm2-135m-instruct"
        kw = dict(device="cpu", dtype="float32", max_num_seqs=16, enable_prefix_caching=False)
        vocab = 49152
        defaults = (512, [1, 16], 16)
    prefill = args.prefill_tokens or defaults[0]
    batches = args.batches or defaults[1]
    steps = args.decode_steps or defaults[2]
    res = {"benchmark": "batch_invariant_cost", "date": datetime.date.today().isoformat(),
           "commit": os.environ.get("OPENINFER_COMMIT") or subprocess.run(
               ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
           "device": torch.cuda.get_device_name() if cuda else platform.processor() or platform.machine(),
           "threads": torch.get_num_threads(), "model": "Llama-3-8B shape (random bf16)" if cuda else model,
           "prefill_tokens": prefill, "decode_steps": steps, "repeats": args.repeats}
    for mode in ("default", "batch_invariant"):
        res[mode] = measure(model, {**kw, "batch_invariant": mode == "batch_invariant"}, prefill, batches, steps,
                            args.repeats, vocab)
        print(mode, json.dumps(res[mode]), flush=True)
    res["ratio_invariant_over_default"] = {k: res["batch_invariant"][k] / res["default"][k] for k in res["default"]}
    print("ratios", json.dumps(res["ratio_invariant_over_default"]), flush=True)
    out = Path(args.out or (Path(os.environ.get("OUT", "benchmarks/results")) /
                            f"{'gpu' if cuda else 'cpu'}_batch_invariant_cost.json"))
    out.write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
