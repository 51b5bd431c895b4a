"""``rackbed emit`` writes scenario text into shell scripts and YAML (sim/emit.py): none of it may run, add a line
or change what a file says.

The text that reaches an emitted file is the scenario's ``name`` (comments; the Dynamo object name), its ``model``
(the default checkpoint, ``MODEL_PATH``; comments) and a draft model's ``mtp.draft.model`` (comments). The
properties feed arbitrary text into those fields (newlines and other line breaks, ``$(touch CANARY)``, backticks,
quotes, ``;``, YAML document markers, placeholders, unicode):

* at the plan level (no input check: quoting alone must hold), every emitted ``launch.sh`` runs under ``bash`` in
  a throwaway directory with every command it invokes a stub that logs its arguments: no canary file appears, the
  stubs see exactly the commands of a plain scenario with the model path in place, and every YAML file parses to
  the same documents (the Dynamo name an RFC 1123 label of the scenario name) with as many lines;
* at the input (the CLI on a scenario file, the model and draft model ``config.json`` files in folders named by
  the text): a control or line-break character in a field is refused in one line (exit 2), anything else is
  emitted and runs as above.

Plus the regressions themselves and ``SCENARIO`` resolution: a bare name is the shipped scenario whatever the
working directory holds (``rackbed emit`` and ``rackbed run``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import subprocess
import tempfile
import unicodedata
from functools import cache
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from rackbed import scenarios
from rackbed.engine.cli.main import main
from rackbed.sim.emit import ENGINES, REFUSED_CATEGORIES, check_text, dns_label, emit_files, plan_of, render
from rackbed.sim.scenario import load_scenario, parse_scenario
from rackbed.topology.errors import UserError
from rackbed.topology.yamlio import load_yaml

BASH = shutil.which("bash")
pytestmark = pytest.mark.skipif(BASH is None, reason="no bash")

#: every command an emitted script runs (stubs), and a few it might be made to run
STUBS = ("python", "python3", "trtllm-serve", "trtllm-llmapi-launch", "sglang", "mpirun", "srun", "dynamo",
         "kubectl", "env", "sh")
CANARY = "CANARY"
#: fragments the injected text is made of, besides arbitrary characters
NASTY = (f"$(touch {CANARY})", f"`touch {CANARY}`", f"\ntouch {CANARY}\n", f"\n>{CANARY}\n", f"';touch {CANARY};'",
         f'";touch {CANARY};"', f"$(>{CANARY})", f"\r\n>{CANARY}", f"\u2028>{CANARY}", f"\x85>{CANARY}", "\n---\n",
         "\n...\n", "\napiVersion: v1\nkind: Pod\nspec: {hostPID: true}\n", "\nevil: 1\n", "${HOST_0}",
         "${MODEL_PATH}", "}", "'", '"', "\\", ";", "&", "|", "*", "~", "#", " ", "\t", "é", "\u202e", "😀", "-")
TEXT = st.lists(st.one_of(st.sampled_from(NASTY), st.text(st.characters(exclude_categories=("Cs",),
                                                                        exclude_characters="\0"), max_size=8)),
                max_size=5).map("".join)
REF = {"name": "ref-scenario", "model_id": "ref/model", "draft_model": "ref/draft"}

#: the Qwen3-235B-A22B preset as a Hugging Face config.json (the model and draft of the input-level property)
QWEN3_235B = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 4096,
              "num_hidden_layers": 94, "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 128,
              "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 1536,
              "intermediate_size": 12288, "vocab_size": 151936, "tie_word_embeddings": False,
              "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True,
              "max_position_embeddings": 40960, "torch_dtype": "bfloat16"}


def _shipped(name: str) -> Path:
    return scenarios.HERE / f"{name}.yaml"  # whatever the working directory holds


def _small_disagg() -> dict:
    """i_h200_mooncake on two nodes: two TP4 prefillers, one EP8 decoder, an MTP head it lacks, no autoscaler."""
    d = load_yaml(_shipped("i_h200_mooncake"))
    d.update(topology="hgx-h200*2", autoscaler=None)
    d["prefill"] = {**d["prefill"], "replicas": 2}
    return d


def _with_draft_model(d: dict, model: str = "qwen3-30b-a3b") -> dict:
    return {**d, "mtp": {"draft_k": 2, "draft": {"kind": "model", "model": model}}}


#: the scenarios the plan-level property starts from: multi-node groups, aggregated, draft models
BASES = {
    "nvl72-default": lambda: load_yaml(_shipped("nvl72-default")),
    "agg_h200_node": lambda: load_yaml(_shipped("agg_h200_node")),
    "disagg-draft-model": lambda: _with_draft_model(_small_disagg()),
    "agg-draft-model": lambda: _with_draft_model(load_yaml(_shipped("agg_h200_node"))),
}


@cache
def _base(key: str):
    sc = parse_scenario(BASES[key](), key)
    return sc, plan_of(sc)


@pytest.fixture(scope="module")
def stubs(tmp_path_factory) -> Path:
    """A folder of stub executables (each logs its name and arguments to $STUB_LOG, exits 0) and a real ``touch``
    (so that an injected ``touch CANARY`` would work)."""
    d = tmp_path_factory.mktemp("stubs")
    for name in STUBS:
        p = d / name
        p.write_text(f'#!{BASH}\nprintf \'%s\\0\' "$#" "${{0##*/}}" "$@" >> "$STUB_LOG"\n')
        p.chmod(0o755)
    (d / "touch").symlink_to(shutil.which("touch"))
    return d


def _run_script(script: Path, stubs: Path, env: dict | None = None) -> list[list[str]]:
    """Run ``script`` under bash in its folder with only the stubs on PATH; the commands the stubs saw. Fails when
    the script errs, prints to stderr, or a canary file appears."""
    cwd = script.parent
    log = cwd / "stub.log"
    log.write_bytes(b"")
    r = subprocess.run([BASH, script.name], cwd=cwd, capture_output=True, text=True, timeout=60, check=False,
                       env={"PATH": str(stubs), "STUB_LOG": str(log), "HOME": str(cwd), **(env or {})})
    assert not list(cwd.rglob(f"*{CANARY}*")), f"{script.name} created a canary file"
    assert r.returncode == 0 and not r.stderr, (r.returncode, r.stderr)
    fields, calls = log.read_bytes().split(b"\0")[:-1], []
    while fields:
        n = int(fields[0])
        calls.append([f.decode() for f in fields[1:n + 2]])
        fields = fields[n + 2:]
    return calls


def _escaped(text: str) -> str:
    """How a comment line shows ``text``: non-printable characters as their Python escapes."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _is_dns_label(label: str) -> bool:
    return re.fullmatch(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?", label) is not None


def _model_args(calls: list[list[str]]) -> list[str]:
    """The checkpoint each engine server was given (SGLang ``--model-path``, ``trtllm-serve MODEL``)."""
    return [c[c.index("--model-path") + 1] if "--model-path" in c else c[1] for c in calls
            if "--model-path" in c or (c[0] == "trtllm-serve" and c[1] != "disaggregated")]


def _write(files: dict[str, str], folder: Path) -> None:
    for name, text in files.items():
        (folder / name).write_text(text, encoding="utf-8")


@cache
def _reference(key: str, engine: str, stubs: Path):
    """The files of the plain plan (:data:`REF` text) and the commands its scripts run."""
    sc, pl = _base(key)
    files = render(sc, dataclasses.replace(pl, **REF), engine)
    with tempfile.TemporaryDirectory() as tmp:
        _write(files, Path(tmp))
        calls = {n: _run_script(Path(tmp) / n, stubs) for n in files if n.endswith(".sh")}
    return files, calls


def _check_files(files: dict, ref_files: dict, ref_calls: dict, name: str, model: str, stubs: Path,
                 draft: str | None = None) -> None:
    """The emitted ``files`` say what the reference files say, with ``name`` / ``model`` / ``draft`` in place."""
    assert sorted(files) == sorted(ref_files)
    with tempfile.TemporaryDirectory() as tmp:
        _write(files, Path(tmp))
        for fname, text in files.items():
            ref, lines = ref_files[fname], text.split("\n")
            if fname.endswith(".sh"):  # the model path's own newlines are inside its quotes
                assert len(lines) - model.count("\n") == len(ref.split("\n")), f"{fname}: a line was added"
                calls = _run_script(Path(tmp) / fname, stubs)
                assert calls == [[model if a == REF["model_id"] else a for a in c] for c in ref_calls[fname]]
                assert lines[1].startswith(f"# {_escaped(name)}: ")
            else:
                assert len(lines) == len(ref.split("\n")), f"{fname}: a line was added"
                docs, ref_docs = list(yaml.safe_load_all(text)), list(yaml.safe_load_all(ref))
                assert len(docs) == len(ref_docs) == 1
                if docs[0].get("kind") == "DynamoGraphDeployment":
                    label = docs[0]["metadata"]["name"]
                    assert label == dns_label(name) and _is_dns_label(label)
                    docs[0]["metadata"]["name"] = ref_docs[0]["metadata"]["name"]
                    assert lines[0].startswith(f"# {_escaped(name)} as a Dynamo ")
                    assert lines[0].endswith(f"(e.g. {_escaped(model)})")
                assert docs == ref_docs
            if draft is not None:
                assert f"draft model {_escaped(draft)} (mtp.draft)" in text


@pytest.mark.slow
@settings(max_examples=40, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(key=st.sampled_from(sorted(BASES)), name=TEXT, model=TEXT, draft=TEXT)
def test_any_text_is_quoted_for_its_file(stubs, key, name, model, draft):
    """Quoting alone (the input check bypassed): whatever the name, model path and draft model hold, the scripts
    run the same commands (the model path reaching them exactly) and create nothing; the YAML says the same."""
    sc, pl = _base(key)
    has_draft = pl.draft_kind == "model"
    injected = dataclasses.replace(pl, name=name, model_id=model, draft_model=draft if has_draft else None)
    for engine in ENGINES:
        ref_files, ref_calls = _reference(key, engine, stubs)
        _check_files(render(sc, injected, engine), ref_files, ref_calls, name, model, stubs,
                     draft if has_draft else None)


def _refused(text: str) -> bool:
    return any(unicodedata.category(c) in REFUSED_CATEGORIES for c in text)


@pytest.mark.slow
@settings(max_examples=200, deadline=None, derandomize=True)
@given(text=st.one_of(TEXT, st.text()))
def test_control_and_line_break_characters_are_refused_in_one_line(text):
    if _refused(text):
        with pytest.raises(UserError) as e:
            check_text("name", text, "s.yaml")
        msg = str(e.value)
        assert msg.startswith("s.yaml: name: ") and "\n" not in msg and msg.isprintable()
    else:
        check_text("name", text, "s.yaml")


#: text that passes the input check (no control or line-break character) and text that may not
ACCEPTED = st.lists(st.one_of(st.sampled_from([f for f in NASTY if not _refused(f)]), st.text(st.characters(
    exclude_categories=tuple(REFUSED_CATEGORIES)), max_size=6)), max_size=4).map("".join)
ANY = st.one_of(ACCEPTED, ACCEPTED, TEXT)
DIR_TEXT = ANY.map(lambda t: t.replace("/", "|").replace("\0", ""))  # a folder name


@pytest.mark.slow
@settings(max_examples=20, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(engine=st.sampled_from(ENGINES), name=ANY, model_dir=DIR_TEXT, draft_dir=DIR_TEXT)
def test_cli_refuses_or_quotes_scenario_text(stubs, capsys, engine, name, model_dir, draft_dir):
    """Through the CLI: the scenario file's name and the model / draft model config.json paths (folders named by
    the text) are refused in one line when they hold a control or line-break character, else emitted, and the
    scripts run the engine on exactly that model path."""
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        paths = []
        for i, d in enumerate((model_dir, draft_dir)):
            folder = tmp / f"m{i}{d}"
            folder.mkdir()
            (folder / "config.json").write_text(json.dumps(QWEN3_235B))
            paths.append(str(folder / "config.json"))
        data = _with_draft_model({**_small_disagg(), "name": name, "model": paths[0]}, paths[1])
        (tmp / "s.yaml").write_text(yaml.safe_dump(data, allow_unicode=True), encoding="utf-8")
        out = tmp / "out"
        rc = main(["emit", str(tmp / "s.yaml"), "--engine", engine, "--out", str(out)])
        err = capsys.readouterr().err
        refused = any(_refused(t) for t in (name, *paths))
        event("refused" if refused else "emitted")
        if refused:
            assert rc == 2 and len(err.splitlines()) == 1 and err.startswith(f"rackbed: error: {tmp / 's.yaml'}: ")
            assert not out.exists()
            return
        assert rc == 0, err
        for script in out.glob("*.sh"):
            # the checkpoint folder (the engines load a folder, not its config.json): two prefillers, one decoder
            assert _model_args(_run_script(script, stubs)) == [os.path.dirname(paths[0])] * 3
        for f in out.glob("*.yaml"):
            assert len(list(yaml.safe_load_all(f.read_text(encoding="utf-8")))) == 1


# ------------------------------------------------------------------------------------------------ regressions


def _scenario_file(tmp_path: Path, **upd) -> Path:
    p = tmp_path / "s.yaml"
    p.write_text(yaml.safe_dump({**_small_disagg(), **upd}, allow_unicode=True), encoding="utf-8")
    return p


@pytest.mark.parametrize("field", ["name", "model", "draft"])
def test_a_newline_in_name_or_path_is_one_line_exit_2(tmp_path, capsys, field):
    folder = tmp_path / f"x\ntouch {CANARY}"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(QWEN3_235B))
    cfg = str(folder / "config.json")
    upd = ({"name": f"x\ntouch {CANARY}"} if field == "name" else {"model": cfg} if field == "model" else
           {"mtp": {"draft_k": 1, "draft": {"kind": "model", "model": cfg}}})
    for engine in ENGINES:
        rc = main(["emit", str(_scenario_file(tmp_path, **upd)), "--engine", engine, "--out", str(tmp_path / "o")])
        err = capsys.readouterr().err
        assert rc == 2 and len(err.strip().splitlines()) == 1 and "holds '\\n'" in err, err
        assert "Traceback" not in err and not (tmp_path / "o").exists()


@pytest.mark.parametrize("payload", [f"$(touch {CANARY})", f"`touch {CANARY}`", f"a'$(touch {CANARY})'b"])
def test_a_model_path_with_command_substitution_is_inert(tmp_path, capsys, stubs, payload):
    folder = tmp_path / payload
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(QWEN3_235B))
    cfg = str(folder / "config.json")
    for engine in ("sglang", "trtllm"):
        out = tmp_path / engine
        assert main(["emit", str(_scenario_file(tmp_path, model=cfg)), "--engine", engine, "--out", str(out)]) == 0
        assert _model_args(_run_script(out / "launch.sh", stubs)) == [str(folder)] * 3
        # MODEL_PATH set by the user still wins
        assert _model_args(_run_script(out / "launch.sh", stubs, env={"MODEL_PATH": "/ckpt dir/m"})) == (
            ["/ckpt dir/m"] * 3)
    capsys.readouterr()


def test_injected_names_add_no_yaml_document_or_key():
    """The plan-level form of the regressions: a Pod document in the name, a top-level key in the draft path."""
    sc, pl = _base("disagg-draft-model")
    bad = dataclasses.replace(pl, name="x\n---\napiVersion: v1\nkind: Pod\nspec: {hostPID: true}",
                              draft_model="d\nevil: 1\n\u2028evil2: 2")
    g = list(yaml.safe_load_all(render(sc, bad, "dynamo")["graph.yaml"]))
    assert len(g) == 1 and g[0]["kind"] == "DynamoGraphDeployment" and _is_dns_label(g[0]["metadata"]["name"])
    for f, text in render(sc, bad, "trtllm").items():
        if f.endswith(".yaml"):
            assert not {"evil", "evil2"} & set(yaml.safe_load(text)), f


def test_shipped_scenarios_keep_their_files(tmp_path):
    """Quoting changes nothing for plain text: a shipped scenario's script defaults MODEL_PATH to its Hugging Face
    id as a plain word, and its name and model read back verbatim."""
    sc = load_scenario(scenarios.resolve("nvl72-default"))
    text = emit_files(sc, "sglang")["launch.sh"]
    assert text.splitlines()[:3] == [
        "#!/usr/bin/env bash",
        ("# nvl72-default: 6 prefill + 3 decode groups (emitted by `rackbed emit`). Run each command on the host "
         "it names; set HOST_<n> to the topology's hosts."),
        '[ -n "${MODEL_PATH:-}" ] || MODEL_PATH=Qwen/Qwen3-235B-A22B']
    assert '--model-path "${MODEL_PATH}"' in text and '"http://${HOST_0}:30000"' in text


# ------------------------------------------------------------------------------------------------ SCENARIO names


@pytest.fixture
def decoys(tmp_path, monkeypatch):
    """A working directory holding a folder and a file named like shipped scenarios."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "nvl72-default").mkdir()
    (tmp_path / "i_h200_mooncake").write_text("name: not a scenario\n")
    (tmp_path / "fig_allreduce_nvls").mkdir()
    return tmp_path


def test_emit_name_is_the_shipped_scenario(decoys, capsys):
    for name in ("nvl72-default", "i_h200_mooncake"):
        assert main(["emit", name, "--engine", "trtllm", "--out", str(decoys / "o" / name)]) == 0
        assert "# no equivalent:" in (decoys / "o" / name / "ctx.yaml").read_text()
    capsys.readouterr()
    # an explicit path is still the path: the folder and the file here
    assert main(["emit", "./nvl72-default", "--engine", "sglang", "--out", str(decoys / "p")]) == 2
    assert "is a directory" in capsys.readouterr().err
    assert main(["emit", "./i_h200_mooncake", "--engine", "sglang", "--out", str(decoys / "p")]) == 2
    assert "i_h200_mooncake: topology: Field required" in capsys.readouterr().err


def test_emit_reads_a_named_yaml_file_here(decoys, capsys):
    d = _small_disagg()
    (decoys / "nvl72-default.yaml").write_text(yaml.safe_dump({**d, "name": "mine"}))
    (decoys / "mine").write_text(yaml.safe_dump({**d, "name": "mine-bare"}))  # no shipped `mine`: the file
    for arg, name in (("nvl72-default.yaml", "mine"), ("mine", "mine-bare")):
        assert main(["emit", arg, "--engine", "sglang", "--out", str(decoys / "o" / arg)]) == 0
        assert (decoys / "o" / arg / "launch.sh").read_text().splitlines()[1].startswith(f"# {name}: ")
    capsys.readouterr()


def test_run_name_is_the_shipped_scenario(decoys, capsys):
    """``rackbed run`` resolves the same way: the shipped figure scenario (which refuses --rate), not the folder."""
    assert main(["run", "fig_allreduce_nvls", "--rate", "1"]) == 2
    err = capsys.readouterr().err
    assert "fig_allreduce_nvls.yaml is a figure file" in err and "directory" not in err
    assert main(["run", "./fig_allreduce_nvls", "--rate", "1"]) == 2
    assert "is a directory" in capsys.readouterr().err


def test_every_command_resolves_a_bare_name_to_the_shipped_scenario(decoys, capsys):
    """One resolver for every command that takes a scenario (run, emit, real, trace, search --max-rate, sweeps,
    figure references): a bare name beside a same-named folder or file is still the shipped file."""
    from rackbed import scenarios

    for name in ("nvl72-default", "i_h200_mooncake", "fig_allreduce_nvls"):
        assert scenarios.resolve(name) == scenarios.HERE / f"{name}.yaml"
    assert scenarios.resolve("./i_h200_mooncake") == Path("./i_h200_mooncake")  # a path stays a path
    assert main(["trace", "stats", "i_h200_mooncake"]) == 0
    capsys.readouterr()
