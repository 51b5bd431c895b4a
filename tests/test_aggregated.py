"""Aggregated workers in the scheduler, driven by hand (no SimPy): a request's life through chunked prefill and
decode on one rank, the per-step token budget, routing across workers, and a hypothesis state machine over random
arrivals, completions and worker failures that checks requests and KV reservations are conserved."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from test_scheduler import MiniDriver, req
from test_sim_driver_models import KV_BYTES_PER_TOKEN

from rackbed.engine.core.deployment import AggregatedGroup, AggregatedTemplate, Deployment, MtpSpec
from rackbed.engine.core.plans import Idle, MixedStep
from rackbed.engine.core.policies import Policies
from rackbed.engine.core.scheduler import Scheduler


def agg_deployment(*, n_workers: int = 2, dp: int = 2, tp: int = 1, cap: int = 4, kv_rank: int = 4000,
                   budget: int = 512, chunk: int | None = 256, page: int = 16, draft_k: int = 0,
                   max_queue: int | None = None) -> Deployment:
    """``n_workers`` aggregated workers of ``tp * dp`` GPUs, hosts of 8 GPUs, one NVLink domain per host."""
    t = AggregatedTemplate(tp=tp, dp=dp, ep=tp * dp, max_batch_per_rank=cap, max_batch_tokens=budget,
                           chunk_tokens=chunk, kv_capacity_tokens_per_rank=kv_rank, kv_page_tokens=page,
                           max_queue_requests=max_queue)
    n = t.n_gpus
    gpus = list(range(n * n_workers))
    groups = tuple(AggregatedGroup(id=f"A{i}", gpus=tuple(range(n * i, n * (i + 1))), template=t)
                   for i in range(n_workers))
    return Deployment(prefillers=(), decoders=(), kv_bytes_per_token=KV_BYTES_PER_TOKEN,
                      gpu_host={g: g // 8 for g in gpus}, gpu_nic={g: f"nic:{g}" for g in gpus},
                      nic_GBps={f"nic:{g}": 50.0 for g in gpus}, gpu_domain={g: g // 8 for g in gpus},
                      mtp=MtpSpec(draft_k=draft_k), aggregated=groups)


def test_a_request_prefills_in_chunks_then_decodes_on_its_rank():
    s = Scheduler(agg_deployment(n_workers=1, dp=1, budget=300, chunk=128), np.random.default_rng(0))
    d = MiniDriver(s)
    assert s.worker_ids() == ["A0"] and type(d.plan["A0"]) is Idle
    d.arrive(req(0, 0.0, 300, 3))
    p = d.plan["A0"]
    assert type(p) is MixedStep and p.prefill == ((0, 0, 0, 128),) and p.rank_batch == (0,)
    assert s.state_of(0) == "prefilling" and s.workers["A0"].rank_free_kv[0] == 4000 - 304  # 302 tokens, pages
    d.complete("A0", 0.1)
    assert d.plan["A0"].prefill == ((0, 0, 128, 128),)
    d.complete("A0", 0.1)
    assert d.plan["A0"].prefill == ((0, 0, 256, 44),)
    d.complete("A0", 0.1)
    assert s.rows == [] and s.reqs[0].generated == 1  # first token out; it joined the batch at the boundary
    p = d.plan["A0"]
    assert p.prefill == () and p.rank_batch == (1,) and p.joined == ((0, 0),)
    d.complete("A0", 0.1)
    d.complete("A0", 0.1)
    assert s.state_of(0) == "done"
    row = dict(zip(("id", "arrival", "prompt", "out", "status", "reason", "first", "end"), s.rows[0]))
    assert row["first"] == pytest.approx(0.3) and row["end"] == pytest.approx(0.5)  # TTFT after the 3rd chunk
    assert s.workers["A0"].rank_free_kv == [4000] and s.busy_gpu_s["aggregated"] > 0
    s.check_invariants()


def test_decode_tokens_come_first_in_the_rank_budget():
    s = Scheduler(agg_deployment(n_workers=1, dp=1, budget=100, chunk=None, cap=8, draft_k=1),
                  np.random.default_rng(0))
    d = MiniDriver(s)
    for i in range(3):
        d.arrive(req(i, 0.0, 10, 50))
    p = d.plan["A0"]
    assert p.prefill == ((0, 0, 0, 10),)  # the worker took request 0 before 1 and 2 arrived
    d.complete("A0", 0.01)
    p = d.plan["A0"]
    assert p.rank_batch == (1,) and [it[0] for it in p.prefill] == [1, 2]
    d.arrive(req(3, d.now, 95, 5))  # 3 sequences decode (2 tokens each with one draft): 94 tokens of room left
    d.complete("A0", 0.01)
    p = d.plan["A0"]
    assert p.rank_batch == (3,) and p.prefill == ((3, 0, 0, 95),) and p.rank_prefill_tokens == (95,)  # alone
    d.arrive(req(4, d.now, 95, 5))
    d.complete("A0", 0.01)
    p = d.plan["A0"]
    assert p.prefill == ((4, 0, 0, 95),) and p.rank_batch == (4,)
    d.drain()
    assert all(r[4] == "done" for r in s.rows)


def test_least_requests_routing_spreads_decode_load_over_workers():
    def held(policies):
        s = Scheduler(agg_deployment(n_workers=3, dp=1, cap=8), np.random.default_rng(0), policies=policies)
        d = MiniDriver(s)
        for i in range(6):
            d.arrive(req(i, d.now, 20, 100))
            while s.state_of(i) in ("queued_prefill", "prefilling"):  # prefilled before the next arrives
                d.complete(s.reqs[i].prefiller.id, 0.001)
        return [sum(s.workers[w].rank_nreq) for w in ("A0", "A1", "A2")]

    assert held(None) == [2, 2, 2]
    # least queued tokens sees no backlog anywhere (every prompt is prefilled by then): the first worker takes all
    assert held(Policies.named(worker="least_queued_tokens")) == [6, 0, 0]


def test_rejections_name_the_aggregated_reasons():
    s = Scheduler(agg_deployment(n_workers=1, dp=1, kv_rank=1000, max_queue=1), np.random.default_rng(0))
    d = MiniDriver(s)
    d.arrive(req(0, 0.0, 990, 20))
    d.arrive(req(1, 0.0, 100, 5))
    d.arrive(req(2, 0.0, 100, 5))
    d.arrive(req(3, 0.0, 100, 5))
    reasons = {r[0]: r[5] for r in s.rows}
    assert reasons == {0: "exceeds_worker_kv", 3: "queue_full"}
    d.fail("gpu:0")
    d.arrive(req(4, d.now, 10, 5))
    d.drain()
    assert {r[0]: r[5] for r in s.rows}[4] == "no_worker"
    assert sorted(r[0] for r in s.rows) == [0, 1, 2, 3, 4] and all(r[4] == "rejected" for r in s.rows)


# ------------------------------------------------------------------ stateful property test
class AggregatedMachine(RuleBasedStateMachine):
    """Random arrivals, completions in any order and failures of workers' GPUs; the invariants (every request in
    one place, KV reservations = capacity - free per rank, requests per rank within the cap, token counters)
    after every call; at the end every request is done or rejected with a reason and every rank's KV is free."""

    @initialize(chunk=st.sampled_from([None, 64, 200]), k=st.integers(0, 2), cap=st.integers(1, 4),
                kv=st.integers(600, 3000), dp=st.integers(1, 3), budget=st.integers(64, 600), seed=st.integers(0, 3))
    def setup(self, chunk, k, cap, kv, dp, budget, seed):
        budget = max(budget, cap * (1 + k) + 1)
        self.s = Scheduler(agg_deployment(n_workers=3, dp=dp, cap=cap, kv_rank=kv, budget=budget, chunk=chunk,
                                          draft_k=k, max_queue=8), np.random.default_rng(seed))
        self.d = MiniDriver(self.s)
        self.n = 0
        self.faults = 0

    @rule(p=st.integers(1, 1200), o=st.integers(1, 30), dt=st.floats(0, 0.05))
    def arrive(self, p, o, dt):
        self.d.arrive(req(self.n, self.d.now + dt, p, o))
        self.n += 1

    @precondition(lambda self: bool(self.d.busy()))
    @rule(i=st.integers(0, 100), dur=st.floats(0.0, 0.05))
    def complete(self, i, dur):
        b = self.d.busy()
        self.d.complete(b[i % len(b)], dur)

    @precondition(lambda self: self.faults < 2)
    @rule(gpu=st.integers(0, 100))
    def fault(self, gpu):
        self.faults += 1
        self.d.fail(f"gpu:{gpu % len(self.s.dep.gpu_host)}")

    @invariant()
    def consistent(self):
        self.s.check_invariants()

    def teardown(self):
        self.d.drain()
        s = self.s
        s.check_invariants()
        assert s.n_open == 0 and len(s.rows) == self.n
        assert sorted(r[0] for r in s.rows) == list(range(self.n))
        for r in s.rows:
            assert r[4] in ("done", "rejected") and (r[4] == "rejected") == bool(r[5]), r
        for w in s.decoders:
            if w.status != 3:  # live workers: every reservation released
                assert w.rank_free_kv == [w.kv_cap] * w.ep and not any(w.rank_nreq), w.id
        if self.faults == 0:
            assert all(r[4] == "done" or r[5] in ("queue_full", "exceeds_worker_kv") for r in s.rows)


TestAggregatedMachine = AggregatedMachine.TestCase
TestAggregatedMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                          suppress_health_check=[HealthCheck.too_slow])
TestAggregatedMachine.pytestmark = [pytest.mark.slow]
