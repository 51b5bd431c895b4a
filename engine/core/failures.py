"""What the scheduler does when hardware fails or comes back (:meth:`FailureHandling.fail` / ``recover``).

A GPU failure kills every group using the GPU; a NIC failure fails the KV transfers using it (they are retried
from the prefiller's copy) and kills a prefiller whose NICs are all down for good. A node or a rack (an NVLink
domain) fails as all its GPUs and NICs at once; a rack's fabric link (``rack_link``) as all its NICs. Work on
a dead group is never dropped: queued and running prompts are routed again, requests whose KV was lost are
prefilled again (prompt plus the tokens generated so far), KV in flight to a dead decoder is re-sent.
:class:`engine.core.scheduler.Scheduler` inherits these methods; they change its state like every other
scheduling call.
"""

from __future__ import annotations

from rackbed.engine.core.scheduler_base import SchedulerBase
from rackbed.engine.core.state import (
    ACTIVE,
    ARRIVED,
    DEAD,
    DONE,
    DRAINING,
    KV_PENDING,
    QUEUED_PREFILL,
    STARTING,
    DecoderState,
    PrefillerState,
    RequestState,
)
from rackbed.topology.errors import UserError


class FailureHandling(SchedulerBase):
    """Failure and recovery handling of the scheduler (a base class of ``Scheduler``: it uses its state)."""

    def fail(self, target: str, now_s: float, *, permanent: bool = True) -> list[str]:
        """Take ``target`` down at ``now_s``: ``"gpu:<i>"``, ``"node:<host>"``, ``"nic:<k>"`` (the NIC's
        link), ``"rack:<domain>"`` (every GPU and NIC of NVLink domain ``domain``) or ``"rack_link:<domain>"``
        (every NIC's link of the domain).

        Groups using a failed GPU die; their work is re-queued (see module docstring). A NIC going down fails the
        transfers using it (they are retried); a prefiller whose NICs are all permanently down dies too.
        Returns the worker ids whose in-flight plan was aborted (the driver interrupts them; their ``done`` is
        then ignored).
        """
        self.check_target(target)
        self.now_s = now_s
        self._add((now_s, "fault", "", -1, 0, 0, target))
        aborted: list[str] = []
        gpus, nics = self._target_parts(target)
        if gpus:
            self._fail_gpus(gpus, now_s, aborted)
        for nic in nics:
            self._fail_nic(nic, now_s, aborted, permanent)
        self._after_failure(now_s)
        return aborted

    def check_target(self, target: str) -> None:
        """Raise a one-line ``UserError`` unless ``target`` names a GPU, host, NIC or rack of the
        deployment."""
        kind, _, ident = target.partition(":")
        ok = False
        if ident.isdigit():
            if kind == "gpu":
                ok = int(ident) in self.dep.gpu_host
            elif kind == "node":
                ok = int(ident) in set(self.dep.gpu_host.values())
            elif kind == "nic":
                ok = target in self.dep.nic_GBps
            elif kind in ("rack", "rack_link"):
                ok = int(ident) in set(self.dep.gpu_domain.values())
        if not ok:
            raise UserError(f"faults: target {target!r} is not a GPU, node, NIC or rack of deployment "
                            f"{self.dep.name!r}")

    def _target_parts(self, target: str) -> tuple[list[int], list[str]]:
        """``(GPUs, NICs)`` a fault target takes down (a checked target): a GPU itself; a node or a rack all
        its GPUs and their NICs; a NIC itself; a rack's link every NIC of the rack."""
        kind, _, ident = target.partition(":")
        i = int(ident)
        if kind == "gpu":
            return [i], []
        if kind == "nic":
            return [], [target]
        if kind == "node":
            gpus = sorted(g for g, h in self.dep.gpu_host.items() if h == i)
        elif kind in ("rack", "rack_link"):
            gpus = sorted(g for g, d in self.dep.gpu_domain.items() if d == i)
        else:
            raise ValueError(f"fault target {target!r}: expected gpu:<i>, node:<host>, nic:<k>, "
                             "rack:<domain> or rack_link:<domain>")
        nics = sorted({self.dep.gpu_nic[g] for g in gpus if g in self.dep.gpu_nic})
        return ([] if kind == "rack_link" else gpus), nics

    def recover(self, target: str, now_s: float) -> None:
        """Bring ``target`` back: a NIC serves transfers again; GPUs return to the spare pool (dead groups stay
        dead — the autoscaler may build new ones)."""
        self.check_target(target)
        self.now_s = now_s
        self._add((now_s, "fault", "", -1, 1, 0, "recover " + target))
        gpus, nics = self._target_parts(target)
        for g in gpus:
            if g in self.failed_gpus:
                self.failed_gpus.discard(g)
                if not any(g in w.gpus for w in (*self.prefillers, *self.decoders)
                           if w.status in (STARTING, ACTIVE, DRAINING)):
                    self.pool = sorted(set(self.pool) | {g})
        for nic in nics:
            self.nic_down.pop(nic, None)
            self._permanent_nic_down.discard(nic)
            for pf in self.prefillers:
                for i, n in enumerate(pf.nics):
                    if n == nic:
                        pf.nic_up[i] = True
                if pf.status in (ACTIVE, STARTING):
                    for s in pf.streams:
                        self._wake(s)
            for d in self.decoders:
                for r, n in enumerate(d.rank_nics):
                    if n == nic:
                        d.rank_up[r] = True
        self._reroute_lists()
        self._refresh_limits()
        self._wake_blocked_streams()

    def _fail_gpus(self, gpus: list[int], now: float, aborted: list[str]) -> None:
        gs = set(gpus)
        self.failed_gpus |= gs
        self.pool = [g for g in self.pool if g not in gs]
        for pf in list(self.prefillers):
            if pf.status in (STARTING, ACTIVE, DRAINING) and gs & set(pf.gpus):
                self._kill_prefiller(pf, now, aborted, "gpu_failed")
        for d in list(self.decoders):
            if d.status in (STARTING, ACTIVE, DRAINING) and gs & set(d.gpus):
                self._kill_decoder(d, now, aborted, "gpu_failed")

    def _fail_nic(self, nic: str, now: float, aborted: list[str], permanent: bool) -> None:
        self.nic_down[nic] = True
        if permanent:
            self._permanent_nic_down.add(nic)
        for pf in self.prefillers:
            for i, n in enumerate(pf.nics):
                if n == nic:
                    pf.nic_up[i] = False
        for d in self.decoders:
            for r, n in enumerate(d.rank_nics):
                if n == nic:
                    d.rank_up[r] = False
        # transfers using the NIC fail and are retried from the prefiller's copy
        for pf in self.prefillers:
            for s in pf.streams:
                plan = s.plan
                if plan is not None and any(nic in (f[0], f[1]) for f in plan.flows):
                    r = s.req
                    s.plan = None
                    s.req = None
                    aborted.append(s.id)
                    if r is not None and r.owner is plan:
                        r.owner = None
                        self._unreserve(r)
                        r.state = KV_PENDING
                        pf.pending.appendleft(r)
                        self._add((now, "requeue", s.id, r.id, 0, 0, "link_failed"))
        for pf in list(self.prefillers):
            if pf.status in (STARTING, ACTIVE, DRAINING) and not any(pf.nic_up) and \
                    all(n in self._permanent_nic_down for n in pf.nics):
                self._kill_prefiller(pf, now, aborted, "nics_failed")
        if permanent:
            for d in self.decoders:
                if d.status in (STARTING, ACTIVE) and self._unreachable(d):
                    self._drain_unreachable(d, now)
        self._reroute_lists()

    def _unreachable(self, d: DecoderState) -> bool:
        """``d`` can never receive KV again: a decoder group whose every rank's NIC is down for good (an aggregated
        worker receives none: never)."""
        return d.kind == "decode" and all(n in self._permanent_nic_down for n in d.rank_nics)

    def _drain_unreachable(self, d: DecoderState, now: float) -> None:
        """A decoder no KV can reach any more drains: it takes no new requests (not routable, not counted as live
        by the autoscaler), decodes those whose KV it holds, then retires (its GPUs whose NICs are down are not
        used for a new decoder, :meth:`_find_decoder_gpus`)."""
        self._set_status(d, DRAINING)
        self._add((now, "scale_down", d.id, -1, d.n_gpus, 0, "unreachable"))
        self._wake(d)

    def _no_decoder_reason(self) -> str:
        """Why a request finds no decoder: ``unreachable`` when decoder groups exist whose NICs are all down for
        good (and no other can take it), ``no_decoder`` otherwise."""
        if self._permanent_nic_down and any(self._unreachable(d) for d in self.decoders if d.status != DEAD):
            return "unreachable"
        return "no_decoder"

    def _kill_prefiller(self, pf: PrefillerState, now: float, aborted: list[str], why: str) -> None:
        self._set_status(pf, DEAD)
        pf.ended_s = now
        self._reroute_lists()
        self._refresh_limits()
        if pf.plan is not None:
            aborted.append(pf.id)
        pf.plan = None
        lost: list[RequestState] = []
        # transfers in flight: KV source gone; free the decoder reservation, re-prefill
        for s in pf.streams:
            if s.plan is not None:
                aborted.append(s.id)
                r = s.req
                if r is not None and r.owner is s.plan:
                    r.owner = None
                    self._unreserve(r)
                    lost.append(r)
            s.plan = None
            s.req = None
            self._wake(s)
        redo = [r for r in pf.running] + list(pf.queue)
        lost.extend(pf.pending)
        pf.running = []
        pf.queue.clear()
        pf.pending.clear()
        pf.n_queued = 0
        pf.queued_tokens = 0
        self._load_changed(pf)
        pf.kv_held = 0
        pf.loads.clear()
        if pf.cache is not None:
            pf.cache.clear()  # its cached KV died with it (pins voided)
        self._wake(pf)
        for r in sorted(redo, key=lambda r: r.id):
            r.owner = None
            self._requeue_prefill(r, now, why, lost_kv=False)
        for r in sorted(lost, key=lambda r: r.id):
            r.owner = None
            self._requeue_prefill(r, now, why, lost_kv=True)

    def _kill_decoder(self, d: DecoderState, now: float, aborted: list[str], why: str) -> None:
        self._set_status(d, DEAD)
        d.ended_s = now
        self._reroute_lists()
        self._refresh_limits()
        if d.plan is not None:
            aborted.append(d.id)
        d.plan = None
        lost: list[RequestState] = []
        done_steps = d.step
        for r in d.running.values():
            steps = done_steps - r.s0
            if steps > 0:
                if not self._real_accept and r.cum is not None:
                    got = self.acceptance.tokens_after(r.cum, r.cum_i, steps, r.out - r.generated)
                    r.generated += got
                    self.decode_tokens += got
                r.steps += steps
            lost.append(r)
        for q in d.rank_queue:
            lost.extend(q)
            q.clear()
        redo = self._drop_aggregated_prefill(d) if d.kind == "agg" else []
        d.running.clear()
        d.heap.clear()
        d.n_running = d.n_qdec = 0
        # KV in flight to this decoder is still on its prefiller: send it elsewhere
        for pf in self.prefillers:
            for s in pf.streams:
                r = s.req
                if s.plan is not None and r is not None and r.decoder is d and r.owner is s.plan:
                    aborted.append(s.id)
                    r.owner = None
                    s.plan = None
                    s.req = None
                    r.reserved = 0
                    r.rank = -1
                    r.state = KV_PENDING
                    pf.pending.appendleft(r)
                    self._add((now, "requeue", s.id, r.id, 0, 0, why))
                    self._wake(s)
        d.rank_nreq = [0] * d.ep
        d.rank_free_kv = [0] * d.ep
        d.rank_key = [0] * d.ep
        d.rank_kmin = 0
        if d.route_i >= 0:
            self._route_dk[d.route_i] = 0
        d.rank_batch = [0] * d.ep
        self._wake(d)
        for r in sorted(redo, key=lambda r: r.id):
            self._requeue_prefill(r, now, why, lost_kv=False)
        for r in sorted(lost, key=lambda r: r.id):
            r.owner = None
            r.reserved = 0
            r.rank = -1
            r.cum = None
            if r.generated >= r.out:  # finished within the lost step's predecessors
                r.state = DONE
                self._add((now, "finish", d.id, r.id, r.generated, r.steps, ""))
                self._resolve(r, now)
                continue
            self._requeue_prefill(r, now, why, lost_kv=True)
        self._wake_blocked_streams()

    def _requeue_prefill(self, r: RequestState, now: float, why: str, lost_kv: bool) -> None:
        r.requeues += 1
        self._add((now, "requeue", r.prefiller.id if r.prefiller is not None else "", r.id, int(lost_kv), 0, why))
        if lost_kv:
            # prefill again: the prompt and every token generated so far (the last one is produced again)
            r.ctx0 = r.prompt + r.generated - 1 if r.generated > 0 else r.prompt
            r.generated = max(r.generated - 1, 0)
        r.pf_done = 0
        r.pin = None  # the worker it was pinned on died, or its prompt was done
        r.state = ARRIVED
        if self.agg:
            return self._route_aggregated(r, now, requeue=True)
        if not self._prefillers_possible():
            return self._reject(r, now, "no_prefiller")
        if r.ctx0 > self.max_pf_kv:
            return self._reject(r, now, "exceeds_prefiller_kv")
        self._route_prefill(r, now, requeue=True)

    def _after_failure(self, now: float) -> None:
        # requests that can never be served any more
        if not self._decoders_possible():
            for pf in self.prefillers:
                for s in pf.streams:
                    self._wake(s)
        if not self.agg and not self._prefillers_possible():
            for r in sorted([r for r in self.reqs.values() if r.state == QUEUED_PREFILL], key=lambda r: r.id):
                pf = r.prefiller
                if pf is not None and pf.status == DRAINING:
                    continue
                if r in pf.queue:
                    pf.queue.remove(r)
                    pf.n_queued -= 1
                    pf.queued_tokens -= r.ctx0 - r.pf_done
                    self._load_changed(pf)
                    pf.kv_held -= r.pf_done
                    self._unpin(r)
                self._reject(r, now, "no_prefiller")
        self._maybe_finish(now)
