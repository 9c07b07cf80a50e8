"""openinfer vs HF transformers `generate` on the same SmolLM2 weights, same prompts, same run (CPU).

For each dtype and batch size: B random 128-token prompts (seed 0), 128 new tokens each, EOS ignored.
openinfer runs them as B requests with max_num_seqs=B; HF runs one `generate` call on the [B, 128] batch
(equal lengths: no padding). Also times the model's matmuls alone on a [B, hidden] input (the weight-
streaming floor of one decode step on this machine), so the numbers say how close to the floor each is.

    python benchmarks/cpu_offline_vs_hf.py --dtypes float32 bfloat16 int4 --batches 1 16
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import time
from pathlib import Path

import torch

from openinfer import LLM
from openinfer.benchmarks.offline import OfflineWorkload, run_offline
from openinfer.config import default_cache_dir
from openinfer.loader.model_source import resolve_model_dir


def machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    return f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__}, {torch.get_num_threads()} threads"


def commit() -> str:
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True).strip()
    except Exception:
        return "unknown"


def matmul_floor_ms(llm: LLM, batch: int, reps: int = 5) -> float:
    from openinfer.layers.quantized import Int4Linear

    linears = [m for m in llm.engine.runner.model.modules() if isinstance(m, (torch.nn.Linear, Int4Linear))]
    dtype = llm.config.torch_dtype
    xs = {m.in_features: torch.randn(batch, m.in_features, dtype=dtype) for m in linears}
    with torch.inference_mode():
        for m in linears:
            m(xs[m.in_features])
        start = time.perf_counter()
        for _ in range(reps):
            for m in linears:
                m(xs[m.in_features])
    return (time.perf_counter() - start) / reps * 1e3


def hf_generate(model, prompts: list[list[int]], new_tokens: int) -> float:
    ids = torch.tensor(prompts)
    with torch.inference_mode():
        model.generate(ids[:, :8], max_new_tokens=2, do_sample=False, pad_token_id=0)   # warm-up
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
        elapsed = time.perf_counter() - start
    assert out.shape[1] == ids.shape[1] + new_tokens
    return elapsed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16", "int4"])
    ap.add_argument("--batches", nargs="+", type=int, default=[1, 16])
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM

    model_dir = resolve_model_dir("smollm2-135m-instruct", default_cache_dir())
    rows = []
    for dtype in args.dtypes:
        # "int4": openinfer's int4 weight-only path (bf16 activations); its dense peer is HF in bf16
        hf_dtype = "bfloat16" if dtype == "int4" else dtype
        engine_dtype = {"dtype": "bfloat16", "quantization": "int4"} if dtype == "int4" else {"dtype": dtype}
        hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=getattr(torch, hf_dtype)).eval()
        for batch in args.batches:
            llm = LLM(str(model_dir), device="cpu", max_num_seqs=batch, **engine_dtype)
            workload = OfflineWorkload(batch, (args.input_len,) * 2, (args.output_len,) * 2, seed=0)
            prompts, _ = workload.build(llm.engine.model_config.vocab_size)
            run_offline(llm, OfflineWorkload(batch, (16, 16), (4, 4), seed=1), use_tqdm=False)  # warm-up
            ours = run_offline(llm, workload, use_tqdm=False)
            hf_s = hf_generate(hf, prompts, args.output_len)
            hf_tps = batch * args.output_len / hf_s
            floor = matmul_floor_ms(llm, batch)
            row = {
                "dtype": dtype, "hf_dtype": hf_dtype, "batch": batch, "input_len": args.input_len, "output_len": args.output_len,
                "openinfer_output_tok_s": round(ours["output_tok_per_s"], 1),
                "hf_generate_output_tok_s": round(hf_tps, 1),
                "ratio_vs_hf": round(ours["output_tok_per_s"] / hf_tps, 2),
                "matmul_floor_ms_per_decode_step": round(floor, 1),
                "openinfer_ms_per_output_token_step": round(1e3 * ours["elapsed_s"] / args.output_len, 1),
            }
            print(json.dumps(row), flush=True)
            rows.append(row)
            del llm
        del hf
    result = {"benchmark": "cpu_offline_vs_hf", "model": "SmolLM2-135M-Instruct (Q4_1 GGUF dequantized)",
              "machine": machine(), "date": datetime.date.today().isoformat(), "commit": commit(), "rows": rows}
    out = Path(args.out or f"benchmarks/results/cpu_offline_vs_hf_{result['date']}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
