"""`rackbed validate --published`: every case of the shipped suite re-simulated against its recorded error
(results/published/published.json), the suite file's one-line errors, and the decode window's token count."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from rackbed.engine.cli.main import main
from rackbed.sim.published import DEFAULT_SUITE, _decode_figure, load_suite, run_case

ROOT = Path(__file__).resolve().parent.parent
RECORDED = ROOT / "results" / "published" / "published.json"
#: how far a case's |error| may grow past its recorded value before the test fails
SLACK = 0.02

_SUITE, _SCENARIOS = load_suite(DEFAULT_SUITE)
_RECORD = {r["case"]: r for r in json.loads(RECORDED.read_text())["cases"]}


def test_record_covers_the_suite():
    assert set(_RECORD) == {c.name for c in _SUITE.cases}, "re-record: rackbed validate --published --out " \
                                                          "results/published/published.json --force"


def _spellings(v: float) -> set[str]:
    return {f"{v:,.0f}", f"{v:.4f}", f"{v / 1000:.1f}k", f"{v:,.0f}".replace(",", "")}


@pytest.mark.parametrize("case", _SUITE.cases, ids=lambda c: c.name)
def test_measured_figure_is_in_its_quote(case):
    """The figure a case compares against is written in the sentence it is quoted from."""
    assert any(s in case.measured.quote for s in _spellings(case.measured.value)), case.measured.quote


def _params():
    for c in _SUITE.cases:
        slow = _RECORD.get(c.name, {}).get("wall_s", 0) > 3.0
        yield pytest.param(c, id=c.name, marks=[pytest.mark.slow] if slow else [])


@pytest.mark.parametrize("case", list(_params()))
def test_case_error_does_not_grow(case):
    rec = _RECORD[case.name]
    row = run_case(case, _SCENARIOS[case.name])
    if rec["refused"]:
        assert row["refused"] is not None, (f"{case.name} now runs (error {row['error']:+.1%}); record it "
                                            f"and drop its refusal note")
        return
    assert row["refused"] is None, row["refused"]
    grown = abs(row["error"]) - abs(rec["error"])
    assert grown <= SLACK, (f"{case.name}: |error| {abs(row['error']):.1%} grew past the recorded "
                            f"{abs(rec['error']):.1%} (+{SLACK:.0%} allowed)")


def _write(tmp_path, text: str) -> Path:
    p = tmp_path / "suite.yaml"
    p.write_text(text)
    return p


def _one_case(**over) -> str:
    """The shipped suite's cheapest case as a one-case suite, with ``over`` replacing scenario fields."""
    import yaml

    case = next(c for c in yaml.safe_load(DEFAULT_SUITE.read_text())["cases"]
                if c["name"] == "trtllm-b200-qwen3-30b-agg")
    case["scenario"].update(over)
    return yaml.safe_dump({"kind": "published_suite", "cases": [case]}, sort_keys=False)


def _drop(*keys):
    def mutate(case: dict) -> None:
        d = case
        for k in keys[:-1]:
            d = d[k]
        del d[keys[-1]]
    return mutate


def _set(value, *keys):
    def mutate(case: dict) -> None:
        d = case
        for k in keys[:-1]:
            d = d[k]
        d[keys[-1]] = value
    return mutate


@pytest.mark.parametrize("mutate, needle", [
    (_drop("measured"), "measured"),
    (_drop("metric"), "metric"),
    (_drop("source", "url"), "url"),
    (_set("http://example.com", "source", "url"), "url"),
    (_set("per_token", "metric", "kind"), "metric.kind"),
    (_set({"ep": 2}, "scenario", "prefil"), "prefil"),
])
def test_malformed_suite_is_one_line_exit_2(tmp_path, capsys, mutate, needle):
    import yaml

    doc = yaml.safe_load(_one_case())
    mutate(doc["cases"][0])
    p = _write(tmp_path, yaml.safe_dump(doc))
    assert main(["validate", "--published", str(p)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("rackbed: error: ") and needle in err and str(p) in err


@pytest.mark.parametrize("over, needle", [
    ({"topology": "hgx-h900"}, "scenario.topology"),
    ({"model": "qwen9-1t"}, "scenario.model"),
    ({"weight_format": "fp3"}, "weight_format"),
])
def test_unknown_preset_is_one_line_exit_2(tmp_path, capsys, over, needle):
    p = _write(tmp_path, _one_case(**over))
    assert main(["validate", "--published", str(p)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and needle in err and "trtllm-b200-qwen3-30b-agg" in err


def test_case_filter_and_bad_case(tmp_path, capsys):
    assert main(["validate", "--published", "--case", "no-such-case"]) == 2
    assert "--case no-such-case" in capsys.readouterr().err
    assert main(["validate", "--case", "trtllm-b200-qwen3-30b-agg"]) == 2
    p = _write(tmp_path, _one_case())
    out = tmp_path / "out.json"
    assert main(["validate", "--published", str(p), "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert [r["case"] for r in doc["cases"]] == ["trtllm-b200-qwen3-30b-agg"]
    assert doc["cases"][0]["rackbed"] > 0 and "trtllm-b200-qwen3-30b-agg" in capsys.readouterr().out


def test_duplicate_case_names(tmp_path, capsys):
    import yaml

    doc = yaml.safe_load(_one_case())
    doc["cases"].append(doc["cases"][0])
    p = _write(tmp_path, yaml.safe_dump(doc))
    assert main(["validate", "--published", str(p)]) == 2
    assert "appears twice" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------ the decode window

_FIELDS = ("status", "output_tokens", "decode_start_s", "end_s")


def _res(requests, samples, end):
    rows = [("done", n, s, e) for n, s, e in requests]
    smp = [SimpleNamespace(t_s=t, decoding=d) for t, d in samples]
    return SimpleNamespace(rows=rows, row_fields=_FIELDS, samples=smp, sim_end_s=end,
                           groups=[("D0", "decode", 4, 0.0, float("nan"), "active")])


_req = st.tuples(st.integers(2, 500), st.floats(0, 50), st.floats(0.01, 50)).map(
    lambda x: (x[0], x[1], x[1] + x[2]))


@given(st.lists(_req, min_size=1, max_size=30), st.lists(st.integers(0, 100), min_size=1, max_size=20))
def test_decode_window_counts_every_token_once(requests, counts):
    """With every sample in the window, the window is the whole run and every decode token is counted once;
    any narrower window counts no more."""
    end = max(e for _, _, e in requests)
    step = end / len(counts)
    samples = [(i * step, c + 1) for i, c in enumerate(counts)]
    total = sum(n - 1 for n, _, _ in requests)
    whole = _decode_figure(_res(requests, samples, end), full=1e-9)
    assert whole["window_s"] == pytest.approx(end)
    assert whole["tokens_per_s_per_gpu"] * end * 4 == pytest.approx(total, rel=1e-9)
    part = _decode_figure(_res(requests, samples, end), full=0.9)
    assert part["tokens_per_s_per_gpu"] * part["window_s"] * 4 <= total * (1 + 1e-9)


def test_prefill_figure_and_cached_share():
    """A prefiller's tokens over its busy span, per GPU; a figure that counts cache hits divides by the
    computed share."""
    from rackbed.sim.driver import SPAN_PREFILL
    from rackbed.sim.published import measure

    spans = [("P0", SPAN_PREFILL, 1.0, 2.0, 8000, False), ("P0", SPAN_PREFILL, 3.0, 2.0, 8000, False),
             ("P0", SPAN_PREFILL, 5.0, 1.0, 9999, True),          # a failed batch computes nothing
             ("P0.kv0", 1, 2.0, 1.0, 7, False)]
    res = SimpleNamespace(spans=spans, groups=[("P0", "prefill", 8, 0.0, float("nan"), "active")])
    case = next(c for c in _SUITE.cases if c.name == "deepseek-h800-prefill")
    fig = measure(case, None, res)
    assert fig["tokens_per_s_per_gpu"] == pytest.approx(16000 / 4.0 / 8)
    assert fig["value"] == pytest.approx(16000 / 4.0 / 8 / 0.437 * 8)   # per node of 8, cache hits counted
