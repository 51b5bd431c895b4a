"""Compute / communication overlap in a step: a schedule on two streams, the step its critical path.

Without overlap (mode ``none``) a step is the sum of its terms (``sim.costs.step``). Engines hide
communication under compute instead; a deployment's role states which way (``ParallelPlan.overlap``):

* ``shared_expert`` (single-batch overlap): the shared expert starts right after the router, alongside the
  dispatch, instead of after the routed experts; the batch is not split.
* ``two_batch`` (two-batch overlap): the step's batch is split into two micro-batches of half the tokens each
  (decode: every DP rank's sequences halved, ``ceil`` / ``floor``; prefill: the batch's new tokens cut at the
  half, a sequence that straddles it split into two chunks, the second reading the first as cached). Every
  per-layer term is re-priced at a micro-batch's tokens by the same cost functions (so the weights are
  streamed twice: at decode batch sizes the GEMMs cost almost as much per micro-batch as for the whole batch),
  and the two micro-batches interleave stage by stage, so that one's communication runs under the other's
  compute.

**Streams.** Every per-layer term runs on one of two streams: *comm* (decode: the all-to-all dispatch and
combine and the attention-TP all-reduces; prefill: the TP all-reduces, the EP combine all-reduce) or *compute*
(everything else; prefill's dispatch and the local part of its combine are HBM work, compute). A layer of one
micro-batch is a chain, in this order: norms, the layer's token mixer (its projection, core and further
kernels), the attention all-reduce, then for a MoE layer the router, dispatch, routed GEMMs, shared expert,
combine (decode; prefill: local accumulate + all-reduce, or the measured combine) and the MoE all-reduce; for
a dense layer the dense MLP and its all-reduce. Each op starts when its stream is free and its predecessor in
the chain has ended; the streams take their ops in a fixed order: layer by layer, within a layer stage by
stage (a stage is a run of consecutive ops on one stream), micro-batch 0 before micro-batch 1. With
``shared_expert`` the shared expert leaves the chain: it follows the router on the compute stream and the
routed GEMM waits for the dispatch only. Layers run dense layers first (DeepSeek's first layers), token-mixer
kinds in ``MIXER_COSTS`` order; costs are the breakdown's own per-layer values (its term divided by the layers
it counts).

**SM share.** Communication kernels occupy SMs while they run: compute running under communication gets only
``1 - share`` of the GPU and progresses at that rate (``share`` = ``constants.OVERLAP_COMM_SMS`` / the GPU's
SM count unless given). Communication is not slowed by compute (its SMs are its own; its time is link- and
latency-bound).

**What is returned.** A ``StepBreakdown`` whose terms are *exposed* seconds and sum to the critical path:
a compute term keeps its work; a communication term keeps what ran while no compute did; the seconds of a
communication term that ran under compute are in ``StepBreakdown.hidden``; the slowdown of compute under
communication is one more term, ``overlap_sm_contention`` (category ``other_s``). Terms that are not per layer
(embeddings, lm_head, host, the cross-node host sync, the MTP draft or draft model passes) and any term the
schedule does not know run serially at the whole batch, as without overlap. With ``H`` the hidden seconds,
``W`` the compute work and ``M`` the communication of the scheduled ops, the critical path is exactly
``W + M - (1 - share) * H``: never shorter than ``max(W, M)`` (each stream is serial) and never longer than
``W + M``, the same ops one after another. For ``shared_expert`` ``W + M`` is the step without overlap; for
``two_batch`` it is the sum of the two micro-batches' steps without overlap (per-layer terms), which can
exceed the whole batch's when the micro-batches each stream the weights.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from rackbed.sim.costs import constants as C
from rackbed.sim.costs.breakdown import StepBreakdown
from rackbed.topology.errors import UserError

MODES: tuple[str, ...] = ("none", "shared_expert", "two_batch")

#: the term that carries compute's slowdown under communication (category ``other_s``)
CONTENTION = "overlap_sm_contention"

_EVERY_LAYER = ("norms", "attn_allreduce")
_MOE = ("router", "moe_dispatch", "moe_gemm", "shared_expert", "moe_combine", "moe_combine_local",
        "moe_combine_allreduce", "moe_allreduce")
_DENSE = ("dense_mlp", "dense_allreduce")
#: per role, the per-layer terms that run on the communication stream
COMM_TERMS: dict[str, frozenset[str]] = {
    "decode": frozenset({"attn_allreduce", "moe_dispatch", "moe_combine", "moe_allreduce",
                         "dense_allreduce"}),
    "prefill": frozenset({"attn_allreduce", "moe_combine", "moe_combine_allreduce", "dense_allreduce"}),
    # a DP-attention prefiller: its dispatch is a DeepEP normal-mode all-to-all too (a TP = EP prefiller's is a
    # local copy of its own tokens, compute)
    "prefill_dp": frozenset({"attn_allreduce", "moe_dispatch", "moe_combine", "moe_combine_allreduce",
                             "dense_allreduce"}),
}


def default_share(gpu, comm_sms: int = C.OVERLAP_COMM_SMS) -> float:
    """The share of a GPU's SMs communication occupies while it overlaps compute (module docstring)."""
    return min(comm_sms, gpu.sm_count - 1) / gpu.sm_count


# --------------------------------------------------------------------------------------------- the schedule


@dataclass(frozen=True, slots=True)
class Op:
    """One op of a layer's chain: a term's per-layer ``seconds`` on stream ``comm`` or compute. ``side``: off
    the chain (it waits for the op before it, and the op after it does not wait for it)."""

    name: str
    seconds: float
    comm: bool = False
    side: bool = False


@dataclass(frozen=True)
class Schedule:
    """A scheduled step: ``makespan_s`` (the critical path), per term name the seconds on each stream
    (``compute`` / ``comm``), the communication seconds that ran under compute (``hidden``), and the compute
    slowdown under communication (``contention_s``)."""

    makespan_s: float
    compute: dict[str, float]
    comm: dict[str, float]
    hidden: dict[str, float]
    contention_s: float

    @property
    def work_s(self) -> float:
        return sum(self.compute.values())

    @property
    def comm_s(self) -> float:
        return sum(self.comm.values())

    @property
    def hidden_s(self) -> float:
        return sum(self.hidden.values())


def _stages(ops: Sequence[Op]) -> list[list[int]]:
    """Indices of ``ops`` grouped into stages: maximal runs of consecutive ops on one stream."""
    out: list[list[int]] = []
    for i, op in enumerate(ops):
        if out and ops[out[-1][-1]].comm == op.comm:
            out[-1].append(i)
        else:
            out.append([i])
    return out


def _advance(t: float, work: float, comm_iv: list[tuple[float, float]], k: int,
             rate: float) -> tuple[float, int]:
    """End of ``work`` seconds of compute started at ``t`` that runs at ``rate`` while a communication
    interval (``comm_iv``, sorted, disjoint; from index ``k``) is open and at 1 otherwise; also the first
    interval index that can still matter for a later start."""
    while k < len(comm_iv) and comm_iv[k][1] <= t:
        k += 1
    j = k
    while work > 0 and j < len(comm_iv):
        a, b = comm_iv[j]
        if a > t:
            if work <= a - t:
                return t + work, k
            work -= a - t
            t = a
        cap = (b - t) * rate
        if work <= cap:
            return t + work / rate, k
        work -= cap
        t = b
        j += 1
    return t + work, k


def schedule(layers: Sequence[Sequence[Sequence[Op]]], share: float) -> Schedule:
    """Schedule ``layers[l][m]`` (the ops of layer ``l`` for micro-batch ``m``; every micro-batch's ops of a
    layer have the same names and streams) on a compute and a communication stream (module docstring): stream
    order layer by layer, stage by stage, micro-batch by micro-batch; an op waits for its chain predecessor
    (the last op before it that is not ``side``; the previous layer's last for a layer's first). Compute under
    an open communication interval runs at ``1 - share``."""
    if not 0 <= share < 1:
        raise UserError(f"the communication SM share must be in [0, 1), got {share}")
    rate = 1.0 - share
    n_mb = max((len(lay) for lay in layers), default=0)
    ops: list[Op] = []
    dep: list[int | None] = []
    comp_order: list[int] = []
    comm_order: list[int] = []
    last: list[int | None] = [None] * n_mb
    for lay in layers:
        if len({tuple((o.name, o.comm, o.side) for o in mb) for mb in lay}) > 1:
            raise ValueError("micro-batches of a layer must have the same ops")
        ids = []
        for m, mb in enumerate(lay):
            row = []
            prev = last[m]
            for op in mb:
                row.append(len(ops))
                ops.append(op)
                dep.append(prev)
                if not op.side:
                    prev = row[-1]
            last[m] = prev
            ids.append(row)
        for stage in _stages(lay[0]):
            for m in range(len(lay)):
                for i in stage:
                    (comm_order if lay[0][i].comm else comp_order).append(ids[m][i])
    end: list[float | None] = [None] * len(ops)
    comm_iv: list[tuple[float, float]] = []
    comp_iv: list[tuple[float, float, int]] = []
    contention = 0.0
    free_c = free_m = 0.0
    ci = mi = k = 0
    while ci < len(comp_order) or mi < len(comm_order):
        moved = False
        while mi < len(comm_order):
            n = comm_order[mi]
            d = dep[n]
            if d is not None and end[d] is None:
                break
            s = max(free_m, end[d] if d is not None else 0.0)
            e = end[n] = free_m = s + ops[n].seconds
            comm_iv.append((s, e))
            mi += 1
            moved = True
        if ci < len(comp_order):
            n = comp_order[ci]
            d = dep[n]
            if d is None or end[d] is not None:
                s = max(free_c, end[d] if d is not None else 0.0)
                e, k = _advance(s, ops[n].seconds, comm_iv, k, rate)
                end[n] = free_c = e
                contention += max(0.0, (e - s) - ops[n].seconds)
                comp_iv.append((s, e, n))
                ci += 1
                moved = True
        if not moved:
            raise AssertionError("overlap schedule: the stream orders wait on each other")
    compute: dict[str, float] = {}
    comm: dict[str, float] = {}
    hidden: dict[str, float] = {}
    j = 0
    for idx, n in enumerate(comm_order):
        s, e = comm_iv[idx]
        comm[ops[n].name] = comm.get(ops[n].name, 0.0) + ops[n].seconds
        while j < len(comp_iv) and comp_iv[j][1] <= s:
            j += 1
        h, jj = 0.0, j
        while jj < len(comp_iv) and comp_iv[jj][0] < e:
            h += max(0.0, min(e, comp_iv[jj][1]) - max(s, comp_iv[jj][0]))
            jj += 1
        if h > 0:
            hidden[ops[n].name] = hidden.get(ops[n].name, 0.0) + h
    for n in comp_order:
        compute[ops[n].name] = compute.get(ops[n].name, 0.0) + ops[n].seconds
    makespan = max((x for x in end if x is not None), default=0.0)
    return Schedule(makespan, compute, comm, hidden, contention)


# ------------------------------------------------------------------------------------------ a step's layers


def _per_layer_counts(model, bd: StepBreakdown) -> dict[str, tuple[str, int]]:
    """Per-layer terms of a (non-overlapped) breakdown: name -> (group, layers it counts), group being a mixer
    prefix, ``every``, ``moe`` or ``dense``; terms not listed are serial."""
    from rackbed.sim.costs.attention import mixer_counts
    from rackbed.sim.costs.step import layer_counts

    _, _, n_moe, n_dense = layer_counts(model)
    kinds = sorted(((c.prefix, n) for c, n in mixer_counts(model)), key=lambda p: -len(p[0]))
    out: dict[str, tuple[str, int]] = {}
    for name, (cat, _) in bd.terms.items():
        if name.startswith(("mtp_", "draft_")):
            continue
        if name in _EVERY_LAYER:
            out[name] = ("every", model.n_layers)
        elif name in _MOE and n_moe:
            out[name] = ("moe", n_moe)
        elif name in _DENSE and n_dense:
            out[name] = ("dense", n_dense)
        elif cat == "attn_s":
            for prefix, n in kinds:
                if name.startswith(prefix + "_") and n:
                    out[name] = (prefix, n)
                    break
    return out


def _layer_order(model) -> list[tuple[str, str]]:
    """(mixer prefix, ``moe`` | ``dense``) of each layer: dense layers first, mixer kinds in ``MIXER_COSTS``
    order (module docstring)."""
    from rackbed.sim.costs.attention import mixer_counts
    from rackbed.sim.costs.step import layer_counts

    _, _, n_moe, n_dense = layer_counts(model)
    mixers = [c.prefix for c, n in mixer_counts(model) for _ in range(n)]
    ffn = ["dense"] * n_dense + ["moe"] * n_moe
    if len(mixers) != len(ffn):
        raise AssertionError(f"{model.name}: {len(mixers)} token-mixer layers but {len(ffn)} MoE + dense "
                             "layers")
    return list(zip(mixers, ffn))


def _chain(kind: tuple[str, str], names: Mapping[str, tuple[str, int]], mode: str) -> list[str]:
    """Term names of one layer's chain in execution order (module docstring); ``shared_expert`` is moved right
    after the router in mode ``shared_expert``."""
    prefix, ffn = kind
    out = ["norms", *(n for n, (g, _) in names.items() if g == prefix), "attn_allreduce"]
    if ffn == "moe":
        out += ["router"]
        if mode == "shared_expert":
            out += ["shared_expert"]
        out += ["moe_dispatch", "moe_gemm"]
        if mode != "shared_expert":
            out += ["shared_expert"]
        out += ["moe_combine", "moe_combine_local", "moe_combine_allreduce", "moe_allreduce"]
    elif ffn == "dense":
        out += ["dense_mlp", "dense_allreduce"]
    return [n for n in out if n in names]


def overlapped(role: str, mode: str, model, full: StepBreakdown, micro: Sequence[StepBreakdown],
               share: float) -> StepBreakdown:
    """The step of ``full`` (the whole batch, without overlap) with its per-layer terms scheduled with
    overlap: from ``micro`` (one breakdown per micro-batch, without overlap: ``[full]`` for
    ``shared_expert``), on the streams of ``role``; serial terms from ``full``. Returns exposed terms +
    ``hidden`` (module docstring)."""
    if mode not in MODES or mode == "none":
        raise UserError(f"overlap mode must be one of {', '.join(MODES[1:])} here, got {mode!r}")
    comm_terms = COMM_TERMS[role]
    counts: dict[str, tuple[str, int]] = {}
    for bd in (full, *micro):
        counts.update(_per_layer_counts(model, bd))
    layers = []
    for kind in _layer_order(model):
        chain = _chain(kind, counts, mode)
        lay = []
        for bd in micro:
            lay.append([Op(n, bd.terms[n][1] / counts[n][1] if n in bd.terms else 0.0, n in comm_terms,
                           side=mode == "shared_expert" and n == "shared_expert") for n in chain])
        layers.append(lay)
    sch = schedule(layers, share)
    cats = {}
    for bd in (*micro, full):
        cats.update({n: c for n, (c, _) in bd.terms.items()})
    terms: dict[str, tuple[str, float]] = {}
    for name in dict.fromkeys([*full.terms, *(n for bd in micro for n in bd.terms)]):
        if name in counts:
            sec = sch.compute.get(name, 0.0) + sch.comm.get(name, 0.0) - sch.hidden.get(name, 0.0)
            terms[name] = (cats[name], max(0.0, sec))
        elif name in full.terms:
            terms[name] = full.terms[name]
    if sch.contention_s > 0:
        terms[CONTENTION] = ("other_s", sch.contention_s)
    return StepBreakdown(terms, {n: h for n, h in sch.hidden.items() if h > 0})


# -------------------------------------------------------------------------------------------- micro-batches


def split_decode(rank_batch: Sequence[int], rank_context_tokens: Sequence[float]):
    """Two micro-batches of a decode step: every DP rank's sequences halved (``ceil`` / ``floor``), its KV
    tokens in proportion. Returns ``((batch_a, context_a), (batch_b, context_b))``."""
    a = [-(-n // 2) for n in rank_batch]
    b = [n // 2 for n in rank_batch]
    ca = [c * x / n if n else 0.0 for c, x, n in zip(rank_context_tokens, a, rank_batch)]
    cb = [c * x / n if n else 0.0 for c, x, n in zip(rank_context_tokens, b, rank_batch)]
    return (a, ca), (b, cb)


def split_prefill(seqs: Sequence[tuple[int, int]]) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Two micro-batches of a prefill batch of ``(new_tokens, cached_tokens)``: the first ``ceil(T / 2)`` new
    tokens in batch order, and the rest; a sequence that straddles the cut becomes two chunks, the second with
    the first's tokens cached."""
    total = sum(q for q, _ in seqs)
    half = -(-total // 2)
    a: list[tuple[int, int]] = []
    b: list[tuple[int, int]] = []
    acc = 0
    for q, c in seqs:
        take = min(q, max(0, half - acc))
        if take:
            a.append((take, c))
            acc += take
        if q - take:
            b.append((q - take, c + take))
    return a, b


def _scale_tokens_per_expert(tpe, share: float):
    """A busiest rank's per-expert token counts (list, or ``ExpertHistogram`` pairs) for a ``share`` of the
    tokens (counts rounded up)."""
    if tpe is None:
        return None
    items = list(tpe)
    if items and isinstance(items[0], tuple):
        out: dict[int, float] = {}
        for m, cnt in items:
            mm = math.ceil(m * share)
            if mm > 0:
                out[mm] = out.get(mm, 0.0) + cnt
        return tuple(sorted(out.items()))
    return [math.ceil(m * share) for m in items]


def _no_overlap(plan):
    return plan.model_copy(update={"overlap": "none"})


def overlapped_decode(step_fn: Callable[..., StepBreakdown], model, plan, topo, rank_batch: Sequence[int],
                      rank_context_tokens: Sequence[float], *, share: float | None = None,
                      **kw) -> StepBreakdown:
    """``plan.overlap``'s decode step (module docstring). ``step_fn``: the non-overlapped breakdown
    (``sim.costs.step.decode_step_breakdown``), called with ``kw`` for the whole batch and for each
    micro-batch (a given ``tokens_per_expert`` / ``send_matrix`` scaled by the micro-batch's share of the
    tokens)."""
    mode = plan.overlap
    base = _no_overlap(plan)
    full = step_fn(model, base, topo, rank_batch, rank_context_tokens, **kw)
    if share is None:
        share = default_share(topo.gpu_spec(plan.gpus[0]))
    if mode == "shared_expert":
        micro = [full]
    else:
        total = sum(rank_batch)
        micro = []
        done: dict[tuple, StepBreakdown] = {}
        for mb, ctx in split_decode(rank_batch, rank_context_tokens):
            key = (tuple(mb), tuple(ctx))
            if key not in done:
                f = sum(mb) / total if total else 0.0
                mkw = dict(kw)
                if kw.get("tokens_per_expert") is not None:
                    mkw["tokens_per_expert"] = _scale_tokens_per_expert(kw["tokens_per_expert"], f)
                if kw.get("send_matrix") is not None:
                    mkw["send_matrix"] = [[x * f for x in row] for row in kw["send_matrix"]]
                done[key] = step_fn(model, base, topo, mb, ctx, **mkw)
            micro.append(done[key])
    return overlapped("decode", mode, model, full, micro, share)


def overlapped_prefill(step_fn: Callable[..., StepBreakdown], model, plan, topo,
                       seqs: Sequence[tuple[int, int]], *, share: float | None = None, role: str = "prefill",
                       **kw) -> StepBreakdown:
    """``plan.overlap``'s prefill step: ``two_batch`` only (module docstring; in a TP = EP prefiller the
    shared expert's partial sums ride in the combine all-reduce, so it has nothing to run under). ``step_fn``:
    ``sim.costs.step.prefill_step_breakdown`` (``role="prefill"``) or ``dp_prefill_step_breakdown``
    (``role="prefill_dp"``: the dispatch is communication too); a given ``tokens_per_expert`` is scaled by each
    micro-batch's share of the tokens."""
    mode = plan.overlap
    if mode != "two_batch":
        raise UserError(f"prefill overlap {mode!r}: a TP=EP prefiller can only overlap two micro-batches "
                        "(two_batch) or none")
    base = _no_overlap(plan)
    full = step_fn(model, base, topo, seqs, **kw)
    if share is None:
        share = default_share(topo.gpu_spec(plan.gpus[0]))
    total = sum(q for q, _ in seqs)
    micro = []
    for part in split_prefill(seqs):
        mkw = dict(kw)
        if kw.get("tokens_per_expert") is not None:
            f = sum(q for q, _ in part) / total if total else 0.0
            mkw["tokens_per_expert"] = _scale_tokens_per_expert(kw["tokens_per_expert"], f)
        micro.append(step_fn(model, base, topo, part, **mkw))
    return overlapped(role, mode, model, full, micro, share)
