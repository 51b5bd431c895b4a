"""rackbed: simulate and run disaggregated prefill/decode serving of MoE LLMs on NVLink racks.

Everything imports under this one name: ``rackbed.topology``, ``rackbed.engine`` (``core``, ``loop``, ``real``,
``cli``, ``bench``), ``rackbed.sim``, ``rackbed.kernels``, and the shipped data ``rackbed.scenarios`` and
``rackbed.calibration``. In the repository those are the top-level folders beside this one, and this folder holds a
relative link to each (``rackbed/sim -> ../sim``): the package is an ordinary directory tree that Python, a wheel
build and static tools (mypy, jedi, import-graph drawers) all resolve the same way, with no import hook. An installed
wheel holds copies in place of the links.

The top-level folders ``engine``, ``sim``, ``kernels`` and ``calibration`` have no ``__init__.py`` of their own
(``rackbed.engine`` and the others are namespace packages): when the repository root is on ``sys.path``
(``python -m pytest``, ``python -m rackbed…`` run from it) they cannot shadow an installed package of the same name,
e.g. Hugging Face's ``kernels``, which transformers imports. ``tests/test_packaging.py`` checks both.

Shipped data is found with :func:`shipped`, never by a path relative to the source tree.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path


def shipped(package: str, *parts: str) -> Path:
    """The folder (or file) ``parts`` of shipped data package ``package`` (``"calibration"``, ``"scenarios"``,
    ``"engine.core"`` …), wherever rackbed is installed. Wheels install unzipped, so this is a real path. Namespace
    packages (``calibration``) are found through their one search location. The path is resolved (in a checkout,
    the top-level folder rather than the link to it under ``rackbed/``), so it compares equal to any resolved path
    into the same data."""
    spec = importlib.util.find_spec(f"rackbed.{package}")
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"rackbed.{package}: not a package")
    return Path(list(spec.submodule_search_locations)[0]).resolve().joinpath(*parts)
