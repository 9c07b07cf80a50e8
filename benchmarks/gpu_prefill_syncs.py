"""The host syncs of one DeepSeek-V4-Flash-width prefill step's model forward on CUDA, by call site, and the forward's
wall time: the GPU counterpart of `prefill_host_census.py` (which counts on the CPU).

Builds the model `gpu_deepseek_v4.py` builds (V4-Flash widths, `--layers` layers, random weights in the published
FP8 / MXFP4 formats with `--weights fp8`), eager (no decode graphs: prefill runs eagerly anyway), then runs prefill
steps of `--seqs` prompts of `--len` tokens (one step each; the first warms the JIT kernels). During the model's
forward only (not the runner's or the sampler's work) `torch.cuda.set_sync_debug_mode("warn")` reports every
synchronizing CUDA call (item / tolist / plain host<->device copies / nonzero ...); each is charged to the innermost
openinfer line on the stack. Prints one JSON line: syncs per forward by site, and the forward's wall ms (GPU
synchronized before and after: the host's issue time or the GPU's, whichever is longer, plus the syncs' stalls).

    python benchmarks/gpu_prefill_syncs.py --tokenizer-json PATH [--weights fp8|bf16] [--layers 4] [--seqs 8]
                                           [--len 1024] [--steps 3]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
import time
import traceback
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from gpu_deepseek_v4 import PUBLISHED, layout, model_dir  # noqa: E402

from openinfer import LLM, SamplingParams  # noqa: E402


def openinfer_site(stack) -> str:
    for f in reversed(stack):
        if f"{os.sep}openinfer{os.sep}" in f.filename and "benchmarks" not in f.filename:
            return f"{f.filename.split(os.sep + 'openinfer' + os.sep, 1)[1]}:{f.lineno}  {(f.line or '')[:90]}"
    return "(outside openinfer)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer-json", required=True)
    ap.add_argument("--weights", default="fp8", choices=("fp8", "bf16"))
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seqs", type=int, default=8)
    ap.add_argument("--len", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=3, help="measured steps (after one warm-up step)")
    args = ap.parse_args()
    over = {**layout(args.layers), **(PUBLISHED if args.weights == "fp8" else {})}
    llm = LLM(str(model_dir(args.tokenizer_json, **over)), device="cuda", dtype="bfloat16", load_format="dummy",
              max_num_seqs=max(args.seqs, 8), max_num_batched_tokens=args.seqs * args.len,
              enable_prefix_caching=False, max_model_len=4 * args.len, enforce_eager=True)
    eng, net = llm.engine, llm.engine.runner.model
    sites: collections.Counter = collections.Counter()
    state = {"armed": False, "forward_ms": []}

    def show(message, category, filename, lineno, file=None, line=None):
        if state["armed"]:
            sites[openinfer_site(traceback.extract_stack())] += 1

    def pre(m, a):
        torch.cuda.synchronize()
        state["t0"] = time.perf_counter()
        torch.cuda.set_sync_debug_mode("warn")

    def post(m, a, o):
        torch.cuda.set_sync_debug_mode("default")
        torch.cuda.synchronize()
        if state["armed"]:
            state["forward_ms"].append((time.perf_counter() - state["t0"]) * 1e3)

    net.register_forward_pre_hook(pre)
    net.register_forward_hook(post)
    g = torch.Generator().manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = show
        for step in range(1 + args.steps):
            state["armed"] = step > 0
            for _ in range(args.seqs):
                eng.add_request(torch.randint(100, 128000, (args.len,), generator=g).tolist(),
                                SamplingParams(max_tokens=1))
            while eng.has_unfinished_requests():
                eng.step()
    llm.shutdown()
    print(json.dumps({"weights": args.weights, "layers": args.layers, "seqs": args.seqs, "len": args.len,
                      "syncs_per_forward": sum(sites.values()) / args.steps,
                      "forward_ms": [round(t, 2) for t in state["forward_ms"]],
                      "sites_per_forward": {s: c / args.steps for s, c in sites.most_common()}}, indent=1))


if __name__ == "__main__":
    main()
