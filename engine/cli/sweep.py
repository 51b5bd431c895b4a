"""``rackbed sweep SPEC``: simulate a grid / list of scenarios in parallel (resumable) and report the Pareto front.

    rackbed sweep scenarios/sweeps/small.yaml --out out/small --jobs 2
    rackbed sweep SPEC --ray-address ray://head:10001      # Ray tasks instead of local processes (needs ray)
    rackbed sweep --bench                                   # the 1,000-point benchmark (points/s, 1 -> 2 procs)
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rackbed.topology.outputs import add_force, prepare_dir, safe_name


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "sweep",
        help="simulate many scenarios from a sweep spec (parallel, resumable) -> Pareto report",
        description="Expand a sweep spec (grid / points over dotted scenario fields), simulate the points in "
        "parallel processes (or on Ray), append results to DIR/results.jsonl as they finish (a re-run skips "
        "done points), then write DIR/report.md, report.html and pareto.png (and the figures the spec's `figures` "
        "list names, e.g. prefix_cache.png / .csv).",
    )
    p.add_argument("spec", nargs="?", help="sweep spec YAML (or a name under scenarios/sweeps/)")
    p.add_argument("--out", type=Path, default=None, help="output folder (default rackbed-out/sweep-<name>)")
    add_force(p, "write into an existing, non-empty --out folder that is not a sweep's (one holding "
              "results.jsonl is resumed without it)")
    p.add_argument("--jobs", "-j", type=int, default=None, help="worker processes (default: CPU count)")
    p.add_argument("--ray-address", default=None, help="run on this Ray cluster (needs `ray` installed)")
    p.add_argument("--start-method", choices=("spawn", "fork", "forkserver"), default="spawn",
                   help="multiprocessing start method for local workers (default spawn)")
    p.add_argument("--point-limit", type=float, default=None, metavar="S",
                   help="wall seconds one point may run before it is recorded as a timeout (default 3600)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--dry-run", action="store_true", help="list the expanded points and exit")
    p.add_argument("--top", type=int, default=5, help="best points to show and explain (default 5)")
    p.add_argument("--no-report", action="store_true", help="skip the Markdown / HTML report")
    p.add_argument("--bench", action="store_true",
                   help="run the benchmark: SPEC (default scenarios/sweeps/bench-1000.yaml) with 1 and --jobs "
                   "processes on a sample, then the whole spec; prints points/s and the parallel efficiency")
    p.add_argument("--bench-sample", type=int, default=200, help="points in the 1-vs-N process comparison")
    p.add_argument("--bench-no-full", action="store_true", help="skip the full-spec run of the benchmark")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    import os

    from rich.console import Console

    from rackbed.sim import sweep as sw

    console = Console() if Console().is_terminal else Console(width=160)
    jobs = args.jobs or os.cpu_count() or 1
    if args.bench:
        res = sw.bench(args.spec, out_dir=args.out, sample=args.bench_sample, jobs=max(2, jobs),
                       full=not args.bench_no_full, console=console, progress=not args.no_progress,
                       force=args.force)
        console.print(sw.format_bench(res))
        console.print(f"[dim]figures in {res['out_dir']}/bench.json[/dim]")
        return 0
    if not args.spec:
        raise ValueError("rackbed sweep: give a sweep spec (YAML), or --bench")
    spec = sw.load_sweep(args.spec)
    points = sw.expand(spec)
    if args.dry_run:
        for pt in points:
            extra = f"  [yellow]invalid: {pt.invalid_reason}[/yellow]" if pt.invalid_reason else ""
            console.print(f"{pt.index:5d} {pt.key} {pt.label}{extra}")
        console.print(f"{len(points)} points")
        return 0
    out = prepare_dir(args.out or Path("rackbed-out") / f"sweep-{safe_name(spec.name)}", force=args.force,
                      resume_marker="results.jsonl")
    console.print(f"[bold]{spec.name}[/bold]: {len(points)} points -> {out}/results.jsonl "
                  f"({'ray ' + args.ray_address if args.ray_address else f'{jobs} process(es)'})")
    run = sw.run_points(points, out / "results.jsonl", jobs=jobs, ray_address=args.ray_address,
                        progress=not args.no_progress, start_method=args.start_method, console=console,
                        limit_s=args.point_limit or sw.POINT_LIMIT_S)
    console.print(f"ran {run.ran} points in {run.wall_s:.1f} s ({run.points_per_s:.2f} points/s), skipped "
                  f"{run.skipped} already done; this run: {run.counts}")
    data = sweep_report_data(spec, points, run.records, top=args.top)
    _print_best(console, data)
    if not args.no_report:
        from rackbed.sim.report import write_report

        files = write_report(out, data)
        console.print(f"[dim]wrote {', '.join(str(f) for f in files)}[/dim]")
    if spec.figures:  # the spec's own figures (sim.sweep_figures), from every record, this run's or earlier
        from rackbed.sim.sweep_figures import draw

        figs = draw(spec, points, run.records, out)
        if figs:
            console.print(f"[dim]wrote {', '.join(str(f) for f in figs)}[/dim]")
    n_err = sum(1 for r in run.records if r.get("status") == "error")
    if n_err:
        console.print(f"[red]{n_err} point(s) failed with an internal error (see 'traceback' in the JSONL); "
                      "they are retried on the next run[/red]")
        return 1
    return 0


def sweep_report_data(spec, points, records, *, top: int = 5):
    """Eligibility (each point against its own scenario's SLOs, p90), the front, the best few with their
    StepTime breakdowns, as ``sim.report.ReportData``."""
    from rackbed.sim.report import ReportData
    from rackbed.sim.search_results import explain, front_of, meets_slo, record_slo
    from rackbed.topology.errors import one_line

    scen = {p.key: p.scenario for p in points}
    elig = [r for r in records if meets_slo(r, *record_slo(r))]
    front = front_of(elig)
    best = sorted(front, key=lambda r: -r["summary"]["tokens_per_s_per_gpu"])[:top]
    expl = {}
    for r in best:
        try:
            expl[r["key"]] = explain(scen[r["key"]], r)
        except (ValueError, FileNotFoundError) as exc:
            expl[r["key"]] = {"error": one_line(exc)}
    axes = [k for k, v in spec.grid.items() if len(v) > 1]
    return ReportData(title=f"sweep {spec.name}", intro=[spec.description, f"spec: {spec.source}",
                      "grid: " + ", ".join(f"{k} {v}" for k, v in spec.grid.items())],
                      records=list(records), eligible={r["key"] for r in elig}, front=front, best=best,
                      explanations=expl, color_by=axes[0] if axes else None,
                      notes=[("eligible = every request completed and TTFT / TPOT p90 within the point's own "
                              "slo section (no bound = always met)"),
                             ("breakdowns are the analytic StepTime of one prefill batch and one decode step at the "
                              "simulated mean batch per rank (sim.costs.step)")])


def _print_best(console, data) -> None:
    from rackbed.engine.cli.tables import print_table
    from rackbed.sim.report import best_table
    from rackbed.sim.search_results import where_time_goes

    t = best_table(data)  # a point's label is a list of knob=value words: it may wrap between them
    print_table(console, t.title, t.headers, t.rows, text=("configuration",), key=2)
    for i, r in enumerate(data.best, 1):
        ex = data.explanations.get(r["key"]) or {}
        if "prefill" in ex:
            console.print(f"  #{i} why: prefill {where_time_goes(ex['prefill'])}")
            console.print(f"       decode {where_time_goes(ex['decode'])}")
        elif "error" in ex:
            console.print(f"  #{i} why: (not explained: {ex['error']})")
