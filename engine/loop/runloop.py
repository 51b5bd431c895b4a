"""The run loop: arrivals and events in time order until the end, for the simulated and the measured clock alike.

:func:`run_loop` drives an environment — :class:`engine.loop.simenv.SimEnv`, or the real engine's measured-clock
environment — through four methods: ``now``, ``peek()`` (the time of the next event; a measured clock waits there
until no plan still running could finish earlier), ``step()`` and ``advance(t)`` (move the clock to an arrival
between events). Arrivals are merged into the loop instead of being a process: before the next event, every request
arriving no later is handed to the scheduler at its arrival time (arrivals at time t go before the other events at
t); after the last one the scheduler is told no more will come. Events after ``until_s`` are not run. A closed loop
(:class:`engine.core.workload.ClosedLoop`) holds the next request back while ``max_concurrency`` are in flight and
sends it (its ``arrival_s`` set to the send time) after the event that resolves one. With a fast
path (:mod:`sim.fastpath`) the loop lets it run the events that need no SimPy process before stepping the
environment.

Housekeeping: a progress bar once the run has taken more than a second of wall time, the watchdog on simulated
progress (:mod:`engine.loop.watchdog`), and — while the cyclic
garbage collector is off (:func:`collector_paused`) — a collection of the young generations every
:data:`GC_EVERY` events.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from math import inf, nextafter

#: the cyclic collector's young-generation threshold during a run with a real environment (see collector_paused)
GC_GEN0 = 100_000
#: events between two collections of the young generations while the collector is off
GC_EVERY = 1 << 22


def _gc_pause(off: bool) -> tuple:
    """The cyclic collector's settings for a run: off (``off``) or with a larger young-generation threshold.
    Returns what :func:`_gc_resume` needs to restore them."""
    state = (off, gc.isenabled(), gc.get_threshold())
    if off:
        gc.disable()
    else:
        th = state[2]
        gc.set_threshold(max(th[0], GC_GEN0), *th[1:])
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


@contextmanager
def collector_paused(off: bool):
    """The cyclic collector during a run, given back as it was (also when the run raises). A run allocates a few
    container objects per event and keeps many (spans, rows): CPython's default young-generation threshold (700)
    makes the collector run every few events and, every so often, rescan everything the run keeps. With a real
    environment the threshold is raised for the run only (~5-9 % of a long run's CPU time in A/B runs); with the
    simulated one (``off``) the collector is off — a bench hour makes no more than a few hundred objects of cyclic
    garbage, in setup mostly — and what the run kept goes straight to the oldest generation at the end, never
    traversed as young objects (~5 % of a bench hour's CPU time); :func:`run_loop` collects the young generations
    every :data:`GC_EVERY` events meanwhile. Yields whether the collector is off."""
    state = _gc_pause(off)
    try:
        yield off
    finally:
        _gc_resume(state)


class Progress:
    """A rich progress bar shown once the run has taken more than a second: requests resolved out of ``n_total``,
    or simulated seconds out of ``until_s`` for a lazy request stream."""

    def __init__(self, t_wall0: float, n_total: int | None, until_s: float | None) -> None:
        self.t_wall0, self.n_total, self.until_s = t_wall0, n_total, until_s
        self.bar = None
        self.task = None

    def update(self, sched, now: float) -> None:
        if self.bar is None:
            if time.perf_counter() - self.t_wall0 <= 1.0:
                return
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

            self.bar = Progress(TextColumn("[bold]simulating"), BarColumn(),
                                TextColumn("{task.completed:,.0f}/{task.total:,.0f} {task.fields[unit]}"),
                                TextColumn("sim t={task.fields[t]:.1f}s"), TimeElapsedColumn(), transient=True)
            self.bar.start()
            if self.n_total is not None:
                self.task = self.bar.add_task("sim", total=self.n_total, unit="requests", t=now)
            else:
                self.task = self.bar.add_task("sim", total=self.until_s or 0.0, unit="sim-s", t=now)
        done = len(sched.rows) if self.n_total is not None else now
        self.bar.update(self.task, completed=done, t=now)

    def stop(self) -> None:
        if self.bar is not None:
            self.bar.stop()


class _Arrivals:
    """The request stream: :attr:`nxt` arrives next, at :attr:`at` (inf when none is left before the end, or while
    a closed loop is full: then :attr:`blocked`)."""

    def __init__(self, requests: Iterable, end: float, closed=None, sched=None) -> None:
        self.it: Iterator = iter(requests)
        self.end = end
        self.last = 0.0
        self.closed, self.sched = closed, sched
        self.sent = 0
        self.blocked = False
        self.nxt = next(self.it, None)
        self.at = self.nxt.arrival_s if self.nxt is not None else inf
        if closed is not None:
            self.refresh(0.0)

    def refresh(self, now: float) -> None:
        """A closed loop's next send time (:attr:`at`) at clock ``now``: inf while full; the stream ends at the
        loop's ``until_s``."""
        cl = self.closed
        if self.nxt is None:
            self.at, self.blocked = inf, False
            return
        self.blocked = self.sent - len(self.sched.rows) >= cl.max_concurrency
        if self.blocked:
            self.at = inf
            return
        at = max(self.nxt.arrival_s if cl.paced else 0.0, now)
        if cl.until_s is not None and at >= cl.until_s:
            self.nxt, at = None, inf
        self.at = at


def _arrive_due(env, sched, arrivals: _Arrivals, t: float, flush: Callable[[], None],
                peek: Callable[[], float]) -> float:
    """Hand the scheduler every request arriving no later than ``t`` (the next event), in arrival order (a stream
    out of order is a user error), and close the arrivals after the last; returns the time of the next event
    then."""
    nxt = arrivals.nxt
    it = arrivals.it
    end = arrivals.end
    arrive = sched.arrive
    advance = env.advance
    closed = arrivals.closed is not None
    while nxt is not None and arrivals.at <= t:
        ta = arrivals.at
        if ta < arrivals.last:
            raise ValueError(f"requests: not sorted by arrival_s (request {nxt.id} at {ta} after {arrivals.last})")
        if ta > end:
            nxt = None
            break
        arrivals.last = ta
        advance(ta)
        if closed and nxt.arrival_s != ta:
            nxt = replace(nxt, arrival_s=ta)
        arrive(nxt, ta)
        flush()
        arrivals.nxt = nxt = next(it, None)
        if closed:
            arrivals.sent += 1
            arrivals.refresh(ta)
            nxt = arrivals.nxt
        else:
            arrivals.at = nxt.arrival_s if nxt is not None else inf
        t = peek()
    arrivals.nxt = nxt
    if nxt is None:
        arrivals.at, arrivals.blocked = inf, False
    if nxt is None and not sched.closed:
        sched.close_arrivals(env.now)
        flush()
        t = peek()
    return t


def run_loop(env, sched, requests: Iterable, *, until_s: float | None, flush: Callable[[], None], fast=None,
             collect: bool = False, progress: Progress | None = None, closed_loop=None, watchdog=None) -> int:
    """Run ``env`` (module docstring) with ``requests`` arriving until ``until_s`` (None: until no event is left);
    ``flush`` hands the scheduler's wake-ups and new workers to the driver; ``fast``: a :class:`sim.fastpath.FastPath`
    (its ``next_time`` replaces ``env.peek``; not with a closed loop, whose sends follow each resolving event);
    ``collect``: the cyclic collector is off (collect now and then); ``closed_loop``: a
    :class:`~engine.core.workload.ClosedLoop` or None; ``watchdog``: a :class:`engine.loop.watchdog.Watchdog` (checked
    with the housekeeping; raises when the run stops making progress) or None. Returns the number of events run."""
    end = inf if until_s is None else until_s
    end_x = nextafter(end, inf)  # t > end  <=>  t >= end_x
    assert closed_loop is None or fast is None, "a closed loop sends after each event: no fast path"
    arrivals = _Arrivals(requests, end, closed_loop, sched)
    peek = fast.next_time if fast is not None else env.peek
    step = env.step
    n = 0
    next_check = 4096
    gc_next = GC_EVERY
    try:
        while True:
            t = peek()
            if arrivals.at <= t or (arrivals.nxt is None and not sched.closed):
                t = _arrive_due(env, sched, arrivals, t, flush, peek)
            if t >= end_x or t == inf:
                break
            # the fast path's events, as long as they come first and before the next arrival and the end
            k = fast.run(min(arrivals.at, end_x)) if fast is not None else 0
            if k:
                n += k
            else:  # the environment's next event
                step()
                n += 1
                if arrivals.blocked:  # a closed loop: did this event resolve a request?
                    arrivals.refresh(env.now)
            if n >= next_check:
                next_check += 4096
                if collect and n >= gc_next:  # the collector is off: a collection now and then
                    gc_next = n + GC_EVERY
                    gc.collect(1)
                if progress is not None:
                    progress.update(sched, env.now)
                if watchdog is not None:
                    watchdog.check(env.now, n)
    finally:
        if progress is not None:
            progress.stop()
    return n
