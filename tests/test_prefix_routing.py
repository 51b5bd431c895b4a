"""Prefix caching in the scheduler (``engine.core.prefix_cache`` on prefillers and aggregated workers) and the
routing policies that use or ignore it (``kv_aware``, ``round_robin``, ``random``): a request's cached prefix is not
prefilled (its batch item starts there), KV-aware routing follows the prefix, copies from a lower tier ride on
the batch (``PrefillBatch.loads``), a dead prefiller's cache is gone and its requests are routed again, and a
hypothesis state machine of random arrivals with shared prefixes, completions, faults and recoveries keeps every
invariant (pins included) and conserves requests: each ends done or rejected with a reason."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, rule
from test_aggregated import AggregatedMachine, agg_deployment
from test_scheduler import MiniDriver, SchedulerMachine
from test_sim_driver_models import KV_BYTES_PER_TOKEN, small_deployment

from rackbed.engine.core import autoscaler as asc
from rackbed.engine.core.plans import PrefillBatch
from rackbed.engine.core.policies import KvAwareRouting, Policies, RandomRouting, RoundRobinRouting
from rackbed.engine.core.prefix_cache import PrefixCacheSpec, TierSpec
from rackbed.engine.core.request import Request
from rackbed.engine.core.scheduler import Scheduler

B = 64


def spec(hbm=64, host=None, shared=None):
    lower = (TierSpec("host", host),) if host is not None else ()
    sh = TierSpec("storage", shared) if shared is not None else None
    n = len(lower) + (sh is not None)
    return PrefixCacheSpec(hbm_blocks=hbm, block_tokens=B, unit_tokens=B, lower=lower, shared=sh,
                           tier_GBps=(100.0,) * n)


def rq(i, t, prompt, out, ids):
    return Request(id=i, arrival_s=t, prompt_tokens=prompt, output_tokens=out, prefix_hash_ids=tuple(ids))


def test_cached_prefix_is_not_prefilled_and_kv_aware_follows_it():
    s = Scheduler(small_deployment(n_pf=2, n_dec=1, ep=2, draft_k=0), np.random.default_rng(0),
                  policies=Policies(prefiller=KvAwareRouting()), prefix_cache=spec())
    d = MiniDriver(s)
    d.arrive(rq(0, 0.0, 10 * B + 5, 4, range(11)))
    first = d.complete("P0", 0.1)
    assert first.items == ((0, 0, 10 * B + 5),)
    d.arrive(rq(1, 0.2, 10 * B + 30, 4, [*range(8), 100, 101, 102]))   # shares 8 blocks
    assert s.reqs[1].prefiller.id == "P0"                               # overlap 512 > its queue of 0
    b = d.plan["P0"]
    assert type(b) is PrefillBatch and b.items == ((1, 8 * B, 2 * B + 30),) and b.loads == ()
    note = next(r for r in s.log.records if r[1] == "route_prefill" and r[3] == 1)[6]
    assert note == f"kv_aware overlap={8 * B}"
    d.drain()
    st = s.prefix_cache_stats()
    assert st.requests == 2 and st.hit_blocks == [8] and st.prompt_tokens == 20 * B + 35
    assert sorted(r[4] for r in s.rows) == ["done", "done"]
    s.check_invariants()


def test_lower_tier_hit_loads_before_the_batch():
    s = Scheduler(small_deployment(n_pf=1, n_dec=1, ep=2, draft_k=0), np.random.default_rng(0),
                  prefix_cache=spec(hbm=4, host=16))
    d = MiniDriver(s)
    d.arrive(rq(0, 0.0, 4 * B + 1, 1, range(5)))
    d.complete("P0", 0.1)
    d.arrive(rq(1, 0.2, 4 * B + 1, 1, range(10, 15)))                  # evicts request 0's blocks to host
    d.complete("P0", 0.1)
    d.arrive(rq(2, 0.4, 4 * B + 1, 1, range(5)))
    b = d.plan["P0"]
    assert b.items == ((2, 4 * B, 1),) and b.loads == ((2, 1, 4 * B * KV_BYTES_PER_TOKEN),)
    assert spec(hbm=4, host=16).load_s(b.loads, 4) == 4 * B * KV_BYTES_PER_TOKEN / (4 * 100e9)
    d.drain()
    assert s.prefix_cache_stats().hit_blocks == [0, 4]


def test_dead_prefiller_cache_is_gone_and_requests_rerouted():
    s = Scheduler(small_deployment(n_pf=2, n_dec=1, ep=2, draft_k=0), np.random.default_rng(0),
                  policies=Policies(prefiller=KvAwareRouting(weight=0.5)), prefix_cache=spec())
    d = MiniDriver(s)
    d.arrive(rq(0, 0.0, 6 * B + 1, 3, range(7)))
    d.complete("P0", 0.1)
    for i in range(1, 4):                                  # all follow the prefix to P0
        d.arrive(rq(i, 0.1, 6 * B + 1, 3, range(7)))
    assert {s.reqs[i].prefiller.id for i in range(1, 4)} == {"P0"}
    d.fail("gpu:0")                                        # P0 = GPUs 0-3
    p0 = s.workers["P0"]
    assert p0.cache.used(0) == 0 and p0.cache.pinned() == 0
    s.check_invariants()
    assert {s.reqs[i].prefiller.id for i in range(1, 4) if i in s.reqs} <= {"P1"}
    d.drain()
    assert sorted(r[0] for r in s.rows) == [0, 1, 2, 3]
    assert all(r[4] == "done" for r in s.rows)


def test_round_robin_and_random_are_deterministic():
    def run(policy):
        s = Scheduler(small_deployment(n_pf=3, n_dec=1, ep=2, draft_k=0), np.random.default_rng(0),
                      policies=Policies(prefiller=policy), prefix_cache=spec())
        d = MiniDriver(s)
        for i in range(9):
            d.arrive(rq(i, 0.01 * i, 3 * B, 2, [i % 2, 7, 8]))
        return [s.reqs[i].prefiller.id for i in range(9)]
    assert run(RoundRobinRouting()) == ["P0", "P1", "P2"] * 3
    assert run(RandomRouting(3)) == run(RandomRouting(3))


class CachedSchedulerMachine(SchedulerMachine):
    """The scheduler state machine with prefix caches (HBM, host, shared storage) and a prefix-sharing workload,
    routed by each of the cache-era policies."""

    @initialize(chunked=st.booleans(), cap=st.integers(1, 4), kv=st.integers(1500, 6000), seed=st.integers(0, 3),
                autoscale=st.booleans(), policy=st.sampled_from(["kv_aware", "round_robin", "random"]),
                hbm=st.integers(0, 12), host=st.sampled_from([None, 0, 6]), shared=st.sampled_from([None, 8]))
    def setup(self, chunked, cap, kv, seed, autoscale, policy, hbm, host, shared):
        dep = small_deployment(n_pf=2, n_dec=2, ep=2, batch_cap=cap, kv_rank=kv, kv_pf=4000, budget=1500,
                               draft_k=1, chunked=chunked, max_queue=6, spare_hosts=2, page=16)
        cfg = asc.AutoscalerConfig(interval_s=0.05, scale_up_delay_s=0.1) if autoscale else None
        pol = Policies.named(prefiller=policy)
        self.s = Scheduler(dep, np.random.default_rng(seed), prefill_tokens_per_s=20_000.0, autoscaler=cfg,
                           policies=pol, prefix_cache=spec(hbm, host, shared))
        self.d = MiniDriver(self.s)
        self.n = 0
        self.faults = 0

    @rule(path=st.lists(st.integers(0, 2), min_size=0, max_size=30), extra=st.integers(1, 200),
          o=st.integers(1, 40), dt=st.floats(0, 0.05))
    def arrive(self, path, extra, o, dt):
        ids = [hash(tuple(path[:i + 1])) for i in range(len(path))]   # chained ids: equal id = equal prefix
        self.d.arrive(rq(self.n, self.d.now + dt, B * len(path) + extra, o, ids))
        self.n += 1


TestCachedSchedulerMachine = CachedSchedulerMachine.TestCase
TestCachedSchedulerMachine.settings = settings(max_examples=120, stateful_step_count=40, deadline=None,
                                               suppress_health_check=[HealthCheck.too_slow])
TestCachedSchedulerMachine.pytestmark = [pytest.mark.slow]


class CachedAggregatedMachine(AggregatedMachine):
    """The aggregated-worker state machine with a prefix cache per worker and a prefix-sharing workload."""

    @initialize(chunk=st.sampled_from([None, 64, 200]), cap=st.integers(1, 4), kv=st.integers(600, 3000),
                dp=st.integers(1, 3), budget=st.integers(64, 600), seed=st.integers(0, 3),
                policy=st.sampled_from(["kv_aware", "round_robin", "random", "least_requests"]),
                hbm=st.integers(0, 8), host=st.sampled_from([None, 4]))
    def setup(self, chunk, cap, kv, dp, budget, seed, policy, hbm, host):
        budget = max(budget, cap * 2 + 1)
        self.s = Scheduler(agg_deployment(n_workers=3, dp=dp, cap=cap, kv_rank=kv, budget=budget, chunk=chunk,
                                          draft_k=1, max_queue=8), np.random.default_rng(seed),
                           policies=Policies.named(worker=policy), prefix_cache=spec(hbm, host))
        self.d = MiniDriver(self.s)
        self.n = 0
        self.faults = 0

    @rule(path=st.lists(st.integers(0, 2), min_size=0, max_size=15), extra=st.integers(1, 100),
          o=st.integers(1, 30), dt=st.floats(0, 0.05))
    def arrive(self, path, extra, o, dt):
        ids = [hash(tuple(path[:i + 1])) for i in range(len(path))]
        self.d.arrive(rq(self.n, self.d.now + dt, B * len(path) + extra, o, ids))
        self.n += 1


TestCachedAggregatedMachine = CachedAggregatedMachine.TestCase
TestCachedAggregatedMachine.settings = settings(max_examples=80, stateful_step_count=40, deadline=None,
                                                suppress_health_check=[HealthCheck.too_slow])
TestCachedAggregatedMachine.pytestmark = [pytest.mark.slow]
