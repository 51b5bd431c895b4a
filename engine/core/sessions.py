"""Multi-turn session streams: the requests of a ``Sessions`` workload spec (:mod:`engine.core.workload`) and their
prefix block ids.

Every session is one token stream, ``system + input_1 + output_1 + input_2 + output_2 + ...``; turn k's prompt is
its first ``prompt_k`` tokens. ``Request.prefix_hash_ids`` follows the Mooncake traces (``engine.core.traces``):
one id per 512-token block of the prompt, ``ceil(prompt_k / 512)`` ids, the last partial block included, and an id
names the whole content from the start of the stream to the end of its block, so equal ids mean an identical
prefix. Concretely:

- block j that lies wholly inside the session's system prompt (``j < system_tokens // 512``) has the id of block
  j of that system prompt: every session that picked it shares these;
- any other full block j has an id of its own session, the same in every turn that contains it (user inputs and
  outputs are taken to be unique content, so sessions share nothing past their system prompt's full blocks);
- the partial last block (``prompt_k % 512 != 0``) gets a fresh id: the next turn fills that block with more
  tokens, so its content differs, and no other request ever has it.

Hence, for turns k and k+1 of one session, turn k+1's ids start with the first ``prompt_k // 512`` ids of turn k
(all its full blocks), and differ from turn k's from there on. The blocks of turn k's *output* get their ids when
turn k+1's prompt first contains them (a request carries prompt blocks only, as a Mooncake trace does).

Ids are allocated by one counter in the order sessions are generated: the system prompts' blocks first
(``0 .. ``), then each session's blocks as the session is drawn. Sessions are drawn in arrival order, each whole,
from eight independent random streams of the seed (session arrivals, system prompt lengths, system prompt choice,
turn counts, first inputs, inputs, outputs, think times) consumed ``CHUNK`` values at a time, so the requests of
``n_requests=N`` are the first N of any longer run with the same seed, ids included.

Pure Python + numpy (no torch, no simpy).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from rackbed.engine.core.request import Request
from rackbed.engine.core.traces import HASH_BLOCK_TOKENS, MAX_TOKENS
from rackbed.topology.errors import UserError

if TYPE_CHECKING:
    from rackbed.engine.core.workload import Sessions

#: values drawn per refill of one random stream; part of the definition of a seeded stream
CHUNK = 4096

#: consecutive sessions of which not one turn fits ``max_prompt_tokens`` after which the stream gives up (every
#: first turn is then too long: a typo, not bad luck)
MAX_EMPTY_SESSIONS = 10_000

#: order of the random streams spawned from the seed
STREAMS = ("arrival", "system_length", "system_choice", "turns", "first_input", "input", "output", "think")

COUNTER_KEYS = ("n_sessions", "n_sessions_cut", "n_sessions_empty")


class SessionTurn(NamedTuple):
    """One request of a session stream and where it comes from.

    session:        0-based index of the session, in order of session arrival.
    turn:           0-based index of the turn within its session.
    system_prompt:  index of the system prompt in the pool (-1: no system prompts).
    system_tokens:  length of that system prompt.
    input_tokens:   tokens this turn appended after the previous turn's output (its user input / tool output).
    """

    request: Request
    session: int
    turn: int
    system_prompt: int
    system_tokens: int
    input_tokens: int


class _Draws:
    """Values of one distribution from one random stream, drawn ``CHUNK`` at a time and handed out in order."""

    def __init__(self, sample: Callable[[np.random.Generator, int], np.ndarray], rng: np.random.Generator) -> None:
        self._sample, self._rng = sample, rng
        self._buf: list = []
        self._pos = 0

    def take(self, n: int) -> list:
        out: list = []
        while len(out) < n:
            if self._pos == len(self._buf):
                self._buf, self._pos = self._sample(self._rng, CHUNK).tolist(), 0
            k = min(n - len(out), len(self._buf) - self._pos)
            out += self._buf[self._pos : self._pos + k]
            self._pos += k
        return out


class _Session(NamedTuple):
    system_prompt: int
    system_tokens: int
    arrivals: list[float]
    prompts: list[int]
    outputs: list[int]
    inputs: list[int]
    ids: list[tuple[int, ...]]


def split_rngs(rng: np.random.Generator | int) -> tuple[np.random.Generator, ...]:
    """One generator per entry of ``STREAMS`` from a seed or a Generator."""
    if isinstance(rng, np.random.Generator):
        return tuple(rng.spawn(len(STREAMS)))
    if isinstance(rng, bool) or not isinstance(rng, int | np.integer) or rng < 0:
        raise UserError(f"seed must be an integer >= 0 or a numpy Generator, got {rng!r}")
    return tuple(np.random.default_rng(s) for s in np.random.SeedSequence(int(rng)).spawn(len(STREAMS)))


def iter_session_turns(
    spec: Sessions,
    rng: np.random.Generator | int | None = None,
    pools: dict[str, np.ndarray | None] | None = None,
    counters: dict[str, int] | None = None,
) -> Iterator[SessionTurn]:
    """The turns of ``spec`` in arrival order (ties: earlier session first), request ids ``0, 1, ...``.

    ``rng`` overrides ``spec.seed``; ``pools`` maps ``"system_prompt"`` / ``"first_input"`` / ``"input"`` /
    ``"output"`` / ``"turns"`` to a cached ``Empirical.pool()``; ``counters`` (``COUNTER_KEYS``) grow as turns are
    produced: sessions with a request produced, those of them cut by ``max_prompt_tokens``, and sessions drawn
    before the end of the stream of which no turn fits it.
    """
    rngs = dict(zip(STREAMS, split_rngs(spec.seed if rng is None else rng), strict=True))  # bad seed: now
    c = counters if counters is not None else dict.fromkeys(COUNTER_KEYS, 0)
    for k in COUNTER_KEYS:
        c.setdefault(k, 0)
    return _turns(spec, rngs, dict(pools or {}), c)


def _turns(
    spec: Sessions, rngs: dict[str, np.random.Generator], pools: dict[str, np.ndarray | None], c: dict[str, int]
) -> Iterator[SessionTurn]:
    from rackbed.engine.core.workload import Empirical

    def draws(dist, stream: str, key: str) -> _Draws:
        if isinstance(dist, Empirical):
            pool = pools.get(key)
            if pool is None:
                pool = pools[key] = dist.pool()
            return _Draws(lambda g, n: dist.sample(g, n, pool), rngs[stream])
        return _Draws(dist.sample, rngs[stream])

    # the pool of system prompts and their block ids
    sys_tokens: list[int] = []
    sys_ids: list[tuple[int, ...]] = []
    next_id = 0
    if spec.system_prompt is not None:
        sys_tokens = draws(spec.system_prompt, "system_length", "system_prompt").take(spec.system_prompts)
        for s in sys_tokens:
            n_full = s // HASH_BLOCK_TOKENS
            sys_ids.append(tuple(range(next_id, next_id + n_full)))
            next_id += n_full
    choose = _Draws(lambda g, n: g.integers(0, max(len(sys_tokens), 1), n), rngs["system_choice"])
    turns_d = draws(spec.turns, "turns", "turns")
    first_d = draws(spec.first_input, "first_input", "first_input") if spec.first_input is not None else None
    input_d = draws(spec.input, "input", "input")
    output_d = draws(spec.output, "output", "output")
    think_d = _Draws(spec.think.sample, rngs["think"])
    arrival = spec.arrival
    if arrival.kind == "constant":
        gaps = _Draws(lambda g, n: np.full(n, 1.0 / arrival.rate_per_s), rngs["arrival"])
    else:
        gaps = _Draws(arrival.gaps_s, rngs["arrival"])
    cap = spec.max_prompt_tokens if spec.max_prompt_tokens is not None else MAX_TOKENS
    ttft, tpot = spec.assumed_ttft_s, spec.assumed_tpot_s

    def draw_session(start_s: float) -> tuple[_Session, bool]:
        nonlocal next_id
        pick = int(choose.take(1)[0]) if sys_tokens else -1
        system = sys_tokens[pick] if sys_tokens else 0
        shared = sys_ids[pick] if sys_tokens else ()
        n = int(turns_d.take(1)[0])
        inputs = (first_d.take(1) + input_d.take(n - 1)) if first_d is not None else input_d.take(n)
        outputs = output_d.take(n)
        thinks = think_d.take(n - 1)
        own: list[int] = []  # ids of this session's full blocks past the shared ones, by block index - len(shared)
        arrivals, prompts, ids = [], [], []
        t, context = start_s, system
        for k in range(n):
            prompt = context + inputs[k]
            if prompt > cap:
                break
            n_full = prompt // HASH_BLOCK_TOKENS
            while len(shared) + len(own) < n_full:
                own.append(next_id)
                next_id += 1
            block_ids = shared[:n_full] + tuple(own[: n_full - len(shared)])
            if prompt % HASH_BLOCK_TOKENS:
                block_ids += (next_id,)
                next_id += 1
            arrivals.append(t)
            prompts.append(prompt)
            ids.append(block_ids)
            context = prompt + outputs[k]
            if k + 1 < n:
                t += ttft + (outputs[k] - 1) * tpot + thinks[k]
        m = len(prompts)
        return _Session(pick, system, arrivals, prompts, outputs[:m], inputs[:m], ids), m < n

    limit = spec.n_requests if spec.n_requests is not None else math.inf
    until = spec.duration_s
    heap: list[tuple[float, int, int]] = []
    live: dict[int, tuple[_Session, bool]] = {}
    n_sessions = 0
    next_start = 0.0
    empty_run = 0
    produced = 0
    while produced < limit:
        while not heap or next_start <= heap[0][0]:
            if until is not None and next_start >= until:
                break
            sess, cut = draw_session(next_start)
            if sess.prompts:
                live[n_sessions] = (sess, cut)
                heapq.heappush(heap, (sess.arrivals[0], n_sessions, 0))
                empty_run = 0
            else:
                c["n_sessions_empty"] += 1
                empty_run += 1
                if empty_run >= MAX_EMPTY_SESSIONS:
                    raise UserError(f"workload.max_prompt_tokens: {cap:,} is below the first prompt (system prompt "
                                    f"+ first input) of {MAX_EMPTY_SESSIONS:,} sessions in a row")
            n_sessions += 1
            next_start += float(gaps.take(1)[0])
        if not heap:
            return
        t, s, k = heapq.heappop(heap)
        if until is not None and t >= until:
            return
        sess, cut = live[s]
        if k == 0:
            c["n_sessions"] += 1
            c["n_sessions_cut"] += int(cut)
        req = Request(produced, t, sess.prompts[k], sess.outputs[k], sess.ids[k])
        yield SessionTurn(req, s, k, sess.system_prompt, sess.system_tokens, sess.inputs[k])
        produced += 1
        if k + 1 < len(sess.prompts):
            heapq.heappush(heap, (sess.arrivals[k + 1], s, k + 1))
        else:
            del live[s]
