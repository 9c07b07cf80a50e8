"""Speculative decoding on models with per-request state (DeepSeek-V4 and V4.1): a verify step writes its drafts'
rows into the window rings, the compressors' open-window rows, V4's HCA running state and V4.1's Engram look-back,
and the next step starts from the last accepted position. Rolled-back drafts must leave no trace: greedy tokens
and logprobs equal decoding without drafts, the prefix cache registers the same blocks and keeps the same state
snapshots (their rows equal plain decoding's), and a later request restoring a snapshot taken inside a verify step
decodes as a cold engine does (docs/spec_decode.md, "Rolling back DeepSeek state")."""

from __future__ import annotations

import pytest
import torch

from openinfer.config import EngineConfig
from openinfer.engine.llm_engine import LLMEngine
from openinfer.kv_cache.kv_cache_manager import hash_block
from openinfer.kv_cache.spec import RequestStateSpec
from openinfer.sampling_params import SamplingParams
from tests.conftest import assert_pool_idle

K = 4                                    # drafts per step: the rings keep 4 rows of rollback room
PARAMS = SamplingParams(temperature=0, ignore_eos=True, max_tokens=32, logprobs=1)


def prompts_of(*lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 129000, (n,), generator=g).tolist() for n in lengths]


class ScriptedDrafter:
    """Drafts the target's own greedy continuation (read off a plain run), wrong from a position that cycles
    through 0..k (k: all right), so accepted runs of every length and rejections at every depth occur — also runs
    that cross a block or compression-window boundary and rejections just past one."""

    def __init__(self, sequences: list[list[int]], k: int):
        self.sequences, self.k, self.calls = sequences, k, 0

    def propose(self, token_ids, max_drafts=None):
        token_ids = list(token_ids)
        seq = next(s for s in self.sequences if s[:len(token_ids)] == token_ids)
        n = min(self.k, max_drafts or self.k)
        drafts = seq[len(token_ids):len(token_ids) + n]
        wrong = self.calls % (self.k + 1)
        self.calls += 1
        if wrong < len(drafts):
            drafts[wrong] = drafts[wrong] % 128000 + 1           # any other token: the target never picks it
        return drafts, [0.5] * len(drafts)


def _engine(model, spec: bool, **kw) -> LLMEngine:
    opts = dict(model=model, device="cpu", block_size=32, max_num_batched_tokens=64, max_num_seqs=4,
                enable_prefix_caching=True, num_state_snapshots=64,
                speculative_config={"method": "ngram", "num_speculative_tokens": K} if spec else None)
    return LLMEngine(EngineConfig(**{**opts, **kw}))


def _generate(engine, prompts, params=PARAMS):
    ids = [engine.add_request(p, params) for p in prompts]
    done = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
    return [done[i] for i in ids]


def _boundary_rows(engine, snap: int, boundary: int) -> dict[str, torch.Tensor]:
    """A snapshot's rows for the positions before its block boundary, in position order (row p % R of a ring
    of R rows): what a request restoring it reads, whatever rollback room the rings keep."""
    runner = engine.runner
    need = {s.name: s.state_shape[0] for s in runner.model.cache_specs(runner.dtype)
            if isinstance(s, RequestStateSpec)}                      # ring lengths without rollback room
    rows = {}
    for name, layers in runner.snapshots.items():
        ring = torch.stack([t[snap] for t in layers])                # [layers, R, ...]
        pos = torch.arange(max(boundary - need[name], 0), boundary)
        rows[name] = ring[:, pos % ring.shape[1]].float()
    return rows


@pytest.mark.parametrize("model", ["deepseek-v4-tiny", "deepseek-v41-tiny"])
def test_rolled_back_drafts_leave_no_trace(model):
    prompts = prompts_of(45, 70, 33, seed=3)
    plain = _engine(model, spec=False)
    ref = [o.outputs[0] for o in _generate(plain, prompts)]

    spec = _engine(model, spec=True)
    spec.speculator.proposer = ScriptedDrafter([p + r.token_ids for p, r in zip(prompts, ref)], K)
    got = [o.outputs[0] for o in _generate(spec, prompts)]
    for o, r in zip(got, ref):
        assert o.token_ids == r.token_ids
        for a, b, t in zip(o.logprobs, r.logprobs, r.token_ids):
            assert abs(a[t].logprob - b[t].logprob) < 1e-4
    drafted, accepted = sum(o.num_draft_tokens for o in got), sum(o.num_accepted_tokens for o in got)
    assert accepted > 40 and drafted - accepted > 20           # long accepted runs and many rejections
    assert_pool_idle(spec)

    # the prefix cache: the same blocks and the same state snapshots, whose rows equal plain decoding's
    kv_plain, kv_spec = plain.kv_manager, spec.kv_manager
    assert set(kv_spec.pool._cached) == set(kv_plain.pool._cached)
    assert set(kv_spec._snapshots) == set(kv_plain._snapshots)
    boundary_of, bs = {}, kv_plain.block_size
    for seq in (p + r.token_ids for p, r in zip(prompts, ref)):
        h = None
        for i in range(len(seq) // bs):
            h = hash_block(h, seq[i * bs:(i + 1) * bs])
            boundary_of[h] = (i + 1) * bs
    decoded = [h for h in kv_plain._snapshots if boundary_of[h] > 70]      # kept while decoding
    assert len(kv_plain._snapshots) >= 6 and decoded
    for h, snap in kv_plain._snapshots.items():
        a = _boundary_rows(spec, kv_spec._snapshots[h], boundary_of[h])
        b = _boundary_rows(plain, snap, boundary_of[h])
        assert a.keys() == b.keys() and a
        for name in b:
            torch.testing.assert_close(a[name], b[name], atol=1e-4, rtol=1e-4)

    # a second turn restores a snapshot the spec engine kept inside a verify step, and decodes as a cold engine
    turn2 = prompts[1] + ref[1].token_ids[:-1] + [5, 6, 7]
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=12, logprobs=1)
    warm, = _generate(spec, [turn2], params)
    cold, = _generate(_engine(model, spec=False, enable_prefix_caching=False), [turn2], params)
    assert warm.num_cached_tokens == (len(prompts[1]) + len(ref[1].token_ids) - 1) // bs * bs > 70
    assert warm.outputs[0].token_ids == cold.outputs[0].token_ids
    assert_pool_idle(spec)


def test_mtp_drafter_keeps_plain_greedy_and_its_ring_holds_only_accepted_rows():
    """`method: mtp` on deepseek-v4-tiny (one MTP head, chained for 3 drafts): greedy output equals decoding
    without drafts; the head's context gets every accepted position once, in order, never a rejected row; and the
    head's output the last block was drafted from (so its first draft) equals the head run over the whole accepted
    context in one chunk — the rows the chained drafts wrote into its ring left no trace."""
    from openinfer.layers.attention import AttentionMetadata, PrefillChunk

    prompts = prompts_of(37, 52, seed=5)
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=24, logprobs=1)
    ref = [o.outputs[0] for o in _generate(_engine("deepseek-v4-tiny", spec=False), prompts, params)]
    engine = _engine("deepseek-v4-tiny", spec=False, speculative_config={"method": "mtp", "num_speculative_tokens": 3})
    drafter = engine.speculator.features.drafter
    extended: dict[int, list] = {}
    drafted = []
    extend, propose = drafter.extend, drafter.propose

    def logging_extend(slots, positions, features, next_tokens):
        for s, p, f, t in zip(slots.tolist(), positions.tolist(), features, next_tokens.tolist()):
            extended.setdefault(s, []).append((p, f.clone(), t))
        return extend(slots, positions, features, next_tokens)

    def logging_propose(slots, last, nxt):
        d = propose(slots, last, nxt)
        drafted.extend(zip(slots.tolist(), last.tolist(), d.tokens.tolist()))
        return d

    drafter.extend, drafter.propose = logging_extend, logging_propose
    got = [o.outputs[0] for o in _generate(engine, prompts, params)]
    for o, r in zip(got, ref):
        assert o.token_ids == r.token_ids
        for a, b, t in zip(o.logprobs, r.logprobs, r.token_ids):
            assert abs(a[t].logprob - b[t].logprob) < 1e-4
        assert o.num_draft_tokens > 0
    for rows in extended.values():
        assert [p for p, _, _ in rows] == list(range(len(rows)))
    assert_pool_idle(engine)

    # the last block's first draft, recomputed: the head over the whole accepted context in one chunk, in the
    # runner's spare state slot
    model, runner = engine.runner.model, engine.runner
    slot, P, tokens = drafted[-1]
    rows = extended[slot][:P + 1]
    spare = runner.num_state_slots
    meta = AttentionMetadata(block_size=runner.block_size, slot_mapping=torch.zeros(P + 1, dtype=torch.long),
                             prefills=[PrefillChunk(0, P + 1, P + 1, torch.zeros(0, dtype=torch.long),
                                                    runner.block_size, spare)])
    with torch.inference_mode():
        hidden = model.mtp_hidden(0, torch.stack([f for _, f, _ in rows]), torch.tensor([t for _, _, t in rows]),
                                  torch.arange(P + 1), runner.caches, meta)
        assert model.mtp_head(0, hidden[-1:]).argmax(-1).item() == tokens[0]
    torch.testing.assert_close(drafter._newest[slot], hidden[-1], atol=1e-5, rtol=1e-5)
    # the same context as a prompt's chunk, then a verify step that kept all k drafts: its 1 + k rows run as decode
    # rows of one batched call (the random head never has a draft accepted above, so no step had more than one)
    run = 1 + 3
    feats, toks = torch.stack([f for _, f, _ in rows]), torch.tensor([t for _, _, t in rows])
    for part in (slice(0, P + 1 - run), slice(P + 1 - run, P + 1)):
        n = part.stop - part.start
        drafter.extend(torch.full((n,), spare), torch.arange(part.start, part.stop), feats[part], toks[part])
    torch.testing.assert_close(drafter._newest[spare], hidden[-1], atol=1e-5, rtol=1e-5)


def test_preempted_requests_with_drafts_recompute_to_plain_greedy():
    """A pool too small for every request: requests with drafts get preempted and recompute their state (rings
    written again from position 0); greedy output still equals plain decoding's, and the pool ends idle."""
    prompts = prompts_of(45, 70, 33, 52, seed=8)
    ref = [o.outputs[0].token_ids for o in _generate(_engine("deepseek-v4-tiny", spec=False), prompts)]
    engine = _engine("deepseek-v4-tiny", spec=True, num_kv_blocks=7)
    engine.speculator.proposer = ScriptedDrafter([p + r for p, r in zip(prompts, ref)], K)
    got = [o.outputs[0].token_ids for o in _generate(engine, prompts)]
    assert got == ref
    assert engine.scheduler.num_preemptions > 0
    assert_pool_idle(engine)


def test_async_scheduling_with_speculation_on_per_request_state_is_refused_by_name():
    """Under async scheduling a step is scheduled on the guess that the verify step in flight keeps every draft,
    which would advance DeepSeek's state rings past their rollback room: asked for explicitly, the engine refuses at
    start and says why (left to the device's default, speculation on such a model runs synchronously)."""
    with pytest.raises(ValueError, match="keeps per-request state .* runs synchronously"):
        _engine("deepseek-v4-tiny", True, async_scheduling=True)
