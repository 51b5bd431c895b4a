"""rackbed.sim.search: analytic pruning and sizing (hand-checked against sim.costs.step with the calibration the simulation
selects), SLO eligibility, cost, and a small end-to-end search through the sweep machinery and the report."""

from __future__ import annotations

import math

import pytest

from rackbed import topology
from rackbed.engine.core.model import get_model
from rackbed.engine.core.sharding import ParallelPlan
from rackbed.engine.core.specdec import expected_tokens_per_step
from rackbed.sim import search as se
from rackbed.sim import search_results as sr
from rackbed.sim.costs.step import decode_step_breakdown, prefill_step_breakdown
from rackbed.topology.errors import UserError


def make_spec(**kw):
    data = {"name": "t", "model": "qwen3-235b-a22b",
            "workload": {"kind": "synthetic", "arrival": {"kind": "constant", "rate_per_s": 10},
                         "prompt": {"kind": "fixed", "tokens": 3000}, "output": {"kind": "fixed", "tokens": 100},
                         "duration_s": 10},
            "slo": {"ttft_s": 2.0, "tpot_s": 0.05},
            "space": {"topology": ["gb200-nvl72"], "weight_format": ["mxfp8"], "prefill_tp": [4],
                      "decode_ep": [8], "max_batch_per_rank": [32], "draft_k": [1]},
            # Qwen3-235B has no MTP layers: drafting states the trained MTP head explicitly
            "scenario": {"mtp": {"draft": {"kind": "mtp", "layers": 1}}}}
    for k, v in kw.items():
        if k in ("space", "scenario"):
            data[k] = {**data[k], **v}
        else:
            data[k] = v
    return se.parse_search(data, "t.yaml")


def parts(spec):
    model = get_model(spec.model)
    topos = {t: topology.load(t) for t in spec.space.topology}
    load = se.workload_load(spec.workload)
    return model, topos, load


def selected_calibration(spec, topo):
    """The kernel calibration the simulation of the spec's candidates selects for the topology's GPU (None where
    none ships): the analytic stage prices steps with it too."""
    from rackbed.sim.scenario import _load_calibration, parse_scenario

    return _load_calibration(parse_scenario(se.base_scenario(spec)), topo.gpu_spec(0).name)[0]


def test_load_of_a_constant_stream():
    load = se.workload_load(make_spec().workload)
    assert load.rate_per_s == pytest.approx(10.0)
    assert load.prompt_mean == 3000 and load.output_mean == 100 and load.n_requests == 100
    assert load.input_tokens_per_s == pytest.approx(30000.0)


def test_prefill_capacity_and_replicas_by_hand():
    spec = make_spec()
    model, topos, load = parts(spec)
    (o,) = se.prefill_options(spec, load, model, topos)
    assert o.pruned is None
    topo = topos["gb200-nvl72"]
    plan = ParallelPlan(role="prefill", tp=4, ep=4, dp=1, gpus=(0, 1, 2, 3), weight_format="mxfp8",
                        max_batch_tokens=16384)
    calib = selected_calibration(spec, topo)
    n_seqs = 16384 // 3000  # 5 full prompts in a 16384-token batch
    step = prefill_step_breakdown(model, plan, topo, [(3000, 0)] * n_seqs, calib=calib).total_s
    assert o.batch == (n_seqs, 3000)
    assert o.capacity_tokens_per_s == pytest.approx(n_seqs * 3000 / step)
    assert o.replicas == math.ceil(30000 * 1.25 / o.capacity_tokens_per_s)
    assert o.ttft_floor_s == pytest.approx(prefill_step_breakdown(model, plan, topo, [(3000, 0)],
                                                                  calib=calib).total_s)


def test_decode_tpot_sizing_and_fixed_point_by_hand():
    spec = make_spec(workload={"kind": "synthetic", "arrival": {"kind": "constant", "rate_per_s": 40},
                               "prompt": {"kind": "fixed", "tokens": 2000},
                               "output": {"kind": "fixed", "tokens": 500}, "duration_s": 10})
    model, topos, load = parts(spec)
    (o,) = se.decode_options(spec, load, model, topos)
    assert o.pruned is None
    topo = topos["gb200-nvl72"]
    plan = ParallelPlan(role="decode", tp=1, ep=8, dp=8, gpus=tuple(range(8)), weight_format="mxfp8",
                        max_batch_seqs=32)
    calib = selected_calibration(spec, topo)
    ctx = 2000 + 500 / 2
    e = expected_tokens_per_step(1, 0.8)
    assert o.b_max == 32  # KV holds far more than 32 sequences of 2250 tokens on a GB200
    t_cap = decode_step_breakdown(model, plan, topo, [32] * 8, [32 * ctx] * 8, draft_k=1, calib=calib).total_s / e
    assert o.tpot_at_cap_s == pytest.approx(t_cap)
    assert o.replicas == max(1, math.ceil(40 * 500 * t_cap / (8 * 32)))
    # the operating batch is (close to) the fixed point of Little's law at the TPOT it causes
    assert 0 < o.b_op <= o.b_max
    bi = math.ceil(o.b_op - 1e-9)
    t_op = decode_step_breakdown(model, plan, topo, [bi] * 8, [bi * ctx] * 8, draft_k=1, calib=calib).total_s / e
    assert o.tpot_s == pytest.approx(t_op)
    assert o.b_op == pytest.approx(min(o.b_max, 40 * 500 * t_op / (o.replicas * 8)), abs=0.5)


def test_pruning_reasons_memory_ttft_tpot_and_gpu_count():
    spec = make_spec(slo={"ttft_s": 0.01, "tpot_s": 0.001},
                     space={"topology": ["hgx-h200"], "weight_format": ["fp8_block"], "prefill_tp": [1, 4],
                            "decode_ep": [8]})
    model, topos, load = parts(spec)
    pre = {o.tp: o for o in se.prefill_options(spec, load, model, topos)}
    assert "does not fit" in pre[1].pruned
    assert pre[4].pruned.startswith("TTFT floor")
    (d,) = se.decode_options(spec, load, model, topos)
    assert d.pruned.startswith("TPOT at batch 32/rank")
    # a deployment larger than the topology is pruned with the count
    spec2 = make_spec(space={"topology": ["hgx-h200"], "weight_format": ["fp8_block"], "decode_ep": [8]})
    model, topos, load = parts(spec2)
    cands = se.candidates(spec2, load, model, topos, se.prefill_options(spec2, load, model, topos),
                          se.decode_options(spec2, load, model, topos))
    assert all(c.pruned and "hgx-h200 has 8" in c.pruned for c in cands)


def test_cost_and_slo_eligibility():
    assert se.cost_per_mtok_usd(6.0, 1000.0) == pytest.approx(6.0 / 3.6)  # $6/h at 1000 tok/s: $1.667 per 1M
    assert se.cost_per_mtok_usd(6.0, 0.0) is None
    ok = {"status": "ok", "summary": {"done": 10, "requests": 10, "ttft_p90_s": 0.5, "tpot_p90_s": 0.02,
                                      "tokens_per_s_per_gpu": 100.0, "tokens_per_s_per_user": 50.0}}
    assert sr.meets_slo(ok, 1.0, 0.05)
    assert not sr.meets_slo(ok, 0.4, 0.05)
    assert not sr.meets_slo(ok, 1.0, 0.01)
    assert sr.meets_slo(ok, None, None)
    short = {**ok, "summary": {**ok["summary"], "done": 9}}
    assert not sr.meets_slo(short, 1.0, 0.05)  # a rejected request disqualifies
    assert not sr.meets_slo({"status": "invalid"}, 1.0, 0.05)


def test_selection_takes_whole_analytic_layers_within_budget():
    def cand(gpu, user):
        c = se.Candidate(None, None, 1, gpu, user, None)  # type: ignore[arg-type]
        return c
    cs = [cand(3, 1), cand(1, 3), cand(2, 2), cand(1, 1), cand(0.5, 0.5)]
    cs[4].pruned = "x"
    # layer 0 = the front, best estimated tokens/s per GPU first; then layer 1; the pruned one never
    assert [id(c) for c in se.select_for_simulation(cs, 10)] == [id(cs[0]), id(cs[2]), id(cs[1]), id(cs[3])]
    first = se.select_for_simulation(cs, 3)
    assert set(map(id, first)) == {id(cs[0]), id(cs[1]), id(cs[2])}
    two = se.select_for_simulation(cs, 2)
    assert [c.est_tokens_per_s_per_gpu for c in two] == [3, 2]  # the front, cut by tokens/s per GPU


@pytest.mark.slow
def test_small_search_end_to_end(tmp_path):
    spec = make_spec(workload={"kind": "synthetic", "arrival": {"kind": "poisson", "rate_per_s": 6},
                               "prompt": {"kind": "fixed", "tokens": 1500},
                               "output": {"kind": "fixed", "tokens": 40}, "duration_s": 4},
                     space={"decode_ep": [8, 16], "max_batch_per_rank": [16], "prefill_tp": [4, 8]},
                     gpu_hour_usd=6.0, max_simulations=4, top=3)
    res = se.run_search(spec, tmp_path, jobs=1, progress=False)
    assert len(res.simulated) == 4 and len(res.records) == 4
    # TP=8 spans two 4-GPU trays: priced analytically, refused by the simulator's placement, recorded as invalid
    inv = [r for r in res.records if r["status"] == "invalid"]
    assert inv and all("needs 8 free GPUs in one node" in r["reason"] for r in inv)
    keys_el = {r["key"] for r in res.eligible}
    assert res.front and all(r["key"] in keys_el for r in res.front)
    gpus = [r["summary"]["tokens_per_s_per_gpu"] for r in res.best]
    assert gpus == sorted(gpus, reverse=True)
    for r in res.best:
        s = r["summary"]
        # one rule (sim.energy): the whole pool for the whole run, GPU-hours plus energy
        e = r["metrics"]["energy"]
        want = (6.0 * e["pool_gpus"] * e["duration_s"] / 3600 + e["usd_energy"]) / (e["output_tokens"] / 1e6)
        assert s["cost_per_mtok_usd"] == pytest.approx(want)
        assert s["cost_per_mtok_usd"] > 6.0 / (3600 * s["tokens_per_s_per_gpu"]) * 1e6 * (1 - 1e-9)
        ex = res.explanations[r["key"]]
        for role in ("prefill", "decode"):
            assert sum(ex[role]["by_category"].values()) == pytest.approx(ex[role]["total_s"])
            assert sum(ex[role]["terms"].values()) == pytest.approx(ex[role]["total_s"])
    from rackbed.engine.cli.search import search_report_data
    from rackbed.sim.report import write_report

    files = write_report(tmp_path, search_report_data(res))
    html = files[1].read_text()
    assert "data:image/png;base64," in html and "Decode options" in html and "where the step time goes" in html
    # resumable: the same search again simulates nothing new
    again = se.run_search(spec, tmp_path, jobs=1, progress=False)
    assert [r["key"] for r in again.records] == [r["key"] for r in res.records]


def test_spec_errors_and_cli_flags(tmp_path, capsys):
    with pytest.raises(UserError, match="t.yaml: spaec: unknown key"):
        se.parse_search({"model": "m", "workload": {}, "slo": {}, "spaec": {}} | {
            "workload": make_spec().workload.model_dump(), "slo": {"ttft_s": 1, "tpot_s": 1}}, "t.yaml")
    from rackbed.engine.cli.main import main

    assert main(["search"]) == 2
    assert "--rate" in capsys.readouterr().err
    rc = main(["search", "--rate", "4", "--prompt", "1000", "--output", "30", "--duration", "3",
               "--decode-ep", "8", "--batch-cap", "16", "--draft-k", "1", "--mtp-layers", "1", "--prefill-tp", "4",
               "--max-simulations", "1", "--out", str(tmp_path), "--jobs", "1", "--no-progress"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "best points" in out and "why: prefill" in out and (tmp_path / "report.md").exists()


def test_a_search_resumes_in_its_own_folder_and_refuses_another(tmp_path, capsys):
    """A search's folder holds search.json (which search wrote it): the same search again — with more
    --max-simulations, as after an interruption — resumes there without --force, running only what is not in
    results.jsonl; another search (a different SLO), or a results.jsonl without search.json, is a one-line error
    naming --out and --force, and leaves the folder as it was. ``--rate`` with ``--gpus`` says the GPU cap."""
    import json

    from rackbed.engine.cli.main import main

    out = tmp_path / "s"
    argv = ["search", "--model", "qwen3-30b-a3b", "--topology", "hgx-h200", "--gpus", "8", "--rate", "4",
            "--isl", "1000", "--osl", "30", "--duration", "3", "--decode-ep", "4,8", "--batch-cap", "16",
            "--prefill-tp", "2,4", "--jobs", "1", "--no-progress", "--no-report", "--out", str(out)]
    assert main([*argv, "--max-simulations", "1"]) == 0
    printed = capsys.readouterr().out
    assert "--gpus 8: deployments of at most 8 GPUs" in printed and "deployments of at most 8 GPUs;" in printed
    first = (out / "results.jsonl").read_text().splitlines()
    marker = json.loads((out / "search.json").read_text())["search"]
    assert len(first) == 1 and marker["mode"] == "rate" and marker["spec"]["max_gpus"] == 8
    assert "max_simulations" not in marker["spec"]
    # resumed: the recorded simulation is not run again, one more is
    assert main([*argv, "--max-simulations", "2"]) == 0
    assert "resuming the search in" in capsys.readouterr().out
    lines = (out / "results.jsonl").read_text().splitlines()
    assert lines[:1] == first and len(lines) == 2
    # another search's folder is not written into without --force
    assert main([*argv, "--ttft", "1.5"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"--out {out}: holds another search" in err and "slo.ttft_s" in err
    assert "--force" in err and (out / "results.jsonl").read_text().splitlines() == lines
    assert json.loads((out / "search.json").read_text())["search"] == marker
    # a folder with results but no search.json (a sweep's): --force, named
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    (legacy / "results.jsonl").write_text("")
    assert main([*argv[:-1], str(legacy)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "no search.json" in err and "--force" in err
    # --emit-out is an output folder too: one holding other files needs --force, said before the search runs
    (legacy / "launch.sh").write_text("mine")
    assert main([*argv, "--emit", "sglang", "--emit-out", str(legacy)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"rackbed: error: --emit-out {legacy}: folder exists and is not empty; pass --force")
    assert (legacy / "launch.sh").read_text() == "mine"


def test_a_budget_search_folder_is_its_own_for_the_same_budget(tmp_path):
    """The budget search's identity: its spec, --gpus, --kind and --fill-tolerance; effort flags may differ."""
    import argparse

    from rackbed.engine.cli.search import identity, search_dir

    spec = se.spec_from_flags(model="qwen3-30b-a3b", topology=["hgx-h200"], weight_format=["fp8"], rate_per_s=1.0,
                              prompt_tokens=1000, output_tokens=40, duration_s=4, ttft_s=2, tpot_s=0.05)
    args = argparse.Namespace(out=tmp_path / "b", force=False)

    def ident(gpus=8, **upd):
        return identity(spec.model_copy(update=upd), "budget", gpus=gpus, kinds=["aggregated", "disaggregated"],
                        fill_tolerance=0.05)

    assert search_dir(args, "b", ident()) == tmp_path / "b"
    (tmp_path / "b" / "results.jsonl").write_text("{}\n")
    assert search_dir(args, "b", ident(max_simulations=30, top=2)) == tmp_path / "b"
    with pytest.raises(UserError, match=r"holds another search \(differs in gpus\); pass --force"):
        search_dir(args, "b", ident(gpus=16))
    assert search_dir(argparse.Namespace(out=tmp_path / "b", force=True), "b", ident(gpus=16)) == tmp_path / "b"
