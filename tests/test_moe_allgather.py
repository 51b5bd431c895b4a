"""``decode.moe_comm: allgather``: a DP-EP decoder that all-gathers every GPU's tokens and reduce-scatters
the expert outputs (TensorRT-LLM's MoE communication inside one NVLink domain without its all-to-all
kernels), priced by the calibration's measured NCCL all-gather / reduce-scatter curves, and the search's
``decode_moe_comm`` knob."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rackbed import topology
from rackbed.engine.core.model import get_model
from rackbed.sim.calibration.files import default_calibration_for
from rackbed.sim.costs import moe_comm as mc
from rackbed.sim.scenario import build, parse_scenario

TOPO = topology.load("hgx-h200")
QWEN = get_model("qwen3-235b-a22b")
CAL = default_calibration_for("H200-SXM", None, "trtllm")


def _scenario(comm: str, **decode):
    return parse_scenario({
        "kind": "serving", "name": "ag", "topology": "hgx-h200*2", "model": "qwen3-235b-a22b",
        "weight_format": "fp8", "kv_dtype": "fp8", "stack": "trtllm",
        "prefill": {"tp": 2, "ep": 2, "replicas": 1},
        "decode": {"ep": 8, "replicas": 1, "moe_comm": comm, **decode},
        "workload": {"kind": "synthetic", "arrival": {"kind": "poisson", "rate_per_s": 1},
                     "prompt": {"kind": "fixed", "tokens": 6000}, "output": {"kind": "fixed", "tokens": 500},
                     "duration_s": 5}})


def test_the_shipped_h200_tables_carry_nccl_all_gather_and_reduce_scatter():
    kinds = {(e.kind, e.key["n_ranks"], e.key["payload"]) for e in CAL.entries
             if e.kind in ("allgather_us", "reducescatter_us")}
    want = {(k, n, p) for k in ("allgather_us", "reducescatter_us") for n in (2, 4, 8)
            for p in ("bf16", "fp8")}
    assert want == kinds


def test_dispatch_and_combine_read_the_measured_curves_at_the_whole_buffer():
    """30 tokens per GPU over 8 H200: the dispatch is the fp8 all-gather of 8 x 30 x (4096 + 8 x 8) bytes, the
    combine the bf16 reduce-scatter of 8 x 30 x 4096 x 2 bytes, both read off NCCL's measured curves."""
    gpus = list(range(8))
    d = mc.allgather_decode_dispatch(TOPO, gpus, 30, QWEN, "fp8", calib=CAL)
    c = mc.reducescatter_decode_combine(TOPO, gpus, 30, QWEN, calib=CAL)
    ag = CAL.lookup("allgather_us", "H200-SXM", 8 * 30 * (4096 + 64), n_ranks=8, payload="fp8")
    rs = CAL.lookup("reducescatter_us", "H200-SXM", 8 * 30 * 4096 * 2, n_ranks=8, payload="bf16")
    assert d.calibrated_s == pytest.approx(ag * 1e-6) and c.calibrated_s == pytest.approx(rs * 1e-6)
    # the measured collectives at this size: tens of µs, below the DeepEP low-latency dispatch's ~70 µs floor
    assert 10e-6 < d.total_s < 30e-6 and 10e-6 < c.total_s < 30e-6
    assert d.total_s < mc.dpep_decode_dispatch(TOPO, gpus, 30, QWEN, "fp8", calib=CAL).total_s


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 256), st.sampled_from([2, 4, 8]))
def test_without_a_table_the_model_is_half_an_all_reduce(tokens, n):
    """Uncalibrated (or across NVLink domains), a reduce-scatter or all-gather costs half the all-reduce of
    its buffer; more tokens never cost less."""
    from rackbed.sim.costs.collective import allreduce_time

    gpus = list(range(n))
    c = mc.reducescatter_decode_combine(TOPO, gpus, tokens, QWEN)
    assert c.total_s == pytest.approx(0.5 * allreduce_time(TOPO, gpus, n * tokens * QWEN.hidden * 2).total_s)
    assert mc.reducescatter_decode_combine(TOPO, gpus, tokens + 1, QWEN).total_s >= c.total_s


def test_a_decode_step_with_allgather_changes_only_its_dispatch_and_combine():
    """Same plan but ``moe_comm``: attention, expert GEMMs and the rest are priced alike; the dispatch and
    combine are the all-gather and reduce-scatter (Qwen3-235B, DP-EP8, 30 sequences per rank: 26 ms a step
    instead of 32 ms with the DeepEP low-latency table)."""
    a2a = build(_scenario("a2a"), engine_calibration=False)
    ag = build(_scenario("allgather"), engine_calibration=False)
    assert ag.decode_plan.moe_comm == "allgather" and a2a.decode_plan.moe_comm == "a2a"
    ba, bg = (b.cost_model.decode_breakdown(30, 30 * 6250, 0) for b in (a2a, ag))
    for term in ba.terms:
        if term not in ("moe_dispatch", "moe_combine"):
            assert bg.terms[term] == ba.terms[term], term
    n_moe = QWEN.n_layers
    t_gpu = 30
    assert bg.terms["moe_dispatch"][1] == pytest.approx(
        n_moe * mc.allgather_decode_dispatch(TOPO, list(range(8)), t_gpu, QWEN, "fp8", calib=CAL).total_s)
    assert 0.024 < bg.total_s < 0.028 < 0.030 < ba.total_s


def test_skewed_routing_moves_no_more_bytes_with_allgather():
    """An all-gather sends every token to every GPU whatever its experts: a skewed expert load changes the
    expert GEMM on the busiest rank, not the dispatch or combine."""
    skew = {"expert_load": {"dist": "power_law", "alpha": 1.2}}
    uni, hot = (build(_scenario("allgather", **kw), engine_calibration=False).cost_model.decode_breakdown(
        16, 16 * 6250, 0) for kw in ({}, skew))
    assert hot.terms["moe_gemm"][1] > uni.terms["moe_gemm"][1]  # the skew is priced
    assert hot.terms["moe_dispatch"] == uni.terms["moe_dispatch"]
    assert hot.terms["moe_combine"] == uni.terms["moe_combine"]


def test_the_search_tries_both_modes_and_labels_allgather(tmp_path):
    from rackbed.sim import budget as bu
    from rackbed.sim import search as se

    spec = se.spec_from_flags(model="qwen3-235b-a22b", topology=["hgx-h200*8"], weight_format=["fp8"],
                              rate_per_s=1.0, prompt_tokens=6000, output_tokens=500, duration_s=5, ttft_s=2.0,
                              tpot_s=0.03, prefill_tp=[2], decode_ep=[8], max_batch_per_rank=[16, 32],
                              draft_k=[0], kv_dtype=["fp8"], decode_moe_comm=["a2a", "allgather"])
    spec = spec.model_copy(update={"scenario": {"stack": "trtllm"}})
    from rackbed.sim.scenario import scenario_model

    model = scenario_model(parse_scenario(se.base_scenario(spec)))
    topo = topology.load("hgx-h200*8")
    dec = se.decode_options(spec, bu.estimate_load(spec), model, {"hgx-h200*8": topo})
    assert sorted((d.max_batch_per_rank, d.moe_comm) for d in dec) == [
        (16, "a2a"), (16, "allgather"), (32, "a2a"), (32, "allgather")]
    alive = {(d.max_batch_per_rank, d.moe_comm) for d in dec if d.pruned is None}
    assert (32, "allgather") in alive and (32, "a2a") not in alive  # 32 a rank meets 30 ms only by all-gather
    cands = bu.disaggregated_candidates(spec, bu.estimate_load(spec), model, topo, 64)
    built = [c for c in cands if c.overrides]
    ag = [c for c in built if c.overrides.get("decode.moe_comm") == "allgather"]
    assert ag and all("DP-EP8 allgather decode" in c.label for c in ag)
    # the default mode stays out of the overrides and the labels, as before the knob
    assert all("allgather" not in c.label for c in built if "decode.moe_comm" not in c.overrides)
    assert len(ag) < len(built)


def test_a_bad_mode_is_a_one_line_error(capsys):
    from rackbed.engine.cli.main import main

    assert main(["search", "--gpus", "8", "--topology", "hgx-h200", "--decode-moe-comm", "deepep",
                 "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--decode-moe-comm deepep: one of a2a, allgather" in err
