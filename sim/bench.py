"""``rackbed bench sim``: how fast the simulator runs the write-up's largest serving scenario.

The scenario (:func:`bench_scenario`) is fixed: Qwen3-235B-A22B (MXFP8) on one GB200 NVL72, laid out like
``scenarios/nvl72-default.yaml`` — six TP=4/EP=4 prefillers (24 GPUs), three DP-EP=16 decoders (48 GPUs), MTP
k=1 p=0.8, so all 72 GPUs serve — under the Mooncake conversation trace looped (``loop: true``) and sped up to
``rate_per_s`` requests per second (default :data:`DEFAULT_RATE_PER_S`, which keeps the prefillers ~90 % busy and
the decoders' batches near their cap: the rack is loaded, not overloaded), with ``sim.costs``' cost model
(``sim.scenario.ScenarioCostModel``) and the decision log off. It is simulated for ``sim_s`` seconds (default one
hour) and the wall time is reported:

    rackbed bench sim [--sim-s 3600] [--rate 20] [--out results/bench_sim.json]

Output (JSON, also printed): ``wall_s`` (the ``simulate`` call: building the scenario and generating requests are
excluded and reported apart as ``setup_s``), ``cpu_s`` (process CPU time of the same call: the figure to compare
on a shared machine, where wall time depends on the other jobs), ``sim_s_per_wall_s``, ``events`` (SimPy events plus decode
steps the driver advanced without one, see ``sim/driver.py``), ``events_per_s``, ``decode_steps``,
``decode_steps_per_wall_s``, and what the run served (requests, utilisation, TTFT/TPOT p50) so that a faster
simulator can be seen to simulate the same thing. The target is ``wall_s <= 10`` for one simulated hour
on one core.
"""

from __future__ import annotations

import json
import platform
import time

#: requests/s of the looped Mooncake trace (mean prompt ≈ 13.7k tokens, mean output ≈ 350 tokens)
DEFAULT_RATE_PER_S = 20.0


def bench_scenario(sim_s: float = 3600.0, rate_per_s: float = DEFAULT_RATE_PER_S):
    """The benchmark's :class:`~sim.scenario.ServingScenario` (module docstring)."""
    from rackbed.sim.scenario import parse_scenario

    if not sim_s > 0:
        raise ValueError(f"--sim-s: must be > 0, got {sim_s}")
    if not rate_per_s > 0:
        raise ValueError(f"--rate: must be > 0, got {rate_per_s}")
    return parse_scenario({
        "name": "bench-sim-nvl72",
        "description": "simulator benchmark: Qwen3-235B on one GB200 NVL72 under the looped Mooncake trace",
        "seed": 0,
        "topology": "gb200-nvl72",
        "model": "qwen3-235b-a22b",
        "weight_format": "mxfp8",
        "kv_dtype": "bf16",
        "prefill": {"tp": 4, "ep": 4, "replicas": 6, "max_batch_tokens": 16384, "kv_streams": 2},
        "decode": {"ep": 16, "replicas": 3, "max_batch_per_rank": 64, "page_tokens": 64},
        "mtp": {"draft_k": 1, "accept_p": 0.8, "draft": {"kind": "mtp", "layers": 1}},  # the trained MTP head
        "workload": {"kind": "trace", "name": "mooncake", "rate_per_s": rate_per_s, "loop": True,
                     "duration_s": sim_s},
        "slo": {"ttft_s": 2.0, "tpot_s": 0.05},
        "sim": {"until_s": sim_s, "decision_log": False},
    }, source="sim/bench.py")


def run_bench(sim_s: float = 3600.0, rate_per_s: float = DEFAULT_RATE_PER_S, progress: bool = False) -> dict:
    """Build and simulate the benchmark scenario; return the figures (module docstring)."""
    from rackbed.engine.core.metrics import Slo
    from rackbed.engine.core.workload import iter_requests
    from rackbed.sim.driver import simulate
    from rackbed.sim.scenario import build

    t0 = time.perf_counter()
    sc = bench_scenario(sim_s, rate_per_s)
    b = build(sc)
    reqs = list(iter_requests(sc.workload, sc.seed))
    setup_s = time.perf_counter() - t0
    c0 = time.process_time()
    res = simulate(b.deployment, reqs, b.cost_model, seed=sc.seed, until_s=sim_s, progress=progress,
                   slo=Slo(ttft_s=sc.slo.ttft_s, tpot_s=sc.slo.tpot_s), kv_chunks=b.cost_model.kv_chunks,
                   decision_log=False)
    cpu_s = time.process_time() - c0
    p, m = res.perf, res.metrics
    lat = m.get("latency_s", {})
    return {
        "scenario": sc.name, "model": sc.model, "topology": sc.topology, "rate_per_s": rate_per_s,
        "sim_s": sim_s, "wall_s": p["wall_s"], "cpu_s": cpu_s, "setup_s": setup_s,
        "sim_s_per_wall_s": p["sim_s_per_wall_s"], "events": p["events"], "events_per_s": p["events_per_s"],
        "decode_steps": p["decode_steps"], "decode_steps_per_wall_s": p["decode_steps_per_wall_s"],
        "requests": m["requests"], "utilisation": m["utilisation"],
        "ttft_p50_s": (lat.get("ttft") or {}).get("p50"), "tpot_p50_s": (lat.get("tpot") or {}).get("p50"),
        "target_wall_s_per_sim_hour": 10.0, "wall_s_per_sim_hour": p["wall_s"] * 3600.0 / sim_s,
        "cpu_s_per_sim_hour": cpu_s * 3600.0 / sim_s,
        "python": platform.python_version(), "machine": platform.processor() or platform.machine(),
    }


def run_cli(args) -> int:
    """``rackbed bench sim`` (see :mod:`engine.cli.bench`)."""
    import sys

    rate = args.rate if args.rate is not None else DEFAULT_RATE_PER_S
    out = run_bench(args.sim_s, rate, progress=sys.stderr.isatty())
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        from rackbed.topology.outputs import write_text

        write_text(args.out, text + "\n")  # checked (topology.outputs.prepare_file) before the benchmark
    return 0
