"""OpenAI legacy Completions (`/v1/completions`): raw prompts, no chat template (deepseek-recipe has no such
protocol, so the request model and response shapes live here).

- `prompt`: a string, a list of token ids, or a list of either (several prompts: the choices of prompt p are
  `p * n + i`; each prompt is one engine request).
- `n`: choices per prompt, sharing the prompt's prefill (the engine's parallel sampling; seeds: choice i samples with
  `seed + i`). `best_of` (>= n): that many sequences are sampled and the n with the highest mean token logprob are
  returned, best first (not with `stream`: the best are known only at the end).
- `echo`: each choice's text (and, with `logprobs`, its logprobs) starts with the prompt; `max_tokens: 0` with
  `echo` scores the prompt and generates nothing (how lm-evaluation-harness computes loglikelihoods).
- `logprobs: k`: OpenAI's legacy shape, `tokens` / `token_logprobs` / `top_logprobs` (the k most likely tokens,
  text -> logprob) / `text_offset`, one entry per token; with `echo` the prompt's tokens come first, the first
  one with `null` logprob and top_logprobs (nothing predicts it).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import AsyncIterator

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from openinfer.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from openinfer.sampling_params import MAX_N, SamplingParams
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
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16      # unset: 16 or what fits in the context; null: up to the context
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    n: int = 1
    best_of: int | None = None
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


@dataclass
class Prompt:
    token_ids: list[int]
    text: str                         # as sent, or the token ids decoded (what echo returns)
    params: SamplingParams


@dataclass
class PreparedCompletion:
    req: CompletionRequest
    prompts: list[Prompt]
    n: int                            # choices per prompt
    best_of: int                      # sequences sampled per prompt (the engine's n)
    score_only: bool                  # echo with max_tokens 0: the one token the engine samples is dropped


class CompletionsFrontend:
    def __init__(self, engine: AsyncLLMEngine, tokenizer: Tokenizer, served_name: str):
        self.engine = engine
        self.tokenizer = tokenizer
        self.served_name = served_name

    # ---- request side -----------------------------------------------------------------------------------
    def prepare(self, body: dict) -> PreparedCompletion:
        """Everything checked before any work: a bad field is a 400 naming it."""
        try:
            req = CompletionRequest.model_validate(body)
        except ValidationError as e:
            msg, loc = _validation_message(e)
            raise APIError(400, msg, param=loc) from None
        if not 1 <= req.n <= MAX_N:
            raise APIError(400, f"n must be an integer from 1 to {MAX_N}, got {req.n}", param="n")
        best_of = req.n if req.best_of is None else req.best_of
        if not req.n <= best_of <= MAX_N:
            raise APIError(400, f"best_of must be an integer from n ({req.n}) to {MAX_N}, got {req.best_of}",
                           param="best_of")
        if req.stream and best_of > req.n:
            raise APIError(400, "best_of > n cannot be streamed: the best n sequences are known only at the end",
                           param="best_of")
        if req.stream_options is not None and not req.stream:
            raise APIError(400, "stream_options is only allowed with stream=true", param="stream_options")
        score_only = req.max_tokens == 0 and "max_tokens" in req.model_fields_set
        if score_only and not req.echo:
            raise APIError(400, "max_tokens must be at least 1 (0 only with echo=true, which scores the prompt "
                                "and generates nothing)", param="max_tokens")
        raw = req.prompt
        many = isinstance(raw, list) and bool(raw) and isinstance(raw[0], (str, list))
        prompts = []
        for i, p in enumerate(raw if many else [raw]):
            name = f"prompt[{i}]" if many else "prompt"
            ids = self.tokenizer.encode(p) if isinstance(p, str) else list(p)
            try:
                self.engine.engine.validate_prompt(ids)
            except ValueError as e:
                raise APIError(400, f"{name}: {e}" if many else str(e), param="prompt") from None
            text = p if isinstance(p, str) else self.tokenizer.decode(ids, skip_special_tokens=False)
            prompts.append(Prompt(ids, text, self._params(req, len(ids), best_of, score_only)))
        return PreparedCompletion(req, prompts, req.n, best_of, score_only)

    def _params(self, req: CompletionRequest, prompt_tokens: int, best_of: int, score_only: bool) -> SamplingParams:
        # logprobs of the sampled tokens are what best_of ranks by: computed (0 alternatives) when not asked for
        logprobs = req.logprobs if req.logprobs is not None or best_of == req.n else 0
        try:
            return SamplingParams(
                temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
                max_tokens=1 if score_only else self._max_tokens(req, prompt_tokens),
                min_tokens=0 if score_only else req.min_tokens, stop=req.stop, seed=req.seed,
                logprobs=logprobs, prompt_logprobs=req.logprobs if req.echo else None, n=best_of,
                presence_penalty=req.presence_penalty, frequency_penalty=req.frequency_penalty,
                repetition_penalty=req.repetition_penalty, ignore_eos=req.ignore_eos,
                structured_outputs=self._structured_outputs(req))
        except (ValueError, TypeError) as e:
            msg = str(e)
            param = next((f for f in ("structured_outputs", "max_tokens", "min_tokens", "temperature", "top_p",
                                      "top_k", "min_p", "stop", "presence_penalty", "frequency_penalty",
                                      "repetition_penalty") if f"SamplingParams.{f}" in msg), None)
            raise APIError(400, msg, param=param) from None

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

    async def _wait_compiled(self, p: PreparedCompletion) -> None:
        so = p.prompts[0].params.structured_outputs
        if so is not None:   # a grammar that does not compile is a 400, before any work
            await wait_compiled(self.engine.engine.structured_output.pool, so)

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

    # ---- response side ----------------------------------------------------------------------------------
    def _logprobs(self, entries: list[tuple[int, PositionLogprobs | None]], start_offset: int, top_n: int) -> dict:
        """OpenAI's legacy logprobs of (token id, its logprobs or None) pairs; offsets from `start_offset`."""
        tokens, token_lps, tops, offsets = [], [], [], []
        off = start_offset
        for tid, entry in entries:
            lp = entry.get(tid) if entry is not None else None
            text = lp.decoded_token if lp is not None and lp.decoded_token is not None else None
            text = text if text is not None else self.tokenizer.id_to_token_text(tid)
            tokens.append(text)
            token_lps.append(lp.logprob if lp is not None else None)
            tops.append(None if entry is None else
                        {e.decoded_token: e.logprob for e in entry.values() if e.rank is not None and e.rank <= top_n})
            offsets.append(off)
            off += len(text)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    @staticmethod
    def _prompt_entries(prompt: Prompt, prompt_logprobs) -> list[tuple[int, PositionLogprobs | None]]:
        plp = list(prompt_logprobs or ())
        plp += [None] * (len(prompt.token_ids) - len(plp))
        return list(zip(prompt.token_ids, plp))

    def _choice(self, p: PreparedCompletion, index: int, text: str, finish_reason, generated, offset: int,
                echo_of: tuple[Prompt, object] | None = None) -> dict:
        """One choice: `text` (the new text; preceded by the prompt's when `echo_of` is (prompt, its logprobs)) and,
        when asked for, the logprobs of its tokens, `generated` ((token id, logprobs) pairs) starting at text offset
        `offset` (after the prompt's, which start at 0)."""
        logprobs = None
        if echo_of is not None:
            text = echo_of[0].text + text
            offset += len(echo_of[0].text)
        if p.req.logprobs is not None:
            logprobs = self._logprobs(generated, offset, p.req.logprobs)
            if echo_of is not None:
                head = self._logprobs(self._prompt_entries(*echo_of), 0, p.req.logprobs)
                logprobs = {k: head[k] + logprobs[k] for k in logprobs}
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}

    def _body(self, rid: str, created: int, choices: list[dict]) -> dict:
        return {"id": rid, "object": "text_completion", "created": created, "model": self.served_name,
                "choices": choices, "usage": None}

    @staticmethod
    def _usage(prompt_tokens: int, completion_tokens: int, cached: int) -> dict:
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens, "prompt_tokens_details": {"cached_tokens": cached}}

    def _engine_ids(self, p: PreparedCompletion) -> tuple[str, list[str]]:
        rid = self.engine.new_request_id("cmpl")
        return rid, [rid] if len(p.prompts) == 1 else [f"{rid}-{i}" for i in range(len(p.prompts))]

    async def _run_all(self, p: PreparedCompletion, ids: list[str]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, DELTA output) of every prompt's engine request, as they come; a failure or an early
        stop aborts them all."""
        if len(p.prompts) == 1:
            async for out in self.engine.generate(p.prompts[0].token_ids, p.prompts[0].params, ids[0]):
                yield 0, out
            return
        q: asyncio.Queue = asyncio.Queue()
        done = object()

        async def run(i: int) -> None:
            try:
                async for out in self.engine.generate(p.prompts[i].token_ids, p.prompts[i].params, ids[i]):
                    q.put_nowait((i, out))
                q.put_nowait((i, done))
            except BaseException as e:     # (a cancelled task's generator aborts its request on the way out)
                q.put_nowait((i, e))
                raise

        tasks = [asyncio.create_task(run(i)) for i in range(len(p.prompts))]
        try:
            left = len(tasks)
            while left:
                i, item = await q.get()
                if item is done:
                    left -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield i, item
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def stream(self, p: PreparedCompletion) -> AsyncIterator[dict]:
        await self._wait_compiled(p)
        (rid, ids), created = self._engine_ids(p), int(time.time())
        n_out, cached = 0, [0] * len(p.prompts)
        offsets: dict[int, int] = {}                  # choice -> its text's length so far (text_offset)
        prompt_lps: dict[int, object] = {}
        async for pi, out in self._run_all(p, ids):
            prompt = p.prompts[pi]
            cached[pi] = out.num_cached_tokens
            if out.prompt_logprobs is not None:
                prompt_lps[pi] = out.prompt_logprobs
            for c in out.outputs:
                index = pi * p.n + c.index
                text, generated = ("", []) if p.score_only else (c.text, self._generated_entries(c))
                if not p.score_only:
                    n_out += len(c.token_ids)
                first = index not in offsets          # the choice's first chunk: the prompt first, with echo
                offset = offsets.setdefault(index, 0)
                echo_of = (prompt, prompt_lps.get(pi)) if first and p.req.echo else None
                finish = ("length" if p.score_only else c.finish_reason) if c.finish_reason is not None else None
                choice = self._choice(p, index, text, finish, generated, offset, echo_of)
                yield self._body(rid, created, [choice])
                offsets[index] = offset + len(choice["text"])
        if p.req.stream_options is not None and p.req.stream_options.include_usage:
            body = self._body(rid, created, [])
            body["usage"] = self._usage(sum(len(x.token_ids) for x in p.prompts), n_out, sum(cached))
            yield body

    @staticmethod
    def _generated_entries(c: CompletionOutput) -> list[tuple[int, PositionLogprobs | None]]:
        lps = c.logprobs if c.logprobs is not None else [None] * len(c.token_ids)
        return list(zip(c.token_ids, lps))

    async def complete(self, p: PreparedCompletion) -> dict:
        await self._wait_compiled(p)
        (rid, ids), created = self._engine_ids(p), int(time.time())
        seqs: list[dict[int, dict]] = [{} for _ in p.prompts]    # prompt -> sequence -> its gathered output
        prompt_lps: list[object] = [None] * len(p.prompts)
        cached = [0] * len(p.prompts)
        async for pi, out in self._run_all(p, ids):
            cached[pi] = out.num_cached_tokens
            if out.prompt_logprobs is not None:
                prompt_lps[pi] = out.prompt_logprobs
            for c in out.outputs:
                s = seqs[pi].setdefault(c.index, {"text": [], "ids": [], "lps": [], "cum": 0.0, "finish": None})
                s["text"].append(c.text)
                s["ids"] += c.token_ids
                s["lps"] += c.logprobs or []
                s["cum"] = c.cumulative_logprob if c.cumulative_logprob is not None else s["cum"]
                s["finish"] = c.finish_reason
        choices, n_out = [], 0
        for pi, prompt in enumerate(p.prompts):
            found = [seqs[pi][i] for i in sorted(seqs[pi])]
            n_out += 0 if p.score_only else sum(len(s["ids"]) for s in found)
            if p.best_of > p.n:   # the n with the highest mean token logprob, best first
                found = sorted(found, key=lambda s: -s["cum"] / max(len(s["ids"]), 1))[:p.n]
            for j, s in enumerate(found):
                if p.score_only:
                    text, generated, finish = "", [], "length"
                else:
                    text, finish = "".join(s["text"]), s["finish"]
                    generated = list(zip(s["ids"], s["lps"] or [None] * len(s["ids"])))
                echo_of = (prompt, prompt_lps[pi]) if p.req.echo else None
                choices.append(self._choice(p, pi * p.n + j, text, finish, generated, 0, echo_of))
        body = self._body(rid, created, choices)
        body["usage"] = self._usage(sum(len(x.token_ids) for x in p.prompts), n_out, sum(cached))
        return body
