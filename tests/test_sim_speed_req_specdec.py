"""``AcceptanceStream`` (refills written into one array) takes exactly what the straightforward stream takes: the
same step counts, the same segments (``tokens_after``) and the same RNG use, for the inversion draws (``p > 2/3``)
and ``rng.geometric`` (``p <= 2/3``), needs that cross or exceed a refill chunk included."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from rackbed.engine.core.specdec import AcceptanceStream


class _PlainStream:
    """The straightforward stream: per-step token counts ``min(Geometric(1 - p), k + 1)`` drawn ``max(chunk, m)``
    at a time when the current segment cannot cover ``m`` tokens, concatenated after the untaken tail."""

    def __init__(self, rng: np.random.Generator, k: int, p: float, chunk: int) -> None:
        self.rng, self.k, self.p, self.chunk = rng, k, p, chunk
        self.cum = np.zeros(1, dtype=np.int64)
        self.pos = 0

    def take(self, m: int) -> tuple[int, np.ndarray, int]:
        if int(self.cum[-1]) - int(self.cum[self.pos]) < m:
            tail = self.cum[self.pos:]
            steps = np.minimum(self.rng.geometric(1.0 - self.p, size=max(self.chunk, m)), self.k + 1)
            self.cum = np.concatenate((tail - tail[0], tail[-1] - tail[0] + np.cumsum(steps)))
            self.pos = 0
        pos = self.pos
        c = int(self.cum[pos])
        end = pos + 1
        while int(self.cum[end]) - c < m:
            end += 1
        self.pos = end
        return end - pos, self.cum, pos


@settings(max_examples=150, deadline=None)
@given(seed=st.integers(0, 2 ** 32 - 1), k=st.integers(1, 3), p=st.sampled_from([0.3, 0.5, 0.7, 0.8, 0.9]),
       chunk=st.sampled_from([8, 64, 1 << 16]), ms=st.lists(st.integers(1, 300), min_size=1, max_size=60))
def test_stream_takes_what_the_plain_stream_takes(seed, k, p, chunk, ms):
    a = AcceptanceStream(np.random.default_rng(seed), k, p, chunk=chunk)
    rng_b = np.random.default_rng(seed)
    b = _PlainStream(rng_b, k, p, chunk)
    for m in ms:
        n, cum, start = a.take(m)
        n_b, cum_b, start_b = b.take(m)
        assert n == n_b
        for s in (0, n // 2, n - 1, n):
            assert a.tokens_after(cum, start, s, m) == min(m, int(cum_b[start_b + s]) - int(cum_b[start_b]))
    # the same RNG use: both generators are in the same state
    assert a.rng.bit_generator.state == rng_b.bit_generator.state
