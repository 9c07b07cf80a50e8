"""DeepSeek-V4.1 on CUDA (`pytest -m gpu`, on the device), on `deepseek-v41-tiny` in its published formats: decode in
CUDA graphs equals eager, Engram tables read in place from pinned host memory equal tables in GPU memory (graphs
included), the UVA row gather equals indexing, and YOCO with a tail covering the truncation equals exact. The CPU
path, which these fast paths are compared with in benchmarks/gpu_deepseek_v41.py, is the one tested against
DeepSeek's reference (tests/test_deepseek_v41.py)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from openinfer import LLM, SamplingParams  # noqa: E402


def _prompts():
    g = torch.Generator().manual_seed(5)
    return [torch.randint(2, 129000, (n,), generator=g).tolist() for n in (100, 37, 200)]


def _run(**kw):
    # max_model_len bounds the context buckets captured at start-up: the default (the pool's length) captures a graph
    # whose torch indexer path scores every entry of a million-token context, gigabytes a start-up leaves behind
    llm = LLM("deepseek-v41-tiny", device="cuda", max_model_len=4096, **kw)
    graphs = llm.engine.config.use_cuda_graphs and llm.engine.runner.model.traits.cuda_graph_decode
    outs = llm.generate(prompt_token_ids=_prompts(), sampling_params=SamplingParams(
        temperature=0, ignore_eos=True, max_tokens=24, logprobs=5), use_tqdm=False)
    llm.shutdown()
    return graphs, [(o.outputs[0].token_ids, [{t: lp.logprob for t, lp in s.items()} for s in o.outputs[0].logprobs])
                    for o in outs]


def _equal(a, b):
    for (ta, la), (tb, lb) in zip(a, b):
        assert ta == tb
        for x, y in zip(la, lb):
            assert max(abs(x[t] - y[t]) for t in x) < 1e-3


def test_graphs_equal_eager_and_host_tables_equal_device_tables():
    graphs, with_graphs = _run()
    assert graphs
    _, eager = _run(enforce_eager=True)
    host_graphs, host = _run(engram_tables="host")
    assert host_graphs               # pinned host tables stay inside the captured decode
    _equal(with_graphs, eager)
    _equal(host, eager)


def test_uva_gather_equals_indexing():
    from openinfer.layers.triton_engram import gather_rows

    values = torch.randint(0, 256, (5000, 256), dtype=torch.uint8).view(torch.float8_e4m3fn).pin_memory()
    scales = torch.randint(0, 256, (5000, 8), dtype=torch.uint8).view(torch.float8_e8m0fnu).pin_memory()
    ids = torch.randint(0, 5000, (7, 24), device="cuda")
    v, s = gather_rows(values, scales, ids)
    assert torch.equal(v.view(torch.uint8).cpu(), values.view(torch.uint8)[ids.cpu()])
    assert torch.equal(s.view(torch.uint8).cpu(), scales.view(torch.uint8)[ids.cpu()])


def test_yoco_with_a_covering_tail_equals_exact(monkeypatch):
    """YOCO's later layers see fewer rows than exact prefill's, so the per-size kernel tables (kernel_choice.py) could
    give the two runs different GEMM routes, each rounding the FP8 activations its own way (W8A8 scales the product
    in fp32, the bf16 routes round the scaled activations to bf16): the tables are pinned to one route each here,
    so what differs is YOCO alone (the routes are held to the reference in test_gpu_published.py)."""
    from openinfer.quantization import kernel_choice

    monkeypatch.setattr(kernel_choice, "FP8_FINE_BLOCK_BY_M", ((0, "fp8"),))
    monkeypatch.setattr(kernel_choice, "EXPERT_KERNEL_BY_ROWS_PER_EXPERT", ((0, "w4a16"),))
    _, exact = _run(enforce_eager=True)
    _, yoco = _run(enforce_eager=True, v41_prefill_mode="yoco", v41_prefill_keep_tokens=64)
    _equal(yoco, exact)
