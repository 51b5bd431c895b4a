"""Model architecture specs and the quantities derived from them (parameters, bytes, FLOPs, KV / state sizes).

A ``ModelSpec`` describes a decoder-only MoE transformer of the Qwen3 / Qwen3-Next / Qwen3.5, DeepSeek-V3 / Kimi-K2,
gpt-oss and GLM-4.5 families:

* token mixers per layer (``layer_types``): ``"full"`` = softmax attention with GQA (optionally *gated*:
  q_proj also emits a per-channel sigmoid gate for the output, so it is 2x wide; optionally qk RMSNorm, q/k/v
  and o biases, learned sinks); ``"sliding"`` = the same attending to the latest ``sliding_window`` tokens
  (gpt-oss); ``"mla"`` = multi-head latent attention (DeepSeek-V3, Kimi-K2: ``q_lora_rank``,
  ``kv_lora_rank``, ``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim``; ``n_q_heads`` heads, and
  ``n_kv_heads`` = ``n_q_heads``, ``head_dim`` = qk_nope + qk_rope as the Hugging Face config states them); or
  ``"linear"`` = Gated DeltaNet (in_proj_qkvz: hidden -> 2*Hk*Dk + 2*Hv*Dv, in_proj_ba: hidden -> 2*Hv,
  depthwise causal conv1d of width ``linear_conv`` over the 2*Hk*Dk + Hv*Dv q/k/v channels, A_log and dt_bias
  [Hv], a gated RMSNorm over Dv, out_proj: Hv*Dv -> hidden);
* an MLP per layer: MoE (``n_experts`` SwiGLU experts of width ``moe_intermediate``, ``top_k`` routed, router
  hidden -> n_experts, plus ``n_shared_experts`` always-on SwiGLU experts of width ``shared_intermediate``,
  each with a sigmoid gate hidden -> 1 unless ``shared_expert_gate`` is false: DeepSeek-V3, GLM-4.5), a router
  bias (``router_bias``) and expert biases (``expert_bias``, gpt-oss), or a dense SwiGLU of width ``dense_intermediate`` for layers listed
  in ``dense_layers`` (all layers if ``n_experts == 0``);
* two RMSNorms per layer, a final RMSNorm, embeddings and an lm_head (untied unless ``tie_embeddings``);
* ``n_mtp_layers`` multi-token-prediction modules (Qwen3-Next/3.5 layout: RMSNorm of the embedding and of the
  hidden state, fc: 2*hidden -> hidden, one full-attention decoder layer with the model's MLP, a final
  RMSNorm; embeddings and lm_head shared with the main model).

The fields are the loader's view (presets, HF configs); ``layers`` / ``mixer`` / ``attention_counts`` give the same
model as layer kinds (``engine.core.layers``), which the counts below and every consumer read.

Counting conventions (all documented per method): ``total_params()`` and ``active_params()`` exclude MTP by
default (published model sizes do); ``active_params`` counts embeddings and lm_head (as the published "A22B"
does); ``flops_*`` count 2 FLOPs per multiply-accumulate.

Presets (``get_model``), from the models' Hugging Face ``config.json`` files (``text_config`` for Qwen3.5);
computed totals vs the published names:

=================  ===============  ==============  ======================================================
preset             total (no MTP)   active          note
=================  ===============  ==============  ======================================================
qwen3-235b-a22b    235.09e9         22.19e9         published 235B / 22B
qwen3-30b-a3b      30.53e9          3.35e9          published 30.5B / 3.3B
qwen3.5-397b-a17b  396.35e9         17.35e9         published 397B / 17B: -0.16 %; the published total also
                                                    counts the vision encoder (not modelled, text only);
                                                    with the MTP layer the text model holds 402.94e9
qwen3.5-122b-a10b  122.11e9         9.77e9          published 122B / 10B (active 2.3 % below the name)
deepseek-v3        671.03e9         37.55e9         published 671B / 37B; + the MTP module: 682.64e9 (the
                                                    published 685B also counts the MTP module's own copies
                                                    of embedding and head)
kimi-k2            1026.41e9        32.86e9         published 1T / 32B
gpt-oss-120b       116.83e9         5.71e9          published 116.83B / 5.13B: the published active count
                                                    leaves out the input embedding (0.58e9)
glm-4.5            352.80e9         33.63e9         published 355B / 32B: with the MTP layer 356.79e9;
                                                    active without the input embedding 32.86e9
=================  ===============  ==============  ======================================================
(exact integers are asserted in tests/test_model.py.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_serializer, model_validator

from rackbed.engine.core.formats import get_format
from rackbed.engine.core.layers import (
    DELTANET_FLOPS_PER_STATE_ELEM,
    AttentionKind,
    DenseFfn,
    GdnAttention,
    GqaAttention,
    Layer,
    MlaAttention,
    MoeFfn,
    SlidingWindowAttention,
)
from rackbed.topology.errors import UserError, one_line

LayerKind = Literal["full", "linear", "sliding", "mla"]
Phase = Literal["prefill", "decode"]

SUPPORTED_HF_MODEL_TYPES = ("qwen3_moe", "qwen3_next", "qwen3_5_moe", "deepseek_v3", "kimi_k2", "gpt_oss", "glm4_moe")


class ModelSpec(BaseModel):
    """A decoder-only (MoE) transformer, as far as serving cost is concerned. Sizes are element counts.

    Field names are the ones the sharding, cost and engine code read. Besides the architecture: ``dense_layers``
    (indices of layers whose MLP is dense, from HF ``mlp_only_layers`` / ``decoder_sparse_step``) and ``source``
    (where the numbers come from).

    ``max_context`` is the longest sequence (prompt + output tokens) the model serves, from HF
    ``max_position_embeddings`` (times a ``rope_scaling`` factor when the config enables one; see
    ``_hf_max_context``); None when unknown (no check). It is left out of ``model_dump`` so that every dump
    of a spec -- in run records, sweep keys, output files -- stays as it was before the field existed.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    hidden: int = Field(gt=0)
    n_layers: int = Field(gt=0)
    layer_types: tuple[LayerKind, ...]
    n_q_heads: int = Field(gt=0)
    n_kv_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    qk_norm: bool = True
    gated_attn: bool = False
    linear_n_k_heads: int = Field(default=0, ge=0)
    linear_n_v_heads: int = Field(default=0, ge=0)
    linear_head_dim: int = Field(default=0, ge=0)
    linear_conv: int = Field(default=0, ge=0)
    n_experts: int = Field(default=0, ge=0)
    top_k: int = Field(default=0, ge=0)
    moe_intermediate: int = Field(default=0, ge=0)
    n_shared_experts: int = Field(default=0, ge=0)
    shared_intermediate: int = Field(default=0, ge=0)
    dense_intermediate: int = Field(default=0, ge=0)
    dense_layers: tuple[int, ...] = ()
    vocab: int = Field(gt=0)
    tie_embeddings: bool = False
    n_mtp_layers: int = Field(default=0, ge=0)
    source: str = ""
    max_context: int | None = Field(default=None, gt=0, exclude=True)
    # ---- the families beyond Qwen (left out of dumps at their defaults: see ``_dump``) ----
    attn_qkv_bias: bool = False
    attn_o_bias: bool = False
    attn_sinks: bool = False
    sliding_window: int = Field(default=0, ge=0)
    q_lora_rank: int = Field(default=0, ge=0)
    kv_lora_rank: int = Field(default=0, ge=0)
    qk_nope_head_dim: int = Field(default=0, ge=0)
    qk_rope_head_dim: int = Field(default=0, ge=0)
    v_head_dim: int = Field(default=0, ge=0)
    shared_expert_gate: bool = True
    router_bias: bool = False
    expert_bias: bool = False

    @model_serializer(mode="wrap")
    def _dump(self, handler):
        """Fields added for the DeepSeek / gpt-oss / GLM families are dumped only when they differ from their
        defaults, so every dump of a Qwen spec (run records, sweep keys, output files) stays as it was."""
        out = handler(self)
        for f in _LATE_FIELDS:
            if f in out and out[f] == ModelSpec.model_fields[f].default:
                del out[f]
        return out

    @model_validator(mode="after")
    def _check(self) -> ModelSpec:
        if len(self.layer_types) != self.n_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries but n_layers is "
                             f"{self.n_layers}")
        if self.n_q_heads % self.n_kv_heads:
            raise ValueError(f"n_q_heads ({self.n_q_heads}) must be a multiple of n_kv_heads "
                             f"({self.n_kv_heads})")
        if "linear" in self.layer_types:
            for f in ("linear_n_k_heads", "linear_n_v_heads", "linear_head_dim", "linear_conv"):
                if getattr(self, f) <= 0:
                    raise ValueError(f"{f} must be > 0 when layer_types contains 'linear'")
            if self.linear_n_v_heads % self.linear_n_k_heads:
                raise ValueError(f"linear_n_v_heads ({self.linear_n_v_heads}) must be a multiple of "
                                 f"linear_n_k_heads ({self.linear_n_k_heads})")
        if self.n_experts > 0:
            if not 1 <= self.top_k <= self.n_experts:
                raise ValueError(f"top_k must be in [1, n_experts={self.n_experts}], got {self.top_k}")
            if self.moe_intermediate <= 0:
                raise ValueError("moe_intermediate must be > 0 when n_experts > 0")
        elif self.dense_intermediate <= 0:
            raise ValueError("dense_intermediate must be > 0 when n_experts == 0 (every layer is dense)")
        if list(self.dense_layers) != sorted(set(self.dense_layers)):
            raise ValueError(f"dense_layers must be sorted and unique, got {list(self.dense_layers)}")
        if self.dense_layers:
            if self.dense_layers[0] < 0 or self.dense_layers[-1] >= self.n_layers:
                raise ValueError(f"dense_layers entries must be in [0, {self.n_layers}), "
                                 f"got {list(self.dense_layers)}")
            if self.dense_intermediate <= 0:
                raise ValueError("dense_intermediate must be > 0 when dense_layers is not empty")
        if self.n_shared_experts > 0 and self.shared_intermediate <= 0:
            raise ValueError("shared_intermediate must be > 0 when n_shared_experts > 0")
        if "mla" in self.layer_types:
            for f in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"):
                if getattr(self, f) <= 0:
                    raise ValueError(f"{f} must be > 0 when layer_types contains 'mla'")
        if "sliding" in self.layer_types and self.sliding_window <= 0:
            raise ValueError("sliding_window must be > 0 when layer_types contains 'sliding'")
        return self

    # ---- layer kinds ---------------------------------------------------------------------------------------

    @property
    def kinds(self) -> _Kinds:
        """The layer kinds (``engine.core.layers``) this spec's fields describe, built once per object."""
        hit = _KINDS.get(id(self))
        if hit is not None and hit[0] is self:
            return hit[1]
        out = _Kinds.of(self)
        if len(_KINDS) > 256:
            _KINDS.clear()
        _KINDS[id(self)] = (self, out)
        return out

    @property
    def layers(self) -> tuple[Layer, ...]:
        """Per layer: its token mixer and its FFN kind (MTP layers excluded; see ``mtp_layer``)."""
        return self.kinds.layers

    @property
    def mtp_layer(self) -> Layer:
        """One MTP module's decoder layer: the model's global attention (MLA for DeepSeek-V3, full attention
        otherwise) with the model's MLP (MoE, or dense without experts)."""
        k = self.kinds
        return Layer(attention=k.mtp_attention, ffn=k.moe or k.dense)

    def mixer(self, kind: str) -> AttentionKind | None:
        """The token mixer of layers tagged ``kind`` ("full" | "linear" | "sliding" | "mla"); None if the model
        has none. The full kind always exists (MTP layers of non-MLA models use it)."""
        k = self.kinds
        if kind in ("full", "linear", "sliding", "mla"):
            return getattr(k, kind)
        raise ValueError(f"attention kind must be 'full', 'linear', 'sliding' or 'mla', got {kind!r}")

    def attention_counts(self, include_mtp: bool = False) -> tuple[tuple[AttentionKind, int], ...]:
        """(token-mixer kind, number of layers) per distinct kind, in first-layer order; ``include_mtp`` adds
        the MTP layers to the count of their kind (``mtp_layer``)."""
        counts = self.kinds.counts
        if not (include_mtp and self.n_mtp_layers):
            return counts
        mtp = self.kinds.mtp_attention
        if all(a.kind != mtp.kind for a, _ in counts):
            return (*counts, (mtp, self.n_mtp_layers))
        return tuple((a, n + self.n_mtp_layers if a.kind == mtp.kind else n) for a, n in counts)

    def n_layers_of(self, kind: str) -> int:
        """Main-model layers whose token mixer is ``kind``."""
        return self.layer_types.count(kind)

    def kv_bytes_per_seq(self, context_len: int, elem_bytes: float = 2, include_mtp: bool = False) -> float:
        """Everything one sequence of ``context_len`` tokens keeps over all layers: per-token KV (sliding-window
        layers at most ``sliding_window`` tokens) plus recurrent state (DeltaNet layers, ``elem_bytes`` each)."""
        return sum(n * a.kv_bytes_per_seq(context_len, elem_bytes) for a, n in self.attention_counts(include_mtp))

    # ---- layer structure -----------------------------------------------------------------------------------

    @property
    def n_full_layers(self) -> int:
        return self.layer_types.count("full")

    @property
    def n_linear_layers(self) -> int:
        return self.layer_types.count("linear")

    def is_moe_layer(self, i: int) -> bool:
        """True if layer ``i`` (0-based) has an MoE MLP, False if its MLP is dense."""
        if not 0 <= i < self.n_layers:
            raise ValueError(f"{self.name}: layer index {i} out of range [0, {self.n_layers})")
        return self.n_experts > 0 and i not in self.dense_layers

    @property
    def n_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.n_layers))

    @property
    def n_dense_layers(self) -> int:
        return self.n_layers - self.n_moe_layers

    # ---- parameters (element counts) -----------------------------------------------------------------------

    def _attn_matmul_params(self, kind: LayerKind) -> int:
        """Projection weights of one token mixer (the part that is quantized); 0 for a kind the model lacks."""
        m = self.mixer(kind)
        return m.proj_params() if m is not None else 0

    def _attn_small_params(self, kind: LayerKind) -> int:
        """Non-matmul parameters of one token mixer (kept in bf16): qk norms; conv1d, A_log, dt_bias, norm."""
        m = self.mixer(kind)
        return m.small_params() if m is not None else 0

    @property
    def linear_conv_channels(self) -> int:
        """Channels of the DeltaNet causal conv: q, k and v (2*Hk*Dk + Hv*Dv)."""
        return (2 * self.linear_n_k_heads + self.linear_n_v_heads) * self.linear_head_dim

    def params_attention_proj(self, kind: LayerKind) -> int:
        """Projection (matmul) weights of one token mixer of ``kind``: full = q (+ gate), k, v, o;
        linear = in_proj_qkvz, in_proj_ba, out_proj. ``weight_bytes`` stores these in the deployment
        format."""
        return self._attn_matmul_params(kind)

    def params_attention_layer(self, kind: LayerKind) -> int:
        """Parameters of one token mixer of ``kind`` ("full" | "linear"), norms inside it included, the
        layer's input/post-attention RMSNorms excluded."""
        return self._attn_matmul_params(kind) + self._attn_small_params(kind)

    def params_expert(self) -> int:
        """One routed expert: gate, up (hidden -> moe_intermediate) and down projections (+ biases, gpt-oss)."""
        moe = self.kinds.moe
        return moe.expert_params() if moe is not None else 3 * self.hidden * self.moe_intermediate

    def params_shared_experts(self) -> int:
        """All shared experts of one MoE layer (with their sigmoid gates where the model has them)."""
        moe = self.kinds.moe
        return moe.shared_params() if moe is not None else 0

    def params_router(self) -> int:
        moe = self.kinds.moe
        return moe.router_params() if moe is not None else 0

    def params_moe_layer(self) -> int:
        """One MoE MLP: routed experts + router + shared experts (and their gates)."""
        moe = self.kinds.moe
        return moe.params() if moe is not None else 0

    def params_dense_mlp(self) -> int:
        dense = self.kinds.dense
        return dense.params() if dense is not None else 0

    def params_mtp_layer(self) -> int:
        """One MTP module (Qwen3-Next/3.5 layout; embeddings and lm_head shared, not counted)."""
        h = self.hidden
        mtp = self.mtp_layer
        return 2 * h * h + 3 * h + 2 * h + mtp.attention.params() + mtp.ffn.params()

    def params_breakdown(self, include_mtp: bool = False) -> dict[str, int]:
        """Parameter counts by group; the values sum to ``total_params(include_mtp)``.

        Keys: embedding, lm_head, attn_full_proj, attn_linear_proj, and attn_sliding_proj / attn_mla_proj for
        models with those kinds (quantizable projections), attn_small (qk norms, sinks, biases, conv1d, A_log,
        dt_bias, gated norm, MLA's latent norms), moe_experts (routed, with their biases), moe_shared (shared
        experts incl. gates), router, dense_mlp, norms (layer RMSNorms + final norm), mtp.
        """
        moe = self.n_moe_layers
        out = {
            "embedding": self.vocab * self.hidden,
            "lm_head": 0 if self.tie_embeddings else self.vocab * self.hidden,
            "attn_full_proj": 0,
            "attn_linear_proj": 0,
        }
        small = 0
        for a, n in self.kinds.counts:
            out[f"attn_{a.kind}_proj"] = n * a.proj_params()
            small += n * a.small_params()
        out.update({
            "attn_small": small,
            "moe_experts": moe * self.n_experts * self.params_expert(),
            "moe_shared": moe * self.params_shared_experts(),
            "router": moe * self.params_router(),
            "dense_mlp": self.n_dense_layers * self.params_dense_mlp(),
            "norms": 2 * self.hidden * self.n_layers + self.hidden,
            "mtp": self.n_mtp_layers * self.params_mtp_layer() if include_mtp else 0,
        })
        return out

    def total_params(self, include_mtp: bool = False) -> int:
        """All parameters. MTP modules are excluded unless asked for (published sizes exclude them)."""
        return sum(self.params_breakdown(include_mtp).values())

    def active_params(self, include_mtp: bool = False) -> int:
        """Parameters touched per token: everything except the routed experts not selected (top_k of n_experts
        active). Embedding and lm_head are counted, as in the published "A22B"-style names."""
        b = self.params_breakdown(include_mtp=False)
        routed_active = self.n_moe_layers * self.top_k * self.params_expert()
        n = sum(b.values()) - b["moe_experts"] + routed_active
        if include_mtp and self.n_mtp_layers:
            mtp_inactive = (self.n_experts - self.top_k) * self.params_expert() if self.n_experts else 0
            n += self.n_mtp_layers * (self.params_mtp_layer() - mtp_inactive)
        return n

    def quantizable_params(self, include_mtp: bool = False) -> int:
        """Matmul weights stored in the deployment format: attention / DeltaNet / MLA projections, routed and
        shared experts, dense MLPs (and the MTP module's projections). The rest (embeddings, lm_head, norms,
        router, shared-expert gates, biases, sinks, conv1d, A_log, dt_bias) stays bf16."""
        k = self.kinds
        n = sum(c * a.proj_params() for a, c in k.counts)
        n += self.n_moe_layers * k.moe.quantizable_params() if k.moe is not None else 0
        n += self.n_dense_layers * self.params_dense_mlp()
        if include_mtp and self.n_mtp_layers:
            mtp = self.mtp_layer
            n += self.n_mtp_layers * (2 * self.hidden * self.hidden + mtp.attention.proj_params()
                                      + mtp.ffn.quantizable_params())
        return n

    def weight_bytes(self, fmt: str = "bf16", include_mtp: bool = False) -> float:
        """Bytes of all weights with the matmul weights (``quantizable_params``) in numeric format ``fmt``
        (block scales included, per-tensor scales ignored) and everything else in bf16 (2 B)."""
        bpe = get_format(fmt).bytes_per_element("weight")
        q = self.quantizable_params(include_mtp)
        return q * bpe + (self.total_params(include_mtp) - q) * 2

    # ---- cache sizes ---------------------------------------------------------------------------------------

    def kv_bytes_per_token(self, elem_bytes: float = 2, include_mtp: bool = False) -> float:
        """KV bytes per token over all layers with a per-token cache (each kind's ``kv_bytes_per_token``;
        full attention: n_full * 2 * n_kv_heads * head_dim * elem_bytes, Qwen3-235B bf16: 94 * 2 * 4 * 128 * 2 =
        192,512). ``include_mtp`` adds the MTP layers' KV."""
        return sum(n * a.kv_bytes_per_token(elem_bytes) for a, n in self.attention_counts(include_mtp)
                   if a.kv_values_per_token())

    def linear_state_bytes_per_seq(self, elem_bytes: float = 2,
                                   conv_elem_bytes: float | None = None) -> float:
        """Recurrent state per sequence over all Gated DeltaNet layers (independent of sequence length):
        Hv * Dk * Dv state elements (``elem_bytes`` each; 4 for an fp32 state) plus (linear_conv - 1) *
        conv channels of conv state (``conv_elem_bytes``, default ``elem_bytes``)."""
        lin = self.kinds.linear
        if lin is None:
            return 0
        return self.n_linear_layers * lin.state_bytes_per_seq(elem_bytes, conv_elem_bytes)

    # ---- FLOPs ---------------------------------------------------------------------------------------------

    def flops_breakdown(self, phase: Phase, context_len: int, prefix_len: int = 0) -> dict[str, float]:
        """FLOPs per token by part (2 FLOPs per multiply-add), averaged over the tokens of the step.

        phase="decode": one new token attending to ``context_len`` tokens (cache + itself).
        phase="prefill": a prompt (chunk) of ``context_len`` tokens after ``prefix_len`` cached tokens;
        attention uses the average causal context ``prefix_len + (context_len + 1) / 2``; logits are computed
        for the last token only, so lm_head is divided by ``context_len``.

        Keys: attn_proj (2 x softmax-attention projections: full, sliding, MLA), attn_core (full: 4 * n_q_heads *
        head_dim * ctx per layer, QK^T and PV; sliding: the context capped at the window; MLA: expanded in
        prefill, absorbed in decode, ``MlaAttention``), linear_proj (2 x DeltaNet projections), linear_core (DeltaNet state update,
        ``DELTANET_FLOPS_PER_STATE_ELEM`` * Hv * Dk * Dv, plus 2 * conv * channels), moe_experts (2 x top_k
        routed experts), moe_shared, router (incl. shared-expert gates), dense_mlp, lm_head. MTP is not
        included.
        """
        if phase not in ("prefill", "decode"):
            raise ValueError(f"phase must be 'prefill' or 'decode', got {phase!r}")
        if int(context_len) != context_len or context_len < 1:
            raise ValueError(f"context_len must be an integer >= 1, got {context_len!r}")
        if int(prefix_len) != prefix_len or prefix_len < 0:
            raise ValueError(f"prefix_len must be an integer >= 0, got {prefix_len!r}")
        if phase == "decode" and prefix_len:
            raise ValueError("prefix_len applies to prefill only (decode: pass the whole context as "
                             "context_len)")
        ctx = context_len if phase == "decode" else prefix_len + (context_len + 1) / 2
        moe = self.n_moe_layers
        proj = core = lin_proj = lin_core = 0.0
        for a, n in self.kinds.counts:
            if a.kind == "linear":
                lin_proj, lin_core = 2.0 * n * a.proj_params(), float(n * a.model_core_flops_per_token())
                continue
            proj += 2.0 * n * a.proj_params()
            if a.kind == "full":
                core += n * a.core_flops_per_pair() * ctx
            elif phase == "decode":
                core += n * a.decode_core_flops(a.kv_tokens(context_len))
            else:
                core += n * a.prefill_core_flops(context_len, prefix_len) / context_len
        m = self.kinds.moe
        out = {
            "attn_proj": proj,
            "attn_core": core,
            "linear_proj": lin_proj,
            "linear_core": lin_core,
            "moe_experts": 2.0 * moe * self.top_k * self.params_expert(),
            "moe_shared": 2.0 * moe * (m.shared_params() - m.shared_gate_params()) if m is not None else 0.0,
            "router": 2.0 * moe * (m.router_params() + m.shared_gate_params()) if m is not None else 0.0,
            "dense_mlp": 2.0 * self.n_dense_layers * self.params_dense_mlp(),
            "lm_head": 2.0 * self.vocab * self.hidden / (context_len if phase == "prefill" else 1),
        }
        return out

    def flops_per_token(self, phase: Phase, context_len: int, prefix_len: int = 0) -> float:
        """Total of ``flops_breakdown`` (FLOPs per token)."""
        return sum(self.flops_breakdown(phase, context_len, prefix_len).values())

    # ---- construction from Hugging Face configs ------------------------------------------------------------

    @classmethod
    def from_hf_config(cls, path: str | Path, name: str | None = None) -> ModelSpec:
        """Read a Hugging Face ``config.json`` (``SUPPORTED_HF_MODEL_TYPES``; Qwen3.5 keeps the text model
        under ``text_config``) through ``model_hf.read_hf_config``. Defaults for absent keys are those of
        transformers' config classes (``save_pretrained`` omits keys equal to them); bad values, unsupported
        features and other model types raise a one-line ValueError naming the file and key. ``name`` defaults
        to the directory holding config.json (the file stem otherwise)."""
        path = Path(path)
        from rackbed.topology.yamlio import parse_json, read_text

        raw = parse_json(read_text(path, "config.json"), path)
        if not isinstance(raw, dict):
            raise UserError(f"{path}: expected a JSON object")
        from rackbed.engine.core.model_hf import read_hf_config

        hf = read_hf_config(raw, path)
        k_dim, v_dim = hf.spec.get("linear_head_dim", 0), hf.linear_value_head_dim
        if k_dim != v_dim:
            raise UserError(f"{path}: linear_key_head_dim ({k_dim}) != linear_value_head_dim ({v_dim}) "
                            "is not supported")
        if name is None:
            name = path.parent.name if path.name == "config.json" and path.parent.name else path.stem
        return cls.from_hf_model(hf, name, path)

    @classmethod
    def from_hf_model(cls, hf, name: str, path: str | Path) -> ModelSpec:
        """The ModelSpec of a config read by ``model_hf.read_hf_config`` (``path`` names it in errors)."""
        mtype, spec_kwargs = hf.model_type, hf.spec
        try:
            return cls(name=name, source=f"{path} (model_type {mtype})", **spec_kwargs)
        except ValidationError as exc:
            raise UserError(one_line(exc, path)) from None


_KINDS: dict[int, tuple[ModelSpec, _Kinds]] = {}


class _Kinds:
    """The distinct kinds of a ``ModelSpec`` (layers of one kind share one object) and the per-layer list."""

    __slots__ = ("counts", "dense", "full", "layers", "linear", "mla", "moe", "sliding")

    def __init__(self, mixers: dict[str, AttentionKind | None], moe: MoeFfn | None, dense: DenseFfn | None,
                 layers: tuple[Layer, ...]) -> None:
        self.full, self.linear = mixers["full"], mixers["linear"]
        self.sliding, self.mla = mixers["sliding"], mixers["mla"]
        self.moe, self.dense, self.layers = moe, dense, layers
        counts: dict[str, list] = {}
        for layer in layers:
            counts.setdefault(layer.attention.kind, [layer.attention, 0])[1] += 1
        self.counts = tuple((a, n) for a, n in counts.values())

    @property
    def mtp_attention(self) -> AttentionKind:
        """The token mixer of an MTP module's layer: MLA in an MLA model, full attention otherwise."""
        return self.mla if self.mla is not None else self.full

    @classmethod
    def of(cls, m: ModelSpec) -> _Kinds:
        gqa = dict(hidden=m.hidden, n_q_heads=m.n_q_heads, n_kv_heads=m.n_kv_heads, head_dim=m.head_dim,
                   qk_norm=m.qk_norm, gated=m.gated_attn, qkv_bias=m.attn_qkv_bias, o_bias=m.attn_o_bias,
                   learned_sinks=m.attn_sinks)
        types = set(m.layer_types)
        mixers: dict[str, AttentionKind | None] = {
            "full": GqaAttention(**gqa),
            "linear": GdnAttention(hidden=m.hidden, n_k_heads=m.linear_n_k_heads, n_v_heads=m.linear_n_v_heads,
                                   head_dim=m.linear_head_dim, conv=m.linear_conv) if "linear" in types else None,
            "sliding": SlidingWindowAttention(**gqa, window=m.sliding_window) if "sliding" in types else None,
            "mla": MlaAttention(hidden=m.hidden, n_heads=m.n_q_heads, q_lora_rank=m.q_lora_rank,
                                kv_lora_rank=m.kv_lora_rank, qk_nope_head_dim=m.qk_nope_head_dim,
                                qk_rope_head_dim=m.qk_rope_head_dim, v_head_dim=m.v_head_dim)
            if "mla" in types else None,
        }
        moe = MoeFfn(hidden=m.hidden, n_experts=m.n_experts, top_k=m.top_k, intermediate=m.moe_intermediate,
                     n_shared=m.n_shared_experts, shared_intermediate=m.shared_intermediate,
                     shared_gate=m.shared_expert_gate, router_bias=m.router_bias,
                     expert_bias=m.expert_bias) if m.n_experts else None
        dense = DenseFfn(hidden=m.hidden, intermediate=m.dense_intermediate) if m.dense_intermediate else None
        pairs: dict[tuple[str, bool], Layer] = {}
        layers = []
        for i, t in enumerate(m.layer_types):
            is_moe = m.is_moe_layer(i)
            key = (t, is_moe)
            if key not in pairs:
                pairs[key] = Layer(attention=mixers[t], ffn=moe if is_moe else dense)
            layers.append(pairs[key])
        return cls(mixers, moe, dense, tuple(layers))


#: fields ``ModelSpec._dump`` leaves out at their defaults
_LATE_FIELDS = ("attn_qkv_bias", "attn_o_bias", "attn_sinks", "sliding_window", "q_lora_rank", "kv_lora_rank",
                "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "shared_expert_gate", "router_bias",
                "expert_bias")


# ------------------------------------------------------------------------------------------------------------
# Presets
# ------------------------------------------------------------------------------------------------------------


def _hybrid(n_layers: int, interval: int = 4) -> tuple[LayerKind, ...]:
    """(interval - 1) Gated DeltaNet layers then one gated-attention layer, repeated."""
    return tuple("linear" if (i + 1) % interval else "full" for i in range(n_layers))


_PRESETS: dict[str, ModelSpec] = {
    "qwen3-235b-a22b": ModelSpec(
        name="qwen3-235b-a22b", hidden=4096, n_layers=94, layer_types=("full",) * 94,
        n_q_heads=64, n_kv_heads=4, head_dim=128, qk_norm=True, gated_attn=False,
        n_experts=128, top_k=8, moe_intermediate=1536, vocab=151936, tie_embeddings=False,
        max_context=40960,  # max_position_embeddings; 131,072 with YaRN (rope_scaling factor 4 on 32,768)
        source="Qwen/Qwen3-235B-A22B config.json",
    ),
    "qwen3-30b-a3b": ModelSpec(
        name="qwen3-30b-a3b", hidden=2048, n_layers=48, layer_types=("full",) * 48,
        n_q_heads=32, n_kv_heads=4, head_dim=128, qk_norm=True, gated_attn=False,
        n_experts=128, top_k=8, moe_intermediate=768, vocab=151936, tie_embeddings=False,
        max_context=40960,  # max_position_embeddings; 131,072 with YaRN (rope_scaling factor 4 on 32,768)
        source="Qwen/Qwen3-30B-A3B config.json",
    ),
    "qwen3.5-397b-a17b": ModelSpec(
        name="qwen3.5-397b-a17b", hidden=4096, n_layers=60, layer_types=_hybrid(60),
        n_q_heads=32, n_kv_heads=2, head_dim=256, qk_norm=True, gated_attn=True,
        linear_n_k_heads=16, linear_n_v_heads=64, linear_head_dim=128, linear_conv=4,
        n_experts=512, top_k=10, moe_intermediate=1024, n_shared_experts=1, shared_intermediate=1024,
        vocab=248320, tie_embeddings=False, n_mtp_layers=1,
        max_context=262144,  # text_config max_position_embeddings (the card: up to ~1M with YaRN)
        source="Qwen/Qwen3.5-397B-A17B config.json (text_config)",
    ),
    "qwen3.5-122b-a10b": ModelSpec(
        name="qwen3.5-122b-a10b", hidden=3072, n_layers=48, layer_types=_hybrid(48),
        n_q_heads=32, n_kv_heads=2, head_dim=256, qk_norm=True, gated_attn=True,
        linear_n_k_heads=16, linear_n_v_heads=64, linear_head_dim=128, linear_conv=4,
        n_experts=256, top_k=8, moe_intermediate=1024, n_shared_experts=1, shared_intermediate=1024,
        vocab=248320, tie_embeddings=False, n_mtp_layers=1,
        max_context=262144,  # the Qwen3.5 family's text_config max_position_embeddings; not re-checked for this size
        source="Qwen/Qwen3.5-122B-A10B config.json (text_config)",
    ),
    "deepseek-v3": ModelSpec(
        name="deepseek-v3", hidden=7168, n_layers=61, layer_types=("mla",) * 61,
        n_q_heads=128, n_kv_heads=128, head_dim=192, qk_norm=False,
        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        n_experts=256, top_k=8, moe_intermediate=2048, n_shared_experts=1, shared_intermediate=2048,
        shared_expert_gate=False, router_bias=True, dense_layers=(0, 1, 2), dense_intermediate=18432,
        vocab=129280, tie_embeddings=False, n_mtp_layers=1,
        max_context=163840,  # YaRN factor 40 on 4,096 (= max_position_embeddings)
        source="deepseek-ai/DeepSeek-V3 config.json (DeepSeek-R1 has the same architecture)",
    ),
    "kimi-k2": ModelSpec(
        name="kimi-k2", hidden=7168, n_layers=61, layer_types=("mla",) * 61,
        n_q_heads=64, n_kv_heads=64, head_dim=192, qk_norm=False,
        q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        n_experts=384, top_k=8, moe_intermediate=2048, n_shared_experts=1, shared_intermediate=2048,
        shared_expert_gate=False, router_bias=True, dense_layers=(0,), dense_intermediate=18432,
        vocab=163840, tie_embeddings=False, n_mtp_layers=0,
        max_context=131072,  # YaRN factor 32 on 4,096
        source="moonshotai/Kimi-K2-Instruct config.json (model_type kimi_k2, DeepseekV3ForCausalLM)",
    ),
    "gpt-oss-120b": ModelSpec(
        name="gpt-oss-120b", hidden=2880, n_layers=36, layer_types=("sliding", "full") * 18,
        n_q_heads=64, n_kv_heads=8, head_dim=64, qk_norm=False, attn_qkv_bias=True, attn_o_bias=True,
        attn_sinks=True, sliding_window=128,
        n_experts=128, top_k=4, moe_intermediate=2880, router_bias=True, expert_bias=True,
        vocab=201088, tie_embeddings=False,
        max_context=131072,  # YaRN factor 32 on 4,096
        source="openai/gpt-oss-120b config.json (experts published in MXFP4)",
    ),
    "glm-4.5": ModelSpec(
        name="glm-4.5", hidden=5120, n_layers=92, layer_types=("full",) * 92,
        n_q_heads=96, n_kv_heads=8, head_dim=128, qk_norm=True, attn_qkv_bias=True,
        n_experts=160, top_k=8, moe_intermediate=1536, n_shared_experts=1, shared_intermediate=1536,
        shared_expert_gate=False, router_bias=True, dense_layers=(0, 1, 2), dense_intermediate=12288,
        vocab=151552, tie_embeddings=False, n_mtp_layers=1,
        max_context=131072,
        source="zai-org/GLM-4.5 config.json",
    ),
}

# DeepSeek-R1 is DeepSeek-V3's architecture (the same config.json but for the checkpoint's weights)
_PRESETS["deepseek-r1"] = _PRESETS["deepseek-v3"].model_copy(
    update={"name": "deepseek-r1", "source": "deepseek-ai/DeepSeek-R1 config.json (DeepSeek-V3's architecture)"})

PRESET_NAMES: tuple[str, ...] = tuple(_PRESETS)

#: what each preset's publisher states (total, active parameters, and how its counting differs from ours), for
#: ``rackbed model show`` and the tests that hold the computed counts to them
PUBLISHED_SIZES: dict[str, tuple[float, float, str]] = {
    "qwen3-235b-a22b": (235e9, 22e9, "model card"),
    "qwen3-30b-a3b": (30.5e9, 3.3e9, "model card"),
    "qwen3.5-397b-a17b": (397e9, 17e9, "model card; the total also counts the vision encoder (not modelled)"),
    "qwen3.5-122b-a10b": (122e9, 10e9, "model name"),
    "deepseek-v3": (671e9, 37e9, "technical report; 685B with the MTP module and its own embedding/head copies"),
    "deepseek-r1": (671e9, 37e9, "model card; 685B with the MTP module and its own embedding/head copies"),
    "kimi-k2": (1e12, 32e9, "model card: 1 trillion (a rounded figure) / 32B"),
    "gpt-oss-120b": (116.83e9, 5.13e9, "model card; its active count leaves out the input embedding (0.58B)"),
    "glm-4.5": (355e9, 32e9, "model card; the total includes the MTP layer, active leaves out the embedding"),
}


def get_model(name: str) -> ModelSpec:
    """A preset (``PRESET_NAMES``) by name, or a Hugging Face config.json by path (anything ending in .json or
    naming an existing file)."""
    if name in _PRESETS:
        return _PRESETS[name]
    p = Path(name)
    if name.endswith(".json") or p.is_file():
        if not p.exists():
            raise FileNotFoundError(f"{name}: no such file")
        return ModelSpec.from_hf_config(p)
    if p.is_dir() and (p / "config.json").is_file():
        return ModelSpec.from_hf_config(p / "config.json")
    raise UserError(f"unknown model {name!r}; presets: {', '.join(PRESET_NAMES)} "
                    "(or a path to a config.json)")


__all__ = ["DELTANET_FLOPS_PER_STATE_ELEM", "PRESET_NAMES", "PUBLISHED_SIZES", "SUPPORTED_HF_MODEL_TYPES", "LayerKind",
           "ModelSpec", "Phase", "get_model"]
