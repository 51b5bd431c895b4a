"""The shapes the real engine's CUDA graphs are captured at, shared with the simulator's engine calibration.

A graph replays fixed shapes, so the engine pads every step to a captured bucket and pays for the padding: a decode
batch of B sequences runs at the next batch bucket, a prefill chunk of n tokens at the next token bucket, attending
over its sequence's pages rounded up to ``PAGE_ROUND`` pages (the attention of a chunk computes every query against
every key of that row, masked by position). The engine calibration prices an aggregated worker's step in these
padded terms (``sim.engine_calibration.mixed_shape``), because they are what the GPU computes."""

from __future__ import annotations

DECODE_BATCH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
PREFILL_TOKEN_BUCKETS = (16, 32, 64, 128) + tuple(range(256, 1024, 128)) + tuple(range(1024, 16385, 256))
#: page-table widths are padded to a multiple of this many pages
PAGE_ROUND = 8


def bucket(n: int, buckets) -> int | None:
    """The smallest bucket holding ``n`` (None past the largest)."""
    return next((b for b in buckets if b >= n), None)


def padded_pages(n_tokens: int, page_tokens: int) -> int:
    """Pages of a row holding ``n_tokens``, rounded up to ``PAGE_ROUND``."""
    pages = -(-n_tokens // page_tokens)
    return -(-pages // PAGE_ROUND) * PAGE_ROUND


def prefill_key(start: int, n: int, page_tokens: int) -> tuple[int, int] | None:
    """(token bucket, padded pages) of a prefill chunk of ``n`` tokens after ``start``; None past the buckets."""
    tb = bucket(n, PREFILL_TOKEN_BUCKETS)
    return None if tb is None else (tb, padded_pages(start + n, page_tokens))


def prefill_padded(start: int, n: int, page_tokens: int) -> tuple[int, int]:
    """(tokens computed, query-key pairs computed) of that chunk as the engine runs it: the bucket's tokens, each
    against the padded row's keys; a chunk past the largest bucket runs eagerly, causal, unpadded."""
    key = prefill_key(start, n, page_tokens)
    if key is None:
        return n, n * start + n * (n + 1) // 2
    tb, pages = key
    return tb, tb * pages * page_tokens


def _sum_ends(n1: int, n2: int, e1: int, e2: int) -> int:
    """How many pairs ``(n, e)`` with ``n1 <= n <= n2`` and ``max(n, e1) <= e <= e2``."""
    total = 0
    if n1 <= min(n2, e1):                        # n <= e1: every end in e1..e2
        total += (min(n2, e1) - n1 + 1) * max(0, e2 - e1 + 1)
    a, b = max(n1, e1 + 1), min(n2, e2)          # e1 < n <= e2: ends n..e2
    if a <= b:
        total += (b - a + 1) * (2 * e2 - a - b + 2) // 2
    return total


def prefill_reach(lo: int, hi: int, page_tokens: int, *, chunk: int = 0, block_tokens: int = 0,
                  max_cached: int | None = None) -> tuple[dict[tuple[int, int], int], set[tuple[int, int]]]:
    """Every prefill key (:func:`prefill_key`) a run whose prompts are ``lo..hi`` tokens long can issue, with how
    many chunks ``(start, n)`` reach it, and the keys of chunks that start at token 0. The chunks a run issues:

    * whole prompts ``(0, L)``, ``lo <= L <= hi`` (``chunk`` 0, no prefix cache);
    * with a prefix cache of ``block_tokens``-token blocks (``block_tokens`` > 0), the suffix after a cached prefix
      too: ``(c, L - c)`` for every multiple ``c`` of ``block_tokens`` below ``L`` (the prompt's last token is always
      computed) and at most ``max_cached`` (None: no bound);
    * with chunks of at most ``chunk`` tokens, any ``(s, n)`` with ``1 <= n <= chunk`` and ``s + n <= hi``: the
      scheduler's chunks of a prompt, a cached prefix's suffix included, are such pairs.

    Chunks past the largest token bucket run eagerly and reach no key. Arithmetic per (length, bucket), not per
    chunk, so a 16k-token range is counted in well under a second."""
    S, R = page_tokens, PAGE_ROUND
    lo, hi = max(lo, 1), max(hi, 1)
    reach: dict[tuple[int, int], int] = {}
    zero: set[tuple[int, int]] = set()
    bounds = list(zip((0,) + PREFILL_TOKEN_BUCKETS, PREFILL_TOKEN_BUCKETS))     # bucket b holds n in (pb, b]

    def add(key, count):
        if count > 0:
            reach[key] = reach.get(key, 0) + count

    if chunk:
        top = min(chunk, hi)
        for pb, b in bounds:
            if pb >= top:
                break
            n1, n2 = pb + 1, min(b, top)
            zero.update((b, p) for p in range(padded_pages(n1, S), padded_pages(n2, S) + 1, R))   # s = 0, e = n
            for p in range(padded_pages(n1, S), padded_pages(hi, S) + 1, R):          # ends e in this page bucket
                add((b, p), _sum_ends(n1, n2, max((p - R) * S + 1, 1), min(p * S, hi)))
        return reach, zero
    step = block_tokens
    for L in range(lo, hi + 1):
        p = padded_pages(L, S)
        tb = bucket(L, PREFILL_TOKEN_BUCKETS)
        if tb is not None:
            zero.add((tb, p))
        if step <= 0:
            add((tb, p), 1 if tb is not None else 0)
            continue
        K = min(L - 1, L if max_cached is None else max_cached) // step            # cached prefixes c = k * step
        for pb, b in bounds:
            if pb >= L:
                break
            k1, k2 = max(0, -(-(L - b) // step)), min(K, (L - pb - 1) // step)      # pb < L - k * step <= b
            add((b, p), k2 - k1 + 1)
    return reach, zero


def prefill_warm_order(reach: dict[tuple[int, int], int], zero: set[tuple[int, int]],
                       limit: int | None = None) -> list[tuple[int, int]]:
    """The keys of :func:`prefill_reach` in the order to capture them, at most ``limit`` (None: all): the largest
    (token bucket x pages) first, so the graphs' shared memory pool is sized once; then the keys of chunks starting
    at token 0 (every prompt's first prefill may be a cache miss), largest first; then the rest by how many chunks
    reach them, most first (ties: larger first)."""
    if not reach:
        return []

    def rank(k):
        hit = k not in zero
        return hit, -reach[k] if hit else 0, -k[0] * k[1], -k[0], -k[1]

    first = max(reach, key=lambda k: (k[0] * k[1], k))
    out = [first] + sorted((k for k in reach if k != first), key=rank)
    return out if limit is None else out[:max(0, limit)]
