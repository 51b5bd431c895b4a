"""What the torch engine needs to know about a model: ``TorchModelConfig``, built from a ModelSpec (random weights)
or a Hugging Face config (a checkpoint's config.json, or a transformers config object). A Hugging Face config
is read by the core reader (``engine.core.model_hf.read_hf_config``, whose table holds every family's
defaults) and derived through ``from_spec``: there is no second parse here.

Five families run: ``qwen3_moe`` (GQA with qk-norm in every layer, softmax top-k routing), ``deepseek_v3``
(Kimi-K2 too: MLA, dense first layers, sigmoid group-limited routing with a correction bias and a scaling factor, an
ungated shared expert), ``gpt_oss`` (alternating sliding-window / full GQA with learned sinks and q/k/v/o biases,
top-k-then-softmax routing with a router bias, experts with biases and a clamped SwiGLU), ``glm4_moe`` (GQA with
partial rotary, q/k/v bias and optional qk-norm, DeepSeek's routing, dense first layers, a shared expert) and
``qwen3_5_moe`` (Qwen3.5: Gated DeltaNet "linear" layers interleaved with gated full-attention layers, partial
rotary, softmax routing, a sigmoid-gated shared expert; ``layers_gdn``). The Qwen3-MoE fields keep their defaults,
so a Qwen config built the old way is unchanged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

from rackbed.engine.core.layers import GqaAttention, MoeFfn
from rackbed.engine.core.layers.mla import MlaAttention

FAMILIES = ("qwen3_moe", "deepseek_v3", "gpt_oss", "glm4_moe", "qwen3_5_moe")

#: routing of each family: "softmax" (softmax over all experts, top-k, optional renormalisation), "sigmoid_group"
#: (sigmoid scores; selection on score + correction bias inside the top ``topk_group`` of ``n_group`` groups;
#: weights = scores, renormalised, times ``routed_scaling``), "topk_softmax" (top-k of the biased logits, softmax
#: over those k)
ROUTING = {"qwen3_moe": "softmax", "deepseek_v3": "sigmoid_group", "glm4_moe": "sigmoid_group",
           "gpt_oss": "topk_softmax", "qwen3_5_moe": "softmax"}

#: what a ModelSpec (a preset) does not state, per family: the published models' values, which
#: ``TorchModelConfig.from_spec`` applies (a Hugging Face config's own values replace them in ``from_hf``;
#: its omitted keys take ``engine.core.model_hf.HF_DEFAULTS``, transformers' defaults). Qwen3-MoE keeps the
#: field defaults (theta 1e6).
PUBLISHED_NUMERICS: dict[str, dict[str, object]] = {
    "qwen3_moe": {},
    "deepseek_v3": dict(rope_theta=10000.0, routed_scaling=2.5, rope_interleave=True),
    "glm4_moe": dict(rope_theta=1e6, partial_rotary=0.5, routed_scaling=2.5),
    "gpt_oss": dict(rope_theta=150000.0, swiglu_limit=7.0),
    "qwen3_5_moe": dict(rope_theta=10_000_000.0, partial_rotary=0.25),   # a quarter of the head rotates
}


@dataclass(frozen=True)
class TorchModelConfig:
    """What the torch model needs; built from an ``engine.core.model.ModelSpec`` or a Hugging Face config.

    ``layer_kinds[i]`` is layer i's token mixer ("full", "sliding", "mla" or "linear" = Gated DeltaNet; empty =
    every layer "full"); ``gated_attn``: full attention with a per-head sigmoid output gate (Qwen3.5);
    ``shared_gate``: the shared expert's output times ``sigmoid(h @ w)`` (Qwen3.5); ``lin_*``: the Gated DeltaNet
    layers' key / value heads, head dims and causal-conv width;
    ``dense_layers`` the layers whose FFN is a dense SwiGLU of width ``dense_intermediate``. For MLA models
    ``n_kv_heads = n_q_heads`` and ``head_dim = qk_nope + qk_rope`` (as the HF config states them).
    ``rope_scaling``: the HF ``rope_parameters`` beyond the theta, as sorted (key, value) pairs (hashable).
    """

    hidden: int
    n_layers: int
    n_q_heads: int
    n_kv_heads: int
    head_dim: int
    n_experts: int
    top_k: int
    moe_intermediate: int
    vocab: int
    rope_theta: float = 1_000_000.0
    rms_eps: float = 1e-6
    norm_topk_prob: bool = True
    tie_embeddings: bool = False
    init_std: float = 0.02
    family: str = "qwen3_moe"
    layer_kinds: tuple[str, ...] = ()
    dense_layers: tuple[int, ...] = ()
    dense_intermediate: int = 0
    shared_intermediate: int = 0
    n_group: int = 1
    topk_group: int = 1
    routed_scaling: float = 1.0
    qk_norm: bool = True
    qkv_bias: bool = False
    o_bias: bool = False
    sinks: bool = False
    sliding_window: int = 0
    partial_rotary: float = 1.0
    rope_interleave: bool = False
    rope_scaling: tuple[tuple[str, object], ...] = ()
    max_position: int = 4096
    swiglu_limit: float = 0.0            # 0: plain SwiGLU; > 0: gpt-oss's clamped SwiGLU
    swiglu_alpha: float = 1.702
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    gated_attn: bool = False
    shared_gate: bool = False
    lin_k_heads: int = 0
    lin_v_heads: int = 0
    lin_k_dim: int = 0
    lin_v_dim: int = 0
    lin_conv: int = 0
    mtp_layers: int = 0                  # multi-token-prediction modules after the decoder layers (DeepSeek-V3: 1)

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"TorchModelConfig.family must be one of {FAMILIES}, got {self.family!r}")
        if self.layer_kinds and len(self.layer_kinds) != self.n_layers:
            raise ValueError(f"TorchModelConfig.layer_kinds has {len(self.layer_kinds)} entries for "
                             f"{self.n_layers} layers")
        if self.has_linear and not (self.lin_k_heads and self.lin_v_heads and self.lin_k_dim and self.lin_v_dim
                                    and self.lin_conv > 1 and self.lin_v_heads % self.lin_k_heads == 0):
            raise ValueError("TorchModelConfig: linear layers need lin_k_heads, lin_v_heads (a multiple), lin_k_dim, "
                             "lin_v_dim > 0 and lin_conv > 1")

    # -- derived ----------------------------------------------------------------------------------------------
    @property
    def routing(self) -> str:
        return ROUTING[self.family]

    def kind(self, layer: int) -> str:
        """Layer ``layer``'s token mixer; an MTP module's layer (``layer >= n_layers``) has the model's global
        attention (MLA, else full)."""
        if layer >= self.n_layers:
            return "mla" if self.is_mla else "full"
        return self.layer_kinds[layer] if self.layer_kinds else "full"

    @property
    def runs_mtp(self) -> bool:
        """The torch engine can run this model's MTP module as the draft of speculative decoding: it has one
        (``mtp_layers``) and its family is one the engine runs it for (DeepSeek-V3 / Kimi-K2, GLM-4.5)."""
        return self.mtp_layers > 0 and self.family in ("deepseek_v3", "glm4_moe")

    @property
    def kv_windows(self) -> tuple[int, ...]:
        """Per layer of the paged cache (``kv_layers``), the tokens of KV a sequence keeps and a KV transfer ships
        (``engine.core.kv.KvLayout.windows``): the sliding window on "sliding" layers, 0 (the whole sequence)
        elsewhere (and on an MTP module's layer, which runs global attention)."""
        return tuple(self.sliding_window if self.kind(li) == "sliding" else 0 for li in self.kv_layers)

    @property
    def has_linear(self) -> bool:
        """Gated DeltaNet layers present (a per-sequence recurrent state besides the paged KV)."""
        return "linear" in self.layer_kinds

    @property
    def kv_layers(self) -> tuple[int, ...]:
        """The decoder layers with a paged KV cache, in order (every layer but the linear ones); the paged cache's
        layer ``j`` is layer ``kv_layers[j]``. A model that runs its MTP module keeps that module's KV after them
        (layer ``n_layers``: ``ShardedMoeLM.kv_layers``)."""
        return tuple(li for li in range(self.n_layers) if self.kind(li) != "linear")

    @property
    def linear_layers(self) -> tuple[int, ...]:
        """The Gated DeltaNet layers, in order; the state pool's layer ``j`` is layer ``linear_layers[j]``."""
        return tuple(li for li in range(self.n_layers) if self.kind(li) == "linear")

    @property
    def lin_conv_channels(self) -> int:
        """Channels of the causal conv: q, k (``lin_k_heads * lin_k_dim`` each) and v."""
        return 2 * self.lin_k_heads * self.lin_k_dim + self.lin_v_heads * self.lin_v_dim

    def state_bytes_per_seq(self, elem_bytes: int = 2) -> int:
        """One sequence's Gated DeltaNet state over all linear layers: the fp32 delta-rule matrix ``[Hv, Dk, Dv]``
        and ``lin_conv - 1`` tokens of conv input (``elem_bytes`` each) per layer; 0 without linear layers."""
        per = self.lin_v_heads * self.lin_k_dim * self.lin_v_dim * 4 + \
            (self.lin_conv - 1) * self.lin_conv_channels * elem_bytes
        return len(self.linear_layers) * per if self.has_linear else 0

    @property
    def is_mla(self) -> bool:
        return "mla" in self.layer_kinds

    def is_dense(self, layer: int) -> bool:
        return layer in self.dense_layers

    @property
    def rope(self) -> dict:
        return dict(self.rope_scaling)

    @property
    def rope_dim(self) -> int:
        """Rotary dims per head (MLA: the decoupled rope key; GLM: ``partial_rotary_factor`` of the head)."""
        return self.qk_rope_head_dim if self.is_mla else int(self.head_dim * self.partial_rotary)

    @property
    def softmax_scale(self) -> float:
        """1/sqrt(qk head dim), times YaRN's ``mscale(factor, mscale_all_dim)^2`` for MLA (DeepSeek's softmax
        correction, as transformers' ``yarn_apply_mscale``)."""
        s = self.head_dim ** -0.5
        r = self.rope
        if self.is_mla and r.get("rope_type", "default") != "default" and r.get("mscale_all_dim"):
            f = float(r["factor"])
            m = 0.1 * float(r["mscale_all_dim"]) * math.log(f) + 1.0 if f > 1 else 1.0
            s *= m * m
        return s

    @cached_property
    def attention(self):
        """The token-mixer kind (MLA, or the GQA kind every full/sliding layer shares)."""
        if self.is_mla:
            return MlaAttention(hidden=self.hidden, n_heads=self.n_q_heads, q_lora_rank=self.q_lora_rank,
                                kv_lora_rank=self.kv_lora_rank, qk_nope_head_dim=self.qk_nope_head_dim,
                                qk_rope_head_dim=self.qk_rope_head_dim, v_head_dim=self.v_head_dim)
        return GqaAttention(hidden=self.hidden, n_q_heads=self.n_q_heads, n_kv_heads=self.n_kv_heads,
                            head_dim=self.head_dim, qk_norm=self.qk_norm, gated=self.gated_attn)

    @cached_property
    def moe(self) -> MoeFfn:
        """The FFN kind every MoE layer runs."""
        return MoeFfn(hidden=self.hidden, n_experts=self.n_experts, top_k=self.top_k, intermediate=self.moe_intermediate,
                      n_shared=1 if self.shared_intermediate else 0, shared_intermediate=self.shared_intermediate,
                      shared_gate=self.shared_gate, router_bias=self.family == "gpt_oss", expert_bias=self.family == "gpt_oss")

    def kv_bytes_per_token(self, elem_bytes: int = 2) -> int:
        """Paged KV bytes per token: every layer with a paged cache (linear layers keep a state instead)."""
        return int(len(self.kv_layers) * self.attention.kv_bytes_per_token(elem_bytes))

    # -- construction -----------------------------------------------------------------------------------------
    @classmethod
    def from_spec(cls, spec, n_layers: int | None = None, family: str | None = None,
                  **overrides) -> TorchModelConfig:
        """From a ModelSpec. The family, unless given, follows from the spec's layer kinds (MLA ->
        deepseek_v3; sliding windows or sinks -> gpt_oss; an ungated shared expert -> glm4_moe; else
        qwen3_moe); the numerics a ModelSpec does not state take the published models' values
        (``PUBLISHED_NUMERICS``; DeepSeek-V3's 8 routing groups, top 4, where its experts split so), and
        ``overrides`` replace any field (``from_hf`` passes a config's own values). ``n_layers`` truncates
        (keeping the dense first layers)."""
        kinds = [x.attention.kind for x in spec.layers]
        n = n_layers or spec.n_layers
        moe = next((x.ffn for x in spec.layers if x.ffn.kind == "moe"), None)
        if moe is None:
            raise ValueError(f"model {spec.name}: the torch engine runs MoE models")
        fam = family or ("qwen3_5_moe" if "linear" in kinds else "deepseek_v3" if "mla" in kinds else
                         "gpt_oss" if ("sliding" in kinds or spec.attn_sinks) else
                         "glm4_moe" if moe.n_shared and not moe.shared_gate else "qwen3_moe")
        if fam == "qwen3_moe" and moe.n_shared:
            raise ValueError(f"model {spec.name}: gated shared experts are not supported by the torch engine")
        kw = dict(hidden=spec.hidden, n_layers=n, n_q_heads=spec.n_q_heads, n_kv_heads=spec.n_kv_heads,
                  head_dim=spec.head_dim, n_experts=moe.n_experts, top_k=moe.top_k, moe_intermediate=moe.intermediate,
                  vocab=spec.vocab, tie_embeddings=spec.tie_embeddings, family=fam)
        if fam != "qwen3_moe":
            dense = tuple(i for i, x in enumerate(spec.layers[:n]) if x.ffn.kind != "moe")
            kw.update(layer_kinds=tuple(kinds[:n]), dense_layers=dense, dense_intermediate=spec.dense_intermediate,
                      shared_intermediate=moe.n_shared * moe.shared_intermediate, qk_norm=spec.qk_norm,
                      qkv_bias=spec.attn_qkv_bias, o_bias=spec.attn_o_bias, sinks=spec.attn_sinks,
                      sliding_window=spec.sliding_window, max_position=spec.max_context or 4096,
                      mtp_layers=spec.n_mtp_layers)
        kw.update(PUBLISHED_NUMERICS[fam])
        if fam == "deepseek_v3":
            groups = 8 if moe.n_experts % 8 == 0 and moe.n_experts // 8 >= 2 else 1
            kw.update(q_lora_rank=spec.q_lora_rank, kv_lora_rank=spec.kv_lora_rank,
                      qk_nope_head_dim=spec.qk_nope_head_dim, qk_rope_head_dim=spec.qk_rope_head_dim,
                      v_head_dim=spec.v_head_dim, n_group=groups, topk_group=max(1, groups // 2))
        elif fam == "qwen3_5_moe":
            kw.update(gated_attn=spec.gated_attn,
                      shared_gate=bool(moe.n_shared and moe.shared_gate), lin_k_heads=spec.linear_n_k_heads,
                      lin_v_heads=spec.linear_n_v_heads, lin_k_dim=spec.linear_head_dim,
                      lin_v_dim=spec.linear_head_dim, lin_conv=spec.linear_conv)
        kw.update(overrides)
        return cls(**kw)

    @classmethod
    def from_hf(cls, hf_config, source: str = "config.json") -> TorchModelConfig:
        """From a Hugging Face config of a supported family: a transformers config object or a config.json
        dict (no ``model_type``: qwen3_moe), read once by ``engine.core.model_hf.read_hf_config`` (keys a
        saved config omits take transformers' defaults from its table) and derived through ``from_spec`` with
        the config's own numerics. ``source`` names the config in errors. The Qwen3-MoE path runs plain RoPE
        at ``rope_theta`` (no scaling, no partial rotary); a Qwen3.5 checkpoint's MTP module is not loaded."""
        from rackbed.engine.core.model import ModelSpec
        from rackbed.engine.core.model_hf import read_hf_config

        raw = dict(hf_config) if isinstance(hf_config, dict) else hf_config.to_dict()
        raw["model_type"] = raw.get("model_type") or "qwen3_moe"
        hf = read_hf_config(raw, source)
        if hf.family not in FAMILIES:
            raise ValueError(f"model_type {hf.model_type!r}: the torch engine runs {', '.join(FAMILIES)}")
        spec = ModelSpec.from_hf_model(hf, "hf", source)
        over: dict = dict(rope_theta=hf.rope_theta, rms_eps=hf.rms_eps, norm_topk_prob=hf.norm_topk_prob)
        if hf.family != "qwen3_moe":
            over.update(rope_scaling=hf.rope_scaling, max_position=hf.max_position,
                        partial_rotary=hf.partial_rotary, n_group=hf.n_group, topk_group=hf.topk_group,
                        routed_scaling=hf.routed_scaling, rope_interleave=hf.rope_interleave,
                        swiglu_limit=hf.swiglu_limit, swiglu_alpha=hf.swiglu_alpha,
                        mtp_layers=spec.n_mtp_layers if hf.family in ("deepseek_v3", "glm4_moe") else 0)
        if hf.family == "qwen3_5_moe":
            over["lin_v_dim"] = hf.linear_value_head_dim
        return cls.from_spec(spec, family=hf.family, **over)
