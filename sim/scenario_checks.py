"""Rules of a disaggregated serving scenario that its schema cannot state field by field, and the caveat for a
prefill batch budget that never batches. ``sim.scenario.build`` applies them to a parsed ``ServingScenario``."""

from __future__ import annotations

import math

from rackbed.engine.core.workload import MAX_REQUESTS
from rackbed.topology.errors import UserError


def check_disaggregated(sc, n_p: int, n_d: int) -> None:
    """Rules of a disaggregated scenario that its schema cannot state field by field (``n_p`` / ``n_d``: the
    replicas it starts with): a run needs both roles (parallelism rules: ``sim.parallel.check_parallel``)."""
    for role, n, floor in (("prefill", n_p, "min_prefillers"), ("decode", n_d, "min_decoders")):
        if n == 0:
            raise UserError(f"{role}.replicas: 0 leaves no {role} group, so no request would finish; give at least 1 "
                            f"(or an autoscaler with {floor} >= 1)")


def check_span(sc, topo) -> None:
    """A decoder or prefiller wider than one NVLink domain needs ``span_nodes`` (whole nodes, EP across them over
    the NICs); one line naming the field."""
    size = max(len(d) for d in topo.nvlink_domains())
    for role, sec, n in (("decode", sc.decode, sc.decode.ep),
                         ("prefill", sc.prefill, max(sc.prefill.tp, sc.prefill.ep))):
        if n > size and not sec.span_nodes:
            raise UserError(f"{role}.ep: a group of {n} GPUs exceeds one {size}-GPU NVLink domain of {topo.name}; set "
                            f"{role}.span_nodes: true to place it on {-(-n // size)} whole nodes (EP across nodes over "
                            "the NICs)")


def budget_caveat(sc) -> list[str]:
    """A caveat when the prefill batch budget is below every prompt the workload can draw: the scheduler then
    admits each prompt alone and whole, past the budget (without chunked prefill), so the budget never batches —
    allowed (a search may price it), but almost always a typo such as ``max_batch_tokens: 1``."""
    prompt = getattr(sc.workload, "prompt", None)
    field = {"fixed": "tokens", "uniform": "lo"}.get(getattr(prompt, "kind", None))
    budget = sc.prefill.max_batch_tokens
    if field is None or sc.sim.chunked_prefill or budget >= getattr(prompt, field):
        return []
    return [(f"prefill.max_batch_tokens: {budget} is below every prompt (workload.prompt.{field}: "
             f"{getattr(prompt, field)}): each prompt is prefilled alone, whole, past the budget")]


def check_run_size(sc) -> None:
    """A synthetic workload bounded by ``duration_s`` alone draws ``rate_per_s x duration_s`` requests (lazily: a
    library caller may iterate a longer stream); a run simulates them all, up to ``sim.until_s``, so beyond
    ``MAX_REQUESTS`` it would run for days: an error, like ``n_requests`` above the bound."""
    wl = sc.workload
    rate = getattr(getattr(wl, "arrival", None), "rate_per_s", None)
    if getattr(wl, "kind", None) != "synthetic" or wl.n_requests is not None or rate is None:
        return
    expected = rate * min(wl.duration_s, sc.sim.until_s or math.inf)
    if expected > MAX_REQUESTS:
        raise UserError(f"workload.duration_s x workload.arrival.rate_per_s is {expected:.3g} requests; at most "
                        f"{MAX_REQUESTS:,} in one run (a generous bound), or give workload.n_requests")


def _length_bound(dist) -> tuple[int | None, str]:
    """The most tokens a length distribution can draw and the field that sets it; None where it is unbounded (a
    log-normal without ``max_tokens``) or drawn from a trace's column (data, judged like a trace's requests)."""
    kind = getattr(dist, "kind", None)
    if kind == "fixed":
        return dist.tokens, "tokens"
    if kind == "uniform":
        return dist.hi, "hi"
    if kind == "lognormal":
        return dist.max_tokens, "max_tokens"
    if kind == "empirical" and dist.values is not None:
        return max(dist.values), "values"
    return None, ""


#: requests :func:`context_check` draws at most (a looped trace repeats itself; a long run's whole stream would
#: cost as much again as generating it for the run)
CONTEXT_SAMPLE = 10_000


def context_check(sc, model) -> list[str]:
    """Requests against the model's context (``ModelSpec.max_context``, prompt + output tokens; no check when it is
    unknown). A synthetic workload whose declared bounds let a request exceed it is an error naming
    ``workload.prompt`` / ``workload.output``. Requests that come from data -- a trace, a length drawn from a trace's
    column -- or from an unbounded log-normal are drawn (the run's own stream) and those beyond the context give a
    caveat: shipped scenarios replay traces whose longest requests exceed a model's native context, and a run
    simulates them whole, as if the model served them (with YaRN, say)."""
    ctx = getattr(model, "max_context", None)
    wl = sc.workload
    if ctx is None:
        return []
    if getattr(wl, "kind", None) == "synthetic":
        (p, pf), (o, of) = _length_bound(wl.prompt), _length_bound(wl.output)
        if p is not None and o is not None:
            if p + o > ctx:
                raise UserError(f"workload.prompt.{pf} + workload.output.{of}: a request can reach {p:,} + {o:,} = "
                                f"{p + o:,} tokens, beyond the {ctx:,}-token context of {model.name} (prompt + "
                                "output must fit)")
            return []
    from itertools import islice

    from rackbed.engine.core.workload import iter_requests

    n = over = largest = 0
    for r in islice(iter_requests(wl, sc.seed), CONTEXT_SAMPLE + 1):
        n += 1
        t = r.prompt_tokens + r.output_tokens
        if n <= CONTEXT_SAMPLE and t > ctx:
            over += 1
            largest = max(largest, t)
    if not over:
        return []
    of = f"the first {CONTEXT_SAMPLE:,}" if n > CONTEXT_SAMPLE else f"{n:,}"
    return [f"workload: {over:,} of {of} requests exceed the {ctx:,}-token context of {model.name} (prompt + "
            f"output, the largest {largest:,}); they are simulated whole, as if the model served them"]
