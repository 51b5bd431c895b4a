"""Capacity on a fixed GPU budget: the best deployment, its tokens/s per GPU and per user, under SLOs.

``rackbed search`` answers "which deployment for *this* load"; a capacity question is "how much load do these
GPUs carry under the SLOs, at how many tokens/s per GPU and per user, and how do two racks compare". This module
poses it with the search as it is — by sweeping the request rate:

    rackbed capacity --out results/capacity --tag before      # the shipped specs (below)
    rackbed capacity scenarios/sweeps/capacity-qwen235-h200.yaml --out DIR --jobs 2

A capacity spec (YAML ``kind: capacity``) is a search spec (:class:`sim.search.SearchSpec`, key ``search``; its
workload synthetic) plus the request rates to try, optionally several values of the search's prefill headroom, and
the GPU budget (default: the topology's GPUs). Each (topology, weight format) of the search space is a *case*; for
every case, rate and headroom one search runs with the workload's arrival rate set to that rate and only that
topology and format in its space, so that each format gets the whole simulation budget (one search over all
formats would let the best format's candidates crowd the others out). The search derives replica counts from the
load (prefill: input tokens/s x headroom / analytic capacity), so near the budget the headroom decides what fits;
trying a lower one lets the simulation, not the heuristic, say whether the queueing still meets the TTFT SLO.
Searches write to ``WORK/<spec>/<topology>/<format>/rate-<r>-h<headroom>/results.jsonl`` and are resumable; the
default WORK holds the git commit, so a re-run on other code starts afresh.

A case's **chosen** point: among the simulated points that meet the SLOs (:func:`sim.search_results.meets_slo`: every
request completed, TTFT and TPOT at the SLO percentile within bounds) and use at most ``gpu_budget`` GPUs, the one
at the highest rate (the load the budget carries); at that rate the one using the fewest GPUs, then the fastest
per user (whichever headroom sized it). Figures:

* tokens/s per budget GPU: output tokens/s / ``gpu_budget`` — what the whole budget delivers, idle GPUs included;
* tokens/s per used GPU: output tokens/s / the deployment's GPUs (``rackbed search``'s tokens/s per GPU);
* tokens/s per user: p50 over requests of 1/TPOT (the search's figure); ``user_at_tpot_p90`` = 1/TPOT p90, the
  slowest decile's.

**Ratio at equal tokens/s per user**, for each pair of cases on different topologies (the topology listed first is
the numerator): ``f(u)`` = the most tokens/s per budget (or used) GPU among a case's eligible points whose tokens/s
per user is >= ``u``, at ``u`` = each of the two chosen points' tokens/s per user; None where a case has no point
that fast. At the slower chosen point's ``u`` it is the ratio of the chosen points' figures; at the faster one's it
asks the slower case to run as fast per user.

Output: ``OUT/<tag>.json`` (date, git commit, command, versions, calibration note and caveats of each case, per
rate the search's counts, its best eligible point or its nearest miss, the chosen point, each case's front, the
ratios) and ``OUT/<tag>.md`` (the tables). No per-request data.
"""

from __future__ import annotations

import math
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from rackbed.sim.search import SearchSpec
from rackbed.topology.errors import UserError, from_validation
from rackbed.topology.outputs import write_text

#: The specs ``rackbed capacity`` runs when none is named (under ``scenarios/sweeps/``).
DEFAULT_SPECS = ("capacity-qwen235-gb200", "capacity-qwen235-h200")


class CapacitySpec(BaseModel):
    """What to size (module docstring)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["capacity"] = "capacity"
    name: str
    description: str = ""
    rates_per_s: tuple[float, ...]
    prefill_headroom: tuple[float, ...] | None = None
    gpu_budget: int | None = Field(None, ge=1)
    search: SearchSpec

    @field_validator("rates_per_s", "prefill_headroom")
    @classmethod
    def _positive(cls, v):
        if v is not None and (not v or any(not (r > 0 and math.isfinite(r)) for r in v)):
            raise ValueError("expected a non-empty list of positive numbers")
        return None if v is None else tuple(sorted(set(v)))

    @property
    def headrooms(self) -> tuple[float, ...]:
        return self.prefill_headroom or (self.search.prefill_headroom,)


def parse_capacity(data: Mapping, source: str | Path | None = None) -> CapacitySpec:
    try:
        spec = CapacitySpec.model_validate(data)
    except ValidationError as exc:
        raise from_validation(exc, source) from None
    if spec.search.workload.kind != "synthetic":
        raise UserError(f"{source or 'capacity spec'}: search.workload.kind: must be synthetic (the rate sweep sets "
                        "its arrival rate)")
    return spec


def load_capacity(path: str | Path) -> CapacitySpec:
    """A capacity spec from a YAML file, or a name under ``scenarios/sweeps/``."""
    from rackbed.sim.sweep import SWEEPS_DIR
    from rackbed.topology.yamlio import load_yaml

    p = Path(path)
    if not p.exists() and p.suffix not in (".yaml", ".yml") and (SWEEPS_DIR / f"{path}.yaml").exists():
        p = SWEEPS_DIR / f"{path}.yaml"
    if not p.exists():
        raise FileNotFoundError(f"{path}: no such capacity spec")
    spec = parse_capacity(load_yaml(p), p)
    _check_budget(spec, p)
    return spec


def _check_budget(spec: CapacitySpec, source) -> None:
    from rackbed import topology

    if spec.gpu_budget is None:
        return
    for t in spec.search.space.topology:
        n = topology.load(t).n_gpus
        if spec.gpu_budget > n:
            raise UserError(f"{source}: gpu_budget: {spec.gpu_budget} GPUs exceeds {t}'s {n} GPUs")


def case_search(spec: CapacitySpec, topology: str, weight_format: str, rate_per_s: float,
                headroom: float | None = None) -> SearchSpec:
    """The search of one case at one rate (and prefill headroom): the spec's search with that rate, topology and
    format only."""
    s = spec.search
    h = s.prefill_headroom if headroom is None else headroom
    wl = s.workload.model_copy(update={"arrival": s.workload.arrival.model_copy(update={"rate_per_s": rate_per_s})})
    space = s.space.model_copy(update={"topology": (topology,), "weight_format": (weight_format,)})
    return s.model_copy(update={"name": f"{spec.name}-{_safe(topology)}-{weight_format}-r{rate_per_s:g}-h{h:g}",
                                "workload": wl, "space": space, "prefill_headroom": h})


def _safe(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]", "x", name)


# ------------------------------------------------------------------------------------------------------------------
# Points, choice, ratios (pure)


def deployment_gpus(overrides: Mapping) -> int:
    """GPUs a search candidate deploys: prefill replicas x max(TP, EP) + decode replicas x EP."""
    return (overrides["prefill.replicas"] * max(overrides["prefill.tp"], overrides["prefill.ep"])
            + overrides["decode.replicas"] * overrides["decode.ep"])


def config_label(overrides: Mapping) -> str:
    o = overrides
    return (f"P{o['prefill.replicas']}xTP{o['prefill.tp']}/EP{o['prefill.ep']} + D{o['decode.replicas']}x"
            f"EP{o['decode.ep']}, b<={o['decode.max_batch_per_rank']}, MTP k={o['mtp.draft_k']}")


def point_of(rec: Mapping, rate_per_s: float, gpu_budget: int, slo) -> dict:
    """The compact figures of one simulated search record (module docstring for the definitions)."""
    ov = rec["overrides"]
    p: dict[str, Any] = {"rate_per_s": rate_per_s, "key": rec["key"], "config": config_label(ov),
                         "gpus": deployment_gpus(ov), "status": rec.get("status"), "overrides": dict(ov)}
    if rec.get("status") != "ok":
        p["reason"] = rec.get("reason", "")
        return p
    from rackbed.sim.search_results import meets_slo

    s = rec["summary"]
    tpot90 = s.get("tpot_p90_s")
    p.update(meets_slo=meets_slo(rec, slo.ttft_s, slo.tpot_s, slo.percentile), requests=s.get("requests"),
             done=s.get("done"), output_tokens_per_s=s.get("output_tokens_per_s"),
             tokens_per_s_per_budget_gpu=(s.get("output_tokens_per_s") or 0.0) / gpu_budget,
             tokens_per_s_per_used_gpu=s.get("tokens_per_s_per_gpu"), user=s.get("tokens_per_s_per_user"),
             user_at_tpot_p90=1.0 / tpot90 if tpot90 else None,
             ttft_p50_s=s.get("ttft_p50_s"), ttft_p90_s=s.get("ttft_p90_s"),
             tpot_p50_s=s.get("tpot_p50_s"), tpot_p90_s=tpot90, util_prefill=s.get("util_prefill"),
             util_decode=s.get("util_decode"), est_user=(rec.get("est") or {}).get("tokens_per_s_per_user"))
    return p


def eligible(points: Sequence[Mapping], gpu_budget: int) -> list[Mapping]:
    """Points that meet the SLOs and fit the budget."""
    return [p for p in points if p.get("meets_slo") and p["gpus"] <= gpu_budget]


def choose(points: Sequence[Mapping], gpu_budget: int) -> Mapping | None:
    """The chosen point (module docstring): highest rate, then fewest GPUs, then fastest per user."""
    el = eligible(points, gpu_budget)
    return max(el, key=lambda p: (p["rate_per_s"], -p["gpus"], p["user"]), default=None)


def per_gpu_at_user(points: Sequence[Mapping], u: float, per: str = "budget") -> Mapping | None:
    """The point with the most tokens/s per ``per`` ("budget" or "used") GPU among ``points`` whose tokens/s per
    user is at least ``u`` (None when none is that fast)."""
    fast = [p for p in points if p["user"] >= u]
    return max(fast, key=lambda p: (p[f"tokens_per_s_per_{per}_gpu"], p["user"]), default=None)


def front(points: Sequence[Mapping]) -> list[Mapping]:
    """Pareto front of (tokens/s per budget GPU, tokens/s per user), by tokens/s per budget GPU descending."""
    from rackbed.sim.pareto import pareto_indices

    idx = pareto_indices([(p["tokens_per_s_per_budget_gpu"], p["user"]) for p in points])
    return sorted((points[i] for i in idx), key=lambda p: -p["tokens_per_s_per_budget_gpu"])


def ratios(case_a: Mapping, case_b: Mapping) -> list[dict]:
    """``case_a / case_b`` at equal tokens/s per user (module docstring), one row per ``u``."""
    ca, cb = case_a.get("chosen"), case_b.get("chosen")
    if ca is None or cb is None:
        return [{"u": None, "note": "no eligible point in " + (_case_name(case_a) if ca is None
                                                               else _case_name(case_b))}]
    ea, eb = case_a["_eligible"], case_b["_eligible"]
    rows = []
    for u in sorted({ca["user"], cb["user"]}):
        row: dict[str, Any] = {"u": u}
        for per in ("budget", "used"):
            pa, pb = per_gpu_at_user(ea, u, per), per_gpu_at_user(eb, u, per)
            k = f"tokens_per_s_per_{per}_gpu"
            row[f"a_{per}"] = _short(pa) if pa else None
            row[f"b_{per}"] = _short(pb) if pb else None
            row[f"ratio_{per}"] = pa[k] / pb[k] if pa and pb and pb[k] else None
        rows.append(row)
    return rows


def _short(p: Mapping) -> dict:
    return {k: p.get(k) for k in ("rate_per_s", "prefill_headroom", "config", "gpus", "tokens_per_s_per_budget_gpu",
                                  "tokens_per_s_per_used_gpu", "user", "est_user", "ttft_p90_s", "tpot_p90_s")}


def _case_name(c: Mapping) -> str:
    return f"{c['topology']} {c['weight_format']}"


# ------------------------------------------------------------------------------------------------------------------
# Running


@dataclass
class CapacityRun:
    specs: list[CapacitySpec]
    cases: list[dict]   # run_case's dicts; "_eligible" (every eligible point) stays out of the JSON
    ratios: list[dict]
    wall_s: float
    cpu_s: float
    simulated: int
    meta: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {**self.meta, "wall_s": self.wall_s, "cpu_s": self.cpu_s, "simulated_points": self.simulated,
                "simulation_cpu_s": sum(c["simulation_cpu_s"] for c in self.cases),
                "definitions": DEFINITIONS,
                "specs": [s.model_dump(mode="json", exclude_defaults=False) for s in self.specs],
                "cases": [{k: v for k, v in c.items() if not k.startswith("_")} for c in self.cases],
                "ratios": self.ratios}


DEFINITIONS = {
    "chosen": "among simulated points meeting the SLOs (all requests done, TTFT and TPOT at the SLO percentile "
              "within bounds) using <= gpu_budget GPUs: the highest rate, then the fewest GPUs, then the "
              "fastest per user",
    "tokens_per_s_per_budget_gpu": "output tokens/s / gpu_budget (idle GPUs of the budget count)",
    "tokens_per_s_per_used_gpu": "output tokens/s / GPUs of the deployment (prefill + decode)",
    "user": "tokens/s per user: p50 over requests of 1/TPOT",
    "user_at_tpot_p90": "1 / TPOT p90 (the slowest decile of users)",
    "cpu_s": "CPU seconds of this run's process (every simulation it ran when --jobs is 1; none it resumed)",
    "simulation_cpu_s": "CPU seconds the simulated points took when they ran (this run or an earlier one it resumed)",
    "ratio": "a/b of the most tokens/s per GPU among eligible points with tokens/s per user >= u, u = each "
             "chosen point's tokens/s per user; a = the topology listed first",
}


def run_case(spec: CapacitySpec, topology: str, weight_format: str, work: Path, *, jobs: int = 1,
             progress: bool = False, log=None) -> dict:
    """Every rate of one case; the case's dict for the JSON (module docstring)."""
    from rackbed import topology as topo_mod
    from rackbed.sim.search import run_search

    budget = spec.gpu_budget or topo_mod.load(topology).n_gpus
    slo = spec.search.slo
    t0 = time.perf_counter()
    rates, points, scen, simulated, sim_cpu = [], [], {}, 0, 0.0
    for rate, h in ((r, h) for r in spec.rates_per_s for h in spec.headrooms):
        s = case_search(spec, topology, weight_format, rate, h)
        res = run_search(s, work / spec.name / _safe(topology) / weight_format / f"rate-{rate:g}-h{h:g}", jobs=jobs,
                         progress=progress)
        # records pair with res.simulated; when every candidate is pruned the search still simulates its base
        # scenario (a sweep of no points expands to the base), which is no candidate: zip leaves it out
        pts = [{**point_of(r, rate, budget, slo), "prefill_headroom": h} for r, _ in zip(res.records, res.simulated)]
        points += pts
        scen.update(res.scenarios)
        simulated += len(pts)
        sim_cpu += sum(r.get("cpu_s") or 0.0 for r, _ in zip(res.records, res.simulated))
        status: dict[str, int] = {}
        for p in pts:
            status[p["status"]] = status.get(p["status"], 0) + 1
        el = eligible(pts, budget)
        row: dict[str, Any] = {"rate_per_s": rate, "prefill_headroom": h, "candidates": len(res.candidates),
                               "pruned": sum(c.pruned is not None for c in res.candidates),
                               "simulated": len(pts), "status": status, "meet_slo": len(el)}
        if el:
            row["best"] = _short(max(el, key=lambda p: (p["tokens_per_s_per_used_gpu"], p["user"])))
        ok = [p for p in pts if p["status"] == "ok"]
        if ok and not el:
            m = min(ok, key=lambda p: _slo_excess(p, slo))
            row["nearest_miss"] = {**_short(m), "slo_excess": _slo_excess(m, slo)}
        if not pts:
            row["pruned_because"] = _prune_reasons(res.candidates)
        inv = [p["reason"] for p in pts if p["status"] != "ok"]
        if inv:
            row["invalid_reason"] = inv[0]
        rates.append(row)
        if log:
            b = row.get("best") or row.get("nearest_miss")
            log(f"{topology} {weight_format} rate {rate:g}/s, prefill headroom {h:g}: {len(res.candidates)} "
                f"candidates, {len(pts)} simulated, {len(el)} meet the SLOs" + (f"; {'best' if el else 'nearest miss'}: {b['config']}, "
                                                         f"{b['tokens_per_s_per_used_gpu']:.4g} tok/s/used GPU, "
                                                         f"{b['user']:.4g} tok/s/user" if b else ""))
    el = eligible(points, budget)
    chosen = choose(points, budget)
    note, caveats = _calibration(scen[chosen["key"]] if chosen else next(iter(scen.values()), None))
    return {"topology": topology, "weight_format": weight_format, "gpu_budget": budget, "headrooms": spec.headrooms,
            "calibration_note": note, "caveats": caveats, "rates": rates,
            "chosen": dict(chosen) if chosen else None,
            "front": [_short(p) for p in front(el)] if el else [],
            "_eligible": el, "wall_s": time.perf_counter() - t0, "simulated": simulated,
            "simulation_cpu_s": sim_cpu}


def _prune_reasons(cands, n: int = 3) -> list[dict]:
    """The ``n`` commonest pruning reasons (numbers masked to group alike ones), each with one real example."""
    from rackbed.sim.search_results import normalise_reason

    groups: dict[str, list[str]] = {}
    for c in cands:
        if c.pruned:
            groups.setdefault(normalise_reason(c.pruned), []).append(c.pruned)
    top = sorted(groups.values(), key=lambda g: -len(g))[:n]
    return [{"candidates": len(g), "example": g[0]} for g in top]


def _slo_excess(p: Mapping, slo) -> float:
    """How far a point misses: the larger of TTFT / bound and TPOT / bound at the SLO percentile (p90 figures)."""
    return max((p.get("ttft_p90_s") or math.inf) / slo.ttft_s, (p.get("tpot_p90_s") or 0.0) / slo.tpot_s)


def _calibration(scenario: Mapping | None) -> tuple[str | None, list[str]]:
    """The calibration note and caveats ``rackbed run`` prints for a scenario (``sim.scenario.build``)."""
    if scenario is None:
        return None, []
    from rackbed.sim.scenario import build, parse_scenario

    b = build(parse_scenario(dict(scenario)))
    return b.calibration_note, list(b.caveats)


def run_capacity(specs: Sequence[CapacitySpec], work: str | Path, *, jobs: int = 1, progress: bool = False,
                 command: str = "", log=None) -> CapacityRun:
    """Every case of every spec, then the ratios between cases of different topologies."""
    t0, c0 = time.perf_counter(), time.process_time()
    cases = []
    for spec in specs:
        for t in spec.search.space.topology:
            for f in spec.search.space.weight_format:
                cases.append(run_case(spec, t, f, Path(work), jobs=jobs, progress=progress, log=log))
    topos = list(dict.fromkeys(c["topology"] for c in cases))
    rat = []
    for i, ta in enumerate(topos):
        for tb in topos[i + 1:]:
            for a in (c for c in cases if c["topology"] == ta):
                for b in (c for c in cases if c["topology"] == tb):
                    rat.append({"a": _case_name(a), "b": _case_name(b), "at": ratios(a, b)})
    return CapacityRun(list(specs), cases, rat, wall_s=time.perf_counter() - t0,
                       cpu_s=time.process_time() - c0, simulated=sum(c["simulated"] for c in cases),
                       meta=provenance(command))


def provenance(command: str) -> dict:
    """Date, git commit (and whether the tree had changes), command, Python and package versions."""
    import datetime
    import platform
    import subprocess
    from importlib.metadata import PackageNotFoundError, version

    root = Path(__file__).resolve().parent.parent

    def git(*a):
        try:
            return subprocess.run(["git", *a], cwd=root, capture_output=True, text=True, timeout=30,
                                  check=True).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None

    vers = {}
    for pkg in ("rackbed", "numpy", "simpy", "pydantic"):
        try:
            vers[pkg] = version(pkg)
        except PackageNotFoundError:
            vers[pkg] = None
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "git_commit": git("rev-parse", "HEAD"), "git_dirty": bool(status) if status is not None else None,
            "command": command, "python": platform.python_version(), "versions": vers}


# ------------------------------------------------------------------------------------------------------------------
# Writing


def _f(x, nd: int = 4) -> str:
    if x is None:
        return "-"
    return f"{x:.{nd}g}"


def markdown(d: Mapping) -> str:
    """The Markdown report of :meth:`CapacityRun.as_dict`."""
    dirty = " (with uncommitted changes)" if d["git_dirty"] else ""
    lines = [f"# Capacity: {', '.join(s['name'] for s in d['specs'])}", "",
             (f"{d['date']}, commit `{(d['git_commit'] or '?')[:12]}`{dirty}; `{d['command']}`; "
              f"{d['simulated_points']} simulated points ({d['simulation_cpu_s']:.0f} s CPU to simulate); this run "
              f"{d['wall_s']:.0f} s wall, {d['cpu_s']:.0f} s CPU."), ""]
    for s in d["specs"]:
        sr = s["search"]
        wl = sr["workload"]
        lines.append(f"- **{s['name']}**: {s['description'] or sr['model']}. Model `{sr['model']}`, prompt "
                     f"{_len(wl['prompt'])} / output {_len(wl['output'])} tokens, {wl['arrival']['kind']} arrivals "
                     f"for {wl.get('duration_s')} s at each rate of {', '.join(f'{r:g}' for r in s['rates_per_s'])} "
                     f"req/s; SLO TTFT <= {sr['slo']['ttft_s']} s, TPOT <= {sr['slo']['tpot_s'] * 1e3:g} ms at "
                     f"{sr['slo']['percentile']}; prefill headroom "
                     f"{', '.join(f'{h:g}' for h in (s['prefill_headroom'] or [sr['prefill_headroom']]))}; "
                     f"MTP accept p {sr['mtp_accept_p']}, KV {sr['kv_dtype']}; up to {sr['max_simulations']} "
                     "simulations per search.")
    lines += ["", ("| topology | format | GPUs | best deployment | rate req/s | GPUs used | tok/s/GPU (budget) | "
              "tok/s/GPU (used) | tok/s/user (p50) | 1/TPOT p90 | TTFT p90 s | TPOT p90 ms |"),
              "| --- | --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for c in d["cases"]:
        p = c["chosen"]
        if p is None:
            n_ok = sum(r["meet_slo"] for r in c["rates"])
            lines.append(f"| {c['topology']} | {c['weight_format']} | {c['gpu_budget']} | none meets the SLOs "
                         f"({n_ok} eligible of {sum(r['simulated'] for r in c['rates'])} simulated) "
                         "| - | - | - | - | - | - | - | - |")
            continue
        lines.append(f"| {c['topology']} | {c['weight_format']} | {c['gpu_budget']} | {p['config']} | "
                     f"{p['rate_per_s']:g} | {p['gpus']} | {_f(p['tokens_per_s_per_budget_gpu'])} | "
                     f"{_f(p['tokens_per_s_per_used_gpu'])} | {_f(p['user'], 3)} | {_f(p['user_at_tpot_p90'], 3)} | "
                     f"{_f(p['ttft_p90_s'], 3)} | {_f(p['tpot_p90_s'] * 1e3, 3)} |")
    lines += ["", ("Ratio at equal tokens/s per user (a / b; the most tokens/s per GPU among each side's eligible "
              "points with tokens/s per user >= u):"), "",
              ("| a | b | u tok/s/user | a: deployment @ rate | b: deployment @ rate | ratio (budget GPUs) | "
              "ratio (used GPUs) |"), "| --- | --- | ---: | --- | --- | ---: | ---: |"]
    for r in d["ratios"]:
        for row in r["at"]:
            if row["u"] is None:
                lines.append(f"| {r['a']} | {r['b']} | - | {row['note']} | | - | - |")
                continue
            pa, pb = row["a_budget"], row["b_budget"]
            lines.append(f"| {r['a']} | {r['b']} | {_f(row['u'], 3)} | {_pt(pa)} | {_pt(pb)} | "
                         f"{_f(row['ratio_budget'], 3)} | {_f(row['ratio_used'], 3)} |")
    lines += ["", ("Per rate (headrooms together): simulated points meeting the SLOs / simulated; where none "
                   "meets, the nearest miss's p90 TTFT and TPOT and the analytic stage's estimate of its tokens/s per "
                   "user beside the simulated one:"), ""]
    for c in d["cases"]:
        by_rate: dict[float, list] = {}
        for r in c["rates"]:
            by_rate.setdefault(r["rate_per_s"], []).append(r)
        cells, pruned = [], []
        for rate, rows in by_rate.items():
            n_sim, n_ok = sum(r["simulated"] for r in rows), sum(r["meet_slo"] for r in rows)
            if not n_sim:
                pruned.append((rate, rows))
                continue
            cell = f"{rate:g}: {n_ok}/{n_sim}"
            misses = [r["nearest_miss"] for r in rows if "nearest_miss" in r]
            if not n_ok and misses:
                m = min(misses, key=lambda m: m["slo_excess"])
                cell += (f" (nearest: TTFT {_f(m['ttft_p90_s'], 3)} s, TPOT {_f(m['tpot_p90_s'] * 1e3, 3)} ms; "
                         f"{_f(m['est_user'], 3)} est. vs {_f(m['user'], 3)} tok/s/user)")
            cells.append(cell)
        line = f"- {c['topology']} {c['weight_format']}: " + ", ".join(cells)
        if pruned:
            r0, rows0 = pruned[0]
            why = next((r["pruned_because"][0] for r in rows0 if r.get("pruned_because")), None)
            line += f"; every candidate pruned at {', '.join(f'{r:g}' for r, _ in pruned)}"
            if why:
                line += f" (at {r0:g}: {why['candidates']} of {rows0[0]['candidates']} like \"{why['example']}\")"
        lines.append(line)
    lines += ["", "Calibration (what `rackbed run` prints for these deployments):", ""]
    for note in dict.fromkeys((c["topology"], c["calibration_note"], tuple(c["caveats"])) for c in d["cases"]):
        t, n, cav = note
        lines.append(f"- {t}: {n}" + "".join(f"; caveat: {x}" for x in cav))
    lines += ["", "Definitions: " + "; ".join(f"{k}: {v}" for k, v in d["definitions"].items()) + ".", ""]
    return "\n".join(lines)


def _len(spec: Mapping) -> str:
    return str(spec.get("tokens")) if spec.get("kind") == "fixed" else spec.get("kind", "?")


def _pt(p: Mapping | None) -> str:
    if p is None:
        return "none that fast"
    return (f"{p['config']} @ {p['rate_per_s']:g}/s: {_f(p['tokens_per_s_per_budget_gpu'])} tok/s/GPU, "
            f"{_f(p['user'], 3)} tok/s/user")


def write(out: str | Path, tag: str, run: CapacityRun) -> list[Path]:
    """``OUT/<tag>.json`` and ``OUT/<tag>.md``."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    d = run.as_dict()
    js, md = out / f"{tag}.json", out / f"{tag}.md"
    write_text(js, _dumps(_rounded(d)) + "\n")
    write_text(md, markdown(d))
    return [js, md]


def _dumps(x, indent: int = 0) -> str:
    """JSON with nested containers spread over lines and flat objects / lists (a point, a count) on one line."""
    import json

    pad = " " * (indent + 1)
    if isinstance(x, dict) and any(isinstance(v, (dict, list, tuple)) for v in x.values()):
        body = ",\n".join(f"{pad}{json.dumps(k)}: {_dumps(v, indent + 1)}" for k, v in x.items())
        return "{\n" + body + "\n" + " " * indent + "}"
    if isinstance(x, (list, tuple)) and any(isinstance(v, (dict, list, tuple)) for v in x):
        return "[\n" + ",\n".join(pad + _dumps(v, indent + 1) for v in x) + "\n" + " " * indent + "]"
    return json.dumps(x, allow_nan=False)


def _rounded(x, digits: int = 6):
    """``x`` with every float rounded to ``digits`` significant digits (the JSON stays small and readable)."""
    if isinstance(x, float):
        return float(f"{x:.{digits}g}") if math.isfinite(x) else x
    if isinstance(x, dict):
        return {k: _rounded(v, digits) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_rounded(v, digits) for v in x]
    return x
