"""Maintainer script: the pinned serving engines' own argument definitions as committed data.

``rackbed emit`` writes command lines for SGLang, its router and Dynamo's SGLang worker. Whether a
flag exists, how many values it takes and which values it accepts is decided by each engine's argument
parser at a given version. This script downloads the pinned wheels (``pip download --no-deps``: no CUDA
stack is installed), imports the modules that build each parser with every third-party import the engines
make replaced by an inert stub (only ``msgspec``, the record library the SGLang arguments are declared
with, is real: installed into the same temporary folder), builds the parsers exactly as the engines do, and
writes what each argparse action says (its option strings, ``nargs``, kind: store / store_true / append
..., value type and choices) to ``sim/data/engine_flags.json`` with the provenance (package, version,
wheel sha256, date, command).
No code of the engines is copied: only the definitions their parsers hold.

``tests/test_emit_flags.py`` rebuilds an ``argparse`` parser from that manifest (exact option names, no
abbreviations) and parses every command line ``rackbed emit`` writes: a flag renamed or removed at the pinned
version fails CI, not the user. Run this when bumping a pin::

    python tools/engine_flags.py [--wheels DIR] [--out sim/data/engine_flags.json]

TensorRT-LLM is not extracted: its PyPI package is a stub that downloads the real wheel from NVIDIA's own
index, which this script does not reach (see docs/DEPLOY.md for what is checked for TensorRT-LLM instead).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import hashlib
import json
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PINS = {"sglang": "0.5.23", "sglang-router": "0.3.2", "ai-dynamo": "1.6.1"}
HELPERS = ("msgspec",)  # real (not stubbed) while the parsers are built
OUT = Path(__file__).resolve().parents[1] / "sim" / "data" / "engine_flags.json"

#: parser name -> (package, the extraction to run in a fresh interpreter)
PARSERS = {
    "sglang.launch_server": "sglang",
    "sglang_router.launch_router": "sglang-router",
    "dynamo.sglang": "ai-dynamo",
}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--wheels", type=Path, default=None, help="folder of already downloaded wheels")
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--_extract", nargs=2, metavar=("PARSER", "ROOT"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args._extract:
        print(json.dumps(_extract(*args._extract)))
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        wheels = args.wheels or Path(tmp) / "wheels"
        if args.wheels is None:
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-d", str(wheels),
                            *(f"{p}=={v}" for p, v in PINS.items())], check=True)
        root = Path(tmp) / "root"
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(root),
                        *HELPERS], check=True)
        prov = {}
        for pkg, ver in PINS.items():
            whl = _wheel(wheels, pkg, ver)
            with zipfile.ZipFile(whl) as z:
                z.extractall(root)
            digest = hashlib.sha256(whl.read_bytes()).hexdigest()
            prov[pkg] = {"version": ver, "wheel": whl.name, "sha256": digest}
        parsers, values = {}, {}
        for name in PARSERS:
            out = subprocess.run([sys.executable, __file__, "--_extract", name, str(root)], check=True,
                                 capture_output=True, text=True).stdout
            got = json.loads(out.strip().splitlines()[-1])
            parsers[name] = {"package": PARSERS[name], "actions": got["actions"]}
            values.update(got.get("values", {}))
    manifest = {
        "about": "argparse definitions of the pinned engines' parsers, extracted by tools/engine_flags.py "
                 "(data only: option strings, nargs, kind, type, choices)",
        "provenance": {"packages": prov, "helpers": list(HELPERS),
                       "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d"),
                       "command": "python tools/engine_flags.py", "python": sys.version.split()[0]},
        "parsers": parsers,
        "values": values,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    print(args.out)
    return 0


def _wheel(folder: Path, pkg: str, ver: str) -> Path:
    stem = pkg.replace("-", "_")
    found = sorted(folder.glob(f"{stem}-{ver}-*.whl"))
    if not found:
        raise SystemExit(f"{folder}: no wheel of {pkg}=={ver}")
    return found[0]


# ------------------------------------------------------------------------------------------------ extraction


def _extract(name: str, root: str) -> dict:
    """Build ``name``'s parser from the unpacked wheels under ``root`` (third-party imports stubbed) and
    describe every action."""
    _install_stubs(root)
    if name == "sglang.launch_server":
        from sglang.srt.server_args import ServerArgs  # type: ignore
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm  # type: ignore
        from sglang.srt.speculative.spec_registry import _RESERVED_ALIASES  # type: ignore

        p = argparse.ArgumentParser(prog="sglang.launch_server")
        ServerArgs.add_cli_args(p)
        values = {"sglang.speculative_algorithm": sorted({m.name for m in SpeculativeAlgorithm}
                                                         | set(_RESERVED_ALIASES))}
        return {"actions": _describe(p), "values": values}
    if name == "sglang_router.launch_router":
        from sglang_router import launch_router  # type: ignore

        return {"actions": _describe(_captured(launch_router.parse_router_args, []))}
    if name == "dynamo.sglang":
        from dynamo.sglang import args as dargs  # type: ignore

        return {"actions": _describe(_captured(dargs.parse_args, []))}
    raise SystemExit(f"unknown parser {name}")


class _Captured(Exception):
    def __init__(self, parser):
        self.parser = parser


def _captured(fn, argv):
    """The first parser ``fn(argv)`` parses with (its ``parse_args`` / ``parse_known_args`` never runs)."""
    import asyncio
    import inspect

    def grab(self, *a, **k):
        raise _Captured(self)

    old = argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args
    argparse.ArgumentParser.parse_args = argparse.ArgumentParser.parse_known_args = grab
    try:
        r = fn(argv)
        if inspect.iscoroutine(r):
            asyncio.run(r)
    except _Captured as c:
        return c.parser
    finally:
        argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args = old
    raise SystemExit(f"{fn.__qualname__} parsed nothing")


def _kind(a: argparse.Action) -> str:
    cls = type(a).__name__
    for base, kind in ((argparse._StoreTrueAction, "store_true"), (argparse._StoreFalseAction, "store_false"),
                       (argparse._StoreConstAction, "store_const"), (argparse._AppendAction, "append"),
                       (argparse._CountAction, "count"), (argparse._HelpAction, "help"),
                       (argparse.BooleanOptionalAction, "boolean_optional")):
        if isinstance(a, base):
            return kind
    if a.nargs == 0:
        return "store_const"
    return "append" if "Append" in cls else "store"


def _plain(v):
    return v if isinstance(v, (str, int, float, bool)) or v is None else str(v)


def _describe(p: argparse.ArgumentParser) -> list[dict]:
    out = []
    for a in p._actions:
        if not a.option_strings or not all(isinstance(o, str) for o in a.option_strings):
            continue  # positional, or named from a stubbed import (not a flag rackbed writes)
        t = a.type if isinstance(a.type, type) else None
        choices = None
        if a.choices is not None:
            choices = sorted({_plain(c) for c in a.choices}, key=str)
            if any("stub" in str(c) for c in choices):  # computed from a stubbed import: unknown
                choices = None
        out.append({"flags": sorted(a.option_strings), "dest": _plain(a.dest), "kind": _kind(a),
                    "nargs": a.nargs if a.nargs is None or isinstance(a.nargs, (int, str)) else None,
                    "type": t.__name__ if t in (int, float, str) else None, "choices": choices})
    return sorted(out, key=lambda d: d["flags"][0])


def _install_stubs(root: str) -> None:
    """Import the engines' packages from ``root``; every module they import that is neither the standard
    library, nor under ``root``, nor importable here becomes an inert stub (as do the engines' GPU kernel and
    platform packages, which only matter when serving)."""
    import importlib.abc
    import importlib.machinery
    import types

    sys.path[:0] = [root]
    own = {p.name for p in Path(root).iterdir() if p.is_dir()} | {p.stem for p in Path(root).glob("*.py")}
    stub_pkgs = ("sglang.srt.utils", "sglang.kernels", "sglang.srt.hardware_backend", "sglang.srt.platforms",
                 "sglang.srt.layers", "sglang.srt.lora", "dynamo._core", "dynamo.runtime", "dynamo.llm",
                 "sglang_router.sglang_router_rs", "dynamo.prometheus_names", "sglang.srt.configs",
                 "sglang.srt.sampling")

    class _Base:
        def __init_subclass__(cls, **kw):
            pass

        def __init__(self, *a, **k):
            pass

    class _Stub:
        def __init__(self, *a, **k):
            pass

        def __call__(self, *a, **k):
            return _Stub()

        def __getattr__(self, k):
            if k.startswith("__"):
                raise AttributeError(k)
            return _Stub()

        def __mro_entries__(self, bases):
            return (_Base,)

        def __iter__(self):
            return iter(())

        def __bool__(self):
            return False

        def __getitem__(self, k):
            return _Stub()

        def __len__(self):
            return 0

        def __add__(self, o):
            return o

        __radd__ = __add__

        def __or__(self, o):
            return _Stub()

        __ror__ = __or__

        def __eq__(self, o):
            return False

        def __hash__(self):
            return 0

        def __lt__(self, o):
            return False

        __gt__ = __le__ = __ge__ = __lt__

        def __int__(self):
            return 0

        def __str__(self):
            return "stub"

        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

    class _StubModule(types.ModuleType):
        __path__: list = []

        def __getattr__(self, k):
            if k.startswith("__"):
                raise AttributeError(k)
            return _Stub()

    this = __file__

    class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        def find_spec(self, name, path, target=None):
            if any(name == p or name.startswith(p + ".") for p in stub_pkgs):
                return importlib.machinery.ModuleSpec(name, self, is_package=True)
            top = name.split(".")[0]
            if top in sys.stdlib_module_names or top in own:
                return None
            if importlib.machinery.PathFinder.find_spec(top) is not None:
                return None
            f = sys._getframe(1)
            while f is not None and (f.f_code.co_filename.startswith("<frozen")
                                     or f.f_code.co_filename == this):
                f = f.f_back
            if f is None or not f.f_code.co_filename.startswith(root):
                return None  # an optional import of an installed library: let it fail as it would
            return importlib.machinery.ModuleSpec(name, self, is_package=True)

        def create_module(self, spec):
            return _StubModule(spec.name)

        def exec_module(self, m):
            pass

    sys.meta_path.insert(0, _Finder())
    for pkg in ("sglang", "sglang.srt", "dynamo"):  # their __init__ starts the serving stack: skip it
        if (Path(root) / pkg.replace(".", "/")).is_dir():
            m = _StubModule(pkg)  # attributes its __init__ would have set: stubs
            m.__path__ = [str(Path(root) / pkg.replace(".", "/"))]
            sys.modules[pkg] = m


if __name__ == "__main__":
    sys.exit(main())
