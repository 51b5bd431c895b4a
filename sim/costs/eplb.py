"""Skewed expert load and EPLB in the DP-EP decode step: what ``sim.costs.step`` asks of a routing distribution.

:class:`ExpertLoad` couples a routing distribution and an EPLB setting (``engine.core.expert_load``: the shares,
the placements, the expected busiest rank) with the model and plan of a step:

* :meth:`ExpertLoad.busiest` — the expected busiest expert rank of a step of ``tokens`` tokens (all DP ranks), or
  None for uniform routing. The step prices each MoE layer at it: the grouped GEMM over its slots' token counts,
  the dispatch it receives and the combine it sends back at ``scale`` times the mean rank's volume
  (``sim.costs.moe_comm``'s ``recv_scale``);
* :meth:`ExpertLoad.rebalance_s` — the EPLB weight movement, priced as a **stall** amortised over the rebalance
  period: every ``rebalance_steps`` steps the rank receiving the most expert weights (summed over the MoE layers)
  takes ``bytes / per-GPU bandwidth + latency`` of the EP group's links (``sim.costs.collective.group_links``:
  NVLink inside one domain, the NICs across), and the step carries ``1 / rebalance_steps`` of it (term
  ``eplb_rebalance``). Engines can overlap the copy with decoding; pricing it as a stall is the conservative
  side, and it is small at the default period.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rackbed.engine.core.expert_load import BusiestRank, EplbSpec, ExpertLoadSpec, busiest_rank


@dataclass(frozen=True, slots=True)
class ExpertLoad:
    """A routing distribution and an EPLB setting for ``sim.costs.step.decode_step_breakdown`` (module docstring)."""

    spec: ExpertLoadSpec = field(default_factory=ExpertLoadSpec)
    eplb: EplbSpec = field(default_factory=EplbSpec)

    @property
    def uniform(self) -> bool:
        return self.spec.uniform

    def busiest(self, model, plan, tokens: int, n_layers: int) -> BusiestRank | None:
        """The expected busiest rank of ``n_layers`` MoE layers for ``tokens`` tokens entering the EP group."""
        slots = model.n_experts + getattr(plan, "redundant_experts", 0)
        return busiest_rank(self.spec, model.n_experts, model.top_k, n_layers, plan.ep, slots, int(tokens),
                            self.eplb)

    def rebalance_s(self, model, plan, topo, busy: BusiestRank) -> float:
        """Seconds per step of the EPLB weight movement (module docstring): one rebalance's stall over
        ``rebalance_steps``."""
        from rackbed.engine.core.formats import get_format
        from rackbed.sim.costs.collective import group_links

        if not busy.moved_per_rebalance:
            return 0.0
        g = group_links(topo, plan.gpus)
        bpe = get_format(plan.weight_format).bytes_per_element("weight")
        expert_bytes = 3 * model.hidden * model.moe_intermediate * bpe / plan.expert_tp
        stall = busy.moved_per_rebalance * expert_bytes / (g.bw_GBps * 1e9) + g.latency_us * 1e-6
        return stall / self.eplb.rebalance_steps
