"""Where a DP2 + EP2 decode step's time goes, against one process on one GPU: V4-Flash width with LAYERS
layers (4 in the recorded run) in the published formats, random values; CUDA graphs and eager; prompts of 1,024 tokens, batch
1 and 8. Prints one JSON row per (layout, batch): front-end step time, each worker's host time in
engine.step() and in the step agreement (the gloo all-reduce: includes waiting for the other rank).

    python benchmarks/gpu_ep_overhead.py TOKENIZER_JSON [LAYERS]
"""
import json, sys, time, os
from pathlib import Path
sys.path.insert(0, "benchmarks")
import torch
from gpu_deepseek_v4 import PUBLISHED, model_dir
from gpu_deepseek_v4_ep import flash_layout
from openinfer import LLM, SamplingParams
from openinfer.sampling_params import RequestOutputKind

if __name__ == "__main__":
    tok, layers = sys.argv[1], int(sys.argv[2])
    path = model_dir(tok, **PUBLISHED, **flash_layout(layers), num_nextn_predict_layers=0)
    for extra in (dict(data_parallel_size=2, enable_expert_parallel=True), dict(data_parallel_size=2, enable_expert_parallel=True, enforce_eager=True), {}):
        llm = LLM(str(path), load_format="dummy", max_model_len=4096, max_num_seqs=8, gpu_memory_utilization=0.5, **extra)
        eng = llm.engine
        for c in (1, 8):
            for i in range(c):
                eng.add_request(list(range(100 + i, 1124 + i)), SamplingParams(temperature=0, max_tokens=200, ignore_eos=True, output_kind=RequestOutputKind.DELTA))
            for _ in range(40): eng.step()
            s0 = eng.stats()
            t = time.perf_counter(); n = 100
            for _ in range(n): eng.step()
            dt = (time.perf_counter() - t) / n * 1e3
            s1 = eng.stats()
            row = {"cfg": extra, "c": c, "ms_per_step": dt}
            if "per_rank" in s1:
                for r, (a, b) in enumerate(zip(s0["per_rank"], s1["per_rank"])):
                    row[f"rank{r}_worker_step_ms"] = (b["worker_step_s"] - a["worker_step_s"]) / n * 1e3
                    row[f"rank{r}_sync_ms"] = (b.get("step_sync_s", 0) - a.get("step_sync_s", 0)) / n * 1e3
            print(json.dumps(row), flush=True)
            for rid in list(eng.requests): eng.abort_request(rid)
            for _ in range(3): eng.step()
        llm.shutdown()
