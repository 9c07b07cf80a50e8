"""Tiny random Llama-family (and OLMo-2) models: our paged engine's logits equal HF transformers' within 1e-4 (fp32,
CPU), through chunked prefill, batched decode and every supported model variant."""

from __future__ import annotations

import shutil

import pytest
import torch

from openinfer.config import EngineConfig
from openinfer.engine.llm_engine import LLMEngine
from openinfer.sampling_params import SamplingParams
from tests.conftest import TINY, assert_pool_idle

VARIANTS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(rope_theta=10000.0)),
    "llama3-rope-bias": ("LlamaConfig", "LlamaForCausalLM", dict(
        attention_bias=True, tie_word_embeddings=True,
        rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                             high_freq_factor=4.0, original_max_position_embeddings=64))),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(rope_theta=1000000.0)),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32, rope_theta=1000000.0)),
    # its own family package (models/olmo2/, docs/architecture.md's walk-through): norms after the sublayers,
    # q/k norms over all heads
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", dict(rope_theta=500000.0)),
}


def make_tiny(tmp_path, smollm_dir, variant: str):
    import transformers

    cfg_cls, model_cls, extra = VARIANTS[variant]
    torch.manual_seed(0)
    cfg = getattr(transformers, cfg_cls)(**{**TINY, **extra})
    model = getattr(transformers, model_cls)(cfg).eval()
    with torch.no_grad():  # larger-than-init weights so differences would show
        for p in model.parameters():
            p.mul_(4.0) if p.dim() > 1 else p.add_(torch.randn_like(p) * 0.1)
    path = tmp_path / variant
    model.save_pretrained(path)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm_dir / f, path / f)
    return path, model


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_tiny_model_logits_match_hf(tmp_path, smollm_dir, variant):
    path, hf = make_tiny(tmp_path, smollm_dir, variant)
    engine = LLMEngine(EngineConfig(model=str(path), device="cpu", block_size=4, max_num_batched_tokens=8))
    recorded: dict[str, list[torch.Tensor]] = {}
    execute = engine.runner.execute

    def recording_execute(sched, *rest):   # observe the real runner's output; nothing is replaced
        out = execute(sched, *rest)
        for rid, i in out.sample_index.items():
            recorded.setdefault(rid, []).append(out.logits[i].clone())
        return out

    engine.runner.execute = recording_execute
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 49152, (n,), generator=g).tolist() for n in (13, 3, 9)]
    ids = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)) for p in prompts]
    finished = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            finished[o.request_id] = o
    for rid, prompt in zip(ids, prompts):
        full = prompt + finished[rid].outputs[0].token_ids
        with torch.no_grad():
            ref = hf(torch.tensor([full[:-1]])).logits[0]
        ours = torch.stack(recorded[rid])
        torch.testing.assert_close(ours, ref[len(prompt) - 1:], atol=1e-4, rtol=0)
    assert_pool_idle(engine)
