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


@pytest.mark.parametrize("which", ["kernels", "models", "ring_kernels", "decode_glue_kernels"])
def test_norm_rope_equals_the_torch_path_in_interpreter(which):
    """"kernels": the op against `RopeRows` / `RMSNorm` with the torch ops; "models": the tiny V4 and V4.1 through the
    engine give the same tokens and logprobs with the op as without it. "ring_kernels": `v4_kv_ring` (the ring write in
    the kernel's epilogue) stores the bytes the models' torch write stores; "decode_glue_kernels": `v4_compressor_rows`
    and `entry_rows` bit-exact against the models' torch code. The staged ops' engine checks ("ring_models",
    "decode_glue_models": the tiny engines with each give the same tokens and exactly the same logprobs, decode-only
    and mixed steps) take ~3 minutes each in the interpreter: they run on the GPU (the tests below) and directly,
    `TRITON_INTERPRET=1 python tests/v4_glue_cases.py ring_models`; both passed on the CPU when written."""
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


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("T", (1, 7, 128))
def test_gpu_kv_ring_at_flash_widths(T):
    """`v4_kv_ring` (TRITON_OPS_NEXT): the ring bytes of the torch write after `v4_norm_rope`, at the tiny cases' and
    the Flash widths."""
    from tests.v4_glue_cases import flash_ring_cases, next_ops, ring_cases
    for name, case in ring_cases(next_ops(), "cuda") + flash_ring_cases(next_ops(), "cuda", T):
        print(name, case())


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("mixed", (False, True))
def test_gpu_tiny_models_with_kv_ring_float32(mixed):
    """The engine in float32 on CUDA with `v4_norm_rope`, with and without `v4_kv_ring`: the ring holds the same bytes,
    so the same greedy tokens and logprobs (the bound only admits run-to-run GPU noise); `mixed`: steps that mix decode
    rows and prefill chunks."""
    from tests.v4_glue_cases import check_tiny_models
    print(check_tiny_models("cuda", "float32", tol=1e-6, op="v4_kv_ring",
                            engine_kwargs={"max_num_batched_tokens": 8} if mixed else None))


@pytest.mark.gpu
@gpu
def test_gpu_tiny_models_with_kv_ring_bf16():
    """The engine in bf16 on CUDA (graphs captured) with and without `v4_kv_ring`."""
    from tests.v4_glue_cases import check_tiny_models
    print(check_tiny_models("cuda", "bfloat16", tol=5e-2, same_tokens=False, op="v4_kv_ring"))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("fp8", (False, True))
def test_gpu_kv_ring_replays_in_a_cuda_graph(fp8):
    """No host sync: the ring write captures in a CUDA graph; the replay with new rows, positions and slots stores what
    the eager op stores."""
    from tests.v4_glue_cases import YARN
    from openinfer.layers.triton_v4_glue import v4_kv_ring
    from openinfer.models.deepseek_v4.model import InterleavedRope

    rope = InterleavedRope(YARN, 64, 1 << 20).cuda()
    rope.reset(torch.device("cuda"))
    x = torch.randn(4, 512, device="cuda", dtype=torch.bfloat16)
    w = torch.rand(512, device="cuda") + 0.5
    pos = torch.randint(0, 1 << 20, (4,), device="cuda")
    slots = torch.tensor([3, 0, 5], device="cuda")
    width = 512 + 16 if fp8 else 512
    ring = torch.zeros(6, 135, width, device="cuda", dtype=torch.uint8 if fp8 else torch.bfloat16)
    run = lambda r: v4_kv_ring(x, 1e-6, w, pos, rope.inv_freq, rope.scale, torch.float32, r, slots,   # noqa: E731
                               32 if fp8 else 0)
    run(ring)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = run(ring)
    x.copy_(torch.randn_like(x))
    pos.copy_(torch.randint(0, 1 << 20, (4,), device="cuda"))
    slots.copy_(torch.tensor([1, 2, 4], device="cuda"))
    ring.zero_()
    g.replay()
    torch.cuda.synchronize()
    eager = torch.zeros_like(ring)
    assert torch.equal(out, run(eager))
    assert torch.equal(ring, eager)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("T", (1, 7, 128))
def test_gpu_compressor_and_entry_rows(T):
    """`v4_compressor_rows` and `entry_rows` (TRITON_OPS_NEXT) bit-exact against the models' torch code on CUDA, at
    the tiny cases' and the Flash widths."""
    from tests.v4_glue_cases import decode_glue_cases, flash_decode_glue_cases, next_ops
    for name, case in decode_glue_cases(next_ops(), "cuda") + flash_decode_glue_cases(next_ops(), "cuda", T):
        print(name, case())


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("op", ("v4_compressor_rows", "entry_rows", "moe_combine_add"))
def test_gpu_tiny_models_with_decode_glue_float32(op):
    """The engine in float32 on CUDA with `v4_norm_rope`, with and without the op: bit-exact ops, so the same greedy
    tokens and logprobs (the bound only admits run-to-run GPU noise)."""
    from tests.v4_glue_cases import check_tiny_models
    print(check_tiny_models("cuda", "float32", tol=1e-6, op=op))


@pytest.mark.gpu
@gpu
def test_gpu_decode_glue_replays_in_a_cuda_graph():
    """No host sync: `v4_compressor_rows` and `entry_rows` capture in a CUDA graph; replays with new inputs give the
    eager results."""
    from openinfer.layers.triton_compressor import v4_compressor_rows
    from openinfer.layers.triton_v4_glue import entry_rows

    kv = torch.randn(4, 1024, device="cuda", dtype=torch.bfloat16)
    gate = torch.randn_like(kv)
    bias = torch.randn(4, 1024, device="cuda")
    pos = torch.randint(0, 1 << 20, (4,), device="cuda")
    tables = torch.randint(0, 1000, (4, 64), device="cuda", dtype=torch.int32)
    run = lambda: (v4_compressor_rows(kv, gate, bias, pos, 4), entry_rows(tables[:, :40], 2500, 64))  # noqa: E731
    run()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = run()
    for t in (kv, gate):
        t.copy_(torch.randn_like(t))
    pos.copy_(torch.randint(0, 1 << 20, (4,), device="cuda"))
    tables.copy_(torch.randint(0, 1000, (4, 64), device="cuda", dtype=torch.int32))
    g.replay()
    torch.cuda.synchronize()
    for a, b in zip(out, run()):
        assert torch.equal(a, b)
