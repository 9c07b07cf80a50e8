"""GrammarBitmask: the allowed next tokens of a step's constrained requests, and applying it to logits.

One int32 row of ceil(V/32) words per constrained request (bit t of the row: token t allowed), filled on
the host by xgrammar. The runner lays it out in the sampler's row order (`for_batch`; unconstrained rows
are all ones) and the sampler applies it to the whole logits batch in one op: xgrammar's
`apply_token_bitmask_inplace` (a CUDA/Triton kernel on the GPU, a vectorised loop on the CPU).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class GrammarBitmask:
    rows: dict[tuple[str, int], int]   # (request id, drafts before the row) -> row of `mask`
    mask: torch.Tensor                 # [len(rows), ceil(V/32)] int32, host

    def for_batch(self, keys: list[tuple[str, int]]) -> torch.Tensor:
        """The mask with one row per (request id, number of drafts before it) in `keys` order (speculative
        decoding verifies a request's drafts in consecutive rows, each with the grammar advanced over the drafts
        before it); all ones for requests without a grammar."""
        full = torch.full((len(keys), self.mask.shape[1]), -1, dtype=torch.int32)
        dst = [i for i, key in enumerate(keys) if key in self.rows]
        if dst:
            full[dst] = self.mask[[self.rows[keys[i]] for i in dst]]
        return full


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set the logits of disallowed tokens to -inf, in place, for the whole batch at once."""
    import xgrammar as xgr

    xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=logits.shape[-1])
