"""Two-batch overlap across attention (distributed/two_batch.py), on CPU with gloo and real worker processes
(DP2 + EP2 of deepseek-v4-tiny, the fixtures' style of tests/test_ep_exchange.py):
- the cut: decode rows split by count, a prefill chunk kept whole, ties to the earlier boundary;
- a workload whose steps hold decode rows and chunked prefills (one half decode rows only, the other decode rows
  and a chunk; an idle rank, whose second half is empty), with the halves overlapped (staggered) equals the same
  halves run one after the other, bit for bit in fp32, and one process within 1e-4 (tokens identical), with the
  padded all-gather (auto at EP2) and the exact all-to-all (sizes read on the host inside each exchange);
- the setting is refused where it cannot run."""

from __future__ import annotations

import pytest

from openinfer import LLM, SamplingParams
from openinfer.distributed.expert_parallel import TBO_MIN_ROWS
from openinfer.distributed.two_batch import agreed_halves, cut
from tests.test_deepseek_v4 import prompts_of
from tests.test_ep_exchange import MODEL, generate, tokens_and_logprobs

# 48-row steps: 30 short requests per rank decode beside a long prompt's chunks, so a split step's second half holds
# decode rows and a chunk
OPTS = dict(device="cpu", dtype="float32", block_size=16, max_num_batched_tokens=48, max_num_seqs=32,
            num_kv_blocks=64)
SHORT = prompts_of(*[3, 4, 5, 6] * 15, seed=7)
LONG = prompts_of(100, 90, seed=8)
# one rank's two requests while the other's is aborted at once (it idles through their split steps)
PAIR, GONE = prompts_of(20, 30, seed=9), prompts_of(8, seed=10)[0]


def workload(llm):
    outs = generate(llm, SHORT + LONG)
    engine = llm.engine
    ids = [engine.add_request(PAIR[0], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=0)),
           engine.add_request(GONE, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)),
           engine.add_request(PAIR[1], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=0))]
    engine.abort_request(ids[1])
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    return outs + [done[ids[0]], done[ids[2]]]


def reference_workload(llm):
    return generate(llm, SHORT + LONG) + generate(llm, PAIR)


def test_cut_splits_decode_rows_by_count_and_keeps_chunks_whole():
    assert cut(list(range(40)) + [40], 48) == 24          # 40 decode rows, a chunk of 8: 24 | 16 decode + chunk
    assert cut(list(range(10)) + [10], 48) == 10          # 10 decode rows | a chunk of 38
    assert cut([0, 5], 42) == 5                           # two chunks: whole, each on one side
    assert cut([0], 48) == 48 and cut([], 0) == 0         # one chunk: nothing to cut
    assert cut([0, 1, 2, 3], 4) == 2 and cut([0, 1, 3], 4) == 1    # ties to the earlier boundary
    assert agreed_halves(TBO_MIN_ROWS - 1, (16, 15)) is None       # below TBO_MIN_ROWS: one batch
    assert agreed_halves(48, (48, 0)) is None                      # every rank's second half empty
    assert agreed_halves(48, (24, 30)) == (24, 30)
    from openinfer.config import EngineConfig
    with pytest.raises(ValueError, match="two_batch_split"):
        EngineConfig(device="cpu", two_batch_split="requests")            # needs expert parallelism
    with pytest.raises(ValueError, match="context_parallel_size"):
        EngineConfig(device="cpu", data_parallel_size=2, enable_expert_parallel=True, context_parallel_size=2,
                     two_batch_split="requests")


@pytest.fixture(scope="module")
def reference():
    llm = LLM(MODEL, **OPTS)
    try:
        yield reference_workload(llm)
    finally:
        llm.shutdown()


def run_two_batches(overlap: bool, dispatch: str):
    llm = LLM(MODEL, **OPTS, data_parallel_size=2, enable_expert_parallel=True, two_batch_split="requests",
              two_batch_overlap=overlap, moe_dispatch=dispatch)
    try:
        outs = workload(llm)
        return outs, [r["two_batch_steps"] for r in llm.engine.stats()["per_rank"]]
    finally:
        llm.shutdown()


@pytest.mark.parametrize("dispatch", ["auto", "all_to_all_exact"])
def test_overlap_across_attention_equals_the_halves_one_after_the_other_and_one_process(reference, dispatch):
    outs, split = run_two_batches(True, dispatch)
    for t, _ in tokens_and_logprobs(outs):
        assert len(t) == 6
    assert min(split) >= 4, split                  # every rank ran split steps (both halves, or one empty)
    off, split_off = run_two_batches(False, dispatch)
    assert split_off == split
    assert tokens_and_logprobs(outs) == tokens_and_logprobs(off)
    for (t, lp), (rt, rlp) in zip(tokens_and_logprobs(outs), tokens_and_logprobs(reference)):
        assert t == rt
        assert max(abs(a - b) for a, b in zip(lp, rlp)) < 1e-4
