"""Decoder groups in the scheduler: admission at a step's boundary, decode steps, finishes, and the step API for
drivers that run decode steps themselves.

A DP-EP decoder group steps synchronously (every rank runs each step; the slowest rank sets its time). At the
boundary before a step, the admission policy (:mod:`engine.core.policies`) moves requests whose KV arrived on a
rank from the rank's queue into its running batch while the batch is under its cap; on admission the number of
decode steps a request needs is drawn (MTP: each step emits ``1 + accepted`` tokens, :mod:`engine.core.specdec`)
and ``(finish_step, request id)`` goes on the group's heap, so a step costs O(ranks + finishing requests), not
O(batch). Each rank's context is kept as exact fixed-point running sums (``rank_c``, ``rank_rate``: a request's
generated tokens grow linearly between admission and finish), so a step's plan costs O(ranks). A driver with real
MTP outcomes passes ``Result.accepted`` and the scheduler counts real tokens instead (O(batch), fine for real
runs).

:meth:`Decoding.advance_decoder` is ``done`` + ``next`` of a decoder in one call without building the plan of the
step it starts (:meth:`Decoding.decode_plan` builds it on demand); :meth:`Decoding.plain_steps` takes the report
of steps a driver took itself; :meth:`Decoding.decoder_view` hands out the read-only view those drivers derive
their shortcuts from (:class:`engine.core.state.DecoderView`, with its change counter).
"""

from __future__ import annotations

from heapq import heappop, heappush
from itertools import compress

from rackbed.engine.core.plans import WAIT_READY, WAIT_WORK, DecodeStep, Plan, Result
from rackbed.engine.core.scheduler_base import SchedulerBase
from rackbed.engine.core.state import (
    ACTIVE,
    DEAD,
    DECODING,
    DONE,
    DRAINING,
    FP,
    PLAN_PENDING,
    RETIRED,
    STARTING,
    STATUS_NAMES,
    DecoderState,
    DecoderView,
    RequestState,
)


class Decoding(SchedulerBase):
    """Decoder admission, steps and finishes (a base class of ``Scheduler``: it uses its state)."""

    # ------------------------------------------------------------------ decode
    def _next_decode(self, d: DecoderState, now: float, build: bool = True) -> Plan | None:
        """``next`` for a decoder: admit, then idle/stop it or start a step. ``build=False`` (``advance_decoder``)
        starts the step without building its plan and returns None."""
        if d.status != ACTIVE:
            st = d.status
            if st == STARTING:
                if now < d.ready_at:
                    return self._idle(d, now, WAIT_READY, d.ready_at)
                self._set_status(d, ACTIVE)
                self._reroute_lists()
                self._wake_blocked_streams()
            elif st in (DEAD, RETIRED):
                return self._stop(d, now, STATUS_NAMES[st])
        if d.n_qdec and not d.admit_blocked:
            self._admit(d, now)
        if d.n_running == 0:
            if self.finished:
                return self._stop(d, now, "finished")
            if d.status == DRAINING and not any(d.rank_nreq):
                self._retire(d, now)
                return self._stop(d, now, "drained")
            return self._idle(d, now, WAIT_WORK)
        joined = d.joined
        left = d.left
        if build:
            plan = d.plan = self._decode_plan(d, joined, left)
        else:  # the plan is built on demand (decode_plan); the step's joins and leaves are kept for it
            plan = None
            d.plan = PLAN_PENDING
            d.delta = (tuple(joined), tuple(left)) if joined or left else None
        if joined:
            joined.clear()
        if left:
            left.clear()
        if self._log_on:
            self._add((now, "decode", d.id, -1, d.step, d.n_running, ""))
        return plan

    @staticmethod
    def _decode_plan(d: DecoderState, joined: list, left: list) -> DecodeStep:
        """The plan of step ``d.step`` (per-rank batch and context now, the given joins and leaves)."""
        s = d.step
        ctx = tuple([(c + s * q) >> FP for c, q in zip(d.rank_c, d.rank_rate)])
        return DecodeStep(d.id, s, tuple(d.rank_batch), ctx, d.k, tuple(joined), tuple(left))

    def _admit(self, d: DecoderState, now: float) -> None:
        # one admission per request served: the decoder's lists and counters are held in locals (and the counts
        # written back once), which saves a dozen attribute look-ups per admission
        d.changes += 1
        cap = d.cap
        s = d.step
        choose = self._take_admitted
        draw = self.acceptance.take
        queues = d.rank_queue
        batch = d.rank_batch
        rate = d.rank_rate
        c = d.rank_c
        running = d.running
        heap = d.heap
        joined = d.joined
        log_on = self._log_on
        n_taken = 0
        room_left = False  # a request still waits on a rank with free batch slots (the policy held it back)
        for rank in compress(range(len(queues)), queues):  # the ranks with a queue, in order (C-level skip)
            b = batch[rank]
            if b >= cap:
                continue
            q = queues[rank]
            for r in choose(q, cap - b):
                n_taken += 1
                m = r.out - r.generated
                n, r.cum, r.cum_i = draw(m)
                r.s0 = s
                rid = r.id
                r.finish_step = fs = s + n - 1
                r.rate_fp = rfp = (m << FP) // n
                r.state = DECODING
                if r.t_decode_start != r.t_decode_start:
                    r.t_decode_start = now
                b += 1
                rate[rank] += rfp
                c[rank] += (r.ctx0 << FP) - rfp * s
                running[rid] = r
                heappush(heap, (fs, rid))
                joined.append((rid, rank))
                if log_on:
                    self._add((now, "admit", d.id, rid, rank, n, ""))
            batch[rank] = b
            if q and b < cap:
                room_left = True
        d.n_running += n_taken
        d.n_qdec -= n_taken
        # whoever still waits is on a full rank: _admit is a no-op until a request finishes or KV arrives
        d.admit_blocked = d.n_qdec > 0 and not room_left

    def _done_decode(self, plan: DecodeStep, result: Result, now: float) -> None:
        d = self.workers[plan.worker]
        if d.plan is not plan:
            return
        d.plan = None
        if result.failed is not None:
            return  # a failed step of a live group is simply retried (nothing advanced)
        self._complete_step(d, result.duration_s, now, result.accepted)

    def _complete_step(self, d: DecoderState, dur: float, now: float, accepted=None) -> None:
        """Step ``d.step`` ended after ``dur``: book it; the requests whose drawn finish step it was are done
        (or, given the real MTP outcomes ``accepted``, those that have all their tokens)."""
        s = d.step
        d.step = s + 1
        self.busy_gpu_s[d.busy_key] += dur * d.n_gpus
        self.decode_steps += 1
        self.step_durations.append(dur)
        if accepted is not None:
            return self._apply_real_acceptance(d, s, accepted, now)
        heap = d.heap
        if not heap or heap[0][0] > s:
            return
        running = d.running
        freed = False
        while heap and heap[0][0] <= s:
            fs, rid = heappop(heap)
            r = running.get(rid)
            if r is None or r.finish_step != fs:
                continue
            self._finish_decode(d, r, now, s - r.s0 + 1, r.out - r.generated)
            freed = True
        if freed and self._blocked:
            self._wake_blocked_streams()

    def _apply_real_acceptance(self, d: DecoderState, s: int, accepted, now: float) -> None:
        heap = d.heap
        while heap and heap[0][0] <= s:
            heappop(heap)  # drawn finish steps are not used with real acceptance
        self._real_accept = True
        done = []
        for rid, r in d.running.items():
            before = r.generated
            r.generated = min(r.out, before + 1 + int(accepted.get(rid, 0)))
            self.decode_tokens += r.generated - before
            if r.generated >= r.out:
                done.append(r)
        for r in done:
            r.generated = r.out
            self._finish_decode(d, r, now, s - r.s0 + 1, 0)
        if done and self._blocked:
            self._wake_blocked_streams()

    def _finish_decode(self, d: DecoderState, r: RequestState, now: float, steps: int, gained: int) -> None:
        rank = r.rank
        rid = r.id
        rfp = r.rate_fp
        reserved = r.reserved
        del d.running[rid]
        d.changes += 1
        d.admit_blocked = False
        d.n_running -= 1
        d.rank_batch[rank] -= 1
        d.rank_rate[rank] -= rfp
        d.rank_c[rank] -= (r.ctx0 << FP) - rfp * r.s0
        self._free_kv(d, rank, reserved)
        d.left.append(rid)
        r.generated += gained
        r.steps += steps
        self.decode_tokens += gained
        r.state = DONE
        if self._log_on:
            self._add((now, "finish", d.id, r.id, r.generated, r.steps, ""))
        self._resolve(r, now)

    # ------------------------------------------------------------------ decode steps run by the driver
    def decoder_view(self, worker: str) -> DecoderView:
        """The state of decoder ``worker``, typed read-only (:class:`~engine.core.state.DecoderView`), for a
        driver that runs its steps through :meth:`advance_decoder` / :meth:`plain_steps`."""
        d = self.workers[worker]
        if d.kind != "decode":
            raise ValueError(f"{worker}: not a decoder")
        return d

    def advance_decoder(self, worker: str, dur_s: float, now_s: float) -> Plan | None:
        """The decode step of ``worker`` in flight ended at ``now_s`` after ``dur_s``: exactly
        ``done(plan, Result(dur_s), now_s)`` then ``next(worker, now_s)``, except that the :class:`DecodeStep` of
        the step this starts is built only when :meth:`decode_plan` asks for it. Returns None when a step started,
        else what ``next`` answered (Idle or Stop). MTP acceptance is drawn (a driver with real outcomes calls
        ``done``)."""
        d = self.workers[worker]
        if d.plan is None or self._real_accept:
            raise RuntimeError(f"{worker}: no drawn decode step in flight")
        self.now_s = now_s
        d.plan = None
        self._complete_step(d, dur_s, now_s)
        if now_s >= self.next_sample_s:
            self._sample(now_s)
        return self._next_decode(d, now_s, build=False)

    def plain_steps(self, worker: str, k: int) -> None:
        """``k`` more decode steps of ``worker`` ended and as many started, each *plain*: nothing finished,
        nobody was admitted, no sample fell due — what ``k`` calls of :meth:`advance_decoder` would have done,
        minus what the driver booked itself in completion order (``step_durations``, ``busy_gpu_s["decode"]``).
        Only with the decision log off (those calls would log each step). The driver reports before any other
        call that concerns this decoder (its next step, :meth:`decode_plan`, ``done``/``next``, :meth:`fail`,
        :meth:`recover`, :meth:`finalize`) — possibly after others (a KV arrival does not read the step counter).
        A claim the state contradicts (a request finishing within those steps) raises."""
        d = self.workers[worker]
        s = d.step
        heap = d.heap
        if self._log_on or d.plan is None or (heap and heap[0][0] < s + k):
            raise RuntimeError(f"{worker}: steps {s}..{s + k - 1} are not plain")
        d.step = s + k
        self.decode_steps += k
        d.delta = None

    def decode_plan(self, worker: str) -> DecodeStep:
        """The :class:`DecodeStep` in flight on ``worker`` — built now if :meth:`advance_decoder` started it (as
        ``next`` would have built it then: nothing it depends on changes while a step runs); after a failure (no
        step in flight) a detached plan the scheduler ignores."""
        d = self.workers[worker]
        plan = d.plan
        if plan is PLAN_PENDING:
            joined, left = d.delta if d.delta is not None else ((), ())
            plan = d.plan = self._decode_plan(d, joined, left)
        elif plan is None:
            plan = self._decode_plan(d, d.joined, d.left)
        return plan
