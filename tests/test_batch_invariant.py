"""Batch-invariant mode (EngineConfig.batch_invariant, layers/batch_invariant.py): the same request gives the
same bits alone or in any batch, chunking and row position -- on SmolLM2's shape (random weights, 2 of its 30
layers: the bits depend on the shapes the kernels see, not on what the weights say), greedy and seeded sampling.
The GPU side (Triton GEMM, attention through one kernel) is in tests/test_gpu.py."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from openinfer import LLM, SamplingParams
from openinfer.config import EngineConfig
from openinfer.layers.attention import AttentionMetadata, PrefillChunk, TorchPagedAttention
from openinfer.layers.batch_invariant import BatchInvariantTorchAttention, linear, matmul_rows
from tests.conftest import write_tiny_llama


@pytest.mark.parametrize("k, n", [(576, 1536), (1536, 576), (576, 49152)])
def test_padded_cpu_gemm_rows_do_not_depend_on_the_batch(k, n):
    """Every row of `linear` has the bits it has alone, for M = 1..70 and larger M at the first, middle and
    last row; plain F.linear does not (M = 1 runs a GEMV), which is why the mode exists."""
    g = torch.Generator().manual_seed(k + n)
    w, x = torch.randn(n, k, generator=g), torch.randn(600, k, generator=g)
    alone = linear(x[:1], w)[0]
    ms = [*range(1, 71), 127, 128, 129, 255, 257, 511, 600] if n < 10_000 else [1, 2, 3, 5, 9, 16, 17, 33, 129]
    for m in ms:
        for pos in {0, m // 2, m - 1}:
            rows = x[:m].clone()
            rows[pos] = x[0]
            assert torch.equal(linear(rows, w)[pos], alone), (m, pos)
    plain = F.linear(x[:1], w)[0]
    assert any(not torch.equal(F.linear(x[:m], w)[0], plain) for m in (2, 5, 16, 100))


def test_padded_attention_matmuls_do_not_depend_on_the_rows():
    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(3, 900, 64, generator=g), torch.randn(3, 64, 128, generator=g)
    alone = matmul_rows(q[:, :1], k)[:, 0]
    for m in (1, 3, 16, 17, 48, 300, 900):
        assert torch.equal(matmul_rows(q[:, :m], k)[:, 0], alone), m


def _paged(ctx_lens, page, kvh, d, g):
    """A shuffled page layout holding `ctx_lens` tokens per sequence, K/V random (fp32)."""
    need = [-(-n // page) for n in ctx_lens]
    perm = torch.randperm(sum(need) + 2, generator=g) + 1
    tables, at = [], 0
    for n in need:
        tables.append(perm[at:at + n])
        at += n
    cache = torch.randn(sum(need) + 3, page, 2, kvh, d, generator=g)
    return cache, tables


def _run(backend, q_rows, cache, tables, page, pieces, scale, window=None):
    """Attention for a step made of `pieces`: ("decode", seq, pos) rows first, then ("chunk", seq, start, end)
    prefill chunks. Returns the output rows in `pieces` order (the cache is only read: K/V are already in)."""
    decs = [p for p in pieces if p[0] == "decode"]
    chunks = [p for p in pieces if p[0] == "chunk"]
    rows, slots, prefills = [], [], []
    for _, s, pos in decs:
        rows.append(q_rows[s][pos:pos + 1])
        slots.append(int(tables[s][pos // page]) * page + pos % page)
    start = len(decs)
    for _, s, a, b in chunks:
        rows.append(q_rows[s][a:b])
        slots += [int(tables[s][p // page]) * page + p % page for p in range(a, b)]
        prefills.append(PrefillChunk(start, b - a, b, tables[s][:-(-b // page)], page))
        start += b - a
    q = torch.cat(rows)
    width = max((len(tables[s]) for _, s, _ in decs), default=1)
    meta = AttentionMetadata(
        page, torch.tensor(slots), num_decode_tokens=len(decs),
        decode_block_tables=torch.stack([F.pad(tables[s], (0, width - len(tables[s]))) for _, s, _ in decs])
        if decs else None,
        decode_context_lens=torch.tensor([pos + 1 for _, _, pos in decs]) if decs else None,
        max_decode_context_len=max((pos + 1 for _, _, pos in decs), default=0), prefills=prefills)
    # write the rows' own K/V back unchanged (the backends write before they read)
    flat = cache.view(-1, *cache.shape[2:])
    kv = flat[torch.tensor(slots)]
    return backend.forward(q, kv[:, 0], kv[:, 1], cache, meta, scale, window=window)


@pytest.mark.parametrize("window", [None, 40])
def test_attention_rows_do_not_depend_on_chunking_or_batch(window):
    """The same query rows computed as decode rows, inside chunks of different boundaries, alone or next to
    other sequences: bitwise equal; and within fp32 rounding of the reference backend."""
    g = torch.Generator().manual_seed(1)
    page, kvh, group, d = 16, 3, 3, 64
    lens = [300, 150, 41]
    cache, tables = _paged(lens, page, kvh, d, g)
    q_rows = [torch.randn(n, kvh * group, d, generator=g) for n in lens]
    inv, ref = BatchInvariantTorchAttention(), TorchPagedAttention()
    scale = d ** -0.5
    want = {p: _run(inv, q_rows, cache, tables, page, [("decode", 0, p)], scale, window)[0] for p in (0, 130, 299)}
    layouts = [
        [("chunk", 0, 0, 300)],
        [("decode", 1, 149), ("decode", 2, 40), ("chunk", 0, 128, 300)],
        [("decode", 2, 7), ("chunk", 1, 0, 150), ("chunk", 0, 100, 131), ("chunk", 0, 299, 300)],
    ]
    for pieces in layouts:
        out = _run(inv, q_rows, cache, tables, page, pieces, scale, window)
        out_ref = _run(ref, q_rows, cache, tables, page, pieces, scale, window)
        torch.testing.assert_close(out, out_ref, atol=2e-5, rtol=1e-5)
        at = 0
        for piece in pieces:
            lo, hi = (piece[2], piece[2] + 1) if piece[0] == "decode" else piece[2:]
            for p in want:
                if piece[1] == 0 and lo <= p < hi:
                    assert torch.equal(out[at + p - lo], want[p]), (pieces, p)
            at += hi - lo


_TARGET = ("The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
           "several older technologies into one system for making books. Write two sentences about it.")


def _fillers(n: int) -> list[tuple[str, SamplingParams]]:
    rng = random.Random(n)
    words = "sea wind harbour dawn gull bread river stone lamp winter garden letter train clock".split()
    out = []
    for i in range(n):
        text = " ".join(rng.choice(words) for _ in range(rng.choice([2, 9, 30, 70])))
        out.append((f"Continue: {text}", SamplingParams(max_tokens=rng.randrange(4, 32), ignore_eos=True,
                                                        temperature=rng.choice([0.0, 1.0]), seed=i)))
    return out


def _target_outputs(llm, batch: int, params: list[SamplingParams]):
    """The targets' (tokens, top-5 logprobs as exact floats) run among batch - len(params) fillers, the
    targets placed apart inside the batch."""
    fill = _fillers(batch - len(params))
    prompts, sps, where = [p for p, _ in fill], [s for _, s in fill], []
    for i, sp in enumerate(params):
        at = min(len(prompts), (i + 1) * len(prompts) // 2)
        prompts.insert(at, _TARGET)
        sps.insert(at, sp)
    where = [i for i, p in enumerate(prompts) if p == _TARGET]
    outs = llm.generate(prompts, sps, use_tqdm=False)
    return [(outs[i].outputs[0].token_ids,
             [sorted((t, lp.logprob) for t, lp in pos.items()) for pos in outs[i].outputs[0].logprobs])
            for i in where]


@pytest.fixture(scope="module")
def smollm_shaped_dir(tmp_path_factory, smollm_dir):
    """SmolLM2-135M's every shape (the GEMMs 576->1536, 1536->576, 576->576/192 and the tied 576->49152 head; 9 query
    heads over 3 KV heads of 64) with 2 layers of random weights: ~4x cheaper a token than its 30."""
    return write_tiny_llama(tmp_path_factory.mktemp("smollm-shaped"), smollm_dir, hidden_size=576,
                            intermediate_size=1536, num_hidden_layers=2, num_attention_heads=9, num_key_value_heads=3,
                            head_dim=64, rope_theta=100000.0, max_position_embeddings=8192, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def target_params():
    return [SamplingParams(max_tokens=16, temperature=0.0, logprobs=5, ignore_eos=True),
            SamplingParams(max_tokens=16, temperature=0.8, top_p=0.95, seed=123, logprobs=5, ignore_eos=True)]


def test_batch_invariant_engine_same_bits_in_any_batch(smollm_shaped_dir, target_params):
    """A greedy and a seeded request alone vs inside batches of 2, 7 and 16 mixed-length prompts, with the whole
    prompt in one chunk (7) or chunked next to decodes (2 and 16, a 32-token budget): identical tokens and top-5
    logprobs, bit for bit, over 16 steps (the fillers run 4..31 tokens, so the targets decode next to
    fillers that finish before them and fillers that outlast them)."""
    engines = {budget: LLM(smollm_shaped_dir, device="cpu", dtype="float32", batch_invariant=True, max_num_seqs=16,
                           max_num_batched_tokens=budget, enable_prefix_caching=False)
               for budget in (2048, 32)}
    alone = [_target_outputs(engines[2048], 1, [sp])[0] for sp in target_params]
    for budget, batch in ((2048, 7), (32, 2), (32, 16)):
        got = _target_outputs(engines[budget], batch, target_params)
        for i, (tokens, lps) in enumerate(got):
            assert tokens == alone[i][0], (budget, batch, i)
            assert lps == alone[i][1], (budget, batch, i)
    for llm in engines.values():
        llm.shutdown()


def test_default_mode_differs_with_the_batch(smollm_shaped_dir, target_params):
    """Without the mode the same request's logprobs do change with the batch (so the test above can fail)."""
    llm = LLM(smollm_shaped_dir, device="cpu", dtype="float32", max_num_seqs=16)
    sp = [SamplingParams(max_tokens=4, temperature=0.0, logprobs=5, ignore_eos=True)]
    alone = _target_outputs(llm, 1, sp)[0][1]
    batched = _target_outputs(llm, 5, sp)[0][1]
    assert alone != batched


def test_batch_invariant_refusals():
    with pytest.raises(ValueError, match="one-process"):
        EngineConfig(device="cpu", batch_invariant=True, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="int4"):
        EngineConfig(device="cpu", batch_invariant=True, quantization="int4")
    with pytest.raises(ValueError, match="Llama family and Gemma-3; DeepSeek-V4 models are not covered"):
        LLM("deepseek-v4-tiny", device="cpu", batch_invariant=True, num_kv_blocks=8)
