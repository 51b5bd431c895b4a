"""Preset racks and clusters, and the builder that turns a :class:`ClusterSpec` into a :class:`Topology`.

Presets (``topology.load(name)``):

- ``gb200-nvl72``: 18 compute trays × (4 GPUs + 2 Grace, each Grace joined by NVLink-C2C to 2 GPUs), 18
  NVLink-5 switch ASICs (9 switch trays × 2), every GPU one link to every ASIC (18 × 50 = 900 GB/s per
  direction), one CX-7 per GPU on a Quantum-2 fabric (72 NICs > 64 ports: 3 leaves + 2 spines). Source:
  NVIDIA GB200 NVL72 datasheet.
- ``hgx-h200``: 8 H200 + 4 NVSwitch-3 (NVLS); the 18 links of each GPU go 5/4/4/5 to the four switches (HGX
  H100/H200 baseboard), 2 x86 CPUs on PCIe, one CX-7 per GPU on a Quantum-2 leaf.
- ``hgx-h200-efa``: the same node as AWS p5en: 16 EFA devices (2 per GPU, 200 Gb/s each = 3200 Gb/s per node),
  no GPU-initiated RDMA.
- ``hgx-b200``: 8 B200 + 2 NVLink-5 switch chips (9 links from every GPU to each), CX-7 per GPU (DGX B200).
- ``gb300-nvl72``: the GB200 NVL72 rack with Blackwell Ultra GPUs (288 GB HBM3e, 15 dense FP4 PFLOP/s per GPU) and
  one 800 Gb/s ConnectX-8 per GPU on a Quantum-X800 (XDR, 144-port) fabric: 72 NICs fit one switch. The same
  18 trays × (4 GPUs + 2 Grace), 18 NVLink-5 switch ASICs, 900 GB/s per GPU per direction. Source: NVIDIA GB300
  NVL72 datasheet.
- ``hgx-b300``: 8 B300 + 2 NVLink-5 switch chips (9 links each, as HGX B200), one 800 Gb/s ConnectX-8 per GPU
  on PCIe Gen6 and a Quantum-X800 leaf. Source: NVIDIA HGX B300 datasheet.
- ``hgx-h100``: ``hgx-h200`` with H100 GPUs (80 GB HBM3, 3.35 TB/s; same NVLink and NICs as DGX H100).
- ``hgx-h800``: the HGX H100 board with H800 GPUs: H100 compute and memory, 8 NVLink-4 links per GPU (2 to each
  of the 4 NVSwitches: 200 GB/s per direction, the 400 GB/s both ways of the H800), one 400 Gb/s CX-7 per GPU
  on a Quantum-2 leaf — the 8 × 400G InfiniBand of the large published H800 deployments (DeepSeek-V3's training
  and serving cluster); 200 Gb/s cards exist in smaller builds, build that from a topology file.
- ``h200x2``: the lab box — 2 H200 joined directly by 18 NVLink-4 links (NV18, 450 GB/s per direction line
  rate, 385 GB/s measured), one x86 CPU, no scale-out NIC.
- ``NAME*N``: N copies of a preset's rack joined by its fabric (e.g. ``hgx-h200*2``, ``gb200-nvl72*2``). GPU
  ids run 0..N*g-1, hosts are numbered globally, fabric switches are rebuilt for all NICs.
- ``A+B``: presets (each ``NAME``, ``NAME*N`` or ``NAME@G``) side by side, numbered in that order, every NIC
  on one fabric of the first part's switches and links (e.g. ``hgx-h200*4+gb200-nvl72``: 4 H200 nodes, then
  one GB200 NVL72 rack); every part needs NICs. A scenario places each role on one GPU kind with
  ``prefill.gpu`` / ``decode.gpu``.
- ``NAME@G``: a rack of several nodes populated with its first G GPUs (whole nodes; e.g. ``gb200-nvl72@16`` =
  4 compute trays on the rack's 18 NVLink switch ASICs). :func:`resized` picks ``NAME*N`` or ``NAME@G`` for a
  GPU count (``rackbed run --gpus``).

Numbering (every builder output): rack by rack, node by node; within a node GPUs, then CPUs, then NICs
(NIC ``k`` of GPU ``i`` is ``nic:i*nics_per_gpu+k``), then in-node NVSwitches; rack-level NVSwitches after the
rack's nodes; fabric leaves ``ibsw:0..L-1`` then spines.
"""

from __future__ import annotations

import math
import re

import networkx as nx

from rackbed.topology.errors import UserError
from rackbed.topology.graph import RackPower, Topology
from rackbed.topology.specs import (
    B200_HGX,
    B300_HGX,
    C2C,
    CX7_IB,
    CX8_IB,
    EFA_200,
    EFA_FABRIC,
    EFA_P5EN,
    GB200_GPU,
    GB300_GPU,
    GRACE,
    H100_SXM,
    H200_SXM,
    H800_SXM,
    IB_NDR,
    IB_XDR,
    NVLINK4,
    NVLINK4_DIRECT,
    NVLINK5,
    NVLINK_SWITCH5,
    NVSWITCH3,
    PCIE5_X16,
    PCIE6_X16,
    QUANTUM2,
    QUANTUM_X800,
    XEON_8480C,
    ClusterSpec,
    FabricSpec,
    NodeSpec,
    RackSpec,
)

IB_FABRIC = FabricSpec(switch=QUANTUM2, link=IB_NDR)

# Power apart from the GPUs (NodeSpec.overhead_w, RackSpec.overhead_w, RackSpec.rack_power_kw). All overheads are
# assumptions for a node at typical load, bounded by the vendors' system maxima:
# - HGX H100/H200/H800 node: 2.0 kW (two Xeons, four NVSwitches, 8 + 2 NICs, fans, drives). NVIDIA DGX H100 /
#   DGX H200 datasheet: 10.2 kW maximum system power, i.e. at most 4.6 kW beside 8 x 700 W of GPUs.
# - HGX B200 / B300 node: 2.5 kW. NVIDIA DGX B200 datasheet: 14.3 kW maximum, at most 6.3 kW beside the GPUs.
# - GB200 / GB300 compute tray: 600 W beside the four GPUs' figures, which already hold the Grace CPUs (NICs,
#   BlueField DPU, drives, fans). NVL72 rack: 14 kW for the nine NVLink switch trays, power shelves and
#   management. Rack limit: NVIDIA GB200 NVL72 material puts the rack at ~120 kW and integrators' specifications
#   at up to 132 kW; 132 kW is used (72 x 1200 + 18 x 600 + 14000 W = 111 kW peak fits). GB300 NVL72: ~135 kW
#   published rack figures (72 x 1400 + 18 x 600 + 14000 W = 126 kW peak fits).
# - An HGX preset's "rack" is one node: no rack limit (a topology file sets rack_power_kw to model one).
# - h200x2 lab box: 800 W (one Xeon, fans, drives; assumption).
HGX_HOPPER_OVERHEAD_W = 2000.0
HGX_BLACKWELL_OVERHEAD_W = 2500.0
NVL72_TRAY_OVERHEAD_W = 600.0
NVL72_RACK_OVERHEAD_W = 14000.0
EFA_NET = FabricSpec(switch=EFA_FABRIC, link=EFA_200)
XDR_FABRIC = FabricSpec(switch=QUANTUM_X800, link=IB_XDR)

GB200_TRAY = NodeSpec(
    name="GB200 compute tray", gpu=GB200_GPU, n_gpus=4, cpu=GRACE, n_cpus=2, cpu_link=C2C,
    nic=CX7_IB, nics_per_gpu=1, nic_link=PCIE5_X16, overhead_w=NVL72_TRAY_OVERHEAD_W,
)
HGX_H200 = NodeSpec(
    name="HGX H200", gpu=H200_SXM, n_gpus=8, cpu=XEON_8480C, n_cpus=2, cpu_link=PCIE5_X16,
    nic=CX7_IB, nics_per_gpu=1, nic_link=PCIE5_X16,
    nvlink=NVLINK4, nvswitch=NVSWITCH3, links_per_switch=(5, 4, 4, 5), overhead_w=HGX_HOPPER_OVERHEAD_W,
)
HGX_H200_EFA = HGX_H200.model_copy(update={"name": "HGX H200 (p5en, EFA)", "nic": EFA_P5EN, "nics_per_gpu": 2})
HGX_B200 = NodeSpec(
    name="HGX B200", gpu=B200_HGX, n_gpus=8, cpu=XEON_8480C, n_cpus=2, cpu_link=PCIE5_X16,
    nic=CX7_IB, nics_per_gpu=1, nic_link=PCIE5_X16,
    nvlink=NVLINK5, nvswitch=NVLINK_SWITCH5, links_per_switch=(9, 9), overhead_w=HGX_BLACKWELL_OVERHEAD_W,
)
GB300_TRAY = GB200_TRAY.model_copy(update={"name": "GB300 compute tray", "gpu": GB300_GPU, "nic": CX8_IB,
                                            "nic_link": PCIE6_X16})
HGX_B300 = HGX_B200.model_copy(update={"name": "HGX B300", "gpu": B300_HGX, "nic": CX8_IB, "nic_link": PCIE6_X16})
HGX_H100 = HGX_H200.model_copy(update={"name": "HGX H100", "gpu": H100_SXM})
HGX_H800 = HGX_H200.model_copy(update={"name": "HGX H800", "gpu": H800_SXM, "links_per_switch": (2, 2, 2, 2)})
H200X2_BOX = NodeSpec(
    name="h200x2 lab box", gpu=H200_SXM, n_gpus=2, cpu=XEON_8480C, n_cpus=1, cpu_link=PCIE5_X16,
    nvlink=NVLINK4_DIRECT, direct_links=18, overhead_w=800.0,
)

PRESETS: dict[str, ClusterSpec] = {
    "gb200-nvl72": ClusterSpec(
        name="gb200-nvl72",
        rack=RackSpec(name="GB200 NVL72", node=GB200_TRAY, n_nodes=18, nvswitch=NVLINK_SWITCH5, n_nvswitches=18,
                      links_per_switch=1, nvlink=NVLINK5, overhead_w=NVL72_RACK_OVERHEAD_W,
                      rack_power_kw=132.0),
        fabric=IB_FABRIC,
    ),
    "hgx-h200": ClusterSpec(name="hgx-h200", rack=RackSpec(name="HGX H200", node=HGX_H200, n_nodes=1),
                            fabric=IB_FABRIC),
    "hgx-h200-efa": ClusterSpec(name="hgx-h200-efa",
                                rack=RackSpec(name="HGX H200 p5en", node=HGX_H200_EFA, n_nodes=1),
                                fabric=EFA_NET),
    "hgx-b200": ClusterSpec(name="hgx-b200", rack=RackSpec(name="HGX B200", node=HGX_B200, n_nodes=1),
                            fabric=IB_FABRIC),
    "gb300-nvl72": ClusterSpec(
        name="gb300-nvl72",
        rack=RackSpec(name="GB300 NVL72", node=GB300_TRAY, n_nodes=18, nvswitch=NVLINK_SWITCH5, n_nvswitches=18,
                      links_per_switch=1, nvlink=NVLINK5, overhead_w=NVL72_RACK_OVERHEAD_W,
                      rack_power_kw=135.0),
        fabric=XDR_FABRIC,
    ),
    "hgx-b300": ClusterSpec(name="hgx-b300", rack=RackSpec(name="HGX B300", node=HGX_B300, n_nodes=1),
                            fabric=XDR_FABRIC),
    "hgx-h100": ClusterSpec(name="hgx-h100", rack=RackSpec(name="HGX H100", node=HGX_H100, n_nodes=1),
                            fabric=IB_FABRIC),
    "hgx-h800": ClusterSpec(name="hgx-h800", rack=RackSpec(name="HGX H800", node=HGX_H800, n_nodes=1),
                            fabric=IB_FABRIC),
    "h200x2": ClusterSpec(name="h200x2", rack=RackSpec(name="h200x2", node=H200X2_BOX, n_nodes=1)),
}

_MULTI = re.compile(r"^(?P<name>[A-Za-z0-9._-]+)\s*\*\s*(?P<n>[^*]+)$")
_PART = re.compile(r"^(?P<name>[A-Za-z0-9._-]+)\s*@\s*(?P<g>[^@]+)$")
MAX_COPIES = 64


def preset_names() -> list[str]:
    return list(PRESETS)


def cluster_spec(name: str) -> ClusterSpec:
    """The ClusterSpec of a preset name, ``NAME*N`` or ``NAME@G``; UserError for unknown names or bad N / G."""
    part = _PART.match(name.strip())
    if part:
        return _partial_rack(name, part.group("name"), part.group("g").strip())
    m = _MULTI.match(name.strip())
    base, n = (m.group("name"), m.group("n").strip()) if m else (name.strip(), None)
    if base not in PRESETS:
        raise UserError(f"unknown topology {name!r}: not a preset ({', '.join(PRESETS)}; NAME*N for N copies) "
                        f"nor an existing file")
    spec = PRESETS[base]
    if n is None:
        return spec
    if not n.isdigit() or not 1 <= int(n) <= MAX_COPIES:
        raise UserError(f"topology {name!r}: the copy count N in NAME*N must be an integer 1..{MAX_COPIES}")
    copies = int(n)
    if copies > 1 and spec.fabric is None:
        raise UserError(f"topology {name!r}: {base} has no scale-out network to join copies with")
    return spec.model_copy(update={"name": f"{base}*{copies}", "n_racks": spec.n_racks * copies})


def _partial_rack(name: str, base: str, g: str) -> ClusterSpec:
    """``NAME@G``: the preset's rack with its first ``G / node GPUs`` nodes."""
    if base not in PRESETS:
        raise UserError(f"unknown topology {name!r}: {base!r} is not a preset ({', '.join(PRESETS)})")
    spec = PRESETS[base]
    per_node, n_nodes = spec.rack.node.n_gpus, spec.rack.n_nodes
    if not g.isdigit() or not 1 <= int(g) <= per_node * n_nodes or int(g) % per_node:
        raise UserError(f"topology {name!r}: G in NAME@G must be a multiple of {per_node} (GPUs per node) up to "
                        f"{per_node * n_nodes} (one {spec.rack.name})")
    rack = spec.rack.model_copy(update={"n_nodes": int(g) // per_node})
    return spec.model_copy(update={"name": f"{base}@{int(g)}", "rack": rack})


def resized(name: str, n_gpus: int) -> str:
    """The preset name with ``n_gpus`` GPUs built from ``name``'s rack: ``NAME`` (one rack), ``NAME*N`` (N racks)
    or ``NAME@G`` (part of a rack of several nodes). UserError (naming ``--gpus``) when no such layout exists."""
    if "+" in name:
        raise UserError(f"--gpus: the topology {name!r} joins presets; give each part's size in it instead")
    m = _MULTI.match(name.strip()) or _PART.match(name.strip())
    base = m.group("name") if m else name.strip()
    if base not in PRESETS:
        raise UserError(f"--gpus: the topology {name!r} is not a preset (a topology file has a fixed size)")
    rack = PRESETS[base].rack
    per_rack = rack.node.n_gpus * rack.n_nodes
    if n_gpus >= per_rack and n_gpus % per_rack == 0:
        copies = n_gpus // per_rack
        if copies > MAX_COPIES:
            raise UserError(f"--gpus {n_gpus}: more than {MAX_COPIES} copies of {base} ({per_rack} GPUs each)")
        if copies > 1 and PRESETS[base].fabric is None:
            raise UserError(f"--gpus {n_gpus}: {base} has {per_rack} GPUs and no scale-out network to join more")
        return base if copies == 1 else f"{base}*{copies}"
    if rack.n_nodes > 1 and 0 < n_gpus < per_rack and n_gpus % rack.node.n_gpus == 0:
        return f"{base}@{n_gpus}"
    hint = (f"a multiple of {rack.node.n_gpus} up to {per_rack}, or" if rack.n_nodes > 1 else "")
    raise UserError(f"--gpus {n_gpus}: {base} comes in {rack.node.n_gpus}-GPU nodes, {per_rack} per "
                    f"{rack.name}; give {hint} a multiple of {per_rack}".replace("  ", " "))


def preset(name: str) -> Topology:
    """Build a preset (``NAME``, ``NAME*N``, ``NAME@G``) or a join of presets (``A+B``) topology."""
    parts = [p.strip() for p in name.split("+")]
    if len(parts) == 1:
        return build(cluster_spec(name))
    if not all(parts):
        raise UserError(f"topology {name!r}: join presets with '+', e.g. hgx-h200*4+gb200-nvl72")
    specs = [cluster_spec(p) for p in parts]
    for p, c in zip(parts, specs):
        if c.fabric is None:
            raise UserError(f"topology {name!r}: {p} has no scale-out network to join others with")
    return build(specs[0], name=name.replace(" ", ""), more=tuple(specs[1:]))


def build(c: ClusterSpec, *, name: str | None = None, more: tuple[ClusterSpec, ...] = ()) -> Topology:
    """Expand a ClusterSpec into the graph described in ``topology.graph`` (numbering in the module doc).
    ``more``: further ClusterSpecs built after it (GPU, host and NIC numbers continuing), every NIC of all of
    them on one fabric of ``c``'s switches and links (a join, ``A+B``)."""
    g = nx.Graph()
    count = {"gpu": 0, "nvsw": 0, "cpu": 0, "nic": 0, "ibsw": 0}

    def add(kind: str, spec, host: int | None = None) -> str:
        nid = f"{kind}:{count[kind]}"
        count[kind] += 1
        g.add_node(nid, kind=kind, spec=spec, host=host)
        return nid

    nics: list[str] = []
    host = 0
    racks: list[RackPower] = []
    for part in (c, *more):
        host = _add_racks(g, part, add, nics, host, racks, joined=bool(more))
    if c.fabric is not None:
        _add_fabric(g, c, nics, add)
    return Topology(g, name or c.name, racks=tuple(racks))


def _add_racks(g: nx.Graph, c: ClusterSpec, add, nics: list[str], host: int, racks: list[RackPower], *,
               joined: bool = False) -> int:
    """The racks of ``c`` (nodes numbered from ``host``, their NICs appended to ``nics``, each rack's power
    domain appended to ``racks``); returns the next host."""
    rack, node = c.rack, c.rack.node
    for r in range(c.n_racks):
        rack_gpus: list[str] = []
        host0 = host
        for _ in range(rack.n_nodes):
            gpus = [add("gpu", node.gpu, host) for _ in range(node.n_gpus)]
            cpus = [add("cpu", node.cpu, host) for _ in range(node.n_cpus)]
            for i, gid in enumerate(gpus):
                if cpus:
                    g.add_edge(gid, cpus[i * len(cpus) // len(gpus)], link=node.cpu_link)
            for gid in gpus:
                for _ in range(node.nics_per_gpu):
                    nic = add("nic", node.nic, host)
                    g.add_edge(gid, nic, link=node.nic_link)
                    nics.append(nic)
            if node.nvswitch is not None:
                switches = [add("nvsw", node.nvswitch) for _ in node.links_per_switch]
                for gid in gpus:
                    for sw, k in zip(switches, node.links_per_switch):
                        g.add_edge(gid, sw, link=node.nvlink.bundle(k))
            elif node.direct_links:
                for i in range(len(gpus)):
                    for j in range(i + 1, len(gpus)):
                        g.add_edge(gpus[i], gpus[j], link=node.nvlink.bundle(node.direct_links))
            rack_gpus += gpus
            host += 1
        if rack.nvswitch is not None:
            switches = [add("nvsw", rack.nvswitch) for _ in range(rack.n_nvswitches)]
            for gid in rack_gpus:
                for sw in switches:
                    g.add_edge(gid, sw, link=rack.nvlink.bundle(rack.links_per_switch))
        racks.append(RackPower(name=f"{rack.name} #{len(racks)}" if c.n_racks > 1 or joined else rack.name,
                               gpus=tuple(int(x.split(":")[1]) for x in rack_gpus),
                               hosts=tuple(range(host0, host)),
                               node_overhead_w=node.overhead_w, rack_overhead_w=rack.overhead_w,
                               limit_kw=rack.rack_power_kw))
    return host


def _add_fabric(g: nx.Graph, c: ClusterSpec, nics: list[str], add) -> None:
    """One switch when the NICs fit its ports; else a two-level fat tree: leaves with ``ports // 2`` NIC ports
    and the rest up, ``ceil(leaves × up / ports)`` spines, each leaf–spine edge bundling ``up // spines``
    links."""
    sw, link = c.fabric.switch, c.fabric.link
    ports = sw.ports
    if len(nics) <= ports:
        leaf = add("ibsw", sw)
        for nic in nics:
            g.add_edge(nic, leaf, link=link)
        return
    down = ports // 2
    up = ports - down
    n_leaves = math.ceil(len(nics) / down)
    if down == 0 or n_leaves > ports:
        raise UserError(f"{c.name}: {len(nics)} NICs exceed a two-level fat tree of {ports}-port "
                        f"{sw.name or 'switches'} (at most {ports * down} NICs)")
    n_spines = math.ceil(n_leaves * up / ports)
    leaves = [add("ibsw", sw) for _ in range(n_leaves)]
    spines = [add("ibsw", sw) for _ in range(n_spines)]
    for k, nic in enumerate(nics):
        g.add_edge(nic, leaves[k // down], link=link)
    per_pair = up // n_spines
    for leaf in leaves:
        for spine in spines:
            g.add_edge(leaf, spine, link=link.bundle(per_pair))
