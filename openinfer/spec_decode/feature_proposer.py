"""FeatureProposer: runs a drafter that reads the target's own hidden features (DSpark's draft stages,
`spec_decode/dspark.py`; DeepSeek-V4's MTP head, `spec_decode/mtp.py`) inside the engine's step loop.

Such a drafter needs, per request, the features of every position the target accepted (its context ring) and
the token the target sampled last. Both are known only once a step's samples are on the host (synchronous
scheduling): `after_step` then writes the accepted rows' features into the drafter's rings, drafts one block for
every request still decoding, and keeps the drafts for the next `Speculator.propose`. Rows of rejected drafts
are never written (a ring row is overwritten by the position W later, so a rejected row would take the slot of a
still-visible accepted position).

Requests that will not draft at their next step (`wants`; under async scheduling, those whose drafts are mostly
rejected draft only to probe) get their rings extended but no block drafted, and a step where none drafts reads
nothing back from the device.

Context a request did not compute here (a prefix-cache hit, a replay from the KV store) has no features: the
drafter's ring slots for it are zeroed (`reset`), which makes drafts worse until W new positions are in, never
wrong outputs (verification is lossless whatever the drafts).

The drafter's request slots are the KV manager's state slots (one per running request, recorded with the step)
when the model has per-request state (the `mtp` head's ring is one of them); otherwise the proposer keeps its own
map from requests to `num_slots` drafter slots, the least recently scheduled request giving its slot up (its
context then starts over: `reset`).
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from openinfer.request import Request


class FeatureProposer:
    def __init__(self, drafter, num_drafts: int, num_slots: int = 0):
        if num_drafts > drafter.block_size:
            raise ValueError(f"num_speculative_tokens {num_drafts} is above the drafter's block size "
                             f"{drafter.block_size} (drafts per step it can make)")
        self.drafter, self.k = drafter, num_drafts
        drafter.enable_capture()
        # request_id -> (its token count when drafted, drafts, confidences): valid while the count is unchanged
        self.pending: dict[str, tuple[int, list[int], list[float]]] = {}
        self._context_end: dict[str, int] = {}      # request_id -> the next position its ring expects
        self._own_slots: OrderedDict[str, int] = OrderedDict()   # models without state slots: request -> slot
        self._free_slots = list(range(num_slots - 1, -1, -1))

    def _slot(self, rid: str, state_slot: int | None) -> int | None:
        if state_slot is not None or not (self._own_slots or self._free_slots):
            return state_slot
        if rid in self._own_slots:
            self._own_slots.move_to_end(rid)
            return self._own_slots[rid]
        if not self._free_slots:
            evicted, slot = self._own_slots.popitem(last=False)
            self._context_end.pop(evicted, None)
            self._free_slots.append(slot)
        self._own_slots[rid] = slot = self._free_slots.pop()
        return slot

    def propose(self, req: Request, room: int) -> tuple[list[int], list[float]]:
        """The drafts kept for `req` by the last `after_step`, cut to `room` (none if they are stale). Under async
        scheduling its next step may still be on the device: the block then continues past the tokens that step
        verifies and samples, if its leading drafts are the ones being verified (`guessed_continuation` below)."""
        got = self.pending.get(req.request_id)
        if got is None or got[0] != req.num_tokens:
            return [], []
        tokens, conf = got[1], got[2]
        if req.num_pending:
            skip = req.num_pending - 1
            if tokens[:skip] != req.pending_drafts:
                return [], []
            tokens, conf = guessed_continuation(tokens, conf, skip)
        n = min(room, self.k)
        return tokens[:n], conf[:n]

    @torch.inference_mode()
    def after_step(self, runner_out, requests: dict[str, Request], wants=None) -> None:
        """Extend the rings with the step's accepted rows, then draft for the requests that sampled a token (and,
        if `wants` is given, for which `wants(request)` says it will draft at its next step)."""
        if runner_out.captured is None or not runner_out.rows:
            return
        features = self.drafter.features_of(runner_out.captured)
        dev = features.device
        reads_next = self.drafter.reads_next_tokens
        rows, positions, slots, following = [], [], [], []
        draft_reqs = []
        for rid, (row, start, n, state_slot) in runner_out.rows.items():
            req = requests.get(rid)
            self.pending.pop(rid, None)
            if req is None:                          # finished this step: nothing to draft for
                self._context_end.pop(rid, None)
                if rid in self._own_slots:
                    self._free_slots.append(self._own_slots.pop(rid))
                continue
            slot = self._slot(rid, state_slot)
            if slot is None:
                continue
            kept = min(n, req.num_computed_tokens - start)          # rows whose tokens the target accepted
            if kept <= 0:
                continue
            if self._context_end.get(rid, 0) != start:            # context computed elsewhere (a prefix hit)
                self.drafter.reset(torch.tensor([slot], device=dev))
            self._context_end[rid] = start + kept
            rows.extend(range(row, row + kept))
            positions.extend(range(start, start + kept))
            if reads_next:                                          # the token after each row (mtp)
                following.extend(req.token_ids_slice(start + 1, start + kept + 1))
            slots.extend([slot] * kept)
            # (its next step may be on the device already: its pending tokens are computed, not yet known)
            if (rid in runner_out.sample_index and req.num_computed_tokens - req.num_pending == req.num_tokens - 1
                    and (wants is None or wants(req))):
                draft_reqs.append((req, slot))
        for rid in [r for r in self._context_end if r not in requests]:
            del self._context_end[rid]
        for rid in [r for r in self._own_slots if r not in requests]:     # aborted between steps
            self._free_slots.append(self._own_slots.pop(rid))
        if rows:
            extra = {"next_tokens": torch.tensor(following, device=dev)} if reads_next else {}
            self.drafter.extend(torch.tensor(slots, device=dev), torch.tensor(positions, device=dev),
                                features[torch.tensor(rows, device=dev)], **extra)
        if not draft_reqs:
            return
        draft = self.drafter.propose(torch.tensor([s for _, s in draft_reqs], device=dev),
                                     torch.tensor([r.num_tokens - 2 for r, _ in draft_reqs], device=dev),
                                     torch.tensor([r.token_ids_slice(r.num_tokens - 1, r.num_tokens)[0]
                                                   for r, _ in draft_reqs], device=dev))
        tokens = draft.tokens.tolist()          # the whole block: under async scheduling a step may skip some
        conf = draft.confidences.float().tolist()
        for (req, _), t, c in zip(draft_reqs, tokens, conf):
            self.pending[req.request_id] = (req.num_tokens, t, c)


def guessed_continuation(tokens: list[int], conf: list[float], skip: int) -> tuple[list[int], list[float]]:
    """Drafts after a step still on the device: `tokens` continue the known sequence; the first `skip` repeat the
    drafts that step verifies and the next one guesses the token it samples after them, so the drafts are what
    follows. The first draft is kept only if that guess was right too: its confidence carries the guess's."""
    if len(tokens) <= skip + 1:
        return [], []
    if not conf:                      # a drafter made without confidences (the `fixed` policy reads none)
        return tokens[skip + 1:], []
    return tokens[skip + 1:], [conf[skip] * conf[skip + 1], *conf[skip + 2:]]
