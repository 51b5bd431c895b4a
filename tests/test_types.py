"""The type check: mypy over the whole package (``[tool.mypy]`` in pyproject.toml), against a baseline of
error counts per file (``tests/data/mypy_baseline.json``) that may only shrink.

A file whose count grows above its baseline (or a file not in the baseline that has errors) fails the test;
that file's messages are printed. When counts shrink the test passes and says how to record the new baseline::

    python tests/test_types.py --refresh

Counts, not messages, are recorded, so moving lines does not disturb the baseline. mypy keeps its incremental
cache in ``.mypy_cache/`` at the repository root: a cold check takes 35-60 s on two cores, a warm one about a
second.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BASELINE = ROOT / "tests" / "data" / "mypy_baseline.json"
REFRESH = "python tests/test_types.py --refresh"
_ERROR = re.compile(r"^(?P<path>[^:\s]+\.pyi?):\d+(?::\d+)?: error: ")


def error_counts(report: str) -> Counter[str]:
    """Errors per file in mypy's normal output (notes are not errors)."""
    return Counter(m["path"] for line in report.splitlines() if (m := _ERROR.match(line)))


def run_mypy() -> tuple[str, Counter[str]]:
    """mypy over the package as pyproject.toml configures it, run from the repository root: report, counts."""
    from mypy import api

    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        out, err, status = api.run(["--cache-dir", str(ROOT / ".mypy_cache"), "--no-error-summary",
                                    "--hide-error-context", "--no-pretty", "--no-color-output"])
    finally:
        os.chdir(cwd)
    if status not in (0, 1) or err.strip():
        raise RuntimeError(f"mypy did not run (exit {status}): {err.strip() or out.strip()}")
    return out, error_counts(out)


def grown(baseline: dict[str, int], counts: Counter[str]) -> dict[str, tuple[int, int]]:
    """Files whose count exceeds the baseline: path -> (baseline, now)."""
    return {p: (baseline.get(p, 0), n) for p, n in sorted(counts.items()) if n > baseline.get(p, 0)}


def test_error_counts_parse():
    report = ("rackbed/a.py:3: error: x  [attr-defined]\n"
              "rackbed/a.py:3: note: y\n"
              "rackbed/a.py:9:5: error: z  [arg-type]\n"
              "rackbed/b/c.py:1: error: w  [misc]\n")
    assert error_counts(report) == {"rackbed/a.py": 2, "rackbed/b/c.py": 1}
    assert grown({"rackbed/a.py": 2}, error_counts(report)) == {"rackbed/b/c.py": (0, 1)}
    assert grown({"rackbed/a.py": 1, "rackbed/b/c.py": 1}, error_counts(report)) == {"rackbed/a.py": (1, 2)}


@pytest.mark.slow
def test_mypy_counts_do_not_grow():
    pytest.importorskip("mypy")
    baseline = json.loads(BASELINE.read_text())["errors"]
    report, counts = run_mypy()
    worse = grown(baseline, counts)
    if worse:
        lines = [line for line in report.splitlines() if (m := _ERROR.match(line)) and m["path"] in worse]
        pytest.fail("mypy errors grew: "
                    + ", ".join(f"{p} {b} -> {n}" for p, (b, n) in worse.items()) + "\n" + "\n".join(lines))
    shrunk = {p: (b, counts.get(p, 0)) for p, b in baseline.items() if counts.get(p, 0) < b}
    if shrunk:
        total = f"{sum(baseline.values())} -> {sum(counts.values())}"
        print(f"mypy errors shrank in {len(shrunk)} files ({total}); record the new baseline: `{REFRESH}`")


def main(argv: list[str]) -> int:
    if argv != ["--refresh"]:
        print(f"usage: {REFRESH}", file=sys.stderr)
        return 2
    _, counts = run_mypy()
    BASELINE.write_text(json.dumps({"total": sum(counts.values()), "errors": dict(sorted(counts.items()))},
                                   indent=1) + "\n")
    print(f"{BASELINE.relative_to(ROOT)}: {sum(counts.values())} errors in {len(counts)} files")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
