from openinfer.benchmarks.prefix import PrefixBenchConfig, run_prefix_bench


def test_bench_prefix_tiny():
    cfg = PrefixBenchConfig(dtype="float32", conversations=2, turns=2, system_tokens=48, turn_tokens=16,
                            max_tokens=4, block_size=16)
    res = run_prefix_bench(cfg, log=lambda s: None)["modes"]
    base = res["no_cache"]["prefill_tokens_computed"]
    assert res["pool"]["prefill_tokens_computed"] < base
    assert res["store_restart"]["prefill_tokens_computed"] < base
    assert res["store_restart"]["cached_tokens_per_turn"][0] > 0
    assert all(r["outputs_match_no_cache"] for r in res.values())
