"""The scheduler's internal invariants, checked by tests after every scheduling call (``debug_checks``).

Every open request is in exactly one place matching its state; decoder KV reservations add up and never exceed
capacity; batches stay within their caps; a prefiller's KV stays within its buffer; the token counters and the
rank keys agree with what they count. An aggregated worker is checked as a decoder whose ranks also hold the KV of
their prefilling requests (whole-sequence reservations, page-rounded), whose requests per rank stay within the
cap, and whose queue and prompt-token counters agree with its queues. With prefix caches: each live worker's
cache passes its own checks (``PrefixCache.check``: capacities, pins only on HBM blocks), every request pinning
blocks sits on that worker's queue or batch with its pinned blocks in HBM and counted, and no request on a dead or
retired worker (or done with its prompt) holds a pin.
"""

from __future__ import annotations

from rackbed.engine.core.state import (
    DEAD,
    DECODING,
    KV_IN_FLIGHT,
    KV_PENDING,
    PREFILLING,
    QUEUED_DECODE,
    QUEUED_PREFILL,
    RETIRED,
    STATE_NAMES,
    AggregatedState,
    RequestState,
)


def check_invariants(sched) -> None:
    """Assert the invariants of ``sched`` (a :class:`~engine.core.scheduler.Scheduler`); AssertionError names the
    first one broken."""
    where: dict[int, str] = {}

    def put(r: RequestState, place: str, states: tuple[int, ...]) -> None:
        assert r.id not in where, f"request {r.id} in {where[r.id]} and {place}"
        assert r.state in states, f"request {r.id} is {STATE_NAMES[r.state]} in {place}"
        assert sched.reqs.get(r.id) is r, f"request {r.id} in {place} but not open"
        where[r.id] = place

    for pf in sched.prefillers:
        if pf.status in (DEAD, RETIRED):
            assert not pf.queue and not pf.running and not pf.pending, f"{pf.id} dead but holds work"
            continue
        for r in pf.queue:
            put(r, f"{pf.id}.queue", (QUEUED_PREFILL,))
            assert r.prefiller is pf
        for r in pf.running:
            if r.owner is not None:
                put(r, f"{pf.id}.running", (PREFILLING,))
        for r in pf.pending:
            put(r, f"{pf.id}.pending", (KV_PENDING,))
        assert pf.n_queued == len(pf.queue)
        qt = sum(r.ctx0 - r.pf_done for r in pf.queue) + sum(
            r.ctx0 - r.pf_done for r in pf.running if r.owner is not None)
        assert pf.queued_tokens == qt, f"{pf.id}: queued_tokens {pf.queued_tokens} != {qt}"
        assert 0 <= pf.kv_held <= pf.kv_cap, f"{pf.id}: kv_held {pf.kv_held} outside [0, {pf.kv_cap}]"
        held = sum(r.pf_done for r in pf.queue) + sum(r.ctx0 for r in pf.pending) + sum(
            s.req.ctx0 for s in pf.streams if s.req is not None and s.plan is not None)
        if pf.plan is not None:
            held += sum(r.pf_done for r in pf.running if r.owner is not None) + pf.plan.n_tokens
        assert pf.kv_held == held, f"{pf.id}: kv_held {pf.kv_held} != {held}"
        for s in pf.streams:
            if s.req is not None and s.plan is not None:
                put(s.req, s.id, (KV_IN_FLIGHT,))
    for d in sched.decoders:
        if d.status in (DEAD, RETIRED):
            assert not d.running and not any(d.rank_queue), f"{d.id} dead but holds work"
            continue
        used = [0] * d.ep
        nreq = [0] * d.ep
        batch = [0] * d.ep
        for r in d.running.values():
            put(r, f"{d.id}.running", (DECODING,))
            used[r.rank] += r.reserved
            nreq[r.rank] += 1
            batch[r.rank] += 1
        for rank, q in enumerate(d.rank_queue):
            for r in q:
                put(r, f"{d.id}.queue{rank}", (QUEUED_DECODE,))
                assert r.rank == rank
                used[rank] += r.reserved
                nreq[rank] += 1
        if d.kind == "agg":
            _check_aggregated(d, put, used, nreq)
        for pf in sched.prefillers:
            for s in pf.streams:
                r = s.req
                if r is not None and s.plan is not None and r.decoder is d:
                    used[r.rank] += r.reserved
                    nreq[r.rank] += 1
        for rank in range(d.ep):
            assert used[rank] <= d.kv_cap, f"{d.id} rank {rank}: KV {used[rank]} > capacity {d.kv_cap}"
            assert d.rank_free_kv[rank] == d.kv_cap - used[rank], f"{d.id} rank {rank}: free KV mismatch"
            assert d.rank_nreq[rank] == nreq[rank], f"{d.id} rank {rank}: nreq mismatch"
            assert d.rank_key[rank] == nreq[rank] * sched._key_base - d.rank_free_kv[rank], f"{d.id} rank {rank}"
            assert 0 <= d.rank_free_kv[rank] < sched._key_base
            assert d.rank_batch[rank] == batch[rank] <= d.cap, f"{d.id} rank {rank}: batch {batch[rank]}"
        assert d.n_running == len(d.running)
        assert d.rank_kmin == min(d.rank_key, default=0), f"{d.id}: rank_kmin {d.rank_kmin} != min(rank_key)"
    # the routable prefillers' loads and decoders' minima, in their order, for the choices
    # (Scheduler._route_pl, _route_dk)
    route_p, route_d = sched._route_p, sched._route_d
    assert sched._route_pl == [p.queued_tokens + p.offset_tokens for p in route_p], "_route_pl is stale"
    assert all(p.route_pi == (route_p.index(p) if p in route_p else -1) for p in sched.prefillers)
    assert sched._route_dk == [d.rank_kmin for d in route_d], "_route_dk != the routable decoders' rank_kmin"
    assert all(d.route_i == (route_d.index(d) if d in route_d else -1) for d in sched.decoders)
    _check_caches(sched)
    missing = [rid for rid in sched.reqs if rid not in where]
    assert not missing, f"open requests in no place: {missing[:5]}"
    assert sched.n_open == len(sched.reqs)


def _check_aggregated(w: AggregatedState, put, used: list[int], nreq: list[int]) -> None:
    """The aggregated worker's own places: its queue (no KV yet) and its ranks' prefilling requests (KV held)."""
    for r in w.queue:
        put(r, f"{w.id}.queue", (QUEUED_PREFILL,))
        assert r.prefiller is w and r.rank == -1 and r.reserved == 0, f"{w.id}: queued request {r.id} holds KV"
    n_pf = 0
    for rank, q in enumerate(w.rank_prefill):
        for r in q:
            put(r, f"{w.id}.prefill{rank}", (PREFILLING,))
            assert r.rank == rank and r.decoder is w and 0 <= r.pf_done < r.ctx0
            assert r.reserved % w.page == 0 and r.reserved >= r.ctx0 + r.out - r.generated - 1, f"request {r.id}"
            used[rank] += r.reserved
            nreq[rank] += 1
            n_pf += 1
    assert w.n_queued == len(w.queue) and w.n_prefilling == n_pf, f"{w.id}: queue counters"
    qt = sum(r.ctx0 - r.pf_done for r in w.queue) + sum(r.ctx0 - r.pf_done for q in w.rank_prefill for r in q)
    assert w.queued_tokens == qt, f"{w.id}: queued_tokens {w.queued_tokens} != {qt}"
    for rank in range(w.ep):
        assert nreq[rank] <= w.cap, f"{w.id} rank {rank}: {nreq[rank]} requests > cap {w.cap}"


def _check_caches(sched) -> None:
    """The prefix caches and the pins requests hold (see the module docstring)."""
    if getattr(sched, "pcache", None) is None:
        return
    pins: dict[int, dict] = {}
    for w in (*sched.prefillers, *sched._aggs):
        if w.status in (DEAD, RETIRED):
            assert w.cache.used(0) == 0 and w.cache.pinned() == 0, f"{w.id} gone but its cache holds blocks"
            continue
        w.cache.check()
        pins[id(w)] = {}
    for r in sched.reqs.values():
        if r.pin is None or r.pin.released:
            continue
        w = r.prefiller
        assert w is not None and id(w) in pins, f"request {r.id} pins blocks of no live worker"
        assert r.state in (QUEUED_PREFILL, PREFILLING), f"request {r.id} is {STATE_NAMES[r.state]} with a pin"
        assert r.pin.epoch == w.cache._epoch, f"request {r.id} holds a void pin"
        assert r.pf_done >= r.pin.cached_tokens, f"request {r.id}: prefilled less than it reused"
        for k in r.pin.keys:
            assert w.cache.tier_of(k) == 0, f"request {r.id}: a pinned block left HBM"
            pins[id(w)][k] = pins[id(w)].get(k, 0) + 1
    for w in (*sched.prefillers, *sched._aggs):
        if id(w) in pins:
            for k, n in pins[id(w)].items():
                assert w.cache.refcount(k) == n, f"{w.id}: block pinned {w.cache.refcount(k)} times, held {n}"
