"""Model architecture specs and the quantities derived from them (parameters, bytes, FLOPs, KV / state sizes).

A ``ModelSpec`` describes a decoder-only MoE transformer of the Qwen3 / Qwen3-Next / Qwen3.5 families:

* token mixers per layer (``layer_types``): ``"full"`` = softmax attention with GQA (optionally *gated*:
  q_proj also emits a per-channel sigmoid gate for the output, so it is 2x wide; optionally qk RMSNorm), or
  ``"linear"`` = Gated DeltaNet (in_proj_qkvz: hidden -> 2*Hk*Dk + 2*Hv*Dv, in_proj_ba: hidden -> 2*Hv,
  depthwise causal conv1d of width ``linear_conv`` over the 2*Hk*Dk + Hv*Dv q/k/v channels, A_log and dt_bias
  [Hv], a gated RMSNorm over Dv, out_proj: Hv*Dv -> hidden);
* an MLP per layer: MoE (``n_experts`` SwiGLU experts of width ``moe_intermediate``, ``top_k`` routed, router
  hidden -> n_experts, plus ``n_shared_experts`` always-on SwiGLU experts of width ``shared_intermediate``,
  each with a sigmoid gate hidden -> 1), or a dense SwiGLU of width ``dense_intermediate`` for layers listed
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
=================  ===============  ==============  ======================================================
(exact integers are asserted in tests/test_model.py.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from rackbed.engine.core.formats import get_format
from rackbed.engine.core.layers import (
    DELTANET_FLOPS_PER_STATE_ELEM,
    AttentionKind,
    DenseFfn,
    GdnAttention,
    GqaAttention,
    Layer,
    MoeFfn,
)
from rackbed.topology.errors import UserError, one_line

LayerKind = Literal["full", "linear"]
Phase = Literal["prefill", "decode"]

SUPPORTED_HF_MODEL_TYPES = ("qwen3_moe", "qwen3_next", "qwen3_5_moe")


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
        """One MTP module's decoder layer: full attention with the model's MLP (MoE, or dense without experts)."""
        k = self.kinds
        return Layer(attention=k.full, ffn=k.moe or k.dense)

    def mixer(self, kind: str) -> AttentionKind | None:
        """The token mixer of layers tagged ``kind`` ("full" | "linear"); None if the model has none. The full
        kind always exists (MTP layers use it)."""
        if kind == "full":
            return self.kinds.full
        if kind == "linear":
            return self.kinds.linear
        raise ValueError(f"attention kind must be 'full' or 'linear', got {kind!r}")

    def attention_counts(self, include_mtp: bool = False) -> tuple[tuple[AttentionKind, int], ...]:
        """(token-mixer kind, number of layers) per distinct kind, in first-layer order; ``include_mtp`` adds
        the MTP layers to the full-attention count."""
        counts = self.kinds.counts
        if not (include_mtp and self.n_mtp_layers):
            return counts
        if all(a.kind != "full" for a, _ in counts):
            return (*counts, (self.kinds.full, self.n_mtp_layers))
        return tuple((a, n + self.n_mtp_layers if a.kind == "full" else n) for a, n in counts)

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
        """One routed SwiGLU expert: gate, up (hidden -> moe_intermediate) and down projections."""
        return 3 * self.hidden * self.moe_intermediate

    def params_shared_experts(self) -> int:
        """All shared experts of one MoE layer, each with its sigmoid gate (hidden -> 1)."""
        moe = self.kinds.moe
        return moe.shared_params() if moe is not None else 0

    def params_router(self) -> int:
        return self.n_experts * self.hidden

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

        Keys: embedding, lm_head, attn_full_proj, attn_linear_proj (quantizable projections), attn_small (qk
        norms, conv1d, A_log, dt_bias, gated norm), moe_experts (routed), moe_shared (shared experts incl.
        gates), router, dense_mlp, norms (layer RMSNorms + final norm), mtp.
        """
        moe = self.n_moe_layers
        out = {
            "embedding": self.vocab * self.hidden,
            "lm_head": 0 if self.tie_embeddings else self.vocab * self.hidden,
            "attn_full_proj": self.n_full_layers * self._attn_matmul_params("full"),
            "attn_linear_proj": self.n_linear_layers * self._attn_matmul_params("linear")
            if self.n_linear_layers else 0,
            "attn_small": self.n_full_layers * self._attn_small_params("full")
            + (self.n_linear_layers * self._attn_small_params("linear") if self.n_linear_layers else 0),
            "moe_experts": moe * self.n_experts * self.params_expert(),
            "moe_shared": moe * self.params_shared_experts(),
            "router": moe * self.params_router(),
            "dense_mlp": self.n_dense_layers * self.params_dense_mlp(),
            "norms": 2 * self.hidden * self.n_layers + self.hidden,
            "mtp": self.n_mtp_layers * self.params_mtp_layer() if include_mtp else 0,
        }
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
        """Matmul weights stored in the deployment format: attention / DeltaNet projections, routed and shared
        experts, dense MLPs (and the MTP module's projections). The rest (embeddings, lm_head, norms, router,
        shared-expert gates, conv1d, A_log, dt_bias) stays bf16."""
        b = self.params_breakdown(include_mtp=False)
        n = b["attn_full_proj"] + b["attn_linear_proj"] + b["moe_experts"] + b["dense_mlp"]
        n += b["moe_shared"] - self.n_moe_layers * self.n_shared_experts * self.hidden  # minus sigmoid gates
        if include_mtp and self.n_mtp_layers:
            mlp = (self.n_experts * self.params_expert() + self.params_shared_experts()
                   - self.n_shared_experts * self.hidden) if self.n_experts else self.params_dense_mlp()
            n += self.n_mtp_layers * (2 * self.hidden * self.hidden + self._attn_matmul_params("full") + mlp)
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

        Keys: attn_proj (2 x full-attention projections), attn_core (4 * n_q_heads * head_dim * ctx per full
        layer: QK^T and PV), linear_proj (2 x DeltaNet projections), linear_core (DeltaNet state update,
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
        lin = self.n_linear_layers
        full, linear = self.kinds.full, self.kinds.linear
        out = {
            "attn_proj": 2.0 * self.n_full_layers * full.proj_params(),
            "attn_core": self.n_full_layers * full.core_flops_per_pair() * ctx,
            "linear_proj": 2.0 * lin * linear.proj_params() if lin else 0.0,
            "linear_core": float(lin * linear.model_core_flops_per_token()) if lin else 0.0,
            "moe_experts": 2.0 * moe * self.top_k * self.params_expert(),
            "moe_shared": 2.0 * moe * (self.params_shared_experts() - self.n_shared_experts * self.hidden),
            "router": 2.0 * moe * (self.params_router() + self.n_shared_experts * self.hidden),
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
        """Read a Hugging Face ``config.json`` (model_type qwen3_moe, qwen3_next or qwen3_5_moe; Qwen3.5
        keeps the text model under ``text_config``). Defaults for absent keys are those of transformers'
        config classes (``save_pretrained`` omits keys equal to them); bad values, unsupported features and
        other model types raise a one-line ValueError naming the file and key. ``name`` defaults to the
        directory holding config.json (the file stem otherwise)."""
        path = Path(path)
        from rackbed.topology.yamlio import parse_json, read_text

        raw = parse_json(read_text(path, "config.json"), path)
        if not isinstance(raw, dict):
            raise UserError(f"{path}: expected a JSON object")
        cfg = raw
        mtype = raw.get("model_type")
        if mtype == "qwen3_5_moe" and isinstance(raw.get("text_config"), dict):
            cfg = {**raw["text_config"]}
            cfg.setdefault("tie_word_embeddings", raw.get("tie_word_embeddings", False))
        elif mtype == "qwen3_5_moe_text":
            mtype = "qwen3_5_moe"
        if mtype not in SUPPORTED_HF_MODEL_TYPES:
            raise UserError(f"{path}: model_type {mtype!r} is not supported; supported: "
                            f"{', '.join(SUPPORTED_HF_MODEL_TYPES)}")
        if name is None:
            name = path.parent.name if path.name == "config.json" and path.parent.name else path.stem
        spec_kwargs = _hf_to_spec_kwargs(cfg, mtype, path)
        try:
            return cls(name=name, source=f"{path} (model_type {mtype})", **spec_kwargs)
        except ValidationError as exc:
            raise UserError(one_line(exc, path)) from None


_KINDS: dict[int, tuple[ModelSpec, _Kinds]] = {}


class _Kinds:
    """The distinct kinds of a ``ModelSpec`` (layers of one kind share one object) and the per-layer list."""

    __slots__ = ("counts", "dense", "full", "layers", "linear", "moe")

    def __init__(self, full: GqaAttention, linear: GdnAttention | None, moe: MoeFfn | None,
                 dense: DenseFfn | None, layers: tuple[Layer, ...]) -> None:
        self.full, self.linear, self.moe, self.dense, self.layers = full, linear, moe, dense, layers
        counts: dict[str, list] = {}
        for layer in layers:
            counts.setdefault(layer.attention.kind, [layer.attention, 0])[1] += 1
        self.counts = tuple((a, n) for a, n in counts.values())

    @classmethod
    def of(cls, m: ModelSpec) -> _Kinds:
        full = GqaAttention(hidden=m.hidden, n_q_heads=m.n_q_heads, n_kv_heads=m.n_kv_heads, head_dim=m.head_dim,
                            qk_norm=m.qk_norm, gated=m.gated_attn)
        linear = GdnAttention(hidden=m.hidden, n_k_heads=m.linear_n_k_heads, n_v_heads=m.linear_n_v_heads,
                              head_dim=m.linear_head_dim, conv=m.linear_conv) if m.n_linear_layers else None
        moe = MoeFfn(hidden=m.hidden, n_experts=m.n_experts, top_k=m.top_k, intermediate=m.moe_intermediate,
                     n_shared=m.n_shared_experts, shared_intermediate=m.shared_intermediate) if m.n_experts else None
        dense = DenseFfn(hidden=m.hidden, intermediate=m.dense_intermediate) if m.dense_intermediate else None
        mixers = {"full": full, "linear": linear}
        pairs: dict[tuple[str, bool], Layer] = {}
        layers = []
        for i, t in enumerate(m.layer_types):
            is_moe = m.is_moe_layer(i)
            key = (t, is_moe)
            if key not in pairs:
                pairs[key] = Layer(attention=mixers[t], ffn=moe if is_moe else dense)
            layers.append(pairs[key])
        return cls(full, linear, moe, dense, tuple(layers))


# Defaults of transformers' config classes (transformers 5.x configuration_qwen3_moe.py,
# configuration_qwen3_next.py,
# configuration_qwen3_5_moe.py: Qwen3_5MoeTextConfig). config.json files written by ``save_pretrained``
# omit keys equal to these, so a reader must know them. head_dim None: hidden_size // num_attention_heads.
_HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen3_moe": dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=24,
        num_attention_heads=32, num_key_value_heads=4, head_dim=None, tie_word_embeddings=False,
        attention_bias=False,
        decoder_sparse_step=1, moe_intermediate_size=768, num_experts_per_tok=8, num_experts=128,
        mlp_only_layers=[],
        max_position_embeddings=32768,
    ),
    "qwen3_next": dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=5632, num_hidden_layers=48,
        num_attention_heads=16, num_key_value_heads=2, head_dim=256, tie_word_embeddings=False,
        attention_bias=False,
        linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_num_key_heads=16, linear_num_value_heads=32, decoder_sparse_step=1, moe_intermediate_size=512,
        shared_expert_intermediate_size=512, num_experts_per_tok=10, num_experts=512, mlp_only_layers=[],
        full_attention_interval=4, mtp_num_hidden_layers=0,
        max_position_embeddings=32768,
    ),
    "qwen3_5_moe": dict(
        vocab_size=248320, hidden_size=2048, num_hidden_layers=40, num_attention_heads=16,
        num_key_value_heads=2, head_dim=256, tie_word_embeddings=False, attention_bias=False,
        linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
        linear_num_value_heads=32, moe_intermediate_size=512, shared_expert_intermediate_size=512,
        num_experts_per_tok=8, num_experts=256, full_attention_interval=4, mtp_num_hidden_layers=0,
        max_position_embeddings=32768,
    ),
}


# Other spellings of a key (transformers' ``attribute_map``: Qwen3MoeConfig stores num_experts as
# num_local_experts).
_HF_ALIASES = {"num_experts": "num_local_experts"}


#: upper bounds on config.json integers: per-layer tables are built from them, so ``num_hidden_layers: 1000000000``
#: would run for minutes into a MemoryError; the bounds are far beyond any published model (Qwen3-235B: 94 layers,
#: 128 experts, vocab 151,936, hidden 4,096)
_HF_BOUNDS = {"num_hidden_layers": 10_000, "mtp_num_hidden_layers": 10_000, "num_experts": 65_536,
              "num_local_experts": 65_536, "num_experts_per_tok": 65_536, "full_attention_interval": 10_000,
              "decoder_sparse_step": 10_000}
_HF_BOUND = 1 << 24  # any other size (vocab, hidden, intermediate, heads, head_dim)


#: RoPE scalings whose ``factor`` stretches the context past ``max_position_embeddings`` (as vLLM derives a model's
#: length); other types (``default``, ``mrope``, and ``longrope`` / ``llama3``, whose configs already state the
#: stretched length) leave it as it is
_ROPE_STRETCH = ("yarn", "linear", "dynamic")


def _hf_max_context(cfg: dict[str, Any], max_pos: int, path: Path) -> int:
    """The longest sequence a config serves: ``max_position_embeddings``, or, when ``rope_scaling`` (transformers
    5: ``rope_parameters``) names a stretching type with a ``factor``, the base times the factor -- for YaRN the
    base is ``original_max_position_embeddings`` when given (Qwen3 with YaRN enabled: ``{rope_type: yarn,
    factor: 4.0, original_max_position_embeddings: 32768}`` -> 131,072; without it: 40,960). vLLM derives its
    ``max_model_len`` the same way."""
    key = "rope_scaling" if isinstance(cfg.get("rope_scaling"), dict) else "rope_parameters"
    rope = cfg.get(key)
    kind = rope.get("rope_type", rope.get("type")) if isinstance(rope, dict) else None
    if kind not in _ROPE_STRETCH or rope.get("factor") is None:
        return max_pos
    factor = rope["factor"]
    if isinstance(factor, bool) or not isinstance(factor, int | float) or not 1 <= factor <= 1024:
        raise UserError(f"{path}: {key}.factor must be a number in [1, 1024], got {factor!r}")
    base = max_pos
    if kind == "yarn" and rope.get("original_max_position_embeddings") is not None:
        base = rope["original_max_position_embeddings"]
        if isinstance(base, bool) or not isinstance(base, int) or not 0 < base <= _HF_BOUND:
            raise UserError(f"{path}: {key}.original_max_position_embeddings must be a positive integer, "
                            f"got {base!r}")
    return int(base * factor)


def _hf_to_spec_kwargs(cfg: dict[str, Any], mtype: str, path: Path) -> dict[str, Any]:
    """Map HF config keys onto ModelSpec fields (see ``ModelSpec.from_hf_config``)."""
    defaults = _HF_DEFAULTS[mtype]

    def get(key: str) -> Any:
        v = cfg.get(key)
        if v is None and key in _HF_ALIASES:  # e.g. transformers 5 writes qwen3_moe's num_experts this way
            v = cfg.get(_HF_ALIASES[key])
        return defaults.get(key) if v is None else v

    def get_int(key: str) -> int:
        v = get(key)
        if isinstance(v, bool) or not isinstance(v, int):
            raise UserError(f"{path}: {key} must be an integer, got {v!r}")
        bound = _HF_BOUNDS.get(key, _HF_BOUND)
        if v > bound:
            raise UserError(f"{path}: {key} must be at most {bound:,} (a generous physical bound: larger values "
                            f"would exhaust memory while deriving the model), got {v:,}")
        return v

    if get("attention_bias"):
        raise UserError(f"{path}: attention_bias=true is not supported (Qwen3 models have no attention bias)")
    hidden = get_int("hidden_size")
    n_layers = get_int("num_hidden_layers")
    n_q = get_int("num_attention_heads")
    head_dim = get_int("head_dim") if get("head_dim") is not None else (hidden // n_q if n_q > 0 else 0)
    n_experts = get_int("num_experts")
    kw: dict[str, Any] = dict(
        max_context=_hf_max_context(cfg, get_int("max_position_embeddings"), path),
        hidden=hidden, n_layers=n_layers, n_q_heads=n_q, n_kv_heads=get_int("num_key_value_heads"),
        head_dim=head_dim, qk_norm=True, vocab=get_int("vocab_size"),
        tie_embeddings=bool(get("tie_word_embeddings")),
        n_experts=n_experts, top_k=get_int("num_experts_per_tok"),
        moe_intermediate=get_int("moe_intermediate_size"),
    )
    # Which layers have a dense MLP (transformers: MoE iff i not in mlp_only_layers and num_experts > 0 and
    # (i + 1) % decoder_sparse_step == 0). qwen3_5_moe has MoE in every layer.
    if mtype == "qwen3_5_moe":
        dense: list[int] = []
    else:
        step = get_int("decoder_sparse_step")
        if step < 1:
            raise UserError(f"{path}: decoder_sparse_step must be >= 1, got {step}")
        mlp_only = get("mlp_only_layers")
        if not isinstance(mlp_only, list) or not all(isinstance(i, int) for i in mlp_only):
            raise UserError(f"{path}: mlp_only_layers must be a list of layer indices, got {mlp_only!r}")
        dense = [i for i in range(n_layers) if i in mlp_only or not (n_experts > 0 and (i + 1) % step == 0)]
    kw["dense_layers"] = tuple(dense)
    kw["dense_intermediate"] = get_int("intermediate_size") if dense else 0

    if mtype == "qwen3_moe":
        kw["layer_types"] = ("full",) * n_layers
        return kw

    # hybrid models: gated attention + Gated DeltaNet
    layer_types = cfg.get("layer_types")
    if layer_types is None:
        interval = get_int("full_attention_interval")
        if interval < 1:
            raise UserError(f"{path}: full_attention_interval must be >= 1, got {interval}")
        layer_types = ["linear_attention" if (i + 1) % interval else "full_attention"
                       for i in range(n_layers)]
    kinds = {"full_attention": "full", "linear_attention": "linear"}
    if not isinstance(layer_types, list) or any(t not in kinds for t in layer_types):
        bad = (next((t for t in layer_types if t not in kinds), None) if isinstance(layer_types, list)
               else layer_types)
        raise UserError(f"{path}: layer_types entries must be 'full_attention' or 'linear_attention', "
                        f"got {bad!r}")
    kw["layer_types"] = tuple(kinds[t] for t in layer_types)
    k_dim, v_dim = get_int("linear_key_head_dim"), get_int("linear_value_head_dim")
    if k_dim != v_dim:
        raise UserError(f"{path}: linear_key_head_dim ({k_dim}) != linear_value_head_dim ({v_dim}) "
                        "is not supported")
    shared = get_int("shared_expert_intermediate_size")
    kw.update(
        gated_attn=True,
        linear_n_k_heads=get_int("linear_num_key_heads"),
        linear_n_v_heads=get_int("linear_num_value_heads"),
        linear_head_dim=k_dim,
        linear_conv=get_int("linear_conv_kernel_dim"),
        n_shared_experts=1 if shared > 0 else 0,
        shared_intermediate=shared,
        n_mtp_layers=get_int("mtp_num_hidden_layers"),
    )
    return kw


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
}

PRESET_NAMES: tuple[str, ...] = tuple(_PRESETS)


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


__all__ = ["DELTANET_FLOPS_PER_STATE_ELEM", "PRESET_NAMES", "SUPPORTED_HF_MODEL_TYPES", "LayerKind",
           "ModelSpec", "Phase", "get_model"]
