"""ModelRunner: executes one prepared step; owns the model, the cache tensors and the sampler.

It turns a SchedulerOutput into flat tensors (input ids, positions, cache slots, attention metadata), runs
the model, computes logits only for the rows that need them (the last token of each request that samples,
plus prompt positions of requests asking for prompt logprobs), and samples. It never decides what runs
or where cache lives: block ids arrive in the SchedulerOutput.

Its parts, each in its own module: the cache tensors and their sizing (`cache_pool.py`), bytes to and from the
prefix-KV store (`store_io.py`), and the decode CUDA graphs (`cuda_graphs.py`); what the runner itself does is
build a step's inputs and call them.

Sliding-window models: paged kinds with a `window` (kv_cache/spec.py) form the window group, with their own
tensors and block ids (kv_cache/window_group.py); the windowed layers read the window group's tables and slots
through the step's second view (`AttentionMetadata.layer_views`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np
import torch

from openinfer.config import EngineConfig
from openinfer.device_io import D2HCopy, h2d, host_longs
from openinfer.distributed.context_parallel import ContextParallelStep
from openinfer.distributed.expert_parallel import MoeExchange, step_exchange
from openinfer.distributed.parallel_state import ParallelContext
from openinfer.distributed.step_sync import StepSync
from openinfer.distributed.two_batch import TwoBatch, agreed_halves, cut
from openinfer.engine.cache_pool import CachePool
from openinfer.engine.cuda_graphs import DecodeGraphs, pad_tables
from openinfer.engine.encoder_cache import EncoderCache
from openinfer.engine.scheduler import SchedulerOutput
from openinfer.engine.store_io import StoreIO
from openinfer.kv_cache.bounded_replay import replay_slot_mappings, window_layer_chunk
from openinfer.layers.attention import AttentionMetadata, PrefillChunk
from openinfer.models.interface import CausalLM, ImageRows
from openinfer.request import Request
from openinfer.sampling.bitmask import GrammarBitmask
from openinfer.sampling.sampler import Sampler, SamplerOutput, SamplingMetadata

@dataclass
class PromptLogprobsChunk:
    first_token_index: int        # index in the prompt of the token the first row predicts
    logprobs: torch.Tensor        # [n, V] log-softmax rows
    token_ids: list[int]          # the actual prompt tokens predicted by those rows


@dataclass
class RunnerOutput:
    # request_id -> index into `sampled` for requests that produced a token this step
    sample_index: dict[str, int] = field(default_factory=dict)
    sampled: SamplerOutput | None = None   # on the device (the next step reads pending tokens from it)
    logits: torch.Tensor | None = None     # the rows the sampler got, aligned with `sampled`
    host_copy: D2HCopy | None = None       # `sampled` on its way to pinned host memory
    # speculative decoding: request_id -> the drafts its rows verified (rows sample_index .. + len(drafts))
    drafts: dict[str, list[int]] = field(default_factory=dict)
    # drafters that read the target's hidden features (spec_decode/feature_proposer.py): request_id -> (first
    # row, first position, rows, state slot) of its rows in this forward, and the features the model kept
    rows: dict[str, tuple[int, int, int, int | None]] = field(default_factory=dict)
    captured: dict[int, torch.Tensor] | None = None

    def sampled_on_host(self) -> dict[str, torch.Tensor | None]:
        """The sampler's outputs on the host; waits only for this step's GPU work."""
        return self.host_copy.wait() if self.host_copy is not None else {}
    prompt_logprobs: dict[str, PromptLogprobsChunk] = field(default_factory=dict)


class ModelRunner:
    def __init__(self, config: EngineConfig, model: CausalLM, vocab_size: int, parallel: ParallelContext | None = None):
        self.config = config
        self.device = torch.device(config.device)
        self.parallel = parallel or ParallelContext.single(self.device)
        if self.parallel.is_distributed:
            self.device = self.parallel.device
        self.dtype = config.torch_dtype
        self.model = model
        self.traits = model.traits
        self.vocab_size = vocab_size
        self.block_size = config.block_size
        self.yoco_keep = config.v41_prefill_keep_tokens if config.v41_prefill_mode == "yoco" else None
        self.sampler = Sampler(config.logprobs_mode)
        self.generator = torch.Generator(device=self.device)
        # DP groups draw different noise (else the same prompt on two groups samples the same text); the TP
        # ranks of a group share it, so they sample the same tokens from the same logits
        self.generator.manual_seed(config.seed + self.parallel.dp_rank)
        # per-request rings keep room for the rows a verify step (and a step guessed on it) may write, then reject
        self.cache_specs = model.cache_specs(self.dtype, rollback_rows=config.rollback_rows)
        self.pool = CachePool(config, self.cache_specs, self.device, self.parallel, self.traits.per_request_state,
                              vocab_size, model.config.max_position_embeddings, self.traits.prefill_scratch_bytes)
        self.caches = self.pool.caches
        # sliding-window models: which layers have a window (the store keeps the others' rows only)
        self.swa_layout = self.traits.sliding_window
        # the prefix-KV store's side (the engine gives it the store's tiers)
        self.store = StoreIO(self.pool, config.kv_store_ttl_s)
        # expert parallelism: forwards run in lockstep with the other EP ranks, EPLB moves experts
        self.step_sync = (StepSync(self.parallel, config.resolved_step_sync_channel) if self.parallel.ep_size > 1
                          else None)
        # two-batch overlap across attention: steps split into two micro-batches of whole requests (two_batch.py)
        self.two_batch = self.step_sync is not None and config.two_batch_split == "requests"
        if self.two_batch and not self.traits.two_batch_layers:
            raise ValueError(f"two_batch_split='requests' needs a model whose layers split at the MoE exchange "
                             f"(DeepSeek-V4); {type(model).__name__} has none")
        self.two_batch_steps = 0     # steps run as two micro-batches
        self.eplb = None
        if self.step_sync is not None:
            from openinfer.distributed.eplb_controller import EplbController

            self.eplb = EplbController(model, self.parallel, config)
        self.decode_graphs: DecodeGraphs | None = None      # capture_decode_graphs makes them
        # vision models: image embeddings by image digest (a repeated image is not encoded again)
        self.encoder_cache = EncoderCache(config.encoder_cache_bytes) if self.traits.vision else None
        self.images_encoded = 0     # spans this rank's tower encoded
        self.images_given = 0       # spans whose rows came with the request (a vision-encoder instance's: EPD)

    # ---- what the engine sizes from the pool -------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_window_blocks(self) -> int:
        return self.pool.num_window_blocks

    @property
    def num_state_slots(self) -> int:
        return self.pool.num_state_slots

    @property
    def num_state_snapshots(self) -> int:
        return self.pool.num_state_snapshots

    def capture_decode_graphs(self, max_model_len: int) -> None:
        """CUDA graphs for decode-only steps (cuda_graphs.py): every batch bucket now, or per (batch, context)
        bucket on first use for models whose decode reads a context-sized gather."""
        self.decode_graphs = DecodeGraphs(self.config, self.model, self.pool, max_model_len,
                                          lockstep=self.step_sync is not None,
                                          context_buckets=self.traits.context_bucketed_graphs)
        self.decode_graphs.capture_all()

    # ---- one step ---------------------------------------------------------------------------------------
    def _as_decode_rows(self, s) -> bool:
        """Whether a scheduled request runs as decode rows (one query each, attending to the keys up to its own
        position) rather than as a prefill chunk: a decode, and a verify step's token + drafts — its rows are then
        decode rows too, so verify steps replay the decode CUDA graphs (bucketed by rows) instead of running eager.
        On a model with per-request state (DeepSeek's rings) each row also carries its offset among its request's
        rows (`AttentionMetadata.decode_row_offsets`): the rings are read after the step's writes, which the k
        rows of rollback room make safe, and the recurrences (V4's HCA running state, V4.1's Engram look-back)
        take the step's earlier rows from the step itself."""
        if _replaying(s):      # a replay chunk needs the prefill path's per-layer views, even of one token
            return False
        return s.num_new_tokens == 1 or bool(s.draft_token_ids)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, prev: RunnerOutput | None = None,
                grammar_bitmask: GrammarBitmask | None = None) -> RunnerOutput:
        """Queue one step on the device; nothing here waits for the GPU. A request whose newest token is still
        on the device (sampled by `prev`, async scheduling) gets it from there, by a device-side copy.
        `grammar_bitmask` (structured output) holds the allowed tokens of constrained requests; the sampler
        applies it to the logits after the forward (so CUDA graphs of the forward are unaffected)."""
        dev, bs = self.device, self.block_size
        self.store.before_forward(sched.state_copies)
        # decode rows first: they share one batched attention call (and the decode CUDA graphs)
        as_decode = [self._as_decode_rows(s) for s in sched.scheduled]
        order = ([s for s, d in zip(sched.scheduled, as_decode) if d]
                 + [s for s, d in zip(sched.scheduled, as_decode) if not d])
        num_decode = sum(as_decode)
        ids: list[int] = []
        dec_pos, dec_slots = [], []             # decode rows: plain ints (most of a big batch)
        pre_pos, pre_slots = [], []             # prefill chunks: numpy ranges
        prefills: list[PrefillChunk] = []
        decode_tables, decode_lens, decode_state_slots, decode_offsets = [], [], [], []
        logit_rows: list[int] = []
        out = RunnerOutput()
        sampling_reqs = []
        plp_spans = []   # (request, first row, n rows, first token index)
        fix_rows, fix_src = [], []               # rows whose input token is prev's sample
        replays = []                             # (prefill chunk index, plan): chunks replaying a prefix's end
        row = 0
        sample_rows: list[Request] = []         # the sampler's rows: a request verifying drafts fills several
        capture = bool(self.model.capture_layers)
        row_drafts: list[list[int]] = []        # the drafts each row comes after
        image_rows, image_embeds = [], []       # rows inside image spans and the embeddings they take
        # (per-request work of a wide decode batch is the step's host cost: properties read once, plain
        # decodes without inner loops)
        for k, s in enumerate(order):
            req, n, table = s.request, s.num_new_tokens, s.block_ids
            start = req.num_computed_tokens
            drafts = s.draft_token_ids
            rid = req.request_id
            num_tokens = len(req.prompt_token_ids) + len(req.output_token_ids)
            if start >= num_tokens:              # the token is pending on the device
                assert n == 1 + len(drafts) and prev is not None, "only a decode can start from a pending token"
                # (after a verify step still on the device: the sample after its last draft, the guess being
                # that all its drafts are kept — the output processor drops these rows if not)
                ids.append(0)
                if drafts:
                    ids.extend(drafts)
                fix_rows.append(row)
                fix_src.append(prev.sample_index[rid] + len(prev.drafts.get(rid, ())))
            elif n == 1 and not drafts:
                ids.append(req.prompt_token_ids[start] if start < len(req.prompt_token_ids)
                           else req.output_token_ids[start - len(req.prompt_token_ids)])
            else:
                ids.extend(req.token_ids_slice(start, start + n - len(drafts)))
                ids.extend(drafts)
            if req.images:
                self._image_rows(req, start, start + n - len(drafts), row, image_rows, image_embeds)
            if k < num_decode:
                if n == 1:
                    dec_pos.append(start)
                    dec_slots.append(table[start // bs] * bs + start % bs)
                    decode_tables.append(table)
                    decode_lens.append(start + 1)
                    decode_state_slots.append(s.state_slot)
                    decode_offsets.append(0)
                else:
                    for p in range(start, start + n):     # a verify step's rows: each sees the keys up to its own
                        dec_pos.append(p)
                        dec_slots.append(table[p // bs] * bs + p % bs)
                        decode_tables.append(table)
                        decode_lens.append(p + 1)
                        decode_state_slots.append(s.state_slot)
                        decode_offsets.append(p - start)
            else:
                positions = np.arange(start, start + n)
                np_table = np.asarray(table, dtype=np.int64)
                pre_pos.append(positions)
                pre_slots.append(np_table[positions // bs] * bs + positions % bs)
                decoder_start = None
                if self.yoco_keep is not None and req.sampling_params.prompt_logprobs is None:
                    # YOCO: the decoder runs over the sequence's last `keep` tokens only (every prompt position
                    # needs its logits when prompt logprobs are asked for: those requests run exact)
                    # (kept also for chunks wholly inside the tail: their decoder windows start there too)
                    decoder_start = req.num_tokens - self.yoco_keep if req.num_tokens > self.yoco_keep else None
                prefills.append(PrefillChunk(row, n, start + n, h2d(torch.from_numpy(np_table), dev), bs,
                                             s.state_slot, decoder_start))
                if _replaying(s):
                    replays.append((len(prefills) - 1, s.replay))
            if start < len(req.prompt_token_ids) - 1 and req.sampling_params.prompt_logprobs is not None:
                # from the row predicting prompt_logprobs_start on (a replay may compute earlier rows)
                first = max(start, req.sampling_params.prompt_logprobs_start - 1)
                end = min(start + n, req.num_prompt_tokens - 1)
                if first < end:
                    plp_spans.append((req, row + first - start, end - first, first + 1))
            if capture:
                out.rows[rid] = (row, start, n, s.state_slot)
            if start + n - len(drafts) == num_tokens + req.num_pending:     # s.samples
                # the last token's row, then one row per draft: row j samples the token after draft j
                sampling_reqs.append(req)
                out.sample_index[rid] = len(sample_rows)
                if drafts:
                    first = row + n - 1 - len(drafts)
                    logit_rows.extend(range(first, row + n))
                    sample_rows.extend([req] * (1 + len(drafts)))
                    row_drafts.extend(drafts[:j] for j in range(1 + len(drafts)))
                    out.drafts[rid] = drafts
                else:
                    logit_rows.append(row + n - 1)
                    sample_rows.append(req)
                    row_drafts.append([])
            row += n
        # Host-to-device copies first: made after the forward is queued, each would wait for it.
        if sampling_reqs:
            meta_s = SamplingMetadata.from_requests(sample_rows, self.vocab_size, dev,
                                                    row_drafts if out.drafts else None)
            if grammar_bitmask is not None:   # row j of a request: its grammar after its first j drafts
                meta_s.token_bitmask = h2d(grammar_bitmask.for_batch(
                    [(r.request_id, len(d)) for r, d in zip(sample_rows, row_drafts)]), dev)
        # (the logit rows and the fix-ups' rows and sources in one copy)
        rows_dev = h2d(host_longs(logit_rows + fix_rows + fix_src), dev) if logit_rows or fix_rows else None
        if sampling_reqs:
            logit_index = rows_dev[:len(logit_rows)]
        fixups = None
        if fix_rows:
            k, f = len(logit_rows), len(fix_rows)
            fixups = (rows_dev[k:k + f], prev.sampled.token_ids[rows_dev[k + f:]])
        pos = torch.from_numpy(np.concatenate([np.asarray(dec_pos, dtype=np.int64), *pre_pos]))
        slots = torch.from_numpy(np.concatenate([np.asarray(dec_slots, dtype=np.int64), *pre_slots]))
        window = self._window_inputs(order, prefills) if self.num_window_blocks else None
        hidden, plan, cp = None, None, None
        if self.parallel.cp_size > 1 and prefills:
            # context parallelism: this rank runs the decode rows and its pieces of each chunk; the layers
            # exchange K/V, and the hidden rows are gathered back whole after the forward
            cp = ContextParallelStep.plan(self.parallel, len(dec_pos), [p.query_len for p in prefills], dev)
            cp.slot_mapping, cp.positions = h2d(slots, dev), h2d(pos, dev)
            cp.input_ids, cp.local_index = h2d(torch.tensor(ids, dtype=torch.long), dev), h2d(
                torch.from_numpy(cp.local_rows), dev)
            cp.chunks = prefills
            ids, pos, slots, prefills = cp.localize(ids, pos, slots, prefills)
        graphs = self.decode_graphs
        images = None
        if image_rows:
            rows, embeds = np.asarray(image_rows, dtype=np.int64), torch.cat(image_embeds)
            if cp is not None:
                # context parallelism: every rank encodes the step's images (their later chunks may be any rank's);
                # its own rows take their embeddings, and the whole step's image rows go with the step's token ids
                # (n-grams are hashed over the whole step)
                cp.image_rows = h2d(torch.from_numpy(rows), dev)
                keep, rows = cp.local_of(rows)
                embeds = embeds[h2d(torch.from_numpy(keep), dev)]
            if len(rows):
                images = ImageRows(h2d(torch.from_numpy(rows), dev), embeds)
        graphable = (cp is None and not prefills and images is None and graphs is not None
                     and len(ids) <= graphs.largest)
        exchange, halves = None, None
        if self.step_sync is not None:
            # (two micro-batches: cut at the request boundary that halves this rank's rows best, decode rows first)
            first = cut([i for i, o in enumerate(decode_offsets) if o == 0] + [c.query_start for c in prefills],
                        len(ids)) if self.two_batch else 0
            plan = self.step_sync.exchange(len(ids), len(ids) if graphable else None,
                                           (first, len(ids) - first) if self.two_batch else (0, 0))
            graphable = plan.graph_batch > 0
            exchange = self._exchange(plan)
            halves = self._halves(plan, first)
        captured = None
        if graphable:
            hidden, captured = graphs.replay(ids, pos, slots, decode_tables, decode_lens, fixups, decode_state_slots,
                                             min_batch=plan.graph_batch if plan else 0, window=window,
                                             offsets=decode_offsets)
        if hidden is None:
            views = self._layer_views(slots, pos, prefills, replays, window) if window is not None else None
            hidden = self._eager_forward(ids, pos, slots, decode_tables, decode_lens, prefills, fixups,
                                         decode_state_slots, moe_rows=plan.max_tokens if plan else None,
                                         layer_views=views, offsets=decode_offsets, images=images,
                                         context_parallel=cp, moe_exchange=exchange, halves=halves)
        if cp is not None:
            hidden = cp.gather(hidden)
        if self.eplb is not None:
            self.eplb.after_forward(summed=exchange is not None and exchange.counts_own_rows)
        if capture:
            out.captured = self.model.captured if captured is None else captured

        self.store.after_forward(sched.state_copies)
        if plp_spans:
            for req, first, n, tok_index in plp_spans:
                lp = self.model.compute_logits(hidden[first:first + n]).float().log_softmax(-1)
                out.prompt_logprobs[req.request_id] = PromptLogprobsChunk(
                    tok_index, lp, req.prompt_token_ids[tok_index:tok_index + n])
        if sampling_reqs:
            logits = self.model.compute_logits(hidden[logit_index])
            out.sampled = self.sampler(logits, meta_s, self.generator)
            out.logits = logits
            smp = out.sampled
            out.host_copy = D2HCopy({"token_ids": smp.token_ids, "logprobs": smp.logprobs, "ranks": smp.ranks,
                                     "top_ids": smp.top_ids, "top_logprobs": smp.top_logprobs})
        return out

    @torch.inference_mode()
    def execute_idle(self) -> None:
        """Expert parallelism, a step with nothing scheduled here: join the other ranks' forward (their MoE
        exchanges wait for this rank) with padding rows that touch only the scratch page; nothing if no
        rank has work."""
        plan = self.step_sync.exchange(0, 0, (1, 0) if self.two_batch else (0, 0))
        if not plan.any_work:
            return
        exchange = self._exchange(plan)
        halves = self._halves(plan, 1)
        if plan.graph_batch and self.decode_graphs is not None:
            self.decode_graphs.replay([], torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long), [], [],
                                      min_batch=plan.graph_batch)
        else:
            self._eager_forward([0], torch.zeros(1, dtype=torch.long), torch.tensor([self.pool.scratch_slot]),
                                [[self.num_blocks]], [1], [], None, [self.num_state_slots],
                                moe_rows=plan.max_tokens, moe_valid=torch.zeros((), dtype=torch.long,
                                                                                device=self.device),
                                moe_exchange=exchange, halves=halves)
        self.eplb.after_forward(summed=exchange.counts_own_rows)

    def _exchange(self, plan):
        """The step's MoE exchange (all ranks pick alike: from agreed values); a graph replay's is its bucket's."""
        if plan.graph_batch and self.decode_graphs is not None:
            return self.decode_graphs.exchange_for(self.decode_graphs.bucket_of(plan.graph_batch))
        return step_exchange(self.config.moe_dispatch, self.config.two_batch_overlap, self.parallel.ep_size,
                             plan.max_tokens, self.parallel.backend)

    def _halves(self, plan, first: int):
        """Two micro-batches (two_batch.py) in an eager step whose ranks agreed on them: (this rank's first row of
        the second, the agreed rows per rank of each); None: one batch."""
        if not self.two_batch or plan.graph_batch:
            return None
        rows = agreed_halves(plan.max_tokens, plan.half_rows)
        return None if rows is None else (first, rows)

    def _window_inputs(self, order, prefills: list[PrefillChunk]):
        """The windowed layers' inputs (kv_cache/window_group.py): slots, decode tables and prefill chunks from the
        window group's tables, rows in the step's order (decode rows first, as `execute` lays them out)."""
        bs, dev = self.block_size, self.device
        dec_slots, pre_slots, dec_tables, chunks = [], [], [], []
        for s in order:
            table, start, n = s.window_block_ids, s.start, s.num_new_tokens
            if self._as_decode_rows(s):          # (a verify step: one decode row per token, as `execute`)
                for p in range(start, start + n):
                    dec_slots.append(table[p // bs] * bs + p % bs)
                    dec_tables.append(table)
            else:
                positions = np.arange(start, start + n)
                np_table = np.asarray(table, dtype=np.int64)
                pre_slots.append(np_table[positions // bs] * bs + positions % bs)
                chunks.append(dataclasses.replace(prefills[len(chunks)],
                                                  block_ids=h2d(torch.from_numpy(np_table), dev)))
        return np.concatenate([np.asarray(dec_slots, dtype=np.int64), *pre_slots]), dec_tables, chunks

    def _layer_views(self, slots: torch.Tensor, pos: torch.Tensor, prefills: list[PrefillChunk], replays, window):
        """(full-attention slots, windowed slots, windowed prefill chunks, windowed decode tables) of a step of a
        model with a window group. Replaying chunks (kv_cache/bounded_replay.py): replayed rows leave the full
        layers' block KV and the kept windowed rows untouched (they write to the scratch slots), and windowed
        chunks start at the replay's window floor."""
        full = slots.numpy().copy()
        window_slots, window_tables, window_prefills = window[0].copy(), window[1], list(window[2])
        for index, plan in replays:
            chunk = prefills[index]
            rows = slice(chunk.query_start, chunk.query_start + chunk.query_len)
            full[rows] = replay_slot_mappings(pos.numpy()[rows], full[rows], plan, self.block_size,
                                              self.pool.scratch_slot)[0]
            window_slots[rows] = replay_slot_mappings(pos.numpy()[rows], window_slots[rows], plan, self.block_size,
                                                      self.pool.window_scratch_slot)[1]
            window_prefills[index] = window_layer_chunk(window_prefills[index], plan)
        return torch.from_numpy(full), torch.from_numpy(window_slots), window_prefills, window_tables

    def _eager_forward(self, ids, pos, slots, decode_tables, decode_lens, prefills, fixups=None,
                       decode_state_slots=None, moe_rows: int | None = None,
                       moe_valid: torch.Tensor | None = None, layer_views=None,
                       offsets: list[int] | None = None, images: ImageRows | None = None,
                       context_parallel=None, moe_exchange=None, halves=None) -> torch.Tensor:
        """`halves`: (first row of the second micro-batch, agreed rows per rank of each) to run the step as two
        micro-batches of whole requests (two_batch.py), each with its own metadata; None: one batch."""
        dev = self.device
        meta = self._metadata(slots, decode_tables, decode_lens, prefills, decode_state_slots, offsets, moe_rows,
                              moe_valid, moe_exchange, context_parallel)
        if halves is not None:
            (first, rows), metas = halves, []
            D = len(decode_tables)
            for (a, b), R in zip(((0, first), (first, len(slots))), rows):
                d = slice(min(a, D), min(b, D))
                chunks = [dataclasses.replace(c, query_start=c.query_start - a) for c in prefills
                          if a <= c.query_start < b]
                metas.append(self._metadata(slots[a:b], decode_tables[d], decode_lens[d], chunks,
                                            (decode_state_slots or [])[d], (offsets or [])[d], R, moe_valid,
                                            MoeExchange(moe_exchange.dispatch)))
            meta.two_batch = TwoBatch(first, tuple(metas), self.config.two_batch_overlap)
            self.two_batch_steps += 1
        if context_parallel is not None:     # the whole step's metadata beside this rank's
            context_parallel.meta = dataclasses.replace(meta, slot_mapping=context_parallel.slot_mapping,
                                                        prefills=context_parallel.chunks, context_parallel=None)
        if layer_views is not None:
            full_slots, window_slots, window_prefills, window_tables = layer_views
            windowed = dataclasses.replace(meta, slot_mapping=h2d(window_slots, dev), prefills=window_prefills)
            if decode_tables:
                windowed.decode_block_tables = h2d(torch.from_numpy(pad_tables(window_tables, fill=0)), dev)
            meta.layer_views = (dataclasses.replace(meta, slot_mapping=h2d(full_slots, dev)), windowed)
        input_ids = h2d(host_longs(ids), dev)
        if fixups is not None:
            input_ids[fixups[0]] = fixups[1]
            if context_parallel is not None:    # (decode rows: the same rows of the whole step)
                context_parallel.input_ids[fixups[0]] = fixups[1]
        if images is not None:
            return self.model(input_ids, h2d(pos, dev), self.caches, meta, images=images)
        return self.model(input_ids, h2d(pos, dev), self.caches, meta)

    def _metadata(self, slots, decode_tables, decode_lens, prefills, decode_state_slots, offsets, moe_rows,
                  moe_valid, moe_exchange, context_parallel=None) -> AttentionMetadata:
        dev = self.device
        meta = AttentionMetadata(block_size=self.block_size, slot_mapping=h2d(slots, dev),
                                 num_decode_tokens=len(decode_tables), prefills=prefills,
                                 moe_rows_per_rank=moe_rows, moe_valid_rows=moe_valid,
                                 context_parallel=context_parallel, moe_exchange=moe_exchange)
        if decode_tables:
            meta.decode_block_tables = h2d(torch.from_numpy(pad_tables(decode_tables, fill=0)), dev)
            meta.decode_context_lens = h2d(host_longs(decode_lens), dev)
            meta.max_decode_context_len = max(decode_lens)
            if self.num_state_slots:
                meta.decode_state_slots = h2d(host_longs(decode_state_slots), dev)
                if offsets and any(offsets):
                    meta.decode_row_offsets = h2d(host_longs(offsets), dev)
        return meta

    def _image_rows(self, req: Request, start: int, end: int, row: int, rows: list[int], embeds: list) -> None:
        """The rows of positions [start, end) (step rows from `row` on) inside the request's image spans, and their
        embeddings (on first use the rows the request brought, else encoded here; then from the encoder cache)."""
        for image in req.images:
            lo, hi = max(start, image.offset), min(end, image.end)
            if lo >= hi:
                continue
            span = self.encoder_cache.get_or_encode(image.digest, lambda: self._span_rows(image))
            rows.extend(range(row + lo - start, row + hi - start))
            embeds.append(span[lo - image.offset:hi - image.offset])

    def _span_rows(self, image) -> torch.Tensor:
        if image.embeds is None:
            self.images_encoded += 1
        else:
            self.images_given += 1
        return self.model.embed_image(image)


def _replaying(s) -> bool:
    """Whether this scheduled chunk replays the end of a prefix hit (kv_cache/bounded_replay.py): it runs as a
    prefill chunk, whatever its length, since its layers see the step through different views."""
    return s.replay is not None and s.start < s.replay.end
