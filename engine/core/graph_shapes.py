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
