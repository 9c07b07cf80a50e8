"""The fused DeepSeek mHC and MoE-routing kernels (layers/triton_mhc.py, layers/triton_moe_routing.py) against the
unfused CUDA path they replace (the models' torch code with today's one Triton kernel, the Sinkhorn weights), on one
GPU at V4-Flash and V4.1-Flash widths, the same modules and inputs, in one run.

Pieces (each with its model's module, `module.ops` switched):
 - mhc_pre: V4 `HyperConnection` (mixes, Sinkhorn, collapse); V4.1 `Block.hc_pre` (mixes, Sinkhorn, the collapse by
   the lagged pre); V4's `HyperHead`;
 - mhc_post: V4 `merge` (bf16 term by term), V4.1 `Block.hc_post` (float32);
 - route: V4 `Router` learned and hashed (bf16 logits), V4.1 `Gate` (float32 logits), the logits GEMM included;
 - moe_glue: V4 `Experts._grouped` and V4.1 `MoE.routed` with the grouped GEMMs replaced by a read of a ready buffer:
   the expert sort, the row gather, the activation with V4.1's weighting, and the combine; and moe_bf16: V4's `_grouped`
   with its real bf16 grouped GEMMs at Flash width (what the glue is next to).
At b = 1, 32, 128 (decode rows) and 8192 (a prefill chunk), each reports:
 - gpu_us: median CUDA-event time per call over replays of a CUDA graph holding REPS calls (what a captured decode
   step pays: no host launch cost);
 - eager_us: host-timed per call, launches included;
 - kernels: GPU operations per call (torch.profiler's CUDA events: kernels, copies, fills).

    python benchmarks/gpu_deepseek_mhc_routing.py [--out PATH] [--batches 1,32,128,8192]
    python benchmarks/gpu_deepseek_mhc_routing.py --mix-tiles [--batches 32,128,1024,8192]

`--mix-tiles`: instead, V4-Flash's mHC pre (`triton_mhc.hc_pre`, the two-launch path) with the mixes' partial tiles
(tokens x K x warps) swept around the default, gpu_us per tiling and its largest relative difference from the
default's outputs (float32 summation order).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import subprocess
import sys
import time
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from openinfer.layers.triton_ops import TRITON_OPS  # noqa: E402
from openinfer.models.deepseek_v4.config import DeepseekV4Config  # noqa: E402
from openinfer.models.deepseek_v4.family import DEEPSEEK_V4_TINY_CONFIG  # noqa: E402
from openinfer.models.deepseek_v4.model import Experts, HyperConnection, HyperHead, Router  # noqa: E402
from openinfer.models.deepseek_v41.config import DeepseekV41Config  # noqa: E402
from openinfer.models.deepseek_v41.family import DEEPSEEK_V41_TINY_CONFIG  # noqa: E402
from openinfer.models.deepseek_v41.model import Block, Gate  # noqa: E402
from openinfer.models.deepseek_v41.model import MoE as MoE41  # noqa: E402
from gpu_quant_kernels import graph_time  # noqa: E402  (median per call over replays of one CUDA graph)

FUSED = TRITON_OPS
UNFUSED = dataclasses.replace(TRITON_OPS, hc_pre=None, hc_head=None, hc_post=None, route=None, expert_order=None,
                              moe_act=None, moe_combine=None)
V4 = dict(hidden_size=4096, hc_mult=4, n_routed_experts=256, num_experts_per_tok=6, moe_intermediate_size=2048,
          routed_scaling_factor=1.5)
V41 = dict(dim=5120, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, norm_eps=1e-20, n_routed_experts=384,
           n_activated_experts=6, route_scale=1.5, moe_inter_dim=2304)
REPS = 20


def eager_time(fn, reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps


def gpu_ops(fn) -> int:
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def randn(*shape, dtype=torch.bfloat16, scale=1.0):
    return (torch.randn(*shape, device="cuda") * scale).to(dtype)


class BufferExperts(Experts):
    """Experts whose grouped GEMMs read a ready buffer (`outs`, at the real widths): the glue around them, timed
    alone. Built with an intermediate width of 1: only the number of expert slots matters."""
    grouped = True

    def grouped_mm(self, rows, name, offs, host_offs=None):
        return self.outs[name][: rows.shape[0]]


def bf16_experts(cfg: DeepseekV4Config) -> Experts:
    """V4-Flash's routed experts as bf16 (6.4 GB), allocated once in bf16."""
    with torch.device("meta"):
        experts = Experts(cfg)
    for name in ("gate_up_proj", "down_proj"):
        p = getattr(experts, name)
        setattr(experts, name, torch.nn.Parameter(
            torch.empty(p.shape, dtype=torch.bfloat16, device="cuda").normal_(0, p.shape[-1] ** -0.5)))
    return experts


def pieces(T: int):
    """(piece, model, module whose .ops is switched, call) at T rows."""
    v4 = DeepseekV4Config.from_hf({**DEEPSEEK_V4_TINY_CONFIG, **V4})
    v41 = DeepseekV41Config.from_dict({**DEEPSEEK_V41_TINY_CONFIG, **V41})
    H, D, n = v4.hidden_size, v41.dim, 4
    with torch.device("cuda"):
        hc, head = HyperConnection(v4), HyperHead(v4)
        block = Block(dataclasses.replace(v41, n_routed_experts=8, moe_inter_dim=16), 0)    # (its mHC is what runs)
        routers = {h: Router(v4, h).to(torch.bfloat16) for h in (False, True)}
        gate = Gate(D, v41.n_routed_experts, v41.n_activated_experts, v41.route_scale, vision=True)
    for p, fan in ((hc.fn, n * H), (head.hc_fn, n * H), (block.hc_attn_fn, n * D)):
        p.data = randn(*p.shape, dtype=torch.float32, scale=fan ** -0.5)
    for r in routers.values():
        r.weight.data = randn(*r.weight.shape, scale=H ** -0.5)
    routers[False].e_score_correction_bias = randn(v4.n_routed_experts, dtype=torch.float32, scale=0.1)
    routers[True].tid2eid = torch.randint(0, v4.n_routed_experts, routers[True].tid2eid.shape, device="cuda")
    gate.weight.data = randn(*gate.weight.shape, scale=D ** -0.5)
    gate.bias.data = randn(v41.n_routed_experts, dtype=torch.float32, scale=0.1)
    s4, o4, s41, o41 = randn(T, n, H), randn(T, H), randn(T, n, D), randn(T, D)
    post4, comb4, _ = hc(s4)
    lagged = torch.rand(T, n, device="cuda") + 0.5
    _, post41, comb41, _ = block.hc_pre(s41, "attn", lagged)
    ids = torch.randint(0, v4.vocab_size, (T,), device="cuda")
    x4, x41 = randn(T, H), randn(T, D)
    yield "mhc_pre", "V4", hc, lambda: hc(s4)
    yield "mhc_pre", "V4 hc_head", head, lambda: head(s4)
    yield "mhc_pre", "V4.1", block, lambda: block.hc_pre(s41, "attn", lagged)
    yield "mhc_post", "V4", hc, lambda: hc.merge(s4, o4, post4, comb4)
    yield "mhc_post", "V4.1", block, lambda: block.hc_post(o41, s41, post41, comb41)
    yield "route", "V4 learned", routers[False], lambda: routers[False](x4, ids)
    yield "route", "V4 hashed", routers[True], lambda: routers[True](x4, ids)
    yield "route", "V4.1", gate, lambda: gate(x41, None)
    k = v4.num_experts_per_tok
    picks4, w4 = routers[False](x4, ids)
    picks41, w41 = gate(x41, None)
    with torch.device("cuda"):
        glue4 = BufferExperts(v4, inter=1)
        moe41 = MoE41(dataclasses.replace(v41, n_routed_experts=8, moe_inter_dim=16), 0)
        moe41.experts = BufferExperts(v4, num_slots=v41.n_routed_experts, inter=1)
    glue4.outs = {"gate_up_proj": randn(T * k, 2 * v4.moe_intermediate_size), "down_proj": randn(T * k, H)}
    moe41.experts.outs = {"gate_up_proj": randn(T * k, 2 * v41.moe_inter_dim), "down_proj": randn(T * k, D)}
    yield "moe_glue", "V4", glue4, lambda: glue4(x4, picks4, w4)
    yield "moe_glue", "V4.1", moe41, lambda: moe41.routed(x41, picks41, w41)
    experts = bf16_experts(v4)
    yield "moe_bf16", "V4", experts, lambda: experts(x4, picks4, w4)


def sweep_mix_tiles(batches: list[int], result: dict, out: Path) -> None:
    from openinfer.layers import triton_mhc
    v4 = DeepseekV4Config.from_hf({**DEEPSEEK_V4_TINY_CONFIG, **V4})
    n, H = v4.hc_mult, v4.hidden_size
    with torch.device("cuda"):
        hc = HyperConnection(v4)
    hc.fn.data = randn(*hc.fn.shape, dtype=torch.float32, scale=(n * H) ** -0.5)
    args = (hc.fn, hc.base, hc.scale, hc.iters, hc.eps, hc.norm_eps)
    for T in batches:
        if T <= triton_mhc.ONE_LAUNCH_MAX_T:
            continue
        streams = randn(T, n, H)
        default = (triton_mhc.BLOCK_T, triton_mhc.BLOCK_K, 4)
        want = triton_mhc.hc_pre(streams, *args)
        reps = REPS if T <= 256 else 3
        for bt in (16, 32, 64, 128):
            for bk in (64, 128, 256):
                for warps in (4, 8):
                    tiles = (bt, bk, warps)
                    row = dict(piece="mix_tiles", model="V4", T=T, tiles=tiles, default=tiles == default)
                    try:
                        got = triton_mhc.hc_pre(streams, *args, tiles=tiles)
                        row["max_rel_vs_default"] = max(((a.float() - b.float()).norm() / b.float().norm()).item()
                                                        for a, b in zip(got, want))
                        call = [lambda: triton_mhc.hc_pre(streams, *args, tiles=tiles)] * reps
                        row["gpu_us"] = graph_time(call) * 1e6
                    except Exception as e:       # a tiling that does not compile (shared memory, registers)
                        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
                    result["rows"].append(row)
                    shown = (f"{row['gpu_us']:9.1f} us  rel {row['max_rel_vs_default']:.1e}" if "gpu_us" in row
                             else row["error"])
                    print(f"mix tiles T={T:>5} {tiles}: {shown}" + ("  (default)" if row["default"] else ""),
                          flush=True)
                    out.write_text(json.dumps(result, indent=1))
        torch.cuda.empty_cache()


def main():
    date = datetime.date.today().isoformat()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=f"benchmarks/results/gpu_deepseek_mhc_routing_{date}.json")
    ap.add_argument("--batches", default="1,32,128,8192")
    ap.add_argument("--mix-tiles", action="store_true", help="sweep V4's mHC pre partial tiles instead")
    args = ap.parse_args()
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    result = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__, date=date,
                  git=rev, reps_per_graph=REPS, rows=[])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if args.mix_tiles:
        with torch.no_grad():
            sweep_mix_tiles([int(b) for b in args.batches.split(",")], result, out)
        print(f"wrote {out}")
        return
    print(f"{'piece':9} {'model':11} {'T':>5} | {'unfused us':>10} {'fused us':>9} {'x':>6} | {'eager':>7} {'eager':>7}"
          f" | {'ops':>4} {'ops':>4}")
    for T in (int(b) for b in args.batches.split(",")):
        with torch.no_grad():
            for piece, model, module, call in pieces(T):
                row = dict(piece=piece, model=model, T=T)
                reps = REPS if T <= 256 else 3
                for name, ops in (("unfused", UNFUSED), ("fused", FUSED)):
                    module.ops = ops
                    row[f"{name}_gpu_us"] = graph_time([call] * reps) * 1e6
                    row[f"{name}_eager_us"] = eager_time(call, reps) * 1e6
                    row[f"{name}_kernels"] = gpu_ops(call)
                row["speedup"] = row["unfused_gpu_us"] / row["fused_gpu_us"]
                result["rows"].append(row)
                print(f"{piece:9} {model:11} {T:>5} | {row['unfused_gpu_us']:10.1f} {row['fused_gpu_us']:9.1f} "
                      f"{row['speedup']:6.2f} | {row['unfused_eager_us']:7.1f} {row['fused_eager_us']:7.1f} | "
                      f"{row['unfused_kernels']:>4} {row['fused_kernels']:>4}", flush=True)
                out.write_text(json.dumps(result, indent=1))
        torch.cuda.empty_cache()
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
