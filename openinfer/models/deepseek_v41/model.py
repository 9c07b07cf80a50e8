"""DeepSeek-V4.1 (the spec's own model: `inference/config.json` form, DeepSeek's tensor names) over openinfer's
paged caches. Semantics are those of DeepSeek's reference inference code (vendored read-only in
`../shared/reference/deepseek_v41/`, the test oracle); docs/deepseek_v41.md explains the layout.

Read top to bottom: numerics shared with V4 (norms, interleaved RoPE) -> the compressor -> the lightning indexer
with the two-level top-k -> attention (sliding window + picked compressed entries + sinks) -> MoE -> the block
with lagged hyper-connections and Engram -> the model -> DSpark stages (their forward pieces; the drafting loop is
spec_decode/dspark.py's).

What V4.1 changes from V4 (deepseek_v4.py), as this file implements it:
- cross-layer compressed KV: only KV-source layers compress (ratio 2 or 1, no overlapping windows, no position
  bias); the layers after a source read its entries. Only index sources run the indexer; the layers after reuse
  its picks. Index keys come from the source's compressed latent (`wk` + `k_norm`), not from a compressor of
  their own. From the candidate source on, indexers score inside its candidate blocks only;
- the caches hold what DeepSeek stores: window keys FP8 (E8M0 scale per 32), compressed entries FP4 (E4M3 scale
  per 16), index keys FP4 (E8M0 per 32); indexer queries are FP4-rounded too; FP8 weights quantize their
  activations per 32 (`act_quant`), MXFP4 experts too;
- hyper-connections are lagged: the pre-mix a sublayer computes collapses the streams for the next sublayer, and
  the last FFN's mix collapses them before the head (no separate hc head); no per-head query norm;
- Engram layers add gated n-gram table lookups to the streams (openinfer/layers/engram.py).

Per-forward data the reference keeps in a module-level runtime (the latest source's picks and candidate blocks)
lives in a `StepShared` made per forward; the caches are per layer kind:
- `swa` (request state): each layer's ring of the last W window keys (position p at row p % R);
- `ckv{r}` / `cidx{r}` (paged, one entry per r tokens): compressed entries and index keys of the ratio-r sources;
- `crows{r}` (request state, r > 1): the source compressors' projected rows of the open group (row p % R);
- `ngram` (request state): the compressed ids of the last max_ngram-1 tokens (Engram's look-back, row p % R).
Prefill chunks run per sequence (any start and length); decode rows run batched; both read what the previous
step left in the state and write it back. Each ring is indexed by position and keeps `rollback_rows` rows
beyond what it needs (R = need + rollback_rows; EngineConfig.rollback_rows, 0 without speculation), so after a verify
step whose drafts were rejected the next step starts from the last accepted position and never reads what the
drafts wrote (spec 000 §5.3's extra ring slots; docs/spec_decode.md, "Rolling back DeepSeek state").

Where the reference is not causal (top-k on tied scores) this file is: ties go to the earlier entry.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from openinfer.device_io import ReadOnce, h2d
from openinfer.distributed.context_parallel import query_spans
from openinfer.distributed.expert_parallel import ExpertRouting, expert_parallel_moe, initial_layout
from openinfer.distributed.parallel_state import ParallelContext
from openinfer.kv_cache.spec import CacheSpec, PagedCacheSpec, RequestStateSpec
from openinfer.layers.attention import AttentionMetadata
from openinfer.layers.basic import TORCH_OPS, LayerOps, StackedLinear, sort_by_expert, torch_hc_weights
from openinfer.layers.engram import Engram, EngramLayout, NgramHasher
from openinfer.layers.fp8_linear import join_linears, to_fp8_linear
from openinfer.layers.index_topk import torch_index_topk
from openinfer.layers.sparse_attention import V41_SOFTMAX, attend_v41, prefill_batch, stack_picks
from openinfer.models.deepseek_v4.model import (Experts, InterleavedRope, QuantizedExperts, RMSNorm, RopeRows,
                                                apply_rope, decode_entries, entry_index, expert_scratch_bytes,
                                                ring_in_glue)
from openinfer.models.deepseek_v41.config import DeepseekV41Config
from openinfer.models.deepseek_v41.vision import Aligner, ViT, check_prompt_image, embed_span
from openinfer.models.interface import ImageRows, ModelTraits
from openinfer.multimodal import ImageSpan
from openinfer.quantization.kv_formats import Fp4BlockCodec, Fp8BlockCodec, IdentityCodec


# ---- the compressor -----------------------------------------------------------------------------------
class Compressor(nn.Module):
    """A KV source's compressed entries: group g pools tokens [g*r, (g+1)*r) with a per-channel softmax gate
    (float32, weights kept float32), then RMS-norms; ratio 1 is a plain projection + norm. Returns latents
    before RoPE (the indexer keys need them so). State (r > 1): the projected rows of the open group, [r, 2*D]
    float32 (kv | score), row p % R in a ring of R = r + rollback_rows rows."""

    def __init__(self, dim: int, head_dim: int, ratio: int, eps: float, ops: LayerOps = TORCH_OPS):
        """`ops`: the fused decode step (`v41_compress_decode`), where the runtime chose one."""
        super().__init__()
        self.ratio, self.head_dim, self.ops = ratio, head_dim, ops
        self.wkv = nn.Linear(dim, head_dim, bias=False)
        if ratio > 1:
            self.wgate = nn.Linear(dim, head_dim, bias=False)
        self.norm = RMSNorm(head_dim, eps)

    def rows(self, x: torch.Tensor) -> torch.Tensor:
        if self.ratio == 1:
            return self.wkv(x)
        xf = x.float()
        return torch.cat((F.linear(xf, self.wkv.weight.float()), F.linear(xf, self.wgate.weight.float())), -1)

    def _pool(self, groups: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """groups [G, r, 2D] float32 -> latents [G, D]."""
        D = self.head_dim
        kv, score = groups[..., :D], groups[..., D:]
        return self.norm((kv * score.softmax(dim=-2)).sum(dim=-2).to(dtype))

    def chunk(self, rows: torch.Tensor, start: int, state: torch.Tensor | None, dtype: torch.dtype):
        """One sequence's chunk of rows for positions [start, start + n): (latents [G, D], first group id) of the
        groups it closes; keeps the open group's rows in `state`."""
        r, n = self.ratio, rows.shape[0]
        if r == 1:
            return self.norm(rows), start
        R, dev = state.shape[0], rows.device
        end = start + n
        first, last = start // r, end // r             # groups [first, last) close in this chunk
        lead = start - first * r                        # rows of group `first` from earlier steps
        if lead:                                        # positions [first * r, end)
            rows_all = torch.cat((state[torch.arange(first * r, start, device=dev) % R], rows))
        else:
            rows_all = rows
        closed = (last - first) * r
        latents = self._pool(rows_all[:closed].view(-1, r, rows.shape[-1]), dtype) if last > first else None
        keep = min(n, R)                                # the open group's rows (and room for a rollback)
        state[torch.arange(end - keep, end, device=dev) % R] = rows[n - keep:]
        return latents, first

    def decode(self, rows: torch.Tensor, positions: torch.Tensor, state: torch.Tensor | None,
               slots: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Decode rows (one token each): (latents [B, D] — meaningful where the token closes its group —,
        closes [B] bool)."""
        r = self.ratio
        if r == 1:
            return self.norm(rows), torch.ones_like(positions, dtype=torch.bool)
        R = state.shape[1]
        state[slots, positions % R] = rows
        group_rows = ((positions + 1) // r - 1)[:, None] * r + torch.arange(r, device=positions.device)
        return self._pool(state[slots[:, None], group_rows % R], dtype), (positions + 1) % r == 0


# ---- the lightning indexer and the two-level top-k ----------------------------------------------------
def select_candidate_blocks(scores: torch.Tensor, num_closed: torch.Tensor, topk_blocks: int,
                            block_size: int, topk=torch_index_topk) -> torch.Tensor:
    """Level one of the two-level top-k: scores [T, N] (unreachable entries -inf) -> bool [T, ceil(N /
    block_size)], True for the `topk_blocks` best blocks of `block_size` entries (a block scores its best entry;
    ties to the earlier block; `topk`: `LayerOps.index_topk`). The block holding a query's newest entry is always
    kept (partly filled, it could otherwise lose to older full blocks)."""
    T, N = scores.shape
    blocks = F.pad(scores, (0, -N % block_size), value=float("-inf")).view(T, -1, block_size).amax(-1)
    nb = blocks.shape[1]
    newest = ((num_closed - 1) // block_size)[:, None]
    blocks = blocks.masked_fill((torch.arange(nb, device=scores.device)[None, :] == newest) & (newest >= 0),
                                float("inf"))
    picks, valid = topk(blocks, topk_blocks)
    return torch.zeros_like(blocks, dtype=torch.bool).scatter_(-1, picks, valid)


class Indexer(nn.Module):
    """Scores sum_h w_h * relu(q_h . k) over a KV source's index keys and keeps the top `index_topk` entries per
    query. Queries and keys are FP4-rounded (groups of 32, E8M0) as DeepSeek stores/computes them; scores are
    rounded to the model dtype where the reference's bf16 einsum rounds them, so its choice is ours on
    tie-free inputs. `owns_keys`: this source also makes the keys (from its compressor's latent)."""

    def __init__(self, cfg: DeepseekV41Config, owns_keys: bool, ops: LayerOps = TORCH_OPS):
        """`ops`: the top-k (`index_topk`) and the fused paged scores (`index_scores` for decode rows,
        `index_prefill_scores` for prefill chunks)."""
        super().__init__()
        self.n_heads, self.head_dim, self.topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        self.ops = ops
        self.wq_b = nn.Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.weights_proj = nn.Linear(cfg.dim, self.n_heads, bias=False)
        if owns_keys:
            self.wk = nn.Linear(cfg.head_dim, self.head_dim, bias=False)
            self.k_norm = RMSNorm(self.head_dim, cfg.norm_eps)

    def keys(self, latents, cos, sin) -> torch.Tensor:
        """Index keys before their cache's rounding (FP4, groups of 32, E8M0: the cache codec's)."""
        return apply_rope(self.k_norm(self.wk(latents)), cos, sin)

    def queries(self, x, qr, at: RopeRows, quantize: bool) -> tuple[torch.Tensor, torch.Tensor]:
        q = at(self.wq_b(qr).view(-1, self.n_heads, self.head_dim), fp4_group=32 if quantize else 0)
        return q, self.weights_proj(x) * (self.head_dim ** -0.5 * self.n_heads ** -0.5)

    @staticmethod
    def scores(q, weights, keys, num_closed) -> torch.Tensor:
        """q [T, H, d], weights [T, H], keys [N, d] (shared) or [T, N, d] -> float32 [T, N], -inf where closed
        entries end."""
        dt = q.dtype
        eq = "thd,nd->thn" if keys.dim() == 2 else "thd,tnd->thn"
        s = torch.einsum(eq, q.float(), keys.float()).to(dt)
        s = (F.relu(s) * weights[..., None]).float().sum(1).to(dt).float()
        closed = torch.arange(s.shape[-1], device=s.device)[None, :] < num_closed[:, None]
        return s.masked_fill(~closed, float("-inf"))

    def pick(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top `index_topk` entries of scores [T, N] (ties: the earlier) -> (entries [T, k] in position order, as
        the reference attends, valid [T, k]: score above -inf)."""
        return self.ops.index_topk(scores, self.topk)

    def fused_scores(self, codec, prefill: bool = False) -> dict | None:
        """The paged scores kernel for index keys stored with `codec` (DeepSeek's FP4 rows, or unquantized) and its
        keyword arguments: {"kernel": ops.index_scores (decode rows) or ops.index_prefill_scores (a chunk's
        queries), ...}; None where the ops have no kernel for them (the torch path then runs)."""
        kernel = self.ops.index_prefill_scores if prefill else self.ops.index_scores
        if kernel is None:
            return None
        if isinstance(codec, Fp4BlockCodec) and (codec.group, codec.scale_fmt) == (32, "e8m0"):
            return {"kernel": kernel, "fp4": True, "round_products": True}
        if isinstance(codec, IdentityCodec):
            return {"kernel": kernel, "fp4": False, "round_products": True}
        return None


class StepShared:
    """What a forward hands down its layers (the reference's `shared_attn`, made per forward): per span (the
    decode rows, then each prefill chunk), the latest index source's picks and the candidate blocks; and the decode
    rows' compressed entries per ratio (`deepseek_v4.model.decode_entries`)."""

    def __init__(self):
        self.picks: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.candidates: dict[int, torch.Tensor] = {}
        self.entries: dict = {}


# ---- attention ----------------------------------------------------------------------------------------
def cache_rows(cache: torch.Tensor) -> torch.Tensor:
    """A paged cache [blocks, entries_per_block, D] as rows [blocks * entries_per_block, D]."""
    return cache.view(-1, cache.shape[-1])


class Attention(nn.Module):
    """Shared-KV MQA (one K=V head) over the sliding window plus, on compressed layers, the index source's
    picked compressed entries, with a per-head sink logit; the output's RoPE slice is rotated back and a
    grouped low-rank projection (`wo_a`, bf16 as published) follows. Decode rows attend through
    `ops.sparse_decode_attention` (keys read and decoded in place from the ring and the paged cache: one fused launch
    on CUDA); prefill chunks, where the runtime chose `ops.sparse_prefill_attention`, all at once through it (keys
    read and decoded in place: one launch per layer with the Triton kernel), else each through `attend_v41`."""

    quantized_caches = True     # window keys FP8, compressed entries and indexer keys/queries FP4 (DeepSeek's)

    def __init__(self, cfg: DeepseekV41Config, layer: int, ops: LayerOps = TORCH_OPS):
        super().__init__()
        self.cfg, self.layer, self.ops = cfg, layer, ops
        H, D = cfg.n_heads, cfg.head_dim
        self.n_heads, self.head_dim, self.window, self.rd = H, D, cfg.window_size, cfg.rope_head_dim
        self.scale = D ** -0.5
        self.ratio = cfg.ratio(layer)
        self.attn_sink = nn.Parameter(torch.zeros(H))
        self.wq_a = nn.Linear(cfg.dim, cfg.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.norm_eps, ops)
        self.wq_b = nn.Linear(cfg.q_lora_rank, H * D, bias=False)
        self.wkv = nn.Linear(cfg.dim, D, bias=False)
        # wq_a and wkv (both read x) joined at load where stored alike (`join_projections`): one GEMM
        self.wq_a_kv: nn.Module | None = None
        self.kv_norm = RMSNorm(D, cfg.norm_eps, ops)
        self.wo_a = nn.Linear(H * D // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank, bias=False)
        self.wo_b = nn.Linear(cfg.o_groups * cfg.o_lora_rank, cfg.dim, bias=False)
        backbone = layer < cfg.n_layers
        self.is_kv_source = backbone and layer in cfg.kv_source_layers
        self.is_index_source = backbone and layer in cfg.index_source_layers
        self.is_candidate_source = backbone and layer == cfg.candidate_source_layer
        self.uses_candidates = backbone and cfg.uses_candidates(layer)
        if self.is_kv_source:
            self.compressor = Compressor(cfg.dim, D, self.ratio, cfg.norm_eps, ops)
        if self.is_index_source:
            self.indexer = Indexer(cfg, cfg.owns_index_keys(layer), ops)
        # a CED decoder layer: under a YOCO prefill its window attention is truncated to the decoder's tokens
        self.is_decoder = cfg.yoco_split is not None and cfg.yoco_split <= layer < cfg.n_layers

    # -- forward over the step's spans
    def forward(self, x, positions, ropes, state: dict, meta: AttentionMetadata, shared: StepShared,
                close_groups: bool = True, cp=None):
        """`close_groups` False: this step's compressed groups were already closed (`close_all`, YOCO). `cp`
        (context parallelism, distributed/context_parallel.py): `x`, `positions` and `meta` are the whole step's;
        the KV side (window ring, compressor groups, indexer keys) runs on every row as one process does, queries,
        the indexer's picks and attention only on this rank's rows, whose outputs are returned."""
        rope = ropes["compress" if self.ratio else "main"]
        at = RopeRows(rope, positions, torch.float32, self.ops)
        qx, q_at = (x, at) if cp is None else (x[cp.local_index], at.take(cp.local_index))
        q_a, kv_x = self.q_kv(x)
        qr = self.q_norm(q_a if cp is None else q_a[cp.local_index])
        T = qr.shape[0]
        q = q_at(self.wq_b(qr).view(T, self.n_heads, self.head_dim))
        stored = ring_in_glue(self.ops, meta, state["codecs"]["swa"])    # decode rows' keys stored as they are made
        kv_stored = at(kv_x, self.kv_norm, codec=state["codecs"]["swa"],
                       ring=(state["swa"], meta.decode_state_slots) if stored else None)
        # as every later step reads them (prefill chunks; decode rows read the ring in place)
        kv = state["codecs"]["swa"].decode(kv_stored, x.dtype) if meta.prefills else None
        rows = self.compressor.rows(x) if self.is_kv_source and close_groups else None
        iq = self.indexer.queries(qx, qr, q_at, self.quantized_caches) if self.is_index_source else None
        out = torch.empty_like(q)
        codecs = state["codecs"]
        batched = self.ops.sparse_prefill_attention is not None and cp is None
        chunks = []
        for span, (sl, qsl, sel, p) in enumerate(query_spans(meta, cp, x.device)):
            crows, siq = (None if rows is None else rows[sl]), (None if iq is None else (iq[0][qsl], iq[1][qsl]))
            if p is None:               # decode rows: keys read in place, one fused launch on CUDA
                self._decode(q[qsl], out[qsl], kv_stored[sl], positions[sl], crows, siq, x[sl], rope, state, meta,
                             shared, span, close_groups, stored)
                continue
            if batched:                 # groups closed and picked now; attention for every chunk at once below
                picks = None
                if self.ratio:
                    flat, pk, valid = self._compressed(positions[sl], crows, siq, x[sl], rope, state, meta, p, shared,
                                                       span, close_groups)
                    picks = (flat[pk], valid)
                chunks.append((p, picks))
                continue
            win = self._window(kv[sl], kv_stored[sl], positions[sl], state, p)
            if sel is not None:         # this rank's queries of the chunk: their rows of the window's columns
                win = (win[0], win[1][sel], win[2][sel])
            comp = None
            if self.ratio:
                flat, picks, valid = self._compressed(positions[sl], crows, siq, x[sl], rope, state, meta, p, shared,
                                                      span, close_groups, None if sel is None else positions[sl][sel])
                comp = (codecs["ckv"].decode(cache_rows(state["ckv"])[flat], x.dtype), valid, picks)
            if q[qsl].shape[0]:
                out[qsl] = self._attend(q[qsl], win, comp)
        if chunks:
            self._prefill(q, out, kv, kv_stored, positions, chunks, state)
        o = q_at(out, inverse=True).view(T, self.cfg.o_groups, self.n_heads * self.head_dim // self.cfg.o_groups)
        wo_a = self.wo_a.weight.view(self.cfg.o_groups, self.cfg.o_lora_rank, -1)
        return self.wo_b(torch.einsum("tgd,grd->tgr", o, wo_a.to(o.dtype)).flatten(1))

    def q_kv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(wq_a(x), wkv(x)): one GEMM and two column views of it where the loader joined them (`wq_a_kv`)."""
        if self.wq_a_kv is not None:
            return self.wq_a_kv.split(self.wq_a_kv(x))
        return self.wq_a(x), self.wkv(x)

    def join_projections(self) -> bool:
        """Join wq_a and wkv into `wq_a_kv` (fp8_linear.join_linears: where they are stored alike)."""
        return join_linears(self, ("wq_a", "wkv"), "wq_a_kv")

    def _decode(self, q, out, kv_stored, positions, rows, iq, x, rope, state, meta, shared: StepShared, span: int,
                close_groups: bool, stored: bool = False) -> None:
        """Decode rows (one token each): store their window keys in the ring (`stored`: `ops.v4_kv_ring` did) and
        (compressed layers) close the groups they complete and pick, then attend over the ring's last W positions, the
        picked entries and the sinks into `out`."""
        ring, slots, codecs = state["swa"], meta.decode_state_slots, state["codecs"]
        if not stored:
            ring[slots, positions % ring.shape[1]] = kv_stored
        comp = {}
        if self.ratio:
            flat, picks, valid = self._compressed(positions, rows, iq, x, rope, state, meta, None, shared, span,
                                                  close_groups)
            comp = dict(cache=state["ckv"], rows=flat.gather(1, picks), valid=valid, cache_codec=codecs["ckv"])
        self.ops.sparse_decode_attention(q, sinks=self.attn_sink, scale=self.scale, softmax=V41_SOFTMAX, ring=ring,
                                         slots=slots, positions=positions, window=self.window,
                                         ring_codec=codecs["swa"], out=out, **comp)

    def _prefill(self, q, out, kv, kv_stored, positions, chunks, state) -> None:
        """Every prefill chunk of the step through one `ops.sparse_prefill_attention` call (window keys read in place:
        the ring's history, decoded, then the chunks' own keys as the ring holds them, stored in it after), into
        `out`."""
        ring, codecs = state["swa"], state["codecs"]
        sl, cu, slots = prefill_batch([p for p, _ in chunks], q.device)
        comp = {}
        if self.ratio:
            rows, valid = stack_picks([c[1][0] for c in chunks], [c[1][1] for c in chunks])
            comp = dict(cache=state["ckv"], rows=rows, valid=valid, cache_codec=codecs["ckv"])
        floors = None
        if self.is_decoder and any(p.decoder_start is not None for p, _ in chunks):   # YOCO: the decoder's tokens
            floors = h2d(torch.tensor([-1 if p.decoder_start is None else p.decoder_start for p, _ in chunks],
                                      dtype=torch.int64), q.device)
        self.ops.sparse_prefill_attention(q[sl], sinks=self.attn_sink, scale=self.scale, softmax=V41_SOFTMAX,
                                          kv=kv[sl], positions=positions[sl], cu_seqlens=cu, ring=ring, slots=slots,
                                          window=self.window, ring_codec=codecs["swa"], floors=floors, out=out[sl],
                                          **comp)
        for p, _ in chunks:
            rs = slice(p.query_start, p.query_start + p.query_len)
            self._store_window(kv_stored[rs], positions[rs], ring[p.state_slot])

    @staticmethod
    def _store_window(kv_stored, positions, ring) -> None:
        """A chunk's stored keys into its ring [R, stored] (the last R of them)."""
        keep = min(len(kv_stored), ring.shape[0])
        ring[positions[-keep:] % ring.shape[0]] = kv_stored[-keep:]

    def _window(self, kv, kv_stored, positions, state, p):
        """A chunk's window keys, in the reference's column order (so the softmax sums run as its kernel's do):
        (keys [W + n, D] of positions start-W .. end-1, index [n, Wc] into them, valid), Wc = min(context, W)
        columns from max(P-W+1, 0) (invalid past P). Stores the new keys in the ring (after reading the history);
        R = W + rollback_rows."""
        W, dev, ring, codec = self.window, kv.device, state["swa"], state["codecs"]["swa"]
        R = ring.shape[1]
        ring = ring[p.state_slot]
        start = p.context_len - p.query_len
        hist = torch.arange(start - W, start, device=dev)
        keys = torch.cat((codec.decode(ring[hist % R], kv.dtype), kv))
        wc = min(p.context_len, W)
        kpos = (positions[:, None] - W + 1).clamp(min=0) + torch.arange(wc, device=dev)
        self._store_window(kv_stored, positions, ring)
        valid = kpos <= positions[:, None]
        if self.is_decoder and p.decoder_start is not None:     # YOCO: only the decoder's own tokens
            valid &= kpos >= p.decoder_start
        return keys, kpos - (start - W), valid

    def _compressed(self, positions, rows, iq, x, rope, state, meta, p, shared: StepShared, span: int,
                    close_groups: bool = True, q_pos=None):
        """(flat, picks, valid): the compressed entries this span's queries attend to — `flat` the rows of entries
        0 .. n-1 in the paged cache viewed as rows ([T, n] for decode rows, [n] for a chunk), `picks` [T, k] into
        them. The KV source first closes the groups its new tokens complete (entries + index keys into the paged
        caches), then the index source scores (or the picks of the latest one are reused). `q_pos`: the queries'
        positions when they are some of the span's rows (context parallelism), else None."""
        r = self.ratio
        cidx = state.get("cidx")
        if p is None:           # (the same for every layer of the ratio: made once per step)
            tables = meta.decode_block_tables
            flat, num_closed, n = decode_entries(self.ops, meta, positions, r, state["ckv"].shape[1], shared.entries)
        else:
            num_closed = ((positions if q_pos is None else q_pos) + 1) // r
            n = max(p.context_len // r, 1)
            flat = entry_index(p.block_ids, torch.arange(n, device=positions.device), state["ckv"].shape[1])
        if self.is_kv_source and close_groups:
            self._close_groups(positions, rows, rope, state, meta, p, x.dtype)
        if self.is_index_source:
            fused = self.indexer.fused_scores(state["codecs"]["cidx"], prefill=p is not None)
            if fused is not None and iq[0].shape[0]:
                if p is not None:           # every query of the chunk reads its one block table (no copy)
                    tables = p.block_ids[None].expand(iq[0].shape[0], -1)
                shared.picks[span] = self._index_paged(iq, cidx, tables, n, num_closed, shared, span, fused,
                                                       budget=None if p is None else 1 << 26)
            else:
                shared.picks[span] = self._index(iq, state["codecs"]["cidx"].decode(cache_rows(cidx)[flat], x.dtype),
                                                 num_closed, shared, span)
        picks, valid = shared.picks[span]
        return flat, picks, valid

    def _index(self, iq, keys, num_closed, shared: StepShared, span: int, budget: int = 1 << 26):
        """The indexer's picks for the span's queries, in query blocks whose scores hold about `budget` floats
        (a long chunk over a long context would otherwise score [T, heads, N] at once). The candidate source
        publishes its blocks [T, N / candidate_block_size]; later index sources score inside them."""
        q, w = iq
        T, N, bs = q.shape[0], keys.shape[-2], self.cfg.candidate_block_size
        if T == 0:          # context parallelism: this rank has no query in the span (it still closed its groups)
            none = torch.zeros((0, min(self.cfg.index_topk, N)), dtype=torch.long, device=q.device)
            if self.is_candidate_source:
                shared.candidates[span] = torch.zeros((0, -(-N // bs)), dtype=torch.bool, device=q.device)
            return none, none.bool()
        step = max(1, budget // (self.indexer.n_heads * N))
        picks, valid, blocks = [], [], []
        for i0 in range(0, T, step):
            sl = slice(i0, min(i0 + step, T))
            scores = self.indexer.scores(q[sl], w[sl], keys if keys.dim() == 2 else keys[sl], num_closed[sl])
            if self.is_candidate_source:
                blocks.append(select_candidate_blocks(scores, num_closed[sl], self.cfg.candidate_topk_blocks, bs,
                                                      self.indexer.ops.index_topk))
            elif self.uses_candidates:
                inside = shared.candidates[span][sl].repeat_interleave(bs, dim=-1)[:, :N]
                scores = scores.masked_fill(~inside, float("-inf"))
            pk, ok = self.indexer.pick(scores)
            picks.append(pk)
            valid.append(ok)
        if self.is_candidate_source:
            shared.candidates[span] = torch.cat(blocks)
        return torch.cat(picks), torch.cat(valid)

    def _index_paged(self, iq, cidx, tables, n, num_closed, shared: StepShared, span: int, fused: dict,
                     budget: int | None = None):
        """`_index` through the paged scores kernel (`Indexer.fused_scores`: `ops.index_scores` for decode rows,
        `ops.index_prefill_scores` for a chunk's queries, `tables` [T, W] their block tables): the index keys read
        (and decoded) in place, the candidate blocks masked in the same launch, no [T, heads, N] scores. `budget`:
        queries in blocks whose scores hold about that many floats (None: all at once)."""
        bs, ops = self.cfg.candidate_block_size, self.indexer.ops
        scores_fn = fused.pop("kernel")
        inside = shared.candidates[span] if self.uses_candidates else None
        if inside is not None and inside.shape[1] * bs < n:
            raise ValueError(f"the candidate blocks cover {inside.shape[1] * bs} entries, this layer scores {n}")
        q, w = iq
        T = q.shape[0]
        step = T if budget is None else max(1, budget // max(n, 1))
        picks, valid, blocks = [], [], []
        for i0 in range(0, T, step):
            sl = slice(i0, min(i0 + step, T))
            scores = scores_fn(q[sl], w[sl], cidx, tables[sl], n, num_closed[sl], 1.0,
                               candidates=None if inside is None else inside[sl], candidate_block=max(bs, 1), **fused)
            if self.is_candidate_source:
                blocks.append(select_candidate_blocks(scores, num_closed[sl], self.cfg.candidate_topk_blocks, bs,
                                                      ops.index_topk))
            pk, ok = self.indexer.pick(scores)
            picks.append(pk)
            valid.append(ok)
        if self.is_candidate_source:
            shared.candidates[span] = blocks[0] if len(blocks) == 1 else torch.cat(blocks)
        return (picks[0], valid[0]) if len(picks) == 1 else (torch.cat(picks), torch.cat(valid))

    def close_all(self, x, positions, ropes, state: dict, meta: AttentionMetadata) -> None:
        """Close this KV source's groups for every token of the step (YOCO: the decoder's global KV is a projection
        of the encoder's output, so it is made for all tokens, also those that skip the decoder)."""
        rows = self.compressor.rows(x)
        for sl, p in spans_of(meta):
            self._close_groups(positions[sl], rows[sl], ropes["compress"], state, meta, p, x.dtype)

    def _close_groups(self, positions, rows, rope, state, meta, p, dtype) -> None:
        comp, r = self.compressor, self.ratio
        epb = state["ckv"].shape[1]
        if p is None and self._fused_close(state):
            self._close_groups_fused(positions, rows, rope, state, meta, dtype)
            return
        if p is None:
            latents, closes = comp.decode(rows, positions, state.get("crows"), meta.decode_state_slots, dtype)
            group = ((positions + 1) // r - 1).clamp(min=0)
            scratch = (state["ckv"].shape[0] - 1) * epb           # the runner's spare block
            dst = torch.where(closes, entry_index(meta.decode_block_tables, group[:, None], epb)[:, 0], scratch)
        else:
            start = p.context_len - p.query_len
            crows = state["crows"][p.state_slot] if r > 1 else None
            latents, first = comp.chunk(rows, start, crows, dtype)
            if latents is None:
                return
            group = torch.arange(first, first + latents.shape[0], device=positions.device)
            dst = entry_index(p.block_ids, group, epb)
        cos, sin = rope.cos_sin(group * r, torch.float32)
        if "cidx" in state:
            cache_rows(state["cidx"])[dst] = state["codecs"]["cidx"].encode(self.indexer.keys(latents, cos, sin))
        cache_rows(state["ckv"])[dst] = state["codecs"]["ckv"].encode(apply_rope(latents, cos, sin))

    def _fused_close(self, state) -> bool:
        """Whether decode rows close their groups through `ops.v41_compress_decode` / `v41_index_keys_decode`: the
        runtime chose them and the caches hold what their kernels write (DeepSeek's FP4 rows, or unquantized)."""
        ops, codecs = self.compressor.ops, state["codecs"]

        def writable(kind: str, group: int, scale_fmt: str) -> bool:
            c = codecs[kind]
            return isinstance(c, IdentityCodec) or (
                isinstance(c, Fp4BlockCodec) and (c.group, c.scale_fmt) == (group, scale_fmt))

        return (ops.v41_compress_decode is not None and ops.v41_index_keys_decode is not None
                and writable("ckv", 16, "e4m3") and ("cidx" not in state or writable("cidx", 32, "e8m0")))

    def _close_groups_fused(self, positions, rows, rope, state, meta, dtype) -> None:
        """`_close_groups` for decode rows in two launches around the index keys' projection: the group step (ring,
        pooling, norm, RoPE, the FP4 entry) and the index keys (k_norm, RoPE, FP4); rows that close no group write
        nothing (the torch path writes them to the scratch block)."""
        comp, ops, tables = self.compressor, self.compressor.ops, meta.decode_block_tables
        latents = ops.v41_compress_decode(state.get("crows"), state["ckv"], rows, positions, meta.decode_state_slots,
                                          tables, meta.decode_row_offsets, comp.norm.weight, comp.norm.eps,
                                          rope.inv_freq, rope.scale, self.ratio, dtype)
        if "cidx" in state:
            ix = self.indexer
            ops.v41_index_keys_decode(state["cidx"], ix.wk(latents), positions, tables, ix.k_norm.weight,
                                      ix.k_norm.eps, rope.inv_freq, rope.scale, self.ratio)

    def _attend(self, q, win, comp):
        """`attend_v41` with this layer's sinks (the picks in position order: the reference's column order)."""
        return attend_v41(q, win, comp, self.attn_sink, self.scale)


def spans_of(meta: AttentionMetadata) -> list[tuple[slice, object]]:
    """The step's spans: the decode rows (batched) first, then each prefill chunk."""
    spans = [(slice(0, meta.num_decode_tokens), None)] if meta.num_decode_tokens else []
    return spans + [(slice(p.query_start, p.query_start + p.query_len), p) for p in meta.prefills]


# ---- MoE ----------------------------------------------------------------------------------------------
class Gate(nn.Module):
    """sqrt(softplus) scores in float32; experts = top-k of scores + the selection bias; weights = the chosen
    unbiased scores, renormalized, times route_scale. `ops.route` does all of it after the logits in one kernel."""

    def __init__(self, dim: int, n_experts: int, topk: int, route_scale: float, vision: bool = False,
                 ops: LayerOps = TORCH_OPS):
        """`vision`: a second selection bias, `bias_vl`, for tokens inside image spans."""
        super().__init__()
        self.topk, self.route_scale, self.ops = topk, route_scale, ops
        self.weight = nn.Parameter(torch.zeros(n_experts, dim))
        self.bias = nn.Parameter(torch.zeros(n_experts))
        self.bias_vl = nn.Parameter(torch.zeros(n_experts)) if vision else None

    def forward(self, x, image_mask: torch.Tensor | None = None):
        """`image_mask` [T] bool: rows inside an image span, which select experts with `bias_vl`."""
        logits = _float32_linear(x, self.weight)
        image_rows = image_mask is not None and self.bias_vl is not None
        if self.ops.route is not None:
            return self.ops.route(logits, self.bias, self.topk, self.route_scale, self.topk > 1,
                                  alt_bias=self.bias_vl if image_rows else None,
                                  alt_rows=image_mask if image_rows else None)
        scores = F.softplus(logits).sqrt()
        bias = self.bias.float()
        if image_rows:
            bias = torch.where(image_mask[:, None], self.bias_vl.float(), bias)
        experts = torch.topk(scores + bias, self.topk, dim=-1).indices
        weights = scores.gather(1, experts)
        if self.topk > 1:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return experts, weights * self.route_scale


class Expert(nn.Module):
    """The shared expert: clamped SwiGLU in float32 between the model-dtype projections. The checkpoint's w1 (gate)
    and w3 (up) are stacked at load into one `w13` [2 * inter, dim] (the loader's `_SHARED_PART`): one GEMM whose
    rows are each the two GEMMs' dot products; `ops.moe_act` (the routed experts' activation kernel) then replaces
    the casts, clamps, silu, product and rounding (seven kernels) with one launch."""

    def __init__(self, dim: int, inter: int, limit: float, ops: LayerOps = TORCH_OPS):
        super().__init__()
        self.w13 = StackedLinear(dim, (inter, inter))
        self.w2 = nn.Linear(inter, dim, bias=False)
        self.limit, self.ops = limit, ops

    def forward(self, x):
        gate_up = self.w13(x)
        if self.ops.moe_act is not None:
            return self.w2(self.ops.moe_act(gate_up, self.limit if self.limit > 0 else None))
        gate, up = gate_up.float().chunk(2, dim=-1)
        if self.limit > 0:
            gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
        return self.w2((F.silu(gate) * up).to(x.dtype))


class MoE(nn.Module):
    """Routed experts (stacked; MXFP4 as published or bf16) + the shared expert, summed in float32. The routing
    weight scales the intermediate activation before `w2` (the reference's order, which matters once that
    activation is FP8-quantized for the quantized GEMM).

    Expert parallelism (`ep_layout`, as DeepSeek-V4's MoE): this rank holds `slots` of the physical expert slots
    (`routing` maps logical experts to them, EPLB moves them); every rank's rows are exchanged
    (distributed/expert_parallel.py), this rank computes its slots' float32 partial sums, and they come back
    summed onto each row's rank. The shared expert runs where its rows are."""

    def __init__(self, cfg: DeepseekV41Config, layer: int, ops: LayerOps = TORCH_OPS,
                 parallel: ParallelContext | None = None, ep_layout: tuple[int, int] | None = None):
        super().__init__()
        n_experts, topk = cfg.moe_shape(layer)
        self.gate = Gate(cfg.dim, n_experts, topk, cfg.route_scale, vision=cfg.vision_n_layers > 0, ops=ops)
        self.parallel = parallel or ParallelContext.single()
        slots = n_experts
        if ep_layout is not None:            # (slots per rank, most replicas one expert can have)
            slots, max_replicas = ep_layout
            self.routing = ExpertRouting(n_experts, max_replicas, slots, self.parallel.ep_rank)
        shape = _ExpertShape(slots, cfg.dim, cfg.moe_inter_dim, cfg.swiglu_limit)
        self.ops = ops
        self.experts = Experts(shape, ops)
        self.shared_experts = Expert(cfg.dim, cfg.moe_inter_dim, cfg.swiglu_limit, ops)
        self.limit = cfg.swiglu_limit

    def _act(self, gate_up: torch.Tensor, weights: torch.Tensor, dtype) -> torch.Tensor:
        gate, up = gate_up.float().chunk(2, dim=-1)
        if self.limit > 0:
            gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
        return (F.silu(gate) * up * weights[:, None]).to(dtype)

    def forward(self, x, meta: AttentionMetadata | None = None, image_mask: torch.Tensor | None = None):
        """`meta`: the step's metadata, read with expert parallelism only (the exchange's lockstep sizes);
        `image_mask`: rows inside image spans (routed with the gate's `bias_vl`)."""
        experts, weights = self.gate(x, image_mask)
        if hasattr(self, "routing"):
            y = expert_parallel_moe(x, experts, weights, self.routing, self.routed, meta, self.parallel)
            if len(x):      # none: a YOCO step whose rows all stopped before the decoder, joining the exchange
                y = y + self.shared_experts(x)  # float32 by promotion: the sum of the widened values, one kernel
        else:
            y = self.routed(x, experts, weights, self.shared_experts(x) if len(x) else None)
        return y.to(x.dtype)

    def routed(self, x, experts, weights, add: torch.Tensor | None = None) -> torch.Tensor:
        """float32 [T, dim]: the routed experts' weighted sum for rows x [T, dim]; experts [T, k] slot ids of this
        layer's stack (-1: computed on another rank), weights [T, k] float32; `add` [T, dim] (the shared expert's
        rows): added to the float32 sum (in the combine's epilogue where the runtime chose `ops.moe_combine_add`)."""
        ex = self.experts          # quantized experts round their rows to FP8 themselves (LayerOps.quantize_activations)
        if ex.grouped and self.ops.moe_combine is not None:   # sorting, activation, combining: one kernel each
            order, rows, inv, offs = self.ops.expert_order(experts, ex.gate_up_proj.shape[0])
            host = ReadOnce(offs)           # (the GEMMs' routes that need offs on the host read them once)
            h = self.ops.moe_act(ex.grouped_mm(x[rows], "gate_up_proj", offs, host),
                                 self.limit if self.limit > 0 else None, weights.flatten(), order)
            out = ex.grouped_mm(h, "down_proj", offs, host)
            if add is not None and self.ops.moe_combine_add is not None:
                return self.ops.moe_combine_add(out, inv, experts, None, torch.float32, add)
            y = self.ops.moe_combine(out, inv, experts, None, torch.float32)
            return y if add is None else y + add
        y = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        if ex.grouped:
            k = experts.shape[1]
            order, offs = sort_by_expert(experts, ex.gate_up_proj.shape[0])   # other ranks' experts (-1) last
            host = ReadOnce(offs)
            h = self._act(ex.grouped_mm(x[order // k], "gate_up_proj", offs, host), weights.flatten()[order], x.dtype)
            out = ex.grouped_mm(h, "down_proj", offs, host).float()
            # rows past the last offset hold whatever memory held
            y.index_add_(0, order // k, torch.where(experts.flatten()[order, None] < 0, 0.0, out))
        else:
            for e in experts.unique().tolist():
                if e < 0:
                    continue
                tok, j = torch.where(experts == e)
                h = self._act(ex.expert_linear(x[tok], "gate_up_proj", e), weights[tok, j], x.dtype)
                y.index_add_(0, tok, ex.expert_linear(h, "down_proj", e).float())
        return y if add is None else y + add      # (float32 by promotion)


class _ExpertShape:
    """The fields `Experts` / `QuantizedExperts` (deepseek_v4.py) read from a config."""

    def __init__(self, n_experts: int, dim: int, inter: int, limit: float):
        self.n_routed_experts, self.hidden_size, self.moe_intermediate_size = n_experts, dim, inter
        self.swiglu_limit = limit


# ---- block: lagged hyper-connections, Engram ----------------------------------------------------------
def hc_weights(mixes: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, n: int, iters: int, eps: float):
    """`torch_hc_weights` (layers/basic.py) with the row softmax spelled exp(x - max) / sum as DeepSeek's V4.1
    kernel does, so the CPU path is bit-equal to the reference (torch.softmax differs in the last float32 ulp)."""
    pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.float().split([n, n, n * n])
    scale = scale.float()
    pre = torch.sigmoid(pre_w * scale[0] + pre_b) + eps
    post = 2 * torch.sigmoid(post_w * scale[1] + post_b)
    comb = (comb_w * scale[2] + comb_b).unflatten(-1, (n, n))
    comb = torch.exp(comb - comb.amax(dim=-1, keepdim=True))
    comb = comb / comb.sum(dim=-1, keepdim=True) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return pre, post, comb


class Block(nn.Module):
    """Attention and MoE between hyper-connections over `hc_mult` residual streams. Each sublayer's mixes come
    from its own input streams, but its `pre` collapses the streams for the *next* sublayer: attention uses the
    previous block's FFN pre-mix, the FFN uses this attention's."""

    def __init__(self, cfg: DeepseekV41Config, layer: int, ops: LayerOps = TORCH_OPS, **moe_kwargs):
        """`moe_kwargs`: `parallel` and `ep_layout` of an expert-parallel MoE (backbone layers only)."""
        super().__init__()
        self.layer, self.ops = layer, ops
        self.hc, self.iters, self.hc_eps, self.eps = cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.norm_eps
        self.attn = Attention(cfg, layer, ops)
        self.ffn = MoE(cfg, layer, ops, **moe_kwargs)
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps, ops)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps, ops)
        mix, width = (2 + cfg.hc_mult) * cfg.hc_mult, cfg.hc_mult * cfg.dim
        for kind in ("attn", "ffn"):
            setattr(self, f"hc_{kind}_fn", nn.Parameter(torch.zeros(mix, width)))
            setattr(self, f"hc_{kind}_base", nn.Parameter(torch.zeros(mix)))
            setattr(self, f"hc_{kind}_scale", nn.Parameter(torch.ones(3)))
        self.engram: Engram | None = None

    def mixes(self, streams, kind: str):
        xf = streams.flatten(1).float()
        rs = torch.rsqrt(xf.square().mean(-1, keepdim=True) + self.eps)
        m = F.linear(xf, getattr(self, f"hc_{kind}_fn").float()) * rs
        weights = hc_weights if self.ops.hc_weights is torch_hc_weights else self.ops.hc_weights
        return weights(m, getattr(self, f"hc_{kind}_base"), getattr(self, f"hc_{kind}_scale"), self.hc, self.iters,
                       self.hc_eps)

    def hc_pre(self, streams, kind: str, lagged):
        """Before a sublayer: (its pre, post, comb) from `streams`, and the streams collapsed by the previous
        sublayer's pre, `lagged` (the sublayer's input); `ops.hc_pre`: in one kernel."""
        if self.ops.hc_pre is not None:
            return self.ops.hc_pre(streams, getattr(self, f"hc_{kind}_fn"), getattr(self, f"hc_{kind}_base"),
                                   getattr(self, f"hc_{kind}_scale"), self.iters, self.hc_eps, self.eps, lagged)
        return *self.mixes(streams, kind), self.collapse(streams, lagged)

    def hc_post(self, out, streams, post, comb):
        """After a sublayer: `expand` (`ops.hc_post`: in one kernel, float32 as here)."""
        if self.ops.hc_post is not None:
            return self.ops.hc_post(out, streams, post, comb, False)
        return self.expand(out, streams, post, comb)

    @staticmethod
    def collapse(streams, pre):
        return (pre.unsqueeze(-1) * streams.float()).sum(1).to(streams.dtype)

    @staticmethod
    def expand(out, streams, post, comb):
        """post * sublayer output + comb^T @ streams (comb mixes over its first axis), in float32."""
        sf = streams.float()
        mixed = comb[:, 0, :, None] * sf[:, 0, None, :]
        for i in range(1, sf.shape[1]):         # in stream order, as the reference sums (bit-equal on CPU)
            mixed = mixed + comb[:, i, :, None] * sf[:, i, None, :]
        return (post.unsqueeze(-1) * out.float().unsqueeze(1) + mixed).to(streams.dtype)

    def forward(self, streams, pre_mix, positions, ropes, state, meta, shared, close_groups: bool = True,
                image_mask: torch.Tensor | None = None):
        pre, post, comb, x = self.hc_pre(streams, "attn", pre_mix)
        cp = meta.context_parallel
        if cp is None:
            h = self.attn(self.attn_norm(x), positions, ropes, state, meta, shared, close_groups)
        else:   # context parallelism: the KV side over the whole step's rows, the queries over this rank's
            h = self.attn(cp.gather(self.attn_norm(x)), cp.positions, ropes, state, cp.meta, shared, close_groups, cp)
        streams = self.hc_post(h, streams, post, comb)
        ffn_pre, post, comb, x = self.hc_pre(streams, "ffn", pre)
        h = self.ffn(self.ffn_norm(x), meta, image_mask)
        return self.hc_post(h, streams, post, comb), ffn_pre


class DSparkStage(Block):
    """A DSpark draft stage (`mtp.{i}`): a window-only block; stage 0 also projects the target layers' hidden
    states (`main_proj`, `main_norm`), the last one holds the head side (`norm`, the Markov head, the confidence
    head). Loaded with the model; the drafting loop (per-request context rings, batching) is
    openinfer/spec_decode/dspark.py's, which calls the pieces below:
    - `context` (stage 0): the target layers' features [T, n_target * dim] -> the context rows `main_x` [T, dim];
    - `context_keys`: a context row at position p -> this stage's window key for p (K = V, RoPE at p, rounded as
      the window cache rounds: what the stage's ring stores);
    - `forward`: the block of drafting positions through the stage. Its attention sees every valid key of the
      request's context ring (slot order) and every key of the block (the block attends to itself in both
      directions: it is drafted in one pass, not causally);
    - `draft_head` (last stage): logits + the Markov bias of the previous token, greedy drafts left to right,
      and the confidence head's raw score per draft.
    Its MoE is replicated on every rank, also with expert parallelism (its own expert count, and drafting runs
    per rank, outside the lockstep forwards; speculation is refused with parallelism for now)."""

    def __init__(self, cfg: DeepseekV41Config, layer: int, ops: LayerOps = TORCH_OPS):
        super().__init__(cfg, layer, ops)
        stage = layer - cfg.n_layers
        if stage == 0:
            self.main_proj = nn.Linear(cfg.dim * len(cfg.dspark_target_layer_ids), cfg.dim, bias=False)
            self.main_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        if stage == cfg.n_mtp_layers - 1:
            self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
            self.markov_head = nn.Module()
            self.markov_head.embed = _embedding(cfg.vocab_size, cfg.dspark_markov_rank)
            self.markov_head.head = nn.Linear(cfg.dspark_markov_rank, cfg.vocab_size, bias=False)
            self.confidence_head = nn.Module()
            self.confidence_head.proj = nn.Linear(cfg.dim + cfg.dspark_markov_rank, 1, bias=False)

    def context(self, features: torch.Tensor) -> torch.Tensor:
        """features [T, n_target * dim] (the target layers' inputs, each averaged over the hc streams, concatenated
        in `dspark_target_layer_ids` order) -> main_x [T, dim]."""
        return self.main_norm(self.main_proj(features))

    def context_keys(self, main_x: torch.Tensor, positions: torch.Tensor, ropes, codec) -> torch.Tensor:
        """This stage's window keys of context rows at `positions`, encoded by `codec` (the window cache's)."""
        a = self.attn
        cos, sin = ropes["main"].cos_sin(positions, torch.float32)
        return codec.encode(apply_rope(a.kv_norm(a.q_kv(main_x)[1]), cos, sin))

    def forward(self, streams, pre_mix, positions, ropes, ring: torch.Tensor, ring_valid: torch.Tensor, codec):
        """streams [B * n, hc, dim] (request-major: request b's block is rows b*n .. b*n+n-1), positions [B * n],
        ring [B, W, D] the requests' decoded context keys in slot order, ring_valid [B, W]."""
        pre, post, comb, x = self.hc_pre(streams, "attn", pre_mix)
        h = self._block_attention(self.attn_norm(x), positions, ropes, ring, ring_valid, codec)
        streams = self.hc_post(h, streams, post, comb)
        ffn_pre, post, comb, x = self.hc_pre(streams, "ffn", pre)
        h = self.ffn(self.ffn_norm(x))
        return self.hc_post(h, streams, post, comb), ffn_pre

    def _block_attention(self, x, positions, ropes, ring, ring_valid, codec):
        a = self.attn
        T, B = x.shape[0], ring.shape[0]
        n = T // B
        cos, sin = ropes["main"].cos_sin(positions, torch.float32)
        q_a, kv_x = a.q_kv(x)
        qr = a.q_norm(q_a)
        q = apply_rope(a.wq_b(qr).view(T, a.n_heads, a.head_dim), cos[:, None], sin[:, None])
        kv = codec.decode(codec.encode(apply_rope(a.kv_norm(kv_x), cos, sin)), x.dtype)
        keys = torch.cat((ring.to(x.dtype), kv.view(B, n, -1)), dim=1).repeat_interleave(n, dim=0)
        valid = torch.cat((ring_valid, ring_valid.new_ones(B, n)), dim=1).repeat_interleave(n, dim=0)
        out = a._attend(q, (keys, None, valid), None)
        o = apply_rope(out, cos[:, None], -sin[:, None]).view(T, a.cfg.o_groups, -1)
        wo_a = a.wo_a.weight.view(a.cfg.o_groups, a.cfg.o_lora_rank, -1)
        return a.wo_b(torch.einsum("tgd,grd->tgr", o, wo_a.to(o.dtype)).flatten(1))

    def draft_head(self, streams, pre_mix, tokens: torch.Tensor, compute_logits):
        """The last stage's head side: streams [B * n, hc, dim], tokens [B] (what block position 0 holds) ->
        (drafts [B, n] long, logits [B, n, vocab] float32 with the Markov bias, scores [B, n] float32). Draft i comes
        from position i's logits plus the Markov head's bias for the token before it (the input token, then draft
        i - 1), greedily; score i is the confidence head's linear map of [position i's hidden before the final
        norm, the Markov embedding of that previous token], raw (no activation)."""
        B = tokens.shape[0]
        x = self.collapse(streams, pre_mix)
        n = x.shape[0] // B
        logits = compute_logits(self.norm(x)).view(B, n, -1)
        prev, drafts, embeds = tokens, [], []
        for i in range(n):
            e = self.markov_head.embed(prev)
            logits[:, i] += _float32_linear(e, self.markov_head.head.weight)
            prev = logits[:, i].argmax(dim=-1)
            drafts.append(prev)
            embeds.append(e)
        feats = torch.cat((x.view(B, n, -1), torch.stack(embeds, dim=1)), dim=-1).float()
        scores = F.linear(feats, self.confidence_head.proj.weight.float()).squeeze(-1)
        return torch.stack(drafts, dim=1), logits, scores


def _embedding(num: int, dim: int) -> nn.Embedding:
    """An nn.Embedding left uninitialized (its weights are always loaded or seeded): its default init on the meta
    device, where models are built, takes torch's reference path, whose first use imports torch._dynamo (~2 s in a
    fresh process)."""
    return nn.Embedding(num, dim, _weight=torch.empty(num, dim))


def _float32_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w^T in float32 (as the reference's float32 heads compute it); on CUDA without a float32 copy of w."""
    if w.is_cuda and w.dtype == torch.bfloat16 and x.dtype == torch.bfloat16:
        return torch.mm(x, w.t(), out_dtype=torch.float32)
    return F.linear(x.float(), w.float())


# ---- the model ----------------------------------------------------------------------------------------
# parameters DeepSeek keeps (or its reference computes) in float32 whatever the model dtype
_FP32_SUFFIXES = ("attn_sink", "_fn", "_base", "_scale", "gate.bias", "gate.bias_vl", "norm.weight", "q_weight",
                  "k_weight", "confidence_head.proj.weight")


def keeps_float32(name: str) -> bool:
    """Whether parameter `name` stays float32 whatever the model dtype, as the reference keeps it (so do the ratio>1
    compressors, which depend on their layer: `DeepseekV41ForCausalLM.cast`)."""
    return name.endswith(_FP32_SUFFIXES)


class DeepseekV41ForCausalLM(nn.Module):
    @property
    def traits(self) -> ModelTraits:
        """Decode is capturable when the experts take the grouped (host-sync-free) path and the device gathers every
        Engram table's rows itself (on the device, or in pinned host memory); it reads compressed entries up to the
        longest context (one graph per context bucket); rings, compressor rows and Engram look-back are per-request
        state; YOCO prefill where the schedule has the CED split; the DSpark stages draft (`dspark`)."""
        dev = self.embed.weight.device
        graphs = all(layer.ffn.experts.grouped for layer in self.layers) and all(
            layer.engram.embed.gathered_by_device(dev) for layer in self.layers if layer.engram is not None)
        c = self.config
        return ModelTraits(cuda_graph_decode=graphs, context_bucketed_graphs=True, per_request_state=True,
                           prefill_modes=("exact", "yoco") if c.yoco_split is not None else ("exact",),
                           drafters=frozenset({"dspark"}) if c.dspark_block_size and len(self.mtp) else frozenset(),
                           feature_layers=c.n_layers, vision=c.vision_n_layers > 0,
                           prefill_scratch_bytes=expert_scratch_bytes(self))

    def __init__(self, cfg: DeepseekV41Config, ops: LayerOps = TORCH_OPS, engram_layout: EngramLayout | None = None,
                 quantized_caches: bool = True, parallel: ParallelContext | None = None):
        """`engram_layout`: the Engram tables' bucket layout (required when the config has Engram layers); the
        n-gram hasher, which needs the tokenizer's compressed token map, is attached once the weights live
        where they run (`attach_hasher`). `quantized_caches`: False keeps window keys, compressed entries and
        indexer keys/queries unrounded (EngineConfig.kv_cache_dtype set to the model dtype). `parallel`: this
        rank's place; with expert parallelism the backbone's routed experts are split over the EP ranks as
        DeepSeek-V4's are (`expert_placement`: the initial slots, which the loader fills)."""
        super().__init__()
        self.config, self.ops = cfg, ops
        self.parallel = parallel or ParallelContext.single()
        self.embed = _embedding(cfg.vocab_size, cfg.dim)
        rd, mp = cfg.rope_head_dim, cfg.max_position_embeddings
        yarn = {"rope_type": "yarn", "rope_theta": cfg.compress_rope_theta, "factor": cfg.rope_factor,
                "original_max_position_embeddings": cfg.original_seq_len, "beta_fast": cfg.beta_fast,
                "beta_slow": cfg.beta_slow, "attention_factor": 1.0}
        self.ropes = nn.ModuleDict({
            "main": InterleavedRope({"rope_type": "default", "rope_theta": cfg.rope_theta}, rd, mp),
            "compress": InterleavedRope(yarn if cfg.original_seq_len > 0 else
                                        {"rope_type": "default", "rope_theta": cfg.compress_rope_theta}, rd, mp)})
        moe_kwargs, self.expert_placement = {}, None
        layout = initial_layout(cfg.n_layers, cfg.n_routed_experts, self.parallel)
        if layout is not None:
            self.expert_placement, ep_layout = layout
            moe_kwargs = {"parallel": self.parallel, "ep_layout": ep_layout}
        self.layers = nn.ModuleList(Block(cfg, i, ops, **moe_kwargs) for i in range(cfg.n_layers))
        for layer in self.layers:
            layer.attn.quantized_caches = quantized_caches
        self.quantized_caches = quantized_caches
        self.codecs: dict = {}          # cache kind -> how its entries are stored (set with the cache specs)
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.head = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        self._float_head: tuple[tuple[int, int], torch.Tensor] | None = None   # see compute_logits
        self.mtp = nn.ModuleList(DSparkStage(cfg, cfg.n_layers + k, ops) for k in range(cfg.n_mtp_layers)) \
            if cfg.dspark_block_size else nn.ModuleList()
        self.hasher: NgramHasher | None = None
        if cfg.vision_n_layers:         # the vision tower (vision.py) and the image span's delimiter embeddings
            self.vision = ViT(cfg)
            self.aligner = Aligner(cfg)
            self.image_start = nn.Parameter(torch.zeros(cfg.dim))
            self.image_end = nn.Parameter(torch.zeros(cfg.dim))
            self.image_newline = nn.Parameter(torch.zeros(cfg.dim))
        # opt-in (DSpark drafting): backbone layer ids whose inputs `forward` keeps in `captured` (layer id ->
        # [rows, dim], the layer's input streams averaged over hc, after its Engram; the rows `forward` ran that
        # layer on, i.e. under YOCO only the decoder's rows for layers from the split on). Empty: nothing is kept.
        self.capture_layers: tuple[int, ...] = ()
        self.captured: dict[int, torch.Tensor] = {}
        if cfg.engram_layer_ids:
            if engram_layout is None:
                raise ValueError("this DeepSeek-V4.1 config has Engram layers: the model needs their layout")
            layout = engram_layout
            for k, i in enumerate(cfg.engram_layer_ids):
                self.layers[i].engram = Engram(cfg.dim, cfg.hc_mult, cfg.norm_eps, layout.n_hash_cols,
                                               layout.head_dim, layout.num_embeddings[k])
        # which index of its cache kind each KV source / index-key owner uses
        self._ckv_index = {}
        for r in cfg.source_ratios:
            for j, s in enumerate(x for x in cfg.kv_source_layers if cfg.ratio(x) == r):
                self._ckv_index[s] = j
        self._cidx_index = {}
        for r in cfg.source_ratios:
            owners = [x for x in cfg.kv_source_layers if cfg.ratio(x) == r and cfg.owns_index_keys(x)]
            for j, s in enumerate(owners):
                self._cidx_index[s] = j

    def cast(self, dtype: torch.dtype) -> "DeepseekV41ForCausalLM":
        """Cast to `dtype`, keeping what the reference keeps in float32 (mHC, sinks, norms, the router bias, the
        ratio>1 compressors) in float32; the head stays in `dtype` (bf16 as published), its logits are float32."""
        for name, p in self.named_parameters():
            if p.dtype.itemsize == 1:       # stored formats (the Engram tables) stay as they are
                continue
            if keeps_float32(name) or (".compressor.w" in name and self._layer_ratio(name) > 1):
                p.data = p.data.float()
            else:
                p.data = p.data.to(dtype)
        for name, b in self.named_buffers():
            if name.endswith("inv_freq"):
                b.data = b.data.float()
        return self

    def _layer_ratio(self, name: str) -> int:
        parts = name.split(".")
        return self.config.ratio(int(parts[1])) if parts[0] == "layers" else 0

    def join_projections(self) -> list[str]:
        """At load, after `quantize` (on the meta model): every attention's wq_a and wkv joined into one GEMM where
        the checkpoint stores them alike (the loader then fills `wq_a_kv` part by part). Returns the attentions
        joined."""
        return [n for n, m in list(self.named_modules()) if isinstance(m, Attention) and m.join_projections()]

    def quantize(self, modules: list[str], block: int, expert_modules: dict[str, str]) -> None:
        """Give the named linears FP8 block-scaled weights and the named expert stacks `fmt` weights, on the meta
        model before allocation (memory is only taken in the published formats)."""
        for name in modules:
            parent_name, _, child = name.rpartition(".")
            parent = self.get_submodule(parent_name)
            setattr(parent, child, to_fp8_linear(getattr(parent, child), block, self.ops))
        for name, fmt in expert_modules.items():
            parent = self.get_submodule(name.rpartition(".")[0])
            old = parent.experts
            with torch.device(old.gate_up_proj.device):
                shape = _ExpertShape(old.gate_up_proj.shape[0], old.down_proj.shape[1], old.down_proj.shape[2],
                                     old.limit)
                parent.experts = QuantizedExperts(shape, fmt, block, self.ops)

    # -- caches
    def cache_specs(self, dtype: torch.dtype, rollback_rows: int = 0) -> list[CacheSpec]:
        """Window rings per layer, compressed entries and index keys per source ratio (paged), the compressors' open
        group and Engram's look-back (per request). Entries are stored as DeepSeek stores them (FP8 window keys
        with an E8M0 scale per 32 values, FP4 compressed entries with an E4M3 scale per 16, FP4 index keys with an
        E8M0 scale per 32: one uint8 row each) or, unquantized, in `dtype`. Every per-request ring keeps
        `rollback_rows` more rows for rejected drafts (speculative decoding)."""
        c, E = self.config, rollback_rows
        D, Di = c.head_dim, c.index_head_dim
        if self.quantized_caches:
            self.codecs = {"swa": Fp8BlockCodec(32), "ckv": Fp4BlockCodec(16, "e4m3"), "cidx": Fp4BlockCodec(32, "e8m0")}
        else:
            self.codecs = {k: IdentityCodec(dtype) for k in ("swa", "ckv", "cidx")}
        sw, ck, ci = self.codecs["swa"], self.codecs["ckv"], self.codecs["cidx"]
        specs: list[CacheSpec] = [RequestStateSpec("swa", c.n_layers, (c.window_size + E, sw.stored_dim(D)),
                                                   sw.storage_dtype)]
        for r in c.source_ratios:
            sources = [s for s in c.kv_source_layers if c.ratio(s) == r]
            specs.append(PagedCacheSpec(f"ckv{r}", len(sources), (ck.stored_dim(D),), ck.storage_dtype, r))
            owners = [s for s in sources if c.owns_index_keys(s)]
            if owners:
                specs.append(PagedCacheSpec(f"cidx{r}", len(owners), (ci.stored_dim(Di),), ci.storage_dtype, r))
            if r > 1:
                specs.append(RequestStateSpec(f"crows{r}", len(sources), (r + E, 2 * D), torch.float32,
                                              needed_at_block_boundary=False))
        if c.engram_layer_ids:
            specs.append(RequestStateSpec("ngram", 1, (c.engram_max_ngram_size - 1 + E,), torch.int64))
        return specs

    def layer_state(self, caches: dict, i: int) -> dict:
        c = self.config
        state = {"swa": caches["swa"][i], "codecs": self.codecs}
        src = c.kv_source(i)
        if src is not None:
            r = c.ratio(i)
            state["ckv"] = caches[f"ckv{r}"][self._ckv_index[src]]
            if r > 1 and i == src:
                state["crows"] = caches[f"crows{r}"][self._ckv_index[src]]
            if i in c.index_source_layers:
                state["cidx"] = caches[f"cidx{r}"][self._cidx_index[c.index_key_source(i)]]
        return state

    @staticmethod
    def _decoder_rows(meta: AttentionMetadata, device) -> tuple[torch.Tensor, AttentionMetadata]:
        """YOCO: the rows that continue into the decoder (decode rows, and each chunk's positions from its
        `decoder_start` on) and the metadata of those rows."""
        keep = [torch.arange(meta.num_decode_tokens, device=device)]
        chunks, row = [], meta.num_decode_tokens
        for p in meta.prefills:
            start = p.context_len - p.query_len
            first = start if p.decoder_start is None else max(p.decoder_start, start)
            n = p.context_len - first
            if n <= 0:
                continue
            keep.append(torch.arange(p.query_start + first - start, p.query_start + p.query_len, device=device))
            chunks.append(dataclasses.replace(p, query_start=row, query_len=n))
            row += n
        rows = torch.cat(keep)
        return rows, dataclasses.replace(meta, prefills=chunks, slot_mapping=meta.slot_mapping[rows])

    def attach_hasher(self, hasher: NgramHasher) -> None:
        if hasher.layout.layer_ids != tuple(self.config.engram_layer_ids):
            raise ValueError(f"the n-gram hasher hashes for layers {hasher.layout.layer_ids}, the model's Engram "
                             f"layers are {self.config.engram_layer_ids}")
        self.hasher = hasher

    # -- images (vision.py)
    def check_image(self, image: ImageSpan, prompt_token_ids: list[int]) -> None:
        """Raise ValueError unless `image` is a span this model reads (vision.check_prompt_image)."""
        check_prompt_image(self.config, image, prompt_token_ids)

    def embed_image(self, image: ImageSpan) -> torch.Tensor:
        """The span's input rows [num_tokens, dim]: the embeddings it came with (encoded by a vision-encoder
        instance, EPD: docs/vision.md), or the tower's (vision.embed_span)."""
        if image.embeds is not None:
            return image.embeds.to(self.image_start.device, self.image_start.dtype)
        return embed_span(self, image)

    # -- forward
    def _engram_hashes(self, input_ids, positions, caches, meta, image_mask=None) -> torch.Tensor:
        """Global table rows [T, n_engram_layers, cols] for the step's tokens; advances each request's look-back.
        Image rows enter the look-back as -1: no n-gram reaches into or across an image span."""
        h = self.hasher
        ring = caches["ngram"][0]                     # [slots, R]: the compressed id of position p at p % R
        n1, R = h.n - 1, ring.shape[1]
        comp = h.compress(input_ids)
        if image_mask is not None:
            comp = comp.masked_fill(image_mask, -1)
        back = torch.arange(1, n1 + 1, device=positions.device)
        windows = torch.empty((len(input_ids), n1 + 1), dtype=torch.long, device=input_ids.device)
        for sl, p in spans_of(meta):
            if p is None:
                slots = meta.decode_state_slots
                before = positions[sl, None] - back
                hist = ring[slots[:, None], before % R].masked_fill(before < 0, -1)
                offsets = meta.decode_row_offsets
                if offsets is not None:     # a verify step's rows: positions of this step are its earlier rows
                    own = back <= offsets[:, None]
                    src = (torch.arange(len(hist), device=hist.device)[:, None] - back).clamp(min=0)
                    hist = torch.where(own, comp[sl][src], hist)
                windows[sl] = h.windows(comp[sl], hist)
                ring[slots, positions[sl] % R] = comp[sl]
            else:
                start = p.context_len - p.query_len
                hist = ring[p.state_slot, (start - back) % R].masked_fill(start - back < 0, -1)
                windows[sl] = h.chunk_windows(comp[sl], hist)
                keep = min(p.query_len, R)
                ring[p.state_slot, positions[sl][-keep:] % R] = comp[sl][-keep:]
        return h(windows)

    def forward(self, input_ids, positions, caches, meta, images: ImageRows | None = None) -> torch.Tensor:
        """`images`: the step's rows inside image spans take the given embeddings, are routed with `bias_vl` and
        take no Engram write."""
        c = self.config
        image_mask = None
        if images is not None:
            image_mask = torch.zeros(len(input_ids), dtype=torch.bool, device=input_ids.device)
            image_mask[images.rows] = True
        hashes = None
        if c.engram_layer_ids:
            if self.hasher is None:
                raise RuntimeError("DeepSeek-V4.1 Engram layers need the n-gram hasher (attach_hasher)")
            cp = meta.context_parallel
            if cp is None:
                hashes = self._engram_hashes(input_ids, positions, caches, meta, image_mask)
            else:   # context parallelism: n-grams look back across piece boundaries; this rank's rows of the step's
                step_mask = None
                if cp.image_rows is not None:
                    step_mask = torch.zeros(len(cp.input_ids), dtype=torch.bool, device=cp.input_ids.device)
                    step_mask[cp.image_rows] = True
                hashes = self._engram_hashes(cp.input_ids, cp.positions, caches, cp.meta, step_mask
                                             ).index_select(0, cp.local_index)
        if self.capture_layers:
            self.captured = {}
        tokens = self.embed(input_ids)
        if images is not None:
            tokens = tokens.index_copy(0, images.rows, images.embeds.to(tokens.dtype))
        streams = tokens.unsqueeze(1).repeat(1, c.hc_mult, 1)
        pre_mix = torch.zeros(len(input_ids), c.hc_mult, device=streams.device)
        pre_mix[:, 0] = 1.0
        shared = StepShared()
        split = c.yoco_split if any(p.decoder_start is not None for p in meta.prefills) else None
        rows = None
        for i, layer in enumerate(self.layers):
            if layer.engram is not None:
                streams = layer.engram(streams, hashes[:, c.engram_layer_ids.index(i)], image_mask)
            state = self.layer_state(caches, i)
            if i == split:          # YOCO: the decoder's global KV for every token, then only its own rows go on
                layer.attn.close_all(layer.attn_norm(Block.collapse(streams, pre_mix)), positions, self.ropes,
                                     state, meta)
                rows, meta = self._decoder_rows(meta, streams.device)
                if len(rows) == 0:      # every token of the step precedes its decoder tail
                    if self.expert_placement is not None:   # the other EP ranks' MoE exchanges still need ours
                        for later in self.layers[i:]:
                            later.ffn(streams.new_zeros((0, c.dim)), meta)
                    return streams.new_zeros((len(input_ids), c.dim))
                streams, pre_mix, positions = streams[rows], pre_mix[rows], positions[rows]
                if hashes is not None:
                    hashes = hashes[rows]
                if image_mask is not None:
                    image_mask = image_mask[rows]
            if self.capture_layers and i in self.capture_layers:
                self.captured[i] = streams.mean(dim=1)
            streams, pre_mix = layer(streams, pre_mix, positions, self.ropes, state, meta, shared,
                                     close_groups=i != split, image_mask=image_mask)
        hidden = self.norm(Block.collapse(streams, pre_mix))
        if rows is None:
            return hidden
        out = hidden.new_zeros((len(input_ids), hidden.shape[-1]))     # rows that skipped the decoder: no logits
        return out.index_copy_(0, rows, hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits of the (bf16-published) head, as the reference computes them; on CUDA without a float32
        copy of the head (products of bf16 values are exact, the sums float32 in both)."""
        w = self.head.weight
        if w.is_cuda and w.dtype == torch.bfloat16 and hidden.dtype == torch.bfloat16:
            return torch.mm(hidden, w.t(), out_dtype=torch.float32)
        return F.linear(hidden.float(), self._head_in_float32())

    def _head_in_float32(self) -> torch.Tensor:
        """`head.weight.float()`; on the CPU converted once per version of the weight instead of at every step: the
        129K-row head was a fifth of the tiny models' CPU time (py-spy, tests/test_deepseek_v41.py). Kept while
        the weight is unchanged: same storage, same in-place version (a write through `.data`, as the loader's
        before any forward, is not seen)."""
        w = self.head.weight
        if w.dtype == torch.float32 or w.device.type != "cpu":    # a device's memory holds no second head
            return w.float()
        key = (w.data_ptr(), w._version)
        if self._float_head is None or self._float_head[0] != key:
            self._float_head = (key, w.float())
        return self._float_head[1]
