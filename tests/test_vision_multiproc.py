"""Images through the multi-process executor (docs/vision.md): `deepseek-v41-tiny` (its two-block vision tower) on
DP2 + EP2 (2 gloo ranks, real worker processes) gives one process's greedy tokens and logprobs (fp32 activations
and caches, 1e-4) for image prompts run together (one per DP group, an image span cut by the 32-token chunk and
block boundary), a prefix hit on a cached image (the rest of its span from the rank's encoder cache), the same text
behind another image (no hit), and after an abort mid-image; bad spans are refused by the front end, naming the
problem, before anything reaches a rank; no worker outlives the engine. An image span pickles (to a rank, to the
engine core) with its tensors as bytes, not through shared memory. One one-process engine and one DP2 + EP2 engine
in all, a few short requests."""

from __future__ import annotations

import dataclasses
import multiprocessing.reduction
import pickle

import numpy as np
import pytest
import torch

from openinfer import LLM
from openinfer.models.deepseek_v41.family import DEEPSEEK_V41_TINY_CONFIG, FAMILY
from openinfer.multimodal import ImageSpan
from openinfer.sampling_params import SamplingParams
from tests.test_deepseek_v4 import prompts_of
from tests.test_parallel import EP2, assert_gone, assert_ranks_idle, assert_same_outputs, worker_pids
from tests.test_v41_parallel import OPTS

NAME = "deepseek-v41-tiny"
PLACEHOLDER = DEEPSEEK_V41_TINY_CONFIG["image_token_id"]
PARAMS = SamplingParams(max_tokens=3, logprobs=0, temperature=0, ignore_eos=True)


def picture(seed: int, height: int, width: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def image_prompt(parts) -> tuple[list[int], tuple[ImageSpan, ...]]:
    """`parts`: token lists and pictures in prompt order -> the prompt with each picture's span, and the spans (the
    family's image processor: 14-pixel patches, 3 x 3 tokens per Aligner cell)."""
    ids, pictures = [], []
    for part in parts:
        if isinstance(part, np.ndarray):
            ids.append(PLACEHOLDER)
            pictures.append(part)
        else:
            ids += part
    return FAMILY.image_processor(DEEPSEEK_V41_TINY_CONFIG).expand(ids, pictures)


def run(engine, requests, abort_after_step: bool = False):
    """Add (prompt, spans) requests together and step until done; the finished outputs in request order. With
    `abort_after_step`, the requests are aborted after their first step (nothing is returned)."""
    ids = [engine.add_request(p, PARAMS, images=spans) for p, spans in requests]
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        if abort_after_step:
            for rid in ids:
                engine.abort_request(rid)
            abort_after_step = False
    return [done[i] for i in ids if i in done]


def image_workload(engine):
    """Two image prompts together (the first's span cut by a 32-token boundary), a third hitting the first's cached
    first block (text + most of its image), a fourth with the same tokens behind another image (no hit)."""
    text = prompts_of(24, 12, 40, 8, seed=31)
    first = image_prompt([text[0][:20], picture(1, 126, 168), text[1]])   # a 17-position span at [20, 37)
    second = image_prompt([text[0][:5], picture(2, 70, 98), text[2][:30], picture(3, 42, 42), text[3]])
    together = run(engine, [first, second])                                 # one request per DP group
    # the first prompt up to its image's end, another tail: its first block (text + most of the image) hits
    hit = (first[0][:37] + text[2][:9], first[1])
    cached = run(engine, [hit])
    other = image_prompt([text[0][:20], picture(4, 126, 168), text[2][:9]])   # the same tokens, another image
    missed = run(engine, [other])
    return together + cached + missed


@pytest.fixture(scope="module")
def reference():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)        # as each worker runs (2 cores): more threads than cores crawl on a busy host
    try:
        llm = LLM(NAME, **OPTS)
        try:
            return image_workload(llm.engine)
        finally:
            llm.shutdown()
    finally:
        torch.set_num_threads(threads)


def test_image_requests_on_dp_ep_ranks_equal_one_process(reference):
    llm = LLM(NAME, **OPTS, **EP2)
    pids = worker_pids(llm)
    try:
        engine = llm.engine
        assert engine.is_multiprocess
        # refused by the front end, naming the problem; nothing reaches a rank
        prompt, spans = image_prompt([[5, 6], picture(5, 42, 42), [7]])
        text_inside = list(prompt)
        text_inside[spans[0].offset + 1] = 9
        with pytest.raises(ValueError, match="image token id"):
            engine.add_request(text_inside, PARAMS, images=spans)
        with pytest.raises(ValueError, match="patches of shape"):
            engine.add_request(prompt, PARAMS, images=(dataclasses.replace(spans[0], grid=(1, 1)),))
        with pytest.raises(ValueError, match="inside the 3-token prompt"):
            engine.add_request(prompt[:3], PARAMS, images=spans)
        assert not engine.has_unfinished_requests()
        # an image request aborted after its first chunk (inside its image) leaves its ranks idle
        aborted = image_prompt([prompts_of(20, seed=32)[0], picture(6, 126, 168), [3, 4, 5]])
        assert run(engine, [aborted], abort_after_step=True) == []
        assert_ranks_idle(llm)
        outs = image_workload(engine)
        assert_same_outputs(outs, reference)
        assert [o.num_cached_tokens for o in outs] == [r.num_cached_tokens for r in reference] == [0, 0, 32, 0]
        per_rank = engine.stats()["per_rank"]
        # each image encoded once, by the rank owning its request (an idle engine sends a lone request to DP group
        # 0): rank 0 the aborted one's, the first's and the other's; rank 1 the second's two. The hit took the rest
        # of its image from rank 0's encoder cache
        assert [(s["images_encoded"], s["images_given"]) for s in per_rank] == [(3, 0), (2, 0)], per_rank
        assert_ranks_idle(llm)
    finally:
        llm.shutdown()
    assert_gone(pids)


def test_an_image_span_pickles_its_tensors_as_bytes():
    """What `multiprocessing` sends (its ForkingPickler, which would otherwise move tensors to shared memory and
    pass file descriptors a rank on another host cannot open): the span's bytes in the message, read back equal,
    the digest as computed."""
    prompt, (span,) = image_prompt([[5], picture(7, 70, 98), [6]])
    given = dataclasses.replace(span, embeds=torch.randn(span.num_tokens, 64))
    wire = bytes(multiprocessing.reduction.ForkingPickler.dumps(given))
    assert b"rebuild_storage" not in wire and b"resource_sharer" not in wire
    assert len(wire) < span.patches.numel() * 2 + given.embeds.numel() * 4 + 1024
    back = pickle.loads(wire)
    assert (back.offset, back.token_types, back.grid, back.digest) == (span.offset, span.token_types, span.grid,
                                                                       span.digest)
    assert back.patches.dtype == torch.bfloat16 and torch.equal(back.patches, span.patches)
    assert torch.equal(back.embeds, given.embeds)
