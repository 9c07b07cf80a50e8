"""Speculative decoding through the whole engine (spec_decode/, docs/spec_decode.md): prompt-lookup drafts
verified in one forward per step must change nothing but the speed — greedy tokens, logprobs, stops and the
state left in the KV pool and prefix cache equal decoding without drafts, and sampling keeps the target's
distribution (a chi-square test against the exact next-token distribution, with a drafter built to be wrong)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from openinfer import LLM, SamplingParams
from openinfer.config import EngineConfig
from tests.conftest import assert_pool_idle

TEXT = ("The lighthouse keeper kept a logbook of every ship that passed the northern island, and in spring the "
        "fishing boats came first, painted blue and red.")
PROMPTS = [f"Copy this sentence exactly.\n{TEXT}\nCopy: {TEXT[:40]}",     # copying: drafts get accepted
           "List the numbers: 1, 2, 3, 4, 5, 6, 7, 8,",
           "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
           "Hello"]
NGRAM = {"method": "ngram", "num_speculative_tokens": 4}


def _run(llm, prompts, sp):
    return [o.outputs[0] for o in llm.generate(prompts, sp, use_tqdm=False)]


def _ngram_reference(toks: list[int], k: int, min_n: int, max_n: int):
    """Prompt lookup as spec_decode/ngram.py's docstring defines it, by brute force."""
    L = len(toks)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        follow = [i + n for i in range(L - n) if toks[i:i + n] == toks[L - n:]]
        if follow:
            drafts = toks[follow[-1]:follow[-1] + k]
            conf, alive = [], follow
            for i, d in enumerate(drafts):
                alive = [f for f in alive if f + i < L]
                agree = [f for f in alive if toks[f + i] == d]
                conf.append((len(agree) + 1) / (len(alive) + 2))
                alive = agree
            return drafts, conf
    return [], []


def test_ngram_proposer_equals_brute_force():
    from openinfer.spec_decode.ngram import NgramProposer

    rng = np.random.default_rng(0)
    for _ in range(2000):
        toks = rng.integers(0, rng.choice([2, 3, 6, 50]), rng.integers(0, 50)).tolist()
        k, min_n = int(rng.integers(1, 6)), int(rng.integers(1, 4))
        max_n = int(rng.integers(min_n, 6))
        got = NgramProposer(k, min_n, max_n).propose(np.asarray(toks, dtype=np.int64))
        want = _ngram_reference(toks, k, min_n, max_n) if len(toks) >= min_n + 1 else ([], [])
        assert got[0] == want[0] and np.allclose(got[1], want[1]), (toks, k, min_n, max_n)
        # the `fixed` policy's proposer skips the confidences: same drafts, none computed
        assert NgramProposer(k, min_n, max_n, confidences=False).propose(toks) == (want[0], [])


@pytest.fixture(scope="module")
def plain_greedy(smollm_dir):
    llm = LLM(smollm_dir, device="cpu", dtype="float32", block_size=16)
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=2)
    outs = _run(llm, PROMPTS, sp)
    cached = set(llm.engine.kv_manager.pool._cached)
    llm.shutdown()
    return outs, cached


@pytest.mark.parametrize("engine_kw", [
    {"rounds": 2},                                                        # the second round hits the prefix cache
    {"max_num_batched_tokens": 16},                                       # chunked prompts, drafts cut by the budget
    {"num_kv_blocks": 8, "max_num_seqs": 4},                              # preemption: the pool holds ~2 requests
    {"policy": "confidence", "verify_budget": 3},                         # DSpark's budget split
    # async scheduling: steps scheduled while a verify step is on the device, on the guess that all its drafts
    # are kept (the guessed rows are dropped when not); with chunks + prefix hits, preemption, the budget split
    {"async_scheduling": True, "rounds": 2, "max_num_batched_tokens": 16},
    {"async_scheduling": True, "num_kv_blocks": 8, "max_num_seqs": 4},
    {"async_scheduling": True, "policy": "confidence", "verify_budget": 3},
])
def test_ngram_greedy_equals_plain_greedy(smollm_dir, plain_greedy, engine_kw):
    ref, ref_cached = plain_greedy
    spec = dict(NGRAM)
    for key in ("policy", "verify_budget"):
        if key in engine_kw:
            spec[key] = engine_kw.pop(key)
    rounds = engine_kw.pop("rounds", 1)
    llm = LLM(smollm_dir, device="cpu", dtype="float32", block_size=16, speculative_config=spec, **engine_kw)
    sp = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=2)
    assert llm.engine.async_scheduling == engine_kw.get("async_scheduling", False)
    guessed = dropped = 0
    for _ in range(rounds):
        results = llm.generate(PROMPTS, sp, use_tqdm=False)
        outs = [o.outputs[0] for o in results]
        guessed += sum(o.metrics.num_guessed_steps for o in results)
        dropped += sum(o.metrics.num_guessed_steps_dropped for o in results)
        for o, r in zip(outs, ref):
            assert o.token_ids == r.token_ids
            lp = [d[t].logprob for d, t in zip(o.logprobs, o.token_ids)]
            lr = [d[t].logprob for d, t in zip(r.logprobs, r.token_ids)]
            assert max(abs(a - b) for a, b in zip(lp, lr)) < 1e-3
            assert [sorted(d) for d in o.logprobs] == [sorted(d) for d in r.logprobs]
    # the copy prompt's drafts were verified and kept (8-12 of its 20 tokens; fewest under async with the budget:
    # a guessed step's drafts follow a guessed token, which lowers their confidence)
    assert outs[0].num_accepted_tokens >= 8
    assert sum(o.num_draft_tokens for o in outs) > sum(o.num_accepted_tokens for o in outs)   # and some rejected
    if llm.engine.async_scheduling:     # guesses were made, and some turned out wrong (their rows dropped)
        assert guessed > dropped > 0
    else:
        assert guessed == 0
    assert_pool_idle(llm.engine)
    if "num_kv_blocks" not in engine_kw:
        # rejected drafts (and dropped guessed rows) were never registered: the prefix cache holds exactly the blocks plain decoding left
        assert set(llm.engine.kv_manager.pool._cached) == ref_cached
    else:
        assert llm.engine.scheduler.num_preemptions > 0
    llm.shutdown()


def test_stops_inside_an_accepted_run_match_plain_decoding(smollm_dir):
    """Stop strings, stop token ids, min_tokens and max_tokens land where plain decoding puts them, even when
    they fall inside a run of accepted drafts (the tokens after them are dropped)."""
    params = [SamplingParams(temperature=0, max_tokens=40, stop=["fishing"]),
              SamplingParams(temperature=0, max_tokens=40, stop=[" red"], include_stop_str_in_output=True),
              SamplingParams(temperature=0, max_tokens=7, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=30, min_tokens=20, ignore_eos=False)]
    prompts = [PROMPTS[0]] * len(params)
    outs = {}
    for mode in ("plain", "spec", "spec_async"):
        llm = LLM(smollm_dir, device="cpu", dtype="float32", async_scheduling=mode == "spec_async",
                  speculative_config=NGRAM if mode != "plain" else None)
        ids = llm.tokenizer.encode(" island")
        params_m = params + [SamplingParams(temperature=0, max_tokens=40, stop_token_ids=[ids[-1]])]
        got = _run(llm, prompts + [PROMPTS[0]], params_m)
        outs[mode] = [(o.text, o.token_ids, o.finish_reason, o.stop_reason) for o in got]
        if mode != "plain":
            assert sum(o.num_accepted_tokens for o in got) > 10
        llm.shutdown()
    assert outs["spec"] == outs["plain"] == outs["spec_async"]
    assert outs["plain"][0][2] == "stop" and outs["plain"][0][3] == "fishing"
    assert outs["plain"][2][2] == "length" and len(outs["plain"][2][1]) == 7


def _tiny_checkpoint(path):
    """A 2-layer Llama with a 48-token vocabulary and peaked next-token distributions (real HF weights)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1)
    cfg = LlamaConfig(vocab_size=48, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, eos_token_id=1,
                      tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(40.0)        # a few likely tokens per position, not a flat distribution
    model.save_pretrained(path)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(48)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "t1"}))
    return model


def _cells(observed: np.ndarray, expected: np.ndarray, own: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Cells for a chi-square test: the tokens in `own` one each, all others pooled into one cell."""
    return (np.append(observed[own], observed[~own].sum()), np.append(expected[own], expected[~own].sum()))


def _chi2(observed: np.ndarray, expected: np.ndarray) -> float:
    return float(((observed - expected) ** 2 / expected).sum())


def _chi2_999(df: int) -> float:
    """The chi-square distribution's 0.999 quantile (Wilson-Hilferty; within 1% for df >= 3)."""
    z = 3.0902
    return df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3


class WrongDrafter:
    """A drafter built to be wrong often: proposes the target's second most likely continuation (read off a
    fixed table, not the model), so both accepts and rejects happen."""

    def __init__(self, table: dict[int, int]):
        self.table = table

    def propose(self, token_ids, max_drafts=None):
        k = min(3, max_drafts or 3)
        last, drafts = token_ids[-1], []
        for _ in range(k):
            last = self.table.get(last, 7)
            drafts.append(last)
        return drafts, [0.5] * len(drafts)


def test_speculative_sampling_keeps_the_target_distribution(tmp_path):
    """Chi-square goodness of fit of the 3rd sampled token (sampled in the verify row after an accepted draft, or
    in the next step after a rejected one) against its exact distribution under the target,
    p(t3) = sum over t1, t2 of p(t1) p(t2 | t1) p(t3 | t1, t2), computed with HF transformers on the same weights.
    N = 24,000 samples: over the four likeliest tokens, 1% of the probability mass moved between the two likeliest
    gives a chi-square above the 0.999 quantile (asserted), so a shift that size would not pass."""
    model = _tiny_checkpoint(tmp_path)
    prompt = [3, 9, 4, 17, 22, 5]
    with torch.no_grad():
        p1 = model(torch.tensor([prompt])).logits[0, -1].double().softmax(-1)
        ctx2 = torch.tensor([prompt + [a] for a in range(48)])
        p2 = model(ctx2).logits[:, -1].double().softmax(-1)                       # [t1, t2]
        ctx3 = torch.tensor([prompt + [a, b] for a in range(48) for b in range(48)])
        p3 = model(ctx3).logits[:, -1].double().softmax(-1).view(48, 48, 48)    # [t1, t2, t3]
    exact = torch.einsum("a,ab,abc->c", p1, p2, p3).numpy()
    # deliberately poor drafts: after t1, the target's second likeliest t2 (often wrong, sometimes right)
    second = {a: int(p2[a].argsort(descending=True)[1]) for a in range(48)}
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", max_num_seqs=512, max_num_batched_tokens=8192,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3}, enable_prefix_caching=False)
    llm.engine.speculator.proposer = WrongDrafter(second)
    n = 24000
    params = [SamplingParams(temperature=1.0, max_tokens=3, ignore_eos=True, seed=s) for s in range(n)]
    outs = llm.generate(prompt_token_ids=[prompt] * n, sampling_params=params, use_tqdm=False)
    t3 = np.array([o.outputs[0].token_ids[2] for o in outs])
    drafts = sum(o.outputs[0].num_draft_tokens for o in outs)
    accepted = sum(o.outputs[0].num_accepted_tokens for o in outs)
    # one draft per request (for t2; none can follow t3 within max_tokens=3): accepted, t3 comes from the verify
    # row after it; rejected, from the next step's plain row. Both outcomes happened many times.
    assert drafts == n and 0.02 * n < accepted < 0.98 * n
    counts = np.bincount(t3, minlength=48)
    # every token with an expected count >= 5 its own cell (a chi-square needs that), the rest pooled
    keep = exact * n >= 5
    observed, expected = _cells(counts, exact * n, keep)
    assert _chi2(observed, expected) < _chi2_999(len(expected) - 1), (observed, expected.round(1))
    # the four likeliest tokens, the rest pooled: a test with the power to see 1% of the probability mass
    # moved from the likeliest token to the second (checked on the exact counts so moved)
    top4 = np.zeros(48, dtype=bool)
    top4[np.argsort(exact)[::-1][:4]] = True
    observed, expected = _cells(counts, exact * n, top4)
    assert _chi2(observed, expected) < _chi2_999(len(expected) - 1), (observed, expected.round(1))
    shifted = exact.copy()
    order = np.argsort(exact)[::-1]
    shifted[order[0]] -= 0.01
    shifted[order[1]] += 0.01
    _, moved = _cells(counts, shifted * n, top4)
    assert _chi2(moved, expected) > _chi2_999(len(expected) - 1)
    llm.shutdown()


@pytest.mark.parametrize("spec, match", [
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 17}, "num_speculative_tokens"),
    ({"method": "eagle", "num_speculative_tokens": 1}, "not available"),
    ({"method": "ngram", "num_speculative_tokens": 2, "policy": "best"}, "policy"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, "unknown keys"),
    ({"num_speculative_tokens": 2}, "needs"),
])
def test_bad_speculative_config_is_refused_at_start(spec, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(model="unused", device="cpu", speculative_config=spec)


def test_contradicting_scheduling_flags_are_refused(capsys):
    """`--async-scheduling` asks for async scheduling even with speculation; with `--no-async-scheduling` as well
    the CLI stops and names both, instead of picking one."""
    from openinfer.entrypoints.cli import build_parser

    def flags(*argv):
        return build_parser().parse_args(["serve", *argv]).async_scheduling

    assert (flags(), flags("--async-scheduling"), flags("--no-async-scheduling")) == (None, True, False)
    assert flags("--async-scheduling", "--async-scheduling") is True
    with pytest.raises(SystemExit):
        flags("--async-scheduling", "--no-async-scheduling")
    assert "--async-scheduling and --no-async-scheduling contradict each other" in capsys.readouterr().err


def test_model_drafters_need_their_heads_and_at_most_their_block_size():
    from openinfer.engine.llm_engine import LLMEngine

    with pytest.raises(ValueError, match="DSpark draft stages"):
        LLMEngine(EngineConfig(model="deepseek-v4-tiny", device="cpu",
                               speculative_config={"method": "dspark", "num_speculative_tokens": 1}))
    with pytest.raises(ValueError, match="block size 2"):          # deepseek-v41-tiny drafts blocks of 2
        LLMEngine(EngineConfig(model="deepseek-v41-tiny", device="cpu",
                               speculative_config={"method": "dspark", "num_speculative_tokens": 3}))
    with pytest.raises(ValueError, match="MTP heads"):          # V4.1's `mtp.*` are DSpark stages
        LLMEngine(EngineConfig(model="deepseek-v41-tiny", device="cpu",
                               speculative_config={"method": "mtp", "num_speculative_tokens": 2}))
    with pytest.raises(ValueError, match="exact"):
        EngineConfig(model="unused", device="cpu", v41_prefill_mode="yoco",
                     speculative_config={"method": "dspark", "num_speculative_tokens": 1})


def test_server_with_speculation_streams_plain_greedy_and_counts_drafts(smollm_dir, plain_greedy):
    """`openinfer serve --speculative-config ... --async-scheduling`: the real openai client, streaming, gets plain
    greedy decoding's text while steps are queued on guesses (async scheduling with speculation); /metrics counts
    the drafts verified and kept."""
    import httpx
    import openai

    from tests.live_server import LiveServer

    ref, _ = plain_greedy
    with LiveServer(str(smollm_dir), served_model_name="smollm2", dtype="float32", block_size=16,
                    speculative_config=NGRAM, async_scheduling=True) as s:
        assert s.engine.async_scheduling
        client = openai.OpenAI(base_url=s.base_url + "/v1", api_key="unused")
        stream = client.completions.create(model="smollm2", prompt=PROMPTS[0], max_tokens=20, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        text = "".join(c.choices[0].text for c in stream)
        assert text == ref[0].text
        metrics = httpx.get(s.base_url + "/metrics").text
        values = {line.split("{")[0]: float(line.split()[-1]) for line in metrics.splitlines()
                  if line.startswith("openinfer:spec_decode_num_")}
        assert values["openinfer:spec_decode_num_draft_tokens_total"] >= values[
            "openinfer:spec_decode_num_accepted_tokens_total"] > 8
        assert s.wait_idle()


def test_penalties_and_grammars_with_drafts_match_plain_decoding(smollm_dir):
    """Requests with penalties draft too (each verify row counts the drafts before it as output), and so do
    constrained ones (drafts cut to the prefix the grammar accepts, each row masked by the grammar after the drafts
    before it): greedy outputs equal plain decoding's."""
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "tags": {"type": "array",
              "items": {"type": "string"}}}, "required": ["name", "tags"]}
    prompts = [PROMPTS[0], PROMPTS[0], PROMPTS[2],
               'Reply in JSON. Copy: {"name": "lighthouse", "tags": ["ship", "ship", "ship", "ship"]}\nJSON: ']
    params = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, repetition_penalty=1.3),
              SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, presence_penalty=0.5,
                             frequency_penalty=0.3),
              SamplingParams(temperature=0, max_tokens=24, structured_outputs={"regex": r"    return a \* b\n.*"}),
              SamplingParams(temperature=0, max_tokens=40, structured_outputs={"json": schema})]
    outs = {}
    for mode in ("plain", "spec"):
        llm = LLM(smollm_dir, device="cpu", dtype="float32", speculative_config=NGRAM if mode == "spec" else None)
        got = _run(llm, prompts, params)
        outs[mode] = [(o.text, o.token_ids, o.finish_reason) for o in got]
        if mode == "spec":
            # (the repetition penalty steers away from the copied text: few or no n-gram matches there)
            assert all(o.num_accepted_tokens > 0 for o in got[1:])   # penalties and both grammars kept drafts
        assert_pool_idle(llm.engine)
        llm.shutdown()
    assert outs["spec"] == outs["plain"]
    assert json.loads(outs["plain"][3][0])["name"]


class FailingOnMarker:
    """A drafter that raises for any request whose tokens contain `marker` (a broken drafter on one request)."""

    def __init__(self, inner, marker: int):
        self.inner, self.marker = inner, marker

    def propose(self, token_ids, max_drafts=None):
        if self.marker in token_ids:
            raise RuntimeError("drafter broke on this request")
        return self.inner.propose(token_ids, max_drafts)


def test_a_drafter_failure_disables_speculation_for_that_request_only(smollm_dir, plain_greedy):
    ref, _ = plain_greedy
    llm = LLM(smollm_dir, device="cpu", dtype="float32", block_size=16, speculative_config=NGRAM)
    marker = llm.tokenizer.encode("List the numbers")[0]
    assert marker in llm.tokenizer.encode(PROMPTS[1]) and marker not in llm.tokenizer.encode(PROMPTS[0])
    spec = llm.engine.speculator
    spec.proposer = FailingOnMarker(spec.proposer, marker)
    outs = _run(llm, PROMPTS[:2], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    assert [o.token_ids for o in outs] == [r.token_ids for r in ref[:2]]
    assert outs[0].num_accepted_tokens > 8          # the other request kept drafting
    assert outs[1].num_draft_tokens == 0            # the failing one decoded without drafts
    assert_pool_idle(llm.engine)
    llm.shutdown()
