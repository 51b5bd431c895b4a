"""MTP speculative decoding as a stochastic model.

Each decode step a sequence verifies ``k`` drafted tokens. Draft position ``i`` (1-based) is accepted with
probability ``p`` *given that positions 1..i-1 were accepted*; the first rejection ends the run. The step emits
``1 + accepted`` tokens (the verified prefix plus the target model's own token), so

    P(accepted >= j) = p**j  (0 <= j <= k),   E[tokens/step] = sum_{j=0..k} p**j = (1 - p**(k+1)) / (1 - p).

With the write-up's p = 0.8: k=1 → 1.8, k=2 → 2.44, k=3 → 2.952 tokens per step.

Draws come from a ``numpy.random.Generator`` the caller passes in (the scheduler's, seeded by the run), so every
driver that makes the same calls in the same order gets the same tokens.
"""

from __future__ import annotations

import math
from bisect import bisect_left

import numpy as np


def expected_tokens_per_step(k: int, p: float) -> float:
    """Closed form ``(1 - p**(k+1)) / (1 - p)`` (``k + 1`` at ``p == 1``)."""
    if p >= 1.0:
        return float(k + 1)
    return (1.0 - p ** (k + 1)) / (1.0 - p)


def draw_accepted(rng: np.random.Generator, k: int, p: float, n: int) -> np.ndarray:
    """Accepted draft tokens for ``n`` independent steps, int64 array of shape ``(n,)`` with values in ``[0, k]``.

    The run of consecutive acceptances is geometric: ``G = Geometric(1 - p) - 1`` has ``P(G >= j) = p**j``;
    truncating at ``k`` gives the accepted count. ``k == 0`` or ``p == 0`` draws nothing (all zeros);
    ``p == 1`` draws nothing (all ``k``).
    """
    if k == 0 or p <= 0.0:
        return np.zeros(n, dtype=np.int64)
    if p >= 1.0:
        return np.full(n, k, dtype=np.int64)
    g = rng.geometric(1.0 - p, size=n) - 1
    return np.minimum(g, k)


def draw_steps(rng: np.random.Generator, k: int, p: float, n_tokens: int) -> np.ndarray:
    """Per-step cumulative tokens emitted until ``n_tokens`` are produced.

    Returns int64 ``cum`` of shape ``(n_steps,)``: ``cum[s]`` tokens after step ``s`` (capped at ``n_tokens``;
    ``cum[-1] == n_tokens``), so ``len(cum)`` is the number of decode steps the sequence needs. Draws in blocks
    sized from the mean, so the RNG use is a deterministic function of ``(rng state, k, p, n_tokens)``.
    """
    if n_tokens <= 0:
        return np.zeros(0, dtype=np.int64)
    if k == 0 or p <= 0.0 or p >= 1.0:
        per = k + 1 if p >= 1.0 else 1
        n_steps = -(-n_tokens // per)
        return np.minimum(np.arange(1, n_steps + 1, dtype=np.int64) * per, n_tokens)
    mean = expected_tokens_per_step(k, p)
    block = math.ceil(n_tokens / mean * 1.1) + 8
    cum = np.cumsum(draw_accepted(rng, k, p, block) + 1)
    while cum[-1] < n_tokens:
        more = np.cumsum(draw_accepted(rng, k, p, block) + 1) + cum[-1]
        cum = np.concatenate([cum, more])
    n_steps = int(np.searchsorted(cum, n_tokens, side="left")) + 1
    out = cum[:n_steps].copy()
    out[-1] = n_tokens
    return out


def _geometric_by_inversion(rng: np.random.Generator, q: float, n: int = 4096) -> bool:
    """Does ``rng.geometric(q, size)`` equal ``ceil(-rng.standard_exponential(size) / log1p(-q))``, drawing the same
    random bits? (numpy draws a geometric variate so for ``q < 1/3``.) Checked on copies of the generator, so a
    numpy that draws otherwise only loses the faster path."""
    if not 0.0 < q < 1.0 / 3.0:
        return False
    try:
        a = np.random.Generator(type(rng.bit_generator)())
        b = np.random.Generator(type(rng.bit_generator)())
        a.bit_generator.state = b.bit_generator.state = rng.bit_generator.state
    except (TypeError, ValueError, AttributeError):
        return False
    g = a.geometric(q, size=n)
    e = b.standard_exponential(size=n)
    return bool((np.ceil(-e / math.log1p(-q)) == g).all()) and a.bit_generator.state == b.bit_generator.state


class AcceptanceStream:
    """Per-step token counts drawn in bulk, consumed request by request (one binary search per admission).

    The stream is one long sequence of i.i.d. per-step token counts ``1 + accepted`` (drawn ``chunk`` at a time
    from ``rng``). A sequence needing ``m`` tokens takes the next steps of the stream until their sum reaches
    ``m`` — the same distribution as drawing for it alone — and remembers where its segment lies so that the
    tokens emitted after ``s`` of its steps can be recovered (after a failure) without storing per-step arrays.
    The RNG use depends only on the order of ``take`` calls, so every driver gets the same draws.
    """

    __slots__ = ("chunk", "cum", "fixed", "inv", "k", "last", "mv", "p", "pos", "rng")

    def __init__(self, rng: np.random.Generator, k: int, p: float, chunk: int = 1 << 16) -> None:
        self.rng = rng
        self.k = k
        self.p = p
        self.chunk = chunk
        self.fixed = k + 1 if p >= 1.0 else (1 if (k == 0 or p <= 0.0) else 0)
        # cum[i] = tokens emitted by the first i steps of the current segment: an int64 array, strictly increasing
        # (kept in numpy, a drawn step costs no Python int), read through a memoryview (its items are Python ints:
        # a take is one bisect over a few of them)
        self.cum = np.zeros(1, dtype=np.int64)
        self.mv = memoryview(self.cum)
        self.last = 0              # int(cum[-1])
        self.pos = 0               # steps of ``cum`` already taken
        # log1p(-(1 - p)) when _geometric_by_inversion holds for this generator and p (faster draws, same numbers)
        self.inv = math.log1p(-(1.0 - p)) if not self.fixed and _geometric_by_inversion(rng, 1.0 - p) else None

    def take(self, m: int) -> tuple[int, memoryview | list[int], int]:
        """Steps a sequence needing ``m >= 1`` tokens takes, and ``(cum, start)`` to recover its progress
        (:meth:`tokens_after`). Deterministic cases (k=0, p∈{0,1}) draw nothing and return ``cum = []``."""
        if self.fixed:
            return -(-m // self.fixed), [], 0
        pos = self.pos
        mv = self.mv
        c = mv[pos]
        if self.last - c < m:
            self._refill(m)
            mv = self.mv
            pos = c = 0
        # the first step at which the sequence has its m tokens: every step emits 1 .. k+1 tokens, so it lies in
        # [pos + ceil(m / (k + 1)), pos + m]
        hi = pos + m + 1
        n = len(mv)
        end = bisect_left(mv, c + m, pos + 1 + (m - 1) // (self.k + 1), hi if hi < n else n)  # noqa: FURB136
        self.pos = end
        return end - pos, mv, pos

    def _refill(self, m: int) -> None:
        tail = self.cum[self.pos:]
        base = int(tail[0])
        need = max(self.chunk, m)
        # draw_accepted + 1, cumulated on from the tail's last value, in place: min(Geometric(1 - p), k + 1) is
        # min(Geometric(1 - p) - 1, k) + 1 (the same draws, the same integers)
        if self.inv is not None:  # rng.geometric's own inversion, vectorised (see _geometric_by_inversion)
            e = self.rng.standard_exponential(size=need)
            np.divide(e, -self.inv, out=e)  # -e / inv, bit for bit (IEEE division is sign-symmetric), one pass
            np.ceil(e, out=e)
            np.minimum(e, self.k + 1, out=e)
            steps = e.astype(np.int64)
        else:
            steps = self.rng.geometric(1.0 - self.p, size=need)
            np.minimum(steps, self.k + 1, out=steps)
        steps[0] += self.last - base
        self.cum = cum = np.concatenate((tail - base, np.cumsum(steps, out=steps)))
        self.mv = memoryview(cum)
        self.last = int(cum[-1])
        self.pos = 0

    def tokens_after(self, cum: memoryview | list[int], start: int, steps: int, m: int) -> int:
        """Tokens emitted by a sequence's first ``steps`` steps (capped at its need ``m``)."""
        if len(cum) == 0:
            return min(m, steps * self.fixed)
        return min(m, cum[start + steps] - cum[start])
