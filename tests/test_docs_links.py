"""Every relative link in the front-door documentation resolves: README.md, docs/, the module READMEs and the
results/ index point at files that exist, and a ``#fragment`` names a heading of the file it points into (GitHub's
anchor rule). Pure text; runs in well under a second."""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted({ROOT / "README.md", *ROOT.glob("docs/*.md"), *ROOT.glob("*/README.md"), *ROOT.glob("*/*/README.md"),
               *ROOT.glob("results/**/*.md")})
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~)")


def _links(text: str) -> list[tuple[int, str]]:
    """(line number, target) of every Markdown link outside fenced code blocks and inline code."""
    out, fenced = [], False
    for n, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line.strip()):
            fenced = not fenced
            continue
        if fenced or line.startswith("    "):
            continue
        out += [(n, m.group(1)) for m in LINK.finditer(re.sub(r"`[^`]*`", "", line))]
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, inline markup and punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", lambda m: m.group(1) or "", heading.strip()).lower()
    kept = "".join(c for c in text if c in " -_" or unicodedata.category(c)[0] in "LN")
    return kept.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """The anchors of a Markdown file's headings (duplicates numbered as GitHub does)."""
    seen: dict[str, int] = {}
    out, fenced = set(), False
    for line in path.read_text().splitlines():
        if FENCE.match(line.strip()):
            fenced = not fenced
        m = None if fenced else re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            s = slug(m.group(1))
            k = seen.get(s, 0)
            seen[s] = k + 1
            out.add(s if k == 0 else f"{s}-{k}")
    return out


def test_slug_follows_github():
    assert slug("Kernel level (`calibration/h200.yaml`)") == "kernel-level-calibrationh200yaml"
    assert slug("Decode dispatch / combine over peer memory") == "decode-dispatch--combine-over-peer-memory"
    assert slug("Engine level (2×H200)") == "engine-level-2h200"


def test_the_checked_files_include_the_front_door():
    names = {p.relative_to(ROOT).as_posix() for p in DOCS}
    assert {"README.md", "docs/ARCHITECTURE.md", "docs/SCENARIOS.md", "kernels/README.md"} <= names


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve(doc: Path):
    bad = []
    for n, target in _links(doc.read_text()):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        path, _, frag = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        if not dest.exists():
            bad.append(f"{doc.relative_to(ROOT)}:{n}: {target}: no such file")
        elif frag and dest.suffix == ".md" and frag not in anchors(dest):
            bad.append(f"{doc.relative_to(ROOT)}:{n}: {target}: no heading with anchor #{frag}")
    assert not bad, "\n".join(bad)
