"""Per-request grammar state and the step's token bitmask.

`GrammarState` rides on a `Request` (`request.grammar`): the future of its compiled grammar, then an
xgrammar `GrammarMatcher` advanced by every token the request emits (the output processor calls
`accept`). The scheduler asks it only one thing, `ready` ("waiting for grammar"). The engine asks the
`StructuredOutputManager` for the step's bitmask: one int32 row of ceil(V/32) words per sampling request
(all ones for unconstrained rows), filled on the host by xgrammar for the rows that need it, which the
sampler applies to the logits in one batched op on the device (`sampling/sampler.py`). The matcher's
stop tokens are allowed only where the grammar accepts, so generation ends by EOS in an accepting state.
"""

from __future__ import annotations

import time
from concurrent.futures import Future

import torch
import xgrammar as xgr

from openinfer.sampling.bitmask import GrammarBitmask
from openinfer.structured_output.compiler import GrammarCompilerPool, GrammarError, GrammarTimeoutError
from openinfer.structured_output.params import StructuredOutputsParams


class GrammarState:
    def __init__(self, params: StructuredOutputsParams, future: Future, timeout_s: float):
        self.params = params
        self.future = future
        self.deadline = time.monotonic() + timeout_s
        self.timeout_s = timeout_s
        self.matcher: xgr.GrammarMatcher | None = None

    @property
    def ready(self) -> bool:
        """Compiled (or failed: the engine retires failed requests before scheduling)."""
        return self.future.done()

    def error(self) -> str | None:
        """Why this request cannot run (a compile error, or the compile timed out), else None."""
        if self.future.done():
            e = self.future.exception()
            return str(e) if e is not None else None
        if time.monotonic() > self.deadline:
            return str(GrammarTimeoutError(f"{self.params.kind} grammar did not compile within {self.timeout_s:g} s"))
        return None

    def wait(self, timeout_s: float) -> None:
        """Block up to `timeout_s` for the compile (the engine, when nothing else can run)."""
        try:
            self.future.exception(timeout=timeout_s)
        except TimeoutError:
            pass

    def _matcher(self) -> xgr.GrammarMatcher:
        if self.matcher is None:
            self.matcher = xgr.GrammarMatcher(self.future.result())
        return self.matcher

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher().fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> bool:
        """Advance by one emitted token; False if the grammar rejects it."""
        return self._matcher().accept_token(token_id)

    def valid_draft_prefix(self, drafts: list[int]) -> int:
        """How many leading drafts the grammar accepts without ending (a draft that would terminate the output
        ends the prefix: the rows after it would have no mask); the matcher is left as it was."""
        m, n = self._matcher(), 0
        for tok in drafts:
            if not m.accept_token(tok):
                break
            n += 1
            if m.is_terminated():
                m.rollback(1)
                n -= 1
                break
        if n:
            m.rollback(n)
        return n

    def fill_bitmask_rows(self, bitmask: torch.Tensor, first_row: int, drafts: list[int]) -> None:
        """Rows first_row + j, j = 0..len(drafts): the allowed tokens after the first j drafts (all of which the
        grammar accepts: `valid_draft_prefix`); the matcher is left as it was."""
        m = self._matcher()
        for j, tok in enumerate(drafts):
            m.fill_next_token_bitmask(bitmask, first_row + j)
            accepted = m.accept_token(tok)
            assert accepted, "drafts must be cut to the grammar's valid prefix before they are scheduled"
        m.fill_next_token_bitmask(bitmask, first_row + len(drafts))
        if drafts:
            m.rollback(len(drafts))

    @property
    def terminated(self) -> bool:
        """A stop token was accepted in an accepting state: the output is complete."""
        return self.matcher is not None and self.matcher.is_terminated()


class StructuredOutputManager:
    def __init__(self, pool: GrammarCompilerPool):
        self.pool = pool
        self.vocab_size = pool.vocab_size

    def new_state(self, params: StructuredOutputsParams) -> GrammarState:
        return GrammarState(params, self.pool.submit(params), self.pool.timeout_s)

    def bitmask(self, requests, drafts: dict[str, list[int]] | None = None) -> GrammarBitmask | None:
        """The next-token masks of the constrained requests among `requests` (those that sample this step),
        filled on the host; None when none is constrained. With speculative decoding (`drafts`: request id ->
        the drafts it verifies) a request gets one row per verify row."""
        constrained = [r for r in requests if r.grammar is not None]
        if not constrained:
            return None
        drafts = drafts or {}
        rows, n = {}, 0
        for r in constrained:
            for j in range(1 + len(drafts.get(r.request_id, ()))):
                rows[(r.request_id, j)] = n
                n += 1
        mask = xgr.allocate_token_bitmask(n, self.vocab_size)   # fresh: copied to the device async
        for r in constrained:
            r.grammar.fill_bitmask_rows(mask, rows[(r.request_id, 0)], drafts.get(r.request_id, []))
        return GrammarBitmask(rows, mask)


__all__ = ["GrammarState", "StructuredOutputManager", "GrammarError"]
