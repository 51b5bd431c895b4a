"""GPU power figures, rack power layout and the rack power limit (topology.specs / presets / power)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as hs

from rackbed.engine.cli.main import main
from rackbed.topology import load
from rackbed.topology.errors import UserError
from rackbed.topology.power import check_rack_power, rack_peak_w
from rackbed.topology.presets import PRESETS
from rackbed.topology.specs import GPUS, GpuPower

TOPO = """cluster:
  name: small-rack
  rack: {{name: test rack, n_nodes: 2, rack_power_kw: {kw}, overhead_w: 500,
         node: {{name: n, gpu: H200-SXM, n_gpus: 8, nvlink: nvlink4, nvswitch: NVSwitch-3,
                links_per_switch: [5, 4, 4, 5], nic: CX-7, nics_per_gpu: 1, nic_link: pcie5-x16,
                overhead_w: 2000}}}}
  fabric: {{switch: Quantum-2-QM9700, link: ib-ndr}}
"""
SCENARIO = """kind: serving
name: t
topology: {topo}
model: qwen3-235b-a22b
weight_format: fp8_block
prefill: {{tp: 8, ep: 8, replicas: 1}}
decode: {{ep: 8, replicas: 1}}
workload: {{kind: synthetic, arrival: {{kind: poisson, rate_per_s: 2}}, prompt: {{kind: fixed, tokens: 1000}},
           output: {{kind: fixed, tokens: 20}}, n_requests: 20}}
"""


def _dep(gpus, spare=()):
    return SimpleNamespace(name="d", prefillers=(SimpleNamespace(gpus=tuple(gpus)),), decoders=(),
                           aggregated=(), spare_gpus=tuple(spare))


def test_every_catalogue_gpu_has_ordered_power():
    for g in GPUS.values():
        assert g.power is not None, g.name
        assert g.power.idle_w < g.power.memory_bound_w < g.power.compute_bound_w
    assert GPUS["H200-SXM"].power.compute_bound_w == 700 and GPUS["B200-HGX"].power.compute_bound_w == 1000


def test_power_must_be_ordered():
    with pytest.raises(ValueError, match="idle_w <= memory_bound_w <= compute_bound_w"):
        GpuPower(idle_w=100, memory_bound_w=50, compute_bound_w=700)


@pytest.mark.parametrize("name", list(PRESETS))
def test_a_whole_preset_fits_its_rack(name):
    t = load(name)
    assert sum(len(r.gpus) for r in t.racks) == t.n_gpus
    check_rack_power(_dep(t.gpu_ids), t)  # no preset refuses its own GPUs


def test_nvl72_peak_in_the_published_range():
    (rack, n, w), = rack_peak_w(load("gb200-nvl72"), range(72))
    assert n == 72 and 100e3 <= w <= rack.limit_kw * 1e3 == 132e3


@given(hs.sets(hs.integers(0, 15)), hs.sets(hs.integers(0, 15)))
def test_peak_is_monotone_in_the_gpus_held(a, b):
    t = load("hgx-h200*2")

    def peak(s):
        return sum(w for _, _, w in rack_peak_w(t, s))

    assert peak(a | b) >= max(peak(a), peak(b))
    assert peak(a) <= len(a) * 700 + 2 * 2000


def test_over_the_limit_is_refused_in_one_line(tmp_path):
    topo = tmp_path / "t.yaml"
    topo.write_text(TOPO.format(kw=10))
    t = load(topo)
    check_rack_power(_dep(range(8)), t)  # one node: 8 x 700 + 2000 + 500 = 8.1 kW fits 10 kW
    with pytest.raises(UserError, match=r"rack test rack of small-rack would draw up to 15\.7 kW .* 10 kW"):
        check_rack_power(_dep(range(8), spare=range(8, 16)), t)  # the spare pool counts


def test_cli_refuses_a_deployment_over_the_rack_limit(tmp_path, capsys):
    topo = tmp_path / "t.yaml"
    topo.write_text(TOPO.format(kw=10))
    sc = tmp_path / "s.yaml"
    sc.write_text(SCENARIO.format(topo=topo))
    rc = main(["run", str(sc), "--out", str(tmp_path / "out"), "--no-progress"])
    err = capsys.readouterr().err
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert rc == 2 and len(lines) == 1 and "rack_power_kw" in lines[0] and "Traceback" not in err, err
