"""Energy and money per token of a simulated run: GPU draw by step, node and rack overhead, PUE, $/M tokens.

**Power of a GPU.** Every catalogue GPU carries three draws (``topology.specs.GpuPower``): ``idle_w``
(powered, weights resident, no kernel running), ``memory_bound_w`` and ``compute_bound_w`` (the board power
limit). While a worker runs a step, each of its GPUs draws

    P = P_mem + k * (P_compute - P_mem) * min(1, u / U_SAT)

where ``k`` is the share of the step spent in kernels rather than in communication (from the cost model's
``StepTime``: ``1 - (a2a_s + allreduce_s) / total_s``, summed over the role's steps) — collectives draw the
memory-bound figure — and ``u`` is the step's compute utilisation: the model's FLOPs for the tokens the step
processes (``ModelSpec.flops_per_token``) over the GPUs' dense peak for the run's weight format during the
kernel time. ``U_SAT`` (0.5, an assumption) is the utilisation at which a GPU reaches its power limit:
GEMM-heavy prefill at half the dense peak already runs at the board's power cap. Between steps, and on GPUs of
the pool no worker holds (spares, groups not started yet), a GPU draws ``idle_w``.

Prefill steps are priced one by one (each span carries its token count); decode and aggregated steps by their
role's mean utilisation (a span carries no batch size). The draw is linear in ``u`` below ``U_SAT``, so the
mean gives the sum over steps exactly there; decode runs far below it.

**Accounting rule** (one, used by every output and study): the deployment's whole pool — every GPU it
reserves, spares included — for the whole simulated time. GPU energy is ``idle_w x pool x T`` plus, per step,
its GPUs' draw above idle; to it come the overheads of the nodes holding pool GPUs (``NodeSpec.overhead_w``)
and of the racks holding them (``RackSpec.overhead_w``) for the whole time: IT energy. Facility energy is IT
energy x PUE. Cost is ``$/GPU-hour x pool x T / 3600`` (hardware, whatever the GPUs do) plus facility kWh x
``$/kWh``; per million output tokens of the requests done (``usd_per_m_output``) and of the requests that met
the SLO (``usd_per_m_good_output``: what compares deployments at equal SLOs). A GPU-hour price that already
includes power is given with ``usd_per_kwh: 0``."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from rackbed.topology.errors import UserError

#: compute utilisation (FLOPs / dense peak during kernels) at which a GPU draws its power limit (assumption)
U_SAT = 0.5
J_PER_KWH = 3.6e6


@dataclass(frozen=True)
class EnergyPrices:
    """Prices and facility efficiency: ``usd_per_gpu_hour`` (0: no hardware cost), ``usd_per_kwh``,
    ``pue``."""

    usd_per_gpu_hour: float = 0.0
    usd_per_kwh: float = 0.10
    pue: float = 1.2

    def __post_init__(self) -> None:
        for name in ("usd_per_gpu_hour", "usd_per_kwh"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise UserError(f"{name}: must be a number >= 0, got {v!r}")
        if not (isinstance(self.pue, (int, float)) and math.isfinite(self.pue) and self.pue >= 1):
            raise UserError(f"pue: must be a number >= 1, got {self.pue!r}")


def busy_power_w(power, u, kernel_frac, u_sat: float = U_SAT):
    """Draw (W) of one GPU while it runs a step of compute utilisation ``u`` (scalar or array) with
    ``kernel_frac`` of the step in kernels (module docstring)."""
    sat = np.minimum(1.0, np.maximum(0.0, np.asarray(u, dtype=np.float64)) / u_sat)
    k = np.clip(np.asarray(kernel_frac, dtype=np.float64), 0.0, 1.0)
    return power.memory_bound_w + k * (power.compute_bound_w - power.memory_bound_w) * sat


def _kernel_frac(bd: dict | None) -> float:
    if not bd:
        return 1.0
    tot = sum(bd.values())
    return 1.0 - (bd.get("a2a_s", 0.0) + bd.get("allreduce_s", 0.0)) / tot if tot > 0 else 1.0


def peak_tflops(gpu, weight_format: str) -> float:
    """Dense TFLOP/s of ``gpu`` for the run's weight format (BF16 where the format has no tensor cores)."""
    r = gpu.dense_tflops.get(weight_format) if weight_format in type(gpu.dense_tflops).model_fields else None
    return r or gpu.dense_tflops.bf16


def energy_report(built, res, prices: EnergyPrices | None = None) -> dict | None:
    """``metrics["energy"]`` of a run (``Built``, ``SimResult``): energy per worker and in total, J per token,
    kWh per simulated day, mean kW, $/M tokens (module docstring). None when a pool GPU has no power
    figure."""
    from rackbed.engine.core.metrics import request_arrays
    from rackbed.sim.driver import SPAN_DECODE, SPAN_MIXED, SPAN_PREFILL
    from rackbed.topology.power import deployment_gpus

    prices = prices or EnergyPrices()
    topo, model, dep = built.topology, built.model, built.deployment
    pool = deployment_gpus(dep)
    powers = [topo.gpu_spec(g).power for g in pool]
    if not pool or any(p is None for p in powers):
        return None
    gpu = topo.gpu_spec(pool[0])
    pw = gpu.power
    T = float(res.sim_end_s)
    fmt = built.scenario.weight_format
    peak = peak_tflops(gpu, fmt) * 1e12

    a = request_arrays(res.rows, res.row_fields)
    done = a["status"] == "done"
    out_tok = float(a["output_tokens"][done].sum())
    in_tok = float(a["prompt_tokens"][done].sum())
    good = _good_output_tokens(a, done, res.metrics)
    mean_prompt = max(1, round(float(np.mean(a["prompt_tokens"])))) if len(a["prompt_tokens"]) else 1
    mean_out = float(np.mean(a["output_tokens"])) if len(a["output_tokens"]) else 1.0
    f_prefill = model.flops_per_token("prefill", mean_prompt)
    f_decode = model.flops_per_token("decode", max(1, round(mean_prompt + mean_out / 2)))

    n_gpus = {gid: n for gid, _role, n, *_ in res.groups}
    role_of = {gid: role for gid, role, *_ in res.groups}
    life = {gid: max(0.0, min(T, T if math.isnan(end) else end) - created)
            for gid, _r, _n, created, end, _s in res.groups}
    kf = {role: _kernel_frac(bd) for role, bd in res.breakdown_s.items()}

    # compute spans: (worker, kind, start, dur, arg); clipped to the simulated time
    spans = [s for s in res.spans if s[1] in (SPAN_PREFILL, SPAN_DECODE, SPAN_MIXED) and s[0] in n_gpus]
    wid = [s[0] for s in spans]
    start = np.array([s[2] for s in spans], dtype=np.float64)
    dur = np.clip(np.minimum(start + np.array([s[3] for s in spans], dtype=np.float64), T) - start, 0.0, None)
    kind = np.array([s[1] for s in spans], dtype=np.int64)
    ng = np.array([n_gpus[w] for w in wid], dtype=np.float64)
    gpu_s = dur * ng

    u = np.zeros(len(spans))
    pre = kind == SPAN_PREFILL
    if pre.any():
        tok = np.array([s[4] if s[1] == SPAN_PREFILL else 0 for s in spans], dtype=np.float64)
        kt = gpu_s * kf.get("prefill", 1.0)
        u[pre] = np.divide(tok[pre] * f_prefill, peak * kt[pre], out=np.zeros(int(pre.sum())),
                           where=kt[pre] > 1e-12)  # a span of ~no GPU time has no utilisation
    dm = res.metrics.get("decode", {})
    dec_tokens = float(dm.get("sequence_steps", 0)) * (1 + int(dm.get("draft_k", 0) or 0))
    for k, role, flops in ((SPAN_DECODE, "decode", dec_tokens * f_decode),
                           (SPAN_MIXED, "aggregated", dec_tokens * f_decode + in_tok * f_prefill)):
        m = kind == k
        kt_role = float(gpu_s[m].sum()) * kf.get(role, 1.0)
        if m.any() and kt_role > 0:
            u[m] = flops / (peak * kt_role)
    kfs = np.array([kf.get({SPAN_PREFILL: "prefill", SPAN_DECODE: "decode"}.get(int(k), "aggregated"), 1.0)
                    for k in kind]) if len(spans) else np.zeros(0)
    p_busy = busy_power_w(pw, u, kfs) if len(spans) else np.zeros(0)
    extra_j = gpu_s * (p_busy - pw.idle_w)

    workers: dict[str, dict] = {}
    for gid in n_gpus:
        workers[gid] = {"role": role_of[gid], "gpus": n_gpus[gid], "busy_s": 0.0, "energy_J": 0.0,
                        "_extra": 0.0}
    for w, d, e in zip(wid, dur, extra_j):
        workers[w]["busy_s"] += float(d)
        workers[w]["_extra"] += float(e)
    for gid, w in workers.items():
        w["energy_J"] = pw.idle_w * w["gpus"] * life[gid] + w.pop("_extra")
        w["mean_W_per_gpu"] = w["energy_J"] / (w["gpus"] * life[gid]) if life[gid] > 0 else None
        w["utilisation"] = w["busy_s"] / life[gid] if life[gid] > 0 else None

    gpu_j = sum(p.idle_w for p in powers) * T + float(extra_j.sum())
    node_w = rack_w = 0.0
    held = set(pool)
    for rack in topo.racks:
        mine = [g for g in rack.gpus if g in held]
        if mine:
            node_w += rack.node_overhead_w * len({topo.host_of(g) for g in mine})
            rack_w += rack.rack_overhead_w
    overhead_j = (node_w + rack_w) * T
    it_j = gpu_j + overhead_j
    fac_j = it_j * prices.pue
    kwh = fac_j / J_PER_KWH
    usd_gpu = prices.usd_per_gpu_hour * len(pool) * T / 3600.0
    usd_energy = kwh * prices.usd_per_kwh
    usd = usd_gpu + usd_energy

    def per(x: float, tok: float, scale: float = 1.0) -> float | None:
        return x / (tok / scale) if tok > 0 else None

    peak_w = sum(p.compute_bound_w for p in powers) + node_w + rack_w
    return {
        "rule": "whole pool for the whole simulated time",
        "pool_gpus": len(pool), "duration_s": T, "pue": prices.pue,
        "gpu_J": gpu_j, "overhead_J": overhead_j, "it_J": it_j, "facility_J": fac_j,
        "gpu_idle_J": sum(p.idle_w for p in powers) * T,
        "mean_kW": fac_j / T / 1e3 if T > 0 else None,
        "mean_it_kW": it_j / T / 1e3 if T > 0 else None,
        "peak_it_kW": peak_w / 1e3,
        "kWh_per_day": fac_j / T * 86400 / J_PER_KWH if T > 0 else None,
        "J_per_output_token": per(fac_j, out_tok),
        "J_per_token": per(fac_j, out_tok + in_tok),
        "output_tokens": out_tok, "input_tokens": in_tok, "good_output_tokens": good,
        "output_tokens_per_s_per_kW": out_tok / T / (fac_j / T / 1e3) if T > 0 and fac_j > 0 else None,
        "usd_per_gpu_hour": prices.usd_per_gpu_hour, "usd_per_kwh": prices.usd_per_kwh,
        "usd_gpu": usd_gpu, "usd_energy": usd_energy, "usd": usd,
        "usd_per_m_output": per(usd, out_tok, 1e6),
        "usd_per_m_good_output": per(usd, good, 1e6),
        "usd_per_m_tokens": per(usd, out_tok + in_tok, 1e6),
        "utilisation_by_role": {r: _role_u(u, kind, gpu_s, k) for r, k in (("prefill", SPAN_PREFILL),
                                                                             ("decode", SPAN_DECODE),
                                                                             ("aggregated", SPAN_MIXED))
                                if (kind == k).any()},
        "workers": workers,
    }


def _role_u(u, kind, gpu_s, k) -> float:
    m = kind == k
    w = gpu_s[m]
    return float((u[m] * w).sum() / w.sum()) if w.sum() > 0 else 0.0


def _good_output_tokens(a, done, metrics) -> float:
    """Output tokens of the done requests that met the run's SLO (TTFT and TPOT), as the goodput counts
    them."""
    g = metrics.get("goodput", {})
    tps = g.get("tokens_per_s")
    dur = metrics.get("throughput", {}).get("duration_s")
    if tps is not None and dur:
        return float(tps) * float(dur)
    return float(a["output_tokens"][done].sum())


def summary_line(e: dict | None) -> str:
    """One line of a run's summary: energy, J/token and $/M output tokens under the accounting rule."""
    if e is None:
        return "energy: not modelled (a GPU of the pool has no power figure)"
    jt = e["J_per_output_token"]
    usd = e["usd_per_m_output"]
    return (f"energy ({e['rule']}: {e['pool_gpus']} GPUs, {e['duration_s']:.1f} s, PUE {e['pue']:g}): "
            f"{e['mean_kW']:.1f} kW mean ({e['peak_it_kW']:.1f} kW IT peak), {e['kWh_per_day']:.0f} kWh/day, "
            + (f"{jt:.2f} J/output token" if jt is not None else "no output tokens")
            + (f"; ${usd:.3g}/M output tokens (GPU-hours ${e['usd_gpu']:.3g} + energy ${e['usd_energy']:.3g})"
               if usd is not None and e["usd"] > 0 else ""))
