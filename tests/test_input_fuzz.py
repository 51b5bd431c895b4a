"""The input contract as a property: whatever a user feeds the CLI, it either succeeds or exits 2 with exactly one
line on stderr naming the file — never a traceback, never an unhandled exception.

Each test takes one valid input the project ships or tests with (a serving scenario, a topology file, a plan, a
sweep spec, a Mooncake trace, a Hugging Face config.json, a measurement file, a calibration file), mutates it —
a wrong type, an unknown key, a deleted key, an out-of-range or huge number, NaN / inf, a boolean, deep nesting, a
duplicated YAML key, binary bytes, truncated text — and runs the CLI in-process (``engine.cli.main.main``) on it.
The examples are derandomized and bounded (about 200 in all, well under a minute on one core). A scenario that
survives its mutation is simulated for real; only the output files (plots, CSVs: not inputs) are not written.
The named regressions behind this are ``tests/test_input_contract.py``.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import math
import tempfile
from pathlib import Path
from unittest import mock

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rackbed.engine.cli.main import main

ROOT = Path(__file__).resolve().parents[1]

SCENARIO = {
    "kind": "serving", "name": "fuzz", "seed": 0, "topology": "h200x2", "model": "qwen3-235b-a22b",
    "model_layers": 16, "weight_format": "bf16", "kv_dtype": "bf16",
    "prefill": {"tp": 1, "ep": 1, "replicas": 1, "max_batch_tokens": 8192, "kv_streams": 1},
    "decode": {"ep": 1, "replicas": 1, "max_batch_per_rank": 32, "page_tokens": 64},
    "workload": {"kind": "synthetic", "arrival": {"kind": "poisson", "rate_per_s": 4.0},
                 "prompt": {"kind": "uniform", "lo": 1000, "hi": 3000},
                 "output": {"kind": "uniform", "lo": 8, "hi": 32}, "n_requests": 4, "seed": 3},
    "slo": {"ttft_s": 1.0, "tpot_s": 0.05}, "sim": {"decision_log": False},
}
TRACE_ROWS = [{"timestamp": 0, "input_length": 1358, "output_length": 20, "hash_ids": [0, 1, 2]},
              {"timestamp": 40, "input_length": 722, "output_length": 9, "hash_ids": [0, 3]},
              {"timestamp": 95, "input_length": 200, "output_length": 12, "hash_ids": [4]}]
MEASUREMENTS = {
    "schema": "rackbed.measure/2", "env": {"gpu_name": "NVIDIA H200", "date": "2026-11-30"},
    "rows": [{"bench": "gemm", "op": "grouped", "fmt": "bf16", "m": m, "n": 3072, "k": 4096, "n_experts": 4,
              "median_us": 30.0 + m} for m in (1, 2, 4, 8, 16, 32)]
    + [{"bench": "hbm_copy", "kernel": "elementwise", "size_bytes": s, "bytes": 2 * s,
        "median_us": 1.1 + 2 * s / 4.2e6} for s in (2**18, 2**20, 2**22, 2**24)],
}

#: replacement values: wrong types, out of range, huge, non-finite, booleans; "<deep>" becomes deep nesting
BAD_VALUES = [None, True, False, "x", "", [], {}, -1, 0, 1.5, 10**30, -(10**30), 1e308, math.nan, math.inf,
              -math.inf, "1e23", "<deep>", {"kind": "bogus"}, [1, [2, [3]]]]
DEEP = "<deep>"
EXAMPLES = 25


def _paths(node, prefix=()):
    """Every path (tuple of keys / indices) into a parsed document, the root included."""
    yield prefix
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for k, v in items:
        yield from _paths(v, (*prefix, k))


def _set(doc, path, value):
    for k in path[:-1]:
        doc = doc[k]
    doc[path[-1]] = value


def _dumps(data, fmt: str) -> str:
    if fmt == "json":
        return json.dumps(data)
    if fmt == "jsonl":
        return "".join(json.dumps(r) + "\n" for r in data)
    return yaml.safe_dump(data, sort_keys=False, default_flow_style=False, width=1000)


def _deepen(text: str, depth: int) -> str:
    """Replace the placeholder by a list nested ``depth`` deep (written by hand: the dumpers would recurse)."""
    for quoted in (f'"{DEEP}"', f"'{DEEP}'", DEEP):
        text = text.replace(quoted, "[" * depth + "]" * depth)
    return text


@st.composite
def mutated(draw, data, fmt: str) -> bytes:
    """``data`` (or its text) mutated once: a value replaced, a key deleted or added, a YAML key duplicated, or
    the bytes damaged."""
    op = draw(st.sampled_from(["replace", "replace", "replace", "delete", "add", "duplicate", "bytes"]))
    doc = copy.deepcopy(data)
    paths = [p for p in _paths(doc) if p]
    if op == "replace":
        _set(doc, draw(st.sampled_from(paths)), draw(st.sampled_from(BAD_VALUES)))
    elif op == "delete":
        path = draw(st.sampled_from(paths))
        parent = doc
        for k in path[:-1]:
            parent = parent[k]
        del parent[path[-1]]
    elif op == "add":
        dicts = [p for p in _paths(doc) if isinstance(_get(doc, p), dict)]
        _get(doc, draw(st.sampled_from(dicts)))["bogus_key"] = draw(st.sampled_from(BAD_VALUES))
    text = _deepen(_dumps(doc, fmt), draw(st.sampled_from([3, 200, 5000, 100_000])))
    if op == "duplicate" and fmt == "yaml":
        lines = text.splitlines(keepends=True)
        i = draw(st.integers(0, len(lines) - 1))
        text = "".join(lines[: i + 1] + [lines[i]] + lines[i + 1:])
    raw = text.encode()
    if op == "bytes":
        cut = draw(st.integers(0, len(raw)))
        junk = draw(st.sampled_from([b"", b"\xff\xfe\x00", bytes(range(256)), b"\x1f\x8b\x08", b"{[", b"\x00"]))
        raw = raw[:cut] + junk + (raw[cut:] if draw(st.booleans()) else b"")
    return raw


def _get(doc, path):
    for k in path:
        doc = doc[k]
    return doc


def check_cli(argv: list, named: Path) -> None:
    """The contract: exit 0, or exit 2 with one stderr line that names the file ``named``."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), \
            mock.patch("rackbed.sim.outputs.write_all", lambda res, out: []):
        rc = main([str(a) for a in argv])
    lines = err.getvalue().strip().splitlines()
    if rc == 0:
        return
    assert rc == 2, (rc, err.getvalue()[-2000:])
    assert len(lines) == 1 and lines[0].startswith("rackbed: error: "), err.getvalue()[-2000:]
    assert named.name in lines[0], lines[0]


FUZZ = settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


def _write(folder: str, name: str, raw: bytes) -> Path:
    p = Path(folder) / name
    p.write_bytes(raw)
    return p


@FUZZ
@given(raw=mutated(SCENARIO, "yaml"))
def test_fuzz_scenario(raw):
    with tempfile.TemporaryDirectory() as d:
        p = _write(d, "scenario.yaml", raw)
        check_cli(["run", p, "--out", Path(d) / "out", "--no-progress"], p)


@pytest.mark.slow
@FUZZ
@given(raw=mutated(TRACE_ROWS, "jsonl"))
def test_fuzz_trace(raw):
    with tempfile.TemporaryDirectory() as d:
        t = _write(d, "trace.jsonl", raw)
        sc = {**SCENARIO, "workload": {"kind": "trace", "path": str(t)}}
        s = _write(d, "scenario.yaml", _dumps(sc, "yaml").encode())
        check_cli(["run", s, "--out", Path(d) / "out", "--no-progress"], t)


def _shipped(rel: str):
    return yaml.safe_load((ROOT / rel).read_text())


@FUZZ
@given(raw=mutated(_shipped("scenarios/topologies/h200x2-lab.yaml"), "yaml"))
def test_fuzz_topology(raw):
    with tempfile.TemporaryDirectory() as d:
        p = _write(d, "topo.yaml", raw)
        check_cli(["topo", "check", p], p)


@FUZZ
@given(raw=mutated(_shipped("scenarios/plans/h200-tp4-prefill-ep8-decode.yaml"), "yaml"))
def test_fuzz_plan(raw):
    with tempfile.TemporaryDirectory() as d:
        p = _write(d, "plan.yaml", raw)
        check_cli(["plan", "check", p], p)


@FUZZ
@given(raw=mutated(_shipped("scenarios/sweeps/small.yaml"), "yaml"))
def test_fuzz_sweep(raw):
    with tempfile.TemporaryDirectory() as d:
        p = _write(d, "sweep.yaml", raw)
        check_cli(["sweep", p, "--dry-run", "--out", Path(d) / "out"], p)


def _hf_config() -> dict:
    from test_model_hf import QWEN3_235B_CONFIG

    return QWEN3_235B_CONFIG


@FUZZ
@given(raw=mutated(_hf_config(), "json"))
def test_fuzz_hf_config(raw):
    with tempfile.TemporaryDirectory() as d:
        p = _write(d, "config.json", raw)
        check_cli(["model", "show", p, "--json"], p)


@FUZZ
@given(raw=mutated(MEASUREMENTS, "json"))
def test_fuzz_measurements(raw):
    with tempfile.TemporaryDirectory() as d:
        p = _write(d, "measure.json", raw)
        check_cli(["calibrate", "--from-measurements", p, "--out", Path(d) / "cal.yaml"], p)


def _calibration() -> dict:
    """The calibration file ``rackbed calibrate`` writes from ``MEASUREMENTS``, parsed."""
    from rackbed.sim.calibrate import calibrate, dump_calibration

    with tempfile.TemporaryDirectory() as d:
        dump_calibration(calibrate(MEASUREMENTS), Path(d) / "cal.yaml")
        return yaml.safe_load((Path(d) / "cal.yaml").read_text())


@pytest.fixture(scope="module")
def measurements_file(tmp_path_factory) -> Path:
    p = tmp_path_factory.mktemp("meas") / "measure.json"
    p.write_text(json.dumps(MEASUREMENTS))
    return p


@pytest.mark.slow
@FUZZ
@given(data=st.data())
def test_fuzz_calibration(measurements_file, data):
    raw = data.draw(mutated(_calibration(), "yaml"))
    with tempfile.TemporaryDirectory() as d:
        p = _write(d, "cal.yaml", raw)
        check_cli(["validate", "--calibration", p, "--measurements", measurements_file, "--topology", "h200x2"], p)
