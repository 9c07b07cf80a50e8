"""Parallel sampling (`SamplingParams.n` > 1): one request, n sequences from one prompt.

`LLMEngine.add_request` turns a request with n > 1 into n child requests (ids `<id>#<i>`), each with n = 1: child i
samples with seed + i when the request has a seed (so choice 0 is what n = 1 would give, and a seeded request is
reproducible choice by choice) and only child 0 computes prompt_logprobs. Child 0 computes the prompt; the others
wait in the queue (`Request.prefix_leader`: they hold up nobody) until child 0's prompt has been scheduled whole,
then find its full blocks in the prefix cache and compute only the tail: the last partial block, or with a prompt
that fills its last block exactly, that block (a hit leaves at least one token to compute: it yields the logits). So
the prompt is computed once plus n - 1 tails of at most `block_size` tokens, and the children's tables share the
prompt's full blocks (reference counted: freed when the last child lets go). Models with per-request state restore
it from the snapshot at the hit's last block, as for any prefix hit. Without prefix caching each child computes
the whole prompt.

`ParentRequest` folds the children's outputs into the request's: `RequestOutput.outputs[i]` is child i's
`CompletionOutput` (`index` i); FINAL_ONLY reports once all n are done, DELTA reports the children that moved this
step, CUMULATIVE every child's output so far; `finished` once every child has finished; the prompt's fields
(prompt_logprobs, num_cached_tokens) are child 0's. Aborting the request aborts every child.
"""

from __future__ import annotations

import dataclasses

from openinfer.outputs import CompletionOutput, PositionLogprobs, RequestMetrics, RequestOutput
from openinfer.sampling_params import RequestOutputKind, SamplingParams


def child_request_id(request_id: str, index: int) -> str:
    return f"{request_id}#{index}"


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """Child `index`'s sampling params: one sequence, its own seed, the prompt's logprobs computed by child 0 only."""
    kw = dict(n=1)
    if params.seed is not None:
        kw["seed"] = params.seed + index
    if index:
        kw.update(prompt_logprobs=None, prompt_logprobs_start=0)
    return dataclasses.replace(params, **kw)


class ParentRequest:
    def __init__(self, request_id: str, n: int, kind: RequestOutputKind):
        self.request_id = request_id
        self.kind = kind
        self.child_ids = [child_request_id(request_id, i) for i in range(n)]
        self.index = {cid: i for i, cid in enumerate(self.child_ids)}
        self.latest: dict[int, CompletionOutput] = {}
        self.done: set[int] = set()
        self.prompt_logprobs: list[PositionLogprobs | None] | None = None
        self.num_cached_tokens = 0
        self.metrics: RequestMetrics | None = None     # child 0's
        self.end_time: float | None = None             # when the last child to finish finished

    @property
    def n(self) -> int:
        return len(self.child_ids)

    @property
    def finished(self) -> bool:
        return len(self.done) == self.n

    def merge(self, child_outputs: list[RequestOutput]) -> RequestOutput | None:
        """This parent's output from its children's outputs of one step (None: nothing to report yet)."""
        moved: list[CompletionOutput] = []
        first = None
        step_prompt_logprobs = None
        for out in child_outputs:
            i = self.index[out.request_id]
            first = first or out
            c = out.outputs[0]          # (made for this report: ours to renumber)
            c.index = i
            moved.append(c)
            self.latest[i] = c
            if out.finished:
                self.done.add(i)
            if i == 0:
                self.num_cached_tokens = out.num_cached_tokens
                self.metrics = out.metrics
                if out.prompt_logprobs is not None:
                    self.prompt_logprobs = step_prompt_logprobs = out.prompt_logprobs
            if out.finished and out.metrics is not None and out.metrics.finished_time is not None:
                self.end_time = max(self.end_time or 0.0, out.metrics.finished_time)
        if first is None:
            return None
        finished = self.finished
        if self.kind is RequestOutputKind.FINAL_ONLY:
            if not finished:
                return None
            outputs, prompt_logprobs = [self.latest[i] for i in sorted(self.latest)], self.prompt_logprobs
        elif self.kind is RequestOutputKind.DELTA:
            outputs, prompt_logprobs = sorted(moved, key=lambda c: c.index), step_prompt_logprobs
        else:
            outputs, prompt_logprobs = [self.latest[i] for i in sorted(self.latest)], self.prompt_logprobs
        metrics = self.metrics or first.metrics
        if finished and metrics is not None and self.end_time is not None:   # the request ends with its last child
            metrics = dataclasses.replace(metrics, finished_time=self.end_time)
        return RequestOutput(request_id=self.request_id, prompt=first.prompt, prompt_token_ids=first.prompt_token_ids,
                             prompt_logprobs=prompt_logprobs, outputs=outputs, finished=finished,
                             num_cached_tokens=self.num_cached_tokens, metrics=metrics)
