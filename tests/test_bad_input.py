"""Bad input: a clear error naming the problem; the engine stays usable and leaks no blocks."""

from __future__ import annotations


import pytest

from openinfer import LLM, SamplingParams
from openinfer.loader.gguf_convert import GGUFError
from tests.conftest import assert_pool_idle


@pytest.mark.parametrize("kwargs, field", [
    (dict(temperature=-0.1), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(min_p=1.5), "min_p"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(min_tokens=-1), "min_tokens"),
    (dict(min_tokens=5, max_tokens=2), "min_tokens"),
    (dict(presence_penalty=3.0), "presence_penalty"),
    (dict(frequency_penalty=-2.5), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(logprobs=-1), "logprobs"),
    (dict(prompt_logprobs=-3), "prompt_logprobs"),
    (dict(stop=[""]), "stop"),
    (dict(stop_token_ids=[-4]), "stop_token_ids"),
    (dict(n=0), "n"),
    (dict(n=129), "n"),
])
def test_bad_sampling_values_name_the_field(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_bad_prompts_leave_engine_usable(llm):
    with pytest.raises(ValueError, match="empty"):
        llm.generate("", SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate(prompt_token_ids=[[1] * (llm.engine.max_model_len + 1)], use_tqdm=False)
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate(prompt_token_ids=[[1, 2, 10**9]], use_tqdm=False)
    # one bad prompt in a batch: nothing from that batch is queued
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        llm.generate(["fine prompt", ""], use_tqdm=False)
    with pytest.raises(ValueError, match="sampling params"):
        llm.generate(["a", "b"], [SamplingParams()], use_tqdm=False)
    assert_pool_idle(llm.engine)
    out = llm.generate("Still working?", SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
    assert_pool_idle(llm.engine)


def test_duplicate_request_id_is_rejected(llm):
    eng = llm.engine
    eng.add_request([1, 2, 3], SamplingParams(max_tokens=1), request_id="dup")
    with pytest.raises(ValueError, match="already in use"):
        eng.add_request([4, 5], SamplingParams(max_tokens=1), request_id="dup")
    while eng.has_unfinished_requests():
        eng.step()
    assert_pool_idle(eng)


def test_unknown_model_and_option(tmp_path):
    with pytest.raises(ValueError, match="unknown model 'no-such-model'"):
        LLM("no-such-model", device="cpu")
    with pytest.raises(ValueError, match="config.json"):
        LLM(str(tmp_path), device="cpu")
    with pytest.raises(TypeError, match="max_num_seq"):
        LLM(device="cpu", max_num_seq=4)


def test_corrupt_and_truncated_gguf(tmp_path, smollm_gguf):
    truncated = tmp_path / "truncated.gguf"
    with open(smollm_gguf, "rb") as src, open(truncated, "wb") as dst:
        dst.write(src.read(5_000_000))
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"not a gguf file at all" * 100)
    for path in (truncated, garbage):
        with pytest.raises(GGUFError, match=path.name):
            LLM(str(path), device="cpu", cache_dir=str(tmp_path / "cache"))
    assert not list((tmp_path / "cache" / "converted").glob("*/config.json"))   # nothing half-converted kept


def test_too_small_kv_budget(smollm_dir):
    with pytest.raises(ValueError, match="KV budget"):
        LLM(str(smollm_dir), device="cpu", kv_cache_memory_bytes=1000)
    with pytest.raises(ValueError, match="does not fit the KV pool"):
        LLM(str(smollm_dir), device="cpu", num_kv_blocks=2, block_size=16, max_model_len=64)
