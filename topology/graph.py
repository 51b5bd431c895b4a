"""``Topology``: a rack / cluster as a networkx graph, with the queries the planner and simulator ask in loops.

Graph schema (node ids are strings ``<kind>:<int>``):

- node kinds: ``gpu`` (GpuSpec), ``nvsw`` (SwitchSpec, kind "nvswitch"), ``cpu`` (CpuSpec), ``nic`` (NicSpec),
  ``ibsw`` (SwitchSpec, kind "ib" or "ethernet": the scale-out fabric). Node data: ``kind``, ``spec``, ``host``
  (int for gpu/cpu/nic — the node or compute-tray index, global over the cluster; None for switches).
- edges: data ``link`` (LinkSpec); one edge bundles ``link.n_links`` physical links.
- GPUs are ``gpu:0 .. gpu:N-1`` and the API addresses them by that int.

Routing. Traffic between two GPUs of one NVLink domain (the connected component of GPUs and NVSwitches over
NVLink edges) goes over NVLink; otherwise over the scale-out network (GPU → its NICs → fabric switches → the
peer's NICs → peer); as a last resort through a CPU the two GPUs share (PCIe / C2C). GPUs and CPUs are never
transit nodes; NICs are transit only for their own GPU. Bandwidth is the maximum flow between the two GPUs over
the allowed part of the graph (per direction, line rate; a NIC node is capped at its line rate), so 18 parallel
NVLink switches add up; latency is the sum of link latencies and transit switch / NIC latencies along the
lowest-latency path.
"""

from __future__ import annotations

import itertools
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass

import networkx as nx

from rackbed.topology.errors import UserError
from rackbed.topology.specs import CpuSpec, GpuSpec, LinkSpec, NicSpec, SwitchSpec

NODE_KINDS: dict[str, type] = {"gpu": GpuSpec, "nvsw": SwitchSpec, "cpu": CpuSpec, "nic": NicSpec,
                               "ibsw": SwitchSpec}
_ID = re.compile(r"^(gpu|nvsw|cpu|nic|ibsw):(0|[1-9][0-9]*)$")
# which node kinds each link kind may join
_LINK_ENDS: dict[str, set[str]] = {
    "nvlink": {"gpu", "nvsw"},
    "c2c": {"gpu", "cpu"},
    "pcie": {"gpu", "cpu", "nic"},
    "ib": {"nic", "ibsw"},
    "efa": {"nic", "ibsw"},
    "ethernet": {"nic", "ibsw"},
}
VIAS = ("nvlink", "net", "host")


@dataclass(frozen=True)
class Hop:
    """One edge of a path, traversed from ``src`` to ``dst`` (node ids)."""

    src: str
    dst: str
    link: LinkSpec


@dataclass(frozen=True)
class RackPower:
    """The power layout of one rack, for energy accounting and the rack power limit (``topology.power``):
    its GPUs and hosts, the draw of each host apart from its GPUs (``NodeSpec.overhead_w``), the rack's own
    (``RackSpec.overhead_w``) and its limit (``RackSpec.rack_power_kw``; None: none)."""

    name: str
    gpus: tuple[int, ...]
    hosts: tuple[int, ...]
    node_overhead_w: float = 0.0
    rack_overhead_w: float = 0.0
    limit_kw: float | None = None


def node_id(kind: str, index: int) -> str:
    return f"{kind}:{index}"


def parse_id(nid: str) -> tuple[str, int]:
    """``"gpu:3"`` -> ``("gpu", 3)``; UserError for anything else."""
    m = _ID.match(nid) if isinstance(nid, str) else None
    if not m:
        raise UserError(f"bad node id {nid!r}: expected <kind>:<int> with kind one of {', '.join(NODE_KINDS)}")
    return m.group(1), int(m.group(2))


def validate_graph(g: nx.Graph, locate=lambda nid: nid, locate_edge=lambda u, v: f"link {u}–{v}") -> None:
    """Check the schema above; raise a one-line UserError ``"<where>: <rule>"``. ``locate(node_id)`` turns a
    node id into a location (io maps it to ``nodes[i]``); edges are located as ``"link a–b"``."""
    gpus: list[int] = []
    for nid, data in g.nodes(data=True):
        try:
            kind, idx = parse_id(nid)
        except UserError as exc:
            raise UserError(f"{locate(nid)}: {exc}") from None
        spec = data.get("spec")
        if data.get("kind") != kind:
            raise UserError(f"{locate(nid)}: kind {data.get('kind')!r} does not match id {nid!r}")
        if not isinstance(spec, NODE_KINDS[kind]):
            raise UserError(f"{locate(nid)}: spec must be a {NODE_KINDS[kind].__name__}")
        if kind == "nvsw" and spec.kind != "nvswitch":
            raise UserError(f"{locate(nid)}: an nvsw node needs a switch of kind 'nvswitch', got {spec.kind!r}")
        if kind == "ibsw" and spec.kind == "nvswitch":
            raise UserError(f"{locate(nid)}: an ibsw node needs a switch of kind 'ib' or 'ethernet'")
        host = data.get("host")
        if kind in ("gpu", "cpu", "nic"):
            if not isinstance(host, int) or isinstance(host, bool) or host < 0:
                raise UserError(f"{locate(nid)}: host must be an integer >= 0, got {host!r}")
        elif host is not None:
            raise UserError(f"{locate(nid)}: a switch has no host (got host={host!r})")
        if kind == "gpu":
            gpus.append(idx)
    if not gpus:
        raise UserError("nodes: topology has no GPUs")
    gpus.sort()
    if gpus != list(range(len(gpus))):
        missing = sorted(set(range(len(gpus))) - set(gpus))
        raise UserError(f"nodes: GPU ids must be gpu:0..gpu:{len(gpus) - 1} (contiguous); "
                        f"gpu:{missing[0]} is missing")
    nvlinks: Counter = Counter()
    for u, v, data in g.edges(data=True):
        link = data.get("link")
        where = locate_edge(u, v)
        if u == v:
            raise UserError(f"{where}: a link cannot join a node to itself")
        if not isinstance(link, LinkSpec):
            raise UserError(f"{where}: missing link spec")
        ku, kv = g.nodes[u]["kind"], g.nodes[v]["kind"]
        allowed = _LINK_ENDS[link.kind]
        if ku not in allowed or kv not in allowed or (ku == kv and ku in ("gpu", "cpu", "nic") and link.kind != "nvlink"):
            raise UserError(f"{where}: a link of kind {link.kind!r} cannot join {ku} to {kv}")
        if link.kind == "nvlink":
            nvlinks[u] += link.n_links
            nvlinks[v] += link.n_links
    for nid in g.nodes:
        data = g.nodes[nid]
        if data["kind"] == "gpu":
            if g.degree(nid) == 0:
                raise UserError(f"{locate(nid)}: GPU {nid} has no links")
            if nvlinks[nid] > data["spec"].nvlink_links:
                raise UserError(f"{locate(nid)}: {nvlinks[nid]} NVLink links attached but {data['spec'].name} "
                                f"has {data['spec'].nvlink_links}")
        elif data["kind"] == "nvsw" and nvlinks[nid] > data["spec"].ports:
            raise UserError(f"{locate(nid)}: {nvlinks[nid]} NVLink links attached but the switch has "
                            f"{data['spec'].ports} ports")


class Topology:
    """A validated topology graph plus precomputed indices and cached path queries.

    Construct from a graph following the module schema (``Topology(graph, name)``), from a preset or file with
    ``topology.load``. Instances are treated as immutable: the graph is frozen on construction.

    ``racks``: the power layout (:class:`RackPower` per rack) when the topology was built from racks (presets,
    the cluster form of a file); () for the graph form, which knows no racks — energy then counts the GPUs only.
    It is not part of the structure (``==`` compares graphs).
    """

    def __init__(self, graph: nx.Graph, name: str = "topology", *, locate=lambda nid: nid,
                 locate_edge=lambda u, v: f"link {u}–{v}", racks: tuple[RackPower, ...] = ()):
        validate_graph(graph, locate, locate_edge)
        self.racks: tuple[RackPower, ...] = tuple(racks)
        self._name = str(name)
        self._g = nx.freeze(graph)
        self._kind = {n: d["kind"] for n, d in graph.nodes(data=True)}
        self._spec = {n: d["spec"] for n, d in graph.nodes(data=True)}
        n = sum(1 for k in self._kind.values() if k == "gpu")
        self._n_gpus = n
        self._host = [graph.nodes[f"gpu:{i}"]["host"] for i in range(n)]
        self._gpus_of_host: dict[int, list[int]] = {}
        for i, h in enumerate(self._host):
            self._gpus_of_host.setdefault(h, []).append(i)
        # NVLink domains: components of the GPU+NVSwitch subgraph over NVLink edges.
        nv = nx.Graph()
        nv.add_nodes_from(f"gpu:{i}" for i in range(n))
        nv.add_edges_from((u, v) for u, v, d in graph.edges(data=True) if d["link"].kind == "nvlink")
        self._domain: list[frozenset[int]] = [frozenset()] * n
        for comp in nx.connected_components(nv):
            gpus = frozenset(parse_id(x)[1] for x in comp if x.startswith("gpu:"))
            for i in gpus:
                self._domain[i] = gpus
        self._nvsw_mesh = any(self._kind[u] == "nvsw" and self._kind[v] == "nvsw" and d["link"].kind == "nvlink"
                              for u, v, d in graph.edges(data=True))
        self._nics = [sorted((x for x in graph.neighbors(f"gpu:{i}") if self._kind[x] == "nic"),
                             key=lambda x: parse_id(x)[1]) for i in range(n)]
        # per GPU: NVLink edges (neighbour -> LinkSpec) and their capacity (GB/s per direction)
        self._nvlinks = [{x: d["link"] for x, d in graph[f"gpu:{i}"].items() if d["link"].kind == "nvlink"}
                         for i in range(n)]
        self._nvcap = [{x: link.GBps_per_dir for x, link in e.items()} for e in self._nvlinks]
        self._index = {x: parse_id(x)[1] for x in self._kind}
        self._path_cache: dict[tuple[int, int, str], tuple[str, list[Hop]]] = {}
        self._via_cache: dict[str, tuple[dict, frozenset[str]]] = {}
        self._bw_cache: dict[tuple[int, int, str], float] = {}
        self._structure: tuple | None = None

    # ------------------------------------------------------------------------------------------- basics
    @property
    def name(self) -> str:
        return self._name

    @property
    def graph(self) -> nx.Graph:
        """The (frozen) networkx graph."""
        return self._g

    @property
    def n_gpus(self) -> int:
        return self._n_gpus

    @property
    def gpu_ids(self) -> list[int]:
        return list(range(self._n_gpus))

    @property
    def hosts(self) -> list[int]:
        """Host (node / tray) indices that hold GPUs, ascending."""
        return sorted(self._gpus_of_host)

    def nodes(self, kind: str | None = None) -> list[str]:
        """Node ids, of one kind if given, in (kind, index) order."""
        ids = [x for x in self._kind if kind is None or self._kind[x] == kind]
        order = list(NODE_KINDS)
        return sorted(ids, key=lambda x: (order.index(self._kind[x]), parse_id(x)[1]))

    def kind(self, nid: str) -> str:
        self._check_node(nid)
        return self._kind[nid]

    def spec(self, nid: str):
        """The spec of any node id."""
        self._check_node(nid)
        return self._spec[nid]

    def host_of_node(self, nid: str) -> int | None:
        self._check_node(nid)
        return self._g.nodes[nid]["host"]

    def links(self) -> Iterator[tuple[str, str, LinkSpec]]:
        for u, v, d in self._g.edges(data=True):
            yield u, v, d["link"]

    def _check_node(self, nid: str) -> None:
        if nid not in self._kind:
            raise UserError(f"{self.name}: no node {nid!r}")

    def _check_gpu(self, i: int) -> str:
        if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < self._n_gpus:
            raise UserError(f"{self.name}: GPU {i!r} out of range 0..{self._n_gpus - 1}")
        return f"gpu:{i}"

    def gpu_spec(self, i: int) -> GpuSpec:
        return self._spec[self._check_gpu(i)]

    def host_memory(self, i: int) -> tuple[object, LinkSpec, int] | None:
        """GPU ``i``'s host memory: ``(CpuSpec, link, GPUs on that CPU)`` — the CPU it hangs off (Grace over
        NVLink-C2C on GB200 trays, x86 over PCIe on HGX hosts), the GPU–CPU link, and how many GPUs share that
        CPU's memory; None when the GPU has no CPU link. (A KV offload tier reads this.)"""
        g = self._check_gpu(i)
        for x, d in self._g[g].items():
            if self._kind[x] == "cpu" and d["link"].kind in ("c2c", "pcie"):
                n = sum(1 for y in self._g[x] if self._kind[y] == "gpu")
                return self._spec[x], d["link"], max(n, 1)
        return None

    def host_of(self, i: int) -> int:
        self._check_gpu(i)
        return self._host[i]

    def gpus_of_host(self, h: int) -> list[int]:
        if h not in self._gpus_of_host:
            raise UserError(f"{self.name}: no host {h!r} with GPUs (hosts: {self.hosts[0]}..{self.hosts[-1]})")
        return list(self._gpus_of_host[h])

    def same_host(self, a: int, b: int) -> bool:
        return self.host_of(a) == self.host_of(b)

    def nvlink_domain(self, i: int) -> frozenset[int]:
        """GPUs reachable from GPU ``i`` over NVLink (including ``i``)."""
        self._check_gpu(i)
        return self._domain[i]

    def nvlink_domains(self) -> list[frozenset[int]]:
        """All NVLink domains, ordered by their lowest GPU."""
        seen, out = set(), []
        for d in self._domain:
            if min(d) not in seen:
                seen.add(min(d))
                out.append(d)
        return out

    def nics_of_gpu(self, i: int) -> list[str]:
        self._check_gpu(i)
        return list(self._nics[i])

    def nic_of_gpu(self, i: int) -> str:
        """The first (lowest-id) NIC attached to GPU ``i``."""
        nics = self.nics_of_gpu(i)
        if not nics:
            raise UserError(f"{self.name}: GPU {i} has no NIC")
        return nics[0]

    def nic_spec(self, nic_id: str) -> NicSpec:
        if self._kind.get(nic_id) != "nic":
            raise UserError(f"{self.name}: {nic_id!r} is not a NIC")
        return self._spec[nic_id]

    # ------------------------------------------------------------------------------------------- routing
    def _node_latency_us(self, nid: str) -> float:
        k = self._kind[nid]
        return self._spec[nid].latency_us if k in ("nvsw", "ibsw", "nic") else 0.0

    def _allowed(self, via: str, a: int, b: int) -> tuple[set[str], set[str]]:
        """(transit-or-endpoint nodes, link kinds) usable for ``via`` between GPUs a and b."""
        fixed, kinds = self._via_fixed(via)
        return self._allowed_ends(via, a, b) | fixed, set(kinds)

    def _via_fixed(self, via: str) -> tuple[frozenset[str], frozenset[str]]:
        """(transit nodes every pair may use, link kinds) of route kind ``via``: NVSwitches and NVLink, IB
        switches and the scale-out links, or no shared transit node and the host links."""
        if via == "nvlink":
            return frozenset(x for x, k in self._kind.items() if k == "nvsw"), frozenset({"nvlink"})
        if via == "net":
            return (frozenset(x for x, k in self._kind.items() if k == "ibsw"),
                    frozenset({"pcie", "ib", "efa", "ethernet"}))
        return frozenset(), frozenset({"pcie", "c2c"})

    def _allowed_ends(self, via: str, a: int, b: int) -> set[str]:
        """The nodes :meth:`_allowed` adds for the pair: the two GPUs, their NICs (net) or the CPUs both hang
        off (host)."""
        nodes = {f"gpu:{a}", f"gpu:{b}"}
        if via == "net":
            nodes.update(self._nics[a], self._nics[b])
        elif via == "host":
            cpus = {x for x in self._g.neighbors(f"gpu:{a}") if self._kind[x] == "cpu"}
            cpus &= {x for x in self._g.neighbors(f"gpu:{b}") if self._kind[x] == "cpu"}
            nodes |= cpus
        return nodes

    def _route(self, a: int, b: int, via: str | None) -> tuple[str, list[Hop]]:
        self._check_gpu(a)
        self._check_gpu(b)
        if via is not None and via not in VIAS:
            raise UserError(f"unknown route kind {via!r} (known: {', '.join(VIAS)})")
        if a == b:
            raise UserError(f"{self.name}: path from GPU {a} to itself")
        key = (a, b, via or "")
        hit = self._path_cache.get(key)
        if hit is not None:
            return hit
        if via is None:
            order = ["nvlink"] if b in self._domain[a] else []
            order += ["net", "host"]
        else:
            order = [via]
        result = None
        for v in order:
            hops = self._shortest(v, a, b)
            if hops is not None:
                result = (v, hops)
                break
        if result is None:
            how = f" via {via}" if via else ""
            raise UserError(f"{self.name}: no path{how} between GPU {a} and GPU {b}")
        self._path_cache[key] = result
        return result

    def _shortest(self, via: str, a: int, b: int) -> list[Hop] | None:
        if via == "nvlink" and not self._nvsw_mesh:
            return self._one_tier_nvlink_path(a, b)
        return self._dijkstra(via, a, b)

    def _one_tier_nvlink_path(self, a: int, b: int) -> list[Hop] | None:
        """Lowest-latency NVLink path when NVSwitches are not linked to each other: the direct edge or one
        switch both GPUs reach (ties: direct first, then the lowest switch id)."""
        ga, gb = f"gpu:{a}", f"gpu:{b}"
        la, lb = self._nvlinks[a], self._nvlinks[b]
        if gb in la:
            best_key, best_via = (la[gb].latency_us, -1), None
        else:
            best_key, best_via = None, None
        for x, l1 in la.items():
            l2 = lb.get(x)
            if l2 is not None and self._kind[x] == "nvsw":
                key = (l1.latency_us + self._spec[x].latency_us + l2.latency_us, self._index[x])
                if best_key is None or key < best_key:
                    best_key, best_via = key, x
        if best_key is None:
            return None
        if best_via is None:
            return [Hop(ga, gb, la[gb])]
        return [Hop(ga, best_via, la[best_via]), Hop(best_via, gb, lb[best_via])]

    def _dijkstra(self, via: str, a: int, b: int) -> list[Hop] | None:
        """Lowest-latency path over the nodes and link kinds ``via`` allows (:meth:`_allowed`), the path
        ``nx.bidirectional_dijkstra`` returns with weight ``link latency + half of each end's node latency``:
        :func:`_bidirectional` runs that search step for step on :meth:`_via_adjacency` (the graph's adjacency
        order, the same weights, computed once per route kind) instead of calling a weight function per edge."""
        adj, fixed = self._via_adjacency(via)
        ends = self._allowed_ends(via, a, b)
        seq = _bidirectional(adj, fixed, ends, f"gpu:{a}", f"gpu:{b}")
        if seq is None:
            return None
        return [Hop(u, v, self._g[u][v]["link"]) for u, v in itertools.pairwise(seq)]

    def _via_adjacency(self, via: str):
        """``(adjacency, fixed)`` of route kind ``via``: per node, ``(neighbour, weight)`` over the links of the
        kinds ``via`` may use, in the graph's adjacency order; ``fixed``: the transit nodes every pair may use
        (NVSwitches for nvlink, IB switches for net, none for host)."""
        hit = self._via_cache.get(via)
        if hit is None:
            fixed, kinds = self._via_fixed(via)
            lat = self._node_latency_us
            adj = {u: [(v, d["link"].latency_us + 0.5 * (lat(u) + lat(v))) for v, d in nbrs.items()
                       if d["link"].kind in kinds]
                   for u, nbrs in self._g.adj.items()}
            hit = self._via_cache[via] = (adj, fixed)
        return hit

    def path(self, a: int, b: int, via: str | None = None) -> list[Hop]:
        """Lowest-latency path GPU ``a`` → GPU ``b`` as hops. ``via``: "nvlink", "net" (scale-out network, e.g.
        for KV transfer over InfiniBand even inside an NVLink domain), "host" (shared CPU), or None (NVLink
        within a domain, else the network, else the host)."""
        return list(self._route(a, b, via)[1])

    def route_kind(self, a: int, b: int, via: str | None = None) -> str:
        """Which of "nvlink" / "net" / "host" :meth:`path` uses for this pair."""
        return self._route(a, b, via)[0]

    def p2p_latency_us(self, a: int, b: int, via: str | None = None) -> float:
        """One-way latency (µs): link latencies plus transit switch and NIC latencies along :meth:`path`."""
        hops = self._route(a, b, via)[1]
        return sum(h.link.latency_us for h in hops) + sum(self._node_latency_us(h.dst) for h in hops[:-1])

    def p2p_GBps(self, a: int, b: int, via: str | None = None) -> float:
        """Bottleneck bandwidth a → b, GB/s per direction (line rate): the max flow over the links the route
        kind may use (parallel NVLink switches add up; NICs are capped at their line rate)."""
        kind = self._route(a, b, via)[0]
        key = (a, b, kind)
        hit = self._bw_cache.get(key)
        if hit is not None:
            return hit
        if kind == "nvlink" and not self._nvsw_mesh:
            bw = self._one_tier_nvlink_GBps(a, b)
        else:
            bw = self.max_flow_GBps(a, b, kind)
        self._bw_cache[key] = self._bw_cache[(b, a, kind)] = bw
        return bw

    def _one_tier_nvlink_GBps(self, a: int, b: int) -> float:
        """Max flow when NVSwitches are not linked to each other: the direct links plus, for every switch both
        GPUs reach, the smaller of their two link bundles."""
        ca, cb = self._nvcap[a], self._nvcap[b]
        bw = ca.get(f"gpu:{b}", 0.0)
        for x, cap in ca.items():
            if self._kind[x] == "nvsw" and x in cb:
                bw += min(cap, cb[x])
        return bw

    def max_flow_GBps(self, a: int, b: int, via: str) -> float:
        """General max flow a → b over the nodes and link kinds ``via`` allows (see module docstring)."""
        nodes, kinds = self._allowed(via, a, b)
        d = nx.DiGraph()
        for n in nodes:
            if self._kind[n] == "nic":
                d.add_edge((n, "in"), (n, "out"), capacity=self._spec[n].GBps)
            else:
                d.add_edge((n, "in"), (n, "out"))  # no capacity attribute = unbounded
        for u, v, data in self._g.edges(data=True):
            link = data["link"]
            if u in nodes and v in nodes and link.kind in kinds:
                d.add_edge((u, "out"), (v, "in"), capacity=link.GBps_per_dir)
                d.add_edge((v, "out"), (u, "in"), capacity=link.GBps_per_dir)
        value = nx.maximum_flow_value(d, (f"gpu:{a}", "out"), (f"gpu:{b}", "in"))
        return float(value)

    def reducing_switches(self, gpus) -> list[str]:
        """Switch ids that can reduce (SHARP / NVLS) for the GPU group ``gpus``; [] if none.

        NVSwitches come first: the SHARP-capable NVSwitch ASICs linked to every GPU of the group (the group
        must sit in one NVLink domain). Otherwise scale-out switches: SHARP-capable ones linked to a NIC of every
        GPU, or failing that the SHARP-capable ones linked to every fabric switch that serves the group's NICs
        (the spine level of a two-level tree).
        """
        group = sorted(set(gpus))
        if len(group) < 2:
            return []
        for i in group:
            self._check_gpu(i)
        g = self._g
        common: set[str] | None = None
        for i in group:
            sw = {x for x, d in g[f"gpu:{i}"].items() if self._kind[x] == "nvsw" and d["link"].kind == "nvlink"
                  and self._spec[x].sharp}
            common = sw if common is None else common & sw
        if common:
            return self.sort_ids(common)
        leaves_per_gpu = []
        for i in group:
            leaves = {x for nic in self._nics[i] for x in g.neighbors(nic) if self._kind[x] == "ibsw"}
            if not leaves:
                return []
            leaves_per_gpu.append(leaves)
        common = set.intersection(*leaves_per_gpu)
        sharp = {x for x in common if self._spec[x].sharp}
        if common:
            return self.sort_ids(sharp)
        used = set.union(*leaves_per_gpu)
        spines = None
        for leaf in used:
            up = {x for x in g.neighbors(leaf) if self._kind[x] == "ibsw"}
            spines = up if spines is None else spines & up
        return self.sort_ids(x for x in (spines or ()) if self._spec[x].sharp)

    @staticmethod
    def sort_ids(ids) -> list[str]:
        order = list(NODE_KINDS)
        return sorted(ids, key=lambda x: (order.index(parse_id(x)[0]), parse_id(x)[1]))

    # ------------------------------------------------------------------------------------------- summary / io
    def counts(self) -> dict[str, int]:
        """Node counts by kind (every kind present as a key)."""
        c = Counter(self._kind.values())
        return {k: c.get(k, 0) for k in NODE_KINDS}

    def summary(self) -> dict:
        """A JSON-able summary: counts by kind, GPU models, NVLink domains, SHARP switches, NICs and
        representative P2P bandwidth / latency inside an NVLink domain and across domains."""
        gpu_models: dict[str, dict] = {}
        for i in range(self._n_gpus):
            s = self.gpu_spec(i)
            m = gpu_models.setdefault(s.name, {
                "count": 0, "arch": s.arch, "sm_count": s.sm_count, "hbm_GB": s.hbm_bytes / 1e9,
                "hbm_TBps": s.hbm_GBps / 1e3, "bf16_tflops": s.dense_tflops.bf16,
                "fp8_tflops": s.dense_tflops.fp8, "mxfp8_tflops": s.dense_tflops.mxfp8,
                "nvfp4_tflops": s.dense_tflops.nvfp4, "nvlink_GBps_per_dir": s.nvlink_GBps_per_dir})
            m["count"] += 1
        domains = self.nvlink_domains()
        sizes = Counter(len(d) for d in domains)
        sharp = Counter(self._kind[x] for x in self._kind
                        if self._kind[x] in ("nvsw", "ibsw") and self._spec[x].sharp)
        nic_models = Counter(self._spec[x].name for x, k in self._kind.items() if k == "nic")
        nics = {name: {"count": c} for name, c in sorted(nic_models.items())}
        for x, k in self._kind.items():
            if k == "nic":
                s = self._spec[x]
                nics[s.name].update(kind=s.kind, line_rate_Gbps=s.line_rate_Gbps,
                                    gpu_initiated_rdma=s.gpu_initiated_rdma)
        out = {
            "name": self.name,
            "counts": self.counts(),
            "hosts": len(self._gpus_of_host),
            "gpu_models": gpu_models,
            "nvlink_domains": {str(k): v for k, v in sorted(sizes.items())},
            "sharp_switches": {"nvsw": sharp.get("nvsw", 0), "ibsw": sharp.get("ibsw", 0)},
            "nics": nics,
            "cpus": dict(sorted(Counter(self._spec[x].name for x, k in self._kind.items() if k == "cpu").items())),
            "switches": dict(sorted(Counter(self._spec[x].name for x, k in self._kind.items()
                                            if k in ("nvsw", "ibsw")).items())),
            "p2p": {},
        }
        dom0 = self._domain[0]
        if len(dom0) > 1:
            far = max(dom0)
            out["p2p"]["intra_domain"] = self._pair_summary(0, far)
        others = [i for i in range(self._n_gpus) if i not in dom0]
        if others:
            try:
                out["p2p"]["cross_domain"] = self._pair_summary(0, others[0])
            except UserError:
                out["p2p"]["cross_domain"] = None
        return out

    def _pair_summary(self, a: int, b: int) -> dict:
        return {"gpus": [a, b], "via": self.route_kind(a, b), "GBps_per_dir": self.p2p_GBps(a, b),
                "latency_us": round(self.p2p_latency_us(a, b), 6), "hops": len(self.path(a, b))}

    def to_dict(self) -> dict:
        """The file form (see ``topology.io``); ``topology.io.from_dict(t.to_dict()) == t``."""
        from rackbed.topology.io import to_dict

        return to_dict(self)

    def structure(self) -> tuple:
        """Everything that defines the topology, in canonical order (used for equality; computed once)."""
        if self._structure is None:
            self._structure = self._compute_structure()
        return self._structure

    def _compute_structure(self) -> tuple:
        nodes = tuple((n, self._kind[n], self._spec[n], self._g.nodes[n]["host"]) for n in self.nodes())
        edges = tuple(sorted(((min(u, v, key=_key), max(u, v, key=_key)), d["link"].model_dump_json())
                             for u, v, d in self._g.edges(data=True)))
        return self.name, nodes, edges

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Topology):
            return NotImplemented
        return self is other or self.structure() == other.structure()

    def __hash__(self) -> int:
        # consistent with structural equality (equal topologies have equal names and counts)
        return hash((self.name, tuple(self.counts().items())))

    def __repr__(self) -> str:
        c = self.counts()
        return (f"Topology({self.name!r}: {c['gpu']} GPUs, {c['nvsw']} NVSwitch, {c['cpu']} CPUs, "
                f"{c['nic']} NICs, {c['ibsw']} fabric switches)")


def _key(nid: str) -> tuple[int, int]:
    kind, idx = parse_id(nid)
    return list(NODE_KINDS).index(kind), idx


def _bidirectional(adj: dict, fixed: frozenset[str], ends: set[str], source: str, target: str) -> list[str] | None:
    """``nx.bidirectional_dijkstra``'s search (networkx 3.x: alternating directions, heap entries
    ``(distance, insertion count, node)``, a relaxation only when strictly shorter, the meeting node of the
    shortest joined distance) over ``adj`` (``node -> [(neighbour, weight)]``, symmetric weights) and the nodes in
    ``fixed`` or ``ends``; the node sequence source → target, or None when there is no path. A node outside both
    sets is skipped where networkx's weight function would return None: the same pushes in the same order, so
    the same path, ties included."""
    from heapq import heappop, heappush

    dists: tuple[dict, dict] = ({}, {})
    preds: tuple[dict, dict] = ({source: None}, {target: None})
    seen: tuple[dict, dict] = ({source: 0}, {target: 0})
    fringe: tuple[list, list] = ([(0, 0, source)], [(0, 1, target)])
    c = itertools.count(2)
    finaldist = meetnode = None
    direction = 1
    while fringe[0] and fringe[1]:
        direction = 1 - direction
        dist, _, v = heappop(fringe[direction])
        dd = dists[direction]
        if v in dd:
            continue
        dd[v] = dist
        if v in dists[1 - direction]:
            fwd: list[str] = []
            node = meetnode
            while node is not None:
                fwd.append(node)
                node = preds[0][node]
            fwd.reverse()
            node = preds[1][meetnode]
            while node is not None:
                fwd.append(node)
                node = preds[1][node]
            return fwd
        sd, so, pd, fr = seen[direction], seen[1 - direction], preds[direction], fringe[direction]
        for w, cost in adj[v]:
            if w not in fixed and w not in ends:
                continue
            vw = dist + cost
            if w in dd:
                continue
            if w not in sd or vw < sd[w]:
                sd[w] = vw
                heappush(fr, (vw, next(c), w))
                pd[w] = v
                if w in so:
                    fw = vw + so[w]
                    if finaldist is None or finaldist > fw:
                        finaldist, meetnode = fw, w
    return None
