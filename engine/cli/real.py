"""``rackbed real SCENARIO``: run a serving scenario on the local GPUs (or CPU) with the simulator's scheduler."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from rackbed.topology.outputs import add_force, prepare_dir, write_text


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("real", help="run a scenario for real on local GPUs/CPU (same scheduler as the simulator)",
                       description="Run SCENARIO on the local devices: one process per GPU of the deployment, the "
                       "simulator's scheduler and worker loop, measured durations. Writes the simulator's output "
                       "files plus real.json (per-plan measured times, versions, the cross-mode replay check).")
    p.add_argument("scenario", help="scenario YAML file or shipped name")
    p.add_argument("--out", type=Path, default=None, help="output folder (default: rackbed-out/<name>-real)")
    add_force(p)
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default=None, help="override real.device")
    p.add_argument("--max-requests", type=int, default=None, help="replay only the first N requests")
    p.add_argument("--profile-plans", type=int, default=None, metavar="N",
                   help="after the run, re-run up to N sampled plans of each kind per worker under "
                        "torch.profiler and record their time per cost-model term in real.json (overrides "
                        "real.profile_plans)")
    p.set_defaults(func=_main)


def _versions() -> dict:
    import datetime
    import platform

    import torch

    v = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
         "python": platform.python_version(), "torch": torch.__version__, "host": platform.node()}
    if torch.cuda.is_available():
        v["device"] = torch.cuda.get_device_name(0)
        v["cuda"] = torch.version.cuda
        v["n_gpus"] = torch.cuda.device_count()
        try:
            v["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:
            pass
        from rackbed.engine.real.model import GROUPED_IMPL
        from rackbed.kernels.grouped_gemm import cute_unavailable

        # which expert GEMMs the ranks run: the CuTe DSL decode kernel where it measured faster, or torch
        v["grouped_impl"] = GROUPED_IMPL
        v["cute_dsl"] = cute_unavailable() or "available"
        v["graphs"] = ("static (RACKBED_STATIC_STEPS=1)" if os.environ.get("RACKBED_STATIC_STEPS") == "1" else
                       "off (RACKBED_NO_GRAPHS=1)" if os.environ.get("RACKBED_NO_GRAPHS") == "1" else "on")
        from rackbed.kernels.paged_attention import unavailable

        # decode attention: the Triton kernel reading pages in place, or the torch gather (and why)
        why = unavailable(torch.device("cuda"))
        v["paged_attention"] = "triton" if why is None else f"torch ({why})"
    return v


def _main(args: argparse.Namespace) -> int:
    if args.profile_plans is not None and args.profile_plans < 0:
        from rackbed.topology.errors import UserError

        raise UserError(f"--profile-plans {args.profile_plans}: must be >= 0 (plans of each kind per worker)")
    try:
        import torch  # noqa: F401
    except ModuleNotFoundError as exc:
        if exc.name != "torch":
            raise
        from rackbed.topology.errors import UserError

        raise UserError("rackbed real needs torch, which is not installed: pip install 'rackbed[real]'") from None
    from rich.console import Console

    from rackbed import scenarios
    from rackbed.engine.core.deployment import kv_capacities
    from rackbed.engine.core.workload import generate
    from rackbed.engine.real.driver import bad_endings, replay, run_real
    from rackbed.engine.real.rank_setup import kv_rings
    from rackbed.sim.driver import simulate
    from rackbed.sim.outputs import write_all
    from rackbed.sim.scenario import build, load_scenario, print_summary

    console = Console()
    path = scenarios.resolve(args.scenario)
    sc = load_scenario(path)
    out = prepare_dir(args.out or Path("rackbed-out") / f"{path.stem}-real", force=args.force,
                      default=args.out is None)
    b = build(sc)
    reqs = generate(sc.workload, sc.seed)
    if args.max_requests:
        reqs = reqs[: args.max_requests]
    rs = sc.real
    n_profile = rs.profile_plans if args.profile_plans is None else args.profile_plans
    tiny = None
    res, run = run_real(b, reqs, simulate=simulate, device=args.device or rs.device, dtype=rs.dtype,
                        weights=rs.weights, seed=rs.weights_seed, prefill_pages=rs.prefill_pages,
                        decode_pages=rs.decode_pages, kill=[(k.at_s, k.gpu) for k in rs.kill], tiny_cfg=tiny,
                        profile_plans=n_profile, mtp_agree=rs.mtp_agree)
    write_all(res, out)
    rep = replay(b, reqs, run.records, simulate=simulate, seed=sc.seed, deaths=run.deaths)
    same = res.log.decisions() == rep.log.decisions()
    doc = {
        "scenario": str(path), "versions": _versions(),
        "mtp": (f"the model's MTP module drafts {b.deployment.mtp.draft_k} token(s) per decode step, one verify "
                "forward of the target accepts them (greedy); the scheduler counts the real tokens"
                if b.deployment.mtp.draft_k else
                "no drafts (mtp.draft_k: 0): one forward per decode step"),
        "model": {"name": b.model.name, "layers": run.cfg.n_layers, "hidden": run.cfg.hidden, "dtype": rs.dtype},
        "kv_bytes_per_token": b.deployment.kv_bytes_per_token,
        "kv_capacity": kv_capacities(b.deployment),   # what the scheduler planned with: the ranks' caches
        # sliding-window layers: one ring of ring_pages pages per sequence, *_rings of them per rank
        "kv_rings": kv_rings(b, run.cfg, rs.prefill_pages, rs.decode_pages, reqs),
        "deaths": [{"t_s": t, "rank": r, "gpu": g} for t, r, g in run.deaths],
        "rank_errors": run.pool.errors,
        "graphs": {str(r): g for r, g in sorted(run.pool.graph_reports.items())},
        "replay_identical_decisions": same,
        "plans": [{"worker": w, "kind": k, "key": key, "measured_s": m, "worker_s": ws,
                   **({"accepted": acc[0]} if acc else {})} for w, k, key, m, ws, *acc in run.records],
        "generated_tokens": {str(k): len(v) for k, v in sorted(run.generated.items())},
        "metrics": res.metrics,
    }
    if n_profile:   # engine.real.profiling: the sampled plans' time per cost-model term (re-run after it)
        doc["term_profile"] = run.term_profile
        if run.term_profile_error:
            doc["term_profile_error"] = run.term_profile_error
            print(f"rackbed: warning: real run: profiling the sampled plans failed: {run.term_profile_error}",
                  file=sys.stderr)
    write_text(out / "real.json", json.dumps(doc, indent=1, default=str))
    console.print(f"[dim]real run on {doc['versions'].get('device', 'cpu')}; deaths: {len(run.deaths)}; "
                  f"simulator replay of the measured durations gives identical decisions: {same}[/dim]")
    print_summary(console, b, res)
    console.print(f"[dim]wrote {out}[/dim]")
    bad = bad_endings(res.metrics)
    if bad:
        print("rackbed: error: real run: requests ended without an acceptable reason: "
              + ", ".join(f"{n} {why}" for why, n in sorted(bad.items())), file=sys.stderr)
    return 0 if same and not bad else 1
