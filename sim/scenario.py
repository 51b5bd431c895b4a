"""Serving scenarios: the YAML schema, building a deployment from it, and running it.

A serving scenario names a topology, a model, the prefill and decode parallelism and replica counts, the workload,
SLOs, MTP, the autoscaler and faults. ``load_scenario`` validates it (one-line errors naming the file and field);
``build`` turns it into what the SimPy driver needs (a placed ``Deployment``, validated ``ParallelPlan``s whose
memory budgets set the KV capacities, a cost model over ``sim.costs``); ``run_serving`` simulates and writes
metrics (JSON, CSV), plots and a Perfetto trace, and prints a summary table.

The cost model a built scenario runs on is ``sim.scenario_costs.ScenarioCostModel``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal

from pydantic import ConfigDict, Field, ValidationError, field_validator

from rackbed.engine.core.workload import WorkloadSpec
from rackbed.sim.aggregated import AggregatedSection, check_aggregated
from rackbed.sim.parallel import check_parallel, decode_plan_for, prefill_plan_for
from rackbed.sim.scenario_costs import ScenarioCostModel
from rackbed.topology.errors import NoBoolNumbers, UserError, from_validation


class _Strict(NoBoolNumbers):
    model_config = ConfigDict(extra="forbid", frozen=True)


Overlap = Literal["none", "shared_expert", "two_batch"]


class PrefillSection(_Strict):
    """Prefiller groups: ``max(tp, ep)`` GPUs in one node (TP attention + EP experts on the same GPUs;
    :mod:`sim.parallel`). ``overlap``: ``none`` or ``two_batch`` (two micro-batches, one's all-reduces under
    the other's compute: :mod:`sim.costs.overlap`). ``gpu``: the GPU model the groups are placed on (part of
    its name, e.g. ``H200``; None: any — a joined topology of several kinds needs it). ``span_nodes``: the group
    takes ``max(tp, ep) / node size`` whole nodes; then ``tp < ep`` is allowed (``ep / tp`` DP attention ranks, the
    experts over all ``ep`` GPUs, dispatch and combine in DeepEP normal mode across nodes:
    ``sim.costs.step.dp_prefill_step_breakdown``)."""

    tp: int = Field(4, ge=1)
    ep: int = Field(4, ge=1)
    replicas: int = Field(1, ge=0)
    max_batch_tokens: int = Field(16384, ge=1)
    kv_streams: int = Field(2, ge=1)
    max_queue_requests: int | None = Field(None, ge=1)
    kv_replication: int | None = Field(None, ge=1)
    overlap: Overlap = "none"
    gpu: str | None = None
    span_nodes: bool = False

    @field_validator("overlap")
    @classmethod
    def _prefill_overlap(cls, v: str) -> str:
        if v == "shared_expert":
            raise ValueError("shared_expert overlap has nothing to run under in a TP=EP prefiller (the "
                             "shared expert's partial sums ride in the combine all-reduce): use two_batch or "
                             "none")
        return v


class ExpertLoadSection(_Strict):
    """How a decode step's routed tokens fall on the experts (``engine.core.expert_load``): ``uniform`` (the
    default when the section is absent), ``power_law`` (``alpha`` None: the model family's default) or
    ``histogram`` (per-expert ``weights``, or a ``file`` of them: one row for every MoE layer or one row per
    layer; a relative path is read from the scenario file's folder). ``samples``: seeded Monte Carlo draws of each
    layer's routing per priced batch (0: the closed form at the expected counts)."""

    dist: Literal["uniform", "power_law", "histogram"]
    alpha: float | None = Field(None, ge=0)
    weights: tuple[Annotated[float, Field(ge=0)], ...] | None = Field(None, min_length=1)
    file: str | None = None
    seed: int = 0
    samples: int = Field(16, ge=0, le=4096)


class EplbSection(_Strict):
    """Expert-parallel load balancing: redundant slots placed by observed load, rebalanced every
    ``rebalance_steps`` decode steps (``sim.costs.eplb``: the weight movement is a stall amortised over them)."""

    enabled: bool = True
    rebalance_steps: int = Field(1000, ge=1)


class DecodeSection(_Strict):
    """Decoder groups: ``ep`` GPUs of one NVLink domain, ``ep / tp`` DP attention ranks of ``tp`` GPUs each;
    with ``span_nodes`` ``ep / node size`` whole nodes (NVLink domains), the all-to-all crossing nodes over each
    GPU's own NIC (DeepEP low-latency mode, :mod:`sim.costs.moe_comm`).
    ``expert_load`` / ``eplb``: skewed routing and its balancing (None: uniform routing, static placement).

    ``overlap``: ``none``, ``shared_expert`` (the shared expert alongside the dispatch) or ``two_batch`` (two
    micro-batches, one's all-to-all under the other's compute): :mod:`sim.costs.overlap`. ``gpu``: as
    :class:`PrefillSection`'s. ``moe_comm``: ``a2a`` (tokens to their experts' GPUs by a sparse all-to-all) or
    ``allgather`` (every GPU gathers every GPU's tokens and a reduce-scatter returns the expert outputs:
    TensorRT-LLM's MoE communication inside one NVLink domain without its all-to-all kernels):
    :mod:`sim.costs.moe_comm`."""

    ep: int = Field(16, ge=1)
    tp: int = Field(1, ge=1)
    replicas: int = Field(1, ge=0)
    max_batch_per_rank: int = Field(64, ge=1)
    page_tokens: int = Field(64, ge=1)
    redundant_experts: int = Field(0, ge=0)
    expert_load: ExpertLoadSection | None = None
    eplb: EplbSection | None = None
    overlap: Overlap = "none"
    gpu: str | None = None
    span_nodes: bool = False
    moe_comm: Literal["a2a", "allgather"] = "a2a"


class MtpDraft(_Strict):
    """Draft tokens from ``layers`` MTP module(s) of the model's own width (one full-attention decoder layer with
    the model's MLP each, :func:`sim.costs.step.decode_step_breakdown`): the model's own MTP layers when its
    config has them (at most that many), else the statement that the deployment adds trained MTP head(s)."""

    kind: Literal["mtp"]
    layers: int = Field(1, ge=1)


class ModelDraft(_Strict):
    """Draft tokens from a separate small model (a preset name or a Hugging Face config.json), priced as one
    decode step of that model per draft token on the decoder's GPUs; it must share the target's vocabulary."""

    kind: Literal["model"]
    model: str


class MtpSection(_Strict):
    """Speculative decoding. ``draft_k``: draft tokens per step (None: 1 when the model has MTP layers, else 0 —
    resolved by :func:`resolve_mtp`); ``accept_p``: geometric acceptance; ``acceptance``: per-position curve
    ``[a1, a2, ...]`` (P(draft i accepted | drafts < i accepted)) used instead of ``accept_p`` when given;
    ``draft``: what drafts the tokens (None: the model's own MTP layers)."""

    draft_k: int | None = Field(None, ge=0, le=16)
    accept_p: float = Field(0.8, ge=0.0, le=1.0)
    acceptance: tuple[Annotated[float, Field(ge=0.0, le=1.0)], ...] | None = Field(None, min_length=1)
    draft: Annotated[MtpDraft | ModelDraft, Field(discriminator="kind")] | None = None

    def expected_tokens_per_step(self, draft_k: int | None = None) -> float:
        """Mean tokens a sequence gains per decode step at ``draft_k`` (default: this section's)."""
        from rackbed.engine.core.specdec import expected_tokens_per_step

        return expected_tokens_per_step(self.draft_k if draft_k is None else draft_k, self.accept_p,
                                        self.acceptance)

    def spec(self):
        """The :class:`~engine.core.deployment.MtpSpec` the scheduler draws from."""
        from rackbed.engine.core.deployment import MtpSpec

        return MtpSpec(draft_k=self.draft_k, accept_p=self.accept_p, acceptance=self.acceptance)


class SloSection(_Strict):
    ttft_s: float | None = Field(None, gt=0)
    tpot_s: float | None = Field(None, gt=0)


class EnergySection(_Strict):
    """Prices and facility efficiency for the run's energy and cost (``sim.energy``: the whole pool for the whole
    simulated time): ``usd_per_gpu_hour`` (0: energy cost only), ``usd_per_kwh``, ``pue`` (facility / IT power)."""

    usd_per_gpu_hour: float = Field(0.0, ge=0)
    usd_per_kwh: float = Field(0.10, ge=0)
    pue: float = Field(1.2, ge=1)

    def prices(self):
        from rackbed.sim.energy import EnergyPrices

        return EnergyPrices(self.usd_per_gpu_hour, self.usd_per_kwh, self.pue)


class AutoscalerSection(_Strict):
    enabled: bool = True
    interval_s: float = Field(5.0, gt=0)
    scale_up_delay_s: float = Field(30.0, ge=0)
    prefill_headroom: float = Field(1.2, gt=0)
    backlog_s: float = Field(10.0, gt=0)
    decode_batch_threshold: float = Field(48.0, gt=0)
    scale_down_frac: float = Field(0.5, ge=0, le=1)
    min_prefillers: int = Field(1, ge=0)
    max_prefillers: int | None = Field(None, ge=0)
    min_decoders: int = Field(1, ge=0)
    max_decoders: int | None = Field(None, ge=0)


class FaultSection(_Strict):
    """A GPU (``gpu:12``), a node (``node:3``), a NIC/link (``nic:5``), a rack (``rack:1``: an NVLink domain) or
    a rack's fabric links (``rack_link:1``) goes down at ``at_s``."""

    at_s: float = Field(ge=0)
    target: str
    duration_s: float | None = Field(None, gt=0)


class PoliciesSection(_Strict):
    """The scheduler's policies by name (``engine.core.policies``: PREFILLER_ROUTING, DECODER_RANK, ADMISSION).
    ``kv_aware_weight``: the load weight of ``kv_aware`` routing (score = cached prefix tokens - weight x queued
    tokens); ``random_seed``: the seed of ``random`` routing."""

    prefiller: str = "least_queued_tokens"
    rank: str = "fewest_requests"
    admission: str = "fifo"
    worker: str = "least_requests"  # aggregated workers
    kv_aware_weight: float = Field(1.0, ge=0)
    random_seed: int = Field(0, ge=0)

    @field_validator("prefiller", "rank", "admission", "worker")
    @classmethod
    def _known(cls, v: str, info) -> str:
        from rackbed.engine.core import policies

        table = {"prefiller": policies.PREFILLER_ROUTING, "rank": policies.DECODER_RANK,
                 "admission": policies.ADMISSION, "worker": policies.WORKER_ROUTING}[info.field_name]
        if v not in table:
            raise ValueError(f"unknown policy {v!r}; one of {', '.join(sorted(table))}")
        return v

    def build(self):
        """The :class:`~engine.core.policies.Policies` named here."""
        from rackbed.engine.core.policies import KvAwareRouting, Policies, RandomRouting

        pol = Policies.named(self.prefiller, self.rank, self.admission, self.worker)
        made = {"kv_aware": lambda: KvAwareRouting(self.kv_aware_weight),
                "random": lambda: RandomRouting(self.random_seed)}
        upd = {f: made[getattr(self, f)]() for f in ("prefiller", "worker") if getattr(self, f) in made}
        return dataclasses.replace(pol, **upd) if upd else pol


class PrefixCacheSection(_Strict):
    """Prefix caching on every prefiller (or aggregated worker), ``docs/PREFIX_CACHE.md``: a block cache keyed by
    the trace's prefix block ids, LRU, with HBM, host-memory and optional shared-storage tiers.

    block_tokens:      tokens per cached block (divides, or is a multiple of, the trace's 512-token blocks).
    hbm_gb_per_gpu:    HBM each GPU gives the cache (GB; a carve-out beside the prefill KV buffer).
    host_gb_per_gpu:   host memory per GPU for the host tier (GB; None: the GPU's share of its CPU's memory from
                       the topology — 240 GB per GPU of a GB200 superchip's Grace, 250 GB on an HGX node; 0: none).
    host_GBps_per_gpu: copy bandwidth host -> HBM per GPU (None: the topology's GPU-CPU link, capped by the CPU's
                       memory bandwidth shared by its GPUs: C2C on GB200, PCIe on HGX).
    storage_gb:        a storage tier every worker shares (GB; 0: none); ``storage_GBps_per_gpu`` its read rate.
    eviction:          ``lru`` (least recently released block first, a prefix's tail before its head).
    """

    enabled: bool = False
    block_tokens: int = Field(512, ge=1)
    hbm_gb_per_gpu: float = Field(8.0, gt=0)
    host_gb_per_gpu: float | None = Field(None, ge=0)
    host_GBps_per_gpu: float | None = Field(None, gt=0)
    storage_gb: float = Field(0.0, ge=0)
    storage_GBps_per_gpu: float = Field(5.0, gt=0)
    eviction: Literal["lru"] = "lru"


class SimSection(_Strict):
    until_s: float | None = Field(None, gt=0)
    sample_interval_s: float | None = Field(None, gt=0)
    decision_log: bool = True
    chunked_prefill: bool = False
    shed_ttft_s: float | None = Field(None, gt=0)
    policies: PoliciesSection = Field(default_factory=PoliciesSection)


class KillSection(_Strict):
    """Real mode failure drill: kill the rank process of ``gpu`` at clock time ``at_s``."""

    at_s: float = Field(ge=0)
    gpu: int = Field(ge=0)


class RealSection(_Strict):
    """How ``rackbed real`` runs this scenario on local devices (ignored by the simulator).

    weights: a Hugging Face checkpoint directory (config.json + *.safetensors) or null for seeded random weights
    with the model's real shapes. Pages are per rank, of ``decode.page_tokens`` tokens. mtp_agree: p in
    [0, 1] shapes the random weights so the MTP module's drafts are accepted with probability p each (given
    the earlier ones were), the geometric acceptance ``mtp.accept_p`` states (``engine.real.agreeing``; a
    model whose MTP module real mode runs, random weights only); null: plain random weights, whose drafts are
    almost never accepted.
    """

    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["bf16", "fp32"] = "bf16"
    weights: str | None = None
    weights_seed: int = 0
    mtp_agree: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    prefill_pages: int = Field(4096, ge=1)
    decode_pages: int = Field(4096, ge=1)
    kill: tuple[KillSection, ...] = ()
    #: after the run, each rank re-runs up to this many sampled plans of each kind under the profiler
    #: (``engine.real.profiling``; ``real.json``'s ``term_profile``); 0: none
    profile_plans: int = Field(0, ge=0)


class ServingScenario(_Strict):
    """A whole serving deployment under a workload (see the module docstring)."""

    kind: Literal["serving"] = "serving"
    name: str = "scenario"
    description: str = ""
    claim: str = ""
    seed: int = 0
    topology: str
    model: str
    model_layers: int | None = Field(None, ge=1)
    weight_format: str = "fp8_block"
    kv_dtype: Literal["bf16", "fp8"] = "bf16"
    calibration: str = "auto"
    #: the serving stack whose kernels price the run: ``rackbed`` (this repository's engine, its own H200
    #: measurements), ``trtllm`` / ``sglang`` / ``vllm`` (imported per-operator tables), ``auto`` (the first shipped
    #: for the GPU, in that order)
    stack: Literal["auto", "rackbed", "trtllm", "sglang", "vllm"] = "auto"
    #: ``disaggregated``: prefillers hand KV to decoders (``prefill`` / ``decode``); ``aggregated``: workers that
    #: prefill and decode on the same GPUs (``aggregated``, :mod:`sim.aggregated`)
    deployment: Literal["disaggregated", "aggregated"] = "disaggregated"
    aggregated: AggregatedSection | None = None
    prefill: PrefillSection = Field(default_factory=PrefillSection)
    decode: DecodeSection = Field(default_factory=DecodeSection)
    mtp: MtpSection = Field(default_factory=MtpSection)
    workload: WorkloadSpec
    slo: SloSection = Field(default_factory=SloSection)
    energy: EnergySection = Field(default_factory=EnergySection)
    autoscaler: AutoscalerSection | None = None
    faults: tuple[FaultSection, ...] = ()
    prefix_cache: PrefixCacheSection = Field(default_factory=PrefixCacheSection)
    sim: SimSection = Field(default_factory=SimSection)
    real: RealSection = Field(default_factory=RealSection)

    @field_validator("weight_format")
    @classmethod
    def _fmt(cls, v: str) -> str:
        from rackbed.engine.core.formats import FORMAT_NAMES

        if v not in FORMAT_NAMES:
            raise ValueError(f"unknown format {v!r}; one of {', '.join(FORMAT_NAMES)}")
        return v


def parse_scenario(data: dict, source: str | Path | None = None) -> ServingScenario:
    try:
        sc = ServingScenario.model_validate(data)
    except ValidationError as exc:
        raise from_validation(exc, source) from None
    sc = resolve_mtp(sc, source)
    check_aggregated(sc, source)
    return _resolve_load_file(sc, source)


def _resolve_load_file(sc: ServingScenario, source: str | Path | None) -> ServingScenario:
    """``decode.expert_load.file`` relative to the scenario file's folder (when read from a file)."""
    el = sc.decode.expert_load
    if el is None or el.file is None or source is None or Path(el.file).is_absolute():
        return sc
    path = str(Path(source).parent / el.file)
    return sc.model_copy(update={"decode": sc.decode.model_copy(update={
        "expert_load": el.model_copy(update={"file": path})})})


def expert_load_kw(sc: ServingScenario, model) -> dict:
    """Keywords of ``sim.costs.step.decode_step_breakdown`` for the scenario's ``decode.expert_load`` /
    ``decode.eplb``: ``{"expert_load": ExpertLoad}``, or nothing when routing is uniform and EPLB off (the uniform
    expectations, exactly). The rules that need the model: one-line ``UserError`` naming the field."""
    el, ep = sc.decode.expert_load, sc.decode.eplb
    if el is None and ep is None:
        return {}
    from rackbed.engine.core.expert_load import EplbSpec, ExpertLoadSpec, default_alpha, read_histogram
    from rackbed.sim.costs.eplb import ExpertLoad

    field = "decode.expert_load" if el is not None else "decode.eplb"
    if not model.n_experts:
        raise UserError(f"{field}: {model.name} has no routed experts")
    if sc.deployment == "aggregated":
        raise UserError(f"{field}: prices the disaggregated DP-EP decode step; an aggregated deployment has none")
    if ep is not None and ep.enabled and (el is None or el.dist == "uniform"):
        raise UserError("decode.eplb: with uniform routing every placement is balanced; give decode.expert_load "
                        "(power_law or histogram) or leave eplb out")
    if el is None or el.dist == "uniform":
        if el is not None and (el.alpha is not None or el.weights is not None or el.file is not None):
            raise UserError("decode.expert_load: alpha / weights / file need dist power_law or histogram")
        return {}
    if el.dist == "power_law" and (el.weights is not None or el.file is not None):
        raise UserError("decode.expert_load.weights: only with dist: histogram (power_law takes alpha)")
    weights = None
    if el.dist == "histogram":
        if el.alpha is not None:
            raise UserError("decode.expert_load.alpha: only with dist: power_law")
        if (el.weights is None) == (el.file is None):
            raise UserError("decode.expert_load: dist histogram needs exactly one of weights (a list) or file")
        try:
            weights = (tuple(el.weights),) if el.weights is not None else read_histogram(el.file)
        except UserError as exc:
            raise UserError(f"decode.{exc}") from None
        n_moe = model.n_moe_layers
        for row in weights:
            if len(row) != model.n_experts:
                raise UserError(f"decode.expert_load.weights: {len(row)} weights for the {model.n_experts} experts "
                                f"of {model.name}")
            if not sum(row) > 0:
                raise UserError("decode.expert_load.weights: all zero; give each expert's share of the tokens")
        if len(weights) not in (1, n_moe):
            raise UserError(f"decode.expert_load.file: {len(weights)} rows; give one (every MoE layer) or one per "
                            f"MoE layer ({n_moe} in {model.name})")
    alpha = None
    if el.dist == "power_law":
        alpha = el.alpha if el.alpha is not None else default_alpha(model.name)
    spec = ExpertLoadSpec(dist=el.dist, alpha=alpha, weights=weights, seed=el.seed, samples=el.samples)
    eplb = EplbSpec(enabled=ep.enabled, rebalance_steps=ep.rebalance_steps) if ep is not None else EplbSpec()
    return {"expert_load": ExpertLoad(spec, eplb)}


def _model_or_none(name: str):
    from rackbed.engine.core.model import get_model

    try:
        return get_model(name)
    except (ValueError, FileNotFoundError):  # an unknown model: ``build`` says so
        return None


def resolve_mtp(sc: ServingScenario, source: str | Path | None = None) -> ServingScenario:
    """``sc`` with ``mtp.draft_k`` resolved (1 when the model has MTP layers, else 0) and the draft rules, which
    need the model, checked: drafting with a model that has no MTP layers needs an explicit ``mtp.draft``; an MTP
    draft uses at most the model's own MTP layers (when it has some); a draft model must exist and share the
    target's vocabulary; an acceptance curve needs an entry per draft token. One-line ``UserError`` naming the
    field."""
    pre = f"{source}: " if source else ""
    m = sc.mtp
    model = _model_or_none(sc.model)
    own = model.n_mtp_layers if model is not None else 0
    k = m.draft_k if m.draft_k is not None else (1 if own else 0)
    d = m.draft
    if model is not None and k > 0 and d is None and not own:
        raise UserError(f"{pre}mtp.draft_k: {k} drafts but {model.name} has no MTP layers; add "
                        "mtp.draft: {kind: mtp, layers: 1} (a trained MTP head) or a draft model "
                        "(mtp.draft: {kind: model, model: NAME}), or set mtp.draft_k: 0")
    if isinstance(d, MtpDraft) and own and d.layers > own:
        raise UserError(f"{pre}mtp.draft.layers: {d.layers} exceeds the {own} MTP layer(s) of {model.name}")
    if isinstance(d, ModelDraft):
        dm = _model_or_none(d.model)
        if dm is None:
            from rackbed.engine.core.model import PRESET_NAMES

            raise UserError(f"{pre}mtp.draft.model: unknown model {d.model!r}; presets: {', '.join(PRESET_NAMES)} "
                            "(or a path to a config.json)")
        if model is not None and dm.vocab != model.vocab:
            raise UserError(f"{pre}mtp.draft.model: {dm.name} has a vocabulary of {dm.vocab} tokens, "
                            f"{model.name} {model.vocab}; a draft model shares the target's tokenizer")
    if m.acceptance is not None and len(m.acceptance) < k:
        raise UserError(f"{pre}mtp.acceptance: {len(m.acceptance)} entries for draft_k = {k}; "
                        "give one per draft token")
    return sc if k == m.draft_k else sc.model_copy(update={"mtp": m.model_copy(update={"draft_k": k})})


def draft_cost_kw(sc: ServingScenario) -> dict:
    """Keywords of ``sim.costs.step.decode_step_breakdown`` that say what drafts the tokens: ``n_mtp_layers``
    (an MTP draft; the model's own MTP layers when no draft is given) or ``draft_model``."""
    d = sc.mtp.draft
    if isinstance(d, ModelDraft):
        from rackbed.engine.core.model import get_model

        return {"draft_model": get_model(d.model)}
    if isinstance(d, MtpDraft):
        return {"n_mtp_layers": d.layers}
    return {}


def load_scenario(path: str | Path) -> ServingScenario:
    from rackbed.topology.yamlio import load_yaml

    path = Path(path)
    sc = parse_scenario(load_yaml(path), path)
    return _resolve_paths(sc, path.parent)


def _resolve_paths(sc: ServingScenario, base: Path) -> ServingScenario:
    """Relative topology / trace / calibration paths are relative to the scenario file."""
    upd = {}
    topo = Path(sc.topology)
    if topo.suffix in (".yaml", ".yml", ".json") and not topo.is_absolute() and (base / topo).exists():
        upd["topology"] = str(base / topo)
    wl = sc.workload
    if getattr(wl, "kind", None) == "trace" and getattr(wl, "path", None):
        p = Path(wl.path)
        if not p.is_absolute() and (base / p).exists():
            upd["workload"] = wl.model_copy(update={"path": str(base / p)})
    if sc.real.weights and not Path(sc.real.weights).is_absolute() and (base / sc.real.weights).exists():
        upd["real"] = sc.real.model_copy(update={"weights": str(base / sc.real.weights)})
    if sc.calibration not in ("auto", "none") and not Path(sc.calibration).is_absolute():
        if (base / sc.calibration).exists():
            upd["calibration"] = str(base / sc.calibration)
    return sc.model_copy(update=upd) if upd else sc


# ------------------------------------------------------------------------------------------------------------------
# Building


@dataclass
class Built:
    """Everything a run needs, derived from a scenario."""

    scenario: ServingScenario
    topology: object
    model: object
    deployment: object
    prefill_plan: object            # ParallelPlan of prefiller group 0 (the template)
    decode_plan: object             # ParallelPlan of decoder group 0
    prefill_budget: object
    decode_budget: object
    cost_model: ScenarioCostModel
    calibration: object | None
    calibration_note: str
    caveats: list[str] = field(default_factory=list)
    prefix_cache: object | None = None   # engine.core.prefix_cache.PrefixCacheSpec (None: caching off)


def _load_calibration(sc: ServingScenario, gpu_name: str):
    """``(table or None, the one line that says what priced the run)`` for the scenario's GPU and stack."""
    if sc.calibration == "none":
        return None, "uncalibrated: first-principles cost models (calibration: none)"
    if sc.calibration != "auto":
        from rackbed.sim.costs.calibration import load_calibration

        return load_calibration(sc.calibration), f"calibrated: {gpu_name} from {sc.calibration}"
    try:
        from rackbed.sim.calibrate import default_calibration_for, describe_calibration
    except ImportError:
        return None, "uncalibrated: first-principles cost models"
    table = default_calibration_for(gpu_name, stack=sc.stack)  # read once per process (sim.calibrate caches it)
    if table is None:
        return None, f"uncalibrated: no shipped calibration for {gpu_name}; first-principles cost models"
    return table, describe_calibration(table)


class _KvPathView:
    """The topology as the KV path sees it: a GPU without a scale-out NIC (the h200x2 lab box) ships KV over
    NVLink peer copies, represented as a pseudo-NIC ``nvlink:<gpu>`` with the GPU's NVLink bandwidth."""

    def __init__(self, topo) -> None:
        self.topo = topo

    def __getattr__(self, name):
        return getattr(self.topo, name)

    def nic_of_gpu(self, i: int) -> str:
        try:
            return self.topo.nic_of_gpu(i)
        except ValueError:
            return f"nvlink:{i}"

    def nic_spec(self, nic: str):
        if nic.startswith("nvlink:"):
            from types import SimpleNamespace

            g = int(nic.split(":")[1])
            peers = [x for x in self.topo.nvlink_domain(g) if x != g]
            bw = self.topo.p2p_GBps(g, peers[0]) if peers else self.topo.gpu_spec(g).nvlink_GBps_per_dir
            return SimpleNamespace(GBps=bw, kind="nvlink", name="NVLink P2P")
        return self.topo.nic_spec(nic)


def truncate_model(model, n_layers: int):
    """The model's first ``n_layers`` layers (a full-width model that fits a lab box; simulated the same way)."""
    if n_layers > model.n_layers:
        raise UserError(f"model_layers: {n_layers} exceeds the {model.n_layers} layers of {model.name}")
    upd = {"n_layers": n_layers, "layer_types": tuple(model.layer_types[:n_layers]),
           "name": f"{model.name}[:{n_layers}]"}
    if hasattr(model, "dense_layers"):
        upd["dense_layers"] = tuple(i for i in model.dense_layers if i < n_layers)
    if getattr(model, "max_context", None) is not None:  # excluded from model_dump
        upd["max_context"] = model.max_context
    return model.model_validate({**model.model_dump(), **upd})


def build(sc: ServingScenario, *, engine_calibration: bool = True) -> Built:
    """Validate the scenario against the hardware and the model, and lay out the deployment."""
    from rackbed import topology as topo_mod
    from rackbed.engine.core.deployment import DecoderTemplate, PrefillerTemplate, kv_transfer_sizes, place
    from rackbed.sim.scenario_checks import (
        budget_caveat,
        check_disaggregated,
        check_run_size,
        check_span,
        context_check,
    )
    from rackbed.topology.power import check_rack_power

    check_run_size(sc)
    topo = topo_mod.load(sc.topology)
    model = scenario_model(sc)
    context = context_check(sc, model)
    if sc.deployment == "aggregated":
        from rackbed.sim.aggregated import build_aggregated

        b = build_aggregated(sc, topo, model, _KvPathView(topo), engine_calibration=engine_calibration)
        b.caveats.extend(context)
        check_rack_power(b.deployment, topo)
        b.prefix_cache = prefix_cache_spec(sc, topo, model, b.deployment)
        return b
    p, d = sc.prefill, sc.decode
    n_p, n_d = p.replicas, d.replicas
    if sc.autoscaler is not None and sc.autoscaler.enabled:
        n_p, n_d = max(n_p, sc.autoscaler.min_prefillers), max(n_d, sc.autoscaler.min_decoders)
    if n_p + n_d == 0:
        raise UserError("prefill.replicas + decode.replicas: at least one group is needed")
    check_disaggregated(sc, n_p, n_d)
    check_parallel(sc, model)
    check_span(sc, topo)
    kv_elem = 2 if sc.kv_dtype == "bf16" else 1
    kv_tok, kv_win = kv_transfer_sizes(model, kv_elem)
    # First a placement with default capacities, to learn which GPUs group 0 of each role gets.
    ptpl0 = PrefillerTemplate(tp=p.tp, ep=p.ep, max_batch_tokens=p.max_batch_tokens, kv_streams=p.kv_streams,
                              max_queue_requests=p.max_queue_requests, span_nodes=p.span_nodes)
    dtpl0 = DecoderTemplate(ep=d.ep, tp=d.tp, max_batch_per_rank=d.max_batch_per_rank, kv_page_tokens=d.page_tokens,
                            span_nodes=d.span_nodes)
    kv_view = _KvPathView(topo)
    pgpus, dgpus = role_gpus(topo, "prefill", p.gpu), role_gpus(topo, "decode", d.gpu)
    autoscaled = sc.autoscaler is not None and sc.autoscaler.enabled
    if autoscaled and (p.gpu or d.gpu):
        raise UserError("autoscaler: not with prefill.gpu / decode.gpu (one spare pool of every GPU kind)")
    dep0 = place(kv_view, n_prefillers=max(n_p, 1), n_decoders=max(n_d, 1),
                 kv_bytes_per_token=kv_tok, kv_window_bytes=kv_win, prefiller=ptpl0, decoder=dtpl0,
                 spare="none", name=sc.name, prefill_gpus=pgpus, decode_gpus=dgpus)
    pg, dg = dep0.prefillers[0], dep0.decoders[0]
    pplan = prefill_plan_for(sc, model, pg.gpus)
    dplan = decode_plan_for(sc, model, dg.gpus)
    pbud = pplan.validate(model, topo)
    dbud = draft_budget(sc, dplan.validate(model, topo), dplan, topo)
    ptpl = PrefillerTemplate(tp=p.tp, ep=p.ep, max_batch_tokens=p.max_batch_tokens,
                             kv_capacity_tokens=max(p.max_batch_tokens, pbud.kv_capacity_tokens),
                             max_queue_requests=p.max_queue_requests, kv_streams=p.kv_streams,
                             span_nodes=p.span_nodes)
    dtpl = DecoderTemplate(ep=d.ep, tp=d.tp, max_batch_per_rank=d.max_batch_per_rank,
                           kv_capacity_tokens_per_rank=max(1, dbud.kv_capacity_tokens), kv_page_tokens=d.page_tokens,
                           span_nodes=d.span_nodes)
    dep = place(kv_view, n_prefillers=n_p, n_decoders=n_d, kv_bytes_per_token=kv_tok, kv_window_bytes=kv_win,
                prefiller=ptpl, decoder=dtpl, mtp=sc.mtp.spec(),
                chunked_prefill=sc.sim.chunked_prefill, shed_ttft_s=sc.sim.shed_ttft_s,
                spare="rest" if autoscaled else "none", name=sc.name, prefill_gpus=pgpus, decode_gpus=dgpus)
    one_gpu_kind(topo, dep)
    check_rack_power(dep, topo)  # after placement: the rack power limit (topology.power)
    cm, calib, note = cost_model_for(sc, model, topo, pplan, dplan, engine_calibration=engine_calibration)
    from rackbed.sim.coverage import calibration_caveats

    caveats = calibration_caveats(calib, topo, model, pplan, dplan)
    if cm.decode_calib is not calib:
        # decode on another GPU model, priced from its own calibration: each GPU's lines of its own role
        caveats = [c for c in caveats if not c.startswith("decode")] + [
            f"decode GPUs: {c}" for c in calibration_caveats(cm.decode_calib, topo, model, dplan, dplan)
            if not c.startswith("prefill")]
    caveats += budget_caveat(sc) + context
    return Built(sc, topo, model, dep, pplan, dplan, pbud, dbud, cm, calib, note, caveats,
                 prefix_cache_spec(sc, topo, model, dep))


def role_gpus(topo, role: str, want: str | None) -> set[int] | None:
    """The GPUs of the model ``want`` names (``prefill.gpu`` / ``decode.gpu``: part of a ``GpuSpec.name``, any
    case; None: no restriction); a one-line UserError when it names none or several of the topology's."""
    if want is None:
        return None
    kinds = sorted({topo.gpu_spec(g).name for g in topo.gpu_ids})
    hit = [k for k in kinds if want.lower() in k.lower()]
    if len(hit) != 1:
        raise UserError(f"{role}.gpu: {want!r} names {'no' if not hit else 'several'} GPU model"
                        f"{'s' if hit else ''} of {topo.name} ({', '.join(hit or kinds)})")
    return {g for g in topo.gpu_ids if topo.gpu_spec(g).name == hit[0]}


def one_gpu_kind(topo, dep) -> None:
    """A role's groups share one GPU model (their plan, memory budget and calibration are group 0's); a
    one-line UserError naming ``prefill.gpu`` / ``decode.gpu`` otherwise."""
    for role, groups in (("prefill", dep.prefillers), ("decode", dep.decoders)):
        kinds = sorted({topo.gpu_spec(g).name for grp in groups for g in grp.gpus})
        if len(kinds) > 1:
            raise UserError(f"{role}: the groups landed on {' and '.join(kinds)}; give {role}.gpu to place "
                            "them on one GPU model")


def prefix_cache_spec(sc: ServingScenario, topo, model, dep):
    """The :class:`~engine.core.prefix_cache.PrefixCacheSpec` of ``sc.prefix_cache`` for the deployment's workers
    (None when caching is off): block capacities from the GB given per GPU and the model's KV bytes per token,
    the host tier and its copy bandwidth from the topology (``Topology.host_memory``) unless given."""
    pc = sc.prefix_cache
    if not pc.enabled:
        return None
    from rackbed.engine.core.prefix_cache import PrefixCacheSpec, TierSpec

    workers = dep.aggregated or dep.prefillers
    if not workers:
        raise UserError("prefix_cache.enabled: the deployment has no prefiller (or aggregated worker) to cache on")
    g0 = workers[0].gpus
    n = len(g0)
    block_bytes = pc.block_tokens * model.kv_bytes_per_token(2 if sc.kv_dtype == "bf16" else 1)
    hbm = int(pc.hbm_gb_per_gpu * 1e9 * n // block_bytes)
    if hbm < 1:
        raise UserError(f"prefix_cache.hbm_gb_per_gpu: {pc.hbm_gb_per_gpu} GB per GPU holds no "
                        f"{pc.block_tokens}-token block ({block_bytes / 1e9:.3g} GB for {n} GPUs)")
    lower, bw, lat = [], [], []
    host = topo.host_memory(g0[0])
    host_gb = pc.host_gb_per_gpu
    if host_gb is None:
        host_gb = host[0].mem_bytes / host[2] / 1e9 if host is not None else 0.0
    if host_gb > 0:
        gbps = pc.host_GBps_per_gpu
        if gbps is None:
            if host is None:
                raise UserError(f"prefix_cache.host_GBps_per_gpu: {topo.name} gives GPU {g0[0]} no CPU link; "
                                "set the host copy bandwidth")
            cpu, link, share = host
            gbps = min(link.GBps_per_dir, cpu.mem_GBps / share)
        lower.append(TierSpec("host", int(host_gb * 1e9 * n // block_bytes)))
        bw.append(gbps)
        lat.append(host[1].latency_us * 1e-6 if host is not None else 0.0)
    shared = None
    if pc.storage_gb > 0:
        shared = TierSpec("storage", int(pc.storage_gb * 1e9 // block_bytes))
        bw.append(pc.storage_GBps_per_gpu)
        lat.append(0.0)
    try:
        return PrefixCacheSpec(hbm_blocks=hbm, block_tokens=pc.block_tokens, lower=tuple(lower), shared=shared,
                               tier_GBps=tuple(bw), tier_latency_s=tuple(lat))
    except ValueError as exc:
        raise UserError(f"prefix_cache.block_tokens: {exc}") from None


def draft_budget(sc: ServingScenario, budget, plan, topo):
    """The decoders' memory budget with a separate draft model (``mtp.draft.kind: model``) deployed beside the
    target on the same ranks: the draft's weights (sharded by the same plan, which must fit it) come out of the
    KV space and every KV token also holds the draft's KV, so the KV capacity shrinks. Unchanged otherwise."""
    if not isinstance(sc.mtp.draft, ModelDraft) or not sc.mtp.draft_k:
        return budget
    import dataclasses

    from rackbed.engine.core.model import get_model

    try:
        dbud = plan.validate(get_model(sc.mtp.draft.model), topo)
    except ValueError as exc:
        raise UserError(f"mtp.draft.model: {' '.join(str(exc).split())}") from None
    per_tok = budget.kv_bytes_per_token_per_rank + dbud.kv_bytes_per_token_per_rank
    room = budget.kv_capacity_tokens * budget.kv_bytes_per_token_per_rank - dbud.weight_bytes
    cap = int(room // per_tok) if per_tok else budget.kv_capacity_tokens
    if cap < budget.min_kv_tokens:
        raise UserError(f"mtp.draft.model: {sc.mtp.draft.model} on the decode plan leaves KV for {max(cap, 0)} "
                        f"tokens per rank, fewer than the {budget.min_kv_tokens} the batch needs")
    return dataclasses.replace(budget, kv_capacity_tokens=cap)


def scenario_model(sc: ServingScenario):
    """The scenario's model (its first ``model_layers`` layers when given)."""
    from rackbed.engine.core.model import get_model

    model = get_model(sc.model)
    return model if sc.model_layers is None else truncate_model(model, sc.model_layers)


def cost_model_for(sc: ServingScenario, model, topo, prefill_plan, decode_plan, *, engine_calibration: bool = True,
                   mode: str = "disaggregated"):
    """``(cost model, calibration table or None, note)``: the cost model ``build`` gives the simulator for a
    deployment whose group 0 of each role has these plans — the calibration the scenario selects for the GPU
    (:func:`_load_calibration`), wrapped in the engine calibration when one matches the GPU and the model. One of
    the plans may be None (a caller that prices one role only); the GPU is the prefill plan's, else the decode
    plan's; with both plans on different GPU models (mixed pools) decode takes its own GPU's calibration and
    no engine calibration applies. ``rackbed search`` prices its options through this too, so its analytic
    stage and its simulations share one cost model."""
    gpu_name = topo.gpu_spec((prefill_plan or decode_plan).gpus[0]).name
    calib, note = _load_calibration(sc, gpu_name)
    dcalib, dgpu = calib, gpu_name
    if prefill_plan is not None and decode_plan is not None:
        dgpu = topo.gpu_spec(decode_plan.gpus[0]).name
        if dgpu != gpu_name:  # prefill and decode on different GPU models: each role its own calibration
            dcalib, dnote = _load_calibration(sc, dgpu)
            note = f"prefill {note}; decode {dnote}"
    cm = ScenarioCostModel(model=model, topo=topo, prefill_plan=prefill_plan, decode_plan=decode_plan, calib=calib,
                           decode_calib=dcalib, draft={**draft_cost_kw(sc), **expert_load_kw(sc, model)})
    # the engine calibration describes this repository's engine: only for a run priced as the rackbed stack
    stack = (getattr(calib, "meta", None) or {}).get("stack") or "rackbed"
    if engine_calibration and sc.calibration != "none" and stack == "rackbed" and dgpu == gpu_name:
        from rackbed.sim.engine_calibration import EngineCalibratedCostModel, find_engine_calibration

        found = find_engine_calibration(gpu_name, model.name, mode=mode)
        if found is not None:
            path, ecal = found
            cm = EngineCalibratedCostModel(cm, ecal)
            note += (f"; engine-calibrated: step times of the rackbed torch engine for {model.name} from "
                     f"{path.name} ({ecal.n_plans.get('fit', 0)} measured plans)")
    return cm, calib, note


# ------------------------------------------------------------------------------------------------------------------
# Running


def simulate_scenario(sc: ServingScenario, *, progress: bool = False, built: Built | None = None):
    """Build and simulate; returns (Built, SimResult)."""
    from rackbed.engine.core.autoscaler import AutoscalerConfig
    from rackbed.engine.core.metrics import Slo
    from rackbed.engine.core.workload import iter_requests
    from rackbed.sim.driver import simulate

    b = built or build(sc)
    auto = None
    if sc.autoscaler is not None and sc.autoscaler.enabled:
        a = sc.autoscaler.model_dump(exclude={"enabled"})
        auto = AutoscalerConfig(**a)
    reqs = list(iter_requests(sc.workload, sc.seed))
    if not reqs:
        raise UserError(f"{sc.name}: the workload produced no requests")
    if b.prefix_cache is not None and not any(r.prefix_hash_ids for r in reqs[:10_000]):
        raise UserError("prefix_cache.enabled: the workload carries no prefix block ids (a trace with hash_ids, "
                        "e.g. mooncake)")
    faults = [f.model_dump(exclude_none=True) for f in sc.faults]
    res = simulate(b.deployment, reqs, b.cost_model, seed=sc.seed, faults=faults, autoscaler=auto,
                   until_s=sc.sim.until_s, progress=progress, slo=Slo(ttft_s=sc.slo.ttft_s, tpot_s=sc.slo.tpot_s),
                   kv_chunks=b.cost_model.kv_chunks, sample_interval_s=sc.sim.sample_interval_s,
                   decision_log=sc.sim.decision_log, policies=sc.sim.policies.build(),
                   closed_loop=sc.workload.closed_loop(), prefix_cache=b.prefix_cache)
    return b, res


def run_serving(path: Path, out: Path, *, console, seed: int | None = None, progress: bool = True,
                overrides: dict | None = None) -> dict:
    """``rackbed run`` for a serving scenario: simulate, write outputs, print the summary. ``overrides``: the
    command line's (``sim.overrides.apply_overrides`` keywords)."""
    from rackbed.sim.outputs import write_all

    sc = load_scenario(path)
    if seed is not None:
        sc = sc.model_copy(update={"seed": seed})
    if overrides:
        from rackbed.sim.overrides import apply_overrides

        sc = apply_overrides(sc, **overrides)
    try:
        b = build(sc)
    except ValueError as exc:       # name the file (or the flags): the messages name the field and the rule
        msg = str(exc)
        where = f"{path} with {_flags(overrides)}" if overrides else str(path)
        raise UserError(msg if msg.startswith(str(path)) else f"{where}: {msg}") from None
    b, res = simulate_scenario(sc, progress=progress, built=b)
    from rackbed.sim.energy import energy_report

    res.metrics["energy"] = energy_report(b, res, sc.energy.prices())
    out.mkdir(parents=True, exist_ok=True)
    files = write_all(res, out)
    print_summary(console, b, res)
    console.print(f"[dim]wrote {', '.join(str(f) for f in files)}[/dim]" if files else f"wrote {out}")
    return res.metrics


def _flags(overrides: dict) -> str:
    return " ".join(f"--{k.removesuffix('_s')} {v}" for k, v in overrides.items())


def gpus_in_use(dep, n_topology: int) -> str:
    """The summary's line of the GPUs a deployment holds at the start: its prefillers and decoders, or its
    aggregated workers (a deployment has one or the other)."""
    if dep.aggregated:
        ag = sum(len(g.gpus) for g in dep.aggregated)
        shapes = sorted({(g.template.tp, g.template.dp) for g in dep.aggregated})
        each = ", ".join(f"TP={tp} x DP={dp}" for tp, dp in shapes)
        parts = f"{len(dep.aggregated)} aggregated worker(s) ({ag} GPUs, {each} each)"
        used = ag
    else:
        pg = sum(len(g.gpus) for g in dep.prefillers)
        dg = sum(len(g.gpus) for g in dep.decoders)
        parts = f"{len(dep.prefillers)} prefiller(s) ({pg} GPUs), {len(dep.decoders)} decoder(s) ({dg} GPUs)"
        used = pg + dg
    return f"GPUs in use: {used} of {n_topology} — {parts}; per-GPU rates below divide by the GPUs in use"


def print_summary(console, b: Built, res) -> None:
    from rich.table import Table

    m = res.metrics
    sc = b.scenario
    a = sc.aggregated or AggregatedSection()
    shape = (f"{a.workers} aggregated workers TP={a.tp}/DP={a.dp}/EP={a.ep} (budget {a.max_batch_tokens} tokens, "
             f"chunks {a.chunk_tokens})" if sc.deployment == "aggregated" else
             f"prefill TP={sc.prefill.tp}/EP={sc.prefill.ep}, decode DP-EP={sc.decode.ep}")
    console.print(f"[bold]{sc.name}[/bold] — {sc.model} ({sc.weight_format}) on {sc.topology}: {shape}, "
                  f"{mtp_label(sc.mtp)}")
    console.print(gpus_in_use(b.deployment, b.topology.n_gpus))
    console.print(f"[dim]{b.calibration_note}[/dim]")
    for c in b.caveats:
        console.print(f"[yellow]caveat:[/yellow] {c}")
    t = Table(title="latency (done requests)")
    t.add_column("metric")
    for q in ("p50", "p90", "p99"):
        t.add_column(q, justify="right")
    lat, qs = m.get("latency_s", {}), m.get("queueing_s", {})
    for d, label, scale, unit in ((lat.get("ttft"), "TTFT", 1.0, "s"), (lat.get("tpot"), "TPOT", 1e3, "ms"),
                                  (lat.get("itl"), "decode step (ITL)", 1e3, "ms"),
                                  (lat.get("e2e"), "end-to-end", 1.0, "s"),
                                  (qs.get("prefill_queue"), "prefill queue", 1.0, "s"),
                                  (qs.get("kv_transfer"), "KV transfer", 1e3, "ms"),
                                  (qs.get("decode_queue"), "decode queue", 1e3, "ms")):
        if not d or not d.get("n"):
            continue
        t.add_row(f"{label} ({unit})", *(_num((d.get(q) or 0) * scale) for q in ("p50", "p90", "p99")))
    console.print(t)
    r, th, gp, ut = m.get("requests", {}), m.get("throughput", {}), m.get("goodput", {}), m.get("utilisation", {})
    t2 = Table(title="throughput and goodput")
    t2.add_column("metric")
    t2.add_column("value", justify="right")
    rows = [
        ("requests done / total", f"{r.get('done')} / {r.get('total')}"),
        ("rejected (by reason)", f"{r.get('rejected')} {r.get('rejected_by_reason') or ''}"),
        ("requeued after a failure", r.get("requeued")),
        ("simulated duration (s)", _num(th.get("duration_s"))),
        ("mean GPUs in use", _num(th.get("mean_gpus"))),
        ("output tokens/s", _num(th.get("output_tokens_per_s"))),
        ("output tokens/s per GPU", _num(th.get("output_tokens_per_s_per_gpu"))),
        ("output tokens/s per decode GPU", _num(th.get("output_tokens_per_s_per_decode_gpu"))),
        ("input tokens/s per prefill GPU", _num(th.get("input_tokens_per_s_per_prefill_gpu"))),
        ("tokens/s per user (p50)", _num((th.get("tokens_per_s_per_user") or {}).get("p50"))),
        ("utilisation prefill / decode", f"{_num(ut.get('prefill'))} / {_num(ut.get('decode'))}"),
        *((("utilisation aggregated", _num(ut["aggregated"])),) if "aggregated" in ut else ()),
        (f"goodput (TTFT<={gp.get('slo_ttft_s')} s, TPOT<={gp.get('slo_tpot_s')} s)",
         f"{_num(gp.get('fraction'))} of requests, {_num(gp.get('tokens_per_s'))} tok/s"),
    ]
    pc = m.get("prefix_cache")
    if pc:
        tiers = ", ".join(f"{k} {_num(v)}" for k, v in pc["hit_rate_by_tier"].items())
        rows += [("prefix cache hit rate (prompt tokens)", f"{_num(pc['hit_rate_tokens'])} ({tiers})"),
                 ("prefill tokens saved", pc["prefill_tokens_saved"]),
                 ("waits for lower-tier copies (s)", _num(pc["load_wait_s"]))]
    for k, v in rows:
        t2.add_row(k, str(v))
    console.print(t2)
    if "energy" in m:
        from rackbed.sim.energy import summary_line

        console.print(summary_line(m["energy"]))
    if sc.claim:
        console.print(f"[bold]write-up:[/bold] {sc.claim}")


def mtp_label(m: MtpSection) -> str:
    """``MTP k=1 p=0.8`` (plus the curve and the draft when given) for summaries."""
    out = f"MTP k={m.draft_k} p={m.accept_p}"
    if m.draft_k and m.acceptance is not None:
        out += f" acceptance={list(m.acceptance[:m.draft_k])}"
    if m.draft_k and isinstance(m.draft, ModelDraft):
        out += f" draft model {m.draft.model}"
    return out


def _num(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.4g}"
    return str(x)
