"""The dequantize-to-bf16 routes (quantization/dequant_gemm.py) against the reference in Triton's interpreter on the
CPU (tests/dequant_gemm_cases.py): dequantization bit for bit, the routes within the bf16 GEMM's bound. A
subprocess: the interpreter is chosen when the kernels are defined. tests/test_gpu_dequant_gemm.py runs them on
CUDA at DeepSeek's shapes."""

import os
import subprocess
import sys
from pathlib import Path

from openinfer.device_io import ReadOnce

ROOT = Path(__file__).resolve().parents[1]


def test_dequant_routes_equal_reference_in_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    r = subprocess.run([sys.executable, str(ROOT / "tests" / "dequant_gemm_cases.py"), "--quick"],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert "all cases pass" in r.stdout


def test_dispatchers_take_the_bf16_dequant_route_when_the_table_names_it(monkeypatch):
    """fp8_linear and grouped_gemm_a8 call the dequant routes for the sizes the tables give them (with the
    activations rounded as their other routes round them), and the other routes elsewhere."""
    from openinfer.quantization import dequant_gemm, kernel_choice, triton_kernels, triton_w4a8

    calls = []
    monkeypatch.setattr(dequant_gemm, "fp8_linear_dequant", lambda *a: calls.append(("linear", a[-1])) or "dq")
    monkeypatch.setattr(dequant_gemm, "grouped_gemm_dequant",
                        lambda *a, host_offs=None: calls.append(("experts", a[-1], host_offs)) or "dq")
    monkeypatch.setattr(triton_w4a8, "quantize_dequantize_activations", lambda x, block: x)
    monkeypatch.setattr(triton_w4a8, "grouped_gemm", lambda *a: "w4a16")
    monkeypatch.setattr(triton_kernels, "fp8_gemm", lambda *a: "fp8")
    monkeypatch.setattr(kernel_choice, "FP8_FINE_BLOCK_BY_M", ((0, "fp8"), (256, "bf16_dequant")))
    monkeypatch.setattr(kernel_choice, "EXPERT_KERNEL_BY_ROWS_PER_EXPERT", ((0, "w4a16"), (256, "bf16_dequant")))
    import torch

    w = torch.zeros(64, 64, dtype=torch.float8_e4m3fn)
    s = torch.zeros(2, 2, dtype=torch.uint8)
    assert triton_kernels.fp8_linear(torch.zeros(255, 64), w, s, 32) == "fp8"
    assert triton_kernels.fp8_linear(torch.zeros(256, 64), w, s, 32) == "dq"
    we, se = torch.zeros(2, 64, 32, dtype=torch.uint8), torch.zeros(2, 64, 2, dtype=torch.uint8)
    offs = torch.zeros(2, dtype=torch.int32)
    assert triton_w4a8.grouped_gemm_a8(torch.zeros(511, 64), offs, we, se, "mxfp4", 32) == "w4a16"  # 255 per expert
    assert triton_w4a8.grouped_gemm_a8(torch.zeros(512, 64), offs, we, se, "mxfp4", 32) == "dq"
    host = ReadOnce(offs)
    assert triton_w4a8.grouped_gemm_a8(torch.zeros(512, 64), offs, we, se, "mxfp4", 32, host_offs=host) == "dq"
    assert calls == [("linear", 32), ("experts", 32, None), ("experts", 32, host)]


def test_foldable_experts_with_128_groups_take_the_folded_table(monkeypatch):
    """`grouped_gemm_a8` takes FOLDED_EXPERT_KERNEL_BY_ROWS_PER_EXPERT, and through it the folded W4A8 kernel, only
    for MXFP4 experts the caller found foldable with 1 x 128 groups over whole 128-blocks of K; others keep the
    plain table."""
    import torch

    from openinfer.quantization import kernel_choice, triton_w4a8

    monkeypatch.setattr(triton_w4a8, "grouped_gemm_w4a8_folded", lambda *a: "folded")
    monkeypatch.setattr(triton_w4a8, "grouped_gemm", lambda *a: "w4a16")
    monkeypatch.setattr(triton_w4a8, "quantize_dequantize_activations", lambda x, block: x)
    monkeypatch.setattr(kernel_choice, "EXPERT_KERNEL_BY_ROWS_PER_EXPERT", ((0, "w4a16"),))
    monkeypatch.setattr(kernel_choice, "FOLDED_EXPERT_KERNEL_BY_ROWS_PER_EXPERT", ((0, "w4a8"),))
    we, se = torch.zeros(2, 64, 128, dtype=torch.uint8), torch.zeros(2, 64, 8, dtype=torch.uint8)
    offs = torch.zeros(2, dtype=torch.int32)

    def route(k=256, fmt="mxfp4", block=128, foldable=True):
        return triton_w4a8.grouped_gemm_a8(torch.zeros(8, k), offs, we, se, fmt, block, w4a8_foldable=foldable)

    assert route() == "folded"
    assert route(foldable=False) == route(block=32) == route(k=192) == "w4a16"


def test_grouped_projection_takes_the_dequant_route_from_the_tables_token_count(monkeypatch):
    """`Fp8Linear.forward_groups` (V4's `wo_a`) calls `ops.fp8_grouped_dequant` from the token count
    FP8_GROUPED_BY_TOKENS names "bf16_dequant" on, the grouped GEMM below it, and the grouped GEMM at every size
    where the ops have no dequant route (the CPU's); both routes give the reference's values."""
    import dataclasses

    import torch

    from openinfer.layers.basic import TORCH_OPS
    from openinfer.layers.fp8_linear import Fp8Linear
    from openinfer.quantization import dequant_gemm, formats, kernel_choice

    monkeypatch.setattr(kernel_choice, "FP8_GROUPED_BY_TOKENS", ((0, "w8a16"), (4, "bf16_dequant")))
    calls = []

    def dequant(x, w, s, block):
        calls.append(x.shape[0])
        return dequant_gemm.grouped_linear_dequant(x, w, s, block)
    ops = dataclasses.replace(TORCH_OPS, fp8_grouped_dequant=dequant)
    # (the dequant kernel in torch here: tests/dequant_gemm_cases.py checks the Triton one in the interpreter)
    monkeypatch.setattr(dequant_gemm, "dequantize_to_bf16",
                        lambda w, s, fmt, block: formats.dequantize_fp8(w, s, block).to(torch.bfloat16))
    g = torch.Generator().manual_seed(0)
    lin = Fp8Linear(64, 4 * 32, 128, ops)
    w, s = formats.quantize_fp8(torch.randn(128, 64, generator=g) * 0.05, 128)
    lin.weight.data, lin.weight_scale.data = w, s
    plain = Fp8Linear(64, 4 * 32, 128)
    plain.weight.data, plain.weight_scale.data = w, s
    for t in (1, 3, 4, 9):
        x = torch.randn(t, 4, 64, generator=g).to(torch.bfloat16)
        out, ref = lin.forward_groups(x), plain.forward_groups(x)
        assert out.shape == ref.shape == (t, 4, 32)
        assert ((out.float() - ref.float()).norm() / ref.float().norm()) < 1e-2
    assert calls == [4, 9]


def test_calls_sharing_offsets_read_them_on_the_host_once():
    """A MoE's two grouped GEMMs share one ReadOnce of their offsets: the first route that needs the values on the
    host reads them (one sync on CUDA), the second reuses them."""
    reads = []

    class Offs:
        def tolist(self):
            reads.append(1)
            return [3, 5]

    host = ReadOnce(Offs())
    assert host.tolist() == [3, 5] and host.tolist() == [3, 5]
    assert len(reads) == 1
