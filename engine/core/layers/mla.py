"""Multi-head latent attention (MLA: DeepSeek-V2/V3, Kimi-K2).

Projections (H = ``n_heads``; ``q_lora_rank = 0`` means an uncompressed q_proj):

    q_a_proj  hidden -> q_lora_rank, RMSNorm(q_lora_rank), q_b_proj q_lora_rank -> H * (qk_nope + qk_rope)
    kv_a_proj hidden -> kv_lora_rank + qk_rope, RMSNorm(kv_lora_rank), kv_b_proj kv_lora_rank -> H * (qk_nope + v)
    o_proj    H * v_head_dim -> hidden

The cache keeps, per token and layer, the compressed latent (``kv_lora_rank``) and the shared rotary key
(``qk_rope_head_dim``): ``kv_lora_rank + qk_rope_head_dim`` values, NOT split by heads (DeepSeek-V3: 512 + 64 = 576,
against 2 * 128 * 128 = 32,768 for the same heads as MHA). Attention TP splits the heads but every rank needs the
whole latent, so the cache is replicated on each TP rank; DP attention partitions it by request.

Prefill runs the expanded form (kv_b_proj applied to every context token: K and V per head, QK^T over
qk_nope + qk_rope dims, PV over v dims). Decode runs with absorbed weights: W_UK folds into the query and W_UV into
the output, so each query head scores the latent directly (``kv_lora + qk_rope`` dims) and reads back
``kv_lora`` dims: per context token ``2 * H * (2 * kv_lora + qk_rope)`` FLOPs, the latent read once for all heads.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from rackbed.engine.core.layers.base import AttentionKind, local_counts, split_heads
from rackbed.topology.errors import UserError


class MlaAttention(AttentionKind):
    """Multi-head latent attention (module docstring)."""

    kind: Literal["mla"] = "mla"
    n_heads: int = Field(gt=0)
    q_lora_rank: int = Field(ge=0)
    kv_lora_rank: int = Field(gt=0)
    qk_nope_head_dim: int = Field(gt=0)
    qk_rope_head_dim: int = Field(gt=0)
    v_head_dim: int = Field(gt=0)
    kv_tp_sharding: ClassVar[str] = "replicated"

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    # ---- parameters ------------------------------------------------------------------------------------------

    def _q_params(self) -> int:
        q_out = self.n_heads * self.qk_head_dim
        if self.q_lora_rank:
            return self.hidden * self.q_lora_rank + self.q_lora_rank * q_out
        return self.hidden * q_out

    def kv_b_params(self) -> int:
        """kv_b_proj: the latent up-projection to per-head K (nope part) and V."""
        return self.kv_lora_rank * self.n_heads * (self.qk_nope_head_dim + self.v_head_dim)

    def proj_params(self) -> int:
        kv_a = self.hidden * (self.kv_lora_rank + self.qk_rope_head_dim)
        o = self.n_heads * self.v_head_dim * self.hidden
        return self._q_params() + kv_a + self.kv_b_params() + o

    def small_params(self) -> int:
        """The q_a and kv_a RMSNorms."""
        return self.q_lora_rank + self.kv_lora_rank

    # ---- cache -----------------------------------------------------------------------------------------------

    def kv_values_per_token(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    def check_tp(self, tp: int, kv_replication: int, model_name: str) -> None:
        if self.n_heads % tp:
            raise UserError(f"tp={tp} does not divide {self.n_heads} attention heads of {model_name}")
        if kv_replication != 1:
            raise UserError(f"kv_replication={kv_replication} does not apply to MLA (the latent KV is on every "
                            "TP rank); set kv_replication=1")

    def heads_of_tp_rank(self, tp: int, rank: int) -> range:
        return split_heads(self.n_heads, tp, rank, "attention heads")

    # ---- cost-model facts ------------------------------------------------------------------------------------

    def local_heads(self, tp: int) -> int:
        return local_counts((self.n_heads,), tp)[0]

    def proj_gemms(self, tp: int = 1, phase: str = "prefill") -> tuple[tuple[int, int], ...]:
        """q (a, b), kv_a (replicated: every rank needs the whole latent), then prefill: kv_b on the new tokens
        (its cached part is ``prefill_core_flops``'s); decode: the absorbed W_UK on q and W_UV on the output
        (per query token, batched over heads); o_proj."""
        h = self.local_heads(tp)
        q_out = h * self.qk_head_dim
        q = ((self.q_lora_rank, self.hidden), (q_out, self.q_lora_rank)) if self.q_lora_rank else \
            ((q_out, self.hidden),)
        kv_a = ((self.kv_lora_rank + self.qk_rope_head_dim, self.hidden),)
        o = ((self.hidden, h * self.v_head_dim),)
        if phase == "decode":
            absorb = ((h * self.kv_lora_rank, self.qk_nope_head_dim), (h * self.v_head_dim, self.kv_lora_rank))
            return q + kv_a + absorb + o
        return q + kv_a + ((h * (self.qk_nope_head_dim + self.v_head_dim), self.kv_lora_rank),) + o

    def prefill_core_flops(self, new_tokens: int, cached_tokens: int, tp: int = 1) -> float:
        """Expanded attention of one sequence's chunk on one rank: QK^T over qk_nope + qk_rope dims and PV over
        v dims per pair, plus kv_b_proj on the cached tokens (the new ones are in the projections)."""
        h = self.local_heads(tp)
        pairs = self.attended_pairs(new_tokens, cached_tokens)
        up = 2.0 * cached_tokens * self.kv_lora_rank * h * (self.qk_nope_head_dim + self.v_head_dim)
        return 2.0 * h * (self.qk_head_dim + self.v_head_dim) * pairs + up

    def decode_core_flops(self, context_tokens: float, tp: int = 1, q_per_seq: int = 1) -> float:
        """Absorbed decode over ``context_tokens`` cached tokens on one rank (module docstring)."""
        h = self.local_heads(tp)
        return 2.0 * h * (2 * self.kv_lora_rank + self.qk_rope_head_dim) * context_tokens * q_per_seq

    def kv_read_bytes(self, kv_tokens: float, tp: int = 1, elem_bytes: float = 2.0) -> float:
        """The latent is read once for all local heads, whatever ``tp``."""
        return kv_tokens * self.kv_values_per_token() * elem_bytes

    def activation_width(self, tp: int) -> int:
        h = self.local_heads(tp)
        return (self.q_lora_rank + h * self.qk_head_dim + self.kv_lora_rank + self.qk_rope_head_dim
                + h * (self.qk_nope_head_dim + 2 * self.v_head_dim))


__all__ = ["MlaAttention"]
