"""Files of a run: metrics JSON, per-request CSV, decision log CSV, timeline CSV, PNG plots, Perfetto trace.

``write_all(result, out_dir)`` writes

- ``metrics.json``   — :func:`engine.core.metrics.summarize` plus the step-time breakdown and NIC utilisation;
  sorted keys, floats rounded to 10 significant digits: byte-identical for the same seed;
- ``perf.json``      — wall time, events/s (machine dependent, kept apart from the metrics);
- ``requests.csv``   — one row per request (``ROW_FIELDS``; times in seconds, 9 decimals);
- ``decisions.csv``  — the decision log;
- ``timeline.csv``   — GPUs per role and requests per stage over time;
- ``trace.json``     — Chrome trace event format (opens in ui.perfetto.dev): one process per group (prefiller
  group, decoder group), one thread per worker (prefill compute, KV streams, decode), ``"X"`` spans for every
  prefill batch, KV transfer and decode step, ``ts``/``dur`` in µs;
- ``ttft_tpot_cdf.png``, ``gpus_by_role.png``, ``queues.png``.

matplotlib is imported inside the plotting function (Agg backend), so importing this module stays cheap.
"""

from __future__ import annotations

import csv
import io
import json
import math
from pathlib import Path

import numpy as np

from rackbed.engine.core.metrics import clean, request_arrays
from rackbed.sim.driver import SPAN_NAMES, SimResult
from rackbed.topology.outputs import replacing, write_text

#: spans beyond this many are left out of trace.json (the UI stays responsive); the metrics keep everything
TRACE_MAX_EVENTS = 300_000


def metrics_document(result: SimResult) -> dict:
    """The deterministic metrics document written to ``metrics.json``."""
    m = dict(result.metrics)
    m["breakdown_s"] = result.breakdown_s
    m["nic_utilisation"] = result.nic_utilisation
    m["run"] = {"seed": result.seed, "sim_end_s": result.sim_end_s, "deployment": result.deployment.name,
                "decisions": len(result.log)}
    return clean(m)


def metrics_json(result: SimResult) -> str:
    return json.dumps(metrics_document(result), sort_keys=True, indent=1) + "\n"


def _fmt(x) -> str:
    if isinstance(x, float):
        return "" if math.isnan(x) else f"{x:.9f}"
    return str(x)


def requests_csv(result: SimResult) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(result.row_fields)
    for row in sorted(result.rows, key=lambda r: r[0]):
        w.writerow([_fmt(x) for x in row])
    return buf.getvalue()


def timeline_csv(result: SimResult) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    fields = ("t_s", "gpus_prefill", "gpus_decode", "gpus_starting", "queued_prefill", "prefilling", "kv",
              "queued_decode", "decoding")
    w.writerow(fields)
    for s in result.samples:
        w.writerow([_fmt(getattr(s, f)) for f in fields])
    return buf.getvalue()


def perfetto_trace(result: SimResult, max_events: int = TRACE_MAX_EVENTS) -> dict:
    """Chrome trace JSON object: pid per group, tid per worker, "X" spans (µs)."""
    pids: dict[str, int] = {}
    tids: dict[str, tuple[int, int]] = {}
    meta: list[dict] = []

    def ids(worker: str) -> tuple[int, int]:
        got = tids.get(worker)
        if got is not None:
            return got
        group, _, sub = worker.partition(".")
        if group not in pids:
            pids[group] = len(pids) + 1
            meta.append({"ph": "M", "name": "process_name", "pid": pids[group], "tid": 0,
                         "args": {"name": group}})
            meta.append({"ph": "M", "name": "process_sort_index", "pid": pids[group], "tid": 0,
                         "args": {"sort_index": pids[group]}})
        tid = 1 if not sub else 2 + int(sub[2:] or 0) if sub.startswith("kv") else 1
        tids[worker] = (pids[group], tid)
        meta.append({"ph": "M", "name": "thread_name", "pid": pids[group], "tid": tid,
                     "args": {"name": worker if sub else f"{group} compute"}})
        return tids[worker]

    events = []
    arg_names = ("tokens", "request", "step", "step")
    for worker, kind, start_s, dur_s, arg, failed in result.spans[:max_events]:
        pid, tid = ids(worker)
        ev = {"ph": "X", "name": SPAN_NAMES[kind], "cat": SPAN_NAMES[kind], "pid": pid, "tid": tid,
              "ts": round(start_s * 1e6, 3), "dur": round(dur_s * 1e6, 3), "args": {arg_names[kind]: arg}}
        if failed:
            ev["args"]["failed"] = True
        events.append(ev)
    return {"traceEvents": meta + events, "displayTimeUnit": "ms",
            "otherData": {"spans_total": len(result.spans), "spans_written": len(events)}}


#: a CDF's x axis goes logarithmic when 90 % of the values sit in the first 1/LOG_X_SPREAD of a linear axis
LOG_X_SPREAD = 10.0


def squashed(x: np.ndarray) -> bool:
    """Whether a linear axis squashes the CDF of ``x``: all positive and p90 < max / ``LOG_X_SPREAD`` (a long
    tail would leave the body a sliver at the left)."""
    if x.size < 2 or not np.all(x > 0):
        return False
    return bool(np.percentile(x, 90) * LOG_X_SPREAD < np.max(x))


def plot_cdf(ax, x: np.ndarray, name: str, slo: float | None = None) -> None:
    """The empirical CDF of ``x`` on ``ax``; the SLO (same unit) as a dashed line with the fraction meeting it;
    a log x axis where the body would be squashed (:func:`squashed`)."""
    if x.size:
        xs = np.sort(x)
        ax.plot(xs, np.arange(1, xs.size + 1) / xs.size)
        if squashed(xs):
            ax.set_xscale("log")
    if slo is not None:
        met = float(np.mean(x <= slo)) if x.size else float("nan")
        ax.axvline(slo, color="tab:red", ls="--", lw=1, label=f"SLO {slo:g}: {met:.1%} meet it")
        ax.legend(loc="lower right", fontsize=8)
    ax.set_xlabel(name)
    ax.set_ylabel("CDF")
    ax.grid(alpha=0.3, which="both")


def _save(plt, fig, p: Path) -> Path:
    """Save ``fig`` as PNG ``p`` atomically and close it."""
    with replacing(p, "wb") as f:
        fig.savefig(f, format="png", dpi=110, metadata={"Software": None})
    plt.close(fig)
    return p


def plot_all(result: SimResult, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    a = request_arrays(result.rows, result.row_fields)
    done = a["status"] == "done"
    ttft = (a["first_token_s"] - a["arrival_s"])[done]
    multi = done & (a["output_tokens"] > 1)
    tpot = ((a["end_s"] - a["first_token_s"])[multi] / (a["output_tokens"][multi] - 1))

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    gp = result.metrics.get("goodput", {})
    slo_ttft, slo_tpot = gp.get("slo_ttft_s"), gp.get("slo_tpot_s")
    plot_cdf(axes[0], ttft, "TTFT (s)", slo_ttft)
    plot_cdf(axes[1], tpot * 1e3, "TPOT (ms)", slo_tpot * 1e3 if slo_tpot is not None else None)
    fig.suptitle(f"{result.deployment.name}: {int(done.sum())} requests done")
    fig.tight_layout()
    p = out / "ttft_tpot_cdf.png"
    paths.append(_save(plt, fig, p))

    t = np.array([s.t_s for s in result.samples])
    fig, ax = plt.subplots(figsize=(8, 3.5))
    for f, lab in (("gpus_prefill", "prefill"), ("gpus_decode", "decode"), ("gpus_starting", "starting")):
        ax.step(t, [getattr(s, f) for s in result.samples], where="post", label=lab)
    ax.set_xlabel("time (s)")
    ax.set_ylabel("GPUs")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    p = out / "gpus_by_role.png"
    paths.append(_save(plt, fig, p))

    fig, ax = plt.subplots(figsize=(8, 3.5))
    for f in ("queued_prefill", "prefilling", "kv", "queued_decode", "decoding"):
        ax.plot(t, [getattr(s, f) for s in result.samples], label=f)
    ax.set_xlabel("time (s)")
    ax.set_ylabel("requests")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    p = out / "queues.png"
    paths.append(_save(plt, fig, p))
    return paths


def write_all(result: SimResult, out_dir: str | Path, *, plots: bool = True,
              trace_max_events: int = TRACE_MAX_EVENTS) -> dict[str, Path]:
    """Write every output file into ``out_dir`` (created; the caller decides whether an existing one may be written
    into, :func:`topology.outputs.prepare_dir`), each atomically; returns ``{name: path}``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths: dict[str, Path] = {}

    def put(name: str, text: str) -> None:
        paths[name] = write_text(out / name, text)

    put("metrics.json", metrics_json(result))
    put("perf.json", json.dumps(clean(result.perf), sort_keys=True, indent=1) + "\n")
    put("requests.csv", requests_csv(result))
    put("decisions.csv", result.log.to_csv())
    put("timeline.csv", timeline_csv(result))
    put("trace.json", json.dumps(perfetto_trace(result, trace_max_events), separators=(",", ":")))
    if plots:
        for p in plot_all(result, out):
            paths[p.name] = p
    return paths
