"""The parallelism of a disaggregated scenario's groups: their ``ParallelPlan``\\ s and the rules across sections.

A **prefiller** is ``max(tp, ep)`` GPUs of one node: attention TP over ``tp`` of them, the experts over ``ep``
(``tp > ep``: each expert's intermediate dimension split ``tp / ep`` ways, expert TP). ``tp < ep`` (attention DP
groups inside a prefiller) is refused there: the TP prefill cost model prices one TP group with a replicated batch.
With ``span_nodes`` a prefiller or decoder is whole nodes instead (``max(tp, ep) / node size`` of them), and a
spanning prefiller may have ``tp < ep``: ``ep / tp`` DP attention ranks, EP over all its GPUs across nodes
(``sim.costs.step.dp_prefill_step_breakdown``). A **decoder** is ``ep`` GPUs of one NVLink domain:
``ep / tp`` DP attention ranks of ``tp`` GPUs each (attention TP x DP, TRT-LLM's and SGLang's "attention TP"
inside "attention DP"), the experts over all ``ep`` GPUs — ``n_experts + redundant_experts`` expert slots, which
``ep`` must divide (wide EP: DeepSeek-V3's 256 experts over 72 GPUs need 32 redundant, 288 = 72 x 4). ``tp = 1`` (the default) is pure DP attention, one GPU
per rank.

:func:`check_parallel` names the first violated rule as one line (``decode.tp: ...``) before the plans are built;
``ParallelPlan.check_structure`` and the memory budget then check the rest against the topology.
"""

from __future__ import annotations

from rackbed.engine.core.sharding import min_redundant_experts
from rackbed.topology.errors import UserError


def _kv_replication(model, tp: int) -> int:
    return model.mixer("full").kv_replication(tp)


def check_parallel(sc, model) -> None:
    """The prefill / decode parallelism rules that name a scenario field; a one-line ``UserError``."""
    p, d = sc.prefill, sc.decode
    rules = []
    for role, tp in (("prefill", p.tp), ("decode", d.tp)):
        for mixer in _mixers(model):
            try:
                mixer.check_tp(tp, _kv_replication(model, tp) if role == "decode" or p.kv_replication is None
                               else p.kv_replication, model.name)
            except UserError as exc:
                raise UserError(f"{role}.tp: {exc}") from None
    rules.append((model.n_experts and model.n_experts % p.ep,
                  f"prefill.ep: {p.ep} does not divide the {model.n_experts} experts of {model.name}"))
    slots = model.n_experts + d.redundant_experts
    need = min_redundant_experts(model.n_experts, d.ep)
    rules += [
        (d.redundant_experts and not model.n_experts,
         f"decode.redundant_experts: {model.name} has no routed experts to replicate"),
        (model.n_experts and not d.redundant_experts and model.n_experts % d.ep,
         f"decode.ep: {d.ep} does not divide the {model.n_experts} experts of {model.name}"
         + (f" (decode.redundant_experts: {need} gives {model.n_experts + need} = {d.ep} x "
            f"{(model.n_experts + need) // d.ep} expert slots)" if need else "")),
        (model.n_experts and d.redundant_experts and slots % d.ep,
         f"decode.redundant_experts: ep = {d.ep} does not divide the {model.n_experts} experts + "
         f"{d.redundant_experts} redundant = {slots} expert slots of {model.name}"
         + (f" (redundant_experts: {need} gives {model.n_experts + need})" if need else "")),
    ]
    rules += [
        (d.ep % d.tp, f"decode.tp: {d.tp} does not divide the decoder's ep = {d.ep} GPUs (dp = ep / tp ranks)"),
        (p.tp < p.ep and not p.span_nodes,
         f"prefill.ep: {p.ep} exceeds prefill.tp: {p.tp}; a prefiller runs its experts over its TP GPUs "
         f"(ep < tp is expert TP; tp < ep makes ep / tp attention DP groups, priced only for a prefiller spanning "
         f"nodes, prefill.span_nodes: true): use ep <= tp, e.g. tp: {p.ep}, ep: {p.ep}"),
        (p.tp < p.ep and p.overlap not in ("none", "two_batch"),
         f"prefill.overlap: {p.overlap} is not priced for DP attention groups (tp = {p.tp} < ep = {p.ep}); use "
         "two_batch or none"),
        (max(p.tp, p.ep) % min(p.tp, p.ep),
         f"prefill.tp: tp = {p.tp} and ep = {p.ep} must divide one another (the group is max(tp, ep) GPUs)"),
        (p.tp > p.ep and model.n_experts and model.moe_intermediate % (p.tp // p.ep),
         f"prefill.tp: expert TP = tp / ep = {p.tp // p.ep} does not divide moe_intermediate "
         f"{model.moe_intermediate} of {model.name}"),
    ]
    for broken, msg in rules:
        if broken:
            raise UserError(msg)


def _mixers(model) -> tuple:
    return (model.mixer("full"),) + tuple(a for a, _ in model.attention_counts() if a.kind != "full")


def prefill_plan_for(sc, model, gpus):
    """The ParallelPlan of a prefiller group of the scenario on ``gpus`` (what ``build`` gives group 0)."""
    from rackbed.engine.core.sharding import ParallelPlan

    p = sc.prefill
    kv_rep = p.kv_replication or _kv_replication(model, p.tp)
    dp = max(1, max(p.tp, p.ep) // p.tp)
    # the group's token budget is dealt over its DP ranks (sim.costs.step.deal_seqs): a rank's share sizes its memory
    return ParallelPlan(role="prefill", tp=p.tp, ep=p.ep, dp=dp, kv_replication=kv_rep,
                        gpus=tuple(gpus), weight_format=sc.weight_format, kv_dtype=sc.kv_dtype,
                        page_tokens=sc.decode.page_tokens, max_batch_tokens=-(-p.max_batch_tokens // dp),
                        overlap=p.overlap)


def decode_plan_for(sc, model, gpus):
    """The ParallelPlan of a decoder group of the scenario on ``gpus`` (what ``build`` gives group 0): ``ep``
    GPUs, ``dp = ep / tp`` DP ranks of ``tp`` GPUs (KV heads split over a rank's GPUs, replicated beyond the model's
    KV heads), ``max_batch_per_rank`` sequences per DP rank."""
    from rackbed.engine.core.sharding import ParallelPlan

    d = sc.decode
    return ParallelPlan(role="decode", tp=d.tp, ep=d.ep, dp=d.ep // d.tp, kv_replication=_kv_replication(model, d.tp),
                        gpus=tuple(gpus), weight_format=sc.weight_format, kv_dtype=sc.kv_dtype,
                        page_tokens=d.page_tokens, max_batch_seqs=d.max_batch_per_rank,
                        redundant_experts=d.redundant_experts, overlap=d.overlap, moe_comm=d.moe_comm)
