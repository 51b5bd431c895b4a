"""The step of an aggregated worker — decode batches and prefill chunks in one forward — and its capacity.

An aggregated worker (``engine.core.deployment.AggregatedGroup``) runs a *mixed* step: every sequence of a rank's
decode batch (``draft_k + 1`` query tokens each) and the rank's prefill chunks go through the model together. The
step is composed from the two step models of :mod:`sim.costs.step`, term by term:

* everything that sees tokens, not sequences — GEMMs (attention projections, routed and shared experts, dense
  MLPs, router), MoE dispatch/combine, all-reduces, norms, embeddings — is priced **once on the total tokens**
  (decode + prefill): weights are streamed once for the whole batch. With DP attention ranks (``plan.tp == 1``)
  that is the decode step model (DP-EP dispatch/combine, the busiest rank's tokens); with one TP group
  (``plan.dp == 1``) the prefill step model (TP all-reduces, EP on the replicated batch);
* attention cores are priced **per part** and added: the decode part as a decode step's (KV read per sequence,
  paged), the chunks as a prefill's (causal over new tokens, reading the cached prefix); with DP ranks the
  busiest rank's sum sets the step;
* the lm_head runs on the decode tokens plus one row per chunk (the last position of every scheduled sequence,
  as vLLM computes it); the host overhead is a prefill step's when the step prefills, else a decode step's;
* MTP drafting (``draft_k`` passes over the decode sequences) is the decode step model's draft terms.

:func:`mixed_step_breakdown` keeps the step models' term names (``attn_core`` splits into ``attn_core_decode`` and
``attn_core_prefill``). :func:`aggregated_operating_point` is a worker's steady state under a uniform load (how
search can compare aggregated against disaggregated analytically): the batch a rank keeps, the step it runs, and
the requests and tokens per second that follow.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rackbed.sim.costs.attention import (
    full_attention_decode_totals,
    full_attention_prefill,
    full_attention_projections,
    linear_attention_decode,
    linear_attention_prefill,
    linear_attention_projections,
    sliding_attention_decode_totals,
    sliding_attention_prefill,
)
from rackbed.sim.costs.breakdown import StepBreakdown, StepTime
from rackbed.sim.costs.calibration import CalibrationTable, host_step_s
from rackbed.sim.costs.gemm import gemm_time
from rackbed.sim.costs.step import decode_step_breakdown, layer_counts, prefill_step_breakdown
from rackbed.topology.errors import UserError

Chunks = Sequence[tuple[int, int]]  # (new_tokens, cached_tokens) per prefill chunk


def _attention(gpu, model, plan, n_seqs: int, ctx: float, chunks: Chunks, q: int, calib) -> dict[str, list]:
    """One rank's attention terms for the step (all layers): ``{step-model term: [(term, seconds)]}`` —
    projections on all the rank's tokens, cores per part."""
    tp, fmt = plan.tp, plan.weight_format
    nf, nl = layer_counts(model)[:2]
    n_tokens = n_seqs * q + sum(n for n, _ in chunks)
    out = {}
    ns = model.n_layers_of("sliding")
    if ns:
        kw = {"tp": tp, "fmt": fmt, "calib": calib}
        dec = sliding_attention_decode_totals(gpu, model, n_seqs, ctx, q_per_seq=q, kv_elem_bytes=plan.kv_elem_bytes,
                                              page_tokens=plan.page_tokens, **kw).core_s if n_seqs else 0.0
        pf = sliding_attention_prefill(gpu, model, chunks, **kw).core_s if chunks else 0.0
        proj = full_attention_projections(gpu, model, n_tokens, kind="sliding", **kw).total_s
        out["sliding_attn_proj"] = [("sliding_attn_proj", ns * proj)]
        out["sliding_attn_core"] = [("sliding_attn_core_decode", ns * dec), ("sliding_attn_core_prefill", ns * pf)]
    nm = model.n_layers_of("mla")
    if nm:
        out.update(_mla_mixed(gpu, model, plan, nm, n_seqs, ctx, chunks, q, calib))
    if nf:
        dec = full_attention_decode_totals(gpu, model, n_seqs, ctx, tp=tp, fmt=fmt, q_per_seq=q,
                                           kv_elem_bytes=plan.kv_elem_bytes, page_tokens=plan.page_tokens,
                                           calib=calib).core_s if n_seqs else 0.0
        pf = full_attention_prefill(gpu, model, chunks, tp=tp, fmt=fmt, calib=calib).core_s if chunks else 0.0
        proj = full_attention_projections(gpu, model, n_tokens, tp=tp, fmt=fmt, calib=calib).total_s
        out["attn_proj"] = [("attn_proj", nf * proj)]
        out["attn_core"] = [("attn_core_decode", nf * dec), ("attn_core_prefill", nf * pf)]
    if nl:
        dec = linear_attention_decode(gpu, model, n_seqs, tp=tp, fmt=fmt, q_per_seq=q,
                                      calib=calib).core_s if n_seqs else 0.0
        pf = linear_attention_prefill(gpu, model, chunks, tp=tp, fmt=fmt, calib=calib).core_s if chunks else 0.0
        proj = linear_attention_projections(gpu, model, n_tokens, tp=tp, fmt=fmt, calib=calib).total_s
        out["linear_attn_proj"] = [("linear_attn_proj", nl * proj)]
        out["linear_attn_core"] = [("linear_attn_core", nl * (dec + pf))]
    return out


def _mla_mixed(gpu, model, plan, nm: int, n_seqs: int, ctx: float, chunks: Chunks, q: int, calib) -> dict[str, list]:
    """MLA layers of a mixed step: q_a / q_b / kv_a / o on all the rank's tokens, kv_b on the chunks' new tokens
    (expanded prefill), the absorbed W_UK / W_UV on the decode tokens; cores per part (absorbed decode over the
    latent, expanded prefill) and the kv_b up-projection of the chunks' cached tokens."""
    from rackbed.sim.costs.mla import mla_decode_totals, mla_prefill, mla_projections

    tp, fmt = plan.tp, plan.weight_format
    att = model.mixer("mla")
    n_new = sum(n for n, _ in chunks)
    proj = mla_projections(gpu, model, n_seqs * q + n_new, tp=tp, fmt=fmt, phase="decode", calib=calib).total_s
    dec = mla_decode_totals(gpu, model, n_seqs, ctx, tp=tp, fmt=fmt, q_per_seq=q, kv_elem_bytes=plan.kv_elem_bytes,
                            page_tokens=plan.page_tokens, calib=calib) if n_seqs else None
    pf = mla_prefill(gpu, model, chunks, tp=tp, fmt=fmt, calib=calib) if chunks else None
    if n_new:
        h = att.local_heads(tp)
        proj += gemm_time(gpu, n_new, h * (att.qk_nope_head_dim + att.v_head_dim), att.kv_lora_rank, fmt,
                          calib=calib).total_s
    parts = dict(dec.parts if dec else ()) | dict(pf.parts if pf else ())
    return {"mla_proj": [("mla_proj", nm * proj)],
            "mla_core": [("mla_core_decode", nm * (dec.core_s if dec else 0.0)),
                         ("mla_core_prefill", nm * (pf.core_s if pf else 0.0))],
            "mla_absorb": [("mla_absorb", nm * parts.get("absorb", 0.0))],
            "mla_kv_up": [("mla_kv_up", nm * parts.get("kv_up", 0.0))]}


def mixed_step_breakdown(model, plan, topo, rank_batch: Sequence[int], rank_context_tokens: Sequence[float],
                         rank_chunks: Sequence[Chunks], *, draft_k: int = 0, n_mtp_layers: int | None = None,
                         draft_model=None, calib: CalibrationTable | None = None) -> StepBreakdown:
    """Term by term, the mixed step of an aggregated worker whose plan is ``plan`` (module docstring).
    ``rank_batch[r]`` / ``rank_context_tokens[r]``: decoding sequences of DP rank ``r`` and their KV tokens;
    ``rank_chunks[r]``: its prefill chunks ``(new_tokens, cached_tokens)``; ``n_mtp_layers`` / ``draft_model``:
    what drafts (``sim.costs.step.decode_step_breakdown``)."""
    if plan.tp > 1 and plan.dp > 1:
        raise UserError(f"aggregated step cost model covers tp == 1 (DP attention) or dp == 1 (one TP group), "
                        f"got tp={plan.tp}, dp={plan.dp}")
    if len(rank_batch) != plan.dp or len(rank_chunks) != plan.dp:
        raise UserError(f"rank_batch and rank_chunks need one entry per DP rank ({plan.dp})")
    if plan.tp > 1 and draft_k:
        raise UserError("aggregated step cost model: MTP drafting is priced for DP attention ranks (tp == 1) only")
    gpu = topo.gpu_spec(plan.gpus[0])
    q = draft_k + 1
    tokens = [b * q + sum(n for n, _ in c) for b, c in zip(rank_batch, rank_chunks)]
    if not any(tokens):
        return StepBreakdown({})
    if plan.tp == 1:  # DP attention ranks: the decode model on every rank's tokens (one query token each)
        base = decode_step_breakdown(model, plan, topo, tokens, rank_context_tokens, draft_k=0, calib=calib)
    else:             # one TP group: the prefill model on the batch as one sequence of all its tokens
        base = prefill_step_breakdown(model, plan, topo, [(tokens[0], 0)], calib=calib)
    over = max((_attention(gpu, model, plan, b, ctx, c, q, calib)
                for b, ctx, c in zip(rank_batch, rank_context_tokens, rank_chunks)),
               key=lambda a: sum(s for terms in a.values() for _, s in terms))  # the busiest rank's
    rows = max(b * q + len(c) for b, c in zip(rank_batch, rank_chunks))
    over["lm_head"] = [("lm_head", gemm_time(gpu, rows, model.vocab, model.hidden, "bf16", calib=calib).total_s)]
    seqs = max(b + len(c) for b, c in zip(rank_batch, rank_chunks))
    phase = "prefill" if any(rank_chunks) else "decode"
    over["host"] = [("host", host_step_s(calib, gpu, phase, seqs))]
    terms: dict[str, tuple[str, float]] = {}
    for name, (cat, s) in base.terms.items():
        for new_name, new_s in over.get(name, [(name, s)]):
            terms[new_name] = (cat, new_s)
    for name in over.keys() - base.terms.keys():  # a part only one phase has (MLA: kv_up in prefill, absorb in decode)
        for new_name, new_s in over[name]:
            if new_s:
                terms[new_name] = ("attn_s", new_s)
    if draft_k and any(rank_batch):
        drafts = decode_step_breakdown(model, plan, topo, rank_batch, rank_context_tokens, draft_k=draft_k,
                                       n_mtp_layers=n_mtp_layers, draft_model=draft_model, calib=calib)
        terms.update({k: v for k, v in drafts.terms.items() if k.startswith(("mtp_", "draft_"))})
    return StepBreakdown(terms)


def mixed_step_time(model, plan, topo, rank_batch, rank_context_tokens, rank_chunks, **kw) -> StepTime:
    """``mixed_step_breakdown(...).to_steptime()``."""
    return mixed_step_breakdown(model, plan, topo, rank_batch, rank_context_tokens, rank_chunks, **kw).to_steptime()


@dataclass(frozen=True)
class OperatingPoint:
    """An aggregated worker's steady state under a uniform load (:func:`aggregated_operating_point`)."""

    batch_per_rank: float          # sequences decoding on a rank
    prefill_tokens_per_rank: int   # prompt tokens a rank prefills per step
    step_s: float
    requests_per_s: float          # of the whole worker
    output_tokens_per_s: float
    tpot_s: float                  # step time / tokens a sequence gains per step


def aggregated_operating_point(model, plan, topo, *, prompt_tokens: int, output_tokens: int,
                               max_batch_per_rank: int, max_batch_tokens: int, chunk_tokens: int | None,
                               draft_k: int = 0, tokens_per_step: float = 1.0,
                               calib: CalibrationTable | None = None, cached_tokens: int = 0) -> OperatingPoint:
    """The step an aggregated worker settles into when every request has ``prompt_tokens`` / ``output_tokens``
    and the worker is never short of work: each rank decodes ``B`` sequences, which finish at ``B × e / O`` per
    step (``e = tokens_per_step``, MTP included), so as many prompts (``B × e × P / O`` tokens) must be prefilled
    per step in the room the decode tokens leave in the budget: ``B`` is the cap, or smaller when that room is
    what limits it (``B × (1 + k) + B × e × P / O = budget``). The step is priced at contexts half way through
    the outputs and prefill chunks of ``chunk_tokens`` (whole prompts when None) half way through their prompts.
    ``cached_tokens`` of each prompt come from a prefix cache: only the rest is prefilled (and takes budget), its
    whole chunks start after the cached context (the leftover chunk stays at position 0, as without a cache, so that
    a cache never prices a step dearer); decode contexts are whole prompts.
    """
    if min(prompt_tokens, output_tokens, max_batch_per_rank, max_batch_tokens) < 1 or tokens_per_step <= 0:
        raise UserError("aggregated_operating_point: tokens, batch and budget must be >= 1")
    if not 0 <= cached_tokens < prompt_tokens:
        raise UserError("aggregated_operating_point: cached_tokens must be in [0, prompt_tokens)")
    new = prompt_tokens - cached_tokens
    q = draft_k + 1
    per_seq = q + tokens_per_step * new / output_tokens  # budget tokens one decoding sequence costs
    b = min(float(max_batch_per_rank), max_batch_tokens / per_seq)
    nb = max(1, round(b))
    pf = max(1, round(b * tokens_per_step * new / output_tokens))
    size = min(new, chunk_tokens or new)
    chunks = [(size, cached_tokens + (new // 2 if size < new else 0))] * (pf // size)
    if pf % size:
        chunks.append((pf % size, 0))
    ctx = nb * (prompt_tokens + output_tokens / 2)
    st = mixed_step_time(model, plan, topo, [nb] * plan.dp, [ctx] * plan.dp, [chunks] * plan.dp,
                         draft_k=draft_k, calib=calib)
    reqs = plan.dp * b * tokens_per_step / output_tokens / st.total_s
    return OperatingPoint(batch_per_rank=b, prefill_tokens_per_rank=pf, step_s=st.total_s, requests_per_s=reqs,
                          output_tokens_per_s=reqs * output_tokens, tpot_s=st.total_s / tokens_per_step)
