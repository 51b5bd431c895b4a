"""Verdicts of the figure scenarios (sim/verdicts.py): every shipped fig_* states a criterion and yields
``reproduced`` or ``not reproduced``; the verdict follows the checks' bands (hypothesis) and flips when a
figure's result is pushed across its criterion."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rich.console import Console

from rackbed import scenarios
from rackbed.sim.figures import compute_figure, figure_verdict, load_figure, run_figure
from rackbed.sim.verdicts import NOT_REPRODUCED, REPRODUCED, Check, Verdict, check_value, judge, met
from rackbed.topology.errors import UserError

ROOT = Path(__file__).resolve().parents[1]
FIGS = sorted(p.stem for p in (ROOT / "scenarios").glob("fig_*.yaml"))
#: figures too slow to price in a test (about a minute): judged on their recorded JSON instead
RECORDED = {"fig_wide_ep_study": ROOT / "results" / "models" / "fig_wide_ep_study.json"}
#: what each shipped figure gives today (docs/MODELS.md and sim/costs/README.md explain the two that differ)
EXPECTED = {name: REPRODUCED for name in FIGS} | {"fig_allreduce_nvls": NOT_REPRODUCED,
                                                 "fig_grouped_gemm": NOT_REPRODUCED}

_CACHE: dict[str, tuple] = {}


def _measured(name: str):
    """(scenario, measures, verdict) of a shipped figure, priced once per test session."""
    if name not in _CACHE:
        from rackbed.sim.verdicts import figure_measures

        sc = load_figure(scenarios.resolve(name))
        if name in RECORDED:
            doc = json.loads(RECORDED[name].read_text())
            rows, extra = doc["rows"], doc
            v = figure_verdict(sc, rows, extra)
        else:
            res = compute_figure(sc)
            rows, extra, v = res.rows, res.extra, res.verdict
        _CACHE[name] = (sc, figure_measures(sc.figure, rows, extra), v)
    return _CACHE[name]


# -------------------------------------------------------------------------------------------- the function

finite = st.floats(-1e6, 1e6, allow_nan=False, allow_infinity=False)


@given(v=finite, lo=st.one_of(st.none(), finite), hi=st.one_of(st.none(), finite))
def test_met_is_the_closed_band(v, lo, hi):
    assert met(v, lo, hi) == ((lo is None or v >= lo) and (hi is None or v <= hi))


@given(lo=st.one_of(st.none(), finite), hi=st.one_of(st.none(), finite),
       bad=st.sampled_from([math.nan, math.inf, -math.inf]))
def test_a_value_that_is_not_a_number_meets_nothing(lo, hi, bad):
    assert not met(bad, lo, hi)


@st.composite
def _verdicts(draw):
    """A verdict of 1-4 checks on measures m0..m3 (some over d0..d3), and measures inside every band."""
    checks, measures = [], {}
    for i in range(draw(st.integers(1, 4))):
        lo = draw(st.one_of(st.none(), st.floats(-100, 100)))
        width = draw(st.floats(0.01, 100))
        hi = draw(st.one_of(st.none(), st.just(None if lo is None else lo + width)))
        if lo is None and hi is None:
            hi = draw(st.floats(-100, 100))
        over = draw(st.booleans())
        den = draw(st.floats(0.1, 50)) if over else 1.0
        if lo is not None and hi is not None:
            inside = (lo + hi) / 2
        else:
            inside = lo + 1 if lo is not None else hi - 1
        measures[f"m{i}"] = inside * den
        if over:
            measures[f"d{i}"] = den
        checks.append(Check(measure=f"m{i}", over=f"d{i}" if over else None, min=lo, max=hi))
    return Verdict(criterion="test", checks=tuple(checks)), measures


@settings(max_examples=200, deadline=None)
@given(vm=_verdicts(), which=st.integers(0, 3), side=st.sampled_from(["below", "above"]),
       by=st.floats(1e-3, 1e3))
def test_verdict_flips_across_a_band(vm, which, side, by):
    """Every check met: reproduced. One value pushed past one of its bounds (by any margin): not reproduced;
    pushed back onto the bound (bounds are inclusive): reproduced again."""
    verdict, measures = vm
    assert judge(verdict, measures)["verdict"] == REPRODUCED
    c = verdict.checks[which % len(verdict.checks)]
    bound = c.min if side == "below" else c.max
    if bound is None:
        bound = c.max if c.min is None else c.min
        side = "above" if c.min is None else "below"
    den = measures[c.over] if c.over else 1.0
    pushed = dict(measures, **{c.measure: (bound - by if side == "below" else bound + by) * den})
    out = judge(verdict, pushed)
    assert out["verdict"] == NOT_REPRODUCED
    assert [r["met"] for r in out["checks"]].count(False) == 1
    back = dict(measures, **{c.measure: bound * den})
    assert math.isclose(check_value(c, back), bound, rel_tol=1e-12, abs_tol=1e-12)
    if met(check_value(c, back), c.min, c.max):  # the ratio may round an ulp past the bound
        assert judge(verdict, back)["verdict"] == REPRODUCED


def test_unknown_measure_is_one_line():
    v = Verdict(criterion="x", checks=(Check(measure="H200.nvls_cut_pct", over="GB200.nvls_us", min=1),))
    with pytest.raises(UserError, match=r"^fig: verdict\.checks\[0\]\.over: 'GB200\.nvls_us' is not a "
                                        r"measure of this figure \(e\.g\. 'GB200\.nvls_cut_pct'\)$"):
        judge(v, {"H200.nvls_cut_pct": 2.0, "GB200.nvls_cut_pct": -12.0}, "fig: verdict")


@pytest.mark.parametrize("patch,match", [
    ({"checks": [{"measure": "H200.nvls_cut_pct"}]},
     r"verdict\.checks\[0\]: .*a check needs min, max or both"),
    ({"checks": [{"measure": "H200.nvls_cut_pct", "min": 2, "max": 1}]}, r"min \(2\) must be <= max \(1\)"),
    ({"checks": []}, r"verdict\.checks"),
    ({"criterion": ""}, r"verdict\.criterion"),
    ({"checks": [{"measure": "H200.nvls_cut_pct", "min": 1, "typo": 2}]}, r"typo"),
])
def test_bad_verdict_is_a_one_line_user_error(tmp_path, patch, match):
    import yaml

    data = yaml.safe_load(scenarios.resolve("fig_allreduce_nvls").read_text())
    data["verdict"] = {**data["verdict"], **patch}
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(data))
    with pytest.raises(UserError, match=match) as ei:
        load_figure(bad)
    assert "\n" not in str(ei.value) and str(ei.value).startswith(str(bad))


def test_a_misspelt_measure_in_a_figure_file_is_a_user_error(tmp_path):
    import yaml

    data = yaml.safe_load(scenarios.resolve("fig_ep_prefill_comm").read_text())
    data["verdict"]["checks"][0]["measure"] = "GB200/ep5.total_us"
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(data))
    with pytest.raises(UserError,
                       match=r"verdict\.checks\[0\]\.measure: 'GB200/ep5\.total_us' is not a measure"):
        compute_figure(load_figure(bad))


# --------------------------------------------------------------------------------------------- the figures


def test_every_figure_scenario_states_a_criterion():
    assert len(FIGS) >= 11
    for name in FIGS:
        sc = load_figure(scenarios.resolve(name))
        assert sc.verdict is not None and sc.verdict.checks, name


@pytest.mark.parametrize("name", FIGS)
def test_every_figure_yields_its_verdict(name):
    sc, measures, v = _measured(name)
    assert v["verdict"] == EXPECTED[name], v
    assert v["criterion"] == sc.verdict.criterion and len(v["checks"]) == len(sc.verdict.checks)
    assert v["verdict"] == (REPRODUCED if all(c["met"] for c in v["checks"]) else NOT_REPRODUCED)


def _push(c: Check, measures: dict, inside: bool) -> dict:
    """``measures`` with the numerator of ``c`` moved so that ``c``'s value lies just inside / just outside
    its band (a relative 1e-3 of the bound past it)."""
    den = measures[c.over] if c.over else 1.0
    assert den, c
    if inside:
        if c.min is not None and c.max is not None:
            t = (c.min + c.max) / 2
        elif c.min is not None:
            t = c.min + 1e-3 * max(abs(c.min), 1)
        else:
            t = c.max - 1e-3 * max(abs(c.max), 1)
    else:
        t = c.max + 1e-3 * max(abs(c.max), 1) if c.max is not None else c.min - 1e-3 * max(abs(c.min), 1)
    return dict(measures, **{c.measure: t * den})


@pytest.mark.parametrize("name", FIGS)
def test_verdict_flips_when_the_result_crosses_the_criterion(name):
    """From the figure's own numbers: every missed check pushed just inside its band gives ``reproduced``;
    from there any one check pushed just outside gives ``not reproduced``."""
    sc, measures, v = _measured(name)
    inside = dict(measures)
    for c, r in zip(sc.verdict.checks, v["checks"]):
        if not r["met"]:
            inside = _push(c, inside, True)
    assert judge(sc.verdict, inside)["verdict"] == REPRODUCED
    for c in sc.verdict.checks:
        out = judge(sc.verdict, _push(c, inside, False))
        assert out["verdict"] == NOT_REPRODUCED, c.label


def test_run_prints_the_verdict_and_writes_it(tmp_path):
    console = Console(file=io.StringIO(), width=200)
    doc = run_figure(scenarios.resolve("fig_ep_prefill_comm"), tmp_path, console=console)
    text = console.file.getvalue()
    assert "verdict: reproduced (criterion: dispatch + combine on GB200" in text
    assert text.count("  met    ") == 3
    on_disk = json.loads((tmp_path / "fig_ep_prefill_comm.json").read_text())
    assert on_disk["verdict"] == doc["verdict"] and on_disk["verdict"]["verdict"] == REPRODUCED
    assert [c["check"] for c in on_disk["verdict"]["checks"]][0] == "GB200/ep4.total_us / H200/ep4.total_us"


def test_recorded_figures_carry_their_verdict():
    """The figure JSONs under results/models carry the verdict a rerun gives."""
    for p in sorted((ROOT / "results" / "models").glob("fig_*.json")):
        doc = json.loads(p.read_text())
        sc = load_figure(scenarios.resolve(p.stem))
        if p.stem in RECORDED:
            want = figure_verdict(sc, doc["rows"], doc)
        else:
            want = _measured(p.stem)[2]
        assert doc.get("verdict") == want, p.name
