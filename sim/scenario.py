"""Serving scenarios: the YAML schema, building a deployment from it, and running it.

A serving scenario names a topology, a model, the prefill and decode parallelism and replica counts, the workload,
SLOs, MTP, the autoscaler and faults. ``load_scenario`` validates it (one-line errors naming the file and field);
``build`` turns it into what the SimPy driver needs (a placed ``Deployment``, validated ``ParallelPlan``s whose
memory budgets set the KV capacities, a cost model over ``sim.costs``); ``run_serving`` simulates and writes
metrics (JSON, CSV), plots and a Perfetto trace, and prints a summary table.

The decode cost is evaluated at the slowest rank's (batch, context tokens) — a DP-EP step is synchronous, so the
slowest rank sets its time — memoised at 1-sequence and ~1 % context resolution, which makes the hot loop a dict
lookup; the prefill cost is evaluated exactly per batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from math import ceil as _ceil
from operator import itemgetter
from pathlib import Path
from typing import Literal

from pydantic import ConfigDict, Field, ValidationError, field_validator
from rackbed.engine.core.workload import WorkloadSpec
from rackbed.sim.aggregated import AggregatedSection, check_aggregated
from rackbed.topology.errors import NoBoolNumbers, UserError, from_validation


class _Strict(NoBoolNumbers):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PrefillSection(_Strict):
    """Prefiller groups: ``tp`` x ``ep`` GPUs in one node (TP attention + EP experts on the same GPUs)."""

    tp: int = Field(4, ge=1)
    ep: int = Field(4, ge=1)
    replicas: int = Field(1, ge=0)
    max_batch_tokens: int = Field(16384, ge=1)
    kv_streams: int = Field(2, ge=1)
    max_queue_requests: int | None = Field(None, ge=1)
    kv_replication: int | None = Field(None, ge=1)


class DecodeSection(_Strict):
    """Decoder groups: DP-EP over ``ep`` GPUs of one NVLink domain, one DP rank per GPU."""

    ep: int = Field(16, ge=1)
    replicas: int = Field(1, ge=0)
    max_batch_per_rank: int = Field(64, ge=1)
    page_tokens: int = Field(64, ge=1)


class MtpSection(_Strict):
    draft_k: int = Field(1, ge=0, le=16)
    accept_p: float = Field(0.8, ge=0.0, le=1.0)


class SloSection(_Strict):
    ttft_s: float | None = Field(None, gt=0)
    tpot_s: float | None = Field(None, gt=0)


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
    """A GPU (``gpu:12``), a node (``node:3``) or a NIC/link (``nic:5``) goes down at ``at_s``."""

    at_s: float = Field(ge=0)
    target: str
    duration_s: float | None = Field(None, gt=0)


class PoliciesSection(_Strict):
    """The scheduler's policies by name (``engine.core.policies``: PREFILLER_ROUTING, DECODER_RANK, ADMISSION)."""

    prefiller: str = "least_queued_tokens"
    rank: str = "fewest_requests"
    admission: str = "fifo"
    worker: str = "least_requests"  # aggregated workers

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
        from rackbed.engine.core.policies import Policies

        return Policies.named(self.prefiller, self.rank, self.admission, self.worker)


class SimSection(_Strict):
    until_s: float | None = Field(None, gt=0)
    sample_interval_s: float | None = Field(None, gt=0)
    decision_log: bool = True
    chunked_prefill: bool = False
    shed_ttft_s: float | None = Field(None, gt=0)
    policies: PoliciesSection = PoliciesSection()


class KillSection(_Strict):
    """Real mode failure drill: kill the rank process of ``gpu`` at clock time ``at_s``."""

    at_s: float = Field(ge=0)
    gpu: int = Field(ge=0)


class RealSection(_Strict):
    """How ``rackbed real`` runs this scenario on local devices (ignored by the simulator).

    weights: a Hugging Face checkpoint directory (config.json + *.safetensors) or null for seeded random weights
    with the model's real shapes. Pages are per rank, of ``decode.page_tokens`` tokens.
    """

    device: Literal["auto", "cpu", "cuda"] = "auto"
    dtype: Literal["bf16", "fp32"] = "bf16"
    weights: str | None = None
    weights_seed: int = 0
    prefill_pages: int = Field(4096, ge=1)
    decode_pages: int = Field(4096, ge=1)
    kill: tuple[KillSection, ...] = ()


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
    prefill: PrefillSection = PrefillSection()
    decode: DecodeSection = DecodeSection()
    mtp: MtpSection = MtpSection()
    workload: WorkloadSpec
    slo: SloSection = SloSection()
    autoscaler: AutoscalerSection | None = None
    faults: tuple[FaultSection, ...] = ()
    sim: SimSection = SimSection()
    real: RealSection = RealSection()

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
    check_aggregated(sc, source)
    return sc


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
    return model.model_validate({**model.model_dump(), **upd})


def build(sc: ServingScenario, *, engine_calibration: bool = True) -> Built:
    """Validate the scenario against the hardware and the model, and lay out the deployment."""
    from rackbed.engine.core.deployment import DecoderTemplate, MtpSpec, PrefillerTemplate, place
    from rackbed.sim.scenario_checks import budget_caveat, check_disaggregated, check_run_size

    from rackbed import topology as topo_mod

    check_run_size(sc)
    topo = topo_mod.load(sc.topology)
    model = scenario_model(sc)
    if sc.deployment == "aggregated":
        from rackbed.sim.aggregated import build_aggregated

        return build_aggregated(sc, topo, model, _KvPathView(topo))
    p, d = sc.prefill, sc.decode
    n_p, n_d = p.replicas, d.replicas
    if sc.autoscaler is not None and sc.autoscaler.enabled:
        n_p, n_d = max(n_p, sc.autoscaler.min_prefillers), max(n_d, sc.autoscaler.min_decoders)
    if n_p + n_d == 0:
        raise UserError("prefill.replicas + decode.replicas: at least one group is needed")
    check_disaggregated(sc, n_p, n_d)
    kv_elem = 2 if sc.kv_dtype == "bf16" else 1
    # First a placement with default capacities, to learn which GPUs group 0 of each role gets.
    ptpl0 = PrefillerTemplate(tp=p.tp, ep=p.ep, max_batch_tokens=p.max_batch_tokens, kv_streams=p.kv_streams,
                              max_queue_requests=p.max_queue_requests)
    dtpl0 = DecoderTemplate(ep=d.ep, max_batch_per_rank=d.max_batch_per_rank, kv_page_tokens=d.page_tokens)
    kv_view = _KvPathView(topo)
    dep0 = place(kv_view, n_prefillers=max(n_p, 1), n_decoders=max(n_d, 1),
                 kv_bytes_per_token=model.kv_bytes_per_token(kv_elem), prefiller=ptpl0, decoder=dtpl0,
                 spare="none", name=sc.name)
    pg, dg = dep0.prefillers[0], dep0.decoders[0]
    pplan = prefill_plan_for(sc, model, pg.gpus)
    dplan = decode_plan_for(sc, model, dg.gpus)
    pbud = pplan.validate(model, topo)
    dbud = dplan.validate(model, topo)
    ptpl = PrefillerTemplate(tp=p.tp, ep=p.ep, max_batch_tokens=p.max_batch_tokens,
                             kv_capacity_tokens=max(p.max_batch_tokens, pbud.kv_capacity_tokens),
                             max_queue_requests=p.max_queue_requests, kv_streams=p.kv_streams)
    dtpl = DecoderTemplate(ep=d.ep, max_batch_per_rank=d.max_batch_per_rank,
                           kv_capacity_tokens_per_rank=max(1, dbud.kv_capacity_tokens), kv_page_tokens=d.page_tokens)
    dep = place(kv_view, n_prefillers=n_p, n_decoders=n_d, kv_bytes_per_token=model.kv_bytes_per_token(kv_elem),
                prefiller=ptpl, decoder=dtpl, mtp=MtpSpec(draft_k=sc.mtp.draft_k, accept_p=sc.mtp.accept_p),
                chunked_prefill=sc.sim.chunked_prefill, shed_ttft_s=sc.sim.shed_ttft_s,
                spare="rest" if (sc.autoscaler is not None and sc.autoscaler.enabled) else "none", name=sc.name)
    cm, calib, note = cost_model_for(sc, model, topo, pplan, dplan, engine_calibration=engine_calibration)
    from rackbed.sim.coverage import calibration_caveats

    caveats = calibration_caveats(calib, topo, model, pplan, dplan) + budget_caveat(sc)
    return Built(sc, topo, model, dep, pplan, dplan, pbud, dbud, cm, calib, note, caveats)


def scenario_model(sc: ServingScenario):
    """The scenario's model (its first ``model_layers`` layers when given)."""
    from rackbed.engine.core.model import get_model

    model = get_model(sc.model)
    return model if sc.model_layers is None else truncate_model(model, sc.model_layers)


def prefill_plan_for(sc: ServingScenario, model, gpus):
    """The ParallelPlan of a prefiller group of the scenario on ``gpus`` (what ``build`` gives group 0)."""
    from rackbed.engine.core.sharding import ParallelPlan

    p = sc.prefill
    kv_rep = p.kv_replication or model.mixer("full").kv_replication(p.tp)
    return ParallelPlan(role="prefill", tp=p.tp, ep=p.ep, dp=max(1, max(p.tp, p.ep) // p.tp), kv_replication=kv_rep,
                        gpus=tuple(gpus), weight_format=sc.weight_format, kv_dtype=sc.kv_dtype,
                        page_tokens=sc.decode.page_tokens, max_batch_tokens=p.max_batch_tokens)


def decode_plan_for(sc: ServingScenario, model, gpus):
    """The ParallelPlan of a decoder group of the scenario on ``gpus`` (what ``build`` gives group 0)."""
    from rackbed.engine.core.sharding import ParallelPlan

    d = sc.decode
    return ParallelPlan(role="decode", tp=1, ep=d.ep, dp=d.ep, gpus=tuple(gpus), weight_format=sc.weight_format,
                        kv_dtype=sc.kv_dtype, page_tokens=d.page_tokens, max_batch_seqs=d.max_batch_per_rank)


def cost_model_for(sc: ServingScenario, model, topo, prefill_plan, decode_plan, *, engine_calibration: bool = True):
    """``(cost model, calibration table or None, note)``: the cost model ``build`` gives the simulator for a
    deployment whose group 0 of each role has these plans — the calibration the scenario selects for the GPU
    (:func:`_load_calibration`), wrapped in the engine calibration when one matches the GPU and the model. One of
    the plans may be None (a caller that prices one role only); the GPU is the prefill plan's, else the decode
    plan's. ``rackbed search`` prices its options through this too, so its analytic stage and its simulations
    share one cost model."""
    gpu_name = topo.gpu_spec((prefill_plan or decode_plan).gpus[0]).name
    calib, note = _load_calibration(sc, gpu_name)
    cm = ScenarioCostModel(model=model, topo=topo, prefill_plan=prefill_plan, decode_plan=decode_plan, calib=calib)
    # the engine calibration describes this repository's engine: only for a run priced as the rackbed stack
    stack = (getattr(calib, "meta", None) or {}).get("stack") or "rackbed"
    if engine_calibration and sc.calibration != "none" and stack == "rackbed":
        from rackbed.sim.engine_calibration import EngineCalibratedCostModel, find_engine_calibration

        found = find_engine_calibration(gpu_name, model.name)
        if found is not None:
            path, ecal = found
            cm = EngineCalibratedCostModel(cm, ecal)
            note += (f"; engine-calibrated: step times of the rackbed torch engine for {model.name} from "
                     f"{path.name} ({ecal.n_plans.get('fit', 0)} measured plans)")
    return cm, calib, note


# ------------------------------------------------------------------------------------------------------------------
# The cost model the SimPy executor calls


_N_START = itemgetter(2, 1)  # PrefillBatch item (request_id, start_token, n_tokens) -> (n_tokens, start_token)


class ScenarioCostModel:
    """``sim.executor.CostModel`` over ``sim.costs``: per-group ParallelPlans (same shape as the templates, the
    group's own GPUs), decode memoised at the slowest rank's (batch, context) point (module docstring).

    Fast paths, all giving ``sim.costs``' own numbers: decode is memoised per (group, busiest rank's batch, context
    bucket of ``CTX_BITS`` significant bits, draft_k) and priced at the bucket's middle; ``decode_point`` also
    returns the bucket's end, so the driver fast-forwards decode steps (``sim/driver.py``). A memo miss assembles
    the step from its context-free terms (per group, batch, draft_k) and two attention evaluations (checked
    against ``decode_step_time``). Prefill is exact per batch, memoised on its (tokens, start) items per group
    class: groups whose GPU model and :class:`~sim.costs.collective.GroupLinks` (EP group, TP group) agree share
    entries, the first ``PREFILL_SPOT_CHECKS`` shared hits of each group are checked, and a mismatch gives the
    group its own class. A looped trace repeats its batches, so an hour of the NVL72 benchmark evaluates a few
    thousand prefill batches instead of ~50 000.
    """

    from rackbed.sim.executor import TransferCost as _TransferCost

    CTX_BITS = 7  # decode memo resolution: contexts that agree in their top 7 bits share a step (<= 1.6 % apart)

    def __init__(self, *, model, topo, prefill_plan, decode_plan, calib=None) -> None:
        self.model, self.topo, self.calib = model, topo, calib
        self.pplan0, self.dplan0 = prefill_plan, decode_plan
        self._plans: dict[str, object] = {}
        self._decode_memo: dict[tuple, object] = {}
        self._decode_base: dict[tuple, tuple] = {}
        self._attn_memo: dict[tuple, object] = {}
        self._prefill_memo: dict[tuple, tuple] = {}
        self._pclass: dict[str, tuple] = {}
        self._pclass_ids: dict[tuple, tuple[int]] = {}
        self._kv_chunk_us: dict[str | None, float] = {}
        self._kv_pipeline = 1
        self._lat_memo: dict[tuple, float] = {}
        self._pchecks: dict[str, int] = {}
        self._split_ok = True  # False once the split failed its check (then: direct evaluation)
        self._chunk_memo: dict[tuple, float] = {}
        self._chunk_last = None  # (prefiller template, decoder template, chunks per page) of the last kv_chunks

    def _plan_for(self, group) -> object:
        pl = self._plans.get(group.id)
        if pl is None:
            base = self.pplan0 if group.id.startswith("P") else self.dplan0
            pl = self._plans[group.id] = base.model_copy(update={"gpus": tuple(group.gpus)})
        return pl

    def prefill(self, plan, group):
        """Exact per batch, memoised on the batch's ``(n_tokens, start_token)`` sequence per group class (groups
        whose GPU groups look the same to ``sim.costs`` share entries: looped traces repeat batches)."""
        cls = self._pclass.get(group.id)
        if cls is None:
            cls = self._pclass[group.id] = self._prefill_class(group)
        key = (cls, tuple(map(_N_START, plan.items)))  # ((n_tokens, start_token), ...), C-level: one per batch
        hit = self._prefill_memo.get(key)
        if hit is not None:
            owner, st = hit
            if owner == group.id or self._pchecks.get(group.id, 0) >= self.PREFILL_SPOT_CHECKS:
                return st
            # the first few entries a group takes from another group of its class are checked
            self._pchecks[group.id] = self._pchecks.get(group.id, 0) + 1
            mine = self._prefill_direct(plan, group)
            if mine != st:
                self._pclass[group.id] = (group.id,)  # not like the others after all: own class from now on
                self._prefill_memo[((group.id,), key[1])] = (group.id, mine)
            return mine
        st = self._prefill_direct(plan, group)
        self._prefill_memo[key] = (group.id, st)
        return st

    PREFILL_SPOT_CHECKS = 2

    def _prefill_direct(self, plan, group):
        return self.prefill_breakdown([(n, start) for _, start, n in plan.items], group).to_steptime()

    def prefill_breakdown(self, seqs, group=None):
        """Term by term (a ``StepBreakdown``), the prefill step :meth:`prefill` prices for a batch of ``seqs``
        ``(new_tokens, cached_tokens)`` on ``group`` (None: the template plan, group 0's)."""
        from rackbed.sim.costs.step import prefill_step_breakdown

        pl = self.pplan0 if group is None else self._plan_for(group)
        return prefill_step_breakdown(self.model, pl, self.topo, seqs, calib=self.calib)

    def decode_breakdown(self, max_batch: int, max_context_tokens: float, draft_k: int, group=None):
        """Term by term, the decode step :meth:`decode_point` prices when the busiest ranks hold ``max_batch``
        sequences and ``max_context_tokens`` KV tokens (every rank priced so, as there), at the context itself
        rather than its memo bucket's middle; ``group`` None: the template plan."""
        from rackbed.sim.costs.step import decode_step_breakdown

        pl = self.dplan0 if group is None else self._plan_for(group)
        n = pl.world
        return decode_step_breakdown(self.model, pl, self.topo, [max_batch] * n, [max_context_tokens] * n,
                                     draft_k=draft_k, calib=self.calib)

    def _prefill_class(self, group) -> tuple[int] | tuple[str]:
        """What ``sim.costs.step.prefill_step_breakdown`` reads of the topology for this group's plan: the GPU
        model and the :class:`~sim.costs.collective.GroupLinks` of its EP group and of its first TP group."""
        from rackbed.sim.costs.collective import group_links

        pl = self._plan_for(group)
        fp = (self.topo.gpu_spec(pl.gpus[0]).name, group_links(self.topo, pl.gpus),
              group_links(self.topo, pl.tp_group(0)))
        return self._pclass_ids.setdefault(fp, (len(self._pclass_ids),))  # a small key, cheap to hash

    def mixed(self, plan, group):
        """An aggregated worker's :class:`~engine.core.plans.MixedStep` (:func:`sim.aggregated.price_mixed`)."""
        from rackbed.sim.aggregated import price_mixed

        return price_mixed(self, plan, group)

    def decode(self, plan, group):
        return self.decode_point(group, max(plan.rank_batch), max(plan.rank_context_tokens), plan.draft_k)[0]

    def decode_point(self, group, max_batch: int, max_context_tokens, draft_k: int):
        """``(StepTime, ctx_hi)`` of a decode step whose busiest ranks hold ``max_batch`` sequences and
        ``max_context_tokens`` KV tokens: the step at the middle of the context's grid bucket (the top
        ``CTX_BITS`` bits of the token count, so buckets are 1/2**(CTX_BITS-1)..1/2**CTX_BITS of the count wide;
        exact below 2**CTX_BITS tokens), the same for every context up to ``ctx_hi``, the bucket's end."""
        ctx = int(max_context_tokens)
        if max_batch <= 0:
            ctx, hi, mid = 0, 1 << 62, 0
        else:
            shift = ctx.bit_length() - self.CTX_BITS
            if shift > 0:
                ctx = (ctx >> shift) << shift
                hi = ctx + (1 << shift) - 1
                mid = ctx + (1 << (shift - 1))
            else:
                hi = mid = ctx
        key = (group.id, max_batch, ctx, draft_k)
        hit = self._decode_memo.get(key)
        if hit is None:
            hit = self._decode_memo[key] = (self._decode_at(group, max_batch, mid, draft_k), hi)
        return hit

    # The decode step at a memo point, split into what depends on the context (the full-attention terms of the
    # verify and draft passes) and what does not (everything else, memoised per (group, batch, draft_k)): a miss
    # then costs two attention evaluations instead of a whole step breakdown. The split is exact — the StepTime is
    # summed term by term in ``StepBreakdown.by_category`` order — and checked against the direct
    # ``decode_step_time`` at a second context for every (group, batch, draft_k); should ``sim.costs.step`` ever
    # change shape, the check fails and the model falls back to direct evaluation (same numbers, slower).

    def _decode_at(self, group, b: int, ctx_q: int, k: int):
        from rackbed.sim.costs.step import decode_step_time

        pl = self._plan_for(group)
        n = pl.world
        if not self._split_ok or b == 0:
            return decode_step_time(self.model, pl, self.topo, [b] * n, [ctx_q] * n, draft_k=k, calib=self.calib)
        base = self._decode_base.get((group.id, b, k))
        if base is None:
            from rackbed.sim.costs.step import decode_step_breakdown, layer_counts

            bd = decode_step_breakdown(self.model, pl, self.topo, [b] * n, [ctx_q] * n, draft_k=k,
                                       calib=self.calib)
            passes = k * (self.model.n_mtp_layers or 1)
            base = (tuple(bd.terms.items()), layer_counts(self.model)[0], passes, self.topo.gpu_spec(pl.gpus[0]))
            # the split must reproduce the direct evaluation at another context too
            ctx2 = 2 * ctx_q + 4099
            if self._assemble(base, pl, b, ctx2, k) != decode_step_time(
                    self.model, pl, self.topo, [b] * n, [ctx2] * n, draft_k=k, calib=self.calib):
                self._split_ok = False
            else:
                self._decode_base[(group.id, b, k)] = base
            return bd.to_steptime()
        return self._assemble(base, pl, b, ctx_q, k)

    def _assemble(self, base, pl, b: int, ctx_q: int, k: int):
        from rackbed.sim.costs.steptime import StepTime

        terms, nf, passes, gpu = base
        kw = {"fmt": pl.weight_format, "kv_elem_bytes": pl.kv_elem_bytes, "page_tokens": pl.page_tokens,
              "calib": self.calib}
        over = {}
        if nf:
            a = self._attn(gpu, b, ctx_q, k + 1, kw)
            over["attn_proj"] = nf * a.proj_s
            over["attn_core"] = nf * a.core_s
        if k:
            over["mtp_attn"] = passes * self._attn(gpu, b, ctx_q, 1, kw).total_s
        cats = {"attn_s": 0.0, "moe_gemm_s": 0.0, "a2a_s": 0.0, "allreduce_s": 0.0, "other_s": 0.0}
        for name, (cat, s) in terms:
            cats[cat] += over.get(name, s)
        return StepTime(**cats)

    def _attn(self, gpu, b: int, ctx_q: int, q: int, kw: dict):
        from rackbed.sim.costs.attention import full_attention_decode_totals

        key = (gpu.name, kw["fmt"], kw["kv_elem_bytes"], kw["page_tokens"], b, ctx_q, q)
        a = self._attn_memo.get(key)
        if a is None:
            a = self._attn_memo[key] = full_attention_decode_totals(gpu, self.model, b, ctx_q, q_per_seq=q, **kw)
        return a

    def kv_transfer(self, plan):
        nic = plan.flows[0][0] if plan.flows else None
        per_chunk_us = self._kv_chunk_us.get(nic)
        if per_chunk_us is None:
            from rackbed.sim.costs import constants as C

            kind = "ib" if nic is None or nic.startswith("nvlink:") else self.topo.nic_spec(nic).kind
            per_chunk_us = self._kv_chunk_us[nic] = C.KV_CHUNK_OVERHEAD_US[kind]
            self._kv_pipeline = C.KV_CHUNK_PIPELINE
        over = plan.n_chunks * per_chunk_us * 1e-6 / self._kv_pipeline
        key = (plan.src, plan.dst, plan.dst_rank)
        lat = self._lat_memo.get(key)
        if lat is None:
            lat = self._lat_memo[key] = self._latency_s(plan)
        return self._TransferCost(overhead_s=over, latency_s=lat, n_bytes=plan.n_bytes)

    def kv_fixed_s(self, plan) -> float:
        """``overhead_s + latency_s`` of :meth:`kv_transfer` (same arithmetic), without the TransferCost."""
        nic = plan.flows[0][0] if plan.flows else None
        per_chunk_us = self._kv_chunk_us.get(nic)
        if per_chunk_us is None:
            return self.kv_transfer(plan).fixed_s  # fills the per-NIC memo
        lat = self._lat_memo.get((plan.src, plan.dst, plan.dst_rank))
        if lat is None:
            return self.kv_transfer(plan).fixed_s
        return plan.n_chunks * per_chunk_us * 1e-6 / self._kv_pipeline + lat

    def _latency_s(self, plan) -> float:
        key = ("lat", plan.src, plan.dst, plan.dst_rank)
        v = self._chunk_memo.get(key)
        if v is None:
            src = self._plans.get(plan.src)
            dst = self._plans.get(plan.dst)
            if src is None or dst is None:
                v = 5e-6
            else:
                a, b = src.gpus[0], dst.gpus[plan.dst_rank]
                try:
                    v = self.topo.p2p_latency_us(a, b, via="net") * 1e-6
                except ValueError:  # no scale-out network (lab box): NVLink peer copy
                    v = self.topo.p2p_latency_us(a, b) * 1e-6
            self._chunk_memo[key] = v
        return v

    def kv_chunks(self, prefiller, decoder, tokens: int) -> int:
        """Chunks of the resharding plan (prefill TP layout -> one DP decode rank, HND, fragmented pages)."""
        pt, dt = prefiller.template, decoder.template
        last = self._chunk_last
        if last is not None and last[0] is pt and last[1] is dt:  # the templates of the previous call
            n = _ceil(last[2] * _ceil(tokens / last[3]))  # one per KV transfer: no global / attribute look-ups
            return n if n > 1 else 1  # noqa: FURB136 (max(1, n) without the call)
        key = ("per_page", pt.tp, dt.kv_page_tokens)
        per_page = self._chunk_memo.get(key)
        if per_page is None:
            from rackbed.engine.core.kv import KvLayout, transfer_stats

            pl, dl = self.pplan0, self.dplan0
            src = KvLayout.for_plan(pl, self.model, 1)
            dst = KvLayout.for_plan(dl, self.model, 1)
            pages = 4
            st = transfer_stats(src, dst, pages * dl.page_tokens)
            per_page = self._chunk_memo[key] = st.n_chunks / pages
        self._chunk_last = (pt, dt, per_page, self.dplan0.page_tokens)  # what the key gives, for the same templates
        return max(1, math.ceil(per_page * math.ceil(tokens / self.dplan0.page_tokens)))


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
    faults = [f.model_dump(exclude_none=True) for f in sc.faults]
    res = simulate(b.deployment, reqs, b.cost_model, seed=sc.seed, faults=faults, autoscaler=auto,
                   until_s=sc.sim.until_s, progress=progress, slo=Slo(ttft_s=sc.slo.ttft_s, tpot_s=sc.slo.tpot_s),
                   kv_chunks=b.cost_model.kv_chunks, sample_interval_s=sc.sim.sample_interval_s,
                   decision_log=sc.sim.decision_log, policies=sc.sim.policies.build(),
                   closed_loop=sc.workload.closed_loop())
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
    out.mkdir(parents=True, exist_ok=True)
    files = write_all(res, out)
    print_summary(console, b, res)
    console.print(f"[dim]wrote {', '.join(str(f) for f in files)}[/dim]" if files else f"wrote {out}")
    return res.metrics


def _flags(overrides: dict) -> str:
    return " ".join(f"--{k.removesuffix('_s')} {v}" for k, v in overrides.items())


def print_summary(console, b: Built, res) -> None:
    from rich.table import Table

    m = res.metrics
    sc = b.scenario
    a = sc.aggregated or AggregatedSection()
    shape = (f"{a.workers} aggregated workers TP={a.tp}/DP={a.dp}/EP={a.ep} (budget {a.max_batch_tokens} tokens, "
             f"chunks {a.chunk_tokens})" if sc.deployment == "aggregated" else
             f"prefill TP={sc.prefill.tp}/EP={sc.prefill.ep}, decode DP-EP={sc.decode.ep}")
    console.print(f"[bold]{sc.name}[/bold] — {sc.model} ({sc.weight_format}) on {sc.topology}: {shape}, "
                  f"MTP k={sc.mtp.draft_k} p={sc.mtp.accept_p}")
    dep = b.deployment
    pg = sum(len(g.gpus) for g in dep.prefillers)
    dg = sum(len(g.gpus) for g in dep.decoders)
    console.print(f"GPUs in use: {pg + dg} of {b.topology.n_gpus} — {len(dep.prefillers)} prefiller(s) ({pg} GPUs), "
                  f"{len(dep.decoders)} decoder(s) ({dg} GPUs); per-GPU rates below divide by the GPUs in use")
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
    for k, v in rows:
        t2.add_row(k, str(v))
    console.print(t2)
    if sc.claim:
        console.print(f"[bold]write-up:[/bold] {sc.claim}")


def _num(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.4g}"
    return str(x)
