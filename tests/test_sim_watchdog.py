"""A simulation cannot hang: decoders no KV can reach are not routed to (their requests end ``unreachable``), and
a run that stops making progress raises :class:`engine.loop.watchdog.Stalled` naming the stuck component."""

from __future__ import annotations

from collections import Counter
from typing import ClassVar

import numpy as np
import pytest
from test_sim_driver_models import AnalyticCost, poisson_requests, small_deployment

from rackbed.engine.cli.run import _stalled_status
from rackbed.engine.core.autoscaler import AutoscalerConfig
from rackbed.engine.core.policies import Policies
from rackbed.engine.core.scheduler import Scheduler
from rackbed.engine.core.stall import describe_stall
from rackbed.engine.loop.watchdog import Stalled, Watchdog
from rackbed.sim.driver import simulate

ASC = AutoscalerConfig(interval_s=0.2, scale_up_delay_s=0.3)


def _decoder_nics(dep) -> list[str]:
    return [n for d in dep.decoders for n in d.rank_nics]


def _reasons(res) -> Counter:
    return Counter(r[5] for r in res.rows)


def _run(dep, faults, n=300, **kw):
    return simulate(dep, poisson_requests(n, 50.0, 1), AnalyticCost(), seed=0, progress=False, faults=faults, **kw)


def test_all_decoder_nics_down_for_good_rejects_unreachable():
    dep = small_deployment()
    res = _run(dep, [{"at_s": 0.5, "target": n} for n in _decoder_nics(dep)], debug_checks=True)
    why = _reasons(res)
    assert len(res.rows) == 300 and "stalled" not in why
    assert why["unreachable"] > 200 and why[""] > 0   # served before the fault, rejected after
    drained = [r for r in res.log.records if r[1] == "scale_down" and r[6] == "unreachable"]
    assert sorted(r[2] for r in drained) == ["D0", "D1"]


def test_autoscaler_with_every_nic_down_ends():
    dep = small_deployment(spare_hosts=1)
    nics = _decoder_nics(dep) + [dep.gpu_nic[g] for g in dep.spare_gpus]
    res = _run(dep, [{"at_s": 0.5, "target": n} for n in nics], autoscaler=ASC, debug_checks=True)
    why = _reasons(res)
    assert len(res.rows) == 300 and "stalled" not in why and why["unreachable"] > 0
    # no decoder is built on GPUs whose NIC is down for good
    assert not [r for r in res.log.records if r[1] == "scale_up" and r[0] >= 0.5 and r[6] == "decode"]


def test_autoscaler_replaces_unreachable_decoders_on_reachable_gpus():
    dep = small_deployment(spare_hosts=1)
    cfg = AutoscalerConfig(interval_s=0.2, scale_up_delay_s=0.3, max_prefillers=2)  # the spare GPUs for decoders
    res = _run(dep, [{"at_s": 0.5, "target": n} for n in _decoder_nics(dep)], autoscaler=cfg, debug_checks=True)
    why = _reasons(res)
    assert "stalled" not in why and "unreachable" not in why and why[""] == 300
    late = {r[15] for r in res.rows if r[10] == r[10] and r[10] > 0.5}   # KV arrived after the fault: where
    assert late and late.isdisjoint({"D0", "D1"})


def test_decoder_nics_down_for_a_while_is_waited_for():
    dep = small_deployment()
    res = _run(dep, [{"at_s": 0.5, "target": n, "duration_s": 2.0} for n in _decoder_nics(dep)])
    assert _reasons(res) == Counter({"": 300})


class _NoRank:
    """A decoder-rank policy that never finds a rank: the KV of every request waits on its prefiller forever."""

    name: ClassVar[str] = "none"

    def choose(self, candidates, need_tokens):
        return None


def test_watchdog_names_the_stuck_streams():
    dep = small_deployment(spare_hosts=1)
    with pytest.raises(Stalled, match=r"kv_pending at P\d\.kv\*") as exc:
        _run(dep, [], n=20, autoscaler=ASC, policies=Policies(rank=_NoRank()), stall_s=30.0)
    msg = str(exc.value)
    assert "stuck: P0.kv0 (waits for kv_space)" in msg or "stuck: P1.kv0 (waits for kv_space)" in msg
    assert "with 20 requests open" in msg
    # the limit is simulated time: the error comes within a few thousand autoscaler ticks of it
    t = float(msg.split("t=")[1].split(" ")[0])
    assert 30.0 < t < 30.0 + 4096 * ASC.interval_s


def test_without_events_left_open_requests_end_stalled():
    res = _run(small_deployment(), [], n=20, policies=Policies(rank=_NoRank()))
    why = _reasons(res)
    assert set(why) <= {"stalled", ""} and why["stalled"] == sum(1 for r in res.rows if r[3] > 1)
    assert _stalled_status(res.metrics) == 1
    assert _stalled_status({"requests": {"rejected_by_reason": {"unreachable": 3}}}) == 0


@pytest.mark.slow
def test_watchdog_waits_for_pending_recoveries():
    # nothing progresses while a NIC is down for 200 s; the recovery still to come is not a stall
    dep = small_deployment()
    faults = [{"at_s": 0.5, "target": n, "duration_s": 200.0} for n in _decoder_nics(dep)]
    res = _run(dep, faults, n=100, autoscaler=AutoscalerConfig(interval_s=0.01, scale_up_delay_s=0.3,
                                                                  min_decoders=2, max_decoders=2), stall_s=20.0)
    assert _reasons(res) == Counter({"": 100})


def test_event_budget_without_progress():
    s = Scheduler(small_deployment(), np.random.default_rng(0))
    from rackbed.engine.core.request import Request

    s.arrive(Request(id=0, arrival_s=0.0, prompt_tokens=100, output_tokens=5), 0.0)
    dog = Watchdog(s, stall_s=None, stall_events=10_000)
    for n in range(0, 10_001, 4096):
        dog.check(0.0, n)            # no simulated time passes: only the event budget can tell
    with pytest.raises(Stalled, match="1 requests open; stuck: P0"):
        dog.check(0.0, 12_288)
    assert "queued_prefill at P0" in describe_stall(s)
    with pytest.raises(ValueError, match="stall_s"):
        Watchdog(s, stall_s=0.0)
