"""What drafts the speculative tokens (``mtp.draft``) and how they are accepted (``mtp.acceptance``).

* ``mtp.draft_k`` defaults to 1 for a model with MTP layers and to 0 for one without (Qwen3-235B); drafting with
  such a model needs the draft stated (``tests/test_scenario_cli.py`` checks the one-line errors).
* An MTP draft of ``N`` layers prices ``draft_k * N`` MTP module passes; the explicit one-layer draft of the
  shipped Qwen3-235B scenarios prices exactly what the implicit one did.
* A draft model is priced as one decode step of that model per draft token on the decoder's plan, shrinks the
  decoders' KV capacity by its weights and KV, and is emitted as a standalone draft.
* An acceptance curve reaches the scheduler's stream; the sweep point key of a scenario with the one-layer MTP
  draft is the key it had before drafts were stated.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rackbed import topology
from rackbed.engine.core.model import get_model
from rackbed.engine.core.specdec import AcceptanceStream
from rackbed.sim.costs.step import decode_step_breakdown
from rackbed.sim.scenario import build, draft_cost_kw, parse_scenario

MTP1 = {"kind": "mtp", "layers": 1}


def _data(model: str = "qwen3-235b-a22b", mtp: dict | None = None) -> dict:
    d = {"kind": "serving", "topology": "hgx-h200*2", "model": model, "weight_format": "fp8_block",
         "prefill": {"tp": 4, "ep": 4, "replicas": 1}, "decode": {"ep": 8, "replicas": 1, "max_batch_per_rank": 32},
         "workload": {"kind": "synthetic", "arrival": {"kind": "poisson", "rate_per_s": 4},
                      "prompt": {"kind": "fixed", "tokens": 500}, "output": {"kind": "fixed", "tokens": 20},
                      "n_requests": 4}}
    if mtp is not None:
        d["mtp"] = mtp
    return d


def test_draft_k_defaults_to_the_models_mtp_layers():
    assert parse_scenario(_data()).mtp.draft_k == 0                       # no MTP layers: no speculative decoding
    assert parse_scenario(_data("qwen3.5-122b-a10b")).mtp.draft_k == 1     # its own MTP layer
    sc = parse_scenario(_data(mtp={"draft_k": 2, "draft": MTP1}))
    assert (sc.mtp.draft_k, draft_cost_kw(sc)) == (2, {"n_mtp_layers": 1})
    assert draft_cost_kw(parse_scenario(_data("qwen3.5-122b-a10b"))) == {}  # the model's own layer(s)


@pytest.fixture(scope="module")
def h200():
    return topology.load("hgx-h200")


@settings(max_examples=8, deadline=None, derandomize=True)
@given(st.integers(1, 3), st.integers(1, 3), st.sampled_from([1, 8, 32]))
def test_mtp_draft_terms_scale_with_layers(layers, k, b):
    """``N`` MTP layers: every MTP term but the draft lm_head (one per draft token) is ``N`` times one layer's."""
    from rackbed.sim.parallel import decode_plan_for

    topo = topology.load("hgx-h200")
    sc = parse_scenario(_data(mtp={"draft_k": k, "draft": MTP1}))
    model = get_model(sc.model)
    plan = decode_plan_for(sc, model, tuple(range(8)))
    one = decode_step_breakdown(model, plan, topo, [b] * 8, [b * 900.0] * 8, draft_k=k, n_mtp_layers=1)
    many = decode_step_breakdown(model, plan, topo, [b] * 8, [b * 900.0] * 8, draft_k=k, n_mtp_layers=layers)
    for name, (_, s) in one.terms.items():
        want = s if (not name.startswith("mtp_") or name == "mtp_lm_head") else layers * s
        assert many.terms[name][1] == pytest.approx(want, rel=1e-12), name


def test_explicit_one_layer_draft_prices_what_the_implicit_one_did(h200):
    """The shipped Qwen3-235B scenarios now say ``draft: {kind: mtp, layers: 1}``: the cost model's step is the
    pure cost function's default (``n_mtp_layers`` = the model's own, at least one)."""
    b = build(parse_scenario(_data(mtp={"draft_k": 1, "draft": MTP1})), engine_calibration=False)
    g = b.deployment.decoders[0]
    pl = b.decode_plan
    assert b.cost_model.draft == {"n_mtp_layers": 1}
    for batch, ctx in ((1, 600.0), (32, 32 * 2000.0)):
        implicit = decode_step_breakdown(b.model, pl, b.topology, [batch] * pl.dp, [ctx] * pl.dp, draft_k=1,
                                         calib=b.calibration)
        explicit = decode_step_breakdown(b.model, pl, b.topology, [batch] * pl.dp, [ctx] * pl.dp, draft_k=1,
                                         calib=b.calibration, **b.cost_model.draft)
        assert explicit.terms == implicit.terms and "mtp_attn" in explicit.terms
        got = b.cost_model.decode_point(g, batch, ctx, 1)[0]
        assert got.total_s == pytest.approx(explicit.total_s, rel=0.02)  # at the memo bucket's middle


def test_draft_model_priced_as_its_decode_steps_and_kv(h200):
    k = 2
    target = build(parse_scenario(_data(mtp={"draft_k": k, "draft": MTP1})), engine_calibration=False)
    sc = parse_scenario(_data(mtp={"draft_k": k, "draft": {"kind": "model", "model": "qwen3-30b-a3b"}}))
    b = build(sc, engine_calibration=False)
    pl, dm = b.decode_plan, get_model("qwen3-30b-a3b")
    rb, rc = [16] * pl.dp, [16 * 1500.0] * pl.dp
    bd = decode_step_breakdown(b.model, pl, b.topology, rb, rc, draft_k=k, draft_model=dm, calib=b.calibration)
    alone = decode_step_breakdown(dm, pl, b.topology, rb, rc, calib=b.calibration)
    drafts = {n: s for n, (_, s) in bd.terms.items() if n.startswith("draft_")}
    assert drafts and not any(n.startswith("mtp_") for n in bd.terms)
    assert sum(drafts.values()) == pytest.approx(k * (alone.total_s - alone.terms["host"][1]))
    assert b.cost_model.decode_point(b.deployment.decoders[0], 16, 16 * 1500.0, k)[0].total_s == pytest.approx(
        bd.total_s, rel=0.02)
    # the draft's weights and KV come out of the decoders' KV space
    assert b.decode_budget.kv_capacity_tokens < target.decode_budget.kv_capacity_tokens
    assert b.deployment.decoders[0].template.kv_capacity_tokens_per_rank == b.decode_budget.kv_capacity_tokens


def test_draft_model_emitted_as_standalone_draft():
    from rackbed.sim.emit import plan_of, sglang_args, sglang_speculative_algorithm, trtllm_options, unmapped

    sc = parse_scenario(_data(mtp={"draft_k": 2, "draft": {"kind": "model", "model": "qwen3-30b-a3b"}}))
    pl = plan_of(sc)
    a = sglang_args(pl, pl.decode[0])
    assert a[a.index("--speculative-algorithm") + 1] == "STANDALONE"
    assert a[a.index("--speculative-draft-model-path") + 1] == "${DRAFT_MODEL_PATH}"
    spec = trtllm_options(pl, "decode")["speculative_config"]
    assert spec["decoding_type"] == "Draft_Target" and spec["max_draft_len"] == 2
    assert any("draft model qwen3-30b-a3b" in n for n in unmapped(sc, "sglang", pl))
    head = plan_of(parse_scenario(_data(mtp={"draft_k": 1, "draft": MTP1})))
    own = plan_of(parse_scenario({**_data("qwen3.5-122b-a10b"), "decode": {"ep": 8, "max_batch_per_rank": 8}}))
    assert (sglang_speculative_algorithm(head), sglang_speculative_algorithm(own)) == ("EAGLE", "NEXTN")
    assert "--speculative-draft-model-path" not in sglang_args(own, own.decode[0])


def test_acceptance_curve_reaches_the_scheduler():
    sc = parse_scenario(_data(mtp={"draft_k": 2, "acceptance": [1.0, 0.0, 0.3], "draft": MTP1}))
    assert sc.mtp.expected_tokens_per_step() == 2.0
    b = build(sc, engine_calibration=False)
    assert b.deployment.mtp.acceptance == (1.0, 0.0, 0.3)
    from rackbed.engine.core.scheduler import Scheduler

    s = Scheduler(b.deployment, np.random.default_rng(0))
    assert s.acceptance.fixed == 2 and s.acceptance.take(9)[0] == 5  # two tokens every step, nothing drawn
    a = AcceptanceStream(np.random.default_rng(0), 2, 0.8, acceptance=(0.9, 0.5))
    assert a.fixed == 0 and a.surv is not None


def test_point_key_of_the_one_layer_draft_is_the_old_key():
    from rackbed.sim.sweep import point_key, scenario_dict

    with_draft = scenario_dict(parse_scenario(_data(mtp={"draft_k": 1, "draft": MTP1})))
    before = {**with_draft, "mtp": {"draft_k": 1, "accept_p": 0.8}}  # the dump before drafts were stated
    assert point_key(with_draft) == point_key(before)
    other = scenario_dict(parse_scenario(_data(mtp={"draft_k": 1, "draft": {"kind": "mtp", "layers": 2}})))
    assert point_key(other) != point_key(before)


def test_simulated_tokens_per_step_follow_the_curve():
    """A short run with a draft model and a curve: the decode steps emit what the curve's formula says per sequence
    step (less a little: a sequence's last step emits only what it still needs), and the metrics say which curve."""
    from rackbed.sim.scenario import simulate_scenario

    data = _data(mtp={"draft_k": 3, "acceptance": [0.75, 0.6, 0.5], "draft": {"kind": "model",
                                                                              "model": "qwen3-30b-a3b"}})
    data["workload"].update(n_requests=30, output={"kind": "fixed", "tokens": 300})
    sc = parse_scenario(data)
    _, res = simulate_scenario(sc)
    d = res.metrics["decode"]
    assert d["acceptance"] == [0.75, 0.6, 0.5] and d["draft_k"] == 3
    e = sc.mtp.expected_tokens_per_step()
    assert e == pytest.approx(1 + 0.75 + 0.75 * 0.6 + 0.75 * 0.6 * 0.5)
    assert 0.95 * e < d["tokens_per_sequence_step"] < e * 1.01
