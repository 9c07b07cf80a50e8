"""DeepSeek's sparse decode pieces on one GPU, fused kernel against the torch path it replaces, at V4-Flash /
V4.1-Flash width (64 index heads of 128, top-512, head_dim 512 with 64 RoPE dims, CSA ratio 4, HCA ratio 128), decode
batch 1/32/128 over several contexts, in one run:

 - `topk`: the indexer's top-k over scores [b, ctx/4] with ties: the stable sort it used to be (`sort`), the
   order-key top-k of the torch path (`torch`, layers/index_topk.py) and the Triton kernel (`fused`);
 - `v4_indexer`: V4's `Indexer.select_decode` (gather the index keys, per-head einsum, relu/weights/sum, mask, top-k):
   `sort` (the torch code with the stable sort, as before), `torch` (TORCH_OPS) and `fused` (TRITON_OPS: paged
   scores + top-k, two launches);
 - `v41_indexer`: V4.1's scores over FP4 index keys + pick: the torch path (gather, codec decode, einsum with the
   model dtype's roundings, top-k) against the fused scores (keys decoded in the kernel) + top-k;
 - `v4_hca_decode`, `v4_csa_decode`, `v4_csa_index_decode`: V4's compressor decode steps (state/ring update,
   pooling, RMSNorm, RoPE, cache write) through `close_decode` with TORCH_OPS and with TRITON_OPS;
 - `v41_close_groups_r2`, `v41_close_groups_r1`: V4.1's KV-source step for decode rows (`Attention._close_groups`:
   group ring, pooling, norm, RoPE, FP4 entry, the index keys' projection, k_norm, RoPE, FP4 keys), ratio 2 and 1,
   FP4 caches, torch against the two fused launches around the projection.

Times are medians of CUDA-event-timed CUDA-graph replays (benchmarks/gpu_quant_kernels.graph_time: what a captured
decode step pays, launch gaps included); kernels are the CUDA kernels one eager call launches (torch profiler).
Writes JSON (--out).

    python benchmarks/gpu_deepseek_decode_pieces.py [--out PATH] [--contexts 1024 4096 16384 65536]
"""

from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import traceback
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from gpu_quant_kernels import graph_time  # noqa: E402

from openinfer.layers.basic import TORCH_OPS  # noqa: E402
from openinfer.layers.index_topk import torch_index_topk  # noqa: E402
from openinfer.layers.triton_ops import TRITON_OPS  # noqa: E402
from openinfer.models.deepseek_v4.config import DeepseekV4Config  # noqa: E402
from openinfer.models.deepseek_v4.family import DEEPSEEK_V4_TINY_CONFIG  # noqa: E402
from openinfer.models.deepseek_v4.model import (Indexer, InterleavedRope, OverlappingCompressor,  # noqa: E402
                                                RunningCompressor, entry_index)
from openinfer.models.deepseek_v41.model import Indexer as V41Indexer  # noqa: E402
from openinfer.quantization.kv_formats import Fp4BlockCodec, fp4_block_qdq  # noqa: E402

HEADS, INDEX_DIM, TOPK, HEAD_DIM, ROPE_DIM, CSA_RATIO, HCA_RATIO, PAGE = 64, 128, 512, 512, 64, 4, 128, 128
BATCHES = (1, 32, 128)
DEV = "cuda"


def v4_config() -> DeepseekV4Config:
    return DeepseekV4Config.from_hf({**DEEPSEEK_V4_TINY_CONFIG, "index_n_heads": HEADS, "index_head_dim": INDEX_DIM,
                                     "index_topk": TOPK, "head_dim": HEAD_DIM,
                                     "partial_rotary_factor": ROPE_DIM / HEAD_DIM, "max_position_embeddings": 1 << 20})


def kernels_of(fn) -> int:
    """CUDA kernels one eager call of `fn` launches."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def measure(variants: dict) -> dict:
    """{variant: {"us": median µs per call from a CUDA graph, "kernels": launches per eager call}}."""
    out = {}
    for name, fn in variants.items():
        try:
            out[name] = {"us": round(graph_time([fn]) * 1e6, 2), "kernels": kernels_of(fn)}
        except Exception as e:                                  # a variant that does not run at this size
            out[name] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"}
    if "fused" in out and "us" in out["fused"]:
        for name, row in out.items():
            if name != "fused" and "us" in row:
                row["fused_speedup"] = round(row["us"] / out["fused"]["us"], 2)
    return out


def paged(g, b: int, entries: int, epb: int, row: int, dtype, fill=None):
    """A paged cache holding `entries` entries of each of b sequences on shuffled pages, and its block tables."""
    width = -(-entries // epb)
    pages = torch.randperm(b * width, device=DEV, generator=g).view(b, width)
    shape = (b * width + 1, epb, row)
    cache = fill(shape) if fill is not None else torch.randn(*shape, device=DEV, generator=g).to(dtype)
    return cache, pages


def sort_select(ix, q, w, keys, num_closed):
    """V4's select as it was: the stable descending sort of every row."""
    scores = ix.scores(q, w, keys, num_closed)
    picked = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :min(ix.topk, scores.shape[-1])]
    return picked, picked < num_closed[:, None]


def bench_topk(g, b: int, ctx: int) -> dict:
    n = ctx // CSA_RATIO
    s = (torch.randint(-20, 20, (b, n), device=DEV, generator=g).float() * 0.25)
    s[:, -n // 8:] = float("-inf")
    return measure({"sort": lambda: torch.sort(s, dim=-1, descending=True, stable=True).indices[:, :TOPK],
                    "torch": lambda: torch_index_topk(s, TOPK),
                    "fused": lambda: TRITON_OPS.index_topk(s, TOPK)})


def bench_v4_indexer(g, b: int, ctx: int) -> dict:
    cfg = v4_config()
    n, epb = ctx // CSA_RATIO, PAGE // CSA_RATIO
    cache, tables = paged(g, b, n, epb, INDEX_DIM, torch.bfloat16)
    q = torch.randn(b, HEADS, INDEX_DIM, device=DEV, generator=g).bfloat16()
    w = torch.randn(b, HEADS, device=DEV, generator=g)
    closed = torch.full((b,), n, device=DEV)
    flat = entry_index(tables, torch.arange(n, device=DEV).expand(b, -1), epb)
    ref, fused = Indexer(cfg, CSA_RATIO, TORCH_OPS).to(DEV), Indexer(cfg, CSA_RATIO, TRITON_OPS).to(DEV)
    return measure({"sort": lambda: sort_select(ref, q, w, cache.view(-1, INDEX_DIM)[flat], closed),
                    "torch": lambda: ref.select_decode(q, w, cache, tables, flat, closed),
                    "fused": lambda: fused.select_decode(q, w, cache, tables, flat, closed)})


def bench_v41_indexer(g, b: int, ctx: int) -> dict:
    codec = Fp4BlockCodec(32, "e8m0")
    n, epb = ctx // CSA_RATIO, PAGE // CSA_RATIO
    fill = (lambda shape: codec.encode(torch.randn(*shape[:2], INDEX_DIM, device=DEV, generator=g)))
    cache, tables = paged(g, b, n, epb, codec.stored_dim(INDEX_DIM), torch.uint8, fill)
    q = fp4_block_qdq(torch.randn(b, HEADS, INDEX_DIM, device=DEV, generator=g).bfloat16(), 32, "e8m0")
    w = (torch.randn(b, HEADS, device=DEV, generator=g) * (INDEX_DIM * HEADS) ** -0.5).bfloat16()
    closed = torch.full((b,), n, device=DEV)
    flat = entry_index(tables, torch.arange(n, device=DEV).expand(b, -1), epb)

    def torch_path():
        keys = codec.decode(cache.view(-1, cache.shape[-1])[flat], torch.bfloat16)
        return torch_index_topk(V41Indexer.scores(q, w, keys, closed), TOPK)

    def fused():
        scores = TRITON_OPS.index_scores(q, w, cache, tables, n, closed, 1.0, fp4=True, round_products=True)
        return TRITON_OPS.index_topk(scores, TOPK)

    return measure({"torch": torch_path, "fused": fused})


def _rope(cfg):
    rope = InterleavedRope(cfg.compress_rope, cfg.rope_head_dim, cfg.max_position_embeddings)
    rope.reset(torch.device(DEV))
    return rope


def bench_compressor(g, b: int, ctx: int, kind: str) -> dict:
    cfg = v4_config()
    ratio = HCA_RATIO if kind == "hca" else CSA_RATIO
    D = INDEX_DIM if kind == "csa_index" else HEAD_DIM
    cls = RunningCompressor if kind == "hca" else OverlappingCompressor
    ref = cls(cfg.hidden_size, D, ratio, cfg.rms_norm_eps, TORCH_OPS).to(DEV)
    fused = cls(cfg.hidden_size, D, ratio, cfg.rms_norm_eps, TRITON_OPS).to(DEV)
    rope = _rope(cfg)
    pos = ctx + torch.randint(0, ratio, (b,), device=DEV, generator=g)      # 1 in `ratio` rows closes a window
    slots = torch.randperm(b, device=DEV, generator=g)
    entries = ctx // ratio + 2
    cache, tables = paged(g, b, entries, PAGE // ratio, D, torch.bfloat16)
    if kind == "hca":
        state = torch.stack((torch.randn(b + 1, 1, D, device=DEV, generator=g),
                             torch.rand(b + 1, 1, D, device=DEV, generator=g) + 1,
                             torch.randn(b + 1, 1, D, device=DEV, generator=g)), dim=2)
        rows = torch.randn(b, 2 * D, device=DEV, generator=g)
    else:
        state = torch.randn(b + 1, 2 * ratio, 4 * D, device=DEV, generator=g)
        rows = torch.randn(b, 4 * D, device=DEV, generator=g)
    s1, s2, c1, c2 = state.clone(), state.clone(), cache.clone(), cache.clone()
    return measure({"torch": lambda: ref.close_decode(s1, c1, rows, pos, slots, tables, rope),
                    "fused": lambda: fused.close_decode(s2, c2, rows, pos, slots, tables, rope)})


def bench_v41_close_groups(g, b: int, ctx: int, layer: int) -> dict:
    from openinfer.layers.attention import AttentionMetadata
    from openinfer.models.deepseek_v41.config import DeepseekV41Config
    from openinfer.models.deepseek_v41.family import DEEPSEEK_V41_TINY_CONFIG
    from openinfer.models.deepseek_v41.model import Attention

    cfg = DeepseekV41Config.from_dict({**DEEPSEEK_V41_TINY_CONFIG, "head_dim": HEAD_DIM, "rope_head_dim": ROPE_DIM,
                                       "index_head_dim": INDEX_DIM, "index_n_heads": HEADS})
    ref = Attention(cfg, layer, TORCH_OPS).to(DEV, torch.bfloat16)
    fused = Attention(cfg, layer, TRITON_OPS).to(DEV, torch.bfloat16)
    for m in (ref, fused):
        m.compressor.norm.float()
        m.indexer.k_norm.float()
    r = cfg.ratio(layer)
    rope = InterleavedRope({"rope_type": "default", "rope_theta": 160000.0}, ROPE_DIM, 1 << 20)
    rope.reset(torch.device(DEV))
    codecs = {"ckv": Fp4BlockCodec(16, "e4m3"), "cidx": Fp4BlockCodec(32, "e8m0")}
    pos = ctx + torch.randint(0, r, (b,), device=DEV, generator=g)
    ckv, tables = paged(g, b, ctx // r + 2, PAGE // r, codecs["ckv"].stored_dim(HEAD_DIM), torch.uint8,
                        lambda shape: torch.zeros(shape, dtype=torch.uint8, device=DEV))
    cidx = torch.zeros(*ckv.shape[:2], codecs["cidx"].stored_dim(INDEX_DIM), dtype=torch.uint8, device=DEV)
    state = {"ckv": ckv, "cidx": cidx, "codecs": codecs}
    if r > 1:
        state["crows"] = torch.randn(b + 1, r, 2 * HEAD_DIM, device=DEV, generator=g)
        rows = torch.randn(b, 2 * HEAD_DIM, device=DEV, generator=g)
    else:
        rows = torch.randn(b, HEAD_DIM, device=DEV, generator=g).bfloat16()
    meta = AttentionMetadata(block_size=PAGE, slot_mapping=torch.zeros(b, dtype=torch.long, device=DEV),
                             num_decode_tokens=b, decode_block_tables=tables,
                             decode_state_slots=torch.randperm(b, device=DEV, generator=g))
    s1 = {k: v.clone() if torch.is_tensor(v) else v for k, v in state.items()}
    s2 = {k: v.clone() if torch.is_tensor(v) else v for k, v in state.items()}
    return measure({"torch": lambda: ref._close_groups(pos, rows, rope, s1, meta, None, torch.bfloat16),
                    "fused": lambda: fused._close_groups(pos, rows, rope, s2, meta, None, torch.bfloat16)})


PIECES = {"topk": bench_topk, "v4_indexer": bench_v4_indexer, "v41_indexer": bench_v41_indexer,
          "v4_hca_decode": lambda g, b, c: bench_compressor(g, b, c, "hca"),
          "v4_csa_decode": lambda g, b, c: bench_compressor(g, b, c, "csa"),
          "v4_csa_index_decode": lambda g, b, c: bench_compressor(g, b, c, "csa_index"),
          "v41_close_groups_r2": lambda g, b, c: bench_v41_close_groups(g, b, c, 1),
          "v41_close_groups_r1": lambda g, b, c: bench_v41_close_groups(g, b, c, 3)}


def main():
    date = datetime.date.today().isoformat()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=f"benchmarks/results/gpu_deepseek_decode_pieces_{date}.json")
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 4096, 16384, 65536])
    ap.add_argument("--only", choices=sorted(PIECES), nargs="+", help="run these pieces only")
    args = ap.parse_args()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    width = dict(index_heads=HEADS, index_head_dim=INDEX_DIM, index_topk=TOPK, head_dim=HEAD_DIM, rope_dim=ROPE_DIM,
                 csa_ratio=CSA_RATIO, hca_ratio=HCA_RATIO)
    result = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__, date=date,
                  commit=commit, width=width, rows=[])
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    g = torch.Generator(device=DEV).manual_seed(0)
    for piece, fn in PIECES.items():
        if args.only and piece not in args.only:
            continue
        for ctx in args.contexts:
            for b in BATCHES:
                row = {"piece": piece, "batch": b, "context": ctx}
                try:
                    row.update(fn(g, b, ctx))
                except Exception:
                    row["error"] = traceback.format_exc()
                result["rows"].append(row)
                print(json.dumps(row))
                torch.cuda.empty_cache()
                out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
