"""The skewed row counts of the ``moe_skew`` benchmark (the busiest-rank GEMM under power-law routing): every count
sums to its rows, a steeper exponent concentrates rows on the first experts, and the draw is reproducible."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from rackbed.kernels.bench.moe_skew import cases, skewed_counts


@settings(max_examples=40, deadline=None)
@given(rows=st.integers(0, 5000), experts=st.integers(1, 64), alpha=st.floats(0, 2), seed=st.integers(0, 99))
def test_counts_sum_to_the_rows_and_repeat(rows, experts, alpha, seed):
    c = skewed_counts(rows, experts, alpha, seed)
    assert len(c) == experts and sum(c) == rows and min(c) >= 0
    assert c == skewed_counts(rows, experts, alpha, seed)


def test_a_steeper_exponent_loads_the_hottest_expert_more():
    hot = [max(skewed_counts(20000, 32, a, seed=1)) for a in (0.0, 1.0, 1.2)]
    assert hot[0] < hot[1] < hot[2]
    assert max(skewed_counts(20000, 32, 0.0, seed=1)) < 1.2 * 20000 / 32


def test_the_sweep_covers_ep4_and_ep8_ranks_at_each_exponent():
    cs = cases()
    assert {(c["experts"], c["alpha"]) for c in cs} == {(e, a) for e in (16, 32) for a in (0.0, 1.0, 1.2)}
    assert all(sum(c["counts"]) == c["rows"] for c in cs)
