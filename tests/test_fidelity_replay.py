"""The recorded real H200 runs of the fidelity matrix (``results/h200/fidelity``), re-simulated from their own
scenario files with the shipped engine calibrations: an error may not grow past the value recorded when the
matrix was made (``fidelity.json``), beyond rounding. A change to the scheduler, the cost model or a calibration
that moves the simulation away from these measurements fails here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from lane import first_in_lane

ROOT = Path(__file__).resolve().parents[1] / "results" / "h200" / "fidelity"
RECORD = ROOT / "fidelity.json"
CHECKS = json.loads(RECORD.read_text())["checks"] if RECORD.exists() else []
#: slack over the recorded |error| (floating-point and library noise, not a budget for drift)
SLACK = 0.005


@pytest.mark.parametrize("rec", first_in_lane(CHECKS, ids=lambda c: Path(c["run"]).name))
def test_recorded_run_error_does_not_grow(rec):
    from rackbed.sim.fidelity import check_run

    run = ROOT / Path(rec["run"]).name
    now = check_run(run)
    assert now["engine_calibration"] == rec["engine_calibration"], "the simulation picks another engine calibration"
    for old, new in zip(rec["rows"], now["rows"]):
        assert old["metric"] == new["metric"]
        if old["rel_error"] is None:
            continue
        assert abs(new["rel_error"]) <= abs(old["rel_error"]) + SLACK, \
            f"{run.name} {new['metric']}: {new['rel_error']:+.1%}, recorded {old['rel_error']:+.1%}"


def test_the_matrix_has_recorded_runs():
    assert CHECKS, f"{RECORD}: no recorded checks"
    for c in CHECKS:
        assert (ROOT / Path(c["run"]).name / "real.json").exists(), c["run"]
