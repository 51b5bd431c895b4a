"""Per-term attribution of the simulator's miss against the real engine: which part of the cost model misses.

A real run with ``real.profile_plans`` N > 0 (``rackbed real --profile-plans N``) records in ``real.json``'s
``term_profile``, for up to N sampled plans of each kind per worker (decode steps, prefill batches, mixed
steps), the kernel time inside each cost-model category of the model code and the plan's measured time
(``engine.real.profiling``). :func:`attribute_run` replays the run (``sim.engine_calibration``: the same
scheduler gives the same plans) and prices each profiled plan term by term with the *kernel-level* cost
model — the scenario's, as ``sim.scenario.build`` makes it without the engine calibration, which would only
rescale every term to the fitted total — and compares, per plan kind, term by term:

===============  =========================================  ==========================================
term             priced (``StepBreakdown`` items)           measured (``term_profile``)
===============  =========================================  ==========================================
``attn_s``       attention projections and cores            the ``attn_s`` scopes' kernels
``moe_gemm_s``   expert grouped GEMMs, shared / dense MLPs  the ``moe_gemm_s`` scopes' kernels
``a2a_s``        MoE dispatch and combine                   the ``a2a_s`` scopes' kernels
``allreduce_s``  TP / EP-combine all-reduces                the ``allreduce_s`` scopes' kernels
``other_s``      router, norms, embedding, lm_head          the ``other_s`` scopes' kernels and every
                 (``other_s`` less the host items)          kernel outside a scope (``unscoped_s``)
``engine_s``     the host items (``host``, ``*_host``)      measured - all kernels: the engine's host,
                                                            launch and IPC time
===============  =========================================  ==========================================

so the measured terms add up to the measured time and the priced ones to the priced total. Per kind, the table
holds the mean per plan of each term, priced and measured, the residual (measured - priced) and its share of
the total residual; a term whose residual exceeds ``threshold`` (default 10 %) of the mean measured plan time
is named in one line (:func:`summary_line`). :func:`attribute` does the arithmetic on priced / measured rows
alone, so it can be checked on synthetic rows.
"""

from __future__ import annotations

import json
from pathlib import Path

from rackbed.topology.errors import UserError

#: the attribution's terms: the StepTime categories plus the engine's own time
TERMS: tuple[str, ...] = ("attn_s", "moe_gemm_s", "a2a_s", "allreduce_s", "other_s", "engine_s")
LABELS = {"attn_s": "attention", "moe_gemm_s": "MoE expert GEMMs", "a2a_s": "MoE dispatch/combine",
          "allreduce_s": "all-reduce", "other_s": "other (router, norms, embedding, lm_head)",
          "engine_s": "engine overhead"}
KINDS: tuple[str, ...] = ("decode", "prefill", "mixed")
#: a term is named when its residual exceeds this share of the kind's mean measured plan time
THRESHOLD = 0.10


def is_host_term(name: str) -> bool:
    """A breakdown item the engine's own time answers for (``host``, ``cross_node_host``...)."""
    return name == "host" or name.endswith("_host")


def priced_terms(bd) -> dict[str, float]:
    """A ``StepBreakdown``'s seconds per attribution term: its categories, the host items as ``engine_s``."""
    out = dict.fromkeys(TERMS, 0.0)
    for name, (cat, s) in bd.terms.items():
        out["engine_s" if is_host_term(name) else cat] += s
    return out


def measured_terms(p: dict) -> dict[str, float]:
    """A ``term_profile`` entry's seconds per attribution term (module docstring), adding up to
    ``measured_s``."""
    t = p["terms"]
    out = {k: float(t.get(k, 0.0)) for k in TERMS[:-1]}
    out["other_s"] += float(p.get("unscoped_s", 0.0))
    out["engine_s"] = float(p["measured_s"]) - float(p["kernels_s"])
    return out


def attribute(rows: list[dict], threshold: float = THRESHOLD) -> dict[str, dict]:
    """Per kind, from rows ``{"kind", "priced": {term: s}, "measured": {term: s}}``: ``{"n", "measured_s",
    "priced_s", "residual_s", "terms": [{"term", "priced_s", "measured_s", "residual_s", "share"}], "misses":
    [term, ...]}`` — means per plan; ``share``: the term's part of the total residual (None when that is 0);
    ``misses``: the terms whose |residual| exceeds ``threshold`` of the mean measured time, largest first."""
    out = {}
    for kind in KINDS:
        rs = [r for r in rows if r["kind"] == kind]
        if not rs:
            continue
        n = len(rs)
        pr = {t: sum(r["priced"].get(t, 0.0) for r in rs) / n for t in TERMS}
        me = {t: sum(r["measured"].get(t, 0.0) for r in rs) / n for t in TERMS}
        total_m, total_p = sum(me.values()), sum(pr.values())
        resid = total_m - total_p
        terms = [{"term": t, "priced_s": pr[t], "measured_s": me[t], "residual_s": me[t] - pr[t],
                  "share": (me[t] - pr[t]) / resid if abs(resid) > 1e-15 else None} for t in TERMS]
        misses = sorted((r for r in terms if abs(r["residual_s"]) > threshold * total_m),
                        key=lambda r: -abs(r["residual_s"]))
        out[kind] = {"n": n, "measured_s": total_m, "priced_s": total_p, "residual_s": resid, "terms": terms,
                     "misses": [r["term"] for r in misses], "threshold": threshold}
    return out


def _ms(s: float) -> str:
    return f"{s * 1e3:+.3g} ms" if abs(s) < 1.0 else f"{s:+.3g} s"


def summary_line(kind: str, a: dict) -> str:
    """One line naming the terms that miss, e.g. ``decode: the miss is engine overhead (+9.8 ms, 71 %) and
    attention (+2.1 ms, 15 %)``."""
    by = {r["term"]: r for r in a["terms"]}
    if not a["misses"]:
        return (f"{kind}: no term misses by more than {a['threshold'] * 100:.0f} % of the measured time "
                f"(total residual {_ms(a['residual_s'])} per plan)")
    parts = []
    for t in a["misses"]:
        r = by[t]
        share = "" if r["share"] is None else f", {r['share'] * 100:.0f} %"
        parts.append(f"{LABELS[t]} ({_ms(r['residual_s'])}{share})")
    body = parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]
    return f"{kind}: the miss is {body}"


def table_lines(kind: str, a: dict) -> list[str]:
    """The kind's table: term, priced, measured, residual (ms per plan) and share of the total residual."""
    out = [f"  {kind} ({a['n']} profiled plans; mean per plan)",
           f"    {'term':44s} {'priced':>10s} {'measured':>10s} {'residual':>10s} {'share':>7s}"]
    for r in a["terms"]:
        share = "-" if r["share"] is None else f"{r['share'] * 100:.0f}%"
        out.append(f"    {LABELS[r['term']]:44s} {r['priced_s'] * 1e3:10.3f} {r['measured_s'] * 1e3:10.3f} "
                   f"{r['residual_s'] * 1e3:+10.3f} {share:>7s}")
    out.append(f"    {'total (ms)':44s} {a['priced_s'] * 1e3:10.3f} {a['measured_s'] * 1e3:10.3f} "
               f"{a['residual_s'] * 1e3:+10.3f}")
    return out


def _group(built, worker: str):
    dep = built.deployment
    for g in (*dep.prefillers, *dep.decoders, *dep.aggregated):
        if g.id == worker:
            return g
    return None


def price_plan(cm, plan, group):
    """The kernel-level cost model's ``StepBreakdown`` of a replayed plan (``PrefillBatch``, ``DecodeStep`` or
    ``MixedStep``) on ``group`` — what ``cm.prefill`` / ``decode`` / ``mixed`` price, term by term."""
    from rackbed.engine.core.plans import DecodeStep, MixedStep, PrefillBatch

    if isinstance(plan, PrefillBatch):
        return cm.prefill_breakdown([(n, start) for _, start, n in plan.items], group)
    if isinstance(plan, DecodeStep):
        return cm.decode_breakdown(max(plan.rank_batch), max(plan.rank_context_tokens), plan.draft_k, group)
    if isinstance(plan, MixedStep):
        from rackbed.sim.costs.mixed import mixed_step_breakdown

        chunks = [[] for _ in plan.rank_batch]
        for _, rank, start, n in plan.prefill:
            chunks[rank].append((n, start))
        return mixed_step_breakdown(cm.model, cm._plan_for(group), cm.topo, plan.rank_batch,
                                    plan.rank_context_tokens, chunks, draft_k=plan.draft_k, calib=cm.calib,
                                    **cm.draft)
    raise TypeError(f"no breakdown for {type(plan).__name__}")


def attribute_run(run_dir: str | Path, *, threshold: float = THRESHOLD, built=None) -> dict | None:
    """The attribution of a real run folder's ``term_profile`` (module docstring); None when the run recorded
    none. ``built``: the run's scenario built without engine calibration (default: from ``real.json``)."""
    from rackbed.sim.engine_calibration import _replay_plans

    run_dir = Path(run_dir)
    real = json.loads((run_dir / "real.json").read_text())
    prof = real.get("term_profile")
    if not prof:
        return None
    if built is None:
        from rackbed.sim.scenario import build, load_scenario

        built = build(load_scenario(real["scenario"]), engine_calibration=False)
    cm = getattr(built.cost_model, "base", built.cost_model)   # the kernel-level model, never the engine fit
    replayed = _replay_plans(real, built)
    rows = []
    for p in prof:
        plans = replayed.get((p["worker"], p["kind"], p["key"]))
        if not plans:
            raise UserError(f"{run_dir}: term_profile names {p['worker']}/{p['kind']}/{p['key']}, which the "
                            f"replay of the run does not have")
        bd = price_plan(cm, plans[0], _group(built, p["worker"]))
        rows.append({"plan": f"{p['worker']}/{p['kind']}/{p['key']}", "kind": p["kind"],
                     **{k: p[k] for k in ("batch", "tokens", "n_seqs", "context_tokens") if k in p},
                     "priced": priced_terms(bd), "measured": measured_terms(p),
                     "priced_items": bd.seconds()})
    kinds = attribute(rows, threshold)
    return {"kinds": kinds, "summary": [summary_line(k, a) for k, a in kinds.items()], "plans": rows,
            "threshold": threshold}


#: what each kind's engine-overhead line runs over (``fit_terms``)
LINE_X = {"decode": "batch", "prefill": "tokens", "mixed": "batch+tokens"}


def _x(r: dict) -> float:
    return float(sum(r.get(k) or 0 for k in LINE_X[r["kind"]].split("+")))


def fit_terms(rows: list[dict], holdout_every: int = 3) -> dict[str, dict]:
    """Per-term refit from profiled plans (rows as :func:`attribute_run`'s ``plans``): per kind, a scale per
    kernel term (measured / priced, summed over the fitted plans; none for a term the model prices at 0) and
    the rest of the measured time — engine overhead and unscaled terms — as a robust line over the kind's size
    (``LINE_X``: ``(a, b)``). Every ``holdout_every``-th plan of each kind is held out and predicted as
    ``sum(scale * priced) + a + b * size``: ``held_out`` ``{"n", "median_abs", "max_abs"}`` of the relative
    errors (null values without held-out plans). A kind with fewer than two fitted plans is left out."""
    import statistics

    from rackbed.sim.engine_calibration import _line

    out = {}
    for kind in KINDS:
        rs = [r for r in rows if r["kind"] == kind]
        held = [i % holdout_every == holdout_every - 1 if holdout_every else False for i in range(len(rs))]
        fit = [r for r, h in zip(rs, held) if not h]
        hold = [r for r, h in zip(rs, held) if h]
        if len(fit) < 2:
            continue
        scales = {}
        for t in TERMS[:-1]:
            p = sum(r["priced"][t] for r in fit)
            if p > 0:
                scales[t] = sum(r["measured"][t] for r in fit) / p

        def scaled(r):
            return sum(s * r["priced"][t] for t, s in scales.items())

        a, b = _line([_x(r) for r in fit], [sum(r["measured"].values()) - scaled(r) for r in fit])
        errs = []
        for r in hold:
            m = sum(r["measured"].values())
            if m > 0:
                errs.append(abs(scaled(r) + max(a + b * _x(r), 0.0) - m) / m)
        out[kind] = {"x": LINE_X[kind], "scales": scales, "overhead_s": [a, b], "n_fit": len(fit),
                     "held_out": {"n": len(errs), "median_abs": statistics.median(errs) if errs else None,
                                  "max_abs": max(errs) if errs else None}}
    return out


def print_attribution(res: dict, echo=print) -> None:
    echo("per-term attribution (kernel-level cost model vs profiled plans; residual = measured - priced, ms)")
    for kind, a in res["kinds"].items():
        for line in table_lines(kind, a):
            echo(line)
    for line in res["summary"]:
        echo(f"  {line}")
