"""DeepSeek-V4 / V4.1 sparse attention: shared-KV MQA (one K = V head) over a sliding window of keys, chosen
compressed entries and a per-head sink logit, in torch — the reference that the fused decode kernel
(`triton_sparse_decode.py`) is tested against, and the math both models' prefill chunks run.

The two models' softmaxes are the same function and differ in where they round (`V4_SOFTMAX`, `V41_SOFTMAX`):
- V4 (`attend_v4`, HF transformers' `DeepseekV4Attention`): the sink is one more logit of a float32 softmax over
  every key; logits come out of a model-dtype matmul, probabilities are rounded to the value dtype before PV.
- V4.1 (`attend_v41`, DeepSeek's `sparse_attn` kernel): float32 logits; the max runs over the keys only (floored at
  -1e30, so a row without a valid key gives exact zeros), the sink enters the denominator only, and the
  unnormalized probabilities are rounded to the value dtype before PV.

`sparse_decode_attention` is the decode rows' contract (one token per sequence, keys read in place from the
caches): the window keys are positions P-W+1 .. P of the row's ring (position p at ring row p % R, R >= W: rows
beyond W are rollback room for rejected drafts and never read), the compressed keys are the rows `rows` [B, K] of the
paged cache viewed as rows, masked by `valid`; caches hold their entries as the codecs of
`quantization/kv_formats.py` store them (None: unquantized, in the value dtype). `LayerOps.sparse_decode_attention`
is this function on the torch path and the Triton kernel on CUDA.

`sparse_prefill_attention` is the prefill chunks' contract: every chunk of a step at once (varlen queries, window
keys from the ring's history and the chunk's own keys, compressed rows per query), per chunk exactly the models'
per-sequence math; `LayerOps.sparse_prefill_attention` (None: the models' own per-chunk path) is the Triton kernel
of `triton_sparse_prefill.py` where the runtime chooses it.
"""

from __future__ import annotations

import torch

from openinfer.device_io import h2d
from openinfer.quantization.kv_formats import KVCodec

V4_SOFTMAX = "v4"
V41_SOFTMAX = "v41"
SOFTMAXES = (V4_SOFTMAX, V41_SOFTMAX)


def attend_v4(q: torch.Tensor, groups: list, sinks: torch.Tensor, scale: float, band: int | None = None,
              query_block: int = 512) -> torch.Tensor:
    """q [T, H, D] over key groups (keys, mask [T, L], picks): keys [T, L, D] per query, or [L, D] shared by all
    (K = V), or with picks [T, k] the rows of keys each query takes. The softmax spans every group and the sink.
    `band` (a window W): group 0 is a chunk's window keys (W history rows then the chunk), so query i only needs
    its columns [i, i + W]; queries go in blocks so memory stays linear in the chunk."""
    out = torch.empty_like(q)
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
            elif gi == 0 and band is not None:
                keys, mask = keys[i0:i1 + band], mask[:, i0:i1 + band]
            eq = "thd,tld->thl" if keys.dim() == 3 else "thd,ld->thl"
            lg = torch.einsum(eq, qb, keys).float() * scale
            logits.append(lg.masked_fill(~mask[:, None, :], float("-inf")))
            values.append(keys)
        logits.append(sinks.float()[None, :, None].expand(i1 - i0, -1, 1))
        probs = torch.cat(logits, dim=-1).softmax(dim=-1)
        acc, col = 0, 0
        for keys in values:
            n = keys.shape[-2]
            pr = probs[..., col:col + n].to(keys.dtype)
            acc = acc + torch.einsum("thl,tld->thd" if keys.dim() == 3 else "thl,ld->thd", pr, keys)
            col += n
        out[i0:i1] = acc
    return out


def attend_v41(q: torch.Tensor, win: tuple, comp: tuple | None, sinks: torch.Tensor, scale: float,
               query_block: int = 256) -> torch.Tensor:
    """Softmax over each query's window keys, its picked compressed entries and the sink, K = V, laid out as the
    reference's sparse_attn (window columns, then the picks; an invalid column gives nothing). `win`: (keys, index,
    valid): keys [T, W, D] per query (index None) or [L, D] shared with index [T, Wc] into them; `comp`: (keys,
    valid, picks): rows [T, k, D] (picks None) or all entries [N, D] with picks [T, k]. Probabilities are rounded
    to the value dtype before PV and the max is the keys' only, as in the reference kernel; a row with no valid key
    gives zeros."""
    out = torch.empty_like(q)
    sink = sinks.float()[None, :, None]
    wkeys, windex, wvalid = win
    for i0 in range(0, q.shape[0], query_block):
        i1 = min(i0 + query_block, q.shape[0])
        keys = [wkeys[windex[i0:i1]] if windex is not None else wkeys[i0:i1]]
        valid = [wvalid[i0:i1]]
        if comp is not None:
            ck, cvalid, picks = comp
            keys.append(ck[picks[i0:i1]] if picks is not None else ck[i0:i1])
            valid.append(cvalid[i0:i1])
        kv = torch.cat(keys, dim=1).float()
        ok = torch.cat(valid, dim=1)
        kv = kv * ok[..., None]
        s = torch.einsum("thd,tld->thl", q[i0:i1].float(), kv).mul(scale)
        s = s.masked_fill(~ok[:, None, :], float("-inf"))
        m = s.amax(-1, keepdim=True).clamp(min=-1e30)
        e = torch.exp(s - m)
        denom = e.sum(-1, keepdim=True) + torch.exp(sink - m)
        pv = torch.einsum("thl,tld->thd", e.to(q.dtype).float(), kv)
        out[i0:i1] = (pv / denom).to(q.dtype)
    return out


def window_positions(positions: torch.Tensor, window: int) -> torch.Tensor:
    """[B, W] the positions a decode row at P reads from its ring: P-W+1 .. P (negative ones are invalid)."""
    return positions[:, None] - window + 1 + torch.arange(window, device=positions.device)


def _decode_rows(stored: torch.Tensor, codec: KVCodec | None, dtype: torch.dtype) -> torch.Tensor:
    return stored.to(dtype) if codec is None else codec.decode(stored, dtype)


def sparse_decode_attention(q: torch.Tensor, *, sinks: torch.Tensor, scale: float, softmax: str,
                            ring: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor, window: int,
                            ring_codec: KVCodec | None = None, cache: torch.Tensor | None = None,
                            rows: torch.Tensor | None = None, valid: torch.Tensor | None = None,
                            cache_codec: KVCodec | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Decode rows' sparse attention, keys read from the caches (the torch reference).

    q [B, H, D] (its dtype is the value dtype); sinks [H]; `softmax`: V4_SOFTMAX or V41_SOFTMAX. Window: ring
    [slots, R, stored] holding position p of slot s at row p % R, slots [B] and positions [B] (each row's slot and
    own position, already written), `window` W <= R. Compressed (optional): cache [..., stored] (rows of a paged
    cache), rows [B, K] row indices into cache.view(-1, stored), valid [B, K] bool (None: all valid). Codecs: how
    ring and cache store their entries (None: in the value dtype). Writes `out` [B, H, D] when given; returns the
    output."""
    if softmax not in SOFTMAXES:
        raise ValueError(f"softmax must be one of {SOFTMAXES}, got {softmax!r}")
    kpos = window_positions(positions, window)
    wvalid = kpos >= 0
    # invalid keys are zeroed, not only masked: rows before the sequence start and unpicked rows may hold anything
    wkeys = _decode_rows(ring[slots[:, None], kpos % ring.shape[1]], ring_codec, q.dtype)
    wkeys = torch.where(wvalid[..., None], wkeys, 0)
    ckeys = cvalid = None
    if cache is not None:
        cvalid = torch.ones_like(rows, dtype=torch.bool) if valid is None else valid
        ckeys = _decode_rows(cache.view(-1, cache.shape[-1])[rows], cache_codec, q.dtype)
        ckeys = torch.where(cvalid[..., None], ckeys, 0)
    if softmax == V4_SOFTMAX:
        groups = [(wkeys, wvalid, None)] + ([] if ckeys is None else [(ckeys, cvalid, None)])
        res = attend_v4(q, groups, sinks, scale)
    else:
        res = attend_v41(q, (wkeys, None, wvalid), None if ckeys is None else (ckeys, cvalid, None), sinks, scale)
    if out is None:
        return res
    out.copy_(res)
    return out


def sparse_prefill_attention(q: torch.Tensor, *, sinks: torch.Tensor, scale: float, softmax: str, kv: torch.Tensor,
                             positions: torch.Tensor, cu_seqlens: torch.Tensor, ring: torch.Tensor,
                             slots: torch.Tensor, window: int, ring_codec: KVCodec | None = None,
                             cache: torch.Tensor | None = None, rows: torch.Tensor | None = None,
                             valid: torch.Tensor | None = None, cache_codec: KVCodec | None = None,
                             floors: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """All prefill chunks of a step at once, keys read from the caches (the torch reference; one Triton launch in
    `triton_sparse_prefill.py`).

    q [T, H, D] (its dtype is the value dtype): chunk c's queries are rows cu_seqlens[c] .. cu_seqlens[c+1] (int
    [C+1], cu_seqlens[0] = 0, cu_seqlens[C] = T) at consecutive positions (`positions` [T]). Window: query at P
    reads positions max(P-W+1, 0, floor) .. P; those before its chunk's first position from the ring [slots, R,
    stored] at slot slots[c], row p % R (the chunk's own keys not yet written there), those of the chunk from `kv`
    [T, D] (each row's own key, in the value dtype, as the ring will hold it decoded). `floors` [C] (V4.1's YOCO
    decoder layers: the first position a chunk's window may read) or None. Compressed (optional): cache [...,
    stored] rows, rows [T, K] per query into cache.view(-1, stored), valid [T, K] (None: all valid). Codecs as
    `sparse_decode_attention`'s. Writes `out` when given; returns the output.

    Per chunk this is exactly what the models' per-sequence prefill computes (the window as W history rows then
    the chunk's, in attend_v4's band layout and attend_v41's column order; the compressed rows gathered per query):
    V4.1's bits are the per-sequence path's; V4's differ from it only where its shared-key HCA matmul
    ("thd,ld->thl") and this per-query one round differently (float32: a few ulps)."""
    if softmax not in SOFTMAXES:
        raise ValueError(f"softmax must be one of {SOFTMAXES}, got {softmax!r}")
    if out is None:
        out = torch.empty_like(q)
    W, R, dev = window, ring.shape[1], q.device
    if window > R:
        raise ValueError(f"window {window} exceeds the ring's {R} rows")
    bounds = cu_seqlens.tolist()
    for c, slot in enumerate(slots.tolist()):
        t0, t1 = bounds[c], bounds[c + 1]
        if t1 == t0:
            continue
        pos = positions[t0:t1]
        start = int(pos[0])
        floor = 0 if floors is None else max(int(floors[c]), 0)
        hist = torch.arange(start - W, start, device=dev)
        # history rows no query reads (before the sequence, the floor or every window) are zeroed, not only masked
        old = _decode_rows(ring[slot, hist % R], ring_codec, q.dtype)
        old = torch.where((hist >= max(start - W + 1, floor))[:, None], old, 0)
        keys = torch.cat((old, kv[t0:t1].to(q.dtype)))
        ckeys = cvalid = None
        if cache is not None:
            crows = rows[t0:t1]
            cvalid = torch.ones_like(crows, dtype=torch.bool) if valid is None else valid[t0:t1]
            ckeys = _decode_rows(cache.view(-1, cache.shape[-1])[crows], cache_codec, q.dtype)
            ckeys = torch.where(cvalid[..., None], ckeys, 0)
        if softmax == V4_SOFTMAX:
            kpos = torch.cat((hist, pos))[None, :]
            mask = (kpos <= pos[:, None]) & (kpos > pos[:, None] - W) & (kpos >= floor)
            groups = [(keys, mask, None)] + ([] if ckeys is None else [(ckeys, cvalid, None)])
            out[t0:t1] = attend_v4(q[t0:t1], groups, sinks, scale, band=W)
        else:
            wc = min(int(pos[-1]) + 1, W)
            kpos = (pos[:, None] - W + 1).clamp(min=0) + torch.arange(wc, device=dev)
            wvalid = (kpos <= pos[:, None]) & (kpos >= floor)
            win = (keys, kpos - (start - W), wvalid)
            out[t0:t1] = attend_v41(q[t0:t1], win, None if ckeys is None else (ckeys, cvalid, None), sinks, scale)
    return out


def prefill_batch(chunks: list, device: torch.device) -> tuple[slice, torch.Tensor, torch.Tensor]:
    """A step's prefill chunks (PrefillChunk, consecutive rows) as `sparse_prefill_attention` takes them: (their
    rows in the step, cu_seqlens [C+1], state slots [C]), both made from the host's values in one copy that does not
    wait for the GPU (`device_io.h2d`; a plain copy would drain the stream at every layer)."""
    first, bounds = chunks[0].query_start, [0]
    for p in chunks:
        if p.query_start != first + bounds[-1]:
            raise ValueError(f"prefill chunks must be consecutive rows: one starts at {p.query_start}, "
                             f"not {first + bounds[-1]}")
        bounds.append(bounds[-1] + p.query_len)
    table = h2d(torch.tensor(bounds + [p.state_slot for p in chunks], dtype=torch.int32), device)
    return slice(first, first + bounds[-1]), table[:len(bounds)], table[len(bounds):]


def stack_picks(rows: list[torch.Tensor], valid: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per chunk compressed rows [n_c, K_c] and their validity -> [sum n_c, max K_c], padded with invalid row 0."""
    K = max(r.shape[1] for r in rows)
    pad = [(torch.nn.functional.pad(r, (0, K - r.shape[1])), torch.nn.functional.pad(v, (0, K - v.shape[1])))
           for r, v in zip(rows, valid)]
    return torch.cat([r for r, _ in pad]), torch.cat([v for _, v in pad])
