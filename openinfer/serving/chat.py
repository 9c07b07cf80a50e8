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
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator

import deepseek_recipe as dr

from openinfer.outputs import RequestOutput
from openinfer.sampling_params import SamplingParams
from openinfer.serving.async_engine import AsyncLLMEngine
from openinfer.serving.errors import APIError
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
    """A whole constrained JSON tool call, as the DSML text the recipe's parser turns into `tool_calls`."""
    out: RequestOutput
    dsml: str
    num_tokens: int          # generated tokens the text stands for (without a final EOS)
    eos: bool
    finish_reason: str | None

    @property
    def prompt_token_ids(self):
        return self.out.prompt_token_ids

    @property
    def num_cached_tokens(self):
        return self.out.num_cached_tokens


class ChatFrontend:
    def __init__(self, engine: AsyncLLMEngine, tokenizer: Tokenizer, tokenizer_path: str, served_name: str):
        self.engine = engine
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
        if n != 1:
            raise APIError(400, f"n={n!r} is not supported: only n=1 (one choice per request)", param="n")
        extras = None
        if protocol == "chat" and body.get("max_completion_tokens") is not None:
            # OpenAI's newer name for max_tokens (what the openai client sends); the recipe reads max_tokens
            body = {**body, "max_tokens": body["max_completion_tokens"]}
        try:
            req = req_cls(body)
            if protocol == "responses":
                extras = (req.namespace_tool_map(self.options), req.echo())
            conv = req.convert(self.options)
        except dr.ConversionError as e:
            raise APIError.from_recipe(e) from None
        except (ValueError, TypeError, OverflowError) as e:   # body the recipe can't even read
            raise APIError(400, f"invalid request body: {e}") from None
        io = conv.inference_options
        # Anthropic's tool_choice {"type": "any"} (some tool must be called): the recipe reads it as auto
        any_tool = (protocol == "messages" and isinstance(body.get("tool_choice"), dict)
                    and body["tool_choice"].get("type") == "any")
        structured, json_tool_call = self._constraint(conv, any_tool)
        prompt_ids = self._encode(conv, json_tool_call)
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
                max_tokens=max_tokens, seed=io.seed,
                logprobs=(io.top_logprobs or 0) if io.logprobs else None,
                stop=list(conv.parsing_options.stop_sequences),
                presence_penalty=body.get("presence_penalty") or 0.0,
                frequency_penalty=body.get("frequency_penalty") or 0.0,
                structured_outputs=structured)
        except (ValueError, TypeError) as e:
            raise APIError(400, str(e), param="response_format" if "structured_outputs" in str(e) else None) from None
        return PreparedChat(protocol, self.engine.new_request_id(prefix), conv, prompt_ids, params, conv.stream,
                            extras, json_tool_call, text_chunks=self.deepseek and structured is not None)

    def _constraint(self, conv: dr.ConversationRequest, any_tool: bool = False
                    ) -> tuple[StructuredOutputsParams | None, bool]:
        """The recipe's output constraint as structured-output params, and whether the reply is a JSON tool
        call to convert (models without a tool-call format). A plain `tool_call` constraint (tools with
        tool_choice=auto) is enforced only for strict tools of DeepSeek models (free text, but any DSML invoke
        follows its tool's schema); otherwise it only describes what a call would look like."""
        oc = conv.inference_options.output_constraint
        if oc is None:
            return None, False
        dsml = self.deepseek and oc.kind in ("tool_call", "tool_call_required")
        if dsml and conv.model_version != dr.ModelVersion.DeepseekV4Pro and (
                oc.kind == "tool_call_required" or any(t.get("function", t).get("strict") for t in json.loads(oc.schema))):
            raise APIError(400, "enforced tool calls use DeepSeek-V4's DSML format; this model version's format "
                                "is not covered yet", param="tool_choice")
        if oc.kind == "tool_call" and any_tool and not self.deepseek:
            return StructuredOutputsParams(json=tool_call_schema(json.loads(oc.schema))), True
        if oc.kind == "tool_call":
            tools = json.loads(oc.schema)
            if not (self.deepseek and any(t.get("function", t).get("strict") for t in tools)):
                return None, False
            try:
                return StructuredOutputsParams(structural_tag=dsml_strict_tools_tag(tools)), False
            except (ValueError, RuntimeError) as e:
                raise APIError(400, f"tools: {e}", param="tools") from None
        if self.deepseek and conv.conversation.thinking_mode and oc.kind in ("json", "regex"):
            # the reasoning stays free: any text up to </think>, then the answer's grammar
            answer = ({"type": "regex", "pattern": oc.schema} if oc.kind == "regex" else
                      {"type": "json_schema", "json_schema": json.loads(oc.schema) if oc.schema else {"type": "object"},
                       "max_whitespace_cnt": 1})   # no runs of free whitespace (cf. structured_output_any_whitespace)
            try:
                check_schema_keywords(answer.get("json_schema"))
                return StructuredOutputsParams(structural_tag={"type": "structural_tag", "format": {
                    "type": "sequence", "elements": [{"type": "tag", "begin": "", "content": {"type": "any_text"},
                                                      "end": "</think>"}, answer]}}), False
            except ValueError as e:
                raise APIError(400, str(e), param="response_format") from None
        try:
            if oc.kind == "json":
                return StructuredOutputsParams(json=oc.schema) if oc.schema else StructuredOutputsParams(json_object=True), False
            if oc.kind == "regex":
                return StructuredOutputsParams(regex=oc.schema), False
            if oc.kind == "tool_call_required":
                if self.deepseek:   # the prompt opened the DSML tool_calls block: constrain the invoke inside
                    return StructuredOutputsParams(grammar=dsml_tool_grammar(json.loads(oc.schema))), False
                return StructuredOutputsParams(json=tool_call_schema(json.loads(oc.schema))), True
        except (ValueError, RuntimeError) as e:   # keywords the grammar engine would not enforce, bad schemas
            raise APIError(400, str(e), param="response_format" if oc.kind != "tool_call_required" else "tools") from None
        raise APIError(400, f"output constraint {oc.kind!r} is not supported", param="response_format")

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

    def _chunks(self, out, first: bool, text_chunks: bool = False) -> list[dr.InferenceChunk]:
        chunks = []
        if first:
            chunks.append(dr.InferenceChunk.ready(prompt_usage=dr.PromptUsage(
                prompt_tokens=len(out.prompt_token_ids), prompt_cache_hit_tokens=out.num_cached_tokens)))
        if isinstance(out, _ToolCallOutput):
            chunks.append(dr.InferenceChunk.text(out.dsml, out.num_tokens))
            if out.eos:
                chunks.append(dr.InferenceChunk.text("", 1))
            reason = dr.InferenceFinishReason.Length if out.finish_reason == "length" else dr.InferenceFinishReason.Stop
            chunks.append(dr.InferenceChunk.finish(reason))
            return chunks
        c = out.outputs[0]
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

    async def events(self, p: PreparedChat) -> AsyncIterator[object]:
        """Protocol events (recipe objects) for one request, ending the engine request once the parser is done."""
        if p.params.structured_outputs is not None:   # a grammar that does not compile is a 400, before any work
            await wait_compiled(self.engine.engine.structured_output.pool, p.params.structured_outputs)
        proc = self._processor(p)
        first = True
        try:
            outs = self.engine.generate(p.prompt_token_ids, p.params, p.request_id)
            if p.json_tool_call:
                outs = self._as_tool_call(outs, p.conversation_request.parsing_options.starts_in_tool_calls)
            async for out in outs:
                for chunk in self._chunks(out, first, p.text_chunks):
                    first = False
                    for ev in proc.push(chunk):
                        yield ev
                    if proc.finished:      # e.g. a stop sequence found by the parser: stop generating
                        return
            for ev in proc.finish():
                yield ev
        finally:
            if not proc.finished:
                proc.close()

    async def _as_tool_call(self, outs: AsyncIterator[RequestOutput], in_block: bool) -> AsyncIterator[object]:
        """Gather a constrained JSON call and hand it on as one output whose text is the DSML invoke the
        recipe's parser reads as a tool call (a call cut short by max_tokens becomes no call, 'length')."""
        text, ids, last = [], [], None
        async for out in outs:
            text.append(out.outputs[0].text)
            ids += out.outputs[0].token_ids
            last = out
        c = last.outputs[0]
        eos = bool(ids) and ids[-1] in self.tokenizer.eos_token_ids and c.finish_reason == "stop"
        dsml = json_call_to_dsml("".join(text), opening=not in_block) if c.finish_reason == "stop" else None
        yield _ToolCallOutput(last, dsml or "", len(ids) - eos, eos, c.finish_reason)

    async def complete(self, p: PreparedChat) -> str:
        resp_cls = PROTOCOLS[p.protocol][1]
        resp = resp_cls(p.request_id, self.served_name, int(time.time()), len(p.prompt_token_ids), 0)
        async for ev in self.events(p):
            resp.accumulate(ev)
        return resp.to_json()

    @staticmethod
    def sse_name(protocol: str, ev) -> str | None:
        return PROTOCOLS[protocol][1].sse_event_name(ev)

    @staticmethod
    def sse_done(protocol: str) -> str | None:
        return PROTOCOLS[protocol][1].sse_done_data()
