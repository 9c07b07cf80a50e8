"""The fused DeepSeek mHC and MoE-routing kernels (layers/triton_mhc.py, layers/triton_moe_routing.py) checked against
the models' torch code they replace, on the same modules and inputs: `module.ops` switched between TORCH_OPS and the
fused ops.

Used by tests/test_fused_mhc_routing.py: in Triton's interpreter on the CPU (a subprocess with TRITON_INTERPRET=1,
tiny widths; `python tests/fused_mhc_routing_cases.py [kernels|models]` runs them and prints "all cases pass") and
on CUDA at the published widths (the `-m gpu` tests call the same functions). Each check raises AssertionError naming what differs
and returns the largest errors it measured.

What "equal" means here: float32 results within float32 rounding (the kernels sum in other orders); results in the
model dtype are the float32 value rounded once (checked against the torch path's unrounded float32 value), and equal
to the torch path's own rounding but where that float32 value sits on a rounding boundary; expert picks, orders and
offsets identical. Ties between experts go to the lowest expert id (what torch.topk does on CUDA: its radix select
keeps the first-seen equal values; on the CPU torch.topk breaks ties otherwise, so the reference picks here are a
stable sort).
"""

from __future__ import annotations

import dataclasses
import sys

import torch
import torch.nn.functional as F

from openinfer.layers.basic import TORCH_OPS, sort_by_expert
from openinfer.models.deepseek_v4.config import DeepseekV4Config
from openinfer.models.deepseek_v4.family import DEEPSEEK_V4_TINY_CONFIG
from openinfer.models.deepseek_v4.model import Experts, HyperConnection, HyperHead, Router, SharedExpert
from openinfer.models.deepseek_v41.config import DeepseekV41Config
from openinfer.models.deepseek_v41.family import DEEPSEEK_V41_TINY_CONFIG
from openinfer.models.deepseek_v41.model import Block, Gate
from openinfer.models.deepseek_v41.model import hc_weights as v41_hc_weights
from openinfer.models.deepseek_v41.model import Expert as SharedExpert41
from openinfer.models.deepseek_v41.model import MoE as MoE41

# V4-Flash and V4.1-Flash (the released config.json) at the widths the kernels see
V4_FLASH = dict(hidden_size=4096, hc_mult=4, n_routed_experts=256, num_experts_per_tok=6, routed_scaling_factor=1.5)
V41_FLASH = dict(dim=5120, hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, norm_eps=1e-20, n_routed_experts=384,
                 n_activated_experts=6, route_scale=1.5)


def next_ops():
    from openinfer.layers.triton_ops import TRITON_OPS_NEXT
    return TRITON_OPS_NEXT


def fused_ops():
    from openinfer.layers.triton_ops import TRITON_OPS
    return TRITON_OPS


def v4_config(**widths) -> DeepseekV4Config:
    return DeepseekV4Config.from_hf({**DEEPSEEK_V4_TINY_CONFIG, **widths})


def v41_config(**widths) -> DeepseekV41Config:
    return DeepseekV41Config.from_dict({**DEEPSEEK_V41_TINY_CONFIG, **widths})


def _gen(seed: int, device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(seed)


def _randn(g, *shape, device, dtype=torch.float32, scale=1.0):
    return (torch.randn(*shape, generator=g, device=device) * scale).to(dtype)


def _ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of `dtype` numbers at |x| (x float32)."""
    mant = {torch.float32: 23, torch.bfloat16: 7, torch.float16: 10}[dtype]
    return torch.ldexp(torch.ones_like(x), torch.frexp(x.abs().clamp_min(1e-30))[1] - 1 - mant)


def near_midpoint(v32: torch.Tensor, dtype: torch.dtype, slack: torch.Tensor) -> torch.Tensor:
    """Where float32 `v32` is within `slack` of a midpoint between two `dtype` numbers: there two float32 sums of the
    same terms in different orders may round to either neighbour."""
    ulp = _ulp(v32, dtype)
    return ((v32 / ulp).frac().abs() - 0.5).abs() * ulp <= slack


def check_rounded(got: torch.Tensor, ref32: torch.Tensor, ref: torch.Tensor, name: str, scale: torch.Tensor,
                  rel: float = 1e-5) -> float:
    """`got` (model dtype) is float32 `ref32` rounded once: within half a `got.dtype` ulp of it, up to the float32
    error of sums in another order (`rel` times `scale`, the sum of the terms' magnitudes); and equal to the torch
    path's `ref` but where ref32 is that close to a rounding midpoint. Returns the largest difference as a fraction
    of that bound (<= 1)."""
    ulp = _ulp(ref32, got.dtype)
    err = (got.float() - ref32).abs()
    slack = rel * scale + 1e-30
    bound = 0.5 * ulp + slack
    bad = err > bound
    assert not bool(bad.any()), f"{name}: {int(bad.sum())} values off by more than half an ulp " \
                                f"(worst {float((err / ulp).max()):.3f} ulp)"
    if got.dtype != torch.float32:
        differ = (got != ref) & ~near_midpoint(ref32, got.dtype, slack)
        assert not bool(differ.any()), f"{name}: {int(differ.sum())} values differ from the torch path away from a " \
                                       "rounding midpoint"
    return float((err / bound).max())


def _close(got, ref, name, atol, rtol) -> float:
    torch.testing.assert_close(got, ref, atol=atol, rtol=rtol, msg=lambda m: f"{name}: {m}")
    return float((got.float() - ref.float()).abs().max())


def _close_or_nearer(got, ref, oracle, name, atol=1e-5, rtol=1e-5, margin=2.0) -> float:
    """mHC weights whose mixes the kernel sums in another order than the torch path (K = 16,384 float32 terms,
    products exact in both): within atol/rtol of the torch path, or else no farther from the float64 oracle (the same
    math on exact mixes) than `margin` x the torch path is — its own float32 summation error, which Sinkhorn
    carries into comb for both alike. Returns max |got - ref|."""
    err = float((got.float() - ref.float()).abs().max())
    if torch.allclose(got.float(), ref.float(), atol=atol, rtol=rtol):
        return err
    err_k = float((got.double() - oracle).abs().max())
    err_r = float((ref.double() - oracle).abs().max())
    assert err_k <= margin * err_r, (f"{name}: max |fused - torch| {err:.3g} past atol/rtol {atol}, and the fused "
                                     f"error vs float64 {err_k:.3g} > {margin} x the torch path's {err_r:.3g}")
    return err


def _random_hc(module_params: list[torch.nn.Parameter], g, device, fan_in: int):
    fn, base, scale = module_params
    fn.data = _randn(g, *fn.shape, device=device, scale=fan_in ** -0.5)
    base.data = _randn(g, *base.shape, device=device, scale=0.5)
    scale.data = torch.rand(*scale.shape, generator=g, device=device) + 0.5


# ---- mHC ----------------------------------------------------------------------------------------------
def check_v4_mhc(ops, device, dtype, T: int, hidden: int, seed: int = 0) -> dict:
    """V4's HyperConnection (pre: post, comb, the collapsed block input; merge) and HyperHead, fused vs torch."""
    cfg = v4_config(hidden_size=hidden, hc_mult=4)
    n = cfg.hc_mult
    g = _gen(seed, device)
    hc, head = HyperConnection(cfg).to(device), HyperHead(cfg).to(device)
    _random_hc([hc.fn, hc.base, hc.scale], g, device, n * hidden)
    _random_hc([head.hc_fn, head.hc_base, head.hc_scale], g, device, n * hidden)
    streams = _randn(g, T, n, hidden, device=device, dtype=dtype)
    out = _randn(g, T, hidden, device=device, dtype=dtype)
    errs = {}
    with torch.no_grad():
        post_r, comb_r, x_r = hc(streams)
        merged_r = hc.merge(streams, out, post_r, comb_r)
        head_r = head(streams)
        hc.ops = head.ops = ops
        post, comb, x = hc(streams)
        merged = hc.merge(streams, out, post_r, comb_r)          # the same weights: the merge alone
        head_y = head(streams)
        # the torch path's float32 values before their final rounding
        xf = streams.float()
        from openinfer.models.deepseek_v4.model import unweighted_rms_norm
        mixes = F.linear(unweighted_rms_norm(xf.flatten(1), hc.norm_eps), hc.fn.float())
        pre_r = TORCH_OPS.hc_weights(mixes, hc.base, hc.scale, n, hc.iters, hc.eps)[0]
        mixes_h = F.linear(unweighted_rms_norm(xf.flatten(1), head.norm_eps), head.hc_fn.float())
        pre_h = torch.sigmoid(mixes_h * head.hc_scale.float() + head.hc_base.float()) + head.eps
        x64 = xf.double().flatten(1)
        mixes64 = F.linear(x64 * torch.rsqrt(x64.square().mean(-1, keepdim=True) + hc.norm_eps), hc.fn.double())
        _, post_o, comb_o = TORCH_OPS.hc_weights(mixes64, hc.base.double(), hc.scale.double(), n, hc.iters, hc.eps)
    errs["post"] = _close_or_nearer(post, post_r, post_o, "V4 mHC post")
    errs["comb"] = _close_or_nearer(comb, comb_r, comb_o, "V4 mHC comb")
    errs["collapsed_of_bound"] = check_rounded(x, (pre_r.unsqueeze(-1) * xf).sum(1), x_r, "V4 mHC collapse",
                                          (pre_r.unsqueeze(-1) * xf).abs().sum(1))
    errs["head_of_bound"] = check_rounded(head_y, (pre_h.unsqueeze(-1) * xf).sum(1), head_r, "V4 hc_head",
                                     (pre_h.unsqueeze(-1) * xf).abs().sum(1))
    errs["merge_ulps"] = check_rounded_merge(merged, merged_r, out, streams, post_r, comb_r)
    return errs


def check_rounded_merge(got, ref, out, streams, post, comb) -> float:
    """The merge in the model dtype term by term (transformers' V4): bf16(bf16(post) * out) and
    bf16(bf16(comb)^T @ streams) (a float32 sum), then their sum rounded. Equal to that, and to the torch path, but
    where the float32 matmul sum sits on a rounding midpoint (two orders may round it either way)."""
    dtype = streams.dtype
    first = post.to(dtype).unsqueeze(-1) * out.unsqueeze(1)                         # exact product, one rounding
    terms = comb.to(dtype).float().unsqueeze(-1) * streams.float().unsqueeze(2)      # [T, j, k, H], exact
    mixed32 = terms.double().sum(1).float()
    expected = (first.float() + mixed32.to(dtype).float()).to(dtype)
    if dtype == torch.float32:
        return _close(got, expected, "V4 mHC merge", 1e-6, 1e-5)
    ambiguous = near_midpoint(mixed32, dtype, 1e-5 * terms.abs().sum(1))
    for name, want in (("the term-by-term rounding", expected), ("the torch path", ref)):
        differ = (got != want) & ~ambiguous
        assert not bool(differ.any()), f"V4 mHC merge: {int(differ.sum())} values differ from {name}"
    one_ulp = (got.float() - expected.float()).abs() <= _ulp(expected.float(), dtype)
    assert bool(one_ulp.all()), "V4 mHC merge: values more than an ulp from the term-by-term rounding"
    return float(((got.float() - expected.float()).abs() / _ulp(expected.float(), dtype)).max())


def check_v41_mhc(ops, device, dtype, T: int, dim: int, seed: int = 0) -> dict:
    """V4.1's Block: a sublayer's mixes (pre, post, comb) with the streams collapsed by the previous pre, and the
    float32 expand; fused vs torch."""
    cfg = v41_config(dim=dim, n_routed_experts=8, n_activated_experts=2)
    n = cfg.hc_mult
    g = _gen(seed, device)
    block = Block(cfg, 0).to(device)
    _random_hc([block.hc_attn_fn, block.hc_attn_base, block.hc_attn_scale], g, device, n * dim)
    streams = _randn(g, T, n, dim, device=device, dtype=dtype)
    lagged = torch.rand(T, n, generator=g, device=device) + 0.5
    out = _randn(g, T, dim, device=device, dtype=dtype)
    errs = {}
    with torch.no_grad():
        pre_r, post_r, comb_r, x_r = block.hc_pre(streams, "attn", lagged)
        y_r = block.hc_post(out, streams, post_r, comb_r)
        block.ops = ops
        pre, post, comb, x = block.hc_pre(streams, "attn", lagged)
        y = block.hc_post(out, streams, post_r, comb_r)
        x64 = streams.double().flatten(1)
        mixes64 = F.linear(x64, block.hc_attn_fn.double()) * torch.rsqrt(x64.square().mean(-1, keepdim=True) + block.eps)
        oracle = v41_hc_weights(mixes64, block.hc_attn_base.double(), block.hc_attn_scale.double(), n, block.iters,
                                block.hc_eps)
    errs["pre"] = _close_or_nearer(pre, pre_r, oracle[0], "V4.1 mHC pre")
    errs["post"] = _close_or_nearer(post, post_r, oracle[1], "V4.1 mHC post")
    errs["comb"] = _close_or_nearer(comb, comb_r, oracle[2], "V4.1 mHC comb")
    sf = streams.float()
    terms = lagged.unsqueeze(-1) * sf
    errs["collapsed_of_bound"] = check_rounded(x, terms.sum(1), x_r, "V4.1 mHC collapse", terms.abs().sum(1))
    first = post_r.unsqueeze(-1) * out.float().unsqueeze(1)
    terms = comb_r.unsqueeze(-1) * sf.unsqueeze(2)                                    # [T, j, k, H]
    errs["expand_of_bound"] = check_rounded(y, (first.double() + terms.double().sum(1)).float(), y_r, "V4.1 mHC expand",
                                       first.abs() + terms.abs().sum(1))
    return errs


def check_hc_pre_launches(device, dtype, T: int, hidden: int, repeats: int = 3, seed: int = 0) -> dict:
    """mHC pre (with and without a lagged pre) and V4's head in one launch, whose K splits are counted in as they
    arrive, equal the two-launch path: pre, post and comb bit for bit, the bf16 collapse within its bound on the GPU
    (bit for bit on the CPU); launched `repeats` times they give the same bits each time (a split read before it
    was stored would not), and leave the kernel's arrival counts zero for the next launch."""
    from openinfer.layers import triton_mhc
    n = 4
    g = _gen(seed, device)
    streams = _randn(g, T, n, hidden, device=device, dtype=dtype)
    fn = _randn(g, (2 + n) * n, n * hidden, device=device, scale=(n * hidden) ** -0.5)
    base, scale = _randn(g, (2 + n) * n, device=device, scale=0.5), torch.rand(3, generator=g, device=device) + 0.5
    lagged = torch.rand(T, n, generator=g, device=device) + 0.5

    def launch(one: bool) -> list[torch.Tensor]:
        outs = []
        for lag in (None, lagged):
            pre, post = torch.empty(T, n, device=device), torch.empty(T, n, device=device)
            comb, y = torch.empty(T, n, n, device=device), torch.empty(T, hidden, device=device, dtype=dtype)
            triton_mhc._hc_launch(streams, fn, base, scale, 20, 1e-6, 1e-6, lag, pre, post, comb, y, False, one)
            outs += [pre, post, comb, y]
        head = torch.empty(T, hidden, device=device, dtype=dtype)
        triton_mhc._hc_launch(streams, fn[:n], base[:n], scale[:1], 0, 1e-6, 1e-6, None, head, head, head, head,
                              True, one)
        return outs + [head]

    names = ["pre", "post", "comb", "collapse", "lagged pre", "lagged post", "lagged comb", "lagged collapse", "head"]
    two = launch(False)
    first = launch(True)
    # pre, post and comb bit for bit (the same partials); the collapse too in the interpreter. On the GPU the one
    # program that collapses the full width may round its four-term float32 sum (mul-add or FMA, as the compiler
    # contracts it in each kernel) differently from the two-launch kernel's blocks: seen at 7-4,500 rows forced
    # (H200), and at 1 row once the mixes moved to the tensor cores (2026-12-03), pre equal bit for bit. There the
    # collapse is held to the bf16 bound, and every launch must repeat the first's bits
    exact = device == "cpu"
    for name, got, want in zip(names, first, two):
        if exact or name not in ("collapse", "lagged collapse", "head"):
            assert torch.equal(got, want), f"hc_pre in one launch ({T} rows): {name} differs from two"
        else:
            err = ((got.float() - want.float()).abs() / want.float().abs().clamp_min(1e-3)).max().item()
            assert err <= 2 * 2.0 ** -8, f"hc_pre in one launch ({T} rows): {name} {err:.2e} from two"
    for k in range(1, repeats):
        for name, got, want in zip(names, launch(True), first):
            assert torch.equal(got, want), f"hc_pre in one launch ({T} rows, repeat {k}): {name} changed bits"
    arrivals = triton_mhc._arrivals(torch.device(device))
    assert not bool(arrivals.any()), f"hc_pre left arrival counts {arrivals.nonzero().flatten().tolist()} set"
    return {"one_launch_repeats": repeats}


def check_hc_pre_tiles(device, dtype, T: int, hidden: int, tiles: list[tuple[int, int, int]], seed: int = 0) -> dict:
    """The two-launch mHC pre with other partial tiles (`hc_pre(..., tiles=)`, the benchmark's sweep) against the
    default tiles, relative to their norms: within float32 summation order (1e-5: the K tiles sum in another
    order), the collapse of bf16 streams within one bf16 ulp; the one-launch path refuses tiles."""
    from openinfer.layers import triton_mhc
    n = 4
    g = _gen(seed, device)
    streams = _randn(g, T, n, hidden, device=device, dtype=dtype)
    fn = _randn(g, (2 + n) * n, n * hidden, device=device, scale=(n * hidden) ** -0.5)
    base, scale = _randn(g, (2 + n) * n, device=device, scale=0.5), torch.rand(3, generator=g, device=device) + 0.5
    want = triton_mhc.hc_pre(streams, fn, base, scale, 20, 1e-6, 1e-6)
    errs = {}
    for t in tiles:
        got = triton_mhc.hc_pre(streams, fn, base, scale, 20, 1e-6, 1e-6, tiles=t)
        for name, a, b in zip(("pre", "post", "comb", "collapse"), got, want):
            err = ((a.float() - b.float()).norm() / b.float().norm()).item()
            bound = 2.0 ** -8 if name == "collapse" and dtype == torch.bfloat16 else 1e-5
            assert err <= bound, f"hc_pre tiles {t}: {name} {err:.2e} from the default tiles"
            errs[f"{t} {name}"] = err
    try:
        triton_mhc.hc_pre(streams[:1], fn, base, scale, 20, 1e-6, 1e-6, tiles=tiles[0])
    except ValueError:
        pass
    else:
        raise AssertionError("the one-launch hc_pre took tiles")
    return {"max_rel": max(errs.values())}


# ---- routing ------------------------------------------------------------------------------------------
def reference_route(logits, bias, k: int, scale: float, renormalize: bool, table=None, ids=None):
    """The models' routing in the logits' dtype with the CUDA tie rule (a stable sort: lowest id first)."""
    scores = F.softplus(logits).sqrt()
    if table is not None:
        experts = table[ids].long()
    else:
        experts = torch.sort(scores + bias, dim=-1, descending=True, stable=True).indices[:, :k]
    w = scores.gather(1, experts)
    if renormalize:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return experts, w * scale


def tied_logits(g, T: int, E: int, device, dtype) -> torch.Tensor:
    """Random logits where every row has groups of equal values, many straddling the top-k boundary."""
    logits = _randn(g, T, E, device=device, scale=2.0)
    groups = torch.randint(0, 4, (T, E), generator=g, device=device)
    ties = torch.rand(T, E, generator=g, device=device) < 0.5
    logits = torch.where(ties, groups.float() + 1.0, logits)
    return logits.to(dtype)


def check_route(ops, device, dtype, T: int, E: int, k: int, seed: int = 0) -> dict:
    """`ops.route` on logits with many exact ties (zero bias, as untrained or dummy weights have) and with a bias,
    learned and hashed: the picks identical to the reference (in order: best first, lowest id among equals), the
    weights those of the models' formula (exact in the model dtype; float32 within rounding)."""
    g = _gen(seed, device)
    errs = {}
    for name, logits, bias in (("ties", tied_logits(g, T, E, device, dtype), torch.zeros(E, device=device)),
                               ("biased", _randn(g, T, E, device=device, dtype=dtype, scale=2.0),
                                _randn(g, E, device=device, scale=0.1))):
        ex_r, w_r = reference_route(logits, bias, k, 1.5, True)
        if name == "ties":      # the case has what it is for: equal values across the top-k boundary
            top = torch.sort(F.softplus(logits).sqrt() + bias, dim=-1, descending=True).values
            assert bool((top[:, k - 1] == top[:, k]).any()), "route (ties): no tie at the top-k boundary"
        ex, w = ops.route(logits, bias, k, 1.5, True)
        assert torch.equal(ex, ex_r), f"route ({name}): picks differ in {int((ex != ex_r).any(1).sum())} rows"
        if device != "cpu" and dtype != torch.float32:
            assert torch.equal(w, w_r), f"route ({name}): weights differ"
        errs[f"weights_{name}"] = _close(w.float(), w_r.float(), f"route ({name}) weights", 1e-6, 2e-6 if
                                         dtype == torch.float32 else 2 ** -8)
        if device != "cpu":     # torch.topk on CUDA picks the same sets (the reference's tie rule)
            top = torch.topk(F.softplus(logits).sqrt() + bias, k, dim=-1).indices
            assert torch.equal(top.sort(1).values, ex.sort(1).values), f"route ({name}): torch.topk picks others"
    table = torch.randint(0, E, (1000, k), generator=g, device=device)
    ids = torch.randint(0, 1000, (T,), generator=g, device=device)
    logits = _randn(g, T, E, device=device, dtype=dtype, scale=2.0)
    ex_r, w_r = reference_route(logits, None, k, 2.5, True, table, ids)
    ex, w = ops.route(logits, None, k, 2.5, True, table=table, token_ids=ids)
    assert torch.equal(ex, ex_r), "hash routing: picks differ"
    errs["weights_hash"] = _close(w.float(), w_r.float(), "hash routing weights", 1e-6,
                                  2e-6 if dtype == torch.float32 else 2 ** -8)
    return errs


def check_routers(ops, device, dtype, T: int, v4_widths: dict, v41_widths: dict, seed: int = 0) -> dict:
    """The models' routers, fused vs torch, on random weights: V4's learned and hashed Router (model dtype), V4.1's
    Gate (float32 logits) with image rows routed by `bias_vl`, and top-1 (no renormalization)."""
    g = _gen(seed, device)
    errs = {}
    cfg = v4_config(**v4_widths)
    H, E = cfg.hidden_size, cfg.n_routed_experts
    x = _randn(g, T, H, device=device, dtype=dtype)
    ids = torch.randint(0, cfg.vocab_size, (T,), generator=g, device=device)
    for hashed in (False, True):
        r = Router(cfg, hashed).to(device)
        r.weight.data = _randn(g, E, H, device=device, dtype=dtype, scale=H ** -0.5)
        if hashed:
            r.tid2eid = torch.stack([torch.randperm(E, generator=g, device=device)[:cfg.num_experts_per_tok]
                                     for _ in range(64)]).repeat(cfg.vocab_size // 64 + 1, 1)[:cfg.vocab_size]
        else:
            r.e_score_correction_bias = _randn(g, E, device=device, scale=0.1)
        with torch.no_grad():
            ex_r, w_r = r(x, ids)
            r.ops = ops
            ex, w = r(x, ids)
        _same_routes(ex, w, ex_r, w_r, f"V4 router (hashed={hashed})", errs)
    cfg = v41_config(**v41_widths)
    D, E = cfg.dim, cfg.n_routed_experts
    x = _randn(g, T, D, device=device, dtype=dtype)
    image = torch.rand(T, generator=g, device=device) < 0.3
    for topk, mask in ((cfg.n_activated_experts, image), (cfg.n_activated_experts, None), (1, image)):
        gate = Gate(D, E, topk, cfg.route_scale, vision=True).to(device)
        gate.weight.data = _randn(g, E, D, device=device, dtype=dtype, scale=D ** -0.5)
        gate.bias.data = _randn(g, E, device=device, scale=0.1)
        gate.bias_vl.data = _randn(g, E, device=device, scale=0.1)
        with torch.no_grad():
            ex_r, w_r = gate(x, mask)
            gate.ops = ops
            ex, w = gate(x, mask)
        _same_routes(ex, w, ex_r, w_r, f"V4.1 gate (top-{topk}, image rows={mask is not None})", errs)
    return errs


def _same_routes(ex, w, ex_r, w_r, name, errs):
    """Picks as sets per row (torch.topk's order among equals is its own), weights matched by expert."""
    a, ia = ex.sort(1)
    b, ib = ex_r.sort(1)
    assert torch.equal(a, b), f"{name}: picks differ in {int((a != b).any(1).sum())} rows"
    wa, wb = w.gather(1, ia).float(), w_r.gather(1, ib).float()
    exact = w.dtype != torch.float32
    errs[name] = _close(wa, wb, f"{name} weights", 0.0 if exact else 1e-6, 0.0 if exact else 2e-6)


# ---- MoE glue -----------------------------------------------------------------------------------------
def check_expert_order(ops, device, T: int, k: int, n: int, seed: int = 0) -> dict:
    """`ops.expert_order` = the torch sort (stable, by expert, -1 last): order, rows, offsets identical; inv its
    inverse."""
    g = _gen(seed, device)
    experts = torch.randint(-1, n, (T, k), generator=g, device=device)
    experts[: T // 2] = torch.randint(0, min(n, 3), (T // 2, k), generator=g, device=device)   # crowded experts
    order, rows, inv, offs = ops.expert_order(experts, n)
    order_r, offs_r = sort_by_expert(experts, n)
    assert torch.equal(order, order_r), "expert order differs from the stable torch sort"
    assert torch.equal(offs, offs_r), "expert offsets differ"
    assert torch.equal(rows, order_r // k), "rows are not the picks' tokens"
    assert torch.equal(order[inv.long()], torch.arange(T * k, device=device)), "inv is not the inverse order"
    return {}


def check_moe_combine(ops, device, dtype, T: int, k: int, H: int, seed: int = 0) -> dict:
    """`ops.moe_combine` = per-token float32 sums over the picks (weighted or not, -1 picks left out), once rounded."""
    g = _gen(seed, device)
    experts = torch.randint(-1, 8, (T, k), generator=g, device=device)
    _, _, inv, _ = ops.expert_order(experts, 8)
    y = _randn(g, T * k, H, device=device, dtype=dtype)
    y[inv[(experts < 0).flatten()].long()] = float("nan")       # what skipped rows may hold: must not leak
    w = _randn(g, T, k, device=device, dtype=dtype)
    errs = {}
    for weights in (w, None):
        got = ops.moe_combine(y, inv, experts, weights, dtype)
        terms = y[inv.long()].view(T, k, H).float()
        if weights is not None:
            terms = terms * weights.float()[..., None]
        kept = torch.where((experts >= 0)[..., None], terms.double(), 0.0)
        ref32 = kept.sum(1).float()
        errs["weighted" if weights is not None else "plain"] = check_rounded(got, ref32, ref32.to(dtype),
                                                                             "moe_combine", kept.abs().sum(1).float())
    return errs


def check_moe_act(ops, device, dtype, N: int, inter: int, seed: int = 0) -> dict:
    """`ops.moe_act` = the models' SwiGLU between the grouped GEMMs: V4's `Experts._act` (clamped, in the rows'
    dtype), V4.1's `MoE._act` (float32, times the sorted rows' routing weights, once rounded; with and without the
    clamp). Equal on CUDA (CUDA's own expf, as torch's silu); float32 within rounding elsewhere."""
    g = _gen(seed, device)
    gate_up = _randn(g, N, 2 * inter, device=device, dtype=dtype, scale=6.0)     # beyond the clamp at 10 too
    weights = torch.rand(N, generator=g, device=device)
    order = torch.randperm(N, generator=g, device=device)
    cfg = v41_config(dim=32, n_routed_experts=8, n_activated_experts=3)
    errs = {}
    with torch.no_grad():
        v4 = Experts(v4_config(hidden_size=32)).to(device)
        moe = MoE41(cfg, 0).to(device)
        cases = [("V4", ops.moe_act(gate_up, v4.limit, rounded=True), v4._act(gate_up))]
        for limit in (moe.limit, 0.0):
            moe.limit = limit
            got = ops.moe_act(gate_up, limit if limit > 0 else None, weights, order)
            cases.append((f"V4.1 limit {limit}", got, moe._act(gate_up, weights[order], dtype)))
    for name, got, ref in cases:
        if device != "cpu":
            assert torch.equal(got, ref), f"moe_act ({name}): differs from the torch path"
        errs[name] = _close(got.float(), ref.float(), f"moe_act ({name})", 1e-6,
                            2e-6 if dtype == torch.float32 else 2 ** -7)
    return errs


def check_shared_experts(ops, device, dtype, T: int, hidden: int, inter: int, seed: int = 0) -> dict:
    """The shared experts with `ops.moe_act` after their stacked gate/up GEMM against their torch code (V4's
    `SharedExpert`: clamped SwiGLU in the model dtype; V4.1's `Expert`: float32, rounded once, with and without the
    clamp), the same modules and weights: equal on CUDA (the same GEMMs, the activation as torch rounds it); within
    float32 rounding elsewhere (the interpreter's exp)."""
    g = _gen(seed, device)
    x = _randn(g, T, hidden, device=device, dtype=dtype, scale=3.0)
    errs = {}
    with torch.no_grad():
        for name, module in (("V4", SharedExpert(hidden, inter, 10.0)),
                             ("V4.1 limit 10", SharedExpert41(hidden, inter, 10.0)),
                             ("V4.1 no limit", SharedExpert41(hidden, inter, 0.0))):
            module = module.to(device, dtype)
            for p in module.parameters():       # gate/up values well past the clamp at 10
                p.copy_(_randn(g, *p.shape, device=device, dtype=dtype, scale=3.0 * p.shape[1] ** -0.5 * 4))
            module.ops = TORCH_OPS
            ref = module(x)
            module.ops = ops
            got = module(x)
            assert got.dtype == ref.dtype and got.shape == ref.shape, f"shared expert ({name}): shape or dtype differs"
            if device != "cpu":
                assert torch.equal(got, ref), f"shared expert ({name}): differs from the torch path"
            errs[name] = _close(got.float(), ref.float(), f"shared expert ({name})", 1e-5,
                                1e-5 if dtype == torch.float32 else 2 ** -6)
    return errs


def check_moe_combine_add(ops, device, dtype, T: int, v4_widths: dict, v41_widths: dict, inter: int,
                          seed: int = 0) -> dict:
    """`ops.moe_combine_add` (the shared expert's rows added in the combine's epilogue) = `ops.moe_combine` then
    torch's addition, every bit: the function in `dtype` and float32 (V4.1's sums), and the routed experts with the
    shared rows through V4's `Experts` and V4.1's `MoE.routed` (`ops` against the same ops without the field)."""
    g = _gen(seed, device)
    without = dataclasses.replace(ops, moe_combine_add=None)
    k, H = 3, 40
    experts = torch.randint(-1, 8, (T, k), generator=g, device=device)
    _, _, inv, _ = ops.expert_order(experts, 8)
    y = _randn(g, T * k, H, device=device, dtype=dtype)
    y[inv[(experts < 0).flatten()].long()] = float("nan")       # what skipped rows may hold: must not leak
    w = _randn(g, T, k, device=device, dtype=dtype)
    add = _randn(g, T, H, device=device, dtype=dtype)
    for weights in (w, None):
        for out_dtype in (dtype, torch.float32):
            got = ops.moe_combine_add(y, inv, experts, weights, out_dtype, add)
            ref = ops.moe_combine(y, inv, experts, weights, out_dtype) + add
            assert got.dtype == ref.dtype and torch.equal(got, ref), f"moe_combine_add ({out_dtype}): differs"
    cfg = v4_config(**v4_widths, moe_intermediate_size=inter)
    H, E, k = cfg.hidden_size, cfg.n_routed_experts, cfg.num_experts_per_tok
    with torch.device(device):
        ex = _GroupedExperts(cfg, ops).to(dtype)
    ex.gate_up_proj.data = _randn(g, E, 2 * inter, H, device=device, dtype=dtype, scale=H ** -0.5)
    ex.down_proj.data = _randn(g, E, H, inter, device=device, dtype=dtype, scale=inter ** -0.5)
    x, shared = _randn(g, T, H, device=device, dtype=dtype), _randn(g, T, H, device=device, dtype=dtype)
    picks = torch.stack([torch.randperm(E, generator=g, device=device)[:k] for _ in range(T)])
    picks = torch.where(torch.rand(T, k, generator=g, device=device) < 0.1, -1, picks)
    pw = torch.rand(T, k, generator=g, device=device).to(dtype)
    with torch.no_grad():
        got = ex(x, picks, pw, add=shared)
        ex.ops = without
        assert torch.equal(got, ex(x, picks, pw, add=shared)), "V4 routed + shared experts: differ"
    cfg = v41_config(**v41_widths, moe_inter_dim=inter)
    with torch.device(device):
        moe = MoE41(cfg, 0, ops).to(dtype)
    moe.experts.__class__ = _GroupedExperts
    D, E, k = cfg.dim, cfg.n_routed_experts, cfg.n_activated_experts
    moe.experts.gate_up_proj.data = _randn(g, E, 2 * inter, D, device=device, dtype=dtype, scale=D ** -0.5)
    moe.experts.down_proj.data = _randn(g, E, D, inter, device=device, dtype=dtype, scale=inter ** -0.5)
    x, shared = _randn(g, T, D, device=device, dtype=dtype), _randn(g, T, D, device=device, dtype=dtype)
    picks = torch.stack([torch.randperm(E, generator=g, device=device)[:k] for _ in range(T)])
    picks = torch.where(torch.rand(T, k, generator=g, device=device) < 0.1, -1, picks)
    pw = torch.rand(T, k, generator=g, device=device)
    with torch.no_grad():
        got = moe.routed(x, picks, pw, shared)
        moe.ops = without
        assert torch.equal(got, moe.routed(x, picks, pw, shared)), "V4.1 routed + shared experts: differ"
    return {"equal": True}


class _GroupedExperts(Experts):
    """Test double: the grouped (expert-sorted) path on any device, as CUDA bf16 runs it."""
    grouped = True


def check_moe(ops, device, dtype, T: int, v4_widths: dict, v41_widths: dict, inter: int, seed: int = 0) -> dict:
    """The routed experts' grouped path with the fused glue vs the torch path, V4 (`Experts._grouped`: weighted
    combine in the model dtype) and V4.1 (`MoE.routed`: weights before the down projection, float32 sums), with
    picks of other ranks (-1) mixed in."""
    g = _gen(seed, device)
    errs = {}
    cfg = v4_config(**v4_widths, moe_intermediate_size=inter)
    H, E, k = cfg.hidden_size, cfg.n_routed_experts, cfg.num_experts_per_tok
    with torch.device(device):          # (built where it runs: a Flash-width stack is gigabytes)
        ex = _GroupedExperts(cfg).to(dtype)
    ex.gate_up_proj.data = _randn(g, E, 2 * inter, H, device=device, dtype=dtype, scale=H ** -0.5)
    ex.down_proj.data = _randn(g, E, H, inter, device=device, dtype=dtype, scale=inter ** -0.5)
    x = _randn(g, T, H, device=device, dtype=dtype)
    picks = torch.stack([torch.randperm(E, generator=g, device=device)[:k] for _ in range(T)])
    picks = torch.where(torch.rand(T, k, generator=g, device=device) < 0.1, -1, picks)
    w = torch.rand(T, k, generator=g, device=device).to(dtype)
    with torch.no_grad():
        ref = ex(x, picks, w)
        ex.ops = ops
        got = ex(x, picks, w)
    errs["v4_rel"] = _rel_close(got, ref, "V4 routed experts", dtype)
    cfg = v41_config(**v41_widths, moe_inter_dim=inter)
    with torch.device(device):
        moe = MoE41(cfg, 0).to(dtype)
    moe.experts.__class__ = _GroupedExperts
    D, E, k = cfg.dim, cfg.n_routed_experts, cfg.n_activated_experts
    moe.experts.gate_up_proj.data = _randn(g, E, 2 * inter, D, device=device, dtype=dtype, scale=D ** -0.5)
    moe.experts.down_proj.data = _randn(g, E, D, inter, device=device, dtype=dtype, scale=inter ** -0.5)
    x = _randn(g, T, D, device=device, dtype=dtype)
    picks = torch.stack([torch.randperm(E, generator=g, device=device)[:k] for _ in range(T)])
    picks = torch.where(torch.rand(T, k, generator=g, device=device) < 0.1, -1, picks)
    w = torch.rand(T, k, generator=g, device=device)
    with torch.no_grad():
        ref = moe.routed(x, picks, w)
        moe.ops = ops
        got = moe.routed(x, picks, w)
    errs["v41"] = _close(got, ref, "V4.1 routed experts", 1e-5, 1e-5)
    return errs


def _rel_close(got, ref, name, dtype) -> float:
    """Norm-relative difference: the torch path rounds each weighted expert output and each of its atomic sums to
    the model dtype, the fused one sums in float32 and rounds once, so in bf16 they part by a few roundings."""
    rel = float((got.float() - ref.float()).norm() / ref.float().norm())
    bound = 1e-6 if dtype == torch.float32 else 2 ** -7
    assert rel <= bound, f"{name}: relative difference {rel:.2e} > {bound:.1e}"
    return rel


# ---- the models end to end ----------------------------------------------------------------------------
FUSED_FIELDS = ("hc_pre", "hc_head", "hc_post", "route", "expert_order", "moe_act", "moe_combine")


def check_tiny_models(ops) -> dict:
    """deepseek-v4-tiny and deepseek-v41-tiny through the engine (CPU, float32, the torch attention) with the fused
    mHC and routing ops in place of the models' torch code: the same greedy tokens, prompt and sampled logprobs
    within float32 rounding, over a batched prefill and batched decode (the wiring: V4.1's lagged pre, V4's head)."""
    from unittest import mock

    from openinfer import LLM, SamplingParams
    from openinfer.engine import llm_engine

    make_kernels = llm_engine.make_kernels

    def fused_kernels(config):
        backend, base = make_kernels(config)
        return backend, dataclasses.replace(base, **{f: getattr(ops, f) for f in FUSED_FIELDS})

    prompts = [[(i * 7919 + 13 * k) % 120000 + 100 for i in range(n)] for k, n in enumerate((6, 3))]
    sp = SamplingParams(temperature=0, max_tokens=3, logprobs=2, prompt_logprobs=0, ignore_eos=True)
    errs = {}
    for model in ("deepseek-v4-tiny", "deepseek-v41-tiny"):
        runs = []
        for kernels in (make_kernels, fused_kernels):
            with mock.patch.object(llm_engine, "make_kernels", kernels):
                llm = LLM(model, device="cpu", dtype="float32")
                runs.append(llm.generate(prompt_token_ids=prompts, sampling_params=sp, use_tqdm=False))
                llm.shutdown()
        worst = 0.0
        for ref, got in zip(*runs):
            assert got.outputs[0].token_ids == ref.outputs[0].token_ids, f"{model}: greedy tokens differ"
            pairs = [(a[t].logprob, b[t].logprob) for a, b in zip(got.prompt_logprobs[1:], ref.prompt_logprobs[1:])
                     for t in b]
            pairs += [(a[t].logprob, b[t].logprob) for a, b in zip(got.outputs[0].logprobs, ref.outputs[0].logprobs)
                      for t in b]
            worst = max([worst] + [abs(a - b) for a, b in pairs])
        assert worst < 1e-4, f"{model}: logprobs differ by {worst:.2e}"
        errs[model] = worst
    return errs


# ---- the interpreter run --------------------------------------------------------------------------------
def kernel_cases(ops, device: str) -> list:
    """Tiny widths for Triton's CPU interpreter; float32, and bf16 where the CPU's torch rounds as CUDA's does.
    Widths with partial K and hidden blocks, several token blocks over split K, K in one split, and (2056) the
    K-split count capped."""
    v4_route = dict(hidden_size=64, hc_mult=4, n_routed_experts=16, num_experts_per_tok=3)
    v41_route = dict(dim=64, n_routed_experts=12, n_activated_experts=3)
    v4_moe = dict(hidden_size=32, n_routed_experts=8, num_experts_per_tok=3)
    v41_moe = dict(dim=32, n_routed_experts=8, n_activated_experts=3)
    return [
        ("v4 mhc fp32", lambda: check_v4_mhc(ops, device, torch.float32, 5, 520)),
        ("v4 mhc bf16", lambda: check_v4_mhc(ops, device, torch.bfloat16, 1, 2056, seed=1)),
        ("v41 mhc fp32", lambda: check_v41_mhc(ops, device, torch.float32, 4, 64)),
        ("v41 mhc bf16", lambda: check_v41_mhc(ops, device, torch.bfloat16, 3, 72, seed=1)),
        ("v41 mhc fp32, 3 token blocks over split K", lambda: check_v41_mhc(ops, device, torch.float32, 70, 64, seed=3)),
        ("v4 mhc fp32, K in one split", lambda: check_v4_mhc(ops, device, torch.float32, 9, 16, seed=4)),
        ("hc_pre one launch = two, 1 row", lambda: check_hc_pre_launches(device, torch.bfloat16, 1, 40)),
        ("hc_pre one launch = two, 2 token blocks", lambda: check_hc_pre_launches(device, torch.float32, 33, 24, 1)),
        ("hc_pre partial tiles", lambda: check_hc_pre_tiles(device, torch.float32, 70, 24, [(64, 32, 4), (16, 64, 4)])),
        ("route fp32", lambda: check_route(ops, device, torch.float32, 9, 24, 3)),
        ("routers fp32", lambda: check_routers(ops, device, torch.float32, 6, v4_route, v41_route)),
        ("expert order", lambda: check_expert_order(ops, device, 37, 3, 10)),
        ("expert order (torch sort past SORT_MAX_PICKS)", lambda: check_expert_order(ops, device, 1400, 6, 16)),
        ("moe act fp32", lambda: check_moe_act(ops, device, torch.float32, 7, 40)),
        ("shared experts fp32", lambda: check_shared_experts(ops, device, torch.float32, 5, 48, 40)),
        ("moe combine fp32", lambda: check_moe_combine(ops, device, torch.float32, 11, 3, 40)),
        ("moe combine bf16", lambda: check_moe_combine(ops, device, torch.bfloat16, 5, 3, 40, seed=1)),
        ("moe fp32", lambda: check_moe(ops, device, torch.float32, 9, v4_moe, v41_moe, 16)),
        ("moe combine add fp32 (next ops)",
         lambda: check_moe_combine_add(next_ops(), device, torch.float32, 9, v4_moe, v41_moe, 16)),
        ("moe combine add bf16 (next ops)",
         lambda: check_moe_combine_add(next_ops(), device, torch.bfloat16, 5, v4_moe, v41_moe, 16, seed=1)),
    ]


def run(which: str = "kernels") -> list[str]:
    """`which`: "kernels" (each kernel against the torch path, module by module) or "models" (the tiny models
    through the engine). Prints each case's measured errors; returns the failures."""
    ops = fused_ops()
    cases = kernel_cases(ops, "cpu") if which == "kernels" else [("tiny models", lambda: check_tiny_models(ops))]
    fails = []
    for name, case in cases:
        try:
            print(f"{name}: ok {case()}", flush=True)
        except AssertionError as e:
            fails.append(f"{name}: {e}")
    return fails


if __name__ == "__main__":
    from tests.triton_interpreter import patch_lang_once_per_launch

    patch_lang_once_per_launch()
    fails = run(*sys.argv[1:2])
    print("\n".join(fails) or "all cases pass")
