"""OLMo-2 (HF `Olmo2ForCausalLM`, `model_type: olmo2`) over openinfer's paged KV cache.

A Llama-shaped decoder with two differences, read top to bottom: every sublayer's *output* is normalized before it
joins the residual stream (`x + norm(attn(x))`, `x + norm(mlp(x))`; no norm on the way in), and q and k are
RMS-normalized over all their heads at once, before RoPE. Attention over the paged cache goes through the
AttentionBackend chosen at start-up, as the Llama family's does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import torch
from torch import nn

from openinfer.distributed.parallel_state import ParallelContext
from openinfer.kv_cache.spec import PagedCacheSpec
from openinfer.layers.attention import AttentionBackend, AttentionMetadata, attend, split_kv_cache_specs
from openinfer.layers.basic import TORCH_OPS, LayerOps, RMSNorm, RotaryEmbedding
from openinfer.layers.parallel_linear import (ColumnParallelLinear, ParallelGatedMLP, ParallelLMHead,
                                              RowParallelLinear, VocabParallelEmbedding, load_fused_hf_weights)
from openinfer.models.interface import ModelTraits


@dataclass
class Olmo2Config:
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
    attention_bias: bool

    @classmethod
    def from_hf(cls, hf: dict) -> "Olmo2Config":
        heads = hf["num_attention_heads"]
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        return cls(vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
                   intermediate_size=hf["intermediate_size"], num_hidden_layers=hf["num_hidden_layers"],
                   num_attention_heads=heads, num_key_value_heads=hf.get("num_key_value_heads") or heads,
                   head_dim=hf.get("head_dim") or hf["hidden_size"] // heads, rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
                   rope_theta=float(hf.get("rope_theta", rope.get("rope_theta", 10000.0))),
                   rope_scaling=rope if rope.get("rope_type", rope.get("type", "default")) != "default" else None,
                   max_position_embeddings=hf.get("max_position_embeddings", 4096),
                   tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
                   attention_bias=bool(hf.get("attention_bias", False)))


class Olmo2Attention(nn.Module):
    def __init__(self, cfg: Olmo2Config, backend: AttentionBackend, ops: LayerOps, parallel: ParallelContext):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.qkv_proj = ColumnParallelLinear(cfg.hidden_size, [self.q_size, self.kv_size, self.kv_size],
                                             cfg.attention_bias, parallel)
        self.o_proj = RowParallelLinear(self.q_size, cfg.hidden_size, cfg.attention_bias, parallel)
        self.q_norm = RMSNorm(self.q_size, cfg.rms_norm_eps, ops)      # over every head at once
        self.k_norm = RMSNorm(self.kv_size, cfg.rms_norm_eps, ops)
        self.scale = self.head_dim ** -0.5
        self.backend = backend

    def forward(self, x, positions, rotary: RotaryEmbedding, kv_cache, meta: AttentionMetadata, kv_scale=None):
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q).view(T, self.num_heads, self.head_dim)
        k = self.k_norm(k).view(T, self.num_kv_heads, self.head_dim)
        v = v.reshape(T, self.num_kv_heads, self.head_dim)
        o = attend(self.backend, q, k, v, positions, rotary, kv_cache, meta, self.scale, None, kv_scale)
        return self.o_proj(o.reshape(T, self.q_size))


class Olmo2DecoderLayer(nn.Module):
    def __init__(self, cfg: Olmo2Config, backend: AttentionBackend, ops: LayerOps, parallel: ParallelContext):
        super().__init__()
        self.self_attn = Olmo2Attention(cfg, backend, ops, parallel)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.mlp = ParallelGatedMLP(cfg.hidden_size, cfg.intermediate_size, ops=ops, parallel=parallel)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)

    def forward(self, x, positions, rotary, kv_cache, meta):
        x = x + self.post_attention_layernorm(self.self_attn(x, positions, rotary, kv_cache, meta))
        return x + self.post_feedforward_layernorm(self.mlp(x))


class Olmo2ForCausalLM(nn.Module):
    def __init__(self, cfg: Olmo2Config, backend: AttentionBackend, ops: LayerOps = TORCH_OPS,
                 parallel: ParallelContext | None = None):
        super().__init__()
        self.config = cfg
        self.parallel = parallel = parallel or ParallelContext.single()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, parallel)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling,
                                      ops)
        self.layers = nn.ModuleList(Olmo2DecoderLayer(cfg, backend, ops, parallel)
                                    for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.lm_head = ParallelLMHead(cfg.hidden_size, cfg.vocab_size, parallel)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.capture_layers, self.captured = (), {}     # no feature taps

    @property
    def traits(self) -> ModelTraits:
        return ModelTraits()          # a plain decoder: graph-able decode, no window, no per-request state

    def cache_specs(self, dtype: torch.dtype, rollback_rows: int = 0) -> list[PagedCacheSpec]:
        c = self.config
        return split_kv_cache_specs(c.num_hidden_layers, 0, c.num_key_value_heads, c.head_dim, dtype, False, None)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, caches: dict[str, list[torch.Tensor]],
                meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        for layer, kv_cache in zip(self.layers, caches["kv"]):
            x = layer(x, positions, self.rotary, kv_cache, meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """HF-named tensors, q/k/v and gate/up fused as they load; every parameter covered exactly once."""
        tied = self.config.tie_word_embeddings

        def rename(name: str) -> str | None:
            name = name.removeprefix("model.")
            if "rotary_emb.inv_freq" in name or (name == "lm_head.weight" and tied):
                return None
            return name

        load_fused_hf_weights(self, weights, rename)
