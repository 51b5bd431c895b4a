"""The SimPy driver: one process per worker running the shared worker loop, an arrival process, a fault process.

    result = simulate(deployment, requests, cost_model, seed=0)
    sim.outputs.write_all(result, "out/")

Each worker process runs :func:`engine.core.worker_loop.worker_loop` (the generator the real driver runs too) and
resolves what it yields: a work plan becomes ``env.timeout(executor.duration(plan, now))`` (interrupted by a
fault), an :class:`~engine.core.plans.Idle` becomes a wait on the worker's wake-up event with an optional timer.
After every resumption the driver hands the scheduler's wake-ups to the idle workers named and starts a process
for every new (scaled-up) worker. SimPy orders simultaneous events by (time, priority, insertion), so a run is a
deterministic function of (deployment, requests, cost model, seed, faults).

**Fast path.** With the simulated environment and executor, the events that need no SimPy process run in the main
loop (:mod:`sim.fastpath`): a decoder's step ends complete and start steps through the scheduler without resuming
its process (when the cost model has ``decode_point`` and the policies are certified), and in a run without
faults prefillers, KV streams and the autoscaler have no process at all (their entries sit in SimPy's queue where
their processes' events would). The queue, and with it every decision and the event count, evolves as with one
process per worker; ``fast_decode=False`` runs every worker as a process (``tests/test_sim_driver_fastdecode.py``,
``test_sim_driver_lazydecode.py``, ``test_sim_speed.py`` check both give identical results). This reaches into
the event queue of :class:`sim.simenv.SimEnv` (SimPy's environment with a queue and clock of its own).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from math import nextafter

import numpy as np
import simpy

from engine.core.autoscaler import AutoscalerConfig
from engine.core.decision_log import DecisionLog
from engine.core.deployment import Deployment, PrefillerGroup
from engine.core.metrics import Slo, summarize
from engine.core.plans import DecodeStep, Idle, KvTransfer, PrefillBatch, Result
from engine.core.policies import Policies
from engine.core.request import Request
from engine.core.scheduler import KvChunks, Scheduler
from engine.core.state import ROW_FIELDS, Sample
from engine.core.worker_loop import worker_loop
from sim import fastpath
from sim.executor import CostModel, Executor
from sim.faults import Fault, parse_faults
from sim.network import Network
from sim.simenv import SimEnv

#: span kinds in ``SimResult.spans``
SPAN_PREFILL, SPAN_KV, SPAN_DECODE = 0, 1, 2
SPAN_NAMES = ("prefill", "kv_transfer", "decode")

#: the cyclic collector's young-generation threshold during a run with a real environment (see ``simulate``)
_GC_GEN0 = 100_000
#: events between two collections of the young generations while the collector is off (see ``simulate``)
_GC_EVERY = 1 << 22


def _gc_pause(off: bool) -> tuple:
    """The cyclic collector's settings for a run: off (``off``) or with a larger young-generation threshold.
    Returns what :func:`_gc_resume` needs to restore them."""
    state = (off, gc.isenabled(), gc.get_threshold())
    if off:
        gc.disable()
    else:
        th = state[2]
        gc.set_threshold(max(th[0], _GC_GEN0), *th[1:])
    return state


def _gc_resume(state: tuple) -> None:
    """Undo :func:`_gc_pause`. After a run with the collector off, the objects made since are moved to the oldest
    generation without a traversal (``gc.freeze`` then ``gc.unfreeze``; skipped when the process keeps frozen
    objects of its own), where the oldest generation's next collection examines them as before, so that the
    young generations' next collection does not traverse everything the run kept."""
    off, was_enabled, th = state
    if off:
        if gc.get_freeze_count() == 0:
            gc.freeze()
            gc.unfreeze()
        if was_enabled:
            gc.enable()
    else:
        gc.set_threshold(*th)


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
    policies:  the scheduler's policies (:class:`~engine.core.policies.Policies`; default: the reference rules).
    """
    t_wall0 = time.perf_counter()
    fault_list = parse_faults(faults)
    if until_s is not None and not until_s > 0:
        raise ValueError(f"until_s: must be > 0, got {until_s}")
    if isinstance(requests, Sequence):
        head = requests[:1000]
        n_total: int | None = len(requests)
    else:
        head = []
        n_total = None
    mean_prompt = round(float(np.mean([r.prompt_tokens for r in head]))) if head else 4096
    if prefill_tokens_per_s is None and deployment.prefillers:
        caps: dict[int, float] = {}

        def cap_of(g: PrefillerGroup) -> float:
            key = id(g.template)
            if key not in caps:
                caps[key] = _prefill_capacity(cost_model, g, mean_prompt)
            return caps[key]

        ptps = cap_of
    else:
        ptps = prefill_tokens_per_s
    if sample_interval_s is None:
        horizon = until_s if until_s is not None else (head[-1].arrival_s if head else 60.0)
        sample_interval_s = max(horizon / 400.0, 0.01)

    rng = np.random.default_rng(seed)
    sched = Scheduler(deployment, rng, prefill_tokens_per_s=ptps, kv_chunks=kv_chunks, autoscaler=autoscaler,
                      sample_interval_s=sample_interval_s, log=DecisionLog(enabled=decision_log), policies=policies)
    for f in fault_list:
        sched.check_target(f.target)
    env = env if env is not None else SimEnv()
    net = Network(deployment.nic_GBps)
    ex = (executor_factory or Executor)(cost_model, net, sched.group)
    duration = ex.duration
    spans: list[tuple] = []
    add_span = spans.append
    wake_ev: dict[str, simpy.Event] = {}
    procs: dict[str, simpy.Process] = {}
    clock = lambda: env.now
    timeout = env.timeout
    event = env.event

    def flush() -> None:
        if debug_checks:
            sched.check_invariants()
        if sched.wakeups:
            for wid in sched.take_wakeups():
                ev = wake_ev.pop(wid, None)
                if ev is not None and not ev.triggered:
                    ev.succeed(True)
        if sched.new_workers:
            for wid in sched.take_new_workers():
                start_worker(wid)

    # decode_point must be the cost model's own (a class attribute): a wrapper that delegates unknown attributes
    # to a wrapped model (``__getattr__``) and changes ``decode`` would otherwise be bypassed
    cm_point = getattr(cost_model, "decode_point", None) if hasattr(type(cost_model), "decode_point") else None
    # The fast path (sim.fastpath): only with the simulated environment and executor. Decode lanes need a cost model
    # that prices a decode step from its busiest rank (decode_point) and certified policies; direct workers a run
    # without faults (nothing interrupts them).
    fp: fastpath.FastPath | None = None
    if fast_decode and type(ex) is Executor and type(env) is SimEnv:
        fp = fastpath.FastPath(
            sched, env, duration, spans, ex.breakdown_s["decode"], wake_ev, flush,
            cm_point=cm_point if fastpath.certified(sched.policies) else None, direct=not fault_list,
            lazy=not decision_log and not debug_checks, debug_checks=debug_checks)

    def run_worker(wid: str):
        gen = worker_loop(sched, wid, clock)
        try:
            plan = next(gen)
        except StopIteration:
            return
        flush()
        send = gen.send
        lane = None
        while True:
            tp = type(plan)
            if tp is Idle:
                t0 = env.now
                ev = event()
                wake_ev[wid] = ev
                if plan.until_s is not None:
                    tmo = timeout(max(plan.until_s - t0, 0.0))
                    tmo.callbacks.append(lambda _e, ev=ev: None if ev.triggered else ev.succeed(False))
                woken = yield ev
                if wake_ev.get(wid) is ev:
                    del wake_ev[wid]
                result = Result(env.now - t0, woken=bool(woken))
            else:
                t0 = env.now
                dur = duration(plan, t0)
                try:
                    if type(dur) is float:
                        if fp is not None and tp is DecodeStep and (st := fp.start_step(wid, plan, t0, dur)):
                            # the main loop completes this step and may run the next ones on the same event
                            # (sim.fastpath); the process resumes when a step's end stops the decoder
                            tmo, lane = st
                            try:
                                yield tmo
                            finally:
                                fp.untick(tmo)
                            add_span((wid, SPAN_DECODE, lane.start_s, lane.dur_s, lane.step, False))
                            plan, lane.handoff = lane.handoff, None  # what next() answered (Idle/Stop)
                            lane.virtual = False
                            gen.close()
                            gen = worker_loop(sched, wid, clock, first=plan)
                            send = gen.send
                            try:
                                plan = next(gen)
                            except StopIteration:
                                return
                            if sched.wakeups or sched.new_workers or debug_checks:
                                flush()
                            continue
                        else:
                            yield timeout(dur)
                        result = Result(dur)
                    else:  # a real executor's completion event: its value is the measured duration
                        done_value = yield dur
                        dur, accepted = done_value if type(done_value) is tuple else (done_value, None)
                        result = Result(dur, accepted=accepted)
                    failed = False
                except simpy.Interrupt as intr:
                    if lane is not None and lane.virtual:
                        t0 = lane.start_s
                    result = Result(env.now - t0, failed=str(intr.cause))
                    failed = True
                if tp is DecodeStep:
                    if lane is not None and lane.virtual:
                        # the step interrupted was started by the main loop: its plan is built now; the
                        # worker's loop goes on with a fresh generator (its first call is next(), as after done())
                        plan = sched.decode_plan(wid)
                        add_span((wid, SPAN_DECODE, t0, result.duration_s, plan.step, failed))
                        lane.virtual = False
                        sched.done(plan, result, env.now)
                        gen.close()
                        gen = worker_loop(sched, wid, clock)
                        send = gen.send
                        try:
                            plan = next(gen)
                        except StopIteration:
                            return
                        if sched.wakeups or sched.new_workers or debug_checks:
                            flush()
                        continue
                    add_span((wid, SPAN_DECODE, t0, result.duration_s, plan.step, failed))
                elif tp is PrefillBatch:
                    add_span((wid, SPAN_PREFILL, t0, result.duration_s, plan.n_tokens, failed))
                elif tp is KvTransfer:
                    add_span((wid, SPAN_KV, t0, result.duration_s, plan.request_id, failed))
            try:
                plan = send(result)
            except StopIteration:
                return
            if sched.wakeups or sched.new_workers or debug_checks:
                flush()

    def start_worker(wid: str) -> None:
        """``env.process(run_worker(wid))``, unless the fast path runs the worker itself."""
        if fp is None or not fp.start_worker(wid):
            procs[wid] = env.process(run_worker(wid))

    def report_plain() -> None:
        if fp is not None:
            fp.report()

    def recover_later(f: Fault):
        yield timeout(f.duration_s)
        report_plain()
        sched.recover(f.target, env.now)
        flush()

    def inject_fault(target: str) -> None:
        """Fail ``target`` now (used for faults detected at run time, e.g. a dead worker process)."""
        report_plain()
        aborted = sched.fail(target, env.now, permanent=True)
        for wid in dict.fromkeys(aborted):
            p = procs.get(wid)
            if p is not None and p.is_alive and wid not in wake_ev:
                p.interrupt(target)
        flush()

    if hasattr(env, "on_fault"):
        env.on_fault = inject_fault

    def fault_proc():
        for f in fault_list:
            if until_s is not None and f.at_s > until_s:
                break
            if f.at_s > env.now:
                yield timeout(f.at_s - env.now)
            if sched.finished:
                return
            report_plain()
            aborted = sched.fail(f.target, env.now, permanent=f.duration_s is None)
            seen = set()
            for wid in aborted:
                if wid in seen:
                    continue
                seen.add(wid)
                p = procs.get(wid)
                if p is not None and p.is_alive and wid not in wake_ev:
                    p.interrupt(f.target)
            flush()
            if f.duration_s is not None:
                env.process(recover_later(f))

    for wid in sched.worker_ids():
        start_worker(wid)
    if fault_list:
        env.process(fault_proc())

    # ---- run, with a progress bar once it takes more than a second
    # Arrivals are merged into the event loop instead of being a process: before the next event, every
    # request arriving no later is handed to the scheduler at its arrival time (one SimPy event less per request;
    # arrivals at time t go before the other events at t).
    n_events = 0
    inf = float("inf")
    bar = None
    task = None
    step = env.step
    peek = env.peek
    sim_env = type(env) is SimEnv
    end = float("inf") if until_s is None else until_s
    next_check = 4096
    arrival_iter = iter(requests)
    nxt = next(arrival_iter, None)
    last_arrival = 0.0
    arrive = sched.arrive
    # The run allocates a few container objects per event and keeps many (spans, rows): CPython's default
    # young-generation threshold (700) makes the cyclic collector run every few events and, every so often, rescan
    # everything the run keeps. A larger threshold for the run only (restored after) saved ~5-9 % of a long run's
    # CPU time in A/B runs; reference counting frees everything that is not in a cycle as before.
    # With the simulated environment the collector is off for the run instead (a bench hour makes no more than a
    # few hundred objects of cyclic garbage, in setup mostly) and what the run kept goes straight to the oldest
    # generation at the end (_gc_resume), never traversed as young objects (~5 % of a bench hour's CPU time);
    # every _GC_EVERY events a collection of the young generations frees whatever cycles a long run made.
    gc_state = _gc_pause(sim_env)
    gc_next = _GC_EVERY
    end_x = nextafter(end, inf)  # t > end  <=>  t >= end_x

    # the time of the next event: the fast path's (SimPy's queue or the decoders' lq), else the environment's
    # (a real environment's peek waits for work)
    gpeek = fp.next_time if fp is not None else peek

    queue = env.queue if fp is not None else None
    lq = fp.lq if fp is not None else []
    try:
        while True:
            if fp is not None:  # gpeek(), inline
                t = queue[0][0] if queue else inf
                if lq and lq[0][0] < t:
                    t = lq[0][0]
            else:
                t = peek()
            while nxt is not None and nxt.arrival_s <= t:
                ta = nxt.arrival_s
                if ta < last_arrival:
                    raise ValueError(
                        f"requests: not sorted by arrival_s (request {nxt.id} at {ta} after {last_arrival})")
                if ta > end:
                    nxt = None
                    break
                last_arrival = ta
                env.advance(ta)
                arrive(nxt, ta)
                flush()
                nxt = next(arrival_iter, None)
                t = gpeek()
            if nxt is None and not sched.closed:
                sched.close_arrivals(env.now)
                flush()
                t = gpeek()
            if t > end or t == inf:
                break
            # the fast path's events, as long as they come first and before the next arrival and the end
            k = fp.run(min(end_x, nxt.arrival_s if nxt is not None else inf)) if fp is not None else 0
            if k:
                n_events += k
            else:  # SimPy's next event
                step()
                n_events += 1
            if n_events >= next_check:
                next_check += 4096
                if n_events >= gc_next and gc_state[0]:  # the collector is off: a collection now and then
                    gc_next = n_events + _GC_EVERY
                    gc.collect(1)
                if progress:
                    el = time.perf_counter() - t_wall0
                    if bar is None and el > 1.0:
                        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

                        bar = Progress(TextColumn("[bold]simulating"), BarColumn(),
                                       TextColumn("{task.completed:,.0f}/{task.total:,.0f} {task.fields[unit]}"),
                                       TextColumn("sim t={task.fields[t]:.1f}s"), TimeElapsedColumn(),
                                       transient=True)
                        bar.start()
                        if n_total is not None:
                            task = bar.add_task("sim", total=n_total, unit="requests", t=env.now)
                        else:
                            task = bar.add_task("sim", total=until_s or 0.0, unit="sim-s", t=env.now)
                    if bar is not None:
                        done_n = len(sched.rows) if n_total is not None else env.now
                        bar.update(task, completed=done_n, t=env.now)
    except BaseException:
        _gc_resume(gc_state)
        raise
    finally:
        if bar is not None:
            bar.stop()
    try:
        report_plain()
        sim_end = until_s if until_s is not None else env.now
        if until_s is not None:
            sched.finalize(until_s)
        else:  # open requests with nothing left to happen would be a scheduler bug: made visible as "stalled"
            sched.finalize(env.now, reason="stalled")
        metrics = summarize(
            sched.rows, ROW_FIELDS, duration_s=sim_end, slo=slo, groups=sched.groups(),
            busy_gpu_s=sched.busy_gpu_s, step_durations=sched.step_durations, decode_tokens=sched.decode_tokens,
            draft_k=deployment.mtp.draft_k, accept_p=deployment.mtp.accept_p)
    finally:
        _gc_resume(gc_state)
    wall = time.perf_counter() - t_wall0
    n_fast = fp.n_fast if fp is not None else 0
    perf = {"wall_s": wall, "events": n_events, "fast_decode_steps": n_fast, "events_per_s": n_events / max(wall, 1e-9),
            "sim_s_per_wall_s": sim_end / max(wall, 1e-9), "decode_steps": sched.decode_steps,
            "decode_steps_per_wall_s": sched.decode_steps / max(wall, 1e-9), "decisions": len(sched.log)}
    return SimResult(
        deployment=deployment, seed=seed, sim_end_s=sim_end, rows=sched.rows, row_fields=ROW_FIELDS,
        log=sched.log, samples=sched.samples, spans=spans, groups=sched.groups(), metrics=metrics,
        breakdown_s=ex.breakdown(), nic_utilisation=net.utilisation(sim_end), perf=perf)
