"""The a2a benchmark's hang safety on the CPU: the watchdog parent of kernels/bench/moe_a2a.py kills workers whose
case overruns its budget, keeps the records of the cases done before, and writes the summary (gloo workers stand
in for the GPU ones; the case protocol and the merge over ranks are the real ones)."""

from __future__ import annotations

import json
import os
import time

import pytest

pytest.importorskip("torch")


def _fake_worker(rank, world, port, q, opts):
    from datetime import timedelta

    import torch.distributed as dist

    from rackbed.kernels.bench.moe_a2a import _Ctx

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    cx = _Ctx(rank, world, q, dist.new_group(backend="gloo"), None)
    cx.case("check_fast", 30, lambda: {"x_us": 1.0 + rank, "payload": "bf16"})
    cx.case("check_fails", 30, lambda: (_ for _ in ()).throw(ValueError("boom")) if rank == 1 else {})
    if opts["tokens"] == [0]:  # desync mode: rank 1 makes an agreement rank 0 does not make
        cx.case("check_desync", 30, lambda: cx.agree(1, "extra") and {} if rank == 1 else {})
    cx.case("time_hangs", 2, lambda: time.sleep(600) if rank == 0 else {})  # rank 1 then waits in agree()
    q.put(("exit", rank))


@pytest.mark.slow
def test_watchdog_kills_a_hung_case_and_keeps_the_earlier_records(tmp_path):
    from rackbed.kernels.bench import moe_a2a as moe_a2a_bench

    t0 = time.time()
    s = moe_a2a_bench.run(str(tmp_path), deadline_s=120, worker=_fake_worker, echo=lambda *a, **k: None)
    wall = time.time() - t0
    assert wall < 90  # the hung case had a 2 s budget; without the watchdog this would take 600 s
    names = [c["case"] for c in s["cases"]]
    assert names[:2] == ["check_fast", "check_fails"] and "time_hangs" in names
    fast = s["cases"][0]
    assert fast["ok"] and fast["x_us"] == 2.0 and fast["x_us_by_rank"] == [1.0, 2.0] and fast["payload"] == "bf16"
    assert not s["cases"][1]["ok"] and "boom" in json.dumps(s["cases"][1])
    hung = [c for c in s["cases"] if c["case"] == "time_hangs"]
    assert hung and not hung[0]["ok"] and "watchdog" in hung[0]["error"]
    assert s["watchdog"] and "time_hangs" in s["watchdog"][0]
    assert not s["checks_ok"]
    files = sorted(os.listdir(tmp_path / "cases"))
    assert len(files) == len(s["cases"]) and files[0].startswith("001_check_fast")
    on_disk = json.loads((tmp_path / "a2a.json").read_text())
    assert on_disk["checks_run"] == 2 and on_disk["checks_passed"] == 1
    assert len((tmp_path / "cases.jsonl").read_text().splitlines()) == len(s["cases"])


@pytest.mark.slow
def test_ranks_that_fall_out_of_step_stop_instead_of_pairing_wrong_calls(tmp_path):
    from rackbed.kernels.bench import moe_a2a as moe_a2a_bench

    t0 = time.time()
    s = moe_a2a_bench.run(str(tmp_path), deadline_s=120, tokens=(0,), worker=_fake_worker, echo=lambda *a, **k: None)
    assert time.time() - t0 < 90
    names = [c["case"] for c in s["cases"]]
    assert "check_desync" in names and "time_hangs" not in names  # stopped at the desync
    bad = [c for c in s["cases"] if c["case"] == "check_desync"]
    assert all(not c.get("ok", False) for c in bad) and "Desync" in json.dumps(bad)
    assert s["watchdog"]  # nonzero exit codes are reported
