"""``engine.core.metrics.request_arrays``: the conversion block by block gives exactly the arrays of one
column-by-column conversion of all rows (same dtypes, same values bit for bit, NaN and -0.0 included) for any block
size, and rows of other shapes (a short or long row, a list) still convert as before."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rackbed.engine.core.metrics import request_arrays
from rackbed.engine.core.state import ROW_FIELDS

_TEXT = ("status", "reason", "prefiller", "decoder")
_INT = ("id", "prompt_tokens", "output_tokens", "decode_steps", "requeues")


def _by_column(rows, fields):
    cols = list(zip(*rows)) if rows else [[] for _ in fields]
    out = {}
    for name, col in zip(fields, cols):
        dt = object if name in _TEXT else np.int64 if name in _INT else np.float64
        out[name] = np.asarray(col, dtype=dt)
    return out


def _same(a: dict, b: dict) -> None:
    assert list(a) == list(b)
    for k in a:
        x, y = a[k], b[k]
        assert x.dtype == y.dtype and x.shape == y.shape and x.flags.c_contiguous, k
        if x.dtype == object:
            assert list(x) == list(y) and all(type(p) is type(q) for p, q in zip(x, y)), k
        else:
            assert x.tobytes() == y.tobytes(), k


_floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.just(math.nan), st.just(-0.0),
                    st.integers(-(2**40), 2**40))
_ints = st.integers(-(2**62), 2**62)
_text = st.sampled_from(["done", "rejected", "", "horizon", "P0", "D12", "ünï"])


def _row():
    return st.tuples(*[(_text if f in _TEXT else _ints if f in _INT else _floats) for f in ROW_FIELDS])


@pytest.mark.slow
@settings(max_examples=200, deadline=None)
@given(st.lists(_row(), max_size=40), st.integers(1, 12))
def test_blocked_conversion_equals_column_conversion(rows, block):
    _same(request_arrays(rows, ROW_FIELDS, block=block), _by_column(rows, ROW_FIELDS))
    _same(request_arrays(rows, ROW_FIELDS), _by_column(rows, ROW_FIELDS))


@settings(max_examples=50, deadline=None)
@given(st.lists(_row(), min_size=1, max_size=10), st.integers(0, 9), st.sampled_from(["list", "long", "short"]),
       st.integers(1, 4))
def test_rows_of_other_shapes_convert_as_before(rows, i, how, block):
    rows = list(rows)
    i %= len(rows)
    rows[i] = list(rows[i]) if how == "list" else rows[i] + (1.0,) if how == "long" else rows[i][:-3]
    _same(request_arrays(rows, ROW_FIELDS, block=block), _by_column(rows, ROW_FIELDS))


def test_empty():
    _same(request_arrays([], ROW_FIELDS), _by_column([], ROW_FIELDS))
