"""engine/core stays pure: importing it pulls in neither torch nor simpy, and its sources use no wall clock
(``time``) and no global RNG (``random``, ``numpy.random.<global function>``).

The import check runs in a fresh interpreter (this test process may already have torch loaded). The source check
parses every module with ``ast``, so it also sees imports inside functions.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "engine" / "core"
MODULES = sorted(
    "rackbed.engine.core" + ("" if p.name == "__init__.py" else "." + ".".join(p.relative_to(CORE).with_suffix("").parts))
    for p in CORE.rglob("*.py")
)
SOURCES = sorted(CORE.rglob("*.py"))
FORBIDDEN_MODULES = ("torch", "simpy", "time", "random")  # top-level names never imported by engine/core
# numpy.random attributes that create an explicitly seeded generator (allowed); everything else on
# numpy.random (np.random.rand, .seed, .shuffle, ...) uses the global RNG.
NP_RANDOM_ALLOWED = {"default_rng", "Generator", "SeedSequence", "BitGenerator", "PCG64", "PCG64DXSM", "Philox",
                     "SFC64", "MT19937"}


def test_modules_found():
    assert "rackbed.engine.core.sharding" in MODULES and "rackbed.engine.core.kv" in MODULES


def test_importing_engine_core_loads_no_torch_or_simpy():
    code = (
        "import importlib, json, sys\n"
        f"mods = {MODULES!r}\n"
        "for m in mods: importlib.import_module(m)\n"
        "print(json.dumps(sorted(k for k in ('torch', 'simpy') if k in sys.modules)))\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    loaded = json.loads(r.stdout.strip().splitlines()[-1])
    assert loaded == [], f"importing engine.core loaded {loaded}"


def violations(text: str, rel: str) -> list[str]:
    """Forbidden imports / global-RNG uses in one source text, as 'file:line: what' strings."""
    tree = ast.parse(text, filename=rel)
    out = []
    np_aliases = {"numpy"}
    np_random_aliases: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                top = a.name.split(".")[0]
                if top in FORBIDDEN_MODULES:
                    out.append(f"{rel}:{node.lineno}: import {a.name}")
                if a.name == "numpy":
                    np_aliases.add(a.asname or "numpy")
                if a.name == "numpy.random":
                    np_random_aliases.add(a.asname or "numpy.random")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            top = node.module.split(".")[0]
            if top in FORBIDDEN_MODULES:
                out.append(f"{rel}:{node.lineno}: from {node.module} import ...")
            if node.module == "numpy":
                for a in node.names:
                    if a.name == "random":
                        np_random_aliases.add(a.asname or "random")
            if node.module == "numpy.random":
                for a in node.names:
                    if a.name not in NP_RANDOM_ALLOWED:
                        out.append(f"{rel}:{node.lineno}: from numpy.random import {a.name} (global RNG)")
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            base = node.value
            # np.random.X
            if isinstance(base, ast.Attribute) and base.attr == "random" and isinstance(base.value, ast.Name) \
                    and base.value.id in np_aliases and node.attr not in NP_RANDOM_ALLOWED:
                out.append(f"{rel}:{node.lineno}: {base.value.id}.random.{node.attr} (global RNG)")
            # alias.X where alias is numpy.random
            if isinstance(base, ast.Name) and base.id in np_random_aliases and node.attr not in NP_RANDOM_ALLOWED:
                out.append(f"{rel}:{node.lineno}: {base.id}.{node.attr} (global RNG)")
    return out


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(CORE)))
def test_source_is_pure(path):
    bad = violations(path.read_text(), str(path.relative_to(ROOT)))
    assert not bad, "engine/core must not use torch, simpy, time or a global RNG:\n" + "\n".join(bad)


@pytest.mark.parametrize("snippet, n_bad", [
    ("import time\n", 1),
    ("def f():\n    import torch\n", 1),
    ("from random import choice\n", 1),
    ("import simpy.rt as rt\n", 1),
    ("import numpy as np\nx = np.random.rand(3)\n", 1),
    ("import numpy as np\nnp.random.seed(0)\nr = np.random.default_rng(0)\n", 1),
    ("from numpy import random as npr\nnpr.shuffle([1])\n", 1),
    ("from numpy.random import default_rng\nrng = default_rng(1)\n", 0),
    ("import datetime\nimport numpy as np\n", 0),
])
def test_scanner_catches_violations(snippet, n_bad):
    """The scanner itself: each forbidden use is reported, allowed ones are not."""
    bad = violations(snippet, "probe.py")
    assert len(bad) == n_bad, bad
