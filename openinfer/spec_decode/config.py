"""SpeculativeConfig: the knobs of speculative decoding, in vLLM's shape (`speculative_config={...}`)."""

from __future__ import annotations

from dataclasses import dataclass, fields

METHODS = ("ngram", "draft_head", "mtp", "dspark")
POLICIES = ("fixed", "confidence")
MAX_NGRAM_DRAFTS = 16                # prompt lookup copies at most this many tokens per step


@dataclass
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    # "fixed": verify every draft; "confidence": DSpark's global budget split by the drafts' confidences
    # (spec_decode/policy.py)
    policy: str = "fixed"
    # "confidence": draft tokens verified per step over the whole batch (None: half of max_num_seqs x k)
    verify_budget: int | None = None
    # ngram (prompt lookup): the longest suffix n-gram in [min, max] that occurred earlier is matched
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    # draft_head: the directory of a head trained by `python -m openinfer.spec_decode.train`
    draft_model: str | None = None

    @classmethod
    def from_value(cls, value: "SpeculativeConfig | dict | None") -> "SpeculativeConfig | None":
        """A dict (CLI JSON, LLM keyword) or an instance; unknown keys are refused by name."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict or SpeculativeConfig, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown keys {unknown}; known: {sorted(known)}")
        missing = [k for k in ("method", "num_speculative_tokens") if k not in value]
        if missing:
            raise ValueError(f"speculative_config needs {missing}")
        return cls(**value)

    def validate(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"speculative_config method {self.method!r} is not available; built: {list(METHODS)}")
        k = self.num_speculative_tokens
        if not isinstance(k, int) or k < 1 or k > MAX_NGRAM_DRAFTS:
            raise ValueError(f"num_speculative_tokens must be an integer in [1, {MAX_NGRAM_DRAFTS}] for "
                             f"{self.method!r}, got {k!r}")
        if (self.method == "draft_head") != (self.draft_model is not None):
            raise ValueError("speculative_config: method 'draft_head' needs draft_model (a directory written by "
                             "python -m openinfer.spec_decode.train), and draft_model needs method 'draft_head'")
        if self.policy not in POLICIES:
            raise ValueError(f"speculative_config policy must be one of {list(POLICIES)}, got {self.policy!r}")
        if self.verify_budget is not None and self.verify_budget < 1:
            raise ValueError(f"verify_budget must be >= 1, got {self.verify_budget}")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {self.prompt_lookup_min}, "
                             f"{self.prompt_lookup_max}")
