"""The ``rackbed`` command line.

Each subcommand lives in its own module of this package and exposes ``register(subparsers)`` (adds its parser,
sets ``func``) — modules import heavy dependencies (torch, simpy, matplotlib) inside their functions, so that
``rackbed topo show`` starts fast. User errors (``ValueError`` and friends) print one line and exit 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> module; each module defines register(subparsers).
SUBCOMMANDS = {
    "topo": "engine.cli.topo",
    "formats": "engine.cli.formats",
    "model": "engine.cli.model",
    "plan": "engine.cli.plan",
    "run": "engine.cli.run",
    "emit": "engine.cli.emit",
    "sweep": "engine.cli.sweep",
    "search": "engine.cli.search",
    "capacity": "engine.cli.capacity",
    "real": "engine.cli.real",
    "bench": "engine.cli.bench",
    "calibrate": "engine.cli.calibrate",
    "validate": "engine.cli.validate",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rackbed",
        description="Simulate and run disaggregated prefill/decode MoE serving on NVLink racks.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, modname in SUBCOMMANDS.items():
        try:
            mod = importlib.import_module(modname)
        except ModuleNotFoundError as exc:
            if exc.name == modname:  # subcommand not written yet
                continue
            raise
        mod.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from topology.errors import one_line

    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        rc = args.func(args)
    except KeyboardInterrupt:
        print("rackbed: interrupted", file=sys.stderr)
        return 130
    except (ValueError, FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError) as exc:
        # ValueError covers pydantic.ValidationError, yaml errors are wrapped by the loaders.
        print(f"rackbed: error: {one_line(exc)}", file=sys.stderr)
        return 2
    except TimeoutError as exc:  # a bounded wait ran out (engine.real.driver.RealRunStalled, measurement workers)
        print(f"rackbed: error: {one_line(exc)}", file=sys.stderr)
        return 1
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
