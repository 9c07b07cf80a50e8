"""Why TP2 Llama's bf16 prompt logprobs differ from one process (tests/test_gpu_parallel.py's bound), on CPU with gloo.

Teacher-forced prompt logprobs of the GPU test's tiny Llama (weights x4, so activations are large): one process vs
TP2 in float32 and bfloat16, one process's own batch noise (the batch reversed, each prompt alone), and one
process of HF transformers in bf16 with its row-parallel linears (o_proj, down_proj) computed as TP2 computes them —
two half-K GEMMs, each rounded to bf16, then summed in bf16 (the all-reduce) — against the plain forward. If TP2's
bf16 gap matches the emulation and its fp32 gap is at float noise, the gap is rank-partial-sum rounding, not a bug.

    python benchmarks/cpu_tp2_bf16_gap.py [--out benchmarks/results/cpu_tp2_bf16_gap.json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.test_gpu_parallel import PROMPTS, _max_gap, _prompt_logprobs, _tiny_llama  # noqa: E402

from openinfer import LLM  # noqa: E402


def engine_gaps(path, prompts) -> dict:
    res = {}
    for dtype in ("float32", "bfloat16"):
        opts = dict(device="cpu", dtype=dtype, block_size=16)
        one = LLM(str(path), **opts)
        ref = _prompt_logprobs(one, prompts)
        noise = _max_gap(ref, _prompt_logprobs(one, prompts[::-1])[::-1])
        alone = _max_gap(ref, [_prompt_logprobs(one, [p])[0] for p in prompts])
        one.shutdown()
        two = LLM(str(path), tensor_parallel_size=2, **opts)
        got = _prompt_logprobs(two, prompts)
        two.shutdown()
        res[dtype] = {"tp2_vs_one_process": _max_gap(ref, got), "one_process_batch_reversed": noise,
                      "one_process_each_prompt_alone": alone}
        print(dtype, res[dtype], flush=True)
    return res


def emulated_gap(path, prompts) -> float:
    import transformers

    m = transformers.LlamaForCausalLM.from_pretrained(str(path), dtype=torch.bfloat16).eval()

    def logprobs():
        out = []
        with torch.no_grad():
            for p in prompts:
                ids = torch.tensor([p])
                lp = m(ids).logits.float().log_softmax(-1)[0, :-1]
                out.append(lp.gather(1, ids[0, 1:, None])[:, 0].tolist())
        return out

    def as_tp2(lin):
        w, b = lin.weight, lin.bias
        half = w.shape[1] // 2

        def forward(x):
            y = x[..., :half] @ w[:, :half].t() + x[..., half:] @ w[:, half:].t()    # two bf16 partials, bf16 sum
            return y if b is None else y + b
        return forward

    ref = logprobs()
    for layer in m.model.layers:
        layer.self_attn.o_proj.forward = as_tp2(layer.self_attn.o_proj)
        layer.mlp.down_proj.forward = as_tp2(layer.mlp.down_proj)
    return _max_gap(ref, logprobs())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/results/cpu_tp2_bf16_gap.json")
    args = ap.parse_args()
    prompts = [[t % 49000 for t in p] for p in PROMPTS]
    with tempfile.TemporaryDirectory() as d:
        path = _tiny_llama(Path(d) / "llama")
        result = {"benchmark": "cpu_tp2_bf16_gap", "device": platform.processor() or platform.machine(),
                  "date": datetime.date.today().isoformat(),
                  "commit": os.environ.get("OPENINFER_COMMIT") or subprocess.run(
                      ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip(),
                  "engine": engine_gaps(path, prompts),
                  "hf_bf16_one_process_vs_tp2_partial_sums_emulated": emulated_gap(path, prompts)}
    print(json.dumps(result, indent=1))
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
