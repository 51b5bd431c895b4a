"""The simulated environment: a SimPy ``Environment`` whose clock and event queue are attributes of its own.

The simulator's fast path (:mod:`sim.fastpath`) runs most events without SimPy processes, in SimPy's order: it
puts entries ``(time, priority, insertion id, event)`` into the event queue itself, takes the next insertion id,
and sets the clock to the time of the event it runs. :class:`SimEnv` therefore keeps the clock (:attr:`now_s`),
the queue (:attr:`queue`, a heap) and the insertion ids (:attr:`eids`) under names it owns and implements the
four methods of ``simpy.Environment`` that use them (``now``, ``schedule``, ``peek``, ``step``) exactly as SimPy
4.1 does; events and processes reach the environment only through ``schedule`` (and ``_active_proc``, which SimPy
keeps itself), so they behave as in SimPy's own environment.

This is the one module that depends on SimPy's internals: ``step`` reads an event's outcome (``_ok``,
``_value``, ``_defused``) and :meth:`SimEnv.ready_event` / :meth:`SimEnv.trigger` set it (an event that is
already a success when queued, as ``Timeout`` does). ``simpy`` is pinned to the tested versions
(:data:`TESTED_SIMPY`, ``pyproject.toml``); ``tests/test_simenv.py`` fails on another version and checks the
environment against ``simpy.Environment`` on random event programs.
"""

from __future__ import annotations

from heapq import heappop, heappush
from itertools import count

import simpy
from simpy.core import EmptySchedule, Infinity, StopSimulation
from simpy.events import NORMAL, EventPriority

#: SimPy versions this module is tested with (pyproject.toml pins ``simpy`` to them)
TESTED_SIMPY = ("4.1.1", "4.1.2")


class SimEnv(simpy.Environment):
    """``simpy.Environment`` with its clock, queue and insertion ids as :attr:`now_s`, :attr:`queue` and
    :attr:`eids` (module docstring); :meth:`advance` moves the clock forward to an arrival between events."""

    def __init__(self, initial_time: float = 0) -> None:  # SimPy's default (an int until the first event)
        super().__init__(initial_time)
        self.now_s = initial_time
        self.queue: list[tuple] = []   # heap of (time, priority, insertion id, event)
        self.eids = count()            # insertion ids: simultaneous events of one priority run in this order

    @property
    def now(self) -> float:
        return self.now_s

    def schedule(self, event, priority: EventPriority = NORMAL, delay: float = 0) -> None:
        heappush(self.queue, (self.now_s + delay, priority, next(self.eids), event))

    def peek(self) -> float:
        return self.queue[0][0] if self.queue else Infinity

    def step(self) -> None:
        try:
            self.now_s, _, _, event = heappop(self.queue)
        except IndexError:
            raise EmptySchedule from None
        callbacks, event.callbacks = event.callbacks, None
        try:
            for callback in callbacks:
                callback(event)
        except StopSimulation:
            event.callbacks = callbacks[callbacks.index(callback) + 1:]
            self.schedule(event, EventPriority(-1))
            raise
        if not event._ok and not hasattr(event, "_defused"):
            exc = type(event._value)(*event._value.args)
            exc.__cause__ = event._value
            raise exc

    def advance(self, t: float) -> None:
        """Move the clock to ``t`` if that is later (an arrival between two events)."""
        self.now_s = max(self.now_s, t)

    def ready_event(self) -> simpy.Event:
        """A new event that is already a success (value None) but not queued: whoever holds it puts it into a
        queue, as ``env.timeout`` would have queued itself."""
        ev = self.event()
        ev._ok = True
        ev._value = None
        return ev

    def trigger(self, ev: simpy.Event, value, delay: float) -> None:
        """``ev`` succeeds with ``value`` ``delay`` seconds from now (``succeed`` with a delay)."""
        ev._ok = True
        ev._value = value
        self.schedule(ev, NORMAL, delay)
