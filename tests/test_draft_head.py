"""The trainable DSpark-shaped draft head (spec_decode/draft_head.py, tools/train_draft_head.py) on the real SmolLM2
(CPU, fp32): training on the target's own generations lowers the loss and lengthens accepted runs on prompts it
never saw; the batched ring drafter equals the head's direct forward; save/load round-trips and refuses another
target; and the HF features used for training are exactly openinfer's own residual stream entering those layers."""

from __future__ import annotations

import pytest
import torch

from openinfer.benchmarks.spec import CHAT_QUESTIONS
from openinfer.spec_decode.draft_head import DraftHead, DraftHeadConfig, DraftHeadDrafter, hf_target_features
from openinfer.tools import train_draft_head as train
from tests.conftest import record_drafter_extends

BLOCK, WINDOW = 3, 16


@pytest.fixture(scope="module")
def target(smollm_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(smollm_dir), dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(str(smollm_dir))


@pytest.fixture(scope="module")
def corpora(target):
    """Greedy generations of 11 training and 5 held-out chat questions, featurised (a few seconds)."""
    model, tok = target
    cfg = head_config(model, tok)

    def build(messages):
        seqs = train.generate(model, tok, messages, max_new_tokens=24, batch_size=len(messages))
        return train.Corpus.build(model, seqs, cfg.target_layer_ids, BLOCK, len(seqs), tok.pad_token_id)

    return build(CHAT_QUESTIONS[:11]), build(CHAT_QUESTIONS[11:16])


def head_config(model, tok) -> DraftHeadConfig:
    return DraftHeadConfig.for_target(model.config, noise_token_id=tok.unk_token_id, block_size=BLOCK, window=WINDOW,
                                      intermediate_size=256, markov_rank=32)


def new_head(target, seed=0) -> DraftHead:
    model, tok = target
    torch.manual_seed(seed)
    return DraftHead(head_config(model, tok), model.get_input_embeddings().weight,
                     model.get_output_embeddings().weight)


@pytest.fixture(scope="module")
def trained(target, corpora):
    train_corpus, heldout = corpora
    head = new_head(target)
    untrained = train.evaluate(head, heldout) | {"ce": heldout_ce(head, heldout)}
    history = train.fit(head, train_corpus, steps=40, anchors=16, lr=3e-3, warmup=4, seed=0, log_every=10,
                        log=lambda *_: None)
    return head, history, untrained, train.evaluate(head, heldout) | {"ce": heldout_ce(head, heldout)}


@torch.no_grad()
def heldout_ce(head, corpus) -> float:
    """Teacher-forced cross-entropy of the drafts over every held-out block."""
    return train.block_loss(head, train.block_batch(corpus, corpus.anchors, WINDOW, BLOCK))[1]["ce"].item()


def test_training_lowers_loss_and_lengthens_heldout_accepts(trained):
    head, history, untrained, after = trained
    assert history[-1]["ce"] < history[0]["ce"] - 0.8
    assert after["ce"] < untrained["ce"] - 2.0                     # on prompts it never saw
    assert after["blocks"] == untrained["blocks"] > 80
    # greedy drafting: at least a few more accepted drafts on the held-out blocks than the untrained head's
    assert after["accepted_drafts_per_block"] * after["blocks"] >= untrained["accepted_drafts_per_block"] * \
        untrained["blocks"] + 3
    # calibration moved towards the truth: the first draft's mean confidence is nearer its acceptance rate
    assert abs(after["mean_confidence_by_position"][0] - after["conditional_accept_by_position"][0]) < \
        abs(untrained["mean_confidence_by_position"][0] - untrained["conditional_accept_by_position"][0])


def _window(corpus, b, P):
    """The head's direct-forward inputs for sequence b's context through P (no ring)."""
    positions = torch.arange(P - WINDOW + 1, P + 1)
    valid = positions >= 0
    positions = positions.clamp_min(0)
    return corpus.features[b, positions], positions, valid


def test_ring_drafter_equals_direct_forward(trained, corpora):
    """Three requests in slots 2, 0, 3 with contexts of 41, 9 (< W: the ring is still filling) and 30 positions,
    written by interleaved `extend` calls in uneven pieces, one of them longer than W: `propose` over the rings
    gives the drafts and confidences of the head's forward over each request's last W context rows."""
    head = trained[0]
    corpus = corpora[0]
    requests = [(0, 2, 41), (1, 0, 9), (2, 3, 30)]          # (sequence, slot, context length)
    pieces = {0: [(0, 5), (5, 27), (27, 41)], 1: [(0, 1), (1, 9), (9, 9)], 2: [(0, 20), (20, 21), (21, 30)]}
    drafter = DraftHeadDrafter(head, max_requests=4)
    drafter.reset(torch.tensor([0, 2, 3]))
    for call in range(3):
        slots, positions, features = [], [], []
        for b, slot, _ in requests:
            lo, hi = pieces[b][call]
            slots += [slot] * (hi - lo)
            positions += list(range(lo, hi))
            features.append(corpus.features[b, lo:hi])
        drafter.extend(torch.tensor(slots), torch.tensor(positions), torch.cat(features))
    P = torch.tensor([n - 1 for _, _, n in requests])
    t = torch.stack([corpus.target_next[b, n - 1] for b, _, n in requests])
    ring = drafter.propose(torch.tensor([slot for _, slot, _ in requests]), P, t)
    inputs = [_window(corpus, b, n - 1) for b, _, n in requests]
    direct = head.draft(*(torch.stack(x) for x in zip(*inputs)), P, t)
    assert ring.tokens.shape == (3, BLOCK) and ring.tokens.dtype == torch.long
    assert torch.equal(ring.tokens, direct.tokens)
    torch.testing.assert_close(ring.confidences, direct.confidences, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(ring.scores, direct.scores, rtol=1e-4, atol=1e-4)
    # the drafts are the argmax of their own logits (Markov bias included)
    assert torch.equal(ring.logits.argmax(-1), ring.tokens)


def test_save_load_round_trip_and_target_mismatch(trained, corpora, target, tmp_path):
    head = trained[0]
    model = target[0]
    embed, lm_head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    head.save(tmp_path)
    from safetensors import safe_open

    with safe_open(str(tmp_path / "draft_head.safetensors"), "pt") as f:
        names = set(f.keys())
    assert not any("embed_weight" in n or "lm_head_weight" in n for n in names)   # the target's, not stored
    loaded = DraftHead.load(tmp_path, embed, lm_head)
    assert loaded.cfg == head.cfg
    assert not [n for n, p in loaded.named_parameters() if p.requires_grad]     # frozen for serving
    corpus = corpora[1]
    anchors = corpus.anchors[:16]
    batch = train.block_batch(corpus, anchors, WINDOW, BLOCK)
    args = (batch["features"], batch["positions"], batch["valid"], batch["last_positions"], batch["next_tokens"])
    a, b = head.draft(*args), loaded.draft(*args)
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.confidences, b.confidences)
    with pytest.raises(ValueError, match="hidden_size 576"):
        DraftHead.load(tmp_path, torch.zeros(49152, 64), torch.zeros(49152, 64))
    with pytest.raises(ValueError, match="vocab_size 49152"):
        DraftHead.load(tmp_path, embed[:1000], lm_head[:1000])


def test_hf_features_equal_openinfer_residual_stream(target, llm):
    """`hf_target_features` (HF's hidden_states[i]) equals the residual stream entering openinfer's own Llama
    decoder layer i, read with a forward pre-hook (x + residual, as the layer's fused norm adds them)."""
    model, tok = target
    layers = head_config(model, tok).target_layer_ids
    ids = tok.encode("The draft head reads the residual stream of three layers: early, middle and late, then "
                     "drafts a block of tokens in one pass.")
    hf_feats, hf_next = hf_target_features(model, torch.tensor([ids]), None, layers)
    seen: dict[int, list[torch.Tensor]] = {i: [] for i in layers}

    def hook(i):
        def pre(module, args):
            x, residual = args[0], args[1]
            seen[i].append((x if residual is None else x + residual).detach().clone())
        return pre

    ours = llm.engine.runner.model
    handles = [ours.layers[i].register_forward_pre_hook(hook(i)) for i in layers]
    try:
        from openinfer import SamplingParams

        out = llm.generate(prompt_token_ids=[ids], sampling_params=SamplingParams(max_tokens=1, temperature=0.0),
                           use_tqdm=False)
    finally:
        for h in handles:
            h.remove()
    assert out[0].outputs[0].token_ids == [int(hf_next[0, -1])]
    hidden = model.config.hidden_size
    for k, i in enumerate(layers):
        rows = torch.cat(seen[i])[:len(ids)]
        assert rows.shape == (len(ids), hidden)
        ref = hf_feats[0, :, k * hidden:(k + 1) * hidden]
        assert ((rows - ref).norm() / ref.norm()).item() < 1e-4, f"layer {i}"


def test_engine_drafts_with_the_trained_head_and_keeps_plain_greedy(smollm_dir, trained, tmp_path):
    """`speculative_config={"method": "draft_head", "draft_model": DIR}`: the engine feeds the head openinfer's own
    Llama features of the accepted rows (every position once, in order, never a rejected row), its drafts are
    verified and some kept (on prompts the head trained on), and greedy output equals decoding without drafts. A
    request whose prompt starts with a cached block starts its head context there (its ring reset)."""
    from openinfer import LLM, SamplingParams

    head = trained[0]
    head.save(tmp_path / "head")
    messages = [[{"role": "user", "content": q}] for q in CHAT_QUESTIONS[:4]]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    plain = LLM(smollm_dir, device="cpu", dtype="float32", block_size=16)
    ref = [o.outputs[0].token_ids for o in plain.chat(messages, params, use_tqdm=False)]
    plain.shutdown()
    llm = LLM(smollm_dir, device="cpu", dtype="float32", block_size=16,
              speculative_config={"method": "draft_head", "num_speculative_tokens": BLOCK,
                                  "draft_model": str(tmp_path / "head")})
    drafter = llm.engine.speculator.features.drafter
    extended = record_drafter_extends(drafter)
    outs = [o.outputs[0] for o in llm.chat(messages, params, use_tqdm=False)]
    assert [o.token_ids for o in outs] == ref
    assert sum(o.num_draft_tokens for o in outs) >= 3 * 4 * 5
    assert sum(o.num_accepted_tokens for o in outs) >= 1
    for positions in extended.values():      # from 0, or from a prefix-cache hit's block boundary (shared template)
        assert positions[0] % 16 == 0 and positions == list(range(positions[0], positions[0] + len(positions)))
    assert min(p[0] for p in extended.values()) == 0
    # a hit leaves the head's window of prompt tokens to compute: its ring is full before the first draft
    results = llm.chat(messages, params, use_tqdm=False)            # the same chats again: their prompts hit
    assert [o.outputs[0].token_ids for o in results] == ref
    assert all(o.num_cached_tokens > 0 and len(o.prompt_token_ids) - o.num_cached_tokens >= WINDOW
               for o in results)
    llm.shutdown()
    # async scheduling: a request's next step is queued before its verify step is read back, its drafts the
    # head's block past the token still on the device; greedy output is unchanged and the rings still get every
    # accepted position once, in order
    llm = LLM(smollm_dir, device="cpu", dtype="float32", block_size=16, async_scheduling=True,
              speculative_config={"method": "draft_head", "num_speculative_tokens": BLOCK - 1,
                                  "draft_model": str(tmp_path / "head")})
    assert llm.engine.async_scheduling
    extended = record_drafter_extends(llm.engine.speculator.features.drafter)
    results = llm.chat(messages, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in results] == ref
    assert sum(o.outputs[0].num_draft_tokens for o in results) >= 4 * 5
    assert sum(o.metrics.num_guessed_steps for o in results) > 0
    for positions in extended.values():
        assert positions == list(range(positions[0], positions[0] + len(positions)))
    llm.shutdown()


def test_draft_head_config_errors_are_named(smollm_dir, tmp_path):
    from openinfer.config import EngineConfig

    with pytest.raises(ValueError, match="draft_model"):
        EngineConfig(model="unused", device="cpu",
                     speculative_config={"method": "draft_head", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="draft_model"):
        EngineConfig(model="unused", device="cpu",
                     speculative_config={"method": "ngram", "num_speculative_tokens": 2, "draft_model": "x"})
