"""What a stuck run looks like from the scheduler: a progress mark to compare over time, and one line naming where
the open requests wait and what the worker holding them waits for (the error :mod:`engine.loop.watchdog` raises).

A run *progresses* while requests arrive or resolve, prefill or KV transfers complete, or decode steps run;
:func:`progress_mark` is a tuple of the counters that move then (it does not move for idle timers, autoscaler
ticks or plans that fail).
"""

from __future__ import annotations

from collections import Counter

from rackbed.engine.core.state import (
    KV_IN_FLIGHT,
    KV_PENDING,
    STATE_NAMES,
    STATUS_NAMES,
)


def progress_mark(sched) -> tuple:
    """Counters of ``sched`` that move whenever a request makes progress (module docstring)."""
    busy = sched.busy_gpu_s
    return (sched.n_arrived, len(sched.rows), len(sched.step_durations), busy["prefill"], busy.get("aggregated"),
            sched.kv_busy_s)


def _holder(r) -> str:
    """The worker an open request waits on: its KV streams' prefiller while its KV waits or moves, otherwise the
    decoder (or aggregated worker) holding it, otherwise its prefiller."""
    if r.state in (KV_PENDING, KV_IN_FLIGHT) and r.prefiller is not None:
        return r.prefiller.id + ".kv*"
    w = r.decoder if r.decoder is not None else r.prefiller
    return w.id if w is not None else "(none)"


def _worker_state(w) -> str:
    what = f"waits for {w.waits_for}" if w.idle else ("has a plan running" if w.plan is not None else "not idle")
    status = getattr(w, "status", None)
    return f"{w.id} ({STATUS_NAMES[status] + ', ' if status is not None else ''}{what})"


def describe_stall(sched) -> str:
    """One line: where the open requests of ``sched`` wait (the three largest groups by state and worker) and the
    state of the workers holding the largest group — the stuck component."""
    groups = Counter((STATE_NAMES[r.state], _holder(r)) for r in sched.reqs.values())
    if not groups:
        return "no open request"
    (_, holder), _ = groups.most_common(1)[0]
    if holder.endswith(".kv*"):
        pf = sched.workers[holder[:-4]]
        workers = [sched.workers[s.id] for s in pf.streams]
    else:
        workers = [sched.workers[holder]] if holder in sched.workers else []
    stuck = "; ".join(_worker_state(w) for w in workers) or holder
    where = ", ".join(f"{n} {st} at {h}" for (st, h), n in groups.most_common(3))
    routable = f"{len(sched._route_p)} prefillers and {len(sched._route_d)} decoders routable"
    return f"stuck: {stuck}; open requests: {where}{', ...' if len(groups) > 3 else ''}; {routable}"
