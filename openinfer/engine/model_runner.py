"""ModelRunner: executes one prepared step; owns the model, the cache tensors and the sampler.

It turns a SchedulerOutput into flat tensors (input ids, positions, cache slots, attention metadata), runs
the model, computes logits only for the rows that need them (the last token of each request that samples,
plus prompt positions of requests asking for prompt logprobs), and samples. It never decides what runs
or where cache lives: block ids arrive in the SchedulerOutput.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from openinfer.config import EngineConfig
from openinfer.engine.scheduler import SchedulerOutput
from openinfer.kv_cache.spec import PagedCacheSpec, RequestStateSpec
from openinfer.layers.attention import AttentionMetadata, PrefillChunk
from openinfer.sampling.sampler import Sampler, SamplerOutput, SamplingMetadata

_CPU_KV_BUDGET = 2 << 30


@dataclass
class PromptLogprobsChunk:
    first_token_index: int        # index in the prompt of the token the first row predicts
    logprobs: torch.Tensor        # [n, V] log-softmax rows
    token_ids: list[int]          # the actual prompt tokens predicted by those rows


@dataclass
class RunnerOutput:
    # request_id -> index into `sampled` for requests that produced a token this step
    sample_index: dict[str, int] = field(default_factory=dict)
    sampled: SamplerOutput | None = None
    logits: torch.Tensor | None = None     # the rows the sampler got, aligned with `sampled`
    prompt_logprobs: dict[str, PromptLogprobsChunk] = field(default_factory=dict)


class ModelRunner:
    def __init__(self, config: EngineConfig, model: torch.nn.Module, vocab_size: int):
        self.config = config
        self.device = torch.device(config.device)
        self.dtype = config.torch_dtype
        self.model = model
        self.vocab_size = vocab_size
        self.block_size = config.block_size
        self.sampler = Sampler(config.logprobs_mode)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(config.seed)
        self.cache_specs = model.cache_specs(self.dtype)
        # one state slot per running request when the model declares per-request state
        self.num_state_slots = config.max_num_seqs if any(
            isinstance(s, RequestStateSpec) for s in self.cache_specs) else 0
        self.num_blocks = self._num_blocks()
        self.caches = self._allocate_caches()

    # ---- cache allocation -------------------------------------------------------------------------------
    def bytes_per_block(self) -> int:
        return sum(s.bytes_per_block(self.block_size) for s in self.cache_specs if isinstance(s, PagedCacheSpec))

    def state_bytes(self) -> int:
        return self.num_state_slots * sum(s.bytes_per_slot() for s in self.cache_specs
                                          if isinstance(s, RequestStateSpec))

    def _num_blocks(self) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        budget = self.config.kv_cache_memory_bytes
        if budget is None:
            if self.device.type == "cpu":
                budget = _CPU_KV_BUDGET
            else:
                free, total = torch.cuda.mem_get_info(self.device)
                reserve = (1 << 30) + self.config.max_num_batched_tokens * self.vocab_size * 4
                budget = int(total * self.config.gpu_memory_utilization) - (total - free) - reserve
        num = (budget - self.state_bytes()) // self.bytes_per_block()
        if num < 1:
            raise ValueError(f"KV budget of {budget} bytes holds no block of {self.bytes_per_block()} bytes "
                             f"(block_size={self.block_size}) beside {self.state_bytes()} bytes of per-request "
                             f"state; raise kv_cache_memory_bytes")
        return int(num)

    def _zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        # Zeroed, not empty: masked-out slots still enter the matmul and must not hold NaN/Inf bit patterns.
        # On the CPU, numpy's calloc gives zero pages lazily, so a large pool costs nothing until used.
        if self.device.type == "cpu":
            nbytes = math.prod(shape) * dtype.itemsize
            return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)
        return torch.zeros(shape, dtype=dtype, device=self.device)

    def _allocate_caches(self) -> dict[str, list[torch.Tensor]]:
        """Per declared cache kind, one tensor per layer: [num_blocks, *block_shape] for paged kinds,
        [num_state_slots, *state_shape] for per-request state."""
        caches = {}
        for spec in self.cache_specs:
            if isinstance(spec, PagedCacheSpec):
                shape = (self.num_blocks, *spec.block_shape(self.block_size))
            else:
                shape = (self.num_state_slots, *spec.state_shape)
            caches[spec.name] = [self._zeros(shape, spec.dtype) for _ in range(spec.num_layers)]
        return caches

    # ---- one step ---------------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        dev, bs = self.device, self.block_size
        # decodes (single-token rows) first: they share one batched attention call
        order = sorted(sched.scheduled, key=lambda s: s.num_new_tokens != 1)
        ids, pos, slots = [], [], []
        prefills: list[PrefillChunk] = []
        decode_tables, decode_lens = [], []
        logit_rows: list[int] = []
        out = RunnerOutput()
        sampling_reqs = []
        plp_spans = []   # (request, first row, n rows, first token index)
        row = 0
        for s in order:
            req, start, n = s.request, s.start, s.num_new_tokens
            ids.extend(req.token_ids_slice(start, start + n))
            positions = torch.arange(start, start + n)
            table = torch.tensor(s.block_ids, dtype=torch.long)
            pos.append(positions)
            slots.append(table[positions // bs] * bs + positions % bs)
            if n == 1:
                decode_tables.append(table)
                decode_lens.append(start + 1)
            else:
                prefills.append(PrefillChunk(row, n, start + n, table.to(dev), bs))
            if req.sampling_params.prompt_logprobs is not None and start < req.num_prompt_tokens - 1:
                end = min(start + n, req.num_prompt_tokens - 1)
                plp_spans.append((req, row, end - start, start + 1))
            if s.samples:
                sampling_reqs.append(req)
                out.sample_index[req.request_id] = len(sampling_reqs) - 1
                logit_rows.append(row + n - 1)
            row += n
        meta = AttentionMetadata(block_size=bs, slot_mapping=torch.cat(slots).to(dev),
                                 num_decode_tokens=len(decode_tables), prefills=prefills)
        if decode_tables:
            width = max(len(t) for t in decode_tables)
            padded = torch.zeros(len(decode_tables), width, dtype=torch.long)
            for i, t in enumerate(decode_tables):
                padded[i, :len(t)] = t
            meta.decode_block_tables = padded.to(dev)
            meta.decode_context_lens = torch.tensor(decode_lens, device=dev)
            meta.max_decode_context_len = max(decode_lens)
        input_ids = torch.tensor(ids, dtype=torch.long, device=dev)
        hidden = self.model(input_ids, torch.cat(pos).to(dev), self.caches, meta)

        if plp_spans:
            for req, first, n, tok_index in plp_spans:
                lp = self.model.compute_logits(hidden[first:first + n]).float().log_softmax(-1)
                out.prompt_logprobs[req.request_id] = PromptLogprobsChunk(
                    tok_index, lp, req.prompt_token_ids[tok_index:tok_index + n])
        if sampling_reqs:
            logits = self.model.compute_logits(hidden[torch.tensor(logit_rows, device=dev)])
            meta_s = SamplingMetadata.from_requests(sampling_reqs, self.vocab_size, dev)
            out.sampled = self.sampler(logits, meta_s, self.generator)
            out.logits = logits
        return out
