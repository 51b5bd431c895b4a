"""Capacity planning on a GPU budget, at any rate: ``rackbed search --gpus N`` (no ``--rate``).

The question users ask is "I have N GPUs of this kind: what is the most tokens/s per GPU I get under my SLOs, at
how many tokens/s per user, aggregated or disaggregated, and how do I deploy it?". The rate is an *answer*, not an
input: every candidate deployment that fits the budget is evaluated at the load it sustains.

1. **Analytic stage** (no simulation). The topology is the preset resized to N GPUs (``topology.presets.resized``).

   * *Disaggregated*: the prefill and decode options of :mod:`sim.search` (same cost model, memory budget and
     TTFT-floor / TPOT-at-cap pruning). For a pair of options and every decoder count ``D`` (``D x EP`` GPUs) the
     decoders carry ``rate_d = D x (EP / TP) x b_max / (output x TPOT(b_max))`` requests/s (Little's law at the
     batch cap of each of a decoder's ``EP / TP`` DP ranks, ``TP`` its attention TP) and ``P`` prefillers
     ``rate_p = P x capacity / (prompt x headroom)`` — the prefill headroom keeps the prefillers' utilisation
     at ``1 / headroom`` so that queueing leaves the TTFT SLO met. The deployment sustains
     ``rate = min(rate_p, rate_d)`` with the fewest prefillers that carry it (at most the GPUs left); its decode
     batch per rank is the fixed point of Little's law at that rate and its TPOT the decode step's at that batch
     plus the KV transfer per token after the first (as :func:`sim.search.candidates`).
   * *Aggregated*: workers of ``tp x dp`` GPUs (DP-attention ranks with ``ep = dp``, or one TP group with
     ``ep = tp``) tiling the budget, for each batch cap, token budget, chunk size and MTP draft length; a worker's
     steady state is :func:`sim.costs.mixed.aggregated_operating_point` (its requests/s and TPOT at saturation);
     the deployment is sized to ``workers x requests/s / headroom``; the TTFT estimate is the steps a prompt
     needs (``ceil(prompt / min(chunk, prefill tokens per rank per step))``) times the step time.

   Both give an estimated tokens/s per GPU (output tokens/s over the deployment's GPUs) and tokens/s per user
   (1 / TPOT); candidates whose estimate misses an SLO are pruned with the reason.

2. **Simulation**: per kind, up to ``per_front`` points of the analytic Pareto front (spread along it, the best
   tokens/s per GPU first) are simulated at their estimated rate; a point that misses the SLOs is simulated again
   at ``backoff`` times the rate (up to ``retries`` times), one that holds once more at ``1 / backoff`` times
   (the highest rate that held is the point's). At most ``max_simulations`` simulations in all.
   **The arrival window** (:func:`arrival_window`) is at least ``workload.duration_s`` and at least
   :data:`LIFE_WINDOWS` (4) *lives* of a request at the SLOs, ``L = TTFT SLO + (output - 1) x TPOT SLO`` — the
   longest a request that meets the SLOs stays in the system. A deployment starts empty: its decode batch fills
   for one life (Little's law: a batch of ``rate x L`` sequences builds up at ``rate`` per second, so the fill
   time ``batch / rate`` is the life itself) and, after the window, drains for one more. A window of 30 s with
   1,000-token outputs at 80 ms (``L`` ~ 82 s) never leaves the ramp, so an overloaded rate looks fine; with
   ``W >= 4 L`` the requests arriving in the window's second and third quarters live entirely in the steady
   state (they arrive after one life and finish before the drain).
   **The steady-state check** (:func:`steady`): a point holds only if, besides meeting the SLOs over the whole
   run, every request of those two quarters finished and their TTFT and TPOT at the SLO's percentile, continued
   at the median's trend from the second quarter to the third (no better than flat) until the end of a window
   :data:`HOLD_WINDOWS` (4) times as long (12 quarters on), stay within the SLOs — a queue that still grows,
   however slowly, would break the SLOs in a 4x longer run. The projection multiplies the rise between two
   quarters by 12, so a rise that is noise (a batch that fluctuates by a few sequences) can fail it too: a point
   that meets the SLOs but fails the projection is therefore **simulated again for** :data:`HOLD_WINDOWS`
   **(4) times the window**, and holds if that run meets the SLOs (it counts as a simulation). A point that
   misses the SLOs, in the window or in the longer run, is retried at ``backoff`` times the rate, or lower where
   its queue grew — a queue fed at ``r`` and served at ``mu`` makes each request wait ``r / mu - 1`` seconds
   longer per second of arrivals, so the retry takes ``backoff x r / (1 + that growth)``. Every simulation's
   ``steady``, ``window_s`` and ``holds`` say what was found.
   Tokens/s per GPU of a simulation is the throughput **at the rate it sustains**: the output tokens of the
   requests that arrived in the arrival window over that window and the deployment's GPUs (:func:`sustained`).
   The simulation runs on past the window until the last request finishes (the drain); counting the drain in the
   denominator, as ``rackbed run``'s ``output_tokens_per_s_per_gpu`` does, would read lower (about 0.9x at 68 s
   of 500-token outputs). A point that holds completed every request, so this is the long-run throughput of that
   arrival rate. The drained figure stays in the record (``tokens_per_s_per_gpu_with_drain``).
3. **Fronts**: per kind, the Pareto front of tokens/s per GPU vs tokens/s per user of the simulated points that
   hold (:func:`holds`).
4. **The budget used**: a deployment of ``n`` GPUs runs as ``replicas = N // n`` independent copies on the budget
   (each with its own router; copies share no GPU, so each carries what its simulation did): ``replicas x n`` GPUs
   used, ``replicas x`` its output tokens/s in total, and tokens/s per *budget* GPU = that total / N besides the
   tokens/s per used GPU. A deployment scaled out the other way — more decoder groups with prefillers to match —
   is a candidate of its own (the analytic stage enumerates every decoder count), and the analytic stage also
   sends each kind's best estimate of tokens/s per budget GPU to simulation. The **best** is, among the confirmed
   points within ``fill_tolerance`` (:data:`FILL_TOLERANCE`, 5 %) of the most tokens/s per used GPU, the one with the most
   tokens/s per budget GPU — a configuration that uses the budget is preferred at a near-equal efficiency; the
   **best on the whole budget** (the most tokens/s per budget GPU whatever its efficiency) is reported too.

**Mixed pools** (a joined topology of several GPU models, ``A+B``): the disaggregated candidates are every
pool — prefill on one model and decode on another, either way round, and each model alone — each role's
options priced on its own model (:func:`disaggregated_candidates` with ``prices``), bounded by each model's
GPUs; a candidate costs the sum of its GPUs' prices per hour (``--gpu-hour-usd MODEL=USD``, required:
:func:`kind_prices`), and the analytic fronts, the fronts of the simulated points and the best rank output
tokens/s per $ per hour (:attr:`BudgetCandidate.value`, :func:`priced`) in place of tokens/s per GPU.
Aggregated workers are not searched there.

:func:`max_rate` answers the fixed-deployment question (``rackbed search --max-rate SCENARIO``): the highest rate a
given scenario's deployment sustains under the SLOs (doubling, then bisection, every step simulated, with the
window rule and the steady-state check of step 2).
"""

from __future__ import annotations

import functools
import itertools
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rackbed.sim import search as se
from rackbed.sim.pareto import pareto_indices
from rackbed.sim.search_results import OBJECTIVES, front_of, meets_slo
from rackbed.topology.errors import UserError, one_line

KINDS = ("disaggregated", "aggregated")
RATE_KEY = "workload.arrival.rate_per_s"
#: a trace's rate is the workload's own field (``rate_per_s``: requests/s of the replay)
TRACE_RATE_KEY = "workload.rate_per_s"
#: requests of a trace drawn for the analytic stage (lengths and prefix-cache hit rates): a simulation at rate r
#: sees r x duration of them
ESTIMATE_REQUESTS = 6000

#: aggregated worker shapes tried: (tp, dp); ep = tp * dp (experts over every GPU of the worker)
AGG_SHAPES = ((1, 4), (1, 8), (1, 16), (1, 32), (2, 1), (4, 1), (8, 1))
#: the best may give up this fraction of the most tokens/s per used GPU for more tokens/s on the whole budget
FILL_TOLERANCE = 0.05
#: aggregated (max_batch_tokens, chunk_tokens) pairs tried
AGG_BUDGETS = ((8192, 2048), (16384, 4096), (16384, 16384))
#: the arrival window is at least this many lives of a request at the SLOs (module docstring, step 2)
LIFE_WINDOWS = 4
#: a point's latency trend must keep it within the SLOs over a run this many times as long as its window
HOLD_WINDOWS = 4


@dataclass
class BudgetCandidate:
    """One deployment on the budget with its analytic figures; ``overrides`` are dotted scenario overrides
    (the rate is set per simulation)."""

    kind: str
    label: str
    overrides: dict
    n_gpus: int
    rate_per_s: float = math.nan
    est_tokens_per_s_per_gpu: float = math.nan
    est_tokens_per_s_per_user: float = math.nan
    est_ttft_s: float = math.nan
    est_tpot_s: float = math.nan
    pruned: str | None = None
    budget: int = 0                     # N, the GPU budget (for the replicas that fill it)
    est_hit_rate: float | None = None   # prefix-cache hit rate the estimate assumes (None: no cache)
    # mixed pools (a topology of several GPU models): GPUs used per model, $ per hour of those GPUs, and
    # the GPUs of each model the topology has; None on a topology of one GPU model
    gpus_by_kind: dict[str, int] | None = None
    usd_per_hour: float | None = None
    room: dict[str, int] | None = None
    usd_budget: float | None = None     # $ per hour of every GPU of the topology (the whole budget)

    @property
    def replicas(self) -> int:
        """Copies of this deployment that fit the budget (at least one; on a mixed topology, also the GPUs of
        each model)."""
        if not self.n_gpus:
            return 1
        n = self.budget // self.n_gpus
        if self.gpus_by_kind and self.room:
            n = min([n, *(self.room[k] // u for k, u in self.gpus_by_kind.items() if u)])
        return max(1, n)

    @property
    def est_tokens_per_s_per_budget_gpu(self) -> float:
        return self.est_tokens_per_s_per_gpu * self.replicas * self.n_gpus / self.budget if self.budget else math.nan

    @property
    def value(self) -> float:
        """What the search maximises against tokens/s per user: estimated tokens/s per GPU, or on a mixed
        topology tokens/s per $ per hour (GPUs of different models cost different prices)."""
        if self.usd_per_hour:
            return self.est_tokens_per_s_per_gpu * self.n_gpus / self.usd_per_hour
        return self.est_tokens_per_s_per_gpu

    @property
    def budget_value(self) -> float:
        """:attr:`value` with the copies that fill the budget: tokens/s per budget GPU, or on a mixed topology
        the copies' tokens/s per $ per hour of every GPU of the topology."""
        if self.usd_per_hour and self.usd_budget:
            return self.est_tokens_per_s_per_gpu * self.n_gpus * self.replicas / self.usd_budget
        return self.est_tokens_per_s_per_budget_gpu


@dataclass
class BudgetResult:
    spec: se.SearchSpec
    gpus: int
    topology: str
    load: se.Load
    candidates: list[BudgetCandidate]
    records: list[dict]                 # every simulation (each with "candidate", "kind", "rate_per_s", "est")
    confirmed: list[dict]               # per simulated candidate: its record at the highest rate meeting the SLOs
    fronts: dict[str, list[dict]]       # kind -> front of the confirmed records, tokens/s per GPU descending
    best: dict | None                   # module docstring, step 4 (its "use" says how it fills the budget)
    scenarios: dict[str, dict] = field(default_factory=dict)  # record key -> scenario dict
    notes: list[str] = field(default_factory=list)
    wall_s: float = 0.0
    best_total: dict | None = None      # the most tokens/s per budget GPU (replicas included)
    stack: str = "auto"                 # the serving stack asked for (scenario field stack)
    calibration: str = ""               # the one line that says what priced the candidates
    prices: dict[str, float] | None = None  # mixed pools: $ per GPU-hour of each GPU model (None: one model)
    room: dict[str, int] | None = None      # mixed pools: GPUs of each model in the topology

    @property
    def objective(self) -> str:
        """The record figure the fronts and the best maximise (``sim.search_results.OBJECTIVES``): tokens/s
        per GPU, or per $ per hour on a mixed topology."""
        return "usd" if self.prices else "gpu"

    def analytic_front(self, kind: str) -> list[BudgetCandidate]:
        seen: dict[tuple, BudgetCandidate] = {}
        for c in self.candidates:  # alike estimates (a knob that does not bind): the one using the most GPUs
            if c.kind == kind and c.pruned is None:
                k = (round(c.value, 6), round(c.est_tokens_per_s_per_user, 6))
                if k not in seen or c.n_gpus > seen[k].n_gpus:
                    seen[k] = c
        alive = list(seen.values())
        idx = pareto_indices([(c.value, c.est_tokens_per_s_per_user) for c in alive])
        return sorted((alive[i] for i in idx), key=lambda c: -c.value)

    def budget_pick(self, kind: str) -> BudgetCandidate | None:
        """The surviving candidate of ``kind`` with the most estimated tokens/s per budget GPU (replicas
        included); ties: the most tokens/s per user."""
        alive = [c for c in self.candidates if c.kind == kind and c.pruned is None]
        return max(alive, key=lambda c: (round(c.budget_value, 6), c.est_tokens_per_s_per_user), default=None)


def request_life_s(spec: se.SearchSpec, output_tokens: float) -> float:
    """The longest a request of ``output_tokens`` that meets the SLOs stays in the system: TTFT SLO + (output - 1)
    x TPOT SLO."""
    return spec.slo.ttft_s + max(0.0, output_tokens - 1.0) * spec.slo.tpot_s


def arrival_window(spec: se.SearchSpec, load: se.Load) -> float:
    """Seconds of arrivals per simulation (module docstring, step 2): ``workload.duration_s``, or
    :data:`LIFE_WINDOWS` lives of a request at the SLOs (:func:`request_life_s` at the mean output) when longer."""
    life = LIFE_WINDOWS * request_life_s(spec, load.output_mean)
    return max(getattr(spec.workload, "duration_s", None) or 0.0, life)


def steady(rec: Mapping, ttft_s: float | None, tpot_s: float | None, percentile: str = "p90", *,
           window_s: float | None = None, output_tokens: float = 1.0) -> dict:
    """Whether a simulation reached a steady state that holds (module docstring, step 2): ``{"ok", "reason",
    "projected", "wait_growth"}`` from its ``quarters`` (:func:`sim.sweep.arrival_quarters`). ``projected``: the
    TTFT / TPOT at ``percentile`` of the third quarter's arrivals plus ``4 x HOLD_WINDOWS - 4`` times the rise of the
    median from the second quarter's (no rise: the third quarter's own). A growing queue delays every request alike,
    so the median measures its growth; the tail of a heavy-tailed workload (a trace's long prompts) swings from
    quarter to quarter by more than a queue that holds would move it. Not ok when a request of those quarters did not finish
    or a projection passes its SLO; ok with reason "no quarters" for a record without them (a run without a
    window). ``wait_growth`` (with ``window_s``): how fast a request's wait grows with its arrival time between the
    two quarters, ``max(rise of TTFT, rise of TPOT x (output_tokens - 1)) / (window_s / 4)`` — a queue fed at rate
    ``r`` and served at ``mu`` grows by ``r / mu - 1`` seconds a second, so ``r / (1 + wait_growth)`` is about what
    the deployment serves."""
    qs = rec.get("quarters")
    if rec.get("status") != "ok":
        return {"ok": False, "reason": "not simulated", "projected": None, "wait_growth": None}
    if not qs:
        return {"ok": True, "reason": "no quarters", "projected": None, "wait_growth": None}
    q2, q3 = qs[1], qs[2]
    if q2["done"] < q2["n"] or q3["done"] < q3["n"]:
        return {"ok": False, "reason": f"{q2['n'] - q2['done'] + q3['n'] - q3['done']} requests of the steady "
                                       "quarters unfinished", "projected": None, "wait_growth": None}
    ahead = 4 * HOLD_WINDOWS - 4  # quarters from the third to the last undrained one of a HOLD_WINDOWS x run
    proj, why, rise = {}, [], 0.0
    for name, bound in (("ttft", ttft_s), ("tpot", tpot_s)):
        a, b = q2.get(f"{name}_p50_s"), q3.get(f"{name}_p50_s")
        tail = q3.get(f"{name}_{percentile}_s")
        if a is None or b is None or tail is None:
            continue
        proj[name] = tail + ahead * max(0.0, b - a)
        rise = max(rise, max(0.0, b - a) * (max(1.0, output_tokens - 1.0) if name == "tpot" else 1.0))
        if bound is not None and proj[name] > bound:
            why.append(f"{name.upper()} p50 {a * 1e3:.0f} -> {b * 1e3:.0f} ms from the 2nd to the 3rd quarter, "
                       f"{percentile} {proj[name] * 1e3:.0f} ms over a {HOLD_WINDOWS}x longer run > SLO "
                       f"{bound * 1e3:.0f} ms")
    growth = rise / (window_s / 4) if window_s else None
    return {"ok": not why, "reason": "; ".join(why) or "steady", "projected": proj, "wait_growth": growth}


def holds(rec: Mapping, slo) -> bool:
    """A simulation that meets the SLOs and whose steady state holds (:func:`steady`), or the record's own
    ``holds`` (the search's decision, module docstring step 2)."""
    if "holds" in rec:
        return bool(rec["holds"])
    return meets_slo(rec, slo.ttft_s, slo.tpot_s, slo.percentile) and (rec.get("steady") or {}).get("ok", True)


def sustained(rec: dict, gpus: int, window_s: float | None) -> dict:
    """``rec`` with its summary's ``tokens_per_s_per_gpu`` the throughput at the sustained rate (module docstring,
    step 2): the output tokens of the requests that arrived within ``window_s`` over ``window_s`` and ``gpus``;
    the simulator's figure over the whole run (the drain included) kept as ``tokens_per_s_per_gpu_with_drain``.
    Unchanged without a window or an output rate."""
    s = rec.get("summary")
    if not s or not window_s or s.get("output_tokens_per_s") is None or not s.get("duration_s"):
        return rec
    tokens = s["output_tokens_per_s"] * s["duration_s"]  # every completed request arrived within the window
    return {**rec, "summary": {**s, "tokens_per_s_per_gpu": tokens / (window_s * gpus),
                               "tokens_per_s_per_gpu_with_drain": s.get("tokens_per_s_per_gpu")}}


def priced(rec: dict, gpus: int, usd_per_hour: float, gpus_by_kind: Mapping[str, int]) -> dict:
    """``rec`` with its deployment's cost (mixed pools): ``usd_per_hour`` and ``gpus_by_kind`` on the record,
    and in its summary ``usd_per_hour``, ``tokens_per_s_per_usd_hour`` (output tokens/s at the sustained rate
    per $ per hour) and ``usd_per_mtok`` ($ per million output tokens, GPU-hours only)."""
    rec = {**rec, "usd_per_hour": usd_per_hour, "gpus_by_kind": dict(gpus_by_kind)}
    s = rec.get("summary") or {}
    per_gpu = s.get("tokens_per_s_per_gpu")
    if per_gpu is None:
        return rec
    tps = per_gpu * gpus
    rec["summary"] = {**s, "usd_per_hour": usd_per_hour, "tokens_per_s_per_usd_hour": tps / usd_per_hour,
                      "usd_per_mtok": se.cost_per_mtok_usd(usd_per_hour / gpus, per_gpu)}
    return rec


def budget_use(rec: Mapping, gpus: int, replicas: int | None = None) -> dict:
    """How a simulated deployment (``rec``: its record) fills a budget of ``gpus`` GPUs with whole copies
    (module docstring, step 4): replicas (default ``gpus // its GPUs``), GPUs used, total output tokens/s,
    tokens/s per used and per budget GPU."""
    n = int(rec["gpus"])
    per_gpu = (rec.get("summary") or {}).get("tokens_per_s_per_gpu") or 0.0
    reps = replicas or max(1, gpus // n)
    total = per_gpu * n * reps
    out = {"replicas": reps, "gpus_used": reps * n, "gpus": gpus, "tokens_per_s": total,
           "tokens_per_s_per_used_gpu": per_gpu, "tokens_per_s_per_budget_gpu": total / gpus}
    if rec.get("usd_per_hour"):  # mixed pools (:func:`priced`): what the copies cost
        out["usd_per_hour"] = reps * rec["usd_per_hour"]
    return out


def pick_best(confirmed: Sequence[dict], gpus: int, tolerance: float, objective: str = "gpu"
              ) -> tuple[dict | None, dict | None]:
    """``(best, best on the whole budget)`` of the confirmed records (module docstring, step 4). ``objective``
    ``usd`` (mixed pools): tokens/s per $ per hour in place of tokens/s per used GPU, and the copies each
    record's ``use`` says fit (the GPUs of each model bound them)."""
    if not confirmed:
        return None, None
    key = OBJECTIVES[objective]
    top = max(r["summary"][key] for r in confirmed)
    near = [r for r in confirmed if r["summary"][key] >= (1.0 - tolerance) * top]

    def by_budget(r):
        if objective == "usd":  # equal totals (to rounding: the same arrivals) go to the cheaper deployment
            return (round(r["use"]["tokens_per_s_per_budget_gpu"], 6), r["summary"][key])
        return (budget_use(r, gpus)["tokens_per_s_per_budget_gpu"], r["summary"][key])

    return max(near, key=by_budget), max(confirmed, key=by_budget)


def budget_topology(name: str, gpus: int) -> str:
    """The topology of ``gpus`` GPUs built from ``name`` (a preset, ``NAME*k`` or ``NAME@G``; a topology file
    must hold at least that many GPUs). UserError naming ``--gpus`` / ``--topology`` otherwise."""
    from rackbed import topology
    from rackbed.topology.presets import _MULTI, _PART, PRESETS, resized

    m = _MULTI.match(name.strip()) or _PART.match(name.strip())
    base = m.group("name") if m else name.strip()
    if base in PRESETS and "+" not in name:
        return resized(name, gpus)
    n = topology.load(name).n_gpus  # a joined topology (A+B) keeps its parts' sizes: the budget caps them
    if gpus > n:
        raise UserError(f"--gpus {gpus}: the topology {name} has {n} GPUs")
    return name


# ------------------------------------------------------------------------------------------------------------------
# Analytic stage


def rate_key(spec: se.SearchSpec) -> str:
    """The dotted scenario field that sets a simulation's request rate."""
    return TRACE_RATE_KEY if spec.workload.kind == "trace" else RATE_KEY


def estimate_load(spec: se.SearchSpec) -> se.Load:
    """The load the analytic stage prices. A trace is drawn for :data:`ESTIMATE_REQUESTS` requests (looped, each
    pass on fresh block ids) whatever the rate: the spec's rate is a placeholder in a budget search and a trace's
    order, hence its prefix reuse, does not depend on the rate; a synthetic workload is drawn as given."""
    wl = spec.workload
    if wl.kind == "trace":
        wl = wl.model_copy(update={"duration_s": None, "max_requests": ESTIMATE_REQUESTS, "loop": True})
    return se.workload_load(wl, spec.seed)


class HitRates:
    """Prefix-cache hit rates the budget search assumes (:func:`sim.search.assumed_hit_rate`'s rule: LRU caches
    of a replica's capacity, requests dealt to them in turn), of the requests a simulation at a given rate sees —
    the first ``rate x duration_s`` of the stream, so that a low rate's colder caches count. One pass of the stream
    per (capacity, caches) (``engine.core.prefix_reuse.lru_reuse_curve``), memoised."""

    def __init__(self, requests: Sequence, duration_s: float | None):
        self.requests, self.duration_s = list(requests), duration_s
        self._curves: dict[tuple[int, int], tuple[list[int], list[int]]] = {}

    def __call__(self, blocks: int, caches: int, rate_per_s: float) -> float:
        from rackbed.engine.core.prefix_reuse import lru_reuse_curve

        key = (blocks, max(1, caches))
        if key not in self._curves:
            self._curves[key] = lru_reuse_curve(self.requests, blocks, key[1])
        total, hits = self._curves[key]
        if not total:
            return 0.0
        n = len(total) if not self.duration_s else min(len(total), max(1, round(rate_per_s * self.duration_s)))
        return hits[n - 1] / total[n - 1] if total[n - 1] else 0.0


def _decode_tpot_fn(spec: se.SearchSpec, base: Mapping, model, topo, d: se.DecodeOption):
    """TPOT(b) of a decode option (memoised on the integer batch), priced as :func:`sim.search.decode_options`."""
    from rackbed.engine.core.specdec import expected_tokens_per_step
    from rackbed.sim.scenario import cost_model_for, decode_plan_for

    sc = se._scenario(base, {"topology": d.topology, "weight_format": d.weight_format, "decode.ep": d.ep,
                             "decode.max_batch_per_rank": d.max_batch_per_rank, "mtp.draft_k": d.draft_k,
                             **se._decode_tp_override(d.tp, d.redundant_experts, d.overlap, d.moe_comm),
                             **se._kv_override(d.kv_dtype), **se.gpu_override("decode", d.gpu)})
    plan = decode_plan_for(sc, model, se._plan_gpus(topo, d.ep, "decode", d.gpu))
    cm = cost_model_for(sc, model, topo, None, plan)[0]
    e = expected_tokens_per_step(d.draft_k, sc.mtp.accept_p)

    @functools.cache
    def at(bi: int) -> float:
        return se._decode_tpot(cm, d.context_tokens, d.draft_k, e, bi)[0]

    return lambda b: at(max(1, math.ceil(b - 1e-9)))


def disaggregated_candidates(spec: se.SearchSpec, load: se.Load, model, topo, gpus: int,
                             hits: HitRates | None = None, prices: Mapping[str, float] | None = None
                             ) -> list[BudgetCandidate]:
    """Every (prefill option x decode option x decoder count) that fits ``gpus`` (module docstring). With a
    prefix cache (``hits``; the prefill option's ``cache_blocks``) a prefiller's capacity is priced at the hit
    rate of the prefiller count that carries the decoders' rate (:func:`_prefillers_for`). ``prices`` ($ per
    GPU-hour of each GPU model, :func:`gpu_kinds`' names) on a topology of several GPU models: every pool —
    prefill on one model and decode on another, either way round, or both on one — each role's options priced
    on its own model's GPUs and calibration, the pair's KV transfer over the fabric that joins them, and each
    candidate's $ per hour; the GPUs of each model the topology has bound each pool."""
    topos = {spec.space.topology[0]: topo}
    # one pool per GPU model with prices, else one pool of every GPU (key None)
    room: dict[Any, int] = dict(gpu_kinds(topo)) if prices else {None: gpus}
    kinds: list[Any] = list(room)
    price: Mapping[Any, float] = prices or {}
    pre_by: dict[Any, list[Any]] = {k: list(se.prefill_options(spec, load, model, topos, gpu=k)) for k in kinds}
    dec_by: dict[Any, list[Any]] = {k: list(se.decode_options(spec, load, model, topos, gpu=k)) for k in kinds}
    base = se.base_scenario(spec)
    kv_cache: dict = {}
    prompt, out_tok = max(1, round(load.prompt_mean)), load.output_mean
    slo = spec.slo
    h = spec.prefill_headroom
    usd_budget = sum(room[k] * price[k] for k in kinds) if prices else None
    out: list[BudgetCandidate] = []
    for k in kinds:  # the options' own pruning, one candidate each so that the reasons are counted
        for o in (*pre_by[k], *dec_by[k]):
            if o.pruned is not None:
                role = "prefill" if isinstance(o, se.PrefillOption) else "decode"
                out.append(BudgetCandidate("disaggregated", f"{role} option", {}, 0, pruned=o.pruned))
    tpots = {}
    pairs = [(kp, kd, p, d) for kp, kd in itertools.product(kinds, kinds)
             for p in pre_by[kp] if p.pruned is None
             for d in dec_by[kd] if d.pruned is None and d.kv_dtype == p.kv_dtype]
    for kp, kd, p, d in pairs:
        on_p, on_d = (f" on {kp}", f" on {kd}") if prices else ("", "")
        gp = max(p.tp, p.ep)
        kv = se._pair_kv_s(base, kv_cache, p, d, prompt)
        if kv is None:
            out.append(BudgetCandidate("disaggregated", "pair", {}, 0,
                                       pruned=f"prefill TP{p.tp}/EP{p.ep}{on_p} and decode EP{d.ep}{on_d}: "
                                              "the simulator's placement refuses the pair"))
            continue
        kv_tok = kv / (out_tok - 1) if out_tok > 1 else 0.0
        key = id(d)
        if key not in tpots:
            tpots[key] = _decode_tpot_fn(spec, base, model, topo, d)
        tpot = tpots[key]
        rate_d1 = d.ranks * d.b_max / (out_tok * d.tpot_at_cap_s)  # one decoder at its batch cap
        rate_p1 = p.capacity_tokens_per_s / (prompt * h)        # one prefiller at 1/headroom utilisation
        same = kp == kd
        d_room = min(room[kd] - (gp if same else 0), gpus - gp)
        for n_d in range(1, d_room // d.ep + 1):
            p_max = min(room[kp] - (n_d * d.ep if same else 0), gpus - n_d * d.ep) // gp
            if p_max < 1:
                break
            hit = None
            if hits is not None and p.cache_blocks > 0:
                n_p, rate, hit = _prefillers_for(p, hits, n_d * rate_d1, p_max, prompt * h)
            else:
                rate = min(p_max * rate_p1, n_d * rate_d1)
                n_p = min(p_max, max(1, math.ceil(rate / rate_p1 - 1e-9)))
            b = float(d.b_max)
            for _ in range(12):  # b = rate x output x TPOT(b) / (D x DP ranks), from above
                nb = min(float(d.b_max), rate * out_tok * tpot(b) / (n_d * d.ranks))
                done = abs(nb - b) < 0.05
                b = nb
                if done:
                    break
            t = tpot(b) + kv_tok
            n = n_p * gp + n_d * d.ep
            ov = {"topology": p.topology, "weight_format": p.weight_format, "deployment": "disaggregated",
                  "prefill.tp": p.tp, "prefill.ep": p.ep, "prefill.max_batch_tokens": p.max_batch_tokens,
                  "prefill.replicas": n_p, "decode.ep": d.ep,
                  "decode.max_batch_per_rank": d.max_batch_per_rank, "decode.replicas": n_d,
                  "mtp.draft_k": d.draft_k,
                  **se._decode_tp_override(d.tp, d.redundant_experts, d.overlap, d.moe_comm),
                  **se._prefill_overlap_override(p.overlap), **se._kv_override(d.kv_dtype),
                  **se.gpu_override("prefill", kp), **se.gpu_override("decode", kd)}
            c = BudgetCandidate("disaggregated", f"{n_p} x TP{p.tp}/EP{p.ep} prefill{on_p} + {n_d} x "
                                f"{f'TP{d.tp}/' if d.tp > 1 else ''}DP-EP{d.ep}"
                                f"{se.moe_comm_label(d.moe_comm)} decode{on_d}, batch <= "
                                f"{d.max_batch_per_rank}, MTP k={d.draft_k}{se._kv_label(d.kv_dtype)}", ov,
                                n, rate_per_s=rate, est_tokens_per_s_per_gpu=rate * out_tok / n,
                                est_tokens_per_s_per_user=1.0 / t, est_ttft_s=p.ttft_floor_s, est_tpot_s=t,
                                est_hit_rate=hit)
            if prices:
                used: dict[str, int] = {}
                for kind, g in ((kp, n_p * gp), (kd, n_d * d.ep)):
                    used[kind] = used.get(kind, 0) + g
                c.gpus_by_kind, c.room, c.usd_budget = used, dict(room), usd_budget
                c.usd_per_hour = sum(g * price[kind] for kind, g in used.items())
            if t > slo.tpot_s:
                c.pruned = (f"TPOT {t * 1e3:.1f} ms at batch {b:.0f}/rank with the KV transfer > SLO "
                            f"{slo.tpot_s * 1e3:.1f} ms")
            out.append(c)
    return out


def gpu_kinds(topo) -> dict[str, int]:
    """The topology's GPU models (``GpuSpec.name``, in the order of their first GPU) and how many GPUs of each
    it has; more than one: a mixed topology (``A+B``), whose roles the search may place on different
    models."""
    out: dict[str, int] = {}
    for g in sorted(topo.gpu_ids):
        name = topo.gpu_spec(g).name
        out[name] = out.get(name, 0) + 1
    return out


def kind_prices(given, kinds: Sequence[str]) -> dict[str, float]:
    """$ per GPU-hour of each GPU model of a mixed topology from ``--gpu-hour-usd`` (the spec's
    ``gpu_hour_usd``): a mapping whose keys name the models as ``prefill.gpu`` does (part of the name, any
    case), every model priced once and above 0. A one-line UserError otherwise (the prices decide the pool:
    they must be stated)."""
    shown = ", ".join(kinds)
    if not isinstance(given, Mapping) or not given:
        raise UserError(f"--gpu-hour-usd: the topology has several GPU models ({shown}); give each its price "
                        f"per GPU-hour: --gpu-hour-usd {','.join(f'{k}=USD' for k in kinds)}")
    out: dict[str, float] = {}
    for key, usd in given.items():
        hit = [k for k in kinds if str(key).lower() in k.lower()]
        if len(hit) != 1:
            raise UserError(f"--gpu-hour-usd {key}={usd}: {key!r} names {'no' if not hit else 'several'} GPU "
                            f"model{'s' if hit else ''} of the topology ({', '.join(hit) or shown})")
        if hit[0] in out:
            raise UserError(f"--gpu-hour-usd {key}={usd}: {hit[0]} is priced twice")
        if not float(usd) > 0:
            raise UserError(f"--gpu-hour-usd {key}={usd}: a price must be above 0")
        out[hit[0]] = float(usd)
    missing = [k for k in kinds if k not in out]
    if missing:
        raise UserError(f"--gpu-hour-usd: no price for {', '.join(missing)} (the topology has {shown})")
    return out

def _prefillers_for(p: se.PrefillOption, hits: HitRates, target: float, p_max: int,
                    tokens_per_request: float) -> tuple[int, float, float]:
    """``(prefillers, rate, hit rate)``: the fewest of at most ``p_max`` prefillers of option ``p`` whose cached
    capacity carries ``target`` requests/s (each at ``1 / headroom`` utilisation: ``tokens_per_request`` = prompt x
    headroom), at the hit rate of that many caches at that rate; ``p_max`` of them and the rate they carry (at its
    own hit rate, one refinement) when none does."""
    for n in range(1, p_max + 1):
        hit = hits(p.cache_blocks, n, target)
        if n * _capacity(p, hit) / tokens_per_request >= target:
            return n, target, hit
    hit = hits(p.cache_blocks, p_max, target)
    rate = p_max * _capacity(p, hit) / tokens_per_request
    hit = hits(p.cache_blocks, p_max, rate)
    return p_max, min(target, p_max * _capacity(p, hit) / tokens_per_request), hit


def _capacity(p: se.PrefillOption, hit: float) -> float:
    """One prefiller's prompt tokens/s at hit rate ``hit`` (``PrefillOption.capacity_at``), memoised per option at
    0.1 % steps of the hit rate."""
    memo = p.__dict__.setdefault("_capacity_memo", {})
    k = round(hit, 3)
    if k not in memo:
        memo[k] = p.capacity_at(k)
    return memo[k]


def aggregated_candidates(spec: se.SearchSpec, load: se.Load, model, topo, gpus: int,
                          hits: HitRates | None = None) -> list[BudgetCandidate]:
    """Aggregated workers tiling ``gpus`` (module docstring), pruned ones included. With a prefix cache
    (``hits``) every worker caches what it prefilled: its operating point prefills the uncached share of the
    mean prompt, at the hit rate of ``workers`` caches at the deployment's rate (two rounds from the rate
    without a cache)."""
    from rackbed.engine.core.specdec import expected_tokens_per_step
    from rackbed.sim.aggregated import aggregated_plan_for
    from rackbed.sim.costs.mixed import aggregated_operating_point
    from rackbed.sim.scenario import cost_model_for

    base = se.base_scenario(spec)
    cached = hits is not None and bool((base.get("prefix_cache") or {}).get("enabled"))
    prompt, out_tok = max(1, round(load.prompt_mean)), max(1, round(load.output_mean))
    ctx = load.prompt_mean + load.output_mean / 2
    slo, h = spec.slo, spec.prefill_headroom
    tname, fmt = spec.space.topology[0], spec.space.weight_format[0]
    out: list[BudgetCandidate] = []
    for tp, dp in AGG_SHAPES:
        size = tp * dp
        workers = gpus // size
        if workers < 1:
            continue
        for mbt, chunk in AGG_BUDGETS:
            for cap in spec.space.max_batch_per_rank:
                for k, kv in itertools.product(spec.space.draft_k if tp == 1 else (0,),
                                               spec.space.kv_dtype or (None,)):
                    ov = {"topology": tname, "weight_format": fmt, "deployment": "aggregated",
                          "aggregated.workers": workers, "aggregated.tp": tp, "aggregated.dp": dp,
                          "aggregated.ep": size, "aggregated.max_batch_per_rank": cap,
                          "aggregated.max_batch_tokens": mbt, "aggregated.chunk_tokens": chunk, "mtp.draft_k": k,
                          **se._kv_override(kv)}
                    c = BudgetCandidate("aggregated", f"{workers} x aggregated TP{tp}/DP{dp}/EP{size}, batch <= "
                                        f"{cap}, budget {mbt} / chunk {chunk} tokens, MTP k={k}{se._kv_label(kv)}",
                                        ov, workers * size)
                    out.append(c)
                    try:
                        sc = se._scenario(base, ov)
                        plan = aggregated_plan_for(sc, model, se._plan_gpus(topo, size, "aggregated worker"))
                        bud = plan.validate(model, topo)
                        b_max = min(cap, int(bud.kv_capacity_tokens // max(1.0, ctx)))
                        if b_max < 1:
                            c.pruned = (f"KV capacity {bud.kv_capacity_tokens} tokens/rank holds no sequence of "
                                        f"{ctx:.0f} tokens")
                            continue
                        calib = cost_model_for(sc, model, topo, plan, plan, engine_calibration=False)[1]
                        e = expected_tokens_per_step(k, sc.mtp.accept_p)
                        at = functools.partial(aggregated_operating_point, model, plan, topo,
                                               prompt_tokens=prompt, output_tokens=out_tok, max_batch_per_rank=b_max,
                                               max_batch_tokens=mbt, chunk_tokens=chunk, draft_k=k,
                                               tokens_per_step=e, calib=calib)
                        op = at()
                        if cached:
                            blocks = se.cache_blocks_of(sc, model, topo, size, "aggregated worker")
                            for _ in range(2):
                                c.est_hit_rate = hits(blocks, workers, workers * op.requests_per_s / h)
                                op = at(cached_tokens=min(prompt - 1, round(prompt * c.est_hit_rate)))
                    except (ValueError, FileNotFoundError) as exc:
                        c.pruned = one_line(exc)
                        continue
                    per_step = min(chunk, op.prefill_tokens_per_rank)
                    ttft = math.ceil(prompt / max(1, per_step)) * op.step_s
                    rate = workers * op.requests_per_s / h
                    c.rate_per_s, c.est_ttft_s, c.est_tpot_s = rate, ttft, op.tpot_s
                    c.est_tokens_per_s_per_gpu = rate * load.output_mean / c.n_gpus
                    c.est_tokens_per_s_per_user = 1.0 / op.tpot_s
                    if op.tpot_s > slo.tpot_s:
                        c.pruned = (f"TPOT {op.tpot_s * 1e3:.1f} ms at batch {op.batch_per_rank:.0f}/rank (mixed "
                                    f"steps) > SLO {slo.tpot_s * 1e3:.1f} ms")
                    elif ttft > slo.ttft_s:
                        c.pruned = (f"TTFT {ttft * 1e3:.0f} ms ({math.ceil(prompt / max(1, per_step))} mixed steps "
                                    f"of {op.step_s * 1e3:.0f} ms) > SLO {slo.ttft_s * 1e3:.0f} ms")
    return out


def spread(front: Sequence[BudgetCandidate], n: int) -> list[BudgetCandidate]:
    """Up to ``n`` points of a front sorted by tokens/s per GPU descending: the first, the last and evenly spaced
    ones between."""
    if len(front) <= n:
        return list(front)
    if n == 1:
        return [front[0]]
    idx = sorted({round(i * (len(front) - 1) / (n - 1)) for i in range(n)})
    return [front[i] for i in idx]


# ------------------------------------------------------------------------------------------------------------------
# The whole budget search


def run_budget_search(spec: se.SearchSpec, gpus: int, out_dir: str | Path, *, kinds: Sequence[str] = KINDS,
                      per_front: int = 3, max_simulations: int = 12, backoff: float = 0.75, retries: int = 2,
                      fill_tolerance: float = FILL_TOLERANCE, jobs: int = 1, progress: bool = False, console=None) -> BudgetResult:
    """The budget search (module docstring); simulations append to ``out_dir/results.jsonl`` (resumable).
    UserError (with what to change) when no candidate survives the analytic stage."""
    from rackbed import topology as topo_mod
    from rackbed.sim.scenario import parse_scenario, scenario_model
    from rackbed.sim.sweep import SweepSpec, expand, run_points

    t0 = time.perf_counter()
    if gpus < 1:
        raise UserError(f"--gpus {gpus}: must be a positive integer")
    tname = budget_topology(spec.space.topology[0], gpus)
    spec = spec.model_copy(update={"space": spec.space.model_copy(update={"topology": (tname,)})})
    topo = topo_mod.load(tname)
    room = gpu_kinds(topo)
    prices = kind_prices(spec.gpu_hour_usd, list(room)) if len(room) > 1 else None
    if prices is None and spec.gpu_hour_usd:
        raise UserError(f"--gpu-hour-usd: with --gpus N only on a topology of several GPU models (A+B), "
                        f"where the prices choose the pool; {tname} has one ({next(iter(room))}), ranked by "
                        "tokens/s per GPU")
    stack, calib_line = _stack_of(spec, topo, list(room) if prices else None)
    model = scenario_model(parse_scenario(se.base_scenario(spec), f"search {spec.name}"))
    spec, note = se.without_unasked_mtp(spec, model)
    load = estimate_load(spec)
    se.check_prefix_ids(spec, load)
    notes = [note] if note else []
    window = arrival_window(spec, load)
    given = getattr(spec.workload, "duration_s", None)
    if given is None or window > given:
        notes.append(f"arrival window {window:.0f} s per simulation: {LIFE_WINDOWS} lives of a request at the SLOs "
                     f"({request_life_s(spec, load.output_mean):.1f} s = TTFT + {load.output_mean - 1:.0f} x TPOT)"
                     + (f", longer than --duration {given:g} s" if given else ""))
        spec = spec.model_copy(update={"workload": spec.workload.model_copy(update={"duration_s": window})})
    hits = None
    if (se.base_scenario(spec).get("prefix_cache") or {}).get("enabled"):
        hits = HitRates(load.requests, window)
        notes.append("prefix cache: each candidate is sized for the uncached share of its prompts at the hit rate "
                     "of its prefillers' (aggregated: workers') LRU caches, HBM and host tiers, with the requests "
                     "a simulation at its rate sees dealt in turn (column est hit; kv_aware routing does better, "
                     "sim hit is measured)")
    if prices:
        if "disaggregated" not in kinds:
            raise UserError(f"--kind {','.join(kinds)}: on a topology of several GPU models ({tname}) the "
                            "search places prefill and decode pools (--kind disaggregated)")
        if "aggregated" in kinds:
            notes.append("aggregated workers are not searched on a topology of several GPU models: a "
                         "worker's prefill and decode share its GPUs")
        kinds = ("disaggregated",)
        at = ", ".join(f"${v:g}/GPU-hour {k}" for k, v in prices.items())
        notes.append(f"mixed pools: prefill and decode each on {' or '.join(room)}, ranked by output "
                     f"tokens/s per $ per hour at {at}")
    cands: list[BudgetCandidate] = []
    if "disaggregated" in kinds:
        cands += disaggregated_candidates(spec, load, model, topo, gpus, hits, prices)
    if "aggregated" in kinds:
        cands += aggregated_candidates(spec, load, model, topo, gpus, hits)
    for c in cands:
        c.budget = gpus
    res = BudgetResult(spec, gpus, tname, load, cands, [], [], {k: [] for k in kinds}, None, notes=notes,
                       stack=stack, calibration=calib_line, prices=prices, room=room if prices else None)
    if not any(c.pruned is None for c in cands):
        raise UserError(infeasible_hint(res))
    base = se.base_scenario(spec)
    # pending simulations: (candidate, rate, retries so far, window multiple: 1, or HOLD_WINDOWS to decide a trend)
    pending = [(c, c.rate_per_s, 0, 1) for kind in kinds for c in spread(res.analytic_front(kind), per_front)]
    for kind in kinds:  # each kind's best estimate on the whole budget, when the front's spread left it out
        c = res.budget_pick(kind)
        if c is not None and all(c is not q for q, _, _, _ in pending):
            pending.append((c, c.rate_per_s, 0, 1))
    best_ok: dict[int, dict] = {}
    tried_up: set[int] = set()
    scen: dict[str, dict] = {}
    n_sim = 0
    wkey = "workload.duration_s"
    while pending and n_sim < max_simulations:
        batch = pending[: max_simulations - n_sim]
        pending, lower, longer, higher = [], [], [], []
        sweep = SweepSpec(name=spec.name, base=base, points=[{**c.overrides, rate_key(spec): round(r, 4),
                                                              **({wkey: round(f * window, 4)} if f > 1 else {})}
                                                             for c, r, _, f in batch], source=f"search {spec.name}")
        points = expand(sweep)
        run = run_points(points, Path(out_dir) / "results.jsonl", jobs=jobs, progress=progress, console=console)
        n_sim += len(points)
        by_key = {r["key"]: r for r in run.records}
        for (c, r, tries, f), p in zip(batch, points):
            w = round(f * window, 4) if f > 1 else window
            rec = sustained(dict(by_key.get(p.key, {"key": p.key, "status": "missing", "label": p.label})),
                            c.n_gpus, w)
            if c.usd_per_hour:
                rec = priced(rec, c.n_gpus, c.usd_per_hour, c.gpus_by_kind)
            rec["steady"] = steady(rec, spec.slo.ttft_s, spec.slo.tpot_s, spec.slo.percentile, window_s=w,
                                   output_tokens=load.output_mean)
            met = meets_slo(rec, spec.slo.ttft_s, spec.slo.tpot_s, spec.slo.percentile)
            # a run HOLD_WINDOWS x as long that meets the SLOs decides a trend the shorter one could not
            rec["holds"] = met and (rec["steady"]["ok"] or f > 1)
            rec.update(candidate=c.label, kind=c.kind, rate_per_s=r, gpus=c.n_gpus, window_s=w,
                       est={"rate_per_s": c.rate_per_s, "tokens_per_s_per_gpu": c.est_tokens_per_s_per_gpu,
                            "tokens_per_s_per_user": c.est_tokens_per_s_per_user, "ttft_s": c.est_ttft_s,
                            "tpot_s": c.est_tpot_s,
                            **({} if c.est_hit_rate is None else {"prefix_hit_rate": c.est_hit_rate})})
            res.records.append(rec)
            scen[p.key] = p.scenario
            if rec["holds"]:
                prev = best_ok.get(id(c))
                if prev is None or r > prev["rate_per_s"]:
                    best_ok[id(c)] = rec
                if id(c) not in tried_up and tries == 0:  # once: does it carry more than the estimate?
                    tried_up.add(id(c))
                    higher.append((c, r / backoff, tries + 1, 1))
            elif met and f == 1:  # meets the SLOs, but its latency still rises: simulate it for longer to decide
                longer.append((c, r, tries, HOLD_WINDOWS))
            elif rec.get("status") == "ok" and id(c) not in best_ok and tries < retries:
                # a queue that grows says how much less the deployment serves: below that, not just backoff x
                g = rec["steady"].get("wait_growth") or 0.0
                lower.append((c, r * min(backoff, backoff / (1.0 + g)), tries + 1, 1))
        pending = lower + longer + higher  # a point still missing the SLOs first
    res.confirmed = list(best_ok.values())
    for kind in kinds:
        el = [r for r in res.confirmed if r["kind"] == kind]
        key = OBJECTIVES[res.objective]
        res.fronts[kind] = sorted(front_of(el, res.objective), key=lambda r: -r["summary"][key]) if el else []
    res.scenarios = scen
    for r in res.confirmed:
        r["use"] = budget_use(r, gpus, _placeable_copies(res, r))
    if prices:
        res.best, res.best_total = pick_best(res.confirmed, gpus, fill_tolerance, res.objective)
    else:
        res.best, res.best_total = pick_best(res.confirmed, gpus, fill_tolerance)
    if n_sim >= max_simulations and pending:
        notes.append(f"stopped at {max_simulations} simulations (--max-simulations)")
    res.wall_s = time.perf_counter() - t0
    return res


def _placeable_copies(res: BudgetResult, rec: dict) -> int:
    """The most copies of ``rec``'s deployment (up to ``budget // its GPUs``) that the topology places together
    (a group must stay within its NVLink domain, so GPUs left over in several nodes may not take one more)."""
    from rackbed.sim.scenario import build

    top = res.gpus // int(rec["gpus"])
    room = getattr(res, "room", None)
    if room and rec.get("gpus_by_kind"):  # mixed pools: each model's GPUs bound it
        top = min([top, *(room[k] // u for k, u in rec["gpus_by_kind"].items() if u)])
    for k in range(max(1, top), 1, -1):
        try:
            build(scenario_of(res, {**rec, "use": {"replicas": k}}, on_budget=True), engine_calibration=False)
            return k
        except ValueError:
            continue
    return 1


def _stack_of(spec: se.SearchSpec, topo, kinds: Sequence[str] | None = None) -> tuple[str, str]:
    """``(stack asked for, the line that says what prices the candidates)`` (:func:`check_stack`; on a mixed
    topology, ``kinds``, one line per GPU model joined by "; ")."""
    stack = str(se.base_scenario(spec).get("stack", "auto"))
    if kinds:
        return stack, "; ".join(check_stack(stack, topo, k) for k in kinds)
    return stack, check_stack(stack, topo)


def check_stack(stack: str, topo, gpu: str | None = None) -> str:
    """The line that says what prices a run on ``topo`` (a Topology or its name) by ``stack`` — on its GPU
    model ``gpu`` when given (a mixed topology); a stack with no shipped calibration for its GPU is a
    UserError naming ``--stack`` and the stacks shipped (before any candidate is priced, so that it is not a
    pruning reason)."""
    from rackbed import topology as topo_mod
    from rackbed.sim.calibrate import calibration_for_topology, describe_calibration

    if isinstance(topo, str):
        topo = topo_mod.load(topo)
    try:
        if gpu is not None:
            from rackbed.sim.calibration.files import default_calibration_for

            table = default_calibration_for(gpu, None, stack)
        else:
            table = calibration_for_topology(topo, stack=stack)
    except UserError as e:
        raise UserError(f"--stack {stack}: {str(e).removeprefix('stack: ')}") from None
    return describe_calibration(table)


def infeasible_hint(res: BudgetResult) -> str:
    """One line: why nothing fits, and what to change."""
    import re

    from rackbed.sim.search_results import normalise_reason

    groups: dict[str, list[str]] = {}
    for c in res.candidates:
        if c.pruned:
            groups.setdefault(normalise_reason(c.pruned), []).append(c.pruned)
    top = sorted(groups.values(), key=lambda g: -len(g))[:2]
    why = "; ".join(f"{len(g)} like '{g[0]}'" for g in top) or "no candidate deployment"
    sp = res.spec
    fits = any(re.search(r"does not fit|KV capacity", g[0]) for g in top)
    change = ("more --gpus, a smaller --format (e.g. fp8 or nvfp4) or a smaller --model" if fits else
              "looser --ttft / --tpot, more --gpus or a shorter --isl")
    return (f"no deployment of {sp.model} on {res.gpus} GPUs of {res.topology} meets TTFT <= {sp.slo.ttft_s:g} s "
            f"and TPOT <= {sp.slo.tpot_s * 1e3:g} ms ({why}); try {change}")


def _safe(name: str) -> str:
    import re

    return re.sub(r"[^A-Za-z0-9._-]", "x", name)


def summary(res: BudgetResult) -> dict:
    """The JSON-able answer: the fronts, the best point, every simulation's figures and the analytic fronts."""
    def pt(r):
        s = r.get("summary") or {}
        return {"kind": r["kind"], "config": r["candidate"], "gpus": r["gpus"], "rate_per_s": r["rate_per_s"],
                "use": r.get("use"),
                "status": r.get("status"), "meets_slo": meets_slo(r, res.spec.slo.ttft_s, res.spec.slo.tpot_s,
                                                                   res.spec.slo.percentile),
                "steady": r.get("steady"), "holds": holds(r, res.spec.slo),
                "tokens_per_s_per_gpu": s.get("tokens_per_s_per_gpu"),
                "tokens_per_s_per_gpu_with_drain": s.get("tokens_per_s_per_gpu_with_drain"),
                "tokens_per_s_per_user": s.get("tokens_per_s_per_user"), "ttft_p90_s": s.get("ttft_p90_s"),
                "tpot_p90_s": s.get("tpot_p90_s"), "prefix_hit_rate": s.get("prefix_hit_rate"), "est": r["est"],
                "overrides": r.get("overrides"),
                "reason": r.get("reason") or None,
                **({"gpus_by_kind": r.get("gpus_by_kind"), "usd_per_hour": r.get("usd_per_hour"),
                    "tokens_per_s_per_usd_hour": s.get("tokens_per_s_per_usd_hour"),
                    "usd_per_mtok": s.get("usd_per_mtok")} if res.prices else {})}

    return {"model": res.spec.model, "gpus": res.gpus, "topology": res.topology,
            "weight_format": res.spec.space.weight_format[0],
            "prompt_tokens": res.load.prompt_mean, "output_tokens": res.load.output_mean,
            "slo": res.spec.slo.model_dump(), "window_s": getattr(res.spec.workload, "duration_s", None),
            "wall_s": res.wall_s, "notes": res.notes, "stack": res.stack,
            "calibration": res.calibration, "workload": res.spec.workload.kind,
            **({"gpu_hour_usd": res.prices, "gpus_by_kind": res.room} if res.prices else {}),
            "prefix_cache": se.base_scenario(res.spec).get("prefix_cache"),
            "candidates": len(res.candidates), "analytic_survivors": sum(c.pruned is None for c in res.candidates),
            "fronts": {k: [pt(r) for r in v] for k, v in res.fronts.items()},
            "best": pt(res.best) if res.best else None,
            "best_total": pt(res.best_total) if res.best_total else None, "simulations": [pt(r) for r in res.records],
            "analytic_fronts": {k: [{"config": c.label, "gpus": c.n_gpus, "rate_per_s": c.rate_per_s,
                                     "tokens_per_s_per_gpu": c.est_tokens_per_s_per_gpu,
                                     "tokens_per_s_per_user": c.est_tokens_per_s_per_user,
                                     "prefix_hit_rate": c.est_hit_rate, "replicas": c.replicas,
                                     "tokens_per_s_per_budget_gpu": c.est_tokens_per_s_per_budget_gpu,
                                     **({"gpus_by_kind": c.gpus_by_kind, "usd_per_hour": c.usd_per_hour,
                                         "tokens_per_s_per_usd_hour": c.value} if res.prices else {})}
                                    for c in res.analytic_front(k)] for k in res.fronts}}


def plot_fronts(res: BudgetResult, path: str | Path) -> Path:
    """``pareto.png``: per kind, every simulated point meeting the SLOs and its front (line), the analytic front
    (dashed), tokens/s per user on x, tokens/s per GPU on y."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for kind, color in zip(res.fronts, ("tab:blue", "tab:orange")):
        ok = [r for r in res.confirmed if r["kind"] == kind]
        ax.scatter([r["summary"]["tokens_per_s_per_user"] for r in ok],
                   [r["summary"]["tokens_per_s_per_gpu"] for r in ok], color=color, alpha=0.5, s=18)
        fr = sorted(res.fronts[kind], key=lambda r: r["summary"]["tokens_per_s_per_user"])
        if fr:
            ax.plot([r["summary"]["tokens_per_s_per_user"] for r in fr],
                    [r["summary"]["tokens_per_s_per_gpu"] for r in fr], "o-", color=color,
                    label=f"{kind} (simulated)")
        af = sorted(res.analytic_front(kind), key=lambda c: c.est_tokens_per_s_per_user)
        if af:
            ax.plot([c.est_tokens_per_s_per_user for c in af], [c.est_tokens_per_s_per_gpu for c in af], "--",
                    color=color, alpha=0.6, label=f"{kind} (analytic estimate)")
    if res.best is not None:
        s = res.best["summary"]
        ax.scatter([s["tokens_per_s_per_user"]], [s["tokens_per_s_per_gpu"]], marker="*", s=200, color="k",
                   zorder=5, label="best")
    ax.set_xlabel("tokens/s per user (p50 of 1/TPOT)")
    ax.set_ylabel("tokens/s per GPU")
    ax.set_title(f"{res.spec.model}, {res.gpus} GPUs ({res.topology}, {res.spec.space.weight_format[0]})", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    from rackbed.topology.outputs import replacing

    path = Path(path)
    with replacing(path, "wb") as f:  # topology.outputs: atomic, never through a link
        fig.savefig(f, format=path.suffix.lstrip(".").lower() or "png", dpi=120)
    plt.close(fig)
    return path


def write_budget(res: BudgetResult, out: str | Path) -> list[Path]:
    """``OUT/budget.json`` (:func:`summary`) and ``OUT/pareto.png`` (:func:`plot_fronts`)."""
    import json

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    js = out / "budget.json"
    from rackbed.topology.outputs import write_text

    write_text(js, json.dumps(summary(res), indent=1, default=str) + "\n")
    return [js, plot_fronts(res, out / "pareto.png")]


def scenario_of(res: BudgetResult, rec: Mapping, *, on_budget: bool = False):
    """The ServingScenario a budget-search record simulated (to emit it or run it again). ``on_budget``: its
    :func:`budget_use` copies as one scenario (replica counts, or aggregated workers, times the copies) — what
    ``--emit`` launches on the budget."""
    import copy

    from rackbed.sim.scenario import parse_scenario

    d = copy.deepcopy(dict(res.scenarios[rec["key"]]))
    reps = (rec.get("use") or budget_use(rec, res.gpus))["replicas"] if on_budget else 1
    if reps > 1:
        if d.get("deployment") == "aggregated":
            d["aggregated"]["workers"] = d["aggregated"].get("workers", 1) * reps
        else:
            for role in ("prefill", "decode"):
                d[role]["replicas"] = d[role]["replicas"] * reps
    return parse_scenario(d, f"search {res.spec.name}")


# ------------------------------------------------------------------------------------------------------------------
# A fixed deployment: the highest rate it sustains


@dataclass
class MaxRate:
    rate_per_s: float | None       # the highest rate simulated that met the SLOs (None: not even the lowest)
    record: dict | None            # its summary
    tried: list[tuple[float, bool, dict]]  # (rate, met the SLOs, summary) in the order simulated


def max_rate(sc, ttft_s: float, tpot_s: float, percentile: str = "p90", *, start: float | None = None,
             steps: int = 5, max_doublings: int = 8, hold: bool = True) -> MaxRate:
    """The highest Poisson rate (requests/s) at which the scenario ``sc`` meets the SLOs: double from ``start``
    (default: the scenario's rate, or 1) until a rate misses, then ``steps`` bisections between the last rate
    that met and the first that missed. Every rate is a simulation of ``sc`` with that rate (``--rate``).
    ``hold`` (default): as the budget search (module docstring, step 2), the arrival window is at least
    :data:`LIFE_WINDOWS` lives of a request at the SLOs (at the workload's mean output) and a rate meets the SLOs
    only if its steady state holds (:func:`steady`, or a run :data:`HOLD_WINDOWS` times as long that meets them);
    each summary in ``tried`` carries its ``steady``."""
    import statistics

    from rackbed.engine.core.metrics import clean
    from rackbed.engine.core.workload import iter_requests
    from rackbed.sim.overrides import apply_overrides
    from rackbed.sim.scenario import build, simulate_scenario
    from rackbed.sim.sweep import arrival_quarters, summarize_metrics

    tried: list[tuple[float, bool, dict]] = []
    out_mean = 1.0
    if hold:
        sample = list(itertools.islice(iter_requests(sc.workload, sc.seed), 2000))
        out_mean = statistics.fmean(r.output_tokens for r in sample) if sample else 1.0
        life = ttft_s + max(0.0, out_mean - 1.0) * tpot_s
        if (getattr(sc.workload, "duration_s", None) or 0.0) < LIFE_WINDOWS * life:
            sc = apply_overrides(sc, duration_s=LIFE_WINDOWS * life)

    def ok(rate: float) -> bool:
        s = apply_overrides(sc, rate=rate)
        _, r = simulate_scenario(s, built=build(s))
        summ = summarize_metrics(clean(r.metrics))
        good = meets_slo({"status": "ok", "summary": summ}, ttft_s, tpot_s, percentile)
        window = getattr(s.workload, "duration_s", None)
        if hold and window:
            st = steady({"status": "ok", "quarters": arrival_quarters(r, window)}, ttft_s, tpot_s, percentile,
                        window_s=window, output_tokens=out_mean)
            summ["steady"] = st
            if good and not st["ok"]:  # the trend decides nothing: a run HOLD_WINDOWS x as long does
                s = apply_overrides(s, duration_s=HOLD_WINDOWS * window)
                _, r = simulate_scenario(s, built=build(s))
                summ = {**summarize_metrics(clean(r.metrics)), "steady": st, "window_s": HOLD_WINDOWS * window}
                good = meets_slo({"status": "ok", "summary": summ}, ttft_s, tpot_s, percentile)
        tried.append((rate, good, summ))
        return good

    wl = sc.workload
    r = start or getattr(getattr(wl, "arrival", None), "rate_per_s", None) or getattr(wl, "rate_per_s", None) or 1.0
    lo, hi = None, None
    for _ in range(max_doublings):
        if ok(r):
            lo, r = r, r * 2
        else:
            hi = r
            break
    if lo is None:  # even the first rate misses: halve down
        for _ in range(max_doublings):
            r /= 2
            if ok(r):
                lo = r
                break
            hi = r
    if lo is not None and hi is not None:
        for _ in range(steps):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    rec = next((s for rate, good, s in tried if good and rate == lo), None)
    return MaxRate(lo, rec, tried)
