"""Scenario files shipped with rackbed (package data), addressed by path or by name.

``resolve("fig_allreduce")`` finds ``scenarios/fig_allreduce.yaml``; ``resolve("my/file.yaml")`` returns that path.
"""

from __future__ import annotations

import os
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


#: suffixes that make an argument a path, never a shipped name
SUFFIXES = (".yaml", ".yml", ".json")


def is_bare_name(arg: str) -> bool:
    """Whether a command-line ``arg`` names a shipped scenario rather than a path: no path separator, no
    ``.yaml`` / ``.yml`` / ``.json`` suffix."""
    seps = {"/", os.sep, *((os.altsep,) if os.altsep else ())}
    return (bool(arg) and arg not in (".", "..") and not any(s in arg for s in seps)
            and not arg.lower().endswith(SUFFIXES))


def resolve(name_or_path: str | Path) -> Path:
    """A scenario file path from a shipped name or a path; one-line ValueError when neither exists.

    A bare name (a ``str`` for which :func:`is_bare_name` holds) is the shipped scenario of that name whatever the
    working directory holds: ``nvl72-default`` reads the shipped file even beside a folder or file called
    ``nvl72-default``. Anything else is a path (``./nvl72-default``, ``my.yaml``, ``runs/x.yaml``, a ``Path``), and
    so is a bare name no scenario ships under. Every command that takes a scenario resolves it here."""
    if isinstance(name_or_path, str) and is_bare_name(name_or_path):
        for cand in (HERE / f"{name_or_path}.yaml", HERE / f"{name_or_path}.yml"):
            if cand.is_file():
                return cand
    p = Path(name_or_path)
    if p.suffix in SUFFIXES or p.exists():
        if not p.exists():
            raise FileNotFoundError(f"{p}: no such scenario file")
        if p.is_dir():
            raise ValueError(f"{p}: is a directory, expected a scenario YAML file")
        return p
    names = ", ".join(available()) or "(none yet)"
    raise ValueError(f"unknown scenario {str(name_or_path)!r}; shipped scenarios: {names}")
