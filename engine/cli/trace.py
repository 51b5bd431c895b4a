"""``rackbed trace stats SOURCE``: what a request stream looks like, and how much of its prefill a prefix cache
could skip at best.

SOURCE is a trace file (Mooncake JSONL or Azure CSV, optionally gzipped), the name of a shipped trace
(``mooncake``, ``azure-conv``, ``azure-code``), a workload YAML (a mapping with ``kind: synthetic | trace |
sessions``) or a serving scenario (a YAML path or a shipped name; its ``workload``, drawn with the scenario's
``seed`` as ``rackbed run`` draws it).

Prefix reuse is counted on ``Request.prefix_hash_ids`` (512-token blocks; equal ids = identical prefix), in
arrival order, in prompt tokens: block j of a prompt of P tokens holds ``min(512, P - 512 j)`` of them. A request
reuses the longest run of its leading blocks that the cache holds (a prefix cache cannot use a block past a miss);
then all its blocks are in the cache. Two caches:

- infinite: every block ever seen stays. For ids that name whole prefixes (as Mooncake's and the sessions
  generator's do) this is exactly the fraction of prompt tokens whose block was seen before: the upper bound.
- LRU of C blocks (``--cache-blocks C``, repeatable): after a request its blocks are the most recently used, its
  first block most recent of all, so eviction takes the tails of prefix chains before their heads (as vLLM's free
  block queue does). Only prompt blocks enter the cache (a request's ids cover its prompt, not its output).

Every block counts by default, a trace's shared partial last blocks too: the bound. A serving engine's prefix cache
holds only full blocks that end before the prompt's last token (prefill must compute that token for the first
output token's logits); ``--full-blocks`` counts only those, in the caches and in the prompt blocks (the infinite
cache's number is printed both ways).

A brute-force reference (a set, an ``OrderedDict``: ``engine.core.prefix_reuse``, which ``rackbed search`` also
uses to estimate a prefix cache's hit rate), not the simulator's prefix cache.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

from rackbed.engine.core.prefix_reuse import BLOCK, ReuseStats, prefix_reuse  # noqa: F401 (re-exported)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("trace", help="request trace tools (stats: lengths and the prefix-reuse bound)",
                       description="Tools for request traces and workloads.")
    tsub = p.add_subparsers(dest="trace_command", metavar="TOOL", required=True)
    s = tsub.add_parser(
        "stats", help="requests, duration, mean lengths and the prefix-cache reuse bound of a trace or workload",
        description="Print requests, duration, mean input/output tokens and the prefix-reuse bound (fraction of "
                    "prompt tokens a prefix cache could skip: infinite, and LRU of --cache-blocks blocks). SOURCE: a "
                    "trace file, a shipped trace name (mooncake, azure-conv, azure-code), a workload YAML or a "
                    "serving scenario (path or shipped name).")
    s.add_argument("source", metavar="PATH_OR_SCENARIO")
    s.add_argument("--cache-blocks", type=int, action="append", default=[], metavar="C",
                   help="also the reuse of an LRU cache of C 512-token blocks (repeatable)")
    s.add_argument("--format", choices=("auto", "azure", "mooncake"), default="auto", help="trace file format")
    s.add_argument("--seed", type=int, default=None, help="seed of a generated workload (default: the file's)")
    s.add_argument("--full-blocks", action="store_true",
                   help="count only full blocks that end before a prompt's last token (what an engine caches)")
    s.add_argument("--max-requests", type=int, default=None, metavar="N", help="only the first N requests")
    s.add_argument("--json", action="store_true", help="print the numbers as one JSON object")
    s.set_defaults(func=_stats_main)


# ------------------------------------------------------------------------------------------------------ numbers


# ------------------------------------------------------------------------------------------------------ source


def load_requests(source: str, fmt: str = "auto", seed: int | None = None,
                  max_requests: int | None = None) -> tuple[str, list]:
    """(what was read, its requests) for a ``rackbed trace stats`` SOURCE (module docstring)."""
    from itertools import islice

    from rackbed import scenarios
    from rackbed.engine.core.traces import TRACE_FILES
    from rackbed.engine.core.workload import TraceReplay, iter_requests, parse_workload
    from rackbed.topology.errors import UserError
    from rackbed.topology.yamlio import load_yaml

    if max_requests is not None and max_requests < 1:
        raise UserError(f"--max-requests: must be >= 1, got {max_requests}")
    p = Path(source)
    shipped_name = scenarios.is_bare_name(source) and any((scenarios.HERE / f"{source}{x}").is_file()
                                                          for x in (".yaml", ".yml"))
    if p.is_file() and p.suffix not in (".yaml", ".yml") and not shipped_name:
        spec, what, run_seed = TraceReplay(path=str(p), format=fmt), f"{p} (trace)", None
    elif not p.exists() and source in TRACE_FILES:
        spec, what, run_seed = TraceReplay(name=source, format=fmt), f"shipped trace {source}", None
    else:
        try:
            path = scenarios.resolve(source)
        except ValueError:
            raise UserError(f"{source}: not a file, a shipped trace ({', '.join(sorted(TRACE_FILES))}) or a shipped "
                            f"scenario ({', '.join(scenarios.available())})") from None
        data = load_yaml(path)
        if not isinstance(data, dict):
            raise UserError(f"{path}: expected a mapping (a workload or a serving scenario)")
        if data.get("kind") in ("synthetic", "trace", "sessions"):
            wl, run_seed, what = data, None, f"{path} (workload)"
        elif data.get("kind", "serving") == "serving" and "workload" in data:
            wl, run_seed, what = data["workload"], data.get("seed", 0), f"{path} (scenario workload)"
        else:
            raise UserError(f"{path}: neither a workload (kind: synthetic, trace or sessions) nor a serving "
                            "scenario with a workload")
        if not isinstance(wl, dict):
            raise UserError(f"{path}: workload: expected a mapping")
        spec = parse_workload(wl, str(path))
        rel = Path(spec.path) if spec.kind == "trace" and spec.path else None
        if rel is not None and not rel.is_absolute() and (path.parent / rel).exists():  # as load_scenario does
            spec = spec.model_copy(update={"path": str(path.parent / rel)})
    stream = iter_requests(spec, seed if seed is not None else run_seed)
    reqs = list(islice(stream, max_requests)) if max_requests is not None else stream.to_list()
    return what, reqs


def trace_stats(source: str, cache_blocks: Sequence[int] = (), fmt: str = "auto", seed: int | None = None,
                max_requests: int | None = None, full_blocks: bool = False) -> dict:
    """The numbers ``rackbed trace stats`` prints, as a flat dict."""
    from rackbed.engine.core.workload import describe

    for c in cache_blocks:  # before reading anything
        if c < 1:
            raise ValueError(f"--cache-blocks: must be >= 1, got {c}")
    what, reqs = load_requests(source, fmt, seed, max_requests)
    d = describe(reqs)
    ru = prefix_reuse(reqs, cache_blocks, full_blocks)
    full = prefix_reuse(reqs, (), True).infinite if not full_blocks else ru.infinite
    out = {"source": what, "requests": d["count"], "duration_s": d["duration_s"],
           "mean_rate_per_s": d["mean_rate_per_s"], "input_tokens_mean": d["prompt_tokens_mean"],
           "output_tokens_mean": d["output_tokens_mean"], "requests_with_ids": ru.requests_with_ids,
           "prompt_blocks": ru.blocks, "distinct_blocks": ru.distinct_blocks, "inconsistent_ids": ru.inconsistent_ids,
           "full_blocks": full_blocks, "reuse_infinite": ru.infinite, "reuse_infinite_full_blocks": full}
    for c in cache_blocks:
        out[f"reuse_lru_{c}"] = ru.lru(c)
    return out


def _stats_main(args: argparse.Namespace) -> int:
    sizes = list(dict.fromkeys(args.cache_blocks))
    s = trace_stats(args.source, sizes, args.format, args.seed, args.max_requests, args.full_blocks)
    if args.json:
        print(json.dumps(s))
        return 0
    rows = [("source", s["source"]),
            ("requests", f"{s['requests']:,} ({s['requests_with_ids']:,} with prefix block ids)"),
            ("duration", f"{s['duration_s']:.1f} s ({s['mean_rate_per_s']:.2f} requests/s)"),
            ("input tokens", f"mean {s['input_tokens_mean']:,.1f}"),
            ("output tokens", f"mean {s['output_tokens_mean']:,.1f}")]
    if s["requests_with_ids"]:
        rows.append(("prompt blocks", f"{s['prompt_blocks']:,} ids, {s['distinct_blocks']:,} distinct"
                     + (f", {s['inconsistent_ids']:,} at more than one position" if s["inconsistent_ids"] else "")))
        what = "full blocks before the last prompt token" if s["full_blocks"] else "any block"
        rows.append(("prefix reuse", f"{100 * s['reuse_infinite']:.1f} % of prompt tokens (infinite cache, {what})"))
        if not s["full_blocks"]:
            full = s["reuse_infinite_full_blocks"]
            rows.append(("", f"{100 * full:.1f} % in full blocks before the last prompt token (what an engine caches)"))
        for c in sizes:
            rows.append(("", f"{100 * s[f'reuse_lru_{c}']:.1f} % with an LRU cache of {c:,} blocks"))
    else:
        rows.append(("prefix reuse", "unknown: no prefix block ids (an Azure trace or a synthetic workload)"))
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")
    return 0
