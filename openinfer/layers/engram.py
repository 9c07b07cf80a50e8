"""DeepSeek-V4.1 Engram: n-gram hash lookups written into the hyper-connection residual streams.

Every position is hashed together with the `max_ngram_size - 1` tokens before it, as one n-gram per
size 2..max_ngram_size and, within each size, one hash per head. Each (n-gram size, head) pair owns a
prime-sized range of rows in the layer's FP8 table; the rows found are projected into one key per
hyper-connection copy plus a shared value, and the value is added to each copy through a sigmoid gate.

The pieces, in the order the model uses them:

- `EngramLayout`: the bucket primes and row offsets of every engram layer (pure Python, built once).
- `compressed_token_map`: token id -> compressed id, tokens that normalize alike sharing one id.
- `hash_multipliers`: the per-(layer, look-back) odd multipliers, from a per-layer numpy RNG.
- `NgramHasher`: compressed ids and their look-back windows -> global table row ids. Its window
  helpers carry a per-sequence history of the last `max_ngram_size - 1` compressed ids instead of a
  [batch, max_seq_len] cache, so the same code serves a prefill chunk and a decode batch.
- `Engram`: the gated residual write of one engram layer (parameter names as in the checkpoint).

The algorithm follows DeepSeek's V4.1-Flash reference (MIT) and is tested against it
(tests/test_v41_engram.py). Image spans (the reference's dead tokens): the model gives their rows -1 as compressed
ids (a window reaching one reads the pad id from there on, `NgramHasher.forward`) and `Engram.forward` a `skip` mask
(no write); tests/test_deepseek_v41_vision.py checks both against the reference.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch
from torch import nn

ENGRAM_SCALE_BLOCK = 32     # one E8M0 scale per 32 values of a table row
GATE_CLAMP = 1e-6           # |dot| floor before the signed square root of the gate

# Miller-Rabin with these bases is exact for every n < 3.3e24, far beyond any table size.
_MR_BASES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37)


def is_prime(n: int) -> bool:
    """Deterministic primality test (Miller-Rabin over a base set exact for 64-bit and beyond)."""
    if n < 2:
        return False
    for p in _MR_BASES:
        if n % p == 0:
            return n == p
    d, r = n - 1, 0
    while d % 2 == 0:
        d //= 2
        r += 1
    for a in _MR_BASES:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(r - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def _primes_from(start: int, count: int) -> list[int]:
    """The first `count` primes >= start, ascending."""
    out, candidate = [], max(start, 2)
    while len(out) < count:
        if is_prime(candidate):
            out.append(candidate)
        candidate += 1
    return out


@dataclass(frozen=True)
class EngramLayout:
    """Bucket layout of the engram hash tables.

    primes[layer][g][head] is the bucket modulus of the (g+2)-gram hash of that head. The primes are
    handed out in order (layer, n-gram size, head) and never reused; every (layer, n-gram size) starts
    its search at `bucket_vocab_size`, so with nothing reused they are simply the consecutive primes
    >= bucket_vocab_size. offsets[layer][col] is where column col's range starts in the layer's table,
    columns ordered n-gram size major, head minor (col = g * n_heads + head).
    """

    layer_ids: tuple[int, ...]
    max_ngram_size: int
    n_heads: int
    head_dim: int
    num_embeddings: tuple[int, ...]                       # table rows per engram layer
    primes: tuple[tuple[tuple[int, ...], ...], ...]       # [layer][n-gram size 2..max][head]
    offsets: tuple[tuple[int, ...], ...]                  # [layer][n_hash_cols]

    @property
    def n_hash_cols(self) -> int:
        return (self.max_ngram_size - 1) * self.n_heads

    @property
    def n_layers(self) -> int:
        return len(self.layer_ids)

    @classmethod
    def build(cls, layer_ids: Sequence[int], max_ngram_size: int, n_heads: int, head_dim: int,
              bucket_vocab_size: int, num_embeddings: Sequence[int]) -> EngramLayout:
        layer_ids, num_embeddings = tuple(int(i) for i in layer_ids), tuple(int(n) for n in num_embeddings)
        if not layer_ids:
            raise ValueError("EngramLayout: no engram layers (layer_ids is empty)")
        if len(num_embeddings) != len(layer_ids):
            raise ValueError(f"EngramLayout: {len(layer_ids)} engram layers {layer_ids} but "
                             f"{len(num_embeddings)} table sizes {num_embeddings}")
        if len(set(layer_ids)) != len(layer_ids):
            raise ValueError(f"EngramLayout: duplicate engram layer ids {layer_ids}")
        if max_ngram_size < 2:
            raise ValueError(f"EngramLayout: max_ngram_size must be >= 2 (hashes cover 2-grams up), "
                             f"got {max_ngram_size}")
        if n_heads < 1 or head_dim < 1 or bucket_vocab_size < 1:
            raise ValueError(f"EngramLayout: n_heads ({n_heads}), head_dim ({head_dim}) and bucket_vocab_size "
                             f"({bucket_vocab_size}) must be positive")
        n_sizes = max_ngram_size - 1
        flat = _primes_from(bucket_vocab_size, len(layer_ids) * n_sizes * n_heads)
        primes, offsets = [], []
        for li, (layer_id, rows) in enumerate(zip(layer_ids, num_embeddings)):
            mine = flat[li * n_sizes * n_heads:(li + 1) * n_sizes * n_heads]
            starts = np.concatenate([[0], np.cumsum(mine, dtype=np.int64)]).tolist()
            if starts[-1] > rows:
                raise ValueError(f"EngramLayout: engram layer {layer_id} needs {starts[-1]} table rows for its "
                                 f"{n_sizes} n-gram sizes x {n_heads} heads of prime buckets (>= {bucket_vocab_size} "
                                 f"each) but num_embeddings gives {rows}")
            primes.append(tuple(tuple(mine[g * n_heads:(g + 1) * n_heads]) for g in range(n_sizes)))
            offsets.append(tuple(starts[:-1]))
        return cls(layer_ids=layer_ids, max_ngram_size=max_ngram_size, n_heads=n_heads, head_dim=head_dim,
                   num_embeddings=num_embeddings, primes=tuple(primes), offsets=tuple(offsets))


def _engram_key_normalizers():
    """(collapse, strip): the text normalization a token's key goes through, split where the
    single-space rule applies. collapse = NFKC, NFD, strip accents, lowercase, whitespace runs -> one
    space; strip then trims Unicode whitespace, except that a key that is exactly " " is kept."""
    from tokenizers import Regex, normalizers
    collapse = normalizers.Sequence([normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(),
                                     normalizers.Lowercase(), normalizers.Replace(Regex(r"[ \t\r\n]+"), " ")])
    return collapse, normalizers.Strip()


def _backend_and_size(tokenizer):
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:                 # transformers fast tokenizer, or a duck-typed stand-in
        return backend, len(tokenizer)
    if hasattr(tokenizer, "get_vocab_size") and hasattr(tokenizer, "id_to_token"):   # tokenizers.Tokenizer
        return tokenizer, tokenizer.get_vocab_size(with_added_tokens=True)
    raise TypeError(f"compressed_token_map: {type(tokenizer).__name__} is neither a fast tokenizer (no "
                    f".backend_tokenizer) nor a tokenizers.Tokenizer")


def compressed_token_map(tokenizer) -> tuple[torch.Tensor, int]:
    """Token id -> compressed id (LongTensor [vocab]) and the number of compressed ids.

    Each token is decoded on its own with the raw backend decoder (special tokens kept) and keyed by
    its normalized text; ids are handed out in order of first appearance. A token whose text has a
    U+FFFD (a partial UTF-8 byte sequence) is keyed by its raw token string instead, and an empty
    normalization falls back to the decoded text. Matching the reference exactly: U+E000 in the
    stripped text reads as a space (the reference uses that private-use char as its single-space
    sentinel). The size matters beyond bounds: every hash multiplier derives from it.
    """
    backend, vocab = _backend_and_size(tokenizer)
    collapse, strip = _engram_key_normalizers()
    ids: dict[str, int] = {}
    table = np.empty(vocab, dtype=np.int64)
    for token_id in range(vocab):
        text = backend.decode([token_id], skip_special_tokens=False)
        if "\ufffd" in text:
            key = backend.id_to_token(token_id)
        else:
            key = collapse.normalize_str(text)
            if key != " ":
                key = strip.normalize_str(key).replace("\ue000", " ")
            key = key or text
        table[token_id] = ids.setdefault(key, len(ids))
    return torch.from_numpy(table), len(ids)


def hash_multipliers(layer_ids: Sequence[int], max_ngram_size: int, compressed_vocab_size: int) -> torch.Tensor:
    """LongTensor [n_layers, max_ngram_size]: odd multipliers, one per (layer, look-back), drawn from
    numpy's default_rng(10007 * layer_id) below a bound that keeps id * multiplier inside int64."""
    bound = max(1, np.iinfo(np.int64).max // compressed_vocab_size // 2)
    rows = [np.random.default_rng(10007 * int(layer_id)).integers(0, bound, size=max_ngram_size, dtype=np.int64)
            for layer_id in layer_ids]
    return torch.from_numpy(np.stack(rows) * 2 + 1)


class NgramHasher(nn.Module):
    """Compressed token ids and their look-back windows -> global engram table row ids.

    A window row [n] (n = max_ngram_size) holds the compressed id of a token (column 0) and of the
    tokens 1..n-1 positions before it (column s), -1 where the position lies before the sequence start.
    A history [n-1] is the same thing minus column 0: the n-1 compressed ids before a token, the
    immediately preceding one first. Every method is pure tensor ops with shapes fixed by its inputs
    (no host synchronisation), so decode steps can be captured in a CUDA graph.

    Text only: look-back stops at the sequence start, never at an image span (the reference's dead
    tokens are out of scope here).
    """

    def __init__(self, layout: EngramLayout, token_map: torch.Tensor | Sequence[int], compressed_vocab_size: int,
                 pad_id: int):
        super().__init__()
        self.layout = layout
        self.n = layout.max_ngram_size
        self.compressed_vocab_size = int(compressed_vocab_size)
        token_map = torch.as_tensor(token_map, dtype=torch.long)
        if not 0 <= pad_id < token_map.numel():
            raise ValueError(f"NgramHasher: pad_id {pad_id} outside the token map ({token_map.numel()} tokens)")
        if token_map.numel() and int(token_map.max()) >= self.compressed_vocab_size:
            raise ValueError(f"NgramHasher: token map reaches id {int(token_map.max())} but compressed_vocab_size "
                             f"is {self.compressed_vocab_size}")
        self.pad_compressed = int(token_map[pad_id])      # fills look-back slots before the sequence start
        self.register_buffer("token_map", token_map, persistent=False)
        self.register_buffer("multipliers", hash_multipliers(layout.layer_ids, self.n, self.compressed_vocab_size),
                             persistent=False)
        # [n_layers, n-1, n_heads] and [n_layers, n_hash_cols]
        self.register_buffer("primes", torch.tensor(layout.primes, dtype=torch.long), persistent=False)
        self.register_buffer("offsets", torch.tensor(layout.offsets, dtype=torch.long), persistent=False)

    def compress(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.token_map[input_ids]

    def empty_history(self, *batch: int, device=None) -> torch.Tensor:
        """History of a sequence not started yet: all -1, shape [*batch, n-1]."""
        return torch.full((*batch, self.n - 1), -1, dtype=torch.long, device=device)

    def windows(self, compressed: torch.Tensor, history: torch.Tensor) -> torch.Tensor:
        """Per-row windows [T, n] from each row's own compressed id [T] and history [T, n-1] (a decode
        batch: one token per sequence). The next history of each row is windows(...)[:, :-1]."""
        return torch.cat([compressed.unsqueeze(-1), history], dim=-1)

    def chunk_windows(self, compressed: torch.Tensor, history: torch.Tensor) -> torch.Tensor:
        """Windows [n_new, n] of a contiguous chunk [n_new] of one sequence whose history [n-1] is given."""
        timeline = torch.cat([history.flip(0), compressed])          # oldest first
        return timeline.unfold(0, self.n, 1).flip(-1)

    def next_history(self, compressed_chunk: torch.Tensor, history: torch.Tensor) -> torch.Tensor:
        """The history [n-1] after appending compressed_chunk [n_new] (any n_new >= 0) to a sequence."""
        timeline = torch.cat([history.flip(0), compressed_chunk])
        return timeline[timeline.numel() - (self.n - 1):].flip(0)

    def forward(self, windows: torch.Tensor) -> torch.Tensor:
        """windows [T, n] -> global row ids [T, n_layers, n_hash_cols] (offsets included).

        Once a look-back reaches before the sequence start (-1) it and every longer look-back read the
        pad token's compressed id. The (s+1)-gram hash is the XOR of id * multiplier over look-backs
        0..s, taken modulo each head's prime."""
        blocked = (windows < 0).cumsum(-1) > 0
        tokens = torch.where(blocked, self.pad_compressed, windows)
        products = tokens.unsqueeze(1) * self.multipliers                    # [T, n_layers, n]
        rolling, hashes = products[..., 0], []
        for s in range(1, self.n):
            rolling = rolling ^ products[..., s]
            hashes.append(rolling.unsqueeze(-1) % self.primes[:, s - 1])    # [T, n_layers, n_heads]
        return torch.cat(hashes, dim=-1) + self.offsets


class EngramTable(nn.Module):
    """The FP8 hash table of one engram layer: weight float8_e4m3fn [rows, head_dim] with an E8M0
    scale per 32 values of a row (scale [rows, head_dim / 32])."""

    def __init__(self, num_rows: int, head_dim: int, device=None, pin_memory: bool = False):
        """`pin_memory`: a host table in pinned memory, which a CUDA step reads directly (`gathered_by_device`)."""
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_rows, head_dim, dtype=torch.float8_e4m3fn, device=device,
                                               pin_memory=pin_memory), requires_grad=False)
        self.scale = nn.Parameter(torch.empty(num_rows, head_dim // ENGRAM_SCALE_BLOCK, dtype=torch.float8_e8m0fnu,
                                              device=device, pin_memory=pin_memory), requires_grad=False)

    def gathered_by_device(self, device: torch.device) -> bool:
        """Whether a step on `device` gathers rows itself (no host round trip; CUDA-graph safe): the table is on
        that device, or in pinned host memory a CUDA device reads through unified addressing."""
        return self.weight.device == device or (device.type == "cuda" and self.weight.device.type == "cpu"
                                                 and self.weight.is_pinned() and self.scale.is_pinned())

    def lookup(self, hash_ids: torch.Tensor, device: torch.device) -> torch.Tensor:
        """Rows of hash_ids [...] dequantized to bf16 on `device`: [..., head_dim]. A pinned host table is read
        by a CUDA kernel in place (triton_engram); any other table is gathered where it lives (hash ids moved
        there first) and only the FP8 rows and their scales travel."""
        if self.weight.device != device and self.gathered_by_device(device):
            from openinfer.layers.triton_engram import gather_rows

            values, scales = gather_rows(self.weight, self.scale, hash_ids.to(device))
        else:
            # blocking: a host-side table must see the ids before gathering (an async D2H copy could race)
            idx = hash_ids.to(self.weight.device)
            values = self.weight[idx].to(device, non_blocking=True)
            scales = self.scale[idx].to(device, non_blocking=True)
        values = values.float().unflatten(-1, (-1, ENGRAM_SCALE_BLOCK)) * scales.float().unsqueeze(-1)
        return values.flatten(-2).to(torch.bfloat16)


class Engram(nn.Module):
    """Gated residual write of one engram layer.

    forward(streams [T, hc_mult, dim], hash_ids [T, n_hash_cols]): the n_hash_cols table rows are
    flattened and projected by `wkv` into hc_mult keys plus one value (each dim wide). Per (token, hc
    copy) the gate is sigmoid(signed_sqrt(<h, q*k*key> * rms(h)^-1 * rms(key)^-1 / sqrt(dim))), |dot|
    clamped to 1e-6 before the root, all in float32; the result h + gate * value is cast back to the
    streams' dtype. Parameter names match the checkpoint: embed.weight, embed.scale, wkv.*, q_weight,
    k_weight. The table may live on another device (pinned host memory for the real tables).
    """

    def __init__(self, dim: int, hc_mult: int, norm_eps: float, n_hash_cols: int, head_dim: int, num_rows: int,
                 wkv: nn.Module | None = None, table_device=None):
        super().__init__()
        if head_dim % ENGRAM_SCALE_BLOCK:
            raise ValueError(f"Engram: head_dim {head_dim} is not a multiple of the {ENGRAM_SCALE_BLOCK}-value "
                             f"scale block")
        self.dim, self.hc_mult, self.eps = dim, hc_mult, norm_eps
        self.n_hash_cols, self.head_dim = n_hash_cols, head_dim
        self.embed = EngramTable(num_rows, head_dim, device=table_device)
        self.wkv = wkv if wkv is not None else nn.Linear(n_hash_cols * head_dim, dim * (hc_mult + 1), bias=False,
                                                         dtype=torch.bfloat16)
        self.q_weight = nn.Parameter(torch.ones(hc_mult, dim, dtype=torch.float32), requires_grad=False)
        self.k_weight = nn.Parameter(torch.ones(hc_mult, dim, dtype=torch.float32), requires_grad=False)

    def forward(self, streams: torch.Tensor, hash_ids: torch.Tensor, skip: torch.Tensor | None = None) -> torch.Tensor:
        """`skip` [T] bool: rows that take no Engram write (DeepSeek-V4.1's image spans: their gate is shut)."""
        # [T, n_hash_cols, head_dim]; FP8 x E8M0 values are exact in bf16 and in wider float types alike
        rows = self.embed.lookup(hash_ids, streams.device).to(streams.dtype)
        kv = self.wkv(rows.flatten(-2))
        key, value = kv.split([self.hc_mult * self.dim, self.dim], dim=-1)
        key = key.float().unflatten(-1, (self.hc_mult, self.dim))            # [T, hc, dim]
        h = streams.float()
        qk = self.q_weight.float() * self.k_weight.float()
        inv_rms = torch.rsqrt(h.square().mean(-1) + self.eps) * torch.rsqrt(key.square().mean(-1) + self.eps)
        dot = (h * qk * key).sum(-1) * inv_rms * self.dim ** -0.5           # [T, hc]
        gate = torch.sigmoid(torch.copysign(dot.abs().clamp_min(GATE_CLAMP).sqrt(), dot))
        if skip is not None:
            gate = gate.masked_fill(skip[:, None], 0.0)
        return (h + gate.unsqueeze(-1) * value.float().unsqueeze(-2)).to(streams.dtype)
