"""``kind: serving_study`` scenarios: studies made of several serving simulations (scenarios (g)-(j)).

``run_serving_study(path, out_dir, console=...)`` validates the YAML (:data:`ServingStudy`, one-line errors naming
the file and field), runs every simulation it needs through :func:`sim.scenario.simulate_scenario`, prints a
table and the write-up's claim next to what the simulation shows, and writes ``<out_dir>/<name>.json`` and
``<out_dir>/<name>.png``. Nothing is fitted to the write-up.

Studies (the ``study`` field):

==================  ===============================================================================================
``decode_frontier`` (g) decode tokens/s per GPU against tokens/s per user for several decoder configurations
                    (hardware x DP-EP width), each simulated at several loads. A load is a *target mean batch per
                    decode rank* b: the arrival rate is set by Little's law from the step-time model,
                    ``rate = b * ep * u(b) / (output_mean - 1)`` with ``u(b) = E[tokens/step] / step_s(b)``, and
                    the prefillers (TP=4, kept apart) are provisioned to keep up, so that the decoders alone set
                    the numbers. Measured in a steady window after a warm-up (see :func:`decode_window`).
``cost_compare``    (h)+(i) the same load on different deployments, judged against the same SLO: latency
                    percentiles, the GPU split, energy (:mod:`sim.energy`) and the cost per million output tokens
                    at a given $/GPU-hour and $/kWh under one rule — every GPU of the pool for the whole run,
                    energy included — per million output tokens of the requests that met the SLO.
``fault_drill``     (j) a serving scenario with faults: request accounting (nothing lost), the time until decode
                    capacity is back and the backlog is drained, TTFT/TPOT before / during / after, the timeline.
==================  ===============================================================================================

Decoders wider than one NVLink domain (H200 EP16 over two nodes) are placed by ``sim.scenario.build`` only with
``decode.span_nodes``; the frontier builds them here (:func:`build_point`) by placing ``ep / domain`` domain-sized
decoders and merging them into one DP-EP group, whose step cost ``sim.costs.step.decode_step_time`` prices with
the all-to-all over the scale-out network (IB or EFA; DeepEP low-latency mode, ``sim.costs.moe_comm``).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    field_validator,
    model_validator,
)

from rackbed.topology.errors import UserError, from_validation
from rackbed.topology.outputs import replacing, safe_name, write_text

# ------------------------------------------------------------------------------------------------ schema


class _S(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class _Base(_S):
    kind: Literal["serving_study"]
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    title: str = ""
    claim: str = Field(min_length=1, description="the write-up's claim, printed beside the simulated result")
    seed: int = 0


class FrontierConfig(_S):
    """One decoder configuration of the frontier: hardware, format and DP-EP width.

    topology: a preset or file for one unit (a node or a rack); ``*N`` is appended when the point needs more
    units (prefillers are placed first, then the decoder).
    """

    label: str = Field(min_length=1)
    topology: str
    weight_format: str = "fp8_block"
    ep: int = Field(ge=1)
    batch_per_rank: tuple[Annotated[int, Field(ge=1)], ...] | None = None

    @field_validator("weight_format")
    @classmethod
    def _fmt(cls, v: str) -> str:
        from rackbed.engine.core.formats import FORMAT_NAMES

        if v not in FORMAT_NAMES:
            raise ValueError(f"unknown format {v!r}; one of {', '.join(FORMAT_NAMES)}")
        return v


def _frontier_mtp():
    from rackbed.sim.scenario import MtpSection

    return MtpSection


#: the study's ``mtp`` is a scenario's (``sim.scenario.MtpSection``: draft_k, accept_p, acceptance, draft)
FrontierMtp = _frontier_mtp()


class DecodeFrontierStudy(_Base):
    """(g): see the module docstring. Loads are target mean batches per decode rank."""

    study: Literal["decode_frontier"]
    model: str = "qwen3-235b-a22b"
    kv_dtype: Literal["bf16", "fp8"] = "bf16"
    #: the serving stack whose measured kernels price every config (one stack for all GPUs compared)
    stack: Literal["auto", "rackbed", "trtllm", "sglang", "vllm"] = "auto"
    prefill_tp: int = Field(4, ge=1)
    prefill_ep: int = Field(4, ge=1)
    prefill_headroom: float = Field(1.3, ge=1.0)
    mtp: FrontierMtp = FrontierMtp()
    prompt_tokens: int = Field(2000, ge=1)
    output_tokens: tuple[Annotated[int, Field(ge=2)], Annotated[int, Field(ge=2)]] = (300, 500)
    batch_per_rank: tuple[Annotated[int, Field(ge=1)], ...] = Field(min_length=1)
    batch_cap_factor: float = Field(2.0, ge=1.0, description="decode.max_batch_per_rank = ceil(factor * b)")
    configs: tuple[FrontierConfig, ...] = Field(min_length=1)
    compare_at_tokens_per_s_per_user: float = Field(gt=0)
    baseline: str | None = None
    warmup_lifetimes: float = Field(1.5, gt=0)
    window_lifetimes: float = Field(2.0, gt=0)
    min_window_s: float = Field(3.0, gt=0)
    max_units: int = Field(8, ge=1)

    @model_validator(mode="after")
    def _check(self):
        lo, hi = self.output_tokens
        if hi < lo:
            raise ValueError(f"output_tokens: hi must be >= lo, got {lo}, {hi}")
        labels = [c.label for c in self.configs]
        if len(set(labels)) != len(labels):
            raise ValueError(f"configs: duplicate label in {labels}")
        if self.baseline is not None and self.baseline not in labels:
            raise ValueError(f"baseline: {self.baseline!r} is not a config label ({', '.join(labels)})")
        return self


class CompareRun(_S):
    """One serving scenario of a cost comparison and the price of its GPUs."""

    label: str = Field(min_length=1)
    scenario: str = Field(min_length=1, description="a scenario file (relative to the study file) or shipped name")
    usd_per_gpu_hour: float = Field(gt=0)


class CostCompareStudy(_Base):
    study: Literal["cost_compare"]
    runs: tuple[CompareRun, ...] = Field(min_length=2)
    usd_per_kwh: float = Field(0.10, ge=0, description="energy price, every run")
    pue: float = Field(1.2, ge=1, description="facility power / IT power, every run")

    @model_validator(mode="after")
    def _labels(self):
        labels = [r.label for r in self.runs]
        if len(set(labels)) != len(labels):
            raise ValueError(f"runs: duplicate label in {labels}")
        return self


class FaultDrillStudy(_Base):
    study: Literal["fault_drill"]
    scenario: str = Field(min_length=1, description="a serving scenario with faults (file or shipped name)")
    drained_quantile: float = Field(0.95, gt=0, le=1, description="backlog level that counts as drained")


ServingStudy = Annotated[DecodeFrontierStudy | CostCompareStudy | FaultDrillStudy, Field(discriminator="study")]
_ADAPTER = TypeAdapter(ServingStudy)


def load_study(path: str | Path) -> Any:
    """Parse and validate a serving-study file; one-line UserError naming the file and the field."""
    from rackbed.topology.yamlio import load_yaml

    p = Path(path)
    data = load_yaml(p)
    try:
        return _ADAPTER.validate_python(data)
    except ValidationError as exc:
        raise from_validation(exc, p) from None


def resolve_ref(ref: str, base_dir: Path) -> Path:
    """A scenario referenced by a study: a path relative to the study file, else a path or shipped name."""
    from rackbed import scenarios

    cand = Path(base_dir) / ref
    if cand.is_file():
        return cand
    return scenarios.resolve(ref)


# ------------------------------------------------------------------------------------------------ helpers


def _arrays(res) -> dict[str, np.ndarray]:
    from rackbed.engine.core.metrics import request_arrays

    return request_arrays(res.rows, res.row_fields)


def _q(x: np.ndarray, q: float) -> float | None:
    x = x[~np.isnan(x)]
    return float(np.percentile(x, q)) if x.size else None


def _r(x: float | None, nd: int = 3) -> float | None:
    return None if x is None or not math.isfinite(x) else round(float(x), nd)


@dataclass
class StudyResult:
    """What a study computes: a table, claim/simulated pairs, a plot callback (figure -> None), a summary."""

    columns: list[str]
    rows: list[dict]
    claims: list[tuple[str, str]]
    plot: Any
    summary: dict
    extra: dict


# ------------------------------------------------------------------------------------------------ (g)


def decode_window(res, start_s: float, end_s: float) -> dict:
    """Decode throughput and speed in the steady window ``[start_s, end_s]`` of a run.

    Each completed request generates its ``output_tokens - 1`` decode tokens (the first token comes from the
    prefiller) between its admission into a decode batch (``decode_start_s``) and its end; they are counted at a
    uniform rate over that interval (per-token times are not recorded). Returns

    - ``tokens_per_s_per_gpu``: decode tokens generated in the window / (window length x decode GPUs);
    - ``tokens_per_s_per_user``: median decode speed ``(output_tokens - 1) / (end - decode_start)`` of requests
      admitted in the window;
    - ``mean_batch_per_rank``: sequence-seconds in the window / (window length x decode ranks).
    """
    a = _arrays(res)
    ok = (a["status"] == "done") & (a["output_tokens"] > 1)
    t0, t1 = a["decode_start_s"][ok], a["end_s"][ok]
    n = (a["output_tokens"][ok] - 1).astype(np.float64)
    life = np.maximum(t1 - t0, 1e-12)
    overlap = np.clip(np.minimum(t1, end_s) - np.maximum(t0, start_s), 0.0, None)
    span = end_s - start_s
    n_dec = sum(len(g.gpus) for g in res.deployment.decoders)
    speed = n / life
    adm = (t0 >= start_s) & (t0 < end_s)
    return {
        "tokens_per_s_per_gpu": float((n * overlap / life).sum() / (span * n_dec)),
        "tokens_per_s_per_user": float(np.median(speed[adm])) if adm.any() else None,
        "mean_batch_per_rank": float(overlap.sum() / (span * n_dec)),
        "requests_in_window": int(adm.sum()),
    }


def _frontier_scenario(st: DecodeFrontierStudy, cfg: FrontierConfig, topology: str, ep: int, replicas_d: int,
                       n_prefill: int, b: int, rate_per_s: float, duration_s: float):
    from rackbed.sim.scenario import parse_scenario

    lo, hi = st.output_tokens
    return parse_scenario({
        "kind": "serving", "name": f"{st.name}:{cfg.label}:b{b}", "seed": st.seed, "topology": topology,
        "model": st.model, "weight_format": cfg.weight_format, "kv_dtype": st.kv_dtype, "stack": st.stack,
        "prefill": {"tp": st.prefill_tp, "ep": st.prefill_ep, "replicas": n_prefill},
        "decode": {"ep": ep, "replicas": replicas_d, "max_batch_per_rank": max(1, math.ceil(st.batch_cap_factor * b))},
        "mtp": st.mtp.model_dump(exclude_none=True),
        "workload": {"kind": "synthetic", "arrival": {"kind": "poisson", "rate_per_s": rate_per_s},
                     "prompt": {"kind": "fixed", "tokens": st.prompt_tokens},
                     "output": {"kind": "uniform", "lo": lo, "hi": hi}, "duration_s": duration_s, "seed": st.seed},
        "sim": {"decision_log": False},
    }, source=f"{st.name}: config {cfg.label!r}")


def build_point(sc):
    """``sim.scenario.build`` for a frontier point, also for decoders wider than one NVLink domain.

    ``sc.decode.ep`` a multiple ``m`` of the domain size: ``m`` domain-wide decoders are placed and merged into
    one DP-EP group (memory budget and KV capacity from the merged plan, its all-to-all priced over the
    scale-out network). Returns ``sim.scenario.Built``.
    """
    from rackbed import topology as topo_mod
    from rackbed.engine.core.deployment import DecoderGroup, DecoderTemplate
    from rackbed.engine.core.sharding import ParallelPlan
    from rackbed.sim.scenario import ScenarioCostModel, build, draft_budget, draft_cost_kw

    topo = topo_mod.load(sc.topology)
    dom = len(topo.nvlink_domain(0))
    ep = sc.decode.ep
    if ep <= dom:
        return build(sc)
    if ep % dom:
        raise UserError(f"{sc.name}: decode.ep={ep} spans NVLink domains of {dom} GPUs; it must be a multiple of {dom}")
    m = ep // dom
    d = sc.decode
    part = sc.model_copy(update={"decode": d.model_copy(update={"ep": dom, "replicas": d.replicas * m})})
    b = build(part)
    dep = b.deployment
    merged_gpus = [tuple(g for grp in dep.decoders[i * m:(i + 1) * m] for g in grp.gpus) for i in range(d.replicas)]
    dplan = ParallelPlan(role="decode", tp=1, ep=ep, dp=ep, gpus=merged_gpus[0], weight_format=sc.weight_format,
                         kv_dtype=sc.kv_dtype, page_tokens=d.page_tokens, max_batch_seqs=d.max_batch_per_rank)
    dbud = draft_budget(sc, dplan.validate(b.model, topo), dplan, topo)
    dtpl = DecoderTemplate(ep=ep, max_batch_per_rank=d.max_batch_per_rank,
                           kv_capacity_tokens_per_rank=max(1, dbud.kv_capacity_tokens), kv_page_tokens=d.page_tokens)
    groups = tuple(DecoderGroup(id=f"D{i}", gpus=gs, rank_nics=tuple(dep.gpu_nic[g] for g in gs), template=dtpl)
                   for i, gs in enumerate(merged_gpus))
    dep = replace(dep, decoders=groups, decoder_template=dtpl)
    cm = ScenarioCostModel(model=b.model, topo=b.topology, prefill_plan=b.prefill_plan, decode_plan=dplan,
                           calib=b.calibration, draft=draft_cost_kw(sc))
    kinds = sorted({topo.nic_spec(topo.nic_of_gpu(g)).kind for g in merged_gpus[0]})
    cav = [*b.caveats, f"decoders span {m} NVLink domains; their dispatch/combine runs over {'/'.join(kinds)}"]
    return replace(b, scenario=sc, deployment=dep, decode_plan=dplan, decode_budget=dbud, cost_model=cm,
                   caveats=cav)


def _decoder_route(topo, gpus) -> str:
    if len({topo.nvlink_domain(g) for g in gpus}) == 1:
        return "NVLink"
    return "/".join(sorted({topo.nic_spec(topo.nic_of_gpu(g)).kind.upper() for g in gpus}))


def _step_model(built, b: int, ctx_tokens: float) -> tuple[float, float]:
    """(step seconds, expected tokens per step) of the decoder at ``b`` sequences per rank, with the built
    scenario's MTP (its draft_k, acceptance and draft)."""
    from rackbed.sim.costs.step import decode_step_time
    from rackbed.sim.scenario import draft_cost_kw

    plan = built.decode_plan
    n = plan.world
    mtp = built.scenario.mtp
    st = decode_step_time(built.model, plan, built.topology, [b] * n, [b * ctx_tokens] * n, draft_k=mtp.draft_k,
                          calib=built.calibration, **draft_cost_kw(built.scenario))
    return st.total_s, mtp.expected_tokens_per_step()


def _build_fitting(st: DecodeFrontierStudy, cfg: FrontierConfig, n_pf: int, b: int, rate: float, dur: float):
    """Build the point on the fewest units of ``cfg.topology`` (``NAME``, ``NAME*2``, ...) that hold ``n_pf``
    prefillers and the decoder."""
    last_err = None
    for units in range(1, st.max_units + 1):
        topo_name = cfg.topology if units == 1 else f"{cfg.topology}*{units}"
        sc = _frontier_scenario(st, cfg, topo_name, cfg.ep, 1, n_pf, b, rate, dur)
        try:
            return build_point(sc)
        except UserError as exc:
            if "deployment:" not in str(exc):
                raise
            last_err = exc
    raise UserError(f"{st.name}: config {cfg.label!r} at b={b}: {n_pf} prefillers + an EP{cfg.ep} decoder do not fit "
                    f"{st.max_units} units of {cfg.topology} ({last_err})")


def frontier_point(st: DecodeFrontierStudy, cfg: FrontierConfig, b: int, *, progress: bool = False) -> dict:
    """Plan, build and simulate one (config, target batch) point; returns its table row."""
    import time

    from rackbed.sim.driver import _prefill_capacity
    from rackbed.sim.scenario import simulate_scenario

    lo, hi = st.output_tokens
    out_mean = (lo + hi) / 2.0
    ctx = st.prompt_tokens + out_mean / 2.0
    # A first build (one prefiller) gives the step model and one prefiller's capacity.
    probe = _build_fitting(st, cfg, 1, b, 1.0, 1.0)
    step_s, e_tok = _step_model(probe, b, ctx)
    u_model = e_tok / step_s
    rate = b * cfg.ep * u_model / (out_mean - 1.0)
    cap = _prefill_capacity(probe.cost_model, probe.deployment.prefillers[0], st.prompt_tokens)
    n_pf = max(1, math.ceil(rate * st.prompt_tokens * st.prefill_headroom / cap))
    life_s = (hi - 1) / u_model
    warm = st.warmup_lifetimes * life_s
    dur = warm + max(st.window_lifetimes * life_s, st.min_window_s)
    built = _build_fitting(st, cfg, n_pf, b, rate, dur)
    t_wall = time.perf_counter()
    _, res = simulate_scenario(built.scenario, built=built, progress=progress)
    wall = time.perf_counter() - t_wall
    w = decode_window(res, warm, dur)
    m = res.metrics
    dgpus = built.deployment.decoders[0].gpus
    topo = built.topology
    return {
        "config": cfg.label, "ep": cfg.ep, "decoder_hosts": len({topo.host_of(g) for g in dgpus}),
        "route": _decoder_route(topo, dgpus), "topology": built.scenario.topology, "b_target": b,
        "rate_per_s": round(rate, 3), "prefillers": n_pf, "requests": m["requests"]["total"],
        "done": m["requests"]["done"],
        "b_measured": _r(w["mean_batch_per_rank"], 2),
        "tokens_per_s_per_user": _r(w["tokens_per_s_per_user"], 2),
        "tokens_per_s_per_gpu": _r(w["tokens_per_s_per_gpu"], 1),
        "tpot_p50_ms": _r((m["latency_s"]["tpot"]["p50"] or math.nan) * 1e3, 3),
        "itl_p50_ms": _r((m["latency_s"]["itl"]["p50"] or math.nan) * 1e3, 3),
        "model_tokens_per_s_per_user": _r(u_model, 2), "model_tokens_per_s_per_gpu": _r(b * u_model, 1),
        "window_s": [round(warm, 3), round(dur, 3)], "calibration": built.calibration_note,
        "wall_s": round(wall, 2),
    }


def interp_at_user_speed(points: list[dict], u_ref: float) -> float | None:
    """tokens/s per GPU at ``u_ref`` tokens/s per user, linear between the simulated points of one config
    (None when ``u_ref`` is outside their range)."""
    pts = sorted((p["tokens_per_s_per_user"], p["tokens_per_s_per_gpu"]) for p in points
                 if p["tokens_per_s_per_user"] is not None)
    if not pts or not pts[0][0] <= u_ref <= pts[-1][0]:
        return None
    us, gs = zip(*pts)
    return float(np.interp(u_ref, us, gs))


def dominates(a: list[dict], b: list[dict]) -> bool:
    """Every point of ``b`` is Pareto-dominated by some point of ``a`` (at least as fast per user and at least
    as much per GPU, one of them strictly)."""
    def key(p):
        return p["tokens_per_s_per_user"], p["tokens_per_s_per_gpu"]

    return all(any(key(p)[0] >= key(q)[0] and key(p)[1] >= key(q)[1] and key(p) != key(q) for p in a) for q in b)


def frontier_rows(st: DecodeFrontierStudy, *, progress: bool = False, console=None) -> list[dict]:
    rows = []
    for cfg in st.configs:
        for b in cfg.batch_per_rank or st.batch_per_rank:
            row = frontier_point(st, cfg, b, progress=progress)
            if console is not None:
                console.print(f"[dim]{cfg.label} b={b}: {row['tokens_per_s_per_user']} tok/s/user, "
                              f"{row['tokens_per_s_per_gpu']} tok/s/GPU ({row['requests']} requests, "
                              f"{row['wall_s']} s)[/dim]")
            rows.append(row)
    return rows


def frontier_result(st: DecodeFrontierStudy, rows: list[dict]) -> StudyResult:
    """Claims, summary and plot of the frontier from its rows."""
    u_ref = st.compare_at_tokens_per_s_per_user
    by = {c.label: [r for r in rows if r["config"] == c.label] for c in st.configs}
    at = {k: interp_at_user_speed(v, u_ref) for k, v in by.items()}
    umax = {k: max((p["tokens_per_s_per_user"] or 0.0) for p in v) for k, v in by.items()}
    gmax = {k: max((p["tokens_per_s_per_gpu"] or 0.0) for p in v) for k, v in by.items()}
    base = st.baseline or st.configs[0].label
    parts = []
    for k, pts in by.items():
        if at[k] is None:
            umin = min(p["tokens_per_s_per_user"] or 0.0 for p in pts)
            side = "slower than that at every simulated load" if umax[k] < u_ref else \
                "faster than that at every simulated load"
            parts.append(f"{k}: {side} ({umin:.0f}-{umax[k]:.0f} tok/s/user)")
        else:
            ratio = f" (x{at[k] / at[base]:.2f} {base})" if at.get(base) and k != base else ""
            parts.append(f"{k}: {at[k]:,.0f} tok/s/GPU{ratio}")
    dom = {f"{a} > {b}": dominates(by[a], by[b]) for a in by for b in by if a != b and dominates(by[a], by[b])}
    sim = (f"at {u_ref:g} tokens/s per user — " + "; ".join(parts) + ". Pareto: "
           + (", ".join(dom) if dom else "no config dominates another over all its points"))
    best = max(by, key=lambda k: gmax[k])
    claims = [(st.claim, sim),
              ("peak decode throughput over the simulated loads (tokens/s per GPU)",
               ", ".join(f"{k} {gmax[k]:,.0f} (at {min(by[k], key=lambda p: -(p['tokens_per_s_per_gpu'] or 0))['tokens_per_s_per_user']:.0f} tok/s/user)"
                         for k in by) + f"; highest: {best}"),
              ("model check: simulated points vs the step-time model at the target batch",
               "; ".join(f"{r['config']} b={r['b_target']}: {r['tokens_per_s_per_gpu']:.0f} vs "
                         f"{r['model_tokens_per_s_per_gpu']:.0f} tok/s/GPU" for r in rows
                         if r["b_target"] == max(p["b_target"] for p in by[r["config"]])))]
    summary = {"compare_at_tokens_per_s_per_user": u_ref, "tokens_per_s_per_gpu_at_user_speed": at,
               "max_tokens_per_s_per_user": umax, "max_tokens_per_s_per_gpu": gmax, "dominates": sorted(dom),
               "baseline": base}

    def plot(fig):
        ax = fig.add_subplot(1, 1, 1)
        for i, (k, pts) in enumerate(by.items()):
            cfg = next(c for c in st.configs if c.label == k)
            pts = sorted(pts, key=lambda p: p["b_target"])
            net = pts[0]["route"] != "NVLink"
            line, = ax.plot([p["tokens_per_s_per_user"] for p in pts], [p["tokens_per_s_per_gpu"] for p in pts],
                            marker="o", ms=4, ls="--" if net else "-", color=f"C{i}",
                            label=f"{k} ({pts[0]['route']}, {cfg.weight_format})")
            ax.plot([p["model_tokens_per_s_per_user"] for p in pts],
                    [p["model_tokens_per_s_per_gpu"] for p in pts], ls=":", lw=0.8, color=line.get_color())
            for p in pts:
                ax.annotate(f"b={p['b_target']}", (p["tokens_per_s_per_user"], p["tokens_per_s_per_gpu"]),
                            fontsize=5, alpha=0.7, xytext=(2, 2), textcoords="offset points")
        ax.axvline(u_ref, color="grey", lw=0.8, ls=":")
        ax.set_xlabel("decode tokens/s per user (median, steady window)")
        ax.set_ylabel("decode tokens/s per GPU")
        ax.set_yscale("log")
        ax.legend(fontsize=7, title="simulated (dotted: step-time model)", title_fontsize=7)

    cols = ["config", "route", "b_target", "rate_per_s", "prefillers", "requests", "b_measured",
            "tokens_per_s_per_user", "tokens_per_s_per_gpu", "tpot_p50_ms", "itl_p50_ms",
            "model_tokens_per_s_per_gpu", "wall_s"]
    return StudyResult(cols, rows, claims, plot, summary, {})


# ------------------------------------------------------------------------------------------------ (h) + (i)


def cost_row(label: str, usd_per_gpu_hour: float, built, res, *, usd_per_kwh: float = 0.10,
             pue: float = 1.2) -> dict:
    """Latency, GPU split, energy and cost per million output tokens of one run (see the module docstring): the
    whole pool for the whole run (:func:`sim.energy.energy_report`)."""
    from rackbed.sim.energy import EnergyPrices, energy_report

    m = res.metrics
    dur = m["throughput"]["duration_s"]
    gs = m["gpu_seconds"]
    lat = m["latency_s"]
    e = energy_report(built, res, EnergyPrices(usd_per_gpu_hour, usd_per_kwh, pue))
    if e is None:
        raise UserError(f"{label}: a GPU of {built.scenario.topology} has no power figure; cost needs energy")
    return {
        "run": label, "topology": built.scenario.topology, "weight_format": built.scenario.weight_format,
        "pool_gpus": e["pool_gpus"], "duration_s": _r(dur, 2), "done": m["requests"]["done"],
        "total": m["requests"]["total"], "rejected": m["requests"]["rejected"],
        "ttft_p50_s": _r(lat["ttft"]["p50"]), "ttft_p90_s": _r(lat["ttft"]["p90"]), "ttft_p99_s": _r(lat["ttft"]["p99"]),
        "tpot_p50_ms": _r((lat["tpot"]["p50"] or math.nan) * 1e3, 2),
        "tpot_p90_ms": _r((lat["tpot"]["p90"] or math.nan) * 1e3, 2),
        "tpot_p99_ms": _r((lat["tpot"]["p99"] or math.nan) * 1e3, 2),
        "slo_ttft_s": m["goodput"]["slo_ttft_s"], "slo_tpot_s": m["goodput"]["slo_tpot_s"],
        "goodput_fraction": _r(m["goodput"]["fraction"]),
        "mean_prefill_gpus": _r(gs["prefill"] / dur, 2), "mean_decode_gpus": _r(gs["decode"] / dur, 2),
        "output_tokens_per_s": _r(m["throughput"]["output_tokens_per_s"], 1),
        "usd_per_gpu_hour": usd_per_gpu_hour, "usd_per_kwh": usd_per_kwh, "pue": pue,
        "mean_kW": _r(e["mean_kW"], 2), "kWh_per_day": _r(e["kWh_per_day"], 1),
        "J_per_output_token": _r(e["J_per_output_token"], 2),
        "output_tokens_per_s_per_kW": _r(e["output_tokens_per_s_per_kW"], 2),
        "usd_gpu": _r(e["usd_gpu"], 4), "usd_energy": _r(e["usd_energy"], 4),
        "usd_per_m_output": _r(e["usd_per_m_output"], 3),
        "usd_per_m_good_output": _r(e["usd_per_m_good_output"], 3),
    }


def cost_compare_result(st: CostCompareStudy, runs: list[tuple]) -> StudyResult:
    """``runs``: ``(CompareRun, Built, SimResult)`` per run, in the study's order. The runs must share one SLO
    (TTFT and TPOT bounds): the answer is the cost per million output tokens that met it."""
    rows = [cost_row(r.label, r.usd_per_gpu_hour, b, res, usd_per_kwh=st.usd_per_kwh, pue=st.pue)
            for r, b, res in runs]
    slos = {(r["slo_ttft_s"], r["slo_tpot_s"]) for r in rows}
    if len(slos) != 1 or None in next(iter(slos)):
        got = ", ".join(f"{r['run']}: {r['slo_ttft_s']} s / {r['slo_tpot_s']} s" for r in rows)
        raise UserError(f"{st.name}: runs: a cost comparison needs every run to state the same slo "
                        f"(ttft_s and tpot_s); got {got}")
    for r in rows:
        if r["usd_per_m_good_output"] is None:
            raise UserError(f"{st.name}: run {r['run']}: no request met the SLO, so no cost per good token")
    ttft, tpot = next(iter(slos))
    parts = []
    for r in rows:
        parts.append(f"{r['run']}: ${r['usd_per_m_good_output']:.2f} per million output tokens within the "
                     f"SLO (${r['usd_per_gpu_hour']:g}/GPU-hour x {r['pool_gpus']} GPUs + {r['mean_kW']:.0f} kW "
                     f"at ${r['usd_per_kwh']:g}/kWh), {r['J_per_output_token']:.0f} J/output token, goodput "
                     f"{r['goodput_fraction']:.0%}, TPOT p50 {r['tpot_p50_ms']:.1f} ms")
    best = min(rows, key=lambda r: r["usd_per_m_good_output"])
    other = [r for r in rows if r is not best]
    verdict = (f"at the same SLO (TTFT <= {ttft:g} s, TPOT <= {tpot * 1e3:g} ms), counting the whole pool for "
               f"the whole run with energy (PUE {st.pue:g}), {best['run']} is the cheaper: "
               + ", ".join(f"x{r['usd_per_m_good_output'] / best['usd_per_m_good_output']:.2f} for {r['run']}"
                           for r in other))
    claims = [(st.claim, verdict + "; " + "; ".join(parts))]
    keys = ("usd_per_m_good_output", "usd_per_m_output", "J_per_output_token", "mean_kW", "ttft_p50_s",
            "tpot_p50_ms", "mean_prefill_gpus", "mean_decode_gpus", "goodput_fraction", "done", "total")
    summary = {r["run"]: {k: r[k] for k in keys} for r in rows}
    summary["answer"] = {"cheaper": best["run"],
                         "rule": "whole pool, whole run, energy included, output tokens within the SLO",
                         "slo_ttft_s": ttft, "slo_tpot_s": tpot,
                         "usd_per_m_good_output": {r["run"]: r["usd_per_m_good_output"] for r in rows}}
    timelines = {r.label: {"t_s": [s.t_s for s in res.samples],
                           "prefill": [s.gpus_prefill for s in res.samples],
                           "decode": [s.gpus_decode for s in res.samples]} for r, _b, res in runs}

    def plot(fig):
        ax1, ax2 = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1, 2]})
        x = np.arange(len(rows))
        gpu = [r["usd_per_m_good_output"] - _energy_share(r) for r in rows]
        en = [_energy_share(r) for r in rows]
        ax1.bar(x, gpu, 0.5, label="GPU-hours")
        ax1.bar(x, en, 0.5, bottom=gpu, label="energy")
        ax1.set_xticks(x, [r["run"] for r in rows], fontsize=7)
        ax1.set_ylabel("$ per million output tokens within the SLO\n(whole pool, whole run)")
        ax1.legend(fontsize=7)
        for i, (k, tl) in enumerate(timelines.items()):
            ax2.step(tl["t_s"], tl["prefill"], where="post", color=f"C{i}", label=f"{k} prefill")
            ax2.step(tl["t_s"], tl["decode"], where="post", color=f"C{i}", ls="--", label=f"{k} decode")
        ax2.set_xlabel("time (s)")
        ax2.set_ylabel("GPUs serving")
        ax2.legend(fontsize=7)

    cols = ["run", "pool_gpus", "done", "ttft_p50_s", "ttft_p99_s", "tpot_p50_ms", "tpot_p99_ms",
            "goodput_fraction", "mean_prefill_gpus", "mean_decode_gpus", "mean_kW", "J_per_output_token",
            "usd_per_gpu_hour", "usd_per_m_output", "usd_per_m_good_output"]  # the JSON rows hold every field
    return StudyResult(cols, rows, claims, plot, summary, {"timelines": timelines})


def _energy_share(r: dict) -> float:
    """The energy part of a row's $ per million good output tokens."""
    tot = r["usd_gpu"] + r["usd_energy"]
    return r["usd_per_m_good_output"] * r["usd_energy"] / tot if tot > 0 else 0.0


# ------------------------------------------------------------------------------------------------ (j)


def fault_drill_report(sc, res, drained_quantile: float = 0.95) -> dict:
    """Recovery and accounting of a run with faults (times in seconds).

    - ``lost`` = total - done - rejected (the scheduler resolves every request; this checks it);
    - ``decode_restored_s``: first timeline sample after the fault whose serving decode GPUs are back to the
      level just before it (None if never);
    - ``drained_s``: first sample from then on whose decode-side backlog (requests with KV in flight or queued
      for decode) is at most the ``drained_quantile`` of that backlog before the fault;
    - phases by arrival: *before* (done before the fault), *disrupted* (in the system at the fault or arriving
      before the backlog drained), *after* (arriving after it): counts and TTFT / TPOT percentiles.
    """
    if not sc.faults:
        raise UserError(f"{sc.name}: fault_drill needs a scenario with faults")
    f0 = min(sc.faults, key=lambda f: f.at_s)
    t_f = f0.at_s
    m = res.metrics
    rq = m["requests"]
    s = res.samples
    t = np.array([x.t_s for x in s])
    dec = np.array([x.gpus_decode for x in s])
    backlog = np.array([x.kv + x.queued_decode for x in s])
    pre = t < t_f
    level = int(dec[pre][-1]) if pre.any() else int(dec[0])
    post = np.nonzero((t >= t_f) & (dec >= level))[0]
    restored = float(t[post[0]]) if post.size else None
    drained = None
    if restored is not None:
        thr = float(np.quantile(backlog[pre], drained_quantile)) if pre.any() else 0.0
        idx = np.nonzero((t >= restored) & (backlog <= thr))[0]
        drained = float(t[idx[0]]) if idx.size else None
    a = _arrays(res)
    done = a["status"] == "done"
    arr, end = a["arrival_s"], a["end_s"]
    ttft = a["first_token_s"] - arr
    multi = done & (a["output_tokens"] > 1)
    tpot = np.full(len(arr), np.nan)
    tpot[multi] = (end[multi] - a["first_token_s"][multi]) / (a["output_tokens"][multi] - 1)
    t_after = drained if drained is not None else math.inf
    phases = {
        "before": done & (end < t_f),
        "disrupted": ~(done & (end < t_f)) & (arr < t_after),
        "after": arr >= t_after,
    }
    ph = {}
    for k, sel in phases.items():
        ph[k] = {"requests": int(sel.sum()), "done": int((sel & done).sum()),
                 "requeued": int((sel & (a["requeues"] > 0)).sum()),
                 "ttft_p50_s": _r(_q(ttft[sel & done], 50)), "ttft_p90_s": _r(_q(ttft[sel & done], 90)),
                 "tpot_p50_ms": _r((_q(tpot[sel], 50) or math.nan) * 1e3, 3),
                 "tpot_p90_ms": _r((_q(tpot[sel], 90) or math.nan) * 1e3, 3)}
    dead = [g for g in res.groups if g[5] == "dead"]
    return {
        "fault": {"at_s": t_f, "target": f0.target, "duration_s": f0.duration_s},
        "dead_groups": [{"id": g[0], "role": g[1], "gpus": g[2], "ended_s": _r(g[4])} for g in dead],
        "requests": {"total": rq["total"], "done": rq["done"], "rejected": rq["rejected"],
                     "rejected_by_reason": rq["rejected_by_reason"], "requeued": rq["requeued"],
                     "lost": rq["total"] - rq["done"] - rq["rejected"]},
        "decode_gpus_before": level, "decode_restored_s": restored,
        "recovery_s": _r(restored - t_f) if restored is not None else None,
        "drained_s": drained, "drain_s": _r(drained - t_f) if drained is not None else None,
        "phases": ph,
    }


def fault_drill_result(st: FaultDrillStudy, sc, res) -> StudyResult:
    rep = fault_drill_report(sc, res, st.drained_quantile)
    f, rq, ph = rep["fault"], rep["requests"], rep["phases"]
    dead = ", ".join(f"{g['id']} ({g['role']}, {g['gpus']} GPUs)" for g in rep["dead_groups"]) or "no group"
    rec = (f"decode capacity back to {rep['decode_gpus_before']} GPUs at t={rep['decode_restored_s']:.0f} s "
           f"(+{rep['recovery_s']:.0f} s)" if rep["decode_restored_s"] is not None else "decode capacity NOT restored")
    dr = f", backlog drained at t={rep['drained_s']:.0f} s (+{rep['drain_s']:.0f} s)" if rep["drained_s"] else ""
    sim = (f"{f['target']} failed at t={f['at_s']:g} s, killing {dead}; {rq['requeued']} requests requeued "
           f"(re-prefilled); {rec}{dr}; {rq['done']}/{rq['total']} done, {rq['rejected']} rejected "
           f"{rq['rejected_by_reason'] or ''}, {rq['lost']} lost")
    tp = "; ".join(f"{k} ({v['requests']} req): TPOT p50 {v['tpot_p50_ms']} ms / p90 {v['tpot_p90_ms']} ms, "
                   f"TTFT p50 {v['ttft_p50_s']} s" for k, v in ph.items())
    claims = [(st.claim, sim), ("TPOT and TTFT before / during / after the recovery", tp)]
    rows = [{"phase": k, **v} for k, v in ph.items()]
    a = _arrays(res)
    done = (a["status"] == "done") & (a["output_tokens"] > 1)
    arr = a["arrival_s"][done]
    tpot_ms = (a["end_s"][done] - a["first_token_s"][done]) / (a["output_tokens"][done] - 1) * 1e3
    requeued = a["requeues"][done] > 0
    samples = res.samples

    def plot(fig):
        ax1, ax2 = fig.subplots(2, 1, sharex=True)
        t = [x.t_s for x in samples]
        for fld, lab in (("gpus_prefill", "prefill"), ("gpus_decode", "decode"), ("gpus_starting", "starting")):
            ax1.step(t, [getattr(x, fld) for x in samples], where="post", label=lab)
        ax1.set_ylabel("GPUs")
        top = max(max(x.gpus_prefill, x.gpus_decode, x.gpus_starting) for x in samples) if samples else 1
        ax1.set_ylim(-1, 1.5 * top)  # room for the legend above the lines
        ax2.scatter(arr[~requeued], tpot_ms[~requeued], s=2, alpha=0.4, label="requests")
        ax2.scatter(arr[requeued], tpot_ms[requeued], s=8, color="C3", label="requeued after the fault")
        ax2.set_yscale("log")
        ax2.set_ylabel("TPOT (ms)")
        ax2.set_xlabel("arrival time (s)")
        ax2.legend(fontsize=7, loc="upper right")
        for ax in (ax1, ax2):
            ax.axvline(f["at_s"], color="C3", lw=1, ls="--", label=f"{f['target']} fails")
            if rep["decode_restored_s"] is not None:
                ax.axvline(rep["decode_restored_s"], color="C2", lw=1, ls=":", label="decode capacity back")
            if rep["drained_s"] is not None:
                ax.axvline(rep["drained_s"], color="grey", lw=1, ls=":", label="backlog drained")
            ax.grid(True, lw=0.3, alpha=0.5)
        ax1.legend(fontsize=7, loc="upper right", ncol=2)

    cols = ["phase", "requests", "done", "requeued", "ttft_p50_s", "ttft_p90_s", "tpot_p50_ms", "tpot_p90_ms"]
    summary = {k: v for k, v in rep.items() if k != "phases"} | {"phases": ph}
    timeline = {"t_s": [x.t_s for x in samples], "gpus_prefill": [x.gpus_prefill for x in samples],
                "gpus_decode": [x.gpus_decode for x in samples], "gpus_starting": [x.gpus_starting for x in samples],
                "decode_backlog": [x.kv + x.queued_decode for x in samples]}
    return StudyResult(cols, rows, claims, plot, summary, {"timeline": timeline})


# ------------------------------------------------------------------------------------------------ runner


def compute_study(st, base_dir: Path, *, progress: bool = False, console=None) -> StudyResult:
    """Run the simulations of a validated study and compute its result (no files written)."""
    from rackbed.sim.scenario import load_scenario, simulate_scenario

    if isinstance(st, DecodeFrontierStudy):
        return frontier_result(st, frontier_rows(st, progress=progress, console=console))
    if isinstance(st, CostCompareStudy):
        runs = []
        for r in st.runs:
            sc = load_scenario(resolve_ref(r.scenario, base_dir))
            b, res = simulate_scenario(sc, progress=progress)
            runs.append((r, b, res))
        return cost_compare_result(st, runs)
    sc = load_scenario(resolve_ref(st.scenario, base_dir))
    _, res = simulate_scenario(sc, progress=progress)
    return fault_drill_result(st, sc, res)


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:,.3f}" if abs(v) < 1000 else f"{v:,.1f}"
    return "—" if v is None else str(v)


def write_study(st, res: StudyResult, path: Path, out_dir: Path, console) -> dict:
    """Print the table and the claim-vs-simulation lines; write ``<name>.json`` and ``<name>.png``."""
    from rich.table import Table

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    table = Table(title=st.title or st.name)
    for c in res.columns:
        table.add_column(c, justify="left" if c in ("config", "route", "run", "topology", "phase") else "right")
    for r in res.rows:
        table.add_row(*(_fmt(r.get(c)) for c in res.columns))
    console.print(table)
    for claim, sim in res.claims:
        console.print(f"[bold]write-up:[/bold] {claim}")
        console.print(f"[bold]simulated:[/bold] {sim}")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    png = out_dir / f"{safe_name(st.name)}.png"
    fig = plt.figure(figsize=(9, 5.5), dpi=110)
    res.plot(fig)
    fig.suptitle(st.title or st.name, fontsize=9)
    for ax in fig.axes:
        ax.grid(True, which="both", lw=0.3, alpha=0.5)
    fig.tight_layout()
    with replacing(png, "wb") as f:
        fig.savefig(f, format="png", metadata={"Software": None})
    plt.close(fig)

    doc = {"name": st.name, "study": st.study, "title": st.title, "scenario": str(path),
           "study_config": json.loads(st.model_dump_json()), "columns": res.columns, "rows": res.rows,
           "claims": [{"write_up": c, "simulated": s} for c, s in res.claims], "summary": res.summary, **res.extra}
    js = write_text(out_dir / f"{safe_name(st.name)}.json", json.dumps(_clean(doc), indent=1) + "\n")
    console.print(f"wrote {js} and {png}")
    return {**doc, "json": str(js), "png": str(png)}


def _clean(o):
    if isinstance(o, dict):
        return {str(k): _clean(v) for k, v in o.items()}
    if isinstance(o, (list, tuple)):
        return [_clean(v) for v in o]
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (float, np.floating)):
        return float(o) if math.isfinite(o) else None
    return o


def run_serving_study(path: Path, out_dir: Path, *, console=None, progress: bool = False) -> dict:
    """``rackbed run`` for a ``kind: serving_study`` file. Returns the JSON document (plus the two paths)."""
    from rich.console import Console

    console = console or Console()
    path = Path(path)
    st = load_study(path)
    res = compute_study(st, path.parent, progress=progress, console=console)
    return write_study(st, res, path, out_dir, console)
