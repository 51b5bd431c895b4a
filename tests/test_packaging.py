"""rackbed installs cleanly: one import name (nothing generic at the top of site-packages), every package of the tree
in the distribution, and the shipped data (calibrations, scenarios, traces) found from an installed wheel, so an
install outside the repository runs calibrated.

The wheel test builds the wheel, installs it with its dependencies into a fresh virtual environment (not editable,
no access to this checkout), and from a folder outside the repository runs the H200 serving scenario — whose
metrics must equal a run from the checkout byte for byte, calibrated from the shipped file — and ``rackbed validate``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
SCENARIO = "i_h200_mooncake"


def _tree_packages() -> set[str]:
    """Every package (folder with ``__init__.py``) under the folders pyproject maps into the namespace."""
    out = set()
    for name, folder in PYPROJECT["tool"]["setuptools"]["package-dir"].items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder).parts
            out.add(".".join((name, *rel)))
    return out


def test_pyproject_names_every_package():
    listed = set(PYPROJECT["tool"]["setuptools"]["packages"])
    assert listed == _tree_packages(), ("pyproject [tool.setuptools] packages differs from the tree: missing "
                                        f"{sorted(_tree_packages() - listed)}, stale {sorted(listed - _tree_packages())}")


def test_everything_under_one_name():
    assert all(name == "rackbed" or name.startswith("rackbed.") for name in PYPROJECT["tool"]["setuptools"]["packages"])
    assert PYPROJECT["project"]["scripts"]["rackbed"].startswith("rackbed.")


def _run(cmd: list, cwd: Path, env: dict | None = None, timeout: int = 300) -> subprocess.CompletedProcess:
    r = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout,
                       check=False)
    assert r.returncode == 0, f"{' '.join(map(str, cmd))} -> {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    return r


@pytest.mark.slow
def test_wheel_in_fresh_venv(tmp_path):
    src, dist = tmp_path / "src", tmp_path / "dist"  # built from a copy: setuptools' build/ folder would keep stale files
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for folder in PYPROJECT["tool"]["setuptools"]["package-dir"].values():
        shutil.copytree(ROOT / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", dist, src], tmp_path)
    (wheel,) = dist.glob("rackbed-*.whl")
    tops = {n.split("/")[0] for n in zipfile.ZipFile(wheel).namelist()}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"rackbed"}, tops

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", venv], tmp_path)
    py, rackbed = venv / "bin" / "python", venv / "bin" / "rackbed"
    _run([py, "-m", "pip", "install", "-q", wheel], tmp_path, timeout=600)  # dependencies from the package index
    away = tmp_path / "elsewhere"
    away.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")} | {"MPLBACKEND": "Agg"}
    where = _run([py, "-c", "import rackbed.sim; print(rackbed.sim.__file__)"], away, env).stdout.strip()
    assert where.startswith(str(venv)), where

    run = _run([rackbed, "run", SCENARIO, "--out", tmp_path / "wheel-run"], away, env)
    assert "calibrated (rackbed stack): H200-SXM from calibration/h200.yaml" in run.stdout, run.stdout[:2000]
    _run([sys.executable, "-m", "rackbed.engine.cli.main", "run", SCENARIO, "--out", tmp_path / "checkout-run"], ROOT,
         {**os.environ, "MPLBACKEND": "Agg"})
    assert (tmp_path / "wheel-run" / "metrics.json").read_bytes() == \
        (tmp_path / "checkout-run" / "metrics.json").read_bytes()

    val = _run([rackbed, "validate"], away, env)
    assert "held-out rows:" in val.stdout and "target <= 3%: ok" in val.stdout, val.stdout[-2000:]
