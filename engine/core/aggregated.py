"""Aggregated workers in the scheduler: prefill and decode on the same GPUs, one mixed step at a time.

An aggregated worker (``A<i>``, :class:`engine.core.deployment.AggregatedGroup`) is what vLLM, SGLang and
TensorRT-LLM run by default: no KV ever moves. Its state (:class:`engine.core.state.AggregatedState`) is a
decoder's — ranks with batches, decode queues, KV reservations and the finish heap, so the decode part of every
step is :mod:`engine.core.decoding`'s own (admission policy, MTP draws, finishes) — plus prefill:

    arrived → queued_prefill → prefilling → queued_decode → decoding → done
      (worker queue)  (a rank holds its KV; chunks)  (next step boundary)

- *routing*: on arrival the worker policy (``Policies.worker``; default: fewest open requests) picks a worker;
  the request waits in the worker's FIFO queue.
- *placement*: at a step boundary, queued requests (head first) take a rank: the rank policy
  (``Policies.rank``) picks one whose free KV covers the whole sequence (``ctx + remaining output + draft_k``
  tokens, rounded up to pages) and that holds fewer than ``max_batch_per_rank`` requests; the reservation holds
  until the request finishes, so a placed request can never run out of KV (no preemption). A head that fits
  nowhere waits (later requests wait behind it).
- *a step*: each rank's decode batch (``1 + draft_k`` tokens per sequence) comes first in the rank's token budget
  (``max_batch_tokens``); the rank's prefilling requests take the rest in order, at most ``chunk_tokens`` each
  (``None``: whole prompts; one larger than the room left goes alone). The plan is a
  :class:`~engine.core.plans.MixedStep`.
- *after a step*: the decode part completes as a decoder's step (finishes free their KV); a request whose last
  chunk ran has its first token (**TTFT**) and joins the rank's decode queue — the batch admits it at the next
  boundary. Its ``kv_start_s`` / ``kv_done_s`` are that moment (no transfer).

Failures re-route like a dead decoder's work (:mod:`engine.core.failures`): the dead worker's queued and
prefilling requests are routed again as they were; its decoding requests lost their KV and are prefilled again
(prompt + tokens generated so far). Reasons of their own: ``no_worker`` (no aggregated worker left),
``exceeds_worker_kv`` (a sequence larger than a rank's KV).
"""

from __future__ import annotations

from itertools import compress

from rackbed.engine.core.plans import WAIT_KV_SPACE, WAIT_WORK, MixedStep, Plan, Result
from rackbed.engine.core.scheduler_base import SchedulerBase
from rackbed.engine.core.state import (
    DEAD,
    DONE,
    PREFILLING,
    QUEUED_DECODE,
    RETIRED,
    STATUS_NAMES,
    AggregatedState,
    RequestState,
)


class AggregatedServing(SchedulerBase):
    """Routing, placement, mixed steps and failures of aggregated workers (a base class of ``Scheduler``)."""

    def _add_aggregated(self, g, status: int, ready_at: float, now: float) -> AggregatedState:
        w = AggregatedState(g, self._order, status, ready_at, self.k, self.p, now)
        if self.pcache is not None:
            w.cache = self.pcache.make(self._shared_tier)
        self._register_decoder(w)
        self._aggs.append(w)
        return w

    # ------------------------------------------------------------------ arrivals and routing
    def _arrive_aggregated(self, r: RequestState, now: float) -> None:
        if not self._route_d:
            return self._reject(r, now, "no_worker")
        if self._reserve_tokens(r.prompt, r.out - 1, self._aggs[0]) > self.max_rank_kv:
            return self._reject(r, now, "exceeds_worker_kv")
        self._route_aggregated(r, now, requeue=False)

    def _route_aggregated(self, r: RequestState, now: float, requeue: bool) -> None:
        cands = self._route_d
        w = self._choose_worker(cands, requeue, r)
        if w is None:
            return self._reject(r, now, "queue_full" if cands else "no_worker")
        self._enqueue_prefill(r, w, now)
        w.changes += 1
        self._wake(w)

    # ------------------------------------------------------------------ a step
    def _next_aggregated(self, w: AggregatedState, now: float) -> Plan:
        if w.status in (DEAD, RETIRED):
            return self._stop(w, now, STATUS_NAMES[w.status])
        if w.n_queued:
            self._place(w, now)
        if w.n_qdec and not w.admit_blocked:
            self._admit(w, now)
        items, per_rank = self._chunks(w, now) if w.n_prefilling else ((), (0,) * w.ep)
        if w.n_running == 0 and not items:
            if self.finished:
                return self._stop(w, now, "finished")
            return self._idle(w, now, WAIT_KV_SPACE if w.n_queued else WAIT_WORK)
        d = self._decode_plan(w, w.joined, w.left)
        plan = w.plan = MixedStep(w.id, d.step, d.rank_batch, d.rank_context_tokens, d.draft_k, d.joined, d.left,
                                  items, per_rank, tuple(w.loads) if items and w.loads else ())
        if items and w.loads:
            w.loads.clear()
        w.joined.clear()
        w.left.clear()
        w.idle = False
        if self._log_on:
            self._add((now, "mixed", w.id, -1, plan.step, w.n_running, str(plan.prefill_tokens)))
        return plan

    def _place(self, w: AggregatedState, now: float) -> None:
        """Queued requests, head first, take a rank that can hold their whole sequence (module docstring)."""
        q = w.queue
        page = w.page
        while q:
            r = q[0]
            need = -(-(r.ctx0 + r.out - r.generated - 1 + self.k) // page) * page
            pick = self._choose_rank((w,), need)
            if pick is None or w.rank_nreq[pick[1]] >= w.cap:
                return
            rank = pick[1]
            q.popleft()
            w.n_queued -= 1
            self._hold_kv(w, rank, need)
            r.reserved = need
            r.rank = rank
            r.decoder = w
            r.state = PREFILLING
            w.rank_prefill[rank].append(r)
            w.n_prefilling += 1
            if w.cache is not None and r.pin is None:
                self._acquire(w, r)
            w.changes += 1
            if self._log_on:
                self._add((now, "route_decode", w.id, r.id, rank, need, ""))

    def _chunks(self, w: AggregatedState, now: float) -> tuple[tuple, tuple[int, ...]]:
        """The prefill chunks of the next step: per rank, the budget its decode tokens leave (module docstring)."""
        items = []
        per_rank = [0] * w.ep
        per_seq = 1 + self.k
        chunk = w.chunk
        batch = w.rank_batch
        for rank in compress(range(w.ep), w.rank_prefill):
            room = w.budget - batch[rank] * per_seq
            used = 0
            for r in w.rank_prefill[rank]:
                if used >= room:
                    break
                n = r.ctx0 - r.pf_done
                if chunk is not None:
                    n = min(n, chunk, room - used)
                elif used and used + n > room:
                    break
                items.append((r.id, rank, r.pf_done, n))
                used += n
                if r.t_prefill_start != r.t_prefill_start:  # NaN: its first chunk
                    r.t_prefill_start = now
            per_rank[rank] = used
        return tuple(items), tuple(per_rank)

    def _done_aggregated(self, plan: MixedStep, result: Result, now: float) -> None:
        w = self.workers[plan.worker]
        if w.plan is not plan:
            return  # the worker failed meanwhile; fail() already re-routed its work
        w.plan = None
        if result.failed is not None:
            return  # a failed step of a live worker is retried (nothing advanced)
        if any(plan.rank_batch):
            self._complete_step(w, result.duration_s, now, result.accepted)
        else:
            w.step += 1
            self.busy_gpu_s[w.busy_key] += result.duration_s * w.n_gpus
        reqs = self.reqs
        for rid, rank, _start, n in plan.prefill:
            r = reqs[rid]
            r.pf_done += n
            w.queued_tokens -= n
            if r.pf_done >= r.ctx0:
                self._prefilled(w, r, rank, now)

    def _prefilled(self, w: AggregatedState, r: RequestState, rank: int, now: float) -> None:
        """``r``'s last chunk ran: its next token exists; it finishes or waits for the rank's decode batch."""
        w.rank_prefill[rank].remove(r)
        w.n_prefilling -= 1
        if r.pin is not None:
            self._cache_prompt(w, r)
        w.changes += 1
        w.admit_blocked = False
        r.generated += 1
        if r.t_first != r.t_first:
            r.t_first = now
        if r.generated >= r.out:
            self._free_kv(w, rank, r.reserved)
            r.reserved = 0
            w.left.append(r.id)  # its KV leaves the rank with the next step (a real rank frees it then)
            r.state = DONE
            if self._log_on:
                self._add((now, "finish", w.id, r.id, r.generated, r.steps, ""))
            self._resolve(r, now)
            return
        r.t_kv_start = r.t_kv_done = now
        r.state = QUEUED_DECODE
        w.rank_queue[rank].append(r)
        w.n_qdec += 1

    # ------------------------------------------------------------------ failures
    def _drop_aggregated_prefill(self, w: AggregatedState) -> list[RequestState]:
        """A dead worker's queued and prefilling requests (none generated a token on it since it took them: they
        are routed again as they were, their partial KV dropped); its queues are emptied."""
        redo = list(w.queue)
        for q in w.rank_prefill:
            redo.extend(q)
            q.clear()
        w.queue.clear()
        w.n_queued = w.n_prefilling = w.queued_tokens = 0
        w.loads.clear()
        if w.cache is not None:
            w.cache.clear()  # the worker died: its cached KV with it (pins voided)
        for r in redo:
            r.reserved = 0
            r.rank = -1
        return redo
