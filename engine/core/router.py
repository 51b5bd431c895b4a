"""Routing: which prefiller takes a new request, which decoder rank receives its KV.

Both choices are deterministic with explicit tie-breaks — candidates are scanned in worker creation order (and
rank order inside a decoder group) and only a *strictly* better key replaces the current best, so ties go to the
earliest worker, then the lowest rank:

- prefiller: least queued tokens (tokens routed to it and not yet prefilled, the running batch included),
  skipping those whose queue is full (``n_queued >= max_queue``);
- decoder rank: among ranks whose NIC is up and whose free KV (tokens) covers the reservation, the fewest
  requests holding KV there (decoding + queued for decode + KV in flight), then the most free KV.

The functions read a few attributes of the scheduler's worker states (see the Protocols) so that routing costs no
intermediate lists.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol, TypeVar


class PrefillerLoad(Protocol):
    queued_tokens: int
    n_queued: int
    max_queue: int | None


class DecoderLoad(Protocol):
    rank_nreq: list[int]       # requests holding KV on each rank
    rank_free_kv: list[int]    # free KV tokens on each rank
    rank_up: list[bool]        # rank can receive KV (its NIC is up)


class KeyedDecoderLoad(DecoderLoad, Protocol):
    # rank_nreq[r] * base - rank_free_kv[r], kept up to date by the owner: ``(requests, -free KV)`` as one int, in
    # the same order as long as 0 <= free KV < base (one base for all candidates)
    rank_key: list[int]


P = TypeVar("P", bound=PrefillerLoad)
D = TypeVar("D", bound=DecoderLoad)
K = TypeVar("K", bound=KeyedDecoderLoad)


def choose_prefiller(candidates: Iterable[P]) -> P | None:
    """The candidate with the least queued tokens whose queue has room; ties → earliest. None if all full."""
    best = None
    best_tokens = 0
    for p in candidates:
        if p.max_queue is not None and p.n_queued >= p.max_queue:
            continue
        if best is None or p.queued_tokens < best_tokens:
            best, best_tokens = p, p.queued_tokens
    return best


def choose_decoder_rank(candidates: Iterable[D], need_tokens: int) -> tuple[D, int] | None:
    """``(group, rank)`` minimising ``(requests on rank, -free KV)`` among ranks with ``free KV >= need_tokens``
    and an up NIC; ties → earliest group, then lowest rank. None when no rank can take it now.

    Per group, the unconstrained minimum of ``(requests, -free KV, rank)`` is taken first (C-level ``min``,
    ``index`` and ``count`` over the request counts; free KV is compared only on ties);
    when that rank qualifies it is the group's answer (the constraint only removes ranks), otherwise the group is
    scanned rank by rank."""
    best = None
    best_rank = -1
    best_n = 0
    best_free = 0
    for g in candidates:
        free = g.rank_free_kv
        up = g.rank_up
        nreq = g.rank_nreq
        if not nreq:
            continue
        n = min(nreq)
        if best is not None and n > best_n:  # no rank of this group can win (fewer requests first)
            continue
        r = nreq.index(n)
        f = free[r]
        if nreq.count(n) > 1:  # ties on requests: the most free KV, then the lowest rank
            for i in range(r + 1, len(nreq)):
                if nreq[i] == n and free[i] > f:
                    f = free[i]
                    r = i
        if f >= need_tokens and up[r]:
            if best is None or n < best_n or (n == best_n and f > best_free):
                best, best_rank, best_n, best_free = g, r, n, f
            continue
        for r, n in enumerate(nreq):
            if best is not None and n > best_n:  # cannot win: the cheap test first
                continue
            f = free[r]
            if f < need_tokens or not up[r]:
                continue
            if best is None or n < best_n or f > best_free:
                best, best_rank, best_n, best_free = g, r, n, f
    if best is None:
        return None
    return best, best_rank


def choose_decoder_rank_keyed(candidates: Iterable[K], need_tokens: int) -> tuple[K, int] | None:
    """:func:`choose_decoder_rank` for groups that keep ``rank_key`` (:class:`KeyedDecoderLoad`): the same choice.

    The scheduler asks once per KV transfer and the ranks mostly tie on requests (batches at their cap), which
    costs :func:`choose_decoder_rank` a Python-level scan of the tied ranks; with the combined key a group's
    unconstrained minimum is one C-level ``min`` + ``index`` (first index = lowest rank on ties); only when that
    rank lacks KV room or its NIC is down are the group's ranks scanned. ``tests/test_sim_speed_req_router.py``
    checks the choice against :func:`choose_decoder_rank`."""
    best = None
    best_rank = -1
    best_key = 0
    for g in candidates:
        keys = g.rank_key
        if not keys:
            continue
        k = min(keys)
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
