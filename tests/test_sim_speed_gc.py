"""Simulator speed, round 6: the cyclic collector is off during a simulated run and is given back as it was.

``simulate`` turns the collector off for a run with the simulated environment (collecting the young generations
every ``engine.loop.runloop.GC_EVERY`` events) and afterwards moves what the run kept to the oldest generation
without a traversal; with any other environment it raises the young-generation threshold instead. Either way the
collector's state (enabled or not, thresholds, frozen objects) is the caller's again afterwards — also when the run
raises — and the results are those of a run with the collector on.
"""

from __future__ import annotations

import gc
import json

import pytest
from test_sim_driver_fastdecode import GridCost
from test_sim_driver_models import poisson_requests, small_deployment

from rackbed.engine.loop import runloop
from rackbed.sim import driver
from rackbed.sim.driver import simulate


def _run(n=120, **kw):
    dep = small_deployment(n_pf=2, n_dec=2, ep=4, batch_cap=8, draft_k=1)
    reqs = poisson_requests(n, 40.0, 3, prompt_mean=1500, out_mean=100, prompt_max=5000, out_max=400)
    return simulate(dep, reqs, GridCost(6), seed=3, progress=False, **kw)


@pytest.mark.parametrize("enabled", [True, False])
def test_collector_state_is_restored(enabled):
    th = gc.get_threshold()
    was = gc.isenabled()
    try:
        if not enabled:
            gc.disable()
        seen = []
        orig = runloop._gc_pause

        def pause(off):
            state = orig(off)
            seen.append((off, gc.isenabled()))
            return state

        runloop._gc_pause = pause
        try:
            _run()
        finally:
            runloop._gc_pause = orig
        assert seen == [(True, False)]  # the simulated environment: off during the run
        assert gc.isenabled() is enabled
        assert gc.get_threshold() == th
        assert gc.get_freeze_count() == 0
    finally:
        if was:
            gc.enable()


def test_collector_state_is_restored_after_an_error(monkeypatch):
    th = gc.get_threshold()
    assert gc.isenabled()

    def boom(*a, **k):
        raise RuntimeError("boom")

    monkeypatch.setattr(driver.Scheduler, "advance_decoder", boom)
    with pytest.raises(RuntimeError, match="boom"):
        _run()
    assert gc.isenabled()
    assert gc.get_threshold() == th


@pytest.mark.slow
def test_frozen_objects_of_the_caller_stay_frozen():
    gc.freeze()
    try:
        n = gc.get_freeze_count()
        _run()
        assert 0 < gc.get_freeze_count() <= n  # none of the run's objects frozen (some of the caller's freed)
        assert gc.isenabled()
    finally:
        gc.unfreeze()


def test_periodic_collection_and_same_results(monkeypatch):
    """A collection every few events (the long-run safety valve) changes nothing in the results."""
    a = _run(2000)
    assert a.perf["events"] > 2 * 4096
    calls = []
    orig_collect = gc.collect

    def collect(*args):
        calls.append(args)
        return orig_collect(*args)

    monkeypatch.setattr(runloop, "GC_EVERY", 4096)
    monkeypatch.setattr(runloop.gc, "collect", collect)
    b = _run(2000)
    assert calls and all(c == (1,) for c in calls)
    assert (a.rows, a.spans, a.samples, a.groups, a.breakdown_s, a.nic_utilisation) == \
        (b.rows, b.spans, b.samples, b.groups, b.breakdown_s, b.nic_utilisation)
    assert json.dumps(a.metrics, sort_keys=True, default=str) == json.dumps(b.metrics, sort_keys=True, default=str)
    assert a.log.records == b.log.records
    assert [a.perf[k] for k in ("events", "fast_decode_steps", "decode_steps")] == \
        [b.perf[k] for k in ("events", "fast_decode_steps", "decode_steps")]


def test_real_environment_keeps_the_collector_on():
    th = gc.get_threshold()
    state = runloop._gc_pause(False)
    try:
        assert gc.isenabled()
        assert gc.get_threshold()[0] == max(th[0], runloop.GC_GEN0)
    finally:
        runloop._gc_resume(state)
    assert gc.get_threshold() == th
