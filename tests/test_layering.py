"""Imports run one way: topology <- engine/core <- engine/loop <- sim, engine/real <- engine/cli, engine/bench;
kernels import nothing above engine/core. The check parses every module with ``ast`` and counts every
form of import: ``import rackbed.sim``, ``from rackbed import sim``, ``from rackbed.sim import x``, relative
imports (``from .. import sim``) resolved against the file's package, and the string literal given to
``importlib.import_module`` / ``__import__`` / ``runpy.run_module``; imports inside functions count too.
Every module of the packages is in a layer. Mutation tests write a module importing across the layering, in
each form, into a scratch tree and check it is caught, and that allowed imports and mere mentions of a
layer's name are not.

``KNOWN`` lists the imports that still cross the layering, each with why; the list may only shrink: an entry that
no longer occurs fails the test until it is removed here, so a fix is recorded, and a new crossing fails at once.
It is empty: every import follows the layering.
"""

from __future__ import annotations

import ast
import tempfile
from functools import lru_cache
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

ROOT = Path(__file__).resolve().parents[1]

#: layer -> the layers it may import (besides itself)
ALLOWED = {
    "topology": set(),
    "scenarios": {"topology"},
    "engine/core": {"topology"},
    # the event loop both executors run on (SimPy's environment, the run loop): where simpy enters
    "engine/loop": {"topology", "engine/core"},
    # device code and its references; kernels/bench (benchmarks, measurement, probes) is part of this layer
    "kernels": {"topology", "engine/core"},
    "sim": {"topology", "engine/core", "engine/loop", "scenarios"},
    # the real engine: given the simulator's loop by its caller (engine/real/driver.py), never imports sim
    "engine/real": {"topology", "engine/core", "engine/loop", "kernels"},
    # the top: the `rackbed` commands (and the torchrun entry), and the real engine's measurement tools
    "engine/cli": {"topology", "engine/core", "engine/loop", "kernels", "sim", "engine/real", "scenarios"},
    "engine/bench": {"topology", "engine/core", "engine/loop", "kernels", "sim", "engine/real", "scenarios"},
}
PREFIXES = tuple(sorted(((f"rackbed.{layer.replace('/', '.')}", layer) for layer in ALLOWED),
                        key=lambda p: -len(p[0])))  # the deepest layer a module name falls in

#: (file, imported layer) still crossing, and why
KNOWN: dict[tuple[str, str], str] = {}


def _layer(module: str) -> str | None:
    for prefix, layer in PREFIXES:
        if module == prefix or module.startswith(prefix + "."):
            return layer
    return None


def _resolve(package: list[str], level: int, module: str | None) -> str | None:
    """``from {'.' * level}{module} import …`` in a module of ``package``, as an absolute name (None: above
    the top)."""
    if level > len(package):
        return None
    return ".".join([*package[:len(package) - level + 1], *([module] if module else [])])


#: calls that import the module named by their first argument: ``importlib.import_module(name, package)``,
#: ``__import__(name)``, ``runpy.run_module(name)``, however the function was imported
DYNAMIC = {"import_module", "__import__", "run_module"}


def _literal_prefix(node: ast.expr) -> str | None:
    """A string literal, or the literal head of an f-string up to its last dot (``f"rackbed.sim.{x}"`` ->
    ``rackbed.sim``): the part of a computed module name that is known."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
        head = str(node.values[0].value)
        return head.rpartition(".")[0] or None
    return None


def _dynamic_name(node: ast.Call, package: list[str]) -> str | None:
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
    if name not in DYNAMIC or not node.args:
        return None
    target = _literal_prefix(node.args[0])
    if not target or not target.startswith("."):
        return target
    # a relative name: against the ``package`` argument when it is a literal, else against the file's own
    # package (``import_module(".x", __package__)``, the only other spelling that works)
    anchor = node.args[1] if len(node.args) > 1 else \
        next((k.value for k in node.keywords if k.arg == "package"), None)
    literal = isinstance(anchor, ast.Constant) and isinstance(anchor.value, str)
    base = anchor.value.split(".") if literal else package
    level = len(target) - len(target.lstrip("."))
    return _resolve(base, level, target[level:] or None)


def imported_names(path: Path, rel: str) -> list[str]:
    """Every module name a file imports, in every form: ``import a.b``, ``from a import b`` (``a`` and
    ``a.b``: ``from rackbed import sim`` imports the simulator), relative imports resolved against the file's
    package, and the string literal a dynamic import is given (``importlib.import_module("rackbed.sim.x")``,
    ``__import__``, ``runpy.run_module``; relative names too). Imports inside functions and under
    ``if TYPE_CHECKING:`` count."""
    package = ["rackbed", *Path(rel).parent.parts]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=rel)):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(package, node.level, node.module) if node.level else node.module
            if base:
                out += [base, *(f"{base}.{a.name}" for a in node.names if a.name != "*")]
        elif isinstance(node, ast.Call) and (name := _dynamic_name(node, package)):
            out.append(name)
    return out


def crossings(root: Path = ROOT) -> set[tuple[str, str]]:
    """(file, imported layer) for every import against the layering in the tree at ``root``."""
    out = set()
    for layer in ALLOWED:
        for path in sorted((root / layer).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            if any(rel.startswith(other + "/") and other != layer and len(other) > len(layer) for other in ALLOWED):
                continue  # a file of a deeper layer (engine/core under engine) is checked as that layer
            for name in imported_names(path, rel):
                target = _layer(name)
                if target and target != layer and target not in ALLOWED[layer]:
                    out.add((rel, target))
    return out


@lru_cache(maxsize=1)
def _repository_crossings() -> frozenset[tuple[str, str]]:
    """:func:`crossings` of the repository, parsed once for the two tests that read it."""
    return frozenset(crossings())


def test_imports_run_one_way():
    new = sorted(_repository_crossings() - set(KNOWN))
    assert not new, f"imports against the layering (file, imported layer): {new}"


def test_known_crossings_still_exist():
    """A crossing that was fixed leaves KNOWN, so the list records only what is left to fix."""
    gone = sorted(set(KNOWN) - _repository_crossings())
    assert not gone, f"fixed: remove from KNOWN: {gone}"


def test_every_module_is_in_a_layer():
    """A new package folder gets a layer (and so a check)."""
    tops = {layer.split("/")[0] for layer in ALLOWED}
    outside = sorted(rel for top in tops for p in (ROOT / top).rglob("*.py")
                     if not any((rel := p.relative_to(ROOT).as_posix()).startswith(layer + "/") for layer in ALLOWED))
    assert not outside, f"modules in no layer (add the folder to ALLOWED): {outside}"


def test_device_code_does_not_import_its_benchmarks():
    """kernels/bench measures kernels/; the device code and its references never import the benchmarks."""
    bad = [f"kernels/{path.name}: {name}" for path in sorted((ROOT / "kernels").glob("*.py"))
           for name in imported_names(path, f"kernels/{path.name}")
           if name == "rackbed.kernels.bench" or name.startswith("rackbed.kernels.bench.")]
    assert not bad, bad


# Mutation tests: a file that imports across the layering, in each form, written into a scratch tree laid out
# like the repository's, is caught by the same check.

def _forms(rel: str, target: str) -> dict[str, str]:
    """Module sources that import layer ``target`` from the file ``rel``, one per import form."""
    dotted = target.replace("/", ".")
    mod = f"rackbed.{dotted}"
    parent, _, last = mod.rpartition(".")
    up = "." * (len(Path(rel).parent.parts) + 1)  # the relative prefix that reaches ``rackbed``
    between = parent.removeprefix("rackbed").lstrip(".")
    return {
        "import": f"import {mod}\n",
        "import submodule as": f"import {mod}.x as y\n",
        "from parent import layer": f"from {parent} import {last}\n",
        "from layer import": f"from {mod} import x\n",
        "from submodule import": f"from {mod}.x import y\n",
        "relative from parent import layer": f"from {up}{between} import {last}\n",
        "relative from layer import": f"from {up}{dotted} import x\n",
        "importlib.import_module": f"import importlib\nimportlib.import_module('{mod}.x')\n",
        "from importlib import import_module":
            f"from importlib import import_module\nimport_module('{mod}')\n",
        "import_module f-string":
            f"import importlib\n\n\ndef f(n):\n    return importlib.import_module(f'{mod}.{{n}}')\n",
        "import_module relative":
            f"import importlib\nimportlib.import_module('{up}{dotted}', __package__)\n",
        "import_module relative, literal package":
            f"import importlib\nimportlib.import_module('.{dotted}', 'rackbed')\n",
        "__import__": f"__import__('{mod}')\n",
        "runpy.run_module": f"import runpy\nrunpy.run_module('{mod}.x')\n",
        "inside a function": f"def f():\n    from {mod} import x\n    return x\n",
        "under TYPE_CHECKING": f"from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import {mod}\n",
    }


def _scratch_crossings(root: Path, rel: str, source: str) -> set[tuple[str, str]]:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(source)
    return crossings(root)


FORMS = sorted(_forms("engine/core/mutant.py", "sim"))


@pytest.mark.parametrize("form", FORMS)
def test_each_import_form_is_caught(form, tmp_path):
    """engine/core importing the simulator, in every form (``from rackbed import sim``, ``from ... import
    sim``, ``importlib.import_module("rackbed.sim.x")`` …), is a crossing; and topology's ``from .. import
    sim``."""
    rel = "engine/core/mutant.py"
    assert _scratch_crossings(tmp_path, rel, _forms(rel, "sim")[form]) == {(rel, "sim")}
    rel = "topology/mutant.py"
    assert _scratch_crossings(tmp_path / "t", rel, _forms(rel, "sim")[form]) == {(rel, "sim")}


def test_allowed_imports_and_mere_mentions_are_not_crossings(tmp_path):
    """The control: imports the layering allows, and the name of another layer in a docstring or a plain
    string, are no crossing (the check is not one that fails on anything)."""
    rel = "engine/core/mutant.py"
    source = ('"""Priced by ``rackbed.sim.costs``; see rackbed.sim."""\n'
              "from rackbed import topology\nfrom rackbed.topology import errors\nfrom . import kv\n"
              "from .. import core\nimport importlib\nimportlib.import_module('rackbed.topology.errors')\n"
              "NAME = 'rackbed.sim.driver'\nprint(NAME)\n")
    assert _scratch_crossings(tmp_path, rel, source) == set()


LAYERS = sorted(ALLOWED)


@settings(max_examples=150, deadline=None, derandomize=True)
@given(source=st.sampled_from(LAYERS), target=st.sampled_from(LAYERS), form=st.sampled_from(FORMS),
       depth=st.integers(0, 2))
def test_a_crossing_is_caught_iff_the_layering_forbids_it(source, target, form, depth):
    """Any layer importing any other, in any form, from a file at any depth below its folder: a crossing
    exactly when ALLOWED does not list the imported layer."""
    rel = "/".join([source, *["zz"] * depth, "mutant.py"])
    with tempfile.TemporaryDirectory() as tmp:
        found = _scratch_crossings(Path(tmp), rel, _forms(rel, target)[form])
    expected = set() if target == source or target in ALLOWED[source] else {(rel, target)}
    assert found == expected
