"""DeepSeek's sparse prefill attention on one GPU: the batched Triton kernel (openinfer/layers/triton_sparse_prefill.py,
every chunk of a step in one launch) against today's per-sequence torch path (openinfer/layers/sparse_attention.py:
`sparse_prefill_attention`'s reference, which runs each chunk as the models did: gathers, decodes, attend_v4 /
attend_v41's einsums and softmax), per layer kind at DeepSeek-V4-Flash / V4.1-Flash width, in one run.

Shapes: 64 heads of 512, window 128 with 6 rollback rows; fresh prompts (each chunk starts at position 0) of
 - 1 x 1K, 32 x 1K (a 32K-token step) and 1 x 8K tokens;
 - V4 (bf16 ring and cache, V4 softmax): window-only; CSA (ratio 4: top min(512, closed) picks per query, random
   entries of the chunk's) and HCA (ratio 128: every closed entry);
 - V4.1 (FP8 window rows of 528 B, FP4 compressed rows of 288 B, V4.1 softmax): window-only; top-512 picks over
   ratio-2 entries.
Per shape: kernel and torch times (median of CUDA-event-timed eager calls: the torch path syncs on the host per
chunk, so neither is graph-captured), kernels launched per call (torch profiler), attention TFLOP/s of the kernel
(2 * 2 * heads * head_dim per query-key pair read), max |kernel - torch|. `--sweep` also times other tile configs.

    python benchmarks/gpu_sparse_prefill_attention.py [--out PATH] [--sweep] [--workloads 1x1024,32x1024,1x8192]
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import sys
import traceback
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from openinfer.layers.sparse_attention import V4_SOFTMAX, V41_SOFTMAX  # noqa: E402
from openinfer.layers import flash_mla_prefill  # noqa: E402
from openinfer.layers.sparse_attention import sparse_prefill_attention as torch_path  # noqa: E402
from openinfer.layers.triton_sparse_prefill import prefill_launch  # noqa: E402
from openinfer.layers.triton_sparse_prefill import sparse_prefill_attention as fused  # noqa: E402
from openinfer.quantization.kv_formats import Fp4BlockCodec, Fp8BlockCodec  # noqa: E402

H, D, W, ROLLBACK = 64, 512, 128, 6
DEVICE = "cuda"
# name: (softmax, quantized, compression ratio (0: window only), top-k (None: every closed entry))
SHAPES = {
    "v4_swa": (V4_SOFTMAX, False, 0, None),
    "v4_csa": (V4_SOFTMAX, False, 4, 512),
    "v4_hca": (V4_SOFTMAX, False, 128, None),
    "v41_swa": (V41_SOFTMAX, True, 0, None),
    "v41_top512": (V41_SOFTMAX, True, 2, 512),
}


def make_inputs(chunks: int, length: int, softmax: str, quantized: bool, ratio: int, topk: int | None) -> dict:
    g = torch.Generator(device=DEVICE).manual_seed(0)
    dt = torch.bfloat16
    T = chunks * length
    ring_codec, cache_codec = (Fp8BlockCodec(32), Fp4BlockCodec(16, "e4m3")) if quantized else (None, None)
    ring_vals = torch.randn(chunks + 1, W + ROLLBACK, D, device=DEVICE, generator=g)
    ring = ring_codec.encode(ring_vals) if quantized else ring_vals.to(dt)
    kv = torch.randn(T, D, device=DEVICE, generator=g).to(dt)
    if quantized:
        kv = ring_codec.decode(ring_codec.encode(kv.float()), dt)
    positions = torch.arange(length, device=DEVICE).repeat(chunks)
    args = dict(q=torch.randn(T, H, D, device=DEVICE, generator=g).to(dt), sinks=torch.randn(H, device=DEVICE),
                scale=D ** -0.5, softmax=softmax, kv=kv, positions=positions,
                cu_seqlens=torch.arange(0, T + 1, length, device=DEVICE, dtype=torch.int32), ring=ring,
                slots=torch.arange(chunks, device=DEVICE, dtype=torch.int32), window=W, ring_codec=ring_codec)
    if ratio:
        n = max(length // ratio, 1)                       # entries per chunk; chunk c's at rows c*n .. c*n+n-1
        vals = torch.randn(chunks * n, D, device=DEVICE, generator=g)
        cache = cache_codec.encode(vals) if quantized else vals.to(dt)
        closed = (positions + 1) // ratio
        base = torch.arange(chunks, device=DEVICE).repeat_interleave(length)[:, None] * n
        if topk is None:                                  # HCA: every closed entry
            rows = base + torch.arange(n, device=DEVICE)
            valid = torch.arange(n, device=DEVICE)[None, :] < closed[:, None]
        else:                                             # the indexer's picks: random closed entries
            k = min(topk, n)
            rows = base + (torch.rand(T, k, device=DEVICE, generator=g) * closed.clamp(min=1)[:, None]).long()
            valid = torch.arange(k, device=DEVICE)[None, :] < closed[:, None]
        args.update(cache=cache, rows=rows, valid=valid, cache_codec=cache_codec)
    return args


def eager_time(fn, iters: int = 10) -> float:
    """Median seconds of `iters` CUDA-event-timed calls after two warm-ups."""
    fn()
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def kernels_launched(fn) -> int:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(e.count for e in prof.key_averages() if e.device_type.name == "CUDA")


def flash_mla_peer(args: dict, ref: torch.Tensor, out: torch.Tensor, softmax: str, pairs: int) -> dict:
    """The peer in the same run: FlashMLA's SM90 sparse prefill (openinfer/layers/flash_mla_prefill.py: two calls and a
    merge) where it applies (V4's softmax, bf16 keys), else why not."""
    why_not = flash_mla_prefill.applies(args["q"], softmax, args["ring"], args.get("ring_codec"), args.get("cache"),
                                        args.get("cache_codec"))
    if why_not is not None:
        return {"flash_mla": why_not}
    row = {}

    def run():
        return flash_mla_prefill.sparse_prefill_attention(**args, out=out)
    try:
        got = flash_mla_prefill.sparse_prefill_attention(**args, out=torch.full_like(out, float("nan")))
        row["flash_mla_max_abs_err"] = (got.float() - ref.float()).abs().max().item()
        row["flash_mla_all_written"] = not bool(got.isnan().any())
        row["flash_mla_us"] = eager_time(run) * 1e6
        row["flash_mla_launches"] = kernels_launched(run)
        row["flash_mla_TFLOPs"] = 4 * H * D * pairs / (row["flash_mla_us"] * 1e-6) / 1e12
    except Exception:
        row["flash_mla"] = "error: " + traceback.format_exc()[-1500:]
    return row


def bench(name: str, chunks: int, length: int, sweep: bool) -> dict:
    softmax, quantized, ratio, topk = SHAPES[name]
    args = make_inputs(chunks, length, softmax, quantized, ratio, topk)
    row = dict(shape=name, chunks=chunks, chunk_len=length, tokens=chunks * length,
               keys_per_query=W + (0 if not ratio else args["rows"].shape[1]))
    out = torch.full_like(args["q"], float("nan"))
    got = fused(**args, out=out)
    ref = torch_path(**args)
    row["max_abs_err"] = (got.float() - ref.float()).abs().max().item()
    row["all_written"] = not bool(got.isnan().any())
    row["kernel_us"] = eager_time(lambda: fused(**args, out=out)) * 1e6
    row["torch_us"] = eager_time(lambda: torch_path(**args), iters=3) * 1e6
    row["speedup"] = row["torch_us"] / row["kernel_us"]
    row["kernel_launches"] = kernels_launched(lambda: fused(**args, out=out))
    row["torch_launches"] = kernels_launched(lambda: torch_path(**args))
    pairs = row["tokens"] * row["keys_per_query"]
    row["kernel_TFLOPs"] = 4 * H * D * pairs / (row["kernel_us"] * 1e-6) / 1e12
    row.update(flash_mla_peer(args, ref, out, softmax, pairs))
    if sweep:
        row["sweep"] = {}
        for bh in (16, 32, 64):
            for bn in (16, 32, 64):
                for warps in (4, 8):
                    tune = {"BLOCK_H": bh, "BLOCK_N": bn, "num_warps": warps}
                    try:
                        t = eager_time(lambda: fused(**args, out=out, tuning=tune)) * 1e6
                    except Exception as e:                  # out of registers / shared memory on this config
                        t = f"{type(e).__name__}: {str(e).splitlines()[0][:100]}"
                    row["sweep"][f"h{bh}_n{bn}_w{warps}"] = t
    del args, out, got, ref
    torch.cuda.empty_cache()
    return row


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    date = datetime.date.today().isoformat()
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / f"gpu_sparse_prefill_attention_{date}.json"))
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--workloads", default="1x1024,32x1024,1x8192", help="CHUNKSxLENGTH,...")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    args = ap.parse_args()
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    except OSError:
        rev = "?"
    result = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__, date=date,
                  git=rev, heads=H, head_dim=D, window=W, rollback_rows=ROLLBACK, launch=prefill_launch(H, D),
                  rows=[])
    print(f"{'shape':12} {'step':>8} {'keys/q':>6} {'kernel us':>10} {'torch us':>10} {'speedup':>8} "
          f"{'launches k/t':>13} {'TFLOP/s':>8} {'max err':>8}")
    for w in args.workloads.split(","):
        chunks, length = (int(v) for v in w.split("x"))
        for name in args.shapes.split(","):
            try:
                row = bench(name, chunks, length, args.sweep)
            except Exception:                                # one shape failing does not lose the others
                row = dict(shape=name, chunks=chunks, chunk_len=length, error=traceback.format_exc()[-2000:])
                print(f"{name:12} {w:>8} ERROR {row['error'].splitlines()[-1]}")
                result["rows"].append(row)
                continue
            result["rows"].append(row)
            print(f"{name:12} {w:>8} {row['keys_per_query']:>6} {row['kernel_us']:>10.1f} {row['torch_us']:>10.1f} "
                  f"{row['speedup']:>7.1f}x {row['kernel_launches']:>6}/{row['torch_launches']:<6} "
                  f"{row['kernel_TFLOPs']:>8.1f} {row['max_abs_err']:>8.2g}"
                  + ("" if row["all_written"] else "  NOT ALL WRITTEN")
                  + (f"  flash_mla {row['flash_mla_us']:.1f} us {row['flash_mla_TFLOPs']:.0f} TFLOP/s "
                     f"err {row['flash_mla_max_abs_err']:.2g}" if "flash_mla_us" in row
                     else f"  flash_mla: {row.get('flash_mla')}"), flush=True)
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
