"""The autoscaling policy (cluster/autoscale.py, spec 003 §2) and the P/D cluster simulator (cluster/simulator.py).
Everything here is pure Python over small simulated traces: the whole file runs in a few seconds."""

import json

import pytest

from openinfer.cluster import autoscale
from openinfer.cluster.autoscale import (OVER_PROVISION, READY_POOL, AutoscaleConfig, DecodeDrain, PoolBounds,
                                         PoolSignals, decide, migration_seconds)
from openinfer.cluster.simulator import (ClusterConfig, WorkloadConfig, h200_llama8b_decode_cost,
                                         h200_llama8b_prefill_cost, simulate)
from openinfer.entrypoints.cli import main

POLICY = AutoscaleConfig(prefill=PoolBounds(1, 10, max_add_per_interval=3, max_remove_per_interval=1),
                         decode=PoolBounds(2, 8, max_add_per_interval=2, max_remove_per_interval=2),
                         scale_in_stabilization_intervals=1)


def signals(demand, quota_use, capacity=100.0):
    return PoolSignals(demand=demand, capacity_per_instance=capacity, quota_use=quota_use)


# ---- policy ---------------------------------------------------------------------------------------------------
def test_scale_in_is_blocked_while_quota_use_is_above_80_percent():
    quiet = decide(POLICY, "prefill", signals(demand=50, quota_use=0.85), online=6)
    assert quiet.needed == 1 and quiet.remove == 0 and quiet.scale_in_blocked
    allowed = decide(POLICY, "prefill", signals(demand=50, quota_use=0.75), online=6)
    assert allowed.remove == 1 and not allowed.scale_in_blocked


def test_bounds_and_rate_limits_hold():
    surge = decide(POLICY, "prefill", signals(demand=10_000, quota_use=1.0), online=2)
    assert surge.needed == 10 and surge.add == 3              # capped at max, then by the per-interval rate
    at_max = decide(POLICY, "prefill", signals(demand=10_000, quota_use=1.0), online=10)
    assert at_max.add == 0 and at_max.remove == 0
    idle = decide(POLICY, "decode", signals(demand=0, quota_use=0.0), online=8)
    assert idle.needed == 2 and idle.remove == 2              # the decode pool's own rate limit
    at_min = decide(POLICY, "decode", signals(demand=0, quota_use=0.0), online=2)
    assert at_min.remove == 0 and at_min.add == 0
    # decode's second dimension: few requests holding much KV still need instances
    kv_bound = PoolSignals(demand=10, capacity_per_instance=100, quota_use=0.5, kv_tokens=3_000_000,
                           kv_capacity_per_instance=800_000)
    assert autoscale.instances_needed(kv_bound, 0.7) == 6


def test_a_scale_in_stays_above_recent_targets():
    policy = AutoscaleConfig(scale_in_stabilization_intervals=3)
    d = decide(policy, "prefill", signals(demand=50, quota_use=0.1), online=5, recent_targets=[1, 5, 2])
    assert d.needed == 1 and d.remove == 0                    # 5 is two intervals ago: still in the window
    d = decide(policy, "prefill", signals(demand=50, quota_use=0.1), online=5, recent_targets=[5, 2, 1])
    assert d.remove == 1                                      # down towards 2, one instance per interval


def test_ready_pool_serves_a_scale_out_first_and_over_provisioning_keeps_spares_online():
    ready = AutoscaleConfig(redundancy=READY_POOL, prefill=PoolBounds(1, 20, 8, 1))
    d = decide(ready, "prefill", signals(demand=700, quota_use=1.0), online=2, ready_available=3)
    assert d.needed == d.target == 10 and d.add_from_ready_pool == 3 and d.add_cold == 5
    over = AutoscaleConfig(redundancy=OVER_PROVISION, over_provision_fraction=0.2, prefill=PoolBounds(1, 20, 8, 1))
    d = decide(over, "prefill", signals(demand=700, quota_use=1.0), online=2, ready_available=3)
    assert d.needed == 10 and d.target == 12 and d.add_from_ready_pool == 0 and d.add_cold == 8
    small = decide(over, "prefill", signals(demand=60, quota_use=0.5), online=2)
    assert small.needed == 1 and small.target == 2 and small.remove == 0     # at least one spare
    with pytest.raises(ValueError):
        AutoscaleConfig(redundancy="hope")


def test_grace_period_then_migration_cost():
    drain = DecodeDrain(instance=3, started_at=100.0, grace_period_s=60.0)
    assert not drain.due(159.9) and drain.due(160.0) and drain.migrate_at == 160.0
    cfg = AutoscaleConfig(kv_bytes_per_token=131_072, migration_bandwidth_bytes_per_s=50e9, migration_latency_s=0.005)
    assert migration_seconds(0, cfg) == pytest.approx(0.005)
    assert migration_seconds(100_000, cfg) == pytest.approx(0.005 + 100_000 * 131_072 / 50e9)
    assert autoscale.pick_drain_victim({0: 500, 1: 100, 2: 100}) == 2


# ---- simulator ---------------------------------------------------------------------------------------------------
def test_default_costs_come_from_the_h200_measurements():
    prefill, decode = h200_llama8b_prefill_cost(), h200_llama8b_decode_cost()
    # held out of the fit: the cold 16,000-token prompt, two chunks, measured 526 ms (BENCHMARKS.md)
    assert prefill.step_cost([(8192, 0)]) + prefill.step_cost([(7808, 8192)]) == pytest.approx(526, rel=0.05)
    for batch, ms in ((1, 4.884), (64, 7.140), (256, 15.067)):     # decode rows at 1K context
        assert decode.step_cost([(1, 1024)] * batch) == pytest.approx(ms, rel=0.05)


DIURNAL = WorkloadConfig(seed=3, duration_s=1800, peak_rate=12, long_fraction=0.2, turns=3)


def test_a_seed_gives_the_same_run_and_every_request_ends():
    cluster = ClusterConfig(prefill_instances=1, decode_instances=1, autoscale=AutoscaleConfig())
    a, b = simulate(DIURNAL, cluster), simulate(DIURNAL, cluster)
    assert a.summary == b.summary and a.timeline == b.timeline
    assert [(r.arrival, r.first_token, r.finish) for r in a.requests] == \
        [(r.arrival, r.first_token, r.finish) for r in b.requests]
    s = a.summary
    assert s["requests"] > 2000 and s["finished"] + s["dropped"] == s["requests"] and s["unfinished"] == 0
    assert s["prefix_hit_rate"] > 0.3                         # later turns hit their previous context
    other = simulate(WorkloadConfig(**{**DIURNAL.__dict__, "seed": 4}), cluster)
    assert other.summary["requests"] != s["requests"]


def test_an_overloaded_cluster_drops_requests_and_counts_them():
    heavy = WorkloadConfig(seed=1, duration_s=300, peak_rate=30, trough_fraction=1.0, long_fraction=0.5)
    s = simulate(heavy, ClusterConfig(prefill_instances=1, decode_instances=1, request_timeout_s=20)).summary
    assert s["dropped"] > 0 and s["finished"] + s["dropped"] == s["requests"] and s["unfinished"] == 0
    assert s["slo_attainment"] < 0.8


def test_autoscaling_uses_fewer_gpu_hours_than_peak_sized_static_at_comparable_slo():
    static = simulate(DIURNAL, ClusterConfig(prefill_instances=3, decode_instances=2)).summary
    auto = simulate(DIURNAL, ClusterConfig(prefill_instances=1, decode_instances=1, autoscale=AutoscaleConfig(
        ready_pool_size=1, cold_start_s=120))).summary
    assert static["slo_attainment"] > 0.97                    # the static split is sized for the peak
    assert auto["gpu_hours_total"] < 0.8 * static["gpu_hours_total"]
    assert auto["slo_attainment"] > static["slo_attainment"] - 0.03
    assert auto["peak_prefill_gpus"] > 1                      # it did scale out for the peak


def test_decode_scale_in_waits_out_the_grace_period_then_migrates_what_is_left():
    long_answers = WorkloadConfig(seed=5, duration_s=900, peak_rate=1.5, long_fraction=0.0,
                                  short_prompt_tokens=(256, 1024), output_tokens=(4000, 8000))
    policy = AutoscaleConfig(interval_s=30, scale_in_stabilization_intervals=1, ready_pool_size=4,
                             decode=PoolBounds(1, 16, 4, 2), grace_period_s=10)
    res = simulate(long_answers, ClusterConfig(prefill_instances=1, decode_instances=1, decode_max_seqs=16,
                                               autoscale=policy))
    s = res.summary
    assert s["migrated_requests"] > 0 and s["migrated_kv_gb"] > 0
    moved = [r for r in res.requests if r.migrations]
    assert len(moved) == s["migrated_requests"] - sum(r.migrations - 1 for r in moved)
    assert all(r.finish is not None and r.generated + 1 == r.output for r in moved)   # no token lost or repeated
    assert s["finished"] == s["requests"]


def test_the_pd_ratio_depends_on_the_workload():
    """Spec (000 §11.1, 004): P:D ≈ 1:1 holds for DeepSeek's traffic, not in general."""
    steady = dict(seed=2, duration_s=900, trough_fraction=1.0, turns=1)
    long_prompts = WorkloadConfig(**steady, peak_rate=6, long_fraction=1.0, long_prompt_tokens=(8192, 16384),
                                  output_tokens=(16, 64))
    long_outputs = WorkloadConfig(**steady, peak_rate=10, long_fraction=0.0, short_prompt_tokens=(128, 512),
                                  output_tokens=(512, 1536))
    cluster = ClusterConfig(prefill_instances=1, decode_instances=1, decode_max_seqs=64,
                            autoscale=AutoscaleConfig(interval_s=30))
    prefill_heavy = simulate(long_prompts, cluster).summary
    decode_heavy = simulate(long_outputs, cluster).summary
    assert prefill_heavy["pd_ratio_gpu_hours"] > 1.5 and decode_heavy["pd_ratio_gpu_hours"] < 0.67
    assert prefill_heavy["slo_attainment"] > 0.9 and decode_heavy["slo_attainment"] > 0.9


def test_cli_simulate_compares_and_writes_json_and_png(tmp_path, capsys):
    rc = main(["simulate", "--compare", "--duration", "600", "--peak-rate", "4", "--prefill", "2", "--decode", "2",
               "--seed", "7", "--out", str(tmp_path), "--name", "t"])
    assert rc == 0
    table = capsys.readouterr().out
    assert "static" in table and "autoscale" in table and "gpu_hours_total" in table
    data = json.loads((tmp_path / "t.json").read_text())
    runs = data["runs"]
    assert set(runs) == {"static", "autoscale"}
    assert runs["static"]["summary"]["requests"] == runs["autoscale"]["summary"]["requests"] > 0
    assert data["coefficients"]["prefill_ms"]["a"] > 0 and data["date"]
    for name in ("t_gpus.png", "t_latency.png"):
        head = (tmp_path / name).read_bytes()[:8]
        assert head == b"\x89PNG\r\n\x1a\n"
