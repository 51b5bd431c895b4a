"""The fast-lane helper: a parametrized test's first case stays in the lane, every other case is ``slow``."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from lane import first_in_lane


@given(st.lists(st.integers(), min_size=1, max_size=20), st.booleans())
def test_only_the_first_case_stays_in_the_lane_and_every_case_keeps_its_value_and_id(values, named):
    ids = [f"case{i}" for i in range(len(values))] if named else None
    params = first_in_lane(values, ids=ids)
    assert [p.values for p in params] == [(v,) for v in values]
    assert [p.id for p in params] == (ids or [None] * len(values))
    assert [any(m.name == "slow" for m in p.marks) for p in params] == [False] + [True] * (len(values) - 1)


def test_ids_may_be_a_function_of_the_value():
    assert [p.id for p in first_in_lane([3, 4], ids=lambda v: f"n{v}")] == ["n3", "n4"]
    assert first_in_lane([]) == []


@pytest.mark.parametrize("x", first_in_lane([1, 2]))
def test_a_marked_case_is_deselected_by_the_lane(x, request):
    assert (request.node.get_closest_marker("slow") is not None) == (x == 2)
