"""Gemma-3 decoder (text only), from an HF config.json (`gemma3_text`, or `gemma3` multimodal: text tower only).

Read top to bottom like models/llama.py: config -> norm/MLP -> attention -> decoder layer -> model -> weights.
What differs from Llama, all as in HF transformers' `Gemma3ForCausalLM`:
- interleaved layers (`layer_types`, else `sliding_window_pattern`, default 5 sliding then 1 full): sliding
  layers attend to the last `sliding_window` positions (keys p-W < j <= p) and rotate with the local RoPE base
  (`rope_local_base_freq`, 10,000); full layers use `rope_theta` (and its scaling, if any);
- Gemma RMSNorm `norm(x) * (1 + w)` computed in float32; q/k norms; sandwich norms around attention and MLP
  (input, post_attention, pre_feedforward, post_feedforward), so no residual fusion into the next norm;
- embeddings scaled by sqrt(hidden_size) (the scale cast to the model dtype first, as HF does);
- GELU(tanh)-gated MLP, attention scale `query_pre_attn_scalar ** -0.5`, final logit softcapping when set.

Caches: the full layers' KV in the "kv" kind, the sliding layers' in "kv_window" (with kv_cache_dtype="fp8": FP8,
scales in "kv_scale" / "kv_window_scale"). "kv_window" declares the window, so it lives in the window group
(kv_cache/window_group.py): its own pool and block table per request, whose blocks before the window are released
as the request advances. A sliding layer's memory per request is bounded by the window (about W + one chunk of
tokens), whatever the length; only the full layers (1 in 6) grow with it. The sliding layers read the window
group's tables through `meta.for_layer(window)`. A backend without windows (`supports_window` False) is refused at
build time. With a prefix-KV store the sliding layers' rows are not stored; a hit gets them from the window group
(when it still holds the hit's last window), host memory or a replay (`swa_layout`, kv_cache/bounded_replay.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from openinfer.distributed.parallel_state import ParallelContext
from openinfer.kv_cache.bounded_replay import SlidingWindowLayout
from openinfer.kv_cache.spec import PagedCacheSpec
from openinfer.layers.attention import (AttentionBackend, AttentionMetadata, attend, layer_caches,
                                        split_kv_cache_specs)
from openinfer.layers.basic import TORCH_OPS, LayerOps, RotaryEmbedding
from openinfer.layers.parallel_linear import (ColumnParallelLinear, ParallelGatedMLP, ParallelLMHead,
                                              RowParallelLinear, VocabParallelEmbedding, load_fused_hf_weights)
from openinfer.models.interface import ModelTraits

SUPPORTED_MODEL_TYPES = ("gemma3_text", "gemma3")
SLIDING, FULL = "sliding_attention", "full_attention"

# Gemma3TextConfig defaults (multimodal configs' text_config often lists only what differs from them)
_TEXT_DEFAULTS = dict(vocab_size=262208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                      num_attention_heads=8, num_key_value_heads=4, head_dim=256,
                      hidden_activation="gelu_pytorch_tanh", max_position_embeddings=131072, rms_norm_eps=1e-6,
                      tie_word_embeddings=True, query_pre_attn_scalar=256, sliding_window=4096,
                      final_logit_softcapping=None, attn_logit_softcapping=None, attention_bias=False,
                      use_bidirectional_attention=False)


@dataclass
class Gemma3Config:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    query_pre_attn_scalar: float
    sliding_window: int
    layer_types: list[str]
    rope_theta: float               # full-attention layers
    rope_scaling: dict | None
    rope_local_theta: float         # sliding layers
    rope_local_scaling: dict | None
    final_logit_softcapping: float | None
    attention_bias: bool

    @classmethod
    def from_hf(cls, hf: dict) -> "Gemma3Config":
        model_type = hf.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model_type {model_type!r} is not a Gemma-3 model (supported: {SUPPORTED_MODEL_TYPES})")
        if model_type == "gemma3":   # multimodal checkpoint: the text tower only
            hf = {**_TEXT_DEFAULTS, **hf.get("text_config", {})}
        else:
            hf = {**_TEXT_DEFAULTS, **hf}
        if hf.get("attn_logit_softcapping") is not None:
            raise NotImplementedError("attention logit softcapping (Gemma-2 style) is not supported; Gemma-3 "
                                      "checkpoints set attn_logit_softcapping to None")
        if hf.get("use_bidirectional_attention"):
            raise NotImplementedError("bidirectional Gemma-3 attention (embedding models) is not supported")
        if hf.get("hidden_activation", "gelu_pytorch_tanh") not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ValueError(f"unsupported Gemma-3 hidden_activation {hf['hidden_activation']!r}")
        n = hf["num_hidden_layers"]
        layer_types = hf.get("layer_types")
        if layer_types is None:
            pattern = hf.get("sliding_window_pattern", 6)
            layer_types = [SLIDING if (i + 1) % pattern else FULL for i in range(n)]
        if len(layer_types) != n or set(layer_types) - {SLIDING, FULL}:
            raise ValueError(f"layer_types must list {n} of {SLIDING!r}/{FULL!r}, got {layer_types}")
        full, local = _rope_params(hf)
        return cls(
            model_type=model_type, vocab_size=hf["vocab_size"], hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"], num_hidden_layers=n,
            num_attention_heads=hf["num_attention_heads"],
            num_key_value_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
            head_dim=hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
            rms_norm_eps=hf["rms_norm_eps"], max_position_embeddings=hf["max_position_embeddings"],
            tie_word_embeddings=bool(hf["tie_word_embeddings"]),
            query_pre_attn_scalar=hf["query_pre_attn_scalar"], sliding_window=hf["sliding_window"],
            layer_types=list(layer_types),
            rope_theta=full[0], rope_scaling=full[1], rope_local_theta=local[0], rope_local_scaling=local[1],
            final_logit_softcapping=hf.get("final_logit_softcapping"), attention_bias=bool(hf["attention_bias"]))

    def check_tensor_parallel(self, tp_size: int) -> None:
        for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size", "vocab_size"):
            value = getattr(self, name)
            if value % tp_size:
                raise ValueError(f"tensor_parallel_size={tp_size} must divide {name} ({value}) of this "
                                 f"{self.model_type} model")


def _rope_params(hf: dict) -> tuple[tuple[float, dict | None], tuple[float, dict | None]]:
    """((theta, scaling) of full layers, (theta, scaling) of sliding layers) from either config format:
    `rope_parameters` keyed by layer type (newer transformers), or rope_theta / rope_scaling /
    rope_local_base_freq (checkpoints on the Hub)."""
    params = hf.get("rope_parameters") or {}
    if SLIDING in params or FULL in params:
        full, local = dict(params.get(FULL) or {}), dict(params.get(SLIDING) or {})
    else:
        full = dict(hf.get("rope_scaling") or params or {})
        local = {}
    full.setdefault("rope_theta", hf.get("rope_theta", 1_000_000.0))
    local.setdefault("rope_theta", hf.get("rope_local_base_freq", 10_000.0))

    def split(p: dict) -> tuple[float, dict | None]:
        kind = p.get("rope_type", p.get("type", "default"))
        return float(p["rope_theta"]), (p if kind != "default" else None)

    return split(full), split(local)


class GemmaRMSNorm(nn.Module):
    """HF Gemma3RMSNorm: (norm(x.float()) * (1 + w.float())).to(x.dtype). The weight is stored as in HF
    (zero-centred; llama.cpp's +1 is undone when a GGUF is converted)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)


class GeluGatedMLP(ParallelGatedMLP):
    """down(gelu_tanh(gate(x)) * up(x)); same parameters and sharding as the SiLU one."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Gemma3Attention(nn.Module):
    def __init__(self, cfg: Gemma3Config, layer_type: str, backend: AttentionBackend, parallel: ParallelContext):
        super().__init__()
        tp = parallel.tp_size
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads // tp, cfg.num_key_value_heads // tp
        self.head_dim = cfg.head_dim
        self.q_size, self.kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        full_q, full_kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        self.qkv_proj = ColumnParallelLinear(cfg.hidden_size, [full_q, full_kv, full_kv], cfg.attention_bias,
                                             parallel, names=["num_attention_heads", "num_key_value_heads",
                                                              "num_key_value_heads"])
        self.o_proj = RowParallelLinear(full_q, cfg.hidden_size, cfg.attention_bias, parallel,
                                        name="num_attention_heads")
        self.q_norm = GemmaRMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.scale = cfg.query_pre_attn_scalar ** -0.5
        self.window = cfg.sliding_window if layer_type == SLIDING else None
        self.backend = backend

    def forward(self, x, positions, rotary: RotaryEmbedding, kv_cache, meta: AttentionMetadata, kv_scale=None):
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.view(T, self.num_heads, self.head_dim))
        k = self.k_norm(k.view(T, self.num_kv_heads, self.head_dim))
        v = v.view(T, self.num_kv_heads, self.head_dim)
        o = attend(self.backend, q, k, v, positions, rotary, kv_cache, meta, self.scale, self.window, kv_scale)
        return self.o_proj(o.reshape(T, self.q_size))


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: Gemma3Config, layer_type: str, backend: AttentionBackend, ops: LayerOps,
                 parallel: ParallelContext):
        super().__init__()
        self.layer_type = layer_type
        eps = cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.self_attn = Gemma3Attention(cfg, layer_type, backend, parallel)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.mlp = GeluGatedMLP(cfg.hidden_size, cfg.intermediate_size, ops=ops, parallel=parallel)
        self.post_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)

    def forward(self, x, positions, rotary, kv_cache, meta, kv_scale=None):
        h = self.self_attn(self.input_layernorm(x), positions, rotary, kv_cache, meta, kv_scale)
        x = x + self.post_attention_layernorm(h)
        h = self.mlp(self.pre_feedforward_layernorm(x))
        return x + self.post_feedforward_layernorm(h)


class Gemma3ForCausalLM(nn.Module):
    def __init__(self, cfg: Gemma3Config, backend: AttentionBackend, ops: LayerOps = TORCH_OPS,
                 parallel: ParallelContext | None = None, fp8_kv_cache: bool = False):
        """`fp8_kv_cache`: K/V stored as FP8 E4M3 with a float32 scale per token, K/V and head
        (kv_cache_dtype="fp8"; docs/kv_cache_fp8.md); else in the model dtype."""
        super().__init__()
        if SLIDING in cfg.layer_types and not getattr(backend, "supports_window", False):
            raise NotImplementedError(
                f"Gemma-3 has sliding-window layers and the {type(backend).__name__} attention backend does not "
                f"support sliding windows; use attention_backend='torch' or 'triton'")
        self.config = cfg
        self.fp8_kv_cache = fp8_kv_cache
        self.parallel = parallel = parallel or ParallelContext.single()
        cfg.check_tensor_parallel(parallel.tp_size)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, parallel)
        self.embed_scale = math.sqrt(cfg.hidden_size)
        self.rotary = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_theta, cfg.rope_scaling,
                                      ops)
        self.rotary_local = RotaryEmbedding(cfg.head_dim, cfg.max_position_embeddings, cfg.rope_local_theta,
                                            cfg.rope_local_scaling, ops)
        self.layers = nn.ModuleList(Gemma3DecoderLayer(cfg, t, backend, ops, parallel) for t in cfg.layer_types)
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = ParallelLMHead(cfg.hidden_size, cfg.vocab_size, parallel)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.capture_layers, self.captured = (), {}     # no feature taps (no drafter reads Gemma-3's layers)

    def reset_rotary_tables(self, device: torch.device) -> None:
        self.rotary.reset_tables(device)
        self.rotary_local.reset_tables(device)

    @property
    def traits(self) -> ModelTraits:
        """The sliding layers (kv_cache/bounded_replay.py: the prefix-KV store keeps only the other layers' rows,
        a hit rebuilds the window's from host memory or by replay)."""
        c = self.config
        layers = tuple(i for i, t in enumerate(c.layer_types) if t == SLIDING)
        return ModelTraits(sliding_window=SlidingWindowLayout(c.sliding_window, layers) if layers else None,
                           fp8_kv_cache=True, batch_invariant=True)

    def cache_specs(self, dtype: torch.dtype, rollback_rows: int = 0) -> list[PagedCacheSpec]:
        """Full layers' KV in "kv", sliding layers' in "kv_window" (the window group: blocks past the window
        are released); this rank's KV heads only. No `rollback_rows`: a rejected draft's paged row is rewritten
        when its position is computed again (and its blocks are never released: release follows the computed
        tokens)."""
        c = self.config
        return split_kv_cache_specs(c.num_hidden_layers, c.layer_types.count(SLIDING),
                                    c.num_key_value_heads // self.parallel.tp_size, c.head_dim, dtype,
                                    self.fp8_kv_cache, c.sliding_window)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, caches: dict[str, list[torch.Tensor]],
                meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        x = x * self._embed_scale_in(x.dtype)
        per_layer = layer_caches(caches, (layer.layer_type == SLIDING for layer in self.layers))
        for layer, (kv_cache, kv_scale) in zip(self.layers, per_layer):
            rotary = self.rotary_local if layer.layer_type == SLIDING else self.rotary
            x = layer(x, positions, rotary, kv_cache, meta, kv_scale)
        return self.norm(x)

    def _embed_scale_in(self, dtype: torch.dtype) -> float:
        """sqrt(hidden) rounded to the model dtype, as HF multiplies by it; a Python number, so that no host
        tensor is copied to the device inside a captured CUDA graph."""
        return float(torch.tensor(self.embed_scale, dtype=dtype))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        cap = self.config.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    # multimodal checkpoints: the text tower's prefixes (older and newer transformers layouts)
    _TEXT_PREFIXES = ("model.language_model.", "language_model.model.", "language_model.", "model.")
    _SKIPPED = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """HF-named tensors in (q/k/v and gate/up fused, TP shards narrowed); vision-tower tensors of a
        multimodal checkpoint are skipped; every parameter must be covered exactly once."""
        tied = self.config.tie_word_embeddings

        def rename(name: str) -> str | None:
            if name.startswith(self._SKIPPED) or "rotary_emb" in name:
                return None
            for prefix in self._TEXT_PREFIXES:
                if name.startswith(prefix):
                    name = name[len(prefix):]
                    break
            return None if name == "lm_head.weight" and tied else name

        load_fused_hf_weights(self, weights, rename)
