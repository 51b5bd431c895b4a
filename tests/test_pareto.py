"""rackbed.sim.pareto: the front is exactly the set of non-dominated points (hypothesis, against the definition)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rackbed.sim.pareto import dominates, pareto_front, pareto_indices, pareto_layers


def brute_dominated(values, i, sense=None):
    return any(dominates(values[j], values[i], sense) for j in range(len(values)) if j != i)


# small integer grids make ties and duplicates common, which is where front code goes wrong
coord = st.one_of(st.integers(0, 6).map(float), st.floats(0, 1e4, allow_nan=False))
pts2 = st.lists(st.tuples(coord, coord), max_size=40)
pts3 = st.lists(st.tuples(coord, coord, coord), max_size=30)
senses2 = st.sampled_from([("max", "max"), ("max", "min"), ("min", "min"), ("min", "max")])


@pytest.mark.slow
@settings(max_examples=400, deadline=None)
@given(pts2, senses2)
def test_front_2d_is_exactly_the_non_dominated_points(values, sense):
    front = set(pareto_indices(values, sense))
    for i in range(len(values)):
        if i in front:
            assert not brute_dominated(values, i, sense), (values, sense, i)  # no returned point is dominated
        else:
            assert brute_dominated(values, i, sense), (values, sense, i)  # every non-dominated one is returned


@pytest.mark.slow
@settings(max_examples=200, deadline=None)
@given(pts3)
def test_front_3d_is_exactly_the_non_dominated_points(values):
    front = set(pareto_indices(values))
    for i in range(len(values)):
        assert (i in front) == (not brute_dominated(values, i)), (values, i)


@pytest.mark.slow
@settings(max_examples=150, deadline=None)
@given(pts2)
def test_layers_partition_and_each_layer_is_the_front_of_the_rest(values):
    layers = pareto_layers(values)
    flat = [i for layer in layers for i in layer]
    assert sorted(flat) == list(range(len(values)))
    rest = list(range(len(values)))
    for layer in layers:
        sub = [values[i] for i in rest]
        assert sorted(layer) == sorted(rest[j] for j in pareto_indices(sub))
        rest = [i for i in rest if i not in set(layer)]


def test_hand_example_and_duplicates():
    # (tok/s/GPU, tok/s/user): (3,1) and (1,3) trade off; (2,2) too; (1,1) is dominated; duplicates both kept
    vals = [(3, 1), (1, 3), (2, 2), (1, 1), (2, 2), (3, 0.5)]
    assert pareto_indices(vals) == [0, 1, 2, 4]
    assert pareto_indices(vals, ("min", "min")) == [3, 5]
    items = ["a", "b", "c", "d", "e", "f"]
    assert pareto_front(items, key=lambda s: vals[items.index(s)]) == ["a", "b", "c", "e"]


def test_missing_values_are_never_on_the_front_and_never_dominate():
    vals = [(1.0, 1.0), (math.nan, 5.0), (None, 9.0), (0.5, 0.5)]
    assert pareto_indices(vals) == [0]
    assert not dominates((math.nan, 9), (1, 1))
    assert pareto_indices([]) == []


def test_bad_input_is_a_value_error():
    with pytest.raises(ValueError, match="objectives"):
        pareto_indices([(1, 2), (1, 2, 3)])
    with pytest.raises(ValueError, match="sense"):
        pareto_indices([(1, 2)], ("max", "up"))
