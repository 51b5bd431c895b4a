"""Cross-source check (``sim.cross_source``): rackbed's shipped H200 measurements against the installed
aiconfigurator-core H200 tables, matched exactly; the committed result is what the shipped files give. CPU only
(~10 s: the parquet tables are read once per module)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rackbed.sim import cross_source as xs
from rackbed.sim.calibration.measurements import read_json
from rackbed.topology.errors import UserError

pytest.importorskip("pyarrow")
pytest.importorskip("aiconfigurator_core")

REPO = Path(__file__).resolve().parents[1]
SHIPPED_JSON = REPO / "results" / "calibration" / "cross_source_h200.json"
SHIPPED_MD = SHIPPED_JSON.with_suffix(".md")


@pytest.fixture(scope="module")
def doc():
    import os

    cwd = os.getcwd()
    os.chdir(REPO)  # the document names the measurement file as given (repository-relative)
    try:
        return xs.compare(xs.DEFAULT_MEASUREMENTS, "h200", "trtllm")
    finally:
        os.chdir(cwd)


@pytest.mark.slow
def test_structure_and_ratios(doc):
    xs.check(doc)
    assert doc["schema"] == xs.SCHEMA and doc["gpu"] == "H200-SXM" and doc["ratio"] == xs.RATIO
    assert set(doc["kinds"]) == {"gemm_bf16", "gemm_fp8", "allreduce", "attn_decode", "flash_prefill"}
    for name in xs.REQUIRED:
        assert doc["kinds"][name]["summary"]["n"] > 0, name
    for name, k in doc["kinds"].items():
        s = k["summary"]
        assert s["n"] == len(k["points"])
        if not s["n"]:
            continue
        assert s["min"] <= s["p10"] <= s["median"] <= s["p90"] <= s["max"], name
        for p in k["points"]:
            assert math.isfinite(p["ratio"]) and p["ratio"] > 0
            assert p["ratio"] == pytest.approx(p["rackbed_us"] / p["table_us"], rel=1e-3)
        # every point of a kind is counted once in its groups of each grouping
        assert sum(g["n"] for g in k["by"].values()) % s["n"] == 0
        assert k["table"]["collection_meta"].get("framework_version")


@pytest.mark.slow
def test_gemm_points_are_exact_matches_of_raw_rows(doc):
    """Each GEMM point is a measured rackbed row and a measured table row at the same (m, n, k) — nothing fitted."""
    meas = read_json(REPO / xs.DEFAULT_MEASUREMENTS)
    rows = {(r["fmt"], r["m"], r["n"], r["k"]): r["median_us"] for r in meas["rows"]
            if r.get("bench") == "gemm" and r.get("op") == "dense" and "median_us" in r}
    for name, fmt in (("gemm_bf16", "bf16"), ("gemm_fp8", "fp8")):
        k = doc["kinds"][name]
        assert {(p["n"], p["k"]) for p in k["points"]} == {(4096, 4096), (4096, 8192)}
        for p in k["points"]:
            assert p["rackbed_us"] == pytest.approx(rows[(fmt, p["m"], p["n"], p["k"])], rel=1e-4)
        # the three QKV shapes are off the table's (n, k) grid and said so
        off = {u["what"].split()[0] for u in k["unmatched"] if "not on the table's grid" in u["why"]}
        assert off == {"qkv_tp1", "qkv_tp2", "qkv_tp4"}
    assert "grouped" in doc["not_comparable"]


@pytest.mark.slow
def test_allreduce_bytes_are_twice_the_message_size(doc):
    pts = doc["kinds"]["allreduce"]["points"]
    assert {p["bytes"] for p in pts} == {2**i for i in range(12, 29)}
    assert all(p["n_ranks"] == 2 for p in pts)
    assert doc["table_repeat"]["allreduce"]["summary"]["n"] > 0


@pytest.mark.slow
def test_committed_result_is_what_the_shipped_files_give(doc):
    """results/calibration/cross_source_h200.{json,md} are this code's output on the shipped files (refresh with
    `python -m rackbed.sim.cross_source --out results/calibration/cross_source_h200.json`)."""
    shipped = json.loads(SHIPPED_JSON.read_text())
    if shipped["tables"]["package_version"] != doc["tables"]["package_version"]:
        pytest.skip("another aiconfigurator-core version is installed")
    assert xs.dumps(doc) == SHIPPED_JSON.read_text()
    assert xs.render_markdown(doc) == SHIPPED_MD.read_text()


@pytest.mark.slow
def test_bad_inputs_are_one_line_errors(tmp_path, capsys):
    bad = tmp_path / "m.json"
    bad.write_text("{")
    with pytest.raises(UserError, match=r"m\.json: not JSON"):
        xs.load_measurements(bad)
    bad.write_text(json.dumps({"schema": "rackbed.measure/1", "rows": [{}]}))
    with pytest.raises(UserError, match=r"schema: expected one of rackbed\.measure/2, got 'rackbed\.measure/1'"):
        xs.load_measurements(bad)
    bad.write_text(json.dumps({"schema": "rackbed.measure/2", "rows": []}))
    with pytest.raises(UserError, match="rows: expected a non-empty list"):
        xs.load_measurements(bad)
    # a file with no matching rows: the CLI says which kind found nothing and exits 2
    bad.write_text(json.dumps({"schema": "rackbed.measure/2", "rows": [
        {"bench": "hbm_copy", "size_bytes": 4096, "median_us": 1.0}]}))
    assert xs.main(["--measurements", str(bad), "--out", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "no gemm_bf16 row matches a table row exactly" in err
    bad.write_text(json.dumps({"schema": "rackbed.measure/2", "rows": [
        {"bench": "allreduce", "n_ranks": 2, "size_bytes": 4096, "median_us": float("nan")}]}))
    with pytest.raises(UserError, match=r"rows\[0\]\.median_us = nan; must be a finite number > 0"):
        xs.compare(bad, "h200")
    assert xs.main(["--measurements", str(bad), "--system", "tpu_v5", "--out", str(tmp_path / "x.json")]) == 2
    assert "unknown system 'tpu_v5'" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ properties

_pos = st.floats(min_value=1e-3, max_value=1e6, allow_nan=False)


@settings(max_examples=100, deadline=None)
@given(st.lists(_pos, min_size=1, max_size=40), st.floats(min_value=0.01, max_value=100), st.randoms())
def test_summary_is_ordered_scale_equivariant_and_order_free(ratios, c, rnd):
    s = xs.summarize(ratios)
    assert s["n"] == len(ratios)
    assert s["min"] <= s["p10"] <= s["median"] <= s["p90"] <= s["max"]
    shuffled = list(ratios)
    rnd.shuffle(shuffled)
    assert xs.summarize(shuffled) == s
    scaled = xs.summarize([r * c for r in ratios])
    for f in ("median", "p10", "p90", "min", "max"):
        assert scaled[f] == pytest.approx(s[f] * c, rel=2e-3)


@settings(max_examples=100, deadline=None)
@given(st.dictionaries(st.integers(0, 30), _pos, max_size=20),
       st.dictionaries(st.integers(0, 30), st.lists(_pos, min_size=1, max_size=3), max_size=20))
def test_join_matches_exactly_the_common_keys(mine, theirs):
    out = xs.join(mine, theirs)
    assert [k for k, *_ in out] == sorted(set(mine) & set(theirs))
    for key, r_us, t_us, n in out:
        assert r_us == mine[key] and n == len(theirs[key])
        assert min(theirs[key]) <= t_us <= max(theirs[key])
