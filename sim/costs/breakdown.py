"""Term-by-term step breakdowns, and the bridge to the scheduler's ``StepTime``.

A :class:`StepBreakdown` is an ordered mapping of named terms (seconds for the whole step: per-layer terms are
already multiplied by their layer counts), each tagged with the ``StepTime`` field it rolls up into:

=================  ==========================================================================================
StepTime field     terms
=================  ==========================================================================================
``attn_s``         attention / DeltaNet projections and cores (and the MTP layer's)
``moe_gemm_s``     routed-expert grouped GEMMs, shared experts, dense MLP layers
``a2a_s``          MoE dispatch and combine except the EP-prefill combine all-reduce (local select / pack /
                   accumulate in prefill; the sparse all-to-all in decode)
``allreduce_s``    TP all-reduces after attention (and dense MLPs), the EP-prefill combine all-reduce
``other_s``        router, norms / residuals, embeddings, lm_head, MTP fc, host overheads
=================  ==========================================================================================

A step with compute / communication overlap (``sim.costs.overlap``) keeps only the *exposed* seconds in
``terms`` (they still sum to the step, its critical path), adds the compute slowdown under communication as
the term ``overlap_sm_contention`` (``other_s``), and lists the seconds of each term that ran hidden under
another stream in ``hidden`` (empty without overlap).

``StepTime`` itself belongs to the scheduler (``sim/costs/steptime.py``); :meth:`StepBreakdown.to_steptime` fills
its category fields (and ``total_s`` too, should it ever become a field rather than a property).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

CATEGORIES: tuple[str, ...] = ("attn_s", "moe_gemm_s", "a2a_s", "allreduce_s", "other_s")

from rackbed.sim.costs.steptime import StepTime  # the scheduler's frozen dataclass


@dataclass(frozen=True)
class StepBreakdown:
    """Named terms of one step: ``terms[name] = (category, seconds)``, in insertion order; ``hidden[name]``:
    seconds of that term that ran under another stream, not in ``terms`` (module docstring)."""

    terms: dict[str, tuple[str, float]] = field(default_factory=dict)
    hidden: dict[str, float] = field(default_factory=dict)

    @property
    def total_s(self) -> float:
        return sum(s for _, s in self.terms.values())

    def by_category(self) -> dict[str, float]:
        out = {c: 0.0 for c in CATEGORIES}
        for cat, s in self.terms.values():
            out[cat] += s
        return out

    def seconds(self) -> dict[str, float]:
        """{term: seconds}."""
        return {k: s for k, (_, s) in self.terms.items()}

    def to_steptime(self) -> StepTime:
        cats = self.by_category()
        names = {f.name for f in dataclasses.fields(StepTime)}
        kw = {k: v for k, v in cats.items() if k in names}
        if "total_s" in names:
            kw["total_s"] = sum(cats.values())
        return StepTime(**kw)


class BreakdownBuilder:
    """Accumulates terms (adding to an existing name) and freezes them into a :class:`StepBreakdown`."""

    def __init__(self) -> None:
        self._terms: dict[str, list] = {}

    def add(self, name: str, category: str, seconds: float) -> None:
        assert category in CATEGORIES, category
        assert seconds >= 0, (name, seconds)
        if name in self._terms:
            assert self._terms[name][0] == category, name
            self._terms[name][1] += seconds
        else:
            self._terms[name] = [category, seconds]

    def build(self) -> StepBreakdown:
        return StepBreakdown({k: (c, s) for k, (c, s) in self._terms.items()})
