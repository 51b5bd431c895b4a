"""Per-term profiles of the real engine's plans: where a plan's kernel time goes, in the cost model's terms.

The model code (``engine.real.model``, ``families``, ``layers_moe``, ``comm``) marks its parts with
:func:`scope` / :func:`scoped`, named after the ``StepTime`` categories of the cost model
(``sim/costs/breakdown.py``), split as the cost model splits them:

=================  ==========================================================================================
scope              what runs inside it
=================  ==========================================================================================
``attn_s``         Q/K/V projections, q/k norms and RoPE, the KV cache write and read, the attention core,
                   the output projection (``_qkv``, ``_attn_prefill`` / ``_attn_decode``, the inline
                   attention of the Qwen3-MoE class)
``moe_gemm_s``     the routed experts' grouped GEMMs (``_experts``), shared experts and dense MLPs
                   (``layers_moe.mlp``)
``a2a_s``          MoE dispatch and combine: the local select / pack / accumulate around the expert GEMMs
                   (``_local_experts``) and the decode all-to-all (``_moe_dp_ep``, ``Comm.ep_all_to_all``)
``allreduce_s``    the TP all-reduce after attention and dense MLPs, the EP-prefill combine all-reduce
                   (``Comm.tp_all_reduce`` / ``ep_all_reduce``)
``other_s``        the router (``_route``), final norm and lm_head (``_logits``)
=================  ==========================================================================================

The innermost scope owns an op (the expert GEMMs inside the dispatch's scope are ``moe_gemm_s``); ops
outside every scope — the layers' RMS norms, residual adds, the embedding — are ``unscoped_s``, which the cost
model counts under ``other_s`` (norms / residuals, embeddings).

Scopes cost nothing while no profile is being taken: ``torch.profiler.record_function`` is entered only when
:func:`profile_calls` has switched them on (an unguarded ``record_function`` costs a few microseconds per call
even with no profiler running, as much as a small op; a guarded scope is a flag test).

:func:`profile_calls` re-runs a list of plans' recorded model calls eagerly under ``torch.profiler``: on CUDA
it counts each op's own kernel time on the device (``self_device_time_total``), on CPU each op's own CPU time
(``self_cpu_time_total``) — the same code path, ``ProfilerActivity.CPU`` standing in for the device. It
returns, per plan, the time inside each scope, the time outside any, and their sum (``kernels_s``). The driver
(``engine.real.driver``) asks each rank for this after the measured run, so the measured times are untouched.
"""

from __future__ import annotations

import contextlib
import functools

import torch

#: the cost model's StepTime categories (``sim.costs.breakdown.CATEGORIES``; ``engine/real`` does not import
#: ``sim``)
CATEGORIES: tuple[str, ...] = ("attn_s", "moe_gemm_s", "a2a_s", "allreduce_s", "other_s")
#: profiler scope name prefixes: a category's scope, and the scope around one profiled plan
PREFIX, PLAN = "rackbed.", "rackbed.plan."

_NULL = contextlib.nullcontext()


class _State:
    on = False


def scope(category: str):
    """A profiler scope named after a cost-model category while profiles are taken; a no-op otherwise."""
    return torch.profiler.record_function(PREFIX + category) if _State.on else _NULL


def scoped(category: str):
    """Decorator: the function runs inside :func:`scope` ``(category)``."""
    assert category in CATEGORIES, category

    def deco(f):
        name = PREFIX + category

        @functools.wraps(f)
        def wrapper(*args, **kw):
            if not _State.on:
                return f(*args, **kw)
            with torch.profiler.record_function(name):
                return f(*args, **kw)

        return wrapper

    return deco


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile_calls(plans: list[list], device: torch.device, *, repeats: int = 3) -> list[dict]:
    """Run each plan's calls (a list of zero-argument callables) under ``torch.profiler``, scopes on; return
    per plan ``{"terms": {category: s}, "unscoped_s", "kernels_s", "wall_s"}`` (module docstring; ``wall_s``:
    the profiled run's wall time, device synchronised, profiler overhead included): of the ``repeats``
    runs of the plan, the one with the least kernel time (a run that shared the cores or the device with
    something else only ever adds time). Every plan runs once before profiling (first calls of a shape:
    allocator growth, kernel selection) and the first plan once more inside the profiler, unattributed (its
    first ops pay the profiler's start-up)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    cuda = device.type == "cuda"
    for calls in plans:
        for c in calls:
            c()
    _sync(device)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    _State.on = True
    try:
        with profile(activities=acts) as prof:
            for c in plans[0] if plans else ():
                c()
            _sync(device)
            for rep in range(repeats):
                for i, calls in enumerate(plans):
                    with record_function(f"{PLAN}{rep * len(plans) + i}"):
                        for c in calls:
                            c()
                        _sync(device)
    finally:
        _State.on = False
    runs = split_events(prof.events(), repeats * len(plans), cuda=cuda)
    return [min(runs[i::len(plans)], key=lambda r: r["kernels_s"]) for i in range(len(plans))]


def split_events(events, n_plans: int, *, cuda: bool) -> list[dict]:
    """Each op's own time (device time on CUDA, CPU time otherwise) to the innermost category scope and the
    plan scope above it (``PLAN<i>``); ops under no plan scope (other threads) are ignored, the scopes' own
    time (the Python between ops) is not kernel time."""
    out = [{"terms": dict.fromkeys(CATEGORIES, 0.0), "unscoped_s": 0.0, "kernels_s": 0.0, "wall_s": 0.0}
           for _ in range(n_plans)]
    cpu = torch.autograd.DeviceType.CPU
    for ev in events:
        if getattr(ev, "device_type", cpu) != cpu:
            continue
        if ev.name.startswith(PLAN) and int(ev.name[len(PLAN):]) < n_plans:
            out[int(ev.name[len(PLAN):])]["wall_s"] += ev.cpu_time_total * 1e-6
        if ev.name.startswith(PREFIX):
            continue
        t_us = ev.self_device_time_total if cuda else ev.self_cpu_time_total
        if not t_us:
            continue
        cat, plan, p = None, None, ev.cpu_parent
        while p is not None:
            if p.name.startswith(PLAN):
                plan = int(p.name[len(PLAN):])
                break
            if cat is None and p.name.startswith(PREFIX):
                cat = p.name[len(PREFIX):]
            p = p.cpu_parent
        if plan is None or plan >= n_plans:
            continue
        rec = out[plan]
        if cat in rec["terms"]:
            rec["terms"][cat] += t_us * 1e-6
        else:
            rec["unscoped_s"] += t_us * 1e-6
        rec["kernels_s"] += t_us * 1e-6
    return out


class PlanSampler:
    """Which plans of a run to profile: up to ``n`` per (worker, kind), spread over the run. Every
    ``stride``-th plan of a (worker, kind) is taken (its ranks record its model calls); when ``2 n`` are
    taken, every other one is dropped and the stride doubles, so the kept ones stay evenly spread however long
    the run is."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.seen: dict[tuple, int] = {}
        self.stride: dict[tuple, int] = {}
        self.kept: dict[tuple, list[dict]] = {}

    def take(self, worker: str, kind: str, key: int, **size) -> bool:
        k = (worker, kind)
        i = self.seen[k] = self.seen.get(k, -1) + 1
        s = self.stride.setdefault(k, 1)
        if i % s:
            return False
        kept = self.kept.setdefault(k, [])
        kept.append({"worker": worker, "kind": kind, "key": key, **size})
        if len(kept) >= 2 * self.n:
            kept[:] = kept[::2]
            self.stride[k] = 2 * s
        return True

    def chosen(self) -> dict[str, list[dict]]:
        """``{worker: [sample, ...]}``: ``n`` per (worker, kind) (all of them where fewer were taken), evenly
        spread over those kept, the first and the last kept among them."""
        out: dict[str, list[dict]] = {}
        for (worker, _), kept in sorted(self.kept.items()):
            k, n = len(kept), self.n
            pick = kept if k <= n else [kept[k // 2]] if n == 1 else \
                [kept[round(i * (k - 1) / (n - 1))] for i in range(n)]
            out.setdefault(worker, []).extend(pick)
        return out
