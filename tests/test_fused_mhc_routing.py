"""The fused DeepSeek-V4/V4.1 mHC and MoE-routing kernels (layers/triton_mhc.py, layers/triton_moe_routing.py)
against the models' torch code they replace (tests/fused_mhc_routing_cases.py): in Triton's interpreter on the CPU
(tiny widths, float32 and bf16), and with `-m gpu` on CUDA at V4-Flash and V4.1-Flash widths over decode batches of
1 to 256 rows; there also captured in a CUDA graph (no host sync) and compiled once for every batch size."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.fused_mhc_routing_cases import V4_FLASH, V41_FLASH

ROOT = Path(__file__).resolve().parents[1]
RELEASED_V41 = ROOT.parent / "shared" / "reference" / "deepseek_v41" / "config.json"
BATCHES = (1, 2, 7, 32, 100, 128, 256)
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("which", ["kernels", "models"])
def test_fused_ops_equal_the_torch_path_in_interpreter(which):
    """"kernels": each kernel against the torch code it replaces, module by module; "models": deepseek-v4-tiny and
    deepseek-v41-tiny through the engine with the fused ops give the torch path's tokens and logprobs."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    r = subprocess.run([sys.executable, str(ROOT / "tests" / "fused_mhc_routing_cases.py"), which], env=env,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    assert "all cases pass" in r.stdout, r.stdout[-4000:]


@pytest.mark.skipif(not RELEASED_V41.exists(), reason="DeepSeek's released V4.1 config is not on this machine")
def test_v41_flash_widths_are_the_released_config():
    released = json.loads(RELEASED_V41.read_text())
    assert {k: released[k] for k in V41_FLASH} == V41_FLASH


# ---- CUDA, published widths -------------------------------------------------------------------------------
def _ops():
    from tests.fused_mhc_routing_cases import fused_ops
    return fused_ops()


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("T", BATCHES)
def test_gpu_mhc_at_flash_widths(T):
    from tests.fused_mhc_routing_cases import check_v4_mhc, check_v41_mhc
    print(check_v4_mhc(_ops(), "cuda", torch.bfloat16, T, V4_FLASH["hidden_size"], seed=T))
    print(check_v41_mhc(_ops(), "cuda", torch.bfloat16, T, V41_FLASH["dim"], seed=T))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("T", (1, 2, 3, 7, 100, 1000, 4500))
def test_gpu_hc_pre_one_launch_at_flash_widths(T):
    """hc_pre in one launch (1, 2 rows: 128 and 64 K splits arriving at one count) or two, equal to the torch path;
    and the one-launch kernel forced at every row count (1000 rows: 32 token blocks of 8 splits; 4500: K unsplit,
    more token blocks than SMs) equal to the two-launch path (pre, post, comb bit for bit; the collapse within the
    bf16 bound) and repeating its bits over 20 launches, its arrival counts left zero."""
    from tests.fused_mhc_routing_cases import check_hc_pre_launches, check_v4_mhc, check_v41_mhc
    print(check_v4_mhc(_ops(), "cuda", torch.bfloat16, T, V4_FLASH["hidden_size"], seed=T))
    print(check_v41_mhc(_ops(), "cuda", torch.bfloat16, T, V41_FLASH["dim"], seed=T))
    for hidden in (V4_FLASH["hidden_size"], V41_FLASH["dim"]):
        print(check_hc_pre_launches("cuda", torch.bfloat16, T, hidden, repeats=20, seed=T))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("T", BATCHES)
def test_gpu_routing_at_flash_widths(T):
    from tests.fused_mhc_routing_cases import check_route, check_routers
    k = V4_FLASH["num_experts_per_tok"]
    print(check_route(_ops(), "cuda", torch.bfloat16, T, V4_FLASH["n_routed_experts"], k, seed=T))     # V4: bf16
    print(check_route(_ops(), "cuda", torch.float32, T, V41_FLASH["n_routed_experts"], k, seed=T))    # V4.1: fp32
    print(check_routers(_ops(), "cuda", torch.bfloat16, T, V4_FLASH, V41_FLASH, seed=T))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("T", BATCHES + (1366, 8192))
def test_gpu_expert_order(T):
    from tests.fused_mhc_routing_cases import check_expert_order
    check_expert_order(_ops(), "cuda", T, V4_FLASH["num_experts_per_tok"], V4_FLASH["n_routed_experts"], seed=T)
    check_expert_order(_ops(), "cuda", T, V41_FLASH["n_activated_experts"], V41_FLASH["n_routed_experts"], seed=T)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("T", BATCHES)
def test_gpu_moe_glue_at_flash_widths(T):
    from tests.fused_mhc_routing_cases import (check_moe, check_moe_act, check_moe_combine, check_moe_combine_add,
                                               check_shared_experts, next_ops)
    print(check_moe_act(_ops(), "cuda", torch.bfloat16, 6 * T, 2048, seed=T))
    print(check_shared_experts(_ops(), "cuda", torch.bfloat16, T, V4_FLASH["hidden_size"], 2048, seed=T))
    print(check_moe_combine_add(next_ops(), "cuda", torch.bfloat16, T, V4_FLASH, V41_FLASH, inter=128, seed=T))
    print(check_moe_combine(_ops(), "cuda", torch.bfloat16, T, 6, V4_FLASH["hidden_size"], seed=T))
    print(check_moe(_ops(), "cuda", torch.bfloat16, T, V4_FLASH, V41_FLASH, inter=128, seed=T))


def _flash_step(ops, streams, fn, base, scale, logits, bias, table, ids, gate_up, ys):
    """One V4-Flash-width pass through every fused kernel: mHC pre and post, learned and hashed routing, the
    expert order, both activations and the combine."""
    pre, post, comb, x = ops.hc_pre(streams, fn, base, scale, 20, 1e-6, 1e-6)
    merged = ops.hc_post(x, streams, post, comb, True)
    _, _, _, lagged = ops.hc_pre(merged, fn, base, scale, 20, 1e-6, 1e-20, pre)
    head = ops.hc_head(streams, fn[:4], base[:4], scale[:1], 1e-6, 1e-6)
    experts, weights = ops.route(logits, bias, 6, 1.5, True)
    hashed, _ = ops.route(logits, None, 6, 1.5, True, table=table, token_ids=ids)
    order, _, inv, offs = ops.expert_order(experts, 256)
    h4 = ops.moe_act(gate_up, 10.0, rounded=True)
    h41 = ops.moe_act(gate_up, 10.0, weights.float().flatten(), order)
    out = ops.moe_combine(ys, inv, experts, weights, torch.bfloat16)
    return merged, lagged, head, experts, weights, hashed, offs, h4, h41, out


def _flash_inputs(T, g):
    H, n = V4_FLASH["hidden_size"], 4
    dev = "cuda"
    return dict(streams=torch.randn(T, n, H, generator=g, device=dev).bfloat16(),
                fn=torch.randn(24, n * H, generator=g, device=dev) / 128, base=torch.randn(24, generator=g, device=dev),
                scale=torch.rand(3, generator=g, device=dev) + 0.5,
                logits=torch.randn(T, 256, generator=g, device=dev).bfloat16(), bias=torch.zeros(256, device=dev),
                table=torch.randint(0, 256, (1000, 6), generator=g, device=dev),
                ids=torch.randint(0, 1000, (T,), generator=g, device=dev),
                gate_up=(torch.randn(T * 6, 4096, generator=g, device=dev) * 6).bfloat16(),
                ys=torch.randn(T * 6, H, generator=g, device=dev).bfloat16())


@pytest.mark.gpu
@gpu
def test_gpu_fused_kernels_replay_in_cuda_graphs_and_compile_once_for_every_batch():
    """Captured in a CUDA graph (a host sync would fail the capture), the replay on new inputs gives the eager
    results bit for bit; and after the first batch size no other one compiles a kernel again."""
    from openinfer.engine.compile_watch import install_triton_compile_counter, triton_compiles
    assert install_triton_compile_counter()
    ops, g = _ops(), torch.Generator(device="cuda").manual_seed(0)
    _flash_step(ops, **_flash_inputs(1, g))
    torch.cuda.synchronize()
    compiled = triton_compiles()
    for T in (2, 3, 16, 17, 64, 100, 255, 256):
        _flash_step(ops, **_flash_inputs(T, g))
    torch.cuda.synchronize()
    assert triton_compiles() == compiled, "a batch size compiled a kernel again"

    static = _flash_inputs(37, g)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _flash_step(ops, **static)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _flash_step(ops, **static)
    fresh = _flash_inputs(37, g)
    for name, t in fresh.items():
        static[name].copy_(t)
    graph.replay()
    torch.cuda.synchronize()
    for got, want in zip(captured, _flash_step(ops, **fresh)):
        assert torch.equal(got, want)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("hidden", (V4_FLASH["hidden_size"], V41_FLASH["dim"]))
def test_gpu_mix_products_are_exact(hidden):
    """The mixes' tensor-core path splits fn into three bf16 parts: with one nonzero stream value (+-1, or a power
    of two) per token, every sum holds one product, so each mix must equal that product exactly — a part dropped
    or rounded would show in fn's low bits."""
    import triton

    from openinfer.layers import triton_mhc

    n, T = 4, 300
    K, mix = n * hidden, (2 + n) * n
    g = torch.Generator(device="cuda").manual_seed(hidden)
    fn = torch.randn(mix, K, device="cuda", generator=g) * 0.37          # full float32 mantissas
    where = torch.randint(0, K, (T,), device="cuda", generator=g)
    value = 2.0 ** torch.randint(-3, 4, (T,), device="cuda", generator=g).float()
    value = value * (torch.randint(0, 2, (T,), device="cuda", generator=g) * 2 - 1)
    x = torch.zeros(T, K, device="cuda", dtype=torch.bfloat16)
    x[torch.arange(T, device="cuda"), where] = value.bfloat16()
    mixp = 32
    part = torch.empty(4, T, mixp, device="cuda")
    kps = K // 4
    triton_mhc._hc_mix_partials_kernel[(triton.cdiv(T, triton_mhc.BLOCK_T), 4)](
        x, fn, part, T, K, kps, x.stride(0), part.stride(0), MIX=mix, MIXP=mixp, BLOCK_T=triton_mhc.BLOCK_T,
        BLOCK_K=triton_mhc.BLOCK_K, UPCAST=False)
    got = part.sum(0)[:, :mix]
    want = fn[:, where].T * value[:, None]
    assert torch.equal(got, want)
    assert torch.equal(part.sum(0)[:, mix], value * value)
