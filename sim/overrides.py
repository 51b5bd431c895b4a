"""Command-line overrides of a serving scenario (``rackbed run --rate/--isl/--osl/--concurrency/--gpus/...``).

:func:`apply_overrides` returns the scenario with the flags applied on top of it; a value that cannot apply is a
one-line :class:`~topology.errors.UserError` naming the flag as the user typed it, not a YAML path.

* ``--rate R``: requests/s. A synthetic workload keeps its arrival process and takes the rate (``immediate``
  arrivals become Poisson); a trace is replayed at that mean rate; a sessions workload takes it as *sessions*/s
  (its request rate is that times the mean turns per session).
* ``--isl`` / ``--osl``: prompt / output lengths in tokens — ``N`` (fixed), ``LO-HI`` (uniform, both included)
  or ``MEAN:STD`` (log-normal with that mean and standard deviation). On a trace the workload becomes synthetic:
  Poisson arrivals at the trace's rate (``rate_per_s``, or ``--rate``), the same request count, and the length
  not overridden drawn from the trace's own column. Not on a sessions workload (its prompts grow by turn).
* ``--concurrency C``: a closed loop, at most C requests in flight (``engine.core.workload.ClosedLoop``). Alone it
  sends the next request as soon as one finishes (``vllm bench serve --max-concurrency C`` at an infinite request
  rate); with ``--rate`` the arrivals are paced by the rate and held back while C are in flight.
* ``--duration S``: requests arrive (or, in an unpaced closed loop, are sent) for S seconds; the request-count cap
  is dropped (kept in an unpaced closed loop) and a trace loops.
* ``--gpus N``: the topology resized to N GPUs (``topology.presets.resized``: ``NAME``, ``NAME*k``, ``NAME@G``);
  the prefiller and decoder counts scale with it — decoders by N / GPUs in use, prefillers fill what is left —
  unless ``--prefillers`` / ``--decoders`` set them. With an autoscaler the counts stay (the rest is its pool).
"""

from __future__ import annotations

import math
import re

from rackbed.topology.errors import UserError

_FIXED = re.compile(r"^\d+$")
_UNIFORM = re.compile(r"^(\d+)-(\d+)$")
_MEANSTD = re.compile(r"^(\d+(?:\.\d*)?):(\d+(?:\.\d*)?)$")


def parse_length(flag: str, text: str) -> dict:
    """The length distribution (a workload ``prompt`` / ``output`` mapping) ``--isl`` / ``--osl`` stands for."""
    t = str(text).strip()
    if _FIXED.match(t) and int(t) >= 1:
        return {"kind": "fixed", "tokens": int(t)}
    if m := _UNIFORM.match(t):
        lo, hi = int(m.group(1)), int(m.group(2))
        if 1 <= lo <= hi:
            return {"kind": "uniform", "lo": lo, "hi": hi}
    if m := _MEANSTD.match(t):
        mean, std = float(m.group(1)), float(m.group(2))
        if mean >= 1:
            if std == 0:
                return {"kind": "fixed", "tokens": round(mean)}
            # log-normal with mean `mean` and standard deviation `std`: sigma^2 = ln(1 + (std / mean)^2)
            return {"kind": "lognormal", "mean": mean, "sigma": math.sqrt(math.log1p((std / mean) ** 2))}
    raise UserError(f"{flag} {text}: expected N (tokens >= 1), LO-HI (uniform) or MEAN:STD (log-normal)")


def _positive(flag: str, value, integer: bool = False) -> None:
    if value is not None and (not value > 0 or (integer and int(value) != value)):
        raise UserError(f"{flag} {value}: must be a positive {'integer' if integer else 'number'}")


def apply_overrides(sc, *, rate=None, isl=None, osl=None, concurrency=None, duration_s=None, gpus=None,
                    prefillers=None, decoders=None):
    """``sc`` (a :class:`~sim.scenario.ServingScenario`) with the command-line overrides applied (module doc)."""
    from rackbed.sim.scenario import parse_scenario

    for flag, v, integer in (("--rate", rate, False), ("--concurrency", concurrency, True),
                             ("--duration", duration_s, False), ("--gpus", gpus, True),
                             ("--prefillers", prefillers, True), ("--decoders", decoders, True)):
        _positive(flag, v, integer)
    data = sc.model_dump(exclude_none=True)
    if any(v is not None for v in (rate, isl, osl, concurrency, duration_s)):
        data["workload"] = _workload(sc.workload, rate, isl, osl, concurrency, duration_s)
    if gpus is not None or prefillers is not None or decoders is not None:
        _resize(sc, data, gpus, prefillers, decoders)
    try:
        return parse_scenario(data, source="command line")
    except UserError as exc:  # a combination the schema refuses: say which flags made it
        raise UserError(f"the overrides give an invalid scenario: {exc}") from None


def _workload(wl, rate, isl, osl, concurrency, duration_s) -> dict:
    w = wl.model_dump(exclude_none=True)
    if wl.kind == "sessions" and (isl is not None or osl is not None):
        raise UserError(f"--{'isl' if isl is not None else 'osl'}: a sessions workload's prompts grow turn by turn; "
                        "set workload.input / workload.output in the scenario instead")
    if wl.kind == "trace" and (isl is not None or osl is not None):
        w = _trace_to_synthetic(wl, rate)
    if rate is not None:
        if w["kind"] == "trace":
            w.pop("time_scale", None)
            w["rate_per_s"] = rate
        elif w["arrival"]["kind"] == "immediate":
            w["arrival"] = {"kind": "poisson", "rate_per_s": rate}
        else:
            w["arrival"] = {**w["arrival"], "rate_per_s": rate}
    if isl is not None:
        w["prompt"] = parse_length("--isl", isl)
    if osl is not None:
        w["output"] = parse_length("--osl", osl)
    if concurrency is not None:
        w["max_concurrency"] = int(concurrency)
        w["paced"] = rate is not None
    unpaced = w.get("max_concurrency") is not None and not w.get("paced", False)
    if duration_s is not None:
        w["duration_s"] = duration_s
        if not unpaced:
            w.pop("max_requests" if w["kind"] == "trace" else "n_requests", None)
        if w["kind"] == "trace":
            w["loop"] = True
    if unpaced and w["kind"] != "trace" and "n_requests" not in w:
        raise UserError("--concurrency without --rate needs a request count: the scenario's workload has "
                        "none (n_requests)")
    return w


def _trace_to_synthetic(wl, rate) -> dict:
    """A trace workload as a synthetic one (for --isl / --osl): Poisson arrivals, the trace's request count and
    its length columns as empirical distributions."""
    from rackbed.engine.core.workload import iter_requests

    r = rate if rate is not None else wl.rate_per_s
    if r is None:
        raise UserError("--isl/--osl replace a trace's lengths: give --rate too (the trace sets no rate_per_s)")
    src = {"path": wl.path} if wl.path else {"name": wl.name}
    out = {"kind": "synthetic", "arrival": {"kind": "poisson", "rate_per_s": r},
           "prompt": {"kind": "empirical", **src, "column": "prompt", "format": wl.format},
           "output": {"kind": "empirical", **src, "column": "output", "format": wl.format}}
    if wl.duration_s is not None:
        out["duration_s"] = wl.duration_s
    if wl.max_requests is not None or wl.duration_s is None:
        out["n_requests"] = wl.max_requests or sum(1 for _ in iter_requests(wl))
    if wl.max_concurrency is not None:
        out["max_concurrency"], out["paced"] = wl.max_concurrency, wl.paced
    return out


def _resize(sc, data: dict, gpus, prefillers, decoders) -> None:
    """--gpus / --prefillers / --decoders on ``data`` (module doc)."""
    gp, gd = max(sc.prefill.tp, sc.prefill.ep), sc.decode.ep
    n_p, n_d = sc.prefill.replicas, sc.decode.replicas
    if gpus is not None:
        from rackbed import topology
        from rackbed.topology.presets import resized

        data["topology"] = resized(sc.topology, int(gpus))
        used = n_p * gp + n_d * gd
        if sc.autoscaler is None and used and (prefillers is None or decoders is None):
            if decoders is None:
                n_d = max(1 if n_d else 0, math.floor(n_d * gpus / used))
            if prefillers is None and n_p:
                n_p = (int(gpus) - (decoders if decoders is not None else n_d) * gd) // gp
        total = topology.load(data["topology"]).n_gpus
    else:
        total = None
    n_p = prefillers if prefillers is not None else n_p
    n_d = decoders if decoders is not None else n_d
    data["prefill"] = {**data.get("prefill", {}), "replicas": int(n_p)}
    data["decode"] = {**data.get("decode", {}), "replicas": int(n_d)}
    need = n_p * gp + n_d * gd
    if total is not None and (need > total or (sc.prefill.replicas and n_p < 1) or (sc.decode.replicas and n_d < 1)):
        raise UserError(f"--gpus {gpus}: {max(n_p, 1)} prefiller(s) x {gp} GPUs + {max(n_d, 1)} decoder(s) x {gd} "
                        f"GPUs do not fit in {total} GPUs")
