"""The scheduling policies (``engine.core.policies``) choose what their rules say, checked against the rules
written out as brute-force minima: the prefiller with the least queued tokens (plus start-up penalty) among those
with queue room (any when re-routing), the decoder rank minimising ``(requests, -free KV, group, rank)`` among
ranks with enough free KV and an up NIC (read through the scheduler's one-int ``rank_key``), FIFO admission."""

from collections import deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rackbed.engine.core.policies import FewestRequests, FifoAdmission, LeastQueuedTokens, Policies


class _D:
    def __init__(self, nreq, free, up=None, base=16):
        self.rank_nreq, self.rank_free_kv = nreq, free
        self.rank_up = up if up is not None else [True] * len(nreq)
        self.rank_key = [n * base - f for n, f in zip(nreq, free)]  # the scheduler's key: base > every free KV
        self.rank_kmin = min(self.rank_key, default=0)


class _P:
    def __init__(self, q, n=0, m=None, off=0):
        self.queued_tokens, self.n_queued, self.max_queue, self.offset_tokens = q, n, m, off


def _best_rank(ds, need):
    cands = [(d.rank_nreq[r], -d.rank_free_kv[r], gi, r) for gi, d in enumerate(ds) for r in range(len(d.rank_nreq))
             if d.rank_free_kv[r] >= need and d.rank_up[r]]
    if not cands:
        return None
    best = min(cands)
    return ds[best[2]], best[3]


def _check_rank(ds, need):
    got = FewestRequests().choose(ds, need)
    want = _best_rank(ds, need)
    assert (got is None) == (want is None)
    if want is not None:
        assert got[0] is want[0] and got[1] == want[1]


_rank = st.tuples(st.integers(0, 4), st.integers(0, 9), st.booleans())


@pytest.mark.slow
@settings(max_examples=600, deadline=None)
@given(st.lists(st.lists(_rank, min_size=0, max_size=6), min_size=0, max_size=4), st.integers(0, 10))
def test_rank_choice_is_the_constrained_minimum(groups, need):
    _check_rank([_D([x[0] for x in g], [x[1] for x in g], [x[2] for x in g]) for g in groups], need)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 2**40), st.booleans()), min_size=1,
                         max_size=16), min_size=1, max_size=3), st.integers(0, 2**40))
def test_rank_choice_is_the_constrained_minimum_large_kv(groups, need):
    _check_rank([_D([x[0] for x in g], [x[1] for x in g], [x[2] for x in g], base=2 ** 40 + 1) for g in groups],
                need)


def test_rank_choice_by_hand():
    choose = FewestRequests().choose
    # the unconstrained minimum (rank 0) is down / too small: the scan finds the next best
    assert choose([_D([0, 1, 1], [9, 5, 7], [False, True, True])], 3)[1] == 2
    assert choose([_D([0, 1, 1], [2, 5, 7])], 3)[1] == 2
    g0, g1 = _D([1, 1], [4, 4]), _D([0], [1])
    assert choose([g0, g1], 3) == (g0, 0)
    # ties on requests: the most free KV wins, then the earliest group / lowest rank
    g0, g1 = _D([2, 1, 1], [9, 5, 7]), _D([1, 1], [7, 8])
    assert choose([g0, g1], 1) == (g1, 1)
    g0, g1 = _D([1, 1], [7, 7]), _D([1], [7])
    assert choose([g0, g1], 1) == (g0, 0)
    g0, g1 = _D([2, 1], [100, 100], base=512), _D([1, 1], [100, 300], base=512)
    assert choose([g0, g1], 50) == (g1, 1)          # fewest requests, then most free KV
    assert choose([g0, g1], 200) == (g1, 1)
    assert choose([g0], 500) is None


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 20), st.integers(0, 3), st.sampled_from([None, 1, 2, 3]),
                          st.integers(0, 5)), max_size=6), st.booleans())
def test_prefiller_choice_is_the_least_loaded_with_room(ps, requeue):
    cands = [_P(q, n, m, off) for q, n, m, off in ps]
    ok = [(p.queued_tokens + p.offset_tokens, i) for i, p in enumerate(cands)
          if requeue or p.max_queue is None or p.n_queued < p.max_queue]
    got = LeastQueuedTokens().choose(cands, requeue)
    assert got is (cands[min(ok)[1]] if ok else None)


def test_prefiller_choice_by_hand():
    choose = LeastQueuedTokens().choose
    a, b, c = _P(10), _P(5), _P(5)
    assert choose([a, b, c], False) is b                # tie b/c -> earlier
    assert choose([a, _P(1, 3, 3), c], False) is c      # full queue skipped
    assert choose([_P(0, 1, 1)], False) is None
    full = _P(0, 1, 1)
    assert choose([a, full], True) is full              # re-routed work ignores the bound
    assert choose([_P(3, off=5), _P(6)], False).queued_tokens == 6   # a starting prefiller's penalty counts


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 8), st.integers(1, 8))
def test_fifo_admits_the_oldest_while_there_is_room(n, room):
    q = deque(range(n))
    got = FifoAdmission().take(q, room)
    assert got == list(range(min(n, room))) and list(q) == list(range(min(n, room), n))


def test_policies_by_name():
    p = Policies.named()
    assert type(p.admission) is FifoAdmission and type(p.rank) is FewestRequests
    with pytest.raises(ValueError, match=r"policies.admission: unknown policy 'nope' \(one of fifo"):
        Policies.named(admission="nope")


def test_scenarios_name_their_policies():
    from rackbed.sim.scenario import parse_scenario
    from rackbed.topology.errors import UserError

    base = {"name": "x", "topology": "hgx-h200", "model": "qwen3-30b-a3b", "prefill": {"tp": 1, "ep": 1, "replicas": 1},
            "decode": {"ep": 1, "replicas": 1}, "workload": {"kind": "trace", "name": "mooncake", "max_requests": 3}}
    sc = parse_scenario(base)
    assert type(sc.sim.policies.build().admission) is FifoAdmission
    with pytest.raises(UserError, match=r"^x.yaml: sim.policies.admission: .*unknown policy 'nope'; one of fifo"):
        parse_scenario({**base, "sim": {"policies": {"admission": "nope"}}}, source="x.yaml")


def _check_rank_indexed(ds, need):
    """choose_indexed (the minima handed in, as the scheduler keeps them) chooses what choose does."""
    p = FewestRequests()
    got = p.choose_indexed(ds, [d.rank_kmin for d in ds], need)
    want = p.choose(ds, need)
    assert (got is None) == (want is None)
    if want is not None:
        assert got[0] is want[0] and got[1] == want[1]


@settings(max_examples=400, deadline=None)
@given(st.lists(st.lists(_rank, min_size=0, max_size=6), min_size=0, max_size=5), st.integers(0, 10))
def test_indexed_rank_choice_is_the_rank_choice(groups, need):
    _check_rank_indexed([_D([x[0] for x in g], [x[1] for x in g], [x[2] for x in g]) for g in groups], need)


def test_indexed_rank_choice_by_hand():
    g0, g1 = _D([1, 0], [5, 2], [True, False]), _D([0, 0], [3, 9])  # the least key is down: the scan decides
    assert FewestRequests().choose_indexed([g0, g1], [g0.rank_kmin, g1.rank_kmin], 1) == (g1, 1)
    g0, g1 = _D([1, 1], [7, 7]), _D([1], [7])  # ties: the earliest group, the lowest rank
    assert FewestRequests().choose_indexed([g0, g1], [g0.rank_kmin, g1.rank_kmin], 1) == (g0, 0)
    assert FewestRequests().choose_indexed([], [], 1) is None


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 20), st.integers(0, 3), st.sampled_from([None, 1, 2, 3]),
                          st.integers(0, 5)), max_size=6), st.booleans())
def test_indexed_prefiller_choice_is_the_prefiller_choice(ps, requeue):
    cands = [_P(q, n, m, off) for q, n, m, off in ps]
    p = LeastQueuedTokens()
    assert p.choose_indexed(cands, [c.queued_tokens + c.offset_tokens for c in cands], requeue) is p.choose(
        cands, requeue)
