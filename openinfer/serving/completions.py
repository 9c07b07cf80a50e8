"""OpenAI legacy Completions (`/v1/completions`): raw prompts, no chat template (deepseek-recipe has no such
protocol, so the request model and response shapes live here)."""

from __future__ import annotations

import time
from typing import AsyncIterator

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from openinfer.outputs import RequestOutput
from openinfer.sampling_params import SamplingParams
from openinfer.serving.async_engine import AsyncLLMEngine
from openinfer.serving.errors import APIError
from openinfer.structured_output.compiler import wait_compiled
from openinfer.tokenizer import Tokenizer


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class CompletionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model: str
    prompt: str | list[int] | list[str]
    max_tokens: int | None = 16      # unset: 16 or what fits in the context; null: up to the context
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    ignore_eos: bool = False
    user: str | None = None          # an end-user id for abuse tracking: accepted, not used
    # constrained output: vLLM's {"json"|"json_object"|"regex"|"grammar"|"choice": ...}, or OpenAI's
    # response_format ({"type": "json_object"} / {"type": "json_schema", "json_schema": {"schema": ...}})
    structured_outputs: dict | None = None
    response_format: dict | None = None


def _validation_message(e: ValidationError) -> tuple[str, str | None]:
    err = e.errors()[0]
    loc = ".".join(str(x) for x in err.get("loc", ()))
    return f"{loc}: {err.get('msg')}" if loc else str(err.get("msg")), loc or None


class CompletionsFrontend:
    def __init__(self, engine: AsyncLLMEngine, tokenizer: Tokenizer, served_name: str):
        self.engine = engine
        self.tokenizer = tokenizer
        self.served_name = served_name

    def prepare(self, body: dict) -> tuple[CompletionRequest, list[int], SamplingParams]:
        try:
            req = CompletionRequest.model_validate(body)
        except ValidationError as e:
            msg, loc = _validation_message(e)
            raise APIError(400, msg, param=loc) from None
        if req.n != 1:
            raise APIError(400, f"n={req.n} is not supported: only n=1 (one choice per request)", param="n")
        if req.echo:
            raise APIError(400, "echo=true is not supported", param="echo")
        if req.stream_options is not None and not req.stream:
            raise APIError(400, "stream_options is only allowed with stream=true", param="stream_options")
        prompt = req.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise APIError(400, "a list of several prompts is not supported; send one request per prompt",
                               param="prompt")
            prompt = prompt[0]
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        try:
            self.engine.engine.validate_prompt(ids)
            max_tokens = self._max_tokens(req, len(ids))
            params = SamplingParams(
                temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
                max_tokens=max_tokens, min_tokens=req.min_tokens, stop=req.stop, seed=req.seed,
                logprobs=req.logprobs, presence_penalty=req.presence_penalty,
                frequency_penalty=req.frequency_penalty, repetition_penalty=req.repetition_penalty,
                ignore_eos=req.ignore_eos, structured_outputs=self._structured_outputs(req))
        except (ValueError, TypeError) as e:
            param = "structured_outputs" if "structured_outputs" in str(e) else "prompt" if "prompt" in str(e) else None
            raise APIError(400, str(e), param=param) from None
        return req, ids, params

    @staticmethod
    def _structured_outputs(req: CompletionRequest) -> dict | None:
        rf = req.response_format
        if rf is None or rf.get("type") == "text":
            return req.structured_outputs
        if req.structured_outputs is not None:
            raise APIError(400, "give structured_outputs or response_format, not both", param="response_format")
        if rf.get("type") == "json_object":
            return {"json_object": True}
        if rf.get("type") == "json_schema" and isinstance(rf.get("json_schema"), dict) and "schema" in rf["json_schema"]:
            return {"json": rf["json_schema"]["schema"]}
        raise APIError(400, "response_format must be {'type': 'text' | 'json_object'} or {'type': 'json_schema', "
                            "'json_schema': {'schema': ...}}", param="response_format")

    async def _wait_compiled(self, params: SamplingParams) -> None:
        if params.structured_outputs is not None:   # a grammar that does not compile is a 400, before any work
            await wait_compiled(self.engine.engine.structured_output.pool, params.structured_outputs)

    def _max_tokens(self, req: CompletionRequest, prompt_tokens: int) -> int | None:
        """Checked before any work, as OpenAI and vLLM do: a requested max_tokens that does not fit beside the
        prompt is a 400 naming the numbers; an unset one is lowered to what fits."""
        limit = self.engine.engine.max_model_len
        if "max_tokens" not in req.model_fields_set:
            return max(1, min(req.max_tokens, limit - prompt_tokens))
        if req.max_tokens is not None and prompt_tokens + req.max_tokens > limit:
            raise APIError(400, f"This model's maximum context length is {limit} tokens. However, you requested "
                                f"{prompt_tokens + req.max_tokens} tokens ({prompt_tokens} in the prompt, "
                                f"{req.max_tokens} in the completion). Please reduce the length of the prompt "
                                f"or completion.", param="max_tokens")
        return req.max_tokens

    @staticmethod
    def _logprobs(c, start_offset: int, top_n: int) -> dict | None:
        if c.logprobs is None:
            return None
        tokens, token_lps, tops, offsets = [], [], [], []
        off = start_offset
        for tid, entry in zip(c.token_ids, c.logprobs):
            lp = entry[tid]
            tokens.append(lp.decoded_token)
            token_lps.append(lp.logprob)
            tops.append({e.decoded_token: e.logprob for e in entry.values() if e.rank is not None and e.rank <= top_n})
            offsets.append(off)
            off += len(lp.decoded_token or "")
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    def _chunk(self, rid: str, created: int, text: str, logprobs, finish_reason) -> dict:
        return {"id": rid, "object": "text_completion", "created": created, "model": self.served_name,
                "choices": [{"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}],
                "usage": None}

    @staticmethod
    def _usage(prompt_tokens: int, completion_tokens: int, cached: int) -> dict:
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens, "prompt_tokens_details": {"cached_tokens": cached}}

    async def stream(self, req: CompletionRequest, ids: list[int], params: SamplingParams) -> AsyncIterator[dict]:
        await self._wait_compiled(params)
        rid, created = self.engine.new_request_id("cmpl"), int(time.time())
        n_out, text_len, last = 0, 0, None
        async for out in self.engine.generate(ids, params, rid):
            c = out.outputs[0]
            n_out += len(c.token_ids)
            yield self._chunk(rid, created, c.text, self._logprobs(c, text_len, params.logprobs or 0), c.finish_reason)
            text_len += len(c.text)
            last = out
        if req.stream_options is not None and req.stream_options.include_usage and last is not None:
            chunk = self._chunk(rid, created, "", None, None)
            chunk["choices"] = []
            chunk["usage"] = self._usage(len(ids), n_out, last.num_cached_tokens)
            yield chunk

    async def complete(self, req: CompletionRequest, ids: list[int], params: SamplingParams) -> dict:
        await self._wait_compiled(params)
        rid, created = self.engine.new_request_id("cmpl"), int(time.time())
        text, token_ids, lps, last = [], [], [], None
        out: RequestOutput
        async for out in self.engine.generate(ids, params, rid):
            c = out.outputs[0]
            text.append(c.text)
            token_ids += c.token_ids
            if c.logprobs is not None:
                lps += c.logprobs
            last = out
        c = last.outputs[0]
        c.text, c.token_ids, c.logprobs = "".join(text), token_ids, (lps if params.logprobs is not None else None)
        body = self._chunk(rid, created, c.text, self._logprobs(c, 0, params.logprobs or 0), c.finish_reason)
        body["usage"] = self._usage(len(ids), len(token_ids), last.num_cached_tokens)
        return body
