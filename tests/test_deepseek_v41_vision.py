"""DeepSeek-V4.1 with its vision tower, against DeepSeek's reference (vendored read-only in ../shared/reference): a
tiny V4.1 whose ViT + Aligner (2 blocks, 4x4-pixel patches, the release's 3x3 Aligner) the reference builds, seeds
and runs in bf16; its state dict is written in the published layout and loaded by openinfer. Images are given as
the reference's tests give them: patches and a span of image-token positions (docs/vision.md).

Tolerances are those of the text tests (tests/test_deepseek_v41.py): a whole prompt in one chunk is equal to the
reference's prefill; chunked prefill computes the same values through other GEMM shapes, where an FP8/FP4 rounding
step can turn a last-bit difference into one quantization step, so it is held to the reference's greedy token and
the random-chunk bound (at most 1 position in 20 above 0.1, none above 1.0).
"""

from __future__ import annotations

import pytest
import torch

from openinfer.multimodal import ImageSpan
from openinfer.sampling_params import SamplingParams
from tests.conftest import assert_pool_idle
from tests.test_deepseek_v4 import run_recording
from tests.test_deepseek_v41 import GREEDY, _reference, build_reference, prompts_of, save_published, stable_topk, \
    v41_engine

VISION = dict(vision_n_layers=2, vision_dim=64, vision_n_heads=4, vision_inter_dim=96, vision_patch_size=4,
              vision_downsample_ratio=3)
IMAGE_ID = 129264
WHOLE = (512, 512)


def make_image(seed: int, grid: tuple[int, int], offset: int, p: int = 4) -> ImageSpan:
    """A random image of `grid` patches (as the reference's preprocessing leaves pixels: bf16 in [-1, 1]) whose
    span starts at prompt position `offset`."""
    from openinfer.models.deepseek_v41.vision import image_token_types, token_grid

    g = torch.Generator().manual_seed(seed)
    patches = (torch.rand((grid[0] * grid[1], 3, p, p), generator=g) * 2 - 1).bfloat16()
    return ImageSpan.make(offset, image_token_types(*token_grid(grid, 3)), patches, grid)


def image_prompt(text: list[int], images: list[ImageSpan]) -> list[int]:
    """`text` with each image's span of image-token ids inserted at its offset (offsets in the result)."""
    out, it = [], iter(text)
    for img in images:
        while len(out) < img.offset:
            out.append(next(it))
        out += [IMAGE_ID] * img.num_tokens
    return out + list(it)


def reference_image_logits(model, ids: list[int], images: list[ImageSpan]) -> torch.Tensor:
    """The reference's prefill logits of every position, its images given as its own `ImageInput`s."""
    R, _ = _reference()
    from reference.deepseek_v41.image_processor import TEXT, ImageInput

    types = torch.full((1, len(ids)), TEXT, dtype=torch.int64)
    inputs = []
    for img in images:
        span = torch.tensor(img.token_types, dtype=torch.int64)
        types[0, img.offset:img.end] = span
        inputs.append(ImageInput(img.offset, img.patches, img.grid[0], img.grid[1], span))
    head = model.head.forward
    model.head.forward = lambda x, full_logits=False: head(x, True)
    try:
        with R.set_dtype(torch.bfloat16), stable_topk():
            return model(torch.tensor([ids]), 0, images=[inputs], token_types=types)[1][0]
    finally:
        model.head.forward = head


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """These shapes are too small to share between threads, and OpenMP threads waiting on a busy machine's other
    processes cost seconds per call."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    model, args = build_reference(**VISION)
    return model, save_published(model, args, tmp_path_factory.mktemp("v41vl"))


@pytest.fixture(scope="module")
def vl_unquantized(vl, tmp_path_factory):
    """The same weights as a bf16 checkpoint (run in float32 with unquantized caches: no FP8/FP4 step amplifies
    last-bit noise between two paths that compute the same function)."""
    from tests.test_deepseek_v41 import save_dequantized

    return save_dequantized(vl[1], tmp_path_factory.mktemp("v41vl_bf16"))


@pytest.fixture(scope="module")
def engine(vl):
    return v41_engine(vl[1], dtype="bfloat16")


def run(engine, prompt, images, budgets=WHOLE, max_tokens=1, seed=0):
    """run_recording for one request with images."""
    add = engine.add_request
    engine.add_request = lambda p, params, **kw: add(p, params, images=tuple(images), **kw)
    try:
        (out, logits), = run_recording(engine, [prompt], SamplingParams(max_tokens=max_tokens, **GREEDY),
                                       budgets=budgets, seed=seed)
    finally:
        engine.add_request = add
    return out, logits


def within_chunking_noise(ours: torch.Tensor, ref: torch.Tensor) -> bool:
    per_position = (ours - ref).abs().amax(-1)
    return bool((per_position > 0.1).float().mean() <= 0.05 and per_position.max() < 1.0)


def test_image_prompt_logits_equal_the_reference(vl, engine):
    """Two images (5x7 and 4x6 patches: 2x3 and 2x2 tokens, the Aligner padding both edges of the first), the second
    crossing the 32-token block boundary; one chunk: the reference's logits at every position. Then chunks of 7 and
    11 tokens, which cut through both spans: the same greedy token, logits within the text tests' chunking bound."""
    ref_model, _ = vl
    images = [make_image(1, (5, 7), 5), make_image(2, (4, 6), 28)]
    prompt = image_prompt(prompts_of(40, seed=21)[0], images)
    ref = reference_image_logits(ref_model, prompt, images)
    out, ours = run(engine, prompt, images)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=0)
    assert out.num_cached_tokens == 0
    for budget in (7, 11):
        out, chunked = run(engine, prompt, images, budgets=(budget, budget))
        assert out.outputs[0].token_ids == [int(ref[-1].argmax())]
        assert within_chunking_noise(chunked, ref)
    assert_pool_idle(engine)


def test_a_cached_image_prefix_hits_and_another_image_does_not(vl):
    """A prompt sharing the first 32 positions (text + an image + the start of a second) hits that block; the rest
    of the second image's span is taken from the encoder cache, not encoded again; the logits are the reference's
    for the whole new prompt. The same text with a different first image hits nothing."""
    ref_model, _ = vl
    images = [make_image(3, (5, 7), 5), make_image(4, (4, 6), 28)]
    text = prompts_of(44, seed=22)[0]
    first = image_prompt(text[:40], images)
    engine = v41_engine(vl[1], dtype="bfloat16", enable_prefix_caching=True)
    run(engine, first, images, budgets=(16, 16))
    second = first[:38] + text[40:]                       # the spans end at 38; a different tail
    cache = engine.runner.encoder_cache
    misses = cache.misses
    out, ours = run(engine, second, images, budgets=(16, 16))
    assert out.num_cached_tokens == 32
    assert cache.misses == misses                          # the second image's rows came from the encoder cache
    ref = reference_image_logits(ref_model, second, images)
    assert out.outputs[0].token_ids == [int(ref[-1].argmax())]
    assert within_chunking_noise(ours, ref[32:])
    other = [make_image(5, (5, 7), 5), images[1]]
    out, _ = run(engine, second, other, budgets=(16, 16))
    assert out.num_cached_tokens == 0
    assert_pool_idle(engine)


def test_image_rows_are_routed_with_the_vision_bias(vl, engine):
    """bias_vl is live: routing the image rows with the text bias instead changes the logits."""
    images = [make_image(6, (4, 6), 3)]
    prompt = image_prompt(prompts_of(20, seed=23)[0], images)
    _, base = run(engine, prompt, images)
    gate = engine.runner.model.layers[1].ffn.gate
    saved = gate.bias_vl.data.clone()
    gate.bias_vl.data.copy_(gate.bias.data)
    try:
        _, text_routed = run(engine, prompt, images)
    finally:
        gate.bias_vl.data.copy_(saved)
    assert not torch.equal(text_routed, base)


def test_bad_images_are_refused_naming_the_problem_and_leave_the_engine_idle(vl, engine):
    good = make_image(7, (4, 6), 2)
    prompt = image_prompt(prompts_of(10, seed=24)[0], [good])
    params = SamplingParams(max_tokens=1, **GREEDY)
    wrong_grid = ImageSpan.make(2, good.token_types, good.patches[:12], (4, 3))      # 2x1 tokens, not 2x2
    cases = [
        ((ImageSpan.make(2, good.token_types, good.patches, good.grid),), prompt[:5], "inside the 5-token prompt"),
        ((wrong_grid,), prompt, "token layout does not match"),
        ((ImageSpan.make(0, good.token_types, good.patches, good.grid),), prompt, "image token id"),
        ((good, good), prompt, "after the previous image"),
    ]
    for images, p, message in cases:
        with pytest.raises(ValueError, match=message):
            engine.add_request(p, params, images=images)
    assert not engine.has_unfinished_requests()
    assert_pool_idle(engine)


def test_a_text_model_refuses_images_by_name():
    from openinfer.config import EngineConfig
    from openinfer.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model="deepseek-v4-tiny", device="cpu", num_kv_blocks=8))
    with pytest.raises(ValueError, match="does not take images"):
        engine.add_request([IMAGE_ID] * 8, SamplingParams(max_tokens=1), images=(make_image(8, (3, 3), 0),))
    assert not engine.has_unfinished_requests()


def test_preemption_and_chunking_through_images_keep_outputs(vl_unquantized):
    """Unquantized (the bf16 checkpoint in float32, caches unrounded: no FP8/FP4 step amplifies last-bit noise):
    two image prompts preempted in a pool too small for both, and run in chunks of 24, give the tokens and logprobs
    they get alone in one chunk."""
    path = vl_unquantized
    images = [[make_image(9, (4, 6), 4)], [make_image(10, (5, 7), 30), make_image(11, (3, 3), 45)]]
    prompts = [image_prompt(t, im) for t, im in zip(prompts_of(50, 40, seed=25), images)]
    params = SamplingParams(max_tokens=6, logprobs=0, **GREEDY)

    def run_all(engine, budgets):
        add = engine.add_request
        queue = iter(images)
        engine.add_request = lambda p, prm, **kw: add(p, prm, images=tuple(next(queue)), **kw)
        try:
            return run_recording(engine, prompts, params, budgets=budgets)
        finally:
            engine.add_request = add

    alone = []
    big = v41_engine(path, kv_cache_dtype="float32")
    for p, im in zip(prompts, images):
        add = big.add_request
        big.add_request = lambda q, prm, im=im, **kw: add(q, prm, images=tuple(im), **kw)
        try:
            alone += run_recording(big, [p], params, budgets=WHOLE)
        finally:
            big.add_request = add
    small = v41_engine(path, kv_cache_dtype="float32", num_kv_blocks=3, max_num_seqs=2, max_num_batched_tokens=64)
    together = run_all(small, (24, 24))
    assert small.scheduler.num_preemptions > 0
    for (oa, _), (ob, _) in zip(alone, together):
        assert ob.outputs[0].token_ids == oa.outputs[0].token_ids
        for a, b, t in zip(oa.outputs[0].logprobs, ob.outputs[0].logprobs, oa.outputs[0].token_ids):
            assert abs(a[t].logprob - b[t].logprob) < 1e-4
    assert_pool_idle(small)


def test_yoco_prefill_with_images_equals_exact(vl_unquantized):
    """YOCO (docs/deepseek_v41.md): the decoder layers run over the prompt's last `keep` tokens only, and the image
    mask (bias_vl routing, Engram's dead rows) follows those rows. Its documented property holds with images as
    with text (tests/test_deepseek_v41.py): with keep 64 >= (3 decoder layers + 1) x window 16, decode equals exact's
    (tokens, logits within 1e-4) for a prompt with three images: the first before the decoder's tail (position 36),
    cut by a chunk boundary (chunks of 29: the first chunk ends inside it and skips the decoder altogether), the
    second cut by the tail's start and by a chunk boundary (chunks of 40), the third inside the tail, in the last
    positions' window, cut by a chunk boundary (chunks of 29). With keep >= the prompt every position's logits equal
    exact's. The decoder's image mask is live: routing the image rows as text in the first decoder layer changes
    the first decode logits."""
    images = [make_image(12, (5, 7), 22), make_image(13, (4, 6), 34), make_image(15, (4, 6), 84)]
    prompt = image_prompt(prompts_of(74, seed=26)[0], images)       # spans [22, 32), [34, 42), [84, 92)
    assert len(prompt) - 64 == 36
    exact = v41_engine(vl_unquantized, kv_cache_dtype="float32")
    yoco = v41_engine(vl_unquantized, kv_cache_dtype="float32", v41_prefill_mode="yoco", v41_prefill_keep_tokens=64)
    decode = slice(len(prompt) - 1, None)
    ref_out, ref = run(exact, prompt, images, max_tokens=6)
    for budgets in ((29, 29), (40, 40)):
        out, ours = run(yoco, prompt, images, budgets=budgets, max_tokens=6)
        assert out.outputs[0].token_ids == ref_out.outputs[0].token_ids
        torch.testing.assert_close(ours[decode], ref[decode], atol=1e-4, rtol=0)
    short_images = [make_image(14, (4, 6), 20)]
    short = image_prompt(prompts_of(30, seed=27)[0], short_images)     # 38 positions <= keep
    _, short_exact = run(exact, short, short_images, budgets=(16, 16), max_tokens=2)
    _, short_yoco = run(yoco, short, short_images, budgets=(16, 16), max_tokens=2)
    torch.testing.assert_close(short_yoco, short_exact, atol=1e-4, rtol=0)
    model = yoco.runner.model
    gate = model.layers[model.config.yoco_split].ffn.gate
    saved = gate.bias_vl.data.clone()
    gate.bias_vl.data.copy_(gate.bias.data)
    try:
        _, text_routed = run(yoco, prompt, images, budgets=(40, 40))
    finally:
        gate.bias_vl.data.copy_(saved)
    assert (text_routed[-1] - ours[len(prompt) - 1]).abs().max() > 1e-3
    assert_pool_idle(yoco)


def test_the_encoder_alone_reads_only_the_tower_and_its_rows_place_as_the_models_own(vl, engine):
    """EPD's vision-encoder instance (models/deepseek_v41/image_encoder.py): the tower alone, read from the published
    checkpoint (no decoder tensor), gives the whole model's rows to the bit; a request bringing those rows
    (`ImageSpan.embeds`) gives the logits of one encoded here, and the runner runs its own tower for none of it."""
    import dataclasses

    from openinfer.models.deepseek_v41.image_encoder import TOWER_NAMES
    from openinfer.quantization.checkpoint import read_headers

    source = engine.model_source
    tower = source.family.build_image_encoder(source, engine.config, torch.device("cpu"))
    names = {n for n, _ in tower.named_parameters()}
    assert names == {n for n in read_headers(source.path) if n.split(".", 1)[0] in TOWER_NAMES}
    assert sum(p.numel() for p in tower.parameters()) < sum(p.numel() for p in engine.runner.model.parameters()) / 5
    images = [make_image(9, (5, 7), 4)]
    rows = tower.embed_image(images[0])
    assert torch.equal(rows, engine.runner.model.embed_image(images[0]))
    prompt = image_prompt(prompts_of(24, seed=25)[0], images)
    _, local = run(engine, prompt, images)
    runner = engine.runner
    encoded, given = runner.images_encoded, runner.images_given
    runner.encoder_cache._entries.clear()            # (nothing cached: the rows must come from the request)
    runner.encoder_cache.bytes = 0
    _, remote = run(engine, prompt, [dataclasses.replace(images[0], embeds=rows)])
    assert torch.equal(remote, local)
    assert (runner.images_encoded, runner.images_given) == (encoded, given + 1)
    with pytest.raises(ValueError, match="embeddings of shape"):
        engine.add_request(prompt, SamplingParams(max_tokens=1), images=(dataclasses.replace(images[0],
                                                                                           embeds=rows[:, :8]),))
    assert_pool_idle(engine)
