"""DeepSeek-V4 (HF `DeepseekV4ForCausalLM` config and weight names) over openinfer's paged caches.

Read top to bottom: config -> small ops (norms, interleaved partial RoPE) -> the compressor (CSA / HCA
pooling) -> attention (sliding window + compressed entries + sinks) -> MoE (hash / learned) -> mHC ->
decoder layer -> model -> MTP. The config is in `config.py`, checkpoint names and loading in `loader.py`.

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
decoder layers and are split the same way. `loader.load_weights` cuts each checkpoint tensor (and a quantized
weight's scales, at the same block boundary) to this rank's slice. With tp_size 1 nothing changes.

Where the reference and causal semantics part (the lightning indexer's top-k on tied scores, see
docs/deepseek_v4.md), this file is causal: ties go to the earlier entry.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from openinfer.device_io import ReadOnce, h2d
from openinfer.distributed.collectives import tp_all_reduce
from openinfer.distributed.context_parallel import query_spans
from openinfer.distributed.expert_parallel import (ExpertRouting, expert_parallel_moe, initial_layout,
                                                   receive_micro_batch, send_micro_batch)
from openinfer.distributed.parallel_state import ParallelContext
from openinfer.kv_cache.spec import CacheSpec, PagedCacheSpec, RequestStateSpec
from openinfer.layers.attention import AttentionMetadata
from openinfer.layers.basic import TORCH_OPS, LayerOps, StackedLinear, sort_by_expert
from openinfer.layers.sparse_attention import V4_SOFTMAX, attend_v4, prefill_batch, stack_picks
from openinfer.layers.fp8_linear import join_linears, stored_parameters, to_fp8_linear
from openinfer.layers.parallel_linear import ParallelLMHead, VocabParallelEmbedding
from openinfer.models.deepseek_v4.config import CSA, HCA, SLIDING, DeepseekV4Config
from openinfer.models.interface import ModelTraits
from openinfer.quantization.kv_formats import Fp8BlockCodec, Fp8DsMlaCodec, IdentityCodec, KVCodec, fp4_block_qdq
from openinfer.quantization.reference import grouped_gemm as reference_grouped_gemm
from openinfer.quantization import dequant_gemm
from openinfer.quantization.reference import grouped_gemm_a8 as reference_grouped_gemm_a8


# ---- small ops ----------------------------------------------------------------------------------------
class RMSNorm(nn.Module):
    """Normalize in float32, scale by a float32 weight, cast back once (the V4 reference's order). `ops.v4_norm_rope`,
    where the runtime chose it: in one launch."""

    def __init__(self, dim: int, eps: float, ops: LayerOps = TORCH_OPS):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps, self.ops = eps, ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ops.v4_norm_rope is not None:
            return self.ops.v4_norm_rope(x.reshape(-1, x.shape[-1]), self.eps, self.weight).view(x.shape)
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


class RopeRows:
    """The attention's norm + RoPE glue for rows at `positions` (queries, keys, the output rotated back), cos/sin in
    `cs_dtype`: with `ops.v4_norm_rope` each call is one launch (norm, rotation and casts); else the torch code above,
    the cos/sin tables computed once, at first use, and shared by every call."""

    def __init__(self, rope: InterleavedRope, positions: torch.Tensor, cs_dtype: torch.dtype, ops: LayerOps,
                 tables: tuple[torch.Tensor, torch.Tensor] | None = None):
        self.rope, self.positions, self.cs_dtype, self.ops, self._tables = rope, positions, cs_dtype, ops, tables

    def tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._tables is None:
            self._tables = self.rope.cos_sin(self.positions, self.cs_dtype)
        return self._tables

    def take(self, index: torch.Tensor) -> "RopeRows":
        """The rows `index` of these (context parallelism: this rank's queries)."""
        tables = None if self.ops.v4_norm_rope is not None else tuple(t[index] for t in self.tables())
        return RopeRows(self.rope, self.positions[index], self.cs_dtype, self.ops, tables)

    def __call__(self, x: torch.Tensor, norm: "RMSNorm | float | None" = None, inverse: bool = False,
                 codec: KVCodec | None = None, fp4_group: int = 0,
                 ring: tuple[torch.Tensor, torch.Tensor] | None = None,
                 ring_codec: KVCodec | None = None) -> torch.Tensor:
        """x [T, D] or [T, heads, D]: `norm` (an RMSNorm; a float: `unweighted_rms_norm` with that eps), then the RoPE
        of the row's position (`inverse`: rotated back); `codec`: then encoded by it (the fused op packs
        `Fp8BlockCodec` rows itself); `fp4_group`: then `fp4_block_qdq(., fp4_group, "e8m0")` (V4.1's indexer
        queries). `ring` (ring, slots), only where the runtime chose `ops.v4_kv_ring` (the window keys): rows
        [0, len(slots)) also stored at ring[slots, positions % R] in the same launch (`ring_in_glue` says when);
        `ring_codec` (V4's `Fp8DsMlaCodec`): stored there as its rows, the returned rows staying values."""
        weight, eps = (norm.weight, norm.eps) if isinstance(norm, RMSNorm) else (None, norm)
        if ring is not None:
            fp8 = codec.block if isinstance(codec, Fp8BlockCodec) else 0
            y = self.ops.v4_kv_ring(x, eps, weight, self.positions, self.rope.inv_freq, self.rope.scale, self.cs_dtype,
                                    ring[0], ring[1], fp8,
                                    **({} if ring_codec is None else {"ring_codec": ring_codec}))
            return y if codec is None or fp8 else codec.encode(y)
        if self.ops.v4_norm_rope is not None:
            fp8 = codec.block if isinstance(codec, Fp8BlockCodec) else 0
            y = self.ops.v4_norm_rope(x, eps, weight, self.positions, self.rope.inv_freq, self.rope.scale,
                                      self.cs_dtype, inverse, fp8, fp4_group)
            return y if codec is None or fp8 else codec.encode(y)
        if weight is not None:
            x = norm(x)
        elif eps is not None:
            x = unweighted_rms_norm(x, eps)
        cos, sin = self.tables()
        if x.dim() == 3:
            cos, sin = cos[:, None], sin[:, None]
        y = apply_rope(x, cos, -sin if inverse else sin)
        if fp4_group:
            y = fp4_block_qdq(y, fp4_group, "e8m0")
        return y if codec is None else codec.encode(y)


def ring_in_glue(ops: LayerOps, meta: AttentionMetadata, codec: KVCodec | None = None) -> bool:
    """Whether this step's decode rows store their window keys through `ops.v4_kv_ring` (the kernel that makes the
    keys) rather than in `_decode`: where the runtime chose it, the step has decode rows, and the ring holds the keys
    as the kernel writes them (the model dtype, an `IdentityCodec`, `Fp8BlockCodec` rows, or V4's `Fp8DsMlaCodec` rows,
    which RopeRows passes as `ring_codec`)."""
    return (ops.v4_kv_ring is not None and meta.num_decode_tokens > 0
            and (codec is None or isinstance(codec, (Fp8BlockCodec, IdentityCodec, Fp8DsMlaCodec))))


# ---- paged entry addressing ---------------------------------------------------------------------------
def entry_index(block_table: torch.Tensor, entry: torch.Tensor, entries_per_block: int) -> torch.Tensor:
    """Flat row of compressed entry `entry` in a [num_blocks * entries_per_block, D] view of a paged cache."""
    return block_table.gather(-1, entry // entries_per_block) * entries_per_block + entry % entries_per_block


def stored_rows(x: torch.Tensor, codec: KVCodec | None, cache: torch.Tensor) -> torch.Tensor:
    """Entries x [..., D] as `cache` stores them: rows of `codec` (EngineConfig.kv_cache_dtype="fp8_ds_mla"), or
    (None) the values in the cache dtype."""
    return x.to(cache.dtype) if codec is None else codec.encode(x)


def read_rows(stored: torch.Tensor, codec: KVCodec | None, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows back to entries in `dtype` (`stored_rows`' inverse, up to the codec's rounding)."""
    return stored.to(dtype) if codec is None else codec.decode(stored, dtype)
def decode_entries(ops: LayerOps, meta: AttentionMetadata, positions: torch.Tensor, ratio: int,
                   entries_per_block: int, step: dict) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The decode rows' compressed entries at `ratio`: (flat rows of entries 0 .. n-1 [T, n] (`decode_entry_rows`),
    how many of them each row's position has closed [T], n). Every layer of a step with the same ratio and cache
    page reads the same (the same rows, block tables and positions): made once per step, in `step` (the forward's
    own dict, empty at its start)."""
    key = ("entries", ratio, entries_per_block)
    if key not in step:
        n = max(meta.max_decode_context_len // ratio, 1)
        step[key] = (decode_entry_rows(ops, meta.decode_block_tables, n, entries_per_block), (positions + 1) // ratio,
                     n)
    return step[key]


def decode_entry_rows(ops: LayerOps, tables: torch.Tensor, n: int, entries_per_block: int) -> torch.Tensor:
    """Flat rows [T, n] of entries 0 .. n-1 for each decode row's block table (tables [T, W]): `entry_index`, or
    `ops.entry_rows` (one launch) where the runtime chose it."""
    if ops.entry_rows is not None:
        return ops.entry_rows(tables, n, entries_per_block)
    return entry_index(tables, torch.arange(n, device=tables.device).expand(tables.shape[0], -1), entries_per_block)


def window_store_rows(chunks: list, ring_rows: int, device: torch.device, step: dict) -> tuple[torch.Tensor,
                                                                                                 torch.Tensor]:
    """The rows of a step's prefill chunks that their window rings keep (each chunk's last min(len, R) rows) and
    each one's state slot, int64 on `device`: one store into the rings for every chunk (`_store_window`'s rows,
    chunk by chunk). From the host's values in one copy that does not wait for the GPU; made once per step, in
    `step`, for every layer."""
    key = ("window store rows", ring_rows)
    if key not in step:
        rows, slots = [], []
        for p in chunks:
            keep = min(p.query_len, ring_rows)
            rows += range(p.query_start + p.query_len - keep, p.query_start + p.query_len)
            slots += [p.state_slot] * keep
        table = h2d(torch.tensor(rows + slots, dtype=torch.int64), device)
        step[key] = table[:len(rows)], table[len(rows):]
    return step[key]


def chunk_entries(p, ratio: int, entries_per_block: int, rope: "InterleavedRope", dtype: torch.dtype,
                  step: dict) -> "ClosedWindows":
    """A prefill chunk's compressed entries at `ratio`: the flat rows of entries 0 .. n-1 (n = its closed entries,
    at least 1) and the windows it closes, with their RoPE tables in `dtype`. Every layer of a step with the same
    ratio, cache page, rope and dtype reads the same (a CSA layer's compressor and indexer, every layer of the
    ratio): made once per step, in `step` (the forward's own dict, empty at its start)."""
    key = ("chunk entries", id(p), ratio, entries_per_block, id(rope), dtype)
    if key not in step:
        dev = p.block_ids.device
        start, end = p.context_len - p.query_len, p.context_len
        flat = entry_index(p.block_ids, torch.arange(max(end // ratio, 1), device=dev), entries_per_block)
        windows = torch.arange(start // ratio, end // ratio, device=dev)
        step[key] = ClosedWindows(flat, windows, flat[start // ratio:end // ratio],
                                  rope.cos_sin(windows * ratio, dtype) if len(windows) else None)
    return step[key]


class ClosedWindows:
    """`chunk_entries`' answer: flat [n] (rows of entries 0 .. n-1), windows [w] (those the chunk closes), rows [w]
    (their flat rows), tables (their RoPE cos/sin, None when w = 0)."""

    def __init__(self, flat, windows, rows, tables):
        self.flat, self.windows, self.rows, self.tables = flat, windows, rows, tables


def _coded(codec: KVCodec | None, dtype: torch.dtype | None) -> dict:
    """The fused compressor ops' keyword arguments for entries stored as `codec` rows made in `dtype` (none: plain)."""
    return {} if codec is None else {"codec": codec, "dtype": dtype}


# ---- compressors (CSA / HCA pooling) ------------------------------------------------------------------
class Compressor(nn.Module):
    """One compressed entry per `ratio` source tokens: a per-channel softmax-gated sum of projected rows,
    RMS-normed and RoPE'd at the window's first position. Each step gives it the rows of its new tokens
    (`rows`); what an open window needs lives in the request's state between steps. The two kinds differ in
    what a window pools and so in that state (see the subclasses)."""

    width_factor = 1

    def __init__(self, hidden: int, dim: int, ratio: int, eps: float, ops: LayerOps = TORCH_OPS):
        """`ops`: the fused decode step of the kind, where the runtime chose one (else the torch code below)."""
        super().__init__()
        width = self.width_factor * dim
        # the checkpoint's kv_proj and gate_proj stacked at load (the loader's stacked parts): one GEMM for both
        self.kv_gate_proj = StackedLinear(hidden, (width, width))
        self.position_bias = nn.Parameter(torch.zeros(ratio, width))
        self.kv_norm = RMSNorm(dim, eps)
        self.dim, self.ratio, self.width, self.ops = dim, ratio, width, ops

    def rows(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """[T, 2*width] float32: projected kv, and the gate plus its in-window position bias (after the stacked
        projection one launch with `ops.v4_compressor_rows`)."""
        kv_gate = self.kv_gate_proj(x)
        kv, gate = kv_gate[:, :self.width], kv_gate[:, self.width:]
        if self.ops.v4_compressor_rows is not None:
            return self.ops.v4_compressor_rows(kv, gate, self.position_bias, positions, self.ratio)
        gate = gate + self.position_bias[positions % self.ratio]
        return torch.cat((kv.float(), gate.float()), dim=-1)

    def _finish(self, pooled: torch.Tensor, windows: torch.Tensor, rope: "InterleavedRope",
                tables: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """`tables`: the windows' cos/sin in pooled's dtype (`chunk_entries`), None: computed here."""
        pooled = self.kv_norm(pooled)
        cos, sin = rope.cos_sin(windows * self.ratio, pooled.dtype) if tables is None else tables
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

    def _entries(self, state, windows, rope, dtype, tables=None):
        return self._finish((state[..., 2, :] / state[..., 1, :]).to(dtype), windows, rope, tables)

    def close_chunk(self, state, cache, new_rows, positions, rope, p, codec=None, dtype=None,
                    closed: ClosedWindows | None = None) -> None:
        """Prefill chunk of one sequence: write the entries of the windows it closes into the paged `cache`
        ([blocks, entries_per_block, dim]; `codec`: its rows, the entries made in `dtype`, else the cache dtype);
        keep the running state after each of its last L positions in `state` [L, 3, dim]. `closed`: the chunk's
        `chunk_entries` for this cache and the entries' dtype (None: computed here)."""
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
        n_closed = end // r - start // r
        if n_closed:
            edtype = dtype if codec is not None else cache.dtype
            if closed is None:
                closed = chunk_entries(p, r, cache.shape[1], rope, edtype, {})
            entries = self._entries(windows[:n_closed], closed.windows, rope, edtype, closed.tables)
            cache.view(-1, cache.shape[-1])[closed.rows] = stored_rows(entries, codec, cache)
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

    def close_decode(self, state, cache, new_rows, positions, slots, tables, rope, offsets=None, codec=None,
                     dtype=None) -> None:
        """Decode rows (one token each): fold the row into the running state; rows that end a window write
        its entry, the others write to the runner's scratch block (the last one), so the batch needs no
        host-side branching.

        `offsets` (a verify step's rows: row t at offset j holds position p, and rows t - 1 .. t - j the
        request's positions p - 1 .. p - j of this step): the state after p is the step's own rows of p's window
        reduced at once, merged into the state before the step's first row if the window opened earlier — as
        `close_chunk` computes it; every read precedes every write, so the rows of one request need no order.

        `ops.v4_hca_decode` (one launch) replaces plain decode rows' step; a verify step's rows stay here (a request's
        rows of one step read a state another of its rows may overwrite in the same launch). `codec`, `dtype`: as
        `close_chunk`'s (the fused op encodes `codec` rows itself)."""
        r, d, L = self.ratio, self.dim, state.shape[1]
        if offsets is None and self.ops.v4_hca_decode is not None:
            self.ops.v4_hca_decode(state, cache, new_rows, positions, slots, tables, self.kv_norm.weight,
                                   self.kv_norm.eps, rope.inv_freq, rope.scale, r, **_coded(codec, dtype))
            return
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
        entries = self._entries(merged, window, rope, dtype if codec is not None else cache.dtype)
        cache.view(-1, cache.shape[-1])[dst] = stored_rows(entries, codec, cache)


class OverlappingCompressor(Compressor):
    """CSA (and its indexer): each row projects to two series; entry w pools the previous window's first
    series with window w's second (2*ratio slots; window 0 has no previous window). State: the raw rows
    (`[kv | gate + position_bias]`, float32) of the open window and the one before, in a ring of 2*ratio
    positions (plus rollback_rows: row p % ring length)."""

    width_factor = 2

    def _entries(self, cur, prev, has_prev, windows, rope, dtype, tables=None):
        """cur/prev [N, ratio, 2*width]: rows of windows w and w-1 -> [N, dim] entries for `windows` [N] (`tables`:
        their cos/sin, as `_finish` takes them)."""
        d, w = self.dim, self.width
        prev_kv = torch.where(has_prev[:, None, None], prev[..., :d], 0.0)
        prev_gate = torch.where(has_prev[:, None, None], prev[..., w:w + d], float("-inf"))
        kv = torch.cat((prev_kv, cur[..., d:w]), dim=1).to(dtype)
        gate = torch.cat((prev_gate, cur[..., w + d:]), dim=1)
        return self._finish((kv * gate.softmax(dim=1).to(dtype)).sum(dim=1), windows, rope, tables)

    def close_chunk(self, ring, cache, new_rows, positions, rope, p, codec=None, dtype=None,
                    closed: ClosedWindows | None = None) -> None:
        """Prefill chunk of one sequence: write the entries of the windows it closes into the paged `cache`
        ([blocks, entries_per_block, dim]; `codec`, `dtype`, `closed` as RunningCompressor's); keep the rows open
        windows need in `ring` [2*ratio, 2*width]."""
        r, dev, R = self.ratio, new_rows.device, ring.shape[0]
        start, end = p.context_len - p.query_len, p.context_len
        first = max(start // r - 1, 0)                            # oldest window whose rows are still needed
        if end // r > start // r:
            edtype = dtype if codec is not None else cache.dtype
            if closed is None:
                closed = chunk_entries(p, r, cache.shape[1], rope, edtype, {})
            windows = closed.windows
            hist = torch.arange(first * r, start, device=dev)
            rows = torch.cat((ring[hist % R], new_rows))[:(end // r - first) * r]
            win = rows.view(-1, r, rows.shape[-1])
            local = windows - first
            entries = self._entries(win[local], win[(local - 1).clamp(min=0)], windows > 0, windows, rope, edtype,
                                    closed.tables)
            cache.view(-1, cache.shape[-1])[closed.rows] = stored_rows(entries, codec, cache)
        keep = min(len(new_rows), R)
        ring[positions[-keep:] % R] = new_rows[-keep:]

    def close_decode(self, ring, cache, new_rows, positions, slots, tables, rope, offsets=None, codec=None,
                     dtype=None) -> None:
        """Decode rows (one token each): store the row; rows that end a window write its entry, the others
        write to the runner's scratch block (the last one), so the batch needs no host-side branching.
        `codec`, `dtype`: as RunningCompressor's.

        `ops.v4_csa_decode` does it in one launch (a verify step's rows too: `offsets`, as RunningCompressor's, say
        which of a window's rows are this step's, taken from `new_rows` rather than the ring they are written to in
        the same launch); it writes no scratch entry, and encodes `codec` rows itself."""
        r, R = self.ratio, ring.shape[1]
        if self.ops.v4_csa_decode is not None:
            self.ops.v4_csa_decode(ring, cache, new_rows, positions, slots, tables, offsets, self.kv_norm.weight,
                                   self.kv_norm.eps, rope.inv_freq, rope.scale, r, **_coded(codec, dtype))
            return
        ring[slots, positions % R] = new_rows
        window = (positions + 1) // r - 1
        j = torch.arange(r, device=positions.device)
        cur = ring[slots[:, None], (window[:, None] * r + j) % R]
        prev = ring[slots[:, None], ((window[:, None] - 1) * r + j) % R]
        entries = self._entries(cur, prev, window > 0, window.clamp(min=0), rope,
                                dtype if codec is not None else cache.dtype)
        epb = cache.shape[1]
        dst = torch.where((positions + 1) % r == 0, entry_index(tables, window.clamp(min=0)[:, None], epb)[:, 0],
                          (cache.shape[0] - 1) * epb)
        cache.view(-1, cache.shape[-1])[dst] = stored_rows(entries, codec, cache)


class Indexer(OverlappingCompressor):
    """Lightning indexer (CSA): its own overlapping compressor over index_head_dim keys, and scores
    sum_h w_h * relu(q_h . k) / sqrt(d_I) that keep the top `index_topk` closed entries per query.
    Ties go to the earlier entry, so appending tokens never changes an earlier query's choice."""

    def __init__(self, cfg: DeepseekV4Config, ratio: int, ops: LayerOps = TORCH_OPS):
        super().__init__(cfg.hidden_size, cfg.index_head_dim, ratio, cfg.rms_norm_eps, ops)
        self.num_heads, self.topk = cfg.index_n_heads, cfg.index_topk
        self.q_b_proj = nn.Linear(cfg.q_lora_rank, self.num_heads * self.dim, bias=False)
        self.scorer = nn.Module()
        self.scorer.weights_proj = nn.Linear(cfg.hidden_size, self.num_heads, bias=False)

    def queries(self, x, q_residual, at: RopeRows) -> tuple[torch.Tensor, torch.Tensor]:
        """(queries [T, H, d], the heads' weights [T, H] as projected: `scores` scales them, `ops.index_scores` in its
        kernel, where it runs)."""
        q = at(self.q_b_proj(q_residual).view(-1, self.num_heads, self.dim))
        return q, self.scorer.weights_proj(x)

    def scores(self, q, weights, keys, num_closed) -> torch.Tensor:
        """q [T, H, d], weights [T, H] (as projected), keys [T or 1, N, d], num_closed [T] -> float32 [T, N], -inf past
        the closed entries."""
        weights = weights.float() * self.num_heads ** -0.5
        if keys.shape[0] == 1:     # a prefill chunk: every query scores the same keys, no per-query copy
            scores = torch.einsum("thd,nd->thn", q.float(), keys[0].float())
        else:
            scores = torch.einsum("thd,tnd->thn", q.float(), keys.float())
        scores = (F.relu(scores) * self.dim ** -0.5 * weights[..., None]).sum(1)          # [T, N]
        closed = torch.arange(scores.shape[-1], device=scores.device)[None, :] < num_closed[:, None]
        return scores.masked_fill(~closed, float("-inf"))

    def select(self, q, weights, keys, num_closed, budget: int = 1 << 26) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (entries [T, k] in position order, valid [T, k]): the top k of `scores`, ties to the earlier. Queries go
        in blocks whose [t, heads, N] products hold about `budget` floats: a budget-sized prefill chunk over a long
        context would otherwise take gigabytes at once (8K queries x 64 heads x 2K entries: 4 GiB)."""
        T, N = q.shape[0], keys.shape[-2]
        step = max(1, budget // (self.num_heads * max(N, 1)))
        if T <= step:
            return self.ops.index_topk(self.scores(q, weights, keys, num_closed), self.topk, num_closed)
        picks, valid = [], []
        for i0 in range(0, T, step):
            sl = slice(i0, min(i0 + step, T))
            pk, ok = self.ops.index_topk(self.scores(q[sl], weights[sl], keys if keys.shape[0] == 1 else keys[sl],
                                                     num_closed[sl]), self.topk, num_closed[sl])
            picks.append(pk)
            valid.append(ok)
        return torch.cat(picks), torch.cat(valid)

    def select_chunk(self, q, weights, cache, block_ids, flat, num_closed,
                     budget: int = 1 << 26) -> tuple[torch.Tensor, torch.Tensor]:
        """`select` for a prefill chunk's queries over its entries 0 .. n-1 (rows `flat` [n] of the paged index cache
        `cache`, whose block table is `block_ids` [W]): `ops.index_prefill_scores` (the decode rows' paged kernel)
        reads the keys in place, every query with the chunk's one table (a stride-0 expansion, no copy); the torch
        path (`select` over the gathered keys) where the ops have none. Queries go in blocks whose scores hold about
        `budget` floats."""
        if self.ops.index_prefill_scores is None:
            return self.select(q, weights, cache.view(-1, self.dim)[flat][None], num_closed, budget)
        T, n = q.shape[0], flat.shape[0]
        tables = block_ids[None].expand(T, -1)
        step = max(1, budget // max(n, 1))
        picks, valid = [], []
        for i0 in range(0, T, step):
            sl = slice(i0, min(i0 + step, T))
            scores = self.ops.index_prefill_scores(q[sl], weights[sl], cache, tables[sl], n, num_closed[sl],
                                                   self.dim ** -0.5, weight_scale=self.num_heads ** -0.5)
            pk, ok = self.ops.index_topk(scores, self.topk, num_closed[sl])
            picks.append(pk)
            valid.append(ok)
        return (picks[0], valid[0]) if len(picks) == 1 else (torch.cat(picks), torch.cat(valid))

    def select_decode(self, q, weights, cache, tables, flat, num_closed) -> tuple[torch.Tensor, torch.Tensor]:
        """`select` for decode rows over the paged index cache: their entries' rows are `flat` [T, N] (the block
        table `tables` walked); `ops.index_scores` reads them in place."""
        if self.ops.index_scores is None:
            return self.select(q, weights, cache.view(-1, self.dim)[flat], num_closed)
        scores = self.ops.index_scores(q, weights, cache, tables, flat.shape[1], num_closed, self.dim ** -0.5,
                                       weight_scale=self.num_heads ** -0.5)
        return self.ops.index_topk(scores, self.topk, num_closed)


# ---- attention ----------------------------------------------------------------------------------------
class DeepseekV4Attention(nn.Module):
    """Shared-KV MQA (one K=V head of head_dim) over the sliding window (the last W tokens, self included),
    the layer's compressed entries (HCA: every closed one; CSA: the indexer's top-k) and a per-head sink
    logit. The output's RoPE slice is rotated back by the query position; a grouped low-rank projection
    follows. `state` maps this layer's cache names (swa, kv, rows, index, index_rows) to tensors, and "codec" to how
    the window ring and the compressed cache store their entries (absent or None: in the model dtype; an
    `Fp8DsMlaCodec`: DeepSeek's FlashMLA rows, EngineConfig.kv_cache_dtype="fp8_ds_mla"). With a codec every key is
    read back decoded, a chunk's own keys too (as DeepSeek's reference rounds them in place before attending).

    Tensor parallelism (`parallel.tp_size` > 1) splits the query heads: rank r holds heads
    [r*H/tp, (r+1)*H/tp) of q_b_proj and the sinks, the output groups [r*G/tp, (r+1)*G/tp) of o_a_proj (whose
    inputs are exactly those heads: a group is H/G consecutive heads) and the matching input columns of
    o_b_proj, whose partial products are summed over the TP group (one all-reduce). q_a_proj, q_a_norm,
    kv_proj, kv_norm, the compressor and the indexer stay replicated: the single shared KV head and the
    compressed entries are the same for every head, so every rank computes them in full and the KV caches
    (sliding window, compressed entries, indexer keys, compressor state) are replicated, not split.

    Decode rows attend through `ops.sparse_decode_attention` (keys read in place from the ring and the paged cache:
    one fused launch on CUDA); prefill chunks, where the runtime chose `ops.sparse_prefill_attention`, all at once
    through it (keys read in place: one launch per layer with the Triton kernel), else each through `attend_v4` over
    gathered keys."""

    def __init__(self, cfg: DeepseekV4Config, layer_type: str, parallel: ParallelContext | None = None,
                 ops: LayerOps = TORCH_OPS):
        super().__init__()
        self.parallel = parallel or ParallelContext.single()
        self.ops = ops
        tp = self.parallel.tp_size
        self.cfg, self.layer_type = cfg, layer_type
        self.num_heads, self.head_dim, self.window = cfg.num_attention_heads // tp, cfg.head_dim, cfg.sliding_window
        self.o_groups = cfg.o_groups // tp          # this rank's output groups (all of them without TP)
        self.scale = self.head_dim ** -0.5
        self.q_a_proj = nn.Linear(cfg.hidden_size, cfg.q_lora_rank, bias=False)
        self.q_a_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps, ops)
        self.q_b_proj = nn.Linear(cfg.q_lora_rank, self.num_heads * self.head_dim, bias=False)
        self.kv_proj = nn.Linear(cfg.hidden_size, self.head_dim, bias=False)
        # q_a_proj and kv_proj (both read x) joined at load where stored alike (`join_projections`): one GEMM
        self.q_a_kv_proj: nn.Module | None = None
        self.kv_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps, ops)
        self.o_a_proj = nn.Linear(cfg.num_attention_heads * self.head_dim // cfg.o_groups,
                                  self.o_groups * cfg.o_lora_rank, bias=False)
        self.o_b_proj = nn.Linear(self.o_groups * cfg.o_lora_rank, cfg.hidden_size, bias=False)
        self.sinks = nn.Parameter(torch.zeros(self.num_heads))
        self.compressor = None
        if layer_type != SLIDING:
            self.ratio = cfg.compress_rates[layer_type]
            kind = OverlappingCompressor if layer_type == CSA else RunningCompressor
            self.compressor = kind(cfg.hidden_size, self.head_dim, self.ratio, cfg.rms_norm_eps, ops)
            if layer_type == CSA:
                self.compressor.indexer = Indexer(cfg, self.ratio, ops)

    def forward(self, x, positions, rope: InterleavedRope, state: dict, meta: AttentionMetadata, cp=None):
        """`cp` (context parallelism, distributed/context_parallel.py: ContextParallelStep): `x`, `positions` and
        `meta` are the whole step's; the KV side (window ring, compressors, indexer keys) runs on every row as one
        process does, queries and their attention only on this rank's rows, whose outputs are returned."""
        at = RopeRows(rope, positions, x.dtype, self.ops)
        q_a, kv_x = self.q_a_kv(x)
        q_residual = self.q_a_norm(q_a)
        qx, q_at = x, at
        if cp is not None:
            mine = cp.local_index
            qx, q_residual, q_at = x[mine], q_residual[mine], at.take(mine)
        T = qx.shape[0]
        q = q_at(self.q_b_proj(q_residual).view(T, self.num_heads, self.head_dim), self.cfg.rms_norm_eps)
        codec = state.get("codec")
        stored = ring_in_glue(self.ops, meta, codec)    # the decode rows' window keys stored as they are made
        kv = at(kv_x, self.kv_norm, ring=(state["swa"], meta.decode_state_slots) if stored else None,
                ring_codec=codec)
        keys = kv if codec is None or not meta.prefills else codec.qdq(kv)    # prefill's own keys, as read back
        comp = self.compressor
        rows = index_rows = index_q = None
        if comp is not None:
            rows = comp.rows(x, positions)
            if self.layer_type == CSA:
                index_rows = comp.indexer.rows(x, positions)
                index_q = comp.indexer.queries(qx, q_residual, q_at)
        out = torch.empty_like(q)
        batched = self.ops.sparse_prefill_attention is not None and cp is None
        chunks = []
        for sl, qsl, sel, p in query_spans(meta, cp, x.device):
            crows = None if rows is None else rows[sl]
            irows = None if index_rows is None else index_rows[sl]
            iq = None if index_q is None else (index_q[0][qsl], index_q[1][qsl])
            if p is None:               # decode rows: keys read in place, one fused launch on CUDA
                self._decode(q[qsl], out[qsl], kv[sl], positions[sl], crows, irows, iq, rope, state, meta, stored)
                continue
            if batched:                 # entries closed and picked now; attention for every chunk at once below
                picks = None
                if comp is not None:
                    flat, picked, valid = self._compressed_entries(positions[sl], crows, irows, iq, rope, state, meta,
                                                                   p, dtype=q.dtype)
                    picks = (flat.expand(len(valid), -1) if picked is None else flat[picked], valid)
                chunks.append((p, picks))
                continue
            groups = [self._window_keys(kv[sl], keys[sl], positions[sl], state["swa"], p, codec)]
            q_pos = positions[sl] if sel is None else positions[sl][sel]
            if comp is not None:
                flat, picked, valid = self._compressed_entries(positions[sl], crows, irows, iq, rope, state, meta, p,
                                                               q_pos, dtype=q.dtype)
                cache = state["kv"]
                groups.append((read_rows(cache.view(-1, cache.shape[-1])[flat], codec, q.dtype), valid, picked))
            if sel is not None:         # this rank's queries of the chunk: their rows of the window mask
                keys, mask, picks = groups[0]
                groups[0] = (keys, mask[sel], picks)
            if q_pos.numel():
                out[qsl] = attend_v4(q[qsl], groups, self.sinks, self.scale, band=self.window if sel is None else None)
        if chunks:
            self._prefill(q, out, kv, keys, positions, chunks, state)
        o = q_at(out, inverse=True).reshape(T, self.o_groups, self.num_heads * self.head_dim // self.o_groups)
        return tp_all_reduce(self.o_b_proj(grouped_projection(self.o_a_proj, o).flatten(1)), self.parallel)

    def q_a_kv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(q_a_proj(x), kv_proj(x)): one GEMM and two column views of it where the loader joined them."""
        if self.q_a_kv_proj is not None:
            return self.q_a_kv_proj.split(self.q_a_kv_proj(x))
        return self.q_a_proj(x), self.kv_proj(x)

    def join_projections(self) -> bool:
        """Join q_a_proj and kv_proj into `q_a_kv_proj` (fp8_linear.join_linears: where they are stored alike)."""
        return join_linears(self, ("q_a_proj", "kv_proj"), "q_a_kv_proj")

    def _decode(self, q, out, kv, positions, rows, index_rows, index_q, rope, state, meta, stored=False) -> None:
        """Decode rows (one token each): store their window keys in the ring (`stored`: `ops.v4_kv_ring` did) and
        close the compressed entries they complete (picking the indexer's top-k on CSA layers), then attend over the
        ring's last W positions, the entries and the sinks into `out`."""
        ring, slots, codec = state["swa"], meta.decode_state_slots, state.get("codec")
        if not stored:
            ring[slots, positions % ring.shape[1]] = stored_rows(kv, codec, ring)
        comp = {}
        if self.compressor is not None:
            flat, picked, valid = self._compressed_entries(positions, rows, index_rows, index_q, rope, state, meta,
                                                           None, dtype=q.dtype)
            comp = dict(cache=state["kv"], rows=flat if picked is None else flat.gather(1, picked), valid=valid,
                        cache_codec=codec)
        self.ops.sparse_decode_attention(q, sinks=self.sinks, scale=self.scale, softmax=V4_SOFTMAX, ring=ring,
                                         slots=slots, positions=positions, window=self.window, ring_codec=codec,
                                         out=out, **comp)

    def _prefill(self, q, out, kv, keys, positions, chunks, state) -> None:
        """Every prefill chunk of the step through one `ops.sparse_prefill_attention` call (window keys read in place:
        the ring's history, then the chunks' own keys `keys` (`kv` as the ring gives it back), which are stored in
        the ring after it), into `out`."""
        ring, codec, step = state["swa"], state.get("codec"), state.get("step", {})
        if "prefill batch" not in step:         # (the same chunks at every layer: made once per step)
            step["prefill batch"] = prefill_batch([p for p, _ in chunks], q.device)
        sl, cu, slots = step["prefill batch"]
        comp = {}
        if self.compressor is not None:
            rows, valid = stack_picks([c[1][0] for c in chunks], [c[1][1] for c in chunks])
            comp = dict(cache=state["kv"], rows=rows, valid=valid, cache_codec=codec)
        own = keys[sl].to(ring.dtype) if codec is None else keys[sl].to(q.dtype)
        self.ops.sparse_prefill_attention(q[sl], sinks=self.sinks, scale=self.scale, softmax=V4_SOFTMAX,
                                          kv=own, positions=positions[sl], cu_seqlens=cu, ring=ring,
                                          slots=slots, window=self.window, ring_codec=codec, out=out[sl], **comp)
        rows, slots = window_store_rows([p for p, _ in chunks], ring.shape[1], q.device, step)
        ring[slots, positions[rows] % ring.shape[1]] = stored_rows(kv[rows], codec, ring)

    @staticmethod
    def _store_window(kv, positions, ring, codec=None) -> None:
        """A chunk's keys into its ring [R, stored] (the last R of them)."""
        keep = min(len(kv), ring.shape[0])
        ring[positions[-keep:] % ring.shape[0]] = stored_rows(kv[-keep:], codec, ring)

    def _window_keys(self, kv, keys, positions, ring, p, codec=None):
        """A chunk's sliding-window keys ([W + n, D]: W history rows, then the chunk's own `keys`, `kv` as the ring
        gives it back) and mask; stores the new keys in the ring (after reading the history). R = W +
        rollback_rows."""
        W, dev, R = self.window, kv.device, ring.shape[1]
        ring = ring[p.state_slot]
        hist = torch.arange(p.context_len - p.query_len - W, p.context_len - p.query_len, device=dev)
        dtype = ring.dtype if codec is None else keys.dtype
        keys = torch.cat((read_rows(ring[hist % R], codec, dtype), keys.to(dtype)))
        kpos = torch.cat((hist, positions))[None, :]
        mask = (kpos <= positions[:, None]) & (kpos > positions[:, None] - W) & (kpos >= 0)
        self._store_window(kv, positions, ring, codec)
        return keys, mask, None

    def _compressed_entries(self, positions, rows, index_rows, index_q, rope, state, meta, p, q_pos=None,
                            dtype=None):
        """Close the windows the new rows complete (entries into the paged cache, and the indexer's keys on CSA
        layers), then say which entries each query reads: (flat, picked, valid) — `flat` the rows of entries
        0 .. n-1 in the cache viewed as rows ([T, n] for decode rows, [n] for a chunk); `picked` None (HCA: every
        closed entry, `valid` [T, n]) or the indexer's top-k [T, k] into them (CSA, `valid` [T, k]). `q_pos`: the
        positions of the queries that read the entries (context parallelism: this rank's rows of the chunk);
        None: every row's. `dtype`: the entries' value dtype (stored as state["codec"] says)."""
        comp, r, codec = self.compressor, self.ratio, state.get("codec")
        cache = state["kv"]
        epb = cache.shape[1]
        if p is None:
            tables, slots = meta.decode_block_tables, meta.decode_state_slots
            comp.close_decode(state["rows"], cache, rows, positions, slots, tables, rope, meta.decode_row_offsets,
                              codec, dtype)
            step = state.get("step", {})        # (made once per step for every layer of the ratio)
            flat, num_closed, n = decode_entries(self.ops, meta, positions, r, epb, step)
            if self.layer_type == HCA:
                if ("closed mask", r, n) not in step:
                    step["closed mask", r, n] = torch.arange(n, device=positions.device)[None, :] < num_closed[:, None]
                return flat, None, step["closed mask", r, n]
        else:
            num_closed = ((positions if q_pos is None else q_pos) + 1) // r
            step = state.get("step", {})        # (a chunk's entries, made once per step for every layer of the ratio)
            edtype = dtype if codec is not None else cache.dtype
            closed = chunk_entries(p, r, epb, rope, edtype, step)
            comp.close_chunk(state["rows"][p.state_slot], cache, rows, positions, rope, p, codec, dtype, closed)
            flat, n = closed.flat, closed.flat.shape[0]
            if self.layer_type == HCA:
                return flat, None, torch.arange(n, device=positions.device)[None, :] < num_closed[:, None]
        indexer = comp.indexer
        if p is None:
            indexer.close_decode(state["index_rows"], state["index"], index_rows, positions, slots, tables, rope,
                                 meta.decode_row_offsets)
            picked, valid = indexer.select_decode(*index_q, state["index"], tables, flat, num_closed)
        else:
            index = state["index"]
            indexer.close_chunk(state["index_rows"][p.state_slot], index, index_rows, positions, rope, p,
                                closed=chunk_entries(p, r, index.shape[1], rope, index.dtype, step))
            picked, valid = indexer.select_chunk(*index_q, state["index"], p.block_ids, flat, num_closed)
        return flat, picked, valid


def grouped_projection(proj: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """x [T, g, K] through a block-diagonal projection: group i uses rows [i*N/g, (i+1)*N/g) of the weight."""
    if hasattr(proj, "forward_groups"):        # a quantized weight computes per group through its kernel
        return proj.forward_groups(x)
    w = proj.weight.view(x.shape[1], -1, proj.weight.shape[1])
    return torch.einsum("tgi,gri->tgr", x, w)


# ---- MoE ----------------------------------------------------------------------------------------------
class SharedExpert(nn.Module):
    """The clamped SwiGLU MLP every token takes. The checkpoint's gate (w1) and up (w3) matrices are stacked at load
    into one `gate_up_proj` [2I, H] (the loader's stacked parts): one GEMM for both, whose rows are each the same
    dot products as the two GEMMs'; `ops.moe_act` (the routed experts' activation kernel) then replaces the clamps,
    silu and product (four kernels) with one launch, rounding as the torch code does."""

    def __init__(self, hidden: int, inter: int, limit: float, ops: LayerOps = TORCH_OPS):
        super().__init__()
        self.gate_up_proj = StackedLinear(hidden, (inter, inter))
        self.down_proj = nn.Linear(inter, hidden, bias=False)
        self.limit, self.ops = limit, ops

    def forward(self, x):
        gate_up = self.gate_up_proj(x)
        if self.ops.moe_act is not None:
            return self.down_proj(self.ops.moe_act(gate_up, self.limit, rounded=True))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate.clamp(max=self.limit)) * up.clamp(min=-self.limit, max=self.limit))


class Router(nn.Module):
    """sqrt(softplus) scores; experts from a frozen token->experts table (hash) or the top-k of scores plus
    a correction bias (learned); the chosen scores, renormalized and scaled, weight the experts. In the model
    dtype, as transformers computes it; `ops.route` does all of it after the logits in one kernel."""

    def __init__(self, cfg: DeepseekV4Config, hashed: bool, ops: LayerOps = TORCH_OPS):
        super().__init__()
        self.top_k, self.scaling, self.hashed = cfg.num_experts_per_tok, cfg.routed_scaling_factor, hashed
        self.ops = ops
        self.weight = nn.Parameter(torch.zeros(cfg.n_routed_experts, cfg.hidden_size))
        if hashed:
            self.register_buffer("tid2eid", torch.zeros(cfg.vocab_size, self.top_k, dtype=torch.long))
        else:
            self.register_buffer("e_score_correction_bias", torch.zeros(cfg.n_routed_experts))

    def forward(self, x, input_ids):
        logits = F.linear(x, self.weight)
        if self.ops.route is not None:
            if self.hashed:
                return self.ops.route(logits, None, self.top_k, self.scaling, True, table=self.tid2eid,
                                      token_ids=input_ids)
            return self.ops.route(logits, self.e_score_correction_bias, self.top_k, self.scaling, True)
        scores = F.softplus(logits).sqrt()
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

    def grouped_mm(self, rows, name: str, offs, host_offs: ReadOnce | None = None):
        """`host_offs`: `offs` read on the host at most once for both GEMMs, where a route needs them there."""
        return torch._grouped_mm(rows, getattr(self, name).transpose(1, 2), offs=offs)

    def weights_changed(self) -> None:
        """Called after the weights were written (loaded, or moved between slots by EPLB): recompute anything
        derived from them (bf16 experts: nothing)."""

    def forward(self, x, experts, weights, add: torch.Tensor | None = None):
        """x [T, H], experts [T, k] slot ids (-1: not computed here, expert parallelism), weights [T, k]; `add` [T, H]
        (the shared expert's rows): returned added to the sums, `experts(x) + add` (in the combine's epilogue where the
        runtime chose `ops.moe_combine_add`)."""
        if self.grouped:
            return self._grouped(x, experts, weights, add)
        out = torch.zeros_like(x)
        for e in experts.unique().tolist():
            if e < 0:
                continue
            tok, k = torch.where(experts == e)
            h = self._act(self.expert_linear(x[tok], "gate_up_proj", e))
            out.index_add_(0, tok, (self.expert_linear(h, "down_proj", e) * weights[tok, k, None]).to(x.dtype))
        return out if add is None else out + add

    def _grouped(self, x, experts, weights, add=None):
        n, k = self.gate_up_proj.shape[0], experts.shape[1]
        if self.ops.moe_combine is not None:     # sorting, activation, combining: one kernel each
            _, rows, inv, offs = self.ops.expert_order(experts, n)
            host = ReadOnce(offs)               # (the GEMMs' routes that need offs on the host read them once)
            h = self.ops.moe_act(self.grouped_mm(x[rows], "gate_up_proj", offs, host), self.limit, rounded=True)
            y = self.grouped_mm(h, "down_proj", offs, host)
            if add is not None and self.ops.moe_combine_add is not None:
                return self.ops.moe_combine_add(y, inv, experts, weights, x.dtype, add)
            out = self.ops.moe_combine(y, inv, experts, weights, x.dtype)
            return out if add is None else out + add
        order, offs = sort_by_expert(experts, n)     # other ranks' experts (-1) last, past the final offset
        host = ReadOnce(offs)
        h = self._act(self.grouped_mm(x[order // k], "gate_up_proj", offs, host))
        y = self.grouped_mm(h, "down_proj", offs, host)
        y = y * weights.flatten()[order, None].to(y.dtype)
        y = torch.where(experts.flatten()[order, None] < 0, 0, y)   # rows past the last offset hold anything
        out = torch.zeros_like(x).index_add_(0, order // k, y)
        return out if add is None else out + add


def expert_weights_loaded(net: nn.Module) -> None:
    """After the checkpoint is in: every routed-experts module recomputes what it derives from its weights
    (`Experts.weights_changed`)."""
    for m in net.modules():
        if isinstance(m, Experts):
            m.weights_changed()


def expert_scratch_bytes(net: nn.Module) -> int:
    """`ModelTraits.prefill_scratch_bytes` of a DeepSeek model: quantized experts on CUDA may take the dequant route
    at large prefill steps (`kernel_choice`), whose bf16 scratch holds at most `dequant_gemm.SCRATCH_BYTES` (or
    one expert) at a time."""
    sizes = [m.gate_up_proj.shape[1] * m.down_proj.shape[1] * 2 for m in net.modules()
             if isinstance(m, QuantizedExperts) and m.grouped]      # one bf16 gate_up [2I, H]
    return max(dequant_gemm.SCRATCH_BYTES, *sizes) if sizes else 0


class QuantizedExperts(Experts):
    """Routed experts kept as published (MXFP4, or block FP8 in older conversions): `<name>` holds the
    stored values and `<name>_scale` the E8M0 scales; GEMMs go through `LayerOps.grouped_gemm` (weights
    dequantized in registers on CUDA), the CPU loop dequantizes one expert at a time (the reference). With
    `LayerOps.quantize_activations` the rows are first rounded to FP8 per token in groups of the checkpoint's
    block (`grouped_gemm_a8`), as DeepSeek's inference feeds its `fp4_gemm` (W4A8)."""

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
        # per GEMM: whether the folded W4A8 kernel reproduces these MXFP4 experts exactly (`weights_changed`)
        self.w4a8_foldable = {"gate_up_proj": False, "down_proj": False}

    @property
    def grouped(self) -> bool:
        return self.gate_up_proj.is_cuda

    def weights_changed(self) -> None:
        """MXFP4 experts on CUDA: check once whether every 128-wide K block's scales fold into E4M3
        (`triton_w4a8.fold_exact`, one reduction and one host read per tensor), which the expert GEMM's folded
        W4A8 route requires. At load (`finish`) and after EPLB moved slots."""
        if self.fmt != "mxfp4" or not self.grouped:
            return
        from openinfer.quantization.triton_w4a8 import fold_exact

        for name in self.w4a8_foldable:
            self.w4a8_foldable[name] = fold_exact(getattr(self, name + "_scale"))

    def expert_linear(self, x, name: str, e: int):
        offs = torch.full((1,), x.shape[0], dtype=torch.int32)
        w, s = getattr(self, name), getattr(self, name + "_scale")
        gemm = reference_grouped_gemm_a8 if self.ops.quantize_activations else reference_grouped_gemm
        return gemm(x, offs, w[e:e + 1], s[e:e + 1], self.fmt, self.block)

    def grouped_mm(self, rows, name: str, offs, host_offs: ReadOnce | None = None):
        w, s = getattr(self, name), getattr(self, name + "_scale")
        if self.ops.quantize_activations:
            return self.ops.grouped_gemm_a8(rows, offs, w, s, self.fmt, self.block, host_offs=host_offs,
                                            w4a8_foldable=self.w4a8_foldable[name])
        return self.ops.grouped_gemm(rows, offs, w, s, self.fmt, self.block, host_offs=host_offs)


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
        self.gate = Router(cfg, hashed, ops)
        slots = None
        if ep_layout is not None:            # (slots per rank, most replicas one expert can have)
            slots, max_replicas = ep_layout
            self.routing = ExpertRouting(cfg.n_routed_experts, max_replicas, slots, self.parallel.ep_rank)
        tp = self.parallel.tp_size
        self.experts = Experts(cfg, ops, slots, cfg.moe_intermediate_size // tp)
        self.shared_experts = SharedExpert(cfg.hidden_size, cfg.moe_intermediate_size * cfg.n_shared_experts // tp,
                                           cfg.swiglu_limit, ops)

    def forward(self, x, input_ids, meta: AttentionMetadata | None = None):
        experts, weights = self.gate(x, input_ids)
        if self.parallel.ep_size == 1:     # (tensor parallelism: partial sums, one all-reduce)
            return tp_all_reduce(self.experts(x, experts, weights, add=self.shared_experts(x)), self.parallel)
        return (expert_parallel_moe(x, experts, weights, self.routing, self.experts, meta, self.parallel)
                + self.shared_experts(x))

    def send(self, x, input_ids, meta: AttentionMetadata):
        """Expert parallelism, one micro-batch of two-batch overlap (distributed/two_batch.py): route, send the rows
        to their experts' ranks, compute the shared expert while they travel; `receive` adds the routed experts."""
        experts, weights = self.gate(x, input_ids)
        return send_micro_batch(x, experts, weights, self.routing, meta, self.parallel), self.shared_experts(x)

    def receive(self, sent) -> torch.Tensor:
        flight, shared = sent
        return receive_micro_batch(flight, self.experts, self.routing, self.parallel) + shared


# ---- mHC ----------------------------------------------------------------------------------------------
class HyperConnection(nn.Module):
    """Manifold-constrained hyper-connection: from the n residual streams, weights to collapse them into
    the block input (pre), to spread the block output back (post), and an n x n stream mix projected onto
    doubly-stochastic matrices by Sinkhorn iterations (comb). Float32 throughout, as the reference; the merge
    in the model dtype, as transformers computes it. `ops.hc_pre` / `ops.hc_post`: the same in 1 + 1 kernels."""

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
        if self.ops.hc_pre is not None:
            _, post, comb, collapsed = self.ops.hc_pre(streams, self.fn, self.base, self.scale, self.iters, self.eps,
                                                       self.norm_eps)
            return post, comb, collapsed
        mixes = F.linear(unweighted_rms_norm(streams.flatten(1).float(), self.norm_eps), self.fn.float())
        pre, post, comb = self.ops.hc_weights(mixes, self.base, self.scale, self.n, self.iters, self.eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(1).to(streams.dtype)
        return post, comb, collapsed

    def merge(self, streams, out, post, comb):
        """post * block output + comb^T @ streams (comb mixes over its first axis)."""
        if self.ops.hc_post is not None:
            return self.ops.hc_post(out, streams, post, comb, True)
        dtype = streams.dtype
        return post.to(dtype).unsqueeze(-1) * out.unsqueeze(1) + torch.matmul(comb.to(dtype).transpose(-1, -2),
                                                                                streams)


class HyperHead(nn.Module):
    """The final collapse of the n streams into one hidden vector (`ops.hc_head`: in one kernel)."""

    def __init__(self, cfg: DeepseekV4Config, ops: LayerOps = TORCH_OPS):
        super().__init__()
        self.eps, self.norm_eps, self.ops = cfg.hc_eps, cfg.rms_norm_eps, ops
        self.hc_fn = nn.Parameter(torch.zeros(cfg.hc_mult, cfg.hc_mult * cfg.hidden_size))
        self.hc_base = nn.Parameter(torch.zeros(cfg.hc_mult))
        self.hc_scale = nn.Parameter(torch.ones(1))

    def forward(self, streams):
        if self.ops.hc_head is not None:
            return self.ops.hc_head(streams, self.hc_fn, self.hc_base, self.hc_scale, self.eps, self.norm_eps)
        mixes = F.linear(unweighted_rms_norm(streams.flatten(1).float(), self.norm_eps), self.hc_fn.float())
        pre = torch.sigmoid(mixes * self.hc_scale.float() + self.hc_base.float()) + self.eps
        return (pre.unsqueeze(-1) * streams).sum(1).to(streams.dtype)


# ---- decoder layer and model --------------------------------------------------------------------------
class DeepseekV4DecoderLayer(nn.Module):
    def __init__(self, cfg: DeepseekV4Config, layer_type: str, mlp_type: str, ops: LayerOps = TORCH_OPS,
                 **moe_kwargs):
        super().__init__()
        self.self_attn = DeepseekV4Attention(cfg, layer_type, moe_kwargs.get("parallel"), ops)
        self.mlp = MoE(cfg, mlp_type == "hash_moe", ops, **moe_kwargs)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.attn_hc = HyperConnection(cfg, ops)
        self.ffn_hc = HyperConnection(cfg, ops)

    def forward(self, streams, input_ids, positions, rope, state, meta):
        streams, post, comb, h = self._attention(streams, positions, rope, state, meta)
        return self.ffn_hc.merge(streams, self.mlp(h, input_ids, meta), post, comb)

    def attend(self, streams, input_ids, positions, rope, state, meta):
        """Two-batch overlap (distributed/two_batch.py), one micro-batch: the layer up to its MoE rows sent to their
        experts' ranks -> (streams, flight); `finish` the rest."""
        streams, post, comb, h = self._attention(streams, positions, rope, state, meta)
        return streams, (self.mlp.send(h, input_ids, meta), post, comb)

    def finish(self, streams, flight):
        sent, post, comb = flight
        return self.ffn_hc.merge(streams, self.mlp.receive(sent), post, comb)

    def _attention(self, streams, positions, rope, state, meta):
        """Attention and its merge, then the FFN hyper-connection's weights -> (streams, post, comb, FFN input)."""
        post, comb, h = self.attn_hc(streams)
        cp = meta.context_parallel
        if cp is None:
            attn = self.self_attn(self.input_layernorm(h), positions, rope, state, meta)
        else:   # context parallelism: the KV side over the whole step's rows, the queries over this rank's
            attn = self.self_attn(cp.gather(self.input_layernorm(h)), cp.positions, rope, state, cp.meta, cp)
        streams = self.attn_hc.merge(streams, attn, post, comb)
        post, comb, h = self.ffn_hc(streams)
        return streams, post, comb, self.post_attention_layernorm(h)


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
        self.hc_head = HyperHead(cfg, ops)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


# parameters the reference keeps in float32 whatever the model dtype
_FP32_SUFFIXES = ("_hc.fn", "_hc.base", "_hc.scale", "hc_head.hc_fn", "hc_head.hc_base", "hc_head.hc_scale",
                  "sinks", "position_bias", "norm.weight")


class DeepseekV4ForCausalLM(nn.Module):
    @property
    def traits(self) -> ModelTraits:
        """Decode is capturable on the host-sync-free expert path (grouped GEMM: bf16 on CUDA) and gathers the
        compressed entries up to the longest context (one graph per context bucket); windows and compressor rows
        are per-request state; the MTP heads draft (`mtp`); the layers split at the MoE exchange (`attend` /
        `finish`: two-batch overlap across attention)."""
        return ModelTraits(cuda_graph_decode=self.lm_head.weight.dtype == torch.bfloat16,
                           context_bucketed_graphs=True, per_request_state=True, two_batch_layers=True,
                           drafters=frozenset({"mtp"}) if len(self.mtp) else frozenset(),
                           prefill_scratch_bytes=expert_scratch_bytes(self))

    def __init__(self, cfg: DeepseekV4Config, ops: LayerOps = TORCH_OPS, parallel: ParallelContext | None = None,
                 kv_codec: KVCodec | None = None):
        """`ops`: the small fused kernels (here the mHC weights), chosen once by the runtime; `parallel`:
        this rank's place (with expert parallelism, which routed experts it holds); `kv_codec`: how the window
        rings and the compressed caches store their entries (None: in the model dtype; `Fp8DsMlaCodec`: DeepSeek's
        FlashMLA rows, EngineConfig.kv_cache_dtype="fp8_ds_mla")."""
        super().__init__()
        self.config, self.ops, self.kv_codec = cfg, ops, kv_codec
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
        self.hc_head = HyperHead(cfg, ops)
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
        the rings grow by that many rows, the HCA running state keeps one per position. With `kv_codec` the window
        rings and the compressed entries (`swa`, `csa_kv`, `hca_kv`) are its rows; the indexer's keys and the MTP
        heads' rings stay in `dtype`."""
        c, E = self.config, rollback_rows
        L, D, Di = c.num_hidden_layers, c.head_dim, c.index_head_dim
        n_csa, n_hca = len(c.layers_of(CSA)), len(c.layers_of(HCA))
        r_csa, r_hca = c.compress_rates[CSA], c.compress_rates[HCA]
        codec = self.kv_codec or IdentityCodec(dtype)
        Dk, kv_dtype = codec.stored_dim(D), codec.storage_dtype
        specs: list[CacheSpec] = [RequestStateSpec("swa", L, (c.sliding_window + E, Dk), kv_dtype)]
        if n_csa:
            specs += [PagedCacheSpec("csa_kv", n_csa, (Dk,), kv_dtype, r_csa),
                      PagedCacheSpec("csa_index", n_csa, (Di,), dtype, r_csa),
                      RequestStateSpec("csa_rows", n_csa, (2 * r_csa + E, 4 * D), torch.float32),
                      RequestStateSpec("csa_index_rows", n_csa, (2 * r_csa + E, 4 * Di), torch.float32)]
        if n_hca:
            specs += [PagedCacheSpec("hca_kv", n_hca, (Dk,), kv_dtype, r_hca),
                      RequestStateSpec("hca_state", n_hca, (1 + E, 3, D), torch.float32,
                                       needed_at_block_boundary=False)]
        if len(self.mtp):
            specs.append(RequestStateSpec("mtp_swa", len(self.mtp), (c.sliding_window + E, D), dtype))
        return specs

    def layer_state(self, caches: dict, i: int, step: dict | None = None) -> dict:
        """Layer i's caches, and `step`: the forward's dict of what its layers share (`decode_entries`)."""
        t, j = self.config.layer_types[i], self._state_index[i]
        state = {"swa": caches["swa"][i], "codec": self.kv_codec, "step": {} if step is None else step}
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
        ropes = [self._rope_for(t) for t in self.config.layer_types]
        tb = meta.two_batch
        if tb is not None:      # two micro-batches of whole requests, each its own metadata (distributed/two_batch.py)
            # and its own per-step dict (`decode_entries`: each half has its own decode rows)
            halves = ({}, {})
            states = [[self.layer_state(caches, i, halves[h]) for i in range(len(self.layers))] for h in (0, 1)]

            def attend(i, s, half):
                rows = tb.rows[half]
                return self.layers[i].attend(s, input_ids[rows], positions[rows], ropes[i], states[half][i],
                                             tb.metas[half])
            return self.hc_head(tb.run(streams, len(self.layers), attend,
                                       lambda i, s, flight: self.layers[i].finish(s, flight)))
        step = {}
        for i, layer in enumerate(self.layers):
            streams = layer(streams, input_ids, positions, ropes[i], self.layer_state(caches, i, step), meta)
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

    def join_projections(self) -> list[str]:
        """At load, after `quantize` (on the meta model): every attention's q_a_proj and kv_proj joined into one
        GEMM where the checkpoint stores them alike (the loader then fills `q_a_kv_proj` part by part). Returns the
        attentions joined."""
        return [n for n, m in list(self.named_modules()) if isinstance(m, DeepseekV4Attention) and m.join_projections()]

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
