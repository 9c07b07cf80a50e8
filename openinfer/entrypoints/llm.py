"""LLM: the offline entry point (vLLM-compatible in shape): generate() and chat() over one engine (one process, or a front end over one worker process per rank)."""

from __future__ import annotations

import dataclasses
import gc
from typing import Sequence

import torch
from tqdm import tqdm

from openinfer.config import EngineConfig
from openinfer.executor import make_engine
from openinfer.outputs import RequestOutput
from openinfer.sampling_params import RequestOutputKind, SamplingParams
from openinfer.serving.errors import APIError
from openinfer.serving.images import ImageInputs, has_image_parts, image_sources

Conversation = list[dict]


class LLM:
    def __init__(self, model: str | None = None, **engine_options):
        if model is not None:
            engine_options["model"] = model
        self.config = EngineConfig.from_kwargs(**engine_options)
        self.engine = make_engine(self.config)   # one process, or a front end over one worker per rank
        self.tokenizer = self.engine.tokenizer
        self._images = None        # chat with images: limits and the model's image processor (made on first use)

    def shutdown(self) -> None:
        """Free the engine now (device memory included) instead of whenever Python's collector next runs;
        the LLM cannot be used afterwards. Idempotent."""
        engine, self.engine = getattr(self, "engine", None), None
        if engine is None:
            return
        engine.shutdown()
        del engine
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def generate(self, prompts: str | Sequence[str] | None = None,
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
                 prompt_token_ids: Sequence[int] | Sequence[Sequence[int]] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Run prompts (text, or token ids) to completion; outputs come back in input order."""
        if (prompts is None) == (prompt_token_ids is None):
            raise ValueError("pass exactly one of prompts or prompt_token_ids")
        if prompts is not None:
            if isinstance(prompts, str):
                prompts = [prompts]
            for i, p in enumerate(prompts):
                if not isinstance(p, str):
                    raise TypeError(f"prompts[{i}] must be a str, got {type(p).__name__}")
            texts: list[str | None] = list(prompts)
            token_lists = [self.tokenizer.encode(p) for p in prompts]
        else:
            if prompt_token_ids and isinstance(prompt_token_ids[0], int):
                prompt_token_ids = [prompt_token_ids]
            token_lists = [list(t) for t in prompt_token_ids]
            texts = [None] * len(token_lists)
        return self._run(token_lists, texts, sampling_params, use_tqdm)

    def chat(self, messages: Conversation | Sequence[Conversation],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None, *,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             chat_template_kwargs: dict | None = None) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, with the model's chat template."""
        if messages and isinstance(messages[0], dict):
            messages = [messages]
        kwargs = chat_template_kwargs or {}
        texts, token_lists, images = [], [], []
        for conv in messages:
            if has_image_parts({"messages": conv}):
                ids, spans = self._encode_images(list(conv), kwargs)
                texts.append(None)
            else:
                texts.append(self.tokenizer.apply_chat_template(list(conv), add_generation_prompt, **kwargs))
                ids, spans = self.tokenizer.encode_chat(list(conv), add_generation_prompt, **kwargs), ()
            token_lists.append(ids)
            images.append(spans)
        return self._run(token_lists, texts, sampling_params, use_tqdm, images)

    def _encode_images(self, conv: list[dict], kwargs: dict):
        """A conversation with image parts (OpenAI `image_url` parts: data URLs or http(s)), through deepseek-recipe's
        conversion and image resolution and the model's image processor, as the chat API runs it (serving/images.py):
        (prompt token ids with the images' spans, the spans). ValueError naming what is wrong."""
        import deepseek_recipe as dr

        source = self.engine.model_source
        if self._images is None:
            self._images = ImageInputs(self.config, source.family.image_processor(source.hf_config), self.config.model)
        if self._images.processor is None:
            raise ValueError(f"model {self.config.model!r} does not take images (it has no vision encoder)")
        ids = self.tokenizer.encode_chat_with_image_placeholders(conv, **kwargs)
        try:
            req = dr.ChatCompletionRequest({"model": self.tokenizer.deepseek_model, "messages": conv, **kwargs})
            return self._images.expand(image_sources(req.convert(dr.ConversionOptions())), ids)
        except dr.ConversionError as e:
            raise ValueError(f"invalid conversation: {e}") from None
        except APIError as e:
            raise ValueError(e.message) from None

    def _run(self, token_lists, texts, sampling_params, use_tqdm, images=None) -> list[RequestOutput]:
        if self.engine is None:
            raise RuntimeError("this LLM was shut down; create a new one")
        n = len(token_lists)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * n
        else:
            params = list(sampling_params)
            if len(params) != n:
                raise ValueError(f"got {len(params)} sampling params for {n} prompts")
        # Offline: only final outputs are needed.
        params = [dataclasses.replace(p, output_kind=RequestOutputKind.FINAL_ONLY) for p in params]
        # Validate everything before queueing anything, so one bad prompt leaves the engine untouched.
        limit = self.engine.max_model_len
        for i, toks in enumerate(token_lists):
            if not toks:
                raise ValueError(f"prompt {i} is empty: at least one token is needed")
            if len(toks) > limit:
                raise ValueError(f"prompt {i} has {len(toks)} tokens, more than max_model_len={limit}")
        specs = {p.structured_outputs for p in params if p.structured_outputs is not None}
        if specs:   # grammars compile in parallel in the engine's pool; a bad one is a ValueError naming it
            pool = self.engine.structured_output.pool
            for spec in specs:
                pool.submit(spec)
            for spec in specs:
                pool.compile_blocking(spec)
        ids = []
        try:
            for i, (toks, text, p) in enumerate(zip(token_lists, texts, params)):
                spans = images[i] if images else ()
                ids.append(self.engine.add_request(toks, p, prompt=text, **({"images": spans} if spans else {})))
        except Exception:
            for rid in ids:
                self.engine.abort_request(rid)
            raise
        results: dict[str, RequestOutput] = {}
        mine = set(ids)       # a set: looking each finished request up in the list was quadratic in the batch
        bar = tqdm(total=n, desc="Generating", unit="req", disable=not use_tqdm, dynamic_ncols=True)
        try:
            while len(results) < n:
                for out in self.engine.step():
                    if out.finished and out.request_id in mine:
                        results[out.request_id] = out
                        bar.update(1)
        except BaseException:
            for rid in ids:
                if rid not in results:
                    self.engine.abort_request(rid)
            raise
        finally:
            bar.close()
        return [results[rid] for rid in ids]
