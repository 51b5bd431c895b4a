"""The GPU power model against measured draw: ``rackbed validate --power FILE`` (sim.power_check)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as hs

from rackbed.engine.cli.main import main
from rackbed.sim.power_check import check_power, read_power_file
from rackbed.topology.errors import UserError
from rackbed.topology.specs import GPUS

FIXTURE = Path(__file__).parent / "data" / "power_h200_synthetic.json"
H200 = GPUS["H200-SXM"]


def test_fixture_by_hand():
    r = check_power(read_power_file(FIXTURE), H200)
    pw = H200.power
    busy = pw.memory_bound_w + 0.9 * (pw.compute_bound_w - pw.memory_bound_w) * (0.02 / 0.5)
    want = 0.25 * pw.idle_w + 0.75 * (pw.idle_w + 0.6 * (busy - pw.idle_w))
    assert r["predicted_mean_w"] == pytest.approx(want)
    assert r["measured_mean_w"] == pytest.approx(0.25 * 80 + 0.75 * 330)
    assert r["rel_error"] == pytest.approx((want - r["measured_mean_w"]) / r["measured_mean_w"])
    assert r["samples"] == 200 and r["busy_from"] == "samples' util"


def test_without_util_the_steps_give_the_busy_share(tmp_path):
    doc = {"samples": [{"t": 0, "power_w": 300}, {"t": 10, "power_w": 300}],
           "steps": [{"start_s": 1, "dur_s": 2}, {"start_s": 2, "dur_s": 2}, {"start_s": -5, "dur_s": 6}]}
    p = tmp_path / "p.json"
    p.write_text(json.dumps(doc))
    r = check_power(read_power_file(p), H200)
    assert r["busy_fraction"] == pytest.approx(0.4)  # [0, 1] + [1, 4] of the 10 s window (overlaps once)
    pw = H200.power
    assert r["predicted_mean_w"] == pytest.approx(pw.idle_w + 0.4 * (pw.memory_bound_w - pw.idle_w))


@given(hs.lists(hs.floats(0, 100), min_size=1, max_size=20), hs.floats(0, 5), hs.floats(0, 1))
def test_prediction_between_idle_and_peak_and_monotone_in_util(utils, u, kf):
    def pred(us):
        data = {"samples": [(float(i), 300.0, x) for i, x in enumerate(us)], "steps": [(0.0, 1.0, u, kf)],
                "gpu": None}
        return check_power(data, H200)["predicted_mean_w"]

    p = pred(utils)
    assert H200.power.idle_w - 1e-9 <= p <= H200.power.compute_bound_w + 1e-9
    assert pred([min(100.0, x + 10) for x in utils]) >= p - 1e-9


@pytest.mark.parametrize("doc,needle", [
    ({"samples": []}, "samples: expected a non-empty list"),
    ({"samples": [{"t": 0}]}, "samples[0]: expected a mapping with t and power_w"),
    ({"samples": [{"t": 0, "power_w": 100, "util": 120}]}, "samples[0].util: a percentage"),
    ({"samples": [{"t": 0, "power_w": -1}]}, "samples[0].power_w"),
    ({"samples": [{"t": 0, "power_w": 100}], "steps": [{"start_s": 0}]}, "steps[0]: expected a mapping"),
    ({"samples": [{"t": 0, "power_w": 100}], "stpes": []}, "stpes: unknown key"),
])
def test_bad_files_fail_in_one_line(tmp_path, doc, needle):
    p = tmp_path / "p.json"
    p.write_text(json.dumps(doc))
    with pytest.raises(UserError, match=None) as exc:
        read_power_file(p)
    assert needle in str(exc.value) and "\n" not in str(exc.value) and "p.json" in str(exc.value)


def test_cli(tmp_path, capsys):
    out = tmp_path / "v.json"
    assert main(["validate", "--power", str(FIXTURE), "--out", str(out)]) == 0
    assert "error" in capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert doc["power"]["gpu"] == "H200-SXM" and doc["power"]["rel_error"] is not None
    bad = tmp_path / "b.json"
    bad.write_text(json.dumps({"samples": [{"t": 0, "power_w": 100}]}))  # no util, no steps
    assert main(["validate", "--power", str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "util" in err[0]


def test_nvidia_smi_csv_and_run_window(tmp_path, capsys):
    """An nvidia-smi CSV read as samples; --power-run keeps the serving window of a `rackbed real` folder (its end
    from versions.date, back by its duration); a malformed line or an empty window fails in one line."""
    from rackbed.sim.power_check import read_smi_csv

    lines = [f"2026/12/04 05:33:{s:02d}.{ms:03d}, {100 + s}.0, {s}, 5, 1980, 3201"
             for s in range(0, 40) for ms in (0, 500)]
    csv = tmp_path / "p.csv"
    csv.write_text("\n".join(lines) + "\n")
    run = tmp_path / "run"
    run.mkdir()
    (run / "real.json").write_text(json.dumps({"versions": {"date": "2026-12-04T05:33:30+00:00"},
                                               "metrics": {"throughput": {"duration_s": 10.0}}}))
    whole = read_smi_csv(csv)["samples"]
    assert len(whole) == 80 and whole[1]["t"] - whole[0]["t"] == pytest.approx(0.5)
    win = read_smi_csv(csv, run)["samples"]
    assert len(win) == 21 and {s["power_w"] for s in win} == {100.0 + s for s in range(20, 31)}
    out = tmp_path / "v.json"
    assert main(["validate", "--power", str(csv), "--power-run", str(run), "--topology", "hgx-h200",
                 "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["power"]["samples"] == 21 and doc["power"]["measured_mean_w"] == pytest.approx(125.0, abs=0.3)
    capsys.readouterr()
    bad = tmp_path / "bad.csv"
    bad.write_text("2026/12/04 05:33:00.000, 100.0, 5\nnot a sample line\n")
    (run / "real.json").write_text(json.dumps({"versions": {"date": "2027-01-01T00:00:00+00:00"},
                                               "metrics": {"throughput": {"duration_s": 1.0}}}))
    for f, extra, needle in ((bad, [], "bad.csv:2"), (csv, ["--power-run", str(run)], "no sample inside")):
        assert main(["validate", "--power", str(f), *extra]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and needle in err[0], err
