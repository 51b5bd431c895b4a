"""Prefix caching in the simulator on a slice of the shipped Mooncake trace: hits happen and the prefill work
drops by exactly the tokens reused (the decision log's batch tokens + tokens saved = prompt tokens), the fast path
gives the reference path's result with caches on, a scenario without the section runs as before, and bad
``prefix_cache`` / routing fields are one-line errors naming the field."""

from __future__ import annotations

import numpy as np
import pytest

from rackbed.engine.core.workload import iter_requests
from rackbed.sim.driver import simulate
from rackbed.sim.scenario import build, parse_scenario, simulate_scenario
from rackbed.topology.errors import UserError

BASE = {
    "kind": "serving", "name": "pc", "seed": 0, "topology": "gb200-nvl72", "model": "qwen3-235b-a22b",
    "weight_format": "mxfp8", "model_layers": 8,
    "prefill": {"tp": 4, "ep": 4, "replicas": 2, "max_batch_tokens": 16384, "kv_streams": 2},
    "decode": {"ep": 16, "replicas": 1, "max_batch_per_rank": 64, "page_tokens": 64},
    "mtp": {"draft_k": 1, "accept_p": 0.8, "draft": {"kind": "mtp", "layers": 1}},
    "workload": {"kind": "trace", "name": "mooncake", "rate_per_s": 4.0, "max_requests": 150},
}


def scenario(**upd):
    return parse_scenario({**BASE, **upd})


def _run(sc, **kw):
    b = build(sc)
    reqs = list(iter_requests(sc.workload, sc.seed))
    return reqs, simulate(b.deployment, reqs, b.cost_model, seed=sc.seed, kv_chunks=b.cost_model.kv_chunks,
                          policies=sc.sim.policies.build(), prefix_cache=b.prefix_cache, progress=False, **kw)


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["kv_aware", "least_queued_tokens"])
def test_cache_hits_and_prefill_work_drops_by_the_tokens_reused(policy):
    sc = scenario(prefix_cache={"enabled": True, "hbm_gb_per_gpu": 2.0},
                  sim={"policies": {"prefiller": policy}})
    reqs, res = _run(sc)
    pc = res.metrics["prefix_cache"]
    assert pc["hit_rate_tokens"] > 0 and pc["prefill_tokens_saved"] > 0
    assert pc["lookups"] == len(reqs) and pc["prompt_tokens"] == sum(r.prompt_tokens for r in reqs)
    assert all(r[4] == "done" and r[13] == 0 for r in res.rows)
    computed = sum(rec[5] for rec in res.log.records if rec[1] == "prefill")
    assert computed + pc["prefill_tokens_saved"] == sum(r.prompt_tokens for r in reqs)
    assert sum(pc["hit_tokens_by_tier"].values()) == pc["prefill_tokens_saved"]
    # the same run without the cache prefills every prompt token, and spends more prefill GPU time
    _, off = _run(scenario(sim={"policies": {"prefiller": policy}}))
    assert sum(rec[5] for rec in off.log.records if rec[1] == "prefill") == sum(r.prompt_tokens for r in reqs)
    busy = [sum(x.breakdown_s["prefill"].values()) for x in (res, off)]   # priced prefill compute, seconds
    assert busy[0] < busy[1]


def test_fast_path_equals_reference_path_with_caches():
    sc = scenario(prefix_cache={"enabled": True, "hbm_gb_per_gpu": 1.0, "host_gb_per_gpu": 2.0},
                  sim={"policies": {"prefiller": "kv_aware"}})
    _, fast = _run(sc, decision_log=True)
    _, ref = _run(sc, decision_log=True, fast_decode=False)
    assert fast.log.digest() == ref.log.digest() and fast.rows == ref.rows
    assert fast.metrics == ref.metrics
    assert fast.metrics["prefix_cache"]["hit_tokens_by_tier"]["host"] > 0


def test_cache_off_is_the_default_and_changes_nothing():
    sc = scenario()
    assert not sc.prefix_cache.enabled and build(sc).prefix_cache is None
    _, a = simulate_scenario(sc)
    _, b = simulate_scenario(scenario(prefix_cache={"enabled": False, "block_tokens": 256}))
    assert "prefix_cache" not in a.metrics and a.metrics == b.metrics and a.log.digest() == b.log.digest()
    assert all(rec[6] == "" for rec in a.log.records if rec[1] == "route_prefill")


@pytest.mark.slow
def test_aggregated_workers_cache_too():
    sc = parse_scenario({**{k: v for k, v in BASE.items() if k not in ("prefill", "decode")},
                         "topology": "hgx-h200", "deployment": "aggregated",
                         "aggregated": {"workers": 2, "tp": 1, "dp": 4, "ep": 4},
                         "workload": {**BASE["workload"], "max_requests": 60},
                         "prefix_cache": {"enabled": True}, "sim": {"policies": {"worker": "kv_aware"}}})
    _, res = simulate_scenario(sc)
    assert res.metrics["prefix_cache"]["prefill_tokens_saved"] > 0
    assert all(r[4] == "done" for r in res.rows)


@pytest.mark.parametrize("upd,field", [
    ({"prefix_cache": {"enabled": True, "block_tokens": 300}}, "prefix_cache.block_tokens"),
    ({"prefix_cache": {"enabled": True, "hbm_gb_per_gpu": 0.001}}, "prefix_cache.hbm_gb_per_gpu"),
    ({"prefix_cache": {"enabled": True, "eviction": "fifo"}}, "prefix_cache.eviction"),
    ({"sim": {"policies": {"prefiller": "kv_awre"}}}, "sim.policies.prefiller"),
    ({"sim": {"policies": {"kv_aware_weight": -1}}}, "sim.policies.kv_aware_weight"),
    ({"prefix_cache": {"enabled": True},
      "workload": {"kind": "synthetic", "arrival": {"kind": "poisson", "rate_per_s": 1.0}, "n_requests": 5,
                   "prompt": {"kind": "lognormal", "p50": 100, "p90": 200, "max_tokens": 400},
                   "output": {"kind": "lognormal", "p50": 10, "p90": 20, "max_tokens": 40}}},
     "prefix_cache.enabled"),
])
def test_bad_fields_are_one_line_errors(upd, field):
    with pytest.raises(UserError) as e:
        simulate_scenario(scenario(**upd))
    msg = str(e.value)
    assert field in msg and "\n" not in msg, msg


def test_gb200_host_tier_from_the_topology():
    b = build(scenario(prefix_cache={"enabled": True}))
    spec = b.prefix_cache
    assert [t.name for t in spec.lower] == ["host"]
    assert spec.tier_GBps == (256.0,)               # Grace LPDDR5X 512 GB/s shared by its 2 GPUs, < C2C 450
    kvb = b.model.kv_bytes_per_token(2)
    assert spec.lower[0].capacity_blocks == int(240e9 * 4 // (512 * kvb))
    assert np.isclose(spec.load_s(((0, 1, 256e9),), 4), 0.25 + 0.5e-6)
