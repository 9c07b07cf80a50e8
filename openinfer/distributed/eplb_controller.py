"""EPLB at run time, on every EP rank: count tokens per expert each forward, report `moe_lb` and the load behind
it, and (with `enable_eplb`) every `eplb_rebalance_interval_steps` forwards compute a new placement from the last
`eplb_window_steps` forwards and move expert weights between ranks. The policy is `eplb.py`.

Every rank sees every rank's routing (the MoE exchange carries it), so the counts — and hence the
placements each rank computes — are identical without a reduction, and ranks run the same number of
forwards (step_sync), so they rebalance at the same step. The move happens between forwards on the
device's stream order, so requests in flight simply continue with the experts at their new slots.

The load is reported from the live window after every step (`stats`), not only when a rebalance is considered:
operators watch an imbalance build up before EPLB acts, and with EPLB off. The window is on the host and fed
without host syncs (`LoadWindow`), so reading it costs no step any device time.
"""

from __future__ import annotations

import torch

from openinfer.distributed.collectives import ep_all_reduce
from openinfer.distributed.eplb import (ExpertPlacement, LoadWindow, apply_moves, moe_lb, num_physical_experts,
                                        rank_loads, rebalance)
from openinfer.distributed.expert_parallel import ExpertRouting
from openinfer.distributed.parallel_state import ParallelContext


class EplbController:
    def __init__(self, model, ctx: ParallelContext, config):
        self.ctx = ctx
        # the expert-parallel MoE layers (DeepSeek-V4's and V4.1's: any module with an ExpertRouting and the
        # stacked `experts` whose slots it maps), in model order
        self.moes = [m for m in model.modules() if isinstance(getattr(m, "routing", None), ExpertRouting)]
        num_logical = model.config.n_routed_experts
        self.num_physical = num_physical_experts(num_logical, ctx.num_redundant_experts, ctx.ep_size)
        device = self.moes[0].routing.load.device
        # one [layers, experts] counter; each layer's router adds into its row
        self.loads = torch.zeros(len(self.moes), num_logical, dtype=torch.long, device=device)
        for i, m in enumerate(self.moes):
            m.routing.load = self.loads[i]
        self.placement = ExpertPlacement.initial(len(self.moes), num_logical, self.num_physical, ctx.ep_size)
        self.window = LoadWindow(len(self.moes), num_logical, config.eplb_window_steps)
        self.enabled, self.interval = config.enable_eplb, config.eplb_rebalance_interval_steps
        self.num_forwards = self.num_rebalances = 0
        self._set_routing()

    def _set_routing(self) -> None:
        table, count = self.placement.replicas()
        for i, m in enumerate(self.moes):
            m.routing.set_replicas(table[i].to(self.loads.device), count[i].to(self.loads.device))

    def after_forward(self, summed: bool = False) -> None:
        """`summed`: the step's exchange was all-to-all, where each rank counted its own rows: sum the counts over
        the ranks first (one small device all-reduce), so every rank records — and decides on — the same."""
        if summed:
            ep_all_reduce(self.loads, self.ctx)
        self.window.record(self.loads)
        self.loads.zero_()
        self.num_forwards += 1
        if self.enabled and self.num_forwards % self.interval == 0:
            self.rebalance()

    def measure(self, wait: bool = True) -> float:
        """`moe_lb` of the window's traffic under the current placement: max/mean tokens per EP rank (1.0 =
        balanced); NaN while the window holds no step. `wait`: count the steps whose counts are still on their
        way from the device too (a host sync)."""
        total = self.window.total(wait)
        if not self.window.num_recorded:
            return float("nan")
        return moe_lb(rank_loads(total, self.placement))

    def rebalance(self) -> bool:
        """A new placement if it lowers moe_lb enough to pay for moving weights (eplb.rebalance decides);
        True if experts moved. Writes weights in place: callers outside a step run it with gradients off."""
        decision = rebalance(self.window.total(wait=True), self.placement)
        if decision is not None:
            new, moves = decision
            apply_moves([list(m.experts.parameters()) for m in self.moes], moves, self.ctx.ep_rank,
                        self.ctx.ep_group)
            for m in self.moes:
                m.experts.weights_changed()
            self.placement = new
            self._set_routing()
            self.num_rebalances += 1
        return decision is not None

    def stats(self) -> dict:
        """From the window as it stands (never waits for the device), all ranks alike: `moe_lb` (NaN while the
        window holds no step); `moe_rank_load`, the tokens each EP rank computes under the current placement
        (each expert's tokens split over its replicas), and `moe_expert_load`, the tokens each logical expert
        drew — both summed over the MoE layers; `moe_load_steps`, the forwards they cover; the rebalances so far."""
        total = self.window.total(wait=False)
        per_rank = rank_loads(total, self.placement)                   # [layers, ep_size]
        steps = self.window.num_recorded
        return {"moe_lb": moe_lb(per_rank) if steps else float("nan"),
                "moe_rank_load": per_rank.sum(0).tolist(), "moe_expert_load": total.sum(0).tolist(),
                "moe_load_steps": steps, "eplb_rebalances": self.num_rebalances}
