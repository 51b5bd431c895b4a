"""The per-worker loop, written once and driven by every driver.

    plan = scheduler.next(worker, now)   →   driver runs/waits   →   scheduler.done(plan, result, now)

:func:`worker_loop` is a generator: it *yields each plan* and is *sent back its* :class:`~engine.core.plans.Result`
once the driver has resolved it — the SimPy driver by a simulated timeout (or a wake-up event for
:class:`~engine.core.plans.Idle`), the real driver by a CUDA event / worker message (or a condition variable with a
timeout for ``Idle``). Time comes from the ``clock`` callable the driver passes (``lambda: env.now`` in SimPy,
seconds since the run started in a real run). The generator returns the final :class:`~engine.core.plans.Stop`.

A driver's obligations, besides resolving plans:

- after every call that can change scheduling state (``arrive``, the generator's resumption, ``fail``,
  ``recover``) deliver ``scheduler.take_wakeups()`` to the idle workers named there and start a loop for every id in
  ``scheduler.take_new_workers()``;
- call ``scheduler.close_arrivals(now)`` after the last request arrived (workers then stop when all are resolved);
- on a failure, interrupt the workers ``scheduler.fail`` returns and send them ``Result(failed=...)``.
"""

from __future__ import annotations

from collections.abc import Callable, Generator

from rackbed.engine.core.plans import Plan, Result, Stop


def worker_loop(scheduler, worker: str, clock: Callable[[], float],
                first: Plan | None = None) -> Generator[Plan, Result, Stop]:
    """Drive ``worker`` until the scheduler stops it. Yields plans, receives results, returns the Stop plan.
    ``first``: the plan the scheduler already answered for ``worker`` (a driver that asked ``next`` itself)."""
    next_plan = scheduler.next
    done = scheduler.done
    plan = first if first is not None else next_plan(worker, clock())
    while True:
        if type(plan) is Stop:
            return plan
        result = yield plan
        done(plan, result, clock())
        plan = next_plan(worker, clock())
