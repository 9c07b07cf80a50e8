"""Kernel census of one DeepSeek-V4 / V4.1 decode step, on the CPU: how many GPU kernels each decoder layer would
launch, and which model code line issues them (issue 34: the decode step is launch-bound at batch 1).

One decode step (batch 1, after a prefill that closed compressed entries) of deepseek-v4-tiny / deepseek-v41-tiny runs
through the engine in bfloat16 under a TorchDispatchMode that records every ATen op that would launch a kernel (views,
allocations and metadata ops launch none and are left out), and every Triton launch (Triton's CPU interpreter,
TRITON_INTERPRET=1, set here before triton is imported; the ATen ops the interpreter itself runs to move data are not
counted). Each is charged to the innermost frame in openinfer/models/ that issued it (the model code line) and to the
decoder layer it ran in (forward hooks on `model.layers`; the rest is "outside layers": embedding, head, ...).

What reflects the CUDA path and what does not:
- `--ops triton` (the default) gives the model TRITON_OPS, as `make_kernels` does on CUDA; `--ops next` gives it
  TRITON_OPS_NEXT (TRITON_OPS plus the kernels that have not passed their GPU tests yet); `--ops torch` the torch reference.
- the routed experts take their CUDA path (the grouped GEMM: `Experts.grouped` is forced on for bf16 weights,
  torch._grouped_mm runs on the CPU; `QuantizedExperts.grouped` for the tiny V4.1's MXFP4 experts, through the
  W4A8 Triton GEMM) instead of the CPU's loop over the experts hit;
- one ATen op counts as one kernel. A few ops launch more than one on CUDA (sort/topk, cumsum, some cuBLAS GEMMs,
  index_put_ with repeated indices), so the CUDA count is a little higher; the ranking of lines is what to read.
- the tiny configs' widths differ from Flash's but the op sequence per layer kind is the same; the tiny V4 has
  sliding, CSA and HCA layers, the tiny V4.1 its KV/index sources and followers.

The openinfer it counts is the one imported: PYTHONPATH=/work/main gives main's models (the "before" of a change).

    PYTHONPATH=. python benchmarks/decode_op_census.py [--model v4|v41|both] [--ops triton|next|torch] [--json]
                                                       [--top 25]
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")      # before triton is imported (its jit reads it at decoration)

import argparse  # noqa: E402
import collections  # noqa: E402
import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import linecache  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402
from unittest import mock  # noqa: E402

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

MODELS = {"v4": "deepseek-v4-tiny", "v41": "deepseek-v41-tiny"}
aten = torch.ops.aten
MODEL_DIR = [""]        # set at the first census (the openinfer imported: this worktree's or PYTHONPATH's)
# ops that allocate or only read metadata: no kernel
NO_KERNEL = {aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default, aten.new_empty.default,
             aten.new_empty_strided.default, aten.lift_fresh.default, aten.detach.default, aten.set_.source_Storage,
             aten.set_.source_Storage_storage_offset, aten.resize_.default, aten.is_same_size.default}


def _storages(x) -> set:
    xs = x if isinstance(x, (list, tuple)) else [x]
    return {t.untyped_storage().data_ptr() for t in xs if isinstance(t, torch.Tensor)}


def launches_kernel(func, args, out) -> bool:
    if func in NO_KERNEL:
        return False
    if not any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns):
        return True
    # an op that may return a view (view, reshape, to, contiguous, ...): a kernel only where it copied
    inputs = set().union(*(_storages(a) for a in args)) if args else set()
    return not _storages(out) <= inputs


def _model_dir() -> str:
    import openinfer.models

    return os.path.dirname(openinfer.models.__file__)


def model_site() -> str:
    """The innermost model code line on the stack, as 'file:line  code'."""
    f = sys._getframe(2)
    while f is not None:
        name = f.f_code.co_filename
        if name.startswith(MODEL_DIR[0]):
            rel = os.path.relpath(name, MODEL_DIR[0])
            return f"{rel}:{f.f_lineno}  {linecache.getline(name, f.f_lineno).strip()[:80]}"
        f = f.f_back
    return "(outside the model code)"


class Census(TorchDispatchMode):
    """Counts kernels per (layer, model line) while `armed`; `layer` is the decoder layer running (None: outside)."""

    def __init__(self):
        super().__init__()
        self.armed, self.layer, self.in_triton = False, None, 0
        self.counts: collections.Counter = collections.Counter()      # (layer, site, kind) -> kernels

    def record(self, kind: str) -> None:
        if self.armed and not self.in_triton:
            self.counts[(self.layer, model_site(), kind)] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.armed and launches_kernel(func, args, out):
            self.record(str(func.overloadpacket.__name__))
        return out


@contextlib.contextmanager
def counting_triton(census: Census):
    """Each interpreted Triton launch counts as one kernel (the ATen ops inside the interpreter: none)."""
    from triton.runtime.interpreter import InterpretedFunction

    run = InterpretedFunction.run

    def counted(self, *args, grid, warmup, **kwargs):
        if not warmup:
            census.record("triton:" + self.fn.__name__)
        census.in_triton += 1
        try:
            return run(self, *args, grid=grid, warmup=warmup, **kwargs)
        finally:
            census.in_triton -= 1

    with mock.patch.object(InterpretedFunction, "run", counted):
        yield


def layer_ops(which: str):
    from openinfer.layers.basic import TORCH_OPS

    if which == "torch":
        return TORCH_OPS
    from openinfer.layers import triton_ops

    return triton_ops.TRITON_OPS if which == "triton" else triton_ops.TRITON_OPS_NEXT


def census_of(model: str, ops_name: str, prompt_len: int = 37) -> dict:
    """One decode step (batch 1, context prompt_len + 1) of `model` with the chosen ops: kernels per layer and per
    model line."""
    from openinfer import LLM, SamplingParams
    from openinfer.engine import llm_engine
    from openinfer.models.deepseek_v4.model import Experts, QuantizedExperts

    MODEL_DIR[0] = _model_dir()
    ops = layer_ops(ops_name)
    make = llm_engine.make_kernels
    census = Census()
    def cuda_experts():     # the CUDA expert paths
        stack = contextlib.ExitStack()
        stack.enter_context(mock.patch.object(Experts, "grouped", property(
            lambda self: self.gate_up_proj.dtype == torch.bfloat16)))
        stack.enter_context(mock.patch.object(QuantizedExperts, "grouped", property(lambda self: True)))
        return stack

    with mock.patch.object(llm_engine, "make_kernels", lambda config: (make(config)[0], ops)), cuda_experts():
        llm = LLM(model, device="cpu", dtype="bfloat16", enable_prefix_caching=False)
    net = llm.engine.runner.model
    for i, layer in enumerate(net.layers):
        layer.register_forward_pre_hook(lambda m, a, i=i: setattr(census, "layer", i))
        layer.register_forward_hook(lambda m, a, o: setattr(census, "layer", None))
    steps = []

    def arm(m, args, kwargs):
        meta = args[3] if len(args) > 3 else kwargs["meta"]
        steps.append(not meta.prefills)
        # the second decode step (the first one's context-bucket and state set-up is done)
        census.armed = steps.count(True) == 2 and steps[-1]

    net.register_forward_pre_hook(arm, with_kwargs=True)
    net.register_forward_hook(lambda m, a, o: setattr(census, "armed", False))
    prompt = [(i * 7919) % 120000 + 100 for i in range(prompt_len)]
    with cuda_experts(), counting_triton(census), census:
        llm.generate(prompt_token_ids=[prompt], use_tqdm=False,
                     sampling_params=SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    llm.shutdown()
    n_layers = len(net.layers)
    per_layer = [sum(c for (lay, _, _), c in census.counts.items() if lay == i) for i in range(n_layers)]
    outside = sum(c for (lay, _, _), c in census.counts.items() if lay is None)
    sites: dict[str, dict] = {}
    for (lay, site, kind), c in census.counts.items():
        s = sites.setdefault(site, {"site": site, "kernels_in_layers": 0, "kernels_outside": 0, "ops": {}})
        s["kernels_in_layers" if lay is not None else "kernels_outside"] += c
        s["ops"][kind] = s["ops"].get(kind, 0) + c
    kinds = getattr(net.config, "layer_types", None)
    return {"model": model, "ops": ops_name, "layers": n_layers, "layer_kinds": kinds,
            "kernels_per_layer": per_layer, "mean_kernels_per_layer": sum(per_layer) / n_layers,
            "kernels_outside_layers": outside, "kernels_per_step": sum(per_layer) + outside,
            "sites": sorted(sites.values(), key=lambda s: -(s["kernels_in_layers"] + s["kernels_outside"]))}


def print_table(r: dict, top: int) -> None:
    print(f"\n{r['model']} ({r['ops']} ops): {r['kernels_per_step']} kernels per decode step; per layer "
          f"{r['kernels_per_layer']} (mean {r['mean_kernels_per_layer']:.1f}); outside layers "
          f"{r['kernels_outside_layers']}")
    print(f"{'in layers':>9} {'outside':>7}  model line  [ops]")
    for s in r["sites"][:top]:
        ops = ", ".join(f"{k} {v}" for k, v in sorted(s["ops"].items(), key=lambda kv: -kv[1]))
        print(f"{s['kernels_in_layers']:>9} {s['kernels_outside']:>7}  {s['site']}  [{ops}]")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=("v4", "v41", "both"), default="both")
    ap.add_argument("--ops", choices=("triton", "next", "torch"), default="triton")
    ap.add_argument("--top", type=int, default=25, help="model lines shown per table")
    ap.add_argument("--json", action="store_true", help="print the census as JSON instead of tables")
    args = ap.parse_args()
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    results = [census_of(MODELS[m], args.ops) for m in (("v4", "v41") if args.model == "both" else (args.model,))]
    if args.json:
        print(json.dumps(results, indent=1))
        return
    for r in results:
        print_table(r, args.top)


if __name__ == "__main__":
    main()
