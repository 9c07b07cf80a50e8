"""Host census of one DeepSeek-V4 / V4.1 prefill step, on the CPU: the host syncs its forward would make on CUDA (by
call site) and the kernels it launches, at several numbers of sequences per step (a prefill step is host-bound
when its host work, and above all its syncs, do not let the host run ahead of the GPU; work that grows with the
sequences x layers is the suspect).

One prefill step of N prompts of `--len` tokens each (all in one step) of deepseek-v4-tiny / deepseek-v41-tiny runs
through the engine in bfloat16, the model with the CUDA ops and expert paths as `decode_op_census.py` sets them up
(TRITON_OPS in Triton's CPU interpreter, the grouped expert GEMMs); only the model's forward is counted (the runner's
and sampler's work is not). Counted:
- kernels: `decode_op_census.Census` (ATen ops that launch one, and Triton launches);
- syncs: ATen ops that wait for the GPU on CUDA (`_local_scalar_dense`: item / int / float / bool of a tensor;
  nonzero, unique, masked_select, boolean-mask indexing, repeat_interleave by a tensor), `Tensor.tolist` / `.cpu()`
  / `.numpy()`, and tensors built from host values (`torch.tensor(list)`: on CUDA a plain copy to the device
  drains the stream) unless the line passes them through `device_io.h2d` (pinned, non-blocking);
each charged to the innermost openinfer frame. `--expert-route dequant` sends the routed experts' grouped GEMMs
through `dequant_gemm.grouped_gemm_dequant` (the route V4-Flash's MXFP4 experts take at 8K-token steps on the H200)
where they are quantized (the tiny V4.1's MXFP4 experts; the tiny V4's are bf16).

    PYTHONPATH=. python benchmarks/prefill_host_census.py [--model v4|v41] [--seqs 1 2 4 8] [--len 64]
                                                          [--expert-route table|dequant] [--top 20] [--json]
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")      # before triton is imported (its jit reads it at decoration)

import argparse  # noqa: E402
import collections  # noqa: E402
import json  # noqa: E402
import linecache  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402
from unittest import mock  # noqa: E402

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent))
from decode_op_census import MODELS, Census, counting_triton, layer_ops  # noqa: E402

aten = torch.ops.aten
SYNC_OPS = {aten._local_scalar_dense, aten.nonzero, aten._unique2, aten.unique_dim, aten.unique_consecutive,
            aten.masked_select, aten.repeat_interleave}


def openinfer_site(depth: int = 2) -> str:
    """The innermost openinfer line on the stack (not this census), as 'file:line  code'."""
    import openinfer

    root = os.path.dirname(os.path.dirname(openinfer.__file__))
    f = sys._getframe(depth)
    while f is not None:
        name = f.f_code.co_filename
        if name.startswith(os.path.join(root, "openinfer")):
            return f"{os.path.relpath(name, root)}:{f.f_lineno}  {linecache.getline(name, f.f_lineno).strip()[:90]}"
        f = f.f_back
    return "(outside openinfer)"


class SyncCensus(Census):
    """Census's kernels, plus the host syncs (see the module docstring) per openinfer line while armed."""

    def __init__(self):
        super().__init__()
        self.syncs: collections.Counter = collections.Counter()

    def sync(self, kind: str) -> None:
        if self.armed and not self.in_triton:
            self.syncs[(openinfer_site(3), kind)] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in SYNC_OPS and not (func.overloadpacket is aten.repeat_interleave
                                                    and not isinstance(args[1] if len(args) > 1 else None,
                                                                       torch.Tensor)):
            self.sync(str(func.overloadpacket.__name__))
        elif func.overloadpacket is aten.index and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or ())):
            self.sync("index by a boolean mask")
        elif func is aten.lift_fresh.default:       # torch.tensor(host values)
            site = openinfer_site(3)
            if "h2d(" not in site:
                self.sync("torch.tensor(host values) (to the device: a sync unless pinned + non_blocking)")
        return super().__torch_dispatch__(func, types, args, kwargs)


def patched_host_reads(census: SyncCensus):
    stack = mock.patch.multiple(torch.Tensor, **{
        name: (lambda name: lambda self, *a, **k: (census.sync(f"Tensor.{name}"),
                                                   getattr(torch._C.TensorBase, name)(self, *a, **k))[1])(name)
        for name in ("tolist", "cpu", "numpy")})
    return stack


def census_of(model: str, seqs: int, length: int, expert_route: str) -> dict:
    from openinfer import LLM, SamplingParams
    from openinfer.engine import llm_engine
    from openinfer.models.deepseek_v4.model import Experts, QuantizedExperts
    from openinfer.quantization import kernel_choice

    import decode_op_census
    decode_op_census.MODEL_DIR[0] = decode_op_census._model_dir()
    ops = layer_ops("triton")
    make = llm_engine.make_kernels
    census = SyncCensus()
    patches = [mock.patch.object(Experts, "grouped", property(lambda self: self.gate_up_proj.dtype == torch.bfloat16)),
               mock.patch.object(QuantizedExperts, "grouped", property(lambda self: True))]
    if expert_route == "dequant":
        patches.append(mock.patch.object(kernel_choice, "EXPERT_KERNEL_BY_ROWS_PER_EXPERT", ((0, "bf16_dequant"),)))
    for p in patches:
        p.start()
    try:
        with mock.patch.object(llm_engine, "make_kernels", lambda config: (make(config)[0], ops)):
            llm = LLM(model, device="cpu", dtype="bfloat16", enable_prefix_caching=False,
                      max_num_batched_tokens=max(seqs * length, 256), max_num_seqs=max(seqs, 8))
        net = llm.engine.runner.model

        def arm(m, args, kwargs):
            meta = args[3] if len(args) > 3 else kwargs["meta"]
            census.armed = len(meta.prefills) == seqs and meta.num_decode_tokens == 0

        net.register_forward_pre_hook(arm, with_kwargs=True)
        net.register_forward_hook(lambda m, a, o: setattr(census, "armed", False))
        prompts = [[(i * 7919 + 31 * s) % 120000 + 100 for i in range(length)] for s in range(seqs)]
        with counting_triton(census), patched_host_reads(census), census:
            llm.generate(prompt_token_ids=prompts, use_tqdm=False,
                         sampling_params=SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
        llm.shutdown()
    finally:
        for p in reversed(patches):
            p.stop()
    kernels = sum(census.counts.values())
    sites = collections.Counter()
    for (_, site, _), c in census.counts.items():
        sites[site] += c
    return {"model": model, "seqs": seqs, "len": length, "expert_route": expert_route,
            "syncs_per_step": sum(census.syncs.values()), "kernels_per_step": kernels,
            "syncs": [{"site": s, "kind": k, "count": c} for (s, k), c in census.syncs.most_common()],
            "kernel_sites": [{"site": s, "kernels": c} for s, c in sites.most_common()]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=tuple(MODELS), default="v4")
    ap.add_argument("--seqs", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--len", type=int, default=64, help="tokens per prompt")
    ap.add_argument("--expert-route", choices=("table", "dequant"), default="table")
    ap.add_argument("--top", type=int, default=20, help="kernel lines shown (at the most sequences)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    results = [census_of(MODELS[args.model], n, args.len, args.expert_route) for n in args.seqs]
    if args.json:
        print(json.dumps(results, indent=1))
        return
    for r in results:
        print(f"{r['model']}  {r['seqs']} x {r['len']} tokens: {r['syncs_per_step']} syncs, "
              f"{r['kernels_per_step']} kernels per prefill step")
    last = results[-1]
    print(f"\nsyncs at {last['seqs']} sequences:")
    for s in last["syncs"]:
        print(f"{s['count']:>5}  {s['site']}  [{s['kind']}]")
    print(f"\nkernels at {last['seqs']} sequences, top model lines:")
    for s in last["kernel_sites"][:args.top]:
        print(f"{s['kernels']:>5}  {s['site']}")


if __name__ == "__main__":
    main()
