"""What the engine hands back: RequestOutput / CompletionOutput / Logprob, in vLLM's shape."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None          # 1 = most likely
    decoded_token: str | None = None


# One dict per position: {token_id: Logprob}; the actual token is always present.
PositionLogprobs = dict[int, Logprob]


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    num_draft_tokens: int = 0             # speculative decoding: drafts verified, and how many were kept
    num_accepted_tokens: int = 0
    # speculation under async scheduling: steps scheduled while the request's verify step was still on the
    # device (on the guess that it keeps all its drafts), and those dropped because it did not
    num_guessed_steps: int = 0
    num_guessed_steps_dropped: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[PositionLogprobs] | None
    finish_reason: str | None = None     # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    num_draft_tokens: int = 0             # speculative decoding: drafts verified, and how many were kept
    num_accepted_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: list[PositionLogprobs | None] | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = field(default=None, repr=False)

    def followed_by(self, later: "RequestOutput") -> "RequestOutput":
        """This DELTA output and the next one of the same request, as one DELTA output: what a consumer that fell
        behind reads (texts, tokens and logprobs joined per choice; status, counts and metrics the later's; the
        prompt logprobs, sent with the first delta, kept)."""
        joined = {c.index: c for c in self.outputs}
        for c in later.outputs:
            before = joined.get(c.index)
            if before is None:
                joined[c.index] = c
                continue
            logprobs = None if before.logprobs is None and c.logprobs is None else \
                [*(before.logprobs or ()), *(c.logprobs or ())]
            joined[c.index] = CompletionOutput(c.index, before.text + c.text, before.token_ids + c.token_ids,
                                               c.cumulative_logprob, logprobs, c.finish_reason, c.stop_reason,
                                               c.num_draft_tokens, c.num_accepted_tokens)
        return RequestOutput(later.request_id, later.prompt, later.prompt_token_ids,
                             self.prompt_logprobs if self.prompt_logprobs is not None else later.prompt_logprobs,
                             [joined[i] for i in sorted(joined)], later.finished, later.num_cached_tokens,
                             later.metrics)
