"""``rackbed calibrate``'s fit: measured kernel rows -> a calibration file of
:class:`~sim.costs.calibration.CalibrationTable` entries (:func:`calibrate`), and the calibration API other code
uses (re-exported below from the :mod:`sim.calibration` modules that define it).

The pipeline, per measurement document (:mod:`sim.calibration.measurements`):

* **rows -> points** (:func:`curve_of`): one point per row on a curve (kind and key) in the cost models' own FLOP /
  byte conventions: ``gemm_tflops`` per (fmt, n, k), x = tokens per expert ``m``, y = FLOPs over the measured time
  (the calibrated GEMM path has no fixed cost); ``flash_tflops`` per head_dim, x = sequence length, y = causal
  FLOPs / (time - F) (the model adds the per-kernel fixed cost F to the core); ``hbm_GBps``, x = bytes moved (read
  + write), y = bytes / (time - F) from ``hbm_copy``; ``allreduce_us`` per (algo, n_ranks), x = bytes per rank,
  y = µs; ``decode_attn_GBps`` per (head_dim, seq_heads = batch x KV heads), x = context tokens per sequence, y =
  KV bytes / (time - F) from ``attn_decode``; ``p2p_us``, ``moe_us``, ``step_us``; ``dispatch_us`` /
  ``combine_us`` from ``rackbed bench`` JSON.
* **hold-out** (:class:`Holdout`, :func:`split_rows`): within each curve every third point (indices 1, 4, 7, ... —
  never an end point, so held-out points are interpolated, not extrapolated) and, with ``--holdout-shape``, entire
  GEMM (n, k) shapes. A held-out shape is predicted by a per-format *fallback* entry (key ``fmt`` only: the
  geometric mean over the fitted dense shapes of their fitted curves), which is also what the simulator uses for
  any GEMM shape that was not measured.
* **per-kernel fixed cost** F (:func:`fit_kernel_fixed_us`, the table's ``kernel_fixed_us``; without copy rows the
  first-principles ``KERNEL_FIXED_US``): from the *fit* ``hbm_copy`` rows, the smallest graph-replayed copy's time
  less its bytes at the fastest rate any fit copy reached. Fitted first, then subtracted from every rate row, so
  the cost functions, which add the same F (:func:`sim.costs.calibration.kernel_fixed_us`), reproduce the fit points.
* **one fit per curve** (:func:`fit_entries`, in worker processes when there is enough work): dense GEMMs and decode
  attention with a kernel map are priced per kernel (:mod:`sim.calibration.kernel_maps`); every other curve is a
  physical base form times the interpolated fit-point residual (:mod:`sim.calibration.forms`).

The file it returns is written by :func:`dump_calibration` and read by :func:`load_calibration_file`
(:mod:`sim.calibration.files`, which also picks the shipped file a simulation uses); :func:`predict_row`
(:mod:`sim.calibration.predict`) is what ``rackbed validate`` compares with the held-out rows.
"""

from __future__ import annotations

import json
from collections import defaultdict

from rackbed.sim.calibration.files import (
    CALIBRATION_DIR,
    FILE_SCHEMA,
    CalibrationFile,
    calibration_for_topology,
    default_calibration_for,
    describe_calibration,
    dump_calibration,
    load_calibration_file,
)
from rackbed.sim.calibration.forms import POINTS_PER_OCTAVE, choose_form, fit_curve, geomean
from rackbed.sim.calibration.kernel_maps import (
    attn_maps,
    fit_decode_with_map,
    fit_dense_with_map,
    forced_points,
    kernel_maps,
    thin,
)
from rackbed.sim.calibration.measurements import (
    MEASURE_SCHEMAS,
    Holdout,
    calibration_rows,
    check_measurements,
    curve_of,
    fit_kernel_fixed_us,
    gpu_name_for_device,
    load_measurements,
    measurement_paths,
    merge_measurements,
    row_id,
    row_noise,
    shape_of,
    split_rows,
)
from rackbed.sim.calibration.predict import Prediction, predict_row
from rackbed.sim.costs import constants as C
from rackbed.sim.costs.calibration import CalibrationEntry, CalibrationTable
from rackbed.topology.errors import UserError

#: the calibration API: this module's fit, and what the :mod:`sim.calibration` modules define for other code
__all__ = [
    "CALIBRATION_DIR", "FIT_WORKERS_ENV", "CalibrationFile", "Holdout", "Prediction", "calibrate",
    "calibration_for_topology", "calibration_rows", "check_measurements", "curve_of", "default_calibration_for",
    "describe_calibration", "dump_calibration", "fit_entries", "fit_kernel_fixed_us", "load_calibration_file",
    "load_measurements", "measurement_paths", "merge_measurements", "predict_row", "row_id", "row_noise",
    "split_rows",
]


def calibrate(measurements: dict, *, gpu: str | None = None, holdout: Holdout = Holdout(),
              measurements_path: str | list[str] = "") -> dict:
    """Fit a calibration file (a dict ready for YAML) from a ``kernels/bench/measure.py`` document (several files:
    :func:`merge_measurements`; ``measurements_path`` then lists them, and ``meta.sources`` says what each is)."""
    check_measurements(measurements, ", ".join(measurement_paths({"measurements": measurements_path}))
                       or "measurements")
    env = measurements.get("env", {})
    if measurements.get("dry_run"):
        gpu = gpu or "CPU-DRY-RUN"
    gpu = gpu or gpu_name_for_device(str(env.get("gpu_name", "")))
    rows = calibration_rows(measurements.get("rows", []))
    fit_ids, held_ids = split_rows(rows, holdout)
    if not fit_ids:
        raise UserError(f"calibrate: {', '.join(measurement_paths({'measurements': measurements_path})) or 'measurements'}"
                        f": no usable rows to fit")
    src = _source(env)
    by_file = {s["path"]: _source(s) for s in measurements.get("sources") or []}
    fixed = fit_kernel_fixed_us(rows, fit_ids)
    fixed_us = fixed["value_us"] if fixed else C.KERNEL_FIXED_US
    entries = fit_entries(rows, gpu, fit_ids, src, int(env.get("sm_count") or 132), fixed_us, by_file)
    covered = sorted({row_id(r) for r in rows if curve_of(r) is None and not r.get("error") and "bench" in r
                      and r.get("median_us")})
    meta = {"schema": FILE_SCHEMA, "gpu": gpu, "device": env.get("gpu_name"), "gpu_count": env.get("gpu_count"),
            "driver": env.get("driver"), "torch": env.get("torch"), "cuda": env.get("cuda"),
            "nccl": env.get("nccl"), "python": env.get("python"), "date": env.get("date"),
            "measurements": measurements_path, "sources": measurements.get("sources"),
            "measure_schema": measurements.get("schema", MEASURE_SCHEMAS[0]),
            "timing": measurements.get("timing"), "n_rows": len(rows), "n_fit": len(fit_ids),
            "holdout_rule": holdout.describe(), "holdout_shapes": [list(s) for s in holdout.shapes],
            "holdout": sorted(held_ids), "not_calibrated": covered,
            "kernel_fixed": fixed or {"value_us": C.KERNEL_FIXED_US, "rule": "no fit hbm_copy rows: default"},
            "errors": [f"{r.get('bench')}: {r['error']}" for r in rows if r.get("error")]}
    if not meta["sources"]:
        del meta["sources"]  # one file: its provenance is the meta block itself
    meta = json.loads(json.dumps(meta, default=str))  # plain types only (torch's version is a str subclass)
    table = CalibrationTable(entries=tuple(entries), kernel_fixed_us={gpu: fixed_us} if fixed else {})
    doc = {"version": 2, "meta": meta}
    if table.kernel_fixed_us:
        doc["kernel_fixed_us"] = dict(table.kernel_fixed_us)
    return {**doc, "entries": [e.model_dump(mode="json") for e in table.entries]}


def _source(env: dict) -> str:
    """The ``source`` of a fitted entry: the measurement's date and library versions (``env`` of a measurement
    document, or one of its merged ``sources``)."""
    return (f"kernels/measure.py {env.get('date', '?')}, torch {env.get('torch', '?')}, CUDA {env.get('cuda', '?')}, "
            f"NCCL {env.get('nccl', '?')}")


def fit_entries(rows: list[dict], gpu: str, fit_ids: set[str], source: str = "",
                sm_count: int = 132, fixed_us: float = C.KERNEL_FIXED_US,
                sources: dict[str, str] | None = None) -> list[CalibrationEntry]:
    """Calibration entries from the fit rows: one per (kind, key) curve, plus a per-format GEMM fallback (key
    ``fmt`` only) from the dense GEMM curves (geometric mean of their interpolants at every fitted ``m``).
    ``fixed_us``: the per-kernel fixed cost the table's rate kinds are net of (:func:`curve_of`). ``sources``: the
    ``source`` of the curves whose rows came from another file (a row's ``from``, :func:`merge_measurements`)."""
    curves: dict[tuple, dict[float, list[float]]] = defaultdict(lambda: defaultdict(list))
    shapes: dict[tuple, dict] = {}
    origin: dict[tuple, str] = {}
    dense_keys: dict[str, list[tuple]] = defaultdict(list)
    kmaps = kernel_maps(rows)
    amaps = attn_maps(rows)
    forced = forced_points(rows)
    for r in rows:
        if row_id(r) not in fit_ids:
            continue
        kind, key, x, y = curve_of(r, fixed_us)  # type: ignore[misc]
        curves[(kind, key)][x].append(y)
        shapes[(kind, key)] = shape_of(r)
        origin.setdefault((kind, key), (sources or {}).get(r.get("from"), source))
        if kind == "gemm_tflops" and r.get("op") == "dense" and (kind, key) not in dense_keys[r["fmt"]]:
            dense_keys[r["fmt"]].append((kind, key))
    tasks = []
    for (kind, key), pts in curves.items():
        xy = [(x, geomean(ys)) for x, ys in sorted(pts.items())]
        kmap = kmaps.get(key) if kind == "gemm_tflops" and shapes[(kind, key)].get("n_experts", 1) == 1 else None
        tasks.append((kind, key, xy, shapes[(kind, key)], sm_count, kmap, amaps.get(key), forced.get(key)))
    fitted = _map_fits(tasks)
    entries = [CalibrationEntry(kind=kind, gpu=gpu, key=dict(key), points=points,
                                source=f"{origin[(kind, key)]}; {desc}" if desc else origin[(kind, key)])
               for (kind, key, *_), (points, desc) in zip(tasks, fitted)]
    by_key = {(e.kind, tuple(e.key.items())): e for e in entries}
    for fmt, keys in sorted(dense_keys.items()):
        es = [by_key[k] for k in keys]
        xs = sorted({x for e in es for x, _ in e.points})
        if any(kmaps.get(k[1]) for k in keys):  # kernel-map curves are tabulated per m: a smooth mean of them
            xs = sorted(thin(xs, POINTS_PER_OCTAVE))
        points = tuple((x, geomean([e.interpolate(x) for e in es])) for x in xs)
        entries.append(CalibrationEntry(kind="gemm_tflops", gpu=gpu, key={"fmt": fmt}, points=points,
                                        source=f"{origin[keys[0]]}; fallback: geometric mean of {len(es)} dense "
                                               f"shapes"))
    order = {"hbm_GBps": 0, "gemm_tflops": 1, "flash_tflops": 2, "decode_attn_GBps": 3, "allreduce_us": 4,
             "dispatch_us": 5, "combine_us": 6, "p2p_us": 7, "moe_us": 8, "step_us": 9}
    entries.sort(key=lambda e: (order.get(e.kind, 9), -len(e.key), sorted(e.key.items(), key=str)))
    return entries


def _fit_one(task: tuple) -> tuple[tuple[tuple[float, float], ...], str]:
    """``(points, description)`` of one curve (a task of :func:`fit_entries`): the kernel-map fits for dense GEMMs and
    decode attention with a map, else the form chosen by leave-one-out."""
    kind, key, xy, shape, sm_count, kmap, amap, forced = task
    if kmap is not None and kmap.full >= 8 and len(xy) >= 3:
        kd = dict(key)
        return fit_dense_with_map(kind, xy, kmap, int(kd["n"]), int(kd["k"]), shape, sm_count, forced)
    if kind == "decode_attn_GBps" and amap is not None and len(xy) >= 3:
        return fit_decode_with_map(kind, xy, amap, dict(key), shape, sm_count)
    form = choose_form(kind, xy, shape, sm_count)
    return fit_curve(kind, xy, form), (form.describe() if len(xy) >= 3 else "")


#: worker processes for the curve fits (``RACKBED_FIT_WORKERS``; 1 = in this process): the curves are independent and
#: the leave-one-out form choice of the every-m GEMM curves is most of a fit's time (v10: ~90 s on one core)
FIT_WORKERS_ENV = "RACKBED_FIT_WORKERS"
#: below this many fit points in all, the curves are fitted in this process (a worker costs ~1 s to start)
FIT_PARALLEL_MIN_POINTS = 2000


def _map_fits(tasks: list[tuple]) -> list:
    """:func:`_fit_one` over ``tasks``, in worker processes when there is enough work and more than one CPU (spawned,
    not forked: the caller may hold threads, e.g. torch's). The result is the same either way: every curve is fitted
    on its own."""
    import os

    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        n = int(os.environ.get(FIT_WORKERS_ENV) or min(cpus, 8))
    except ValueError as exc:
        raise UserError(f"{FIT_WORKERS_ENV} must be a whole number of worker processes, got "
                        f"{os.environ.get(FIT_WORKERS_ENV)!r}") from exc
    if n <= 1 or len(tasks) < 2 or sum(len(t[2]) for t in tasks) < FIT_PARALLEL_MIN_POINTS:
        return [_fit_one(t) for t in tasks]
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    # the most expensive curves first, so that no worker starts a long fit last
    order = sorted(range(len(tasks)), key=lambda i: -(len(tasks[i][2]) + 10_000 * (tasks[i][5] is not None)))
    with ProcessPoolExecutor(max_workers=min(n, len(tasks)), mp_context=mp.get_context("spawn")) as ex:
        done = dict(zip(order, ex.map(_fit_one, [tasks[i] for i in order])))
    return [done[i] for i in range(len(tasks))]
