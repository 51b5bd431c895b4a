"""Engine-level calibration: the real engine's measured step times drive the simulator for that engine.

The kernel calibration (``calibration/h200.yaml``) makes the first-principles cost models match the *kernels*;
the real engine adds what those models do not describe — Python and launch overheads, its own attention and MoE
glue, and its KV transfers, which run on each rank's transfer lane (own thread, CUDA stream and process group)
beside the compute loop, so their time depends on what the two ends compute meanwhile. A real run
(``rackbed real``) records every plan's measured time; :func:`fit_engine` replays the run through the simulator
with those times (the same scheduler, so the same plans: each prefill batch's sequences, each KV's tokens) and
fits, from every plan not held out:

- ``decode_step_s(batch)``: robust line in the total batch (tabulated at the measured batch sizes);
- ``prefill_s`` + ``prefill_attn_s``: ``a + b * tokens + c * pairs``, where ``pairs`` is the batch's causal
  attention work, the query-key pairs ``sum(n * start + n * (n + 1) / 2)`` over its sequences — attention is
  quadratic in each sequence's length, so two 1500-token prompts cost less than one 3000-token prompt (robust
  non-negative least squares);
- ``kv_transfer_s(tokens)``: robust line over KV transfers (measured from dispatch to completion, waits for the
  ends' compute included).

The file (``calibration/engine-<gpu>-<model>.yaml``) is used automatically by ``sim.scenario.build`` when the
scenario's model name (truncation included) and GPU match: :class:`EngineCalibratedCostModel` rescales the cost
model's StepTime so its total is the fitted value (the breakdown's proportions are the model's) and replaces the
KV transfer's fixed cost. :func:`validate_engine` reports per-plan errors on the held-out plans and TTFT/TPOT
p50/p90 of a re-simulation against the real run.
"""

from __future__ import annotations

import csv
import json
import math
import statistics
from dataclasses import replace
from pathlib import Path

import numpy as np
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from rackbed import shipped
from rackbed.topology.errors import UserError, from_validation

ENGINE_DIR = shipped("calibration")


def attn_pairs(items) -> float:
    """Causal attention work of a prefill batch: query-key pairs over its ``(request_id, start, n)`` items (a chunk
    of ``n`` tokens after ``start`` already prefilled attends to ``start`` earlier tokens and causally to itself)."""
    return float(sum(n * start + n * (n + 1) / 2 for _, start, n in items))


class EngineCalibration(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    version: int = 1
    kind: str = "engine"
    gpu: str
    model: str
    source: str = ""
    date: str = ""
    holdout_every: int = 3
    decode_step_s: tuple[tuple[float, float], ...] = Field(min_length=1)   # (batch, seconds)
    prefill_s: tuple[float, float]                                          # (a, b): a + b * tokens
    prefill_attn_s: float = 0.0                                             # + c * causal attention pairs
    kv_transfer_s: tuple[float, float]                                      # (a, b): a + b * tokens
    # the deployment kind whose runs fitted it: "disaggregated" (prefill batches, decode steps, KV transfers) or
    # "aggregated" (one-GPU workers' mixed steps, ``mixed_s``)
    mode: str = "disaggregated"
    # aggregated: seconds per unit of each term of a mixed step (:data:`MIXED_TERMS`), summed
    mixed_s: dict[str, float] = Field(default_factory=dict)
    # aggregated: whether the fitted runs replayed their prefill chunks as CUDA graphs (padded shapes) or eagerly
    prefill_graphs: bool = True
    n_plans: dict[str, int] = Field(default_factory=dict)
    #: optional per-term refit from profiled plans (``sim.engine_attribution.fit_terms``): read, not priced
    term_fit: dict | None = None

    @field_validator("mode")
    @classmethod
    def _mode(cls, v):
        if v not in ("disaggregated", "aggregated"):
            raise ValueError(f"mode: {v!r} is not 'disaggregated' or 'aggregated'")
        return v

    @field_validator("mixed_s")
    @classmethod
    def _mixed(cls, v):
        if v and not set(MIXED_TERMS) - set(MTP_TERMS) <= set(v) <= set(MIXED_TERMS):
            raise ValueError(f"mixed_s: one coefficient per term {', '.join(MIXED_TERMS)} (the MTP terms may be "
                             f"left out); got {', '.join(v)}")
        bad = [k for k, x in v.items() if not (math.isfinite(x) and x >= 0)]
        if bad:
            raise ValueError(f"mixed_s.{bad[0]}: must be finite and >= 0 (seconds per unit)")
        return {k: v.get(k, 0.0) for k in MIXED_TERMS} if v else v

    @field_validator("decode_step_s", "prefill_s", "prefill_attn_s", "kv_transfer_s")
    @classmethod
    def _finite_non_negative(cls, v, info):
        """Every fitted number is a time, a rate per token or a batch size: finite and >= 0 (the file is loaded
        automatically for its GPU and model, so a hand-edited ``-1`` would otherwise price every run)."""
        items = [(None, v)] if isinstance(v, float) else list(enumerate(v))
        for i, item in items:
            bad = [x for x in (item if isinstance(item, tuple) else (item,)) if not (math.isfinite(x) and x >= 0)]
            if bad:
                where = "" if i is None else f"[{i}] {item}"
                raise ValueError(f"{info.field_name}{where}: must be finite and >= 0 (times and batch sizes)")
        return v

    def decode(self, batch: float) -> float:
        xs, ys = zip(*self.decode_step_s)
        return float(np.interp(batch, xs, ys))

    def prefill(self, tokens: float, pairs: float = 0.0) -> float:
        """A prefill batch of ``tokens`` tokens whose attention covers ``pairs`` query-key pairs
        (:func:`attn_pairs`)."""
        return max(self.prefill_s[0] + self.prefill_s[1] * tokens + self.prefill_attn_s * pairs, 0.0)

    def kv(self, tokens: float) -> float:
        return max(self.kv_transfer_s[0] + self.kv_transfer_s[1] * tokens, 0.0)

    def mixed(self, shape: dict[str, float]) -> float:
        """An aggregated worker's step of ``shape`` (:func:`mixed_shape`): the sum of each term times its fitted
        seconds per unit."""
        return sum(self.mixed_s[k] * shape[k] for k in MIXED_TERMS)


def load_engine_calibration(path: str | Path) -> EngineCalibration:
    from rackbed.topology.yamlio import load_yaml

    path = Path(path)
    try:
        return EngineCalibration.model_validate(load_yaml(path))
    except ValidationError as exc:
        raise from_validation(exc, path) from None


def find_engine_calibration(gpu: str, model: str, directory: Path | None = None, *,
                            mode: str = "disaggregated") -> tuple[Path, EngineCalibration] | None:
    """The shipped engine calibration for this GPU model, model name and deployment kind (``mode``), if any."""
    for p in sorted((directory or ENGINE_DIR).glob("engine-*.yaml")):
        cal = load_engine_calibration(p)  # a broken file is an error, not skipped: it would price runs silently
        if cal.gpu == gpu and cal.model == model and cal.mode == mode:
            return p, cal
    return None


#: the terms of an aggregated worker's mixed step (one GPU): a fixed cost per step; the experts the decode batch
#: touches per layer, ``E (1 - (1 - k/E)^B)`` for B sequences routed to k of E experts each (their weights are read
#: once: the MoE's cost saturates with the batch); the decode sequences; the KV tokens they attend over; the prefill
#: tokens and query-key pairs the engine computes for its chunks (padded to its CUDA-graph shapes,
#: ``engine.core.graph_shapes.prefill_padded``); the chunks (each one forward, reading every expert's weights); and,
#: with MTP (k drafts a step), the draft forwards (``drafts`` = k: each runs the MTP module and its LM head once)
#: and the drafted tokens (``draft_tokens`` = B k: the verify forward's extra tokens and the drafts' own), the
#: verify's touched experts counted for its ``B (1 + k)`` tokens. A calibration fitted without MTP runs prices
#: the two MTP terms at 0 (files written before they existed hold no coefficient for them).
MIXED_TERMS = ("step", "touched_experts", "seqs", "context", "prefill_tokens", "pairs", "chunks", "drafts",
               "draft_tokens")
MTP_TERMS = ("drafts", "draft_tokens")


def touched_experts(batch: float, n_experts: int, top_k: int) -> float:
    """Expected distinct experts ``batch`` tokens routed uniformly to ``top_k`` of ``n_experts`` reach."""
    if not batch or not n_experts:
        return 0.0
    return n_experts * (1.0 - (1.0 - top_k / n_experts) ** batch)


def prefill_graphs(real: dict) -> bool:
    """Whether a real run's ranks replayed their prefill steps as CUDA graphs (``real.json``'s ``graphs``, which
    every rank reports when it stops; a run recorded without it counts as eager)."""
    reports = list((real.get("graphs") or {}).values())
    return bool(reports) and all(r.get("prefill", {}).get("mode") == "graph" for r in reports)


def mixed_shape(plan, model, page_tokens: int, prefill_graphs: bool = True) -> dict[str, float]:
    """The :data:`MIXED_TERMS` of a ``MixedStep`` of ``model`` (a ``ModelSpec``: its experts and top-k) on a worker
    with KV pages of ``page_tokens`` tokens. ``prefill_graphs``: the engine replays its prefill chunks as CUDA graphs
    (tokens and keys padded to the graph shapes); else it runs them eagerly (the chunk's own tokens, causal pairs)."""
    from rackbed.engine.core.graph_shapes import prefill_padded

    b = float(sum(plan.rank_batch))
    k = float(plan.draft_k) if b else 0.0
    padded = [prefill_padded(s, n, page_tokens) if prefill_graphs else (n, n * s + n * (n + 1) // 2)
              for _, _, s, n in plan.prefill]
    return {"step": 1.0, "touched_experts": touched_experts(b * (1.0 + k), model.n_experts, model.top_k),
            "seqs": b, "context": float(sum(plan.rank_context_tokens)),
            "prefill_tokens": float(sum(t for t, _ in padded)), "pairs": float(sum(q for _, q in padded)),
            "chunks": float(len(plan.prefill)), "drafts": k, "draft_tokens": b * k}


class EngineCalibratedCostModel:
    """Wraps a ``ScenarioCostModel``: step totals from the engine calibration, breakdown proportions from it."""

    def __init__(self, base, cal: EngineCalibration) -> None:
        self.base, self.cal = base, cal

    def __getattr__(self, name):
        return getattr(self.base, name)

    @staticmethod
    def _scaled(st, total: float):
        t = st.total_s
        if t <= 0:
            return replace(st, other_s=total)
        f = total / t
        return type(st)(attn_s=st.attn_s * f, moe_gemm_s=st.moe_gemm_s * f, a2a_s=st.a2a_s * f,
                        allreduce_s=st.allreduce_s * f, other_s=st.other_s * f)

    def prefill(self, plan, group):
        return self._scaled(self.base.prefill(plan, group), self.cal.prefill(plan.n_tokens, attn_pairs(plan.items)))

    def decode(self, plan, group):
        return self._scaled(self.base.decode(plan, group), self.cal.decode(max(plan.rank_batch)))

    def decode_point(self, group, max_batch, max_context_tokens, draft_k):
        """The driver's fast-forward entry (see ``ScenarioCostModel.decode_point``), rescaled like ``decode``."""
        st, hi = self.base.decode_point(group, max_batch, max_context_tokens, draft_k)
        return self._scaled(st, self.cal.decode(max_batch)), hi

    @staticmethod
    def _scaled_breakdown(bd, total: float):
        """A StepBreakdown whose terms keep their proportions and sum to ``total`` (as :meth:`_scaled`)."""
        from rackbed.sim.costs.breakdown import StepBreakdown

        t = bd.total_s
        if t <= 0:
            return StepBreakdown({**bd.terms, "engine": ("other_s", total)})
        f = total / t
        return StepBreakdown({k: (c, s * f) for k, (c, s) in bd.terms.items()})

    def prefill_breakdown(self, seqs, group=None):
        """``prefill`` term by term: the base model's breakdown rescaled to the fitted batch time."""
        bd = self.base.prefill_breakdown(seqs, group)
        tokens = sum(q for q, _ in seqs)
        return self._scaled_breakdown(bd, self.cal.prefill(tokens, attn_pairs((0, c, q) for q, c in seqs)))

    def decode_breakdown(self, max_batch, max_context_tokens, draft_k, group=None):
        """``decode_point`` term by term: the base model's breakdown rescaled to the fitted step time."""
        bd = self.base.decode_breakdown(max_batch, max_context_tokens, draft_k, group)
        return self._scaled_breakdown(bd, self.cal.decode(max_batch))

    def mixed(self, plan, group):
        """An aggregated worker's step: the fitted ``mixed_s`` (a calibration fitted to disaggregated runs has none:
        the base model's price)."""
        st = self.base.mixed(plan, group)
        if not self.cal.mixed_s:
            return st
        shape = mixed_shape(plan, self.base.model, self.base.dplan0.page_tokens, self.cal.prefill_graphs)
        return self._scaled(st, self.cal.mixed(shape))

    def kv_transfer(self, plan):
        tc = self.base.kv_transfer(plan)
        return type(tc)(overhead_s=self.cal.kv(plan.tokens), latency_s=0.0, n_bytes=tc.n_bytes)

    def kv_chunks(self, prefiller, decoder, tokens):
        return self.base.kv_chunks(prefiller, decoder, tokens)


# ------------------------------------------------------------------------------------------------------------------
# Fitting and validation from a real run's files


def run_deaths(real: dict) -> list[tuple[float, int, int]]:
    """The rank deaths of a real run's ``real.json`` as ``(t_s, rank, gpu)``: its ``deaths`` are objects
    ``{"t_s", "rank", "gpu"}`` (``engine/cli/real.py``); triples are read too."""
    out = []
    for d in real.get("deaths") or ():
        t, rank, gpu = (d["t_s"], d.get("rank", -1), d["gpu"]) if isinstance(d, dict) else d
        out.append((float(t), int(rank), int(gpu)))
    return out


def run_faults(real: dict) -> list[dict]:
    """A real run's rank deaths as the simulator's fault list (each a fault of its GPU at its clock time, as
    the real run's replay has them)."""
    return [{"at_s": t, "target": f"gpu:{gpu}"} for t, _, gpu in run_deaths(real)]


def run_deployment(built, real: dict):
    """The deployment a real run's scheduler planned with: ``built``'s, with the KV capacities of the ranks'
    real caches that ``real.json`` records (``kv_capacity``); ``built``'s as it is for a run recorded without
    them. Replaying the run's times through another capacity can make other decisions."""
    cap = real.get("kv_capacity")
    if not cap:
        return built.deployment
    from rackbed.engine.core.deployment import with_kv_capacities

    return with_kv_capacities(built.deployment, prefill_tokens=int(cap["prefill_tokens"]),
                              rank_tokens=int(cap["rank_tokens"]))


def _measured(p: dict) -> float:
    """A plan's measured time (``inf``: it never completed, a rank death interrupted it)."""
    m = p.get("measured_s")
    return float("inf") if m is None else float(m)


class _Replayed:
    """Executor for :func:`_replay_plans`: each plan's recorded duration, and the plan kept. A plan that
    failed without a fault (kind ``kv:kv_lost`` / ``kv:kv_no_room``: a declined KV transfer) fails again with
    its reason; one that never completed (a rank death interrupted it) runs until the replayed fault
    interrupts it too."""

    def __init__(self, records) -> None:
        self.table: dict[tuple, list] = {}
        for p in records:           # a key can repeat (a KV shipped again after a failure)
            kind, _, failed = p["kind"].partition(":")
            m = _measured(p)
            acc = p.get("accepted")     # a speculative step's real MTP outcomes (JSON keys are strings)
            acc = None if acc is None else {int(r): int(a) for r, a in acc.items()}
            self.table.setdefault((p["worker"], kind, p["key"]), []).append((m, failed, acc))
        self.plans: dict[tuple, list] = {}
        self.breakdown_s = {"prefill": {}, "decode": {}}

    def breakdown(self) -> dict:
        return self.breakdown_s

    def duration(self, plan, now_s: float):
        from rackbed.engine.core.plans import Accepted, Failed, KvTransfer, MixedStep, PrefillBatch

        tp = type(plan)
        k = (plan.worker, "prefill", plan.batch) if tp is PrefillBatch else \
            (plan.worker, "kv", plan.request_id) if tp is KvTransfer else \
            (plan.worker, "mixed", plan.step) if tp is MixedStep else (plan.worker, "decode", plan.step)
        if not self.table.get(k):
            raise UserError(f"engine calibration: replaying the real run diverged (no measured time for {k})")
        self.plans.setdefault(k, []).append(plan)
        d, failed, acc = self.table[k].pop(0)
        if failed:
            return Failed(d, failed)
        if acc is not None:
            return Accepted(d, acc)
        return d if np.isfinite(d) else 1e9


def _replay_plans(real: dict, built) -> dict[tuple, list]:
    """The real run's plans, rebuilt by replaying it through the simulator with its measured times (the scheduler
    is the same, so the decisions are: ``tests/test_real_driver.py``): ``(worker, kind, key) -> [plan, ...]``."""
    from rackbed.engine.core.metrics import Slo
    from rackbed.engine.core.workload import generate
    from rackbed.sim.driver import simulate

    sc = built.scenario
    ex = _Replayed(real["plans"])
    simulate(run_deployment(built, real), generate(sc.workload, sc.seed), built.cost_model, seed=sc.seed,
             progress=False, faults=run_faults(real), slo=Slo(sc.slo.ttft_s, sc.slo.tpot_s),
             kv_chunks=built.cost_model.kv_chunks, decision_log=False,
             executor_factory=lambda cm, net, group_of: ex)
    return ex.plans


def skipped_plans(real: dict) -> dict:
    """The plans of a real run that measure no step and are left out of the fit: ``interrupted`` (no time: a
    rank death interrupted them), ``failed`` (``{reason: n}``: KV transfers that failed without a fault, e.g.
    ``kv_lost``, ``kv_no_room``); with the run's ``deaths`` (``[{"t_s", "rank", "gpu"}]``)."""
    interrupted, failed = 0, {}
    for p in real.get("plans", ()):
        _, _, why = p["kind"].partition(":")
        if why:
            failed[why] = failed.get(why, 0) + 1
        elif not np.isfinite(_measured(p)):
            interrupted += 1
    return {"interrupted": interrupted, "failed": failed,
            "deaths": [{"t_s": t, "rank": r, "gpu": g} for t, r, g in run_deaths(real)]}


def _plans(run_dir: Path, built, kv_bytes_per_token: int | None = None) -> list[dict]:
    """Each measured plan of a real run with its size: decode -> batch, prefill -> tokens (and ``pairs``, its
    causal attention work), kv -> tokens; in the run's completion order. Plans that measure no step are left
    out (:func:`skipped_plans`): those a rank death interrupted and KV transfers that failed."""
    real = json.loads((run_dir / "real.json").read_text())
    dec, pre, kv = {}, {}, {}
    with open(run_dir / "decisions.csv") as f:
        for row in csv.DictReader(f):
            if row["kind"] == "decode":
                dec[(row["worker"], int(row["a"]))] = int(row["b"])
            elif row["kind"] == "prefill":
                pre[(row["worker"], int(row["a"]))] = int(row["b"])
            elif row["kind"] == "kv_transfer":
                kv[(row["worker"], int(row["request_id"]))] = int(row["a"])
    replayed = _replay_plans(real, built)
    kv_bpt = real.get("kv_bytes_per_token") or kv_bytes_per_token
    out = []
    seen: dict[tuple, int] = {}
    for p in real["plans"]:
        k3 = (p["worker"], p["kind"].partition(":")[0], p["key"])
        i = seen[k3] = seen.get(k3, -1) + 1
        if ":" in p["kind"] or not np.isfinite(_measured(p)):
            continue
        k = (p["worker"], p["key"])
        if p["kind"] == "decode" and k in dec:
            out.append({**p, "x": dec[k]})
        elif p["kind"] == "prefill" and k in pre:
            items = replayed[k3][i].items
            out.append({**p, "x": pre[k], "pairs": attn_pairs(items), "n_seqs": len(items)})
        elif p["kind"] == "kv" and k in kv:
            out.append({**p, "x": kv[k] / kv_bpt if kv_bpt else kv[k]})
        elif p["kind"] == "mixed" and replayed.get(k3):
            shape = mixed_shape(replayed[k3][i], built.model, built.decode_plan.page_tokens, prefill_graphs(real))
            out.append({**p, "x": shape["seqs"], "shape": shape, "prefill_graphs": prefill_graphs(real)})
    return out


def _split(plans: list[dict], every: int) -> tuple[list[dict], list[dict]]:
    fit, hold = [], []
    counts: dict[str, int] = {}
    for p in plans:
        i = counts.get(p["kind"], 0)
        counts[p["kind"]] = i + 1
        (hold if every and i % every == every - 1 else fit).append(p)
    return fit, hold


def _line(xs, ys) -> tuple[float, float]:
    """Robust least-squares line ``a + b x``: fit, drop points beyond 3 MADs of the residuals (e.g. a decode step
    that captured a new CUDA graph), refit; a negative slope becomes the median (no trend)."""
    x, y = np.asarray(xs, float), np.asarray(ys, float)
    if len(x) < 3 or len(set(x.tolist())) < 2:
        return (float(np.median(y)) if len(y) else 0.0, 0.0)
    for _ in range(2):
        b, a = np.polyfit(x, y, 1)
        r = y - (a + b * x)
        mad = float(np.median(np.abs(r - np.median(r)))) or 1e-12
        keep = np.abs(r - np.median(r)) <= 3 * 1.4826 * mad
        if keep.all() or keep.sum() < 3 or len(set(x[keep].tolist())) < 2:
            break           # (dropping would leave one x: no slope to fit)
        x, y = x[keep], y[keep]
    b, a = np.polyfit(x, y, 1)
    if b < 0:
        return float(np.median(y)), 0.0
    if a < 0:
        return 0.0, float(np.dot(x, y) / np.dot(x, x))
    return float(a), float(b)


def _lstsq_nonneg(cols, ys) -> tuple[float, ...]:
    """Robust non-negative least squares ``y ~ sum(c_i * col_i)`` (the first column is the intercept's ones): fit,
    drop points beyond 3 MADs of the residuals (a warm-up batch), refit. Falls back to :func:`_line` in the first
    real column when there are too few points to determine every coefficient."""
    from scipy.optimize import nnls

    X, y = np.column_stack([np.asarray(c, float) for c in cols]), np.asarray(ys, float)
    if len(y) < X.shape[1] + 2 or np.linalg.matrix_rank(X) < X.shape[1]:
        a, b = _line(X[:, 1], y)
        return (a, b) + (0.0,) * (X.shape[1] - 2)
    scale = np.abs(X).max(axis=0)
    scale[scale == 0] = 1.0
    keep = np.ones(len(y), bool)
    for _ in range(3):
        c = nnls(X[keep] / scale, y[keep])[0] / scale
        r = y - X @ c
        rk = r[keep]
        mad = float(np.median(np.abs(rk - np.median(rk)))) or 1e-12
        new = np.abs(r - np.median(rk)) <= 3 * 1.4826 * mad
        if (new == keep).all() or new.sum() < X.shape[1] + 2:
            break
        keep = new
    return tuple(float(v) for v in nnls(X[keep] / scale, y[keep])[0] / scale)


def _nonneg_through_origin(cols, ys) -> tuple[float, ...]:
    """Robust non-negative least squares ``y ~ sum(c_i * col_i)`` with no intercept (the MTP terms of a mixed
    step: what the steps with drafts take beyond the fitted terms of every step); points beyond 3 MADs of the
    residuals are dropped once."""
    from scipy.optimize import nnls

    X, y = np.column_stack([np.asarray(c, float) for c in cols]), np.asarray(ys, float)
    scale = np.abs(X).max(axis=0)
    scale[scale == 0] = 1.0
    c = nnls(X / scale, y)[0] / scale
    r = y - X @ c
    mad = float(np.median(np.abs(r - np.median(r)))) or 1e-12
    keep = np.abs(r - np.median(r)) <= 3 * 1.4826 * mad
    if keep.sum() >= X.shape[1] + 2:
        c = nnls(X[keep] / scale, y[keep])[0] / scale
    return tuple(float(v) for v in c)


def fit_engine(run_dir: str | Path, *, gpu: str, model: str, holdout_every: int = 3,
               kv_bytes_per_token: int | None = None, built=None,
               more_runs: tuple = ()) -> tuple[EngineCalibration, list[dict]]:
    """Fit the engine curves from a real run folder (real.json + decisions.csv); return them and the held-out
    plans. Every time is the driver's dispatch-to-completion time (``measured_s``: what the simulated clock
    advances by). ``built``: the run's scenario, built without engine calibration (default: built from
    ``real.json``), to replay the run for each prefill batch's sequences. ``more_runs``: further run folders
    (of the same model and GPU: the caller checks) whose plans are fitted together with ``run_dir``'s, each
    replayed through its own scenario."""
    run_dir = Path(run_dir)
    real = json.loads((run_dir / "real.json").read_text())
    if built is None:
        from rackbed.sim.scenario import build, load_scenario

        built = build(load_scenario(real["scenario"]), engine_calibration=False)
    plans = _plans(run_dir, built, kv_bytes_per_token)
    for more in more_runs:
        from rackbed.sim.scenario import build, load_scenario

        more = Path(more)
        sc_more = load_scenario(json.loads((more / "real.json").read_text())["scenario"])
        plans += _plans(more, build(sc_more, engine_calibration=False), kv_bytes_per_token)
    if not plans:
        raise UserError(f"{run_dir}: no measured plans to fit (need real.json and decisions.csv)")
    fit, hold = _split(plans, holdout_every)
    if built.deployment.aggregated:
        return _fit_mixed(str(run_dir), real, fit, hold, gpu=gpu, model=model, holdout_every=holdout_every,
                          spec=built.model)
    dpts = [(p["x"], p["measured_s"]) for p in fit if p["kind"] == "decode"]
    if not dpts:
        raise UserError(f"{run_dir}: no decode steps among the fitted plans")
    da, db = _line(*zip(*dpts))
    dec = tuple((float(b), da + db * b) for b in sorted({int(x) for x, _ in dpts}))
    pre = [p for p in fit if p["kind"] == "prefill"]
    if pre:
        pa, pb, pc = _lstsq_nonneg([[1.0] * len(pre), [p["x"] for p in pre], [p["pairs"] for p in pre]],
                                   [p["measured_s"] for p in pre])
    else:
        pa = pb = pc = 0.0
    kvs = [(p["x"], p["measured_s"]) for p in fit if p["kind"] == "kv"]
    cal = EngineCalibration(gpu=gpu, model=model, source=str(run_dir), date=real.get("versions", {}).get("date", ""),
                            holdout_every=holdout_every, decode_step_s=dec, prefill_s=(pa, pb), prefill_attn_s=pc,
                            kv_transfer_s=_line(*zip(*kvs)) if kvs else (0.0, 0.0),
                            n_plans={"fit": len(fit), "held_out": len(hold)})
    return cal, hold


def fit_engine_runs(run_dirs, *, holdout_every: int = 3) -> tuple[EngineCalibration, list[dict]]:
    """One engine calibration from several real runs of the same GPU, model and deployment kind (e.g. an aggregated
    worker with and without chunked prefill): each run's plans are split into fitted and held-out ones as in
    :func:`fit_engine`, and the fitted plans of all runs make one fit. Returns it and the held-out plans."""
    from rackbed.sim.scenario import build, load_scenario

    fit, hold, keys, reals, spec = [], [], set(), [], None
    for d in map(Path, run_dirs):
        if not (d / "real.json").is_file() or not (d / "decisions.csv").is_file():
            raise UserError(f"{d}: not a `rackbed real` output folder (needs real.json and decisions.csv)")
        real = json.loads((d / "real.json").read_text())
        b = build(load_scenario(real["scenario"]), engine_calibration=False)
        gpu = b.topology.gpu_spec((b.deployment.decoders or b.deployment.aggregated)[0].gpus[0]).name
        mode = "aggregated" if b.deployment.aggregated else "disaggregated"
        keys.add((gpu, b.model.name, mode))
        f, h = _split(_plans(d, b, b.deployment.kv_bytes_per_token), holdout_every)
        fit += f
        hold += h
        reals.append(real)
        spec = b.model
    if len(keys) != 1:
        raise UserError(f"engine calibration: the runs differ in (GPU, model, deployment kind): {sorted(keys)}")
    (gpu, model, mode), = keys
    if mode != "aggregated":
        raise UserError("engine calibration from several runs: aggregated runs only (fit a disaggregated run "
                        "with rackbed validate --engine)")
    return _fit_mixed(", ".join(str(d) for d in run_dirs), reals[0], fit, hold, gpu=gpu, model=model,
                      holdout_every=holdout_every, spec=spec)


def _fit_mixed(run_dir, real, fit, hold, *, gpu, model, holdout_every, spec) -> tuple[EngineCalibration, list[dict]]:
    """An aggregated run: every step is a mixed step; ``mixed_s`` is the robust non-negative fit of its time in
    the decode batch, the decode context, the prefill tokens and the prefill's causal pairs. The decode and
    prefill curves are that fit's pure-decode (no prefill) and pure-prefill (no decode) cuts."""
    pts = [p for p in fit if p["kind"] == "mixed"]
    graphs = all(p.get("prefill_graphs", True) for p in pts)
    if any(p.get("prefill_graphs", True) != graphs for p in pts):
        raise UserError(f"{run_dir}: some runs replayed prefill as CUDA graphs and some did not; fit them apart")
    if len(pts) < 2 * (len(MIXED_TERMS) - len(MTP_TERMS)):
        raise UserError(f"{run_dir}: {len(pts)} measured mixed steps to fit; an aggregated run needs at least "
                        f"{2 * (len(MIXED_TERMS) - len(MTP_TERMS))}")
    # the terms of every step from the steps without drafts when there are enough of them (MTP runs beside plain
    # ones: the plain runs' fit stays what it is), then the MTP terms from what those leave in the steps with drafts
    coef = dict.fromkeys(MIXED_TERMS, 0.0)
    base = [k for k in MIXED_TERMS if k not in MTP_TERMS]
    plain = [p for p in pts if not p["shape"]["drafts"]]
    drafted = [p for p in pts if p["shape"]["drafts"]]
    first = plain if len(plain) >= 2 * len(base) else pts
    terms = [k for k in (base if drafted and first is plain else MIXED_TERMS)
             if k == "step" or any(p["shape"][k] for p in first)]  # a term no step has is priced 0, not fitted
    coef.update(zip(terms, _lstsq_nonneg([[p["shape"][k] for p in first] for k in terms],
                                         [p["measured_s"] for p in first])))
    if drafted and first is plain:
        rest = [p["measured_s"] - sum(coef[k] * p["shape"][k] for k in base) for p in drafted]
        coef.update(zip(MTP_TERMS, _nonneg_through_origin([[p["shape"][k] for p in drafted] for k in MTP_TERMS],
                                                          rest)))
    # the pure-decode and pure-prefill cuts, for readers of the file (the simulator prices mixed steps whole)
    dec = [p["shape"] for p in pts if p["shape"]["prefill_tokens"] == 0 and p["shape"]["seqs"] > 0]
    ctx = statistics.mean(s["context"] / s["seqs"] for s in dec) if dec else 0.0
    batches = sorted({int(s["seqs"]) for s in dec}) or [1]
    cut = EngineCalibration(gpu=gpu, model=model, decode_step_s=((1.0, 0.0),), prefill_s=(0.0, 0.0), prefill_graphs=graphs,
                            kv_transfer_s=(0.0, 0.0), mode="aggregated", mixed_s=coef)
    decode = tuple((float(b), cut.mixed({"step": 1.0, "touched_experts": touched_experts(b, spec.n_experts, spec.top_k),
                                         "seqs": b, "context": ctx * b, "prefill_tokens": 0.0, "pairs": 0.0,
                                         "chunks": 0.0, "drafts": 0.0, "draft_tokens": 0.0}))
                   for b in batches)
    cal = EngineCalibration(gpu=gpu, model=model, mode="aggregated", source=str(run_dir), prefill_graphs=graphs,
                            date=real.get("versions", {}).get("date", ""), holdout_every=holdout_every,
                            decode_step_s=decode, prefill_s=(coef["step"] + coef["chunks"], coef["prefill_tokens"]),
                            prefill_attn_s=coef["pairs"], kv_transfer_s=(0.0, 0.0), mixed_s=coef,
                            n_plans={"fit": len(fit), "held_out": len(hold)})
    return cal, hold



def predict_plan(cal: EngineCalibration, p: dict) -> float:
    """The calibration's time for a measured plan row of :func:`_plans`."""
    if p["kind"] == "mixed":
        return cal.mixed(p["shape"])
    return cal.decode(p["x"]) if p["kind"] == "decode" else cal.prefill(p["x"], p["pairs"]) \
        if p["kind"] == "prefill" else cal.kv(p["x"])


def _rel(pred, measured) -> float | None:
    """``(pred - measured) / measured``, or None when either is missing or the measurement is not positive."""
    if pred is None or measured is None or not measured > 0 or not math.isfinite(pred):
        return None
    return (pred - measured) / measured


def _err_stats(rows: list[dict]) -> dict:
    e = [abs(r["rel_error"]) for r in rows]
    return {"n": len(e), "median_abs": statistics.median(e) if e else None, "max_abs": max(e) if e else None}


def validate_engine_run(run_dir: str | Path, *, holdout_every: int = 3, write_calibration: Path | None = None) -> dict:
    """Engine-level validation of a real run: fit on the plans not held out, then (1) per-plan error on the
    held-out plans, (2) re-simulate the run's scenario with the engine-calibrated cost model and compare the
    serving metrics (TTFT/TPOT p50/p90, decode step and prefill medians) with the real run's. A run that had
    rank deaths is read too: the plans they interrupted and the KV transfers that failed are left out of the
    fit and counted under ``skipped`` (:func:`skipped_plans`), and the re-simulations meet the same deaths
    (faults of their GPUs at the same clock times); they plan with the KV capacities the run's scheduler had
    (:func:`run_deployment`). A metric without a value on either side (e.g. no request
    finished) has a null error."""
    from rackbed.engine.core.workload import generate
    from rackbed.sim.driver import simulate
    from rackbed.sim.scenario import build, load_scenario

    run_dir = Path(run_dir)
    real = json.loads((run_dir / "real.json").read_text())
    sc = load_scenario(real["scenario"])
    b = build(sc, engine_calibration=False)
    gpu = b.topology.gpu_spec((b.deployment.decoders or b.deployment.aggregated)[0].gpus[0]).name
    cal, hold = fit_engine(run_dir, gpu=gpu, model=b.model.name, holdout_every=holdout_every,
                           kv_bytes_per_token=b.deployment.kv_bytes_per_token, built=b)
    rows = []
    for p in hold:
        pred = predict_plan(cal, p)
        rows.append({"plan": f"{p['worker']}/{p['kind']}/{p['key']}", "kind": p["kind"], "x": p["x"],
                     "measured_s": p["measured_s"], "predicted_s": pred,
                     "rel_error": _rel(pred, p["measured_s"])})
    per_kind = {k: _err_stats([r for r in rows if r["kind"] == k and r["rel_error"] is not None])
                for k in ("decode", "prefill", "kv", "mixed")}
    # (2) serving metrics: the scenario re-simulated with the engine calibration vs the real run
    from rackbed.engine.core.metrics import Slo

    cm = EngineCalibratedCostModel(b.cost_model, cal)
    reqs = generate(sc.workload, sc.seed)
    faults, dep = run_faults(real), run_deployment(b, real)
    res = simulate(dep, reqs, cm, seed=sc.seed, progress=False, slo=Slo(sc.slo.ttft_s, sc.slo.tpot_s),
                   kv_chunks=b.cost_model.kv_chunks, decision_log=False, faults=faults)
    rm = real["metrics"]["latency_s"]
    sm = res.metrics["latency_s"]
    serving = []
    for key in ("ttft", "tpot", "itl", "e2e"):
        for q in ("p50", "p90"):
            m, s = rm[key][q], sm[key][q]
            serving.append({"metric": f"{key} {q}", "real_s": m, "sim_s": s, "rel_error": _rel(s, m)})
    uncal = simulate(dep, reqs, b.cost_model, seed=sc.seed, progress=False,
                     slo=Slo(sc.slo.ttft_s, sc.slo.tpot_s), kv_chunks=b.cost_model.kv_chunks,
                     decision_log=False, faults=faults).metrics["latency_s"]
    for r in serving:
        key, q = r["metric"].split()
        r["uncalibrated_sim_s"] = uncal[key][q]
    if write_calibration is not None:
        from rackbed.topology.outputs import write_text

        write_calibration.parent.mkdir(parents=True, exist_ok=True)
        write_text(write_calibration, yaml.safe_dump(json.loads(cal.model_dump_json()), sort_keys=False))
    return {"run": str(run_dir), "gpu": gpu, "model": b.model.name, "calibration": json.loads(cal.model_dump_json()),
            "held_out_plans": rows, "per_plan": per_kind, "serving": serving, "skipped": skipped_plans(real),
            "targets": {"step_time": 0.05, "ttft_tpot_p50": 0.05, "ttft_tpot_p90": 0.10}}
