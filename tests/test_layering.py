"""Imports run one way: topology <- engine/core <- engine/loop <- sim, engine/real <- engine/cli, engine/bench;
kernels import nothing above engine/core. The check parses every module with ``ast`` (imports inside functions
count too), and every module of the packages is in a layer.

``KNOWN`` lists the imports that still cross the layering, each with why; the list may only shrink: an entry that
no longer occurs fails the test until it is removed here, so a fix is recorded, and a new crossing fails at once.
It is empty: every import follows the layering.
"""

from __future__ import annotations

import ast
from pathlib import Path

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


def imported_names(path: Path, rel: str) -> list[str]:
    """Every module name a file imports, in every form: ``import a.b``, ``from a import b`` (``a`` and ``a.b``: ``from
    rackbed import sim`` imports the simulator), and relative imports resolved against the file's package."""
    package = ["rackbed", *Path(rel).parent.parts]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=rel)):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join([*package[:len(package) - node.level + 1], *([node.module] if node.module else [])]) \
                if node.level else node.module
            out += [base, *(f"{base}.{a.name}" for a in node.names)]
    return out


def crossings() -> set[tuple[str, str]]:
    out = set()
    for layer in ALLOWED:
        for path in sorted((ROOT / layer).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if any(rel.startswith(other + "/") and other != layer and len(other) > len(layer) for other in ALLOWED):
                continue  # a file of a deeper layer (engine/core under engine) is checked as that layer
            for name in imported_names(path, rel):
                    target = _layer(name)
                    if target and target != layer and target not in ALLOWED[layer]:
                        out.add((rel, target))
    return out


def test_imports_run_one_way():
    new = sorted(crossings() - set(KNOWN))
    assert not new, f"imports against the layering (file, imported layer): {new}"


def test_known_crossings_still_exist():
    """A crossing that was fixed leaves KNOWN, so the list records only what is left to fix."""
    gone = sorted(set(KNOWN) - crossings())
    assert not gone, f"fixed: remove from KNOWN: {gone}"


def test_every_module_is_in_a_layer():
    """A new package folder gets a layer (and so a check)."""
    tops = {layer.split("/")[0] for layer in ALLOWED}
    outside = sorted(rel for top in tops for p in (ROOT / top).rglob("*.py")
                     if not any((rel := p.relative_to(ROOT).as_posix()).startswith(layer + "/") for layer in ALLOWED))
    assert not outside, f"modules in no layer (add the folder to ALLOWED): {outside}"


def test_device_code_does_not_import_its_benchmarks():
    """kernels/bench measures kernels/; the device code and its references never import the benchmarks."""
    bad = []
    for path in sorted((ROOT / "kernels").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.module else []
            if isinstance(node, ast.ImportFrom) and node.module == "kernels":
                names = [f"kernels.{a.name}" for a in node.names]
            bad += [f"kernels/{path.name}: {n}" for n in names if n == "rackbed.kernels.bench" or n.startswith("rackbed.kernels.bench.")]
    assert not bad, bad
