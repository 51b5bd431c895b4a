"""What every token-mixer (attention) kind answers, and the shared helpers.

A kind is frozen data: the dimensions of one layer's token mixer. Consumers (parameter and memory accounting,
the KV layout, the sharding plan, the cost models, the real engine) ask the kind instead of re-deriving facts from
a model's flat fields. The defaults below describe a mixer with no per-token cache and no per-request state;
each kind overrides what applies to it.

Conventions: sizes are element counts; FLOPs count 2 per multiply-accumulate; "per rank" means one rank of an
attention TP group of ``tp`` ranks (``tp = 1``: a DP rank holding its own requests whole).
"""

from __future__ import annotations

import functools
from typing import ClassVar

from pydantic import BaseModel, ConfigDict, Field

from rackbed.topology.errors import UserError


@functools.lru_cache(maxsize=4096)
def local_counts(counts: tuple[int, ...], tp: int) -> tuple[int, ...]:
    """``ceil(n / tp)``, at least 1, of each head count: what one of ``tp`` ranks computes with (a replica when
    ``tp > n``). Cached: the cost models ask per step."""
    if tp < 1:
        raise UserError(f"tp must be >= 1, got {tp}")
    return tuple(max(1, -(-n // tp)) for n in counts)


def split_heads(n_heads: int, tp: int, rank: int, what: str) -> range:
    """Heads of TP rank ``rank`` when ``tp`` ranks split ``n_heads`` contiguously (tp must divide)."""
    if n_heads % tp:
        raise UserError(f"tp={tp} does not divide {n_heads} {what}")
    per = n_heads // tp
    return range(rank * per, (rank + 1) * per)


class AttentionKind(BaseModel):
    """Base of the token-mixer kinds (``kind`` is the tag a layer list and the cost models dispatch on)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: str
    hidden: int = Field(gt=0)

    # ---- parameters ------------------------------------------------------------------------------------------

    def proj_params(self) -> int:
        """Projection (matmul) weights: the part stored in the deployment's weight format."""
        raise NotImplementedError

    def small_params(self) -> int:
        """Non-matmul parameters (norms, convolutions, per-head scalars), kept in bf16."""
        return 0

    def params(self) -> int:
        """All parameters of one layer's token mixer (the layer's input / post-attention RMSNorms excluded)."""
        return self.proj_params() + self.small_params()

    # ---- cache -----------------------------------------------------------------------------------------------

    def kv_values_per_token(self) -> int:
        """Cache elements one token adds to one layer (all heads, K and V or the latent); 0 without a KV cache."""
        return 0

    def kv_tokens(self, context_len: int) -> int:
        """Tokens of KV one sequence of ``context_len`` tokens keeps in one layer."""
        return context_len if self.kv_values_per_token() else 0

    def kv_bytes_per_token(self, elem_bytes: float = 2) -> float:
        """KV bytes per token of one layer, whole (every head)."""
        return self.kv_values_per_token() * elem_bytes

    def state_bytes_per_seq(self, elem_bytes: float = 2, conv_elem_bytes: float | None = None) -> float:
        """Per-request state of one layer independent of the sequence length (recurrent kinds); 0 otherwise."""
        return 0

    def kv_bytes_per_seq(self, context_len: int, elem_bytes: float = 2) -> float:
        """Everything one sequence of ``context_len`` tokens keeps in one layer: KV plus state."""
        return self.kv_tokens(context_len) * self.kv_bytes_per_token(elem_bytes) + self.state_bytes_per_seq(elem_bytes)

    # ---- sharding --------------------------------------------------------------------------------------------

    #: how the per-token cache spreads over an attention TP group: "heads" (split by heads, replicated once
    #: tp exceeds them), "replicated" (every TP rank holds the whole), "none" (no per-token cache). Under DP
    #: attention every kind is partitioned by request: a rank holds its own requests' cache whole.
    kv_tp_sharding: ClassVar[str] = "none"

    def n_kv_units(self) -> int:
        """Independently placeable units of the per-token cache (KV heads; 1 for a latent shared by all heads)."""
        return 1

    def kv_shards(self, tp: int) -> tuple[tuple[int, ...], ...]:
        """Cache units each of ``tp`` TP ranks holds (``KvLayout.shards``)."""
        return tuple((0,) for _ in range(tp))

    def kv_units_per_rank(self, tp: int) -> int:
        return len(self.kv_shards(tp)[0])

    def kv_bytes_per_token_per_rank(self, tp: int, elem_bytes: float = 2) -> float:
        """KV bytes per token of one layer that one rank of a TP group of ``tp`` stores."""
        return self.kv_bytes_per_token(elem_bytes) * self.kv_units_per_rank(tp) / self.n_kv_units()

    def state_bytes_per_seq_per_rank(self, tp: int, elem_bytes: float = 2) -> float:
        """Per-request state of one layer on one rank of a TP group of ``tp``."""
        return 0

    def check_tp(self, tp: int, kv_replication: int, model_name: str) -> None:
        """Raise a one-line ``UserError`` when ``tp`` ranks cannot split this mixer."""

    # ---- cost-model facts ------------------------------------------------------------------------------------

    def proj_gemms(self, tp: int = 1, phase: str = "prefill") -> tuple[tuple[int, int], ...]:
        """The projection GEMMs of one rank per token: ``(n, k)`` for ``[T, k] @ [k, n]``, in execution order."""
        raise NotImplementedError

    def attended_pairs(self, new_tokens: int, cached_tokens: int) -> float:
        """(query, key) pairs a prefill chunk of ``new_tokens`` after ``cached_tokens`` scores (causal)."""
        q, c = new_tokens, cached_tokens
        return q * c + q * (q + 1) / 2

    def prefill_core_flops(self, new_tokens: int, cached_tokens: int, tp: int = 1) -> float:
        """The mixer's core (attention / recurrence, projections excluded) for one sequence's prefill chunk of
        ``new_tokens`` after ``cached_tokens``, on one rank."""
        raise NotImplementedError

    def decode_core_flops(self, context_tokens: float, tp: int = 1, q_per_seq: int = 1) -> float:
        """The core of a decode step over ``context_tokens`` cached tokens (summed over the rank's sequences),
        ``q_per_seq`` query tokens per sequence, on one rank."""
        raise NotImplementedError

    def kv_read_bytes(self, kv_tokens: float, tp: int = 1, elem_bytes: float = 2.0) -> float:
        """Per-token cache bytes one rank reads for ``kv_tokens`` cached tokens (0 without a per-token cache)."""
        return 0.0

    def activation_width(self, tp: int) -> int:
        """Activation elements per token one rank writes in the mixer's stage (projection outputs), for the
        activation reserve of the memory budget."""
        return sum(n for n, _ in self.proj_gemms(tp))


__all__ = ["AttentionKind", "local_counts", "split_heads"]
