"""The ``SCENARIO`` argument of ``rackbed run`` and ``rackbed emit``: a shipped scenario's name or a file's path.

A bare name (no path separator, no ``.yaml`` / ``.yml`` / ``.json`` suffix) is the shipped scenario of that name,
whatever the working directory holds: ``rackbed emit nvl72-default`` reads ``scenarios/nvl72-default.yaml`` even
beside a folder or file called ``nvl72-default``. Anything else is a path (``./nvl72-default``, ``my.yaml``,
``runs/x.yaml``), and so is a bare name no scenario ships under (a file here without a suffix). Paths go through
:func:`rackbed.scenarios.resolve` (its one-line errors: no such file, a directory, an unknown name).
"""

from __future__ import annotations

import os
from pathlib import Path

SUFFIXES = (".yaml", ".yml", ".json")


def is_bare_name(arg: str) -> bool:
    """Whether ``arg`` names a shipped scenario rather than a path (module docstring)."""
    seps = {"/", os.sep, *((os.altsep,) if os.altsep else ())}
    return (bool(arg) and arg not in (".", "..") and not any(s in arg for s in seps)
            and not arg.lower().endswith(SUFFIXES))


def resolve_scenario(arg: str | Path) -> Path:
    """The scenario file ``arg`` names: a bare name the shipped scenario of that name when there is one, else (and
    for every other argument) the path, through :func:`rackbed.scenarios.resolve`."""
    from rackbed import scenarios

    text = str(arg)
    if isinstance(arg, str) and is_bare_name(text):
        for cand in (scenarios.HERE / f"{text}.yaml", scenarios.HERE / f"{text}.yml"):
            if cand.is_file():
                return cand
    return scenarios.resolve(arg)
