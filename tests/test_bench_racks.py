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
    out["points"] = [{"racks": n, **pt, "baseline": dict(pt)} for n in (1, 10, 100)]  # log axes
    plot_racks(out, f)
    assert f.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_rack_groups_split_evenly():
    from rackbed.sim.bench import rack_groups

    assert rack_groups(10) == [10] and rack_groups(1) == [1]
    assert rack_groups(100) == [10] * 10
    assert rack_groups(25, 10) == [9, 8, 8]
    for n in range(1, 60):
        for g in (1, 3, 10, 28):
            got = rack_groups(n, g)
            assert sum(got) == n and max(got) <= g and max(got) - min(got) <= 1


def test_a_point_in_independent_groups():
    """Two racks as two one-rack groups in two processes: the groups' figures summed, each group its own seed
    (so not copies of one another), the point's digest made of theirs."""
    out = run_racks([2], 1.0, 20.0, group_racks=1, jobs=2)
    (p,) = out["points"]
    g0, g1 = p["groups"]
    assert (p["prefillers"], p["decoders"]) == (12, 6) and p["rate_per_s"] == pytest.approx(40.0)
    assert g0["topology"] == g1["topology"] == "gb200-nvl72" and p["topology"] == "2 x (gb200-nvl72)"
    assert p["events"] == g0["events"] + g1["events"]
    assert p["cpu_s"] == pytest.approx(g0["cpu_s"] + g1["cpu_s"])
    assert g0["digest"] != g1["digest"] and p["digest"] not in (g0["digest"], g1["digest"])
    assert p["wall_s"] > 0 and out["group_racks"] == 1
    json.dumps(out)


@pytest.mark.parametrize("flag", ["--group-racks", "--jobs"])
def test_bad_group_options_one_line(flag, capsys):
    assert cli_main(["bench", "sim", "--racks", "1", "--sim-s", "1", flag, "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and flag in err
