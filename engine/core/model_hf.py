"""Reading Hugging Face ``config.json`` files, once, into the core model description (``read_hf_config``).

``read_hf_config`` returns an ``HfModel``: the ``ModelSpec`` fields (what the simulator and planners need) and
the numerics only a runtime needs (RoPE theta and scaling, norm epsilon, routing groups and scaling, SwiGLU
clamp). ``ModelSpec.from_hf_config`` builds the ModelSpec from it; the torch engine's
``TorchModelConfig.from_hf`` derives its config from it too, so a config is parsed in one place. One reader
per family: Qwen3-MoE / Qwen3-Next / Qwen3.5 (``_hf_to_spec_kwargs``), DeepSeek-V3 and Kimi-K2
(``_hf_deepseek_v3``), gpt-oss (``_hf_gpt_oss``), GLM-4.5 (``_hf_glm4_moe``), and one for the runtime numerics
of every family (``_hf_runtime``). Keys a saved config omits take the defaults of transformers' config classes
(``HF_DEFAULTS``: ``save_pretrained`` leaves out keys equal to them); a bad value raises a one-line
``UserError`` naming the file and key.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rackbed.topology.errors import UserError

#: model types read as another's (Kimi-K2 is DeepseekV3ForCausalLM; Qwen3.5's text model)
HF_SAME_AS = {"kimi_k2": "deepseek_v3", "qwen3_5_moe_text": "qwen3_5_moe"}

# Defaults of transformers' config classes (transformers 5.x configuration_qwen3_moe.py,
# configuration_qwen3_next.py, configuration_qwen3_5_moe.py: Qwen3_5MoeTextConfig,
# configuration_deepseek_v3.py, configuration_gpt_oss.py, configuration_glm4_moe.py), per family: the one
# table both the ModelSpec fields and the runtime numerics read. config.json files written by
# ``save_pretrained`` omit keys equal to these, so a reader must know them. head_dim None: hidden_size //
# num_attention_heads. rope_theta and partial_rotary_factor are the ones transformers places in
# ``rope_parameters`` when a config states none.
HF_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen3_moe": dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=24,
        num_attention_heads=32, num_key_value_heads=4, head_dim=None, tie_word_embeddings=False,
        attention_bias=False,
        decoder_sparse_step=1, moe_intermediate_size=768, num_experts_per_tok=8, num_experts=128,
        mlp_only_layers=[],
        max_position_embeddings=32768,
        rope_theta=10000.0, rms_norm_eps=1e-6, norm_topk_prob=False,
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
        rope_theta=10000.0, partial_rotary_factor=0.25, rms_norm_eps=1e-6, norm_topk_prob=True,
    ),
    "qwen3_5_moe": dict(
        vocab_size=248320, hidden_size=2048, num_hidden_layers=40, num_attention_heads=16,
        num_key_value_heads=2, head_dim=256, tie_word_embeddings=False, attention_bias=False,
        linear_conv_kernel_dim=4, linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
        linear_num_value_heads=32, moe_intermediate_size=512, shared_expert_intermediate_size=512,
        num_experts_per_tok=8, num_experts=256, full_attention_interval=4, mtp_num_hidden_layers=0,
        max_position_embeddings=32768,
        rope_theta=10000.0, partial_rotary_factor=0.25, rms_norm_eps=1e-6,
    ),
    # DeepSeek-V3 / R1 (Kimi-K2 writes model_type kimi_k2 with the same keys; its config.json states them all)
    "deepseek_v3": dict(
        vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128, n_shared_experts=1,
        n_routed_experts=256, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128,
        qk_nope_head_dim=128, num_experts_per_tok=8, first_k_dense_replace=3, moe_layer_freq=1,
        max_position_embeddings=4096, tie_word_embeddings=False, attention_bias=False,
        num_nextn_predict_layers=1,
        rope_theta=10000.0, rms_norm_eps=1e-6, norm_topk_prob=True, n_group=8, topk_group=4,
        routed_scaling_factor=2.5, rope_interleave=True,
    ),
    "gpt_oss": dict(
        num_hidden_layers=36, num_local_experts=128, vocab_size=201088, hidden_size=2880, intermediate_size=2880,
        head_dim=64, num_attention_heads=64, num_key_value_heads=8, sliding_window=128,
        tie_word_embeddings=False, num_experts_per_tok=4, attention_bias=True, max_position_embeddings=131072,
        rope_parameters={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                         "truncate": False, "original_max_position_embeddings": 4096, "rope_theta": 150000.0},
        rope_theta=150000.0, rms_norm_eps=1e-5, swiglu_limit=7.0, swiglu_alpha=1.702,
    ),
    "glm4_moe": dict(
        vocab_size=151552, hidden_size=4096, intermediate_size=10944, num_hidden_layers=46,
        num_attention_heads=96, num_key_value_heads=8, head_dim=None, attention_bias=False,
        moe_intermediate_size=1408, num_experts_per_tok=8, n_shared_experts=1, n_routed_experts=128,
        first_k_dense_replace=1, use_qk_norm=False, tie_word_embeddings=False, max_position_embeddings=131072,
        num_nextn_predict_layers=1,
        rope_theta=10000.0, partial_rotary_factor=0.5, rms_norm_eps=1e-5, norm_topk_prob=True, n_group=1,
        topk_group=1, routed_scaling_factor=1.0,
    ),
}
HF_DEFAULTS["kimi_k2"] = HF_DEFAULTS["deepseek_v3"]


@dataclass(frozen=True)
class HfModel:
    """A Hugging Face config read once (``read_hf_config``): ``spec``, the ``ModelSpec`` fields, and the
    numerics a runtime needs beyond them. ``model_type`` is the config's (``qwen3_5_moe_text`` read as
    ``qwen3_5_moe``), ``family`` the architecture it runs as (Kimi-K2: ``deepseek_v3``). ``rope_scaling``: the
    RoPE parameters beyond theta and the partial-rotary factor, as sorted (key, value) pairs, empty for plain
    RoPE; ``max_position``: ``max_position_embeddings`` as stated (``spec["max_context"]`` is the stretched
    length); ``norm_topk_prob``, ``n_group``, ``topk_group``, ``routed_scaling``: routing (the last three for
    DeepSeek-V3 and GLM-4.5); ``swiglu_limit`` / ``swiglu_alpha``: gpt-oss's clamped SwiGLU (0: plain SwiGLU);
    ``linear_value_head_dim``: the Gated DeltaNet value head dim (``spec["linear_head_dim"]`` is the
    key's)."""

    model_type: str
    spec: dict[str, Any] = field(hash=False)
    rope_theta: float
    rms_eps: float
    max_position: int
    rope_scaling: tuple[tuple[str, Any], ...] = ()
    partial_rotary: float = 1.0
    norm_topk_prob: bool = True
    n_group: int = 1
    topk_group: int = 1
    routed_scaling: float = 1.0
    rope_interleave: bool = False
    swiglu_limit: float = 0.0
    swiglu_alpha: float = 1.702
    linear_value_head_dim: int = 0

    @property
    def family(self) -> str:
        return HF_SAME_AS.get(self.model_type, self.model_type)


# Other spellings of a key (transformers' ``attribute_map``: Qwen3MoeConfig stores num_experts as
# num_local_experts).
_HF_ALIASES = {"num_experts": "num_local_experts"}


#: upper bounds on config.json integers: per-layer tables are built from them, so ``num_hidden_layers: 1000000000``
#: would run for minutes into a MemoryError; the bounds are far beyond any published model (Qwen3-235B: 94 layers,
#: 128 experts, vocab 151,936, hidden 4,096)
_HF_BOUNDS = {"num_hidden_layers": 10_000, "mtp_num_hidden_layers": 10_000, "num_experts": 65_536,
              "num_local_experts": 65_536, "n_routed_experts": 65_536, "n_shared_experts": 65_536,
              "num_nextn_predict_layers": 10_000, "first_k_dense_replace": 10_000, "moe_layer_freq": 10_000, "num_experts_per_tok": 65_536, "full_attention_interval": 10_000,
              "decoder_sparse_step": 10_000}
_HF_BOUND = 1 << 24  # any other size (vocab, hidden, intermediate, heads, head_dim)


#: RoPE scalings whose ``factor`` stretches the context past ``max_position_embeddings`` (as vLLM derives a model's
#: length); other types (``default``, ``mrope``, and ``longrope`` / ``llama3``, whose configs already state the
#: stretched length) leave it as it is
_ROPE_STRETCH = ("yarn", "linear", "dynamic")


def _hf_max_context(cfg: dict[str, Any], get, max_pos: int, path: Path) -> int:
    """The longest sequence a config serves: ``max_position_embeddings``, or, when ``rope_scaling`` (transformers
    5: ``rope_parameters``) names a stretching type with a ``factor``, the base times the factor -- for YaRN the
    base is ``original_max_position_embeddings`` when given (Qwen3 with YaRN enabled: ``{rope_type: yarn,
    factor: 4.0, original_max_position_embeddings: 32768}`` -> 131,072; without it: 40,960). vLLM derives its
    ``max_model_len`` the same way."""
    key = "rope_scaling" if isinstance(cfg.get("rope_scaling"), dict) else "rope_parameters"
    rope = cfg.get(key) or get("rope_parameters")     # none stated: the family's default (gpt-oss: YaRN)
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


def read_hf_config(raw: dict[str, Any], path: Path | str) -> HfModel:
    """A Hugging Face config (the parsed config.json; ``path`` names it in errors) as an ``HfModel``. Qwen3.5
    keeps the text model under ``text_config`` (the multimodal config) or is the text config itself
    (model_type ``qwen3_5_moe_text``). Other model types than ``SUPPORTED_HF_MODEL_TYPES`` raise a one-line
    UserError."""
    from rackbed.engine.core.model import SUPPORTED_HF_MODEL_TYPES

    path = Path(path)
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
    get, get_int = _getters(cfg, mtype, path)
    spec = _hf_to_spec_kwargs(cfg, mtype, get, get_int, path)
    return HfModel(model_type=mtype, spec=spec, **_hf_runtime(cfg, mtype, get, get_int, path))


def _getters(cfg: dict[str, Any], mtype: str, path: Path):
    """``get(key)``: the config's value, else its alias's, else the family's default (``HF_DEFAULTS``);
    ``get_int(key)``: the same, checked to be an integer within bounds."""
    defaults = HF_DEFAULTS[mtype]

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

    return get, get_int


def _hf_to_spec_kwargs(cfg: dict[str, Any], mtype: str, get, get_int, path: Path) -> dict[str, Any]:
    """Map HF config keys onto ModelSpec fields (see ``ModelSpec.from_hf_config``)."""
    if mtype in _HF_FAMILIES:
        return _HF_FAMILIES[mtype](cfg, get, get_int, path)
    if get("attention_bias"):
        raise UserError(f"{path}: attention_bias=true is not supported (Qwen3 models have no attention bias)")
    hidden = get_int("hidden_size")
    n_layers = get_int("num_hidden_layers")
    n_q = get_int("num_attention_heads")
    head_dim = get_int("head_dim") if get("head_dim") is not None else (hidden // n_q if n_q > 0 else 0)
    n_experts = get_int("num_experts")
    kw: dict[str, Any] = dict(
        max_context=_hf_max_context(cfg, get, get_int("max_position_embeddings"), path),
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
    k_dim = get_int("linear_key_head_dim")     # the value head dim: HfModel.linear_value_head_dim
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


def _hf_common(get, get_int, path: Path) -> dict[str, Any]:
    """Keys every family shares: sizes, vocabulary, embeddings, context."""
    hidden, n_q = get_int("hidden_size"), get_int("num_attention_heads")
    if n_q < 1:
        raise UserError(f"{path}: num_attention_heads must be >= 1, got {n_q}")
    return dict(hidden=hidden, n_layers=get_int("num_hidden_layers"), n_q_heads=n_q, vocab=get_int("vocab_size"),
                tie_embeddings=bool(get("tie_word_embeddings")))


def _hf_first_dense(get, get_int, n_layers: int, path: Path) -> tuple[int, ...]:
    """DeepSeek-V3 / GLM-4.5: the first ``first_k_dense_replace`` layers are dense; beyond them a layer is MoE
    when ``i % moe_layer_freq == 0`` (1 in every published config)."""
    k = get_int("first_k_dense_replace")
    freq = get_int("moe_layer_freq") if get("moe_layer_freq") is not None else 1
    if k < 0 or k > n_layers:
        raise UserError(f"{path}: first_k_dense_replace must be in [0, num_hidden_layers={n_layers}], got {k}")
    if freq < 1:
        raise UserError(f"{path}: moe_layer_freq must be >= 1, got {freq}")
    return tuple(i for i in range(n_layers) if i < k or i % freq)


def _hf_routed_shared(get_int, path: Path) -> dict[str, Any]:
    """Routed experts, and the shared experts as one ungated MLP of ``n_shared_experts * moe_intermediate_size``
    (how DeepSeek-V3 and GLM-4.5 build them)."""
    moe_i, n_shared = get_int("moe_intermediate_size"), get_int("n_shared_experts")
    return dict(n_experts=get_int("n_routed_experts"), top_k=get_int("num_experts_per_tok"), moe_intermediate=moe_i,
                n_shared_experts=1 if n_shared else 0, shared_intermediate=n_shared * moe_i,
                shared_expert_gate=False, router_bias=True)


def _hf_deepseek_v3(cfg: dict[str, Any], get, get_int, path: Path) -> dict[str, Any]:
    """DeepseekV3ForCausalLM (DeepSeek-V3 / R1, Kimi-K2): MLA in every layer, dense first layers, routed experts
    with one ungated shared expert, a selection-only expert bias (``e_score_correction_bias``), MTP modules
    (``num_nextn_predict_layers``)."""
    if get("attention_bias"):
        raise UserError(f"{path}: attention_bias=true is not supported for MLA (DeepSeek-V3 has no attention bias)")
    kw = _hf_common(get, get_int, path)
    n = kw["n_layers"]
    q_lora = get("q_lora_rank")
    kw.update(_hf_routed_shared(get_int, path))
    dense = _hf_first_dense(get, get_int, n, path)
    nope, rope = get_int("qk_nope_head_dim"), get_int("qk_rope_head_dim")
    kw.update(
        layer_types=("mla",) * n, n_kv_heads=kw["n_q_heads"], head_dim=nope + rope, qk_norm=False,
        q_lora_rank=0 if q_lora is None else get_int("q_lora_rank"), kv_lora_rank=get_int("kv_lora_rank"),
        qk_nope_head_dim=nope, qk_rope_head_dim=rope, v_head_dim=get_int("v_head_dim"),
        dense_layers=dense, dense_intermediate=get_int("intermediate_size") if dense else 0,
        n_mtp_layers=get_int("num_nextn_predict_layers"),
        max_context=_hf_max_context(cfg, get, get_int("max_position_embeddings"), path),
    )
    return kw


def _hf_gpt_oss(cfg: dict[str, Any], get, get_int, path: Path) -> dict[str, Any]:
    """GptOssForCausalLM: sliding-window and full attention alternating (``layer_types``), learned sinks and
    biases on every attention projection, 128 routed experts with biases and a biased router, no shared or dense
    MLP, no MTP."""
    kw = _hf_common(get, get_int, path)
    n = kw["n_layers"]
    types = cfg.get("layer_types")
    if types is None:
        types = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
    kinds = {"full_attention": "full", "sliding_attention": "sliding"}
    if not isinstance(types, list) or any(t not in kinds for t in types):
        bad = next((t for t in types if t not in kinds), None) if isinstance(types, list) else types
        raise UserError(f"{path}: layer_types entries must be 'full_attention' or 'sliding_attention', got {bad!r}")
    bias = bool(get("attention_bias"))
    kw.update(
        layer_types=tuple(kinds[t] for t in types), n_kv_heads=get_int("num_key_value_heads"),
        head_dim=get_int("head_dim"), qk_norm=False, attn_qkv_bias=bias, attn_o_bias=bias, attn_sinks=True,
        sliding_window=get_int("sliding_window"),
        n_experts=get_int("num_local_experts"), top_k=get_int("num_experts_per_tok"),
        moe_intermediate=get_int("intermediate_size"), router_bias=True, expert_bias=True,
        max_context=_hf_max_context(cfg, get, get_int("max_position_embeddings"), path),
    )
    return kw


def _hf_glm4_moe(cfg: dict[str, Any], get, get_int, path: Path) -> dict[str, Any]:
    """Glm4MoeForCausalLM (GLM-4.5, GLM-4.5-Air): GQA with q/k/v biases (o without) and optional qk norm, dense
    first layers, routed experts with one ungated shared expert and a selection-only expert bias, MTP modules."""
    kw = _hf_common(get, get_int, path)
    n = kw["n_layers"]
    kw.update(_hf_routed_shared(get_int, path))
    dense = _hf_first_dense(get, get_int, n, path)
    head_dim = get_int("head_dim") if get("head_dim") is not None else kw["hidden"] // kw["n_q_heads"]
    kw.update(
        layer_types=("full",) * n, n_kv_heads=get_int("num_key_value_heads"), head_dim=head_dim,
        qk_norm=bool(get("use_qk_norm")), attn_qkv_bias=bool(get("attention_bias")),
        dense_layers=dense, dense_intermediate=get_int("intermediate_size") if dense else 0,
        n_mtp_layers=get_int("num_nextn_predict_layers"),
        max_context=_hf_max_context(cfg, get, get_int("max_position_embeddings"), path),
    )
    return kw


_HF_FAMILIES = {"deepseek_v3": _hf_deepseek_v3, "kimi_k2": _hf_deepseek_v3, "gpt_oss": _hf_gpt_oss,
                "glm4_moe": _hf_glm4_moe}


_NUMBER = (int, float)


def _hf_runtime(cfg: dict[str, Any], mtype: str, get, get_int, path: Path) -> dict[str, Any]:
    """The ``HfModel`` numerics beyond the ModelSpec fields. RoPE as transformers reads it:
    ``rope_parameters`` (transformers 5), else ``rope_scaling`` (transformers 4, whose ``type`` names the
    ``rope_type``), else the family's default; theta and the partial-rotary factor from there, else from the
    top-level keys (transformers 4), else the family's defaults."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or get("rope_parameters") or {}
    if not isinstance(rope, dict):
        raise UserError(f"{path}: rope_parameters must be an object, got {rope!r}")
    rope = dict(rope)
    rope.setdefault("rope_type", rope.get("type", "default"))
    theta = rope.pop("rope_theta", None) or get("rope_theta")
    partial = rope.pop("partial_rotary_factor", None) or get("partial_rotary_factor") or 1.0
    eps = get("rms_norm_eps")
    for key, v in (("rope_theta", theta), ("partial_rotary_factor", partial), ("rms_norm_eps", eps)):
        if isinstance(v, bool) or not isinstance(v, _NUMBER) or not v > 0:
            raise UserError(f"{path}: {key} must be a positive number, got {v!r}")
    out: dict[str, Any] = dict(
        rope_theta=float(theta), partial_rotary=float(partial), rms_eps=eps,
        rope_scaling=tuple(sorted(rope.items())) if rope["rope_type"] != "default" else (),
        max_position=get_int("max_position_embeddings"),
        # Qwen3.5 always renormalises the top-k weights (its config has no switch); gpt-oss's softmax over the
        # top-k does by construction
        norm_topk_prob=True if get("norm_topk_prob") is None else bool(get("norm_topk_prob")),
    )
    if mtype == "qwen3_5_moe":
        out["norm_topk_prob"] = True
    if mtype in ("qwen3_next", "qwen3_5_moe"):
        out["linear_value_head_dim"] = get_int("linear_value_head_dim")
    if mtype in ("deepseek_v3", "kimi_k2", "glm4_moe"):     # sigmoid routing within groups, scaled
        scaling = get("routed_scaling_factor")
        if isinstance(scaling, bool) or not isinstance(scaling, _NUMBER):
            raise UserError(f"{path}: routed_scaling_factor must be a number, got {scaling!r}")
        out.update(n_group=get_int("n_group") or 1, topk_group=get_int("topk_group") or 1,
                   routed_scaling=float(scaling))
    if mtype in ("deepseek_v3", "kimi_k2"):
        out["rope_interleave"] = bool(get("rope_interleave"))
    if mtype == "gpt_oss":
        out.update(swiglu_limit=float(get("swiglu_limit")), swiglu_alpha=float(get("swiglu_alpha")))
    return out
