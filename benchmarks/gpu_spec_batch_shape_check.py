"""Is dspark-2 at c=16 on deepseek-v41-tiny bf16 diverging from none by batch-shape numerics (near-ties) or a bug?
Runs none and dspark-2, each in CUDA graphs and eager, 16 edit prompts at once, 64 greedy tokens with logprobs."""
import gc, json, os, sys
import torch
from openinfer import LLM, SamplingParams
from openinfer.benchmarks.spec import task_prompts

prompts = task_prompts("edit", 16)
sp = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, logprobs=2)
runs = {}
for name, spec, eager in (("none/graph", None, False), ("none/eager", None, True),
                          ("dspark/graph", {"method": "dspark", "num_speculative_tokens": 2}, False),
                          ("dspark/eager", {"method": "dspark", "num_speculative_tokens": 2}, True),
                          ("fixed2/graph", {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1}, False)):
    llm = LLM("deepseek-v41-tiny", device="cuda", dtype="bfloat16", max_num_seqs=16, speculative_config=spec,
              enforce_eager=eager, kv_cache_memory_bytes=2 << 30)
    outs = [o.outputs[0] for o in llm.chat([[{"role": "user", "content": p}] for p in prompts], sp, use_tqdm=False)]
    runs[name] = outs
    print(name, "drafted", sum(o.num_draft_tokens for o in outs), "graph replays", getattr(llm.engine.runner, "graph_replays", None), flush=True)
    llm.shutdown(); del llm; gc.collect(); torch.cuda.empty_cache()

def cmp(a, b):
    res = []
    for x, y in zip(runs[a], runs[b]):
        i = next((i for i, (s, t) in enumerate(zip(x.token_ids, y.token_ids)) if s != t), None)
        if i is None:
            res.append(None); continue
        lp = y.logprobs[i]
        top = sorted((v.logprob for v in lp.values()), reverse=True)
        gap = top[0] - top[1] if len(top) > 1 else float("nan")
        lpx = x.logprobs[i]
        topx = sorted((v.logprob for v in lpx.values()), reverse=True)
        res.append((i, round(gap, 4), round(topx[0] - topx[1], 4) if len(topx) > 1 else None))
    print(a, "vs", b, "identical", sum(r is None for r in res), "of", len(res), "first diffs (pos, top-2 gap in b, in a):", [r for r in res if r], flush=True)

cmp("none/eager", "none/graph")
cmp("dspark/graph", "none/graph")
cmp("dspark/eager", "none/eager")
cmp("dspark/graph", "dspark/eager")
cmp("fixed2/graph", "none/graph")
