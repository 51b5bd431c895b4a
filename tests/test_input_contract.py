"""Every bad input gets one clear answer: exit 2 and one line on stderr naming the file, the field as the user wrote
it and the rule — never a traceback, a minutes-long run into a MemoryError, or a silently different run.

Each test is one input that once went wrong (a vague message, a traceback, or silent acceptance); the property
test over mutated inputs is ``tests/test_input_fuzz.py``.
"""

from __future__ import annotations

import json
import sys
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rackbed.engine.cli.main import main

H200 = """kind: serving
name: t
topology: h200x2
model: qwen3-235b-a22b
model_layers: 16
weight_format: bf16
prefill: {tp: 1, ep: 1, replicas: 1, max_batch_tokens: 8192}
decode: {ep: 1, replicas: 1, max_batch_per_rank: 32}
workload:
  kind: synthetic
  arrival: {kind: poisson, rate_per_s: 4.0}
  prompt: {kind: uniform, lo: 1000, hi: 3000}
  output: {kind: uniform, lo: 32, hi: 128}
  n_requests: 24
  seed: 3
"""

NVL72 = """kind: serving
topology: gb200-nvl72
model: qwen3-235b-a22b
weight_format: mxfp8
prefill: {tp: 4, ep: 4, replicas: 2}
decode: {ep: 16, replicas: 1}
workload: {kind: synthetic, arrival: {kind: poisson, rate_per_s: 2}, prompt: {kind: fixed, tokens: 1000},
           output: {kind: fixed, tokens: 20}, n_requests: 20}
"""

MOONCAKE_ROW = '{"timestamp": %s, "input_length": %s, "output_length": 5}\n'


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main([str(a) for a in argv])
    cap = capsys.readouterr()
    return rc, cap.out, cap.err


def one_line_error(capsys, *argv, needles=()) -> str:
    """Run the CLI in-process; assert exit 2 and exactly one stderr line that contains every needle."""
    rc, _, err = cli(capsys, *argv)
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("rackbed: error: "), err
    for n in needles:
        assert str(n) in lines[0], (n, lines[0])
    return lines[0]


def run_scenario(tmp_path, capsys, text: str, *needles, where: str = "s.yaml") -> str:
    """``rackbed run`` of scenario ``text``: one line naming the file ``where`` (the scenario or one it names)."""
    p = tmp_path / "s.yaml"
    p.write_text(text)
    return one_line_error(capsys, "run", p, "--out", tmp_path / "out", "--no-progress",
                          needles=(tmp_path / where, *needles))


# ----------------------------------------------------------------------------------------------- scenarios


def test_prefill_ep_above_tp_names_the_fields_as_written(tmp_path, capsys):
    line = run_scenario(tmp_path, capsys, NVL72.replace("prefill: {tp: 4, ep: 4", "prefill: {tp: 1, ep: 4"),
                        "prefill.ep: 4", "prefill.tp: 1")
    assert "dp" not in line  # not a quantity the user wrote


def test_boolean_where_a_number_belongs(tmp_path, capsys):
    run_scenario(tmp_path, capsys, H200.replace("prefill: {tp: 1,", "prefill: {tp: true,"), "prefill", "tp",
                 "boolean")


@pytest.mark.parametrize("cmd,shipped,old,new,field", [
    ("plan", "scenarios/plans/h200-tp4-prefill-ep8-decode.yaml", "  tp: 4", "  tp: true", "tp"),
    ("topo", "scenarios/topologies/h200x2-lab.yaml", "n_links: 18", "n_links: true", "n_links"),
])
def test_boolean_where_a_number_belongs_in_plans_and_topologies(tmp_path, capsys, cmd, shipped, old, new, field):
    from pathlib import Path

    p = tmp_path / "f.yaml"
    p.write_text((Path(__file__).resolve().parents[1] / shipped).read_text().replace(old, new, 1))
    one_line_error(capsys, cmd, "check", p, needles=(p, field, "boolean"))


def test_zero_decoders_without_autoscaler(tmp_path, capsys):
    run_scenario(tmp_path, capsys, H200.replace("decode: {ep: 1, replicas: 1", "decode: {ep: 1, replicas: 0"),
                 "decode.replicas: 0")


def test_prompts_beyond_any_context(tmp_path, capsys):
    run_scenario(tmp_path, capsys, H200.replace("lo: 1000, hi: 3000", "lo: 1000, hi: 3000000"),
                 "prompt", "hi", "1,048,576")


def _build(text: str):
    from rackbed.sim.scenario import build, parse_scenario
    from rackbed.topology.yamlio import parse_yaml

    return build(parse_scenario(parse_yaml(text, "s.yaml")))


def test_batch_budget_below_every_prompt_is_a_caveat():
    # allowed (the scheduler admits a prompt above the budget alone and whole; a search may price it), but said
    b = _build(H200.replace("max_batch_tokens: 8192", "max_batch_tokens: 1"))
    assert "prefill.max_batch_tokens: 1 is below every prompt (workload.prompt.lo: 1000)" in b.caveats[-1]
    assert not any("max_batch_tokens" in c for c in _build(H200).caveats)
    chunked = _build(H200.replace("max_batch_tokens: 8192", "max_batch_tokens: 1") + "sim: {chunked_prefill: true}\n")
    assert not any("max_batch_tokens" in c for c in chunked.caveats)


def test_request_beyond_the_model_context(tmp_path, capsys):
    # qwen3-235b-a22b serves 40,960 tokens (prompt + output; 131,072 only with YaRN): 41,000 + 128 cannot fit
    run_scenario(tmp_path, capsys, H200.replace("lo: 1000, hi: 3000", "lo: 1000, hi: 41000"),
                 "workload.prompt.hi", "workload.output.hi", "41,128", "40,960-token context", "qwen3-235b-a22b")


@settings(max_examples=40, deadline=None, derandomize=True)
@given(prompt=st.integers(1, 60_000), output=st.integers(1, 30_000))
def test_fixed_lengths_error_exactly_when_they_exceed_the_context(prompt, output):
    from rackbed.engine.core.model import get_model
    from rackbed.sim.scenario import parse_scenario
    from rackbed.sim.scenario_checks import context_check
    from rackbed.topology.errors import UserError
    from rackbed.topology.yamlio import parse_yaml

    text = NVL72.replace("prompt: {kind: fixed, tokens: 1000}", f"prompt: {{kind: fixed, tokens: {prompt}}}").replace(
        "output: {kind: fixed, tokens: 20}", f"output: {{kind: fixed, tokens: {output}}}")
    sc = parse_scenario(parse_yaml(text, "s.yaml"))
    if prompt + output > 40960:
        with pytest.raises(UserError, match=r"^workload\.prompt\.tokens \+ workload\.output\.tokens: .*40,960"):
            context_check(sc, get_model(sc.model))
    else:
        assert context_check(sc, get_model(sc.model)) == []


def test_trace_requests_beyond_the_model_context_are_a_caveat(tmp_path):
    # a trace is data (shipped scenarios replay Mooncake, whose longest requests exceed Qwen3's native context):
    # the run goes on and says how many requests exceed it and by how much
    trace = tmp_path / "t.jsonl"
    trace.write_text(MOONCAKE_ROW % (0, 100) + MOONCAKE_ROW % (10, 50_000) + MOONCAKE_ROW % (20, 45_000))
    b = _build(H200.split("workload:")[0] + f"workload: {{kind: trace, path: {trace}}}\n")
    assert [c for c in b.caveats if "context" in c] == [
        "workload: 2 of 3 requests exceed the 40,960-token context of qwen3-235b-a22b[:16] (prompt + output, the "
        "largest 50,005); they are simulated whole, as if the model served them"]
    # an unbounded log-normal is judged on the requests it draws (the run's own stream), as a trace is
    tail = _build(H200.replace("{kind: uniform, lo: 1000, hi: 3000}", "{kind: lognormal, p50: 20000, p90: 40000}"))
    assert any(c.startswith("workload: ") and "exceed the 40,960-token context" in c for c in tail.caveats)
    assert not any("context" in c for c in _build(H200).caveats)
    # a long run's stream is judged on its first CONTEXT_SAMPLE requests (the rest would cost a second generation)
    import rackbed.sim.scenario_checks as checks

    mp = pytest.MonkeyPatch()
    mp.setattr(checks, "CONTEXT_SAMPLE", 2)
    try:
        capped = _build(H200.split("workload:")[0] + f"workload: {{kind: trace, path: {trace}}}\n")
    finally:
        mp.undo()
    assert [c for c in capped.caveats if "context" in c] == [
        "workload: 1 of the first 2 requests exceed the 40,960-token context of qwen3-235b-a22b[:16] (prompt + "
        "output, the largest 50,005); they are simulated whole, as if the model served them"]


def test_duplicate_yaml_key(tmp_path, capsys):
    run_scenario(tmp_path, capsys, H200.replace("  seed: 3\n", "  seed: 3\n  seed: 4\n"),
                 "duplicate key 'seed'", "line 16")


@pytest.mark.parametrize("field", ["n_requests: 1000000000000000", "n_requests: 1.0e+15"])
def test_request_count_bounded(tmp_path, capsys, field):
    run_scenario(tmp_path, capsys, H200.replace("n_requests: 24", field), "n_requests", "10,000,000")


def test_request_count_of_a_duration_bounded(tmp_path, capsys):
    text = H200.replace("n_requests: 24", "duration_s: 1.0e+9")
    run_scenario(tmp_path, capsys, text, "workload.duration_s x workload.arrival.rate_per_s", "10,000,000")


def test_max_requests_of_a_trace_bounded(tmp_path, capsys):
    (tmp_path / "t.jsonl").write_text("".join(MOONCAKE_ROW % (i * 100, 100) for i in range(3)))
    text = H200.split("workload:")[0] + "workload: {kind: trace, path: t.jsonl, max_requests: 1.0e+15}\n"
    run_scenario(tmp_path, capsys, text, "max_requests", "10,000,000")


def test_deeply_nested_scenario(tmp_path, capsys):
    run_scenario(tmp_path, capsys, H200 + "real: " + "[" * 100_000 + "]" * 100_000 + "\n")


def test_nvfp4_on_hopper_says_it_is_emulated():
    b = _build(H200.replace("weight_format: bf16", "weight_format: nvfp4"))
    assert "nvfp4 has no tensor-core support on H200-SXM (Hopper)" in b.caveats[0]
    assert not any("tensor-core support" in c for c in _build(H200).caveats)


# ----------------------------------------------------------------------------------------------- traces


@pytest.mark.parametrize("value", ["100000000000000000000000", "1e23"])
def test_trace_token_count_beyond_int64(tmp_path, capsys, value):
    trace = tmp_path / "t.jsonl"
    trace.write_text(MOONCAKE_ROW % (0, 100) + MOONCAKE_ROW % (10, value) + MOONCAKE_ROW % (20, 100))
    text = H200.split("workload:")[0] + "workload: {kind: trace, path: t.jsonl}\n"
    one = run_scenario(tmp_path, capsys, text, "t.jsonl:2: input_length", where="t.jsonl")
    assert "Traceback" not in one


def test_trace_line_nested_too_deeply(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    trace.write_text(MOONCAKE_ROW % (0, 100) + "[" * 100_000 + "]" * 100_000 + "\n")
    text = H200.split("workload:")[0] + "workload: {kind: trace, path: t.jsonl}\n"
    run_scenario(tmp_path, capsys, text, "t.jsonl:2: nested too deeply", where="t.jsonl")


# ----------------------------------------------------------------------------------------------- other files


BINARY = bytes(range(256)) * 4


@pytest.mark.parametrize("argv,name,rule", [
    (("plan", "check"), "p.yaml", "not a text file"),
    (("topo", "check"), "t.yaml", "not a text file"),
    (("model", "show"), "config.json", "not a text file"),
    (("validate", "--measurements"), "m.json", "not a text file"),  # read as UTF-8 text, as every input file
    (("calibrate", "--from-measurements"), "m.json", "not a text file"),
])
def test_binary_file_names_the_file(tmp_path, capsys, argv, name, rule):
    p = tmp_path / name
    p.write_bytes(b"\x00\x01" + BINARY)
    extra = ("--out", tmp_path / "c.yaml") if argv[0] == "calibrate" else ()
    one_line_error(capsys, *argv, p, *extra, needles=(p, rule))


@pytest.mark.parametrize("argv,name", [
    (("topo", "check"), "t.json"),
    (("model", "show"), "config.json"),
    (("validate", "--measurements"), "m.json"),
    (("plan", "check"), "p.yaml"),
])
def test_deeply_nested_json_names_the_file(tmp_path, capsys, argv, name):
    p = tmp_path / name
    p.write_text("[" * 100_000 + "]" * 100_000)
    one_line_error(capsys, *argv, p, needles=(p, "nested too deeply"))


def test_validate_engine_missing_folder_fails_before_any_output(tmp_path, capsys):
    rc, out, err = cli(capsys, "validate", "--engine", tmp_path / "missing")
    assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert str(tmp_path / "missing") in err and "real.json" in err


def test_hf_config_layer_count_bounded_at_once(tmp_path, capsys):
    from test_model_hf import QWEN3_235B_CONFIG

    p = tmp_path / "config.json"
    p.write_text(json.dumps({**QWEN3_235B_CONFIG, "num_hidden_layers": 10**9}))
    t0 = time.perf_counter()
    one_line_error(capsys, "model", "show", p, needles=(p, "num_hidden_layers", "10,000"))
    assert time.perf_counter() - t0 < 5


@pytest.mark.parametrize("key", ["num_experts", "vocab_size", "hidden_size"])
def test_hf_config_sizes_bounded(tmp_path, capsys, key):
    from test_model_hf import QWEN3_235B_CONFIG

    p = tmp_path / "config.json"
    p.write_text(json.dumps({**QWEN3_235B_CONFIG, key: 10**12}))
    one_line_error(capsys, "model", "show", p, needles=(p, key, "at most"))


ENGINE_CAL = """version: 1
kind: engine
gpu: H200-SXM
model: qwen3-235b-a22b[:16]
decode_step_s: [[1.0, 0.008], [2.0, {bad}]]
prefill_s: [0.029, 3.2e-05]
kv_transfer_s: [0.01, 4.9e-06]
"""


@pytest.mark.parametrize("bad", ["-0.9997", ".nan", ".inf"])
def test_engine_calibration_rejects_negative_and_non_finite(tmp_path, bad):
    from rackbed.sim.engine_calibration import find_engine_calibration
    from rackbed.topology.errors import UserError

    p = tmp_path / "engine-H200-SXM-x.yaml"
    p.write_text(ENGINE_CAL.format(bad=bad))
    # found automatically: a broken file must stop the run, not be skipped or price it
    with pytest.raises(UserError, match=r"engine-H200-SXM-x\.yaml: decode_step_s.*decode_step_s\[1\].*finite and >= 0"):
        find_engine_calibration("H200-SXM", "qwen3-235b-a22b[:16]", directory=tmp_path)


def test_kernel_calibration_non_finite_point(tmp_path, capsys):
    cal = tmp_path / "cal.yaml"
    cal.write_text("version: 2\nentries:\n- {kind: hbm_GBps, gpu: H200-SXM, points: [[1.0, .nan]]}\n")
    run_scenario(tmp_path, capsys, H200 + f"calibration: {cal}\n", "entries[0].points", where="cal.yaml")


# ----------------------------------------------------------------------------------------------- the process


class _ClosedPipe:
    """stdout whose reader has gone (``rackbed ... | head``)."""

    def write(self, s):
        raise BrokenPipeError(32, "Broken pipe")

    def flush(self):
        raise BrokenPipeError(32, "Broken pipe")


def test_broken_pipe_is_quiet(monkeypatch, capsys):
    monkeypatch.setattr(sys, "stdout", _ClosedPipe())
    rc = main(["topo", "show", "hgx-h200", "--json"])
    assert rc == 141 and capsys.readouterr().err == ""


def test_real_without_torch_says_what_to_install(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch -> ModuleNotFoundError(name='torch')
    p = tmp_path / "s.yaml"
    p.write_text(H200)
    one_line_error(capsys, "real", p, needles=("pip install 'rackbed[real]'",))
