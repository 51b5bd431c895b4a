"""``rackbed search --gpus N`` (sim.budget): fronts for both deployment kinds on a small budget, every front point
within the budget and meeting the SLOs in its own simulation, the emitted launch settings of the best one, flag
errors naming the flag, the infeasible search's hint, MTP off for models without MTP layers."""

from __future__ import annotations

import json
import shlex

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rackbed.engine.core.model import get_model
from rackbed.sim import budget as bu
from rackbed.sim import search as se
from rackbed.sim.search_results import meets_slo, normalise_reason


def _gpus(ov: dict) -> int:
    if ov.get("deployment") == "aggregated":
        return ov["aggregated.workers"] * ov["aggregated.tp"] * ov["aggregated.dp"]
    return ov["prefill.replicas"] * max(ov["prefill.tp"], ov["prefill.ep"]) + ov["decode.replicas"] * ov["decode.ep"]


@pytest.mark.slow
def test_budget_cli_fronts_fit_meet_slo_and_emit(tmp_path, capsys):
    from rackbed.engine.cli.main import main

    out = tmp_path / "s"
    rc = main(["search", "--model", "qwen3-30b-a3b", "--gpus", "8", "--topology", "hgx-h200", "--format", "fp8",
               "--isl", "1000", "--osl", "40", "--duration", "4", "--ttft", "2", "--tpot", "0.05",
               "--prefill-tp", "2,4", "--decode-ep", "4", "--batch-cap", "16,64", "--per-front", "2",
               "--max-simulations", "6", "--jobs", "1", "--no-progress", "--out", str(out),
               "--emit", "sglang", "--emit-out", str(tmp_path / "emit")])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    assert "has no MTP layers" in printed and "best:" in printed and (out / "pareto.png").stat().st_size > 0
    d = json.loads((out / "budget.json").read_text())
    assert d["fronts"]["disaggregated"] and d["fronts"]["aggregated"]
    assert len(d["simulations"]) <= 6
    for kind, front in d["fronts"].items():
        for p in front:
            assert p["kind"] == kind and p["meets_slo"] and p["gpus"] <= 8 and _gpus(p["overrides"]) <= 8
            assert p["ttft_p90_s"] <= 2 and p["tpot_p90_s"] <= 0.05
    # no MTP searched for a model without MTP layers
    assert all(p["overrides"]["mtp.draft_k"] == 0 for p in d["simulations"])
    # tokens/s per GPU at the sustained rate: every request's 40 output tokens over the arrival window (4 lives of a
    # request at the SLOs, 4 x (2 + 39 x 0.05) = 15.8 s > --duration 4), not the run's length (the drain included);
    # the simulator's own figure kept
    w = d["window_s"]
    assert w == pytest.approx(4 * (2 + 39 * 0.05))
    raw = {r["key"]: r for r in map(json.loads, (out / "results.jsonl").read_text().splitlines())}
    for r in raw.values():
        s = r.get("summary") or {}
        if s.get("done") and s["done"] == s["requests"]:
            g = _gpus(r["overrides"])
            got = bu.sustained(r, g, w)["summary"]
            assert got["tokens_per_s_per_gpu"] == pytest.approx(s["done"] * 40 / (w * g), rel=1e-6)
            assert got["tokens_per_s_per_gpu_with_drain"] == s["tokens_per_s_per_gpu"] <= got["tokens_per_s_per_gpu"]
    for p in d["simulations"]:
        if p["meets_slo"]:
            assert p["tokens_per_s_per_gpu"] >= p["tokens_per_s_per_gpu_with_drain"]
    # the budget used: copies x GPUs within the budget, totals consistent, the best within FILL_TOLERANCE of the most
    # tokens/s per used GPU and no point that close uses more of the budget
    conf = [p for p in d["simulations"] if p["use"] is not None]
    top = max(p["tokens_per_s_per_gpu"] for p in conf)
    for p in conf:
        u = p["use"]
        assert 1 <= u["replicas"] <= 8 // p["gpus"] and u["gpus_used"] == u["replicas"] * p["gpus"] <= 8
        assert u["tokens_per_s"] == pytest.approx(p["tokens_per_s_per_gpu"] * u["gpus_used"])
        assert u["tokens_per_s_per_budget_gpu"] == pytest.approx(u["tokens_per_s"] / 8)
    b = d["best"]
    tol = 1 - bu.FILL_TOLERANCE
    assert b["tokens_per_s_per_gpu"] >= tol * top
    assert all(p["use"]["tokens_per_s_per_budget_gpu"] <= b["use"]["tokens_per_s_per_budget_gpu"] + 1e-9
               for p in conf if p["tokens_per_s_per_gpu"] >= tol * top)
    assert d["best_total"]["use"]["tokens_per_s_per_budget_gpu"] == max(
        p["use"]["tokens_per_s_per_budget_gpu"] for p in conf)
    # the emitted files are the best configuration, whatever its kind, with its copies on the budget
    ov, reps = b["overrides"], b["use"]["replicas"]
    lines = [shlex.split(x)[1:] for x in (tmp_path / "emit" / "launch.sh").read_text().splitlines()
             if x.startswith("CUDA_VISIBLE_DEVICES=") and " python -m sglang.launch_server " in x]  # pinned
    if b["kind"] == "aggregated":
        assert len(lines) == ov["aggregated.workers"] * reps
        assert all("--disaggregation-mode" not in a for a in lines)
        return
    pre = [a for a in lines if a[a.index("--disaggregation-mode") + 1] == "prefill"]
    dec = [a for a in lines if a[a.index("--disaggregation-mode") + 1] == "decode"]
    assert len(pre) == ov["prefill.replicas"] * reps and len(dec) == ov["decode.replicas"] * reps
    for a in pre:
        assert int(a[a.index("--tp-size") + 1]) == max(ov["prefill.tp"], ov["prefill.ep"])
        assert int(a[a.index("--chunked-prefill-size") + 1]) == ov["prefill.max_batch_tokens"]
    for a in dec:
        assert int(a[a.index("--ep-size") + 1]) == ov["decode.ep"]
        assert int(a[a.index("--max-running-requests") + 1]) == ov["decode.max_batch_per_rank"] * ov["decode.ep"]


@pytest.mark.parametrize("argv, flag", [
    (["--format", "fp3", "--gpus", "8"], "--format fp3"),
    (["--rate", "-1"], "--rate -1"),
    (["--gpus", "0"], "--gpus 0"),
    (["--gpus", "12", "--topology", "hgx-h200"], "--gpus 12"),
    (["--gpus", "8", "--tpot", "0"], "--tpot 0"),
    (["--isl", "0", "--rate", "3"], "--isl 0"),
    (["--gpus", "8", "--fill-tolerance", "1.5"], "--fill-tolerance 1.5"),
])
def test_bad_flags_one_line_exit_2(argv, flag, capsys):
    from rackbed.engine.cli.main import main

    assert main(["search", *argv, "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and flag in err and "workload." not in err and "space." not in err


@pytest.mark.parametrize("argv, flag", [
    (["--gpus", "8", "--rate", "5", "--kind", "aggregated"], "--kind:"),
    (["--rate", "5", "--per-front", "2"], "--per-front:"),
    (["--rate", "5", "--fill-tolerance", "0.1"], "--fill-tolerance:"),
    (["--gpus", "8", "--top", "3"], "--top:"),
    (["--gpus", "8", "--gpu-hour-usd", "3"], "--gpu-hour-usd:"),
    (["--gpus", "8", "--ray-address", "auto"], "--ray-address:"),
    (["--max-rate", "agg_h200_node", "--model", "qwen3-30b-a3b"], "--model:"),
    (["--max-rate", "agg_h200_node", "--isl", "100"], "--isl:"),
    (["--max-rate", "agg_h200_node", "--out", "x"], "--out:"),
    (["prefix-cache-search-h200", "--ttft", "1"], "--ttft:"),
    (["prefix-cache-search-h200", "--gpus", "72"], "--gpus:"),
    (["prefix-cache-search-h200", "--rate", "5"], "--rate:"),
    (["prefix-cache-search-h200", "--max-rate", "agg_h200_node"], "search spec prefix-cache-search-h200:"),
])
def test_a_flag_the_search_does_not_read_is_an_error(argv, flag, capsys):
    """Every flag given is used or refused: one line naming it and what applies instead, exit 2, before any work
    (the flags' defaults are None so that a flag given can be told from one left out)."""
    from rackbed.engine.cli.main import main

    assert main(["search", *argv, "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"rackbed: error: {flag}"), err
    assert "only" in err or "not with" in err


def test_rate_search_with_gpus_keeps_deployments_within_them():
    """``--rate R --gpus N``: candidates of at most N GPUs (``max_gpus``), even on a topology with more; the
    others are pruned naming the cap."""
    from rackbed import topology

    spec = se.spec_from_flags(model="qwen3-30b-a3b", topology=["hgx-h200*2"], weight_format=["fp8"], rate_per_s=30,
                              prompt_tokens=2000, output_tokens=50, duration_s=2, ttft_s=2, tpot_s=0.05,
                              prefill_tp=[2, 4], decode_ep=[4, 8], max_batch_per_rank=[64], draft_k=[0])
    model = get_model(spec.model)
    topos = {"hgx-h200*2": topology.load("hgx-h200*2")}
    load = se.workload_load(spec.workload)
    pre = se.prefill_options(spec, load, model, topos)
    dec = se.decode_options(spec, load, model, topos)

    def alive(sp):
        return [c for c in se.candidates(sp, load, model, topos, pre, dec) if c.pruned is None]

    assert max(c.n_gpus for c in alive(spec)) > 8
    capped = spec.model_copy(update={"max_gpus": 8})
    cands = se.candidates(capped, load, model, topos, pre, dec)
    assert alive(capped) and all(c.n_gpus <= 8 for c in alive(capped))
    assert any(c.pruned and c.pruned.endswith("max_gpus is 8") for c in cands)


def test_infeasible_budget_exits_non_zero_with_a_hint(tmp_path, capsys):
    from rackbed.engine.cli.main import main

    rc = main(["search", "--model", "qwen3.5-397b-a17b", "--format", "bf16", "--topology", "hgx-h200", "--gpus",
               "8", "--kind", "disaggregated", "--isl", "1000", "--osl", "40", "--out", str(tmp_path),
               "--no-progress", "--jobs", "1"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1
    assert "no deployment of qwen3.5-397b-a17b on 8 GPUs" in err and "try more --gpus" in err
    assert not (tmp_path / "results.jsonl").exists()  # nothing simulated


def test_mtp_only_when_the_model_has_it_or_asked():
    def spec(**kw):
        return se.spec_from_flags(model=kw.pop("model", "qwen3-30b-a3b"), topology=["hgx-h200"],
                                  weight_format=["fp8"], rate_per_s=1, prompt_tokens=100, output_tokens=10,
                                  duration_s=2, ttft_s=1, tpot_s=0.1, **kw)

    s, note = se.without_unasked_mtp(spec(), get_model("qwen3-30b-a3b"))
    assert s.space.draft_k == (0,) and "no MTP layers" in note
    s, note = se.without_unasked_mtp(spec(draft_k=[0, 2]), get_model("qwen3-30b-a3b"))
    assert s.space.draft_k == (0, 2) and note is None  # asked explicitly
    s, note = se.without_unasked_mtp(spec(model="qwen3.5-122b-a10b"), get_model("qwen3.5-122b-a10b"))
    assert s.space.draft_k == (0, 1, 2) and note is None


def test_prune_reasons_keep_names_with_digits():
    assert normalise_reason("needs 80 GPUs (20 x 2 + 10 x 4); hgx-h200 has 8") == \
        "needs N GPUs (N x N + N x N); hgx-h200 has N"
    assert normalise_reason("unknown format 'fp3' at p90, TP4/EP4: 31.9 ms") == \
        "unknown format 'fp3' at p90, TP4/EP4: N ms"


def test_budget_topology_and_spread():
    assert bu.budget_topology("hgx-h200*8", 64) == "hgx-h200*8"
    assert bu.budget_topology("gb200-nvl72", 16) == "gb200-nvl72@16"
    assert bu.budget_topology("hgx-h200", 16) == "hgx-h200*2"
    front = [bu.BudgetCandidate("aggregated", str(i), {}, 1) for i in range(7)]
    assert [c.label for c in bu.spread(front, 3)] == ["0", "3", "6"]
    assert bu.spread(front[:2], 3) == front[:2]


def test_rate_search_with_headroom_fits_the_topology():
    """The prefill headroom is a margin: a deployment it would push past the topology keeps the prefillers that
    fit, as long as they carry the load itself."""
    spec = se.spec_from_flags(model="qwen3-30b-a3b", topology=["hgx-h200"], weight_format=["fp8"], rate_per_s=30,
                              prompt_tokens=4000, output_tokens=50, duration_s=2, ttft_s=2, tpot_s=0.05,
                              prefill_tp=[2], decode_ep=[4], max_batch_per_rank=[64], draft_k=[0])
    model = get_model(spec.model)
    from rackbed import topology

    topos = {"hgx-h200": topology.load("hgx-h200")}
    load = se.workload_load(spec.workload)
    pre = se.prefill_options(spec, load, model, topos)
    dec = se.decode_options(spec, load, model, topos)
    for c in se.candidates(spec, load, model, topos, pre, dec):
        if c.pruned is None:
            assert c.n_gpus <= 8
            assert c.prefill.replicas * c.prefill.capacity_tokens_per_s >= load.input_tokens_per_s


def test_stack_prices_the_candidates(tmp_path, capsys):
    """``--stack``: every candidate priced by the named stack's shipped calibration; a stack not shipped for the
    GPU is one line naming --stack and the stacks that are."""
    from rackbed.engine.cli.main import main

    spec = se.spec_from_flags(model="qwen3-30b-a3b", topology=["hgx-h200"], weight_format=["fp8"], rate_per_s=1.0,
                              prompt_tokens=1000, output_tokens=40, duration_s=4, ttft_s=2, tpot_s=0.05,
                              prefill_tp=[2], decode_ep=[4], max_batch_per_rank=[16, 64], name="t")
    fronts = {}
    for stack in ("rackbed", "trtllm"):
        sp = spec.model_copy(update={"scenario": {"stack": stack}})
        res = bu.run_budget_search(sp, 8, tmp_path / stack, kinds=("disaggregated",), max_simulations=0)
        assert res.stack == stack and not res.records
        fronts[stack] = [(c.label, round(c.est_tokens_per_s_per_gpu, 3)) for c in res.analytic_front("disaggregated")]
        assert ("h200-trtllm" in res.calibration) == (stack == "trtllm")
    assert fronts["rackbed"] != fronts["trtllm"]
    rc = main(["search", "--model", "qwen3-30b-a3b", "--gpus", "8", "--topology", "hgx-h200", "--stack", "vllm",
               "--no-progress", "--out", str(tmp_path / "v")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("rackbed: error: --stack vllm: no calibration") and "\n" not in err
    assert "trtllm" in err
    rc = main(["search", "--model", "qwen3-30b-a3b", "--topology", "hgx-h200", "--rate", "5", "--stack", "vllm",
               "--no-progress", "--out", str(tmp_path / "r")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("rackbed: error: --stack vllm: no calibration") and "\n" not in err


@pytest.mark.slow
@pytest.mark.parametrize("topo, calib", [("gb300-nvl72", "gb300-trtllm"), ("hgx-b300", "b300-trtllm"),
                                         ("hgx-h100", "h100-trtllm"), ("hgx-h800", "h800-trtllm")])
def test_newer_presets_are_searched_with_their_calibration(tmp_path, topo, calib):
    """``rackbed search --gpus 8 --topology T`` on the GB300 / B300 / H100 / H800 presets: the analytic stage finds
    candidates priced by the GPU's own imported calibration."""
    spec = se.spec_from_flags(model="qwen3-30b-a3b", topology=[topo], weight_format=["fp8"], rate_per_s=1.0,
                              prompt_tokens=1000, output_tokens=40, duration_s=4, ttft_s=2, tpot_s=0.05,
                              prefill_tp=[2], decode_ep=[4], max_batch_per_rank=[16, 64], name="t")
    res = bu.run_budget_search(spec, 8, tmp_path / "s", kinds=("disaggregated",), max_simulations=0)
    assert "calibrated (trtllm stack, measured tables)" in res.calibration and f"{calib}.json" in res.calibration
    assert res.analytic_front("disaggregated")


@pytest.mark.slow
def test_max_rate_brackets_the_highest_rate():
    """:func:`sim.budget.max_rate`: the rate returned met the SLOs in its simulation and is the highest simulated
    that did; a simulated rate at most ``1 + 2**-steps`` times higher missed them (doubling, then ``steps``
    bisections of a gap no wider than the rate)."""
    from rackbed import scenarios
    from rackbed.sim.overrides import apply_overrides
    from rackbed.sim.scenario import load_scenario

    sc = apply_overrides(load_scenario(scenarios.resolve("agg_h200_node")), duration_s=2.0)
    steps = 2
    r = bu.max_rate(sc, 2.0, 0.05, start=50.0, steps=steps, hold=False)  # the bracketing, on 2 s windows
    met = [rate for rate, ok, _ in r.tried if ok]
    missed = [rate for rate, ok, _ in r.tried if not ok]
    assert r.rate_per_s is not None and r.rate_per_s == max(met)
    assert meets_slo({"status": "ok", "summary": r.record}, 2.0, 0.05, "p90")
    assert min(m for m in missed if m > r.rate_per_s) <= r.rate_per_s * (1 + 2 ** -steps) + 1e-9
    assert len(r.tried) <= 8 + steps + 1


@settings(max_examples=60, deadline=None, derandomize=True)
@given(st.lists(st.tuples(st.integers(1, 72), st.floats(1.0, 2000.0)), min_size=1, max_size=8),
       st.integers(1, 72), st.floats(0.0, 0.2))
def test_pick_best_prefers_the_budget_within_the_tolerance(points, gpus, tol):
    """:func:`sim.budget.pick_best`: the best is within ``tol`` of the most tokens/s per used GPU and no point that
    close gives more tokens/s per budget GPU; the best on the whole budget gives the most; with ``tol = 0`` the
    best has the most tokens/s per used GPU. :func:`sim.budget.budget_use`: whole copies within the budget."""
    recs = [{"gpus": min(n, gpus), "summary": {"tokens_per_s_per_gpu": t}} for n, t in points]
    best, total = bu.pick_best(recs, gpus, tol)
    top = max(r["summary"]["tokens_per_s_per_gpu"] for r in recs)
    per_budget = [bu.budget_use(r, gpus)["tokens_per_s_per_budget_gpu"] for r in recs]
    assert best["summary"]["tokens_per_s_per_gpu"] >= (1 - tol) * top
    b = bu.budget_use(best, gpus)["tokens_per_s_per_budget_gpu"]
    assert all(pb <= b + 1e-9 for r, pb in zip(recs, per_budget) if r["summary"]["tokens_per_s_per_gpu"] >= (1 - tol) * top)
    assert bu.budget_use(total, gpus)["tokens_per_s_per_budget_gpu"] == max(per_budget)
    if tol == 0:
        assert best["summary"]["tokens_per_s_per_gpu"] == top
    for r in recs:
        u = bu.budget_use(r, gpus)
        assert u["gpus_used"] == u["replicas"] * r["gpus"] <= gpus < (u["replicas"] + 1) * r["gpus"]


@pytest.mark.parametrize("dp, copies", [(4, 4), (8, 2), (2, 8)])
def test_copies_on_the_budget_are_placed_and_emitted(dp, copies):
    """A deployment of n GPUs fills a budget of N with ``N // n`` copies the topology places
    (:func:`sim.budget._placeable_copies`); ``scenario_of(on_budget=True)`` is that many copies as one scenario."""
    from types import SimpleNamespace

    from rackbed import scenarios
    from rackbed.sim.scenario import build
    from rackbed.topology.yamlio import load_yaml

    d = load_yaml(scenarios.resolve("agg_h200_node"))
    d = dict(d, topology="hgx-h200*2", aggregated={**d["aggregated"], "workers": 1, "dp": dp, "ep": dp})
    res = SimpleNamespace(gpus=16, scenarios={"k": d}, spec=SimpleNamespace(name="t"))
    rec = {"key": "k", "gpus": dp, "summary": {"tokens_per_s_per_gpu": 10.0}}
    assert bu._placeable_copies(res, rec) == copies
    rec["use"] = bu.budget_use(rec, 16, copies)
    assert rec["use"]["tokens_per_s"] == pytest.approx(10.0 * dp * copies)
    sc = bu.scenario_of(res, rec, on_budget=True)
    assert sc.aggregated.workers == copies and bu.scenario_of(res, rec).aggregated.workers == 1
    assert len(build(sc, engine_calibration=False).deployment.aggregated) == copies
