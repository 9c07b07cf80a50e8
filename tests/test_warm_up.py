"""Start-up warm-up (LLMEngine.warm_up, engine/compile_watch.py): its prompt lengths meet every kernel variant a
step can, it leaves no trace, and the capture setting is checked. The GPU side (no compile and no capture under
traffic after start-up) is tests/test_gpu.py::test_traffic_after_start_up_compiles_and_captures_nothing."""

from __future__ import annotations

import dataclasses

import pytest

from openinfer import LLM, EngineConfig, SamplingParams
from openinfer.engine.llm_engine import warm_up_token_counts
from openinfer.quantization.triton_kernels import fp8_config, grouped_config


@pytest.mark.parametrize("budget", [512, 2048, 8192])
@pytest.mark.parametrize("experts", [8, 64, 256])
def test_warm_up_lengths_meet_every_gemm_variant(budget, experts):
    """Every step size up to the token budget picks a (FP8 GEMM config, grouped MoE GEMM config, M == 1,
    M % 16 == 0) class — what makes Triton compile a new variant — that one of the warm-up's lengths picked."""
    counts = warm_up_token_counts(budget, 10**6)
    assert max(counts) == budget and len(counts) <= 40

    def fp8_variant(m, n, k, block):        # the split count is a runtime argument: no variant of its own
        return dataclasses.replace(fp8_config(m, n, k, block), split_k=0)

    def variant(m):
        return (fp8_variant(m, 4096, 7168, 128), fp8_variant(m, 512, 7168, 32),
                grouped_config(m, 2048, 7168, experts, "mxfp4", 32), grouped_config(m, 2048, 7168, experts, "fp8", 128),
                m == 1, m % 16 == 0)

    seen = {variant(m) for m in counts}
    assert [m for m in range(1, budget + 1) if variant(m) not in seen] == []
    assert all(m <= 100 for m in warm_up_token_counts(budget, 100))     # short models: nothing past their length


def test_warm_up_leaves_no_trace(smollm_dir):
    llm = LLM(smollm_dir, device="cpu", max_num_batched_tokens=64, max_num_seqs=4)
    engine = llm.engine
    engine.warm_up()
    stats = engine.stats()
    assert stats["num_steps"] == 0 and stats["prompt_tokens_computed"] == 0 and stats["num_running"] == 0
    assert stats["prefix_cache_hit_tokens"] == 0 and stats["kv_blocks_free"] == stats["kv_blocks_total"]
    assert stats["jit_compiles"] is None and stats["graph_captures"] == 0        # CPU: no Triton, no graphs
    out = llm.generate("hello", SamplingParams(max_tokens=2, temperature=0))[0]
    assert out.num_cached_tokens == 0 and len(out.outputs[0].token_ids) == 2


def test_cuda_graph_capture_setting_is_checked():
    with pytest.raises(ValueError, match="cuda_graph_capture"):
        EngineConfig(cuda_graph_capture="lazy").validate()
