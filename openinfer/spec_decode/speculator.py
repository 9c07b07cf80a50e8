"""Speculator: before each step, the drafts every decoding request will have verified (the host side of
speculative decoding; the runner verifies them in the step's one forward, the output processor keeps what the
target's samples confirm, spec_decode/README in docs/spec_decode.md).

Which requests draft: those decoding (prompt done) whose drafter has not failed on them. Penalties count a
row's preceding drafts as output (sampler.SamplingMetadata.from_requests); a grammar cuts the drafts to the prefix
it accepts and masks each verify row with its state after the drafts before it (structured_output/manager.py).
Draft counts are capped so that no draft runs past max_tokens or max_model_len: the last verified row's sample
must still be a token the request may emit.

Under async scheduling a request's previous step may still be on the device when its next one is scheduled. If
that step verified drafts, the next one is scheduled on the guess that all of them are kept (its first row is the
sample after the last draft, fed from the device; docs/spec_decode.md, "Async scheduling"), and its drafts
continue that guessed sequence: the drafter's continuation past the token still on the device. A request whose
verify steps often reject a draft (`ASYNC_MIN_FULL_ACCEPT`) waits for the read-back instead: its guessed rows
would mostly be dropped. Waiting costs that request a step, so under async scheduling such a request does not
draft at all (it decodes one token per step, overlapped like plain async decoding) except for a probe every
`ASYNC_PROBE_INTERVAL` steps, whose verify step tells whether its drafts are kept again.
"""

from __future__ import annotations

import sys

import numpy as np
import torch

from openinfer.config import SpeculativeConfig
from openinfer.request import Request
from openinfer.spec_decode.feature_proposer import guessed_continuation
from openinfer.spec_decode.ngram import NgramProposer


# Under async scheduling, a request whose verify step is on the device is scheduled on the guess that it keeps all
# its drafts while at least this share of its recent verify steps did (a moving average over steps, halving weight
# per step); below it, the guessed rows would be dropped more often than kept, so it waits for the read-back.
ASYNC_MIN_FULL_ACCEPT = 0.5
# Under async scheduling a request below ASYNC_MIN_FULL_ACCEPT drafts only once per this many steps (a probe): a verify
# step it is not scheduled on a guess after costs it the next step, which plain decoding would have used for a token.
ASYNC_PROBE_INTERVAL = 8


class Speculator:
    def __init__(self, config: SpeculativeConfig, max_model_len: int, max_num_seqs: int, runner=None,
                 async_scheduling: bool = False):
        """`runner`: the engine's model runner (drafters over the target's features need its model, its state
        slots and, for `mtp`, its caches). `async_scheduling`: whether steps are queued before the previous one
        is read back (then requests whose drafts are mostly rejected draft only to probe)."""
        self.config = config
        self.async_scheduling = async_scheduling
        self.k = config.num_speculative_tokens
        self.max_model_len = max_model_len
        self.features = None          # a drafter over the target's features: drafts made after each step
        if config.method == "dspark":
            from openinfer.spec_decode.dspark import DSparkDrafter
            from openinfer.spec_decode.feature_proposer import FeatureProposer

            model = runner.model
            if "dspark" not in model.traits.drafters:
                raise ValueError(f"speculative_config method 'dspark' needs a DeepSeek-V4.1 model with DSpark draft "
                                 f"stages; {type(model).__name__} has none")
            graphs = max_num_seqs if runner.config.use_cuda_graphs else 0      # propose from CUDA graphs
            self.features = FeatureProposer(DSparkDrafter(model, runner.num_state_slots, max_batch=graphs), self.k)
        elif config.method == "draft_head":
            from openinfer.spec_decode.draft_head import DraftHead, DraftHeadDrafter
            from openinfer.spec_decode.feature_proposer import FeatureProposer

            model = runner.model
            if "draft_head" not in model.traits.drafters:
                raise ValueError(f"speculative_config method 'draft_head' runs on Llama-family targets; "
                                 f"{type(model).__name__} is not one")
            head = DraftHead.load(config.draft_model, model.embed_tokens.weight, model.lm_head.weight)
            own = 0 if runner.num_state_slots else 2 * max_num_seqs     # models without state slots: its own map
            graphs = max_num_seqs if runner.config.use_cuda_graphs else 0      # propose from CUDA graphs
            self.features = FeatureProposer(DraftHeadDrafter(head, runner.num_state_slots or own, target=model,
                                                             max_batch=graphs), self.k, num_slots=own)
        elif config.method == "mtp":
            from openinfer.spec_decode.feature_proposer import FeatureProposer
            from openinfer.spec_decode.mtp import MtpDrafter

            graphs = max_num_seqs if runner.config.use_cuda_graphs else 0      # the chain from CUDA graphs
            self.features = FeatureProposer(MtpDrafter(runner.model, runner.caches, runner.block_size, self.k,
                                                       max_batch=graphs, scratch_slot=runner.num_state_slots), self.k)
        else:
            # confidences only where the verify policy reads them
            conf = config.policy == "confidence"
            self.proposer = NgramProposer(self.k, config.prompt_lookup_min, config.prompt_lookup_max, conf)
            # with the token still on the device: one more, its guess leading the continuation
            self.proposer_ahead = NgramProposer(self.k + 1, config.prompt_lookup_min, config.prompt_lookup_max, conf)
        # A prefix hit leaves this many prompt tokens to compute: a drafter whose context ring is its own (draft
        # head, DSpark stages; not the MTP ring, a per-request state restored with the hit) then gets the features
        # of the hit's last W positions instead of starting from an empty ring (W + block_size - 1 more tokens
        # of prefill per hit, for first drafts made with full context).
        self.context_tokens_after_hit = 0
        if config.method in ("draft_head", "dspark"):
            self.context_tokens_after_hit = self.features.drafter.window
        # ngram: each running request's tokens as an int64 array, extended by the new tokens only (a long prompt
        # is not converted again at every step)
        self._token_arrays: dict[str, tuple[Request, np.ndarray, int]] = {}
        self.budget = config.verify_budget or max(1, max_num_seqs * self.k // 2)

    def after_step(self, runner_out, requests) -> None:
        """A step's samples are on the host: a feature drafter extends its context and drafts the next block."""
        if self.features is not None:
            try:
                self.features.after_step(runner_out, requests, wants=self._drafts_next_step)
            except Exception as e:        # drafting stops for the step's requests; the engine goes on
                for rid in runner_out.rows:
                    req = requests.get(rid)
                    if req is not None and not req.spec_disabled:
                        req.spec_disabled = True
                        print(f"[openinfer] drafter failed on request {rid} ({e!r}): speculation off for it",
                              file=sys.stderr, flush=True)

    def _drafts_next_step(self, req: Request) -> bool:
        """Whether `propose` will give `req` drafts at its next step (under async scheduling a request below
        ASYNC_MIN_FULL_ACCEPT drafts only to probe): a feature drafter drafts a block only for those."""
        return self.drafts_allowed(req) and not (
            self.async_scheduling and req.spec_full_accept_rate < ASYNC_MIN_FULL_ACCEPT
            and req.spec_steps_without_drafts < ASYNC_PROBE_INTERVAL - 1)

    @staticmethod
    def _seeded(req: Request) -> bool:
        """A seeded sampling request never runs guessed rows: dropped rows would still draw from its generator, so
        its samples would depend on whether a guess was made (which other requests in the batch decide)."""
        return req.generator is not None and req.sampling_params.temperature > 0

    @staticmethod
    def drafts_allowed(req: Request) -> bool:
        return not req.spec_disabled

    def propose(self, running: list[Request]) -> None:
        """Set spec_token_ids / spec_confidences on every running request (empty where it does not draft)."""
        drafting = []
        for req in running:
            req.spec_token_ids, req.spec_confidences, req.spec_wait = [], [], False
            if req.num_computed_tokens != req.num_tokens_with_pending - 1 or not self.drafts_allowed(req):
                continue
            if req.num_pending and req.pending_drafts and (req.spec_full_accept_rate < ASYNC_MIN_FULL_ACCEPT
                                                           or self._seeded(req)):
                req.spec_wait = True          # its verify step is on the device and likely rejects a draft
                continue
            if not self._drafts_next_step(req):
                req.spec_steps_without_drafts += 1       # decodes plainly: its next step need not wait
                continue
            p = req.sampling_params
            room = self.max_model_len - req.num_tokens_with_pending - 1
            if p.max_tokens is not None:
                room = min(room, p.max_tokens - req.num_output_tokens - req.num_pending - 1)
            if room <= 0:
                continue
            try:
                if self.features is not None:
                    drafts, conf = self.features.propose(req, room)
                elif req.num_pending:         # continue the guessed sequence past the token on the device
                    drafts, conf = self.proposer_ahead.propose(self._token_array(req, req.pending_drafts),
                                                               room + 1)
                    drafts, conf = guessed_continuation(drafts, conf, 0)
                else:
                    drafts, conf = self.proposer.propose(self._token_array(req), room)
            except Exception as e:          # this request decodes without drafts from now on; others go on
                req.spec_disabled = True
                print(f"[openinfer] drafter failed on request {req.request_id} ({e!r}): speculation off for it",
                      file=sys.stderr, flush=True)
                continue
            if drafts and req.grammar is not None:
                # drafts the grammar rejects could never be kept (the mask forbids them): cut them off here
                n = req.grammar.valid_draft_prefix(drafts)
                drafts, conf = drafts[:n], conf[:n]
            if drafts:
                req.spec_token_ids, req.spec_confidences = drafts, conf
                req.spec_steps_without_drafts = 0
                drafting.append(req)
        if len(self._token_arrays) > len(running):     # requests that left
            live = {r.request_id for r in running}
            for rid in [r for r in self._token_arrays if r not in live]:
                del self._token_arrays[rid]
        if self.config.policy == "confidence" and drafting:
            self._apply_confidence_policy(drafting)

    def _token_array(self, req: Request, guessed: list[int] = ()) -> np.ndarray:
        """`req`'s tokens as an int64 array (a view of a buffer kept per request, grown geometrically; a request's
        tokens never change once appended, so only the new ones are copied in), then `guessed` (drafts still being
        verified: written past the known tokens, where the next call's real tokens overwrite them)."""
        owner, buf, have = self._token_arrays.get(req.request_id, (None, None, 0))
        n, total = req.num_tokens, req.num_tokens + len(guessed)
        if owner is not req or have > n:      # (an id reused by a new request starts over)
            buf, have = np.empty(max(2 * total, 256), dtype=np.int64), 0
        elif len(buf) < total:
            grown = np.empty(2 * total, dtype=np.int64)
            grown[:have] = buf[:have]
            buf = grown
        if have < n:
            buf[have:n] = req.token_ids_slice(have, n)
        buf[n:total] = guessed
        self._token_arrays[req.request_id] = (req, buf, n)
        return buf[:total]

    def _apply_confidence_policy(self, reqs: list[Request]) -> None:
        from openinfer.spec_decode.policy import confidence_lengths

        conf = torch.zeros(len(reqs), self.k)
        for i, r in enumerate(reqs):
            conf[i, :len(r.spec_confidences)] = torch.tensor(r.spec_confidences)
        num = torch.tensor([len(r.spec_token_ids) for r in reqs])
        lengths = confidence_lengths(conf, num, self.budget).tolist()
        for r, n in zip(reqs, lengths):
            r.spec_token_ids, r.spec_confidences = r.spec_token_ids[:n], r.spec_confidences[:n]
