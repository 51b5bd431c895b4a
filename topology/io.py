"""Loading and dumping topologies (YAML or JSON files, preset names).

A topology file takes one of two forms.

*Cluster form* — a :class:`~topology.specs.ClusterSpec` under the key ``cluster``; parts may be given inline or
by catalogue name (``gpu: H200-SXM``, ``nvlink: nvlink4``; see ``topology.specs``)::

    cluster:
      name: my-box
      rack: {name: box, n_nodes: 2, node: {name: n, gpu: H200-SXM, n_gpus: 2, nvlink: nvlink4-direct,
             direct_links: 18, nic: CX-7, nics_per_gpu: 1, nic_link: pcie5-x16}}
      fabric: {switch: Quantum-2-QM9700, link: ib-ndr}

*Graph form* — what :func:`dump` writes, and what round-trips: named specs, then nodes and links::

    name: h200x2
    specs:                       # sections gpu / cpu / nic / switch / link: name -> spec fields
      link: {nv18: {kind: nvlink, GBps_per_dir: 450.0, latency_us: 0.6, n_links: 18}}
    nodes:                       # id <kind>:<int>; spec names a specs entry or a catalogue part
      - {id: "gpu:0", spec: H200-SXM, host: 0}
      - {id: "gpu:1", spec: H200-SXM, host: 0}
    links:
      - {a: "gpu:0", b: "gpu:1", spec: nv18}

Every mistake raises one ``UserError`` line: ``<file>: <field path>: <rule>`` — unknown keys, negative or zero
bandwidths, unknown spec names, links to missing nodes, duplicate nodes or links, GPUs with no links.
"""

from __future__ import annotations

import json
from pathlib import Path

import networkx as nx
import yaml
from pydantic import Field, ValidationError

from rackbed.topology.errors import UserError, from_validation
from rackbed.topology.graph import NODE_KINDS, Topology, parse_id
from rackbed.topology.specs import (
    CATALOGUES,
    ClusterSpec,
    CpuSpec,
    GpuSpec,
    LinkSpec,
    NicSpec,
    NonNegInt,
    SwitchSpec,
    _Spec,
)

_SECTION = {"gpu": "gpu", "cpu": "cpu", "nic": "nic", "nvsw": "switch", "ibsw": "switch"}
_SECTION_TYPE = {"gpu": GpuSpec, "cpu": CpuSpec, "nic": NicSpec, "switch": SwitchSpec, "link": LinkSpec}


class SpecLibrary(_Spec):
    """Named specs a graph file defines; names shadow catalogue parts of the same name."""

    gpu: dict[str, GpuSpec] = Field(default_factory=dict)
    cpu: dict[str, CpuSpec] = Field(default_factory=dict)
    nic: dict[str, NicSpec] = Field(default_factory=dict)
    switch: dict[str, SwitchSpec] = Field(default_factory=dict)
    link: dict[str, LinkSpec] = Field(default_factory=dict)


class NodeEntry(_Spec):
    id: str
    spec: str
    host: NonNegInt | None = None


class LinkEntry(_Spec):
    a: str
    b: str
    spec: str


class GraphFile(_Spec):
    """The graph form of a topology file."""

    name: str
    specs: SpecLibrary = Field(default_factory=SpecLibrary)
    nodes: list[NodeEntry]
    links: list[LinkEntry]


class ClusterFile(_Spec):
    """The cluster form of a topology file."""

    cluster: ClusterSpec


# ----------------------------------------------------------------------------------------------- loading


def load(spec: str | Path) -> Topology:
    """A preset name (``hgx-h200``, ``gb200-nvl72*2``, ...) or a ``.yaml`` / ``.yml`` / ``.json`` file path."""
    from rackbed.topology.presets import preset

    path = Path(spec)
    if isinstance(spec, Path) or path.suffix.lower() in (".yaml", ".yml", ".json") or path.exists():
        return load_file(path)
    return preset(str(spec))


def load_file(path: str | Path) -> Topology:
    from rackbed.topology.yamlio import load_data

    path = Path(path)
    if not path.exists():
        raise UserError(f"{path}: no such topology file")
    data = load_data(path, "topology file")
    return from_dict(data, source=path)


def from_dict(data, source: str | Path | None = None) -> Topology:
    """Build a Topology from the parsed file contents (either form)."""
    prefix = f"{source}: " if source else ""
    if not isinstance(data, dict):
        raise UserError(f"{prefix}<root>: a topology file must be a mapping (got {type(data).__name__})")
    if "cluster" in data:
        try:
            cf = ClusterFile.model_validate(data)
        except ValidationError as exc:
            raise from_validation(exc, source) from None
        from rackbed.topology.presets import build

        try:
            return build(cf.cluster)
        except UserError as exc:
            raise UserError(f"{prefix}cluster: {exc}") from None
    try:
        gf = GraphFile.model_validate(data)
    except ValidationError as exc:
        raise from_validation(exc, source) from None
    return _build_graph(gf, prefix)


def _lookup(lib: SpecLibrary, section: str, name: str):
    own = getattr(lib, section)
    if name in own:
        return own[name]
    catalogue = CATALOGUES[_SECTION_TYPE[section]]
    if name in catalogue:
        return catalogue[name]
    known = sorted(set(own) | set(catalogue))
    raise UserError(f"unknown {section} spec {name!r} (known: {', '.join(known)})")


def _build_graph(gf: GraphFile, prefix: str) -> Topology:
    g = nx.Graph()
    index: dict[str, int] = {}
    for i, entry in enumerate(gf.nodes):
        where = f"{prefix}nodes[{i}]"
        try:
            kind, _ = parse_id(entry.id)
        except UserError as exc:
            raise UserError(f"{where}.id: {exc}") from None
        if entry.id in index:
            raise UserError(f"{where}.id: duplicate node id {entry.id!r} (first at nodes[{index[entry.id]}])")
        try:
            spec = _lookup(gf.specs, _SECTION[kind], entry.spec)
        except UserError as exc:
            raise UserError(f"{where}.spec: {exc}") from None
        if kind in ("gpu", "cpu", "nic") and entry.host is None:
            raise UserError(f"{where}.host: required for a {kind} node")
        if kind in ("nvsw", "ibsw") and entry.host is not None:
            raise UserError(f"{where}.host: a switch has no host")
        index[entry.id] = i
        g.add_node(entry.id, kind=kind, spec=spec, host=entry.host)
    pair_index: dict[frozenset, int] = {}
    for j, entry in enumerate(gf.links):
        where = f"{prefix}links[{j}]"
        for end in ("a", "b"):
            nid = getattr(entry, end)
            if nid not in index:
                raise UserError(f"{where}.{end}: no node {nid!r} (links must join nodes listed under nodes)")
        if entry.a == entry.b:
            raise UserError(f"{where}: a link cannot join {entry.a} to itself")
        pair = frozenset((entry.a, entry.b))
        if pair in pair_index:
            raise UserError(f"{where}: duplicate link {entry.a}–{entry.b} (first at links[{pair_index[pair]}]; "
                            f"bundle parallel links with n_links)")
        try:
            link = _lookup(gf.specs, "link", entry.spec)
        except UserError as exc:
            raise UserError(f"{where}.spec: {exc}") from None
        pair_index[pair] = j
        g.add_edge(entry.a, entry.b, link=link)

    def locate(nid: str) -> str:
        return f"{prefix}nodes[{index[nid]}] ({nid})"

    def locate_edge(u: str, v: str) -> str:
        return f"{prefix}links[{pair_index[frozenset((u, v))]}] ({u}–{v})"

    try:
        return Topology(g, gf.name, locate=locate, locate_edge=locate_edge)
    except UserError as exc:
        msg = str(exc)
        raise UserError(msg if msg.startswith(prefix) else f"{prefix}{msg}") from None


# ----------------------------------------------------------------------------------------------- dumping


def _names_for(specs: list, base) -> dict:
    """Give each distinct spec a file-unique name: its own ``name`` (or ``base(spec)``), suffixed on clashes."""
    names: dict = {}
    taken: set[str] = set()
    for s in specs:
        if s in names:
            continue
        stem = base(s)
        name, k = stem, 2
        while name in taken:
            name, k = f"{stem}-{k}", k + 1
        taken.add(name)
        names[s] = name
    return names


def _link_stem(s: LinkSpec) -> str:
    stem = f"{s.kind}-{s.GBps_per_dir:g}GBps-{s.latency_us:g}us"
    return stem + (f"-x{s.n_links}" if s.n_links > 1 else "")


def to_dict(t: Topology) -> dict:
    """The graph form of ``t`` (plain dicts, lists, str, int, float, bool, None)."""
    node_ids = t.nodes()
    by_section: dict[str, list] = {s: [] for s in _SECTION_TYPE}
    for nid in node_ids:
        by_section[_SECTION[t.kind(nid)]].append(t.spec(nid))
    edges = sorted(((min(u, v, key=_key), max(u, v, key=_key), link) for u, v, link in t.links()),
                   key=lambda e: (_key(e[0]), _key(e[1])))
    by_section["link"] = [e[2] for e in edges]
    names = {sec: _names_for(specs, _link_stem if sec == "link" else (lambda s, sec=sec: s.name or sec))
             for sec, specs in by_section.items()}
    specs_out = {sec: {name: s.model_dump(mode="json") for s, name in names[sec].items()}
                 for sec in _SECTION_TYPE if names[sec]}
    nodes_out = []
    for nid in node_ids:
        entry = {"id": nid, "spec": names[_SECTION[t.kind(nid)]][t.spec(nid)]}
        host = t.host_of_node(nid)
        if host is not None:
            entry["host"] = host
        nodes_out.append(entry)
    links_out = [{"a": a, "b": b, "spec": names["link"][link]} for a, b, link in edges]
    return {"name": t.name, "specs": specs_out, "nodes": nodes_out, "links": links_out}


def _key(nid: str) -> tuple[int, int]:
    kind, idx = parse_id(nid)
    return list(NODE_KINDS).index(kind), idx


def dumps(t: Topology, fmt: str = "yaml") -> str:
    """``t`` as YAML (``fmt="yaml"``) or JSON (``fmt="json"``) text in the graph form."""
    data = to_dict(t)
    if fmt == "json":
        return json.dumps(data, indent=1) + "\n"
    if fmt != "yaml":
        raise UserError(f"unknown dump format {fmt!r} (known: yaml, json)")
    dumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)
    return yaml.dump(data, Dumper=dumper, sort_keys=False, default_flow_style=None, width=200)


def dump(t: Topology, path: str | Path | None = None, fmt: str | None = None) -> str:
    """Serialise ``t``; with ``path`` also write it (format from the suffix unless ``fmt`` is given)."""
    if fmt is None:
        fmt = "json" if path is not None and Path(path).suffix.lower() == ".json" else "yaml"
    text = dumps(t, fmt)
    if path is not None:
        from rackbed.topology.outputs import write_text

        write_text(path, text)
    return text
