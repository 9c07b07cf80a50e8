"""benchmarks/deepseek_v41_memory.py: the analytic V4.1 memory report is internally consistent and agrees with the
runner's own accounting (engine/cache_pool.py: CachePool.bytes_per_block / state_bytes, applied to the model's
cache specs)."""

import importlib.util
import json
import math
import types
from pathlib import Path

import pytest
import torch

from openinfer.engine.cache_pool import CachePool
from openinfer.kv_cache.spec import PagedCacheSpec, RequestStateSpec

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "deepseek_v41_memory.py"


def _load():
    spec = importlib.util.spec_from_file_location("deepseek_v41_memory", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def bench():
    mod = _load()
    if not mod.RELEASED_CONFIG.is_file():
        pytest.skip(f"no released DeepSeek-V4.1 config at {mod.RELEASED_CONFIG}")
    return mod


@pytest.fixture(scope="module")
def result(bench, tmp_path_factory):
    out = tmp_path_factory.mktemp("v41mem") / "r.json"
    r = bench.main(["--json", str(out)])
    assert json.loads(out.read_text())["quantized"]["paged_bytes_per_token"] \
        == r["quantized"]["paged_bytes_per_token"]
    return r


def _fake_runner(specs, block_size=128, max_num_seqs=256, snapshots=512):
    ns = types.SimpleNamespace(specs=specs, block_size=block_size, num_state_slots=max_num_seqs,
                               num_state_snapshots=snapshots)
    ns.snapshot_specs = lambda: CachePool.snapshot_specs(ns)
    return ns


@pytest.mark.parametrize("kind", ["quantized", "unquantized_bf16"])
def test_breakdowns_sum_to_totals(result, kind):
    r = result[kind]
    assert math.isclose(sum(d["bytes_per_token"] for d in r["paged"].values()), r["paged_bytes_per_token"])
    assert math.isclose(sum(r["paged_bytes_per_token_by_kind"].values()), r["paged_bytes_per_token"])
    assert math.isclose(sum(d["total"] for d in r["paged_bytes_per_token_by_source_layer"].values()),
                        r["paged_bytes_per_token"])
    assert r["paged_bytes_per_block"] == r["paged_bytes_per_token"] * r["block_size"]
    assert sum(d["bytes"] for d in r["state"].values()) == r["state_bytes_per_request"]
    st = result["vs_spec"]["state_bytes_per_request"]
    assert st["swa"] + st["crows"] + st["ngram"] == result["quantized"]["state_bytes_per_request"] == st["ours_total"]
    swa = result["vs_spec"]["swa_state_bytes"]
    assert swa["encoder_layers_x_our_128_ring"] + swa["decoder_layers_rings"] == swa["ours"]


def test_quantized_below_unquantized(result):
    q, u = result["quantized"], result["unquantized_bf16"]
    assert q["paged_bytes_per_token"] < u["paged_bytes_per_token"]
    assert q["state_bytes_per_request"] < u["state_bytes_per_request"]
    for name in q["paged"]:
        assert q["paged"][name]["bytes_per_block"] < u["paged"][name]["bytes_per_block"]


@pytest.mark.parametrize("quantized", [True, False])
def test_matches_runner_accounting(bench, result, quantized):
    hf, cfg = bench.load_config()
    model = bench.build_meta_model(cfg, bench.engram_layout(cfg), quantized_caches=quantized)
    specs = model.cache_specs(torch.bfloat16)
    runner = _fake_runner(specs)
    r = result["quantized" if quantized else "unquantized_bf16"]
    assert CachePool.bytes_per_block(runner) == r["paged_bytes_per_block"]
    assert CachePool.bytes_per_block(runner) / 128 == r["paged_bytes_per_token"]
    live = sum(s.bytes_per_slot() for s in specs if isinstance(s, RequestStateSpec))
    assert live == r["state_bytes_per_request"]
    snaps = sum(s.bytes_per_slot() for s in CachePool.snapshot_specs(runner))
    assert snaps == r["snapshot_bytes_per_kept_boundary"]
    if quantized:
        assert CachePool.state_bytes(runner) == result["runner_state_default"]["bytes"]
    assert {s.name for s in specs if isinstance(s, PagedCacheSpec)} == set(r["paged"])


def test_spec_comparison(result):
    v = result["vs_spec"]
    assert v["paged_bytes_per_token"]["spec"] == 890 and v["swa_state_bytes"]["spec"] == 1_415_040
    # what the released config gives today; a config or codec change shows up here first
    assert result["quantized"]["paged_bytes_per_token"] == 890
    assert v["paged_bytes_per_token"]["spec_counts_index_keys"]
    assert v["swa_state_bytes"]["spec_reproduced_from_our_row"]
    w = result["weights"]
    assert w["engram_tables"]["equals_meta_model_params"]
    assert sum(w["published_bytes_by_group"].values()) == w["published_total_bytes"]
    assert sum(w["in_memory_bytes_by_dtype"].values()) == w["in_memory_total_bytes"]
    assert result["seconds"] < 10
