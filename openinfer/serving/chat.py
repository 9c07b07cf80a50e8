"""Chat Completions, Responses and Messages through deepseek-recipe, for every model.

deepseek-recipe parses and validates the three protocols into one `ConversationRequest`, maps its
inference options, and turns backend chunks into each protocol's response objects and stream events
(usage, stop sequences, logprobs, and for DeepSeek models thinking and DSML tool calls). We use it end to
end and do not re-implement any of that. What differs per model family is the prompt:
- DeepSeek models (served as `DeepSeek-V4-Pro` / `DeepSeek-V4.1-Flash`): the recipe's own encoding, and the
  generated token ids go back to its stream processor, which decodes and parses them.
- Other models: the request's conversation is rendered with the model's chat template (user text never
  becomes control tokens, see `Tokenizer.encode_chat`); thinking mode is off and output is plain text.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator

import deepseek_recipe as dr

from openinfer.outputs import CompletionOutput, RequestOutput
from openinfer.sampling_params import MAX_N, SamplingParams
from openinfer.serving.async_engine import AsyncLLMEngine
from openinfer.serving.errors import APIError
from openinfer.serving.images import ImageInputs, image_sources
from openinfer.structured_output.compiler import wait_compiled
from openinfer.structured_output.params import StructuredOutputsParams, check_schema_keywords
from openinfer.structured_output.tool_calls import (dsml_strict_tools_tag, dsml_tool_grammar, json_call_to_dsml,
                                                    tool_call_schema, tool_system_prompt)
from openinfer.tokenizer import DEEPSEEK_V4, DEEPSEEK_V41, Tokenizer, deepseek_v41_vocabulary

DEEPSEEK_MODEL_NAMES = (DEEPSEEK_V4, DEEPSEEK_V41)

# protocol -> (request class, response accumulator class, id prefix)
PROTOCOLS = {
    "chat": (dr.ChatCompletionRequest, dr.ChatCompletionResponse, "chatcmpl"),
    "responses": (dr.ResponsesRequest, dr.ResponsesResponse, "resp"),
    "messages": (dr.MessagesRequest, dr.MessagesResponse, "msg"),
}


@dataclass
class PreparedChat:
    protocol: str
    request_id: str
    conversation_request: dr.ConversationRequest
    prompt_token_ids: list[int]
    params: SamplingParams
    stream: bool
    responses_extras: tuple | None = None   # (namespace tool map, echo) for the Responses generator
    json_tool_call: bool = False   # the reply is a constrained JSON call, turned into a tool call at the end
    # hand the parser text, not token ids: a grammar admits DSML markers spelled in byte tokens as well as
    # the marker token, and the parser recognises only the latter among ids (text is parsed either way)
    text_chunks: bool = False
    include_usage: bool = False    # stream_options.include_usage (n > 1: one usage chunk at the end)
    images: tuple = ()             # the prompt's image spans (multimodal.ImageSpan), its placeholders expanded

    @property
    def n(self) -> int:
        return self.params.n


@dataclass
class ClientSchemas:
    """The JSON schemas as the client wrote them in the request body. deepseek-recipe's conversion reports the
    constraint with `strict` schemas normalised as OpenAI's strict mode does, which drops keywords such as
    `minItems` / `maxItems` / `minLength` / `maxLength`; the server compiles these instead (checked by
    `check_schema_keywords`: a keyword the grammar would not enforce is a 400 naming it)."""
    response: Any = None                                   # the response format's schema (None: none given)
    tools: dict[str, Any] = field(default_factory=dict)    # function name (as the recipe reports it) -> parameters

    @classmethod
    def from_body(cls, protocol: str, body: dict, namespace_map: dict | None = None) -> "ClientSchemas":
        out = cls()
        if protocol == "chat":
            rf = body.get("response_format")
            if isinstance(rf, dict) and rf.get("type") == "json_schema" and isinstance(rf.get("json_schema"), dict):
                out.response = rf["json_schema"].get("schema")
        elif protocol == "responses":
            fmt = body.get("text", {}).get("format") if isinstance(body.get("text"), dict) else None
            if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
                out.response = fmt.get("schema")
        else:   # Anthropic structured outputs: output_config.format (GA) or output_format (beta)
            cfg = body.get("output_config")
            fmt = (cfg.get("format") if isinstance(cfg, dict) else None) or body.get("output_format")
            if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
                out.response = fmt.get("schema", {})
        by_path = {v: k for k, v in (namespace_map or {}).items()}   # (namespace, local name) -> function name
        for t in body.get("tools") or ():
            if not isinstance(t, dict):
                continue
            if protocol == "chat":
                f = t.get("function")
                if isinstance(f, dict) and isinstance(f.get("name"), str) and "parameters" in f:
                    out.tools[f["name"]] = f["parameters"]
            elif protocol == "responses":
                if t.get("type") == "function" and isinstance(t.get("name"), str) and "parameters" in t:
                    out.tools[t["name"]] = t["parameters"]
                elif t.get("type") == "namespace":
                    for inner in t.get("tools") or ():
                        name = by_path.get((t.get("name"), inner.get("name"))) if isinstance(inner, dict) else None
                        if name is not None and "parameters" in inner:
                            out.tools[name] = inner["parameters"]
            elif isinstance(t.get("name"), str) and "input_schema" in t:
                out.tools[t["name"]] = t["input_schema"]
        return out

    def apply_to_tools(self, tools_json: str) -> list[dict]:
        """The recipe's tool list (Chat Completions function tools) with each tool's parameters as the client
        wrote them."""
        tools = json.loads(tools_json)
        for t in tools:
            f = t.get("function", t)
            if f.get("name") in self.tools:
                f["parameters"] = self.tools[f["name"]]
        return tools


class _ChunkJSON:
    """A Chat Completions chunk re-serialised (n > 1: its choice's index set, usage moved to the end)."""

    def __init__(self, data: dict):
        self.data = data

    def to_json(self) -> str:
        return json.dumps(self.data, ensure_ascii=False, separators=(",", ":"))


def merge_usage(usages: list[dict]) -> dict:
    """One request's usage over its n choices: the prompt counted once (OpenAI's rule), completion tokens summed."""
    out = dict(usages[0])
    out["completion_tokens"] = sum(u.get("completion_tokens") or 0 for u in usages)
    out["total_tokens"] = (out.get("prompt_tokens") or 0) + out["completion_tokens"]
    details = [d for d in (u.get("completion_tokens_details") for u in usages) if isinstance(d, dict)]
    if details:
        out["completion_tokens_details"] = {k: sum(d.get(k) or 0 for d in details) if isinstance(v, int) else v
                                            for k, v in details[0].items()}
    return out


def _message_dict(m: dr.Message) -> dict:
    d: dict = {"role": m.role, "content": m.content}
    if m.tool_calls:
        d["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                           for c in m.tool_calls]
    if m.tool_call_id is not None:
        d["tool_call_id"] = m.tool_call_id
    return d


@dataclass
class _ToolCallOutput:
    """A whole constrained JSON tool call (one choice's), as the DSML text the recipe's parser turns into
    `tool_calls`."""
    index: int
    dsml: str
    num_tokens: int          # generated tokens the text stands for (without a final EOS)
    eos: bool
    finish_reason: str | None


class ChatFrontend:
    def __init__(self, engine: AsyncLLMEngine, tokenizer: Tokenizer, tokenizer_path: str, served_name: str,
                 images: ImageInputs | None = None):
        """`images`: the engine's image limits and the model's image processor (None: image parts are refused)."""
        self.engine = engine
        self.images = images
        self.tokenizer = tokenizer
        self.served_name = served_name
        self.deepseek = served_name in DEEPSEEK_MODEL_NAMES
        if served_name == DEEPSEEK_V41:
            # V4.1's encoding emits tokens V4's tokenizer.json lacks (<｜System｜>): V4.1's ids, as the engine's
            # tokenizer has them (Tokenizer.from_dir), for encoding prompts and decoding output alike
            self.recipe_tokenizer = dr.Tokenizer.from_str(deepseek_v41_vocabulary(Path(tokenizer_path).read_text()))
        else:
            self.recipe_tokenizer = dr.Tokenizer.from_file(tokenizer_path)
        if self.deepseek:
            self.options = dr.ConversionOptions()
            self.encodings = {dr.ModelVersion.DeepseekV4Pro: dr.DeepseekV4Encoding().with_tokenizer(self.recipe_tokenizer),
                              dr.ModelVersion.DeepseekV41Flash:
                                  dr.DeepseekV41Encoding().with_tokenizer(self.recipe_tokenizer)}
        else:
            # The recipe targets DeepSeek versions; other models borrow its parsing under their own name.
            self.options = (dr.ConversionOptions().with_default_thinking_mode(False)
                            .with_model_versions_by_name({served_name: dr.ModelVersion.DeepseekV4Pro}))
        self.max_model_len = engine.engine.max_model_len

    # ---- request side -----------------------------------------------------------------------------------
    def prepare(self, protocol: str, body: dict) -> PreparedChat:
        req_cls, _, prefix = PROTOCOLS[protocol]
        n = body.get("n", 1)
        if protocol == "chat":
            # n choices share one prompt prefill (the engine's parallel sampling); the recipe takes only n = 1
            n = 1 if n is None else n
            if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_N:
                raise APIError(400, f"n must be an integer from 1 to {MAX_N}, got {n!r}", param="n")
            if body.get("best_of") not in (None, n):      # (the recipe would ignore it)
                raise APIError(400, "best_of is not supported on chat completions (it is a /v1/completions "
                                    "parameter); ask for n choices instead", param="best_of")
            body = {k: v for k, v in body.items() if k not in ("n", "best_of")}
        elif n != 1:
            raise APIError(400, f"n={n!r} is not supported on this API (one reply per request)", param="n")
        extras = None
        namespace_map = None
        if protocol == "chat" and body.get("max_completion_tokens") is not None:
            # OpenAI's newer name for max_tokens (what the openai client sends); the recipe reads max_tokens
            body = {**body, "max_tokens": body["max_completion_tokens"]}
        try:
            req = req_cls(body)
            if protocol == "responses":
                namespace_map = req.namespace_tool_map(self.options)
                extras = (namespace_map, req.echo())
            conv = req.convert(self.options)
        except dr.ConversionError as e:
            raise APIError.from_recipe(e) from None
        except (ValueError, TypeError, OverflowError) as e:   # body the recipe can't even read
            raise APIError(400, f"invalid request body: {e}") from None
        io = conv.inference_options
        # Anthropic's tool_choice {"type": "any"} (some tool must be called): the recipe reads it as auto
        any_tool = (protocol == "messages" and isinstance(body.get("tool_choice"), dict)
                    and body["tool_choice"].get("type") == "any")
        client = ClientSchemas.from_body(protocol, body, namespace_map)
        structured, json_tool_call = self._constraint(conv, any_tool, client)
        prompt_ids = self._encode(conv, json_tool_call)
        sources = image_sources(conv)
        images = ()
        if sources:      # each placeholder becomes its image's span: usage counts the image tokens
            if self.images is None:
                raise APIError(400, f"model {self.served_name!r} does not take images (it has no vision encoder)",
                               param="messages")
            prompt_ids, images = self.images.expand(sources, prompt_ids)
        if len(prompt_ids) > self.max_model_len:
            raise APIError(400, f"prompt has {len(prompt_ids)} tokens, more than this model's context "
                                f"(max_model_len={self.max_model_len})", param="messages")
        try:
            max_tokens = conv.resolve_max_tokens(len(prompt_ids), self.max_model_len)
        except dr.ConversionError as e:
            raise APIError.from_recipe(e) from None
        try:
            params = SamplingParams(
                temperature=io.temperature if io.temperature is not None else 1.0,
                top_p=io.top_p if io.top_p is not None else 1.0,
                max_tokens=max_tokens, seed=io.seed, n=n,
                logprobs=(io.top_logprobs or 0) if io.logprobs else None,
                stop=list(conv.parsing_options.stop_sequences),
                presence_penalty=body.get("presence_penalty") or 0.0,
                frequency_penalty=body.get("frequency_penalty") or 0.0,
                structured_outputs=structured)
        except (ValueError, TypeError) as e:
            raise APIError(400, str(e), param="response_format" if "structured_outputs" in str(e) else None) from None
        so = body.get("stream_options")
        return PreparedChat(protocol, self.engine.new_request_id(prefix), conv, prompt_ids, params, conv.stream,
                            extras, json_tool_call, text_chunks=self.deepseek and structured is not None,
                            include_usage=isinstance(so, dict) and bool(so.get("include_usage")), images=images)

    def _constraint(self, conv: dr.ConversationRequest, any_tool: bool = False, client: ClientSchemas | None = None
                    ) -> tuple[StructuredOutputsParams | None, bool]:
        """The recipe's output constraint as structured-output params, and whether the reply is a JSON tool
        call to convert (models without a tool-call format). Schemas are the client's (`ClientSchemas`), not the
        recipe's normalised copies. A plain `tool_call` constraint (tools with tool_choice=auto) is enforced only
        for strict tools of DeepSeek models (free text, but any DSML invoke follows its tool's schema); otherwise
        it only describes what a call would look like. Anthropic's `output_format` / `output_config.format`
        (which the recipe does not read) is a JSON-schema constraint like `response_format`."""
        client = client or ClientSchemas()
        oc = conv.inference_options.output_constraint
        if oc is None and client.response is not None:
            kind, text = "json", None          # Messages' structured output: only the body has it
        elif oc is None:
            return None, False
        else:
            kind, text = oc.kind, oc.schema
        param = "tools" if kind.startswith("tool_call") else "response_format"

        def schema():   # the response format's schema as sent (None: any JSON value)
            if client.response is not None:
                return client.response
            return json.loads(text) if text else None

        dsml = self.deepseek and kind in ("tool_call", "tool_call_required")
        if dsml and conv.model_version != dr.ModelVersion.DeepseekV4Pro and (
                kind == "tool_call_required" or any(t.get("function", t).get("strict") for t in json.loads(text))):
            raise APIError(400, "enforced tool calls use DeepSeek-V4's DSML format; this model version's format "
                                "is not covered yet", param="tool_choice")
        try:
            if kind == "tool_call" and any_tool and not self.deepseek:
                return StructuredOutputsParams(json=tool_call_schema(client.apply_to_tools(text))), True
            if kind == "tool_call":
                tools = client.apply_to_tools(text)
                if not (self.deepseek and any(t.get("function", t).get("strict") for t in tools)):
                    return None, False
                return StructuredOutputsParams(structural_tag=dsml_strict_tools_tag(tools)), False
            if self.deepseek and conv.conversation.thinking_mode and kind in ("json", "regex"):
                # the reasoning stays free: any text up to </think>, then the answer's grammar
                sch = schema() if kind == "json" else None
                answer = ({"type": "regex", "pattern": text} if kind == "regex" else
                          {"type": "json_schema", "json_schema": sch if sch is not None else {"type": "object"},
                           # no runs of free whitespace (cf. structured_output_any_whitespace)
                           "max_whitespace_cnt": 1})
                check_schema_keywords(answer.get("json_schema"))
                return StructuredOutputsParams(structural_tag={"type": "structural_tag", "format": {
                    "type": "sequence", "elements": [{"type": "tag", "begin": "", "content": {"type": "any_text"},
                                                      "end": "</think>"}, answer]}}), False
            if kind == "json":
                sch = schema()
                return (StructuredOutputsParams(json=sch) if sch is not None
                        else StructuredOutputsParams(json_object=True)), False
            if kind == "regex":
                return StructuredOutputsParams(regex=text), False
            if kind == "tool_call_required":
                tools = client.apply_to_tools(text)
                if self.deepseek:   # the prompt opened the DSML tool_calls block: constrain the invoke inside
                    return StructuredOutputsParams(grammar=dsml_tool_grammar(tools)), False
                return StructuredOutputsParams(json=tool_call_schema(tools)), True
        except (ValueError, RuntimeError) as e:   # keywords the grammar engine would not enforce, bad schemas
            raise APIError(400, f"tools: {e}" if param == "tools" and not str(e).startswith("tools") else str(e),
                           param=param) from None
        raise APIError(400, f"output constraint {kind!r} is not supported", param="response_format")

    def _encode(self, conv: dr.ConversationRequest, json_tool_call: bool = False) -> list[int]:
        if self.deepseek:
            try:
                return self.encodings[conv.model_version].encode(conv.conversation)
            except RuntimeError as e:
                raise APIError(400, f"prompt encoding failed: {e}") from None
        c = conv.conversation
        if c.thinking_mode:
            raise APIError(400, f"model {self.served_name!r} has no thinking mode", param="thinking")
        kwargs = {}
        messages = [_message_dict(m) for m in c.messages]
        if c.tools and json_tool_call and "tools" not in (self.tokenizer.chat_template or ""):
            # no tool format in the template: describe the tools in the system message (see tool_calls.py)
            text = tool_system_prompt([{"name": t.name, "description": t.description, "parameters": t.parameters}
                                       for t in c.tools])
            if messages and messages[0]["role"] == "system" and isinstance(messages[0]["content"], str):
                messages[0] = {**messages[0], "content": messages[0]["content"] + "\n\n" + text}
            else:
                messages.insert(0, {"role": "system", "content": text})
        elif c.tools:
            if "tools" not in (self.tokenizer.chat_template or ""):
                raise APIError(400, f"model {self.served_name!r}: its chat template takes no tools", param="tools")
            kwargs["tools"] = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                                 "parameters": t.parameters}} for t in c.tools]
        try:
            return self.tokenizer.encode_chat(messages, True, **kwargs)
        except Exception as e:  # template errors (raise_exception in the template, bad roles)
            raise APIError(400, f"chat template rejected the conversation: {e}") from None

    # ---- response side ----------------------------------------------------------------------------------
    def _processor(self, p: PreparedChat) -> dr.StreamProcessor:
        req_cls = PROTOCOLS[p.protocol][0]
        gen = req_cls.chunk_generator(p.conversation_request, p.request_id, self.served_name)
        if p.responses_extras is not None:
            gen = gen.with_namespace_tool_map(p.responses_extras[0]).with_echo(p.responses_extras[1])
        return dr.StreamProcessor(gen, p.conversation_request.parsing_options, self.recipe_tokenizer)

    def _chunks(self, out: RequestOutput, c: "CompletionOutput | _ToolCallOutput", first: bool,
                text_chunks: bool = False) -> list[dr.InferenceChunk]:
        """The recipe's input chunks for one choice's new output `c` (of request output `out`)."""
        chunks = []
        if first:
            chunks.append(dr.InferenceChunk.ready(prompt_usage=dr.PromptUsage(
                prompt_tokens=len(out.prompt_token_ids), prompt_cache_hit_tokens=out.num_cached_tokens)))
        if isinstance(c, _ToolCallOutput):
            chunks.append(dr.InferenceChunk.text(c.dsml, c.num_tokens))
            if c.eos:
                chunks.append(dr.InferenceChunk.text("", 1))
            reason = dr.InferenceFinishReason.Length if c.finish_reason == "length" else dr.InferenceFinishReason.Stop
            chunks.append(dr.InferenceChunk.finish(reason))
            return chunks
        ids = list(c.token_ids)
        logprobs = None
        if c.logprobs is not None:
            logprobs = [(entry[t].logprob, [(tid, lp.logprob) for tid, lp in sorted(entry.items(),
                                                                                   key=lambda kv: kv[1].rank or 0)])
                        for t, entry in zip(ids, c.logprobs)]
        # A generation ending on EOS: the token counts as generated but is not text (the recipe's decoder
        # would spell it out), so it goes to the processor as an empty text chunk worth one token.
        eos_tail = (c.finish_reason == "stop" and c.stop_reason is None and ids
                    and ids[-1] in self.tokenizer.eos_token_ids)
        if eos_tail:
            ids, logprobs = ids[:-1], (logprobs[:-1] if logprobs is not None else None)
        if ids and text_chunks:
            chunks.append(dr.InferenceChunk.text(c.text, len(ids)))
        elif ids:
            chunks.append(dr.InferenceChunk.tokens(ids, logprobs))
        if eos_tail:
            chunks.append(dr.InferenceChunk.text("", 1))
        if c.finish_reason is not None:
            reason = dr.InferenceFinishReason.Length if c.finish_reason == "length" else dr.InferenceFinishReason.Stop
            chunks.append(dr.InferenceChunk.finish(reason))
        return chunks

    async def _choice_events(self, p: PreparedChat) -> AsyncIterator[tuple[int, object]]:
        """(choice index, protocol event) for one request: one recipe stream processor per choice (n of them,
        all fed from the one engine request), ending the engine request once every parser is done."""
        if p.params.structured_outputs is not None:   # a grammar that does not compile is a 400, before any work
            await wait_compiled(self.engine.engine.structured_output.pool, p.params.structured_outputs)
        procs = [self._processor(p) for _ in range(p.n)]
        first = [True] * p.n
        try:
            outs = self.engine.generate(p.prompt_token_ids, p.params, p.request_id, images=p.images)
            if p.json_tool_call:
                outs = self._as_tool_calls(outs, p.conversation_request.parsing_options.starts_in_tool_calls)
            else:
                outs = self._with_outputs(outs)
            async for out, items in outs:
                for c in items:
                    proc = procs[c.index]
                    if proc.finished:      # e.g. a stop sequence found by the parser: the rest is not wanted
                        continue
                    for chunk in self._chunks(out, c, first[c.index], p.text_chunks):
                        first[c.index] = False
                        for ev in proc.push(chunk):
                            yield c.index, ev
                        if proc.finished:
                            break
                if all(proc.finished for proc in procs):   # every parser is done: stop generating
                    return
            for i, proc in enumerate(procs):
                for ev in proc.finish():
                    yield i, ev
        finally:
            for proc in procs:
                if not proc.finished:
                    proc.close()

    async def events(self, p: PreparedChat) -> AsyncIterator[object]:
        """Protocol events (recipe objects; for n > 1 Chat Completions chunks whose choice carries its index, the
        usage of all choices in one last chunk when stream_options.include_usage asks for it)."""
        if p.n == 1:
            async for _, ev in self._choice_events(p):
                yield ev
            return
        usages: dict[int, dict] = {}
        last = None
        async for i, ev in self._choice_events(p):
            data = json.loads(ev.to_json())
            for choice in data.get("choices") or ():
                choice["index"] = i
            if data.get("usage"):
                usages[i] = data["usage"]
            data["usage"] = None
            last = data
            yield _ChunkJSON(data)
        if p.include_usage and last is not None and usages:
            yield _ChunkJSON({**last, "choices": [], "usage": merge_usage([usages[i] for i in sorted(usages)])})

    @staticmethod
    async def _with_outputs(outs: AsyncIterator[RequestOutput]) -> AsyncIterator[tuple[RequestOutput, list]]:
        async for out in outs:
            yield out, out.outputs

    async def _as_tool_calls(self, outs: AsyncIterator[RequestOutput], in_block: bool
                             ) -> AsyncIterator[tuple[RequestOutput, list]]:
        """Gather each choice's constrained JSON call and hand it on, once that choice is done, as one output whose
        text is the DSML invoke the recipe's parser reads as a tool call (a call cut short by max_tokens becomes
        no call, 'length')."""
        text: dict[int, list[str]] = {}
        ids: dict[int, list[int]] = {}
        async for out in outs:
            done = []
            for c in out.outputs:
                text.setdefault(c.index, []).append(c.text)
                ids.setdefault(c.index, []).extend(c.token_ids)
                if c.finish_reason is None:
                    continue
                toks = ids[c.index]
                eos = bool(toks) and toks[-1] in self.tokenizer.eos_token_ids and c.finish_reason == "stop"
                dsml = (json_call_to_dsml("".join(text[c.index]), opening=not in_block)
                        if c.finish_reason == "stop" else None)
                done.append(_ToolCallOutput(c.index, dsml or "", len(toks) - eos, eos, c.finish_reason))
            if done:
                yield out, done

    async def complete(self, p: PreparedChat) -> str:
        resp_cls = PROTOCOLS[p.protocol][1]
        created = int(time.time())
        resps = [resp_cls(p.request_id, self.served_name, created, len(p.prompt_token_ids), 0) for _ in range(p.n)]
        async for i, ev in self._choice_events(p):
            resps[i].accumulate(ev)
        if p.n == 1:
            return resps[0].to_json()
        docs = [json.loads(r.to_json()) for r in resps]
        doc = docs[0]
        doc["choices"] = [{**c, "index": i} for i, d in enumerate(docs) for c in d["choices"]]
        usages = [d["usage"] for d in docs if d.get("usage")]
        doc["usage"] = merge_usage(usages) if usages else None
        return json.dumps(doc, ensure_ascii=False, separators=(",", ":"))

    @staticmethod
    def sse_name(protocol: str, ev) -> str | None:
        return None if isinstance(ev, _ChunkJSON) else PROTOCOLS[protocol][1].sse_event_name(ev)

    @staticmethod
    def sse_done(protocol: str) -> str | None:
        return PROTOCOLS[protocol][1].sse_done_data()
