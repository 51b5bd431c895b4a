"""Gated DeltaNet linear attention (the "linear" layers of Qwen3-Next / Qwen3.5).

in_proj_qkvz: hidden -> 2*Hk*Dk + 2*Hv*Dv, in_proj_ba: hidden -> 2*Hv, a depthwise causal conv1d of width ``conv``
over the 2*Hk*Dk + Hv*Dv q/k/v channels, A_log and dt_bias [Hv], a gated RMSNorm over Dv, out_proj: Hv*Dv -> hidden
(Dk = Dv = ``head_dim``). No KV cache: each request keeps a recurrent state of Hv*Dk*Dv elements plus
(conv - 1) tokens of conv state per layer, whatever its length. Attention TP splits every head ``tp`` ways (and the
state with them).
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, model_validator

from rackbed.engine.core.layers.base import AttentionKind, local_counts
from rackbed.topology.errors import UserError

#: FLOPs per recurrent-state element per token of a Gated DeltaNet head: decay (1), retrieval S^T k (2),
#: rank-1 delta update (2), readout S^T q (2). Chunked prefill kernels do the same work in a different order
#: (plus an intra-chunk term of order chunk_size * (Dk + Dv) per head that is ignored here).
DELTANET_FLOPS_PER_STATE_ELEM = 7


class GdnAttention(AttentionKind):
    """Gated DeltaNet (module docstring)."""

    kind: Literal["linear"] = "linear"
    n_k_heads: int = Field(gt=0)
    n_v_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    conv: int = Field(gt=0)
    kv_tp_sharding: ClassVar[str] = "none"

    @model_validator(mode="after")
    def _check(self):
        if self.n_v_heads % self.n_k_heads:
            raise ValueError(f"linear_n_v_heads ({self.n_v_heads}) must be a multiple of linear_n_k_heads "
                             f"({self.n_k_heads})")
        return self

    @property
    def conv_channels(self) -> int:
        """Channels of the causal conv: q, k and v (2*Hk*Dk + Hv*Dv)."""
        return (2 * self.n_k_heads + self.n_v_heads) * self.head_dim

    # ---- parameters ------------------------------------------------------------------------------------------

    def proj_params(self) -> int:
        h = self.hidden
        key_dim = self.n_k_heads * self.head_dim
        value_dim = self.n_v_heads * self.head_dim
        return h * (2 * key_dim + 2 * value_dim) + h * 2 * self.n_v_heads + value_dim * h

    def small_params(self) -> int:
        return self.conv_channels * self.conv + 2 * self.n_v_heads + self.head_dim

    # ---- state -----------------------------------------------------------------------------------------------

    def state_bytes_per_seq(self, elem_bytes: float = 2, conv_elem_bytes: float | None = None) -> float:
        """Hv * Dk * Dv state elements (``elem_bytes`` each; 4 for an fp32 state) plus (conv - 1) * conv
        channels of conv state (``conv_elem_bytes``, default ``elem_bytes``)."""
        cb = elem_bytes if conv_elem_bytes is None else conv_elem_bytes
        state = self.n_v_heads * self.head_dim * self.head_dim * elem_bytes
        return state + (self.conv - 1) * self.conv_channels * cb

    def state_bytes_per_seq_per_rank(self, tp: int, elem_bytes: float = 2) -> float:
        return self.state_bytes_per_seq(elem_bytes) / tp

    def check_tp(self, tp: int, kv_replication: int, model_name: str) -> None:
        for what, n in (("linear-attention key heads", self.n_k_heads),
                        ("linear-attention value heads", self.n_v_heads)):
            if n % tp:
                raise UserError(f"tp={tp} does not divide {n} {what} of {model_name}")

    # ---- cost-model facts ------------------------------------------------------------------------------------

    def local_heads(self, tp: int) -> tuple[int, int]:
        """(key heads, value heads) of one rank: ``ceil(n / tp)``, at least 1."""
        return local_counts((self.n_k_heads, self.n_v_heads), tp)

    def proj_gemms(self, tp: int = 1, phase: str = "prefill") -> tuple[tuple[int, int], ...]:
        """in_proj_qkvz + in_proj_ba ``[T, hidden] @ [hidden, 2*Hk*Dk + 2*Hv*Dv + 2*Hv]``, out_proj ``[T, Hv*Dv]``."""
        hk, hv = self.local_heads(tp)
        dk = self.head_dim
        return ((2 * hk * dk + 2 * hv * dk + 2 * hv, self.hidden), (self.hidden, hv * dk))

    def local_state_bytes(self, tp: int, state_elem_bytes: float, conv_elem_bytes: float = 2) -> float:
        """Recurrent + conv state of one sequence on one rank (the cost model's fp32 or bf16 state)."""
        hk, hv = self.local_heads(tp)
        dk = self.head_dim
        return hv * dk * dk * state_elem_bytes + (self.conv - 1) * ((2 * hk + hv) * dk) * conv_elem_bytes

    def prefill_flops_per_token(self, tp: int, chunk: int) -> float:
        """Chunked delta rule per token on one rank: ``2 * (2*C*Dk + C*Dv + 3*Dk*Dv)`` per value head (intra-chunk
        K K^T and Q K^T, the chunk's A V, the three state products) plus the causal conv."""
        hk, hv = self.local_heads(tp)
        dk = self.head_dim
        return hv * 2.0 * (2 * chunk * dk + chunk * dk + 3 * dk * dk) + 2.0 * self.conv * (2 * hk + hv) * dk

    def prefill_core_flops(self, new_tokens: int, cached_tokens: int, tp: int = 1, chunk: int = 64) -> float:
        """The chunked delta rule over the new tokens (the cached ones only through the stored state)."""
        return self.prefill_flops_per_token(tp, chunk) * new_tokens

    def decode_core_flops(self, context_tokens: float, tp: int = 1, q_per_seq: int = 1) -> float:
        """Per sequence and query token, whatever the context (``context_tokens`` is not read)."""
        return q_per_seq * self.decode_flops_per_token(tp)

    def prefill_act_bytes_per_token(self, tp: int) -> float:
        """q, k, v in and o out (bf16) per token on one rank."""
        hk, hv = self.local_heads(tp)
        return (2 * hk + 2 * hv) * self.head_dim * 2

    def decode_flops_per_token(self, tp: int) -> float:
        """Recurrent update per token on one rank (``DELTANET_FLOPS_PER_STATE_ELEM`` per state element)."""
        _, hv = self.local_heads(tp)
        return float(DELTANET_FLOPS_PER_STATE_ELEM) * hv * self.head_dim * self.head_dim

    def model_core_flops_per_token(self) -> int:
        """The whole layer's recurrence + conv per token (``ModelSpec.flops_breakdown``'s ``linear_core``)."""
        return (DELTANET_FLOPS_PER_STATE_ELEM * self.n_v_heads * self.head_dim ** 2
                + 2 * self.conv * self.conv_channels)

    def activation_width(self, tp: int) -> int:
        return (2 * self.n_k_heads + 2 * self.n_v_heads) * self.head_dim // tp


__all__ = ["DELTANET_FLOPS_PER_STATE_ELEM", "GdnAttention"]
