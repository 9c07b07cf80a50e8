"""EPD on loopback (docs/vision.md): two vision-encoder instances (`openinfer serve deepseek-v41-tiny --role encoder`,
real processes) and a `both` instance sending them its images (`encoders=...`), against a single `both` instance that
encodes its own, through the real `openai` client. The encoder instances return the rows the instance's own tower
computes, so answers match to the bit; the prefill side picks the encoder with the fewest patches in flight; a
killed encoder costs no request (another one takes the image, or the instance encodes it itself)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import openai
import pytest
import torch

from openinfer.multimodal import ImageSpan
from openinfer.serving.api_server import ServerConfig
from openinfer.serving.encoder_pool import EncoderPool
from openinfer.serving.encoder_wire import (DIGEST_HEADER, ENCODE_PATH, model_identity, pack_embeds, pack_image,
                                            unpack_embeds, unpack_image)
from tests.live_server import LiveServer, _free_port, wait_up
from tests.test_server_vision import data_url, png

MODEL = "DeepSeek-V4.1-Flash"
# the same engine on both sides; no prefix caching, so neither server's earlier requests change a later answer
ENGINE = dict(max_num_seqs=4, block_size=32, max_num_batched_tokens=256, enable_prefix_caching=False)


# ---- pure parts ------------------------------------------------------------------------------------------------
def _image(seed: int = 0, grid=(5, 7), p: int = 14) -> ImageSpan:
    from openinfer.models.deepseek_v41.vision import image_token_types, token_grid

    patches = (torch.rand((grid[0] * grid[1], 3, p, p), generator=torch.Generator().manual_seed(seed)) * 2 - 1)
    return ImageSpan.make(7, image_token_types(*token_grid(grid, 3)), patches.bfloat16(), grid)


def test_the_wire_carries_the_image_and_its_rows_and_refuses_what_does_not_fit():
    image = _image()
    got = unpack_image(pack_image(image), image.digest.hex())
    assert got.digest == image.digest and got.grid == image.grid and torch.equal(got.patches, image.patches)
    with pytest.raises(ValueError, match="disagree on what the image is"):
        unpack_image(pack_image(image), _image(seed=1).digest.hex())
    with pytest.raises(ValueError, match="not safetensors"):
        unpack_image(b"\x00" * 16, None)
    rows = torch.randn(image.num_tokens, 64).bfloat16()
    assert torch.equal(unpack_embeds(pack_embeds(rows), image), rows)
    with pytest.raises(ValueError, match="for a 4-position span"):
        unpack_embeds(pack_embeds(rows), _image(grid=(3, 3)))
    assert model_identity({"dim": 1, "a": 2}) == model_identity({"a": 2, "dim": 1}) != model_identity({"dim": 2})


def _pool(answers: dict, **kw) -> EncoderPool:
    """A pool over fake encoders: `answers[url]` is a /load dict, an exception, or for /v1/encode a callable."""
    def handler(request: httpx.Request):
        url = f"{request.url.scheme}://{request.url.netloc.decode()}"
        a = answers[url][request.url.path]
        if isinstance(a, Exception):
            raise a
        return a(request) if callable(a) else httpx.Response(200, json=a)
    return EncoderPool(list(answers), "me", health_failures=1, transport=httpx.MockTransport(handler),
                       sync_transport=httpx.MockTransport(handler), **kw)


def _load(identity="me", role="encoder", patches=0):
    return {"role": role, "model": "m", "model_identity": identity, "image_patches_in_flight": patches}


def test_the_pool_refuses_other_roles_and_models_and_starts_the_silent_ones_drained():
    with pytest.raises(ValueError, match="another model"):
        _pool({"http://a": {"/load": _load(identity="other")}}).verify()
    with pytest.raises(ValueError, match="its role is 'both'"):
        _pool({"http://a": {"/load": _load(role="both")}}).verify()
    pool = _pool({"http://a": {"/load": _load()}, "http://b": {"/load": httpx.ConnectError("no")}})
    pool.verify()
    assert [g.healthy for g in pool.loads.gpus] == [True, False]
    assert "not answering at start" in pool.describe()[1]["reason"]


def _encode_through(pool: EncoderPool, image: ImageSpan) -> ImageSpan:
    import asyncio

    async def go():
        await pool.start()
        try:
            return (await pool.encode((image,)))[0]
        finally:
            await pool.stop()
    pool.verify()
    return asyncio.run(go())


def test_an_image_goes_to_the_next_encoder_when_one_fails_and_is_encoded_here_when_none_is_left():
    image = _image()
    rows = torch.randn(image.num_tokens, 64)

    def answer(content: bytes, status: int = 200):
        return lambda request: httpx.Response(status, content=content)
    failures = {"refused": httpx.ConnectError("refused"), "busy": answer(b"", 429),
                "wrong rows": answer(pack_embeds(rows[:3]))}
    for name, failure in failures.items():
        pool = _pool({"http://a": {"/load": _load(), ENCODE_PATH: failure},
                      "http://b": {"/load": _load(patches=10), ENCODE_PATH: answer(pack_embeds(rows))}})
        got = _encode_through(pool, image)
        assert torch.equal(got.embeds, rows), name                      # a (fewest patches) failed; b answered
        assert pool.m_retries._value.get() == 1 and pool.m_local._value.get() == 0
        assert all(g.patches_in_flight == 0 for g in pool.loads.gpus)
    pool = _pool({"http://a": {"/load": _load(), ENCODE_PATH: httpx.ConnectError("refused")}})
    assert _encode_through(pool, image).embeds is None                  # the engine encodes it itself
    assert pool.m_local._value.get() == 1 and not pool.instances["http://a"].healthy


def test_an_encoder_instance_takes_no_engine_options_and_no_encoders(capsys):
    from openinfer.entrypoints.cli import main

    assert main(["serve", "deepseek-v41-tiny", "--role", "encoder", "--device", "cpu", "--max-num-seqs", "3"]) == 2
    assert "none of --max-num-seqs" in capsys.readouterr().err
    with pytest.raises(ValueError, match="an encoder instance"):
        ServerConfig(role="encoder", encoders=["http://a"])
    with pytest.raises(ValueError, match="distinct"):
        ServerConfig(encoders=["http://a", "http://a/"])


# ---- real processes ----------------------------------------------------------------------------------------------
def _encoder_process(log: str) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    cmd = [sys.executable, "-m", "openinfer", "serve", "deepseek-v41-tiny", "--role", "encoder", "--device", "cpu",
           "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})
    return proc, f"http://127.0.0.1:{port}"


@pytest.fixture(scope="module")
def epd(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("epd")
    procs = [_encoder_process(str(tmp / f"encoder{i}.log")) for i in range(2)]
    urls = [url for _, url in procs]
    threads = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"           # the engine cores' processes (tiny shapes, a busy machine)
    try:
        with ThreadPoolExecutor(2) as pool:       # both engine cores start at once
            ref = pool.submit(LiveServer, "deepseek-v41-tiny", **ENGINE)
            epd_server = pool.submit(LiveServer, "deepseek-v41-tiny", server_options=dict(
                encoders=urls, encoder_health_interval_s=0.3, encoder_timeout_s=30), **ENGINE)
            ref, epd_server = ref.result(), epd_server.result()
    finally:
        if threads is None:
            os.environ.pop("OMP_NUM_THREADS")
        else:
            os.environ["OMP_NUM_THREADS"] = threads
    try:
        with ref, epd_server:
            for i, (proc, url) in enumerate(procs):
                wait_up(url, 60, proc, str(tmp / f"encoder{i}.log"))
            pool = epd_server.app.state.encoders
            _until(lambda: all(i.healthy for i in pool.instances.values()), 10)
            yield {"ref": ref, "epd": epd_server, "pool": pool, "urls": urls, "procs": [p for p, _ in procs]}
    finally:
        for proc, _ in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=20)


def _until(cond, timeout: float) -> None:
    deadline = time.time() + timeout
    while not cond():
        if time.time() > deadline:
            raise AssertionError("timed out waiting")
        time.sleep(0.02)


def _chat(server: LiveServer, image: bytes, stream: bool = False, text: str = "What is in the picture?"):
    """The answer's text (reasoning included: V4.1 thinks first, and samples there at temperature 1 whatever the
    request says: a seed makes it the same on both servers) and, not streamed, each token's logprob and top 2."""
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x")
    messages = [{"role": "user", "content": [{"type": "text", "text": text},
                                             {"type": "image_url", "image_url": {"url": data_url(image)}}]}]
    if stream:
        chunks = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, seed=0,
                                                stream=True)
        deltas = [c.choices[0].delta.model_dump() for c in chunks if c.choices]
        return "".join((d.get("reasoning_content") or "") + (d.get("content") or "") for d in deltas), None
    r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, seed=0, logprobs=True,
                                       top_logprobs=2).model_dump()["choices"][0]
    tokens = [t for part in ("reasoning_content", "content") for t in r["logprobs"].get(part) or ()]
    answer = (r["message"].get("reasoning_content") or "") + (r["message"]["content"] or "")
    return answer, [(t["token"], t["logprob"], [(a["token"], a["logprob"]) for a in t["top_logprobs"]])
                    for t in tokens]


def _stats(server: LiveServer) -> dict:
    return server.engine.call("stats")


def _encoded(url: str) -> int:
    return httpx.get(url + "/load", timeout=5).json()["images_encoded"]


def _metric(server: LiveServer, name: str) -> float:
    text = httpx.get(server.base_url + "/metrics", timeout=5).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name))


def _max_logprob_diff(a, b) -> float:
    assert [t for t, _, _ in a] == [t for t, _, _ in b]
    diffs = [abs(x - y) for (_, x, _), (_, y, _) in zip(a, b)]
    diffs += [abs(x - y) for (_, _, ta), (_, _, tb) in zip(a, b) for (_, x), (_, y) in zip(ta, tb)]
    return max(diffs)


def test_images_through_encoder_instances_equal_one_instance(epd):
    ref, server, urls = epd["ref"], epd["epd"], epd["urls"]
    load = httpx.get(urls[0] + "/load", timeout=5).json()
    assert load["role"] == "encoder" and load["image_patches_in_flight"] == 0
    assert httpx.get(urls[0] + "/health").json() == {"status": "ok", "role": "encoder"}
    before, encoded = _stats(server), sum(_encoded(u) for u in urls)
    image = png(60, 40, seed=11)
    want, want_lp = _chat(ref, image)
    got, got_lp = _chat(server, image)
    assert got == want and want
    assert _max_logprob_diff(got_lp, want_lp) == 0.0        # the encoder's rows are the tower's own bits
    second = png(50, 70, seed=12)
    assert _chat(server, second, stream=True)[0] == _chat(ref, second, stream=True)[0]
    after = _stats(server)
    # both images' rows came from the encoder instances; the instance's own tower ran for none
    assert after["images_given"] - before["images_given"] == 2
    assert after["images_encoded"] == before["images_encoded"]
    assert sum(_encoded(u) for u in urls) - encoded == 2
    epd_load = httpx.get(server.base_url + "/load", timeout=5).json()
    assert [e["healthy"] for e in epd_load["encoders"]] == [True, True]
    assert _metric(server, "openinfer:encoder_images_sent_total") == 2


def test_the_encoder_with_the_fewest_patches_in_flight_gets_the_image(epd):
    """Another client keeps encoder 0 busy with a large image: its /load reports the patches in flight, the `both`
    instance reads it and sends its own image to encoder 1."""
    server, pool, urls = epd["epd"], epd["pool"], epd["urls"]
    source = server.engine.model_source
    processor = source.family.image_processor(source.hf_config)
    pixels = np.random.default_rng(5).integers(0, 256, (700, 700, 3), dtype=np.uint8)   # 50 x 50 patches: busy
    # for seconds (the tiny tower's attention over every patch is most of it), long past the next health check
    big = processor.expand([processor.image_token_id], [pixels])[1][0]
    body = pack_image(big)
    direct = threading.Thread(target=lambda: httpx.post(urls[0] + ENCODE_PATH, content=body, timeout=60,
                                                        headers={DIGEST_HEADER: big.digest.hex()}))
    encoded = [_encoded(u) for u in urls]
    direct.start()
    _until(lambda: pool.loads.gpus[0].reported_patches == big.num_patches, 10)    # the instance's view of encoder 0
    assert httpx.get(urls[0] + "/load", timeout=5).json()["image_patches_in_flight"] == big.num_patches
    got, _ = _chat(server, png(40, 40, seed=13))
    assert got
    direct.join(timeout=60)
    assert [_encoded(u) - e for u, e in zip(urls, encoded)] == [1, 1]         # the big one, and the request's
    assert all(g.patches_in_flight == 0 for g in pool.loads.gpus)


def test_bench_serve_sends_a_generated_image_with_each_prompt(epd):
    """`openinfer bench serve --prompt-mode image --image-size WxH` through the EPD instance: every request carries
    its own image (a new one each: encoded by the encoders, none here), usage counts the image tokens."""
    from openinfer.benchmarks.serve import ServeBenchConfig, run_serve_bench

    server = epd["epd"]
    before = _stats(server)
    cfg = ServeBenchConfig(base_url=server.base_url, num_prompts=2, max_concurrency=2, input_len=4, output_len=2,
                           prompt_mode="image", image_size="60x40")
    result = run_serve_bench(cfg, quiet=True)
    assert (result["completed"], result["failed"]) == (2, 0) and result["ttft_ms"]["p50"] > 0
    assert result["input_tokens"] > 2 * 189                       # a 60x40 picture is planned at 189 positions
    after = _stats(server)
    assert (after["images_given"] - before["images_given"], after["images_encoded"]) == (2, before["images_encoded"])
    with pytest.raises(ValueError, match="--endpoint chat"):
        ServeBenchConfig(endpoint="completions", prompt_mode="image", image_size="60x40")
    with pytest.raises(ValueError, match="WxH"):
        ServeBenchConfig(prompt_mode="image", image_size="60")


def test_a_killed_encoder_instance_costs_no_request(epd):
    """Encoder 0 dies with the request's image in flight: the image goes to encoder 1. Then encoder 1 dies too: the
    instance encodes the next image itself. Every answer equals the single instance's."""
    ref, server, pool, procs = epd["ref"], epd["epd"], epd["pool"], epd["procs"]
    retries, local = _metric(server, "openinfer:encoder_retries_total"), _metric(
        server, "openinfer:encoder_local_fallbacks_total")
    image = png(60, 40, seed=14)
    answer: dict = {}
    request = threading.Thread(target=lambda: answer.update(got=_chat(server, image)))
    request.start()
    _until(lambda: pool.loads.gpus[0].patches_in_flight > 0, 30)       # picked for encoder 0, on its way there
    procs[0].send_signal(signal.SIGKILL)
    request.join(timeout=60)
    assert not request.is_alive()
    want = _chat(ref, image)
    assert answer["got"][0] == want[0] and _max_logprob_diff(answer["got"][1], want[1]) == 0.0
    assert _metric(server, "openinfer:encoder_retries_total") == retries + 1
    assert not pool.instances[epd["urls"][0]].healthy                 # drained by the failed call itself

    procs[1].send_signal(signal.SIGKILL)
    before = _stats(server)
    image = png(60, 40, seed=15)
    got, want = _chat(server, image), _chat(ref, image)
    assert got[0] == want[0] and _max_logprob_diff(got[1], want[1]) == 0.0
    assert _stats(server)["images_encoded"] == before["images_encoded"] + 1       # encoded here
    assert _metric(server, "openinfer:encoder_local_fallbacks_total") == local + 1
    assert httpx.get(server.base_url + "/health", timeout=5).status_code == 200
