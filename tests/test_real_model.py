"""The torch engine: equal to Hugging Face transformers, and sharded forwards equal the unsharded one (CPU, gloo)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st_
from tiny_qwen3moe import tiny_hf_model

from rackbed.engine.real.comm import Comm
from rackbed.engine.real.launch import spawn_local
from rackbed.engine.real.model import Shard, ShardedQwen3Moe, TorchModelConfig

CFG = TorchModelConfig(hidden=64, n_layers=2, n_q_heads=8, n_kv_heads=2, head_dim=16, n_experts=8, top_k=2,
                       moe_intermediate=32, vocab=128, rope_theta=10000.0)


def _hf_model(seed: int = 0):
    return tiny_hf_model(seed)


@pytest.mark.slow
def test_matches_transformers_logits_and_greedy_tokens():
    hc, hf = _hf_model()
    cfg = TorchModelConfig.from_hf(hc)
    m = ShardedQwen3Moe.from_state_dict(hf.state_dict(), cfg, Shard(), Comm())
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 128, (n,), generator=g) for n in (11, 5)]
    cache = m.new_cache(32, 4)
    pts = [cache.alloc(len(p)) for p in prompts]
    with torch.no_grad():
        logits = m.forward_prefill(prompts, cache, pts)
        for i, p in enumerate(prompts):
            ref = hf(p[None]).logits[0, -1]
            assert torch.allclose(logits[i], ref, atol=1e-5), (logits[i] - ref).abs().max()
        ref_tokens = [hf.generate(p[None], max_new_tokens=6, do_sample=False)[0, len(p):].tolist() for p in prompts]
    # batched greedy decode of both sequences together
    toks = [[int(logits[i].argmax())] for i in range(2)]
    pos = [len(p) for p in prompts]
    for _ in range(5):
        for i in range(2):
            cache.grow(pts[i], pos[i] + 1)
        width = max(len(pt) for pt in pts)
        table = torch.tensor([pt + [pt[0]] * (width - len(pt)) for pt in pts])
        lo = m.forward_decode(torch.tensor([t[-1] for t in toks]), torch.tensor(pos), cache, table)
        for i in range(2):
            toks[i].append(int(lo[i].argmax()))
            pos[i] += 1
    assert toks == ref_tokens


def _sharded_prefill_rank(rank, world, tp, ep, seed):
    group = dist.new_group(list(range(world))) if world > 1 else None
    shard = Shard(attn_tp=tp, attn_rank=rank % tp, ep=ep, ep_rank=rank % ep)
    comm = Comm(tp_group=group if tp > 1 else None, ep_group=group if ep > 1 else None)
    m = ShardedQwen3Moe.random(CFG, shard, comm, seed=seed)
    g = torch.Generator().manual_seed(seed + 7)
    prompts = [torch.randint(0, CFG.vocab, (n,), generator=g) for n in (9, 4, 13)]
    cache = m.new_cache(32, 4)
    pts = [cache.alloc(len(p)) for p in prompts]
    return m.forward_prefill(prompts, cache, pts)


def _cached_prefix_prefill(m, seed):
    """Logits of a full prefill and of a prefill of the same prompts whose first pages come from a cached prefix
    (shared pages, suffix positions offset by the prefix), in one batch with an uncached prompt; also whether the
    shared prefix pages were left untouched."""
    g = torch.Generator().manual_seed(seed + 11)
    prompts = [torch.randint(0, CFG.vocab, (n,), generator=g) for n in (13, 6, 9)]
    cached = [8, 0, 4]                          # whole pages (page_tokens 4) of prompts 0 and 2
    cache = m.new_cache(64, 4)
    full = m.forward_prefill(prompts, cache, [cache.alloc(len(p)) for p in prompts])
    # the prefixes' KV, computed by an earlier prefill of those prefixes alone and kept in its pages
    pre = [cache.alloc(c) for c in cached if c]
    m.forward_prefill([p[:c] for p, c in zip(prompts, cached) if c], cache, pre)
    snap = cache.storage[:, [x for pt in pre for x in pt]].clone()
    shared, it = [], iter(pre)
    for p, c in zip(prompts, cached):
        pt = cache.share(next(it)) if c else []
        cache.grow(pt, len(p))
        shared.append(pt)
    part = m.forward_prefill([p[c:] for p, c in zip(prompts, cached)], cache, shared, starts=cached)
    untouched = bool(torch.equal(snap, cache.storage[:, [x for pt in pre for x in pt]]))
    return full, part, untouched


def test_prefill_after_a_cached_prefix_equals_a_full_prefill():
    m = ShardedQwen3Moe.random(CFG, Shard(), Comm(), seed=3)
    full, part, untouched = _cached_prefix_prefill(m, 3)
    assert torch.allclose(part, full, atol=1e-5), (part - full).abs().max()
    assert part.argmax(-1).tolist() == full.argmax(-1).tolist()
    assert untouched


def _dp_ep_decode_rank(rank, world, seed):
    group = dist.new_group(list(range(world)))
    m = ShardedQwen3Moe.random(CFG, Shard(attn_tp=1, ep=world, ep_rank=rank), Comm(ep_group=group), seed=seed)
    g = torch.Generator().manual_seed(seed + rank)      # each DP rank has its own, different batch
    n_seq = [3, 1][rank % 2]
    prompts = [torch.randint(0, CFG.vocab, (5 + i,), generator=g) for i in range(n_seq)]
    cache = m.new_cache(32, 4)
    pts = [cache.alloc(len(p) + 1) for p in prompts]
    # prefill with ep all-reduce would need every rank: use the single-rank path for the KV, via a full model copy
    full = ShardedQwen3Moe.random(CFG, Shard(), Comm(), seed=seed)
    full.forward_prefill(prompts, cache, pts)
    last = torch.tensor([int(p[-1]) for p in prompts])
    pos = torch.tensor([len(p) for p in prompts])
    width = max(len(pt) for pt in pts)
    table = torch.tensor([pt + [pt[0]] * (width - len(pt)) for pt in pts])
    sharded = m.forward_decode(last, pos, cache, table)
    cache2 = full.new_cache(32, 4)
    pts2 = [cache2.alloc(len(p) + 1) for p in prompts]
    full.forward_prefill(prompts, cache2, pts2)
    ref = full.forward_decode(last, pos, cache2, torch.tensor([pt + [pt[0]] * (width - len(pt)) for pt in pts2]))
    return (sharded - ref).abs().max().item()


def _all_cases_rank(rank, world, seed):
    """One spawn for every sharded case (process start-up dominates on CPU)."""
    out = {}
    for tp, ep in [(2, 2), (2, 1), (1, 2)]:
        out[(tp, ep)] = _sharded_prefill_rank(rank, world, tp, ep, seed)
    out["dp_ep_decode_err"] = _dp_ep_decode_rank(rank, world, seed)
    group = dist.new_group(list(range(world)))
    m = ShardedQwen3Moe.random(CFG, Shard(attn_tp=2, attn_rank=rank, ep=2, ep_rank=rank),
                               Comm(tp_group=group, ep_group=group), seed=seed)
    out["cached_prefix"] = _cached_prefix_prefill(m, seed)
    return out


@pytest.fixture(scope="module")
def two_rank_results():
    return spawn_local(_all_cases_rank, 2, 3)


@pytest.mark.slow
@pytest.mark.parametrize("tp,ep", [(2, 2), (2, 1), (1, 2)])
def test_sharded_prefill_equals_unsharded(two_rank_results, tp, ep):
    ref = _sharded_prefill_rank(0, 1, 1, 1, 3)
    for res in two_rank_results:
        assert torch.allclose(res[(tp, ep)], ref, atol=1e-5), (res[(tp, ep)] - ref).abs().max()


@pytest.mark.slow
def test_tp_prefill_after_a_cached_prefix_equals_a_full_prefill(two_rank_results):
    """Each TP rank holds its own KV heads of the shared prefix pages; the suffix prefill reads them."""
    ref = _cached_prefix_prefill(ShardedQwen3Moe.random(CFG, Shard(), Comm(), seed=3), 3)[0]
    for res in two_rank_results:
        full, part, untouched = res["cached_prefix"]
        assert torch.allclose(full, ref, atol=1e-5) and torch.allclose(part, ref, atol=1e-5), (part - ref).abs().max()
        assert untouched


@pytest.mark.slow
def test_dp_ep_decode_equals_unsharded(two_rank_results):
    errs = [res["dp_ep_decode_err"] for res in two_rank_results]
    assert max(errs) < 1e-5, errs


def test_kv_replication_when_tp_exceeds_kv_heads():
    shard = Shard(attn_tp=4, attn_rank=3)
    assert list(shard.kv_heads(CFG)) == [1]          # 2 KV heads over 4 ranks: ranks 2,3 hold head 1
    assert list(shard.q_heads(CFG)) == [6, 7]
    with pytest.raises(ValueError, match="does not divide"):
        Shard(attn_tp=3).q_heads(CFG)


@settings(max_examples=60, derandomize=True, deadline=None)
@given(st_.lists(st_.tuples(st_.sampled_from(["alloc", "share", "free"]), st_.integers(0, 9), st_.integers(1, 9)),
                 max_size=40))
def test_page_refcounts_free_a_page_exactly_when_its_last_holder_lets_go(ops):
    """Pages held by several owners (sequences, a prefix cache) return to the free list only when the last owner
    frees them, never twice, and a page is never both free and held."""
    from rackbed.engine.real.model import PagedKvCache

    cache = PagedKvCache(1, 12, 1, 4, 2)
    owners: list[list[int]] = []
    for op, i, n in ops:
        if op == "alloc":
            try:
                owners.append(cache.alloc(n))
            except MemoryError:
                assert len(cache.free_pages) < -(-n // 4)
        elif op == "share" and owners:
            owners.append(cache.share(owners[i % len(owners)]))
        elif op == "free" and owners:
            cache.free(owners.pop(i % len(owners)))
        held = {}
        for pages in owners:
            for p in pages:
                held[p] = held.get(p, 0) + 1
        assert not set(held) & set(cache.free_pages)
        assert len(set(cache.free_pages)) == len(cache.free_pages) == 12 - len(held)
        assert all(cache.refs[p] == k for p, k in held.items())
    for pages in owners:
        cache.free(pages)
    assert sorted(cache.free_pages) == list(range(12))
    with pytest.raises(ValueError, match="freed more often"):
        cache.free([0])
