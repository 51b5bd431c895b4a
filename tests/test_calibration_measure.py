"""Measurement format rackbed.measure/2 (graph replay, rounds with spread), the decode-attention calibration kind
and the per-row noise that `rackbed validate` reports — all on the CPU."""

from __future__ import annotations

import itertools
import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rackbed import topology
from rackbed.engine.cli.main import main
from rackbed.engine.cli.validate import validate_kernels
from rackbed.engine.core.model import get_model
from rackbed.kernels.bench import measure
from rackbed.sim.calibrate import (
    Holdout,
    calibrate,
    check_measurements,
    curve_of,
    dump_calibration,
    load_calibration_file,
    row_id,
    row_noise,
    split_rows,
)
from rackbed.sim.costs import constants as C
from rackbed.sim.costs.attention import full_attention_decode
from rackbed.sim.costs.calibration import CalibrationEntry, CalibrationTable
from rackbed.topology.errors import UserError

H200 = topology.load("h200x2")
GPU = H200.gpu_spec(0)
KV_TOKEN = 2 * 4 * 128 * 2  # K and V, 4 KV heads of 128, bf16


# ------------------------------------------------------------------------------------------------ grids / stats

@pytest.mark.parametrize("grid, lo, hi, per_octave", [
    (measure.ALLREDUCE_SIZES, 32768, 8 * 2**20, 2), (measure.GROUPED_M, 32, 512, 4), (measure.GEMM_M, 64, 1024, 4),
    (measure.FLASH_SEQ, 1024, 16384, 2), (measure.HBM_SIZES, 2**18, 2**24, 4), (measure.HBM_SIZES, 2**24, 2**31, 2),
    (measure.DECODE_CTX, 256, 4096, 4), (measure.DECODE_CTX, 4096, 65536, 2), (measure.P2P_SIZES, 2**12, 2**26, 2)])
def test_dense_grids_are_spaced_where_asked(grid, lo, hi, per_octave):
    """Every grid is dense where it says (quarter-octave or √2 spacing, within the rounding to a multiple)."""
    assert lo in grid and hi in grid and grid == sorted(set(grid))
    inside = [x for x in grid if lo <= x <= hi]
    ratios = [b / a for a, b in itertools.pairwise(inside)]
    assert len(inside) >= per_octave * round(math.log2(hi / lo)) + 1
    step = 2 ** (1 / per_octave)
    assert all(step / 1.13 < q < step * 1.1 for q in ratios), ratios


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 4096), st.integers(0, 8), st.sampled_from([1, 2, 4]), st.sampled_from([1, 8, 256]))
def test_geo_grid_is_sorted_bounded_and_rounded(lo, octaves, per_octave, mult):
    hi = lo * 2 ** octaves
    g = measure.geo(lo, hi, per_octave, mult)
    assert g == sorted(set(g)) and all(x % mult == 0 for x in g)
    assert g[0] == max(mult, round(lo / mult) * mult) and g[-1] <= max(mult, round(hi / mult) * mult)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(0.1, 1e6), min_size=1, max_size=15))
def test_round_stats_order_and_median(ts):
    s = measure.round_stats(ts)
    assert s["min_us"] <= s["q1_us"] <= s["median_us"] <= s["q3_us"] <= s["max_us"]
    assert s["rounds"] == len(ts) and len(s["rounds_us"]) == len(ts)
    assert s["median_us"] == pytest.approx(sorted(ts)[(len(ts) - 1) // 2] if len(ts) % 2 else
                                           (sorted(ts)[len(ts) // 2 - 1] + sorted(ts)[len(ts) // 2]) / 2)


def test_dry_run_writes_rounds_and_spread(tmp_path):
    out = tmp_path / "m.json"
    doc = measure.run(dry_run=True, only=["decode", "flash"], partial_out=out, echo=lambda *a: None)
    on_disk = json.loads(out.read_text())
    assert on_disk["schema"] == "rackbed.measure/2" and on_disk["complete"] and doc["complete"]
    rows = on_disk["rows"]
    assert {r["bench"] for r in rows} == {"attn_decode", "flash_prefill"}
    for r in rows:
        assert r["timing"] == "host" and r["rounds"] == 3 and len(r["rounds_us"]) == 3
        assert r["min_us"] <= r["median_us"] <= r["max_us"]
        assert row_noise(r) == pytest.approx((r["max_us"] - r["min_us"]) / 2 / r["median_us"])


def test_budget_skips_benchmarks(tmp_path):
    doc = measure.run(dry_run=True, only=["hbm", "flash"], partial_out=tmp_path / "m.json", echo=lambda *a: None,
                      budget_s=0.0)
    assert [r["error"] for r in doc["rows"]] == ["skipped: time budget"] * 2


# ------------------------------------------------------------------------------------------------ decode kind

def _decode_t_us(batch, ctx, floor=12.0, bw_GBps=3000.0, lat=4.0):
    """A known decode-attention time: launch floor, then latency + KV bytes at a rate that grows with the
    number of (sequence, KV head) units."""
    bw = bw_GBps * min(1.0, (batch * 4) / 256) ** 0.3
    return max(floor, lat + batch * ctx * KV_TOKEN / (bw * 1e3))


def _rows_v2(spread=0.02):
    rows = []
    for b in (1, 4, 16, 64):
        for c in measure.DECODE_CTX:
            t = _decode_t_us(b, c)
            rows.append({"bench": "attn_decode", "batch": b, "ctx": c, "n_q_heads": 64, "n_kv_heads": 4,
                         "head_dim": 128, "kv_bytes": b * c * KV_TOKEN, "median_us": t, "min_us": t * (1 - spread),
                         "max_us": t * (1 + spread), "q1_us": t, "q3_us": t, "rounds": 9, "timing": "graph"})
    for s in measure.ALLREDUCE_SIZES:
        t = max(14.0, 8.0 + s / 150e3)
        rows.append({"bench": "allreduce", "algo": "ring", "impl": "nccl", "n_ranks": 2, "size_bytes": s,
                     "median_us": t, "min_us": t * (1 - spread), "max_us": t * (1 + spread), "timing": "graph"})
    return {"schema": "rackbed.measure/2", "env": {"gpu_name": "NVIDIA H200", "date": "2026-12-01"}, "rows": rows}


def _v1(doc):
    keep = ("min_us", "max_us", "q1_us", "q3_us", "rounds", "rounds_us", "timing")
    return {"schema": "rackbed.measure/1", "env": doc["env"],
            "rows": [{k: v for k, v in r.items() if k not in keep} for r in doc["rows"]]}


def test_decode_rows_are_a_calibration_kind_per_seq_heads():
    r = _rows_v2()["rows"][0]
    kind, key, x, y = curve_of(r)
    assert kind == "decode_attn_GBps" and dict(key) == {"head_dim": 128, "seq_heads": 4} and x == r["ctx"]
    assert y == pytest.approx(r["kv_bytes"] / (r["median_us"] - C.KERNEL_FIXED_US) / 1e3)


@pytest.mark.slow
def test_new_and_old_format_fit_the_same_with_the_same_holdouts(tmp_path):
    new = _rows_v2()
    d2, d1 = calibrate(new), calibrate(_v1(new))
    assert d2["entries"] == d1["entries"] and d2["meta"]["holdout"] == d1["meta"]["holdout"]
    assert d2["meta"]["measure_schema"] == "rackbed.measure/2" and d1["meta"]["measure_schema"] == "rackbed.measure/1"
    kinds = {e["kind"] for e in d2["entries"]}
    assert kinds == {"decode_attn_GBps", "allreduce_us"}
    assert sorted(e["key"]["seq_heads"] for e in d2["entries"] if e["kind"] == "decode_attn_GBps") == [4, 16, 64, 256]
    # held-out rule unchanged: every third inner point per curve
    ctx = measure.DECODE_CTX
    held = set(d2["meta"]["holdout"])
    assert {f"attn_decode/b16/c{c}" for c in ctx} & held == {f"attn_decode/b16/c{ctx[i]}"
                                                             for i in range(1, len(ctx) - 1, 3)}


@pytest.mark.slow
def test_validate_reports_noise_for_new_format_only(tmp_path):
    new = _rows_v2(spread=0.05)
    for doc, has in ((new, True), (_v1(new), False)):
        p = tmp_path / f"c{int(has)}.yaml"
        dump_calibration(calibrate(doc), p)
        res = validate_kernels(doc, load_calibration_file(p), H200)
        held = [r for r in res["rows"] if r["role"] == "holdout"]
        assert held and {r["bench"] for r in held} == {"attn_decode", "allreduce"}
        nz = res["summary"]["noise"]
        if has:
            assert all(r["noise"] == pytest.approx(0.05) for r in held)
            assert all(r["within_noise"] == (abs(r["rel_error"]) <= 0.05) for r in held)
            assert nz["rows_with_spread"] == len(held) and nz["within_noise"] >= 1
        else:
            assert all(r["noise"] is None and r["within_noise"] is None for r in held)
            assert nz["rows_with_spread"] == 0
        # the known curve is smooth: held-out decode rows are predicted well by the fitted kind
        dec = [abs(r["rel_error"]) for r in held if r["bench"] == "attn_decode"]
        assert max(dec) < 0.05


@pytest.mark.slow
def test_decode_calibration_changes_the_simulator_prediction():
    doc = _rows_v2()
    table = CalibrationTable.model_validate({"entries": calibrate(doc)["entries"]})
    model = get_model("qwen3-235b-a22b")
    for b, c in ((16, 4096), (64, 1024), (4, 65536)):
        r = next(r for r in doc["rows"] if r.get("batch") == b and r.get("ctx") == c)
        cal = full_attention_decode(GPU, model, [c] * b, tp=1, page_tokens=1, calib=table).core_s
        assert cal == pytest.approx(r["median_us"] * 1e-6, rel=1e-3)  # a fitted point: the measurement itself
        uncal = full_attention_decode(GPU, model, [c] * b, tp=1, page_tokens=1).core_s
        assert abs(uncal / cal - 1) > 0.01  # and it differs from the uncalibrated model
    # a batch between the measured ones (32 sequences = 128 units) lies between its neighbours' rates
    t16, t32, t64 = (full_attention_decode(GPU, model, [2048] * b, tp=1, page_tokens=1, calib=table).core_s / b
                     for b in (16, 32, 64))
    assert min(t16, t64) <= t32 <= max(t16, t64)
    # TP=2 halves the local KV heads: 16 sequences x 2 heads = 32 units, between the b4 and b16 curves
    r = table.lookup_along("decode_attn_GBps", GPU.name, 2048, "seq_heads", 32, head_dim=128)
    lo, hi = (table.lookup("decode_attn_GBps", GPU.name, 2048, head_dim=128, seq_heads=v) for v in (16, 64))
    assert min(lo, hi) <= r <= max(lo, hi)


@settings(max_examples=100, deadline=None)
@given(st.floats(1.0, 1e4), st.floats(0.5, 5000.0), st.lists(st.floats(1.0, 100.0), min_size=3, max_size=3))
def test_lookup_along_interpolates_between_bracketing_curves(x, v, ys):
    es = [CalibrationEntry(kind="decode_attn_GBps", gpu="G", key={"head_dim": 128, "seq_heads": s},
                           points=((1.0, y), (1e4, y))) for s, y in zip((4, 64, 1024), ys)]
    t = CalibrationTable(entries=tuple(es))
    got = t.lookup_along("decode_attn_GBps", "G", x, "seq_heads", v, head_dim=128)
    if v <= 4:
        assert got == ys[0]
    elif v >= 1024:
        assert got == ys[2]
    else:
        j = 0 if v < 64 else 1
        lo, hi = (4, 64)[j], (64, 1024)[j]
        w = math.log(v / lo) / math.log(hi / lo)
        assert got == pytest.approx(ys[j] + w * (ys[j + 1] - ys[j]))
    assert t.lookup_along("decode_attn_GBps", "G", x, "seq_heads", v, head_dim=64) is None
    assert t.lookup_along("decode_attn_GBps", "other", x, "seq_heads", v, head_dim=128) is None


# ------------------------------------------------------------------------------------------------ parsing

def test_split_rows_repeated_x_share_a_role():
    rows = [{"bench": "allreduce", "algo": "ring", "n_ranks": 2, "size_bytes": s, "median_us": 10.0 + s / 1e5}
            for s in (4096, 8192, 16384, 32768, 65536)]
    dup = [dict(r, median_us=r["median_us"] * 1.01, **{"from": "b.json"}) for r in rows]
    fit, held = split_rows(rows + dup, Holdout())
    assert held == {row_id(rows[1])}  # index 1 of the 5 distinct sizes (4 would be the end point)


def test_unknown_schema_and_bad_rows_are_one_line_errors(tmp_path):
    with pytest.raises(UserError, match="schema must be one of"):
        check_measurements({"schema": "rackbed.measure/9", "rows": []}, "x.json")
    with pytest.raises(UserError, match=r"rows\[0\] has no 'bench'"):
        check_measurements({"rows": [{"median_us": 1.0}]}, "x.json")
    p = tmp_path / "bad.json"
    p.write_text(json.dumps({"schema": "nope", "rows": []}))
    assert main(["calibrate", "--from-measurements", str(p), "--out", str(tmp_path / "c.yaml")]) == 2


def test_cli_refit_and_validate_new_format(tmp_path, capsys):
    meas = tmp_path / "measure.json"
    meas.write_text(json.dumps(_rows_v2(spread=0.03)))
    cal, val = tmp_path / "h200.yaml", tmp_path / "val.json"
    assert main(["calibrate", "--from-measurements", str(meas), "--out", str(cal)]) == 0
    assert main(["validate", "--calibration", str(cal), "--out", str(val)]) == 0
    out = capsys.readouterr().out
    assert "measurement spread (half range of rounds)" in out and "±3.0%" in out
    doc = json.loads(val.read_text())
    rows = doc["kernel"]["rows"]
    assert rows and all(r["noise"] == pytest.approx(0.03) for r in rows if r["role"] == "holdout")
    assert any(r["bench"] == "attn_decode" and r["role"] == "holdout" for r in rows)


# ------------------------------------------------------------------------------------------------ fitted forms

SQRT2_GEMM_M = measure.grid(measure.pow2(1, 32), measure.sqrt2(64, 1024, 16), measure.pow2(2048, 16384))


def _wave_rows(n: int, k: int, fmt: str, t_wave_us: float, floor_us: float) -> list[dict]:
    """Dense GEMM rows whose time is a wave staircase (128x128 tiles on 132 SMs) on the √2 grid of the /2
    measurements. (On the quarter-octave grid the fit points of n = 12288 lie on the 64x256 staircase as well, so
    leave-one-out ties and the held-out points cannot tell the two tiles apart.)"""
    out = []
    for m in SQRT2_GEMM_M:
        waves = math.ceil(math.ceil(m / 128) * math.ceil(n / 128) / 132)
        out.append({"bench": "gemm", "op": "dense", "fmt": fmt, "m": m, "n": n, "k": k,
                    "median_us": max(floor_us, t_wave_us * waves)})
    return out


@pytest.mark.slow
@settings(max_examples=15, deadline=None)
@given(st.sampled_from([4608, 9216, 12288]), st.floats(8.0, 30.0), st.floats(0.5, 1.0))
def test_wave_staircase_is_predicted_at_held_out_points(n, t_wave, floor_frac):
    """A GEMM whose time is a wave staircase (a held-out m between fit points on different steps): leave-one-out
    on the fit rows picks a quantised form and the held-out points are predicted to the step, where a smooth form
    through the fit points would be off by up to the step height. (n = 4096 is left out: there every fit point
    also lies on ``max(floor, s * m)``, so the fit rows cannot tell the staircase from the line.)"""
    rows = _wave_rows(n, 4096, "fp8", t_wave, floor_frac * t_wave)
    _, held = split_rows(rows, Holdout())
    doc = calibrate({"schema": "rackbed.measure/2", "env": {"sm_count": 132}, "rows": rows}, gpu="G")
    e = next(CalibrationEntry(**x) for x in doc["entries"] if x["key"] == {"fmt": "fp8", "n": n, "k": 4096})
    assert "waves" in e.source or "stream-K" in e.source
    for r in rows:
        if row_id(r) in held:
            _, _, x, y = curve_of(r)
            assert e.interpolate(x) == pytest.approx(y, rel=0.02), (r["m"], e.source)


def test_smooth_power_curve_picks_log_log_and_interpolates():
    """t ∝ s^1.3 (no floor, not the quadratic causal form): plain log-log interpolation of the fit points is
    exact, and leave-one-out picks a form that predicts the held-out sequence lengths within 1 %."""
    rows = [{"bench": "flash_prefill", "seq": s, "n_q_heads": 64, "n_kv_heads": 4, "head_dim": 128,
             "median_us": C.KERNEL_FIXED_US + 0.01 * s ** 1.3} for s in measure.FLASH_SEQ]
    _, held = split_rows(rows, Holdout())
    doc = calibrate({"rows": rows}, gpu="G")
    e = CalibrationEntry(**doc["entries"][0])
    for r in rows:
        if row_id(r) in held:
            _, _, x, y = curve_of(r)
            assert e.interpolate(x) == pytest.approx(y, rel=0.01)


@pytest.mark.slow
@settings(max_examples=10, deadline=None)
@given(st.lists(st.floats(0.5, 2.0), min_size=60, max_size=60))
def test_held_out_values_never_change_the_fit(factors):
    """Form choice and fit use fit rows only: scaling the held-out rows' times leaves every entry unchanged."""
    rows = _wave_rows(4608, 4096, "bf16", 12.0, 10.0) + [
        {"bench": "hbm_copy", "size_bytes": s, "bytes": 2 * s, "median_us": 2.0 + 2 * s / 4e6}
        for s in measure.HBM_SIZES]
    _, held = split_rows(rows, Holdout())
    doc = calibrate({"rows": rows}, gpu="G")
    changed = [dict(r) for r in rows]
    i = 0
    for r in changed:
        if row_id(r) in held:
            r["median_us"] *= factors[i % len(factors)]
            i += 1
    assert i > 0
    new = calibrate({"rows": changed}, gpu="G")
    assert new["entries"] == doc["entries"]
    assert new["kernel_fixed_us"] == doc["kernel_fixed_us"] and doc["kernel_fixed_us"]["G"] == pytest.approx(2.0, rel=1e-3)


@pytest.mark.slow
def test_allreduce_worker_exit_is_bounded_when_the_barrier_hangs(tmp_path):
    """The all-reduce worker's exit skips NCCL tear-down and never waits on a hung barrier for long: it exits 0
    within EXIT_BARRIER_S even when ``dist.barrier`` never returns (CPU: a stand-in ``dist``)."""
    import subprocess
    import sys
    import time

    code = ("import threading, rackbed.kernels.bench.measure as m\n"
            "m.EXIT_BARRIER_S = 0.5\n"
            "class D:\n"
            "    def barrier(self): threading.Event().wait()\n"
            "print('before', flush=True)\n"
            "m._worker_exit(D(), [object()])\n"
            "print('not reached')\n")
    t0 = time.time()
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False,
                       cwd=str(measure.Path(measure.__file__).resolve().parents[2]))
    assert p.returncode == 0, p.stderr
    assert "before" in p.stdout and "not reached" not in p.stdout
    assert time.time() - t0 < 30


def test_stop_terminates_only_live_processes():
    import multiprocessing as mp
    import time

    ctx = mp.get_context("spawn")
    live = ctx.Process(target=time.sleep, args=(60,))
    done = ctx.Process(target=time.sleep, args=(0,))
    live.start()
    done.start()
    done.join(30)
    measure._stop([live, done])
    assert not live.is_alive() and live.exitcode is not None and done.exitcode == 0


@settings(max_examples=80, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=40), min_size=1, max_size=30), st.integers(1, 3))
def test_short_runs_and_where_they_are_forced(lengths, longest):
    from rackbed.kernels.bench.measure import FORCED_OFFSETS, forced_ms, short_runs

    runs, m = [], 1
    for i, n in enumerate(lengths):  # kernel i % 5 over n consecutive m: kernels recur, as cuBLAS's do
        runs.append([m, m + n - 1, f"k{i % 5}"])
        m += n
    top = 200
    groups = short_runs(runs, top=top, longest=longest)
    assert groups == [(kn, list(range(a, b + 1))) for a, b, kn in runs if b <= top and b - a + 1 <= longest]
    for kn, at in groups:
        ms = forced_ms(at, top=top)
        assert not set(ms) & set(at) and all(1 <= x <= top for x in ms)
        assert all(any(x - a in FORCED_OFFSETS for a in at) for x in ms)
