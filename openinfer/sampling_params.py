"""SamplingParams: per-request generation knobs, validated on construction (vLLM's names and semantics)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from openinfer.structured_output.params import StructuredOutputsParams

_GREEDY_EPS = 1e-5
# most sequences one request may ask for (n; the completions API's best_of too): OpenAI's limit
MAX_N = 128


class RequestOutputKind(Enum):
    CUMULATIVE = 0   # every update carries the whole output so far
    DELTA = 1        # every update carries only what is new (streaming)
    FINAL_ONLY = 2   # only the finished output is reported (offline generate)


# cache_ttl classes (DeepInfer's defaults): agent sessions are kept 3 days, chat 7 days
TTL_CLASSES = {"agent": 3 * 86400.0, "chat": 7 * 86400.0}


def resolve_ttl(value: float | str | None, default: float) -> float:
    if value is None:
        return default
    if isinstance(value, str):
        if value not in TTL_CLASSES:
            raise ValueError(f"cache_ttl must be seconds > 0 or one of {sorted(TTL_CLASSES)}, got {value!r}")
        return TTL_CLASSES[value]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"cache_ttl must be seconds > 0 or one of {sorted(TTL_CLASSES)}, got {value!r}")
    return float(value)


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0                       # 0 or -1: disabled
    min_p: float = 0.0
    max_tokens: int | None = 16          # None: up to max_model_len
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None          # top-N logprobs per generated token (the sampled token is always included)
    prompt_logprobs: int | None = None   # top-N logprobs per prompt token (the prompt token is always included)
    # prompt logprobs are wanted from this prompt position on: the prompt before it may come from the prefix
    # cache, and those positions get None (scoring continuations of one long context reuses its KV). 0: every
    # position, no prefix-cache lookup.
    prompt_logprobs_start: int = 0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    # parallel sampling: n sequences from one prompt, whose prefill they share (its full KV blocks, through the
    # prefix cache; the tail is computed again per sequence). Sequence i samples with seed + i (when a seed is
    # given); only sequence 0 computes prompt_logprobs. Outputs: RequestOutput.outputs[i], index i.
    n: int = 1
    # Constrained decoding (vLLM's shape): {"json": schema} | {"json_object": True} | {"regex": r} |
    # {"grammar": ebnf} | {"choice": [...]}, or a StructuredOutputsParams. docs/structured_output.md
    structured_outputs: StructuredOutputsParams | dict | None = None
    so_args: dict | None = None          # DeepInfer's name for structured_outputs (an alias, folded into it)
    # prefix-KV store (docs/kv_cache.md): how long blocks this request computes are kept, in seconds or a
    # traffic class ("agent": 3 days, "chat": 7 days); None: the engine's kv_store_ttl_s
    cache_ttl: float | str | None = None
    _stop_list: list[str] = field(init=False, repr=False, default_factory=list)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        if self.cache_ttl is not None:
            resolve_ttl(self.cache_ttl, 0.0)     # raises ValueError naming what is accepted
        if self.so_args is not None:
            if self.structured_outputs is not None:
                raise ValueError("SamplingParams.so_args is an alias of structured_outputs: give only one")
            self.structured_outputs, self.so_args = self.so_args, None
        if self.structured_outputs is not None:
            self.structured_outputs = StructuredOutputsParams.from_any(self.structured_outputs)
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, allowed: str) -> ValueError:
            return ValueError(f"SamplingParams.{name} must be {allowed}, got {getattr(self, name)!r}")

        if isinstance(self.n, bool) or not isinstance(self.n, int) or not 1 <= self.n <= MAX_N:
            raise bad("n", f"an integer from 1 to {MAX_N}")
        if not (isinstance(self.temperature, (int, float)) and self.temperature >= 0.0):
            raise bad("temperature", ">= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", "in (0, 1]")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise bad("top_k", "an integer >= 1, or 0/-1 to disable")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", "in [0, 1]")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", "an integer >= 1 or None")
        if not isinstance(self.min_tokens, int) or self.min_tokens < 0:
            raise bad("min_tokens", "an integer >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"SamplingParams.min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", "in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", "in [-2, 2]")
        if not self.repetition_penalty > 0.0:
            raise bad("repetition_penalty", "> 0")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v < 0):
                raise bad(name, "an integer >= 0 or None")
        if (not isinstance(self.prompt_logprobs_start, int) or isinstance(self.prompt_logprobs_start, bool)
                or self.prompt_logprobs_start < 0):
            raise bad("prompt_logprobs_start", "an integer >= 0")
        if self.prompt_logprobs_start and self.prompt_logprobs is None:
            raise bad("prompt_logprobs_start", "0 unless prompt_logprobs is set")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", "an integer or None")
        if any(not isinstance(s, str) or s == "" for s in self.stop):
            raise bad("stop", "a list of non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise bad("stop_token_ids", "a list of non-negative token ids")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def max_stop_len(self) -> int:
        return max((len(s) for s in self.stop), default=0)
