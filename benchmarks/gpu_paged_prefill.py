"""Paged prefill attention, one layer of the Llama-3-8B shape (32 heads, 8 KV heads, head_dim 128, pages of 128),
in one device call: the Triton varlen kernel (bf16 and FP8 cache) against the previous path (K/V gathered out
of the pages, one SDPA call per chunk: `TorchPagedAttention.prefill_into`) and against PyTorch's SDPA over K/V
already contiguous (the peer: flash for a cold causal chunk, memory-efficient with a mask over a cached prefix),
with TFLOP/s against the measured bf16 matmul peak. Writes $OUT/gpu_paged_prefill.json (or
benchmarks/results/) and prints a table.

    python benchmarks/gpu_paged_prefill.py
"""

from __future__ import annotations

import datetime
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_llama8b import timed  # noqa: E402
from paged_attention_cases import random_step  # noqa: E402

from openinfer.layers.attention import TorchPagedAttention  # noqa: E402
from openinfer.layers.triton_attention import TritonPagedAttention  # noqa: E402

H, KVH, D, PAGE = 32, 8, 128, 128
STEPS = {   # name -> prefill chunks (cached tokens, new tokens)
    "8K: 8064 cached + 64 new": [(8064, 64)],
    "8K: 7680 cached + 512 new": [(7680, 512)],
    "8K: 6144 cached + 2048 new": [(6144, 2048)],
    "8K cold": [(0, 8192)],
    "16K: 15488 cached + 512 new": [(15488, 512)],
    "8 chunks: 4096 cached + 256 new each": [(4096, 256)] * 8,
}


def matmul_peak() -> float:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    return 2 * 8192 ** 3 / timed(lambda: a @ a, 10) / 1e12


def attention_flops(chunks) -> float:
    """QK and PV over the keys each new token sees (causal): 4 * H * D per (query, visible key) pair."""
    pairs = sum(n * c + n * (n + 1) / 2 for c, n in chunks)
    return 4 * H * D * pairs


def peer_sdpa(q, keys, vals, chunks):
    """PyTorch SDPA per chunk over contiguous K/V [KVH, ctx, D] (expanded to H heads for the flash kernel)."""
    outs, row = [], 0
    group = H // KVH
    for (c, n), (k, v) in zip(chunks, zip(keys, vals)):
        qs = q[row:row + n].transpose(0, 1)[None]
        kk, vv = k.repeat_interleave(group, 0)[None], v.repeat_interleave(group, 0)[None]
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]):
            if c == 0:
                o = F.scaled_dot_product_attention(qs, kk, vv, is_causal=True)
            else:
                qp = torch.arange(c, c + n, device="cuda")[:, None]
                mask = torch.arange(c + n, device="cuda")[None, :] <= qp
                o = F.scaled_dot_product_attention(qs, kk, vv, attn_mask=mask)
        outs.append(o)
        row += n
    return outs


def main() -> None:
    res = {"benchmark": "gpu_paged_prefill", "gpu": torch.cuda.get_device_name(),
           "date": datetime.date.today().isoformat(), "torch": torch.__version__,
           "shape": {"heads": H, "kv_heads": KVH, "head_dim": D, "page": PAGE}}
    # the device's copy of the tree may carry a stale .git: the caller's OPENINFER_COMMIT wins
    res["commit"] = os.environ.get("OPENINFER_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip() or "unknown"
    peak = res["bf16_matmul_TFLOPs"] = matmul_peak()
    rows = res["steps"] = []
    triton_backend, torch_backend = TritonPagedAttention(), TorchPagedAttention()
    for name, chunks in STEPS.items():
        row = {"step": name, "chunks": chunks, "GFLOP": attention_flops(chunks) / 1e9}
        for fp8 in (False, True):
            q, k, v, cache, kv_scale, meta = random_step(random.Random(0), device="cuda", dtype=torch.bfloat16,
                                                         heads=H, kv_heads=KVH, head_dim=D, page=PAGE,
                                                         num_decodes=0, prefill=chunks, fp8=fp8)
            out = torch.empty_like(q)
            scale = D ** -0.5
            extra = {"kv_scale": kv_scale} if fp8 else {}
            t = timed(lambda: triton_backend.prefill_into(q, cache, meta, scale, out, **extra))
            row["triton_fp8_ms" if fp8 else "triton_ms"] = t * 1e3
            if fp8:
                continue
            row["previous_path_ms"] = timed(lambda: torch_backend.prefill_into(q, cache, meta, scale, out)) * 1e3
            keys, vals = [], []
            for p in meta.prefills:
                rows_ = cache.view(-1, 2, KVH, D)[p.context_slots]
                keys.append(rows_[:, 0].transpose(0, 1).contiguous())
                vals.append(rows_[:, 1].transpose(0, 1).contiguous())
            row["peer_sdpa_contiguous_ms"] = timed(lambda: peer_sdpa(q, keys, vals, chunks)) * 1e3
        row["triton_TFLOPs"] = row["GFLOP"] / row["triton_ms"]
        row["triton_vs_peak"] = row["triton_TFLOPs"] / peak
        row["triton_vs_previous"] = row["previous_path_ms"] / row["triton_ms"]
        row["triton_vs_peer"] = row["peer_sdpa_contiguous_ms"] / row["triton_ms"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    out_dir = Path(os.environ.get("OUT") or "benchmarks/results")
    (out_dir / "gpu_paged_prefill.json").write_text(json.dumps(res, indent=2) + "\n")
    print(f"\nbf16 matmul peak {peak:.0f} TFLOP/s\n")
    print("| step | Triton paged | FP8 cache | previous path (gather + SDPA) | peer: SDPA, contiguous K/V | "
          "Triton TFLOP/s (of peak) |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['step']} | {r['triton_ms']:.3f} ms | {r['triton_fp8_ms']:.3f} ms | "
              f"{r['previous_path_ms']:.3f} ms ({r['triton_vs_previous']:.1f}x) | "
              f"{r['peer_sdpa_contiguous_ms']:.3f} ms ({r['triton_vs_peer']:.2f}x) | "
              f"{r['triton_TFLOPs']:.0f} ({r['triton_vs_peak']:.0%}) |")


if __name__ == "__main__":
    main()
