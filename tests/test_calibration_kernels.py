"""Dense GEMM curves with a kernel map (``gemm_kernels`` rows): the block model of ``sim.calibration.kernel_maps``."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rackbed.sim.calibrate import Holdout, calibrate, calibration_rows, curve_of, row_id, split_rows
from rackbed.sim.calibration.kernel_maps import (
    KernelMap,
    attn_maps,
    decode_map_grid,
    decode_run_times,
    decode_work_x,
    kernel_block_times,
    kernel_maps,
    kernel_tile,
    tabulate_exact,
)
from rackbed.sim.costs.calibration import CalibrationEntry
from rackbed.topology.errors import UserError

FP8 = "nvjet_sm90_qqtst_128x128_128x6_1x1_h_bz_coopA_algo2_ovscale_TNT"
SPLITK = "nvjet_sm90_tst_192x8_64x8_4x1_v_bz_splitK_TNT + void cublasLt::splitKreduce_kernel<32, 16, int>"


def test_kernel_tile_reads_the_nvjet_name():
    assert kernel_tile(FP8) == (128, 128)
    assert kernel_tile(SPLITK) == (192, 8)  # the first kernel of a split-K pair
    assert kernel_tile("sm90_xmma_gemm_bf16bf16_bf16f32") is None


def test_kernel_map_blocks_and_coverage():
    km = KernelMap(((1, 8, SPLITK), (9, 300, FP8), (320, 320, FP8)))
    assert km.full == 300  # 301..319 not recorded
    assert km.kernel(5) == SPLITK and km.kernel(310) is None and km.kernel(320) == FP8
    assert km.block(128) == (FP8, 1) and km.block(129) == (FP8, 2) and km.block(8) == (SPLITK, 1)


def _saw(m: int) -> float:
    """An FP8-like time (s): a step per 128-row tile, falling as the last tile fills."""
    j = math.ceil(m / 128)
    return (14.0 + 12.0 * (j - 1) + 6.0 * (1 - (m - 128 * (j - 1)) / 128)) * 1e-6


def test_block_model_follows_a_tile_sawtooth_between_sparse_fit_points():
    km = KernelMap(((1, 1024, FP8),))
    fit = {m: _saw(m) for m in range(8, 1025, 24)}  # every third multiple of 8
    ts = kernel_block_times(km, 4608, fit, fallback=lambda m: 1.0)
    for m in range(16, 1025, 8):  # every multiple of 8 with two fit points in its tile
        assert ts[m - 1] == _saw(m) or abs(ts[m - 1] / _saw(m) - 1) < 1e-9, m
    # a smooth log-log interpolation of the same fit points misses the tile steps by far more
    e = CalibrationEntry(kind="p2p_us", gpu="g", points=tuple((float(m), t * 1e6) for m, t in sorted(fit.items())))
    assert max(abs(e.interpolate(m) * 1e-6 / _saw(m) - 1) for m in range(16, 1025, 8)) > 0.2


def test_block_model_uses_the_same_kernel_then_the_fallback():
    other = "nvjet_sm90_tst_384x64_64x3_4x1_v_bz_coopB_TNN"
    km = KernelMap(((1, 299, FP8), (300, 300, other), (301, 319, FP8), (320, 320, other), (321, 400, FP8),
                    (401, 401, "unnamed_kernel")))
    fit = {m: _saw(m) for m in (8, 64, 128, 200, 256, 264, 312, 320, 384, 392, 400)}
    ts = kernel_block_times(km, 4608, fit, fallback=lambda m: 7.0)
    assert ts[300 - 1] == fit[320]  # same kernel, same M-tile count (5 of 64): the fit point's time
    assert ts[401 - 1] == 7.0  # nothing known about the kernel: the fallback


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(min_value=1e-6, max_value=1e-3), min_size=2, max_size=300),
       st.sampled_from([0.002, 0.005, 0.02]))
def test_tabulation_reproduces_every_value(ys, tol):
    idx = tabulate_exact(ys, tol)
    assert idx[0] == 0 and idx[-1] == len(ys) - 1 and idx == sorted(set(idx))
    e = CalibrationEntry(kind="p2p_us", gpu="g", points=tuple((float(i + 1), ys[i]) for i in idx))
    for i, y in enumerate(ys):
        assert abs(e.interpolate(i + 1) / y - 1) <= tol * (1 + 1e-9), i


def _doc(runs, times):
    rows = [{"bench": "gemm", "op": "dense", "fmt": "fp8", "shape": "s", "m": m, "n": 4608, "k": 4096,
             "n_experts": 1, "median_us": t * 1e6} for m, t in times.items()]
    rows.append({"bench": "gemm_kernels", "op": "dense", "fmt": "fp8", "shape": "s", "n": 4608, "k": 4096,
                 "runs": runs})
    return {"schema": "rackbed.measure/2", "env": {"gpu_name": "NVIDIA H200", "sm_count": 132}, "rows": rows}


@pytest.mark.slow
def test_calibrate_with_a_kernel_map_predicts_held_out_rows_of_a_sawtooth():
    ms = [1, 2, 4, *range(8, 1025, 8), 2048, 4096]
    times = {m: _saw(m) for m in ms}
    doc = _doc([[1, 1024, FP8]], times)
    assert set(kernel_maps(doc["rows"])) == {(("fmt", "fp8"), ("n", 4608), ("k", 4096))}
    fit, held = split_rows(doc["rows"], Holdout())
    out = calibrate(doc, gpu="H200-SXM")
    (e,) = [CalibrationEntry(**x) for x in out["entries"] if x["key"] == {"fmt": "fp8", "n": 4608, "k": 4096}]
    assert "kernel map" in e.source
    flops = lambda m: 2.0 * m * 4608 * 4096  # noqa: E731
    errs = {}
    for m in ms:
        pred = flops(m) / (e.interpolate(m) * 1e12)
        errs[m] = abs(pred / times[m] - 1)
    held_m = [m for m in ms if f"gemm/dense/fp8/n4608_k4096/m{m}" in held]
    assert len(held_m) > 30
    # held-out rows inside a tile with two fit points: within the tabulation tolerance
    inside = [m for m in held_m if 16 <= m <= 1016 and m % 128 not in (0, 8)]
    assert max(errs[m] for m in inside) < 0.006
    assert max(errs[m] for m in ms if f"gemm/dense/fp8/n4608_k4096/m{m}" in fit and m <= 1024) < 0.006


def test_kv_block_form_is_a_staircase_and_its_residual_holds_within_a_block():
    from rackbed.sim.calibration.forms import Form, _hybrid, candidate_forms

    f = Form("kvblocks", tile=(256, 1))
    assert [f.w(x) for x in (1, 256, 257, 512, 513)] == [256.0, 256.0, 512.0, 512.0, 768.0]
    assert f.steps(200, 800) == [256.0, 257.0, 512.0, 513.0, 768.0, 769.0]
    assert any(c.work == "kvblocks" for c in candidate_forms("decode_attn_GBps"))
    # a split-KV decode: flat within a 256-block, +50 % per block; a held-out context in a fit point's block
    # takes that point's time (not the interpolation towards the next block's step)
    t = lambda c: 9.3e-6 * (1.5 ** (math.ceil(c / 256) - 1))  # noqa: E731
    xs = [256.0, 432.0, 608.0, 864.0, 1216.0]
    h = _hybrid(f, (1e-7, 1e-7, 1e-8), xs, [t(x) for x in xs])
    assert abs(h(512.0) / t(512.0) - 1) < 1e-9 and abs(h(720.0) / t(720.0) - 1) < 1e-9


def test_runs_of_encodes_a_kernel_choice_and_kernel_maps_read_it_back():
    from rackbed.kernels.bench.measure import runs_of

    ms = [1, 2, 3, 4, 8, 16]
    names = [(SPLITK.split(" + ")[0], "reduce"), (SPLITK.split(" + ")[0], "reduce"), (FP8,), (FP8,), (FP8,), ("x",)]
    runs = runs_of(ms, names)
    assert runs == [[1, 2, f"{SPLITK.split(' + ')[0]} + reduce"], [3, 8, FP8], [16, 16, "x"]]
    km = KernelMap(tuple(tuple(r) for r in runs))
    assert km.full == 8 and km.kernel(5) == FP8 and km.kernel(16) == "x" and km.kernel(12) is None


def test_a_malformed_kernel_map_is_one_user_error():
    import pytest

    from rackbed.topology.errors import UserError

    for runs in ([[1, 2]], [[5, 1, "k"]], [[1, 8, "a"], [8, 9, "b"]], "x"):
        with pytest.raises(UserError, match="gemm_kernels row fp8/s"):
            kernel_maps([{"bench": "gemm_kernels", "fmt": "fp8", "shape": "s", "n": 8, "k": 8, "runs": runs}])


# ------------------------------------------------------------------ block ends, decode maps, memcpy rows

def test_block_end_uses_a_least_squares_line_not_two_noisy_neighbours():
    other = "nvjet_sm90_tst_64x184_64x6_2x1_v_bz_TNT"
    km = KernelMap(((1, 352, FP8), (353, 400, other)))
    # v7 o_tp1: a block whose first m is held out and whose fit points alternate +-3 % around a flat time
    fit = {8: 1.0, 352: 1.0, 354: 45.5e-6, 355: 42.9e-6, 357: 45.9e-6, 358: 42.8e-6}
    ts = kernel_block_times(km, 4096, fit, fallback=lambda m: 1.0)
    flat = sum(fit[m] for m in (354, 355, 357, 358)) / 4
    assert abs(ts[353 - 1] / flat - 1) < 0.03  # the line through the two nearest would give 48.1 (+9 %)
    assert ts[356 - 1] == fit[355] + (fit[357] - fit[355]) / 2  # inside: the bracketing pair


DEC1 = "cudnn_sdpa_knob_35_16x128x128_1x4x1_kernel0_0<<<1,4,1>>>"
DEC4 = "cudnn_sdpa_knob_35_16x128x128_1x4x1_kernel0_0<<<4,4,1>>> + reduce<<<1,64,1>>>"
DEC64 = "cudnn_sdpa_knob_35_16x128x128_1x4x1_kernel0_0<<<64,4,1>>> + reduce<<<1,64,1>>>"


def test_decode_work_rounds_to_kv_blocks_only_in_one_wave():
    assert decode_work_x(DEC1, 432) == 512.0 and decode_work_x(DEC1, 512) == 512.0  # 4 CTAs: whole blocks
    assert decode_work_x(DEC4, 608) == 640.0  # 16 CTAs
    assert decode_work_x(DEC64, 11520) == 11520.0  # 256 CTAs > 132 SMs: the partial block is partial work
    assert decode_work_x("no_tile_kernel<<<1,1,1>>>", 100) == 100.0


def _truth(runs, x):
    """A decode time that is linear in the decode work of its run (what the run model assumes)."""
    for i, (a, b, k) in enumerate(runs):
        if a <= x <= b:
            return (5.0 + 3.0 * i) * 1e-6 + (1.0 + i) * 1e-9 * decode_work_x(k, x)
    raise AssertionError(x)


@pytest.mark.slow
@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(min_value=1, max_value=40), min_size=6, max_size=30, unique=True))
def test_decode_run_model_is_exact_for_run_linear_times_between_fit_points(steps):
    runs = ((16, 512, DEC1), (528, 8064, DEC4), (8192, 65536, DEC64))
    xs = [x for x in decode_map_grid(runs)]
    fit = {}
    for s in sorted(steps):  # fit points spread over the grid
        x = xs[(s * 97) % len(xs)]
        fit[x] = _truth(runs, x)
    ts = decode_run_times(runs, xs, fit, fallback=lambda x: -1.0)
    for x, t in zip(xs, ts):
        same = sorted(decode_work_x(k, f) for f in fit for a, b, k in runs if a <= f <= b and a <= x <= b)
        if len(set(same)) >= 2 and same[0] <= decode_work_x(next(k for a, b, k in runs if a <= x <= b), x) <= same[-1]:
            assert abs(t / _truth(runs, x) - 1) < 1e-9, x
        elif len(set(same)) < 2:
            assert t == -1.0, x  # fewer than two distinct fit works in the run: the fallback


def test_decode_map_grid_follows_the_recorded_contexts():
    g = decode_map_grid(((16, 32, DEC1), (48, 4096, DEC4), (4224, 4480, DEC64)))
    assert g[:4] == [16, 32, 48, 64] and 4096 in g and 4112 not in g and g[-3:] == [4224, 4352, 4480]


def _decode_doc():
    ctxs = [256, 304, 368, 432, 512, 608, 720, 864, 1024, 1216, 1456, 1728, 2048]
    runs = [[16, 512, DEC1], [528, 1008, DEC4], [1024, 4096, DEC64.replace("<<<64,", "<<<8,")]]
    tr = tuple(tuple(r) for r in runs)
    rows = [{"bench": "attn_decode", "batch": 1, "ctx": c, "n_q_heads": 64, "n_kv_heads": 4, "head_dim": 128,
             "kv_bytes": c * 2 * 4 * 128 * 2, "median_us": _truth(tr, c) * 1e6 + 1.06} for c in ctxs]
    rows.append({"bench": "attn_kernels", "batch": 1, "n_q_heads": 64, "n_kv_heads": 4, "head_dim": 128,
                 "runs": runs})
    return {"schema": "rackbed.measure/2", "env": {"gpu_name": "NVIDIA H200", "sm_count": 132}, "rows": rows}


def test_calibrate_with_a_decode_map_predicts_held_out_contexts():
    from rackbed import topology
    from rackbed.engine.cli.validate import validate_kernels
    from rackbed.sim.calibrate import CalibrationFile

    doc = _decode_doc()
    assert set(attn_maps(doc["rows"])) == {(("head_dim", 128), ("seq_heads", 4))}
    out = calibrate(doc, gpu="H200-SXM")
    (e,) = [x for x in out["entries"] if x["kind"] == "decode_attn_GBps"]
    assert "kernel map" in e["source"]
    table = CalibrationFile(**{k: v for k, v in out.items() if k != "version"})
    res = validate_kernels(doc, table, topology.load("h200x2"))
    held = [r for r in res["rows"] if r["role"] == "holdout"]
    assert len(held) == 4  # 304, 512, 864, 1456
    # 512 sits in the same 128-token block as fit point 432 (one wave): no split-switch miss (v6: +21 %)
    assert max(abs(r["rel_error"]) for r in held) < 0.01


def test_a_malformed_decode_map_is_one_user_error():
    doc = _decode_doc()
    doc["rows"][-1]["runs"] = [[16, 600, DEC1], [528, 1008, DEC4]]
    with pytest.raises(UserError, match="attn_kernels row b1"):
        attn_maps(doc["rows"])


def test_memcpy_copies_are_not_calibration_points_once_elementwise_copies_exist():
    old = [{"bench": "hbm_copy", "size_bytes": 2**20, "bytes": 2**21, "median_us": 1.0}]
    assert calibration_rows(old) is old and curve_of(old[0]) is not None  # v6 files: memcpy rows still fit
    new = old + [{"bench": "hbm_copy", "kernel": "elementwise", "size_bytes": 2**20, "bytes": 2**21,
                  "median_us": 1.1}]
    rows = calibration_rows(new)
    assert rows[0]["kernel"] == "memcpy" and "kernel" not in old[0]  # labelled in a copy
    assert curve_of(rows[0]) is None and curve_of(rows[1]) is not None
    assert row_id(rows[0]) != row_id(rows[1])


# ------------------------------------------------------------------ kernels forced at other m (gemm_forced rows)

SLOW = "nvjet_sm90_tst_64x224_64x5_2x1_v_bz_TNT"
BASE = "nvjet_sm90_tst_128x104_64x7_1x2_h_bz_TNT"


def _forced_doc(forced: dict[int, float] | None, extra: list[dict] = ()):
    """A bf16 curve where the library runs BASE (flat 45 µs) except SLOW at m = 416 only (56 µs, 24 % slower);
    ``forced``: SLOW timed by choice at other m (m -> µs)."""
    times = {m: 45.0 + 0.01 * m for m in range(1, 1025)}
    times[416] = 56.0
    rows = [{"bench": "gemm", "op": "dense", "fmt": "bf16", "shape": "o", "m": m, "n": 4096, "k": 8192,
             "n_experts": 1, "median_us": t} for m, t in times.items()]
    rows.append({"bench": "gemm_kernels", "op": "dense", "fmt": "bf16", "shape": "o", "n": 4096, "k": 8192,
                 "runs": [[1, 415, BASE], [416, 416, SLOW], [417, 1024, BASE]]})
    for m, t in (forced or {}).items():
        rows.append({"bench": "gemm_forced", "op": "dense", "fmt": "bf16", "shape": "o", "n": 4096, "k": 8192,
                     "m": m, "kernel": SLOW, "library_m": [416], "library_kernel": BASE, "median_us": t})
    rows.extend(extra)
    return {"schema": "rackbed.measure/2", "env": {"gpu_name": "NVIDIA H200", "sm_count": 132}, "rows": rows}


def _predict_us(doc, m: int) -> float:
    out = calibrate(doc, gpu="H200-SXM")
    (e,) = [CalibrationEntry(**x) for x in out["entries"] if x["key"] == {"fmt": "bf16", "n": 4096, "k": 8192}]
    return 2.0 * m * 4096 * 8192 / (e.interpolate(m) * 1e12) * 1e6


@pytest.mark.slow
def test_a_held_out_single_m_kernel_is_priced_from_its_forced_points():
    assert "gemm/dense/bf16/n4096_k8192/m416" in split_rows(_forced_doc(None)["rows"], Holdout())[1]
    without = _predict_us(_forced_doc(None), 416)
    assert abs(without / 56.0 - 1) > 0.1  # from the curve alone: a form through the neighbours (45 µs)
    # the same kernel timed by choice either side of 416, in its block of M tiles (ceil(m / 224) = 2)
    doc = _forced_doc({400: 55.2, 408: 55.6, 424: 56.4, 432: 56.8})
    assert abs(_predict_us(doc, 416) / 56.0 - 1) < 0.005
    # the forced points price their own kernel only: the library's m next to them keep the library's time
    for m in (400, 408, 424, 432):
        assert abs(_predict_us(doc, m) / (45.0 + 0.01 * m) - 1) < 0.005


@pytest.mark.slow
def test_forced_rows_with_errors_checks_or_other_kernels_change_nothing():
    base = calibrate(_forced_doc(None), gpu="H200-SXM")["entries"]
    junk = [
        {"bench": "gemm_forced", "op": "dense", "fmt": "bf16", "shape": "o", "n": 4096, "k": 8192, "m": 416,
         "kernel": SLOW, "check": True, "median_us": 56.0},  # where the library runs it: never read
        {"bench": "gemm_forced", "op": "dense", "fmt": "bf16", "shape": "o", "n": 4096, "k": 8192, "kernel": SLOW,
         "error": "none of the 12 cuBLASLt heuristic candidates at m = 416 launches this kernel"},
        {"bench": "gemm_forced", "op": "dense", "fmt": "bf16", "shape": "o", "n": 4096, "k": 8192, "m": 600,
         "kernel": "nvjet_sm90_tst_256x80_64x5_2x1_v_bz_TNT", "library_m": [600], "median_us": 99.0},  # not run
        {"bench": "gemm_forced", "op": "dense", "fmt": "bf16", "shape": "o", "n": 4096, "k": 8192, "m": 300,
         "kernel": BASE, "library_m": [416], "median_us": 99.0},  # a run the library does not make
    ]
    assert calibrate(_forced_doc(None, junk), gpu="H200-SXM")["entries"] == base


def test_a_malformed_forced_row_is_one_line_error():
    bad = [{"bench": "gemm_forced", "op": "dense", "fmt": "bf16", "shape": "o", "n": 4096, "k": 8192,
            "kernel": SLOW, "median_us": 50.0}]  # no m
    with pytest.raises(UserError, match=r"gemm_forced row o/mNone: needs fmt, n, k, m, kernel, library_m"):
        calibrate(_forced_doc(None, bad), gpu="H200-SXM")


@pytest.mark.slow
def test_a_kernel_run_at_one_m_with_other_launch_parameters_is_its_own_configuration():
    """v8 (4096 x 4096): ``128x64_64x8_1x2_h`` runs at m = 224 (36 µs) and at 240..256 (31.5 µs), the same M tiles.
    Forced at 200..232 with the heuristic's choice at m = 224, the held-out 224 is priced from those points, and the
    kernel's other m keep their own (faster) time."""
    k64 = "nvjet_sm90_tst_128x64_64x8_1x2_h_bz_TNT"
    times = {m: 30.0 + 0.01 * m for m in range(1, 1025)}
    for m in (224, 240, 248, 256):
        times[m] = 36.3 if m == 224 else 31.5
    rows = [{"bench": "gemm", "op": "dense", "fmt": "bf16", "shape": "o", "m": m, "n": 4096, "k": 4096,
             "n_experts": 1, "median_us": t} for m, t in times.items()]
    runs = [[1, 223, BASE], [224, 224, k64], [225, 239, BASE], [240, 240, k64], [241, 247, BASE], [248, 248, k64],
            [249, 255, BASE], [256, 256, k64], [257, 1024, BASE]]
    rows.append({"bench": "gemm_kernels", "op": "dense", "fmt": "bf16", "shape": "o", "n": 4096, "k": 4096,
                 "runs": runs})

    def predict(doc_rows, m):
        out = calibrate({"schema": "rackbed.measure/2", "env": {"gpu_name": "NVIDIA H200", "sm_count": 132},
                         "rows": doc_rows}, gpu="H200-SXM")
        (e,) = [CalibrationEntry(**x) for x in out["entries"] if x["key"] == {"fmt": "bf16", "n": 4096, "k": 4096}]
        return 2.0 * m * 4096 * 4096 / (e.interpolate(m) * 1e12) * 1e6

    assert "gemm/dense/bf16/n4096_k4096/m224" in split_rows(rows, Holdout())[1]
    assert abs(predict(rows, 224) / 36.3 - 1) > 0.1  # the kernel's block-mate at 240: 31.5 µs
    forced = [{"bench": "gemm_forced", "op": "dense", "fmt": "bf16", "shape": "o", "n": 4096, "k": 4096, "m": m,
               "kernel": k64, "library_m": [224], "median_us": 36.0 + 0.02 * (m - 200)} for m in (200, 208, 216, 232)]
    assert abs(predict(rows + forced, 224) / 36.3 - 1) < 0.01
    assert abs(predict(rows + forced, 248) / 31.5 - 1) < 0.01  # held out too: from 240 and 256, not the forced runs


@pytest.mark.slow
def test_curves_fitted_in_worker_processes_are_the_serial_fit(monkeypatch):
    import rackbed.sim.calibrate as cal

    doc = _forced_doc({400: 55.2, 408: 55.6, 424: 56.4, 432: 56.8})
    doc["rows"] += [{"bench": "hbm_copy", "kernel": "elementwise", "size_bytes": s, "bytes": 2 * s,
                     "median_us": 1.1 + 2 * s / 4.2e6} for s in (2**18, 2**20, 2**22, 2**24, 2**26, 2**28)]
    monkeypatch.setenv(cal.FIT_WORKERS_ENV, "1")
    serial = calibrate(doc, gpu="H200-SXM")
    monkeypatch.setenv(cal.FIT_WORKERS_ENV, "2")
    monkeypatch.setattr(cal, "FIT_PARALLEL_MIN_POINTS", 1)
    assert calibrate(doc, gpu="H200-SXM") == serial
