"""Published serving results against the simulator: a suite of measured deployments, each run as a scenario
and measured the way its source measured it.

A suite file (``kind: published_suite``; the shipped one is ``scenarios/published/suite.yaml``) lists cases.
Each case carries its source (title, address, date), the configuration as the source published it, the
measured figure with the sentence it came from and what it counts, a ``metric`` that says how to take
rackbed's figure from a run, and the ``scenario`` (the serving-scenario schema of docs/SCENARIOS.md, less
``kind`` and ``name``) that reproduces the deployment. Where the source leaves a setting open the case's
``assumptions`` say what the scenario chose.

Metrics (``metric.kind``), each divided by GPUs or by nodes of ``metric.gpus_per_node`` (``metric.per``):

``prefill_input``
    prompt tokens a saturated prefiller computes per second: per prefiller group, the tokens of its prefill
    batches over the wall time from its first batch's start to its last batch's end, summed over groups and
    divided by their GPUs. ``metric.computed_share`` (default 1) is the share of the counted prompt tokens
    that the prefiller computes: a figure that counts prefix-cache hits is compared with rackbed's computed
    tokens divided by it (cached tokens are taken as free, their attention over the prefix included).
``decode_output``
    output tokens decoders emit per second while their batches are full: the timeline samples in which the
    decoding requests are at least ``metric.full`` (default 0.95) of the run's most form the window; every
    done request's decode tokens (``output_tokens - 1``: the first comes from the prefill) are spread evenly
    over its decode span and counted where that span meets the window; divided by the window and the decode
    GPUs.
``output``
    output tokens of the whole run per second, over every GPU in use (``trtllm-bench``'s "Per GPU Output
    Throughput": every request's output tokens over the run's wall time): the run's
    ``throughput.output_tokens_per_s_per_gpu``.

A case's error is ``(rackbed - measured) / measured``. Beyond ``TOLERANCE`` (25 %) the row names the
cost-model term behind the miss: the largest term of the step at the run's operating point (decode: the
window's mean batch per rank at the mean context; prefill: a full batch of the case's prompts; aggregated: a
decode step of the mean batch), from ``sim.costs`` term by term, with the case's own ``why`` (what the source
did that the term does not price, or why rackbed is right there). A case rackbed refuses (a plan that does not
fit, a mode the cost model does not price) is reported with no figure, the refusal and the case's ``why``."""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Annotated, Literal

import numpy as np
from pydantic import BeforeValidator, ConfigDict, Field, ValidationError

from rackbed.topology.errors import NoBoolNumbers, UserError, from_validation

#: |error| beyond which a row names the term responsible
TOLERANCE = 0.25

#: the shipped suite, relative to the repository root
DEFAULT_SUITE = Path(__file__).resolve().parent.parent / "scenarios" / "published" / "suite.yaml"


class _Strict(NoBoolNumbers):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _iso(v):
    """A YAML date (``2025-05-05`` unquoted) as its ISO text."""
    return v.isoformat() if hasattr(v, "isoformat") else v


class Source(_Strict):
    """Where a figure was published: ``title``, ``url``, ``date`` (YYYY-MM-DD or YYYY-MM) and who published
    it; ``note``: which version of a living page was read, and how its date is known."""

    title: str = Field(min_length=1)
    url: str = Field(pattern=r"^https://\S+$")
    date: Annotated[str, BeforeValidator(_iso), Field(pattern=r"^\d{4}-\d{2}(-\d{2})?$")]
    publisher: str = Field(min_length=1)
    note: str = ""


class PublishedConfig(_Strict):
    """The deployment as the source describes it (free text, as the source words it; nothing here is
    simulated)."""

    gpu: str = Field(min_length=1)
    gpus: int = Field(ge=1)
    model: str = Field(min_length=1)
    precision: str = Field(min_length=1)
    deployment: Literal["disaggregated", "aggregated"]
    parallelism: str = Field(min_length=1)
    isl: str = Field(min_length=1)
    osl: str = Field(min_length=1)
    load: str = Field(min_length=1)
    stack: str = Field(min_length=1)


class Measured(_Strict):
    """The measured figure: ``value`` in ``unit``, the ``quote`` it comes from, and what it ``measures``."""

    value: float = Field(gt=0, allow_inf_nan=False)
    unit: str = Field(min_length=1)
    quote: str = Field(min_length=1)
    measures: str = Field(min_length=1)


class Metric(_Strict):
    """How rackbed's figure is taken from the run (module docstring)."""

    kind: Literal["prefill_input", "decode_output", "output"]
    per: Literal["gpu", "node"] = "gpu"
    gpus_per_node: int = Field(8, ge=1)
    computed_share: float = Field(1.0, gt=0, le=1)
    full: float = Field(0.95, gt=0, le=1)


class Case(_Strict):
    name: str = Field(pattern=r"^[a-z0-9][a-z0-9.-]*$")
    source: Source
    published: PublishedConfig
    measured: Measured
    metric: Metric
    scenario: dict
    assumptions: tuple[str, ...] = ()
    #: why rackbed misses (or is right) where |error| exceeds the tolerance; shown only then
    why: str = ""


class Suite(_Strict):
    kind: Literal["published_suite"]
    description: str = ""
    cases: tuple[Case, ...] = Field(min_length=1)


def load_suite(path: str | Path) -> tuple[Suite, dict]:
    """The suite file at ``path`` and each case's parsed ``ServingScenario`` (``{name: scenario}``); one-line
    errors name the file, the case and the field: a missing or unknown field, a duplicate name, a scenario the
    schema refuses, an unknown topology or model preset."""
    from rackbed import topology
    from rackbed.sim.scenario import parse_scenario, scenario_model
    from rackbed.topology.yamlio import load_yaml

    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: no such suite file")
    data = load_yaml(path)
    try:
        suite = Suite.model_validate(data)
    except ValidationError as exc:
        raise from_validation(exc, path) from None
    seen: set[str] = set()
    scenarios = {}
    for i, case in enumerate(suite.cases):
        where = f"{path}: cases[{i}] ({case.name})"
        if case.name in seen:
            raise UserError(f"{where}: name: {case.name!r} appears twice")
        seen.add(case.name)
        bad = {"kind", "name"} & set(case.scenario)
        if bad:
            raise UserError(f"{where}: scenario.{sorted(bad)[0]}: set by the case (leave it out)")
        try:
            sc = parse_scenario({"kind": "serving", "name": case.name, **case.scenario})
        except UserError as exc:
            raise UserError(f"{where}: scenario: {exc}") from None
        try:
            topology.load(sc.topology)
        except (UserError, ValueError, KeyError) as exc:
            raise UserError(f"{where}: scenario.topology: {exc}") from None
        try:
            scenario_model(sc)
        except (UserError, ValueError, KeyError) as exc:
            raise UserError(f"{where}: scenario.model: {exc}") from None
        scenarios[case.name] = sc
    return suite, scenarios


# ------------------------------------------------------------------------------------------------ measuring


def _prefill_figure(res) -> dict:
    """Computed prompt tokens per second per prefill GPU of saturated prefillers (module docstring)."""
    from rackbed.sim.driver import SPAN_PREFILL

    gpus = {g[0]: g[2] for g in res.groups if g[1] == "prefill"}
    per: dict[str, list] = {}
    for wid, kind, start, dur, arg, failed in res.spans:
        if kind == SPAN_PREFILL and not failed and wid in gpus:
            p = per.setdefault(wid, [math.inf, 0.0, 0])
            p[0] = min(p[0], start)
            p[1] = max(p[1], start + dur)
            p[2] += int(arg)
    if not per:
        raise UserError("prefill_input: the run has no prefill batches")
    gpu_s = sum((p[1] - p[0]) * gpus[w] for w, p in per.items())
    tokens = sum(p[2] for p in per.values())
    return {"tokens_per_s_per_gpu": tokens / gpu_s, "tokens": tokens,
            "prefill_gpus": sum(gpus[w] for w in per)}


def _decode_figure(res, full: float) -> dict:
    """Output tokens per second per decode GPU while the decode batches are full (module docstring)."""
    from rackbed.engine.core.metrics import request_arrays

    t = np.array([s.t_s for s in res.samples] + [res.sim_end_s])
    dec = np.array([s.decoding for s in res.samples], dtype=float)
    if not len(dec) or dec.max() <= 0:
        raise UserError("decode_output: no request was ever decoding")
    on = dec >= full * dec.max()
    lo, hi = t[:-1][on], t[1:][on]
    a = request_arrays(res.rows, res.row_fields)
    done = (a["status"] == "done") & (a["output_tokens"] > 1)
    ds, de = a["decode_start_s"][done], a["end_s"][done]
    n = (a["output_tokens"][done] - 1).astype(float)
    span = np.maximum(de - ds, 1e-12)
    tokens = 0.0
    for a0, a1 in zip(lo, hi):
        tokens += float((n * np.clip(np.minimum(de, a1) - np.maximum(ds, a0), 0, None) / span).sum())
    window = float((hi - lo).sum())
    gpus = sum(g[2] for g in res.groups if g[1] == "decode")
    return {"tokens_per_s_per_gpu": tokens / window / gpus, "window_s": window, "decode_gpus": gpus,
            "mean_decoding": float(dec[on].mean()), "max_decoding": int(dec.max())}


def _scale(metric: Metric) -> float:
    return metric.gpus_per_node if metric.per == "node" else 1.0


def measure(case: Case, b, res) -> dict:
    """rackbed's figure for ``case`` from a built scenario ``b`` and its run ``res``, in the case's unit, with
    the details it rests on."""
    m = case.metric
    if m.kind == "prefill_input":
        d = _prefill_figure(res)
        d["value"] = d["tokens_per_s_per_gpu"] / m.computed_share * _scale(m)
    elif m.kind == "decode_output":
        d = _decode_figure(res, m.full)
        d["value"] = d["tokens_per_s_per_gpu"] * _scale(m)
        ranks = sum(g.template.ep // g.template.tp for g in b.deployment.decoders)
        t = b.deployment.decoders[0].template
        d.update(batch_per_rank=d["mean_decoding"] / ranks, max_batch_per_rank=t.max_batch_per_rank,
                 kv_capacity_tokens_per_rank=t.kv_capacity_tokens_per_rank)
    else:
        th = res.metrics["throughput"]
        d = {"tokens_per_s_per_gpu": th["output_tokens_per_s_per_gpu"], "duration_s": th["duration_s"],
             "mean_gpus": th["mean_gpus"]}
        d["value"] = d["tokens_per_s_per_gpu"] * _scale(m)
    return d


# ------------------------------------------------------------------------------------------------------ terms


def _mean_lengths(sc) -> tuple[float, float]:
    """Mean prompt and output tokens of the scenario's first requests."""
    from rackbed.engine.core.workload import iter_requests

    reqs = list(iter_requests(sc.workload, sc.seed))[:2000]
    return sum(r.prompt_tokens for r in reqs) / len(reqs), sum(r.output_tokens for r in reqs) / len(reqs)


def step_terms(case: Case, b, res, fig: dict) -> dict:
    """The step at the run's operating point, term by term (seconds), and what that point is."""
    sc, cm = b.scenario, b.cost_model
    isl, osl = _mean_lengths(sc)
    k = sc.mtp.draft_k
    if case.metric.kind == "prefill_input":
        plan = b.prefill_plan
        per_rank = max(1, sc.prefill.max_batch_tokens // max(1, plan.dp))
        n = max(1, int(per_rank // isl)) * max(1, plan.dp)
        seqs = [(int(isl), 0)] * n
        bd = cm.prefill_breakdown(seqs, b.deployment.prefillers[0])
        point = f"prefill batch of {n} prompts of {isl:.0f} tokens"
    elif sc.deployment == "aggregated":
        from rackbed.sim.costs.mixed import mixed_step_breakdown

        g = b.deployment.aggregated[0]
        plan = cm._plan_for(g)
        batch = max(1, round(_agg_batch(res, plan)))
        ctx = isl + osl / 2
        bd = mixed_step_breakdown(cm.model, plan, cm.topo, [batch] * plan.dp, [batch * ctx] * plan.dp,
                                  [[] for _ in range(plan.dp)], draft_k=k, calib=cm.calib, **cm.draft)
        point = f"decode step of {batch} sequences per rank at {ctx:.0f} tokens of context"
    else:
        plan = b.decode_plan
        batch = max(1, round(fig.get("mean_decoding", 1) / max(1, len(b.deployment.decoders)) / plan.dp))
        ctx = isl + osl / 2
        bd = cm.decode_breakdown(batch, batch * ctx, k, b.deployment.decoders[0])
        point = f"decode step of {batch} sequences per rank at {ctx:.0f} tokens of context"
    terms = bd.seconds()
    total = sum(terms.values()) or 1e-12
    top = sorted(terms.items(), key=lambda kv: -kv[1])
    return {"point": point, "step_s": total, "terms_s": terms, "hidden_s": dict(bd.hidden),
            "top": [{"term": n, "share": s / total} for n, s in top[:3]]}


def _agg_batch(res, plan) -> float:
    """Mean decoding requests per DP rank of the aggregated workers over the run's samples."""
    dec = [s.decoding for s in res.samples]
    workers = sum(1 for g in res.groups if g[1] == "aggregated")
    return (sum(dec) / max(1, len(dec))) / max(1, workers) / plan.dp


# ---------------------------------------------------------------------------------------------------- running


def run_case(case: Case, sc) -> dict:
    """Build and simulate one case; its row (``rackbed`` None and ``refused`` set when rackbed refuses it)."""
    from rackbed.sim.scenario import build, simulate_scenario

    row = {"case": case.name, "source": case.source.title, "url": case.source.url, "date": case.source.date,
           "publisher": case.source.publisher, "source_note": case.source.note,
           "unit": case.measured.unit, "measured": case.measured.value,
           "metric": case.metric.model_dump(), "rackbed": None, "error": None, "term": None, "why": None,
           "refused": None}
    t0 = time.perf_counter()
    try:
        b = build(sc)
    except (UserError, ValueError) as exc:
        row.update(refused=str(exc), why=case.why or "(no explanation recorded in the suite)", term="refused")
        row["wall_s"] = time.perf_counter() - t0
        return row
    b, res = simulate_scenario(sc, built=b)
    fig = measure(case, b, res)
    row["rackbed"] = fig["value"]
    row["details"] = {k: v for k, v in fig.items() if k != "value"}
    err = (fig["value"] - case.measured.value) / case.measured.value
    row["error"] = err
    terms = step_terms(case, b, res, fig)
    row["step"] = terms
    row["calibration"] = b.calibration_note
    row["caveats"] = list(b.caveats)
    row["requests"] = res.metrics["requests"]
    if abs(err) > TOLERANCE:
        row["term"] = terms["top"][0]["term"]
        row["why"] = case.why or "(no explanation recorded in the suite)"
    row["wall_s"] = time.perf_counter() - t0
    return row


def run_suite(path: str | Path | None = None, *, cases: list[str] | None = None, echo=None) -> dict:
    """Every case of the suite (or the named ``cases``), in file order; the result document."""
    path = Path(path) if path is not None else DEFAULT_SUITE
    suite, scenarios = load_suite(path)
    names = [c.name for c in suite.cases]
    if cases:
        unknown = [c for c in cases if c not in names]
        if unknown:
            raise UserError(f"--case {unknown[0]}: not in {path} (cases: {', '.join(names)})")
    rows = []
    for case in suite.cases:
        if cases and case.name not in cases:
            continue
        row = run_case(case, scenarios[case.name])
        rows.append(row)
        if echo is not None:
            echo(row)
    root = DEFAULT_SUITE.parent.parent.parent
    shown = path.resolve().relative_to(root) if path.resolve().is_relative_to(root) else path
    return {"schema": "rackbed.published/1", "suite": str(shown), "tolerance": TOLERANCE, "cases": rows}


def fmt_value(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def table_rows(doc: dict) -> list[tuple[str, ...]]:
    """``(case, source, measured, rackbed, error, term)`` per row, formatted."""
    out: list[tuple[str, ...]] = []
    for r in doc["cases"]:
        err = "-" if r["error"] is None else f"{r['error'] * 100:+.1f}%"
        term = r["term"] or ""
        if r["term"] and r["term"] != "refused":
            share = next((t["share"] for t in r["step"]["top"] if t["term"] == r["term"]), None)
            term = f"{r['term']} ({share * 100:.0f}% of the step)" if share is not None else r["term"]
        out.append((r["case"], f"{r['publisher']} {r['date']}", f"{fmt_value(r['measured'])} {r['unit']}",
                    fmt_value(r["rackbed"]), err, term))
    return out
