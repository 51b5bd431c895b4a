"""Expert load as data (``engine.core.expert_load``, ``sim.costs.eplb``): uniform routing leaves the decode step
exactly as it was, the busiest rank is never below the mean, EPLB never raises the busiest rank's observed load, a
hand-computed EP4 case, and the scenario fields' one-line errors."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rackbed.engine.core.expert_load import (
    EplbSpec,
    ExpertLoadSpec,
    Placement,
    busiest_rank,
    eplb_placement,
    layer_shares,
    rank_loads,
    read_histogram,
    static_placement,
)
from rackbed.engine.core.model import get_model
from rackbed.engine.core.sharding import ParallelPlan
from rackbed.sim.costs.collective import group_links
from rackbed.sim.costs.eplb import ExpertLoad
from rackbed.sim.costs.gemm import expert_mlp_time
from rackbed.sim.costs.moe_comm import _act_bpe, dpep_decode_dispatch, expected_dest_ranks
from rackbed.sim.costs.step import decode_step_breakdown
from rackbed.sim.scenario import expert_load_kw, parse_scenario
from rackbed.topology import load as load_topology
from rackbed.topology.errors import UserError

DSV3 = get_model("deepseek-v3")
Q235 = get_model("qwen3-235b-a22b")
#: 8 experts, top-2: the hand-computed case
TINY = get_model("qwen3-30b-a3b").model_copy(update={"name": "tiny-moe", "n_experts": 8, "top_k": 2})
HIST = (8.0, 4.0, 2.0, 2.0, 1.0, 1.0, 1.0, 1.0)


@pytest.fixture(scope="module")
def nvl72():
    return load_topology("gb200-nvl72")


def _plan(ep: int, redundant: int = 0, fmt: str = "fp8_block") -> ParallelPlan:
    return ParallelPlan(role="decode", tp=1, ep=ep, dp=ep, gpus=tuple(range(ep)), weight_format=fmt,
                        redundant_experts=redundant, max_batch_seqs=64)


# ------------------------------------------------------------------------------------------------ uniform = today


@settings(max_examples=25, deadline=None, derandomize=True)
@given(model=st.sampled_from([DSV3, Q235]), ep=st.sampled_from([8, 16, 32]), extra=st.integers(0, 1),
       batch=st.integers(1, 128), draft_k=st.integers(0, 2), eplb=st.booleans())
def test_uniform_load_is_todays_step_exactly(nvl72, model, ep, extra, batch, draft_k, eplb):
    """Uniform routing (with or without an EPLB setting) gives the very terms of the step without expert load."""
    plan = _plan(ep, extra * ep)
    args = (model, plan, nvl72, [batch] * ep, [batch * 3000.0] * ep)
    ref = decode_step_breakdown(*args, draft_k=draft_k, n_mtp_layers=1)
    got = decode_step_breakdown(*args, draft_k=draft_k, n_mtp_layers=1,
                                expert_load=ExpertLoad(ExpertLoadSpec("uniform"), EplbSpec(eplb)))
    assert got.terms == ref.terms


# ------------------------------------------------------------------------------------------------ busiest >= mean


_specs = st.one_of(
    st.builds(lambda a, s, n: ExpertLoadSpec("power_law", alpha=a, seed=s, samples=n),
              st.floats(0, 2), st.integers(0, 5), st.integers(0, 4)),
    st.builds(lambda w, s, n: ExpertLoadSpec("histogram", weights=(tuple(w),), seed=s, samples=n),
              st.lists(st.floats(0.01, 100), min_size=16, max_size=16), st.integers(0, 5), st.integers(0, 4)))


@settings(max_examples=60, deadline=None, derandomize=True)
@given(spec=_specs, ep=st.sampled_from([1, 2, 4, 8]), extra=st.integers(0, 2), tokens=st.integers(1, 300),
       top_k=st.sampled_from([1, 2, 4]), eplb=st.booleans())
def test_busiest_rank_is_never_below_the_mean(spec, ep, extra, tokens, top_k, eplb):
    b = busiest_rank(spec, 16, top_k, 3, ep, 16 + extra * ep, tokens, EplbSpec(eplb, 10))
    assert b.mean_copies == pytest.approx(tokens * top_k / ep)
    assert b.copies >= b.mean_copies * (1 - 1e-9)
    assert b.scale >= 1 - 1e-9
    # deduplicated messages: at least the mean rank's, at most every token
    m = b.message_scale(top_k, ep)
    assert 1 - 1e-9 <= m <= (1 / (1 - (1 - 1 / ep) ** top_k) if ep > 1 else 1) + 1e-9
    assert len(b.slot_tokens) == (16 + extra * ep) // ep


@settings(max_examples=30, deadline=None, derandomize=True)
@given(alpha=st.floats(0, 3), top_k=st.sampled_from([1, 2, 8]))
def test_power_law_shares_respect_the_top_k_cap(alpha, top_k):
    """A token visits an expert at most once: no share above 1 / top_k; shares sum to one per layer."""
    s = layer_shares(ExpertLoadSpec("power_law", alpha=alpha), 64, top_k, 4)
    assert np.allclose(s.sum(axis=1), 1.0)
    assert s.max() <= 1 / top_k + 1e-9


def test_monte_carlo_is_deterministic_given_the_seed():
    spec = ExpertLoadSpec("power_law", alpha=1.2, seed=7, samples=8)
    a = busiest_rank(spec, 64, 4, 5, 8, 64, 512)
    from rackbed.engine.core import expert_load

    expert_load._busiest_cached.cache_clear()  # drawn again, not read from the cache
    assert busiest_rank(spec, 64, 4, 5, 8, 64, 512) == a
    other = busiest_rank(ExpertLoadSpec("power_law", alpha=1.2, seed=8, samples=8), 64, 4, 5, 8, 64, 512)
    assert other != a


# ------------------------------------------------------------------------------------------------ EPLB


@st.composite
def _placements(draw):
    n = draw(st.sampled_from([4, 8, 12, 16]))
    ep = draw(st.sampled_from([d for d in (1, 2, 4, 8) if n % d == 0]))
    slots = n + draw(st.integers(0, 2)) * ep
    loads = draw(st.lists(st.floats(0, 1000), min_size=n, max_size=n))
    # a current placement: every expert once, the rest random copies, shuffled over the slots
    rng = np.random.default_rng(draw(st.integers(0, 10**6)))
    experts = list(range(n)) + list(rng.integers(0, n, slots - n))
    rng.shuffle(experts)
    per = slots // ep
    cur = Placement(tuple(tuple(experts[r * per:(r + 1) * per]) for r in range(ep)))
    return np.array(loads), slots, ep, cur


@settings(max_examples=120, deadline=None, derandomize=True)
@given(case=_placements())
def test_eplb_never_raises_the_busiest_rank(case):
    """Against the static placement and against any current placement of the same slots, on the observed loads;
    the result holds every expert, ``slots / ep`` per rank."""
    loads, slots, ep, cur = case
    n = len(loads)
    for before in (static_placement(n, slots, ep), cur):
        after = eplb_placement(loads, slots, ep, before)
        assert rank_loads(loads, after).max() <= rank_loads(loads, before).max() * (1 + 1e-12) + 1e-12
        assert all(len(r) == slots // ep for r in after.ranks)
        assert set(np.flatnonzero(after.copies(n))) == set(range(n))


def test_redundant_slots_with_eplb_buy_back_the_busiest_rank(nvl72):
    """DeepSeek-V3 EP32 under its power law: 32 redundant slots placed by EPLB bring the busiest rank near the
    mean and the step back near the uniform one; without EPLB the copies (of experts 0..31) barely help."""
    pl = ExpertLoadSpec("power_law", alpha=1.0, samples=4)
    args = ([64] * 32, [64 * 2000.0] * 32)
    uni = decode_step_breakdown(DSV3, _plan(32), nvl72, *args).total_s
    skew = decode_step_breakdown(DSV3, _plan(32), nvl72, *args, expert_load=ExpertLoad(pl)).total_s
    eplb = decode_step_breakdown(DSV3, _plan(32, 32), nvl72, *args,
                                 expert_load=ExpertLoad(pl, EplbSpec(True, 1000)))
    assert skew > 1.2 * uni
    assert uni < eplb.total_s < 1.1 * uni
    assert 0 < eplb.terms["eplb_rebalance"][1] < 0.01 * eplb.total_s


# ------------------------------------------------------------------------------------------------ by hand


def test_hand_computed_ep4_case(nvl72):
    """EP4, 8 experts, top-2, weights 8:4:2:2:1:1:1:1 (of 20), 10 tokens per rank (40 in all, 80 copies), closed
    form. Static placement: rank 0 holds experts 0 and 1, i.e. 12/20 of the copies = 48 tokens (32 + 16) against
    a mean of 20: scale 2.4. Its grouped GEMM is over [32, 16] tokens; a token reaches it with probability
    1 - 0.4^2 = 0.84 against 1 - 0.75^2 = 0.4375 for the mean rank, so its dispatch receives 0.84 / 0.4375 = 1.92 x
    the uniform per-peer tokens from each of its 3 peers (and unpacks 2.4 x the copies). EPLB with 4 redundant
    slots: expert 0 gets 3 more copies, expert 1 one (copies of 8 tokens: 0 x4, 1 x2, 2, 3; and four of 4), every
    rank 8 + 8 + 4 = 20 = the mean."""
    spec = ExpertLoadSpec("histogram", weights=(HIST,), samples=0)
    b = busiest_rank(spec, 8, 2, 1, 4, 8, 40)
    assert (b.copies, b.mean_copies, b.slot_tokens, b.scale) == (48.0, 20.0, (32, 16), 2.4)
    assert b.slot_hist == ((16, 1.0), (32, 1.0))
    plan = _plan(4)
    bd = decode_step_breakdown(TINY, plan, nvl72, [10] * 4, [10 * 1000.0] * 4, expert_load=ExpertLoad(spec))
    n_moe = TINY.n_moe_layers
    gpu = nvl72.gpu_spec(0)
    # per layer the layer-0 permutation is not used by a histogram: every layer is the same
    gemm = expert_mlp_time(gpu, TINY.hidden, TINY.moe_intermediate, [32, 16], plan.weight_format).total_s
    assert bd.terms["moe_gemm"][1] == pytest.approx(n_moe * gemm, rel=1e-12)
    assert b.message_scale(2, 4) == pytest.approx(1.92)
    disp = dpep_decode_dispatch(nvl72, plan.gpus, 10, TINY, plan.weight_format, recv_scale=b.message_scale(2, 4),
                                copy_scale=2.4)
    assert bd.terms["moe_dispatch"][1] == pytest.approx(n_moe * disp.total_s, rel=1e-12)
    # the transfer by hand: d = 4 (1 - C(6,2)/C(8,2)) = 13/7 ranks per token; per peer 10 d / 4 copies; the busiest
    # rank receives 3 peers x that x 1.92, each copy hidden x act bytes + top_k x 8 + 4 B
    assert expected_dest_ranks(8, 2, 4) == pytest.approx(13 / 7)
    copy = TINY.hidden * _act_bpe(gpu, plan.weight_format) + 2 * 8 + 4
    recv = 3 * (10 * 13 / 7 / 4) * 1.92
    assert disp.transfer_s == pytest.approx(recv * copy / (group_links(nvl72, plan.gpus).nvlink_bw_GBps * 1e9))
    # EPLB with 4 redundant slots
    e = busiest_rank(spec, 8, 2, 1, 4, 12, 40, EplbSpec(True))
    assert (e.copies, e.slot_tokens, e.scale, e.moved_per_rebalance) == (20.0, (8, 8, 4), 1.0, 0.0)
    assert e.slot_hist == ((4, 1.0), (8, 2.0))
    placed = eplb_placement(np.array(HIST) * 4, 12, 4)
    assert sorted(sorted(r) for r in placed.ranks) == [[0, 1, 4], [0, 1, 5], [0, 2, 6], [0, 3, 7]]


# ------------------------------------------------------------------------------------------------ scenario


def _scenario(**decode):
    return {"kind": "serving", "topology": "gb200-nvl72", "model": "deepseek-v3", "weight_format": "fp8_block",
            "prefill": {"tp": 4, "ep": 4, "replicas": 1}, "decode": {"ep": 32, "replicas": 1, **decode},
            "workload": {"kind": "synthetic", "arrival": {"kind": "poisson", "rate_per_s": 4},
                         "prompt": {"kind": "fixed", "tokens": 500}, "output": {"kind": "fixed", "tokens": 20},
                         "n_requests": 4}}


@pytest.mark.parametrize("decode,msg", [
    ({"expert_load": {"dist": "zipf"}}, r"decode\.expert_load\.dist"),
    ({"expert_load": {"dist": "power_law", "alpha": -1}}, r"decode\.expert_load\.alpha"),
    ({"expert_load": {"dist": "power_law", "samples": -1}}, r"decode\.expert_load\.samples"),
    ({"eplb": {"rebalance_steps": 0}}, r"decode\.eplb\.rebalance_steps"),
    ({"expert_load": {"dist": "power_law", "bogus": 1}}, r"decode\.expert_load\.bogus"),
])
def test_scenario_field_errors(decode, msg):
    with pytest.raises(UserError, match=msg) as e:
        parse_scenario(_scenario(**decode))
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("decode,msg", [
    ({"eplb": {"enabled": True}}, r"^decode\.eplb: with uniform routing every placement is balanced"),
    ({"expert_load": {"dist": "uniform", "alpha": 1.0}}, r"^decode\.expert_load: alpha / weights / file need"),
    ({"expert_load": {"dist": "power_law", "weights": [1, 2]}}, r"^decode\.expert_load\.weights: only with"),
    ({"expert_load": {"dist": "histogram"}}, r"^decode\.expert_load: dist histogram needs exactly one of"),
    ({"expert_load": {"dist": "histogram", "weights": [1, 2, 3]}},
     r"^decode\.expert_load\.weights: 3 weights for the 256 experts of deepseek-v3$"),
    ({"expert_load": {"dist": "histogram", "weights": [0] * 256}}, r"^decode\.expert_load\.weights: all zero"),
    ({"expert_load": {"dist": "histogram", "alpha": 1, "weights": [1] * 256}},
     r"^decode\.expert_load\.alpha: only with dist: power_law$"),
    ({"expert_load": {"dist": "histogram", "file": "/nonexistent/h.txt"}},
     r"^decode\.expert_load\.file: cannot read /nonexistent/h\.txt"),
])
def test_scenario_rules_that_need_the_model(decode, msg):
    sc = parse_scenario(_scenario(**decode))
    with pytest.raises(UserError, match=msg) as e:
        expert_load_kw(sc, DSV3)
    assert "\n" not in str(e.value)


def test_scenario_fields_reach_the_step(tmp_path):
    """Absent fields: no keywords (today's step) and the old sweep point key; a power law with its family default;
    a histogram file relative to the scenario file, one row per line."""
    from rackbed.sim.sweep import point_key, scenario_dict

    plain = parse_scenario(_scenario())
    assert expert_load_kw(plain, DSV3) == {}
    d = scenario_dict(plain)
    d["decode"] = {k: v for k, v in d["decode"].items() if k not in ("expert_load", "eplb")}
    assert point_key(scenario_dict(plain)) == point_key(d)
    kw = expert_load_kw(parse_scenario(_scenario(expert_load={"dist": "power_law"}, eplb={})), DSV3)
    assert kw["expert_load"].spec.alpha == 1.0 and kw["expert_load"].eplb == EplbSpec(True, 1000)
    assert expert_load_kw(parse_scenario(_scenario(expert_load={"dist": "power_law"})),
                          Q235)["expert_load"].spec.alpha == 1.2
    (tmp_path / "h.txt").write_text("\n".join(str(i % 7 + 1) for i in range(256)) + "\n")
    sc = parse_scenario(_scenario(expert_load={"dist": "histogram", "file": "h.txt"}), tmp_path / "sc.yaml")
    spec = expert_load_kw(sc, DSV3)["expert_load"].spec
    assert spec.weights == (tuple(float(i % 7 + 1) for i in range(256)),)


def test_read_histogram_forms(tmp_path):
    p = tmp_path / "h.json"
    p.write_text("[[1, 2], [3, 4]]")
    assert read_histogram(p) == ((1.0, 2.0), (3.0, 4.0))
    p.write_text("1, 2, 3\n")
    assert read_histogram(p) == ((1.0, 2.0, 3.0),)
    p.write_text("one two")
    with pytest.raises(UserError, match="neither JSON nor rows of numbers"):
        read_histogram(p)

@pytest.mark.slow

def test_shipped_eplb_figure(tmp_path):
    """``rackbed run fig_dsv3_decode_eplb`` (the table of docs/MODELS.md): the power law slows the step, static
    copies barely help, EPLB's placement brings it within 2 % of uniform routing over the same slots."""
    from rackbed import scenarios
    from rackbed.sim.figures import decode_step_rows, load_figure

    rows = {(r["config"], r["batch_per_rank"]): r for r in
            decode_step_rows(load_figure(scenarios.resolve("fig_dsv3_decode_eplb")))}
    for b in (16, 64):
        uni, uni32 = rows["EP32 uniform", b]["step_ms"], rows["EP32 +32 uniform", b]["step_ms"]
        skew, static = rows["EP32 power law", b]["step_ms"], rows["EP32 +32 static, power law", b]["step_ms"]
        eplb = rows["EP32 +32 EPLB, power law", b]["step_ms"]
        assert skew > 1.1 * uni and static > 1.1 * uni32
        assert uni32 <= eplb < 1.02 * uni32

@pytest.mark.slow

def test_simulation_prices_the_busiest_rank():
    """A whole (small) simulated run: the fields reach the simulated decode steps — a power-law run decodes slower
    than the uniform one, EPLB changes the run with the same 32 redundant slots — and a uniform ``expert_load``
    is the run without the fields, exactly. (At this light load, a few sequences per GPU, a step streams the
    activated experts' weights and replicas activate more slots on the busiest rank: EPLB pays at large batches,
    ``test_redundant_slots_with_eplb_buy_back_the_busiest_rank``.)"""
    from rackbed.sim.scenario import simulate_scenario

    def tpot(**decode):
        _, res = simulate_scenario(parse_scenario(_scenario(**decode)))
        assert res.metrics["requests"]["done"] == 4
        return res.metrics["latency_s"]["tpot"]["p50"]

    uni = tpot()
    assert tpot(expert_load={"dist": "uniform"}) == uni
    pl = {"dist": "power_law", "samples": 4}
    assert tpot(expert_load=pl) > uni
    assert tpot(redundant_experts=32, expert_load=pl, eplb={}) != tpot(redundant_experts=32, expert_load=pl)

@pytest.mark.slow

def test_search_knob_adds_redundant_slots_priced_at_the_busiest_rank():
    """``space.decode_extra_slots_per_rank: [0, 1]`` searches EP32 with 0 and 32 more slots; with the spec's
    power-law load and EPLB the extra slots lower the TPOT at the batch cap, and the option's step is the cost
    model's own (the breakdown carries ``eplb_rebalance``). (At EP8 they would not: 16 experts per GPU all stream
    their weights at this batch whatever the skew, and a 17th slot adds one more.)"""
    from rackbed import topology
    from rackbed.sim import search as se

    spec = se.parse_search({
        "name": "t", "model": "qwen3-235b-a22b",
        "workload": {"kind": "synthetic", "arrival": {"kind": "constant", "rate_per_s": 10},
                     "prompt": {"kind": "fixed", "tokens": 2000}, "output": {"kind": "fixed", "tokens": 100},
                     "duration_s": 10},
        "slo": {"ttft_s": 2.0, "tpot_s": 0.5},
        "space": {"topology": ["gb200-nvl72"], "weight_format": ["mxfp8"], "prefill_tp": [4], "decode_ep": [32],
                  "max_batch_per_rank": [64], "draft_k": [0], "decode_extra_slots_per_rank": [0, 1]},
        "scenario": {"calibration": "none",
                     "decode": {"expert_load": {"dist": "power_law", "samples": 4}, "eplb": {}}}}, "t.yaml")
    opts = {o.redundant_experts: o for o in se.decode_options(spec, se.workload_load(spec.workload), Q235,
                                                              {"gb200-nvl72": topology.load("gb200-nvl72")})}
    assert sorted(opts) == [0, 32] and all(o.pruned is None for o in opts.values())
    assert opts[32].tpot_at_cap_s < 0.9 * opts[0].tpot_at_cap_s
    assert "eplb_rebalance" in opts[32].breakdown_at_cap.terms
    with pytest.raises(UserError, match="decode_extra_slots_per_rank"):
        se.parse_search({**spec.model_dump(mode="json"), "space": {"decode_extra_slots_per_rank": [-1]}}, "t.yaml")


def test_per_layer_histogram_prices_the_mtp_pass_too(nvl72):
    """A recorded histogram with one row per MoE layer: the main layers use their rows, the MTP module's MoE the
    first row; a hotter recording costs more."""
    n_moe = DSV3.n_moe_layers
    flat = ExpertLoadSpec("histogram", weights=tuple((1.0,) * 256 for _ in range(n_moe)), samples=0)
    hot = ExpertLoadSpec("histogram", weights=tuple(((20.0,) + (1.0,) * 255) for _ in range(n_moe)), samples=0)
    args = (DSV3, _plan(32), nvl72, [32] * 32, [32 * 2000.0] * 32)
    a = decode_step_breakdown(*args, draft_k=1, expert_load=ExpertLoad(flat))
    b = decode_step_breakdown(*args, draft_k=1, expert_load=ExpertLoad(hot))
    assert b.terms["moe_dispatch"][1] > a.terms["moe_dispatch"][1]
    assert b.terms["mtp_moe_dispatch"][1] > a.terms["mtp_moe_dispatch"][1]
    assert b.total_s > a.total_s
