"""rackbed.sim.sweep on a Ray cluster: a local one-node cluster (2 CPUs) started for this module; ``rackbed sweep
--ray-address`` gives the same records as the in-process run point by point, and a driver killed mid-way (SIGKILL)
resumes into a results file holding every point exactly once. Skipped when ray is not installed (the ``cluster``
extra). The cluster runs in its own session and every process of that session is killed at the end."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from test_sweep import BASE

from rackbed.sim import sweep as sw
from rackbed.topology.errors import UserError

ray = pytest.importorskip("ray", reason="ray is not installed (pip install -e '.[cluster]')")

ROOT = Path(__file__).resolve().parent.parent
#: 36 points: 24 simulate, 12 are rejected by placement inside the worker (EP=128 on a 72-GPU rack). A worker's first
#: point takes ~1 s (imports, cost tables), the others ~0.05 s: enough of them that a driver killed after its first
#: record still has work left
GRID = {"decode.ep": [8, 16, 128], "mtp.draft_k": [0, 1, 2], "workload.arrival.rate_per_s": [4, 6, 8, 10]}
#: record fields that depend on where and when a point ran, not on what it computed
VOLATILE = ("wall_s", "cpu_s", "pid")


def _env() -> dict:
    # the cluster's workers and the drivers import this checkout's rackbed, whatever else is installed
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]).rstrip(
        os.pathsep), "RAY_USAGE_STATS_ENABLED": "0", "MPLBACKEND": "Agg"}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _session_pids(sid: int) -> list[int]:
    """Live (non-zombie) processes of session ``sid``: the cluster's, since it was started in a new session."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # state ppid pgrp session ...
        if int(fields[3]) == sid and fields[0] != "Z":
            out.append(int(d.name))
    return out


@pytest.fixture(scope="module")
def cluster():
    """``ray start --head --block`` on this machine in a new session; yields the GCS address."""
    if not sys.platform.startswith("linux"):
        pytest.skip("the cluster fixture finds its processes in /proc (Linux)")
    tmp = Path(tempfile.mkdtemp(prefix="rbray-", dir="/tmp"))  # short: Ray's socket paths must fit in 107 bytes
    port = _free_port()
    log = (tmp / "start.log").open("w")
    proc = subprocess.Popen(
        [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block", "--node-ip-address", "127.0.0.1",
         "--port", str(port), "--num-cpus", "2", "--include-dashboard", "false", "--disable-usage-stats",
         "--temp-dir", str(tmp)],
        stdout=log, stderr=subprocess.STDOUT, env=_env(), start_new_session=True, cwd=tmp)
    try:
        deadline = time.monotonic() + 90
        while "Ray runtime started" not in (tmp / "start.log").read_text():
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail("ray start failed:\n" + (tmp / "start.log").read_text()[-3000:])
            time.sleep(0.1)
        yield f"127.0.0.1:{port}"
    finally:
        proc.send_signal(signal.SIGTERM)  # ray start --block stops its node's processes on SIGTERM ...
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        for pid in _session_pids(proc.pid):  # ... and whatever is left of the session (workers) is killed here
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait(timeout=10)
        log.close()
        left = _session_pids(proc.pid)
        shutil.rmtree(tmp, ignore_errors=True)
        assert not left, f"ray processes left running: {left}"


@pytest.fixture(scope="module")
def spec_path(tmp_path_factory):
    import yaml

    p = tmp_path_factory.mktemp("spec") / "ray.yaml"
    p.write_text(yaml.safe_dump({"kind": "sweep", "name": "ray", "scenario": BASE, "grid": GRID}))
    return p


@pytest.fixture(scope="module")
def local(spec_path, tmp_path_factory):
    """The reference: every point in this process (``--jobs 1``), by key, without the volatile fields."""
    run = sw.run_points(sw.expand(sw.load_sweep(spec_path)), tmp_path_factory.mktemp("local") / "r.jsonl", jobs=1,
                        progress=False)
    assert run.counts == {"ok": 24, "invalid": 12, "error": 0}
    return {r["key"]: _stable(r) for r in run.records}


def _stable(rec: dict) -> dict:
    return {k: v for k, v in rec.items() if k not in VOLATILE}


def _driver(spec: Path, out: Path, address: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "rackbed.engine.cli.main", "sweep", str(spec), "--out", str(out), "--ray-address",
         address, "--no-progress", "--no-report"],
        cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        # a suite started in the background (``cmd &`` in a script) runs with SIGINT ignored, which a child inherits
        # and Python then keeps: Ctrl-C must reach the driver as it does from a terminal
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def _records_once(path: Path) -> dict[str, dict]:
    """The results file's records by key, asserting that no key was recorded twice."""
    recs = sw.read_results(path)
    keys = [r["key"] for r in recs]
    assert len(keys) == len(set(keys)), f"a point was recorded twice: {keys}"
    return {r["key"]: r for r in recs}


def _wait_for_records(p: subprocess.Popen, res: Path, n: int) -> None:
    deadline = time.monotonic() + 90
    while len(sw.read_results(res)) < n:
        assert p.poll() is None, p.communicate()[0]
        assert time.monotonic() < deadline, f"fewer than {n} records within 90 s"
        time.sleep(0.02)


@pytest.mark.slow
def test_ray_sweep_interrupted_killed_resumed_matches_the_local_run(cluster, spec_path, local, tmp_path):
    """Three drivers on one results file: Ctrl-C after the first record, SIGKILL after the next, then one that
    finishes. Every point is recorded exactly once, each record equal to the local run's but for timings/pids."""
    out = tmp_path / "out"
    res = out / "results.jsonl"
    p = _driver(spec_path, out, cluster)
    try:
        _wait_for_records(p, res, 1)
        p.send_signal(signal.SIGINT)
        log, _ = p.communicate(timeout=20)  # interrupted: in-flight tasks cancelled, the driver exits promptly
    finally:
        p.kill()
    assert p.returncode == 130 and "rackbed: interrupted" in log, log
    n1 = len(_records_once(res))
    p = _driver(spec_path, out, cluster)
    try:
        _wait_for_records(p, res, n1 + 1)
        p.send_signal(signal.SIGKILL)
    finally:
        p.kill()
        p.communicate()
    before = _records_once(res)
    assert n1 < len(before) < len(local), "the driver finished before it was killed: nothing to resume"
    p = _driver(spec_path, out, cluster)
    log, _ = p.communicate(timeout=120)
    assert p.returncode == 0, log
    assert f"skipped {len(before)} already done" in " ".join(log.split()), log
    after = _records_once(res)
    assert set(after) == set(local)
    for key, rec in after.items():
        assert _stable(rec) == local[key], rec["label"]
    for key, rec in before.items():  # what the earlier drivers recorded is kept, not re-run
        assert after[key]["pid"] == rec["pid"] and after[key]["wall_s"] == rec["wall_s"]
    # the points ran in Ray workers, not in a driver
    assert {r["pid"] for r in after.values()}.isdisjoint({p.pid})


def test_an_unreachable_ray_address_is_a_one_line_error(tmp_path):
    out = tmp_path / "r.jsonl"
    t0 = time.monotonic()
    with pytest.raises(UserError, match=r"--ray-address 127\.0\.0\.1:\d+: nothing answers there"):
        sw.run_points(sw.expand(sw.parse_sweep({"name": "x", "scenario": BASE}, "x.yaml")), out,
                      ray_address=f"127.0.0.1:{_free_port()}", progress=False)
    assert time.monotonic() - t0 < 10 and not out.exists()
