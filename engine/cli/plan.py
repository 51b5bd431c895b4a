"""``rackbed plan``: check parallel plans (sharding + memory budget) without hardware.

    rackbed plan check FILE.yaml                       validate prefill/decode plans; print their budgets
    rackbed plan show FILE.yaml [--formats bf16,fp8,mxfp8] [--markdown] [--kv-seq-len N]
                                                       budgets (one row per plan x format; plans that do not
                                                       fit are shown, not rejected) and, with --kv-seq-len, the
                                                       prefill -> decode KV transfer of one sequence (HND vs NHD)
    rackbed plan show --model M --topology T --role decode --tp 1 --ep 16 --dp 16 --gpus 0-15 [...]
                                                       the same for a plan given by flags

FILE.yaml holds ``topology``, ``model``, ``prefill`` and/or ``decode`` (``engine.core.sharding.PlanFile``), or is a
scenario file with those keys under ``plan:``. Every mistake is one line (``rackbed: error: FILE: decode: ...``).
"""

from __future__ import annotations

import argparse
from pathlib import Path


def register(subparsers) -> None:
    p = subparsers.add_parser("plan", help="validate parallel plans and show per-rank memory budgets")
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])
    sub = p.add_subparsers(dest="plan_command", metavar="ACTION")

    q = sub.add_parser("check", help="validate a plan file (exit 2 with a one-line error if invalid)")
    q.add_argument("file", metavar="FILE.yaml")
    q.set_defaults(func=cmd_check)

    q = sub.add_parser("show", help="memory budgets of a plan file or of a plan given by flags")
    q.add_argument("file", metavar="FILE.yaml", nargs="?", help="plan or scenario file")
    q.add_argument("--formats", help="comma-separated weight formats to tabulate (default: the plans' own)")
    q.add_argument("--markdown", action="store_true", help="print a Markdown table (for SHARDING.md)")
    q.add_argument("--kv-seq-len", type=int, metavar="N",
                   help="also plan the prefill -> decode KV transfer of one N-token sequence (HND vs NHD)")
    g = q.add_argument_group("plan by flags (instead of FILE)")
    g.add_argument("--model")
    g.add_argument("--topology")
    g.add_argument("--role", choices=["prefill", "decode"], default="prefill")
    for name in ("tp", "ep", "dp", "kv-replication", "page-tokens", "max-batch-tokens", "max-batch-seqs"):
        g.add_argument(f"--{name}", type=int)
    g.add_argument("--gpus", help="GPU ids, e.g. 0-3 or 0-3,8-11 (default: 0 .. tp*dp-1)")
    g.add_argument("--format", dest="weight_format", help="weight format (default bf16)")
    g.add_argument("--kv-dtype", choices=["bf16", "fp8"])
    q.set_defaults(func=cmd_show)


def _print_table(budgets, title: str, markdown: bool) -> None:
    from rackbed.engine.core.sharding import MemoryBudget

    cols = MemoryBudget.COLUMNS
    rows = [b.row() for b in budgets]
    if markdown:
        print("| " + " | ".join(cols) + " |")
        print("|" + "|".join(" --- " for _ in cols) + "|")
        for r in rows:
            print("| " + " | ".join(r) + " |")
        return
    from rich.console import Console
    from rich.table import Table

    t = Table(title=title)
    for c in cols:
        t.add_column(c, justify="left" if c in ("role", "parallel", "formats (w/kv)") else "right")
    for r in rows:
        t.add_row(*r, style=None if r[-1] == "yes" else "red")
    Console(width=max(Console().width, 150)).print(t)


def cmd_check(args: argparse.Namespace) -> int:
    from rackbed.engine.core.sharding import check_plan_file

    pf, budgets = check_plan_file(args.file)
    _print_table(budgets, f"{args.file}: {pf.model} on {pf.topology}", markdown=False)
    print(f"{args.file}: OK ({', '.join(p.role for p in pf.plans())} valid)")
    return 0


def _plans_from_flags(args: argparse.Namespace):
    from pydantic import ValidationError

    from rackbed.engine.core.sharding import ParallelPlan, PlanFile
    from rackbed.topology.errors import UserError, from_validation

    if not args.model or not args.topology:
        raise UserError("plan show: give FILE.yaml, or --model and --topology (plus --tp/--ep/--dp ...)")
    kw = {k: getattr(args, k) for k in ("tp", "ep", "dp", "kv_replication", "page_tokens", "max_batch_tokens",
                                        "max_batch_seqs", "weight_format", "kv_dtype")
          if getattr(args, k) is not None}
    tp, dp = kw.get("tp", 1), kw.get("dp", 1)
    try:
        plan = ParallelPlan(role=args.role, gpus=args.gpus if args.gpus is not None else list(range(tp * dp)),
                            **kw)
        return PlanFile(topology=args.topology, model=args.model, **{args.role: plan}), None
    except ValidationError as exc:
        raise from_validation(exc, "plan show") from None


def cmd_show(args: argparse.Namespace) -> int:
    from rackbed.engine.core.sharding import load_plan_file
    from rackbed.topology.errors import UserError

    if args.file:
        path = Path(args.file)
        pf, base = load_plan_file(path), path.parent
        where = str(path)
    else:
        pf, base = _plans_from_flags(args)
        where = "plan show"
    formats = [f.strip() for f in args.formats.split(",")] if args.formats else [None]
    model, topo = pf.resolve(base)
    budgets = []
    for plan in pf.plans():
        try:
            plan.check_structure(model, topo)
        except UserError as exc:
            raise UserError(f"{where}: {plan.role}: {exc}") from None
        for fmt in formats:
            p = plan if fmt is None else _with_format(plan, fmt, where)
            budgets.append(p.memory_budget(model, topo))
    _print_table(budgets, f"{where}: {pf.model} on {pf.topology}", markdown=args.markdown)
    if args.kv_seq_len:
        _show_kv(pf, model, args.kv_seq_len, args.markdown)
    return 0


def _with_format(plan, fmt: str, where: str):
    from pydantic import ValidationError

    from rackbed.topology.errors import from_validation

    try:
        return type(plan).model_validate({**plan.model_dump(), "weight_format": fmt})
    except ValidationError as exc:
        raise from_validation(exc, f"{where}: --formats") from None


def _show_kv(pf, model, seq_len: int, markdown: bool) -> None:
    """HND vs NHD chunk counts of one sequence's prefill -> decode transfer (fragmented page tables)."""
    import numpy as np

    from rackbed.engine.core.kv import KvLayout, chunk_stats, pages_needed, reshard_plan
    from rackbed.topology.errors import UserError

    if pf.prefill is None or pf.decode is None:
        raise UserError("--kv-seq-len needs both a prefill and a decode plan")
    if seq_len < 1:
        raise UserError(f"--kv-seq-len must be >= 1, got {seq_len}")
    if pf.prefill.kv_dtype != pf.decode.kv_dtype:
        raise UserError("--kv-seq-len: prefill and decode kv_dtype differ (conversion is not modelled)")
    ns, nd = pages_needed(seq_len, pf.prefill.page_tokens), pages_needed(seq_len, pf.decode.page_tokens)
    sp, dp = np.arange(ns) * 2, np.arange(nd) * 2  # fragmented: no two pages adjacent
    rows = []
    for order in ("HND", "NHD"):
        src = KvLayout.for_plan(pf.prefill, model, 2 * ns, order)
        dst = KvLayout.for_plan(pf.decode, model, 2 * nd, order)
        st = chunk_stats(reshard_plan(src, dst, seq_len, sp, dp))
        rows.append((order, f"{st.n_chunks:,}", f"{st.total_bytes / 1e6:.1f}", f"{st.mean_chunk_bytes:,.0f}",
                     " ".join(f"{r}:{b / 1e6:.1f}" for r, b in sorted(st.bytes_by_src.items()))))
    title = (f"KV transfer of one {seq_len}-token sequence: prefill tp{pf.prefill.tp} "
             f"(page {pf.prefill.page_tokens}) -> decode tp{pf.decode.tp} (page {pf.decode.page_tokens})")
    cols = ("layout", "chunks", "MB", "mean chunk B", "MB read per prefill rank")
    if markdown:
        print(f"\n{title}\n")
        print("| " + " | ".join(cols) + " |")
        print("|" + "|".join(" --- " for _ in cols) + "|")
        for r in rows:
            print("| " + " | ".join(r) + " |")
        return
    from rich.console import Console
    from rich.table import Table

    t = Table(title=title)
    for c in cols:
        t.add_column(c)
    for r in rows:
        t.add_row(*r)
    Console().print(t)
