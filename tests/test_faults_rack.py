"""Rack-level faults: ``rack:<d>`` takes a whole NVLink domain down (its GPUs and NICs), ``rack_link:<d>`` its
fabric links. Workers on the rack die (or, cut off, drain), their requests are routed again, none is lost, and
the other racks' workers carry on."""

from __future__ import annotations

import pytest
from test_deployment_place import Grid
from test_sim_driver_models import KV_BYTES_PER_TOKEN, AnalyticCost, poisson_requests

from rackbed.engine.core.deployment import DecoderTemplate, PrefillerTemplate, place
from rackbed.sim.driver import simulate
from rackbed.sim.faults import Fault
from rackbed.topology.errors import UserError


def _deployment():
    """Three racks of 4 nodes x 4 GPUs: prefillers P0-P3 fill rack 0, P4 and decoder D0 are in rack 1, D1 and
    D2 in rack 2."""
    return place(Grid(3, 4, 4), n_prefillers=5, n_decoders=3, kv_bytes_per_token=KV_BYTES_PER_TOKEN,
                 prefiller=PrefillerTemplate(tp=4, ep=4, max_batch_tokens=8192, kv_capacity_tokens=60_000),
                 decoder=DecoderTemplate(ep=8, max_batch_per_rank=8, kv_capacity_tokens_per_rank=40_000),
                 spare="none")


def _run(faults):
    dep = _deployment()
    res = simulate(dep, poisson_requests(150, 6.0, 3), AnalyticCost(), seed=0, progress=False, faults=faults)
    return dep, res


def _stopped(res, how):
    """Workers that stopped ``how`` (``dead``, ``drained``, ...), with the time."""
    return {r[2]: r[0] for r in res.log.records if r[1] == "stop" and r[6] == how}


def test_the_layout_spans_the_racks():
    dep = _deployment()
    rack = {g.id: dep.gpu_domain[g.gpus[0]] for g in (*dep.prefillers, *dep.decoders)}
    assert rack == {"P0": 0, "P1": 0, "P2": 0, "P3": 0, "P4": 1, "D0": 1, "D1": 2, "D2": 2}


def test_a_rack_failing_kills_its_workers_and_loses_no_request():
    dep, res = _run([Fault(4.0, "rack:1")])
    m = res.metrics["requests"]
    assert m["done"] == m["total"] == 150 and m["requeued"] > 0
    assert [r[6] for r in res.log.records if r[1] == "fault"] == ["rack:1"]
    assert _stopped(res, "dead") == {"P4": 4.0, "P4.kv0": 4.0, "D0": 4.0}  # rack 1's workers, no other
    # nothing runs on rack 1 after the fault; its requests were routed to the other racks' workers
    recs = res.log.records
    assert not [r for r in recs if r[0] > 4.0 and r[2] in ("P4", "D0") and r[1] in ("prefill", "decode")]
    assert {r[6] for r in recs if r[0] >= 4.0 and r[1] == "kv_transfer"} <= {"D1", "D2"}
    assert all(r[6] == "gpu_failed" for r in recs if r[1] == "requeue")


def test_a_rack_cut_off_from_the_fabric_drains_and_loses_no_request():
    dep, res = _run([Fault(4.0, "rack_link:1")])
    m = res.metrics["requests"]
    assert m["done"] == m["total"] == 150
    recs = res.log.records
    # P4 can ship no KV: it dies; D0 can receive none: it decodes what it holds, takes nothing new, retires
    assert _stopped(res, "dead") == {"P4": 4.0, "P4.kv0": 4.0}
    assert [(r[2], r[6]) for r in recs if r[1] == "scale_down"] == [("D0", "unreachable")]
    assert _stopped(res, "drained")["D0"] > 4.0
    assert {r[6] for r in recs if r[0] >= 4.0 and r[1] == "kv_transfer"} <= {"D1", "D2"}


def test_a_rack_link_down_for_a_while_comes_back():
    dep, res = _run([Fault(4.0, "rack_link:1", duration_s=3.0)])
    m = res.metrics["requests"]
    assert m["done"] == m["total"] == 150
    assert [r[6] for r in res.log.records if r[1] == "fault"] == ["rack_link:1", "recover rack_link:1"]


@pytest.mark.parametrize("target", ["rack:3", "rack_link:9"])
def test_a_rack_the_deployment_lacks_is_a_one_line_error(target):
    with pytest.raises(UserError, match=f"faults: target '{target}' is not a GPU, node, NIC or rack"):
        _run([Fault(1.0, target)])


def test_the_shipped_rack_failure_scenario_loses_no_request(tmp_path):
    """``scenarios/nvl72x10-rack-failure.yaml``, shortened: rack 3 of ten fails; exactly its workers die (four
    decoders, two prefillers) and every request still ends done."""
    from pathlib import Path

    from rackbed.sim.scenario import build, load_scenario, simulate_scenario

    src = Path(__file__).parents[1] / "scenarios" / "nvl72x10-rack-failure.yaml"
    p = tmp_path / "s.yaml"
    p.write_text(src.read_text().replace("max_requests: 12000", "max_requests: 2500")
                 .replace("at_s: 30.0", "at_s: 8.0"))
    sc = load_scenario(p)
    b = build(sc, engine_calibration=False)
    on_rack = {g.id for g in (*b.deployment.prefillers, *b.deployment.decoders)
               if b.deployment.gpu_domain[g.gpus[0]] == 3}
    assert sum(i.startswith("D") for i in on_rack) == 4 and sum(i.startswith("P") for i in on_rack) == 2
    _, res = simulate_scenario(sc, built=b)
    m = res.metrics["requests"]
    assert m["done"] == m["total"] == 2500 and m["requeued"] > 0
    assert {w.split(".")[0] for w in _stopped(res, "dead")} == on_rack
