"""Calibration: measured kernel rows -> :class:`~sim.costs.calibration.CalibrationTable` entries, the shipped
calibration files, and the simulator's predictions for measured rows (``rackbed calibrate`` / ``validate``).

Measurements are the rows of ``kernels/measure.py`` (``{"bench": ..., "median_us": ..., shape fields}``; see its
docstring for the FLOP / byte conventions, which are the cost models'). Fitting is per curve:

* **curves** (one per kind and key): ``gemm_tflops`` per (fmt, n, k), x = tokens per expert ``m``, y = FLOPs over
  the measured time (the calibrated GEMM path has no fixed cost); ``flash_tflops`` per head_dim, x = sequence
  length, y = causal FLOPs / (time - ``KERNEL_FIXED_US``) (the model adds that fixed cost to the core); ``hbm_GBps``,
  x = bytes moved (read + write), y = bytes / (time - ``KERNEL_FIXED_US``) from ``hbm_copy``; ``allreduce_us`` per
  (algo, n_ranks), x = bytes per rank, y = µs; ``dispatch_us`` / ``combine_us`` from ``rackbed bench`` JSON.
* **fit** (:func:`fit_curve`) = log-log interpolation of the implied time through the curve's *fit* points,
  tabulated densely for ``CalibrationEntry.interpolate``; medians of >= 15 repeats, no further smoothing.
* **hold-out** (:class:`Holdout`): within each curve every third point (indices 1, 4, 7, ... — never an end
  point, so held-out points are interpolated, not extrapolated) and, for GEMMs, entire (n, k) shapes
  (default: the O projection ``n=4096, k=8192``). A held-out shape is predicted by a per-format *fallback* entry
  (key ``fmt`` only: the geometric mean over the fitted dense shapes of their fitted curves), which is also what
  the simulator uses for any GEMM shape that was not measured.

The calibration file is a CalibrationTable (``version: 1``, ``entries``) plus a ``meta`` block (device, driver,
torch / CUDA / NCCL versions, date, the measurement file, the hold-out rule and the held-out row ids).
:func:`load_calibration_file` reads it (``meta`` kept on the returned :class:`CalibrationFile`);
:func:`default_calibration_for` finds the shipped file for a GPU model (``calibration/*.yaml``);
:func:`describe_calibration` is the one line the simulator prints.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

import yaml
from pydantic import ValidationError

from sim.costs import constants as C
from sim.costs.calibration import CalibrationEntry, CalibrationTable
from topology.errors import UserError, from_validation

#: calibration file schema (``meta.schema``); the table itself is CalibrationTable version 1
FILE_SCHEMA = "rackbed.calibration/1"
#: where the shipped calibration files live (package data next to sim/)
CALIBRATION_DIR = Path(__file__).resolve().parents[1] / "calibration"
#: torch device name -> topology GpuSpec.name
DEVICE_TO_GPU = {"NVIDIA H200": "H200-SXM", "NVIDIA H100 80GB HBM3": "H100-SXM", "NVIDIA B200": "B200-HGX"}
FIXED_S = C.KERNEL_FIXED_US * 1e-6


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
    shapes: tuple[tuple[int, int], ...] = ((4096, 8192),)

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
        return f"hbm_copy/{r['size_bytes']}"
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
    return f"{b}/{json.dumps({k: v for k, v in sorted(r.items()) if k != 'median_us'})}"


def curve_of(r: dict) -> tuple[str, tuple[tuple[str, object], ...], float, float] | None:
    """``(kind, key, x, y)`` of the calibration point a measured row gives, or None if no calibration kind
    covers it (p2p copies, decode attention — see calibration/README.md — and rows with errors)."""
    if r.get("error") or not r.get("median_us") or r["median_us"] <= 0:
        return None
    t = r["median_us"] * 1e-6
    b = r["bench"]
    if b == "gemm":
        flops = 2.0 * r["m"] * r.get("n_experts", 1) * r["n"] * r["k"]
        return "gemm_tflops", (("fmt", r["fmt"]), ("n", r["n"]), ("k", r["k"])), float(r["m"]), flops / t / 1e12
    if b == "flash_prefill":
        flops = 4.0 * r["n_q_heads"] * r["head_dim"] * r["seq"] * (r["seq"] + 1) / 2
        return "flash_tflops", (("head_dim", r["head_dim"]),), float(r["seq"]), flops / _net(t) / 1e12
    if b == "hbm_copy":
        return "hbm_GBps", (), float(r["bytes"]), r["bytes"] / _net(t) / 1e9
    if b == "allreduce":
        return ("allreduce_us", (("algo", r["algo"]), ("n_ranks", r["n_ranks"])), float(r["size_bytes"]),
                r["median_us"])
    if b in ("dispatch", "combine"):
        return (f"{b}_us", (("n_ranks", r["n_ranks"]), ("hidden", r["hidden"]), ("phase", r["phase"])),
                float(r["tokens"]), r["median_us"])
    return None


def _net(t_s: float) -> float:
    """Measured time less the model's fixed kernel cost (never below half the measurement)."""
    return max(t_s - FIXED_S, 0.5 * t_s)


def split_rows(rows: list[dict], holdout: Holdout) -> tuple[set[str], set[str]]:
    """``(fit_ids, holdout_ids)`` over the rows that give calibration points (module docstring)."""
    curves: dict[tuple, list[tuple[float, str]]] = defaultdict(list)
    fit, held = set(), set()
    for r in rows:
        c = curve_of(r)
        if c is None:
            continue
        rid = row_id(r)
        if c[0] == "gemm_tflops" and (r["n"], r["k"]) in holdout.shapes:
            held.add(rid)
            continue
        curves[(c[0], c[1])].append((c[2], rid))
    for pts in curves.values():
        pts.sort()
        for i, (_, rid) in enumerate(pts):
            inner = 0 < i < len(pts) - 1
            if inner and holdout.every > 0 and i % holdout.every == holdout.offset % holdout.every:
                held.add(rid)
            else:
                fit.add(rid)
    return fit, held


def fit_entries(rows: list[dict], gpu: str, fit_ids: set[str], source: str = "") -> list[CalibrationEntry]:
    """Calibration entries from the fit rows: one per (kind, key) curve, plus a per-format GEMM fallback (key
    ``fmt`` only) from the dense GEMM curves (geometric mean of their interpolants at every fitted ``m``)."""
    curves: dict[tuple, dict[float, list[float]]] = defaultdict(lambda: defaultdict(list))
    dense_keys: dict[str, list[tuple]] = defaultdict(list)
    for r in rows:
        if row_id(r) not in fit_ids:
            continue
        kind, key, x, y = curve_of(r)  # type: ignore[misc]
        curves[(kind, key)][x].append(y)
        if kind == "gemm_tflops" and r.get("op") == "dense" and (kind, key) not in dense_keys[r["fmt"]]:
            dense_keys[r["fmt"]].append((kind, key))
    entries = []
    for (kind, key), pts in curves.items():
        points = fit_curve(kind, [(x, _geomean(ys)) for x, ys in sorted(pts.items())])
        entries.append(CalibrationEntry(kind=kind, gpu=gpu, key=dict(key), points=points, source=source))
    by_key = {(e.kind, tuple(e.key.items())): e for e in entries}
    for fmt, keys in sorted(dense_keys.items()):
        es = [by_key[k] for k in keys]
        xs = sorted({x for e in es for x, _ in e.points})
        points = tuple((x, _geomean([e.interpolate(x) for e in es])) for x in xs)
        entries.append(CalibrationEntry(kind="gemm_tflops", gpu=gpu, key={"fmt": fmt}, points=points,
                                        source=f"{source}; fallback: geometric mean of {len(es)} dense shapes"))
    order = {"hbm_GBps": 0, "gemm_tflops": 1, "flash_tflops": 2, "allreduce_us": 3, "dispatch_us": 4,
             "combine_us": 5}
    entries.sort(key=lambda e: (order.get(e.kind, 9), -len(e.key), sorted(e.key.items(), key=str)))
    return entries


#: kinds whose y is a rate (time = x-proportional work / y); the others (``*_us``) are times
RATE_KINDS = ("gemm_tflops", "flash_tflops", "hbm_GBps", "nic_GBps")
#: work per unit x of a rate kind up to a constant, as a function of x (time = work(x) / y): GEMM FLOPs are
#: linear in tokens m, causal attention quadratic in the sequence, bytes linear
_WORK_EXP = {"gemm_tflops": 1.0, "flash_tflops": 2.0, "hbm_GBps": 1.0, "nic_GBps": 1.0}
#: tabulation density of a fitted curve (points per factor of 2 in x)
POINTS_PER_OCTAVE = 8


def fit_curve(kind: str, pts: list[tuple[float, float]]) -> tuple[tuple[float, float], ...]:
    """Fitted calibration points from measured ``(x, y)`` (x increasing):

    1. **log-log interpolation** of the implied time ``t(x)`` (``work(x) / y`` for rate kinds, ``y`` for
       ``*_us``): between measured points ``t`` is a power law in ``x`` — a straight line in log-log, exact for
       the two regimes that matter (constant time at the launch / latency floor, ``t ∝ x`` once bandwidth- or
       compute-bound). The curve passes through every fit point, so a calibrated shape at a measured ``x``
       returns the measured value (kernel-selection steps, e.g. a faster tile config at m = 128, are kept);
    2. **tabulation**: ``CalibrationEntry.interpolate`` is linear in ``log x`` (not log-log), so the curve is
       tabulated at ``POINTS_PER_OCTAVE`` points per doubling of ``x`` (for ``y ∝ x^a`` the two interpolants
       differ by at most ``(a · ln2 / 8)² / 8``: 0.1 % for a = 1, 0.4 % for a = 2).
    """
    xs = [float(x) for x, _ in pts]
    if len(xs) == 1:
        return ((xs[0], float(pts[0][1])),)
    rate = kind in RATE_KINDS
    e = _WORK_EXP.get(kind, 1.0)
    ts = [(x ** e) / y if rate else y for x, y in pts]
    lx, lt = [math.log(x) for x in xs], [math.log(max(t, 1e-300)) for t in ts]
    grid: list[float] = []
    for i in range(len(xs) - 1):
        n = max(1, math.ceil((lx[i + 1] - lx[i]) / math.log(2) * POINTS_PER_OCTAVE))
        grid += [lx[i] + (lx[i + 1] - lx[i]) * j / n for j in range(n)]
    grid.append(lx[-1])
    out = []
    j = 0
    for g in grid:
        while j < len(lx) - 2 and g > lx[j + 1]:
            j += 1
        f = (g - lx[j]) / (lx[j + 1] - lx[j])
        t = math.exp(lt[j] + f * (lt[j + 1] - lt[j]))
        x = math.exp(g)
        out.append((x, (x ** e) / t if rate else t))
    # exact end points / measured x (exp(log x) round-off) and strictly increasing x
    out[0], out[-1] = (xs[0], out[0][1]), (xs[-1], out[-1][1])
    dedup = [out[0]]
    for x, y in out[1:]:
        if x > dedup[-1][0] * (1 + 1e-12):
            dedup.append((x, y))
    return tuple((float(_sig(x)), float(_sig(y))) for x, y in dedup)


def _sig(v: float, digits: int = 6) -> float:
    return float(f"{v:.{digits}g}")


def _geomean(ys: list[float]) -> float:
    return math.exp(sum(math.log(y) for y in ys) / len(ys))


def calibrate(measurements: dict, *, gpu: str | None = None, holdout: Holdout = Holdout(),
              measurements_path: str = "") -> dict:
    """Fit a calibration file (a dict ready for YAML) from a ``kernels/measure.py`` document."""
    env = measurements.get("env", {})
    if measurements.get("dry_run"):
        gpu = gpu or "CPU-DRY-RUN"
    gpu = gpu or gpu_name_for_device(str(env.get("gpu_name", "")))
    rows = measurements.get("rows", [])
    fit_ids, held_ids = split_rows(rows, holdout)
    if not fit_ids:
        raise UserError(f"calibrate: {measurements_path or 'measurements'}: no usable rows to fit")
    src = (f"kernels/measure.py {env.get('date', '?')}, torch {env.get('torch', '?')}, CUDA {env.get('cuda', '?')}, "
           f"NCCL {env.get('nccl', '?')}")
    entries = fit_entries(rows, gpu, fit_ids, src)
    covered = sorted({row_id(r) for r in rows if curve_of(r) is None and not r.get("error") and "bench" in r
                      and r.get("median_us")})
    meta = {"schema": FILE_SCHEMA, "gpu": gpu, "device": env.get("gpu_name"), "gpu_count": env.get("gpu_count"),
            "driver": env.get("driver"), "torch": env.get("torch"), "cuda": env.get("cuda"),
            "nccl": env.get("nccl"), "python": env.get("python"), "date": env.get("date"),
            "measurements": measurements_path, "n_rows": len(rows), "n_fit": len(fit_ids),
            "holdout_rule": holdout.describe(), "holdout_shapes": [list(s) for s in holdout.shapes],
            "holdout": sorted(held_ids), "not_calibrated": covered,
            "errors": [f"{r.get('bench')}: {r['error']}" for r in rows if r.get("error")]}
    meta = json.loads(json.dumps(meta, default=str))  # plain types only (torch's version is a str subclass)
    table = CalibrationTable(entries=tuple(entries))
    return {"version": 1, "meta": meta, "entries": [e.model_dump(mode="json") for e in table.entries]}


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
        data = json.loads(text) if p.suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise UserError(f"{p}: not valid {'JSON' if p.suffix == '.json' else 'YAML'}: "
                        f"{' '.join(str(exc).split())}") from exc
    if not isinstance(data, dict):
        raise UserError(f"{p}: a calibration file must be a mapping with 'entries'")
    meta = data.get("meta", {})
    if meta and meta.get("schema", FILE_SCHEMA) != FILE_SCHEMA:
        raise UserError(f"{p}: meta.schema must be {FILE_SCHEMA!r}, got {meta.get('schema')!r}")
    try:
        return CalibrationFile.model_validate({**data, "meta": meta or {}, "path": str(p)})
    except ValidationError as exc:
        raise from_validation(exc, p) from exc


@lru_cache(maxsize=16)
def _shipped(directory: str) -> tuple[tuple[str, str], ...]:
    """``(gpu, path)`` of every calibration file shipped in ``directory``."""
    out = []
    d = Path(directory)
    if d.is_dir():
        for f in sorted(d.glob("*.yaml")) + sorted(d.glob("*.json")):
            try:
                meta = (yaml.safe_load(f.read_text()) or {}).get("meta", {})
            except (yaml.YAMLError, OSError, AttributeError):
                continue
            if isinstance(meta, dict) and meta.get("gpu"):
                out.append((str(meta["gpu"]), str(f)))
    return tuple(out)


def default_calibration_for(gpu_name: str, directory: str | Path | None = None) -> CalibrationTable | None:
    """The shipped calibration for GPU model ``gpu_name`` (``GpuSpec.name``, e.g. ``H200-SXM``), or None when
    none is shipped — the simulator then uses the first-principles constants alone."""
    for gpu, path in _shipped(str(directory or CALIBRATION_DIR)):
        if gpu == gpu_name:
            return load_calibration_file(path)
    return None


def calibration_for_topology(topo, directory: str | Path | None = None) -> CalibrationTable | None:
    """:func:`default_calibration_for` the topology's GPU model (first GPU; mixed GPUs are not calibrated)."""
    names = {topo.gpu_spec(i).name for i in topo.gpu_ids}
    if len(names) != 1:
        return None
    return default_calibration_for(names.pop(), directory)


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
    return (f"calibrated: {meta.get('gpu') or ', '.join(gpus)} from {path} ({meta.get('date', 'undated')}, "
            f"{len(kinds)} kinds, {len(table.entries)} curves)")


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
    from sim.costs.collective import allreduce_time
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
        return Prediction(rid, b, t, r["bytes"] / hbm_rate_Bps(gpu, r["bytes"], calib) + FIXED_S, "hbm_rate_Bps")
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
        s = r["size_bytes"] / (topo.p2p_GBps(r["src"], r["dst"]) * 1e9) + topo.p2p_latency_us(r["src"], r["dst"]) * 1e-6
        return Prediction(rid, b, t, s, "topology p2p_GBps + p2p_latency_us (no calibration kind)")
    return None


def _attn_model(model, r: dict):
    from engine.core.model import get_model

    m = model or get_model("qwen3-235b-a22b")
    if (m.n_q_heads, m.n_kv_heads, m.head_dim) != (r["n_q_heads"], r["n_kv_heads"], r["head_dim"]):
        m = m.model_copy(update={"n_q_heads": r["n_q_heads"], "n_kv_heads": r["n_kv_heads"],
                                 "head_dim": r["head_dim"]})
    return m
