"""Placement (``engine.core.deployment.place``): layouts that placed in order keep their GPUs; layouts the
in-order packing fragments (many racks) are placed widest group first; a layout that fits by a bin-packing
argument is never refused; a layout that does not fit is a one-line error naming the smallest change that
fits."""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rackbed import topology
from rackbed.engine.core.deployment import (
    AggregatedTemplate,
    DecoderTemplate,
    PrefillerTemplate,
    _pack,
    _Want,
    place,
    place_aggregated,
)
from rackbed.topology.errors import UserError


class Grid:
    """Just what :func:`place` needs of a topology: ``domains`` NVLink domains of ``hosts`` nodes of
    ``per_host`` GPUs each, one NIC per GPU."""

    def __init__(self, domains: int, hosts: int, per_host: int) -> None:
        self.per_host, self.per_dom = per_host, hosts * per_host
        self.gpu_ids = list(range(domains * self.per_dom))

    def host_of(self, i):
        return i // self.per_host

    def nic_of_gpu(self, i):
        return f"nic:{i}"

    def nic_spec(self, nic_id):
        class Nic:
            GBps = 50.0
        return Nic

    def nvlink_domain(self, i):
        d = i // self.per_dom
        return frozenset(range(d * self.per_dom, (d + 1) * self.per_dom))


def _place(topo, n_p, n_d, wp=4, wd=16, **kw):
    return place(topo, n_prefillers=n_p, n_decoders=n_d, kv_bytes_per_token=1,
                 prefiller=PrefillerTemplate(tp=wp, ep=wp), decoder=DecoderTemplate(ep=wd), **kw)


def _check(dep, topo):
    """Every group on its own GPUs, a prefiller in one node, a decoder in one NVLink domain."""
    seen = Counter(g for grp in (*dep.prefillers, *dep.decoders) for g in grp.gpus)
    assert all(n == 1 for n in seen.values())
    for p in dep.prefillers:
        assert len({topo.host_of(g) for g in p.gpus}) == 1 and p.host == topo.host_of(p.gpus[0])
    for d in dep.decoders:
        assert len({dep.gpu_domain[g] for g in d.gpus}) == 1
    assert not set(dep.spare_gpus) & set(seen)


def test_ten_racks_of_the_benchmark_layout_place_every_decoder():
    topo = topology.load("gb200-nvl72*10")
    dep = _place(topo, 60, 30)
    _check(dep, topo)
    assert len(dep.prefillers) == 60 and len(dep.decoders) == 30 and dep.spare_gpus == ()
    per_rack = Counter(dep.gpu_domain[d.gpus[0]] for d in dep.decoders)
    # widest first: decoders fill rack after rack (4 x EP16 = 64 of 72 GPUs), leaving whole racks for later
    assert sorted(per_rack.values(), reverse=True) == [4] * 7 + [2]
    # prefillers beside the decoders first (the 2 trays left in each decoder rack), then the nearest racks
    pf_racks = Counter(dep.gpu_domain[p.gpus[0]] for p in dep.prefillers)
    assert all(pf_racks[r] == 2 for r in range(7)) and pf_racks[7] == 10 and pf_racks[8] == pf_racks[9] == 18
    # ids follow the GPUs
    assert [min(p.gpus) for p in dep.prefillers] == sorted(min(p.gpus) for p in dep.prefillers)


@pytest.mark.parametrize("topo_name,n_p,n_d,wd,want", [
    # one rack: prefillers on trays 0-7, the decoder on the trays after them (the fault drill's layout)
    ("gb200-nvl72", 8, 1, 16, {"P0": range(0, 4), "P7": range(28, 32), "D0": range(32, 48)}),
    ("gb200-nvl72", 6, 3, 16, {"P5": range(20, 24), "D0": range(24, 40), "D2": range(56, 72)}),
    # two racks, 12 prefillers in rack 0, the EP64 decoder in rack 1
    ("gb200-nvl72*2", 12, 1, 64, {"P11": range(44, 48), "D0": range(72, 136)}),
    ("hgx-h200*12", 14, 1, 8, {"P13": range(52, 56), "D0": range(56, 64)}),
])
def test_layouts_that_place_in_order_keep_their_gpus(topo_name, n_p, n_d, wd, want):
    dep = _place(topology.load(topo_name), n_p, n_d, wd=wd)
    groups = {g.id: g.gpus for g in (*dep.prefillers, *dep.decoders)}
    for gid, gpus in want.items():
        assert groups[gid] == tuple(gpus), gid


def test_a_decoder_that_does_not_fit_names_the_smallest_fixes():
    # 9 x EP16 = 144 GPUs = two racks by count, but a rack holds only 4 (64 of 72 GPUs)
    with pytest.raises(UserError) as e:
        _place(Grid(2, 18, 4), 0, 9)
    msg = str(e.value)
    assert "\n" not in msg
    assert msg == ("deployment: decoder 8 needs 16 free GPUs in one NVLink domain; the largest free block "
                   "is 8 (n_prefillers=0, n_decoders=9, 144 GPUs) — fits with 1 fewer decoder, or decoders "
                   "of 8 GPUs, or 1 more NVLink domain of 72 GPUs")


def test_too_many_groups_for_the_gpus_name_both_roles():
    with pytest.raises(UserError) as e:
        _place(topology.load("gb200-nvl72*10"), 60, 31)
    msg = str(e.value)
    assert "prefiller 56 needs 4 free GPUs in one node; the largest free block is 0" in msg
    assert msg.endswith("fits with 4 fewer prefillers, or 1 fewer decoder, or 1 more NVLink domain of "
                        "72 GPUs")


def test_a_group_wider_than_any_node_says_so():
    with pytest.raises(UserError, match="prefiller 0 needs 8 free GPUs in one node; no node has more than 4"):
        _place(Grid(1, 18, 4), 1, 1, wp=8)


def test_aggregated_workers_that_do_not_fit_name_the_fixes():
    with pytest.raises(UserError) as e:
        place_aggregated(Grid(2, 2, 4), n_workers=3, kv_bytes_per_token=1,
                         template=AggregatedTemplate(dp=8, ep=8))
    assert str(e.value) == ("deployment: aggregated worker 2 needs 8 free GPUs in one NVLink domain; the "
                            "largest free block is 0 (aggregated.workers=3, 16 GPUs) — fits with 1 fewer "
                            "aggregated worker, or 1 more NVLink domain of 8 GPUs")


def test_the_cli_refuses_a_layout_that_does_not_fit_in_one_line(tmp_path, capsys):
    from rackbed.engine.cli.main import main

    src = Path(__file__).parents[1] / "scenarios" / "nvl72x10-default.yaml"
    p = tmp_path / "s.yaml"
    p.write_text(src.read_text().replace("replicas: 30", "replicas: 40"))
    assert main(["run", str(p), "--out", str(tmp_path / "out"), "--no-progress"]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and "fewer decoders" in err[0] and "Traceback" not in err[0]


# ---------------------------------------------------------------- never refused when a packing exists


def _witness(rng: random.Random, size: int, host: int, widths: set[int], out: list):
    """A random packing of one aligned block of ``size`` GPUs (a power of two) into groups of ``widths``: the
    block becomes one group, splits in halves, or (rarely: tight packings are the hard ones) stays empty.
    ``out`` gets ``(width, scope)``: a block no wider than a node is a prefiller (one node) or a decoder; a
    wider one a decoder (one domain)."""
    r = rng.random()
    if size in widths and (r < 0.4 or size == min(widths)) and r < 0.97:
        out.append((size, "host" if size <= host and rng.random() < 0.5 else "domain"))
    elif size > min(widths) and r < 0.97:
        _witness(rng, size // 2, host, widths, out)
        _witness(rng, size // 2, host, widths, out)


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), log_dom=st.integers(0, 6), log_host=st.integers(0, 3),
       domains=st.integers(1, 4))
def test_power_of_two_mixes_that_fit_are_never_refused(seed, log_dom, log_host, domains):
    """Groups of power-of-two widths (prefillers up to a node, decoders up to a domain) that a packing places
    by construction: the widest-first packing places them too, each group whole in its node / domain."""
    rng = random.Random(seed)
    host = 2 ** min(log_host, log_dom)
    dom = 2 ** log_dom
    widths = {2 ** k for k in range(log_dom + 1) if rng.random() < 0.6} or {dom}
    groups: list = []
    for _ in range(domains):
        _witness(rng, dom, host, widths, groups)
    rng.shuffle(groups)
    wants = [_Want("prefiller" if s == "host" else "decoder", i, w, s) for i, (w, s) in enumerate(groups)]
    topo = Grid(domains, dom // host, host)
    got = _pack(topo.gpu_ids, {g: topo.host_of(g) for g in topo.gpu_ids},
                {g: g // dom for g in topo.gpu_ids}, wants)
    assert not isinstance(got, _Want), f"{got} refused"
    used = [g for gpus in got.values() for g in gpus]
    assert len(used) == len(set(used)) == sum(w.width for w in wants)
    for w, gpus in got.items():
        assert len(gpus) == w.width
        assert len({g // (host if w.scope == "host" else dom) for g in gpus}) == 1


@settings(max_examples=100, deadline=None)
@given(racks=st.integers(1, 6), log_wd=st.integers(0, 4), log_wp=st.integers(0, 2), data=st.data())
def test_nvl72_racks_take_every_layout_that_fits_rack_by_rack(racks, log_wd, log_wp, data):
    """NVL72-shaped racks (18 nodes of 4 GPUs): decoders of 4..64 GPUs (whole nodes), prefillers of 1..4 GPUs.
    Any count a rack-by-rack layout holds (k decoders per rack, prefillers in the rest) is placed."""
    wd, wp = 4 * 2 ** log_wd, 2 ** log_wp
    n_d = n_p = 0
    for _ in range(racks):
        k = data.draw(st.integers(0, 72 // wd))
        n_d += k
        room = (72 - k * wd) // wp
        n_p += room - data.draw(st.integers(0, min(room, 2)))  # (nearly) full racks: the hard cases
    topo = Grid(racks, 18, 4)
    dep = _place(topo, n_p, n_d, wp=wp, wd=wd)
    _check(dep, topo)
    assert (len(dep.prefillers), len(dep.decoders)) == (n_p, n_d)


def test_the_shipped_ten_rack_scenario_builds_every_group():
    from rackbed.sim.scenario import build, load_scenario

    b = build(load_scenario(Path(__file__).parents[1] / "scenarios" / "nvl72x10-default.yaml"),
              engine_calibration=False)
    dep = b.deployment
    _check(dep, b.topology)
    assert (len(dep.prefillers), len(dep.decoders), dep.n_gpus) == (60, 30, 720)
