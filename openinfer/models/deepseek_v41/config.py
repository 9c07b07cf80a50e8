"""DeepSeek-V4.1 configuration: the released `inference/config.json` keys (`dim`, `n_layers`, `kv_source_layers`,
...), read as DeepSeek's reference reads them, plus the layer roles derived from the source lists, checked at
load so an inconsistent schedule fails with the rule it breaks (docs/deepseek_v41.md).

Layer roles (spec 000 §2.2; the reference wires them through a module-level runtime, here they are data):
- every backbone layer attends over its sliding window; `compress_ratios[i] > 0` adds compressed entries;
- a `kv_source_layers` layer runs a compressor (one entry per `ratio` tokens); every compressed layer after it, up
  to the next source, reads the same entries (so a reader needs a source at or before it with its ratio);
- an `index_source_layers` layer runs the lightning indexer and publishes its top-k; the layers up to the next
  index source reuse it. Index keys come from a KV source's latent: an index source that is also a KV source
  owns them, any other reads the latest owner's (same ratio);
- from `candidate_source_layer` on, indexers score only inside the `candidate_topk_blocks` blocks (of
  `candidate_block_size` entries) that layer selected (two-level top-k).
Layers `n_layers ..` are DSpark draft stages (`n_mtp_layers`), window-only.

A config in HF release form (`model_type: deepseek_v41`) is read through the same fields: HF-style names
(`hidden_size`, `num_hidden_layers`, ...) map onto the inference names (`_HF_NAMES`); the inference names win
where both are given.
"""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields

_HF_NAMES = {
    "hidden_size": "dim", "num_hidden_layers": "n_layers", "moe_intermediate_size": "moe_inter_dim",
    "num_attention_heads": "n_heads", "num_experts_per_tok": "n_activated_experts",
    "rms_norm_eps": "norm_eps", "sliding_window": "window_size", "qk_rope_head_dim": "rope_head_dim",
    "routed_scaling_factor": "route_scale", "scoring_func": "score_func", "num_nextn_predict_layers": "n_mtp_layers",
}
# keys only DeepSeek's inference-form V4.1 config has (how such a config.json is recognised)
INFERENCE_FORM_KEYS = ("dim", "n_layers", "kv_source_layers")


@dataclass
class DeepseekV41Config:
    """Every model-shape key is required (a config that lacks one is refused, never filled with a guess); the
    optional features (candidates, Engram, DSpark, published formats) default to off."""
    # shape: embedding, attention, experts
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    head_dim: int
    rope_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    window_size: int
    n_routed_experts: int
    n_activated_experts: int
    moe_inter_dim: int
    route_scale: float
    swiglu_limit: float
    norm_eps: float
    # the CSA2 schedule and its lightning indexer
    compress_ratios: list[int]          # backbone + DSpark layers, as released
    kv_source_layers: list[int]
    index_source_layers: list[int]
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    # RoPE: window layers at rope_theta; compressed layers at compress_rope_theta with YaRN past original_seq_len
    rope_theta: float
    compress_rope_theta: float
    original_seq_len: int
    rope_factor: float
    beta_fast: int
    beta_slow: int
    # hyper-connections
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    # optional features
    n_shared_experts: int = 1
    score_func: str = "sqrtsoftplus"
    candidate_source_layer: int = -1     # two-level top-k off
    candidate_topk_blocks: int = 0
    candidate_block_size: int = 0
    engram_layer_ids: list[int] = field(default_factory=list)    # Engram off
    engram_num_embeddings: list[int] = field(default_factory=list)
    engram_vocab_size: int = 0
    engram_max_ngram_size: int = 0
    engram_n_heads: int = 0
    engram_head_dim: int = 0
    engram_pad_id: int = 0
    engram_compressed_vocab_size: int = 0
    n_mtp_layers: int = 0                # DSpark draft stages
    dspark_block_size: int = 0
    dspark_noise_token_id: int = 0
    dspark_target_layer_ids: list[int] = field(default_factory=list)
    dspark_markov_rank: int = 0
    dspark_n_routed_experts: int = 0
    dspark_n_activated_experts: int = 0
    dtype: str = "bf16"                  # "fp8": dense weights published FP8 (32x32 E8M0 blocks)
    expert_dtype: str | None = None      # "fp4": routed experts published MXFP4
    # the vision tower (ViT + Aligner, models/deepseek_v41/vision.py), as the released config.json states it;
    # 0 layers: text only, and then none of the rest is read. Its resize plan (min pixels, max tokens, aspect
    # ratio) belongs to deepseek-recipe's preprocessing, which reads it from there.
    vision_n_layers: int = 0
    vision_dim: int | None = None
    vision_n_heads: int | None = None
    vision_inter_dim: int | None = None          # the SwiGLU MLP's hidden width
    vision_patch_size: int | None = None         # pixels per patch side
    vision_rope_theta: float | None = None       # the 2D RoPE's base
    vision_downsample_ratio: int | None = None   # the Aligner merges r x r patches into one LLM row
    image_token_id: int | None = None            # every position of an image span carries it
    max_position_embeddings: int = 1 << 20
    model_type: str = "deepseek_v41"

    @classmethod
    def from_dict(cls, d: dict) -> "DeepseekV41Config":
        d = dict(d)
        for hf_name, name in _HF_NAMES.items():
            if hf_name in d and name not in d:
                d[name] = d[hf_name]
        known = {f.name for f in fields(cls)}
        missing = [f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING
                   and f.name not in d]
        if missing:
            raise ValueError(f"this DeepSeek-V4.1 config.json lacks {missing} (the released inference config has "
                             f"every one of them)")
        cfg = cls(**{k: v for k, v in d.items() if k in known})
        for name in ("compress_ratios", "kv_source_layers", "index_source_layers", "engram_layer_ids",
                     "engram_num_embeddings", "dspark_target_layer_ids"):
            setattr(cfg, name, [int(v) for v in getattr(cfg, name)])
        cfg.validate()
        return cfg

    # ---- derived roles ----------------------------------------------------------------------------------
    def ratio(self, layer: int) -> int:
        return self.compress_ratios[layer]

    def kv_source(self, layer: int) -> int | None:
        """The KV source whose compressed entries `layer` reads (None: a window-only layer)."""
        if self.ratio(layer) == 0:
            return None
        return max((s for s in self.kv_source_layers if s <= layer), default=None)

    def index_source(self, layer: int) -> int | None:
        """The index source whose top-k `layer` uses."""
        if self.ratio(layer) == 0:
            return None
        return max((s for s in self.index_source_layers if s <= layer), default=None)

    def owns_index_keys(self, layer: int) -> bool:
        return layer in self.kv_source_layers and layer in self.index_source_layers

    def index_key_source(self, layer: int) -> int | None:
        """The layer whose index keys the indexer of index source `layer` scores."""
        return max((s for s in self.kv_source_layers if s <= layer and self.owns_index_keys(s)), default=None)

    def uses_candidates(self, layer: int) -> bool:
        return 0 <= self.candidate_source_layer < layer

    @property
    def source_ratios(self) -> list[int]:
        """Distinct compress ratios of the KV sources, in order of first use (one paged cache kind each)."""
        return list(dict.fromkeys(self.ratio(s) for s in self.kv_source_layers))

    @property
    def yoco_split(self) -> int | None:
        """The first decoder layer of the CED split (spec 000 §2.2): the last KV source, when every compressed
        layer from it on reads its entries and index keys, so the decoder's global KV is a projection of the
        encoder's output. None: no such split (YOCO prefill impossible)."""
        if not self.kv_source_layers:
            return None
        d = max(self.kv_source_layers)
        for i in range(d, self.n_layers):
            if self.ratio(i) and self.kv_source(i) != d:
                return None
            if i in self.index_source_layers and self.index_key_source(i) != d:
                return None
        return d

    def moe_shape(self, layer: int) -> tuple[int, int]:
        """(routed experts, experts per token) of a backbone layer or a DSpark stage."""
        if layer < self.n_layers:
            return self.n_routed_experts, self.n_activated_experts
        return (self.dspark_n_routed_experts or self.n_routed_experts,
                self.dspark_n_activated_experts or self.n_activated_experts)

    def validate(self) -> None:
        """Raise ValueError naming the rule an inconsistent V4.1 schedule breaks."""
        n, total = self.n_layers, self.n_layers + self.n_mtp_layers
        if len(self.compress_ratios) < total:
            raise ValueError(f"compress_ratios lists {len(self.compress_ratios)} layers; n_layers + n_mtp_layers is "
                             f"{total}")
        if self.score_func != "sqrtsoftplus":
            raise ValueError(f"DeepSeek-V4.1 score_func {self.score_func!r} is not supported (sqrtsoftplus)")
        if self.n_shared_experts != 1:
            raise ValueError(f"DeepSeek-V4.1 has one shared expert; config says {self.n_shared_experts}")
        for name in ("kv_source_layers", "index_source_layers", "engram_layer_ids", "dspark_target_layer_ids"):
            bad = [i for i in getattr(self, name) if not 0 <= i < n]
            if bad:
                raise ValueError(f"{name} names layers {bad} outside the {n} backbone layers")
        for s in self.kv_source_layers + self.index_source_layers:
            if self.ratio(s) == 0:
                raise ValueError(f"layer {s} is listed as a KV/index source but its compress ratio is 0")
        for i in range(n):
            r = self.ratio(i)
            if r == 0:
                continue
            src = self.kv_source(i)
            if src is None:
                raise ValueError(f"layer {i} reads compressed KV (ratio {r}) but no kv_source_layers entry comes "
                                 f"at or before it (a reader layer before its source)")
            if self.ratio(src) != r:
                raise ValueError(f"layer {i} (ratio {r}) would read the compressed KV of source layer {src}, whose "
                                 f"ratio is {self.ratio(src)}")
            isrc = self.index_source(i)
            if isrc is None:
                raise ValueError(f"layer {i} attends over compressed KV but no index_source_layers entry comes at "
                                 f"or before it")
            if self.ratio(isrc) != r:
                raise ValueError(f"layer {i} (ratio {r}) would use the top-k of index source {isrc}, whose ratio is "
                                 f"{self.ratio(isrc)}")
        for s in self.index_source_layers:
            ks = self.index_key_source(s)
            if ks is None or self.ratio(ks) != self.ratio(s):
                raise ValueError(f"index source {s} has no index keys to score: no KV+index source with its ratio "
                                 f"({self.ratio(s)}) at or before it")
            if not self.owns_index_keys(s) and not self.uses_candidates(s):
                raise ValueError(f"index source {s} owns no keys and has no candidate source before it")
        c = self.candidate_source_layer
        if c >= 0:
            if c not in self.index_source_layers:
                raise ValueError(f"candidate_source_layer {c} must be an index source")
            if self.candidate_block_size < 1 or self.candidate_topk_blocks < 1:
                raise ValueError("candidate_block_size and candidate_topk_blocks must be positive with a "
                                 "candidate source")
            if self.candidate_topk_blocks * self.candidate_block_size < self.index_topk:
                raise ValueError(f"candidate blocks cannot hold index_topk: {self.candidate_topk_blocks} blocks x "
                                 f"{self.candidate_block_size} entries < index_topk {self.index_topk}")
        if self.engram_layer_ids:
            if len(self.engram_num_embeddings) != len(self.engram_layer_ids):
                raise ValueError(f"engram_num_embeddings lists {len(self.engram_num_embeddings)} tables for "
                                 f"{len(self.engram_layer_ids)} engram layers")
            if self.engram_max_ngram_size < 2 or self.engram_n_heads < 1 or self.engram_head_dim % 32:
                raise ValueError("engram needs engram_max_ngram_size >= 2, engram_n_heads >= 1 and engram_head_dim "
                                 "a multiple of 32 (one E8M0 scale per 32 values)")
            if self.engram_compressed_vocab_size < 1:
                raise ValueError("engram needs engram_compressed_vocab_size (the tokenizer's compressed vocabulary)")
        if self.dspark_block_size and self.n_mtp_layers and (self.dspark_markov_rank < 1
                                                             or not self.dspark_target_layer_ids):
            raise ValueError("DSpark stages need dspark_markov_rank >= 1 and dspark_target_layer_ids")
        if self.dim % self.o_groups or (self.n_heads * self.head_dim) % self.o_groups:
            raise ValueError(f"o_groups {self.o_groups} must divide the heads' width")
        if self.head_dim % 32 or self.index_head_dim % 32 or self.rope_head_dim % 2:
            raise ValueError("head_dim and index_head_dim must be multiples of 32 (the caches' FP4/FP8 groups)")
        if self.vision_n_layers:
            unset = [f.name for f in fields(self) if f.name.startswith(("vision_", "image_token_id"))
                     and getattr(self, f.name) is None]
            if unset:
                raise ValueError(f"a DeepSeek-V4.1 config with vision_n_layers > 0 must set {unset}")
            if self.vision_dim % self.vision_n_heads or (self.vision_dim // self.vision_n_heads) % 4:
                raise ValueError(f"vision_dim {self.vision_dim} must split into vision_n_heads {self.vision_n_heads} "
                                 f"heads whose width is a multiple of 4 (2D RoPE: a half per axis, rotated in pairs)")
            if self.vision_patch_size < 1 or self.vision_downsample_ratio < 1:
                raise ValueError("vision_patch_size and vision_downsample_ratio must be positive")
        if self.dtype not in ("fp8", "bf16"):
            raise ValueError(f"dtype {self.dtype!r}: V4.1 weights are published 'fp8' (or 'bf16')")
        if self.expert_dtype not in (None, "fp4", "fp8"):
            raise ValueError(f"expert_dtype {self.expert_dtype!r} is not supported (fp4, fp8, or unset)")
