"""Per-term profiles of the real engine (engine.real.profiling), the attribution of the simulator's miss over
the cost model's terms (sim.engine_attribution, ``rackbed validate --engine``) and ``rackbed calibrate
--engine``."""

from __future__ import annotations

import argparse
import json
import shutil

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rackbed.sim.engine_attribution import KINDS, TERMS, attribute, summary_line

torch = pytest.importorskip("torch")

from rackbed.engine.real import profiling  # noqa: E402
from rackbed.engine.real.profiling import PlanSampler, profile_calls, scope, scoped  # noqa: E402


# -- the attribution's arithmetic ----------------------------------------------------------------------------
@settings(max_examples=200, deadline=None)
@given(kind=st.sampled_from(KINDS), term=st.sampled_from(TERMS), factor=st.floats(0.2, 5.0),
       priced=st.lists(st.floats(1e-5, 1e-2), min_size=len(TERMS), max_size=len(TERMS)),
       noise=st.lists(st.floats(-0.01, 0.01), min_size=len(TERMS), max_size=len(TERMS)),
       n=st.integers(1, 5))
def test_attribution_names_the_one_inflated_term(kind, term, factor, priced, noise, n):
    """Plans whose measured terms are the priced ones (within 1 % of the total, either way) except one term
    inflated by ``factor`` times the priced total: that term alone is named, with the inflation as its
    residual and most of the total residual as its share."""
    p = dict(zip(TERMS, priced))
    total = sum(priced)
    m = {t: max(0.0, p[t] + e * total / len(TERMS)) for t, e in zip(TERMS, noise)}
    m[term] = p[term] + factor * total
    rows = [{"kind": kind, "priced": p, "measured": m}] * n
    a = attribute(rows)[kind]
    assert a["misses"] == [term]
    by = {r["term"]: r for r in a["terms"]}
    assert by[term]["residual_s"] == pytest.approx(factor * total, rel=1e-9)
    assert by[term]["share"] > 0.8
    assert a["residual_s"] == pytest.approx(sum(r["residual_s"] for r in a["terms"]), rel=1e-9, abs=1e-15)
    line = summary_line(kind, a)
    assert line.startswith(f"{kind}: the miss is ") and " and " not in line


@settings(max_examples=100, deadline=None)
@given(scales=st.lists(st.floats(0.1, 50.0), min_size=len(TERMS) - 1, max_size=len(TERMS) - 1),
       a=st.floats(0.0, 0.02), b=st.floats(0.0, 1e-3), n=st.integers(4, 12), seed=st.integers(0, 2**16))
def test_per_term_refit_recovers_term_scales_and_the_overhead_line(scales, a, b, n, seed):
    """Decode steps whose measured kernel terms are the priced ones times a scale per term and whose engine
    time is ``a + b * batch``: the refit finds the scales and the line, and predicts the held-out steps."""
    import random

    from rackbed.sim.engine_attribution import fit_terms

    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        batch = rng.randint(1, 64)
        p = {t: rng.uniform(1e-5, 1e-3) * batch for t in TERMS[:-1]} | {"engine_s": 2e-4}
        m = {t: s * p[t] for t, s in zip(TERMS[:-1], scales)} | {"engine_s": a + b * batch}
        rows.append({"kind": "decode", "batch": batch, "priced": p, "measured": m})
    f = fit_terms(rows, holdout_every=3)["decode"]
    assert list(f["scales"].values()) == pytest.approx(scales, rel=1e-6)
    if len({r["batch"] for i, r in enumerate(rows) if i % 3 != 2}) > 1:   # the fitted steps' sizes differ
        assert f["overhead_s"] == pytest.approx([a, b], rel=1e-4, abs=1e-9)
        assert f["held_out"]["n"] == n // 3 and f["held_out"]["max_abs"] < 1e-4


def test_attribution_names_nothing_within_the_threshold():
    p = dict.fromkeys(TERMS, 1e-3)
    a = attribute([{"kind": "decode", "priced": p, "measured": {**p, "attn_s": 1.05e-3}}])["decode"]
    assert a["misses"] == [] and "no term misses" in summary_line("decode", a)


# -- sampling and profiling ----------------------------------------------------------------------------------
@given(n=st.integers(1, 8), total=st.integers(0, 400))
def test_plan_sampler_keeps_n_plans_spread_over_the_run(n, total):
    s = PlanSampler(n)
    taken = [k for k in range(total) if s.take("D0", "decode", k, batch=1)]
    chosen = [c["key"] for c in s.chosen().get("D0", [])]
    assert len(chosen) == min(n, total) and len(set(chosen)) == len(chosen)
    assert set(chosen) <= set(taken) and chosen == sorted(chosen)
    if total > n > 1:   # spread: from the first plan to within one stride of the run's end
        assert chosen[0] == 0 and chosen[-1] >= total - s.stride[("D0", "decode")]


@pytest.mark.slow
def test_scopes_are_free_unless_profiling_and_split_the_op_time():
    """Outside :func:`profile_calls` no scope reaches the profiler; inside, each op's time goes to its
    innermost scope (the matmul inside the ``a2a_s`` scope's ``moe_gemm_s`` function is ``moe_gemm_s``), ops
    outside every scope to ``unscoped_s``, and the parts add up to ``kernels_s``."""
    x = torch.randn(64, 64)

    @scoped("moe_gemm_s")
    def gemm(y):
        return y @ y

    def plan():
        with scope("attn_s"):
            y = torch.softmax(x @ x.T, -1)
        with scope("a2a_s"):
            y = gemm(y[torch.argsort(y[:, 0])])
        return (y + 1).sum()

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        plan()
    assert not any(e.name.startswith(profiling.PREFIX) for e in prof.events())
    assert scope("attn_s") is profiling._NULL

    out = profile_calls([[plan], [plan, plan]], torch.device("cpu"))
    assert len(out) == 2
    for r in out:
        t = r["terms"]
        assert t["attn_s"] > 0 and t["moe_gemm_s"] > 0 and t["a2a_s"] > 0 and r["unscoped_s"] > 0
        assert t["allreduce_s"] == 0 and t["other_s"] == 0
        assert r["kernels_s"] == pytest.approx(sum(t.values()) + r["unscoped_s"])
    assert not profiling._State.on


def test_profile_plans_must_not_be_negative(tmp_path, capsys):
    from rackbed.engine.cli.main import main
    from rackbed.sim.scenario import parse_scenario

    assert main(["real", "nowhere.yaml", "--profile-plans", "-1", "--out", str(tmp_path / "o")]) == 2
    assert "--profile-plans -1: must be >= 0" in capsys.readouterr().err and not (tmp_path / "o").exists()
    import yaml

    data = yaml.safe_load(SCENARIO.format(name="neg", ck="x", deploy=DISAGG).replace("profile_plans: 2",
                                                                                      "profile_plans: -1"))
    with pytest.raises(ValueError, match="profile_plans"):
        parse_scenario({**data, "model": "qwen3-235b-a22b"})


# -- a real CPU run with profiling on ------------------------------------------------------------------------
SCENARIO = """kind: serving
name: {name}
topology: hgx-h200
model: {ck}/config.json
weight_format: bf16
{deploy}
mtp: {{draft_k: 0}}
workload: {{kind: synthetic, arrival: {{kind: poisson, rate_per_s: 100}},
           prompt: {{kind: uniform, lo: 5, hi: 30}}, output: {{kind: uniform, lo: 3, hi: 8}},
           n_requests: 8, seed: 1}}
real: {{device: cpu, dtype: fp32, weights: {ck}, prefill_pages: 64, decode_pages: 64, profile_plans: 2}}
"""
DISAGG = """prefill: {tp: 2, ep: 2, replicas: 1, max_batch_tokens: 256}
decode: {ep: 1, replicas: 1, max_batch_per_rank: 4, page_tokens: 4}"""
AGG = """deployment: aggregated
aggregated: {workers: 1, tp: 1, dp: 1, ep: 1, max_batch_per_rank: 4, max_batch_tokens: 40, chunk_tokens: null,
             page_tokens: 4}"""


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``rackbed real`` with ``real.profile_plans: 2``: a disaggregated run (a TP2/EP2 prefiller, one decoder)
    and an aggregated one (mixed steps)."""
    pytest.importorskip("transformers")
    from tiny_qwen3moe import save_checkpoint, tiny_hf_model

    from rackbed.engine.cli.main import main

    d = tmp_path_factory.mktemp("attrib")
    ck = save_checkpoint(*tiny_hf_model(), d / "ckpt")
    out = {}
    for name, deploy in (("disagg", DISAGG), ("agg", AGG)):
        scen = d / f"{name}.yaml"
        scen.write_text(SCENARIO.format(name=name, ck=ck, deploy=deploy))
        assert main(["real", str(scen), "--out", str(d / name)]) == 0
        out[name] = d / name
    return out


@pytest.mark.slow   # the runs fixture: two real CPU runs, ~45 s together
def test_real_run_records_term_profiles_of_every_plan_kind(runs):
    profs = []
    for name in ("disagg", "agg"):
        real = json.loads((runs[name] / "real.json").read_text())
        assert "term_profile_error" not in real
        profs += real["term_profile"]
        measured = {(p["worker"], p["kind"], p["key"]): p["measured_s"] for p in real["plans"]}
        for p in real["term_profile"]:
            assert p["measured_s"] == measured[(p["worker"], p["kind"], p["key"])]
    assert {p["kind"] for p in profs} == set(KINDS)
    for p in profs:
        t = p["terms"]
        assert p["kernels_s"] == pytest.approx(sum(t.values()) + p["unscoped_s"])
        assert 0 < p["kernels_s"] <= p["profiled_wall_s"]
        assert p["overhead_s"] == pytest.approx(p["measured_s"] - p["kernels_s"])
        assert t["attn_s"] > 0 and t["moe_gemm_s"] > 0 and t["other_s"] > 0
        assert (t["allreduce_s"] > 0) == (p["kind"] == "prefill"), p   # only the TP2/EP2 prefiller reduces
    for kind in KINDS:   # the kernels fit in the measured time (per plan, a re-run on a shared CPU can be the
        # slower run of the two: the mean over the kind's plans is what is checked)
        ps = [p for p in profs if p["kind"] == kind]
        assert sum(p["kernels_s"] for p in ps) <= sum(p["measured_s"] for p in ps), kind
    per_kind = {}
    for p in profs:
        per_kind[(p["worker"], p["kind"])] = per_kind.get((p["worker"], p["kind"]), 0) + 1
    assert max(per_kind.values()) <= 2


@pytest.mark.slow   # the runs fixture: two real CPU runs, ~45 s together
def test_validate_engine_attributes_the_run_over_the_terms(runs, capsys):
    from rackbed.engine.cli.validate import validate_engine

    res = validate_engine(None, None, argparse.Namespace(engine=str(runs["disagg"]), holdout_every=3,
                                                          write_engine_calibration=None))
    text = capsys.readouterr().out
    att = res["attribution"]
    assert set(att["kinds"]) == {"decode", "prefill"}
    for kind, a in att["kinds"].items():
        assert a["n"] >= 1 and [r["term"] for r in a["terms"]] == list(TERMS)
        # the measured terms add up to the measured plan time (engine overhead = measured - kernels)
        plans = [r for r in att["plans"] if r["kind"] == kind]
        assert all(min(r["measured"].values()) >= 0 for r in plans)
        assert a["priced_s"] > 0
        assert f"{kind}: the miss is" in text or f"{kind}: no term misses" in text
    assert "per-term attribution" in text and "engine overhead" in text
    json.dumps(att)   # --out writes it


@pytest.mark.slow   # the runs fixture: two real CPU runs, ~45 s together
def test_validate_engine_without_a_term_profile_says_so(runs, tmp_path, capsys):
    from rackbed.engine.cli.validate import validate_engine
    from rackbed.sim.engine_attribution import attribute_run

    d = tmp_path / "run"
    shutil.copytree(runs["disagg"], d)
    real = json.loads((d / "real.json").read_text())
    del real["term_profile"]
    (d / "real.json").write_text(json.dumps(real))
    assert attribute_run(d) is None
    res = validate_engine(None, None, argparse.Namespace(engine=str(d), holdout_every=3,
                                                          write_engine_calibration=None))
    assert res["attribution"] is None and "recorded no term profile" in capsys.readouterr().out


# -- rackbed calibrate --engine ------------------------------------------------------------------------------
@pytest.mark.slow   # the runs fixture: two real CPU runs, ~45 s together
def test_calibrate_engine_round_trip(runs, tmp_path, capsys):
    from rackbed.engine.cli.main import main
    from rackbed.sim.engine_calibration import load_engine_calibration

    out = tmp_path / "engine-cpu.yaml"
    run = str(runs["disagg"])
    assert main(["calibrate", "--engine", run, "--out", str(out)]) == 0
    text = capsys.readouterr().out
    cal = load_engine_calibration(out)
    assert cal.source == run and cal.n_plans["held_out"] > 0 and "held-out decode" in text
    assert main(["calibrate", "--engine", run, "--out", str(out)]) == 2        # no replacing without --force
    assert "exists" in capsys.readouterr().err
    argv = ["calibrate", "--engine", run, run, "--out", str(out), "--force", "--holdout-every", "0"]
    assert main(argv) == 0
    two = load_engine_calibration(out)
    assert two.n_plans == {"fit": 2 * (cal.n_plans["fit"] + cal.n_plans["held_out"]), "held_out": 0}
    assert two.source == f"{run}, {run}"
    # the run profiled sampled plans: the optional per-term refit, with its held-out check
    tf = load_engine_calibration(out).term_fit
    assert set(tf) == {"decode", "prefill"} and "per-term refit decode" in capsys.readouterr().out
    for f in tf.values():
        assert f["n_fit"] >= 2 and f["scales"]["attn_s"] > 0 and len(f["overhead_s"]) == 2


@pytest.mark.slow   # the runs fixture: two real CPU runs, ~45 s together
def test_calibrate_engine_refuses_bad_input_in_one_line(runs, tmp_path, capsys):
    from rackbed.engine.cli.main import main

    run = str(runs["disagg"])
    other = tmp_path / "other"
    shutil.copytree(runs["disagg"], other)
    scen = tmp_path / "gb200.yaml"   # the same model on another GPU model
    scen.write_text((runs["disagg"].parent / "disagg.yaml").read_text().replace("topology: hgx-h200",
                                                                               "topology: gb200-nvl72"))
    real = json.loads((other / "real.json").read_text())
    (other / "real.json").write_text(json.dumps({**real, "scenario": str(scen)}))
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "real.json").write_text("[1, 2]")
    (tmp_path / "junk" / "decisions.csv").write_text("")
    out = str(tmp_path / "c.yaml")
    cases = [
        (["--engine", str(tmp_path / "nowhere"), "--out", out], "real.json, decisions.csv missing"),
        (["--engine", str(tmp_path / "junk"), "--out", out], "not a `rackbed real` result"),
        (["--engine", run], "--out"),
        (["--engine", run, "--out", out, "--holdout-every", "1"], "--holdout-every 1"),
        (["--engine", run, "--out", out, "--dry-run"], "--dry-run is for kernel calibrations"),
        (["--engine", run, str(other), "--out", out], "one model on one GPU model"),
    ]
    for argv, msg in cases:
        assert main(["calibrate", *argv]) == 2, argv
        err = capsys.readouterr().err
        assert msg in err and err.count("\n") == 1 and "Traceback" not in err, (argv, err)
    assert not (tmp_path / "c.yaml").exists()
