"""``rackbed bench TARGET``: benchmarks. Targets are a table (name -> runner); add one with a function below.

    rackbed bench kernels [--suite allreduce] [--sizes 8K 1M 128M] [--dtypes bf16 fp32] [--out results/x.json]
    rackbed bench sim [--sim-s 3600] [--rate 20] [--out results/bench_sim.json]
    rackbed bench sim --racks 1,2,5,10,100 [--sim-s 300] [--baseline REV] [--group-racks 10] [--jobs 2]
        [--out results/x.json] [--figure x.png]

``kernels`` runs kernel suites (kernels/bench/suites.py) on the local GPUs, prints a table with the baseline ratios
and writes a results JSON. ``sim`` times the simulator on a fully loaded GB200 NVL72 (sim/bench.py) and prints
simulated seconds per wall second, events/s and decode steps/s as JSON. Heavy imports (torch) happen inside the
runner.
"""

from __future__ import annotations

import argparse


def _run_kernels(args: argparse.Namespace) -> int:
    from rackbed.kernels.bench.suites import SUITES, config_from_args, load_suites, run_suites

    load_suites()  # the MoE suites register on import: "all registered" must see them
    names = args.suite or sorted(SUITES)
    cfg = config_from_args(args.sizes, args.dtypes, args.reps, not args.no_check, args.impls)
    run_suites(names, cfg, out=args.out)
    return 0


def _run_sim(args: argparse.Namespace) -> int:
    from rackbed.sim.bench import run_cli

    return run_cli(args)


# target name -> (help, runner); another target adds an entry here and its options in register()
TARGETS = {
    "kernels": ("device kernel benchmarks (all-reduce, MoE decode/prefill grouped GEMM, dispatch/combine, MX) on the "
                "local GPUs", _run_kernels),
    "sim": ("simulator speed: one simulated hour of a loaded GB200 NVL72 (Qwen3-235B, Mooncake trace)", _run_sim),
}


def _run(args: argparse.Namespace) -> int:
    from rackbed.topology.outputs import prepare_file

    if args.out:  # before the benchmark, not after it
        prepare_file(args.out, force=args.force)
    if getattr(args, "figure", None):
        prepare_file(args.figure, force=args.force)
    return TARGETS[args.target][1](args)


def register(subparsers) -> None:
    from rackbed.topology.outputs import add_force

    p = subparsers.add_parser("bench", help="run benchmarks",
                              description="Run benchmarks. Targets: " +
                              "; ".join(f"{k}: {v[0]}" for k, v in TARGETS.items()))
    p.add_argument("target", choices=sorted(TARGETS), help="what to benchmark")
    g = p.add_argument_group("kernels")
    g.add_argument("--suite", action="append", help="kernel suite (repeatable; default: all registered)")
    g.add_argument("--sizes", nargs="+", help="message sizes, e.g. 8K 1M 128MiB (default: 8 KiB..128 MiB, x2)")
    g.add_argument("--dtypes", nargs="+", help="bf16 and/or fp32 (default: bf16)")
    g.add_argument("--impls", nargs="+", help="subset of implementations to time (default: all)")
    g.add_argument("--reps", type=int, default=15, help="timed repetitions per point (median reported)")
    g.add_argument("--no-check", action="store_true", help="skip the device correctness check")
    g = p.add_argument_group("sim")
    g.add_argument("--sim-s", type=float, default=3600.0, help="simulated seconds (default: one hour)")
    g.add_argument("--rate", type=float, default=None,
                   help="requests/s of the looped Mooncake trace (default: sim.bench.DEFAULT_RATE_PER_S); "
                   "with --racks, per rack")
    g.add_argument("--racks", help="rack curve: comma-separated rack counts, e.g. 1,2,5,10 (the one-rack "
                   "layout and rate times N on gb200-nvl72*N, each point in a fresh process; CPU-s per "
                   "simulated hour, events, us per event)")
    g.add_argument("--baseline", metavar="REV", help="with --racks: measure git revision REV too (its tree "
                   "unpacked into a temporary folder), point by point, and report the speed-up and whether "
                   "results are identical")
    g.add_argument("--group-racks", type=int, metavar="G",
                   help="with --racks: a point of more than G racks (default 10) runs as independent groups "
                   "of at most G racks (each its own deployment, fabric and arrivals), reported summed")
    g.add_argument("--jobs", type=int, metavar="J",
                   help="with --racks: groups of one point run J processes at a time (default: CPU count)")
    g.add_argument("--figure", metavar="PNG", help="with --racks: plot the curve (CPU-s per simulated hour and us "
                   "per event against racks) into PNG")
    p.add_argument("--out", help="write the results JSON here (e.g. results/h200x2/allreduce.json)")
    add_force(p, "replace an existing --out file")
    p.set_defaults(func=_run)
