"""DeepSeek's sparse decode attention on one GPU: the fused Triton kernel (openinfer/layers/triton_sparse_decode.py)
against the torch path it replaces (openinfer/layers/sparse_attention.py: gathers, decodes and einsums), per layer
kind at DeepSeek-V4-Flash / V4.1-Flash width, in one run.

Shapes: 64 heads of 512, window 128 with the spec's 6 rollback rows, each row at position ctx - 1:
 - V4 (bf16 ring and cache, V4 softmax): window-only; CSA (ratio 4: the indexer's top min(512, ctx/4) picks) and
   HCA (ratio 128: every closed entry) at 1K and 8K context;
 - V4.1 (FP8 window rows of 528 B, FP4 compressed rows of 288 B, V4.1 softmax): window-only; top-512 picks (its
   ratio-2 and ratio-1 layers at 4K context read the same amount);
 at batch 1, 32 and 128.
Per shape: kernel and torch times (median of CUDA-event-timed replays of a CUDA graph holding one call per input
copy, enough copies that the bytes read exceed 3x the L2: b=128 is a DRAM number, b=1 a latency one), kernels
launched by one call (torch profiler), the bytes a call must move (q, the window and compressed rows it reads,
indices, masks, the output) and their floor at 4.2 TB/s (the H200's measured copy bandwidth) and at the copy
bandwidth measured in this run; max |kernel - torch| of one call, and whether the kernel wrote every element.
`--sweep` also times alternative tile configs and split counts (what `decode_launch`'s defaults should be chosen
from). FlashMLA (PyPI sgl-flash-mla) is only noted, not timed: its sparse FP8 decode reads its own 656-byte token
layout (FP8 latent, scales, bf16 RoPE part), not these caches.

    python benchmarks/gpu_sparse_decode_attention.py [--out PATH] [--sweep] [--batches 1,32,128]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import subprocess
import sys
import traceback
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from gpu_quant_kernels import ceilings, graph_time, try_time  # noqa: E402

from openinfer.layers.sparse_attention import V4_SOFTMAX, V41_SOFTMAX  # noqa: E402
from openinfer.layers.sparse_attention import sparse_decode_attention as torch_path  # noqa: E402
from openinfer.layers.triton_sparse_decode import decode_launch  # noqa: E402
from openinfer.layers.triton_sparse_decode import sparse_decode_attention as fused  # noqa: E402
from openinfer.quantization.kv_formats import Fp4BlockCodec, Fp8BlockCodec  # noqa: E402

H, D, W, ROLLBACK = 64, 512, 128, 6
DEVICE = "cuda"
FLOOR_BPS = 4.2e12                       # the H200's measured copy bandwidth (bytes read + written per second)
L2_BYTES = 60 << 20
MAX_COPIES = 256
# name: (softmax, quantized, context, compressed keys per row (0: window only))
SHAPES = {
    "v4_swa": (V4_SOFTMAX, False, 1024, 0),
    "v4_csa_1k": (V4_SOFTMAX, False, 1024, 256),
    "v4_csa_8k": (V4_SOFTMAX, False, 8192, 512),
    "v4_hca_1k": (V4_SOFTMAX, False, 1024, 8),
    "v4_hca_8k": (V4_SOFTMAX, False, 8192, 64),
    "v41_swa": (V41_SOFTMAX, True, 4096, 0),
    "v41_top512_4k": (V41_SOFTMAX, True, 4096, 512),
}
SWEEP = [(16, 32, 4, 2), (16, 64, 4, 2), (32, 32, 8, 2), (32, 32, 4, 2), (32, 64, 8, 2), (32, 16, 4, 3),
         (64, 32, 8, 2), (64, 16, 8, 2)]                          # (BLOCK_H, BLOCK_N, num_warps, num_stages)


def make_inputs(batch: int, softmax: str, quantized: bool, ctx: int, k: int) -> dict:
    """One call's arguments: fresh ring, cache and picks (rows scattered over a cache of batch * k rows)."""
    ring_codec, cache_codec = (Fp8BlockCodec(32), Fp4BlockCodec(16, "e4m3")) if quantized else (None, None)
    dev = DEVICE
    ring = torch.randn(batch, W + ROLLBACK, D, device=dev)
    ring = ring_codec.encode(ring) if quantized else ring.to(torch.bfloat16)
    args = dict(q=torch.randn(batch, H, D, device=dev, dtype=torch.bfloat16), sinks=torch.randn(H, device=dev),
                scale=D ** -0.5, softmax=softmax, ring=ring, slots=torch.randperm(batch, device=dev),
                positions=torch.full((batch,), ctx - 1, device=dev), window=W, ring_codec=ring_codec)
    if k:
        cache = torch.randn(batch * k, D, device=dev)
        cache = cache_codec.encode(cache) if quantized else cache.to(torch.bfloat16)
        args.update(cache=cache, rows=torch.randperm(batch * k, device=dev).view(batch, k),
                    valid=torch.ones(batch, k, dtype=torch.bool, device=dev), cache_codec=cache_codec)
    return args


def bytes_moved(batch: int, quantized: bool, k: int) -> int:
    """q and the output (bf16), the window rows and picked rows read, their indices (int64) and masks."""
    ring_row = Fp8BlockCodec(32).stored_dim(D) if quantized else 2 * D
    cache_row = Fp4BlockCodec(16, "e4m3").stored_dim(D) if quantized else 2 * D
    return batch * (2 * 2 * H * D + W * ring_row + k * (cache_row + 8 + 1))


def kernels_launched(fn) -> int:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def bench_shape(name: str, batch: int, copy_bps: float, sweep: bool) -> dict:
    softmax, quantized, ctx, k = SHAPES[name]
    nbytes = bytes_moved(batch, quantized, k)
    copies = [make_inputs(batch, softmax, quantized, ctx, k) for _ in range(
        max(1, min(MAX_COPIES, math.ceil(3 * L2_BYTES / nbytes))))]
    outs = [torch.empty_like(c["q"]) for c in copies]
    first = copies[0]
    poisoned = torch.full_like(first["q"], float("nan"))
    got = fused(**first, out=poisoned)
    ref = torch_path(**first)
    row = dict(shape=name, batch=batch, context=ctx, compressed_keys=k, window=W, quantized=quantized,
               softmax=softmax, copies=len(copies), launch=decode_launch(batch, H, D, W + k, first["q"].device),
               all_written=not got.isnan().any().item(),
               max_abs_diff=(got.float() - ref.float()).abs().max().item(),
               rel_diff=((got.float() - ref.float()).norm() / ref.float().norm()).item(),
               bytes=nbytes, floor_us=nbytes / FLOOR_BPS * 1e6, copy_floor_us=nbytes / copy_bps * 1e6,
               kernels_fused=kernels_launched(lambda: fused(**first)),
               kernels_torch=kernels_launched(lambda: torch_path(**first)))
    t = graph_time([lambda c=c, o=o: fused(**c, out=o) for c, o in zip(copies, outs)])
    row.update(us=t * 1e6, ratio_to_floor=t * 1e6 / row["floor_us"], GBps=nbytes / t / 1e9)
    t_torch = try_time([lambda c=c, o=o: torch_path(**c, out=o) for c, o in zip(copies, outs)])
    row["torch_us"] = t_torch * 1e6 if isinstance(t_torch, float) else t_torch
    if isinstance(t_torch, float):
        row["speedup_vs_torch"] = t_torch / t
    print(f"{name:14s} b={batch:3d}: fused {row['us']:8.1f} us ({row['ratio_to_floor']:5.1f}x floor "
          f"{row['floor_us']:6.1f} us, {row['kernels_fused']} kernels) | torch {fmt(row['torch_us'])} "
          f"({row['kernels_torch']} kernels) | max diff {row['max_abs_diff']:.3g}", flush=True)
    if sweep:
        row["sweep"] = {}
        for bh, bn, warps, stages in SWEEP:
            for splits in ((1, 2, 4, 8, 16) if batch < 128 else (1, 2)):
                cfg = dict(BLOCK_H=bh, BLOCK_N=bn, num_warps=warps, num_stages=stages, splits=splits)
                ts = try_time([lambda c=c, o=o: fused(**c, out=o, tuning=cfg) for c, o in zip(copies, outs)])
                row["sweep"][f"h{bh}_n{bn}_w{warps}_s{stages}_split{splits}"] = ts * 1e6 if isinstance(ts, float) else ts
        timed = [(v, c) for c, v in row["sweep"].items() if isinstance(v, float)]
        if timed:
            best = min(timed)
            print(f"    sweep best {best[1]}: {best[0]:.1f} us", flush=True)
    return row


def fmt(us) -> str:
    return f"{us:8.1f} us" if isinstance(us, float) else str(us)[:40]


def main():
    date = datetime.date.today().isoformat()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", help="write the results as JSON here (e.g. benchmarks/results/"
                                  f"gpu_sparse_decode_attention_{date}.json)")
    ap.add_argument("--sweep", action="store_true", help="also time alternative tile configs and splits")
    ap.add_argument("--batches", default="1,32,128")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="comma-separated subset of " + ", ".join(SHAPES))
    args = ap.parse_args()
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        rev = "unknown"
    result = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__, date=date,
                  git=rev, heads=H, head_dim=D, window=W, rollback_rows=ROLLBACK, floor_GBps=FLOOR_BPS / 1e9)
    result["copy_GBps"], result["read_GBps"] = ceilings()
    try:
        import flash_mla  # noqa: F401

        result["flash_mla"] = ("importable; not timed: its sparse FP8 decode reads its own 656-byte token layout, "
                               "not these caches")
    except ImportError:
        result["flash_mla"] = "not installed"
    print(f"{result['device']}  torch {result['torch']}  triton {result['triton']}  {rev}  copy "
          f"{result['copy_GBps']:.0f} GB/s  flash_mla: {result['flash_mla']}")
    result["rows"] = rows = []
    for name in args.shapes.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            try:
                rows.append(bench_shape(name, batch, result["copy_GBps"] * 1e9, args.sweep))
            except Exception:
                rows.append(dict(shape=name, batch=batch, error=traceback.format_exc()))
                print(rows[-1]["error"])
            if args.out:
                Path(args.out).parent.mkdir(parents=True, exist_ok=True)
                Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"\n{'shape':14s} {'b':>4s} {'fused us':>9s} {'floor us':>9s} {'x floor':>8s} {'torch us':>9s} "
          f"{'speedup':>8s} {'kernels':>8s}")
    for r in rows:
        if "error" not in r:
            print(f"{r['shape']:14s} {r['batch']:4d} {r['us']:9.1f} {r['floor_us']:9.1f} {r['ratio_to_floor']:8.1f} "
                  f"{fmt(r['torch_us']):>9s} {r.get('speedup_vs_torch', float('nan')):8.1f} "
                  f"{r['kernels_fused']:>3d}/{r['kernels_torch']:<4d}")
    if args.out:
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
