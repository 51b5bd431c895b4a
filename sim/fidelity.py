"""The simulator against recorded real runs: the fidelity matrix (docs/FIDELITY.md, "Real runs by mode").

A real run (``rackbed real``: real.json, decisions.csv, metrics.json) measured the serving metrics of one scenario
file on a GPU. :func:`check_run` simulates the *same file* the way ``rackbed run`` does — the scenario's cost
model with the shipped engine calibration it selects — on the KV capacities the run's ranks had (``real.json``),
meeting the run's rank deaths if any, and compares TTFT / TPOT / ITL / end-to-end p50 and p90. Runs used to fit a
calibration are *fit* rows; the matrix's errors come from runs it never saw (another seed and rate).

    python -m rackbed.sim.fidelity fit RUN [RUN ...] --out calibration/engine-....yaml   # aggregated runs
    python -m rackbed.sim.fidelity check RUN [RUN ...] [--out fidelity.json]

``tests/test_fidelity_replay.py`` re-checks the recorded runs under ``results/h200/fidelity`` and fails when an error
grows past the value recorded in its ``fidelity.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from rackbed.topology.errors import UserError

METRICS = ("ttft", "tpot", "itl", "e2e")
#: targets of the matrix: |error| of the p50s and the p90s
TARGETS = {"p50": 0.10, "p90": 0.15}


def check_run(run_dir: str | Path, *, calibration=None) -> dict:
    """Real vs simulated serving metrics of one recorded real run (module docstring). ``calibration``: an
    ``EngineCalibration`` to price with instead of the one ``build`` selects (None: the shipped one, or none)."""
    from rackbed.engine.core.metrics import Slo
    from rackbed.engine.core.workload import generate
    from rackbed.sim.driver import simulate
    from rackbed.sim.engine_calibration import EngineCalibratedCostModel, _rel, run_deployment, run_faults
    from rackbed.sim.scenario import build, load_scenario

    run_dir = Path(run_dir)
    try:
        real = json.loads((run_dir / "real.json").read_text())
    except FileNotFoundError:
        raise UserError(f"{run_dir}: no real.json (a `rackbed real` output folder is expected)") from None
    sc = load_scenario(_scenario_path(real["scenario"]))
    if calibration is None:
        b = build(sc)
        cm = b.cost_model
    else:
        b = build(sc, engine_calibration=False)
        cm = EngineCalibratedCostModel(b.cost_model, calibration)
    base = getattr(cm, "base", None)
    reqs = generate(sc.workload, sc.seed)
    n = len(real.get("generated_tokens", {})) or len(reqs)
    reqs = reqs[:n] if n < len(reqs) else reqs
    dep = run_deployment(b, real)
    # as the real run's scheduler ran (engine.real.driver.run_real): the scenario's policies, closed loop and prefix
    # caches
    kw = dict(seed=sc.seed, progress=False, slo=Slo(sc.slo.ttft_s, sc.slo.tpot_s), kv_chunks=b.cost_model.kv_chunks,
              decision_log=False, faults=run_faults(real), policies=sc.sim.policies.build(),
              closed_loop=sc.workload.closed_loop())
    if b.prefix_cache is not None:
        kw["prefix_cache"] = b.prefix_cache
    sim = simulate(dep, reqs, cm, **kw).metrics["latency_s"]
    raw = simulate(dep, reqs, base, **kw).metrics["latency_s"] if base is not None else None
    rm = real["metrics"]["latency_s"]
    rows = []
    for key in METRICS:
        for q in ("p50", "p90"):
            m, s = rm[key][q], sim[key][q]
            rows.append({"metric": f"{key} {q}", "real_s": m, "sim_s": s, "rel_error": _rel(s, m),
                         "kernel_only_sim_s": raw[key][q] if raw else None})
    graphs = real.get("graphs") or {}
    return {"run": str(run_dir), "scenario": real["scenario"], "device": real.get("versions", {}).get("device"),
            "date": real.get("versions", {}).get("date"), "engine_calibration": b.calibration_note.split("engine-calibrated: ")[-1]
            if calibration is None and "engine-calibrated" in b.calibration_note else (calibration.source if calibration else None),
            "graphs": graphs, "replay_identical_decisions": real.get("replay_identical_decisions"), "rows": rows}


def _scenario_path(recorded: str) -> Path:
    """The scenario file a run recorded: as written (relative to where it ran), else the shipped file of that name
    under ``scenarios/`` (a run made in a checkout and read from elsewhere)."""
    p = Path(recorded)
    if p.exists():
        return p
    from rackbed import shipped

    parts = p.parts[p.parts.index("scenarios") + 1:] if "scenarios" in p.parts else (p.name,)
    q = shipped("scenarios", *parts)
    if not q.exists():
        raise UserError(f"{recorded}: the run's scenario file is not here, nor shipped as {q}")
    return q


def misses(check: dict) -> list[str]:
    """The TTFT / TPOT rows of a :func:`check_run` result outside the matrix targets."""
    out = []
    for r in check["rows"]:
        key, q = r["metric"].split()
        if key in ("ttft", "tpot") and (r["rel_error"] is None or abs(r["rel_error"]) > TARGETS[q]):
            out.append(f"{r['metric']} {r['rel_error']:+.1%}" if r["rel_error"] is not None else f"{r['metric']} n/a")
    return out


def markdown(checks: list[dict]) -> str:
    """One line per run: TTFT / TPOT p50 / p90, real -> simulated and the error."""
    lines = ["| run | TTFT p50 | TTFT p90 | TPOT p50 | TPOT p90 |", "| --- | --- | --- | --- | --- |"]
    for c in checks:
        cells = []
        for name in ("ttft p50", "ttft p90", "tpot p50", "tpot p90"):
            r = next(x for x in c["rows"] if x["metric"] == name)
            scale, unit = (1.0, "s") if name.startswith("ttft") else (1e3, "ms")
            e = f"{r['rel_error']:+.1%}" if r["rel_error"] is not None else "n/a"
            cells.append(f"{r['real_s'] * scale:.3g} → {r['sim_s'] * scale:.3g} {unit} ({e})")
        lines.append(f"| {Path(c['run']).name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rackbed.sim.fidelity", description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fit", help="fit an aggregated engine calibration from real runs")
    f.add_argument("runs", nargs="+", type=Path)
    f.add_argument("--out", type=Path, required=True)
    f.add_argument("--force", action="store_true")
    c = sub.add_parser("check", help="real vs simulated metrics of recorded real runs")
    c.add_argument("runs", nargs="+", type=Path)
    c.add_argument("--calibration", type=Path, default=None, help="price with this engine calibration file")
    c.add_argument("--out", type=Path, default=None, help="write the checks as JSON")
    c.add_argument("--force", action="store_true")
    args = ap.parse_args(argv)
    try:
        from rackbed.topology.outputs import write_out_file

        if args.cmd == "fit":
            import yaml

            from rackbed.sim.engine_calibration import _err_stats, _rel, fit_engine_runs, predict_plan

            cal, hold = fit_engine_runs(args.runs)
            rows = [{"kind": p["kind"], "rel_error": _rel(predict_plan(cal, p), p["measured_s"])} for p in hold]
            st = _err_stats([r for r in rows if r["rel_error"] is not None])
            write_out_file(args.out, yaml.safe_dump(json.loads(cal.model_dump_json()), sort_keys=False),
                           force=args.force)
            print(f"wrote {args.out}: mixed_s = {cal.mixed_s}; held-out steps: {st['n']}, median |error| "
                  f"{st['median_abs']:.1%}, max {st['max_abs']:.1%}")
            return 0
        cal = None
        if args.calibration is not None:
            from rackbed.sim.engine_calibration import load_engine_calibration

            cal = load_engine_calibration(args.calibration)
        checks = [check_run(r, calibration=cal) for r in args.runs]
        print(markdown(checks))
        for ch in checks:
            m = misses(ch)
            print(f"{Path(ch['run']).name}: " + ("within targets" if not m else "misses " + ", ".join(m)))
        if args.out is not None:
            write_out_file(args.out, json.dumps({"targets": TARGETS, "checks": checks}, indent=1), force=args.force)
        return 0
    except UserError as exc:
        print(f"rackbed: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
