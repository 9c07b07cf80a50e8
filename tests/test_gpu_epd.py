"""EPD on CUDA (`pytest -m gpu`, on the device; docs/vision.md): `deepseek-v41-tiny`'s vision tower alone, as a
vision-encoder instance runs it (models/deepseek_v41/image_encoder.py, serving/encoder_server.py), gives the whole
model's rows to the bit in bf16 on the GPU, over `POST /v1/encode` too; a request bringing those rows gives the
logprobs of one encoded by the engine itself. (The CPU path is tested against DeepSeek's reference and end to end
on loopback: tests/test_deepseek_v41_vision.py, tests/test_serving_epd.py.)"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from openinfer import LLM, SamplingParams  # noqa: E402


@pytest.fixture(scope="module")
def llm():
    llm = LLM("deepseek-v41-tiny", device="cuda", enable_prefix_caching=False)
    yield llm
    llm.shutdown()


def _image(engine, seed: int, side: int = 448):
    source = engine.model_source
    processor = source.family.image_processor(source.hf_config)
    pixels = np.random.default_rng(seed).integers(0, 256, (side, side, 3), dtype=np.uint8)
    ids, (image,) = processor.expand([0, 11, 12, processor.image_token_id, 13, 14], [pixels])
    return ids, image


def _run(engine, ids, image):
    engine.runner.encoder_cache._entries.clear()     # nothing cached: the rows come from the request or the tower
    engine.runner.encoder_cache.bytes = 0
    engine.add_request(ids, SamplingParams(temperature=0, ignore_eos=True, max_tokens=6, logprobs=5),
                       images=(image,))
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                c = out.outputs[0]
                return c.token_ids, [{t: lp.logprob for t, lp in s.items()} for s in c.logprobs]


def test_the_encoder_alone_gives_the_models_rows_and_they_place_as_its_own(llm):
    engine = llm.engine
    source = engine.model_source
    tower = source.family.build_image_encoder(source, engine.config, torch.device("cuda"))
    ids, image = _image(engine, seed=1)
    rows = tower.embed_image(image)
    assert rows.device.type == "cuda" and rows.dtype == torch.bfloat16
    assert torch.equal(rows, engine.runner.model.embed_image(image))
    local = _run(engine, ids, image)
    encoded, given = engine.runner.images_encoded, engine.runner.images_given
    remote = _run(engine, ids, dataclasses.replace(image, embeds=rows.cpu()))
    assert remote == local
    assert (engine.runner.images_encoded, engine.runner.images_given) == (encoded, given + 1)


def test_an_encoder_instance_on_cuda_answers_the_towers_rows(llm):
    from fastapi.testclient import TestClient

    from openinfer.serving.api_server import ServerConfig
    from openinfer.serving.encoder_server import EncoderService, build_encoder_app
    from openinfer.serving.encoder_wire import DIGEST_HEADER, ENCODE_PATH, pack_image, unpack_embeds

    engine = llm.engine
    service = EncoderService.load(engine.config, engine.model_source)
    _, image = _image(engine, seed=2, side=672)
    with TestClient(build_encoder_app(service, ServerConfig(role="encoder"), "tiny")) as client:
        for cache in ("miss", "hit"):
            r = client.post(ENCODE_PATH, content=pack_image(image), headers={DIGEST_HEADER: image.digest.hex()})
            assert r.status_code == 200 and r.headers["x-encoder-cache"] == cache
            assert torch.equal(unpack_embeds(r.content, image), engine.runner.model.embed_image(image).cpu())
        assert client.get("/load").json()["images_encoded"] == 1
