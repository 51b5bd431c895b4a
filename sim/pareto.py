"""Pareto fronts (pure; no numpy needed).

A point is a tuple of objective values. With ``sense[i] == "max"`` larger is better on objective ``i``, with
``"min"`` smaller is better. Point ``a`` *dominates* ``b`` when it is at least as good on every objective and
strictly better on at least one. The *front* is the set of points no other point dominates; equal points do not
dominate each other, so duplicates on the front are all kept. Points with a NaN or None value are never on the
front and never dominate (they are "not measured").

Used by ``sim.search`` (tokens/s per GPU vs tokens/s per user, both maximised) and ``sim.report``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TypeVar

T = TypeVar("T")

MAX, MIN = "max", "min"


def _signed(values: Sequence[Sequence[float | None]], sense: Sequence[str] | None) -> list[tuple[float, ...] | None]:
    """Each point as a tuple to maximise (min objectives negated); None for points with a missing value."""
    out: list[tuple[float, ...] | None] = []
    n_obj = None
    for v in values:
        v = tuple(v)
        if n_obj is None:
            n_obj = len(v)
            if sense is not None and len(sense) != n_obj:
                raise ValueError(f"pareto: {len(sense)} senses for {n_obj} objectives")
        elif len(v) != n_obj:
            raise ValueError(f"pareto: points have {n_obj} and {len(v)} objectives")
        if any(x is None or (isinstance(x, float) and math.isnan(x)) for x in v):
            out.append(None)
            continue
        s = sense or (MAX,) * len(v)
        for x in s:
            if x not in (MAX, MIN):
                raise ValueError(f"pareto: sense must be 'max' or 'min', got {x!r}")
        out.append(tuple(float(x) if d == MAX else -float(x) for x, d in zip(v, s)))
    return out


def dominates(a: Sequence[float], b: Sequence[float], sense: Sequence[str] | None = None) -> bool:
    """True when ``a`` dominates ``b`` (module docstring)."""
    sa, sb = _signed([a, b], sense)
    if sa is None or sb is None:
        return False
    return all(x >= y for x, y in zip(sa, sb)) and any(x > y for x, y in zip(sa, sb))


def pareto_indices(values: Sequence[Sequence[float | None]], sense: Sequence[str] | None = None) -> list[int]:
    """Indices (ascending) of the non-dominated points of ``values`` (n points x m objectives).

    Two objectives: one sort and a sweep, O(n log n). More: pairwise against the running front, O(n * front).
    """
    pts = _signed(values, sense)
    idx = [i for i, p in enumerate(pts) if p is not None]
    if not idx:
        return []
    m = len(pts[idx[0]])  # type: ignore[arg-type]
    if m == 1:
        best = max(pts[i][0] for i in idx)  # type: ignore[index]
        return [i for i in idx if pts[i][0] == best]  # type: ignore[index]
    if m == 2:
        # best first objective first; within ties, best second first. A point is on the front iff its second
        # objective beats every point with a strictly better first objective, and equals-or-beats the best of its
        # own first-objective tie group (the group's leader is its best second objective).
        order = sorted(idx, key=lambda i: (-pts[i][0], -pts[i][1]))  # type: ignore[index]
        front: list[int] = []
        best_y_before = -math.inf  # best y among points with a strictly larger x
        k = 0
        while k < len(order):
            x = pts[order[k]][0]  # type: ignore[index]
            j = k
            while j < len(order) and pts[order[j]][0] == x:  # type: ignore[index]
                j += 1
            group = order[k:j]
            top_y = pts[group[0]][1]  # type: ignore[index]
            if top_y > best_y_before:
                front.extend(i for i in group if pts[i][1] == top_y)  # type: ignore[index]
            best_y_before = max(best_y_before, top_y)
            k = j
        return sorted(front)
    front = []
    for i in sorted(idx, key=lambda i: tuple(-x for x in pts[i])):  # type: ignore[union-attr]
        p = pts[i]
        if not any(_dom(pts[j], p) for j in front):  # type: ignore[arg-type]
            front.append(i)
    return sorted(front)


def _dom(a: tuple[float, ...], b: tuple[float, ...]) -> bool:
    return all(x >= y for x, y in zip(a, b)) and any(x > y for x, y in zip(a, b))


def pareto_front(items: Sequence[T], key: Callable[[T], Sequence[float | None]],
                 sense: Sequence[str] | None = None) -> list[T]:
    """The non-dominated items, in their input order; ``key(item)`` gives its objective values."""
    return [items[i] for i in pareto_indices([key(it) for it in items], sense)]


def pareto_layers(values: Sequence[Sequence[float | None]], sense: Sequence[str] | None = None) -> list[list[int]]:
    """Non-dominated sorting: layer 0 is the front, layer 1 the front of the rest, ... (points with a missing
    value are left out). Used to keep the most promising candidates when a budget caps how many are simulated."""
    remaining = list(range(len(values)))
    layers: list[list[int]] = []
    pts = _signed(values, sense)
    remaining = [i for i in remaining if pts[i] is not None]
    while remaining:
        sub = pareto_indices([values[i] for i in remaining], sense)
        layer = [remaining[j] for j in sub]
        layers.append(layer)
        taken = set(layer)
        remaining = [i for i in remaining if i not in taken]
    return layers
