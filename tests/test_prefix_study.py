"""The prefix-cache studies (``scenarios/sweeps/prefix-cache-*.yaml``) on a slice, the reuse estimator behind
``rackbed search``'s assumed hit rate, and the search with a prefix cache.

- A 3-point slice of the shipped GB200 study (the first 400 requests): cache off hits nothing; on the same cache
  (8 GB HBM + the Grace tier) KV-aware routing hits at least as much as round robin, and the sweep's
  ``prefix_cache`` figure hook writes its table and plot from the records.
- ``lru_reuse``: one cache is ``prefix_reuse``'s LRU; k caches dealt in turn are k independent LRUs of the
  sub-streams (hypothesis).
- ``rackbed search`` on a Mooncake slice: with the cache on the analytic stage assumes a hit rate > 0, plans fewer
  prefillers than with it off at the same load, says so in its notes, and the simulated candidate runs with the
  cache (its measured hit rate > 0)."""

from __future__ import annotations

import csv
import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rackbed.engine.core.prefix_reuse import lru_reuse, prefix_reuse
from rackbed.engine.core.request import Request
from rackbed.sim.search import parse_search, run_search
from rackbed.sim.sweep import deep_merge, expand, load_sweep, run_points
from rackbed.sim.sweep_figures import draw


def _slice(spec, wanted):
    spec = dataclasses.replace(spec, base=deep_merge(spec.base, {"workload": {"max_requests": 400}}))
    pts = [p for p in expand(spec) if p.overrides in wanted]
    assert len(pts) == len(wanted)
    return spec, pts


@pytest.mark.slow
def test_study_slice_hit_rate_ordering_and_figures(tmp_path):
    pol = "sim.policies.prefiller"
    on8 = {"prefix_cache.enabled": True, "prefix_cache.hbm_gb_per_gpu": 8}
    spec, pts = _slice(load_sweep("prefix-cache-gb200"),
                       [{pol: "least_queued_tokens", "prefix_cache.enabled": False},
                        {pol: "kv_aware", **on8}, {pol: "round_robin", **on8}])
    run = run_points(pts, tmp_path / "results.jsonl", progress=False)
    assert [r["status"] for r in run.records] == ["ok"] * 3
    off, kv, rr = (r["summary"] for r in run.records)
    assert "prefix_hit_rate" not in off
    assert kv["prefix_hit_rate"] >= rr["prefix_hit_rate"] > 0
    assert kv["prefix_tokens_saved"] > 0
    files = draw(spec, pts, run.records, tmp_path)
    assert {f.name for f in files} == {"prefix_cache.csv", "prefix_cache.png"}
    rows = list(csv.DictReader((tmp_path / "prefix_cache.csv").open()))
    by = {(r["policy"], r["cache"]): r for r in rows}
    assert float(by["least_queued_tokens", "off"]["prefix_hit_rate"]) == 0.0
    assert float(by["kv_aware", "on"]["prefix_hit_rate"]) == pytest.approx(kv["prefix_hit_rate"], rel=1e-5)
    assert by["kv_aware", "on"]["host_tier"] == "on" and by["kv_aware", "on"]["hbm_gb_per_gpu"] == "8"


_reqs = st.lists(st.tuples(st.integers(1, 3000), st.lists(st.integers(0, 6), max_size=6)), max_size=40)


def _requests(spec):
    out = []
    for i, (prompt, ids) in enumerate(spec):
        chain = tuple(hash(tuple(ids[: j + 1])) & 0xFFFF for j in range(len(ids)))  # whole-prefix ids
        out.append(Request(i, float(i), prompt, 10, prefix_hash_ids=chain[: -(-prompt // 512)]))
    return out


@settings(max_examples=60, deadline=None, derandomize=True)
@given(_reqs, st.integers(1, 8), st.integers(1, 4))
def test_lru_reuse_is_per_cache_lru(spec, blocks, k):
    reqs = _requests(spec)
    total = sum(r.prompt_tokens for r in reqs)
    one = prefix_reuse(reqs, (blocks,), full_blocks=True)
    assert lru_reuse(reqs, blocks, 1) == one.lru(blocks)
    parts = [prefix_reuse(reqs[j::k], (blocks,), full_blocks=True).reused_tokens_lru[blocks] for j in range(k)]
    assert lru_reuse(reqs, blocks, k) == (sum(parts) / total if total else 0.0)


def _search_spec(cache: bool):
    sc = {"mtp": {"draft": {"kind": "mtp", "layers": 1}}}
    if cache:
        sc["prefix_cache"] = {"enabled": True, "hbm_gb_per_gpu": 8}
    return parse_search({
        "name": "pc", "model": "qwen3-235b-a22b",
        "workload": {"kind": "trace", "name": "mooncake", "rate_per_s": 18.0, "max_requests": 600},
        "slo": {"ttft_s": 4.0, "tpot_s": 0.05},
        "space": {"topology": ["gb200-nvl72"], "weight_format": ["mxfp8"], "prefill_tp": [4], "decode_ep": [16],
                  "max_batch_per_rank": [64], "draft_k": [1]},
        "scenario": sc, "max_simulations": 1})


@pytest.mark.slow
def test_search_with_prefix_cache_plans_fewer_prefillers(tmp_path):
    off, on = (run_search(_search_spec(c), tmp_path / str(c), progress=False) for c in (False, True))
    (po,), (pn,) = ([o for o in r.prefill if o.pruned is None] for r in (off, on))
    assert po.hit_rate == 0.0 and not any("prefix cache" in n for n in off.notes)
    assert 0.0 < pn.hit_rate < 0.3 and pn.capacity_tokens_per_s > po.capacity_tokens_per_s
    # at 18 requests/s the uncached prompts need 4 prefillers, all of them 5 (the rate sits where the hit rate
    # crosses a whole prefiller; at any rate the cache never asks for more)
    assert pn.replicas < po.replicas
    assert on.simulated[0].n_gpus < off.simulated[0].n_gpus
    assert any(f"{pn.hit_rate:.1%}" in n for n in on.notes)
    rec_on, rec_off = on.records[0], off.records[0]
    assert rec_on["est"]["prefix_hit_rate"] == pn.hit_rate
    assert rec_on["summary"]["prefix_hit_rate"] > 0 and "prefix_hit_rate" not in rec_off["summary"]
