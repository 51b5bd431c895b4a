"""MTP speculative decoding as a stochastic model.

Each decode step a sequence verifies ``k`` drafted tokens. Draft position ``i`` (1-based) is accepted with
probability ``p`` *given that positions 1..i-1 were accepted*; the first rejection ends the run. The step emits
``1 + accepted`` tokens (the verified prefix plus the target model's own token), so

    P(accepted >= j) = p**j  (0 <= j <= k),   E[tokens/step] = sum_{j=0..k} p**j = (1 - p**(k+1)) / (1 - p).

With the write-up's p = 0.8: k=1 → 1.8, k=2 → 2.44, k=3 → 2.952 tokens per step.

A measured draft rarely accepts every position alike (later drafts condition on more guessed tokens), so the
probabilities may also be given per position: an *acceptance curve* ``(a1, a2, ...)``, ``a_i`` = P(draft token
``i`` accepted | tokens ``< i`` accepted). Then ``P(accepted >= j) = a1 * ... * aj`` (:func:`survival`) and
``E[tokens/step] = 1 + sum_{j=1..k} P(accepted >= j)``; a curve is drawn by inversion, one uniform variate per
step (accepted = the ``j`` whose survival brackets it). Without a curve the geometric form above holds (``a_i = p``
for every ``i``) and is drawn as it always was, so runs without a curve draw the same numbers.

Draws come from a ``numpy.random.Generator`` the caller passes in (the scheduler's, seeded by the run), so every
driver that makes the same calls in the same order gets the same tokens.
"""

from __future__ import annotations

import math
from bisect import bisect_left

import numpy as np


def survival(k: int, p: float, acceptance=None) -> tuple[float, ...]:
    """``(P(accepted >= 1), ..., P(accepted >= k))``: running products of the curve's first ``k`` entries, or
    ``p**j`` without a curve. A curve needs at least ``k`` entries (the rest are not used)."""
    if acceptance is None:
        return tuple(p ** j for j in range(1, k + 1))
    if len(acceptance) < k:
        raise ValueError(f"mtp.acceptance: {len(acceptance)} entries for draft_k = {k}; give one per draft token")
    out, s = [], 1.0
    for a in acceptance[:k]:
        if not 0.0 <= a <= 1.0:
            raise ValueError(f"mtp.acceptance: {a} is not a probability in [0, 1]")
        s *= a
        out.append(s)
    return tuple(out)


def expected_tokens_per_step(k: int, p: float, acceptance=None) -> float:
    """Closed form ``(1 - p**(k+1)) / (1 - p)`` (``k + 1`` at ``p == 1``); with an acceptance curve,
    ``1 + sum(survival(k, p, acceptance))``."""
    if acceptance is not None:
        return 1.0 + sum(survival(k, p, acceptance))
    if p >= 1.0:
        return float(k + 1)
    return (1.0 - p ** (k + 1)) / (1.0 - p)


def _fixed_tokens(k: int, p: float, acceptance=None) -> int:
    """Tokens every step emits when the outcome is certain (0 when it is random): ``k + 1`` when every draft is
    always accepted, 1 when none ever is (or ``k == 0``); with a curve of zeros and ones, one more than the
    leading ones."""
    if k == 0:
        return 1
    if acceptance is None:
        return k + 1 if p >= 1.0 else (1 if p <= 0.0 else 0)
    s = survival(k, p, acceptance)
    if all(x in (0.0, 1.0) for x in s):
        return 1 + sum(x == 1.0 for x in s)
    return 0


def _curve_steps(rng: np.random.Generator, k: int, surv_ascending: np.ndarray, n: int) -> np.ndarray:
    """``n`` per-step token counts ``1 + accepted`` of a curve, by inversion of one uniform ``u`` per step:
    ``accepted = #{j : P(accepted >= j) > u}``, i.e. ``k - #{j : survival_j <= u}``."""
    u = rng.random(n)
    return (k + 1) - np.searchsorted(surv_ascending, u, side="right").astype(np.int64)


def draw_accepted(rng: np.random.Generator, k: int, p: float, n: int, acceptance=None) -> np.ndarray:
    """Accepted draft tokens for ``n`` independent steps, int64 array of shape ``(n,)`` with values in ``[0, k]``.

    The run of consecutive acceptances is geometric: ``G = Geometric(1 - p) - 1`` has ``P(G >= j) = p**j``;
    truncating at ``k`` gives the accepted count. ``k == 0`` or ``p == 0`` draws nothing (all zeros);
    ``p == 1`` draws nothing (all ``k``). With an acceptance curve: by inversion (module docstring), nothing drawn
    when the outcome is certain.
    """
    if acceptance is not None:
        fixed = _fixed_tokens(k, p, acceptance)
        if fixed:
            return np.full(n, fixed - 1, dtype=np.int64)
        return _curve_steps(rng, k, np.array(survival(k, p, acceptance)[::-1]), n) - 1
    if k == 0 or p <= 0.0:
        return np.zeros(n, dtype=np.int64)
    if p >= 1.0:
        return np.full(n, k, dtype=np.int64)
    g = rng.geometric(1.0 - p, size=n) - 1
    return np.minimum(g, k)


def draw_steps(rng: np.random.Generator, k: int, p: float, n_tokens: int, acceptance=None) -> np.ndarray:
    """Per-step cumulative tokens emitted until ``n_tokens`` are produced.

    Returns int64 ``cum`` of shape ``(n_steps,)``: ``cum[s]`` tokens after step ``s`` (capped at ``n_tokens``;
    ``cum[-1] == n_tokens``), so ``len(cum)`` is the number of decode steps the sequence needs. Draws in blocks
    sized from the mean, so the RNG use is a deterministic function of ``(rng state, k, p, acceptance,
    n_tokens)``.
    """
    if n_tokens <= 0:
        return np.zeros(0, dtype=np.int64)
    per = _fixed_tokens(k, p, acceptance)
    if per:
        n_steps = -(-n_tokens // per)
        return np.minimum(np.arange(1, n_steps + 1, dtype=np.int64) * per, n_tokens)
    mean = expected_tokens_per_step(k, p, acceptance)
    block = math.ceil(n_tokens / mean * 1.1) + 8
    cum = np.cumsum(draw_accepted(rng, k, p, block, acceptance) + 1)
    while cum[-1] < n_tokens:
        more = np.cumsum(draw_accepted(rng, k, p, block, acceptance) + 1) + cum[-1]
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
    The RNG use depends only on the order of ``take`` calls, so every driver gets the same draws. ``acceptance``:
    an acceptance curve (module docstring) instead of the geometric ``p``.
    """

    __slots__ = ("acceptance", "chunk", "cum", "fixed", "inv", "k", "last", "mv", "p", "pos", "rng", "surv")

    def __init__(self, rng: np.random.Generator, k: int, p: float, chunk: int = 1 << 16,
                 acceptance=None) -> None:
        self.rng = rng
        self.k = k
        self.p = p
        self.acceptance = None if acceptance is None else tuple(acceptance)
        self.chunk = chunk
        self.fixed = _fixed_tokens(k, p, self.acceptance)
        # a curve's survival P(accepted >= j), ascending (j = k .. 1), for the inversion draws
        self.surv = None if self.acceptance is None else np.array(survival(k, p, self.acceptance)[::-1])
        # cum[i] = tokens emitted by the first i steps of the current segment: an int64 array, strictly increasing
        # (kept in numpy, a drawn step costs no Python int), read through a memoryview (its items are Python ints:
        # a take is one bisect over a few of them)
        self.cum = np.zeros(1, dtype=np.int64)
        self.mv = memoryview(self.cum)
        self.last = 0              # int(cum[-1])
        self.pos = 0               # steps of ``cum`` already taken
        # log1p(-(1 - p)) when _geometric_by_inversion holds for this generator and p (faster draws, same numbers)
        self.inv = (math.log1p(-(1.0 - p)) if not self.fixed and self.surv is None
                    and _geometric_by_inversion(rng, 1.0 - p) else None)

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
        if self.surv is not None:  # an acceptance curve: one uniform per step
            steps = _curve_steps(self.rng, self.k, self.surv, need)
        elif self.inv is not None:  # rng.geometric's own inversion, vectorised (see _geometric_by_inversion)
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
