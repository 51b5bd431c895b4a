"""Step time of a whole model under a ``ParallelPlan``: a prefill batch, a decode step (with MTP draft + verify).

Both functions are pure and O(ranks) per call: layers of one kind are identical, so a per-layer cost is computed
once per kind (token mixers: ``sim.costs.attention.MIXER_COSTS`` keyed by the layer kind's tag) and multiplied by
the layer count (costs are exactly linear in layer counts); GEMM costs are memoised per
shape (``sim.costs.gemm``). They return ``StepTime`` (``*_step_time``) or the term-by-term
:class:`~sim.costs.breakdown.StepBreakdown` (``*_step_breakdown``) whose categories sum to it.

**Prefill** (``plan.dp == 1``: the write-up's TP = EP prefillers; the batch is replicated over the EP group after
each attention all-reduce). Per layer, on one rank:

    attention (QKV/O projections split tp ways, K/V replicated beyond n_kv_heads; flash core over local heads)
    + TP all-reduce of the attention output: tokens x hidden x 2 B over the TP group
    + MoE: router, dispatch (local select + pack), routed grouped GEMM over this rank's experts (per-expert token
      counts: binomial from uniform top-k routing, or given; a measured ``moe_us`` block replaces it, fixed costs
      included: ``sim.costs.moe_block``), shared expert (split tp ways), combine (local
      accumulate) and the EP combine all-reduce: tokens x hidden x 2 B over the EP group
      (dense-MLP layers instead: the MLP split tp ways + an all-reduce)
    + two fused residual-add + RMSNorm kernels
  and once per step: embeddings, lm_head for the last token of every sequence, host step overhead, and — when
  the TP group spans hosts — the cross-node host synchronisation (``CROSS_NODE_HOST_SYNC_US``: the write-up's
  "host code split over two nodes").

**Decode** (DP attention + EP experts; every DP rank owns ``rank_batch[r]`` sequences holding
``rank_context_tokens[r]`` KV tokens). A DP rank is one GPU (``plan.tp == 1``) or a TP group of ``tp`` GPUs
(attention TP x DP): its GPUs split the attention heads (projections, core and KV ``tp`` ways, KV heads replicated
beyond the model's), all-reduce the attention output over the TP group (``attn_allreduce``), each route and
dispatch a ``1 / tp`` slice of the rank's tokens over the EP group (all ``tp * dp`` GPUs), run the shared expert
``tp`` ways on all of them, and all-reduce the MoE output (``moe_allreduce``: shared-expert partial sums and the
routed slices in one). With ``tp = 1`` none of the TP terms exist. A step with ``draft_k`` MTP drafts is
*draft + verify*:

* verify: the main model on ``draft_k + 1`` query tokens per sequence — per layer the slowest rank's attention
  (KV read once, ``q_per_seq = draft_k + 1``), DP-EP dispatch, the grouped GEMM on a rank's experts (tokens per
  expert ~ Binomial(all tokens of all ranks, top_k / n_experts) — the *activated* local experts' weights are
  streamed), combine, shared expert, norms; then the lm_head on every token;
* draft: ``draft_k`` sequential passes of the MTP module(s) on one token per sequence: fc (2*hidden -> hidden),
  one full-attention decoder layer with the model's MoE (dispatch, GEMM, combine), norms and the lm_head.
  ``n_mtp_layers`` says how many modules a pass runs (default: the model's own, at least one — a scenario states
  the draft explicitly, ``sim.scenario.resolve_mtp``). With a separate ``draft_model`` instead, each draft token
  is one decode step of that model on one token per sequence on the same plan (its terms prefixed ``draft_``;
  the host overhead is the step's, counted once).
"""

from __future__ import annotations

from collections.abc import Sequence

from rackbed.sim.costs import constants as C
from rackbed.sim.costs.attention import mixer_counts, mtp_costs
from rackbed.sim.costs.breakdown import BreakdownBuilder, StepBreakdown, StepTime
from rackbed.sim.costs.calibration import CalibrationTable, host_step_s, kernel_fixed_us
from rackbed.sim.costs.collective import allreduce_time, group_links
from rackbed.sim.costs.eplb import ExpertLoad
from rackbed.sim.costs.gemm import (
    ExpertHistogram,
    binomial_histogram,
    expert_mlp_time,
    gemm_time,
    hbm_rate_Bps,
)
from rackbed.sim.costs.moe_block import moe_block_s
from rackbed.sim.costs.moe_comm import (
    allgather_decode_dispatch,
    dpep_decode_combine,
    dpep_decode_dispatch,
    ep_prefill_combine,
    ep_prefill_dispatch,
    reducescatter_decode_combine,
)
from rackbed.topology.errors import UserError

US = 1e-6


def _norms_s(gpu, model, n_tokens: float, calib) -> float:
    """Fused residual-add + RMSNorm kernels of one layer (``ELEMENTWISE_PASSES_PER_LAYER`` read+write passes
    over the hidden state, two kernels)."""
    if n_tokens <= 0:
        return 0.0
    nbytes = C.ELEMENTWISE_PASSES_PER_LAYER * n_tokens * model.hidden * 2 * 2
    return nbytes / hbm_rate_Bps(gpu, nbytes, calib) + 2 * kernel_fixed_us(calib, gpu) * US


def _embed_s(gpu, model, n_tokens: float, calib) -> float:
    if n_tokens <= 0:
        return 0.0
    nbytes = n_tokens * model.hidden * 2 * 2
    return nbytes / hbm_rate_Bps(gpu, nbytes, calib) + kernel_fixed_us(calib, gpu) * US


def _shared_expert_s(gpu, model, n_tokens: int, tp: int, fmt: str, calib) -> float:
    if not model.n_shared_experts or n_tokens <= 0:
        return 0.0
    inter = max(1, model.n_shared_experts * model.shared_intermediate // tp)
    return (gemm_time(gpu, n_tokens, 2 * inter, model.hidden, fmt, calib=calib).total_s
            + gemm_time(gpu, n_tokens, model.hidden, inter, fmt, calib=calib).total_s)


def _dense_mlp_s(gpu, model, n_tokens: int, tp: int, fmt: str, calib) -> float:
    if n_tokens <= 0 or not model.dense_intermediate:
        return 0.0
    inter = max(1, model.dense_intermediate // tp)
    return (gemm_time(gpu, n_tokens, 2 * inter, model.hidden, fmt, calib=calib).total_s
            + gemm_time(gpu, n_tokens, model.hidden, inter, fmt, calib=calib).total_s)


def _plan_gpu(plan, topo):
    return topo.gpu_spec(plan.gpus[0])


_COUNTS: dict[int, tuple[object, tuple[int, int, int, int]]] = {}


def layer_counts(model) -> tuple[int, int, int, int]:
    """(full-attention, linear-attention, MoE, dense-MLP) layer counts, cached per model object."""
    hit = _COUNTS.get(id(model))
    if hit is not None and hit[0] is model:
        return hit[1]
    out = (model.n_full_layers, model.n_linear_layers, model.n_moe_layers, model.n_dense_layers)
    if len(_COUNTS) > 256:
        _COUNTS.clear()
    _COUNTS[id(model)] = (model, out)
    return out


def _add_attention(b: BreakdownBuilder, prefix: str, n: int, a) -> None:
    """A token-mixer kind's terms for ``n`` layers: ``<prefix>_proj``, ``<prefix>_core`` and one
    ``<prefix>_<part>`` per further kernel of the kind (``AttentionCost.parts``: MLA's ``kv_up`` / ``absorb``)."""
    b.add(f"{prefix}_proj", "attn_s", n * a.proj_s)
    b.add(f"{prefix}_core", "attn_s", n * a.core_s)
    for name, sec in a.parts:
        b.add(f"{prefix}_{name}", "attn_s", n * sec)


def pareto_ranks(batch: Sequence[float], context: Sequence[float]) -> list[tuple[float, float]]:
    """Distinct (batch, context) pairs not dominated by another rank's pair: the only candidates for the slowest
    rank, since per-rank attention time grows with both."""
    pairs = sorted(set(zip(batch, context)), key=lambda p: (-p[0], -p[1]))
    out, best_ctx = [], -1.0
    for n, ctx in pairs:
        if ctx > best_ctx:
            out.append((n, ctx))
            best_ctx = ctx
    return out


# ------------------------------------------------------------------------------------------------ prefill


def prefill_step_breakdown(model, plan, topo, seqs: Sequence[tuple[int, int]], *,
                           tokens_per_expert: Sequence[int] | ExpertHistogram | None = None,
                           allreduce_algo: str = "auto", calib: CalibrationTable | None = None) -> StepBreakdown:
    """Term-by-term prefill step (module docstring). ``seqs``: ``(new_tokens, cached_tokens)`` per sequence.
    ``tokens_per_expert``: the busiest rank's per-local-expert token counts (e.g. from ``EpPrefillPlan.gemm_rows``);
    None = expected counts under uniform routing. ``allreduce_algo``: see ``collective.allreduce_time``."""
    if plan.dp != 1:
        return dp_prefill_step_breakdown(model, plan, topo, seqs, tokens_per_expert=tokens_per_expert, calib=calib)
    if getattr(plan, "overlap", "none") != "none":  # the same terms, scheduled with overlap
        from rackbed.sim.costs.overlap import overlapped_prefill

        return overlapped_prefill(prefill_step_breakdown, model, plan, topo, seqs,
                                  tokens_per_expert=tokens_per_expert, allreduce_algo=allreduce_algo,
                                  calib=calib)
    gpu = _plan_gpu(plan, topo)
    fmt, tp = plan.weight_format, plan.tp
    n_tokens = sum(q for q, _ in seqs)
    n_seqs = sum(1 for q, _ in seqs if q)
    b = BreakdownBuilder()
    if n_tokens <= 0:
        return b.build()
    _, _, n_moe, n_dense = layer_counts(model)
    for costs, n in mixer_counts(model):
        a = costs.prefill(gpu, model, seqs, tp=tp, fmt=fmt, calib=calib)
        _add_attention(b, costs.prefix, n, a)
    tp_group = plan.tp_group(0)
    act_bytes = n_tokens * model.hidden * 2
    ar = allreduce_time(topo, tp_group, act_bytes, algo=allreduce_algo, calib=calib)
    b.add("attn_allreduce", "allreduce_s", model.n_layers * ar.total_s)
    if n_moe:
        ep = plan.ep
        if tokens_per_expert is None:
            hist = binomial_histogram(n_tokens, model.top_k / model.n_experts, model.n_experts // ep)
            local = None
        else:
            hist = tokens_per_expert
            local = sum(m * c for m, c in hist) if hist and isinstance(next(iter(hist)), tuple) \
                else sum(hist)  # type: ignore[arg-type]
        b.add("router", "other_s", n_moe * gemm_time(gpu, n_tokens, model.n_experts, model.hidden, "bf16",
                                                     calib=calib).total_s)
        disp = ep_prefill_dispatch(topo, plan.gpus, n_tokens, model, fmt, local_copies=local, calib=calib)
        b.add("moe_dispatch", "a2a_s", n_moe * disp.total_s)
        block = moe_block_s(calib, gpu, model, fmt, plan.expert_tp, ep, n_tokens)
        if block is None:
            inter = model.moe_intermediate // plan.expert_tp
            block = expert_mlp_time(gpu, model.hidden, inter, hist, fmt, calib=calib).total_s
        b.add("moe_gemm", "moe_gemm_s", n_moe * block)
        b.add("shared_expert", "moe_gemm_s", n_moe * _shared_expert_s(gpu, model, n_tokens, tp, fmt, calib))
        comb = ep_prefill_combine(topo, plan.gpus, n_tokens, model, local_copies=local, algo=allreduce_algo,
                                  calib=calib)
        if comb.calibrated_s is not None:
            b.add("moe_combine", "a2a_s", n_moe * comb.total_s)
        else:
            b.add("moe_combine_local", "a2a_s", n_moe * (comb.fixed_s + comb.local_s))
            b.add("moe_combine_allreduce", "allreduce_s", n_moe * comb.allreduce_s)
    if n_dense:
        b.add("dense_mlp", "moe_gemm_s", n_dense * _dense_mlp_s(gpu, model, n_tokens, tp, fmt, calib))
        b.add("dense_allreduce", "allreduce_s", n_dense * ar.total_s)
    b.add("norms", "other_s", model.n_layers * _norms_s(gpu, model, n_tokens, calib))
    b.add("embed", "other_s", _embed_s(gpu, model, n_tokens, calib))
    b.add("lm_head", "other_s", gemm_time(gpu, n_seqs, model.vocab, model.hidden, "bf16", calib=calib).total_s)
    b.add("host", "other_s", host_step_s(calib, gpu, "prefill", n_seqs))
    if group_links(topo, tp_group).n_hosts > 1:
        b.add("cross_node_host", "other_s", C.CROSS_NODE_HOST_SYNC_US * US)
    return b.build()


def deal_seqs(seqs: Sequence[tuple[int, int]], ranks: int) -> list[list[tuple[int, int]]]:
    """``seqs`` dealt to ``ranks`` DP ranks: longest first, each onto the rank with the fewest new tokens so far
    (ties: the lowest rank)."""
    out: list[list[tuple[int, int]]] = [[] for _ in range(ranks)]
    load = [0] * ranks
    for q, c in sorted(seqs, key=lambda x: -x[0]):
        r = load.index(min(load))
        out[r].append((q, c))
        load[r] += q
    return out


def dp_prefill_step_breakdown(model, plan, topo, seqs: Sequence[tuple[int, int]], *,
                              tokens_per_expert: Sequence[int] | ExpertHistogram | None = None,
                              calib: CalibrationTable | None = None) -> StepBreakdown:
    """A prefill step with DP attention and EP over all the group's GPUs (``plan.dp > 1``: a prefiller spanning
    nodes, DeepSeek-V3's prefill over several 8-GPU nodes). The batch's sequences are dealt to the ``dp`` ranks
    (:func:`deal_seqs`); the step is priced on the rank with the most new tokens ``t``: its attention (TP ``tp``
    inside the rank, with a TP all-reduce when ``tp > 1``); per MoE layer the router on the ``ceil(t / tp)`` tokens
    each of its GPUs dispatches, a DeepEP normal-mode dispatch and combine over the EP group
    (:func:`sim.costs.moe_comm.ep_comm`: once per node over RDMA, forwarded over NVLink; the busiest GPU sends
    ``ceil(t / tp)`` tokens and receives the mean GPU's), the grouped GEMM over the GPU's local experts fed from the
    whole batch (binomial counts, or a measured MoE block), the shared expert on the rank's tokens split ``tp``
    ways; dense-MLP layers, norms, embeddings and the lm_head on the rank's tokens; the host step."""
    if getattr(plan, "overlap", "none") != "none":  # two micro-batches, one's dispatch / combine under the other's
        from rackbed.sim.costs.overlap import overlapped_prefill

        return overlapped_prefill(dp_prefill_step_breakdown, model, plan, topo, seqs, role="prefill_dp",
                                  tokens_per_expert=tokens_per_expert, calib=calib)
    gpu = _plan_gpu(plan, topo)
    fmt, tp, dp = plan.weight_format, plan.tp, plan.dp
    b = BreakdownBuilder()
    n_tokens = sum(q for q, _ in seqs)
    if n_tokens <= 0:
        return b.build()
    dealt = deal_seqs([(q, c) for q, c in seqs if q], dp)
    mine = max(dealt, key=lambda r: sum(q for q, _ in r))
    t = sum(q for q, _ in mine)
    _, _, n_moe, n_dense = layer_counts(model)
    for costs, n in mixer_counts(model):
        _add_attention(b, costs.prefix, n, costs.prefill(gpu, model, mine, tp=tp, fmt=fmt, calib=calib))
    _tp_allreduce(b, "attn_allreduce", model.n_layers, model, plan, topo, t, calib)
    if n_moe:
        from rackbed.sim.costs.moe_comm import ep_comm

        t_gpu = -(-t // tp)
        mean = n_tokens / (tp * dp)
        b.add("router", "other_s", n_moe * gemm_time(gpu, t_gpu, model.n_experts, model.hidden, "bf16",
                                                     calib=calib).total_s)
        disp = ep_comm(topo, plan.gpus, t_gpu, model, "normal", "dispatch", fmt, calib=calib,
                       recv_scale=mean / t_gpu, copy_scale=mean / t_gpu)
        b.add("moe_dispatch", "a2a_s", n_moe * disp.total_s)
        block = moe_block_s(calib, gpu, model, fmt, plan.expert_tp, plan.ep, n_tokens)
        if block is None:
            hist = tokens_per_expert if tokens_per_expert is not None else \
                binomial_histogram(n_tokens, model.top_k / model.n_experts, model.n_experts // plan.ep)
            block = expert_mlp_time(gpu, model.hidden, model.moe_intermediate // plan.expert_tp, hist, fmt,
                                    calib=calib).total_s
        b.add("moe_gemm", "moe_gemm_s", n_moe * block)
        b.add("shared_expert", "moe_gemm_s", n_moe * _shared_expert_s(gpu, model, t, tp, fmt, calib))
        comb = ep_comm(topo, plan.gpus, t_gpu, model, "normal", "combine", calib=calib, recv_scale=mean / t_gpu,
                       copy_scale=mean / t_gpu)
        b.add("moe_combine", "a2a_s", n_moe * comb.total_s)
        _tp_allreduce(b, "moe_allreduce", n_moe, model, plan, topo, t, calib)
    if n_dense:
        b.add("dense_mlp", "moe_gemm_s", n_dense * _dense_mlp_s(gpu, model, t, tp, fmt, calib))
        _tp_allreduce(b, "dense_allreduce", n_dense, model, plan, topo, t, calib)
    b.add("norms", "other_s", model.n_layers * _norms_s(gpu, model, t, calib))
    b.add("embed", "other_s", _embed_s(gpu, model, t, calib))
    b.add("lm_head", "other_s", gemm_time(gpu, len(mine), model.vocab, model.hidden, "bf16", calib=calib).total_s)
    b.add("host", "other_s", host_step_s(calib, gpu, "prefill", len(mine)))
    return b.build()


def prefill_step_time(model, plan, topo, seqs: Sequence[tuple[int, int]], **kw) -> StepTime:
    """``prefill_step_breakdown(...).to_steptime()``."""
    return prefill_step_breakdown(model, plan, topo, seqs, **kw).to_steptime()


# ------------------------------------------------------------------------------------------------ decode


def _moe_decode_layer(b: BreakdownBuilder, prefix: str, n_layers: int, gpu, model, plan, topo,
                      tokens_per_rank: Sequence[int], tokens_per_expert, send_matrix, fmt: str, calib,
                      load=None) -> None:
    """One MoE layer of a decode pass on the slowest rank, times ``n_layers``, into ``b``. ``tokens_per_rank``:
    tokens of each DP rank; with attention TP (``plan.tp > 1``) each of a rank's GPUs routes and dispatches its
    ``1 / tp`` slice of them, and the shared expert (split ``tp`` ways) runs on them all. ``load``: an
    :class:`ExpertLoad` for skewed routing (None: uniform expectations): the layer is priced at the busiest expert
    rank — its grouped GEMM over its slots' token counts (``BusiestRank.slot_hist``), its incoming dispatch /
    outgoing combine messages (``BusiestRank.message_scale`` times the mean rank's: deduplicated per token) and its
    local (un)packing of expert copies (``BusiestRank.scale`` times). The MTP module's MoE (``prefix`` ``mtp_``)
    draws its routing like the model's first MoE layer."""
    tp = plan.tp
    t_max = max(tokens_per_rank)
    t_all = sum(tokens_per_rank)
    if t_all <= 0 or n_layers <= 0:
        return
    t_gpu = -(-t_max // tp)  # a GPU's slice of its DP rank's tokens (all of them when tp = 1)
    b.add(f"{prefix}router", "other_s",
          n_layers * gemm_time(gpu, t_gpu, model.n_experts, model.hidden, "bf16", calib=calib).total_s)
    slots = model.n_experts + getattr(plan, "redundant_experts", 0)
    busy = None if load is None or tokens_per_expert is not None or send_matrix is not None else \
        load.busiest(model, plan, t_all, n_layers if prefix == "" else 1)
    gather = getattr(plan, "moe_comm", "a2a") == "allgather"  # every token to every GPU, whatever its routing
    if gather:
        disp = allgather_decode_dispatch(topo, plan.gpus, t_gpu, model, fmt, calib=calib)
        comb = reducescatter_decode_combine(topo, plan.gpus, t_gpu, model, calib=calib)
    if busy is None:
        if not gather:
            disp = dpep_decode_dispatch(topo, plan.gpus, t_gpu, model, fmt, send_matrix=send_matrix,
                                        calib=calib)
            comb = dpep_decode_combine(topo, plan.gpus, t_gpu, model, send_matrix=send_matrix, calib=calib)
        b.add(f"{prefix}moe_dispatch", "a2a_s", n_layers * disp.total_s)
        block = _routed_block_s(calib, gpu, model, fmt, plan.expert_tp, plan.ep, slots, t_all)
        if block is None:
            hist = tokens_per_expert if tokens_per_expert is not None else \
                binomial_histogram(t_all, model.top_k / slots, slots // plan.ep)
            inter = model.moe_intermediate // plan.expert_tp
            block = expert_mlp_time(gpu, model.hidden, inter, hist, fmt, calib=calib).total_s
    else:
        msgs = busy.message_scale(model.top_k, plan.ep)
        if not gather:
            disp = dpep_decode_dispatch(topo, plan.gpus, t_gpu, model, fmt, calib=calib, recv_scale=msgs,
                                        copy_scale=busy.scale)
            comb = dpep_decode_combine(topo, plan.gpus, t_gpu, model, calib=calib, recv_scale=msgs,
                                       copy_scale=busy.scale)
        b.add(f"{prefix}moe_dispatch", "a2a_s", n_layers * disp.total_s)
        block = _routed_block_s(calib, gpu, model, fmt, plan.expert_tp, plan.ep, slots, t_all * busy.scale)
        if block is None:
            inter = model.moe_intermediate // plan.expert_tp
            block = expert_mlp_time(gpu, model.hidden, inter, busy.slot_hist, fmt, calib=calib).total_s
        if busy.moved_per_rebalance and prefix == "":
            b.add("eplb_rebalance", "other_s", load.rebalance_s(model, plan, topo, busy))
    b.add(f"{prefix}moe_gemm", "moe_gemm_s", n_layers * block)
    b.add(f"{prefix}shared_expert", "moe_gemm_s",
          n_layers * _shared_expert_s(gpu, model, t_max, tp, fmt, calib))
    b.add(f"{prefix}moe_combine", "a2a_s", n_layers * comb.total_s)
    _tp_allreduce(b, f"{prefix}moe_allreduce", n_layers, model, plan, topo, t_max, calib)


def _routed_block_s(calib, gpu, model, fmt: str, expert_tp: int, ep: int, slots: int, n_tokens: float) -> float | None:
    """A measured routed-expert block (``moe_block_s``) for a rank of ``slots / ep`` expert slots. Without
    redundant experts that is the table's own ``ep``. With them (wide EP) a rank holds ``s = slots / ep`` slots,
    each loaded with ``n_tokens * top_k / slots`` tokens under balanced routing: exactly the table's rank at
    ``ep' = n_experts / s`` (also ``s`` experts) fed ``n_tokens * n_experts / slots`` tokens, when ``s`` divides the
    experts (e.g. DeepSeek-V3 at EP 72 with 288 slots: the EP-64 curve at 256/288 of the tokens). None when no
    table matches (the caller prices the grouped GEMMs over the slots)."""
    if slots == model.n_experts:
        return moe_block_s(calib, gpu, model, fmt, expert_tp, ep, n_tokens)
    per_rank = slots // ep
    if model.n_experts % per_rank:
        return None
    return moe_block_s(calib, gpu, model, fmt, expert_tp, model.n_experts // per_rank,
                       n_tokens * model.n_experts / slots)


def _tp_allreduce(b: BreakdownBuilder, name: str, n_layers: int, model, plan, topo, n_tokens: int, calib) -> None:
    """Attention TP in a decoder (``plan.tp > 1``): an all-reduce of ``n_tokens x hidden`` bf16 over a DP rank's
    TP group per layer (after the attention's output projection; after the MoE block, where it sums the shared
    expert's partial outputs and gathers the GPUs' routed slices in one). Nothing with ``tp = 1``."""
    if plan.tp > 1 and n_layers and n_tokens > 0:
        ar = allreduce_time(topo, plan.tp_group(0), n_tokens * model.hidden * 2, calib=calib)
        b.add(name, "allreduce_s", n_layers * ar.total_s)


def decode_step_breakdown(model, plan, topo, rank_batch: Sequence[int], rank_context_tokens: Sequence[float], *,
                          draft_k: int = 0, n_mtp_layers: int | None = None, draft_model=None,
                          tokens_per_expert: Sequence[int] | ExpertHistogram | None = None,
                          send_matrix: Sequence[Sequence[float]] | None = None,
                          expert_load: ExpertLoad | None = None,
                          calib: CalibrationTable | None = None) -> StepBreakdown:
    """Term-by-term decode step = MTP draft (``draft_k`` passes) + verify (module docstring).

    ``rank_batch[r]`` / ``rank_context_tokens[r]``: sequences and KV tokens of DP rank ``r`` (``plan.tp_group(r)``,
    one GPU when ``plan.tp == 1``). ``tokens_per_expert``: the busiest GPU's per-local-expert token counts of the
    verify pass (e.g. from a ``DpEpDecodePlan``); ``send_matrix``: its ``tokens`` matrix (one row and column per
    GPU of the EP group); None = uniform-routing expectations. ``expert_load``: skewed routing and EPLB
    (:class:`ExpertLoad`): every MoE layer priced at its expected busiest expert rank; None or uniform routing:
    the uniform expectations, exactly."""
    r = plan.dp
    if plan.world != plan.tp * plan.dp:
        raise UserError(f"decode plan: {plan.world} GPUs for tp*dp = {plan.tp}*{plan.dp}")
    if len(rank_batch) != r or len(rank_context_tokens) != r:
        raise UserError(f"rank_batch and rank_context_tokens need one entry per rank ({r} DP ranks), got "
                        f"{len(rank_batch)} and {len(rank_context_tokens)}")
    if draft_k < 0:
        raise UserError(f"draft_k must be >= 0, got {draft_k}")
    if getattr(plan, "overlap", "none") != "none":  # the same terms, scheduled with overlap
        from rackbed.sim.costs.overlap import overlapped_decode

        return overlapped_decode(decode_step_breakdown, model, plan, topo, rank_batch, rank_context_tokens,
                                 draft_k=draft_k, n_mtp_layers=n_mtp_layers, draft_model=draft_model,
                                 tokens_per_expert=tokens_per_expert, send_matrix=send_matrix,
                                 expert_load=expert_load, calib=calib)
    gpu = _plan_gpu(plan, topo)
    fmt = plan.weight_format
    q = draft_k + 1
    b = BreakdownBuilder()
    if sum(rank_batch) <= 0:
        return b.build()
    kw = {"fmt": fmt, "q_per_seq": q, "kv_elem_bytes": plan.kv_elem_bytes, "page_tokens": plan.page_tokens,
          "calib": calib}
    if plan.tp > 1:
        kw["tp"] = plan.tp
    _, _, n_moe, n_dense = layer_counts(model)
    front = pareto_ranks(rank_batch, rank_context_tokens)
    # verify pass: slowest rank's attention per layer kind
    for costs, n in mixer_counts(model):
        worst = costs.decode(gpu, model, rank_batch, front, kw)
        _add_attention(b, costs.prefix, n, worst)
    tokens = [n * q for n in rank_batch]
    _tp_allreduce(b, "attn_allreduce", model.n_layers, model, plan, topo, max(tokens), calib)
    _moe_decode_layer(b, "", n_moe, gpu, model, plan, topo, tokens, tokens_per_expert, send_matrix, fmt, calib,
                      expert_load)
    if n_dense:
        b.add("dense_mlp", "moe_gemm_s", n_dense * _dense_mlp_s(gpu, model, max(tokens), plan.tp, fmt, calib))
        _tp_allreduce(b, "dense_allreduce", n_dense, model, plan, topo, max(tokens), calib)
    b.add("norms", "other_s", model.n_layers * _norms_s(gpu, model, max(tokens), calib))
    b.add("embed", "other_s", _embed_s(gpu, model, max(tokens), calib))
    b.add("lm_head", "other_s", gemm_time(gpu, max(tokens), model.vocab, model.hidden, "bf16",
                                          calib=calib).total_s)
    if draft_k and draft_model is not None:
        one = decode_step_breakdown(draft_model, plan, topo, rank_batch, rank_context_tokens, calib=calib)
        for name, (cat, sec) in one.terms.items():
            if name != "host":
                b.add(f"draft_{name}", cat, draft_k * sec)
    elif draft_k:
        n_mtp = n_mtp_layers if n_mtp_layers is not None else (model.n_mtp_layers or 1)
        _mtp_draft(b, draft_k, n_mtp, gpu, model, plan, topo, rank_batch, front, {**kw, "q_per_seq": 1},
                   expert_load)
    b.add("host", "other_s", host_step_s(calib, gpu, "decode", max(rank_batch)))
    return b.build()


def _mtp_draft(b: BreakdownBuilder, draft_k: int, n_mtp: int, gpu, model, plan, topo, rank_batch, front,
               kw: dict, load=None) -> None:
    """MTP draft: ``draft_k`` sequential passes of the ``n_mtp`` MTP module(s), one token per sequence: fc
    (2*hidden -> hidden, replicated), one decoder layer of the model's global attention kind (full attention; MLA
    in an MLA model: ``ModelSpec.mtp_layer``) sharded like the others (its own KV cache, as long as the
    sequence's) with the model's MoE, norms and the lm_head."""
    passes = draft_k * n_mtp
    fmt, calib = kw["fmt"], kw["calib"]
    t1 = max(rank_batch)
    worst = mtp_costs(model).decode(gpu, model, rank_batch, front, kw)
    b.add("mtp_fc", "other_s", passes * gemm_time(gpu, t1, model.hidden, 2 * model.hidden, fmt,
                                                  calib=calib).total_s)
    b.add("mtp_attn", "attn_s", passes * worst.total_s)
    _tp_allreduce(b, "mtp_attn_allreduce", passes, model, plan, topo, t1, calib)
    if model.n_experts:
        _moe_decode_layer(b, "mtp_", passes, gpu, model, plan, topo, list(rank_batch), None, None, fmt, calib,
                          load)
    else:
        b.add("mtp_dense_mlp", "moe_gemm_s", passes * _dense_mlp_s(gpu, model, t1, plan.tp, fmt, calib))
        _tp_allreduce(b, "mtp_dense_allreduce", passes, model, plan, topo, t1, calib)
    b.add("mtp_norms", "other_s", passes * _norms_s(gpu, model, t1, calib))
    b.add("mtp_lm_head", "other_s", draft_k * gemm_time(gpu, t1, model.vocab, model.hidden, "bf16",
                                                        calib=calib).total_s)


def decode_step_time(model, plan, topo, rank_batch: Sequence[int], rank_context_tokens: Sequence[float],
                     **kw) -> StepTime:
    """``decode_step_breakdown(...).to_steptime()``."""
    return decode_step_breakdown(model, plan, topo, rank_batch, rank_context_tokens, **kw).to_steptime()


# ------------------------------------------------------------------------------------------------ plan adapters


def prefill_batch_time(model, plan, topo, batch, **kw) -> StepTime:
    """StepTime of an ``engine.core.plans.PrefillBatch`` (items ``(request_id, start_token, n_tokens)``)."""
    seqs = [(n, start) for _, start, n in batch.items]
    return prefill_step_time(model, plan, topo, seqs, **kw)


def decode_plan_time(model, plan, topo, step, **kw) -> StepTime:
    """StepTime of an ``engine.core.plans.DecodeStep`` (rank_batch, rank_context_tokens, draft_k)."""
    return decode_step_time(model, plan, topo, step.rank_batch, step.rank_context_tokens, draft_k=step.draft_k,
                            **kw)
