"""topology: specs, presets (hand-computed facts) and graph queries (property tests on generated topologies)."""

from __future__ import annotations

import itertools

import networkx as nx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from rackbed import topology
from rackbed.topology import UserError, load
from rackbed.topology.graph import Topology
from rackbed.topology.presets import build
from rackbed.topology.specs import (
    B200_HGX,
    B300_HGX,
    C2C,
    CX7_IB,
    CX8_IB,
    EFA_200,
    GB200_GPU,
    GB300_GPU,
    H100_SXM,
    H200_SXM,
    H800_SXM,
    IB_NDR,
    NVLINK4,
    NVLINK5,
    NVLINK_SWITCH5,
    NVSWITCH3,
    PCIE5_X16,
    QUANTUM2,
    XEON_8480C,
    ClusterSpec,
    FabricSpec,
    FormatRates,
    LinkSpec,
    NicSpec,
    NodeSpec,
    RackSpec,
    SwitchSpec,
)

# ------------------------------------------------------------------------------------------------ specs


def test_gpu_facts():
    assert H200_SXM.hbm_bytes == 141e9 and H200_SXM.hbm_GBps == 4800 and H200_SXM.sm_count == 132
    assert H200_SXM.dense_tflops.bf16 == 989 and H200_SXM.dense_tflops.fp8 == 1979
    for fmt in ("mxfp8", "mxfp6", "mxfp4", "nvfp4"):  # Hopper: no MX / FP4 tensor cores
        assert H200_SXM.dense_tflops.get(fmt) is None
    assert H200_SXM.nvlink_links == 18 and H200_SXM.nvlink_GBps_per_dir == 450
    assert H200_SXM.nvlink_effective_GBps_per_dir == pytest.approx(18 * 20.6)
    r = GB200_GPU.dense_tflops
    assert (r.bf16, r.fp8, r.mxfp8, r.mxfp6, r.mxfp4, r.nvfp4) == (2500, 5000, 5000, 5000, 10000, 10000)
    assert GB200_GPU.hbm_bytes == 186e9 and GB200_GPU.sm_count == 152 and GB200_GPU.nvlink_GBps_per_dir == 900
    assert GB200_GPU.nvlink_effective_GBps_per_dir == pytest.approx(18 * 40.1)
    r = B200_HGX.dense_tflops
    assert (r.bf16, r.fp8, r.nvfp4) == (2250, 4500, 9000) and B200_HGX.sm_count == 148
    assert B200_HGX.hbm_bytes == 180e9
    assert CX7_IB.GBps == 50.0 and CX7_IB.gpu_initiated_rdma
    assert CX8_IB.GBps == 100.0 and CX8_IB.gpu_initiated_rdma
    # Blackwell Ultra: FP4 1.5x Blackwell's, BF16 / FP8 unchanged; 288 GB HBM3e
    r = GB300_GPU.dense_tflops
    assert (r.bf16, r.fp8, r.mxfp8, r.mxfp4, r.nvfp4) == (2500, 5000, 5000, 15000, 15000)
    assert GB300_GPU.hbm_bytes == 288e9 and GB300_GPU.hbm_GBps == 8000 and GB300_GPU.sm_version == 103
    r = B300_HGX.dense_tflops
    assert (r.bf16, r.fp8, r.nvfp4) == (2250, 4500, 13500) and B300_HGX.hbm_GBps == 7750
    assert GB300_GPU.nvlink_GBps_per_dir == B300_HGX.nvlink_GBps_per_dir == 900
    # H100: H200's die and NVLink with 80 GB HBM3; H800: H100 with NVLink cut to 400 GB/s both ways
    assert H100_SXM.hbm_bytes == 80e9 and H100_SXM.hbm_GBps == 3350 and H100_SXM.dense_tflops == H200_SXM.dense_tflops
    assert H100_SXM.nvlink_GBps_per_dir == 450
    same = ("arch", "sm_version", "sm_count", "hbm_bytes", "hbm_GBps", "l2_bytes", "dense_tflops")
    assert all(getattr(H800_SXM, f) == getattr(H100_SXM, f) for f in same)
    assert H800_SXM.nvlink_GBps_per_dir == 200 and H800_SXM.nvlink_links == 8
    assert H800_SXM.nvlink_effective_GBps_per_dir == pytest.approx(8 * 20.6)
    assert not topology.specs.EFA_P5EN.gpu_initiated_rdma
    assert NVSWITCH3.sharp and NVLINK_SWITCH5.sharp and not topology.specs.EFA_FABRIC.sharp


def test_format_rates_unknown_name():
    with pytest.raises(UserError, match="unknown number format 'fp3'"):
        H200_SXM.dense_tflops.get("fp3")


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: LinkSpec(kind="nvlink", GBps_per_dir=-1, latency_us=0.1), "greater than 0"),
        (lambda: LinkSpec(kind="nvlink", GBps_per_dir=1, latency_us=-0.1), "greater than or equal to 0"),
        (lambda: LinkSpec(kind="warp", GBps_per_dir=1, latency_us=0.1), "kind"),
        (lambda: LinkSpec(kind="ib", GBps_per_dir=1, latency_us=0.1, colour="red"), "Extra inputs"),
        (lambda: H200_SXM.model_validate({**H200_SXM.model_dump(), "nvlink_effective_GBps_per_dir": 500.0}),
         "exceeds the line rate"),
        (lambda: SwitchSpec(kind="ib", ports=8, sharp=False, reduce_GBps=10, latency_us=0.1), "needs sharp"),
        (lambda: NicSpec(name="x", kind="ib", line_rate_Gbps=0, gpu_initiated_rdma=True, latency_us=1),
         "greater than 0"),
        (lambda: FormatRates(bf16=-5), "greater than 0"),
        (lambda: NodeSpec(name="n", gpu=H200_SXM, n_gpus=8, nvlink=NVLINK4, nvswitch=NVSWITCH3,
                          links_per_switch=(5, 5, 5, 5)), "would use 20 NVLink links"),
        (lambda: NodeSpec(name="n", gpu=H200_SXM, n_gpus=3, nvlink=NVLINK4, direct_links=10),
         "would use 20 NVLink links"),
        (lambda: RackSpec(name="r", node=NodeSpec(name="n", gpu=GB200_GPU, n_gpus=4), n_nodes=19,
                          nvswitch=NVLINK_SWITCH5, n_nvswitches=18, links_per_switch=1, nvlink=NVLINK5),
         "need 76 ports"),
        (lambda: NodeSpec(name="n", gpu="H100", n_gpus=1), "unknown spec 'H100'"),
    ],
)
def test_impossible_specs_rejected(make, match):
    with pytest.raises(ValidationError, match=match):
        make()


def test_specs_are_frozen():
    with pytest.raises(ValidationError):
        H200_SXM.sm_count = 1


# ------------------------------------------------------------------------------------------------ presets


def test_gb200_nvl72():
    t = load("gb200-nvl72")
    c = t.counts()
    assert (c["gpu"], c["nvsw"], c["cpu"], c["nic"]) == (72, 18, 36, 72)
    assert all(t.spec(s).sharp for s in t.nodes("nvsw"))
    assert {t.spec(c).name for c in t.nodes("cpu")} == {"Grace"}
    assert t.hosts == list(range(18))
    assert t.gpus_of_host(1) == [4, 5, 6, 7] and t.host_of(5) == 1 and t.same_host(4, 7) and not t.same_host(3, 4)
    assert t.nvlink_domain(0) == frozenset(range(72))
    g = t.graph
    for i in range(72):
        nb = list(g.neighbors(f"gpu:{i}"))
        assert sorted(x for x in nb if x.startswith("nvsw")) == sorted(t.nodes("nvsw"))  # one link to each ASIC
        assert sum(g[f"gpu:{i}"][x]["link"].n_links for x in nb if x.startswith("nvsw")) == 18
        (cpu,) = [x for x in nb if x.startswith("cpu")]
        assert g[f"gpu:{i}"][cpu]["link"].kind == "c2c" and cpu == f"cpu:{i // 2}"  # 2 GPUs per Grace
        assert t.nic_of_gpu(i) == f"nic:{i}"
    for s in t.nodes("nvsw"):
        assert g.degree(s) == 72
    # P2P inside the domain: 18 switches × 50 GB/s; GPU -> switch -> GPU = 0.25 + 0.1 + 0.25 µs
    assert t.p2p_GBps(0, 71) == pytest.approx(900.0)
    assert t.p2p_latency_us(0, 71) == pytest.approx(0.6)
    assert [h.dst for h in t.path(0, 71)] == ["nvsw:0", "gpu:71"]
    assert t.reducing_switches([0, 1, 2, 3]) == [f"nvsw:{j}" for j in range(18)]
    # the IB path: 72 NICs on 64-port switches -> 3 leaves of 32 NICs + 2 spines
    assert t.counts()["ibsw"] == 5
    assert [h.dst for h in t.path(0, 4, via="net")] == ["nic:0", "ibsw:0", "nic:4", "gpu:4"]
    assert t.p2p_latency_us(0, 4, via="net") == pytest.approx(0.5 + 0.5 + 0.05 + 0.15 + 0.05 + 0.5 + 0.5)
    assert t.p2p_GBps(0, 40, via="net") == pytest.approx(50.0)
    assert len(t.path(0, 40, via="net")) == 6  # leaf -> spine -> leaf
    assert t.p2p_latency_us(0, 40, via="net") == pytest.approx(2.25 + 2 * (0.05 + 0.15))


def test_hgx_h200_links_5_4_4_5():
    t = load("hgx-h200")
    c = t.counts()
    assert (c["gpu"], c["nvsw"], c["cpu"], c["nic"]) == (8, 4, 2, 8)
    g = t.graph
    for i in range(8):
        bw = [g[f"gpu:{i}"][f"nvsw:{j}"]["link"].GBps_per_dir for j in range(4)]
        assert bw == [125.0, 100.0, 100.0, 125.0]  # 5/4/4/5 links × 25 GB/s
        assert g[f"gpu:{i}"][f"cpu:{i // 4}"]["link"].kind == "pcie"
    assert t.p2p_GBps(2, 6) == pytest.approx(450.0)
    assert t.reducing_switches(range(8)) == ["nvsw:0", "nvsw:1", "nvsw:2", "nvsw:3"]
    assert t.nic_spec(t.nic_of_gpu(3)).gpu_initiated_rdma


def test_hgx_h200_efa_two_nodes():
    t = load("hgx-h200-efa*2")
    assert t.n_gpus == 16 and t.counts()["nic"] == 32 and t.hosts == [0, 1]
    assert t.nics_of_gpu(9) == ["nic:18", "nic:19"]
    assert not t.nic_spec("nic:18").gpu_initiated_rdma
    assert t.route_kind(0, 9) == "net"
    assert t.p2p_GBps(0, 9) == pytest.approx(2 * 25.0)  # two 200 Gb/s EFA devices per GPU
    assert t.reducing_switches([0, 9]) == []  # no in-network reduction on EFA


def test_multi_node_ids_are_global():
    t = load("hgx-h200*2")
    assert t.gpu_ids == list(range(16))
    assert t.nvlink_domain(9) == frozenset(range(8, 16)) and t.host_of(8) == 1
    assert t.nodes("nvsw") == [f"nvsw:{j}" for j in range(8)]
    assert t.p2p_GBps(0, 8) == pytest.approx(50.0) and t.route_kind(0, 8) == "net"
    assert t.reducing_switches([0, 8]) == ["ibsw:0"]
    assert t.reducing_switches([0, 1]) == ["nvsw:0", "nvsw:1", "nvsw:2", "nvsw:3"]
    t2 = load("gb200-nvl72*2")
    assert t2.n_gpus == 144 and t2.host_of(143) == 35 and len(t2.nvlink_domains()) == 2
    assert t2.nvlink_domain(72) == frozenset(range(72, 144))


def test_hgx_b200_and_h200x2():
    t = load("hgx-b200")
    assert t.counts()["nvsw"] == 2 and t.gpu_spec(0).name == "B200-HGX"
    assert t.graph["gpu:0"]["nvsw:1"]["link"].n_links == 9
    assert t.p2p_GBps(0, 7) == pytest.approx(900.0)
    lab = load("h200x2")
    c = lab.counts()
    assert (c["gpu"], c["nvsw"], c["nic"]) == (2, 0, 0)
    (hop,) = lab.path(0, 1)
    assert hop.link.n_links == 18 and hop.link.GBps_per_dir == 450.0
    assert lab.p2p_GBps(1, 0) == 450.0 and lab.p2p_latency_us(0, 1) == pytest.approx(0.6)
    assert lab.reducing_switches([0, 1]) == []
    with pytest.raises(UserError, match="GPU 0 has no NIC"):
        lab.nic_of_gpu(0)
    with pytest.raises(UserError, match="no path via net"):
        lab.path(0, 1, via="net")


def test_gb300_nvl72():
    """The GB200 NVL72 rack with Blackwell Ultra GPUs and 800 Gb/s ConnectX-8 NICs on a 144-port XDR fabric."""
    t = load("gb300-nvl72")
    c = t.counts()
    assert (c["gpu"], c["nvsw"], c["cpu"], c["nic"], c["ibsw"]) == (72, 18, 36, 72, 1)  # 72 NICs: one switch
    assert t.gpu_spec(71).name == "B300-GB300" and t.nvlink_domain(0) == frozenset(range(72))
    assert t.p2p_GBps(0, 71) == pytest.approx(900.0)
    assert t.nic_spec(t.nic_of_gpu(5)).name == "CX-8"
    assert t.p2p_GBps(0, 4, via="net") == pytest.approx(100.0)
    assert t.reducing_switches([0, 1]) == [f"nvsw:{j}" for j in range(18)]
    two = load("gb300-nvl72*2")
    assert two.n_gpus == 144 and len(two.nvlink_domains()) == 2 and two.route_kind(0, 72) == "net"
    assert two.p2p_GBps(0, 72) == pytest.approx(100.0)


def test_hgx_b300_h100_h800():
    b = load("hgx-b300")
    assert b.counts()["nvsw"] == 2 and b.gpu_spec(0).name == "B300-HGX"
    assert b.graph["gpu:0"]["nvsw:1"]["link"].n_links == 9 and b.p2p_GBps(0, 7) == pytest.approx(900.0)
    assert b.nic_spec(b.nic_of_gpu(0)).line_rate_Gbps == 800
    assert load("hgx-b300*2").p2p_GBps(0, 8) == pytest.approx(100.0)
    h = load("hgx-h100")
    assert h.gpu_spec(0).name == "H100-SXM" and h.p2p_GBps(2, 6) == pytest.approx(450.0)
    assert h.counts() == load("hgx-h200").counts()
    h8 = load("hgx-h800")
    assert h8.gpu_spec(3).name == "H800-SXM" and h8.counts()["nvsw"] == 4
    g = h8.graph
    for i in range(8):
        assert [g[f"gpu:{i}"][f"nvsw:{j}"]["link"].n_links for j in range(4)] == [2, 2, 2, 2]
    assert h8.p2p_GBps(0, 7) == pytest.approx(200.0)  # 400 GB/s both ways
    assert h8.reducing_switches(range(8)) == ["nvsw:0", "nvsw:1", "nvsw:2", "nvsw:3"]
    two = load("hgx-h800*2")  # 8 x 400G CX-7 per node
    assert two.counts()["nic"] == 16 and two.p2p_GBps(0, 8) == pytest.approx(50.0)
    assert two.nic_spec(two.nic_of_gpu(9)).name == "CX-7"


@pytest.mark.parametrize(
    "name, match",
    [
        ("dgx-a100", "unknown topology 'dgx-a100'"),
        ("hgx-h200*0", "must be an integer 1..64"),
        ("hgx-h200*two", "must be an integer"),
        ("h200x2*2", "no scale-out network"),
    ],
)
def test_bad_preset_names(name, match):
    with pytest.raises(UserError, match=match):
        load(name)


def test_query_errors():
    t = load("hgx-h200")
    with pytest.raises(UserError, match="GPU 8 out of range 0..7"):
        t.gpu_spec(8)
    with pytest.raises(UserError, match="to itself"):
        t.path(3, 3)
    with pytest.raises(UserError, match="unknown route kind"):
        t.path(0, 1, via="carrier-pigeon")
    with pytest.raises(UserError, match="no host 5"):
        t.gpus_of_host(5)
    with pytest.raises(UserError, match="not a NIC"):
        t.nic_spec("gpu:0")


def test_summary_counts():
    s = load("gb200-nvl72").summary()
    assert s["counts"]["gpu"] == 72 and s["sharp_switches"]["nvsw"] == 18 and s["cpus"] == {"Grace": 36}
    assert s["nics"]["CX-7"]["count"] == 72 and s["nvlink_domains"] == {"72": 1}
    assert s["p2p"]["intra_domain"]["GBps_per_dir"] == 900.0 and "cross_domain" not in s["p2p"]
    s2 = load("hgx-h200*2").summary()
    assert s2["p2p"]["cross_domain"]["via"] == "net" and s2["nvlink_domains"] == {"8": 2}


# ------------------------------------------------------------------------------------------------ properties

link_strategy = st.builds(
    LinkSpec, kind=st.just("nvlink"),
    GBps_per_dir=st.floats(0.5, 200, allow_nan=False), latency_us=st.floats(0, 2, allow_nan=False),
)


@st.composite
def clusters(draw) -> ClusterSpec:
    """Small random clusters covering every NVLink shape (none, direct, in-node switches, rack switches)."""
    gpu = draw(st.sampled_from([H200_SXM, GB200_GPU, B200_HGX]))
    n_gpus = draw(st.integers(1, 4))
    n_cpus = draw(st.integers(0, 2))
    nics = draw(st.integers(0, 2))
    nvlink = draw(link_strategy)
    mode = draw(st.sampled_from(["none", "direct", "node_switch", "rack_switch"]))
    node_kw: dict = {"name": "n", "gpu": gpu, "n_gpus": n_gpus}
    if n_cpus:
        node_kw.update(cpu=XEON_8480C, n_cpus=n_cpus, cpu_link=draw(st.sampled_from([PCIE5_X16, C2C])))
    if nics:
        node_kw.update(nic=CX7_IB, nics_per_gpu=nics, nic_link=PCIE5_X16)
    if mode == "direct" and n_gpus > 1:
        node_kw.update(nvlink=nvlink, direct_links=draw(st.integers(1, 18 // (n_gpus - 1))))
    if mode == "node_switch":
        k = draw(st.integers(1, 4))
        lps = tuple(draw(st.lists(st.integers(1, 4), min_size=k, max_size=k)))
        node_kw.update(nvlink=nvlink, nvswitch=NVSWITCH3, links_per_switch=lps)
    has_links = n_cpus or nics or (mode == "direct" and n_gpus > 1) or mode in ("node_switch", "rack_switch")
    if not has_links:
        node_kw.update(cpu=XEON_8480C, n_cpus=1, cpu_link=PCIE5_X16)
    n_nodes = draw(st.integers(1, 3))
    rack_kw: dict = {"name": "r", "node": NodeSpec(**node_kw), "n_nodes": n_nodes}
    if mode == "rack_switch":
        rack_kw.update(nvswitch=NVLINK_SWITCH5, n_nvswitches=draw(st.integers(1, 4)),
                       links_per_switch=draw(st.integers(1, 4)), nvlink=nvlink)
    n_racks = draw(st.integers(1, 3))
    fabric = None
    if nics and draw(st.booleans()):
        small = QUANTUM2.model_copy(update={"ports": 4})  # forces a leaf/spine tree when NICs > 4
        fits_small = n_racks * n_nodes * n_gpus * nics <= 8
        fabric = FabricSpec(switch=draw(st.sampled_from([QUANTUM2, small] if fits_small else [QUANTUM2])),
                            link=draw(st.sampled_from([IB_NDR, EFA_200.model_copy(update={"kind": "ib"})])))
    name = draw(st.sampled_from(["t", "yes", "null", "1:30", "a b#c", "ünï", "*x"]))
    return ClusterSpec(name=name, rack=RackSpec(**rack_kw), n_racks=n_racks, fabric=fabric)


def _latency(t: Topology, hops) -> float:
    """Hand sum: link latencies plus the latency of every transit switch / NIC (CPUs add none)."""
    transit = [h.dst for h in hops[:-1]]
    return (sum(h.link.latency_us for h in hops)
            + sum(t.spec(x).latency_us for x in transit if t.kind(x) in ("nvsw", "ibsw", "nic")))


PROP = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.slow
@PROP
@given(clusters(), st.data())
def test_routing_properties(c, data):
    t = build(c)
    g = t.graph
    n = t.n_gpus
    assert n == c.n_racks * c.rack.n_nodes * c.rack.node.n_gpus
    # domains and hosts partition the GPUs
    doms = t.nvlink_domains()
    assert sorted(i for d in doms for i in d) == list(range(n))
    assert sorted(i for h in t.hosts for i in t.gpus_of_host(h)) == list(range(n))
    if n < 2:
        return
    pairs = data.draw(st.lists(st.tuples(st.integers(0, n - 1), st.integers(0, n - 1))
                               .filter(lambda p: p[0] != p[1]), min_size=1, max_size=6))
    for a, b in pairs:
        try:
            hops = t.path(a, b)
        except UserError:
            assert b not in t.nvlink_domain(a)  # inside a domain there is always a path
            continue
        kind = t.route_kind(a, b)
        assert (kind == "nvlink") == (b in t.nvlink_domain(a))
        # the path chains from a to b over real edges; GPUs and CPUs are never transit nodes
        assert hops[0].src == f"gpu:{a}" and hops[-1].dst == f"gpu:{b}"
        transit_ok = {"nvlink": {"nvsw"}, "net": {"nic", "ibsw"}, "host": {"cpu"}}[kind]
        for h1, h2 in itertools.pairwise(hops):
            assert h1.dst == h2.src and t.kind(h1.dst) in transit_ok
        for h in hops:
            assert g[h.src][h.dst]["link"] == h.link
        lat = t.p2p_latency_us(a, b)
        assert lat == pytest.approx(t.p2p_latency_us(b, a))
        assert lat == pytest.approx(_latency(t, hops))
        bw = t.p2p_GBps(a, b)
        assert bw > 0 and bw == pytest.approx(t.p2p_GBps(b, a))
        # the fast one-tier NVLink formula equals the general max flow; the cut around a bounds it
        assert bw == pytest.approx(t.max_flow_GBps(a, b, kind))
        allowed = {"nvlink"} if kind == "nvlink" else {"pcie", "ib", "efa", "ethernet", "c2c"}
        cut = sum(d["link"].GBps_per_dir for _, _, d in g.edges(f"gpu:{a}", data=True)
                  if d["link"].kind in allowed)
        assert bw <= cut + 1e-9
        if kind == "nvlink":
            # Dijkstra over the whole NVLink subgraph finds no lower latency than the fast path
            assert lat == pytest.approx(_latency(t, t._dijkstra("nvlink", a, b)))
    group = data.draw(st.sets(st.integers(0, n - 1), min_size=2, max_size=min(n, 5)))
    for sw in t.reducing_switches(group):
        assert t.spec(sw).sharp
        if sw.startswith("nvsw"):
            assert all(g.has_edge(f"gpu:{i}", sw) for i in group)


def test_max_flow_through_switch_mesh():
    """Two NVSwitches linked to each other (not a preset shape): the general max flow is used and honours the
    switch–switch bottleneck."""
    g = nx.Graph()
    for i in range(2):
        g.add_node(f"gpu:{i}", kind="gpu", spec=H200_SXM, host=i)
    for j in range(2):
        g.add_node(f"nvsw:{j}", kind="nvsw", spec=NVSWITCH3, host=None)
    g.add_edge("gpu:0", "nvsw:0", link=NVLINK4.bundle(18))
    g.add_edge("gpu:1", "nvsw:1", link=NVLINK4.bundle(18))
    g.add_edge("nvsw:0", "nvsw:1", link=NVLINK4.bundle(4))
    t = Topology(g, "mesh")
    assert t.route_kind(0, 1) == "nvlink" and t.p2p_GBps(0, 1) == pytest.approx(100.0)
    assert [h.dst for h in t.path(0, 1)] == ["nvsw:0", "nvsw:1", "gpu:1"]
    assert t.p2p_latency_us(0, 1) == pytest.approx(3 * 0.25 + 2 * 0.1)


def test_queries_are_cached_and_fast():
    import time

    t = load("gb200-nvl72")
    start = time.perf_counter()
    for a, b in itertools.permutations(range(72), 2):
        t.p2p_GBps(a, b)
        t.p2p_latency_us(a, b)
    first = time.perf_counter() - start
    start = time.perf_counter()
    for a, b in itertools.permutations(range(72), 2):
        t.p2p_GBps(a, b)
        t.p2p_latency_us(a, b)
    again = time.perf_counter() - start
    assert again < first and again < 1.0
