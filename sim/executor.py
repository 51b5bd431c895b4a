"""The simulated executor: turns each plan into a duration, from the cost models and the network.

``CostModel`` is what ``sim/costs`` provides (pure functions returning breakdowns):

- ``prefill(plan: PrefillBatch, group: PrefillerGroup) -> StepTime``
- ``decode(plan: DecodeStep, group: DecoderGroup) -> StepTime`` (the slowest rank sets a synchronous step:
  ``plan.rank_batch`` / ``plan.rank_context_tokens`` carry every rank's load)
- ``mixed(plan: MixedStep, group: AggregatedGroup) -> StepTime``: an aggregated worker's step (decode batches and
  prefill chunks in one forward); needed only for deployments with aggregated workers
- optional ``decode_point(group, max_batch, max_context_tokens, draft_k) -> (StepTime, ctx_hi)``: for a cost model
  whose decode step depends on the plan only through ``max(rank_batch)``, ``max(rank_context_tokens)`` and
  ``draft_k`` — the same StepTime as ``decode`` for any such plan, and the same for every ``max_context_tokens``
  up to ``ctx_hi``; with it the driver fast-forwards decode steps (``sim/driver.py``). It must be defined on the
  cost model's class: a wrapper that changes ``decode`` defines its own (one delegating through ``__getattr__``
  is not used)
- ``kv_transfer(plan: KvTransfer) -> TransferCost``: the fixed part (per-chunk overhead × ``plan.n_chunks``,
  path latency); the bytes go through :class:`sim.network.Network`, which adds NIC bandwidth and contention.
- optional ``kv_fixed_s(plan: KvTransfer) -> float``: ``overhead_s + latency_s`` of ``kv_transfer(plan)`` without
  building the TransferCost (one per KV transfer is measurable in a long run); like ``decode_point`` it is used
  only when defined on the cost model's class

The executor also sums each role's :class:`~sim.costs.steptime.StepTime` fields, so a run can be explained term
by term (``Executor.breakdown_s``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, Protocol

from rackbed.engine.core.deployment import DecoderGroup, PrefillerGroup
from rackbed.engine.core.plans import DecodeStep, KvTransfer, MixedStep, Plan, PrefillBatch
from rackbed.sim.costs.steptime import StepTime
from rackbed.sim.network import Network

_FIELDS = ("attn_s", "moe_gemm_s", "a2a_s", "allreduce_s", "other_s")


class TransferCost(NamedTuple):
    """Fixed costs of one KV transfer (seconds); bandwidth time is the network's business.

    overhead_s: per-chunk posting/completion overhead not hidden by pipelining (chunks × per-chunk cost).
    latency_s:  one path latency (NIC → switches → NIC).
    n_bytes:    bytes moved (for reporting; the flows of the plan carry the split per NIC).

    A NamedTuple (immutable, built ~5x faster than a frozen dataclass): one per KV transfer.
    """

    overhead_s: float
    latency_s: float
    n_bytes: int

    @property
    def fixed_s(self) -> float:
        return self.overhead_s + self.latency_s


class CostModel(Protocol):
    def prefill(self, plan: PrefillBatch, group: PrefillerGroup) -> StepTime: ...

    def decode(self, plan: DecodeStep, group: DecoderGroup) -> StepTime: ...

    def kv_transfer(self, plan: KvTransfer) -> TransferCost: ...


class Executor:
    """``duration(plan, now_s) -> seconds`` for PrefillBatch / DecodeStep / KvTransfer plans."""

    def __init__(self, cost_model: CostModel, network: Network,
                 group_of: Callable[[str], PrefillerGroup | DecoderGroup | None]) -> None:
        self.cm = cost_model
        self.net = network
        self._group_of = group_of
        self._groups: dict[str, object] = {}
        self.breakdown_s = {"prefill": [0.0] * 5, "decode": [0.0] * 5}  # "aggregated" too once a MixedStep ran
        self.kv_fixed_s = 0.0
        # defined on the class, not reached through a wrapper's __getattr__ (which may change kv_transfer)
        self._kv_fixed = cost_model.kv_fixed_s if hasattr(type(cost_model), "kv_fixed_s") else None
        self._reserve = network.reserve
        #: ``(loads, group) -> seconds`` a batch waits for its prefix-cache copies (None: no cache in the run)
        self.load_s = None
        self.load_total_s = 0.0

    def _group(self, worker: str):
        g = self._groups.get(worker)
        if g is None:
            g = self._groups[worker] = self._group_of(worker)
        return g

    def _acc(self, role: str, st: StepTime) -> float:
        b = self.breakdown_s[role]
        b[0] += st.attn_s
        b[1] += st.moe_gemm_s
        b[2] += st.a2a_s
        b[3] += st.allreduce_s
        b[4] += st.other_s
        return st.total_s

    def acc_decode(self, st: StepTime) -> None:
        """Account a decode step priced outside :meth:`duration` (the driver's fast-forward of plain steps)."""
        b = self.breakdown_s["decode"]
        b[0] += st.attn_s
        b[1] += st.moe_gemm_s
        b[2] += st.a2a_s
        b[3] += st.allreduce_s
        b[4] += st.other_s

    def duration(self, plan: Plan, now_s: float) -> float:
        tp = type(plan)
        if tp is KvTransfer:  # the most frequent plan the driver asks about (decode steps are mostly fast-forwarded)
            kf = self._kv_fixed
            if kf is not None:
                fixed = kf(plan)
            else:
                tc = self.cm.kv_transfer(plan)
                fixed = tc.overhead_s + tc.latency_s  # tc.fixed_s
            end = self._reserve(now_s, plan.flows)
            self.kv_fixed_s += fixed
            return end - now_s + fixed
        if tp is DecodeStep:
            g = self._groups.get(plan.worker) or self._group(plan.worker)
            return self._acc("decode", self.cm.decode(plan, g))
        if tp is PrefillBatch:
            g = self._group(plan.worker)
            t = self._acc("prefill", self.cm.prefill(plan, g))
            return t + self._load(plan, g) if plan.loads else t
        if tp is MixedStep:
            self.breakdown_s.setdefault("aggregated", [0.0] * 5)
            g = self._group(plan.worker)
            t = self._acc("aggregated", self.cm.mixed(plan, g))
            return t + self._load(plan, g) if plan.loads else t
        raise TypeError(f"executor cannot run {tp.__name__}")

    def _load(self, plan, group) -> float:
        """Prefix-cache copies into HBM the step waits for before it computes (``plan.loads``)."""
        t = self.load_s(plan.loads, group) if self.load_s is not None else 0.0
        self.load_total_s += t
        return t

    def breakdown(self) -> dict[str, dict[str, float]]:
        """Seconds per StepTime field summed over all steps of each role."""
        return {role: dict(zip(_FIELDS, vals)) for role, vals in self.breakdown_s.items()}
