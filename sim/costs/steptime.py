"""``StepTime``: seconds of one forward step by category — what every cost model returns to the executor.

Categories (see ``sim/costs/breakdown.py`` for which terms roll up where): ``attn_s`` (attention / DeltaNet),
``moe_gemm_s`` (expert and dense MLP GEMMs), ``a2a_s`` (MoE dispatch/combine), ``allreduce_s`` (TP and EP-prefill
all-reduces), ``other_s`` (router, norms, embeddings, lm_head, host overheads). ``total_s`` is their sum.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class StepTime:
    attn_s: float = 0.0
    moe_gemm_s: float = 0.0
    a2a_s: float = 0.0
    allreduce_s: float = 0.0
    other_s: float = 0.0

    @property
    def total_s(self) -> float:
        return self.attn_s + self.moe_gemm_s + self.a2a_s + self.allreduce_s + self.other_s
