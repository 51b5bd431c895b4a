"""The GPU power model against a measured run: ``rackbed validate --power FILE``.

The file (JSON or YAML) holds power samples of the GPUs during a real run — e.g. ``nvidia-smi --query-gpu=
timestamp,power.draw,utilization.gpu`` — and, optionally, the run's steps::

    {"gpu": "H200-SXM",                                  # optional: else the --topology's GPU
     "samples": [{"t": 0.0, "power_w": 312.5, "util": 87, "gpu": 0}, ...],
     "steps":   [{"start_s": 0.01, "dur_s": 0.02, "u": 0.03, "kernel_frac": 0.9}, ...]}

``t`` in seconds (any origin, the steps' on the same clock), ``power_w`` the board draw, ``util`` (optional)
the percentage of the sample period a kernel ran (nvidia-smi's ``utilization.gpu``), ``gpu`` (optional) which
GPU. A step's ``u`` is its compute utilisation (FLOPs over the dense peak during kernels, ``sim.energy``;
default 0: memory-bound) and ``kernel_frac`` the share not spent in communication (default 1).

The prediction uses ``sim.energy``'s draw: a GPU busy for a fraction ``f`` of a sample period draws ``idle_w +
f x (P_busy - idle_w)`` with ``P_busy = busy_power_w(power, u, kernel_frac)`` — ``u`` and ``kernel_frac`` the
steps' means weighted by duration. ``f`` is the sample's ``util`` / 100 when the samples carry it, else the
share of the sampled window the steps cover. The check reports the measured and predicted mean draw per GPU
over the samples and the relative error ``(predicted - measured) / measured``.

A ``.csv`` file is read as ``nvidia-smi --query-gpu=timestamp,power.draw,utilization.gpu[,...] --format=csv,
noheader,nounits -lms=100`` output (what ``results/h200/fidelity/record.sh`` writes beside every run);
``run_window`` (a ``rackbed real`` output folder) keeps the samples of its serving window only — from the
run's end (``real.json`` ``versions.date``) back by its measured duration — leaving out start-up, weight
initialisation and graph capture."""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from rackbed.topology.errors import UserError


def _num(x, where: str, lo: float | None = None) -> float:
    bad = isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x)
    if bad or (lo is not None and x < lo):
        raise UserError(f"{where}: expected a finite number{'' if lo is None else f' >= {lo:g}'}, got {x!r}")
    return float(x)


def read_smi_csv(path: str | Path, run_window: str | Path | None = None) -> dict:
    """Power samples ``{t, power_w, util}`` from an ``nvidia-smi`` CSV (module docstring), ``t`` in epoch seconds
    (the timestamps read as UTC, the recorder's clock); with ``run_window``, those of that run's serving window."""
    import datetime
    import json

    from rackbed.topology.yamlio import read_text

    samples = []
    for n, line in enumerate(read_text(Path(path), "power file").splitlines(), 1):
        p = [x.strip() for x in line.split(",")]
        if not line.strip() or p[0].lower().startswith("timestamp"):
            continue
        try:
            t = datetime.datetime.strptime(p[0], "%Y/%m/%d %H:%M:%S.%f").replace(tzinfo=datetime.timezone.utc)
            samples.append({"t": t.timestamp(), "power_w": float(p[1]), "util": float(p[2])})
        except (ValueError, IndexError):
            raise UserError(f"{path}:{n}: expected nvidia-smi CSV 'timestamp, power.draw, utilization.gpu, ...' "
                            f"(--format=csv,noheader,nounits), got {line.strip()[:60]!r}") from None
    if run_window is not None:
        real = Path(run_window) / "real.json"
        try:
            r = json.loads(read_text(real, "run"))
            end = datetime.datetime.fromisoformat(r["versions"]["date"]).timestamp()
            dur = float(r["metrics"]["throughput"]["duration_s"])
        except (KeyError, TypeError, ValueError):
            raise UserError(f"{real}: a `rackbed real` result with versions.date and metrics.throughput."
                            "duration_s") from None
        samples = [s for s in samples if end - dur <= s["t"] <= end]
        if not samples:
            raise UserError(f"{path}: no sample inside {run_window}'s serving window ({dur:.1f} s before "
                            f"{r['versions']['date']})")
    return {"samples": samples}


def read_power_file(path: str | Path, run_window: str | Path | None = None) -> dict:
    """Parse and check a power file (module docstring); one-line UserError naming the file and the entry."""
    from rackbed.topology.yamlio import load_data

    if str(path).lower().endswith((".csv", ".csv.gz")):
        data = read_smi_csv(path, run_window)
    elif run_window is not None:
        raise UserError(f"--power-run: windows an nvidia-smi .csv power file; {path} is not one")
    else:
        data = load_data(Path(path), "power file")
    if not isinstance(data, Mapping):
        raise UserError(f"{path}: a power file is a mapping with samples (and optionally steps, gpu)")
    unknown = set(data) - {"samples", "steps", "gpu", "note"}
    if unknown:
        raise UserError(f"{path}: {sorted(unknown)[0]}: unknown key (known: samples, steps, gpu, note)")
    samples = data.get("samples")
    if not isinstance(samples, list) or not samples:
        raise UserError(f"{path}: samples: expected a non-empty list of {{t, power_w, util?}}")
    out_s = []
    for i, s in enumerate(samples):
        w = f"{path}: samples[{i}]"
        if not isinstance(s, Mapping) or "t" not in s or "power_w" not in s:
            raise UserError(f"{w}: expected a mapping with t and power_w")
        util = s.get("util")
        out_s.append((_num(s["t"], f"{w}.t"), _num(s["power_w"], f"{w}.power_w", 0),
                      None if util is None else _num(util, f"{w}.util", 0)))
        if util is not None and util > 100:
            raise UserError(f"{w}.util: a percentage 0..100, got {util!r}")
    steps = data.get("steps") or []
    if not isinstance(steps, list):
        raise UserError(f"{path}: steps: expected a list of {{start_s, dur_s, u?, kernel_frac?}}")
    out_st = []
    for i, s in enumerate(steps):
        w = f"{path}: steps[{i}]"
        if not isinstance(s, Mapping) or "start_s" not in s or "dur_s" not in s:
            raise UserError(f"{w}: expected a mapping with start_s and dur_s")
        kf = _num(s.get("kernel_frac", 1.0), f"{w}.kernel_frac", 0)
        if kf > 1:
            raise UserError(f"{w}.kernel_frac: a share 0..1, got {kf!r}")
        out_st.append((_num(s["start_s"], f"{w}.start_s"), _num(s["dur_s"], f"{w}.dur_s", 0),
                       _num(s.get("u", 0.0), f"{w}.u", 0), kf))
    gpu = data.get("gpu")
    if gpu is not None and not isinstance(gpu, str):
        raise UserError(f"{path}: gpu: expected a GPU name, got {gpu!r}")
    return {"samples": out_s, "steps": out_st, "gpu": gpu}


def check_power(data: dict, gpu_spec) -> dict:
    """Measured vs predicted mean draw per GPU (module docstring). ``gpu_spec``: the GPU sampled."""
    from rackbed.sim.energy import busy_power_w

    pw = gpu_spec.power
    if pw is None:
        raise UserError(f"validate --power: {gpu_spec.name} has no power figures (topology.specs GpuPower)")
    t = np.array([s[0] for s in data["samples"]])
    p = np.array([s[1] for s in data["samples"]])
    steps = data["steps"]
    if steps:
        d = np.array([s[1] for s in steps])
        tot = d.sum()
        u = float((np.array([s[2] for s in steps]) * d).sum() / tot) if tot > 0 else 0.0
        kf = float((np.array([s[3] for s in steps]) * d).sum() / tot) if tot > 0 else 1.0
    else:
        u, kf = 0.0, 1.0
    p_busy = float(busy_power_w(pw, u, kf))
    utils = [s[2] for s in data["samples"]]
    if all(x is not None for x in utils):
        f = np.array(utils) / 100.0
        source = "samples' util"
    elif steps:
        lo, hi = float(t.min()), float(t.max())
        if hi <= lo:
            raise UserError("validate --power: the samples span no time and carry no util; cannot place the "
                            "steps")
        busy = _covered([(s[0], s[0] + s[1]) for s in steps], lo, hi)
        f = np.full(len(t), busy / (hi - lo))
        source = "steps' share of the sampled window"
    else:
        raise UserError("validate --power: give util in every sample or the run's steps (the busy share)")
    pred = pw.idle_w + f * (p_busy - pw.idle_w)
    meas_mean, pred_mean = float(p.mean()), float(pred.mean())
    return {"gpu": gpu_spec.name, "samples": len(t), "window_s": float(t.max() - t.min()),
            "steps": len(steps), "busy_fraction": float(f.mean()), "busy_from": source, "mean_u": u,
            "kernel_frac": kf, "idle_w": pw.idle_w, "busy_w": p_busy, "measured_mean_w": meas_mean,
            "predicted_mean_w": pred_mean,
            "rel_error": (pred_mean - meas_mean) / meas_mean if meas_mean > 0 else None}


def _covered(intervals, lo: float, hi: float) -> float:
    """Length of the union of ``intervals`` within ``[lo, hi]``."""
    tot, end = 0.0, lo
    for a, b in sorted(intervals):
        a, b = max(a, end), min(b, hi)
        if b > a:
            tot += b - a
            end = b
    return tot


def power_line(r: dict) -> str:
    err = r["rel_error"]
    return (f"power ({r['gpu']}, {r['samples']} samples over {r['window_s']:.1f} s, busy "
            f"{r['busy_fraction']:.0%} from the {r['busy_from']}, compute utilisation {r['mean_u']:.3f}): "
            f"measured {r['measured_mean_w']:.0f} W mean, model {r['predicted_mean_w']:.0f} W (idle "
            f"{r['idle_w']:.0f} W, busy {r['busy_w']:.0f} W): "
            + ("error n/a" if err is None else f"error {err:+.1%}"))
