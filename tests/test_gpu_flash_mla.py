"""FlashMLA's SM90 sparse prefill as V4's prefill attention on the GPU (`layers/flash_mla_prefill.py`; the CPU half,
with a torch stand-in for FlashMLA, is tests/test_flash_mla_prefill.py). Needs sgl-flash-mla and an SM90 GPU.

- FlashMLA's two calls and the Triton merge against the torch contract over the random steps of
  tests/sparse_prefill_cases.py at V4-Flash width (64 heads of 512, window 128, CSA top-512, HCA prefixes), bf16:
  no farther from the float32 contract than the bf16 contract plus two output roundings;
- the Triton merge against `merge_reference`, lse of every kind (finite, +inf, -inf, NaN);
- an engine (the tiny V4 with 64 heads of 512) prefilling through FlashMLA against the same engine through the
  per-sequence path, as the Triton kernel's engine test (sparse_prefill_cases.compare_engine_ops).
"""

from __future__ import annotations

import copy
import gc
import json

import pytest
import torch

from openinfer.layers import flash_mla_prefill
from openinfer.layers.sparse_attention import V4_SOFTMAX, sparse_prefill_attention

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(flash_mla_prefill.load_error() is not None,
                                 reason=str(flash_mla_prefill.load_error()))]


def test_flash_mla_holds_the_contract_at_flash_width():
    from sparse_prefill_cases import cases

    n = 0
    for name, case in cases("cuda", formats=(False,)):
        q = case["q"]
        if case["softmax"] != V4_SOFTMAX or q.dtype != torch.bfloat16 or q.shape[1:] != (64, 512):
            continue
        assert flash_mla_prefill.applies(q, V4_SOFTMAX, case["ring"], None, case.get("cache"), None) is None
        got = flash_mla_prefill.sparse_prefill_attention(**case, out=torch.full_like(q, float("nan")))
        assert not got.isnan().any(), name
        ref = sparse_prefill_attention(**case)
        oracle = sparse_prefill_attention(**{**case, "q": q.float()})
        err_k = (got.float() - oracle).abs().max().item()
        err_r = (ref.float() - oracle).abs().max().item()
        print(f"{name}: FlashMLA vs float32 {err_k:.3g}, bf16 contract {err_r:.3g}", flush=True)
        assert err_k <= err_r + 2 * 2 ** -8 * oracle.abs().max().item(), name
        n += 1
    assert n >= 5


def test_window_kernel_equals_the_reference():
    """`window_plan`'s one launch against `window_rows` + `_padded` (the torch reference) over the random steps at
    small and Flash width: the same indices, and the same key at every index a query reads."""
    from sparse_prefill_cases import cases

    for name, case in cases("cuda", formats=(False,)):
        args = (case["positions"], case["cu_seqlens"], case["ring"], case["slots"], case["kv"], case["window"],
                case.get("floors"))
        keys, idx = flash_mla_prefill.window_plan(*args)
        ref_keys, ref_idx = flash_mla_prefill.window_rows(*(a.cpu() if torch.is_tensor(a) else a for a in args))
        ref_idx = flash_mla_prefill._padded(ref_idx)
        assert torch.equal(idx.cpu(), ref_idx), name
        read = ref_idx[ref_idx >= 0].long()
        assert torch.equal(keys.cpu()[read], ref_keys[read]), name


def test_triton_merge_equals_the_reference():
    g = torch.Generator(device="cuda").manual_seed(0)
    T, H, D = 300, 64, 512
    o_w = torch.randn(T, H, D, device="cuda", generator=g).bfloat16()
    o_c = torch.randn(T, H, D, device="cuda", generator=g).bfloat16()
    l_w = torch.randn(T, H, device="cuda", generator=g) * 4
    l_c = torch.randn(T, H, device="cuda", generator=g) * 4
    l_c[::7] = float("inf")
    l_c[1::7] = float("-inf")
    l_c[2::7] = float("nan")
    sinks = torch.randn(H, device="cuda", generator=g)
    got = flash_mla_prefill.merge(o_w, l_w, o_c, l_c, sinks, torch.empty_like(o_w))
    want = flash_mla_prefill.merge_reference(o_w, l_w, o_c, l_c, sinks)
    assert (got.float() - want.float()).abs().max().item() <= 2 ** -8 * want.float().abs().max().item()


def test_engine_prefill_through_flash_mla_follows_the_per_sequence_engine(tmp_path):
    from sparse_prefill_cases import compare_engine_ops

    from openinfer.models.deepseek_v4.family import DEEPSEEK_V4_TINY_CONFIG
    from openinfer.models.deepseek_v4.writer import write_tiny

    cfg = copy.deepcopy(DEEPSEEK_V4_TINY_CONFIG)
    cfg.update(num_attention_heads=64, head_dim=512, partial_rotary_factor=0.125, index_head_dim=128)
    write_tiny(cfg, tmp_path, seed=0)
    assert json.loads((tmp_path / "config.json").read_text())["head_dim"] == 512
    ran = [0]

    def through_flash_mla(q, **kw):
        assert flash_mla_prefill.applies(q, kw["softmax"], kw["ring"], kw.get("ring_codec"), kw.get("cache"),
                                         kw.get("cache_codec")) is None
        ran[0] += 1
        return flash_mla_prefill.sparse_prefill_attention(q, **kw)

    failures = compare_engine_ops(str(tmp_path), "cuda", "bfloat16", 2e-2, through_flash_mla)
    assert ran[0] > 0
    assert not failures, failures
    # the comparison can fail: prefill attention that returns zeros moves the logits past the bound
    def zeros(q, **kw):
        return kw["out"].zero_() if kw.get("out") is not None else torch.zeros_like(q)
    broken = compare_engine_ops(str(tmp_path), "cuda", "bfloat16", 2e-2, zeros)
    gc.collect()
    torch.cuda.empty_cache()
    assert broken, "an engine whose prefill attention returns zeros passed the comparison"
