"""Reading spec files (scenario, sweep, search, study, capacity, topology, plan, calibration, HF config) into
Python values, with one-line errors naming the file.

It sits at the bottom of the import graph so that every layer that reads a file (``sim``, the CLI) uses the same
reader without importing the layer above it. Whatever the bytes are — not UTF-8, truncated, nested deeper than the
parser can recurse, a mapping with the same key twice — the reader raises a :class:`UserError` that names the file
(and the line where the parser knows it), never a bare decoder exception.
"""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

import yaml

from rackbed.topology.errors import UserError

_BASE_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


class UniqueKeyLoader(_BASE_LOADER):
    """A safe YAML loader that rejects a mapping with the same key twice (PyYAML keeps the last one silently,
    so ``seed: 1`` followed by ``seed: 2`` would run with 2 and nobody would know)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                dup = key in seen
            except TypeError:  # an unhashable key: the base constructor reports it
                break
            if dup:
                raise yaml.constructor.ConstructorError(None, None, f"duplicate key {key!r}", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def read_text(path: str | Path, what: str = "file") -> str:
    """A text file's contents (a ``.gz`` file decompressed); ``UserError`` naming the file if it is missing,
    unreadable, not gzip (``.gz``) or not UTF-8."""
    p = Path(path)
    try:
        raw = p.read_bytes()
    except FileNotFoundError:
        raise UserError(f"{p}: no such {what}") from None
    except IsADirectoryError:
        raise UserError(f"{p}: is a directory, expected a {what}") from None
    except OSError as exc:
        raise UserError(f"{p}: cannot read {what} ({exc.strerror or exc})") from None
    if p.name.lower().endswith(".gz"):
        import gzip
        import zlib

        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError, zlib.error) as exc:
            raise UserError(f"{p}: not a gzip file ({exc})") from None
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(f"{p}: not a text file (byte {exc.start} is not UTF-8)") from None


#: deeper nesting is refused before parsing: libyaml's composer recurses in C and crashes the interpreter (a
#: segmentation fault, not an exception) at some ten thousand levels; spec files nest a handful of levels
MAX_YAML_DEPTH = 1000
_ONLY_BRACKETS = {i: None for i in range(128) if chr(i) not in "[]{}"}  # str.translate: drop the rest of ASCII
_BLOCK_RUN = re.compile(rf"(?:-[ \t]+){{{MAX_YAML_DEPTH}}}|^[ \t]{{{MAX_YAML_DEPTH}}}", re.MULTILINE)


def _nesting_bound(text: str) -> int:
    """An upper bound on the nesting depth of a YAML text, good enough to refuse crafted input: the depth of its
    flow brackets (brackets inside quoted strings count too, which only overestimates), or ``MAX_YAML_DEPTH`` + 1
    for a block structure that deep (a line of that many ``- `` indicators, or indented that far). About 0.05 s for
    the 1.4 MB shipped calibration file."""
    if ("- - " in text or " " * MAX_YAML_DEPTH in text) and _BLOCK_RUN.search(text):
        return MAX_YAML_DEPTH + 1
    if text.count("[") + text.count("{") <= MAX_YAML_DEPTH:
        return text.count("[") + text.count("{")  # cannot nest deeper than it has openers
    steps = [1 if c in "[{" else -1 if c in "]}" else 0 for c in text.translate(_ONLY_BRACKETS)]
    return max(itertools.accumulate(steps, lambda depth, step: max(depth + step, 0)), default=0)


def parse_yaml(text: str, path: str | Path):
    """Parse YAML text read from ``path`` (duplicate keys rejected); one-line errors naming the file and line."""
    if _nesting_bound(text) > MAX_YAML_DEPTH:
        raise UserError(f"{path}: nested too deeply to parse (more than {MAX_YAML_DEPTH:,} levels)")
    try:
        return yaml.load(text, Loader=UniqueKeyLoader)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1} column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or " ".join(str(exc).split())
        raise UserError(f"{path}: invalid YAML{where}: {problem}") from None
    except RecursionError:
        raise UserError(f"{path}: nested too deeply to parse") from None


def parse_json(text: str, path: str | Path):
    """Parse JSON text read from ``path``; one-line errors naming the file and line."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise UserError(f"{path}: invalid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}") from None
    except RecursionError:
        raise UserError(f"{path}: nested too deeply to parse") from None


def load_data(path: str | Path, what: str = "file"):
    """A JSON (``.json`` or ``.json.gz``) or YAML file's parsed contents, any top-level type."""
    text = read_text(path, what)
    return parse_json(text, path) if is_json_name(path) else parse_yaml(text, path)


def is_json_name(path: str | Path) -> bool:
    """Whether ``path`` names a JSON file (``.json``, or gzip-compressed ``.json.gz``)."""
    return Path(path).name.lower().endswith((".json", ".json.gz"))


def load_yaml(path: Path) -> dict:
    """Parse a YAML spec that must be a mapping; one-line errors naming the file and line."""
    path = Path(path)
    data = parse_yaml(read_text(path), path)
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a mapping at the top level, got {type(data).__name__}")
    return data
