"""``rackbed search``: which deployment, for this model, hardware, traffic and SLOs — and what a token costs.

    rackbed search scenarios/sweeps/search-qwen235-gb200.yaml --jobs 2
    rackbed search --model qwen3-235b-a22b --topology gb200-nvl72 --format mxfp8 --rate 20 --prompt 4000 \\
        --output 400 --duration 30 --ttft 2 --tpot 0.05 --gpu-hour-usd 6

Enumerates candidates, prunes them with the memory budget and the analytic step-time model, simulates the
survivors (parallel, resumable: DIR/results.jsonl), prints the Pareto front's best few with where their step
time goes, and writes DIR/report.md / report.html / pareto.png (see ``sim.search``). DIR/search.json says which
search wrote DIR: the same search run again resumes there, another needs ``--force`` (:func:`search_dir`). A flag
the chosen search does not read is an error (:func:`check_flags`).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rackbed.topology.outputs import add_force, prepare_dir, safe_name, write_text

MARKER = "search.json"  # in a search's folder: which search wrote it (resumed by the same search only)
# What a search's identity leaves out: how far it goes, how much it prints and its prose (a re-run with more
# simulations resumes the same search); everything else — the spec, the mode and its budget — makes it another.
ASIDE = ("max_simulations", "top", "description")


def _ints(s: str) -> list[int]:
    try:
        return [int(x) for x in s.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from None


def _caps(s: str) -> list[int] | dict:
    """``--batch-cap``: comma-separated caps, or a grid ``LO:HI:STEP`` / ``LO:HI:xFACTOR`` (checked by
    :func:`check_flags` with ``sim.search.batch_grid``)."""
    if ":" not in s:
        return _ints(s)
    parts = s.split(":")
    try:
        if len(parts) != 3:
            raise ValueError
        lo, hi = int(parts[0]), int(parts[1])
        if parts[2][:1] in ("x", "*"):
            return {"lo": lo, "hi": hi, "factor": float(parts[2][1:])}
        return {"lo": lo, "hi": hi, "step": int(parts[2])}
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers or a grid LO:HI:STEP or "
                                         f"LO:HI:xFACTOR, got {s!r}") from None


def _strs(s: str) -> list[str]:
    return [x for x in s.split(",") if x]


def _prices(s: str) -> float | dict[str, float]:
    """``--gpu-hour-usd``: one price, or ``MODEL=USD`` pairs (comma-separated) naming a mixed topology's GPU
    models as ``prefill.gpu`` does."""
    if "=" not in s:
        try:
            return float(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a price or MODEL=USD pairs, got {s!r}") from None
    out: dict[str, float] = {}
    bad = argparse.ArgumentTypeError(f"expected MODEL=USD pairs (H200=3.5,GB200=6), got {s!r}")
    for part in _strs(s):
        k, _, v = part.partition("=")
        try:
            out[k.strip()] = float(v)
        except ValueError:
            raise bad from None
        if not k.strip():
            raise bad
    return out


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Every flag's default in its help; flags whose default is "not given" say in their help what applies."""

    def _get_help_string(self, action):
        if action.default in (None, False) or action.default is argparse.SUPPRESS:
            return action.help
        return super()._get_help_string(action)


def register(sub: argparse._SubParsersAction) -> None:
    from rackbed.sim.emit import ENGINES

    p = sub.add_parser(
        "search",
        help="find the Pareto-best deployments (tokens/s per GPU vs per user) for a GPU budget or a load and SLOs",
        formatter_class=_Help,
        description="With --gpus N (no --rate): the best deployments on N GPUs, aggregated and disaggregated, each "
        "at the highest rate it sustains under the SLOs — the Pareto fronts of tokens/s per GPU vs tokens/s per "
        "user and the best configuration (docs/CAPACITY.md). With --rate: the Pareto search for that load "
        "(enumerate, prune with the memory budget and the analytic step-time model, simulate the survivors; with "
        "--gpus N too, deployments of at most N GPUs). With a search spec: that search (the spec sets what the "
        "flags would). With --max-rate SCENARIO: the highest rate a given deployment sustains under the SLOs. "
        "A flag the chosen search does not use is an error naming it.",
    )
    p.add_argument("spec", nargs="?", help="search spec YAML (kind: search) or a name under scenarios/sweeps/ "
                   "(instead of the flags)")
    p.add_argument("--model", default=None, help="model name (rackbed model show); default qwen3-235b-a22b")
    p.add_argument("--gpus", type=int, default=None,
                   help="GPU budget: without --rate, search every deployment on this many GPUs at the rate each "
                   "sustains; with --rate, only deployments of at most this many GPUs; a preset topology is "
                   "resized to it (NAME, NAME*k, NAME@G); default: none (give --rate)")
    p.add_argument("--topology", type=_strs, default=None,
                   help="topology (with --gpus alone: one preset, resized); with --rate: comma-separated names; "
                   "default gb200-nvl72")
    p.add_argument("--format", dest="weight_format", type=_strs, default=None,
                   help="weight format (rackbed formats); with --rate: comma-separated; default fp8")
    p.add_argument("--stack", choices=("auto", "rackbed", "trtllm", "sglang", "vllm"), default=None,
                   help="serving stack whose calibration prices every candidate (scenario field stack): auto = the "
                   "first shipped for the GPU (rackbed's own, then trtllm, sglang, vllm); default: the spec's or "
                   "scenario's own, else auto")
    p.add_argument("--kind", type=_strs, default=None,
                   help="with --gpus alone: deployment kinds searched, comma-separated; default "
                   "disaggregated,aggregated (the --rate search is disaggregated)")
    p.add_argument("--rate", type=float, default=None, help="requests/s (Poisson): search for this load; default: none (give --gpus)")
    p.add_argument("--prompt", "--isl", dest="prompt", type=int, default=None,
                   help="prompt tokens (fixed); default 4000")
    p.add_argument("--output", "--osl", dest="output", type=int, default=None,
                   help="output tokens (fixed); default 400")
    p.add_argument("--trace", default=None, metavar="NAME|PATH",
                   help="replay this trace instead of fixed --isl/--osl requests (a shipped name: "
                   "mooncake, azure-conv, azure-code; or a file), at the searched rate, looped; default: none")
    p.add_argument("--prefix-cache", action="store_true",
                   help="every prefiller and aggregated worker keeps a prefix cache (scenario prefix_cache: "
                   "8 GB of HBM per GPU and the topology's host tier); needs a workload with prefix block ids "
                   "(--trace mooncake, or a spec's); docs/PREFIX_CACHE.md")
    p.add_argument("--prefix-cache-gb", type=float, default=None, metavar="G",
                   help="the prefix cache with G GB of HBM per GPU (implies --prefix-cache); default 8")
    p.add_argument("--no-host-tier", action="store_true",
                   help="the prefix cache without its host-memory tier (HBM only)")
    p.add_argument("--duration", type=float, default=None, help="seconds of arrivals simulated per point; default 30")
    p.add_argument("--ttft", type=float, default=None, help="TTFT SLO, seconds (p90); default 2")
    p.add_argument("--tpot", type=float, default=None, help="TPOT SLO, seconds (p90); default 0.05")
    p.add_argument("--gpu-hour-usd", type=_prices, default=None,
                   help="price of one GPU-hour, for $/M tokens (with --rate); with --gpus N on a "
                   "topology of several GPU models (A+B), each model's: MODEL=USD pairs (H200=3.5,GB200=6), "
                   "which rank the mixed pools by tokens/s per $ per hour; default 0 (none)")
    p.add_argument("--objective", choices=("gpu", "kw"), default=None,
                   help="what the front maximises against tokens/s per user (with --rate): gpu = output "
                        "tokens/s per GPU, kw = output tokens/s per kW of facility power (whole pool, "
                        "sim/energy.py); default gpu")
    p.add_argument("--prefill-tp", type=_ints, default=None, help="prefill TP degrees (EP = TP); default 2,4,8")
    p.add_argument("--decode-ep", type=_ints, default=None, help="decode DP-EP degrees; default 4,8,16,32")
    p.add_argument("--batch-cap", type=_caps, default=None,
                   help="max batch per rank (decode / aggregated): a list, or a grid LO:HI:STEP (8:256:4) or "
                        "LO:HI:xFACTOR (8:256:x1.25, geometric); default 8,16,32,64,128")
    p.add_argument("--decode-tp", type=_ints, default=None,
                   help="attention TP degrees inside a decoder's DP ranks (dp = ep / tp); default 1")
    p.add_argument("--kv-dtype", type=_strs, default=None,
                   help="KV cache formats to try: bf16, fp8 (KV capacity and attention reads follow it); "
                        "default bf16")
    p.add_argument("--draft-k", type=_ints, default=None,
                   help="MTP draft lengths; default 0,1,2 for a model with MTP layers, else 0")
    p.add_argument("--wide", action="store_true",
                   help="a wider space: " + ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in WIDE_FLAGS.items())
                        + " where those flags are not given")
    p.add_argument("--decode-overlap", type=_strs, default=None,
                   help="decode compute / communication overlap modes to try: none, shared_expert, two_batch "
                        "(sim/costs/overlap.py); default none")
    p.add_argument("--decode-moe-comm", type=_strs, default=None,
                   help="how decoders move tokens to their experts, modes to try: a2a (sparse all-to-all), "
                        "allgather (all-gather the tokens, reduce-scatter the outputs; "
                        "sim/costs/moe_comm.py); default a2a")
    p.add_argument("--mtp-layers", type=int, default=None,
                   help="draft with N MTP layers of the model's width (mtp.draft: {kind: mtp, layers: N}); needed "
                        "for draft_k > 0 with a model without MTP layers (a trained MTP head, e.g. Qwen3-235B); "
                        "default: none")
    p.add_argument("--max-simulations", type=int, default=None,
                   help="cap on simulations; default 12 with --gpus alone, 60 with --rate, a spec's own")
    p.add_argument("--per-front", type=int, default=None,
                   help="with --gpus alone: analytic front points simulated per deployment kind; default 3")
    p.add_argument("--fill-tolerance", type=float, default=None,
                   help="with --gpus alone: the best may give up this fraction of the most tokens/s per used GPU for "
                   "more tokens/s per budget GPU (a deployment that uses the budget); default 0.05")
    p.add_argument("--max-rate", metavar="SCENARIO", default=None,
                   help="the highest rate this scenario's deployment sustains under --ttft / --tpot (doubling from --rate or "
                   "the scenario's rate, then bisection; --duration per simulation); default: not this mode")
    p.add_argument("--top", type=int, default=None,
                   help="best points to print and explain (--rate or a spec); default 5")
    p.add_argument("--emit", choices=ENGINES, default=None,
                   help="write the best configuration's launch settings for this engine (rackbed emit); default: none")
    p.add_argument("--emit-out", type=Path, default=None,
                   help="folder for --emit (an existing, non-empty one needs --force); default OUT/emit-ENGINE")
    p.add_argument("--out", type=Path, default=None,
                   help="output folder; a folder this same search wrote (its search.json) is resumed: the "
                   "simulations already in its results.jsonl are not run again. Default rackbed-out/search-<name> "
                   "(or the first of -2, -3 ... that is free or this search's)")
    add_force(p, "write into an existing, non-empty --out folder that is not this search's (other files, or "
              "another search's: its report is replaced, simulations of the same points are reused); not needed "
              "to resume the same search: the same flags or spec, where --max-simulations, --per-front, --top, "
              "--jobs and --emit may differ")
    p.add_argument("--jobs", "-j", type=int, default=None, help="worker processes; default: CPU count")
    p.add_argument("--ray-address", default=None, help="simulate on this Ray cluster (needs `ray` installed); default: local processes")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--no-report", action="store_true", help="no report.md / report.html")
    p.set_defaults(func=_main)


# The flags' defaults where a flag was not given (argparse leaves them None, so that a flag given to a search that
# does not use it can be told from its default).
DEFAULTS = {"model": "qwen3-235b-a22b", "topology": ["gb200-nvl72"], "weight_format": ["fp8"],
            "kind": ["disaggregated", "aggregated"], "duration": 30.0, "ttft": 2.0, "tpot": 0.05,
            "gpu_hour_usd": 0.0, "per_front": 3, "fill_tolerance": 0.05, "objective": "gpu"}

# What --wide sets where the flag is not given: the KV cache format, a geometric batch-cap grid, TP2 attention
# ranks in the decoders and their all-gather MoE communication, next to the defaults.
WIDE_FLAGS = {"kv_dtype": "bf16,fp8", "batch_cap": "8:256:x1.25", "decode_tp": "1,2",
              "decode_moe_comm": "a2a,allgather"}

# The flags each search reads (argparse dests); --stack and --no-progress apply to every one.
_WORKLOAD = {"model", "topology", "weight_format", "prompt", "output", "trace", "prefix_cache", "prefix_cache_gb",
             "no_host_tier", "duration", "ttft", "tpot", "prefill_tp", "decode_ep", "batch_cap", "draft_k",
             "mtp_layers", "decode_overlap", "decode_tp", "kv_dtype", "decode_moe_comm", "max_simulations",
             "emit", "emit_out", "out", "force", "jobs", "no_report", "wide"}
USED = {
    "budget": {"gpus", *_WORKLOAD, "kind", "per_front", "fill_tolerance", "gpu_hour_usd"},
    "rate": {"gpus", "rate", *_WORKLOAD, "gpu_hour_usd", "top", "ray_address", "objective"},
    "spec": {"spec", "prefix_cache", "prefix_cache_gb", "no_host_tier", "max_simulations", "top", "emit",
             "emit_out", "out", "force", "jobs", "ray_address", "no_report"},
    "max-rate": {"max_rate", "rate", "duration", "ttft", "tpot"},
}
_FLAG = {"weight_format": "--format", "prompt": "--isl", "output": "--osl"}


def mode_of(args: argparse.Namespace) -> str:
    """Which search the flags ask for: ``max-rate``, ``spec``, ``budget`` (--gpus without --rate) or ``rate``."""
    from rackbed.topology.errors import UserError

    if args.max_rate:
        return "max-rate"
    if args.spec:
        return "spec"
    if args.rate is None and args.gpus is not None:
        return "budget"
    if args.rate is not None:
        return "rate"
    raise UserError("rackbed search: give --gpus N (the best deployments on N GPUs at any rate), --rate "
                    "(requests/s), --max-rate SCENARIO, or a search spec YAML")


def _unused(args: argparse.Namespace, mode: str) -> None:
    """A flag given to a search that does not read it: a one-line UserError naming it and what applies instead
    (never a flag silently ignored)."""
    from rackbed.topology.errors import UserError

    for dest, v in vars(args).items():
        if dest in ("command", "func", "stack", "no_progress") or v is None or v is False or dest in USED[mode]:
            continue
        flag = f"search spec {args.spec}" if dest == "spec" else _FLAG.get(dest, "--" + dest.replace("_", "-"))
        if mode == "max-rate":
            why = ("not with --max-rate SCENARIO (it simulates the scenario's own deployment, model and workload, "
                   "one rate at a time, and writes nothing); only --rate (the first rate tried), --duration, "
                   "--ttft, --tpot and --stack apply")
        elif mode == "spec":
            why = (f"not with a search spec: set it in {args.spec} instead; with a spec only --max-simulations, "
                   "--top, --stack, --prefix-cache*, --emit, --out, --force, --jobs and --ray-address apply")
        elif dest in ("kind", "per_front", "fill_tolerance"):
            why = ("only with --gpus N and no --rate (the budget search); the --rate search enumerates disaggregated "
                   "deployments for that load")
        elif dest == "objective":
            why = "only with --rate (a spec sets objective: itself; the budget search --gpus N ranks by GPU)"
        elif dest == "top":
            why = "only with --rate or a spec (the budget search --gpus N prints every front point)"
        elif dest == "ray_address":
            why = "only with --rate or a spec (the budget search --gpus N simulates in local processes: --jobs)"
        else:
            why = f"not used by the {mode} search"
        raise UserError(f"{flag}: {why}")


def check_flags(args: argparse.Namespace) -> str:
    """Flag values the search cannot use: a one-line UserError naming the flag as typed (never a spec path); a flag
    the chosen search does not read is one too. Fills in the defaults of the flags not given (:data:`DEFAULTS`)
    and returns the search's mode (:func:`mode_of`)."""
    from rackbed.engine.core.formats import FORMAT_NAMES
    from rackbed.topology.errors import UserError

    def bad(flag, v, rule):
        raise UserError(f"{flag} {v}: {rule}")

    mode = mode_of(args)
    given = argparse.Namespace(**vars(args))
    if getattr(args, "wide", False) and mode in ("budget", "rate"):
        for k, v in WIDE_FLAGS.items():
            if getattr(args, k) is None:
                setattr(args, k, {"kv_dtype": _strs, "batch_cap": _caps, "decode_tp": _ints,
                                  "decode_moe_comm": _strs}[k](v))
    for k, v in DEFAULTS.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    for flag, v in (("--rate", args.rate), ("--duration", args.duration), ("--ttft", args.ttft),
                    ("--tpot", args.tpot)):
        if v is not None and not v > 0:
            bad(flag, v, "must be a positive number")
    for flag, v in (("--gpus", args.gpus), ("--isl", args.prompt), ("--osl", args.output), ("--top", args.top),
                    ("--per-front", args.per_front), ("--jobs", args.jobs)):
        if v is not None and v < 1:
            bad(flag, v, "must be a positive integer")
    if args.max_simulations is not None and args.max_simulations < 0:
        bad("--max-simulations", args.max_simulations, "must be >= 0")
    if not 0 <= args.fill_tolerance < 1:
        bad("--fill-tolerance", args.fill_tolerance, "must be in [0, 1)")
    if isinstance(args.gpu_hour_usd, dict):
        if mode != "budget":
            bad("--gpu-hour-usd", ",".join(f"{k}={v:g}" for k, v in args.gpu_hour_usd.items()),
                "prices per GPU model only with --gpus N on a topology of several GPU models (A+B); with "
                "--rate give one price")
    elif args.gpu_hour_usd < 0:
        bad("--gpu-hour-usd", args.gpu_hour_usd, "must be >= 0")
    if mode == "budget" and len(args.topology) == 1:
        _check_budget_prices(args.topology[0], given.gpu_hour_usd)
    for f in args.weight_format:
        if f not in FORMAT_NAMES:
            bad("--format", f, f"unknown format; one of {', '.join(FORMAT_NAMES)}")
    if not args.weight_format:
        bad("--format", "''", "give a format")
    for k in args.kind:
        if k not in ("disaggregated", "aggregated"):
            bad("--kind", k, "one of disaggregated, aggregated")
    if isinstance(args.batch_cap, dict):
        from rackbed.sim.search import batch_grid

        g = args.batch_cap
        try:
            args.batch_cap = list(batch_grid(g))
        except ValueError as exc:
            bad("--batch-cap", ":".join(str(g[k]) if k != "factor" else f"x{g[k]}" for k in g), str(exc))
    for m in args.kv_dtype or ():
        if m not in ("bf16", "fp8"):
            bad("--kv-dtype", m, "one of bf16, fp8")
    if args.kv_dtype is not None and not args.kv_dtype:
        bad("--kv-dtype", "''", "give a format")
    for flag, v in (("--prefill-tp", args.prefill_tp), ("--decode-ep", args.decode_ep),
                    ("--batch-cap", args.batch_cap), ("--decode-tp", args.decode_tp)):
        if v is not None and (not v or any(x < 1 for x in v)):
            bad(flag, ",".join(map(str, v)), "expected comma-separated integers >= 1")
    if args.draft_k is not None and (not args.draft_k or any(x < 0 for x in args.draft_k)):
        bad("--draft-k", ",".join(map(str, args.draft_k)), "expected comma-separated integers >= 0")
    for m in args.decode_overlap or ():
        if m not in ("none", "shared_expert", "two_batch"):
            bad("--decode-overlap", m, "one of none, shared_expert, two_batch")
    if args.decode_overlap is not None and not args.decode_overlap:
        bad("--decode-overlap", "''", "give a mode")
    for m in args.decode_moe_comm or ():
        if m not in ("a2a", "allgather"):
            bad("--decode-moe-comm", m, "one of a2a, allgather")
    if args.decode_moe_comm is not None and not args.decode_moe_comm:
        bad("--decode-moe-comm", "''", "give a mode")
    if mode == "budget" and len(args.topology) != 1:
        bad("--topology", ",".join(args.topology), "with --gpus give one topology")
    if mode == "budget" and len(args.weight_format) != 1:
        bad("--format", ",".join(args.weight_format), "with --gpus give one format")
    if args.emit_out is not None and args.emit is None:
        bad("--emit-out", args.emit_out, "needs --emit ENGINE")
    _check_cache_flags(args, bad)
    _unused(given, mode)
    return mode


def _check_budget_prices(name: str, given) -> None:
    """``--gpu-hour-usd`` with ``--gpus N``: prices for each GPU model of a mixed topology (``sim.budget.
    kind_prices``); on a topology of one model (ranked by tokens/s per GPU) it is refused. One-line UserErrors
    before any work."""
    from rackbed import topology
    from rackbed.sim.budget import gpu_kinds, kind_prices
    from rackbed.topology.errors import UserError

    try:
        kinds = list(gpu_kinds(topology.load(name)))
    except (UserError, ValueError, OSError):
        return  # the search names what is wrong with the topology itself
    if len(kinds) == 1 and given is None:
        return
    if len(kinds) == 1 and given is not None:
        raise UserError(f"--gpu-hour-usd: with --gpus N only on a topology of several GPU models (A+B), "
                        f"where the prices choose the pool; {name} has one ({kinds[0]}), ranked by tokens/s "
                        "per GPU")
    if len(kinds) > 1:
        kind_prices(given, kinds)


def _check_cache_flags(args: argparse.Namespace, bad) -> None:
    """``--trace`` / ``--prefix-cache*``: one-line errors for the combinations the search cannot use."""
    cache = args.prefix_cache or args.prefix_cache_gb is not None
    if args.prefix_cache_gb is not None and not args.prefix_cache_gb > 0:
        bad("--prefix-cache-gb", args.prefix_cache_gb, "must be a positive number (GB of HBM per GPU)")
    if args.no_host_tier and not cache:
        bad("--no-host-tier", "", "needs --prefix-cache or --prefix-cache-gb G")
    if args.max_rate and (cache or args.trace):
        bad("--prefix-cache" if cache else "--trace", args.trace or "",
            "not with --max-rate (set the scenario's prefix_cache: / workload: instead)")
    if args.trace is not None:
        from rackbed.engine.core.traces import TRACE_FILES

        if args.spec:
            bad("--trace", args.trace, "not with a search spec (its workload: field says what to replay)")
        for flag, v in (("--isl", args.prompt), ("--osl", args.output)):
            if v is not None:
                bad(flag, v, "not with --trace (the trace gives every request's lengths)")
        if args.trace not in TRACE_FILES and not Path(args.trace).is_file():
            bad("--trace", args.trace, f"no such file, nor a shipped trace ({', '.join(sorted(TRACE_FILES))})")
    elif cache and not args.spec:
        bad("--prefix-cache" if args.prefix_cache else "--prefix-cache-gb",
            "" if args.prefix_cache else args.prefix_cache_gb,
            "fixed --isl/--osl requests carry no prefix block ids, so nothing is reused; give --trace mooncake")


def _prefix_cache(args: argparse.Namespace) -> dict | None:
    """The scenarios' ``prefix_cache`` section the flags ask for (None: the flags leave it alone)."""
    if not (args.prefix_cache or args.prefix_cache_gb is not None):
        return None
    pc: dict = {"enabled": True}
    if args.prefix_cache_gb is not None:
        pc["hbm_gb_per_gpu"] = args.prefix_cache_gb
    if args.no_host_tier:
        pc["host_gb_per_gpu"] = 0
    return pc


def _flags_spec(args: argparse.Namespace, rate: float, max_simulations: int, topology=None):
    from rackbed.sim import search as se

    return se.spec_from_flags(model=args.model, topology=topology or args.topology, weight_format=args.weight_format,
                              rate_per_s=rate, prompt_tokens=4000 if args.prompt is None else args.prompt,
                              output_tokens=400 if args.output is None else args.output,
                              duration_s=args.duration, ttft_s=args.ttft, tpot_s=args.tpot,
                              gpu_hour_usd=args.gpu_hour_usd, prefill_tp=args.prefill_tp, decode_ep=args.decode_ep,
                              max_batch_per_rank=args.batch_cap, draft_k=args.draft_k,
                              decode_overlap=args.decode_overlap, decode_tp=args.decode_tp,
                              decode_moe_comm=args.decode_moe_comm,
                              kv_dtype=args.kv_dtype, objective=args.objective,
                              max_simulations=max_simulations, top=args.top or 5, mtp_layers=args.mtp_layers,
                              trace=args.trace, prefix_cache=_prefix_cache(args),
                              max_gpus=args.gpus if args.rate is not None else None)


def _with_stack(spec, stack: str | None):
    """``spec`` with ``scenario: {stack: ...}`` when ``--stack`` is given (the search prices every candidate by
    it)."""
    if stack is None:
        return spec
    return spec.model_copy(update={"scenario": {**spec.scenario, "stack": stack}})


def identity(spec, mode: str, **budget) -> dict:
    """What makes two searches the same (resumable in one folder): the mode, the spec but for :data:`ASIDE`, and
    the budget search's ``gpus``, ``kinds`` and ``fill_tolerance``; JSON-normal (lists, no tuples)."""
    import json

    body = spec.model_dump(mode="json", exclude=set(ASIDE))
    for knob in ("prefill_overlap", "decode_overlap"):  # left at none, a search keeps its identity
        if body["space"].get(knob) == ["none"]:
            del body["space"][knob]
    if body["space"].get("kv_dtype", 0) is None:  # not varied: likewise
        del body["space"]["kv_dtype"]
    if body["space"].get("decode_moe_comm") == ["a2a"]:  # all-to-all only: likewise
        del body["space"]["decode_moe_comm"]
    return json.loads(json.dumps({"mode": mode, "spec": body, **budget}))


def _differs(a, b, at: str = "") -> list[str]:
    """The dotted keys where ``a`` and ``b`` differ."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [k for key in sorted(set(a) | set(b), key=str)
                for k in _differs(a.get(key), b.get(key), f"{at}.{key}" if at else str(key))]
    return [] if a == b else [at or "(all)"]


def search_dir(args: argparse.Namespace, name: str, ident: dict, console=None) -> Path:
    """The search's output folder under ``topology.outputs``' rule, a folder written by the same search
    (:func:`identity`, in its ``search.json``) being its own: resumed without ``--force``. Writes ``search.json``
    before any simulation, so that an interrupted search resumes too. Another search's folder given as ``--out``
    is a one-line error naming what differs. Says on ``console`` when it resumes."""
    import json

    from rackbed.topology.errors import UserError

    def recorded(q: Path) -> dict | None:
        f = q / MARKER
        if f.is_symlink() or not f.is_file():
            return None
        try:
            d = json.loads(f.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        return d.get("search") if isinstance(d, dict) else None

    out = args.out
    if out is not None and not args.force and out.is_dir() and not out.is_symlink() and any(out.iterdir()):
        old = recorded(out)
        if old is None and (out / "results.jsonl").exists():
            raise UserError(f"--out {out}: holds a results.jsonl but no {MARKER} (not a search of this rackbed: a "
                            "sweep's, or an older search's); pass --force to write into it (simulations of the "
                            "same points are reused), or choose another folder")
        if old is not None and old != ident:
            diff = _differs(old, ident)
            raise UserError(f"--out {out}: holds another search (differs in {', '.join(diff[:4])}"
                            f"{' ...' if len(diff) > 4 else ''}); pass --force to write into it, or choose another "
                            "folder")
    out = prepare_dir(out or Path("rackbed-out") / f"search-{safe_name(name)}", force=args.force,
                      own=lambda q: recorded(q) == ident, default=out is None)
    if console is not None and recorded(out) == ident:
        done = out / "results.jsonl"
        n = sum(1 for line in done.read_text(encoding="utf-8").splitlines() if line.strip()) if done.is_file() else 0
        console.print(f"resuming the search in {out}: {n} simulation(s) already in results.jsonl")
    write_text(out / MARKER, json.dumps({"search": ident}, indent=1) + "\n")
    return out


def _main(args: argparse.Namespace) -> int:
    import os

    from rich.console import Console

    from rackbed.sim import search as se

    mode = check_flags(args)
    console = Console() if Console().is_terminal else Console(width=160)
    jobs = args.jobs or os.cpu_count() or 1
    if mode == "max-rate":
        return _max_rate(args, console)
    if args.emit_out is not None:  # before the search, not after it: a folder of other files needs --force
        prepare_dir(args.emit_out, force=args.force, flag="--emit-out")
    if mode == "budget":
        return _budget(args, console, jobs)
    if mode == "spec":
        spec = se.load_search(args.spec)
        upd = {k: v for k, v in (("max_simulations", args.max_simulations), ("top", args.top)) if v is not None}
        if upd:
            spec = spec.model_copy(update=upd)
        spec = _with_stack(spec, args.stack)
        pc = _prefix_cache(args)
        if pc is not None:  # the flags' cache over the spec's scenario (its other prefix_cache fields kept)
            from rackbed.sim.sweep import deep_merge

            spec = spec.model_copy(update={"scenario": deep_merge(dict(spec.scenario), {"prefix_cache": pc})})
    else:
        topology = None
        if args.gpus is not None:  # deployments of at most --gpus GPUs, on the topologies resized to hold them
            from rackbed.sim.budget import budget_topology

            topology = [budget_topology(t, args.gpus) for t in args.topology]
            console.print(f"--gpus {args.gpus}: deployments of at most {args.gpus} GPUs, on "
                          + ", ".join(t if r == t else f"{r} ({t} resized)" for t, r in zip(args.topology, topology)))
        spec = _with_stack(_flags_spec(args, args.rate, 60 if args.max_simulations is None else args.max_simulations,
                                       topology), args.stack)
    if args.stack not in (None, "auto"):  # one line naming --stack, not every candidate pruned for it
        from rackbed.sim.budget import check_stack

        for t in spec.space.topology:
            check_stack(args.stack, t)
    out = search_dir(args, spec.name, identity(spec, mode), console)
    res = se.run_search(spec, out, jobs=jobs, ray_address=args.ray_address, progress=not args.no_progress,
                        console=console)
    for note in res.notes:
        console.print(f"[yellow]note:[/yellow] {note}")
    if not res.simulated:
        from rackbed.sim.search_results import prune_summary

        why = next(iter(prune_summary(res)), "no candidate")
        raise ValueError(f"rackbed search: every candidate was pruned (commonest: {why}); try looser --ttft / "
                         "--tpot, more GPUs (--topology NAME*k) or another --format")
    print_search(console, res)
    if not args.no_report:
        from rackbed.sim.report import write_report

        files = write_report(out, search_report_data(res))
        console.print(f"[dim]wrote {', '.join(str(f) for f in files)}[/dim]")
    if args.emit and res.best:
        from rackbed.sim.scenario import parse_scenario

        sc = parse_scenario(dict(res.scenarios[res.best[0]["key"]]), "search best")
        _emit(console, sc, args.emit, args.emit_out or out / f"emit-{args.emit}")
    return 0


def _emit(console, sc, engine: str, out: Path) -> None:
    from rackbed.sim.emit import write_emit

    files = write_emit(sc, engine, out)
    console.print(f"{engine} launch settings of the best configuration: {', '.join(str(f) for f in files)}")


def _budget(args: argparse.Namespace, console, jobs: int) -> int:
    from rackbed.sim import budget as bu

    spec = _with_stack(_flags_spec(args, 1.0, 12), args.stack)
    name = (f"budget-{bu._safe(args.topology[0])}-{args.gpus}" + (f"-{args.stack}" if args.stack else "")
            + (f"-{bu._safe(Path(args.trace).stem)}" if args.trace else "")
            + ("-cache" if _prefix_cache(args) else ""))
    spec = spec.model_copy(update={"name": name})
    out = search_dir(args, spec.name, identity(spec, "budget", gpus=args.gpus, kinds=sorted(args.kind),
                                               fill_tolerance=args.fill_tolerance), console)
    res = bu.run_budget_search(spec, args.gpus, out, kinds=tuple(args.kind), per_front=args.per_front,
                               max_simulations=12 if args.max_simulations is None else args.max_simulations,
                               fill_tolerance=args.fill_tolerance, jobs=jobs, progress=not args.no_progress, console=console)
    print_budget(console, res)
    files = bu.write_budget(res, out)
    console.print(f"[dim]wrote {', '.join(str(f) for f in files)}[/dim]")
    if res.best is None:
        console.print("[red]no simulated deployment met the SLOs[/red]")
        raise SystemExit(f"rackbed search: no simulated deployment on {args.gpus} GPUs met the SLOs; try looser "
                         "--ttft / --tpot, more --max-simulations or --per-front, or more --gpus")
    if args.emit:  # the best configuration, whatever its kind, with the copies that fill the budget
        _emit(console, bu.scenario_of(res, res.best, on_budget=True), args.emit,
              args.emit_out or out / f"emit-{args.emit}")
    return 0


def print_budget(console, res) -> None:
    """The budget search's answer: per kind its front, then the best configuration."""
    from rackbed.engine.cli.tables import print_table
    from rackbed.sim.report import fmt

    sp, ld = res.spec, res.load
    alive = sum(c.pruned is None for c in res.candidates)
    wl = sp.workload
    what = f"trace {wl.name or wl.path}, " if wl.kind == "trace" else ""
    console.print(f"[bold]{sp.model} on {res.gpus} GPUs ({res.topology}, {sp.space.weight_format[0]})[/bold]: {what}prompt "
                  f"{ld.prompt_mean:.0f} / output {ld.output_mean:.0f} tokens; SLO TTFT {sp.slo.ttft_s:g} s, TPOT "
                  f"{sp.slo.tpot_s * 1e3:g} ms at {sp.slo.percentile}")
    console.print(f"priced by stack {res.stack}: {res.calibration}")
    console.print(f"{len(res.candidates)} candidates, {alive} survive the analytic stage, {len(res.records)} "
                  f"simulations, {len(res.confirmed)} deployments confirmed; {res.wall_s:.0f} s")
    for note in res.notes:
        console.print(f"[yellow]note:[/yellow] {note}")
    cached = bool((se_base(res).get("prefix_cache") or {}).get("enabled"))
    usd = bool(res.prices)  # mixed pools: what each deployment costs and its tokens per dollar
    heads = ("kind", "configuration", "GPUs", "rate req/s", "tok/s/GPU", "tok/s/user", "TTFT p90 s", "TPOT p90 ms",
             "copies", "tok/s/budget GPU", "est rate", "est tok/s/GPU", "est tok/s/user",
             *(("est hit", "sim hit") if cached else ()),
             *(("$/h", "tok/s per $/h", "$/M tok") if usd else ()))
    rows = []
    for kind, front in res.fronts.items():
        if not front:
            rows.append([kind, "none confirmed", *[""] * (len(heads) - 2)])
        for r in front:
            s, e = r["summary"], r["est"]
            rows.append([kind, r["candidate"], str(r["gpus"]), fmt(r["rate_per_s"]), fmt(s["tokens_per_s_per_gpu"]),
                         fmt(s["tokens_per_s_per_user"]), fmt(s.get("ttft_p90_s"), 3),
                         fmt((s.get("tpot_p90_s") or 0) * 1e3, 3), str(r["use"]["replicas"]),
                         fmt(r["use"]["tokens_per_s_per_budget_gpu"]), fmt(e["rate_per_s"]),
                         fmt(e["tokens_per_s_per_gpu"]), fmt(e["tokens_per_s_per_user"]),
                         *((_pct(e.get("prefix_hit_rate")), _pct(s.get("prefix_hit_rate")))
                           if cached else ()),
                         *((fmt(s.get("usd_per_hour")), fmt(s.get("tokens_per_s_per_usd_hour")),
                            fmt(s.get("usd_per_mtok"), 3)) if usd else ())])
    per = "$ per hour" if usd else "used GPU"
    print_table(console, f"Pareto fronts: tokens/s per {per} (output tokens of the window's arrivals / "
                "window) vs tokens/s per user, each deployment at the highest simulated rate meeting the "
                "SLOs; copies on the budget", heads, rows, text=("configuration",),
                left=("kind", "configuration"), key=2, min_width={"configuration": 36})
    for title, b in (("best", res.best), ("best on the whole budget", res.best_total)):
        if b is None or (title != "best" and b is res.best):
            continue
        s, u = b["summary"], b["use"]
        console.print(f"[bold]{title}:[/bold] {b['kind']} {b['candidate']} on {b['gpus']} GPUs at "
                      f"{b['rate_per_s']:.4g} req/s: [bold]{s['tokens_per_s_per_gpu']:.4g} tokens/s/GPU[/bold], "
                      f"{s['tokens_per_s_per_user']:.4g} tokens/s/user (TTFT p90 {s['ttft_p90_s']:.3g} s, TPOT p90 "
                      f"{s['tpot_p90_s'] * 1e3:.3g} ms); on the budget: {u['replicas']} x = {u['gpus_used']} of "
                      f"{u['gpus']} GPUs, {u['tokens_per_s']:.5g} tokens/s in total, "
                      f"{u['tokens_per_s_per_budget_gpu']:.4g} tokens/s per budget GPU"
                      + (f"; ${s['usd_per_hour']:.4g}/h a copy, "
                         f"{s['tokens_per_s_per_usd_hour']:.4g} tokens/s per $/h, "
                         f"${s['usd_per_mtok']:.3g} per million output tokens" if usd else "")
                      + (f"; prefix-cache hit rate {_pct(s.get('prefix_hit_rate'))} of prompt tokens (assumed "
                         f"{_pct(b['est'].get('prefix_hit_rate'))})" if cached else ""))


def se_base(res) -> dict:
    """The base scenario of a budget search's candidates."""
    from rackbed.sim.search import base_scenario

    return base_scenario(res.spec)


def _pct(x) -> str:
    return "-" if x is None else f"{x:.1%}"


def _max_rate(args: argparse.Namespace, console) -> int:
    from rackbed import scenarios
    from rackbed.sim.budget import max_rate
    from rackbed.sim.overrides import apply_overrides
    from rackbed.sim.scenario import parse_scenario
    from rackbed.topology.yamlio import load_yaml

    path = scenarios.resolve(args.max_rate)
    sc = apply_overrides(parse_scenario(load_yaml(path), path), duration_s=args.duration)
    if args.stack is not None:
        sc = sc.model_copy(update={"stack": args.stack})
    r = max_rate(sc, args.ttft, args.tpot, start=args.rate)
    for rate, good, s in r.tried:
        console.print(f"  {rate:8.4g} req/s: {'meets' if good else 'misses'} the SLOs (TTFT p90 "
                      f"{(s.get('ttft_p90_s') or float('nan')):.3g} s, TPOT p90 "
                      f"{(s.get('tpot_p90_s') or float('nan')) * 1e3:.3g} ms, {s.get('done')}/{s.get('requests')} "
                      "done)")
    if r.rate_per_s is None:
        raise SystemExit(f"rackbed search: {path.name} meets TTFT <= {args.ttft:g} s / TPOT <= {args.tpot * 1e3:g} "
                         f"ms at no rate tried (lowest {min(t[0] for t in r.tried):.3g} req/s)")
    s = r.record
    console.print(f"[bold]max rate of {path.stem}:[/bold] {r.rate_per_s:.4g} req/s under TTFT <= {args.ttft:g} s, "
                  f"TPOT <= {args.tpot * 1e3:g} ms: {s['tokens_per_s_per_gpu']:.4g} tokens/s/GPU, "
                  f"{s['tokens_per_s_per_user']:.4g} tokens/s/user")
    return 0


def print_search(console, res) -> None:
    from rackbed.engine.cli.tables import print_table
    from rackbed.sim.report import fmt
    from rackbed.sim.search_results import axis_table, prune_summary, where_time_goes

    sp, ld = res.spec, res.load
    console.print(f"[bold]search {sp.name}[/bold]: {sp.model} on {_where(sp)}; load {ld.rate_per_s:.3g} req/s, prompt "
                  f"{ld.prompt_mean:.0f} tok (p90 {ld.prompt_p90:.0f}), output {ld.output_mean:.0f} tok -> "
                  f"{ld.input_tokens_per_s:.4g} input / {ld.output_tokens_per_s:.4g} output tok/s; SLO TTFT "
                  f"{sp.slo.ttft_s} s, TPOT {sp.slo.tpot_s * 1e3:g} ms at {sp.slo.percentile}")
    alive = sum(1 for c in res.candidates if c.pruned is None)
    console.print(f"{len(res.candidates)} candidates, {len(res.candidates) - alive} pruned analytically, "
                  f"{len(res.simulated)} simulated ({_status_counts(res.records)}), {len(res.eligible)} meet the "
                  f"SLOs, {len(res.front)} on the front; {res.wall_s:.1f} s")
    for reason, n in list(prune_summary(res).items())[:6]:
        console.print(f"  [dim]pruned {n:4d}: {reason}[/dim]")
    rows = []
    for i, r in enumerate(res.best, 1):
        s, e = r["summary"], r.get("est", {})
        rows.append([str(i), r.get("candidate", r.get("label", "")), fmt(s["mean_gpus"], 3),
                     fmt(s["tokens_per_s_per_gpu"]), fmt(s["tokens_per_s_per_user"]),
                     fmt((s.get("ttft_p90_s") or 0) * 1e3), fmt((s.get("tpot_p90_s") or 0) * 1e3),
                     fmt(s.get("cost_per_mtok_usd"), 3), fmt(s.get("tokens_per_s_per_kw")),
                     fmt(e.get("tokens_per_s_per_gpu")), fmt(e.get("tokens_per_s_per_user"))])
    per = "kW" if sp.objective == "kw" else "GPU"
    print_table(console, f"best points (Pareto front of tokens/s per {per} vs tokens/s per user)",
                ("#", "configuration", "GPUs", "tok/s/GPU", "tok/s/user", "TTFT p90 ms", "TPOT p90 ms", "$/M tok",
                 "tok/s/kW", "est tok/s/GPU", "est tok/s/user"), rows, left=("configuration",), key=2)
    for i, r in enumerate(res.best, 1):
        ex = res.explanations.get(r["key"]) or {}
        if "prefill" in ex:
            console.print(f"  #{i} why: prefill {where_time_goes(ex['prefill'])}")
            console.print(f"       decode  {where_time_goes(ex['decode'])}")
    for tab in option_tables(res):
        key = 3 if "TP" in tab.headers else 4  # topology and TP/EP (prefill); topology, EP, cap and k (decode)
        print_table(console, tab.title, tab.headers, tab.rows, text=("pruned",), key=key,
                    bare=("topology/format",))
    rows = axis_table(res)
    if rows:
        print_table(console, "per knob: best analytic estimate and best simulated point meeting the SLOs",
                    ("knob", "value", "cand.", "pruned", "sim.", "ok", "est tok/s/GPU", "sim tok/s/GPU",
                     "sim tok/s/user", "sim tok/s/GPU @ >= median user", "note"),
                    [[row["axis"], str(row["value"]), str(row["candidates"]), str(row["pruned"]),
                      str(row["simulated"]), str(row["eligible"]), fmt(row.get("est_best_tokens_per_s_per_gpu")),
                      fmt(row.get("sim_best_tokens_per_s_per_gpu")), fmt(row.get("sim_best_tokens_per_s_per_user")),
                      fmt(row.get("sim_best_tokens_per_s_per_gpu_at_median_user")), _note(row)] for row in rows],
                    text=("note",), key=2, bare=("knob", "value"))
    inv = [r for r in res.records if r.get("status") == "invalid"]
    if inv:
        reasons: dict[str, int] = {}
        for r in inv:
            reasons[r["reason"]] = reasons.get(r["reason"], 0) + 1
        for reason, n in sorted(reasons.items(), key=lambda kv: -kv[1])[:4]:
            console.print(f"  [yellow]invalid in simulation ({n}):[/yellow] {reason}")


def _where(sp) -> str:
    """The topologies a search's candidates run on, and its GPU cap (``max_gpus``) if any."""
    return ", ".join(sp.space.topology) + (f", deployments of at most {sp.max_gpus} GPUs" if sp.max_gpus else "")


def option_tables(res):
    """The analytic prefill and decode options as ``sim.report.Table``s (pruned ones with their reason)."""
    from rackbed.sim.report import Table, fmt
    from rackbed.sim.search_results import decode_table, prefill_table

    def ms(x):
        return fmt(None if x is None else x * 1e3)

    multi_topo = len(res.spec.space.topology) > 1 or len(res.spec.space.weight_format) > 1
    prows = prefill_table(res)
    cached = any("prefix_hit_rate" in r for r in prows)  # a prefix cache: the hit rate each capacity assumes
    pre = Table("Prefill options (analytic): a full batch of mean prompts; capacity = input tokens/s per GPU"
                + (" (cached share of each prompt not recomputed)" if cached else ""),
                ["topology/format", "TP", "EP", "TTFT floor ms", "batch", "step ms", "input tok/s/GPU",
                 *(["assumed hit"] if cached else []),
                 "replicas", "attn ms", "moe_gemm ms", "a2a ms", "allreduce ms", "other ms", "pruned"],
                [[f"{r['topology']}/{r['weight_format']}" if multi_topo else r["topology"], r["tp"], r["ep"],
                  ms(r["ttft_floor_s"]), r.get("batch", "-"), ms(r.get("step_s")),
                  fmt(r.get("input_tokens_per_s_per_gpu")),
                  *([f"{r['prefix_hit_rate']:.1%}" if "prefix_hit_rate" in r else "-"] if cached else []),
                  r.get("replicas", "-"), ms(r.get("attn_s")),
                  ms(r.get("moe_gemm_s")), ms(r.get("a2a_s")), ms(r.get("allreduce_s")), ms(r.get("other_s")),
                  r["pruned"][:70]] for r in prows])
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
               f"on {_where(sp)}",
               (f"load: {ld.rate_per_s:.3g} req/s, prompt {ld.prompt_mean:.0f} tokens (p90 {ld.prompt_p90:.0f}), "
                f"output {ld.output_mean:.0f} tokens; SLO TTFT <= {sp.slo.ttft_s} s and TPOT <= "
                f"{sp.slo.tpot_s * 1e3:g} ms at {sp.slo.percentile}; $/GPU-hour {sp.gpu_hour_usd}"),
               (f"{len(res.candidates)} candidates, {sum(c.pruned is not None for c in res.candidates)} pruned "
                f"analytically, {len(res.simulated)} simulated")],
        records=res.records, eligible={r["key"] for r in res.eligible}, front=res.front, best=res.best,
        explanations=res.explanations, color_by=varied[0] if varied else None,
        tables=[knob, *option_tables(res), prune],
        notes=[("tokens/s per GPU counts every allocated GPU (prefill and decode); tokens/s per user is the p50 "
                "of 1/TPOT; cost per million output tokens = ($/GPU-hour x pool GPUs x hours + energy) / output "
                "tokens x 1e6 (the whole pool for the whole run, sim/energy.py)"),
               "est = the analytic estimate the pruning used (replicas from the input-token rate and Little's law)",
               *res.notes])
