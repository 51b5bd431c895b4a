"""Plain decode steps taken by the main loop without calling the scheduler (``sim.fastpath``, reported through
``Scheduler.plain_steps``, decision log off) change nothing: the same rows, spans, samples, metrics and breakdowns as step by
step — with autoscaling (draining decoders) and faults — and they are most of a loaded run's steps."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_sim_driver_fastdecode import GridCost, _assert_same, _both
from test_sim_driver_models import poisson_requests, small_deployment

from rackbed.engine.core.autoscaler import AutoscalerConfig
from rackbed.engine.core.scheduler import Scheduler


@pytest.mark.slow
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**16), rate=st.floats(5.0, 60.0), shift=st.sampled_from([0, 10]),
       fault=st.booleans())
def test_plain_steps_with_autoscaler_and_log_off(seed, rate, shift, fault):
    dep = small_deployment(n_pf=1, n_dec=1, ep=2, batch_cap=4, spare_hosts=3, draft_k=1)
    reqs = poisson_requests(120, rate, seed, prompt_mean=1200, out_mean=80, prompt_max=4000, out_max=300)
    asc = AutoscalerConfig(interval_s=0.5, scale_up_delay_s=0.3, decode_batch_threshold=2.0,
                           scale_down_frac=0.9, max_decoders=3)
    faults = [{"at_s": 0.6 + (seed % 5) * 0.4, "target": f"gpu:{dep.decoders[0].gpus[0]}"}] if fault else []
    a, b = _both(dep, reqs, GridCost(shift), seed=seed, autoscaler=asc, prefill_tokens_per_s=60_000.0,
                 faults=faults, decision_log=False)
    _assert_same(a, b)


def test_plain_steps_do_the_work(monkeypatch):
    taken = []
    orig = Scheduler.plain_steps

    def spy(self, worker, k):
        taken.append(k)
        return orig(self, worker, k)

    monkeypatch.setattr(Scheduler, "plain_steps", spy)
    dep = small_deployment(n_pf=2, n_dec=2, ep=4, batch_cap=16, draft_k=1)
    reqs = poisson_requests(300, 20.0, 5, prompt_mean=1500, out_mean=150)
    a, b = _both(dep, reqs, GridCost(10), seed=1, decision_log=False)
    _assert_same(a, b)
    assert sum(taken) > 0.5 * a.perf["decode_steps"]
    # with the decision log on, every step goes through the scheduler (it logs each)
    taken.clear()
    _both(dep, reqs, GridCost(10), seed=1, decision_log=True)
    assert not taken
