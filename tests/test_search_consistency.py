"""The search's analytic figures are the simulation's: at low load (requests never overlap, so nothing queues) the
TTFT and TPOT the analytic stage estimates for a candidate are within 10 % of the simulated p50.

TTFT is the first prefill's completion minus the arrival (``engine.core.metrics``), so without queueing it is the
prompt's prefill step alone (its chunks one after another with chunked prefill); TPOT is ``(end - first token) / (output - 1)``, which holds the KV transfer and the
decode steps (each ``1 + accepted`` tokens). Both sides price steps with one cost model
(``sim.scenario.cost_model_for``: the shipped calibration of the GPU, the engine calibration when one matches the
GPU and the model — ``qwen3-235b-a22b[:16]`` on H200 — and the candidate's plans), so the property holds for every
topology, weight format the GPU runs, prefill TP/EP, decode EP, batch cap and MTP draft length; what separates the
two is the simulation's MTP acceptance draws (outputs of 300+ tokens keep that to a few per cent) and its decode
memo's context buckets (<= 1.6 %).
"""

from __future__ import annotations

import functools
import math

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from rackbed import topology
from rackbed.engine.core.formats import FORMAT_NAMES
from rackbed.engine.core.plans import PrefillBatch
from rackbed.sim import search as se
from rackbed.sim import search_results as sr
from rackbed.sim.engine_calibration import EngineCalibratedCostModel
from rackbed.sim.scenario import ScenarioCostModel, build, parse_scenario, scenario_model, simulate_scenario
from rackbed.sim.sweep import SweepSpec, expand

#: (model, model_layers): the full models, and the truncated one the shipped engine calibration covers on H200
MODELS = (("qwen3-235b-a22b", None), ("qwen3-235b-a22b", 16), ("qwen3.5-122b-a10b", None))
#: decode EP degrees that fit one NVLink domain (8 GPUs of an HGX node; 72 of the NVL72 rack)
DECODE_EP = {"hgx-h200*8": (4, 8), "gb200-nvl72": (4, 8, 16, 32)}
N_REQUESTS = 4
GAP_S = 200.0  # between arrivals: far longer than any request here takes (no two overlap)


@functools.cache
def _topo(name: str):
    return topology.load(name)


def _spec(topo: str, fmt: str, model: str, layers: int | None, tp: int, ep: int, dep: int, cap: int, k: int,
          prompt: int, out: int, seed: int = 0, mbt: int = 16384, chunked: bool = False):
    scenario = {"sim": {"chunked_prefill": chunked}, "mtp": {"draft": {"kind": "mtp", "layers": 1}}}  # Qwen3-235B: a trained MTP head
    if layers is not None:
        scenario["model_layers"] = layers
    return se.parse_search({
        "name": "lowload", "model": model, "seed": seed,
        "workload": {"kind": "synthetic", "arrival": {"kind": "constant", "rate_per_s": 1 / GAP_S},
                     "prompt": {"kind": "fixed", "tokens": prompt}, "output": {"kind": "fixed", "tokens": out},
                     "n_requests": N_REQUESTS},
        "slo": {"ttft_s": 100.0, "tpot_s": 10.0},
        "space": {"topology": [topo], "weight_format": [fmt], "prefill_tp": [tp], "prefill_ep": [ep],
                  "prefill_max_batch_tokens": [mbt], "decode_ep": [dep], "max_batch_per_rank": [cap],
                  "draft_k": [k]},
        "scenario": scenario})


def _analytic(spec):
    """The one candidate of ``spec`` as the search's analytic stage sees it, and its scenario."""
    topos = {t: _topo(t) for t in spec.space.topology}
    model = scenario_model(parse_scenario(se.base_scenario(spec)))
    load = se.workload_load(spec.workload, spec.seed)
    pre = se.prefill_options(spec, load, model, topos)
    dec = se.decode_options(spec, load, model, topos)
    (c,) = se.candidates(spec, load, model, topos, pre, dec)
    (point,) = expand(SweepSpec(name=spec.name, base=se.base_scenario(spec), points=[c.overrides]))
    return c, point.scenario


@pytest.mark.slow
@settings(max_examples=30, derandomize=True, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(data=st.data())
def test_analytic_ttft_and_tpot_are_the_simulated_p50_at_low_load(data):
    tname = data.draw(st.sampled_from(sorted(DECODE_EP)), label="topology")
    topo = _topo(tname)
    gpu = topo.gpu_spec(0)
    node = len(topo.gpus_of_host(topo.host_of(0)))  # a prefiller stays in one node
    fmt = data.draw(st.sampled_from([f for f in FORMAT_NAMES if gpu.dense_tflops.get(f)]), label="format")
    model, layers = data.draw(st.sampled_from(MODELS), label="model")
    tp = data.draw(st.sampled_from([t for t in (1, 2, 4, 8) if t <= node]), label="prefill tp")
    ep = data.draw(st.sampled_from([e for e in (1, 2, 4, 8) if e <= tp]), label="prefill ep")
    dep = data.draw(st.sampled_from(DECODE_EP[tname]), label="decode ep")
    cap = data.draw(st.sampled_from((8, 16, 64)), label="batch cap")
    k = data.draw(st.integers(0, 3), label="draft_k")
    prompt = data.draw(st.integers(200, 8000), label="prompt")
    out = data.draw(st.integers(300, 800), label="output")
    seed = data.draw(st.integers(0, 2**16), label="seed")  # the simulation's MTP acceptance draws
    mbt = data.draw(st.sampled_from((2048, 16384)), label="prefill max_batch_tokens")
    chunked = data.draw(st.booleans(), label="chunked prefill")  # a prompt above the budget: in chunks, or whole
    c, scenario = _analytic(_spec(tname, fmt, model, layers, tp, ep, dep, cap, k, prompt, out, seed, mbt, chunked))
    assume(c.pruned is None)  # e.g. the weights do not fit the group's memory
    assert (c.prefill.replicas, c.decode.replicas) == (1, 1)
    assert math.isfinite(c.kv_transfer_s) and c.kv_transfer_s > 0
    _, res = simulate_scenario(parse_scenario(scenario))
    m = res.metrics
    assert m["requests"]["done"] == N_REQUESTS
    lat = m["latency_s"]
    assert lat["e2e"]["max"] < GAP_S  # no two requests overlapped
    ttft, tpot = lat["ttft"]["p50"], lat["tpot"]["p50"]
    assert abs(c.est_ttft_s / ttft - 1) <= 0.10, (c.label, c.est_ttft_s, ttft)
    assert abs(c.est_tpot_s / tpot - 1) <= 0.10, (c.label, c.est_tpot_s, tpot)
    assert c.est_tokens_per_s_per_user == 1 / c.est_tpot_s


@pytest.mark.parametrize("layers", [None, 16])
def test_the_analytic_stage_prices_with_the_cost_model_the_simulation_builds(layers):
    """H200: the shipped kernel calibration, and for ``qwen3-235b-a22b[:16]`` the engine calibration around it —
    the candidate's figures are what the built scenario's cost model says, breakdowns included."""
    prompt, out, k = 3000, 400, 1
    c, scenario = _analytic(_spec("hgx-h200*8", "fp8", "qwen3-235b-a22b", layers, 8, 8, 8, 32, k, prompt, out))
    assert c.pruned is None
    b = build(parse_scenario(scenario))
    assert b.calibration is not None  # calibration/h200.yaml
    assert isinstance(b.cost_model, EngineCalibratedCostModel if layers else ScenarioCostModel)
    pg, dg = b.deployment.prefillers[0], b.deployment.decoders[0]
    alone = b.cost_model.prefill(PrefillBatch(pg.id, 0, ((0, 0, prompt),), prompt), pg)
    assert c.est_ttft_s == pytest.approx(alone.total_s, rel=1e-12)
    bi = math.ceil(c.decode.b_op - 1e-9)
    step, _ = b.cost_model.decode_point(dg, bi, bi * (prompt + out / 2), k)
    # decode_point prices its context bucket's middle (<= 1.6 % away); an engine calibration ignores the context
    assert c.decode.breakdown.total_s == pytest.approx(step.total_s, rel=1e-12 if layers else 0.02)
    for bd in (c.prefill.breakdown, c.decode.breakdown, c.decode.breakdown_at_cap):
        assert sum(bd.by_category().values()) == pytest.approx(bd.total_s)
    ex = sr.explain(scenario)
    assert ex["decode"]["total_s"] == pytest.approx(
        b.cost_model.decode_breakdown(32, 32 * (prompt + out / 2), k).total_s)
