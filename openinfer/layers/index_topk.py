"""The sparse indexer's top-k without a sort: the k best entries of each row of scores, ties to the earlier entry.

DeepSeek's lightning indexers (V4's CSA, V4.1's index sources) keep the `index_topk` best compressed entries per
query. A stable descending sort gives the causal choice (among equal scores the earlier entry wins, so appending
entries never changes an earlier query's picks), but it sorts every row in full: over a long context that sort is
one of the decode step's costliest kernels. The same picks come from one order-preserving integer key per entry,
unique by construction, and a plain top-k on it:

    key = monotone32(score) << 32 | (N - 1 - entry)

`monotone32` maps a float32's bits to a signed integer of the same order (-0.0 first made +0.0, as the sort
compares them equal; every NaN made one positive NaN, above +inf, as the sort puts NaNs first); the low half breaks
ties toward the earlier entry. Keys are unique, so the k largest are exactly the stable sort's first k.

Picks come back in position order (ascending entry), the order DeepSeek's V4.1 reference attends in and what a
kernel can emit without sorting (`triton_indexer.index_topk`). `valid` says which picks a query may attend to:
with `limit` (V4: the query's closed entries) the picks below it, else (V4.1) the picks whose score is above -inf.
"""

from __future__ import annotations

import torch


def order_keys(scores: torch.Tensor) -> torch.Tensor:
    """int64 keys [T, N] of float32 scores [T, N], unique per row, ordered as a stable descending sort ranks."""
    x = torch.where(scores == 0, 0.0, scores.float())
    x = torch.where(x.isnan(), float("nan"), x)
    bits = x.contiguous().view(torch.int32).long()
    mono = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)        # negative floats: larger magnitude, smaller key
    n = scores.shape[-1]
    return (mono << 32) | (n - 1 - torch.arange(n, device=scores.device))


def torch_index_topk(scores: torch.Tensor, k: int, limit: torch.Tensor | None = None):
    """scores [T, N] float32 -> (picks [T, min(k, N)] int64 in position order, valid [T, min(k, N)] bool): the stable
    descending sort's first k entries of each row, sorted by entry. `limit` [T]: a pick is valid below it; None:
    valid where its score is above -inf."""
    k = min(k, scores.shape[-1])
    picks = torch.topk(order_keys(scores), k, dim=-1, sorted=False).indices.sort(dim=-1).values
    if limit is not None:
        return picks, picks < limit[:, None]
    return picks, scores.gather(-1, picks) > float("-inf")
