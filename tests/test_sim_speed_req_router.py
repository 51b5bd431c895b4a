"""``choose_decoder_rank_keyed`` (one combined int key per rank, kept by the scheduler) chooses exactly what the
straightforward ``choose_decoder_rank`` chooses, including the scan when the unconstrained minimum does not qualify.
The scheduler keeps the keys equal to ``nreq * base - free KV`` (``Scheduler.check_invariants``, run by the
scheduler's stateful tests)."""

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.core.router import choose_decoder_rank, choose_decoder_rank_keyed


class _D:
    def __init__(self, nreq, free, up, base=16):
        self.rank_nreq, self.rank_free_kv, self.rank_up = nreq, free, up
        self.rank_key = [n * base - f for n, f in zip(nreq, free)]  # base > every free KV


_rank = st.tuples(st.integers(0, 4), st.integers(0, 9), st.booleans())


@settings(max_examples=600, deadline=None)
@given(st.lists(st.lists(_rank, min_size=0, max_size=6), min_size=0, max_size=4), st.integers(0, 10))
def test_keyed_choice_equals_the_plain_choice(groups, need):
    ds = [_D([x[0] for x in g], [x[1] for x in g], [x[2] for x in g]) for g in groups]
    got = choose_decoder_rank_keyed(ds, need)
    want = choose_decoder_rank(ds, need)
    assert (got is None) == (want is None)
    if want is not None:
        assert got[0] is want[0] and got[1] == want[1]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.tuples(st.integers(0, 2), st.integers(0, 2**40), st.booleans()), min_size=1,
                         max_size=16), min_size=1, max_size=3), st.integers(0, 2**40))
def test_keyed_choice_equals_the_plain_choice_large_kv(groups, need):
    ds = [_D([x[0] for x in g], [x[1] for x in g], [x[2] for x in g], base=2 ** 40 + 1) for g in groups]
    got = choose_decoder_rank_keyed(ds, need)
    want = choose_decoder_rank(ds, need)
    assert (got is None) == (want is None)
    if want is not None:
        assert got[0] is want[0] and got[1] == want[1]


def test_keyed_choice_skips_a_down_or_full_minimum():
    assert choose_decoder_rank_keyed([_D([0, 1, 1], [9, 5, 7], [False, True, True])], 3)[1] == 2
    assert choose_decoder_rank_keyed([_D([0, 1, 1], [2, 5, 7], [True, True, True])], 3)[1] == 2
    g0, g1 = _D([1, 1], [4, 4], [True, True]), _D([0], [1], [True])
    assert choose_decoder_rank_keyed([g0, g1], 3) == (g0, 0)
    # ties on requests: the most free KV wins, then the earliest group / lowest rank
    g0, g1 = _D([2, 1, 1], [9, 5, 7], [True, True, True]), _D([1, 1], [7, 8], [True, True])
    assert choose_decoder_rank_keyed([g0, g1], 1) == (g1, 1)
    g0, g1 = _D([1, 1], [7, 7], [True, True]), _D([1], [7], [True])
    assert choose_decoder_rank_keyed([g0, g1], 1) == (g0, 0)
