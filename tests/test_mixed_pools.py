"""Mixed pools: a joined topology (``A+B``) holds two GPU kinds; ``prefill.gpu`` / ``decode.gpu`` place each
role on one of them, each role is priced on its own GPU model (compute, memory, calibration), and KV crosses
the fabric that joins them."""

from __future__ import annotations

from pathlib import Path

import pytest

from rackbed import topology
from rackbed.sim.scenario import build, load_scenario, parse_scenario
from rackbed.topology.errors import UserError

SHIPPED = Path(__file__).parents[1] / "scenarios" / "h200-prefill-gb200-decode.yaml"


def _scenario(**over):
    data = load_scenario(SHIPPED).model_dump(mode="json", exclude_none=True)
    for k, v in over.items():
        data[k] = {**data[k], **v} if isinstance(v, dict) else v
    return parse_scenario(data)


def test_a_joined_topology_numbers_its_parts_in_order_on_one_fabric():
    t = topology.load("hgx-h200*2+gb200-nvl72")
    assert t.name == "hgx-h200*2+gb200-nvl72" and t.n_gpus == 16 + 72
    assert {t.gpu_spec(g).name for g in range(16)} == {"H200-SXM"}
    assert {t.gpu_spec(g).name for g in range(16, 88)} == {"B200-GB200"}
    assert [t.host_of(g) for g in (7, 8, 16, 20, 87)] == [0, 1, 2, 3, 19]
    assert sorted(len(d) for d in t.nvlink_domains()) == [8, 8, 72]
    # one fabric: every NIC reaches every other (an H200 NIC and a GB200 NIC share the switches)
    assert t.summary()["counts"]["nic"] == 88


@pytest.mark.parametrize("name,msg", [
    ("hgx-h200+h200x2", "h200x2 has no scale-out network to join others with"),
    ("hgx-h200+", "join presets with '[+]'"),
    ("hgx-h200+gb900", "unknown topology 'gb900'"),
])
def test_bad_joins_are_one_line_errors(name, msg):
    with pytest.raises(UserError, match=msg):
        topology.load(name)


def test_each_role_lands_on_its_gpu_kind():
    b = build(_scenario(), engine_calibration=False)
    t, dep = b.topology, b.deployment
    assert {t.gpu_spec(g).name for p in dep.prefillers for g in p.gpus} == {"H200-SXM"}
    assert {t.gpu_spec(g).name for d in dep.decoders for g in d.gpus} == {"B200-GB200"}
    assert (len(dep.prefillers), len(dep.decoders)) == (8, 4)
    # the KV path: an H200 node's NICs to the rack's
    assert {dep.gpu_nic[g] for g in dep.prefillers[0].gpus} <= {f"nic:{i}" for i in range(32)}
    assert dep.decoders[0].rank_nics[0] in {f"nic:{i}" for i in range(32, 104)}


def test_each_role_is_priced_as_on_a_pool_of_its_own_kind():
    """Prefill steps cost what they cost on H200 nodes alone, decode steps what they cost on the NVL72 alone
    (same plans, each GPU's own calibration), and not what the other kind would give."""
    mixed = build(_scenario(), engine_calibration=False).cost_model
    h200 = build(_scenario(topology="hgx-h200*8", prefill={"gpu": None}, decode={"gpu": None, "ep": 8}),
                 engine_calibration=False).cost_model
    gb200 = build(_scenario(topology="gb200-nvl72", prefill={"gpu": None, "replicas": 2},
                            decode={"gpu": None}), engine_calibration=False).cost_model
    seqs = [(6000, 0), (3000, 0)]
    pre = mixed.prefill_breakdown(seqs).to_steptime().total_s
    assert pre == pytest.approx(h200.prefill_breakdown(seqs).to_steptime().total_s, rel=1e-12)
    assert pre != pytest.approx(gb200.prefill_breakdown(seqs).to_steptime().total_s, rel=1e-3)
    dec = mixed.decode_breakdown(32, 8000, 1).to_steptime().total_s
    assert dec == pytest.approx(gb200.decode_breakdown(32, 8000, 1).to_steptime().total_s, rel=1e-12)
    assert mixed.calib is not mixed.decode_calib  # H200's table for prefill, GB200's for decode


def test_the_shipped_mixed_scenario_runs(tmp_path, capsys):
    from rackbed.engine.cli.main import main

    p = tmp_path / "m.yaml"
    p.write_text(SHIPPED.read_text().replace("max_requests: 2000", "max_requests: 200"))
    assert main(["run", str(p), "--out", str(tmp_path / "out"), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "prefill calibrated" in out and "decode calibrated" in out and "200 / 200" in out


@pytest.mark.parametrize("over,msg", [
    ({"decode": {"gpu": "H100"}}, "decode.gpu: 'H100' names no GPU model of hgx-h200*4+gb200-nvl72 "
                                  "(B200-GB200, H200-SXM)"),
    ({"prefill": {"gpu": "00"}}, "prefill.gpu: '00' names several GPU models"),
    ({"prefill": {"gpu": None, "replicas": 10}},
     "prefill: the groups landed on B200-GB200 and H200-SXM; give prefill.gpu"),
    ({"decode": {"gpu": "H200"}}, "decoder 0 needs 16 free GPUs in one NVLink domain; no NVLink domain has "
                                  "more than 8 GPUs"),
])
def test_pools_that_do_not_work_are_one_line_errors(over, msg):
    with pytest.raises(UserError) as e:
        build(_scenario(**over), engine_calibration=False)
    assert msg in str(e.value) and "\n" not in str(e.value)
