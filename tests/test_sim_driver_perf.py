"""Simulator speed: a fully loaded GB200 NVL72 (8 TP=4 prefillers, 2 EP=16 decoders, 8 spare GPUs).

``python tests/test_sim_driver_perf.py [sim_seconds] [nolog]`` runs the benchmark (default one simulated hour) and
prints events/s, decode steps/s and simulated seconds per wall second; the test runs 20 simulated seconds and checks
the simulator keeps a (generous, machine-independent-ish) minimum speed. The cost model is the tests' analytic one,
given a ``decode_point`` (exact: the same numbers) so that the driver fast-forwards decode steps as it does with
the real cost model; ``rackbed bench sim`` (sim/bench.py) is the benchmark with ``sim.costs``.
"""

from __future__ import annotations

import sys
import time

import numpy as np
from test_sim_driver_models import KV_BYTES_PER_TOKEN, AnalyticCost

from rackbed.engine.core.deployment import DecoderTemplate, MtpSpec, PrefillerTemplate, place
from rackbed.engine.core.request import Request
from rackbed.sim.costs.steptime import StepTime
from rackbed.sim.driver import simulate


class PointCost(AnalyticCost):
    """:class:`AnalyticCost` with ``decode_point`` (``sim.executor``): the same step times, priced from the busiest
    rank; exact in the context, so ``ctx_hi`` is the context itself."""

    def decode_point(self, group, max_batch: int, max_ctx: int, draft_k: int) -> tuple[StepTime, int]:
        return StepTime(attn_s=max_ctx * KV_BYTES_PER_TOKEN / self.hbm_Bps,
                        moe_gemm_s=max_batch * (draft_k + 1) * self.decode_per_seq_token_s,
                        other_s=self.decode_fixed_s), max_ctx


class _Nvl72View:
    """Just what :func:`place` needs of a GB200 NVL72: 18 trays × 4 GPUs, one 400 Gb/s NIC per GPU, one
    NVLink domain (the real ``topology.load("gb200-nvl72")`` gives the same answers; kept light here)."""

    gpu_ids = tuple(range(72))

    def host_of(self, i):
        return i // 4

    def nic_of_gpu(self, i):
        return f"nic:{i}"

    def nic_spec(self, nic_id):
        class Nic:
            GBps = 50.0
        return Nic

    def nvlink_domain(self, i):
        return frozenset(range(72))


def nvl72_deployment(topo=None):
    topo = topo or _Nvl72View()
    return place(topo, n_prefillers=8, n_decoders=2, kv_bytes_per_token=192_512,
                 prefiller=PrefillerTemplate(tp=4, ep=4, max_batch_tokens=16384, kv_capacity_tokens=400_000),
                 decoder=DecoderTemplate(ep=16, max_batch_per_rank=64, kv_capacity_tokens_per_rank=600_000),
                 mtp=MtpSpec(draft_k=2, accept_p=0.8))


class LazyPoisson:
    """Lazy request stream: Poisson arrivals, lognormal prompts (mean ≈ 6000) and outputs (mean ≈ 400)."""

    def __init__(self, rate_per_s: float, horizon_s: float, seed: int) -> None:
        self.rate, self.horizon, self.seed = rate_per_s, horizon_s, seed

    def __iter__(self):
        rng = np.random.default_rng(self.seed)
        t = 0.0
        i = 0
        while True:
            n = 4096
            gaps = rng.exponential(1.0 / self.rate, n)
            p = np.clip(rng.lognormal(np.log(5000), 0.6, n), 16, 60000).astype(int)
            o = np.clip(rng.lognormal(np.log(330), 0.6, n), 2, 4000).astype(int)
            for j in range(n):
                t += float(gaps[j])
                if t > self.horizon:
                    return
                yield Request(id=i, arrival_s=t, prompt_tokens=int(p[j]), output_tokens=int(o[j]))
                i += 1


def bench(sim_s: float, rate_per_s: float = 50.0, progress: bool = False, decision_log: bool = True) -> dict:
    dep = nvl72_deployment()
    t0 = time.perf_counter()
    c0 = time.process_time()
    res = simulate(dep, LazyPoisson(rate_per_s, sim_s, 1), PointCost(), seed=0, until_s=sim_s,
                   progress=progress, prefill_tokens_per_s=50_000.0, decision_log=decision_log)
    wall = time.perf_counter() - t0
    cpu = time.process_time() - c0
    m = res.metrics
    return {"sim_s": sim_s, "wall_s": wall, "cpu_s": cpu, "sim_s_per_cpu_s": sim_s / cpu, **res.perf, "requests": m["requests"],
            "decode_util": m["utilisation"]["decode"], "prefill_util": m["utilisation"]["prefill"],
            "ttft_p50": m["latency_s"]["ttft"]["p50"], "tpot_p50": m["latency_s"]["tpot"]["p50"]}


def test_nvl72_layout_matches_topology_preset():
    from rackbed import topology

    real = nvl72_deployment(topology.load("gb200-nvl72"))
    light = nvl72_deployment()
    assert [g.gpus for g in real.prefillers] == [g.gpus for g in light.prefillers]
    assert [g.gpus for g in real.decoders] == [g.gpus for g in light.decoders]
    assert real.spare_gpus == light.spare_gpus == tuple(range(64, 72))
    assert real.nic_GBps[real.decoders[0].rank_nics[0]] == 50.0


def test_point_cost_is_analytic_cost():
    from rackbed.engine.core.plans import DecodeStep

    a, p = AnalyticCost(), PointCost()
    for plan in (DecodeStep("D0", 0, (3, 5), (1000, 200), 2), DecodeStep("D0", 0, (64, 1), (7, 900_001), 0)):
        assert p.decode_point(None, max(plan.rank_batch), max(plan.rank_context_tokens), plan.draft_k)[0] == \
            a.decode(plan, None)


def test_simulator_speed_floor():
    out = bench(20.0)
    assert out["requests"]["done"] > 700
    assert out["prefill_util"] > 0.5  # the rack is loaded
    # a loose floor that holds on a busy shared CI core; the benchmark prints the real figures
    assert out["sim_s_per_wall_s"] > 1.0, out


if __name__ == "__main__":
    import json

    secs = float(sys.argv[1]) if len(sys.argv) > 1 else 3600.0
    log = (sys.argv[2] != "nolog") if len(sys.argv) > 2 else True
    print(json.dumps(bench(secs, progress=sys.stdout.isatty(), decision_log=log), indent=1, default=str))
