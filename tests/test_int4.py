"""CPU int4 weight-only path: it recovers the Q4_1 grid of the GGUF weights, its kernel equals dense bf16 on
the dequantized weights, and end to end it generates what the dense fp32 path does (bar late divergence)."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

from openinfer import LLM, SamplingParams
from openinfer.layers.quantized import Int4Linear, dequantize_int4, quantize_int4
from tests.conftest import assert_pool_idle


@pytest.mark.parametrize("name", ["model.layers.0.mlp.gate_proj.weight", "model.layers.7.self_attn.k_proj.weight",
                                  "model.layers.29.mlp.down_proj.weight"])
def test_int4_recovers_the_q4_1_grid(smollm_dir, name):
    """Q4_1 blocks hold their min and max on the grid, so min/max quantization finds the same grid: every
    weight comes back within bf16 rounding of the block's scale and zero (a fresh 4-bit grid would miss by
    up to half a step)."""
    with safe_open(str(smollm_dir / "model.safetensors"), "pt") as f:
        w = f.get_tensor(name)
    q, sz = quantize_int4(w)
    step = sz.float()[..., 0].transpose(0, 1).repeat_interleave(32, 1)
    assert ((dequantize_int4(q, sz) - w).abs() / step).max() < 0.1


def test_int4_linear_equals_dense_bf16_on_dequantized_weights():
    g = torch.Generator().manual_seed(0)
    lin = torch.nn.Linear(576, 1536, bias=True)
    with torch.no_grad():
        lin.weight.normal_(0, 0.05, generator=g)
        lin.bias.normal_(0, 0.1, generator=g)
    q_lin = Int4Linear(lin)
    x = torch.randn(7, 576, generator=g)
    ref = torch.nn.functional.linear(x, dequantize_int4(*quantize_int4(lin.weight.data)), lin.bias.data)
    out = q_lin(x).float()
    assert out.shape == ref.shape and ((out - ref).norm() / ref.norm()) < 1e-2


def test_int4_generation_follows_the_dense_path(smollm_dir, llm):
    prompts = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4,", "The three primary colors are",
               "Q: What is the boiling point of water at sea level?\nA:", "Once upon a time"]
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    q = LLM(str(smollm_dir), device="cpu", quantization="int4")
    assert q.config.torch_dtype == torch.bfloat16
    a = [o.outputs[0].token_ids for o in q.generate(prompts, sp, use_tqdm=False)]
    b = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    prefix = [next((i for i, (x, y) in enumerate(zip(u, v)) if x != y), len(u)) for u, v in zip(a, b)]
    assert sum(p >= 4 for p in prefix) >= len(prompts) - 1, prefix
    assert q.tokenizer.decode(a[0]).startswith(" Paris")
    assert_pool_idle(q.engine)


def test_int4_refuses_other_dtypes():
    with pytest.raises(ValueError, match="bfloat16"):
        LLM(device="cpu", quantization="int4", dtype="float32")
    with pytest.raises(ValueError, match="quantization"):
        LLM(device="cpu", quantization="int3")
