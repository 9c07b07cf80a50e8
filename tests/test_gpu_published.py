"""GPU tests (`pytest -m gpu`): a tiny DeepSeek-V4 in the published layout (FP8 32 x 32 block-scaled dense
weights, MXFP4 experts) through the engine on CUDA (Triton FP8 and MXFP4 kernels) against the CPU reference
path on the same checkpoint, eager and CUDA-graph decode."""

from __future__ import annotations

import gc

import pytest
import torch

from openinfer import LLM, SamplingParams
from tests.test_gpu import _prompt_logits, _rel
from tests.test_quantization import QUANT, TINY_PUBLISHED, write_published

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def published_dir(tmp_path_factory):
    return write_published(tmp_path_factory.mktemp("pub") / "ckpt", TINY_PUBLISHED)


@pytest.fixture(scope="module")
def published_128_dir(tmp_path_factory):
    """The tiny V4 in 128 x 128 blocks (V4's published block; widths of whole blocks): its experts take 1 x 128
    activation groups, the folded W4A8 kernel's case."""
    cfg = {**TINY_PUBLISHED, "hidden_size": 256, "moe_intermediate_size": 128, "q_lora_rank": 128,
           "o_lora_rank": 128, "quantization_config": {**QUANT, "weight_block_size": [128, 128]}}
    return write_published(tmp_path_factory.mktemp("pub128") / "ckpt", cfg)


@pytest.mark.parametrize("quantize_activations", [True, False])
def test_published_v4_cuda_follows_cpu_reference(published_dir, quantize_activations):
    """Same semantics on both sides (W8A8 dense and W4A8 experts, or W8A16 and W4A16): CUDA bf16 is no further
    from CPU fp32 than our CPU bf16 is (the kernels add no error beyond bf16 rounding)."""
    prompt = [(i * 7919) % 120000 + 100 for i in range(150)]
    opts = dict(quantize_activations=quantize_activations)
    ref = _prompt_logits(LLM(str(published_dir), device="cpu", dtype="float32", **opts), prompt)
    cpu_bf16 = _prompt_logits(LLM(str(published_dir), device="cpu", dtype="bfloat16", **opts), prompt)
    gc.collect()
    gpu = LLM(str(published_dir), device="cuda", dtype="bfloat16", gpu_memory_utilization=0.3, **opts)
    got = _prompt_logits(gpu, prompt)
    rel, baseline = _rel(got, ref), _rel(cpu_bf16, ref)
    print(f"published tiny V4 (act quant {quantize_activations}): CUDA bf16 vs CPU fp32 {rel:.4f}, "
          f"CPU bf16 vs CPU fp32 {baseline:.4f}")
    assert not got.isnan().any()
    assert rel < 1.5 * baseline


@pytest.mark.parametrize("table, route", [("EXPERT_KERNEL_BY_ROWS_PER_EXPERT", "w4a8"), ("EXPERT_KERNEL_BY_ROWS_PER_EXPERT", "w4a16"),
                                          ("FOLDED_EXPERT_KERNEL_BY_ROWS_PER_EXPERT", "w4a8"),
                                          ("FOLDED_EXPERT_KERNEL_BY_ROWS_PER_EXPERT", "bf16_dequant"),
                                          ("EXPERT_KERNEL_BY_ROWS_PER_EXPERT", "bf16_dequant"), ("FP8_FINE_BLOCK_BY_M", "bf16"),
                                          ("FP8_FINE_BLOCK_BY_M", "fp8"), ("FP8_FINE_BLOCK_BY_M", "bf16_dequant")])
def test_published_v4_every_kernel_route_follows_cpu_reference(request, table, route, monkeypatch):
    """Each route of the per-size kernel tables (quantization/kernel_choice.py) forced at every size: the W4A8
    expert kernel, W4A16 or bf16 dequant + torch._grouped_mm on rounded rows; the 32 x 32 FP8 linears on the FP8
    or the bf16 tensor cores, or dequantized to bf16 through cuBLAS. Each
    is as close to the CPU fp32 reference as CPU bf16 is. The folded table's routes run on the 128 x 128 tiny."""
    from openinfer.quantization import kernel_choice

    published_dir = request.getfixturevalue("published_128_dir" if table.startswith("FOLDED") else "published_dir")
    prompt = [(i * 7919) % 120000 + 100 for i in range(150)]
    ref = _prompt_logits(LLM(str(published_dir), device="cpu", dtype="float32"), prompt)
    cpu_bf16 = _prompt_logits(LLM(str(published_dir), device="cpu", dtype="bfloat16"), prompt)
    gc.collect()
    from openinfer.quantization import triton_w4a8

    monkeypatch.setattr(kernel_choice, table, ((0, route),))
    folded_calls = []
    folded = triton_w4a8.grouped_gemm_w4a8_folded
    monkeypatch.setattr(triton_w4a8, "grouped_gemm_w4a8_folded",
                        lambda *a, **k: folded_calls.append(1) or folded(*a, **k))
    got = _prompt_logits(LLM(str(published_dir), device="cuda", dtype="bfloat16", gpu_memory_utilization=0.3), prompt)
    # the 128 x 128 tiny (scales within a few binades of each other) takes the folded kernel where it is named
    assert bool(folded_calls) == (table.startswith("FOLDED") and route == "w4a8")
    rel, baseline = _rel(got, ref), _rel(cpu_bf16, ref)
    print(f"published tiny V4, {table} -> {route}: CUDA bf16 vs CPU fp32 {rel:.4f}, CPU bf16 vs CPU fp32 {baseline:.4f}")
    assert not got.isnan().any()
    assert rel < 1.5 * baseline


@pytest.mark.parametrize("checkpoint", ["published_dir", "published_128_dir"])
def test_published_v4_graph_decode_equals_eager(request, checkpoint):
    """Graph-replayed decode against eager; the 128 x 128 tiny's experts run the folded W4A8 kernel in both."""
    published_dir = request.getfixturevalue(checkpoint)
    prompts = [[(i * 7919 + k) % 120000 + 100 for i in range(n)] for k, n in enumerate((20, 130))]
    sp = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = {}
    for eager in (False, True):
        llm = LLM(str(published_dir), device="cuda", dtype="bfloat16", enforce_eager=eager, max_num_seqs=8,
                  gpu_memory_utilization=0.3)
        outs[eager] = [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=sp,
                                                                     use_tqdm=False)]
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    agree = [next((i for i, (a, b) in enumerate(zip(x, y)) if a != b), len(x)) for x, y in zip(outs[False], outs[True])]
    print("graph vs eager agreeing prefixes", agree)
    assert min(agree) >= 8
