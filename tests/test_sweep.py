"""rackbed.sim.sweep: expansion, keys, resumability, invalid points recorded (not crashed on), the Ray import guard, CLI."""

from __future__ import annotations

import json
import sys

import pytest

from rackbed.sim import sweep as sw
from rackbed.topology.errors import UserError

# A tiny, fast scenario: ~12 requests over 3 s on an NVL72, so each point simulates in well under a second.
BASE = {
    "kind": "serving", "topology": "gb200-nvl72", "model": "qwen3-235b-a22b", "weight_format": "mxfp8",
    "prefill": {"tp": 4, "ep": 4, "replicas": 1}, "decode": {"ep": 8, "replicas": 1, "max_batch_per_rank": 16},
    "mtp": {"draft_k": 1, "accept_p": 0.8, "draft": {"kind": "mtp", "layers": 1}},
    "workload": {"kind": "synthetic", "arrival": {"kind": "poisson", "rate_per_s": 4},
                 "prompt": {"kind": "fixed", "tokens": 1000}, "output": {"kind": "fixed", "tokens": 40},
                 "duration_s": 3},
    "slo": {"ttft_s": 2.0, "tpot_s": 0.05}, "sim": {"decision_log": False},
}


def spec(grid=None, points=None, name="t"):
    return sw.parse_sweep({"name": name, "scenario": BASE, "grid": grid or {}, "points": points or []}, "t.yaml")


def test_expansion_grid_times_points_and_dotted_paths():
    s = spec({"decode.ep": [8, 16], "mtp.draft_k": [0, 1, 2]},
             [{"topology": "gb200-nvl72"}, {"workload.arrival.rate_per_s": 2}])
    assert sw.n_points(s) == 12
    pts = sw.expand(s)
    assert len(pts) == 12 and [p.index for p in pts] == list(range(12))
    p = pts[11]
    assert p.overrides == {"workload.arrival.rate_per_s": 2, "decode.ep": 16, "mtp.draft_k": 2}
    assert p.scenario["decode"]["ep"] == 16 and p.scenario["mtp"]["draft_k"] == 2
    assert p.scenario["workload"]["arrival"]["rate_per_s"] == 2
    assert p.scenario["decode"]["replicas"] == 1  # untouched fields keep the base's value
    assert len({p.key for p in pts}) == 12


def test_key_ignores_name_and_is_stable_and_sensitive():
    a = sw.expand(spec({"decode.ep": [8]}, name="one"))[0]
    b = sw.expand(spec({"decode.ep": [8]}, name="two"))[0]
    c = sw.expand(spec({"decode.ep": [16]}, name="one"))[0]
    assert a.key == b.key and a.key != c.key
    assert len(a.key) == sw.KEY_HEX and int(a.key, 16) >= 0
    # the key is of the fully expanded scenario: giving a default explicitly does not change it
    d = sw.expand(spec({"decode.page_tokens": [64]}))[0]
    e = sw.expand(spec({"decode.ep": [8]}))[0]
    assert d.key == e.key


def test_set_path_and_spec_errors_are_one_line():
    d: dict = {"a": {"b": 1}, "n": None, "x": 3}
    sw.set_path(d, "a.c", 2)
    sw.set_path(d, "n.m", 5)
    assert d == {"a": {"b": 1, "c": 2}, "n": {"m": 5}, "x": 3}
    with pytest.raises(UserError, match="x is a value"):
        sw.set_path(d, "x.y", 1)
    with pytest.raises(UserError, match=r"t.yaml: grid: decode.epp: decode has no field 'epp'"):
        spec({"decode.epp": [1]})
    with pytest.raises(UserError, match=r"points\[0\].decode.ep: also a grid axis"):
        spec({"decode.ep": [8]}, [{"decode.ep": 16}])
    with pytest.raises(UserError, match="grid.decode.ep: expected a non-empty list"):
        spec({"decode.ep": []})
    with pytest.raises(UserError, match="unknown key"):
        sw.parse_sweep({"scenario": BASE, "gird": {}}, "t.yaml")
    with pytest.raises(UserError, match="base: model"):
        sw.parse_sweep({"scenario": {**BASE, "model": 3}}, "t.yaml")


def test_invalid_points_are_recorded_not_crashed_on(tmp_path):
    # ep=0 fails the schema (parsed in the parent); ep=128 fails the build (wider than the NVLink domain, in the
    # worker); ep=8 runs
    s = spec({"decode.ep": [0, 128, 8]})
    run = sw.run_points(sw.expand(s), tmp_path / "r.jsonl", jobs=1, progress=False)
    st = [r["status"] for r in run.records]
    assert st == ["invalid", "invalid", "ok"], run.records
    r0, r1, r2 = run.records
    assert "decode.ep" in r0["reason"] and "greater than or equal to 1" in r0["reason"]
    assert "group of 128 GPUs exceeds one 72-GPU NVLink domain" in r1["reason"]
    assert all("\n" not in r["reason"] for r in (r0, r1))
    s2 = r2["summary"]
    assert s2["done"] == s2["requests"] > 0 and s2["tokens_per_s_per_gpu"] > 0
    assert run.counts == {"ok": 1, "invalid": 2, "error": 0}


def test_resumable_skips_done_points_and_repairs_a_torn_line(tmp_path):
    out = tmp_path / "r.jsonl"
    pts = sw.expand(spec({"decode.ep": [8, 16], "mtp.draft_k": [0, 1]}))
    first = sw.run_points(pts, out, jobs=1, progress=False)
    assert first.ran == 4 and first.skipped == 0
    again = sw.run_points(pts, out, jobs=1, progress=False)
    assert again.ran == 0 and again.skipped == 4
    assert len(out.read_text().splitlines()) == 4
    # a sweep killed mid-way: two whole records and a torn third line survive
    lines = out.read_text().splitlines()
    out.write_text(lines[0] + "\n" + lines[1] + "\n" + lines[2][: len(lines[2]) // 2])
    resumed = sw.run_points(pts, out, jobs=1, progress=False)
    assert resumed.ran == 2 and resumed.skipped == 2
    recs = sw.read_results(out)
    assert sorted(r["key"] for r in recs) == sorted(p.key for p in pts)
    # re-simulated points reproduce the first run's metrics exactly (deterministic per seed)
    by_first = {r["key"]: r for r in first.records}
    for r in resumed.records:
        assert r["metrics"] == by_first[r["key"]]["metrics"]


def test_error_records_are_retried(tmp_path):
    out = tmp_path / "r.jsonl"
    pts = sw.expand(spec({"decode.ep": [8]}))
    out.write_text(json.dumps({"key": pts[0].key, "status": "error", "reason": "boom"}) + "\n")
    run = sw.run_points(pts, out, jobs=1, progress=False)
    assert run.ran == 1 and run.records[0]["status"] == "ok"


def test_a_point_past_its_limit_is_a_timeout_record_retried_only_under_a_larger_limit(tmp_path):
    out = tmp_path / "r.jsonl"
    pts = sw.expand(spec({"decode.ep": [8]}))
    run = sw.run_points(pts, out, jobs=1, progress=False, limit_s=1e-4)
    rec = run.records[0]
    assert (rec["status"], rec["limit_s"]) == ("timeout", 1e-4) and "limit of 0.0001 s" in rec["reason"]
    assert run.counts["timeout"] == 1
    again = sw.run_points(pts, out, jobs=1, progress=False, limit_s=1e-4)      # settled: not retried
    assert again.ran == 0 and again.skipped == 1
    larger = sw.run_points(pts, out, jobs=1, progress=False, limit_s=600.0)
    assert larger.ran == 1 and larger.records[0]["status"] == "ok"
    with pytest.raises(UserError, match="--point-limit"):
        sw.run_points(pts, out, jobs=1, progress=False, limit_s=0.0)


def test_process_pool_matches_in_process(tmp_path):
    pts = sw.expand(spec({"decode.ep": [8, 16], "mtp.draft_k": [1]}))
    a = sw.run_points(pts, tmp_path / "a.jsonl", jobs=1, progress=False)
    b = sw.run_points(pts, tmp_path / "b.jsonl", jobs=2, progress=False, start_method="fork")
    assert [r["metrics"] for r in a.records] == [r["metrics"] for r in b.records]
    assert len({r["pid"] for r in b.records}) >= 1


def test_ray_path_is_guarded_by_the_import(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # makes `import ray` raise ImportError
    out = tmp_path / "r.jsonl"
    with pytest.raises(UserError, match="ray is not installed"):
        sw.run_points(sw.expand(spec({"decode.ep": [8]})), out, ray_address="ray://nowhere:10001", progress=False)
    assert not out.exists()


def test_cost_model_reuse_gives_identical_results(tmp_path):
    # two rates on the same plans: the second reuses the first's decode memo; a fresh process gives the same
    pts = sw.expand(spec({"workload.arrival.rate_per_s": [4, 6]}))
    sw._COST_MODELS.clear()
    warm = [sw.run_point(sw._payload(p)) for p in pts]
    sw._COST_MODELS.clear()
    cold = sw.run_point(sw._payload(pts[1]))
    assert warm[1]["metrics"] == cold["metrics"]


def test_cli_sweep_writes_results_and_report(tmp_path, capsys):
    import yaml

    from rackbed.engine.cli.main import main

    spec_path = tmp_path / "s.yaml"
    spec_path.write_text(yaml.safe_dump({"kind": "sweep", "name": "cli", "scenario": BASE,
                                         "grid": {"decode.ep": [8, 128]}}))
    out = tmp_path / "out"
    assert main(["sweep", str(spec_path), "--out", str(out), "--jobs", "1", "--no-progress"]) == 0
    assert len(sw.read_results(out / "results.jsonl")) == 2
    html = (out / "report.html").read_text()
    assert "data:image/png;base64," in html and "exceeds one 72-GPU NVLink domain" in html
    md = (out / "report.md").read_text()
    assert "pareto.png" in md and "where the step time goes" in md
    assert main(["sweep", str(tmp_path / "missing.yaml")]) == 2
    err = capsys.readouterr().err
    assert "no such sweep spec" in err and len(err.strip().splitlines()) == 1


def test_shipped_sweep_specs_parse():
    for p in sorted(sw.SWEEPS_DIR.glob("*.yaml")):
        import yaml

        if yaml.safe_load(p.read_text()).get("kind", "sweep") == "sweep":
            s = sw.load_sweep(p)
            assert sw.n_points(s) >= 1
    assert sw.n_points(sw.load_sweep("bench-1000")) == 1000


@pytest.mark.slow
@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_every_start_method_gives_the_in_process_records(tmp_path, method):
    """Pool workers started by a fork server have the fork server for their operating-system parent; they must not
    take that for their parent's death and exit (every point then failed with BrokenProcessPool). `fork` is the
    test above."""
    pts = sw.expand(spec({"decode.ep": [8, 16], "mtp.draft_k": [1]}))
    a = sw.run_points(pts, tmp_path / "a.jsonl", jobs=1, progress=False)
    b = sw.run_points(pts, tmp_path / "b.jsonl", jobs=2, progress=False, start_method=method)
    assert [r["status"] for r in b.records] == ["ok", "ok"]
    assert [r["metrics"] for r in a.records] == [r["metrics"] for r in b.records]
