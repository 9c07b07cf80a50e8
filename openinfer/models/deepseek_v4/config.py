"""DeepSeek-V4's config (HF `DeepseekV4Config` keys and their legacy spellings) and the layer kinds it names."""

from __future__ import annotations

from dataclasses import dataclass

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
_RATIO_TO_TYPE = {0: SLIDING, 4: CSA, 128: HCA}


@dataclass
class DeepseekV4Config:
    vocab_size: int
    hidden_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    q_lora_rank: int
    rope_head_dim: int
    num_experts_per_tok: int
    n_routed_experts: int
    n_shared_experts: int
    routed_scaling_factor: float
    layer_types: list[str]
    mlp_layer_types: list[str]
    compress_rates: dict[str, int]
    main_rope: dict
    compress_rope: dict
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    swiglu_limit: float
    sliding_window: int
    o_groups: int
    o_lora_rank: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    num_nextn_predict_layers: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    model_type: str = "deepseek_v4"

    @classmethod
    def from_hf(cls, hf: dict) -> "DeepseekV4Config":
        """HF `DeepseekV4Config` semantics, including its legacy keys (compress_ratios, num_hash_layers,
        qk_rope_head_dim, flat rope_scaling)."""
        n = hf["num_hidden_layers"]
        if hf.get("scoring_func", "sqrtsoftplus") != "sqrtsoftplus":
            raise ValueError(f"DeepSeek-V4 scoring_func {hf['scoring_func']!r} is not supported (sqrtsoftplus)")
        rates = dict(hf.get("compress_rates") or {CSA: 4, HCA: 128})
        rates[CSA] = hf.get("compress_rate_csa", rates.get(CSA, 4))
        rates[HCA] = hf.get("compress_rate_hca", rates.get(HCA, 128))
        layer_types = hf.get("layer_types")
        if layer_types is None and hf.get("compress_ratios") is not None:
            layer_types = [_RATIO_TO_TYPE[r] for r in hf["compress_ratios"]]
        if layer_types is None:
            layer_types = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
        mlp_types = hf.get("mlp_layer_types")
        if mlp_types is None:
            n_hash = hf.get("num_hash_layers", 3)
            mlp_types = ["hash_moe"] * min(n, n_hash) + ["moe"] * max(0, n - n_hash)
        head_dim = hf.get("head_dim", 512)
        prf = hf.get("partial_rotary_factor")
        if prf is None:
            prf = hf["qk_rope_head_dim"] / head_dim if "qk_rope_head_dim" in hf else 64 / 512
        rp = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        if isinstance(rp.get("main"), dict) and isinstance(rp.get("compress"), dict):
            main, compress = dict(rp["main"]), dict(rp["compress"])
        else:
            main = {"rope_type": "default", "rope_theta": hf.get("rope_theta", 10000.0)}
            compress = {k: v for k, v in rp.items() if k not in ("main", "compress")}
            compress["rope_theta"] = hf.get("compress_rope_theta", 160000.0)
            compress.setdefault("rope_type", compress.pop("type", "default"))
            if compress["rope_type"] == "yarn":
                compress.setdefault("attention_factor", 1.0)   # the V4 reference does not scale cos/sin
        for name, types, allowed in (("layer_types", layer_types, (SLIDING, CSA, HCA)),
                                     ("mlp_layer_types", mlp_types, ("hash_moe", "moe"))):
            if len(types) < n or any(t not in allowed for t in types[:n]):
                raise ValueError(f"{name} must list {n} entries from {allowed}; got {types}")
        return cls(
            vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
            moe_intermediate_size=hf["moe_intermediate_size"], num_hidden_layers=n,
            num_attention_heads=hf["num_attention_heads"], head_dim=head_dim, q_lora_rank=hf["q_lora_rank"],
            rope_head_dim=int(head_dim * prf), num_experts_per_tok=hf["num_experts_per_tok"],
            n_routed_experts=hf["n_routed_experts"], n_shared_experts=hf.get("n_shared_experts", 1),
            routed_scaling_factor=hf.get("routed_scaling_factor", 1.5), layer_types=list(layer_types[:n]),
            mlp_layer_types=list(mlp_types[:n]), compress_rates=rates, main_rope=main, compress_rope=compress,
            hc_mult=hf.get("hc_mult", 4), hc_sinkhorn_iters=hf.get("hc_sinkhorn_iters", 20),
            hc_eps=hf.get("hc_eps", 1e-6), swiglu_limit=hf.get("swiglu_limit", 10.0),
            sliding_window=hf.get("sliding_window", 128), o_groups=hf["o_groups"], o_lora_rank=hf["o_lora_rank"],
            index_n_heads=hf["index_n_heads"], index_head_dim=hf["index_head_dim"], index_topk=hf["index_topk"],
            num_nextn_predict_layers=hf.get("num_nextn_predict_layers", 0), rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            max_position_embeddings=hf.get("max_position_embeddings", 1 << 20),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        )

    def layers_of(self, kind: str) -> list[int]:
        return [i for i, t in enumerate(self.layer_types) if t == kind]

    def check_tensor_parallel(self, tp_size: int, block: int | None = None, expert_fmt: str | None = None) -> None:
        """Raise ValueError naming the field if this model cannot be split over `tp_size` ranks (query heads,
        output groups, the experts' intermediate dimension and the vocabulary in equal slices). `block` /
        `expert_fmt`: a quantized checkpoint's FP8 block and routed-expert format ("fp8" | "mxfp4"); every
        shard boundary must then fall on a scale block (FP8: `block` rows/columns; MXFP4: 32 values along K)."""
        if tp_size == 1:
            return
        for name in ("num_attention_heads", "o_groups", "moe_intermediate_size", "vocab_size"):
            value = getattr(self, name)
            if value % tp_size:
                raise ValueError(f"tensor_parallel_size={tp_size} must divide {name} ({value}) of this DeepSeek-V4 "
                                 f"model (every rank holds an equal slice)")
        if block is None:
            return
        inter = self.moe_intermediate_size // tp_size
        fp8 = f"FP8 block ({block})"
        cuts = [("num_attention_heads * head_dim / tp (the rows of q_b_proj / wq_b per rank)",
                 self.num_attention_heads * self.head_dim // tp_size, block, fp8),
                ("o_groups * o_lora_rank / tp (the rows of o_a_proj / wo_a and columns of o_b_proj / wo_b per rank)",
                 self.o_groups * self.o_lora_rank // tp_size, block, fp8),
                ("moe_intermediate_size * n_shared_experts / tp (the shared expert's slice per rank)",
                 inter * self.n_shared_experts, block, fp8),
                ("moe_intermediate_size / tp (the routed experts' slice per rank)", inter,
                 *((32, "MXFP4 scale group (32)") if expert_fmt == "mxfp4" else (block, fp8)))]
        for what, size, unit, unit_name in cuts:
            if size % unit:
                raise ValueError(f"tensor_parallel_size={tp_size} cuts the quantized checkpoint's scale blocks: "
                                 f"{what} is {size}, not a multiple of the {unit_name}")
