"""One SimPy process per worker, running the shared worker loop; wake-ups, new workers and faults.

Each process runs :func:`engine.core.worker_loop.worker_loop` (the generator the real driver runs too) and
resolves what it yields: a work plan becomes ``env.timeout(executor.duration(plan, now))`` — or, with a real
executor, the completion event it returns, whose value is the measured duration — interrupted by a fault; a
:class:`~engine.core.plans.Failed` answer (or event value) fails the plan after its duration, an
:class:`~engine.core.plans.Accepted` one completes it with the real MTP outcomes (``Result.accepted``); an
:class:`~engine.core.plans.Idle` becomes a wait on the worker's wake-up event with an optional timer. After every
resumption the scheduler's wake-ups go to the idle workers named and every new (scaled-up) worker gets a process
(:meth:`WorkerProcesses.flush`). SimPy orders simultaneous events by (time, priority, insertion), so a run is a
deterministic function of its inputs.

With the simulated environment a fast path (:mod:`sim.fastpath`) takes part: it runs some workers without a
process (:meth:`~sim.fastpath.FastPath.start_worker`), and a decoder's step on a *lane* ends in the main loop,
which goes on stepping the decoder; the process resumes only when the scheduler answers Idle/Stop at a step's end
(the lane hands that answer over) or a fault interrupts the step (its plan is built then).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import simpy

from rackbed.engine.core.plans import (
    Accepted,
    DecodeStep,
    Failed,
    Idle,
    KvTransfer,
    MixedStep,
    PrefillBatch,
    Result,
)
from rackbed.engine.core.worker_loop import worker_loop
from rackbed.sim.faults import Fault

#: span kinds in ``SimResult.spans``
SPAN_PREFILL, SPAN_KV, SPAN_DECODE, SPAN_MIXED = 0, 1, 2, 3


class _Restart:
    """The scheduler already has a plan's outcome: the worker's loop goes on with a fresh generator, from ``first``
    (what ``next`` answered meanwhile) or, when None, from a call of ``next``."""

    __slots__ = ("first",)

    def __init__(self, first) -> None:
        self.first = first


class WorkerProcesses:
    """The workers' SimPy processes of one run. ``duration(plan, now)``: the executor's (seconds, or a completion
    event); ``spans``: the run's span list; :attr:`fast`: the run's fast path, if any (set after construction)."""

    def __init__(self, sched, env, duration: Callable, spans: list, *, debug_checks: bool) -> None:
        self.sched = sched
        self.env = env
        self.duration = duration
        self.add_span = spans.append
        self.debug_checks = debug_checks
        self.wake_ev: dict[str, simpy.Event] = {}   # idle workers' wake-up events
        self.procs: dict[str, simpy.Process] = {}
        self.fast = None
        self.faults_pending = 0   # fault injections and recoveries still to come (the watchdog waits for them)
        self.clock = lambda: env.now
        self.flush = self._flusher()

    def _flusher(self) -> Callable[[], None]:
        """``flush()``: hand the scheduler's wake-ups to the idle workers named, start every new worker (a closure:
        the driver calls it after every scheduling call)."""
        sched = self.sched
        wake_ev = self.wake_ev
        start_worker = self.start_worker
        debug_checks = self.debug_checks

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

        return flush

    def start_worker(self, wid: str) -> None:
        """``env.process(run_worker(wid))``, unless the fast path runs the worker itself."""
        if self.fast is None or not self.fast.start_worker(wid):
            self.procs[wid] = self.env.process(self.run_worker(wid))

    def run_worker(self, wid: str):
        """The process of worker ``wid``."""
        sched = self.sched
        first = None
        while True:  # one worker loop per (re)start
            gen = worker_loop(sched, wid, self.clock, first=first)
            try:
                plan = next(gen)
            except StopIteration:
                return
            self.flush()
            while True:
                if type(plan) is Idle:
                    result = yield from self._idle(wid, plan)
                else:
                    result = yield from self._work(wid, plan)
                    if type(result) is _Restart:
                        break
                try:
                    plan = gen.send(result)
                except StopIteration:
                    return
                if sched.wakeups or sched.new_workers or self.debug_checks:
                    self.flush()
            gen.close()
            first = result.first

    def _idle(self, wid: str, plan: Idle):
        """Wait for a wake-up (or the plan's timer): the Idle plan's result."""
        env = self.env
        t0 = env.now
        ev = env.event()
        self.wake_ev[wid] = ev
        if plan.until_s is not None:
            tmo = env.timeout(max(plan.until_s - t0, 0.0))
            tmo.callbacks.append(lambda _e, ev=ev: None if ev.triggered else ev.succeed(False))
        woken = yield ev
        if self.wake_ev.get(wid) is ev:
            del self.wake_ev[wid]
        return Result(env.now - t0, woken=bool(woken))

    def _work(self, wid: str, plan):
        """Run a work plan: its result (failed when a fault interrupts it), or a :class:`_Restart` when the
        scheduler was told its outcome already (a decoder step on a lane)."""
        env = self.env
        t0 = env.now
        dur = self.duration(plan, t0)
        lane = None
        try:
            if type(dur) is not float:  # a real executor's completion event: its value is the measured duration
                if type(dur) is Failed or type(dur) is Accepted:   # replayed: it takes its time, then ends so
                    yield env.timeout(dur.duration_s)
                    done_value = dur
                else:
                    done_value = yield dur
                if type(done_value) is Failed:
                    result = Result(done_value.duration_s, failed=done_value.reason)
                elif type(done_value) is Accepted:
                    result = Result(done_value.duration_s, accepted=done_value.accepted)
                else:
                    dur, accepted = done_value if type(done_value) is tuple else (done_value, None)
                    result = Result(dur, accepted=accepted)
            elif type(plan) is DecodeStep and self.fast is not None and (st := self.fast.start_step(wid, plan, t0,
                                                                                                   dur)):
                tmo, lane = st
                try:
                    yield tmo  # resumed only when a step's end stopped the decoder (or by a fault)
                finally:
                    self.fast.untick(tmo)
                self.add_span((wid, SPAN_DECODE, lane.start_s, lane.dur_s, lane.step, False))
                first, lane.handoff = lane.handoff, None  # what next() answered at that step's end
                lane.virtual = False
                return _Restart(first)
            else:
                yield env.timeout(dur)
                result = Result(dur)
            failed = result.failed is not None
        except simpy.Interrupt as intr:
            if lane is not None and lane.virtual:
                return self._interrupted_on_lane(wid, lane, intr)
            result = Result(env.now - t0, failed=str(intr.cause))
            failed = True
        tp = type(plan)
        if tp is DecodeStep:
            self.add_span((wid, SPAN_DECODE, t0, result.duration_s, plan.step, failed))
        elif tp is PrefillBatch:
            self.add_span((wid, SPAN_PREFILL, t0, result.duration_s, plan.n_tokens, failed))
        elif tp is KvTransfer:
            self.add_span((wid, SPAN_KV, t0, result.duration_s, plan.request_id, failed))
        elif tp is MixedStep:
            self.add_span((wid, SPAN_MIXED, t0, result.duration_s, plan.step, failed))
        return result

    def _interrupted_on_lane(self, wid: str, lane, intr) -> _Restart:
        """A fault interrupted a step the main loop started: its plan is built now and the scheduler told."""
        sched = self.sched
        now = self.env.now
        result = Result(now - lane.start_s, failed=str(intr.cause))
        plan = sched.decode_plan(wid)
        self.add_span((wid, SPAN_DECODE, lane.start_s, result.duration_s, plan.step, True))
        lane.virtual = False
        sched.done(plan, result, now)
        return _Restart(None)

    # ------------------------------------------------------------------ faults
    def _report(self) -> None:
        if self.fast is not None:
            self.fast.report()  # plain decode steps, before the scheduler is told of a fault

    def _interrupt(self, aborted: Iterable[str], cause: str) -> None:
        for wid in dict.fromkeys(aborted):
            p = self.procs.get(wid)
            if p is not None and p.is_alive and wid not in self.wake_ev:
                p.interrupt(cause)

    def inject_fault(self, target: str) -> None:
        """Fail ``target`` now for good (a fault detected at run time, e.g. a dead worker process); ignored once
        the scheduler has finished, as :meth:`fault_process` ignores a fault due then (so a real run and its
        replay log the same)."""
        if self.sched.finished:
            return
        self._report()
        self._interrupt(self.sched.fail(target, self.env.now, permanent=True), target)
        self.flush()

    def fault_process(self, faults: list[Fault], until_s: float | None):
        """The process that injects ``faults`` at their times (and recovers those with a duration)."""
        env = self.env
        sched = self.sched
        self.faults_pending += len(faults)
        for f in faults:
            if until_s is not None and f.at_s > until_s:
                break
            if f.at_s > env.now:
                yield env.timeout(f.at_s - env.now)
            if sched.finished:
                return
            self._report()
            self._interrupt(sched.fail(f.target, env.now, permanent=f.duration_s is None), f.target)
            self.flush()
            self.faults_pending -= 1
            if f.duration_s is not None:
                self.faults_pending += 1
                env.process(self._recover_later(f))

    def _recover_later(self, f: Fault):
        yield self.env.timeout(f.duration_s)
        self.faults_pending -= 1
        self._report()
        self.sched.recover(f.target, self.env.now)
        self.flush()
