"""Sweeps: many serving scenarios, expanded from one spec, simulated in parallel, resumable.

A sweep spec (YAML, ``kind: sweep``)::

    kind: sweep
    name: decode-ep
    base: nvl72-default            # a scenario file or shipped name (relative to this file), and/or
    scenario: {sim: {decision_log: false}}   # inline fields merged onto it (deep merge)
    grid:                          # cartesian product over dotted scenario paths
      decode.ep: [8, 16, 32]
      prefill.replicas: [2, 4, 6]
      workload.rate_per_s: [4, 8]
    points:                        # and/or an explicit list of override sets, each crossed with the grid
      - {topology: gb200-nvl72, weight_format: mxfp8}
      - {topology: hgx-h200*2, weight_format: fp8_block}
    figures: [prefix_cache]        # optional: figures drawn from the records after the run (sim.sweep_figures)

Every point is the base scenario with its overrides applied (``a.b.c: v`` sets ``scenario["a"]["b"]["c"] = v``;
a path may not be given both by ``grid`` and by a ``points`` entry). A point's **key** is a SHA-256 (first 20 hex
digits) of the fully expanded, validated scenario (``ServingScenario.model_dump``) without its ``name`` /
``description`` / ``claim``: the same configuration gets the same key whatever spec produced it.

Running: results are appended to a JSONL file (one record per point, flushed as each finishes); a re-run skips the
points whose key has a record with status ``ok`` or ``invalid`` (``error`` records, i.e. bugs, are retried). A
point runs for at most ``limit_s`` wall seconds (``--point-limit``, default :data:`POINT_LIMIT_S`); one that runs
longer is stopped and recorded ``timeout`` with its limit, and a re-run retries it only under a larger limit. A
record: ``{key, index, label, overrides, status: ok|invalid|error|timeout, reason, wall_s, cpu_s, pid, summary,
metrics, quarters}``;
``summary`` is the flat dict :func:`summarize_metrics` makes; ``quarters`` (:func:`arrival_quarters`) the latency
of the requests that arrived in each quarter of the arrival window (how the budget search tells a steady state); ``invalid`` means the scenario was rejected with a
user error (a pydantic field error, ``ParallelPlan.validate`` "does not fit", a placement that does not fit ...),
whose one-line message is the ``reason``.

Execution: in the calling process (``jobs=1``), in a ``concurrent.futures.ProcessPoolExecutor`` (``jobs>1``;
start method ``spawn`` by default), or on a Ray cluster when ``ray`` is importable (the ``cluster`` extra) and an
address is given (Ray tasks, one CPU each, see :func:`sim.sweep_ray.run_ray`; every node needs rackbed installed, the same version
as the driver's, since a task is the driver's ``run_point`` by reference). Only the driver writes the results file,
so a killed driver resumes like a local run; its tasks end with its Ray job. Each worker process keeps what it can
reuse between points: topologies and models are cheap, but the decode cost memo of ``ScenarioCostModel`` is kept per
(plans, placement) so that points differing only in load or seed skip the cost evaluations already made — the
results are identical to a fresh run (the memo is a pure function of its key; it is not reused when an autoscaler
or faults can change the placement during the run).

``rackbed sweep --bench`` times a 1,000-point spec (``scenarios/sweeps/bench-1000.yaml``) and the parallel
efficiency from 1 to 2 processes (see :func:`bench`).
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import json
import math
import os
import signal
import threading
import time
import traceback
from collections.abc import Callable, Iterable, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rackbed import shipped
from rackbed.topology.errors import UserError, one_line

SWEEPS_DIR = shipped("scenarios", "sweeps")
KEY_HEX = 20
_NOT_HASHED = ("name", "description", "claim")
#: fields added to the scenario schema after keys were first made (path -> default, or a tuple of values that all
#: mean what the configuration meant before the field existed — an MTP draft of one layer was the only draft):
#: left out of the key while at their default, so a configuration keeps the key it had before they existed
_ADDED = {("deployment",): "disaggregated", ("aggregated",): None, ("sim", "policies", "worker"): "least_requests",
          ("mtp", "acceptance"): None, ("mtp", "draft"): (None, {"kind": "mtp", "layers": 1}),
          ("sim", "policies", "kv_aware_weight"): 1.0, ("sim", "policies", "random_seed"): 0,
          ("prefix_cache",): {"enabled": False, "block_tokens": 512, "hbm_gb_per_gpu": 8.0, "host_gb_per_gpu": None,
                              "host_GBps_per_gpu": None, "storage_gb": 0.0, "storage_GBps_per_gpu": 5.0,
                              "eviction": "lru"},
          ("decode", "expert_load"): None, ("decode", "eplb"): None,
          ("prefill", "overlap"): "none", ("decode", "overlap"): "none"}
DONE_STATUSES = ("ok", "invalid")
#: default wall-clock limit of one point (seconds): generous, it only ends points that would never end
POINT_LIMIT_S = 3600.0


# ------------------------------------------------------------------------------------------------------------------
# Spec and expansion


@dataclass(frozen=True)
class SweepSpec:
    """A parsed sweep spec: ``base`` is a full scenario dict; ``grid`` maps dotted paths to value lists;
    ``points`` is a list of override dicts (dotted path -> value)."""

    name: str
    base: dict
    grid: dict[str, list] = field(default_factory=dict)
    points: list[dict] = field(default_factory=list)
    source: str = "<sweep>"
    description: str = ""
    figures: tuple[str, ...] = ()   # names in sim.sweep_figures.FIGURES, drawn after the run


@dataclass(frozen=True)
class SweepPoint:
    """One expanded point. ``scenario`` is the full scenario dict; ``key`` is None when it does not validate."""

    index: int
    overrides: dict
    scenario: dict
    key: str
    label: str
    invalid_reason: str | None = None


def set_path(data: dict, dotted: str, value: Any) -> None:
    """Set ``data[a][b][c] = value`` for ``dotted == "a.b.c"`` in place, creating mappings where a parent is
    missing or None; a parent that is a scalar raises UserError."""
    parts = dotted.split(".")
    if not all(parts):
        raise UserError(f"{dotted!r}: not a dotted field path (e.g. decode.ep)")
    cur = data
    for i, p in enumerate(parts[:-1]):
        nxt = cur.get(p)
        if nxt is None:
            nxt = cur[p] = {}
        elif not isinstance(nxt, dict):
            raise UserError(f"{dotted}: {'.'.join(parts[:i + 1])} is a value, not a section")
        cur = nxt
    cur[parts[-1]] = value


def get_path(data: Mapping, dotted: str, default: Any = None) -> Any:
    """``data[a][b][c]`` for ``"a.b.c"``, or ``default`` when a part is missing."""
    cur: Any = data
    for p in dotted.split("."):
        if not isinstance(cur, Mapping) or p not in cur:
            return default
        cur = cur[p]
    return cur


def deep_merge(base: dict, over: Mapping) -> dict:
    """A copy of ``base`` with ``over`` merged in (mappings merged recursively, anything else replaced)."""
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def scenario_dict(sc) -> dict:
    """A validated ``ServingScenario`` as plain JSON data (every field, defaults included)."""
    return sc.model_dump(mode="json")


def point_key(scenario: Mapping) -> str:
    """The point key (module docstring) of a fully expanded scenario dict."""
    body = {k: v for k, v in scenario.items() if k not in _NOT_HASHED}
    for path, default in _ADDED.items():
        body = _without(body, path, default)
    text = json.dumps(body, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:KEY_HEX]


def _without(d: Mapping, path: tuple[str, ...], default) -> Mapping:
    """``d`` without the value at ``path`` when it equals ``default`` (a copy of what changes)."""
    head, rest = path[0], path[1:]
    if head not in d:
        return d
    if not rest:
        hit = d[head] in default if isinstance(default, tuple) else d[head] == default
        return {k: v for k, v in d.items() if k != head} if hit else d
    sub = d[head]
    return {**d, head: _without(sub, rest, default)} if isinstance(sub, Mapping) else d


def _label(overrides: Mapping) -> str:
    return " ".join(f"{k}={_short(v)}" for k, v in overrides.items()) or "base"


def _short(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:g}"
    if isinstance(v, (dict, list)):
        return json.dumps(v, separators=(",", ":"))
    return str(v)


def _check_path(base: dict, dotted: str, where: str) -> None:
    """The path's parent must be a section of the base scenario (or None), and the leaf one of its keys unless
    the section is free-form (absent from the base); catches typos before 1,000 points fail alike."""
    parts = dotted.split(".")
    cur: Any = base
    for i, p in enumerate(parts):
        if cur is None:
            return
        if not isinstance(cur, dict):
            raise UserError(f"{where}: {dotted}: {'.'.join(parts[:i])} is a value, not a section")
        if p not in cur:
            known = ", ".join(sorted(cur)) or "(none)"
            sect = ".".join(parts[:i]) or "the scenario"
            raise UserError(f"{where}: {dotted}: {sect} has no field {p!r} (fields: {known})")
        cur = cur[p]


def parse_sweep(data: Mapping, source: str | Path = "<sweep>", base_dir: Path | None = None) -> SweepSpec:
    """Validate a sweep spec mapping (module docstring); one-line UserErrors naming ``source`` and the field."""
    from rackbed.sim.scenario import load_scenario, parse_scenario

    src = str(source)
    if not isinstance(data, Mapping):
        raise UserError(f"{src}: a sweep spec must be a mapping")
    known = {"kind", "name", "description", "base", "scenario", "grid", "points", "figures"}
    extra = sorted(set(data) - known)
    if extra:
        raise UserError(f"{src}: {extra[0]}: unknown key (sweep keys: {', '.join(sorted(known))})")
    if data.get("kind", "sweep") != "sweep":
        raise UserError(f"{src}: kind: expected 'sweep', got {data.get('kind')!r}")
    base: dict = {}
    if data.get("base") is not None:
        from rackbed import scenarios

        ref = str(data["base"])
        p = Path(ref)
        if base_dir is not None and not p.is_absolute() and (base_dir / p).exists():
            p = base_dir / p
        path = scenarios.resolve(p if p.exists() else ref)
        base = scenario_dict(load_scenario(path))
    inline = data.get("scenario") or {}
    if not isinstance(inline, Mapping):
        raise UserError(f"{src}: scenario: expected a mapping of scenario fields")
    base = deep_merge(base, inline)
    if not base:
        raise UserError(f"{src}: give base (a scenario file or name) or scenario (inline fields)")
    # validate the base once, so that bad base fields are one error, not one per point
    base_full = scenario_dict(parse_scenario(base, f"{src}: base"))
    grid = data.get("grid") or {}
    if not isinstance(grid, Mapping):
        raise UserError(f"{src}: grid: expected a mapping of dotted paths to lists")
    grid_out: dict[str, list] = {}
    for k, v in grid.items():
        if not isinstance(v, list) or not v:
            raise UserError(f"{src}: grid.{k}: expected a non-empty list of values")
        _check_path(base_full, str(k), f"{src}: grid")
        grid_out[str(k)] = list(v)
    pts = data.get("points") or []
    if not isinstance(pts, list):
        raise UserError(f"{src}: points: expected a list of mappings")
    pts_out: list[dict] = []
    for i, pt in enumerate(pts):
        if not isinstance(pt, Mapping) or not pt:
            raise UserError(f"{src}: points[{i}]: expected a non-empty mapping of dotted paths to values")
        for k in pt:
            if k in grid_out:
                raise UserError(f"{src}: points[{i}].{k}: also a grid axis; give it in one place")
            _check_path(base_full, str(k), f"{src}: points[{i}]")
        pts_out.append({str(k): v for k, v in pt.items()})
    figs = data.get("figures") or []
    from rackbed.sim.sweep_figures import FIGURES

    if not isinstance(figs, list) or any(not isinstance(f, str) or f not in FIGURES for f in figs):
        raise UserError(f"{src}: figures: expected a list of figure names ({', '.join(sorted(FIGURES))})")
    name = str(data.get("name") or Path(src).stem)
    return SweepSpec(name=name, base=base, grid=grid_out, points=pts_out, source=src,
                     description=str(data.get("description") or ""), figures=tuple(figs))


def load_sweep(path: str | Path) -> SweepSpec:
    """A sweep spec from a YAML file path or a shipped name (``scenarios/sweeps/<name>.yaml``)."""
    from rackbed.topology.yamlio import load_yaml

    p = Path(path)
    if not p.exists() and p.suffix not in (".yaml", ".yml"):
        cand = SWEEPS_DIR / f"{path}.yaml"
        if cand.exists():
            p = cand
    if not p.exists():
        raise FileNotFoundError(f"{path}: no such sweep spec")
    return parse_sweep(load_yaml(p), p, base_dir=p.parent)


def n_points(spec: SweepSpec) -> int:
    """How many points ``expand(spec)`` makes."""
    return math.prod(len(v) for v in spec.grid.values()) * max(1, len(spec.points))


def iter_overrides(spec: SweepSpec) -> Iterable[dict]:
    """Override dicts in expansion order: for each ``points`` entry (or once), the grid in row-major order."""
    axes = list(spec.grid)
    for extra in spec.points or [{}]:
        for combo in itertools.product(*(spec.grid[a] for a in axes)):
            yield {**extra, **dict(zip(axes, combo))}


def expand(spec: SweepSpec) -> list[SweepPoint]:
    """Every point of the spec, validated (a point whose scenario does not validate carries its reason and a key
    hashed from the raw dict)."""
    from rackbed.sim.scenario import parse_scenario

    out = []
    for i, ov in enumerate(iter_overrides(spec)):
        raw = copy.deepcopy(spec.base)
        for k, v in ov.items():
            set_path(raw, k, v)
        raw["name"] = f"{spec.name}-{i}"
        label = _label(ov)
        try:
            full = scenario_dict(parse_scenario(raw, f"{spec.source}: point {i} ({label})"))
        except UserError as exc:
            out.append(SweepPoint(i, ov, raw, point_key(raw), label, invalid_reason=str(exc)))
            continue
        out.append(SweepPoint(i, ov, full, point_key(full), label))
    return out


# ------------------------------------------------------------------------------------------------------------------
# One point (runs in a worker)

_COST_MODELS: dict[tuple, object] = {}
_COST_MODELS_MAX = 64


def _cost_model_key(b) -> tuple | None:
    sc = b.scenario
    if (sc.autoscaler is not None and sc.autoscaler.enabled) or sc.faults:
        return None
    groups = tuple((g.id, tuple(g.gpus)) for g in (*b.deployment.prefillers, *b.deployment.decoders))
    return (sc.topology, sc.model, sc.calibration, b.prefill_plan.model_dump_json(),
            b.decode_plan.model_dump_json(), groups, sc.mtp.draft,  # the draft is priced in the decode memo
            sc.decode.expert_load, sc.decode.eplb)  # and so is the expert load


def _reuse_cost_model(b) -> None:
    """Swap ``b.cost_model`` for this process's earlier one with the same plans and placement (module docstring)."""
    key = _cost_model_key(b)
    if key is None:
        return
    cm = _COST_MODELS.get(key)
    if cm is None:
        if len(_COST_MODELS) >= _COST_MODELS_MAX:
            _COST_MODELS.pop(next(iter(_COST_MODELS)))
        _COST_MODELS[key] = b.cost_model
    else:
        b.cost_model = cm


def summarize_metrics(m: Mapping) -> dict:
    """The flat per-point summary stored with each record (None where the run produced no sample).

    tokens_per_s_per_gpu: output tokens/s of completed requests per allocated GPU (all roles);
    tokens_per_s_per_user: p50 over requests of 1/TPOT; ttft/tpot at p50/p90/p99 (seconds); with an energy section
    (``sim.energy``), tokens_per_s_per_kw (output tokens/s per kW of facility power, the whole pool), mean_kw and
    j_per_output_token; with a prefix cache,
    prefix_hit_rate (of prompt tokens, all tiers), prefix_hbm_hit_rate, prefix_tokens_saved and prefix_load_wait_s
    (absent without one, so summaries of runs without a cache are as before)."""
    th, lat, req = m.get("throughput", {}), m.get("latency_s", {}), m.get("requests", {})
    gp, ut, dec = m.get("goodput", {}), m.get("utilisation", {}), m.get("decode", {})

    def q(d, k):
        return (d or {}).get(k)

    out = {
        "requests": req.get("total"), "done": req.get("done"), "rejected": req.get("rejected"),
        "duration_s": th.get("duration_s"), "mean_gpus": th.get("mean_gpus"),
        "output_tokens_per_s": th.get("output_tokens_per_s"), "input_tokens_per_s": th.get("input_tokens_per_s"),
        "requests_per_s": th.get("requests_per_s"),
        "tokens_per_s_per_gpu": th.get("output_tokens_per_s_per_gpu"),
        "tokens_per_s_per_decode_gpu": th.get("output_tokens_per_s_per_decode_gpu"),
        "input_tokens_per_s_per_prefill_gpu": th.get("input_tokens_per_s_per_prefill_gpu"),
        "tokens_per_s_per_user": q(th.get("tokens_per_s_per_user"), "p50"),
        "ttft_p50_s": q(lat.get("ttft"), "p50"), "ttft_p90_s": q(lat.get("ttft"), "p90"),
        "ttft_p99_s": q(lat.get("ttft"), "p99"),
        "tpot_p50_s": q(lat.get("tpot"), "p50"), "tpot_p90_s": q(lat.get("tpot"), "p90"),
        "tpot_p99_s": q(lat.get("tpot"), "p99"),
        "itl_p50_s": q(lat.get("itl"), "p50"),
        "goodput_fraction": gp.get("fraction"),
        "util_prefill": ut.get("prefill"), "util_decode": ut.get("decode"),
        "decode_steps": dec.get("steps"), "decode_sequence_steps": dec.get("sequence_steps"),
    }
    en = m.get("energy")
    if en:
        out.update(tokens_per_s_per_kw=en.get("output_tokens_per_s_per_kW"), mean_kw=en.get("mean_kW"),
                   j_per_output_token=en.get("J_per_output_token"))
    pc = m.get("prefix_cache")
    if pc:
        out.update(prefix_hit_rate=pc.get("hit_rate_tokens"),
                   prefix_hbm_hit_rate=(pc.get("hit_rate_by_tier") or {}).get("hbm"),
                   prefix_tokens_saved=pc.get("prefill_tokens_saved"), prefix_load_wait_s=pc.get("load_wait_s"))
    return out


def arrival_quarters(res, window_s: float | None) -> list[dict] | None:
    """Per quarter of the arrival window ``[0, window_s)``: the requests that arrived in it (``n``), how many
    finished (``done``), and the p50 / p90 / p99 TTFT and TPOT of those done (seconds; None without a sample). A request
    unfinished at the end of the run counts as missing its SLOs where the budget search reads this. None
    without a window."""
    import numpy as np

    from rackbed.engine.core.metrics import request_arrays

    if not window_s or not res.rows:
        return None
    a = request_arrays(res.rows, res.row_fields)
    arrival, out_tok = a["arrival_s"], a["output_tokens"]
    done = a["status"] == "done"
    ttft = a["first_token_s"] - arrival
    out = []
    for i in range(4):
        sel = (arrival >= i * window_s / 4) & (arrival < (i + 1) * window_s / 4)
        d = sel & done
        m = d & (out_tok > 1)
        tpot = (a["end_s"][m] - a["first_token_s"][m]) / (out_tok[m] - 1)
        q = {"n": int(sel.sum()), "done": int(d.sum())}
        for pct in (50, 90, 99):
            q[f"ttft_p{pct}_s"] = round(float(np.percentile(ttft[d], pct)), 6) if d.any() else None
            q[f"tpot_p{pct}_s"] = round(float(np.percentile(tpot, pct)), 6) if m.any() else None
        out.append(q)
    return out


def run_point(payload: Mapping) -> dict:
    """Simulate one point; never raises for a bad point. ``payload``: ``{index, key, label, overrides, scenario}``.
    Returns the record (module docstring). Top level so that process pools can pickle it."""
    from rackbed.engine.core.metrics import clean
    from rackbed.sim.scenario import build, parse_scenario, simulate_scenario

    t0, c0 = time.perf_counter(), time.process_time()
    rec = {"key": payload["key"], "index": payload["index"], "label": payload["label"],
           "overrides": payload["overrides"]}
    limit = payload.get("limit_s")
    try:
        with _wall_limit(limit):
            sc = parse_scenario(payload["scenario"], f"point {payload['index']}")
            b = build(sc)
            _reuse_cost_model(b)
            _, res = simulate_scenario(sc, built=b)
            res.metrics["energy"] = _energy(b, res, sc)
        m = clean(res.metrics)
        rec.update(status="ok", reason="", summary=summarize_metrics(m), metrics=m,
                   quarters=arrival_quarters(res, getattr(sc.workload, "duration_s", None)))
    except PointTimeout:
        rec.update(status="timeout", reason=f"ran longer than the per-point limit of {limit:g} s", limit_s=limit)
    except (ValueError, FileNotFoundError) as exc:  # UserError, pydantic ValidationError: a bad point
        rec.update(status="invalid", reason=one_line(exc))
    except Exception as exc:  # noqa: BLE001 -- a bug: record it, keep sweeping, retry on the next run
        tb = traceback.format_exception(exc)
        rec.update(status="error", reason=f"{type(exc).__name__}: {one_line(exc)}", traceback="".join(tb[-6:]))
    rec["wall_s"] = round(time.perf_counter() - t0, 6)
    rec["cpu_s"] = round(time.process_time() - c0, 6)  # this process's CPU time: wall_s >> cpu_s = contention
    rec["pid"] = os.getpid()
    return rec


def _energy(b, res, sc) -> dict | None:
    """The run's energy section (``sim.energy``) without its per-worker table (records stay small)."""
    from rackbed.sim.energy import energy_report

    e = energy_report(b, res, sc.energy.prices())
    if e is not None:
        e.pop("workers", None)
    return e


class PointTimeout(BaseException):
    """A point ran past its wall-clock limit (a BaseException: no ``except Exception`` on the way swallows it)."""


@contextmanager
def _wall_limit(seconds: float | None):
    """Raise :class:`PointTimeout` in this thread after ``seconds`` of wall time (SIGALRM: the main thread of a
    POSIX process, as in the sweep's own process, its pool workers and Ray's; elsewhere, or with None, no limit)."""
    if not seconds or not hasattr(signal, "setitimer") or threading.current_thread() is not threading.main_thread():
        yield
        return

    def on_alarm(_signum, _frame):
        raise PointTimeout

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _settled(rec: Mapping, limit_s: float | None) -> bool:
    """A record that a re-run does not run again: ok, invalid, or a timeout under a limit at least as large."""
    st = rec.get("status")
    if st == "timeout":
        return limit_s is not None and rec.get("limit_s", 0.0) >= limit_s
    return st in DONE_STATUSES


def _worker_init() -> None:
    """Import the simulator once per worker process, before the first point is timed; the worker ends with the
    sweep's process, even a killed one (``engine.loop.lifetime``)."""
    from rackbed.engine.loop.lifetime import die_with_parent

    die_with_parent()
    import rackbed.sim.driver
    import rackbed.sim.scenario  # noqa: F401



# ------------------------------------------------------------------------------------------------------------------
# Results file


def read_results(path: str | Path) -> list[dict]:
    """Records of a results JSONL file (a missing file = none; a torn last line, left by a kill, is skipped)."""
    p = Path(path)
    if not p.exists():
        return []
    out = []
    with p.open(encoding="utf-8") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(rec, dict) and "key" in rec:
                out.append(rec)
    return out


def latest_by_key(records: Iterable[dict]) -> dict[str, dict]:
    """The last record of each key (a retried error is superseded by its later record)."""
    out: dict[str, dict] = {}
    for r in records:
        out[r["key"]] = r
    return out


class _Appender:
    """Appends records to a JSONL file, one flushed line each; repairs a torn last line first."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        torn = False
        if path.exists() and path.stat().st_size > 0:
            with path.open("rb") as f:
                f.seek(-1, os.SEEK_END)
                torn = f.read(1) != b"\n"
        from rackbed.topology.outputs import open_append

        self.f = open_append(path)  # never through a link
        if torn:
            self.f.write("\n")

    def write(self, rec: dict) -> None:
        self.f.write(json.dumps(rec, separators=(",", ":"), allow_nan=False, default=str) + "\n")
        self.f.flush()

    def close(self) -> None:
        self.f.close()


# ------------------------------------------------------------------------------------------------------------------
# Running


@dataclass
class SweepRun:
    """What a run did: every point's latest record (in point order), and counts for this invocation."""

    records: list[dict]
    ran: int
    skipped: int
    wall_s: float
    jobs: int
    counts: dict[str, int]

    @property
    def points_per_s(self) -> float:
        return self.ran / self.wall_s if self.wall_s > 0 else math.nan


def _payload(p: SweepPoint, limit_s: float | None = None) -> dict:
    return {"index": p.index, "key": p.key, "label": p.label, "overrides": p.overrides, "scenario": p.scenario,
            "limit_s": limit_s}


def run_points(points: Sequence[SweepPoint], out: str | Path, *, jobs: int = 1, ray_address: str | None = None,
               progress: bool = True, start_method: str = "spawn", console=None,
               on_record: Callable[[dict], None] | None = None, limit_s: float | None = POINT_LIMIT_S) -> SweepRun:
    """Simulate the points not already done in the JSONL file ``out`` and append their records.

    jobs: processes (1 = in this process); ray_address: run as Ray tasks on that cluster instead (needs ``ray``);
    limit_s: wall seconds per point (None: no limit; module docstring).
    Points that did not validate are recorded as invalid here, without a worker. Returns a :class:`SweepRun`.
    """
    if jobs < 1:
        raise UserError(f"--jobs: must be >= 1, got {jobs}")
    if limit_s is not None and not limit_s > 0:
        raise UserError(f"--point-limit: must be > 0 seconds, got {limit_s}")
    if ray_address:
        from rackbed.sim.sweep_ray import ray_precheck

        ray_precheck(ray_address)  # fail before touching the results file
    out = Path(out)
    done = {k for k, r in latest_by_key(read_results(out)).items() if _settled(r, limit_s)}
    todo, skipped = [], 0
    seen: set[str] = set()
    for p in points:
        if p.key in done or p.key in seen:  # duplicates in one spec run once
            skipped += 1
            continue
        seen.add(p.key)
        todo.append(p)
    app = _Appender(out)
    t0 = time.perf_counter()
    counts = {"ok": 0, "invalid": 0, "error": 0}

    def emit(rec: dict) -> None:
        app.write(rec)
        counts[rec["status"]] = counts.get(rec["status"], 0) + 1
        if on_record is not None:
            on_record(rec)

    try:
        payloads = []
        for p in todo:
            if p.invalid_reason is not None:
                emit({"key": p.key, "index": p.index, "label": p.label, "overrides": p.overrides,
                      "status": "invalid", "reason": p.invalid_reason, "wall_s": 0.0, "pid": os.getpid()})
            else:
                payloads.append(_payload(p, limit_s))
        with _progress(progress and bool(payloads), len(payloads), console) as advance:
            def emit_adv(rec: dict) -> None:
                emit(rec)
                advance(rec)

            if ray_address:
                from rackbed.sim.sweep_ray import run_ray

                run_ray(payloads, ray_address, emit_adv, run_point)
            elif jobs == 1:
                for pl in payloads:
                    emit_adv(run_point(pl))
            else:
                _run_pool(payloads, jobs, start_method, emit_adv)
    finally:
        app.close()
    wall = time.perf_counter() - t0
    latest = latest_by_key(read_results(out))
    recs = [latest[p.key] for p in points if p.key in latest]
    return SweepRun(records=recs, ran=len(todo), skipped=skipped, wall_s=wall, jobs=jobs, counts=counts)


def _run_pool(payloads: list[dict], jobs: int, start_method: str, emit: Callable[[dict], None]) -> None:
    import multiprocessing as mp
    from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

    ctx = mp.get_context(start_method)
    with ProcessPoolExecutor(max_workers=jobs, mp_context=ctx, initializer=_worker_init) as pool:
        # keep a bounded window in flight, so an interrupt loses little and memory stays flat
        it = iter(payloads)
        inflight = set()
        try:
            for pl in itertools.islice(it, 4 * jobs):
                inflight.add(pool.submit(run_point, pl))
            while inflight:
                fin, inflight = wait(inflight, return_when=FIRST_COMPLETED)
                for fut in fin:
                    emit(fut.result())
                    nxt = next(it, None)
                    if nxt is not None:
                        inflight.add(pool.submit(run_point, nxt))
        except BaseException:
            for f in inflight:
                f.cancel()
            pool.shutdown(wait=False, cancel_futures=True)
            raise


class _progress:
    """A rich progress bar with ETA (context manager yielding ``advance(record)``); a no-op when disabled."""

    def __init__(self, enabled: bool, total: int, console=None) -> None:
        self.enabled, self.total, self.console = enabled, total, console
        self.bar = None

    def __enter__(self):
        if not self.enabled:
            return lambda rec: None
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self.bar = Progress(TextColumn("[bold]sweep[/bold]"), BarColumn(), MofNCompleteColumn(),
                            TextColumn("{task.fields[status]}"), TimeElapsedColumn(), TextColumn("ETA"),
                            TimeRemainingColumn(), console=self.console, transient=False)
        self.bar.start()
        task = self.bar.add_task("sweep", total=self.total, status="")
        counts = {"ok": 0, "invalid": 0, "error": 0}

        def advance(rec: dict) -> None:
            counts[rec["status"]] = counts.get(rec["status"], 0) + 1
            st = f"ok {counts['ok']} invalid {counts['invalid']}" + (
                f" [red]error {counts['error']}[/red]" if counts["error"] else "")
            self.bar.update(task, advance=1, status=st)

        return advance

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.stop()


def run_sweep(spec: SweepSpec, out_dir: str | Path, *, jobs: int = 1, ray_address: str | None = None,
              progress: bool = True, start_method: str = "spawn", console=None) -> SweepRun:
    """Expand ``spec`` and run it into ``out_dir/results.jsonl`` (resumable; module docstring)."""
    out_dir = Path(out_dir)
    return run_points(expand(spec), out_dir / "results.jsonl", jobs=jobs, ray_address=ray_address,
                      progress=progress, start_method=start_method, console=console)


# ------------------------------------------------------------------------------------------------------------------
# Benchmark


def _loadavg() -> tuple[float, float, float] | None:
    try:
        return os.getloadavg()
    except OSError:
        return None


def bench(spec_path: str | Path | None = None, *, out_dir: str | Path | None = None, sample: int = 200,
          jobs: int = 2, full: bool = True, console=None, progress: bool = True, force: bool = False) -> dict:
    """Time the 1,000-point benchmark sweep.

    1. ``sample`` points spread evenly over the spec with 1 process, then the same points with ``jobs`` processes (fresh result
       files both times): points/s each and the parallel efficiency ``rate_jobs / (jobs * rate_1)``;
    2. with ``full``: the whole spec with ``jobs`` processes (fresh file), its wall time and points/s, and the
       efficiency against the 1-process sample rate (the pool's start-up amortised over 1,000 points).

    ``out_dir`` follows the output rule (``topology.outputs.prepare_dir``: missing or empty, or ``force``);
    without it a fresh temporary folder is used. Returns a dict of the figures (also written as ``bench.json``
    there); the machine's load average before and after is recorded since the figures depend on what else
    runs.
    """
    import tempfile

    spec = load_sweep(spec_path or SWEEPS_DIR / "bench-1000.yaml")
    pts = expand(spec)
    from rackbed.topology.outputs import prepare_dir, write_text

    # an --out folder under the output rule (empty, or --force: its bench files are replaced); else a new one
    out = prepare_dir(out_dir, force=force) if out_dir else Path(tempfile.mkdtemp(prefix="rackbed-bench-"))
    for name in ("bench-1proc.jsonl", f"bench-{jobs}proc.jsonl", "bench-full.jsonl"):
        (out / name).unlink(missing_ok=True)  # results files resume: these runs start afresh
    res: dict[str, Any] = {"spec": spec.source, "points": len(pts), "cpus": os.cpu_count(),
                           "loadavg_before": _loadavg(), "sample": min(sample, len(pts)), "jobs": jobs}
    step = max(1, len(pts) // max(1, sample))
    sub = pts[::step][:sample]  # evenly spread over the spec, so the sample has its mix of point sizes
    r1 = run_points(sub, out / "bench-1proc.jsonl", jobs=1, progress=progress, console=console)
    rn = run_points(sub, out / f"bench-{jobs}proc.jsonl", jobs=jobs, progress=progress, console=console)
    res["sample_1proc"] = {"wall_s": r1.wall_s, "points_per_s": r1.points_per_s, "counts": r1.counts}
    res[f"sample_{jobs}proc"] = {"wall_s": rn.wall_s, "points_per_s": rn.points_per_s, "counts": rn.counts}
    res["parallel_efficiency"] = rn.points_per_s / (jobs * r1.points_per_s)
    for name, run in (("sample_1proc", r1), (f"sample_{jobs}proc", rn)):
        ok = [r for r in run.records if r.get("status") == "ok"]
        if ok:
            res[name]["mean_point_wall_s"] = sum(r["wall_s"] for r in ok) / len(ok)
            res[name]["mean_point_cpu_s"] = sum(r.get("cpu_s", 0.0) for r in ok) / len(ok)
    res["sample_mean_point_s"] = res["sample_1proc"].get("mean_point_wall_s")
    if full:
        rf = run_points(pts, out / "bench-full.jsonl", jobs=jobs, progress=progress, console=console)
        res["full"] = {"wall_s": rf.wall_s, "points_per_s": rf.points_per_s, "counts": rf.counts,
                       "within_10_min": rf.wall_s <= 600.0,
                       # the pool's start-up (spawned workers importing the simulator) amortised over the whole spec
                       "parallel_efficiency_vs_1proc_sample": rf.points_per_s / (jobs * r1.points_per_s)}
    res["loadavg_after"] = _loadavg()
    write_text(out / "bench.json", json.dumps(res, indent=1))
    res["out_dir"] = str(out)
    return res


def format_bench(res: Mapping) -> str:
    """The benchmark figures as a few lines of text."""
    j = res["jobs"]
    s1, sn = res["sample_1proc"], res[f"sample_{j}proc"]
    lines = [(f"benchmark: {res['spec']} ({res['points']} points), {res['cpus']} CPUs, "
              f"load average before {_fmt_load(res.get('loadavg_before'))}"),
             (f"  sample of {res['sample']} points: 1 process {s1['points_per_s']:.3f} points/s "
              f"({s1['wall_s']:.1f} s); {j} processes {sn['points_per_s']:.3f} points/s ({sn['wall_s']:.1f} s); "
              f"parallel efficiency {res['parallel_efficiency']:.2f}")]
    for name, label in (("sample_1proc", "1 process"), (f"sample_{j}proc", f"{j} processes")):
        d = res[name]
        if "mean_point_wall_s" in d:
            lines.append(f"  one point with {label}: {d['mean_point_wall_s']:.3f} s wall, {d['mean_point_cpu_s']:.3f} s "
                         "CPU (wall well above CPU = the worker waited for a core)")
    if "full" in res:
        f = res["full"]
        lines.append(f"  full sweep, {j} processes: {f['wall_s']:.1f} s ({f['wall_s'] / 60:.2f} min), "
                     f"{f['points_per_s']:.3f} points/s, {f['counts']}; "
                     f"{'within' if f['within_10_min'] else 'OVER'} the 10-minute target; parallel efficiency "
                     f"vs the 1-process sample rate {f['parallel_efficiency_vs_1proc_sample']:.2f}")
    lines.append(f"  load average after {_fmt_load(res.get('loadavg_after'))}")
    return "\n".join(lines)


def _fmt_load(x) -> str:
    return "n/a" if not x else " ".join(f"{v:.2f}" for v in x)
