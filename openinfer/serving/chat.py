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

import time
from dataclasses import dataclass
from typing import AsyncIterator

import deepseek_recipe as dr

from openinfer.outputs import RequestOutput
from openinfer.sampling_params import SamplingParams
from openinfer.serving.async_engine import AsyncLLMEngine
from openinfer.serving.errors import APIError
from openinfer.tokenizer import Tokenizer

DEEPSEEK_MODEL_NAMES = ("DeepSeek-V4-Pro", "DeepSeek-V4.1-Flash")

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


def _message_dict(m: dr.Message) -> dict:
    d: dict = {"role": m.role, "content": m.content}
    if m.tool_calls:
        d["tool_calls"] = [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                           for c in m.tool_calls]
    if m.tool_call_id is not None:
        d["tool_call_id"] = m.tool_call_id
    return d


class ChatFrontend:
    def __init__(self, engine: AsyncLLMEngine, tokenizer: Tokenizer, tokenizer_path: str, served_name: str):
        self.engine = engine
        self.tokenizer = tokenizer
        self.served_name = served_name
        self.deepseek = served_name in DEEPSEEK_MODEL_NAMES
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
        prompt_ids = self._encode(conv)
        if len(prompt_ids) > self.max_model_len:
            raise APIError(400, f"prompt has {len(prompt_ids)} tokens, more than this model's context "
                                f"(max_model_len={self.max_model_len})", param="messages")
        io = conv.inference_options
        # A plain `tool_call` constraint (tools with tool_choice=auto) only describes what a call would look
        # like; the parser handles calls without enforcement. The others would be silently ignored: refuse.
        if io.output_constraint is not None and io.output_constraint.kind != "tool_call":
            raise APIError(400, f"constrained output ({io.output_constraint.kind}: response_format / "
                                "tool_choice=required) is not supported yet", param="response_format")
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
                frequency_penalty=body.get("frequency_penalty") or 0.0)
        except (ValueError, TypeError) as e:
            raise APIError(400, str(e)) from None
        return PreparedChat(protocol, self.engine.new_request_id(prefix), conv, prompt_ids, params, conv.stream,
                            extras)

    def _encode(self, conv: dr.ConversationRequest) -> list[int]:
        if self.deepseek:
            try:
                return self.encodings[conv.model_version].encode(conv.conversation)
            except RuntimeError as e:
                raise APIError(400, f"prompt encoding failed: {e}") from None
        c = conv.conversation
        if c.thinking_mode:
            raise APIError(400, f"model {self.served_name!r} has no thinking mode", param="thinking")
        kwargs = {}
        if c.tools:
            if "tools" not in (self.tokenizer.chat_template or ""):
                raise APIError(400, f"model {self.served_name!r}: its chat template takes no tools", param="tools")
            kwargs["tools"] = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                                                 "parameters": t.parameters}} for t in c.tools]
        try:
            return self.tokenizer.encode_chat([_message_dict(m) for m in c.messages], True, **kwargs)
        except Exception as e:  # template errors (raise_exception in the template, bad roles)
            raise APIError(400, f"chat template rejected the conversation: {e}") from None

    # ---- response side ----------------------------------------------------------------------------------
    def _processor(self, p: PreparedChat) -> dr.StreamProcessor:
        req_cls = PROTOCOLS[p.protocol][0]
        gen = req_cls.chunk_generator(p.conversation_request, p.request_id, self.served_name)
        if p.responses_extras is not None:
            gen = gen.with_namespace_tool_map(p.responses_extras[0]).with_echo(p.responses_extras[1])
        return dr.StreamProcessor(gen, p.conversation_request.parsing_options, self.recipe_tokenizer)

    def _chunks(self, out: RequestOutput, first: bool) -> list[dr.InferenceChunk]:
        chunks = []
        if first:
            chunks.append(dr.InferenceChunk.ready(prompt_usage=dr.PromptUsage(
                prompt_tokens=len(out.prompt_token_ids), prompt_cache_hit_tokens=out.num_cached_tokens)))
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
        if ids:
            chunks.append(dr.InferenceChunk.tokens(ids, logprobs))
        if eos_tail:
            chunks.append(dr.InferenceChunk.text("", 1))
        if c.finish_reason is not None:
            reason = dr.InferenceFinishReason.Length if c.finish_reason == "length" else dr.InferenceFinishReason.Stop
            chunks.append(dr.InferenceChunk.finish(reason))
        return chunks

    async def events(self, p: PreparedChat) -> AsyncIterator[object]:
        """Protocol events (recipe objects) for one request, ending the engine request once the parser is done."""
        proc = self._processor(p)
        first = True
        try:
            async for out in self.engine.generate(p.prompt_token_ids, p.params, p.request_id):
                for chunk in self._chunks(out, first):
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
