"""DeepSeek's batched sparse prefill attention: the torch contract (`layers/sparse_attention.py:
sparse_prefill_attention`) against the per-sequence path the models ran before it, the Triton kernel
(`layers/triton_sparse_prefill.py`) against the contract, and the engines' prefill with the batched op against
the engines without it.

- CPU: Triton's interpreter (a subprocess: the interpreter is chosen when kernels are defined) over random small
  steps of tests/sparse_prefill_cases.py: 1-4 chunks of random starts and lengths (fresh, within the first window,
  the ring wrapped, longer than the ring), YOCO floors, both softmaxes, fp32 and bf16, unquantized and V4.1's
  packed FP8 window / FP4 compressed rows, K = 0, invalid picks, a query with none.
- CPU, contract: equal to the per-sequence path (bit for bit where both gather the same keys).
- CPU, engine: the tiny V4 and V4.1 engines prefilling (several chunks per step, a prefix hit) with the contract
  as `LayerOps.sparse_prefill_attention` against the same engines without it.
- GPU (`-m gpu`): every case at small and V4-Flash / V4.1-Flash width (64 heads of 512, window 128, top-512, HCA up
  to 1024 entries), and the engines with the kernel against the engines without it (fp32, bf16).
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


def _cases(mode: str, interpret: bool) -> None:
    """tests/sparse_prefill_cases.py in a subprocess (TRITON_INTERPRET=1 for kernel runs)."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    r = subprocess.run([sys.executable, "-W", "ignore", str(ROOT / "tests" / "sparse_prefill_cases.py"), "cpu", mode],
                       env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert "all cases pass" in r.stdout


def test_kernel_equals_contract_in_interpreter():
    _cases("--quick", interpret=True)


def test_kernel_reads_ds_mla_rows_as_the_contract_in_interpreter():
    """V4's FlashMLA cache rows (`Fp8DsMlaCodec`) in the ring and the compressed cache, both softmaxes, fp32, bf16."""
    _cases("--ds-mla", interpret=True)


def test_contract_equals_the_per_sequence_path():
    from sparse_prefill_cases import check_per_sequence

    failures = check_per_sequence("cpu")
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("model, tol", [("deepseek-v4-tiny", 1e-6), ("deepseek-v41-tiny", 0.0)])
def test_engine_prefill_with_the_batched_contract_equals_the_per_sequence_engine(model, tol):
    """Float32: V4.1's logits are bit for bit the per-sequence engine's; V4's differ by its HCA layer's shared-key
    matmul alone (a few ulps, relative logit error < 1e-6). The batched op ran."""
    from sparse_prefill_cases import compare_engine_ops

    from openinfer.layers.sparse_attention import sparse_prefill_attention

    failures = compare_engine_ops(model, "cpu", "float32", tol, sparse_prefill_attention)
    assert not failures, failures


def test_contract_refuses_bad_arguments():
    from openinfer.layers.sparse_attention import sparse_prefill_attention

    args = dict(q=torch.zeros(2, 1, 16), sinks=torch.zeros(1), scale=1.0, kv=torch.zeros(2, 16),
                positions=torch.arange(2), cu_seqlens=torch.tensor([0, 2]), ring=torch.zeros(1, 4, 16),
                slots=torch.zeros(1, dtype=torch.long))
    with pytest.raises(ValueError, match="softmax must be one of"):
        sparse_prefill_attention(**args, softmax="v5", window=4)
    with pytest.raises(ValueError, match="exceeds the ring"):
        sparse_prefill_attention(**args, softmax="v4", window=5)


def test_chunks_must_be_consecutive_rows():
    from openinfer.layers.attention import PrefillChunk
    from openinfer.layers.sparse_attention import prefill_batch

    def chunk(start, n):
        return PrefillChunk(query_start=start, query_len=n, context_len=n, block_ids=torch.zeros(1), block_size=16,
                            state_slot=0)

    rows, cu, slots = prefill_batch([chunk(3, 4), chunk(7, 2)], torch.device("cpu"))
    assert rows == slice(3, 9) and cu.tolist() == [0, 4, 6] and slots.tolist() == [0, 0]
    with pytest.raises(ValueError, match="consecutive rows"):
        prefill_batch([chunk(3, 4), chunk(8, 2)], torch.device("cpu"))


@pytest.mark.gpu
@needs_cuda
def test_kernel_equals_contract_on_gpu_every_case():
    """Small shapes and V4-Flash / V4.1-Flash width, bf16 and fp32, default launch and small tiles."""
    from sparse_prefill_cases import check_all

    failures = check_all("cuda")
    assert not failures, "\n".join(failures[:20])


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype, tol", [("float32", 1e-4), ("bfloat16", 2e-2)])
@pytest.mark.parametrize("model", ["deepseek-v4-tiny", "deepseek-v41-tiny"])
def test_engine_prefill_with_the_kernel_follows_the_per_sequence_engine(model, dtype, tol):
    """The engines prefilling with the kernel (several chunks per step, a prefix hit) against the same engines
    without it, and the kernel ran: fp32, logits within `tol` (relative norm; summation order only); bf16, no
    farther from the float32 engine than the per-sequence bf16 engine is (x BF16_MARGIN, + `tol`), as the decode
    kernel's engine test (sparse_prefill_cases.compare_engine_ops)."""
    from sparse_prefill_cases import compare_engines

    failures = compare_engines(model, "cuda", dtype, tol)
    gc.collect()
    torch.cuda.empty_cache()
    assert not failures, failures
