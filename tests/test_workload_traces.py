"""Trace parsing (engine/core/traces.py) and trace replay (TraceReplay in engine/core/workload.py)."""

from __future__ import annotations

import csv
import gzip
import io
import itertools
import json
import os
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rackbed.engine.core.traces import TRACE_FILES, load_trace, trace_path
from rackbed.engine.core.workload import TraceReplay, describe, generate, iter_requests
from rackbed.topology.errors import UserError

# the shipped traces are the first 2000 lines of the published ones (engine/core/data/TRACES.md); where a folder of
# the full originals is at hand, RACKBED_FULL_TRACES=DIR also checks the loader on them (skipped otherwise)
FULL_TRACES = Path(os.environ.get("RACKBED_FULL_TRACES", "/nonexistent"))


def _read_gz_lines(name: str) -> list[str]:
    with gzip.open(trace_path(name), "rt") as f:
        return f.read().splitlines()


# ------------------------------------------------------------------------------------------ shipped copies


def test_shipped_traces_exist_small_and_named():
    total = 0
    for name, fname in TRACE_FILES.items():
        p = trace_path(name)
        assert p.name == fname and p.is_file()
        total += p.stat().st_size
    assert total < 300_000
    assert (trace_path("mooncake").parent / "TRACES.md").is_file()
    with pytest.raises(UserError, match="unknown trace name 'sharegpt'"):
        trace_path("sharegpt")


@pytest.mark.parametrize("name", sorted(TRACE_FILES))
def test_replay_matches_an_independent_parse(name):
    """Every request equals the file's line, parsed here with csv/json directly."""
    lines = _read_gz_lines(name)
    if name.startswith("azure"):
        rows = list(csv.DictReader(io.StringIO("\n".join(lines))))
        from datetime import datetime

        t = [datetime.fromisoformat(r["TIMESTAMP"]) for r in rows]
        want = [
            ((ti - t[0]).total_seconds(), int(r["ContextTokens"]), int(r["GeneratedTokens"]), ())
            for ti, r in zip(t, rows)
        ]
    else:
        objs = [json.loads(s) for s in lines]
        want = [
            (
                (o["timestamp"] - objs[0]["timestamp"]) / 1000,
                o["input_length"],
                o["output_length"],
                tuple(o["hash_ids"]),
            )
            for o in objs
        ]
    reqs = generate(TraceReplay(name=name))
    assert len(reqs) == len(want) == 2000
    assert [r.id for r in reqs] == list(range(2000))
    for r, (a, p, o, h) in zip(reqs, want):
        assert r.arrival_s == pytest.approx(a, abs=1e-6)
        assert (r.prompt_tokens, r.output_tokens, r.prefix_hash_ids) == (p, o, h)


def test_shipped_first_requests_by_hand():
    moon = generate(TraceReplay(name="mooncake", max_requests=2))
    assert (moon[0].arrival_s, moon[0].prompt_tokens, moon[0].output_tokens) == (0.0, 6758, 500)
    assert moon[0].prefix_hash_ids == tuple(range(14))
    conv = generate(TraceReplay(name="azure-conv", max_requests=2))
    # 18:15:50.9951690 - 18:15:46.6805900 (the 100 ns digit is dropped)
    assert conv[1].arrival_s == 4.314579
    assert (conv[0].prompt_tokens, conv[0].output_tokens, conv[1].prompt_tokens) == (374, 44, 396)


def test_shipped_averages_published_ish():
    moon = describe(generate(TraceReplay(name="mooncake")))
    # published: 12,035 input / 343 output tokens over the whole hour; the first 2000 requests run longer
    assert 0.9 * 12035 < moon["prompt_tokens_mean"] < 1.2 * 12035
    assert moon["output_tokens_mean"] == pytest.approx(343, rel=0.05)
    assert moon["mean_rate_per_s"] == pytest.approx(12031 / 3537, rel=0.15)  # ~3.4 req/s in the hour
    conv = describe(generate(TraceReplay(name="azure-conv")))
    code = describe(generate(TraceReplay(name="azure-code")))
    assert conv["prompt_tokens_mean"] == pytest.approx(1155, rel=0.1)  # full-trace means, as in TRACES.md
    assert code["prompt_tokens_mean"] == pytest.approx(2048, rel=0.1)
    assert code["output_tokens_mean"] == pytest.approx(28, rel=0.1)
    assert code["output_tokens_mean"] < conv["output_tokens_mean"] / 5  # code completions are short


@pytest.mark.skipif(
    not (FULL_TRACES / "mooncake_conversation.jsonl").is_file(), reason="full traces not here"
)
def test_full_traces_published_numbers():
    moon = describe(generate(TraceReplay(path=str(FULL_TRACES / "mooncake_conversation.jsonl"))))
    assert moon["count"] == 12031
    assert round(moon["prompt_tokens_mean"]) == 12035 and round(moon["output_tokens_mean"]) == 343
    assert moon["duration_s"] == 3536.999
    conv = describe(generate(TraceReplay(path=str(FULL_TRACES / "azure_llm_2023_conv.csv"))))
    assert conv["count"] == 19366


# ------------------------------------------------------------------------------------------ replay semantics


@pytest.mark.slow
@settings(max_examples=30, deadline=None)
@given(name=st.sampled_from(sorted(TRACE_FILES)), scale=st.floats(1e-3, 1e3))
def test_time_scale_scales_arrivals_exactly(name, scale):
    base = generate(TraceReplay(name=name))
    fast = generate(TraceReplay(name=name, time_scale=scale))
    assert [r.arrival_s for r in fast] == [r.arrival_s / scale for r in base]
    assert [(r.id, r.prompt_tokens, r.output_tokens, r.prefix_hash_ids) for r in fast] == [
        (r.id, r.prompt_tokens, r.output_tokens, r.prefix_hash_ids) for r in base
    ]
    assert describe(fast)["mean_rate_per_s"] == pytest.approx(
        describe(base)["mean_rate_per_s"] * scale, rel=1e-9
    )


@settings(max_examples=30, deadline=None)
@given(name=st.sampled_from(sorted(TRACE_FILES)), rate=st.floats(0.01, 1e4), start_s=st.floats(0, 300))
def test_rate_per_s_hits_the_mean_rate(name, rate, start_s):
    reqs = generate(TraceReplay(name=name, rate_per_s=rate, start_s=start_s))
    assert describe(reqs)["mean_rate_per_s"] == pytest.approx(rate, rel=1e-9)


@settings(max_examples=40, deadline=None)
@given(name=st.sampled_from(sorted(TRACE_FILES)), start_s=st.floats(0, 400), scale=st.floats(0.1, 10))
def test_start_s_windows_the_trace(name, start_s, scale):
    trace = load_trace(trace_path(name))
    keep = trace.arrival_s >= start_s
    reqs = generate(TraceReplay(name=name, start_s=start_s, time_scale=scale))
    assert len(reqs) == int(keep.sum())
    assert [r.arrival_s for r in reqs] == ((trace.arrival_s[keep] - start_s) / scale).tolist()
    assert [r.prompt_tokens for r in reqs] == trace.prompt_tokens[keep].tolist()


def test_start_past_the_end():
    with pytest.raises(UserError, match="start_s=1000000.0 is past the last request"):
        iter_requests(TraceReplay(name="azure-conv", start_s=1e6))


@settings(max_examples=40, deadline=None)
@given(duration_s=st.floats(0.5, 1000), max_requests=st.none() | st.integers(1, 3000))
def test_duration_and_max_requests_cut(duration_s, max_requests):
    base = generate(TraceReplay(name="azure-code"))
    reqs = generate(TraceReplay(name="azure-code", duration_s=duration_s, max_requests=max_requests))
    want = [r for r in base if r.arrival_s < duration_s][:max_requests]
    assert reqs == want


def test_clipping_is_counted():
    trace = load_trace(trace_path("mooncake"))
    stream = iter_requests(TraceReplay(name="mooncake", max_prompt_tokens=4096, max_output_tokens=300))
    reqs = stream.to_list()
    assert max(r.prompt_tokens for r in reqs) == 4096 and max(r.output_tokens for r in reqs) == 300
    assert stream.counters["n_prompt_clipped"] == int((trace.prompt_tokens > 4096).sum())
    assert stream.counters["n_output_clipped"] == int((trace.output_tokens > 300).sum())
    assert [min(p, 4096) for p in trace.prompt_tokens.tolist()] == [r.prompt_tokens for r in reqs]


def test_loop_repeats_with_period_and_shifted_prefix_ids():
    trace = load_trace(trace_path("mooncake"))
    m = len(trace)
    gap_s = trace.span_s / (m - 1)
    period_s = trace.span_s + gap_s
    stream = iter_requests(
        TraceReplay(name="mooncake", loop=True, time_scale=2.0, duration_s=2.5 * period_s / 2)
    )
    reqs = stream.to_list()
    assert stream.counters["n_passes"] == 3
    assert [r.id for r in reqs] == list(range(len(reqs)))
    assert all(a.arrival_s <= b.arrival_s for a, b in itertools.pairwise(reqs))
    assert reqs[-1].arrival_s < 2.5 * period_s / 2
    shift = trace.max_hash_id + 1
    for k in (1, 2):
        first = reqs[k * m]
        assert first.arrival_s == (trace.arrival_s[0] + k * period_s) / 2.0
        assert first.prompt_tokens == reqs[0].prompt_tokens
        assert first.prefix_hash_ids == tuple(h + k * shift for h in reqs[0].prefix_hash_ids)
    # a loop bounded by max_requests
    looped = generate(TraceReplay(name="azure-conv", loop=True, max_requests=4500))
    assert len(looped) == 4500 and looped[2000].prompt_tokens == looped[0].prompt_tokens
    assert looped[2000].prefix_hash_ids == ()


def test_loop_rate_per_s_keeps_the_rate_across_passes():
    reqs = generate(TraceReplay(name="azure-conv", loop=True, rate_per_s=20.0, max_requests=6000))
    assert describe(reqs)["mean_rate_per_s"] == pytest.approx(20.0, rel=1e-9)


# ------------------------------------------------------------------------------------------ parsing


def _write(path: Path, text: str, gz: bool = False) -> Path:
    if gz:
        path.write_bytes(gzip.compress(text.encode()))
    else:
        path.write_text(text)
    return path


AZURE_OK = "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.5,10,5\n2023-11-16 18:15:47.0,20,6\n"
MOON_OK = '{"timestamp": 0, "input_length": 10, "output_length": 5, "hash_ids": [0]}\n'


@pytest.mark.parametrize(
    ("name", "text", "msg"),
    [
        (
            "x.csv",
            AZURE_OK + "2023-11-16 18:15:48,abc,3\n",
            ":4: ContextTokens must be an integer >= 0, got 'abc'",
        ),
        (
            "x.csv",
            AZURE_OK + "2023-11-16 18:15:48,3,-2\n",
            ":4: GeneratedTokens must be an integer >= 0, got '-2'",
        ),
        (
            "x.csv",
            AZURE_OK + "2023-11-16 18:15:48,3.5,2\n",
            ":4: ContextTokens must be an integer >= 0, got '3.5'",
        ),
        ("x.csv", AZURE_OK + "yesterday,3,2\n", ":4: TIMESTAMP must be a date-time"),
        ("x.csv", AZURE_OK + "2023-11-16 18:15:48,3\n", ":4: expected 3 fields, got 2"),
        ("x.csv", "TIMESTAMP,Context,GeneratedTokens\n1,2,3\n", ":1: Azure CSV header must name"),
        ("x.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n", ": trace has no requests"),
        ("x.csv", "", ": trace is empty"),
        ("x.jsonl", MOON_OK + "{not json}\n", ":2: not valid JSON"),
        ("x.jsonl", MOON_OK + "[1, 2]\n", ":2: expected a JSON object, got list"),
        ("x.jsonl", MOON_OK + '{"timestamp": 1, "input_length": 3}\n', ":2: missing key 'output_length'"),
        (
            "x.jsonl",
            MOON_OK + '{"timestamp": -1, "input_length": 3, "output_length": 1}\n',
            ":2: timestamp must be",
        ),
        (
            "x.jsonl",
            MOON_OK + '{"timestamp": 1, "input_length": 3.0, "output_length": 1}\n',
            ":2: input_length must be an integer >= 0, got 3.0",
        ),
        (
            "x.jsonl",
            MOON_OK + '{"timestamp": 1, "input_length": 3, "output_length": true}\n',
            ":2: output_length must be an integer >= 0",
        ),
        (
            "x.jsonl",
            MOON_OK + '{"timestamp": 1, "input_length": 3, "output_length": 1, "hash_ids": [1, "a"]}\n',
            ":2: hash_ids must be a list",
        ),
        (
            "x.jsonl",
            MOON_OK + '{"timestamp": 1, "input_length": 513, "output_length": 1, "hash_ids": [1]}\n',
            ":2: hash_ids has 1 ids, input_length 513 needs ceil(513 / 512) = 2",
        ),
        (
            "x.jsonl",
            MOON_OK + '{"timestamp": 1, "input_length": 512, "output_length": 1, "hash_ids": [1, 2]}\n',
            ":2: hash_ids has 2 ids, input_length 512 needs ceil(512 / 512) = 1",
        ),
    ],
)
@pytest.mark.parametrize("gz", [False, True])
def test_malformed_traces_one_line_error(tmp_path, name, text, msg, gz):
    path = _write(tmp_path / (name + (".gz" if gz else "")), text, gz)
    with pytest.raises(UserError) as info:
        load_trace(path)
    err = str(info.value)
    assert err == f"{path}{msg}" or err.startswith(f"{path}{msg}")
    assert "\n" not in err
    with pytest.raises(ValueError, match=str(path).replace(".", r"\.")):  # and through the workload
        iter_requests(TraceReplay(path=str(path)))


@settings(max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture], deadline=None)
@given(
    n_good=st.integers(1, 40),
    bad_at=st.integers(0, 39),
    blank_every=st.integers(0, 5),
    bad=st.sampled_from(["x", "-1", "1e3", "", " 7a"]),
)
def test_error_names_the_bad_line(tmp_path, n_good, bad_at, blank_every, bad):
    """Wherever the bad row is (blank lines in between), the error gives its 1-based line number."""
    bad_at = min(bad_at, n_good)
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    bad_line = None
    for i in range(n_good + 1):
        if blank_every and i % blank_every == 0:
            lines.append("")
        if i == bad_at:
            lines.append(f"2023-11-16 18:00:{i:02d},{bad},3")
            bad_line = len(lines)
        else:
            lines.append(f"2023-11-16 18:00:{i:02d},{i + 1},3")
    path = _write(tmp_path / "t.csv", "\n".join(lines) + "\n")
    with pytest.raises(UserError) as info:
        load_trace(path)
    assert str(info.value) == f"{path}:{bad_line}: ContextTokens must be an integer >= 0, got {bad!r}"


def test_missing_file_names_the_path(tmp_path):
    missing = tmp_path / "traces" / "nope.csv"
    with pytest.raises(UserError, match=f"^{missing!s}: trace file not found$"):
        load_trace(missing)
    with pytest.raises(UserError, match="trace file not found"):
        generate(TraceReplay(path=str(missing)))
    with pytest.raises(UserError, match="not a file"):
        load_trace(tmp_path)


def test_zero_tokens_clamped_to_1_and_counted(tmp_path):
    text = "TIMESTAMP,ContextTokens,GeneratedTokens\n10.0,0,5\n10.5,7,0\n11.0,0,0\n"
    path = _write(tmp_path / "z.csv", text)
    assert load_trace(path).prompt_tokens.tolist() == [0, 7, 0]  # the trace keeps what the file says
    stream = iter_requests(TraceReplay(path=str(path)))
    reqs = stream.to_list()
    assert [(r.arrival_s, r.prompt_tokens, r.output_tokens) for r in reqs] == [
        (0.0, 1, 5),
        (0.5, 7, 1),
        (1.0, 1, 1),
    ]
    stats = describe(reqs, stream.counters)
    assert stats["n_prompt_zero_to_1"] == 2 and stats["n_output_zero_to_1"] == 2


def test_unsorted_trace_sorted_stably_and_format_sniffed(tmp_path):
    lines = [
        '{"timestamp": 2000, "input_length": 1, "output_length": 1}',
        "",
        '{"timestamp": 500, "input_length": 2, "output_length": 1, "extra": "ignored"}',
        '{"timestamp": 2000, "input_length": 3, "output_length": 1, "hash_ids": [4]}',
        '{"timestamp": 500.5, "input_length": 4, "output_length": 1}',
    ]
    path = _write(tmp_path / "trace.txt", "\n".join(lines))  # no telling extension: sniffed
    trace = load_trace(path)
    assert trace.format == "mooncake"
    assert trace.arrival_s.tolist() == [0.0, 0.0005, 1.5, 1.5]
    assert trace.prompt_tokens.tolist() == [2, 4, 1, 3]
    reqs = generate(TraceReplay(path=str(path)))
    assert [(r.id, r.prompt_tokens, r.prefix_hash_ids) for r in reqs] == [
        (0, 2, ()),
        (1, 4, ()),
        (2, 1, ()),
        (3, 3, (4,)),
    ]
    csv_path = _write(tmp_path / "trace.dat", "TIMESTAMP,ContextTokens,GeneratedTokens\n5,1,1\n3.25,2,2\n")
    assert load_trace(csv_path).format == "azure"
    assert load_trace(csv_path).arrival_s.tolist() == [0.0, 1.75]  # numeric TIMESTAMP = seconds
    with pytest.raises(UserError, match=":1: Azure CSV header"):
        load_trace(path, format="azure")


def test_gz_and_plain_load_the_same(tmp_path):
    plain = _write(tmp_path / "a.csv", AZURE_OK)
    packed = _write(tmp_path / "b.csv.gz", AZURE_OK, gz=True)
    a, b = load_trace(plain), load_trace(packed)
    assert a.arrival_s.tolist() == b.arrival_s.tolist() == [0.0, 0.5]
    assert a.prompt_tokens.tolist() == b.prompt_tokens.tolist() == [10, 20]
    with pytest.raises(ValueError):
        a.arrival_s[0] = 1.0  # read-only: shared through the cache


def test_full_azure_column_names_case_and_order(tmp_path):
    text = "generatedtokens,Extra,ContextTokens,TIMESTAMP\n5,x,10,2023-11-16 18:15:46+00:00\n6,y,20,2023-11-16 18:15:48+00:00\n"
    trace = load_trace(_write(tmp_path / "c.csv", text))
    assert trace.prompt_tokens.tolist() == [10, 20] and trace.output_tokens.tolist() == [5, 6]
    assert trace.arrival_s.tolist() == [0.0, 2.0]


def test_trace_is_reread_when_the_file_changes(tmp_path):
    path = _write(tmp_path / "t.csv", AZURE_OK)
    assert len(load_trace(path)) == 2
    _write(path, AZURE_OK + "2023-11-16 18:15:49.0,30,7\n")
    assert len(load_trace(path)) == 3
    np.testing.assert_array_equal(load_trace(path).output_tokens, [5, 6, 7])
