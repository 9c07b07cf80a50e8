"""Context parallelism on the CPU (gloo): the K/V exchange (all-gather vs ring), the per-rank attention work of the
balanced (zigzag) and the contiguous split (computed and measured), and the prefill time of one long prompt at CP1
(one process), CP2 and CP4 (docs/parallelism.md, "Context parallelism").

    python benchmarks/cpu_context_parallel.py [--prompt-len 4096] [--out benchmarks/results/cpu_context_parallel.json]

Each rank runs one torch thread (the one-process run too), so the prefill rows compare the same per-rank compute;
on a host with fewer cores than ranks (CP4 on 2 cores) the ranks share cores and the row says so.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from openinfer.distributed.context_parallel import (attention_work, contiguous_pieces,  # noqa: E402
                                                    zigzag_pieces)

# the model of the prefill rows: a small Llama whose attention weighs at a few thousand tokens
MODEL = dict(vocab_size=49152, hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=2, max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=10000.0,
             tie_word_embeddings=False)


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- 1. the exchange ------------------------------------------------------------------------------------------
def _exchange_rank(rank: int, cp: int, port: int, rows: int, width: int, reps: int, queue) -> None:
    import torch.distributed as dist

    from openinfer.distributed.context_parallel import cp_all_gather, ring_all_gather
    from openinfer.distributed.parallel_state import ParallelContext

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=cp)
    ctx = ParallelContext(world_size=cp, rank=rank, cp_size=cp, cp_rank=rank, cp_group=dist.new_group(list(range(cp))))
    x = torch.randn(rows, width)
    fns = {"all_gather": cp_all_gather, "ring": ring_all_gather}
    times = {name: [] for name in fns}
    for fn in fns.values():
        fn(x, ctx)
    for i in range(reps):           # interleaved, so a busy host's drift weighs on both alike
        for name in (("all_gather", "ring") if i % 2 else ("ring", "all_gather")):
            dist.barrier()
            t = time.perf_counter()
            fns[name](x, ctx)
            times[name].append(time.perf_counter() - t)
    out = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    assert torch.equal(cp_all_gather(x, ctx), ring_all_gather(x, ctx))
    queue.put((rank, out))
    dist.destroy_process_group()


def exchange(cp: int, tokens: int, width: int, reps: int = 40) -> dict:
    """One layer's K/V exchange of a `tokens`-token chunk: each rank's tokens/cp rows of `width` floats."""
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), _port()
    procs = [ctx.Process(target=_exchange_rank, args=(r, cp, port, tokens // cp, width, reps, queue))
             for r in range(cp)]
    for p in procs:
        p.start()
    got = dict(queue.get(timeout=300) for _ in procs)
    for p in procs:
        p.join()
    return {name: max(got[r][name] for r in got) for name in ("all_gather", "ring")}


# ---- 2. per-rank attention work -------------------------------------------------------------------------------
def attention_ms(pieces, n: int, heads: int = 8, kv_heads: int = 2, dim: int = 64, reps: int = 3) -> float:
    """Causal attention of one rank's query pieces over the chunk's keys (SDPA, one thread)."""
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(1, kv_heads, n, dim, generator=g)
    vals = torch.randn(1, kv_heads, n, dim, generator=g)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        for a, b in pieces:
            if b <= a:
                continue
            q = torch.randn(1, heads, b - a, dim, generator=g)
            mask = torch.arange(b)[None, :] <= torch.arange(a, b)[:, None]
            F.scaled_dot_product_attention(q, keys[:, :, :b], vals[:, :, :b], attn_mask=mask, enable_gqa=True)
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def balance(n: int, cp: int) -> dict:
    rows = {}
    for name, split in (("zigzag", zigzag_pieces(n, cp)), ("contiguous", contiguous_pieces(n, cp))):
        work = [attention_work(p) for p in split]
        ms = [attention_ms(p, n) for p in split]
        rows[name] = dict(work_keys=work, work_max_over_mean=max(work) / statistics.mean(work),
                          measured_ms=[round(m, 2) for m in ms], measured_max_over_mean=max(ms) / statistics.mean(ms))
    return rows


# ---- 3. prefill of one long prompt ------------------------------------------------------------------------------
def prefill(path: str, cp: int, prompt_len: int, reps: int = 3) -> float:
    from openinfer import LLM
    from openinfer.sampling_params import SamplingParams

    torch.set_num_threads(1)
    llm = LLM(path, device="cpu", context_parallel_size=cp, max_num_batched_tokens=prompt_len, max_num_seqs=1,
              enable_prefix_caching=False, max_model_len=prompt_len + 8)
    sp = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    g = torch.Generator().manual_seed(0)
    times = []
    try:
        for i in range(reps + 1):
            prompt = torch.randint(2, 49000, (prompt_len,), generator=g).tolist()
            t = time.perf_counter()
            llm.generate(prompt_token_ids=[prompt], sampling_params=sp, use_tqdm=False)
            if i:                       # the first is the warm-up
                times.append(time.perf_counter() - t)
    finally:
        llm.shutdown()
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt-len", type=int, default=4096)
    ap.add_argument("--cps", default="1,2,4")
    ap.add_argument("--out", default="benchmarks/results/cpu_context_parallel.json")
    a = ap.parse_args()
    from openinfer.config import default_cache_dir
    from openinfer.loader.model_source import resolve_model_dir
    from openinfer.models.llama.family import FAMILY

    cps = [int(c) for c in a.cps.split(",")]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    result = dict(device=f"CPU, {os.cpu_count()} cores, torch {torch.__version__}, gloo",
                  date=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), commit=commit,
                  load_average_at_start=os.getloadavg(), model=MODEL, prompt_len=a.prompt_len)
    kv_width = 2 * MODEL["num_key_value_heads"] * MODEL["hidden_size"] // MODEL["num_attention_heads"]
    result["exchange_ms_per_layer"] = {f"cp{cp}_{n}_tokens": exchange(cp, n, kv_width, reps=40)
                                       for cp in cps if cp > 1 for n in (1024, a.prompt_len, 4 * a.prompt_len)}
    print(json.dumps(result["exchange_ms_per_layer"]), flush=True)
    result["attention_balance"] = {f"cp{cp}": balance(a.prompt_len, cp) for cp in cps if cp > 1}
    print(json.dumps(result["attention_balance"]), flush=True)
    with tempfile.TemporaryDirectory() as d:
        FAMILY.write_random_checkpoint(MODEL, Path(d), tokenizer_dir=resolve_model_dir("smollm2-135m-instruct",
                                                                                       default_cache_dir()))
        result["prefill_s"] = {}
        for cp in cps:
            result["prefill_s"][f"cp{cp}"] = prefill(d, cp, a.prompt_len)
            print(cp, result["prefill_s"][f"cp{cp}"], flush=True)
    base = result["prefill_s"].get("cp1")
    if base:
        result["prefill_speedup"] = {k: base / v for k, v in result["prefill_s"].items()}
    result["load_average_at_end"] = os.getloadavg()
    Path(a.out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
