"""DeepSeek's sparse decode pieces: the indexer's sort-free top-k (layers/index_topk.py) picks exactly what the stable
descending sort picked (ties to the earlier entry, -inf and NaN where the sort puts them, k beyond the row or the
closed entries), as V4's `Indexer.select` and V4.1's `Indexer.pick` / `select_candidate_blocks` use it; the Triton
kernels (layers/triton_indexer.py, layers/triton_compressor.py) equal the torch code they replace, in Triton's
interpreter on the CPU (tests/sparse_decode_indexer_cases.py, tiny shapes) and on the GPU at full width (`-m gpu`), where
they are also captured in a CUDA graph and meet new context sizes without a new compile."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from openinfer.layers.basic import TORCH_OPS
from openinfer.layers.index_topk import order_keys, torch_index_topk
from openinfer.models.deepseek_v41.model import select_candidate_blocks

ROOT = Path(__file__).resolve().parents[1]


def stable_sort_topk(scores: torch.Tensor, k: int):
    """The oracle: the first k of a stable descending sort, as (entries sorted by position, their scores)."""
    top = torch.sort(scores, dim=-1, descending=True, stable=True)
    k = min(k, scores.shape[-1])
    picks, order = top.indices[:, :k].sort(dim=-1)
    return picks, top.values[:, :k].gather(-1, order)


def tie_heavy_scores(g, rows: int, n: int) -> torch.Tensor:
    s = torch.randint(-3, 4, (rows, n), generator=g).float() * 0.5
    s[torch.rand(rows, n, generator=g) < 0.25] = float("-inf")
    s[torch.rand(rows, n, generator=g) < 0.1] = -0.0
    s[torch.rand(rows, n, generator=g) < 0.05] = float("inf")
    s[torch.rand(rows, n, generator=g) < 0.02] = float("nan")
    s[torch.rand(rows, n, generator=g) < 0.2] += torch.randn(1, generator=g).item()
    return s


def test_order_keys_rank_as_the_stable_sort():
    s = torch.tensor([[0.5, -0.0, float("nan"), 0.0, float("-inf"), -1.5, float("inf"), 0.5, -0.0, float("nan")]])
    keys = order_keys(s)
    assert keys.unique().numel() == s.numel()                           # unique: no two entries tie
    assert torch.equal(keys.argsort(dim=-1, descending=True),
                       torch.sort(s, dim=-1, descending=True, stable=True).indices)


@pytest.mark.parametrize("n", [1, 2, 7, 64, 513, 3000])
def test_topk_picks_what_the_stable_sort_picks(n):
    g = torch.Generator().manual_seed(n)
    for k in (1, 3, n - 1, n, n + 5, 512):
        if k < 1:
            continue
        s = tie_heavy_scores(g, 16, n)
        want_picks, want_values = stable_sort_topk(s, k)
        picks, valid = torch_index_topk(s, k)
        assert torch.equal(picks, want_picks), (n, k)
        assert torch.equal(valid, want_values > float("-inf"))
        limit = torch.randint(0, n + 1, (16,), generator=g)
        picks, valid = torch_index_topk(s, k, limit)
        assert torch.equal(picks, want_picks) and torch.equal(valid, picks < limit[:, None])


def test_ties_go_to_the_earlier_entry_and_k_beyond_the_closed_entries_stays_invalid():
    s = torch.tensor([[1.0, 2.0, 2.0, 1.0, 2.0, float("-inf"), float("-inf")]])
    picks, valid = torch_index_topk(s, 2)
    assert picks.tolist() == [[1, 2]]
    picks, valid = torch_index_topk(s, 4)
    assert picks.tolist() == [[0, 1, 2, 4]]                                # the earlier 1.0 over the later
    picks, valid = torch_index_topk(s, 7, torch.tensor([5]))
    assert picks.tolist() == [list(range(7))] and valid.tolist() == [[True] * 5 + [False] * 2]
    picks, valid = torch_index_topk(s, 6)
    assert picks.tolist() == [[0, 1, 2, 3, 4, 5]] and valid.tolist() == [[True] * 5 + [False]]


def test_v4_select_picks_the_stable_sort_top_k_below_the_closed_entries():
    from tests.sparse_decode_indexer_cases import v4_config
    from openinfer.models.deepseek_v4.model import Indexer

    g = torch.Generator().manual_seed(0)
    cfg = v4_config(heads=4, index_dim=16, topk=6, head_dim=32, rope_dim=8)
    ix = Indexer(cfg, 4, TORCH_OPS)
    q = torch.randint(-2, 3, (5, 4, 16), generator=g).float()            # integer scores: many ties
    w = torch.randint(0, 2, (5, 4), generator=g).float()
    keys = torch.randint(-2, 3, (5, 12, 16), generator=g).float()
    num_closed = torch.tensor([0, 3, 6, 7, 12])
    scores = ix.scores(q, w, keys, num_closed)
    picks, valid = ix.select(q, w, keys, num_closed)
    want, _ = stable_sort_topk(scores, 6)
    assert torch.equal(picks, want) and torch.equal(valid, want < num_closed[:, None])


def test_v41_candidate_blocks_and_picks_equal_the_stable_sort():
    g = torch.Generator().manual_seed(1)
    s = tie_heavy_scores(g, 8, 37).nan_to_num(nan=1.0)
    num_closed = torch.randint(0, 38, (8,), generator=g)
    s = s.masked_fill(torch.arange(37)[None, :] >= num_closed[:, None], float("-inf"))
    # the former implementation, a stable sort of the block maxima
    blocks = torch.nn.functional.pad(s, (0, 3), value=float("-inf")).view(8, -1, 4).amax(-1)
    newest = ((num_closed - 1) // 4)[:, None]
    blocks = blocks.masked_fill((torch.arange(10)[None, :] == newest) & (newest >= 0), float("inf"))
    order = torch.sort(blocks, dim=-1, descending=True, stable=True)
    want = torch.zeros_like(blocks, dtype=torch.bool).scatter_(-1, order.indices[:, :3],
                                                              order.values[:, :3] > float("-inf"))
    assert torch.equal(select_candidate_blocks(s, num_closed, 3, 4), want)


def _interpret(*args: str, timeout: int) -> str:
    """Run tests/sparse_decode_indexer_cases.py in Triton's interpreter (chosen when the kernels are defined: a subprocess)."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    r = subprocess.run([sys.executable, str(ROOT / "tests" / "sparse_decode_indexer_cases.py"), *args],
                       env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    return r.stdout


def test_kernels_equal_the_torch_code_in_interpreter():
    assert "all cases pass" in _interpret("cpu", "--quick", timeout=900)


def test_v4_compressors_write_ds_mla_rows_as_the_torch_code_in_interpreter():
    """V4's fused HCA / CSA decode steps encode FlashMLA cache rows (kv_cache_dtype="fp8_ds_mla") in the kernel: the
    bytes the torch code's codec writes (bit-equal in the interpreter; the check admits one FP8 step)."""
    assert "all cases pass" in _interpret("cpu", "--quick", "--ds-mla", timeout=300)


def test_tiny_models_generate_the_same_through_the_kernels_in_interpreter():
    assert "engine cases pass" in _interpret("--engine", "deepseek-v4-tiny", "deepseek-v41-tiny", timeout=1800)


# ---- GPU (`pytest -m gpu`, on the device) ------------------------------------------------------------------
gpu = pytest.mark.gpu
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@gpu
@needs_cuda
@pytest.mark.parametrize("width", ["quick", "full"])
def test_gpu_kernels_equal_the_torch_code(width):
    """Every case of tests/sparse_decode_indexer_cases.py on the GPU, bf16 included: full width (64 index heads of 128,
    top-512, head_dim 512, ratios 4 and 128, contexts to 64K, batch 1/32/128) and the quick shapes (integer inputs
    with power-of-two scales: the scores and picks bit-equal, ties included)."""
    from tests.sparse_decode_indexer_cases import run_all, run_ds_mla

    run_all("cuda", width == "quick")
    run_ds_mla("cuda", width == "quick")


def _decode_inputs(g, n: int, B: int = 8) -> dict:
    """Random inputs of every piece for B decode rows over `n` compressed entries each (V4-Flash widths)."""
    dev, H, Di, D, epb = "cuda", 64, 128, 512, 32
    width = -(-n // epb) + 1
    pages = lambda: torch.randperm(B * width, device=dev, generator=g).view(B, width)     # noqa: E731
    rnd = lambda *shape: torch.randn(*shape, device=dev, generator=g)                    # noqa: E731
    pos = torch.randint(0, 4 * n, (B,), device=dev, generator=g) // 128 * 128 + 127        # closing HCA windows
    return dict(q=rnd(B, H, Di).bfloat16(), w=rnd(B, H), index=rnd(B * width + 1, epb, Di).bfloat16(),
                tables=pages(), closed=torch.randint(0, n + 1, (B,), device=dev, generator=g),
                hca_state=torch.stack((rnd(B + 1, 1, D), rnd(B + 1, 1, D).abs() + 1, rnd(B + 1, 1, D)), dim=2),
                hca_rows=rnd(B, 2 * D), hca_cache=rnd(B * width + 1, 1, D).bfloat16(), hca_tables=pages(),
                csa_ring=rnd(B + 1, 8, 4 * D), csa_rows=rnd(B, 4 * D), csa_cache=rnd(B * width + 1, epb, D).bfloat16(),
                v41_ring=rnd(B + 1, 2, 2 * D), v41_rows=rnd(B, 2 * D), v41_keys=rnd(B, Di).bfloat16(),
                v41_ckv=torch.zeros(B * width + 1, 2 * epb, D // 2 + D // 16, dtype=torch.uint8, device=dev),
                v41_cidx=torch.zeros(B * width + 1, 2 * epb, Di // 2 + Di // 32, dtype=torch.uint8, device=dev),
                pos=pos, slots=torch.randperm(B, device=dev, generator=g), n=n,
                inv_freq=torch.rand(Di // 4, device=dev, generator=g), weight=rnd(D).abs() + 0.5)


def _decode_pieces(x: dict, out: dict) -> None:
    """Indexer scores + top-k, V4's HCA and CSA compressor steps and V4.1's KV-source step and index keys (state,
    rings and caches written in place)."""
    from openinfer.layers import triton_compressor, triton_indexer

    inv_freq, weight = x["inv_freq"], x["weight"]
    out["scores"] = triton_indexer.index_scores(x["q"], x["w"], x["index"], x["tables"], x["n"], x["closed"],
                                                128 ** -0.5)
    out["picks"], out["valid"] = triton_indexer.index_topk(out["scores"], 512, x["closed"])
    triton_compressor.v4_hca_decode(x["hca_state"], x["hca_cache"], x["hca_rows"], x["pos"], x["slots"],
                                    x["hca_tables"], weight, 1e-6, inv_freq, 1.0, 128)
    triton_compressor.v4_csa_decode(x["csa_ring"], x["csa_cache"], x["csa_rows"], x["pos"], x["slots"], x["tables"],
                                    None, weight, 1e-6, inv_freq, 1.0, 4)
    out["latents"] = triton_compressor.v41_compress_decode(x["v41_ring"], x["v41_ckv"], x["v41_rows"], x["pos"],
                                                           x["slots"], x["tables"], None, weight, 1e-6, inv_freq, 1.0,
                                                           2, torch.bfloat16)
    triton_compressor.v41_index_keys_decode(x["v41_cidx"], x["v41_keys"], x["pos"], x["tables"], weight[:128], 1e-6,
                                            inv_freq, 1.0, 2)


@gpu
@needs_cuda
def test_gpu_kernels_capture_in_a_graph_and_compile_once_across_contexts():
    """The decode pieces replay from a CUDA graph with their inputs changed in place (no host work inside) and give
    what eager gives; new context sizes (entry counts, table widths, k below index_topk) reuse the compiled
    variants."""
    from openinfer.engine.compile_watch import install_triton_compile_counter, triton_compiles

    assert install_triton_compile_counter()
    g = torch.Generator(device="cuda").manual_seed(0)
    for n in (100, 700, 5000):          # warm: the variants the sizes below meet
        _decode_pieces(_decode_inputs(g, n), {})
    before = triton_compiles()
    for n in (37, 300, 513, 2049, 9000):
        _decode_pieces(_decode_inputs(g, n), {})
    torch.cuda.synchronize()
    assert triton_compiles() == before, "a new context size compiled a new kernel variant"

    static = _decode_inputs(g, 3000)
    out = {}
    _decode_pieces(static, out)         # warm-up outside the graph
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _decode_pieces(static, out)
    fresh = _decode_inputs(g, 3000)
    eager_in = {k: v.clone() if torch.is_tensor(v) else v for k, v in fresh.items()}
    for k, v in fresh.items():
        if torch.is_tensor(v):
            static[k].copy_(v)
    graph.replay()
    eager = {}
    _decode_pieces(eager_in, eager)
    torch.cuda.synchronize()
    for k in ("scores", "picks", "valid", "latents"):
        assert torch.equal(out[k], eager[k]), k
    for k in ("hca_state", "hca_cache", "csa_ring", "csa_cache", "v41_ring", "v41_ckv", "v41_cidx"):
        assert torch.equal(static[k], eager_in[k]), k
