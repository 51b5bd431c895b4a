"""Prefix reuse of a request stream, counted on ``Request.prefix_hash_ids`` with a brute-force cache model (a set,
``OrderedDict`` LRUs), independent of the simulator's :mod:`engine.core.prefix_cache`.

Used by ``rackbed trace stats`` (the reuse bound of a trace: infinite and LRU caches; see
``engine/cli/trace.py``) and by ``rackbed search`` (:func:`lru_reuse`: the hit rate a prefill pool of several
per-worker caches can expect, to discount the prefill work it plans for).

Prefix reuse is counted in arrival order, in prompt tokens: block j of a prompt of P tokens holds
``min(512, P - 512 j)`` of them. A request reuses the longest run of its leading blocks the cache holds; then all
its blocks are in the cache, its first block the most recently used (eviction takes the tails of prefix chains
before their heads, as vLLM's free block queue does). ``full_blocks``: only full blocks that end before the
prompt's last token count (what an engine's prefix cache holds).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

BLOCK = 512  # engine.core.traces.HASH_BLOCK_TOKENS


@dataclass(frozen=True)
class ReuseStats:
    """Prefix reuse of a request stream (module docstring). Fractions are of all prompt tokens, requests without
    ids included (they reuse nothing)."""

    prompt_tokens: int
    blocks: int                 # block ids over all requests
    distinct_blocks: int
    requests_with_ids: int
    inconsistent_ids: int       # ids seen at more than one block position: not whole-prefix ids
    reused_tokens_infinite: int
    reused_tokens_lru: dict[int, int]

    @property
    def infinite(self) -> float:
        return self.reused_tokens_infinite / self.prompt_tokens if self.prompt_tokens else 0.0

    def lru(self, blocks: int) -> float:
        return self.reused_tokens_lru[blocks] / self.prompt_tokens if self.prompt_tokens else 0.0


def _block_tokens(prompt: int, ids: Sequence[int], full_blocks: bool = False) -> list[int]:
    """Tokens of each block that lies (partly) in the prompt, ids past a clipped prompt dropped; with
    ``full_blocks``, only the full blocks that end before the prompt's last token."""
    if full_blocks:
        return [BLOCK] * min(len(ids), (prompt - 1) // BLOCK)
    n = min(len(ids), -(-prompt // BLOCK))
    return [min(BLOCK, prompt - BLOCK * j) for j in range(n)]


def prefix_reuse(requests: Iterable, cache_blocks: Sequence[int] = (), full_blocks: bool = False) -> ReuseStats:
    """Reuse of ``requests`` (``Request`` objects in arrival order) with an infinite cache and LRU caches of each
    size in ``cache_blocks``; ``full_blocks``: only full blocks before the last prompt token (module docstring)."""
    for c in cache_blocks:
        if c < 1:
            raise ValueError(f"--cache-blocks: must be >= 1, got {c}")
    seen: set[int] = set()
    pos: dict[int, int] = {}
    inconsistent: set[int] = set()
    lrus = {c: OrderedDict() for c in cache_blocks}
    hits_lru = dict.fromkeys(cache_blocks, 0)
    total = n_blocks = with_ids = hits_inf = 0
    for r in requests:
        total += r.prompt_tokens
        ids = r.prefix_hash_ids
        if not ids:
            continue
        with_ids += 1
        tokens = _block_tokens(r.prompt_tokens, ids, full_blocks)
        ids = ids[: len(tokens)]
        n_blocks += len(ids)
        hits_inf += _leading_hits(ids, tokens, seen)
        for j, h in enumerate(ids):
            if pos.setdefault(h, j) != j:
                inconsistent.add(h)
        seen.update(ids)
        for c, cache in lrus.items():
            hits_lru[c] += _leading_hits(ids, tokens, cache)
            _touch(cache, ids, c)
    return ReuseStats(total, n_blocks, len(seen), with_ids, len(inconsistent), hits_inf, hits_lru)


def _leading_hits(ids: Sequence[int], tokens: Sequence[int], cache) -> int:
    got = 0
    for h, t in zip(ids, tokens, strict=True):
        if h not in cache:
            break
        got += t
    return got


def lru_reuse(requests: Iterable, blocks: int, n_caches: int = 1, full_blocks: bool = True) -> float:
    """Fraction of all prompt tokens reused by ``n_caches`` LRU caches of ``blocks`` blocks each, requests dealt to
    the caches in turn (round robin, a cache unaware of where a prefix lives). ``n_caches=1`` with the pool's
    total capacity is the other extreme: routing that sends every request to the worker holding its prefix makes
    the workers' caches one cache. Lower-tier capacity counts as blocks too (a hit in any tier skips prefill)."""
    total, hits = lru_reuse_curve(requests, blocks, n_caches, full_blocks)
    return hits[-1] / total[-1] if total and total[-1] else 0.0


def lru_reuse_curve(requests: Iterable, blocks: int, n_caches: int = 1,
                    full_blocks: bool = True) -> tuple[list[int], list[int]]:
    """:func:`lru_reuse` after every request: ``(prompt tokens, reused tokens)`` of the first ``i + 1`` requests
    at index ``i``, so that the hit rate of any leading part of a stream (what a run of that many requests sees,
    cold caches included) costs one pass."""
    if blocks < 1 or n_caches < 1:
        raise ValueError(f"lru_reuse: blocks and n_caches must be >= 1, got {blocks}, {n_caches}")
    caches = [OrderedDict() for _ in range(n_caches)]
    total = hits = 0
    totals: list[int] = []
    reused: list[int] = []
    for i, r in enumerate(requests):
        total += r.prompt_tokens
        ids = r.prefix_hash_ids
        if ids:
            tokens = _block_tokens(r.prompt_tokens, ids, full_blocks)
            ids = ids[: len(tokens)]
            cache = caches[i % n_caches]
            hits += _leading_hits(ids, tokens, cache)
            _touch(cache, ids, blocks)
        totals.append(total)
        reused.append(hits)
    return totals, reused


def _touch(cache: OrderedDict, ids: Sequence[int], capacity: int) -> None:
    """``ids`` become the most recently used, the first most recent of all; the LRU blocks past ``capacity`` go."""
    for h in reversed(ids):
        if h in cache:
            cache.move_to_end(h)
        else:
            cache[h] = None
            if len(cache) > capacity:
                cache.popitem(last=False)
