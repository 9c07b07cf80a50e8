"""Scheduler: decides *what* runs each step (continuous batching with chunked prefill).

There are no prefill and decode phases: every request has `num_computed_tokens` and wants to reach
`num_tokens` (plus a token still on the device, under async scheduling). Each step first serves running requests (a decode is 1 token, an unfinished prefill takes
what is left of the token budget), then admits waiting requests, prefix-cache hits first subtracted. When
the KV pool runs dry the most recently admitted running request is preempted (its blocks freed, to be
recomputed later; cached blocks usually make that cheap) instead of failing. Sliding-window models' window
group (kv_cache/window_group.py) is a second pool: running dry in either preempts the same way.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from openinfer.engine.cost_model import StepCostModel
from openinfer.kv_cache.bounded_replay import ReplayPlan
from openinfer.kv_cache.kv_cache_manager import KVCacheManager, StateCopies
from openinfer.request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int          # tokens to run this step, starting at request.num_computed_tokens (drafts included)
    block_ids: list[int]
    state_slot: int | None = None
    # speculative decoding: draft tokens run after the request's last token, verified by this step's samples
    draft_token_ids: list[int] = field(default_factory=list)
    # sliding-window models: the request is replaying the end of its prefix hit (kv_cache/bounded_replay.py)
    replay: ReplayPlan | None = None
    # sliding-window models: the window group's table (kv_cache/window_group.py), what the windowed layers read
    window_block_ids: list[int] | None = None

    @property
    def start(self) -> int:
        return self.request.num_computed_tokens

    @property
    def samples(self) -> bool:
        """Whether this step reaches the last token (known or still on the device), so it yields a new one."""
        r = self.request      # (num_tokens_with_pending, spelled out: read per request per step)
        return (r.num_computed_tokens + self.num_new_tokens - len(self.draft_token_ids)
                == len(r.prompt_token_ids) + len(r.output_token_ids) + r.num_pending)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    state_copies: StateCopies = field(default_factory=StateCopies)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, kv_manager: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int | None = None, cost_model: StepCostModel | None = None,
                 step_budget_ms: float | None = None):
        """`cost_model` + `step_budget_ms`: a time budget per step on top of the token budget (cost_model.py):
        decodes are charged first, then each prefill chunk is the largest that fits what is left."""
        self.kv = kv_manager
        self.cost_model, self.step_budget_ms = cost_model, step_budget_ms
        self.max_model_len = max_model_len
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.num_prompt_tokens_computed = 0    # prompt positions run (recomputation after preemption included)

    def add(self, request: Request) -> None:
        if request.prefix_leader is None:   # (a parallel-sampling sibling finds its prompt's blocks in the pool)
            self.kv.prefetch(request)        # with a prefix-KV store: its blocks are read while it waits
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        now = time.time()
        self._time_left = None
        if self.cost_model is not None:
            decodes = [r.num_computed_tokens for r in self.running
                       if r.num_tokens_with_pending - r.num_computed_tokens == 1]
            self._time_left = self.step_budget_ms - self.cost_model.step_cost([(1, c) for c in decodes])
            self._prefill_scheduled = False

        # 1) Running requests, oldest first; preempt from the back when the pool is dry.
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if req.num_pending and (req.spec_wait or self._pending_token_ends(req)):
                # its last token is on the device: nothing to extend, it finishes on read-back (or, speculating,
                # it waits for its verify step's read-back: spec_decode/speculator.py)
                i += 1
                continue
            n = min(req.num_tokens_with_pending - req.num_computed_tokens, budget)
            if n != 1:           # (a decode is neither cut by the time budget nor at a snapshot boundary)
                n = self._snapshot_aligned(req, req.num_computed_tokens,
                                           self._chunk(req.num_computed_tokens, n, share=0.5 if self.waiting else 1.0))
            if n == 0 and self._time_left is not None:
                i += 1           # no time left for its prefill chunk this step
                continue
            drafts = []
            if req.spec_token_ids and n == 1 == req.num_tokens_with_pending - req.num_computed_tokens:
                drafts = req.spec_token_ids[:budget - 1]     # verified after the last token, within the budget
                if drafts and self.kv.allocate_slots(req, 1 + len(drafts), num_drafts=len(drafts)):
                    out.scheduled.append(ScheduledRequest(req, 1 + len(drafts), self.kv.block_ids(req.request_id),
                                                          self.kv.state_slot(req.request_id), drafts,
                                                          window_block_ids=self.kv.window_block_ids(req.request_id)))
                    budget -= 1 + len(drafts)
                    i += 1
                    continue         # no room for the drafts: decode the one token as usual (below)
            while not self.kv.allocate_slots(req, n):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            else:
                out.scheduled.append(ScheduledRequest(req, n, self.kv.block_ids(req.request_id),
                                                      self.kv.state_slot(req.request_id),
                                                      replay=self.kv.replay_plan(req.request_id),
                                                      window_block_ids=self.kv.window_block_ids(req.request_id)))
                budget -= n
                i += 1
                continue
            break  # req itself was preempted: nothing behind it is left

        # 2) Waiting requests, in arrival order, while seats, budget and blocks last. One whose grammar is
        #    still compiling, whose prefix is still being read from the store, or whose prompt a sibling is still
        #    computing (parallel sampling) keeps its place in the queue without holding up those behind it.
        not_ready: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not out.preempted:
            req = self.waiting[0]
            if req.waiting_for_grammar or req.waiting_for_prefix or self.kv.store_read_pending(req):
                not_ready.append(self.waiting.popleft())
                continue
            if req.num_pending:      # preempted with a token still on the device: admit once it is read back
                break
            hits, num_cached = self.kv.get_computed_blocks(req)
            n = self._snapshot_aligned(req, num_cached, self._chunk(num_cached, min(req.num_tokens - num_cached,
                                                                                    budget)))
            if n == 0 and self._time_left is not None:
                break            # no time left for a new prompt this step
            if not self.kv.allocate_slots(req, n, hits):
                break
            self.waiting.popleft()
            req.num_computed_tokens = num_cached
            if req.num_cached_tokens < 0:
                req.num_cached_tokens = num_cached
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = now
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, n, self.kv.block_ids(req.request_id),
                                                  self.kv.state_slot(req.request_id),
                                                  replay=self.kv.replay_plan(req.request_id),
                                                  window_block_ids=self.kv.window_block_ids(req.request_id)))
            budget -= n
        self.waiting.extendleft(reversed(not_ready))
        out.state_copies = self.kv.take_state_copies()
        return out

    def _chunk(self, start: int, n: int, share: float = 1.0) -> int:
        """Tokens to run for a sequence wanting n from `start`: all of them without a time budget; with one,
        a decode (already charged) or the largest prefill chunk whose cost fits `share` of the time left (a
        running prompt leaves half to requests waiting behind it, so a long prompt does not hold short ones
        back for its whole prefill). The step's first prefill chunk gets at least one token, so a budget
        smaller than a decode batch cannot starve prompts."""
        if self._time_left is None or n == 1:
            return n
        q = min(n, self.cost_model.max_tokens(self._time_left * share, start))
        if q == 0 and not self._prefill_scheduled:
            q = 1
        if q:
            self._time_left -= self.cost_model.seq_cost(q, start)
            self._prefill_scheduled = True
        return q

    def _snapshot_aligned(self, req: Request, start: int, n: int) -> int:
        """With state snapshots, a prompt's chunk stops at the prompt's last block boundary so the state
        there can be kept for later requests sharing the prefix (spec 003 §3.2)."""
        if not self.kv.num_state_snapshots or start >= req.num_prompt_tokens:
            return n
        bs = self.kv.block_size
        boundary = (req.num_prompt_tokens - 1) // bs * bs
        return boundary - start if start < boundary < start + n else n

    def _pending_token_ends(self, req: Request) -> bool:
        """Whether the token still on the device reaches max_tokens or max_model_len (known without it)."""
        p = req.sampling_params
        return ((self.max_model_len is not None and req.num_tokens_with_pending >= self.max_model_len)
                or (p.max_tokens is not None and req.num_output_tokens + req.num_pending >= p.max_tokens))

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        req.status = RequestStatus.WAITING
        req.num_computed_tokens = 0
        req.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def update_after_step(self, scheduled: list[ScheduledRequest]) -> None:
        prompt_tokens = 0
        for s in scheduled:
            req, n = s.request, s.num_new_tokens
            start, num_prompt = req.num_computed_tokens, len(req.prompt_token_ids)
            if start < num_prompt:
                prompt_tokens += min(start + n, num_prompt) - start
            req.num_computed_tokens = start + n
        self.num_prompt_tokens_computed += prompt_tokens

    def finish(self, req: Request, status: RequestStatus) -> None:
        """Retire a request (stopped, length or aborted) and return its blocks."""
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status == RequestStatus.WAITING:
            self.waiting.remove(req)
        req.status = status
        self.kv.save_window_state(req)
        self.kv.free(req)
