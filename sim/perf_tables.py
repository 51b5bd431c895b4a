"""Calibrations from measured per-operator tables (``rackbed calibrate --from-aiconfigurator SYSTEM``).

NVIDIA's aiconfigurator-core package (Apache-2.0, the ``tables`` extra) ships per-operator latencies collected on
GPUs rackbed cannot run here — GB200, B200, H200, ... — under TensorRT-LLM, SGLang and vLLM, as parquet files under
``aiconfigurator_core/systems/data/<system>/<op>/<backend>/<version>/``. They are measurements, so rackbed reads
them as calibration data (never the package's code): this module turns the tables of one system and one serving
stack into a rackbed calibration file whose ``meta`` names the package version, the system, the backend, and for
every table its framework version, file and row counts.

What is read (latencies in ms, except ``moe_a2a_perf``, whose ``latency`` is in µs like its ``transmit_us`` /
``notify_us`` columns — a one-token DeepEP dispatch takes ~30 µs, not 30 ms; a table carrying a unit column must say
the unit rackbed expects for it):

========================  ================================  =====================================================
table                     rackbed kind                      how
========================  ================================  =====================================================
``gemm/*/gemm_perf``      ``gemm_tflops`` (fmt, n, k)       one curve per format and (n, k), x = m, y = 2mnk / t;
                                                            (n, k) is a measured grid: other shapes interpolate
``moe/*/moe_perf``        ``moe_us`` (fmt, hidden, inter,   the whole routed-expert block, x = tokens into the EP
                          top_k, n_experts, tp, ep, dist)   group, balanced routing, fastest kernel source per point;
                                                            MXFP4 experts as fmt ``mxfp4`` (``MXFP4_MOE``)
``comm/nccl/*/nccl_perf`` ``allreduce_us`` (ring, n_ranks)  NCCL all-reduce, x = bytes per rank (fp16 elements x 2)
``comm/<backend>/*/       ``allreduce_us`` (one_shot and    the stack's own all-reduce (it picks one- or two-shot
custom_allreduce_perf``   two_shot, n_ranks)                itself): the same curve under both names, the names
                                                            ``sim.costs.collective`` prices them by
``comm/trtllm/*/trtllm_   ``a2a_us`` (dispatch | combine,   DP-EP decode dispatch / combine, x = payload bytes per
alltoall_perf``,          n_ranks, payload)                 rank (tokens x hidden x element bytes)
``comm/*/moe_a2a_perf``
``comm/nccl/*/nccl_perf`` ``allgather_us`` /                NCCL all-gather / reduce-scatter (the DP-EP
                          ``reducescatter_us`` (n_ranks,    decode's ``decode.moe_comm: allgather``), x =
                          payload)                          bytes of the whole buffer (every rank's part)
========================  ================================  =====================================================

Attention tables (``attention/*/{context,generation}_attention_perf``) become ``flash_tflops`` and
``decode_attn_GBps`` curves (:mod:`sim.perf_tables_attention`); MLA tables (``mla/*/{context,generation}_mla_perf``,
``mla_bmm/*/mla_bmm_perf``) become ``mla_prefill_tflops``, ``mla_decode_GBps`` and ``mla_bmm_us`` curves
(:mod:`sim.perf_tables_mla`).

**Hold-out**: as ``rackbed calibrate`` does for the engine's own rows, every third point of each curve (indices 1,
4, 7, ...; never an end point) is left out of the fit and predicted by the rackbed cost function the simulator
calls, with the fitted table; the held-out rows are named in ``meta.holdout`` (the x values, grouped with the
curves that share them) and the errors per kind are in ``meta.validation`` (median
/ p90 / max of |predicted / measured - 1|); ``meta.validation_groups`` splits a kind whose curves an importer
groups (attention: one sequence / batched prefills, bf16 / fp8 KV caches).

**Systems without tables** (``DERIVED`` in :mod:`sim.perf_tables_base`; ``h800``): the tables of a related system
are read under the derived GPU's name, and its all-reduce / all-to-all curves are scaled point by point by the
simulator's model of the same collective on the derived system's preset over the measured one's
(:func:`scale_collectives`); ``meta.system`` names the folder read, ``meta.for_system`` the derived system.

The output is deterministic (sorted tables and rows, rounded numbers, no dates): the same package version gives
the same file byte for byte.
"""

from __future__ import annotations

import json
import math
import statistics
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

from rackbed.sim import perf_tables_attention as pta
from rackbed.sim import perf_tables_mla as ptm
from rackbed.sim.perf_tables_base import (
    BACKENDS,
    DERIVED,
    GEMM_FMT,
    GEMM_MIN_NK,
    HOLDOUT_RULE,
    PACKAGE,
    PAYLOAD,
    SCALE_MODEL,
    SCHEMA,
    SYSTEMS,
    Curve,
    Imported,
    Table,
    _columns,
    _gpu,
    _pick,
    _sig,
    _source,
    _table_meta,
    cached_rows,
    find_tables,
    latency_s,
    read_rows,
    resolve_system,
)
from rackbed.topology.errors import UserError


def data_root() -> Path:
    """The installed package's data folder (found through ``importlib.resources``, never a path on one machine)."""
    try:
        from importlib.resources import files

        import pyarrow.parquet  # noqa: F401  (the tables are parquet files)

        root = files("aiconfigurator_core") / "systems" / "data"
    except ModuleNotFoundError as exc:
        raise UserError(f"calibrate --from-aiconfigurator needs the {exc.name} package: pip install "
                        f"'rackbed[tables]'") from exc
    return Path(str(root))


def package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(PACKAGE)
    except PackageNotFoundError:
        return "unknown"


# ------------------------------------------------------------------------------------------------ GEMM


def import_gemm(root: Path, system: str, backend: str, gpu: str) -> Imported:
    out = Imported(grid={"gemm_tflops": ("n", "k")})
    tabs = find_tables(root, system, "gemm", backend, "gemm_perf.parquet")
    cols = ("gemm_dtype", "m", "n", "k", "latency")
    cache: dict = {}
    t = _pick(tabs, lambda t: len(cached_rows(t, cols, cache)))
    if t is None:
        out.notes.append(f"no GEMM table for {system}/{backend}")
        return out
    rows = cached_rows(t, cols, cache)
    curves: dict[tuple, Curve] = {}
    used = 0
    for r in rows:
        fmt = GEMM_FMT.get(str(r["gemm_dtype"]))
        if fmt is None:
            continue
        m, n, k = int(r["m"]), int(r["n"]), int(r["k"])
        if n < GEMM_MIN_NK or k < GEMM_MIN_NK:
            continue
        s = r["latency"] * latency_s(t)
        key = (fmt, n, k)
        c = curves.get(key)
        if c is None:
            c = curves[key] = Curve("gemm_tflops", {"fmt": fmt, "n": n, "k": k}, _source(t))
        c.add(float(m), _sig(2.0 * m * n * k / s / 1e12), s)
        used += 1
    out.curves = [curves[k] for k in sorted(curves)]
    out.tables.append(_table_meta(t, len(rows), used))
    fmts = sorted({k[0] for k in curves})
    out.notes.append(f"GEMM formats measured: {', '.join(fmts)}")

    def predict(calib, c: Curve, x: float) -> float:
        from rackbed.sim.costs.gemm import gemm_time

        return gemm_time(_gpu(gpu), int(x), c.key["n"], c.key["k"], c.key["fmt"], calib=calib).total_s

    out.predict["gemm_tflops"] = predict
    return out


# ------------------------------------------------------------------------------------------------ MoE


#: MoE ``moe_dtype`` -> rackbed weight format, beyond ``GEMM_FMT``: MXFP4 experts (gpt-oss) as the stack runs them,
#: with bf16 activations (``w4a16``: the only MXFP4 MoE measured on Hopper, which has no FP4 tensor cores) or MXFP8
#: activations (``w4a8``: Blackwell); a shape measured both ways takes the first of ``MXFP4_MOE`` (the faster)
MXFP4_MOE = ("w4a8_mxfp4_mxfp8", "w4a16_mxfp4")
MOE_FMT = {**GEMM_FMT, **{d: "mxfp4" for d in MXFP4_MOE}}


def import_moe(root: Path, system: str, backend: str, gpu: str) -> Imported:
    out = Imported(grid={"moe_us": ("ep",)})
    tabs = find_tables(root, system, "moe", backend, "moe_perf.parquet")
    cols = ("moe_dtype", "kernel_source", "num_tokens", "hidden_size", "inter_size", "topk", "num_experts",
            "moe_tp_size", "moe_ep_size", "distribution", "latency")

    def usable(r) -> bool:
        return (str(r["moe_dtype"]) in MOE_FMT and str(r["distribution"]) == "balanced"
                and "nongated" not in str(r["kernel_source"]))

    cache: dict = {}
    t = _pick(tabs, lambda t: sum(1 for r in cached_rows(t, cols, cache) if usable(r)))
    if t is None:
        out.notes.append(f"no MoE table for {system}/{backend}")
        return out
    rows = cached_rows(t, cols, cache)

    def shape(r) -> tuple:
        return (MOE_FMT[str(r["moe_dtype"])], int(r["hidden_size"]), int(r["inter_size"]), int(r["topk"]),
                int(r["num_experts"]), int(r["moe_tp_size"]), int(r["moe_ep_size"]))

    # per MXFP4 shape, the table's dtype it is read from (the first of MXFP4_MOE measured at that shape)
    mx: dict[tuple, str] = {}
    for r in rows:
        d = str(r["moe_dtype"])
        if d in MXFP4_MOE and usable(r):
            k = shape(r)
            if k not in mx or MXFP4_MOE.index(d) < MXFP4_MOE.index(mx[k]):
                mx[k] = d
    curves: dict[tuple, Curve] = {}
    used = 0
    for r in rows:
        if not usable(r):
            continue
        kt = shape(r)
        d = str(r["moe_dtype"])
        if d in MXFP4_MOE and mx[kt] != d:
            continue
        c = curves.get(kt)
        if c is None:
            key = dict(zip(("fmt", "hidden", "inter", "top_k", "n_experts", "tp", "ep"), kt)) | {"dist": "balanced"}
            how = f"{d}, " if d in MXFP4_MOE else ""
            c = curves[kt] = Curve("moe_us", key, _source(t) + f" ({how}balanced routing; fastest kernel source)")
        s = r["latency"] * latency_s(t)
        c.add(float(int(r["num_tokens"])), _sig(s * 1e6), s)
        used += 1
    out.curves = [curves[k] for k in sorted(curves)]
    out.tables.append(_table_meta(t, len(rows), used))
    if mx:
        shapes = sorted({(k[1], k[2], k[3], k[4], mx[k]) for k in mx})
        out.notes.append("MoE blocks with MXFP4 experts (fmt mxfp4): " + ", ".join(
            f"{h}/{i} top-{tk} of {n} ({d})" for h, i, tk, n, d in shapes))

    def predict(calib, c: Curve, x: float) -> float:
        return calib.lookup("moe_us", gpu, x, **c.key) * 1e-6

    out.predict["moe_us"] = predict
    return out


# ------------------------------------------------------------------------------------------------ collectives


def import_allreduce(root: Path, system: str, backend: str, gpu: str) -> Imported:
    out = Imported()
    nccl_cols = ("op_name", "nccl_dtype", "num_gpus", "message_size", "latency")
    nccl = find_tables(root, system, "comm", "nccl", "nccl_perf.parquet")
    nccl = [t for t in nccl if {"op_name", "nccl_dtype"} <= set(_columns(t))]
    if nccl:
        t = nccl[-1]  # the newest NCCL
        rows = read_rows(t, nccl_cols)
        curves: dict[int, Curve] = {}
        used = 0
        for r in rows:
            if r["op_name"] != "all_reduce" or r["nccl_dtype"] != "half":
                continue
            n = int(r["num_gpus"])
            c = curves.get(n)
            if c is None:
                c = curves[n] = Curve("allreduce_us", {"algo": "ring", "n_ranks": n}, _source(t) + " (NCCL, fp16)",
                                      envelope=True)
            s = r["latency"] * latency_s(t)
            c.add(float(int(r["message_size"]) * 2), _sig(s * 1e6), s)
            used += 1
        out.curves += [curves[n] for n in sorted(curves)]
        out.tables.append(_table_meta(t, len(rows), used, framework=f"NCCL {t.version}"))
        out.notes.append(f"NCCL all-reduce measured at {', '.join(map(str, sorted(curves)))} GPUs")
    ca_cols = ("op_name", "allreduce_dtype", "num_gpus", "message_size", "latency")
    custom = find_tables(root, system, "comm", backend, "custom_allreduce_perf.parquet")
    if custom:
        t = custom[-1]
        rows = read_rows(t, ca_cols)
        curves = {}
        used = 0
        for r in rows:
            if r["op_name"] != "all_reduce" or r["allreduce_dtype"] not in ("bfloat16", "float16", "half"):
                continue
            n = int(r["num_gpus"])
            s = r["latency"] * latency_s(t)
            for algo in ("one_shot", "two_shot"):  # collective.ALGOS' names (KEY_ALIASES maps TRT-LLM's)
                c = curves.get((algo, n))
                if c is None:
                    c = curves[(algo, n)] = Curve("allreduce_us", {"algo": algo, "n_ranks": n},
                                                  _source(t) + f" ({backend} custom all-reduce, its own one/two-shot "
                                                               f"choice)", envelope=True)
                c.add(float(int(r["message_size"]) * 2), _sig(s * 1e6), s)
            used += 1
        out.curves += [curves[k] for k in sorted(curves)]
        out.tables.append(_table_meta(t, len(rows), used))
    if not out.curves:
        out.notes.append(f"no all-reduce table for {system}/{backend}")

    def predict(calib, c: Curve, x: float) -> float:
        return calib.lookup("allreduce_us", gpu, x, **c.key) * 1e-6

    out.predict["allreduce_us"] = predict
    return out


#: NCCL data types of the all-gather / reduce-scatter rows read, as rackbed payloads (element bytes)
GATHER_DTYPES = {"half": ("bf16", 2.0), "int8": ("fp8", 1.0)}


def import_gather_scatter(root: Path, system: str, backend: str, gpu: str) -> Imported:
    """NCCL all-gather and reduce-scatter of the newest NCCL table: ``allgather_us`` / ``reducescatter_us``
    (n_ranks, payload: ``bf16`` from fp16 rows, ``fp8`` from int8 rows), x = bytes of the whole buffer (the
    table's element count x element bytes), y = µs."""
    out = Imported(grid={"allgather_us": ("n_ranks",), "reducescatter_us": ("n_ranks",)})
    kinds = {"all_gather": "allgather_us", "reduce_scatter": "reducescatter_us"}
    nccl = find_tables(root, system, "comm", "nccl", "nccl_perf.parquet")
    nccl = [t for t in nccl if {"op_name", "nccl_dtype"} <= set(_columns(t))]
    if nccl:
        t = nccl[-1]
        rows = read_rows(t, ("op_name", "nccl_dtype", "num_gpus", "message_size", "latency"))
        curves: dict[tuple, Curve] = {}
        used = 0
        for r in rows:
            kind = kinds.get(str(r["op_name"]))
            if kind is None or str(r["nccl_dtype"]) not in GATHER_DTYPES:
                continue
            pay, bpe = GATHER_DTYPES[str(r["nccl_dtype"])]
            n = int(r["num_gpus"])
            c = curves.get((kind, n, pay))
            if c is None:
                c = curves[(kind, n, pay)] = Curve(kind, {"n_ranks": n, "payload": pay},
                                                   _source(t) + f" (NCCL, {r['nccl_dtype']})", envelope=True)
            s = r["latency"] * latency_s(t)
            c.add(_sig(int(r["message_size"]) * bpe), _sig(s * 1e6), s)
            used += 1
        out.curves = [curves[k] for k in sorted(curves)]
        out.tables.append(_table_meta(t, len(rows), used, framework=f"NCCL {t.version}"))
        out.notes.append(f"NCCL all-gather / reduce-scatter measured at "
                         f"{', '.join(map(str, sorted({k[1] for k in curves})))} GPUs")
    else:
        out.notes.append(f"no all-gather / reduce-scatter table for {system}")

    def predict(calib, c: Curve, x: float) -> float:
        return calib.lookup(c.kind, gpu, x, **c.key) * 1e-6

    out.predict["allgather_us"] = out.predict["reducescatter_us"] = predict
    return out


def _a2a_row(curves: dict, extra: tuple, t: Table, kernel: str, op: str, n: int, dtype: str, r: dict) -> None:
    """Add one all-to-all row to the curve of (op, EP size, payload) (+ ``extra`` key parts): x = payload bytes
    per rank, y = µs."""
    pay, bpe = PAYLOAD[dtype]
    key = (op, n, pay, *extra)
    c = curves.get(key)
    if c is None:
        c = curves[key] = Curve("a2a_us", {"op": op, "n_ranks": n, "payload": pay},
                                _source(t) + f" ({kernel}, hidden {int(r['hidden_size'])})", envelope=True)
    s = r["latency"] * latency_s(t)
    c.add(_sig(int(r["num_tokens"]) * int(r["hidden_size"]) * bpe), _sig(s * 1e6), s)


def import_alltoall(root: Path, system: str, backend: str, gpu: str) -> Imported:
    """DP-EP decode dispatch / combine: TRT-LLM's NVLink all-to-all where measured (GB200: EP 2-64), else the
    DeepEP low-latency kernels of the per-stack ``moe_a2a_perf`` table."""
    out = Imported(grid={"a2a_us": ("n_ranks",)})
    curves: dict[tuple, Curve] = {}
    trt = find_tables(root, system, "comm", backend, "trtllm_alltoall_perf.parquet") if backend == "trtllm" else []
    hidden_seen: set[int] = set()
    if trt:
        t = trt[-1]
        cols = ("op_name", "kernel_source", "moe_dtype", "num_tokens", "hidden_size", "moe_ep_size", "latency")
        rows = read_rows(t, cols)
        used = 0
        for r in rows:
            op = {"alltoall_dispatch": "dispatch", "alltoall_combine": "combine"}.get(str(r["op_name"]))
            if op is None or r["kernel_source"] != "NVLinkTwoSided" or str(r["moe_dtype"]) not in PAYLOAD:
                continue
            if op == "combine" and r["moe_dtype"] != "bfloat16":
                continue  # rackbed combines in bf16
            _a2a_row(curves, (), t, "NVLinkTwoSided", op, int(r["moe_ep_size"]), str(r["moe_dtype"]), r)
            hidden_seen.add(int(r["hidden_size"]))
            used += 1
        out.tables.append(_table_meta(t, len(rows), used))
    if not curves:
        a2a = find_tables(root, system, "comm", backend, "moe_a2a_perf.parquet")
        if a2a:
            t = a2a[-1]
            cols = ("comm_backend", "phase", "comm_dtype", "ep_size", "node_num", "hidden_size", "num_tokens",
                    "latency")
            rows = read_rows(t, cols)
            used = 0
            for r in rows:
                if "_ll" not in str(r["comm_backend"]) or int(r["node_num"]) != 1:
                    continue
                op = str(r["phase"])
                if op not in ("dispatch", "combine") or str(r["comm_dtype"]) not in PAYLOAD:
                    continue
                if op == "combine" and r["comm_dtype"] != "bfloat16":
                    continue
                _a2a_row(curves, (int(r["hidden_size"]),), t, str(r["comm_backend"]), op, int(r["ep_size"]),
                         str(r["comm_dtype"]), r)
                hidden_seen.add(int(r["hidden_size"]))
                used += 1
            out.tables.append(_table_meta(t, len(rows), used))
            # several hidden sizes per (op, n_ranks, payload): keep the largest hidden's curve (the most bytes)
            best: dict[tuple, Curve] = {}
            for key in sorted(curves):
                best[key[:3]] = curves[key]
            curves = best
    out.curves = [curves[k] for k in sorted(curves)]
    if out.curves:
        eps = sorted({c.key["n_ranks"] for c in out.curves})
        out.notes.append(f"all-to-all measured at EP {', '.join(map(str, eps))}, hidden "
                         f"{', '.join(map(str, sorted(hidden_seen)))} (other hidden sizes priced at equal bytes)")
    else:
        out.notes.append(f"no all-to-all table for {system}/{backend}")

    def predict(calib, c: Curve, x: float) -> float:
        return calib.lookup("a2a_us", gpu, x, **c.key) * 1e-6

    out.predict["a2a_us"] = predict
    return out


# ------------------------------------------------------------------------------------------------ assembly


IMPORTERS: tuple[Callable[..., Imported], ...] = (import_gemm, import_moe, import_allreduce, import_alltoall,
                                                 *ptm.IMPORTERS)
#: the importers of collective tables (measured on the system's own NVLink; a DERIVED system scales their curves)
COMM_IMPORTERS = (import_allreduce, import_alltoall, import_gather_scatter)
#: importers whose curves go after the attention ones (added later: the earlier curves keep their order)
LATE_IMPORTERS: tuple[Callable[..., Imported], ...] = (import_gather_scatter,)


def scale_collectives(part: Imported, measured_on: str, runs_on: str) -> None:
    """Scale every all-reduce / all-to-all curve of ``part``, measured on preset ``measured_on``, to preset
    ``runs_on``: each point's time times the simulator's first-principles time of the same collective (same group
    size and bytes; all-to-all as DP-EP decode dispatch / combine of :data:`SCALE_MODEL` in bf16) on ``runs_on``
    over that on ``measured_on``. The held-out rows of a scaled curve check its interpolation only."""
    from rackbed.engine.core.model import get_model
    from rackbed.sim.costs import collective, moe_comm
    from rackbed.topology import load

    ref, own = load(measured_on), load(runs_on)
    model = get_model(SCALE_MODEL)

    def model_s(topo, c: Curve, x: float) -> float:
        n = int(c.key["n_ranks"])
        if n > min(ref.n_gpus, own.n_gpus):
            raise UserError(f"{c.label}: measured on {n} GPUs, more than the {runs_on} preset holds")
        gpus = list(range(n))
        if c.kind == "allreduce_us":
            return collective.allreduce_time(topo, gpus, x, algo=c.key["algo"]).total_s
        if c.kind in ("allgather_us", "reducescatter_us"):  # half an all-reduce's traffic: the same ratio
            return collective.allreduce_time(topo, gpus, x).total_s
        tokens = x / (model.hidden * 2)
        if c.key["op"] == "dispatch":
            return moe_comm.dpep_decode_dispatch(topo, gpus, tokens, model, "bf16").total_s
        return moe_comm.dpep_decode_combine(topo, gpus, tokens, model).total_s

    for c in part.curves:
        for x in sorted(c.points):
            r = model_s(own, c, x) / model_s(ref, c, x)
            c.points[x] = _sig(c.points[x] * r)
            c.measured[x] *= r
        c.source += f", scaled to {runs_on} by the model's {runs_on} / {measured_on} time"


def _attention_importers() -> tuple[Callable[..., Imported], ...]:
    return pta.IMPORTERS



def build_calibration(system: str, backend: str = "trtllm", *, root: Path | None = None,
                      progress: Callable[[str], None] | None = None) -> dict:
    """The calibration document (``meta`` + table fields) for ``system`` under ``backend``: every importer's curves,
    held-out rows predicted by the simulator's cost functions with the fitted table."""
    from rackbed.sim.costs.calibration import CalibrationEntry, CalibrationTable

    system = resolve_system(system)
    if backend not in BACKENDS:
        raise UserError(f"--backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    root = root or data_root()
    gpu, _short = SYSTEMS[system]
    derived = DERIVED.get(system)
    folder = derived[0] if derived else system
    if not (root / folder).is_dir():
        raise UserError(f"{PACKAGE} has no tables for system {folder!r} (looked in {root})")
    say = progress or (lambda s: None)
    parts: list[Imported] = []
    for imp in IMPORTERS + _attention_importers() + LATE_IMPORTERS:
        say(f"reading {imp.__name__.removeprefix('import_')} tables")
        part = imp(root, folder, backend, gpu)
        if derived and imp in COMM_IMPORTERS:
            scale_collectives(part, derived[1], derived[2])
        parts.append(part)
    if derived:
        parts.append(Imported(notes=[derived[3]]))
    curves = [c for p in parts for c in p.curves]
    if not curves:
        raise UserError(f"{PACKAGE}: no usable tables for {system} under {backend}")
    grid: dict[str, tuple[str, ...]] = {}
    for p in parts:
        grid.update({k: v for k, v in p.grid.items() if any(c.kind == k for c in p.curves)})
    entries, holdout = [], {}
    for c in curves:
        fit, held = c.split()
        entries.append({"kind": c.kind, "gpu": gpu, "key": dict(sorted(c.key.items())),
                        "points": [[_sig(x), y] for x, y in fit], "source": c.source})
        if held:
            holdout[c.label] = [_sig(x) for x in held]
    table = CalibrationTable(entries=tuple(CalibrationEntry.model_validate(e) for e in entries), grid=grid,
                             interpolation="log-log")
    say("predicting held-out rows")
    predictors = {k: f for p in parts for k, f in p.predict.items()}
    errors: dict[str, list[float]] = defaultdict(list)
    worst: dict[str, tuple[float, str]] = {}
    for c in curves:
        for x in holdout.get(c.label, ()):
            pred = predictors[c.kind](table, c, x)
            meas = c.measured[x] if x in c.measured else c.measured[min(c.measured, key=lambda v: abs(v - x))]
            e = abs(pred / meas - 1.0)
            for name in (c.kind, f"{c.kind}: {c.group}" if c.group else None):
                if name is None:
                    continue
                errors[name].append(e)
                if e > worst.get(name, (-1.0, ""))[0]:
                    worst[name] = (e, f"{c.label} x={x:g}")
    validation = {k: _summary(v) | {"worst": worst[k][1]} for k, v in sorted(errors.items()) if ": " not in k}
    groups = {k: _summary(v) | {"worst": worst[k][1]} for k, v in sorted(errors.items()) if ": " in k}
    clipped = defaultdict(int)
    for c in curves:
        clipped[c.kind] += c.clipped
    meta = {
        "schema": SCHEMA,
        "gpu": gpu,
        "stack": backend,
        "source": PACKAGE,
        "package_version": package_version(),
        "system": folder,
        **({"for_system": system} if derived else {}),
        "backend": backend,
        "tables": sorted((t for p in parts for t in p.tables), key=lambda t: t["file"]),
        "notes": [n for p in parts for n in p.notes],
        "holdout_rule": HOLDOUT_RULE,
        "monotone_fit_points": {k: v for k, v in sorted(clipped.items()) if v},
        "validation": validation,
    }
    if groups:
        meta["validation_groups"] = groups
    meta["holdout"] = _group_holdout(holdout)
    return {"meta": meta, "version": 2, "interpolation": "log-log", "grid": {k: list(v) for k, v in sorted(grid.items())},
            "entries": entries}


def _group_holdout(holdout: dict[str, list[float]]) -> list[dict]:
    """``meta.holdout``: the held-out x values with the curves that hold them out (curves measured on one grid
    share a list), in a stable order."""
    groups: dict[tuple, list[str]] = defaultdict(list)
    for label, xs in sorted(holdout.items()):
        groups[tuple(xs)].append(label)
    return [{"x": list(xs), "curves": labels} for xs, labels in sorted(groups.items(), key=lambda g: g[1][0])]


def _summary(errs: list[float]) -> dict:
    s = sorted(errs)
    p90 = s[min(len(s) - 1, math.ceil(0.9 * len(s)) - 1)]
    return {"n": len(s), "median_pct": round(100 * statistics.median(s), 2), "p90_pct": round(100 * p90, 2),
            "max_pct": round(100 * s[-1], 2)}


def dumps(doc: dict) -> str:
    """The calibration document as JSON text: ``meta`` first, one entry per line (stable, diffable)."""
    head = {k: v for k, v in doc.items() if k != "entries"}
    body = ",\n".join("  " + json.dumps(e, separators=(",", ":")) for e in doc["entries"])
    text = json.dumps(head, indent=1)
    return text[:-2] + ',\n "entries": [\n' + body + "\n ]\n}\n"


def default_out(system: str, backend: str) -> Path:
    """Where ``rackbed calibrate --from-aiconfigurator`` writes by default (never over a shipped file)."""
    return Path("rackbed-out") / "calibration" / f"{SYSTEMS[resolve_system(system)][1]}-{backend}.json.gz"


def validation_table(meta: dict) -> list[str]:
    """Markdown rows of a calibration's held-out errors per kind (and per group of curves within a kind,
    ``meta.validation_groups``, after their kind)."""
    rows = ["| kind | held-out rows | median | p90 | max | worst row |", "| --- | ---: | ---: | ---: | ---: | --- |"]
    groups = meta.get("validation_groups", {})
    items = []
    for k, v in meta.get("validation", {}).items():
        items.append((k, v))
        items += [(g, gv) for g, gv in groups.items() if g.startswith(k + ": ")]
    for k, v in items:
        rows.append(f"| {k} | {v['n']} | {v['median_pct']:.1f} % | {v['p90_pct']:.1f} % | {v['max_pct']:.1f} % | "
                    f"{v.get('worst', '')} |")
    return rows
