"""``rackbed bench TARGET``: benchmarks. Targets are a table (name -> runner); add one with a function below.

    rackbed bench kernels [--suite allreduce] [--sizes 8K 1M 128M] [--dtypes bf16 fp32] [--out results/x.json]

``kernels`` runs kernel suites (kernels/bench.py) on the local GPUs, prints a table with the baseline ratios
and writes a results JSON. Heavy imports (torch) happen inside the runner.
"""

from __future__ import annotations

import argparse


def _run_kernels(args: argparse.Namespace) -> int:
    from kernels.bench import SUITES, config_from_args, run_suites

    names = args.suite or sorted(SUITES)
    cfg = config_from_args(args.sizes, args.dtypes, args.reps, not args.no_check, args.impls)
    run_suites(names, cfg, out=args.out)
    return 0


# target name -> (help, runner); another target (e.g. "sim") adds an entry here and its options in register()
TARGETS = {
    "kernels": ("device kernel benchmarks (all-reduce, ...) on the local GPUs", _run_kernels),
}


def _run(args: argparse.Namespace) -> int:
    return TARGETS[args.target][1](args)


def register(subparsers) -> None:
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
    p.add_argument("--out", help="write the results JSON here (e.g. results/h200x2/allreduce.json)")
    p.set_defaults(func=_run)
