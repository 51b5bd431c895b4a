"""engine/bench/peer_a2a.py on the CPU: the rank function end to end on a tiny model over gloo (the peer path
driven by the torch backend of kernels.moe_a2a, as tests/test_moe_a2a.py does), the summary and the kernel-bench
prediction it reads, argument checks, and the one-line exit on a machine without 2 GPUs."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from rackbed.engine.bench import peer_a2a as cpa
from rackbed.engine.real.launch import spawn_local


@pytest.mark.slow
def test_rank_function_on_cpu_checks_and_times_both_paths():
    opts = {"device": "cpu", "tiny": True, "layers": 2, "max_tokens": 32, "sizes": [1, 8],
            "extra_cases": [[40, 3], [0, 4]], "reps": 2, "inner": 1, "seed": 0}
    ranks = spawn_local(cpa._rank, 2, opts, backend="gloo", timeout_s=240)
    assert [r["rank"] for r in ranks] == [0, 1]
    assert all(r["peer_backend"] == "torch" for r in ranks)
    s = cpa.summarize(ranks, {8: {"graph": {"peer_us": 1.0, "nccl_us": 3.0, "saving_us": 2.0}}}, n_layers=2)
    cases = {tuple(c["batch_per_rank"]): c for c in s["correctness"]}
    assert set(cases) == {(1, 1), (8, 8), (40, 3), (0, 4)}
    assert all(c["ok"] for c in cases.values()), cases
    assert cases[(40, 3)]["chunks"] == 2 and cases[(1, 1)]["chunks"] == 1
    assert all(c["peer_err"] < cpa.TOL for c in cases.values())
    assert not s["ok"]  # a torch-backend run is not the kernels: the summary says so
    assert [r["B"] for r in s["timing"]] == [1, 8]
    for r in s["timing"]:
        for path in ("peer", "a2a"):
            p = r[path]
            assert p["layer_us"] > 0 and p["step_us"] > 0 and p["route_us"] > 0
            assert p["a2a_us"] == pytest.approx(p["comm_us"] - p["route_us"], abs=0.11)
        assert r["saving_layer_us"] == pytest.approx(r["a2a"]["layer_us"] - r["peer"]["layer_us"], abs=0.11)
    assert s["timing"][1]["predicted"]["graph"]["saving_us"] == 2.0 and "predicted" not in s["timing"][0]
    table = cpa.format_table(s)
    assert len(table.splitlines()) == 3


def test_bench_prediction_reads_dispatch_plus_combine(tmp_path):
    rec = {"case": "time_bf16_T128", "ok": True, "T": 128, "dispatch_graph_us": 19.5, "combine_graph_us": 15.0,
           "nccl_dispatch_graph_us": 23.5, "nccl_combine_graph_us": 27.0, "dispatch_eager_us": 48.0,
           "combine_eager_us": 32.0, "nccl_dispatch_eager_us": 55.0}  # eager NCCL combine missing
    other = {**rec, "case": "time_fp8_T128", "dispatch_graph_us": 1.0}
    f = tmp_path / "cases.jsonl"
    f.write_text("\n".join([json.dumps(other), "not json", json.dumps(rec), json.dumps({**rec, "T": 8, "ok": False,
                                                                                        "case": "time_bf16_T8"})]))
    p = cpa.bench_prediction(f, (8, 128))
    assert set(p) == {128}
    assert p[128] == {"graph": {"peer_us": 34.5, "nccl_us": 50.5, "saving_us": 16.0}}
    assert cpa.bench_prediction(tmp_path / "missing.jsonl", (128,)) == {}


def test_committed_kernel_bench_gives_a_prediction_for_every_default_size():
    p = cpa.bench_prediction(cpa.BENCH_CASES, cpa.SIZES)
    if not p:
        pytest.skip("results/h200x2/moe/a2a/cases.jsonl not in this checkout")
    assert set(p) == set(cpa.SIZES)
    assert all({"graph", "eager"} <= set(v) for v in p.values())


def test_arguments():
    a = cpa.parse_args(["--out", "x.json", "--sizes", "4,16"])
    assert a.sizes == (4, 16) and a.layers == 2
    for bad in (["--sizes", "0"], ["--sizes", "300"], ["--sizes", "a,b"], ["--layers", "1"], ["--reps", "0"], []):
        with pytest.raises(SystemExit) as e:
            cpa.parse_args((["--out", "x.json"] if bad else []) + bad)
        assert e.value.code == 2


def test_without_two_gpus_says_so_in_one_line(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    for k, v in cpa.MULTICAST_OFF:  # main sets them; restore afterwards
        monkeypatch.setenv(k, v)
    out = tmp_path / "r.json"
    assert cpa.main(["--out", str(out)]) == 2
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 1 and "2 CUDA GPUs" in lines[0]
    assert not out.exists()
