"""``rackbed bench sim --racks``: the one-rack benchmark scaled to N racks, measured in fresh processes, against a
``--baseline`` revision with an identity check of the results; one-line errors for bad arguments."""

from __future__ import annotations

import json

import pytest

from rackbed.engine.cli.main import main as cli_main
from rackbed.sim.bench import parse_racks, rack_spec, run_racks


def test_rack_spec_scales_the_one_rack_layout():
    s = rack_spec(10, 300.0, 20.0)
    assert s["topology"] == "gb200-nvl72*10"
    assert (s["prefill"]["replicas"], s["decode"]["replicas"]) == (60, 30)
    assert s["workload"]["rate_per_s"] == 200.0 and s["sim"]["until_s"] == 300.0
    one = rack_spec(1, 300.0, 20.0)
    assert one["topology"] == "gb200-nvl72" and (one["prefill"]["replicas"], one["decode"]["replicas"]) == (6, 3)


@pytest.mark.parametrize("text", ["", "0", "1,x", "-2", "1,,0"])
def test_bad_racks_one_line(text, capsys):
    assert cli_main(["bench", "sim", "--racks", text, "--sim-s", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--racks" in err and "Traceback" not in err
    with pytest.raises(Exception, match="--racks"):
        parse_racks(text)


def test_bad_baseline_one_line(capsys):
    assert cli_main(["bench", "sim", "--racks", "1", "--sim-s", "1", "--baseline", "no-such-revision"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--baseline" in err


def test_two_racks_against_head(tmp_path):
    """Two racks: 12 TP4 prefillers and 6 decoders of 16 GPUs place (the widest-first packing keeps the racks
    whole for the decoders); HEAD's tree simulates the same thing (the working tree's simulator changes are behind
    identity tests)."""
    out = run_racks([2], 2.0, 20.0, baseline="HEAD")
    (p,) = out["points"]
    assert p["topology"] == "gb200-nvl72*2" and p["prefillers"] == 12
    assert p["decoders"] == 6 and p["decoders_asked"] == 6
    assert p["rate_per_s"] == pytest.approx(40.0)
    assert p["events"] > 0 and p["cpu_s"] > 0 and p["us_per_event"] == pytest.approx(p["cpu_s"] / p["events"] * 1e6)
    assert p["baseline"]["events"] == p["events"] and p["identical"] is True
    assert len(out["baseline_commit"]) == 40
    json.dumps(out)


def test_figure_of_a_curve(tmp_path):
    from rackbed.sim.bench import plot_racks

    pt = {"cpu_s_per_sim_hour": 10.0, "us_per_event": 9.0}
    out = {"sim_s": 300.0, "baseline": "HEAD~1", "baseline_commit": "0" * 40,
           "points": [{"racks": n, **pt, "baseline": dict(pt)} for n in (1, 2, 5, 10)]}
    f = tmp_path / "curve.png"
    plot_racks(out, f)
    assert f.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
