"""The encoder-output cache: image embeddings by digest, least recently used evicted once the bytes exceed the
budget; an entry larger than the whole budget is used once and not kept."""

from __future__ import annotations

import torch

from openinfer.engine.encoder_cache import EncoderCache


def rows(n: int) -> torch.Tensor:
    return torch.zeros(n, 4)          # 16 bytes a row


def test_a_repeated_digest_is_not_encoded_again_and_the_least_recently_used_goes_first():
    cache, calls = EncoderCache(capacity_bytes=3 * 16), []

    def get(d: bytes, n: int = 1):
        return cache.get_or_encode(d, lambda: calls.append(d) or rows(n))

    get(b"a"), get(b"b"), get(b"c")
    get(b"a")                           # a hit: a is now the most recent
    assert calls == [b"a", b"b", b"c"] and (cache.hits, cache.misses) == (1, 3)
    get(b"d")                           # over budget: b (least recently used) goes
    get(b"a"), get(b"c")
    assert calls == [b"a", b"b", b"c", b"d"]
    get(b"b")
    assert calls[-1] == b"b" and cache.bytes <= 3 * 16 and len(cache) == 3


def test_an_entry_larger_than_the_budget_is_returned_but_not_kept():
    cache = EncoderCache(capacity_bytes=32)
    cache.get_or_encode(b"small", lambda: rows(1))
    out = cache.get_or_encode(b"big", lambda: rows(10))
    assert out.shape == (10, 4) and len(cache) == 1 and cache.bytes == 16
    assert EncoderCache(0).get_or_encode(b"x", lambda: rows(1)).shape == (1, 4)
