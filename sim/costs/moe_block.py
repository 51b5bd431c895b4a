"""The routed-expert block of one MoE layer from a measured table (calibration kind ``moe_us``).

A serving stack runs the routed experts of a layer as one block: routing / top-k, permute, the expert GEMMs,
unpermute and the weighted sum. Measured whole (the imported per-operator tables do this, and so does
``kernels/bench/measure.py`` for the engine in this repository), the block carries the fixed costs that a grouped-GEMM
roofline misses at small batch: one Qwen3-235B layer at a handful of tokens is dominated by them.

``x`` of a ``moe_us`` curve is the number of tokens entering the EP group's MoE (the whole batch the group's routed
experts serve: with attention DP it is the sum over the group's ranks; with a TP = EP prefiller it is the batch,
which every rank sees); ``y`` is the time of the block on one rank, which computes its ``n_experts / ep`` experts.
Routing in the tables is balanced (every expert gets its share), which is what rackbed's uniform-routing
expectation assumes elsewhere.
"""

from __future__ import annotations

from rackbed.sim.costs.calibration import CalibrationTable

#: the routing distribution rackbed asks the tables for (module docstring)
DIST = "balanced"


def moe_key(model, fmt: str, tp: int, ep: int) -> dict:
    """The ``moe_us`` key of ``model``'s routed experts in ``fmt`` with expert TP ``tp`` and EP ``ep``."""
    return {"fmt": fmt, "hidden": model.hidden, "inter": model.moe_intermediate, "top_k": model.top_k,
            "n_experts": model.n_experts, "tp": tp, "ep": ep, "dist": DIST}


def moe_block_s(calib: CalibrationTable | None, gpu, model, fmt: str, tp: int, ep: int,
                n_tokens: float) -> float | None:
    """Seconds of the routed-expert block on one rank for ``n_tokens`` entering the EP group, from a matching
    ``moe_us`` entry; None when the table has none (the caller then prices the grouped GEMMs)."""
    if calib is None or n_tokens <= 0:
        return None
    us = calib.lookup("moe_us", gpu.name, n_tokens, **moe_key(model, fmt, tp, ep))
    return None if us is None else us * 1e-6
