"""Figures a sweep spec asks for (``figures: [NAME, ...]``), drawn from its records after ``rackbed sweep`` runs it.

Each entry of :data:`FIGURES` is ``fn(spec, points, records, out_dir) -> [files written]``; it reads every point's
expanded scenario (``SweepPoint.scenario``, by key) for what the point is and the record's ``summary`` for what it
measured, so a re-run of a finished sweep (every point skipped) redraws the figures from the results file.

``prefix_cache``: a prefix-cache study (``scenarios/sweeps/prefix-cache-*.yaml``): points that differ in prefill
routing policy, ``prefix_cache.hbm_gb_per_gpu`` (cache off = 0) and the host tier (on = the topology's default,
off = ``host_gb_per_gpu: 0``). Writes ``prefix_cache.csv`` (one row a point) and ``prefix_cache.png``: hit rate,
TTFT p50 and TTFT p90 against the HBM cache size, a line per policy, solid with the host tier and dashed without;
the cache-off point is shared by both.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from rackbed.topology.outputs import replacing, write_text

POLICY_ORDER = ("kv_aware", "least_queued_tokens", "round_robin", "random")
CSV_COLUMNS = ("topology", "policy", "cache", "hbm_gb_per_gpu", "host_tier", "prefix_hit_rate", "prefix_hbm_hit_rate",
               "prefix_tokens_saved", "prompt_tokens", "ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "tpot_p50_s",
               "util_prefill", "prefix_load_wait_s", "done", "requests", "key")


def prefix_cache_rows(points: Sequence, records: Sequence[Mapping]) -> list[dict]:
    """One row per ``ok`` record: what the point is (from its scenario) and what it measured (its summary and the
    prefix-cache metrics); sorted by policy, host tier and cache size."""
    scen = {p.key: p.scenario for p in points}
    rows = []
    for r in records:
        sc = scen.get(r.get("key"))
        if r.get("status") != "ok" or sc is None:
            continue
        pc, s = sc.get("prefix_cache") or {}, r.get("summary") or {}
        on = bool(pc.get("enabled"))
        host = pc.get("host_gb_per_gpu")
        m = (r.get("metrics") or {}).get("prefix_cache") or {}
        rows.append({
            "topology": sc.get("topology"), "policy": sc["sim"]["policies"]["prefiller"],
            "cache": "on" if on else "off", "hbm_gb_per_gpu": float(pc.get("hbm_gb_per_gpu", 0)) if on else 0.0,
            "host_tier": ("off" if host == 0 else "on") if on else "-",
            "prefix_hit_rate": s.get("prefix_hit_rate", 0.0) if on else 0.0,
            "prefix_hbm_hit_rate": s.get("prefix_hbm_hit_rate", 0.0) if on else 0.0,
            "prefix_tokens_saved": s.get("prefix_tokens_saved", 0) if on else 0,
            "prompt_tokens": m.get("prompt_tokens"),
            **{k: s.get(k) for k in ("ttft_p50_s", "ttft_p90_s", "ttft_p99_s", "tpot_p50_s", "util_prefill",
                                     "done", "requests")},
            "prefix_load_wait_s": s.get("prefix_load_wait_s", 0.0) if on else 0.0, "key": r["key"]})
    order = {p: i for i, p in enumerate(POLICY_ORDER)}
    rows.sort(key=lambda x: (order.get(x["policy"], 99), x["policy"], x["host_tier"], x["hbm_gb_per_gpu"]))
    return rows


def _csv(rows: Sequence[Mapping]) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=CSV_COLUMNS, lineterminator="\n")
    w.writeheader()
    for r in rows:
        w.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in r.items() if k in CSV_COLUMNS})
    return buf.getvalue()


def prefix_cache_figures(spec, points: Sequence, records: Sequence[Mapping], out_dir: str | Path) -> list[Path]:
    """``prefix_cache.csv`` and ``prefix_cache.png`` in ``out_dir`` (module docstring); nothing without ok points."""
    rows = prefix_cache_rows(points, records)
    if not rows:
        return []
    out_dir = Path(out_dir)
    files = [write_text(out_dir / "prefix_cache.csv", _csv(rows))]

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted({r["hbm_gb_per_gpu"] for r in rows})
    xpos = {s: i for i, s in enumerate(sizes)}   # evenly spaced: the sizes are a geometric series
    policies = sorted({r["policy"] for r in rows}, key=lambda p: (POLICY_ORDER.index(p) if p in POLICY_ORDER else 99, p))
    colors = dict(zip(POLICY_ORDER, ("tab:red", "tab:blue", "tab:green", "tab:gray")))
    host_label = "Grace tier" if any(str(r["topology"]).startswith("gb") for r in rows) else "host tier"
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.4), dpi=80)
    panels = (("prefix_hit_rate", "hit rate (% of prompt tokens)", 100.0, False),
              ("ttft_p50_s", "TTFT p50 (s)", 1.0, True), ("ttft_p90_s", "TTFT p90 (s)", 1.0, True))
    for ax, (col, ylabel, scale, logy) in zip(axes, panels):
        for pol in policies:
            off = [r for r in rows if r["policy"] == pol and r["cache"] == "off"]
            for tier, ls in (("on", "-"), ("off", "--")):
                pts = off + [r for r in rows if r["policy"] == pol and r["host_tier"] == tier]
                pts = [r for r in sorted(pts, key=lambda r: r["hbm_gb_per_gpu"]) if r.get(col) is not None]
                if len(pts) < 2 and not any(r["cache"] == "on" for r in pts):
                    continue
                ax.plot([xpos[r["hbm_gb_per_gpu"]] for r in pts], [r[col] * scale for r in pts], ls, marker="o",
                        ms=3, lw=1.2, color=colors.get(pol), label=f"{pol}, {host_label} {tier}")
        ax.set_xticks(range(len(sizes)), ["off" if s == 0 else f"{s:g}" for s in sizes])
        ax.set_xlabel("HBM cache per GPU (GB)")
        ax.set_ylabel(ylabel)
        if logy:
            from matplotlib.ticker import FuncFormatter

            ax.set_yscale("log")
            ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}" if f"{v:g}"[0] in "25" else ""))
        ax.grid(True, which="both", lw=0.3, alpha=0.5)
    axes[0].legend(fontsize=6, loc="upper left")
    fig.suptitle(spec.description or spec.name, fontsize=9)
    fig.tight_layout()
    png = out_dir / "prefix_cache.png"
    with replacing(png, "wb") as f:
        fig.savefig(f, format="png", metadata={"Software": None})
    plt.close(fig)
    files.append(png)
    return files


FIGURES: dict[str, Callable[..., list[Path]]] = {"prefix_cache": prefix_cache_figures}


def draw(spec, points: Sequence, records: Sequence[Mapping], out_dir: str | Path) -> list[Path]:
    """Every figure ``spec.figures`` names, into ``out_dir``."""
    files: list[Path] = []
    for name in spec.figures:
        files += FIGURES[name](spec, points, records, out_dir)
    return files
