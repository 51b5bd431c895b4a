"""rackbed installs cleanly: one import name (nothing generic at the top of site-packages), every package of the tree
in the distribution, and the shipped data (calibrations, scenarios, traces) found from an installed wheel, so an
install outside the repository runs calibrated.

The wheel test builds the wheel, installs it with its dependencies into a fresh virtual environment (not editable,
no access to this checkout), and from a folder outside the repository runs the H200 serving scenario — whose
metrics must equal a run from the checkout byte for byte, calibrated from the shipped file — and ``rackbed validate``.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
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
    """Every package under ``rackbed/`` (following its links to the top-level folders): a folder with
    ``__init__.py``, or one of the links themselves (namespace packages, see ``rackbed/__init__.py``)."""
    out = {"rackbed"}
    for link in (ROOT / "rackbed").iterdir():
        if link.is_symlink():
            out.add(f"rackbed.{link.name}")
    for dirpath, _dirs, files in os.walk(ROOT / "rackbed", followlinks=True):
        if "__init__.py" in files:
            out.add(".".join(Path(dirpath).relative_to(ROOT).parts))
    return out


def test_pyproject_names_every_package():
    listed = set(PYPROJECT["tool"]["setuptools"]["packages"])
    assert listed == _tree_packages(), ("pyproject [tool.setuptools] packages differs from the tree: missing "
                                        f"{sorted(_tree_packages() - listed)}, stale {sorted(listed - _tree_packages())}")


def test_everything_under_one_name():
    assert all(name == "rackbed" or name.startswith("rackbed.") for name in PYPROJECT["tool"]["setuptools"]["packages"])
    assert PYPROJECT["project"]["scripts"]["rackbed"].startswith("rackbed.")


#: folders that a launcher puts on sys.path: the root (``python -m …`` run from it, pytest's ``pythonpath``) and tests/
PATH_DIRS = (ROOT, ROOT / "tests")


def _installed_import_names() -> dict[str, list[str]]:
    """Top-level import names of every installed distribution but rackbed itself -> the distributions."""
    return {name: dists for name, dists in importlib.metadata.packages_distributions().items()
            if "rackbed" not in dists}


def test_no_checkout_folder_shadows_an_installed_package():
    """A folder of the root or of tests/ that is a regular package (has ``__init__.py``) would be imported in place of
    an installed package of the same name whenever that folder's parent is first on sys.path; Hugging Face's
    ``kernels``, which transformers imports, met the repository's ``kernels/`` that way. Such a name must be a
    namespace portion (no ``__init__.py``): the import system prefers any regular package further down the path.
    Checked twice: by the names every installed distribution provides, and by importing each of them in this process,
    whichever launcher started it (the launcher test below runs this test under each)."""
    installed = _installed_import_names()
    for parent in PATH_DIRS:
        for folder in parent.iterdir():
            if not folder.is_dir() or not folder.name.isidentifier():
                continue
            assert not ((folder / "__init__.py").exists() and folder.name in installed), (
                f"{folder.relative_to(ROOT)}/ is a regular package named like {installed.get(folder.name)}'s "
                f"'{folder.name}': remove its __init__.py or rename it")
            if folder.name in installed:
                spec = importlib.util.find_spec(folder.name)
                where = spec.origin or next(iter(spec.submodule_search_locations or []), "")
                assert spec.origin is None or not Path(where).resolve().is_relative_to(ROOT), (
                    f"import {folder.name} gives {where}, not {installed[folder.name]}'s package")


@pytest.mark.slow
def test_installed_packages_win_under_every_launcher():
    """``python -m pytest`` and ``pytest``, from the root and from tests/: the shadowing test above passes under each
    (``python -m`` puts the working directory first on sys.path; pytest adds the root and tests/)."""
    here = "tests/test_packaging.py::test_no_checkout_folder_shadows_an_installed_package"
    script = Path(sys.executable).with_name("pytest")
    launchers = [[sys.executable, "-m", "pytest"]] + ([[str(script)]] if script.exists() else [])
    for cwd, node in ((ROOT, here), (ROOT / "tests", here.removeprefix("tests/"))):
        for launcher in launchers:
            _run([*launcher, "-q", "-p", "no:randomly", node], cwd, timeout=120)


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
    for folder in ("rackbed", *(p.name for p in (ROOT / "rackbed").iterdir() if p.is_symlink())):
        shutil.copytree(ROOT / folder, src / folder, symlinks=True, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
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
    where = _run([py, "-c", "import rackbed.sim.driver as d; print(d.__file__)"], away, env).stdout.strip()
    assert where.startswith(str(venv)), where

    run = _run([rackbed, "run", SCENARIO, "--out", tmp_path / "wheel-run"], away, env)
    assert "calibrated (rackbed stack): H200-SXM from calibration/h200.yaml" in run.stdout, run.stdout[:2000]
    _run([sys.executable, "-m", "rackbed.engine.cli.main", "run", SCENARIO, "--out", tmp_path / "checkout-run"], ROOT,
         {**os.environ, "MPLBACKEND": "Agg"})
    assert (tmp_path / "wheel-run" / "metrics.json").read_bytes() == \
        (tmp_path / "checkout-run" / "metrics.json").read_bytes()

    val = _run([rackbed, "validate"], away, env)
    assert "held-out rows:" in val.stdout and "target <= 3%: ok" in val.stdout, val.stdout[-2000:]


def test_ci_runs_the_readme_test_command_in_a_fresh_venv():
    """CI sees what a new user sees: `.ci/run` makes a virtual environment of its own (no system site-packages) and
    runs, inside it, the README's test command verbatim."""
    ci = (ROOT / ".ci" / "run").read_text()
    command = ci.split("# --- README test command", 1)[1].splitlines()[1].strip()
    assert command and command in (ROOT / "README.md").read_text()
    venv_at = ci.index("python3 -m venv")
    assert "--system-site-packages" not in ci and venv_at < ci.index("activate") < ci.rindex(command)
