"""DeepSeek-V4/V4.1 manifold-constrained hyper-connections (mHC) in two Triton kernels per sublayer.

The torch path (the models' `HyperConnection` / `Block` code, the reference and the CPU path) spends ~15 small
kernels on each sublayer's mHC: casts, the unweighted RMS norm of the flattened streams, the mixes' linear, the
Sinkhorn weights, the collapse, and the merge. Here:

- `hc_pre` = one launch of `_hc_pre_kernel`: the [T, n*H] x [n*H, (2+n)*n] product and the sum of squares, split
  over K so a decode step's handful of rows still spreads the 1.5-2 MB of `fn` over every SM; the last split of a
  token block to store its partials (an arrival count per block) then sums the splits, normalizes, takes the
  sigmoids, softmax and every Sinkhorn iteration, and collapses the streams into the sublayer input (by this pre, or
  by the lagged pre V4.1 passes in) for each of the block's tokens (`hc_head`, V4's final collapse: the same kernel);
- `hc_post` = one launch: post * sublayer output + comb^T @ streams.

Float32 math throughout, as the references (the mixes of bf16 streams on the tensor cores, every product exact:
`_mix_partial`). Two roundings are offered for the merge: V4's torch path (transformers' semantics) computes it in
the model dtype (post and comb cast to it, the two terms rounded, then their sum), V4.1's (DeepSeek's reference) in
float32 with one rounding at the end; `rounded=True` reproduces the first exactly. Sums run in the references'
orders where they have one (the merge's streams in stream order); elsewhere results agree within float32 rounding
(the mixes: no farther from float64 than twice the torch path, tests/fused_mhc_routing_cases.py). Integer arguments that change with the batch are not specialized on (one compile
per model width, whatever the batch: openinfer/engine/compile_watch.py). Tests: tests/test_fused_mhc_routing.py.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from openinfer.quantization.triton_kernels import num_sms

BLOCK_T, BLOCK_K = 32, 64          # the mixes' product: tokens x K per tile
MAX_SPLITS = 128                   # K splits of one token block (summed by `_hc_pre_kernel` in one load)
BLOCK_H = 512                      # hidden columns per program of the merge
BLOCK_HC = 2048                    # hidden columns per step of a token's collapse
# up to this many rows (a decode step of a batch of 1 or 2) hc_pre / hc_head take one launch, whose last K split
# finishes the rows one after another; past it two, the second spreading the finish over T x hidden-split programs
# (the serial finish of a 32-row block would cost more than the launch it saves: an estimate, to be measured)
ONE_LAUNCH_MAX_T = 2


@triton.jit
def round_to(x, DTYPE: tl.constexpr):
    """float32 `x` rounded to DTYPE's precision, kept float32: what a torch op in DTYPE leaves. bfloat16 by rounding
    the bits to nearest even (a CUDA cast does the same; Triton's CPU interpreter would truncate); a store to a DTYPE
    pointer of the result is then exact everywhere."""
    if DTYPE == tl.float32:
        return x
    elif DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    else:
        return x.to(DTYPE).to(tl.float32)


@triton.jit
def sinkhorn(w, iters, eps, ROW: tl.constexpr, COL: tl.constexpr):
    """The mHC comb from its logits `w` (rows along axis ROW, columns along COL): a row softmax, + eps, then
    column / row normalizations, `iters` column normalizations in all (`torch_hc_weights`'s order)."""
    w = tl.exp(w - tl.expand_dims(tl.max(w, axis=ROW), ROW))
    comb = w / tl.expand_dims(tl.sum(w, axis=ROW), ROW) + eps
    comb = comb / (tl.expand_dims(tl.sum(comb, axis=COL), COL) + eps)
    for _ in range(iters - 1):
        comb = comb / (tl.expand_dims(tl.sum(comb, axis=ROW), ROW) + eps)
        comb = comb / (tl.expand_dims(tl.sum(comb, axis=COL), COL) + eps)
    return comb


@triton.jit
def _split3(w):
    """float32 w -> bf16 (hi, mid, lo) with hi + mid + lo == w exactly: each part takes the next 8 of the 24
    significant bits (each remainder is exact in float32, the last fits bf16), by rounding or by truncation alike."""
    hi = w.to(tl.bfloat16)
    r = w - hi.to(tl.float32)
    mid = r.to(tl.bfloat16)
    return hi, mid, (r - mid.to(tl.float32)).to(tl.bfloat16)


@triton.jit
def _dot3(x, hi, mid, lo, UPCAST: tl.constexpr):
    """x @ (hi + mid + lo) for one K tile, bf16 operands: the parts chained through the tensor cores' accumulator
    (low first) from zero. The caller adds the tile to its float32 sum with an ordinary add: Triton folds `acc +
    dot(a, b)` into the MMA's accumulator only for a dot started from zero, and a K loop summed inside the tensor cores
    came out ~10x farther from the float64 oracle than the torch path at prefill sizes (post 1.8e-5 vs 1.5e-6, H200,
    2026-12-03). UPCAST (Triton's CPU interpreter): float32 dots, where the products are exact as on the tensor cores."""
    if UPCAST:
        xf = x.to(tl.float32)
        t = tl.dot(xf, lo.to(tl.float32), input_precision="ieee")
        t = tl.dot(xf, mid.to(tl.float32), t, input_precision="ieee")
        return tl.dot(xf, hi.to(tl.float32), t, input_precision="ieee")
    t = tl.dot(x, lo)
    t = tl.dot(x, mid, t)
    return tl.dot(x, hi, t)


@triton.jit
def _mix_partial(x_ptr, fn_ptr, part_ptr, blk, split, T, K, k_per_split, stride_x, stride_ps, MIX: tl.constexpr,
                 MIXP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, UPCAST: tl.constexpr):
    """Token block `blk`, K split `split`: x [T, K] (the flattened streams) times fn [MIX, K]^T over the split's K
    range, and the split's sum of squares in column MIX: part[split, t, :MIX + 1]. Every product is exact, as in the
    float32 torch path (bf16 x times float32 fn fits float32), the sums are float32 in another order:
    - bf16 streams: on the tensor cores. fn's tile splits exactly into three bf16 parts (`_split3`), each product
      of a part with x is exact, and each K tile's three dots sum in the tensor cores from zero before an ordinary
      float32 add into the running sum (`_dot3`);
    - float32 streams: IEEE float32 dots (not TF32)."""
    rows = blk * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, MIXP)
    rmask = rows < T
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_x
    SPLIT: tl.constexpr = x_ptr.dtype.element_ty == tl.bfloat16
    acc = tl.zeros((BLOCK_T, MIXP), tl.float32)
    squares = tl.zeros((BLOCK_T,), tl.float32)
    k_lo = split * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        kmask = ks < k_hi
        x = tl.load(x_rows + ks[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
        w = tl.load(fn_ptr + cols[None, :] * K + ks[:, None], mask=(cols[None, :] < MIX) & kmask[:, None],
                    other=0.0).to(tl.float32)
        if SPLIT:
            hi, mid, lo = _split3(w)
            acc += _dot3(x, hi, mid, lo, UPCAST)
        else:
            acc += tl.dot(x.to(tl.float32), w, input_precision="ieee")
        xf = x.to(tl.float32)
        squares += tl.sum(xf * xf, axis=1)
    acc = tl.where(cols[None, :] == MIX, squares[:, None], acc)
    tl.store(part_ptr + split * stride_ps + rows[:, None] * MIXP + cols[None, :], acc, mask=rmask[:, None])


@triton.jit
def _hc_token(part_ptr, S, stride_ps, t, h_lo, h_hi, store, x_ptr, stride_xt, H, lag_ptr, base_ptr, scale_ptr, pre_ptr,
              post_ptr, comb_ptr, y_ptr, stride_y, inv_k, iters, eps, norm_eps, N: tl.constexpr, MIX: tl.constexpr,
              MIXP: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_H: tl.constexpr, HEAD: tl.constexpr,
              LAGGED: tl.constexpr):
    """Token t once its S K-splits' partials are stored (read past L1: other programs may have written them): its
    mixes, normalized by the RMS of the flattened streams; pre (+ post and the Sinkhorn comb unless HEAD, stored
    where `store`); then the hidden columns [h_lo, h_hi) of sum_i w_i * streams[t, i] with w = pre, or the lagged
    pre given (LAGGED)."""
    s = tl.arange(0, BLOCK_S)[:, None]
    part = part_ptr + s * stride_ps + t * MIXP
    smask = s < S
    c = tl.arange(0, N)
    squares = tl.sum(tl.load(part + MIX, mask=smask, other=0.0, cache_modifier=".cg"), axis=0)          # [1]
    rs = 1.0 / tl.sqrt(squares * inv_k + norm_eps)
    pre_w = tl.sum(tl.load(part + c[None, :], mask=smask, other=0.0, cache_modifier=".cg"), axis=0) * rs
    pre = tl.sigmoid(pre_w * tl.load(scale_ptr) + tl.load(base_ptr + c)) + eps
    if not HEAD:
        post_w = tl.sum(tl.load(part + N + c[None, :], mask=smask, other=0.0, cache_modifier=".cg"), axis=0) * rs
        post = 2 * tl.sigmoid(post_w * tl.load(scale_ptr + 1) + tl.load(base_ptr + N + c))
        cc = tl.arange(0, N * N)
        comb_w = tl.sum(tl.load(part + 2 * N + cc[None, :], mask=smask, other=0.0, cache_modifier=".cg"),
                        axis=0) * rs
        comb_w = comb_w * tl.load(scale_ptr + 2) + tl.load(base_ptr + 2 * N + cc)
        comb = tl.reshape(sinkhorn(tl.reshape(comb_w, (N, N)), iters, eps, 1, 0), (N * N,))
        tl.store(pre_ptr + t * N + c, pre, mask=(c * 0 + store) != 0)
        tl.store(post_ptr + t * N + c, post, mask=(c * 0 + store) != 0)
        tl.store(comb_ptr + t * (N * N) + cc, comb, mask=(cc * 0 + store) != 0)
    if LAGGED:
        pre = tl.load(lag_ptr + t * N + c).to(tl.float32)
    t64 = tl.cast(t, tl.int64)
    x_row = x_ptr + t64 * stride_xt
    y_row = y_ptr + t64 * stride_y
    for h0 in range(h_lo, h_hi, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        hmask = h < h_hi
        x = tl.load(x_row + c[:, None] * H + h[None, :], mask=hmask[None, :], other=0.0)
        y = tl.sum(pre[:, None] * x.to(tl.float32), axis=0)
        tl.store(y_row + h, round_to(y, y_ptr.dtype.element_ty), mask=hmask)


@triton.jit(do_not_specialize=["T", "k_per_split", "stride_ps", "S"])
def _hc_pre_kernel(x_ptr, fn_ptr, part_ptr, arrivals_ptr, T, K, k_per_split, stride_x, stride_ps, S, lag_ptr,
                   base_ptr, scale_ptr, pre_ptr, post_ptr, comb_ptr, y_ptr, stride_y, H, inv_k, iters, eps, norm_eps,
                   N: tl.constexpr, MIX: tl.constexpr, MIXP: tl.constexpr, BLOCK_T: tl.constexpr,
                   BLOCK_K: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_H: tl.constexpr, HEAD: tl.constexpr,
                   LAGGED: tl.constexpr, UPCAST: tl.constexpr):
    """mHC pre in one launch. Program (token block, K split) of S splits: the split's partials (`_mix_partial`);
    the block's last program to store them (the S-th arrival counted in arrivals[token block], which it sets back
    to 0 for the next launch) then finishes each of the block's tokens over every hidden column (`_hc_token`)."""
    blk = tl.program_id(0)
    _mix_partial(x_ptr, fn_ptr, part_ptr, blk, tl.program_id(1), T, K, k_per_split, stride_x, stride_ps, MIX, MIXP,
                 BLOCK_T, BLOCK_K, UPCAST)
    arrived = S
    if S > 1:           # this program's partials all stored (bar.sync) before its arrival is released
        tl.debug_barrier()
        arrived = tl.atomic_add(arrivals_ptr + blk, 1, sem="acq_rel", scope="gpu") + 1
    if arrived == S:
        if S > 1:
            tl.atomic_xchg(arrivals_ptr + blk, 0, sem="relaxed", scope="gpu")
        for t in range(blk * BLOCK_T, tl.minimum(blk * BLOCK_T + BLOCK_T, T)):
            _hc_token(part_ptr, S, stride_ps, t, 0, H, 1, x_ptr, stride_x, H, lag_ptr, base_ptr, scale_ptr, pre_ptr,
                      post_ptr, comb_ptr, y_ptr, stride_y, inv_k, iters, eps, norm_eps, N, MIX, MIXP, BLOCK_S,
                      BLOCK_H, HEAD, LAGGED)


@triton.jit(do_not_specialize=["T", "k_per_split", "stride_ps"])
def _hc_mix_partials_kernel(x_ptr, fn_ptr, part_ptr, T, K, k_per_split, stride_x, stride_ps,
                            MIX: tl.constexpr, MIXP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr,
                            UPCAST: tl.constexpr):
    """The two-launch pre's first: program (token block, K split) -> the split's partials (`_mix_partial`)."""
    _mix_partial(x_ptr, fn_ptr, part_ptr, tl.program_id(0), tl.program_id(1), T, K, k_per_split, stride_x, stride_ps,
                 MIX, MIXP, BLOCK_T, BLOCK_K, UPCAST)


@triton.jit(do_not_specialize=["S", "stride_ps", "h_per_split"])
def _hc_finish_kernel(part_ptr, S, stride_ps, x_ptr, stride_xt, lag_ptr, base_ptr, scale_ptr, pre_ptr, post_ptr,
                      comb_ptr, y_ptr, stride_y, H, h_per_split, inv_k, iters, eps, norm_eps,
                      N: tl.constexpr, MIX: tl.constexpr, MIXP: tl.constexpr, BLOCK_S: tl.constexpr,
                      BLOCK_H: tl.constexpr, HEAD: tl.constexpr, LAGGED: tl.constexpr):
    """The two-launch pre's second: program (token t, hidden split) -> `_hc_token` over the split's columns (the
    weights recomputed by each split, stored by split 0)."""
    hsplit = tl.program_id(1)
    h_lo = hsplit * h_per_split
    _hc_token(part_ptr, S, stride_ps, tl.program_id(0), h_lo, tl.minimum(h_lo + h_per_split, H),
              (hsplit == 0).to(tl.int32), x_ptr, stride_xt, H, lag_ptr, base_ptr, scale_ptr, pre_ptr, post_ptr, comb_ptr,
              y_ptr, stride_y, inv_k, iters, eps, norm_eps, N, MIX, MIXP, BLOCK_S, BLOCK_H, HEAD, LAGGED)


@triton.jit
def _hc_post_kernel(out_ptr, stride_o, x_ptr, stride_xt, post_ptr, comb_ptr, y_ptr, H,
                    N: tl.constexpr, BLOCK_H: tl.constexpr, ROUNDED: tl.constexpr):
    """Program (token t, hidden block): new streams[t, k] = post[k] * out[t] + sum_j comb[j, k] * streams[t, j]
    (j in stream order). ROUNDED: post and comb in the streams' dtype and each term rounded to it, as a torch
    merge in that dtype computes; else float32 with one rounding."""
    t = tl.program_id(0)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = h < H
    k = tl.arange(0, N)
    t64 = t.to(tl.int64)
    o = tl.load(out_ptr + t64 * stride_o + h, mask=hmask, other=0.0).to(tl.float32)
    post = tl.load(post_ptr + t * N + k).to(tl.float32)
    if ROUNDED:
        post = round_to(post, y_ptr.dtype.element_ty)
    first = post[:, None] * o[None, :]
    if ROUNDED:
        first = round_to(first, y_ptr.dtype.element_ty)
    mixed = tl.zeros((N, BLOCK_H), tl.float32)
    for j in tl.static_range(N):
        cj = tl.load(comb_ptr + t * (N * N) + j * N + k).to(tl.float32)
        if ROUNDED:
            cj = round_to(cj, y_ptr.dtype.element_ty)
        sj = tl.load(x_ptr + t64 * stride_xt + j * H + h, mask=hmask, other=0.0).to(tl.float32)
        mixed += cj[:, None] * sj[None, :]
    if ROUNDED:
        mixed = round_to(mixed, y_ptr.dtype.element_ty)
    y = round_to(first + mixed, y_ptr.dtype.element_ty)
    tl.store(y_ptr + t64 * (N * H) + k[:, None] * H + h[None, :], y, mask=hmask[None, :])


def _check_streams(n: int) -> None:
    if n & (n - 1):
        raise ValueError(f"the fused mHC kernels need hc_mult a power of two (got {n}); run this model with "
                         f"attention_backend='torch'")


@functools.lru_cache(maxsize=None)
def _arrivals(device: torch.device) -> torch.Tensor:
    """`_hc_pre_kernel`'s arrival counts, one per token block of a launch that splits K (at most one per SM: the
    split rule), zero between launches (each block's last arrival sets its count back). The kernel's own workspace,
    made once per device at the first (eager) call, as `num_sms` is looked up once; launches on a device run in
    stream order, so every layer's calls share it as they share the SMs."""
    return torch.zeros(num_sms(device), dtype=torch.int32, device=device)


def _hc_launch(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int,
               eps: float, norm_eps: float, lagged: torch.Tensor | None, pre, post, comb, y, head: bool,
               one_launch: bool, tiles: tuple[int, int, int] | None = None) -> None:
    """mHC pre (or `head`) over streams [T, n, H] (T > 0) and fn [mix, n*H]: K split until the token blocks and their
    splits fill the GPU twice over (a decode step's handful of rows still spreads the 1.5-2 MB of fn over every SM).
    `one_launch`: `_hc_pre_kernel`, whose last split of a block finishes the block's tokens one after another (over
    the whole width, a few BLOCK_H steps); else the partials' launch and a second launch of T x hidden-split programs
    (`_hc_finish_kernel`), which spreads the finish over the GPU. `tiles`: (tokens, K, warps) of the two-launch
    path's partials (the benchmark's sweep; default (BLOCK_T, BLOCK_K, 4))."""
    T, n, H = streams.shape
    _check_streams(n)
    K, mix = n * H, fn.shape[0]
    mixp = max(16, triton.next_power_of_2(mix + 1))
    if tiles is not None and one_launch:
        raise ValueError("the one-launch mHC pre takes the default tiles")
    block_t, block_k, warps = tiles or (BLOCK_T, BLOCK_K, 4)
    token_blocks = triton.cdiv(T, block_t)
    k_blocks = triton.cdiv(K, block_k)
    sms = num_sms(streams.device)
    splits = max(1, min(MAX_SPLITS, k_blocks, 2 * sms // token_blocks))
    k_per_split = triton.cdiv(k_blocks, splits) * block_k
    splits = triton.cdiv(K, k_per_split)
    part = torch.empty(splits, T, mixp, dtype=torch.float32, device=streams.device)
    lag = lagged if lagged is not None else y
    if one_launch:
        arrivals = _arrivals(streams.device)
        assert splits == 1 or token_blocks <= arrivals.numel()      # (splits > 1 only where token_blocks <= sms)
        _hc_pre_kernel[(token_blocks, splits)](
            streams, fn, part, arrivals, T, K, k_per_split, streams.stride(0), part.stride(0), splits, lag, base,
            scale, pre, post, comb, y, y.stride(0), H, 1.0 / K, iters, eps, norm_eps, N=n, MIX=mix, MIXP=mixp,
            BLOCK_T=BLOCK_T, BLOCK_K=BLOCK_K, BLOCK_S=MAX_SPLITS, BLOCK_H=BLOCK_HC, HEAD=head, LAGGED=lagged is not None,
            UPCAST=streams.device.type != "cuda")
        return
    _hc_mix_partials_kernel[(token_blocks, splits)](streams, fn, part, T, K, k_per_split, streams.stride(0),
                                                   part.stride(0), MIX=mix, MIXP=mixp, BLOCK_T=block_t,
                                                   BLOCK_K=block_k, UPCAST=streams.device.type != "cuda",
                                                   num_warps=warps)
    h_splits = max(1, min(triton.cdiv(H, BLOCK_HC), triton.cdiv(2 * sms, T)))   # one per token at large T
    h_per_split = triton.cdiv(triton.cdiv(H, h_splits), BLOCK_HC) * BLOCK_HC
    _hc_finish_kernel[(T, triton.cdiv(H, h_per_split))](
        part, splits, part.stride(0), streams, streams.stride(0), lag, base, scale, pre, post, comb, y, y.stride(0),
        H, h_per_split, 1.0 / K, iters, eps, norm_eps, N=n, MIX=mix, MIXP=mixp, BLOCK_S=MAX_SPLITS, BLOCK_H=BLOCK_HC,
        HEAD=head, LAGGED=lagged is not None)


def hc_pre(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int, eps: float,
           norm_eps: float, lagged: torch.Tensor | None = None, tiles: tuple[int, int, int] | None = None):
    """mHC before a sublayer, in one launch: streams [T, n, H] -> (pre [T, n], post [T, n], comb [T, n, n] float32,
    the sublayer input [T, H] in the streams' dtype) = the streams collapsed by `pre`, or by `lagged` [T, n] when
    given (V4.1 collapses a sublayer's streams by the previous sublayer's pre). fn [(2+n)*n, n*H], base [(2+n)*n],
    scale [3]. `tiles`: `_hc_launch`'s, past ONE_LAUNCH_MAX_T rows."""
    streams = streams.contiguous()
    T, n, H = streams.shape
    dev = streams.device
    pre = torch.empty(T, n, dtype=torch.float32, device=dev)
    post = torch.empty_like(pre)
    comb = torch.empty(T, n, n, dtype=torch.float32, device=dev)
    y = torch.empty(T, H, dtype=streams.dtype, device=dev)
    if T:
        _hc_launch(streams, fn, base, scale, iters, eps, norm_eps, None if lagged is None else lagged.contiguous(),
                   pre, post, comb, y, head=False, one_launch=T <= ONE_LAUNCH_MAX_T, tiles=tiles)
    return pre, post, comb, y


def hc_head(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, eps: float,
            norm_eps: float) -> torch.Tensor:
    """V4's final collapse (`HyperHead`), in one launch: streams [T, n, H] -> [T, H], by pre = sigmoid(mixes * scale
    + base) + eps with fn [n, n*H], base [n], scale [1]."""
    streams = streams.contiguous()
    T, n, H = streams.shape
    y = torch.empty(T, H, dtype=streams.dtype, device=streams.device)
    if T:
        _hc_launch(streams, fn, base, scale, 0, eps, norm_eps, None, y, y, y, y, head=True,
                   one_launch=T <= ONE_LAUNCH_MAX_T)
    return y


def hc_post(out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor,
            rounded: bool) -> torch.Tensor:
    """mHC after a sublayer: out [T, H], streams [T, n, H], post [T, n], comb [T, n, n] -> new streams [T, n, H] =
    post * out + comb^T @ streams. `rounded`: in the streams' dtype term by term (V4's torch path), else float32
    with one rounding (V4.1's)."""
    streams, out = streams.contiguous(), out.contiguous()
    T, n, H = streams.shape
    _check_streams(n)
    y = torch.empty_like(streams)
    if T:
        _hc_post_kernel[(T, triton.cdiv(H, BLOCK_H))](out, out.stride(0), streams, streams.stride(0),
                                                     post.contiguous(), comb.contiguous(), y, H, N=n,
                                                     BLOCK_H=BLOCK_H, ROUNDED=rounded)
    return y
