"""rackbed.sim.capacity: a tiny rate sweep end to end (the chosen point checked against its own sweep record), the choice /
front / equal-user-speed functions as properties, and one-line spec errors."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rackbed.sim import capacity as cap
from rackbed.sim.sweep import read_results
from rackbed.topology.errors import UserError

SLO = {"ttft_s": 2.0, "tpot_s": 0.05}


def tiny(**kw) -> dict:
    data = {"kind": "capacity", "name": "tiny", "rates_per_s": [4, 2], "gpu_budget": 16,
            "search": {"model": "qwen3-235b-a22b",
                       "workload": {"kind": "synthetic", "arrival": {"kind": "poisson", "rate_per_s": 1},
                                    "prompt": {"kind": "fixed", "tokens": 1500},
                                    "output": {"kind": "fixed", "tokens": 40}, "duration_s": 3},
                       "slo": SLO,
                       "space": {"topology": ["gb200-nvl72", "hgx-h200*2"], "weight_format": ["fp8_block"],
                                 "prefill_tp": [4], "decode_ep": [8], "max_batch_per_rank": [16],
                                 "draft_k": [1]},
                       "scenario": {"mtp": {"draft": {"kind": "mtp", "layers": 1}}},
                       "max_simulations": 2}}
    data.update(kw)
    return data


@pytest.mark.slow
def test_tiny_capacity_end_to_end(tmp_path):
    spec = cap.parse_capacity(tiny(prefill_headroom=[1.25, 1.0]), "tiny.yaml")
    assert spec.rates_per_s == (2.0, 4.0) and spec.headrooms == (1.0, 1.25)
    run = cap.run_capacity([spec], tmp_path / "work", command="test")
    js, md = cap.write(tmp_path / "out", "t", run)
    d = json.loads(js.read_text())
    assert d == json.loads(json.dumps(cap._rounded(run.as_dict())))  # the compact layout is plain JSON
    assert d["git_commit"] and d["command"] == "test" and d["date"] and d["versions"]["pydantic"]
    assert [(c["topology"], c["weight_format"]) for c in d["cases"]] == [("gb200-nvl72", "fp8_block"),
                                                                        ("hgx-h200*2", "fp8_block")]
    gb, h = d["cases"]
    # each case says what priced it: GB200 from the measured tables (with its caveats), H200 from rackbed's own
    assert gb["calibration_note"].startswith("calibrated (trtllm stack, measured tables): B200-GB200")
    assert gb["caveats"] and any("not in the tables" in c for c in gb["caveats"])
    assert h["calibration_note"].startswith("calibrated (rackbed stack): H200")
    for c in d["cases"]:
        assert [(r["rate_per_s"], r["prefill_headroom"]) for r in c["rates"]] == [(2, 1), (2, 1.25), (4, 1), (4, 1.25)]
        p = c["chosen"]
        assert p is not None and p["gpus"] <= 16 == c["gpu_budget"]
        # the chosen point meets the SLOs in its own sweep record, under the SLO its own scenario carried
        path = tmp_path / "work" / "tiny" / cap._safe(c["topology"]) / "fp8_block" / f"rate-{p['rate_per_s']:g}-h{p['prefill_headroom']:g}"
        (rec,) = [r for r in read_results(path / "results.jsonl") if r["key"] == p["key"]]
        s = rec["summary"]
        assert rec["status"] == "ok" and s["done"] == s["requests"] > 0
        assert s["ttft_p90_s"] <= SLO["ttft_s"] and s["tpot_p90_s"] <= SLO["tpot_s"]
        g = rec["metrics"]["goodput"]
        assert (g["slo_ttft_s"], g["slo_tpot_s"]) == (SLO["ttft_s"], SLO["tpot_s"])
        assert cap.deployment_gpus(rec["overrides"]) == p["gpus"]
        assert p["tokens_per_s_per_budget_gpu"] == pytest.approx(s["output_tokens_per_s"] / 16, rel=1e-5)
        assert p["tokens_per_s_per_used_gpu"] == pytest.approx(s["output_tokens_per_s"] / p["gpus"], rel=1e-4)
        # no eligible point ran at a higher rate
        assert p["rate_per_s"] == max(r["rate_per_s"] for r in c["rates"] if r["meet_slo"])
    (r,) = d["ratios"]
    assert (r["a"], r["b"]) == ("gb200-nvl72 fp8_block", "hgx-h200*2 fp8_block")
    us = sorted({gb["chosen"]["user"], h["chosen"]["user"]})
    assert [row["u"] for row in r["at"]] == pytest.approx(us)
    low = r["at"][0]  # at the slower chosen point's speed both chosen points qualify: the ratio of their figures
    assert low["ratio_budget"] == pytest.approx(gb["chosen"]["tokens_per_s_per_budget_gpu"]
                                                / h["chosen"]["tokens_per_s_per_budget_gpu"], rel=1e-4)
    text = md.read_text()
    assert "| gb200-nvl72 | fp8_block | 16 | P1xTP4/EP4 + D1xEP8, b<=16, MTP k=1 |" in text
    assert "Ratio at equal tokens/s per user" in text and "caveat: " in text


def test_a_budget_nothing_fits_chooses_nothing(tmp_path):
    spec = cap.parse_capacity(tiny(rates_per_s=[2], gpu_budget=8, search={
        **tiny()["search"], "space": {**tiny()["search"]["space"], "topology": ["gb200-nvl72"]}}))
    run = cap.run_capacity([spec], tmp_path, command="t")
    (c,) = run.cases
    assert c["chosen"] is None and c["rates"][0]["simulated"] == 1 and c["rates"][0]["meet_slo"] == 0
    assert "none meets the SLOs" in cap.markdown(run.as_dict())


def test_every_candidate_pruned_simulates_nothing(tmp_path):
    # the search simulates its bare base scenario when nothing survives the pruning: not a candidate, not counted
    spec = cap.parse_capacity(tiny(rates_per_s=[2], search={**tiny()["search"], "slo": {"ttft_s": 2, "tpot_s": 1e-4},
                                                            "space": {**tiny()["search"]["space"],
                                                                      "topology": ["gb200-nvl72"]}}))
    run = cap.run_capacity([spec], tmp_path, command="t")
    (c,) = run.cases
    (r,) = c["rates"]
    assert c["chosen"] is None and r["simulated"] == 0 and r["candidates"] == r["pruned"] == 1
    assert r["pruned_because"] == [{"candidates": 1, "example": r["pruned_because"][0]["example"]}]
    assert r["pruned_because"][0]["example"].startswith("TPOT at batch 16/rank")
    assert "every candidate pruned at 2 (at 2: 1 of 1 like \"TPOT at batch 16/rank" in cap.markdown(run.as_dict())


def _points():
    pt = st.fixed_dictionaries({
        "rate_per_s": st.sampled_from([1.0, 2.0, 5.0]), "gpus": st.integers(1, 12), "meets_slo": st.booleans(),
        "tokens_per_s_per_budget_gpu": st.floats(0, 1e3), "tokens_per_s_per_used_gpu": st.floats(0, 1e3),
        "user": st.floats(1, 500)})
    return st.lists(pt, max_size=12)


@settings(max_examples=200, derandomize=True, deadline=None)
@given(_points(), st.integers(1, 12), st.floats(0, 600))
def test_choice_front_and_speed_floor_properties(points, budget, u):
    el = cap.eligible(points, budget)
    c = cap.choose(points, budget)
    if not el:
        assert c is None
    else:
        assert c in el
        assert not any(p["rate_per_s"] > c["rate_per_s"]
                       or (p["rate_per_s"] == c["rate_per_s"] and p["gpus"] < c["gpus"]) for p in el)
    for per in ("budget", "used"):
        k = f"tokens_per_s_per_{per}_gpu"
        b = cap.per_gpu_at_user(el, u, per)
        fast = [p for p in el if p["user"] >= u]
        assert (b is None) == (not fast)
        if b is not None:
            assert b["user"] >= u and b[k] == max(p[k] for p in fast)
            # asking for more speed per user never gives more tokens/s per GPU
            b2 = cap.per_gpu_at_user(el, u * 1.5 + 1, per)
            assert b2 is None or b2[k] <= b[k]
    if el:
        f = cap.front(el)
        assert f and all(not (q["tokens_per_s_per_budget_gpu"] >= p["tokens_per_s_per_budget_gpu"]
                              and q["user"] >= p["user"]
                              and (q["tokens_per_s_per_budget_gpu"], q["user"])
                              != (p["tokens_per_s_per_budget_gpu"], p["user"])) for p in f for q in el)


def test_spec_errors_are_one_line(tmp_path, capsys):
    with pytest.raises(UserError, match=r"^c.yaml: rates_per_s: .*non-empty list of positive numbers"):
        cap.parse_capacity(tiny(rates_per_s=[]), "c.yaml")
    with pytest.raises(UserError, match=r"^c.yaml: rate_per_s: unknown key"):
        cap.parse_capacity(tiny(rate_per_s=3), "c.yaml")
    trace = {**tiny()["search"], "workload": {"kind": "trace", "name": "mooncake"}}
    with pytest.raises(UserError, match=r"^c.yaml: search.workload.kind: must be synthetic"):
        cap.parse_capacity(tiny(search=trace), "c.yaml")
    y = tmp_path / "big.yaml"
    y.write_text(json.dumps(tiny(gpu_budget=20)))  # JSON is YAML
    with pytest.raises(UserError, match=r"big.yaml: gpu_budget: 20 GPUs exceeds hgx-h200\*2's 16 GPUs"):
        cap.load_capacity(y)
    from rackbed.engine.cli.main import main

    assert main(["capacity", str(tmp_path / "nope.yaml"), "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "nope.yaml: no such capacity spec" in err
