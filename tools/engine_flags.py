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

TensorRT-LLM's PyPI package is a stub that downloads the real wheel from NVIDIA's own index, which this
script does not reach. Its facts come from source text instead, read with ``ast`` (nothing of TensorRT-LLM
is imported): :func:`trtllm_click_commands` reads the ``click`` decorators of ``trtllm-serve``
(``tensorrt_llm/commands/serve.py``) and :func:`trtllm_model_fields` the field declarations of the LLM API
argument classes (``tensorrt_llm/llmapi/llm_args.py``, which the ``--extra_llm_api_options`` YAML is
validated against). ``--trtllm-serve FILE --trtllm-llm-args FILE`` (with ``--trtllm-provenance JSON``) writes
their result into the ``trtllm`` entry of the manifest, keeping the rest; the provenance names the
repository, paths, commits and the sha256 of each text parsed::

    python tools/engine_flags.py --trtllm-serve serve.py --trtllm-llm-args llm_args.py \
        --trtllm-provenance prov.json
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
    ap.add_argument("--trtllm-serve", type=Path, help="text of tensorrt_llm/commands/serve.py, or a digest")
    ap.add_argument("--trtllm-llm-args", type=Path,
                    help="text of tensorrt_llm/llmapi/llm_args.py, or a digest")
    ap.add_argument("--trtllm-provenance", type=Path, help="JSON: repository, paths, commits, version, notes")
    args = ap.parse_args(argv)
    if args._extract:
        print(json.dumps(_extract(*args._extract)))
        return 0
    if args.trtllm_serve or args.trtllm_llm_args:
        if not (args.trtllm_serve and args.trtllm_llm_args):
            raise SystemExit("--trtllm-serve and --trtllm-llm-args go together")
        prov = json.loads(args.trtllm_provenance.read_text()) if args.trtllm_provenance else {}
        manifest = json.loads(args.out.read_text()) if args.out.exists() else {}
        manifest["trtllm"] = trtllm_entry(args.trtllm_serve.read_text(), args.trtllm_llm_args.read_text(),
                                          prov)
        args.out.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
        print(args.out)
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
    if args.out.exists() and "trtllm" in (old := json.loads(args.out.read_text())):
        manifest["trtllm"] = old["trtllm"]  # read from source text, not from a wheel: kept as it is
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    print(args.out)
    return 0


# --------------------------------------------------------------------------------------------- TensorRT-LLM


def trtllm_entry(serve_text: str, llm_args_text: str, provenance: dict) -> dict:
    """The manifest's ``trtllm`` entry: ``trtllm-serve``'s commands and the LLM API argument classes, with the
    provenance given and the sha256 and date of the texts parsed."""
    prov = dict(provenance)
    prov["sha256"] = {"serve": hashlib.sha256(serve_text.encode()).hexdigest(),
                      "llm_args": hashlib.sha256(llm_args_text.encode()).hexdigest()}
    prov.setdefault("date", _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d"))
    return {"provenance": prov, "commands": trtllm_click_commands(serve_text),
            "classes": trtllm_model_fields(llm_args_text), "root": "TorchLlmArgs"}


def trtllm_click_commands(text: str) -> dict:
    """``{command: {"arguments": [...], "options": [...]}}`` of every ``@click.command`` function in ``text``:
    each option's flags, destination, kind (``flag`` / ``store`` / ``multiple``), value type (``int`` /
    ``float`` / ``str``) and choices (``click.Choice`` or ``ChoiceWithAlias`` of literal strings; None when
    computed, e.g. from a registry's keys), with a ``ChoiceWithAlias``'s aliases."""
    import ast

    out = {}
    for fn in ast.walk(ast.parse(text)):
        if not isinstance(fn, ast.FunctionDef):
            continue
        name, args, opts = None, [], []
        for dec in fn.decorator_list:
            if not (isinstance(dec, ast.Call) and isinstance(dec.func, ast.Attribute)):
                continue
            what = dec.func.attr
            strs = [a.value for a in dec.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            kw = {k.arg: k.value for k in dec.keywords}
            if what == "command":
                name = strs[0] if strs else fn.name
            elif what == "argument":
                args.append(strs[0])
            elif what == "option":
                flags = [x for x in strs if x.startswith("-")]
                dest = next((x for x in strs if not x.startswith("-")), None)
                if dest is None:
                    dest = max(flags, key=len).lstrip("-").replace("-", "_")
                kind = "flag" if _const(kw.get("is_flag")) is True else (
                    "multiple" if _const(kw.get("multiple")) is True else "store")
                typ, choices, aliases = _click_type(kw.get("type"))
                if kind == "flag":
                    typ = None
                opts.append({"flags": flags, "dest": dest, "kind": kind, "type": typ, "choices": choices,
                             "aliases": aliases})
        if name is not None:
            out[name] = {"arguments": args, "options": opts}  # in source order
    return out


def _const(node):
    import ast

    return node.value if isinstance(node, ast.Constant) else None


def _click_type(node):
    """(value type, literal choices, aliases) of a click ``type=``."""
    import ast

    if node is None:
        return "str", None, None
    if isinstance(node, ast.Name):
        return (node.id if node.id in ("int", "float", "str") else None), None, None
    if isinstance(node, ast.Call):
        fname = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
        if fname in ("Choice", "ChoiceWithAlias"):
            first = node.args[0] if node.args else None
            choices = None
            literal = isinstance(first, (ast.List, ast.Tuple))
            if literal and all(isinstance(e, ast.Constant) for e in first.elts):
                choices = [e.value for e in first.elts]
            aliases = None
            if fname == "ChoiceWithAlias" and len(node.args) > 1 and isinstance(node.args[1], ast.Dict):
                aliases = {_const(k): _const(v) for k, v in zip(node.args[1].keys, node.args[1].values)}
            return "str", choices, aliases
        if fname == "Path":
            return "str", None, None
    return None, None, None


#: annotation names -> the JSON kinds a value may take
_SCALARS = {"int": "int", "StrictInt": "int", "NonNegativeInt": "int", "PositiveInt": "int",
            "float": "float", "NonNegativeFloat": "float", "bool": "bool", "str": "str", "Path": "str",
            "object": "any", "Any": "any", "dict": "dict", "Dict": "dict", "list": "list", "List": "list",
            "Set": "list", "set": "list", "tuple": "list", "Tuple": "list"}


def trtllm_model_fields(text: str) -> dict:
    """``{class: {"bases": [...], "fields": {name: spec}}}`` of every class in ``text`` that declares
    annotated fields, inherited fields included (a subclass's declaration wins). A spec lists the JSON
    ``types`` a value may take (``int`` / ``float`` / ``bool`` / ``str`` / ``list`` / ``dict`` / ``null`` /
    ``any`` / ``model``),
    a ``Literal``'s ``choices``, the ``models`` (classes of this text) a mapping is validated as, a
    discriminated union's ``discriminator`` (``{"key", "models": {value: class}}``), the ``unchecked`` type
    names this text does not define and ``deprecated`` where the declaration says so (``Field(deprecated=
    ...)``). Names starting with ``_`` and ``ClassVar`` declarations are skipped; a
    ``Field(json_schema_extra={"type": ...})`` on an ``object`` annotation is read as that type."""
    import ast

    tree = ast.parse(text)
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}
    aliases = {}
    for n in tree.body:
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name) and n.value is not None:
            aliases[n.target.id] = n.value
        elif isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name):
            aliases[n.targets[0].id] = n.value
    raw, deprecated = {}, set()
    for name, c in classes.items():
        fields = {}
        for st in c.body:
            if not (isinstance(st, ast.AnnAssign) and isinstance(st.target, ast.Name)):
                continue
            fname = st.target.id
            if fname.startswith("_") or "ClassVar" in ast.unparse(st.annotation):
                continue
            ann = st.annotation
            if _kwarg(st.value, "deprecated") not in (None, False):
                deprecated.add((name, fname))
            extra = _json_schema_type(st.value)
            if extra is not None and "object" in ast.unparse(ann):
                ann = ast.parse(extra, mode="eval").body
                if "Optional" in ast.unparse(st.annotation):
                    ann = ast.parse(f"Optional[{extra}]", mode="eval").body
            fields[fname] = ann
        raw[name] = ([b.id for b in c.bases if isinstance(b, ast.Name)], fields)

    def spec(node) -> dict:
        out: dict = {"types": set()}

        def add(node):
            if isinstance(node, ast.Constant) and node.value is None:
                out["types"].add("null")
            elif isinstance(node, ast.Name):
                if node.id in _SCALARS:
                    out["types"].add(_SCALARS[node.id])
                elif node.id in raw:
                    out["types"].add("model")
                    out.setdefault("models", set()).add(node.id)
                elif node.id in aliases:
                    add(aliases[node.id])
                else:
                    out.setdefault("unchecked", set()).add(node.id)
            elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
                add(node.left)
                add(node.right)
            elif isinstance(node, ast.Subscript):
                head = node.value.id if isinstance(node.value, ast.Name) else getattr(node.value, "attr", "")
                items = node.slice.elts if isinstance(node.slice, ast.Tuple) else [node.slice]
                if head in ("Optional",):
                    out["types"].add("null")
                    add(items[0])
                elif head == "Union":
                    for i in items:
                        add(i)
                elif head == "Literal":
                    for i in items:
                        v = i.value
                        out["types"].add({bool: "bool", int: "int", float: "float", str: "str"}[type(v)])
                        out.setdefault("choices", []).append(v)
                elif head == "Annotated":
                    field = items[1] if len(items) > 1 else None
                    disc = _kwarg(field, "discriminator")
                    if disc is not None:
                        out["discriminator_key"] = disc
                    add(items[0])
                else:
                    out["types"].add(_SCALARS.get(head, "any"))
            else:
                out["types"].add("any")

        add(node)
        res = {"types": sorted(out["types"])}
        if "choices" in out:
            res["choices"] = out["choices"]
        if "models" in out:
            res["models"] = sorted(out["models"])
        if "unchecked" in out:
            res["unchecked"] = sorted(out["unchecked"])
        if "discriminator_key" in out:
            res["discriminator"] = {"key": out["discriminator_key"]}
        return res

    def flat(name, seen=()):
        bases, fields = raw[name]
        merged = {}
        for b in bases:
            if b in raw and b not in seen:
                merged.update(flat(b, (*seen, name)))
        merged.update({k: {**spec(v), **({"deprecated": True} if (name, k) in deprecated else {})}
                       for k, v in fields.items()})
        return merged

    result = {n: {"bases": raw[n][0], "fields": flat(n)} for n in raw}
    for c in result.values():  # a discriminated union: the value of its key selects the class
        for f in c["fields"].values():
            if "discriminator" in f:
                key = f["discriminator"]["key"]
                f["discriminator"]["models"] = {result[m]["fields"][key]["choices"][0]: m
                                                for m in f["models"]}
    return result


def _kwarg(call, name):
    import ast

    if isinstance(call, ast.Call):
        for k in call.keywords:
            if k.arg == name and isinstance(k.value, ast.Constant):
                return k.value.value
    return None


def _json_schema_type(value):
    import ast

    if isinstance(value, ast.Call):
        for k in value.keywords:
            if k.arg == "json_schema_extra" and isinstance(k.value, ast.Dict):
                for kk, vv in zip(k.value.keys, k.value.values):
                    if _const(kk) == "type" and isinstance(vv, ast.Constant):
                        return vv.value
    return None


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
