"""Shortest-prompt-first decode admission (``engine.core.policies.ShortestPromptFirst``): it takes the shortest
prompts of a rank's queue (ties in queue order) and leaves the rest in order; in the scheduler, a rank that frees a
slot admits its shortest waiting prompt; the simulator's fast path (certified: the policy is state-only) gives the
step-by-step results under it, and the policy changes what a loaded run does."""

from __future__ import annotations

from collections import deque

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_scheduler import MiniDriver, req
from test_sim_driver_fastdecode import GridCost, _assert_same, _both
from test_sim_driver_models import poisson_requests, small_deployment

from rackbed.engine.core.plans import PrefillBatch
from rackbed.engine.core.policies import ADMISSION, Policies, ShortestPromptFirst
from rackbed.engine.core.scheduler import Scheduler
from rackbed.sim import fastpath
from rackbed.sim.driver import simulate

SPF = Policies(admission=ShortestPromptFirst())


class _R:
    def __init__(self, i, prompt):
        self.id, self.prompt = i, prompt


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(1, 6), max_size=10), st.integers(1, 12))
def test_takes_the_shortest_prompts_and_keeps_the_rest_in_order(prompts, room):
    rs = [_R(i, p) for i, p in enumerate(prompts)]
    q = deque(rs)
    got = ShortestPromptFirst().take(q, room)
    want = sorted(rs, key=lambda r: (r.prompt, r.id))[:room]
    assert [r.id for r in got] == [r.id for r in want]
    assert [r.id for r in q] == [r.id for r in rs if r not in want]


def test_registered_and_certified():
    assert ADMISSION["shortest_prompt"] is ShortestPromptFirst
    assert type(Policies.named(admission="shortest_prompt").admission) is ShortestPromptFirst
    assert fastpath.certified(SPF)


def test_a_freed_slot_goes_to_the_shortest_waiting_prompt():
    # one rank, batch cap 1: request 0 decodes; 1 (long) and 2 (short) wait for its slot, 2 gets it
    s = Scheduler(small_deployment(n_pf=1, n_dec=1, ep=1, batch_cap=1, draft_k=0), np.random.default_rng(0),
                  policies=SPF)
    d = MiniDriver(s)
    d.arrive(req(0, 0.0, 100, 3))
    d.complete("P0", 0.1)
    d.complete("P0.kv0", 0.01)
    d.arrive(req(1, 0.2, 900, 3))
    d.arrive(req(2, 0.2, 50, 3))
    while type(d.plan["P0"]) is PrefillBatch:
        d.complete("P0", 0.1)
    d.complete("P0.kv0", 0.01)
    d.complete("P0.kv0", 0.01)
    assert [s.state_of(i) for i in range(3)] == ["decoding", "queued_decode", "queued_decode"]
    d.drain()
    admits = [r[3] for r in s.log.records if r[1] == "admit"]
    assert admits == [0, 2, 1]
    s.check_invariants()


@pytest.mark.slow
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**16), n_dec=st.integers(1, 2), ep=st.sampled_from([1, 2, 4]), cap=st.integers(1, 6),
       draft_k=st.integers(0, 2), shift=st.sampled_from([0, 9, 13]), log=st.booleans(),
       fault=st.sampled_from([None, "decoder_gpu", "nic"]))
def test_fast_path_is_the_reference_path_under_it(seed, n_dec, ep, cap, draft_k, shift, log, fault):
    dep = small_deployment(n_pf=2, n_dec=n_dec, ep=ep, batch_cap=cap, draft_k=draft_k, accept_p=0.8)
    reqs = poisson_requests(80, 25.0, seed, prompt_mean=1500, out_mean=60, prompt_max=5000, out_max=300)
    faults = []
    if fault == "decoder_gpu":
        faults = [{"at_s": 0.7 + (seed % 7) * 0.3, "target": f"gpu:{dep.decoders[-1].gpus[0]}"}]
    elif fault == "nic":
        faults = [{"at_s": 0.4 + (seed % 3) * 0.5, "target": f"nic:{dep.decoders[0].gpus[0]}", "duration_s": 0.5}]
    a, b = _both(dep, reqs, GridCost(shift), seed=seed, faults=faults, decision_log=log, policies=SPF)
    _assert_same(a, b)


def test_a_loaded_run_admits_differently_and_takes_the_fast_path():
    dep = small_deployment(n_pf=2, n_dec=1, ep=2, batch_cap=4, draft_k=1)
    reqs = poisson_requests(200, 30.0, 3, prompt_mean=1500, out_mean=150)
    spf = simulate(dep, reqs, GridCost(10), seed=1, progress=False, policies=SPF)
    fifo = simulate(dep, reqs, GridCost(10), seed=1, progress=False)
    assert spf.perf["fast_decode_steps"] > 0.5 * spf.perf["decode_steps"]
    admits = [r[3] for r in spf.log.records if r[1] == "admit"]
    assert admits != [r[3] for r in fifo.log.records if r[1] == "admit"]
    assert spf.metrics["requests"]["done"] == fifo.metrics["requests"]["done"] == len(reqs)
