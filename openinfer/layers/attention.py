"""Paged attention: metadata, the backend interface, and the torch reference backend.

The reference backend is plain torch (SDPA over K/V gathered from the paged cache). It is correct on CPU
and CUDA for any mix of decodes and prefill chunks (with or without prefix-cache hits), and it is what every
faster kernel is tested against.

Cache layout per layer: [num_blocks, block_size, 2, num_kv_heads, head_dim] (K at [:, :, 0], V at [:, :, 1]).
Batch layout: decode rows (one query token per sequence) come first and run as one padded SDPA call; each
prefill chunk then runs on its own with a causal mask offset by the tokens already in its context.

Sliding windows (`window=W` in `forward`, per layer): a query at position p sees keys at positions
p-W < j <= p (W keys counting itself), HF transformers' `sliding_window_overlay` convention. Keys before the
window stay in the cache and are masked out; `window=None` is plain causal attention.

FP8 KV cache (`kv_scale=` in `forward`, kv_cache_dtype="fp8", docs/kv_cache_fp8.md): the cache holds E4M3
values and `kv_scale` [num_blocks, block_size, 2, num_kv_heads] one float32 scale per token, K/V and KV head
(`quantization.kv_formats.fp8_kv_quantize`). New K/V are quantized as they are written; every read (decode
rows and prefill chunks alike, the chunk's own tokens included) dequantizes to q's dtype, so attention is
exactly attention over the dequantized K/V, whatever the chunking or prefix-cache hits.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Iterable, Iterator, Protocol

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from openinfer.kv_cache.spec import PagedCacheSpec
from openinfer.quantization.kv_formats import fp8_kv_dequantize, fp8_kv_quantize


def context_slots(block_table: torch.Tensor, length: int, block_size: int) -> torch.Tensor:
    """Flat cache slots of positions [0, length) for a block table [..., num_blocks] -> [..., length]."""
    pos = torch.arange(length, device=block_table.device)
    return block_table[..., pos // block_size] * block_size + pos % block_size


@dataclass
class PrefillChunk:
    query_start: int        # first row of this chunk in the flattened batch
    query_len: int
    context_len: int        # tokens in the cache after this step (cached prefix + this chunk)
    block_ids: torch.Tensor  # [ceil(context_len / block_size)] long
    block_size: int
    state_slot: int | None = None   # the request's per-request state slot (models with RequestStateSpecs)
    # DeepSeek-V4.1 YOCO prefill: positions before this one skip the decoder layers (None: every layer runs)
    decoder_start: int | None = None

    @cached_property
    def context_slots(self) -> torch.Tensor:
        return context_slots(self.block_ids, self.context_len, self.block_size)


@dataclass
class AttentionMetadata:
    block_size: int
    slot_mapping: torch.Tensor            # [num_tokens] flat cache slot of each new token
    num_decode_tokens: int = 0            # rows [0, num_decode_tokens) are single-token sequences
    decode_block_tables: torch.Tensor | None = None   # [num_decodes, max_blocks] (padded with 0)
    decode_context_lens: torch.Tensor | None = None   # [num_decodes]
    max_decode_context_len: int = 0
    prefills: list[PrefillChunk] = field(default_factory=list)
    decode_state_slots: torch.Tensor | None = None    # [num_decodes] state slot per decode row
    # [num_decodes] each decode row's index among its request's rows of the step (a verify step's token and
    # drafts run as consecutive decode rows of one request: 0, 1, .., k); None: every row is 0 (one token per
    # request). Models with per-request state that is a recurrence over positions (not a position-indexed ring
    # read after the step's writes) need it to see the step's own earlier rows
    decode_row_offsets: torch.Tensor | None = None
    # expert parallelism (distributed/expert_parallel.py): rows every EP rank passes to the MoE exchange
    # this step (the step's maximum), a device scalar: rows at or past it are padding, and False in the
    # warm-up forward before a CUDA-graph capture (same shapes, no collective)
    moe_rows_per_rank: int | None = None
    moe_valid_rows: torch.Tensor | None = None
    moe_communicate: bool = True
    # which exchange and whether two micro-batches overlap (distributed/expert_parallel.py: MoeExchange; None:
    # all-gather, one batch), picked by the runner from agreed values, so alike on every rank
    moe_exchange: object | None = None
    # two-batch overlap across attention (distributed/two_batch.py: TwoBatch): the step as two micro-batches of
    # whole requests, each with its own metadata; None: one batch
    two_batch: Any = None
    # models with a window group (kv_cache/window_group.py): the step as (full-attention layers, windowed
    # layers) see it: the windowed layers read the window group's tables and slots (and, in a step with bounded
    # replay, kv_cache/bounded_replay.py, other slot mappings and chunks starting later); None: one view
    layer_views: tuple[AttentionMetadata, AttentionMetadata] | None = None
    # context parallelism (distributed/context_parallel.py: ContextParallelStep): this rank holds some of the
    # step's prefill rows; `attend` all-gathers the chunk's K/V and writes it whole before attending. None: off
    context_parallel: Any = None

    def for_layer(self, window: int | None) -> AttentionMetadata:
        """This step's metadata for a layer with this window (None: full attention)."""
        if self.layer_views is None:
            return self
        return self.layer_views[window is not None]

    @cached_property
    def decode_context_slots(self) -> torch.Tensor:
        """[num_decodes, max_decode_context_len] flat slots (padding rows point at valid memory)."""
        return context_slots(self.decode_block_tables, self.max_decode_context_len, self.block_size)

    @cached_property
    def decode_valid(self) -> torch.Tensor:
        pos = torch.arange(self.max_decode_context_len, device=self.decode_context_lens.device)
        return pos < self.decode_context_lens[:, None]

    def decode_window_valid(self, window: int) -> torch.Tensor:
        """decode_valid restricted to each row's last `window` positions (made once per step and window)."""
        masks = self.__dict__.setdefault("_decode_window_valid", {})
        if window not in masks:
            pos = torch.arange(self.max_decode_context_len, device=self.decode_context_lens.device)
            masks[window] = self.decode_valid & (pos >= self.decode_context_lens[:, None] - window)
        return masks[window]


class AttentionBackend(Protocol):
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, scale: float, window: int | None = None,
                kv_scale: torch.Tensor | None = None, rotary: tuple | None = None) -> torch.Tensor:
        """q [T, H, D], k/v [T, KVH, D] for the new tokens; writes k/v into kv_cache; returns [T, H, D].
        `window`: sliding-window size of this layer (None: full causal attention). Backends whose class
        attribute `supports_window` is False raise on a window. `kv_scale`: the layer's FP8 scale cache
        (kv_cache is then float8_e4m3fn); only backends whose `supports_fp8_kv` is True are given one.
        `rotary`: (RoPE module, positions), given only to backends whose `applies_rotary` is True: q and k are
        then unrotated, and the backend rotates them before the write (fused where it can)."""
        ...


def attend(backend: AttentionBackend, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
           rope, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float, window: int | None = None,
           kv_scale: torch.Tensor | None = None) -> torch.Tensor:
    """A decoder layer's call into its backend with unrotated q, k: the RoPE module goes to a backend that
    `applies_rotary` (with the KV write, fused on Triton), else is applied here; the window and the FP8 scale
    cache are passed only when set (backends without window or FP8 support keep their signatures)."""
    extra = {} if window is None else {"window": window}
    if kv_scale is not None:
        extra["kv_scale"] = kv_scale
    cp = meta.context_parallel
    if cp is not None:
        # context parallelism: every CP rank's rotated K/V of the step, written whole into this rank's pool, then
        # this rank's queries attend (its own rows are written again, the same values)
        q, k = rope(positions, q, k)
        kv = cp.gather(torch.stack((k, v), dim=1))
        backend.write(kv_cache, cp.slot_mapping, kv[:, 0], kv[:, 1], kv_scale)
        if q.shape[0] == 0:        # a chunk shorter than 2·cp may leave this rank no row
            return torch.empty_like(q)
        return backend.forward(q, k, v, kv_cache, meta.for_layer(window), scale, **extra)
    if getattr(backend, "applies_rotary", False):
        extra["rotary"] = (rope, positions)
    else:
        q, k = rope(positions, q, k)
    return backend.forward(q, k, v, kv_cache, meta.for_layer(window), scale, **extra)


def kv_cache_specs(num_layers: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                   fp8: bool = False, window: int | None = None, name: str = "kv") -> list[PagedCacheSpec]:
    """The paged caches this backend reads: "kv" [2, KVH, D] per token in `dtype`, or with `fp8` in
    float8_e4m3fn plus "kv_scale" [2, KVH] float32 (one scale per token, K/V and KV head). `window`: layers
    attending through a sliding window (their kinds form the window group, kv_cache/window_group.py), under
    `name` (and `name`_scale)."""
    if not fp8:
        return [PagedCacheSpec(name, num_layers, (2, num_kv_heads, head_dim), dtype, window=window)]
    return [PagedCacheSpec(name, num_layers, (2, num_kv_heads, head_dim), torch.float8_e4m3fn, window=window),
            PagedCacheSpec(f"{name}_scale", num_layers, (2, num_kv_heads), torch.float32, window=window)]


def layer_caches(caches: dict[str, list[torch.Tensor]], windowed: Iterable[bool]
                 ) -> Iterator[tuple[torch.Tensor, torch.Tensor | None]]:
    """(KV cache, FP8 scale cache or None) per layer, in order: a full layer takes the next of "kv", a windowed
    one the next of "kv_window" (the kinds `kv_cache_specs` declares, the windowed ones under `name="kv_window"`)."""
    kinds = {w: (iter(caches.get(name, ())), iter(caches.get(f"{name}_scale", ())))
             for w, name in ((False, "kv"), (True, "kv_window"))}
    for w in windowed:
        kv, scales = kinds[w]
        yield next(kv), next(scales, None)


def split_kv_cache_specs(num_layers: int, num_windowed: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                         fp8: bool, window: int | None) -> list[PagedCacheSpec]:
    """A model's paged kinds when `num_windowed` of its layers attend through `window`: the full layers' under
    "kv", the windowed ones' under "kv_window" (the window group), either left out when it has no layers."""
    specs = []
    if num_windowed < num_layers:
        specs += kv_cache_specs(num_layers - num_windowed, num_kv_heads, head_dim, dtype, fp8)
    if num_windowed:
        specs += kv_cache_specs(num_windowed, num_kv_heads, head_dim, dtype, fp8, window=window, name="kv_window")
    return specs


def _rows(cache: torch.Tensor) -> torch.Tensor:
    """[slots, entry] view of a paged cache [blocks, page, *entry]; FP8 as bytes (CPU index_copy_ has no FP8)."""
    rows = cache.view(-1, cache[0, 0].numel())
    return rows.view(torch.uint8) if cache.dtype == torch.float8_e4m3fn else rows


def write_kv(kv_cache: torch.Tensor, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             kv_scale: torch.Tensor | None = None) -> None:
    """Scatter new K/V [T, KVH, D] into the cache at flat slots; with `kv_scale` (FP8 cache) quantized per
    row by fp8_kv_quantize, the scales [T, 2, KVH] to the same slots of kv_scale."""
    kv = torch.stack((k, v), dim=1)
    if kv_scale is not None:
        kv, s = fp8_kv_quantize(kv)
        _rows(kv_scale).index_copy_(0, slot_mapping, s.view(len(slot_mapping), -1))
    rows = _rows(kv_cache)
    rows.index_copy_(0, slot_mapping, kv.to(kv_cache.dtype).view(rows.dtype).view(len(slot_mapping), -1))


def gather_kv(kv_cache: torch.Tensor, slots: torch.Tensor, kv_scale: torch.Tensor | None = None,
              dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V at `slots` [..., L] -> two [..., L, KVH, D] views (index_select on rows: a fast gather).
    With `kv_scale` (FP8 cache): dequantized to `dtype` by fp8_kv_dequantize."""
    flat = slots.reshape(-1)
    ctx = _rows(kv_cache).index_select(0, flat)
    if kv_scale is not None:
        ctx = fp8_kv_dequantize(ctx.view(torch.float8_e4m3fn).view(-1, *kv_cache.shape[2:]),
                                _rows(kv_scale).index_select(0, flat).view(-1, *kv_scale.shape[2:]), dtype)
    ctx = ctx.view(*slots.shape, *kv_cache.shape[2:])
    return ctx[..., 0, :, :], ctx[..., 1, :, :]


class TorchPagedAttention:
    """Reference backend (see module docstring). Faster backends override `write`, `decode_into`,
    `prefill_into`. A window and an FP8 scale cache are passed on only when set, so a subclass without
    window or FP8 support keeps its signatures (and sets `supports_window` / `supports_fp8_kv` False)."""

    supports_window = True
    supports_fp8_kv = True
    # `forward(..., rotary=(rope, positions))`: q and k arrive unrotated and the backend applies the model's RoPE
    # module before writing k (a faster backend fuses the two: `rotate_and_write`)
    applies_rotary = True

    def forward(self, q, k, v, kv_cache, meta, scale, window=None, kv_scale=None, rotary=None):
        fp8 = {} if kv_scale is None else {"kv_scale": kv_scale}
        if rotary is None:
            self.write(kv_cache, meta.slot_mapping, k, v, **fp8)
        else:
            q, k = self.rotate_and_write(kv_cache, meta.slot_mapping, rotary, q, k, v, **fp8)
        out = torch.empty_like(q)
        extra = fp8 if window is None else {**fp8, "window": window}
        if meta.num_decode_tokens:
            self.decode_into(q, kv_cache, meta, scale, out, **extra)
        if meta.prefills:
            self.prefill_into(q, kv_cache, meta, scale, out, **extra)
        return out

    def write(self, kv_cache, slot_mapping, k, v, kv_scale=None):
        write_kv(kv_cache, slot_mapping, k, v, kv_scale)

    def rotate_and_write(self, kv_cache, slot_mapping, rotary, q, k, v, kv_scale=None):
        """(rotated q, rotated k), k written with v. `rotary`: (the model's RotaryEmbedding, positions [T])."""
        rope, positions = rotary
        q, k = rope(positions, q, k)
        self.write(kv_cache, slot_mapping, k, v, **({} if kv_scale is None else {"kv_scale": kv_scale}))
        return q, k

    def decode_into(self, q, kv_cache, meta, scale, out, window=None, kv_scale=None):
        nd = meta.num_decode_tokens
        keys, vals = gather_kv(kv_cache, meta.decode_context_slots, kv_scale, q.dtype)    # [B, L, KVH, D]
        kvh = keys.shape[2]
        valid = meta.decode_valid if window is None else meta.decode_window_valid(window)
        # The H/KVH query heads sharing a KV head ride as that head's query rows: no K/V expansion.
        qg = q[:nd].view(nd, kvh, -1, q.shape[-1])                      # [B, KVH, G, D]
        o = F.scaled_dot_product_attention(qg, keys.transpose(1, 2), vals.transpose(1, 2),
                                           attn_mask=valid[:, None, None, :], scale=scale)
        out[:nd] = o.reshape(nd, *q.shape[1:])

    def prefill_into(self, q, kv_cache, meta, scale, out, window=None, kv_scale=None):
        if q.is_cuda:
            # Not cuDNN: it plans a graph per new (query, context) shape, and prefill chunk shapes rarely repeat.
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]):
                return self._prefill_into(q, kv_cache, meta, scale, out, window, kv_scale)
        return self._prefill_into(q, kv_cache, meta, scale, out, window, kv_scale)

    def _prefill_into(self, q, kv_cache, meta, scale, out, window=None, kv_scale=None):
        for p in meta.prefills:
            keys, vals = gather_kv(kv_cache, p.context_slots, kv_scale, q.dtype)     # [L, KVH, D]
            keys, vals = keys.transpose(0, 1), vals.transpose(0, 1)
            rows = slice(p.query_start, p.query_start + p.query_len)
            qs = q[rows].transpose(0, 1)                                     # [H, q, D]
            gqa = {"enable_gqa": True}
            if q.is_cuda and qs.shape[0] != keys.shape[0]:
                # CUDA's flash kernel is only picked with equal head counts: expand K/V (cheap next to the
                # quadratic work) rather than fall back to the math path
                group = qs.shape[0] // keys.shape[0]
                keys, vals, gqa = keys.repeat_interleave(group, 0), vals.repeat_interleave(group, 0), {}
            qs, keys, vals = qs[None], keys[None], vals[None]   # 4-D: the fused CUDA kernels need a batch dim
            windowed = window is not None and p.context_len > window   # else the window masks nothing
            if p.query_len == p.context_len and not windowed:
                o = F.scaled_dot_product_attention(qs, keys, vals, is_causal=True, scale=scale, **gqa)
            else:
                q_pos = torch.arange(p.context_len - p.query_len, p.context_len, device=q.device)
                k_pos = torch.arange(p.context_len, device=q.device)[None, :]
                mask = k_pos <= q_pos[:, None]
                if windowed:
                    mask &= k_pos > q_pos[:, None] - window
                o = F.scaled_dot_product_attention(qs, keys, vals, attn_mask=mask, scale=scale, **gqa)
            out[rows] = o[0].transpose(0, 1)
