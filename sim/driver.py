"""The simulator: :func:`simulate` runs a deployment on the scheduler, a cost model and the network, in SimPy.

    result = simulate(deployment, requests, cost_model, seed=0)
    sim.outputs.write_all(result, "out/")

The parts: :class:`~engine.core.scheduler.Scheduler` decides, :class:`sim.executor.Executor` prices plans (cost
model + :class:`sim.network.Network`), :mod:`sim.processes` runs one SimPy process per worker (the shared worker
loop) and injects faults, :mod:`engine.loop.runloop` merges arrivals with the events until the end — the same loop the
real engine runs with a measured clock (``engine.real.driver`` passes its environment and executor) — and, with
the simulated environment (:class:`engine.loop.simenv.SimEnv`) and executor, :mod:`sim.fastpath` runs the events that
need no SimPy process in the main loop: decoder steps (when the cost model has ``decode_point`` and the policies are
certified) and, in a run without faults, the prefillers, KV streams and autoscaler. The event queue, and with it
every decision and the event count, evolves as with one process per worker; ``fast_decode=False`` runs every
worker as a process (``tests/test_sim_driver_fastdecode.py``, ``test_sim_driver_lazydecode.py``,
``test_sim_speed.py`` check both give identical results). A run is a deterministic function of (deployment,
requests, cost model, seed, faults, policies).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import simpy

from rackbed.engine.core.autoscaler import AutoscalerConfig
from rackbed.engine.core.decision_log import DecisionLog
from rackbed.engine.core.deployment import Deployment, PrefillerGroup
from rackbed.engine.core.metrics import Slo, summarize
from rackbed.engine.core.plans import PrefillBatch
from rackbed.engine.core.policies import Policies
from rackbed.engine.core.prefix_cache import PrefixCacheSpec
from rackbed.engine.core.request import Request
from rackbed.engine.core.scheduler import KvChunks, Scheduler
from rackbed.engine.core.state import ROW_FIELDS, Sample
from rackbed.engine.core.workload import ClosedLoop
from rackbed.engine.loop.runloop import Progress, collector_paused, run_loop
from rackbed.engine.loop.simenv import SimEnv
from rackbed.engine.loop.watchdog import STALL_EVENTS, STALL_S, Watchdog
from rackbed.sim import fastpath
from rackbed.sim.executor import CostModel, Executor
from rackbed.sim.faults import Fault, parse_faults
from rackbed.sim.network import Network
from rackbed.sim.processes import SPAN_DECODE, SPAN_KV, SPAN_MIXED, SPAN_PREFILL, WorkerProcesses

#: span kinds in ``SimResult.spans``: SPAN_PREFILL, SPAN_KV, SPAN_DECODE, SPAN_MIXED (0, 1, 2, 3)
SPAN_NAMES = ("prefill", "kv_transfer", "decode", "mixed")
__all__ = ["SPAN_DECODE", "SPAN_KV", "SPAN_MIXED", "SPAN_NAMES", "SPAN_PREFILL", "SimResult", "simulate"]


@dataclass
class SimResult:
    """Everything a run produced. ``metrics`` is deterministic for a seed; ``perf`` (wall time) is not.

    rows:    one tuple per request (fields :data:`engine.core.state.ROW_FIELDS`), in resolution order.
    spans:   ``(worker, kind, start_s, dur_s, arg, failed)`` per executed plan (kind: SPAN_*; arg: tokens for
             prefill, request id for KV, step number for decode), in completion order.
    samples: timeline (GPUs per role, requests per stage).
    groups:  ``(id, role, n_gpus, created_s, ended_s, status)`` of every group.
    """

    deployment: Deployment
    seed: int
    sim_end_s: float
    rows: list[tuple]
    row_fields: tuple[str, ...]
    log: DecisionLog
    samples: list[Sample]
    spans: list[tuple]
    groups: list[tuple]
    metrics: dict
    breakdown_s: dict
    nic_utilisation: dict
    perf: dict = field(default_factory=dict)


def _prefill_capacity(cm: CostModel, group: PrefillerGroup, mean_prompt: int) -> float:
    """Sustained prefill tokens/s of a group: full token-budget batches of mean-length prompts."""
    budget = group.template.max_batch_tokens
    per = max(1, min(mean_prompt, budget))
    n = max(1, budget // per)
    items = tuple((-1 - i, 0, per) for i in range(n))
    st = cm.prefill(PrefillBatch(group.id, 0, items, n * per), group)
    return n * per / max(st.total_s, 1e-12)


def simulate(
    deployment: Deployment,
    requests: Iterable[Request],
    cost_model: CostModel,
    *,
    seed: int,
    faults: Iterable[Fault | dict] = (),
    autoscaler: AutoscalerConfig | None = None,
    until_s: float | None = None,
    progress: bool = True,
    slo: Slo | None = None,
    kv_chunks: KvChunks | None = None,
    prefill_tokens_per_s: float | None = None,
    sample_interval_s: float | None = None,
    debug_checks: bool = False,
    decision_log: bool = True,
    fast_decode: bool = True,
    env: simpy.Environment | None = None,
    executor_factory=None,
    policies: Policies | None = None,
    closed_loop: ClosedLoop | None = None,
    stall_s: float | None = STALL_S,
    stall_events: int | None = STALL_EVENTS,
    prefix_cache: PrefixCacheSpec | None = None,
) -> SimResult:
    """Simulate ``deployment`` serving ``requests`` (sorted by arrival; a list or a lazy iterator).

    seed:      seeds the scheduler's RNG (MTP acceptance draws).
    faults:    :class:`~sim.faults.Fault` or ``{at_s, target, duration_s?}`` dicts.
    until_s:   stop the clock there (requests still open are rejected with reason ``horizon``); None runs until
               every request is resolved.
    progress:  show a rich progress bar once the run has taken more than a second of wall time.
    prefill_tokens_per_s: one prefiller's capacity for the autoscaler / TTFT shedding; default from the cost
               model (full budget batches of the mean prompt of the first 1000 requests, or 4096 tokens).
    debug_checks: assert the scheduler's invariants after every scheduling call (slow; for tests).
    decision_log: keep the decision log (False for long benchmark runs; decisions are the same).
    fast_decode: run what needs no SimPy process without one (:mod:`sim.fastpath`); the result is the same either
               way (False is for the tests that check so).
    env, executor_factory: another environment (with ``advance(t)``) and ``(cost_model, network, group_of) ->
               executor`` (the real engine's measured clock and ranks; the fast path is then off).
    policies:  the scheduler's policies (:class:`~engine.core.policies.Policies`; default: the reference rules).
    closed_loop: at most that many requests in flight (:class:`~engine.core.workload.ClosedLoop`; the workload's
               ``closed_loop()``); runs every worker as a process (a send follows the event that resolves one).
    stall_s, stall_events: the watchdog's limits (:mod:`engine.loop.watchdog`): with requests open and no progress
               for that many simulated seconds (while no fault or recovery is still to come) or events, the run
               raises :class:`~engine.loop.watchdog.Stalled` naming the stuck component; None switches a limit off.
               A run that ends with requests open and nothing left to happen rejects them ``stalled``.
    prefix_cache: a prefix cache per prefiller / aggregated worker (:class:`~engine.core.prefix_cache.
               PrefixCacheSpec`; None: off); copies from a lower tier lengthen the batch that waits for them
               (``PrefixCacheSpec.load_s``) and ``metrics["prefix_cache"]`` counts hits.
    """
    t_wall0 = time.perf_counter()
    fault_list = parse_faults(faults)
    if until_s is not None and not until_s > 0:
        raise ValueError(f"until_s: must be > 0, got {until_s}")
    head = requests[:1000] if isinstance(requests, Sequence) else []
    if deployment.aggregated and autoscaler is not None:
        raise ValueError("autoscaler: aggregated workers are not autoscaled")
    ptps = prefill_tokens_per_s
    if ptps is None and deployment.prefillers:
        ptps = _prefill_rate(cost_model, head)
    if sample_interval_s is None:
        horizon = until_s if until_s is not None else (head[-1].arrival_s if head else 60.0)
        sample_interval_s = max(horizon / 400.0, 0.01)
    sched = Scheduler(deployment, np.random.default_rng(seed), prefill_tokens_per_s=ptps, kv_chunks=kv_chunks,
                      autoscaler=autoscaler, sample_interval_s=sample_interval_s,
                      log=DecisionLog(enabled=decision_log), policies=policies, prefix_cache=prefix_cache)
    for f in fault_list:
        sched.check_target(f.target)
    env = env if env is not None else SimEnv()
    share = getattr(cost_model, "ep_nic_share", None)  # the EP all-to-all's share of NICs across nodes
    net = Network(deployment.nic_GBps, share(deployment) if callable(share) else None)
    ex = (executor_factory or Executor)(cost_model, net, sched.group)
    if prefix_cache is not None:
        ex.load_s = lambda loads, g: prefix_cache.load_s(loads, len(g.gpus))
    spans: list[tuple] = []
    procs = WorkerProcesses(sched, env, ex.duration, spans, debug_checks=debug_checks)
    sim_env = type(env) is SimEnv
    if fast_decode and sim_env and type(ex) is Executor and closed_loop is None and fastpath.handles(deployment):
        procs.fast = _fast_path(sched, env, ex, cost_model, spans, procs, direct=not fault_list,
                                lazy=not decision_log and not debug_checks, debug_checks=debug_checks)
    if hasattr(env, "on_fault"):
        env.on_fault = procs.inject_fault
    for wid in sched.worker_ids():
        procs.start_worker(wid)
    if fault_list:
        env.process(procs.fault_process(fault_list, until_s))
    bar = Progress(t_wall0, len(requests) if isinstance(requests, Sequence) else None, until_s) if progress else None
    dog = None
    if stall_s is not None or stall_events is not None:
        dog = Watchdog(sched, stall_s=stall_s, stall_events=stall_events, pending=lambda: procs.faults_pending)
    with collector_paused(sim_env) as collector_off:
        n_events = run_loop(env, sched, requests, until_s=until_s, flush=procs.flush, fast=procs.fast,
                            collect=collector_off, progress=bar, closed_loop=closed_loop, watchdog=dog)
        if procs.fast is not None:
            procs.fast.report()
        sim_end = until_s if until_s is not None else env.now
        # open requests with nothing left to happen would be a scheduler bug: made visible as "stalled"
        sched.finalize(sim_end, reason="horizon" if until_s is not None else "stalled")
        metrics = summarize(
            sched.rows, ROW_FIELDS, duration_s=sim_end, slo=slo, groups=sched.groups(),
            busy_gpu_s=sched.busy_gpu_s, step_durations=sched.step_durations, decode_tokens=sched.decode_tokens,
            draft_k=deployment.mtp.draft_k, accept_p=deployment.mtp.accept_p, acceptance=deployment.mtp.acceptance)
        if prefix_cache is not None:
            metrics["prefix_cache"] = prefix_cache_metrics(sched.prefix_cache_stats(), ex.load_total_s)
    wall = time.perf_counter() - t_wall0
    n_fast = procs.fast.n_fast if procs.fast is not None else 0
    perf = {"wall_s": wall, "events": n_events, "fast_decode_steps": n_fast, "events_per_s": n_events / max(wall, 1e-9),
            "sim_s_per_wall_s": sim_end / max(wall, 1e-9), "decode_steps": sched.decode_steps,
            "decode_steps_per_wall_s": sched.decode_steps / max(wall, 1e-9), "decisions": len(sched.log)}
    return SimResult(
        deployment=deployment, seed=seed, sim_end_s=sim_end, rows=sched.rows, row_fields=ROW_FIELDS,
        log=sched.log, samples=sched.samples, spans=spans, groups=sched.groups(), metrics=metrics,
        breakdown_s=ex.breakdown(), nic_utilisation=net.utilisation(sim_end), perf=perf)


def prefix_cache_metrics(st, load_s: float) -> dict:
    """``metrics["prefix_cache"]``: hit rate over prompt tokens (all tiers and per tier), prefill tokens saved,
    block traffic between tiers, and the seconds batches waited for copies up from lower tiers."""
    names = ("hbm", "host", "storage")[:st.n_tiers] if st.n_tiers <= 3 else tuple(map(str, range(st.n_tiers)))
    B = st.block_tokens
    return {
        "lookups": st.requests, "prompt_tokens": st.prompt_tokens, "block_tokens": B,
        "hit_rate_tokens": st.hit_rate_tokens, "prefill_tokens_saved": st.hit_tokens,
        "hit_tokens_by_tier": {n: h * B for n, h in zip(names, st.hit_blocks)},
        "hit_rate_by_tier": {n: (h * B / st.prompt_tokens if st.prompt_tokens else 0.0)
                             for n, h in zip(names, st.hit_blocks)},
        "query_blocks": st.query_blocks, "miss_blocks": st.miss_blocks, "inserted_blocks": st.inserted,
        "not_cached_blocks": st.not_cached,
        "demoted_blocks": dict(zip(names, st.demoted)), "promoted_blocks": dict(zip(names, st.promoted)),
        "dropped_blocks": dict(zip(names, st.dropped)), "load_wait_s": load_s,
    }


def _prefill_rate(cost_model: CostModel, head: Sequence[Request]):
    """One prefiller group's sustained prefill rate (tokens/s) as a function of the group, from the cost model:
    full token-budget batches of the mean prompt of ``head`` (4096 tokens without requests), one per template."""
    mean_prompt = round(float(np.mean([r.prompt_tokens for r in head]))) if head else 4096
    caps: dict[int, float] = {}

    def cap_of(g: PrefillerGroup) -> float:
        key = id(g.template)
        if key not in caps:
            caps[key] = _prefill_capacity(cost_model, g, mean_prompt)
        return caps[key]

    return cap_of


def _fast_path(sched, env, ex, cost_model, spans, procs, **kw) -> fastpath.FastPath:
    """The run's fast path. Decode lanes need a cost model that prices a decode step from its busiest rank
    (``decode_point``, the cost model's own: a wrapper that delegates unknown attributes through ``__getattr__``
    and changes ``decode`` would otherwise be bypassed) and policies the fast path is certified for."""
    cm_point = getattr(cost_model, "decode_point", None) if hasattr(type(cost_model), "decode_point") else None
    if not fastpath.certified(sched.policies):
        cm_point = None
    return fastpath.FastPath(sched, env, ex.duration, spans, ex.breakdown_s["decode"], procs.wake_ev, procs.flush,
                             cm_point=cm_point, **kw)
