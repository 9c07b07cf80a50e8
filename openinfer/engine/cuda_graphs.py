"""DecodeGraphs: the model's forward for decode-only batches, captured as CUDA graphs per batch bucket and replayed.

Padded rows of a bucket attend to one token of the scratch page and write their KV (and state) there, so they
touch no real block or slot. Models whose decode reads a context-sized gather (`ModelTraits.context_bucketed_graphs`:
DeepSeek-V4/V4.1's compressed entries) get one graph per (batch bucket, power-of-two context bucket); the others one
per batch bucket at max_model_len. All are captured at start-up (`EngineConfig.cuda_graph_capture = "startup"`), so
no step captures under traffic; "first_use" captures a context-bucketed model's graphs when a step first needs them.

With speculative decoding a verify step runs 1 + k decode rows per request: the buckets then reach
max_num_seqs * (1 + k) rows (at most max_num_batched_tokens). With expert parallelism the ranks replay the bucket
they agreed on, an idle rank with padding rows only (`valid` holds the real rows for the MoE exchanges).
"""

from __future__ import annotations

import dataclasses
import itertools
import sys
import time

import numpy as np
import torch

from openinfer.config import EngineConfig
from openinfer.device_io import h2d, host_longs
from openinfer.distributed.expert_parallel import step_exchange
from openinfer.engine.cache_pool import CachePool
from openinfer.layers.attention import AttentionMetadata

BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512,
           *range(640, 1025, 128), *range(1280, 4097, 256))


class DecodeGraphs:
    def __init__(self, config: EngineConfig, model, pool: CachePool, max_model_len: int, lockstep: bool,
                 context_buckets: bool):
        """`lockstep`: expert parallelism (ranks replay together; the capture's warm-up runs without collectives);
        `context_buckets`: one graph per context bucket too (`ModelTraits.context_bucketed_graphs`)."""
        self.config, self.model, self.pool = config, model, pool
        self.lockstep, self.context_buckets = lockstep, context_buckets
        rows = config.max_num_seqs
        spec = config.speculative_config
        if spec is not None:
            rows = max(rows, min(rows * (1 + spec.num_speculative_tokens), config.max_num_batched_tokens))
        sizes = [b for b in BUCKETS if b <= rows] or [1]
        if sizes[-1] < rows:
            sizes.append(rows)
        dev, bs, n = pool.device, pool.block_size, sizes[-1]
        self.device, self.block_size = dev, bs
        self.sizes, self.max_context = sizes, max_model_len
        self.replays = self.max_rows = 0    # steps replayed with real rows, the most rows in one
        self.captures, self.capture_s = 0, 0.0    # graphs captured so far, and their seconds
        # (decode batch bucket, context the graph was captured for) -> (graph, its output, the features it keeps)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor, dict | None]] = {}
        self.valid = torch.zeros((), dtype=torch.long, device=dev)   # EP: rows of the bucket that are real
        self._live = 0      # rows holding a real request since the last replay (the rest are padding)
        self._width = 0     # table columns those rows used
        width = -(-max_model_len // bs)
        self.ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.pos = torch.zeros(n, dtype=torch.long, device=dev)
        self.slots = torch.full((n,), pool.scratch_slot, dtype=torch.long, device=dev)
        self.tables = torch.full((n, width), pool.num_blocks, dtype=torch.long, device=dev)
        self.lens = torch.ones(n, dtype=torch.long, device=dev)
        self.state_slots = torch.full((n,), pool.num_state_slots, dtype=torch.long, device=dev)   # scratch slot
        # a verify step's rows on a model with per-request state: each row's offset in its request's rows
        self.offsets = (torch.zeros(n, dtype=torch.long, device=dev)
                        if spec is not None and pool.num_state_slots else None)
        if pool.num_window_blocks:   # the windowed layers' slots and tables (kv_cache/window_group.py)
            self.wslots = torch.full((n,), pool.window_scratch_slot, dtype=torch.long, device=dev)
            self.wtables = torch.full((n, width), pool.num_window_blocks, dtype=torch.long, device=dev)
        self.memory_pool = torch.cuda.graph_pool_handle()

    @property
    def largest(self) -> int:
        return self.sizes[-1]

    def context_sizes(self) -> list[int]:
        """The contexts graphs are captured for: powers of two from one block up to max_model_len, and
        max_model_len (models without context buckets: max_model_len alone)."""
        if not self.context_buckets:
            return [self.max_context]
        sizes, c = [], self.block_size
        while c < self.max_context:
            sizes.append(c)
            c *= 2
        return sizes + [self.max_context]

    def context_bucket(self, longest: int) -> int:
        """The context a step whose longest row holds `longest` tokens replays the graph of."""
        if not self.context_buckets:
            return self.max_context
        return min(max(self.block_size, 1 << (max(longest, 1) - 1).bit_length()), self.max_context)

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture every (batch, context) bucket now; a context-bucketed model under `cuda_graph_capture =
        "first_use"` captures each on first use instead."""
        if self.context_buckets and self.config.cuda_graph_capture == "first_use":
            print("[openinfer] CUDA graphs for decode are captured on first use per (batch, context) bucket",
                  file=sys.stderr, flush=True)
            return
        from tqdm import tqdm

        t0 = time.perf_counter()
        todo = [(b, c) for c in reversed(self.context_sizes()) for b in reversed(self.sizes)]
        for b, c in tqdm(todo, desc="capturing decode CUDA graphs", unit="graph", file=sys.stderr,
                         disable=len(todo) < 16 or not sys.stderr.isatty()):
            self.capture(b, c)
        torch.cuda.synchronize(self.device)
        contexts = f" x contexts {self.context_sizes()}" if self.context_buckets else ""
        print(f"[openinfer] captured {len(todo)} CUDA graphs for decode (batch sizes {self.sizes}{contexts}) in "
              f"{time.perf_counter() - t0:.1f}s", file=sys.stderr, flush=True)

    def bucket_of(self, rows: int) -> int | None:
        """The batch bucket a replay of `rows` rows uses (None: beyond the graphs)."""
        return next((s for s in self.sizes if s >= rows), None)

    def exchange_for(self, b: int):
        """Expert parallelism: the MoE exchange bucket `b` is captured with (every rank picks the same; the EP
        group is the world, graphs are CUDA's, and a capture reads no counts on the host)."""
        return step_exchange(self.config.moe_dispatch, self.config.two_batch_overlap,
                             self.config.world_size, b, "nccl", captured=True)

    def capture(self, b: int, context: int) -> None:
        """Warm up (kernel compiles) and capture one bucket. With expert parallelism the warm-up runs without
        collectives (same shapes): a capture is one rank's affair, the others are not waiting for it."""
        bs, pool = self.block_size, self.pool
        t0 = time.perf_counter()

        def meta_for(communicate: bool) -> AttentionMetadata:
            meta = AttentionMetadata(block_size=bs, slot_mapping=self.slots[:b], num_decode_tokens=b,
                                     decode_block_tables=self.tables[:b, :-(-context // bs)],
                                     decode_context_lens=self.lens[:b], max_decode_context_len=context,
                                     decode_state_slots=self.state_slots[:b] if pool.num_state_slots else None,
                                     decode_row_offsets=None if self.offsets is None else self.offsets[:b],
                                     moe_rows_per_rank=b if self.lockstep else None,
                                     moe_valid_rows=self.valid if self.lockstep else None, moe_communicate=communicate,
                                     moe_exchange=self.exchange_for(b) if self.lockstep else None)
            if pool.num_window_blocks:
                meta.layer_views = (dataclasses.replace(meta), dataclasses.replace(
                    meta, slot_mapping=self.wslots[:b], decode_block_tables=self.wtables[:b, :-(-context // bs)]))
            return meta

        # Rows left from the last replay may address more context than this bucket covers: start every row
        # as a padding row (scratch page, scratch state slot); the step's inputs are copied in after capture.
        self._pad_rows(0, max(b, self._live))
        self._live = self._width = 0
        valid = int(self.valid)
        self.valid.fill_(0)      # the warm-up's rows count as padding (no EPLB load)
        self.model(self.ids[:b], self.pos[:b], pool.caches, meta_for(False))
        self.valid.fill_(valid)
        torch.cuda.synchronize(self.device)
        meta = meta_for(True)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.memory_pool):
            hidden = self.model(self.ids[:b], self.pos[:b], pool.caches, meta)
        # a drafter reading the target's features (spec_decode/feature_proposer.py): the graph's own copies,
        # rewritten by each replay
        captured = dict(self.model.captured) if self.model.capture_layers else None
        self.graphs[(b, context)] = (graph, hidden, captured)
        self.captures += 1
        self.capture_s += time.perf_counter() - t0

    def _pad_rows(self, start: int, end: int) -> None:
        """Make graph rows [start, end) padding rows: they read and write only the scratch page and slot."""
        pool = self.pool
        self.ids[start:end].zero_()
        self.pos[start:end].zero_()
        self.slots[start:end].fill_(pool.scratch_slot)
        self.tables[start:end].fill_(pool.num_blocks)
        self.lens[start:end].fill_(1)
        self.state_slots[start:end].fill_(pool.num_state_slots)
        if self.offsets is not None:
            self.offsets[start:end].zero_()
        if pool.num_window_blocks:
            self.wslots[start:end].fill_(pool.window_scratch_slot)
            self.wtables[start:end].fill_(pool.num_window_blocks)

    def replay(self, ids: list[int], pos: torch.Tensor, slots: torch.Tensor, tables: list[list[int]],
               lens: list[int], fixups=None, state_slots=None, min_batch: int = 0, window=None,
               offsets: list[int] | None = None) -> tuple[torch.Tensor | None, dict[int, torch.Tensor] | None]:
        """Replay the graph of the smallest bucket holding max(len(ids), min_batch) rows (expert parallelism:
        the bucket all ranks agreed on; an idle rank replays it with padding rows only). Returns the hidden
        rows and the features the model kept for a drafter (None: no bucket / none kept)."""
        pool = self.pool
        b = len(ids)
        bucket = next((s for s in self.sizes if s >= max(b, min_batch)), None)
        if bucket is None:
            return None, None
        if self.lockstep:
            self.valid.fill_(b)
        context = self.context_bucket(max(lens) if lens else 1)
        if (bucket, context) not in self.graphs:        # first_use (cuda_graph_capture)
            self.capture(bucket, context)
        # Rows of the bucket past b must be padding rows (scratch page, scratch state slot, position 0): rows
        # that held real requests in an earlier replay would otherwise write into those requests' slots
        # and state (and address context the graph's tables may not cover).
        if self._live > b:
            self._pad_rows(b, self._live)
        self._live = b
        graph, hidden, captured = self.graphs[(bucket, context)]
        if b == 0:
            graph.replay()
            return hidden[:0], None
        host_tables = pad_tables(tables, fill=pool.num_blocks)
        width = host_tables.shape[1]
        if self._width > width:
            self.tables[:b, width:self._width].fill_(pool.num_blocks)
            if window is not None:
                self.wtables[:b, width:self._width].fill_(pool.num_window_blocks)
        self._width = width
        # the step's inputs through one pinned staging buffer and one host-to-device copy (one per input cost the
        # host ~20 us each), then into the graph's buffers
        parts = [(self.ids[:b], host_longs(ids)), (self.pos[:b], pos), (self.slots[:b], slots),
                 (self.tables[:b, :width], torch.from_numpy(host_tables)), (self.lens[:b], host_longs(lens))]
        if state_slots is not None and pool.num_state_slots:
            parts.append((self.state_slots[:b], host_longs(state_slots)))
        if self.offsets is not None:
            parts.append((self.offsets[:b], host_longs(offsets or [0] * b)))
        if window is not None:   # window tables have the full tables' lengths (kv_cache/window_group.py)
            parts += [(self.wslots[:b], torch.from_numpy(window[0])),
                      (self.wtables[:b, :width], torch.from_numpy(pad_tables(window[1], fill=pool.num_window_blocks)))]
        staged = h2d(torch.cat([src.reshape(-1) for _, src in parts]), self.device)
        offset = 0
        for dst, src in parts:
            dst.copy_(staged[offset:offset + src.numel()].view(src.shape))
            offset += src.numel()
        if fixups is not None:
            self.ids[fixups[0]] = fixups[1]
        graph.replay()
        self.replays += 1
        self.max_rows = max(self.max_rows, b)
        if captured is not None:
            # the graph's own buffers, rewritten by the next replay: under async scheduling the next step is
            # queued before the drafter reads this one's features, so they are copied out
            captured = {k: v[:b].clone() if self.config.speculates_async else v[:b] for k, v in captured.items()}
        return hidden[:b], captured



def pad_tables(tables: list[list[int]], fill: int) -> np.ndarray:
    """Block tables as one [rows, longest] int64 array, short rows padded with `fill`: one pass through numpy (a
    wide decode batch's tables are its step's largest host-side input; a Python loop over rows cost ~5 us each)."""
    n = len(tables)
    lens = np.fromiter(map(len, tables), dtype=np.int64, count=n)
    width = int(lens.max())
    flat = np.fromiter(itertools.chain.from_iterable(tables), dtype=np.int64, count=int(lens.sum()))
    if int(lens.min()) == width:
        return flat.reshape(n, width)
    out = np.full((n, width), fill, dtype=np.int64)
    out[np.arange(width) < lens[:, None]] = flat
    return out
