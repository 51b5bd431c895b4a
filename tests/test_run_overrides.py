"""``rackbed run`` overrides (sim/overrides.py), the closed loop (engine.core.workload.ClosedLoop in engine.loop.runloop),
topology resizing (topology.presets.resized) and the default scenario serving on every worker."""

from __future__ import annotations

import math
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rackbed import scenarios, topology
from rackbed.engine.cli.main import main
from rackbed.sim.overrides import apply_overrides, parse_length
from rackbed.sim.scenario import build, load_scenario, parse_scenario, simulate_scenario
from rackbed.topology.errors import UserError
from rackbed.topology.presets import resized

SMALL = {
    "kind": "serving", "name": "closed", "topology": "hgx-h200*2", "model": "qwen3-30b-a3b",
    "weight_format": "fp8_block", "prefill": {"tp": 2, "ep": 2, "replicas": 2},
    "decode": {"ep": 4, "replicas": 2, "max_batch_per_rank": 32},
    "workload": {"kind": "synthetic", "arrival": {"kind": "poisson", "rate_per_s": 50.0},
                 "prompt": {"kind": "uniform", "lo": 200, "hi": 3000}, "output": {"kind": "uniform", "lo": 5, "hi": 80},
                 "n_requests": 40},
}


@pytest.mark.slow
def test_default_scenario_every_worker_serves():
    """The default demo loads the rack: every prefiller and every decoder group serves requests, and tokens/s per
    GPU divide by the GPUs the groups hold."""
    sc = load_scenario(scenarios.resolve("nvl72-default"))
    b, res = simulate_scenario(sc)
    f = res.row_fields
    ip, idd = f.index("prefiller"), f.index("decoder")
    per_p = Counter(r[ip] for r in res.rows)
    per_d = Counter(r[idd] for r in res.rows)
    assert {g.id for g in b.deployment.prefillers} <= {k for k, v in per_p.items() if v > 0}, per_p
    assert {g.id for g in b.deployment.decoders} <= {k for k, v in per_d.items() if v > 0}, per_d
    # no decoder is a bystander: the least loaded serves at least a fifth of an even share
    n_d = len(b.deployment.decoders)
    assert min(per_d[g.id] for g in b.deployment.decoders) >= len(res.rows) / n_d / 5, per_d
    th = res.metrics["throughput"]
    used = sum(len(g.gpus) for g in (*b.deployment.prefillers, *b.deployment.decoders))
    assert th["mean_gpus"] == pytest.approx(used)
    assert th["output_tokens_per_s_per_gpu"] == pytest.approx(th["output_tokens_per_s"] / used, rel=1e-9)
    assert res.metrics["utilisation"]["prefill"] > 0.5 and res.metrics["utilisation"]["decode"] > 0.5


_HW = {"gb300-nvl72": "gb300", "hgx-b300": "b300", "hgx-h100": "h100", "hgx-h800": "h800"}


@pytest.fixture(scope="module")
def hw_runs():
    """The default Qwen3-235B scenario on each newer preset, fp8, 24 requests: the full rack on GB300 NVL72, one
    TP4/EP4 prefiller + one EP4 decoder on the 8-GPU boards."""
    base = load_scenario(scenarios.resolve("nvl72-default"))
    out = {}
    for topo in _HW:
        over = {} if topo.endswith("nvl72") else {"prefill": base.prefill.model_copy(update={"replicas": 1}),
                                                   "decode": base.decode.model_copy(update={"ep": 4, "replicas": 1})}
        wl = base.workload.model_copy(update={"max_requests": 24, "rate_per_s": 4.0})
        out[topo] = simulate_scenario(base.model_copy(update={"topology": topo, "weight_format": "fp8",
                                                              "workload": wl, **over}))
    return out


@pytest.mark.parametrize("topo", list(_HW))
def test_newer_presets_serve_the_default_scenario(hw_runs, topo):
    """Each preset runs the scenario end to end, priced by its own imported calibration."""
    b, res = hw_runs[topo]
    assert b.calibration_note.startswith(f"calibrated (trtllm stack, measured tables): {b.topology.gpu_spec(0).name} "
                                         f"from calibration/{_HW[topo]}-trtllm.json.gz")
    req = res.metrics["requests"]
    assert req["total"] == 24 and req["done"] + req["rejected"] == 24 and req["done"] >= 22
    lat = res.metrics["latency_s"]
    assert 0 < lat["tpot"]["p50"] < 0.2 and 0 < lat["ttft"]["p50"] < 30


def test_h800_is_no_faster_than_h100(hw_runs):
    """Same kernels, same deployment, under half the NVLink bandwidth: H800's decode steps take no less time than
    H100's."""
    p50 = {t: hw_runs[t][1].metrics["latency_s"]["tpot"]["p50"] for t in ("hgx-h100", "hgx-h800")}
    assert p50["hgx-h800"] >= p50["hgx-h100"]


# ------------------------------------------------------------------------------------------------ closed loop


@pytest.fixture(scope="module")
def small_built():
    return build(parse_scenario(SMALL))


def _in_flight_profile(res):
    f = res.row_fields
    ia, ie = f.index("arrival_s"), f.index("end_s")
    ev = sorted([(r[ie], -1) for r in res.rows] + [(r[ia], 1) for r in res.rows])  # ends first at equal times
    c = peak = 0
    for _, d in ev:
        c += d
        peak = max(peak, c)
    return peak, sorted(r[ia] for r in res.rows), sorted(r[ie] for r in res.rows)


@settings(max_examples=6, deadline=None)
@given(c=st.integers(1, 12), paced=st.booleans())
def test_closed_loop_caps_in_flight_and_sends_on_each_finish(small_built, c, paced):
    sc = small_built.scenario
    sc = sc.model_copy(update={"workload": sc.workload.model_copy(update={"max_concurrency": c, "paced": paced})})
    _, res = simulate_scenario(sc, built=small_built)
    peak, arrivals, ends = _in_flight_profile(res)
    assert len(res.rows) == 40 and res.metrics["requests"]["done"] == 40
    assert peak <= c
    if not paced:
        assert arrivals[:c] == [0.0] * c
        # every later send is the moment an earlier request resolved: the loop is never idle below C
        assert all(a in set(ends) for a in arrivals[c:])
        assert peak == min(c, 40)
    _, res2 = simulate_scenario(sc, built=small_built)
    assert res2.rows == res.rows  # deterministic


def test_unbounded_closed_loop_is_the_open_loop(small_built):
    """A cap no run reaches changes nothing: paced by the arrivals, the same rows as without it."""
    sc = small_built.scenario
    _, open_ = simulate_scenario(sc, built=small_built)
    wl = sc.workload.model_copy(update={"max_concurrency": 1000, "paced": True})
    _, closed = simulate_scenario(sc.model_copy(update={"workload": wl}), built=small_built)
    assert closed.rows == open_.rows


# ------------------------------------------------------------------------------------------------ overrides


@settings(max_examples=30, deadline=None)
@given(mean=st.integers(1, 100_000), std=st.integers(0, 50_000))
def test_mean_std_is_a_lognormal_with_that_mean_and_std(mean, std):
    d = parse_length("--isl", f"{mean}:{std}")
    if std == 0:
        assert d == {"kind": "fixed", "tokens": mean}
        return
    s2 = d["sigma"] ** 2
    assert d["mean"] == mean
    assert mean * math.sqrt(math.expm1(s2)) == pytest.approx(std, rel=1e-9)


def test_length_forms_and_errors():
    assert parse_length("--osl", "128") == {"kind": "fixed", "tokens": 128}
    assert parse_length("--osl", "10-20") == {"kind": "uniform", "lo": 10, "hi": 20}
    for bad in ("0", "20-10", "x", "-5", "1:2:3"):
        with pytest.raises(UserError, match=r"^--osl "):
            parse_length("--osl", bad)


def test_overrides_on_a_trace_and_on_synthetic():
    sc = load_scenario(scenarios.resolve("nvl72-default"))
    o = apply_overrides(sc, rate=5.0, isl="6000:1000", concurrency=64)
    wl = o.workload
    assert wl.kind == "synthetic" and wl.arrival.rate_per_s == 5.0 and wl.prompt.kind == "lognormal"
    assert wl.output.kind == "empirical" and wl.output.name == "mooncake" and wl.n_requests == 2000
    assert wl.closed_loop() == (64, True, None)
    o = apply_overrides(sc, rate=30.0, duration_s=60.0)
    assert (o.workload.rate_per_s, o.workload.duration_s, o.workload.max_requests, o.workload.loop) == (
        30.0, 60.0, None, True)
    s = apply_overrides(parse_scenario(SMALL), concurrency=4, osl="100")
    assert s.workload.closed_loop() == (4, False, None) and s.workload.output.tokens == 100
    assert apply_overrides(parse_scenario(SMALL), rate=7.0).workload.arrival.rate_per_s == 7.0


def test_gpus_resizes_the_preset_and_scales_the_groups():
    sc = load_scenario(scenarios.resolve("nvl72-default"))
    o = apply_overrides(sc, gpus=32)
    assert o.topology == "gb200-nvl72@32" and (o.prefill.replicas, o.decode.replicas) == (4, 1)
    assert build(o).topology.n_gpus == 32
    o = apply_overrides(sc, gpus=144)
    assert o.topology == "gb200-nvl72*2" and (o.prefill.replicas, o.decode.replicas) == (12, 6)
    o = apply_overrides(sc, gpus=64, prefillers=2, decoders=2)
    assert (o.prefill.replicas, o.decode.replicas) == (2, 2)
    with pytest.raises(UserError, match=r"^--gpus 16: .* do not fit in 16 GPUs"):
        apply_overrides(sc, gpus=16)


@settings(max_examples=25, deadline=None)
@given(name=st.sampled_from(["gb200-nvl72", "hgx-h200", "hgx-b200", "hgx-h200*4", "gb200-nvl72@8", "gb300-nvl72",
                             "hgx-b300", "hgx-h100", "hgx-h800*2"]),
       n=st.integers(1, 300))
def test_resized_has_exactly_n_gpus_or_says_why(name, n):
    try:
        spec = resized(name, n)
    except UserError as exc:
        assert str(exc).startswith(f"--gpus {n}: ") and "\n" not in str(exc)
        return
    assert topology.load(spec).n_gpus == n


@pytest.mark.parametrize("argv, flag", [
    (["--gpus", "6"], "--gpus 6"), (["--isl", "abc"], "--isl abc"), (["--concurrency", "0"], "--concurrency 0"),
    (["--rate", "-1"], "--rate -1"),
])
def test_cli_errors_name_the_flag(capsys, argv, flag):
    assert main(["run", *argv, "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"rackbed: error: {flag}") and "\n" not in err


# ------------------------------------------------------------------------------------------------ plots


@settings(max_examples=30, deadline=None)
@given(st.lists(st.floats(1e-4, 1e4), min_size=2, max_size=200))
def test_log_axis_exactly_when_the_body_is_squashed(xs):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from rackbed.sim.outputs import LOG_X_SPREAD, plot_cdf, squashed

    x = np.asarray(xs)
    assert squashed(x) == (np.percentile(x, 90) * LOG_X_SPREAD < x.max())
    fig, ax = plt.subplots()
    plot_cdf(ax, x, "TPOT (ms)", slo=1.0)
    assert ax.get_xscale() == ("log" if squashed(x) else "linear")
    line = [ln for ln in ax.get_lines() if ln.get_linestyle() == "--"]
    assert line and line[0].get_xdata()[0] == 1.0 and f"{np.mean(x <= 1.0):.1%}" in line[0].get_label()
    plt.close(fig)
