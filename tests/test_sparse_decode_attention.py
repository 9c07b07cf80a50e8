"""DeepSeek's fused decode attention (`layers/triton_sparse_decode.py`) against its torch reference
(`layers/sparse_attention.py`), and the engine with it against the engine with the reference.

- CPU: Triton's interpreter (a subprocess: the interpreter is chosen when kernels are defined) over random small
  steps of tests/sparse_decode_cases.py: both softmax semantics, fp32 and bf16, unquantized and V4.1's packed
  FP8 / FP4 caches, V4's FlashMLA (fp8_ds_mla) rows, rollback rows, rows before the sequence start, invalid picks, a row with no valid pick, the
  default launch and a forced split.
- CPU, engine: the tiny V4 and V4.1 models decoding with the kernel (interpreter) against the same engine with the
  torch reference in its place.
- GPU (`-m gpu`): every case at small and DeepSeek's full width (64 heads of 512, window 128, top-512, HCA up to
  1024 entries); CUDA-graph replay; no new kernel variant per context size; and the engine comparison on CUDA
  (fp32 and bf16, CUDA graphs).
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _in_interpreter(mode: str) -> None:
    """tests/sparse_decode_cases.py in a subprocess with TRITON_INTERPRET=1 (`--quick`: kernel cases; `--engine`)."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    r = subprocess.run([sys.executable, "-W", "ignore", str(ROOT / "tests" / "sparse_decode_cases.py"), "cpu", mode],
                       env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert "all cases pass" in r.stdout


def test_kernel_equals_reference_in_interpreter():
    _in_interpreter("--quick")


def test_kernel_reads_ds_mla_rows_as_the_reference_in_interpreter():
    """V4's FlashMLA cache rows (`Fp8DsMlaCodec`: FP8 NoPE, E8M0 scales, bf16 RoPE) in the window ring and the
    compressed cache: the kernel decodes them as the codec does, both softmaxes, fp32 and bf16, split or not."""
    _in_interpreter("--ds-mla")


def test_engine_with_the_kernel_equals_engine_with_reference_in_interpreter():
    """The tiny V4 and V4.1 models decoding (float32) with the kernel in Triton's interpreter as their sparse decode
    attention follow the same engine with the torch reference: relative logit error < 1e-5 at every step."""
    _in_interpreter("--engine")


def test_engine_with_ds_mla_rows_and_the_kernel_equals_the_reference_engine_in_interpreter():
    """The tiny V4 with kv_cache_dtype="fp8_ds_mla" (float32) decoding through the kernel in the interpreter follows the
    same engine with the torch reference: relative logit error < 1e-5 (measured 3e-7)."""
    _in_interpreter("--engine-ds-mla")


def test_reference_rejects_an_unknown_softmax():
    from openinfer.layers.sparse_attention import sparse_decode_attention

    with pytest.raises(ValueError, match="softmax must be one of"):
        sparse_decode_attention(torch.zeros(1, 1, 16), sinks=torch.zeros(1), scale=1.0, softmax="v5",
                                ring=torch.zeros(1, 4, 16), slots=torch.zeros(1, dtype=torch.long),
                                positions=torch.zeros(1, dtype=torch.long), window=4)


@pytest.mark.gpu
@needs_cuda
def test_kernel_equals_reference_on_gpu_every_case():
    """Small shapes and DeepSeek's full width, bf16 and fp32, each with the default launch and a forced split."""
    from sparse_decode_cases import check_all

    failures = check_all("cuda")
    assert not failures, "\n".join(failures[:20])


def _full_width_case(batch: int, topk: int, softmax: str, quantized: bool, seed: int = 0):
    import random

    from sparse_decode_cases import random_case

    return random_case(random.Random(seed), device="cuda", dtype=torch.bfloat16, batch=batch, heads=64,
                       head_dim=512, window=128, rollback=3, topk=topk, softmax=softmax, quantized=quantized,
                       cache_rows=4096)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("softmax, quantized", [("v4", False), ("v41", True)])
def test_graph_replay_follows_new_positions_and_picks(softmax, quantized):
    """Captured once, replayed over other positions, slots and picks written into the same tensors: the replay
    gives what an eager call on the new inputs gives (nothing of the capture-time values is baked in)."""
    from openinfer.layers.triton_sparse_decode import sparse_decode_attention as fused

    a, b = _full_width_case(4, 512, softmax, quantized, 1), _full_width_case(4, 512, softmax, quantized, 2)
    out = torch.empty_like(a["q"])
    fused(**a, out=out)                                   # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fused(**a, out=out)
    for k in ("q", "sinks", "positions", "slots", "rows", "valid", "ring", "cache"):
        a[k].copy_(b[k])
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, fused(**b))


@pytest.mark.gpu
@needs_cuda
def test_context_sizes_compile_no_new_variant():
    """K (compressed rows per query) grows with the context and the batch varies: once a layer's variant is
    compiled, other K (and the row tensors' strides with them) and batches, split over the keys or not, reuse it —
    a new batch or context bucket is no compile under traffic."""
    from openinfer.engine.compile_watch import install_triton_compile_counter, recent_triton_compiles, triton_compiles
    from openinfer.layers.triton_sparse_decode import sparse_decode_attention as fused

    assert install_triton_compile_counter()
    for quantized in (False, True):
        softmax = "v41" if quantized else "v4"
        fused(**_full_width_case(2, 64, softmax, quantized))           # both kernels compiled (split launch)
        before = triton_compiles()
        for batch, topk in ((2, 96), (2, 512), (2, 1000), (2, 4096), (128, 512), (1, 8)):   # b=128: unsplit
            fused(**_full_width_case(batch, topk, softmax, quantized))
        torch.cuda.synchronize()
        new = triton_compiles() - before
        assert new == 0, recent_triton_compiles(new)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype, tol", [("float32", 1e-4), ("bfloat16", 2e-2)])
@pytest.mark.parametrize("model, kv_cache_dtype", [("deepseek-v4-tiny", "auto"), ("deepseek-v41-tiny", "auto"),
                                                   ("deepseek-v4-tiny", "fp8_ds_mla")])
def test_engine_with_the_kernel_follows_the_engine_with_the_reference(model, kv_cache_dtype, dtype, tol):
    """Greedy decoding of three requests (CUDA graphs where the model captures them: bf16) with the kernel and with
    the torch reference in its place: every step's logits up to the first differing token agree within `tol`
    (relative norm: fp32 leaves the kernel only its summation order; bf16 is the graph-vs-eager bound of
    tests/test_gpu.py), and the kernel ran. fp8_ds_mla: V4's FlashMLA cache rows in both engines."""
    from sparse_decode_cases import compare_engines

    failures = compare_engines(model, "cuda", dtype, tol, kv_cache_dtype=kv_cache_dtype)
    gc.collect()
    torch.cuda.empty_cache()
    assert not failures, failures
