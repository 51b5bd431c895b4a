"""Imports run one way: topology <- engine/core <- sim, engine/real <- engine/cli; kernels import nothing above
engine/core. The check parses every module with ``ast`` (imports inside functions count too).

``KNOWN`` lists the imports that still cross the layering, each with why; the list may only shrink: an entry that
no longer occurs fails the test until it is removed here, so a fix is recorded, and a new crossing fails at once.
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
    "kernels": {"topology", "engine/core"},
    "sim": {"topology", "engine/core", "scenarios"},
    "engine/real": {"topology", "engine/core", "kernels"},
    "engine/cli": {"topology", "engine/core", "kernels", "sim", "engine/real", "scenarios"},
}
PREFIXES = (("topology", "topology"), ("scenarios", "scenarios"), ("engine.core", "engine/core"),
            ("engine.real", "engine/real"), ("engine.cli", "engine/cli"), ("sim", "sim"), ("kernels", "kernels"))

#: (file, imported layer) still crossing, and why
KNOWN = {
    ("engine/real/bench_decode.py", "sim"): "the decode benchmark prints the simulator's prediction beside the step",
    ("engine/real/check_peer_a2a.py", "sim"): "the check compares the engine's dispatch with the simulator's cost",
    ("engine/real/check_tp_allreduce.py", "sim"): "the check compares the all-reduce with the simulator's cost",
    ("engine/real/driver.py", "sim"): "the real driver runs on the simulator's event loop and replays through it",
    ("engine/real/torchrun.py", "sim"): "multi-node runs build the deployment with sim.scenario and write sim.outputs",
}


def _layer(module: str) -> str | None:
    for prefix, layer in PREFIXES:
        if module == prefix or module.startswith(prefix + "."):
            return layer
    return None


def crossings() -> set[tuple[str, str]]:
    out = set()
    for layer in ALLOWED:
        for path in sorted((ROOT / layer).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if any(rel.startswith(other + "/") and other != layer and len(other) > len(layer) for other in ALLOWED):
                continue  # a file of a deeper layer (engine/core under engine) is checked as that layer
            for node in ast.walk(ast.parse(path.read_text(), filename=rel)):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                    [node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level else []
                for name in names:
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
