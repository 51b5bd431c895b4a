"""Outputs never clobber (topology.outputs): an existing file as an output folder, a non-empty folder without
--force, symbolic links, names that would leave the output root, atomic writes; and the commands that use it."""

from __future__ import annotations

import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rackbed.engine.cli.main import main
from rackbed.topology.errors import UserError
from rackbed.topology.outputs import prepare_dir, prepare_file, replacing, safe_name, write_text

SCENARIO = """kind: serving
name: t
topology: gb200-nvl72
model: qwen3-235b-a22b
weight_format: mxfp8
prefill: {tp: 4, ep: 4, replicas: 1}
decode: {ep: 16, replicas: 1}
workload: {kind: synthetic, arrival: {kind: poisson, rate_per_s: 2}, prompt: {kind: fixed, tokens: 1000},
           output: {kind: fixed, tokens: 20}, n_requests: 5}
"""


def test_existing_file_as_output_folder_is_one_line(tmp_path):
    f = tmp_path / "f"
    f.write_text("keep")
    with pytest.raises(UserError, match="is a file, not a folder"):
        prepare_dir(f)
    assert f.read_text() == "keep"


def test_non_empty_folder_needs_force_or_its_resume_marker(tmp_path):
    d = tmp_path / "d"
    assert prepare_dir(d) == d and d.is_dir()       # created
    assert prepare_dir(d) == d                       # empty: fine
    (d / "x.txt").write_text("old")
    with pytest.raises(UserError, match="not empty; pass --force"):
        prepare_dir(d)
    assert prepare_dir(d, force=True) == d
    (d / "results.jsonl").write_text("")
    assert prepare_dir(d, resume_marker="results.jsonl") == d
    with pytest.raises(UserError, match="exists; pass --force"):
        prepare_file(d / "x.txt")
    with pytest.raises(UserError, match="is a folder"):
        prepare_file(d)


def test_symlinks_are_never_written_through(tmp_path):
    target = tmp_path / "target.txt"
    target.write_text("precious")
    link = tmp_path / "link.txt"
    link.symlink_to(target)
    with pytest.raises(UserError, match="symbolic link"):
        write_text(link, "overwritten")
    with pytest.raises(UserError, match="symbolic link"):
        prepare_file(link, force=True)
    (tmp_path / "dir").mkdir()
    (tmp_path / "dirlink").symlink_to(tmp_path / "dir")
    with pytest.raises(UserError, match="symbolic link"):
        prepare_dir(tmp_path / "dirlink", force=True)
    assert target.read_text() == "precious"


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.text(max_size=40))
def test_safe_name_is_one_harmless_component(name):
    s = safe_name(name)
    assert s and "/" not in s and "\\" not in s and ".." not in s and not s.startswith((".", "-"))
    assert safe_name(s) == s


def test_escaped_spec_name_stays_inside():
    assert safe_name("x/../../../escaped") == "x-.-.-.-escaped"
    assert safe_name("../..") == "unnamed" and safe_name("ok_name-1.2") == "ok_name-1.2"


def test_atomic_write_leaves_the_old_file_on_error(tmp_path):
    p = tmp_path / "out.txt"
    write_text(p, "old\n")
    with pytest.raises(RuntimeError), replacing(p) as f:
        f.write("half of the new")
        raise RuntimeError("killed mid-write")
    assert p.read_text() == "old\n"
    assert os.listdir(tmp_path) == ["out.txt"]    # no temporary left behind
    write_text(p, "new\n")
    assert p.read_text() == "new\n" and oct(p.stat().st_mode & 0o777) != "0o600"


@pytest.mark.slow
def test_run_refuses_to_clobber(tmp_path, capsys):
    sc = tmp_path / "s.yaml"
    sc.write_text(SCENARIO)
    a_file = tmp_path / "a_file"
    a_file.write_text("x")
    assert main(["run", str(sc), "--out", str(a_file), "--no-progress"]) == 2
    assert "is a file, not a folder" in capsys.readouterr().err
    out = tmp_path / "out"
    assert main(["run", str(sc), "--out", str(out), "--no-progress"]) == 0
    first = (out / "metrics.json").read_bytes()
    capsys.readouterr()
    assert main(["run", str(sc), "--out", str(out), "--no-progress"]) == 2
    assert "pass --force" in capsys.readouterr().err
    assert main(["run", str(sc), "--out", str(out), "--no-progress", "--force"]) == 0
    assert (out / "metrics.json").read_bytes() == first
    assert not [n for n in os.listdir(out) if n.endswith(".tmp")]


def test_calibrate_never_defaults_to_a_shipped_file(tmp_path, capsys, monkeypatch):
    from rackbed.engine.cli import calibrate

    assert not calibrate.DEFAULT_OUT.startswith("calibration/")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "calibration").mkdir()
    shipped = tmp_path / "calibration" / "h200.yaml"
    shipped.write_text("shipped")
    assert main(["calibrate", "--dry-run", "--out", "calibration/h200.yaml"]) == 2
    assert "pass --force" in capsys.readouterr().err and shipped.read_text() == "shipped"


def test_a_default_folder_in_use_gives_a_fresh_one(tmp_path):
    """Without --out a command writes to its default folder; a second run leaves the first's files and takes the
    next free sibling, so running the main job twice works and loses nothing."""
    base = tmp_path / "rackbed-out" / "nvl72-default"
    assert prepare_dir(base, default=True) == base  # missing: created and used
    (base / "metrics.json").write_text("{}")
    assert prepare_dir(base, default=True) == tmp_path / "rackbed-out" / "nvl72-default-2"
    (tmp_path / "rackbed-out" / "nvl72-default-2" / "metrics.json").write_text("{}")
    assert prepare_dir(base, default=True) == tmp_path / "rackbed-out" / "nvl72-default-3"
    assert (base / "metrics.json").read_text() == "{}"
    with pytest.raises(UserError, match="not empty"):  # a folder the user named is never silently swapped
        prepare_dir(base)


def test_a_default_folder_of_the_same_command_is_resumed(tmp_path):
    """``own``: a command's own test of a folder (a search's search.json naming the same search); the default
    folder and its -2, -3 … siblings are resumed when they are the command's own, skipped when another's."""
    base = tmp_path / "search-x"
    base.mkdir()
    (base / "mark").write_text("A")
    other = tmp_path / "search-x-2"
    other.mkdir()
    (other / "mark").write_text("B")

    def own_of(tag):
        return lambda q: (q / "mark").is_file() and (q / "mark").read_text() == tag

    assert prepare_dir(base, default=True, own=own_of("A")) == base
    assert prepare_dir(base, default=True, own=own_of("B")) == other
    assert prepare_dir(base, default=True, own=own_of("C")) == tmp_path / "search-x-3"
    assert prepare_dir(other, own=own_of("B")) == other
    with pytest.raises(UserError, match="not empty; pass --force"):
        prepare_dir(other, own=own_of("A"))
