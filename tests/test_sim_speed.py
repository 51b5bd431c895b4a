"""Simulator speed, round 5: the faster paths give the same numbers.

- ``AcceptanceStream`` keeps its per-step token counts in a numpy array and draws them through
  ``standard_exponential`` where numpy's geometric sampler is an inversion of it: every ``take`` /
  ``tokens_after`` answer and the generator's state afterwards equal those of the list-and-``rng.geometric``
  stream it replaced (re-implemented below as the reference);
- the main loop drives prefillers, KV streams and the autoscaler itself (no SimPy process) when no fault can
  interrupt them, keeps the decoders' step ends in a queue of their own, and a decode lane (``sim.fastpath``) keeps a
  step's price across finishes / admissions that provably leave it unchanged: results, decision logs and event
  counts are those of the step-by-step run (``fast_decode=False``), and the shortcuts are taken.
"""

from __future__ import annotations

from bisect import bisect_left

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_sim_driver_fastdecode import GridCost, _assert_same, _both
from test_sim_driver_models import poisson_requests, small_deployment

from rackbed.engine.core.autoscaler import AutoscalerConfig
from rackbed.engine.core.specdec import AcceptanceStream, _geometric_by_inversion, draw_accepted
from rackbed.engine.loop.simenv import SimEnv
from rackbed.sim import driver, fastpath


class _RefStream:
    """The previous AcceptanceStream (Python list, bisect, ``draw_accepted``), as the reference."""

    def __init__(self, rng, k, p, chunk):
        self.rng, self.k, self.p, self.chunk = rng, k, p, chunk
        self.fixed = k + 1 if p >= 1.0 else (1 if (k == 0 or p <= 0.0) else 0)
        self.cum, self.pos = [0], 0

    def take(self, m):
        if self.fixed:
            return -(-m // self.fixed), [], 0
        if self.cum[-1] - self.cum[self.pos] < m:
            tail = self.cum[self.pos:]
            draws = (draw_accepted(self.rng, self.k, self.p, max(self.chunk, m)) + 1).cumsum()
            self.cum = [x - tail[0] for x in tail] + (draws + (tail[-1] - tail[0])).tolist()
            self.pos = 0
        end = bisect_left(self.cum, self.cum[self.pos] + m, self.pos + 1)
        out = (end - self.pos, self.cum, self.pos)
        self.pos = end
        return out

    def tokens_after(self, cum, start, steps, m):
        if not cum:
            return min(m, steps * self.fixed)
        return min(m, cum[start + steps] - cum[start])


@settings(max_examples=120, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), k=st.integers(0, 4),
       p=st.sampled_from([0.0, 0.3, 0.5, 0.6, 0.66, 0.67, 0.7, 0.8, 0.95, 1.0]),
       chunk=st.sampled_from([1, 3, 64, 1 << 16]), ms=st.lists(st.integers(1, 3000), min_size=1, max_size=60))
def test_acceptance_stream_same_draws(seed, k, p, chunk, ms):
    a = AcceptanceStream(np.random.default_rng(seed), k, p, chunk=chunk)
    b = _RefStream(np.random.default_rng(seed), k, p, chunk)
    for m in ms:
        n, cum, start = a.take(m)
        n2, cum2, start2 = b.take(m)
        assert n == n2 and type(n) is int
        for steps in (0, n // 2, n):
            got = a.tokens_after(cum, start, steps, m)
            assert got == b.tokens_after(cum2, start2, steps, m) and type(got) is int
        if not a.fixed:
            assert a.tokens_after(cum, start, n, m) == m  # the sequence has its tokens after its steps
    assert a.rng.bit_generator.state == b.rng.bit_generator.state


def test_geometric_by_inversion():
    """numpy samples Geometric(q < 1/3) by inverting one exponential draw (the fast path relies on it; a numpy
    that does otherwise would only turn the fast path off, which the reference comparison above would show)."""
    rng = np.random.default_rng(11)
    state = rng.bit_generator.state
    assert _geometric_by_inversion(rng, 0.2)
    assert rng.bit_generator.state == state  # checked on copies: nothing drawn from the run's generator
    assert not _geometric_by_inversion(rng, 0.5)
    assert AcceptanceStream(np.random.default_rng(0), 1, 0.8).inv is not None
    assert AcceptanceStream(np.random.default_rng(0), 1, 0.5).inv is None


@pytest.mark.slow
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**16), n_dec=st.integers(1, 3), ep=st.sampled_from([2, 4, 8]),
       cap=st.integers(2, 16), draft_k=st.integers(0, 2), rate=st.floats(10.0, 80.0),
       shift=st.sampled_from([0, 6, 11, 14]), log=st.booleans(), asc=st.booleans())
def test_direct_workers_and_kept_prices_are_step_by_step(seed, n_dec, ep, cap, draft_k, rate, shift, log, asc):
    """No faults (the main loop drives prefillers, KV streams and the autoscaler), loaded decoders whose steps
    finish and admit requests often (prices kept or re-taken): identical to step by step, event counts too."""
    dep = small_deployment(n_pf=2, n_dec=n_dec, ep=ep, batch_cap=cap, draft_k=draft_k, accept_p=0.8,
                           spare_hosts=2 if asc else 0)
    reqs = poisson_requests(150, rate, seed, prompt_mean=1500, out_mean=120, prompt_max=5000, out_max=500)
    kw = {}
    if asc:
        kw = {"autoscaler": AutoscalerConfig(interval_s=0.5, scale_up_delay_s=0.3, decode_batch_threshold=2.0,
                                             scale_down_frac=0.9, max_decoders=n_dec + 1),
              "prefill_tokens_per_s": 60_000.0}
    a, b = _both(dep, reqs, GridCost(shift), seed=seed, decision_log=log, until_s=None if seed % 3 else 4.0, **kw)
    _assert_same(a, b)


def test_shortcuts_are_taken(monkeypatch):
    """A loaded fault-free run starts no SimPy process for prefillers / KV streams, and re-prices far fewer decode
    steps than it completes outside the plain-step path."""
    started = []
    orig_process = SimEnv.process

    def process(self, gen):
        started.append(gen)
        return orig_process(self, gen)

    monkeypatch.setattr(SimEnv, "process", process)
    priced = []
    orig_cost = fastpath.step_cost

    def step_cost(*a):
        cost = orig_cost(*a)

        def counted(b, ctx):
            priced.append(b)
            return cost(b, ctx)

        return counted

    monkeypatch.setattr(fastpath, "step_cost", step_cost)
    general = []
    orig_ff = driver.Scheduler.advance_decoder

    def ff(self, *a):
        general.append(1)
        return orig_ff(self, *a)

    monkeypatch.setattr(driver.Scheduler, "advance_decoder", ff)
    dep = small_deployment(n_pf=2, n_dec=2, ep=8, batch_cap=32, draft_k=1)
    reqs = poisson_requests(600, 40.0, 3, prompt_mean=1500, out_mean=200)
    res = driver.simulate(dep, reqs, GridCost(12), seed=1, progress=False, decision_log=False)
    assert res.perf["fast_decode_steps"] > 0.9 * res.perf["decode_steps"]
    assert len(started) == len(dep.decoders)  # only the decoders have processes
    assert len(priced) < 0.6 * len(general)
