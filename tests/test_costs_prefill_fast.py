"""The prefill pricing fast paths give the general paths' exact results: the all-reduce "auto" memo
(``collective._auto_terms`` / ``_auto_fast``) against min() over ``_estimate``, the GEMM identity memo
(``gemm._FRONT``) against ``_grouped_cached``, the GEMM model's loops against the sum() passes they replace."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rackbed import topology
from rackbed.sim.costs import gemm as G
from rackbed.sim.costs.calibration import CalibrationTable
from rackbed.sim.costs.collective import _estimate, allreduce_time, auto_names, group_links
from rackbed.topology.presets import PRESETS


def _general(topo, gpus, n_bytes, algo, calib):
    g = group_links(topo, gpus)  # the candidates "auto" chooses between (measured ones only where measured)
    return min((_estimate(g, a, n_bytes, calib) for a in auto_names(g, algo, calib)), key=lambda c: c.total_s)


@pytest.fixture(scope="module")
def topos():
    spec = PRESETS["hgx-h200"]
    sw = spec.rack.node.nvswitch.model_copy(update={"sharp": False, "reduce_GBps": 0.0})
    node = spec.rack.node.model_copy(update={"nvswitch": sw})
    nosharp = topology.build(spec.model_copy(update={"rack": spec.rack.model_copy(update={"node": node}),
                                                      "name": "hgx-h200-nosharp"}))
    return [topology.load("gb200-nvl72"), topology.load("hgx-h200"), topology.load("hgx-h200*2"), nosharp]


_FIXED = CalibrationTable(kernel_fixed_us={"H200-SXM": 7.5, "GB200": 3.25})
_MEASURED = CalibrationTable.model_validate({"entries": [
    {"kind": "allreduce_us", "gpu": "H200-SXM", "key": {"algo": "one_shot", "n_ranks": 4},
     "points": [[1024, 9.0], [1 << 20, 30.0]]}]})


@settings(max_examples=300, deadline=None)
@given(ti=st.integers(0, 3), start=st.integers(0, 15), n=st.sampled_from([2, 3, 4, 8, 16]),
       n_bytes=st.one_of(st.integers(1, 1 << 34), st.floats(1e-3, 1e12)),
       algo=st.sampled_from(["auto", "auto_no_nvls"]), ci=st.integers(0, 2))
def test_allreduce_auto_fast_matches_general(topos, ti, start, n, n_bytes, algo, ci):
    topo = topos[ti]
    n_gpus = topo.n_gpus
    gpus = tuple((start + i) % n_gpus for i in range(n))
    if len(set(gpus)) < 2:
        return
    calib = (None, _FIXED, _MEASURED)[ci]
    try:
        want = _general(topo, gpus, n_bytes, algo, calib)
    except Exception as e:  # noqa: BLE001 (the group is not valid on this topology: both paths must say so)
        with pytest.raises(type(e)):
            allreduce_time(topo, gpus, n_bytes, algo=algo, calib=calib)
        return
    got = allreduce_time(topo, gpus, n_bytes, algo=algo, calib=calib)
    assert got == want
    assert got.total_s == want.total_s  # bit-identical, not approx


def test_gemm_front_memo_keys_on_identity():
    gpu = PRESETS["gb200-nvl72"].rack.node.gpu
    other = gpu.model_copy(update={"hbm_GBps": gpu.hbm_GBps / 2})  # a different spec object
    for m in (1, 7, 300, 5000):
        a = G.gemm_time(gpu, m, 4096, 7168, "bf16")
        b = G.gemm_time(other, m, 4096, 7168, "bf16")
        assert a == G._grouped_cached(gpu, ((m, 1.0),), 4096, 7168, "bf16", False)
        assert b == G._grouped_cached(other, ((m, 1.0),), 4096, 7168, "bf16", False)
        assert a == G.gemm_time(gpu, m, 4096, 7168, "bf16")  # the memo hit


def _grouped_reference(gpu, hist, n, k, fmt, grouped):
    """The GEMM model as written before the loop rewrite (three sum() passes), for the identity check."""
    import math

    from rackbed.sim.costs import constants as C

    fe = G.format_execution(gpu, fmt)
    n_exp = sum(c for _, c in hist)
    if n_exp <= 0:
        return G.ZERO_GEMM
    bm, bn = C.GEMM_TILE[gpu.arch]
    tiles_n = math.ceil(n / bn)
    tokens = sum(m * c for m, c in hist)
    tiles = sum(math.ceil(m / bm) * c for m, c in hist) * tiles_n
    flops = 2.0 * tokens * n * k
    sm = gpu.sm_count
    split = 1 if grouped or tiles >= sm else max(1, min(sm // max(int(tiles), 1), k // C.SPLIT_K_MIN_K))
    per_sm_flops = fe.peak_tflops * 1e12 * fe.efficiency / sm
    tile_s = 2.0 * bm * bn * k / per_sm_flops / split
    compute_s = math.ceil(tiles * split / sm - 1e-9) * tile_s
    hbm_bytes = (n_exp * n * k * G._bpe(fmt, "weight") + tokens * k * G._bpe(fe.act_format, "activation")
                 + tokens * n * 2.0)
    hbm = gpu.hbm_GBps * 1e9 * C.HBM_EFFICIENCY[gpu.arch]
    slices = n_exp * tiles_n * split
    slice_bytes = bn * k * G._bpe(fmt, "weight") / split
    per_sm_bw = C.PER_SM_BW_FACTOR * hbm / sm
    memory_s = max(hbm_bytes / hbm, math.ceil(slices / sm - 1e-9) * slice_bytes / per_sm_bw)
    fixed_s = (C.KERNEL_FIXED_US + (C.GROUPED_GEMM_EXTRA_US if grouped else 0.0)) * 1e-6
    return G.GemmCost(flops, hbm_bytes, compute_s, memory_s, fixed_s, max(compute_s, memory_s) + fixed_s, tiles,
                      fe.exec_format)


@settings(max_examples=300, deadline=None)
@given(n_tokens=st.integers(1, 300_000), n_exp=st.sampled_from([8, 32, 64, 128]), grouped=st.booleans(),
       gi=st.integers(0, 1), fmt=st.sampled_from(["bf16", "mxfp8", "mxfp4"]), n=st.integers(1, 9000),
       k=st.integers(1, 9000))
def test_grouped_gemm_matches_reference(n_tokens, n_exp, grouped, gi, fmt, n, k):
    gpu = (PRESETS["gb200-nvl72"].rack.node.gpu, PRESETS["hgx-h200"].rack.node.gpu)[gi]
    hist = G.binomial_histogram(n_tokens, 8 / 256, n_exp)
    try:
        want_g = _grouped_reference(gpu, hist, n, k, fmt, grouped)
    except Exception as e:  # noqa: BLE001 (format not supported on the GPU: both must refuse)
        with pytest.raises(type(e)):
            G._grouped_calc(gpu, hist, n, k, fmt, grouped)
        return
    assert G._grouped_calc(gpu, hist, n, k, fmt, grouped) == want_g
    assert G._grouped(gpu, hist, n, k, fmt, None, grouped) == want_g
