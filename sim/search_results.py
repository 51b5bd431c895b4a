"""Reading simulated points — a search's or a sweep's records: which meet the SLOs, their Pareto front of tokens/s
per GPU vs tokens/s per user, where a point's step time goes, and the tables of a search's report (per knob value,
per prefill option, per decode option, per pruning reason)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from rackbed.sim.pareto import pareto_indices

if TYPE_CHECKING:
    from rackbed.sim.search import SearchResult


def meets_slo(rec: Mapping, ttft_s: float | None, tpot_s: float | None, percentile: str = "p90") -> bool:
    """An ``ok`` record whose every request completed and whose TTFT / TPOT at ``percentile`` meet the bounds
    (a None bound always holds; a run with no multi-token request has no TPOT and passes it)."""
    if rec.get("status") != "ok":
        return False
    s = rec["summary"]
    if not s.get("done") or s.get("done") != s.get("requests"):
        return False
    ttft = s.get(f"ttft_{percentile}_s")
    tpot = s.get(f"tpot_{percentile}_s")
    if ttft_s is not None and (ttft is None or ttft > ttft_s):
        return False
    if tpot_s is not None and tpot is not None and tpot > tpot_s:
        return False
    return s.get("tokens_per_s_per_gpu") is not None and s.get("tokens_per_s_per_user") is not None


def record_slo(rec: Mapping) -> tuple[float | None, float | None]:
    """The SLO bounds a record's own scenario had (from its metrics' goodput section)."""
    g = (rec.get("metrics") or {}).get("goodput") or {}
    return g.get("slo_ttft_s"), g.get("slo_tpot_s")


#: search objectives: the summary field maximised against tokens/s per user
#: the record figure each objective maximises; ``usd``: output tokens/s per $ per hour, the budget search's
#: on a topology of several GPU models (``sim.budget.priced``)
OBJECTIVES = {"gpu": "tokens_per_s_per_gpu", "kw": "tokens_per_s_per_kw", "usd": "tokens_per_s_per_usd_hour"}


def front_of(records: Sequence[Mapping], objective: str = "gpu") -> list[Mapping]:
    """Records on the Pareto front of (tokens/s per GPU — or per kW with ``objective="kw"`` —, tokens/s per
    user), both maximised; records without the objective's figure (no power model) are left out."""
    key = OBJECTIVES[objective]
    records = [r for r in records if r["summary"].get(key) is not None]
    vals = [(r["summary"][key], r["summary"]["tokens_per_s_per_user"]) for r in records]
    return [records[i] for i in pareto_indices(vals)]


def explain(scenario: Mapping, rec: Mapping | None = None) -> dict:
    """Where time goes for a point: its prefill step (a full batch of the mean prompt) and decode step (at the
    simulated mean batch per rank when ``rec`` has metrics, else at the batch cap) as StepBreakdowns in a JSON-able
    dict ``{"prefill": {...}, "decode": {...}}`` with ``at`` (the step evaluated), ``total_s``, ``by_category``
    (StepTime fields), ``terms`` (seconds per named term) and, for a step with overlap, ``hidden``."""
    from rackbed.sim.scenario import build, parse_scenario

    sc = parse_scenario(dict(scenario))
    b = build(sc)
    cm = b.cost_model  # what the simulation priced the point with
    m = (rec or {}).get("metrics") or {}
    th = m.get("throughput") or {}
    rps = th.get("requests_per_s") or 0
    prompt = (th.get("input_tokens_per_s") or 0) / rps if rps else 0
    output = (th.get("output_tokens_per_s") or 0) / rps if rps else 0
    if not prompt:
        from rackbed.engine.core.workload import WorkloadStats, generate

        st = WorkloadStats.from_requests(generate(sc.workload, sc.seed))
        prompt, output = st.prompt_tokens_mean, st.output_tokens_mean
    out: dict[str, Any] = {}
    mbt = sc.prefill.max_batch_tokens
    each = max(1, min(round(prompt), mbt) if sc.sim.chunked_prefill else round(prompt))  # as prefill_options
    n_seqs = max(1, mbt // each)
    pb = cm.prefill_breakdown([(each, 0)] * n_seqs)
    out["prefill"] = _bd_dict(pb, f"{n_seqs} x {each}-token prompts (TP={sc.prefill.tp}, EP={sc.prefill.ep})")
    dec = m.get("decode") or {}
    ep = sc.decode.ep
    n_groups = max(1, sc.decode.replicas)
    if dec.get("steps"):
        per_group_step = dec["sequence_steps"] / dec["steps"]
        bsz = max(1, round(per_group_step / ep))
        how = "simulated mean"
    else:
        bsz, how = sc.decode.max_batch_per_rank, "batch cap"
    _ = n_groups
    ctx = prompt + output / 2
    db = cm.decode_breakdown(bsz, bsz * ctx, sc.mtp.draft_k)
    out["decode"] = _bd_dict(db, f"{bsz} seqs/rank ({how}) x {ctx:.0f} ctx tokens, EP={ep}, MTP k={sc.mtp.draft_k}")
    return out


def _bd_dict(bd, at: str) -> dict:
    """A breakdown as JSON-able data; ``hidden`` (seconds of each term run under another stream,
    ``sim.costs.overlap``) only for a step with overlap."""
    out = {"at": at, "total_s": bd.total_s, "by_category": bd.by_category(), "terms": bd.seconds()}
    if bd.hidden:
        out["hidden"] = dict(bd.hidden)
    return out


def where_time_goes(bd: Mapping, n_terms: int = 3) -> str:
    """One line: the categories' shares and the biggest terms of a breakdown dict from :func:`explain`."""
    tot = bd["total_s"] or 1e-30
    cats = sorted(bd["by_category"].items(), key=lambda kv: -kv[1])
    terms = sorted(bd["terms"].items(), key=lambda kv: -kv[1])[:n_terms]
    c = ", ".join(f"{k[:-2]} {v / tot:.0%}" for k, v in cats if v > 0)
    t = ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in terms)
    hid = sum((bd.get("hidden") or {}).values())
    more = f"; {hid * 1e3:.2f} ms hidden by overlap" if hid else ""
    return f"{bd['total_s'] * 1e3:.2f} ms: {c} (top: {t}){more}"


# ------------------------------------------------------------------------------------------------------------------
# The tables of a search's report


def axis_table(res: SearchResult) -> list[dict]:
    """For each knob with more than one candidate value: per value, the analytic best and the simulated best
    eligible point (tokens/s per GPU, and at tokens/s per user >= the median of all eligible points) — the numbers
    behind comparisons like "TP=4 beats TP=8" or "EP16 beats EP8"."""
    import statistics

    axes = {"topology": "topology", "weight_format": "weight_format", "prefill TP/EP": None,
            "decode.ep": "decode.ep", "decode.max_batch_per_rank": "decode.max_batch_per_rank",
            "mtp.draft_k": "mtp.draft_k", "decode.tp": "decode.tp", "kv_dtype": "kv_dtype"}
    unset = {"decode.tp": 1, "kv_dtype": res.spec.kv_dtype}  # overrides left out at these values
    elig_keys = {r["key"] for r in res.eligible}
    u_med = statistics.median([r["summary"]["tokens_per_s_per_user"] for r in res.eligible]) if res.eligible else None
    rows = []
    for axis, path in axes.items():
        def val(ov, path=path):
            return f"TP={ov['prefill.tp']}/EP={ov['prefill.ep']}" if path is None else ov.get(path, unset.get(path))

        values = sorted({val(c.overrides) for c in res.candidates}, key=str)
        if len(values) < 2:
            continue
        for v in values:
            cs = [c for c in res.candidates if val(c.overrides) == v]
            alive = [c for c in cs if c.pruned is None]
            sim = [r for r, c in zip(res.records, res.simulated) if val(c.overrides) == v and r["key"] in elig_keys]
            row = {"axis": axis, "value": v, "candidates": len(cs), "pruned": len(cs) - len(alive),
                   "simulated": sum(1 for c in res.simulated if val(c.overrides) == v), "eligible": len(sim)}
            if axis == "prefill TP/EP" and alive:
                po = max((c.prefill for c in alive), key=lambda o: o.capacity_tokens_per_s)
                row["est_prefill_input_tokens_per_s_per_gpu"] = po.capacity_tokens_per_s / max(po.tp, po.ep)
                row["est_ttft_floor_s"] = po.ttft_floor_s
            if alive:
                a = max(alive, key=lambda c: c.est_tokens_per_s_per_gpu)
                row["est_best_tokens_per_s_per_gpu"] = a.est_tokens_per_s_per_gpu
                row["est_best_tokens_per_s_per_user"] = a.est_tokens_per_s_per_user
            else:
                reasons = sorted({c.pruned for c in cs if c.pruned})
                row["pruned_because"] = reasons[0] if reasons else ""
            if sim:
                s = max(sim, key=lambda r: r["summary"]["tokens_per_s_per_gpu"])
                row["sim_best_tokens_per_s_per_gpu"] = s["summary"]["tokens_per_s_per_gpu"]
                row["sim_best_tokens_per_s_per_user"] = s["summary"]["tokens_per_s_per_user"]
                row["sim_best_label"] = s.get("candidate")
                if u_med is not None:
                    fast = [r for r in sim if r["summary"]["tokens_per_s_per_user"] >= u_med]
                    if fast:
                        row["sim_best_tokens_per_s_per_gpu_at_median_user"] = max(
                            r["summary"]["tokens_per_s_per_gpu"] for r in fast)
                row["median_user_tokens_per_s"] = u_med
            rows.append(row)
    return rows


def prefill_table(res: SearchResult) -> list[dict]:
    """Per prefill option: the analytic TTFT floor, capacity per GPU and the step's split — the numbers behind
    "TP=4/EP=4 beats TP=8/EP=8" (input tokens/s per GPU at the same batch)."""
    rows = []
    for o in res.prefill:
        row = {"topology": o.topology, "weight_format": o.weight_format, "tp": o.tp, "ep": o.ep,
               "max_batch_tokens": o.max_batch_tokens, "ttft_floor_s": o.ttft_floor_s, "pruned": o.pruned or ""}
        if o.breakdown is not None:
            n = max(o.tp, o.ep)
            row.update(step_s=o.breakdown.total_s, batch=f"{o.batch[0]} x {o.batch[1]}",
                       input_tokens_per_s_per_gpu=o.capacity_tokens_per_s / n, replicas=o.replicas,
                       **{k: v for k, v in o.breakdown.by_category().items()})
            if o.cache_blocks:  # a prefix cache: the hit rate the capacity assumes (sim.search._size_prefill)
                row.update(prefix_hit_rate=o.hit_rate, prefix_cache_blocks=o.cache_blocks)
        rows.append(row)
    return rows


def decode_table(res: SearchResult) -> list[dict]:
    """Per decode option at its batch cap (equal batch per rank across EP degrees): step time, TPOT, tokens/s per
    user and per decode GPU, and the step's split — the numbers behind "EP16 beats EP8 on GB200" and "EP16 over
    EFA loses to EP8 on H200"."""
    from rackbed.engine.core.specdec import expected_tokens_per_step
    from rackbed.sim.search import base_scenario

    curve = (base_scenario(res.spec).get("mtp") or {}).get("acceptance")  # a curve the spec's scenario gives
    rows = []
    for o in res.decode:
        row = {"topology": o.topology, "weight_format": o.weight_format, "ep": o.ep, "cap": o.max_batch_per_rank,
               "draft_k": o.draft_k, "b": o.b_max, "pruned": o.pruned or ""}
        bd = o.breakdown_at_cap
        if bd is not None:
            e = expected_tokens_per_step(o.draft_k, res.spec.mtp_accept_p, curve)
            tpot = bd.total_s / e
            row.update(step_s=bd.total_s, tpot_s=tpot, tokens_per_s_per_user=1.0 / tpot,
                       tokens_per_s_per_decode_gpu=o.b_max / tpot, **bd.by_category())
        rows.append(row)
    return rows


def prune_summary(res: SearchResult) -> dict[str, int]:
    """How many candidates each pruning reason removed (reasons with numbers stripped to group alike ones)."""
    out: dict[str, int] = {}
    for c in res.candidates:
        if c.pruned:
            k = normalise_reason(c.pruned)
            out[k] = out.get(k, 0) + 1
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))


def normalise_reason(reason: str) -> str:
    """A pruning reason with its standalone numbers replaced by ``N`` (to group alike reasons); digits inside
    names — ``hgx-h200``, ``fp8``, ``TP4``, ``p90`` — stay, so the grouped reason still names what it is about."""
    import re

    return re.sub(r"(?<![A-Za-z0-9_.])[0-9][0-9.,]*(?![A-Za-z0-9_.,])", "N", reason)
