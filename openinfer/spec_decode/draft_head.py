"""A DSpark-shaped draft head for ordinary HF models, trained on the target's own greedy output (issue 12 item 6).

DeepSeek-V4.1 ships its DSpark drafter as trained stages of the checkpoint (`spec_decode/dspark.py`). Other models
have none, so this module gives them a small head of the same shape, and `tools/train_draft_head.py` fits it by
self-distillation (docs/spec_decode.md, "Training a draft head"). The semantics follow the dspark drafter:

- **Context features.** For every context position p the target exposes the *input* hidden state of each layer in
  `target_layer_ids` (the residual stream entering that decoder layer), concatenated in that order:
  [len(target_layer_ids) * hidden]. For an HF `transformers` model that is `outputs.hidden_states[i]` of a forward
  with `output_hidden_states=True` (index 0 is the embeddings, index i the output of layer i - 1, the input of layer
  i; the last index is the final norm's output, never a layer input, so ids must be < num_hidden_layers):
  `hf_target_features`. In openinfer's Llama (`models/llama.py`) it is `x + residual` as decoder layer i receives
  them (`x` alone for layer 0), the sum the fused norm computes. `main_proj` + `main_norm` turn the features into
  one context row per position; each layer projects the rows to keys (RoPE at p) and values.
- **The block.** With context through position P and t, the target's token for P + 1, one block of `block_size` = n
  positions P + 1 .. P + n holds t then `noise_token_id`. Each layer: attention in which every block position sees
  the last `window` context rows and every block position (both directions: drafted in one pass), then a gated MLP;
  `norm` then the *target's* LM head gives the logits.
- **Markov head.** Draft i, the token for P + 2 + i, is argmax(logits_i + markov_head(markov_embed(prev_i))) with
  prev_0 = t and prev_i = draft i - 1: a rank-`markov_rank` bigram correction, drafted greedily left to right.
- **Confidence head.** A linear map (fp32, with a bias) of [norm(hidden_i), markov_embed(prev_i)];
  sigmoid of it is the probability that the target accepts draft i *given that drafts < i were accepted*, which is
  what the verification policy multiplies up (`policy.py`: gain = cumprod of confidences).

What is smaller than DSpark: one or a few plain pre-norm layers (attention with K/V from the context rows, dense
MLP) instead of V4.1 blocks with hyper-connections, MoE and FP8 window keys; K and V are kept separately (V4.1's
window attention shares one KV). The head holds no copy of the target's embedding or LM head: both are passed in at
construction and `load` and never written by `save`.

`DraftHeadDrafter` is the batched inference state with `DSparkDrafter`'s API (`extend`, `reset`, `propose`,
returning a `DSparkDraft`): per-request rings of context K/V, position p at slot p % W. As there, `extend` must only
get accepted positions (a rejected row's slot would hide a still visible accepted position), and a request that
writes its context from position 0 needs no `reset`. Plain torch, device-agnostic, no host sync in `propose`
(so on CUDA it replays graphs, one per batch bucket: spec_decode/graphs.py).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from openinfer.layers.basic import RMSNorm
from openinfer.spec_decode.dspark import DSparkDraft, ring_rows

CONFIG_FILE = "draft_head.json"
WEIGHTS_FILE = "draft_head.safetensors"


def default_target_layers(num_layers: int) -> tuple[int, ...]:
    """Three layer inputs spread over depth: early (2), middle, and the last layer's input. EAGLE-3 found that
    low/middle/high features beat the top layer alone for small drafters; DSpark's release takes the inputs of the
    last three of 40 layers (`dspark_target_layer_ids: [37, 38, 39]`), which `--target-layers` can reproduce."""
    if num_layers < 3:
        return tuple(range(num_layers))
    return tuple(sorted({min(2, num_layers - 3), num_layers // 2, num_layers - 1}))


def _hf_get(cfg, name: str, default=None):
    return cfg.get(name, default) if isinstance(cfg, dict) else getattr(cfg, name, default)


@dataclass
class DraftHeadConfig:
    hidden_size: int                      # the target's (the block runs in its embedding space)
    vocab_size: int                       # the target's
    target_layer_ids: tuple[int, ...]     # target layers whose *inputs* are the context features, in this order
    block_size: int = 4                   # n: drafts per block
    window: int = 64                      # W: context rows each block attends to (the newest W)
    num_heads: int = 8
    head_dim: int = 64
    intermediate_size: int = 1536
    num_layers: int = 1
    markov_rank: int = 64
    noise_token_id: int = 0               # fills block positions 1 .. n-1 (an id of the target vocab)
    rope_theta: float = 10000.0
    rms_eps: float = 1e-5

    def __post_init__(self):
        self.target_layer_ids = tuple(int(i) for i in self.target_layer_ids)
        if not self.target_layer_ids:
            raise ValueError("target_layer_ids must name at least one target layer")
        if self.block_size < 1 or self.window < 1:
            raise ValueError(f"block_size ({self.block_size}) and window ({self.window}) must be >= 1")
        if not 0 <= self.noise_token_id < self.vocab_size:
            raise ValueError(f"noise_token_id {self.noise_token_id} is outside the vocabulary "
                             f"(0..{self.vocab_size - 1})")

    @property
    def feature_size(self) -> int:
        return len(self.target_layer_ids) * self.hidden_size

    @classmethod
    def for_target(cls, hf_config, noise_token_id: int, **overrides) -> "DraftHeadConfig":
        """Sizes from the target's HF config (object or dict): its hidden size, vocabulary, attention shape, MLP
        width and RoPE base; one layer; overrides win."""
        num_layers = _hf_get(hf_config, "num_hidden_layers")
        heads = _hf_get(hf_config, "num_attention_heads")
        rope = _hf_get(hf_config, "rope_parameters") or _hf_get(hf_config, "rope_scaling") or {}
        theta = _hf_get(hf_config, "rope_theta") or rope.get("rope_theta", 10000.0)
        base = dict(hidden_size=_hf_get(hf_config, "hidden_size"), vocab_size=_hf_get(hf_config, "vocab_size"),
                    target_layer_ids=default_target_layers(num_layers), num_heads=heads,
                    head_dim=_hf_get(hf_config, "head_dim") or _hf_get(hf_config, "hidden_size") // heads,
                    intermediate_size=_hf_get(hf_config, "intermediate_size"), noise_token_id=noise_token_id,
                    rope_theta=float(theta), rms_eps=float(_hf_get(hf_config, "rms_norm_eps") or 1e-5))
        cfg = cls(**{**base, **{k: v for k, v in overrides.items() if v is not None}})
        if max(cfg.target_layer_ids) >= num_layers or min(cfg.target_layer_ids) < 0:
            raise ValueError(f"target_layer_ids {cfg.target_layer_ids} must be inputs of the target's layers "
                             f"0 .. {num_layers - 1}")
        return cfg

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "target_layer_ids": list(self.target_layer_ids)}, indent=2)

    @classmethod
    def from_json(cls, text: str) -> "DraftHeadConfig":
        raw = json.loads(text)
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in raw.items() if k in known})


def apply_rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half RoPE (Llama's layout) of x [..., T, heads, d] at positions [..., T], computed in float32."""
    d = x.shape[-1]
    inv_freq = theta ** (-torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d)
    angles = positions[..., None].float() * inv_freq
    cos, sin = angles.cos()[..., None, :], angles.sin()[..., None, :]
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class DraftLayer(nn.Module):
    """Pre-norm attention + gated MLP. The same `kv_proj` makes the block's keys/values (from its normed hidden) and
    the context's (from the context rows, already normed by `main_norm`), as a DSpark stage's `wkv` serves both."""

    def __init__(self, cfg: DraftHeadConfig):
        super().__init__()
        inner = cfg.num_heads * cfg.head_dim
        self.cfg = cfg
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.q_proj = nn.Linear(cfg.hidden_size, inner, bias=False)
        self.kv_proj = nn.Linear(cfg.hidden_size, 2 * inner, bias=False)
        self.o_proj = nn.Linear(inner, cfg.hidden_size, bias=False)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.gate_up = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def keys_values(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [..., T, hidden] at positions [..., T] -> (k with RoPE, v), each [..., T, heads, head_dim]."""
        k, v = self.kv_proj(x).unflatten(-1, (2, self.cfg.num_heads, self.cfg.head_dim)).unbind(-3)
        return apply_rope(k, positions, self.cfg.rope_theta), v

    def forward(self, h, positions, ctx_k, ctx_v, ctx_valid):
        """h [B, n, hidden] at positions [B, n]; context keys/values [B, W, heads, d] with ctx_valid [B, W]."""
        B, n, _ = h.shape
        x = self.attn_norm(h)
        q = apply_rope(self.q_proj(x).unflatten(-1, (self.cfg.num_heads, self.cfg.head_dim)), positions,
                       self.cfg.rope_theta)
        k, v = self.keys_values(x, positions)
        k, v = torch.cat([ctx_k.to(k.dtype), k], dim=1), torch.cat([ctx_v.to(v.dtype), v], dim=1)
        visible = torch.cat([ctx_valid, torch.ones(B, n, dtype=torch.bool, device=h.device)], dim=1)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           attn_mask=visible[:, None, None, :])
        h = h + self.o_proj(o.transpose(1, 2).flatten(2))
        gate, up = self.gate_up(self.mlp_norm(h)).chunk(2, dim=-1)
        return h + self.down(F.silu(gate) * up)


class DraftHead(nn.Module):
    """The trainable head. `embed` [vocab, hidden] and `lm_head` [vocab, hidden] are the target's (frozen, not in
    `state_dict`); everything else is the head's own."""

    def __init__(self, cfg: DraftHeadConfig, embed: torch.Tensor, lm_head: torch.Tensor):
        super().__init__()
        for name, t in (("embed", embed), ("lm_head", lm_head)):
            if tuple(t.shape) != (cfg.vocab_size, cfg.hidden_size):
                raise ValueError(f"the target's {name} has shape {tuple(t.shape)}, but this draft head was built for "
                                 f"vocab_size {cfg.vocab_size} and hidden_size {cfg.hidden_size}")
        self.cfg = cfg
        self.register_buffer("embed_weight", embed.detach(), persistent=False)
        self.register_buffer("lm_head_weight", lm_head.detach(), persistent=False)
        self.main_proj = nn.Linear(cfg.feature_size, cfg.hidden_size, bias=False)
        self.main_norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.layers = nn.ModuleList(DraftLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.markov_embed = nn.Embedding(cfg.vocab_size, cfg.markov_rank)
        self.markov_head = nn.Linear(cfg.markov_rank, cfg.vocab_size, bias=False)
        self.confidence = nn.Linear(cfg.hidden_size + cfg.markov_rank, 1)
        self._init_weights()

    def _init_weights(self) -> None:
        """Small normal weights; the Markov head starts at zero so the untrained head's logits are the backbone's
        (its embedding still gets gradients once the head moves, as with LoRA's zero-initialised B)."""
        with torch.no_grad():
            for module in self.modules():
                if isinstance(module, nn.Linear):
                    module.weight.normal_(0.0, 0.02)
            self.markov_embed.weight.normal_(0.0, self.cfg.markov_rank ** -0.5)
            self.markov_head.weight.zero_()
            self.confidence.bias.zero_()
            self.norm.weight.fill_(0.1)

    @property
    def param_dtype(self) -> torch.dtype:
        return self.main_proj.weight.dtype

    # -- the pieces `DraftHeadDrafter` and training share
    def context_rows(self, features: torch.Tensor) -> torch.Tensor:
        """[..., n_target * hidden] target features -> [..., hidden] context rows."""
        return self.main_norm(self.main_proj(features.to(self.param_dtype)))

    def context_keys_values(self, features: torch.Tensor, positions: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
        """Per layer (k, v) [..., T, heads, d] of context rows at these positions."""
        rows = self.context_rows(features)
        return [layer.keys_values(rows, positions) for layer in self.layers]

    def block_hidden(self, ctx_kv, ctx_valid, last_positions, next_tokens) -> torch.Tensor:
        """The block P + 1 .. P + n (t, then noise) through the layers: [B, n, hidden] before the final norm."""
        B, n = next_tokens.shape[0], self.cfg.block_size
        ids = torch.full((B, n), self.cfg.noise_token_id, dtype=torch.long, device=next_tokens.device)
        ids[:, 0] = next_tokens
        positions = last_positions.long()[:, None] + 1 + torch.arange(n, device=ids.device)
        h = F.embedding(ids, self.embed_weight).to(self.param_dtype)
        for layer, (k, v) in zip(self.layers, ctx_kv):
            h = layer(h, positions, k, v, ctx_valid)
        return h

    def backbone_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(self.norm(hidden).to(self.lm_head_weight.dtype), self.lm_head_weight).float()

    def markov(self, prev: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(bigram bias [..., vocab] float32, markov embedding [..., rank]) of the previous tokens."""
        m = self.markov_embed(prev)
        return self.markov_head(m).float(), m

    def confidence_logit(self, hidden: torch.Tensor, markov_emb: torch.Tensor) -> torch.Tensor:
        """Raw score in float32 (as DSpark's confidence head runs); sigmoid is the acceptance probability. It reads
        the hidden state *after* the final norm (DSpark: before it): the residual stream's scale drifts as the
        layers train, and a linear score of it swung the BCE by orders of magnitude early in training."""
        x = torch.cat([self.norm(hidden).float(), markov_emb.float()], dim=-1)
        return F.linear(x, self.confidence.weight.float(), self.confidence.bias.float()).squeeze(-1)

    def greedy(self, hidden: torch.Tensor, next_tokens: torch.Tensor) -> DSparkDraft:
        """Draft left to right: draft i = argmax(logits_i + markov(prev_i)), prev_0 = t, prev_i = draft i - 1."""
        base = self.backbone_logits(hidden)
        prev, tokens, scores, logits = next_tokens.long(), [], [], []
        for i in range(self.cfg.block_size):
            bias, m = self.markov(prev)
            logits_i = base[:, i] + bias
            scores.append(self.confidence_logit(hidden[:, i], m))
            prev = logits_i.argmax(-1)
            tokens.append(prev)
            logits.append(logits_i)
        scores = torch.stack(scores, 1)
        return DSparkDraft(torch.stack(tokens, 1), torch.sigmoid(scores), scores, torch.stack(logits, 1))

    # -- training and direct (ring-free) drafting
    def forward(self, features, positions, valid, last_positions, next_tokens, prev_tokens):
        """Teacher-forced block for training: context `features` [B, W, F] at `positions` [B, W] (`valid` [B, W]),
        block after `last_positions` [B] starting with `next_tokens` [B]; `prev_tokens` [B, n] is the token before
        each draft (prev_tokens[:, 0] == next_tokens). Returns (logits [B, n, vocab] float32 with the Markov bias,
        confidence logits [B, n] float32)."""
        hidden = self.block_hidden(self.context_keys_values(features, positions), valid, last_positions,
                                   next_tokens)
        bias, m = self.markov(prev_tokens)
        return self.backbone_logits(hidden) + bias, self.confidence_logit(hidden, m)

    @torch.no_grad()
    def draft(self, features, positions, valid, last_positions, next_tokens) -> DSparkDraft:
        """Greedy drafts from an explicit context window (no ring): what `DraftHeadDrafter.propose` computes."""
        hidden = self.block_hidden(self.context_keys_values(features, positions), valid, last_positions,
                                   next_tokens)
        return self.greedy(hidden, next_tokens)

    # -- files
    def save(self, directory: str | Path) -> None:
        """`draft_head.json` (the config) and `draft_head.safetensors` (the head's own weights, not the target's)."""
        from safetensors.torch import save_file

        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        (out / CONFIG_FILE).write_text(self.cfg.to_json())
        save_file({k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}, str(out / WEIGHTS_FILE))

    @classmethod
    def load(cls, directory: str | Path, embed: torch.Tensor, lm_head: torch.Tensor) -> "DraftHead":
        """The head in `directory` on the target's `embed`/`lm_head` (their device; the weights keep the saved
        dtype: cast with `.to(dtype)`), frozen for serving as the target is (no parameter requires grad; training
        builds its own head). A head trained for another target raises ValueError naming the mismatch."""
        from safetensors.torch import load_file

        src = Path(directory)
        cfg = DraftHeadConfig.from_json((src / CONFIG_FILE).read_text())
        for name, t in (("embedding", embed), ("LM head", lm_head)):
            vocab, hidden = t.shape
            if hidden != cfg.hidden_size:
                raise ValueError(f"draft head in {src} was trained for hidden_size {cfg.hidden_size}, but the "
                                 f"target's {name} has hidden size {hidden}")
            if vocab != cfg.vocab_size:
                raise ValueError(f"draft head in {src} was trained for vocab_size {cfg.vocab_size}, but the "
                                 f"target's {name} has {vocab} rows")
        state = load_file(str(src / WEIGHTS_FILE), device=str(embed.device))
        head = cls(cfg, embed, lm_head).to(device=embed.device, dtype=next(iter(state.values())).dtype)
        head.embed_weight, head.lm_head_weight = embed.detach(), lm_head.detach()   # the target's, uncast
        head.load_state_dict(state)
        return head.requires_grad_(False).eval()


@torch.no_grad()
def hf_target_features(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                       layer_ids) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward of an HF causal LM: (features [B, T, n_target * hidden] = the inputs of `layer_ids`
    concatenated, i.e. `hidden_states[i]`; the target's greedy next token at every position [B, T])."""
    num_layers = model.config.num_hidden_layers
    if any(not 0 <= i < num_layers for i in layer_ids):
        raise ValueError(f"layer ids {tuple(layer_ids)} must be inputs of the target's layers 0 .. {num_layers - 1} "
                         f"(hidden_states[{num_layers}] is the final norm's output, not a layer input)")
    out = model(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, use_cache=False)
    features = torch.cat([out.hidden_states[i] for i in layer_ids], dim=-1)
    return features, out.logits.argmax(-1)


class DraftHeadDrafter:
    """Drafts with a `DraftHead` for up to `max_requests` requests (slots 0 .. max_requests - 1); the API of
    `DSparkDrafter`: `extend` the accepted rows' context, `propose` a block per request."""
    reads_next_tokens = False     # extend reads the rows' features only

    def __init__(self, head: DraftHead, max_requests: int, target=None, max_batch: int = 0):
        """`target`: the engine's model, whose forward keeps the features (`capture_layers`, as openinfer's
        Llama does) — needed only for `enable_capture`. `max_batch` > 0 (CUDA): `propose` for up to that many
        requests replays CUDA graphs (spec_decode/graphs.py)."""
        cfg = head.cfg
        self.target = target
        self.head, self.block_size, self.window = head.eval(), cfg.block_size, cfg.window
        dev = head.main_proj.weight.device
        # [layer, request slot, ring slot, k|v, heads, head_dim]; ring slot W is scratch for rows not kept
        self.rings = torch.zeros((cfg.num_layers, max_requests, cfg.window + 1, 2, cfg.num_heads, cfg.head_dim),
                                 dtype=head.param_dtype, device=dev)
        self.graphs = None
        if max_batch and dev.type == "cuda":
            from openinfer.spec_decode.graphs import BatchGraphs

            self.graphs = BatchGraphs(self._propose, max_batch)

    def enable_capture(self) -> None:
        layers = self.target.traits.feature_layers
        if not layers:
            raise ValueError(f"the draft head reads its target's layer inputs; {type(self.target).__name__} "
                             f"does not expose them (ModelTraits.feature_layers)")
        if max(self.head.cfg.target_layer_ids) >= layers:
            raise ValueError(f"the draft head reads layers {self.head.cfg.target_layer_ids}; the target has {layers}")
        self.target.capture_layers = self.head.cfg.target_layer_ids

    def features_of(self, captured: dict[int, torch.Tensor]) -> torch.Tensor:
        """The target-layer inputs a forward kept, concatenated in the head's order: [rows, n_target * hidden]."""
        return torch.cat([captured[i] for i in self.head.cfg.target_layer_ids], dim=-1).to(self.rings.dtype)

    @torch.inference_mode()
    def extend(self, slots: torch.Tensor, positions: torch.Tensor, features: torch.Tensor) -> None:
        """Write rows (request slot [T], position [T], target features [T, n_target * hidden]) into the rings.
        Rows of one request must have distinct positions; only its newest W are written (older would be
        overwritten)."""
        if features.shape[0] == 0:
            return
        slots, positions = slots.long(), positions.long()
        dst = ring_rows(slots, positions, self.rings.shape[1], self.window)
        for layer, (k, v) in enumerate(self.head.context_keys_values(features, positions)):
            self.rings[layer, slots, dst] = torch.stack([k, v], dim=1).to(self.rings.dtype)

    def reset(self, slots: torch.Tensor) -> None:
        """Forget these request slots' context (needed only for a request not written from position 0)."""
        self.rings[:, slots.long()] = 0

    @torch.inference_mode()
    def propose(self, slots: torch.Tensor, last_positions: torch.Tensor, next_tokens: torch.Tensor) -> DSparkDraft:
        """`last_positions` [B]: the newest context position P written by `extend`; `next_tokens` [B]: the
        target's token at P + 1. Returns block_size greedy drafts (positions P + 2 ..) and their confidences
        (with graphs: views of the graph's outputs, valid until the next call)."""
        if self.graphs is not None:
            return self.graphs(slots.long(), last_positions.long(), next_tokens.long())
        return self._propose(slots, last_positions, next_tokens)

    def _propose(self, slots: torch.Tensor, last_positions: torch.Tensor, next_tokens: torch.Tensor) -> DSparkDraft:
        W, P = self.window, last_positions.long()
        # ring slot j holds position P - ((P - j) mod W): written once that is >= 0
        valid = torch.arange(W, device=P.device)[None, :] <= P[:, None]
        rings = self.rings[:, slots.long(), :W]
        ctx_kv = [(rings[layer, :, :, 0], rings[layer, :, :, 1]) for layer in range(rings.shape[0])]
        hidden = self.head.block_hidden(ctx_kv, valid, P, next_tokens)
        return self.head.greedy(hidden, next_tokens)
