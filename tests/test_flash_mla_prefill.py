"""FlashMLA's sparse prefill as V4's prefill attention (`layers/flash_mla_prefill.py`): its two calls and merge hold
`sparse_attention.sparse_prefill_attention`'s contract.

- CPU: `two_calls` with a torch stand-in for FlashMLA's `flash_mla_sparse_fwd` (`torch_sparse_fwd`: the same
  arguments and results, a query with no valid index giving lse = +inf and zeros, as FlashMLA does on the H200)
  over the random steps of tests/sparse_prefill_cases.py with V4's softmax and unquantized caches: the window rows
  and indices, the compressed indices and the merge against the contract.
- CPU: what FlashMLA does not take goes to the Triton kernel, with the reason named.
- GPU (`-m gpu`, tests/test_gpu_flash_mla.py): FlashMLA itself against the contract at V4-Flash width, the Triton
  merge against `merge_reference`, and an engine with 64 heads of 512 against the same engine without FlashMLA.
"""

from __future__ import annotations

import random

import pytest
import torch

from openinfer.config import EngineConfig
from openinfer.layers import flash_mla_prefill
from openinfer.layers.sparse_attention import V4_SOFTMAX, V41_SOFTMAX, sparse_prefill_attention
from openinfer.quantization.kv_formats import Fp8DsMlaCodec
from tests.sparse_prefill_cases import cases, random_case


def torch_sparse_fwd(q, kv, indices, scale, sink=None):
    """FlashMLA's `flash_mla_sparse_fwd` in torch: q [T, H, D], kv [N, 1, D] (K = V), indices [T, 1, k] (-1 or >= N:
    none) -> (out [T, H, D] in q's dtype, lse [T, H] natural log, +inf for a query with no valid index); `sink` [H]
    scales the output by e^lse / (e^lse + e^sink). Probabilities rounded to the value dtype before PV, as the kernel."""
    idx = indices[:, 0].long()
    ok = (idx >= 0) & (idx < kv.shape[0])
    keys = kv[:, 0][idx.clamp(0, kv.shape[0] - 1)]
    keys = torch.where(ok[..., None], keys, 0)
    s = torch.einsum("thd,tkd->thk", q.float(), keys.float()) * scale
    s = s.masked_fill(~ok[:, None, :], float("-inf"))
    m = s.amax(-1, keepdim=True).clamp(min=-1e30)
    p = torch.exp(s - m)
    lsum = p.sum(-1)
    lse = torch.where(lsum > 0, m[..., 0] + torch.log(lsum), float("inf"))
    out = torch.einsum("thk,tkd->thd", p.to(keys.dtype).float(), keys.float()) / lsum.clamp(min=1e-30)[..., None]
    if sink is not None:
        out = out * torch.where(lsum > 0, torch.sigmoid(lse - sink.float()[None, :]), 0.0)[..., None]
    return out.to(q.dtype), lse


def _v4_cases():
    for name, case in cases("cpu", formats=(False,)):
        if case["softmax"] == V4_SOFTMAX:
            yield name, case


def test_two_calls_and_the_merge_hold_the_contract():
    """Every V4 step of the random cases (fresh, wrapped and floored windows, chunks longer than the ring, invalid
    picks, a query with none, K = 0, HCA prefixes): float32 within 1e-5 of the output's magnitude; bf16 no farther
    from the float32 contract than the bf16 contract plus two output roundings (the calls' and the merge's)."""
    n = 0
    for name, case in _v4_cases():
        args = {k: v for k, v in case.items() if k != "q"}
        q = case["q"]
        got = flash_mla_prefill.two_calls(q, torch_sparse_fwd, **args, out=torch.full_like(q, float("nan")))
        assert not got.isnan().any(), name
        ref = sparse_prefill_attention(**case)
        if q.dtype == torch.float32:
            err = (got - ref).abs().max().item()
            assert err <= 1e-5 * max(1.0, ref.abs().max().item()), f"{name}: {err}"
        else:
            oracle = sparse_prefill_attention(**{**case, "q": q.float()})
            err_k = (got.float() - oracle).abs().max().item()
            err_r = (ref.float() - oracle).abs().max().item()
            assert err_k <= err_r + 2 * 2 ** -8 * oracle.abs().max().item(), f"{name}: {err_k} vs {err_r}"
        n += 1
    assert n >= 16


def test_window_rows_read_the_positions_each_query_may_see():
    """A chunk at 20..29 with window 8 in a ring of 10 (its history wrapped) and floor 17: the query at P reads
    positions max(P - 7, 17) .. P, those before 20 from ring rows p % 10 of its slot, its chunk's own from `kv`;
    -1 elsewhere."""
    W, R, D = 8, 10, 4
    ring = torch.arange(2 * R * D, dtype=torch.float32).view(2, R, D)
    positions = torch.arange(20, 30)
    kv = -torch.arange(10 * D, dtype=torch.float32).view(10, D) - 1
    keys, idx = flash_mla_prefill.window_rows(positions, torch.tensor([0, 10]), ring, torch.tensor([1]), kv, W,
                                              torch.tensor([17]))
    assert idx.shape == (10, W) and idx.dtype == torch.int32
    for t, P in enumerate(range(20, 30)):
        for j, p in enumerate(range(P - W + 1, P + 1)):
            if p < 17:
                assert idx[t, j] == -1, (P, p)
            else:
                want = ring[1, p % R] if p < 20 else kv[p - 20]
                assert torch.equal(keys[idx[t, j]], want), (P, p)


def test_merge_reference_is_the_softmax_over_both_sets_and_the_sink():
    """Merging two normalized partial attentions by their lse equals one softmax over the union with the sink; a
    side with no valid key (lse +inf, -inf or NaN) adds nothing."""
    g = torch.Generator().manual_seed(0)
    T, H, D, kw, kc = 5, 3, 8, 6, 4
    q = torch.randn(T, H, D, generator=g)
    kv = torch.randn(kw + kc, 1, D, generator=g)
    sinks = torch.randn(H, generator=g)
    iw = torch.arange(kw).expand(T, 1, kw).clone()
    ic = (kw + torch.arange(kc)).expand(T, 1, kc).clone()
    ic[0] = -1                                      # query 0: no compressed key
    o_w, l_w = torch_sparse_fwd(q, kv, iw, 0.5)
    o_c, l_c = torch_sparse_fwd(q, kv, ic, 0.5)
    assert torch.isinf(l_c[0]).all()
    got = flash_mla_prefill.merge(o_w, l_w, o_c, l_c, sinks, torch.empty_like(q))
    want, _ = torch_sparse_fwd(q, kv, torch.cat((iw, ic), -1), 0.5, sinks)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for bad in (float("-inf"), float("nan")):
        l_c2 = l_c.clone()
        l_c2[0] = bad
        torch.testing.assert_close(flash_mla_prefill.merge(o_w, l_w, o_c, l_c2, sinks, torch.empty_like(q)), got)


def test_what_flashmla_does_not_take_goes_to_the_triton_kernel_with_the_reason():
    case = random_case(random.Random(1), device="cpu", dtype=torch.bfloat16, chunks=2, heads=64, head_dim=512,
                       window=8, rollback=0, topk=8, softmax=V4_SOFTMAX, quantized=False, max_len=4, cache_rows=16)

    def why(**over):
        c = {**case, **over}
        return flash_mla_prefill.applies(c["q"], c["softmax"], c["ring"], c.get("ring_codec"), c.get("cache"),
                                         c.get("cache_codec"))
    assert "V4.1" in why(softmax=V41_SOFTMAX)
    assert "float32" in why(q=case["q"].float())
    assert "32 heads" in why(q=case["q"][:, :32])
    assert "codec" in why(ring_codec=Fp8DsMlaCodec())
    assert "codec" in why(cache_codec=Fp8DsMlaCodec())
    assert why() == "not on CUDA"


def test_flash_mla_setting_is_auto_or_off():
    assert EngineConfig(model="x", device="cpu").flash_mla == "auto"
    EngineConfig(model="x", device="cpu", flash_mla="off")
    with pytest.raises(ValueError, match="flash_mla"):
        EngineConfig(model="x", device="cpu", flash_mla="on")
