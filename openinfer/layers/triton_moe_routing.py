"""DeepSeek-V4/V4.1 MoE routing and the glue around the grouped expert GEMMs, one Triton kernel each.

The torch path (the models' `Router` / `Gate` and `Experts._grouped` / `MoE.routed`, the reference) spends ~10
kernels routing (softplus, sqrt, bias, top-k and its sort, gather, sum, divide, scale) and ~15 around the experts
(argsort, counts, cumsum, gathers, weighting, masking, an atomic index_add). Here:

- `route`: router logits [T, E] -> (experts [T, k] int64, weights [T, k]) in one launch: sqrt(softplus) scores, the
  top-k of scores + a selection bias (a per-row second bias for V4.1's image rows) or the hash table's experts of
  each token id (V4's first layers), the picked scores renormalized and scaled. Each op rounds to the logits' dtype
  as torch's ops in that dtype do (V4: bf16 logits; V4.1: float32); on CUDA the transcendental functions are
  CUDA's own (libdevice, as torch's kernels call them), so the scores are torch's bit for bit. Ties pick the lowest
  expert id, as torch.topk on CUDA does (its radix select keeps the first-seen of equal values); picks come out
  best first.
- `expert_order`: picks [T, k] -> the stable expert-major order of the flattened picks (skipped picks, -1 with
  expert parallelism, last), each sorted row's token, the inverse permutation and the grouped GEMMs' cumulative
  offsets, in one launch: a pick's sorted position is the number of picks with a smaller (expert, index) key,
  counted by each program over all picks. No host sync; beyond `SORT_MAX_PICKS` picks (prefill chunks) the count
  grows quadratically and torch's argsort takes over (`layers/basic.py: sort_by_expert`, the same order).
- `moe_act`: the clamped SwiGLU between the two grouped GEMMs, in V4's rounding (each op in the model dtype) or
  V4.1's (float32, times each sorted row's routing weight, read through the order: no gathered copy).
- `moe_combine`: expert outputs in sorted order -> per-token sums over the token's picks in pick order (weighted by
  the routing weights or not), float32 accumulation and one rounding: deterministic, where the torch path's
  index_add is atomic.

Integer arguments that change with the batch are not specialized on (openinfer/engine/compile_watch.py).
Tests: tests/test_fused_mhc_routing.py.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from openinfer.layers.basic import sort_by_expert
from openinfer.layers.triton_mhc import round_to

SORT_CHUNK = 64            # picks per program of `_expert_order_kernel` (and per step of its count)
SORT_EXPERTS = 64          # experts per offsets program
SORT_MAX_PICKS = 8192      # above: torch's sort (the kernel's count is quadratic in the picks)
COMBINE_BLOCK_H = 1024
ACT_BLOCK = 1024


@triton.jit
def _score(x, DTYPE: tl.constexpr, LIBDEVICE: tl.constexpr):
    """sqrt(softplus(x)) from float32 logits as torch computes it in DTYPE: softplus (threshold 20) rounded to
    DTYPE, then an IEEE square root rounded to DTYPE. LIBDEVICE: CUDA's expf / log1pf; else (the interpreter)
    log1p(e) = log(1 + e) * e / ((1 + e) - 1), exact to a few ulp."""
    if LIBDEVICE:
        sp = libdevice.log1p(libdevice.exp(x))
    else:
        e = tl.exp(x)
        u = 1.0 + e
        sp = tl.where(u == 1.0, e, tl.log(u) * (e / (u - 1.0)))
    sp = tl.where(x > 20.0, x, sp)
    return round_to(tl.sqrt_rn(round_to(sp, DTYPE)), DTYPE)


@triton.jit(do_not_specialize=["stride_l", "has_alt", "ids_ptr", "alt_rows_ptr"])
def _route_kernel(logit_ptr, stride_l, bias_ptr, alt_bias_ptr, alt_rows_ptr, has_alt, table_ptr, ids_ptr,
                  experts_ptr, weights_ptr, E, route_scale, K: tl.constexpr, K_PAD: tl.constexpr,
                  E_PAD: tl.constexpr, HASHED: tl.constexpr, RENORM: tl.constexpr, LIBDEVICE: tl.constexpr):
    """Program t: token t's K experts (table[ids[t]], or the top-K of score + bias, lowest id first among equal
    values; rows flagged in alt_rows use alt_bias when has_alt) and their weights: the experts' scores, / (their
    sum + 1e-20) when RENORM, * route_scale. `has_alt` is a runtime flag (and the token ids and row flags may be
    views at any offset): image rows or none, one compiled kernel."""
    t = tl.program_id(0)
    DT = logit_ptr.dtype.element_ty
    row = logit_ptr + t.to(tl.int64) * stride_l
    j = tl.arange(0, K_PAD)
    jmask = j < K
    if HASHED:
        picks = tl.load(table_ptr + tl.load(ids_ptr + t).to(tl.int64) * K + j, mask=jmask, other=0).to(tl.int32)
    else:
        e = tl.arange(0, E_PAD)
        emask = e < E
        score = _score(tl.load(row + e, mask=emask, other=0.0).to(tl.float32), DT, LIBDEVICE)
        bias = tl.load(bias_ptr + e, mask=emask, other=0.0).to(tl.float32)
        if has_alt != 0:
            if tl.load(alt_rows_ptr + t) != 0:
                bias = tl.load(alt_bias_ptr + e, mask=emask, other=0.0).to(tl.float32)
        sel = tl.where(emask, score + bias, float("-inf"))
        picks = tl.zeros((K_PAD,), tl.int32)
        for i in tl.static_range(K):
            best = tl.max(sel, axis=0)
            pick = tl.min(tl.where(sel == best, e, E_PAD), axis=0)
            picks = tl.where(j == i, pick, picks)
            sel = tl.where(e == pick, float("-inf"), sel)
    w = tl.where(jmask, _score(tl.load(row + picks, mask=jmask, other=0.0).to(tl.float32), DT, LIBDEVICE), 0.0)
    if RENORM:
        total = round_to(round_to(tl.sum(w, axis=0), DT) + 1e-20, DT)
        w = round_to(tl.div_rn(w, total), DT)
    w = round_to(w * route_scale, DT)
    tl.store(experts_ptr + t * K + j, picks.to(tl.int64), mask=jmask)
    tl.store(weights_ptr + t * K + j, w, mask=jmask)


def route(logits: torch.Tensor, bias: torch.Tensor | None, top_k: int, route_scale: float, renormalize: bool, *,
          alt_bias: torch.Tensor | None = None, alt_rows: torch.Tensor | None = None,
          table: torch.Tensor | None = None, token_ids: torch.Tensor | None = None):
    """Router logits [T, E] -> (experts [T, top_k] int64, weights [T, top_k] in the logits' dtype). Experts: the
    top-k of sqrt(softplus(logits)) + `bias` [E] (rows where `alt_rows` [T] is set use `alt_bias`), or, given
    `table` [vocab, top_k], table[token_ids]. Weights: the experts' scores, renormalized to sum 1 when
    `renormalize`, times `route_scale`."""
    T, E = logits.shape
    dev = logits.device
    experts = torch.empty(T, top_k, dtype=torch.long, device=dev)
    weights = torch.empty(T, top_k, dtype=logits.dtype, device=dev)
    if T == 0:
        return experts, weights
    hashed, alt = table is not None, alt_bias is not None and alt_rows is not None
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    bias = bias if bias is not None else logits         # (unused pointers get any tensor of the same type)
    _route_kernel[(T,)](logits, logits.stride(0), bias, alt_bias if alt else bias,
                        (alt_rows if alt else experts).view(torch.uint8), int(alt),
                        table.contiguous() if hashed else experts,
                        token_ids if hashed else experts, experts, weights, E, route_scale, K=top_k,
                        K_PAD=triton.next_power_of_2(top_k), E_PAD=triton.next_power_of_2(E), HASHED=hashed,
                        RENORM=renormalize, LIBDEVICE=logits.is_cuda, num_warps=2)
    return experts, weights


@triton.jit(do_not_specialize=["N", "chunks"])
def _expert_order_kernel(experts_ptr, order_ptr, rows_ptr, inv_ptr, offs_ptr, N, chunks, n, k,
                         CH: tl.constexpr, EB: tl.constexpr):
    """Programs [0, chunks): pick i of chunk `pid` goes to position #{j: key_j < key_i}, key = expert * N + i with
    skipped picks' expert = n (a stable sort by expert, skipped last): order[pos] = i, rows[pos] = i // k (its
    token), inv[i] = pos. Programs from `chunks` on: offs[e] = #{j: expert_j <= e} for a block of EB experts."""
    pid = tl.program_id(0)
    if pid < chunks:
        i = pid * CH + tl.arange(0, CH)
        imask = i < N
        ei = tl.load(experts_ptr + i, mask=imask, other=0).to(tl.int32)
        key_i = tl.where(ei < 0, n, ei) * N + i
        pos = tl.zeros((CH,), tl.int32)
        for c in range(chunks):
            jj = c * CH + tl.arange(0, CH)
            jmask = jj < N
            ej = tl.load(experts_ptr + jj, mask=jmask, other=0).to(tl.int32)
            key_j = tl.where(jmask, tl.where(ej < 0, n, ej) * N + jj, 2147483647)
            pos += tl.sum((key_j[None, :] < key_i[:, None]).to(tl.int32), axis=1)
        tl.store(order_ptr + pos, i.to(tl.int64), mask=imask)
        tl.store(rows_ptr + pos, (i // k).to(tl.int64), mask=imask)
        tl.store(inv_ptr + i, pos, mask=imask)
    else:
        eb = (pid - chunks) * EB + tl.arange(0, EB)
        count = tl.zeros((EB,), tl.int32)
        for c in range(chunks):
            jj = c * CH + tl.arange(0, CH)
            ej = tl.load(experts_ptr + jj, mask=jj < N, other=-1).to(tl.int32)
            ej = tl.where(ej < 0, 2147483647, ej)
            count += tl.sum((ej[None, :] <= eb[:, None]).to(tl.int32), axis=1)
        tl.store(offs_ptr + eb, count, mask=eb < n)


def expert_order(experts: torch.Tensor, n: int):
    """Picks [T, k] of n expert slots (-1: computed elsewhere) -> (order [T*k] int64: the flat pick at each sorted
    position, expert-major and stable; rows [T*k] int64: its token; inv [T*k] int32: each pick's sorted position;
    offs [n] int32: the cumulative pick counts the grouped GEMMs take)."""
    T, k = experts.shape
    N = T * k
    if N > SORT_MAX_PICKS:
        order, offs = sort_by_expert(experts, n)
        inv = torch.empty(N, dtype=torch.int32, device=experts.device)
        inv.scatter_(0, order, torch.arange(N, dtype=torch.int32, device=experts.device))
        return order, order // k, inv, offs
    dev = experts.device
    order = torch.empty(N, dtype=torch.long, device=dev)
    rows = torch.empty(N, dtype=torch.long, device=dev)
    inv = torch.empty(N, dtype=torch.int32, device=dev)
    offs = torch.empty(n, dtype=torch.int32, device=dev)
    chunks = triton.cdiv(N, SORT_CHUNK)
    _expert_order_kernel[(chunks + triton.cdiv(n, SORT_EXPERTS),)](
        experts.contiguous(), order, rows, inv, offs, N, chunks, n, k, CH=SORT_CHUNK, EB=SORT_EXPERTS)
    return order, rows, inv, offs


@triton.jit
def _silu(x, LIBDEVICE: tl.constexpr):
    """x / (1 + exp(-x)), as torch's silu computes it (CUDA's expf, an IEEE division)."""
    if LIBDEVICE:
        e = libdevice.exp(-x)
    else:
        e = tl.exp(-x)
    return tl.div_rn(x, 1.0 + e)


@triton.jit
def _moe_act_kernel(gu_ptr, stride_gu, w_ptr, order_ptr, h_ptr, I, limit, CLAMP: tl.constexpr,
                    WEIGHTED: tl.constexpr, ROUNDED: tl.constexpr, LIBDEVICE: tl.constexpr, BLOCK: tl.constexpr):
    """Program (sorted row r, column block): h = silu(min(gate, limit)) * clamp(up, -limit, limit) from the row's
    [gate | up]; ROUNDED: each op rounded to h's dtype (a torch SwiGLU in that dtype), else float32 times the row's
    routing weight w[order[r]] (WEIGHTED) and rounded once."""
    r = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = i < I
    DT = h_ptr.dtype.element_ty
    gate = tl.load(gu_ptr + r * stride_gu + i, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gu_ptr + r * stride_gu + I + i, mask=mask, other=0.0).to(tl.float32)
    if CLAMP:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
    if ROUNDED:
        h = round_to(round_to(_silu(gate, LIBDEVICE), DT) * up, DT)
    else:
        h = _silu(gate, LIBDEVICE) * up
        if WEIGHTED:
            h = h * tl.load(w_ptr + tl.load(order_ptr + r)).to(tl.float32)
        h = round_to(h, DT)
    tl.store(h_ptr + r * I + i, h, mask=mask)


def moe_act(gate_up: torch.Tensor, limit: float | None, weights: torch.Tensor | None = None,
            order: torch.Tensor | None = None, rounded: bool = False) -> torch.Tensor:
    """Sorted expert rows [N, 2I] ([gate | up]) -> [N, I] in their dtype: silu(gate) * up, gate clamped above at
    `limit` and up to [-limit, limit] (None: no clamp). `rounded`: each op in the rows' dtype (V4's torch path);
    else float32, times the routing weight `weights[order[r]]` of each row when given (V4.1's), rounded once."""
    N, I = gate_up.shape[0], gate_up.shape[1] // 2
    h = torch.empty(N, I, dtype=gate_up.dtype, device=gate_up.device)
    if N:
        weighted = weights is not None
        _moe_act_kernel[(N, triton.cdiv(I, ACT_BLOCK))](
            gate_up, gate_up.stride(0), weights.contiguous() if weighted else gate_up, order if weighted else gate_up,
            h, I, 0.0 if limit is None else float(limit), CLAMP=limit is not None, WEIGHTED=weighted,
            ROUNDED=rounded, LIBDEVICE=gate_up.is_cuda, BLOCK=ACT_BLOCK)
    return h


@triton.jit(do_not_specialize=["stride_y", "stride_a"])
def _moe_combine_kernel(y_ptr, stride_y, inv_ptr, experts_ptr, w_ptr, out_ptr, add_ptr, stride_a, H, K: tl.constexpr,
                        BLOCK_H: tl.constexpr, WEIGHTED: tl.constexpr, ADD: tl.constexpr):
    """Program (token t, hidden block): out[t] = sum over t's picks j (in pick order, skipped ones left out) of
    y[inv[t, j]] (* w[t, j] when WEIGHTED), float32, rounded once to out's dtype; ADD: then + add[t] (widened to
    float32), rounded again (a torch addition in out's dtype after the sum)."""
    t = tl.program_id(0)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = h < H
    acc = tl.zeros((BLOCK_H,), tl.float32)
    for j in tl.static_range(K):
        keep = (h * 0 + tl.load(experts_ptr + t * K + j)) >= 0       # (a vector: the interpreter's masks are)
        p = tl.load(inv_ptr + t * K + j).to(tl.int64)
        yj = tl.load(y_ptr + p * stride_y + h, mask=hmask & keep, other=0.0).to(tl.float32)
        if WEIGHTED:
            yj = yj * tl.load(w_ptr + t * K + j).to(tl.float32)
        acc += yj
    out = round_to(acc, out_ptr.dtype.element_ty)
    if ADD:
        a = tl.load(add_ptr + t.to(tl.int64) * stride_a + h, mask=hmask, other=0.0).to(tl.float32)
        out = round_to(out + a, out_ptr.dtype.element_ty)
    tl.store(out_ptr + t.to(tl.int64) * H + h, out, mask=hmask)


def moe_combine(y: torch.Tensor, inv: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor | None,
                dtype: torch.dtype, add: torch.Tensor | None = None) -> torch.Tensor:
    """Expert outputs y [T*k, H] in `expert_order`'s order -> [T, H] in `dtype`: each token's sum over its picks
    (weighted by `weights` [T, k] if given; picks of expert -1 contribute nothing), float32 accumulation. `add`
    [T, H] (unit last stride; the shared expert's output): the sums in `dtype` plus it, as torch's `sums + add`
    in `dtype` (`LayerOps.moe_combine_add`: one kernel, not two)."""
    T, k = experts.shape
    H = y.shape[1]
    if add is not None and (add.shape != (T, H) or add.stride(-1) != 1):
        raise ValueError(f"moe_combine adds rows [T, H] = [{T}, {H}] with unit last stride (got {tuple(add.shape)})")
    out = torch.empty(T, H, dtype=dtype, device=y.device)
    if T:
        w = weights.contiguous() if weights is not None else y
        _moe_combine_kernel[(T, triton.cdiv(H, COMBINE_BLOCK_H))](
            y, y.stride(0), inv, experts.contiguous(), w, out, out if add is None else add,
            0 if add is None else add.stride(0), H, K=k, BLOCK_H=COMBINE_BLOCK_H, WEIGHTED=weights is not None,
            ADD=add is not None)
    return out
