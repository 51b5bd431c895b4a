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

The rack curve (:func:`run_racks`) scales that rack to ``gb200-nvl72*N`` (6N prefillers, 3N decoders, the rate
times N; decoders that do not place are left out and the rate scaled by those kept) and measures each N in a
fresh process, optionally against another git revision's tree with an identity check of the results:

    rackbed bench sim --racks 1,2,5,10 [--sim-s 600] [--baseline REV] [--out x.json] [--figure x.png]

A point of more racks than ``--group-racks`` (default 10) runs as independent groups of at most that many
racks (:func:`rack_groups`: 100 racks are ten ten-rack deployments, group ``i`` with seed ``i``), ``--jobs``
processes at a time, and reports the groups' CPU seconds, events and workers summed: one scale-out fabric of
these racks' switches joins at most 28 racks, so a hundred racks are several deployments side by side.
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
    if args.racks is not None or args.baseline is not None:
        return _racks_cli(args, rate)
    out = run_bench(args.sim_s, rate, progress=sys.stderr.isatty())
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        from rackbed.topology.outputs import write_text

        write_text(args.out, text + "\n")  # checked (topology.outputs.prepare_file) before the benchmark
    return 0


# ---------------------------------------------------------------------------------------------- rack curve
#: one rack of the benchmark layout: prefillers and decoders (``bench_scenario``)
RACK_PREFILLERS, RACK_DECODERS = 6, 3


#: racks one simulated deployment spans at most in the rack curve; more are split into independent groups
#: (:func:`rack_groups`)
GROUP_RACKS = 10


def rack_spec(racks: int, sim_s: float, rate_per_rack: float, seed: int = 0) -> dict:
    """The benchmark scenario scaled to ``racks`` GB200 NVL72 racks (``gb200-nvl72*N``): ``6 N``
    prefillers, ``3 N`` decoders and ``rate_per_rack * N`` requests/s (:func:`_measure` takes decoders off
    when they do not place); ``seed``: the scenario's seed (0, as the one-rack benchmark, unless a group of a
    larger point)."""
    spec = bench_scenario(sim_s, rate_per_rack).model_dump(mode="json", exclude_unset=True)
    spec.update(name=f"bench-sim-nvl72x{racks}", seed=seed,
                topology="gb200-nvl72" if racks == 1 else f"gb200-nvl72*{racks}")
    spec["prefill"]["replicas"] = RACK_PREFILLERS * racks
    spec["decode"]["replicas"] = RACK_DECODERS * racks
    spec["workload"]["rate_per_s"] = rate_per_rack * racks
    return spec


def _measure(spec: dict, sim_s: float) -> dict:
    """Build and simulate ``spec`` in this process; the figures of one point of the rack curve.

    Self-contained (imports inside, plain data in and out): :func:`run_racks` runs its source in a fresh
    process of the tree it measures, the current one or a ``--baseline`` revision's. When the decoders do not
    place (``deployment:`` error), one decoder fewer is tried until they do, and the rate is scaled by the
    decoders kept (the per-decoder load stays that of one rack)."""
    import hashlib
    import json
    import time
    from typing import Any

    from rackbed.engine.core.metrics import Slo
    from rackbed.engine.core.workload import iter_requests
    from rackbed.sim.driver import simulate
    from rackbed.sim.scenario import build, parse_scenario
    from rackbed.topology.errors import UserError

    c0 = time.process_time()
    want = spec["decode"]["replicas"]
    dec = want
    while True:
        spec["decode"]["replicas"] = dec
        try:
            build(parse_scenario(spec, source="sim/bench.py"))
            break
        except UserError as exc:
            if not str(exc).startswith("deployment:") or dec <= 1:
                raise
            dec -= 1
    spec["workload"]["rate_per_s"] *= dec / want
    sc = parse_scenario(spec, source="sim/bench.py")
    b = build(sc)
    dep: Any = b.deployment
    reqs = list(iter_requests(sc.workload, sc.seed))
    setup = time.process_time() - c0
    c0 = time.process_time()
    res = simulate(dep, reqs, b.cost_model, seed=sc.seed, until_s=sim_s, progress=False,
                   slo=Slo(ttft_s=sc.slo.ttft_s, tpot_s=sc.slo.tpot_s), kv_chunks=b.cost_model.kv_chunks,
                   decision_log=False)
    cpu = time.process_time() - c0
    h = hashlib.sha256()
    for part in (res.rows, res.groups, sorted(res.breakdown_s.items())):
        h.update(repr(part).encode())
    h.update(json.dumps(res.metrics, sort_keys=True, default=repr).encode())
    events = res.perf["events"]
    return {"topology": sc.topology, "prefillers": len(dep.prefillers),
            "decoders": len(dep.decoders), "decoders_asked": want,
            "rate_per_s": spec["workload"]["rate_per_s"], "sim_s": sim_s, "cpu_s": cpu, "setup_cpu_s": setup,
            "cpu_s_per_sim_hour": cpu * 3600.0 / sim_s, "events": events,
            "decode_steps": res.perf["decode_steps"], "events_per_cpu_s": events / max(cpu, 1e-9),
            "us_per_event": cpu / max(events, 1) * 1e6, "requests_done": res.metrics["requests"]["done"],
            "digest": h.hexdigest()[:16]}


def _child(tree, spec: dict, sim_s: float) -> dict:
    """:func:`_measure` in a fresh Python process whose ``rackbed`` is ``tree``'s."""
    import inspect
    import os
    import subprocess
    import sys

    from rackbed.topology.errors import UserError

    code = (inspect.getsource(_measure) + "\nimport json, sys\n"
            "print(json.dumps(_measure(json.loads(sys.argv[1]), float(sys.argv[2]))))\n")
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    env.pop("PYTHONPATH", None)
    p = subprocess.run([sys.executable, "-c", code, json.dumps(spec), repr(sim_s)], cwd=tree, env=env,
                       capture_output=True, text=True)
    if p.returncode != 0:
        last = (p.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise UserError(f"bench sim: the run in {tree} failed: {last}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def rack_groups(racks: int, group_racks: int = GROUP_RACKS) -> list[int]:
    """Racks per independent group of an N-rack point: one group up to ``group_racks``, else
    ``ceil(N / group_racks)`` groups as even as possible (100 racks in groups of 10: ten of 10). A group is
    a deployment of its own (its own scale-out fabric, scheduler and arrivals, ``rate_per_rack`` times its
    racks): a two-level fat tree of the GB200 racks' 64-port switches joins at most 28 racks (2,048 NICs), so
    a point beyond that is several fabrics whatever the scheduler does."""
    n = -(-racks // group_racks)
    return [racks // n + (1 if i < racks % n else 0) for i in range(n)]


def _run_groups(tree, specs: list[dict], sim_s: float, jobs: int) -> dict:
    """:func:`_child` of every group's spec in ``tree``, ``jobs`` processes at a time; one group's figures as
    they are, several summed (CPU seconds, events, workers, rate, requests) with a digest of their digests and
    the groups' own figures under ``groups``. ``wall_s``: the whole point's wall time."""
    import hashlib
    import time
    from concurrent.futures import ThreadPoolExecutor

    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=max(1, min(jobs, len(specs)))) as pool:
        res = list(pool.map(lambda sp: _child(tree, sp, sim_s), specs))
    wall = time.perf_counter() - t0
    if len(res) == 1:
        return {**res[0], "wall_s": wall}
    tops = ", ".join(sorted({r["topology"] for r in res}))
    out: dict = {"topology": f"{len(res)} x ({tops})", "sim_s": sim_s}
    for k in ("prefillers", "decoders", "decoders_asked", "rate_per_s", "cpu_s", "setup_cpu_s", "events",
              "decode_steps", "requests_done"):
        out[k] = sum(r[k] for r in res)
    cpu = out["cpu_s"]
    out.update(cpu_s_per_sim_hour=cpu * 3600.0 / sim_s, events_per_cpu_s=out["events"] / max(cpu, 1e-9),
               us_per_event=cpu / max(out["events"], 1) * 1e6, wall_s=wall, jobs=jobs,
               digest=hashlib.sha256(" ".join(r["digest"] for r in res).encode()).hexdigest()[:16],
               groups=res)
    return out


def parse_racks(text: str) -> list[int]:
    """``--racks 1,2,5,10`` -> ``[1, 2, 5, 10]`` (one-line error otherwise)."""
    from rackbed.topology.errors import UserError

    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        out = []
    if not out or any(n < 1 for n in out):
        raise UserError(f"--racks: expected positive integers separated by commas (e.g. 1,2,5,10), "
                        f"got {text!r}")
    return out


def _export(repo, rev: str, dest) -> str:
    """``rev``'s tree (``git archive``) unpacked into ``dest``; returns the commit id."""
    import io
    import subprocess
    import tarfile

    from rackbed.topology.errors import UserError

    p = subprocess.run(["git", "-C", str(repo), "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}"],
                       capture_output=True, text=True)
    if p.returncode != 0:
        raise UserError(f"--baseline: {rev!r} is not a commit of {repo}")
    commit = p.stdout.strip()
    tar = subprocess.run(["git", "-C", str(repo), "archive", "--format=tar", commit], capture_output=True,
                         check=True)
    with tarfile.open(fileobj=io.BytesIO(tar.stdout)) as t:
        t.extractall(dest, filter="tar")
    return commit


def run_racks(racks: list[int], sim_s: float, rate_per_rack: float, baseline: str | None = None,
              log=None, group_racks: int = GROUP_RACKS, jobs: int = 1) -> dict:
    """The rack curve: for each N of ``racks``, :func:`_measure` of :func:`rack_spec` in a fresh process of
    this tree and, with ``baseline`` (a git revision), of that revision's tree (unpacked into a temporary
    folder), the two runs of one N back to back. Per point: the layout run, CPU seconds of ``simulate`` and
    per simulated hour (``sim_s`` extrapolated), events, events per CPU second, µs per event, its ratio to the
    first point's, and with a baseline the CPU ratio baseline / current and whether the results are identical (a
    digest of the request rows, groups, breakdown and metrics). A point of more than ``group_racks`` racks
    runs as independent groups (:func:`rack_groups`; group ``i`` with seed ``i``), ``jobs`` processes at a
    time, and reports their sums (:func:`_run_groups`)."""
    import tempfile
    from pathlib import Path

    here = Path(__file__).resolve().parents[1]
    out: dict = {"sim_s": sim_s, "rate_per_rack": rate_per_rack, "python": platform.python_version(),
                 "machine": platform.processor() or platform.machine(), "group_racks": group_racks,
                 "jobs": jobs, "points": []}
    with tempfile.TemporaryDirectory(prefix="rackbed-baseline-") as tmp:
        if baseline is not None:
            out["baseline"] = baseline
            out["baseline_commit"] = _export(here, baseline, tmp)
        for n in racks:
            sizes = rack_groups(n, group_racks)
            specs = [rack_spec(k, sim_s, rate_per_rack, seed=i) for i, k in enumerate(sizes)]
            point: dict = {"racks": n}
            if baseline is not None:
                point["baseline"] = _run_groups(tmp, json.loads(json.dumps(specs)), sim_s, jobs)
            point.update(_run_groups(here, specs, sim_s, jobs))
            if baseline is not None:
                bl = point["baseline"]
                point["speedup"] = bl["cpu_s"] / max(point["cpu_s"], 1e-9)
                point["identical"] = bl["digest"] == point["digest"] and bl["events"] == point["events"]
            out["points"].append(point)
            if log is not None:
                log(_row(point, out["points"][0]))
    one = out["points"][0]["us_per_event"]
    for p in out["points"]:
        p["us_per_event_vs_first"] = p["us_per_event"] / one
    return out


def _row(p: dict, first: dict) -> str:
    s = (f"{p['racks']:>3} racks {p['prefillers']:>3}P+{p['decoders']:<3}D {p['rate_per_s']:7.1f} req/s  "
         f"{p['cpu_s_per_sim_hour']:8.1f} CPU-s/sim-h  {p['events']:>9} events  "
         f"{p['events_per_cpu_s']:9.0f} ev/CPU-s  "
         f"{p['us_per_event']:6.2f} us/ev (x{p['us_per_event'] / first['us_per_event']:.2f})")
    if "baseline" in p:
        s += (f"  | baseline {p['baseline']['cpu_s_per_sim_hour']:8.1f} CPU-s/sim-h  "
              f"speedup x{p['speedup']:.2f}  "
              f"{'identical' if p['identical'] else 'RESULTS DIFFER'}")
    if p["decoders"] < p["decoders_asked"]:
        s += f"  ({p['decoders_asked']} decoders do not place: {p['decoders']} kept, rate scaled)"
    if "groups" in p:
        s += f"  [{p['topology']}: independent groups, {p['jobs']} at a time, {p['wall_s']:.0f} s wall]"
    return s


def _racks_cli(args, rate: float) -> int:
    import os
    import sys

    from rackbed.topology.errors import UserError

    racks = parse_racks(args.racks if args.racks is not None else "1")
    group = args.group_racks if args.group_racks is not None else GROUP_RACKS
    jobs = args.jobs if args.jobs is not None else (os.cpu_count() or 1)
    for name, v in (("--group-racks", group), ("--jobs", jobs)):
        if v < 1:
            raise UserError(f"{name}: must be >= 1, got {v}")
    out = run_racks(racks, args.sim_s, rate, args.baseline, log=lambda s: print(s, flush=True),
                    group_racks=group, jobs=jobs)
    text = json.dumps(out, indent=1)
    if args.out:
        from rackbed.topology.outputs import write_text

        write_text(args.out, text + "\n")
    else:
        print(text, file=sys.stderr if sys.stdout.isatty() else sys.stdout)
    if args.figure:
        plot_racks(out, args.figure)
    return 0


def plot_racks(out: dict, path) -> None:
    """The rack curve as a PNG: CPU seconds per simulated hour against racks (left) and µs per event (right),
    this tree and, when measured, the baseline; logarithmic rack (and CPU second) axes when the racks span
    more than a factor of ten (1 .. 100)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from rackbed.topology.outputs import replacing

    pts = out["points"]
    n = [p["racks"] for p in pts]
    fig, (a, b) = plt.subplots(1, 2, figsize=(8.0, 3.2), dpi=100)
    series = [("this tree", pts, "o-")]
    if "baseline" in out:
        label = f"baseline {out['baseline']} ({out['baseline_commit'][:10]})"
        series.insert(0, (label, [p["baseline"] for p in pts], "s--"))
    for label, ps, style in series:
        a.plot(n, [p["cpu_s_per_sim_hour"] for p in ps], style, label=label)
        b.plot(n, [p["us_per_event"] for p in ps], style, label=label)
    a.set_xlabel("GB200 NVL72 racks")
    a.set_ylabel("CPU s per simulated hour")
    b.set_xlabel("GB200 NVL72 racks")
    b.set_ylabel("CPU µs per event")
    wide = max(n) > 10 * min(n)
    if wide:
        a.set_yscale("log")
    else:
        a.set_ylim(bottom=0)
    b.set_ylim(bottom=0)
    for ax in (a, b):
        if wide:
            ax.set_xscale("log")
            ax.minorticks_off()
        ax.set_xticks(n, [str(x) for x in n])
        ax.grid(True, lw=0.3, alpha=0.5)
        ax.legend(fontsize=7)
    fig.suptitle(f"rackbed bench sim --racks ({out['sim_s']:g} simulated s per point, extrapolated to an hour)",
                 fontsize=8)
    fig.tight_layout()
    with replacing(path, "wb") as f:
        fig.savefig(f, format="png")
    plt.close(fig)
