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
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    def __init__(self, num_drafts: int, min_n: int, max_n: int):
        self.k, self.min_n, self.max_n = num_drafts, min_n, max_n

    def propose(self, token_ids: list[int] | np.ndarray, max_drafts: int | None = None
                ) -> tuple[list[int], list[float]]:
        """(drafts, confidences) for the sequence `token_ids`; at most min(k, max_drafts) drafts, possibly none."""
        k = self.k if max_drafts is None else min(self.k, max_drafts)
        toks = np.asarray(token_ids, dtype=np.int64)
        L = len(toks)
        if k <= 0 or L < self.min_n + 1:
            return [], []
        for n in range(min(self.max_n, L - 1), self.min_n - 1, -1):
            windows = sliding_window_view(toks[:L - 1], n)          # n-grams that end before the last token
            starts = np.flatnonzero((windows == toks[L - n:]).all(axis=1))
            if len(starts) == 0:
                continue
            follow = starts + n                                      # first token after each occurrence
            src = int(follow[-1])                                    # most recent occurrence
            drafts = toks[src:min(src + k, L)].tolist()
            return drafts, self._confidences(toks, follow, drafts)
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
