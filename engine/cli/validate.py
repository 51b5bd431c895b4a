"""``rackbed validate``: the simulator vs measurements on the same hardware, per row, with relative errors.

    rackbed validate [--measurements FILE] [--calibration FILE] [--topology h200x2] [--all]
                     [--out results/h200x2/validation_kernels.json]
    rackbed validate --power FILE [--power-run RUN_DIR] [--topology h200x2] [--out FILE]
    rackbed validate --published [FILE] [--case NAME ...] [--out FILE]

**Published deployments** (``--published [FILE]``, :mod:`sim.published`): every case of a suite of public,
measured serving results (default ``scenarios/published/suite.yaml``) simulated from its scenario, rackbed's
figure taken the way the source measured its own (per GPU or per node, prompt or output tokens, at the
source's batch or concurrency), printed as a table of case, source, measured, rackbed, error and, beyond
±25 %, the cost-model term behind the miss with the suite's explanation; ``--case`` runs the named cases only.

**Power** (``--power FILE``, :mod:`sim.power_check`): the GPU power model's predicted mean draw for a measured run's
utilisation against the measured mean (nvidia-smi samples), with the relative error.

**Kernel level** (:func:`validate_kernels`): for every measured row of ``kernels/bench/measure.py`` that the
calibration did *not* fit (its ``meta.holdout`` ids: every third point of each curve, whole held-out GEMM
shapes), the simulator's prediction — the cost function the simulator calls (``gemm_time``,
``grouped_gemm_time``, ``full_attention_prefill`` / ``_decode``, ``hbm_rate_Bps``, ``allreduce_time``,
``p2p_copy_time``) evaluated with the calibration table, i.e. the fitted curve interpolated at that shape — against the measured time:
``rel_error = (predicted - measured) / measured``; median and max of ``|rel_error|`` against the targets (median
<= 3 %, max <= 10 %), their 90th percentile and how many are within 10 %. Rows of benchmarks no calibration kind
covers are reported separately (model without calibration). ``--repeat FILE`` (a second run of the same grid)
adds each row's run-to-run difference. ``--all`` also lists the fitted rows (their error is ~0 by
construction: a check of the fit / lookup plumbing). Measurements in the ``rackbed.measure/2`` format carry the
spread of their timed rounds: each row reports ``noise`` (half the min-max range of its rounds over the median,
:func:`sim.calibrate.row_noise`) and ``within_noise`` (``|rel_error| <= noise``), and the summary the errors
beyond the noise (``max(0, |rel_error| - noise)``), so a reader sees which misses the measurement cannot resolve.
Older files (one median per row) have no spread: ``noise`` is null. ``--cross-validate K``
(:func:`cross_validate`) refits K times from the measurements instead, each fold holding out a different third
(for K = 3) of every curve's inner points, and reports every inner point once: the shipped file's errors depend on
which points its one hold-out hit.

**Engine level** (:func:`validate_engine`, ``--engine DIR``): a ``rackbed real`` run's measured plan times fitted on
the plans not held out (``sim.engine_calibration``), errors on the held-out plans, and the run's TTFT/TPOT/ITL
p50/p90 against a re-simulation with the fitted engine calibration; for a run that profiled sampled plans
(``rackbed real --profile-plans N``), the per-term attribution of the kernel-level cost model's miss
(``sim.engine_attribution``, docs/FIDELITY.md).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

from rackbed.topology.errors import UserError
from rackbed.topology.outputs import add_force, prepare_file, write_out_file

#: what ``--engine DIR`` reads from a ``rackbed real`` output folder
ENGINE_RUN_FILES = ("real.json", "decisions.csv")

#: kernel-level targets: |relative error| on held-out rows
TARGET_MEDIAN, TARGET_MAX = 0.03, 0.10


def _group(pred) -> str:
    rid = pred.row_id
    if rid.startswith("gemm/"):
        _, op, fmt, nk, _ = rid.split("/")
        return f"gemm {op} {fmt} {nk}"
    if rid.startswith("moe_block/"):
        return " ".join(rid.split("/")[:2])
    return rid.split("/")[0]


def _stats(errs: list[float]) -> dict:
    a = sorted(abs(e) for e in errs)
    return {"n": len(a), "median_abs": statistics.median(a) if a else None, "max_abs": a[-1] if a else None,
            "p90_abs": a[min(len(a) - 1, math.ceil(0.9 * len(a)) - 1)] if a else None,
            "within_max_target": sum(1 for e in a if e <= TARGET_MAX)}


def _targets(s: dict) -> dict:
    """The target fields of a summary of held-out errors ``s`` (:func:`_stats`)."""
    return {"holdout": s, "targets": {"median_abs": TARGET_MEDIAN, "max_abs": TARGET_MAX},
            "median_ok": s["median_abs"] is not None and s["median_abs"] <= TARGET_MEDIAN,
            "max_ok": s["max_abs"] is not None and s["max_abs"] <= TARGET_MAX}


def _verdict(label: str, summary: dict) -> str:
    """One line: ``label``, then median / max against the targets, 90th percentile, rows within the max."""
    s = summary["holdout"]
    ok = lambda b: "ok" if b else "MISSED"  # noqa: E731
    return (f"{label}: {s['n']}; median |error| {s['median_abs'] * 100:.1f}% (target <= {TARGET_MEDIAN * 100:.0f}%: "
            f"{ok(summary['median_ok'])}), max {s['max_abs'] * 100:.1f}% (target <= {TARGET_MAX * 100:.0f}%: "
            f"{ok(summary['max_ok'])}); 90th percentile {s['p90_abs'] * 100:.1f}%; {s['within_max_target']} of "
            f"{s['n']} within {TARGET_MAX * 100:.0f}%")


def validate_kernels(measurements: dict, calib, topo, *, include_fit: bool = False,
                     repeat: dict | None = None) -> dict:
    """Kernel-level comparison (module docstring). Returns ``{"rows": [...], "summary": {...}}``; each row has
    ``row_id, bench, role (holdout | fit | uncalibrated), measured_us, predicted_us, rel_error, model``.
    ``repeat``: a second measurement of the same grid (``--repeat``): each row also gets ``repeat_rel`` (its
    median in the repeat over this one, less 1), and the summary the run-to-run differences of the held-out rows,
    so a miss far beyond them is a reproducible property of the kernel, not noise."""
    from rackbed.sim.calibrate import (
        calibration_rows,
        check_measurements,
        curve_of,
        predict_row,
        row_id,
        row_noise,
    )

    check_measurements(measurements)
    if repeat is not None:
        check_measurements(repeat, "repeat measurements")
    again = {row_id(r): r["median_us"] for r in (repeat or {}).get("rows", [])
             if not r.get("error") and r.get("median_us")}

    meta = getattr(calib, "meta", {}) or {}
    held = set(meta.get("holdout", []))
    if not held:
        raise UserError("validate: the calibration file lists no held-out rows (meta.holdout); refit it with "
                        "'rackbed calibrate' (hold-outs are on by default)")
    out, groups = [], {}
    for r in calibration_rows(measurements.get("rows", [])):
        if r.get("error") or not r.get("median_us"):
            continue
        rid = row_id(r)
        role = "holdout" if rid in held else ("uncalibrated" if curve_of(r) is None else "fit")
        if role == "fit" and not include_fit:
            continue
        p = predict_row(r, calib, topo)
        if p is None:
            continue
        p0 = predict_row(r, None, topo)  # the first-principles model alone, for comparison
        row = {"row_id": rid, "bench": r["bench"], "group": _group(p), "role": role,
               "measured_us": p.measured_s * 1e6, "predicted_us": p.predicted_s * 1e6, "rel_error": p.rel_error,
               "uncalibrated_us": p0.predicted_s * 1e6, "uncalibrated_rel_error": p0.rel_error, "model": p.model}
        noise = row_noise(r)
        row.update(noise=noise, within_noise=None if noise is None else abs(p.rel_error) <= noise,
                   min_us=r.get("min_us"), max_us=r.get("max_us"), timing=r.get("timing"))
        if rid in again:
            row["repeat_rel"] = again[rid] / r["median_us"] - 1
        out.append(row)
        groups.setdefault((role, row["group"]), []).append(p.rel_error)
    hold = [r["rel_error"] for r in out if r["role"] == "holdout"]
    summary = {**_targets(_stats(hold)),
               "by_group": {f"{role}: {g}": _stats(v) for (role, g), v in sorted(groups.items())},
               "holdout_without_calibration": _stats([r["uncalibrated_rel_error"] for r in out
                                                      if r["role"] == "holdout"]),
               "uncalibrated": _stats([r["rel_error"] for r in out if r["role"] == "uncalibrated"])}
    noisy = [r for r in out if r["role"] == "holdout" and r["noise"] is not None]
    over = [r for r in out if r["role"] == "holdout" and abs(r["rel_error"]) > TARGET_MAX]
    summary["noise"] = {
        "rows_with_spread": len(noisy),
        "median_noise": statistics.median([r["noise"] for r in noisy]) if noisy else None,
        "max_noise": max([r["noise"] for r in noisy]) if noisy else None,
        "within_noise": sum(1 for r in noisy if r["within_noise"]),
        "beyond_noise": _stats([max(0.0, abs(r["rel_error"]) - r["noise"]) for r in noisy]),
        "over_max_target": [{"row_id": r["row_id"], "rel_error": r["rel_error"], "noise": r["noise"],
                             "repeat_rel": r.get("repeat_rel")} for r in over]}
    rep = [r["repeat_rel"] for r in out if r["role"] == "holdout" and "repeat_rel" in r]
    if rep:
        summary["repeat"] = _stats(rep)
    return {"rows": out, "summary": summary}


def cross_validate(measurements: dict, topo, folds: int = 3, *, gpu: str | None = None, echo=print) -> dict:
    """``folds``-fold cross-validation of the calibration at kernel level: ``folds`` calibrations from the same
    measurements, fold i holding out every ``folds``-th inner point of each curve from index i
    (``sim.calibrate.Holdout(every=folds, offset=i)``), each validated on its own held-out rows. Every inner point of
    every curve is held out exactly once (end points are always fitted), so the result does not depend on which
    points one hold-out happens to hit (a kernel switch, a protocol change). Returns ``{"folds": [per-fold
    summaries], "rows": [held-out rows with their fold], "summary": {...}}`` (the summary as
    :func:`validate_kernels`' over all folds' rows)."""
    import tempfile

    from rackbed.sim.calibrate import Holdout, calibrate, dump_calibration, load_calibration_file

    if folds < 2:
        raise UserError(f"validate: --cross-validate needs at least 2 folds, got {folds}")
    rows, per_fold = [], []
    for i in range(folds):
        echo(f"cross-validation: fold {i + 1}/{folds}: fitting (one in {folds} inner points held out, from index {i})")
        doc = calibrate(measurements, gpu=gpu, holdout=Holdout(every=folds, offset=i))
        with tempfile.TemporaryDirectory() as d:
            path = Path(d) / "fold.yaml"
            dump_calibration(doc, path)
            res = validate_kernels(measurements, load_calibration_file(path), topo)
        held = [{**r, "fold": i} for r in res["rows"] if r["role"] == "holdout"]
        rows.extend(held)
        s = res["summary"]["holdout"]
        per_fold.append({"fold": i, **s})
        echo(f"cross-validation: fold {i + 1}/{folds}: {s['n']} held-out rows, median |error| "
             f"{s['median_abs'] * 100:.1f}%, max {s['max_abs'] * 100:.1f}%")
    groups: dict[str, list[float]] = {}
    for r in rows:
        groups.setdefault(r["group"], []).append(r["rel_error"])
    summary = {**_targets(_stats([r["rel_error"] for r in rows])), "folds": folds,
               "by_group": {g: _stats(v) for g, v in sorted(groups.items())},
               "over_max_target": [{"row_id": r["row_id"], "fold": r["fold"], "rel_error": r["rel_error"],
                                    "noise": r["noise"]}
                                   for r in sorted(rows, key=lambda r: -abs(r["rel_error"]))
                                   if abs(r["rel_error"]) > TARGET_MAX]}
    return {"folds": per_fold, "rows": rows, "summary": summary}


def print_cross_validation(res: dict, echo=print) -> None:
    sm = res["summary"]
    echo(f"{'group':52s} {'n':>5s} {'median|e|':>10s} {'p90|e|':>8s} {'max|e|':>8s}")
    for g, s in sm["by_group"].items():
        echo(f"{g[:52]:52s} {s['n']:5d} {s['median_abs'] * 100:9.1f}% {s['p90_abs'] * 100:7.1f}% "
             f"{s['max_abs'] * 100:7.1f}%")
    echo(_verdict(f"{sm['folds']}-fold cross-validation, every inner point held out once; rows", sm))
    for o in sm["over_max_target"]:
        n = "" if o["noise"] is None else f" (spread ±{o['noise'] * 100:.1f}%)"
        echo(f"  over {TARGET_MAX * 100:.0f}%: fold {o['fold'] + 1}: {o['row_id']} {o['rel_error'] * 100:+.1f}%{n}")


def validate_engine(calib, topo, args: argparse.Namespace) -> dict | None:
    """Engine level, from a real run folder (``--engine DIR``: real.json + decisions.csv + metrics.json written by
    ``rackbed real``): fit the engine's step curves on the plans not held out (every ``--holdout-every``-th plan of
    each kind is held out), report per-plan errors on the held-out ones and the re-simulated TTFT/TPOT/ITL p50/p90
    against the real run (``sim.engine_calibration``). ``--write-engine-calibration FILE`` writes the fitted file
    the simulator then uses automatically for that model and GPU. A run with a term profile (``rackbed real
    --profile-plans N``) adds the per-term attribution of the kernel-level cost model's miss
    (``sim.engine_attribution``: a table per plan kind and one line naming the terms that miss)."""
    if not getattr(args, "engine", None):
        return None
    from rackbed.sim.engine_calibration import validate_engine_run

    wc = Path(args.write_engine_calibration) if getattr(args, "write_engine_calibration", None) else None
    res = validate_engine_run(args.engine, holdout_every=args.holdout_every, write_calibration=wc)
    print(f"engine level: {res['model']} on {res['gpu']} from {res['run']} "
          f"({res['calibration']['n_plans']['fit']} plans fitted, {len(res['held_out_plans'])} held out)")
    sk = res.get("skipped") or {}
    if sk.get("deaths") or sk.get("interrupted") or sk.get("failed"):
        deaths = ", ".join(f"GPU {d['gpu']} (rank {d['rank']}) at {d['t_s']:.3f} s"
                           for d in sk.get("deaths", ()))
        failed = ", ".join(f"{n} {why}" for why, n in sorted(sk.get("failed", {}).items()))
        print(f"  rank deaths: {deaths or 'none'}; left out of the fit: {sk.get('interrupted', 0)} plans "
              f"they interrupted (no time), failed KV transfers: {failed or 'none'}; the re-simulations "
              f"meet the same deaths")
    for kind, st in res["per_plan"].items():
        if st["n"]:
            print(f"  held-out {kind:8s} n={st['n']:4d}  median |error| {st['median_abs'] * 100:6.1f}%  "
                  f"max {st['max_abs'] * 100:7.1f}%")
    ms = lambda v: "-" if v is None else f"{v * 1e3:.2f}ms"  # noqa: E731
    pct = lambda v: "-" if v is None else f"{v * 100:+.1f}%"  # noqa: E731
    print(f"  {'metric':10s} {'real':>10s} {'sim':>10s} {'error':>8s} {'uncalibrated sim':>17s}")
    for r in res["serving"]:
        print(f"  {r['metric']:10s} {ms(r['real_s']):>10s} {ms(r['sim_s']):>10s} {pct(r['rel_error']):>8s} "
              f"{ms(r['uncalibrated_sim_s']):>17s}")
    if wc:
        print(f"  wrote {wc}")
    from rackbed.sim.engine_attribution import THRESHOLD, attribute_run, print_attribution

    th = getattr(args, "attribution_threshold", None) or THRESHOLD
    res["attribution"] = att = attribute_run(args.engine, threshold=th)
    if att:
        print_attribution(att)
    else:
        print("  per-term attribution: the run recorded no term profile (rackbed real --profile-plans N)")
    return res


def print_table(res: dict, echo=print) -> None:
    echo(f"{'row':44s} {'role':12s} {'measured_us':>12s} {'sim_us':>10s} {'error':>8s} {'noise':>7s} "
         f"{'uncal_err':>9s}")
    for r in res["rows"]:
        nz = r.get("noise")
        nzs = "-" if nz is None else f"±{nz * 100:.1f}%"
        flag = " *" if r["role"] == "holdout" and abs(r["rel_error"]) > TARGET_MAX else ""
        echo(f"{r['row_id'][:44]:44s} {r['role']:12s} {r['measured_us']:12.2f} {r['predicted_us']:10.2f} "
             f"{r['rel_error'] * 100:+7.1f}% {nzs:>7s} {r['uncalibrated_rel_error'] * 100:+8.1f}%{flag}")
    echo("")
    echo(f"{'group':52s} {'n':>4s} {'median|e|':>10s} {'max|e|':>8s}")
    for g, s in res["summary"]["by_group"].items():
        echo(f"{g[:52]:52s} {s['n']:4d} {s['median_abs'] * 100:9.1f}% {s['max_abs'] * 100:7.1f}%")
    s = res["summary"]["holdout"]
    if s["n"]:
        echo(_verdict("held-out rows", res["summary"]))
        u = res["summary"]["holdout_without_calibration"]
        echo(f"same rows, first-principles model without calibration: median |error| "
             f"{u['median_abs'] * 100:.1f}%, max {u['max_abs'] * 100:.1f}%")
        nz = res["summary"].get("noise") or {}
        if nz.get("rows_with_spread"):
            b = nz["beyond_noise"]
            echo(f"measurement spread (half range of rounds) on {nz['rows_with_spread']} held-out rows: median "
                 f"±{nz['median_noise'] * 100:.1f}%, max ±{nz['max_noise'] * 100:.1f}%; errors within it: "
                 f"{nz['within_noise']}; error beyond it: median {b['median_abs'] * 100:.1f}%, "
                 f"max {b['max_abs'] * 100:.1f}%")
        elif nz:
            echo("measurement spread: not recorded (rackbed.measure/1 file: one median per row)")
        rp = res["summary"].get("repeat")
        if rp:
            echo(f"repeat measurement on {rp['n']} held-out rows: run-to-run |difference| median "
                 f"{rp['median_abs'] * 100:.1f}%, 90th percentile {rp['p90_abs'] * 100:.1f}%, max "
                 f"{rp['max_abs'] * 100:.1f}%")
        for o in nz.get("over_max_target", []):
            n = "no spread recorded" if o["noise"] is None else f"spread ±{o['noise'] * 100:.1f}%"
            if o.get("repeat_rel") is not None:
                n += f", repeat {o['repeat_rel'] * 100:+.1f}%"
            echo(f"  over {TARGET_MAX * 100:.0f}%: {o['row_id']} {o['rel_error'] * 100:+.1f}% ({n})")


def _run(args: argparse.Namespace) -> int:
    from rackbed import topology
    from rackbed.sim.calibrate import (
        calibration_for_topology,
        describe_calibration,
        load_calibration_file,
        load_measurements,
        measurement_paths,
    )

    if getattr(args, "power", None):
        return _run_power(args)
    if getattr(args, "published", None):
        return _run_published(args)
    if getattr(args, "case", None):
        raise UserError("--case: selects cases of --published; give --published too")
    wec = getattr(args, "write_engine_calibration", None)
    th = getattr(args, "attribution_threshold", None)
    if th is not None and not 0 < th < 1:
        raise UserError(f"--attribution-threshold {th}: must be between 0 and 1 (a share of the plan time)")
    for flag, f in (("--out", args.out), ("--write-engine-calibration", wec)):
        if f:  # before the work, not after it
            prepare_file(f, force=args.force, flag=flag)
    if getattr(args, "engine", None):  # before the kernel level's long table: a typo fails at once
        missing = [f for f in ENGINE_RUN_FILES if not (Path(args.engine) / f).is_file()]
        if missing:
            raise UserError(f"{args.engine}: --engine needs a `rackbed real` output folder; {', '.join(missing)} "
                            f"missing")
    topo = topology.load(args.topology)
    calib = load_calibration_file(args.calibration) if args.calibration else calibration_for_topology(topo)
    if calib is None:
        raise UserError(f"validate: no calibration for {topo.gpu_spec(topo.gpu_ids[0]).name}; pass --calibration")
    print(describe_calibration(calib))
    paths = args.measurements or measurement_paths(getattr(calib, "meta", {}) or {})
    if not paths:
        raise UserError("validate: no --measurements and the calibration names none (meta.measurements)")
    meas = load_measurements(paths)  # meta paths are relative to the repository root
    rep = load_measurements(args.repeat) if args.repeat else None
    if args.cross_validate:
        res = cross_validate(meas, topo, args.cross_validate, gpu=(getattr(calib, "meta", None) or {}).get("gpu"))
        print_cross_validation(res)
        print()
        doc = {"schema": "rackbed.validation/1", "measurements": paths, "topology": args.topology,
               "cross_validation": res}
        _write_out(args, doc)
        return 0
    res = validate_kernels(meas, calib, topo, include_fit=args.all, repeat=rep)
    print_table(res)
    print()
    doc = {"schema": "rackbed.validation/1", "calibration": getattr(calib, "path", ""), "measurements": paths,
           "repeat": args.repeat,
           "topology": args.topology, "kernel": res, "engine": validate_engine(calib, topo, args)}
    _write_out(args, doc)
    return 0


def _run_power(args: argparse.Namespace) -> int:
    """``--power FILE``: the GPU power model against measured draw (``sim.power_check``); nothing else
    runs."""
    from rackbed import topology
    from rackbed.sim.power_check import check_power, power_line, read_power_file
    from rackbed.topology.specs import GPUS

    if args.out:
        prepare_file(args.out, force=args.force, flag="--out")
    data = read_power_file(args.power, args.power_run)
    if data["gpu"] is not None:
        if data["gpu"] not in GPUS:
            raise UserError(f"{args.power}: gpu: unknown GPU {data['gpu']!r} (known: {', '.join(GPUS)})")
        spec = GPUS[data["gpu"]]
    else:
        topo = topology.load(args.topology)
        spec = topo.gpu_spec(topo.gpu_ids[0])
    res = check_power(data, spec)
    print(power_line(res))
    _write_out(args, {"schema": "rackbed.validation/1", "power_file": str(args.power), "power": res})
    return 0


def _run_published(args: argparse.Namespace) -> int:
    """``--published [FILE]``: the suite of published deployments (``sim.published``); nothing else runs."""
    from rackbed.sim.published import DEFAULT_SUITE, TOLERANCE, run_suite, table_rows

    if args.out:
        prepare_file(args.out, force=args.force, flag="--out")
    path = DEFAULT_SUITE if args.published == "-" else Path(args.published)
    head = ("case", "source", "measured", "rackbed", "error", "term")
    rows: list[tuple[str, ...]] = []

    def echo(row: dict) -> None:
        r = table_rows({"cases": [row]})[0]
        rows.append(r)
        print(f"  {r[0]}: measured {r[2]}, rackbed {r[3]} ({r[4]})", flush=True)

    doc = run_suite(path, cases=args.case, echo=echo)
    widths = [max(len(x[i]) for x in [head, *rows]) for i in range(len(head))]
    print()
    for r in [head, tuple("-" * w for w in widths), *rows]:
        print("  ".join(x.ljust(w) for x, w in zip(r, widths)).rstrip())
    within = [r for r in doc["cases"] if r["error"] is not None and abs(r["error"]) <= TOLERANCE]
    ran = [r for r in doc["cases"] if r["error"] is not None]
    print(f"\n{len(within)} of {len(ran)} simulated cases within ±{TOLERANCE * 100:.0f} %; "
          f"{len(doc['cases']) - len(ran)} refused by rackbed")
    for r in doc["cases"]:
        if r["refused"]:
            print(f"  {r['case']} (refused: {r['refused']}): {r['why']}")
        elif r["why"]:
            print(f"  {r['case']} ({r['term']}): {r['why']}")
    _write_out(args, doc)
    return 0


def _write_out(args, doc: dict) -> None:
    """The validation JSON to ``--out``, if given (an existing file only with ``--force``; atomically)."""
    if args.out:
        write_out_file(args.out, json.dumps(doc, indent=1), force=args.force)
        print(f"wrote {args.out}")


def register(subparsers) -> None:
    p = subparsers.add_parser("validate", help="simulator vs measurements: kernel level, and engine level with --engine DIR",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--measurements", nargs="+", metavar="FILE",
                   help="kernels/bench/measure.py JSON, one or several files fitted together (default: the "
                        "calibration's meta.measurements)")
    p.add_argument("--calibration", help="calibration file (default: the shipped one for the topology's GPU)")
    p.add_argument("--topology", default="h200x2", help="topology the measurements were taken on")
    p.add_argument("--all", action="store_true", help="also list the fitted rows")
    p.add_argument("--repeat", nargs="+", metavar="FILE", help="a second kernels/bench/measure.py run of the same grid "
                   "(several files: of the measurements' files): per-row run-to-run differences beside the errors")
    p.add_argument("--cross-validate", type=int, metavar="K", help="kernel level, instead of the calibration's "
                   "own hold-outs: refit K times from the measurements, fold i holding out every K-th inner point "
                   "from index i, so every inner point is held out once (slow: K fits)")
    p.add_argument("--out", help="write the validation JSON here")
    p.add_argument("--power", metavar="FILE",
                   help="instead: the GPU power model against measured draw (a JSON or YAML file of samples "
                        "{t, power_w, util?} and optional steps; sim/power_check.py), on the --topology's GPU "
                        "unless the file names one")
    p.add_argument("--power-run", metavar="DIR", help="with an nvidia-smi .csv(.gz) --power file: only the samples of "
                   "this `rackbed real` output folder's serving window")
    p.add_argument("--published", nargs="?", const="-", metavar="FILE",
                   help="instead: rackbed against published serving results, every case of a suite file "
                        "(default scenarios/published/suite.yaml; sim/published.py)")
    p.add_argument("--case", action="append", metavar="NAME",
                   help="with --published: run this case only (repeat for several)")
    add_force(p, "replace an existing --out or --write-engine-calibration file")
    p.add_argument("--engine", metavar="DIR", help="also validate at engine level from a `rackbed real` output folder")
    p.add_argument("--holdout-every", type=int, default=3, help="engine level: hold out every N-th plan of each kind")
    p.add_argument("--write-engine-calibration", metavar="FILE", help="engine level: write the fitted curves here")
    p.add_argument("--attribution-threshold", type=float, default=None, metavar="FRACTION",
                   help="engine level: name a term whose residual exceeds this share of the measured plan "
                        "time (default 0.10)")
    p.set_defaults(func=_run)
