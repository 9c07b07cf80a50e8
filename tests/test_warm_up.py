"""Start-up warm-up (LLMEngine.warm_up, engine/compile_watch.py): its prompt lengths meet every kernel variant a
step can, and the capture setting is checked (that it leaves no trace: tests/test_engine_core.py). The GPU side (no compile and no capture under
traffic after start-up) is tests/test_gpu.py::test_traffic_after_start_up_compiles_and_captures_nothing."""

from __future__ import annotations

import dataclasses

import pytest

from openinfer import EngineConfig
from openinfer.engine.llm_engine import warm_up_token_counts
from openinfer.quantization import kernel_choice
from openinfer.quantization.triton_kernels import fp8_config, grouped_config
from openinfer.quantization.triton_w4a8 import folded_config


@pytest.mark.parametrize("budget", [512, 2048, 8192])
@pytest.mark.parametrize("experts", [8, 64, 256])
def test_warm_up_lengths_meet_every_gemm_variant(budget, experts):
    """Every step size up to the token budget picks, for each kernel, a variant (FP8 GEMM config, grouped MoE GEMM
    configs, V4's grouped wo_a config and route, the folded W4A8 config of its 6M routed rows, kernel_choice routes (top-6 routing), M == 1,
    M % 16 == 0) — what makes Triton compile a new variant — that one of the warm-up's lengths picked."""
    counts = warm_up_token_counts(budget, 10**6)
    assert max(counts) == budget and len(counts) <= 40

    def fp8_variant(m, n, k, block):        # the split count is a runtime argument: no variant of its own
        return dataclasses.replace(fp8_config(m, n, k, block), split_k=0)

    def variant(m):
        return (fp8_variant(m, 4096, 7168, 128), fp8_variant(m, 512, 7168, 32),
                grouped_config(m, 2048, 7168, experts, "mxfp4", 32), grouped_config(m, 2048, 7168, experts, "fp8", 128),
                folded_config(6 * m, 2048, experts),
                grouped_config(8 * m, 1024, 4096, 8, "fp8", 128),        # V4's grouped wo_a: 8 groups of T rows
                kernel_choice.fp8_grouped_kernel(m),
                kernel_choice.fp8_fine_block_kernel(m), kernel_choice.expert_kernel(6 * m, experts),   # the routes per size
                kernel_choice.expert_kernel(6 * m, experts, folded=True),
                m == 1, m % 16 == 0)

    # each kernel compiles its variants on its own: every variant of each one must come up in some warm-up step
    seen = [{variant(m)[i] for m in counts} for i in range(len(variant(1)))]
    assert [m for m in range(1, budget + 1) if any(v not in s for v, s in zip(variant(m), seen))] == []
    assert all(m <= 100 for m in warm_up_token_counts(budget, 100))     # short models: nothing past their length


def test_cuda_graph_capture_setting_is_checked():
    with pytest.raises(ValueError, match="cuda_graph_capture"):
        EngineConfig(cuda_graph_capture="lazy").validate()
