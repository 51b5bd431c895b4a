"""Calibration fitting, hold-out bookkeeping, shipped files and their effect on the simulator (CPU only)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from rackbed import topology
from rackbed.engine.core.model import get_model
from rackbed.sim.calibrate import (
    Holdout,
    calibrate,
    calibration_for_topology,
    curve_of,
    default_calibration_for,
    describe_calibration,
    dump_calibration,
    load_calibration_file,
    load_measurements,
    measurement_paths,
    predict_row,
    row_id,
    split_rows,
)
from rackbed.sim.calibration.forms import fit_curve
from rackbed.sim.costs.calibration import CalibrationEntry
from rackbed.sim.costs.gemm import gemm_time, grouped_gemm_time
from rackbed.sim.costs.step import decode_step_time
from rackbed.topology.errors import UserError

REPO = Path(__file__).resolve().parents[1]
H200 = topology.load("h200x2")
GPU = H200.gpu_spec(0)


def _gemm_rows(n, k, ms, t_us, op="dense", fmt="bf16", E=1):
    return [{"bench": "gemm", "op": op, "fmt": fmt, "shape": f"{n}x{k}", "m": m, "n": n, "k": k, "n_experts": E,
             "median_us": t_us(m)} for m in ms]


def _synthetic(floor_us=20.0, tflops=700.0, E=8):
    """Rows from a known curve: time = max(floor, flops / rate)."""
    ms = [2 ** p for p in range(13)]
    rows = []
    for (n, k), op, e in (((3072, 4096), "grouped", E), ((4096, 1536), "grouped", E), ((9216, 4096), "dense", 1),
                          ((4608, 4096), "dense", 1), ((4096, 8192), "dense", 1)):
        rows += _gemm_rows(n, k, ms, lambda m, n=n, k=k, e=e: max(floor_us, 2 * m * e * n * k / tflops / 1e6),
                           op=op, E=e)
    rows += [{"bench": "hbm_copy", "size_bytes": s, "bytes": 2 * s, "median_us": 2.5 + 2 * s / 4000e3}
             for s in [2 ** p for p in range(20, 31)]]
    return {"env": {"gpu_name": "NVIDIA H200", "date": "2026-11-29", "torch": "x", "cuda": "13.0",
                    "nccl": "2.28", "driver": "580"}, "rows": rows}


@pytest.mark.slow
def test_fit_recovers_a_known_curve_at_held_out_points():
    meas = _synthetic()
    doc = calibrate(meas)
    table = load_calibration_file(_dump(doc))
    held = set(doc["meta"]["holdout"])
    assert held, "hold-outs must exist"
    errs = []
    for r in meas["rows"]:
        if row_id(r) in held and not (r["bench"] == "gemm" and (r["n"], r["k"]) == (4096, 8192)):
            errs.append(abs(predict_row(r, table, H200).rel_error))
    # the synthetic curve is a floor then t ∝ m: log-log interpolation is exact except across the knee, where
    # a held-out point between fitted m and 4m is off by at most sqrt(4/2) - 1 = 41 % (knee exactly at 2m)
    assert errs and sorted(errs)[len(errs) // 2] < 1e-3
    assert max(errs) <= math.sqrt(2) - 1 + 1e-6


_dump_n = [0]


def _dump(doc, tmp=None):
    import tempfile

    d = Path(tmp or tempfile.mkdtemp())
    _dump_n[0] += 1
    p = d / f"c{_dump_n[0]}.yaml"
    dump_calibration(doc, p)
    return p


@pytest.mark.slow
@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0.1, 1e4), min_size=2, max_size=12), st.sampled_from(["gemm_tflops", "allreduce_us",
                                                                                 "hbm_GBps", "flash_tflops"]))
def test_fit_curve_passes_through_every_fit_point(ys, kind):
    pts = [(float(2 ** i), y) for i, y in enumerate(ys)]
    e = CalibrationEntry(kind=kind, gpu="G", points=fit_curve(kind, pts))
    for x, y in pts:
        assert e.interpolate(x) == pytest.approx(y, rel=1e-5)


@pytest.mark.slow
@settings(max_examples=100, deadline=None)
@given(st.floats(1.0, 100.0), st.floats(0.0, 50.0), st.floats(1e-4, 1.0), st.integers(5, 10),
       st.sampled_from(["allreduce_us", "hbm_GBps"]))
def test_fit_curve_is_exact_for_its_physical_form(floor, c, s, n, kind):
    """t = max(floor, c + s * x) (launch floor, then latency + bytes / bandwidth) is the base form: the fitted,
    tabulated curve reproduces it *between* the fit points too (tabulation error only)."""
    t = lambda x: max(floor, c + s * x)
    xs = [float(4 ** i) for i in range(n)]
    # identifiable only with >= 2 points clearly on the line (c, s) when any point is at the floor (e.g. floor 65,
    # s 0.25: only x = 1024 is above it, and every line through (256, 65) and (1024, 256) fits the points)
    on_line = [x for x in xs if c + s * x > floor * 1.01]
    assume(len(on_line) >= 2 or all(c + s * x >= floor for x in xs))
    pts = [(x, t(x) if kind == "allreduce_us" else x / t(x)) for x in xs]
    e = CalibrationEntry(kind=kind, gpu="G", points=fit_curve(kind, pts))
    for x in (1.5, 3.0, 7.0, 50.0, 300.0, 5000.0):
        if x <= xs[-1]:
            got = e.interpolate(x) if kind == "allreduce_us" else x / e.interpolate(x)
            # within one tabulation step (2^(1/8)) of the knee the table's log-x interpolation cuts the corner
            near_knee = s > 0 and floor > c and abs(math.log(x * s / (floor - c))) < math.log(2) / 8
            assert got == pytest.approx(t(x), rel=5e-2 if near_knee else 1e-2)


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(1, 1 << 20), min_size=1, max_size=30, unique=True), st.integers(0, 5),
       st.integers(0, 4))
def test_holdout_bookkeeping(ms, every, offset):
    rows = _gemm_rows(3072, 4096, ms, lambda m: 10.0 + m) + _gemm_rows(4096, 8192, ms, lambda m: 10.0 + m)
    fit, held = split_rows(rows, Holdout(every=every, offset=offset, shapes=((4096, 8192),)))
    ids = {row_id(r) for r in rows}
    assert fit | held == ids and not fit & held
    # the held-out shape is entirely held out
    assert all(row_id(r) in held for r in rows if r["k"] == 8192)
    shape = sorted((r["m"], row_id(r)) for r in rows if r["k"] == 4096)
    # end points are always fitted; the held-out points are exactly every `every`-th inner index
    assert shape[0][1] in fit and shape[-1][1] in fit
    for i, (_, rid) in enumerate(shape):
        inner = 0 < i < len(shape) - 1
        expect = inner and every > 0 and i % every == offset % every if every else False
        assert (rid in held) == expect


@pytest.mark.slow
def test_calibration_file_changes_predictions_as_the_table_says(tmp_path):
    meas = _synthetic()
    path = tmp_path / "h200.yaml"
    dump_calibration(calibrate(meas, measurements_path="m.json"), path)
    table = load_calibration_file(path)
    assert describe_calibration(table).startswith("calibrated (rackbed stack): H200-SXM from ")
    # a GEMM at a calibrated (fitted) shape returns the calibrated TFLOP/s
    r = next(r for r in meas["rows"] if r["bench"] == "gemm" and r["n"] == 3072 and r["m"] == 64)
    tflops_meas = 2 * 64 * 8 * 3072 * 4096 / (r["median_us"] * 1e-6) / 1e12
    c = grouped_gemm_time(GPU, [64] * 8, 3072, 4096, "bf16", calib=table)
    assert c.calibrated and c.achieved_tflops == pytest.approx(tflops_meas, rel=1e-5)
    assert table.lookup("gemm_tflops", "H200-SXM", 64, fmt="bf16", n=3072, k=4096) == pytest.approx(tflops_meas,
                                                                                                    rel=1e-5)
    # an unmeasured shape uses the per-format fallback
    assert gemm_time(GPU, 512, 1000, 2000, calib=table).calibrated
    # an uncalibrated GPU is untouched
    b200 = topology.load("hgx-b200").gpu_spec(0)
    assert gemm_time(b200, 64, 3072, 4096, calib=table) == gemm_time(b200, 64, 3072, 4096)


@pytest.mark.slow
def test_decode_step_time_changes_with_the_calibration(tmp_path):
    """Slower measured kernels -> slower simulated decode step; faster -> faster; and only with the table."""
    from rackbed.engine.core.sharding import ParallelPlan

    model = get_model("qwen3-235b-a22b")
    plan = ParallelPlan(role="decode", tp=1, ep=2, dp=2, gpus=(0, 1), weight_format="bf16")
    args = (model, plan, H200, [32, 32], [32 * 4096, 32 * 4096])
    base = decode_step_time(*args).total_s
    slow = load_calibration_file(_dump(calibrate(_synthetic(floor_us=400.0, tflops=50.0)), tmp_path))
    fast = load_calibration_file(_dump(calibrate(_synthetic(floor_us=1.0, tflops=950.0)), tmp_path))
    t_slow = decode_step_time(*args, calib=slow).total_s
    t_fast = decode_step_time(*args, calib=fast).total_s
    assert t_slow > base > t_fast
    # the GEMM part moves by what the table says: every grouped expert GEMM at >= 400 µs per call
    br = __import__("rackbed.sim.costs.step", fromlist=["x"]).decode_step_breakdown(*args, calib=slow)
    assert br.to_steptime().total_s == pytest.approx(t_slow)


@pytest.mark.slow
def test_shipped_h200_file_is_found_and_described():
    table = default_calibration_for("H200-SXM")
    assert table is not None
    line = describe_calibration(table)
    assert line.startswith("calibrated (rackbed stack): H200-SXM from calibration/h200.yaml (") and "kinds" in line
    assert calibration_for_topology(H200) is not None
    # GB200 is calibrated from imported tables only: the auto stack is trtllm; the engine's own stack has none
    gb = default_calibration_for("B200-GB200")
    assert gb is not None and gb.meta["stack"] == "trtllm" and gb.meta["source"] == "aiconfigurator-core"
    assert calibration_for_topology(topology.load("gb200-nvl72")).meta["stack"] == "trtllm"
    assert default_calibration_for("H200-SXM", stack="trtllm").meta["stack"] == "trtllm"
    assert default_calibration_for("H200-SXM", stack="auto").meta.get("stack", "rackbed") == "rackbed"
    with pytest.raises(UserError, match=r"stack: no calibration of stack 'rackbed' is shipped for B200-GB200 "
                                        r"\(shipped: trtllm"):
        default_calibration_for("B200-GB200", stack="rackbed")
    assert describe_calibration(None, "B200-GB200").startswith("uncalibrated for B200-GB200")
    meta = table.meta
    for f in ("device", "driver", "torch", "cuda", "nccl", "date", "holdout", "holdout_rule"):
        assert meta.get(f), f


@pytest.mark.slow
def test_shipped_measurements_fit_reproduces_the_shipped_file(tmp_path):
    """The shipped file is, byte for byte, what `rackbed calibrate --from-measurements` writes from the shipped raw
    rows (the files ``meta.measurements`` lists, fitted together: the full v10 run and the later fp8_block / MoE
    block run)."""
    table = default_calibration_for("H200-SXM")
    paths = measurement_paths(table.meta)
    assert len(paths) == 3 and [s["path"] for s in table.meta["sources"]] == paths
    doc = calibrate(load_measurements(paths), measurements_path=paths)
    assert [e["points"] for e in doc["entries"]] == [[list(p) for p in e.points] for e in table.entries]
    assert sorted(doc["meta"]["holdout"]) == sorted(table.meta["holdout"])
    assert doc["kernel_fixed_us"] == table.kernel_fixed_us and doc["version"] == table.version == 2
    out = tmp_path / "h200.yaml"
    dump_calibration(doc, out)
    assert out.read_bytes() == (REPO / "calibration" / "h200.yaml").read_bytes()


def test_curve_of_uses_the_cost_model_conventions():
    r = {"bench": "flash_prefill", "seq": 1024, "n_q_heads": 64, "n_kv_heads": 4, "head_dim": 128,
         "median_us": 102.5}
    kind, key, x, y = curve_of(r)
    assert kind == "flash_tflops" and dict(key) == {"head_dim": 128} and x == 1024
    assert y == pytest.approx(4 * 64 * 128 * 1024 * 1025 / 2 / 100e-6 / 1e12)
    assert curve_of({"bench": "p2p_copy", "src": 0, "dst": 1, "size_bytes": 8, "median_us": 1.0}) == (
        "p2p_us", (("route", "nvlink"),), 8.0, 1.0)
    assert curve_of({"bench": "nvme_read", "size_bytes": 8, "median_us": 1.0}) is None  # no kind covers it
    assert curve_of({"bench": "gemm", "error": "boom"}) is None


def test_bad_files_are_one_line_user_errors(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text("version: 1\nmeta: {schema: other/9}\nentries: []\n")
    with pytest.raises(UserError, match="meta.schema"):
        load_calibration_file(p)
    p.write_text("version: 1\nentries:\n  - {kind: gemm_tflops, gpu: X, key: {bogus: 1}, points: [[1, 2]]}\n")
    with pytest.raises(UserError, match="bogus"):
        load_calibration_file(p)
    with pytest.raises(UserError, match="unknown GPU"):
        calibrate({"env": {"gpu_name": "Mystery GPU"}, "rows": _synthetic()["rows"]})
