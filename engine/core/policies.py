"""Scheduling policies: the choices the scheduler delegates, each a small object with one implementation.

- :class:`PrefillerRouting` — which prefiller a request is queued on (on arrival, and again after a failure):
  least queued tokens (the default), or :class:`KvAwareRouting` (cached prefix overlap against load, reading each
  worker's prefix cache, :mod:`engine.core.prefix_cache`), or the locality-blind baselines
  :class:`RoundRobinRouting` and :class:`RandomRouting`;
- :class:`DecoderRankChoice` — which decoder group and DP rank receive a request's KV (and hold it while it decodes);
- :class:`DecodeAdmission` — which requests waiting on a decoder rank join its running batch at a step boundary;
- worker routing (a :class:`PrefillerRouting` over aggregated workers) — which aggregated worker a request is
  queued on (an aggregated worker's ranks are then chosen by the :class:`DecoderRankChoice`, its decode batch
  admitted by the :class:`DecodeAdmission`).

:class:`Policies` bundles one of each (``Scheduler(..., policies=Policies(admission=...))``); the defaults are
the rules the module docstring of :mod:`engine.core.scheduler` describes. A policy reads the scheduler's state
objects (:mod:`engine.core.state`) through the few attributes its Protocol names and changes nothing but what its
method says (an admission policy removes the requests it admits from the queue it is given). Every choice is
deterministic: candidates come in worker creation order (ranks in order inside a decoder group, requests in
queue order) and ties go to the earliest.

A new policy is one class: implement the Protocol, give it a ``name`` and add it to :data:`ADMISSION` (or
:data:`PREFILLER_ROUTING` / :data:`DECODER_RANK` / :data:`WORKER_ROUTING`) so scenarios can name it
(``sim.policies``). An admission policy also says whether it is *state-only* (its choice depends on nothing but the
queue and the free batch slots it is given — not on the time, a step count or randomness): drivers that skip the
steps in which a decoder's state does not change (``sim.fastpath``) are used only with state-only admission.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import ClassVar, Protocol, TypeVar


# ------------------------------------------------------------------ what the policies read
class PrefillerLoad(Protocol):
    queued_tokens: int         # prefill tokens routed to it and not yet prefilled (its running batch included)
    offset_tokens: int         # routing penalty of a prefiller still starting (tokens it could have done meanwhile)
    n_queued: int              # requests waiting in its queue
    max_queue: int | None      # queue bound (None: unbounded)


class DecoderLoad(Protocol):
    rank_nreq: list[int]       # requests holding KV on each rank (decoding + queued for decode + KV in flight)
    rank_free_kv: list[int]    # free KV tokens on each rank
    rank_up: list[bool]        # rank can receive KV (its NIC is up)
    # rank_nreq[r] * base - rank_free_kv[r], kept with them by the scheduler (one base for all groups, larger than
    # any rank's KV capacity): (requests, -free KV) as one int, in the same order
    rank_key: list[int]
    rank_kmin: int             # min(rank_key) (0 when there are no ranks), kept with it by the scheduler


class QueuedRequest(Protocol):
    id: int
    prompt: int                # prompt tokens
    ctx0: int                  # KV tokens it holds (prompt, plus tokens generated before a failure forced a re-prefill)
    out: int                   # output tokens it generates in all
    generated: int             # output tokens generated so far
    arrival_s: float


class RoutedRequest(Protocol):
    id: int
    ctx0: int                  # tokens to prefill without a cache hit
    keys: tuple                # prefix-cache keys of its cacheable blocks (() without a cache)


class CachedLoad(PrefillerLoad, Protocol):
    cache: object | None       # its engine.core.prefix_cache.PrefixCache (None: caching off)


class WorkerLoad(PrefillerLoad, Protocol):
    rank_nreq: list[int]       # requests holding KV on each of the worker's ranks (prefilling or decoding)


P = TypeVar("P", bound=PrefillerLoad)
W = TypeVar("W", bound=WorkerLoad)
D = TypeVar("D", bound=DecoderLoad)
R = TypeVar("R", bound=QueuedRequest)


# ------------------------------------------------------------------ the three choices
class PrefillerRouting(Protocol):
    name: ClassVar[str]

    def choose(self, candidates: Sequence[P], requeue: bool, req: RoutedRequest | None = None) -> P | None:
        """The prefiller to queue a request on, among the routable ones (creation order); None: none can take it
        (the request is rejected ``queue_full``). ``requeue``: the request is routed again after a failure (such
        work is never refused). ``req``: the request (its ``keys`` for a prefix-aware choice)."""
        ...


class DecoderRankChoice(Protocol):
    name: ClassVar[str]

    def choose(self, candidates: Iterable[D], need_tokens: int) -> tuple[D, int] | None:
        """``(group, rank)`` to reserve ``need_tokens`` of KV on, among the routable decoder groups (creation
        order); None when no rank can take it now (the KV waits on its prefiller until KV is freed)."""
        ...


class DecodeAdmission(Protocol):
    name: ClassVar[str]
    #: the choice depends only on the queue and the room given (see the module docstring)
    state_only: ClassVar[bool]

    def take(self, queue: deque[R], room: int) -> list[R]:
        """Remove from one decoder rank's ``queue`` (arrival order of their KV) the requests that join its batch
        now and return them in the order they join; ``room`` (>= 1): free batch slots on the rank. Returning fewer
        than ``min(room, len(queue))`` requests leaves the others waiting with free slots: the scheduler then asks
        again at every step boundary."""
        ...


# ------------------------------------------------------------------ the default policies
class LeastQueuedTokens:
    """The prefiller with the least queued tokens (plus its start-up penalty), skipping full queues unless the
    request is re-routed; ties → the earliest prefiller."""

    name: ClassVar[str] = "least_queued_tokens"

    def choose(self, candidates: Sequence[P], requeue: bool, req=None) -> P | None:
        best = None
        best_load = 0
        for p in candidates:
            load = p.queued_tokens + p.offset_tokens
            if best is not None and load >= best_load:  # cannot win: the cheap test first
                continue
            if not requeue and p.max_queue is not None and p.n_queued >= p.max_queue:
                continue
            best, best_load = p, load
        return best

    def choose_indexed(self, candidates: Sequence[P], loads: Sequence[int], requeue: bool,
                       req=None) -> P | None:
        """:meth:`choose`, given ``loads[i] == candidates[i].queued_tokens + candidates[i].offset_tokens``
        (the scheduler keeps its routable prefillers' loads in a list of their own): the first least loaded in
        C-level calls — the choice itself when its queue has room (or the request is re-routed),
        :meth:`choose` otherwise."""
        if loads:
            p = candidates[loads.index(min(loads))]
            if requeue or p.max_queue is None or p.n_queued < p.max_queue:
                return p
        return self.choose(candidates, requeue, req)


class LeastRequests:
    """The aggregated worker with the fewest requests routed to it and not finished (queued, prefilling, decoding),
    then the least queued prompt tokens, skipping full queues unless the request is re-routed; ties → the earliest
    worker. Unlike least queued tokens it spreads decode load too: a worker whose prompts are all prefilled is not
    thereby idle."""

    name: ClassVar[str] = "least_requests"

    def choose(self, candidates: Sequence[W], requeue: bool, req=None) -> W | None:
        best = None
        best_load = (0, 0)
        for w in candidates:
            if not requeue and w.max_queue is not None and w.n_queued >= w.max_queue:
                continue
            load = (w.n_queued + sum(w.rank_nreq), w.queued_tokens)
            if best is None or load < best_load:
                best, best_load = w, load
        return best


def _has_room(p: PrefillerLoad, requeue: bool) -> bool:
    return requeue or p.max_queue is None or p.n_queued < p.max_queue


def overlap_tokens(p, req) -> int:
    """Prompt tokens of ``req`` that ``p``'s prefix cache holds now (any tier; 0 without a cache or keys)."""
    cache = getattr(p, "cache", None)
    keys = getattr(req, "keys", ())
    if cache is None or not keys:
        return 0
    return cache.lookup(keys).blocks * cache.block_tokens


class KvAwareRouting:
    """The prefiller (or aggregated worker) that maximises

        score = overlap_tokens - weight * (queued_tokens + offset_tokens)

    ``overlap_tokens``: prompt tokens its prefix cache holds for the request (the longest cached prefix, any tier:
    prefill it would skip); ``queued_tokens + offset_tokens``: the load least-queued-tokens routing reads. With
    ``weight = 1`` a token of cached prefix is worth a token of queue (both are prefill work); a larger weight
    favours balance, a smaller one locality. Skips full queues unless the request is re-routed; ties → the least
    loaded, then the earliest. Without caches (or keys) it is least-queued-tokens routing."""

    name: ClassVar[str] = "kv_aware"

    def __init__(self, weight: float = 1.0) -> None:
        if not weight >= 0:
            raise ValueError(f"kv_aware weight must be >= 0, got {weight}")
        self.weight = weight

    def choose(self, candidates: Sequence[P], requeue: bool, req=None) -> P | None:
        best = None
        best_key = (0.0, 0)
        for p in candidates:
            if not _has_room(p, requeue):
                continue
            load = p.queued_tokens + p.offset_tokens
            key = (overlap_tokens(p, req) - self.weight * load, -load)
            if best is None or key > best_key:
                best, best_key = p, key
        return best


class RoundRobinRouting:
    """Candidates in turn (a counter over the routable list, skipping full queues unless re-routing): the
    locality-blind baseline."""

    name: ClassVar[str] = "round_robin"

    def __init__(self) -> None:
        self.i = 0

    def choose(self, candidates: Sequence[P], requeue: bool, req=None) -> P | None:
        n = len(candidates)
        for j in range(n):
            p = candidates[(self.i + j) % n]
            if _has_room(p, requeue):
                self.i = (self.i + j + 1) % n
                return p
        return None


class RandomRouting:
    """A uniformly random candidate with queue room (its own seeded ``numpy.random.Generator``: deterministic for a
    seed, independent of the scheduler's MTP draws)."""

    name: ClassVar[str] = "random"

    def __init__(self, seed: int = 0) -> None:
        import numpy as np

        self.rng = np.random.default_rng(seed)

    def choose(self, candidates: Sequence[P], requeue: bool, req=None) -> P | None:
        ok = [p for p in candidates if _has_room(p, requeue)]
        return ok[int(self.rng.integers(len(ok)))] if ok else None


class FewestRequests:
    """Among ranks whose NIC is up and whose free KV covers the need: the fewest requests holding KV there, then
    the most free KV; ties → the earliest group, then the lowest rank.

    Reads ``rank_key`` (``(requests, -free KV)`` as one int): a group's unconstrained minimum is ``rank_kmin``
    (kept by the scheduler) and its rank one C-level ``index`` (first index = lowest rank on ties); only when that rank lacks KV room or its NIC is down
    are the group's ranks scanned. The scheduler asks once per KV transfer, and ranks mostly tie on requests
    (batches at their cap), which a scan of (requests, free KV) pairs would pay for in Python.
    ``tests/test_policies.py`` checks the choice against the rule written out."""

    name: ClassVar[str] = "fewest_requests"

    def choose(self, candidates: Iterable[D], need_tokens: int) -> tuple[D, int] | None:
        best = None
        best_rank = -1
        best_key = 0
        for g in candidates:
            keys = g.rank_key
            if not keys:
                continue
            k = g.rank_kmin  # min(keys), kept by the scheduler: one attribute instead of a pass over the ranks
            if best is not None and k >= best_key:  # no rank of this group is strictly better
                continue
            r = keys.index(k)
            free = g.rank_free_kv
            up = g.rank_up
            if free[r] >= need_tokens and up[r]:
                best, best_rank, best_key = g, r, k
                continue
            for r, k in enumerate(keys):  # the minimum does not qualify: the qualifying ranks, in order
                if (best is None or k < best_key) and free[r] >= need_tokens and up[r]:
                    best, best_rank, best_key = g, r, k
        if best is None:
            return None
        return best, best_rank

    def choose_indexed(self, candidates: Sequence[D], kmins: Sequence[int], need_tokens: int
                       ) -> tuple[D, int] | None:
        """:meth:`choose`, given ``kmins[i] == candidates[i].rank_kmin`` (the scheduler keeps its routable
        decoders' minima in a list of their own): the least minimum and the first group holding it in C-level
        calls, and its first rank with that key — the choice itself when that rank qualifies (no rank anywhere
        has a smaller key, and ties go to the earliest group and lowest rank), :meth:`choose` otherwise."""
        if kmins:
            k = min(kmins)
            g = candidates[kmins.index(k)]
            keys = g.rank_key
            if keys:
                r = keys.index(k)
                if g.rank_free_kv[r] >= need_tokens and g.rank_up[r]:
                    return g, r
        return self.choose(candidates, need_tokens)


class FifoAdmission:
    """First come (first KV arrived on the rank), first admitted, while the rank's batch has room."""

    name: ClassVar[str] = "fifo"
    state_only: ClassVar[bool] = True

    def take(self, queue: deque[R], room: int) -> list[R]:
        if len(queue) <= room:
            out = list(queue)
            queue.clear()
            return out
        pop = queue.popleft
        return [pop() for _ in range(room)]


class ShortestPromptFirst:
    """The requests with the shortest prompts first (ties: the earlier KV arrival), while the rank's batch has room;
    those left waiting keep their order. Short requests start decoding sooner; a long prompt can wait as long as
    shorter ones keep arriving on its rank (no aging)."""

    name: ClassVar[str] = "shortest_prompt"
    state_only: ClassVar[bool] = True

    def take(self, queue: deque[R], room: int) -> list[R]:
        ranked = sorted(queue, key=_prompt)  # stable: ties keep queue order
        if len(ranked) <= room:
            queue.clear()
            return ranked
        out = ranked[:room]
        taken = {id(r) for r in out}
        rest = [r for r in queue if id(r) not in taken]
        queue.clear()
        queue.extend(rest)
        return out


def _prompt(r: QueuedRequest) -> int:
    return r.prompt


# ------------------------------------------------------------------ the bundle and the names scenarios use
_BASELINES = {KvAwareRouting.name: KvAwareRouting, RoundRobinRouting.name: RoundRobinRouting,
              RandomRouting.name: RandomRouting}
PREFILLER_ROUTING: dict[str, type] = {LeastQueuedTokens.name: LeastQueuedTokens, **_BASELINES}
DECODER_RANK: dict[str, type] = {FewestRequests.name: FewestRequests}
ADMISSION: dict[str, type] = {FifoAdmission.name: FifoAdmission, ShortestPromptFirst.name: ShortestPromptFirst}
WORKER_ROUTING: dict[str, type] = {LeastRequests.name: LeastRequests, LeastQueuedTokens.name: LeastQueuedTokens,
                                   **_BASELINES}


@dataclass(frozen=True)
class Policies:
    """The scheduler's policies (one of each; the defaults describe :mod:`engine.core.scheduler`)."""

    prefiller: PrefillerRouting = field(default_factory=LeastQueuedTokens)
    rank: DecoderRankChoice = field(default_factory=FewestRequests)
    admission: DecodeAdmission = field(default_factory=FifoAdmission)
    worker: PrefillerRouting = field(default_factory=LeastRequests)  # aggregated workers

    @classmethod
    def named(cls, prefiller: str = LeastQueuedTokens.name, rank: str = FewestRequests.name,
              admission: str = FifoAdmission.name, worker: str = LeastRequests.name) -> Policies:
        """The policies registered under these names; ValueError (one line, naming the choices) otherwise.
        (``kv_aware`` gets its default weight, ``random`` seed 0: build those objects to choose otherwise.)"""
        picked = []
        for what, name, table in (("prefiller", prefiller, PREFILLER_ROUTING), ("rank", rank, DECODER_RANK),
                                  ("admission", admission, ADMISSION), ("worker", worker, WORKER_ROUTING)):
            if name not in table:
                raise ValueError(f"policies.{what}: unknown policy {name!r} (one of {', '.join(sorted(table))})")
            picked.append(table[name]())
        return cls(*picked)
