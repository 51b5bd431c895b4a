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


class AcceptanceStream:
    """Per-step token counts drawn in bulk, consumed request by request (O(log n) per admission, no numpy call).

    The stream is one long sequence of i.i.d. per-step token counts ``1 + accepted`` (drawn ``chunk`` at a time
    from ``rng``). A sequence needing ``m`` tokens takes the next steps of the stream until their sum reaches
    ``m`` — the same distribution as drawing for it alone — and remembers where its segment lies so that the
    tokens emitted after ``s`` of its steps can be recovered (after a failure) without storing per-step arrays.
    The RNG use depends only on the order of ``take`` calls, so every driver gets the same draws.
    """

    __slots__ = ("chunk", "cum", "fixed", "k", "p", "pos", "rng")

    def __init__(self, rng: np.random.Generator, k: int, p: float, chunk: int = 1 << 16) -> None:
        self.rng = rng
        self.k = k
        self.p = p
        self.chunk = chunk
        self.fixed = k + 1 if p >= 1.0 else (1 if (k == 0 or p <= 0.0) else 0)
        self.cum: list[int] = [0]  # cum[i] = tokens emitted by the first i steps of the current segment list
        self.pos = 0               # steps of ``cum`` already taken

    def take(self, m: int) -> tuple[int, list[int], int]:
        """Steps a sequence needing ``m >= 1`` tokens takes, and ``(cum, start)`` to recover its progress
        (:meth:`tokens_after`). Deterministic cases (k=0, p∈{0,1}) draw nothing and return ``cum = []``."""
        if self.fixed:
            return -(-m // self.fixed), [], 0
        cum = self.cum
        pos = self.pos
        if cum[-1] - cum[pos] < m:
            self._refill(m)
            cum = self.cum
            pos = self.pos
        target = cum[pos] + m
        end = bisect_left(cum, target, pos + 1)
        self.pos = end
        return end - pos, cum, pos

    def _refill(self, m: int) -> None:
        tail = self.cum[self.pos:]
        base = tail[0]
        need = max(self.chunk, m)
        draws = (draw_accepted(self.rng, self.k, self.p, need) + 1).cumsum()
        last = tail[-1] - base
        self.cum = [x - base for x in tail] + (draws + last).tolist()
        self.pos = 0

    def tokens_after(self, cum: list[int], start: int, steps: int, m: int) -> int:
        """Tokens emitted by a sequence's first ``steps`` steps (capped at its need ``m``)."""
        if not cum:
            return min(m, steps * self.fixed)
        return min(m, cum[start + steps] - cum[start])
