"""``rackbed calibrate``: measure the local GPUs, fit the cost-model curves, write a calibration file.

    rackbed calibrate [--out FILE.yaml] [--force] [--quick] [--measurements-out results/h200x2/measure.json]
                      [--from-measurements FILE ...] [--from-bench FILE ...] [--only gemm flash ...] [--dry-run]
    rackbed calibrate --from-aiconfigurator SYSTEM [--backend trtllm|sglang|vllm] [--out FILE.json]
    rackbed calibrate --engine RUN [RUN ...] --out FILE.yaml [--holdout-every 3]

Runs ``kernels/bench/measure.py`` on the local GPUs (or reads earlier measurements with ``--from-measurements``: the
``rackbed.measure/1`` format or ``/2``, graph-replayed rounds with their spread; several files of one GPU model are
fitted together, e.g. a full run and a later run of benchmarks it lacked — ``meta.measurements`` lists them and
``meta.sources`` says what each is),
adds rows from ``rackbed bench kernels --out FILE`` JSON (``--from-bench``: NCCL all-reduce rows, decode
dispatch/combine rows), fits (``sim.calibrate``: every third point of each curve is held out for ``rackbed validate``;
``--holdout-shape NxK`` also holds out whole GEMM shapes) and writes the calibration file (versioned ``meta``: device, driver, torch / CUDA /
NCCL versions, date). ``--dry-run`` measures tiny sizes on the CPU (plumbing only; the file is tagged
``CPU-DRY-RUN`` and never matches a real GPU).

``--from-aiconfigurator SYSTEM`` (``gb200``, ``h200``, ``b200``, ``gb300``, ``b300``, ``h100``, ``h800``) builds a
calibration for a serving stack from the measured per-operator tables of the aiconfigurator-core package (the
``tables`` extra: ``pip install 'rackbed[tables]'``; ``sim.perf_tables``), held-out errors per kind printed and kept
in ``meta.validation``; ``h800`` reads H100's tables, its collectives scaled to H800's NVLink by the model
(``sim.perf_tables_base.DERIVED``). It writes ``rackbed-out/calibration/<gpu>-<backend>.json`` unless ``--out``
names a file.

A measured calibration goes to ``rackbed-out/calibration/h200.yaml`` unless ``--out`` names a file, and the
measurements it writes (measured, or merged with ``--from-bench``) to ``--measurements-out`` or
``<out>_measure.json`` beside it; the raw ``--from-measurements`` files are only read. Every file follows the
output rule (``topology.outputs``): an existing file is replaced only with ``--force``, atomically, never
through a link; a file inside the shipped data (``calibration/``) is written only when named explicitly
(``--out``, ``--measurements-out``) together with ``--force``: that is how a maintainer regenerates a shipped
calibration.

``--engine RUN [RUN ...]`` writes an *engine* calibration (``sim.engine_calibration``: the real engine's step
curves, used automatically by the simulator for that model and GPU) from one or more ``rackbed real`` output
folders of one model on one GPU model, fitted together (``fit_engine``); every ``--holdout-every``-th plan of
each kind is held out and its error printed. Runs that profiled sampled plans (``rackbed real --profile-plans
N``) add the optional per-term refit ``term_fit`` (``sim.engine_attribution.fit_terms``: a scale per cost-model
term and the engine overhead as a line, per plan kind, with held-out errors); the simulator reads the
whole-step curves, not this section.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rackbed.topology.errors import UserError
from rackbed.topology.outputs import add_force, prepare_file, write_text

#: where a measured calibration goes unless --out says otherwise (never a shipped file under calibration/)
DEFAULT_OUT = "rackbed-out/calibration/h200.yaml"


def bench_rows(doc: dict, source: str) -> list[dict]:
    """Measurement rows from a ``rackbed bench kernels`` JSON (``{"suites": {name: result}}``): NCCL all-reduce
    rows (bf16, CUDA-graph replayed: device time without the host launch, as a graph-captured engine sees it)
    and decode dispatch / combine rows of ``moe_a2a`` (graph-replayed times)."""
    if not isinstance(doc, dict) or not isinstance(doc.get("suites"), dict):
        raise UserError(f"{source}: not a 'rackbed bench kernels' JSON (no 'suites' mapping)")
    rows: list[dict] = []
    ar = doc["suites"].get("allreduce") or {}
    world = ar.get("world") or ar.get("world_size") or ar.get("n_ranks")
    for r in ar.get("rows", []):
        if r.get("impl") == "nccl" and r.get("dtype", "bf16") == "bf16" and r.get("graph") and r.get("median_us"):
            if not world:
                raise UserError(f"{source}: suites.allreduce has no 'world' (number of ranks)")
            rows.append({"bench": "allreduce", "algo": "ring", "impl": "nccl", "n_ranks": int(world),
                         "size_bytes": int(r["size_bytes"]), "median_us": float(r["median_us"]), "from": source})
    a2a = doc["suites"].get("moe_a2a") or {}
    world = a2a.get("world") or a2a.get("world_size") or a2a.get("n_ranks")
    hidden = a2a.get("hidden") or a2a.get("D")
    for r in a2a.get("rows", []):
        if "T" not in r:
            continue
        if not (world and hidden):
            raise UserError(f"{source}: suites.moe_a2a needs 'world' and 'hidden' to key its rows")
        for phase_name, col in (("dispatch", "dispatch_graph_us"), ("combine", "combine_graph_us")):
            if r.get(col):
                rows.append({"bench": phase_name, "n_ranks": int(world), "hidden": int(hidden), "phase": "decode",
                             "tokens": int(r["T"]), "median_us": float(r[col]), "from": source})
    return rows


def _run_tables(args: argparse.Namespace) -> int:
    from rackbed.sim import perf_tables as pt

    out = Path(args.out) if args.out else pt.default_out(args.from_aiconfigurator, args.backend)
    if not out.name.lower().endswith((".json", ".json.gz")):
        raise UserError(f"--out {out}: a calibration built from tables is written as JSON (.json, or .json.gz "
                        "compressed)")
    prepare_file(out, force=args.force, default=args.out is None)
    doc = pt.build_calibration(args.from_aiconfigurator, args.backend, progress=lambda s: print(f"  {s}"))
    write_text(out, pt.dumps(doc))
    m = doc["meta"]
    print(f"wrote {out}: {m['gpu']} ({m['stack']} stack) from {pt.PACKAGE} {m['package_version']} "
          f"{m['system']}, {len(doc['entries'])} curves")
    for t in m["tables"]:
        print(f"  table {t['file']} ({t['framework_version']}): {t['rows_used']} of {t['rows']} rows")
    for n in m["notes"]:
        print(f"  note: {n}")
    print(f"held-out rows ({m['holdout_rule']}), |predicted / measured - 1|:")
    for line in pt.validation_table(m):
        print(f"  {line}")
    return 0


def _engine_runs(args: argparse.Namespace) -> list[tuple[Path, object, str, str]]:
    """``(folder, built scenario, GPU model, model name)`` of each ``--engine`` run, checked: a ``rackbed
    real`` folder, one model on one GPU model across them."""
    from rackbed.engine.cli.validate import ENGINE_RUN_FILES
    from rackbed.sim.scenario import build, load_scenario
    from rackbed.topology.yamlio import parse_json, read_text

    out = []
    for d in args.engine:
        d = Path(d)
        missing = [f for f in ENGINE_RUN_FILES if not (d / f).is_file()]
        if missing:
            raise UserError(f"{d}: --engine needs `rackbed real` output folders; {', '.join(missing)} "
                            f"missing")
        real = parse_json(read_text(d / "real.json", "real run file"), d / "real.json")
        if not isinstance(real, dict) or not isinstance(real.get("plans"), list) or "scenario" not in real:
            raise UserError(f"{d / 'real.json'}: not a `rackbed real` result (no 'plans' list or 'scenario')")
        b = build(load_scenario(real["scenario"]), engine_calibration=False)
        gpu = b.topology.gpu_spec((b.deployment.decoders or b.deployment.aggregated)[0].gpus[0]).name
        out.append((d, b, gpu, b.model.name))
    first = out[0]
    for d, _, gpu, model in out[1:]:
        if (gpu, model) != first[2:]:
            raise UserError(f"{d}: {model} on {gpu}, but {first[0]} is {first[3]} on {first[2]}: an engine "
                            f"calibration is for one model on one GPU model")
    return out


def _run_engine(args: argparse.Namespace) -> int:
    """``--engine RUN [RUN ...]``: fit (``sim.engine_calibration.fit_engine``), print the held-out plans'
    errors per kind, write the file."""
    import statistics

    import yaml

    from rackbed.sim.engine_calibration import fit_engine

    for flag, v in (("--from-measurements", args.from_measurements), ("--from-bench", args.from_bench),
                    ("--from-aiconfigurator", args.from_aiconfigurator), ("--dry-run", args.dry_run),
                    ("--measurements-out", args.measurements_out), ("--only", args.only)):
        if v:
            raise UserError(f"--engine fits real runs; {flag} is for kernel calibrations")
    if not args.out:
        raise UserError("--engine: name the file to write with --out (e.g. engine-<gpu>-<model>.yaml)")
    if args.holdout_every < 0 or args.holdout_every == 1:
        raise UserError(f"--holdout-every {args.holdout_every}: 0 (none) or >= 2 (1 would hold out every "
                        f"plan)")
    out = prepare_file(args.out, force=args.force)
    runs = _engine_runs(args)
    d0, b0, gpu, model = runs[0]
    cal, hold = fit_engine(d0, gpu=gpu, model=model, holdout_every=args.holdout_every,
                           kv_bytes_per_token=b0.deployment.kv_bytes_per_token, built=b0,
                           more_runs=tuple(d for d, *_ in runs[1:]))
    if len(runs) > 1:
        cal = cal.model_copy(update={"source": ", ".join(str(d) for d, *_ in runs)})
    from rackbed.sim.engine_attribution import attribute_run, fit_terms

    rows = [r for d, b, *_ in runs for r in (attribute_run(d, built=b) or {}).get("plans", ())]
    tf = fit_terms(rows, args.holdout_every) if rows else {}
    if tf:   # the runs profiled sampled plans (rackbed real --profile-plans N): the optional per-term refit
        cal = cal.model_copy(update={"term_fit": tf})
    write_text(out, yaml.safe_dump(json.loads(cal.model_dump_json()), sort_keys=False))
    print(f"engine calibration: {model} on {gpu} from {len(runs)} run(s): {cal.n_plans.get('fit', 0)} plans "
          f"fitted, {len(hold)} held out (one in {args.holdout_every} of each kind)")
    predict = {"decode": lambda p: cal.decode(p["x"]), "prefill": lambda p: cal.prefill(p["x"], p["pairs"]),
               "kv": lambda p: cal.kv(p["x"])}
    errs: dict[str, list[float]] = {}
    for p in hold:
        f = predict.get(p["kind"])
        if f is not None and p["measured_s"] > 0:
            errs.setdefault(p["kind"], []).append((f(p) - p["measured_s"]) / p["measured_s"])
    for kind, e in sorted(errs.items()):
        a = [abs(x) for x in e]
        print(f"  held-out {kind:8s} n={len(a):4d}  median |error| {statistics.median(a) * 100:6.1f}%  "
              f"max {max(a) * 100:7.1f}%")
    for kind, f in tf.items():
        h = f["held_out"]
        err = "no held-out plans" if not h["n"] else \
            f"held out n={h['n']}: median |error| {h['median_abs'] * 100:.1f}%, max {h['max_abs'] * 100:.1f}%"
        scales = ", ".join(f"{t} x{s:.3g}" for t, s in f["scales"].items())
        print(f"  per-term refit {kind:8s} ({f['n_fit']} profiled plans): {scales}; engine overhead "
              f"{f['overhead_s'][0] * 1e3:.3g} ms + {f['overhead_s'][1] * 1e3:.3g} ms per {f['x']}; {err}")
    print(f"wrote {out}")
    return 0


def _run(args: argparse.Namespace) -> int:
    if getattr(args, "engine", None):
        return _run_engine(args)
    if args.from_aiconfigurator:
        return _run_tables(args)
    # never the shipped calibration/h200.yaml by default (run from a checkout, that path is the shipped file)
    args.out = str(prepare_file(args.out or DEFAULT_OUT, force=args.force, default=args.out is None))
    # the measurements file written (measured, or merged with --from-bench, or --measurements-out asked for):
    # --measurements-out, else <out>_measure.json beside the calibration; checked now, before the work
    mpath = None
    if not args.from_measurements or args.from_bench or args.measurements_out:
        mpath = args.measurements_out or Path(args.out).with_suffix("").as_posix() + "_measure.json"
        if Path(mpath).resolve() == Path(args.out).resolve():
            raise UserError(f"--measurements-out {mpath}: is the --out file; give another file")
        mpath = str(prepare_file(mpath, force=args.force, flag="--measurements-out",
                                 default=args.measurements_out is None))
    from rackbed.sim.calibrate import (
        Holdout,
        calibrate,
        describe_calibration,
        dump_calibration,
        gpu_name_for_device,
        load_calibration_file,
        load_measurements,
        merge_measurements,
    )

    if args.from_measurements:
        docs = []
        for f in args.from_measurements:
            doc = load_measurements([f], root=Path.cwd())
            if doc.get("complete") is False:
                print(f"warning: {f}: the measurement run did not finish (partial file); fitting what it holds")
            docs.append((f, doc))
        meas = merge_measurements(docs)
        if not args.gpu:  # the GPU model comes from the file: a name it does not know is the file's mistake
            try:
                gpu_name_for_device(meas.get("env", {}).get("gpu_name", ""))
            except UserError as exc:
                raise UserError(f"{args.from_measurements[0]}: env.gpu_name: {exc}") from None
        if mpath is None:  # nothing merged: the calibration names the files it was fitted from
            mpath = args.from_measurements[0] if len(docs) == 1 else list(args.from_measurements)
    else:
        from rackbed.kernels.bench.measure import run

        meas = run(quick=args.quick, dry_run=args.dry_run, only=args.only, partial_out=mpath)
    for f in args.from_bench or []:
        from rackbed.topology.yamlio import parse_json, read_text

        meas.setdefault("rows", []).extend(bench_rows(parse_json(read_text(f, "bench file"), f), f))
    if not args.from_measurements or args.from_bench or args.measurements_out:
        write_text(mpath, json.dumps(meas, indent=1))
        print(f"measurements: {mpath} ({len(meas.get('rows', []))} rows)")
    shapes = tuple(tuple(int(v) for v in s.split("x")) for s in args.holdout_shape) if args.holdout_shape else \
        Holdout().shapes
    doc = calibrate(meas, gpu=args.gpu, holdout=Holdout(every=args.holdout_every, shapes=shapes),
                    measurements_path=mpath)
    dump_calibration(doc, args.out)
    table = load_calibration_file(args.out)
    print(describe_calibration(table))
    m = doc["meta"]
    print(f"fit rows: {m['n_fit']}; held out: {len(m['holdout'])} ({m['holdout_rule']}); "
          f"not calibrated (no kind): {len(m['not_calibrated'])}; errors: {len(m['errors'])}")
    for e in m["errors"]:
        print(f"  measurement error: {e}")
    return 0


def register(subparsers) -> None:
    p = subparsers.add_parser("calibrate", help="measure the local GPUs and write a calibration file",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="calibration file to write (.yaml or .json; default "
                   f"{DEFAULT_OUT} when measuring, rackbed-out/calibration/<gpu>-<backend>.json from tables)")
    add_force(p, "replace an existing --out / --measurements-out file (and write a shipped one named "
              "explicitly)")
    p.add_argument("--from-aiconfigurator", metavar="SYSTEM",
                   help="build the calibration of a serving stack from aiconfigurator-core's measured tables "
                        "(gb200, h200, b200, gb300, b300, h100, h800 = H100's kernels; needs the 'tables' "
                        "extra)")
    p.add_argument("--backend", default="trtllm", choices=("trtllm", "sglang", "vllm"),
                   help="the serving stack whose tables to read (default: %(default)s)")
    p.add_argument("--quick", action="store_true", help="every other size, fewer repeats")
    p.add_argument("--dry-run", action="store_true", help="tiny sizes on CPU tensors (plumbing test)")
    p.add_argument("--only", nargs="+", help="subset of kernels/bench/measure.py benchmarks")
    p.add_argument("--measurements-out", help="where to write the measurements JSON (measured, or merged "
                   "with --from-bench; default <out>_measure.json)")
    p.add_argument("--from-measurements", nargs="+", metavar="FILE",
                   help="fit earlier kernels/bench/measure.py JSON instead of measuring (several files of one GPU "
                        "model: fitted together)")
    p.add_argument("--from-bench", action="append", help="add rows from 'rackbed bench kernels --out' JSON")
    p.add_argument("--gpu", help="GPU model name for the entries (default: from the device name)")
    p.add_argument("--holdout-every", type=int, default=3, help="hold out every Nth point of each curve "
                   "(0: none); with --engine, every Nth plan of each kind")
    p.add_argument("--holdout-shape", nargs="*", help="GEMM shapes NxK held out entirely, predicted by the per-format fallback (default: none; "
                        "`--holdout-shape 4096x8192` measures the fallback on the O projection)")
    p.add_argument("--engine", nargs="+", metavar="RUN", help="write an engine calibration fitted from these "
                   "`rackbed real` output folders (one model, one GPU model) to --out")
    p.set_defaults(func=_run)


if __name__ == "__main__":
    import sys

    from rackbed.engine.cli.main import main

    sys.exit(main(["calibrate", *sys.argv[1:]]))
