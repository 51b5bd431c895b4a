"""A KV transfer that fails because its prefiller no longer holds the KV (``Result.failed == KV_LOST``, a real
source's decline) sends the request back to prefill — not back to the prefiller's pending list, whose copy is gone
— and frees the decoder reservation: whichever transfers lose their KV, every request still finishes with all its
tokens, each lost one is prefilled exactly once more, no worker dies, and the scheduler's invariants hold after
every call. A replayed ``Failed`` answer (``engine.real.driver.ReplayExecutor``) fails the plan the same way.
A transfer that fails with ``KV_NO_ROOM`` (a real decoder had no free pages) is shipped again from the
prefiller's copy, later, and nothing is prefilled again."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from test_sim_driver_models import AnalyticCost, poisson_requests, small_deployment

from rackbed.engine.core.plans import (
    KV_LOST,
    KV_NO_ROOM,
    DecodeStep,
    Failed,
    KvTransfer,
    MixedStep,
    PrefillBatch,
)
from rackbed.sim.driver import simulate
from rackbed.sim.executor import Executor

N_REQ = 12


class _Losing(Executor):
    """The simulated executor, except that the first ``lose[rid]`` KV transfers of request ``rid`` fail with
    ``reason`` (:data:`KV_LOST`, or :data:`KV_NO_ROOM`) after their priced duration."""

    def __init__(self, cm, net, group_of, lose: dict[int, int], reason: str = KV_LOST) -> None:
        super().__init__(cm, net, group_of)
        self.lose = dict(lose)
        self.reason = reason
        self.lost: list[int] = []
        self.records: list[tuple] = []

    def duration(self, plan, now_s):
        d = super().duration(plan, now_s)
        tp = type(plan)
        kind, key = {PrefillBatch: ("prefill", "batch"), KvTransfer: ("kv", "request_id"),
                     DecodeStep: ("decode", "step"), MixedStep: ("mixed", "step")}[tp]
        key = getattr(plan, key)
        if tp is KvTransfer and self.lose.get(plan.request_id, 0) > 0:
            self.lose[plan.request_id] -= 1
            self.lost.append(plan.request_id)
            self.records.append((plan.worker, f"kv:{self.reason}", key, d, 0.0))
            return Failed(d, self.reason)
        self.records.append((plan.worker, kind, key, d, 0.0))   # as a real run records them (RealRun.records)
        return d


def _run(lose: dict[int, int], reason: str = KV_LOST):
    made = []

    def factory(cm, net, group_of):
        made.append(_Losing(cm, net, group_of, lose, reason))
        return made[-1]

    reqs = poisson_requests(N_REQ, 20.0, 5)
    res = simulate(small_deployment(n_pf=2, n_dec=2, ep=2, draft_k=0), reqs, AnalyticCost(), seed=0,
                   progress=False, debug_checks=True, executor_factory=factory)
    return res, reqs, made[0]


@settings(max_examples=12, deadline=None, derandomize=True)
@given(st.dictionaries(st.integers(0, N_REQ - 1), st.integers(1, 2), max_size=5))
def test_a_lost_kv_is_prefilled_again_and_every_request_finishes(lose):
    res, reqs, ex = _run(lose)
    m = res.metrics["requests"]
    assert m["done"] == m["total"] == len(reqs), m
    assert sorted(ex.lost) == sorted(r for r, n in lose.items() for _ in range(n))
    log = res.log
    assert not log.of_kind("fault")
    requeues = [(rec[3], rec[4], rec[6]) for rec in log.of_kind("requeue")]
    assert sorted(requeues) == sorted((rid, 1, KV_LOST) for rid in ex.lost)   # lost_kv=1, nothing else requeued
    # a request's KV is shipped once per prefill: one transfer more per loss than without losses
    shipped: dict[int, int] = {}
    for rec in log.of_kind("kv_transfer"):
        shipped[rec[3]] = shipped.get(rec[3], 0) + 1
    assert all(shipped.get(r.id, 0) == 1 + lose.get(r.id, 0) for r in reqs if r.output_tokens > 1)
    rows = {row[0]: dict(zip(res.row_fields, row)) for row in res.rows}
    for r in reqs:   # every token is produced once more after its loss, none twice: k = 0, one token per step
        row = rows[r.id]
        assert row["status"] == "done" and row["requeues"] == len([x for x in ex.lost if x == r.id]), row
        assert row["decode_steps"] == r.output_tokens - 1, row


def test_a_replayed_failure_fails_the_same_way():
    """The run's durations recorded as a real run records them (a lost transfer's kind ``kv:kv_lost``) and
    replayed through :class:`engine.real.driver.ReplayExecutor` give the same decisions."""
    from rackbed.engine.real.driver import ReplayExecutor

    res, reqs, ex = _run({2: 1, 5: 2})
    assert sorted(ex.lost) == [2, 5, 5]
    assert sum(1 for r in ex.records if r[1] == f"kv:{KV_LOST}") == 3
    rep = simulate(small_deployment(n_pf=2, n_dec=2, ep=2, draft_k=0), reqs, AnalyticCost(), seed=0,
                   progress=False, debug_checks=True, executor_factory=lambda cm, net, g: ReplayExecutor(ex.records))
    assert rep.log.decisions() == res.log.decisions()


@settings(max_examples=8, deadline=None, derandomize=True)
@given(st.dictionaries(st.integers(0, N_REQ - 1), st.integers(1, 2), max_size=5))
def test_a_refused_kv_is_shipped_again_from_the_prefillers_copy(refuse):
    """A decoder that had no pages for a transfer (``KV_NO_ROOM``) is no fault and loses nothing: the
    request waits for its prefiller's next transfer (to whichever decoder rank then has room), it is prefilled
    once, every request finishes, and the replay of the recorded failures makes the same decisions."""
    from rackbed.engine.real.driver import ReplayExecutor

    res, reqs, ex = _run(refuse, KV_NO_ROOM)
    m = res.metrics["requests"]
    assert m["done"] == m["total"] == len(reqs), m
    assert sorted(ex.lost) == sorted(r for r, n in refuse.items() for _ in range(n))
    log = res.log
    assert not log.of_kind("fault")
    requeued = sorted((rec[3], rec[6]) for rec in log.of_kind("requeue"))
    assert requeued == sorted((r, KV_NO_ROOM) for r in ex.lost)
    prefilled: dict[int, int] = {}
    for rec in log.of_kind("route_prefill"):
        prefilled[rec[3]] = prefilled.get(rec[3], 0) + 1
    assert all(n == 1 for n in prefilled.values()) and len(prefilled) == len(reqs), prefilled
    shipped: dict[int, int] = {}
    for rec in log.of_kind("kv_transfer"):
        shipped[rec[3]] = shipped.get(rec[3], 0) + 1
    assert all(shipped.get(r.id, 0) == 1 + refuse.get(r.id, 0) for r in reqs if r.output_tokens > 1)
    rep = simulate(small_deployment(n_pf=2, n_dec=2, ep=2, draft_k=0), reqs, AnalyticCost(), seed=0,
                   progress=False, debug_checks=True,
                   executor_factory=lambda cm, net, g: ReplayExecutor(ex.records))
    assert rep.log.decisions() == res.log.decisions()
