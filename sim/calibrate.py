"""Calibration: measured kernel rows -> :class:`~sim.costs.calibration.CalibrationTable` entries, the shipped
calibration files, and the simulator's predictions for measured rows (``rackbed calibrate`` / ``validate``).

Measurements are the rows of ``kernels/measure.py`` (``{"bench": ..., "median_us": ..., shape fields}``; see its
docstring for the FLOP / byte conventions, which are the cost models'). Fitting is per curve:

* **curves** (one per kind and key): ``gemm_tflops`` per (fmt, n, k), x = tokens per expert ``m``, y = FLOPs over
  the measured time (the calibrated GEMM path has no fixed cost); ``flash_tflops`` per head_dim, x = sequence
  length, y = causal FLOPs / (time - F) (the model adds the per-kernel fixed cost F to the core); ``hbm_GBps``,
  x = bytes moved (read + write), y = bytes / (time - F) from ``hbm_copy``; ``allreduce_us`` per
  (algo, n_ranks), x = bytes per rank, y = µs; ``decode_attn_GBps`` per (head_dim, seq_heads = batch x KV heads),
  x = context tokens per sequence, y = KV bytes / (time - F) from ``attn_decode``;
  ``dispatch_us`` / ``combine_us`` from ``rackbed bench`` JSON.
* **per-kernel fixed cost** F (:func:`fit_kernel_fixed_us`, the table's ``kernel_fixed_us``; without copy rows
  the first-principles ``KERNEL_FIXED_US``): from the *fit* ``hbm_copy`` rows, the smallest graph-replayed copy's
  time less its bytes at the fastest rate any fit copy reached — the time of a kernel that is not moving data
  (launch gap, pipeline fill, tail). Fitted first, then subtracted from every row above, so the cost functions,
  which add the same F (:func:`sim.costs.calibration.kernel_fixed_us`), reproduce the fit points.
* **dense GEMMs with a kernel map** (``gemm_kernels`` rows, :func:`fit_dense_with_map`): priced per kernel and
  block of M tiles from the fit points; a choice cuBLAS makes at one or two m only is priced from its kernel timed
  by choice at neighbouring m (``gemm_forced`` rows, :func:`forced_points`), never from the held-out row itself.
* **fit** (:func:`fit_curve`): a physical base form of the implied time times the interpolated fit-point
  residual, tabulated densely for ``CalibrationEntry.interpolate``.
* **measurement formats**: ``rackbed.measure/1`` (a median of repeats per row) and ``rackbed.measure/2`` (CUDA-graph
  replay, interleaved rounds: ``median_us`` is the median of the rounds, with ``min_us`` / ``max_us`` /
  ``q1_us`` / ``q3_us``, which :func:`row_noise` turns into the row's measurement spread for ``rackbed validate``).
* **hold-out** (:class:`Holdout`): within each curve every third point (indices 1, 4, 7, ... — never an end
  point, so held-out points are interpolated, not extrapolated) and, for GEMMs, entire (n, k) shapes
  (default: the O projection ``n=4096, k=8192``). A held-out shape is predicted by a per-format *fallback* entry
  (key ``fmt`` only: the geometric mean over the fitted dense shapes of their fitted curves), which is also what
  the simulator uses for any GEMM shape that was not measured.

The calibration file is a CalibrationTable (``version: 2``, ``kernel_fixed_us``, ``entries``; version-1 files,
without ``kernel_fixed_us``, still load) plus a ``meta`` block (schema ``rackbed.calibration/2``; device, driver,
torch / CUDA / NCCL versions, date, the measurement file, the hold-out rule, the held-out row ids and how the
fixed cost was fitted, ``kernel_fixed``).
:func:`load_calibration_file` reads it (``meta`` kept on the returned :class:`CalibrationFile`);
:func:`default_calibration_for` finds the shipped file for a GPU model (``calibration/*.yaml``);
:func:`describe_calibration` is the one line the simulator prints.
"""

from __future__ import annotations

import bisect
import json
import math
import re
from collections import defaultdict
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path

import yaml
from pydantic import ValidationError

from sim.costs import constants as C
from sim.costs.calibration import _YAML_LOADER, KINDS, CalibrationEntry, CalibrationTable, kernel_fixed_us
from topology.errors import UserError, from_validation

#: calibration file schema (``meta.schema``) written; /2 adds the table's ``kernel_fixed_us`` (CalibrationTable
#: version 2). Every schema in ``FILE_SCHEMAS`` is read (/1 files get the default fixed cost).
FILE_SCHEMA = "rackbed.calibration/2"
FILE_SCHEMAS = ("rackbed.calibration/1", FILE_SCHEMA)
#: where the shipped calibration files live (package data next to sim/)
CALIBRATION_DIR = Path(__file__).resolve().parents[1] / "calibration"
#: torch device name -> topology GpuSpec.name
DEVICE_TO_GPU = {"NVIDIA H200": "H200-SXM", "NVIDIA H100 80GB HBM3": "H100-SXM", "NVIDIA B200": "B200-HGX"}
#: a row's time less the fixed cost is never taken below this fraction of the time (:func:`_net`: a guard against
#: a fixed cost at or above a measurement; a fitted one leaves every fit copy row at least its bytes / peak rate)
NET_FLOOR = 0.1
#: measurement document schemas ``calibrate`` reads (``kernels/measure.py``; documents without a schema are /1)
MEASURE_SCHEMAS = ("rackbed.measure/1", "rackbed.measure/2")
#: the parts of the ``moe_block`` rows (``kernels/measure.py``) that are calibration points: ``routed`` (the
#: routed-expert block without the router GEMM) of kind ``moe_us``, and ``router_gemm`` (the router's bf16 GEMM
#: ``[T, hidden] x [hidden, n_experts]``, what the step model's router term prices through ``gemm_time``) of kind
#: ``gemm_tflops``; the other parts (the router with its top-k, the pieces alone) are reported, not calibrated
MOE_CALIBRATED_PARTS = {"routed": "moe_us", "router_gemm": "gemm_tflops"}


class CalibrationFile(CalibrationTable):
    """A CalibrationTable read from a calibration file, with its ``meta`` block (provenance, hold-outs) and the
    path it came from. Usable wherever a CalibrationTable is."""

    meta: dict = {}
    path: str = ""


@dataclass(frozen=True)
class Holdout:
    """Which measured rows are not used for fitting: every ``every``-th point of each curve starting at index
    ``offset`` (end points always fitted) and every GEMM row whose ``(n, k)`` is in ``shapes``."""

    every: int = 3
    offset: int = 1
    shapes: tuple[tuple[int, int], ...] = ()

    def describe(self) -> str:
        sh = ", ".join(f"n={n} k={k}" for n, k in self.shapes) or "none"
        return (f"every {self.every}-th point of each curve from index {self.offset} (end points kept); "
                f"whole GEMM shapes: {sh}")


def gpu_name_for_device(device_name: str) -> str:
    """``torch.cuda.get_device_name()`` -> topology GpuSpec name (UserError if unknown)."""
    if device_name in DEVICE_TO_GPU.values():
        return device_name
    for k, v in DEVICE_TO_GPU.items():
        if device_name.startswith(k):
            return v
    raise UserError(f"calibrate: unknown GPU {device_name!r}; known: {', '.join(DEVICE_TO_GPU)} (pass --gpu NAME)")


# ---------------------------------------------------------------------------------------------------- rows -> curves

def row_id(r: dict) -> str:
    """A stable id of a measured row (its benchmark, key and x)."""
    b = r["bench"]
    if b == "gemm":
        return f"gemm/{r['op']}/{r['fmt']}/n{r['n']}_k{r['k']}/m{r['m']}"
    if b == "hbm_copy":
        return f"hbm_copy/{'elementwise/' if r.get('kernel') == 'elementwise' else ''}{r['size_bytes']}"
    if b == "flash_prefill":
        return f"flash_prefill/d{r['head_dim']}/s{r['seq']}"
    if b == "attn_decode":
        return f"attn_decode/b{r['batch']}/c{r['ctx']}"
    if b == "allreduce":
        return f"allreduce/{r['algo']}/r{r['n_ranks']}/{r['size_bytes']}"
    if b == "p2p_copy":
        return f"p2p_copy/{r['src']}-{r['dst']}/{r['size_bytes']}"
    if b in ("dispatch", "combine"):
        return f"{b}/r{r['n_ranks']}/h{r['hidden']}/{r['phase']}/t{r['tokens']}"
    if b == "moe_block":
        return (f"moe_block/{r['part']}/{r['fmt']}/h{r['hidden']}_i{r['inter']}_k{r['top_k']}_e{r['n_experts']}"
                f"_tp{r['tp']}_ep{r['ep']}/{r['dist']}/t{r['tokens']}")
    return f"{b}/{json.dumps({k: v for k, v in sorted(r.items()) if k != 'median_us'})}"


def curve_of(r: dict, fixed_us: float = C.KERNEL_FIXED_US) -> tuple[str, tuple[tuple[str, object], ...], float,
                                                                   float] | None:
    """``(kind, key, x, y)`` of the calibration point a measured row gives, or None if no calibration kind
    covers it (rows with errors, unknown benchmarks). ``fixed_us``: the per-kernel fixed
    cost subtracted from the rate kinds' times (the value the calibration file will carry)."""
    if r.get("error") or not r.get("median_us") or r["median_us"] <= 0:
        return None
    t = r["median_us"] * 1e-6
    f = fixed_us * 1e-6
    b = r["bench"]
    if b == "gemm":
        flops = 2.0 * r["m"] * r.get("n_experts", 1) * r["n"] * r["k"]
        return "gemm_tflops", (("fmt", r["fmt"]), ("n", r["n"]), ("k", r["k"])), float(r["m"]), flops / t / 1e12
    if b == "flash_prefill":
        flops = 4.0 * r["n_q_heads"] * r["head_dim"] * r["seq"] * (r["seq"] + 1) / 2
        return "flash_tflops", (("head_dim", r["head_dim"]),), float(r["seq"]), flops / _net(t, f) / 1e12
    if b == "hbm_copy":
        if r.get("kernel") == "memcpy":  # the driver's memcpy (module docstring): not what model ops run
            return None
        return "hbm_GBps", (), float(r["bytes"]), r["bytes"] / _net(t, f) / 1e9
    if b == "attn_decode":
        kv = r.get("kv_bytes") or r["batch"] * r["ctx"] * 2 * r["n_kv_heads"] * r["head_dim"] * 2
        return ("decode_attn_GBps", (("head_dim", r["head_dim"]), ("seq_heads", r["batch"] * r["n_kv_heads"])),
                float(r["ctx"]), kv / _net(t, f) / 1e9)
    if b == "allreduce":
        return ("allreduce_us", (("algo", r["algo"]), ("n_ranks", r["n_ranks"])), float(r["size_bytes"]),
                r["median_us"])
    if b in ("dispatch", "combine"):
        return (f"{b}_us", (("n_ranks", r["n_ranks"]), ("hidden", r["hidden"]), ("phase", r["phase"])),
                float(r["tokens"]), r["median_us"])
    if b == "p2p_copy":  # kernels/measure.py copies between two GPUs of one node: an NVLink peer copy
        return "p2p_us", (("route", r.get("route", "nvlink")),), float(r["size_bytes"]), r["median_us"]
    if b == "step_overhead":  # the framework's time per step beyond its kernels
        return "step_us", (("phase", r["phase"]),), float(r["batch"]), r["median_us"]
    kind = MOE_CALIBRATED_PARTS.get(r.get("part")) if b == "moe_block" else None
    if kind == "moe_us":  # the block's own time: no fixed cost taken off
        return kind, tuple((f, r[f]) for f in KINDS["moe_us"]), float(r["tokens"]), r["median_us"]
    if kind == "gemm_tflops":  # the router's dense bf16 GEMM, as the gemm rows (no fixed cost)
        flops = 2.0 * r["tokens"] * r["n_experts"] * r["hidden"]
        return kind, (("fmt", "bf16"), ("n", r["n_experts"]), ("k", r["hidden"])), float(r["tokens"]), flops / t / 1e12
    return None


def _net(t_s: float, fixed_s: float) -> float:
    """Measured time less the per-kernel fixed cost (never below ``NET_FLOOR`` of the measurement)."""
    return max(t_s - fixed_s, NET_FLOOR * t_s)


def fit_kernel_fixed_us(rows: list[dict], fit_ids: set[str]) -> dict | None:
    """The per-kernel fixed cost (µs) from the **fit** ``hbm_copy`` rows, or None with fewer than two of them.

    A copy's work is exactly its bytes, so its time is ``F + bytes / rate``. The fixed cost ``F`` is what a
    graph-replayed kernel costs with no work: the smallest fit copy (closest to zero work; its time bounds F from
    above) less the time its bytes take at the fastest rate any fit copy reached (``bytes / time`` maximised over
    the fit copies — the large, bandwidth-bound ones; a rate is never above the sustained peak, so what remains is
    time not spent moving data; never below 0). Held-out rows are never read. Also returns, as a cross-check, the intercept of
    the least-squares line ``time = a + bytes * s`` through the three smallest fit copies."""
    cps = sorted(((r["median_us"], float(r["bytes"]), row_id(r)) for r in rows
                  if r.get("bench") == "hbm_copy" and r.get("kernel") != "memcpy" and row_id(r) in fit_ids
                  and not r.get("error")
                  and (r.get("median_us") or 0) > 0 and (r.get("bytes") or 0) > 0), key=lambda c: (c[0], c[1]))
    if len(cps) < 2:
        return None
    t0, b0, rid0 = cps[0]
    # the fastest of the other copies (the smallest one being the fastest per byte leaves no fixed cost: 0)
    peak_t, peak_b, peak_id = max(cps[1:], key=lambda c: c[1] / c[0])
    rate = peak_b / peak_t  # bytes per µs
    fixed = max(0.0, t0 - b0 / rate)
    small = sorted(cps, key=lambda c: c[1])[:3]
    mb = sum(b for _, b, _ in small) / len(small)
    mt = sum(t for t, _, _ in small) / len(small)
    sxx = sum((b - mb) ** 2 for _, b, _ in small)
    icpt = mt - mb * (sum((b - mb) * (t - mt) for t, b, _ in small) / sxx) if sxx > 0 else None
    return {"value_us": _sig(fixed, 4), "smallest_row": rid0, "smallest_us": _sig(t0, 6),
            "peak_row": peak_id, "peak_GBps": _sig(rate / 1e3, 6),
            "rule": "smallest fit hbm_copy time - its bytes / the fastest fit copy rate",
            "check_intercept_us": None if icpt is None else _sig(icpt, 4),
            "check_rows": [rid for _, _, rid in small]}


def row_noise(r: dict) -> float | None:
    """The row's measurement spread as a fraction of its median: half the range of its timed rounds
    (``(max_us - min_us) / 2 / median_us``, ``rackbed.measure/2``), or None when the row has no rounds (older
    files, ``rackbed bench`` rows)."""
    lo, hi, med = r.get("min_us"), r.get("max_us"), r.get("median_us")
    if lo is None or hi is None or not med:
        return None
    return (float(hi) - float(lo)) / 2 / float(med)


def check_measurements(measurements: dict, source: str = "measurements") -> None:
    """One-line UserError unless ``measurements`` is a ``kernels/measure.py`` document of a known schema."""
    if not isinstance(measurements, dict) or not isinstance(measurements.get("rows", []), list):
        raise UserError(f"{source}: not a kernels/measure.py document (a mapping with a 'rows' list)")
    sch = measurements.get("schema", MEASURE_SCHEMAS[0])
    if sch not in MEASURE_SCHEMAS:
        raise UserError(f"{source}: schema must be one of {', '.join(MEASURE_SCHEMAS)}, got {sch!r}")
    for i, r in enumerate(measurements.get("rows", [])):
        if not isinstance(r, dict) or "bench" not in r:
            raise UserError(f"{source}: rows[{i}] has no 'bench' field")


def merge_measurements(docs: list[tuple[str, dict]]) -> dict:
    """One measurement document from several ``kernels/measure.py`` documents ``[(path, doc), ...]`` of the same GPU
    model (e.g. a full run and a later run of benchmarks it lacked): their rows in order, the first document's
    ``env``, ``schema`` and ``timing`` (the file's provenance), ``complete`` only if every one is, and ``sources``:
    per document its path, date, device, GPU count, driver, torch / CUDA versions, command and row count. A single
    document is returned as it is. One-line UserError if one is not a measurement document or the GPU models
    differ."""
    if not docs:
        raise UserError("calibrate: no measurement files")
    for path, doc in docs:
        check_measurements(doc, path)
    if len(docs) == 1:
        return docs[0][1]
    names = {str(d.get("env", {}).get("gpu_name", "")) for _, d in docs}
    if len(names) > 1:
        raise UserError(f"calibrate: measurement files of different GPUs ({', '.join(sorted(names))}): "
                        f"{', '.join(p for p, _ in docs)}")
    first = docs[0][1]
    sources = []
    for path, d in docs:
        env = d.get("env", {})
        src = {"path": path, "date": env.get("date"), "device": env.get("gpu_name"), "gpu_count": env.get("gpu_count"),
               "driver": env.get("driver"), "torch": env.get("torch"), "cuda": env.get("cuda"),
               "nccl": env.get("nccl"), "command": env.get("command"),
               "schema": d.get("schema", MEASURE_SCHEMAS[0]), "n_rows": len(d.get("rows", []))}
        sources.append({k: v for k, v in src.items() if v is not None})
    # every row says which file it came from (the ``source`` of its curve, :func:`fit_entries`)
    return {**{k: v for k, v in first.items() if k != "rows"},
            "rows": [{**r, "from": path} for path, d in docs for r in d["rows"]],
            "complete": all(d.get("complete", True) is not False for _, d in docs), "sources": sources}


def measurement_paths(meta: dict) -> list[str]:
    """The measurement files a calibration file was fitted from (``meta.measurements``: one path, or a list)."""
    m = meta.get("measurements")
    if not m:
        return []
    return [str(m)] if isinstance(m, str) else [str(x) for x in m]


def load_measurements(paths: list[str], root: str | Path | None = None) -> dict:
    """Read and merge (:func:`merge_measurements`) ``kernels/measure.py`` JSON files; a relative path that does not
    exist from here is taken relative to ``root`` (default: the repository, where ``meta.measurements`` paths
    point). One-line UserError on an unreadable or invalid file."""
    docs = []
    for path in paths:
        p = Path(path)
        if not p.is_absolute() and not p.exists():
            p = Path(root or CALIBRATION_DIR.parent) / p
        try:
            doc = json.loads(p.read_text())
            docs.append((str(path), step_overhead_measurements(doc) if _is_overhead_doc(doc) else doc))
        except OSError as exc:
            raise UserError(f"{path}: cannot read measurements: {exc.strerror or exc}") from exc
        except json.JSONDecodeError as exc:
            raise UserError(f"{path}: not valid JSON: {exc.msg} (line {exc.lineno})") from exc
    return merge_measurements(docs)


def _is_overhead_doc(doc) -> bool:
    return (isinstance(doc, dict) and "schema" not in doc and isinstance(doc.get("rows"), list)
            and any(isinstance(r, dict) and isinstance(r.get("overhead"), dict) for r in doc["rows"]))


def step_overhead_measurements(doc: dict) -> dict:
    """A ``kernels/measure.py`` document from ``python -m engine.real.bench_decode --overhead`` output: per graph-
    replayed decode step, ``step_overhead`` rows whose time is the runner's whole call less the graph replay (the
    bucket's input copies and bookkeeping: framework work per step that no kernel accounts for), x = the batch."""
    rows = []
    for r in doc.get("rows", []):
        o = r.get("overhead") or {}
        if r.get("graph_mode") == "graph" and o.get("call_us") and o.get("replay_us"):
            rows.append({"bench": "step_overhead", "phase": "decode", "batch": int(r["batch"]),
                         "context": r.get("context"), "model": doc.get("model"),
                         "median_us": round(o["call_us"] - o["replay_us"], 3),
                         "call_us": o["call_us"], "replay_us": o["replay_us"]})
    env = {"gpu_name": doc.get("device"), "date": doc.get("date"), "torch": doc.get("torch"), "cuda": doc.get("cuda"),
           "command": "python -m engine.real.bench_decode --overhead"}
    return {"schema": MEASURE_SCHEMAS[-1], "env": {k: v for k, v in env.items() if v}, "rows": rows}


def calibration_rows(rows: list[dict]) -> list[dict]:
    """``rows`` with the ``hbm_copy`` rows of the driver's memcpy labelled ``kernel: memcpy`` (not calibration
    points, :func:`curve_of`) when the document also has ``kernel: elementwise`` copies: measurement files before
    those rows (v6 and older) have only memcpy rows, unlabelled, and keep fitting the HBM curve on them."""
    if not any(r.get("bench") == "hbm_copy" and r.get("kernel") == "elementwise" for r in rows):
        return rows
    return [{**r, "kernel": "memcpy"} if r.get("bench") == "hbm_copy" and "kernel" not in r else r for r in rows]


def split_rows(rows: list[dict], holdout: Holdout) -> tuple[set[str], set[str]]:
    """``(fit_ids, holdout_ids)`` over the rows that give calibration points (module docstring). Points are the
    curve's distinct ``x`` values (rows repeating an ``x``, e.g. a merged second measurement, share its role)."""
    curves: dict[tuple, list[tuple[float, str]]] = defaultdict(list)
    fit, held = set(), set()
    for r in rows:
        c = curve_of(r)
        if c is None:
            continue
        rid = row_id(r)
        if c[0] == "gemm_tflops" and (dict(c[1])["n"], dict(c[1])["k"]) in holdout.shapes:
            held.add(rid)
            continue
        curves[(c[0], c[1])].append((c[2], rid))
    for pts in curves.values():
        xs = sorted({x for x, _ in pts})
        idx = {x: i for i, x in enumerate(xs)}
        for x, rid in pts:
            i = idx[x]
            inner = 0 < i < len(xs) - 1
            if inner and holdout.every > 0 and i % holdout.every == holdout.offset % holdout.every:
                held.add(rid)
            else:
                fit.add(rid)
    return fit, held


def shape_of(r: dict) -> dict:
    """The shape fields of a measured row that the curve's base form needs (:func:`form_for`)."""
    if r["bench"] == "gemm":
        return {"n": r["n"], "n_experts": r.get("n_experts", 1)}
    if r["bench"] == "flash_prefill":
        return {"heads": r["n_q_heads"]}
    if r["bench"] == "moe_block" and r.get("part") == "router_gemm":
        return {"n": r["n_experts"], "n_experts": 1}
    if r["bench"] == "moe_block":
        return {"n_experts": r["n_experts"], "top_k": r["top_k"], "n_local": r["n_experts"] // r.get("ep", 1)}
    return {}


def kernel_maps(rows: list[dict]) -> dict[tuple, KernelMap]:
    """The ``gemm_kernels`` rows (``kernels/measure.py``) by their dense curve's key ``(fmt, n, k)`` (as
    :func:`curve_of` keys it)."""
    out = {}
    for r in rows:
        if r.get("bench") == "gemm_kernels" and not r.get("error") and r.get("runs"):
            key, runs = _map_row(r, f"gemm_kernels row {r.get('fmt')}/{r.get('shape')}", "fmt, n, k", "m",
                                 lambda: (("fmt", r["fmt"]), ("n", int(r["n"])), ("k", int(r["k"]))))
            out[key] = KernelMap(runs)
    return out


def _map_row(r: dict, label: str, fields: str, x: str, key_of) -> tuple[tuple, tuple[tuple[int, int, str], ...]]:
    """``(key_of(), runs)`` of a kernel-map row (``gemm_kernels`` / ``attn_kernels``), or one UserError naming the
    row when a field is missing or the runs are not increasing, non-overlapping ``[x_first, x_last, kernels]``."""
    try:
        key = key_of()
        runs = tuple((int(a), int(b), str(kn)) for a, b, kn in r["runs"])
    except (KeyError, TypeError, ValueError) as exc:
        raise UserError(f"{label}: needs {fields} and runs of [{x}_first, {x}_last, kernel] "
                        f"({type(exc).__name__}: {exc})") from exc
    if any(a > b for a, b, _ in runs) or any(r0[1] >= r1[0] for r0, r1 in zip(runs, runs[1:])):
        raise UserError(f"{label}: runs must be increasing, non-overlapping [{x}_first, {x}_last] ranges")
    return key, runs


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
        xy = [(x, _geomean(ys)) for x, ys in sorted(pts.items())]
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
            xs = sorted(_thin(xs, POINTS_PER_OCTAVE))
        points = tuple((x, _geomean([e.interpolate(x) for e in es])) for x in xs)
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


# ---------------------------------------------------------------------------------------- dense GEMMs by kernel

#: the tile of a cuBLAS (nvjet) / CUTLASS Hopper kernel name, ``..._{BN}x{BM}_{BK}x{stages}_...``: in the TN calls
#: of ``kernels/measure.py`` the second number tiles the token dimension m (``192x8`` runs m <= 8, ``192x16`` m 9-16)
_TILE_RE = re.compile(r"_(\d+)x(\d+)_(\d+)x(\d+)_")
#: fit points of a dense GEMM curve with a kernel map that its fallback form is fitted on: the fit point nearest to
#: each of this many targets per octave (the leave-one-out form choice is quadratic in the points)
KERNEL_FALLBACK_PER_OCTAVE = 4
#: the tabulated kernel-map curve reproduces the block model within this relative error at every integer m
KERNEL_TAB_TOL = 0.005


def kernel_tile(name: str) -> tuple[int, int] | None:
    """``(BN, BM)`` of a GEMM kernel's name (the first of ``" + "``-joined kernels), or None if it names none."""
    m = _TILE_RE.search(name.split(" + ")[0])
    return (int(m.group(1)), int(m.group(2))) if m else None


@dataclass(frozen=True)
class KernelMap:
    """Which kernel a dense GEMM runs at each token count ``m`` (a ``gemm_kernels`` row of ``kernels/measure.py``:
    ``runs = [[m_first, m_last, kernels], ...]``), for ``m = 1 .. full`` (every m recorded)."""

    runs: tuple[tuple[int, int, str], ...]

    @property
    def full(self) -> int:
        """The largest L with every m in 1..L inside a run (0 if m = 1 is not). A run spans the m between the
        recorded ends it joins (one kernel at both): FP8's single kernel covers 1..16384 from a map recorded at
        every m to 1024 and every 64 above, so its blocks above 1024 are priced from the same kernel's fit points."""
        top = 0
        for a, b, _ in self.runs:
            if a > top + 1:
                break
            top = max(top, b)
        return top

    def kernel(self, m: int) -> str | None:
        i = bisect.bisect_right([a for a, _, _ in self.runs], m) - 1
        if i < 0 or m > self.runs[i][1]:
            return None
        return self.runs[i][2]

    def block(self, m: int) -> tuple[str, int] | None:
        """``(kernel, M tiles)``: the m with equal blocks run the same kernel over the same number of M tiles."""
        k = self.kernel(m)
        return None if k is None else (k, m_tiles(k, m))


def m_tiles(kernel: str, m: int) -> int:
    """How many M tiles ``kernel`` (its name, :func:`kernel_tile`) covers at ``m`` tokens (0: no tile in the name)."""
    t = kernel_tile(kernel)
    return math.ceil(m / t[1]) if t else 0


def forced_points(rows: list[dict]) -> dict[tuple, dict[tuple[str, tuple[int, ...]], dict[int, float]]]:
    """The ``gemm_forced`` rows (``kernels/measure.py``: the kernel of a choice the library makes at one or two m,
    timed at other m by choice) as ``{curve key (fmt, n, k): {(kernels, library m): {m: seconds}}}``. Rows with
    errors and the ``check`` rows (the forced kernel where the library itself runs it, a duplicate of the library's
    own row) are not read; a merged file's repeats of one point are averaged geometrically."""
    acc: dict[tuple, dict[tuple, dict[int, list[float]]]] = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for r in rows:
        if r.get("bench") != "gemm_forced" or r.get("error") or r.get("check") or not r.get("median_us"):
            continue
        try:
            key = (("fmt", r["fmt"]), ("n", int(r["n"])), ("k", int(r["k"])))
            cfg = (str(r["kernel"]), tuple(sorted(int(x) for x in r["library_m"])))
            acc[key][cfg][int(r["m"])].append(float(r["median_us"]) * 1e-6)
        except (KeyError, TypeError, ValueError) as exc:
            raise UserError(f"gemm_forced row {r.get('shape')}/m{r.get('m')}: needs fmt, n, k, m, kernel, "
                            f"library_m and median_us ({type(exc).__name__}: {exc})") from exc
    return {key: {cfg: {m: _geomean(ts) for m, ts in by_m.items()} for cfg, by_m in cfgs.items()}
            for key, cfgs in acc.items()}


def kernel_block_times(kmap: KernelMap, n: int, pts: dict[int, float], fallback, sm_count: int = 132,
                       forced: dict[tuple[str, tuple[int, ...]], dict[int, float]] | None = None) -> list[float]:
    """The time (s) of a dense GEMM at every ``m = 1 .. kmap.full`` from its timed fit points ``pts`` (m -> s) and
    the kernel each m runs (index 0 is m = 1). A GEMM's time is set by its kernel and how many M tiles that kernel
    covers (its *block*, :meth:`KernelMap.block`); within a block it varies smoothly with m (FP8's 128-row tiles run
    a saw-tooth: time falls as the last tile fills).

    ``forced`` (:func:`forced_points`: ``(kernels, library m) -> {m: s}``): the kernel of a choice the library makes
    at the m of ``library m`` only, timed by choice at other m. Such a choice is a configuration of its own (the same
    kernel can run with other launch parameters at its other m): the library's points at ``library m`` and the
    forced points form its blocks, and price nothing else (never the library's time at a forced point's m, even where
    the library runs the same kernel there). Below, "kernel" is the configuration. In order:

    1. fit points in the same block: linear in m between the two around it; beyond the block's fit points the
       least-squares line through them (three or more) or the nearest one's time (v7: a line through the two
       nearest of an alternating +-3 % block missed a held-out end by 13 %);
    2. fit points of the same kernel in other blocks: the nearest one's time scaled by the ratio of waves,
       ``ceil(ceil(n / BN) * ceil(m / BM) / sm_count)``;
    3. ``fallback(m)``: the curve's form fitted without the map (``fit_curve``). (A kernel no fit point ran, priced
       by its waves of tiles at the nearest fit points' speed per tile, was tried: worse, up to +130 %; split-K
       and memory-bound kernels do not scale with tile area. The two fit points either side of m, whatever their
       kernels, were tried on v7: the worst held-out row went from 18 % to 31 % (m = 152 of the TP2 QKV GEMM).)
    """
    L = kmap.full
    forced = forced or {}
    cfg_at = {m: cfg for cfg in forced for m in cfg[1] if kmap.kernel(m) == cfg[0]}

    def config(m: int) -> tuple[str, tuple[int, ...]]:
        return cfg_at.get(m) or (kmap.kernel(m), ())

    def block(cfg, m: int) -> tuple:  # KernelMap.block, per configuration
        return (cfg, m_tiles(cfg[0], m))

    timed: dict[tuple, float] = {}  # (configuration, m) -> s
    for m in pts:
        if 1 <= m <= L:
            timed[(config(m), m)] = pts[m]
    for cfg, by_m in forced.items():
        for m, t in by_m.items():
            if 1 <= m <= L and m not in cfg[1]:
                timed[(cfg, m)] = t
    by_block: dict[tuple, list[int]] = defaultdict(list)
    by_kernel: dict[tuple, list[int]] = defaultdict(list)
    for cfg, m in sorted(timed, key=lambda cm: (cm[1], cm[0])):
        by_block[block(cfg, m)].append(m)
        by_kernel[cfg].append(m)

    def waves(m: int, tile) -> int:
        return math.ceil(math.ceil(n / tile[0]) * math.ceil(m / tile[1]) / sm_count)

    out = []
    for m in range(1, L + 1):
        kn = config(m)
        b = block(kn, m)
        same = by_block.get(b, ())
        if len(same) >= 2 and same[0] <= m <= same[-1]:
            j = min(max(bisect.bisect_left(same, m), 1), len(same) - 1)  # the bracketing pair
            m0, m1 = same[j - 1], same[j]
            t0, t1 = timed[(kn, m0)], timed[(kn, m1)]
            out.append(t0 + (t1 - t0) * (m - m0) / (m1 - m0))
        elif len(same) >= 3:  # beyond the block's fit points: the least-squares line through them
            out.append(_ls_line(same, [timed[(kn, x)] for x in same], m))
        elif same:  # one or two: the nearest (a line through two noisy neighbours amplifies their noise)
            out.append(timed[(kn, min(same, key=lambda x: (abs(x - m), x)))])
        elif by_kernel.get(kn) and (tile := kernel_tile(kn[0])):
            mk = min(by_kernel[kn], key=lambda x: (abs(x - m), x))
            out.append(timed[(kn, mk)] * waves(m, tile) / waves(mk, tile))
        else:
            out.append(fallback(m))
    return out


def _ls_line(xs: list[float], ys: list[float], x: float) -> float:
    """The least-squares line through ``(xs, ys)`` at ``x``, kept within a factor 2 of the ``ys``."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((a - mx) ** 2 for a in xs)
    slope = sum((a - mx) * (b - my) for a, b in zip(xs, ys)) / sxx if sxx > 0 else 0.0
    return min(max(my + slope * (x - mx), 0.5 * min(ys)), 2.0 * max(ys))


def tabulate_exact(ys: list[float], tol: float = KERNEL_TAB_TOL, keep: set[int] = frozenset(),
                   xs: list[float] | None = None) -> list[int]:
    """Indices of ``ys`` (values at ``xs``, default x = index + 1) to tabulate so that linear interpolation in
    log x between them (``CalibrationEntry.interpolate``) reproduces every value within ``tol``: both sides of
    every change of slope sign or jump, then the worst-reproduced index until none is off by more than ``tol``."""
    n = len(ys)
    lx = [math.log(i + 1) for i in range(n)] if xs is None else [math.log(x) for x in xs]
    kept = {0, n - 1, *(i for i in keep if 0 <= i < n)}
    for i in range(1, n):
        if abs(ys[i] - ys[i - 1]) > tol * ys[i - 1]:
            kept.update((i - 1, i))
    while True:
        ks = sorted(kept)
        worst, wi = tol, None
        for a, b in zip(ks, ks[1:]):
            la, lb = lx[a], lx[b]
            for i in range(a + 1, b):
                y = ys[a] + (ys[b] - ys[a]) * (lx[i] - la) / (lb - la)
                e = abs(y - ys[i]) / ys[i]
                if e > worst:
                    worst, wi = e, i
        if wi is None:
            return ks
        kept.add(wi)


def _thin(xs: list[float], per_octave: int = KERNEL_FALLBACK_PER_OCTAVE) -> set[float]:
    """The x values nearest to a geometric grid of ``per_octave`` targets per octave over ``xs`` (and both ends)."""
    lo, hi = xs[0], xs[-1]
    keep = {lo, hi}
    j = 0
    while (t := lo * 2 ** (j / per_octave)) <= hi:
        keep.add(min(xs, key=lambda x: (abs(math.log(x / t)), x)))
        j += 1
    return keep


def fit_dense_with_map(kind: str, xy: list[tuple[float, float]], kmap: KernelMap, n: int, k: int, shape: dict,
                       sm_count: int = 132, forced: dict[tuple[str, tuple[int, ...]], dict[int, float]] | None = None,
                       ) -> tuple[tuple[tuple[float, float], ...], str]:
    """Tabulated ``gemm_tflops`` points of a dense GEMM curve with a kernel map: :func:`kernel_block_times` at every
    m up to the map's ``full``, the form fitted on a thinned set of fit points (:func:`_thin`) above it and as the
    last resort inside. Returns ``(points, description)``."""
    flops = lambda m: 2.0 * m * n * k
    xs = [x for x, _ in xy]
    keep = _thin(xs)
    sub = [(x, y) for x, y in xy if x in keep]
    form = choose_form(kind, sub, shape, sm_count)
    fb_pts = fit_curve(kind, sub, form)
    fb = CalibrationEntry(kind="gemm_tflops", gpu="-", points=fb_pts)
    pts = {int(x): flops(x) / (y * 1e12) for x, y in xy if float(x).is_integer()}
    L = kmap.full
    forced = {cfg: used for cfg, by_m in (forced or {}).items() if any(kmap.kernel(m) == cfg[0] for m in cfg[1])
              if (used := {m: t for m, t in by_m.items() if 1 <= m <= L and m not in cfg[1]})}
    ts = kernel_block_times(kmap, n, pts, lambda m: flops(m) / (fb.interpolate(m) * 1e12), sm_count, forced)
    ys = [flops(m) / t / 1e12 for m, t in zip(range(1, L + 1), ts)]  # tflops, tabulated as the rate
    idx = tabulate_exact(ys, keep={int(x) - 1 for x in pts if x <= L})
    points = [(float(i + 1), _sig(ys[i])) for i in idx] + [(x, y) for x, y in fb_pts if x > L]
    nf = sum(len(v) for v in forced.values())
    desc = (f"kernel map: {len(kmap.runs)} kernel runs over m = 1..{L}, per (kernel, M tiles) block "
            f"through the fit points{f' and {nf} forced-kernel points of {len(forced)} short runs' if nf else ''}; "
            f"above and without a block: {form.describe()}")
    return tuple((float(_sig(x, 9)), float(y)) for x, y in points), desc


# ------------------------------------------------------------------------------- decode attention by kernel

#: the tile of a cuDNN / flash SDPA kernel name, ``_{Br}x{Bc}x{D}_``: Bc is the KV block a CTA walks
_ATTN_TILE_RE = re.compile(r"_(\d+)x(\d+)x(\d+)_")
#: the launch grid ``kernels/measure.py`` appends to each kernel name of an ``attn_kernels`` row
_GRID_RE = re.compile(r"<<<(\d+),(\d+),(\d+)>>>")


def attn_maps(rows: list[dict]) -> dict[tuple, tuple[tuple[int, int, str], ...]]:
    """The ``attn_kernels`` rows (``kernels/measure.py``) by their decode curve's key ``(head_dim, seq_heads)``
    (as :func:`curve_of` keys it): runs ``(ctx_first, ctx_last, kernels with grids)``."""
    out = {}
    for r in rows:
        if r.get("bench") == "attn_kernels" and not r.get("error") and r.get("runs"):
            key, runs = _map_row(r, f"attn_kernels row b{r.get('batch')}", "batch, n_kv_heads, head_dim", "ctx",
                                 lambda: (("head_dim", int(r["head_dim"])),
                                          ("seq_heads", int(r["batch"]) * int(r["n_kv_heads"]))))
            out[key] = runs
    return out


def decode_work_x(kernels: str, ctx: float, sm_count: int = 132) -> float:
    """The context a decode-attention kernel's time is piecewise linear in, within one kernel run (same kernels,
    same grid): with no more CTAs than SMs (one wave; a CTA's time is its KV blocks) the context rounded up to
    whole KV blocks ``Bc`` of the kernel's tile — SDPA at batch 1 takes as long at 432 as at 512 tokens; with more,
    the context itself (the partial last block is partial work). Measured (v7): the rule is what keeps the run's
    held-out rows within 8 % at batch 1-256."""
    g = _GRID_RE.search(kernels)
    t = _ATTN_TILE_RE.search(kernels.split(" + ")[0])
    if g and t and int(g.group(1)) * int(g.group(2)) * int(g.group(3)) <= sm_count:
        bc = int(t.group(2))
        return float(math.ceil(ctx / bc) * bc)
    return float(ctx)


def decode_map_grid(runs: tuple[tuple[int, int, str], ...]) -> list[int]:
    """The contexts a decode kernel map recorded inside its runs (``kernels/measure.py`` ``DECODE_MAP_CTX``: every
    16 up to 4096, every 128 above) and the runs' ends."""
    out = set()
    for a, b, _ in runs:
        out.update((a, b))
        out.update(x for x in range(-(-a // 16) * 16, min(b, 4096) + 1, 16))
        out.update(x for x in range(max(-(-a // 128) * 128, 4224), b + 1, 128))
    return sorted(out)


def decode_run_times(runs: tuple[tuple[int, int, str], ...], xs: list[int], pts: dict[int, float], fallback,
                     sm_count: int = 132) -> list[float]:
    """Net time (s) of a decode-attention curve at every context of ``xs`` from its fit points ``pts`` (ctx -> s)
    and the kernel runs of its map: fit points in the same run, piecewise linear in :func:`decode_work_x` (exact at
    a fit point's x, extrapolated from the two nearest at the ends, within a factor 2); a run with fewer than two
    distinct x among its fit points, and a context outside every run: ``fallback(ctx)``."""
    starts = [a for a, _, _ in runs]

    def run_of(x: float) -> int | None:
        i = bisect.bisect_right(starts, x) - 1
        return i if i >= 0 and x <= runs[i][1] else None

    per_run: dict[int, dict[float, list[float]]] = defaultdict(lambda: defaultdict(list))
    for x, t in pts.items():
        i = run_of(x)
        if i is not None:
            per_run[i][decode_work_x(runs[i][2], x, sm_count)].append(t)
    curves = {i: sorted((w, sum(ts) / len(ts)) for w, ts in d.items()) for i, d in per_run.items()}
    out = []
    for x in xs:
        i = run_of(x)
        c = curves.get(i) if i is not None else None
        if not c or len(c) < 2:
            out.append(fallback(x))
            continue
        w = decode_work_x(runs[i][2], x, sm_count)
        ws = [a for a, _ in c]
        j = bisect.bisect_left(ws, w)
        if j < len(ws) and ws[j] == w:
            out.append(c[j][1])
            continue
        j = min(max(j, 1), len(c) - 1)
        (w0, t0), (w1, t1) = c[j - 1], c[j]
        t = t0 + (t1 - t0) * (w - w0) / (w1 - w0)
        out.append(min(max(t, 0.5 * min(t0, t1)), 2.0 * max(t0, t1)))
    return out


def fit_decode_with_map(kind: str, xy: list[tuple[float, float]], runs: tuple[tuple[int, int, str], ...],
                        key: dict, shape: dict, sm_count: int = 132) -> tuple[tuple[tuple[float, float], ...], str]:
    """Tabulated ``decode_attn_GBps`` points of a decode curve with a kernel map: :func:`decode_run_times` at every
    context the map recorded, the curve's form (fitted on all its fit points) outside the map and as the fallback
    inside. Returns ``(points, description)``."""
    kv = lambda x: 4.0 * key["seq_heads"] * key["head_dim"] * x
    form = choose_form(kind, xy, shape, sm_count)
    fb_pts = fit_curve(kind, xy, form)
    fb = CalibrationEntry(kind="decode_attn_GBps", gpu="-", points=fb_pts)
    pts = {int(x): kv(x) / (y * 1e9) for x, y in xy if float(x).is_integer()}
    xs = decode_map_grid(runs)
    ts = decode_run_times(runs, xs, pts, lambda x: kv(x) / (fb.interpolate(x) * 1e9), sm_count)
    ys = [kv(x) / t / 1e9 for x, t in zip(xs, ts)]
    pos = {x: i for i, x in enumerate(xs)}
    idx = tabulate_exact(ys, keep={pos[x] for x in pts if x in pos}, xs=[float(x) for x in xs])
    points = ([(x, y) for x, y in fb_pts if x < xs[0]] + [(float(xs[i]), _sig(ys[i])) for i in idx]
              + [(x, y) for x, y in fb_pts if x > xs[-1]])
    desc = (f"kernel map: {len(runs)} kernel runs over ctx = {xs[0]}..{xs[-1]}, per run piecewise linear in the "
            f"context (whole KV blocks when one wave) through the fit points; outside: {form.describe()}")
    return tuple((float(_sig(x, 9)), float(y)) for x, y in points), desc


#: kinds whose y is a rate (time = x-proportional work / y); the others (``*_us``) are times
RATE_KINDS = ("gemm_tflops", "flash_tflops", "hbm_GBps", "decode_attn_GBps", "nic_GBps")
#: work per unit x of a rate kind up to a constant, as a function of x (time = work(x) / y): GEMM FLOPs are
#: linear in tokens m, causal attention quadratic in the sequence, bytes linear
_WORK_EXP = {"gemm_tflops": 1.0, "flash_tflops": 2.0, "hbm_GBps": 1.0, "decode_attn_GBps": 1.0, "nic_GBps": 1.0}
#: tabulation density of a fitted curve (points per factor of 2 in x)
POINTS_PER_OCTAVE = 8
#: Whether a GEMM curve's *default* base form (:func:`form_for`: curves with fewer than 5 fit points, where no
#: leave-one-out choice is made) is the wave form. Off: with v1 data the bf16 curves were ∝ m at large m (stream-K
#: like). :func:`choose_form` always tries the wave and stream-K forms (:func:`candidate_forms`); on the /2
#: measurements it picks waves for every FP8 curve (an exact 128x128 wave staircase) and stream-K for bf16 ones.
GEMM_WAVES = False
#: CTA tiles (BLOCK_M, BLOCK_N) a GEMM curve's wave model may pick (cuBLAS / CUTLASS Hopper configurations)
GEMM_TILES = ((64, 128), (64, 256), (128, 128), (128, 256), (256, 128))
#: M-tile heights of the stream-K GEMM forms (:class:`Form` ``streamk``)
GEMM_STREAMK_BM = (64, 128, 256)
#: leave-one-out scores closer than this (|error| units, plus ``LOO_REL_TIE`` of the best score) are a tie
#: (:func:`choose_form`): the earlier candidate is kept. Relative part: on the v7 grouped bf16 gate+up curve the
#: form alone beat the same form through the fit points by 0.5 % of the score and missed a held-out dip by 13 %
LOO_TIE = 1e-4
LOO_REL_TIE = 0.02
#: smallest relative jump of a form's work that is tabulated as a step (both sides; smaller ones interpolate)
STEP_MIN_JUMP = 0.03
#: flash-attention query / key block (FA2/FA3 and SDPA's flash backend on Hopper)
FLASH_BLOCK = 128
#: the per-token work of an MoE block's form (``Form.per_token``, in active experts' weights per token) that
#: :func:`choose_form` may pick: the block streams each active expert's weights once, and every token copy also costs
#: its permute / unpermute and its rows of MMA work (v2 H200 measurement: ~0.5 µs per token against ~12 µs per expert)
MOE_PER_TOKEN = (1 / 128, 1 / 64, 1 / 32, 1 / 16, 1 / 8, 1 / 4, 1 / 2, 1.0)
#: KV block lengths a decode-attention curve's block form may pick (split-KV kernels walk the context in blocks:
#: SDPA at batch 16 takes as long at context 432 as at 512, then +50 % at 608)
DECODE_KV_BLOCKS = (64, 128, 256)


@dataclass(frozen=True)
class Form:
    """The physical base form of a curve's time, ``t(x) = max(floor, c + s * w(x))`` (:func:`fit_form`).

    ``w`` is the curve's work in *quantised* units: ``"linear"`` w = x (bytes, tokens of a collective);
    ``"gemm"`` w = waves of CTA tiles, ``ceil(n_experts * ceil(m / bm) * ceil(n / bn) / sm_count)`` (tile and wave
    quantisation: the time of an m that fills a partial wave is the time of the full wave); ``"flash"`` w = causal
    block-pairs per SM, ``max(heads * nb (nb + 1) / 2 / sm_count, nb)`` with ``nb = ceil(s / 128)`` (total work
    spread over the SMs, but never less than the longest CTA's ``nb`` blocks); ``"experts"`` (the ``moe_us`` block)
    w = the expected number of this rank's ``n`` experts that ``x`` uniformly routed tokens reach,
    ``n * (1 - (1 - top_k / experts) ** x)`` (each active expert streams its weights once: the block's time follows
    the active experts at small batch, then its per-token work); ``"power"`` w = x^e (no shape)."""

    work: str = "linear"
    exp: float = 1.0
    n: int = 0
    experts: int = 1
    heads: int = 0
    tile: tuple[int, int] = (128, 128)
    sm_count: int = 132
    #: weight of the interpolated fit-point residual (1: the curve passes through every fit point; 0: the base
    #: form alone, which averages the fit points' jitter instead of following it)
    lam: float = 1.0
    #: GEMM only: stream-K scheduling (the tiles' work is spread evenly over the SMs: no wave ceiling, only the
    #: tile quantisation of m)
    streamk: bool = False
    #: ``"experts"`` only: experts per token (``experts`` is then the model's expert count, ``n`` the rank's), and
    #: the work of one token in units of one active expert's (the block's per-token part: permute, unpermute,
    #: the rows' MMA work), a candidate of ``MOE_PER_TOKEN``
    top_k: int = 0
    per_token: float = 0.0

    def w(self, x: float) -> float:
        if self.work == "gemm":
            bm, bn = self.tile
            tiles = self.experts * math.ceil(x / bm - 1e-9) * math.ceil(self.n / bn)
            return float(tiles / self.sm_count if self.streamk else math.ceil(tiles / self.sm_count - 1e-9))
        if self.work == "loglog":
            return 1.0
        if self.work == "experts":
            return self.n * (1.0 - (1.0 - self.top_k / self.experts) ** x) + self.per_token * x
        if self.work == "kvblocks":  # the context in whole KV blocks of a split-KV decode kernel
            return float(math.ceil(x / self.tile[0] - 1e-9) * self.tile[0])
        if self.work == "flash":
            nb = math.ceil(x / FLASH_BLOCK - 1e-9)
            return max(self.heads * nb * (nb + 1) / 2 / self.sm_count, float(nb))
        return x ** self.exp

    def describe(self) -> str:
        """A short name of the form (recorded in each fitted entry's ``source``)."""
        if self.work == "gemm":
            w = (f"stream-K m-tiles of {self.tile[0]}" if self.streamk
                 else f"waves of {self.tile[0]}x{self.tile[1]} tiles")
        elif self.work == "flash":
            w = f"flash blocks of {FLASH_BLOCK}"
        elif self.work == "kvblocks":
            w = f"KV blocks of {self.tile[0]}"
        elif self.work == "loglog":
            return "form: log-log interpolation of the fit points"
        elif self.work == "experts":
            w = f"active experts of {self.n} (top-{self.top_k} of {self.experts}) + {self.per_token:g} per token"
        else:
            w = f"power x^{self.exp:g}"
        return f"form: {w}, " + ("through the fit points" if self.lam == 1.0 else "form alone")

    def steps(self, lo: float, hi: float) -> list[float]:
        """x values inside ``[lo, hi]`` where ``w`` jumps (tabulated on both sides so the table keeps the steps)."""
        if self.work == "gemm":
            bm = self.tile[0]
            out = []
            for j in range(max(1, int(lo // bm)), int(hi // bm) + 1):
                if self.w(j * bm + 1) > self.w(j * bm) * (1 + STEP_MIN_JUMP):
                    out += [float(j * bm), float(j * bm + 1)]
            return [x for x in out if lo < x < hi]
        if self.work == "kvblocks":
            b = self.tile[0]
            js = range(max(1, int(lo // b)), min(int(hi // b), int(1 / STEP_MIN_JUMP)) + 1)
            return [x for j in js for x in (float(j * b), float(j * b + 1)) if lo < x < hi]
        return []


def form_for(kind: str, shape: dict | None = None, sm_count: int = 132) -> Form:
    """The base form of a curve of ``kind`` (``shape``: GEMM ``n`` / ``n_experts``, attention ``heads``, MoE block
    ``n_experts`` / ``top_k`` / ``n_local``)."""
    shape = shape or {}
    if kind == "gemm_tflops" and shape.get("n") and GEMM_WAVES:
        return Form("gemm", n=int(shape["n"]), experts=int(shape.get("n_experts", 1)), sm_count=sm_count)
    if kind == "flash_tflops" and shape.get("heads"):
        return Form("flash", heads=int(shape["heads"]), sm_count=sm_count)
    if kind == "moe_us" and shape.get("n_experts") and shape.get("top_k"):
        return Form("experts", n=int(shape.get("n_local") or shape["n_experts"]), experts=int(shape["n_experts"]),
                    top_k=int(shape["top_k"]))
    return Form("power", exp=_WORK_EXP.get(kind, 1.0) if kind in RATE_KINDS else 1.0)


def _base(form: Form, p: tuple[float, float, float], x: float) -> float:
    floor, c, s = p
    return max(floor, c + s * form.w(x))


def fit_form(form: Form, xs: list[float], ts: list[float]) -> tuple[float, float, float]:
    """Least-squares fit (in log time) of ``(floor, c, s)`` of ``t = max(floor, c + s * w(x))`` to the points:
    the launch / latency floor, the fixed cost above it, and the time per unit of work (1 / rate)."""
    import numpy as np
    from scipy.optimize import least_squares

    w = np.array([form.w(x) for x in xs])
    t = np.array(ts)
    lt = np.log(t)

    def res(q):
        floor, c, s = np.exp(q)
        return np.log(np.maximum(floor, c + s * w)) - lt

    big = int(np.argmax(w))
    s0 = max(t[big] / max(w[big], 1e-300), 1e-300)
    starts = [(t.min(), 0.1 * t.min(), s0), (0.5 * t.min(), 0.5 * t.min(), s0)]
    order = np.argsort(w)
    if len(w) >= 2 and w[order[-1]] > w[order[-2]] and t[order[-1]] > t[order[-2]]:
        # the line through the two largest-work points (the bandwidth / compute regime), floor at the minimum
        i, j = order[-1], order[-2]
        sl = (t[i] - t[j]) / (w[i] - w[j])
        starts.append((t.min(), max(t[i] - sl * w[i], 1e-3 * t.min()), sl))
    best = None
    for f0, c0, s0 in starts:
        q0 = np.log([f0, max(c0, 1e-300), s0])
        r = least_squares(res, q0, method="trf", x_scale=1.0, max_nfev=400)
        if best is None or r.cost < best.cost:
            best = r
    floor, c, s = (float(v) for v in np.exp(best.x))
    return floor, c, s


def _hybrid(form: Form, p, xs: list[float], ts: list[float]):
    """``t(x) = base(x) * exp(rho(x))``: the fitted base form times its log-residual at the fit points,
    interpolated between neighbouring fit points (held at the end values outside): passes through every fit
    point, follows the form between them (floor / wave steps / knee), and the residual carries the smooth
    efficiency drift. The residual is linear in ``log x``, except across a step of a GEMM or KV-block form
    (neighbours with different quantised work): there it is linear in ``log w(x)``, so an ``x`` with the same
    waves / tiles / KV blocks as a fit point takes that point's residual (the staircase: same quantised work, same
    time)."""
    lx = [math.log(x) for x in xs]
    rho = [math.log(t / _base(form, p, x)) for x, t in zip(xs, ts)]
    quant = form.work in ("gemm", "kvblocks")
    lw = [math.log(max(form.w(x), 1e-300)) for x in xs] if quant else []

    def f(x: float) -> float:
        g = math.log(x)
        if g <= lx[0]:
            r = rho[0]
        elif g >= lx[-1]:
            r = rho[-1]
        else:
            j = bisect.bisect_right(lx, g) - 1
            j = min(j, len(lx) - 2)
            if quant and lw[j + 1] > lw[j] + 1e-12:
                u = min(1.0, max(0.0, (math.log(max(form.w(x), 1e-300)) - lw[j]) / (lw[j + 1] - lw[j])))
            else:
                u = (g - lx[j]) / (lx[j + 1] - lx[j])
            r = rho[j] + u * (rho[j + 1] - rho[j])
        return _base(form, p, x) * math.exp(form.lam * r)

    return f


@lru_cache(maxsize=4096)
def _fit_cached(form: Form, xs: tuple[float, ...], ts: tuple[float, ...]) -> tuple[float, float, float]:
    """:func:`fit_form` memoised (leave-one-out fits each subset once per form, for both ``lam``)."""
    return fit_form(form, list(xs), list(ts))


def _loo_error(form: Form, xs: list[float], ts: list[float]) -> float:
    """Leave-one-out median |error| of the hybrid over the inner fit points (model selection on fit rows only)."""
    errs = []
    for i in range(1, len(xs) - 1):
        xi, ti = xs[:i] + xs[i + 1:], ts[:i] + ts[i + 1:]
        f = _hybrid(form, _fit_cached(replace(form, lam=1.0), tuple(xi), tuple(ti)), xi, ti)
        errs.append(abs(f(xs[i]) / ts[i] - 1))
    errs.sort()
    return (errs[len(errs) // 2] + max(errs)) if errs else 0.0


def candidate_forms(kind: str, shape: dict | None = None, sm_count: int = 132) -> list[Form]:
    """The base forms :func:`choose_form` picks from for a curve of ``kind``: always the kind's power form and
    plain log-log interpolation (``loglog``: the fit points joined by straight lines in log-log space); GEMMs
    also the wave-quantised form per CTA tile of ``GEMM_TILES`` (``waves = ceil(tiles / SMs)``: a kernel that
    maps one tile per CTA) and the stream-K form per ``GEMM_STREAMK_BM`` (tile quantisation of m only);
    flash attention also its block form; decode attention the context in whole KV blocks (``DECODE_KV_BLOCKS``)."""
    shape = shape or {}
    base = form_for(kind, shape, sm_count)
    out = [base] if base.work != "power" else []
    out.append(Form("power", exp=_WORK_EXP.get(kind, 1.0) if kind in RATE_KINDS else 1.0))
    if kind == "gemm_tflops" and shape.get("n"):
        g = Form("gemm", n=int(shape["n"]), experts=int(shape.get("n_experts", 1)), sm_count=sm_count)
        out += [replace(g, tile=t) for t in GEMM_TILES]
        out += [replace(g, tile=(bm, 128), streamk=True) for bm in GEMM_STREAMK_BM]
    if kind == "decode_attn_GBps":
        out += [Form("kvblocks", tile=(b, 1)) for b in DECODE_KV_BLOCKS]
    if base.work == "experts":
        out += [replace(base, per_token=r) for r in MOE_PER_TOKEN]
    out.append(Form("loglog"))
    return list(dict.fromkeys(out))


def choose_form(kind: str, pts: list[tuple[float, float]], shape: dict | None = None,
                sm_count: int = 132) -> Form:
    """The base form for a curve, chosen by leave-one-out over the curve's *fit* points only (median + max
    |error|) among :func:`candidate_forms`, and for every form but ``loglog`` whether the fit-point residual is
    interpolated (``lam`` 1) or the form alone is used (``lam`` 0). Scores within ``LOO_TIE`` (+ ``LOO_REL_TIE``) of the best so far
    keep the earlier candidate (forms the fit rows cannot tell apart: the simpler / wave form wins)."""
    base = form_for(kind, shape, sm_count)
    if len(pts) < 5:
        return base
    xs, ts = _times(kind, pts)
    best = None
    for f in candidate_forms(kind, shape, sm_count):
        for lam in ((1.0,) if f.work == "loglog" else (1.0, 0.0)):
            g = replace(f, lam=lam)
            e = _loo_error(g, xs, ts)
            if best is None or e < best[0] * (1 - LOO_REL_TIE) - LOO_TIE:
                best = (e, g)
    return best[1]


def _times(kind: str, pts: list[tuple[float, float]]) -> tuple[list[float], list[float]]:
    rate = kind in RATE_KINDS
    e = _WORK_EXP.get(kind, 1.0)
    return [float(x) for x, _ in pts], [(float(x) ** e) / y if rate else float(y) for x, y in pts]


def fit_curve(kind: str, pts: list[tuple[float, float]], form: Form | None = None) -> tuple[tuple[float, float], ...]:
    """Fitted calibration points from measured ``(x, y)`` (x increasing):

    1. **physical base form** (:class:`Form`, :func:`fit_form`): the implied time ``t(x)`` (``work(x) / y`` for
       rate kinds, ``y`` for ``*_us``) is fitted with ``max(floor, c + s * w(x))`` — the launch / latency floor,
       a fixed cost and the time per unit of *quantised* work (GEMM: waves of CTA tiles; flash attention: causal
       block pairs per SM; bytes for copies and collectives);
    2. **residual**: the log-ratio of measured to base time at every fit point, interpolated linearly in log x, so
       the curve passes through every fit point (kernel-selection steps seen at a fitted x are kept) and between
       points follows the form (floor, knee, wave steps) times a smoothly varying efficiency;
    3. **tabulation** for ``CalibrationEntry.interpolate`` (linear in ``log x``): ``POINTS_PER_OCTAVE`` points per
       doubling of x, the fit points, and both sides of every wave step of the form.

    With fewer than 3 points the base form is not fitted (pure log-log interpolation of the time).
    """
    xs, ts = _times(kind, pts)
    if len(xs) == 1:
        return ((xs[0], float(pts[0][1])),)
    form = form or form_for(kind)
    if len(xs) >= 3:
        f = _hybrid(form, fit_form(form, xs, ts), xs, ts)
    else:
        lt = [math.log(t) for t in ts]  # two points: the log-log line through them
        a = (lt[1] - lt[0]) / (math.log(xs[1]) - math.log(xs[0]))
        f = (lambda x, a=a: ts[0] * (x / xs[0]) ** a)
    lx0, lx1 = math.log(xs[0]), math.log(xs[-1])
    n = max(1, math.ceil((lx1 - lx0) / math.log(2) * POINTS_PER_OCTAVE))
    grid = sorted({*(math.exp(lx0 + (lx1 - lx0) * j / n) for j in range(1, n)), *xs, *form.steps(xs[0], xs[-1])})
    rate = kind in RATE_KINDS
    e = _WORK_EXP.get(kind, 1.0)
    out = []
    for x in grid:
        t = ts[xs.index(x)] if x in xs else f(x)
        out.append((x, (x ** e) / t if rate else t))
    dedup = [out[0]]
    for x, y in out[1:]:
        if x > dedup[-1][0] * (1 + 1e-9):
            dedup.append((x, y))
    return tuple((float(_sig(x, 9)), float(_sig(y))) for x, y in dedup)


def _sig(v: float, digits: int = 6) -> float:
    return float(f"{v:.{digits}g}")


def _geomean(ys: list[float]) -> float:
    return math.exp(sum(math.log(y) for y in ys) / len(ys))


def calibrate(measurements: dict, *, gpu: str | None = None, holdout: Holdout = Holdout(),
              measurements_path: str | list[str] = "") -> dict:
    """Fit a calibration file (a dict ready for YAML) from a ``kernels/measure.py`` document (several files:
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


def dump_calibration(doc: dict, path: str | Path) -> None:
    """Write a calibration file (YAML, or JSON for ``*.json``); points as flow lists."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    if p.suffix == ".json":
        p.write_text(json.dumps(doc, indent=1))
        return

    class _D(yaml.SafeDumper):
        pass

    def _seq(dumper, data):
        flow = all(not isinstance(v, (dict, list, tuple)) for v in data) and len(data) <= 8
        return dumper.represent_sequence("tag:yaml.org,2002:seq", data, flow_style=flow)

    _D.add_representer(list, _seq)
    _D.add_representer(tuple, _seq)
    head = (f"# rackbed calibration file ({FILE_SCHEMA}): {doc['meta'].get('gpu')} measured "
            f"{doc['meta'].get('date')} by `rackbed calibrate`; do not edit by hand.\n")
    p.write_text(head + yaml.dump(doc, Dumper=_D, sort_keys=False, width=120))


def load_calibration_file(path: str | Path) -> CalibrationFile:
    """Read a calibration file (YAML or JSON) with its ``meta``; one-line UserError on mistakes."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise UserError(f"{p}: cannot read calibration file: {exc.strerror or exc}") from exc
    try:
        data = json.loads(text) if p.suffix == ".json" else yaml.load(text, Loader=_YAML_LOADER)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise UserError(f"{p}: not valid {'JSON' if p.suffix == '.json' else 'YAML'}: "
                        f"{' '.join(str(exc).split())}") from exc
    if not isinstance(data, dict):
        raise UserError(f"{p}: a calibration file must be a mapping with 'entries'")
    meta = data.get("meta", {})
    if meta and meta.get("schema", FILE_SCHEMA) not in FILE_SCHEMAS:
        raise UserError(f"{p}: meta.schema must be one of {', '.join(FILE_SCHEMAS)}, got {meta.get('schema')!r}")
    try:
        return CalibrationFile.model_validate({**data, "meta": meta or {}, "path": str(p)})
    except ValidationError as exc:
        raise from_validation(exc, p) from exc


#: serving stacks a calibration can describe: ``rackbed`` is the engine in this repository, calibrated from its own
#: measurements (files without ``meta.stack``); the others are calibrated from imported per-operator tables
STACKS = ("rackbed", "trtllm", "sglang", "vllm")


def _read_meta(f: Path) -> dict:
    """A calibration file's ``meta`` block, read cheaply (JSON files keep it at the top)."""
    if f.suffix == ".json":
        data = json.loads(f.read_text())
    else:
        data = yaml.load(f.read_text(), Loader=_YAML_LOADER) or {}
    meta = data.get("meta", {}) if isinstance(data, dict) else {}
    return meta if isinstance(meta, dict) else {}


def file_stack(meta: dict) -> str:
    """The serving stack a calibration file describes (``meta.stack``; absent: ``rackbed``)."""
    return str(meta.get("stack") or "rackbed")


@lru_cache(maxsize=16)
def _shipped(directory: str) -> tuple[tuple[str, str, str], ...]:
    """``(gpu, stack, path)`` of every calibration file shipped in ``directory``."""
    out = []
    d = Path(directory)
    if d.is_dir():
        for f in sorted(d.glob("*.yaml")) + sorted(d.glob("*.json")):
            try:
                meta = _read_meta(f)
            except (yaml.YAMLError, json.JSONDecodeError, OSError, AttributeError):
                continue
            if meta.get("gpu"):
                out.append((str(meta["gpu"]), file_stack(meta), str(f)))
    return tuple(out)


def shipped_stacks(gpu_name: str, directory: str | Path | None = None) -> list[str]:
    """The stacks with a shipped calibration for GPU model ``gpu_name``, in :data:`STACKS` order."""
    have = {st for g, st, _ in _shipped(str(directory or CALIBRATION_DIR)) if g == gpu_name}
    return [st for st in STACKS if st in have] + sorted(have - set(STACKS))


def default_calibration_for(gpu_name: str, directory: str | Path | None = None,
                            stack: str | None = None) -> CalibrationTable | None:
    """The shipped calibration for GPU model ``gpu_name`` (``GpuSpec.name``, e.g. ``H200-SXM``) and serving
    ``stack``, or None when none is shipped — the simulator then uses the first-principles constants alone.
    ``stack`` None or ``auto``: the first of :data:`STACKS` that has a file for the GPU (the engine's own
    measurements before imported tables). A named stack without a file for the GPU is a UserError naming those
    that exist."""
    files = {st: path for g, st, path in _shipped(str(directory or CALIBRATION_DIR)) if g == gpu_name}
    if stack in (None, "auto"):
        for st in shipped_stacks(gpu_name, directory):
            return _load_shipped(files[st])
        return None
    if stack not in files:
        have = ", ".join(shipped_stacks(gpu_name, directory)) or "none"
        raise UserError(f"stack: no calibration of stack {stack!r} is shipped for {gpu_name} (shipped: {have}; "
                        f"use stack: auto, or make one with `rackbed calibrate`)")
    return _load_shipped(files[stack])


def _load_shipped(path: str) -> CalibrationFile:
    """A shipped file, read once per process while it is unchanged on disk (tables are immutable; a search or
    sweep builds many scenarios on the same GPU)."""
    st = Path(path).stat()
    return _load_cached(path, st.st_mtime_ns, st.st_size)


@lru_cache(maxsize=8)
def _load_cached(path: str, mtime_ns: int, size: int) -> CalibrationFile:
    return load_calibration_file(path)


def calibration_for_topology(topo, directory: str | Path | None = None,
                             stack: str | None = None) -> CalibrationTable | None:
    """:func:`default_calibration_for` the topology's GPU model (first GPU; mixed GPUs are not calibrated)."""
    names = {topo.gpu_spec(i).name for i in topo.gpu_ids}
    if len(names) != 1:
        return None
    return default_calibration_for(names.pop(), directory, stack)


def describe_calibration(table: CalibrationTable | None, gpu_name: str | None = None) -> str:
    """One line for the simulator's output: what calibration is in use (or that none is, and why that matters)."""
    if table is None:
        g = f" for {gpu_name}" if gpu_name else ""
        return (f"uncalibrated{g}: first-principles constants (datasheet peaks, assumed efficiencies; "
                f"see calibration/README.md for the uncertainty)")
    meta = getattr(table, "meta", {}) or {}
    gpus = sorted({e.gpu for e in table.entries})
    kinds = sorted({e.kind for e in table.entries})
    path = getattr(table, "path", "") or "an in-memory table"
    try:
        path = str(Path(path).resolve().relative_to(CALIBRATION_DIR.parent))
    except ValueError:
        pass
    if meta.get("source") == "aiconfigurator-core":
        return (f"calibrated ({file_stack(meta)} stack, measured tables): {meta.get('gpu')} from {path} "
                f"(aiconfigurator-core {meta.get('package_version')}, {meta.get('system')}/{meta.get('backend')}, "
                f"{len(kinds)} kinds, {len(table.entries)} curves)")
    return (f"calibrated ({file_stack(meta)} stack): {meta.get('gpu') or ', '.join(gpus)} from {path} "
            f"({meta.get('date', 'undated')}, {len(kinds)} kinds, {len(table.entries)} curves)")


# ------------------------------------------------------------------------------------------------ predictions

@dataclass
class Prediction:
    """The simulator's time for one measured row (``predicted_s``) and what produced it."""

    row_id: str
    bench: str
    measured_s: float
    predicted_s: float
    model: str
    extra: dict = field(default_factory=dict)

    @property
    def rel_error(self) -> float:
        return (self.predicted_s - self.measured_s) / self.measured_s


def predict_row(r: dict, calib: CalibrationTable | None, topo, model=None) -> Prediction | None:
    """The simulator's prediction for measured row ``r`` (the cost function the simulator calls, with ``calib``),
    or None for rows without a model (errors, unknown benchmarks). ``model``: a ModelSpec for the attention rows
    (default: Qwen3-235B-A22B with the row's head counts)."""
    from sim.costs.attention import full_attention_decode, full_attention_prefill
    from sim.costs.collective import allreduce_time, p2p_copy_time
    from sim.costs.gemm import gemm_time, grouped_gemm_time, hbm_rate_Bps

    if r.get("error") or not r.get("median_us"):
        return None
    gpu = topo.gpu_spec(topo.gpu_ids[0])
    t = r["median_us"] * 1e-6
    b, rid = r["bench"], row_id(r)
    if b == "gemm":
        if r["op"] == "grouped":
            c = grouped_gemm_time(gpu, [r["m"]] * r["n_experts"], r["n"], r["k"], r["fmt"], calib=calib)
        else:
            c = gemm_time(gpu, r["m"], r["n"], r["k"], r["fmt"], calib=calib)
        return Prediction(rid, b, t, c.total_s, "gemm_time" if r["op"] == "dense" else "grouped_gemm_time",
                          {"calibrated": c.calibrated})
    if b == "hbm_copy":
        return Prediction(rid, b, t, r["bytes"] / hbm_rate_Bps(gpu, r["bytes"], calib)
                          + kernel_fixed_us(calib, gpu) * 1e-6, "hbm_rate_Bps + kernel_fixed_us")
    if b in ("flash_prefill", "attn_decode"):
        m = _attn_model(model, r)
        if b == "flash_prefill":
            a = full_attention_prefill(gpu, m, [(r["seq"], 0)], tp=1, calib=calib)
            return Prediction(rid, b, t, a.core_s, "full_attention_prefill.core_s")
        a = full_attention_decode(gpu, m, [r["ctx"]] * r["batch"], tp=1, page_tokens=1, calib=calib)
        return Prediction(rid, b, t, a.core_s, "full_attention_decode.core_s")
    if b == "allreduce":
        c = allreduce_time(topo, list(range(r["n_ranks"])), r["size_bytes"], algo=r["algo"], calib=calib)
        return Prediction(rid, b, t, c.total_s, "allreduce_time", {"calibrated": c.calibrated})
    if b == "p2p_copy":
        c = p2p_copy_time(topo, r["src"], r["dst"], r["size_bytes"], calib=calib)
        return Prediction(rid, b, t, c.total_s, "p2p_copy_time", {"calibrated": c.calibrated})
    if b == "moe_block":
        return _predict_moe(r, calib, gpu, t, rid)
    return None


def _predict_moe(r: dict, calib: CalibrationTable | None, gpu, t: float, rid: str) -> Prediction | None:
    """A ``moe_block`` row: ``routed`` from the table's ``moe_us`` entry (the row's key), else as the step model
    prices the block without one (the routed grouped GEMMs of :func:`sim.costs.gemm.expert_mlp_time` over the
    uniform-routing histogram; dispatch and combine are nothing on one rank); ``router_gemm`` as the step model's
    router term (:func:`sim.costs.gemm.gemm_time`, bf16 ``[T, hidden] x [hidden, n_experts]``); ``layer`` the two
    together. The other parts (the router with its top-k, the pieces alone) have no model of their own (None)."""
    from sim.costs.gemm import binomial_histogram, expert_mlp_time, gemm_time

    part, T = r.get("part"), int(r["tokens"])
    E, ep, tp = int(r["n_experts"]), int(r.get("ep", 1)), int(r.get("tp", 1))

    def routed() -> tuple[float, str]:
        us = None if calib is None else calib.lookup("moe_us", gpu.name, T, **{f: r[f] for f in KINDS["moe_us"]})
        if us is not None:
            return us * 1e-6, "moe_us"
        hist = binomial_histogram(T, r["top_k"] / E, E // ep)
        return (expert_mlp_time(gpu, r["hidden"], r["inter"] // tp, hist, r["fmt"], calib=calib).total_s,
                "expert_mlp_time")

    def router() -> float:
        return gemm_time(gpu, T, E, r["hidden"], "bf16", calib=calib).total_s

    if part == "routed":
        s, how = routed()
        return Prediction(rid, "moe_block", t, s, how, {"calibrated": how == "moe_us"})
    if part == "router_gemm":
        return Prediction(rid, "moe_block", t, router(), "gemm_time (router)")
    if part == "layer":
        s, how = routed()
        return Prediction(rid, "moe_block", t, router() + s, f"gemm_time (router) + {how}")
    return None


def _attn_model(model, r: dict):
    from engine.core.model import get_model

    m = model or get_model("qwen3-235b-a22b")
    if (m.n_q_heads, m.n_kv_heads, m.head_dim) != (r["n_q_heads"], r["n_kv_heads"], r["head_dim"]):
        m = m.model_copy(update={"n_q_heads": r["n_q_heads"], "n_kv_heads": r["n_kv_heads"],
                                 "head_dim": r["head_dim"]})
    return m
