"""Request: the plain state of one request as it crosses engine, scheduler, KV manager and runner."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from openinfer.multimodal import ImageSpan
from openinfer.outputs import PositionLogprobs, RequestMetrics
from openinfer.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self is not RequestStatus.WAITING and self is not RequestStatus.RUNNING   # identity: Enum hashing is slow


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    metrics: RequestMetrics
    prompt: str | None = None
    eos_token_ids: frozenset[int] = frozenset()
    # images of the prompt, in order (multimodal.py): their spans' rows take the model's image embeddings
    images: tuple[ImageSpan, ...] = ()
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    # Tokens whose KV is in the cache (or scheduled to be written this step).
    num_computed_tokens: int = 0
    # Tokens sampled on the device but not yet read back (async scheduling): 1 for a decode in flight; a verify
    # step in flight counts 1 + its drafts, as if all were accepted (docs/spec_decode.md, "Async scheduling")
    num_pending: int = 0
    # Prompt tokens found in the prefix cache at first scheduling (-1: not scheduled yet).
    num_cached_tokens: int = -1
    # Per-request RNG when the request carries a seed: same seed => same samples, whatever the batch.
    generator: torch.Generator | None = None
    # Hash chain of full blocks of all_token_ids, extended as tokens arrive (KV manager fills it).
    block_hashes: list[bytes] = field(default_factory=list)
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float = 0.0
    stop_reason: int | str | None = None
    # Detokenizer state, owned by the output processor.
    output_text: str = ""
    detok_state: object = None
    # What has been reported so far (DELTA outputs).
    num_sent_tokens: int = 0
    num_sent_chars: int = 0
    # Structured output: the compiled grammar's future, then its matcher (structured_output/manager.py).
    grammar: object = None
    # Parallel sampling (n > 1): the sibling computing the shared prompt. This request waits (without holding up
    # the queue) until that prompt has been scheduled whole, then finds its full blocks in the prefix cache.
    prefix_leader: "Request | None" = None
    # Speculative decoding: drafts to verify in the next step (after the last token) and their confidences;
    # spec_disabled after a drafter failure on this request (it then decodes one token per step)
    spec_token_ids: list[int] = field(default_factory=list)
    spec_confidences: list[float] = field(default_factory=list)
    spec_disabled: bool = False
    # Speculation under async scheduling: the drafts of the verify step still on the device (valid while
    # num_pending > 0); how often this request's verify steps kept every draft (a moving average, 1 at start);
    # whether it waits for its verify step to be read back instead of being scheduled on the guess that all
    # drafts are kept (set by the speculator each step); steps since it last drafted while that rate was low
    # (under async it then drafts only every ASYNC_PROBE_INTERVAL steps, spec_decode/speculator.py)
    pending_drafts: list[int] = field(default_factory=list)
    spec_full_accept_rate: float = 1.0
    spec_wait: bool = False
    spec_steps_without_drafts: int = 0

    @property
    def waiting_for_grammar(self) -> bool:
        """Its grammar is still compiling: the scheduler leaves it queued and admits others."""
        return self.grammar is not None and not self.grammar.ready

    @property
    def waiting_for_prefix(self) -> bool:
        """Its prompt is being computed by `prefix_leader`: the scheduler admits it once that is done (or the
        leader has finished: it then computes what the prefix cache no longer holds itself)."""
        leader = self.prefix_leader
        if leader is None:
            return False
        if leader.is_finished or leader.num_computed_tokens >= leader.num_prompt_tokens:
            self.prefix_leader = None
            return False
        return True

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens_with_pending(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending

    @property
    def num_unconfirmed_drafts(self) -> int:
        """Drafts of the verify step still on the device (async scheduling): num_computed_tokens counts them as
        kept, so it may fall back by this many when that step is read back."""
        return len(self.pending_drafts) if self.num_pending else 0

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        """all_token_ids[start:end] without concatenating the whole list."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p:end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - p]

    @property
    def is_finished(self) -> bool:
        return self.status.finished
