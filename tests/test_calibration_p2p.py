"""The ``p2p_us`` calibration kind (GPU-to-GPU copies), the time-curve extension above the measured range, and
``rackbed validate --repeat`` (run-to-run differences beside the errors)."""

from __future__ import annotations

import itertools
import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rackbed import topology
from rackbed.engine.cli.validate import validate_kernels
from rackbed.sim.calibrate import (
    CalibrationFile,
    Holdout,
    calibrate,
    curve_of,
    load_calibration_file,
    predict_row,
    row_id,
    split_rows,
)
from rackbed.sim.costs.calibration import CalibrationEntry, CalibrationTable
from rackbed.sim.costs.collective import p2p_copy_time

H200 = topology.load("h200x2")
GPU = H200.gpu_spec(0)


def _p2p_rows(lat_us: float, GBps: float, sizes=None) -> list[dict]:
    sizes = sizes or [2**p for p in range(12, 31)]
    return [{"bench": "p2p_copy", "src": 0, "dst": 1, "size_bytes": s, "median_us": lat_us + s / GBps / 1e3}
            for s in sizes]


def test_p2p_rows_become_a_calibrated_curve_keyed_by_route():
    rows = _p2p_rows(13.0, 390.0)
    assert curve_of(rows[0])[:2] == ("p2p_us", (("route", "nvlink"),))
    doc = calibrate({"rows": rows}, gpu=GPU.name)
    (e,) = [CalibrationEntry(**x) for x in doc["entries"] if x["kind"] == "p2p_us"]
    assert e.key == {"route": "nvlink"} and doc["meta"]["not_calibrated"] == []
    table = CalibrationTable(entries=(e,))
    _, held = split_rows(rows, Holdout())
    for r in rows:  # latency + bytes / rate is the form's own shape: held-out sizes within 1 %
        p = predict_row(r, table, H200)
        assert p.model == "p2p_copy_time" and p.extra["calibrated"]
        if row_id(r) in held:
            assert p.predicted_s == pytest.approx(p.measured_s, rel=0.01)


def test_p2p_uncalibrated_is_line_rate_plus_latency_and_local_copies_are_free():
    c = p2p_copy_time(H200, 0, 1, 2**30)
    assert not c.calibrated and c.route == "nvlink"
    assert c.total_s == pytest.approx(2**30 / (H200.p2p_GBps(0, 1) * 1e9) + H200.p2p_latency_us(0, 1) * 1e-6)
    assert p2p_copy_time(H200, 1, 1, 2**20).total_s == 0.0 == p2p_copy_time(H200, 0, 1, 0).total_s


@pytest.mark.slow
@settings(max_examples=60, deadline=None)
@given(st.floats(1.0, 30.0), st.floats(50.0, 900.0), st.floats(1.0, 64.0))
def test_p2p_beyond_the_measured_range_keeps_the_rate_and_the_floor(lat_us, GBps, factor):
    """Above the largest measured copy the time grows at the last interval's rate (not clamped); below the
    smallest it stays at that copy's time (the latency floor); in between it is monotone in size."""
    rows = _p2p_rows(lat_us, GBps, [2**p for p in range(12, 25)])
    doc = calibrate({"rows": rows}, gpu=GPU.name, holdout=Holdout(every=0))
    table = CalibrationTable(entries=tuple(CalibrationEntry(**x) for x in doc["entries"]))
    big = 2**24 * factor
    t = p2p_copy_time(H200, 0, 1, big, calib=table).total_s * 1e6
    assert t == pytest.approx(lat_us + big / GBps / 1e3, rel=0.02)
    small = p2p_copy_time(H200, 0, 1, 1024, calib=table).total_s * 1e6
    assert small == pytest.approx(lat_us + 4096 / GBps / 1e3, rel=1e-3)
    ts = [p2p_copy_time(H200, 0, 1, 2**(p / 3), calib=table).total_s for p in range(36, 75)]
    assert all(b >= a * (1 - 1e-9) for a, b in itertools.pairwise(ts))


@given(st.lists(st.floats(0.5, 1e4), min_size=2, max_size=8, unique=True), st.floats(1.0, 100.0))
def test_extend_is_interpolate_inside_and_linear_above(ys, k):
    ys = sorted(ys)
    pts = tuple((2.0**i, y) for i, y in enumerate(ys))
    e = CalibrationEntry(kind="p2p_us", gpu="G", points=pts)
    for x, _ in pts:
        assert e.extend(x) == e.interpolate(x)
    x1, y1 = pts[-1]
    x0, y0 = pts[-2]
    assert e.extend(x1 * k) == pytest.approx(y1 + (x1 * k - x1) * (y1 - y0) / (x1 - x0))


def test_unknown_key_of_p2p_kind_is_one_line_error():
    with pytest.raises(ValueError, match="not a key of kind 'p2p_us'"):
        CalibrationTable(entries=(CalibrationEntry(kind="p2p_us", gpu="G", key={"nic": "x"}, points=((1, 1),)),))


def test_repeat_measurement_reports_run_to_run_difference():
    rows = _p2p_rows(13.0, 390.0)
    doc = calibrate({"rows": rows}, gpu=GPU.name)
    table = CalibrationFile(entries=tuple(CalibrationEntry(**x) for x in doc["entries"]), meta=doc["meta"])
    again = [{**r, "median_us": r["median_us"] * (1.02 if i % 2 else 0.99)} for i, r in enumerate(rows)]
    res = validate_kernels({"rows": rows}, table, H200, repeat={"rows": again})
    held = [r for r in res["rows"] if r["role"] == "holdout"]
    assert held and all(r["repeat_rel"] in (pytest.approx(0.02), pytest.approx(-0.01)) for r in held)
    s = res["summary"]
    assert s["repeat"]["n"] == len(held) and s["repeat"]["max_abs"] == pytest.approx(
        max(abs(r["repeat_rel"]) for r in held))
    assert s["holdout"]["within_max_target"] == len(held) and s["holdout"]["p90_abs"] <= s["holdout"]["max_abs"]
    assert "repeat" not in validate_kernels({"rows": rows}, table, H200)["summary"]


def test_shipped_file_loads_with_the_new_kind(tmp_path):
    doc = calibrate({"rows": _p2p_rows(13.0, 390.0)}, gpu=GPU.name)
    p = tmp_path / "c.json"
    p.write_text(json.dumps(doc))
    t = load_calibration_file(p)
    assert t.entry("p2p_us", GPU.name, route="nvlink") is not None
    assert t.entry("p2p_us", GPU.name, route="net") is None and math.isfinite(
        p2p_copy_time(H200, 0, 1, 1e6, calib=t).total_s)
