"""Mixed pools in the budget search: on a topology of two GPU models (``A+B``) ``rackbed search --gpus N``
tries prefill on one model and decode on the other (either way round) beside single-model pools, each role
priced on its own GPUs, and ranks them by output tokens/s per $ per hour at the stated price of each model."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rackbed.sim import budget as bu
from rackbed.sim import search as se
from rackbed.topology.errors import UserError

TOPO = "hgx-h200+gb200-nvl72@8"  # 8 H200 (GPUs 0-7) and 8 GB200 of an NVL72 (8-15), one InfiniBand fabric
H200, GB200 = "H200-SXM", "B200-GB200"


def _spec(tpot_s: float, prices: dict, **space):
    """Qwen3-30B, prefill-heavy requests (8000 prompt / 100 output tokens), both GPUs priced by one stack's
    measured tables (TensorRT-LLM's), so that the models differ by their GPUs only."""
    spec = se.spec_from_flags(model="qwen3-30b-a3b", topology=[TOPO], weight_format=["fp8"], rate_per_s=1.0,
                              prompt_tokens=8000, output_tokens=100, duration_s=5, ttft_s=2.0, tpot_s=tpot_s,
                              gpu_hour_usd=prices, prefill_tp=space.get("prefill_tp", [1]),
                              decode_ep=space.get("decode_ep", [1, 4]),
                              max_batch_per_rank=space.get("caps", [8, 16]), draft_k=[0], decode_overlap=None,
                              decode_tp=None, kv_dtype=None, objective="gpu", max_simulations=4, top=5,
                              mtp_layers=None, trace=None, prefix_cache=None, max_gpus=None)
    return spec.model_copy(update={"scenario": {"stack": "trtllm"}})


def _pool(c) -> tuple[str, str]:
    ov = c.overrides if hasattr(c, "overrides") else c["overrides"]
    return ov["prefill.gpu"], ov["decode.gpu"]


def test_the_search_picks_h200_prefill_and_gb200_decode_where_only_gb200_decodes_fast_enough(tmp_path):
    """TPOT 8.5 ms: no H200 decoder meets it (batch 8 is 8.8 ms on H200's tables), a GB200 one does; the H200s
    prefill at a sixth of the GB200's price. H200 prefill + GB200 decode is the best tokens/s per $ per hour,
    well ahead of GB200 alone, and the simulation confirms it."""
    prices = {"H200": 1.0, "GB200": 6.0}
    res = bu.run_budget_search(_spec(0.0085, prices), 16, tmp_path, per_front=1, max_simulations=4)
    alive = [c for c in res.candidates if c.pruned is None]
    # H200 decoders miss the TPOT at their smallest cap (pruned as options); GB200 prefill and decode remain
    assert {_pool(c) for c in alive} == {(H200, GB200), (GB200, GB200)}
    assert any(c.label == "decode option" and "TPOT at batch 8/rank" in c.pruned for c in res.candidates)
    for c in alive:  # each candidate's cost: its GPUs of each model at that model's price
        assert c.usd_per_hour == pytest.approx(sum(n * {H200: 1.0, GB200: 6.0}[k] for k, n in
                                                    c.gpus_by_kind.items()))
        assert all(c.gpus_by_kind[k] <= 8 for k in c.gpus_by_kind)
    best_mixed = max((c for c in alive if _pool(c) == (H200, GB200)), key=lambda c: c.value)
    best_gb200 = max((c for c in alive if _pool(c) == (GB200, GB200)), key=lambda c: c.value)
    assert best_mixed.value > 1.3 * best_gb200.value
    assert res.best is not None
    scen = res.scenarios[res.best["key"]]  # what was simulated: each role placed on its model
    assert (scen["prefill"]["gpu"], scen["decode"]["gpu"]) == (H200, GB200)
    s = res.best["summary"]
    assert "on H200-SXM" in res.best["candidate"].split("+")[0] and "on B200-GB200" in res.best["candidate"]
    assert s["tokens_per_s_per_usd_hour"] == pytest.approx(s["tokens_per_s_per_gpu"] * res.best["gpus"]
                                                           / res.best["usd_per_hour"])
    assert s["tpot_p90_s"] <= 0.0085 and s["ttft_p90_s"] <= 2.0
    assert bu.summary(res)["gpu_hour_usd"] == {H200: 1.0, GB200: 6.0}


def test_a_single_model_pool_wins_where_mixing_cannot(tmp_path):
    """H200 dearer than GB200 ($12 vs $6 an hour) and slower at both roles on the same stack: every pool with
    an H200 in it gives fewer tokens/s per $ per hour, all four pools are candidates, and the search picks
    GB200 alone."""
    res = bu.run_budget_search(_spec(0.05, {"H200": 12.0, "GB200": 6.0}), 16, tmp_path, per_front=1,
                               max_simulations=3)
    best: dict = {}
    for c in (c for c in res.candidates if c.pruned is None):
        best[_pool(c)] = max(best.get(_pool(c), 0.0), c.value)
    assert set(best) == {(H200, H200), (H200, GB200), (GB200, H200), (GB200, GB200)}
    assert best[(GB200, GB200)] > max(v for k, v in best.items() if k != (GB200, GB200))
    assert res.best is not None
    scen = res.scenarios[res.best["key"]]
    assert (scen["prefill"]["gpu"], scen["decode"]["gpu"]) == (GB200, GB200)
    assert res.best["gpus_by_kind"] == {GB200: res.best["gpus"]}


def test_one_model_topologies_keep_their_candidates():
    """On a topology of one GPU model nothing names a GPU: no ``prefill.gpu`` / ``decode.gpu`` override, no
    price, labels as before, and the value ranked is tokens/s per GPU."""
    spec = _spec(0.05, 0.0)
    spec = spec.model_copy(update={"space": spec.space.model_copy(update={"topology": ("hgx-h200",)})})
    from rackbed import topology
    from rackbed.sim.scenario import parse_scenario, scenario_model

    topo = topology.load("hgx-h200")
    model = scenario_model(parse_scenario(se.base_scenario(spec)))
    cands = bu.disaggregated_candidates(spec, bu.estimate_load(spec), model, topo, 8)
    alive = [c for c in cands if c.pruned is None]
    assert alive and all(" on " not in c.label and "prefill.gpu" not in c.overrides and c.usd_per_hour is None
                         and c.value == c.est_tokens_per_s_per_gpu for c in alive)


@pytest.mark.parametrize("given, msg", [
    (None, "give each its price per GPU-hour: --gpu-hour-usd H200-SXM=USD,B200-GB200=USD"),
    ({"H200": 3.0}, "no price for B200-GB200"),
    ({"H200": 3.0, "GB200": 6.0, "B300": 1.0}, "'B300' names no GPU model"),
    ({"200": 3.0}, "'200' names several GPU models"),
    ({"H200": 0.0, "GB200": 6.0}, "a price must be above 0"),
    ({"H200": 3.0, "h200-sxm": 6.0, "GB200": 6.0}, "H200-SXM is priced twice"),
])
def test_prices_must_name_each_model_once(given, msg):
    with pytest.raises(UserError, match=msg.replace("(", r"\(").replace("+", r"\+")):
        bu.kind_prices(given, [H200, GB200])


@pytest.mark.parametrize("argv, msg", [
    (["--gpus", "16", "--topology", TOPO], "--gpu-hour-usd: the topology has several GPU models"),
    (["--gpus", "16", "--topology", TOPO, "--gpu-hour-usd", "H200=3"], "no price for B200-GB200"),
    (["--gpus", "8", "--topology", "hgx-h200", "--gpu-hour-usd", "3"],
     "only on a topology of several GPU models"),
    (["--rate", "3", "--gpu-hour-usd", "H200=3,GB200=6"], "prices per GPU model only with --gpus N"),
])
def test_price_flags_are_one_line_errors(argv, msg, capsys, tmp_path):
    from rackbed.engine.cli.main import main

    assert main(["search", *argv, "--no-progress", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and msg in err, err
    assert not (tmp_path / "o").exists()  # refused before any work


@settings(max_examples=80, deadline=None)
@given(st.dictionaries(st.sampled_from("ABC"), st.integers(0, 80), min_size=1),
       st.dictionaries(st.sampled_from("ABC"), st.integers(1, 80), min_size=3, max_size=3),
       st.integers(1, 200))
def test_copies_never_exceed_any_models_gpus(used, room, budget):
    """The copies of a mixed-pool deployment fit every GPU model's count and the budget (or are the one
    copy), and one more copy would not."""
    n = sum(used.values())
    c = bu.BudgetCandidate("disaggregated", "x", {}, n, budget=budget, gpus_by_kind=used, room=room)
    r = c.replicas
    assert r >= 1
    if r > 1:
        assert r * n <= budget and all(r * u <= room[k] for k, u in used.items())
    if n:  # and one more copy would not fit
        assert (r + 1) * n > budget or any((r + 1) * u > room[k] for k, u in used.items())
