"""Sweep / search reports: a Markdown file and a self-contained HTML file (the plot embedded as base64).

Contents: the Pareto plot (tokens/s per user on x, tokens/s per GPU on y — the write-up's "decode speed vs
throughput per GPU" axes — every simulated point, SLO-meeting ones filled, the front joined), the table of the
best points, each best point's prefill and decode StepTime breakdown (where the step time goes), optional extra
tables (e.g. the per-knob comparison of a search) and the reasons points were invalid or pruned.

``write_report(out_dir, ReportData(...)) -> [report.md, report.html, pareto.png]``.
"""

from __future__ import annotations

import base64
import html
import io
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rackbed.topology.outputs import write_bytes, write_text


@dataclass
class Table:
    title: str
    headers: list[str]
    rows: list[list[Any]]
    note: str = ""


@dataclass
class ReportData:
    """What a report shows. ``records`` are sweep records (``sim.sweep``); ``eligible`` the keys that meet the
    SLOs; ``front`` / ``best`` records on the front / the best few (best first); ``explanations``: key ->
    ``sim.search_results.explain`` dict; ``color_by``: a dotted override path to colour points by (None: one
    colour)."""

    title: str
    intro: list[str] = field(default_factory=list)
    records: list[dict] = field(default_factory=list)
    eligible: set[str] = field(default_factory=set)
    front: list[dict] = field(default_factory=list)
    best: list[dict] = field(default_factory=list)
    explanations: dict[str, dict] = field(default_factory=dict)
    color_by: str | None = None
    tables: list[Table] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


# ------------------------------------------------------------------------------------------------------------------
# Numbers


def fmt(x: Any, digits: int = 4) -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, float):
        if math.isnan(x):
            return "-"
        return f"{x:.{digits}g}"
    return str(x)


def best_table(data: ReportData) -> Table:
    """The best points: label, GPUs, tokens/s per GPU and per user, TTFT / TPOT p90, goodput, $/M tokens, tokens/s
    per kW (whole pool, facility power: ``sim.energy``)."""
    rows = []
    for i, r in enumerate(data.best, 1):
        s = r["summary"]
        rows.append([i, r.get("candidate") or compact_label(r.get("label", "")), fmt(s.get("mean_gpus"), 3),
                     fmt(s.get("tokens_per_s_per_gpu")), fmt(s.get("tokens_per_s_per_user")),
                     fmt(_ms(s.get("ttft_p90_s"))), fmt(_ms(s.get("tpot_p90_s"))), fmt(s.get("goodput_fraction"), 3),
                     fmt(s.get("cost_per_mtok_usd"), 3), fmt(s.get("tokens_per_s_per_kw"))])
    return Table("Best points (on the Pareto front)",
                 ["#", "configuration", "GPUs", "tok/s/GPU", "tok/s/user (p50)", "TTFT p90 (ms)", "TPOT p90 (ms)",
                  "goodput", "$/M tok", "tok/s/kW"], rows)


_ABBREV = (("prefill.", "P."), ("decode.", "D."), ("workload.arrival.", "load."), ("workload.", "load."),
           ("max_batch_per_rank", "bmax"), ("weight_format", "fmt"), ("mtp.draft_k", "k"))


def compact_label(label: str) -> str:
    """A sweep point label with the long dotted prefixes abbreviated (``decode.ep=16`` -> ``D.ep=16``)."""
    for a, b in _ABBREV:
        label = label.replace(a, b)
    return label


def _ms(x):
    return None if x is None else x * 1e3


def breakdown_tables(data: ReportData) -> list[Table]:
    """One table per best point: per category, seconds and share of the prefill and decode steps, plus the top
    terms of each."""
    out = []
    for i, r in enumerate(data.best, 1):
        ex = data.explanations.get(r["key"])
        if not ex or "error" in ex:
            continue
        cats = list(ex["prefill"]["by_category"])
        rows = []
        for c in cats:
            p, d = ex["prefill"]["by_category"][c], ex["decode"]["by_category"][c]
            rows.append([c, fmt(p * 1e3), f"{p / max(ex['prefill']['total_s'], 1e-30):.0%}", fmt(d * 1e3),
                         f"{d / max(ex['decode']['total_s'], 1e-30):.0%}"])
        rows.append(["total", fmt(ex["prefill"]["total_s"] * 1e3), "100%", fmt(ex["decode"]["total_s"] * 1e3),
                     "100%"])
        top_p = _top_terms(ex["prefill"])
        top_d = _top_terms(ex["decode"])
        note = (f"prefill step: {ex['prefill']['at']}; biggest terms {top_p}. "
                f"decode step: {ex['decode']['at']}; biggest terms {top_d}.")
        out.append(Table(f"#{i} {r.get('candidate') or compact_label(r.get('label', ''))}: where the step time goes",
                         ["StepTime field", "prefill (ms)", "share", "decode (ms)", "share"], rows, note))
    return out


def _top_terms(bd: Mapping, n: int = 4) -> str:
    terms = sorted(bd["terms"].items(), key=lambda kv: -kv[1])[:n]
    return ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in terms)


def invalid_table(records: Sequence[Mapping]) -> Table | None:
    """Invalid / error points grouped by reason (first 20 reasons)."""
    by: dict[tuple[str, str], list[str]] = {}
    for r in records:
        if r.get("status") in ("invalid", "error"):
            by.setdefault((r["status"], r.get("reason", "")), []).append(r.get("label", ""))
    if not by:
        return None
    rows = [[st, n_, len(labels), labels[0]] for (st, n_), labels in
            sorted(by.items(), key=lambda kv: -len(kv[1]))[:20]]
    return Table("Points not simulated (invalid: a user error from validation; error: a bug)",
                 ["status", "reason", "points", "e.g."], rows)


# ------------------------------------------------------------------------------------------------------------------
# Plot


def pareto_png(data: ReportData) -> bytes:
    """The Pareto plot as PNG bytes (matplotlib, Agg)."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    ok = [r for r in data.records if r.get("status") == "ok" and r["summary"].get("tokens_per_s_per_gpu") is not None
          and r["summary"].get("tokens_per_s_per_user") is not None]
    fig, ax = plt.subplots(figsize=(8, 5.2), dpi=110)
    groups: dict[str, list[dict]] = {}
    for r in ok:
        g = str(_override(r, data.color_by)) if data.color_by else "points"
        groups.setdefault(g, []).append(r)
    cmap = plt.get_cmap("tab10")
    for i, (g, rs) in enumerate(sorted(groups.items(), key=lambda kv: _sort_key(kv[0]))):
        col = cmap(i % 10)
        el = [r for r in rs if r["key"] in data.eligible]
        nel = [r for r in rs if r["key"] not in data.eligible]
        lab = f"{data.color_by}={g}" if data.color_by else "meets SLO"
        if el:
            ax.scatter([r["summary"]["tokens_per_s_per_user"] for r in el],
                       [r["summary"]["tokens_per_s_per_gpu"] for r in el], s=28, color=col, label=lab, zorder=3)
        if nel:
            ax.scatter([r["summary"]["tokens_per_s_per_user"] for r in nel],
                       [r["summary"]["tokens_per_s_per_gpu"] for r in nel], s=28, facecolors="none",
                       edgecolors=col, label=None if el else f"{lab} (misses SLO)", zorder=2)
    if data.front:
        fr = sorted(data.front, key=lambda r: r["summary"]["tokens_per_s_per_user"])
        ax.plot([r["summary"]["tokens_per_s_per_user"] for r in fr], [r["summary"]["tokens_per_s_per_gpu"] for r in fr],
                "-", color="black", lw=1.2, label="Pareto front", zorder=4)
    for i, r in enumerate(data.best, 1):
        ax.annotate(f"#{i}", (r["summary"]["tokens_per_s_per_user"], r["summary"]["tokens_per_s_per_gpu"]),
                    textcoords="offset points", xytext=(5, 5), fontsize=8, zorder=5)
    ax.set_xlabel("tokens/s per user (p50 of 1/TPOT)")
    ax.set_ylabel("output tokens/s per GPU (all GPUs)")
    ax.set_title(data.title, fontsize=10)
    ax.grid(True, alpha=0.3)
    if ok:
        ax.legend(fontsize=8, loc="best")
    else:
        ax.text(0.5, 0.5, "no simulated point", ha="center", va="center", transform=ax.transAxes)
    fig.text(0.99, 0.01, "hollow: misses the SLOs", ha="right", fontsize=7, color="grey")
    buf = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


def _override(r: Mapping, path: str | None):
    ov = r.get("overrides") or {}
    return ov.get(path, "-") if path else None


def _sort_key(s: str):
    try:
        return (0, float(s), "")
    except ValueError:
        return (1, 0.0, s)


# ------------------------------------------------------------------------------------------------------------------
# Writers


def _md_table(t: Table) -> str:
    lines = [f"### {t.title}", "", "| " + " | ".join(t.headers) + " |", "|" + "---|" * len(t.headers)]
    for row in t.rows:
        lines.append("| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |")
    if t.note:
        lines += ["", t.note]
    return "\n".join(lines) + "\n"


def _html_table(t: Table) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in t.headers)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>" for row in t.rows)
    note = f"<p class='note'>{html.escape(t.note)}</p>" if t.note else ""
    return f"<h3>{html.escape(t.title)}</h3><table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>{note}"


def _all_tables(data: ReportData) -> list[Table]:
    ts = [best_table(data), *breakdown_tables(data), *data.tables]
    inv = invalid_table(data.records)
    if inv:
        ts.append(inv)
    return ts


def _counts(data: ReportData) -> str:
    c: dict[str, int] = {}
    for r in data.records:
        c[r.get("status", "?")] = c.get(r.get("status", "?"), 0) + 1
    parts = ", ".join(f"{k} {v}" for k, v in sorted(c.items()))
    return (f"{len(data.records)} points ({parts}); {len(data.eligible)} meet the SLOs; "
            f"{len(data.front)} on the Pareto front")


def render_markdown(data: ReportData, png_name: str = "pareto.png") -> str:
    parts = [f"# {data.title}", "", *data.intro, "", _counts(data), "", f"![Pareto plot]({png_name})", ""]
    parts += [_md_table(t) for t in _all_tables(data)]
    if data.notes:
        parts += ["## Notes", "", *[f"- {n}" for n in data.notes], ""]
    return "\n".join(parts)


def render_html(data: ReportData, png: bytes) -> str:
    b64 = base64.b64encode(png).decode()
    style = ("body{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto;color:#222}"
             "table{border-collapse:collapse;margin:.5em 0 1.5em}td,th{border:1px solid #ccc;padding:3px 8px;"
             "text-align:right;font-size:13px}th{background:#f3f3f3}td:nth-child(2){text-align:left}"
             ".note{font-size:12px;color:#555;margin-top:-1em}img{max-width:100%}")
    intro = "".join(f"<p>{html.escape(x)}</p>" for x in data.intro if x)
    tables = "".join(_html_table(t) for t in _all_tables(data))
    notes = ("<h2>Notes</h2><ul>" + "".join(f"<li>{html.escape(n)}</li>" for n in data.notes) + "</ul>") \
        if data.notes else ""
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(data.title)}</title>"
            f"<style>{style}</style></head><body><h1>{html.escape(data.title)}</h1>{intro}"
            f"<p>{html.escape(_counts(data))}</p><img alt='Pareto plot' src='data:image/png;base64,{b64}'/>"
            f"{tables}{notes}</body></html>\n")


def write_report(out_dir: str | Path, data: ReportData) -> list[Path]:
    """Write ``report.md``, ``report.html`` (self-contained) and ``pareto.png`` into ``out_dir``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    png = pareto_png(data)
    write_bytes(out / "pareto.png", png)
    write_text(out / "report.md", render_markdown(data))
    write_text(out / "report.html", render_html(data, png))
    return [out / "report.md", out / "report.html", out / "pareto.png"]
