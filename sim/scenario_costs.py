"""The simulator's cost model of a built scenario (``sim.executor.CostModel`` over ``sim.costs``): what every
prefill batch, KV transfer, decode step and mixed step of a run costs, memoised so the hot loop is a dict lookup.

The decode cost is evaluated at the slowest rank's (batch, context tokens) — a DP-EP step is synchronous, so the
slowest rank sets its time — memoised at 1-sequence and ~1 % context resolution; the prefill cost is evaluated
exactly per batch. ``sim.scenario.build`` makes one per run.
"""


from __future__ import annotations

import math
from math import ceil as _ceil
from operator import itemgetter
from typing import Any

_N_START = itemgetter(2, 1)  # PrefillBatch item (request_id, start_token, n_tokens) -> (n_tokens, start_token)


class ScenarioCostModel:
    """``sim.executor.CostModel`` over ``sim.costs``: per-group ParallelPlans (same shape as the templates, the
    group's own GPUs), decode memoised at the slowest rank's (batch, context) point (module docstring).

    Fast paths, all giving ``sim.costs``' own numbers: decode is memoised per (group, busiest rank's batch, context
    bucket of ``CTX_BITS`` significant bits, draft_k) and priced at the bucket's middle; ``decode_point`` also
    returns the bucket's end, so the driver fast-forwards decode steps (``sim/driver.py``). A memo miss assembles
    the step from its context-free terms (per group, batch, draft_k) and two attention evaluations (checked
    against ``decode_step_time``). Prefill is exact per batch, memoised on its (tokens, start) items per group
    class: groups whose GPU model and :class:`~sim.costs.collective.GroupLinks` (EP group, TP group) agree share
    entries, the first ``PREFILL_SPOT_CHECKS`` shared hits of each group are checked, and a mismatch gives the
    group its own class. A looped trace repeats its batches, so an hour of the NVL72 benchmark evaluates a few
    thousand prefill batches instead of ~50 000.
    """

    from rackbed.sim.executor import TransferCost as _TransferCost

    CTX_BITS = 7  # decode memo resolution: contexts that agree in their top 7 bits share a step (<= 1.6 % apart)

    def __init__(self, *, model, topo, prefill_plan, decode_plan, calib=None, draft: dict | None = None,
                 decode_calib=...) -> None:
        self.model, self.topo, self.calib = model, topo, calib
        #: the decoders' calibration: ``calib`` unless decode runs on another GPU model (a joined topology)
        self.decode_calib = calib if decode_calib is ... else decode_calib
        #: what drafts the tokens (:func:`draft_cost_kw`) and how routing loads the experts
        #: (:func:`expert_load_kw`): keywords passed to every decode step pricing
        self.draft = dict(draft or {})
        self.pplan0, self.dplan0 = prefill_plan, decode_plan
        self._plans: dict[str, object] = {}
        self._decode_memo: dict[tuple, object] = {}
        self._decode_base: dict[tuple, tuple] = {}
        self._attn_memo: dict[tuple, object] = {}
        self._prefill_memo: dict[tuple, tuple] = {}
        self._pclass: dict[str, tuple] = {}
        self._pclass_ids: dict[tuple, tuple[int]] = {}
        self._kv_chunk_us: dict[str | None, float] = {}
        self._kv_pipeline = 1
        self._lat_memo: dict[tuple, float] = {}
        self._pchecks: dict[str, int] = {}
        self._split_ok = True  # False once the split failed its check (then: direct evaluation)
        self._chunk_memo: dict[tuple, object] = {}
        # (prefiller template, decoder template, chunks per page, page tokens, base) of the last kv_chunks
        self._chunk_last = None

    def _plan_for(self, group) -> object:
        pl = self._plans.get(group.id)
        if pl is None:
            base = self.pplan0 if group.id.startswith("P") else self.dplan0
            pl = self._plans[group.id] = base.model_copy(update={"gpus": tuple(group.gpus)})
        return pl

    def prefill(self, plan, group):
        """Exact per batch, memoised on the batch's ``(n_tokens, start_token)`` sequence per group class (groups
        whose GPU groups look the same to ``sim.costs`` share entries: looped traces repeat batches)."""
        cls = self._pclass.get(group.id)
        if cls is None:
            cls = self._pclass[group.id] = self._prefill_class(group)
        key = (cls, tuple(map(_N_START, plan.items)))  # ((n_tokens, start_token), ...), C-level: one per batch
        hit = self._prefill_memo.get(key)
        if hit is not None:
            owner, st = hit
            if owner == group.id or self._pchecks.get(group.id, 0) >= self.PREFILL_SPOT_CHECKS:
                return st
            # the first few entries a group takes from another group of its class are checked
            self._pchecks[group.id] = self._pchecks.get(group.id, 0) + 1
            mine = self._prefill_direct(plan, group)
            if mine != st:
                self._pclass[group.id] = (group.id,)  # not like the others after all: own class from now on
                self._prefill_memo[((group.id,), key[1])] = (group.id, mine)
            return mine
        st = self._prefill_direct(plan, group)
        self._prefill_memo[key] = (group.id, st)
        return st

    PREFILL_SPOT_CHECKS = 2

    def _prefill_direct(self, plan, group):
        return self.prefill_breakdown([(n, start) for _, start, n in plan.items], group).to_steptime()

    def prefill_breakdown(self, seqs, group=None):
        """Term by term (a ``StepBreakdown``), the prefill step :meth:`prefill` prices for a batch of ``seqs``
        ``(new_tokens, cached_tokens)`` on ``group`` (None: the template plan, group 0's)."""
        from rackbed.sim.costs.step import prefill_step_breakdown

        pl = self.pplan0 if group is None else self._plan_for(group)
        return prefill_step_breakdown(self.model, pl, self.topo, seqs, calib=self.calib)

    def decode_breakdown(self, max_batch: int, max_context_tokens: float, draft_k: int, group=None):
        """Term by term, the decode step :meth:`decode_point` prices when the busiest ranks hold ``max_batch``
        sequences and ``max_context_tokens`` KV tokens (every rank priced so, as there), at the context itself
        rather than its memo bucket's middle; ``group`` None: the template plan."""
        from rackbed.sim.costs.step import decode_step_breakdown

        pl = self.dplan0 if group is None else self._plan_for(group)
        n = pl.dp
        return decode_step_breakdown(self.model, pl, self.topo, [max_batch] * n, [max_context_tokens] * n,
                                     draft_k=draft_k, calib=self.decode_calib, **self.draft)

    #: the most of a NIC's rate the EP all-to-all is taken to hold (KV keeps at least a tenth)
    EP_SHARE_CAP = 0.9

    def ep_nic_share(self, dep) -> dict[str, float]:
        """``{nic: share}``: the fraction of each NIC of a group spanning NVLink domains that its EP all-to-all keeps
        busy, which the simulator's network takes off the NIC's rate for KV transfers (``sim.network.Network``).
        A decoder is taken at its full batch (``max_batch_per_rank`` per rank, each rank's KV half full, the run's
        MTP drafts): the RDMA seconds of every MoE layer's dispatch and combine (low-latency mode; verify pass and
        draft passes) over that step's time. A prefiller with DP attention (``tp < ep``) is taken at a full budget
        dealt evenly over its ranks (normal mode). Capped at ``EP_SHARE_CAP``; NICs of groups inside one domain
        are not listed (their all-to-all stays on NVLink)."""
        from rackbed.sim.costs.collective import group_links
        from rackbed.sim.costs.moe_comm import ep_rdma_busy_s
        from rackbed.sim.costs.step import layer_counts

        out: dict[str, float] = {}
        n_moe = layer_counts(self.model)[2]
        if not n_moe:
            return out
        k = dep.mtp.draft_k
        for g in dep.decoders:
            pl: Any = self._plan_for(g)
            if group_links(self.topo, pl.gpus).one_domain:
                continue
            b = g.template.max_batch_per_rank
            verify = ep_rdma_busy_s(self.topo, pl.gpus, -(-b * (k + 1) // pl.tp), self.model, "low_latency",
                                    pl.weight_format)
            draft = ep_rdma_busy_s(self.topo, pl.gpus, -(-b // pl.tp), self.model, "low_latency", pl.weight_format)
            n_draft = 0 if "draft_model" in self.draft else k * (self.draft.get("n_mtp_layers")
                                                                 or self.model.n_mtp_layers or 1)
            step = self.decode_breakdown(b, g.template.kv_capacity_tokens_per_rank / 2, k, g).total_s
            share = min(self.EP_SHARE_CAP, (n_moe * verify + n_draft * draft) / step) if step > 0 else 0.0
            out.update({nic: share for nic in {dep.gpu_nic[x] for x in g.gpus}})
        for g in dep.prefillers:
            pl = self._plan_for(g)
            if pl.dp == 1 or group_links(self.topo, pl.gpus).one_domain:
                continue
            per_rank = pl.max_batch_tokens or g.template.max_batch_tokens // pl.dp
            busy = n_moe * ep_rdma_busy_s(self.topo, pl.gpus, -(-per_rank // pl.tp), self.model, "normal",
                                          pl.weight_format)
            step = self.prefill_breakdown([(per_rank, 0)] * pl.dp, g).total_s
            share = min(self.EP_SHARE_CAP, busy / step) if step > 0 else 0.0
            out.update({nic: max(share, out.get(nic, 0.0)) for nic in {dep.gpu_nic[x] for x in g.gpus}})
        return out

    def _prefill_class(self, group) -> tuple[int] | tuple[str]:
        """What ``sim.costs.step.prefill_step_breakdown`` reads of the topology for this group's plan: the GPU
        model and the :class:`~sim.costs.collective.GroupLinks` of its EP group and of its first TP group."""
        from rackbed.sim.costs.collective import group_links

        pl = self._plan_for(group)
        fp = (self.topo.gpu_spec(pl.gpus[0]).name, group_links(self.topo, pl.gpus),
              group_links(self.topo, pl.tp_group(0)))
        return self._pclass_ids.setdefault(fp, (len(self._pclass_ids),))  # a small key, cheap to hash

    def mixed(self, plan, group):
        """An aggregated worker's :class:`~engine.core.plans.MixedStep` (:func:`sim.aggregated.price_mixed`)."""
        from rackbed.sim.aggregated import price_mixed

        return price_mixed(self, plan, group)

    def decode(self, plan, group):
        return self.decode_point(group, max(plan.rank_batch), max(plan.rank_context_tokens), plan.draft_k)[0]

    def decode_point(self, group, max_batch: int, max_context_tokens, draft_k: int):
        """``(StepTime, ctx_hi)`` of a decode step whose busiest ranks hold ``max_batch`` sequences and
        ``max_context_tokens`` KV tokens: the step at the middle of the context's grid bucket (the top
        ``CTX_BITS`` bits of the token count, so buckets are 1/2**(CTX_BITS-1)..1/2**CTX_BITS of the count wide;
        exact below 2**CTX_BITS tokens), the same for every context up to ``ctx_hi``, the bucket's end."""
        ctx = int(max_context_tokens)
        if max_batch <= 0:
            ctx, hi, mid = 0, 1 << 62, 0
        else:
            shift = ctx.bit_length() - self.CTX_BITS
            if shift > 0:
                ctx = (ctx >> shift) << shift
                hi = ctx + (1 << shift) - 1
                mid = ctx + (1 << (shift - 1))
            else:
                hi = mid = ctx
        key = (group.id, max_batch, ctx, draft_k)
        hit = self._decode_memo.get(key)
        if hit is None:
            hit = self._decode_memo[key] = (self._decode_at(group, max_batch, mid, draft_k), hi)
        return hit

    # The decode step at a memo point, split into what depends on the context (the full-attention terms of the
    # verify and draft passes) and what does not (everything else, memoised per (group, batch, draft_k)): a miss
    # then costs two attention evaluations instead of a whole step breakdown. The split is exact — the StepTime is
    # summed term by term in ``StepBreakdown.by_category`` order — and checked against the direct
    # ``decode_step_time`` at a second context for every (group, batch, draft_k); should ``sim.costs.step`` ever
    # change shape, the check fails and the model falls back to direct evaluation (same numbers, slower). A
    # plan with overlap (``sim.costs.overlap``) is evaluated directly: what hides under the attention moves
    # with it.

    def _decode_at(self, group, b: int, ctx_q: int, k: int):
        from rackbed.sim.costs.step import decode_step_time

        pl = self._plan_for(group)
        n = pl.dp
        dr = self.draft
        # a draft model, or overlap (the step is a critical path, not a sum of terms): direct evaluation
        if not self._split_ok or b == 0 or (k and "draft_model" in dr) or pl.overlap != "none":
            return decode_step_time(self.model, pl, self.topo, [b] * n, [ctx_q] * n, draft_k=k,
                                    calib=self.decode_calib, **dr)
        base = self._decode_base.get((group.id, b, k))
        if base is None:
            from rackbed.sim.costs.step import decode_step_breakdown

            bd = decode_step_breakdown(self.model, pl, self.topo, [b] * n, [ctx_q] * n, draft_k=k,
                                       calib=self.decode_calib, **dr)
            passes = k * dr.get("n_mtp_layers", self.model.n_mtp_layers or 1)
            base = (tuple(bd.terms.items()), _ctx_kinds(self.model), passes, self.topo.gpu_spec(pl.gpus[0]))
            # the split must reproduce the direct evaluation at another context too
            ctx2 = 2 * ctx_q + 4099
            if self._assemble(base, pl, b, ctx2, k) != decode_step_time(
                    self.model, pl, self.topo, [b] * n, [ctx2] * n, draft_k=k, calib=self.decode_calib, **dr):
                self._split_ok = False
            else:
                self._decode_base[(group.id, b, k)] = base
            return bd.to_steptime()
        return self._assemble(base, pl, b, ctx_q, k)

    def _assemble(self, base, pl, b: int, ctx_q: int, k: int):
        from rackbed.sim.costs.steptime import StepTime

        terms, kinds, passes, gpu = base
        kw = {"fmt": pl.weight_format, "kv_elem_bytes": pl.kv_elem_bytes, "page_tokens": pl.page_tokens,
              "calib": self.decode_calib, "tp": pl.tp}
        over = {}
        for costs, nf in kinds:
            a = self._attn(costs, gpu, b, ctx_q, k + 1, kw)
            over[f"{costs.prefix}_proj"] = nf * a.proj_s
            over[f"{costs.prefix}_core"] = nf * a.core_s
            for name, sec in a.parts:
                over[f"{costs.prefix}_{name}"] = nf * sec
        if k:
            from rackbed.sim.costs.attention import mtp_costs

            over["mtp_attn"] = passes * self._attn(mtp_costs(self.model), gpu, b, ctx_q, 1, kw).total_s
        cats = {"attn_s": 0.0, "moe_gemm_s": 0.0, "a2a_s": 0.0, "allreduce_s": 0.0, "other_s": 0.0}
        for name, (cat, s) in terms:
            cats[cat] += over.get(name, s)
        return StepTime(**cats)

    def _attn(self, costs, gpu, b: int, ctx_q: int, q: int, kw: dict):
        """One layer of a token-mixer kind (``costs``: its ``MIXER_COSTS`` entry) on a rank of ``b`` sequences
        holding ``ctx_q`` tokens, ``q`` query tokens each."""
        key = (costs.prefix, gpu.name, kw["fmt"], kw["kv_elem_bytes"], kw["page_tokens"], kw["tp"], b, ctx_q, q)
        a = self._attn_memo.get(key)
        if a is None:
            a = self._attn_memo[key] = costs.decode(gpu, self.model, [b], [(b, ctx_q)], {**kw, "q_per_seq": q})
        return a

    def kv_transfer(self, plan):
        nic = plan.flows[0][0] if plan.flows else None
        per_chunk_us = self._kv_chunk_us.get(nic)
        if per_chunk_us is None:
            from rackbed.sim.costs import constants as C

            kind = "ib" if nic is None or nic.startswith("nvlink:") else self.topo.nic_spec(nic).kind
            per_chunk_us = self._kv_chunk_us[nic] = C.KV_CHUNK_OVERHEAD_US[kind]
            self._kv_pipeline = C.KV_CHUNK_PIPELINE
        over = plan.n_chunks * per_chunk_us * 1e-6 / self._kv_pipeline
        key = (plan.src, plan.dst, plan.dst_rank)
        lat = self._lat_memo.get(key)
        if lat is None:
            lat = self._lat_memo[key] = self._latency_s(plan)
        return self._TransferCost(overhead_s=over, latency_s=lat, n_bytes=plan.n_bytes)

    def kv_fixed_s(self, plan) -> float:
        """``overhead_s + latency_s`` of :meth:`kv_transfer` (same arithmetic), without the TransferCost."""
        nic = plan.flows[0][0] if plan.flows else None
        per_chunk_us = self._kv_chunk_us.get(nic)
        if per_chunk_us is None:
            return self.kv_transfer(plan).fixed_s  # fills the per-NIC memo
        lat = self._lat_memo.get((plan.src, plan.dst, plan.dst_rank))
        if lat is None:
            return self.kv_transfer(plan).fixed_s
        return plan.n_chunks * per_chunk_us * 1e-6 / self._kv_pipeline + lat

    def _latency_s(self, plan) -> float:
        key = ("lat", plan.src, plan.dst, plan.dst_rank)
        v = self._chunk_memo.get(key)
        if v is None:
            src = self._plans.get(plan.src)
            dst = self._plans.get(plan.dst)
            if src is None or dst is None:
                v = 5e-6
            else:
                a, b = src.gpus[0], dst.gpus[plan.dst_rank * dst.tp]
                try:
                    v = self.topo.p2p_latency_us(a, b, via="net") * 1e-6
                except ValueError:  # no scale-out network (lab box): NVLink peer copy
                    v = self.topo.p2p_latency_us(a, b) * 1e-6
            self._chunk_memo[key] = v
        return v

    def kv_chunks(self, prefiller, decoder, tokens: int) -> int:
        """Chunks of the resharding plan (prefill TP layout -> one DP decode rank, HND, fragmented pages; every
        layer with a per-token cache: full, MLA latent, sliding): ``base + per_page * pages``. Without sliding
        layers ``base = 0`` and ``per_page`` comes from a 4-page sequence; with them the sliding layers' chunks
        stop growing once the sequence passes the window, so the line goes through two sequences longer than
        the window ending mid-page (``base`` = the windows' chunks; it overcounts sequences shorter than the
        window)."""
        pt, dt = prefiller.template, decoder.template
        last = self._chunk_last
        if last is not None and last[0] is pt and last[1] is dt:  # the templates of the previous call
            n = _ceil(last[4] + last[2] * _ceil(tokens / last[3]))  # one per KV transfer: no global look-ups
            return n if n > 1 else 1  # noqa: FURB136 (max(1, n) without the call)
        key = ("per_page", pt.tp, dt.kv_page_tokens)
        line = self._chunk_memo.get(key)
        if line is None:
            from rackbed.engine.core.kv import KvLayout, pages_needed, transfer_stats

            pl, dl = self.pplan0, self.dplan0
            src = KvLayout.for_plan(pl, self.model, 1)
            dst = KvLayout.for_plan(dl, self.model, 1)
            if src.windows:  # half-page ends: a last page partly filled and a window off page boundaries
                P = dl.page_tokens
                p1 = pages_needed(max(src.windows), P) + 2
                n1 = transfer_stats(src, dst, p1 * P + P // 2).n_chunks
                n2 = transfer_stats(src, dst, 2 * p1 * P + P // 2).n_chunks
                slope = (n2 - n1) / p1
                line = (slope, n1 - slope * pages_needed(p1 * P + P // 2, P))
            else:
                pages = 4
                line = (transfer_stats(src, dst, pages * dl.page_tokens).n_chunks / pages, 0.0)
            self._chunk_memo[key] = line
        per_page, base = line
        self._chunk_last = (pt, dt, per_page, self.dplan0.page_tokens, base)  # for the same templates
        return max(1, math.ceil(base + per_page * math.ceil(tokens / self.dplan0.page_tokens)))


def _ctx_kinds(model) -> tuple:
    """(costs, layer count) of the model's token-mixer kinds whose decode time depends on the context: all but
    Gated DeltaNet (a fixed-size state), whose terms the split keeps as evaluated."""
    from rackbed.sim.costs.attention import mixer_counts

    return tuple((c, n) for c, n in mixer_counts(model) if c.prefix != "linear_attn")
