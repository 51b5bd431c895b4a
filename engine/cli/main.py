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
    "topo": "rackbed.engine.cli.topo",
    "formats": "rackbed.engine.cli.formats",
    "model": "rackbed.engine.cli.model",
    "plan": "rackbed.engine.cli.plan",
    "run": "rackbed.engine.cli.run",
    "emit": "rackbed.engine.cli.emit",
    "sweep": "rackbed.engine.cli.sweep",
    "search": "rackbed.engine.cli.search",
    "capacity": "rackbed.engine.cli.capacity",
    "real": "rackbed.engine.cli.real",
    "bench": "rackbed.engine.cli.bench",
    "calibrate": "rackbed.engine.cli.calibrate",
    "validate": "rackbed.engine.cli.validate",
    "trace": "rackbed.engine.cli.trace",
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
    from rackbed.topology.errors import one_line
    from rackbed.topology.outputs import release_claims

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
    except BrokenPipeError:  # the reader went away (``rackbed topo show x --json | head``): stop quietly
        _silence_stdout()
        return 141  # what a shell reports for a process killed by SIGPIPE (128 + 13)
    finally:
        release_claims()  # the output folders this command claimed (topology.outputs)
    return int(rc or 0)


def _silence_stdout() -> None:
    """Point stdout at /dev/null so that the interpreter's final flush of the closed pipe raises nothing."""
    import os

    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # captured in-process (tests): nothing to redirect
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


if __name__ == "__main__":
    sys.exit(main())
