"""A rank's prefix cache: the KV pages of prompt blocks it prefilled, reused by later prompts that start the same way.

Blocks are named by their content: the key of block ``i`` is a hash of block ``i``'s token ids chained with block
``i - 1``'s key (:func:`block_hashes`), so two prompts get equal keys exactly as far as their tokens agree, block by
block — the real-engine counterpart of a trace's ``hash_ids``. Which blocks are cached, the LRU eviction and the
pins of in-flight requests are ``engine.core.prefix_cache.PrefixCache``'s (the simulator's scheduler uses the same
structure, keyed by the trace's ids); this class adds the pages:

- a cached block owns one reference to each of its pages (``PagedKvCache.share``); a sequence that hits a cached
  prefix takes references to the prefix's pages too — shared, never copied;
- a block is ``block_tokens`` tokens, a multiple of the cache's ``page_tokens``: a block is whole pages, so a
  sequence writes its suffix into pages of its own and a shared page is only ever read (no copy-on-write);
- a block the index evicts (LRU, unpinned) drops its references; the page returns to the free list only when no
  sequence holds it any more (``PagedKvCache.free``).

Only HBM (the rank's own KV cache) is a tier here: offload tiers are simulated, not run.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from rackbed.engine.core.prefix_cache import Pin, PrefixCache, cacheable_keys
from rackbed.engine.real.model import PagedKvCache


def block_hashes(token_ids: Sequence[int], block_tokens: int, n_blocks: int | None = None) -> list[int]:
    """Chained content keys of the first ``n_blocks`` full blocks of ``token_ids`` (None: every full block):
    ``key_i = blake2b(key_{i-1} || tokens of block i)`` as a 63-bit integer (equal in every process, unlike
    ``hash``)."""
    n = len(token_ids) // block_tokens if n_blocks is None else n_blocks
    arr = np.asarray(token_ids[:n * block_tokens], dtype=np.int64)
    out, prev = [], b""
    for i in range(n):
        d = hashlib.blake2b(prev + arr[i * block_tokens:(i + 1) * block_tokens].tobytes(), digest_size=8).digest()
        out.append(int.from_bytes(d, "little") & (2**63 - 1))
        prev = d
    return out


class RankPrefixCache:
    """Cached prompt blocks of one rank: ``blocks`` blocks of ``block_tokens`` tokens at most, their pages taken
    from ``kv`` (module docstring). Every rank of a TP group runs the same commands, so their caches hold the same
    blocks on the same page ids (each rank holds its own KV heads of them).

    ``hit_tokens`` / ``computed_tokens``: prompt tokens served from the cache / prefilled, over the rank's life."""

    def __init__(self, kv: PagedKvCache, blocks: int, block_tokens: int) -> None:
        if block_tokens < 1 or block_tokens % kv.page_tokens:
            raise ValueError(f"prefix cache block_tokens ({block_tokens}) must be a positive multiple of the KV "
                             f"cache's page_tokens ({kv.page_tokens}): a block is whole pages, so shared pages are "
                             "never written")
        self.kv = kv
        self.block_tokens = block_tokens
        self.pages_per_block = block_tokens // kv.page_tokens
        self.index = PrefixCache(hbm_blocks=blocks, block_tokens=block_tokens)
        self.pages: dict[int, list[int]] = {}         # cached key -> its pages (one reference each)
        self._dropped = 0
        self.hit_tokens = 0
        self.computed_tokens = 0

    def keys(self, token_ids: Sequence[int]) -> tuple[int, ...]:
        """The cacheable blocks' keys (full blocks that end before the prompt's last token)."""
        n = max(0, (len(token_ids) - 1) // self.block_tokens)
        return cacheable_keys(block_hashes(token_ids, self.block_tokens, n), len(token_ids), self.block_tokens)

    def acquire(self, token_ids: Sequence[int], cached: int | None) -> tuple[Pin, int, list[int]]:
        """Pin the longest cached prefix of ``token_ids``; reuse ``cached`` tokens of it (None: all of it; more
        than it holds: what it holds — the rest is recomputed, same KV). Returns ``(pin, reused tokens, the
        sequence's page list so far)``: the reused blocks' pages, shared."""
        pin = self.index.acquire(self.keys(token_ids), len(token_ids))
        hit = pin.cached_tokens
        c = hit if cached is None else min(int(cached), hit)
        c -= c % self.block_tokens
        pages: list[int] = []
        for k in pin.keys[:c // self.block_tokens]:
            pages += self.kv.share(self.pages[k])
        self.hit_tokens += c
        self.computed_tokens += len(token_ids) - c
        return pin, c, pages

    def insert(self, pin: Pin, token_ids: Sequence[int], pages: Sequence[int]) -> int:
        """After the prefill of ``token_ids`` into ``pages``: cache its blocks beyond the pinned prefix (the index
        may evict LRU unpinned blocks for them; their pages are let go). Returns the blocks added."""
        before = len(pin.keys)
        added = self.index.insert(pin, self.keys(token_ids))
        self._let_go_evicted()
        ppb = self.pages_per_block
        for i in range(before, len(pin.keys)):
            k = pin.keys[i]
            if k not in self.pages:
                self.pages[k] = self.kv.share(list(pages[i * ppb:(i + 1) * ppb]))
        return added

    def release(self, pin: Pin | None) -> None:
        """The sequence holding ``pin`` is gone: its blocks become evictable (its own page references are the
        caller's to free)."""
        if pin is not None:
            self.index.release(pin)

    def _let_go_evicted(self) -> None:
        dropped = self.index.stats.dropped[0]
        if dropped == self._dropped:
            return
        self._dropped = dropped
        for k in [k for k in self.pages if self.index.tier_of(k) != 0]:
            self.kv.free(self.pages.pop(k))

    def n_pages(self) -> int:
        """Pages the cache holds a reference to."""
        return len(self.pages) * self.pages_per_block
