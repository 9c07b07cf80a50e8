"""Context parallelism on GPUs: prefill time of one long prompt at CP1, CP2, ... up to the GPUs present (NCCL,
Triton attention), a Llama shape with random weights (`load_format="dummy"`: only config.json and a tokenizer are
written), and a check that every CP size gives the one-GPU run's first token.

    python benchmarks/gpu_context_parallel.py --tokenizer DIR [--prompt-len 32768] [--layers 8] [--hidden 4096]
        [--cps 1,2,4,8] [--out benchmarks/results/gpu_context_parallel.json]

`--tokenizer`: a directory with tokenizer.json and tokenizer_config.json (e.g. the SmolLM2 one in the openinfer
cache; vocabulary 49152). CP sizes above the number of GPUs are skipped. Not yet run: written for when several
GPUs are lent (docs/parallelism.md, "Context parallelism").
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def prefill(path: str, cp: int, prompt_len: int, reps: int) -> tuple[float, int]:
    from openinfer import LLM
    from openinfer.sampling_params import SamplingParams

    llm = LLM(path, device="cuda", dtype="bfloat16", load_format="dummy", context_parallel_size=cp,
              max_num_batched_tokens=prompt_len, max_num_seqs=1, enable_prefix_caching=False,
              max_model_len=prompt_len + 8, gpu_memory_utilization=0.5)
    sp = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    fixed = torch.randint(2, 49000, (prompt_len,), generator=g).tolist()
    times = []
    try:
        first = llm.generate(prompt_token_ids=[fixed], sampling_params=sp, use_tqdm=False)[0].outputs[0].token_ids[0]
        for _ in range(reps):
            prompt = torch.randint(2, 49000, (prompt_len,), generator=g).tolist()
            t = time.perf_counter()
            llm.generate(prompt_token_ids=[prompt], sampling_params=sp, use_tqdm=False)
            times.append(time.perf_counter() - t)
    finally:
        llm.shutdown()
    return statistics.median(times), first


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--prompt-len", type=int, default=32768)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--cps", default="1,2,4,8")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/gpu_context_parallel.json")
    a = ap.parse_args()
    gpus = torch.cuda.device_count()
    cps = [c for c in (int(x) for x in a.cps.split(",")) if c <= gpus]
    hf = dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=49152, hidden_size=a.hidden,
              intermediate_size=int(a.hidden * 3.5), num_hidden_layers=a.layers, num_attention_heads=a.hidden // 128,
              num_key_value_heads=8, max_position_embeddings=a.prompt_len + 8, rms_norm_eps=1e-5,
              rope_theta=500000.0, tie_word_embeddings=False, torch_dtype="bfloat16")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    result = dict(device=f"{gpus} x {torch.cuda.get_device_name(0)}", date=datetime.now(timezone.utc).strftime(
        "%Y-%m-%d %H:%M UTC"), commit=commit, model=hf, prompt_len=a.prompt_len, prefill_s={}, first_token={})
    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "config.json").write_text(json.dumps(hf))
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(Path(a.tokenizer) / f, Path(d) / f)
        for cp in cps:
            s, first = prefill(d, cp, a.prompt_len, a.reps)
            result["prefill_s"][f"cp{cp}"], result["first_token"][f"cp{cp}"] = s, first
            print(f"cp{cp}: {s:.3f} s, first token {first}", flush=True)
    base = result["prefill_s"].get("cp1")
    if base:
        result["prefill_speedup"] = {k: base / v for k, v in result["prefill_s"].items()}
    Path(a.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
