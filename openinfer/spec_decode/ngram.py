"""Prompt-lookup drafting (the `ngram` drafter): no weights, any model.

The last n tokens (n from prompt_lookup_max down to prompt_lookup_min) are searched for earlier in the request's
own tokens; the tokens that followed their most recent earlier occurrence are the drafts. Summaries, edits and
code completion copy long spans of their prompt, which is where this pays.

Confidence (what DSpark's confidence head predicts for a model drafter, spec 000 §6): from the match statistics
of the n-gram used. Over all earlier occurrences of that n-gram, draft i's confidence is the fraction of those
whose continuation agrees with drafts 0..i, given it agreed with drafts 0..i-1 (a conditional acceptance rate,
so the cumulative product is the fraction agreeing with the whole prefix), shrunk towards 1/2 by one pseudo-
observation each way so that a single occurrence does not claim certainty.
"""

from __future__ import annotations

import numpy as np


class NgramProposer:
    def __init__(self, num_drafts: int, min_n: int, max_n: int, confidences: bool = True):
        """`confidences`: whether `propose` computes the drafts' confidences (only the `confidence` verify policy
        reads them; without them a proposal costs about a third less host time, at every step of every request)."""
        self.k, self.min_n, self.max_n = num_drafts, min_n, max_n
        self.confidences = confidences

    def propose(self, token_ids: list[int] | np.ndarray, max_drafts: int | None = None
                ) -> tuple[list[int], list[float]]:
        """(drafts, confidences) for the sequence `token_ids`; at most min(k, max_drafts) drafts, possibly none
        (the confidences are [] when the proposer was made without them)."""
        k = self.k if max_drafts is None else min(self.k, max_drafts)
        toks = np.asarray(token_ids, dtype=np.int64)
        L = len(toks)
        if k <= 0 or L < self.min_n + 1:
            return [], []
        # Ends of earlier occurrences of the last token (before it), then kept while the tokens before them match
        # too: one vectorized pass over the sequence and a few over the candidates, instead of one n-gram
        # comparison over the whole sequence per n (a long prompt at every step of every request).
        ends = [np.flatnonzero(toks[:L - 1] == toks[L - 1])]
        for j in range(1, min(self.max_n, L - 1)):
            e = ends[-1]
            e = e[e >= j]
            ends.append(e[toks[e - j] == toks[L - 1 - j]])
        for n in range(len(ends), self.min_n - 1, -1):
            if len(ends[n - 1]) == 0:
                continue
            follow = ends[n - 1] + 1                                 # first token after each occurrence
            src = int(follow[-1])                                    # most recent occurrence
            drafts = toks[src:min(src + k, L)].tolist()
            return drafts, self._confidences(toks, follow, drafts) if self.confidences else []
        return [], []

    @staticmethod
    def _confidences(toks: np.ndarray, follow: np.ndarray, drafts: list[int]) -> list[float]:
        conf = []
        alive = follow
        for i, d in enumerate(drafts):
            alive = alive[alive + i < len(toks)]
            agree = alive[toks[alive + i] == d]
            conf.append((len(agree) + 1) / (len(alive) + 2))
            alive = agree
        return conf
