"""What the FP8 KV cache (`kv_cache_dtype="fp8"`) costs in accuracy and saves in memory: SmolLM2-135M on the CPU.

For each model dtype (float32, bfloat16): the real-text prompts of tests/test_fidelity_smollm.py, N greedy tokens
each (EOS ignored), once with the unquantized cache (the reference) and once with the FP8 cache. Reports
- free-running greedy agreement: per prompt, the tokens generated before the first divergence;
- teacher forcing (prompt + the reference's greedy tokens, scored in one pass with prompt_logprobs=1): the
  fraction of positions where the FP8 cache's top-1 token equals the reference's, and the mean / p99 / max
  |delta logprob| of the reference's chosen token;
- KV bytes per token (all layers, K and V, scales included) of both caches.

    python benchmarks/cpu_fp8_kv_accuracy.py [--tokens 128] [--dtypes float32 bfloat16]

DeepSeek-V4's own cache format (`kv_cache_dtype="fp8_ds_mla"`: window and compressed entries as FlashMLA's FP8
rows) against its unquantized cache, on the tiny V4 (random weights: near-flat logits, so greedy tokens part on
near ties; the teacher-forced |delta logprob| is the measure) or a real V4 checkpoint:

    python benchmarks/cpu_fp8_kv_accuracy.py --model deepseek-v4-tiny --kv-cache-dtype fp8_ds_mla --tokens 32 \
        --out benchmarks/results/cpu_fp8_ds_mla_accuracy.json

On a GPU, the Llama-3-8B shape with random bf16 weights (the engine of benchmarks/gpu_llama8b.py; the Triton
kernels write and read the FP8 cache):

    python benchmarks/cpu_fp8_kv_accuracy.py --llama8b-dummy TOKENIZER_JSON --dtypes bfloat16 --out $OUT/x.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from openinfer import LLM, SamplingParams  # noqa: E402
from tests.test_fidelity_smollm import PROMPTS  # noqa: E402  (the real-text prompt set of the fidelity tests)


def commit() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True, cwd=ROOT).strip()
    except Exception:
        return "unknown"


def greedy(llm: LLM, prompts: list[list[int]], n: int) -> list[list[int]]:
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(temperature=0, max_tokens=n,
                                                                                  ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def teacher_forced(llm: LLM, prompts: list[list[int]], conts: list[list[int]]) -> list[list[tuple[float, int]]]:
    """Per prompt, per continuation token: (logprob of that token, the top-1 token) given everything before it."""
    seqs = [p + c for p, c in zip(prompts, conts)]
    outs = llm.generate(prompt_token_ids=seqs, sampling_params=SamplingParams(temperature=0, max_tokens=1,
                                                                               prompt_logprobs=1), use_tqdm=False)
    res = []
    for p, seq, o in zip(prompts, seqs, outs):
        rows = []
        for i in range(len(p), len(seq)):
            entry = o.prompt_logprobs[i]
            top1 = next(t for t, lp in entry.items() if lp.rank == 1)
            rows.append((entry[seq[i]].logprob, top1))
        res.append(rows)
    return res


ENGINE = {"device": "cpu", "kv_cache_memory_bytes": 256 << 20}   # --llama8b-dummy: CUDA, random weights


def run_cache(model: str, dtype: str, kv_cache_dtype: str, n: int, forced: list[list[int]] | None = None):
    """(prompts, greedy tokens, teacher-forced rows over `forced` (else its own greedy tokens), greedy wall s,
    KV bytes per token) of one engine."""
    llm = LLM(model, dtype=dtype, kv_cache_dtype=kv_cache_dtype, max_num_seqs=len(PROMPTS), **ENGINE)
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS]
    t = time.perf_counter()
    tokens = greedy(llm, prompts, n)
    secs = time.perf_counter() - t
    rows = teacher_forced(llm, prompts, forced or tokens)
    kv_bytes = llm.engine.runner.pool.bytes_per_block() / llm.engine.config.block_size
    llm.shutdown()
    return prompts, tokens, rows, secs, kv_bytes


def run_dtype(model: str, dtype: str, n: int, kv_cache_dtype: str = "fp8") -> dict:
    prompts, ref_tokens, ref_tf, ref_s, ref_bytes = run_cache(model, dtype, "auto", n)
    _, fp8_tokens, fp8_tf, fp8_s, fp8_bytes = run_cache(model, dtype, kv_cache_dtype, n, forced=ref_tokens)
    prefix = [next((i for i, (a, b) in enumerate(zip(r, f)) if a != b), n) for r, f in zip(ref_tokens, fp8_tokens)]
    dlp = np.array([abs(a[0] - b[0]) for r, f in zip(ref_tf, fp8_tf) for a, b in zip(r, f)])
    top1_same = np.mean([a[1] == b[1] for r, f in zip(ref_tf, fp8_tf) for a, b in zip(r, f)])
    # the reference's own teacher-forced top-1 against its free-running greedy tokens: how often one forward
    # pass over the whole sequence picks differently from token-by-token decode (fp32/bf16 rounding alone)
    ref_self = np.mean([row[1] == tok for rows, toks in zip(ref_tf, ref_tokens) for row, tok in zip(rows, toks)])
    return {
        "prompts": len(prompts), "tokens_per_prompt": n,
        "greedy_prefix_until_divergence": prefix,
        "greedy_identical_prompts": int(sum(p == n for p in prefix)),
        "greedy_prefix_mean": float(np.mean(prefix)),
        "teacher_forced_top1_agreement": float(top1_same),
        "teacher_forced_positions": int(dlp.size),
        "abs_dlogprob_mean": float(dlp.mean()), "abs_dlogprob_p99": float(np.percentile(dlp, 99)),
        "abs_dlogprob_max": float(dlp.max()),
        "reference_teacher_forced_vs_own_greedy": float(ref_self),
        "kv_bytes_per_token": {"reference": ref_bytes, kv_cache_dtype: fp8_bytes, "ratio": fp8_bytes / ref_bytes},
        "greedy_wall_s": {"reference": ref_s, kv_cache_dtype: fp8_s},
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--kv-cache-dtype", default="fp8", choices=["fp8", "fp8_e4m3", "fp8_ds_mla"],
                    help="the quantized cache held against kv_cache_dtype='auto' (fp8_ds_mla: DeepSeek-V4)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "cpu_fp8_kv_accuracy.json"))
    ap.add_argument("--llama8b-dummy", metavar="TOKENIZER_JSON",
                    help="CUDA: the Llama-3-8B shape with random weights (benchmarks/gpu_llama8b.py's model)")
    args = ap.parse_args()
    device = "cpu"
    if args.llama8b_dummy:
        import os

        import torch

        sys.path.insert(0, str(ROOT / "benchmarks"))
        from gpu_llama8b import LLAMA3_8B, model_dir

        args.model = str(model_dir(args.llama8b_dummy, LLAMA3_8B))
        device = torch.cuda.get_device_name()
        ENGINE.update(device="cuda", load_format="dummy", kv_cache_memory_bytes=8 << 30, max_model_len=2048)
        c = os.environ.get("OPENINFER_COMMIT")
    res = {"benchmark": "cpu_fp8_kv_accuracy", "date": datetime.date.today().isoformat(),
           "commit": (c if args.llama8b_dummy and c else commit()),
           "device": device, "model": "Llama-3-8B shape, random bf16 weights" if args.llama8b_dummy else args.model,
           "prompt_set": "tests/test_fidelity_smollm.py PROMPTS", "kv_cache_dtype": args.kv_cache_dtype,
           "results": {}}
    for dtype in args.dtypes:
        res["results"][dtype] = r = run_dtype(args.model, dtype, args.tokens, args.kv_cache_dtype)
        print(dtype, json.dumps({k: v for k, v in r.items() if k != "greedy_prefix_until_divergence"}), flush=True)
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    print("wrote", args.out)


if __name__ == "__main__":
    main()
