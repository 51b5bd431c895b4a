"""Softmax attention with grouped KV heads (GQA), and its sliding-window variant.

``GqaAttention``: ``n_q_heads`` query heads share ``n_kv_heads`` KV heads of ``head_dim``; optionally *gated*
(q_proj also emits a per-channel sigmoid gate for the output, so it is 2x wide; Qwen3.5 / Qwen3-Next) and with
qk RMSNorm (``qk_norm``: two ``head_dim`` weights). The KV cache holds K and V of every KV head for every token.

Attention TP: query heads split ``tp`` ways; KV heads split ``tp`` ways while ``tp <= n_kv_heads``, beyond that
each KV head (its K/V projections and its cache) is replicated on ``tp / n_kv_heads`` consecutive ranks.

``SlidingWindowAttention``: the same projections, but each query attends to at most the ``window`` latest tokens
(itself included), so the cache keeps at most ``window`` tokens per sequence.

``learned_sinks`` (either kind) adds one learned sink logit per query head to the softmax (gpt-oss, in its
sliding and its full layers): parameters only, no cached tokens.

Projection biases (``qkv_bias``, ``o_bias``: GLM-4.5 and gpt-oss) are parameters only; they cost nothing the
cost models see.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, model_validator

from rackbed.engine.core.layers.base import AttentionKind, local_counts, split_heads
from rackbed.topology.errors import UserError


def tp_kv_head_shards(n_kv_heads: int, tp: int) -> tuple[tuple[int, ...], ...]:
    """KV heads of each TP rank: contiguous blocks when ``tp <= n_kv_heads`` (tp must divide), otherwise one head
    per rank, head ``r // (tp / n_kv_heads)`` (each replicated on consecutive ranks)."""
    if tp <= n_kv_heads:
        if n_kv_heads % tp:
            raise UserError(f"tp={tp} does not divide {n_kv_heads} KV heads")
        per = n_kv_heads // tp
        return tuple(tuple(range(r * per, (r + 1) * per)) for r in range(tp))
    if tp % n_kv_heads:
        raise UserError(f"tp={tp} is not a multiple of {n_kv_heads} KV heads")
    rep = tp // n_kv_heads
    return tuple((r // rep,) for r in range(tp))


class GqaAttention(AttentionKind):
    """Full softmax attention with GQA (module docstring)."""

    kind: Literal["full"] = "full"
    n_q_heads: int = Field(gt=0)
    n_kv_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    qk_norm: bool = True
    gated: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    learned_sinks: bool = False
    kv_tp_sharding: ClassVar[str] = "heads"

    @model_validator(mode="after")
    def _check(self):
        if self.n_q_heads % self.n_kv_heads:
            raise ValueError(f"n_q_heads ({self.n_q_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
        return self

    # ---- parameters ------------------------------------------------------------------------------------------

    def kv_proj_params(self) -> int:
        """K and V projections (the part replicated with the KV heads beyond ``tp = n_kv_heads``)."""
        return self.hidden * 2 * self.n_kv_heads * self.head_dim

    def proj_params(self) -> int:
        h = self.hidden
        q_out = self.n_q_heads * self.head_dim * (2 if self.gated else 1)  # query (+ output gate)
        kv_out = 2 * self.n_kv_heads * self.head_dim
        o_in = self.n_q_heads * self.head_dim
        return h * q_out + h * kv_out + o_in * h

    def small_params(self) -> int:
        """qk RMSNorm weights, sink logits and projection biases (GLM-4.5: q/k/v; gpt-oss: q/k/v and o), kept in bf16."""
        n = 2 * self.head_dim if self.qk_norm else 0
        if self.qkv_bias:
            n += (self.n_q_heads + 2 * self.n_kv_heads) * self.head_dim
        n += self.n_q_heads if self.learned_sinks else 0
        return n + (self.hidden if self.o_bias else 0)

    # ---- cache -----------------------------------------------------------------------------------------------

    def kv_values_per_token(self) -> int:
        return 2 * self.n_kv_heads * self.head_dim

    def n_kv_units(self) -> int:
        return self.n_kv_heads

    def kv_shards(self, tp: int) -> tuple[tuple[int, ...], ...]:
        return tp_kv_head_shards(self.n_kv_heads, tp)

    def kv_units_per_rank(self, tp: int) -> int:
        """KV heads each rank holds: ``n_kv_heads / tp``, or 1 (a replica) when ``tp > n_kv_heads``."""
        return max(self.n_kv_heads // tp, 1)

    def kv_replication(self, tp: int) -> int:
        """Copies of each KV head in a TP group of ``tp`` ranks."""
        return max(1, tp // self.n_kv_heads) if tp > self.n_kv_heads else 1

    # ---- sharding --------------------------------------------------------------------------------------------

    def q_heads_of_tp_rank(self, tp: int, rank: int) -> range:
        return split_heads(self.n_q_heads, tp, rank, "query heads")

    def kv_heads_of_tp_rank(self, tp: int, rank: int) -> range:
        """The KV heads TP rank ``rank``'s query heads read (a replica when ``tp > n_kv_heads``)."""
        group = self.n_q_heads // self.n_kv_heads
        q = self.q_heads_of_tp_rank(tp, rank)
        return range(q.start // group, (q.stop - 1) // group + 1)

    def check_tp(self, tp: int, kv_replication: int, model_name: str) -> None:
        if self.n_q_heads % tp:
            raise UserError(f"tp={tp} does not divide {self.n_q_heads} query heads of {model_name}")
        kvh = self.n_kv_heads
        if tp > kvh:
            need = tp // kvh
            if tp % kvh:
                raise UserError(f"tp={tp} is not a multiple of {kvh} KV heads, so heads cannot be replicated "
                                f"evenly; use tp<={kvh} or a multiple of {kvh}")
            if kv_replication != need:
                raise UserError(f"tp={tp} exceeds {kvh} KV heads; set kv_replication={need} or tp<={kvh}"
                                + (f" (got kv_replication={kv_replication})" if kv_replication > 1 else ""))
        else:
            if kvh % tp:
                raise UserError(f"tp={tp} does not divide {kvh} KV heads of {model_name}")
            if kv_replication != 1:
                raise UserError(f"kv_replication={kv_replication} but tp={tp} <= {kvh} KV heads needs "
                                f"no replication; set kv_replication=1")

    # ---- cost-model facts ------------------------------------------------------------------------------------

    def local_heads(self, tp: int) -> tuple[int, int]:
        """(query heads, KV heads) one rank computes with: ``ceil(n / tp)``, at least 1 (KV replication)."""
        return local_counts((self.n_q_heads, self.n_kv_heads), tp)

    def proj_gemms(self, tp: int = 1, phase: str = "prefill") -> tuple[tuple[int, int], ...]:
        """Fused QKV ``[T, hidden] @ [hidden, H*D*(2 if gated) + 2*Hkv*D]``, then O ``[T, H*D] @ [H*D, hidden]``."""
        h, hkv = self.local_heads(tp)
        d = self.head_dim
        return ((h * d * (2 if self.gated else 1) + 2 * hkv * d, self.hidden), (self.hidden, h * d))

    def core_flops_per_pair(self, tp: int = 1) -> float:
        """FLOPs of one (query, key) pair on one rank: QK^T and PV over its local query heads."""
        h, _ = self.local_heads(tp)
        return 4.0 * h * self.head_dim

    def prefill_core_flops(self, new_tokens: int, cached_tokens: int, tp: int = 1) -> float:
        """Causal attention core of one sequence's prefill chunk on one rank."""
        return self.core_flops_per_pair(tp) * self.attended_pairs(new_tokens, cached_tokens)

    def decode_core_flops(self, context_tokens: float, tp: int = 1, q_per_seq: int = 1) -> float:
        """QK^T and PV of every query token against its sequence's context, on one rank."""
        return self.core_flops_per_pair(tp) * context_tokens * q_per_seq

    def kv_read_bytes(self, kv_tokens: float, tp: int = 1, elem_bytes: float = 2.0) -> float:
        """KV bytes one rank reads for ``kv_tokens`` cached tokens (K and V of its local KV heads)."""
        _, hkv = self.local_heads(tp)
        return kv_tokens * 2 * hkv * self.head_dim * elem_bytes

    def activation_width(self, tp: int) -> int:
        """q (+ gate), K, V and the O input one rank holds per token (the memory budget's attention stage)."""
        q_local = self.n_q_heads * self.head_dim * (2 if self.gated else 1) // tp
        o_local = self.n_q_heads * self.head_dim // tp
        return q_local + 2 * self.kv_units_per_rank(tp) * self.head_dim + o_local


class SlidingWindowAttention(GqaAttention):
    """GQA attending to the latest ``window`` tokens only (module docstring)."""

    kind: Literal["sliding"] = "sliding"  # type: ignore[assignment]
    window: int = Field(gt=0)

    def kv_tokens(self, context_len: int) -> int:
        return min(context_len, self.window)

    def attended_pairs(self, new_tokens: int, cached_tokens: int) -> float:
        """Sum over the chunk's positions ``p = c+1 .. c+q`` of ``min(p, window)``."""
        q, c, w = new_tokens, cached_tokens, self.window
        if q <= 0:
            return 0.0
        hi = c + q
        ramp_end = min(hi, w)  # positions c+1 .. ramp_end attend to p tokens, the rest to w
        ramp = (ramp_end * (ramp_end + 1) - c * (c + 1)) / 2 if ramp_end > c else 0.0
        return ramp + (hi - max(ramp_end, c)) * w

    # decode_core_flops is GQA's: its ``context_tokens`` are summed over sequences, so callers cap each
    # sequence's context with ``kv_tokens`` before summing (a cap on the sum would undercount).


__all__ = ["GqaAttention", "SlidingWindowAttention", "tp_kv_head_shards"]
