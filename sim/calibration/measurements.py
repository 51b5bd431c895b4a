"""Measurement documents and their rows: what ``rackbed calibrate`` reads and how a row becomes a calibration point.

Measurements are the rows of ``kernels/bench/measure.py`` (``{"bench": ..., "median_us": ..., shape fields}``; see its
docstring for the FLOP / byte conventions, which are the cost models'), in format ``rackbed.measure/1`` (a median of
repeats per row) or ``rackbed.measure/2`` (CUDA-graph replay, interleaved rounds: ``median_us`` is the median of the
rounds, with ``min_us`` / ``max_us`` / ``q1_us`` / ``q3_us``, which :func:`row_noise` turns into the row's
measurement spread for ``rackbed validate``). Several documents of one GPU model merge into one
(:func:`merge_measurements`); ``python -m rackbed.engine.bench.decode --overhead`` output reads as ``step_overhead``
rows (:func:`step_overhead_measurements`).

* :func:`curve_of`: the ``(kind, key, x, y)`` point a row gives, net of the per-kernel fixed cost for the rate kinds;
* :func:`fit_kernel_fixed_us`: that fixed cost, from the fit ``hbm_copy`` rows;
* :class:`Holdout` / :func:`split_rows`: which rows are fitted and which are held out for ``rackbed validate``.
"""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from rackbed.sim.calibration.files import CALIBRATION_DIR
from rackbed.sim.calibration.forms import sig
from rackbed.sim.costs import constants as C
from rackbed.sim.costs.calibration import KINDS
from rackbed.topology.errors import UserError
from rackbed.topology.yamlio import read_text

#: torch device name -> topology GpuSpec.name
DEVICE_TO_GPU = {"NVIDIA H200": "H200-SXM", "NVIDIA H100 80GB HBM3": "H100-SXM", "NVIDIA B200": "B200-HGX"}
#: a row's time less the fixed cost is never taken below this fraction of the time (:func:`_net`: a guard against
#: a fixed cost at or above a measurement; a fitted one leaves every fit copy row at least its bytes / peak rate)
NET_FLOOR = 0.1
#: measurement document schemas ``calibrate`` reads (``kernels/bench/measure.py``; documents without a schema are /1)
MEASURE_SCHEMAS = ("rackbed.measure/1", "rackbed.measure/2")
#: the parts of the ``moe_block`` rows (``kernels/bench/measure.py``) that are calibration points: ``routed`` (the
#: routed-expert block without the router GEMM) of kind ``moe_us``, and ``router_gemm`` (the router's bf16 GEMM
#: ``[T, hidden] x [hidden, n_experts]``, what the step model's router term prices through ``gemm_time``) of kind
#: ``gemm_tflops``; the other parts (the router with its top-k, the pieces alone) are reported, not calibrated
MOE_CALIBRATED_PARTS = {"routed": "moe_us", "router_gemm": "gemm_tflops"}


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
    if b == "p2p_copy":  # kernels/bench/measure.py copies between two GPUs of one node: an NVLink peer copy
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
    return {"value_us": sig(fixed, 4), "smallest_row": rid0, "smallest_us": sig(t0, 6),
            "peak_row": peak_id, "peak_GBps": sig(rate / 1e3, 6),
            "rule": "smallest fit hbm_copy time - its bytes / the fastest fit copy rate",
            "check_intercept_us": None if icpt is None else sig(icpt, 4),
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
    """One-line UserError unless ``measurements`` is a ``kernels/bench/measure.py`` document of a known schema."""
    if not isinstance(measurements, dict) or not isinstance(measurements.get("rows", []), list):
        raise UserError(f"{source}: not a kernels/bench/measure.py document (a mapping with a 'rows' list)")
    sch = measurements.get("schema", MEASURE_SCHEMAS[0])
    if sch not in MEASURE_SCHEMAS:
        raise UserError(f"{source}: schema must be one of {', '.join(MEASURE_SCHEMAS)}, got {sch!r}")
    env = measurements.get("env", {})
    if not isinstance(env, dict) or not isinstance(env.get("gpu_name", ""), str):
        raise UserError(f"{source}: env must be a mapping whose gpu_name is a string")
    for i, r in enumerate(measurements.get("rows", [])):
        if not isinstance(r, dict) or "bench" not in r:
            raise UserError(f"{source}: rows[{i}] has no 'bench' field")
        _check_row(r, f"{source}: rows[{i}]")


#: row fields that name things, and row fields that are sizes, counts or times (``kernels/bench/measure.py``)
ROW_NAMES = frozenset(("bench", "op", "fmt", "kernel", "algo", "impl", "dist", "part", "routing", "shape", "mode",
                       "timing", "graph_mode", "library_kernel", "error", "phase", "route"))
ROW_NUMBERS = frozenset(("m", "n", "k", "n_experts", "size_bytes", "bytes", "batch", "context", "ctx", "seq",
                         "tokens", "hidden", "inter", "top_k", "tp", "ep", "n_ranks", "src", "dst", "head_dim",
                         "n_q_heads", "n_kv_heads", "kv_bytes", "inner", "median_us", "min_us", "max_us", "q1_us",
                         "q3_us", "rounds", "replays", "GBps", "busbw_GBps", "tflops", "flops"))
#: the fields each benchmark's rows must have (what :func:`row_id` and :func:`curve_of` read)
ROW_KEYS = {"gemm": ("op", "fmt", "n", "k", "m"), "hbm_copy": ("size_bytes", "bytes"),
            "flash_prefill": ("head_dim", "seq", "n_q_heads"), "attn_decode": ("batch", "ctx", "head_dim", "n_kv_heads"),
            "allreduce": ("algo", "n_ranks", "size_bytes"), "p2p_copy": ("src", "dst", "size_bytes"),
            "dispatch": ("n_ranks", "hidden", "phase", "tokens"), "combine": ("n_ranks", "hidden", "phase", "tokens"),
            "moe_block": ("part", "fmt", "hidden", "inter", "top_k", "n_experts", "tp", "ep", "dist", "tokens"),
            "step_overhead": ("phase", "batch")}
#: sizes and times beyond this (2^53, the largest integer a float holds exactly) are not measurements
ROW_NUMBER_MAX = float(1 << 53)


def _check_row(r: dict, where: str) -> None:
    """One-line UserError naming the row and field unless its names are strings and its numbers finite, >= 0 and
    at most ``ROW_NUMBER_MAX`` (the fit sorts, multiplies and takes logarithms of them)."""
    missing = [k for k in ROW_KEYS.get(r["bench"], ()) if k not in r]
    if missing and not r.get("error"):
        raise UserError(f"{where}: a {r['bench']!r} row needs {', '.join(missing)}"[:300])
    for key, v in r.items():
        if key in ROW_NAMES and not isinstance(v, str):
            raise UserError(f"{where}.{key} must be a string, got {v!r}"[:300])
        if key in ROW_NUMBERS and not (isinstance(v, int | float) and not isinstance(v, bool)
                                       and 0 <= v <= ROW_NUMBER_MAX):  # NaN fails the comparison too
            raise UserError(f"{where}.{key} must be a finite number in [0, 2^53], got {v!r}"[:300])
    rounds = r.get("rounds_us", [])
    if not isinstance(rounds, list) or not all(isinstance(x, int | float) and not isinstance(x, bool)
                                               and 0 <= x <= ROW_NUMBER_MAX for x in rounds):
        raise UserError(f"{where}.rounds_us must be a list of finite numbers >= 0")


def merge_measurements(docs: list[tuple[str, dict]]) -> dict:
    """One measurement document from several ``kernels/bench/measure.py`` documents ``[(path, doc), ...]`` of the same GPU
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
    # every row says which file it came from (the ``source`` of its curve, :func:`sim.calibrate.fit_entries`)
    return {**{k: v for k, v in first.items() if k != "rows"},
            "rows": [{**r, "from": path} for path, d in docs for r in d["rows"]],
            "complete": all(d.get("complete", True) is not False for _, d in docs), "sources": sources}


def measurement_paths(meta: dict) -> list[str]:
    """The measurement files a calibration file was fitted from (``meta.measurements``: one path, or a list)."""
    m = meta.get("measurements")
    if not m:
        return []
    return [str(m)] if isinstance(m, str) else [str(x) for x in m]


def read_json(p: Path):
    """A JSON document from ``p``; ``*.gz`` files (the shipped measurements are compressed) are decompressed first
    (``topology.yamlio.read_text``: a missing, unreadable, non-gzip or non-UTF-8 file is one UserError)."""
    return json.loads(read_text(p, "measurement file"))


def load_measurements(paths: list[str], root: str | Path | None = None) -> dict:
    """Read and merge (:func:`merge_measurements`) ``kernels/bench/measure.py`` JSON files; a relative path that does not
    exist from here is taken relative to ``root`` (default: the repository, where ``meta.measurements`` paths
    point). One-line UserError on an unreadable or invalid file."""
    docs = []
    for path in paths:
        p = Path(path)
        if not p.is_absolute() and not p.exists():
            p = Path(root or CALIBRATION_DIR.parent) / p
        try:
            doc = read_json(p)
            docs.append((str(path), step_overhead_measurements(doc) if _is_overhead_doc(doc) else doc))
        except json.JSONDecodeError as exc:
            raise UserError(f"{path}: not valid JSON: {exc.msg} (line {exc.lineno})") from exc
        except RecursionError:
            raise UserError(f"{path}: nested too deeply to parse") from None
    return merge_measurements(docs)


def _is_overhead_doc(doc) -> bool:
    return (isinstance(doc, dict) and "schema" not in doc and isinstance(doc.get("rows"), list)
            and any(isinstance(r, dict) and isinstance(r.get("overhead"), dict) for r in doc["rows"]))


def step_overhead_measurements(doc: dict) -> dict:
    """A ``kernels/bench/measure.py`` document from ``python -m rackbed.engine.bench.decode --overhead`` output: per graph-
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
           "command": "python -m rackbed.engine.bench.decode --overhead"}
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
    """The shape fields of a measured row that the curve's base form needs (:func:`~sim.calibration.forms.form_for`)."""
    if r["bench"] == "gemm":
        return {"n": r["n"], "n_experts": r.get("n_experts", 1)}
    if r["bench"] == "flash_prefill":
        return {"heads": r["n_q_heads"]}
    if r["bench"] == "moe_block" and r.get("part") == "router_gemm":
        return {"n": r["n_experts"], "n_experts": 1}
    if r["bench"] == "moe_block":
        return {"n_experts": r["n_experts"], "top_k": r["top_k"], "n_local": r["n_experts"] // r.get("ep", 1)}
    return {}


