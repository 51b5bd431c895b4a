"""How one deployment (a prefiller or a decoder) spreads a model over GPUs, checked without hardware.

A ``ParallelPlan`` is data: which degrees of parallelism a role uses and which GPUs of a ``Topology`` its ranks sit
on. ``validate(model, topology)`` raises a one-line ``UserError`` naming the first violated constraint;
``memory_budget(model, topology)`` returns what each rank holds. ``SHARDING.md`` beside this file has the table.

Ranks, axes and groups (``world = len(gpus)``; rank ``r`` runs on GPU ``gpus[r]``):

* attention: ``world = tp * dp``; rank ``r`` is TP rank ``r % tp`` of DP group ``r // tp`` (TP groups are
  consecutive ranks). q heads and the output projection are split ``tp`` ways. KV heads are split ``tp`` ways while
  ``tp <= n_kv_heads``; beyond that each KV head is replicated on ``kv_replication = tp / n_kv_heads`` consecutive
  ranks (K/V projections and the KV cache are replicated with them). Linear-attention (Gated DeltaNet) layers
  split all their heads ``tp`` ways.
* experts: the ``world`` ranks form one EP group; ``ep`` divides ``world`` and ``n_experts``. Rank ``r`` holds the
  experts of EP rank ``r // expert_tp`` (``n_experts / ep`` of them, a contiguous range); when ``ep < world``
  each expert's intermediate dimension is further split ``expert_tp = world / ep`` ways (consecutive ranks).
  Common cases: prefill ``tp=4 ep=4 dp=1`` on 4 GPUs, decode ``tp=1 ep=16 dp=16`` on 16 GPUs.
* redundant experts (``redundant_experts = N``, wide EP): the EP group holds ``n_experts + N`` expert *slots*,
  ``(n_experts + N) / ep`` per EP rank; the N extra slots are copies of the most-loaded experts (DeepSeek's EPLB,
  SGLang ``--ep-num-redundant-experts``, TensorRT-LLM's ``num_slots``), so that e.g. DeepSeek-V3's 256 experts
  spread over 72 ranks as 288 = 72 x 4 slots. ``ep`` must divide the slots (not the experts); every rank stores
  its slots' weights (the copies cost memory), and a token's copy to a replicated expert goes to one of its
  replicas, so the load per slot is the experts' load spread over the slots.
* dense parts of the layers (shared expert, dense MLP layers) are split ``tp`` ways and replicated over DP groups.
* replicated on every rank: embeddings, lm_head, all RMSNorms, the MoE routers and everything else the model
  counts that is not listed above (e.g. the MTP layer's input projection). Vocab-parallel embeddings would save
  a little with ``tp > 1``; they are not modelled.
* MTP layers (``n_mtp_layers``) are deployed (``include_mtp=True``) and sharded like one more full-attention
  decoder layer (attention by tp, experts by ep); their fc projection (2*hidden -> hidden) is replicated.

Weight bytes: the matmul weights (``ModelSpec.quantizable_params``: attention / DeltaNet projections, routed and
shared experts, dense MLPs, MTP fc) are stored in ``weight_format``
(``engine.core.formats.get_format(fmt).bytes_per_element("weight")``, block scales included); the rest
(embeddings, lm_head, norms, routers, gates, conv1d ...) stays BF16 — ``ModelSpec.weight_bytes``'s convention, so a
1-GPU plan holds exactly ``weight_bytes(fmt, include_mtp=True)``.

KV cache: ``kv_dtype`` ``bf16`` (2 B/element) or ``fp8`` (1 B/element, per-tensor scale not counted). Per rank
and token it holds ``n_kv_heads * kv_replication / tp`` heads of every full-attention layer (a DP decode rank
holds all heads), MTP layers included. An MLA layer's latent (``kv_lora_rank + qk_rope_head_dim`` values per
token) is whole on every rank: replicated under attention TP, partitioned by request under DP. Hybrid models
(Qwen3.5) also keep a linear-attention state per sequence, split ``tp`` ways, in BF16 (vLLM's default
mamba-state dtype is the model dtype).

Sliding-window layers (gpt-oss) keep at most ``window`` tokens per sequence, so they are not a per-token cost:
``kv_bytes_per_token_per_rank`` counts the layers that keep the whole sequence (full, MLA) and
``window_bytes_per_seq_per_rank`` charges each sequence the sliding layers' live pages, ``ceil(window /
page_tokens) + 1`` pages per layer (the window rarely starts on a page boundary, and the page the next token
goes to is allocated before the oldest is freed), as a fixed per-sequence cost like the DeltaNet state. It is an
upper bound: a sequence shorter than the window holds less. The KV capacity in tokens is then what is left
after weights, reserve and the batch's per-sequence costs, divided by the per-token bytes of the other layers.

Activation reserve (per rank, bytes; override with ``activation_reserve_bytes``) — a conservative estimate of
what the step needs besides weights and KV, with T = ``max_batch_tokens`` and S = ``max_batch_seqs`` per DP
group, activations in BF16:

    reserve = RUNTIME_OVERHEAD_BYTES                                          # CUDA context, NCCL, workspaces
            + 2 * T * (3*hidden + q_local + 2*kv_local + o_local [+ linear_local])    # attention stage
            + 2 * R * (2*hidden + 3*moe_intermediate/expert_tp)          # MoE dispatch buffer + expert GEMMs
            + 4 * L * vocab                                               # fp32 logits
    R = dp * T * min(top_k, n_experts/ep)    # worst-case token copies received by one EP rank (buffers are
                                              # sized for the worst case, as DeepEP's low-latency ones are)
    R = min(R, NORMAL_MODE_HEADROOM * dp * T * top_k * slots_per_rank / slots)
                                              # prefill with DP attention (dp > 1): DeepEP's normal-mode
                                              # dispatch allocates the receive tensors at the counts a batch
                                              # routes, reserved here at twice the uniform share
    L = S (prefill: the last token of each sequence) or T (decode: every token, MTP drafts included)

A plan *fits* when ``weights + reserve + min_kv_tokens * kv_bytes_per_token_per_rank +
max_batch_seqs * (state_bytes_per_seq_per_rank + window_bytes_per_seq_per_rank) <= hbm_bytes`` of the smallest
GPU it uses; ``min_kv_tokens`` defaults to ``max_batch_tokens`` (one full batch's KV must fit). The KV capacity
reported is what is left after weights, reserve and the batch's linear state and sliding windows, in whole pages
of ``page_tokens``.

Role defaults: prefill ``max_batch_tokens=16384, max_batch_seqs=4``; decode ``max_batch_tokens=128,
max_batch_seqs=64`` (two tokens per sequence with one MTP draft).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from rackbed.engine.core.layers import tp_kv_head_shards
from rackbed.topology.errors import NoBoolNumbers, UserError, from_validation, one_line

Role = Literal["prefill", "decode"]
KV_DTYPE_BYTES = {"bf16": 2, "fp8": 1}
ACT_BYTES = 2  # BF16 activations
REPLICATED_BYTES_PER_PARAM = 2  # embeddings, lm_head, norms, routers stay BF16
# CUDA context + cuBLAS/NCCL workspaces + CUDA graphs; vLLM's profiler typically attributes 1-3 GB of
# "non-torch" memory per GPU on Hopper/Blackwell. A round 2 GB is used.
RUNTIME_OVERHEAD_BYTES = 2_000_000_000
#: a DP-attention prefiller's MoE receive rows over the uniform share (DeepEP normal mode sizes them per batch;
#: routing skew puts the busiest rank at up to about twice the mean for DeepSeek-V3's top-8 of 256)
NORMAL_MODE_HEADROOM = 2.0
ROLE_DEFAULTS = {
    "prefill": {"max_batch_tokens": 16384, "max_batch_seqs": 4},
    "decode": {"max_batch_tokens": 128, "max_batch_seqs": 64},
}


def parse_gpus(value: Any) -> Any:
    """Accept ``[0, 1, 2, 3]``, ``"0-3"`` or ``"0-3,8-11"`` (inclusive ranges) for a GPU list."""
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if not isinstance(value, str):
        return value
    out: list[int] = []
    for part in value.replace(" ", "").split(","):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part)
        if not m:
            raise ValueError(f"cannot parse GPU range {part!r} (use e.g. '0-3,8-11')")
        lo = int(m.group(1))
        hi = int(m.group(2)) if m.group(2) is not None else lo
        if hi < lo:
            raise ValueError(f"GPU range {part!r} is empty")
        out.extend(range(lo, hi + 1))
    return out


def _range_text(ids) -> str:
    """Compact text for a GPU list: 0-3,8."""
    ids = list(ids)
    if not ids:
        return "-"
    parts, start, prev = [], ids[0], ids[0]
    for g in ids[1:] + [None]:
        if g is not None and g == prev + 1:
            prev = g
            continue
        parts.append(f"{start}-{prev}" if prev != start else f"{start}")
        if g is not None:
            start = prev = g
    return ",".join(parts)


def kv_window(attention) -> int:
    """Tokens of KV one sequence keeps at most in a layer of this token-mixer kind: its sliding window
    (``SlidingWindowAttention.window``), 0 when the layer keeps the whole sequence."""
    return int(getattr(attention, "window", 0) or 0)


# ----------------------------------------------------------------------------------------------------------------
# The model split into parts that shard differently
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class WeightParts:
    """Parameter counts of a ``ModelSpec`` grouped by how they shard and how they are stored, MTP included.

    Built from ``ModelSpec.params_breakdown(include_mtp=True)``; quantized groups are exactly
    ``quantizable_params(include_mtp=True)``, so a 1-GPU plan holds ``weight_bytes(fmt, include_mtp=True)``.

    attn_split:       full / sliding attention q/o projections (q gate included); MLA's q_b, kv_b and o
                      (per head); split by tp                                                [weight_format]
    kv_proj:          full / sliding attention K and V projections, split by tp up to n_kv_heads, then
                      replicated                                                             [weight_format]
    linear_attn:      Gated DeltaNet projections, split by tp                                [weight_format]
    experts:          routed experts, split over all ranks (ep x expert_tp)                  [weight_format]
    tp_dense:         shared experts (without their gates) and dense MLPs, split by tp       [weight_format]
    replicated_quant: MTP fc projection (2*hidden -> hidden); MLA's q_a and kv_a down-projections (every head
                      reads the whole latent), on every rank                                 [weight_format]
    replicated_bf16:  embeddings, lm_head, RMSNorms, routers, shared-expert gates, qk norms, conv1d, A_log,
                      dt_bias, MTP norms, biases and sinks, on every rank (gpt-oss's expert biases too:
                      ~0.08 GB in bf16, counted whole on each rank rather than split with their experts) [bf16]
    """

    attn_split: int
    kv_proj: int
    linear_attn: int
    experts: int
    tp_dense: int
    replicated_quant: int
    replicated_bf16: int

    @property
    def total(self) -> int:
        return (self.attn_split + self.kv_proj + self.linear_attn + self.experts + self.tp_dense
                + self.replicated_quant + self.replicated_bf16)

    @property
    def quantized(self) -> int:
        return self.total - self.replicated_bf16

    @classmethod
    def of(cls, model) -> WeightParts:
        b = model.params_breakdown(include_mtp=True)
        h, n_mtp = model.hidden, model.n_mtp_layers
        counts = model.attention_counts(include_mtp=True)
        attn_split = kv_proj = linear_attn = replicated_quant = 0
        for a, n in counts:
            if a.kind == "linear":
                linear_attn += n * a.proj_params()
            elif a.kind == "mla":  # q_a and kv_a feed every head: replicated; q_b, kv_b, o split by heads
                down = a.hidden * (a.q_lora_rank + a.kv_lora_rank + a.qk_rope_head_dim) if a.q_lora_rank else \
                    a.hidden * (a.kv_lora_rank + a.qk_rope_head_dim)
                replicated_quant += n * down
                attn_split += n * (a.proj_params() - down)
            else:
                kv_proj += n * a.kv_proj_params()
                attn_split += n * (a.proj_params() - a.kv_proj_params())
        moe = model.kinds.moe
        n_moe = model.n_moe_layers + (n_mtp if model.n_experts else 0)
        experts = n_moe * model.n_experts * moe.expert_weight_params() if moe is not None else 0
        tp_dense = (n_moe * (moe.shared_params() - moe.shared_gate_params()) if moe is not None else 0) \
            + b["dense_mlp"]
        if n_mtp and not model.n_experts:
            tp_dense += n_mtp * model.params_dense_mlp()
        replicated_quant += n_mtp * 2 * h * h
        parts = {"attn_split": attn_split, "kv_proj": kv_proj, "linear_attn": linear_attn,
                 "experts": experts, "tp_dense": tp_dense, "replicated_quant": replicated_quant}
        total = model.total_params(include_mtp=True)
        replicated_bf16 = total - sum(parts.values())
        out = cls(replicated_bf16=replicated_bf16, **parts)
        assert out.quantized == model.quantizable_params(include_mtp=True), (out, model.name)
        return out


# ----------------------------------------------------------------------------------------------------------------
# ParallelPlan
# ----------------------------------------------------------------------------------------------------------------


class ParallelPlan(NoBoolNumbers):
    """Parallelism of one role (prefill or decode) of one deployment replica.

    role:                     "prefill" | "decode".
    tp, dp:                   attention tensor / data parallel degrees; ``tp * dp == len(gpus)``.
    ep:                       expert-parallel degree; divides ``len(gpus)`` and ``n_experts``.
    kv_replication:           copies of each KV head across a TP group; must be ``tp / n_kv_heads`` when
                              ``tp > n_kv_heads`` and 1 otherwise.
    gpus:                     global GPU index of each rank (rank r -> gpus[r]); ``"0-3"`` is accepted.
    weight_format:            format name of the sharded linear weights (``engine.core.formats``).
    kv_dtype:                 "bf16" | "fp8".
    page_tokens:              tokens per KV page.
    max_batch_tokens / max_batch_seqs: per DP group per step; None -> role default (module docstring).
    activation_reserve_bytes: per rank; None -> the formula in the module docstring.
    min_kv_tokens:            KV tokens a rank must be able to hold to "fit"; None -> max_batch_tokens.
    redundant_experts:        extra expert slots (copies of hot experts) over the EP group; ``ep`` divides
                              ``n_experts + redundant_experts`` (module docstring).
    overlap:                  compute / communication overlap of the role's steps: ``none``, ``shared_expert``
                              (single-batch: the shared expert alongside the dispatch) or ``two_batch`` (two
                              micro-batches, one's communication under the other's compute); priced by
                              ``sim.costs.overlap``.
    moe_comm:                 how a DP-EP group moves tokens to its experts and back: ``a2a`` (a sparse
                              all-to-all) or ``allgather`` (all-gather every rank's tokens, reduce-scatter the
                              expert outputs); priced by ``sim.costs.moe_comm``.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    role: Role
    tp: int = Field(1, ge=1)
    ep: int = Field(1, ge=1)
    dp: int = Field(1, ge=1)
    kv_replication: int = Field(1, ge=1)
    gpus: tuple[int, ...]
    weight_format: str = "bf16"
    kv_dtype: Literal["bf16", "fp8"] = "bf16"
    page_tokens: int = Field(64, ge=1)
    max_batch_tokens: int | None = Field(None, ge=1)
    max_batch_seqs: int | None = Field(None, ge=1)
    activation_reserve_bytes: int | None = Field(None, ge=0)
    min_kv_tokens: int | None = Field(None, ge=0)
    redundant_experts: int = Field(0, ge=0)
    overlap: Literal["none", "shared_expert", "two_batch"] = "none"
    moe_comm: Literal["a2a", "allgather"] = "a2a"

    @field_validator("gpus", mode="before")
    @classmethod
    def _parse_gpus(cls, v):
        return parse_gpus(v)

    @field_validator("weight_format")
    @classmethod
    def _known_format(cls, v: str) -> str:
        from rackbed.engine.core.formats import get_format

        get_format(v)  # raises a ValueError naming the unknown format
        return v

    # --- derived axes ---------------------------------------------------------------------------------------

    @property
    def world(self) -> int:
        """Number of ranks (GPUs) of this plan."""
        return len(self.gpus)

    @property
    def expert_tp(self) -> int:
        """How many ways each expert's intermediate dimension is split (``world / ep``)."""
        return max(self.world // self.ep, 1)

    def expert_slots(self, model) -> int:
        """Routed-expert slots over the EP group: the model's experts plus the redundant copies (0 for a dense
        model)."""
        return model.n_experts + self.redundant_experts if model.n_experts else 0

    def slots_per_rank(self, model) -> int:
        """Expert slots one EP rank holds (``expert_slots / ep``)."""
        return self.expert_slots(model) // self.ep

    @property
    def batch_tokens(self) -> int:
        return self.max_batch_tokens or ROLE_DEFAULTS[self.role]["max_batch_tokens"]

    @property
    def batch_seqs(self) -> int:
        return self.max_batch_seqs or ROLE_DEFAULTS[self.role]["max_batch_seqs"]

    @property
    def kv_elem_bytes(self) -> int:
        return KV_DTYPE_BYTES[self.kv_dtype]

    def tp_group(self, g: int) -> tuple[int, ...]:
        """GPU ids of DP group ``g``'s TP group (ranks ``g*tp .. g*tp+tp-1``)."""
        return tuple(self.gpus[g * self.tp:(g + 1) * self.tp])

    def tp_rank(self, rank: int) -> int:
        """Rank ``rank``'s index in its TP group."""
        return rank % self.tp

    def ep_rank(self, rank: int) -> int:
        """Rank ``rank``'s index in the EP group (ranks ``e*expert_tp ..`` share EP rank ``e``)."""
        return rank // self.expert_tp

    def q_heads_of_rank(self, model, rank: int) -> range:
        """Query heads rank ``rank`` computes (its TP rank's contiguous block)."""
        return model.mixer("full").q_heads_of_tp_rank(self.tp, self.tp_rank(rank))

    def kv_heads_of_rank(self, model, rank: int) -> range:
        """KV heads rank ``rank`` holds: those its query heads read (``kv_heads_of_tp_rank``)."""
        return model.mixer("full").kv_heads_of_tp_rank(self.tp, self.tp_rank(rank))

    def kv_heads_of_tp_rank(self, model, tp_rank: int) -> tuple[int, ...]:
        """Global KV head ids TP rank ``tp_rank`` holds: a contiguous block when ``tp <= n_kv_heads``, else head
        ``tp_rank // kv_replication`` (replicated on ``kv_replication`` consecutive ranks)."""
        return model.mixer("full").kv_shards(self.tp)[tp_rank]

    def experts_of_rank(self, model, rank: int) -> range:
        """Routed experts held (whole or split expert_tp ways) by rank ``rank``."""
        per = model.n_experts // self.ep
        e = self.ep_rank(rank)
        return range(e * per, (e + 1) * per)

    def kv_heads_per_rank(self, model) -> int:
        """KV heads each rank holds: ``n_kv_heads / tp``, or 1 (a replica) when ``tp > n_kv_heads``."""
        return model.mixer("full").kv_units_per_rank(self.tp)

    def _kv_token_bytes(self, a, n: int) -> int:
        """Per-token cache bytes of ``n`` layers of kind ``a`` on one rank: its share of the cache units
        (``AttentionKind.kv_units_per_rank``; an MLA latent is one unit, whole on every rank)."""
        return int(n * a.kv_bytes_per_token(self.kv_elem_bytes)) * a.kv_units_per_rank(self.tp) // a.n_kv_units()

    def kv_bytes_per_token_per_rank(self, model) -> int:
        """KV bytes one rank stores per token of a sequence: every layer that keeps the whole sequence (full
        attention, MLA), MTP included; sliding-window layers are ``window_bytes_per_seq_per_rank``."""
        return sum(self._kv_token_bytes(a, n) for a, n in model.attention_counts(include_mtp=True)
                   if a.kv_values_per_token() and not kv_window(a))

    def window_bytes_per_seq_per_rank(self, model) -> int:
        """KV bytes one rank keeps per sequence in sliding-window layers: ``ceil(window / page_tokens) + 1`` pages
        of each (module docstring); 0 without such layers."""
        out = 0
        for a, n in model.attention_counts(include_mtp=True):
            w = kv_window(a)
            if w and a.kv_values_per_token():
                out += (-(-w // self.page_tokens) + 1) * self.page_tokens * self._kv_token_bytes(a, n)
        return out

    def state_bytes_per_seq_per_rank(self, model) -> int:
        """Per-request state (Gated DeltaNet recurrent + conv) one rank keeps per sequence, BF16, split ``tp``
        ways; 0 without such layers."""
        total = sum(n * a.state_bytes_per_seq(2) for a, n in model.attention_counts(include_mtp=True))
        return int(total) // self.tp if total else 0

    # --- validation -------------------------------------------------------------------------------------------

    def check_structure(self, model, topology) -> None:
        """All constraints except memory; raises ``UserError`` (one line) on the first violation."""
        tp, ep, dp, world = self.tp, self.ep, self.dp, self.world
        if world != tp * dp:
            raise UserError(f"gpus lists {world} GPUs but tp*dp = {tp}*{dp} = {tp * dp}")
        dup = sorted({g for g in self.gpus if self.gpus.count(g) > 1})
        if dup:
            raise UserError(f"GPU {dup[0]} is listed twice in gpus")
        missing = [g for g in self.gpus if not 0 <= g < topology.n_gpus]
        if missing:
            raise UserError(f"rank {self.gpus.index(missing[0])} is on GPU {missing[0]}, which does not exist "
                            f"(topology {topology.name} has GPUs 0-{topology.n_gpus - 1})")
        if world % ep:
            raise UserError(f"ep={ep} does not divide the {world} GPUs of the plan (tp*dp)")
        if self.redundant_experts and not model.n_experts:
            raise UserError(f"redundant_experts={self.redundant_experts}: {model.name} has no routed experts")
        if model.n_experts and self.expert_slots(model) % ep:
            if self.redundant_experts:
                raise UserError(f"ep={ep} does not divide {model.n_experts} experts + {self.redundant_experts} "
                                f"redundant = {self.expert_slots(model)} expert slots of {model.name}")
            raise UserError(f"ep={ep} does not divide {model.n_experts} experts of {model.name}"
                            + _redundancy_hint(model.n_experts, ep))
        if model.n_experts and model.moe_intermediate % self.expert_tp:
            raise UserError(f"expert_tp = world/ep = {self.expert_tp} does not divide moe_intermediate "
                            f"{model.moe_intermediate}")
        for mixer in _mixers(model):
            mixer.check_tp(tp, self.kv_replication, model.name)
        for g in range(dp):
            group = self.tp_group(g)
            domain = topology.nvlink_domain(group[0])
            outside = [x for x in group if x not in domain]
            if outside:
                raise UserError(f"TP group {g} (GPUs {_range_text(group)}) crosses an NVLink domain: GPU "
                                f"{outside[0]} is not NVLink-reachable from GPU {group[0]}")
        if self.expert_tp > 1:
            for e in range(ep):
                group = tuple(self.gpus[e * self.expert_tp:(e + 1) * self.expert_tp])
                domain = topology.nvlink_domain(group[0])
                outside = [x for x in group if x not in domain]
                if outside:
                    raise UserError(f"expert-TP group {e} (GPUs {_range_text(group)}) crosses an NVLink "
                                    f"domain: GPU {outside[0]} is not NVLink-reachable from GPU {group[0]}")

    def validate(self, model, topology) -> MemoryBudget:
        """Check every constraint, memory included; return the budget or raise a one-line ``UserError``.

        Named ``validate`` per the interface contract (it shadows pydantic's deprecated ``BaseModel.validate``).
        """
        self.check_structure(model, topology)
        b = self.memory_budget(model, topology)
        if not b.fits:
            raise UserError(
                f"plan does not fit: needs {b.needs_bytes / 1e9:.1f} GB/rank, GPU {b.gpu} has "
                f"{b.hbm_bytes / 1e9:.0f} GB (weights {b.weight_bytes / 1e9:.1f} + activations "
                f"{b.activation_reserve_bytes / 1e9:.1f} + KV for {b.min_kv_tokens} tokens "
                f"{b.min_kv_bytes / 1e9:.1f} GB); shard wider (tp/ep), use a smaller weight_format or "
                f"lower max_batch_tokens")
        return b

    # --- memory -----------------------------------------------------------------------------------------------

    def default_activation_reserve_bytes(self, model) -> int:
        """The activation reserve formula of the module docstring, per rank, bytes."""
        T, S = self.batch_tokens, self.batch_seqs
        h = model.hidden
        attn = ACT_BYTES * T * (3 * h + sum(m.activation_width(self.tp) for m in _mixers(model)))
        moe = 0
        if model.n_experts:
            per_rank = self.slots_per_rank(model)
            rows = self.dp * T * min(model.top_k, per_rank)
            if self.role == "prefill" and self.dp > 1:
                slots = self.expert_slots(model)
                rows = min(rows, math.ceil(NORMAL_MODE_HEADROOM * self.dp * T * model.top_k * per_rank / slots))
            moe = ACT_BYTES * rows * (2 * h + 3 * model.moe_intermediate // self.expert_tp)
        logit_rows = S if self.role == "prefill" else T
        logits = 4 * logit_rows * model.vocab
        return RUNTIME_OVERHEAD_BYTES + attn + moe + logits

    def memory_budget(self, model, topology=None, hbm_bytes: int | None = None) -> MemoryBudget:
        """Per-rank memory: weights by part, activation reserve, KV per token, and the KV capacity left.

        The HBM is that of the smallest GPU the plan uses (``topology``), or ``hbm_bytes`` if given.
        Structural constraints are not checked here (see ``check_structure``); divisions round down.
        """
        from rackbed.engine.core.formats import get_format

        parts = WeightParts.of(model)
        bpe = get_format(self.weight_format).bytes_per_element("weight")
        tp, world = self.tp, self.world
        full = model.mixer("full")
        kv_frac = full.kv_units_per_rank(tp) / full.n_kv_units()
        attention_params = parts.attn_split / tp + parts.kv_proj * kv_frac + parts.linear_attn / tp
        attention_bytes = round(attention_params * bpe)
        slots = self.expert_slots(model)
        expert_bytes = round(parts.experts * (slots / model.n_experts if slots else 1) / world * bpe)
        dense_bytes = round(parts.tp_dense / tp * bpe)
        replicated_bytes = round(parts.replicated_quant * bpe) + parts.replicated_bf16 * REPLICATED_BYTES_PER_PARAM
        if hbm_bytes is None:
            if topology is None:
                raise ValueError("memory_budget needs a topology or hbm_bytes")
            valid = [g for g in self.gpus if 0 <= g < topology.n_gpus] or [0]
            gpu = min(valid, key=lambda g: (topology.gpu_spec(g).hbm_bytes, g))
            hbm_bytes = int(topology.gpu_spec(gpu).hbm_bytes)
        else:
            gpu = self.gpus[0] if self.gpus else 0
        reserve = self.activation_reserve_bytes
        if reserve is None:
            reserve = self.default_activation_reserve_bytes(model)
        kv_tok = self.kv_bytes_per_token_per_rank(model)
        state_seq = self.state_bytes_per_seq_per_rank(model)
        window_seq = self.window_bytes_per_seq_per_rank(model)
        min_kv = self.min_kv_tokens if self.min_kv_tokens is not None else self.batch_tokens
        weights = attention_bytes + expert_bytes + dense_bytes + replicated_bytes
        free = hbm_bytes - weights - reserve - (state_seq + window_seq) * self.batch_seqs
        capacity = max(free, 0) // kv_tok if kv_tok else 0
        capacity -= capacity % self.page_tokens
        return MemoryBudget(
            role=self.role, tp=tp, ep=self.ep, dp=self.dp, kv_replication=self.kv_replication,
            weight_format=self.weight_format, kv_dtype=self.kv_dtype, gpu=gpu,
            attention_weight_bytes=attention_bytes, expert_weight_bytes=expert_bytes,
            dense_weight_bytes=dense_bytes, replicated_weight_bytes=replicated_bytes,
            activation_reserve_bytes=int(reserve), kv_bytes_per_token_per_rank=kv_tok,
            state_bytes_per_seq_per_rank=state_seq, batch_seqs=self.batch_seqs, min_kv_tokens=min_kv,
            hbm_bytes=hbm_bytes, kv_capacity_tokens=int(capacity), redundant_experts=self.redundant_experts,
            window_bytes_per_seq_per_rank=window_seq,
        )


def _redundancy_hint(n_experts: int, ep: int) -> str:
    """The fewest redundant experts that make ``ep`` divide the slots, as a hint for an error message."""
    need = min_redundant_experts(n_experts, ep)
    if not need:
        return ""
    return (f" (redundant_experts: {need} gives {n_experts + need} = {ep} x {(n_experts + need) // ep} expert "
            f"slots)")


def min_redundant_experts(n_experts: int, ep: int) -> int:
    """The fewest redundant experts that make ``ep`` divide the expert slots (0 when it divides the experts or
    the model has none)."""
    return -n_experts % ep if n_experts else 0


def _mixers(model) -> tuple:
    """The model's distinct token-mixer kinds, full attention first (always deployed: MTP layers use it)."""
    return (model.mixer("full"),) + tuple(a for a, _ in model.attention_counts() if a.kind != "full")


@dataclass(frozen=True)
class MemoryBudget:
    """Per-rank memory of a plan, bytes (decimal GB in the text forms)."""

    role: str
    tp: int
    ep: int
    dp: int
    kv_replication: int
    weight_format: str
    kv_dtype: str
    gpu: int  # the GPU the budget was computed for (the plan's smallest)
    attention_weight_bytes: int
    expert_weight_bytes: int
    dense_weight_bytes: int  # shared experts / dense MLP layers (split by tp)
    replicated_weight_bytes: int  # embeddings, lm_head, norms, routers, MTP extras
    activation_reserve_bytes: int
    kv_bytes_per_token_per_rank: int
    state_bytes_per_seq_per_rank: int
    batch_seqs: int
    min_kv_tokens: int
    hbm_bytes: int
    kv_capacity_tokens: int
    redundant_experts: int = 0  # extra expert slots (copies) over the EP group, counted in expert_weight_bytes
    window_bytes_per_seq_per_rank: int = 0  # sliding-window layers' live pages per sequence

    @property
    def weight_bytes(self) -> int:
        return (self.attention_weight_bytes + self.expert_weight_bytes + self.dense_weight_bytes
                + self.replicated_weight_bytes)

    @property
    def min_kv_bytes(self) -> int:
        return self.min_kv_tokens * self.kv_bytes_per_token_per_rank

    @property
    def needs_bytes(self) -> int:
        """Weights + reserve + KV for ``min_kv_tokens`` + linear state and sliding windows for the batch."""
        return (self.weight_bytes + self.activation_reserve_bytes + self.min_kv_bytes
                + (self.state_bytes_per_seq_per_rank + self.window_bytes_per_seq_per_rank) * self.batch_seqs)

    @property
    def fits(self) -> bool:
        return self.needs_bytes <= self.hbm_bytes

    @property
    def kv_capacity_bytes(self) -> int:
        return self.kv_capacity_tokens * self.kv_bytes_per_token_per_rank

    COLUMNS = ("role", "parallel", "formats (w/kv)", "attn GB", "experts GB", "dense GB", "repl. GB",
               "weights GB", "act GB", "KV B/tok", "KV tokens", "HBM GB", "fits")

    def row(self) -> tuple[str, ...]:
        """One table row matching ``COLUMNS`` (GB = 1e9 bytes)."""
        par = f"tp{self.tp} ep{self.ep} dp{self.dp}" + (f" kvrep{self.kv_replication}"
                                                          if self.kv_replication > 1 else "") \
            + (f" +{self.redundant_experts} redundant" if self.redundant_experts else "")
        gb = lambda x: f"{x / 1e9:.1f}"
        return (self.role, par, f"{self.weight_format}/{self.kv_dtype}", gb(self.attention_weight_bytes),
                gb(self.expert_weight_bytes), gb(self.dense_weight_bytes), gb(self.replicated_weight_bytes),
                gb(self.weight_bytes), gb(self.activation_reserve_bytes), f"{self.kv_bytes_per_token_per_rank:,}",
                f"{self.kv_capacity_tokens:,}", f"{self.hbm_bytes / 1e9:.0f}", "yes" if self.fits else "NO")

    def __str__(self) -> str:
        return "  ".join(f"{c}={v}" for c, v in zip(self.COLUMNS, self.row()))


# ----------------------------------------------------------------------------------------------------------------
# Plan files
# ----------------------------------------------------------------------------------------------------------------


class PlanFile(BaseModel):
    """The sharding part of a scenario file: ``topology``, ``model``, ``prefill``, ``decode``.

    ``prefill`` / ``decode`` are ``ParallelPlan`` mappings; their ``role`` is implied by the key. The two roles
    must not share GPUs. ``topology`` is a preset name (``gb200-nvl72``) or a YAML/JSON path (relative paths are
    resolved against the plan file's directory by ``load_plan_file``).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    topology: str
    model: str
    prefill: ParallelPlan | None = None
    decode: ParallelPlan | None = None

    @model_validator(mode="before")
    @classmethod
    def _imply_roles(cls, data):
        if isinstance(data, dict):
            data = dict(data)
            for role in ("prefill", "decode"):
                sec = data.get(role)
                if isinstance(sec, dict):
                    if sec.get("role", role) != role:
                        raise ValueError(f"{role}.role is {sec['role']!r}; it must be {role!r} or omitted")
                    data[role] = {**sec, "role": role}
        return data

    @model_validator(mode="after")
    def _roles(self) -> PlanFile:
        if self.prefill is None and self.decode is None:
            raise ValueError("needs a prefill or a decode section")
        if self.prefill is not None and self.decode is not None:
            shared = sorted(set(self.prefill.gpus) & set(self.decode.gpus))
            if shared:
                raise ValueError(f"prefill and decode share GPUs {_range_text(shared)}")
        return self

    def plans(self) -> list[ParallelPlan]:
        return [p for p in (self.prefill, self.decode) if p is not None]

    def resolve(self, base_dir: str | Path | None = None):
        """(model spec, topology) named by this file."""
        from rackbed import topology as topo_pkg
        from rackbed.engine.core.model import get_model

        topo_name = self.topology
        if base_dir is not None and topo_name.endswith((".yaml", ".yml", ".json")):
            p = Path(topo_name)
            if not p.is_absolute():
                topo_name = str(Path(base_dir) / p)
        return get_model(self.model), topo_pkg.load(topo_name)

    def check(self, base_dir: str | Path | None = None) -> list[MemoryBudget]:
        """Validate every plan; budgets in order prefill, decode. Errors are prefixed with the role."""
        model, topo = self.resolve(base_dir)
        out = []
        for plan in self.plans():
            try:
                out.append(plan.validate(model, topo))
            except UserError as exc:
                raise UserError(f"{plan.role}: {exc}") from None
        return out


def load_plan_file(path: str | Path) -> PlanFile:
    """Read a plan (or scenario) YAML into a ``PlanFile``; other top-level keys are ignored only if the file is a
    scenario (it has a ``plan:`` mapping, which is then used). Errors are one line prefixed with the file name."""
    from rackbed.topology.yamlio import parse_yaml, read_text

    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: no such file")
    data = parse_yaml(read_text(path, "plan file"), path)
    if not isinstance(data, dict):
        raise UserError(f"{path}: expected a mapping with keys topology, model, prefill, decode")
    if isinstance(data.get("plan"), dict):
        data = data["plan"]
    try:
        return PlanFile.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        if err.get("type") == "value_error" and not err.get("loc"):  # a PlanFile-level rule
            raise UserError(f"{path}: {err['ctx']['error']}") from None
        raise from_validation(exc, path) from None


def check_plan_file(path: str | Path) -> tuple[PlanFile, list[MemoryBudget]]:
    """Load and validate a plan file; ``UserError`` messages start with the file name."""
    path = Path(path)
    pf = load_plan_file(path)
    try:
        return pf, pf.check(path.parent)
    except (ValueError, FileNotFoundError) as exc:  # UserError, unknown model / topology, bad topology file
        raise UserError(one_line(exc, path)) from None


__all__ = [
    "KV_DTYPE_BYTES",
    "RUNTIME_OVERHEAD_BYTES",
    "MemoryBudget",
    "ParallelPlan",
    "PlanFile",
    "WeightParts",
    "check_plan_file",
    "kv_window",
    "load_plan_file",
    "min_redundant_experts",
    "parse_gpus",
    "tp_kv_head_shards",
]
