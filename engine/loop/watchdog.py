"""A watchdog on simulated progress: a run whose requests stop making progress ends with an error instead of
running (and growing) forever.

:func:`engine.loop.runloop.run_loop` calls :meth:`Watchdog.check` every few thousand events. While requests are
open and :func:`engine.core.stall.progress_mark` does not move, it raises :class:`Stalled` once ``stall_s``
simulated seconds or ``stall_events`` events have passed — a livelock (timers that fire forever around requests
nothing will serve, e.g. an autoscaler ticking) — naming the stuck component (:func:`engine.core.stall.describe_stall`).
``pending()`` counts events still to come from outside the scheduler (scheduled faults and recoveries): while
there are some, simulated time without progress is not a stall (a NIC down for an hour holds its KV that long),
and each one that happens counts as progress. A run with nothing left to happen ends anyway; its open requests
are then rejected ``stalled`` by the driver.
"""

from __future__ import annotations

from collections.abc import Callable

from rackbed.engine.core.stall import describe_stall, progress_mark

#: default limits: an hour of simulated time, ten million events without progress
STALL_S = 3600.0
STALL_EVENTS = 10_000_000


class Stalled(TimeoutError):
    """The run made no progress within the watchdog's limits (the message names the stuck component; a
    ``TimeoutError``: the command line prints it as one line and exits 1)."""


class Watchdog:
    """See module docstring. ``stall_s`` / ``stall_events``: None switches that limit off."""

    def __init__(self, sched, *, stall_s: float | None = STALL_S, stall_events: int | None = STALL_EVENTS,
                 pending: Callable[[], int] | None = None) -> None:
        if stall_s is not None and not stall_s > 0:
            raise ValueError(f"stall_s: must be > 0 or None, got {stall_s}")
        if stall_events is not None and not stall_events > 0:
            raise ValueError(f"stall_events: must be > 0 or None, got {stall_events}")
        self.sched = sched
        self.stall_s = stall_s
        self.stall_events = stall_events
        self.pending = pending
        self.mark: tuple = ()
        self.t0 = 0.0
        self.n0 = 0

    def check(self, now: float, n_events: int) -> None:
        """Called by the run loop at ``now`` after ``n_events`` events; raises :class:`Stalled` (module docstring)."""
        sched = self.sched
        waiting = self.pending() if self.pending is not None else 0
        mark = (*progress_mark(sched), waiting)
        if mark != self.mark or sched.n_open == 0:
            self.mark, self.t0, self.n0 = mark, now, n_events
            return
        idle_s = now - self.t0
        n = n_events - self.n0
        over_t = self.stall_s is not None and not waiting and idle_s > self.stall_s
        if over_t or (self.stall_events is not None and n > self.stall_events):
            raise Stalled(f"simulation stalled at t={now:.6g} s: no request progress for {idle_s:.6g} simulated s "
                          f"({n} events) with {sched.n_open} requests open; {describe_stall(sched)}")
