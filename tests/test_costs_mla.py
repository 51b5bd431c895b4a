"""Cost models of the model families beyond Qwen (sim/costs/mla.py, sliding-window attention, MXFP4 experts):
per-kind facts, breakdowns that sum to the step, and the imported MLA tables hit with provenance."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rackbed import topology
from rackbed.engine.core.model import get_model
from rackbed.engine.core.sharding import ParallelPlan
from rackbed.sim.costs import constants as C
from rackbed.sim.costs.attention import (
    MIXER_COSTS,
    full_attention_decode_totals,
    sliding_attention_decode,
    sliding_attention_decode_totals,
    sliding_attention_prefill,
)
from rackbed.sim.costs.calibration import kernel_fixed_us
from rackbed.sim.costs.gemm import expert_mlp_time
from rackbed.sim.costs.mixed import mixed_step_breakdown
from rackbed.sim.costs.mla import mla_decode, mla_decode_totals, mla_dims, mla_prefill, mla_roofline_intensity
from rackbed.sim.costs.step import decode_step_breakdown, prefill_step_breakdown
from rackbed.topology.specs import GPUS

H200, B200 = GPUS["H200-SXM"], GPUS["B200-HGX"]
DS, OSS, GLM = get_model("deepseek-v3"), get_model("gpt-oss-120b"), get_model("glm-4.5")
FIXED = kernel_fixed_us(None, H200) * 1e-6
PROPS = settings(max_examples=25, deadline=None, derandomize=True)


# ------------------------------------------------------------------------------------------------ MLA


@PROPS
@given(ctx=st.integers(1, 200_000), n=st.integers(1, 64), tp=st.sampled_from([1, 2, 4, 8, 16, 32, 64, 128]))
def test_absorbed_decode_reads_the_latent_once_per_rank_whatever_tp(ctx, n, tp):
    a = mla_decode(H200, DS, [ctx] * n, tp=tp, page_tokens=1)
    assert a.core_bytes == n * ctx * (DS.kv_lora_rank + DS.qk_rope_head_dim) * 2
    # the FLOPs, not the bytes, shrink with the heads
    assert a.core_flops == pytest.approx(mla_decode(H200, DS, [ctx] * n, tp=1, page_tokens=1).core_flops / tp)


@PROPS
@given(ctx=st.integers(512, 100_000), n=st.integers(1, 64), k=st.integers(2, 8))
def test_bandwidth_bound_mla_decode_scales_with_context_times_latent_bytes(ctx, n, k):
    """At 8 heads per rank (TP 16) the absorbed kernel is bandwidth-bound: time = latent bytes / rate, so k x the
    context takes k x the time, and an fp8 latent half the bf16 one's."""
    def core(c, eb):
        return mla_decode(H200, DS, [c] * n, tp=16, page_tokens=1, kv_elem_bytes=eb).core_s - FIXED

    assert mla_roofline_intensity(DS.mixer("mla"), 16) < H200.dense_tflops.bf16 / 4.8  # below the ridge
    assert core(k * ctx, 2.0) == pytest.approx(k * core(ctx, 2.0), rel=1e-9)
    assert core(ctx, 1.0) == pytest.approx(core(ctx, 2.0) / 2, rel=1e-9)


def test_all_heads_on_one_rank_make_mla_decode_compute_bound_on_hopper():
    """DP attention: a rank holds all 128 heads, ~240 FLOP per bf16 latent byte, above H200's ridge (~206):
    the core takes longer than its bytes at the decode bandwidth, and MTP verification (2 query tokens) doubles
    it, while at TP 16 (bandwidth-bound) a second query token costs nothing."""
    att = DS.mixer("mla")
    assert mla_roofline_intensity(att, 1) > H200.dense_tflops.bf16 * 1e12 / (H200.hbm_GBps * 1e9)
    one = mla_decode_totals(H200, DS, 64, 64 * 8192, q_per_seq=1)
    two = mla_decode_totals(H200, DS, 64, 64 * 8192, q_per_seq=2)
    assert one.core_s - FIXED > one.core_bytes / (H200.hbm_GBps * 1e9 * C.DECODE_ATTN_BW_EFFICIENCY)
    assert two.core_s - FIXED == pytest.approx(2 * (one.core_s - FIXED))
    bw1 = mla_decode_totals(H200, DS, 64, 64 * 8192, tp=16, q_per_seq=1)
    bw2 = mla_decode_totals(H200, DS, 64, 64 * 8192, tp=16, q_per_seq=2)
    assert bw2.core_s == bw1.core_s


def test_mla_prefill_rebuilds_the_cached_tokens_with_kv_b_and_attends_over_them():
    fresh = mla_prefill(H200, DS, [(2048, 0)], tp=8)
    cached = mla_prefill(H200, DS, [(2048, 6144)], tp=8)
    assert dict(fresh.parts)["kv_up"] == 0.0 and dict(cached.parts)["kv_up"] > 0.0
    assert cached.proj_s == fresh.proj_s  # projections see the new tokens only
    h, att = 128 // 8, DS.mixer("mla")
    assert cached.core_flops == pytest.approx(2 * h * (192 + 128) * att.attended_pairs(2048, 6144))


def test_mla_breakdown_terms_and_the_step_total():
    topo = topology.load("hgx-h200")
    pre = ParallelPlan(role="prefill", tp=8, ep=8, dp=1, gpus=tuple(range(8)), weight_format="fp8_block")
    dec = ParallelPlan(role="decode", tp=1, ep=8, dp=8, gpus=tuple(range(8)), weight_format="fp8_block")
    p = prefill_step_breakdown(DS, pre, topo, [(3000, 1000), (2000, 0)])
    d = decode_step_breakdown(DS, dec, topo, [32] * 8, [32 * 3000] * 8, draft_k=1)
    x = mixed_step_breakdown(DS, dec, topo, [16] * 8, [16 * 3000] * 8, [[(512, 512)]] * 8)
    for bd in (p, d, x):
        assert sum(bd.seconds().values()) == pytest.approx(bd.total_s)
        assert bd.to_steptime().total_s == pytest.approx(bd.total_s)
        assert not any(k.startswith("attn_") and k != "attn_allreduce" for k in bd.terms)  # no GQA layer
    assert {"mla_proj", "mla_core", "mla_kv_up", "shared_expert", "dense_mlp", "moe_gemm"} <= p.terms.keys()
    assert {"mla_proj", "mla_core", "mla_absorb", "shared_expert", "dense_mlp", "mtp_attn"} <= d.terms.keys()
    assert {"mla_core_decode", "mla_core_prefill", "mla_absorb", "mla_kv_up"} <= x.terms.keys()
    # 3 dense first layers, 58 MoE layers; the MTP module's attention is MLA
    assert DS.n_dense_layers == 3 and DS.n_moe_layers == 58
    worst = MIXER_COSTS["mla"].decode(H200, DS, [32] * 8, [(32, 32 * 3000)],
                                      {"fmt": "fp8_block", "q_per_seq": 1, "kv_elem_bytes": 2.0,
                                       "page_tokens": dec.page_tokens, "calib": None})
    assert d.seconds()["mtp_attn"] == pytest.approx(worst.total_s)


def test_glm_dense_first_layers_are_priced_as_a_dense_mlp():
    topo = topology.load("hgx-h200")
    dec = ParallelPlan(role="decode", tp=1, ep=8, dp=8, gpus=tuple(range(8)), weight_format="fp8_block")
    d = decode_step_breakdown(GLM, dec, topo, [16] * 8, [16 * 2000] * 8)
    assert GLM.n_dense_layers == 3 and d.seconds()["dense_mlp"] > 0 and d.seconds()["shared_expert"] > 0


# ------------------------------------------------------------------------------------------------ sliding window


@PROPS
@given(extra=st.integers(0, 500_000), n=st.integers(1, 64), page=st.sampled_from([1, 16, 64]))
def test_sliding_decode_is_flat_beyond_the_window(extra, n, page):
    w = OSS.sliding_window
    at_w = sliding_attention_decode(H200, OSS, [w + page] * n, page_tokens=page)
    beyond = sliding_attention_decode(H200, OSS, [w + page + extra] * n, page_tokens=page)
    assert beyond.core_flops == at_w.core_flops
    assert beyond.core_bytes <= at_w.core_bytes + n * page * 2 * OSS.n_kv_heads * OSS.head_dim * 2
    tot_w = sliding_attention_decode_totals(H200, OSS, n, n * (w + page), page_tokens=page)
    tot = sliding_attention_decode_totals(H200, OSS, n, n * (w + page + extra), page_tokens=page)
    assert tot.core_s == tot_w.core_s
    full = full_attention_decode_totals(H200, OSS, n, n * (w + page + extra), page_tokens=page)
    assert full.core_s >= tot.core_s


@PROPS
@given(q=st.integers(1, 8192), c=st.integers(0, 100_000))
def test_sliding_prefill_attends_at_most_the_window(q, c):
    a = sliding_attention_prefill(H200, OSS, [(q, c)])
    h = OSS.n_q_heads
    assert a.core_flops <= 4 * h * OSS.head_dim * q * OSS.sliding_window
    assert a.core_flops == pytest.approx(4 * h * OSS.head_dim * OSS.mixer("sliding").attended_pairs(q, c))


def test_gpt_oss_step_has_sliding_and_full_terms():
    topo = topology.load("hgx-h200")
    dec = ParallelPlan(role="decode", tp=1, ep=4, dp=4, gpus=tuple(range(4)), weight_format="mxfp4")
    d = decode_step_breakdown(OSS, dec, topo, [64] * 4, [64 * 30_000] * 4)
    s = d.seconds()
    assert s["sliding_attn_core"] > 0 and s["attn_core"] > 10 * s["sliding_attn_core"]  # 128-token window
    assert sum(s.values()) == pytest.approx(d.total_s)


# ------------------------------------------------------------------------------------------------ MXFP4 experts


def test_mxfp4_experts_on_b200_beat_fp8_on_h200_by_the_bandwidth_ratio():
    """A few tokens per expert: the grouped GEMM streams the weights. MXFP4 (4.25 bits, native FP4 MMA on
    Blackwell) on B200 vs FP8 on H200: time ratio ~ (4.25 / 8) x (H200 / B200 HBM)."""
    hist = [2] * 32
    fp8 = expert_mlp_time(H200, OSS.hidden, OSS.moe_intermediate, hist, "fp8").total_s
    fp4 = expert_mlp_time(B200, OSS.hidden, OSS.moe_intermediate, hist, "mxfp4").total_s
    expect = (4.25 / 8) * (H200.hbm_GBps * C.HBM_EFFICIENCY["hopper"]) / (B200.hbm_GBps * C.HBM_EFFICIENCY["blackwell"])
    assert fp4 / fp8 == pytest.approx(expect, rel=0.25)


def test_mxfp4_on_hopper_reads_packed_weights_and_computes_in_fp8():
    """The Hopper fallback: weight-only MXFP4 — bandwidth of 4.25-bit weights when memory-bound, the FP8 MMA
    rate (times the dequantisation factor) when compute-bound."""
    from rackbed.sim.costs.gemm import format_execution

    fe = format_execution(H200, "mxfp4")
    assert fe.exec_format == "fp8" and "dequantisation" in fe.note
    few = [2] * 32
    assert expert_mlp_time(H200, OSS.hidden, OSS.moe_intermediate, few, "mxfp4").total_s < \
        expert_mlp_time(H200, OSS.hidden, OSS.moe_intermediate, few, "fp8").total_s
    many = [4096] * 4
    assert expert_mlp_time(H200, OSS.hidden, OSS.moe_intermediate, many, "mxfp4").total_s > \
        expert_mlp_time(H200, OSS.hidden, OSS.moe_intermediate, many, "fp8").total_s


# ------------------------------------------------------------------------------------------------ measured tables


@pytest.fixture(scope="module")
def h200_tables():
    from rackbed.sim.calibration.files import load_calibration_file

    return load_calibration_file(Path(__file__).resolve().parent.parent / "calibration" / "h200-trtllm.json.gz")


@pytest.mark.slow
def test_mla_tables_are_imported_with_provenance(h200_tables):
    meta, table = h200_tables.meta, h200_tables
    files = {t["file"]: t for t in meta["tables"]}
    for f in ("h200_sxm/mla/trtllm/1.3.0rc20/context_mla_perf.parquet",
              "h200_sxm/mla/trtllm/1.3.0rc20/generation_mla_perf.parquet",
              "h200_sxm/mla_bmm/trtllm/1.3.0rc20/mla_bmm_perf.parquet"):
        assert files[f]["rows_used"] > 0
    for kind in ("mla_prefill_tflops", "mla_decode_GBps", "mla_bmm_us"):
        entries = [e for e in table.entries if e.kind == kind]
        assert entries and all("aiconfigurator-core" in e.source and e.key["dims"] == "512+64/128/128"
                               for e in entries)
        assert meta["validation"][kind]["median_pct"] < 6


def test_an_mla_decode_row_on_h200_is_hit(h200_tables):
    """A DP-attention rank (128 heads) decoding 64 sequences of 8192 tokens: the measured generation-MLA row, not
    the roofline."""
    table = h200_tables
    e = table.entry("mla_decode_GBps", "H200-SXM", dims=mla_dims(DS.mixer("mla")), n_heads=128, seqs=64, kv="bf16")
    assert e is not None and "generation_mla_perf" in e.source and e.key["seqs"] == 64
    cal = mla_decode(H200, DS, [8192] * 64, page_tokens=1, calib=table).core_s
    rate = dict(e.points)[8192.0]  # a fit point of the curve
    assert cal == pytest.approx(64 * 8192 * 576 * 2 / (rate * 1e9) + FIXED, rel=1e-9)
    assert cal != mla_decode(H200, DS, [8192] * 64, page_tokens=1).core_s
    pq = pytest.importorskip("pyarrow.parquet")
    pytest.importorskip("aiconfigurator_core")
    from rackbed.sim.perf_tables import data_root

    rows = pq.read_table(data_root() / "h200_sxm/mla/trtllm/1.3.0rc20/generation_mla_perf.parquet").to_pylist()
    measured = min(r["latency"] for r in rows if r["num_heads"] == 128 and r["batch_size"] == 64
                   and r["step"] == 8191 and r["kv_cache_dtype"] == "bfloat16") * 1e-3
    assert cal == pytest.approx(measured, rel=0.02)


def test_mla_prefill_and_bmm_rows_on_h200_are_hit(h200_tables):
    table = h200_tables
    with_t = mla_prefill(H200, DS, [(8192, 0)], tp=1, calib=table)
    without = mla_prefill(H200, DS, [(8192, 0)], tp=1)
    assert with_t.core_s != without.core_s
    assert math.isclose(with_t.core_flops, without.core_flops)
    topo = topology.load("hgx-h200")
    dec = ParallelPlan(role="decode", tp=1, ep=8, dp=8, gpus=tuple(range(8)), weight_format="fp8_block")
    d = decode_step_breakdown(DS, dec, topo, [64] * 8, [64 * 4096] * 8, calib=table)
    us = table.lookup("mla_bmm_us", "H200-SXM", 64, dims="512+64/128/128", op="pre", n_heads=128, fmt="fp8")
    us += table.lookup("mla_bmm_us", "H200-SXM", 64, dims="512+64/128/128", op="post", n_heads=128, fmt="fp8")
    assert d.seconds()["mla_absorb"] == pytest.approx(DS.n_layers * us * 1e-6)
