"""The prefix cache (``engine.core.prefix_cache``) against a naive reference and brute-force recounts.

Random traces of acquire / insert / release / clear over chained keys drawn from a small prefix tree (so requests
share prefixes) run on the cache and on a reference model written the slow, obvious way (every block a
``[tier, age]`` entry, eviction by a scan for the oldest unpinned block). After every operation: the two agree on
every tier's contents and LRU order, pin counts and statistics; no block a live request pins has left HBM; no tier
is over capacity (``PrefixCache.check``); blocks are conserved (cached now = blocks that entered - blocks dropped,
promotion and demotion only move them). With unbounded HBM the hits equal a brute-force recount: the longest prefix
of each request's keys among all keys inserted before it.
"""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from rackbed.engine.core.prefix_cache import PrefixCache, SharedTier, TierSpec, cacheable_keys


# ------------------------------------------------------------------ the reference model
class Ref:
    def __init__(self, caps):
        self.caps = caps                  # capacity per tier, tier 0 = HBM
        self.blocks = {}                  # key -> [tier, age]
        self.refs = {}
        self.clock = 0
        self.n = len(caps)
        self.hits = [0] * self.n
        self.promoted = [0] * self.n
        self.demoted = [0] * self.n
        self.dropped = [0] * self.n

    def tick(self):
        self.clock += 1
        return self.clock

    def in_tier(self, t):
        return [k for k, (tt, _) in self.blocks.items() if tt == t]

    def order(self, t):
        """Tier t's evictable keys, oldest first."""
        ks = [k for k in self.in_tier(t) if t > 0 or k not in self.refs]
        return sorted(ks, key=lambda k: self.blocks[k][1])

    def can_place(self):
        return len(self.in_tier(0)) < self.caps[0] or bool(self.order(0))

    def demote(self, k, frm):
        to = frm + 1
        while to < self.n and self.caps[to] == 0:
            to += 1
        if to >= self.n:
            self.dropped[frm] += 1
            return
        self.demoted[frm] += 1
        if len(self.in_tier(to)) >= self.caps[to]:
            old = self.order(to)[0]
            del self.blocks[old]
            self.demote(old, to)
        self.blocks[k] = [to, self.tick()]

    def place(self, k):
        self.blocks.pop(k, None)
        if len(self.in_tier(0)) >= self.caps[0]:
            old = self.order(0)[0]
            del self.blocks[old]
            self.demote(old, 0)
        self.blocks[k] = [0, 0]
        self.refs[k] = self.refs.get(k, 0) + 1

    def acquire(self, keys):
        got = []
        for k in keys:
            if k not in self.blocks:
                break
            t = self.blocks[k][0]
            if t == 0:
                self.refs[k] = self.refs.get(k, 0) + 1
            elif self.can_place():
                self.place(k)
                self.promoted[t] += 1
            else:
                break
            self.hits[t] += 1
            got.append(k)
        return got

    def insert(self, got, keys):
        for i in range(len(got), len(keys)):
            k = keys[i]
            if k in self.blocks and self.blocks[k][0] == 0:
                self.refs[k] = self.refs.get(k, 0) + 1   # an unpinned HBM block another request inserted
            elif self.can_place():
                self.place(k)
            else:
                break
            got.append(k)

    def release(self, got):
        for k in reversed(got):
            self.refs[k] -= 1
            if not self.refs[k]:
                del self.refs[k]
                self.blocks[k][1] = self.tick()

    def clear(self):
        self.blocks.clear()
        self.refs.clear()


# ------------------------------------------------------------------ random traces
def chains(max_len):
    """A request's chained keys: a path in a small tree (key i = the path's first i+1 steps)."""
    return st.lists(st.integers(0, 2), min_size=0, max_size=max_len).map(
        lambda p: tuple(tuple(p[:i + 1]) for i in range(len(p))))


ops = st.lists(st.one_of(
    st.tuples(st.just("request"), chains(6)),     # acquire, insert, release in a row
    st.tuples(st.just("acquire"), chains(6)),
    st.tuples(st.just("insert"), st.integers(0, 50)),
    st.tuples(st.just("release"), st.integers(0, 50)),
    st.tuples(st.just("clear"), st.just(0)),
), max_size=60)

caps_st = st.tuples(st.integers(0, 6), st.sampled_from([None, 0, 1, 3]), st.sampled_from([None, 0, 2]))


def _build(caps):
    hbm, host, storage = caps
    lower = []
    if host is not None:
        lower.append(TierSpec("host", host))
    if storage is not None:
        lower.append(TierSpec("storage", storage))
    cache = PrefixCache(hbm, block_tokens=4, lower=lower)
    return cache, Ref([hbm] + [t.capacity_blocks for t in lower])


def _agree(cache, ref):
    cache.check()
    for t in range(cache.n_tiers):
        assert set(ref.in_tier(t)) == {k for k, tt in cache._where.items() if tt == t}
        assert ref.order(t) == list(cache._lru[t])
    assert ref.refs == cache._refs
    s = cache.stats
    assert (s.hit_blocks, s.promoted, s.demoted, s.dropped) == (ref.hits, ref.promoted, ref.demoted, ref.dropped)


@pytest.mark.slow
@settings(max_examples=300)
@example(caps=(1, None, None), trace=[("acquire", ((0,),)), ("request", ((0,),)), ("insert", 0)])
@given(caps_st, ops)
def test_matches_reference_and_never_frees_a_pinned_block(caps, trace):
    cache, ref = _build(caps)
    live = []            # (pin, keys, ref's pinned keys, inserted?)
    for op, arg in trace:
        before = sum(cache.used(t) for t in range(cache.n_tiers))
        dropped = sum(cache.stats.dropped)
        new = 0
        if op == "request":
            pin = cache.acquire(arg, prompt_tokens=4 * len(arg) + 1)
            got = ref.acquire(arg)
            assert pin.keys == got
            uncached = {k for k in arg[len(pin.keys):] if cache.tier_of(k) is None}
            cache.insert(pin, arg)
            ref.insert(got, arg)
            assert pin.keys == got
            new = len(uncached & set(pin.keys))
            _agree(cache, ref)
            cache.release(pin)
            ref.release(got)
        elif op == "acquire":
            promoted = sum(cache.stats.promoted)
            pin = cache.acquire(arg, prompt_tokens=4 * len(arg) + 1)
            got = ref.acquire(arg)
            assert pin.keys == got and pin.hit_blocks == len(got)
            assert pin.copied[0] == 0 and sum(pin.copied) == sum(cache.stats.promoted) - promoted
            live.append([pin, arg, got, False])
        elif live and op in ("insert", "release"):
            item = live[arg % len(live)]
            pin, keys, got, done = item
            if op == "insert" and not done:
                uncached = {k for k in keys[len(pin.keys):] if cache.tier_of(k) is None}
                cache.insert(pin, keys)
                ref.insert(got, keys)
                assert pin.keys == got
                new = len(uncached & set(pin.keys))
                item[3] = True
            elif op == "release":
                cache.release(pin)
                ref.release(got)
                live.remove(item)
        elif op == "clear":
            cache.clear()
            ref.clear()
            for pin, *_ in live:
                cache.release(pin)      # void pins: releasing them changes nothing
            live.clear()
            before = dropped = 0
        _agree(cache, ref)
        # a live request's blocks are all in HBM, pinned at least once per live pin holding them
        for pin, *_ in live:
            for k in pin.keys:
                assert cache.tier_of(k) == 0
                assert cache.refcount(k) >= sum(k in p.keys for p, *_ in live)
        # conservation: promotion/demotion move blocks; only insertions add and drops remove
        if op != "clear":
            now = sum(cache.used(t) for t in range(cache.n_tiers))
            assert now - before == new - (sum(cache.stats.dropped) - dropped)


@settings(max_examples=200)
@given(st.lists(chains(8), max_size=40))
def test_hits_equal_brute_force_recount(requests):
    """Unbounded HBM: a request hits the longest prefix of its keys that any earlier request inserted."""
    cache = PrefixCache(10_000, block_tokens=16)
    seen: set = set()
    want_blocks = 0
    for keys in requests:
        pin = cache.acquire(keys, prompt_tokens=16 * len(keys) + 3)
        n = 0
        while n < len(keys) and keys[n] in seen:
            n += 1
        assert pin.hit_blocks == n and pin.cached_tokens == 16 * n
        want_blocks += n
        cache.insert(pin, keys)
        cache.release(pin)
        seen.update(keys)
    s = cache.stats
    assert s.hit_blocks[0] == want_blocks
    assert s.hit_tokens == 16 * want_blocks
    assert s.query_blocks == sum(len(k) for k in requests)
    assert s.miss_blocks == s.query_blocks - want_blocks
    assert s.prompt_tokens == sum(16 * len(k) + 3 for k in requests)


@settings(max_examples=100)
@given(st.lists(st.tuples(st.integers(0, 1), chains(5)), max_size=40), st.integers(0, 3), st.integers(0, 4))
def test_shared_tier_is_inclusive_and_bounded(trace, hbm, storage):
    """Two workers share a storage tier: it never exceeds its capacity and each worker's private invariants hold
    whatever the interleaving."""
    shared = SharedTier("storage", storage)
    caches = [PrefixCache(hbm, 4, lower=(shared,)) for _ in range(2)]
    for w, keys in trace:
        c = caches[w]
        pin = c.acquire(keys, 4 * len(keys) + 1)
        c.check()
        c.insert(pin, keys)
        c.release(pin)
        for cc in caches:
            cc.check()
        assert len(shared.blocks) <= storage


def test_shared_tier_serves_the_other_worker():
    """A block worker 0 demotes to shared storage is a hit for worker 1, copied up (storage keeps it)."""
    shared = SharedTier("storage", 8)
    w0, w1 = (PrefixCache(1, 4, lower=(TierSpec("host", 0), shared)) for _ in range(2))
    for keys in ((("a",)), ("b",)):
        pin = w0.acquire(keys, 5)
        w0.insert(pin, keys)
        w0.release(pin)
    assert list(shared.blocks) == ["a"] and w0.stats.demoted == [1, 0, 0]
    pin = w1.acquire(("a", "c"), 9)
    assert pin.hit_blocks == 1 and pin.copied == (0, 0, 1) and "a" in shared.blocks
    assert w1.tier_of("a") == 0 and w1.stats.hit_blocks == [0, 0, 1]


def test_lower_tier_hit_is_promoted_and_priced_as_a_copy():
    c = PrefixCache(2, 4, lower=(TierSpec("host", 4),))
    a = ("a",), ("a", "b")
    b = ("x",), ("x", "y")
    for keys in (a, b):
        pin = c.acquire(keys, 9)
        c.insert(pin, keys)
        c.release(pin)
    assert [c.tier_of(k) for k in a] == [1, 1] and [c.tier_of(k) for k in b] == [0, 0]
    assert c.lookup(a).per_tier == (0, 2)
    pin = c.acquire(a, 9)
    assert pin.hit_blocks == 2 and pin.copied == (0, 2) and pin.cached_tokens == 8
    assert [c.tier_of(k) for k in a] == [0, 0] and [c.tier_of(k) for k in b] == [1, 1]
    assert c.stats.promoted == [0, 2] and c.stats.demoted == [4, 0]


def test_all_pinned_means_not_cached():
    c = PrefixCache(2, 4)
    p1 = c.acquire(("a", "b"), 9)
    c.insert(p1, ("a", "b"))
    p2 = c.acquire(("x", "y"), 9)
    assert c.insert(p2, ("x", "y")) == 0 and c.stats.not_cached == 2
    assert c.tier_of("a") == 0 and c.refcount("a") == 1
    c.release(p1)
    c.release(p1)  # idempotent
    assert c.refcount("a") == 0 and c.pinned() == 0


def test_tail_evicted_before_head():
    c = PrefixCache(3, 4)
    keys = ("h", "m", "t")
    pin = c.acquire(keys, 13)
    c.insert(pin, keys)
    c.release(pin)
    pin = c.acquire(("z",), 5)
    c.insert(pin, ("z",))
    assert c.tier_of("t") is None and c.tier_of("h") == 0 and c.tier_of("m") == 0


def test_clear_voids_pins():
    c = PrefixCache(4, 4, lower=(TierSpec("host", 4),))
    pin = c.acquire(("a",), 5)
    c.insert(pin, ("a",))
    c.clear()
    assert c.lookup(("a",)).blocks == 0 and c.used(0) == 0
    assert c.insert(pin, ("a", "b")) == 0
    c.release(pin)
    c.check()


@pytest.mark.parametrize("prompt,block,unit,want", [
    (1024, 512, 512, (1,)),              # the block holding the last token is never cached
    (1025, 512, 512, (1, 2)),
    (5000, 512, 512, (1, 2, 3)),         # no more blocks than ids
    (700, 256, 512, ((1, 0), (1, 1))),   # sub-blocks of a 512-token unit
    (2049, 1024, 512, (2,)),             # a block of two units: the id of its last unit
    (1, 512, 512, ()),
])
def test_cacheable_keys(prompt, block, unit, want):
    assert cacheable_keys((1, 2, 3), prompt, block, unit) == want


def test_cacheable_keys_bad_ratio():
    with pytest.raises(ValueError, match="divide"):
        cacheable_keys((1,), 2000, 300, 512)
