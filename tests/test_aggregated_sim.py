"""Aggregated deployments in the simulator: the scenario schema and its one-line errors, the mixed-step cost model
against the step models it is composed of, and whole runs — the shipped scenario, a worker failure, and the same
trace served disaggregated and aggregated on the same GPUs."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rackbed.engine.core.model import get_model
from rackbed.engine.core.sharding import ParallelPlan
from rackbed.engine.core.workload import generate
from rackbed.sim.costs.mixed import aggregated_operating_point, mixed_step_time
from rackbed.sim.costs.step import decode_step_time, prefill_step_time
from rackbed.sim.driver import simulate
from rackbed.sim.scenario import build, load_scenario, parse_scenario
from rackbed.topology.errors import UserError

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ROOT / "scenarios" / "agg_h200_node.yaml"


def _scenario(**over):
    data = load_scenario(SHIPPED).model_dump(mode="json", exclude_none=True)
    data["workload"]["n_requests"] = 80
    for k, v in over.items():
        data[k] = v
    return parse_scenario(data)


# ------------------------------------------------------------------ schema
@pytest.mark.parametrize(("over", "msg"), [
    ({"aggregated": {"tp": 2, "dp": 4, "ep": 8}}, "aggregated.tp: tp > 1 needs dp = 1"),
    ({"aggregated": {"dp": 4, "ep": 3}}, "aggregated.ep: 3 does not divide"),
    ({"aggregated": {"max_batch_per_rank": 64, "max_batch_tokens": 64}}, "aggregated.max_batch_tokens: must exceed"),
    ({"aggregated": {"chunk_tokens": 0}}, "aggregated.chunk_tokens: Input should be greater than or equal to 1"),
    ({"aggregated": {"workerz": 2}}, "aggregated.workerz: unknown key"),
    ({"autoscaler": {"enabled": True}}, "autoscaler: aggregated workers are not autoscaled"),
    ({"deployment": "disaggregated"}, "aggregated: only used with deployment: aggregated"),
    ({"deployment": "both"}, "deployment: Input should be 'disaggregated' or 'aggregated'"),
])
def test_bad_aggregated_scenarios_are_one_line_errors_naming_the_field(over, msg):
    with pytest.raises(UserError) as e:
        _scenario(**over)
    assert msg in str(e.value) and "\n" not in str(e.value)


def test_workers_that_do_not_fit_the_topology_are_a_one_line_error():
    with pytest.raises(UserError, match="aggregated worker 2 needs 4 free GPUs in one NVLink domain"):
        build(_scenario(aggregated={"workers": 3, "dp": 4, "ep": 4}))


# ------------------------------------------------------------------ the mixed step against its parts
@functools.cache
def _h200():
    from rackbed import topology
    from rackbed.sim.calibrate import default_calibration_for

    return topology.load("hgx-h200"), get_model("qwen3-30b-a3b"), default_calibration_for("H200-SXM", stack="rackbed")


def _plan(tp, dp, model):
    kv_rep = max(1, tp // model.n_kv_heads)
    return ParallelPlan(role="decode" if tp == 1 else "prefill", tp=tp, dp=dp, ep=tp * dp, kv_replication=kv_rep,
                        gpus=tuple(range(tp * dp)), weight_format="fp8_block", page_tokens=64)


@settings(max_examples=25, deadline=None)
@given(batch=st.lists(st.integers(0, 64), min_size=4, max_size=4), ctx=st.integers(1, 4000),
       k=st.integers(0, 2), extra=st.integers(1, 4096))
def test_a_mixed_step_is_the_decode_step_plus_what_its_prefill_adds(batch, ctx, k, extra):
    """Without chunks a DP-attention mixed step is exactly the decode step; a chunk adds attention time (the
    grouped-GEMM model itself is not monotonic in tokens: expected tokens per expert round to tiles)."""
    topo, model, cal = _h200()
    pl = _plan(1, 4, model)
    ctxs = [b * ctx for b in batch]
    none = [[] for _ in batch]
    alone = mixed_step_time(model, pl, topo, batch, ctxs, none, draft_k=k, calib=cal)
    if any(batch):
        ref = decode_step_time(model, pl, topo, batch, ctxs, draft_k=k, calib=cal)
        assert alone.total_s == pytest.approx(ref.total_s, rel=1e-12)
        assert alone.attn_s == pytest.approx(ref.attn_s, rel=1e-12)
    busiest = batch.index(max(batch))  # its attention sets the step's: the chunk goes there
    chunks = [[(extra, 0)] if r == busiest else [] for r in range(4)]
    more = mixed_step_time(model, pl, topo, batch, ctxs, chunks, draft_k=k, calib=cal)
    assert more.attn_s > alone.attn_s and more.total_s > 0


@settings(max_examples=20, deadline=None)
@given(chunks=st.lists(st.tuples(st.integers(1, 3000), st.integers(0, 3000)), min_size=1, max_size=4),
       dec=st.integers(0, 32))
def test_a_tp_mixed_step_is_the_prefill_step_plus_its_decode_part(chunks, dec):
    """Without a decode batch a TP mixed step is exactly the prefill step of its chunks; a decode batch adds
    attention time."""
    topo, model, cal = _h200()
    pl = _plan(4, 1, model)
    alone = mixed_step_time(model, pl, topo, [0], [0], [chunks], calib=cal)
    ref = prefill_step_time(model, pl, topo, chunks, calib=cal)
    assert alone.total_s == pytest.approx(ref.total_s, rel=1e-12)
    if dec:
        with_dec = mixed_step_time(model, pl, topo, [dec], [dec * 1000], [chunks], calib=cal)
        assert with_dec.attn_s > alone.attn_s


def test_operating_point_trades_batch_for_prefill_room():
    topo, model, cal = _h200()
    pl = _plan(1, 4, model)
    kw = {"max_batch_per_rank": 64, "chunk_tokens": 2048, "calib": cal}
    short = aggregated_operating_point(model, pl, topo, prompt_tokens=500, output_tokens=500, max_batch_tokens=8192,
                                       **kw)
    long = aggregated_operating_point(model, pl, topo, prompt_tokens=8000, output_tokens=100, max_batch_tokens=2048,
                                      **kw)
    assert short.batch_per_rank == 64 and long.batch_per_rank < 64  # prefill demand caps the batch
    assert long.batch_per_rank * (1 + 8000 / 100) == pytest.approx(2048)
    assert short.output_tokens_per_s == pytest.approx(short.requests_per_s * 500)
    assert short.tpot_s == short.step_s > 0


# ------------------------------------------------------------------ runs
@pytest.mark.slow
def test_shipped_scenario_serves_every_request_with_its_invariants():
    b = build(_scenario())
    sc = b.scenario
    reqs = generate(sc.workload, sc.seed)
    res = simulate(b.deployment, reqs, b.cost_model, seed=sc.seed, progress=False, debug_checks=True,
                   policies=sc.sim.policies.build())
    m = res.metrics
    assert m["requests"]["done"] == len(reqs) == 80
    assert m["utilisation"]["aggregated"] > 0 and m["gpu_seconds"]["aggregated"] > 0
    assert set(res.breakdown_s) == {"prefill", "decode", "aggregated"} and res.breakdown_s["aggregated"]["a2a_s"] > 0
    assert {g[1] for g in res.groups} == {"aggregated"}
    assert res.log.of_kind("mixed") and not res.log.of_kind("kv_transfer")
    assert m["queueing_s"]["kv_transfer"]["max"] == 0


@pytest.mark.slow
def test_a_failed_worker_is_rerouted_and_nothing_is_lost():
    b = build(_scenario())
    sc = b.scenario
    reqs = generate(sc.workload, sc.seed)
    res = simulate(b.deployment, reqs, b.cost_model, seed=sc.seed, progress=False, debug_checks=True,
                   faults=[{"at_s": reqs[40].arrival_s, "target": "gpu:5"}])
    m = res.metrics["requests"]
    assert m["done"] == len(reqs) and m["requeued"] >= 1
    assert [g[5] for g in res.groups] == ["active", "dead"]


@pytest.mark.slow
def test_the_same_trace_disaggregated_and_aggregated_on_the_same_gpus_finishes_every_request():
    agg = _scenario()
    dis = _scenario(deployment="disaggregated", aggregated=None,
                    prefill={"tp": 4, "ep": 4, "replicas": 1, "max_batch_tokens": 16384},
                    decode={"ep": 4, "replicas": 1, "max_batch_per_rank": 64, "page_tokens": 64})
    out = {}
    for sc in (agg, dis):
        b = build(sc)
        assert b.deployment.n_gpus == 8
        reqs = generate(sc.workload, sc.seed)
        res = simulate(b.deployment, reqs, b.cost_model, seed=sc.seed, progress=False,
                       kv_chunks=getattr(b.cost_model, "kv_chunks", None), policies=sc.sim.policies.build())
        out[sc.deployment] = res.metrics
        assert res.metrics["requests"]["done"] == len(reqs)
    # no KV transfer when aggregated; the disaggregated run ships every multi-token request's KV
    assert out["aggregated"]["queueing_s"]["kv_transfer"]["max"] == 0
    assert out["disaggregated"]["queueing_s"]["kv_transfer"]["max"] > 0


@pytest.mark.slow
def test_the_summary_counts_aggregated_workers_as_gpus_in_use(tmp_path, capsys):
    """``rackbed run`` of an aggregated scenario: its header's GPUs in use are the workers' GPUs (no prefillers or
    decoders), the figure its metrics' mean GPUs in use gives; a disaggregated deployment counts its groups."""
    from rackbed.engine.cli.main import main
    from rackbed.sim.scenario import gpus_in_use

    assert main(["run", "agg_h200_node", "--duration", "1", "--no-progress", "--out", str(tmp_path / "a")]) == 0
    out = capsys.readouterr().out
    head = next(line for line in out.splitlines() if line.startswith("GPUs in use"))
    assert head.startswith("GPUs in use: 8 of 8 — 2 aggregated worker(s) (8 GPUs, TP=1 x DP=4 each)")
    assert "prefiller" not in head
    import json

    assert json.loads((tmp_path / "a" / "metrics.json").read_text())["throughput"]["mean_gpus"] == 8
    dis = build(_scenario(deployment="disaggregated", aggregated=None,
                          prefill={"tp": 4, "ep": 4, "replicas": 1, "max_batch_tokens": 16384},
                          decode={"ep": 4, "replicas": 1, "max_batch_per_rank": 64, "page_tokens": 64}))
    assert gpus_in_use(dis.deployment, 8).startswith(
        "GPUs in use: 8 of 8 — 1 prefiller(s) (4 GPUs), 1 decoder(s) (4 GPUs);")
