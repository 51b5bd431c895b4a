"""Energy and money per token (sim.energy): the draw model's bounds, the whole-pool accounting rule,
prices."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs

from rackbed.engine.cli.main import main
from rackbed.sim.driver import SPAN_DECODE, SPAN_PREFILL
from rackbed.sim.energy import EnergyPrices, busy_power_w, energy_report
from rackbed.sim.scenario import load_scenario, simulate_scenario
from rackbed.topology.specs import GPUS

SCENARIO = """kind: serving
name: e
topology: hgx-h200*2
model: qwen3-235b-a22b
weight_format: fp8_block
prefill: {tp: 8, ep: 8, replicas: 1}
decode: {ep: 8, replicas: 1}
workload: {kind: synthetic, arrival: {kind: poisson, rate_per_s: 4}, prompt: {kind: fixed, tokens: 2000},
           output: {kind: fixed, tokens: 30}, n_requests: 20}
slo: {ttft_s: 2.0, tpot_s: 0.05}
"""
H200 = GPUS["H200-SXM"].power


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    p = tmp_path_factory.mktemp("e") / "s.yaml"
    p.write_text(SCENARIO)
    sc = load_scenario(p)
    return simulate_scenario(sc)


@given(hs.floats(0, 10), hs.floats(0, 10), hs.floats(0, 1), hs.floats(0, 1))
def test_busy_draw_between_memory_and_compute_bound_and_monotone(u1, u2, k1, k2):
    lo, hi = sorted((u1, u2))
    klo, khi = sorted((k1, k2))
    p = float(busy_power_w(H200, lo, klo))
    assert H200.memory_bound_w <= p <= H200.compute_bound_w
    assert float(busy_power_w(H200, hi, klo)) >= p and float(busy_power_w(H200, lo, khi)) >= p


def test_report_adds_up(run):
    b, res = run
    e = energy_report(b, res, EnergyPrices(usd_per_gpu_hour=3.5, usd_per_kwh=0.1, pue=1.3))
    T, n = res.sim_end_s, 16
    assert e["pool_gpus"] == n and e["duration_s"] == T
    assert e["overhead_J"] == pytest.approx(2 * 2000 * T)  # two HGX nodes, no rack overhead
    assert e["facility_J"] == pytest.approx(1.3 * (e["gpu_J"] + e["overhead_J"]))
    assert e["mean_kW"] == pytest.approx(e["facility_J"] / T / 1e3)
    assert e["kWh_per_day"] == pytest.approx(e["mean_kW"] * 24)
    assert e["J_per_output_token"] == pytest.approx(e["facility_J"] / (20 * 30))
    assert e["usd_gpu"] == pytest.approx(3.5 * n * T / 3600)
    assert e["usd_energy"] == pytest.approx(e["facility_J"] / 3.6e6 * 0.1)
    assert e["usd_per_m_output"] == pytest.approx((e["usd_gpu"] + e["usd_energy"]) / (600 / 1e6))
    # every worker's GPUs are in the pool for its life: the workers' energy is part of the pool's
    assert sum(w["energy_J"] for w in e["workers"].values()) <= e["gpu_J"] * (1 + 1e-12)
    for w in e["workers"].values():
        assert H200.idle_w <= w["mean_W_per_gpu"] <= H200.compute_bound_w
    assert 0 < e["utilisation_by_role"]["prefill"] and 0 < e["utilisation_by_role"]["decode"]


@settings(max_examples=30)
@given(hs.data())
def test_gpu_energy_between_idle_and_peak(run, data):
    """Whatever the steps (none overlapping on one worker), the pool's GPU energy lies between all idle and
    all at the power limit for the whole time."""
    b, res = run
    T = res.sim_end_s
    spans = []
    for gid, role, *_ in res.groups:
        cuts = sorted(data.draw(hs.lists(hs.floats(0, T), min_size=0, max_size=12)))
        kind = SPAN_PREFILL if role == "prefill" else SPAN_DECODE
        for i in range(0, len(cuts) - 1, 2):
            tok = data.draw(hs.integers(1, 10**7))
            spans.append((gid, kind, cuts[i], cuts[i + 1] - cuts[i], tok, False))
    r2 = dataclasses.replace(res, spans=spans)
    e = energy_report(b, r2)
    n = e["pool_gpus"]
    assert H200.idle_w * n * T * (1 - 1e-9) <= e["gpu_J"] <= H200.compute_bound_w * n * T * (1 + 1e-9)
    assert e["gpu_idle_J"] == pytest.approx(H200.idle_w * n * T)


@settings(max_examples=20)
@given(hs.floats(0, 20), hs.floats(0, 20), hs.floats(0, 1), hs.floats(0, 1), hs.floats(1, 2), hs.floats(1, 2))
def test_prices_move_cost_not_energy(run, g1, g2, k1, k2, p1, p2):
    b, res = run
    lo = energy_report(b, res, EnergyPrices(min(g1, g2), min(k1, k2), min(p1, p2)))
    hi = energy_report(b, res, EnergyPrices(max(g1, g2), max(k1, k2), max(p1, p2)))
    assert hi["usd_per_m_output"] >= lo["usd_per_m_output"]
    assert hi["J_per_output_token"] >= lo["J_per_output_token"]  # only PUE moves energy
    assert hi["gpu_J"] == lo["gpu_J"]
    same = energy_report(b, res, EnergyPrices(max(g1, g2), max(k1, k2), min(p1, p2)))
    assert same["J_per_output_token"] == lo["J_per_output_token"]


@pytest.mark.parametrize("kw,needle", [({"pue": 0.9}, "pue"), ({"usd_per_kwh": -1}, "usd_per_kwh"),
                                       ({"usd_per_gpu_hour": float("nan")}, "usd_per_gpu_hour")])
def test_bad_prices_are_one_line_errors(kw, needle):
    with pytest.raises(ValueError, match=needle):
        EnergyPrices(**kw)


def test_run_writes_energy_and_refuses_bad_pue(tmp_path, capsys):
    p = tmp_path / "s.yaml"
    p.write_text(SCENARIO + "energy: {usd_per_gpu_hour: 3.5, pue: 1.1}\n")
    assert main(["run", str(p), "--out", str(tmp_path / "out"), "--no-progress"]) == 0
    import json

    e = json.loads((tmp_path / "out" / "metrics.json").read_text())["energy"]
    assert e["pue"] == 1.1 and e["usd_per_gpu_hour"] == 3.5 and e["J_per_output_token"] > 0
    assert "J/output" in capsys.readouterr().out
    p.write_text(SCENARIO + "energy: {pue: 0.5}\n")
    assert main(["run", str(p), "--out", str(tmp_path / "out2"), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "energy.pue" in err[0]
    assert np.isfinite(e["kWh_per_day"])


def test_one_prefill_step_by_hand(run):
    """A single prefill step: its GPUs draw the memory-bound figure plus the kernel share of the way to the
    power limit, in proportion to its compute utilisation (FLOPs over the dense FP8 peak during kernel
    time)."""
    b, res = run
    T = res.sim_end_s
    pid = next(g[0] for g in res.groups if g[1] == "prefill")
    tokens, dur = 16384, 0.5
    r2 = dataclasses.replace(res, spans=[(pid, SPAN_PREFILL, 1.0, dur, tokens, False)])
    e = energy_report(b, r2)
    bd = res.breakdown_s["prefill"]
    k = 1 - (bd["a2a_s"] + bd["allreduce_s"]) / sum(bd.values())
    prompt = 2000  # the scenario's fixed prompt
    u = tokens * b.model.flops_per_token("prefill", prompt) / (1979e12 * 8 * dur * k)
    p = H200.memory_bound_w + k * (H200.compute_bound_w - H200.memory_bound_w) * min(1.0, u / 0.5)
    assert e["gpu_J"] == pytest.approx(H200.idle_w * 16 * T + 8 * dur * (p - H200.idle_w))
    assert e["workers"][pid]["busy_s"] == pytest.approx(dur)
    assert e["utilisation_by_role"]["prefill"] == pytest.approx(u)
