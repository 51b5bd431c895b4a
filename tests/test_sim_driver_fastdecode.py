"""The decode fast path (``sim.fastpath``: decoder steps run by the main loop through ``Scheduler.advance_decoder``)
changes nothing: a run with it and the same run step by step (``simulate(..., fast_decode=False)``) produce
identical rows, decision logs, spans, samples, metrics, breakdowns and NIC figures — on random deployments,
workloads, MTP settings, faults (which interrupt fast-forwarded steps) and autoscaling (draining decoders), with a
cost model priced on a context grid (the fast path then skips recomputing contexts) and one priced exactly
(recomputed every step)."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_sim_driver_models import KV_BYTES_PER_TOKEN, AnalyticCost, poisson_requests, small_deployment

from rackbed.engine.core.autoscaler import AutoscalerConfig
from rackbed.engine.core.plans import DecodeStep
from rackbed.sim.costs.steptime import StepTime
from rackbed.sim.driver import simulate


class GridCost(AnalyticCost):
    """:class:`AnalyticCost` with the decode step priced from the busiest rank on a context grid of
    ``2**shift`` tokens (``shift = 0``: exact), through ``decode_point`` as ``sim.executor`` documents it."""

    def __init__(self, shift: int) -> None:
        self.shift = shift

    def decode_point(self, group, max_batch: int, max_ctx: int, draft_k: int) -> tuple[StepTime, int]:
        lo = (int(max_ctx) >> self.shift) << self.shift
        hi = lo + (1 << self.shift) - 1
        mid = lo + (1 << self.shift >> 1)
        st = StepTime(attn_s=mid * KV_BYTES_PER_TOKEN / self.hbm_Bps,
                      moe_gemm_s=max_batch * (draft_k + 1) * self.decode_per_seq_token_s,
                      other_s=self.decode_fixed_s)
        return st, hi

    def decode(self, plan: DecodeStep, group) -> StepTime:
        return self.decode_point(group, max(plan.rank_batch), max(plan.rank_context_tokens), plan.draft_k)[0]


def _both(dep, reqs, cm, **kw):
    a = simulate(dep, reqs, cm, progress=False, fast_decode=True, **kw)
    b = simulate(dep, reqs, cm, progress=False, fast_decode=False, **kw)
    return a, b


def _assert_same(a, b) -> None:
    assert a.rows == b.rows
    assert a.log.records == b.log.records
    assert a.spans == b.spans
    assert a.samples == b.samples
    assert a.groups == b.groups
    assert json.dumps(a.metrics, sort_keys=True, default=str) == json.dumps(b.metrics, sort_keys=True, default=str)
    assert a.breakdown_s == b.breakdown_s
    assert a.nic_utilisation == b.nic_utilisation
    assert a.perf["events"] == b.perf["events"] and a.perf["decode_steps"] == b.perf["decode_steps"]
    assert b.perf["fast_decode_steps"] == 0


@pytest.mark.slow
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**16), n_dec=st.integers(1, 3), ep=st.sampled_from([1, 2, 4]),
       cap=st.integers(1, 8), draft_k=st.integers(0, 3), accept_p=st.sampled_from([0.0, 0.6, 0.8, 1.0]),
       rate=st.floats(2.0, 40.0), n=st.integers(1, 80), shift=st.sampled_from([0, 4, 9, 13]),
       page=st.sampled_from([1, 16]), kv_rank=st.sampled_from([6_000, 40_000]),
       fault=st.sampled_from([None, "decoder_gpu", "prefiller_gpu", "nic"]),
       until=st.sampled_from([None, 3.0]), log=st.booleans())
def test_fast_forward_is_step_by_step(seed, n_dec, ep, cap, draft_k, accept_p, rate, n, shift, page, kv_rank,
                                      fault, until, log):
    dep = small_deployment(n_pf=2, n_dec=n_dec, ep=ep, batch_cap=cap, draft_k=draft_k, accept_p=accept_p,
                           page=page, kv_rank=kv_rank)
    reqs = poisson_requests(n, rate, seed, prompt_mean=1500, out_mean=60, prompt_max=5000, out_max=400)
    faults = []
    if fault == "decoder_gpu":
        faults = [{"at_s": 0.7 + (seed % 7) * 0.3, "target": f"gpu:{dep.decoders[-1].gpus[0]}"}]
    elif fault == "prefiller_gpu":
        faults = [{"at_s": 0.5 + (seed % 5) * 0.2, "target": "gpu:1", "duration_s": 1.0}]
    elif fault == "nic":
        faults = [{"at_s": 0.4 + (seed % 3) * 0.5, "target": f"nic:{dep.decoders[0].gpus[0]}", "duration_s": 0.5}]
    a, b = _both(dep, reqs, GridCost(shift), seed=seed, faults=faults, until_s=until, decision_log=log,
                 debug_checks=seed % 4 == 0)
    _assert_same(a, b)


@pytest.mark.slow
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**16), rate=st.floats(5.0, 60.0), shift=st.sampled_from([0, 10]))
def test_fast_forward_with_autoscaler(seed, rate, shift):
    dep = small_deployment(n_pf=1, n_dec=1, ep=2, batch_cap=4, spare_hosts=3, draft_k=1)
    reqs = poisson_requests(120, rate, seed, prompt_mean=1200, out_mean=80, prompt_max=4000, out_max=300)
    asc = AutoscalerConfig(interval_s=0.5, scale_up_delay_s=0.3, decode_batch_threshold=2.0,
                           scale_down_frac=0.9, max_decoders=3)
    a, b = _both(dep, reqs, GridCost(shift), seed=seed, autoscaler=asc, prefill_tokens_per_s=60_000.0)
    _assert_same(a, b)


def test_fast_forward_does_the_work():
    """A loaded run fast-forwards almost every decode step (and the grid lets it skip context recomputation)."""
    dep = small_deployment(n_pf=2, n_dec=2, ep=4, batch_cap=16, draft_k=1)
    reqs = poisson_requests(300, 20.0, 5, prompt_mean=1500, out_mean=150)
    a, b = _both(dep, reqs, GridCost(10), seed=1)
    _assert_same(a, b)
    assert a.perf["fast_decode_steps"] > 0.9 * a.perf["decode_steps"]


def test_no_fast_forward_without_decode_point():
    """A cost model without ``decode_point`` runs step by step (nothing to price a step without its plan)."""
    dep = small_deployment()
    res = simulate(dep, poisson_requests(40, 6.0, 2), AnalyticCost(), seed=0, progress=False)
    assert res.perf["fast_decode_steps"] == 0 and res.perf["decode_steps"] > 0


class _ScalingWrapper:
    """A wrapper like ``sim.engine_calibration.EngineCalibratedCostModel``: changes ``decode``, delegates the rest
    (``decode_point`` included) through ``__getattr__`` — the driver must not use the wrapped ``decode_point``."""

    def __init__(self, base) -> None:
        self.base = base

    def __getattr__(self, name):
        return getattr(self.base, name)

    def decode(self, plan, group):
        st_ = self.base.decode(plan, group)
        return StepTime(attn_s=st_.attn_s * 3, moe_gemm_s=st_.moe_gemm_s, other_s=st_.other_s)


def test_delegated_decode_point_is_not_used():
    dep = small_deployment(n_pf=2, n_dec=2, ep=2, batch_cap=8, draft_k=1)
    reqs = poisson_requests(60, 10.0, 4)
    res = simulate(dep, reqs, _ScalingWrapper(GridCost(8)), seed=0, progress=False)
    assert res.perf["fast_decode_steps"] == 0 and res.perf["decode_steps"] > 0
    plain = simulate(dep, reqs, GridCost(8), seed=0, progress=False)
    assert res.metrics["latency_s"]["tpot"]["p50"] > plain.metrics["latency_s"]["tpot"]["p50"]  # the wrapper counts
