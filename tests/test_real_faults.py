"""The real engine under faults, on CPU processes (gloo): decoders killed at seeded random moments (two of them at
the same instant) leave every request done or rejected with a reason — none ``stalled``, no hang — and the
simulator's replay of the run makes the same decisions; a killed driver (SIGKILL) takes its rank processes with
it, and so does a killed sweep its pool workers; ``rackbed real``'s exit status counts requests that ended without
an acceptable reason."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tiny_qwen3moe import tiny_hf_model

from rackbed.engine.core.workload import generate
from rackbed.engine.real.driver import bad_endings, replay, run_real
from rackbed.engine.real.model import TorchModelConfig
from rackbed.sim.driver import simulate
from rackbed.sim.scenario import build, parse_scenario

REPO = Path(__file__).resolve().parents[1]


def _scenario(ckpt: Path, decoders: int, n_requests: int = 12, rate: float = 40.0):
    return parse_scenario({
        "name": "cpu-faults", "topology": "hgx-h200", "model": str(ckpt / "config.json"), "weight_format": "bf16",
        "prefill": {"tp": 1, "ep": 1, "replicas": 1, "max_batch_tokens": 256},
        "decode": {"ep": 1, "replicas": decoders, "max_batch_per_rank": 4, "page_tokens": 4},
        "mtp": {"draft_k": 0},
        "workload": {"kind": "synthetic", "arrival": {"kind": "poisson", "rate_per_s": rate},
                     "prompt": {"kind": "uniform", "lo": 5, "hi": 30},
                     "output": {"kind": "uniform", "lo": 10, "hi": 30}, "n_requests": n_requests, "seed": 1}})


@pytest.fixture(scope="module")
def ckpt(tiny_qwen3moe_ckpt):
    return tiny_qwen3moe_ckpt[2]


def _kills(seed: int, decoder_gpus: list[int], last_arrival_s: float) -> list[tuple[float, int]]:
    """Three of the decoders killed at seeded clock times before the last arrival (so inside the run, however
    fast the ranks are); seed 0 kills two of them at the same instant (listed out of GPU order)."""
    rng = random.Random(seed)
    gpus = rng.sample(decoder_gpus, 3)
    hi_t = 0.9 * last_arrival_s
    if seed == 0:
        t = rng.uniform(0.1, 0.6) * hi_t
        hi, lo = sorted(gpus[:2], reverse=True)
        return [(t, hi), (t, lo), (rng.uniform(0.3, 1.0) * hi_t, gpus[2])]
    return [(rng.uniform(0.05, 1.0) * hi_t, g) for g in gpus]


@pytest.mark.slow
@pytest.mark.parametrize("seed", [0, 1])
def test_decoders_killed_at_random_moments_leave_no_request_stalled(ckpt, seed):
    sc = _scenario(ckpt, decoders=4)
    b = build(sc)
    reqs = generate(sc.workload, sc.seed)
    kills = _kills(seed, [g.gpus[0] for g in b.deployment.decoders], max(r.arrival_s for r in reqs))
    t0 = time.perf_counter()
    res, run = run_real(b, reqs, simulate=simulate, device="cpu", dtype="fp32", weights=str(ckpt),
                        prefill_pages=64, decode_pages=40, kill=kills, stall_s=60,
                        tiny_cfg=TorchModelConfig.from_hf(json.loads((ckpt / "config.json").read_text())))
    assert time.perf_counter() - t0 < 150
    m = res.metrics["requests"]
    assert bad_endings(res.metrics) == {}, (m, run.deaths, run.pool.errors)
    # a decoder and the prefiller survive: all of them finish
    assert m["done"] == m["total"] == len(reqs), (m, run.deaths, run.pool.errors)
    assert sorted(g for _, _, g in run.deaths) == sorted(g for _, g in kills)
    assert run.deaths == sorted(run.deaths, key=lambda d: (d[0], d[2]))
    rep = replay(b, reqs, run.records, simulate=simulate, seed=sc.seed, deaths=run.deaths)
    assert res.log.decisions() == rep.log.decisions()


@pytest.mark.slow
@pytest.mark.parametrize("first", [0.3, 0.45, 0.6])
def test_the_prefiller_survives_when_all_its_decoders_die(ckpt, first):
    """Both decoders of a two-decoder run are killed while the prefiller holds KV waiting for room on them.
    The scheduler rejects those requests (no decoder left) and counts their KV free; the prefiller's ranks
    must free it too, or the next prefill (of the requests the last decoder was decoding, routed again) finds
    the cache full and the healthy prefiller is declared dead — as happened in every run of this drill before
    the driver passed those requests to the prefill's ``free``. Three kill times (the failure depended on
    timing)."""
    sc = _scenario(ckpt, decoders=2, n_requests=24, rate=150.0)
    b = build(sc)
    reqs = generate(sc.workload, sc.seed)
    last = max(r.arrival_s for r in reqs)
    d0, d1 = (g.gpus[0] for g in b.deployment.decoders)
    kills = [(first * last, d0), (0.75 * last, d1)]
    res, run = run_real(b, reqs, simulate=simulate, device="cpu", dtype="fp32", weights=str(ckpt),
                        prefill_pages=64, decode_pages=40, kill=kills, stall_s=60,
                        tiny_cfg=TorchModelConfig.from_hf(json.loads((ckpt / "config.json").read_text())))
    assert sorted(g for _, _, g in run.deaths) == sorted([d0, d1]), (run.deaths, run.pool.errors)
    assert not any("MemoryError" in e for e in run.pool.errors), run.pool.errors
    m = res.metrics["requests"]
    assert bad_endings(res.metrics) == {}, m
    assert set(m["rejected_by_reason"]) <= {"no_decoder"}, m
    rep = replay(b, reqs, run.records, simulate=simulate, seed=sc.seed, deaths=run.deaths)
    assert res.log.decisions() == rep.log.decisions()


class _Proc:
    exitcode = None

    def __init__(self) -> None:
        self.killed = False

    def is_alive(self) -> bool:
        return not self.killed

    def kill(self) -> None:
        self.killed = True

    def join(self, timeout=None) -> None:
        pass


class _Queue(list):
    put = list.append


def _kv_in_flight(replies: dict[int, tuple[str, object]]):
    """A bare :class:`RealRun` (no processes) with one KV plan in flight from prefiller ranks 0, 1 to decoder
    rank 2, answered with ``replies`` ``{rank: (status, payload)}``; returns the run, the plan's event and the
    command queues."""
    from rackbed.engine.real.driver import MeasuredClockEnv, RankPool, RealRun, _Inflight

    run = RealRun.__new__(RealRun)
    cmd_qs = [_Queue() for _ in range(3)]
    run.pool = RankPool([_Proc() for _ in range(3)], cmd_qs, [], {0: 0, 1: 1, 2: 2})
    run.env = MeasuredClockEnv(run.pool, run._on_reply)
    run.env.on_death = lambda r: run.deaths.append(r)
    run.records, run.deaths, run.kv_declined, run.kv_refused, run.kv_bytes = [], [], [], [], {}
    run.group_ranks, run.pf_held, run.faulted = {"P0": (0, 1), "D0": (2,)}, {"P0": {7}}, set()
    ev = run.env.event()
    run.pool.inflight[1] = _Inflight(ev=ev, start_v=0.0, start_w=time.perf_counter(), waiting={0, 1, 2},
                                     worker="P0.kv0", kind="kv", key=7, dst=2, srcs=(0, 1))
    for rank, (status, payload) in replies.items():
        run._on_reply(1, rank, status, payload, time.perf_counter())
    return run, ev, cmd_qs


@pytest.mark.slow
def test_a_decoder_without_free_pages_is_not_declared_dead():
    """A decoder that refuses a transfer for lack of pages replies ``declined: no pages`` (and so do the
    sources that saw the refusal): no rank is declared dead or stopped, the plan fails with ``KV_NO_ROOM``
    (the scheduler ships it again later, to this decoder or another), the prefiller keeps its copy (no drop
    is sent), and the record's kind lets the replay fail it the same way. A source that lost the KV still
    fails the plan with ``KV_LOST`` and has the copies dropped; an error (not a decline) still blames the
    decoder."""
    from rackbed.engine.core.plans import KV_LOST, KV_NO_ROOM, Failed

    no = "declined: no pages: decoder rank 2 has no room for request 7"
    full = "declined: no pages: KV cache full: no room for request 7 (20 tokens)"
    run, ev, cmd_qs = _kv_in_flight({0: ("declined", no), 1: ("declined", no), 2: ("declined", full)})
    run.env.run(until=1.0)
    assert ev.processed and type(ev.value) is Failed and ev.value.reason == KV_NO_ROOM
    assert run.deaths == [] and run.pool.dead == set() and not any(p.killed for p in run.pool.procs)
    assert run.kv_refused == [7] and run.kv_declined == [] and run.pool.errors == []
    assert [r[1] for r in run.records] == [f"kv:{KV_NO_ROOM}"]
    assert all(q == [] for q in cmd_qs) and run.pf_held == {"P0": {7}}     # the prefiller keeps its copy

    run, ev, cmd_qs = _kv_in_flight({0: ("ok", (40, 0.01)), 1: ("declined", "declined: KV lost: no KV here"),
                                     2: ("declined", "declined: KV lost: source rank 1 declined")})
    run.env.run(until=1.0)
    assert ev.value.reason == KV_LOST and run.kv_declined == [7] and run.deaths == []
    assert [q[0][0] for q in cmd_qs[:2]] == ["drop", "drop"] and run.pf_held == {"P0": set()}

    ok = ("ok", (40, 0.01))
    run, ev, _ = _kv_in_flight({0: ok, 1: ok, 2: ("error", "RuntimeError: bad")})
    assert run.deaths == [2] and run.pool.procs[2].killed and not ev.triggered


@pytest.mark.slow
def test_a_source_that_lost_the_kv_kills_no_rank_and_the_request_is_prefilled_again(ckpt):
    """Two requests' first KV transfers find their copy gone on the prefiller's second TP rank (the drill frees it
    just before the send): that source declines, the other ships, the decoder frees the pages it reserved and
    replies ``declined`` too. No rank is declared dead; the scheduler prefills the two requests again and they
    finish with Hugging Face's greedy tokens; its invariants hold after every call; the replay fails the same
    transfers the same way and makes the same decisions."""
    import functools

    _, hf = tiny_hf_model()
    sc = parse_scenario({
        "name": "cpu-kv-lost", "topology": "hgx-h200", "model": str(ckpt / "config.json"), "weight_format": "bf16",
        "prefill": {"tp": 2, "ep": 2, "replicas": 1, "max_batch_tokens": 256},
        "decode": {"ep": 1, "replicas": 2, "max_batch_per_rank": 4, "page_tokens": 4},
        "mtp": {"draft_k": 0},
        "workload": {"kind": "synthetic", "arrival": {"kind": "poisson", "rate_per_s": 20},
                     "prompt": {"kind": "uniform", "lo": 5, "hi": 30},
                     "output": {"kind": "uniform", "lo": 3, "hi": 8}, "n_requests": 5, "seed": 1}})
    b = build(sc)
    reqs = generate(sc.workload, sc.seed)
    lose = [reqs[1].id, reqs[3].id]
    checked = functools.partial(simulate, debug_checks=True)
    res, run = run_real(b, reqs, simulate=checked, device="cpu", dtype="fp32", weights=str(ckpt),
                        prefill_pages=64, decode_pages=64, lose_kv=lose, stall_s=60,
                        tiny_cfg=TorchModelConfig.from_hf(json.loads((ckpt / "config.json").read_text())))
    assert sorted(run.kv_declined) == sorted(lose)
    assert run.deaths == [] and run.pool.dead == set() and run.pool.errors == [], (run.deaths, run.pool.errors)
    m = res.metrics["requests"]
    assert m["done"] == m["total"] == len(reqs), m
    requeued = sorted((rec[3], rec[4], rec[6]) for rec in res.log.of_kind("requeue"))
    assert requeued == sorted((rid, 1, "kv_lost") for rid in lose)
    assert sum(1 for w, k, key, _, _ in run.records if k == "kv:kv_lost") == len(lose)
    for r in reqs:
        prompt = torch.tensor(run.prompt_ids[r.id])[None]
        with torch.no_grad():
            ref = hf.generate(prompt, max_new_tokens=r.output_tokens, do_sample=False)[0, prompt.shape[1]:]
        assert run.generated[r.id] == ref.tolist(), f"request {r.id}"
    rep = replay(b, reqs, run.records, simulate=checked, seed=sc.seed, deaths=run.deaths)
    assert res.log.decisions() == rep.log.decisions()


def _children(pid: int) -> set[int]:
    out = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        out.update(int(x) for x in (task / "children").read_text().split())
    return out


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def _wait_gone(pids: set[int], within_s: float) -> set[int]:
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < within_s:
        left = {p for p in pids if _running(p)}
        if not left:
            return left
        time.sleep(0.1)
    return {p for p in pids if _running(p)}


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs /proc")
def test_a_killed_driver_takes_its_ranks_with_it(ckpt, tmp_path):
    """SIGKILL the driver once its ranks are ready: every rank process is gone within a few seconds."""
    script = tmp_path / "driver.py"
    script.write_text(textwrap.dedent(f"""
        import json, sys, time
        sys.path.insert(0, {str(REPO / 'tests')!r})
        from pathlib import Path
        from rackbed.engine.real.driver import RealRun
        from rackbed.engine.real.model import TorchModelConfig
        from rackbed.sim.scenario import build
        from test_real_faults import _scenario

        if __name__ == "__main__":
            ck = Path({str(ckpt)!r})
            b = build(_scenario(ck, decoders=1))
            run = RealRun(b, device="cpu", dtype="fp32", n_layers=None, seed=0, weights=str(ck), prefill_pages=64,
                          decode_pages=40, tiny_cfg=TorchModelConfig.from_hf(json.loads((ck / "config.json").read_text())))
            print("ready", *[p.pid for p in run.pool.procs], flush=True)
            time.sleep(600)
    """))
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    drv = subprocess.Popen([sys.executable, str(script)], cwd=tmp_path, env=env, stdout=subprocess.PIPE, text=True)
    try:
        line = drv.stdout.readline().split()
        assert line and line[0] == "ready", line
        ranks = {int(x) for x in line[1:]}
        assert ranks and ranks <= _children(drv.pid)
        drv.send_signal(signal.SIGKILL)
        drv.wait(timeout=10)
        assert _wait_gone(ranks, 5.0) == set()
    finally:
        drv.kill()


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs /proc")
def test_a_killed_sweep_takes_its_pool_workers_with_it(tmp_path):
    script = tmp_path / "sweep.py"
    script.write_text(textwrap.dedent("""
        import multiprocessing as mp, os, time
        from concurrent.futures import ProcessPoolExecutor
        from rackbed.sim.sweep import _worker_init

        if __name__ == "__main__":
            with ProcessPoolExecutor(2, mp_context=mp.get_context("spawn"), initializer=_worker_init) as pool:
                pids = {pool.submit(os.getpid).result() for _ in range(8)}
                print("ready", *pids, flush=True)
                pool.submit(time.sleep, 600)
                time.sleep(600)
    """))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    sw = subprocess.Popen([sys.executable, str(script)], cwd=tmp_path, env=env, stdout=subprocess.PIPE, text=True)
    try:
        line = sw.stdout.readline().split()
        assert line and line[0] == "ready", line
        workers = {int(x) for x in line[1:]}
        assert workers and workers <= _children(sw.pid)
        sw.send_signal(signal.SIGKILL)
        sw.wait(timeout=10)
        assert _wait_gone(workers, 5.0) == set()
    finally:
        sw.kill()


def test_bad_endings_name_stalled_and_lost_requests():
    ok = {"requests": {"total": 5, "done": 3, "rejected": 2, "rejected_by_reason": {"no_decoder": 2}}}
    assert bad_endings(ok) == {}
    bad = {"requests": {"total": 6, "done": 2, "rejected": 3, "rejected_by_reason": {"stalled": 2, "shed": 1}}}
    assert bad_endings(bad) == {"stalled": 2, "lost": 1}


def test_rackbed_real_exits_1_when_a_request_stalled(ckpt, tmp_path, monkeypatch, capsys):
    """The command's exit status reflects how requests ended (the run itself is stood in for: its metrics say
    one request stalled; everything else of the command runs)."""
    import types

    import rackbed.engine.real.driver as drv
    from rackbed.engine.cli.main import main
    from rackbed.sim import outputs

    scen = tmp_path / "s.yaml"
    scen.write_text(f"""kind: serving
name: stall
topology: hgx-h200
model: {ckpt / 'config.json'}
weight_format: bf16
prefill: {{tp: 1, ep: 1, replicas: 1, max_batch_tokens: 256}}
decode: {{ep: 1, replicas: 1, max_batch_per_rank: 4, page_tokens: 4}}
mtp: {{draft_k: 0}}
workload: {{kind: synthetic, arrival: {{kind: poisson, rate_per_s: 20}}, prompt: {{kind: uniform, lo: 5, hi: 9}},
           output: {{kind: uniform, lo: 2, hi: 3}}, n_requests: 3, seed: 1}}
real: {{device: cpu, dtype: fp32, weights: {ckpt}}}
""")
    metrics = {"requests": {"total": 3, "done": 2, "rejected": 1, "rejected_by_reason": {"stalled": 1},
                            "requeued": 0}}
    log = types.SimpleNamespace(decisions=lambda: [("same",)])
    res = types.SimpleNamespace(metrics=metrics, log=log)
    run = types.SimpleNamespace(records=[], deaths=[], generated={},
                                pool=types.SimpleNamespace(errors=[], graph_reports={}),
                                cfg=types.SimpleNamespace(n_layers=1, hidden=8, kv_windows=()))
    monkeypatch.setattr(drv, "run_real", lambda *a, **k: (res, run))
    monkeypatch.setattr(drv, "replay", lambda *a, **k: res)
    monkeypatch.setattr(outputs, "write_all", lambda *a, **k: None)
    monkeypatch.setattr("rackbed.sim.scenario.print_summary", lambda *a, **k: None)
    assert main(["real", str(scen), "--out", str(tmp_path / "out")]) == 1
    assert "1 stalled" in capsys.readouterr().err
    metrics["requests"].update(done=3, rejected=0, rejected_by_reason={})
    assert main(["real", str(scen), "--out", str(tmp_path / "out2")]) == 0
