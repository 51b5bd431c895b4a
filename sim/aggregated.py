"""Aggregated deployments in scenarios: the ``aggregated:`` section, its checks, building and pricing its steps.

A scenario with ``deployment: aggregated`` serves with aggregated workers (:mod:`engine.core.aggregated`: every
worker prefills and decodes, mixed steps under a per-rank token budget, KV kept on the rank) instead of prefillers
and decoders; its ``prefill`` / ``decode`` sections are not used. :func:`check_aggregated` holds the rules that
span sections (one line naming the field); :func:`build_aggregated` places the workers and sizes their KV from the
memory budget of the worker's :class:`~engine.core.sharding.ParallelPlan` (:func:`aggregated_plan_for`), and the
scenario's cost model prices their :class:`~engine.core.plans.MixedStep`\\ s with :func:`price_mixed`
(:mod:`sim.costs.mixed`).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from rackbed.topology.errors import UserError


class AggregatedSection(BaseModel):
    """Aggregated workers: ``tp × dp`` GPUs of one NVLink domain each; ``dp`` DP-attention ranks (``tp`` GPUs each)
    share ``ep``-way expert parallelism; each rank's step takes its decode batch plus prefill chunks within
    ``max_batch_tokens`` (``vLLM``'s ``max_num_batched_tokens``), at most ``chunk_tokens`` per prompt."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    workers: int = Field(1, ge=1)
    tp: int = Field(1, ge=1)
    dp: int = Field(8, ge=1)
    ep: int = Field(8, ge=1)
    max_batch_per_rank: int = Field(64, ge=1)
    max_batch_tokens: int = Field(8192, ge=1)
    chunk_tokens: int | None = Field(2048, ge=1)
    page_tokens: int = Field(64, ge=1)
    max_queue_requests: int | None = Field(None, ge=1)
    kv_replication: int | None = Field(None, ge=1)


def check_aggregated(sc, source=None) -> None:
    """The rules of an aggregated scenario that span sections; a one-line ``UserError`` naming the field."""
    pre = f"{source}: " if source else ""
    a = sc.aggregated
    if sc.deployment != "aggregated":
        if a is not None:
            raise UserError(f"{pre}aggregated: only used with deployment: aggregated")
        return
    a = a or AggregatedSection()
    rules = (
        (a.tp > 1 and a.dp > 1, "aggregated.tp: tp > 1 needs dp = 1 (one TP group) or tp = 1 (DP attention ranks)"),
        ((a.tp * a.dp) % a.ep != 0, f"aggregated.ep: {a.ep} does not divide the worker's tp*dp = {a.tp * a.dp} GPUs"),
        (a.tp > 1 and sc.mtp.draft_k > 0, "mtp.draft_k: MTP is priced for aggregated DP attention ranks (tp = 1) only"),
        (a.max_batch_tokens <= a.max_batch_per_rank * (1 + sc.mtp.draft_k),
         f"aggregated.max_batch_tokens: must exceed max_batch_per_rank × (1 + mtp.draft_k) = "
         f"{a.max_batch_per_rank * (1 + sc.mtp.draft_k)} so that prefill always has room"),
        (sc.autoscaler is not None and sc.autoscaler.enabled, "autoscaler: aggregated workers are not autoscaled"),
        (sc.sim.shed_ttft_s is not None, "sim.shed_ttft_s: TTFT shedding needs prefillers (not aggregated)"),
        (sc.sim.chunked_prefill, "sim.chunked_prefill: aggregated workers chunk prompts by aggregated.chunk_tokens"),
    )
    for broken, msg in rules:
        if broken:
            raise UserError(pre + msg)


def aggregated_plan_for(sc, model, gpus):
    """The ParallelPlan of an aggregated worker on ``gpus``: DP attention ranks (``tp == 1``, priced as a decode
    plan) or one TP group (``dp == 1``, as a prefill plan); ``max_batch_tokens`` / ``max_batch_per_rank`` size
    the activation reserve."""
    from rackbed.engine.core.sharding import ParallelPlan

    a = sc.aggregated or AggregatedSection()
    kv_rep = a.kv_replication or (max(1, a.tp // model.n_kv_heads) if a.tp > model.n_kv_heads else 1)
    return ParallelPlan(role="decode" if a.tp == 1 else "prefill", tp=a.tp, ep=a.ep, dp=a.dp, kv_replication=kv_rep,
                        gpus=tuple(gpus), weight_format=sc.weight_format, kv_dtype=sc.kv_dtype,
                        page_tokens=a.page_tokens, max_batch_tokens=a.max_batch_tokens,
                        max_batch_seqs=a.max_batch_per_rank)


def build_aggregated(sc, topo, model, kv_view, *, engine_calibration: bool = True):
    """``sim.scenario.build`` for ``deployment: aggregated``: the placed workers, their plan (as both the
    ``prefill_plan`` and the ``decode_plan`` of :class:`~sim.scenario.Built`) and the cost model."""
    from rackbed.engine.core.deployment import AggregatedTemplate, place_aggregated
    from rackbed.sim.coverage import calibration_caveats
    from rackbed.sim.scenario import Built, cost_model_for, draft_budget

    a = sc.aggregated or AggregatedSection()
    kv_elem = 2 if sc.kv_dtype == "bf16" else 1

    def template(kv: int) -> AggregatedTemplate:
        return AggregatedTemplate(tp=a.tp, dp=a.dp, ep=a.ep, max_batch_per_rank=a.max_batch_per_rank,
                                  max_batch_tokens=a.max_batch_tokens, chunk_tokens=a.chunk_tokens,
                                  kv_capacity_tokens_per_rank=kv, kv_page_tokens=a.page_tokens,
                                  max_queue_requests=a.max_queue_requests)

    def placed(kv: int):
        return place_aggregated(kv_view, n_workers=a.workers, kv_bytes_per_token=model.kv_bytes_per_token(kv_elem),
                                template=template(kv), mtp=sc.mtp.spec(), name=sc.name)

    plan = aggregated_plan_for(sc, model, placed(1).aggregated[0].gpus)
    budget = draft_budget(sc, plan.validate(model, topo), plan, topo)
    dep = placed(max(1, budget.kv_capacity_tokens))
    # an engine calibration applies when it was fitted to this engine's aggregated runs (mixed steps); one fitted to
    # disaggregated prefill batches and decode steps does not describe a mixed step
    cm, calib, note = cost_model_for(sc, model, topo, plan, plan, engine_calibration=engine_calibration,
                                     mode="aggregated")
    # the parts a mixed step prices: DP ranks have no TP or EP-combine all-reduce, one TP group no all-to-all
    skip = ("prefill TP", "prefill EP combine") if plan.tp == 1 else ("decode dispatch/combine",)
    caveats = [c for c in calibration_caveats(calib, topo, model, plan, plan) if not c.startswith(skip)]
    return Built(sc, topo, model, dep, plan, plan, budget, budget, cm, calib, note, caveats)


def price_mixed(cm, plan, group):
    """The StepTime of a :class:`~engine.core.plans.MixedStep` on ``group`` for the scenario cost model ``cm``
    (its plans, calibration), memoised on the step's shape (the busiest decode contexts at ``cm.CTX_BITS``
    resolution: decode attention is priced per rank from totals anyway)."""
    from rackbed.sim.costs.mixed import mixed_step_time

    memo = cm.__dict__.setdefault("_mixed_memo", {})
    ctx = tuple(_bucket(c, cm.CTX_BITS) for c in plan.rank_context_tokens)
    key = (group.id, plan.rank_batch, ctx, plan.draft_k, tuple((r, s, n) for _, r, s, n in plan.prefill))
    st = memo.get(key)
    if st is None:
        chunks = [[] for _ in plan.rank_batch]
        for _, rank, start, n in plan.prefill:
            chunks[rank].append((n, start))
        st = memo[key] = mixed_step_time(cm.model, cm._plan_for(group), cm.topo, plan.rank_batch, ctx, chunks,
                                         draft_k=plan.draft_k, calib=cm.calib, **cm.draft)
    return st


def _bucket(x: int, bits: int) -> int:
    """``x`` with all but its top ``bits`` significant bits cleared, plus half the cleared range."""
    shift = int(x).bit_length() - bits
    return x if shift <= 0 else ((x >> shift) << shift) + (1 << (shift - 1))
