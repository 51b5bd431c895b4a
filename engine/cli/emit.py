"""``rackbed emit SCENARIO --engine sglang|trtllm|dynamo|k8s --out DIR``: a scenario's deployment as real
engines' launch settings (``sim.emit``)."""

from __future__ import annotations

import argparse
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    from rackbed.sim.emit import ENGINES
    from rackbed.topology.outputs import add_force

    p = sub.add_parser(
        "emit", help="write a scenario's deployment as SGLang / TensorRT-LLM / Dynamo / Kubernetes launch files",
        description="Write launch commands and configs of a real serving engine (or Kubernetes objects) for a "
                    "serving scenario's deployment (prefill/decode groups, TP/EP/DP, batch caps, chunk size, MTP). "
                    "See docs/DEPLOY.md.")
    p.add_argument("scenario", nargs="?", default="nvl72-default",
                   help="shipped scenario name (see `rackbed run --list`) or YAML file; a name without a path "
                        "separator or suffix is always the shipped one (./NAME for a file here; default: "
                        "nvl72-default)")
    p.add_argument("--engine", required=True, help=f"one of {', '.join(ENGINES)}")
    p.add_argument("--out", type=Path, default=None, help="output folder (default: rackbed-out/<name>/<engine>)")
    add_force(p)
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    from rackbed import scenarios
    from rackbed.sim.emit import ENGINES, check_emittable, write_emit
    from rackbed.sim.scenario import load_scenario
    from rackbed.topology.errors import UserError
    from rackbed.topology.outputs import prepare_dir

    if args.engine not in ENGINES:  # before loading anything
        raise UserError(f"--engine {args.engine}: unknown engine; one of {', '.join(ENGINES)}")
    path = scenarios.resolve(args.scenario)
    sc = load_scenario(path)
    check_emittable(sc, path)  # before the output folder is made
    out = prepare_dir(args.out or Path("rackbed-out") / path.stem / args.engine, force=args.force,
                      default=args.out is None)
    for p in write_emit(sc, args.engine, out, source=path):
        print(p)
    return 0
