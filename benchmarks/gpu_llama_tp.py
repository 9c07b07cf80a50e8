"""Tensor parallelism on Llama shapes: decode step time vs the per-GPU floor, in one device call.

Llama-3-8B shape with TP1 (the one-GPU path, the peer) and TP2, and the Llama-3-70B shape (140 GB in bf16:
it needs two H200s) with TP2; random bf16 weights (`load_format="dummy"`), through `LLM` (TP2 = two worker
processes, NCCL all-reduce after every row-parallel linear, CUDA graphs). Floor of one decode step on one
GPU: (its weight shard + its KV heads' cache for the batch) / measured copy bandwidth. Writes JSON to $OUT
(or benchmarks/results/).

    python benchmarks/gpu_llama_tp.py --tokenizer-json PATH [--batches 1,64] [--context 1024]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from gpu_llama8b import LLAMA3_8B, ceilings  # noqa: E402

from openinfer import LLM, SamplingParams  # noqa: E402
from openinfer.sampling_params import RequestOutputKind  # noqa: E402

LLAMA3_70B = {**LLAMA3_8B, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
              "num_attention_heads": 64, "num_key_value_heads": 8}


def model_dir(cfg: dict, tokenizer_json: str) -> Path:
    d = Path(tempfile.mkdtemp(prefix="llama-shape-"))
    (d / "config.json").write_text(json.dumps(cfg))
    shutil.copy(tokenizer_json, d / "tokenizer.json")
    (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<｜end▁of▁sentence｜>"}))
    return d


def weight_bytes(cfg: dict) -> int:
    h, i, L, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    d = cfg["head_dim"]
    attn = h * d * (cfg["num_attention_heads"] * 2 + cfg["num_key_value_heads"] * 2)
    return 2 * (L * (attn + 3 * h * i + 2 * h) + 2 * v * h + h)


def decode(llm: LLM, cfg: dict, batch: int, ctx: int, tp: int, ceil: dict, steps: int = 40) -> dict:
    eng = llm.engine
    g = torch.Generator().manual_seed(batch)
    params = SamplingParams(temperature=0, max_tokens=steps + 40, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    ids = [eng.add_request(torch.randint(100, 128000, (ctx,), generator=g).tolist(), params) for _ in range(batch)]
    started: set[str] = set()
    while len(started) < batch:
        started |= {o.request_id for o in eng.step() if o.outputs[0].token_ids}
    for _ in range(5):
        eng.step()
    t0 = time.perf_counter()
    for _ in range(steps):
        eng.step()
    step_ms = (time.perf_counter() - t0) / steps * 1e3
    for rid in ids:
        eng.abort_request(rid)
    eng.step()
    kv = 2 * batch * (ctx + 25) * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * cfg["head_dim"] * 2
    floor = (weight_bytes(cfg) + kv) / tp / (ceil["copy_TBps"] * 1e12) * 1e3
    return {"batch": batch, "context": ctx, "tp": tp, "step_ms": step_ms, "floor_ms": floor,
            "ratio_to_floor": step_ms / floor, "tok_s": batch / step_ms * 1e3}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer-json", required=True)
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--models", default="8b:1,8b:2,70b:2")
    args = ap.parse_args()
    out_dir = Path(os.environ.get("OUT") or Path(__file__).parent / "results")
    out_dir.mkdir(parents=True, exist_ok=True)
    result = {"benchmark": "gpu_llama_tp", "date": datetime.date.today().isoformat(),
              "commit": os.environ.get("OPENINFER_COMMIT") or subprocess.run(
                  ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
              "device": f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}", "rows": []}
    result["ceilings"] = ceil = ceilings()
    torch.cuda.empty_cache()
    batches = [int(b) for b in args.batches.split(",")]
    for spec in args.models.split(","):
        name, tp = spec.split(":")
        cfg = {"8b": LLAMA3_8B, "70b": LLAMA3_70B}[name]
        t0 = time.perf_counter()
        llm = LLM(str(model_dir(cfg, args.tokenizer_json)), load_format="dummy", tensor_parallel_size=int(tp),
                  max_model_len=args.context + 256, max_num_seqs=max(batches), gpu_memory_utilization=0.9)
        start = time.perf_counter() - t0
        for b in batches:
            row = {"model": f"llama3-{name}", "startup_s": start, **decode(llm, cfg, b, args.context, int(tp), ceil)}
            result["rows"].append(row)
            print(json.dumps(row), flush=True)
            (out_dir / "gpu_llama_tp.json").write_text(json.dumps(result, indent=1))
        llm.shutdown()


if __name__ == "__main__":
    main()
