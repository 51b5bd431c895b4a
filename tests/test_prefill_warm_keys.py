"""The prefill CUDA-graph keys a rank warms up (``graph_shapes.prefill_reach`` / ``prefill_warm_order``,
``PrefillGraphRunner.warm_plan``): counted by arithmetic, they equal a brute-force enumeration of every chunk a run
can issue -- whole prompts, chunks at any start, the suffix after every block-aligned cached prefix -- and every
such chunk's key is warmed, or the plan says how many keys it left out (property). The starts a rank's prefix cache
actually produces (``RankPrefixCache.acquire``) are among those enumerated."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rackbed.engine.core.graph_shapes import prefill_key, prefill_reach, prefill_warm_order


def _issued(lo, hi, S, chunk, block, max_cached):
    """Every ``(start, n)`` chunk a run with prompts of lo..hi tokens can issue, by enumeration."""
    if chunk:
        return [(s, n) for n in range(1, chunk + 1) for s in range(0, hi - n + 1)]
    out = []
    for L in range(lo, hi + 1):
        top = min(L - 1, L if max_cached is None else max_cached)
        out += [(c, L - c) for c in (range(0, top + 1, block) if block else [0])]
    return out


_plans = st.tuples(st.integers(1, 160), st.integers(0, 160), st.sampled_from([1, 2, 4, 16]),
                   st.sampled_from([0, 0, 1, 7, 16, 33, 200]), st.integers(0, 4), st.none() | st.integers(0, 120))


@settings(max_examples=120, deadline=None)
@given(plan=_plans)
def test_reach_equals_brute_force_enumeration(plan):
    lo, extra, S, chunk, blocks, max_cached = plan
    hi = lo + extra
    block = S * blocks
    issued = _issued(lo, hi, S, chunk, block, max_cached)
    want = Counter(k for k in (prefill_key(s, n, S) for s, n in issued) if k)
    reach, zero = prefill_reach(lo, hi, S, chunk=chunk, block_tokens=block, max_cached=max_cached)
    assert reach == dict(want)
    assert zero == {prefill_key(s, n, S) for s, n in issued if s == 0}


@settings(max_examples=60, deadline=None)
@given(plan=_plans, limit=st.none() | st.integers(0, 40))
def test_every_issued_chunk_is_warmed_or_the_shortfall_is_reported(plan, limit):
    from rackbed.engine.real.model import PrefillGraphRunner

    lo, extra, S, chunk, blocks, max_cached = plan
    hi = lo + extra
    block = S * blocks
    keys, reachable = PrefillGraphRunner.warm_plan(lo, hi, chunk, S, block_tokens=block, max_cached=max_cached,
                                                   limit=limit)
    assert len(set(keys)) == len(keys)
    issued = {prefill_key(s, n, S) for s, n in _issued(lo, hi, S, chunk, block, max_cached)} - {None}
    assert reachable == len(issued)
    if limit is None or reachable <= limit:
        assert set(keys) == issued                  # everything warmed
    else:
        assert len(keys) == limit and set(keys) < issued
    if keys:                                        # the pool is sized by the largest; then starts at token 0
        assert keys[0] == max(issued, key=lambda k: (k[0] * k[1], k))
        zero = {prefill_key(s, n, S) for s, n in _issued(lo, hi, S, chunk, block, max_cached) if s == 0}
        flags = [k in zero for k in keys[1:]]
        assert flags == sorted(flags, reverse=True)

@pytest.mark.slow

def test_large_ranges_are_counted_fast_and_bounded():
    """A 16k-token prompt range with 16-token pages and blocks: thousands of keys, counted in about a second;
    the plan keeps the default bound and says how many it left out."""
    import time

    from rackbed.engine.real.model import PrefillGraphRunner

    t0 = time.perf_counter()
    keys, reachable = PrefillGraphRunner.warm_plan(64, 16384, 0, 16, block_tokens=16)
    assert time.perf_counter() - t0 < 5
    assert reachable > PrefillGraphRunner.MAX_WARM_KEYS == len(keys)
    reach, zero = prefill_reach(64, 16384, 16, block_tokens=16)
    assert zero <= set(keys)                        # every whole prompt's key survives the bound
    hits = [reach[k] for k in keys if k not in zero]
    assert hits == sorted(hits, reverse=True)       # then the keys most (length, prefix) pairs reach


def _serve(S, B, prompts):
    """Serve ``prompts`` through a rank's prefix cache as the worker does (acquire, prefill, insert, release);
    check each (start, suffix) maps to a key of the plan for their length range; return the starts."""
    import torch

    from rackbed.engine.real.model import PagedKvCache, PrefillGraphRunner
    from rackbed.engine.real.prefix import RankPrefixCache

    lens = [len(p) for p in prompts]
    kv = PagedKvCache(1, 256, 1, S, 2, dtype=torch.float32)
    pc = RankPrefixCache(kv, blocks=6, block_tokens=B)
    keys = set(PrefillGraphRunner.warm_keys(min(lens), max(lens), 0, S, block_tokens=B, max_cached=6 * B,
                                            limit=10**6))
    starts = []
    for ids in prompts:
        pin, c, pages = pc.acquire(ids, None)
        assert c % B == 0 and c < len(ids)
        assert prefill_key(c, len(ids) - c, S) in keys
        starts.append(c)
        kv.grow(pages, len(ids))
        pc.insert(pin, ids, pages)
        pc.release(pin)
        kv.free(pages)
    return starts


@settings(max_examples=25, deadline=None)
@given(S=st.sampled_from([2, 4]), ppb=st.integers(1, 3), data=st.data())
def test_rank_prefix_cache_starts_are_among_the_warmed_keys(S, ppb, data):
    """Prompts sharing prefixes: every (start, suffix) a rank's prefix cache serves maps to a warmed key."""
    pytest.importorskip("torch")
    stem = data.draw(st.lists(st.integers(0, 3), min_size=1, max_size=40))
    lens = data.draw(st.lists(st.integers(1, 60), min_size=1, max_size=8))
    _serve(S, S * ppb, [(stem * 60)[:n] for n in lens])


def test_rank_prefix_cache_hits_start_past_token_zero():
    pytest.importorskip("torch")
    stem = [1, 2, 3, 0, 2]
    assert _serve(4, 8, [(stem * 20)[:n] for n in (30, 41, 17, 60)]) == [0, 24, 16, 40]


def test_warm_order_is_empty_for_no_keys():
    assert prefill_warm_order({}, set()) == []


def test_the_prefix_scenario_rank_warms_its_cache_hits():
    """The shipped prefix-cache scenario's aggregated rank (``rank_specs`` as a real run builds it): its warm-up plan
    holds the key of every (prompt, block-aligned cached prefix) its requests can produce, within the bound; without
    the cache only whole prompts' keys."""
    from dataclasses import replace

    from rackbed.engine.core.workload import generate
    from rackbed.engine.real.driver import rank_specs, real_model_config
    from rackbed.engine.real.worker import prefill_warm_plan
    from rackbed.sim.scenario import build, load_scenario

    sc = load_scenario("scenarios/real/h200-agg-prefix.yaml")
    b = build(sc)
    reqs = generate(sc.workload, sc.seed)
    specs = rank_specs(b, real_model_config(b), {0: 0}, 1, use_cuda=False, dtype="bf16", seed=0, weights=None,
                       prefill_pages=64, decode_pages=4096, requests=reqs)
    (spec,) = specs.values()
    assert spec.role == "aggregated" and spec.prefix_blocks > 0
    B, S, cap = spec.prefix_block_tokens, spec.page_tokens, spec.prefix_blocks * spec.prefix_block_tokens
    keys, reachable = prefill_warm_plan(spec)
    assert reachable == len(keys)                    # this scenario's keys all fit the bound
    issued = {prefill_key(c, r.prompt_tokens - c, S) for r in reqs
              for c in range(0, min(r.prompt_tokens - 1, cap) + 1, B)}
    assert issued <= set(keys)
    bare, _ = prefill_warm_plan(replace(spec, prefix_blocks=0, prefix_block_tokens=0))
    assert set(bare) == {prefill_key(0, n, S) for n in range(spec.prefill_lens[0], spec.prefill_lens[1] + 1)}
    assert issued - set(bare), "cache hits reach keys that whole prompts do not"
