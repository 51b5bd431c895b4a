"""Decoders with attention TP x DP (``decode.tp``): scenario rules, plans and KV, the resharding plan from a
prefiller's TP layout onto a decoder's TP groups, and the decode step's TP terms."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_kv import check_plan

from rackbed.engine.core.kv import KvLayout, pages_needed, reshard_plan
from rackbed.engine.core.model import get_model
from rackbed.engine.core.sharding import ParallelPlan
from rackbed.sim.costs.attention import full_attention_decode_totals
from rackbed.sim.costs.step import decode_step_breakdown
from rackbed.sim.scenario import build, parse_scenario, truncate_model
from rackbed.topology import load as load_topology
from rackbed.topology.errors import UserError

Q235 = get_model("qwen3-235b-a22b")
SMALL = truncate_model(get_model("qwen3-30b-a3b"), 2)
TP_TERMS = {"attn_allreduce", "moe_allreduce", "dense_allreduce", "mtp_attn_allreduce", "mtp_moe_allreduce",
            "mtp_dense_allreduce"}


def _scenario(**decode):
    return parse_scenario({
        "kind": "serving", "topology": "hgx-h200*2", "model": "qwen3-235b-a22b", "weight_format": "fp8_block",
        "prefill": {"tp": 4, "ep": 4, "replicas": 1},
        "decode": {"ep": 8, "replicas": 1, "max_batch_per_rank": 32, **decode},
        "mtp": {"draft_k": 1, "draft": {"kind": "mtp", "layers": 1}},
        "workload": {"kind": "synthetic", "arrival": {"kind": "poisson", "rate_per_s": 4},
                     "prompt": {"kind": "fixed", "tokens": 500}, "output": {"kind": "fixed", "tokens": 20},
                     "n_requests": 4}})


@pytest.fixture(scope="module")
def h200():
    return load_topology("hgx-h200")


@pytest.mark.parametrize(("section", "field", "match"), [
    ("decode", {"tp": 3}, r"^decode\.tp: .*3"),              # 64 q heads / 4 KV heads are not split 3 ways
    ("decode", {"tp": 16, "ep": 8}, r"^decode\.tp: "),        # tp must divide ep
    ("decode", {"ep": 5}, r"^decode\.ep: 5 does not divide the 128 experts"),
    ("prefill", {"tp": 2, "ep": 4}, r"^prefill\.ep: 4 exceeds prefill\.tp: 2"),
    ("prefill", {"tp": 8, "ep": 3}, r"^prefill\.ep: 3 does not divide"),
])
def test_rules_name_the_field(section, field, match):
    sc = _scenario()
    sc = sc.model_copy(update={section: getattr(sc, section).model_copy(update=field)})
    with pytest.raises(UserError, match=match):
        build(sc)


def test_decoder_groups_and_plans():
    b = build(_scenario(tp=4))
    d = b.deployment.decoders[0]
    assert (d.ep, d.ranks, len(d.rank_nics)) == (8, 2, 2)
    pl = b.decode_plan
    assert (pl.tp, pl.dp, pl.ep, pl.world) == (4, 2, 8, 8)
    # Qwen3-235B has 4 KV heads: one per GPU of a TP4 group, four times a DP rank's KV tokens per GPU
    one = build(_scenario()).decode_plan
    assert pl.kv_bytes_per_token_per_rank(Q235) * 4 == one.kv_bytes_per_token_per_rank(Q235)
    eight = build(_scenario(tp=8)).decode_plan  # tp > KV heads: each head on two GPUs
    assert eight.kv_replication == 2
    assert eight.kv_bytes_per_token_per_rank(Q235) == pl.kv_bytes_per_token_per_rank(Q235)
    assert b.decode_budget.kv_capacity_tokens > 3 * build(_scenario()).decode_budget.kv_capacity_tokens


def test_tp_decoder_simulates():
    from rackbed.sim.scenario import simulate_scenario

    _, res = simulate_scenario(_scenario(tp=2))
    assert res.metrics["requests"]["done"] == 4


# ------------------------------------------------------------------------------------------------ KV resharding


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
@given(st.sampled_from([1, 2, 4, 8]), st.sampled_from([1, 2, 4, 8]), st.integers(1, 70), st.integers(1, 16),
       st.integers(1, 16), st.integers(0, 2**31))
def test_reshard_prefill_tp_to_decode_tp_groups(src_tp, dst_tp, seq_len, ps, pd, seed):
    """Prefill TP layout -> one DP rank (a TP group) of a decode plan with attention TP: every destination byte
    written once, nothing read outside the sequence in the source (``test_kv.check_plan``)."""
    model = SMALL  # 4 KV heads: tp 8 replicates each head twice
    src_plan = ParallelPlan(role="prefill", tp=src_tp, ep=src_tp, gpus=tuple(range(src_tp)), page_tokens=ps,
                            kv_replication=max(1, src_tp // 4))
    dst_plan = ParallelPlan(role="decode", tp=dst_tp, ep=2 * dst_tp, dp=2, gpus=tuple(range(2 * dst_tp)),
                            page_tokens=pd, kv_replication=max(1, dst_tp // 4))
    ns, nd = pages_needed(seq_len, ps), pages_needed(seq_len, pd)
    src = KvLayout.for_plan(src_plan, model, ns + 1)
    dst = KvLayout.for_plan(dst_plan, model, nd + 2)
    assert dst.n_ranks == dst_tp
    rng = np.random.default_rng(seed)
    sp, dp = rng.permutation(src.n_pages)[:ns], [rng.permutation(dst.n_pages)[:nd] for _ in range(dst.n_ranks)]
    # a small head_dim keeps the byte-level check fast; the shards are the plans'
    src, dst = (KvLayout(x.n_layers, x.n_kv_heads, 2, x.elem_bytes, x.page_tokens, x.shards, x.n_pages)
                for x in (src, dst))
    check_plan(reshard_plan(src, dst, seq_len, sp, dp), src, dst, seq_len, sp, dp, seed)


# ------------------------------------------------------------------------------------------------ decode step


def _plan(tp: int, ep: int = 8) -> ParallelPlan:
    return ParallelPlan(role="decode", tp=tp, ep=ep, dp=ep // tp, kv_replication=max(1, tp // 4),
                        gpus=tuple(range(ep)), weight_format="fp8_block")


@settings(max_examples=25, deadline=None, derandomize=True)
@given(st.sampled_from([1, 2, 4, 8]), st.integers(1, 64), st.integers(1, 8000), st.integers(0, 2))
def test_decode_tp_terms(h200, tp, b, ctx, k):
    """TP terms exist exactly when tp > 1; the attention is the kind's cost on a GPU's heads (tp-split); the
    TP all-reduce moves a DP rank's tokens."""
    pl = _plan(tp)
    bd = decode_step_breakdown(Q235, pl, h200, [b] * pl.dp, [b * ctx] * pl.dp, draft_k=k)
    terms = bd.seconds()
    assert bool(TP_TERMS & set(terms)) == (tp > 1)
    a = full_attention_decode_totals(h200.gpu_spec(0), Q235, b, b * ctx, tp=tp, fmt="fp8_block", q_per_seq=k + 1,
                                     kv_elem_bytes=pl.kv_elem_bytes, page_tokens=pl.page_tokens)
    assert terms["attn_core"] == pytest.approx(Q235.n_full_layers * a.core_s, rel=1e-12)
    if tp > 1:
        assert terms["attn_allreduce"] > 0 and terms["moe_allreduce"] == pytest.approx(terms["attn_allreduce"])
    assert bd.total_s == pytest.approx(sum(terms.values()))


def test_decode_tp_splits_attention(h200):
    """At equal sequences per DP rank, a TP4 rank reads a quarter of the KV per GPU: its attention core is
    cheaper, and the step's MoE sees a quarter of the tokens (two DP ranks instead of eight)."""
    one, four = _plan(1), _plan(4)
    a = decode_step_breakdown(Q235, one, h200, [32] * 8, [32 * 4000] * 8).seconds()
    c = decode_step_breakdown(Q235, four, h200, [32] * 2, [32 * 4000] * 2).seconds()
    assert c["attn_core"] < a["attn_core"] / 2
    assert c["moe_gemm"] < a["moe_gemm"]


def test_real_mode_refuses_tp_decoders():
    from rackbed.engine.real.driver import real_model_config

    with pytest.raises(UserError, match=r"^decode\.tp: real mode"):
        real_model_config(build(_scenario(tp=2)))
