"""rackbed: simulate and run disaggregated prefill/decode serving of MoE LLMs on NVLink racks.

Everything installs under this one import name: ``rackbed.topology``, ``rackbed.engine`` (``core``, ``real``, ``cli``),
``rackbed.sim``, ``rackbed.kernels``, and the shipped data ``rackbed.scenarios`` and ``rackbed.calibration``. In the
repository those are the top-level folders beside this one (``pyproject.toml`` maps them); an installed wheel puts
them inside it. Shipped data is found with :func:`shipped`, never by a path relative to the source tree.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

# A source checkout keeps the subpackages beside this folder, an installed wheel inside it: in a checkout, let the
# package see them too, so `python -m rackbed.…` runs from the repository root without installing (e.g. on a GPU
# machine without a package index). An installed package has no pyproject.toml beside it and is left alone.
_checkout = Path(__file__).resolve().parent.parent
if (_checkout / "pyproject.toml").is_file() and (_checkout / "engine" / "core").is_dir():
    __path__.append(str(_checkout))


def shipped(package: str, *parts: str) -> Path:
    """The folder (or file) ``parts`` of shipped data package ``package`` (``"calibration"``, ``"scenarios"``,
    ``"rackbed.engine.core"`` …), wherever rackbed is installed. Wheels install unzipped, so this is a real path."""
    return Path(str(files(f"rackbed.{package}").joinpath(*parts)))
