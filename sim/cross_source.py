"""Cross-source check: rackbed's own H200 measurements against the imported H200 tables, raw row against raw row.

``calibration/h200.yaml`` is fitted from rackbed's measurements (``kernels/bench/measure.py``: torch / cuBLAS / cuDNN /
NCCL, CUDA-graph replay, interleaved rounds, median); the ``trtllm`` calibration of the same GPU is built from
aiconfigurator-core's measured tables (:mod:`sim.perf_tables`: TensorRT-LLM's operators, NCCL's own benchmark).
This module puts the **measured rows** of both side by side where they measure the same operation at the same
size — no fitted curve, no interpolation — so that a difference between the two calibrations can be told apart
from a fitting error:

==================  ==========================================  ================================================
kind                rackbed rows (``--measurements``)           table rows (matched exactly on)
==================  ==========================================  ================================================
``gemm_bf16``,      ``gemm`` ``op: dense`` (``torch.matmul`` /  ``gemm/<backend>/*/gemm_perf``: ``gemm_dtype``
``gemm_fp8``        ``torch._scaled_mm`` row-wise)              ``bfloat16`` / ``fp8``, the same ``(m, n, k)``
``allreduce``       ``allreduce`` (NCCL, 2 ranks, bf16)         ``comm/nccl/*/nccl_perf``: ``all_reduce``,
                                                                ``half``, 2 GPUs, ``message_size`` x 2 = bytes
``attn_decode``     ``attn_decode`` (SDPA, one query per        ``generation_attention_perf``: the same batch,
                    sequence over ``ctx`` keys)                 heads, head_dim; ``step + isl`` = ``ctx`` keys;
                                                                bf16 activations and KV cache, no window
``flash_prefill``   ``flash_prefill`` (causal SDPA, batch 1)    ``context_attention_perf``: batch 1, ``isl`` =
                                                                ``seq``, the same heads, bf16, no window
==================  ==========================================  ================================================

Per matched point: rackbed µs (the row's ``median_us``), table µs (``latency`` ms x 1000; the median where a table
holds the point more than once), ``ratio`` = rackbed / table (> 1: rackbed's measurement is slower). Per kind: the
number of points, the median ratio and its 10th / 90th percentiles (linear interpolation between order
statistics), min and max, and the same per group (GEMM shape and m range, decode batch, message size range).
Rackbed rows with no exact table match are listed with the reason (a GEMM shape off the table's (n, k) grid);
operations the tables do not measure as such are named with why (``grouped``: the tables' MoE op is the whole
routed-expert block).

``controls``: the GEMM comparison repeated against the other stacks' GEMM tables of the same system (SGLang,
vLLM — their ``kernel_source`` names the kernel family, e.g. ``torch.nn.functional.linear``), summaries only, to
separate what the GEMM library contributes from what the measurement method does. ``table_repeat``: where the
package holds the same NCCL point more than once (duplicate rows, other version folders), the spread of those
rows against the ones compared — the tables' own run-to-run difference.

Usage: ``python -m rackbed.sim.cross_source --out results/calibration/cross_source_h200.json`` (writes the Markdown table
next to it, ``--md`` to choose). The output is deterministic (sorted, rounded, no dates).
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import re
import statistics
import sys
from collections import defaultdict
from collections.abc import Callable, Hashable, Iterable
from pathlib import Path

from rackbed.sim import perf_tables as pt
from rackbed.sim.calibration.measurements import read_json
from rackbed.topology.errors import UserError

SCHEMA = "rackbed.cross_source/1"
RATIO = "rackbed_us / table_us"
DEFAULT_MEASUREMENTS = "calibration/measurements/measure_h200x2_v10.json.gz"
#: the rackbed measurement formats this module reads
MEASURE_SCHEMAS = ("rackbed.measure/2",)
#: kinds whose comparison must find points on a shipped pair of files (the others may legitimately be empty)
REQUIRED = ("gemm_bf16", "gemm_fp8", "allreduce")
#: table dtype -> rackbed GEMM format compared
GEMM_KINDS = {"bf16": ("gemm_bf16", "bfloat16"), "fp8": ("gemm_fp8", "fp8")}
#: message-size boundary between the latency-bound and the bandwidth-bound regime of the all-reduce groups (bytes)
ALLREDUCE_SPLIT = 2**20
#: GEMM m ranges of the per-group summaries (weight-read bound, mixed, compute bound on H200 at these shapes)
GEMM_M_GROUPS = ((64, "m <= 64"), (1024, "64 < m <= 1024"), (math.inf, "m > 1024"))


# ------------------------------------------------------------------------------------------------ statistics


def quantile(sorted_values: list[float], q: float) -> float:
    """The ``q`` quantile of ascending ``sorted_values`` by linear interpolation between order statistics (the
    definition of numpy's default), so that p10 / p90 of a handful of points are not just the extremes."""
    if not sorted_values:
        raise ValueError("quantile of no values")
    pos = q * (len(sorted_values) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def summarize(ratios: Iterable[float]) -> dict:
    """``n``, ``median``, ``p10``, ``p90``, ``min``, ``max`` of a list of ratios (rounded to 4 significant
    digits); an empty list gives ``{"n": 0}``."""
    s = sorted(ratios)
    if not s:
        return {"n": 0}
    return {"n": len(s), "median": _sig(statistics.median(s)), "p10": _sig(quantile(s, 0.10)),
            "p90": _sig(quantile(s, 0.90)), "min": _sig(s[0]), "max": _sig(s[-1])}


def _sig(v: float, digits: int = 4) -> float:
    return float(f"{v:.{digits}g}")


def join(rackbed: dict[Hashable, float], table: dict[Hashable, list[float]]) -> list[tuple]:
    """Exact matches: ``(key, rackbed_us, table_us, table_rows)`` for every key both sides hold, sorted by key; a
    key held more than once by the table is compared with the median of its rows."""
    out = []
    for key in sorted(set(rackbed) & set(table)):
        vals = table[key]
        out.append((key, rackbed[key], statistics.median(vals), len(vals)))
    return out


# ------------------------------------------------------------------------------------------------ inputs


def load_measurements(path: str | Path) -> dict:
    """A rackbed measurement file (``kernels/bench/measure.py`` output); a missing file, bad JSON, another schema or no
    rows is one UserError naming the file."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"{p}: measurement file not found")
    try:
        doc = read_json(p)
    except json.JSONDecodeError as exc:
        raise UserError(f"{p}: not JSON ({exc.msg} at line {exc.lineno})") from exc
    if not isinstance(doc, dict) or doc.get("schema") not in MEASURE_SCHEMAS:
        got = doc.get("schema") if isinstance(doc, dict) else type(doc).__name__
        raise UserError(f"{p}: schema: expected one of {', '.join(MEASURE_SCHEMAS)}, got {got!r}")
    rows = doc.get("rows")
    if not isinstance(rows, list) or not rows:
        raise UserError(f"{p}: rows: expected a non-empty list of measured rows")
    return doc


def _timed(rows: list[dict], bench: str, where: str) -> Iterable[dict]:
    """The rows of ``bench`` that carry a time (error rows are skipped); a time that is not a finite number > 0 is
    a UserError naming the row."""
    for i, r in enumerate(rows):
        if not isinstance(r, dict) or r.get("bench") != bench or "error" in r or "median_us" not in r:
            continue
        v = r["median_us"]
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v <= 0:
            raise UserError(f"{where}: rows[{i}].median_us = {v!r}; must be a finite number > 0")
        yield r


@functools.lru_cache(maxsize=16)
def _rows(table: pt.Table, cols: tuple[str, ...]) -> tuple[dict, ...]:
    """A table's rows (:func:`sim.perf_tables.read_rows`: columns checked, latency in ms, finite and > 0), read once
    per process (the GEMM tables hold ~10^5 rows; several kinds and the controls read them)."""
    return tuple(pt.read_rows(table, cols))


def _collection_meta(table: pt.Table) -> dict:
    """What the table's folder says about how it was collected (``collection_meta.yaml``): provenance
    (``collected`` / ``legacy``), framework and version, the table's status; {} where there is no such file."""
    import yaml

    f = table.path.parent / "collection_meta.yaml"
    if not f.is_file():
        return {}
    try:
        doc = yaml.safe_load(f.read_text()) or {}
    except yaml.YAMLError as exc:
        raise UserError(f"{table.rel}: collection_meta.yaml is not YAML: {' '.join(str(exc).split())[:160]}") from exc
    rt = doc.get("runtime") or {}
    tab = (doc.get("tables") or {}).get(table.name.removesuffix(".parquet")) or {}
    return {"provenance": doc.get("provenance"), "framework": rt.get("framework"),
            "framework_version": str(rt.get("version")) if rt.get("version") is not None else None,
            "status": tab.get("status")}


def _table_info(table: pt.Table, used: int, **extra) -> dict:
    return {"file": table.rel, "collection_meta": _collection_meta(table), "rows_matched": used, **extra}


def _newest(root: Path, system: str, op: str, backend: str, name: str) -> pt.Table | None:
    found = pt.find_tables(root, system, op, backend, name)
    return found[-1] if found else None


# ------------------------------------------------------------------------------------------------ kinds


def _point(key: dict, r_us: float, t_us: float, n_rows: int) -> dict:
    out = {**key, "rackbed_us": _sig(r_us, 5), "table_us": _sig(t_us, 5), "ratio": _sig(r_us / t_us, 5)}
    if n_rows > 1:
        out["table_rows"] = n_rows
    return out


def _groups(points: list[dict], label: Callable[[dict], str]) -> dict:
    by: dict[str, list[float]] = defaultdict(list)
    for p in points:
        by[label(p)].append(p["ratio"])
    return {k: summarize(v) for k, v in by.items()}


@functools.lru_cache(maxsize=8)
def _gemm_table(root: Path, system: str, backend: str) -> tuple[pt.Table | None, dict]:
    """The backend's GEMM table as ``{dtype: {"sources": [kernel_source, ...], "points": {(m, n, k): [us, ...]}}}``:
    per point the median of a source's repeated rows, then the fastest source, as :mod:`sim.perf_tables` imports
    it (a one-element list: :func:`join` reads the table side as lists). Built once per process; callers only
    read it."""
    t = _newest(root, system, "gemm", backend, "gemm_perf.parquet")
    if t is None:
        return None, {}
    cols = ("gemm_dtype", "kernel_source", "m", "n", "k", "latency")
    raw: dict[tuple, dict] = defaultdict(lambda: defaultdict(list))
    for r in _rows(t, cols):
        raw[(str(r["gemm_dtype"]), str(r["kernel_source"]))][(int(r["m"]), int(r["n"]), int(r["k"]))].append(
            r["latency"] * 1e3)
    out: dict[str, dict] = {}
    for (dtype, src), pts in sorted(raw.items()):
        e = out.setdefault(dtype, {"sources": [], "points": {}})
        e["sources"].append(src)
        for key, us in pts.items():
            v = statistics.median(us)
            if key not in e["points"] or v < e["points"][key][0]:
                e["points"][key] = [v]
    return t, out


def _rackbed_gemm(rows: list[dict], fmt: str, where: str) -> dict[tuple, dict]:
    """``{(n, k): {"shape": name, "m": {m: us}}}`` of rackbed's dense GEMM rows of one format (the library's own
    call; the forced-kernel rows are not the library's choice and are left out)."""
    out: dict[tuple, dict] = {}
    for r in _timed(rows, "gemm", where):
        if r.get("op") != "dense" or r.get("fmt") != fmt:
            continue
        e = out.setdefault((int(r["n"]), int(r["k"])), {"shape": r.get("shape"), "m": {}})
        e["m"][int(r["m"])] = float(r["median_us"])
    return out


def _grid_note(nk: tuple[int, int], grid: set[tuple[int, int]]) -> str:
    n, k = nk
    ns = sorted({gn for gn, gk in grid if gk == k})
    below = [v for v in ns if v < n]
    above = [v for v in ns if v > n]
    near = ", ".join(str(v) for v in (below[-1:] + above[:1]))
    if not ns:
        return f"k = {k} is not on the table's grid"
    return f"n = {n} is not on the table's grid at k = {k} (nearest n: {near})"


def compare_gemm(meas: dict, where: str, table: dict, fmt: str) -> dict:
    """One GEMM kind: rackbed's dense rows of ``fmt`` against the table's rows of the matching dtype, exact
    ``(m, n, k)``; ``table`` as returned by :func:`_gemm_table`."""
    kind, dtype = GEMM_KINDS[fmt]
    mine = _rackbed_gemm(meas["rows"], fmt, where)
    sources = table.get(dtype, {}).get("sources", [])
    theirs: dict[tuple, list[float]] = table.get(dtype, {}).get("points", {})
    grid = {(n, k) for (_m, n, k) in theirs}
    points, unmatched = [], []
    for nk in sorted(mine):
        e = mine[nk]
        if nk not in grid:
            unmatched.append({"what": f"{e['shape']} (n={nk[0]}, k={nk[1]})", "rackbed_rows": len(e["m"]),
                              "why": _grid_note(nk, grid)})
            continue
        rb = {(m, *nk): us for m, us in e["m"].items()}
        for (m, n, k), r_us, t_us, nr in join(rb, theirs):
            points.append(_point({"shape": e["shape"], "m": m, "n": n, "k": k}, r_us, t_us, nr))
        t_ms = sorted({m for (m, n, k) in theirs if (n, k) == nk})
        missing = sorted(set(e["m"]) - set(t_ms))
        if missing:
            unmatched.append({"what": f"{e['shape']} (n={nk[0]}, k={nk[1]})", "rackbed_rows": len(missing),
                              "why": f"m not on the table's m grid ({len(t_ms)} values from {t_ms[0]} to "
                                     f"{t_ms[-1]})"})

    def m_group(p):
        return next(lbl for hi, lbl in GEMM_M_GROUPS if p["m"] <= hi)

    by = _groups(points, lambda p: f"{p['shape']} n={p['n']} k={p['k']}")
    by.update(_groups(points, m_group))
    return {"kind": kind, "table_dtype": dtype, "table_kernel_source": sources,
            "summary": summarize(p["ratio"] for p in points), "by": by, "points": points, "unmatched": unmatched}


def compare_allreduce(meas: dict, where: str, root: Path, system: str) -> tuple[dict, dict | None]:
    """NCCL all-reduce on 2 ranks: rackbed bytes per rank against the newest NCCL table's ``message_size`` x 2
    (``half`` elements); plus the table's own repeat (the same point elsewhere in the package's NCCL tables)."""
    tables = pt.find_tables(root, system, "comm", "nccl", "nccl_perf.parquet")
    cols = ("op_name", "nccl_dtype", "num_gpus", "message_size", "latency")
    per_table: list[tuple[pt.Table, dict]] = []
    for t in tables:
        if not {"op_name", "nccl_dtype"} <= set(pt._columns(t)):
            continue
        pts: dict[tuple[int, int], list[float]] = defaultdict(list)
        for r in _rows(t, cols):
            if r["op_name"] == "all_reduce" and r["nccl_dtype"] == "half":
                pts[(int(r["num_gpus"]), int(r["message_size"]) * 2)].append(r["latency"] * 1e3)
        if pts:
            per_table.append((t, pts))
    mine: dict[tuple, float] = {}
    for r in _timed(meas["rows"], "allreduce", where):
        mine[(int(r["n_ranks"]), int(r["size_bytes"]))] = float(r["median_us"])
    if not per_table:
        return {"kind": "allreduce", "summary": {"n": 0}, "by": {}, "points": [], "unmatched": [],
                "why": f"no NCCL all-reduce table for {system}"}, None
    t, theirs = per_table[-1]
    points = [_point({"n_ranks": key[0], "bytes": key[1]}, r_us, t_us, nr)
              for key, r_us, t_us, nr in join(mine, theirs)]
    off = sorted(b for (n, b) in set(mine) - set(theirs))
    unmatched = [{"what": "sizes " + ", ".join(map(str, off)) + " B", "rackbed_rows": len(off),
                  "why": "no table row at that size (the table measures 512 B x 2^i)"}] if off else []

    def regime(p):
        return f"<= {ALLREDUCE_SPLIT >> 20} MiB" if p["bytes"] <= ALLREDUCE_SPLIT else f"> {ALLREDUCE_SPLIT >> 20} MiB"

    doc = {"kind": "allreduce", "table": _table_info(t, len(points)),
           "summary": summarize(p["ratio"] for p in points), "by": _groups(points, regime), "points": points,
           "unmatched": unmatched}
    # the tables' own repeat: the same point's rows elsewhere in the package (and the compared table's duplicates)
    matched = {(p["n_ranks"], p["bytes"]) for p in points}
    rep, files = [], []
    for t2, pts in per_table:
        for key in sorted(matched & set(pts)):
            if t2 is t and len(pts[key]) < 2:
                continue  # the compared row itself
            ref = statistics.median(theirs[key])
            rep += [v / ref for v in pts[key]]
            if t2.rel not in files:
                files.append(t2.rel)
    repeat = {"what": "the rows of the same all_reduce / half / num_gpus / size in the package's other NCCL tables "
                      "(and duplicates in the compared one) over the compared value", "files": files,
              "summary": summarize(rep)} if rep else None
    return doc, repeat


@functools.lru_cache(maxsize=8)
def _attn_table(root: Path, system: str, backend: str, name: str) -> tuple[pt.Table | None, list[dict]]:
    t = _newest(root, system, "attention", backend, name)
    if t is None:
        return None, []
    cols = ("batch_size", "isl", "step", "num_heads", "num_key_value_heads", "head_dim", "window_size",
            "beam_width", "attn_dtype", "kv_cache_dtype", "latency")
    rows = [r for r in _rows(t, cols)
            if int(r["window_size"]) == 0 and int(r["beam_width"]) == 1 and str(r["attn_dtype"]) == "bfloat16"
            and str(r["kv_cache_dtype"]) == "bfloat16"]
    return t, rows


def compare_decode(meas: dict, where: str, root: Path, system: str, backend: str) -> dict:
    """Decode attention: rackbed ``attn_decode`` (batch, ctx keys) against ``generation_attention_perf`` rows of
    the same batch and heads whose ``step`` cached tokens plus ``isl`` new ones are ``ctx`` keys."""
    t, rows = _attn_table(root, system, backend, "generation_attention_perf.parquet")
    mine: dict[tuple, float] = {}
    for r in _timed(meas["rows"], "attn_decode", where):
        mine[(int(r["batch"]), int(r["ctx"]), int(r["n_q_heads"]), int(r["n_kv_heads"]), int(r["head_dim"]))] = \
            float(r["median_us"])
    theirs: dict[tuple, list[float]] = defaultdict(list)
    for r in rows:
        key = (int(r["batch_size"]), int(r["step"]) + int(r["isl"]), int(r["num_heads"]),
               int(r["num_key_value_heads"]), int(r["head_dim"]))
        theirs[key].append(r["latency"] * 1e3)
    points = [_point({"batch": k[0], "ctx": k[1], "n_q_heads": k[2], "n_kv_heads": k[3], "head_dim": k[4]},
                     r_us, t_us, nr) for k, r_us, t_us, nr in join(mine, theirs)]
    return {"kind": "attn_decode", "table": _table_info(t, len(points)) if t else None,
            "match": "table step + isl = rackbed ctx (keys attended); bf16 activations and KV cache; window 0",
            "summary": summarize(p["ratio"] for p in points), "by": _groups(points, lambda p: f"batch {p['batch']}"),
            "points": points, "unmatched": _count_unmatched(mine, theirs, "batch, ctx (table: 2^i keys, capped in "
                                                                           "batch x ctx)")}


def compare_prefill(meas: dict, where: str, root: Path, system: str, backend: str) -> dict:
    """Causal prefill attention: rackbed ``flash_prefill`` (one sequence) against ``context_attention_perf``
    rows of batch 1, ``isl`` = ``seq``, the same heads."""
    t, rows = _attn_table(root, system, backend, "context_attention_perf.parquet")
    mine: dict[tuple, float] = {}
    for r in _timed(meas["rows"], "flash_prefill", where):
        mine[(1, int(r["seq"]), int(r["n_q_heads"]), int(r["n_kv_heads"]), int(r["head_dim"]))] = \
            float(r["median_us"])
    theirs: dict[tuple, list[float]] = defaultdict(list)
    for r in rows:
        if int(r["step"]) != 0:
            continue
        key = (int(r["batch_size"]), int(r["isl"]), int(r["num_heads"]), int(r["num_key_value_heads"]),
               int(r["head_dim"]))
        theirs[key].append(r["latency"] * 1e3)
    points = [_point({"batch": k[0], "seq": k[1], "n_q_heads": k[2], "n_kv_heads": k[3], "head_dim": k[4]},
                     r_us, t_us, nr) for k, r_us, t_us, nr in join(mine, theirs)]
    return {"kind": "flash_prefill", "table": _table_info(t, len(points)) if t else None,
            "match": "batch 1, table isl = rackbed seq, no cached tokens; bf16; window 0",
            "summary": summarize(p["ratio"] for p in points),
            "by": _groups(points, lambda p: "seq <= 2048" if p["seq"] <= 2048 else "seq > 2048"),
            "points": points, "unmatched": _count_unmatched(mine, theirs, "seq (table: 2^i and 1.5 x 2^i tokens)")}


def _count_unmatched(mine: dict, theirs: dict, what: str) -> list[dict]:
    off = sorted(set(mine) - set(theirs))
    if not off:
        return []
    return [{"what": "other sizes", "rackbed_rows": len(off), "why": f"no table row at the same {what}"}]


#: rackbed measures these, the tables do not measure them as the same operation
NOT_COMPARABLE = {
    "grouped": "rackbed times one torch._grouped_mm (32 experts x m tokens, bf16) per projection; the tables have "
               "no grouped-GEMM op: moe_perf is the whole routed-expert block (routing, token permutation, both "
               "grouped GEMMs, activation, finalize) at a number of tokens into the block, so neither the work nor "
               "the tokens per expert of a row map onto one rackbed row",
}


# ------------------------------------------------------------------------------------------------ assembly


def compare(measurements: str | Path = DEFAULT_MEASUREMENTS, system: str = "h200", backend: str = "trtllm", *,
            root: Path | None = None, controls: Iterable[str] | None = None) -> dict:
    """The cross-source document (module docstring) for one rackbed measurement file and one system's tables."""
    system = pt.resolve_system(system)
    if backend not in pt.BACKENDS:
        raise UserError(f"--backend must be one of {', '.join(pt.BACKENDS)}, got {backend!r}")
    root = root or pt.data_root()
    if not (root / system).is_dir():
        raise UserError(f"{pt.PACKAGE} has no tables for system {system!r} (looked in {root})")
    meas = load_measurements(measurements)
    where = str(measurements)
    gpu = pt.SYSTEMS[system][0]

    gt, gemm = _gemm_table(root, system, backend)
    kinds: dict[str, dict] = {}
    for fmt in GEMM_KINDS:
        k = compare_gemm(meas, where, gemm, fmt)
        k["table"] = _table_info(gt, len(k["points"])) if gt else None
        kinds[k["kind"]] = k
    ar, repeat = compare_allreduce(meas, where, root, system)
    kinds["allreduce"] = ar
    kinds["attn_decode"] = compare_decode(meas, where, root, system, backend)
    kinds["flash_prefill"] = compare_prefill(meas, where, root, system, backend)

    ctl = {}
    for b in (controls if controls is not None else [x for x in pt.BACKENDS if x != backend]):
        ct, cg = _gemm_table(root, system, b)
        if ct is None:
            continue
        for fmt in GEMM_KINDS:
            k = compare_gemm(meas, where, cg, fmt)
            ctl[f"{b}/{k['kind']}"] = {"table": ct.rel, "collection_meta": _collection_meta(ct),
                                       "table_kernel_source": k["table_kernel_source"], "summary": k["summary"],
                                       "by": k["by"]}
    env = meas.get("env", {})
    return {
        "schema": SCHEMA,
        "gpu": gpu,
        "ratio": RATIO,
        "rackbed": {"file": where, "schema": meas.get("schema"), "timing": meas.get("timing"),
                    "env": {k: env.get(k) for k in ("date", "gpu_name", "host", "driver", "torch", "cuda", "nccl")}},
        "tables": {"package": pt.PACKAGE, "package_version": pt.package_version(), "system": system,
                   "backend": backend},
        "kinds": kinds,
        "not_comparable": NOT_COMPARABLE,
        "table_repeat": {"allreduce": repeat} if repeat else {},
        "controls": ctl,
    }


def check(doc: dict) -> None:
    """Every required kind has matched points and every ratio is a finite number > 0 (else UserError)."""
    for name in REQUIRED:
        if not doc["kinds"].get(name, {}).get("points"):
            raise UserError(f"{doc['rackbed']['file']}: no {name} row matches a table row exactly "
                            f"({doc['tables']['system']}/{doc['tables']['backend']})")
    for name, k in doc["kinds"].items():
        for p in k["points"]:
            if not (math.isfinite(p["ratio"]) and p["ratio"] > 0):
                raise UserError(f"{name}: ratio {p['ratio']!r} at {p}")


# ------------------------------------------------------------------------------------------------ output


def dumps(doc: dict) -> str:
    """JSON text: indented, with every matched point on one line (stable, diffable)."""
    compact: dict[str, str] = {}

    def sub(o):
        if isinstance(o, dict):
            return {k: ([mark(p) for p in v] if k == "points" else sub(v)) for k, v in o.items()}
        if isinstance(o, list):
            return [sub(v) for v in o]
        return o

    def mark(p: dict) -> str:
        token = f"@point{len(compact)}@"
        compact[json.dumps(token)] = json.dumps(p, separators=(", ", ": "))
        return token

    text = json.dumps(sub(doc), indent=1)
    return re.sub(r'"@point\d+@"', lambda m: compact[m.group(0)], text) + "\n"


def _fmt_sum(s: dict) -> str:
    if not s.get("n"):
        return "| 0 | — | — | — |"
    return f"| {s['n']} | {s['median']:.3g} | {s['p10']:.3g}–{s['p90']:.3g} | {s['min']:.3g}–{s['max']:.3g} |"


def render_markdown(doc: dict) -> str:
    """The Markdown report: summary per kind, per group, the unmatched and non-comparable rows, the controls, and
    every matched point."""
    rb, tb = doc["rackbed"], doc["tables"]
    env = rb["env"]
    lines = [
        (f"# Cross-source check on {doc['gpu']}: rackbed's measurements vs {tb['package']} "
         f"{tb['package_version']} ({tb['system']}, {tb['backend']})"),
        "",
        ("Generated by `python -m rackbed.sim.cross_source` (`sim/cross_source.py`); what the differences mean: "
         "calibration/README.md, \"Cross-source check on H200\"."),
        "",
        (f"* rackbed: `{rb['file']}` ({rb['schema']}; {env.get('date')}, {env.get('gpu_name')}, host "
         f"{env.get('host')}, driver {env.get('driver')}, torch {env.get('torch')}, CUDA {env.get('cuda')}, "
         f"NCCL {env.get('nccl')}); timing: {json.dumps(rb['timing'])}"),
        "* table rows: " + "; ".join(
            f"{k}: `{v['table']['file']}` ({_meta_text(v['table']['collection_meta'])})"
            for k, v in doc["kinds"].items() if v.get("table")),
        f"* ratio = {doc['ratio']} at exactly the same operation and size (> 1: rackbed's measurement slower)",
        "",
        "| kind | matched points | median ratio | p10–p90 | min–max |",
        "| --- | ---: | ---: | ---: | ---: |",
    ]
    for k, v in doc["kinds"].items():
        lines.append(f"| {k} " + _fmt_sum(v["summary"]))
    lines += ["", "## Per group", "", "| kind | group | points | median | p10–p90 | min–max |",
              "| --- | --- | ---: | ---: | ---: | ---: |"]
    for k, v in doc["kinds"].items():
        for g, s in v["by"].items():
            lines.append(f"| {k} | {g} " + _fmt_sum(s))
    lines += ["", "## Not matched", ""]
    for k, v in doc["kinds"].items():
        for u in v.get("unmatched", []):
            lines.append(f"* {k}, {u['what']}: {u['rackbed_rows']} rackbed rows — {u['why']}")
    for k, why in doc["not_comparable"].items():
        lines.append(f"* {k}: not comparable — {why}")
    if doc["table_repeat"]:
        lines += ["", "## The tables' own repeat", ""]
        for k, v in doc["table_repeat"].items():
            s = v["summary"]
            lines.append(f"* {k}: {v['what']} ({', '.join(f'`{f}`' for f in v['files'])}): {s['n']} rows, median "
                         f"{s['median']:.3g}, p10–p90 {s['p10']:.3g}–{s['p90']:.3g}, min–max {s['min']:.3g}–"
                         f"{s['max']:.3g}")
    if doc["controls"]:
        lines += ["", "## Controls: the same GEMM points against the other stacks' GEMM tables", "",
                  "| table | kernel_source | kind | points | median | p10–p90 | min–max |",
                  "| --- | --- | --- | ---: | ---: | ---: | ---: |"]
        for k, v in doc["controls"].items():
            lines.append(f"| `{v['table']}` ({_meta_text(v['collection_meta'])}) | "
                         f"{', '.join(v['table_kernel_source'])} | {k.split('/')[1]} "
                         + _fmt_sum(v["summary"]))
        lines += ["", "| table | kind | group | points | median | p10–p90 | min–max |",
                  "| --- | --- | --- | ---: | ---: | ---: | ---: |"]
        for k, v in doc["controls"].items():
            for g, s in v["by"].items():
                lines.append(f"| `{v['table']}` | {k.split('/')[1]} | {g} " + _fmt_sum(s))
    lines += ["", "## Matched points", ""]
    for k, v in doc["kinds"].items():
        if not v["points"]:
            continue
        keys = [c for c in v["points"][0] if c not in ("rackbed_us", "table_us", "ratio", "table_rows")]
        lines += [f"### {k}", "", "| " + " | ".join(keys) + " | rackbed µs | table µs | ratio |",
                  "| " + " | ".join("---" for _ in keys) + " | ---: | ---: | ---: |"]
        for p in v["points"]:
            lines.append("| " + " | ".join(str(p[c]) for c in keys)
                         + f" | {p['rackbed_us']:.4g} | {p['table_us']:.4g} | {p['ratio']:.3f} |")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def _meta_text(m: dict) -> str:
    if not m:
        return "no collection_meta.yaml"
    return f"{m.get('framework')} {m.get('framework_version')}, provenance {m.get('provenance')}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rackbed.sim.cross_source", description=__doc__.split("\n\n")[0])
    ap.add_argument("--measurements", default=DEFAULT_MEASUREMENTS, help="rackbed measurement file (%(default)s)")
    ap.add_argument("--system", default="h200", help="aiconfigurator system (%(default)s)")
    ap.add_argument("--backend", default="trtllm", help="stack whose tables are compared (%(default)s)")
    ap.add_argument("--out", required=True, help="JSON output")
    ap.add_argument("--md", help="Markdown output (default: --out with .md)")
    ap.add_argument("--force", action="store_true", help="replace existing --out / --md files")
    args = ap.parse_args(argv)
    from rackbed.topology.outputs import entry_file, write_text

    out = entry_file(args.out, force=args.force)  # before the comparison, not after it
    md = entry_file(args.md, force=args.force, flag="--md") if args.md else \
        entry_file(out.with_suffix(".md"), force=args.force, default=True)
    try:
        doc = compare(args.measurements, args.system, args.backend)
        check(doc)
    except (UserError, FileNotFoundError) as exc:
        print(f"cross_source: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2
    write_text(out, dumps(doc))
    write_text(md, render_markdown(doc))
    print(f"wrote {out} and {md}")
    for k, v in doc["kinds"].items():
        s = v["summary"]
        print(f"  {k}: {s['n']} points" + (f", median {s['median']:.3g}, p10-p90 {s['p10']:.3g}-{s['p90']:.3g}"
                                             if s["n"] else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
