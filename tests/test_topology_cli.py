"""``rackbed topo`` through ``engine.cli.main.main``: summaries, checks, drawings, dumps and one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from rackbed.engine.cli.main import main

ROOT = Path(__file__).resolve().parents[1]


def run(capsys, *argv):
    rc = main(["topo", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_show_gb200_json(capsys):
    rc, out, err = run(capsys, "show", "gb200-nvl72", "--json")
    assert rc == 0 and err == ""
    s = json.loads(out)
    assert s["counts"]["gpu"] == 72
    assert s["counts"]["nvsw"] == 18 and s["sharp_switches"]["nvsw"] == 18
    assert s["cpus"] == {"Grace": 36}
    assert s["counts"]["nic"] == 72
    assert s["gpu_models"]["B200-GB200"]["hbm_GB"] == 186


def test_show_gb200_table(capsys):
    rc, out, _ = run(capsys, "show", "gb200-nvl72")
    assert rc == 0
    assert "72 × B200-GB200" in out and "18, 18 with SHARP/NVLS" in out and "36 × Grace" in out
    assert "72 × CX-7" in out and "900 GB/s per direction" in out


def test_show_hgx_h200(capsys):
    rc, out, _ = run(capsys, "show", "hgx-h200")
    assert rc == 0
    assert "8 × H200-SXM" in out and "4 × NVSwitch-3" in out and "mxfp8 unsupported" in out
    rc, out, _ = run(capsys, "show", "hgx-h200", "--json")
    s = json.loads(out)
    assert s["counts"]["gpu"] == 8 and s["counts"]["nvsw"] == 4


def test_show_multi_node(capsys):
    rc, out, _ = run(capsys, "show", "hgx-h200*2", "--json")
    s = json.loads(out)
    assert rc == 0 and s["counts"]["gpu"] == 16 and s["p2p"]["cross_domain"]["GBps_per_dir"] == 50.0


def test_list(capsys):
    rc, out, _ = run(capsys, "list")
    assert rc == 0 and all(n in out for n in ("gb200-nvl72", "hgx-h200", "hgx-h200-efa", "hgx-b200", "h200x2",
                                       "gb300-nvl72", "hgx-b300", "hgx-h100", "hgx-h800"))


@pytest.mark.parametrize("name", ["h200x2-lab.yaml", "h200x2-pair-ib.yaml"])
def test_check_examples(capsys, name):
    path = ROOT / "scenarios" / "topologies" / name
    rc, out, err = run(capsys, "check", str(path))
    assert rc == 0 and out.startswith(f"ok: {path}") and err == ""


def _one_line_error(capsys, *argv) -> str:
    rc, out, err = run(capsys, *argv)
    assert rc == 2, (out, err)
    assert "Traceback" not in err and err.count("\n") == 1 and err.startswith("rackbed: error: ")
    return err


def test_errors_are_one_line(capsys, tmp_path):
    assert "unknown topology 'dgx-a100'" in _one_line_error(capsys, "show", "dgx-a100")
    assert "copy count" in _one_line_error(capsys, "show", "hgx-h200*0")
    assert "no such topology file" in _one_line_error(capsys, "check", str(tmp_path / "none.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [oops\n")
    assert "invalid YAML at line" in _one_line_error(capsys, "check", str(bad))
    bad.write_text(yaml.safe_dump({"name": "x", "nodes": [{"id": "gpu:0", "spec": "H200-SXM", "host": 0}],
                                   "links": [{"a": "gpu:0", "b": "nic:3", "spec": "pcie5-x16"}]}))
    assert "links[0].b: no node 'nic:3'" in _one_line_error(capsys, "check", str(bad))
    bad.write_text(yaml.safe_dump({"name": "x", "specs": {"link": {"l": {"kind": "pcie", "GBps_per_dir": -3,
                                                                         "latency_us": 1}}},
                                   "nodes": [], "links": []}))
    assert "specs.link.l.GBps_per_dir: Input should be greater than 0" in _one_line_error(capsys, "show", str(bad))
    bad.write_text(yaml.safe_dump({"name": "x", "nodes": [{"id": "gpu:0", "spec": "H200-SXM", "host": 0}],
                                   "links": [], "extra": 1}))
    assert "extra: unknown key" in _one_line_error(capsys, "draw", str(bad), "--out", str(tmp_path / "x.png"))
    bad.write_text(yaml.safe_dump({"name": "x", "nodes": [{"id": "gpu:0", "spec": "H200-SXM", "host": 0}],
                                   "links": []}))
    assert "GPU gpu:0 has no links" in _one_line_error(capsys, "check", str(bad))


def test_draw_png(capsys, tmp_path):
    out_png = tmp_path / "hgx.png"
    rc, out, _ = run(capsys, "draw", "hgx-h200*2", "--out", str(out_png))
    assert rc == 0 and out.strip() == f"wrote {out_png}" and out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out_png.stat().st_size > 5000


def test_dump_then_check(capsys, tmp_path):
    path = tmp_path / "efa.yaml"
    rc, _, _ = run(capsys, "dump", "hgx-h200-efa*2", "--out", str(path))
    assert rc == 0
    rc, out, _ = run(capsys, "check", str(path))
    assert rc == 0 and "16 GPUs on 2 host(s)" in out and "32 NICs" in out
    rc, out, _ = run(capsys, "dump", "h200x2", "--format", "json")
    assert rc == 0 and json.loads(out)["name"] == "h200x2"
