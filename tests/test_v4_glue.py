"""The fused DeepSeek-V4/V4.1 attention glue (layers/triton_v4_glue.v4_norm_rope: RMSNorm + interleaved RoPE + casts in
one launch) against the models' torch code it replaces (tests/v4_glue_cases.py): in Triton's interpreter on the CPU
(every call shape the models make, float32 and bf16, widths with a partial block; and deepseek-v4-tiny and
deepseek-v41-tiny through the engine with and without the op), and with `-m gpu` on CUDA at the Flash widths and
through the engine in bf16."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("which", ["kernels", "models"])
def test_norm_rope_equals_the_torch_path_in_interpreter(which):
    """"kernels": the op against `RopeRows` / `RMSNorm` with the torch ops; "models": the tiny V4 and V4.1 through the
    engine give the same tokens and logprobs with the op as without it."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    r = subprocess.run([sys.executable, str(ROOT / "tests" / "v4_glue_cases.py"), which], env=env,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert "all cases pass" in r.stdout, r.stdout[-4000:]


# ---- CUDA ---------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("T", (1, 7, 128))
def test_gpu_norm_rope_at_flash_widths(T):
    from tests.v4_glue_cases import flash_cases, fused_ops, kernel_cases
    for name, case in kernel_cases(fused_ops(), "cuda") + flash_cases(fused_ops(), "cuda", T):
        print(name, case())


@pytest.mark.gpu
@gpu
def test_gpu_tiny_models_with_norm_rope_float32():
    """The engine in float32 on CUDA (TRITON_OPS) with and without the op: the same greedy tokens, logprobs within
    float32 noise."""
    from tests.v4_glue_cases import check_tiny_models
    print(check_tiny_models("cuda", "float32", tol=1e-3))


@pytest.mark.gpu
@gpu
def test_gpu_tiny_models_with_norm_rope_bf16():
    """The engine in bf16 on CUDA (graphs captured, TRITON_OPS) with and without the op: prompt logprobs (and the
    sampled ones until the tokens part, which a near-tie of the random model may make them do) within bf16 noise."""
    from tests.v4_glue_cases import check_tiny_models
    print(check_tiny_models("cuda", "bfloat16", tol=5e-2, same_tokens=False))


@pytest.mark.gpu
@gpu
def test_gpu_norm_rope_replays_in_a_cuda_graph():
    """No host sync: the op captures in a CUDA graph and the replay gives the eager result for new inputs."""
    from tests.v4_glue_cases import YARN
    from openinfer.layers.triton_v4_glue import v4_norm_rope
    from openinfer.models.deepseek_v4.model import InterleavedRope

    rope = InterleavedRope(YARN, 64, 1 << 20).cuda()
    rope.reset(torch.device("cuda"))
    x = torch.randn(4, 64, 512, device="cuda", dtype=torch.bfloat16)
    pos = torch.randint(0, 1 << 20, (4,), device="cuda")
    run = lambda: v4_norm_rope(x, 1e-6, None, pos, rope.inv_freq, rope.scale, torch.bfloat16)   # noqa: E731
    run()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = run()
    x.copy_(torch.randn_like(x))
    pos.copy_(torch.randint(0, 1 << 20, (4,), device="cuda"))
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, run())
