"""Bad serving scenario files give one clear line naming the file, field or line (exit 2, no traceback)."""

from __future__ import annotations

import pytest

from rackbed.engine.cli.main import main

BASE = """kind: serving
name: t
topology: gb200-nvl72
model: qwen3-235b-a22b
weight_format: mxfp8
prefill: {tp: 4, ep: 4, replicas: 1}
decode: {ep: 16, replicas: 1}
workload: {kind: synthetic, arrival: {kind: poisson, rate_per_s: 2}, prompt: {kind: fixed, tokens: 1000},
           output: {kind: fixed, tokens: 20}, n_requests: 20}
"""


def _run(tmp_path, capsys, text: str, name: str = "s.yaml") -> tuple[int, str]:
    p = tmp_path / name
    p.write_text(text)
    rc = main(["run", str(p), "--out", str(tmp_path / "out"), "--no-progress"])
    err = capsys.readouterr().err
    return rc, err


@pytest.mark.parametrize("edit,needle", [
    (lambda s: s.replace("name: t", "name: t\nbogus: 1"), "bogus: unknown key"),
    (lambda s: s.replace("decode: {ep: 16", "decode: {ep: 3"), "ep"),
    (lambda s: s + "slo: {ttft_s: -1}\n", "slo.ttft_s"),
    (lambda s: s.replace("prefill: {tp: 4, ep: 4", "prefill: {tp: 8, ep: 8"), "8 free GPUs in one node"),
    (lambda s: s.replace("model: qwen3-235b-a22b", "model: qwen9"), "qwen9"),
    (lambda s: s.replace("weight_format: mxfp8", "weight_format: fp5"), "weight_format"),
    (lambda s: s.replace("decode: {ep: 16, replicas: 1}", "decode: {ep: 16, replicas: 9}"), "decoder"),
    (lambda s: s.replace("topology: gb200-nvl72", "topology: gb200-nvl72\n  : ["), "s.yaml:"),
    # drafting with a model that has no MTP layers needs the draft stated (the fix is in the message)
    (lambda s: s + "mtp: {draft_k: 1}\n", ("mtp.draft_k: 1 drafts but qwen3-235b-a22b has no MTP layers; add "
                                            "mtp.draft: {kind: mtp, layers: 1}")),
    (lambda s: s + "mtp: {draft_k: 2, acceptance: [0.9], draft: {kind: mtp}}\n", "mtp.acceptance: 1 entries"),
    (lambda s: s + "mtp: {draft_k: 1, acceptance: [1.5], draft: {kind: mtp}}\n", "mtp.acceptance"),
    (lambda s: s + "mtp: {draft_k: 1, draft: {kind: model, model: qwen3.5-122b-a10b}}\n", "mtp.draft.model"),
    (lambda s: s + "mtp: {draft_k: 1, draft: {kind: model, model: qwen9}}\n", "mtp.draft.model: unknown model"),
    (lambda s: s + "mtp: {draft_k: 1, draft: {kind: eagle}}\n", "mtp.draft"),
    (lambda s: s.replace("qwen3-235b-a22b", "qwen3.5-122b-a10b") + "mtp: {draft: {kind: mtp, layers: 2}}\n",
     "mtp.draft.layers: 2 exceeds the 1 MTP layer(s)"),
])
def test_bad_scenarios_fail_in_one_line(tmp_path, capsys, edit, needle):
    rc, err = _run(tmp_path, capsys, edit(BASE))
    assert rc == 2
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("rackbed: error:"), err
    assert "Traceback" not in err
    assert needle in lines[0], lines[0]
    assert "s.yaml" in lines[0], lines[0]


def test_trace_that_does_not_parse_names_file_and_line(tmp_path, capsys):
    bad = tmp_path / "t.csv"
    bad.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\n"
                   "2023-11-16 18:15:50.9951690,abc,25\n")
    text = BASE.replace(
        "workload: {kind: synthetic, arrival: {kind: poisson, rate_per_s: 2}, prompt: {kind: fixed, tokens: 1000},\n"
        "           output: {kind: fixed, tokens: 20}, n_requests: 20}",
        f"workload: {{kind: trace, path: {bad}, format: azure}}")
    rc, err = _run(tmp_path, capsys, text)
    assert rc == 2 and "t.csv:3" in err and "Traceback" not in err, err


def test_good_scenario_runs_and_writes_outputs(tmp_path, capsys):
    rc, _ = _run(tmp_path, capsys, BASE)
    assert rc == 0
    for f in ("metrics.json", "requests.csv", "trace.json"):
        assert (tmp_path / "out" / f).exists()


def test_list_shows_every_shipped_scenario_with_its_one_line_description(capsys):
    """`rackbed run --list`: one line per shipped scenario, the name then its description (serving) or title
    (figures, studies), the second column aligned."""
    import yaml

    from rackbed import scenarios

    assert main(["run", "--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    names = scenarios.available()
    assert [ln.split()[0] for ln in lines] == names
    col = max(map(len, names)) + 2
    for name, line in zip(names, lines):
        doc = yaml.safe_load((scenarios.HERE / f"{name}.yaml").read_text())
        want = " ".join((doc.get("description") or doc.get("title")).split())
        assert line[:col].rstrip() == name and line[col:] == want, line
