"""Expert parallelism across nodes: the DeepEP-style per-NIC traffic of dispatch / combine (normal and low-latency
mode, ``sim.costs.moe_comm.ep_traffic``) against a hand computation and an exhaustive enumeration, its properties,
the decode step's use of it for groups spanning NVLink domains, ``span_nodes`` placement on whole nodes, and the
one-node paths priced exactly as before."""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rackbed import scenarios
from rackbed.engine.core.deployment import DecoderTemplate, PrefillerTemplate, place
from rackbed.engine.core.model import get_model
from rackbed.engine.core.sharding import ParallelPlan
from rackbed.sim.costs import constants as C
from rackbed.sim.costs.moe_comm import (
    direct_rdma_copies,
    dpep_decode_combine,
    dpep_decode_dispatch,
    ep_comm,
    ep_prefill_combine,
    ep_prefill_dispatch,
    ep_rdma_busy_s,
    ep_traffic,
)
from rackbed.sim.costs.step import deal_seqs, decode_step_time, prefill_step_breakdown
from rackbed.sim.network import Network
from rackbed.sim.scenario import build, load_scenario, parse_scenario, simulate_scenario
from rackbed.topology import load as load_topology
from rackbed.topology.errors import UserError

DSV3 = get_model("deepseek-v3")
Q235 = get_model("qwen3-235b-a22b")
FP8 = 1 + 4 / 128  # FP8 elements with one fp32 scale per 128 channels


@pytest.fixture(scope="module")
def h800x4():
    return load_topology("hgx-h800*4")


def test_bytes_per_nic_by_hand_2x8():
    """2 nodes x 8 GPUs (R = 16 ranks), 16 experts (one per GPU, 8 per node), top-2, hidden 1024, FP8 dispatch
    (1024 x (1 + 4/128) = 1056 B of hidden state and scales), b = 64 tokens per GPU, one NIC per GPU.

    Low-latency mode: one record per (token, expert). A token's 2 experts are on the other node with probability
    1/2 each, so the GPU sends 64 x 2 x 1/2 = 64 records over RDMA, each 16 B header + 1056 = 1072 B:
    64 x 1072 = 68,608 B per NIC; over NVLink 64 x 2 x 7/16 = 56 records = 60,032 B. Combine returns bf16
    (2048 B per record): 64 x 2048 = 131,072 B per NIC.

    Normal mode: one record per (token, other node holding one of its experts). The other node holds none of the
    2 experts with probability C(8,2)/C(16,2) = 28/120 = 7/30, so 64 x 23/30 = 49.0667 records cross, each
    1056 + 8 (source meta) + 2 x 8 (expert ids, weights) = 1080 B padded to 1088 B: 64 x 23/30 x 1088 =
    53,384.53 B per NIC. NVLink: a token reaches D_rank = 2 GPUs (one expert each), 7/8 of them not the relay
    GPU itself: 64 x 2 x 7/8 = 112 records x 1088 = 121,856 B. Combine: 49.0667 x 2048 = 100,488.53 B per NIC.
    Sending every token once to every GPU (on the other node) holding one of its experts would be 64 x 2 x 8/16 =
    64 records. With two NICs per GPU each carries half."""
    kw = dict(n_experts=16, top_k=2, hidden=1024, nodes=2, gpus_per_node=8, tokens_per_gpu=64, dispatch_bpe=FP8)
    ll = ep_traffic("low_latency", "dispatch", **kw)
    assert ll.record_bytes == 1072
    assert ll.rdma_copies == pytest.approx(64) and ll.nvlink_copies == pytest.approx(56)
    assert ll.nic_send_bytes == pytest.approx(68_608) and ll.nic_recv_bytes == pytest.approx(68_608)
    assert ll.nvlink_send_bytes == pytest.approx(60_032)
    assert ep_traffic("low_latency", "combine", **kw).nic_bytes == pytest.approx(131_072)
    nm = ep_traffic("normal", "dispatch", **kw)
    assert nm.record_bytes == 1088
    assert nm.rdma_copies == pytest.approx(64 * 23 / 30)
    assert nm.nic_bytes == pytest.approx(64 * 23 / 30 * 1088) == pytest.approx(53_384.533, abs=1e-2)
    assert nm.nvlink_send_bytes == pytest.approx(121_856)
    assert ep_traffic("normal", "combine", **kw).nic_bytes == pytest.approx(100_488.533, abs=1e-2)
    assert direct_rdma_copies(16, 2, 2, 8, 64) == pytest.approx(64)
    assert ep_traffic("normal", "dispatch", **kw, nics_per_gpu=2).nic_bytes == pytest.approx(nm.nic_bytes / 2)
    assert ll.rdma_peers == 8 and nm.rdma_peers == 1


def _enumerate(n_experts: int, top_k: int, nodes: int, per_node: int) -> dict[str, Fraction]:
    """Exact expected records per token of GPU 0, averaged over every set of ``top_k`` distinct experts (experts
    ``e`` on GPU ``e // (E / R)``, GPU ``g`` on node ``g // per_node``)."""
    r = nodes * per_node
    per_gpu = n_experts // r
    tot = {"ll_rdma": 0, "ll_nvl": 0, "nm_rdma": 0, "nm_nvl": 0, "direct": 0}
    combos = list(itertools.combinations(range(n_experts), top_k))
    for c in combos:
        gpus = [e // per_gpu for e in c]
        tot["ll_rdma"] += sum(1 for g in gpus if g // per_node != 0)
        tot["ll_nvl"] += sum(1 for g in gpus if g // per_node == 0 and g != 0)
        dest = set(gpus)
        tot["nm_rdma"] += len({g // per_node for g in dest} - {0})
        # each destination GPU is reached over NVLink unless it is the relay GPU (same local index as GPU 0)
        tot["nm_nvl"] += sum(1 for g in dest if g % per_node != 0)
        tot["direct"] += sum(1 for g in dest if g // per_node != 0)
    return {k: Fraction(v, len(combos)) for k, v in tot.items()}


@pytest.mark.parametrize("e,k,n,g", [(16, 2, 2, 8), (12, 3, 3, 2), (8, 4, 4, 1), (24, 3, 2, 4), (16, 8, 4, 2)])
def test_closed_forms_match_exhaustive_enumeration(e, k, n, g):
    exact = _enumerate(e, k, n, g)
    kw = dict(n_experts=e, top_k=k, hidden=64, nodes=n, gpus_per_node=g, tokens_per_gpu=1)
    ll, nm = ep_traffic("low_latency", "dispatch", **kw), ep_traffic("normal", "dispatch", **kw)
    assert ll.rdma_copies == pytest.approx(float(exact["ll_rdma"]))
    assert ll.nvlink_copies == pytest.approx(float(exact["ll_nvl"]))
    assert nm.rdma_copies == pytest.approx(float(exact["nm_rdma"]))
    assert nm.nvlink_copies == pytest.approx(float(exact["nm_nvl"]))
    assert direct_rdma_copies(e, k, n, g, 1) == pytest.approx(float(exact["direct"]))


SHAPES = st.sampled_from([(2, 8), (4, 8), (9, 8), (18, 8), (2, 4), (8, 1), (3, 2)])


@settings(max_examples=200, deadline=None)
@given(shape=SHAPES, per_gpu=st.integers(1, 8), k=st.integers(1, 8), b=st.floats(0.5, 4096),
       hidden=st.integers(64, 8192))
def test_normal_never_crosses_more_than_direct_or_low_latency(shape, per_gpu, k, b, hidden):
    """Across nodes, normal mode's records (once per node) <= every token once per destination GPU <= low-latency
    mode's (once per expert); combine records are equal in size in both modes, so its NIC bytes keep the order."""
    n, g = shape
    e = n * g * per_gpu
    if k > e:
        return
    kw = dict(n_experts=e, top_k=k, hidden=hidden, nodes=n, gpus_per_node=g, tokens_per_gpu=b)
    nm, ll = ep_traffic("normal", "dispatch", **kw), ep_traffic("low_latency", "dispatch", **kw)
    direct = direct_rdma_copies(e, k, n, g, b)
    assert nm.rdma_copies <= direct * (1 + 1e-12) + 1e-9
    assert direct <= ll.rdma_copies * (1 + 1e-12) + 1e-9
    assert ep_traffic("normal", "combine", **kw).nic_bytes <= \
        ep_traffic("low_latency", "combine", **kw).nic_bytes * (1 + 1e-12) + 1e-9


@settings(max_examples=150, deadline=None)
@given(shape=SHAPES, k=st.integers(1, 8), b=st.floats(1, 2048), db=st.floats(0, 2048),
       mode=st.sampled_from(["normal", "low_latency"]), op=st.sampled_from(["dispatch", "combine"]))
def test_bytes_per_nic_grow_with_tokens_and_top_k(shape, k, b, db, mode, op):
    n, g = shape
    e = n * g * 4
    kw = dict(n_experts=e, hidden=7168, nodes=n, gpus_per_node=g, dispatch_bpe=FP8)
    a = ep_traffic(mode, op, top_k=k, tokens_per_gpu=b, **kw)
    assert ep_traffic(mode, op, top_k=k, tokens_per_gpu=b + db, **kw).nic_bytes >= a.nic_bytes
    if op == "combine" or mode == "low_latency":  # the normal-mode dispatch record grows with k too
        assert ep_traffic(mode, op, top_k=min(k + 1, e), tokens_per_gpu=b, **kw).rdma_copies >= a.rdma_copies - 1e-9


def test_decode_across_nodes_is_low_latency_mode(h800x4):
    """A DP-EP32 decoder on four H800 nodes: dispatch and combine are DeepEP low-latency transfers, bandwidth-bound
    at 128 tokens per GPU (RDMA bytes / (400 Gb/s x EP_NIC_EFFICIENCY) is the transfer term)."""
    gpus = tuple(range(32))
    d = dpep_decode_dispatch(h800x4, gpus, 128, DSV3, "fp8_block")
    assert d == ep_comm(h800x4, gpus, 128, DSV3, "low_latency", "dispatch", "fp8_block")
    tr = ep_traffic("low_latency", "dispatch", n_experts=256, top_k=8, hidden=7168, nodes=4, gpus_per_node=8,
                    tokens_per_gpu=128, dispatch_bpe=FP8)
    assert tr.nic_bytes == pytest.approx(128 * 8 * 3 / 4 * (16 + 7168 * FP8))
    assert d.transfer_s == pytest.approx(tr.nic_bytes / (50e9 * C.EP_NIC_EFFICIENCY))
    c = dpep_decode_combine(h800x4, gpus, 128, DSV3)
    assert c.transfer_s == pytest.approx(128 * 8 * 3 / 4 * 7168 * 2 / (50e9 * C.EP_NIC_EFFICIENCY))
    # normal mode (prefill kernels) crosses less: once per node
    assert ep_comm(h800x4, gpus, 128, DSV3, "normal", "dispatch", "fp8_block").transfer_s < d.transfer_s
    # EFA: no GPU-initiated RDMA, a proxy posts every peer's messages
    efa = load_topology("hgx-h200-efa*2")
    assert dpep_decode_dispatch(efa, range(16), 128, DSV3, "fp8_block").sync_s > \
        dpep_decode_dispatch(load_topology("hgx-h200*2"), range(16), 128, DSV3, "fp8_block").sync_s


def test_one_node_paths_price_exactly_as_before():
    """One-NVLink-domain groups keep their pricing bit for bit (values recorded before the cross-node model)."""
    gb, h = load_topology("gb200-nvl72"), load_topology("hgx-h200*2")
    gold = [
        (gb, 8, 1, 6.586299242078825e-06, 5.130476807749121e-06, 6.589015270705238e-06),
        (gb, 8, 64, 1.0763151493044865e-05, 1.2720515695943742e-05, 1.09369773251353e-05),
        (gb, 64, 1, 9.976509204487221e-06, 6.873272801426805e-06, 9.979199957492532e-06),
        (gb, 64, 64, 1.605658908718219e-05, 1.8419459291315562e-05, 1.6228797279522104e-05),
        (h, 8, 1, 7.244045221149579e-06, 5.536773440319211e-06, 7.248414808446023e-06),
        (h, 8, 64, 1.5058894153573087e-05, 1.982350018042945e-05, 1.5338547740545545e-05),
    ]
    for topo, ep, t, disp, comb, skew in gold:
        assert dpep_decode_dispatch(topo, range(ep), t, DSV3, "fp8_block").total_s == pytest.approx(disp, rel=1e-12)
        assert dpep_decode_combine(topo, range(ep), t, DSV3).total_s == pytest.approx(comb, rel=1e-12)
        assert dpep_decode_dispatch(topo, range(ep), t, Q235, "fp8_block", recv_scale=1.7,
                                    copy_scale=2.2).total_s == pytest.approx(skew, rel=1e-12)
    assert ep_prefill_dispatch(h, range(8), 4096, DSV3, "fp8_block").total_s == \
        pytest.approx(2.5819110697674417e-05, rel=1e-12)
    assert ep_prefill_combine(h, range(8), 4096, DSV3).total_s == pytest.approx(0.0002479271781589258, rel=1e-12)
    p = ParallelPlan(role="decode", tp=1, ep=8, dp=8, gpus=tuple(range(8)), weight_format="fp8_block",
                     max_batch_seqs=64)
    assert decode_step_time(DSV3, p, h, [32] * 8, [32 * 2000] * 8, draft_k=1).total_s == \
        pytest.approx(0.032534281820753075, rel=1e-12)


# ------------------------------------------------------------------------------------------------ placement


def test_span_nodes_places_whole_nodes_with_own_nics(h800x4):
    dep = place(h800x4, n_prefillers=1, n_decoders=1, kv_bytes_per_token=100,
                prefiller=PrefillerTemplate(tp=8, ep=8), decoder=DecoderTemplate(ep=24, span_nodes=True))
    assert dep.prefillers[0].gpus == tuple(range(8))
    d = dep.decoders[0]
    assert d.gpus == tuple(range(8, 32))
    assert {dep.gpu_host[g] for g in d.gpus} == {1, 2, 3}
    assert d.rank_nics == tuple(h800x4.nic_of_gpu(g) for g in d.gpus)  # every rank its own GPU's NIC
    assert len(set(d.rank_nics)) == 24
    # a prefiller may span nodes too; it then ships KV over all its GPUs' NICs
    dep = place(h800x4, n_prefillers=1, n_decoders=1, kv_bytes_per_token=100,
                prefiller=PrefillerTemplate(tp=8, ep=16, span_nodes=True), decoder=DecoderTemplate(ep=8))
    assert dep.prefillers[0].gpus == tuple(range(16)) and len(dep.prefillers[0].nics) == 16
    assert dep.decoders[0].gpus == tuple(range(16, 24))


def test_span_nodes_errors_are_one_line(h800x4):
    with pytest.raises(UserError, match=r"its 12 GPUs are not whole 8-GPU NVLink domains \(use a multiple of 8\)"):
        place(h800x4, n_prefillers=0, n_decoders=1, kv_bytes_per_token=1,
              decoder=DecoderTemplate(ep=12, span_nodes=True))
    with pytest.raises(UserError, match="decoder 1 needs 2 wholly free 8-GPU NVLink domains; 1 left"):
        place(h800x4, n_prefillers=1, n_decoders=2, kv_bytes_per_token=1, prefiller=PrefillerTemplate(tp=4, ep=4),
              decoder=DecoderTemplate(ep=16, span_nodes=True))
    sc = parse_scenario({"topology": "hgx-h800*4", "model": "deepseek-v3", "decode": {"ep": 32},
                         "workload": {"kind": "trace", "name": "mooncake", "max_requests": 4}})
    with pytest.raises(UserError) as e:
        build(sc)
    assert "\n" not in str(e.value)
    assert str(e.value).startswith("decode.ep: a group of 32 GPUs exceeds one 8-GPU NVLink domain of hgx-h800*4; "
                                   "set decode.span_nodes: true")


def test_one_node_placement_unchanged(h800x4):
    """Templates without ``span_nodes`` are laid out as before: prefillers on the lowest hosts, decoders in the lowest
    free GPUs of one NVLink domain."""
    dep = place(h800x4, n_prefillers=2, n_decoders=3, kv_bytes_per_token=1, prefiller=PrefillerTemplate(tp=4, ep=4),
                decoder=DecoderTemplate(ep=8))
    assert [p.gpus for p in dep.prefillers] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert [d.gpus for d in dep.decoders] == [tuple(range(8, 16)), tuple(range(16, 24)), tuple(range(24, 32))]


# ------------------------------------------------------------------------------------------------ scenario


def test_shipped_wide_ep_scenario_runs():
    """``scenarios/dsv3_h200_wide_ep.yaml`` (DP-EP32 decoder over four H200 nodes), a shortened workload."""
    sc = load_scenario(scenarios.resolve("dsv3_h200_wide_ep"))
    assert sc.decode.span_nodes and sc.decode.ep == 32
    sc = sc.model_copy(update={"workload": sc.workload.model_copy(update={"max_requests": 20})})
    b, res = simulate_scenario(sc)
    d = b.deployment.decoders[0]
    assert len({b.deployment.gpu_host[g] for g in d.gpus}) == 4
    assert not set(d.gpus) & {g for p in b.deployment.prefillers for g in p.gpus}
    assert res.metrics["requests"]["done"] == 20
    assert math.isfinite(res.metrics["latency_s"]["tpot"]["p50"])


# ------------------------------------------------------------------------------------------------ prefill across nodes


def test_deal_seqs_longest_first_onto_the_lightest_rank():
    # 9 -> rank 0; 5 -> rank 1; 4 -> rank 1 (5 < 9); 3 -> rank 0 (9 = 9, the lowest)
    assert deal_seqs([(5, 0), (9, 0), (3, 0), (4, 1)], 2) == [[(9, 0), (3, 0)], [(5, 0), (4, 1)]]
    assert deal_seqs([(7, 0)], 3) == [[(7, 0)], [], []]


def test_dp_prefill_prices_the_busiest_rank_with_normal_mode(h800x4):
    """EP32 prefiller of four TP8 ranks (one node each) on four H800 nodes: the busiest rank's tokens set the
    attention, each of its GPUs dispatches ceil(t / 8) tokens in DeepEP normal mode, the GEMM sees the whole batch."""
    plan = ParallelPlan(role="prefill", tp=8, ep=32, dp=4, gpus=tuple(range(32)), weight_format="fp8_block")
    seqs = [(4096, 0)] * 4 + [(1024, 0)]
    bd = prefill_step_breakdown(DSV3, plan, h800x4, seqs)
    t = 4096 + 1024  # the rank that got the short prompt too
    n_moe = DSV3.n_moe_layers
    scale = sum(q for q, _ in seqs) / 32 / (t // 8)  # the mean GPU's tokens over the busiest GPU's
    disp = ep_comm(h800x4, plan.gpus, t // 8, DSV3, "normal", "dispatch", "fp8_block", recv_scale=scale,
                   copy_scale=scale)
    assert bd.seconds()["moe_dispatch"] == pytest.approx(n_moe * disp.total_s)
    assert "moe_combine_allreduce" not in bd.seconds() and "moe_allreduce" in bd.seconds()
    # balanced batches are faster than one long prompt on one rank, at the same number of tokens
    assert prefill_step_breakdown(DSV3, plan, h800x4, [(4096, 0)] * 4).total_s < \
        prefill_step_breakdown(DSV3, plan, h800x4, [(16384, 0)]).total_s


def test_dp_prefill_needs_span_nodes():
    base = {"topology": "hgx-h800*4", "model": "deepseek-v3", "decode": {"ep": 8},
            "workload": {"kind": "trace", "name": "mooncake", "max_requests": 4}}
    with pytest.raises(UserError, match=r"prefill.span_nodes: true"):
        build(parse_scenario({**base, "prefill": {"tp": 1, "ep": 8}}))
    with pytest.raises(UserError, match=r"^prefill.ep: a group of 16 GPUs exceeds one 8-GPU NVLink domain"):
        build(parse_scenario({**base, "prefill": {"tp": 16, "ep": 16}}))


def test_shipped_h800_scenario_spans_nodes_in_both_roles():
    """``scenarios/dsv3_h800_wide_ep.yaml``: EP32 prefiller (DP4 x TP8) and DP-EP32 decoder, four H800 nodes each."""
    sc = load_scenario(scenarios.resolve("dsv3_h800_wide_ep"))
    sc = sc.model_copy(update={"workload": sc.workload.model_copy(update={"max_requests": 12})})
    b, res = simulate_scenario(sc)
    (p,), (d,) = b.deployment.prefillers, b.deployment.decoders
    host = b.deployment.gpu_host
    assert len({host[g] for g in p.gpus}) == 4 and len({host[g] for g in d.gpus}) == 4
    assert b.prefill_plan.dp == 4 and b.prefill_plan.max_batch_tokens == 65536 // 4
    assert any("DeepEP normal-mode" in c for c in b.caveats)
    assert res.metrics["requests"]["done"] == 12


# ------------------------------------------------------------------------------------------------ NIC sharing


def test_kv_flows_get_the_nic_rate_the_all_to_all_leaves():
    """A NIC whose EP all-to-all takes a share ``s`` serves KV at ``(1 - s)`` of its rate, in both directions."""
    net = Network({"nic:0": 50.0, "nic:1": 50.0, "nic:2": 50.0}, {"nic:1": 0.25})
    assert net.reserve(0.0, [("nic:0", "nic:2", 10**9)]) == pytest.approx(0.02)  # no share: 1 GB at 50 GB/s
    assert net.reserve(1.0, [("nic:0", "nic:1", 10**9)]) == pytest.approx(1.0 + 1 / 37.5)
    assert net.reserve(2.0, [("nic:1", "nic:2", 10**9)]) == pytest.approx(2.0 + 1 / 37.5)
    assert Network({"nic:0": 50.0}).nic_Bps == Network({"nic:0": 50.0}, {}).nic_Bps == {"nic:0": 50e9}


def test_ep_nic_share_of_the_shipped_scenarios():
    """The decoder spanning four nodes shares its 32 NICs with its all-to-all: the low-latency RDMA seconds of
    the full-batch step over that step; a one-node deployment shares nothing; a DP-attention prefiller spanning
    nodes shares its NICs too."""
    b = build(load_scenario(scenarios.resolve("dsv3_h200_wide_ep")))
    dep, cm = b.deployment, b.cost_model
    share = cm.ep_nic_share(dep)
    (d,) = dep.decoders
    assert set(share) == {dep.gpu_nic[g] for g in d.gpus}
    (s,) = set(share.values())
    pl, k = b.decode_plan, dep.mtp.draft_k
    busy = DSV3.n_moe_layers * ep_rdma_busy_s(b.topology, pl.gpus, 64 * (k + 1), DSV3, "low_latency", "fp8_block") \
        + k * ep_rdma_busy_s(b.topology, pl.gpus, 64, DSV3, "low_latency", "fp8_block")
    step = cm.decode_breakdown(64, d.template.kv_capacity_tokens_per_rank / 2, k, d).total_s
    assert s == pytest.approx(busy / step) and 0.05 < s < 0.9
    one = build(load_scenario(scenarios.resolve("dsv3_h200_ib")))
    assert one.cost_model.ep_nic_share(one.deployment) == {}
    h8 = build(load_scenario(scenarios.resolve("dsv3_h800_wide_ep")))
    sh8 = h8.cost_model.ep_nic_share(h8.deployment)
    assert len(sh8) == 64 and all(0 < v <= 0.9 for v in sh8.values())


def test_autoscaler_grows_spanning_groups_on_whole_nodes():
    import numpy as np

    from rackbed.engine.core.scheduler import Scheduler

    topo = load_topology("hgx-h800*6")
    dep = place(topo, n_prefillers=1, n_decoders=1, kv_bytes_per_token=100, prefiller=PrefillerTemplate(tp=8, ep=8),
                decoder=DecoderTemplate(ep=16, span_nodes=True), spare="rest")
    assert dep.spare_gpus == tuple(range(24, 48))
    s = Scheduler(dep, np.random.default_rng(0))
    assert s._find_decoder_gpus() == tuple(range(24, 40))  # two whole nodes of the three spare
    s._take_pool([24, 25, 40, 41])
    assert s._find_decoder_gpus() is None  # 20 GPUs free, but only one node (32-39) wholly


def test_real_mode_refuses_groups_spanning_nodes():
    from rackbed.engine.real.rank_setup import real_model_config

    b = build(load_scenario(scenarios.resolve("dsv3_h200_wide_ep")))
    with pytest.raises(UserError, match=r"^decode.span_nodes: real mode runs every group on this machine's devices"):
        real_model_config(b)
