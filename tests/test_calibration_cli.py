"""`rackbed calibrate` / `rackbed validate` plumbing on the CPU (dry-run measurements, synthetic rows)."""

from __future__ import annotations

import json

import pytest

from rackbed import topology
from rackbed.engine.cli.calibrate import bench_rows
from rackbed.engine.cli.main import main
from rackbed.engine.cli.validate import validate_engine, validate_kernels
from rackbed.sim.calibrate import calibrate, dump_calibration, load_calibration_file
from rackbed.topology.errors import UserError


def test_dry_run_calibrate_then_validate(tmp_path, capsys):
    out = tmp_path / "dry.yaml"
    assert main(["calibrate", "--dry-run", "--only", "hbm", "grouped", "--out", str(out)]) == 0
    table = load_calibration_file(out)
    assert table.meta["gpu"] == "CPU-DRY-RUN" and table.meta["holdout"]
    meas = json.loads((tmp_path / "dry_measure.json").read_text())
    assert {r["bench"] for r in meas["rows"]} == {"hbm_copy", "gemm"}
    res = validate_kernels(meas, table, topology.load("h200x2"))
    # the dry-run GPU name matches no topology GPU: predictions are the uncalibrated model, rows are bookkept;
    # the driver-memcpy copies are listed but not calibration points (the elementwise copies are)
    held = [r for r in res["rows"] if r["role"] == "holdout"]
    assert len(held) == len(table.meta["holdout"])
    memcpy = {f"hbm_copy/{r['size_bytes']}" for r in meas["rows"] if r.get("kernel") == "memcpy"}
    assert memcpy and {r["row_id"] for r in res["rows"] if r["role"] != "holdout"} == memcpy
    assert not any(rid in memcpy for rid in table.meta["holdout"])
    assert validate_engine(table, None, None) is None


def test_validate_reports_holdouts_only_and_fit_rows_are_exact(tmp_path):
    rows = [{"bench": "gemm", "op": "grouped", "fmt": "bf16", "m": m, "n": 3072, "k": 4096, "n_experts": 4,
             "median_us": 30.0 + m} for m in (1, 2, 4, 8, 16, 32, 64)]
    meas = {"env": {"gpu_name": "NVIDIA H200", "date": "2026-11-29"}, "rows": rows}
    p = tmp_path / "c.yaml"
    dump_calibration(calibrate(meas), p)
    table = load_calibration_file(p)
    res = validate_kernels(meas, table, topology.load("h200x2"), include_fit=True)
    held = [r for r in res["rows"] if r["role"] == "holdout"]
    assert [r["row_id"].rsplit("/m", 1)[1] for r in held] == ["2", "16"]
    assert all(abs(r["rel_error"]) < 1e-5 for r in res["rows"] if r["role"] == "fit")
    assert res["summary"]["holdout"]["n"] == 2


def test_bench_rows_conversion():
    doc = {"suites": {"allreduce": {"world": 2, "rows": [
        {"impl": "nccl", "dtype": "bf16", "size_bytes": 8192, "graph": False, "median_us": 12.0},
        {"impl": "nccl", "dtype": "bf16", "size_bytes": 8192, "graph": True, "median_us": 9.0},
        {"impl": "peer_auto", "dtype": "bf16", "size_bytes": 8192, "graph": False, "median_us": 5.0}]}}}
    rows = bench_rows(doc, "b.json")
    assert rows == [{"bench": "allreduce", "algo": "ring", "impl": "nccl", "n_ranks": 2, "size_bytes": 8192,
                     "median_us": 9.0, "from": "b.json"}]
    with pytest.raises(UserError, match="suites"):
        bench_rows({"rows": []}, "b.json")


@pytest.mark.slow
def test_cross_validation_holds_every_inner_point_out_once(tmp_path, capsys):
    from rackbed.engine.cli.validate import cross_validate

    rows = [{"bench": "gemm", "op": "grouped", "fmt": "bf16", "m": m, "n": 3072, "k": 4096, "n_experts": 4,
             "median_us": 30.0 + m} for m in (1, 2, 4, 8, 16, 32, 64, 128)]
    rows += [{"bench": "hbm_copy", "kernel": "elementwise", "size_bytes": s, "bytes": 2 * s,
              "median_us": 1.1 + 2 * s / 4.2e6} for s in (2**18, 2**20, 2**22, 2**24, 2**26)]
    meas = {"schema": "rackbed.measure/2", "env": {"gpu_name": "NVIDIA H200", "date": "2026-11-30"}, "rows": rows}
    res = cross_validate(meas, topology.load("h200x2"), 3, echo=lambda *a: None)
    ids = [r["row_id"] for r in res["rows"]]
    assert len(ids) == len(set(ids)) == (8 - 2) + (5 - 2)  # every inner point of both curves, once
    assert {r["fold"] for r in res["rows"]} == {0, 1, 2} and len(res["folds"]) == 3
    assert sum(f["n"] for f in res["folds"]) == res["summary"]["holdout"]["n"] == 9
    with pytest.raises(UserError, match="at least 2 folds"):
        cross_validate(meas, topology.load("h200x2"), 1)
    # the command: a table, a one-line verdict, and the JSON
    mp, cp, out = tmp_path / "m.json", tmp_path / "c.yaml", tmp_path / "cv.json"
    mp.write_text(json.dumps(meas))
    dump_calibration(calibrate(meas), cp)
    assert main(["validate", "--calibration", str(cp), "--measurements", str(mp), "--cross-validate", "3",
                 "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "3-fold cross-validation, every inner point held out once; rows: 9; median" in text
    assert json.loads(out.read_text())["cross_validation"]["summary"]["holdout"]["n"] == 9
