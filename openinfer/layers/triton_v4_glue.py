"""DeepSeek-V4/V4.1 attention glue in one Triton launch per call: an RMSNorm of each row and the interleaved RoPE of
its trailing channels, with the casts between them (issue 34: in torch these are ~25 small kernels per call, and a
decode layer makes five such calls — q_a_norm / q_norm, the query heads' norm and RoPE, kv_norm and the key's RoPE,
the indexer queries' RoPE and the output's inverse RoPE). `LayerOps.v4_norm_rope`; None runs the models' torch code
(`deepseek_v4.model.RMSNorm`, `unweighted_rms_norm`, `InterleavedRope.cos_sin`, `apply_rope`), its reference.

One program per row (token, head), the channels in registers as even/odd halves (the RoPE pairs are adjacent
channels). Every rounding the torch code makes is made here in the same place (the norm factor, the weighted or
unweighted product, cos/sin to their dtype, the rotated channels); the norm's divisions and square root round as
torch's CPU ones do (IEEE); cos/sin are libdevice's (CUDA's cosf/sinf with their full range reduction — positions
run to 1M — which torch's CUDA kernels call too). What may part from torch: the order of the sum of squares, cos/sin
against torch's CPU ones (numpy's in the interpreter), torch's approximate rsqrt on CUDA, and the GPU contracting the
rotation's products and sums into FMAs — each a float32 last-bit difference, so the result is the torch path's within one rounding of the
model dtype (bit-exact wherever that float32 value is not near a rounding boundary). Positions are a device tensor:
no host synchronization (CUDA-graph capturable). Tested in tests/test_v4_glue.py.

Two more pieces of the decode glue (issue 34), each exact: `v4_kv_ring` (`LayerOps.v4_kv_ring`), the window keys'
call with the decode rows' ring write (`ring[slots, positions % R] = kv`, two kernels) in its epilogue, the bytes the
returned rows hold; and `entry_rows` (`LayerOps.entry_rows`), the decode rows' compressed-entry addresses
(`deepseek_v4.model.entry_index` over entries 0 .. n-1, six kernels) in one launch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice
from triton.runtime.interpreter import InterpretedFunction

from openinfer.quantization.kv_formats import Fp8DsMlaCodec
from openinfer.quantization.triton_kv_formats import ds_mla_store, fp4_qdq_e8m0, fp8_store, round_to

NO_NORM, UNWEIGHTED, WEIGHTED = 0, 1, 2


@triton.jit
def _norm_rope_kernel(x_ptr, out_ptr, pos_ptr, w_ptr, inv_freq_ptr, ring_ptr, slot_ptr, n_ring, ring_len, eps,
                      rope_scale, stride_xt, stride_xh, stride_ot, stride_oh, stride_rs, stride_rr, D: tl.constexpr,
                      HALF: tl.constexpr, BLOCK: tl.constexpr, ROPE_HALF: tl.constexpr, NORM: tl.constexpr,
                      SIGN: tl.constexpr, CS_DT: tl.constexpr, FP8_BLOCK: tl.constexpr, FP4_GROUP: tl.constexpr,
                      RING: tl.constexpr, LIBDEVICE: tl.constexpr, DS_NOPE: tl.constexpr, DS_TILE: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    i = tl.arange(0, BLOCK)
    m = i < HALF
    dt = x_ptr.dtype.element_ty
    src = x_ptr + t.to(tl.int64) * stride_xt + h * stride_xh
    x_e = tl.load(src + 2 * i, mask=m, other=0.0).to(tl.float32)
    x_o = tl.load(src + 2 * i + 1, mask=m, other=0.0).to(tl.float32)
    if NORM != 0:
        inv = tl.div_rn(1.0, tl.sqrt_rn((tl.sum(x_e * x_e, 0) + tl.sum(x_o * x_o, 0)) / D + eps))
        if NORM == 1:       # unweighted_rms_norm: the factor in the model dtype, times x there
            inv = round_to(inv, dt)
            x_e, x_o = round_to(x_e * inv, dt), round_to(x_o * inv, dt)
        else:               # RMSNorm: float32 weight * (x * factor), rounded once
            w_e = tl.load(w_ptr + 2 * i, mask=m, other=0.0).to(tl.float32)
            w_o = tl.load(w_ptr + 2 * i + 1, mask=m, other=0.0).to(tl.float32)
            x_e, x_o = round_to(w_e * (x_e * inv), dt), round_to(w_o * (x_o * inv), dt)
    if ROPE_HALF > 0:       # apply_rope on the last 2 * ROPE_HALF channels, cos/sin rounded to CS_DT
        j = i - (HALF - ROPE_HALF)
        rot = (j >= 0) & m
        f = tl.load(pos_ptr + t).to(tl.float32) * tl.load(inv_freq_ptr + j, mask=rot, other=0.0)
        if LIBDEVICE:       # CUDA's cosf/sinf, as torch's kernels call them
            c, s = libdevice.cos(f), libdevice.sin(f)
        else:               # Triton's interpreter (numpy), which has no libdevice
            c, s = tl.cos(f), tl.sin(f)
        c = round_to(c * rope_scale, CS_DT)
        s = SIGN * round_to(s * rope_scale, CS_DT)
        x_e, x_o = (tl.where(rot, round_to(x_e * c - x_o * s, dt), x_e),
                    tl.where(rot, round_to(x_o * c + x_e * s, dt), x_o))
    if FP4_GROUP > 0:       # fp4_block_qdq(., FP4_GROUP, "e8m0") of the row (a power-of-two D: BLOCK == HALF)
        x_e, x_o = fp4_qdq_e8m0(x_e, x_o, D, FP4_GROUP)
    dst = out_ptr + t.to(tl.int64) * stride_ot + h * stride_oh
    if FP8_BLOCK > 0:       # the row as Fp8BlockCodec(FP8_BLOCK) stores it (a power-of-two D: BLOCK == HALF)
        fp8_store(dst, x_e, x_o, D, FP8_BLOCK)
    else:
        tl.store(dst + 2 * i, x_e.to(dt), mask=m)
        tl.store(dst + 2 * i + 1, x_o.to(dt), mask=m)
    if RING:                # rows [0, n_ring) (the decode rows, one head) also into ring[slot, position % ring_len]
        if t < n_ring:
            pos = tl.load(pos_ptr + t).to(tl.int64)
            row = ((pos % ring_len) + ring_len) % ring_len
            rdst = ring_ptr + tl.load(slot_ptr + t).to(tl.int64) * stride_rs + row * stride_rr
            if FP8_BLOCK > 0:
                fp8_store(rdst, x_e, x_o, D, FP8_BLOCK)
            elif DS_NOPE > 0:   # V4's FlashMLA rows (`Fp8DsMlaCodec`), the returned rows staying values
                ds_mla_store(rdst, x_e, x_o, D, DS_NOPE, DS_TILE)
            else:           # as `kv.to(ring.dtype)` (the row's values are already rounded to the model dtype)
                tl.store(rdst + 2 * i, x_e.to(dt).to(ring_ptr.dtype.element_ty), mask=m)
                tl.store(rdst + 2 * i + 1, x_o.to(dt).to(ring_ptr.dtype.element_ty), mask=m)


def v4_norm_rope(x: torch.Tensor, eps: float | None = None, weight: torch.Tensor | None = None,
                 positions: torch.Tensor | None = None, inv_freq: torch.Tensor | None = None, rope_scale: float = 1.0,
                 cs_dtype: torch.dtype | None = None, inverse: bool = False, fp8_block: int = 0,
                 fp4_group: int = 0, ring: torch.Tensor | None = None,
                 ring_slots: torch.Tensor | None = None, ring_codec: Fp8DsMlaCodec | None = None) -> torch.Tensor:
    """x [T, D] or [T, H, D] (unit last stride) -> a new tensor of its shape and dtype: each row (token, head) through
    the RMSNorm with `eps` (V4's `RMSNorm` with the float32 `weight`; without a weight `unweighted_rms_norm`; eps None:
    no norm), then the interleaved RoPE of `positions` [T] on its last 2 * len(inv_freq) channels, cos/sin scaled by
    `rope_scale` and rounded to `cs_dtype` as `InterleavedRope.cos_sin` gives them (`inverse`: sin negated, the
    rotation back; inv_freq None: no RoPE). `fp8_block`: the rows returned as `Fp8BlockCodec(fp8_block).encode` gives
    them (uint8 [..., D + D / fp8_block]: V4.1's window keys as its ring stores them); 0: in x's dtype. `fp4_group`: the
    rows then through `fp4_block_qdq(., fp4_group, "e8m0")` (V4.1's indexer queries); 0: not. `ring` [slots, R, width]
    (x [T, D] only): the first len(ring_slots) rows are also stored at ring[ring_slots, positions % R] as the returned
    rows hold them (cast to the ring's dtype), as the models' decode step stores its window keys (`v4_kv_ring`);
    `ring_codec` (an `Fp8DsMlaCodec`, V4's kv_cache_dtype="fp8_ds_mla"): encoded as its rows there (`ring` uint8
    [slots, R, stored_dim(D)]; whole tiles of RoPE channels), the returned rows staying values."""
    rows = x if x.dim() == 3 else x[:, None]
    T, H, D = rows.shape
    rope_half = 0 if inv_freq is None else inv_freq.numel()
    if D % 2 or rows.stride(-1) != 1 or rope_half > D // 2:
        raise ValueError(f"v4_norm_rope needs rows of an even width with unit stride and at most width/2 RoPE pairs "
                         f"(got width {D}, stride {rows.stride(-1)}, {rope_half} pairs)")
    for block in (fp8_block, fp4_group):
        if block and (D & (D - 1) or D % block or block % 2):
            raise ValueError(f"FP8 rows and FP4 rounding need a power-of-two width divisible by the (even) block "
                             f"(got {D}, {block})")
    width = D + D // fp8_block if fp8_block else D
    ds_nope, ds_tile = 0, 1
    if ring_codec is not None:
        if (not isinstance(ring_codec, Fp8DsMlaCodec) or fp8_block or ring_codec.rope_dim % ring_codec.tile
                or (D - ring_codec.rope_dim) % ring_codec.tile or ring_codec.tile % 2 or D & (D - 1)):
            raise ValueError(f"the ring's codec must be an Fp8DsMlaCodec with whole tiles of RoPE channels of a "
                             f"power-of-two width, without fp8_block (got {ring_codec!r}, width {D})")
        ds_nope, ds_tile = D - ring_codec.rope_dim, ring_codec.tile
    ring_width = width if ring_codec is None else ring_codec.stored_dim(D)
    n_ring = 0 if ring is None else ring_slots.numel()
    if ring is not None and (H != 1 or positions is None or ring.dim() != 3 or ring.shape[2] != ring_width
                             or ring.stride(2) != 1 or n_ring > T
                             or (ring.dtype == torch.uint8) != bool(fp8_block or ring_codec)):
        raise ValueError(f"the ring write needs one row per token, positions, a ring [slots, R, {ring_width}] with "
                         f"unit last stride ({'uint8' if fp8_block or ring_codec else 'not uint8'}) and at most {T} "
                         f"slots (got rows "
                         f"{tuple(rows.shape)}, ring {tuple(ring.shape)} {ring.dtype}, {n_ring} slots)")
    out = torch.empty((T, H, width), dtype=torch.uint8 if fp8_block else x.dtype, device=x.device)
    norm = NO_NORM if eps is None else (UNWEIGHTED if weight is None else WEIGHTED)
    if T and H:
        cs = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}[cs_dtype or x.dtype]
        _norm_rope_kernel[(T, H)](
            rows, out, positions if positions is not None else out, weight if weight is not None else out,
            inv_freq if inv_freq is not None else out, out if ring is None else ring,
            out if ring is None else ring_slots, n_ring, 1 if ring is None else ring.shape[1],
            0.0 if eps is None else eps, rope_scale, rows.stride(0), rows.stride(1), out.stride(0), out.stride(1),
            0 if ring is None else ring.stride(0), 0 if ring is None else ring.stride(1), D=D, HALF=D // 2,
            BLOCK=triton.next_power_of_2(D // 2), ROPE_HALF=rope_half, NORM=norm, SIGN=-1.0 if inverse else 1.0,
            CS_DT=cs, FP8_BLOCK=fp8_block, FP4_GROUP=fp4_group, RING=ring is not None,
            LIBDEVICE=not isinstance(_norm_rope_kernel, InterpretedFunction), DS_NOPE=ds_nope, DS_TILE=ds_tile)
    return out.view(*x.shape[:-1], width)


def v4_kv_ring(x: torch.Tensor, eps: float, weight: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
               rope_scale: float, cs_dtype: torch.dtype, ring: torch.Tensor, slots: torch.Tensor,
               fp8_block: int = 0, ring_codec: Fp8DsMlaCodec | None = None) -> torch.Tensor:
    """The window keys' glue with the decode step's ring write in its epilogue (`LayerOps.v4_kv_ring`): `v4_norm_rope`
    of the key rows x [T, D] (RMSNorm, RoPE, FP8 rows where `fp8_block`), the first len(slots) of them (the decode rows)
    also stored at ring[slots, positions % R] — the models' `ring[slots, positions % R] = kv` (2 kernels) in the same
    launch, the same bytes (`ring_codec`: V4's FlashMLA rows, as `v4_norm_rope`'s)."""
    return v4_norm_rope(x, eps, weight, positions, inv_freq, rope_scale, cs_dtype, fp8_block=fp8_block, ring=ring,
                        ring_slots=slots, ring_codec=ring_codec)


@triton.jit(do_not_specialize=["stride_tb", "n"])
def _entry_rows_kernel(tables_ptr, out_ptr, n, epb, stride_tb, stride_ot, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    e = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = e < n
    page = tl.load(tables_ptr + t.to(tl.int64) * stride_tb + e // epb, mask=m, other=0).to(tl.int64)
    tl.store(out_ptr + t.to(tl.int64) * stride_ot + e, page * epb + e % epb, mask=m)


def entry_rows(tables: torch.Tensor, n: int, entries_per_block: int) -> torch.Tensor:
    """Decode rows' compressed entries 0 .. n-1 as flat rows of their paged cache (`LayerOps.entry_rows`): tables
    [T, W] (each row's block table) -> [T, n] int64 (as torch promotes), `deepseek_v4.model.entry_index(tables,
    arange(n).expand(T, n), entries_per_block)` (an arange and five integer kernels) in one launch. Integers: exact."""
    T = tables.shape[0]
    out = torch.empty(T, n, dtype=torch.int64, device=tables.device)
    if T and n:
        block = 256         # one variant for every context length (n is not specialized either)
        _entry_rows_kernel[(T, triton.cdiv(n, block))](tables, out, n, entries_per_block, tables.stride(0),
                                                       out.stride(0), BLOCK=block)
    return out
