"""``rackbed search``: which deployment, for this model, hardware, traffic and SLOs — and what a token costs.

    rackbed search scenarios/sweeps/search-qwen235-gb200.yaml --jobs 2
    rackbed search --model qwen3-235b-a22b --topology gb200-nvl72 --format mxfp8 --rate 20 --prompt 4000 \\
        --output 400 --duration 30 --ttft 2 --tpot 0.05 --gpu-hour-usd 6

Enumerates candidates, prunes them with the memory budget and the analytic step-time model, simulates the
survivors (parallel, resumable: DIR/results.jsonl), prints the Pareto front's best few with where their step
time goes, and writes DIR/report.md / report.html / pareto.png (see ``sim.search``).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rackbed.topology.outputs import add_force, prepare_dir, safe_name


def _ints(s: str) -> list[int]:
    try:
        return [int(x) for x in s.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from None


def _strs(s: str) -> list[str]:
    return [x for x in s.split(",") if x]


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "search",
        help="find the Pareto-best deployments (tokens/s per GPU vs per user) for a load and SLOs",
        description="Enumerate deployments, prune with the memory budget and the analytic step-time model, "
        "simulate the survivors, report the Pareto front of tokens/s per GPU vs tokens/s per user with the cost "
        "per million tokens and where the step time goes. Give a search spec YAML, or the flags.",
    )
    p.add_argument("spec", nargs="?", help="search spec YAML (kind: search) or a name under scenarios/sweeps/")
    p.add_argument("--model", default="qwen3-235b-a22b")
    p.add_argument("--topology", type=_strs, default=["gb200-nvl72"], help="comma-separated topology names")
    p.add_argument("--format", dest="weight_format", type=_strs, default=["mxfp8"], help="comma-separated formats")
    p.add_argument("--rate", type=float, default=None, help="requests/s (Poisson)")
    p.add_argument("--prompt", type=int, default=4000, help="prompt tokens (fixed)")
    p.add_argument("--output", type=int, default=400, help="output tokens (fixed)")
    p.add_argument("--duration", type=float, default=30.0, help="seconds of arrivals simulated per point")
    p.add_argument("--ttft", type=float, default=2.0, help="TTFT SLO, seconds (p90)")
    p.add_argument("--tpot", type=float, default=0.05, help="TPOT SLO, seconds (p90)")
    p.add_argument("--gpu-hour-usd", type=float, default=0.0, help="price of one GPU-hour, for $/M tokens")
    p.add_argument("--prefill-tp", type=_ints, default=None, help="e.g. 2,4,8 (EP = TP)")
    p.add_argument("--decode-ep", type=_ints, default=None, help="e.g. 8,16,32")
    p.add_argument("--batch-cap", type=_ints, default=None, help="decode max batch per rank, e.g. 16,32,64")
    p.add_argument("--draft-k", type=_ints, default=None, help="MTP draft lengths, e.g. 0,1,2")
    p.add_argument("--max-simulations", type=int, default=None, help="cap on simulated survivors")
    p.add_argument("--top", type=int, default=None, help="best points to print and explain")
    p.add_argument("--out", type=Path, default=None, help="output folder (default rackbed-out/search-<name>)")
    add_force(p, "write into an existing, non-empty --out folder that is not a search's (one holding "
              "results.jsonl is resumed without it)")
    p.add_argument("--jobs", "-j", type=int, default=None, help="worker processes (default: CPU count)")
    p.add_argument("--ray-address", default=None, help="simulate on this Ray cluster (needs `ray` installed)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--no-report", action="store_true")
    p.set_defaults(func=_main)


def _main(args: argparse.Namespace) -> int:
    import os

    from rackbed.sim import search as se
    from rich.console import Console

    console = Console() if Console().is_terminal else Console(width=160)
    if args.spec:
        spec = se.load_search(args.spec)
        upd = {k: v for k, v in (("max_simulations", args.max_simulations), ("top", args.top)) if v is not None}
        if upd:
            spec = spec.model_copy(update=upd)
    else:
        if args.rate is None:
            raise ValueError("rackbed search: give a search spec YAML, or at least --rate (requests/s)")
        spec = se.spec_from_flags(model=args.model, topology=args.topology, weight_format=args.weight_format,
                                  rate_per_s=args.rate, prompt_tokens=args.prompt, output_tokens=args.output,
                                  duration_s=args.duration, ttft_s=args.ttft, tpot_s=args.tpot,
                                  gpu_hour_usd=args.gpu_hour_usd, prefill_tp=args.prefill_tp,
                                  decode_ep=args.decode_ep, max_batch_per_rank=args.batch_cap,
                                  draft_k=args.draft_k, max_simulations=args.max_simulations or 60,
                                  top=args.top or 5)
    out = prepare_dir(args.out or Path("rackbed-out") / f"search-{safe_name(spec.name)}", force=args.force,
                      resume_marker="results.jsonl")
    jobs = args.jobs or os.cpu_count() or 1
    res = se.run_search(spec, out, jobs=jobs, ray_address=args.ray_address, progress=not args.no_progress,
                        console=console)
    print_search(console, res)
    if not args.no_report:
        from rackbed.sim.report import write_report

        files = write_report(out, search_report_data(res))
        console.print(f"[dim]wrote {', '.join(str(f) for f in files)}[/dim]")
    return 0


def print_search(console, res) -> None:
    from rackbed.sim.report import fmt
    from rackbed.sim.search_results import axis_table, prune_summary, where_time_goes
    from rich.table import Table

    sp, ld = res.spec, res.load
    console.print(f"[bold]search {sp.name}[/bold]: {sp.model}; load {ld.rate_per_s:.3g} req/s, prompt "
                  f"{ld.prompt_mean:.0f} tok (p90 {ld.prompt_p90:.0f}), output {ld.output_mean:.0f} tok -> "
                  f"{ld.input_tokens_per_s:.4g} input / {ld.output_tokens_per_s:.4g} output tok/s; SLO TTFT "
                  f"{sp.slo.ttft_s} s, TPOT {sp.slo.tpot_s * 1e3:g} ms at {sp.slo.percentile}")
    alive = sum(1 for c in res.candidates if c.pruned is None)
    console.print(f"{len(res.candidates)} candidates, {len(res.candidates) - alive} pruned analytically, "
                  f"{len(res.simulated)} simulated ({_status_counts(res.records)}), {len(res.eligible)} meet the "
                  f"SLOs, {len(res.front)} on the front; {res.wall_s:.1f} s")
    for reason, n in list(prune_summary(res).items())[:6]:
        console.print(f"  [dim]pruned {n:4d}: {reason}[/dim]")
    t = Table(title="best points (Pareto front of tokens/s per GPU vs tokens/s per user)")
    for h in ("#", "configuration", "GPUs", "tok/s/GPU", "tok/s/user", "TTFT p90 ms", "TPOT p90 ms", "$/M tok",
              "est tok/s/GPU", "est tok/s/user"):
        t.add_column(h, justify="left" if h == "configuration" else "right")
    for i, r in enumerate(res.best, 1):
        s, e = r["summary"], r.get("est", {})
        t.add_row(str(i), r.get("candidate", r.get("label", "")), fmt(s["mean_gpus"], 3),
                  fmt(s["tokens_per_s_per_gpu"]), fmt(s["tokens_per_s_per_user"]),
                  fmt((s.get("ttft_p90_s") or 0) * 1e3), fmt((s.get("tpot_p90_s") or 0) * 1e3),
                  fmt(s.get("cost_per_mtok_usd"), 3), fmt(e.get("tokens_per_s_per_gpu")),
                  fmt(e.get("tokens_per_s_per_user")))
    console.print(t)
    for i, r in enumerate(res.best, 1):
        ex = res.explanations.get(r["key"]) or {}
        if "prefill" in ex:
            console.print(f"  #{i} why: prefill {where_time_goes(ex['prefill'])}")
            console.print(f"       decode  {where_time_goes(ex['decode'])}")
    for tab in option_tables(res):
        rt = Table(title=tab.title)
        for h in tab.headers:
            rt.add_column(h, justify="right")
        for row in tab.rows:
            rt.add_row(*(str(c) for c in row))
        console.print(rt)
    rows = axis_table(res)
    if rows:
        at = Table(title="per knob: best analytic estimate and best simulated point meeting the SLOs")
        for h in ("knob", "value", "cand.", "pruned", "sim.", "ok", "est tok/s/GPU", "sim tok/s/GPU",
                  "sim tok/s/user", "sim tok/s/GPU @ >= median user", "note"):
            at.add_column(h, justify="right")
        for row in rows:
            at.add_row(row["axis"], str(row["value"]), str(row["candidates"]), str(row["pruned"]),
                       str(row["simulated"]), str(row["eligible"]), fmt(row.get("est_best_tokens_per_s_per_gpu")),
                       fmt(row.get("sim_best_tokens_per_s_per_gpu")), fmt(row.get("sim_best_tokens_per_s_per_user")),
                       fmt(row.get("sim_best_tokens_per_s_per_gpu_at_median_user")),
                       _note(row))
        console.print(at)
    inv = [r for r in res.records if r.get("status") == "invalid"]
    if inv:
        reasons: dict[str, int] = {}
        for r in inv:
            reasons[r["reason"]] = reasons.get(r["reason"], 0) + 1
        for reason, n in sorted(reasons.items(), key=lambda kv: -kv[1])[:4]:
            console.print(f"  [yellow]invalid in simulation ({n}):[/yellow] {reason}")


def option_tables(res):
    """The analytic prefill and decode options as ``sim.report.Table``s (pruned ones with their reason)."""
    from rackbed.sim.report import Table, fmt
    from rackbed.sim.search_results import decode_table, prefill_table

    def ms(x):
        return fmt(None if x is None else x * 1e3)

    multi_topo = len(res.spec.space.topology) > 1 or len(res.spec.space.weight_format) > 1
    pre = Table("Prefill options (analytic): a full batch of mean prompts; capacity = input tokens/s per GPU",
                ["topology/format", "TP", "EP", "TTFT floor ms", "batch", "step ms", "input tok/s/GPU",
                 "replicas", "attn ms", "moe_gemm ms", "a2a ms", "allreduce ms", "other ms", "pruned"],
                [[f"{r['topology']}/{r['weight_format']}" if multi_topo else r["topology"], r["tp"], r["ep"],
                  ms(r["ttft_floor_s"]), r.get("batch", "-"), ms(r.get("step_s")),
                  fmt(r.get("input_tokens_per_s_per_gpu")), r.get("replicas", "-"), ms(r.get("attn_s")),
                  ms(r.get("moe_gemm_s")), ms(r.get("a2a_s")), ms(r.get("allreduce_s")), ms(r.get("other_s")),
                  r["pruned"][:70]] for r in prefill_table(res)])
    dec = Table("Decode options (analytic) at the batch cap, i.e. equal batch per rank across EP degrees",
                ["topology/format", "EP", "cap", "k", "batch/rank", "step ms", "TPOT ms", "tok/s/user",
                 "tok/s/decode GPU", "attn ms", "moe_gemm ms", "a2a ms", "other ms", "pruned"],
                [[f"{r['topology']}/{r['weight_format']}" if multi_topo else r["topology"], r["ep"], r["cap"],
                  r["draft_k"], r["b"], ms(r.get("step_s")), ms(r.get("tpot_s")), fmt(r.get("tokens_per_s_per_user")),
                  fmt(r.get("tokens_per_s_per_decode_gpu")), ms(r.get("attn_s")), ms(r.get("moe_gemm_s")),
                  ms(r.get("a2a_s")), ms(r.get("other_s")), r["pruned"][:70]] for r in decode_table(res)])
    return [pre, dec]


def _note(row) -> str:
    if "est_prefill_input_tokens_per_s_per_gpu" in row:
        return (f"prefill capacity {row['est_prefill_input_tokens_per_s_per_gpu']:.4g} input tok/s/GPU, "
                f"TTFT floor {row['est_ttft_floor_s'] * 1e3:.0f} ms")
    return row.get("pruned_because", "")[:80]


def _status_counts(records) -> str:
    c: dict[str, int] = {}
    for r in records:
        c[r.get("status", "?")] = c.get(r.get("status", "?"), 0) + 1
    return ", ".join(f"{k} {v}" for k, v in sorted(c.items()))


def search_report_data(res):
    """``sim.report.ReportData`` of a search result (front, best, breakdowns, per-knob table, pruning)."""
    from rackbed.sim.report import ReportData, Table, fmt
    from rackbed.sim.search_results import axis_table, prune_summary

    sp, ld = res.spec, res.load
    rows = [[r["axis"], r["value"], r["candidates"], r["pruned"], r["simulated"], r["eligible"],
             fmt(r.get("est_best_tokens_per_s_per_gpu")), fmt(r.get("est_best_tokens_per_s_per_user")),
             fmt(r.get("sim_best_tokens_per_s_per_gpu")), fmt(r.get("sim_best_tokens_per_s_per_user")),
             fmt(r.get("sim_best_tokens_per_s_per_gpu_at_median_user")), _note(r)]
            for r in axis_table(res)]
    knob = Table("Per knob: best analytic estimate and best simulated point meeting the SLOs",
                 ["knob", "value", "candidates", "pruned", "simulated", "meet SLO", "est tok/s/GPU",
                  "est tok/s/user", "sim tok/s/GPU", "sim tok/s/user", "sim tok/s/GPU at >= median tok/s/user",
                  "note"], rows)
    prune = Table("Analytic pruning (reasons, numbers replaced by N)", ["reason", "candidates"],
                  [[k, v] for k, v in prune_summary(res).items()])
    varied = [k for k in ("decode.ep", "prefill.tp", "topology", "mtp.draft_k")
              if len({c.overrides[k] for c in res.simulated}) > 1]
    return ReportData(
        title=f"search {sp.name}: {sp.model}",
        intro=[sp.description,
               (f"load: {ld.rate_per_s:.3g} req/s, prompt {ld.prompt_mean:.0f} tokens (p90 {ld.prompt_p90:.0f}), "
                f"output {ld.output_mean:.0f} tokens; SLO TTFT <= {sp.slo.ttft_s} s and TPOT <= "
                f"{sp.slo.tpot_s * 1e3:g} ms at {sp.slo.percentile}; $/GPU-hour {sp.gpu_hour_usd}"),
               (f"{len(res.candidates)} candidates, {sum(c.pruned is not None for c in res.candidates)} pruned "
                f"analytically, {len(res.simulated)} simulated")],
        records=res.records, eligible={r["key"] for r in res.eligible}, front=res.front, best=res.best,
        explanations=res.explanations, color_by=varied[0] if varied else None,
        tables=[knob, *option_tables(res), prune],
        notes=[("tokens/s per GPU counts every allocated GPU (prefill and decode); tokens/s per user is the p50 "
                "of 1/TPOT; cost per million output tokens = $/GPU-hour / (3600 x tokens/s per GPU) x 1e6"),
               "est = the analytic estimate the pruning used (replicas from the input-token rate and Little's law)"])
