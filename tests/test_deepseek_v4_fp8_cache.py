"""DeepSeek-V4's own cache format (EngineConfig.kv_cache_dtype="fp8_ds_mla": window rings and compressed entries as
FlashMLA's FP8 rows, quantization/kv_formats.py's `Fp8DsMlaCodec`) through the engine, against the bf16/fp32 cache.

The codec itself (bits, FlashMLA's layout) is tests/test_kv_formats.py's; the fused decode kernel reading it,
tests/test_sparse_decode_attention.py's. Here: the tiny V4 (float32, torch paths: the contract every kernel follows)
decodes greedily with and without the option. Its random weights give near-flat logits over 129k tokens, so greedy
tokens part on near ties; what is held is the log-probability of the unquantized engine's token at every step up to
and including the first difference. Measured 2026-12-03 (3 prompts of 20/130/300 tokens, 10 steps): at most 0.0133
(greedy tokens agree for 10, 10 and 2 of 10 steps); bound 0.05. Every prompt's first token (the prefill's) agrees.
"""

from __future__ import annotations

import pytest
import torch

from openinfer import LLM, SamplingParams
from tests.conftest import record_step_logits

PROMPTS = [[(i * 7919 + k) % 120000 + 100 for i in range(n)] for k, n in enumerate((20, 130, 300))]
STEPS = 10
MAX_DLOGPROB = 0.05


def _decode(kv_cache_dtype: str):
    llm = LLM("deepseek-v4-tiny", device="cpu", dtype="float32", max_num_seqs=4, kv_cache_dtype=kv_cache_dtype)
    logits = record_step_logits(llm)
    outs = llm.generate(prompt_token_ids=PROMPTS, use_tqdm=False,
                        sampling_params=SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True))
    caches = llm.engine.runner.caches
    kinds = {k: (caches[k][0].dtype, caches[k][0].shape[-1]) for k in ("swa", "csa_kv", "hca_kv")}
    result = [o.outputs[0].token_ids for o in outs], [logits[o.request_id] for o in outs], kinds
    llm.shutdown()
    return result


def test_tiny_v4_with_the_flashmla_cache_follows_the_unquantized_cache():
    ref_tokens, ref_logits, _ = _decode("auto")
    tokens, logits, kinds = _decode("fp8_ds_mla")
    # the window rings and compressed entries are the codec's uint8 rows (24 + 2*8 + 8 bytes of a 32-wide head)
    assert set(kinds.values()) == {(torch.uint8, 48)}, kinds
    worst, changed = 0.0, False
    for ta, tb, la, lb in zip(ref_tokens, tokens, ref_logits, logits):
        same = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), len(ta))
        for i in range(min(same + 1, len(ta))):
            a, b = la[i].log_softmax(-1), lb[i].log_softmax(-1)
            worst = max(worst, (a[ta[i]] - b[ta[i]]).abs().item())
            changed |= not torch.equal(la[i], lb[i])
    assert changed, "the FP8 cache changed no logit: is it in use?"
    assert worst < MAX_DLOGPROB, worst
    assert sum(ta[0] == tb[0] for ta, tb in zip(ref_tokens, tokens)) == len(PROMPTS)   # the prefill's token


@pytest.mark.parametrize("model", ["deepseek-v41-tiny"])
def test_fp8_ds_mla_is_refused_for_other_models(model):
    with pytest.raises(ValueError, match=r"kv_cache_dtype='fp8_ds_mla'.*DeepSeek-V4 models only"):
        LLM(model, device="cpu", kv_cache_dtype="fp8_ds_mla")


# ---- GPU (`pytest -m gpu`, on the device): the fused kernels (decode attention, compressors) read and write the rows
def _decode_on(device: str, dtype: str, kv_cache_dtype: str):
    llm = LLM("deepseek-v4-tiny", device=device, dtype=dtype, max_num_seqs=4, kv_cache_dtype=kv_cache_dtype,
              **({"gpu_memory_utilization": 0.3} if device == "cuda" else {}))
    logits = record_step_logits(llm)
    outs = llm.generate(prompt_token_ids=PROMPTS, use_tqdm=False,
                        sampling_params=SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True))
    result = [o.outputs[0].token_ids for o in outs], [logits[o.request_id] for o in outs]
    llm.shutdown()
    return result


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpu_tiny_v4_with_the_flashmla_cache_follows_the_unquantized_cache(dtype):
    """On CUDA (TRITON_OPS: the fused decode attention reads the rows, the fused compressors write them; CUDA graphs)
    the option moves the unquantized engine's token log-probabilities by no more than on the CPU's torch paths."""
    (ref_tokens, ref_logits), (tokens, logits) = (_decode_on("cuda", dtype, kv) for kv in ("auto", "fp8_ds_mla"))
    worst = 0.0
    for ta, tb, la, lb in zip(ref_tokens, tokens, ref_logits, logits):
        same = next((i for i, (x, y) in enumerate(zip(ta, tb)) if x != y), len(ta))
        for i in range(min(same + 1, len(ta))):
            a, b = la[i].float().log_softmax(-1), lb[i].float().log_softmax(-1)
            worst = max(worst, (a[ta[i]] - b[ta[i]]).abs().item())
    print(f"{dtype}: max |delta logprob| {worst:.4g}")
    assert worst < MAX_DLOGPROB, worst
