"""The scheduler's state: one object per request and per worker, plus the timeline samples.

Plain mutable objects, owned and changed by :class:`engine.core.scheduler.Scheduler` only; drivers receive plans
(:mod:`engine.core.plans`), never these. States and statuses are small ints (cheap to compare); their names are in
:data:`STATE_NAMES` / :data:`STATUS_NAMES`.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from typing import Protocol

from rackbed.engine.core.deployment import DecoderGroup, PrefillerGroup
from rackbed.engine.core.request import Request

# ---------------------------------------------------------------- request states (ints: cheap to compare)
ARRIVED, QUEUED_PREFILL, PREFILLING, KV_PENDING, KV_IN_FLIGHT, QUEUED_DECODE, DECODING, DONE, REJECTED = range(9)
STATE_NAMES = ("arrived", "queued_prefill", "prefilling", "kv_pending", "kv_in_flight", "queued_decode",
               "decoding", "done", "rejected")

# worker status
STARTING, ACTIVE, DRAINING, DEAD, RETIRED = range(5)
STATUS_NAMES = ("starting", "active", "draining", "dead", "retired")

AUTOSCALER = "autoscaler"
FP = 16  # fixed-point bits of the per-step context growth rate (exact integer running sums, no float drift)

#: ``DecoderState.plan`` while a step runs whose :class:`~engine.core.plans.DecodeStep` was not built yet
#: (``Scheduler.advance_decoder`` started it; ``Scheduler.decode_plan`` builds it)
PLAN_PENDING = object()

#: per-request metric row, appended when a request resolves (see :data:`ROW_FIELDS`)
ROW_FIELDS = ("id", "arrival_s", "prompt_tokens", "output_tokens", "status", "reason", "first_token_s",
              "end_s", "prefill_start_s", "kv_start_s", "kv_done_s", "decode_start_s", "decode_steps",
              "requeues", "prefiller", "decoder")


class RequestState:
    __slots__ = (
        "arrival_s",
        "ctx0",
        "cum",
        "cum_i",
        "decoder",
        "finish_step",
        "generated",
        "id",
        "keys",
        "out",
        "owner",
        "pf_done",
        "pin",
        "prefiller",
        "prompt",
        "rank",
        "rate_fp",
        "reason",
        "requeues",
        "reserved",
        "s0",
        "state",
        "steps",
        "t_decode_start",
        "t_first",
        "t_kv_done",
        "t_kv_start",
        "t_prefill_start",
    )

    def __init__(self, r: Request) -> None:
        self.id = r.id
        self.arrival_s = r.arrival_s
        self.prompt = r.prompt_tokens
        self.out = r.output_tokens
        self.state = ARRIVED
        self.reason = ""
        self.ctx0 = r.prompt_tokens   # tokens to prefill (prompt, plus generated ones after a KV loss)
        self.pf_done = 0              # tokens of ctx0 prefilled so far (chunked prefill), or reused from a cache
        self.keys = ()                # prefix-cache keys of its cacheable blocks (engine.core.prefix_cache)
        self.pin = None               # its hold on its prefiller's cache blocks (Pin) from prefill start to end
        self.generated = 0            # output tokens produced so far (the first comes from prefill)
        self.prefiller = None
        self.decoder = None
        self.rank = -1
        self.reserved = 0             # decoder KV tokens reserved
        self.cum = None               # acceptance-stream segment (list) and start: progress after a failure
        self.cum_i = 0
        self.s0 = 0                   # first decode step (group step number)
        self.finish_step = -1
        self.rate_fp = 0
        self.owner = None             # the plan currently working on it (stale completions are ignored)
        self.t_first = math.nan
        self.t_prefill_start = math.nan
        self.t_kv_start = math.nan
        self.t_kv_done = math.nan
        self.t_decode_start = math.nan
        self.steps = 0
        self.requeues = 0


class _GroupState:
    """What every worker group's state holds: the group, its place in creation order, its status and its life."""

    #: its place in ``Scheduler._route_p`` (-1: none; only a prefiller's is ever set)
    route_pi = -1

    def _init_group(self, g, order: int, status: int, ready_at: float, created_s: float) -> None:
        self.g = g
        self.id = g.id
        self.order = order
        self.status = status
        self.ready_at = ready_at
        self.created_s = created_s
        self.ended_s = math.nan
        self.gpus = g.gpus


class PrefillerState(_GroupState):
    """State of one prefiller group (its compute worker id is the group id)."""

    kind = "prefill"

    def __init__(self, g: PrefillerGroup, order: int, status: int, ready_at: float, cap_tps: float,
                 created_s: float) -> None:
        t = g.template
        self._init_group(g, order, status, ready_at, created_s)
        self.n_gpus = len(g.gpus)
        self.nics = list(g.nics)
        self.nic_up = [True] * len(g.nics)
        self.up_nics = list(g.nics)   # the NICs whose link is up, in order (kept by Scheduler._reroute_lists)
        self.budget = t.max_batch_tokens
        self.kv_cap = t.kv_capacity_tokens
        self.max_queue = t.max_queue_requests
        self.cap_tps = cap_tps
        self.queue: deque[RequestState] = deque()
        self.n_queued = 0
        self.queued_tokens = 0        # remaining prefill tokens of queued + running requests
        self.offset_tokens = 0        # routing penalty while starting (≈ tokens it could have done meanwhile)
        self.kv_held = 0              # prompt KV tokens on the group (running batch, pending, in flight)
        self.pending: deque[RequestState] = deque()
        self.running: list[RequestState] = []
        self.plan = None
        self.idle = False
        self.waits_for = ""
        self.batches = 0
        self.streams: list[KvStreamState] = []
        self.changes = 0              # status changes (Scheduler._set_status)
        self.cache = None             # its PrefixCache (None: prefix caching off)
        self.loads: list[tuple[int, int, int]] = []  # cache copies the next batch waits for (PrefillBatch.loads)


class KvStreamState:
    kind = "kv"

    def __init__(self, wid: str, pf: PrefillerState) -> None:
        self.id = wid
        self.pf = pf
        self.plan = None
        self.req = None
        self.idle = False
        self.blocked = False          # idle because no decoder rank could take the head request


class DecoderState(_GroupState):
    kind = "decode"

    #: ``Scheduler.busy_gpu_s`` key its steps are booked under
    busy_key = "decode"

    def __init__(self, g: DecoderGroup, order: int, status: int, ready_at: float, k: int, p: float,
                 created_s: float) -> None:
        self._init_group(g, order, status, ready_at, created_s)
        self.n_gpus = g.ep
        self._init_ranks(g.ranks, g.template, k, p, g.rank_nics)

    def _init_ranks(self, ep: int, t, k: int, p: float, rank_nics) -> None:
        """The ranks' batches, queues and KV (``t``: a template with ``max_batch_per_rank``, ``kv_page_tokens``,
        ``kv_capacity_tokens_per_rank``). ``ep``: the DP ranks (``DecoderGroup.ranks``: GPUs / attention tp)."""
        self.ep = ep
        self.k = k
        self.p = p
        self.cap = t.max_batch_per_rank
        self.page = t.kv_page_tokens
        self.kv_cap = t.kv_capacity_tokens_per_rank
        self.rank_nics = list(rank_nics)
        self.rank_up = [True] * ep
        self.rank_nreq = [0] * ep        # requests holding KV on the rank (in flight + queued + decoding)
        self.rank_free_kv = [t.kv_capacity_tokens_per_rank] * ep
        # rank_nreq * Scheduler._key_base - rank_free_kv, updated with them (Scheduler._hold_kv / _free_kv): the
        # (requests, -free KV) order as one int, for engine.core.policies.FewestRequests; set by Scheduler._add_decoder
        self.rank_key: list[int] = []
        self.rank_kmin = 0  # min(rank_key), kept with it (Scheduler._hold_kv / _free_kv and where keys are set)
        self.route_i = -1   # its place in Scheduler._route_d (-1: not routable), set with that list
        self.rank_batch = [0] * ep       # decoding
        self.rank_queue: list[deque[RequestState]] = [deque() for _ in range(ep)]
        self.rank_rate = [0] * ep        # sum of fixed-point growth rates
        # sum of (ctx at admission << FP) - rate × first step: a rank's context at step s is
        # (rank_c + s × rank_rate) >> FP (= Σ ctx0 + ((s × Σ rate - Σ rate × s0) >> FP), exactly)
        self.rank_c = [0] * ep
        self.n_qdec = 0
        self.n_running = 0
        self.running: dict[int, RequestState] = {}
        self.heap: list[tuple[int, int]] = []
        self.step = 0
        self.joined: list[tuple[int, int]] = []
        self.left: list[int] = []
        self.plan = None
        self.idle = False
        self.delta: tuple | None = None  # (joined, left) of a step started without its plan (PLAN_PENDING)
        self.admit_blocked = False       # requests queue for decode only on full ranks (set by _admit)
        self.changes = 0                 # see DecoderView.changes

    @property
    def nreq(self) -> int:
        return sum(self.rank_nreq)


class AggregatedState(DecoderState):
    """State of one aggregated worker: a decoder's ranks (batches, decode queues, KV reservations, the finish heap:
    :mod:`engine.core.decoding` runs its decode part) plus prefill. A routed request waits in :attr:`queue` (state
    queued_prefill) until a rank reserves its whole sequence's KV (``rank_nreq`` counts it from then on); it then
    prefills on that rank, chunk by chunk (:attr:`rank_prefill`, state prefilling), joins the rank's decode queue
    when its prompt is done and the batch at the next step. Its ranks receive no KV over a NIC (no ``rank_nics``).
    The routing policy reads ``queued_tokens`` / ``offset_tokens`` / ``n_queued`` / ``max_queue`` as a prefiller's.
    Timeline samples count its GPUs as decode GPUs and its queued / prefilling requests as prefill stages.
    """

    kind = "agg"
    busy_key = "aggregated"

    def __init__(self, g, order: int, status: int, ready_at: float, k: int, p: float, created_s: float) -> None:
        t = g.template
        self._init_group(g, order, status, ready_at, created_s)
        self.n_gpus = len(g.gpus)
        self._init_ranks(g.ranks, t, k, p, ())
        self.budget = t.max_batch_tokens
        self.chunk = t.chunk_tokens
        self.max_queue = t.max_queue_requests
        self.queue: deque[RequestState] = deque()
        self.n_queued = 0
        self.queued_tokens = 0        # prompt tokens routed here and not yet prefilled (queued and placed)
        self.offset_tokens = 0
        self.rank_prefill: list[deque[RequestState]] = [deque() for _ in range(g.ranks)]
        self.n_prefilling = 0         # requests in rank_prefill
        self.cache = None             # its PrefixCache (None: prefix caching off)
        self.loads: list[tuple[int, int, int]] = []  # cache copies the next batch waits for (PrefillBatch.loads)


class AutoscalerState:
    kind = "autoscaler"

    def __init__(self) -> None:
        self.id = AUTOSCALER
        self.idle = False
        self.plan = None


@dataclass(frozen=True)
class Sample:
    """Timeline point (for plots): GPUs per role, and requests per stage."""

    t_s: float
    gpus_prefill: int
    gpus_decode: int
    gpus_starting: int
    queued_prefill: int
    prefilling: int
    kv: int
    queued_decode: int
    decoding: int


class DecoderView(Protocol):
    """What a driver that runs a decoder's steps itself (``sim.fastpath``) may read of its state — read only: the
    scheduler changes it, in :meth:`~engine.core.scheduler.Scheduler.advance_decoder` / ``plain_steps`` among
    others. ``Scheduler.decoder_view`` hands out the :class:`DecoderState` itself under this type (no copy: the
    fast path reads a few of these per simulated step).

    ``changes`` moves whenever the decoder's status, decode queues or running batch change, whoever changes
    them: a driver that derived something from the state (how many coming steps are plain) knows it still holds
    while ``changes`` is what it was then."""

    @property
    def id(self) -> str: ...

    @property
    def n_gpus(self) -> int: ...

    @property
    def step(self) -> int: ...                           # the step in flight (or next to start)

    @property
    def changes(self) -> int: ...

    @property
    def rank_batch(self) -> list[int]: ...               # running requests per rank

    @property
    def rank_c(self) -> list[int]: ...                   # a rank's context at step s: (rank_c + s * rank_rate) >> FP

    @property
    def rank_rate(self) -> list[int]: ...

    @property
    def heap(self) -> list[tuple[int, int]]: ...         # (finish step, request id), a heap; may hold stale entries

    @property
    def delta(self) -> tuple | None: ...                 # (joined, left) of a step started without its plan

