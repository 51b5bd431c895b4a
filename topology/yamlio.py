"""Reading a YAML spec file (scenario, sweep, search, study, capacity) into a mapping, with one-line errors.

It sits at the bottom of the import graph so that every layer that reads a spec (``sim``, the CLI) uses the same
reader without importing the layer above it.
"""

from __future__ import annotations

from pathlib import Path


def load_yaml(path: Path) -> dict:
    """Parse a YAML spec; one-line errors naming the file and line."""
    import yaml

    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f":{mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or "not valid YAML"
        raise ValueError(f"{path}{where}: {problem}") from None
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not a text file") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
    return data
