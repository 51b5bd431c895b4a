"""What the scheduler tells a worker to do next, and what the worker reports back — frozen data at the seam.

``scheduler.next(worker, now_s)`` returns one of :class:`PrefillBatch`, :class:`KvTransfer`, :class:`DecodeStep`,
:class:`Idle` or :class:`Stop`; the executor (simulated or real) runs it and the driver calls
``scheduler.done(plan, Result(...), now_s)``. Every object here is immutable, comparable and cheap to build, so plans can
be logged (``plan._asdict()``), replayed and diffed (``plan._replace(...)``).

They are ``typing.NamedTuple`` classes rather than frozen dataclasses for one reason: a simulated hour of a full
rack builds hundreds of thousands of them, and a NamedTuple is built ~5x faster than a frozen dataclass (whose
``__init__`` goes through ``object.__setattr__`` per field). Dispatch on ``type(plan) is DecodeStep`` etc.;
do not compare plans of different classes with ``==`` (tuples compare by value).

Worker ids (strings) name the executing entity:

- a prefiller group ``"P<i>"`` (TP×EP GPUs in one node) runs :class:`PrefillBatch`;
- its KV sender streams ``"P<i>.kv<j>"`` run :class:`KvTransfer` over that node's NICs;
- a decoder group ``"D<i>"`` (one DP-EP deployment of ``ep`` GPUs, each a DP rank) runs :class:`DecodeStep`;
- an aggregated worker ``"A<i>"`` (prefill and decode on the same GPUs) runs :class:`MixedStep`;
- ``"autoscaler"`` only ever idles; its wake-ups are the periodic scaling decisions.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple


class PrefillBatch(NamedTuple):
    """Prefill a batch of prompts (or prompt chunks) on one prefiller group.

    worker:   prefiller group id.
    batch:    sequence number of this batch on this worker (0, 1, ...).
    items:    ``(request_id, start_token, n_tokens)`` per sequence, in queue order; ``start_token > 0`` only with
              chunked prefill (tokens ``[0, start_token)`` were prefilled by earlier batches and are read as
              context by attention).
    n_tokens: sum of ``n_tokens`` over items (the batch's token budget use).
    loads:    ``(request_id, tier, n_bytes)``: prefix-cache blocks copied up into HBM from a lower tier (1: host
              memory, 2: storage, :mod:`engine.core.prefix_cache`) before the batch runs; such a request's
              ``start_token`` counts the reused tokens (they are read as context, not computed).
    """

    worker: str
    batch: int
    items: tuple[tuple[int, int, int], ...]
    n_tokens: int
    loads: tuple[tuple[int, int, int], ...] = ()


class KvTransfer(NamedTuple):
    """Ship one request's prompt KV cache from a prefiller node to a decoder rank.

    worker:     KV stream id (``"P<i>.kv<j>"``).
    request_id: the request whose KV moves.
    src:        prefiller group id; ``dst``/``dst_rank``: decoder group id and DP rank (GPU index within the group).
    tokens:     KV tokens moved (the prompt, plus tokens generated before a failure forced a re-prefill).
    n_bytes:    ``tokens × kv_bytes_per_token`` (all full-attention layers, all KV heads).
    n_chunks:   contiguous chunks the resharding plan splits the transfer into (per-chunk overhead in cost models).
    flows:      ``(src_nic, dst_nic, n_bytes)`` per NIC flow, in NIC order; the flows' bytes sum to ``n_bytes``.
    """

    worker: str
    request_id: int
    src: str
    dst: str
    dst_rank: int
    tokens: int
    n_bytes: int
    n_chunks: int
    flows: tuple[tuple[str, str, int], ...]


class DecodeStep(NamedTuple):
    """One synchronous decode step of a DP-EP decoder group (every rank runs it; the slowest rank sets the time).

    worker:              decoder group id.
    step:                step number on this worker (0, 1, ...).
    rank_batch:          running sequences per DP rank, shape ``(ep,)``.
    rank_context_tokens: KV tokens read by attention per rank, shape ``(ep,)`` (sum of context lengths; the
                         scheduler tracks it in O(1) per step by assuming each sequence's generated tokens grow
                         linearly between admission and finish — exact at both ends).
    draft_k:             MTP draft length (0 = no speculative decoding); each sequence verifies ``draft_k``
                         drafted tokens and emits ``1 + accepted`` tokens.
    joined:              ``(request_id, rank)`` admitted into the batch at this step (delta for a real engine).
    left:                request ids that left the batch since the previous step (finished or failed).
    """

    worker: str
    step: int
    rank_batch: tuple[int, ...]
    rank_context_tokens: tuple[int, ...]
    draft_k: int
    joined: tuple[tuple[int, int], ...] = ()
    left: tuple[int, ...] = ()

    @property
    def max_batch(self) -> int:
        return max(self.rank_batch)

    @property
    def total_batch(self) -> int:
        return sum(self.rank_batch)


class MixedStep(NamedTuple):
    """One step of an aggregated worker: every DP rank's decode batch plus prefill chunks, in one forward.

    The first seven fields mean what they mean in :class:`DecodeStep` (the decode part; ``rank_batch`` may be all
    zeros in a step that only prefills). ``prefill``: ``(request_id, rank, start_token, n_tokens)`` per chunk, in
    the order the ranks took them (``start_token > 0``: tokens ``[0, start_token)`` are in the rank's KV cache
    from earlier steps); a chunk that ends its prompt yields the request's next token. ``rank_prefill_tokens``:
    prefill tokens per rank (the chunks' sum per rank). ``step`` numbers every step of the worker, those that
    only prefill too. ``loads``: as in :class:`PrefillBatch` (prefix-cache copies the step waits for).
    """

    worker: str
    step: int
    rank_batch: tuple[int, ...]
    rank_context_tokens: tuple[int, ...]
    draft_k: int
    joined: tuple[tuple[int, int], ...]
    left: tuple[int, ...]
    prefill: tuple[tuple[int, int, int, int], ...]
    rank_prefill_tokens: tuple[int, ...]
    loads: tuple[tuple[int, int, int], ...] = ()

    @property
    def max_batch(self) -> int:
        return max(self.rank_batch)

    @property
    def total_batch(self) -> int:
        return sum(self.rank_batch)

    @property
    def prefill_tokens(self) -> int:
        return sum(self.rank_prefill_tokens)


#: ``Idle.waits_for`` values: what the worker sleeps on (besides ``until_s``).
WAIT_WORK = "work"              # new requests routed to it / KV arriving / batch slots
WAIT_KV_SPACE = "kv_space"      # prefiller KV buffer full, or no decoder rank can take the next KV
WAIT_READY = "ready"            # a scaled-up worker that is still starting (until_s = ready time)
WAIT_TIMER = "timer"            # only the timer (autoscaler)


class Idle(NamedTuple):
    """Nothing to do now. Sleep until the scheduler wakes this worker or until ``until_s`` (None = no timer).

    A driver implements the wait as "wait on this worker's wake-up signal with a timeout": SimPy with an event
    and ``env.timeout``; a real driver with a condition variable and ``wait(timeout)``. The scheduler only lists
    a worker in ``take_wakeups()`` after it returned ``Idle`` to that worker, so a wake-up cannot be lost.
    """

    worker: str
    until_s: float | None
    waits_for: str


class Stop(NamedTuple):
    """The worker is retired (drained after scale-down, failed, or the run is over): its loop ends."""

    worker: str
    reason: str


Plan = PrefillBatch | KvTransfer | DecodeStep | MixedStep | Idle | Stop


class Result(NamedTuple):
    """What happened to a plan.

    duration_s: how long it ran (simulated or measured); for :class:`Idle`, how long the worker slept.
    accepted:   optional real MTP outcome of a :class:`DecodeStep`: request id -> accepted draft tokens (0..k).
                When None the scheduler draws acceptance from its seeded RNG (identically in every driver).
    failed:     None, or why the plan did not complete (the scheduler then re-queues its work): a fault's target
                (``"gpu:3"``), :data:`KV_LOST` or :data:`KV_NO_ROOM`.
    woken:      for :class:`Idle`: True if woken by the scheduler, False if the timer fired.
    """

    duration_s: float
    accepted: Mapping[int, int] | None = None
    failed: str | None = None
    woken: bool = False


#: ``Result.failed`` of a :class:`KvTransfer` whose decoder had no free pages for the KV (a real decoder
#: refused the offer: its cache was fuller than the scheduler's count, e.g. a finished request's pages not
#: freed yet). The KV is still on the prefiller: the scheduler ships it again later, to whichever decoder rank
#: it then picks
KV_NO_ROOM = "kv_no_room"

#: ``Result.failed`` of a :class:`KvTransfer` whose source no longer holds the request's KV (it declined to ship):
#: the request is prefilled again (prompt and tokens generated so far), as when its prefiller dies — shipping it
#: again from the same prefiller would meet the same missing KV
KV_LOST = "kv_lost"


class Accepted(NamedTuple):
    """An executor's answer for a :class:`DecodeStep` or :class:`MixedStep` that ran ``duration_s`` and whose MTP
    drafts were verified for real: ``accepted`` (``Result.accepted``) says how many drafts of each request were
    accepted. A real run's completion event fires with it, and its replay returns it."""

    duration_s: float
    accepted: Mapping[int, int]


class Failed(NamedTuple):
    """An executor's answer for a plan that ran ``duration_s`` and failed for ``reason`` (``Result.failed``) with
    no fault to interrupt it: a real run's declined KV transfer, and its replay. ``executor.duration`` returns it
    (or a completion event fires with it) instead of a duration."""

    duration_s: float
    reason: str
