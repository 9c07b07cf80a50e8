"""Vision-encoder throughput: DeepSeek-V4.1-Flash's ViT + Aligner (openinfer/models/deepseek_v41/vision.py) at the
released shape (1024 wide, 16 heads, MLP 2816, 14-pixel patches, 3x3 Aligner), random bf16 weights, one image of
the release's smallest planned size (544 x 544 pixels: 39 x 39 = 1521 patches) or as given, timed over repeats.

Reports patches/s for the whole tower (`--layers` blocks timed, scaled to the released 32 when fewer are built, since
every block costs the same) and the matmul floor: the tower's GEMM FLOPs (projections + attention) over the device's
measured bf16 GEMM rate on the same shapes. Writes benchmarks/results/<device>_vision_encoder.json.

    python benchmarks/vision_encoder.py --device cpu --layers 2 --threads 1
    python benchmarks/vision_encoder.py --device cuda --layers 32
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import time
from pathlib import Path

import torch

from openinfer.models.deepseek_v41.config import DeepseekV41Config
from openinfer.models.deepseek_v41.vision import ViT, Aligner



def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(fn, device, repeats: int) -> float:
    fn()
    _sync(device)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t)
    return best


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--side", type=int, default=544, help="image side in pixels (square)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--dtype", default="bfloat16", help="bfloat16 (the release's) | float32 (openinfer's CPU default)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    full_layers = 32
    cfg = DeepseekV41Config.__new__(DeepseekV41Config)
    for k, v in dict(dim=4096, vision_n_layers=args.layers, vision_dim=1024, vision_n_heads=16, vision_inter_dim=2816,
                     vision_patch_size=14, vision_rope_theta=10000.0, vision_downsample_ratio=3).items():
        setattr(cfg, k, v)
    torch.manual_seed(0)
    with torch.device(device):
        vit, aligner = ViT(cfg).to(dtype), Aligner(cfg).to(dtype)
    for p in list(vit.parameters()) + list(aligner.parameters()):
        p.data.normal_(0, 0.02)
        p.requires_grad_(False)
    side = args.side // 14
    n = side * side
    patches = (torch.rand(n, 3, 14, 14, device=device) * 2 - 1).to(dtype)

    def run():
        with torch.inference_mode():
            aligner(vit(patches, (side, side)), (side, side))

    t = timed(run, device, args.repeats)
    # per block: qkv, wo, w1 (2 x inter), w2 GEMMs, and attention's QK^T and PV over n patches
    D, I = cfg.vision_dim, cfg.vision_inter_dim
    gemm_flops = 2 * n * (D * 3 * D + D * D + D * 2 * I + I * D) + 4 * n * n * D
    aligner_flops = 2 * (n / 9) * (9 * D * cfg.dim + cfg.dim * cfg.dim)
    # the device's GEMM rate (in the run's dtype) on the block's largest shape
    a = torch.randn(n, D, device=device, dtype=dtype)
    w = torch.randn(D, 2 * I, device=device, dtype=dtype)
    tg = timed(lambda: a @ w, device, args.repeats)
    rate = 2 * n * D * 2 * I / tg
    per_block = (t - 0) / max(args.layers, 1)          # the Aligner and patch embedding are < 2% at 32 blocks
    t_full = per_block * full_layers
    floor_full = (gemm_flops * full_layers + aligner_flops) / rate
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    name = torch.cuda.get_device_name() if device.type == "cuda" else f"CPU ({torch.get_num_threads()} threads)"
    out = {"device": name, "dtype": args.dtype, "date": datetime.date.today().isoformat(), "commit": commit,
           "image_px": args.side, "patches": n, "layers_timed": args.layers,
           "seconds_timed": round(t, 4), "seconds_32_layers": round(t_full, 4),
           "patches_per_s_32_layers": round(n / t_full, 1),
           "gemm_tflops_measured": round(rate / 1e12, 4),
           "matmul_floor_s_32_layers": round(floor_full, 4),
           "fraction_of_floor": round(floor_full / t_full, 3)}
    print(json.dumps(out, indent=1))
    kind = "h200" if device.type == "cuda" else "cpu"
    res = Path(__file__).resolve().parent / "results" / f"{kind}_vision_encoder_{args.dtype}.json"
    res.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
