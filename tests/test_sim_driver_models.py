"""Test fixtures for the scheduler / SimPy driver tests: a small analytic cost model, deployments, workloads.

The cost model is deliberately simple (closed forms with round constants) so that expectations in the tests
can be computed by hand; the real cost models live in ``sim/costs``. Imported by ``test_scheduler*.py`` and
``test_sim_driver*.py``; the tests at the bottom check the model itself.
"""

from __future__ import annotations

import numpy as np

from rackbed.engine.core.deployment import (
    DecoderGroup,
    DecoderTemplate,
    Deployment,
    MtpSpec,
    PrefillerGroup,
    PrefillerTemplate,
)
from rackbed.engine.core.plans import DecodeStep, KvTransfer, PrefillBatch
from rackbed.engine.core.request import Request
from rackbed.sim.costs.steptime import StepTime
from rackbed.sim.executor import TransferCost

KV_BYTES_PER_TOKEN = 192_512  # Qwen3-235B-A22B, bf16


class AnalyticCost:
    """prefill: ``5 ms + 20 µs/token + 1 ns × (attention token pairs)``; decode: ``12 ms + 40 µs × max rank
    batch × (k+1) + KV read of the busiest rank at 8 TB/s``; KV transfer: 5 µs per chunk + 5 µs latency."""

    prefill_fixed_s = 5e-3
    prefill_per_token_s = 20e-6
    prefill_per_pair_s = 1e-9
    decode_fixed_s = 12e-3
    decode_per_seq_token_s = 40e-6
    hbm_Bps = 8e12

    def prefill(self, plan: PrefillBatch, group) -> StepTime:
        pairs = sum(n * start + n * (n + 1) // 2 for _, start, n in plan.items)
        return StepTime(attn_s=pairs * self.prefill_per_pair_s,
                        moe_gemm_s=plan.n_tokens * self.prefill_per_token_s,
                        other_s=self.prefill_fixed_s)

    def decode(self, plan: DecodeStep, group) -> StepTime:
        return StepTime(attn_s=max(plan.rank_context_tokens) * KV_BYTES_PER_TOKEN / self.hbm_Bps,
                        moe_gemm_s=max(plan.rank_batch) * (plan.draft_k + 1) * self.decode_per_seq_token_s,
                        other_s=self.decode_fixed_s)

    def kv_transfer(self, plan: KvTransfer) -> TransferCost:
        return TransferCost(overhead_s=5e-6 * plan.n_chunks, latency_s=5e-6, n_bytes=plan.n_bytes)


def small_deployment(*, n_pf: int = 2, n_dec: int = 2, ep: int = 2, batch_cap: int = 8,
                     kv_rank: int = 40_000, kv_pf: int = 60_000, budget: int = 8192, draft_k: int = 2,
                     accept_p: float = 0.8, chunked: bool = False, max_queue: int | None = None,
                     spare_hosts: int = 0, shed_ttft_s: float | None = None, page: int = 1,
                     kv_streams: int = 1) -> Deployment:
    """Hosts of 4 GPUs, one NIC per GPU (50 GB/s); prefillers = 4 GPUs of a host (TP=4), decoders = ``ep``
    GPUs. GPUs of ``spare_hosts`` extra hosts form the spare pool. All in one NVLink domain."""
    ptpl = PrefillerTemplate(tp=4, ep=4, max_batch_tokens=budget, kv_capacity_tokens=kv_pf,
                             max_queue_requests=max_queue, kv_streams=kv_streams)
    dtpl = DecoderTemplate(ep=ep, max_batch_per_rank=batch_cap, kv_capacity_tokens_per_rank=kv_rank,
                           kv_page_tokens=page)
    n_dec_gpus = n_dec * ep
    n_hosts = n_pf + -(-n_dec_gpus // 4) + spare_hosts
    gpus = list(range(4 * n_hosts))
    gpu_host = {g: g // 4 for g in gpus}
    gpu_nic = {g: f"nic:{g}" for g in gpus}
    nic_GBps = {f"nic:{g}": 50.0 for g in gpus}
    pfs = tuple(PrefillerGroup(id=f"P{i}", gpus=tuple(range(4 * i, 4 * i + 4)), host=i,
                               nics=tuple(f"nic:{g}" for g in range(4 * i, 4 * i + 4)), template=ptpl)
                for i in range(n_pf))
    base = 4 * n_pf
    decs = tuple(DecoderGroup(id=f"D{i}", gpus=tuple(range(base + ep * i, base + ep * (i + 1))),
                              rank_nics=tuple(f"nic:{g}" for g in range(base + ep * i, base + ep * (i + 1))),
                              template=dtpl)
                 for i in range(n_dec))
    used = base + n_dec_gpus
    spare = tuple(g for g in gpus if g >= used)
    return Deployment(prefillers=pfs, decoders=decs, kv_bytes_per_token=KV_BYTES_PER_TOKEN, gpu_host=gpu_host,
                      gpu_nic=gpu_nic, nic_GBps=nic_GBps, gpu_domain={g: 0 for g in gpus},
                      mtp=MtpSpec(draft_k=draft_k, accept_p=accept_p), chunked_prefill=chunked,
                      shed_ttft_s=shed_ttft_s, spare_gpus=spare, prefiller_template=ptpl, decoder_template=dtpl)


def poisson_requests(n: int, rate_per_s: float, seed: int, *, prompt_mean: int = 2000, out_mean: int = 200,
                     prompt_max: int = 16000, out_max: int = 2000) -> list[Request]:
    """``n`` requests, Poisson arrivals at ``rate_per_s``, lognormal prompt/output lengths (σ = 0.6)."""
    rng = np.random.default_rng(seed)
    t = np.cumsum(rng.exponential(1.0 / rate_per_s, n))
    p = np.clip(rng.lognormal(np.log(prompt_mean), 0.6, n), 1, prompt_max).astype(int)
    o = np.clip(rng.lognormal(np.log(out_mean), 0.6, n), 1, out_max).astype(int)
    return [Request(id=i, arrival_s=float(t[i]), prompt_tokens=int(p[i]), output_tokens=int(o[i]))
            for i in range(n)]


# ---------------------------------------------------------------- checks of the fixtures themselves
def test_analytic_cost_by_hand():
    cm = AnalyticCost()
    st = cm.prefill(PrefillBatch("P0", 0, ((1, 0, 1000), (2, 500, 100)), 1100), None)
    pairs = 1000 * 1001 // 2 + (100 * 500 + 100 * 101 // 2)
    assert st.total_s == 5e-3 + 1100 * 20e-6 + pairs * 1e-9
    d = cm.decode(DecodeStep("D0", 0, (3, 5), (1000, 200), 2), None)
    assert abs(d.total_s - (12e-3 + 5 * 3 * 40e-6 + 1000 * KV_BYTES_PER_TOKEN / 8e12)) < 1e-15


def test_small_deployment_shapes():
    dep = small_deployment(n_pf=2, n_dec=3, ep=2, spare_hosts=1)
    assert [g.gpus for g in dep.prefillers] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert [g.gpus for g in dep.decoders] == [(8, 9), (10, 11), (12, 13)]
    assert dep.spare_gpus == (14, 15, 16, 17, 18, 19)
    assert dep.n_gpus == 20
