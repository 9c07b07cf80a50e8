"""Bounded replay's quality and time cost on the real Gemma-3-270M (docs/kv_cache.md, kv_cache/bounded_replay.py).

A document's prefix (`--prefix` tokens) is in the prefix-KV store (a directory), the GPU pool is empty, and a
request asks for the next `--suffix` tokens' log-probabilities (teacher-forced; `prompt_logprobs_start` lets the
prefix come from the cache). The window state is:
- none (no cache): the whole document computed cold -- the reference;
- state hit: the windowed layers' rows come from host memory (saved when the prefix's request ended) -- exact;
- exact replay: missing; the windowed layers are recomputed from the first missing block (the whole prefix);
- bounded replay: missing; only the last window is recomputed, its attention truncated to the window (spec §5.4).
Perplexity over the suffix (and over its first 64 tokens, where the truncation's effect is strongest), the max
|delta log p| of any suffix token vs no cache, and the time to the first token of a prompt = prefix + a short
question in each state, as a ratio to cold prefill (same run).

Text: the Python language reference topics shipped with CPython (`pydoc_data.topics`, PSF licence), so any machine
can rerun it without a download; each document is consecutive topics until long enough.

    python benchmarks/bounded_replay.py [--device cpu] [--docs 4] [--prefix 1536] [--suffix 256]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import subprocess
import tempfile
import time
from pathlib import Path

from openinfer import LLM, SamplingParams

MODES = ("no_cache", "state_hit", "exact_replay", "bounded_replay")


def documents(tokenizer, n: int, length: int) -> list[list[int]]:
    from pydoc_data.topics import topics

    docs, current = [], []
    for name in sorted(topics):
        current += tokenizer.encode(topics[name])
        if len(current) >= length:
            docs.append(current[:length])
            current = []
            if len(docs) == n:
                return docs
    raise ValueError(f"pydoc topics hold fewer than {n} documents of {length} tokens")


def _suffix_logprobs(llm: LLM, doc: list[int], prefix: int) -> list[float]:
    """log p of doc[prefix + 1:] (the row at `prefix` is the first computed one: the hit can cover the prefix)."""
    sp = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0, prompt_logprobs_start=prefix + 1)
    out = llm.generate(prompt_token_ids=[doc], sampling_params=sp, use_tqdm=False)[0]
    return [out.prompt_logprobs[i][doc[i]].logprob for i in range(prefix + 1, len(doc))]


def _ttft(llm: LLM, prompt: list[int]) -> tuple[float, int]:
    sp = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    t = time.perf_counter()
    out = llm.generate(prompt_token_ids=[prompt], sampling_params=sp, use_tqdm=False)[0]
    return time.perf_counter() - t, out.num_cached_tokens


def _engine(args, store: str | None, **kw) -> LLM:
    return LLM(args.model, device=args.device, dtype=args.dtype, block_size=16, max_num_batched_tokens=4096,
               kv_store_dir=store, **kw)


def _seed_store(llm: LLM, prefix: list[int]) -> None:
    """The prefix computed once (its blocks to the store, its window state to host memory), then the pool emptied."""
    llm.generate(prompt_token_ids=[prefix], sampling_params=SamplingParams(max_tokens=1, temperature=0),
                 use_tqdm=False)
    llm.engine.kv_store.flush()
    assert llm.engine.stats()["kv_store_dropped_writes"] == 0, "the store dropped blocks: raise the write buffer"
    assert llm.engine.kv_manager.reset_prefix_cache()


def run(args) -> dict:
    question = None
    results = {m: {"logprobs": [], "ttft_s": [], "cached_tokens": []} for m in MODES}
    with tempfile.TemporaryDirectory() as tmp:
        engines = {"no_cache": _engine(args, None, enable_prefix_caching=False)}
        tok = engines["no_cache"].tokenizer
        docs = documents(tok, args.docs, args.prefix + args.suffix)
        question = tok.encode("\n\nQuestion: what does the text above describe? Answer:")
        engines["state_hit"] = _engine(args, f"{tmp}/state")
        engines["exact_replay"] = _engine(args, f"{tmp}/exact", swa_state_bytes=0, swa_replay="exact")
        engines["bounded_replay"] = _engine(args, f"{tmp}/bounded", swa_state_bytes=0, swa_replay="bounded")
        _ttft(engines["no_cache"], docs[0][:64])        # warm-up
        for doc in docs:
            prefix = doc[:args.prefix]
            for mode, llm in engines.items():
                if mode != "no_cache":
                    _seed_store(llm, prefix)
                results[mode]["logprobs"].append(_suffix_logprobs(llm, doc, args.prefix))
                if mode != "no_cache":
                    _seed_store(llm, prefix)
                t, cached = _ttft(llm, prefix + question)
                results[mode]["ttft_s"].append(t)
                results[mode]["cached_tokens"].append(cached)
        stats = {m: {k: v for k, v in e.engine.stats().items() if k.startswith("swa")} for m, e in engines.items()}
        for llm in engines.values():
            llm.shutdown()
    ref = results["no_cache"]["logprobs"]
    ref_ttft = sorted(results["no_cache"]["ttft_s"])[len(docs) // 2]
    rows = {}
    for mode in MODES:
        lps = results[mode]["logprobs"]
        flat = [x for doc in lps for x in doc]
        head = [x for doc in lps for x in doc[:64]]
        ttft = sorted(results[mode]["ttft_s"])[len(docs) // 2]
        rows[mode] = {
            "ppl_suffix": math.exp(-sum(flat) / len(flat)),
            "ppl_first_64": math.exp(-sum(head) / len(head)),
            "max_abs_dlogp_vs_no_cache": max(abs(a - b) for d, r in zip(lps, ref) for a, b in zip(d, r)),
            "ttft_s_median": ttft, "ttft_vs_cold": ttft / ref_ttft,
            "cached_tokens": results[mode]["cached_tokens"], "engine_stats": stats[mode],
        }
    return {"rows": rows, "docs": len(docs), "prefix_tokens": args.prefix, "suffix_tokens": args.suffix,
            "question_tokens": len(question)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--docs", type=int, default=4)
    ap.add_argument("--prefix", type=int, default=1536)
    ap.add_argument("--suffix", type=int, default=256)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    import torch

    torch.set_num_threads(os.cpu_count() or 1)
    result = run(args)
    commit = os.environ.get("OPENINFER_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
        cwd=Path(__file__).parent).stdout.strip()
    result.update(model=args.model, device=args.device, dtype=args.dtype, commit=commit,
                  date=datetime.date.today().isoformat(), host=platform.processor() or platform.machine(),
                  cpus=os.cpu_count(), torch=torch.__version__)
    print(f"{'mode':16s} {'ppl':>8s} {'ppl@64':>8s} {'max|dlogp|':>10s} {'TTFT s':>8s} {'x cold':>7s}")
    for mode, r in result["rows"].items():
        print(f"{mode:16s} {r['ppl_suffix']:8.3f} {r['ppl_first_64']:8.3f} {r['max_abs_dlogp_vs_no_cache']:10.2e} "
              f"{r['ttft_s_median']:8.3f} {r['ttft_vs_cold']:7.2f}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
