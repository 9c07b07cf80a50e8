"""DeepSeek-V4 (HF `DeepseekV4ForCausalLM` config and weight names) over openinfer's paged caches.

Read top to bottom: config -> small ops (norms, interleaved partial RoPE) -> the compressor (CSA / HCA
pooling) -> attention (sliding window + compressed entries + sinks) -> MoE (hash / learned) -> mHC ->
decoder layer -> model -> MTP -> weight loading.

Cache layout (spec 003 §3; docs/deepseek_v4.md has the byte counts):
- paged, 128-token blocks shared through the prefix cache: CSA main entries (`csa_kv`, one per 4 tokens),
  CSA indexer keys (`csa_index`), HCA entries (`hca_kv`, one per 128 tokens);
- per running request (state slots): the sliding-window ring of the last W keys of every layer (`swa`,
  position p at row p % R) and the compressors' raw rows for windows not yet closed (`csa_rows`,
  `csa_index_rows`: the current and the previous window, since a CSA entry overlaps two windows;
  `hca_state`: an online-softmax running state of the open window, after each of the last positions).
  Every state is indexed by position, with `rollback_rows` (EngineConfig.rollback_rows: k, 2k + 1 under async
  speculation; 0 without speculation) rows of room: a verify step writes its drafts' rows, and after a rejection
  the next step simply starts from the last accepted position — the rows the drafts took alias positions no later
  read sees (spec 000 §5.3's "6 extra slots"; docs/spec_decode.md, "Rolling back DeepSeek state").
A prefill chunk runs per sequence (any start, any length: windows close wherever the chunk crosses a
boundary); decode rows run batched. Both read the state a previous step left and write it back.

Tensor parallelism (`parallel.tp_size` > 1, expert parallelism off): query heads, sinks and output groups
split over the TP ranks (one all-reduce after o_b_proj), the routed and shared experts split along their
intermediate dimension (one all-reduce per MoE for both), the embedding and LM head split by vocabulary
(logits all-gathered, so every rank samples the same token); everything else — the shared KV head, the
compressors, the indexer, the router, mHC, norms — and so every cache is replicated. MTP layers are
decoder layers and are split the same way. `load_weights` cuts each checkpoint tensor (and a quantized
weight's scales, at the same block boundary) to this rank's slice. With tp_size 1 nothing changes.

Where the reference and causal semantics part (the lightning indexer's top-k on tied scores, see
docs/deepseek_v4.md), this file is causal: ties go to the earlier entry.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from openinfer.distributed.collectives import tp_all_reduce
from openinfer.distributed.expert_parallel import (ExpertRouting, checkpoint_slots, expert_parallel_moe,
                                                   initial_layout)
from openinfer.distributed.parallel_state import ParallelContext
from openinfer.kv_cache.spec import CacheSpec, PagedCacheSpec, RequestStateSpec
from openinfer.layers.attention import AttentionMetadata
from openinfer.layers.basic import TORCH_OPS, LayerOps
from openinfer.layers.parallel_linear import ParallelLMHead, VocabParallelEmbedding
from openinfer.quantization.linear import stored_parameters, to_fp8_linear
from openinfer.quantization.reference import grouped_gemm as reference_grouped_gemm

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
_RATIO_TO_TYPE = {0: SLIDING, 4: CSA, 128: HCA}
V4_TP_WITH_EP = ("DeepSeek-V4 does not combine tensor_parallel_size > 1 with enable_expert_parallel: use "
                 "data_parallel_size with enable_expert_parallel, or tensor_parallel_size without it")


# ---- config -------------------------------------------------------------------------------------------
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


# ---- small ops ----------------------------------------------------------------------------------------
class RMSNorm(nn.Module):
    """Normalize in float32, scale by a float32 weight, cast back once (the V4 reference's order)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps))).to(x.dtype)


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def rope_inv_freq(rope: dict, dim: int, max_positions: int) -> tuple[torch.Tensor, float]:
    """(inverse frequencies, cos/sin scale) for default and YaRN RoPE (HF `rope_parameters` semantics)."""
    base = rope["rope_theta"]
    # on the CPU whatever the default device: under `torch.device("meta")` (models are built there) arange takes
    # torch's reference path, whose first use imports torch._dynamo (~2 s in every fresh process)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim)
    kind = rope.get("rope_type", "default")
    if kind == "default":
        return 1.0 / pos_freqs, 1.0
    if kind != "yarn":
        raise ValueError(f"DeepSeek-V4 rope type {kind!r} is not supported (default, yarn)")
    orig = rope["original_max_position_embeddings"]
    factor = rope.get("factor") or max_positions / orig
    beta_fast, beta_slow = rope.get("beta_fast") or 32, rope.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / ((high - low) or 0.001)).clamp(0, 1)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    scale = rope.get("attention_factor")
    if scale is None:
        mscale, mscale_all = rope.get("mscale"), rope.get("mscale_all_dim")

        def get_mscale(m=1.0):
            return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

        scale = get_mscale(mscale) / get_mscale(mscale_all) if mscale and mscale_all else get_mscale()
    return inv_freq, float(scale)


class InterleavedRope(nn.Module):
    """RoPE on the trailing `dim` channels of each vector, rotating consecutive channel pairs (V4's layout
    `[nope | rope]`). cos/sin are computed from positions on the fly: V4 contexts run to 1M positions."""

    def __init__(self, rope: dict, dim: int, max_positions: int):
        super().__init__()
        inv_freq, self.scale = rope_inv_freq(rope, dim, max_positions)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.rope, self.dim, self.max_positions = rope, dim, max_positions

    def reset(self, device: torch.device) -> None:
        self.inv_freq = rope_inv_freq(self.rope, self.dim, self.max_positions)[0].to(device)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[..., None].float() * self.inv_freq
        return (freqs.cos() * self.scale).to(dtype), (freqs.sin() * self.scale).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., D]; cos/sin [..., dim/2] broadcast against x's leading dims (pass [T, 1, dim/2] for heads)."""
    rd = 2 * cos.shape[-1]
    pairs = x[..., -rd:].float().unflatten(-1, (rd // 2, 2))
    x1, x2 = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    return torch.cat((x[..., :-rd], rotated.to(x.dtype)), dim=-1)


# ---- paged entry addressing ---------------------------------------------------------------------------
def entry_index(block_table: torch.Tensor, entry: torch.Tensor, entries_per_block: int) -> torch.Tensor:
    """Flat row of compressed entry `entry` in a [num_blocks * entries_per_block, D] view of a paged cache."""
    return block_table.gather(-1, entry // entries_per_block) * entries_per_block + entry % entries_per_block


# ---- compressors (CSA / HCA pooling) ------------------------------------------------------------------
class Compressor(nn.Module):
    """One compressed entry per `ratio` source tokens: a per-channel softmax-gated sum of projected rows,
    RMS-normed and RoPE'd at the window's first position. Each step gives it the rows of its new tokens
    (`rows`); what an open window needs lives in the request's state between steps. The two kinds differ in
    what a window pools and so in that state (see the subclasses)."""

    width_factor = 1

    def __init__(self, hidden: int, dim: int, ratio: int, eps: float):
        super().__init__()
        width = self.width_factor * dim
        self.kv_proj = nn.Linear(hidden, width, bias=False)
        self.gate_proj = nn.Linear(hidden, width, bias=False)
        self.position_bias = nn.Parameter(torch.zeros(ratio, width))
        self.kv_norm = RMSNorm(dim, eps)
        self.dim, self.ratio, self.width = dim, ratio, width

    def rows(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """[T, 2*width] float32: projected kv, and the gate plus its in-window position bias."""
        gate = self.gate_proj(x) + self.position_bias[positions % self.ratio]
        return torch.cat((self.kv_proj(x).float(), gate.float()), dim=-1)

    def _finish(self, pooled: torch.Tensor, windows: torch.Tensor, rope: "InterleavedRope") -> torch.Tensor:
        pooled = self.kv_norm(pooled)
        cos, sin = rope.cos_sin(windows * self.ratio, pooled.dtype)
        return apply_rope(pooled, cos, sin)


class RunningCompressor(Compressor):
    """HCA: entry w pools window w's rows. State: online-softmax running states of the open window,
    [L, 3, dim] float32 (per-channel max gate, sum of exp, exp-weighted kv sum), the state after position p at
    row p % L, for the last L = 1 + rollback_rows positions: a step reads the state after its first position's
    predecessor, so a verify step whose drafts were rejected leaves the accepted position's state in place.
    Empty at every window (so block) boundary."""

    @staticmethod
    def _merge(a, b):
        """Combine two running states [..., 3, dim] (either may be empty: max -inf, sums 0)."""
        m = torch.maximum(a[..., 0, :], b[..., 0, :])
        safe = torch.where(torch.isinf(m), 0.0, m)
        wa, wb = torch.exp(a[..., 0, :] - safe), torch.exp(b[..., 0, :] - safe)
        return torch.stack((m, a[..., 1, :] * wa + b[..., 1, :] * wb, a[..., 2, :] * wa + b[..., 2, :] * wb), dim=-2)

    def _entries(self, state, windows, rope, dtype):
        return self._finish((state[..., 2, :] / state[..., 1, :]).to(dtype), windows, rope)

    def close_chunk(self, state, cache, new_rows, positions, rope, p) -> None:
        """Prefill chunk of one sequence: write the entries of the windows it closes into the paged `cache`
        ([blocks, entries_per_block, dim]); keep the running state after each of its last L positions in
        `state` [L, 3, dim]."""
        r, d, dev, L = self.ratio, self.dim, new_rows.device, state.shape[0]
        start, end = p.context_len - p.query_len, p.context_len
        lead, n = start % r, len(new_rows)
        nw = -(-(lead + n) // r)
        kv = torch.zeros(nw * r, d, device=dev)
        gate = torch.full((nw * r, d), float("-inf"), device=dev)
        kv[lead:lead + n], gate[lead:lead + n] = new_rows[:, :d], new_rows[:, d:]
        kv, gate = kv.view(nw, r, d), gate.view(nw, r, d)
        m = gate.max(dim=1).values
        e = torch.exp(gate - m[:, None, :])
        windows = torch.stack((m, e.sum(1), (e * kv).sum(1)), dim=1)         # [nw, 3, d]
        if lead:                                                              # the open window's earlier rows
            windows[0] = self._merge(state[(start - 1) % L], windows[0])
        closed = end // r - start // r
        if closed:
            ids = torch.arange(start // r, end // r, device=dev)
            cache.view(-1, d)[entry_index(p.block_ids, ids, cache.shape[1])] = self._entries(
                windows[:closed], ids, rope, cache.dtype)
        if L == 1:
            if end % r:
                state[0] = windows[-1]
            return
        base = state[(start - 1) % L].clone()
        for q in range(max(start, end - L), end):      # the state after q: its window's rows up to q
            wi, upto = divmod(q - start + lead, r)
            g = gate[wi, :upto + 1]
            m = g.max(dim=0).values
            e = torch.exp(g - m)
            st = torch.stack((m, e.sum(0), (e * kv[wi, :upto + 1]).sum(0)))
            state[q % L] = self._merge(base, st) if wi == 0 and lead else st

    def close_decode(self, state, cache, new_rows, positions, slots, tables, rope, offsets=None) -> None:
        """Decode rows (one token each): fold the row into the running state; rows that end a window write
        its entry, the others write to the runner's scratch block (the last one), so the batch needs no
        host-side branching.

        `offsets` (a verify step's rows: row t at offset j holds position p, and rows t - 1 .. t - j the
        request's positions p - 1 .. p - j of this step): the state after p is the step's own rows of p's window
        reduced at once, merged into the state before the step's first row if the window opened earlier — as
        `close_chunk` computes it; every read precedes every write, so the rows of one request need no order."""
        r, d, L = self.ratio, self.dim, state.shape[1]
        if offsets is None:
            row = torch.stack((new_rows[:, d:], torch.ones_like(new_rows[:, d:]), new_rows[:, :d]), dim=1)
            fresh = (positions % r == 0)[:, None, None]                     # a window opens: drop the old one
            merged = torch.where(fresh, row, self._merge(state[slots, (positions - 1) % L], row))
        else:
            back = torch.arange(L, device=positions.device)                 # at most L = 1 + k rows per request
            own = (back <= offsets[:, None]) & (back <= (positions % r)[:, None])       # [T, L]: p - b, this step
            src = (torch.arange(len(positions), device=positions.device)[:, None] - back).clamp(min=0)
            gate = torch.where(own[..., None], new_rows[src, d:], float("-inf"))
            m = gate.max(dim=1).values                                      # finite: b = 0 is always own
            e = torch.exp(gate - m[:, None])
            steps = torch.stack((m, e.sum(1), (e * new_rows[src, :d]).sum(1)), dim=1)
            before = (offsets < positions % r)[:, None, None]               # the window began before the step
            merged = torch.where(before, self._merge(state[slots, (positions - offsets - 1) % L], steps), steps)
        state[slots, positions % L] = merged
        window = ((positions + 1) // r - 1).clamp(min=0)
        dst = torch.where((positions + 1) % r == 0, entry_index(tables, window[:, None], cache.shape[1])[:, 0],
                          (cache.shape[0] - 1) * cache.shape[1])
        cache.view(-1, d)[dst] = self._entries(merged, window, rope, cache.dtype)


class OverlappingCompressor(Compressor):
    """CSA (and its indexer): each row projects to two series; entry w pools the previous window's first
    series with window w's second (2*ratio slots; window 0 has no previous window). State: the raw rows
    (`[kv | gate + position_bias]`, float32) of the open window and the one before, in a ring of 2*ratio
    positions (plus rollback_rows: row p % ring length)."""

    width_factor = 2

    def _entries(self, cur, prev, has_prev, windows, rope, dtype):
        """cur/prev [N, ratio, 2*width]: rows of windows w and w-1 -> [N, dim] entries for `windows` [N]."""
        d, w = self.dim, self.width
        prev_kv = torch.where(has_prev[:, None, None], prev[..., :d], 0.0)
        prev_gate = torch.where(has_prev[:, None, None], prev[..., w:w + d], float("-inf"))
        kv = torch.cat((prev_kv, cur[..., d:w]), dim=1).to(dtype)
        gate = torch.cat((prev_gate, cur[..., w + d:]), dim=1)
        return self._finish((kv * gate.softmax(dim=1).to(dtype)).sum(dim=1), windows, rope)

    def close_chunk(self, ring, cache, new_rows, positions, rope, p) -> None:
        """Prefill chunk of one sequence: write the entries of the windows it closes into the paged `cache`
        ([blocks, entries_per_block, dim]); keep the rows open windows need in `ring` [2*ratio, 2*width]."""
        r, dev, R = self.ratio, new_rows.device, ring.shape[0]
        start, end = p.context_len - p.query_len, p.context_len
        first = max(start // r - 1, 0)                            # oldest window whose rows are still needed
        windows = torch.arange(start // r, end // r, device=dev)
        if len(windows):
            hist = torch.arange(first * r, start, device=dev)
            rows = torch.cat((ring[hist % R], new_rows))[:(end // r - first) * r]
            win = rows.view(-1, r, rows.shape[-1])
            local = windows - first
            entries = self._entries(win[local], win[(local - 1).clamp(min=0)], windows > 0, windows, rope,
                                    cache.dtype)
            cache.view(-1, self.dim)[entry_index(p.block_ids, windows, cache.shape[1])] = entries
        keep = min(len(new_rows), R)
        ring[positions[-keep:] % R] = new_rows[-keep:]

    def close_decode(self, ring, cache, new_rows, positions, slots, tables, rope) -> None:
        """Decode rows (one token each): store the row; rows that end a window write its entry, the others
        write to the runner's scratch block (the last one), so the batch needs no host-side branching."""
        r, R = self.ratio, ring.shape[1]
        ring[slots, positions % R] = new_rows
        window = (positions + 1) // r - 1
        j = torch.arange(r, device=positions.device)
        cur = ring[slots[:, None], (window[:, None] * r + j) % R]
        prev = ring[slots[:, None], ((window[:, None] - 1) * r + j) % R]
        entries = self._entries(cur, prev, window > 0, window.clamp(min=0), rope, cache.dtype)
        epb = cache.shape[1]
        dst = torch.where((positions + 1) % r == 0, entry_index(tables, window.clamp(min=0)[:, None], epb)[:, 0],
                          (cache.shape[0] - 1) * epb)
        cache.view(-1, self.dim)[dst] = entries


class Indexer(OverlappingCompressor):
    """Lightning indexer (CSA): its own overlapping compressor over index_head_dim keys, and scores
    sum_h w_h * relu(q_h . k) / sqrt(d_I) that keep the top `index_topk` closed entries per query.
    Ties go to the earlier entry, so appending tokens never changes an earlier query's choice."""

    def __init__(self, cfg: DeepseekV4Config, ratio: int):
        super().__init__(cfg.hidden_size, cfg.index_head_dim, ratio, cfg.rms_norm_eps)
        self.num_heads, self.topk = cfg.index_n_heads, cfg.index_topk
        self.q_b_proj = nn.Linear(cfg.q_lora_rank, self.num_heads * self.dim, bias=False)
        self.scorer = nn.Module()
        self.scorer.weights_proj = nn.Linear(cfg.hidden_size, self.num_heads, bias=False)

    def queries(self, x, q_residual, cos, sin) -> tuple[torch.Tensor, torch.Tensor]:
        q = apply_rope(self.q_b_proj(q_residual).view(-1, self.num_heads, self.dim), cos[:, None], sin[:, None])
        return q, self.scorer.weights_proj(x).float() * self.num_heads ** -0.5

    def select(self, q, weights, keys, num_closed) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, H, d], weights [T, H], keys [T or 1, N, d], num_closed [T] -> (entries [T, k], valid [T, k])."""
        if keys.shape[0] == 1:     # a prefill chunk: every query scores the same keys, no per-query copy
            scores = torch.einsum("thd,nd->thn", q.float(), keys[0].float())
        else:
            scores = torch.einsum("thd,tnd->thn", q.float(), keys.float())
        scores = (F.relu(scores) * self.dim ** -0.5 * weights[..., None]).sum(1)          # [T, N]
        closed = torch.arange(scores.shape[-1], device=scores.device)[None, :] < num_closed[:, None]
        scores = scores.masked_fill(~closed, float("-inf"))
        picked = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :min(self.topk, scores.shape[-1])]
        return picked, picked < num_closed[:, None]


# ---- attention ----------------------------------------------------------------------------------------
class DeepseekV4Attention(nn.Module):
    """Shared-KV MQA (one K=V head of head_dim) over the sliding window (the last W tokens, self included),
    the layer's compressed entries (HCA: every closed one; CSA: the indexer's top-k) and a per-head sink
    logit. The output's RoPE slice is rotated back by the query position; a grouped low-rank projection
    follows. `state` maps this layer's cache names (swa, kv, rows, index, index_rows) to tensors.

    Tensor parallelism (`parallel.tp_size` > 1) splits the query heads: rank r holds heads
    [r*H/tp, (r+1)*H/tp) of q_b_proj and the sinks, the output groups [r*G/tp, (r+1)*G/tp) of o_a_proj (whose
    inputs are exactly those heads: a group is H/G consecutive heads) and the matching input columns of
    o_b_proj, whose partial products are summed over the TP group (one all-reduce). q_a_proj, q_a_norm,
    kv_proj, kv_norm, the compressor and the indexer stay replicated: the single shared KV head and the
    compressed entries are the same for every head, so every rank computes them in full and the KV caches
    (sliding window, compressed entries, indexer keys, compressor state) are replicated, not split."""

    def __init__(self, cfg: DeepseekV4Config, layer_type: str, parallel: ParallelContext | None = None):
        super().__init__()
        self.parallel = parallel or ParallelContext.single()
        tp = self.parallel.tp_size
        self.cfg, self.layer_type = cfg, layer_type
        self.num_heads, self.head_dim, self.window = cfg.num_attention_heads // tp, cfg.head_dim, cfg.sliding_window
        self.o_groups = cfg.o_groups // tp          # this rank's output groups (all of them without TP)
        self.scale = self.head_dim ** -0.5
        self.q_a_proj = nn.Linear(cfg.hidden_size, cfg.q_lora_rank, bias=False)
        self.q_a_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.q_b_proj = nn.Linear(cfg.q_lora_rank, self.num_heads * self.head_dim, bias=False)
        self.kv_proj = nn.Linear(cfg.hidden_size, self.head_dim, bias=False)
        self.kv_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.o_a_proj = nn.Linear(cfg.num_attention_heads * self.head_dim // cfg.o_groups,
                                  self.o_groups * cfg.o_lora_rank, bias=False)
        self.o_b_proj = nn.Linear(self.o_groups * cfg.o_lora_rank, cfg.hidden_size, bias=False)
        self.sinks = nn.Parameter(torch.zeros(self.num_heads))
        self.compressor = None
        if layer_type != SLIDING:
            self.ratio = cfg.compress_rates[layer_type]
            kind = OverlappingCompressor if layer_type == CSA else RunningCompressor
            self.compressor = kind(cfg.hidden_size, self.head_dim, self.ratio, cfg.rms_norm_eps)
            if layer_type == CSA:
                self.compressor.indexer = Indexer(cfg, self.ratio)

    def forward(self, x, positions, rope: InterleavedRope, state: dict, meta: AttentionMetadata):
        T = x.shape[0]
        cos, sin = rope.cos_sin(positions, x.dtype)
        q_residual = self.q_a_norm(self.q_a_proj(x))
        q = unweighted_rms_norm(self.q_b_proj(q_residual).view(T, self.num_heads, self.head_dim),
                                self.cfg.rms_norm_eps)
        q = apply_rope(q, cos[:, None], sin[:, None])
        kv = apply_rope(self.kv_norm(self.kv_proj(x)), cos, sin)
        comp = self.compressor
        rows = index_rows = index_q = None
        if comp is not None:
            rows = comp.rows(x, positions)
            if self.layer_type == CSA:
                index_rows = comp.indexer.rows(x, positions)
                index_q = comp.indexer.queries(x, q_residual, cos, sin)
        out = torch.empty_like(q)
        spans = ([(slice(0, meta.num_decode_tokens), None)] if meta.num_decode_tokens else []) + \
            [(slice(p.query_start, p.query_start + p.query_len), p) for p in meta.prefills]
        for sl, p in spans:
            groups = [self._window_keys(kv[sl], positions[sl], state["swa"], meta, p)]
            if comp is not None:
                groups.append(self._compressed_keys(
                    positions[sl], rows[sl], None if index_rows is None else index_rows[sl],
                    None if index_q is None else (index_q[0][sl], index_q[1][sl]), rope, state, meta, p))
            out[sl] = self._attend(q[sl], groups, banded=p is not None)
        o = apply_rope(out, cos[:, None], -sin[:, None]).reshape(T, self.o_groups, -1)
        return tp_all_reduce(self.o_b_proj(grouped_projection(self.o_a_proj, o).flatten(1)), self.parallel)

    def _attend(self, q, groups, banded: bool, query_block: int = 512):
        """q [T, H, D] over key groups (keys, mask [T, L], picks): keys [T, L, D] per query, or [L, D] shared
        by all (K = V), or with picks [T, k] the rows of keys each query takes. The softmax spans every group
        and the sink. `banded`: group 0 is a chunk's window keys (W history rows then the chunk), so query i
        only needs its columns [i, i + W]; queries go in blocks so memory stays linear in the chunk."""
        out = torch.empty_like(q)
        W = self.window
        for i0 in range(0, q.shape[0], query_block):
            i1 = min(i0 + query_block, q.shape[0])
            qb = q[i0:i1]
            logits, values = [], []
            for gi, (keys, mask, picks) in enumerate(groups):
                mask = mask[i0:i1]
                if picks is not None:
                    keys = keys[picks[i0:i1]]
                elif keys.dim() == 3:
                    keys = keys[i0:i1]
                elif gi == 0 and banded:
                    keys, mask = keys[i0:i1 + W], mask[:, i0:i1 + W]
                eq = "thd,tld->thl" if keys.dim() == 3 else "thd,ld->thl"
                lg = torch.einsum(eq, qb, keys).float() * self.scale
                logits.append(lg.masked_fill(~mask[:, None, :], float("-inf")))
                values.append(keys)
            logits.append(self.sinks.float()[None, :, None].expand(i1 - i0, -1, 1))
            probs = torch.cat(logits, dim=-1).softmax(dim=-1)
            acc, col = 0, 0
            for keys in values:
                n = keys.shape[-2]
                pr = probs[..., col:col + n].to(keys.dtype)
                acc = acc + torch.einsum("thl,tld->thd" if keys.dim() == 3 else "thl,ld->thd", pr, keys)
                col += n
            out[i0:i1] = acc
        return out

    def _window_keys(self, kv, positions, ring, meta, p):
        """Sliding-window keys and mask; stores the new keys in the ring (after reading what a chunk needs)."""
        W, dev, R = self.window, kv.device, ring.shape[1]               # R = W + rollback_rows
        if p is None:                                                   # decode rows: [B, R, D] each
            slots = meta.decode_state_slots
            ring[slots, positions % R] = kv.to(ring.dtype)
            # the position each row holds; a row a rejected draft wrote reads as R before it: out of the window
            kpos = positions[:, None] - (positions[:, None] - torch.arange(R, device=dev)) % R
            return ring[slots], (kpos >= 0) & (kpos > positions[:, None] - W), None
        ring = ring[p.state_slot]                                       # one chunk: [1, W + n, D] shared
        hist = torch.arange(p.context_len - p.query_len - W, p.context_len - p.query_len, device=dev)
        keys = torch.cat((ring[hist % R], kv.to(ring.dtype)))
        kpos = torch.cat((hist, positions))[None, :]
        mask = (kpos <= positions[:, None]) & (kpos > positions[:, None] - W) & (kpos >= 0)
        keep = min(len(kv), R)
        ring[positions[-keep:] % R] = kv[-keep:].to(ring.dtype)
        return keys, mask, None

    def _compressed_keys(self, positions, rows, index_rows, index_q, rope, state, meta, p):
        comp, r = self.compressor, self.ratio
        cache = state["kv"]
        epb = cache.shape[1]
        num_closed = (positions + 1) // r
        if p is None:
            tables, slots = meta.decode_block_tables, meta.decode_state_slots
            if self.layer_type == HCA:      # (a recurrence over positions: a verify step's rows need their offsets)
                comp.close_decode(state["rows"], cache, rows, positions, slots, tables, rope, meta.decode_row_offsets)
            else:
                comp.close_decode(state["rows"], cache, rows, positions, slots, tables, rope)
            n = max(meta.max_decode_context_len // r, 1)
            flat = entry_index(tables, torch.arange(n, device=positions.device).expand(len(positions), -1), epb)
        else:
            comp.close_chunk(state["rows"][p.state_slot], cache, rows, positions, rope, p)
            n = max(p.context_len // r, 1)
            flat = entry_index(p.block_ids, torch.arange(n, device=positions.device), epb)
        if self.layer_type == HCA:
            entries = torch.arange(n, device=positions.device)
            return cache.view(-1, self.head_dim)[flat], entries[None, :] < num_closed[:, None], None
        indexer = comp.indexer
        if p is None:
            indexer.close_decode(state["index_rows"], state["index"], index_rows, positions, slots, tables, rope)
        else:
            indexer.close_chunk(state["index_rows"][p.state_slot], state["index"], index_rows, positions, rope, p)
        ikeys = state["index"].view(-1, indexer.dim)[flat]
        picked, valid = indexer.select(*index_q, ikeys if ikeys.dim() == 3 else ikeys[None], num_closed)
        if p is None:
            return cache.view(-1, self.head_dim)[flat.gather(1, picked)], valid, None
        return cache.view(-1, self.head_dim)[flat], valid, picked


def grouped_projection(proj: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """x [T, g, K] through a block-diagonal projection: group i uses rows [i*N/g, (i+1)*N/g) of the weight."""
    if hasattr(proj, "forward_groups"):        # a quantized weight computes per group through its kernel
        return proj.forward_groups(x)
    w = proj.weight.view(x.shape[1], -1, proj.weight.shape[1])
    return torch.einsum("tgi,gri->tgr", x, w)


# ---- MoE ----------------------------------------------------------------------------------------------
class SharedExpert(nn.Module):
    def __init__(self, hidden: int, inter: int, limit: float):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)
        self.limit = limit

    def forward(self, x):
        gate = self.gate_proj(x).clamp(max=self.limit)
        up = self.up_proj(x).clamp(min=-self.limit, max=self.limit)
        return self.down_proj(F.silu(gate) * up)


class Router(nn.Module):
    """sqrt(softplus) scores; experts from a frozen token->experts table (hash) or the top-k of scores plus
    a correction bias (learned); the chosen scores, renormalized and scaled, weight the experts."""

    def __init__(self, cfg: DeepseekV4Config, hashed: bool):
        super().__init__()
        self.top_k, self.scaling, self.hashed = cfg.num_experts_per_tok, cfg.routed_scaling_factor, hashed
        self.weight = nn.Parameter(torch.zeros(cfg.n_routed_experts, cfg.hidden_size))
        if hashed:
            self.register_buffer("tid2eid", torch.zeros(cfg.vocab_size, self.top_k, dtype=torch.long))
        else:
            self.register_buffer("e_score_correction_bias", torch.zeros(cfg.n_routed_experts))

    def forward(self, x, input_ids):
        scores = F.softplus(F.linear(x, self.weight)).sqrt()
        if self.hashed:
            experts = self.tid2eid[input_ids].long()
        else:
            experts = torch.topk(scores + self.e_score_correction_bias, self.top_k, dim=-1).indices
        weights = scores.gather(1, experts)
        return experts, weights / (weights.sum(-1, keepdim=True) + 1e-20) * self.scaling


class Experts(nn.Module):
    """Routed experts as stacked weights [E, 2I, H] / [E, H, I]: a grouped GEMM over expert-sorted rows on
    CUDA (no host sync), a loop over the experts hit elsewhere."""

    def __init__(self, cfg: DeepseekV4Config, ops: LayerOps = TORCH_OPS, num_slots: int | None = None,
                 inter: int | None = None):
        """`num_slots`: expert slots this rank holds (expert parallelism); None: all routed experts.
        `inter`: this rank's slice of moe_intermediate_size (tensor parallelism); None: all of it."""
        super().__init__()
        E, H, inter = num_slots or cfg.n_routed_experts, cfg.hidden_size, inter or cfg.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.zeros(E, 2 * inter, H))
        self.down_proj = nn.Parameter(torch.zeros(E, H, inter))
        self.limit, self.ops = cfg.swiglu_limit, ops

    def _act(self, gate_up):
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate.clamp(max=self.limit)) * up.clamp(min=-self.limit, max=self.limit)

    @property
    def grouped(self) -> bool:
        return self.gate_up_proj.is_cuda and self.gate_up_proj.dtype == torch.bfloat16

    def expert_linear(self, x, name: str, e: int):
        return F.linear(x, getattr(self, name)[e])

    def grouped_mm(self, rows, name: str, offs):
        return torch._grouped_mm(rows, getattr(self, name).transpose(1, 2), offs=offs)

    def forward(self, x, experts, weights):
        """x [T, H], experts [T, k] slot ids (-1: not computed here, expert parallelism), weights [T, k]."""
        if self.grouped:
            return self._grouped(x, experts, weights)
        out = torch.zeros_like(x)
        for e in experts.unique().tolist():
            if e < 0:
                continue
            tok, k = torch.where(experts == e)
            h = self._act(self.expert_linear(x[tok], "gate_up_proj", e))
            out.index_add_(0, tok, (self.expert_linear(h, "down_proj", e) * weights[tok, k, None]).to(x.dtype))
        return out

    def _grouped(self, x, experts, weights):
        T, k = experts.shape
        n = self.gate_up_proj.shape[0]
        flat = experts.flatten()
        skip = flat < 0                      # other ranks' experts: sorted last, past the final offset
        flat = torch.where(skip, n, flat)
        order = flat.argsort(stable=True)
        counts = torch.zeros(n + 1, dtype=torch.int32, device=x.device)
        offs = counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32)).cumsum(0, dtype=torch.int32)[:n]
        rows = x[order // k]
        h = self._act(self.grouped_mm(rows, "gate_up_proj", offs))
        y = self.grouped_mm(h, "down_proj", offs)
        y = y * weights.flatten()[order, None].to(y.dtype)
        y = torch.where(skip[order, None], 0, y)    # rows past the last offset hold whatever memory held
        return torch.zeros_like(x).index_add_(0, order // k, y)


class QuantizedExperts(Experts):
    """Routed experts kept as published (MXFP4, or block FP8 in older conversions): `<name>` holds the
    stored values and `<name>_scale` the E8M0 scales; GEMMs go through `LayerOps.grouped_gemm` (weights
    dequantized in registers on CUDA), the CPU loop dequantizes one expert at a time (the reference)."""

    def __init__(self, cfg: DeepseekV4Config, fmt: str, block: int, ops: LayerOps = TORCH_OPS,
                 num_slots: int | None = None, inter: int | None = None):
        nn.Module.__init__(self)
        E, H, inter = num_slots or cfg.n_routed_experts, cfg.hidden_size, inter or cfg.moe_intermediate_size
        if fmt == "fp8" and inter % block:
            raise ValueError(f"block-FP8 experts need moe_intermediate_size ({inter}) divisible by the block "
                             f"size {block} (w1 and w3 are stacked)")
        self.gate_up_proj, self.gate_up_proj_scale = stored_parameters((E, 2 * inter, H), fmt, block)
        self.down_proj, self.down_proj_scale = stored_parameters((E, H, inter), fmt, block)
        self.fmt, self.block, self.limit, self.ops = fmt, block, cfg.swiglu_limit, ops

    @property
    def grouped(self) -> bool:
        return self.gate_up_proj.is_cuda

    def expert_linear(self, x, name: str, e: int):
        offs = torch.full((1,), x.shape[0], dtype=torch.int32)
        w, s = getattr(self, name), getattr(self, name + "_scale")
        return reference_grouped_gemm(x, offs, w[e:e + 1], s[e:e + 1], self.fmt, self.block)

    def grouped_mm(self, rows, name: str, offs):
        return self.ops.grouped_gemm(rows, offs, getattr(self, name), getattr(self, name + "_scale"), self.fmt,
                                     self.block)


class MoE(nn.Module):
    """Router -> routed experts (+ the shared expert). With expert parallelism this rank holds some of the
    experts' slots: every rank's tokens are exchanged (distributed/expert_parallel.py), each rank computes
    its slots' share and the shares are summed back onto each token's rank.

    With tensor parallelism instead (no expert parallelism), every rank holds every expert's slice
    [r*I/tp, (r+1)*I/tp) of the intermediate dimension (w1 and w3 rows, w2 columns), and so of the shared
    expert; the router is replicated (every rank routes the same tokens identically), each rank computes
    its partial sums of routed and shared outputs and one all-reduce adds them."""

    def __init__(self, cfg: DeepseekV4Config, hashed: bool, ops: LayerOps = TORCH_OPS,
                 parallel: ParallelContext | None = None, ep_layout: tuple[int, int] | None = None):
        super().__init__()
        self.parallel = parallel or ParallelContext.single()
        self.gate = Router(cfg, hashed)
        slots = None
        if ep_layout is not None:            # (slots per rank, most replicas one expert can have)
            slots, max_replicas = ep_layout
            self.routing = ExpertRouting(cfg.n_routed_experts, max_replicas, slots, self.parallel.ep_rank)
        tp = self.parallel.tp_size
        self.experts = Experts(cfg, ops, slots, cfg.moe_intermediate_size // tp)
        self.shared_experts = SharedExpert(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts // tp,
                                           cfg.swiglu_limit)

    def forward(self, x, input_ids, meta: AttentionMetadata | None = None):
        experts, weights = self.gate(x, input_ids)
        if self.parallel.ep_size == 1:     # (tensor parallelism: partial sums, one all-reduce)
            return tp_all_reduce(self.experts(x, experts, weights) + self.shared_experts(x), self.parallel)
        return (expert_parallel_moe(x, experts, weights, self.routing, self.experts, meta, self.parallel)
                + self.shared_experts(x))


# ---- mHC ----------------------------------------------------------------------------------------------
class HyperConnection(nn.Module):
    """Manifold-constrained hyper-connection: from the n residual streams, weights to collapse them into
    the block input (pre), to spread the block output back (post), and an n x n stream mix projected onto
    doubly-stochastic matrices by Sinkhorn iterations (comb). Float32 throughout, as the reference."""

    def __init__(self, cfg: DeepseekV4Config, ops: LayerOps = TORCH_OPS):
        super().__init__()
        n = self.n = cfg.hc_mult
        self.iters, self.eps, self.norm_eps = cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps
        self.ops = ops
        self.fn = nn.Parameter(torch.zeros((2 + n) * n, n * cfg.hidden_size))
        self.base = nn.Parameter(torch.zeros((2 + n) * n))
        self.scale = nn.Parameter(torch.ones(3))

    def forward(self, streams):
        """streams [T, n, H] -> (post [T, n], comb [T, n, n], collapsed block input [T, H])."""
        mixes = F.linear(unweighted_rms_norm(streams.flatten(1).float(), self.norm_eps), self.fn.float())
        pre, post, comb = self.ops.hc_weights(mixes, self.base, self.scale, self.n, self.iters, self.eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(1).to(streams.dtype)
        return post, comb, collapsed

    @staticmethod
    def merge(streams, out, post, comb):
        """post * block output + comb^T @ streams (comb mixes over its first axis)."""
        dtype = streams.dtype
        return post.to(dtype).unsqueeze(-1) * out.unsqueeze(1) + torch.matmul(comb.to(dtype).transpose(-1, -2),
                                                                                streams)


class HyperHead(nn.Module):
    """The final collapse of the n streams into one hidden vector."""

    def __init__(self, cfg: DeepseekV4Config):
        super().__init__()
        self.eps, self.norm_eps = cfg.hc_eps, cfg.rms_norm_eps
        self.hc_fn = nn.Parameter(torch.zeros(cfg.hc_mult, cfg.hc_mult * cfg.hidden_size))
        self.hc_base = nn.Parameter(torch.zeros(cfg.hc_mult))
        self.hc_scale = nn.Parameter(torch.ones(1))

    def forward(self, streams):
        mixes = F.linear(unweighted_rms_norm(streams.flatten(1).float(), self.norm_eps), self.hc_fn.float())
        pre = torch.sigmoid(mixes * self.hc_scale.float() + self.hc_base.float()) + self.eps
        return (pre.unsqueeze(-1) * streams).sum(1).to(streams.dtype)


# ---- decoder layer and model --------------------------------------------------------------------------
class DeepseekV4DecoderLayer(nn.Module):
    def __init__(self, cfg: DeepseekV4Config, layer_type: str, mlp_type: str, ops: LayerOps = TORCH_OPS,
                 **moe_kwargs):
        super().__init__()
        self.self_attn = DeepseekV4Attention(cfg, layer_type, moe_kwargs.get("parallel"))
        self.mlp = MoE(cfg, mlp_type == "hash_moe", ops, **moe_kwargs)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn_hc = HyperConnection(cfg, ops)
        self.ffn_hc = HyperConnection(cfg, ops)

    def forward(self, streams, input_ids, positions, rope, state, meta):
        post, comb, h = self.attn_hc(streams)
        streams = HyperConnection.merge(streams, self.self_attn(self.input_layernorm(h), positions, rope, state, meta),
                                        post, comb)
        post, comb, h = self.ffn_hc(streams)
        return HyperConnection.merge(streams, self.mlp(self.post_attention_layernorm(h), input_ids, meta), post, comb)


MTP_INPUT = "mtp_input"          # the key `captured` keeps the MTP heads' input under


class MTPLayer(nn.Module):
    """Multi-token prediction head (`mtp.{i}.*`): embeds the next token, mixes it with the main model's
    hidden state (post hc_head, pre final norm), runs one sliding-window decoder block and its own hc_head
    and norm; the embedding and lm_head are the main model's. The `mtp` drafter (spec_decode/mtp.py) chains
    it for several drafts."""

    def __init__(self, cfg: DeepseekV4Config, ops: LayerOps = TORCH_OPS, **moe_kwargs):
        super().__init__()
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.e_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False)
        self.h_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False)
        self.layer = DeepseekV4DecoderLayer(cfg, SLIDING, "moe", ops, **moe_kwargs)
        self.hc_head = HyperHead(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


# parameters the reference keeps in float32 whatever the model dtype
_FP32_SUFFIXES = ("_hc.fn", "_hc.base", "_hc.scale", "hc_head.hc_fn", "hc_head.hc_base", "hc_head.hc_scale",
                  "sinks", "position_bias", "norm.weight")


class DeepseekV4ForCausalLM(nn.Module):
    # decode gathers compressed entries up to max_decode_context_len: one graph per context bucket
    decode_graph_context_buckets = True

    @property
    def supports_cuda_graphs(self) -> bool:
        """Graph capture needs the host-sync-free expert path (grouped GEMM: bf16 on CUDA)."""
        return self.lm_head.weight.dtype == torch.bfloat16

    def __init__(self, cfg: DeepseekV4Config, ops: LayerOps = TORCH_OPS, parallel: ParallelContext | None = None):
        """`ops`: the small fused kernels (here the mHC weights), chosen once by the runtime; `parallel`:
        this rank's place (with expert parallelism, which routed experts it holds)."""
        super().__init__()
        self.config, self.ops = cfg, ops
        self.parallel = parallel or ParallelContext.single()
        # vocabulary-parallel with tensor parallelism (rows of this rank's shard; exactly nn.Embedding without)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, self.parallel)
        rd, mp = cfg.rope_head_dim, cfg.max_position_embeddings
        self.ropes = nn.ModuleDict({"main": InterleavedRope(cfg.main_rope, rd, mp),
                                    "compress": InterleavedRope(cfg.compress_rope, rd, mp)})
        moe_kwargs = {"parallel": self.parallel}
        self.expert_placement = None
        layout = initial_layout(cfg.num_hidden_layers + cfg.num_nextn_predict_layers, cfg.n_routed_experts,
                                self.parallel)
        if layout is not None:              # this rank's expert slots, first as a plain checkpoint split
            self.expert_placement, moe_kwargs["ep_layout"] = layout
        self.layers = nn.ModuleList(DeepseekV4DecoderLayer(cfg, t, m, ops, **moe_kwargs)
                                    for t, m in zip(cfg.layer_types, cfg.mlp_layer_types))
        self.hc_head = HyperHead(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        # logits shards all-gathered: every TP rank samples from the same full logits (nn.Linear without TP)
        self.lm_head = ParallelLMHead(cfg.hidden_size, cfg.vocab_size, self.parallel)
        self.mtp = nn.ModuleList(MTPLayer(cfg, ops, **moe_kwargs) for _ in range(cfg.num_nextn_predict_layers))
        # opt-in (the `mtp` drafter): `forward` keeps the MTP heads' input, forward_streams' output of every row,
        # in `captured[MTP_INPUT]`
        self.capture_layers: tuple[str, ...] = ()
        self.captured: dict[str, torch.Tensor] = {}
        # which index of each cache kind a layer uses
        self._state_index = []
        counts = {CSA: 0, HCA: 0}
        for t in cfg.layer_types:
            self._state_index.append(counts.get(t))
            if t in counts:
                counts[t] += 1

    def cast(self, dtype: torch.dtype) -> "DeepseekV4ForCausalLM":
        """Cast to `dtype`, keeping the reference's float32 parameters (mHC, sinks, norms, biases) in float32."""
        self.to(dtype)
        for name, p in self.named_parameters():
            if name.endswith(_FP32_SUFFIXES):
                p.data = p.data.float()
        for name, b in self.named_buffers():
            if name.endswith("e_score_correction_bias") or name.endswith("inv_freq"):
                b.data = b.data.float()
        return self

    def cache_specs(self, dtype: torch.dtype, rollback_rows: int = 0) -> list[CacheSpec]:
        """`rollback_rows`: room each per-request state keeps for rejected drafts (EngineConfig.rollback_rows):
        the rings grow by that many rows, the HCA running state keeps one per position."""
        c, E = self.config, rollback_rows
        L, D, Di = c.num_hidden_layers, c.head_dim, c.index_head_dim
        n_csa, n_hca = len(c.layers_of(CSA)), len(c.layers_of(HCA))
        r_csa, r_hca = c.compress_rates[CSA], c.compress_rates[HCA]
        specs: list[CacheSpec] = [RequestStateSpec("swa", L, (c.sliding_window + E, D), dtype)]
        if n_csa:
            specs += [PagedCacheSpec("csa_kv", n_csa, (D,), dtype, r_csa),
                      PagedCacheSpec("csa_index", n_csa, (Di,), dtype, r_csa),
                      RequestStateSpec("csa_rows", n_csa, (2 * r_csa + E, 4 * D), torch.float32),
                      RequestStateSpec("csa_index_rows", n_csa, (2 * r_csa + E, 4 * Di), torch.float32)]
        if n_hca:
            specs += [PagedCacheSpec("hca_kv", n_hca, (D,), dtype, r_hca),
                      RequestStateSpec("hca_state", n_hca, (1 + E, 3, D), torch.float32,
                                       needed_at_block_boundary=False)]
        if len(self.mtp):
            specs.append(RequestStateSpec("mtp_swa", len(self.mtp), (c.sliding_window + E, D), dtype))
        return specs

    def layer_state(self, caches: dict, i: int) -> dict:
        t, j = self.config.layer_types[i], self._state_index[i]
        state = {"swa": caches["swa"][i]}
        if t == CSA:
            state.update(kv=caches["csa_kv"][j], rows=caches["csa_rows"][j], index=caches["csa_index"][j],
                         index_rows=caches["csa_index_rows"][j])
        elif t == HCA:
            state.update(kv=caches["hca_kv"][j], rows=caches["hca_state"][j])
        return state

    def _rope_for(self, layer_type: str) -> InterleavedRope:
        return self.ropes["main" if layer_type == SLIDING else "compress"]

    def forward_streams(self, input_ids, positions, caches, meta) -> torch.Tensor:
        """The hc_head output (pre final norm) [T, hidden]: what the MTP heads read."""
        streams = self.embed_tokens(input_ids).unsqueeze(1).expand(-1, self.config.hc_mult, -1).contiguous()
        for i, layer in enumerate(self.layers):
            streams = layer(streams, input_ids, positions, self._rope_for(self.config.layer_types[i]),
                            self.layer_state(caches, i), meta)
        return self.hc_head(streams)

    def forward(self, input_ids, positions, caches, meta) -> torch.Tensor:
        hidden = self.forward_streams(input_ids, positions, caches, meta)
        if self.capture_layers:
            self.captured = {MTP_INPUT: hidden}
        return self.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)

    def mtp_hidden(self, k: int, prev_hidden, next_ids, positions, caches, meta) -> torch.Tensor:
        """MTP head k's hidden state (its hc_head output, pre norm) for the token after `next_ids` at
        `positions`, from the main model's hidden states at the positions before (`prev_hidden`, from
        forward_streams; a chained draft passes this function's own output); uses its own sliding-window
        state (`mtp_swa`)."""
        m = self.mtp[k]
        x = m.e_proj(m.enorm(self.embed_tokens(next_ids))) + m.h_proj(m.hnorm(prev_hidden))
        streams = x.unsqueeze(1).expand(-1, self.config.hc_mult, -1).contiguous()
        streams = m.layer(streams, next_ids, positions, self.ropes["main"], {"swa": caches["mtp_swa"][k]}, meta)
        return m.hc_head(streams)

    def mtp_head(self, k: int, hidden: torch.Tensor) -> torch.Tensor:
        """Logits from MTP head k's hidden state (its norm, then the shared lm_head)."""
        return self.lm_head(self.mtp[k].norm(hidden))

    def mtp_logits(self, k: int, prev_hidden, next_ids, positions, caches, meta) -> torch.Tensor:
        """Logits of MTP head k for the token after `next_ids` (mtp_hidden, then mtp_head)."""
        return self.mtp_head(k, self.mtp_hidden(k, prev_hidden, next_ids, positions, caches, meta))

    def quantize(self, formats: dict[str, str], block: int) -> None:
        """Give the modules named in `formats` ("fp8" | "mxfp4") stored-format weights; called on the meta
        model before allocation, so memory is only ever taken in the published formats."""
        for name, fmt in formats.items():
            parent_name, _, child = name.rpartition(".")
            parent = self.get_submodule(parent_name)
            module = getattr(parent, child)
            if isinstance(module, Experts):
                with torch.device(module.gate_up_proj.device):
                    new = QuantizedExperts(self.config, fmt, block, self.ops, num_slots=module.gate_up_proj.shape[0],
                                           inter=module.down_proj.shape[-1])
            elif name == "lm_head" and self.config.tie_word_embeddings:
                raise ValueError("the checkpoint stores lm_head quantized but the config ties it to the "
                                 "(bf16) embedding: tie_word_embeddings must be false for a quantized head")
            elif name == "lm_head" and self.parallel.tp_size > 1:
                raise ValueError("the checkpoint stores lm_head quantized: not supported with "
                                 "tensor_parallel_size > 1 (the vocabulary-parallel head is bf16/float)")
            elif isinstance(module, nn.Linear) and fmt == "fp8":
                new = to_fp8_linear(module, block, self.ops, parent.o_groups if child == "o_a_proj" else 1)
            else:
                raise ValueError(f"{name} cannot hold {fmt} weights")
            setattr(parent, child, new)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], dry_run: bool = False) -> None:
        """Tensors named as transformers' modules or as the upstream checkpoint (what `save_pretrained`
        writes: `attn.wq_a`, `ffn.experts.{e}.w1`, `hc_attn_fn`, ...; renamed by transformers' own rules,
        see `native_to_hf`); `mtp.{k}.*` for the MTP heads; quantized weights as stored with their scales
        named `<weight>_scale` (the loader's canonical name for `.scale` / `.weight_scale_inv`). Every
        parameter and routing buffer must be covered exactly once. A checkpoint without MTP tensors
        (transformers drops them) drops the heads. `dry_run`: check names and shapes only (meta tensors
        are fine), before anything is allocated."""
        params = dict(self.named_parameters())
        params.update({n: b for n, b in self.named_buffers() if n.endswith(("tid2eid", "e_score_correction_bias"))})
        n_experts = self.config.n_routed_experts
        local_slots = None
        if self.expert_placement is not None:    # expert e -> the slots of this rank that hold it
            local_slots = checkpoint_slots(self.expert_placement, self.parallel.ep_rank)
            local_logical = self.expert_placement.local_logical(self.parallel.ep_rank)[0]
        loaded = set()
        for name, tensor in weights:
            name, part = native_to_hf(name)
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue
            if name not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no place in DeepseekV4ForCausalLM")
            dst = params[name].data
            key = name
            dsts = [dst]
            if (part is None and local_slots is not None and ".experts." in name and tensor.dim() == 3
                    and tensor.shape[0] == n_experts):   # stacked experts (transformers' layout): this rank's
                tensor = tensor[local_logical]
            if part is not None:            # one expert's w1 / w3 / w2 (or its scale) of a stacked parameter
                e, w = part
                if e >= n_experts:
                    raise ValueError(f"checkpoint expert {e} of {name!r} is beyond n_routed_experts={n_experts}")
                half = dst.shape[1] // 2
                slots = [e] if local_slots is None else local_slots.get(e, [])   # EP: this rank's copies
                dsts = [dst[i] if w == "w2" else dst[i, :half] if w == "w1" else dst[i, half:] for i in slots]
                key = f"{name}#{e}.{w}"
            if self.parallel.tp_size > 1:    # tensor parallelism: this rank's slice (weights and their scales)
                tensor = self._tp_shard(name, part, tensor, dsts[0] if dsts else None, key)
            stored_raw = tensor.dtype in (torch.float8_e4m3fn, torch.float8_e8m0fnu, torch.int8, torch.uint8)
            for dst in dsts:
                if stored_raw and dst.dtype.is_floating_point and dst.dtype.itemsize > 1:
                    raise ValueError(f"checkpoint tensor {key!r} is stored {tensor.dtype} but its place holds "
                                     f"{dst.dtype}: quantized weights are never read as plain floats")
                if dst.dtype.itemsize == 1 and not stored_raw:
                    raise ValueError(f"checkpoint tensor {key!r} is stored {tensor.dtype} but the other tensors "
                                     f"of its module are quantized ({dst.dtype}): one module, one format")
                if tuple(dst.shape) != tuple(tensor.shape):
                    raise ValueError(f"checkpoint tensor {key!r} has shape {tuple(tensor.shape)}, "
                                     f"expected {tuple(dst.shape)}")
                if not dry_run:
                    dst.copy_(tensor.view(dst.dtype) if stored_raw and tensor.dtype.itemsize == 1 == dst.dtype.itemsize
                              else tensor.to(dst.dtype))
            loaded.add(key)
        if len(self.mtp) and not any(n.startswith("mtp.") for n in loaded):
            self.mtp = nn.ModuleList()
        expected = set()
        for n in (*dict(self.named_parameters()), *[b for b in dict(self.named_buffers())
                                                     if b.endswith(("tid2eid", "e_score_correction_bias"))]):
            if n.endswith(("experts.gate_up_proj", "experts.gate_up_proj_scale")) and n not in loaded:
                expected |= {f"{n}#{e}.{w}" for e in range(n_experts) for w in ("w1", "w3")}
            elif n.endswith(("experts.down_proj", "experts.down_proj_scale")) and n not in loaded:
                expected |= {f"{n}#{e}.w2" for e in range(n_experts)}
            else:
                expected.add(n)
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
            expected.discard("lm_head.weight")
        missing = sorted(expected - loaded)
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensor(s), e.g. {missing[:5]}")

    def _tp_shard(self, name: str, part, tensor: torch.Tensor, dst: torch.Tensor | None, key: str) -> torch.Tensor:
        """This TP rank's slice of full checkpoint tensor `tensor` (our name `name`, one expert's `part`),
        for a parameter slice shaped `dst`. A quantized weight and its scale are cut along the same
        dimension at the same fraction: FP8 scales hold one value per block x block tile, MXFP4 scales one
        per 32 values along K and its bytes two values each, so slice i of the weight is slice i of its
        bytes and of its scales when the cut falls on a block (checked at start-up, check_tensor_parallel;
        a full size that is not tp x the local one is refused here)."""
        if dst is None:
            return tensor
        if part is not None:
            dim = 1 if part[1] == "w2" else 0
        else:
            dim = _tp_shard_dim(name)
            if dim is None:
                return tensor
            if name.endswith(("experts.gate_up_proj", "experts.gate_up_proj_scale")):   # stacked [E, 2I, H]
                gate, up = tensor.chunk(2, dim=1)
                half = dst.shape[1] // 2
                return torch.cat((self._tp_narrow(gate, 1, half, key), self._tp_narrow(up, 1, half, key)), dim=1)
        return self._tp_narrow(tensor, dim, dst.shape[dim], key)

    def _tp_narrow(self, tensor: torch.Tensor, dim: int, local: int, key: str) -> torch.Tensor:
        tp, rank = self.parallel.tp_size, self.parallel.tp_rank
        if tensor.dim() <= dim or tensor.shape[dim] != local * tp:
            raise ValueError(f"checkpoint tensor {key!r} has shape {tuple(tensor.shape)}: dimension {dim} should be "
                             f"tensor_parallel_size ({tp}) x {local} (this rank's slice)")
        return tensor.narrow(dim, rank * local, local)


# tensor parallelism: which dimension of a (non-expert-slice) parameter is split over the TP ranks
_TP_SPLIT = [(re.compile(a), d) for a, d in (
    (r"^embed_tokens\.weight$", 0), (r"^lm_head\.weight$", 0),
    (r"\.self_attn\.q_b_proj\.weight(_scale)?$", 0), (r"\.self_attn\.sinks$", 0),
    (r"\.self_attn\.o_a_proj\.weight(_scale)?$", 0), (r"\.self_attn\.o_b_proj\.weight(_scale)?$", 1),
    (r"\.shared_experts\.(gate|up)_proj\.weight(_scale)?$", 0), (r"\.shared_experts\.down_proj\.weight(_scale)?$", 1),
    (r"\.experts\.gate_up_proj(_scale)?$", 1), (r"\.experts\.down_proj(_scale)?$", 2))]


def _tp_shard_dim(name: str) -> int | None:
    for pattern, dim in _TP_SPLIT:
        if pattern.search(name):
            return dim
    return None


# transformers' renaming of the upstream checkpoint (conversion_mapping.py, "deepseek_v4"), in its order
_NATIVE_RENAMES = [(re.compile(a), b) for a, b in (
    (r"\.attn\.", ".self_attn."), (r"\.ffn\.", ".mlp."), (r"\.indexer\.compressor\.", ".compressor.indexer."),
    (r"^embed\.weight", "embed_tokens.weight"), (r"^head\.weight", "lm_head.weight"),
    (r"^hc_head_fn", "hc_head.hc_fn"), (r"^hc_head_base", "hc_head.hc_base"), (r"^hc_head_scale", "hc_head.hc_scale"),
    (r"\.attn_norm\.", ".input_layernorm."), (r"\.ffn_norm\.", ".post_attention_layernorm."),
    (r"\.hc_attn_fn", ".attn_hc.fn"), (r"\.hc_attn_base", ".attn_hc.base"), (r"\.hc_attn_scale", ".attn_hc.scale"),
    (r"\.hc_ffn_fn", ".ffn_hc.fn"), (r"\.hc_ffn_base", ".ffn_hc.base"), (r"\.hc_ffn_scale", ".ffn_hc.scale"),
    (r"\.attn_sink", ".sinks"), (r"\.indexer\.weights_proj\.", ".compressor.indexer.scorer.weights_proj."),
    (r"\.indexer\.wq_b\.", ".compressor.indexer.q_b_proj."), (r"\.norm\.", ".kv_norm."), (r"\.ape", ".position_bias"),
    (r"\.wq_a\.", ".q_a_proj."), (r"\.self_attn\.wq_b\.", ".self_attn.q_b_proj."), (r"\.wkv\.", ".kv_proj."),
    (r"\.wgate\.", ".gate_proj."), (r"\.wo_a\.", ".o_a_proj."), (r"\.wo_b\.", ".o_b_proj."),
    (r"\.q_norm\.", ".q_a_norm."), (r"\.gate\.bias", ".gate.e_score_correction_bias"),
    (r"\.shared_experts\.w1\.", ".shared_experts.gate_proj."), (r"\.shared_experts\.w2\.", ".shared_experts.down_proj."),
    (r"\.shared_experts\.w3\.", ".shared_experts.up_proj."))]
_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(w1|w2|w3)\.weight(_scale)?$")
_MTP_OWN = ("enorm.", "hnorm.", "e_proj.", "h_proj.", "norm.", "hc_head")


def native_to_hf(name: str) -> tuple[str, tuple[int, str] | None]:
    """Our parameter name for a checkpoint tensor name, and (expert, w1|w2|w3) for one expert's slice."""
    name = name.removeprefix("model.")
    prefix = ""
    if name.startswith("mtp."):          # mtp.{k}.<a decoder block's names, or the head's own>
        k, rest = name.split(".", 2)[1:]
        if not rest.startswith(("layer.", *_MTP_OWN)):
            rest = "layer." + rest
        prefix, name = f"mtp.{k}.", rest
        if name.startswith("layer."):
            prefix, name = prefix + "layer", name[len("layer"):]
    for pattern, repl in _NATIVE_RENAMES:
        name = pattern.sub(repl, name)
    name = prefix + name
    m = _EXPERT.match(name)
    if m:
        stacked = m.group(1) + (".down_proj" if m.group(3) == "w2" else ".gate_up_proj") + (m.group(4) or "")
        return stacked, (int(m.group(2)), m.group(3))
    return name, None


# the inverse: our parameter name -> the upstream checkpoint's (for writing checkpoints in the published layout)
_HF_TO_NATIVE = [(re.compile(a), b) for a, b in (
    (r"^embed_tokens\.weight$", "embed.weight"), (r"^lm_head\.weight$", "head.weight"),
    (r"(^|\.)hc_head\.hc_(fn|base|scale)$", r"\1hc_head_\2"),
    (r"\.input_layernorm\.", ".attn_norm."), (r"\.post_attention_layernorm\.", ".ffn_norm."),
    (r"\.(attn|ffn)_hc\.(fn|base|scale)$", r".hc_\1_\2"),
    (r"\.compressor\.indexer\.scorer\.weights_proj\.", ".indexer.weights_proj."),
    (r"\.compressor\.indexer\.q_b_proj\.", ".indexer.wq_b."), (r"\.compressor\.indexer\.", ".indexer.compressor."),
    (r"\.compressor\.kv_norm\.", ".compressor.norm."), (r"\.compressor\.kv_proj\.", ".compressor.wkv."),
    (r"\.compressor\.gate_proj\.", ".compressor.wgate."), (r"\.compressor\.position_bias$", ".compressor.ape"),
    (r"\.self_attn\.", ".attn."), (r"\.attn\.q_a_proj\.", ".attn.wq_a."), (r"\.attn\.q_b_proj\.", ".attn.wq_b."),
    (r"\.attn\.kv_proj\.", ".attn.wkv."), (r"\.attn\.o_a_proj\.", ".attn.wo_a."), (r"\.attn\.o_b_proj\.", ".attn.wo_b."),
    (r"\.attn\.q_a_norm\.", ".attn.q_norm."), (r"\.attn\.sinks$", ".attn.attn_sink"), (r"\.mlp\.", ".ffn."),
    (r"\.gate\.e_score_correction_bias$", ".gate.bias"), (r"\.shared_experts\.gate_proj\.", ".shared_experts.w1."),
    (r"\.shared_experts\.down_proj\.", ".shared_experts.w2."), (r"\.shared_experts\.up_proj\.", ".shared_experts.w3."),
    (r"^mtp\.(\d+)\.layer\.", r"mtp.\1."))]

# which upstream tensors DeepSeek publishes in FP8 (block-scaled); routed experts follow `expert_dtype`;
# float32 ones; everything else (embeddings, head, norms, router, compressors, indexer weights_proj) is bf16
_PUBLISHED_FP8 = re.compile(r"(\.attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|\.attn\.indexer\.wq_b|\.shared_experts\.w[123]"
                            r"|^mtp\.\d+\.(e_proj|h_proj))\.weight$")
_PUBLISHED_FP32 = re.compile(r"(hc_(attn|ffn|head)_(fn|base|scale)|\.attn_sink|\.ape|\.gate\.bias)$")


def hf_to_native(name: str) -> str:
    """The upstream checkpoint's name of one of our (non-expert) tensors; `native_to_hf` inverts it."""
    for pattern, repl in _HF_TO_NATIVE:
        name = pattern.sub(repl, name)
    return name


def published_dtype(native_name: str, expert_fmt: str | None) -> str:
    """"fp8" | "mxfp4" | "fp32" | "bf16" | "int": how DeepSeek publishes an upstream tensor; `expert_fmt`
    None means a bf16 checkpoint (nothing quantized)."""
    if native_name.endswith("tid2eid"):
        return "int"
    if _PUBLISHED_FP32.search(native_name):
        return "fp32"
    if expert_fmt is not None:
        if native_to_hf(native_name)[1] is not None:      # one routed expert's w1 / w2 / w3
            return expert_fmt
        if _PUBLISHED_FP8.search(native_name):
            return "fp8"
    return "bf16"
