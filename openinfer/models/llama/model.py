"""Llama-family decoder: Llama 2/3, SmolLM2, Mistral, Qwen2 (qkv bias), Qwen3 (q/k RMSNorm), from HF config.json.

Read top to bottom: config -> attention -> decoder layer -> model -> weight loading. Attention over the
paged cache is delegated to an AttentionBackend, norms/rotary/activation to LayerOps, both chosen once at
start-up; the model never branches on hardware. Layers pass the residual stream separately so a backend
can fuse the residual add into the next RMSNorm (math identical to `x = x + f(norm(x))`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch
from torch import nn

from openinfer.distributed.parallel_state import ParallelContext
from openinfer.kv_cache.bounded_replay import SlidingWindowLayout
from openinfer.kv_cache.spec import PagedCacheSpec
from openinfer.layers.attention import (AttentionBackend, AttentionMetadata, attend, layer_caches,
                                        split_kv_cache_specs)
from openinfer.layers.basic import TORCH_OPS, LayerOps, RMSNorm, RotaryEmbedding
from openinfer.layers.parallel_linear import (ColumnParallelLinear, ParallelGatedMLP, ParallelLMHead,
                                              RowParallelLinear, VocabParallelEmbedding, load_fused_hf_weights)
from openinfer.models.interface import ModelTraits

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass
class LlamaConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    qk_norm: bool
    sliding_window: int | None
    # per layer: whether it attends through `sliding_window` (HF `layer_types`; Mistral: every layer)
    window_layers: tuple[bool, ...] = ()

    @classmethod
    def from_hf(cls, hf: dict) -> "LlamaConfig":
        model_type = hf.get("model_type", "llama")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type {model_type!r} is not supported (supported: {SUPPORTED_MODEL_TYPES})")
        heads = hf["num_attention_heads"]
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        theta = hf.get("rope_theta", rope.get("rope_theta", 10000.0))
        attention_bias = bool(hf.get("attention_bias", False))
        sliding = hf.get("sliding_window") if hf.get("use_sliding_window", True) else None
        layers = hf["num_hidden_layers"]
        if sliding is None:
            windowed = (False,) * layers
        elif hf.get("layer_types"):          # transformers 5 spells out each layer (Qwen2's max_window_layers)
            windowed = tuple(t == "sliding_attention" for t in hf["layer_types"])
            if len(windowed) != layers:
                raise ValueError(f"layer_types has {len(windowed)} entries for num_hidden_layers={layers}")
        else:                                # Mistral: every layer attends through the window
            windowed = (True,) * layers
        if not any(windowed):
            sliding = None
        return cls(
            model_type=model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=rope if rope.get("rope_type", rope.get("type", "default")) != "default" else None,
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=attention_bias or model_type == "qwen2",
            o_bias=attention_bias and model_type != "qwen3",
            qk_norm=model_type == "qwen3",
            sliding_window=sliding,
            window_layers=windowed,
        )

    def check_tensor_parallel(self, tp_size: int) -> None:
        """Raise ValueError naming the field if this model cannot be split over `tp_size` ranks (every rank
        holds whole heads, an equal slice of the MLP and of the vocabulary)."""
        for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size"):
            value = getattr(self, name)
            if value % tp_size:
                raise ValueError(f"tensor_parallel_size={tp_size} must divide {name} ({value}) of this "
                                 f"{self.model_type} model")


class LlamaAttention(nn.Module):
    """This rank's heads: num_attention_heads / tp query heads and num_key_value_heads / tp KV heads (qkv_proj
    column-parallel per q/k/v, o_proj row-parallel: one all-reduce)."""

    def __init__(self, cfg: LlamaConfig, backend: AttentionBackend, ops: LayerOps, parallel: ParallelContext,
                 window: int | None = None):
        super().__init__()
        tp = parallel.tp_size
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads // tp, cfg.num_key_value_heads // tp
        self.head_dim = cfg.head_dim
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        full_q, full_kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        self.qkv_proj = ColumnParallelLinear(cfg.hidden_size, [full_q, full_kv, full_kv], cfg.qkv_bias, parallel,
                                             names=["num_attention_heads", "num_key_value_heads",
                                                    "num_key_value_heads"])
        self.o_proj = RowParallelLinear(full_q, cfg.hidden_size, cfg.o_bias, parallel, name="num_attention_heads")
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, ops)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, ops)
        self.qk_norm = cfg.qk_norm
        self.scale = self.head_dim ** -0.5
        self.window = window
        self.backend = backend

    def forward(self, x, positions, rotary: RotaryEmbedding, kv_cache, meta: AttentionMetadata, kv_scale=None):
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        o = attend(self.backend, q, k, v, positions, rotary, kv_cache, meta, self.scale, self.window, kv_scale)
        return self.o_proj(o.reshape(T, self.q_size))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig, backend: AttentionBackend, ops: LayerOps, parallel: ParallelContext,
                 window: int | None = None):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.self_attn = LlamaAttention(cfg, backend, ops, parallel, window)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.mlp = ParallelGatedMLP(cfg.hidden_size, cfg.intermediate_size, ops=ops, parallel=parallel)

    def forward(self, x, residual, positions, rotary, kv_cache, meta, kv_scale=None):
        """(x, residual) -> (mlp output, residual before it); the caller adds them (fused into the next norm)."""
        if residual is None:
            h, residual = self.input_layernorm(x), x
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, positions, rotary, kv_cache, meta, kv_scale)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: LlamaConfig, backend: AttentionBackend, ops: LayerOps = TORCH_OPS,
                 parallel: ParallelContext | None = None, fp8_kv_cache: bool = False):
        """`fp8_kv_cache`: K/V stored as FP8 E4M3 with a float32 scale per token, K/V and head
        (kv_cache_dtype="fp8"; docs/kv_cache_fp8.md); else in the model dtype."""
        super().__init__()
        self.config = cfg
        self.fp8_kv_cache = fp8_kv_cache
        self.parallel = parallel = parallel or ParallelContext.single()
        cfg.check_tensor_parallel(parallel.tp_size)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, parallel)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling,
                                      ops)
        if cfg.sliding_window is not None and not getattr(backend, "supports_window", False):
            raise NotImplementedError(
                f"this {cfg.model_type} model has sliding-window layers and the {type(backend).__name__} attention "
                f"backend does not support sliding windows; use attention_backend='torch' or 'triton'")
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(cfg, backend, ops, parallel, cfg.sliding_window if windowed else None)
            for windowed in (cfg.window_layers or (False,) * cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        # vocab-parallel; returns the full logits on every TP rank (see ParallelLMHead: no token broadcast)
        self.lm_head = ParallelLMHead(cfg.hidden_size, cfg.vocab_size, parallel)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # opt-in (a draft head over the target's features, spec_decode/draft_head.py): layer ids whose input —
        # the residual stream entering the layer, transformers' hidden_states[i] — `forward` keeps in `captured`
        self.capture_layers: tuple[int, ...] = ()
        self.captured: dict[int, torch.Tensor] = {}

    @property
    def traits(self) -> ModelTraits:
        """Windowed layers (kv_cache/bounded_replay.py; Mistral: all of them, so the prefix-KV store keeps no rows
        of this model and a hit's window comes from the pool, host memory or a replay); every layer's input can be
        kept for a draft head (spec_decode/draft_head.py)."""
        c = self.config
        layers = tuple(i for i, w in enumerate(c.window_layers) if w)
        return ModelTraits(sliding_window=SlidingWindowLayout(c.sliding_window, layers) if layers else None,
                           drafters=frozenset({"draft_head"}), feature_layers=len(self.layers),
                           fp8_kv_cache=True, batch_invariant=True)

    def cache_specs(self, dtype: torch.dtype, rollback_rows: int = 0) -> list[PagedCacheSpec]:
        """Full layers' KV in "kv", windowed layers' in "kv_window" (the window group: blocks past the window
        are released); this rank's KV heads only: with tensor parallelism each rank's pool is 1/tp of the whole.
        Paged KV needs no `rollback_rows`: a rejected draft's row is rewritten when its position is computed
        again."""
        c = self.config
        return split_kv_cache_specs(c.num_hidden_layers, sum(c.window_layers),
                                    c.num_key_value_heads // self.parallel.tp_size, c.head_dim, dtype,
                                    self.fp8_kv_cache, c.sliding_window)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, caches: dict[str, list[torch.Tensor]],
                meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states [T, hidden] for the flattened batch; logits come from compute_logits on chosen rows.
        `caches` holds one tensor per layer of each kind declared by cache_specs ("kv" / "kv_window", and
        "kv_scale" / "kv_window_scale" with an FP8 cache)."""
        x, residual = self.embed_tokens(input_ids), None
        if self.capture_layers:
            self.captured = {}
        per_layer = layer_caches(caches, (layer.self_attn.window is not None for layer in self.layers))
        for i, (layer, (kv_cache, kv_scale)) in enumerate(zip(self.layers, per_layer)):
            if i in self.capture_layers:
                self.captured[i] = x if residual is None else x + residual
            x, residual = layer(x, residual, positions, self.rotary, kv_cache, meta, kv_scale)
        return self.norm(x, residual)[0] if residual is not None else self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in, fusing q/k/v and gate/up; every parameter must be covered exactly once.
        With tensor parallelism each full checkpoint tensor is narrowed to this rank's shard (q, k, v, gate and
        up each separately, before being placed in the fused parameter); replicated tensors are copied whole."""
        tied = self.config.tie_word_embeddings

        def rename(name: str) -> str | None:
            name = name.removeprefix("model.")
            if "rotary_emb.inv_freq" in name or (name == "lm_head.weight" and tied):
                return None
            return name

        load_fused_hf_weights(self, weights, rename)
