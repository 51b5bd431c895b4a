"""The fast lane (``python -m pytest -m "not slow"``) for parametrized tests whose cases are quick one by one
but slow together: the first case runs in the lane, every case in the full suite. A helper module: the tests
import it by name under ``pytest`` and ``python -m pytest`` alike."""

from __future__ import annotations

import pytest


def first_in_lane(values, ids=None) -> list:
    """``values`` as ``pytest.param``s for ``parametrize``: all but the first marked ``slow``; ``ids`` a list
    of names or a function of the value."""
    out = []
    for i, v in enumerate(values):
        name = None if ids is None else ids(v) if callable(ids) else ids[i]
        out.append(pytest.param(v, marks=[pytest.mark.slow] if i else [], id=name))
    return out
