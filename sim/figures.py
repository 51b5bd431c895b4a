"""``kind: figure`` scenarios: the write-up's kernel figures, recomputed from the cost models.

``run_figure(path, out_dir, console=...)`` validates the YAML (:data:`FigureScenario`, one-line errors naming the
file and field), computes a table from ``sim.costs``, prints it, writes ``<out_dir>/<name>.json`` and
``<out_dir>/<name>.png`` (matplotlib Agg), and prints the write-up's claim next to what the simulation shows,
then the verdict against the criterion the scenario states (``verdict``: :mod:`sim.verdicts`), ``reproduced`` or
``not reproduced`` with every check, also written to the JSON. Nothing is fitted to the write-up or to the
criterion.

Figure types (the ``figure`` field):

==================  ===============================================================================================
``allreduce_nvls``  TP all-reduce of ``tokens x hidden`` at ``elem_bytes``: best NVLink algorithm vs NVLS per
                    topology, a size sweep, and the end-to-end prefill effect (step model with / without NVLS).
``ep_prefill_comm`` EP prefill dispatch + combine (local + all-reduce) for each EP degree and topology.
``decode_a2a``      DP-EP decode dispatch / combine latency vs tokens per rank for each EP degree.
``grouped_gemm``    routed-expert grouped GEMM (gate_up + down) per rank vs EP and format, every expert activated
                    by ``tokens_per_expert`` tokens.
``prefill_parallelism``  prefill step breakdown of TP/EP configurations for a batch of prompts; latency and
                    tokens/s per GPU.
``decode_ep_trade`` EP_a -> EP_b decode: dispatch/combine added vs grouped GEMM removed per MoE layer, and the
                    whole decode step (draft + verify) per configuration.
``decode_step``     where a decode step's time goes for a serving scenario's decoders at several DP-EP degrees
                    (redundant experts where the EP needs them; compute / communication overlap where a config
                    sets one, with the seconds it hid): attention, MoE GEMM, dispatch/combine,
                    all-reduce, other, and tokens/s per GPU and per user — priced by the scenario's own cost model
                    (its stack's calibration, as ``rackbed run`` prices it), at a fixed batch per rank and context.
``decode_frontier`` the same decode steps swept over the batch per rank: tokens/s per GPU vs per user
                    for each scenario (a panel), expert-load case (uniform, skewed, skewed + EPLB with
                    redundant slots), EP degree and overlap, the best overlap per point, and at each
                    tokens/s-per-user SLO the EP that gives the most tokens/s per GPU (``slo`` in the JSON).
==================  ===============================================================================================
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    model_serializer,
    model_validator,
)

from rackbed.sim.scenario import EplbSection, ExpertLoadSection
from rackbed.sim.verdicts import Verdict, figure_measures, judge
from rackbed.topology.errors import UserError, from_validation
from rackbed.topology.outputs import replacing, safe_name, write_text

# ------------------------------------------------------------------------------------------------ schema


class _F(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Hardware(_F):
    """One hardware column of a figure: a topology (preset or file) and the weight format deployed on it."""

    topology: str
    weight_format: str = "bf16"
    label: str | None = None

    @property
    def name(self) -> str:
        return self.label or self.topology


class _Base(_F):
    kind: Literal["figure"]
    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$")
    title: str = ""
    claim: str = Field(min_length=1, description="the write-up's claim, printed beside the simulated result")
    #: the claim made precise (:mod:`sim.verdicts`): the figure prints ``reproduced`` or ``not reproduced``
    verdict: Verdict | None = None
    model: str = "qwen3-235b-a22b"


class AllreduceFigure(_Base):
    figure: Literal["allreduce_nvls"]
    hardware: tuple[Hardware, ...] = Field(min_length=1)
    tp: int = Field(ge=2)
    tokens: int = Field(ge=1)
    elem_bytes: int = Field(2, ge=1)
    sweep_min_bytes: int = Field(16 * 1024, ge=1)
    sweep_max_bytes: int = Field(256 * 1024 * 1024, ge=1)

    @model_validator(mode="after")
    def _sweep(self):
        if self.sweep_max_bytes < self.sweep_min_bytes:
            raise ValueError("sweep_max_bytes must be >= sweep_min_bytes")
        return self


class EpPrefillFigure(_Base):
    figure: Literal["ep_prefill_comm"]
    hardware: tuple[Hardware, ...] = Field(min_length=1)
    eps: tuple[Annotated[int, Field(ge=1)], ...] = Field(min_length=1)
    tokens: int = Field(ge=1)


class DecodeA2aFigure(_Base):
    figure: Literal["decode_a2a"]
    hardware: tuple[Hardware, ...] = Field(min_length=1)
    eps: tuple[Annotated[int, Field(ge=2)], ...] = Field(min_length=1)
    tokens_per_rank: tuple[Annotated[int, Field(ge=1)], ...] = Field(min_length=1)


class GroupedGemmFigure(_Base):
    figure: Literal["grouped_gemm"]
    hardware: tuple[Hardware, ...] = Field(min_length=1)
    eps: tuple[Annotated[int, Field(ge=1)], ...] = Field(min_length=1)
    formats: tuple[str, ...] = Field(min_length=1)
    tokens_per_expert: int = Field(1, ge=1)


class ParallelConfig(_F):
    tp: int = Field(ge=1)
    ep: int = Field(ge=1)
    label: str | None = None


class PrefillParallelismFigure(_Base):
    figure: Literal["prefill_parallelism"]
    hardware: tuple[Hardware, ...] = Field(min_length=1)
    configs: tuple[ParallelConfig, ...] = Field(min_length=2)
    prompt_tokens: int = Field(ge=1)
    n_prompts: int = Field(1, ge=1)


class DecodeEpTradeFigure(_Base):
    figure: Literal["decode_ep_trade"]
    hardware: Hardware
    eps: tuple[Annotated[int, Field(ge=2)], Annotated[int, Field(ge=2)]]
    tokens_per_rank: tuple[Annotated[int, Field(ge=1)], ...] = Field(min_length=1)
    step_batch_per_rank: int = Field(32, ge=1)
    step_context_tokens: int = Field(4000, ge=1)
    draft_k: int = Field(1, ge=0)


class DecodeConfig(_F):
    """One decoder shape of a ``decode_step`` figure: ``ep`` GPUs, attention TP ``tp`` inside a DP rank,
    ``redundant_experts`` (None: the fewest that make ``ep`` divide the expert slots), ``overlap`` (None: the
    scenario's ``decode.overlap``; :mod:`sim.costs.overlap`) and the scenario's ``decode.expert_load`` /
    ``decode.eplb`` sections (None: the scenario's own)."""

    ep: int = Field(ge=1)
    tp: int = Field(1, ge=1)
    redundant_experts: int | None = Field(None, ge=0)
    expert_load: ExpertLoadSection | None = None
    eplb: EplbSection | None = None
    label: str | None = None
    overlap: Literal["none", "shared_expert", "two_batch"] | None = None

    @model_serializer(mode="wrap")
    def _dump(self, handler):
        out = handler(self)
        if self.overlap is None:  # figures that do not set it dump as they did before it existed
            out.pop("overlap", None)
        return out


class DecodeStepFigure(_Base):
    """``scenario``: a serving scenario (a path relative to this file, a path, or a shipped name) whose model,
    topology, formats, stack, calibration (unless ``calibration`` replaces it) and MTP price the steps; ``model``
    is not used."""

    figure: Literal["decode_step"]
    scenario: str
    calibration: str | None = None
    configs: tuple[DecodeConfig, ...] = Field(min_length=1)
    batch_per_rank: tuple[Annotated[int, Field(ge=1)], ...] = Field((64,), min_length=1)
    context_tokens: int = Field(4000, ge=1)
    draft_k: int | None = Field(None, ge=0)  # None: the scenario's mtp.draft_k


class FrontierCase(_F):
    """An expert-load case of a ``decode_frontier`` figure: the scenario's ``decode.expert_load`` /
    ``decode.eplb`` sections (None: uniform routing, static placement) and ``extra_slots_per_rank`` redundant
    slots per GPU beyond the fewest that make the EP divide the expert slots (the search's
    ``space.decode_extra_slots_per_rank``)."""

    label: str = Field(min_length=1)
    expert_load: ExpertLoadSection | None = None
    eplb: EplbSection | None = None
    extra_slots_per_rank: int = Field(0, ge=0)


class FrontierPanel(_F):
    """A serving scenario whose decoders a ``decode_frontier`` figure reshapes (a plot panel per scenario)."""

    scenario: str
    label: str | None = None


class DecodeFrontierFigure(_Base):
    """Decode steps of each panel's scenario (priced as ``decode_step`` prices them) for every case x EP x
    overlap x batch per rank; ``slo_tokens_per_s_per_user``: the tokens/s-per-user targets the ``slo`` table
    reads the curves at. ``model`` is not used."""

    figure: Literal["decode_frontier"]
    panels: tuple[FrontierPanel, ...] = Field(min_length=1)
    calibration: str | None = None
    eps: tuple[Annotated[int, Field(ge=1)], ...] = Field(min_length=1)
    cases: tuple[FrontierCase, ...] = Field(min_length=1)
    overlaps: tuple[Literal["none", "shared_expert", "two_batch"], ...] = Field(("none",), min_length=1)
    batch_per_rank: tuple[Annotated[int, Field(ge=1)], ...] = Field(min_length=2)
    context_tokens: int = Field(4000, ge=1)
    draft_k: int | None = Field(None, ge=0)
    slo_tokens_per_s_per_user: tuple[Annotated[float, Field(gt=0)], ...] = ()

    @model_validator(mode="after")
    def _distinct(self):
        for field, vals in (("eps", self.eps), ("cases", [c.label for c in self.cases]),
                            ("overlaps", self.overlaps), ("batch_per_rank", self.batch_per_rank)):
            if len(set(vals)) != len(vals):
                raise ValueError(f"{field}: each value once")
        return self


FigureScenario = Annotated[
    AllreduceFigure | EpPrefillFigure | DecodeA2aFigure | GroupedGemmFigure | PrefillParallelismFigure
    | DecodeEpTradeFigure | DecodeStepFigure | DecodeFrontierFigure,
    Field(discriminator="figure"),
]
_ADAPTER = TypeAdapter(FigureScenario)


def load_figure(path: str | Path) -> Any:
    """Parse and validate a figure scenario file; one-line UserError naming the file and the field."""
    import yaml

    p = Path(path)
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f":{mark.line + 1}" if mark is not None else ""
        raise UserError(f"{p}{where}: {getattr(exc, 'problem', None) or 'not valid YAML'}") from None
    if not isinstance(data, dict):
        raise UserError(f"{p}: expected a mapping at the top level")
    try:
        sc = _ADAPTER.validate_python(data)
    except ValidationError as exc:
        raise from_validation(exc, p) from None
    if isinstance(sc, DecodeStepFigure):
        from rackbed.sim.serving_figures import resolve_ref

        try:
            ref = resolve_ref(sc.scenario, p.parent)
        except (ValueError, FileNotFoundError) as exc:
            raise UserError(f"{p}: scenario: {exc}") from None
        sc = sc.model_copy(update={"scenario": str(ref)})
    if isinstance(sc, DecodeFrontierFigure):
        from rackbed.sim.serving_figures import resolve_ref

        panels = []
        for i, pn in enumerate(sc.panels):
            try:
                ref = resolve_ref(pn.scenario, p.parent)
            except (ValueError, FileNotFoundError) as exc:
                raise UserError(f"{p}: panels[{i}].scenario: {exc}") from None
            panels.append(pn.model_copy(update={"scenario": str(ref)}))
        sc = sc.model_copy(update={"panels": tuple(panels)})
    return sc


# ------------------------------------------------------------------------------------------------ helpers

_TOPOS: dict[str, Any] = {}


def _topo(name: str):
    """Load a topology once per process (topologies are immutable)."""
    from rackbed import topology

    if name not in _TOPOS:
        _TOPOS[name] = topology.load(name)
    return _TOPOS[name]


def _model(name: str):
    from rackbed.engine.core.model import get_model

    return get_model(name)


def _check_gpus(topo, n: int, where: str) -> tuple[int, ...]:
    if n > topo.n_gpus:
        raise UserError(f"{where}: needs {n} GPUs but topology {topo.name} has {topo.n_gpus}")
    return tuple(range(n))


def _us(s: float) -> float:
    return round(s * 1e6, 3)


def _pct(new: float, old: float) -> float:
    return round(100.0 * (old - new) / old, 2) if old > 0 else 0.0


class Result:
    """What a figure builder returns: a table (columns + rows), claims, a plot callback, and a summary dict."""

    def __init__(self, columns: list[str], rows: list[dict], claims: list[tuple[str, str]],
                 plot: Callable, summary: dict, extra: dict | None = None, layout: tuple[int, int] = (1, 1),
                 compact: bool = False):
        self.columns, self.rows, self.claims, self.plot, self.summary = columns, rows, claims, plot, summary
        self.extra = extra or {}
        #: (rows, columns) of plot panels: (1, 1) hands ``plot`` one axis, any other a grid of them
        self.layout = layout
        #: the JSON writes each row (and each row of a list in ``extra``) on one line
        self.compact = compact
        #: the verdict against the scenario's criterion (set by :func:`compute_figure`)
        self.verdict: dict | None = None


# ------------------------------------------------------------------------------------------------ (a)


def _fig_allreduce(sc: AllreduceFigure) -> Result:
    from rackbed.engine.core.collectives import sharp_cut, sharp_cut_per_direction
    from rackbed.engine.core.sharding import ParallelPlan
    from rackbed.sim.costs.collective import allreduce_time
    from rackbed.sim.costs.constants import NVLS_EFFICIENCY
    from rackbed.sim.costs.step import prefill_step_time

    model = _model(sc.model)
    n_bytes = sc.tokens * model.hidden * sc.elem_bytes
    rows, summary, sweep = [], {}, {}
    sizes = []
    s = sc.sweep_min_bytes
    while s <= sc.sweep_max_bytes:
        sizes.append(s)
        s *= 2
    for hw in sc.hardware:
        topo = _topo(hw.topology)
        gpus = _check_gpus(topo, sc.tp, f"hardware {hw.name}")
        base = allreduce_time(topo, gpus, n_bytes, algo="auto_no_nvls")
        try:
            nvls = allreduce_time(topo, gpus, n_bytes, algo="nvls")
        except UserError:
            nvls = None
        plan = ParallelPlan(role="prefill", tp=sc.tp, ep=sc.tp, dp=1, gpus=gpus, weight_format=hw.weight_format)
        step_with = prefill_step_time(model, plan, topo, [(sc.tokens, 0)],
                                      allreduce_algo="nvls" if nvls else "auto_no_nvls").total_s
        step_without = prefill_step_time(model, plan, topo, [(sc.tokens, 0)],
                                         allreduce_algo="auto_no_nvls").total_s
        arch = topo.gpu_spec(0).arch
        row = {"hardware": hw.name, "bytes": n_bytes, "nvlink_algo": f"{base.algo}/{base.protocol}",
               "nvlink_us": _us(base.total_s), "nvls_us": _us(nvls.total_s) if nvls else None,
               "nvls_cut_pct": _pct(nvls.total_s, base.total_s) if nvls else None,
               "prefill_step_ms_nvlink": round(step_without * 1e3, 3),
               "prefill_step_ms_nvls": round(step_with * 1e3, 3),
               "prefill_cut_pct": _pct(step_with, step_without),
               "nvls_efficiency": NVLS_EFFICIENCY[arch]}
        rows.append(row)
        summary[hw.name] = row
        sweep[hw.name] = {
            "bytes": sizes,
            "nvlink_us": [_us(allreduce_time(topo, gpus, b, algo="auto_no_nvls").total_s) for b in sizes],
            "nvls_us": [_us(allreduce_time(topo, gpus, b, algo="nvls").total_s) for b in sizes] if nvls else None,
        }
    n = sc.tp
    breakeven = round(1 - sharp_cut_per_direction(n), 4)  # (N+1)/(2(N-1)): NVLS efficiency to break even
    sim = "; ".join(
        f"{r['hardware']}: NVLS {'n/a' if r['nvls_cut_pct'] is None else format(r['nvls_cut_pct'], '+.1f') + ' %'}"
        f" on the all-reduce ({r['nvlink_us']:.0f} -> {r['nvls_us'] or float('nan'):.0f} µs), "
        f"{r['prefill_cut_pct']:+.1f} % on the prefill step" for r in rows)
    claims = [
        (sc.claim, sim),
        (f"traffic bound: GPU transactions B vs 2(N-1)B/N -> {100 * sharp_cut(n):.0f} % cut at N={n}",
         (f"per-direction port bytes B(1+1/N) vs 2(N-1)B/N -> {100 * sharp_cut_per_direction(n):.1f} % bound; "
          f"NVLS wins at large sizes only if its link efficiency exceeds {breakeven:.3f} "
          f"(model: Hopper {NVLS_EFFICIENCY['hopper']}, Blackwell {NVLS_EFFICIENCY['blackwell']}, NCCL tuning)")),
    ]

    def plot(ax):
        for hw_name, sw in sweep.items():
            line, = ax.loglog(sw["bytes"], sw["nvlink_us"], marker="o", ms=3, label=f"{hw_name} NVLink")
            if sw["nvls_us"]:
                ax.loglog(sw["bytes"], sw["nvls_us"], marker="s", ms=3, ls="--", color=line.get_color(),
                          label=f"{hw_name} NVLS")
        ax.axvline(n_bytes, color="grey", lw=0.8, ls=":")
        ax.set_xlabel("bytes per rank")
        ax.set_ylabel("all-reduce time (µs)")
        ax.legend(fontsize=7)

    cols = ["hardware", "nvlink_algo", "nvlink_us", "nvls_us", "nvls_cut_pct", "prefill_step_ms_nvlink",
            "prefill_step_ms_nvls", "prefill_cut_pct"]
    return Result(cols, rows, claims, plot, summary, {"sweep": sweep})


# ------------------------------------------------------------------------------------------------ (b)


def _fig_ep_prefill(sc: EpPrefillFigure) -> Result:
    from rackbed.sim.costs.moe_comm import ep_prefill_combine, ep_prefill_dispatch

    model = _model(sc.model)
    rows = []
    for hw in sc.hardware:
        topo = _topo(hw.topology)
        for ep in sc.eps:
            gpus = _check_gpus(topo, ep, f"hardware {hw.name}, ep={ep}")
            d = ep_prefill_dispatch(topo, gpus, sc.tokens, model, hw.weight_format)
            c = ep_prefill_combine(topo, gpus, sc.tokens, model)
            hosts = len({topo.host_of(g) for g in gpus})
            rows.append({"hardware": hw.name, "ep": ep, "hosts": hosts, "dispatch_us": _us(d.total_s),
                         "combine_local_us": _us(c.fixed_s + c.local_s),
                         "combine_allreduce_us": _us(c.allreduce_s),
                         "allreduce_algo": c.allreduce.algo if c.allreduce else "none",
                         "total_us": _us(d.total_s + c.total_s)})
    summary = {f"{r['hardware']}/ep{r['ep']}": r["total_us"] for r in rows}
    parts = []
    for hw in sc.hardware:
        mine = [r for r in rows if r["hardware"] == hw.name]
        parts.append(", ".join(f"EP{r['ep']} {r['total_us']:.0f} µs" for r in mine) + f" on {hw.name}")
    claims = [(sc.claim, "; ".join(parts))]

    def plot(ax):
        width = 0.8 / max(len(sc.hardware), 1)
        for i, hw in enumerate(sc.hardware):
            mine = [r for r in rows if r["hardware"] == hw.name]
            xs = [j + i * width for j in range(len(mine))]
            bottom = [0.0] * len(mine)
            for key, hatch in (("dispatch_us", ""), ("combine_local_us", "//"), ("combine_allreduce_us", "..")):
                vals = [r[key] for r in mine]
                ax.bar(xs, vals, width, bottom=bottom, hatch=hatch, label=f"{hw.name} {key[:-3]}",
                       color=f"C{i}", alpha=0.5 + 0.2 * (hatch == ""), edgecolor="black", lw=0.3)
                bottom = [b + v for b, v in zip(bottom, vals)]
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(sc.eps))], [f"EP={e}" for e in sc.eps])
        ax.set_ylabel(f"µs per MoE layer ({sc.tokens} tokens)")
        ax.legend(fontsize=6)

    return Result(["hardware", "ep", "hosts", "dispatch_us", "combine_local_us", "combine_allreduce_us",
                   "allreduce_algo", "total_us"], rows, claims, plot, summary)


# ------------------------------------------------------------------------------------------------ (c)


def _fig_decode_a2a(sc: DecodeA2aFigure) -> Result:
    from rackbed.sim.costs.moe_comm import dpep_decode_combine, dpep_decode_dispatch

    model = _model(sc.model)
    rows = []
    for hw in sc.hardware:
        topo = _topo(hw.topology)
        for ep in sc.eps:
            gpus = _check_gpus(topo, ep, f"hardware {hw.name}, ep={ep}")
            route = "nvlink" if len({topo.nvlink_domain(g) for g in gpus}) == 1 else "net"
            for t in sc.tokens_per_rank:
                d = dpep_decode_dispatch(topo, gpus, t, model, hw.weight_format)
                c = dpep_decode_combine(topo, gpus, t, model)
                rows.append({"hardware": hw.name, "ep": ep, "route": route, "tokens_per_rank": t,
                             "dispatch_us": _us(d.total_s), "combine_us": _us(c.total_s),
                             "total_us": _us(d.total_s + c.total_s)})
    summary = {f"{r['hardware']}/ep{r['ep']}/t{r['tokens_per_rank']}": [r["dispatch_us"], r["combine_us"]]
               for r in rows}
    parts = []
    for hw in sc.hardware:
        mine = [r for r in rows if r["hardware"] == hw.name]
        tot = [r["total_us"] for r in mine]
        tmax = max(sc.tokens_per_rank)
        at = [r for r in mine if r["tokens_per_rank"] == tmax]
        lo, hi = min(at, key=lambda r: r["ep"]), max(at, key=lambda r: r["ep"])
        parts.append(f"{hw.name}: dispatch+combine {min(tot):.0f}-{max(tot):.0f} µs over all points; at {tmax} "
                     f"tokens/rank EP{lo['ep']} {lo['total_us']:.0f} µs -> EP{hi['ep']} {hi['total_us']:.0f} µs "
                     f"(x{hi['total_us'] / lo['total_us']:.2f} for x{hi['ep'] // lo['ep']} peers)")
    claims = [(sc.claim, "; ".join(parts)),
              (("sanity anchors (published, other hardware/hidden sizes; not fit targets): pplx-kernels NVLink "
                "EP8 hidden 7168 41.6/41.7 µs at 1 token, 83.6/102.3 µs at 128; pplx-garden CX7 EP8 128 tokens "
                "50.5/65.3 µs"),
               "; ".join(f"{r['hardware']} EP{r['ep']} t={r['tokens_per_rank']}: {r['dispatch_us']:.1f}/"
                         f"{r['combine_us']:.1f} µs" for r in rows
                         if r["ep"] == 8 and r["tokens_per_rank"] in (1, 128)))]

    def plot(ax):
        for i, hw in enumerate(sc.hardware):
            for j, ep in enumerate(sc.eps):
                mine = [r for r in rows if r["hardware"] == hw.name and r["ep"] == ep]
                ts = [r["tokens_per_rank"] for r in mine]
                ax.semilogx(ts, [r["dispatch_us"] for r in mine], marker="o", ms=3, color=f"C{j}",
                            ls=["-", "-."][i % 2], label=f"{hw.name} EP{ep} dispatch")
                ax.semilogx(ts, [r["combine_us"] for r in mine], marker="s", ms=3, color=f"C{j}", ls=":")
        ax.set_xlabel("tokens per rank")
        ax.set_ylabel("µs (solid: dispatch, dotted: combine)")
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=6)

    return Result(["hardware", "ep", "route", "tokens_per_rank", "dispatch_us", "combine_us", "total_us"], rows,
                  claims, plot, summary)


# ------------------------------------------------------------------------------------------------ (d)


def _fig_grouped_gemm(sc: GroupedGemmFigure) -> Result:
    from rackbed.sim.costs.gemm import expert_mlp_time, format_execution

    model = _model(sc.model)
    rows, notes = [], {}
    for hw in sc.hardware:
        gpu = _topo(hw.topology).gpu_spec(0)
        for fmt in sc.formats:
            fe = format_execution(gpu, fmt)
            if fe.note != "native":
                notes[f"{hw.name}/{fmt}"] = fe.note
            for ep in sc.eps:
                if model.n_experts % ep:
                    raise UserError(f"eps: {ep} does not divide the {model.n_experts} experts of {model.name}")
                n_local = model.n_experts // ep
                c = expert_mlp_time(gpu, model.hidden, model.moe_intermediate, [sc.tokens_per_expert] * n_local,
                                    fmt)
                rows.append({"hardware": hw.name, "format": fmt, "exec_format": fe.exec_format, "ep": ep,
                             "local_experts": n_local, "gemm_us": _us(c.total_s),
                             "weight_MB": round(c.hbm_bytes / 1e6, 2),
                             "fixed_us": _us(c.gate_up.fixed_s + c.down.fixed_s)})
    summary = {f"{r['hardware']}/{r['format']}/ep{r['ep']}": r["gemm_us"] for r in rows}

    def t(hw, fmt, ep):
        return next(r["gemm_us"] for r in rows if r["hardware"] == hw and r["format"] == fmt and r["ep"] == ep)

    parts = []
    eps = sorted(sc.eps)
    for hw in sc.hardware:
        fmt = "mxfp8" if "mxfp8" in sc.formats else sc.formats[0]
        steps = [f"EP{a}->{b}: -{t(hw.name, fmt, a) - t(hw.name, fmt, b):.1f} µs "
                 f"(x{t(hw.name, fmt, a) / t(hw.name, fmt, b):.2f})" for a, b in itertools.pairwise(eps)]
        parts.append(f"{hw.name} {fmt}: " + ", ".join(steps))
    e16 = 16 if 16 in sc.eps else eps[-1]
    if len(sc.hardware) >= 2:
        a, b = sc.hardware[0].name, sc.hardware[1].name
        parts.append(f"at EP{e16} {b} / {a} time: " + ", ".join(f"{f} {t(b, f, e16) / t(a, f, e16):.2f}x"
                                                              for f in sc.formats))
    if "mxfp8" in sc.formats and "fp8_block" in sc.formats:
        parts.append(f"mxfp8 / fp8_block time at EP{eps[0]} and EP{e16}: " + ", ".join(
            f"{hw.name} {t(hw.name, 'mxfp8', eps[0]) / t(hw.name, 'fp8_block', eps[0]):.2f}x and "
            f"{t(hw.name, 'mxfp8', e16) / t(hw.name, 'fp8_block', e16):.2f}x" for hw in sc.hardware)
            + " (1 token per expert is memory-bound: block-scale handling only shows when compute matters)")
    claims = [(sc.claim, "; ".join(parts))] + [(f"format note ({k})", v) for k, v in notes.items()]

    def plot(ax):
        for i, hw in enumerate(sc.hardware):
            for j, fmt in enumerate(sc.formats):
                ys = [t(hw.name, fmt, e) for e in sc.eps]
                ax.semilogx(sc.eps, ys, marker="o", ms=3, color=f"C{j}", ls=["-", "--"][i % 2],
                            label=f"{hw.name} {fmt}", base=2)
        ax.set_xlabel("EP ranks (experts per rank = n_experts / EP)")
        ax.set_ylabel(f"grouped GEMM µs ({sc.tokens_per_expert} token/expert)")
        ax.set_yscale("log")
        ax.legend(fontsize=6, ncol=2)

    return Result(["hardware", "format", "exec_format", "ep", "local_experts", "gemm_us", "weight_MB",
                   "fixed_us"], rows, claims, plot, summary, {"notes": notes})


# ------------------------------------------------------------------------------------------------ (e)


def _fig_prefill_parallelism(sc: PrefillParallelismFigure) -> Result:
    from rackbed.engine.core.sharding import ParallelPlan
    from rackbed.sim.costs.step import prefill_step_breakdown

    model = _model(sc.model)
    rows, terms = [], {}
    seqs = [(sc.prompt_tokens, 0)] * sc.n_prompts
    n_tok = sc.prompt_tokens * sc.n_prompts
    for hw in sc.hardware:
        topo = _topo(hw.topology)
        for cfg in sc.configs:
            world = cfg.tp
            gpus = _check_gpus(topo, world, f"hardware {hw.name}, tp={cfg.tp}")
            plan = ParallelPlan(role="prefill", tp=cfg.tp, ep=cfg.ep, dp=1, gpus=gpus,
                                weight_format=hw.weight_format, kv_replication=model.mixer("full").kv_replication(cfg.tp))
            bd = prefill_step_breakdown(model, plan, topo, seqs)
            label = cfg.label or f"TP={cfg.tp}/EP={cfg.ep}"
            cats = bd.by_category()
            row = {"hardware": hw.name, "config": label, "gpus": world,
                   "hosts": len({topo.host_of(g) for g in gpus}),
                   **{k.replace("_s", "_ms"): round(v * 1e3, 3) for k, v in cats.items()},
                   "step_ms": round(bd.total_s * 1e3, 3),
                   "tokens_per_s_per_gpu": round(n_tok / bd.total_s / world, 1)}
            rows.append(row)
            terms[f"{hw.name}/{label}"] = {k: round(v * 1e3, 4) for k, v in bd.seconds().items()}
    summary = {f"{r['hardware']}/{r['config']}": [r["step_ms"], r["tokens_per_s_per_gpu"]] for r in rows}
    parts = []
    for hw in sc.hardware:
        mine = [r for r in rows if r["hardware"] == hw.name]
        best = max(mine, key=lambda r: r["tokens_per_s_per_gpu"])
        fastest = min(mine, key=lambda r: r["step_ms"])
        desc = ", ".join(f"{r['config']} {r['step_ms']:.1f} ms / {r['tokens_per_s_per_gpu']:.0f} tok/s/GPU"
                         for r in mine)
        parts.append(f"{hw.name}: {desc}; per GPU {best['config']} wins, lowest latency {fastest['config']}")
    a = terms[f"{sc.hardware[0].name}/{sc.configs[0].label or f'TP={sc.configs[0].tp}/EP={sc.configs[0].ep}'}"]
    b = terms[f"{sc.hardware[0].name}/{sc.configs[1].label or f'TP={sc.configs[1].tp}/EP={sc.configs[1].ep}'}"]
    shrink = {k: round(a[k] - b.get(k, 0.0), 2) for k in a}
    grow = {k: round(b[k] - a.get(k, 0.0), 2) for k in b if b[k] - a.get(k, 0.0) > 0}
    claims = [(sc.claim, "; ".join(parts)),
              ("where the time goes (first hardware, config 1 -> config 2, ms per step)",
               "saved: " + ", ".join(f"{k} {v}" for k, v in sorted(shrink.items(), key=lambda kv: -kv[1])
                                     if v > 0.05)
               + "; added: " + (", ".join(f"{k} +{v}" for k, v in grow.items()) or "none"))]

    def plot(ax):
        cats = ["attn_ms", "moe_gemm_ms", "a2a_ms", "allreduce_ms", "other_ms"]
        labels = [f"{r['hardware']}\n{r['config']}" for r in rows]
        bottom = [0.0] * len(rows)
        for i, c in enumerate(cats):
            vals = [r[c] for r in rows]
            ax.bar(labels, vals, bottom=bottom, label=c[:-3], color=f"C{i}")
            bottom = [b + v for b, v in zip(bottom, vals)]
        ax.set_ylabel(f"prefill step ms ({sc.n_prompts} x {sc.prompt_tokens} tokens)")
        ax.tick_params(axis="x", labelsize=7)
        ax.legend(fontsize=7)

    cols = ["hardware", "config", "gpus", "hosts", "attn_ms", "moe_gemm_ms", "a2a_ms", "allreduce_ms", "other_ms",
            "step_ms", "tokens_per_s_per_gpu"]
    return Result(cols, rows, claims, plot, summary, {"terms_ms": terms})


# ------------------------------------------------------------------------------------------------ (f)


def _fig_decode_ep_trade(sc: DecodeEpTradeFigure) -> Result:
    from rackbed.engine.core.sharding import ParallelPlan
    from rackbed.sim.costs.gemm import binomial_histogram, expert_mlp_time
    from rackbed.sim.costs.moe_comm import dpep_decode_combine, dpep_decode_dispatch
    from rackbed.sim.costs.step import decode_step_breakdown

    model = _model(sc.model)
    hw = sc.hardware
    topo = _topo(hw.topology)
    gpu = topo.gpu_spec(0)
    ea, eb = sc.eps
    rows = []
    for t in sc.tokens_per_rank:
        vals = {}
        for ep in (ea, eb):
            gpus = _check_gpus(topo, ep, f"hardware {hw.name}, ep={ep}")
            comm = (dpep_decode_dispatch(topo, gpus, t, model, hw.weight_format).total_s
                    + dpep_decode_combine(topo, gpus, t, model).total_s)
            hist = binomial_histogram(t * ep, model.top_k / model.n_experts, model.n_experts // ep)
            gemm = expert_mlp_time(gpu, model.hidden, model.moe_intermediate, hist, hw.weight_format).total_s
            vals[ep] = (comm, gemm)
        rows.append({"tokens_per_rank": t, f"comm_ep{ea}_us": _us(vals[ea][0]), f"comm_ep{eb}_us": _us(vals[eb][0]),
                     f"gemm_ep{ea}_us": _us(vals[ea][1]), f"gemm_ep{eb}_us": _us(vals[eb][1]),
                     "comm_added_us": _us(vals[eb][0] - vals[ea][0]),
                     "gemm_removed_us": _us(vals[ea][1] - vals[eb][1]),
                     "net_gain_us": _us((vals[ea][0] + vals[ea][1]) - (vals[eb][0] + vals[eb][1]))})
    steps = {}
    for ep in (ea, eb):
        gpus = _check_gpus(topo, ep, f"hardware {hw.name}, ep={ep}")
        plan = ParallelPlan(role="decode", tp=1, ep=ep, dp=ep, gpus=gpus, weight_format=hw.weight_format)
        bd = decode_step_breakdown(model, plan, topo, [sc.step_batch_per_rank] * ep,
                                   [sc.step_batch_per_rank * sc.step_context_tokens] * ep, draft_k=sc.draft_k)
        steps[ep] = {k: round(v * 1e3, 4) for k, v in bd.by_category().items()}
        steps[ep]["step_ms"] = round(bd.total_s * 1e3, 4)
    summary = {"rows": {r["tokens_per_rank"]: [r["comm_added_us"], r["gemm_removed_us"]] for r in rows},
               "step_ms": {ep: steps[ep]["step_ms"] for ep in steps}}
    sim = "; ".join(f"{r['tokens_per_rank']} tok/rank: +{r['comm_added_us']:.1f} µs comm, "
                    f"-{r['gemm_removed_us']:.1f} µs GEMM (net {r['net_gain_us']:+.1f} µs/layer)" for r in rows)
    st = (f"whole decode step at {sc.step_batch_per_rank} seqs/rank x {sc.step_context_tokens} ctx, "
          f"draft_k={sc.draft_k}: EP{ea} {steps[ea]['step_ms']:.2f} ms vs EP{eb} {steps[eb]['step_ms']:.2f} ms "
          f"(same per-rank batch, so EP{eb} serves {eb // ea}x the users)")
    claims = [(sc.claim, sim), ("end to end (write-up: EP16 decoders confirmed faster on GB200)", st)]

    def plot(ax):
        ts = [r["tokens_per_rank"] for r in rows]
        ax.semilogx(ts, [r["comm_added_us"] for r in rows], marker="o", label=f"dispatch+combine added (EP{ea}->{eb})")
        ax.semilogx(ts, [r["gemm_removed_us"] for r in rows], marker="s", label="grouped GEMM removed")
        ax.semilogx(ts, [r["net_gain_us"] for r in rows], marker="^", ls="--", label="net gain per MoE layer")
        ax.axhline(0, color="grey", lw=0.8)
        ax.set_xlabel("tokens per rank")
        ax.set_ylabel("µs per MoE layer")
        ax.legend(fontsize=7)

    cols = ["tokens_per_rank", f"comm_ep{ea}_us", f"comm_ep{eb}_us", f"gemm_ep{ea}_us", f"gemm_ep{eb}_us",
            "comm_added_us", "gemm_removed_us", "net_gain_us"]
    return Result(cols, rows, claims, plot, summary, {"decode_step_ms": steps})


# ------------------------------------------------------------------------------------------------ decode step


#: the StepTime categories of a decode breakdown, in table order, and their column names
_CATS = (("attn_s", "attention_ms"), ("moe_gemm_s", "moe_gemm_ms"), ("a2a_s", "dispatch_combine_ms"),
         ("allreduce_s", "allreduce_ms"), ("other_s", "other_ms"))


def decode_step_rows(sc: DecodeStepFigure) -> list[dict]:
    """One row per (config, batch): the decode step of the scenario's decoders reshaped to ``config``, priced
    by the scenario's cost model (``sim.scenario.cost_model_for``) with every rank holding ``batch`` sequences of
    ``context_tokens``: milliseconds per category, tokens/s per GPU (all of the decoder's GPUs) and per user, and
    the KV tokens a rank can hold."""
    from rackbed.engine.core.sharding import min_redundant_experts
    from rackbed.sim.parallel import check_parallel
    from rackbed.sim.scenario import cost_model_for, decode_plan_for, load_scenario, scenario_model

    base = load_scenario(sc.scenario)
    if sc.calibration is not None:
        base = base.model_copy(update={"calibration": sc.calibration})
    model = scenario_model(base)
    topo = _topo(base.topology)
    k = base.mtp.draft_k if sc.draft_k is None else sc.draft_k
    e_tok = base.mtp.expected_tokens_per_step(k)
    rows = []
    for c in sc.configs:
        red = min_redundant_experts(model.n_experts, c.ep) if c.redundant_experts is None else c.redundant_experts
        label = c.label or (f"EP{c.ep}" + (f" TP{c.tp}" if c.tp > 1 else "")
                            + (f" +{red} redundant" if red else "") + (f" {c.overlap}" if c.overlap else ""))
        gpus = _domain_gpus(topo, c.ep, f"configs: {label}")
        for b in sc.batch_per_rank:
            upd = {"ep": c.ep, "tp": c.tp, "redundant_experts": red, "max_batch_per_rank": b,
                   **({"overlap": c.overlap} if c.overlap else {})}
            upd.update({k: getattr(c, k) for k in ("expert_load", "eplb") if getattr(c, k) is not None})
            d = base.decode.model_copy(update=upd)
            one = base.model_copy(update={"decode": d, "mtp": base.mtp.model_copy(update={"draft_k": k})})
            try:
                check_parallel(one, model)
                plan = decode_plan_for(one, model, gpus)
                bud = plan.validate(model, topo)
            except UserError as exc:
                raise UserError(f"configs: {label}: {exc}") from None
            cm = cost_model_for(one, model, topo, None, plan)[0]
            bd = cm.decode_breakdown(b, b * sc.context_tokens, k)
            cat = bd.by_category()
            step = bd.total_s
            row = {"config": label, "ep": c.ep, "tp": c.tp, "redundant_experts": red, "batch_per_rank": b,
                   "step_ms": round(step * 1e3, 4)}
            row.update({col: round(cat.get(key, 0.0) * 1e3, 4) for key, col in _CATS})
            row["tokens_per_s_per_gpu"] = round(plan.dp * b * e_tok / step / c.ep, 1)
            row["tokens_per_s_per_user"] = round(e_tok / step, 1)
            row["kv_tokens_per_rank"] = bud.kv_capacity_tokens
            row["fits_batch"] = bud.kv_capacity_tokens >= b * sc.context_tokens
            if c.overlap:  # the seconds the overlap hid (sim.costs.overlap), for configs that set one
                row["overlap"] = c.overlap
                row["hidden_ms"] = round(sum(bd.hidden.values()) * 1e3, 4)
            rows.append(row)
    return rows


def _domain_gpus(topo, n: int, where: str) -> tuple[int, ...]:
    """The first ``n`` GPUs of the first NVLink domain that has them (a decoder's GPUs: one domain)."""
    seen: set[int] = set()
    for g in sorted(topo.gpu_ids):
        if g in seen:
            continue
        dom = sorted(topo.nvlink_domain(g))
        seen.update(dom)
        if len(dom) >= n:
            return tuple(dom[:n])
    raise UserError(f"{where}: a decoder of {n} GPUs needs one NVLink domain that large; topology {topo.name} has "
                    f"none")


def _fig_decode_step(sc: DecodeStepFigure) -> Result:
    rows = decode_step_rows(sc)
    cols = ["config", "batch_per_rank", "step_ms", *(c for _, c in _CATS), "tokens_per_s_per_gpu",
            "tokens_per_s_per_user", "kv_tokens_per_rank"]
    if any("hidden_ms" in r for r in rows):
        cols.insert(cols.index("tokens_per_s_per_gpu"), "hidden_ms")
        for r in rows:
            r.setdefault("hidden_ms", 0.0)
    sim = "; ".join(f"{r['config']} at {r['batch_per_rank']}/rank: {r['step_ms']:.2f} ms, "
                    f"{r['tokens_per_s_per_gpu']:.0f} tok/s/GPU" for r in rows)
    summary = {f"{r['config']}@{r['batch_per_rank']}": {"step_ms": r["step_ms"],
                                                        "tokens_per_s_per_gpu": r["tokens_per_s_per_gpu"]}
               for r in rows}

    def plot(ax):
        labels = [f"{r['config']}\nb={r['batch_per_rank']}" for r in rows]
        bottom = [0.0] * len(rows)
        for _, col in _CATS:
            vals = [r[col] for r in rows]
            ax.bar(labels, vals, bottom=bottom, label=col.removesuffix("_ms"))
            bottom = [a + v for a, v in zip(bottom, vals)]
        ax.set_ylabel("decode step, ms")
        ax.tick_params(axis="x", labelsize=7)
        ax.legend(fontsize=7)

    return Result(cols, rows, [(sc.claim, sim)], plot, summary)


def frontier_rows(sc: DecodeFrontierFigure) -> list[dict]:
    """:func:`decode_step_rows` of every panel x case x EP x overlap at each ``batch_per_rank`` and at the
    largest batch whose sequences fit in a rank's KV memory (where a curve ends), each row also naming its
    ``panel``, ``case`` and ``overlap``. A case's redundant slots: the fewest that make the EP divide the
    expert slots plus ``extra_slots_per_rank`` x EP."""
    from rackbed.engine.core.sharding import min_redundant_experts
    from rackbed.sim.scenario import load_scenario, scenario_model

    rows = []
    for pn in sc.panels:
        model = scenario_model(load_scenario(pn.scenario))
        panel = pn.label or model.name
        configs, keys = [], {}
        for case in sc.cases:
            for ep in sc.eps:
                for ov in sc.overlaps:
                    red = min_redundant_experts(model.n_experts, ep) + case.extra_slots_per_rank * ep
                    label = f"{panel} | {case.label} | EP{ep} | {ov}"
                    keys[label] = (case.label, ov)
                    configs.append(DecodeConfig(ep=ep, redundant_experts=red, expert_load=case.expert_load,
                                                eplb=case.eplb, label=label, overlap=ov))

        def priced(cfgs, batches):
            one = DecodeStepFigure(kind="figure", figure="decode_step", name=sc.name, claim=sc.claim,
                                   scenario=pn.scenario, calibration=sc.calibration, configs=tuple(cfgs),
                                   batch_per_rank=tuple(batches), context_tokens=sc.context_tokens,
                                   draft_k=sc.draft_k)
            return decode_step_rows(one)

        mine = priced(configs, sc.batch_per_rank)
        by_fill: dict[int, list[DecodeConfig]] = {}  # the largest batch that fits, per config
        for c in configs:
            kv = next(r["kv_tokens_per_rank"] for r in mine if r["config"] == c.label)
            full = kv // sc.context_tokens
            if full >= min(sc.batch_per_rank) and full not in sc.batch_per_rank:
                by_fill.setdefault(full, []).append(c)
        for full, cfgs in by_fill.items():
            mine += priced(cfgs, [full])
        order = {c.label: i for i, c in enumerate(configs)}
        mine.sort(key=lambda r: (order[r["config"]], r["batch_per_rank"]))
        for r in mine:
            case, ov = keys[r["config"]]
            rows.append({"panel": panel, "case": case,
                         **{k: v for k, v in r.items() if k not in ("config", "tp", "allreduce_ms")},
                         "overlap": ov, "hidden_ms": r.get("hidden_ms", 0.0)})
    return rows


def best_overlap_rows(rows: list[dict]) -> list[dict]:
    """Per (panel, case, EP, batch): the row of the shortest step over the overlaps (at a fixed batch per rank
    the shortest step is also the most tokens/s per GPU and per user)."""
    best: dict[tuple, dict] = {}
    for r in rows:
        k = (r["panel"], r["case"], r["ep"], r["batch_per_rank"])
        if k not in best or r["step_ms"] < best[k]["step_ms"]:
            best[k] = r
    return list(best.values())


def at_slo(points: list[dict], slo: float) -> dict | None:
    """The most tokens/s per GPU a curve of rows (one per batch per rank; those whose batch fits in KV memory)
    gives at ``slo`` tokens/s per user or faster: its best row at or above the SLO, or the point where the
    curve, linear between two batches, crosses it. None when even the smallest batch is slower than the SLO.
    ``batch_per_rank`` of a crossing is interpolated; ``capped``: the largest fitting batch still meets the
    SLO (the curve ends there, at KV memory, not at the SLO)."""
    pts = sorted((r for r in points if r["fits_batch"]), key=lambda r: r["batch_per_rank"])
    cands = []
    for a, b in zip(pts, pts[1:] + [None]):
        if a["tokens_per_s_per_user"] < slo:
            continue
        cands.append({k: a[k] for k in ("tokens_per_s_per_gpu", "batch_per_rank", "tokens_per_s_per_user")}
                     | {"capped": b is None})
        if b is not None and b["tokens_per_s_per_user"] < slo:  # the segment crosses the SLO
            ua, ub = a["tokens_per_s_per_user"], b["tokens_per_s_per_user"]
            f = (ua - slo) / (ua - ub)

            def lerp(k):
                return round(a[k] + f * (b[k] - a[k]), 1)

            cands.append({"tokens_per_s_per_gpu": lerp("tokens_per_s_per_gpu"),
                          "batch_per_rank": lerp("batch_per_rank"), "tokens_per_s_per_user": slo,
                          "capped": False})
    # the most tokens/s per GPU; of equals, the first (a point before the crossing it ties)
    return max(cands, key=lambda c: c["tokens_per_s_per_gpu"], default=None)


def frontier_slo_rows(sc: DecodeFrontierFigure, rows: list[dict]) -> list[dict]:
    """For each panel, case, overlap (``none`` and ``best``: the best overlap per point) and SLO, every EP's
    tokens/s per GPU at the SLO (:func:`at_slo`) and whether it is the winner."""
    curves: dict[tuple, list[dict]] = {}
    for r in rows:
        if r["overlap"] == "none":
            curves.setdefault((r["panel"], r["case"], "none", r["ep"]), []).append(r)
    if set(sc.overlaps) != {"none"}:
        for r in best_overlap_rows(rows):
            curves.setdefault((r["panel"], r["case"], "best", r["ep"]), []).append(r)
    out = []
    panels = list(dict.fromkeys(r["panel"] for r in rows))
    for panel, case, mode in itertools.product(panels, [c.label for c in sc.cases], ("none", "best")):
        for slo in sc.slo_tokens_per_s_per_user:
            group = []
            for ep in sc.eps:
                pts = curves.get((panel, case, mode, ep))
                if pts is None:
                    continue
                hit = at_slo(pts, slo)
                row = {"panel": panel, "case": case, "overlap": mode, "slo_tokens_per_s_per_user": slo,
                       "ep": ep, "tokens_per_s_per_gpu": hit and hit["tokens_per_s_per_gpu"],
                       "batch_per_rank": hit and hit["batch_per_rank"], "capped": bool(hit and hit["capped"])}
                if mode == "best" and hit is not None:
                    near = min(pts, key=lambda r: abs(r["batch_per_rank"] - hit["batch_per_rank"]))
                    row["overlap_used"] = near["overlap"]
                group.append(row)
            top = max((g["tokens_per_s_per_gpu"] or 0.0 for g in group), default=0.0)
            for g in group:
                g["wins"] = top > 0 and g["tokens_per_s_per_gpu"] == top
            out.extend(group)
    return out


_STYLES = ("-", "--", ":", "-.")


def _fig_decode_frontier(sc: DecodeFrontierFigure) -> Result:
    rows = frontier_rows(sc)
    slo_rows = frontier_slo_rows(sc, rows)
    cats = [c for _, c in _CATS if c != "allreduce_ms"]  # DP attention (tp 1): no all-reduce
    cols = ["panel", "case", "ep", "overlap", "batch_per_rank", "step_ms", *cats, "hidden_ms",
            "tokens_per_s_per_gpu", "tokens_per_s_per_user", "fits_batch"]
    panels = list(dict.fromkeys(r["panel"] for r in rows))
    lines = []
    for g in slo_rows:
        if g["wins"]:
            lines.append(f"{g['panel']}, {g['case']}, overlap {g['overlap']}, "
                         f"{g['slo_tokens_per_s_per_user']:g} tok/s/user: EP{g['ep']} "
                         f"({g['tokens_per_s_per_gpu']:.0f} tok/s/GPU)")
    summary = {f"{g['panel']} | {g['case']} | {g['overlap']} | {g['slo_tokens_per_s_per_user']:g}":
               {"ep": g["ep"], "tokens_per_s_per_gpu": g["tokens_per_s_per_gpu"]}
               for g in slo_rows if g["wins"]}
    modes = ["none"] + (["best"] if set(sc.overlaps) != {"none"} else [])
    best = best_overlap_rows(rows)

    def plot(axes):
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FixedLocator, NullFormatter, ScalarFormatter

        colours = plt.get_cmap("viridis")(list(i / max(1, len(sc.eps) - 1) for i in range(len(sc.eps))))
        for i, mode in enumerate(modes):
            src = [r for r in rows if r["overlap"] == "none"] if mode == "none" else best
            for j, panel in enumerate(panels):
                ax = axes[i][j]
                for ci, case in enumerate(sc.cases):
                    for ei, ep in enumerate(sc.eps):
                        pts = sorted((r for r in src if r["panel"] == panel and r["case"] == case.label
                                      and r["ep"] == ep and r["fits_batch"]),
                                     key=lambda r: r["batch_per_rank"])
                        ax.plot([r["tokens_per_s_per_user"] for r in pts],
                                [r["tokens_per_s_per_gpu"] for r in pts],
                                ls=_STYLES[ci % len(_STYLES)], color=colours[ei], marker=".", ms=3, lw=1.1,
                                label=f"EP{ep}" if ci == 0 else None)
                for slo in sc.slo_tokens_per_s_per_user:
                    ax.axvline(slo, color="grey", lw=0.7, ls="--")
                ax.set_xscale("log")
                ax.xaxis.set_major_locator(FixedLocator([5, 10, 20, 50, 100, 200, 500]))
                ax.xaxis.set_major_formatter(ScalarFormatter())
                ax.xaxis.set_minor_formatter(NullFormatter())
                ax.set_title(f"{panel}: " + ("no overlap" if mode == "none" else "best overlap per point"),
                             fontsize=8)
                ax.set_xlabel("tokens/s per user", fontsize=8)
                ax.set_ylabel("tokens/s per GPU", fontsize=8)
                ax.tick_params(labelsize=7)
                ax.grid(True, which="both", lw=0.3, alpha=0.5)
        from matplotlib.lines import Line2D

        ep_legend = axes[0][0].legend(fontsize=6, loc="upper right", title="colour", title_fontsize=6)
        axes[0][0].add_artist(ep_legend)
        axes[0][0].legend(handles=[Line2D([], [], color="k", ls=_STYLES[ci % len(_STYLES)], label=c.label)
                                   for ci, c in enumerate(sc.cases)], fontsize=6, loc="lower left",
                          title="line", title_fontsize=6)

    return Result(cols, rows, [(sc.claim, "; ".join(lines))], plot, summary, {"slo": slo_rows},
                  layout=(len(modes), len(panels)), compact=True)


_BUILDERS: dict[type, Callable] = {
    AllreduceFigure: _fig_allreduce, EpPrefillFigure: _fig_ep_prefill, DecodeA2aFigure: _fig_decode_a2a,
    GroupedGemmFigure: _fig_grouped_gemm, PrefillParallelismFigure: _fig_prefill_parallelism,
    DecodeEpTradeFigure: _fig_decode_ep_trade, DecodeStepFigure: _fig_decode_step,
    DecodeFrontierFigure: _fig_decode_frontier,
}


# ------------------------------------------------------------------------------------------------ runner


def compute_figure(sc) -> Result:
    """The table, claims, plot and verdict (``Result.verdict``: :func:`sim.verdicts.judge`, None when the
    scenario states no criterion) of a validated figure scenario (no I/O)."""
    res = _BUILDERS[type(sc)](sc)
    res.verdict = figure_verdict(sc, res.rows, res.extra)
    return res


def figure_verdict(sc, rows: list[dict], extra: dict) -> dict | None:
    """The verdict of figure scenario ``sc`` on its rows and extra tables, computed or read back from its JSON
    (None when ``sc`` has no ``verdict``)."""
    if sc.verdict is None:
        return None
    return judge(sc.verdict, figure_measures(sc.figure, rows, extra), f"{sc.name}: verdict")


def verdict_lines(v: dict | None) -> list[str]:
    """The printed verdict: one line with the verdict and the criterion, then one per check."""
    if v is None:
        return ["verdict: none (the scenario states no criterion)"]
    out = [f"verdict: {v['verdict']} (criterion: {v['criterion']})"]
    for c in v["checks"]:
        val = "not a number" if c["value"] is None else f"{c['value']:.4g}"
        band = (f"{c['min']:g} to {c['max']:g}" if c["min"] is not None and c["max"] is not None
                else f">= {c['min']:g}" if c["min"] is not None else f"<= {c['max']:g}")
        out.append(f"  {'met   ' if c['met'] else 'missed'} {c['check']} = {val} (want {band})")
    return out


def _fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:,.3f}" if abs(v) < 1000 else f"{v:,.1f}"
    return "—" if v is None else str(v)


def run_figure(path: Path, out_dir: Path, *, console=None) -> dict:
    """Run a ``kind: figure`` scenario: print the table and the claim-vs-simulation lines, write
    ``<out_dir>/<name>.json`` and ``<out_dir>/<name>.png``. Returns the JSON document (plus the two paths)."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    path = Path(path)
    sc = load_figure(path)
    res = compute_figure(sc)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)

    table = Table(title=sc.title or sc.name, show_lines=False)
    for c in res.columns:
        table.add_column(c, justify="left" if c in ("hardware", "config", "format", "exec_format", "route",
                                                    "nvlink_algo", "allreduce_algo") else "right")
    for r in res.rows:
        table.add_row(*(_fmt(r.get(c)) for c in res.columns))
    console.print(table)
    # its claim is this repository's own
    said = "claim" if isinstance(sc, DecodeStepFigure | DecodeFrontierFigure) else "write-up"
    for claim, sim in res.claims:
        console.print(f"[bold]{said}:[/bold] {claim}")
        console.print(f"[bold]simulated:[/bold] {sim}")
    for line in verdict_lines(res.verdict):
        console.print(line, markup=False, highlight=False)

    png = out_dir / f"{safe_name(sc.name)}.png"
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if res.layout == (1, 1):
        fig, ax = plt.subplots(figsize=(7.5, 4.5), dpi=110)
        res.plot(ax)
        ax.set_title(sc.title or sc.name, fontsize=9)
        ax.grid(True, which="both", lw=0.3, alpha=0.5)
    else:
        nr, nc = res.layout
        fig, axes = plt.subplots(nr, nc, figsize=(5.5 * nc, 4.0 * nr), dpi=110, squeeze=False)
        res.plot(axes)
        fig.suptitle(sc.title or sc.name, fontsize=9)
    fig.tight_layout()
    with replacing(png, "wb") as f:
        fig.savefig(f, format="png")
    plt.close(fig)

    doc = {"name": sc.name, "figure": sc.figure, "title": sc.title, "scenario": str(path),
           "scenario_config": json.loads(sc.model_dump_json()), "columns": res.columns, "rows": res.rows,
           "claims": [{"write_up": c, "simulated": s} for c, s in res.claims], "verdict": res.verdict,
           "summary": res.summary, **res.extra}
    text = _dumps_compact(doc) if res.compact else json.dumps(doc, indent=1, default=_json_default)
    js = write_text(out_dir / f"{safe_name(sc.name)}.json", text + "\n")
    console.print(f"wrote {js} and {png}")
    return {**doc, "json": str(js), "png": str(png)}


def _dumps_compact(doc: dict) -> str:
    """``doc`` as indented JSON, except that every list of rows (dicts) has one row per line."""
    slots, plain = {}, {}
    for k, v in doc.items():
        if isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
            slots[k] = v
            plain[k] = f"@@{k}@@"
        else:
            plain[k] = v
    text = json.dumps(plain, indent=1, default=_json_default)
    for k, v in slots.items():
        lines = ",\n  ".join(json.dumps(x, default=_json_default, separators=(",", ":")) for x in v)
        text = text.replace(json.dumps(f"@@{k}@@"), "[\n  " + lines + "\n ]")
    return text


def _json_default(o):
    if isinstance(o, float) and not math.isfinite(o):
        return
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")
