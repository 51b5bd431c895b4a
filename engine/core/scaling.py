"""The scheduler's worker pool: creating prefiller and decoder groups, scaling the pool, draining and retiring.

:class:`WorkerPool` is a base class of :class:`engine.core.scheduler.Scheduler` (it uses the scheduler's state).
The autoscaler is a worker of its own that only idles; at each tick (``AutoscalerConfig.interval_s``) it observes
the input token rate, the prefill backlog and the decode load and asks :func:`engine.core.autoscaler.decide` for
target counts: new groups take GPUs from the spare pool (a prefiller on one host, a decoder inside one NVLink
domain) and serve after ``scale_up_delay_s`` (a starting prefiller is routed to with a penalty of the tokens it
could have prefilled meanwhile); a group scaled down drains (it takes no new work, finishes what it holds) and
then returns its GPUs to the pool.
"""

from __future__ import annotations

from collections.abc import Iterable

from rackbed.engine.core import autoscaler as autoscale
from rackbed.engine.core.deployment import DecoderGroup, DecoderTemplate, PrefillerGroup, whole_domains
from rackbed.engine.core.plans import WAIT_TIMER, Plan
from rackbed.engine.core.scheduler_base import SchedulerBase
from rackbed.engine.core.state import (
    ACTIVE,
    DRAINING,
    RETIRED,
    STARTING,
    AutoscalerState,
    DecoderState,
    KvStreamState,
    PrefillerState,
)
from rackbed.topology.errors import UserError


class WorkerPool(SchedulerBase):
    """Worker creation, scaling, draining and retiring (a base class of ``Scheduler``: it uses its state)."""

    # ------------------------------------------------------------------ creating workers
    def _cap_tps(self, g: PrefillerGroup) -> float:
        p = self._ptps
        if p is None:
            return 0.0
        return float(p(g) if callable(p) else p)

    def _add_prefiller(self, g: PrefillerGroup, status: int, ready_at: float, now: float) -> PrefillerState:
        pf = PrefillerState(g, self._order, status, ready_at, self._cap_tps(g), now)
        if self.pcache is not None:
            pf.cache = self.pcache.make(self._shared_tier)
        self._order += 1
        self._n_pf_created += 1
        self.prefillers.append(pf)
        self.workers[pf.id] = pf
        self.new_workers.append(pf.id)
        for j in range(g.template.kv_streams):
            s = KvStreamState(f"{g.id}.kv{j}", pf)
            pf.streams.append(s)
            self.workers[s.id] = s
            self.new_workers.append(s.id)
        if status == STARTING:
            pf.offset_tokens = int(max(0.0, ready_at - now) * pf.cap_tps)
        for i, nic in enumerate(pf.nics):
            if self.nic_down.get(nic):
                pf.nic_up[i] = False
        self._reroute_lists()
        return pf

    def _add_decoder(self, g: DecoderGroup, status: int, ready_at: float, now: float) -> DecoderState:
        return self._register_decoder(DecoderState(g, self._order, status, ready_at, self.k, self.p, now))

    def _register_decoder(self, d: DecoderState) -> DecoderState:
        """Make ``d`` (a decoder, or an aggregated worker: a decoder that also prefills) a worker: rank keys,
        creation order, the worker registry, the NICs already down, the routing lists."""
        base = self._key_base
        if d.kv_cap >= base:  # the rank keys need a larger base: every decoder's keys are recomputed
            base = self._key_base = 1 << d.kv_cap.bit_length()
            for x in self.decoders:
                x.rank_key = [n * base - f for n, f in zip(x.rank_nreq, x.rank_free_kv)]
                x.rank_kmin = min(x.rank_key, default=0)
        d.rank_key = [n * base - f for n, f in zip(d.rank_nreq, d.rank_free_kv)]
        d.rank_kmin = min(d.rank_key, default=0)
        self._order += 1
        self._n_dec_created += 1
        self.decoders.append(d)
        self.workers[d.id] = d
        self.new_workers.append(d.id)
        for r, nic in enumerate(d.rank_nics):
            if self.nic_down.get(nic):
                d.rank_up[r] = False
        self._reroute_lists()
        return d

    def _reroute_lists(self) -> None:
        for p in self.prefillers:  # called after every change of a NIC's state
            p.up_nics = [n for n, u in zip(p.nics, p.nic_up) if u]
        route_p = [p for p in self.prefillers if p.status in (STARTING, ACTIVE) and any(p.nic_up)]
        self._route_p = route_p
        for p in self.prefillers:
            p.route_pi = -1
        for i, p in enumerate(route_p):
            p.route_pi = i
        self._route_pl = [p.queued_tokens + p.offset_tokens for p in route_p]
        self._route_d = route_d = [d for d in self.decoders if d.status == ACTIVE]
        for d in self.decoders:
            d.route_i = -1
        for i, d in enumerate(route_d):
            d.route_i = i
        self._route_dk = [d.rank_kmin for d in route_d]
        if self._blocked and not self._route_d and not self._decoders_possible():
            # no decoder now and none can come (none starting, no GPUs for the autoscaler): KV streams that wait
            # for decoder room would wait for good; woken, they reject what they hold (unreachable / no_decoder)
            self._wake_blocked_streams()

    def _refresh_limits(self) -> None:
        """Largest KV a request may need (decoder rank) / hold (prefiller), over live groups and templates."""
        dks = [d.kv_cap // d.page * d.page for d in self.decoders if d.status in (STARTING, ACTIVE, DRAINING)]
        pks = [p.kv_cap for p in self.prefillers if p.status in (STARTING, ACTIVE, DRAINING)]
        if self.asc is not None:
            t: DecoderTemplate = self.dep.decoder_template
            dks.append(t.kv_capacity_tokens_per_rank // t.kv_page_tokens * t.kv_page_tokens)
            pks.append(self.dep.prefiller_template.kv_capacity_tokens)
        self.max_rank_kv = max(dks, default=0)
        self.max_pf_kv = max(pks, default=0)

    def _set_status(self, w, status: int) -> None:
        w.status = status
        w.changes += 1

    # ------------------------------------------------------------------ autoscaler
    def _next_autoscaler(self, a: AutoscalerState, now: float) -> Plan:
        if self.finished:
            return self._stop(a, now, "finished")
        cfg = self.asc
        if now >= self._last_tick + cfg.interval_s - 1e-12 and now > 0:
            self._autoscale(now)
        return self._idle(a, now, WAIT_TIMER, self._last_tick + cfg.interval_s)

    def _autoscale(self, now: float) -> None:
        cfg = self.asc
        dt = max(now - self._last_tick, 1e-9)
        rate = self._window_tokens / dt
        self._window_tokens = 0
        self._last_tick = now
        live_p = [p for p in self.prefillers if p.status in (STARTING, ACTIVE)]
        live_d = [d for d in self.decoders if d.status in (STARTING, ACTIVE)]
        cap = self._cap_tps(self.prefillers[0].g) if self.prefillers else 0.0
        if cap <= 0:
            cap = self._template_cap()
        dec_req = sum(d.nreq for d in self.decoders if d.status in (STARTING, ACTIVE, DRAINING))
        dec_req += sum(len(p.pending) for p in self.prefillers)
        obs = autoscale.Observation(
            now_s=now, input_tokens_per_s=rate, queued_prefill_tokens=sum(p.queued_tokens for p in live_p),
            prefill_capacity_tokens_per_s=cap, n_prefillers=len(live_p), n_decoders=len(live_d),
            decode_requests=dec_req, ranks_per_decoder=self.dep.decoder_template.ranks)
        tgt = autoscale.decide(cfg, obs)
        for _ in range(tgt.prefillers - len(live_p)):
            if self._scale_up_prefiller(now) is None:
                break
        if tgt.prefillers < len(live_p):
            act = [p for p in live_p if p.status == ACTIVE]
            if len(act) > 1:
                victim = min(act, key=lambda p: (p.queued_tokens, -p.order))
                self._drain(victim, now, "prefill")
        for _ in range(tgt.decoders - len(live_d)):
            if self._scale_up_decoder(now) is None:
                break
        if tgt.decoders < len(live_d):
            act_d = [d for d in live_d if d.status == ACTIVE]
            if len(act_d) > 1:
                victim_d = min(act_d, key=lambda d: (d.nreq, -d.order))
                self._drain(victim_d, now, "decode")

    def _template_cap(self) -> float:
        t = self.dep.prefiller_template
        g = PrefillerGroup(id="template", gpus=tuple(range(t.n_gpus)), host=0, nics=("nic:template",), template=t)
        return self._cap_tps(g)

    def _find_prefiller_gpus(self) -> tuple[int, ...] | None:
        n = self.dep.prefiller_template.n_gpus
        if self.dep.prefiller_template.span_nodes:
            return self._pool_domains(n)
        host = self.dep.gpu_host
        by_host: dict[int, list[int]] = {}
        for g in self.pool:
            by_host.setdefault(host[g], []).append(g)
        for h in sorted(by_host):
            if len(by_host[h]) >= n:
                return tuple(by_host[h][:n])
        return None

    def _pool_domains(self, n: int) -> tuple[int, ...] | None:
        """A group that spans nodes (``span_nodes``) grows on whole NVLink domains of the pool, or not at all."""
        try:
            return whole_domains(self.pool, self.dep.gpu_domain, n, "a new group", "autoscaler")
        except UserError:
            return None

    def _find_decoder_gpus(self) -> tuple[int, ...] | None:
        n = self.dep.decoder_template.ep
        if self.dep.decoder_template.span_nodes:
            return self._pool_domains(n)
        dom = self.dep.gpu_domain
        by_dom: dict[int, list[int]] = {}
        dead_nic = self._permanent_nic_down
        gpu_nic = self.dep.gpu_nic
        for g in self.pool:
            if dead_nic and gpu_nic.get(g) in dead_nic:
                continue  # a rank there could never receive KV
            by_dom.setdefault(dom.get(g, 0), []).append(g)
        for k in sorted(by_dom):
            if len(by_dom[k]) >= n:
                return tuple(by_dom[k][:n])
        return None

    def _take_pool(self, gpus: Iterable[int]) -> None:
        taken = set(gpus)
        self.pool = [g for g in self.pool if g not in taken]

    def _scale_up_prefiller(self, now: float) -> PrefillerState | None:
        if self.asc is None:
            return None
        gpus = self._find_prefiller_gpus()
        if gpus is None:
            return None
        self._take_pool(gpus)
        host = self.dep.gpu_host[gpus[0]]
        nics = tuple(sorted({self.dep.gpu_nic[g] for g in gpus}))
        g = PrefillerGroup(id=f"P{self._n_pf_created}", gpus=gpus, host=host, nics=nics,
                           template=self.dep.prefiller_template)
        pf = self._add_prefiller(g, STARTING, now + self.asc.scale_up_delay_s, now)
        self._add((now, "scale_up", pf.id, -1, len(gpus), 0, "prefill"))
        self._refresh_limits()
        return pf

    def _scale_up_decoder(self, now: float) -> DecoderState | None:
        if self.asc is None:
            return None
        gpus = self._find_decoder_gpus()
        if gpus is None:
            return None
        self._take_pool(gpus)
        g = DecoderGroup(id=f"D{self._n_dec_created}", gpus=gpus,
                         rank_nics=self.dep.decoder_template.rank_nics(gpus, self.dep.gpu_nic),
                         template=self.dep.decoder_template)
        d = self._add_decoder(g, STARTING, now + self.asc.scale_up_delay_s, now)
        self._add((now, "scale_up", d.id, -1, len(gpus), 0, "decode"))
        self._refresh_limits()
        return d

    def _drain(self, w, now: float, role: str) -> None:
        self._set_status(w, DRAINING)
        self._reroute_lists()
        self._add((now, "scale_down", w.id, -1, w.n_gpus, 0, role))
        self._wake(w)

    def _retire(self, w, now: float) -> None:
        self._set_status(w, RETIRED)
        if getattr(w, "cache", None) is not None:
            w.cache.clear()  # its GPUs go back to the pool: the cached KV with them
        w.ended_s = now
        self.pool = sorted(set(self.pool) | (set(w.gpus) - self.failed_gpus))
        self._reroute_lists()
        self._refresh_limits()
        if isinstance(w, PrefillerState):
            for s in w.streams:
                self._wake(s)
