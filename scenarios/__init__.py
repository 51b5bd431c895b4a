"""Scenario files shipped with rackbed (package data), addressed by path or by name.

``resolve("fig_allreduce")`` finds ``scenarios/fig_allreduce.yaml``; ``resolve("my/file.yaml")`` returns that path.
"""

from __future__ import annotations

from pathlib import Path

from rackbed import shipped

HERE = shipped("scenarios")


def available() -> list[str]:
    """Names of the shipped scenarios (files directly in this folder)."""
    return sorted(p.stem for p in HERE.glob("*.yaml"))


def summary(name: str) -> str:
    """One line about a shipped scenario for ``rackbed run --list``: its ``description`` (serving scenarios), else its
    ``title`` (figures and studies), else the first sentence of its ``claim``; whitespace folded to single spaces."""
    from rackbed.topology.yamlio import load_yaml

    data = load_yaml(HERE / f"{name}.yaml")
    for key in ("description", "title", "claim"):
        text = data.get(key)
        if isinstance(text, str) and text.strip():
            line = " ".join(text.split())
            return line.split(". ")[0] if key == "claim" else line
    return ""


def resolve(name_or_path: str | Path) -> Path:
    """A scenario file path from a path or a shipped name; one-line ValueError when neither exists."""
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml", ".json") or p.exists():
        if not p.exists():
            raise FileNotFoundError(f"{p}: no such scenario file")
        if p.is_dir():
            raise ValueError(f"{p}: is a directory, expected a scenario YAML file")
        return p
    for cand in (HERE / f"{name_or_path}.yaml", HERE / f"{name_or_path}.yml"):
        if cand.exists():
            return cand
    names = ", ".join(available()) or "(none yet)"
    raise ValueError(f"unknown scenario {str(name_or_path)!r}; shipped scenarios: {names}")
