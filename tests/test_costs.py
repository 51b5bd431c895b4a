"""Cost models (sim/costs): properties (monotonicity, SHARP, linearity in layers), hand-computed units,
calibration hook, and sanity anchors with wide tolerances."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rackbed import topology
from rackbed.engine.core.kv import KvLayout, reshard_plan
from rackbed.engine.core.model import get_model
from rackbed.engine.core.sharding import ParallelPlan
from rackbed.sim.costs import constants as C
from rackbed.sim.costs.attention import full_attention_decode, full_attention_prefill, linear_attention_decode
from rackbed.sim.costs.calibration import CalibrationTable, load_calibration
from rackbed.sim.costs.collective import _estimate, allreduce_time, available_algos, group_links
from rackbed.sim.costs.gemm import (
    binomial_histogram,
    expert_mlp_time,
    format_execution,
    gemm_time,
    grouped_gemm_time,
    histogram,
)
from rackbed.sim.costs.kv_transfer import kv_transfer_time
from rackbed.sim.costs.moe_comm import (
    dpep_decode_combine,
    dpep_decode_dispatch,
    ep_prefill_combine,
    ep_prefill_dispatch,
    expected_dest_ranks,
)
from rackbed.sim.costs.step import (
    decode_step_breakdown,
    decode_step_time,
    prefill_step_breakdown,
    prefill_step_time,
)
from rackbed.topology.errors import UserError
from rackbed.topology.presets import PRESETS
from rackbed.topology.specs import GB200_GPU, H200_SXM

SET = settings(max_examples=150, deadline=None)
SLOW = settings(max_examples=50, deadline=None)
FMTS = ["bf16", "fp8", "fp8_block", "mxfp8", "mxfp6", "mxfp4", "nvfp4"]
Q235 = get_model("qwen3-235b-a22b")
Q35 = get_model("qwen3.5-397b-a17b")


@pytest.fixture(scope="module")
def h200():
    return topology.load("hgx-h200")


@pytest.fixture(scope="module")
def gb200():
    return topology.load("gb200-nvl72")


@pytest.fixture(scope="module")
def h200x2():
    return topology.load("hgx-h200*2")


@pytest.fixture(scope="module")
def h200_nosharp():
    spec = PRESETS["hgx-h200"]
    sw = spec.rack.node.nvswitch.model_copy(update={"sharp": False, "reduce_GBps": 0.0})
    node = spec.rack.node.model_copy(update={"nvswitch": sw})
    rack = spec.rack.model_copy(update={"node": node})
    return topology.build(spec.model_copy(update={"rack": rack, "name": "hgx-h200-nosharp"}))


# ------------------------------------------------------------------------------------------------ GEMM


@SET
@given(m=st.integers(1, 20000), dm=st.integers(1, 5000), n=st.integers(1, 16384), k=st.integers(1, 16384),
       fmt=st.sampled_from(FMTS), gpu=st.sampled_from([H200_SXM, GB200_GPU]))
def test_gemm_more_work_never_faster(m, dm, n, k, fmt, gpu):
    a = gemm_time(gpu, m, n, k, fmt)
    b = gemm_time(gpu, m + dm, n, k, fmt)
    assert b.total_s >= a.total_s * (1 - 1e-12)
    assert b.hbm_bytes > a.hbm_bytes and b.flops > a.flops


@SET
@given(tokens=st.lists(st.integers(0, 600), min_size=1, max_size=64), extra=st.integers(0, 63),
       fmt=st.sampled_from(FMTS), gpu=st.sampled_from([H200_SXM, GB200_GPU]))
def test_grouped_gemm_more_tokens_never_faster(tokens, extra, fmt, gpu):
    more = list(tokens)
    more[extra % len(more)] += 1 + extra
    a = grouped_gemm_time(gpu, tokens, 3072, 4096, fmt).total_s
    b = grouped_gemm_time(gpu, more, 3072, 4096, fmt).total_s
    assert b >= a * (1 - 1e-12)


@SET
@given(m=st.integers(1, 8192), scale=st.floats(1.0, 4.0), fmt=st.sampled_from(FMTS),
       gpu=st.sampled_from([H200_SXM, GB200_GPU]))
def test_gemm_more_bandwidth_or_flops_never_slower(m, scale, fmt, gpu):
    base = gemm_time(gpu, m, 3072, 4096, fmt).total_s
    fast_mem = gpu.model_copy(update={"hbm_GBps": gpu.hbm_GBps * scale})
    rates = gpu.dense_tflops.model_copy(update={f: (v * scale if v else v)
                                                for f, v in gpu.dense_tflops.model_dump().items()})
    fast_mma = gpu.model_copy(update={"dense_tflops": rates})
    assert gemm_time(fast_mem, m, 3072, 4096, fmt).total_s <= base * (1 + 1e-12)
    assert gemm_time(fast_mma, m, 3072, 4096, fmt).total_s <= base * (1 + 1e-12)


def test_gemm_units_hand_computed():
    # large bf16 GEMM on H200: compute-bound; 4096^3: 64x32 tiles of 64x128 = 2048 tiles -> 16 waves on 132 SMs
    c = gemm_time(H200_SXM, 4096, 4096, 4096, "bf16")
    per_sm = 989e12 * C.MMA_EFFICIENCY["hopper"]["bf16"] / 132
    tile_s = 2 * 64 * 128 * 4096 / per_sm
    assert c.bound == "compute"
    assert c.compute_s == pytest.approx(16 * tile_s, rel=1e-12)
    assert c.total_s == pytest.approx(16 * tile_s + C.KERNEL_FIXED_US * 1e-6, rel=1e-12)
    assert c.flops == 2 * 4096 ** 3
    # ~790 TFLOP/s measured bf16 on H200 (sim/costs/constants.py MMA_EFFICIENCY): within 10 %
    assert c.achieved_tflops == pytest.approx(790, rel=0.10)
    # bytes: weights + activations in + bf16 out
    assert c.hbm_bytes == 4096 * 4096 * 2 * 3


def test_deepgemm_small_m_anchor():
    """DeepGEMM README (H800 FP8 block): M=64 206-336 TFLOP/s, M=128 352-645: wide tolerance (x1.5)."""
    m64 = gemm_time(H200_SXM, 64, 7168, 2048, "fp8_block").achieved_tflops
    m128 = gemm_time(H200_SXM, 128, 7168, 2048, "fp8_block").achieved_tflops
    assert 206 / 1.5 < m64 < 336 * 1.5
    assert 352 / 1.5 < m128 < 645 * 1.5
    assert m64 < m128  # efficiency falls at small M


def test_hopper_runs_mx_as_fp8():
    fe = format_execution(H200_SXM, "mxfp8")
    assert fe.exec_format == "fp8" and "Hopper" in fe.note
    assert format_execution(GB200_GPU, "mxfp4").exec_format == "mxfp4"
    # weight bytes keep the packed format on Hopper: MXFP4 reads fewer bytes than FP8
    e4 = expert_mlp_time(H200_SXM, 4096, 1536, [1] * 8, "mxfp4")
    e8 = expert_mlp_time(H200_SXM, 4096, 1536, [1] * 8, "fp8")
    assert e4.hbm_bytes < 0.6 * e8.hbm_bytes and e4.total_s < e8.total_s


def test_histogram_and_binomial():
    assert histogram([5, 0, 5, 3]) == ((3, 1), (5, 2))
    h = binomial_histogram(8, 8 / 128, 16)
    # expected active experts = 16 * (1 - (1 - 1/16)^8)
    assert sum(c for _, c in h) == pytest.approx(16 * (1 - (15 / 16) ** 8), rel=1e-6)
    assert sum(m * c for m, c in h) == pytest.approx(8 * 8 / 128 * 16, rel=1e-3)
    big = binomial_histogram(6000, 8 / 128, 32)
    assert sum(m * c for m, c in big) == pytest.approx(6000 * 8 / 128 * 32, rel=0.01)


def test_diminishing_return_of_ep_in_grouped_gemm():
    t = {ep: expert_mlp_time(GB200_GPU, 4096, 1536, [1] * (128 // ep), "mxfp8").total_s for ep in (8, 16, 32, 64)}
    assert t[8] > t[16] > t[32] >= t[64]
    assert t[8] / t[16] >= t[16] / t[32] >= t[32] / t[64]  # each halving of experts saves relatively less
    assert t[32] / t[64] < 1.25  # 2 experts per rank are not much cheaper than 4


# ------------------------------------------------------------------------------------------------ attention


@SET
@given(ctx=st.lists(st.integers(1, 50000), min_size=1, max_size=32), extra=st.integers(1, 5000),
       tp=st.sampled_from([1, 2, 4, 8]))
def test_decode_attention_more_context_never_faster(ctx, extra, tp):
    a = full_attention_decode(GB200_GPU, Q235, ctx, tp=tp).total_s
    b = full_attention_decode(GB200_GPU, Q235, ctx + [extra], tp=tp).total_s
    c = full_attention_decode(GB200_GPU, Q235, [x + extra for x in ctx], tp=tp).total_s
    assert b >= a and c >= a


def test_attention_units_hand_computed():
    d = full_attention_decode(H200_SXM, Q235, [1024], tp=1, page_tokens=16)
    assert d.core_bytes == 1024 * 2 * 4 * 128 * 2  # K and V, 4 KV heads, head_dim 128, bf16
    bw = 4800e9 * C.HBM_EFFICIENCY["hopper"] * C.DECODE_ATTN_BW_EFFICIENCY
    assert d.core_s == pytest.approx(d.core_bytes / bw + C.KERNEL_FIXED_US * 1e-6, rel=1e-12)
    p = full_attention_prefill(H200_SXM, Q235, [(1000, 0)], tp=4)
    assert p.core_flops == 4 * 16 * 128 * (1000 * 1001 / 2)  # causal, 64/4 local q heads
    # TP=8 replicates K/V: one KV head per rank, same KV bytes per rank as TP=4
    assert full_attention_decode(H200_SXM, Q235, [1024], tp=8).core_bytes == \
        full_attention_decode(H200_SXM, Q235, [1024], tp=4).core_bytes


def test_gdn_decode_state_bytes():
    d = linear_attention_decode(GB200_GPU, Q35, 10)
    per_seq = 64 * 128 * 128 * C.GDN_STATE_ELEM_BYTES + 3 * (2 * 16 + 64) * 128 * 2
    assert d.core_bytes == pytest.approx(10 * per_seq * 2)


# ------------------------------------------------------------------------------------------------ collectives


@SET
@given(b=st.integers(0, 2 ** 30), db=st.integers(1, 2 ** 28), n=st.sampled_from([2, 3, 4, 8]),
       algo=st.sampled_from(["auto", "auto_no_nvls", "one_shot", "two_shot", "ring", "nvls"]),
       topo_name=st.sampled_from(["h200", "gb200"]))
def test_allreduce_more_bytes_never_faster(b, db, n, algo, topo_name, h200, gb200):
    topo = h200 if topo_name == "h200" else gb200
    gpus = tuple(range(n))
    a = allreduce_time(topo, gpus, b, algo=algo).total_s
    c = allreduce_time(topo, gpus, b + db, algo=algo).total_s
    assert c >= a


@SET
@given(b=st.integers(1, 2 ** 30), scale=st.floats(1.0, 8.0), n=st.sampled_from([2, 4, 8]),
       algo=st.sampled_from(["one_shot", "two_shot", "ring", "nvls"]))
def test_allreduce_more_bandwidth_never_slower(b, scale, n, algo, h200):
    g = group_links(h200, tuple(range(n)))
    fast = dataclasses.replace(g, bw_GBps=g.bw_GBps * scale, nvlink_bw_GBps=g.nvlink_bw_GBps * scale)
    assert _estimate(fast, algo, b, None).total_s <= _estimate(g, algo, b, None).total_s


@SET
@given(b=st.integers(0, 2 ** 30), n=st.sampled_from([2, 3, 4, 5, 8]))
def test_sharp_never_slower(b, n, h200, h200_nosharp):
    """With SHARP switches the all-reduce (tuner's choice) is never slower than on the same machine without."""
    gpus = tuple(range(n))
    assert "nvls" in available_algos(group_links(h200, gpus))
    assert "nvls" not in available_algos(group_links(h200_nosharp, gpus))
    with_sharp = allreduce_time(h200, gpus, b).total_s
    without = allreduce_time(h200_nosharp, gpus, b).total_s
    assert with_sharp <= without
    assert allreduce_time(h200, gpus, b).total_s <= allreduce_time(h200, gpus, b, algo="auto_no_nvls").total_s


@pytest.mark.parametrize("n", [4, 8])
def test_nvls_moves_fewer_port_bytes(n, h200):
    b = 2 ** 24 * n
    nv = allreduce_time(h200, range(n), b, algo="nvls")
    two = allreduce_time(h200, range(n), b, algo="two_shot")
    assert nv.link_bytes == pytest.approx(b * (1 + 1 / n))
    assert two.link_bytes == pytest.approx(2 * (n - 1) * b / n)
    assert nv.link_bytes < two.link_bytes


def test_allreduce_units_and_nccl_anchor(h200):
    g = group_links(h200, (0, 1, 2, 3))
    c = allreduce_time(h200, (0, 1, 2, 3), 10 ** 9, algo="two_shot")
    assert c.bandwidth_s == pytest.approx(1.5e9 / (18 * 20.6e9), rel=1e-9)
    assert g.bw_GBps == pytest.approx(18 * 20.6)
    # 8xH100/H200 bus bandwidth: NVLS ~480 GB/s, ring ~365-370 GB/s (nccl-tests#212): within 15 %
    assert allreduce_time(h200, range(8), 2 ** 30, algo="nvls").bus_GBps == pytest.approx(480, rel=0.15)
    assert allreduce_time(h200, range(8), 2 ** 30, algo="ring").bus_GBps == pytest.approx(367, rel=0.15)


def test_allreduce_errors_and_cross_node(h200, h200x2):
    with pytest.raises(UserError, match="nvls"):
        allreduce_time(h200x2, range(16), 2 ** 20, algo="nvls")
    with pytest.raises(UserError, match="algo"):
        allreduce_time(h200, range(4), 2 ** 20, algo="tree")
    cross = allreduce_time(h200x2, range(16), 2 ** 24)
    inside = allreduce_time(h200, range(8), 2 ** 24)
    assert cross.algo == "ring" and cross.total_s > 3 * inside.total_s
    assert allreduce_time(h200, [0], 2 ** 20).total_s == 0.0


# ------------------------------------------------------------------------------------------------ MoE comm


def test_expected_dest_ranks_hand_computed():
    assert expected_dest_ranks(128, 8, 1) == pytest.approx(1.0)
    assert expected_dest_ranks(128, 8, 128) == pytest.approx(8.0)
    assert expected_dest_ranks(128, 8, 8) == pytest.approx(8 * (1 - math.comb(112, 8) / math.comb(128, 8)))


@SET
@given(t=st.integers(1, 512), dt=st.integers(1, 512), ep=st.sampled_from([2, 4, 8, 16, 32, 64]))
def test_decode_a2a_more_tokens_never_faster(t, dt, ep, gb200):
    g = tuple(range(ep))
    assert dpep_decode_dispatch(gb200, g, t + dt, Q235, "mxfp8").total_s >= \
        dpep_decode_dispatch(gb200, g, t, Q235, "mxfp8").total_s
    assert dpep_decode_combine(gb200, g, t + dt, Q235).total_s >= dpep_decode_combine(gb200, g, t, Q235).total_s


@SET
@given(t=st.integers(1, 20000), dt=st.integers(1, 5000), ep=st.sampled_from([2, 4, 8]))
def test_ep_prefill_more_tokens_never_faster(t, dt, ep, h200):
    g = tuple(range(ep))
    assert ep_prefill_dispatch(h200, g, t + dt, Q235).total_s >= ep_prefill_dispatch(h200, g, t, Q235).total_s
    assert ep_prefill_combine(h200, g, t + dt, Q235).total_s >= ep_prefill_combine(h200, g, t, Q235).total_s


def test_decode_a2a_latency_bound_and_paths(gb200, h200, h200x2):
    """Tens of µs at most on NVLink, nearly flat in tokens at decode sizes; IB (and EFA) much slower."""
    d1 = dpep_decode_dispatch(gb200, range(8), 1, Q235, "mxfp8")
    d128 = dpep_decode_dispatch(gb200, range(8), 128, Q235, "mxfp8")
    assert d1.total_s < 50e-6 and d128.total_s < 50e-6
    assert d1.sync_s + d1.fixed_s > d1.transfer_s  # latency-dominated
    assert dpep_decode_dispatch(gb200, range(8), 1, Q235, "mxfp8").total_s < \
        dpep_decode_dispatch(h200, range(8), 1, Q235, "mxfp8").total_s  # lower P2P latency on GB200
    ib = dpep_decode_dispatch(h200x2, range(16), 128, Q235, "fp8_block")
    assert ib.total_s > 2 * dpep_decode_dispatch(gb200, range(16), 128, Q235, "fp8_block").total_s
    efa = dpep_decode_dispatch(topology.load("hgx-h200-efa*2"), range(16), 128, Q235, "fp8_block")
    assert efa.total_s > ib.total_s


def test_send_matrix_matches_expectation_shape(gb200):
    uniform = [[4.0] * 8 for _ in range(8)]
    a = dpep_decode_dispatch(gb200, range(8), 8, Q235, "mxfp8", send_matrix=uniform)
    skew = [row[:] for row in uniform]
    skew[0][1] = 400.0
    b = dpep_decode_dispatch(gb200, range(8), 8, Q235, "mxfp8", send_matrix=skew)
    assert b.total_s > a.total_s  # imbalanced routing matters
    with pytest.raises(UserError, match="8x8"):
        dpep_decode_dispatch(gb200, range(8), 8, Q235, "mxfp8", send_matrix=[[1.0]])


# ------------------------------------------------------------------------------------------------ KV transfer


def _kv_plan(tp_src, tp_dst, seq=4096):
    src = KvLayout.tp_sharded(94, 4, 128, 2, 64, tp_src, 100)
    dst = KvLayout.tp_sharded(94, 4, 128, 2, 64, tp_dst, 100)
    return reshard_plan(src, dst, seq)


def test_kv_transfer_monotone_and_nic_parallel(h200x2):
    small = kv_transfer_time(h200x2, _kv_plan(4, 1, 2048), [0, 1, 2, 3], [8])
    big = kv_transfer_time(h200x2, _kv_plan(4, 1, 4096), [0, 1, 2, 3], [8])
    assert big.total_s > small.total_s > 0
    assert big.n_bytes == 4096 * 192512
    # receiving side with one NIC is the bottleneck; spreading destinations over 4 GPUs is faster
    spread = kv_transfer_time(h200x2, _kv_plan(4, 4, 4096), [0, 1, 2, 3], [8, 9, 10, 11])
    assert spread.total_s < big.total_s
    # one NIC at ~50 GB/s * 0.95: bandwidth term dominates the 4096-token transfer
    assert big.total_s == pytest.approx(big.n_bytes / (50e9 * C.KV_NIC_EFFICIENCY), rel=0.2)
    same = kv_transfer_time(h200x2, _kv_plan(1, 1, 64), [0], [0])
    assert same.total_s == 0.0


# ------------------------------------------------------------------------------------------------ step time


def _with_layers(model, factor):
    return model.model_copy(update={"n_layers": model.n_layers * factor,
                                    "layer_types": tuple(model.layer_types) * factor})


PER_STEP_TERMS = {"embed", "lm_head", "host", "cross_node_host", "mtp_fc", "mtp_attn", "mtp_router",
                  "mtp_moe_dispatch", "mtp_moe_gemm", "mtp_shared_expert", "mtp_moe_combine", "mtp_norms",
                  "mtp_lm_head", "mtp_dense_mlp"}


@pytest.mark.parametrize("model", [Q235, Q35], ids=["qwen3", "qwen3.5"])
def test_costs_linear_in_layer_count(model, gb200):
    pre = ParallelPlan(role="prefill", tp=4, ep=4, dp=1, gpus=(0, 1, 2, 3), weight_format="mxfp8")
    dec = ParallelPlan(role="decode", tp=1, ep=8, dp=8, gpus=tuple(range(8)), weight_format="mxfp8")
    for factor in (2, 3):
        big = _with_layers(model, factor)
        for a, b in ((prefill_step_breakdown(model, pre, gb200, [(3000, 0), (1000, 500)]),
                      prefill_step_breakdown(big, pre, gb200, [(3000, 0), (1000, 500)])),
                     (decode_step_breakdown(model, dec, gb200, [16] * 8, [16 * 3000] * 8, draft_k=2),
                      decode_step_breakdown(big, dec, gb200, [16] * 8, [16 * 3000] * 8, draft_k=2))):
            sa, sb = a.seconds(), b.seconds()
            assert set(sa) == set(sb)
            for k in sa:
                want = sa[k] if k in PER_STEP_TERMS else factor * sa[k]
                assert sb[k] == pytest.approx(want, rel=1e-12, abs=1e-15), k


def test_steptime_categories_sum(gb200):
    dec = ParallelPlan(role="decode", tp=1, ep=16, dp=16, gpus=tuple(range(16)), weight_format="mxfp8")
    bd = decode_step_breakdown(Q235, dec, gb200, [32] * 16, [32 * 4000] * 16, draft_k=1)
    stt = decode_step_time(Q235, dec, gb200, [32] * 16, [32 * 4000] * 16, draft_k=1)
    assert stt.total_s == pytest.approx(bd.total_s, rel=1e-12)
    assert stt.attn_s > 0 and stt.moe_gemm_s > 0 and stt.a2a_s > 0 and stt.allreduce_s == 0


@SLOW
@given(b=st.integers(1, 64), db=st.integers(1, 64), ctx=st.integers(1, 8000), k=st.integers(0, 3))
def test_decode_step_more_work_never_faster(b, db, ctx, k, gb200):
    dec = ParallelPlan(role="decode", tp=1, ep=8, dp=8, gpus=tuple(range(8)), weight_format="mxfp8")
    a = decode_step_time(Q235, dec, gb200, [b] * 8, [b * ctx] * 8, draft_k=k).total_s
    c = decode_step_time(Q235, dec, gb200, [b + db] * 8, [(b + db) * ctx] * 8, draft_k=k).total_s
    d = decode_step_time(Q235, dec, gb200, [b] * 8, [b * ctx] * 8, draft_k=k + 1).total_s
    assert c >= a and d >= a


def test_prefill_tp4_vs_tp8_per_gpu(gb200):
    p4 = ParallelPlan(role="prefill", tp=4, ep=4, dp=1, gpus=(0, 1, 2, 3), weight_format="mxfp8")
    p8 = ParallelPlan(role="prefill", tp=8, ep=8, dp=1, kv_replication=2, gpus=tuple(range(8)),
                      weight_format="mxfp8")
    t4 = prefill_step_time(Q235, p4, gb200, [(6000, 0)]).total_s
    b8 = prefill_step_breakdown(Q235, p8, gb200, [(6000, 0)])
    assert "cross_node_host" in b8.seconds()  # TP=8 spans two GB200 trays
    assert 6000 / t4 / 4 > 6000 / b8.total_s / 8  # TP=4 wins per GPU


def test_plan_shape_errors(gb200):
    dec = ParallelPlan(role="decode", tp=1, ep=8, dp=8, gpus=tuple(range(8)))
    with pytest.raises(UserError, match="one entry per rank"):
        decode_step_time(Q235, dec, gb200, [1] * 7, [10] * 8)


@given(n=st.integers(64, 40_000), seqs=st.integers(1, 8))
@settings(max_examples=15, deadline=None)
def test_dp_prefill_two_batch_hides_at_most_its_communication(gb200, n, seqs):
    """dp > 1 (DP attention in a prefiller, the DP-EP prefill model) with two micro-batches: never slower than
    the two micro-batches run one after the other, and never faster than the whole batch's step less all of its
    dispatch, combine and all-reduce time."""
    from rackbed.sim.costs.overlap import split_prefill

    plain = ParallelPlan(role="prefill", tp=2, ep=4, dp=2, gpus=(0, 1, 2, 3))
    ovl = ParallelPlan(role="prefill", tp=2, ep=4, dp=2, gpus=(0, 1, 2, 3), overlap="two_batch")
    batch = [(n // seqs + (1 if i < n % seqs else 0), 0) for i in range(seqs)]
    full = prefill_step_breakdown(Q235, plain, gb200, batch)
    both = prefill_step_breakdown(Q235, ovl, gb200, batch)
    comm = sum(s for name, (cat, s) in full.terms.items() if cat in ("a2a_s", "allreduce_s"))
    assert both.total_s >= full.total_s - comm - 1e-12
    serial = sum(prefill_step_breakdown(Q235, plain, gb200, part).total_s for part in split_prefill(batch) if part)
    assert both.total_s <= serial + 1e-12
    assert both.hidden  # something of the communication is hidden


# ------------------------------------------------------------------------------------------------ calibration


def test_calibration_lookup_and_override(h200, tmp_path):
    table = CalibrationTable.model_validate({"entries": [
        {"kind": "allreduce_us", "gpu": "H200-SXM", "key": {"n_ranks": 4},
         "points": [[1000, 10.0], [1000000, 100.0]]},
        {"kind": "allreduce_us", "gpu": "H200-SXM", "key": {"n_ranks": 4, "algo": "nvls"},
         "points": [[1000, 5.0], [1000000, 50.0]]},
        {"kind": "gemm_tflops", "gpu": "H200-SXM", "key": {"fmt": "bf16"}, "points": [[1, 10.0], [4096, 700.0]]},
    ]})
    assert table.lookup("allreduce_us", "H200-SXM", 31622.7766, n_ranks=4, algo="ring") == pytest.approx(55.0)
    assert table.lookup("allreduce_us", "H200-SXM", 1000, n_ranks=4, algo="nvls") == 5.0  # most specific
    # above the measured range a time continues at the last interval's rate (45 µs per 999 kB), below it is held
    assert table.lookup("allreduce_us", "H200-SXM", 10 ** 9, n_ranks=4, algo="nvls") == pytest.approx(
        50.0 + (10 ** 9 - 10 ** 6) * 45.0 / 999000)
    assert table.lookup("allreduce_us", "H200-SXM", 10, n_ranks=4, algo="nvls") == 5.0
    assert table.lookup("gemm_tflops", "H200-SXM", 10 ** 6, fmt="bf16") == 700.0  # a rate is clamped
    assert table.lookup("allreduce_us", "B200-GB200", 1000, n_ranks=4) is None
    c = allreduce_time(h200, range(4), 1000, algo="nvls", calib=table)
    assert c.calibrated and c.total_s == pytest.approx(5e-6)
    g = gemm_time(H200_SXM, 4096, 4096, 4096, "bf16", calib=table)
    assert g.calibrated and g.achieved_tflops == pytest.approx(700.0)
    assert not gemm_time(H200_SXM, 4096, 4096, 4096, "fp8", calib=table).calibrated
    p = tmp_path / "cal.yaml"
    p.write_text("version: 1\nentries:\n  - kind: allreduce_us\n    gpu: H200-SXM\n    key: {tokens: 3}\n"
                 "    points: [[1, 2]]\n")
    with pytest.raises(ValueError, match=r"cal.yaml: .*entries.*tokens") as e:
        load_calibration(p)
    assert "\n" not in str(e.value)
    p.write_text("entries:\n  - kind: allreduce_us\n    gpu: X\n    points: [[2, 1], [1, 1]]\n")
    with pytest.raises(ValueError, match=r"cal.yaml: entries\[0\]\.points"):
        load_calibration(p)
