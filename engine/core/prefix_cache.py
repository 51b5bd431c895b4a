"""A per-worker prefix cache of KV blocks keyed by block hash, with LRU eviction, pins and offload tiers.

Requests that share a prompt prefix (multi-turn chat, agents, a common system prompt) share its KV. A worker keeps
the KV of prompts it prefilled, cut into blocks of ``block_tokens`` tokens, each named by a *chained* key: the key
of block ``i`` identifies the whole prefix ``0..i`` (Mooncake's ``hash_ids``, or a real engine's hash of
(parent key, block tokens)). A request can reuse block ``i`` only if blocks ``0..i-1`` are reused too: a match is
the longest prefix of the request's keys that the cache holds.

Tiers. Tier 0 is HBM (the only tier a prefill can read); lower tiers are offload targets in order (host memory —
Grace LPDDR5X over NVLink-C2C on GB200, CPU DRAM over PCIe on HGX — then an optional storage tier), each with a
capacity in blocks. A private tier holds a block in exactly one place (tiers of one cache are *exclusive*): an
HBM eviction *demotes* the block to the next tier (whose own LRU block moves one tier further down, and falls out
of the last tier), and a hit in a lower tier *promotes* the block back to HBM (moved, the caller charges the copy).
A :class:`SharedTier` (storage several workers reach) is *inclusive*: a promotion copies a block out of it and it
keeps its copy; any cache sharing it finds the blocks the others demoted there.

Pins. :meth:`PrefixCache.acquire` pins the matched blocks for an in-flight request and :meth:`PrefixCache.insert`
adds (and pins) the blocks it computes; :meth:`PrefixCache.release` unpins them all. A pinned block is never
evicted, demoted or dropped; when every HBM block is pinned, an insertion or a promotion that needs room simply
stops there (the rest of the prefix is not cached, and the request prefills it).

Eviction is LRU over unpinned HBM blocks (the evictable queue holds exactly the unpinned HBM blocks, oldest first;
a block's age counts from its last release). A release unpins a request's blocks from the last to the first, so a
prefix's tail is evicted before its head (a head evicted first would strand its tail: unusable, yet taking room).
Lower tiers are LRU too, a block entering at the young end.

The API (used by the simulator's scheduler and the real engine alike; keys are any hashable values)::

    cache = PrefixCache(hbm_blocks=1024, block_tokens=512, lower=(TierSpec("host", 8192),))
    keys = cacheable_keys(hash_ids, prompt_tokens, 512)     # full blocks, never the prompt's last token
    m = cache.lookup(keys)            # read-only: m.blocks matched, m.per_tier[t] of them in tier t
    pin = cache.acquire(keys, prompt_tokens)  # pins + promotes the match, counts hits; pin.cached_tokens,
                                              # pin.copied[t] blocks copied up from tier t (t >= 1)
    ... prefill prompt_tokens - pin.cached_tokens tokens ...
    cache.insert(pin, keys)           # caches (and pins) the blocks beyond the match; returns how many were added
    cache.release(pin)                # the request no longer needs them (idempotent)
    cache.clear()                     # the worker died: its private tiers are gone, every pin void
    cache.stats                       # CacheStats: lookups, prompt/hit/miss tokens and blocks, per tier, ...

:meth:`PrefixCache.check` asserts every structural invariant (capacities, exclusivity, pins only on HBM blocks,
the evictable queue = unpinned HBM blocks); ``tests/test_prefix_cache.py`` runs it after every operation of random
traces and recounts the hits by brute force.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

Key = Hashable
HBM = "hbm"


def cacheable_keys(hash_ids: Sequence[Key], prompt_tokens: int, block_tokens: int,
                   unit_tokens: int | None = None) -> tuple[Key, ...]:
    """The cache keys of a prompt's cacheable blocks: full blocks of ``block_tokens`` tokens that end before the
    prompt's last token (prefill must compute at least that token to produce the first output token's logits, so a
    block holding it is never cached; a trailing partial block is not cacheable either).

    ``hash_ids`` are chained ids of ``unit_tokens``-token blocks (Mooncake: 512; ``None``: ``block_tokens``).
    Other block sizes are derived: a block smaller than the unit and dividing it is keyed ``(unit id, j)`` (j-th
    sub-block; chained, since the unit id names the whole prefix before it); a block that is a multiple of the unit
    is keyed by the id of its last unit. Any other ratio is a ValueError."""
    unit = block_tokens if unit_tokens is None else unit_tokens
    if block_tokens < 1 or unit < 1:
        raise ValueError(f"block_tokens and unit_tokens must be >= 1, got {block_tokens} and {unit}")
    n = max(0, (prompt_tokens - 1) // block_tokens)
    if unit == block_tokens:
        return tuple(hash_ids[:n])
    if unit % block_tokens == 0:
        k = unit // block_tokens
        n = min(n, len(hash_ids) * k)
        return tuple((hash_ids[i // k], i % k) for i in range(n))
    if block_tokens % unit == 0:
        k = block_tokens // unit
        n = min(n, len(hash_ids) // k)
        return tuple(hash_ids[(i + 1) * k - 1] for i in range(n))
    raise ValueError(f"block_tokens {block_tokens} must divide or be a multiple of the trace's {unit}-token blocks")


@dataclass(frozen=True)
class TierSpec:
    """A private lower tier: ``name`` (e.g. "host", "storage") and its capacity in blocks (>= 0)."""

    name: str
    capacity_blocks: int

    def __post_init__(self) -> None:
        if self.capacity_blocks < 0:
            raise ValueError(f"tier {self.name}: capacity_blocks must be >= 0, got {self.capacity_blocks}")


class SharedTier:
    """A lower tier several caches share (e.g. storage every worker reaches): inclusive, LRU, never pinned.

    ``blocks`` maps key -> None in LRU order (oldest first). ``drops`` counts blocks that fell out of it."""

    def __init__(self, name: str, capacity_blocks: int) -> None:
        if capacity_blocks < 0:
            raise ValueError(f"tier {name}: capacity_blocks must be >= 0, got {capacity_blocks}")
        self.name = name
        self.capacity_blocks = capacity_blocks
        self.blocks: OrderedDict[Key, None] = OrderedDict()
        self.drops = 0

    def put(self, key: Key) -> None:
        """Store (or refresh) ``key``; the LRU block falls out when the tier is full."""
        b = self.blocks
        if key in b:
            b.move_to_end(key)
            return
        if self.capacity_blocks == 0:
            self.drops += 1
            return
        if len(b) >= self.capacity_blocks:
            b.popitem(last=False)
            self.drops += 1
        b[key] = None


@dataclass
class Match:
    """What :meth:`PrefixCache.lookup` found: the matched prefix (``blocks`` keys) and the tier of each block."""

    tiers: tuple[int, ...]           # tiers[i]: tier index holding block i of the match (0 = HBM)
    n_tiers: int

    @property
    def blocks(self) -> int:
        return len(self.tiers)

    @property
    def per_tier(self) -> tuple[int, ...]:
        """Matched blocks held in each tier (index 0 = HBM)."""
        out = [0] * self.n_tiers
        for t in self.tiers:
            out[t] += 1
        return tuple(out)


@dataclass
class Pin:
    """An in-flight request's hold on cache blocks (from :meth:`PrefixCache.acquire`, extended by ``insert``).

    keys:          the pinned keys (a prefix of the request's keys: the hit, then the inserted blocks).
    hit_blocks:    blocks reused from the cache (the prefill skips ``cached_tokens = hit_blocks * block_tokens``).
    copied:        copied[t] = hit blocks that were copied up from tier t (t >= 1; copied[0] = 0): the request
                   waits for these copies before its prefill.
    """

    keys: list[Key]
    hit_blocks: int
    copied: tuple[int, ...]
    block_tokens: int
    epoch: int
    released: bool = False

    @property
    def cached_tokens(self) -> int:
        return self.hit_blocks * self.block_tokens


@dataclass
class CacheStats:
    """Hit accounting (counted by :meth:`PrefixCache.acquire`, one per request served) and block traffic.

    requests:       acquisitions.
    prompt_tokens:  prompt tokens of those requests;  query_blocks: cacheable blocks they asked for.
    hit_blocks[t]:  matched blocks found in tier t (all reused: promoted to HBM when below it).
    miss_blocks:    query_blocks - sum(hit_blocks).
    inserted:       blocks added to HBM by ``insert``;  not_cached: blocks ``insert`` could not place (pins).
    demoted[t]:     blocks evicted from tier t into a lower tier (the next one with room for blocks).
    dropped[t]:     blocks evicted from tier t out of the cache (no lower tier; a shared tier counts its own).
    promoted[t]:    hit blocks moved (private tier) or copied (shared tier) from tier t up to HBM.
    """

    n_tiers: int
    block_tokens: int
    requests: int = 0
    prompt_tokens: int = 0
    query_blocks: int = 0
    hit_blocks: list[int] = field(default_factory=list)
    inserted: int = 0
    not_cached: int = 0
    demoted: list[int] = field(default_factory=list)
    promoted: list[int] = field(default_factory=list)
    dropped: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        for name in ("hit_blocks", "demoted", "promoted", "dropped"):
            if not getattr(self, name):
                setattr(self, name, [0] * self.n_tiers)

    @property
    def miss_blocks(self) -> int:
        return self.query_blocks - sum(self.hit_blocks)

    @property
    def hit_tokens(self) -> int:
        return sum(self.hit_blocks) * self.block_tokens

    @property
    def hit_rate_tokens(self) -> float:
        """Prompt tokens served from the cache / prompt tokens (0 without requests)."""
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def add(self, other: CacheStats) -> None:
        """Accumulate ``other`` (another worker's stats, same tiers) into this one."""
        if other.n_tiers != self.n_tiers:
            raise ValueError("CacheStats.add: different tier counts")
        for name in ("requests", "prompt_tokens", "query_blocks", "inserted", "not_cached"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for name in ("hit_blocks", "demoted", "promoted", "dropped"):
            mine = getattr(self, name)
            for i, v in enumerate(getattr(other, name)):
                mine[i] += v


class PrefixCache:
    """One worker's block cache: HBM (tier 0, ``hbm_blocks``) and the ``lower`` tiers in order (see the module
    docstring for the semantics). ``lower`` entries are :class:`TierSpec` (private, exclusive) or
    :class:`SharedTier` (shared, inclusive; only as the last tier)."""

    def __init__(self, hbm_blocks: int, block_tokens: int = 512,
                 lower: Sequence[TierSpec | SharedTier] = ()) -> None:
        if hbm_blocks < 0:
            raise ValueError(f"hbm_blocks must be >= 0, got {hbm_blocks}")
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
        for t in lower[:-1]:
            if isinstance(t, SharedTier):
                raise ValueError(f"shared tier {t.name} must be the last tier")  # noqa: TRY004 (an order rule)
        self.block_tokens = block_tokens
        self.names: tuple[str, ...] = (HBM, *(t.name for t in lower))
        self.capacity: tuple[int, ...] = (hbm_blocks, *(t.capacity_blocks for t in lower))
        self.shared: SharedTier | None = lower[-1] if lower and isinstance(lower[-1], SharedTier) else None
        n_private = len(self.names) - (1 if self.shared is not None else 0)
        self._n_private = n_private
        # private tiers: key -> None in LRU order (oldest first); HBM's dict holds the *unpinned* blocks only
        self._lru: list[OrderedDict[Key, None]] = [OrderedDict() for _ in range(n_private)]
        self._where: dict[Key, int] = {}        # key -> private tier holding it
        self._refs: dict[Key, int] = {}         # pinned HBM key -> pin count (>= 1)
        self._hbm_used = 0                      # HBM blocks, pinned included
        self._epoch = 0
        self.stats = CacheStats(n_tiers=len(self.names), block_tokens=block_tokens)

    # ------------------------------------------------------------------ queries
    @property
    def n_tiers(self) -> int:
        return len(self.names)

    def used(self, tier: int) -> int:
        """Blocks tier ``tier`` holds now."""
        if tier == 0:
            return self._hbm_used
        if tier < self._n_private:
            return len(self._lru[tier])
        assert self.shared is not None
        return len(self.shared.blocks)

    def pinned(self) -> int:
        """HBM blocks pinned by in-flight requests."""
        return len(self._refs)

    def refcount(self, key: Key) -> int:
        return self._refs.get(key, 0)

    def tier_of(self, key: Key) -> int | None:
        """The tier holding ``key`` (the highest one, for a key also in the shared tier), None if not cached."""
        t = self._where.get(key)
        if t is not None:
            return t
        if self.shared is not None and key in self.shared.blocks:
            return self._n_private
        return None

    def lookup(self, keys: Sequence[Key]) -> Match:
        """The longest cached prefix of ``keys`` and where each of its blocks is; changes nothing."""
        tiers = []
        for k in keys:
            t = self.tier_of(k)
            if t is None:
                break
            tiers.append(t)
        return Match(tuple(tiers), self.n_tiers)

    # ------------------------------------------------------------------ the request's life
    def acquire(self, keys: Sequence[Key], prompt_tokens: int) -> Pin:
        """Pin the longest cached prefix of ``keys`` for a request of ``prompt_tokens`` tokens, promoting the
        blocks found in lower tiers to HBM (in chain order, while HBM room can be made: the match stops at the
        first block that cannot be placed), and count the request's hits. The request reuses ``pin.hit_blocks``
        blocks and waits for ``pin.copied[t]`` block copies from each tier t."""
        st = self.stats
        st.requests += 1
        st.prompt_tokens += prompt_tokens
        st.query_blocks += len(keys)
        pinned: list[Key] = []
        copied = [0] * self.n_tiers
        for k in keys:
            t = self.tier_of(k)
            if t is None:
                break
            if t == 0:
                self._pin(k)
            elif not self._promote(k, t):
                break
            pinned.append(k)
            st.hit_blocks[t] += 1
            copied[t] += t > 0
        return Pin(pinned, len(pinned), tuple(copied), self.block_tokens, self._epoch)

    def insert(self, pin: Pin, keys: Sequence[Key]) -> int:
        """After the prefill of the request holding ``pin``: cache (and pin to it) the blocks of ``keys`` beyond
        those it already pins, in chain order, evicting unpinned HBM blocks as needed; stops at the first block
        that finds no room (every HBM block pinned). A block already in HBM is pinned; one in a lower tier is moved
        up (freshly computed: no copy to charge). Returns the blocks newly added to HBM."""
        if pin.released or pin.epoch != self._epoch:
            return 0
        if list(keys[:len(pin.keys)]) != pin.keys:
            raise ValueError("insert: keys must extend the pin's keys")
        added = 0
        for i in range(len(pin.keys), len(keys)):
            k = keys[i]
            t = self._where.get(k)
            if t == 0:
                self._pin(k)
            else:
                if not self._can_place():
                    self.stats.not_cached += len(keys) - i
                    break
                self._place(k)                        # a copy in a private lower tier moves up
                added += 1
            pin.keys.append(k)
        self.stats.inserted += added
        return added

    def release(self, pin: Pin) -> None:
        """Unpin every block ``pin`` holds (a second release, or one after :meth:`clear`, does nothing). The
        blocks stay cached, refreshed in the LRU order (the prefix head the most recent)."""
        if pin.released:
            return
        pin.released = True
        if pin.epoch != self._epoch:
            return
        refs = self._refs
        hbm = self._lru[0]
        for k in reversed(pin.keys):
            n = refs[k] - 1
            if n:
                refs[k] = n
            else:
                del refs[k]
                hbm[k] = None
                hbm.move_to_end(k)

    def clear(self) -> None:
        """Drop every block of the private tiers and void all pins (the worker died or was drained). A shared
        tier keeps its blocks (it outlives the worker)."""
        for d in self._lru:
            d.clear()
        self._where.clear()
        self._refs.clear()
        self._hbm_used = 0
        self._epoch += 1

    # ------------------------------------------------------------------ internals
    def _pin(self, k: Key) -> None:
        refs = self._refs
        n = refs.get(k, 0)
        if n == 0:
            del self._lru[0][k]
        refs[k] = n + 1

    def _can_place(self) -> bool:
        """HBM has a free slot or an unpinned block to evict (no side effect)."""
        return self._hbm_used < self.capacity[0] or bool(self._lru[0])

    def _make_room(self) -> None:
        """One free HBM slot (the caller checked :meth:`_can_place`): evict the LRU unpinned block if full."""
        if self._hbm_used < self.capacity[0]:
            return
        k, _ = self._lru[0].popitem(last=False)
        del self._where[k]
        self._hbm_used -= 1
        self._demote(k, 0)

    def _demote(self, k: Key, frm: int) -> None:
        """``k`` just left tier ``frm``: place it in the next tier with room for blocks (a zero-capacity private
        tier is skipped), pushing that tier's LRU block further down; dropped when there is none."""
        st = self.stats
        to = frm + 1
        while to < self._n_private and self.capacity[to] == 0:
            to += 1
        if to >= self.n_tiers:
            st.dropped[frm] += 1
            return
        st.demoted[frm] += 1
        if to >= self._n_private:                     # the shared tier
            assert self.shared is not None
            self.shared.put(k)
            return
        d = self._lru[to]
        if len(d) >= self.capacity[to]:
            old, _ = d.popitem(last=False)
            del self._where[old]
            self._demote(old, to)
        d[k] = None
        self._where[k] = to

    def _place(self, k: Key) -> None:
        """Put ``k`` in HBM, pinned once (the caller made sure :meth:`_can_place`)."""
        t = self._where.get(k)
        if t is not None:                             # leaves its private lower tier first (frees a slot there)
            del self._lru[t][k]
            del self._where[k]
        self._make_room()
        self._where[k] = 0
        self._hbm_used += 1
        self._refs[k] = self._refs.get(k, 0) + 1

    def _promote(self, k: Key, tier: int) -> bool:
        """Move (private tier) or copy (shared tier) ``k`` from ``tier`` to HBM, pinned; False if HBM has no
        room (every block pinned)."""
        if not self._can_place():
            return False
        self._place(k)
        self.stats.promoted[tier] += 1
        return True

    # ------------------------------------------------------------------ invariants
    def check(self) -> None:
        """Assert the structural invariants (tests call it after every operation)."""
        assert self._hbm_used <= self.capacity[0], "HBM over capacity"
        hbm_keys = [k for k, t in self._where.items() if t == 0]
        assert len(hbm_keys) == self._hbm_used, "HBM count"
        assert set(self._lru[0]) | set(self._refs) == set(hbm_keys), "HBM blocks = evictable + pinned"
        assert not (set(self._lru[0]) & set(self._refs)), "a pinned block is evictable"
        assert all(n >= 1 for n in self._refs.values()), "refcounts"
        for t in range(1, self._n_private):
            assert len(self._lru[t]) <= self.capacity[t], f"tier {self.names[t]} over capacity"
            assert all(self._where.get(k) == t for k in self._lru[t]), f"tier {self.names[t]} index"
        assert sum(len(d) for d in self._lru[1:]) + self._hbm_used == len(self._where), "exclusive tiers"
        if self.shared is not None:
            assert len(self.shared.blocks) <= self.shared.capacity_blocks, "shared tier over capacity"


# ------------------------------------------------------------------ a deployment's caches
@dataclass(frozen=True)
class PrefixCacheSpec:
    """The prefix caches of a deployment: one :class:`PrefixCache` per prefiller (per aggregated worker).

    block_tokens:  tokens per cached block;  unit_tokens: tokens per id of ``Request.prefix_hash_ids`` (512,
                   Mooncake's block) — see :func:`cacheable_keys`.
    hbm_blocks:    HBM blocks per worker (the cache's carve-out of the worker's memory).
    lower:         private lower tiers per worker, in order (host memory, then storage).
    shared:        a storage tier every worker shares (``(name, capacity_blocks)``), or None.
    tier_GBps:     per lower tier (``lower`` then ``shared``), the bandwidth (GB/s) one GPU copies blocks up into
                   HBM with: a worker's ``g`` GPUs each copy their share of the KV over their own link, so a copy
                   of ``n`` bytes takes ``latency_s + n / (g * GBps * 1e9)`` (:meth:`load_s`).
    tier_latency_s: per lower tier, a fixed latency per copy (one per tier a batch loads from).
    """

    hbm_blocks: int
    block_tokens: int = 512
    unit_tokens: int = 512
    lower: tuple[TierSpec, ...] = ()
    shared: TierSpec | None = None
    tier_GBps: tuple[float, ...] = ()
    tier_latency_s: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        n = len(self.lower) + (self.shared is not None)
        if len(self.tier_GBps) != n or any(not b > 0 for b in self.tier_GBps):
            raise ValueError(f"PrefixCacheSpec.tier_GBps: one bandwidth > 0 per lower tier ({n}), got "
                             f"{self.tier_GBps}")
        if self.tier_latency_s and len(self.tier_latency_s) != n:
            raise ValueError("PrefixCacheSpec.tier_latency_s: one latency per lower tier")
        cacheable_keys((), 1, self.block_tokens, self.unit_tokens)  # the block/unit ratio check

    def shared_tier(self) -> SharedTier | None:
        """A fresh shared tier for a run (None without one)."""
        return SharedTier(self.shared.name, self.shared.capacity_blocks) if self.shared is not None else None

    def make(self, shared: SharedTier | None) -> PrefixCache:
        """One worker's cache (``shared``: the run's shared tier, from :meth:`shared_tier`)."""
        lower: list[TierSpec | SharedTier] = list(self.lower)
        if shared is not None:
            lower.append(shared)
        return PrefixCache(self.hbm_blocks, self.block_tokens, lower)

    def keys(self, hash_ids: Sequence[Key], prompt_tokens: int) -> tuple[Key, ...]:
        return cacheable_keys(hash_ids, prompt_tokens, self.block_tokens, self.unit_tokens)

    def load_s(self, loads: Sequence[tuple[int, int, int]], n_gpus: int) -> float:
        """Seconds a batch waits for its copies ``(request_id, tier, n_bytes)`` into HBM on a worker of
        ``n_gpus`` GPUs: the copies of one tier share its links (serial), different tiers run in parallel."""
        per: dict[int, int] = {}
        for _, t, b in loads:
            per[t] = per.get(t, 0) + b
        lat = self.tier_latency_s
        return max((b / (n_gpus * self.tier_GBps[t - 1] * 1e9) + (lat[t - 1] if lat else 0.0)
                    for t, b in per.items()), default=0.0)
