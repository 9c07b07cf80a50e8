"""`openinfer bench structured` on a tiny setting with the real SmolLM2: every structured output validates, the
ratios are taken against `none` at the same concurrency, a cached grammar is a cache hit (no new compile) and
faster than the cold compile, and every token of a constrained request was sampled under a mask row."""

from __future__ import annotations

import pytest
import torch

from openinfer.benchmarks.structured import StructuredBenchConfig, run_structured_bench

SMALL_SCHEMA = {"type": "object", "properties": {"a": {"enum": ["yes", "no"]},
                                                 "n": {"type": "integer", "minimum": 0, "maximum": 9}},
                "required": ["a", "n"]}
DATE = r"20[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"


def test_bench_structured_tiny(smollm_dir):
    cfg = StructuredBenchConfig(model=str(smollm_dir), device="cpu", dtype="float32", concurrency=(2,),
                                modes=("none", "json_schema", "regex"), max_tokens=16, min_requests=1,
                                schema=SMALL_SCHEMA, regex=DATE, threads=1, warmup_tokens=2)
    threads = torch.get_num_threads()
    try:
        result = run_structured_bench(cfg, log=lambda s: None)
    finally:
        torch.set_num_threads(threads)
    rows = {(r["mode"], r["concurrency"]): r for r in result["rows"]}
    assert set(rows) == {(m, c) for m in cfg.modes for c in cfg.concurrency}
    for (mode, c), r in rows.items():
        assert r["num_requests"] == c and r["output_tokens"] > 0
        if mode == "none":
            assert "valid" not in r and r["mask_rows"] == 0 and "tok_per_s_vs_none" not in r
            continue
        # the grammar closes well within max_tokens: every output ends by EOS and validates
        assert r["valid"] == c and r["finished_length"] == 0 and r["invalid_not_length"] == 0, r
        assert r["finish_reasons"] == {"stop": c}
        # one mask row per sampled token (the first one from prefill included), filled on the host
        assert r["mask_rows"] == r["output_tokens"] and r["mask_fill_us_per_row"] > 0
        assert r["mask_apply_us_per_call"] is not None          # CPU: the apply is timed too
        base = rows[("none", c)]
        assert r["tok_per_s_vs_none"] == pytest.approx(r["output_tok_per_s"] / base["output_tok_per_s"])
        assert r["tpot_vs_none"] == pytest.approx(r["tpot_ms"] / base["tpot_ms"])
    assert result["valid"] == result["structured_outputs"] == 4
    # one fresh pool per engine: cold = a compile, cached = a cache hit, much faster
    assert [c["concurrency"] for c in result["compile"]] == [2]
    for comp in result["compile"]:
        assert set(comp) == {"pool_setup_ms", "json_schema", "regex", "concurrency"}
        for mode in ("json_schema", "regex"):
            t = comp[mode]
            assert t["compiles_cold"] == 1 and t["compiles_cached"] == 0, t
            assert t["compile_ms"] > 0 and t["cached_ms"] < t["cold_ms"], t
