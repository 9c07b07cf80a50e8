"""OutputProcessor: turns sampled tokens into request state and RequestOutputs.

Per new token: append it, record logprobs, detokenize incrementally, then check stop conditions in vLLM's
order (EOS / stop token ids -> stop strings -> max_tokens / max_model_len). A constrained request first
advances its grammar matcher; it stops once the grammar has accepted EOS. Stop strings are searched in
the tail of the text, so one split across token boundaries is still found; the text is cut before it.
"""

from __future__ import annotations

import time

import torch

from openinfer.engine.model_runner import PromptLogprobsChunk, RunnerOutput
from openinfer.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput
from openinfer.request import Request, RequestStatus
from openinfer.sampling_params import RequestOutputKind
from openinfer.tokenizer import Tokenizer


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, max_model_len: int):
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len

    def _position_logprobs(self, token_id: int, logprob: float, rank: int,
                           top_ids: list[int], top_lps: list[float]) -> PositionLogprobs:
        dec = self.tokenizer.id_to_token_text
        d = {tid: Logprob(lp, i + 1, dec(tid)) for i, (tid, lp) in enumerate(zip(top_ids, top_lps))}
        if token_id not in d:
            d[token_id] = Logprob(logprob, rank, dec(token_id))
        return d

    def add_prompt_logprobs(self, req: Request, chunk: PromptLogprobsChunk) -> None:
        n_top = req.sampling_params.prompt_logprobs
        lp = chunk.logprobs
        actual = torch.tensor(chunk.token_ids, device=lp.device)
        actual_lp = lp.gather(-1, actual[:, None]).squeeze(-1)
        ranks = ((lp > actual_lp[:, None]).sum(-1) + 1).tolist()
        top_lp, top_ids = lp.topk(n_top, dim=-1) if n_top > 0 else (None, None)
        if req.prompt_logprobs is None:
            req.prompt_logprobs = [None]
        # positions served from the prefix cache (SamplingParams.prompt_logprobs_start) have no logits
        req.prompt_logprobs.extend([None] * (chunk.first_token_index - len(req.prompt_logprobs)))
        for i, tid in enumerate(chunk.token_ids):
            req.prompt_logprobs.append(self._position_logprobs(
                tid, actual_lp[i].item(), ranks[i],
                top_ids[i].tolist() if n_top else [], top_lp[i].tolist() if n_top else []))

    def process(self, runner_out: RunnerOutput, requests: dict[str, Request], following: RunnerOutput | None = None
                ) -> list[tuple[Request, RequestStatus | None]]:
        """Apply one step's results; returns (request, finish status or None) for each request that got a token.
        `following`: the step queued after this one (async scheduling). A request scheduled there on the guess
        that this step keeps all its drafts, whose drafts were rejected here, computed those rows at positions
        past its real length: they are dropped from `following` (`_drop_guessed_rows`)."""
        for rid, chunk in runner_out.prompt_logprobs.items():
            self.add_prompt_logprobs(requests[rid], chunk)
        touched = []
        if runner_out.sampled is None:
            return touched
        host = runner_out.sampled_on_host()
        lists = {k: (v.tolist() if v is not None else None) for k, v in host.items()}
        token_ids, lps, ranks = lists["token_ids"], lists["logprobs"], lists["ranks"]
        top_ids, top_lps = lists["top_ids"], lists["top_logprobs"]
        now = time.time()
        all_drafts = runner_out.drafts
        for rid, i in runner_out.sample_index.items():
            req = requests.get(rid)
            if req is None or req.status.finished:   # finished or aborted while this step ran: token discarded
                continue
            drafts = all_drafts.get(rid, ()) if all_drafts else ()
            req.num_pending = max(0, req.num_pending - 1 - len(drafts))
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = now
            # Speculative decoding: row j sampled the token after draft j from the target's own distribution;
            # drafts are kept while they equal those samples, and the first differing sample (or the sample
            # after the last draft) follows them. For drafts that are single tokens (not distributions) this is
            # the accept/reject rule exactly: draft x is kept with probability p(x), and a rejection's sample is
            # p without x, renormalised (docs/spec_decode.md).
            accepted = 0
            while accepted < len(drafts) and token_ids[i + accepted] == drafts[accepted]:
                accepted += 1
            if drafts:
                req.metrics.num_draft_tokens += len(drafts)
                req.metrics.num_accepted_tokens += accepted
                full = accepted == len(drafts)
                req.spec_full_accept_rate = 0.5 * req.spec_full_accept_rate + 0.5 * full
                if req.status is RequestStatus.RUNNING:     # (a preempted request recomputes from 0 anyway)
                    # the rejected drafts' KV is stale: the next step recomputes from the first of them
                    req.num_computed_tokens -= len(drafts) - accepted
                    if not full and following is not None:
                        self._drop_guessed_rows(req, following)
            finish = None
            for row in range(i, i + accepted + 1):
                tok = token_ids[row]
                req.output_token_ids.append(tok)
                n_lp = req.sampling_params.logprobs
                if n_lp is not None:
                    req.cumulative_logprob += lps[row]
                    if req.logprobs is None:
                        req.logprobs = []
                    req.logprobs.append(self._position_logprobs(tok, lps[row], ranks[row],
                                                                top_ids[row][:n_lp] if n_lp else [],
                                                                top_lps[row][:n_lp] if n_lp else []))
                finish = self._append_text_and_check_stop(req, tok)
                if finish is not None:
                    break                    # the tokens after a stop inside the accepted run are dropped
            touched.append((req, finish))
        return touched

    @staticmethod
    def _drop_guessed_rows(req: Request, following: RunnerOutput) -> None:
        """`req`'s rows in the next step (already queued) started after this step's drafts, on the guess that all
        would be kept; some were not, so those rows ran at positions past the request's real length: their
        samples are dropped and its computed tokens go back to the end of this step's accepted run (the next
        schedule recomputes from there; the rows' KV lies past the length, where nothing reads it before it is
        overwritten, as a rejected draft's)."""
        rid = req.request_id
        if following.sample_index.pop(rid, None) is None:
            return
        n = 1 + len(following.drafts.pop(rid, ()))
        following.rows.pop(rid, None)
        req.num_computed_tokens -= n
        req.num_pending -= n
        req.metrics.num_guessed_steps_dropped += 1

    def _append_text_and_check_stop(self, req: Request, tok: int) -> RequestStatus | None:
        p = req.sampling_params
        if req.detok_state is None:
            req.detok_state = self.tokenizer.decode_stream(p.skip_special_tokens)
        new_text = self.tokenizer.step_decode(req.detok_state, tok)
        req.output_text += new_text
        num_output = len(req.output_token_ids)
        past_min = num_output >= p.min_tokens
        if req.grammar is not None:
            # the mask only offered tokens the grammar accepts, EOS only in an accepting state
            if not req.grammar.accept(tok):
                req.stop_reason = "grammar rejected the sampled token"
                return RequestStatus.FINISHED_ABORTED
            if req.grammar.terminated:
                return RequestStatus.FINISHED_STOPPED
        if past_min and not p.ignore_eos and tok in req.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED
        if past_min and tok in p.stop_token_ids:
            req.stop_reason = tok
            return RequestStatus.FINISHED_STOPPED
        if past_min and p.stop and new_text:
            text = req.output_text
            search_from = max(0, len(text) - len(new_text) - p.max_stop_len + 1)
            for stop in p.stop:
                idx = text.find(stop, search_from)
                if idx != -1:
                    req.output_text = text[:idx + len(stop)] if p.include_stop_str_in_output else text[:idx]
                    req.stop_reason = stop
                    return RequestStatus.FINISHED_STOPPED
        if ((p.max_tokens is not None and num_output >= p.max_tokens)
                or len(req.prompt_token_ids) + num_output >= self.max_model_len):
            return RequestStatus.FINISHED_LENGTH
        return None

    def make_output(self, req: Request) -> RequestOutput | None:
        """The RequestOutput to report now, per the request's output kind (None: nothing to report)."""
        kind = req.sampling_params.output_kind
        finished = req.status.finished
        if kind is RequestOutputKind.FINAL_ONLY and not finished:
            return None
        text, token_ids, logprobs = req.output_text, req.output_token_ids, req.logprobs
        if kind is RequestOutputKind.DELTA:
            first_report = req.num_sent_tokens == 0
            hold = 0 if finished else max(req.sampling_params.max_stop_len - 1, 0)
            end = max(req.num_sent_chars, len(text) - hold)
            text = text[req.num_sent_chars:end]
            token_ids = token_ids[req.num_sent_tokens:]
            logprobs = logprobs[req.num_sent_tokens:] if logprobs is not None else None
            req.num_sent_chars, req.num_sent_tokens = end, req.num_output_tokens
            prompt_logprobs = req.prompt_logprobs if first_report else None   # sent once, with the first delta
        else:
            token_ids = list(token_ids)
            logprobs = list(logprobs) if logprobs is not None else None
            prompt_logprobs = req.prompt_logprobs
        completion = CompletionOutput(
            index=0, text=text, token_ids=token_ids,
            cumulative_logprob=req.cumulative_logprob if req.sampling_params.logprobs is not None else None,
            logprobs=logprobs, finish_reason=req.status.value if finished else None, stop_reason=req.stop_reason,
            num_draft_tokens=req.metrics.num_draft_tokens, num_accepted_tokens=req.metrics.num_accepted_tokens)
        return RequestOutput(request_id=req.request_id, prompt=req.prompt, prompt_token_ids=req.prompt_token_ids,
                             prompt_logprobs=prompt_logprobs, outputs=[completion], finished=finished,
                             num_cached_tokens=max(req.num_cached_tokens, 0), metrics=req.metrics)
