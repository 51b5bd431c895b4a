"""The state the scheduler's parts share, declared in one place.

:class:`~engine.core.scheduler.Scheduler` is assembled from base classes that each handle one concern
(:class:`~engine.core.decoding.Decoding`, :class:`~engine.core.scaling.WorkerPool`,
:class:`~engine.core.failures.FailureHandling`, :class:`~engine.core.aggregated.AggregatedServing`); they
all read and write the same ``self``. :class:`SchedulerBase`, their common base, declares that state: the
attributes ``Scheduler.__init__`` sets (annotations only, no values, so nothing exists at run time that the
constructor does not set) and the methods one part calls on another, as signatures seen only by the type
checker. At run time it is an empty class; the methods resolve to the scheduler's and its parts' own
definitions, which come before it in the method resolution order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from rackbed.engine.core import autoscaler as autoscale
from rackbed.engine.core.decision_log import DecisionLog
from rackbed.engine.core.deployment import DecoderGroup, Deployment, PrefillerGroup
from rackbed.engine.core.plans import DecodeStep, Idle, Stop
from rackbed.engine.core.policies import Policies
from rackbed.engine.core.prefix_cache import PrefixCacheSpec, SharedTier
from rackbed.engine.core.specdec import AcceptanceStream
from rackbed.engine.core.state import (
    AggregatedState,
    AutoscalerState,
    DecoderState,
    KvStreamState,
    PrefillerState,
    RequestState,
    Sample,
)

KvChunks = Callable[[PrefillerGroup, DecoderGroup, int], int]
# a value of ``Scheduler.workers``
Worker = PrefillerState | DecoderState | KvStreamState | AutoscalerState


class SchedulerBase:
    """The scheduler's shared state (see the module docstring; what each field means is said where
    ``Scheduler.__init__`` sets it)."""

    # configuration
    dep: Deployment
    rng: np.random.Generator
    k: int                                   # MTP draft tokens per step
    p: float                                 # MTP acceptance probability
    acceptance: AcceptanceStream
    kv_bytes_per_token: int
    kv_window_bytes: tuple[tuple[int, int], ...]
    chunked: bool
    shed_ttft_s: float | None
    _ptps: float | Callable[[PrefillerGroup], float] | None
    kv_chunks: KvChunks | None
    asc: autoscale.AutoscalerConfig | None
    policies: Policies
    _choose_prefiller: Callable
    _choose_rank: Callable
    _choose_rank_indexed: Callable | None
    _choose_prefiller_indexed: Callable | None
    _choose_worker: Callable
    _take_admitted: Callable
    pcache: PrefixCacheSpec | None
    _shared_tier: SharedTier | None
    _route_name: str
    _route_note: bool
    log: DecisionLog
    _add: Callable[[tuple], None]
    _log_on: bool
    sample_interval_s: float
    next_sample_s: float
    samples: list[Sample]

    # workers
    workers: dict[str, Worker]
    prefillers: list[PrefillerState]
    decoders: list[DecoderState]
    _aggs: list[AggregatedState]
    agg: bool
    _route_p: list[PrefillerState]
    _route_d: list[DecoderState]
    _route_dk: list[int]
    _route_pl: list[int]
    _order: int
    _n_pf_created: int
    _n_dec_created: int
    pool: list[int]
    failed_gpus: set[int]
    nic_down: dict[str, bool]
    _permanent_nic_down: set[str]
    wakeups: list[str]
    _blocked: list[KvStreamState]
    _key_base: int
    _real_accept: bool
    new_workers: list[str]

    # requests and counters
    reqs: dict[int, RequestState]
    rows: list[tuple]
    n_arrived: int
    n_open: int
    closed: bool
    finished: bool
    now_s: float
    _window_tokens: int
    _last_tick: float
    busy_gpu_s: dict[str, float]
    kv_busy_s: float
    decode_steps: int
    decode_tokens: int
    step_durations: list[float]
    max_rank_kv: int
    max_pf_kv: int

    if TYPE_CHECKING:
        # defined by Scheduler
        def _wake(self, w) -> None: ...
        def _load_changed(self, w) -> None: ...
        def _wake_blocked_streams(self) -> None: ...
        def _maybe_finish(self, now_s: float) -> None: ...
        def _reserve_tokens(self, ctx: int, remaining: int, d: DecoderState | None) -> int: ...
        def _prefillers_possible(self) -> bool: ...
        def _decoders_possible(self) -> bool: ...
        def _route_prefill(self, r: RequestState, now: float, requeue: bool) -> None: ...
        def _enqueue_prefill(self, r: RequestState, q, now: float) -> None: ...
        def _reject(self, r: RequestState, now: float, reason: str) -> None: ...
        def _resolve(self, r: RequestState, now: float) -> None: ...
        def _idle(self, w, now: float, waits_for: str, until: float | None = None) -> Idle: ...
        def _stop(self, w, now: float, reason: str) -> Stop: ...
        def _unpin(self, r: RequestState) -> None: ...
        def _unreserve(self, r: RequestState) -> None: ...
        def _hold_kv(self, d: DecoderState, rank: int, tokens: int) -> None: ...
        def _free_kv(self, d: DecoderState, rank: int, tokens: int) -> None: ...
        def _sample(self, now: float, force: bool = False) -> None: ...

        # defined by Decoding
        @staticmethod
        def _decode_plan(d: DecoderState, joined: list, left: list) -> DecodeStep: ...
        def _admit(self, d: DecoderState, now: float) -> None: ...
        def _complete_step(self, d: DecoderState, dur: float, now: float, accepted=None) -> None: ...

        # defined by WorkerPool
        def _register_decoder(self, d: DecoderState) -> DecoderState: ...
        def _reroute_lists(self) -> None: ...
        def _refresh_limits(self) -> None: ...
        def _set_status(self, w, status: int) -> None: ...
        def _retire(self, w, now: float) -> None: ...

        # defined by AggregatedServing
        def _route_aggregated(self, r: RequestState, now: float, requeue: bool) -> None: ...
        def _drop_aggregated_prefill(self, w: AggregatedState) -> list[RequestState]: ...
