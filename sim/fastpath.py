"""The simulator's fast path: the events that need no SimPy process, run by the main loop (:meth:`FastPath.run`).

Two kinds, both only with the simulated environment (:class:`engine.loop.simenv.SimEnv`) and executor:

**Decode lanes.** Decode steps are ~85 % of a loaded rack's events. When the cost model prices a decode step from
its busiest rank (``decode_point``, see :mod:`sim.executor`) and the scheduler's policies are certified
(:func:`certified`), a decoder's process yields its step's end as an entry of the decoders' own event heap
(``FastPath.lq``) instead of a SimPy timeout, and the main loop completes the step when that entry comes up:
:meth:`DecodeLane.advance` asks the scheduler (:meth:`~engine.core.scheduler.Scheduler.advance_decoder`: ``done``
+ ``next`` without the plan object) and, when the decoder steps on, re-schedules the *same* entry for the next step
exactly as ``env.timeout`` would (same time, priority and next insertion id), so the event queue, and with it every
decision, evolves as step by step. The process stays suspended until a step's end makes the scheduler answer
Idle/Stop (the process then takes that answer over: :attr:`DecodeLane.handoff`) or a fault interrupts it (it asks
the scheduler for the plan in flight: ``decode_plan``).

*Price memo.* A lane keeps the price of its last step and the range it holds for: the cost depends on the busiest
batch and on the longest context's bucket only (``decode_point``'s contract: the same step time for every context
from the one asked up to ``ctx_hi``), so the contexts are recomputed only when the batch changed or they may have
left that range — finishes keep the price unless the busiest batch changed or the rank that held the longest
context fell below the context priced (running requests' contexts only grow); admissions keep it while the busiest
batch is unchanged and their ranks' contexts stay <= ``ctx_hi``.

*Plain steps.* With the decision log off, a step whose completion finishes nobody, admits nobody and keeps the
price is *plain*: the main loop takes it without calling the scheduler, books its duration in completion order
(``step_durations``, ``busy_gpu_s["decode"]``, the breakdown) and reports how many it took
(:meth:`~engine.core.scheduler.Scheduler.plain_steps`) before the scheduler is next called about that decoder or a
fault (:meth:`FastPath.report`). How many of the coming steps are plain is derived from the decoder's read-only
view after each :meth:`DecodeLane.advance`; it holds while the decoder's change counter (``DecoderView.changes``)
stays where it was — a KV arrival, a drain or a failure moves it — and no sample falls due.

**Direct workers.** In a run without faults (nothing interrupts them) prefillers, KV streams and the autoscaler
have no process: their entries (:class:`DirectEvent`) sit in the environment's queue at the same time, priority
and insertion order as their processes' events would (start, timeouts, wake-up events and their timers, the
process's end), and the main loop does what the process would when one comes up.

``tests/test_sim_driver_fastdecode.py``, ``test_sim_driver_lazydecode.py``, ``test_sim_speed.py`` and
``test_fastpath.py`` check that runs with the fast path equal runs without it (``simulate(..., fast_decode=False)``):
rows, decision logs, spans, samples, metrics, breakdowns, event counts.
"""

from __future__ import annotations

from heapq import heappop, heappush, heapreplace
from itertools import repeat
from operator import add, mul

from simpy.events import NORMAL, URGENT

from rackbed.engine.core.plans import Idle, KvTransfer, PrefillBatch, Result, Stop
from rackbed.engine.core.policies import Policies
from rackbed.engine.core.state import FP
from rackbed.sim.processes import SPAN_DECODE, SPAN_KV, SPAN_PREFILL

#: events :meth:`FastPath.run` runs before it returns to the run loop (it may run a few more: a lane's plain steps)
RUN_EVENTS = 4096


def handles(deployment) -> bool:
    """Whether the fast path is certified for the deployment's kinds of worker: prefillers, KV streams, decoders
    and the autoscaler. An aggregated worker's mixed steps are run by its process, the reference path (a
    deployment with aggregated workers runs without the fast path)."""
    return not deployment.aggregated


def certified(policies: Policies) -> bool:
    """Whether the fast path gives the reference path's results under ``policies``: it skips calling the scheduler
    for steps in which a decoder's state did not change, which holds when decode admission is state-only (the
    routing policies are consulted inside scheduler calls, which the fast path makes as the reference path does)."""
    return bool(getattr(policies.admission, "state_only", False))


def step_cost(cm_point, group, draft_k: int):
    """``(max_batch, max_context_tokens) -> (dur_s, ctx_hi, parts)`` of one decoder group (parts: the StepTime's
    fields, in :data:`sim.executor._FIELDS` order) from the cost model's ``decode_point``, memoised."""

    memo: dict = {}
    last: dict[int, tuple] = {}  # max_batch -> (ctx, ctx_hi, answer) of the last point asked for that batch

    def cost(b: int, ctx: int):
        hit = last.get(b)
        if hit is not None and hit[0] <= ctx <= hit[1]:
            return hit[2]  # decode_point's contract: the same StepTime for every context from hit[0] to ctx_hi
        st, hi = cm_point(group, b, ctx, draft_k)
        parts = memo.get(st)
        if parts is None:  # one tuple per StepTime: the driver adds its fields to the breakdown
            parts = memo[st] = (st.attn_s, st.moe_gemm_s, st.a2a_s, st.allreduce_s, st.other_s)
        ans = (st.total_s, hi, parts)
        last[b] = (ctx, hi, ans)
        return ans

    return cost


class DecodeLane:
    """One decoder's step in flight as the main loop sees it, and what the lane derived from the decoder's view:
    the price of its steps and for how many more steps it holds, and how many coming steps are plain."""

    __slots__ = ("b", "cost", "dng", "dur_s", "handoff", "hi", "k", "left", "lo_fp", "ng", "parts", "plain",
                 "price", "rb", "rx", "start_s", "step", "ver", "view", "virtual", "wid")

    def __init__(self, wid: str, view, price) -> None:
        self.wid = wid
        self.view = view      # the scheduler's DecoderView of the decoder (read only)
        self.price = price    # step_cost(...) of the decoder's group
        self.ng = view.n_gpus
        self.k = 0            # plain steps taken and not yet reported (Scheduler.plain_steps)
        self.plain = 0        # completions after the step in flight that are plain while view.changes == ver
        self.ver = -1
        self.left = 0         # steps, from the one in flight, that the price below holds for (<= 0: re-price)
        self.cost = 0.0       # the price: duration, StepTime fields, and what it was taken at: the busiest batch
        self.parts = None     # b on rank rb, the longest context on rank rx (lo_fp: that context << FP) and the
        self.b = self.rb = self.rx = self.hi = self.lo_fp = 0  # end hi of the context range the price holds for
        self.start_s = self.dur_s = self.dng = 0.0  # the step in flight: start, duration, dur_s * GPUs
        self.step = 0
        self.virtual = False  # the step in flight was started by advance (its plan is not built)
        self.handoff = None   # what the scheduler answered (Idle/Stop) when a step's end stopped the decoder

    def advance(self, sched, t: float):
        """The step in flight ended at ``t``: the scheduler completes it and starts the next
        (``advance_decoder``); returns the duration of the step started (its StepTime fields: :attr:`parts`), or
        None when the decoder does not step on (its process takes :attr:`handoff` over)."""
        res = sched.advance_decoder(self.wid, self.dur_s, t)
        if res is not None:
            self.handoff = res
            return None
        v = self.view
        s = v.step
        left = self.left
        dl = v.delta  # this step's joins and leaves (None: neither)
        if left > 0 and dl is not None:
            batch = v.rank_batch
            b = self.b
            joined, gone = dl
            if batch[self.rb] != b:
                left = 0
            elif gone and v.rank_c[self.rx] + s * v.rank_rate[self.rx] < self.lo_fp:
                left = 0  # the longest context priced fell (a request on its rank finished): re-price
            elif joined:
                lim = (self.hi + 1) << FP  # contexts < lim (in fixed point) are <= hi
                rate = v.rank_rate
                c = v.rank_c
                for _, q in joined:
                    rq = rate[q]
                    x = c[q] + s * rq
                    if batch[q] > b or x >= lim:
                        left = 0
                        break
                    if rq:
                        left = min(left, -(-(lim - x) // rq))  # the steps j that keep x + j * rq < lim
        if left <= 0:
            rate = v.rank_rate
            # max over ranks of (c + s * rate) >> FP = (max of c + s * rate) >> FP, in C-level maps
            xs = list(map(add, v.rank_c, map(mul, rate, repeat(s))))
            mx = max(xs)
            m = mx >> FP
            batch = v.rank_batch
            b = max(batch)
            self.cost, hi, self.parts = self.price(b, m)
            self.b, self.rb, self.rx, self.hi, self.lo_fp = b, batch.index(b), xs.index(mx), hi, m << FP
            # every rank's context after j more steps is <= m + j * max(rate) / 2**FP + 1
            qmax = max(rate)
            left = ((max(hi - m - 1, 0) << FP) // qmax + 1) if qmax else 1 << 62
        left -= 1
        self.left = left
        heap = v.heap
        if heap:  # max(min(left, heap[0][0] - s), 0), without the calls
            f = heap[0][0] - s
            if left < f:  # noqa: PLR1730
                f = left
            self.plain = f if f > 0 else 0  # noqa: FURB136
        else:
            self.plain = left
        self.ver = v.changes
        return self.cost


#: kinds of a direct worker's queue entry (``DirectEvent.kind``)
D_DONE, D_WAKE, D_TIMER, D_INIT, D_END = 0, 1, 2, 3, 4

#: ``_new_result(Result, (dur, None, None, False))`` is ``Result(dur)`` without the NamedTuple's Python-level
#: ``__new__`` (one per direct worker's plan), checked here against the fields it fills
_new_result = tuple.__new__
if Result._fields != ("duration_s", "accepted", "failed", "woken"):  # pragma: no cover (a changed plans.Result)
    raise ImportError("rackbed.sim.fastpath: plans.Result's fields changed; update the _new_result call")


class DirectWorker:
    """A worker the main loop drives itself (no SimPy process): its plan in flight, when it began, its duration."""

    __slots__ = ("done_ev", "dur", "plan", "t0", "wid")

    def __init__(self, wid: str) -> None:
        self.wid = wid
        self.plan = None
        self.t0 = self.dur = 0.0
        self.done_ev = DirectEvent(D_DONE, self, None)


class DirectEvent:
    """A direct worker's entry in SimPy's event queue, standing where the worker's process would have put an event:
    a plan's end (the process's timeout), an idle worker's wake-up event (``succeed`` as SimPy's), the wake-up's
    timer, the process's start (``Initialize``) and end (the process event itself)."""

    __slots__ = ("kind", "push", "triggered", "value", "w")

    def __init__(self, kind: int, w, push) -> None:
        self.kind = kind
        self.w = w            # the DirectWorker (the wake-up event for a timer)
        self.push = push      # schedules this entry now, as ``env.schedule(event)`` (wake-up events only)
        self.triggered = False
        self.value = None

    def succeed(self, value) -> None:
        """``simpy.Event.succeed`` for a wake-up: the worker resumes at the current time with ``value``."""
        self.triggered = True
        self.value = value
        self.push(self)


def _direct_workers(sched, env, duration, spans: list, wake_ev: dict, flush, debug_checks: bool):
    """``(start, fire)`` of the direct workers: ``start(wid)`` puts a worker's start into SimPy's queue (an URGENT
    entry now, as ``env.process`` would); ``fire(ev, t)`` does what the worker's process would do when its entry
    ``ev`` comes up at ``t`` (popped, the clock set). Closures: ``fire`` runs once per prefill batch, KV transfer
    and idle period."""
    queue = env.queue
    eid = env.eids
    add_span = spans.append
    sched_next = sched.next
    sched_done = sched.done

    def push_now(ev: DirectEvent) -> None:
        heappush(queue, (env.now_s, NORMAL, next(eid), ev))

    def start(wid: str) -> None:
        heappush(queue, (env.now_s, URGENT, next(eid), DirectEvent(D_INIT, DirectWorker(wid), None)))

    def fire(ev: DirectEvent, t: float) -> None:
        kind = ev.kind
        w = ev.w
        if kind == D_DONE:
            plan = w.plan
            tp = type(plan)
            if tp is KvTransfer:
                add_span((w.wid, SPAN_KV, w.t0, w.dur, plan.request_id, False))
            elif tp is PrefillBatch:
                add_span((w.wid, SPAN_PREFILL, w.t0, w.dur, plan.n_tokens, False))
            sched_done(plan, _new_result(Result, (w.dur, None, None, False)), t)  # Result(w.dur)
        elif kind == D_WAKE:
            if wake_ev.get(w.wid) is ev:
                del wake_ev[w.wid]
            # the worker's Idle plan ends: Scheduler.done has nothing to account for an Idle plan (it only sets
            # now_s, as sched_next below does), so it is not called
        elif kind == D_TIMER:
            if not w.triggered:  # w: the wake-up event the timer belongs to
                w.succeed(False)
            return
        elif kind == D_END:
            return
        plan = sched_next(w.wid, t)
        if type(plan) is Stop:
            heappush(queue, (t, NORMAL, next(eid), DirectEvent(D_END, w, None)))  # the process's own event
            return
        if kind == D_INIT or sched.wakeups or sched.new_workers or debug_checks:
            flush()
        # the worker starts the plan (the top of its process's loop)
        w.plan = plan
        w.t0 = t
        if type(plan) is Idle:
            ev = DirectEvent(D_WAKE, w, push_now)
            wake_ev[w.wid] = ev
            if plan.until_s is not None:
                heappush(queue, (t + max(plan.until_s - t, 0.0), NORMAL, next(eid), DirectEvent(D_TIMER, ev, None)))
        else:
            w.dur = dur = duration(plan, t)
            heappush(queue, (t + dur, NORMAL, next(eid), w.done_ev))

    return start, fire


class FastPath:
    """The events of a simulated run that need no SimPy process: decoder step ends (:class:`DecodeLane`, when
    ``cm_point`` — the cost model's ``decode_point`` — is given) and the direct workers' entries (``direct``:
    prefillers, KV streams and the autoscaler run by the main loop, when no fault can interrupt them).

    The decoders' pending step ends are SimPy queue entries ``(time, priority, id, event)`` kept in a heap of their
    own (``lq``), merged with SimPy's queue in (time, priority, insertion) order by :meth:`run`; an entry goes to
    SimPy's queue when SimPy must process it (the decoder's process resumes). ``env`` is the simulated environment
    whose queue, insertion counter and clock these share; ``duration`` the executor's; ``spans`` the run's span
    list; ``breakdown`` the executor's decode breakdown (five sums, added to in step order); ``wake_ev`` the
    driver's idle workers' wake-up events; ``flush`` its hand-over of wake-ups and new workers; ``lazy``: take
    plain steps (decision log off)."""

    def __init__(self, sched, env, duration, spans: list, breakdown: list, wake_ev: dict, flush, *, cm_point,
                 direct: bool, lazy: bool, debug_checks: bool) -> None:
        self.sched = sched
        self.env = env
        self.cm_point = cm_point
        self.spans = spans
        self.bd = breakdown
        self.flush = flush
        self.lazy = lazy and cm_point is not None
        self.debug_checks = debug_checks
        self.lq: list[tuple] = []
        self.ticks: dict = {}               # a decoder's step-end event -> its lane
        self.lanes: dict[str, DecodeLane] = {}
        self.n_fast = 0                     # decode steps completed by the main loop
        self.direct = direct
        self._start_direct, self._fire = _direct_workers(sched, env, duration, spans, wake_ev, flush, debug_checks)

    def start_worker(self, wid: str) -> bool:
        """Start ``wid`` as a direct worker if it is one (True); otherwise the driver starts its process."""
        if self.direct and self.sched.workers[wid].kind != "decode":
            self._start_direct(wid)
            return True
        return False

    def start_step(self, wid: str, plan, t0: float, dur: float):
        """A decoder's process starts ``plan`` (built by ``next``) at ``t0`` for ``dur`` (None when the decoder
        steps the reference way: no ``decode_point``): its end goes on ``lq``, an event as ``env.timeout(dur)``
        would be, with the next insertion id. Returns ``(event, lane)``; the process yields the event and calls
        :meth:`untick` when it resumes."""
        if self.cm_point is None:
            return None
        env = self.env
        lane = self.lanes.get(wid)
        if lane is None:
            price = step_cost(self.cm_point, self.sched.group(wid), plan.draft_k)
            lane = self.lanes[wid] = DecodeLane(wid, self.sched.decoder_view(wid), price)
        tmo = env.ready_event()
        heappush(self.lq, (env.now_s + dur, NORMAL, next(env.eids), tmo))
        lane.start_s, lane.dur_s, lane.step, lane.virtual = t0, dur, plan.step, False
        lane.dng = dur * lane.ng
        lane.left = 0   # priced by the executor: the lane prices the next step itself
        lane.plain = 0
        self.ticks[tmo] = lane
        return tmo, lane

    def untick(self, tmo) -> None:
        del self.ticks[tmo]

    def report(self) -> None:
        """Report the plain steps taken (Scheduler.plain_steps); before any call that may read a decoder's step
        counters (a fault, a recovery, the end of the run)."""
        sched = self.sched
        for ln in self.lanes.values():
            if ln.k:
                sched.plain_steps(ln.wid, ln.k)
                ln.left -= ln.k
                ln.plain -= ln.k
                ln.k = 0

    def next_time(self) -> float:
        """Time of the next event (SimPy's queue or ``lq``)."""
        queue = self.env.queue
        t = queue[0][0] if queue else float("inf")
        lq = self.lq
        if lq and lq[0][0] < t:
            t = lq[0][0]
        return t

    def run(self, stop: float) -> int:
        """Run the events that come before ``stop`` (the next arrival, the end) while they are the fast path's:
        decoder step ends — each completes its step and starts the next, plain steps without calling the scheduler
        — and direct workers' entries. A step end whose decoder does not step on (the scheduler answered
        Idle/Stop), or whose process was interrupted meanwhile, goes to SimPy's queue and SimPy processes it (the
        process resumes); then, or when SimPy's next event is not one of these, it returns. Returns the number of
        events run, about :data:`RUN_EVENTS` at most (the run loop calls again: a run whose only events are the
        direct workers' timers still reaches its housekeeping and watchdog)."""
        sched, env, lq, ticks, spans, bd = self.sched, self.env, self.lq, self.ticks, self.spans, self.bd
        lazy = self.lazy
        queue, eid, add_span, sd_append = env.queue, env.eids, spans.append, sched.step_durations.append
        fire = self._fire if self.direct else None
        busy_gpu_s = sched.busy_gpu_s
        b0, b1, b2, b3, b4 = bd  # Executor.acc_decode, inline: nothing else touches it while this runs
        busy = busy_gpu_s["decode"]  # Scheduler.advance_decoder adds to it: written back around each call
        n = 0
        n_fast = 0
        resume = False  # an entry of lq must go to its process
        while True:
            if lq and (not queue or lq[0] < queue[0]):
                head = lq[0]
                t = head[0]
                if t >= stop:
                    break
                ln = ticks.get(head[3])
                if ln is None:  # a step end whose process was interrupted meanwhile: SimPy processes it (no-op)
                    resume = True
                    break
                # a plain step needs no sample due: the first one is checked here, the later ones stop before the
                # sample time (stop_q) and come back here
                nsample = sched.next_sample_s
                # stop_q = min(stop, nsample, SimPy's next event), without calls
                stop_q = stop if nsample > stop else nsample  # noqa: FURB136
                if queue and queue[0][0] < stop_q:
                    stop_q = queue[0][0]
                calm = lazy and not sched.wakeups and t < nsample  # only the scheduler changes its wake-ups
                spans0 = len(spans)  # every step taken below adds one span
                tl = t
                while True:
                    if calm and ln.k < ln.plain and ln.view.changes == ln.ver:
                        dur = ln.dur_s
                        s = ln.step
                        add_span((ln.wid, SPAN_DECODE, ln.start_s, dur, s, False))
                        p0, p1, p2, p3, p4 = ln.parts
                        b0 += p0
                        b1 += p1
                        b2 += p2
                        b3 += p3
                        b4 += p4
                        busy += ln.dng  # dur * ng
                        sd_append(dur)
                        heapreplace(lq, (t + dur, NORMAL, next(eid), head[3]))
                        ln.start_s = t
                        ln.step = s + 1
                        ln.k += 1
                    else:
                        if ln.k:  # this decoder's plain steps, before the scheduler looks at it again
                            sched.plain_steps(ln.wid, ln.k)
                            ln.left -= ln.k
                            ln.plain -= ln.k
                            ln.k = 0
                        busy_gpu_s["decode"] = busy
                        dur = ln.advance(sched, t)
                        busy = busy_gpu_s["decode"]
                        if dur is None:  # next() answered Idle/Stop: the process takes it over at this step end
                            resume = True
                            break
                        nsample = sched.next_sample_s
                        env.now_s = t
                        add_span((ln.wid, SPAN_DECODE, ln.start_s, ln.dur_s, ln.step, False))
                        if sched.wakeups or sched.new_workers or self.debug_checks:
                            self.flush()  # before the step's timeout, as the worker's process would
                        calm = lazy and not sched.wakeups
                        p0, p1, p2, p3, p4 = ln.parts
                        b0, b1, b2, b3, b4 = b0 + p0, b1 + p1, b2 + p2, b3 + p3, b4 + p4
                        heapreplace(lq, (t + dur, NORMAL, next(eid), head[3]))  # this step's end -> the next's
                        ln.start_s, ln.dur_s, ln.step, ln.virtual = t, dur, ln.step + 1, True
                        ln.dng = dur * ln.ng
                        # the calls above may have queued events
                        stop_q = stop if nsample > stop else nsample  # noqa: FURB136
                        if queue and queue[0][0] < stop_q:
                            stop_q = queue[0][0]
                    tl = t
                    head = lq[0]
                    t = head[0]
                    if t >= stop_q or (ln := ticks.get(head[3])) is None:
                        break
                env.now_s = tl  # the last step taken (a plain step does not move the clock itself)
                k = len(spans) - spans0
                n += k
                n_fast += k
                if resume:
                    break
            elif fire is not None and queue and type(ev := queue[0][3]) is DirectEvent:
                t = queue[0][0]
                if t >= stop:
                    break
                heappop(queue)
                env.now_s = t
                fire(ev, t)
                n += 1
            else:
                break
            if n >= RUN_EVENTS:  # back to the run loop now and then: its housekeeping and watchdog
                break
        self.n_fast += n_fast
        busy_gpu_s["decode"] = busy
        bd[:] = b0, b1, b2, b3, b4
        if resume:  # SimPy resumes the decoder's process with this step's end
            heappush(queue, heappop(lq))
            env.step()
            n += 1
        return n
