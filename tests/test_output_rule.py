"""One output rule for every file rackbed writes (topology.outputs): every command that writes, the torchrun
entry and the benchmark scripts refuse (a) an output folder or file that is a symbolic link, (b) a non-empty
folder / an existing file without --force, (c) a place inside the shipped data — with one line and status 2,
before any work and leaving the place as it was. Two runs started together never share a folder (processes and
threads racing for a default folder or one --out). A static check finds raw writes outside the helpers."""

from __future__ import annotations

import ast
import importlib
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from rackbed import shipped
from rackbed.engine.cli.main import main
from rackbed.topology.errors import UserError
from rackbed.topology.outputs import prepare_dir, prepare_file, release_claims, shipped_root_of

REPO = Path(__file__).resolve().parents[1]

SCENARIO = """kind: serving
name: t
topology: gb200-nvl72
model: qwen3-235b-a22b
weight_format: mxfp8
prefill: {tp: 4, ep: 4, replicas: 1}
decode: {ep: 16, replicas: 1}
workload: {kind: synthetic, arrival: {kind: poisson, rate_per_s: 2}, prompt: {kind: fixed, tokens: 200},
           output: {kind: fixed, tokens: 4}, n_requests: 3}
"""


def _scen(tmp: Path) -> str:
    p = tmp / "s.yaml"
    p.write_text(SCENARIO)
    return str(p)


# Commands that write a folder: argv for output folder ``d`` (``tmp`` holds their inputs).
DIR_COMMANDS = {
    "run": lambda tmp, d: ["run", _scen(tmp), "--out", d],
    "emit": lambda tmp, d: ["emit", _scen(tmp), "--engine", "sglang", "--out", d],
    "real": lambda tmp, d: ["real", _scen(tmp), "--out", d],
    "sweep": lambda tmp, d: ["sweep", str(shipped("scenarios", "sweeps", "small.yaml")), "--out", d],
    "sweep --bench": lambda tmp, d: ["sweep", "--bench", "--out", d],
    "search": lambda tmp, d: ["search", "--rate", "2", "--out", d],
    "search --emit-out": lambda tmp, d: ["search", "--rate", "2", "--emit", "sglang", "--emit-out", d],
}
# Commands whose folder collects files of several runs (capacity's tags, its searches' cache): a non-empty one
# is theirs, the other two rules hold.
COLLECTING_DIR_COMMANDS = {
    "capacity --out": lambda tmp, d: ["capacity", "--out", d],
    "capacity --work": lambda tmp, d: ["capacity", "--out", str(tmp / "cap"), "--work", d],
}
# Commands that write a file: argv for output file ``f``.
FILE_COMMANDS = {
    "topo draw": lambda tmp, f: ["topo", "draw", "h200x2", "--out", f],
    "topo dump": lambda tmp, f: ["topo", "dump", "h200x2", "--out", f],
    "bench sim": lambda tmp, f: ["bench", "sim", "--out", f],
    "bench kernels": lambda tmp, f: ["bench", "kernels", "--out", f],
    "calibrate": lambda tmp, f: ["calibrate", "--dry-run", "--out", f],
    "calibrate --from-aiconfigurator": lambda tmp, f: ["calibrate", "--from-aiconfigurator", "h200",
                                                       "--out", f],
    "calibrate --measurements-out": lambda tmp, f: ["calibrate", "--dry-run", "--out", str(tmp / "c.yaml"),
                                                    "--measurements-out", f],
    "capacity (its files)": lambda tmp, f: ["capacity", "--out", str(Path(f).parent), "--tag", Path(f).stem],
    "validate --out": lambda tmp, f: ["validate", "--out", f],
    "validate --write-engine-calibration": lambda tmp, f: ["validate", "--write-engine-calibration", f],
}
# Script entry points with --out FILE (python -m …): module, extra arguments.
FILE_SCRIPTS = {
    "kernels.bench.measure": [],
    "kernels.bench.probe": [],
    "kernels.bench.moe_prefill": [],
    "engine.bench.decode": [],
    "engine.bench.mla_decode": [],
    "engine.bench.tp_allreduce": [],
    "engine.bench.peer_a2a": [],
    "sim.cross_source": [],
}


def _cli(argv: list[str], capsys) -> tuple[int, str]:
    rc = main(argv)
    err = capsys.readouterr().err.strip()
    return rc, err


def _refused(rc: int, err: str, path, rule: str) -> None:
    assert rc == 2, err
    assert len(err.splitlines()) == 1 and err.startswith("rackbed: error: ") and "Traceback" not in err, err
    assert str(path) in err and rule in err, err


def _link_to_empty_dir(tmp: Path) -> Path:
    (tmp / "real").mkdir()
    (tmp / "link").symlink_to(tmp / "real")
    return tmp / "link"


def _full_dir(tmp: Path) -> Path:
    d = tmp / "full"
    d.mkdir()
    (d / "keep.txt").write_text("precious")
    return d


def _shipped_dir() -> Path:
    d = shipped("scenarios") / "rackbed-output-rule-test"
    assert not d.exists()
    return d


def _shipped_file(suffix: str) -> Path:
    f = shipped("calibration") / f"rackbed-output-rule-test{suffix}"
    assert not f.exists()
    return f


def _suffix(name: str) -> str:
    return ".png" if name == "topo draw" else ".yaml" if name == "calibrate" else ".json"


# ------------------------------------------------------------------------------------------------------------
# (a) links, (b) non-empty / existing, (c) shipped data: every command

@pytest.mark.parametrize("name", sorted(DIR_COMMANDS) + sorted(COLLECTING_DIR_COMMANDS))
def test_folder_commands_refuse_a_linked_folder_even_with_force(name, tmp_path, capsys):
    argv = {**DIR_COMMANDS, **COLLECTING_DIR_COMMANDS}[name]
    link = _link_to_empty_dir(tmp_path)
    _refused(*_cli([*argv(tmp_path, str(link)), "--force"], capsys), link, "symbolic link")
    assert list((tmp_path / "real").iterdir()) == []


@pytest.mark.parametrize("name", sorted(DIR_COMMANDS))
def test_folder_commands_refuse_a_non_empty_folder_without_force(name, tmp_path, capsys):
    d = _full_dir(tmp_path)
    _refused(*_cli(DIR_COMMANDS[name](tmp_path, str(d)), capsys), d, "not empty; pass --force")
    assert [p.name for p in d.iterdir()] == ["keep.txt"] and (d / "keep.txt").read_text() == "precious"


@pytest.mark.parametrize("name", sorted(DIR_COMMANDS) + sorted(COLLECTING_DIR_COMMANDS))
def test_folder_commands_refuse_shipped_data_even_with_force(name, tmp_path, capsys):
    argv = {**DIR_COMMANDS, **COLLECTING_DIR_COMMANDS}[name]
    d = _shipped_dir()
    _refused(*_cli([*argv(tmp_path, str(d)), "--force"], capsys), d, "shipped data")
    assert not d.exists()


@pytest.mark.parametrize("name", sorted(FILE_COMMANDS))
def test_file_commands_refuse_a_linked_file_even_with_force(name, tmp_path, capsys):
    target = tmp_path / "target.txt"
    target.write_text("precious")
    link = tmp_path / f"link{_suffix(name)}"
    link.symlink_to(target)
    _refused(*_cli([*FILE_COMMANDS[name](tmp_path, str(link)), "--force"], capsys), link, "symbolic link")
    assert target.read_text() == "precious" and link.is_symlink()


@pytest.mark.parametrize("name", sorted(FILE_COMMANDS))
def test_file_commands_refuse_an_existing_file_without_force(name, tmp_path, capsys):
    f = tmp_path / f"exists{_suffix(name)}"
    f.write_text("precious")
    _refused(*_cli(FILE_COMMANDS[name](tmp_path, str(f)), capsys), f, "exists; pass --force")
    assert f.read_text() == "precious"


@pytest.mark.parametrize("name", sorted(FILE_COMMANDS))
def test_file_commands_refuse_shipped_data_without_force(name, tmp_path, capsys):
    f = _shipped_file(_suffix(name))
    rc, err = _cli(FILE_COMMANDS[name](tmp_path, str(f)), capsys)
    _refused(rc, err, f.parent if name == "capacity (its files)" else f, "shipped data")
    assert not f.exists()


def test_a_shipped_file_is_written_only_when_named_with_force(tmp_path, capsys):
    """The maintainer's way (regenerating a shipped calibration): --out naming the file and --force. A name
    derived from it (calibrate's <out>_measure.json) or a default is never inside shipped data, even with
    --force."""
    f = _shipped_file(".yaml")
    assert prepare_file(f, force=True) == f and not f.exists()        # checked, not written
    with pytest.raises(UserError, match="shipped data"):
        prepare_file(f, force=True, default=True)
    _refused(*_cli(["calibrate", "--dry-run", "--out", str(f), "--force"], capsys),
             f.with_name(f.stem + "_measure.json"), "shipped data")
    assert not f.exists() and not f.with_name(f.stem + "_measure.json").exists()
    # through the rackbed/calibration link too
    assert shipped_root_of(REPO / "rackbed" / "calibration" / "h200.yaml") == shipped("calibration")


@pytest.mark.slow
def test_calibrate_does_not_write_merged_measurements_beside_shipped_inputs(tmp_path, monkeypatch):
    """--from-measurements (shipped) + --from-bench: the merged file goes beside the calibration, not into
    calibration/measurements/ (the fit itself is stubbed: it is not what is tested, and it takes a minute)."""
    from rackbed.sim import calibrate

    class Fitted(Exception):
        pass

    def fit(meas, **kw):
        raise Fitted(kw["measurements_path"])

    monkeypatch.setattr(calibrate, "calibrate", fit)
    meas = sorted(shipped("calibration", "measurements").glob("measure_h200x2_*.json.gz"))[0]
    before = sorted(p.name for p in meas.parent.iterdir())
    bench = tmp_path / "bench.json"
    bench.write_text('{"suites": {}}')
    out = tmp_path / "cal.yaml"
    with pytest.raises(Fitted) as e:
        main(["calibrate", "--from-measurements", str(meas), "--from-bench", str(bench), "--out", str(out)])
    assert str(e.value) == str(tmp_path / "cal_measure.json") and (tmp_path / "cal_measure.json").is_file()
    assert sorted(p.name for p in meas.parent.iterdir()) == before


# ------------------------------------------------------------------------------------------------------------
# The torchrun entry and the benchmark scripts (their runs need GPUs or torchrun: checked where they take
# --out)

def test_torchrun_entry_claims_its_folder_under_the_rule(tmp_path, capsys, monkeypatch):
    from rackbed.engine.cli.torchrun import DEFAULT_OUT, prepare_out

    link, full, ship = _link_to_empty_dir(tmp_path), _full_dir(tmp_path), _shipped_dir()
    for d, force, rule in ((link, True, "symbolic link"), (full, False, "not empty"),
                           (ship, True, "shipped")):
        with pytest.raises(SystemExit) as e:
            prepare_out(str(d), force)
        assert e.value.code == 2
        _refused(2, capsys.readouterr().err.strip(), d, rule)
    assert not ship.exists() and list((tmp_path / "real").iterdir()) == []
    monkeypatch.chdir(tmp_path)
    (tmp_path / DEFAULT_OUT).mkdir(parents=True)
    (tmp_path / DEFAULT_OUT / "real.json").write_text("{}")               # an earlier run's
    assert prepare_out(None, False) == Path(DEFAULT_OUT + "-2")


@pytest.mark.parametrize("module", sorted(FILE_SCRIPTS))
def test_bench_scripts_refuse_links_existing_files_and_shipped_data(module, tmp_path, capsys):
    mod = importlib.import_module(f"rackbed.{module}")
    target = tmp_path / "target.json"
    target.write_text("precious")
    link = tmp_path / "link.json"
    link.symlink_to(target)
    for f, extra, rule in ((link, ["--force"], "symbolic link"), (target, [], "exists; pass --force"),
                           (_shipped_file(".json"), [], "shipped data")):
        with pytest.raises(SystemExit) as e:
            mod.main(["--out", str(f), *extra, *FILE_SCRIPTS[module]])
        assert e.value.code == 2, module
        _refused(2, capsys.readouterr().err.strip(), f, rule)
    assert target.read_text() == "precious" and not _shipped_file(".json").exists()


def test_bench_scripts_with_derived_files_and_folders(tmp_path, capsys):
    from rackbed.kernels.bench import moe, moe_a2a

    (tmp_path / "r_moe_gemm.json").write_text("precious")  # moe.py writes OUT_<suite>.json
    with pytest.raises(SystemExit) as e:
        moe.main(["--out", str(tmp_path / "r.json")])
    assert e.value.code == 2
    _refused(2, capsys.readouterr().err.strip(), tmp_path / "r_moe_gemm.json", "exists; pass --force")
    for d, extra, rule in ((_link_to_empty_dir(tmp_path), ["--force"], "symbolic link"),
                           (_full_dir(tmp_path), [], "not empty"), (_shipped_dir(), ["--force"], "shipped")):
        with pytest.raises(SystemExit) as e:
            moe_a2a.main(["--out", str(d), *extra])
        assert e.value.code == 2
        _refused(2, capsys.readouterr().err.strip(), d, rule)
    assert not _shipped_dir().exists()


def test_appends_and_replacements_inside_an_output_folder_never_follow_links(tmp_path):
    from rackbed.sim.sweep import _Appender
    from rackbed.topology.outputs import write_text

    target = tmp_path / "target.jsonl"
    target.write_text("precious\n")
    (tmp_path / "results.jsonl").symlink_to(target)
    with pytest.raises(UserError, match="symbolic link"):
        _Appender(tmp_path / "results.jsonl")
    with pytest.raises(UserError, match="symbolic link"):
        write_text(tmp_path / "results.jsonl", "x")
    assert target.read_text() == "precious\n"


# ------------------------------------------------------------------------------------------------------------
# Two runs never share a folder

_RACER = """
import sys, time
from pathlib import Path
from rackbed.topology.errors import UserError
from rackbed.topology.outputs import prepare_dir
go, path, default = Path(sys.argv[1]), sys.argv[2], sys.argv[3] == "1"
print("ready", flush=True)
while not go.exists():
    time.sleep(0.001)
try:
    out = prepare_dir(path, default=default)
except UserError as exc:
    print("refused", exc, flush=True)
else:
    print("got", out, flush=True)
    time.sleep(1.5)   # holds the folder (a run writing there) while the others choose
"""


def _race(tmp_path: Path, path: Path, default: bool, n: int = 3) -> list[str]:
    go = tmp_path / "go"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    procs = [subprocess.Popen([sys.executable, "-c", _RACER, str(go), str(path), "1" if default else "0"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
             for _ in range(n)]
    for p in procs:  # every racer imported and waiting
        assert p.stdout.readline().strip() == "ready"
    go.touch()
    return [p.communicate(timeout=60)[0].strip() for p in procs]


@pytest.mark.slow
def test_processes_racing_for_a_default_folder_get_one_each(tmp_path):
    outs = _race(tmp_path, tmp_path / "rackbed-out" / "t", default=True)
    got = sorted(o.split(" ", 1)[1] for o in outs if o.startswith("got "))
    assert len(got) == 3 and len(set(got)) == 3, outs
    assert set(got) == {str(tmp_path / "rackbed-out" / n) for n in ("t", "t-2", "t-3")}


@pytest.mark.slow
def test_processes_racing_for_one_out_folder_one_wins(tmp_path):
    outs = _race(tmp_path, tmp_path / "o", default=False)
    assert sum(o.startswith("got ") for o in outs) == 1, outs
    refused = [o for o in outs if not o.startswith("got ")]
    assert all("another rackbed process is writing there" in o for o in refused), outs


def test_a_resumable_folder_held_by_a_run_is_not_resumed_by_another(tmp_path):
    d = tmp_path / "sweep"
    d.mkdir()
    (d / "results.jsonl").write_text("")
    script = ("import sys, time; from rackbed.topology.outputs import prepare_dir; "
              "prepare_dir(sys.argv[1], resume_marker='results.jsonl'); print('held', flush=True); "
              "time.sleep(30)")
    p = subprocess.Popen([sys.executable, "-c", script, str(d)], stdout=subprocess.PIPE, text=True,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert p.stdout.readline().strip() == "held"
        with pytest.raises(UserError, match="another rackbed process is writing there"):
            prepare_dir(d, resume_marker="results.jsonl")
        assert prepare_dir(d, resume_marker="results.jsonl", default=True) == d.parent / "sweep-2"
    finally:
        p.kill()
        p.wait()
    release_claims()
    assert prepare_dir(d, resume_marker="results.jsonl") == d      # free again once the run ended


def test_threads_racing_for_a_default_folder_get_one_each(tmp_path):
    barrier, got, errors = threading.Barrier(4, timeout=30), [], []

    def racer():
        try:
            barrier.wait()
            got.append(prepare_dir(tmp_path / "d", default=True))
            barrier.wait()  # all chosen while every folder is held
        except Exception as exc:  # noqa: BLE001 — reported below
            errors.append(exc)
        finally:
            release_claims()

    threads = [threading.Thread(target=racer) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(got)) == 4, (errors, got)


@pytest.mark.slow
def test_two_rackbed_runs_started_together_write_to_different_folders(tmp_path):
    _scen(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "rackbed.engine.cli.main", "run", "./s.yaml", "--no-progress"]
    procs = [subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for _ in range(2)]
    logs = [p.communicate(timeout=240)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), logs
    assert sorted(p.name for p in (tmp_path / "rackbed-out").iterdir()) == ["s", "s-2"], logs
    for d in ("s", "s-2"):
        assert (tmp_path / "rackbed-out" / d / "metrics.json").is_file()


# ------------------------------------------------------------------------------------------------------------
# Static: no raw write outside the helpers

SCANNED = ("engine", "sim", "kernels", "topology")
#: (file, the call's source line, stripped) -> why it is not an output write
ALLOWED = {
    ("engine/cli/main.py", "devnull = os.open(os.devnull, os.O_WRONLY)"):
        "stdout to /dev/null on a broken pipe",
    ("kernels/bench/measure.py", "os.unlink(path)"): "its own temporary profiler trace (tempfile.mkstemp)",
    ("sim/sweep.py", "(out / name).unlink(missing_ok=True)  # results files resume: these runs start afresh"):
        "sweep --bench: its own result files in the folder it claimed (prepare_dir, --force to reuse one)",
}


def _raw_writes(path: Path) -> list[tuple[int, str]]:
    """Calls in ``path`` that write or remove files without topology.outputs."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    safe = set()  # names bound to a replacing() file or an in-memory buffer
    for node in ast.walk(tree):
        if isinstance(node, ast.With):
            for it in node.items:
                c = it.context_expr
                if isinstance(c, ast.Call) and _name(c.func) in ("replacing", "BytesIO", "StringIO") \
                        and isinstance(it.optional_vars, ast.Name):
                    safe.add(it.optional_vars.id)
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call) \
                and _name(node.value.func) in ("BytesIO", "StringIO"):
            safe.update(t.id for t in node.targets if isinstance(t, ast.Name))
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f, name = node.func, _name(node.func)
        base = f.value.id if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) else ""
        why = None
        if name == "open" and base != "os":
            mode = _mode(node)
            if not isinstance(mode, str) or set(mode) & set("wax+"):
                why = f"open(mode={mode!r})"
        elif name == "open" and base == "os" and any(
                isinstance(n, ast.Attribute) and n.attr in ("O_WRONLY", "O_RDWR", "O_CREAT", "O_APPEND")
                for n in ast.walk(node)):
            why = "os.open for writing"
        elif name in ("write_text", "write_bytes") and isinstance(f, ast.Attribute) and base != "outputs":
            why = f"Path.{name}"
        elif base in ("json", "pickle", "marshal") and name == "dump":
            why = f"{base}.dump"
        elif base == "yaml" and name in ("dump", "safe_dump") and len(node.args) >= 2:
            why = f"yaml.{name} to a stream"
        elif name == "savefig" and not (node.args and isinstance(node.args[0], ast.Name)
                                        and node.args[0].id in safe):
            why = "savefig to a path"
        elif name in ("to_csv", "to_parquet", "to_json") and (node.args or node.keywords) and base != "self":
            why = f"{name}(path)"
        elif base == "shutil" and name in ("copy", "copy2", "copyfile", "copytree", "move", "rmtree"):
            why = f"shutil.{name}"
        elif base == "os" and name in ("replace", "rename", "remove", "unlink", "rmdir", "symlink", "link"):
            why = f"os.{name}"
        elif isinstance(f, ast.Attribute) and base != "os" and name in (
                "unlink", "rmdir", "rename", "symlink_to", "hardlink_to", "touch"):
            why = f".{name}()"
        elif base in ("np", "numpy", "torch") and name in ("save", "savez", "savez_compressed", "savetxt"):
            why = f"{base}.{name}"
        if why:
            found.append((node.lineno, why))
    return found


def _name(f: ast.expr) -> str:
    return f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""


def _mode(call: ast.Call):
    for k in call.keywords:
        if k.arg == "mode":
            return k.value.value if isinstance(k.value, ast.Constant) else None
    if len(call.args) >= 2:
        a = call.args[1]
        return a.value if isinstance(a, ast.Constant) else None
    return "r"


@pytest.mark.slow
def test_nothing_writes_outside_the_output_helpers():
    bad, used = [], set()
    for top in SCANNED:
        for p in sorted((REPO / top).rglob("*.py")):
            rel = p.relative_to(REPO).as_posix()
            if rel == "topology/outputs.py":
                continue
            lines = p.read_text(encoding="utf-8").splitlines()
            for ln, why in _raw_writes(p):
                key = (rel, lines[ln - 1].strip())
                if key in ALLOWED:
                    used.add(key)
                else:
                    bad.append(f"{rel}:{ln}: {why}: {lines[ln - 1].strip()}")
    assert not bad, ("raw writes (use topology.outputs: prepare_dir / prepare_file / write_text / replacing "
                     "/ open_append):\n" + "\n".join(bad))
    assert used == set(ALLOWED), f"stale ALLOWED entries: {set(ALLOWED) - used}"


def test_the_static_check_sees_raw_writes(tmp_path):
    p = tmp_path / "x.py"
    p.write_text("import json, shutil\nfrom pathlib import Path\n"
                 "open('a', 'w')\nPath('b').write_text('x')\njson.dump({}, f)\nfig.savefig('c.png')\n"
                 "shutil.rmtree('d')\nwith open('e', mode='a') as f: pass\n"
                 "with replacing('g', 'wb') as f:\n    fig.savefig(f)\nopen('h').read()\n")
    assert [ln for ln, _ in _raw_writes(p)] == [3, 4, 5, 6, 7, 8]
