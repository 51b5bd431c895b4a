"""``choose_decoder_rank`` (a C-level minimum per group, a scan when that rank does not qualify) picks exactly what
the rule says: the minimum of ``(requests on rank, -free KV, group order, rank)`` over ranks with enough free KV
and an up NIC."""

from hypothesis import given, settings
from hypothesis import strategies as st

from engine.core.router import choose_decoder_rank


class _D:
    def __init__(self, nreq, free, up):
        self.rank_nreq, self.rank_free_kv, self.rank_up = nreq, free, up


@settings(max_examples=400, deadline=None)
@given(st.lists(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 5), st.booleans()), min_size=0, max_size=5),
                min_size=0, max_size=4),
       st.integers(0, 6))
def test_choose_decoder_rank_is_the_constrained_minimum(groups, need):
    ds = [_D([x[0] for x in g], [x[1] for x in g], [x[2] for x in g]) for g in groups]
    cands = [(d.rank_nreq[r], -d.rank_free_kv[r], gi, r) for gi, d in enumerate(ds) for r in range(len(d.rank_nreq))
             if d.rank_free_kv[r] >= need and d.rank_up[r]]
    got = choose_decoder_rank(ds, need)
    if not cands:
        assert got is None
    else:
        best = min(cands)
        assert got is not None and got[0] is ds[best[2]] and got[1] == best[3]


def test_choose_decoder_rank_skips_a_down_or_full_minimum():
    # the unconstrained minimum (rank 0) is down / too small: the scan finds the next best
    assert choose_decoder_rank([_D([0, 1, 1], [9, 5, 7], [False, True, True])], 3)[1] == 2
    assert choose_decoder_rank([_D([0, 1, 1], [2, 5, 7], [True, True, True])], 3)[1] == 2
    g0, g1 = _D([1, 1], [4, 4], [True, True]), _D([0], [1], [True])
    assert choose_decoder_rank([g0, g1], 3) == (g0, 0)
