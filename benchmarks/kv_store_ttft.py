"""TTFT with the prefix-KV store (docs/kv_cache.md): a prompt computed cold, hit in the GPU pool, and hit from the
store's directory tier by a restarted engine (the pool and host tier empty), through `LLM.generate` one prompt at
a time (max_tokens=1, so the wall time is the TTFT).

- cold: a fresh engine with an empty store directory computes each prompt (and writes its blocks behind: the
  writer is drained after each prompt, outside its TTFT, and that wait reported -- the write side's cost);
- pool hit: the same engine, the same prompts again (the peer: what a hit costs without the store);
- store hit: the engine shut down (its writer drained), a new one on the same directory with no host tier:
  every full block is read from the directory at schedule time and copied into the pool.

The break-even is simple arithmetic: a store hit pays (KV bytes per token) / (read + copy bandwidth) per token,
recompute pays 1 / (prefill tokens per second). CPU: the default model (SmolLM2-135M, fp32). CUDA: the
Llama-3-8B shape with random bf16 weights and a real tokenizer (`--tokenizer-json`).

    python benchmarks/kv_store_ttft.py                      # CPU
    python benchmarks/kv_store_ttft.py --device cuda --tokenizer-json PATH
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from openinfer import LLM, SamplingParams  # noqa: E402


def _ttfts(llm: LLM, prompts: list[list[int]], drain: list | None = None) -> list[tuple[float, int]]:
    """(TTFT s, cached tokens) per prompt; with `drain`, the store's writer is waited for after each prompt
    (outside the TTFT) and the wait appended to it: the write side's own time."""
    sp = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    out = []
    for p in prompts:
        t = time.perf_counter()
        o = llm.generate(prompt_token_ids=[p], sampling_params=sp, use_tqdm=False)[0]
        out.append((time.perf_counter() - t, o.num_cached_tokens))
        if drain is not None:
            t = time.perf_counter()
            llm.engine.kv_store.flush()
            drain.append(time.perf_counter() - t)
    return out


def _summary(rows) -> dict:
    times = sorted(t for t, _ in rows)
    return {"ttft_s_median": times[len(times) // 2], "ttft_s_min": times[0],
            "cached_tokens": [c for _, c in rows]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tokenizer-json")
    ap.add_argument("--prompt-tokens", type=int)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--store-dir", default=None, help="default: a fresh temporary directory")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    cuda = args.device.startswith("cuda")
    if cuda:
        from gpu_llama8b import LLAMA3_8B, model_dir

        model = str(model_dir(args.tokenizer_json, LLAMA3_8B))
        kw = dict(device=args.device, dtype="bfloat16", load_format="dummy", gpu_memory_utilization=0.85)
        vocab, n_tok = LLAMA3_8B["vocab_size"], args.prompt_tokens or 8192
    else:
        model, kw, vocab, n_tok = "smollm2-135m-instruct", dict(device="cpu", dtype="float32"), 49152, \
            args.prompt_tokens or 1024
    g = torch.Generator().manual_seed(0)
    warm = torch.randint(100, vocab - 100, (n_tok,), generator=g).tolist()
    prompts = [torch.randint(100, vocab - 100, (n_tok,), generator=g).tolist() for _ in range(args.prompts)]
    store = args.store_dir or tempfile.mkdtemp(prefix="kv-store-")
    shutil.rmtree(store, ignore_errors=True)
    res = {"benchmark": "kv_store_ttft", "date": datetime.date.today().isoformat(),
           "commit": os.environ.get("OPENINFER_COMMIT") or subprocess.run(
               ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
           "device": torch.cuda.get_device_name() if cuda else platform.machine(),
           "model": "Llama-3-8B shape (random bf16)" if cuda else model, "prompt_tokens": n_tok,
           "prompts": args.prompts, "store_dir_fs": subprocess.run(["df", "-T", str(Path(store).parent)],
                                                                   capture_output=True, text=True).stdout.split("\n")[1:2]}
    llm = LLM(model, kv_store_dir=store, kv_host_cache_bytes=0, **kw)
    _ttfts(llm, [warm], [])                                       # warm-up: kernels, graphs, the writer thread
    waits: list[float] = []
    res["cold"] = _summary(_ttfts(llm, prompts, waits))
    res["writer_drain_s_after_ttft"] = waits
    res["pool_hit"] = _summary(_ttfts(llm, prompts))
    res["kv_bytes_per_token"] = llm.engine.runner.pool.bytes_per_block() // llm.config.block_size
    llm.shutdown()
    del llm
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()
    res["store_bytes"] = sum(f.stat().st_size for f in Path(store).rglob("*") if f.is_file())
    llm = LLM(model, kv_store_dir=store, kv_host_cache_bytes=0, **kw)
    _ttfts(llm, [warm])
    res["store_hit"] = _summary(_ttfts(llm, prompts))
    res["stats"] = {k: v for k, v in llm.engine.stats().items() if "store" in k}
    llm.shutdown()
    for k in ("pool_hit", "store_hit"):
        res[f"{k}_over_cold"] = res[k]["ttft_s_median"] / res["cold"]["ttft_s_median"]
    full = n_tok // 128 * 128
    res["store_read_GBps_effective"] = full * res["kv_bytes_per_token"] / 1e9 / max(
        res["store_hit"]["ttft_s_median"] - res["pool_hit"]["ttft_s_median"], 1e-9)
    print(json.dumps({k: v for k, v in res.items() if k != "stats"}, indent=1), flush=True)
    out = Path(args.out or (Path(os.environ.get("OUT", "benchmarks/results")) /
                            f"{'gpu' if cuda else 'cpu'}_kv_store_ttft.json"))
    out.write_text(json.dumps(res, indent=2, default=str) + "\n")
    if not args.store_dir:
        shutil.rmtree(store, ignore_errors=True)


if __name__ == "__main__":
    main()
