"""Time-budgeted chunked prefill: the step cost model's fit and solver, calibration on a real (tiny) model, and
the scheduler keeping each step's predicted time within the budget without changing any output."""

from __future__ import annotations

import random

import pytest

from openinfer.config import EngineConfig
from openinfer.engine.cost_model import StepCostModel, calibrate, fit, load_or_calibrate
from openinfer.engine.llm_engine import LLMEngine
from openinfer.sampling_params import SamplingParams
from tests.conftest import assert_pool_idle
from tests.test_models_tiny import make_tiny


def test_fit_recovers_the_coefficients_and_drops_negative_ones():
    true = StepCostModel(a=2e-5, b=3e-6, d=0.01, e=1.5)
    rng = random.Random(0)
    samples = []
    for _ in range(40):
        seqs = [(rng.choice([1, 16, 100, 700]), rng.choice([0, 50, 900])) for _ in range(rng.randint(1, 4))]
        samples.append((seqs, true.step_cost(seqs)))
    got, err = fit(samples)
    for name in "abde":
        assert getattr(got, name) == pytest.approx(getattr(true, name), rel=1e-6)
    assert err < 1e-9
    # data that would want a negative quadratic term: it is dropped, the rest stay non-negative
    lin = [([(q, 0)], 0.5 + 0.02 * q - 1e-7 * q * q) for q in (1, 10, 100, 1000, 2000)]
    model, _ = fit(lin)
    assert model.a == 0 and model.d > 0 and model.e > 0


@pytest.mark.parametrize("coef", [(1e-5, 2e-6, 0.02, 1.0), (0.0, 1e-6, 0.05, 0.3), (0.0, 0.0, 0.1, 0.0)])
def test_max_tokens_is_the_largest_chunk_that_fits(coef):
    m = StepCostModel(*coef)
    for budget in (0.05, 1.0, 7.3, 40.0):
        for c in (0, 128, 5000):
            q = m.max_tokens(budget, c)
            assert m.seq_cost(q, c) <= budget
            assert m.seq_cost(q + 1, c) > budget


def _engine(path, **kw):
    return LLMEngine(EngineConfig(model=str(path), device="cpu", block_size=8, max_num_batched_tokens=256,
                                  num_kv_blocks=400, **kw))


def _run(engine, prompts, observe=None):
    schedule = engine.scheduler.schedule

    def observing():            # the real scheduler's output, recorded; nothing replaced
        out = schedule()
        if observe is not None:
            observe(out)
        return out

    engine.scheduler.schedule = observing
    ids = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)) for p in prompts]
    done = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o.outputs[0].token_ids
    assert_pool_idle(engine)
    return [done[i] for i in ids]


def test_time_budget_bounds_predicted_step_cost_and_keeps_outputs(tmp_path, smollm_dir):
    path, _ = make_tiny(tmp_path, smollm_dir, "llama")
    rng = random.Random(1)
    prompts = [[rng.randrange(10, 40000) for _ in range(n)] for n in (200, 5, 9, 150, 3)]
    expected = _run(_engine(path), prompts)
    engine = _engine(path)
    model = StepCostModel(a=1e-4, b=2e-5, d=0.05, e=0.5)
    engine.scheduler.cost_model, engine.scheduler.step_budget_ms = model, 4.0
    steps = []

    def observe(out):
        seqs = [(s.num_new_tokens, s.start) for s in out.scheduled]
        prefill = [q for q, _ in seqs if q > 1]
        steps.append((model.step_cost(seqs), prefill, len(seqs)))

    assert _run(engine, prompts, observe) == expected
    assert all(cost <= 4.0 or prefill == [1] for cost, prefill, _ in steps if prefill), steps
    # the 200-token prompt was cut into several time-bounded chunks (the token budget alone would take it whole)
    assert max(max(p) for _, p, _ in steps if p) < 200
    assert sum(1 for _, p, _ in steps if p) >= 4


def test_calibration_on_a_real_model_fits_and_is_saved(tmp_path, smollm_dir):
    path, _ = make_tiny(tmp_path, smollm_dir, "llama")
    engine = _engine(path, cache_dir=str(tmp_path / "cache"))
    result = calibrate(engine, prompt_lengths=(8, 64, 200), contexts=(0, 96), repeats=2)
    m = result["model"]
    # timings are noisy on a shared CPU, so nothing here depends on their values: the samples cover the grid
    # (prefill of q over c, then a decode row at c + q; contexts are whole blocks) and the model is their fit
    grid = {(q, c) for q in (8, 64, 200) for c in (0, 96)}
    assert {s[0][0] for s in result["samples"][::2]} == grid
    assert {s[0][0] for s in result["samples"][1::2]} == {(1, c + q) for q, c in grid}
    assert all(ms > 0 for _, ms in result["samples"])
    assert fit(result["samples"])[0] == m and min(m.a, m.b, m.d, m.e) >= 0
    assert_pool_idle(engine)
    # the engine option: calibrated once at start, saved in the cache, loaded the next time
    first = _engine(path, cache_dir=str(tmp_path / "cache2"), prefill_step_budget_ms=50.0)
    assert first.cost_model_path.exists() and first.scheduler.cost_model is not None
    second = _engine(path, cache_dir=str(tmp_path / "cache2"), prefill_step_budget_ms=50.0)
    assert second.scheduler.cost_model == first.scheduler.cost_model
    model, saved = load_or_calibrate(second)
    assert saved == first.cost_model_path and model == first.scheduler.cost_model


def test_bad_budget_is_named():
    with pytest.raises(ValueError, match="prefill_step_budget_ms"):
        EngineConfig(device="cpu", prefill_step_budget_ms=0)
