"""KV / state bytes of DeepSeek-V4-Flash in openinfer's cache layout, from the model's own cache specs.

    python benchmarks/deepseek_v4_memory.py [--layer-types hf-default|flash-2sw] [--kv-cache-dtype fp8_ds_mla]

Prints paged bytes per token (what grows with context and is prefix-cached) and per-request state bytes
(sliding-window ring, compressor rows), against the theory for the same dtype and the seeds' V4.1 figure.
`--kv-cache-dtype fp8_ds_mla`: the window rings and compressed entries as FlashMLA's FP8 rows (584 B per entry; the
theory line stays the bf16 one).
"""

from __future__ import annotations

import argparse
import json

import torch

from openinfer.kv_cache.spec import PagedCacheSpec, RequestStateSpec
from openinfer.models.deepseek_v4.config import CSA, HCA, SLIDING, DeepseekV4Config
from openinfer.models.deepseek_v4.model import DeepseekV4ForCausalLM
from openinfer.quantization.kv_formats import Fp8DsMlaCodec

FLASH = dict(vocab_size=129280, hidden_size=4096, moe_intermediate_size=2048, num_hidden_layers=43,
             num_attention_heads=64, head_dim=512, q_lora_rank=1024, num_experts_per_tok=6, n_routed_experts=256,
             o_groups=8, o_lora_rank=1024, index_n_heads=64, index_head_dim=128, index_topk=512,
             sliding_window=128, num_nextn_predict_layers=1)


def report(layer_types: list[str], block_size: int = 128, dtype=torch.bfloat16, ds_mla: bool = False) -> dict:
    cfg = DeepseekV4Config.from_hf({**FLASH, "layer_types": layer_types})
    codec = Fp8DsMlaCodec.for_head(cfg.head_dim, cfg.rope_head_dim) if ds_mla else None
    with torch.device("meta"):
        model = DeepseekV4ForCausalLM(cfg, kv_codec=codec)
    specs = model.cache_specs(dtype)
    paged = {s.name: s.bytes_per_block(block_size) / block_size for s in specs if isinstance(s, PagedCacheSpec)}
    state = {s.name: s.bytes_per_slot() for s in specs if isinstance(s, RequestStateSpec)}
    snapshot = sum(s.bytes_per_slot() for s in specs if isinstance(s, RequestStateSpec) and s.needed_at_block_boundary)
    n_csa, n_hca = layer_types.count(CSA), layer_types.count(HCA)
    esize = torch.empty((), dtype=dtype).element_size()
    theory = n_csa * (cfg.head_dim + cfg.index_head_dim) * esize / 4 + n_hca * cfg.head_dim * esize / 128
    return {"layers": {"sliding": layer_types.count(SLIDING), "csa": n_csa, "hca": n_hca},
            "paged_bytes_per_token": paged, "paged_total": sum(paged.values()), "theory_bytes_per_token": theory,
            "state_bytes_per_request": state, "state_total": sum(state.values()),
            "snapshot_bytes_per_kept_boundary": snapshot}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layer-types", choices=["hf-default", "flash-2sw"], default="hf-default")
    ap.add_argument("--kv-cache-dtype", choices=["auto", "fp8_ds_mla"], default="auto")
    args = ap.parse_args()
    n = FLASH["num_hidden_layers"]
    if args.layer_types == "hf-default":     # transformers' default schedule: 2 HCA, then HCA/CSA alternating
        types = [HCA] * 2 + [CSA if i % 2 else HCA for i in range(n - 2)]
    else:                                    # two sliding-only layers first, then CSA/HCA alternating
        types = [SLIDING] * 2 + [CSA if i % 2 == 0 else HCA for i in range(n - 2)]
    print(json.dumps(report(types, ds_mla=args.kv_cache_dtype == "fp8_ds_mla"), indent=1))


if __name__ == "__main__":
    main()
