"""``rackbed run SCENARIO``: simulate a scenario file (serving deployment or a kernel-figure study)."""

from __future__ import annotations

import argparse
from pathlib import Path

from rackbed.topology.outputs import add_force, prepare_dir
from rackbed.topology.yamlio import load_yaml


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "run",
        help="simulate a scenario (YAML path or shipped name)",
        description="Simulate a scenario and write metrics, plots and a Perfetto trace. "
        "SCENARIO is the name of a shipped scenario (see `rackbed run --list`) or a YAML file; a name without a "
        "path separator or suffix is always the shipped one (./NAME for a file here).",
    )
    p.add_argument("scenario", nargs="?", default="nvl72-default", help="YAML file or shipped name (default: nvl72-default)")
    p.add_argument("--out", type=Path, default=None, help="output folder (default: rackbed-out/<name>)")
    add_force(p)
    p.add_argument("--seed", type=int, default=None, help="override the scenario's seed")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--list", action="store_true", help="list the shipped scenarios, one line each, and exit")
    o = p.add_argument_group("overrides of a serving scenario (default: the scenario's own; docs/SCENARIOS.md)")
    o.add_argument("--rate", type=float, metavar="R", help="arrival rate, requests/s (a trace: its replayed mean rate)")
    o.add_argument("--isl", metavar="N|LO-HI|MEAN:STD",
                   help="prompt tokens: fixed, uniform or log-normal (a trace becomes synthetic, its outputs kept)")
    o.add_argument("--osl", metavar="N|LO-HI|MEAN:STD", help="output tokens, as --isl")
    o.add_argument("--concurrency", type=int, metavar="C",
                   help="closed loop: at most C requests in flight, the next sent when one finishes (with --rate: "
                        "paced by it)")
    o.add_argument("--duration", type=float, metavar="S", help="send requests for S seconds (no request-count cap)")
    o.add_argument("--gpus", type=int, metavar="N",
                   help="resize the topology preset to N GPUs; prefiller/decoder counts scale with it")
    o.add_argument("--prefillers", type=int, metavar="N", help="prefiller groups")
    o.add_argument("--decoders", type=int, metavar="N", help="decoder groups")
    p.set_defaults(func=_main)


OVERRIDES = ("rate", "isl", "osl", "concurrency", "duration", "gpus", "prefillers", "decoders")


def overrides_of(args: argparse.Namespace) -> dict:
    """The override flags given, as :func:`sim.overrides.apply_overrides` keywords."""
    given = {k: getattr(args, k, None) for k in OVERRIDES}
    given["duration_s"] = given.pop("duration")
    return {k: v for k, v in given.items() if v is not None}


def _main(args: argparse.Namespace) -> int:
    import sys

    from rich.console import Console

    from rackbed import scenarios

    # piped output (CI logs, files) gets wide tables instead of rich's 80-column default
    console = Console(width=None if sys.stdout.isatty() else 140)
    if args.list:
        names = scenarios.available()
        width = max(map(len, names), default=0)
        for name in names:
            console.print(f"{name:<{width}}  {scenarios.summary(name)}".rstrip(), markup=False, highlight=False,
                          soft_wrap=True)
        return 0
    path = scenarios.resolve(args.scenario)
    data = load_yaml(path)
    kind = data.get("kind", "serving")
    out = args.out or Path("rackbed-out") / path.stem
    over = overrides_of(args)
    if over and kind != "serving":
        raise ValueError(f"--{next(iter(over)).split('_')[0]}: applies to serving scenarios; {path.name} is a "
                         f"{kind} file")
    if kind in ("figure", "serving_study", "serving"):
        out = prepare_dir(out, force=args.force, default=args.out is None)
    if kind == "figure":
        from rackbed.sim.figures import run_figure

        run_figure(path, out, console=console)
        console.print(f"output folder: {out}")
        return 0
    if kind == "serving_study":
        from rackbed.sim.serving_figures import run_serving_study

        run_serving_study(path, out, console=console, progress=not args.no_progress)
        console.print(f"output folder: {out}")
        return 0
    if kind == "serving":
        from rackbed.sim.scenario import run_serving

        metrics = run_serving(path, out, console=console, seed=args.seed, progress=not args.no_progress,
                              overrides=over)
        console.print(f"output folder: {out}")
        return _stalled_status(metrics)
    raise ValueError(f"{path}: kind: expected 'serving', 'figure' or 'serving_study', got {kind!r}")


def _stalled_status(metrics: dict) -> int:
    """1 (with one line on stderr) when requests ended ``stalled`` — open with nothing left to happen, a scheduler
    bug the run made visible — else 0."""
    import sys

    n = metrics.get("requests", {}).get("rejected_by_reason", {}).get("stalled", 0)
    if n:
        print(f"rackbed: error: {n} requests ended stalled (open when nothing was left to happen: a scheduler bug; "
              "see decisions.csv)", file=sys.stderr)
        return 1
    return 0
