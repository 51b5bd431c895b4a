"""``rackbed search``: capacity planning — the Pareto front of tokens/s per GPU vs tokens/s per user.

For a model, candidate hardware, a workload and SLOs, the search

1. **enumerates** candidate deployments: topology x weight format x KV cache format (``space.kv_dtype``: both
   roles of a candidate share it) x prefill (TP, EP, batch-token budget, overlap) x decode (DP-EP degree, attention
   TP of a DP rank, per-rank batch cap — a list or a grid, :func:`batch_grid` — MTP draft length, overlap:
   ``space.prefill_overlap`` / ``space.decode_overlap``, ``sim.costs.overlap``), with replica counts derived from
   the load (or given);
2. **prunes** each part with the memory budget (``ParallelPlan.validate``) and the analytic step-time model,
   recording why. Steps are priced by the very cost model the simulation of that candidate uses
   (``sim.scenario.cost_model_for`` on the candidate's scenario: the same calibration selection, plans and
   engine-calibration wrapper), asked for its term-by-term breakdowns:

   * prefill: the TTFT floor — the p90 prompt prefilled alone (in ``max_batch_tokens`` chunks with chunked
     prefill), which is the simulated TTFT without queueing — must meet the TTFT SLO; a replica's capacity is
     ``tokens of a full batch of mean prompts / its step time``, and ``replicas = ceil(input tokens/s x headroom /
     capacity)``;
   * decode (a DP-EP degree that does not divide the experts gets the fewest redundant experts that make it divide
     the expert slots, as wide-EP deployments do: ``decode.redundant_experts``): with per-sequence context ``c = mean prompt + mean output / 2`` the batch a rank can hold is
     ``b_max = min(batch cap, KV capacity / c)``; the TPOT at ``b_max`` (step time / expected tokens per step,
     ``engine.core.specdec``) must meet the TPOT SLO; decoders are sized by Little's law,
     ``replicas = ceil(rate x mean output x TPOT(b_max) / (ep x b_max))``, and the operating batch per rank ``b``
     is the fixed point of ``b = rate x mean output x TPOT(b) / (replicas x ep)``;
   * a candidate (prefill option x decode option) adds the KV transfer of a mean prompt, amortised over the
     tokens after the first — the simulator's TPOT is ``(end - first token) / (output - 1)`` and the KV ships in
     between — to its estimated TPOT, which must meet the SLO at ``b_max`` too; its estimated TTFT is the prefill
     option's floor. At low load (no queueing) both are what the simulation measures
     (``tests/test_search_consistency.py``);
   * the whole deployment must fit the topology's GPUs (and ``max_gpus``, when the spec sets it:
     ``rackbed search --rate R --gpus N``);

3. keeps at most ``max_simulations`` survivors, taking whole layers of the *analytic* Pareto front (non-dominated
   sorting on estimated tokens/s per GPU and per user), and **simulates** them through ``sim.sweep`` (parallel,
   resumable);
   Each simulation runs the budget search's arrival window (``sim.budget``, step 2): at least 4 lives of a request
   at the SLOs, ``TTFT SLO + (output - 1) x TPOT SLO``, or the workload's ``duration_s`` when longer (a workload
   given as a number of requests keeps it), so that the rate is judged in the queues' steady state, not while they
   build up;
4. computes the **Pareto front** (``objective: gpu``; with ``objective: kw`` tokens/s per kW of facility
   power, the whole pool, :mod:`sim.energy`, replaces tokens/s per GPU) of the simulated points that meet the
   SLOs (TTFT and TPOT at the SLO percentile,
   every request completed) and **hold**: the latency of the 2nd and 3rd quarters' arrivals, continued at its
   trend for a run 4x as long, stays within the SLOs, or such a run, simulated when the trend is in doubt, meets
   them — tokens/s per GPU (all GPUs, prefill included) vs tokens/s per user (p50 of 1/TPOT)
   — and the **cost per million output tokens** under the one accounting rule of :mod:`sim.energy` (the whole
   pool for the whole run: ``$/GPU-hour x pool GPUs x hours + energy``, :func:`run_cost_per_mtok_usd`; the
   analytic stage's estimate before simulation, ``$/GPU-hour / (3600 x estimated tokens/s per GPU) x 1e6``, counts
   GPU-hours only);
5. prints the best few with **why**: their prefill and decode ``StepBreakdown`` at the operating point (the
   simulated mean batch per rank), i.e. where the step time goes.

Steps 4-5 and the report's tables read the simulated records with :mod:`sim.search_results` (shared with
``rackbed sweep``).

The spec (YAML ``kind: search``, or CLI flags) is :class:`SearchSpec`.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from rackbed.engine.core.sharding import min_redundant_experts
from rackbed.engine.core.workload import WorkloadSpec
from rackbed.sim.pareto import pareto_layers
from rackbed.sim.search_results import OBJECTIVES, explain, front_of, meets_slo
from rackbed.topology.errors import UserError, from_validation, one_line


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class SearchSpace(_Strict):
    """The candidate values of each knob (every combination is a candidate before pruning)."""

    topology: tuple[str, ...] = ("gb200-nvl72",)
    weight_format: tuple[str, ...] = ("mxfp8",)
    prefill_tp: tuple[int, ...] = (2, 4, 8)
    prefill_ep: tuple[int, ...] | None = None  # None: ep = tp (the write-up's TP=EP prefillers)
    prefill_max_batch_tokens: tuple[int, ...] = (16384,)
    prefill_replicas: tuple[int, ...] | None = None  # None: derived from the input-token rate
    decode_ep: tuple[int, ...] = (4, 8, 16, 32)
    decode_tp: tuple[int, ...] = (1,)  # attention TP inside a decoder's DP ranks (dp = ep / tp)
    #: a list, or a grid ``{lo, hi, step}`` / ``{lo, hi, factor}`` (:func:`batch_grid`)
    max_batch_per_rank: tuple[int, ...] = (8, 16, 32, 64, 128)
    draft_k: tuple[int, ...] = (0, 1, 2)
    decode_replicas: tuple[int, ...] | None = None  # None: derived by Little's law
    # redundant expert slots per decode rank beyond the fewest that make ep divide the slots (wide EP: with
    # skewed routing, ``scenario: {decode: {expert_load: .., eplb: ..}}``, they buy back the busiest rank's load)
    decode_extra_slots_per_rank: tuple[int, ...] = (0,)
    #: compute / communication overlap tried per role (``sim.costs.overlap``; a TP=EP prefiller has no
    #: single-batch overlap)
    prefill_overlap: tuple[Literal["none", "two_batch"], ...] = Field(("none",), min_length=1)
    decode_overlap: tuple[Literal["none", "shared_expert", "two_batch"], ...] = Field(("none",), min_length=1)
    #: KV cache formats tried (the scenario's ``kv_dtype``: KV capacity and attention reads follow it); None: the
    #: spec's ``kv_dtype`` only, as an untouched base scenario field
    kv_dtype: tuple[Literal["bf16", "fp8"], ...] | None = Field(None, min_length=1)
    #: how a decoder moves tokens to its experts (``decode.moe_comm``: ``a2a``, ``allgather``)
    decode_moe_comm: tuple[Literal["a2a", "allgather"], ...] = Field(("a2a",), min_length=1)

    @field_validator("max_batch_per_rank", mode="before")
    @classmethod
    def _batch_grid(cls, v):
        if isinstance(v, Mapping):
            return batch_grid(v)
        return v

    @field_validator("weight_format")
    @classmethod
    def _formats(cls, v):
        from rackbed.engine.core.formats import FORMAT_NAMES

        bad = [f for f in v if f not in FORMAT_NAMES]
        if bad or not v:
            raise ValueError(f"unknown format {bad[0]!r}; one of {', '.join(FORMAT_NAMES)}" if bad else
                             "expected a non-empty list of formats")
        return v

    @field_validator("prefill_tp", "prefill_ep", "prefill_max_batch_tokens", "prefill_replicas", "decode_ep",
                     "decode_tp", "max_batch_per_rank", "draft_k", "decode_replicas", "decode_extra_slots_per_rank")
    @classmethod
    def _ints(cls, v):
        if v is not None and (not v or any(x < 0 for x in v)):
            raise ValueError("expected a non-empty list of non-negative integers")
        return v


def batch_grid(g: Mapping) -> tuple[int, ...]:
    """The batch caps of a grid ``{lo, hi, step}`` (``lo, lo + step, ...`` up to ``hi``) or ``{lo, hi, factor}``
    (``lo``, then each the previous times ``factor``, rounded and at least one more, up to ``hi``); ``hi`` is
    always the last cap. A ValueError (one line) for a bad grid."""
    keys = set(g)
    if not ({"lo", "hi"} <= keys and keys - {"lo", "hi"} in ({"step"}, {"factor"})):
        raise ValueError(f"a batch-cap grid is {{lo, hi, step}} or {{lo, hi, factor}}, got keys "
                         f"{', '.join(sorted(map(str, keys))) or 'none'}")
    lo, hi = g["lo"], g["hi"]
    if not (isinstance(lo, int) and isinstance(hi, int)) or isinstance(lo, bool) or isinstance(hi, bool) \
            or not 1 <= lo <= hi:
        raise ValueError(f"a batch-cap grid needs integers 1 <= lo <= hi, got lo={lo!r}, hi={hi!r}")
    if "step" in g:
        step = g["step"]
        if not isinstance(step, int) or isinstance(step, bool) or step < 1:
            raise ValueError(f"a batch-cap grid's step must be an integer >= 1, got {step!r}")
        caps = list(range(lo, hi + 1, step))
    else:
        f = g["factor"]
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not 1 < f <= 16:
            raise ValueError(f"a batch-cap grid's factor must be a number in (1, 16], got {f!r}")
        caps = [lo]
        while (nxt := max(caps[-1] + 1, round(caps[-1] * f))) <= hi:
            caps.append(nxt)
    if caps[-1] != hi:
        caps.append(hi)
    return tuple(caps)


class SearchSlo(_Strict):
    ttft_s: float = Field(gt=0)
    tpot_s: float = Field(gt=0)
    percentile: Literal["p50", "p90", "p99"] = "p90"


class SearchSpec(_Strict):
    """What to plan for (module docstring). ``scenario`` holds extra scenario fields applied to every simulated
    point (e.g. ``sim``, ``calibration``, ``decode.page_tokens``); ``gpu_hour_usd`` is one price or a price per
    topology name (the budget search on a topology of several GPU models: a price per GPU model,
    ``sim.budget.kind_prices``); ``max_gpus`` caps a candidate's GPUs below its topology's (None: the
    topology's)."""

    kind: Literal["search"] = "search"
    name: str = "search"
    description: str = ""
    model: str
    workload: WorkloadSpec
    slo: SearchSlo
    kv_dtype: Literal["bf16", "fp8"] = "bf16"
    mtp_accept_p: float = Field(0.8, ge=0, le=1)
    gpu_hour_usd: float | dict[str, float] = 0.0
    #: what the front maximises against tokens/s per user: ``gpu`` (output tokens/s per GPU) or ``kw`` (output
    #: tokens/s per kW of facility power, the whole pool: ``sim.energy``, priced by ``scenario.energy``)
    objective: Literal["gpu", "kw"] = "gpu"
    space: SearchSpace = Field(default_factory=SearchSpace)
    prefill_headroom: float = Field(1.25, gt=0)
    max_simulations: int = Field(60, ge=0)
    top: int = Field(5, ge=1)
    max_gpus: int | None = Field(None, ge=1)
    seed: int = 0
    scenario: dict[str, Any] = Field(default_factory=dict)

    def price(self, topology: str) -> float:
        p = self.gpu_hour_usd
        if isinstance(p, dict):
            return float(p.get(topology, p.get("default", 0.0)))
        return float(p)


def parse_search(data: Mapping, source: str | Path | None = None) -> SearchSpec:
    try:
        return SearchSpec.model_validate(data)
    except ValidationError as exc:
        raise from_validation(exc, source) from None


def load_search(path: str | Path) -> SearchSpec:
    from rackbed.sim.sweep import SWEEPS_DIR
    from rackbed.topology.yamlio import load_yaml

    p = Path(path)
    if not p.exists() and p.suffix not in (".yaml", ".yml") and (SWEEPS_DIR / f"{path}.yaml").exists():
        p = SWEEPS_DIR / f"{path}.yaml"
    if not p.exists():
        raise FileNotFoundError(f"{path}: no such search spec")
    return parse_search(load_yaml(p), p)


# ------------------------------------------------------------------------------------------------------------------
# Analytic stage


@dataclass
class Load:
    """The workload's demand: request rate (1/s), mean and p90 prompt tokens, mean output tokens."""

    rate_per_s: float
    prompt_mean: float
    prompt_p90: float
    output_mean: float
    n_requests: int
    requests: list = field(default_factory=list, repr=False)  # the drawn stream (prefix-cache hit estimates)

    @property
    def input_tokens_per_s(self) -> float:
        return self.rate_per_s * self.prompt_mean

    @property
    def output_tokens_per_s(self) -> float:
        return self.rate_per_s * self.output_mean


def workload_load(workload, seed: int = 0) -> Load:
    from rackbed.engine.core.workload import WorkloadStats, generate

    reqs = generate(workload, seed)
    st = WorkloadStats.from_requests(reqs)
    if st.count < 2 or st.mean_rate_per_s <= 0:
        raise UserError("search: workload: needs at least two requests at distinct arrival times")
    return Load(st.mean_rate_per_s, st.prompt_tokens_mean, st.prompt_tokens_p90, st.output_tokens_mean, st.count,
                list(reqs))


@dataclass
class PrefillOption:
    topology: str
    weight_format: str
    tp: int
    ep: int
    max_batch_tokens: int
    ttft_floor_s: float = math.nan
    capacity_tokens_per_s: float = math.nan  # one replica
    replicas: int = 0
    batch: tuple[int, int] = (0, 0)  # (sequences, tokens each) of the full batch used for the capacity
    breakdown: object = None
    pruned: str | None = None
    hit_rate: float = 0.0            # assumed prefix-cache hit rate (of prompt tokens); 0 without a cache
    cache_blocks: int = 0            # prefix-cache capacity of one replica, 512-token blocks (all private tiers)
    capacity_at: Callable[[float], float] | None = field(default=None, repr=False)  # capacity at a hit rate
    overlap: str = "none"            # prefill.overlap (sim.costs.overlap)
    kv_dtype: str | None = None      # the scenario's kv_dtype (None: the base scenario's, not overridden)
    gpu: str | None = None           # prefill.gpu: the GPU model of a mixed topology it runs on (None: any)


@dataclass
class DecodeOption:
    topology: str
    weight_format: str
    ep: int
    max_batch_per_rank: int
    draft_k: int
    kv_capacity_tokens: int = 0
    b_max: int = 0
    tpot_at_cap_s: float = math.nan
    replicas: int = 0
    b_op: float = math.nan
    tpot_s: float = math.nan
    context_tokens: float = 0.0
    breakdown: object = None          # at the operating batch b_op
    breakdown_at_cap: object = None   # at b_max (what the TPOT pruning used)
    pruned: str | None = None
    tp: int = 1                       # attention TP of a DP rank (ranks = ep / tp)
    redundant_experts: int = 0        # extra expert slots: the fewest that make ep divide them (wide EP)
    overlap: str = "none"             # decode.overlap (sim.costs.overlap)
    kv_dtype: str | None = None       # the scenario's kv_dtype (None: the base scenario's, not overridden)
    gpu: str | None = None            # decode.gpu: the GPU model of a mixed topology it runs on (None: any)
    moe_comm: str = "a2a"             # decode.moe_comm (sim.costs.moe_comm)

    @property
    def ranks(self) -> int:
        return max(1, self.ep // self.tp)


def _decode_tp_override(tp: int, redundant_experts: int = 0, overlap: str = "none",
                        moe_comm: str = "a2a") -> dict:
    """``decode.tp``, ``decode.redundant_experts``, ``decode.overlap`` and ``decode.moe_comm`` for a scenario
    override, each left out at its default (1, 0, none, a2a) so that such scenarios stay as they were."""
    return ({"decode.tp": tp} if tp != 1 else {}) | (
        {"decode.redundant_experts": redundant_experts} if redundant_experts else {}) | (
        {"decode.overlap": overlap} if overlap != "none" else {}) | (
        {"decode.moe_comm": moe_comm} if moe_comm != "a2a" else {})


def moe_comm_label(moe_comm: str) -> str:
    """A candidate label's mark of ``decode.moe_comm``: nothing for the default all-to-all."""
    return " allgather" if moe_comm == "allgather" else ""


def _kv_override(kv_dtype: str | None) -> dict:
    """``kv_dtype`` for a scenario override, left out when the space does not vary it (None)."""
    return {"kv_dtype": kv_dtype} if kv_dtype is not None else {}


def _kv_label(kv_dtype: str | None) -> str:
    return f" kv {kv_dtype}" if kv_dtype is not None else ""


def gpu_override(role: str, gpu: str | None) -> dict:
    """``prefill.gpu`` / ``decode.gpu`` (``role``) for a scenario override, left out when the option runs on
    any GPU (None: a topology of one GPU model)."""
    return {f"{role}.gpu": gpu} if gpu is not None else {}


def _prefill_overlap_override(overlap: str) -> dict:
    """``prefill.overlap`` for a scenario override, left out at its default (none)."""
    return {"prefill.overlap": overlap} if overlap != "none" else {}


_OVERLAP_LABEL = {"none": "", "shared_expert": " sbo", "two_batch": " tbo"}


@dataclass
class Candidate:
    prefill: PrefillOption
    decode: DecodeOption
    n_gpus: int
    est_tokens_per_s_per_gpu: float
    est_tokens_per_s_per_user: float
    est_cost_per_mtok_usd: float | None
    pruned: str | None = None
    overrides: dict = field(default_factory=dict)
    est_ttft_s: float = math.nan   # the prefill option's TTFT floor (no queueing)
    est_tpot_s: float = math.nan   # decode TPOT at the operating batch + the KV transfer per token after the first
    kv_transfer_s: float = math.nan  # one mean prompt's KV, prefiller -> decoder rank, idle network

    @property
    def label(self) -> str:
        p, d = self.prefill, self.decode
        return (f"{p.topology} {p.weight_format} P{p.replicas}xTP{p.tp}/EP{p.ep}{_OVERLAP_LABEL[p.overlap]} "
                f"D{d.replicas}x{f'TP{d.tp}/' if d.tp > 1 else ''}EP{d.ep}"
                f"{f'+{d.redundant_experts}r' if d.redundant_experts else ''} b<={d.max_batch_per_rank} "
                f"k={d.draft_k}{_OVERLAP_LABEL[d.overlap]}{moe_comm_label(d.moe_comm)}"
                f"{_kv_label(d.kv_dtype)}")


def _plan_gpus(topo, n: int, role: str, gpu: str | None = None) -> tuple[int, ...]:
    """The lowest ``n`` GPUs — of the GPU model ``gpu`` names on a mixed topology
    (``sim.scenario.role_gpus``) — what the first group of a role gets when it fits one node (prefill) or
    one NVLink domain (decode). Wider groups span nodes / domains: the analytic model prices them (cross-node
    host sync, all-to-all over the network), while the simulator's placement refuses them, so such candidates
    end up as invalid simulation points with the placement's reason."""
    if gpu is None:
        if n > topo.n_gpus:
            raise UserError(f"{role} group of {n} GPUs exceeds the topology's {topo.n_gpus} GPUs")
        return tuple(sorted(topo.gpu_ids)[:n])
    from rackbed.sim.scenario import role_gpus

    ids = sorted(role_gpus(topo, role.split()[0], gpu) or topo.gpu_ids)
    if n > len(ids):
        raise UserError(f"{role} group of {n} GPUs exceeds the topology's {len(ids)} {gpu} GPUs")
    return tuple(ids[:n])


def _cache_get(cache: dict, name: str, fn):
    v = cache.get(name)
    if v is None:
        v = cache[name] = fn(name)
    return v


def _scenario(base: Mapping, overrides: Mapping):
    """The ServingScenario of ``base`` (:func:`base_scenario`) with dotted ``overrides`` (a candidate's knobs)."""
    import copy

    from rackbed.sim.scenario import parse_scenario
    from rackbed.sim.sweep import set_path

    raw = copy.deepcopy(dict(base))
    for k, v in overrides.items():
        set_path(raw, k, v)
    return parse_scenario(raw, f"search {raw.get('name', '')}")


def prefill_alone_s(cm, prompt: int, max_batch_tokens: int, chunked: bool) -> float:
    """Seconds to prefill one ``prompt`` with nothing else queued, priced by the cost model ``cm``: one batch (the
    scheduler admits a lone prompt above the token budget whole), or ``max_batch_tokens`` chunks one after another
    with chunked prefill — the simulated TTFT without queueing."""
    if not chunked:
        return cm.prefill_breakdown([(prompt, 0)]).total_s
    return sum(cm.prefill_breakdown([(min(max_batch_tokens, prompt - done), done)]).total_s
               for done in range(0, prompt, max_batch_tokens))


def prefill_options(spec: SearchSpec, load: Load, model, topos: Mapping, gpu: str | None = None
                    ) -> list[PrefillOption]:
    """Prefill options with their analytic figures, pruned ones included (``pruned`` says why); ``gpu``: on
    that GPU model of a mixed topology (``prefill.gpu``), priced by its own calibration."""
    from rackbed.sim.scenario import cost_model_for, prefill_plan_for

    sp = spec.space
    base = base_scenario(spec)
    chunked = bool(_get(base, "sim.chunked_prefill", False))
    out = []
    prompt = max(1, round(load.prompt_mean))
    p90 = max(1, round(load.prompt_p90))
    for tname in sp.topology:
        topo = topos[tname]
        for fmt in sp.weight_format:
            for tp in sp.prefill_tp:
                for ep in (sp.prefill_ep or (tp,)):
                    for mbt, pov, kv in itertools.product(sp.prefill_max_batch_tokens, sp.prefill_overlap,
                                                          sp.kv_dtype or (None,)):
                        o = PrefillOption(tname, fmt, tp, ep, mbt, overlap=pov, kv_dtype=kv, gpu=gpu)
                        out.append(o)
                        try:
                            sc = _scenario(base, {"topology": tname, "weight_format": fmt, "prefill.tp": tp,
                                                  "prefill.ep": ep, "prefill.max_batch_tokens": mbt,
                                                  **_prefill_overlap_override(pov), **_kv_override(kv),
                                                  **gpu_override("prefill", gpu)})
                            plan = prefill_plan_for(sc, model, _plan_gpus(topo, max(tp, ep), "prefill", gpu))
                            plan.validate(model, topo)
                            cm = cost_model_for(sc, model, topo, plan, None)[0]
                            floor = prefill_alone_s(cm, p90, mbt, chunked)
                            o.ttft_floor_s = floor
                            if floor > spec.slo.ttft_s:
                                o.pruned = (f"TTFT floor {floor * 1e3:.0f} ms (p90 prompt {p90} tokens alone) > "
                                            f"SLO {spec.slo.ttft_s * 1e3:.0f} ms")
                                continue
                            each = min(prompt, mbt) if chunked else prompt
                            _size_prefill(o, spec, load, cm, each,
                                          cache_blocks_of(sc, model, topo, max(tp, ep), gpu=gpu))
                            o.capacity_at = functools.partial(_capacity_at, cm, mbt, each)
                        except (ValueError, FileNotFoundError) as exc:
                            o.pruned = one_line(exc)
    return out


def _full_batch(cm, max_batch_tokens: int, each: int, hit: float):
    """``(sequences, breakdown)`` of a full prefill batch of ``each``-token prompts when a share ``hit`` of each is
    cached: batch items ``(new, cached)`` as the scheduler makes them, as many as fit the token budget on their new
    tokens."""
    new = max(1, round(each * (1.0 - hit)))
    n_seqs = max(1, max_batch_tokens // new)
    return n_seqs, cm.prefill_breakdown([(new, each - new)] * n_seqs)


def _capacity_at(cm, max_batch_tokens: int, each: int, hit: float) -> float:
    """Prompt tokens/s of one prefill replica when a share ``hit`` of each prompt is cached (:func:`_full_batch`):
    what the budget search prices a replica count's hit rate with."""
    n_seqs, bd = _full_batch(cm, max_batch_tokens, each, hit)
    return n_seqs * each / bd.total_s


def _price_prefill(o: PrefillOption, cm, each: int, hit: float) -> None:
    """``o``'s full batch and capacity (prompt tokens/s) when a share ``hit`` of each prompt is cached
    (:func:`_full_batch`)."""
    n_seqs, bd = _full_batch(cm, o.max_batch_tokens, each, hit)
    o.breakdown, o.batch, o.hit_rate = bd, (n_seqs, each), hit
    o.capacity_tokens_per_s = n_seqs * each / bd.total_s


def _size_prefill(o: PrefillOption, spec: SearchSpec, load: Load, cm, each: int, cache_blocks: int) -> None:
    """Capacity and replicas of a prefill option. With a prefix cache (``cache_blocks`` > 0 per replica) the hit
    rate depends on the replica count (each replica caches what it prefilled) and the count on the hit rate: from
    the count without a cache, alternate :func:`assumed_hit_rate` and the count it needs until the count repeats
    (at most 6 rounds; a cycle keeps its larger count)."""
    _price_prefill(o, cm, each, 0.0)

    def need() -> int:
        return max(1, math.ceil(load.input_tokens_per_s * spec.prefill_headroom / o.capacity_tokens_per_s))

    o.replicas, o.cache_blocks = need(), cache_blocks
    if cache_blocks <= 0:
        return
    seen: list[int] = []
    for _ in range(6):
        seen.append(o.replicas)
        _price_prefill(o, cm, each, assumed_hit_rate(load.requests, cache_blocks, o.replicas))
        r = need()
        if r in seen:
            if r != seen[-1]:  # a cycle: keep the larger count and its hit rate
                r = max(seen[seen.index(r):])
                _price_prefill(o, cm, each, assumed_hit_rate(load.requests, cache_blocks, r))
            o.replicas = r
            return
        o.replicas = r


def assumed_hit_rate(requests: Sequence, cache_blocks: int, replicas: int) -> float:
    """The prefix-cache hit rate the search plans with: ``replicas`` LRU caches of ``cache_blocks`` blocks, the
    requests dealt to them in turn (``engine.core.prefix_reuse.lru_reuse``). Routing that ignores the caches
    (least queued tokens, round robin, random) gets about this; ``kv_aware`` routing gets more (the simulation
    measures it), so the estimate errs towards more prefillers."""
    from rackbed.engine.core.prefix_reuse import lru_reuse

    return lru_reuse(requests, cache_blocks, max(1, replicas))


def cache_blocks_of(sc, model, topo, n_gpus: int, role: str = "prefill", gpu: str | None = None) -> int:
    """Prefix-cache capacity of one prefill replica (or aggregated worker: ``role``) of ``n_gpus`` GPUs in
    512-token blocks (the ids' block), HBM
    and host tiers together, as the simulator sizes it (``sim.scenario.prefix_cache_spec``); a shared storage
    tier is not counted (the estimate errs towards more prefillers). 0 when the scenario's cache is off."""
    if not sc.prefix_cache.enabled:
        return 0
    from types import SimpleNamespace

    from rackbed.engine.core.prefix_reuse import BLOCK
    from rackbed.sim.scenario import prefix_cache_spec

    group = SimpleNamespace(gpus=_plan_gpus(topo, n_gpus, role, gpu))
    dep = SimpleNamespace(aggregated=None, prefillers=[group])
    pcs = prefix_cache_spec(sc, topo, model, dep)
    blocks = pcs.hbm_blocks + sum(t.capacity_blocks for t in pcs.lower)
    return max(1, blocks * pcs.block_tokens // BLOCK)


def decode_options(spec: SearchSpec, load: Load, model, topos: Mapping, gpu: str | None = None
                   ) -> list[DecodeOption]:
    """Decode options with their analytic figures (module docstring), pruned ones included; ``gpu``: on that
    GPU model of a mixed topology (``decode.gpu``)."""
    from rackbed.sim.scenario import cost_model_for, decode_plan_for

    sp = spec.space
    base = base_scenario(spec)
    ctx = load.prompt_mean + load.output_mean / 2
    out = []
    for tname in sp.topology:
        topo = topos[tname]
        for fmt in sp.weight_format:
            for ep, dtp, extra in itertools.product(sp.decode_ep, sp.decode_tp, sp.decode_extra_slots_per_rank):
                for cap in sp.max_batch_per_rank:
                    for k, dov, kv, mc in itertools.product(sp.draft_k, sp.decode_overlap,
                                                            sp.kv_dtype or (None,), sp.decode_moe_comm):
                        red = min_redundant_experts(model.n_experts, ep) + (extra * ep if model.n_experts else 0)
                        o = DecodeOption(tname, fmt, ep, cap, k, context_tokens=ctx, tp=dtp,
                                         redundant_experts=red, overlap=dov, kv_dtype=kv, gpu=gpu,
                                         moe_comm=mc)
                        out.append(o)
                        try:
                            sc = _scenario(base, {"topology": tname, "weight_format": fmt, "decode.ep": ep,
                                                  "decode.max_batch_per_rank": cap, "mtp.draft_k": k,
                                                  **_decode_tp_override(dtp, red, dov, mc),
                                                  **_kv_override(kv),
                                                  **gpu_override("decode", gpu)})
                            plan = decode_plan_for(sc, model, _plan_gpus(topo, ep, "decode", gpu))
                            bud = plan.validate(model, topo)
                            o.kv_capacity_tokens = bud.kv_capacity_tokens
                            o.b_max = min(cap, int(bud.kv_capacity_tokens // max(1.0, ctx)))
                            if o.b_max < 1:
                                o.pruned = (f"KV capacity {bud.kv_capacity_tokens} tokens/rank holds no sequence "
                                            f"of {ctx:.0f} tokens")
                                continue
                            cm = cost_model_for(sc, model, topo, None, plan)[0]
                            e_tok = sc.mtp.expected_tokens_per_step()
                            tpot = functools.partial(_decode_tpot, cm, ctx, k, e_tok)
                            t_cap, bd = tpot(o.b_max)
                            o.tpot_at_cap_s, o.breakdown_at_cap = t_cap, bd
                            if t_cap > spec.slo.tpot_s:
                                o.pruned = (f"TPOT at batch {o.b_max}/rank {t_cap * 1e3:.1f} ms > SLO "
                                            f"{spec.slo.tpot_s * 1e3:.1f} ms")
                                continue
                            conc = load.rate_per_s * load.output_mean * t_cap  # sequences in flight (Little)
                            o.replicas = max(1, math.ceil(conc / (o.ranks * o.b_max)))
                            b = float(o.b_max)
                            for _ in range(8):  # fixed point b = rate * out * TPOT(b) / (replicas * ep), from above
                                t_b, bd = tpot(b)
                                nb = min(float(o.b_max), load.rate_per_s * load.output_mean * t_b / (o.replicas * o.ranks))
                                if abs(nb - b) < 0.05:
                                    b = nb
                                    break
                                b = nb
                            o.b_op = b
                            o.tpot_s, o.breakdown = tpot(b)
                        except (ValueError, FileNotFoundError) as exc:
                            o.pruned = one_line(exc)
    return out


def _decode_tpot(cm, ctx: float, draft_k: int, tokens_per_step: float, b: float) -> tuple[float, object]:
    """(TPOT seconds, StepBreakdown) of a decode step with ``ceil(b)`` sequences of ``ctx`` tokens on every rank,
    priced by the cost model ``cm`` as the simulator prices a step from its busiest rank."""
    bi = max(1, math.ceil(b - 1e-9))
    bd = cm.decode_breakdown(bi, bi * ctx, draft_k)
    return bd.total_s / tokens_per_step, bd


def kv_transfer_s(built, tokens: int) -> float:
    """The simulator's time for one KV transfer of a ``tokens``-token prompt from prefiller 0 to rank 0 of
    decoder 0 of ``built`` (``sim.scenario.build``) over an idle network: the plan as ``Scheduler._next_kv`` makes
    it (the bytes split evenly over the prefiller node's NICs, all into the rank's NIC; the cost model's chunk
    count), timed by the simulator's own executor and network."""
    from rackbed.engine.core.plans import KvTransfer
    from rackbed.sim.executor import Executor
    from rackbed.sim.network import Network

    dep = built.deployment
    pf, d = dep.prefillers[0], dep.decoders[0]
    n_bytes = dep.kv_transfer_bytes(tokens)
    each, extra = divmod(n_bytes, len(pf.nics))
    flows = tuple((nic, d.rank_nics[0], each + 1 if j < extra else each) for j, nic in enumerate(pf.nics))
    plan = KvTransfer(f"{pf.id}.kv0", 0, pf.id, d.id, 0, tokens, n_bytes,
                      built.cost_model.kv_chunks(pf, d, tokens), flows)
    groups = {g.id: g for g in (*dep.prefillers, *dep.decoders)}
    return Executor(built.cost_model, Network(dep.nic_GBps), groups.get).duration(plan, 0.0)


def _pair_kv_s(base: Mapping, cache: dict, p: PrefillOption, d: DecodeOption, tokens: int) -> float | None:
    """:func:`kv_transfer_s` for one prefiller and one decoder of these options (memoised on what the KV path
    depends on); None when the simulator's placement refuses the pair (the simulation records why)."""
    key = (p.topology, p.weight_format, p.tp, p.ep, p.max_batch_tokens, d.ep, d.tp, d.redundant_experts,
           d.kv_dtype, p.gpu, d.gpu)
    if key not in cache:
        from rackbed.sim.scenario import build

        ov = {"topology": p.topology, "weight_format": p.weight_format, "prefill.tp": p.tp, "prefill.ep": p.ep,
              "prefill.max_batch_tokens": p.max_batch_tokens, "prefill.replicas": 1, "decode.ep": d.ep,
              "decode.max_batch_per_rank": d.max_batch_per_rank, "decode.replicas": 1, "mtp.draft_k": d.draft_k,
              **_decode_tp_override(d.tp, d.redundant_experts), **_kv_override(d.kv_dtype),
              **gpu_override("prefill", p.gpu), **gpu_override("decode", d.gpu)}
        try:
            cache[key] = kv_transfer_s(build(_scenario(base, ov)), tokens)
        except (ValueError, FileNotFoundError):
            cache[key] = None
    return cache[key]


def _get(d: Mapping, dotted: str, default=None):
    from rackbed.sim.sweep import get_path

    v = get_path(d, dotted)
    return default if v is None else v


def candidates(spec: SearchSpec, load: Load, model, topos: Mapping,
               pre: Sequence[PrefillOption], dec: Sequence[DecodeOption]) -> list[Candidate]:
    """Every (prefill option x decode option) of the same topology, format and KV cache format, with replica
    variants when the spec lists replica counts; a candidate is pruned when a part is, when it needs more GPUs
    than there are, or when the KV transfer per token after the first lifts its TPOT at the batch cap above the
    SLO."""
    sp = spec.space
    base = base_scenario(spec)
    kv_cache: dict = {}
    prompt = max(1, round(load.prompt_mean))
    after_first = load.output_mean - 1  # tokens the TPOT is an average over (the first comes with the prefill)
    out = []
    for p in pre:
        for d in dec:
            if (p.topology, p.weight_format, p.kv_dtype) != (d.topology, d.weight_format, d.kv_dtype):
                continue
            n_topo = topos[p.topology].n_gpus
            if spec.max_gpus is not None and spec.max_gpus < n_topo:
                n_topo, where = spec.max_gpus, "max_gpus is"
            else:
                where = f"{p.topology} has"
            kv = _pair_kv_s(base, kv_cache, p, d, prompt) if p.pruned is None and d.pruned is None else None
            kv_tok = kv / after_first if kv is not None and after_first > 0 else 0.0
            if p.pruned is None and d.pruned is None and d.tpot_at_cap_s + kv_tok > spec.slo.tpot_s:
                d = _with(d, pruned=(f"TPOT at batch {d.b_max}/rank {(d.tpot_at_cap_s + kv_tok) * 1e3:.1f} ms "
                                     f"with the KV transfer ({kv * 1e3:.1f} ms) > SLO {spec.slo.tpot_s * 1e3:.1f} ms"))
            for pr in (sp.prefill_replicas or (p.replicas,)):
                for dr in (sp.decode_replicas or (d.replicas,)):
                    pp = _with(p, replicas=pr)
                    dd = _with(d, replicas=dr)
                    n = pr * max(p.tp, p.ep) + dr * d.ep
                    if n > n_topo and sp.prefill_replicas is None and p.pruned is None:
                        # the headroom is a margin, not a need: fewer prefillers, down to the load's own, that fit
                        # the topology keep the candidate (the simulation says whether the TTFT SLO still holds)
                        fit = (n_topo - dr * d.ep) // max(p.tp, p.ep)
                        if fit >= math.ceil(load.input_tokens_per_s / p.capacity_tokens_per_s):
                            pr, pp = fit, _with(p, replicas=fit)
                            n = pr * max(p.tp, p.ep) + dr * d.ep
                    pruned = p.pruned or d.pruned
                    if pruned is None and (pr < 1 or dr < 1):
                        pruned = "needs at least one prefiller and one decoder"
                    if pruned is None and n > n_topo:
                        pruned = f"needs {n} GPUs ({pr} x {max(p.tp, p.ep)} + {dr} x {d.ep}); {where} {n_topo}"
                    tpg = load.output_tokens_per_s / n if n and pruned is None else math.nan
                    tpot = d.tpot_s + kv_tok
                    tpu = 1.0 / tpot if pruned is None and tpot > 0 else math.nan
                    price = spec.price(p.topology)
                    cost = cost_per_mtok_usd(price, tpg) if price and pruned is None else None
                    c = Candidate(pp, dd, n, tpg, tpu, cost, pruned, est_ttft_s=p.ttft_floor_s, est_tpot_s=tpot,
                                  kv_transfer_s=math.nan if kv is None else kv)
                    c.overrides = scenario_overrides(spec, c)
                    out.append(c)
    _mark_duplicates(out)
    return out


def _mark_duplicates(cands: Sequence[Candidate]) -> None:
    """Candidates that differ only in a batch cap that does not bind at the estimated operating point (same
    replicas, same operating batch) behave alike: keep the one with the smallest cap, prune the rest."""
    seen: dict[tuple, Candidate] = {}
    for c in sorted(cands, key=lambda c: c.decode.max_batch_per_rank):
        if c.pruned is not None:
            continue
        ov = dict(c.overrides)
        ov.pop("decode.max_batch_per_rank")
        key = (tuple(sorted(ov.items())), round(c.decode.b_op, 3))
        first = seen.get(key)
        if first is None:
            seen[key] = c
        else:
            c.pruned = (f"same operating point as batch cap {first.decode.max_batch_per_rank} "
                        f"(estimated batch {c.decode.b_op:.1f}/rank)")


def _with(o, **kw):
    import dataclasses

    return dataclasses.replace(o, **kw)


def cost_per_mtok_usd(gpu_hour_usd: float, tokens_per_s_per_gpu: float | None) -> float | None:
    """Dollars per million output tokens at ``gpu_hour_usd`` per GPU-hour."""
    if not tokens_per_s_per_gpu or tokens_per_s_per_gpu <= 0 or math.isnan(tokens_per_s_per_gpu):
        return None
    return gpu_hour_usd / (3600.0 * tokens_per_s_per_gpu) * 1e6


def run_cost_per_mtok_usd(gpu_hour_usd: float, rec: Mapping) -> float | None:
    """Dollars per million output tokens of a simulated point under the one accounting rule (``sim.energy``): the
    whole pool for the whole run, GPU-hours at ``gpu_hour_usd`` plus the energy the record's ``energy`` section
    priced (the scenario's ``energy.usd_per_kwh`` and PUE). A record without one (a GPU with no power figure)
    counts GPU-hours of the GPUs in use only (:func:`cost_per_mtok_usd`)."""
    e = (rec.get("metrics") or {}).get("energy")
    if not e:
        return cost_per_mtok_usd(gpu_hour_usd, rec["summary"].get("tokens_per_s_per_gpu"))
    out = e.get("output_tokens") or 0
    if out <= 0:
        return None
    return (gpu_hour_usd * e["pool_gpus"] * e["duration_s"] / 3600.0 + e["usd_energy"]) / (out / 1e6)


def scenario_overrides(spec: SearchSpec, c: Candidate) -> dict:
    """Dotted scenario overrides of a candidate (the keys ``sim.sweep`` points use)."""
    p, d = c.prefill, c.decode
    return {"topology": p.topology, "weight_format": p.weight_format, "prefill.tp": p.tp, "prefill.ep": p.ep,
            "prefill.max_batch_tokens": p.max_batch_tokens, "prefill.replicas": p.replicas,
            "decode.ep": d.ep, "decode.max_batch_per_rank": d.max_batch_per_rank, "decode.replicas": d.replicas,
            "mtp.draft_k": d.draft_k, **_decode_tp_override(d.tp, d.redundant_experts, d.overlap, d.moe_comm),
            **_prefill_overlap_override(p.overlap), **_kv_override(d.kv_dtype)}


def base_scenario(spec: SearchSpec) -> dict:
    """The scenario every candidate's overrides are applied to."""
    from rackbed.sim.sweep import deep_merge

    base = {"kind": "serving", "name": spec.name, "seed": spec.seed, "topology": spec.space.topology[0],
            "model": spec.model, "kv_dtype": spec.kv_dtype, "weight_format": spec.space.weight_format[0],
            "mtp": {"accept_p": spec.mtp_accept_p},
            "workload": spec.workload.model_dump(mode="json", exclude_none=True),
            "slo": {"ttft_s": spec.slo.ttft_s, "tpot_s": spec.slo.tpot_s},
            "sim": {"decision_log": False}}
    return deep_merge(base, spec.scenario)


def select_for_simulation(cands: Sequence[Candidate], budget: int) -> list[Candidate]:
    """Surviving candidates, whole analytic-Pareto layers at a time, at most ``budget`` (the last layer is cut
    by estimated tokens/s per GPU when it overflows)."""
    alive = [c for c in cands if c.pruned is None]
    vals = [(c.est_tokens_per_s_per_gpu, c.est_tokens_per_s_per_user) for c in alive]
    chosen: list[Candidate] = []
    for layer in pareto_layers(vals):
        room = budget - len(chosen)
        if room <= 0:
            break
        layer_c = sorted((alive[i] for i in layer), key=lambda c: -c.est_tokens_per_s_per_gpu)
        chosen.extend(layer_c[:room])
    return chosen


# ------------------------------------------------------------------------------------------------------------------
# The whole search


@dataclass
class SearchResult:
    spec: SearchSpec
    load: Load
    prefill: list[PrefillOption]
    decode: list[DecodeOption]
    candidates: list[Candidate]
    simulated: list[Candidate]
    records: list[dict]          # sweep records of the simulated candidates (same order)
    eligible: list[dict]
    front: list[dict]
    best: list[dict]             # front sorted by tokens/s per GPU, the first ``top``
    explanations: dict[str, dict]  # record key -> explain()
    scenarios: dict[str, dict]     # record key -> scenario dict
    wall_s: float = 0.0
    notes: list[str] = field(default_factory=list)


def run_search(spec: SearchSpec, out_dir: str | Path, *, jobs: int = 1, ray_address: str | None = None,
               progress: bool = True, console=None) -> SearchResult:
    """The whole search (module docstring); simulations go to ``out_dir/results.jsonl`` (resumable)."""
    import time

    from rackbed import topology as topo_mod
    from rackbed.sim.scenario import parse_scenario, scenario_model
    from rackbed.sim.sweep import SweepSpec, expand, run_points

    t0 = time.perf_counter()
    model = scenario_model(parse_scenario(base_scenario(spec), f"search {spec.name}"))
    spec, note = without_unasked_mtp(spec, model)
    topos: dict[str, object] = {}
    for t in spec.space.topology:
        _cache_get(topos, t, topo_mod.load)
    load = workload_load(spec.workload, spec.seed)
    check_prefix_ids(spec, load)
    pre = prefill_options(spec, load, model, topos)
    dec = decode_options(spec, load, model, topos)
    cands = candidates(spec, load, model, topos, pre, dec)
    chosen = select_for_simulation(cands, spec.max_simulations)
    notes = [note] if note else []
    notes += prefix_cache_notes(pre)
    if not chosen:  # every candidate pruned: a sweep of no points would simulate the bare base scenario
        return SearchResult(spec, load, pre, dec, cands, [], [], [], [], [], {}, {}, wall_s=time.perf_counter() - t0,
                            notes=notes)
    from rackbed.sim import budget as bu  # its window rule and steady-state check (it imports this module)

    base = base_scenario(spec)
    window = None
    if base["workload"].get("duration_s"):  # a workload of so many seconds of arrivals (not of N requests)
        window = bu.arrival_window(spec, load)
        base["workload"]["duration_s"] = round(window, 4)
        if window > (getattr(spec.workload, "duration_s", None) or 0.0):
            notes.append(f"arrival window {window:.0f} s per simulation: {bu.LIFE_WINDOWS} lives of a request at "
                         f"the SLOs (TTFT + (output - 1) x TPOT), so that its queues reach their steady state")
    sweep = SweepSpec(name=spec.name, base=base, points=[c.overrides for c in chosen], source=f"search {spec.name}")
    points = expand(sweep)
    results = Path(out_dir) / "results.jsonl"
    run = run_points(points, results, jobs=jobs, ray_address=ray_address, progress=progress, console=console)
    by_key = {r["key"]: r for r in run.records}
    recs = [by_key.get(p.key, {"key": p.key, "status": "missing", "label": p.label}) for p in points]
    slo = spec.slo
    if window:
        # a point that meets the SLOs but whose latency still rises is decided by a run HOLD_WINDOWS x as long
        # (as the budget search does: sim.budget, step 2); every other point by its own run
        longer = []
        for i, r in enumerate(recs):
            r["steady"] = bu.steady(r, slo.ttft_s, slo.tpot_s, slo.percentile, window_s=window,
                                    output_tokens=load.output_mean)
            met = meets_slo(r, slo.ttft_s, slo.tpot_s, slo.percentile)
            r["holds"], r["window_s"] = met and r["steady"]["ok"], window
            if met and not r["steady"]["ok"]:
                longer.append(i)
        if longer:
            wl = round(bu.HOLD_WINDOWS * window, 4)
            long_points = expand(SweepSpec(name=spec.name, base={**base, "workload": {**base["workload"],
                                                                                        "duration_s": wl}},
                                           points=[chosen[i].overrides for i in longer], source=f"search {spec.name}"))
            run = run_points(long_points, results, jobs=jobs, ray_address=ray_address, progress=progress,
                             console=console)
            by_key = {r["key"]: r for r in run.records}
            for i, p in zip(longer, long_points):
                lr = by_key.get(p.key, {"key": p.key, "status": "missing", "label": p.label})
                lr["steady"] = bu.steady(lr, slo.ttft_s, slo.tpot_s, slo.percentile, window_s=wl,
                                         output_tokens=load.output_mean)
                lr["holds"], lr["window_s"] = meets_slo(lr, slo.ttft_s, slo.tpot_s, slo.percentile), wl
                recs[i], points[i] = lr, p
    for r, c in zip(recs, chosen):
        r["candidate"] = c.label
        r["est"] = {"tokens_per_s_per_gpu": c.est_tokens_per_s_per_gpu,
                    "tokens_per_s_per_user": c.est_tokens_per_s_per_user, "n_gpus": c.n_gpus,
                    "ttft_s": c.est_ttft_s, "tpot_s": c.est_tpot_s,
                    "kv_transfer_s": None if math.isnan(c.kv_transfer_s) else c.kv_transfer_s,
                    "prefix_hit_rate": c.prefill.hit_rate}
    scen = {p.key: p.scenario for p in points}
    price = {p.key: spec.price(p.scenario.get("topology", "")) for p in points}
    for r in recs:
        if r.get("status") == "ok":
            r["summary"]["cost_per_mtok_usd"] = run_cost_per_mtok_usd(price[r["key"]], r) \
                if price[r["key"]] else None
    elig = [r for r in recs if r["holds"]] if window else \
        [r for r in recs if meets_slo(r, spec.slo.ttft_s, spec.slo.tpot_s, spec.slo.percentile)]
    front = front_of(elig, spec.objective)
    obj = OBJECTIVES[spec.objective]
    best = sorted(front, key=lambda r: -r["summary"][obj])[: spec.top]
    expl = {}
    for r in best:
        try:
            expl[r["key"]] = explain(scen[r["key"]], r)
        except (ValueError, FileNotFoundError) as exc:
            expl[r["key"]] = {"error": one_line(exc)}
    return SearchResult(spec, load, pre, dec, cands, chosen, recs, elig, front, best, expl, scen,
                        wall_s=time.perf_counter() - t0, notes=notes)


def prefix_cache_notes(pre: Sequence[PrefillOption]) -> list[str]:
    """One line per surviving prefill option with a prefix cache: the hit rate its replica count assumes."""
    return [f"prefix cache: {o.topology} {o.weight_format} TP{o.tp}/EP{o.ep} prefillers assume a hit rate of "
            f"{o.hit_rate:.1%} of prompt tokens ({o.replicas} replicas x {o.cache_blocks:,} blocks of 512 tokens, "
            "LRU, requests dealt in turn; kv_aware routing does better) and are sized for the uncached rest"
            for o in pre if o.pruned is None and o.cache_blocks > 0]


def without_unasked_mtp(spec: SearchSpec, model) -> tuple[SearchSpec, str | None]:
    """``spec`` searching only ``draft_k`` 0 when the model has no MTP layers and the spec did not list draft
    lengths itself (speculative decoding would then need a draft model the simulation does not price), and the
    note that says so (None when nothing changed)."""
    if model.n_mtp_layers or "draft_k" in spec.space.model_fields_set or spec.space.draft_k == (0,):
        return spec, None
    space = spec.space.model_copy(update={"draft_k": (0,)})
    return spec.model_copy(update={"space": space}), (
        f"{spec.model} has no MTP layers: searching MTP draft_k 0 only (--draft-k 1,2 --mtp-layers 1 searches with a "
        "trained MTP head of the model's width)")


def spec_from_flags(*, model: str, topology: Sequence[str], weight_format: Sequence[str], rate_per_s: float,
                    prompt_tokens: int, output_tokens: int, duration_s: float, ttft_s: float, tpot_s: float,
                    gpu_hour_usd: float = 0.0, prefill_tp: Sequence[int] | None = None,
                    decode_ep: Sequence[int] | None = None, max_batch_per_rank: Sequence[int] | None = None,
                    draft_k: Sequence[int] | None = None, max_simulations: int = 60, top: int = 5,
                    name: str = "search", mtp_layers: int | None = None, trace: str | None = None,
                    prefix_cache: Mapping | None = None, max_gpus: int | None = None,
                    decode_overlap: Sequence[str] | None = None, decode_tp: Sequence[int] | None = None,
                    kv_dtype: Sequence[str] | None = None, objective: str = "gpu",
                    decode_moe_comm: Sequence[str] | None = None) -> SearchSpec:
    """A SearchSpec from command-line flags (Poisson arrivals, fixed prompt / output lengths). ``mtp_layers``:
    the scenarios' ``mtp.draft`` (``{kind: mtp, layers: N}``), needed to draft with a model without MTP layers.
    ``trace``: replay this trace (a shipped name or a path) at ``rate_per_s`` instead, looped so that a high rate
    does not run out of requests (each pass on fresh block ids); its lengths replace the fixed ones.
    ``prefix_cache``: the scenarios' ``prefix_cache`` section. ``max_gpus``: candidates of at most this many
    GPUs. ``decode_overlap``: the decode overlap modes to try (``sim.costs.overlap``; None: none only).
    ``decode_tp``: attention TP degrees of a decoder's DP ranks (None: 1); ``kv_dtype``: KV cache formats to try
    (None: the spec's, bf16); ``objective``: ``gpu`` or ``kw`` (:attr:`SearchSpec.objective`);
    ``decode_moe_comm``: the decoders' MoE communication modes to try (None: a2a only)."""
    space: dict[str, Any] = {"topology": tuple(topology), "weight_format": tuple(weight_format)}
    for k, v in (("prefill_tp", prefill_tp), ("decode_ep", decode_ep), ("max_batch_per_rank", max_batch_per_rank),
                 ("draft_k", draft_k), ("decode_overlap", decode_overlap), ("decode_tp", decode_tp),
                 ("kv_dtype", kv_dtype), ("decode_moe_comm", decode_moe_comm)):
        if v is not None:
            space[k] = tuple(v)
    data = {"name": name, "model": model,
            "workload": {"kind": "synthetic", "arrival": {"kind": "poisson", "rate_per_s": rate_per_s},
                         "prompt": {"kind": "fixed", "tokens": prompt_tokens},
                         "output": {"kind": "fixed", "tokens": output_tokens}, "duration_s": duration_s},
            "slo": {"ttft_s": ttft_s, "tpot_s": tpot_s}, "gpu_hour_usd": gpu_hour_usd, "space": space,
            "max_simulations": max_simulations, "top": top, "max_gpus": max_gpus, "objective": objective}
    if trace is not None:
        from rackbed.engine.core.traces import TRACE_FILES

        data["workload"] = {"kind": "trace", **({"name": trace} if trace in TRACE_FILES else {"path": trace}),
                            "rate_per_s": rate_per_s, "duration_s": duration_s, "loop": True}
    scenario: dict[str, Any] = {}
    if mtp_layers is not None:
        scenario["mtp"] = {"draft": {"kind": "mtp", "layers": mtp_layers}}
    if prefix_cache is not None:
        scenario["prefix_cache"] = dict(prefix_cache)
    if scenario:
        data["scenario"] = scenario
    return parse_search(data, "rackbed search flags")


def check_prefix_ids(spec: SearchSpec, load: Load) -> None:
    """A search whose scenarios enable the prefix cache needs a workload with prefix block ids (a trace with hash
    ids, or sessions): a one-line UserError otherwise, before any candidate is priced."""
    if (spec.scenario.get("prefix_cache") or {}).get("enabled") and not any(
            r.prefix_hash_ids for r in load.requests[:10_000]):
        raise UserError(f"prefix cache: the {spec.workload.kind} workload carries no prefix block ids, so nothing "
                        "can be reused; give --trace mooncake (a trace with hash ids) or a sessions workload")
