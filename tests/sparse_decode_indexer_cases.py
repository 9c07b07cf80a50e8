"""DeepSeek's sparse decode kernels (layers/triton_indexer.py, layers/triton_compressor.py) against the torch code
they replace, on random inputs over shuffled paged caches:

- the top-k (`index_topk`) against `torch_index_topk` (itself checked against the stable sort in
  tests/test_sparse_decode_indexer.py), on tie-heavy rows with -inf, -0.0 and NaN, k above and below the row length;
- V4's indexer scores and picks (`Indexer.select_decode` with the fused ops against its torch path): exactly equal on
  integer-valued inputs (every sum exact in float32, so any summation order gives the same bits: ties included),
  and within float32 summation error on random ones, the picks then a top-k of the reference scores;
- V4.1's scores over FP4 index keys decoded in the kernel (`Indexer.scores` over the codec's decoded rows), with the
  model dtype's roundings and the candidate-block mask, and its candidate blocks through the fused top-k;
- V4's compressor decode steps (`RunningCompressor` / `OverlappingCompressor.close_decode` with and without
  `ops.v4_hca_decode` / `v4_csa_decode`): the state and ring equal, the entries written equal to float32 rounding
  and in bf16 rounded where the reference rounds (`_compare_entries`), verify steps' rows included (CSA); and with
  V4's FlashMLA cache rows (`Fp8DsMlaCodec`, kv_cache_dtype="fp8_ds_mla"), the entries encoded in the kernel
  (`_compare_coded`; `cpu --ds-mla` runs only those).

- the tiny V4 and V4.1 models generating through the kernels as through the torch code (`check_engine`).

Used by tests/test_sparse_decode_indexer.py: Triton's interpreter on the CPU (a subprocess with TRITON_INTERPRET=1,
tiny shapes) and the GPU at full width. Run directly: `python tests/sparse_decode_indexer_cases.py cpu|cuda [--quick]`, or
`python tests/sparse_decode_indexer_cases.py --engine deepseek-v4-tiny deepseek-v41-tiny`.
"""

from __future__ import annotations

import sys

import torch

from openinfer.layers.basic import TORCH_OPS
from openinfer.layers.index_topk import torch_index_topk
from openinfer.models.deepseek_v4.config import DeepseekV4Config
from openinfer.models.deepseek_v4.family import DEEPSEEK_V4_TINY_CONFIG
from openinfer.models.deepseek_v4.model import (Indexer, InterleavedRope, OverlappingCompressor, RunningCompressor,
                                                entry_index)
from openinfer.layers.attention import AttentionMetadata
from openinfer.models.deepseek_v41.config import DeepseekV41Config
from openinfer.models.deepseek_v41.family import DEEPSEEK_V41_TINY_CONFIG
from openinfer.models.deepseek_v41.model import Attention as V41Attention
from openinfer.models.deepseek_v41.model import Indexer as V41Indexer
from openinfer.models.deepseek_v41.model import select_candidate_blocks
from openinfer.quantization.kv_formats import Fp4BlockCodec, Fp8DsMlaCodec, IdentityCodec, fp4_block_qdq

# full width: V4-Flash / V4.1-Flash (64 index heads of 128, top-512, head_dim 512 with 64 RoPE dims, ratios 4, 128)
FULL = dict(heads=64, index_dim=128, topk=512, head_dim=512, rope_dim=64)
QUICK = dict(heads=16, index_dim=64, topk=24, head_dim=32, rope_dim=8)     # (exact cases: 4^k heads and dims)


def fused_ops():
    """TRITON_OPS: the indexer's and compressors' decode kernels are in it."""
    from openinfer.layers.triton_ops import TRITON_OPS

    return TRITON_OPS


def v4_config(heads: int, index_dim: int, topk: int, head_dim: int, rope_dim: int) -> DeepseekV4Config:
    return DeepseekV4Config.from_hf({**DEEPSEEK_V4_TINY_CONFIG, "index_n_heads": heads, "index_head_dim": index_dim,
                                     "index_topk": topk, "head_dim": head_dim,
                                     "partial_rotary_factor": rope_dim / head_dim,
                                     "max_position_embeddings": 1 << 20})


def paged(g, entries: list[int], epb: int, row: tuple, dtype, device, fill=None):
    """A paged cache [blocks + 1, epb, *row] (the last block the scratch one) with random contents, and block tables
    [B, W] over shuffled pages holding `entries[b]` entries of sequence b (padded with page 0)."""
    need = [max(-(-e // epb), 1) for e in entries]
    pages = torch.randperm(sum(need) + 3, generator=g).tolist()
    blocks = len(pages) + 1
    cache = (fill((blocks, epb, *row)) if fill is not None else torch.randn(blocks, epb, *row, generator=g)).to(dtype)
    width = max(need)
    tables = torch.zeros(len(entries), width, dtype=torch.long)
    for b, k in enumerate(need):
        tables[b, :k] = torch.tensor([pages.pop() for _ in range(k)])
    return cache.to(device), tables.to(device)


def check_topk(device, g, rows: int, sizes: list[int], ks: list[int]) -> None:
    topk = fused_ops().index_topk
    for n in sizes:
        for k in ks:
            s = torch.randint(-4, 5, (rows, n), generator=g).float() * 0.25
            s += (torch.rand(rows, n, generator=g) < 0.3) * torch.randn(rows, n, generator=g)
            s[torch.rand(rows, n, generator=g) < 0.2] = float("-inf")
            s[torch.rand(rows, n, generator=g) < 0.1] = -0.0
            s[torch.rand(rows, n, generator=g) < 0.01] = float("nan")
            s[0] = float("-inf")                       # a row with nothing valid
            limit = torch.randint(0, n + 1, (rows,), generator=g)
            s, limit = s.to(device), limit.to(device)
            for lim in (None, limit):
                want, got = torch_index_topk(s, k, lim), topk(s, k, lim)
                assert torch.equal(got[0], want[0]), f"top-k picks differ (n={n}, k={k}, limit={lim is not None})"
                assert torch.equal(got[1], want[1]), f"top-k valid flags differ (n={n}, k={k})"
    print(f"top-k: {len(sizes) * len(ks)} shapes x {rows} rows equal to the reference")


def _assert_close(got, want, tol, what):
    """Scores equal where -inf, within `tol` (elementwise) elsewhere."""
    fin = want.isfinite()
    assert torch.equal(fin, got.isfinite()), f"{what}: masks differ"
    excess = ((got - want).abs() - tol)[fin]
    assert not fin.any() or excess.max() <= 0, f"{what}: beyond tolerance by {excess.max().item()}"


def _assert_topk_of(ref_scores, picks, valid, k, num_closed, tol):
    """`picks` are k distinct entries whose reference scores reach the k-th best within `tol` (float summation
    order may swap entries closer than that), valid exactly below num_closed."""
    kk = min(k, ref_scores.shape[1])
    assert picks.shape == (ref_scores.shape[0], kk)
    assert (picks.sort(-1).values.diff(dim=-1) > 0).all(), "picks not distinct / not in position order"
    kth = torch.topk(ref_scores, kk, dim=-1).values[:, -1:]
    got = ref_scores.gather(1, picks)
    assert ((got >= kth - tol) | (kth == float("-inf"))).all(), "a pick below the reference k-th score"
    assert torch.equal(valid, picks < num_closed[:, None])


def check_v4_indexer(device, g, dims: dict, dtype, batch: int, contexts: list[int]) -> None:
    """Indexer.select_decode with the fused scores + top-k against its torch path (gather, einsum, sort-free top-k)."""
    cfg = v4_config(**dims)
    H, D, r = cfg.index_n_heads, cfg.index_head_dim, cfg.compress_rates["compressed_sparse_attention"]
    ref_ix, fused_ix = Indexer(cfg, r, TORCH_OPS), Indexer(cfg, r, fused_ops())
    positions = torch.tensor([contexts[i % len(contexts)] - 1 for i in range(batch)])
    num_closed = (positions + 1) // r
    epb = 128 // r
    n = max((int(positions.max()) + 1) // r, 1)
    for exact in (True, False):
        if exact:       # integer values: every dot and weighted sum exact, so the kernels' sums give the same bits
            ints = lambda shape: torch.randint(-3, 4, shape, generator=g).float()    # noqa: E731
            cache, tables = paged(g, num_closed.tolist(), epb, (D,), dtype, device, fill=ints)
            q = ints((batch, H, D)).to(dtype)
            w = (2.0 ** torch.randint(-2, 3, (batch, H), generator=g)) * torch.randint(-1, 2, (batch, H), generator=g)
            if any(s != 2.0 ** round(torch.log2(torch.tensor(s)).item()) for s in (D ** -0.5, H ** -0.5)):
                continue        # index_dim or heads not a power of four: exactness needs power-of-two scales
        else:
            cache, tables = paged(g, num_closed.tolist(), epb, (D,), dtype, device)
            q = torch.randn(batch, H, D, generator=g).to(dtype)
            w = torch.randn(batch, H, generator=g)
        q, w, pos_d, closed_d = q.to(device), w.float().to(device), positions.to(device), num_closed.to(device)
        flat = entry_index(tables, torch.arange(n, device=device).expand(batch, -1), epb)
        want_scores = ref_ix.scores(q, w, cache.view(-1, D)[flat], closed_d)
        got_scores = fused_ops().index_scores(q, w, cache, tables, n, closed_d, D ** -0.5, weight_scale=H ** -0.5)
        picks, valid = fused_ix.select_decode(q, w, cache, tables, flat, closed_d)
        ref_picks, ref_valid = ref_ix.select_decode(q, w, cache, tables, flat, closed_d)
        if exact:
            assert torch.equal(got_scores, want_scores), "exact-input scores differ"
            assert torch.equal(picks, ref_picks) and torch.equal(valid, ref_valid), "exact-input picks differ"
        else:       # float32 sums in another order: the worst-case bound over the terms' magnitudes
            keys = cache.view(-1, D)[flat]
            tol = (D + H + 2) * 2.0 ** -24 * ref_ix.scores(q.abs(), w.abs(), keys.abs(), closed_d)
            _assert_close(got_scores, want_scores, tol, "V4 indexer scores")
            _assert_topk_of(want_scores, picks, valid, cfg.index_topk, closed_d, 2 * tol.nan_to_num(0.0).amax())
    print(f"V4 indexer {dtype}: B={batch} H={H} D={D} n={n} equal to the torch path")


def check_v4_indexer_chunk(device, g, dims: dict, dtype, context: int, queries: int, budget: int) -> None:
    """Indexer.select_chunk (a prefill chunk's last `queries` positions of `context`, every query with the chunk's
    one block table) with the fused scores + top-k against its torch path (the gathered keys, `select`), the
    queries in blocks of `budget` // n."""
    cfg = v4_config(**dims)
    H, D, r = cfg.index_n_heads, cfg.index_head_dim, cfg.compress_rates["compressed_sparse_attention"]
    from openinfer.layers.triton_ops import TRITON_OPS_NEXT

    ref_ix, fused_ix = Indexer(cfg, r, TORCH_OPS), Indexer(cfg, r, TRITON_OPS_NEXT)
    assert fused_ix.ops.index_prefill_scores is not None
    epb = 128 // r
    positions = torch.arange(context - queries, context)
    num_closed = ((positions + 1) // r).to(device)
    n = max(context // r, 1)
    cache, tables = paged(g, [n], epb, (D,), dtype, device)
    block_ids = tables[0]
    flat = entry_index(block_ids, torch.arange(n, device=device), epb)
    q = torch.randn(queries, H, D, generator=g).to(dtype).to(device)
    w = torch.randn(queries, H, generator=g).to(device)
    picks, valid = fused_ix.select_chunk(q, w, cache, block_ids, flat, num_closed, budget)
    ref_picks, ref_valid = ref_ix.select_chunk(q, w, cache, block_ids, flat, num_closed, budget)
    keys = cache.view(-1, D)[flat][None]
    want = ref_ix.scores(q, w, keys, num_closed)
    tol = (D + H + 2) * 2.0 ** -24 * ref_ix.scores(q.abs(), w.abs(), keys.abs(), num_closed)
    _assert_topk_of(want, picks, valid, cfg.index_topk, num_closed, 2 * tol.nan_to_num(0.0).amax())
    assert torch.equal(valid, ref_valid)
    agree = (picks == ref_picks).float().mean().item()
    print(f"V4 indexer chunk {dtype}: context={context} queries={queries} n={n} budget={budget}: top-k of the torch "
          f"path's scores ({agree:.1%} of picks identical)")


def check_v41_indexer(device, g, heads: int, dim: int, topk: int, dtype, batch: int, n: int, block: int) -> None:
    """V4.1's scores over FP4 index keys (decoded in the kernel; the model dtype's roundings) and over plain rows,
    with and without the candidate mask, and the candidate blocks and picks through the fused top-k."""
    ops = fused_ops()
    codec = Fp4BlockCodec(32, "e8m0")
    num_closed = torch.randint(0, n + 1, (batch,), generator=g)
    num_closed[0] = n
    epb = 32
    q = fp4_block_qdq(torch.randn(batch, heads, dim, generator=g).to(dtype), 32, "e8m0").to(device)
    w = (torch.randn(batch, heads, generator=g) * (dim ** -0.5 * heads ** -0.5)).to(dtype).to(device)
    closed = num_closed.to(device)
    nb = -(-n // block)
    cand = (torch.rand(batch, nb, generator=g) < 0.5).to(device)
    for fp4 in (True, False):
        rows = (lambda shape: codec.encode(torch.randn(*shape[:2], dim, generator=g))) if fp4 else None
        cache, tables = paged(g, num_closed.tolist(), epb, (codec.stored_dim(dim) if fp4 else dim,),
                              torch.uint8 if fp4 else dtype, device, fill=rows)
        flat = entry_index(tables, torch.arange(n, device=device).expand(batch, -1), epb)
        keys = codec.decode(cache.view(-1, cache.shape[-1])[flat], dtype) if fp4 else cache.view(-1, dim)[flat]
        want = V41Indexer.scores(q, w, keys, closed)
        # the dot is exact on FP4 grids, not on plain rows; then roundings to the model dtype of the dot, each
        # weighted head and the sum (a float32 sum in another order can flip each): bounded by the magnitudes
        mag = V41Indexer.scores(q.abs(), w.abs(), keys.abs(), closed).nan_to_num(0.0, neginf=0.0)
        ulp = 2.0 ** -7 if dtype == torch.bfloat16 else (dim + heads + 2) * 2.0 ** -24
        for candidates in (None, cand):
            got = ops.index_scores(q, w, cache, tables, n, closed, 1.0, fp4=fp4, round_products=True,
                                   candidates=candidates, candidate_block=block)
            ref = want
            if candidates is not None:
                ref = want.masked_fill(~candidates.repeat_interleave(block, dim=-1)[:, :n], float("-inf"))
            _assert_close(got, ref, 2 * ulp * mag, f"V4.1 scores (fp4={fp4}, candidates={candidates is not None})")
            picks, valid = ops.index_topk(got, topk)
            want_picks, want_valid = torch_index_topk(got, topk)
            assert torch.equal(picks, want_picks) and torch.equal(valid, want_valid), "V4.1 picks differ"
            blocks = select_candidate_blocks(got, closed, 3, block, ops.index_topk)
            assert torch.equal(blocks, select_candidate_blocks(got, closed, 3, block)), "candidate blocks differ"
    print(f"V4.1 indexer {dtype}: B={batch} H={heads} D={dim} n={n} equal to the torch path")


def _rope(cfg: DeepseekV4Config, device) -> InterleavedRope:
    rope = InterleavedRope(cfg.compress_rope, cfg.rope_head_dim, cfg.max_position_embeddings)
    rope.reset(torch.device(device))
    return rope


def _decode_positions(g, ratio: int, batch: int) -> torch.Tensor:
    """Positions of every kind for a window of `ratio`: opening a window, closing one (the first window too), in
    between; some far out (large RoPE angles)."""
    base = torch.randint(0, 3000, (batch,), generator=g) * ratio
    base[: batch // 4] += (10 ** 5 // ratio) * ratio
    phase = torch.randint(0, ratio, (batch,), generator=g)
    phase[0::3] = ratio - 1                                    # every third row closes its window
    phase[1::5] = 0
    pos = base + phase
    pos[-1] = ratio - 1                                        # window 0 closes
    return pos


def _compare_entries(got, want, before, dtype, what) -> float:
    """The entries the reference wrote (rows of the cache, the scratch block aside, that changed from `before`):
    float32 within 2^-16 of each entry's largest channel (the GPU's exp and division are approximate to a few
    float32 ulps, which cancellation in the pooled sum and the norm can scale up); bf16 within 2^-4 of it and, over
    all of them, at least 90% of the values bit-equal (in Triton's interpreter, whose exp and cos round as torch's
    do, all of them are). The bf16 reference rounds each slot's kv, probability and product, the pooled sum, the
    normed entry and cos/sin: on the GPU an exp's last bit (ex2.approx) or the pooled sum's order flips some of
    them, each by 2^-8 relative, and the norm and RoPE mix the channels, so an entry's worst channel can move by
    about 8 * 2^-8 of the entry (mixed-sign kv that cancel in the pooled sum scale the slot roundings up further:
    the bf16 cases use positive kv, `_kv_values`). Returns the largest difference."""
    written = (want[:-1] != before[:-1]).any(-1)
    assert written.any(), f"{what}: the reference wrote no entry"
    g, w = got[:-1][written].float(), want[:-1][written].float()
    err = (g - w).abs().amax(-1)
    excess = (err - (2.0 ** -16 if dtype == torch.float32 else 2.0 ** -4) * w.abs().amax(-1)).max().item()
    assert excess <= 0, f"{what} entries differ beyond tolerance by {excess}"
    if dtype == torch.bfloat16:
        same = (g == w).float().mean().item()
        assert same >= 0.9, f"{what}: only {same:.1%} of the bf16 entry values equal the reference's"
    return err.max().item()


def _compare_coded(got, want, before, codec, dtype, what) -> float:
    """`_compare_entries` for caches of `codec` rows: the entries the reference wrote, decoded, within one E4M3 step
    of their tile (2^-3 of the tile's scale * 448 ... taken as 2^-3 of the entry's largest channel) — an entry within
    float32 rounding of the reference's may round to the neighbouring FP8 value — and at least 90% of the bytes
    equal (bit-equal rows wherever the values are)."""
    written = (want[:-1] != before[:-1]).any(-1)
    assert written.any(), f"{what}: the reference wrote no entry"
    gb, wb = got[:-1][written], want[:-1][written]
    same = (gb == wb).float().mean().item()
    assert same >= 0.9, f"{what}: only {same:.1%} of the coded entry bytes equal the reference's"
    g, w = codec.decode(gb, torch.float32), codec.decode(wb, torch.float32)
    err = (g - w).abs().amax(-1)
    excess = (err - 2.0 ** -3 * w.abs().amax(-1)).max().item()
    assert excess <= 0, f"{what} coded entries differ beyond one FP8 step by {excess}"
    return err.max().item()


def _kv_values(g, shape, dtype, kv_cols: int) -> torch.Tensor:
    """Random compressor rows whose first `kv_cols` columns are kv; positive in bf16 (see `_compare_entries`)."""
    x = torch.randn(*shape, generator=g)
    if dtype == torch.bfloat16:
        x[..., :kv_cols] = x[..., :kv_cols].abs() + 0.25
    return x


def _entry_pages(g, pos: torch.Tensor, ratio: int, D: int, dtype, device, codec=None):
    """A paged entry cache [rows + 3 blocks, 128 / ratio, D] and tables [rows, W] for decode rows at `pos`: the page
    of the window each row would close is its own (shuffled), every other column the untouched page 0 (a compressor
    writes entries and never reads them, so far-out positions need no large cache)."""
    epb = 128 // ratio
    col = ((pos + 1) // ratio - 1).clamp(min=0) // epb
    tables = torch.zeros(len(pos), int(col.max()) + 1, dtype=torch.long)
    tables[torch.arange(len(pos)), col] = torch.randperm(len(pos) + 1, generator=g)[:len(pos)] + 1
    if codec is not None:       # random bytes: rows of `codec`
        cache = torch.randint(0, 256, (len(pos) + 3, epb, codec.stored_dim(D)), generator=g, dtype=torch.uint8)
    else:
        cache = torch.randn(len(pos) + 3, epb, D, generator=g).to(dtype)
    return cache.to(device), tables.to(device)


def _compressors(kind, cfg: DeepseekV4Config, D: int, ratio: int, g, device):
    """The same compressor (one random kv_norm weight) on the torch ops and on the fused ones."""
    weight = torch.rand(D, generator=g) + 0.5
    pair = [kind(cfg.hidden_size, D, ratio, cfg.rms_norm_eps, ops) for ops in (TORCH_OPS, fused_ops())]
    for m in pair:
        m.kv_norm.weight.data = weight.clone()
        m.to(device)
    return pair


def check_v4_hca(device, g, dims: dict, dtype, batch: int, ratio: int, state_rows: int, ds_mla: bool = False) -> float:
    cfg = v4_config(**dims)
    D = cfg.head_dim
    rope = _rope(cfg, device)
    ref, fused = _compressors(RunningCompressor, cfg, D, ratio, g, device)
    pos = _decode_positions(g, ratio, batch)
    slots = torch.randperm(batch + 2, generator=g)[:batch]
    state = torch.stack((torch.randn(batch + 3, state_rows, D, generator=g),                      # max gate
                         torch.rand(batch + 3, state_rows, D, generator=g) * 4 + 0.1,            # sum of exp
                         _kv_values(g, (batch + 3, state_rows, D), dtype, D)), dim=2)             # weighted kv
    codec = Fp8DsMlaCodec.for_head(D, cfg.rope_head_dim) if ds_mla else None
    cache, tables = _entry_pages(g, pos, ratio, D, dtype, device, codec)
    rows = _kv_values(g, (batch, 2 * D), dtype, D) * 2
    pos, slots, state, rows = pos.to(device), slots.to(device), state.to(device), rows.to(device)
    s1, s2, c1, c2 = state.clone(), state.clone(), cache.clone(), cache.clone()
    ref.close_decode(s1, c1, rows, pos, slots, tables, rope, codec=codec, dtype=dtype)
    fused.close_decode(s2, c2, rows, pos, slots, tables, rope, codec=codec, dtype=dtype)
    serr = (s1 - s2).abs().max().item()
    assert serr <= 1e-5 * s1.abs().max().item(), f"HCA state differs by {serr}"
    err = (_compare_entries(c2, c1, cache, dtype, "HCA") if codec is None
           else _compare_coded(c2, c1, cache, codec, dtype, "HCA fp8_ds_mla"))
    print(f"V4 HCA {dtype}{' fp8_ds_mla' if ds_mla else ''}: B={batch} D={D} ratio={ratio} L={state_rows}: "
          f"state err {serr:.2e}, entry err {err:.2e}")
    return err


def check_v4_csa(device, g, dims: dict, dtype, batch: int, ratio: int, extra: int, indexer: bool,
                 ds_mla: bool = False) -> float:
    """Plain decode rows, then a verify step: requests of 1 + extra consecutive rows (offsets 0..extra)."""
    cfg = v4_config(**dims)
    D = cfg.index_head_dim if indexer else cfg.head_dim
    rope = _rope(cfg, device)
    ref, fused = _compressors(OverlappingCompressor, cfg, D, ratio, g, device)
    codec = Fp8DsMlaCodec.for_head(D, cfg.rope_head_dim) if ds_mla else None
    R = 2 * ratio + extra
    worst = 0.0
    for verify in (False, True):
        if verify:
            reqs = max(batch // (1 + extra), 1)
            start = _decode_positions(g, ratio, reqs) - extra
            start = start.clamp(min=0)
            pos = (start[:, None] + torch.arange(1 + extra)).flatten()
            offsets = torch.arange(1 + extra).repeat(reqs)
            slots = torch.randperm(reqs + 2, generator=g)[:reqs].repeat_interleave(1 + extra)
        else:
            pos = _decode_positions(g, ratio, batch)
            offsets = None
            slots = torch.randperm(batch + 2, generator=g)[:batch]
        T = len(pos)
        ring = _kv_values(g, (int(slots.max()) + 2, R, 4 * D), dtype, 2 * D).to(device)
        cache, tables = _entry_pages(g, pos, ratio, D, dtype, device, codec)
        rows = (_kv_values(g, (T, 4 * D), dtype, 2 * D) * 2).to(device)
        pos, slots = pos.to(device), slots.to(device)
        offsets = None if offsets is None else offsets.to(device)
        r1, r2, c1, c2 = ring.clone(), ring.clone(), cache.clone(), cache.clone()
        ref.close_decode(r1, c1, rows, pos, slots, tables, rope, offsets, codec=codec, dtype=dtype)
        fused.close_decode(r2, c2, rows, pos, slots, tables, rope, offsets, codec=codec, dtype=dtype)
        assert torch.equal(r1, r2), "CSA ring differs"
        worst = max(worst, _compare_entries(c2, c1, cache, dtype, "CSA") if codec is None
                    else _compare_coded(c2, c1, cache, codec, dtype, "CSA fp8_ds_mla"))
    print(f"V4 CSA{' indexer' if indexer else ''}{' fp8_ds_mla' if ds_mla else ''} {dtype}: B={batch} D={D} "
          f"ratio={ratio} rollback={extra}: entry err {worst:.2e}")
    return worst


def check_v41_compressor(device, g, dims: dict, dtype, batch: int, layer: int, extra: int, quantized: bool) -> float:
    """V4.1's `Attention._close_groups` for decode rows with and without `ops.v41_compress_decode` /
    `v41_index_keys_decode`: the group ring equal, the entries and index keys written equal (FP4 rows: the packed
    bytes; unquantized: as `_compare_entries`), a verify step's rows included (`extra` rollback rows)."""
    cfg = DeepseekV41Config.from_dict({**DEEPSEEK_V41_TINY_CONFIG, "head_dim": dims["head_dim"],
                                       "rope_head_dim": dims["rope_dim"], "index_head_dim": dims["index_dim"],
                                       "index_n_heads": dims["heads"]})
    ref, fused = V41Attention(cfg, layer, TORCH_OPS), V41Attention(cfg, layer, fused_ops())
    ref.compressor.norm.weight.data = torch.rand(cfg.head_dim, generator=g) + 0.5
    ref.indexer.k_norm.weight.data = torch.rand(cfg.index_head_dim, generator=g) + 0.5
    ref.indexer.wk.weight.data = torch.randn(cfg.index_head_dim, cfg.head_dim, generator=g) * cfg.head_dim ** -0.5
    fused.load_state_dict(ref.state_dict())
    for m in (ref, fused):
        m.to(device, dtype)
        m.compressor.norm.weight.data = m.compressor.norm.weight.float()
        m.indexer.k_norm.weight.data = m.indexer.k_norm.weight.float()
    yarn = {"rope_type": "yarn", "rope_theta": cfg.compress_rope_theta, "factor": cfg.rope_factor,
            "original_max_position_embeddings": cfg.original_seq_len, "beta_fast": cfg.beta_fast,
            "beta_slow": cfg.beta_slow, "attention_factor": 1.0}
    rope = InterleavedRope(yarn, cfg.rope_head_dim, cfg.max_position_embeddings)
    rope.reset(torch.device(device))
    r, D, Di = cfg.ratio(layer), cfg.head_dim, cfg.index_head_dim
    codecs = ({"ckv": Fp4BlockCodec(16, "e4m3"), "cidx": Fp4BlockCodec(32, "e8m0")} if quantized else
              {"ckv": IdentityCodec(dtype), "cidx": IdentityCodec(dtype)})
    worst = 0.0
    for verify in (False, True):
        reqs = max(batch // (1 + extra), 1) if verify else batch
        rows_per = 1 + extra if verify else 1
        start = (_decode_positions(g, max(r, 2), reqs) - (rows_per - 1)).clamp(min=0)
        pos = (start[:, None] + torch.arange(rows_per)).flatten()
        offsets = torch.arange(rows_per).repeat(reqs) if verify else None
        slots = torch.randperm(reqs + 2, generator=g)[:reqs].repeat_interleave(rows_per)
        T = len(pos)
        ckv, tables = _entry_pages(g, pos, r, codecs["ckv"].stored_dim(D), torch.float32, "cpu")
        cidx = torch.randn(ckv.shape[0], ckv.shape[1], codecs["cidx"].stored_dim(Di), generator=g)
        if quantized:       # valid FP4 rows to start from
            ckv = codecs["ckv"].encode(torch.randn(*ckv.shape[:2], D, generator=g))
            cidx = codecs["cidx"].encode(torch.randn(*ckv.shape[:2], Di, generator=g))
        state = {"ckv": ckv.to(dtype if not quantized else torch.uint8).to(device),
                 "cidx": cidx.to(dtype if not quantized else torch.uint8).to(device), "codecs": codecs}
        if r > 1:
            state["crows"] = torch.randn(int(slots.max()) + 2, r + extra, 2 * D, generator=g).to(device)
            rows = (torch.randn(T, 2 * D, generator=g) * 2).to(device)
        else:
            rows = torch.randn(T, D, generator=g).to(dtype).to(device)
        meta = AttentionMetadata(block_size=128, slot_mapping=torch.zeros(T, dtype=torch.long, device=device),
                                 num_decode_tokens=T, decode_block_tables=tables.to(device),
                                 decode_state_slots=slots.to(device),
                                 decode_row_offsets=None if offsets is None else offsets.to(device))
        pos = pos.to(device)
        s1 = {k: v.clone() if torch.is_tensor(v) else v for k, v in state.items()}
        s2 = {k: v.clone() if torch.is_tensor(v) else v for k, v in state.items()}
        ref._close_groups(pos, rows, rope, s1, meta, None, dtype)
        assert fused._fused_close(s2), "the fused path does not take these caches"
        fused._close_groups(pos, rows, rope, s2, meta, None, dtype)
        if r > 1:
            assert torch.equal(s1["crows"], s2["crows"]), "V4.1 group ring differs"
        for kind in ("ckv", "cidx"):
            if quantized:   # the packed rows the reference wrote: at least 99% of their bytes equal, the rest
                #             (a pooled or normed value rounded the other way) decoding within the format's step
                written = (s1[kind][:-1] != state[kind][:-1]).any(-1)
                assert written.any()
                a, b = s1[kind][:-1][written], s2[kind][:-1][written]
                same = (a == b).float().mean().item()
                assert same >= 0.99, f"V4.1 {kind}: only {same:.2%} of the packed bytes equal"
                da, db = codecs[kind].decode(a, torch.float32), codecs[kind].decode(b, torch.float32)
                err = ((da - db).abs().amax(-1) / da.abs().amax(-1)).max().item()
                assert err <= 0.5, f"V4.1 {kind}: an FP4 entry differs by {err:.2f} of its largest value"
                worst = max(worst, err)
            else:
                worst = max(worst, _compare_entries(s2[kind], s1[kind], state[kind], dtype, f"V4.1 {kind}"))
    print(f"V4.1 compressor {dtype}: layer {layer} (ratio {r}) B={batch} D={D} quantized={quantized} "
          f"rollback={extra}: worst {worst:.2e}")
    return worst


def check_engine(name: str) -> None:
    """The tiny model (`LLM(name)`, float32 on the CPU) generating greedily with the torch ops and with the sparse
    decode kernels (and V4's prefill indexer scores) in their place (through `make_kernels`; Triton's interpreter): the same tokens, the same
    cumulative log-probabilities to 1e-4. Decode steps cross compression windows and score more entries than
    index_topk (and, V4.1, than its candidate blocks hold): 8 tokens after prompts of 9 and 40 feed decode positions
    9-15 and 40-46, which close V4's CSA windows (ratio 4: 11, 15, 43), an HCA window (ratio 16: 15) and V4.1's
    every step (ratios 2 and 1); V4's 9-token request starts below index_topk (2 entries of 4), the 40-token one
    above it, and above V4.1's index_topk and 3 candidate blocks of 4 entries."""
    import dataclasses

    from openinfer import LLM, SamplingParams
    from openinfer.engine import llm_engine
    from openinfer.layers import triton_compressor, triton_indexer

    fused = dataclasses.replace(
        TORCH_OPS, index_topk=triton_indexer.index_topk, index_scores=triton_indexer.index_scores,
        index_prefill_scores=triton_indexer.index_scores, v4_hca_decode=triton_compressor.v4_hca_decode, v4_csa_decode=triton_compressor.v4_csa_decode,
        v41_compress_decode=triton_compressor.v41_compress_decode,
        v41_index_keys_decode=triton_compressor.v41_index_keys_decode)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 120000, (n,), generator=g).tolist() for n in (9, 40)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    make = llm_engine.make_kernels
    runs = []
    for ops in (None, fused):
        if ops is not None:
            llm_engine.make_kernels = lambda config: (make(config)[0], fused)
        try:
            llm = LLM(name, device="cpu")
            runs.append([o.outputs[0] for o in llm.generate(prompt_token_ids=prompts, sampling_params=params,
                                                            use_tqdm=False)])
            llm.shutdown()
        finally:
            llm_engine.make_kernels = make
    for want, got in zip(*runs):
        assert got.token_ids == want.token_ids, f"{name}: tokens differ"
        assert abs(got.cumulative_logprob - want.cumulative_logprob) <= 1e-4, f"{name}: log-probabilities differ"
    print(f"{name}: {len(prompts)} requests x {params.max_tokens} tokens equal through the kernels")


def run_all(device: str, quick: bool) -> None:
    g = torch.Generator().manual_seed(0)
    dims = QUICK if quick else FULL
    if quick:
        check_topk(device, g, 3, [1, 5, 200, 1025], [1, 7, 300])
    else:
        check_topk(device, g, 64, [1, 100, 511, 512, 513, 4096, 16384, 70000], [1, 64, 512, 2048])
    for dtype in (torch.float32, torch.bfloat16):
        # Triton's CPU interpreter computes bf16 dots on raw bits: the scores in float32 only there
        if dtype == torch.float32 or device == "cuda":
            contexts = [1, 3, 4, 5, 63, 64, 65, 200] if quick else [1, 4, 5, 1024, 2047, 4096, 16384, 65536]
            for batch in ((6,) if quick else (1, 32, 128)):
                check_v4_indexer(device, g, dims, dtype, batch, contexts)
            for context, queries, budget in (((9, 9, 1 << 26), (200, 23, 128)) if quick else
                                             ((1024, 1024, 1 << 26), (8192, 2048, 1 << 26), (4096, 700, 1 << 18))):
                check_v4_indexer_chunk(device, g, dims, dtype, context, queries, budget)
            block = 4 if quick else 64
            for batch, n in (((5, 40),) if quick else ((1, 4096), (32, 1024), (128, 512))):
                check_v41_indexer(device, g, dims["heads"], dims["index_dim"], dims["topk"], dtype, batch, n, block)
        for batch in ((6,) if quick else (1, 32, 128)):
            for ratio in ((4, 16) if quick else (4, 128)):
                for state_rows in (1, 3):
                    check_v4_hca(device, g, dims, dtype, batch, ratio, state_rows)
            for extra in (0, 2):
                for indexer in (False, True):
                    check_v4_csa(device, g, dims, dtype, batch, 4, extra, indexer)
                for layer in (1, 3):            # the tiny schedule's ratio-2 and ratio-1 KV + index-key sources
                    for quantized in (True, False):
                        check_v41_compressor(device, g, dims, dtype, batch, layer, extra, quantized)
    print("all cases pass")


def run_ds_mla(device: str, quick: bool) -> None:
    """V4's HCA and CSA decode steps writing `Fp8DsMlaCodec` rows, fused against torch, fp32 and bf16."""
    g = torch.Generator().manual_seed(1)
    dims = QUICK if quick else FULL
    for dtype in (torch.float32, torch.bfloat16):
        for batch in ((6,) if quick else (1, 32, 128)):
            for ratio in ((4, 16) if quick else (4, 128)):
                check_v4_hca(device, g, dims, dtype, batch, ratio, 1 if quick else 3, ds_mla=True)
            check_v4_csa(device, g, dims, dtype, batch, 4, 2, False, ds_mla=True)
    print("all cases pass")


if __name__ == "__main__":
    from tests.triton_interpreter import patch_lang_once_per_launch

    patch_lang_once_per_launch()
    if "--engine" in sys.argv:
        for model in sys.argv[sys.argv.index("--engine") + 1:]:
            check_engine(model)
        print("engine cases pass")
    elif "--ds-mla" in sys.argv:    # V4's compressors writing FlashMLA cache rows (kv_cache_dtype="fp8_ds_mla")
        run_ds_mla(sys.argv[1] if len(sys.argv) > 1 else "cpu", "--quick" in sys.argv)
    else:
        run_all(sys.argv[1] if len(sys.argv) > 1 else "cpu", "--quick" in sys.argv)
