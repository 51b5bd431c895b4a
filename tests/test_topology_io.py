"""rackbed.topology.io: YAML/JSON round trips (property-tested) and one-line errors naming field path and rule."""

from __future__ import annotations

import json
import pickle
from pathlib import Path

import networkx as nx
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rackbed import topology
from rackbed.topology import UserError, dumps, from_dict, load, load_file
from rackbed.topology.graph import Topology
from rackbed.topology.specs import (
    CX7_IB,
    GRACE,
    H200_SXM,
    NVSWITCH3,
    QUANTUM2,
    XEON_8480C,
    LinkSpec,
)

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((ROOT / "scenarios" / "topologies").glob("*.yaml"))

# ------------------------------------------------------------------------------------------------ round trip

floats = st.floats(min_value=1e-3, max_value=1e4, allow_nan=False, allow_infinity=False)


def links_of(kind: str):
    return st.builds(LinkSpec, kind=st.just(kind), GBps_per_dir=floats, latency_us=st.floats(0, 10),
                     n_links=st.integers(1, 3))


@st.composite
def graphs(draw) -> Topology:
    """Random small valid graphs: GPU variants that share a name (dump must rename them), random link specs,
    random hosts, every node kind."""
    n_gpu = draw(st.integers(1, 5))
    n_nvsw, n_cpu, n_nic, n_ibsw = (draw(st.integers(0, k)) for k in (2, 2, 3, 2))
    g = nx.Graph()
    host = st.integers(0, 3)
    for i in range(n_gpu):
        spec = H200_SXM
        if draw(st.booleans()):  # same name, different numbers
            spec = H200_SXM.model_copy(update={"sm_count": draw(st.integers(1, 200))})
        g.add_node(f"gpu:{i}", kind="gpu", spec=spec, host=draw(host))
    for j in range(n_nvsw):
        g.add_node(f"nvsw:{j}", kind="nvsw", spec=NVSWITCH3, host=None)
    for j in range(n_cpu):
        g.add_node(f"cpu:{j}", kind="cpu", spec=draw(st.sampled_from([GRACE, XEON_8480C])), host=draw(host))
    for j in range(n_nic):
        g.add_node(f"nic:{j}", kind="nic", spec=CX7_IB, host=draw(host))
    for j in range(n_ibsw):
        g.add_node(f"ibsw:{j}", kind="ibsw", spec=QUANTUM2, host=None)
    nv_ends = [f"gpu:{i}" for i in range(n_gpu)] + [f"nvsw:{j}" for j in range(n_nvsw)]
    for u, v in draw(st.lists(st.tuples(st.sampled_from(nv_ends), st.sampled_from(nv_ends)), max_size=6)):
        if u != v and not (u.startswith("nvsw") and v.startswith("nvsw")):
            g.add_edge(u, v, link=draw(links_of("nvlink")))
    for j in range(n_nic):
        g.add_edge(f"nic:{j}", f"gpu:{draw(st.integers(0, n_gpu - 1))}", link=draw(links_of("pcie")))
        if n_ibsw:
            g.add_edge(f"nic:{j}", f"ibsw:{draw(st.integers(0, n_ibsw - 1))}", link=draw(links_of("ib")))
    for i in range(n_gpu):
        if g.degree(f"gpu:{i}") == 0 or (n_cpu and draw(st.booleans())):
            if not n_cpu:
                g.add_node("cpu:0", kind="cpu", spec=GRACE, host=0)
                n_cpu = 1
            g.add_edge(f"gpu:{i}", f"cpu:{draw(st.integers(0, n_cpu - 1))}", link=draw(links_of("c2c")))
    name = draw(st.sampled_from(["g", "yes", "~", "null", "0x1F", "1:30", "- x", "é ü", "a: b"]))
    return Topology(g, name)


@pytest.mark.slow
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(graphs(), st.sampled_from(["yaml", "json"]))
def test_round_trip(t, fmt):
    text = dumps(t, fmt)
    data = json.loads(text) if fmt == "json" else yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    back = from_dict(data)
    assert back == t
    assert dumps(back, fmt) == text  # dumping is deterministic and canonical


@pytest.mark.parametrize("name", ["hgx-h200", "hgx-h200-efa*2", "hgx-b200", "h200x2", "gb200-nvl72", "gb300-nvl72",
                                  "hgx-b300", "hgx-h100", "hgx-h800*2"])
def test_presets_round_trip_through_files(name, tmp_path):
    t = load(name)
    for suffix in (".json", ".yaml") if not name.endswith("-nvl72") else (".json",):
        path = tmp_path / f"t{suffix}"
        topology.dump(t, path)
        assert load(str(path)) == t


def test_equality_is_structural():
    a, b = load("hgx-h200"), load("hgx-h200")
    assert a == b and a is not b and hash(a) == hash(b)
    assert pickle.loads(pickle.dumps(a)) == a  # sweeps ship topologies to worker processes
    assert load("hgx-h200") != load("hgx-h200-efa")
    g = nx.Graph(a.graph)
    g.edges["gpu:0", "nvsw:0"]["link"] = g.edges["gpu:0", "nvsw:0"]["link"].model_copy(update={"latency_us": 9.0})
    assert Topology(g, a.name) != a


@pytest.mark.parametrize("path", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_example_files_load(path):
    t = load_file(path)
    assert t.n_gpus >= 2


def test_lab_file_equals_preset():
    assert load_file(ROOT / "scenarios/topologies/h200x2-lab.yaml") == load("h200x2")


def test_pair_file_is_two_boxes():
    t = load_file(ROOT / "scenarios/topologies/h200x2-pair-ib.yaml")
    assert t.n_gpus == 4 and t.hosts == [0, 1] and t.nvlink_domain(2) == frozenset({2, 3})
    assert t.route_kind(1, 2) == "net" and t.p2p_GBps(1, 2) == pytest.approx(50.0)
    assert t.p2p_GBps(0, 1) == pytest.approx(450.0)


# ------------------------------------------------------------------------------------------------ errors

GOOD = {
    "name": "box",
    "specs": {"link": {"nv": {"kind": "nvlink", "GBps_per_dir": 450.0, "latency_us": 0.6, "n_links": 18}}},
    "nodes": [{"id": "gpu:0", "spec": "H200-SXM", "host": 0}, {"id": "gpu:1", "spec": "H200-SXM", "host": 0}],
    "links": [{"a": "gpu:0", "b": "gpu:1", "spec": "nv"}],
}


def _edit(fn):
    data = json.loads(json.dumps(GOOD))
    fn(data)
    return data


BAD = {
    "unknown top-level key": (lambda d: d.update(colour="red"), "colour: unknown key"),
    "unknown nested key": (lambda d: d["nodes"][1].update(rack=3), "nodes[1].rack: unknown key"),
    "unknown spec field": (lambda d: d["specs"]["link"]["nv"].update(speed=1),
                           "specs.link.nv.speed: unknown key"),
    "negative bandwidth": (lambda d: d["specs"]["link"]["nv"].update(GBps_per_dir=-450),
                           "specs.link.nv.GBps_per_dir: Input should be greater than 0"),
    "negative latency": (lambda d: d["specs"]["link"]["nv"].update(latency_us=-1),
                         "specs.link.nv.latency_us: Input should be greater than or equal to 0"),
    "gpu with no links": (lambda d: d["nodes"].append({"id": "gpu:2", "spec": "H200-SXM", "host": 0}),
                          "nodes[2] (gpu:2): GPU gpu:2 has no links"),
    "link to missing node": (lambda d: d["links"].append({"a": "gpu:0", "b": "gpu:7", "spec": "nv"}),
                             "links[1].b: no node 'gpu:7'"),
    "unknown spec name": (lambda d: d["nodes"][0].update(spec="H100"), "nodes[0].spec: unknown gpu spec 'H100'"),
    "unknown link spec": (lambda d: d["links"][0].update(spec="nv19"), "links[0].spec: unknown link spec 'nv19'"),
    "duplicate node": (lambda d: d["nodes"].append({"id": "gpu:1", "spec": "H200-SXM", "host": 0}),
                       "nodes[2].id: duplicate node id 'gpu:1'"),
    "duplicate link": (lambda d: d["links"].append({"a": "gpu:1", "b": "gpu:0", "spec": "nv"}),
                       "links[1]: duplicate link gpu:1–gpu:0"),
    "self link": (lambda d: d["links"].append({"a": "gpu:1", "b": "gpu:1", "spec": "nv"}),
                  "links[1]: a link cannot join gpu:1 to itself"),
    "bad node id": (lambda d: d["nodes"].append({"id": "tpu:0", "spec": "H200-SXM", "host": 0}),
                    "nodes[2].id: bad node id 'tpu:0'"),
    "gpu ids not contiguous": (lambda d: d["nodes"][1].update(id="gpu:5") or d["links"][0].update(b="gpu:5"),
                               "nodes: GPU ids must be gpu:0..gpu:1 (contiguous); gpu:1 is missing"),
    "too many nvlinks": (lambda d: d["specs"]["link"]["nv"].update(n_links=19),
                         "nodes[0] (gpu:0): 19 NVLink links attached but H200-SXM has 18"),
    "wrong link kind": (lambda d: d["specs"]["link"]["nv"].update(kind="ib"),
                        "links[0] (gpu:0–gpu:1): a link of kind 'ib' cannot join gpu to gpu"),
    "missing host": (lambda d: d["nodes"][0].pop("host"), "nodes[0].host: required for a gpu node"),
    "negative host": (lambda d: d["nodes"][0].update(host=-1),
                      "nodes[0].host: Input should be greater than or equal to 0"),
    "missing field": (lambda d: d.pop("links"), "links: Field required"),
    "wrong type": (lambda d: d["nodes"][0].update(host="zero"), "nodes[0].host: Input should be a valid integer"),
}


@pytest.mark.parametrize("case", list(BAD))
@pytest.mark.parametrize("fmt", ["yaml", "json"])
def test_bad_file_errors(case, fmt, tmp_path):
    edit, expected = BAD[case]
    path = tmp_path / f"bad.{fmt}"
    data = _edit(edit)
    path.write_text(json.dumps(data) if fmt == "json" else yaml.safe_dump(data))
    with pytest.raises(UserError) as info:
        load_file(path)
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith(f"{path}: ")
    assert expected in msg


def test_good_base_is_good(tmp_path):
    path = tmp_path / "good.yaml"
    path.write_text(yaml.safe_dump(GOOD))
    t = load_file(path)
    assert t.name == "box" and t.p2p_GBps(0, 1) == 450.0 and t.counts()["cpu"] == 0
    assert t.path(0, 1)[0].link.n_links == 18


CLUSTER = {"cluster": {"name": "c", "n_racks": 2, "fabric": {"switch": "Quantum-2-QM9700", "link": "ib-ndr"},
                       "rack": {"name": "r", "n_nodes": 1,
                                "node": {"name": "n", "gpu": "H200-SXM", "n_gpus": 2, "nvlink": "nvlink4-direct",
                                         "direct_links": 18, "nic": "CX-7", "nics_per_gpu": 1,
                                         "nic_link": "pcie5-x16"}}}}


@pytest.mark.parametrize(
    "edit, expected",
    [
        (lambda c: c["rack"]["node"].update(n_gpus=0), "cluster.rack.node.n_gpus: Input should be greater than 0"),
        (lambda c: c["rack"]["node"].update(gpu="H100"), "cluster.rack.node.gpu: Value error, unknown spec 'H100'"),
        (lambda c: c["rack"]["node"].update(direct_links=19), "would use 19 NVLink links"),
        (lambda c: c["rack"]["node"].update(n_gpus=3), "would use 36 NVLink links"),
        (lambda c: c.update(fabric={"switch": {"kind": "ib", "ports": 2, "sharp": False, "reduce_GBps": 0,
                                               "latency_us": 0.1}, "link": "ib-ndr"}, n_racks=4),
         "cluster: c: 8 NICs exceed a two-level fat tree of 2-port"),
        (lambda c: c["rack"]["node"].update(nics_per_gpu=0), "fabric given but the nodes have no NICs"),
        (lambda c: c["fabric"].update(link={"kind": "ib", "GBps_per_dir": -1, "latency_us": 0}),
         "cluster.fabric.link.GBps_per_dir: Input should be greater than 0"),
    ],
)
def test_bad_cluster_files(edit, expected, tmp_path):
    data = json.loads(json.dumps(CLUSTER))
    edit(data["cluster"])
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(UserError) as info:
        load_file(path)
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith(f"{path}: ") and expected in msg


@pytest.mark.parametrize(
    "text, expected",
    [
        ("name: [unclosed\n", "invalid YAML at line"),
        ("- just\n- a list\n", "<root>: a topology file must be a mapping (got list)"),
        ("", "must be a mapping (got NoneType)"),
        ("name: x\nnodes: []\nlinks: []\n", "topology has no GPUs"),
    ],
)
def test_malformed_yaml(text, expected, tmp_path):
    path = tmp_path / "m.yaml"
    path.write_text(text)
    with pytest.raises(UserError) as info:
        load_file(path)
    assert expected in str(info.value) and "\n" not in str(info.value)


def test_malformed_json_and_missing_file(tmp_path):
    path = tmp_path / "m.json"
    path.write_text('{"name": "x",')
    with pytest.raises(UserError, match=r"m\.json: invalid JSON: .* at line 1"):
        load_file(path)
    with pytest.raises(UserError, match="no such topology file"):
        load(str(tmp_path / "absent.yaml"))
