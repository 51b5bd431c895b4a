"""Prefix caching in the real engine on CPU processes (gloo): a conversation's second turn (the first turn's prompt
and output, then new text) reuses the first turn's KV pages on the TP=2 prefiller instead of recomputing them, and
generates the tokens of a run without the cache (and of Hugging Face); replaying the measured durations through the
simulator gives the identical decision log with the cache on."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hypothesis import given, settings
from hypothesis import strategies as st_
from tiny_qwen3moe import real_scenario

from rackbed.engine.core.prefix_cache import PrefixCacheSpec
from rackbed.engine.core.request import Request
from rackbed.engine.real.driver import replay, run_real
from rackbed.engine.real.model import TorchModelConfig
from rackbed.engine.real.prefix import block_hashes
from rackbed.sim.driver import simulate
from rackbed.sim.scenario import build
from rackbed.topology.errors import UserError

BLOCK = 4     # tokens per cached block = decode.page_tokens: a block is one page

#: turn 1 (request 0): 21 prompt tokens, 6 generated; turn 2 (request 1) = those 27 tokens + 7 new; request 2 is
#: unrelated and overlaps turn 2 in time. Prefix ids name 512-token units (one each here; the cache's 4-token
#: blocks are its sub-blocks): turn 2 starts with turn 1's unit, whose first 5 blocks turn 1 cached
REQS = [Request(0, 0.0, 21, 6, (1,)), Request(1, 30.0, 34, 5, (1,)), Request(2, 30.0, 13, 4, (2,))]
FOLLOWS = {1: 0}
#: the scenario's cache: 7 blocks of 4 tokens per prefiller (1 KiB each for the tiny model's 2 GPUs), HBM only
CACHE = {"enabled": True, "block_tokens": BLOCK, "hbm_gb_per_gpu": 3.6e-6, "host_gb_per_gpu": 0}


@pytest.fixture(scope="module")
def ckpt(tiny_qwen3moe_ckpt):
    return tiny_qwen3moe_ckpt


def _run(d, cache=None, reqs=REQS, follows=FOLLOWS, **kw):
    sc = real_scenario(d, decode={"ep": 1, "replicas": 1, "max_batch_per_rank": 4, "page_tokens": BLOCK},
                   **({"prefix_cache": cache} if cache else {}))
    b = build(sc)
    res, run = run_real(b, reqs, simulate=simulate, device="cpu", dtype="fp32", weights=str(d), prefill_pages=64,
                        decode_pages=64, follows=follows,
                        tiny_cfg=TorchModelConfig.from_hf(json.loads((d / "config.json").read_text())), **kw)
    return sc, b, res, run


@pytest.mark.slow
def test_second_turn_reuses_the_first_turns_kv_and_generates_the_same_tokens(ckpt):
    _, hf, d = ckpt
    sc, b, res, run = _run(d, CACHE)
    assert b.prefix_cache.hbm_blocks == 7 and not b.prefix_cache.lower
    assert res.metrics["requests"]["done"] == len(REQS)
    # turn 1's 5 cacheable blocks (its prompt's full blocks before the last token) are reused by turn 2; its 6th
    # block mixes turn 1's last prompt token with its output, which the prefiller never cached
    assert run.prefix_hits == {0: [0], 1: [20], 2: [0]}
    assert run.prefix_hit_tokens() == 20 and run.prefix_shortfall_tokens() == 0
    assert res.metrics["prefix_cache"]["prefill_tokens_saved"] == 20      # the scheduler's count, the same
    turn2 = run.prompt_ids[1]
    assert turn2[:27] == run.prompt_ids[0] + run.generated[0] and len(turn2) == 34
    _, _, res_off, off = _run(d)
    assert res_off.metrics["requests"]["done"] == len(REQS) and off.prefix_hit_tokens() == 0 and off.prompt_ids == run.prompt_ids
    assert {r.id: run.generated[r.id] for r in REQS} == {r.id: off.generated[r.id] for r in REQS}
    with torch.no_grad():
        ref = hf.generate(torch.tensor(turn2)[None], max_new_tokens=5, do_sample=False)[0, 34:]
    assert run.generated[1] == ref.tolist()
    rep = replay(b, REQS, run.records, simulate=simulate, seed=sc.seed, deaths=run.deaths)
    assert res.log.decisions() == rep.log.decisions()
    assert rep.metrics["prefix_cache"] == res.metrics["prefix_cache"]


def test_block_hashes_are_chained_content_keys():
    a = list(range(10))
    assert block_hashes(a, 4) == block_hashes(a + [99], 4)          # only full blocks
    assert len(block_hashes(a, 4)) == 2
    b = [7] + a[1:]
    assert block_hashes(b, 4)[0] != block_hashes(a, 4)[0]
    assert block_hashes(b, 4)[1] != block_hashes(a, 4)[1]          # a later block's key names its whole prefix


def test_prefix_cache_settings_are_checked(ckpt):
    _, _, d = ckpt
    with pytest.raises(UserError, match="multiple of decode.page_tokens"):
        _run(d, prefix_cache=PrefixCacheSpec(hbm_blocks=8, block_tokens=6, unit_tokens=6))
    with pytest.raises(UserError, match="take 64 KV pages"):
        _run(d, prefix_cache=PrefixCacheSpec(hbm_blocks=64, block_tokens=BLOCK, unit_tokens=BLOCK))
    with pytest.raises(UserError, match="HBM only"):       # the scenario's default host tier (the topology's)
        _run(d, {**CACHE, "host_gb_per_gpu": None})


@settings(max_examples=40, derandomize=True, deadline=None)
@given(st_.lists(st_.tuples(st_.lists(st_.integers(0, 1), min_size=1, max_size=14), st_.booleans()),
                 min_size=1, max_size=12),
       st_.integers(0, 4))
def test_rank_prefix_cache_reuses_only_equal_tokens_and_frees_pages_when_unreferenced(prompts, hbm_blocks):
    """A rank cache over a toy KV cache whose "KV" of a token is the token id itself: a reused prefix's pages hold
    exactly that prompt's tokens, every page's refcount is the number of its holders (live sequences and cached
    blocks), and pages go back to the free list only when nothing holds them, whatever the LRU evicts."""
    from rackbed.engine.real.model import PagedKvCache
    from rackbed.engine.real.prefix import RankPrefixCache

    kv = PagedKvCache(1, 40, 1, 2, 1)
    rc = RankPrefixCache(kv, hbm_blocks, 4)            # blocks of two pages
    live: list[tuple] = []
    for ids, finish_early in prompts:
        pin, c, pages = rc.acquire(ids, None)
        assert c % 4 == 0 and c <= max(0, len(ids) - 1)
        if c:
            k, _ = kv.read(0, pages, c)
            assert k.flatten().tolist() == [float(t) for t in ids[:c]]
        kv.grow(pages, len(ids))
        t = torch.tensor(ids[c:], dtype=torch.float32)[None, :, None]
        kv.write(0, pages, c, t, t)
        rc.insert(pin, ids, pages)
        live.append((pin, pages))
        if finish_early:                               # the oldest sequence finishes (shipped, dropped)
            p0, pg0 = live.pop(0)
            kv.free(pg0)
            rc.release(p0)
        holders: dict[int, int] = {}
        for pg in [pg for _, pg in live] + list(rc.pages.values()):
            for x in pg:
                holders[x] = holders.get(x, 0) + 1
        assert all(kv.refs[x] == n for x, n in holders.items())
        assert sorted(kv.free_pages) == sorted(set(range(40)) - set(holders))
        assert len(rc.pages) <= hbm_blocks
        rc.index.check()
    for pin, pages in live:
        kv.free(pages)
        rc.release(pin)
    assert len(kv.free_pages) == 40 - rc.n_pages()


@pytest.mark.slow
def test_aggregated_worker_reuses_the_first_turns_kv(ckpt):
    """One aggregated worker (prefill and decode in one cache): turn 2's prefill maps turn 1's cached pages, its
    decode steps then grow the sequence past them into pages of its own."""
    from test_real_aggregated import AGG

    _, hf, d = ckpt
    sc = real_scenario(d, deployment="aggregated", aggregated={**AGG, "workers": 1},
                   prefix_cache={**CACHE, "hbm_gb_per_gpu": 7.2e-6})
    b = build(sc)
    res, run = run_real(b, REQS, simulate=simulate, device="cpu", dtype="fp32", weights=str(d), prefill_pages=64,
                        decode_pages=64, follows=FOLLOWS,
                        tiny_cfg=TorchModelConfig.from_hf(json.loads((d / "config.json").read_text())))
    assert res.metrics["requests"]["done"] == len(REQS)
    assert run.prefix_hits[1] == [20] and run.prefix_shortfall_tokens() == 0
    for r in REQS:
        p = torch.tensor(run.prompt_ids[r.id])[None]
        with torch.no_grad():
            ref = hf.generate(p, max_new_tokens=r.output_tokens, do_sample=False)[0, p.shape[1]:]
        assert run.generated[r.id] == ref.tolist(), f"request {r.id}"
    rep = replay(b, REQS, run.records, simulate=simulate, seed=sc.seed, deaths=run.deaths)
    assert res.log.decisions() == rep.log.decisions()


@pytest.mark.slow
def test_trace_block_ids_give_the_prompts_their_shared_tokens(ckpt):
    """Trace requests (no conversation links) whose block ids agree get equal tokens there, so the ranks'
    content-keyed caches reuse exactly what the scheduler's id-keyed cache counts: request 1 shares request 0's
    block id, request 2 does not; the tokens equal a run without the cache."""
    _, _, d = ckpt
    reqs = [Request(0, 0.0, 21, 3, (7,)), Request(1, 30.0, 30, 3, (7,)), Request(2, 30.0, 13, 3, (8,))]
    sc, b, res, run = _run(d, CACHE, reqs=reqs, follows={})
    assert run.prompt_ids[1][:21] == run.prompt_ids[0] and run.prompt_ids[2][:5] != run.prompt_ids[0][:5]
    assert run.prefix_hits == {0: [0], 1: [20], 2: [0]} and run.prefix_shortfall_tokens() == 0
    assert res.metrics["prefix_cache"]["prefill_tokens_saved"] == 20
    _, _, _, off = _run(d, reqs=reqs, follows={})
    assert off.prompt_ids == run.prompt_ids and off.generated == run.generated
