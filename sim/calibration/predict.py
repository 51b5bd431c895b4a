"""The simulator's predictions for measured rows (``rackbed validate``): each row priced by the cost function the
simulator calls for that work, with a given calibration table (:func:`predict_row`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from rackbed.sim.calibration.measurements import row_id
from rackbed.sim.costs.calibration import KINDS, CalibrationTable, kernel_fixed_us


@dataclass
class Prediction:
    """The simulator's time for one measured row (``predicted_s``) and what produced it."""

    row_id: str
    bench: str
    measured_s: float
    predicted_s: float
    model: str
    extra: dict = field(default_factory=dict)

    @property
    def rel_error(self) -> float:
        return (self.predicted_s - self.measured_s) / self.measured_s


def predict_row(r: dict, calib: CalibrationTable | None, topo, model=None) -> Prediction | None:
    """The simulator's prediction for measured row ``r`` (the cost function the simulator calls, with ``calib``),
    or None for rows without a model (errors, unknown benchmarks). ``model``: a ModelSpec for the attention rows
    (default: Qwen3-235B-A22B with the row's head counts)."""
    from rackbed.sim.costs.attention import full_attention_decode, full_attention_prefill
    from rackbed.sim.costs.collective import allreduce_time, p2p_copy_time
    from rackbed.sim.costs.gemm import gemm_time, grouped_gemm_time, hbm_rate_Bps

    if r.get("error") or not r.get("median_us"):
        return None
    gpu = topo.gpu_spec(topo.gpu_ids[0])
    t = r["median_us"] * 1e-6
    b, rid = r["bench"], row_id(r)
    if b == "gemm":
        if r["op"] == "grouped":
            c = grouped_gemm_time(gpu, [r["m"]] * r["n_experts"], r["n"], r["k"], r["fmt"], calib=calib)
        else:
            c = gemm_time(gpu, r["m"], r["n"], r["k"], r["fmt"], calib=calib)
        return Prediction(rid, b, t, c.total_s, "gemm_time" if r["op"] == "dense" else "grouped_gemm_time",
                          {"calibrated": c.calibrated})
    if b == "hbm_copy":
        return Prediction(rid, b, t, r["bytes"] / hbm_rate_Bps(gpu, r["bytes"], calib)
                          + kernel_fixed_us(calib, gpu) * 1e-6, "hbm_rate_Bps + kernel_fixed_us")
    if b in ("flash_prefill", "attn_decode"):
        m = attn_model(model, r)
        if b == "flash_prefill":
            a = full_attention_prefill(gpu, m, [(r["seq"], 0)], tp=1, calib=calib)
            return Prediction(rid, b, t, a.core_s, "full_attention_prefill.core_s")
        a = full_attention_decode(gpu, m, [r["ctx"]] * r["batch"], tp=1, page_tokens=1, calib=calib)
        return Prediction(rid, b, t, a.core_s, "full_attention_decode.core_s")
    if b == "allreduce":
        c = allreduce_time(topo, list(range(r["n_ranks"])), r["size_bytes"], algo=r["algo"], calib=calib)
        return Prediction(rid, b, t, c.total_s, "allreduce_time", {"calibrated": c.calibrated})
    if b == "p2p_copy":
        c = p2p_copy_time(topo, r["src"], r["dst"], r["size_bytes"], calib=calib)
        return Prediction(rid, b, t, c.total_s, "p2p_copy_time", {"calibrated": c.calibrated})
    if b == "moe_block":
        return _predict_moe(r, calib, gpu, t, rid)
    return None


def _predict_moe(r: dict, calib: CalibrationTable | None, gpu, t: float, rid: str) -> Prediction | None:
    """A ``moe_block`` row: ``routed`` from the table's ``moe_us`` entry (the row's key), else as the step model
    prices the block without one (the routed grouped GEMMs of :func:`sim.costs.gemm.expert_mlp_time` over the
    uniform-routing histogram; dispatch and combine are nothing on one rank); ``router_gemm`` as the step model's
    router term (:func:`sim.costs.gemm.gemm_time`, bf16 ``[T, hidden] x [hidden, n_experts]``); ``layer`` the two
    together. The other parts (the router with its top-k, the pieces alone) have no model of their own (None)."""
    from rackbed.sim.costs.gemm import binomial_histogram, expert_mlp_time, gemm_time

    part, T = r.get("part"), int(r["tokens"])
    E, ep, tp = int(r["n_experts"]), int(r.get("ep", 1)), int(r.get("tp", 1))

    def routed() -> tuple[float, str]:
        us = None if calib is None else calib.lookup("moe_us", gpu.name, T, **{f: r[f] for f in KINDS["moe_us"]})
        if us is not None:
            return us * 1e-6, "moe_us"
        hist = binomial_histogram(T, r["top_k"] / E, E // ep)
        return (expert_mlp_time(gpu, r["hidden"], r["inter"] // tp, hist, r["fmt"], calib=calib).total_s,
                "expert_mlp_time")

    def router() -> float:
        return gemm_time(gpu, T, E, r["hidden"], "bf16", calib=calib).total_s

    if part == "routed":
        s, how = routed()
        return Prediction(rid, "moe_block", t, s, how, {"calibrated": how == "moe_us"})
    if part == "router_gemm":
        return Prediction(rid, "moe_block", t, router(), "gemm_time (router)")
    if part == "layer":
        s, how = routed()
        return Prediction(rid, "moe_block", t, router() + s, f"gemm_time (router) + {how}")
    return None


def attn_model(model, r: dict):
    from rackbed.engine.core.model import get_model

    m = model or get_model("qwen3-235b-a22b")
    if (m.n_q_heads, m.n_kv_heads, m.head_dim) != (r["n_q_heads"], r["n_kv_heads"], r["head_dim"]):
        m = m.model_copy(update={"n_q_heads": r["n_q_heads"], "n_kv_heads": r["n_kv_heads"],
                                 "head_dim": r["head_dim"]})
    return m
