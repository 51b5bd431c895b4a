"""Feed-forward kinds of a decoder layer: a dense SwiGLU MLP, or a mixture of SwiGLU experts.

``DenseFfn``: gate, up (hidden -> intermediate) and down projections, split ``tp`` ways.
``MoeFfn``: ``n_experts`` routed experts of width ``intermediate``, ``top_k`` active per token, a router
hidden -> n_experts, plus ``n_shared`` always-on experts of width ``shared_intermediate``, each with a sigmoid gate
hidden -> 1 (Qwen3-Next / Qwen3.5; ``shared_gate=False``: DeepSeek-V3, Kimi-K2, GLM-4.5 add the shared experts
ungated). ``router_bias``: a per-expert bias on the router (gpt-oss's router bias; DeepSeek-V3's and GLM-4.5's
selection-only ``e_score_correction_bias``); ``expert_bias``: biases on each expert's gate/up and down projections
(gpt-oss). Biases are parameters kept in bf16, never quantized. Routed experts spread over the EP group (``n_experts / ep`` contiguous
experts per EP rank); shared experts split ``tp`` ways like a dense MLP; router and gates are replicated.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rackbed.topology.errors import UserError


class DenseFfn(BaseModel):
    """A dense SwiGLU MLP."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["dense"] = "dense"
    hidden: int = Field(gt=0)
    intermediate: int = Field(gt=0)

    def params(self) -> int:
        return 3 * self.hidden * self.intermediate

    def active_params(self) -> int:
        return self.params()

    def quantizable_params(self) -> int:
        return self.params()


class MoeFfn(BaseModel):
    """A mixture of experts, with or without shared experts (module docstring)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["moe"] = "moe"
    hidden: int = Field(gt=0)
    n_experts: int = Field(gt=0)
    top_k: int = Field(gt=0)
    intermediate: int = Field(gt=0)
    n_shared: int = Field(default=0, ge=0)
    shared_intermediate: int = Field(default=0, ge=0)
    shared_gate: bool = True
    router_bias: bool = False
    expert_bias: bool = False

    @model_validator(mode="after")
    def _check(self):
        if not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"top_k must be in [1, n_experts={self.n_experts}], got {self.top_k}")
        if self.n_shared > 0 and self.shared_intermediate <= 0:
            raise ValueError("shared_intermediate must be > 0 when n_shared_experts > 0")
        return self

    def expert_weight_params(self) -> int:
        """One routed SwiGLU expert's matmul weights: gate, up (hidden -> intermediate) and down projections."""
        return 3 * self.hidden * self.intermediate

    def expert_params(self) -> int:
        """One routed expert: its weights plus, with ``expert_bias``, gate/up (2 * intermediate) and down
        (hidden) biases."""
        bias = 2 * self.intermediate + self.hidden if self.expert_bias else 0
        return self.expert_weight_params() + bias

    def shared_params(self) -> int:
        """All shared experts, each with its sigmoid gate (hidden -> 1) when ``shared_gate``."""
        return self.n_shared * (3 * self.hidden * self.shared_intermediate) + self.shared_gate_params()

    def shared_gate_params(self) -> int:
        return self.n_shared * self.hidden if self.shared_gate else 0

    def router_params(self) -> int:
        return self.n_experts * self.hidden + (self.n_experts if self.router_bias else 0)

    def params(self) -> int:
        """Routed experts + router + shared experts (and their gates)."""
        return self.n_experts * self.expert_params() + self.router_params() + self.shared_params()

    def active_params(self) -> int:
        """What one token touches: ``top_k`` routed experts, the router, the shared experts and gates."""
        return self.params() - (self.n_experts - self.top_k) * self.expert_params()

    def quantizable_params(self) -> int:
        """Routed and shared experts' weights (router, shared-expert gates and biases stay bf16)."""
        return self.n_experts * self.expert_weight_params() + self.shared_params() - self.shared_gate_params()

    def experts_of_ep_rank(self, ep: int, ep_rank: int) -> range:
        """The contiguous routed experts EP rank ``ep_rank`` of ``ep`` holds."""
        if self.n_experts % ep:
            raise UserError(f"ep={ep} does not divide {self.n_experts} experts")
        per = self.n_experts // ep
        return range(ep_rank * per, (ep_rank + 1) * per)


__all__ = ["DenseFfn", "MoeFfn"]
