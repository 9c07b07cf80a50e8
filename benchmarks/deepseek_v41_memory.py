"""DeepSeek-V4.1-Flash cache and weight memory in openinfer's layout, from the model's own cache specs, against
the spec's figures (000 §2.4, §5.3, §5.8: 890 B/token of global KV, 20 layers x 134 tokens x 528 B = 1.35 MiB of
SWA state per sequence).

    python benchmarks/deepseek_v41_memory.py [--json PATH] [--config PATH] [--block-size 128]

Analytic, CPU only, a few seconds: the released config.json builds the model on the `meta` device, and every
number below comes from `cache_specs()` (paged kinds: bytes_per_block / block_size; per-request kinds:
bytes_per_slot), from the codecs' stored row widths, and from the meta model's parameters after quantizing the
published modules the way the loader does (`published_modules` + `model.quantize`).
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import math
import subprocess
import time
from pathlib import Path

import torch

from openinfer.kv_cache.spec import PagedCacheSpec, RequestStateSpec
from openinfer.layers.engram import EngramLayout
from openinfer.models.deepseek_v41.config import DeepseekV41Config
from openinfer.models.deepseek_v41.loader import published_modules, quant_scheme
from openinfer.models.deepseek_v41.model import DeepseekV41ForCausalLM
from openinfer.models.deepseek_v41.writer import published_state_dict

ROOT = Path(__file__).resolve().parents[1]
RELEASED_CONFIG = Path("/work/shared/reference/deepseek_v41/config.json")
DEFAULT_JSON = ROOT / "benchmarks" / "results" / "deepseek_v41_memory.json"
MiB, GiB = 1 << 20, 1 << 30

# the spec's claims (000 §5.3 / §5.8), quoted, never used to compute ours
SPEC = {
    "paged_bytes_per_token": 890,
    "swa_state": {"layers": 20, "tokens": 134, "bytes_per_token": 528, "window": 128, "spec_rollback_margin": 6,
                  "bytes": 1_415_040, "MiB": 1.35},
    "where": "000 §2.4 (890 B/token: FP4 main KV + FP4 indexer KV + cross-layer reuse), §5.3 / §5.8 (StateBlock: "
             "only the 20 encoder layers' SWA is persisted, in host memory, 134-token slots)",
}


def load_config(path: Path = RELEASED_CONFIG) -> tuple[dict, DeepseekV41Config]:
    hf = json.loads(Path(path).read_text())
    return hf, DeepseekV41Config.from_dict(hf)


def engram_layout(cfg: DeepseekV41Config) -> EngramLayout | None:
    """As `openinfer.models.deepseek_v41.loader.engram_hasher` builds it (the layout needs no tokenizer)."""
    if not cfg.engram_layer_ids:
        return None
    return EngramLayout.build(cfg.engram_layer_ids, cfg.engram_max_ngram_size, cfg.engram_n_heads,
                              cfg.engram_head_dim, cfg.engram_vocab_size, cfg.engram_num_embeddings)


def build_meta_model(cfg: DeepseekV41Config, layout, quantized_caches: bool = True,
                     dtype: torch.dtype = torch.bfloat16) -> DeepseekV41ForCausalLM:
    with torch.device("meta"):
        return DeepseekV41ForCausalLM(cfg, engram_layout=layout, quantized_caches=quantized_caches).cast(dtype)


def _cache_layers(cfg: DeepseekV41Config, name: str) -> list[int]:
    """The layers a cache kind holds one entry/slot for, in the model's index order (`_ckv_index`,
    `_cidx_index`)."""
    if name == "swa":
        return list(range(cfg.n_layers))
    if name == "ngram":
        return []
    kind, r = name.rstrip("0123456789"), int(name[len(name.rstrip("0123456789")):])
    sources = [s for s in cfg.kv_source_layers if cfg.ratio(s) == r]
    if kind in ("ckv", "crows"):
        return sources
    if kind == "cidx":
        return [s for s in sources if cfg.owns_index_keys(s)]
    raise ValueError(f"unknown cache kind {name!r}")


def cache_report(model: DeepseekV41ForCausalLM, block_size: int = 128, dtype: torch.dtype = torch.bfloat16) -> dict:
    cfg = model.config
    specs = model.cache_specs(dtype)
    paged, state = {}, {}
    per_source: dict[int, dict[str, float]] = {}
    for s in specs:
        layers = _cache_layers(cfg, s.name)
        if isinstance(s, PagedCacheSpec):
            bpb = s.bytes_per_block(block_size)
            entry = bpb // (s.num_layers * (block_size // s.tokens_per_entry))
            paged[s.name] = {"layers": layers, "tokens_per_entry": s.tokens_per_entry, "entry_shape": list(s.entry_shape),
                             "dtype": str(s.dtype).removeprefix("torch."), "entry_bytes": entry,
                             "bytes_per_block": bpb, "bytes_per_token": bpb / block_size}
            for layer in layers:
                kind = s.name.rstrip("0123456789")
                per_source.setdefault(layer, {"ratio": cfg.ratio(layer)})[kind] = bpb / block_size / s.num_layers
        else:
            state[s.name] = {"layers": layers, "num_layers": s.num_layers, "state_shape": list(s.state_shape),
                             "dtype": str(s.dtype).removeprefix("torch."), "bytes": s.bytes_per_slot(),
                             "needed_at_block_boundary": s.needed_at_block_boundary}
    for layer, d in per_source.items():
        d["total"] = sum(v for k, v in d.items() if k in ("ckv", "cidx"))
    by_kind = collections.defaultdict(float)
    for name, d in paged.items():
        by_kind[name.rstrip("0123456789")] += d["bytes_per_token"]
    paged_total = sum(d["bytes_per_token"] for d in paged.values())
    state_total = sum(d["bytes"] for d in state.values())
    snapshot = sum(d["bytes"] for d in state.values() if d["needed_at_block_boundary"])
    return {"block_size": block_size, "quantized_caches": model.quantized_caches,
            "codecs": {k: repr(v) for k, v in model.codecs.items()},
            "paged": paged, "paged_bytes_per_token_by_kind": dict(by_kind),
            "paged_bytes_per_token_by_source_layer": {str(k): per_source[k] for k in sorted(per_source)},
            "paged_bytes_per_token": paged_total,
            "paged_bytes_per_block": sum(d["bytes_per_block"] for d in paged.values()),
            "state": state, "state_bytes_per_request": state_total,
            "snapshot_bytes_per_kept_boundary": snapshot}


def spec_comparison(cfg: DeepseekV41Config, q: dict, u: dict) -> dict:
    """Every difference between ours and the spec's two figures, computed from our specs and codecs."""
    swa = q["state"]["swa"]
    window, row = swa["state_shape"]                 # 128 tokens x 528 B (FP8 512 + E8M0 per 32)
    ckv_row = next(d["entry_bytes"] for n, d in q["paged"].items() if n.startswith("ckv"))
    cidx_row = next(d["entry_bytes"] for n, d in q["paged"].items() if n.startswith("cidx"))
    by_kind = q["paged_bytes_per_token_by_kind"]
    n_comp = [i for i in range(cfg.n_layers) if cfg.ratio(i)]
    D, Di = cfg.head_dim, cfg.index_head_dim
    # candidate accountings of the spec's 890 B/token
    candidates = {
        "entries only (ckv: FP4 256 B + E4M3 scales 32 B = 288 B per entry, no index keys)": by_kind.get("ckv", 0),
        "entries + owners' index keys (cidx: FP4 64 B + E8M0 per 32 4 B = 68 B per key) = openinfer": (
            by_kind.get("ckv", 0) + by_kind.get("cidx", 0)),
        "entries + index keys, FP4 values without their scale bytes": sum(
            (D // 2 if n.startswith("ckv") else Di // 2) * len(d["layers"]) / d["tokens_per_entry"]
            for n, d in q["paged"].items()),
        "entries + index keys for every index source (owners and readers)": by_kind.get("ckv", 0) + sum(
            cidx_row / cfg.ratio(s) for s in cfg.index_source_layers),
        "no cross-layer reuse (every compressed layer its own entries, every index source its own keys)": sum(
            ckv_row / cfg.ratio(i) for i in n_comp) + sum(cidx_row / cfg.ratio(s) for s in cfg.index_source_layers),
    }
    spec_890 = SPEC["paged_bytes_per_token"]
    matches = [k for k, v in candidates.items() if abs(v - spec_890) < 1e-9]
    terms = [f"{len(d['layers'])} x {d['entry_bytes']} B / {d['tokens_per_entry']} ({n}, layers {d['layers']}) = "
             f"{d['bytes_per_token']:g}" for n, d in q["paged"].items()]
    enc = cfg.yoco_split if cfg.yoco_split is not None else cfg.n_layers
    spec_swa = SPEC["swa_state"]
    ours_swa = swa["bytes"]
    enc_128 = enc * window * row
    enc_134 = enc * (window + spec_swa["spec_rollback_margin"]) * row
    n_stages = cfg.n_mtp_layers if cfg.dspark_block_size else 0
    dspark_windows = n_stages * window * row
    state = q["state"]
    return {
        "paged_bytes_per_token": {
            "ours": q["paged_bytes_per_token"], "spec": spec_890,
            "difference": q["paged_bytes_per_token"] - spec_890,
            "ours_terms": terms,
            "candidate_accountings": candidates,
            "accountings_matching_spec": matches,
            "spec_counts_index_keys": (abs(by_kind.get("ckv", 0) - spec_890) > 1e-9
                                       and abs(by_kind.get("ckv", 0) + by_kind.get("cidx", 0) - spec_890) < 1e-9),
            "cross_layer_reuse_factor": candidates[list(candidates)[-1]] / q["paged_bytes_per_token"],
            "ours_unquantized_bf16": u["paged_bytes_per_token"],
            "compressed_layers": len(n_comp), "kv_sources": cfg.kv_source_layers,
            "index_sources": cfg.index_source_layers,
            "index_key_owners": [s for s in cfg.kv_source_layers if cfg.owns_index_keys(s)],
        },
        "swa_state_bytes": {
            "ours": ours_swa, "spec": spec_swa["bytes"], "ratio_ours_to_spec": ours_swa / spec_swa["bytes"],
            "row_bytes": {"ours": row, "spec": spec_swa["bytes_per_token"]},
            "layers": {"ours": swa["num_layers"], "spec": spec_swa["layers"], "encoder_layers_yoco_split": enc},
            "tokens": {"ours": window, "spec": spec_swa["tokens"]},
            "encoder_layers_x_our_128_ring": enc_128,
            "encoder_layers_x_134_slot": enc_134,
            "spec_reproduced_from_our_row": enc_134 == spec_swa["bytes"],
            "decoder_layers_rings": ours_swa - enc_128,
            "rollback_margin_missing": enc_134 - enc_128,
        },
        "state_bytes_per_request": {
            "ours_total": q["state_bytes_per_request"],
            "swa": ours_swa,
            "crows": sum(d["bytes"] for n, d in state.items() if n.startswith("crows")),
            "ngram": sum(d["bytes"] for n, d in state.items() if n == "ngram"),
            "dspark_stage_windows_not_allocated": dspark_windows,
            "spec_swa_only": spec_swa["bytes"],
            "ours_unquantized_bf16": u["state_bytes_per_request"],
        },
    }


def weights_report(hf: dict, cfg: DeepseekV41Config, layout) -> dict:
    """Parameters of the meta model by dtype after quantizing what DeepSeek publishes quantized (as the loader's
    dummy path does), in memory (what openinfer allocates) and as published (`published_state_dict`)."""
    model = build_meta_model(cfg, layout)
    logical = sum(p.numel() for n, p in model.named_parameters() if not n.endswith(".embed.scale"))
    scheme = quant_scheme(hf, cfg)
    fp8, experts = published_modules(model, scheme)
    if fp8 or experts:
        model.quantize(fp8, scheme.block, experts)

    def group(name: str) -> str:
        if ".engram.embed." in name:
            return "engram_tables"
        part = "dspark" if name.startswith("mtp.") else "backbone"
        if ".ffn.experts." in name:
            return f"{part}_routed_experts"
        return f"{part}_other"

    mem_dtype, mem_group = collections.Counter(), collections.Counter()
    for n, p in model.named_parameters():
        b = p.numel() * p.element_size()
        mem_dtype[str(p.dtype).removeprefix("torch.")] += b
        mem_group[group(n)] += b
    pub_dtype, pub_group = collections.Counter(), collections.Counter()
    for n, t in published_state_dict(model).items():
        b = t.numel() * t.element_size()
        pub_dtype[str(t.dtype).removeprefix("torch.")] += b
        pub_group[group(n)] += b
    rows = sum(cfg.engram_num_embeddings)
    table_bytes = rows * (cfg.engram_head_dim + cfg.engram_head_dim // 32)   # FP8 values + E8M0 per 32
    mem_total, pub_total = sum(mem_dtype.values()), sum(pub_dtype.values())
    return {
        "scheme": {"block": scheme.block, "expert_fmt": scheme.expert_fmt} if scheme else None,
        "fp8_linears": len(fp8), "quantized_expert_stacks": len(experts),
        "logical_parameters": logical,
        "in_memory_bytes_by_dtype": dict(mem_dtype), "in_memory_bytes_by_group": dict(mem_group),
        "in_memory_total_bytes": mem_total, "in_memory_total_GiB": mem_total / GiB,
        "published_bytes_by_dtype": dict(pub_dtype), "published_bytes_by_group": dict(pub_group),
        "published_total_bytes": pub_total, "published_total_GiB": pub_total / GiB,
        "published_without_engram_tables_GiB": (pub_total - pub_group["engram_tables"]) / GiB,
        "in_memory_without_engram_tables_GiB": (mem_total - mem_group["engram_tables"]) / GiB,
        "h200_needed_for_weights_without_tables": math.ceil((mem_total - mem_group["engram_tables"]) / (139 * GiB)),
        "engram_tables": {"rows": cfg.engram_num_embeddings, "head_dim": cfg.engram_head_dim,
                          "bytes_per_row": cfg.engram_head_dim + cfg.engram_head_dim // 32,
                          "bytes_from_config": table_bytes, "GiB": table_bytes / GiB,
                          "equals_meta_model_params": table_bytes == mem_group["engram_tables"]},
        "not_counted": [f"the {cfg.vision_n_layers}-layer vision tower (not loaded: text only)",
                        "DSpark stages' embed/head copies a checkpoint may store (the loader checks they equal "
                        "the backbone's and keeps one)"],
    }


def runner_state_bytes(state_per_request: int, snapshot_per_boundary: int, max_num_seqs: int = 256,
                       num_state_snapshots: int | None = None) -> dict:
    """CachePool.state_bytes with the engine's defaults: (max_num_seqs + 1) live slots, 2 x max_num_seqs
    prefix-cache snapshots of the kinds needed at block boundaries (swa, ngram)."""
    snaps = 2 * max_num_seqs if num_state_snapshots is None else num_state_snapshots
    total = (max_num_seqs + 1) * state_per_request + snaps * snapshot_per_boundary
    return {"max_num_seqs": max_num_seqs, "num_state_snapshots": snaps, "bytes": total, "GiB": total / GiB}


def _git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _openinfer_dirty() -> list[str]:
    """Files under openinfer/ that differ from HEAD (the numbers are the working tree's, not only the commit's)."""
    try:
        out = subprocess.run(["git", "diff", "--name-only", "HEAD", "--", "openinfer"], cwd=ROOT, capture_output=True,
                             text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return []
    return out.split()


def run(config_path: Path = RELEASED_CONFIG, block_size: int = 128) -> dict:
    t0 = time.perf_counter()
    hf, cfg = load_config(config_path)
    layout = engram_layout(cfg)
    q = cache_report(build_meta_model(cfg, layout, quantized_caches=True), block_size)
    u = cache_report(build_meta_model(cfg, layout, quantized_caches=False), block_size)
    weights = weights_report(hf, cfg, layout)
    result = {
        "benchmark": "deepseek_v41_memory", "model": "DeepSeek-V4.1-Flash (released config.json)",
        "config": str(config_path), "device": "cpu (analytic, from cache_specs)",
        "date": datetime.date.today().isoformat(), "commit": _git_commit(),
        "uncommitted_changes_under_openinfer": _openinfer_dirty(),
        "quantized": q, "unquantized_bf16": u,
        "quantized_vs_unquantized": {"paged": q["paged_bytes_per_token"] / u["paged_bytes_per_token"],
                                     "state": q["state_bytes_per_request"] / u["state_bytes_per_request"]},
        "spec": SPEC, "vs_spec": spec_comparison(cfg, q, u),
        "runner_state_default": runner_state_bytes(q["state_bytes_per_request"],
                                                   q["snapshot_bytes_per_kept_boundary"]),
        "context_kv": {f"{n:,} tokens": {"ours_MB": n * q["paged_bytes_per_token"] / 1e6,
                                         "spec_MB": n * SPEC["paged_bytes_per_token"] / 1e6}
                       for n in (77_000, 131_072, 1_000_000)},
        "weights": weights,
    }
    result["seconds"] = time.perf_counter() - t0
    return result


def summary(r: dict) -> str:
    q, u, v, w = r["quantized"], r["unquantized_bf16"], r["vs_spec"], r["weights"]
    p, s, st = v["paged_bytes_per_token"], v["swa_state_bytes"], v["state_bytes_per_request"]
    lines = [f"DeepSeek-V4.1-Flash memory, {r['device']}, commit {r['commit']}, {r['date']}", "",
             f"paged KV (block {q['block_size']}): {q['paged_bytes_per_token']:g} B/token ours vs {p['spec']} spec "
             f"(bf16 caches: {u['paged_bytes_per_token']:g}); per kind {q['paged_bytes_per_token_by_kind']}"]
    lines += [f"  {t}" for t in p["ours_terms"]]
    lines.append("  per source layer: " + ", ".join(f"L{k} r{d['ratio']}: {d['total']:g}"
                                                   for k, d in q["paged_bytes_per_token_by_source_layer"].items()))
    lines.append("  candidate accountings of the spec's 890:")
    lines += [f"    {'=' if k in p['accountings_matching_spec'] else ' '} {val:g}  {k}"
              for k, val in p["candidate_accountings"].items()]
    lines.append(f"  spec counts index keys: {p['spec_counts_index_keys']}; cross-layer reuse saves "
                 f"{p['cross_layer_reuse_factor']:.1f}x")
    lines += ["", f"per-request state: {st['ours_total']:,} B ({st['ours_total'] / MiB:.2f} MiB) = swa {st['swa']:,} + "
              f"crows {st['crows']:,} + ngram {st['ngram']:,}; bf16 caches {st['ours_unquantized_bf16']:,} B",
              f"  swa: ours {s['layers']['ours']} layers x {s['tokens']['ours']} x {s['row_bytes']['ours']} B = "
              f"{s['ours']:,} B ({s['ours'] / MiB:.2f} MiB) vs spec {s['layers']['spec']} x {s['tokens']['spec']} x "
              f"{s['row_bytes']['spec']} B = {s['spec']:,} B ({s['spec'] / MiB:.2f} MiB), {s['ratio_ours_to_spec']:.2f}x",
              f"  = encoder {s['layers']['encoder_layers_yoco_split']} layers x 128 ring {s['encoder_layers_x_our_128_ring']:,}"
              f" + decoder rings {s['decoder_layers_rings']:,}; the spec's 6-token rollback margin would add "
              f"{s['rollback_margin_missing']:,} (encoder x 134 = {s['encoder_layers_x_134_slot']:,}, reproduces the "
              f"spec: {s['spec_reproduced_from_our_row']})",
              f"  not allocated: DSpark stages' windows {st['dspark_stage_windows_not_allocated']:,} B",
              f"  runner default ({r['runner_state_default']['max_num_seqs']} seqs + "
              f"{r['runner_state_default']['num_state_snapshots']} snapshots): {r['runner_state_default']['GiB']:.2f} GiB",
              "", f"weights: published {w['published_total_GiB']:.2f} GiB (without Engram tables "
              f"{w['published_without_engram_tables_GiB']:.2f}), in memory {w['in_memory_total_GiB']:.2f} GiB "
              f"(without tables {w['in_memory_without_engram_tables_GiB']:.2f}: >= "
              f"{w['h200_needed_for_weights_without_tables']} H200s of ~139 GiB); "
              f"{w['logical_parameters'] / 1e9:.1f} B parameters",
              f"  Engram tables {w['engram_tables']['rows']} rows x {w['engram_tables']['bytes_per_row']} B = "
              f"{w['engram_tables']['GiB']:.2f} GiB",
              f"  published by group (GiB): " + ", ".join(f"{k} {b / GiB:.2f}" for k, b in
                                                         sorted(w["published_bytes_by_group"].items())),
              f"({r['seconds']:.1f} s)"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, default=DEFAULT_JSON, help="where to write the result (default: %(default)s)")
    ap.add_argument("--config", type=Path, default=RELEASED_CONFIG)
    ap.add_argument("--block-size", type=int, default=128)
    args = ap.parse_args(argv)
    result = run(args.config, args.block_size)
    print(summary(result))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
        print(f"wrote {args.json}")
    return result


if __name__ == "__main__":
    main()
