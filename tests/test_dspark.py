"""The `dspark` drafter (openinfer/spec_decode/dspark.py) against DeepSeek's reference `forward_spec` (vendored
read-only in ../shared/reference/deepseek_v41), on the small V4.1 model of tests/test_deepseek_v41.py with two
DSpark stages drafting blocks of 4 (the release: 3 stages, blocks of 5), the same weights on both sides, in the
reference's dtype (bf16, float32 heads).

The reference seeds its DSpark window at the prefill (start_pos 0, no drafts) and drafts at every decode step
from the new position's target-layer features; openinfer's drafter takes the same features from openinfer's own
forward (`capture_layers`) and must give the same drafts and the same raw confidence scores, bit for bit."""

from __future__ import annotations

import pytest
import torch

from openinfer.sampling_params import SamplingParams
from openinfer.spec_decode.dspark import DSparkDrafter
from tests.test_deepseek_v4 import run_recording
from tests.test_deepseek_v41 import (GREEDY, WHOLE, _reference, build_reference, prompts_of,
                                     reference_with_own_index_keys, save_published, stable_topk, v41_engine)

BLOCK = 4


@pytest.fixture(scope="module")
def dspark(tmp_path_factory):
    # one intra-op thread: the reference's Python-looped block GEMMs otherwise spend most of their time in OpenMP
    # hand-offs, many times over on a loaded 2-core machine (its README: 14 s vs 0.15 s for one prefill)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ref, args = build_reference(dspark_block_size=BLOCK, max_batch_size=2, n_mtp_layers=2,
                                    compress_ratios=(0, 2, 2, 1, 1, 1, 0, 0))
        published = save_published(ref, args, tmp_path_factory.mktemp("dspark"))
        yield ref, v41_engine(published, dtype="bfloat16")
    finally:
        torch.set_num_threads(threads)


def reference_drafts(ref, prompts: list[list[int]], steps: int):
    """The reference's prefill of equal-length `prompts` (one batch), then `steps` - 1 greedy decode steps each
    followed by `forward_spec`, as its own generate loop would run them: (greedy tokens [b, steps], per step
    (main_hidden, drafts [b, n], raw confidences [b, n])); step 0 is the prefill's main_hidden [b, L, 2 * dim]
    only, the others' main_hidden [b, 2 * dim] is the decoded position's."""
    R, _ = _reference()
    L = len(prompts[0])
    out, tokens = [], []
    with R.set_dtype(torch.bfloat16), stable_topk(), reference_with_own_index_keys():
        ids, _, hidden = ref(torch.tensor(prompts), 0)
        assert ref.forward_spec(ids, hidden, 0) is None
        out.append((hidden, None, None))
        for k in range(steps - 1):
            tokens.append(ids)
            ids, _, hidden = ref(ids[:, None], L + k)
            drafts, _, conf = ref.forward_spec(ids, hidden, L + k)
            assert drafts.shape == (len(prompts), BLOCK + 1) and conf.shape == (len(prompts), BLOCK)
            assert torch.equal(drafts[:, 0], ids)
            out.append((hidden[:, 0], drafts[:, 1:], conf))
    tokens.append(ids)
    return torch.stack(tokens, dim=1), out


def our_run(engine, prompt, max_tokens):
    """openinfer's engine on one prompt (whole-prompt prefill, then decode), keeping each forward's target-layer
    features: (generated tokens, [features of the prefill [L, 2 * dim], then of each decode row [1, 2 * dim]])."""
    model = engine.runner.model
    drafter = DSparkDrafter(model, max_requests=1)
    drafter.enable_capture()
    feats = []
    hook = model.register_forward_hook(lambda m, i, o: feats.append(drafter.features().clone()))
    try:
        (out, _), = run_recording(engine, [prompt], SamplingParams(max_tokens=max_tokens, **GREEDY), budgets=WHOLE)
    finally:
        hook.remove()
        model.capture_layers = ()
    return out.outputs[0].token_ids, feats


@pytest.fixture(scope="module")
def runs(dspark):
    """The reference on a 40-token prompt (longer than the window of 16: the rings wrap) and, as one batch, on
    two 10-token prompts (the rings fill up while drafting); openinfer's engine on the 40-token prompt."""
    ref, engine = dspark
    long_prompt = prompts_of(40, seed=21)[0]
    short_prompts = prompts_of(10, 10, seed=22)
    return dict(engine=engine, ours=our_run(engine, long_prompt, STEPS),
                long=reference_drafts(ref, [long_prompt], STEPS), short=reference_drafts(ref, short_prompts, STEPS))


STEPS = 8


def check(d, drafts, conf):
    assert d.tokens.tolist() == drafts.tolist()
    torch.testing.assert_close(d.scores, conf, atol=0, rtol=0)
    torch.testing.assert_close(d.confidences, torch.sigmoid(conf), atol=0, rtol=0)
    assert ((d.confidences >= 0) & (d.confidences <= 1)).all()
    assert d.logits.shape == (*drafts.shape, 129280)
    assert d.logits.argmax(-1).tolist() == d.tokens.tolist()


def test_drafts_and_confidences_equal_the_reference_forward_spec(runs):
    """One request: openinfer's forward gives the reference's target-layer features (bit for bit), and the
    drafter on them the reference's drafts and raw confidences at every decode step."""
    tokens, feats = runs["ours"]
    ref_tokens, expected = runs["long"]
    L = 40
    assert tokens == ref_tokens[0].tolist()
    assert len(feats) == STEPS and feats[0].shape == (L, 2 * 256)
    torch.testing.assert_close(feats[0], expected[0][0][0], atol=0, rtol=0)
    drafter = DSparkDrafter(runs["engine"].runner.model, max_requests=3)
    slot = torch.tensor([1])
    drafter.extend(slot.expand(L), torch.arange(L), feats[0])
    seen = set()
    for k in range(1, STEPS):
        hidden, drafts, conf = expected[k]
        torch.testing.assert_close(feats[k], hidden, atol=0, rtol=0)
        P = torch.tensor([L + k - 1])
        drafter.extend(slot, P, feats[k])
        d = drafter.propose(slot, P, torch.tensor([tokens[k]]))
        check(d, drafts, conf)
        seen.update(d.tokens.flatten().tolist())
    assert len(seen) > BLOCK          # the drafts depend on the context (not one constant block)


def test_capture_is_off_by_default_and_keeps_nothing(runs):
    model = runs["engine"].runner.model
    assert model.capture_layers == ()
    model.captured = {}
    run_recording(runs["engine"], prompts_of(5, seed=3), SamplingParams(max_tokens=2, **GREEDY))
    assert model.captured == {}
    with pytest.raises(RuntimeError, match="enable_capture"):
        DSparkDrafter(model, max_requests=1).features()


def test_a_batch_at_different_positions_equals_the_reference_per_request(runs):
    """Three requests in one batch, at positions 40.. and 10.. (a ring still filling: its empty slots must not be
    attended), the slots not in batch order; the prompts' contexts written in two mixed `extend` calls (the long
    one wrapping its ring within each), then one `extend` per step: each request's drafts and scores are the
    reference's (which drafts one shared position per batch)."""
    (long_tokens, long_ref), (short_tokens, short_ref) = runs["long"], runs["short"]
    drafter = DSparkDrafter(runs["engine"].runner.model, max_requests=4)
    slots = torch.tensor([2, 0, 3])
    lengths = torch.tensor([40, 10, 10])
    ctx = [long_ref[0][0][0], short_ref[0][0][0], short_ref[0][0][1]]
    for parts in ([(0, 0, 23), (1, 0, 10), (2, 0, 4)], [(2, 4, 10), (0, 23, 40)]):
        drafter.extend(torch.cat([slots[r].expand(b - a) for r, a, b in parts]),
                       torch.cat([torch.arange(a, b) for _, a, b in parts]),
                       torch.cat([ctx[r][a:b] for r, a, b in parts]))
    tokens = torch.cat((long_tokens, short_tokens))
    for k in range(1, STEPS):
        P = lengths + k - 1
        drafter.extend(slots, P, torch.cat((long_ref[k][0], short_ref[k][0])))
        d = drafter.propose(slots, P, tokens[:, k])
        check(d, torch.cat((long_ref[k][1], short_ref[k][1])), torch.cat((long_ref[k][2], short_ref[k][2])))


def test_a_model_without_dspark_stages_is_refused(dspark):
    model = dspark[1].runner.model
    mtp = model.mtp
    model.mtp = torch.nn.ModuleList()
    try:
        with pytest.raises(ValueError, match="no DSpark|has none"):
            DSparkDrafter(model, max_requests=1)
    finally:
        model.mtp = mtp


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_engine_drafts_with_dspark_and_keeps_plain_greedy(dspark, async_scheduling):
    """`speculative_config={"method": "dspark"}` in the engine: greedy output equals decoding without drafts
    (random stages: most drafts are rejected), each request's drafter context gets every accepted position exactly
    once and never a rejected draft's row, and every block it drafted equals a fresh drafter's given that whole
    context in one piece. Also under async scheduling (the next step queued before the drafter reads a step)."""
    from openinfer.config import EngineConfig
    from openinfer.engine.llm_engine import LLMEngine

    path = dspark[1].config.model
    prompts = prompts_of(40, 23, seed=9)
    params = SamplingParams(max_tokens=10, logprobs=0, **GREEDY)
    ref = [o.outputs[0] for o, _ in run_recording(dspark[1], prompts, params)]      # the plain engine
    engine = LLMEngine(EngineConfig(model=str(path), device="cpu", dtype="bfloat16", block_size=32,
                                    max_num_batched_tokens=64, enable_prefix_caching=False,
                                    async_scheduling=async_scheduling,
                                    speculative_config={"method": "dspark", "num_speculative_tokens": BLOCK}))
    assert engine.async_scheduling == async_scheduling
    proposer = engine.speculator.features
    drafter = proposer.drafter
    extended: dict[int, list] = {}            # slot -> [(position, features row)]
    drafted = []                              # (slot, P, next token, drafts)
    extend, propose = drafter.extend, drafter.propose

    def logging_extend(slots, positions, features):
        for s, p, f in zip(slots.tolist(), positions.tolist(), features):
            extended.setdefault(s, []).append((p, f.clone()))
        return extend(slots, positions, features)

    def logging_propose(slots, last, nxt):
        d = propose(slots, last, nxt)
        drafted.extend(zip(slots.tolist(), last.tolist(), nxt.tolist(), d.tokens.tolist()))
        return d

    drafter.extend, drafter.propose = logging_extend, logging_propose
    ids = [engine.add_request(p, params) for p in prompts]
    done = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o.outputs[0]
    for rid, r in zip(ids, ref):
        assert done[rid].token_ids == r.token_ids
        assert done[rid].num_draft_tokens > 0
    for slot, rows in extended.items():
        assert [p for p, _ in rows] == list(range(len(rows)))     # in order, once each, nothing rolled back
    assert len(drafted) >= 2 * len(prompts)
    fresh = DSparkDrafter(engine.runner.model, max_requests=1)
    for slot, P, nxt, tokens in drafted[-3:]:
        rows = extended[slot][:P + 1]
        fresh.reset(torch.tensor([0]))
        fresh.extend(torch.zeros(P + 1, dtype=torch.long), torch.arange(P + 1), torch.stack([f for _, f in rows]))
        assert fresh.propose(torch.tensor([0]), torch.tensor([P]), torch.tensor([nxt])).tokens[0].tolist() == tokens
