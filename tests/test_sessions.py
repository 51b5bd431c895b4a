"""The sessions workload (``Sessions`` in engine/core/workload.py, the stream in engine/core/sessions.py): prompts
that grow turn by turn, prefix block ids that follow the Mooncake traces, the schema's one-line errors, and the
command-line overrides on a sessions scenario."""

from __future__ import annotations

import itertools
import math
from collections import defaultdict

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rackbed.engine.core.sessions import MAX_EMPTY_SESSIONS, iter_session_turns
from rackbed.engine.core.workload import Sessions, describe, generate, iter_requests, parse_workload
from rackbed.topology.errors import UserError

BLOCK = 512

BASE = {
    "kind": "sessions",
    "arrival": {"kind": "poisson", "rate_per_s": 2.0},
    "turns": {"kind": "uniform", "lo": 1, "hi": 8},
    "system_prompts": 3,
    "system_prompt": {"kind": "uniform", "lo": 200, "hi": 3000},
    "input": {"kind": "lognormal", "p50": 200, "p90": 1500, "max_tokens": 6000},
    "output": {"kind": "uniform", "lo": 1, "hi": 900},
    "think": {"kind": "exponential", "mean_s": 10},
    "n_requests": 300,
    "seed": 1,
}


def _spec(**over) -> Sessions:
    d = {**BASE, **over}
    return parse_workload({k: v for k, v in d.items() if v is not None})


def _by_session(turns):
    out = defaultdict(list)
    for t in turns:
        out[t.session].append(t)
    return out


@st.composite
def specs(draw):
    think = draw(st.sampled_from([{"kind": "fixed", "s": 3.0}, {"kind": "exponential", "mean_s": 20.0},
                                  {"kind": "lognormal", "p50_s": 5.0, "p90_s": 30.0}]))
    lo = draw(st.integers(1, 6))
    sys = draw(st.one_of(st.none(), st.integers(1, 3000).map(lambda n: {"kind": "uniform", "lo": 1, "hi": n})))
    return _spec(
        arrival=draw(st.sampled_from([{"kind": "poisson", "rate_per_s": 3.0}, {"kind": "constant", "rate_per_s": 0.7},
                                      {"kind": "gamma", "rate_per_s": 1.0, "cv": 3.0}])),
        turns={"kind": "uniform", "lo": lo, "hi": lo + draw(st.integers(0, 10))},
        system_prompts=draw(st.integers(1, 4)),
        system_prompt=sys,
        first_input=draw(st.sampled_from([None, {"kind": "fixed", "tokens": 2048}, {"kind": "fixed", "tokens": 700}])),
        input={"kind": "uniform", "lo": 1, "hi": draw(st.integers(1, 1500))},
        output={"kind": "uniform", "lo": 1, "hi": draw(st.integers(1, 1500))},
        think=think,
        assumed_ttft_s=draw(st.sampled_from([0.0, 0.5])),
        assumed_tpot_s=draw(st.sampled_from([0.0, 0.03])),
        # at least a system prompt (<= 3000) plus a first input (<= 2048): a smaller cap refuses every session
        max_prompt_tokens=draw(st.sampled_from([None, 6000, 20000])),
        n_requests=draw(st.integers(1, 250)),
        duration_s=draw(st.sampled_from([None, 30.0, 500.0])),
        seed=draw(st.integers(0, 2**32)),
    )


@pytest.mark.slow
@settings(max_examples=60, deadline=None)
@given(spec=specs())
def test_session_streams_hold_their_invariants(spec):
    """Stated exactly (engine/core/sessions.py): per request ceil(prompt / 512) ids; turn k+1's prompt is turn k's
    prompt + output + its input; its ids start with all full blocks of turn k's prompt and share nothing with turn k
    past them; sessions share exactly the full blocks of a common system prompt; an id names a whole prefix; arrivals
    are monotone, ids 0..n-1; turns are spaced by the assumed service time plus a think time."""
    turns = list(iter_session_turns(spec))
    reqs = [t.request for t in turns]
    assert reqs == generate(spec)
    assert [r.id for r in reqs] == list(range(len(reqs)))
    assert all(a.arrival_s <= b.arrival_s for a, b in itertools.pairwise(reqs))
    assert len(reqs) <= spec.n_requests
    if spec.duration_s is not None:
        assert all(r.arrival_s < spec.duration_s for r in reqs)
    cap = spec.max_prompt_tokens or math.inf
    chain: dict[int, tuple[int, ...]] = {}
    for r in reqs:
        assert len(r.prefix_hash_ids) == -(-r.prompt_tokens // BLOCK)
        assert r.prompt_tokens <= cap
        for j, h in enumerate(r.prefix_hash_ids):  # an id always names the same whole prefix
            assert chain.setdefault(h, r.prefix_hash_ids[: j + 1]) == r.prefix_hash_ids[: j + 1]
    sessions = _by_session(turns)
    first_shared = {}
    for s, ts in sessions.items():
        assert [t.turn for t in ts] == list(range(len(ts)))
        t0 = ts[0]
        assert t0.request.prompt_tokens == t0.system_tokens + t0.input_tokens
        n_sys = t0.system_tokens // BLOCK
        first_shared[s] = (t0.system_prompt, t0.request.prefix_hash_ids[:n_sys])
        for a, b in itertools.pairwise(ts):
            pa, pb = a.request, b.request
            assert pb.prompt_tokens == pa.prompt_tokens + pa.output_tokens + b.input_tokens
            full = pa.prompt_tokens // BLOCK
            assert pb.prefix_hash_ids[:full] == pa.prefix_hash_ids[:full]
            assert not set(pb.prefix_hash_ids[full:]) & set(pa.prefix_hash_ids)
            service = spec.assumed_ttft_s + (pa.output_tokens - 1) * spec.assumed_tpot_s
            gap = pb.arrival_s - pa.arrival_s
            if spec.think.kind == "fixed":
                assert gap == pytest.approx(service + spec.think.s, abs=1e-9)
            else:
                assert gap >= service - 1e-9
    ids_of = {s: set().union(*(t.request.prefix_hash_ids for t in ts)) for s, ts in sessions.items()}
    for a, b in itertools.combinations(sorted(sessions), 2):
        (pick_a, sys_a), (pick_b, _) = first_shared[a], first_shared[b]
        want = set(sys_a) if pick_a == pick_b else set()
        assert ids_of[a] & ids_of[b] == want
    # a partial last block is nobody else's
    owners = defaultdict(int)
    for r in reqs:
        for h in set(r.prefix_hash_ids):
            owners[h] += 1
    for r in reqs:
        if r.prompt_tokens % BLOCK:
            assert owners[r.prefix_hash_ids[-1]] == 1


@settings(max_examples=30, deadline=None)
@given(spec=specs(), extra=st.integers(1, 200), other=st.integers(0, 2**32))
def test_deterministic_per_seed_and_shorter_runs_are_prefixes(spec, extra, other):
    a = generate(spec)
    assert generate(spec) == a
    longer = generate(spec.model_copy(update={"n_requests": spec.n_requests + extra}))
    assert longer[: len(a)] == a
    if other != spec.seed and len(a) > 3:
        assert generate(spec, other) != a


def test_closed_form_ids_by_hand():
    """One system prompt of 2 blocks, 2 turns of 512 in / 512 out: turn 0 = [sys0, sys1, own0] (1536 tokens), turn
    1 = [sys0, sys1, own0, own1, own2] (2560 tokens); ids counted from 0 by session."""
    spec = _spec(arrival={"kind": "constant", "rate_per_s": 0.01}, turns={"kind": "fixed", "tokens": 2},
                 system_prompts=1, system_prompt={"kind": "fixed", "tokens": 1024}, input={"kind": "fixed", "tokens": 512},
                 output={"kind": "fixed", "tokens": 512}, think={"kind": "fixed", "s": 4.0}, assumed_ttft_s=1.0,
                 assumed_tpot_s=0.01, n_requests=4)
    reqs = generate(spec)
    assert [(r.arrival_s, r.prompt_tokens, r.prefix_hash_ids) for r in reqs] == [
        (0.0, 1536, (0, 1, 2)),
        (1.0 + 511 * 0.01 + 4.0, 2560, (0, 1, 2, 3, 4)),
        (100.0, 1536, (0, 1, 5)),
        (100.0 + 1.0 + 511 * 0.01 + 4.0, 2560, (0, 1, 5, 6, 7)),
    ]


def test_partial_blocks_get_fresh_ids():
    spec = _spec(turns={"kind": "fixed", "tokens": 3}, system_prompt=None, input={"kind": "fixed", "tokens": 300},
                 output={"kind": "fixed", "tokens": 100}, think={"kind": "fixed", "s": 1.0}, n_requests=3,
                 arrival={"kind": "constant", "rate_per_s": 0.001})
    p = [r.prefix_hash_ids for r in generate(spec)]
    # prompts 300, 700, 1100: (partial), (full, partial), (full, full, partial); ids counted in the order needed
    assert p == [(0,), (1, 2), (1, 3, 4)]


@pytest.mark.slow
def test_rate_turns_and_counters():
    spec = _spec(turns={"kind": "fixed", "tokens": 3}, n_requests=None, duration_s=2000.0,
                 think={"kind": "fixed", "s": 1.0}, assumed_tpot_s=0.0, assumed_ttft_s=0.0)
    stream = iter_requests(spec)
    reqs = stream.to_list()
    c = stream.counters
    assert c["n_sessions"] == pytest.approx(2.0 * 2000, rel=0.05)
    # turns at start, start + 1 s, start + 2 s; those at or past duration_s are dropped
    starts = [t.request.arrival_s for t in iter_session_turns(spec) if t.turn == 0]
    assert len(starts) == c["n_sessions"]
    assert len(reqs) == sum(sum(s + k < 2000.0 for k in range(3)) for s in starts)
    assert c["n_sessions_cut"] == c["n_sessions_empty"] == 0
    assert describe(reqs, c)["count"] == len(reqs)


def test_max_prompt_tokens_cuts_sessions_and_counts_them():
    spec = _spec(turns={"kind": "fixed", "tokens": 20}, max_prompt_tokens=5000, n_requests=2000)
    stream = iter_requests(spec)
    reqs = stream.to_list()
    assert max(r.prompt_tokens for r in reqs) <= 5000
    assert stream.counters["n_sessions_cut"] > 0
    with pytest.raises(UserError, match=f"workload.max_prompt_tokens: 10 is below the first prompt .* of "
                                        f"{MAX_EMPTY_SESSIONS:,} sessions in a row"):
        generate(_spec(max_prompt_tokens=10))


def test_empirical_lengths_from_a_trace():
    spec = _spec(input={"kind": "empirical", "name": "azure-conv", "column": "prompt"},
                 output={"kind": "empirical", "values": [7, 9]}, n_requests=50)
    reqs = generate(spec)
    assert {r.output_tokens for r in reqs} <= {7, 9} and len(reqs) == 50


def test_agent_flavour_example_parses_and_runs():
    """The agent example of docs/SCENARIOS.md: a long task, many short tool-call turns."""
    import re
    from pathlib import Path

    import yaml

    doc = (Path(__file__).resolve().parents[1] / "docs" / "SCENARIOS.md").read_text()
    blocks = re.findall(r"```yaml\n(.*?)```", doc, re.DOTALL)
    wl = [yaml.safe_load(b)["workload"] for b in blocks if "kind: sessions" in b]
    assert len(wl) == 2
    for w in wl:
        reqs = generate(parse_workload(w).model_copy(update={"n_requests": 500, "duration_s": None}))
        assert len(reqs) == 500
    agent = _by_session(iter_session_turns(parse_workload(wl[1]).model_copy(update={"n_requests": 500})))
    assert np.mean([len(ts) for ts in agent.values()]) > 5


@pytest.mark.parametrize(("over", "msg"), [
    ({"turns": {"kind": "lognormal", "p50": 5, "p90": 20}}, "workload.sessions: Value error, turns: must be bounded"),
    ({"turns": {"kind": "fixed", "tokens": 5000}}, "turns: at most 1,000 turns per session, got up to 5,000"),
    ({"turns": {"kind": "empirical", "name": "mooncake"}}, "turns: must be bounded"),
    ({"think": {"kind": "exponential", "mean_s": 0}}, ("workload.sessions.think.exponential.mean_s: Input should be "
                                                     "greater than 0")),
    ({"think": {"kind": "lognormal", "p50_s": 5, "p90_s": 2}}, "p90_s must be > p50_s"),
    ({"n_requests": None}, "give n_requests or duration_s"),
    ({"arrival": {"kind": "immediate"}}, "workload.sessions.arrival: Input tag 'immediate'"),
    ({"system_prompts": 0}, "workload.sessions.system_prompts: Input should be greater than or equal to 1"),
    ({"assumed_tpot_s": -1}, "workload.sessions.assumed_tpot_s: Input should be greater than or equal to 0"),
    ({"max_prompt_tokens": True}, "max_prompt_tokens: expected a number"),
    ({"think": None}, "workload.sessions.think: Field required"),
    ({"users": 3}, "workload.sessions.users: unknown key"),
])
def test_bad_fields_one_line_errors(over, msg):
    from rackbed.sim.scenario import parse_scenario

    wl = {k: v for k, v in {**BASE, **over}.items() if v is not None}
    data = {"topology": "h200x2", "model": "qwen3-235b-a22b", "workload": wl}
    with pytest.raises(UserError) as info:
        parse_scenario(data, "s.yaml")
    err = str(info.value)
    assert err.startswith("s.yaml: ") and msg in err and "\n" not in err


def test_overrides_on_a_sessions_scenario():
    from rackbed.sim.overrides import apply_overrides
    from rackbed.sim.scenario import parse_scenario

    sc = parse_scenario({"topology": "h200x2", "model": "qwen3-235b-a22b", "workload": BASE})
    s = apply_overrides(sc, rate=5.0, duration_s=60.0)
    assert s.workload.arrival.rate_per_s == 5.0 and s.workload.duration_s == 60.0 and s.workload.n_requests is None
    with pytest.raises(UserError, match="^--isl: a sessions workload's prompts grow turn by turn"):
        apply_overrides(sc, isl="100")
    with pytest.raises(UserError, match="^--concurrency without --rate needs a request count"):
        apply_overrides(parse_scenario({"topology": "h200x2", "model": "qwen3-235b-a22b",
                                        "workload": {**BASE, "n_requests": None, "duration_s": 9.0}}),
                        concurrency=4)


def test_engine_core_sessions_is_pure():
    import ast
    from pathlib import Path

    tree = ast.parse((Path(__file__).resolve().parents[1] / "engine" / "core" / "sessions.py").read_text())
    mods = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    mods |= {n.module.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not mods & {"torch", "simpy", "time", "random"}, mods
