"""The sans-I/O scheduler of a disaggregated prefill/decode deployment (or of aggregated workers).

It is told the time and what finished; it answers what each worker does next, as frozen plans
(:mod:`engine.core.plans`). It never reads a clock, sleeps, or touches a device; both the SimPy driver and the
real driver call it through :func:`engine.core.worker_loop.worker_loop`: ``arrive`` routes a request, ``next``
answers a worker's next plan (admitting queued requests into a decoder's batch at its step boundary), ``done``
takes a plan's result, ``fail`` / ``recover`` take hardware down and back. The choices are policy objects
(:mod:`engine.core.policies`: prefiller routing, decoder rank choice, decode admission); the state objects are in
:mod:`engine.core.state`, decoder admission and steps in :mod:`engine.core.decoding`, worker creation and
autoscaling in :mod:`engine.core.scaling`, failure handling in :mod:`engine.core.failures`, aggregated workers
(prefill and decode on the same GPUs, mixed steps) in :mod:`engine.core.aggregated` (the four are base classes of
:class:`Scheduler`; the state they share is declared in :mod:`engine.core.scheduler_base`), the invariants tests
check in :mod:`engine.core.invariants`.

A driver that runs decode steps without a plan object per step (the simulator's fast path, :mod:`sim.fastpath`)
uses :meth:`Scheduler.advance_decoder` (``done`` + ``next`` of a decoder in one call, the plan of the step started
built only on demand by :meth:`Scheduler.decode_plan`), :meth:`Scheduler.plain_steps` and the read-only
:meth:`Scheduler.decoder_view`, whose ``changes`` counter moves whenever the decoder's status, queues or batch
change.

Request lifecycle (``RequestState``)::

    arrived → queued_prefill → prefilling → kv_pending → kv_in_flight → queued_decode → decoding → done
                 ↑______________ re-prefill after a failure that lost its KV ____________|
    any state before done → rejected(reason)

- *queued_prefill*: routed to a prefiller (default policy: least queued tokens), waiting in its FIFO queue.
- *prefilling*: in the prefiller's running batch (token budget; with chunked prefill a prompt may span batches).
- When prefill completes the first output token exists: **TTFT = prefill completion − arrival** (the prefiller
  returns the first token to the user at that moment). A request with ``output_tokens == 1`` is done then.
- *kv_pending*: prompt KV sits on the prefiller (counted against its KV buffer) until a KV stream picks it.
- *kv_in_flight*: a decoder rank was chosen (default: fewest requests, most free KV), its KV reserved for the whole
  sequence (``ctx + remaining output + draft_k`` tokens, rounded up to pages) and the transfer runs over the
  prefiller node's NICs. The prefiller's copy is freed when the transfer completes.
- *queued_decode*: KV is on the decoder rank; the request joins the running batch at a step boundary when the
  rank's batch is under its cap and the admission policy takes it (default: first come, first admitted).
- *decoding*: on admission the number of decode steps it needs is drawn (MTP: each step emits ``1 + accepted``
  tokens, see :mod:`engine.core.specdec`) and ``(finish_step, request id)`` goes on the group's heap, so a step
  costs O(ranks + finishing requests), not O(batch). A driver with real MTP outcomes passes
  ``Result.accepted`` and the scheduler counts real tokens instead (O(batch), fine for real runs).
- **TPOT** = (e2e − TTFT) / (output_tokens − 1).

Aggregated workers (a deployment of kind aggregated) run both halves of this lifecycle on one worker, without the
KV states: queued_prefill → prefilling (a rank holds the sequence's KV) → queued_decode → decoding → done (see
:mod:`engine.core.aggregated`).

Prefix caching (``prefix_cache``, :mod:`engine.core.prefix_cache`): each prefiller / aggregated worker owns a
cache; a request acquires its cached prefix when its prefill starts (its batch item then starts at the reused
tokens, and copies from lower tiers ride on the batch as ``loads``), inserts its blocks and releases its pins when
its prompt is done; a dead or retired worker's cache is cleared (``docs/PREFIX_CACHE.md``).

Failures (:meth:`Scheduler.fail`): a dead prefiller's queued and running prompts are routed again; KV it held
is lost, so those requests are prefilled again elsewhere; KV in flight to a dead decoder is re-sent from the
prefiller (which still holds it); a dead decoder's queued/decoding requests lose their KV and are prefilled again
(prompt + tokens generated so far); a KV transfer that fails because its prefiller no longer holds the KV
(``Result.failed == KV_LOST``: a real source declined) is prefilled again too. Nothing is dropped: every request
ends ``done`` or ``rejected`` with a reason. Overload: bounded prefiller queues (``queue_full``), optional TTFT shedding (``ttft_slo_unreachable``),
requests that can never fit (``exceeds_decoder_kv``, ``exceeds_prefiller_kv``) or never be served
(``no_prefiller``, ``no_decoder``; ``unreachable`` when the decoders left have lost every NIC for good: such a
decoder is drained, not routed to), and ``horizon`` for requests still open when a run is cut off.

Determinism: the only randomness is the ``numpy.random.Generator`` passed in; iteration is over lists and
insertion-ordered dicts keyed by ints or created in a deterministic order; ties break by worker creation order,
DP rank and request id. Same (requests, durations, seed) → same plans and the same decision log.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from rackbed.engine.core import autoscaler as autoscale
from rackbed.engine.core.aggregated import AggregatedServing
from rackbed.engine.core.decision_log import DecisionLog
from rackbed.engine.core.decoding import Decoding
from rackbed.engine.core.deployment import DecoderGroup, Deployment, PrefillerGroup
from rackbed.engine.core.failures import FailureHandling
from rackbed.engine.core.invariants import check_invariants
from rackbed.engine.core.plans import (
    KV_LOST,
    WAIT_KV_SPACE,
    WAIT_READY,
    WAIT_WORK,
    DecodeStep,
    Idle,
    KvTransfer,
    MixedStep,
    Plan,
    PrefillBatch,
    Result,
    Stop,
)
from rackbed.engine.core.policies import Policies, overlap_tokens
from rackbed.engine.core.prefix_cache import CacheStats, PrefixCacheSpec
from rackbed.engine.core.request import Request
from rackbed.engine.core.scaling import WorkerPool
from rackbed.engine.core.scheduler_base import KvChunks
from rackbed.engine.core.specdec import AcceptanceStream
from rackbed.engine.core.state import (
    ACTIVE,
    AUTOSCALER,
    DEAD,
    DONE,
    DRAINING,
    KV_IN_FLIGHT,
    KV_PENDING,
    PREFILLING,
    QUEUED_DECODE,
    QUEUED_PREFILL,
    REJECTED,
    RETIRED,
    STARTING,
    STATE_NAMES,
    STATUS_NAMES,
    AutoscalerState,
    DecoderState,
    KvStreamState,
    PrefillerState,
    RequestState,
    Sample,
)

_ROLES = {"prefill": "prefill", "agg": "aggregated"}  # worker kind -> role in groups() (decoders: "decode")


class Scheduler(Decoding, WorkerPool, FailureHandling, AggregatedServing):
    """One scheduler for one deployment (see module docstring).

    rng:                   the run's seeded ``numpy.random.Generator`` (MTP acceptance draws).
    prefill_tokens_per_s:  sustained prefill rate of one prefiller group (tokens/s), a number or a function of
                           the group; used by the autoscaler and TTFT shedding (None: neither can be used).
    kv_chunks:             ``(prefiller, decoder, tokens) -> chunks`` from the resharding plan; default: one
                           contiguous chunk per sending NIC (HND layout).
    autoscaler:            policy config, or None for a fixed deployment.
    sample_interval_s:     spacing of timeline samples.
    log:                   the decision log to append to (default: a new, enabled one).
    policies:              prefiller routing, decoder rank choice and decode admission
                           (:class:`~engine.core.policies.Policies`; default: the rules of the module docstring).
    prefix_cache:          one prefix cache per prefiller / aggregated worker
                           (:class:`~engine.core.prefix_cache.PrefixCacheSpec`; None: off, see the module docstring).
    """

    def __init__(
        self,
        deployment: Deployment,
        rng: np.random.Generator,
        *,
        prefill_tokens_per_s: float | Callable[[PrefillerGroup], float] | None = None,
        kv_chunks: KvChunks | None = None,
        autoscaler: autoscale.AutoscalerConfig | None = None,
        sample_interval_s: float = 1.0,
        log: DecisionLog | None = None,
        policies: Policies | None = None,
        prefix_cache: PrefixCacheSpec | None = None,
    ) -> None:
        self.dep = deployment
        self.rng = rng
        self.k = deployment.mtp.draft_k
        self.p = deployment.mtp.accept_p
        self.acceptance = AcceptanceStream(rng, self.k, self.p, acceptance=deployment.mtp.acceptance)
        self.kv_bytes_per_token = deployment.kv_bytes_per_token
        self.kv_window_bytes = deployment.kv_window_bytes
        self.chunked = deployment.chunked_prefill
        self.shed_ttft_s = deployment.shed_ttft_s
        self._ptps = prefill_tokens_per_s
        self.kv_chunks = kv_chunks
        self.asc = autoscaler
        self.policies = policies = policies if policies is not None else Policies()
        self._choose_prefiller = policies.prefiller.choose
        # the prefiller choice given each routable prefiller's load too (_route_pl), when the policy takes it
        self._choose_prefiller_indexed = getattr(policies.prefiller, "choose_indexed", None)
        self._choose_rank = policies.rank.choose
        # the rank choice given each routable decoder's least rank key too (_route_dk), if the policy takes it
        self._choose_rank_indexed = getattr(policies.rank, "choose_indexed", None)
        self._choose_worker = policies.worker.choose
        self._take_admitted = policies.admission.take
        self.pcache = prefix_cache
        self._shared_tier = prefix_cache.shared_tier() if prefix_cache is not None else None
        route = policies.worker if deployment.aggregated else policies.prefiller
        self._route_name = route.name
        # the route's note names the policy and the prefix overlap (only then: logs stay as they were otherwise)
        self._route_note = prefix_cache is not None or route.name in ("kv_aware", "round_robin", "random")
        self.log = log if log is not None else DecisionLog()
        self._add = self.log.add_record
        self._log_on = self.log.enabled
        self.sample_interval_s = sample_interval_s
        self.next_sample_s = 0.0
        self.samples = []

        self.workers = {}
        self.prefillers = []
        self.decoders = []  # decoders and aggregated workers (decoders that also prefill)
        self._aggs = []  # the aggregated workers
        self.agg = bool(deployment.aggregated)
        self._route_p = []  # routable prefillers (starting/active), creation order
        self._route_pl = []  # their queued_tokens + offset_tokens, in that order (PrefillerState.route_pi)
        self._route_d = []  # routable decoders (active), creation order
        self._route_dk = []  # their rank_kmin, in that order (DecoderState.route_i: a decoder's place there)
        self._order = 0
        self._n_pf_created = 0
        self._n_dec_created = 0
        self.pool = sorted(deployment.spare_gpus)
        self.failed_gpus = set()
        self.nic_down = {}
        self._permanent_nic_down = set()
        self.wakeups = []
        self._blocked = []
        self._key_base = 1                     # > every decoder rank's KV capacity (see _add_decoder)
        self._real_accept = False
        self.new_workers = []

        self.reqs = {}
        self.rows = []
        self.n_arrived = 0
        self.n_open = 0
        self.closed = False
        self.finished = False
        self.now_s = 0.0
        self._window_tokens = 0
        self._last_tick = 0.0
        self.busy_gpu_s = {"prefill": 0.0, "decode": 0.0}
        if self.agg:
            self.busy_gpu_s["aggregated"] = 0.0
        self.kv_busy_s = 0.0
        self.decode_steps = 0
        self.decode_tokens = 0
        self.step_durations = []
        self.max_rank_kv = 0
        self.max_pf_kv = 0

        for g in deployment.prefillers:
            self._add_prefiller(g, ACTIVE, 0.0, 0.0)
        for g in deployment.decoders:
            self._add_decoder(g, ACTIVE, 0.0, 0.0)
        for g in deployment.aggregated:
            self._add_aggregated(g, ACTIVE, 0.0, 0.0)
        if autoscaler is not None:
            self.workers[AUTOSCALER] = AutoscalerState()
        self.new_workers.clear()
        self._refresh_limits()

    # ------------------------------------------------------------------ worker registry
    def group(self, worker: str) -> PrefillerGroup | DecoderGroup | None:
        """The group a worker belongs to (a KV stream belongs to its prefiller group; None for the autoscaler)."""
        w = self.workers[worker]
        if w.kind == "kv":
            return w.pf.g
        return getattr(w, "g", None)

    def groups(self) -> list[tuple[str, str, int, float, float, str]]:
        """``(id, role, n_gpus, created_s, ended_s, status)`` of every group ever created, in creation order."""
        return [(w.id, _ROLES.get(w.kind, "decode"), w.n_gpus, w.created_s, w.ended_s,
                 STATUS_NAMES[w.status]) for w in sorted((*self.prefillers, *self.decoders), key=lambda w: w.order)]

    def worker_ids(self) -> list[str]:
        """All worker ids created so far, in creation order."""
        return list(self.workers)

    def take_new_workers(self) -> list[str]:
        """Worker ids created since the last call (the driver starts a loop for each)."""
        out, self.new_workers = self.new_workers, []
        return out

    def take_wakeups(self) -> list[str]:
        """Idle workers that now have something to do (or must stop), in the order they were woken."""
        out, self.wakeups = self.wakeups, []
        return out

    def _wake(self, w) -> None:
        if w.idle:
            w.idle = False
            self.wakeups.append(w.id)

    def _wake_blocked_streams(self) -> None:
        """Decoder KV was freed or a decoder became routable: retry the KV streams that found no room."""
        blocked, self._blocked = self._blocked, []
        for s in blocked:
            s.blocked = False
            if s.idle:
                s.idle = False
                self.wakeups.append(s.id)

    # ------------------------------------------------------------------ arrivals
    def arrive(self, req: Request, now_s: float) -> None:
        """A request arrives at ``now_s``: route it to a prefiller or reject it with a reason."""
        self.now_s = now_s
        r = RequestState(req)
        if self.pcache is not None:
            r.keys = self.pcache.keys(req.prefix_hash_ids, req.prompt_tokens)
        self.reqs[r.id] = r
        self.n_arrived += 1
        self.n_open += 1
        self._window_tokens += r.prompt
        if self.agg:
            return self._arrive_aggregated(r, now_s)
        if not self._prefillers_possible():
            return self._reject(r, now_s, "no_prefiller")
        if r.out > 1 and not self._decoders_possible():
            return self._reject(r, now_s, self._no_decoder_reason())
        if r.out > 1 and self._reserve_tokens(r.prompt, r.out - 1, None) > self.max_rank_kv:
            return self._reject(r, now_s, "exceeds_decoder_kv")
        if r.prompt > self.max_pf_kv:
            return self._reject(r, now_s, "exceeds_prefiller_kv")
        self._route_prefill(r, now_s, requeue=False)

    def close_arrivals(self, now_s: float) -> None:
        """No more requests will arrive; workers stop once every open request is resolved."""
        self.closed = True
        self._maybe_finish(now_s)

    def _maybe_finish(self, now_s: float) -> None:
        if self.closed and self.n_open == 0 and not self.finished:
            self.finished = True
            for w in self.workers.values():
                self._wake(w)

    def _reserve_tokens(self, ctx: int, remaining: int, d: DecoderState | None) -> int:
        need = ctx + remaining + self.k
        page = d.page if d is not None else self.dep.decoder_template.kv_page_tokens
        return -(-need // page) * page

    def _prefillers_possible(self) -> bool:
        if self._route_p:
            return True
        return self.asc is not None and self._find_prefiller_gpus() is not None

    def _decoders_possible(self) -> bool:
        if self._route_d or any(d.status == STARTING for d in self.decoders):
            return True
        return self.asc is not None and self._find_decoder_gpus() is not None

    def _route_prefill(self, r: RequestState, now: float, requeue: bool) -> None:
        cands = self._route_p
        if not cands and self.asc is not None:
            self._scale_up_prefiller(now)  # emergency: nothing can take it right now
            cands = self._route_p
        indexed = self._choose_prefiller_indexed
        if indexed is not None and cands is self._route_p:
            pf = indexed(cands, self._route_pl, requeue, r)
        else:
            pf = self._choose_prefiller(cands, requeue, r)
        if pf is None:
            return self._reject(r, now, "queue_full" if cands else "no_prefiller")
        if not requeue and self.shed_ttft_s is not None and pf.cap_tps > 0:
            est = (pf.queued_tokens + pf.offset_tokens + r.ctx0) / pf.cap_tps
            if est > self.shed_ttft_s:
                return self._reject(r, now, "ttft_slo_unreachable")
        self._enqueue_prefill(r, pf, now)
        if pf.idle:
            pf.idle = False
            self.wakeups.append(pf.id)

    def _enqueue_prefill(self, r: RequestState, q, now: float) -> None:
        """``r`` joins the prefill queue of ``q`` (a prefiller, or an aggregated worker), logged as its route."""
        if self._log_on:
            note = f"{self._route_name} overlap={overlap_tokens(q, r)}" if self._route_note else ""
            self._add((now, "route_prefill", q.id, r.id, q.queued_tokens, r.ctx0, note))
        r.state = QUEUED_PREFILL
        r.prefiller = q
        r.pf_done = 0
        q.queue.append(r)
        q.n_queued += 1
        q.queued_tokens += r.ctx0
        if q.route_pi >= 0:
            self._route_pl[q.route_pi] = q.queued_tokens + q.offset_tokens

    def _load_changed(self, w) -> None:
        """``w``'s ``queued_tokens`` or ``offset_tokens`` changed: its entry in ``_route_pl`` (if any)."""
        if w.route_pi >= 0:
            self._route_pl[w.route_pi] = w.queued_tokens + w.offset_tokens

    def _reject(self, r: RequestState, now: float, reason: str) -> None:
        r.state = REJECTED
        r.reason = reason
        r.owner = None
        self._add((now, "reject", "", r.id, r.prompt, r.out, reason))
        self._resolve(r, now)

    def _resolve(self, r: RequestState, now: float) -> None:
        pf = r.prefiller
        d = r.decoder
        self.rows.append((
            r.id, r.arrival_s, r.prompt, r.out, STATE_NAMES[r.state], r.reason, r.t_first, now,
            r.t_prefill_start, r.t_kv_start, r.t_kv_done, r.t_decode_start, r.steps, r.requeues,
            pf.id if pf is not None else "", d.id if d is not None else ""))
        del self.reqs[r.id]
        r.cum = None
        self.n_open -= 1
        if self.closed and self.n_open == 0:
            self._maybe_finish(now)

    # ------------------------------------------------------------------ the seam
    def next(self, worker: str, now_s: float) -> Plan:
        """What ``worker`` does next at ``now_s``."""
        self.now_s = now_s
        if now_s >= self.next_sample_s:
            self._sample(now_s)
        w = self.workers[worker]
        kind = w.kind
        if kind == "decode":
            return self._next_decode(w, now_s)
        if kind == "prefill":
            return self._next_prefill(w, now_s)
        if kind == "kv":
            return self._next_kv(w, now_s)
        if kind == "agg":
            return self._next_aggregated(w, now_s)
        return self._next_autoscaler(w, now_s)

    def done(self, plan: Plan, result: Result, now_s: float) -> None:
        """``plan`` finished (or failed) at ``now_s``."""
        self.now_s = now_s
        tp = type(plan)
        if tp is DecodeStep:
            self._done_decode(plan, result, now_s)
        elif tp is PrefillBatch:
            self._done_prefill(plan, result, now_s)
        elif tp is KvTransfer:
            self._done_kv(plan, result, now_s)
        elif tp is MixedStep:
            self._done_aggregated(plan, result, now_s)
        # Idle / Stop: nothing to account

    def _idle(self, w, now: float, waits_for: str, until: float | None = None) -> Idle:
        w.idle = True
        w.waits_for = waits_for
        w.plan = None
        if self._log_on:
            self._add((now, "idle", w.id, -1, 0, 0, waits_for))
        return Idle(w.id, until, waits_for)

    def _stop(self, w, now: float, reason: str) -> Stop:
        w.idle = False
        w.plan = None
        self._add((now, "stop", w.id, -1, 0, 0, reason))
        return Stop(w.id, reason)

    # ------------------------------------------------------------------ prefill
    def _next_prefill(self, pf: PrefillerState, now: float) -> Plan:
        st = pf.status
        if st == STARTING:
            if now < pf.ready_at:
                return self._idle(pf, now, WAIT_READY, pf.ready_at)
            self._set_status(pf, ACTIVE)
            pf.offset_tokens = 0
            self._load_changed(pf)
            for s in pf.streams:
                self._wake(s)
        elif st in (DEAD, RETIRED):
            return self._stop(pf, now, STATUS_NAMES[st])
        if self.finished:
            return self._stop(pf, now, "finished")
        q = pf.queue
        if not q:
            if st == DRAINING and self._pf_drained(pf):
                self._retire(pf, now)
                return self._stop(pf, now, "drained")
            return self._idle(pf, now, WAIT_WORK)
        budget = pf.budget
        room = pf.kv_cap - pf.kv_held
        items = []
        running = pf.running
        tokens = 0
        chunked = self.chunked
        cache = pf.cache
        while q:
            r = q[0]
            if cache is not None and r.pin is None:
                if tokens + r.ctx0 > room:  # its reused prefix is held too: the whole prompt must fit
                    break
                self._acquire(pf, r)
            left = r.ctx0 - r.pf_done
            if chunked:
                n = min(left, budget - tokens, room - tokens)
                if n <= 0:
                    break
            else:
                n = left
                if tokens + n > room or (items and tokens + n > budget):
                    break
            q.popleft()
            pf.n_queued -= 1
            items.append((r.id, r.pf_done, n))
            running.append(r)
            tokens += n
            r.state = PREFILLING
            if r.t_prefill_start != r.t_prefill_start:  # NaN: first time
                r.t_prefill_start = now
            if tokens >= budget:
                break
        if not items:
            return self._idle(pf, now, WAIT_KV_SPACE)
        if cache is not None and pf.loads:
            plan = PrefillBatch(pf.id, pf.batches, tuple(items), tokens, tuple(pf.loads))
            pf.loads.clear()
        else:
            plan = PrefillBatch(pf.id, pf.batches, tuple(items), tokens)
        pf.batches += 1
        pf.kv_held += tokens
        for r in running:
            r.owner = plan
        pf.plan = plan
        pf.idle = False
        if self._log_on:
            self._add((now, "prefill", pf.id, -1, plan.batch, tokens, str(len(items))))
        return plan

    def _done_prefill(self, plan: PrefillBatch, result: Result, now: float) -> None:
        pf = self.workers[plan.worker]
        if pf.plan is not plan:
            return  # the worker failed meanwhile; fail() already re-queued its work
        pf.plan = None
        if result.failed is not None:
            pf.kv_held -= plan.n_tokens
            self._requeue_running_prefill(pf, now, result.failed)
            return
        self.busy_gpu_s["prefill"] += result.duration_s * pf.n_gpus
        partial = []
        n_new = 0
        for r, item in zip(pf.running, plan.items):
            n = item[2]
            if r.owner is not plan:
                pf.kv_held -= n  # dropped meanwhile: release its chunk
                continue
            r.owner = None
            r.pf_done += n
            pf.queued_tokens -= n
            if r.pf_done < r.ctx0:
                r.state = QUEUED_PREFILL
                partial.append(r)
                continue
            if r.pin is not None:
                self._cache_prompt(pf, r)
            r.generated += 1
            if r.t_first != r.t_first:
                r.t_first = now
            if r.generated >= r.out:
                pf.kv_held -= r.ctx0
                r.state = DONE
                if self._log_on:
                    self._add((now, "finish", pf.id, r.id, r.generated, r.steps, ""))
                self._resolve(r, now)
                continue
            r.state = KV_PENDING
            pf.pending.append(r)
            n_new += 1
        pf.running = []
        if pf.route_pi >= 0:
            self._route_pl[pf.route_pi] = pf.queued_tokens + pf.offset_tokens
        for r in reversed(partial):
            pf.queue.appendleft(r)
            pf.n_queued += 1
        if n_new:  # one idle stream per new pending request (the others would find nothing and idle again)
            for s in pf.streams:
                if s.idle and not s.blocked:
                    s.idle = False
                    self.wakeups.append(s.id)
                    n_new -= 1
                    if not n_new:
                        break

    # ------------------------------------------------------------------ prefix cache
    def _acquire(self, w, r: RequestState) -> None:
        """``r`` starts its prefill on ``w`` (a prefiller or an aggregated worker with a cache): pin its cached
        prefix, which it then does not prefill (``pf_done`` starts there); copies up from lower tiers wait in
        ``w.loads`` for the next batch (it runs once they are in HBM)."""
        pin = r.pin = w.cache.acquire(r.keys, r.ctx0)
        c = pin.cached_tokens
        if c:
            r.pf_done = c
            w.queued_tokens -= c
            self._load_changed(w)
            if w.kind == "prefill":
                w.kv_held += c
            per_block = pin.block_tokens * self.kv_bytes_per_token
            for t, n in enumerate(pin.copied):
                if n:
                    w.loads.append((r.id, t, n * per_block))

    def _cache_prompt(self, w, r: RequestState) -> None:
        """``r``'s prompt is prefilled on ``w``: its blocks join the cache; its pins are released."""
        w.cache.insert(r.pin, r.keys)
        w.cache.release(r.pin)
        r.pin = None

    def _unpin(self, r: RequestState) -> None:
        """``r`` leaves its prefiller's queue before its prompt was done: release its pins (void ones after the
        worker's cache was cleared are ignored)."""
        if r.pin is not None:
            w = r.prefiller
            if w is not None and w.cache is not None:
                w.cache.release(r.pin)
            r.pin = None

    def prefix_cache_stats(self) -> CacheStats | None:
        """Every worker's cache statistics summed (dead and retired workers included); None without caches."""
        if self.pcache is None:
            return None
        total = None
        for w in (*self.prefillers, *self._aggs):
            if w.cache is None:
                continue
            if total is None:
                total = CacheStats(n_tiers=w.cache.n_tiers, block_tokens=w.cache.block_tokens)
            total.add(w.cache.stats)
        return total

    def _requeue_running_prefill(self, pf: PrefillerState, now: float, why: str) -> None:
        """A failed batch on a live prefiller: its chunks are dropped, its prompts go back to the queue head."""
        back = []
        for r in pf.running:
            if r.owner is not None:
                r.owner = None
                back.append(r)
        pf.running = []
        for r in reversed(back):
            r.state = QUEUED_PREFILL
            pf.queue.appendleft(r)
            pf.n_queued += 1
            self._add((now, "requeue", pf.id, r.id, 0, 0, why))

    def _pf_drained(self, pf: PrefillerState) -> bool:
        return not pf.queue and not pf.running and not pf.pending and pf.kv_held == 0

    # ------------------------------------------------------------------ KV transfer
    def _next_kv(self, s: KvStreamState, now: float) -> Plan:
        pf = s.pf
        if pf.status in (DEAD, RETIRED):
            return self._stop(s, now, STATUS_NAMES[pf.status])
        if self.finished:
            return self._stop(s, now, "finished")
        if pf.status == STARTING:
            return self._idle(s, now, WAIT_READY)
        if not pf.pending:
            return self._idle(s, now, WAIT_WORK)
        up = pf.up_nics
        if not up:
            return self._idle(s, now, WAIT_WORK)
        while pf.pending:
            r = pf.pending[0]
            remaining = r.out - r.generated
            if not self._route_d and not self._decoders_possible():
                pf.pending.popleft()
                pf.kv_held -= r.ctx0
                self._reject(r, now, self._no_decoder_reason())
                self._wake(pf)
                continue
            need_probe = r.ctx0 + remaining + self.k
            indexed = self._choose_rank_indexed
            if indexed is not None:
                pick = indexed(self._route_d, self._route_dk, need_probe)
            else:
                pick = self._choose_rank(self._route_d, need_probe)
            if pick is not None:
                d, rank = pick
                need = -(-need_probe // d.page) * d.page  # _reserve_tokens(r.ctx0, remaining, d)
                if need > d.rank_free_kv[rank]:  # page rounding: retry with the rounded size
                    pick = self._choose_rank(self._route_d, need)
                    if pick is not None:
                        d, rank = pick
                        need = -(-need_probe // d.page) * d.page
            if pick is None:
                if not s.blocked:
                    s.blocked = True
                    self._blocked.append(s)
                return self._idle(s, now, WAIT_KV_SPACE)
            pf.pending.popleft()
            self._hold_kv(d, rank, need)
            r.reserved = need
            r.decoder = d
            r.rank = rank
            r.state = KV_IN_FLIGHT
            r.t_kv_start = now
            n_bytes = r.ctx0 * self.kv_bytes_per_token
            if self.kv_window_bytes:  # sliding-window layers ship their window only
                n_bytes = self.dep.kv_transfer_bytes(r.ctx0)
            n_up = len(up)
            each, extra = divmod(n_bytes, n_up)
            dst_nic = d.rank_nics[rank]
            if extra:
                flows = tuple([(nic, dst_nic, each + 1 if j < extra else each) for j, nic in enumerate(up)])
            else:
                flows = tuple([(nic, dst_nic, each) for nic in up])
            n_chunks = self.kv_chunks(pf.g, d.g, r.ctx0) if self.kv_chunks is not None else n_up
            plan = KvTransfer(s.id, r.id, pf.id, d.id, rank, r.ctx0, n_bytes, n_chunks, flows)
            r.owner = plan
            s.plan = plan
            s.req = r
            s.blocked = False
            if self._log_on:
                self._add((now, "route_decode", d.id, r.id, rank, need, ""))
                self._add((now, "kv_transfer", s.id, r.id, n_bytes, n_chunks, d.id))
            return plan
        return self._idle(s, now, WAIT_WORK)

    def _done_kv(self, plan: KvTransfer, result: Result, now: float) -> None:
        s = self.workers[plan.worker]
        if s.plan is not plan:
            return
        s.plan = None
        r = s.req
        s.req = None
        if r is None or r.owner is not plan:
            return
        r.owner = None
        pf = s.pf
        d = r.decoder
        if result.failed is not None:
            self._unreserve(r)
            if result.failed == KV_LOST:
                # the prefiller no longer holds the KV (its source declined): prefill it again, as after the
                # prefiller's death; shipping it again would decline again
                pf.kv_held -= r.ctx0
                self._wake_prefiller(pf)
                self._requeue_prefill(r, now, KV_LOST, lost_kv=True)
                return
            r.state = KV_PENDING
            pf.pending.appendleft(r)
            self._add((now, "requeue", s.id, r.id, 0, 0, result.failed))
            return
        self.kv_busy_s += result.duration_s
        pf.kv_held -= r.ctx0
        r.t_kv_done = now
        r.state = QUEUED_DECODE
        d.rank_queue[r.rank].append(r)
        d.n_qdec += 1
        d.changes += 1
        d.admit_blocked = False
        if d.idle:
            d.idle = False
            self.wakeups.append(d.id)
        self._wake_prefiller(pf)

    def _wake_prefiller(self, pf: PrefillerState) -> None:
        """``pf`` holds less KV now: wake it if it waits for KV room, or drains (it may be done)."""
        if pf.idle and (pf.waits_for == WAIT_KV_SPACE or pf.status == DRAINING):
            pf.idle = False
            self.wakeups.append(pf.id)

    def _unreserve(self, r: RequestState) -> None:
        d = r.decoder
        if d is not None and r.rank >= 0:
            self._free_kv(d, r.rank, r.reserved)
        r.reserved = 0
        r.rank = -1

    def _hold_kv(self, d: DecoderState, rank: int, tokens: int) -> None:
        """A request reserves ``tokens`` of KV on ``rank`` of ``d`` (the rank's counts and key move together)."""
        d.rank_free_kv[rank] -= tokens
        d.rank_nreq[rank] += 1
        keys = d.rank_key
        old = keys[rank]
        keys[rank] = old + self._key_base + tokens
        if old == d.rank_kmin:  # the key grew: it may have been the only minimum
            d.rank_kmin = k = min(keys)
            if d.route_i >= 0:
                self._route_dk[d.route_i] = k

    def _free_kv(self, d: DecoderState, rank: int, tokens: int) -> None:
        """A request's reservation of ``tokens`` on ``rank`` of ``d`` is released."""
        d.rank_free_kv[rank] += tokens
        d.rank_nreq[rank] -= 1
        keys = d.rank_key
        v = keys[rank] - (self._key_base + tokens)
        keys[rank] = v
        if v < d.rank_kmin:
            d.rank_kmin = v
            if d.route_i >= 0:
                self._route_dk[d.route_i] = v

    # ------------------------------------------------------------------ end of run, samples, checks
    def finalize(self, now_s: float, reason: str = "horizon") -> None:
        """End of the run: every request still open is rejected with ``reason`` (``horizon`` when the run was
        cut off)."""
        self.now_s = now_s
        for rid in sorted(self.reqs):
            r = self.reqs[rid]
            r.state = REJECTED
            r.reason = reason
            self._add((now_s, "reject", "", r.id, r.prompt, r.out, reason))
            self._resolve(r, now_s)
        for w in (*self.prefillers, *self.decoders):
            if w.ended_s != w.ended_s:
                w.ended_s = now_s
        self._sample(now_s, force=True)

    def _sample(self, now: float, force: bool = False) -> None:
        if not force:
            self.next_sample_s = now + self.sample_interval_s
        gp = sum(p.n_gpus for p in self.prefillers if p.status in (ACTIVE, DRAINING))
        gd = sum(d.n_gpus for d in self.decoders if d.status in (ACTIVE, DRAINING))
        gs = sum(w.n_gpus for w in (*self.prefillers, *self.decoders) if w.status == STARTING)
        self.samples.append(Sample(
            t_s=now, gpus_prefill=gp, gpus_decode=gd, gpus_starting=gs,
            queued_prefill=sum(p.n_queued for p in (*self.prefillers, *self._aggs)),
            prefilling=sum(len(p.running) for p in self.prefillers) + sum(w.n_prefilling for w in self._aggs),
            kv=sum(len(p.pending) + sum(1 for s in p.streams if s.req is not None) for p in self.prefillers),
            queued_decode=sum(d.n_qdec for d in self.decoders),
            decoding=sum(d.n_running for d in self.decoders)))

    def state_of(self, request_id: int) -> str:
        """Current state name of a request (``done``/``rejected`` once resolved)."""
        r = self.reqs.get(request_id)
        if r is not None:
            return STATE_NAMES[r.state]
        for row in self.rows:
            if row[0] == request_id:
                return row[4]
        raise KeyError(request_id)

    def check_invariants(self) -> None:
        """Assert the internal invariants (for tests): see :func:`engine.core.invariants.check_invariants`."""
        check_invariants(self)


