"""The `dspark` drafter: DeepSeek-V4.1's DSpark draft stages (`mtp.*`), batched over requests.

What it computes (the semantics of `Transformer.forward_spec` in DeepSeek's reference, vendored read-only in
../shared/reference/deepseek_v41/model.py; docs/spec_decode.md, "The dspark drafter"):

- **Context features.** For every context position p the target model exposes the inputs of its layers
  `dspark_target_layer_ids` (each layer's input streams after its Engram, averaged over the hc streams),
  concatenated in that order: [n_target * dim]. Stage 0 projects them (`main_proj`, then `main_norm`) to one
  context row `main_x[p]`. Each stage turns a context row into a window key for position p (its own `wkv`,
  `kv_norm`, RoPE at p, rounded as the window cache rounds: FP8 with a power-of-two scale per 32) and keeps the
  last `window_size` of them in a per-request ring (position p at slot p % W): `extend`.
- **The block.** With the context through position P (the newest position whose features were given) and the
  token t that follows it (the target's token for P + 1), `propose` runs one block of `dspark_block_size` = n
  positions P + 1 .. P + n: position P + 1 holds t, the others the noise token `dspark_noise_token_id`. The
  embeddings go through the stages as hc streams (stream 0 taken first); each stage's attention sees its ring
  (the valid slots, in slot order) and every position of the block (both directions: the block is drafted in one
  pass); the rest is a V4.1 block (hyper-connections, MoE with the stages' expert counts).
- **Markov head.** Draft i (i = 0 .. n-1, the token for position P + 2 + i) is the argmax of block position i's
  logits (the backbone's head after the last stage's `norm`) plus the Markov bias of the token before it (t for
  i = 0, else draft i - 1): `markov_head.head(markov_head.embed(prev))`, a rank-`dspark_markov_rank` bigram
  correction. Drafting is greedy, as the reference runs it at temperature 0.
- **Confidence head.** score i = `confidence_head.proj([hidden_i, markov_embed(prev_i)])` in float32, where
  hidden_i is block position i's hidden state before the final norm. The reference returns this raw score (no
  activation, no bias). openinfer's verification policy (spec_decode/policy.py) takes acceptance probabilities,
  so `confidences = sigmoid(scores)`: the spec describes the head as a small regression head (W_c, b_c)
  estimating the probability that the target accepts the draft (spec 004, "DSpark confidence head"), and a
  linear head read as a probability is a logit. This mapping is openinfer's reading, not the reference's code.

Bit-for-bit on CPU in the reference's dtype (tests/test_dspark.py): drafts and raw scores equal the reference's
`forward_spec` for the same context. Where the reference is narrower, this generalizes: per-request positions in
one batch (the reference drafts a batch at one shared `start_pos`), and context of any length per `extend` call (the
reference's decode takes one new position per call; its prefill, one whole prompt, drafts nothing).

State and rollback: a ring slot is overwritten by the position W later, so `extend` must only get positions the
target accepted (features of rejected verify rows must not be written: they would take the slot of a still
visible accepted position). Plain torch, device-agnostic, no host sync of its own (the stages' MoE syncs only
where the model's own MoE does: its per-expert loop off the grouped CUDA path).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from openinfer.quantization.kv_formats import Fp8BlockCodec, IdentityCodec


def ring_rows(slots: torch.Tensor, positions: torch.Tensor, num_slots: int, window: int) -> torch.Tensor:
    """Ring row of each (request slot, position) a drafter's `extend` writes: position p at row p % W when it is
    among its request's newest W positions of the call, else row W (the scratch row: an older row would be
    overwritten by a newer one of the same call anyway)."""
    newest = torch.full((num_slots,), -1, dtype=torch.long, device=positions.device)
    newest = newest.scatter_reduce(0, slots, positions, reduce="amax")
    keep = positions > newest[slots] - window
    return torch.where(keep, positions % window, window)


class DSparkDraft(NamedTuple):
    tokens: torch.Tensor          # [B, n] long: drafts for positions P + 2 .. P + n + 1
    confidences: torch.Tensor     # [B, n] float32 in [0, 1]: sigmoid(scores)
    scores: torch.Tensor          # [B, n] float32: the confidence head's raw output (the reference's `confidence`)
    logits: torch.Tensor          # [B, n, vocab] float32: each draft's logits, Markov bias included


class DSparkDrafter:
    """Drafts with the DSpark stages of a `DeepseekV41ForCausalLM` (`model.mtp`), for up to `max_requests`
    requests identified by slots 0 .. max_requests - 1.

    Use: `enable_capture()` once, so the model's forward keeps the target layers' inputs; after a forward,
    `features()` gives them for the forward's rows; `extend(slots, positions, features)` writes the accepted rows'
    context keys; `propose(slots, last_positions, next_tokens)` drafts a block per request."""
    reads_next_tokens = False     # extend reads the rows' features only

    def __init__(self, model, max_requests: int, max_batch: int = 0):
        """`max_batch` > 0 (CUDA, a model whose experts take the grouped path): `propose` for up to that many
        requests replays CUDA graphs (spec_decode/graphs.py); it only reads the rings, so padded rows may read
        slot 0."""
        cfg = model.config
        if not cfg.dspark_block_size or len(model.mtp) == 0:
            raise ValueError("the dspark drafter needs a DeepSeek-V4.1 model with DSpark draft stages "
                             "(dspark_block_size > 0 and n_mtp_layers > 0); this model has none")
        self.model, self.stages = model, model.mtp
        self.block_size = cfg.dspark_block_size
        self.noise_token = cfg.dspark_noise_token_id
        self.target_layers = tuple(cfg.dspark_target_layer_ids)
        self.window = cfg.window_size
        ref = model.embed.weight
        self.dtype = ref.dtype
        self.codec = model.codecs.get("swa") or (Fp8BlockCodec(32) if model.quantized_caches
                                                 else IdentityCodec(self.dtype))
        D = cfg.head_dim
        # [stage, request slot, ring slot, stored key]; ring slot W is scratch (rows `extend` does not keep)
        self.rings = torch.zeros((len(self.stages), max_requests, self.window + 1, self.codec.stored_dim(D)),
                                 dtype=self.codec.storage_dtype, device=ref.device)
        self.graphs = None
        if max_batch and ref.is_cuda and model.traits.cuda_graph_decode:
            from openinfer.spec_decode.graphs import BatchGraphs

            self.graphs = BatchGraphs(self._propose, max_batch)

    # -- context
    def enable_capture(self) -> None:
        self.model.capture_layers = self.target_layers

    def features(self) -> torch.Tensor:
        """The latest forward's target-layer inputs, [rows, n_target * dim]."""
        return self.features_of(self.model.captured)

    def features_of(self, cap: dict[int, torch.Tensor]) -> torch.Tensor:
        """The target-layer inputs a forward kept (`model.captured` after it), [rows, n_target * dim]."""
        missing = [i for i in self.target_layers if i not in cap]
        if missing:
            raise RuntimeError(f"the model's forward kept no hidden states of layers {missing}: call "
                               f"enable_capture() before it runs")
        return torch.cat([cap[i] for i in self.target_layers], dim=-1)

    @torch.inference_mode()
    def extend(self, slots: torch.Tensor, positions: torch.Tensor, features: torch.Tensor) -> None:
        """Write the context keys of rows (request slot, position, features [T, n_target * dim]) into the rings.
        Rows of one request must have distinct positions; of those, only its newest W matter (older ones would be
        overwritten), so only they are written."""
        if features.shape[0] == 0:
            return
        slots, positions = slots.long(), positions.long()
        dst = ring_rows(slots, positions, self.rings.shape[1], self.window)
        main_x = self.stages[0].context(features.to(self.dtype))
        for k, stage in enumerate(self.stages):
            self.rings[k, slots, dst] = stage.context_keys(main_x, positions, self.model.ropes, self.codec)

    def reset(self, slots: torch.Tensor) -> None:
        """Forget the context of these request slots. Not needed for a request that writes its context from
        position 0 (every slot a draft reads is then its own); for one that starts elsewhere (a prefix hit)."""
        self.rings[:, slots.long()] = 0

    # -- drafting
    @torch.inference_mode()
    def propose(self, slots: torch.Tensor, last_positions: torch.Tensor, next_tokens: torch.Tensor) -> DSparkDraft:
        """One block per request: `last_positions` [B] the newest context position P written by `extend`,
        `next_tokens` [B] the token at P + 1 (the target's). Returns n = dspark_block_size drafts per request (with
        graphs: views of the graph's outputs, valid until the next call)."""
        if self.graphs is not None:
            return self.graphs(slots.long(), last_positions.long(), next_tokens.long())
        return self._propose(slots, last_positions, next_tokens)

    def _propose(self, slots: torch.Tensor, last_positions: torch.Tensor, next_tokens: torch.Tensor) -> DSparkDraft:
        B, n, W = next_tokens.shape[0], self.block_size, self.window
        dev = next_tokens.device
        slots, P = slots.long(), last_positions.long()
        ids = torch.full((B, n), self.noise_token, dtype=torch.long, device=dev)
        ids[:, 0] = next_tokens
        positions = (P[:, None] + 1 + torch.arange(n, device=dev)).flatten()
        # ring slot j holds position P - ((P - j) mod W): valid once that is >= 0
        ring_valid = torch.arange(W, device=dev)[None, :] <= P[:, None]
        streams = self.model.embed(ids.flatten()).unsqueeze(1).repeat(1, self.model.config.hc_mult, 1)
        pre_mix = torch.zeros(B * n, self.model.config.hc_mult, device=dev)
        pre_mix[:, 0] = 1.0
        for k, stage in enumerate(self.stages):
            ring = self.codec.decode(self.rings[k, slots, :W], self.dtype)
            streams, pre_mix = stage(streams, pre_mix, positions, self.model.ropes, ring, ring_valid, self.codec)
        tokens, logits, scores = self.stages[-1].draft_head(streams, pre_mix, next_tokens.long(),
                                                            self.model.compute_logits)
        return DSparkDraft(tokens, torch.sigmoid(scores), scores, logits)
