"""``Topology._dijkstra`` (``topology.graph._bidirectional`` over a per-route-kind adjacency) returns exactly the
path ``nx.bidirectional_dijkstra`` returns with the weight function it replaces, ties included, for every route
kind on multi-rack and multi-host presets: routes (and so KV latencies in the simulator) are unchanged."""

from __future__ import annotations

import itertools

import networkx as nx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rackbed.topology import load

_TOPOS: dict[str, object] = {}


def _topo(name: str):
    if name not in _TOPOS:
        _TOPOS[name] = load(name)
    return _TOPOS[name]


def _reference(t, via: str, a: int, b: int):
    """The search as it was: networkx with a weight function that drops nodes and link kinds ``via`` excludes."""
    nodes, kinds = t._allowed(via, a, b)
    lat = t._node_latency_us

    def weight(u, v, d):
        if u not in nodes or v not in nodes or d["link"].kind not in kinds:
            return None
        return d["link"].latency_us + 0.5 * (lat(u) + lat(v))

    try:
        _, seq = nx.bidirectional_dijkstra(t.graph, f"gpu:{a}", f"gpu:{b}", weight=weight)
    except nx.NetworkXNoPath:
        return None
    return [(u, v) for u, v in itertools.pairwise(seq)]


NAMES = ["gb200-nvl72*3", "hgx-h200*4", "hgx-h200-efa*2", "gb300-nvl72*2", "h200x2"]


@settings(max_examples=120, deadline=None)
@given(name=st.sampled_from(NAMES), via=st.sampled_from(["net", "nvlink", "host"]), data=st.data())
def test_route_search_is_networkx_bidirectional_dijkstra(name, via, data):
    t = _topo(name)
    gpus = sorted(t.gpu_ids)
    a = data.draw(st.sampled_from(gpus))
    b = data.draw(st.sampled_from([g for g in gpus if g != a]))
    ref = _reference(t, via, a, b)
    got = t._dijkstra(via, a, b)
    assert (None if got is None else [(h.src, h.dst) for h in got]) == ref


@pytest.mark.parametrize("name", ["gb200-nvl72*2", "hgx-h200*2"])
def test_every_net_route_from_one_gpu(name):
    """All destinations of GPU 0 and of the last GPU over the scale-out network, and their latencies."""
    t = _topo(name)
    gpus = sorted(t.gpu_ids)
    for a in (gpus[0], gpus[-1]):
        for b in gpus:
            if b != a:
                hops = t._dijkstra("net", a, b)
                assert [(h.src, h.dst) for h in hops] == _reference(t, "net", a, b)
