"""The decode fast path (``sim.fastpath``) talks to the scheduler only through ``advance_decoder`` /
``plain_steps`` / ``decode_plan`` and a read-only view: a run whose views refuse every write (and hand out copies
of their lists) is the reference run; the view's change counter moves whenever a decoder's status, queues or batch
change; a wrong plain-step claim is refused; an admission policy the fast path is not certified for makes the run
fall back to the reference path for decoders, with the reference results."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_scheduler import MiniDriver, req
from test_sim_driver_fastdecode import GridCost, _assert_same, _both
from test_sim_driver_models import poisson_requests, small_deployment

from rackbed.engine.core.decision_log import DecisionLog
from rackbed.engine.core.policies import FifoAdmission, Policies
from rackbed.engine.core.scheduler import Scheduler
from rackbed.sim import fastpath
from rackbed.sim.driver import simulate


class _ReadOnlyView:
    """A decoder view that refuses writes and hands out copies (tuples) of the state's lists."""

    __slots__ = ("_d",)

    def __init__(self, d) -> None:
        object.__setattr__(self, "_d", d)

    def __getattr__(self, name):
        v = getattr(self._d, name)
        return tuple(v) if isinstance(v, list) else v

    def __setattr__(self, name, value):
        raise AssertionError(f"the fast path wrote {name} of a decoder view")


@pytest.mark.slow
@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])  # the patch is constant
@given(seed=st.integers(0, 2**16), shift=st.sampled_from([0, 8, 12]), log=st.booleans(), fault=st.booleans())
def test_fast_path_only_reads_the_view(monkeypatch, seed, shift, log, fault):
    orig = Scheduler.decoder_view
    monkeypatch.setattr(Scheduler, "decoder_view", lambda self, w: _ReadOnlyView(orig(self, w)))
    dep = small_deployment(n_pf=2, n_dec=2, ep=4, batch_cap=6, draft_k=1)
    reqs = poisson_requests(120, 30.0, seed, prompt_mean=1500, out_mean=100, prompt_max=5000, out_max=400)
    faults = [{"at_s": 0.8 + (seed % 5) * 0.3, "target": f"gpu:{dep.decoders[0].gpus[0]}"}] if fault else []
    a, b = _both(dep, reqs, GridCost(shift), seed=seed, decision_log=log, faults=faults)
    _assert_same(a, b)
    assert a.perf["fast_decode_steps"] > 0


def _snapshot(d):
    return (d.status, tuple(len(q) for q in d.rank_queue), tuple(d.rank_batch), d.n_qdec)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=st.lists(st.tuples(st.sampled_from(["arrive", "complete", "timer", "fault"]), st.integers(0, 99)),
                    min_size=5, max_size=60), seed=st.integers(0, 3))
def test_change_counter_moves_with_status_queues_and_batch(ops, seed):
    dep = small_deployment(n_pf=1, n_dec=2, ep=2, batch_cap=2, kv_rank=6000, draft_k=1, spare_hosts=1, page=16)
    s = Scheduler(dep, np.random.default_rng(seed), prefill_tokens_per_s=20_000.0)
    drv = MiniDriver(s)
    seen = {d.id: (_snapshot(d), d.changes) for d in s.decoders}
    n = 0
    for op, x in ops:
        if op == "arrive":
            drv.arrive(req(n, drv.now + x * 1e-3, 100 + 40 * x, 2 + x % 9))
            n += 1
        elif op == "complete" and drv.busy():
            b = drv.busy()
            drv.complete(b[x % len(b)], 0.01)
        elif op == "timer":
            drv.fire_timers()
        elif op == "fault" and x < 5:
            drv.fail(f"gpu:{4 + x % 4}")
        for d in s.decoders:
            snap, changes = seen.get(d.id, (None, -1))
            if snap is not None and snap != _snapshot(d):
                assert d.changes != changes, f"{d.id} changed without its counter moving"
            seen[d.id] = (_snapshot(d), d.changes)


def test_a_wrong_plain_step_claim_is_refused():
    s = Scheduler(small_deployment(n_pf=1, n_dec=1, ep=1, draft_k=0), np.random.default_rng(0),
                  log=DecisionLog(enabled=False))
    drv = MiniDriver(s)
    drv.arrive(req(1, 0.0, 100, 4))       # 3 decode steps: steps 0, 1, 2
    drv.complete("P0", 0.1)
    drv.complete("P0.kv0", 0.01)
    assert s.decoder_view("D0").step == 0
    with pytest.raises(RuntimeError, match="not plain"):
        s.plain_steps("D0", 3)            # the request finishes at step 2
    s.plain_steps("D0", 2)
    assert s.decoder_view("D0").step == 2 and s.decode_steps == 2


class _HeldBackAdmission(FifoAdmission):
    """FIFO admission declared time-dependent (not state-only): the fast path is not certified for it."""

    name = "held_back"
    state_only = False


def test_uncertified_admission_falls_back_to_the_reference_path():
    assert fastpath.certified(Policies()) and not fastpath.certified(Policies(admission=_HeldBackAdmission()))
    dep = small_deployment(n_pf=2, n_dec=2, ep=4, batch_cap=8, draft_k=1)
    reqs = poisson_requests(150, 20.0, 5, prompt_mean=1500, out_mean=120)
    pol = Policies(admission=_HeldBackAdmission())
    a = simulate(dep, reqs, GridCost(10), seed=1, progress=False, policies=pol)
    b = simulate(dep, reqs, GridCost(10), seed=1, progress=False, fast_decode=False)
    assert a.perf["fast_decode_steps"] == 0 and a.perf["decode_steps"] > 0   # the fallback was taken
    assert a.rows == b.rows and a.log.records == b.log.records and a.spans == b.spans
