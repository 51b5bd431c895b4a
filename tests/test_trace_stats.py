"""``rackbed trace stats`` (engine/cli/trace.py): the prefix-reuse bound by hand on a small Mooncake-format tool/agent
fixture, against an independent count on the shipped Mooncake trace, on the sessions generator, and the command
line's output and errors.

``tests/data/mooncake_toolagent_sample.jsonl`` is a hand-made trace in the Mooncake format (not an excerpt of a
published one): two agent sessions over one shared 2-block tool prompt (ids 0, 1), prompts growing by tool outputs
(a partial last block gets a new id when the next turn fills it), and one request without ``hash_ids``.
"""

from __future__ import annotations

import gzip
import json
import math
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from rackbed.engine.cli.main import main
from rackbed.engine.cli.trace import prefix_reuse, trace_stats
from rackbed.engine.core.traces import load_trace, trace_path
from rackbed.engine.core.workload import TraceReplay, generate, iter_requests, parse_workload

FIXTURE = Path(__file__).resolve().parent / "data" / "mooncake_toolagent_sample.jsonl"

SESSIONS = {
    "kind": "sessions", "arrival": {"kind": "constant", "rate_per_s": 0.01}, "turns": {"kind": "fixed", "tokens": 2},
    "system_prompt": {"kind": "fixed", "tokens": 1024}, "input": {"kind": "fixed", "tokens": 512},
    "output": {"kind": "fixed", "tokens": 512}, "think": {"kind": "fixed", "s": 4.0}, "n_requests": 10,
}


def test_toolagent_fixture_loads_in_the_mooncake_format():
    trace = load_trace(FIXTURE)
    assert trace.format == "mooncake" and len(trace) == 6
    assert trace.arrival_s.tolist() == [0.0, 0.8, 1.5, 2.0, 2.6, 3.0]
    reqs = generate(TraceReplay(path=str(FIXTURE)))
    assert [r.prefix_hash_ids for r in reqs] == [(0, 1, 2), (0, 1, 3), (0, 1, 4, 5), (0, 1, 6, 7), (0, 1, 4, 8, 9), ()]
    assert all(len(r.prefix_hash_ids) in (0, math.ceil(r.prompt_tokens / 512)) for r in reqs)


def test_reuse_by_hand_on_the_fixture():
    """Prompt tokens 1300 + 1100 + 1700 + 1600 + 2100 + 40 = 7840. Infinite: the shared 1024 tokens of requests 2-4
    and 1536 of request 5 (blocks 0, 1, 4) = 4608. LRU of 3 blocks: request 2 left [4, 1, 0] (its head blocks),
    request 4 left [6, 1, 0], so request 5 misses block 4: 4096. LRU of 5 blocks keeps block 4: as infinite."""
    reqs = generate(TraceReplay(path=str(FIXTURE)))
    r = prefix_reuse(reqs, (3, 5))
    assert (r.prompt_tokens, r.blocks, r.distinct_blocks, r.requests_with_ids) == (7840, 19, 10, 5)
    assert r.reused_tokens_infinite == 4608
    assert r.reused_tokens_lru == {3: 4096, 5: 4608}
    assert r.infinite == pytest.approx(4608 / 7840) and r.lru(3) == pytest.approx(4096 / 7840)
    assert r.inconsistent_ids == 0


def test_shipped_mooncake_bound_equals_an_independent_count():
    """On the shipped trace the prefix rule and "block seen before" agree (its ids name whole prefixes): 29.4 %."""
    with gzip.open(trace_path("mooncake"), "rt") as f:
        rows = [json.loads(s) for s in f if s.strip()]
    seen, hit, total = set(), 0, 0
    for o in rows:
        for j, h in enumerate(o["hash_ids"]):
            t = min(512, o["input_length"] - 512 * j)
            hit += t if h in seen else 0
            seen.add(h)
        total += o["input_length"]
    s = trace_stats("mooncake", (1000, 16000))
    assert s["requests"] == 2000 and s["requests_with_ids"] == 2000
    assert s["reuse_infinite"] == pytest.approx(hit / total, rel=1e-12)
    assert round(100 * s["reuse_infinite"], 1) == 29.4
    assert s["reuse_lru_1000"] < s["reuse_lru_16000"] < s["reuse_infinite"]
    assert s["inconsistent_ids"] == 0 and s["distinct_blocks"] == len(seen)


def test_sessions_by_hand():
    """Sessions of two turns, one after another: turn 0 = [sys0, sys1, own] (1536 tokens), turn 1 = turn 0's blocks +
    2 more (2560). Session 0 reuses 0 + 1536 tokens, the 4 others 1024 + 1536 each."""
    reqs = generate(parse_workload(SESSIONS))
    r = prefix_reuse(reqs, (1, 3))
    assert r.prompt_tokens == 5 * (1536 + 2560)
    assert r.reused_tokens_infinite == 1536 + 4 * (1024 + 1536)
    # one block: only a request's first block survives it, and every session starts with sys0
    assert r.reused_tokens_lru[1] == 4 * 512 + 5 * 512
    assert r.reused_tokens_lru[3] == r.reused_tokens_infinite
    # full blocks before the last prompt token only: a 1536-token turn 0 caches [sys0, sys1] (its third block holds
    # the last token), so turn 1 reuses 1024 tokens; the prompt total stays
    f = prefix_reuse(reqs, (), full_blocks=True)
    assert f.prompt_tokens == r.prompt_tokens and f.blocks == 5 * (2 + 4)
    assert f.reused_tokens_infinite == 1024 + 4 * (1024 + 1024)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**32), sizes=st.lists(st.integers(1, 400), min_size=2, max_size=4, unique=True))
def test_lru_reuse_grows_with_the_cache_up_to_the_bound(seed, sizes):
    """LRU keeps inclusion (a smaller cache's blocks are in a larger one's), so reuse grows with the size, never
    passes the infinite cache, and reaches it once every distinct block fits."""
    spec = parse_workload({**SESSIONS, "arrival": {"kind": "poisson", "rate_per_s": 1.0},
                           "turns": {"kind": "uniform", "lo": 1, "hi": 6}, "system_prompts": 3,
                           "system_prompt": {"kind": "uniform", "lo": 100, "hi": 3000},
                           "input": {"kind": "uniform", "lo": 1, "hi": 2000}, "n_requests": 120, "seed": seed})
    reqs = generate(spec)
    first = prefix_reuse(reqs)
    sizes = sorted(sizes) + [first.distinct_blocks]
    r = prefix_reuse(reqs, sizes)
    got = [r.reused_tokens_lru[c] for c in sizes]
    assert got == sorted(got) and got[-1] == r.reused_tokens_infinite == first.reused_tokens_infinite


def test_cli_text_json_and_a_scenario(tmp_path, capsys):
    assert main(["trace", "stats", str(FIXTURE), "--cache-blocks", "3"]) == 0
    out = capsys.readouterr().out
    assert "requests       6 (5 with prefix block ids)" in out
    assert "58.8 % of prompt tokens (infinite cache, any block)" in out and "52.2 % with an LRU cache of 3 blocks" in out
    assert main(["trace", "stats", str(FIXTURE), "--full-blocks", "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["full_blocks"] and s["prompt_blocks"] == 2 + 2 + 3 + 3 + 4
    assert s["reuse_infinite"] == s["reuse_infinite_full_blocks"] == pytest.approx(4608 / 7840)
    # a workload file, and a serving scenario whose seed draws the workload as a run does
    wl = tmp_path / "wl.yaml"
    wl.write_text(yaml.safe_dump(SESSIONS))
    assert main(["trace", "stats", str(wl), "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["requests"] == 10 and s["reuse_infinite"] == pytest.approx((1536 + 4 * 2560) / (5 * 4096))
    noisy = {**SESSIONS, "arrival": {"kind": "poisson", "rate_per_s": 1.0}, "input": {"kind": "uniform", "lo": 1,
                                                                                        "hi": 900}}
    sc = tmp_path / "sc.yaml"
    sc.write_text(yaml.safe_dump({"kind": "serving", "seed": 7, "topology": "h200x2", "model": "qwen3-235b-a22b",
                                  "workload": noisy}))
    assert main(["trace", "stats", str(sc), "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    want = iter_requests(parse_workload(noisy), 7).to_list()
    assert s["input_tokens_mean"] == pytest.approx(sum(r.prompt_tokens for r in want) / len(want))
    assert main(["trace", "stats", "azure-conv", "--max-requests", "10"]) == 0
    assert "unknown: no prefix block ids" in capsys.readouterr().out


@pytest.mark.parametrize(("argv", "msg"), [
    (["nope"], "nope: not a file, a shipped trace (azure-code, azure-conv, mooncake) or a shipped scenario"),
    (["mooncake", "--cache-blocks", "0"], "--cache-blocks: must be >= 1, got 0"),
    (["mooncake", "--max-requests", "0"], "--max-requests: must be >= 1, got 0"),
    (["fig_grouped_gemm"], "neither a workload (kind: synthetic, trace or sessions) nor a serving scenario"),
])
def test_cli_errors_one_line(argv, msg, capsys):
    assert main(["trace", "stats", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("rackbed: error: ") and msg in err and "\n" not in err


def test_cli_bad_trace_names_the_line(tmp_path, capsys):
    bad = tmp_path / "t.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 1100, "output_length": 5, "hash_ids": [0, 1]}\n')
    assert main(["trace", "stats", str(bad)]) == 2
    assert f"{bad}:1: hash_ids has 2 ids, input_length 1100 needs ceil(1100 / 512) = 3" in capsys.readouterr().err
