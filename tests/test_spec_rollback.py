"""Speculative decoding on models with per-request state (DeepSeek-V4 and V4.1): a verify step writes its drafts'
rows into the window rings, the compressors' open-window rows, V4's HCA running state and V4.1's Engram look-back,
and the next step starts from the last accepted position. Rolled-back drafts must leave no trace: greedy tokens
and logprobs equal decoding without drafts, the prefix cache registers the same blocks and keeps the same state
snapshots (their rows equal plain decoding's), and a later request restoring a snapshot taken inside a verify step
decodes as a cold engine does (docs/spec_decode.md, "Rolling back DeepSeek state")."""

from __future__ import annotations

import functools

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

    def __init__(self, sequences: list[list[int]], k: int, vocab_size: int = 128001, wrong_at: int | None = None,
                 wrong_every: int = 1):
        self.sequences, self.k, self.calls, self.vocab_size = sequences, k, 0, vocab_size
        self.wrong_at = wrong_at          # every draft from this depth on wrong (None: one, at a cycling depth)
        self.wrong_every = wrong_every    # only every n-th call may be wrong (the others: all right)

    def propose(self, token_ids, max_drafts=None):
        token_ids = list(token_ids)
        seq = next((s for s in self.sequences if s[:len(token_ids)] == token_ids), None)
        if seq is None:        # async scheduling: a guessed sequence that went wrong (its step will be dropped)
            return [], []
        n = min(self.k, max_drafts or self.k)
        drafts = seq[len(token_ids):len(token_ids) + n]
        wrong = self.calls // self.wrong_every % (self.k + 1) if self.wrong_at is None else self.wrong_at
        if self.calls % self.wrong_every:
            wrong = self.k
        self.calls += 1
        for i in range(wrong, len(drafts) if self.wrong_at is not None else min(wrong + 1, len(drafts))):
            drafts[i] = drafts[i] % (self.vocab_size - 1) + 1   # any other token: the target never picks it
        return drafts, [0.5] * len(drafts)


# V4.1's tiny model is in DeepSeek's published formats, whose W8A8 linears round each activation to FP8 per token
# group. Speculative and plain runs batch rows differently, and the float32 GEMMs then sum in other orders (1e-7);
# where an activation sits near an FP8 rounding midpoint, that moves it one E4M3 step. On an AVX2 CPU (2026-12-03)
# this gave a logprob 1.1e-3 from plain decoding under async scheduling with no draft rejected, against 9.5e-7 with
# the weights dequantized alone (W8A16): batch-shape sensitivity of W8A8, not a trace of rolled-back drafts, which
# would show in W8A16 too. So these engines run W8A16; the caches keep V4.1's FP8/FP4 formats.
MODEL_OPTIONS = {"deepseek-v41-tiny": {"quantize_activations": False}}


def _engine(model, spec: bool, **kw) -> LLMEngine:
    opts = dict(model=model, device="cpu", block_size=32, max_num_batched_tokens=64, max_num_seqs=4,
                enable_prefix_caching=True, num_state_snapshots=64,
                speculative_config={"method": "ngram", "num_speculative_tokens": K} if spec else None,
                **MODEL_OPTIONS.get(model, {}))
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
    for name, layers in runner.pool.snapshots.items():
        ring = torch.stack([t[snap] for t in layers])                # [layers, R, ...]
        pos = torch.arange(max(boundary - need[name], 0), boundary)
        rows[name] = ring[:, pos % ring.shape[1]].float()
    return rows


@functools.cache
def _plain_run(model):
    """Plain decoding of the rollback test's prompts (shared by its sync and async variants; read only)."""
    prompts = prompts_of(45, 70, 33, seed=3)
    plain = _engine(model, spec=False)
    return prompts, plain, [o.outputs[0] for o in _generate(plain, prompts)]


@functools.cache
def _cold_second_turn(model, turn2: tuple[int, ...]):
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=12, logprobs=1)
    cold, = _generate(_engine(model, spec=False, enable_prefix_caching=False), [list(turn2)], params)
    return cold.outputs[0].token_ids


@pytest.mark.parametrize("model,async_scheduling", [("deepseek-v4-tiny", False), ("deepseek-v41-tiny", False),
                                                    ("deepseek-v4-tiny", True), ("deepseek-v41-tiny", True)])
def test_rolled_back_drafts_leave_no_trace(model, async_scheduling):
    """Under async scheduling a step is also queued on the guess that the verify step in flight keeps all its
    drafts (rows at up to 2k + 1 positions past the last accepted one before a rejection is known: the rings keep
    that much room); guesses are both kept and dropped, and the same properties hold."""
    prompts, plain, ref = _plain_run(model)

    spec = _engine(model, spec=True, async_scheduling=async_scheduling)
    assert spec.async_scheduling == async_scheduling
    room = 2 * K + 1 if async_scheduling else K
    for s in spec.runner.cache_specs:
        if isinstance(s, RequestStateSpec):       # every ring: its length without speculation + the room
            plain_len = next(p for p in plain.runner.cache_specs if p.name == s.name).state_shape[0]
            assert s.state_shape[0] in (plain_len + room, plain_len), s.name       # (HCA: 1 + room states)
    assert any(s.state_shape[0] == 1 + room for s in spec.runner.cache_specs if isinstance(s, RequestStateSpec)
               ) or model != "deepseek-v4-tiny"
    # (under async, right more often than not: a request whose drafts are mostly rejected stops drafting but for
    # probes, and guesses are made only while they are mostly kept)
    spec.speculator.proposer = spec.speculator.proposer_ahead = ScriptedDrafter(
        [p + r.token_ids for p, r in zip(prompts, ref)], K, wrong_every=2 if async_scheduling else 1)
    results = _generate(spec, prompts)
    got = [o.outputs[0] for o in results]
    for o, r in zip(got, ref):
        assert o.token_ids == r.token_ids
        for a, b, t in zip(o.logprobs, r.logprobs, r.token_ids):
            assert abs(a[t].logprob - b[t].logprob) < 1e-4
    drafted, accepted = sum(o.num_draft_tokens for o in got), sum(o.num_accepted_tokens for o in got)
    assert accepted > 40 and drafted - accepted > (8 if async_scheduling else 20)   # long runs kept, many rejected
    guessed = sum(o.metrics.num_guessed_steps for o in results)
    dropped = sum(o.metrics.num_guessed_steps_dropped for o in results)
    assert (guessed > dropped > 0) if async_scheduling else guessed == 0
    assert_pool_idle(spec)
    assert not spec.kv_manager._unkeyed

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
    # no snapshot slot leaked: each is keyed or free
    assert len(kv_spec._snapshots) + len(kv_spec._free_snapshots) == kv_spec.num_state_snapshots

    # a second turn restores a snapshot the spec engine kept inside a verify step, and decodes as a cold engine
    turn2 = prompts[1] + ref[1].token_ids[:-1] + [5, 6, 7]
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=12, logprobs=1)
    warm, = _generate(spec, [turn2], params)
    assert warm.num_cached_tokens == (len(prompts[1]) + len(ref[1].token_ids) - 1) // bs * bs > 70
    assert warm.outputs[0].token_ids == _cold_second_turn(model, tuple(turn2))
    assert_pool_idle(spec)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_mtp_drafter_keeps_plain_greedy_and_its_ring_holds_only_accepted_rows(async_scheduling):
    """`method: mtp` on deepseek-v4-tiny (one MTP head, chained for 3 drafts): greedy output equals decoding
    without drafts; the head's context gets every accepted position once, in order, never a rejected row; and the
    head's output the last block was drafted from (so its first draft) equals the head run over the whole accepted
    context in one chunk — the rows the chained drafts wrote into its ring left no trace. Also under async
    scheduling (the head extends and drafts after the next step is queued)."""
    from openinfer.layers.attention import AttentionMetadata, PrefillChunk

    prompts = prompts_of(37, 52, seed=5)
    params = SamplingParams(temperature=0, ignore_eos=True, max_tokens=24, logprobs=1)
    ref = [o.outputs[0] for o in _generate(_engine("deepseek-v4-tiny", spec=False), prompts, params)]
    engine = _engine("deepseek-v4-tiny", spec=False, speculative_config={"method": "mtp", "num_speculative_tokens": 3},
                     async_scheduling=async_scheduling)
    assert engine.async_scheduling == async_scheduling
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
    last = extended[slot][-1][0]         # its newest position (under async a step may extend without drafting)
    rows = extended[slot][:last + 1]
    spare = runner.num_state_slots
    meta = AttentionMetadata(block_size=runner.block_size, slot_mapping=torch.zeros(last + 1, dtype=torch.long),
                             prefills=[PrefillChunk(0, last + 1, last + 1, torch.zeros(0, dtype=torch.long),
                                                    runner.block_size, spare)])
    with torch.inference_mode():
        hidden = model.mtp_hidden(0, torch.stack([f for _, f, _ in rows]), torch.tensor([t for _, _, t in rows]),
                                  torch.arange(last + 1), runner.caches, meta)
        assert model.mtp_head(0, hidden[P:P + 1]).argmax(-1).item() == tokens[0]
    assert last == P or async_scheduling
    torch.testing.assert_close(drafter._newest[slot], hidden[-1], atol=1e-5, rtol=1e-5)
    # the same context as a prompt's chunk, then a verify step that kept all k drafts: its 1 + k rows run as decode
    # rows of one batched call (the random head never has a draft accepted above, so no step had more than one)
    run = 1 + 3
    feats, toks = torch.stack([f for _, f, _ in rows]), torch.tensor([t for _, _, t in rows])
    for part in (slice(0, last + 1 - run), slice(last + 1 - run, last + 1)):
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


def test_under_async_a_request_whose_drafts_are_rejected_drafts_only_to_probe():
    """Under async scheduling a verify step whose successor is not queued on a guess makes its request skip a step;
    a request whose drafts are all rejected therefore stops drafting but for a probe every ASYNC_PROBE_INTERVAL
    steps (decoding plainly in between, overlapped): greedy still equals plain decoding, and each request verified
    a few times, not at every other step."""
    from openinfer.spec_decode.speculator import ASYNC_PROBE_INTERVAL

    prompts, _, ref = _plain_run("deepseek-v4-tiny")
    engine = _engine("deepseek-v4-tiny", spec=True, async_scheduling=True)
    engine.speculator.proposer = engine.speculator.proposer_ahead = ScriptedDrafter(
        [p + r.token_ids for p, r in zip(prompts, ref)], K, wrong_at=0)
    got = [o.outputs[0] for o in _generate(engine, prompts)]
    assert [o.token_ids for o in got] == [r.token_ids for r in ref]
    n = PARAMS.max_tokens
    for o in got:       # two verify steps drop the rate below the bar, then a probe per interval
        assert o.num_accepted_tokens == 0 and K <= o.num_draft_tokens <= K * (3 + n // ASYNC_PROBE_INTERVAL)
    assert_pool_idle(engine)


@pytest.mark.parametrize("guess_right", [True, False])
def test_snapshots_of_a_verify_step_and_the_step_guessed_on_it_both_wait_for_their_hashes(guess_right):
    """Async scheduling with speculation (the KV manager alone; blocks of 4, k = 3): verify step N crosses a
    block boundary, and so does the step queued on the guess that N keeps its drafts, before N is read back. Both
    state copies wait for their block's hash (neither block's tokens are known yet): right guess — both keyed once
    known; wrong — both let go. No snapshot slot is lost either way (one pending copy per request would drop N's)."""
    from openinfer.request import Request
    from openinfer.kv_cache.kv_cache_manager import KVCacheManager
    from openinfer.outputs import RequestMetrics

    kv = KVCacheManager(16, 4, enable_prefix_caching=True, num_state_slots=2, num_state_snapshots=4)
    req = Request("r", list(range(10, 16)), SamplingParams(), RequestMetrics(0.0))       # 6 prompt tokens

    def step(n, drafts=()):
        assert kv.allocate_slots(req, n, num_drafts=len(drafts))
        req.num_computed_tokens += n
        req.num_pending += n
        req.pending_drafts = list(drafts)

    step(6)                                   # the prompt; its sample (position 6) stays on the device
    step(4, [20, 21, 22])                     # N: positions 6..9 (boundary 8), on the guess that 6 is known
    step(4, [23, 24, 25])                     # N + 1 on the guess that N keeps 20, 21, 22: positions 10..13 (12)
    assert [i for i, _ in kv._unkeyed["r"]] == [1, 2] and len(kv._free_snapshots) == 2
    req.num_pending = 8                       # the prompt's sample read back: token 16
    req.output_token_ids.append(16)
    if guess_right:                           # N kept all: tokens to 10 known; then N + 1 all too
        req.output_token_ids += [20, 21, 22, 30]
        req.num_pending = 4
        step(1)
        assert [i for i, _ in kv._unkeyed["r"]] == [2] and len(kv._snapshots) == 1
        req.output_token_ids += [23, 24, 25, 31]
        req.num_pending = 1
        step(1)                               # (to 16: the next boundary's copy waits for its last token)
        assert [i for i, _ in kv._unkeyed["r"]] == [3] and len(kv._snapshots) == 2
    else:                                     # N rejected 20: its sample at 7 follows; N + 1's rows dropped
        req.output_token_ids.append(40)
        req.num_computed_tokens -= 3 + 4
        req.num_pending = 0
        step(1)                               # position 7 again, up to boundary 8: a copy of its own, keyed
        assert "r" not in kv._unkeyed and len(kv._snapshots) == 1 and len(kv._free_snapshots) == 3
    kv.free(req)
    assert len(kv._snapshots) + len(kv._free_snapshots) == 4
