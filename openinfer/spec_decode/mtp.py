"""The `mtp` drafter: DeepSeek-V4's multi-token-prediction head (`mtp.0.*`, already loaded with the model),
chained for several drafts, run by `FeatureProposer` (feature_proposer.py) after each step.

The head's row q reads the main model's hidden state at q (forward_streams' output, pre final norm) and the
token at q + 1, runs one sliding-window block over its own window ring (`mtp_swa`, a per-request state of the
runner's caches) at position q — the main model's positions, input ids shifted by one, as SGLang and vLLM run
DeepSeek's MTP — and predicts the token at q + 2 (DeepSeek-V3 §2.2's MTP module, depth 1).

- `extend` (the accepted rows of a step): row q's hidden state with the token that followed it runs through the
  head, which writes the ring. The newest row's output (at P, the newest accepted position) is the first draft's:
  kept per slot. A request's rows of a verify step (at most 1 + k) run as decode rows of one batched call — the
  ring is read after the call's writes, and the k rows of rollback room keep a later row out of an earlier row's
  window, as in the target's verify steps; longer runs (a prompt) run as one chunk per request.
- `propose`: draft 1 = argmax of that output's logits; drafts 2..k chain the head on itself (its own output
  hidden state in place of the main model's, the previous draft as the token) at positions P + 1 .. P + k - 1 —
  the way DeepSeek's MTP is reused for more than one draft (SGLang/vLLM do the same). Confidence of a draft =
  the head's probability for it (used by the `confidence` policy).
- CUDA graphs (`max_batch` > 0, a single-process model whose experts take the grouped path): the chain — k heads
  and k - 1 decode steps of the head's block — and the decode rows of `extend` replay from graphs per batch
  bucket (spec_decode/graphs.py); padded rows write only the runner's scratch state slot.
- Rollback: the chain writes ring rows for positions past P that a rejection makes stale; the ring keeps
  `rollback_rows` ≥ k rows of room (runner caches), so those rows alias positions no later read sees, and the
  next `extend` rewrites the accepted ones from the target's real hidden states.

Context the engine did not compute (a prefix-cache hit) is restored with the request's state snapshot (the
`mtp_swa` ring is a per-request state like the others); a snapshot taken in the step that reached the boundary
lacks that step's own head rows (the head runs after the step), so drafts right after a hit can be worse —
never the output (verification is lossless)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from openinfer.config import MAX_NGRAM_DRAFTS
from openinfer.layers.attention import AttentionMetadata, PrefillChunk
from openinfer.models.deepseek_v4.model import MTP_INPUT


class MtpDraft(NamedTuple):
    tokens: torch.Tensor          # [B, k] long
    confidences: torch.Tensor     # [B, k] float32: the head's probability of each draft


class MtpDrafter:
    reads_next_tokens = True      # extend needs the token after each row (FeatureProposer passes it)
    block_size = MAX_NGRAM_DRAFTS  # chained: any number of drafts up to the engine's limit

    def __init__(self, model, caches: dict, block_size: int, num_drafts: int, max_batch: int = 0,
                 scratch_slot: int = 0):
        """`max_batch` > 0: `propose` for up to that many requests replays CUDA graphs, whose padded rows write
        the state slot `scratch_slot` (the runner's spare one)."""
        if "mtp" not in model.traits.drafters:
            raise ValueError(f"speculative_config method 'mtp' needs a DeepSeek-V4 model with MTP heads "
                             f"(num_nextn_predict_layers > 0); {type(model).__name__} has none")
        self.model, self.caches, self.kv_block_size, self.num_drafts = model, caches, block_size, num_drafts
        self._newest: dict[int, torch.Tensor] = {}      # request slot -> the head's hidden at P
        self.graphs = self.row_graphs = None
        single = model.parallel.tp_size == 1 and model.parallel.ep_size == 1
        if max_batch and single and model.lm_head.weight.is_cuda and model.traits.cuda_graph_decode:
            from openinfer.spec_decode.graphs import BatchGraphs

            self.graphs = BatchGraphs(self._chain, max_batch, pad_values=(0, scratch_slot, 0, 0))
            self.row_graphs = BatchGraphs(self._rows, max_batch * (1 + num_drafts), pad_values=(0, 0, 0, scratch_slot))

    def enable_capture(self) -> None:
        self.model.capture_layers = (MTP_INPUT,)

    def features_of(self, captured: dict) -> torch.Tensor:
        return captured[MTP_INPUT]

    def reset(self, slots: torch.Tensor) -> None:
        """Nothing to clear: a request starting past position 0 got its ring with its state snapshot."""

    @torch.inference_mode()
    def extend(self, slots: torch.Tensor, positions: torch.Tensor, features: torch.Tensor,
               next_tokens: torch.Tensor) -> None:
        """Rows (slot, position q, main hidden at q, token at q + 1), each request's rows contiguous and in
        order: run the head over them at their positions, one chunk per request."""
        if features.shape[0] == 0:
            return
        sl, ps = slots.tolist(), positions.tolist()
        dev, bs = features.device, self.kv_block_size
        runs, first = [], 0                    # (first row, rows, first position, slot) of each request
        for i in range(1, len(sl) + 1):
            if i == len(sl) or sl[i] != sl[first] or ps[i] != ps[i - 1] + 1:
                runs.append((first, i - first, ps[first], sl[first]))
                first = i
        short = [r for r in runs if r[1] <= 1 + self.num_drafts]
        for group in (short, [r for r in runs if r[1] > 1 + self.num_drafts]):
            if not group:
                continue
            rows = torch.tensor([i for r0, n, _, _ in group for i in range(r0, r0 + n)], device=dev)
            args = (features[rows], next_tokens[rows].long(), positions[rows].long(), slots[rows].long())
            if group is short:               # decode rows, batched (graphed)
                hidden = self.row_graphs(*args) if self.row_graphs is not None else self._rows(*args)
            else:
                chunks, row = [], 0
                for _, n, p0, slot in group:
                    chunks.append(PrefillChunk(row, n, p0 + n, torch.zeros(0, dtype=torch.long, device=dev), bs,
                                               slot))          # the window-only head reads no pages
                    row += n
                meta = AttentionMetadata(block_size=bs, slot_mapping=torch.zeros(row, dtype=torch.long, device=dev),
                                         prefills=chunks)
                hidden = self.model.mtp_hidden(0, *args[:3], self.caches, meta)
            row = 0
            for _, n, _, slot in group:
                row += n
                self._newest[slot] = hidden[row - 1].clone()    # (a graph's output is rewritten by its next replay)

    def _rows(self, features, next_tokens, positions, slots) -> torch.Tensor:
        """The head over rows that are decode rows (each request's rows consecutive, at most 1 + k)."""
        meta = AttentionMetadata(block_size=self.kv_block_size, slot_mapping=torch.zeros_like(positions),
                                 num_decode_tokens=len(positions), decode_state_slots=slots,
                                 decode_context_lens=positions + 1)
        return self.model.mtp_hidden(0, features, next_tokens, positions, self.caches, meta)

    @torch.inference_mode()
    def propose(self, slots: torch.Tensor, last_positions: torch.Tensor, next_tokens: torch.Tensor) -> MtpDraft:
        """`num_drafts` drafts per request whose newest accepted position is `last_positions` (the head already
        ran there on `next_tokens` in `extend`)."""
        hidden = torch.stack([self._newest[s] for s in slots.tolist()])
        args = (hidden, slots.long(), last_positions.long(), next_tokens.long())
        return self.graphs(*args) if self.graphs is not None else self._chain(*args)

    def _chain(self, hidden: torch.Tensor, slots: torch.Tensor, P: torch.Tensor, next_tokens: torch.Tensor) -> MtpDraft:
        """The drafts from the head's hidden at P: one head, then the block at P + 1 .. P + k - 1 on the previous
        draft (no host sync: capturable)."""
        dev, bs = next_tokens.device, self.kv_block_size
        B = len(slots)
        tokens, conf = [], []
        for j in range(self.num_drafts):
            if j:
                pos = P + j
                meta = AttentionMetadata(block_size=bs, slot_mapping=torch.zeros(B, dtype=torch.long, device=dev),
                                         num_decode_tokens=B, decode_state_slots=slots,
                                         decode_context_lens=pos + 1)
                hidden = self.model.mtp_hidden(0, hidden, tokens[-1], pos, self.caches, meta)
            probs = self.model.mtp_head(0, hidden).float().softmax(-1)
            p, t = probs.max(-1)
            tokens.append(t)
            conf.append(p)
        return MtpDraft(torch.stack(tokens, 1), torch.stack(conf, 1))
