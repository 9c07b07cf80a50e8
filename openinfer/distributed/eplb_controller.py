"""EPLB at run time, on every EP rank: count tokens per expert each forward, report `moe_lb`, and (with
`enable_eplb`) every `eplb_rebalance_interval_steps` forwards compute a new placement from the last
`eplb_window_steps` forwards and move expert weights between ranks. The policy is `eplb.py`.

Every rank sees every rank's routing (the MoE exchange carries it), so the counts — and hence the
placements each rank computes — are identical without a reduction, and ranks run the same number of
forwards (step_sync), so they rebalance at the same step. The move happens between forwards on the
device's stream order, so requests in flight simply continue with the experts at their new slots.
"""

from __future__ import annotations

import torch

from openinfer.distributed.eplb import (ExpertPlacement, LoadWindow, apply_moves, moe_lb, num_physical_experts,
                                        rank_loads, rebalance)
from openinfer.distributed.expert_parallel import ExpertRouting
from openinfer.distributed.parallel_state import ParallelContext

_MEASURE_EVERY = 64     # forwards between moe_lb readings (each reads the window back to the host)


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
        self.window = LoadWindow(len(self.moes), num_logical, config.eplb_window_steps, device)
        self.enabled, self.interval = config.enable_eplb, config.eplb_rebalance_interval_steps
        self.num_forwards = self.num_rebalances = 0
        self.moe_lb: float | None = None
        self._set_routing()

    def _set_routing(self) -> None:
        table, count = self.placement.replicas()
        for i, m in enumerate(self.moes):
            m.routing.set_replicas(table[i].to(self.loads.device), count[i].to(self.loads.device))

    def after_forward(self) -> None:
        self.window.record(self.loads)
        self.loads.zero_()
        self.num_forwards += 1
        if self.num_forwards % _MEASURE_EVERY == 0:
            self.measure()
        if self.enabled and self.num_forwards % self.interval == 0:
            self.rebalance()

    def measure(self) -> float:
        """max/mean tokens per rank (1.0 = balanced) of the window's traffic under the current placement."""
        self.moe_lb = moe_lb(rank_loads(self.window.total().cpu(), self.placement))
        return self.moe_lb

    def rebalance(self) -> bool:
        """A new placement if it lowers moe_lb enough to pay for moving weights (eplb.rebalance decides);
        True if experts moved."""
        decision = rebalance(self.window.total().cpu(), self.placement)
        if decision is not None:
            new, moves = decision
            apply_moves([list(m.experts.parameters()) for m in self.moes], moves, self.ctx.ep_rank,
                        self.ctx.ep_group)
            self.placement = new
            self._set_routing()
            self.num_rebalances += 1
        self.measure()
        return decision is not None

    def stats(self) -> dict:
        return {"moe_lb": self.moe_lb if self.moe_lb is not None else float("nan"),
                "eplb_rebalances": self.num_rebalances}
