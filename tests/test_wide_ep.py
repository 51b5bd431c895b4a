"""Wide expert parallelism with redundant experts (``redundant_experts``): the divisibility rule and its one-line
errors, the memory the copies cost, and the decode step's per-slot load."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rackbed.engine.core.model import get_model
from rackbed.engine.core.sharding import ParallelPlan, min_redundant_experts
from rackbed.sim.costs.gemm import binomial_histogram
from rackbed.sim.costs.moe_comm import expected_dest_ranks
from rackbed.sim.costs.step import decode_step_breakdown
from rackbed.sim.parallel import check_parallel
from rackbed.sim.scenario import parse_scenario
from rackbed.topology import load as load_topology
from rackbed.topology.errors import UserError

DSV3 = get_model("deepseek-v3")
Q235 = get_model("qwen3-235b-a22b")


@pytest.fixture(scope="module")
def nvl72():
    return load_topology("gb200-nvl72")


def _plan(ep: int, redundant: int = 0, fmt: str = "fp8_block") -> ParallelPlan:
    return ParallelPlan(role="decode", tp=1, ep=ep, dp=ep, gpus=tuple(range(ep)), weight_format=fmt,
                        redundant_experts=redundant, max_batch_seqs=64)


def test_ep72_needs_redundant_experts(nvl72):
    with pytest.raises(UserError) as e:
        _plan(72).validate(DSV3, nvl72)
    assert str(e.value) == ("ep=72 does not divide 256 experts of deepseek-v3 "
                            "(redundant_experts: 32 gives 288 = 72 x 4 expert slots)")
    with pytest.raises(UserError, match=r"^ep=72 does not divide 256 experts \+ 30 redundant = 286 expert slots"):
        _plan(72, 30).validate(DSV3, nvl72)
    b = _plan(72, 32).validate(DSV3, nvl72)
    assert b.redundant_experts == 32 and "+32 redundant" in str(b)
    assert _plan(72, 32).slots_per_rank(DSV3) == 4


def test_redundant_on_dense_model_is_an_error(nvl72):
    dense = get_model("qwen3-30b-a3b").model_copy(update={"n_experts": 0})
    with pytest.raises(UserError, match="has no routed experts"):
        _plan(8, 8).check_structure(dense, nvl72)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(ep=st.sampled_from([8, 16, 24, 32, 48, 64, 72]), extra=st.integers(0, 3))
def test_copies_cost_their_weights(ep, extra):
    """Every rank stores ``slots / ep`` experts: the expert bytes over all ranks are the model's expert bytes times
    ``slots / n_experts`` (rounding aside), and nothing else in the budget changes."""
    red = min_redundant_experts(DSV3.n_experts, ep) + extra * ep
    plan = _plan(ep, red)
    b = plan.memory_budget(DSV3, hbm_bytes=10**12)
    assert (DSV3.n_experts + red) % ep == 0
    ref = _plan(8).memory_budget(DSV3, hbm_bytes=10**12).expert_weight_bytes * 8  # all experts, once
    assert b.expert_weight_bytes * ep == pytest.approx(ref * (DSV3.n_experts + red) / DSV3.n_experts, rel=1e-6)
    assert b.attention_weight_bytes == _plan(8).memory_budget(DSV3, hbm_bytes=10**12).attention_weight_bytes


def _decode_scenario(**decode):
    return parse_scenario({
        "kind": "serving", "topology": "gb200-nvl72", "model": "deepseek-v3", "weight_format": "fp8_block",
        "prefill": {"tp": 4, "ep": 4, "replicas": 1},
        "decode": {"ep": 72, "replicas": 1, **decode},
        "workload": {"kind": "synthetic", "arrival": {"kind": "poisson", "rate_per_s": 4},
                     "prompt": {"kind": "fixed", "tokens": 500}, "output": {"kind": "fixed", "tokens": 20},
                     "n_requests": 4}})


@pytest.mark.parametrize("decode,msg", [
    ({}, r"^decode\.ep: 72 does not divide the 256 experts of deepseek-v3 \(decode\.redundant_experts: 32 gives "
         r"288 = 72 x 4 expert slots\)$"),
    ({"redundant_experts": 16}, r"^decode\.redundant_experts: ep = 72 does not divide the 256 experts \+ 16 "
                                r"redundant = 272 expert slots of deepseek-v3"),
])
def test_scenario_rules_name_the_field(decode, msg):
    with pytest.raises(UserError, match=msg):
        check_parallel(_decode_scenario(**decode), DSV3)


def test_scenario_with_redundant_experts_passes_the_rules():
    sc = _decode_scenario(redundant_experts=32)
    check_parallel(sc, DSV3)
    from rackbed.sim.parallel import decode_plan_for

    assert decode_plan_for(sc, DSV3, range(72)).redundant_experts == 32


@settings(max_examples=40, deadline=None, derandomize=True)
@given(ep=st.integers(1, 96), k=st.sampled_from([1, 2, 4, 8]))
def test_expected_dest_ranks_bounds(ep, k):
    """A token's top-k copies land on between 1 and min(k, ep) ranks; divisible and fractional forms agree on the
    divisible cases (the fractional product is the same hypergeometric miss probability)."""
    d = expected_dest_ranks(256, k, ep)
    assert 1 - 1e-9 <= d <= min(k, ep) + 1e-9
    if 256 % ep == 0:
        per = 256 / ep
        miss = math.prod(max(0.0, (256 - per - i) / (256 - i)) for i in range(k))
        assert d == pytest.approx(ep * (1 - miss))


@settings(max_examples=40, deadline=None, derandomize=True)
@given(tokens=st.integers(1, 4096), red=st.sampled_from([0, 16, 32, 48]))
def test_slot_histogram_keeps_a_ranks_load(tokens, red):
    """Balanced routing over the slots: a rank's expected token copies are ``tokens * top_k / ep`` whatever the
    redundancy (copies spread the load, they do not add to it), over at most ``slots / ep`` slots."""
    ep = 16
    slots = Q235.n_experts + red
    hist = binomial_histogram(tokens, Q235.top_k / slots, slots // ep)
    assert sum(c for _, c in hist) <= slots // ep + 1e-6
    if tokens * Q235.top_k / slots <= 8:  # exact pmf regime (the large-mean bins round to whole tokens)
        assert sum(m * c for m, c in hist) == pytest.approx(tokens * Q235.top_k / ep, rel=1e-3)


def test_decode_step_prices_the_slots(nvl72):
    """At a large batch every local slot is activated: more slots per rank stream more expert weights (the
    copies' cost); at a tiny batch the activated experts, and so the time, barely change."""
    plan = ParallelPlan(role="decode", tp=1, ep=16, dp=16, gpus=tuple(range(16)), weight_format="mxfp8")
    wide = plan.model_copy(update={"redundant_experts": 16})
    gemm = {}
    for name, p in (("base", plan), ("red", wide)):
        for b in (1, 64):
            bd = decode_step_breakdown(Q235, p, nvl72, [b] * 16, [b * 2000.0] * 16)
            gemm[name, b] = bd.terms["moe_gemm"][1]
    assert gemm["red", 64] > gemm["base", 64]
    assert gemm["red", 1] == pytest.approx(gemm["base", 1], rel=0.1)
