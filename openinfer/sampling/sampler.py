"""Sampler: logits -> next tokens (+ logprobs), batched, in vLLM's order of operations.

raw logprobs -> grammar bitmask (structured output) -> min_tokens mask -> penalties (repetition on prompt+output, presence/frequency on output)
-> greedy argmax for temperature 0 -> temperature -> min-p -> top-k -> top-p -> exponential-race sample.
A request with a seed draws its noise from its own generator, so its samples do not depend on what else
is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from openinfer.device_io import h2d
from openinfer.request import Request
from openinfer.sampling.bitmask import apply_token_bitmask


def apply_penalties(logits: torch.Tensor, prompt_mask: torch.Tensor, output_counts: torch.Tensor,
                    presence: torch.Tensor, frequency: torch.Tensor, repetition: torch.Tensor) -> torch.Tensor:
    """HF/vLLM semantics: repetition divides positive / multiplies negative logits of every token seen in the
    prompt or output; frequency subtracts `f * count`, presence subtracts `p` once, for output tokens."""
    seen = prompt_mask | (output_counts > 0)
    rep = repetition[:, None].expand_as(logits)
    penalized = torch.where(logits > 0, logits / rep, logits * rep)
    logits = torch.where(seen, penalized, logits)
    logits = logits - frequency[:, None] * output_counts
    return logits - presence[:, None] * (output_counts > 0).to(logits.dtype)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the top token's probability."""
    probs = logits.softmax(-1)
    keep = probs >= min_p[:, None] * probs.amax(-1, keepdim=True)
    return logits.masked_fill(~keep, float("-inf"))


def apply_top_k(logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Keep the k largest logits per row (ties with the k-th are kept); k = 0 disables."""
    k = torch.where(top_k > 0, top_k, logits.shape[-1]).clamp(max=logits.shape[-1])
    sorted_desc = logits.sort(dim=-1, descending=True).values
    kth = sorted_desc.gather(-1, (k - 1)[:, None])
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_p(logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability mass reaches top_p (at least one)."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    probs = sorted_logits.softmax(-1)
    mass_before = probs.cumsum(-1) - probs
    remove_sorted = mass_before >= top_p[:, None]
    remove = torch.zeros_like(remove_sorted).scatter(-1, order, remove_sorted)
    return logits.masked_fill(remove, float("-inf"))


@dataclass
class SamplingMetadata:
    # per-row knobs, on the device only where a row samples at random (None in an all-greedy batch: the sampler
    # reads them only then, and a greedy step then copies none of them to the device)
    temperature: torch.Tensor | None   # [N] float
    top_k: torch.Tensor | None         # [N] long (None also when no row uses top-k)
    top_p: torch.Tensor | None         # [N] float
    min_p: torch.Tensor | None         # [N] float
    all_greedy: bool
    any_random: bool
    # which masks any row uses, known on the host (no device sync to find out)
    any_min_p: bool
    any_top_k: bool
    any_top_p: bool
    generators: list[torch.Generator | None]
    max_num_logprobs: int | None   # None: no row asked for logprobs
    # penalties (None when no row uses any)
    prompt_mask: torch.Tensor | None = None
    output_counts: torch.Tensor | None = None
    presence: torch.Tensor | None = None
    frequency: torch.Tensor | None = None
    repetition: torch.Tensor | None = None
    # (row, token ids) pairs banned because min_tokens is not reached yet
    banned: list[tuple[int, list[int]]] | None = None
    # structured output: [N, ceil(V/32)] int32 allowed-token bits per row (all ones: unconstrained), or None
    token_bitmask: torch.Tensor | None = None

    @classmethod
    def from_requests(cls, requests: list[Request], vocab_size: int, device: torch.device,
                      row_drafts: list[list[int]] | None = None) -> "SamplingMetadata":
        """One row per entry of `requests` (a request may fill several rows: speculative decoding verifies
        its drafts in consecutive rows); `row_drafts[i]`: the draft tokens row i comes after, counted as output
        tokens by min_tokens and the penalties."""
        ps = [r.sampling_params for r in requests]
        f32 = dict(dtype=torch.float32, device=device)

        def col(values, dtype=torch.float32):
            return h2d(torch.tensor(values, dtype=dtype), device)

        all_greedy = all(p.greedy for p in ps)
        any_top_k = any(p.top_k > 0 for p in ps)
        temperature = top_k = top_p = min_p = None
        if not all_greedy:       # (the float knobs in one copy)
            knobs = col([[p.temperature for p in ps], [p.top_p for p in ps], [p.min_p for p in ps]])
            temperature, top_p, min_p = knobs[0], knobs[1], knobs[2]
            if any_top_k:
                top_k = col([p.top_k for p in ps], torch.long)
        meta = cls(
            temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
            all_greedy=all_greedy,
            any_random=not all_greedy,
            any_min_p=any(p.min_p > 0 for p in ps),
            any_top_k=any_top_k,
            any_top_p=any(p.top_p < 1.0 for p in ps),
            generators=[r.generator for r in requests],
            max_num_logprobs=max((p.logprobs for p in ps if p.logprobs is not None), default=None),
        )
        if any(p.presence_penalty or p.frequency_penalty or p.repetition_penalty != 1.0 for p in ps):
            n = len(requests)
            meta.prompt_mask = torch.zeros(n, vocab_size, dtype=torch.bool, device=device)
            meta.output_counts = torch.zeros(n, vocab_size, **f32)
            for i, r in enumerate(requests):
                if r.prompt_token_ids:
                    meta.prompt_mask[i, torch.tensor(r.prompt_token_ids, device=device)] = True
                out_ids = r.output_token_ids + (row_drafts[i] if row_drafts is not None else [])
                if out_ids:
                    ids = torch.tensor(out_ids, device=device)
                    meta.output_counts[i].index_add_(0, ids, torch.ones(len(ids), **f32))
            meta.presence = col([p.presence_penalty for p in ps])
            meta.frequency = col([p.frequency_penalty for p in ps])
            meta.repetition = col([p.repetition_penalty for p in ps])
        banned = []
        for i, r in enumerate(requests):
            p = r.sampling_params
            if not p.min_tokens:
                continue
            # a constrained request ends where its grammar allows EOS: min_tokens does not ban it there
            offset = len(row_drafts[i]) if row_drafts is not None else 0
            if r.num_output_tokens + r.num_pending + offset < p.min_tokens and r.grammar is None:
                ids = list(p.stop_token_ids) + ([] if p.ignore_eos else list(r.eos_token_ids))
                if ids:
                    banned.append((i, ids))
        meta.banned = banned or None
        return meta


@dataclass
class SamplerOutput:
    token_ids: torch.Tensor                 # [N] long
    logprobs: torch.Tensor | None = None    # [N] logprob of the sampled token
    ranks: torch.Tensor | None = None       # [N] its rank (1 = best)
    top_ids: torch.Tensor | None = None     # [N, max_num_logprobs]
    top_logprobs: torch.Tensor | None = None


class Sampler:
    def __init__(self, logprobs_mode: str = "raw_logprobs"):
        self.logprobs_mode = logprobs_mode

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata,
                 default_generator: torch.Generator | None = None) -> SamplerOutput:
        logits = logits.float()
        raw_logprobs = logits.log_softmax(-1) if (meta.max_num_logprobs is not None
                                                  and self.logprobs_mode == "raw_logprobs") else None
        if meta.token_bitmask is not None:
            logits = logits.clone()   # .float() may have returned the runner's own tensor
            apply_token_bitmask(logits, meta.token_bitmask)
        if meta.banned:
            logits = logits.clone()
            for row, ids in meta.banned:
                logits[row, ids] = float("-inf")
        if meta.prompt_mask is not None:
            logits = apply_penalties(logits, meta.prompt_mask, meta.output_counts,
                                     meta.presence, meta.frequency, meta.repetition)
        greedy = logits.argmax(-1)
        if meta.all_greedy:
            sampled, processed = greedy, logits
        else:
            temp = torch.where(meta.temperature < 1e-5, 1.0, meta.temperature)
            processed = logits / temp[:, None]
            if meta.any_min_p:
                processed = apply_min_p(processed, meta.min_p)
            if meta.any_top_k:
                processed = apply_top_k(processed, meta.top_k)
            if meta.any_top_p:
                processed = apply_top_p(processed, meta.top_p)
            probs = processed.softmax(-1)
            noise = torch.empty_like(probs).exponential_(generator=default_generator)
            for row, gen in enumerate(meta.generators):
                if gen is not None:
                    noise[row].exponential_(generator=gen)
            random = (probs / noise).argmax(-1)
            sampled = torch.where(meta.temperature < 1e-5, greedy, random)
        out = SamplerOutput(token_ids=sampled)
        if meta.max_num_logprobs is not None:
            lp = raw_logprobs if raw_logprobs is not None else processed.log_softmax(-1)
            out.logprobs = lp.gather(-1, sampled[:, None]).squeeze(-1)
            out.ranks = (lp > out.logprobs[:, None]).sum(-1) + 1
            if meta.max_num_logprobs > 0:
                out.top_logprobs, out.top_ids = lp.topk(meta.max_num_logprobs, dim=-1)
        return out
