"""Compute / communication overlap (``sim.costs.overlap``): the two-stream schedule's bounds and identity, a
hand-computed schedule, the step with ``shared_expert`` / ``two_batch`` against the same terms without
overlap, ``none`` unchanged, the micro-batch splits, and the scenario field's one-line errors.

What the properties prove, for any ops, micro-batches and SM share ``s`` (``W`` compute work, ``M``
communication, ``H`` communication that ran under compute, all of the scheduled ops): the critical path is
exactly ``W + M - (1 - s) * H`` with no idle time (every instant some stream works), hence ``max(W, M) <= step
<= W + M``; it is never shorter than one micro-batch's chain either. For a step, ``W + M`` is the same
per-layer terms run one after another: the step without overlap for ``shared_expert``; for ``two_batch`` the
two half-batch steps' per-layer terms (re-priced at half the tokens by the same cost functions) — so
``two_batch`` is bounded by those, not by the whole batch's step, which it can exceed when each micro-batch
streams the weights again.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rackbed.engine.core.model import get_model
from rackbed.engine.core.sharding import ParallelPlan
from rackbed.sim.costs import overlap as ov
from rackbed.sim.costs.overlap import Op, schedule, split_decode, split_prefill
from rackbed.sim.costs.step import decode_step_breakdown, prefill_step_breakdown
from rackbed.topology import load as load_topology
from rackbed.topology.errors import UserError

DSV3 = get_model("deepseek-v3")
Q235 = get_model("qwen3-235b-a22b")
Q35 = get_model("qwen3.5-122b-a10b")  # Gated DeltaNet + full attention layers, a shared expert
EPS = 1e-12


@pytest.fixture(scope="module")
def nvl72():
    return load_topology("gb200-nvl72")


# ------------------------------------------------------------------------------------------------ the
# schedule


def test_hand_computed_two_batch():
    """One layer [c1 = 2 compute, d = 1 comm, c2 = 2 compute] for micro-batches A and B. Share 0: A.c1 0-2,
    A.d 2-3 under B.c1 2-4, B.d 4-5 under A.c2 4-6, B.c2 6-8: 8 = W 8 + M 2 - H 2. Share 0.5: B.c1 runs at
    half speed while A.d is open (2-3: 0.5 done) and ends at 4.5; B.d 4.5-5.5; A.c2 4.5-7 (1 s at half speed);
    B.c2 7-9: 9 = 8 + 2 - 0.5 x 2, contention 0.5 + 0.5."""
    lay = [[Op("c1", 2.0), Op("d", 1.0, comm=True), Op("c2", 2.0)] for _ in range(2)]
    s0 = schedule([lay], 0.0)
    assert s0.makespan_s == 8.0 and s0.hidden == {"d": 2.0} and s0.contention_s == 0.0
    s5 = schedule([lay], 0.5)
    assert s5.makespan_s == pytest.approx(9.0) and s5.hidden == {"d": pytest.approx(2.0)}
    assert s5.contention_s == pytest.approx(1.0)
    assert s5.compute == {"c1": 4.0, "c2": 4.0} and s5.comm == {"d": 2.0}


def test_hand_computed_shared_expert():
    """[router 1, shared 2 (side), dispatch 3 (comm), gemm 1], share 0: router 0-1, dispatch 1-4 with the
    shared expert 1-3 under it, gemm 4-5. Without the side op it is the sum, 7."""
    ops = [Op("router", 1.0), Op("shared", 2.0, side=True), Op("disp", 3.0, comm=True), Op("gemm", 1.0)]
    s = schedule([[ops]], 0.0)
    assert s.makespan_s == 5.0 and s.hidden == {"disp": 2.0}
    serial = [Op("router", 1.0), Op("disp", 3.0, comm=True), Op("gemm", 1.0), Op("shared", 2.0)]
    assert schedule([[serial]], 0.0).makespan_s == 7.0


@st.composite
def _layers(draw):
    n_ops = draw(st.integers(1, 6))
    shape = [(draw(st.booleans()), draw(st.booleans()) and i > 0) for i in range(n_ops)]
    n_mb = draw(st.integers(1, 2))
    n_layers = draw(st.integers(1, 4))
    sec = st.floats(0.0, 5.0, allow_nan=False)
    return [[[Op(f"op{i}", draw(sec), comm=c, side=s) for i, (c, s) in enumerate(shape)] for _ in range(n_mb)]
            for _ in range(n_layers)]


@settings(max_examples=300, deadline=None, derandomize=True)
@given(layers=_layers(), share=st.floats(0.0, 0.9))
def test_schedule_bounds(layers, share):
    s = schedule(layers, share)
    w, m, h = s.work_s, s.comm_s, s.hidden_s
    tol = 1e-9 * (1 + w + m)
    assert max(w, m) - tol <= s.makespan_s <= w + m + tol
    assert s.makespan_s == pytest.approx(w + m - (1 - share) * h, abs=tol)
    assert s.contention_s == pytest.approx(share * h, abs=tol)
    for mb in range(len(layers[0])):  # one micro-batch's chain (side ops aside) is a lower bound
        chain = sum(op.seconds for lay in layers for op in lay[mb] if not op.side)
        assert s.makespan_s >= chain - tol
    assert all(0 <= s.hidden.get(n, 0.0) <= s.comm[n] + tol for n in s.comm)


# ------------------------------------------------------------------------------------------------ a step


def _dplan(ep: int, mode: str, tp: int = 1, fmt: str = "fp8_block") -> ParallelPlan:
    return ParallelPlan(role="decode", tp=tp, ep=ep, dp=ep // tp, gpus=tuple(range(ep)), weight_format=fmt,
                        max_batch_seqs=256, overlap=mode)


def _per_layer(model, bd) -> dict[str, float]:
    names = ov._per_layer_counts(model, bd)
    return {n: s for n, (_, s) in bd.terms.items() if n in names}


def test_none_is_todays_step(nvl72):
    """``overlap: none`` (the default) takes no new code path: the same terms, nothing hidden."""
    for model, ep in ((DSV3, 32), (Q235, 16)):
        default = ParallelPlan(role="decode", ep=ep, dp=ep, gpus=tuple(range(ep)), weight_format="fp8_block",
                               max_batch_seqs=256)
        a = decode_step_breakdown(model, default, nvl72, [48] * ep, [48 * 3000] * ep, draft_k=1)
        b = decode_step_breakdown(model, _dplan(ep, "none"), nvl72, [48] * ep, [48 * 3000] * ep, draft_k=1)
        assert a == b and a.hidden == {} and "overlap_sm_contention" not in a.terms


@settings(max_examples=60, deadline=None, derandomize=True)
@given(b=st.integers(1, 160), k=st.integers(0, 2), ep=st.sampled_from([8, 32]), tp=st.sampled_from([1, 2]),
       model=st.sampled_from([DSV3, Q235, Q35]))
def test_decode_step_bounds(nvl72, b, k, ep, tp, model):
    """``shared_expert``: between the longest stream and the step without overlap, serial terms unchanged,
    every per-layer term's exposed + hidden seconds equal to its seconds without overlap. ``two_batch``: the
    same against the two half-batch steps' per-layer terms (+ the whole batch's serial terms)."""
    n = ep // tp
    batch, ctx = [b] * n, [b * 2500.0] * n
    none = decode_step_breakdown(model, _dplan(ep, "none", tp), nvl72, batch, ctx, draft_k=k)
    share = ov.default_share(nvl72.gpu_spec(0))
    serial = {nm: s for nm, (_, s) in none.terms.items() if nm not in _per_layer(model, none)}

    se = decode_step_breakdown(model, _dplan(ep, "shared_expert", tp), nvl72, batch, ctx, draft_k=k)
    layer = _per_layer(model, none)
    assert se.total_s <= none.total_s * (1 + 1e-12)
    comm = sum(s for nm, s in layer.items() if nm in ov.COMM_TERMS["decode"])
    work = sum(layer.values()) - comm
    assert se.total_s >= sum(serial.values()) + max(work, comm) - 1e-12
    for nm, s in layer.items():
        assert se.terms[nm][1] + se.hidden.get(nm, 0.0) == pytest.approx(s, rel=1e-9, abs=EPS)
    for nm, s in serial.items():
        assert se.terms[nm][1] == s
    if not model.n_shared_experts:  # nothing leaves the chain: the step is the sum
        assert se.total_s == pytest.approx(none.total_s, rel=1e-12) and se.hidden == {}
    contention = se.terms.get("overlap_sm_contention", ("", 0.0))[1]
    assert contention == pytest.approx(share * sum(se.hidden.values()), rel=1e-9, abs=EPS)

    tb = decode_step_breakdown(model, _dplan(ep, "two_batch", tp), nvl72, batch, ctx, draft_k=k)
    halves = [decode_step_breakdown(model, _dplan(ep, "none", tp), nvl72, mb, c, draft_k=k)
              for mb, c in split_decode(batch, ctx)]
    parts: dict[str, float] = {}
    for h in halves:
        for nm, s in _per_layer(model, h).items():
            parts[nm] = parts.get(nm, 0.0) + s
    bound = sum(parts.values()) + sum(serial.values())
    assert tb.total_s <= bound * (1 + 1e-12)
    comm = sum(s for nm, s in parts.items() if nm in ov.COMM_TERMS["decode"])
    assert tb.total_s >= sum(serial.values()) + max(sum(parts.values()) - comm, comm) - 1e-12
    for nm, s in parts.items():
        assert tb.terms[nm][1] + tb.hidden.get(nm, 0.0) == pytest.approx(s, rel=1e-9, abs=EPS)
    assert tb.total_s == pytest.approx(sum(s for _, s in tb.terms.values()), rel=1e-12)


def test_two_batch_hides_the_all_to_all(nvl72):
    """DeepSeek-V3 at EP 32, 128 sequences per rank: the two micro-batches hide most of the dispatch and
    combine, and the step shows it term by term."""
    batch, ctx = [128] * 32, [128 * 2000.0] * 32
    none = decode_step_breakdown(DSV3, _dplan(32, "none"), nvl72, batch, ctx)
    tb = decode_step_breakdown(DSV3, _dplan(32, "two_batch"), nvl72, batch, ctx)
    a2a = none.terms["moe_dispatch"][1] + none.terms["moe_combine"][1]
    hidden = tb.hidden.get("moe_dispatch", 0.0) + tb.hidden.get("moe_combine", 0.0)
    assert hidden > 0.5 * a2a
    assert tb.terms["moe_dispatch"][1] + tb.terms["moe_combine"][1] < 0.5 * a2a
    assert tb.terms["overlap_sm_contention"][1] > 0


def test_overlap_prices_the_busiest_rank(nvl72):
    """Skewed routing reaches the overlapped step: DeepSeek-V3 EP32 under its power law, each mode's per-layer
    terms (exposed + hidden) are the skewed step's own (``shared_expert``: the whole batch; ``two_batch``: the
    two skewed half-batches), so the skewed overlapped step is longer than the uniform one."""
    from rackbed.engine.core.expert_load import ExpertLoadSpec
    from rackbed.sim.costs.eplb import ExpertLoad

    load = ExpertLoad(ExpertLoadSpec("power_law", alpha=1.0, samples=2))
    batch, ctx = [64] * 32, [64 * 2000.0] * 32
    skew = decode_step_breakdown(DSV3, _dplan(32, "none"), nvl72, batch, ctx, expert_load=load)
    for mode in ("shared_expert", "two_batch"):
        uni = decode_step_breakdown(DSV3, _dplan(32, mode), nvl72, batch, ctx)
        ov_skew = decode_step_breakdown(DSV3, _dplan(32, mode), nvl72, batch, ctx, expert_load=load)
        assert ov_skew.total_s > 1.05 * uni.total_s, mode
        parts = [skew] if mode == "shared_expert" else [
            decode_step_breakdown(DSV3, _dplan(32, "none"), nvl72, mb, c, expert_load=load)
            for mb, c in split_decode(batch, ctx)]
        for nm in ("moe_dispatch", "moe_gemm", "moe_combine"):
            want = sum(p.terms[nm][1] for p in parts)
            got = ov_skew.terms[nm][1] + ov_skew.hidden.get(nm, 0.0)
            assert got == pytest.approx(want, rel=1e-9), (mode, nm)


def test_prefill_two_batch(nvl72):
    plan = ParallelPlan(role="prefill", tp=4, ep=4, dp=1, gpus=(0, 1, 2, 3), weight_format="fp8_block")
    seqs = [(8192, 0), (3001, 500)]
    none = prefill_step_breakdown(DSV3, plan, nvl72, seqs)
    tb = prefill_step_breakdown(DSV3, plan.model_copy(update={"overlap": "two_batch"}), nvl72, seqs)
    halves = [prefill_step_breakdown(DSV3, plan, nvl72, part) for part in split_prefill(seqs)]
    layer = sum(sum(_per_layer(DSV3, h).values()) for h in halves)
    serial = sum(s for nm, (_, s) in none.terms.items() if nm not in _per_layer(DSV3, none))
    assert tb.total_s <= (layer + serial) * (1 + 1e-12)
    assert tb.hidden.get("attn_allreduce", 0.0) > 0 and tb.hidden.get("moe_combine_allreduce", 0.0) > 0
    assert tb.terms["lm_head"] == none.terms["lm_head"]  # serial, at the whole batch
    with pytest.raises(UserError, match="two_batch"):
        prefill_step_breakdown(DSV3, plan.model_copy(update={"overlap": "shared_expert"}), nvl72, seqs)


# ------------------------------------------------------------------------------------------------ splits


@settings(max_examples=200, deadline=None, derandomize=True)
@given(seqs=st.lists(st.tuples(st.integers(0, 5000), st.integers(0, 9000)), min_size=1, max_size=8))
def test_split_prefill(seqs):
    a, b = split_prefill(seqs)
    ta, tb = sum(q for q, _ in a), sum(q for q, _ in b)
    assert ta + tb == sum(q for q, _ in seqs) and 0 <= ta - tb <= 1
    # in batch order, the pieces cover every sequence's new tokens once; a second chunk reads the first as
    # cached
    pieces = iter(a + b)
    for q, c in seqs:
        done = 0
        while done < q:
            pq, pc = next(pieces)
            assert pq > 0 and pc == c + done
            done += pq
        assert done == q
    assert next(pieces, None) is None


@settings(max_examples=200, deadline=None, derandomize=True)
@given(batch=st.lists(st.integers(0, 300), min_size=1, max_size=8))
def test_split_decode(batch):
    ctx = [n * 1234.5 for n in batch]
    (a, ca), (b, cb) = split_decode(batch, ctx)
    assert [x + y for x, y in zip(a, b)] == batch and all(0 <= x - y <= 1 for x, y in zip(a, b))
    assert all(abs(x + y - c) <= 1e-6 * (1 + c) for x, y, c in zip(ca, cb, ctx))


# ------------------------------------------------------------------------------------------------ scenario


def _scenario(**sections):
    from rackbed.sim.scenario import parse_scenario

    return parse_scenario({
        "kind": "serving", "topology": "gb200-nvl72", "model": "deepseek-v3", "weight_format": "fp8_block",
        "prefill": {"tp": 4, "ep": 4, "replicas": 1, **sections.get("prefill", {})},
        "decode": {"ep": 32, "replicas": 1, **sections.get("decode", {})},
        "workload": {"kind": "synthetic", "arrival": {"kind": "poisson", "rate_per_s": 4},
                     "prompt": {"kind": "fixed", "tokens": 500}, "output": {"kind": "fixed", "tokens": 20},
                     "n_requests": 4}}, "t.yaml")


def test_scenario_overlap_fields():
    from rackbed.sim.parallel import decode_plan_for, prefill_plan_for

    sc = _scenario(prefill={"overlap": "two_batch"}, decode={"overlap": "shared_expert"})
    assert prefill_plan_for(sc, DSV3, (0, 1, 2, 3)).overlap == "two_batch"
    assert decode_plan_for(sc, DSV3, tuple(range(32))).overlap == "shared_expert"
    assert decode_plan_for(_scenario(), DSV3, tuple(range(32))).overlap == "none"


@pytest.mark.parametrize("sections,msg", [
    ({"decode": {"overlap": "tbo"}}, r"decode\.overlap"),
    ({"prefill": {"overlap": "shared_expert"}}, r"prefill\.overlap: .*use two_batch or none"),
])
def test_scenario_overlap_errors(sections, msg):
    with pytest.raises(UserError, match=msg) as e:
        _scenario(**sections)
    assert "\n" not in str(e.value)


def test_sweep_key_unchanged_by_default():
    """A scenario that does not set ``overlap`` keeps its sweep point key."""
    from rackbed.sim.sweep import point_key, scenario_dict

    d = scenario_dict(_scenario())
    without = {**d, "prefill": {k: v for k, v in d["prefill"].items() if k != "overlap"},
               "decode": {k: v for k, v in d["decode"].items() if k != "overlap"}}
    assert point_key(d) == point_key(without)
    assert point_key(scenario_dict(_scenario(decode={"overlap": "two_batch"}))) != point_key(d)


# ------------------------------------------------------------------------------------------------ search


def test_search_tries_decode_overlap():
    """``space.decode_overlap`` is a knob: one decode option per mode, each priced by the overlapped step, and
    a candidate's scenario overrides carry ``decode.overlap`` only when it is not ``none``."""
    from rackbed import topology
    from rackbed.sim import search as se

    spec = se.parse_search({
        "name": "t", "model": "deepseek-v3",
        "workload": {"kind": "synthetic", "arrival": {"kind": "constant", "rate_per_s": 10},
                     "prompt": {"kind": "fixed", "tokens": 2000}, "output": {"kind": "fixed", "tokens": 100},
                     "duration_s": 10},
        "slo": {"ttft_s": 2.0, "tpot_s": 0.05},
        "space": {"topology": ["gb200-nvl72"], "weight_format": ["fp8_block"], "prefill_tp": [8],
                  "decode_ep": [32], "max_batch_per_rank": [64], "draft_k": [0],
                  "decode_overlap": ["none", "shared_expert", "two_batch"]}}, "t.yaml")
    topos = {"gb200-nvl72": topology.load("gb200-nvl72")}
    load = se.workload_load(spec.workload)
    opts = {o.overlap: o for o in se.decode_options(spec, load, DSV3, topos)}
    assert set(opts) == {"none", "shared_expert", "two_batch"}
    assert all(o.pruned is None for o in opts.values())
    assert opts["shared_expert"].tpot_at_cap_s < opts["none"].tpot_at_cap_s
    assert opts["two_batch"].breakdown_at_cap.hidden.get("moe_dispatch", 0.0) > 0
    assert se._decode_tp_override(1, 0, "none") == {}
    assert se._decode_tp_override(1, 0, "two_batch") == {"decode.overlap": "two_batch"}
    with pytest.raises(UserError, match=r"space\.decode_overlap"):
        se.parse_search({**spec.model_dump(mode="json"), "space": {"decode_overlap": ["tbo"]}}, "t.yaml")


def test_search_cli_overlap_flag(capsys):
    from rackbed.engine.cli.main import main

    assert main(["search", "--rate", "4", "--decode-overlap", "tbo"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("--decode-overlap tbo: one of none, shared_expert, two_batch") and "\n" not in err


# ------------------------------------------------------------------------------------------------ emit


@pytest.mark.parametrize("mode,flag", [("two_batch", "--enable-two-batch-overlap"),
                                       ("shared_expert", "--enable-single-batch-overlap")])
def test_emit_sets_the_overlap_switch(mode, flag):
    """The decoders (DeepEP groups) get SGLang's switch for the priced overlap; TensorRT-LLM's files and a
    TP=EP prefiller priced with two-batch overlap get a ``# no equivalent:`` line instead; ``none`` adds
    nothing."""
    from rackbed.sim.emit import emit_files

    sc = _scenario(prefill={"overlap": "two_batch"}, decode={"overlap": mode})
    files = emit_files(sc, "sglang")["launch.sh"]
    servers = [ln for ln in files.splitlines() if "sglang.launch_server" in ln]
    decode = [ln for ln in servers if "--disaggregation-mode decode" in ln]
    prefill = [ln for ln in servers if "--disaggregation-mode prefill" in ln]
    assert decode and all(flag in ln for ln in decode)
    assert prefill and not any("batch-overlap" in ln for ln in prefill)
    assert "# no equivalent: prefill.overlap two_batch: SGLang overlaps only an all-to-all" in files
    trt = emit_files(sc, "trtllm")["gen.yaml"]
    assert f"decode.overlap {mode}: the LLM API options here set no" in trt
    plain = emit_files(_scenario(), "sglang")["launch.sh"]
    assert "batch-overlap" not in plain and ".overlap" not in plain


def test_where_time_goes_names_the_hidden_seconds(nvl72):
    from rackbed.sim.search_results import _bd_dict, where_time_goes

    batch, ctx = [64] * 32, [64 * 2000.0] * 32
    tb = _bd_dict(decode_step_breakdown(DSV3, _dplan(32, "two_batch"), nvl72, batch, ctx), "x")
    none = _bd_dict(decode_step_breakdown(DSV3, _dplan(32, "none"), nvl72, batch, ctx), "x")
    assert "hidden" not in none and "hidden by overlap" not in where_time_goes(none)
    hid = sum(tb["hidden"].values())
    assert where_time_goes(tb).endswith(f"; {hid * 1e3:.2f} ms hidden by overlap")


def test_real_mode_refuses_overlap():
    from rackbed.engine.real.rank_setup import real_model_config
    from rackbed.sim.scenario import build

    with pytest.raises(UserError, match=r"^decode\.overlap: real mode runs its steps without .* \(set "
                                        r"decode\.overlap: none\)$"):
        real_model_config(build(_scenario(decode={"overlap": "two_batch"})))
