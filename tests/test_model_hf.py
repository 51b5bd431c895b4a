"""ModelSpec.from_hf_config: config.json files as Hugging Face writes them, and transformers as an oracle.

The first part needs nothing beyond the standard library (config.json files are written into tmp_path with
HF's key names). The second part uses transformers (no download): default configs must round-trip through
the reader, and ``total_params()`` must equal the parameter count of transformers' own model built on a tiny
config.
"""

from __future__ import annotations

import json

import pytest

from rackbed.engine.core.model import ModelSpec, get_model

QWEN3_235B_CONFIG = {  # keys and values of Qwen/Qwen3-235B-A22B config.json (architecture part)
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "hidden_size": 4096,
    "num_hidden_layers": 94,
    "num_attention_heads": 64,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 1536,
    "intermediate_size": 12288,
    "vocab_size": 151936,
    "tie_word_embeddings": False,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "attention_bias": False,
    "norm_topk_prob": True,
    "rope_theta": 1000000.0,
    "max_position_embeddings": 40960,
    "rope_scaling": None,
    "torch_dtype": "bfloat16",
}

QWEN35_397B_TEXT = {  # text_config of Qwen/Qwen3.5-397B-A17B (architecture part)
    "model_type": "qwen3_5_moe_text",
    "hidden_size": 4096,
    "num_hidden_layers": 60,
    "num_attention_heads": 32,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 64,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "num_experts": 512,
    "num_experts_per_tok": 10,
    "moe_intermediate_size": 1024,
    "shared_expert_intermediate_size": 1024,
    "vocab_size": 248320,
    "full_attention_interval": 4,
    "mtp_num_hidden_layers": 1,
    "tie_word_embeddings": False,
    "max_position_embeddings": 262144,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000, "partial_rotary_factor": 0.25},
}


def _write(tmp_path, cfg: dict, name: str = "config.json"):
    p = tmp_path / name
    p.write_text(json.dumps(cfg))
    return p


def _same_architecture(a: ModelSpec, b: ModelSpec) -> None:
    assert a.model_dump(exclude={"name", "source"}) == b.model_dump(exclude={"name", "source"})
    assert a.max_context == b.max_context  # not in model_dump (see ModelSpec)


def test_qwen3_moe_config_gives_the_preset(tmp_path):
    m = ModelSpec.from_hf_config(_write(tmp_path, QWEN3_235B_CONFIG))
    _same_architecture(m, get_model("qwen3-235b-a22b"))
    assert m.name == tmp_path.name and "qwen3_moe" in m.source
    assert m.kv_bytes_per_token() == 192_512


@pytest.mark.parametrize("rope, ctx", [
    (None, 40960),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}, 131072),  # Qwen3 card
    ({"type": "yarn", "factor": 2}, 81920),  # no original length: the factor stretches max_position_embeddings
    ({"rope_type": "linear", "factor": 2.0}, 81920),
    ({"rope_type": "longrope", "factor": 4.0}, 40960),  # longrope configs already state the stretched length
])
def test_max_context_honours_a_rope_scaling_factor(tmp_path, rope, ctx):
    m = ModelSpec.from_hf_config(_write(tmp_path, {**QWEN3_235B_CONFIG, "rope_scaling": rope}))
    assert m.max_context == ctx
    assert "max_context" not in m.model_dump()  # dumps (output files, sweep keys) stay as they were


def test_max_context_defaults_and_bad_factors(tmp_path):
    cfg = {k: v for k, v in QWEN3_235B_CONFIG.items() if k != "max_position_embeddings"}
    assert ModelSpec.from_hf_config(_write(tmp_path, cfg)).max_context == 32768  # transformers' default
    for bad in (0.5, "4", True):
        with pytest.raises(ValueError, match=r"rope_scaling\.factor must be a number"):
            ModelSpec.from_hf_config(_write(tmp_path, {**QWEN3_235B_CONFIG,
                                                       "rope_scaling": {"rope_type": "yarn", "factor": bad}}))


@pytest.mark.parametrize("layout", ["interval", "layer_types", "flat"])
def test_qwen3_5_moe_config_gives_the_preset(tmp_path, layout):
    text = dict(QWEN35_397B_TEXT)
    if layout == "layer_types":
        del text["full_attention_interval"]
        text["layer_types"] = ["linear_attention" if (i + 1) % 4 else "full_attention" for i in range(60)]
    cfg = (
        {"model_type": "qwen3_5_moe", "text_config": text, "vision_config": {"depth": 27}}
        if layout != "flat"
        else text
    )
    m = ModelSpec.from_hf_config(_write(tmp_path, cfg), name="q35")
    _same_architecture(m, get_model("qwen3.5-397b-a17b"))
    assert m.name == "q35"


def test_qwen3_next_config(tmp_path):
    cfg = {
        "model_type": "qwen3_next",
        "hidden_size": 2048,
        "num_hidden_layers": 48,
        "num_attention_heads": 16,
        "num_key_value_heads": 2,
        "head_dim": 256,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_conv_kernel_dim": 4,
        "num_experts": 512,
        "num_experts_per_tok": 10,
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
        "intermediate_size": 5120,
        "vocab_size": 151936,
        "full_attention_interval": 4,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "tie_word_embeddings": False,
    }
    m = ModelSpec.from_hf_config(_write(tmp_path, cfg, "qwen3-next-80b.json"))
    assert m.name == "qwen3-next-80b" and m.gated_attn and m.n_linear_layers == 36
    assert m.dense_layers == () and m.dense_intermediate == 0 and m.n_mtp_layers == 0
    assert abs(m.total_params() / 80e9 - 1) < 0.005  # Qwen3-Next-80B-A3B: 79.67e9 computed


def test_dense_layers_from_sparse_step_and_mlp_only_layers(tmp_path):
    cfg = dict(QWEN3_235B_CONFIG, num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[3])
    m = ModelSpec.from_hf_config(_write(tmp_path, cfg))
    # MoE iff i not in mlp_only_layers and (i + 1) % 2 == 0 -> MoE at 1 and 5; dense at 0, 2, 3, 4
    assert m.dense_layers == (0, 2, 3, 4) and m.dense_intermediate == 12288
    assert [m.is_moe_layer(i) for i in range(6)] == [False, True, False, False, False, True]
    assert m.params_breakdown()["dense_mlp"] == 4 * 3 * 4096 * 12288


@pytest.mark.parametrize(
    "cfg, match",
    [
        (
            {"model_type": "llama", "hidden_size": 8},
            r"model_type 'llama' is not supported; supported: qwen3_moe, qwen3_next, qwen3_5_moe",
        ),
        ({"hidden_size": 8}, "model_type None is not supported"),
        (dict(QWEN3_235B_CONFIG, hidden_size="4096"), "hidden_size must be an integer"),
        (dict(QWEN3_235B_CONFIG, attention_bias=True), "attention_bias"),
        (dict(QWEN3_235B_CONFIG, num_experts_per_tok=300), "top_k"),
        (dict(QWEN3_235B_CONFIG, mlp_only_layers="all"), "mlp_only_layers"),
        (dict(QWEN35_397B_TEXT, layer_types=["full_attention", "sliding"] * 30), "sliding"),
        (dict(QWEN35_397B_TEXT, linear_value_head_dim=64), "linear_value_head_dim"),
    ],
)
def test_config_errors_are_one_line_and_name_the_file(tmp_path, cfg, match):
    p = _write(tmp_path, cfg)
    with pytest.raises(ValueError, match=match) as info:
        ModelSpec.from_hf_config(p)
    msg = str(info.value)
    assert msg.startswith(str(p)) and "\n" not in msg


def test_config_not_json(tmp_path):
    p = tmp_path / "config.json"
    p.write_text("{not json")
    with pytest.raises(ValueError, match="config.json: invalid JSON"):
        ModelSpec.from_hf_config(p)
    p.write_text("[1, 2]")
    with pytest.raises(ValueError, match="expected a JSON object"):
        ModelSpec.from_hf_config(p)


# ---- transformers as an oracle
# ----------------------------------------------------------------------------------

transformers = pytest.importorskip("transformers")


def _hf_param_count(model) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("diff", [False, True])
def test_transformers_default_configs_round_trip(tmp_path, diff):
    """HF default configs, written in full (to_dict) and as save_pretrained writes them (non-defaults only)."""
    cases = [
        (
            transformers.Qwen3MoeConfig(),
            dict(
                hidden=2048,
                n_layers=24,
                n_q_heads=32,
                n_kv_heads=4,
                head_dim=64,
                n_experts=128,
                top_k=8,
                moe_intermediate=768,
                vocab=151936,
            ),
        ),
        (
            transformers.Qwen3NextConfig(),
            dict(
                hidden=2048,
                n_layers=48,
                n_q_heads=16,
                n_kv_heads=2,
                head_dim=256,
                n_experts=512,
                top_k=10,
                moe_intermediate=512,
                shared_intermediate=512,
                linear_n_v_heads=32,
                vocab=151936,
            ),
        ),
        (
            transformers.Qwen3_5MoeConfig(),
            dict(
                hidden=2048,
                n_layers=40,
                n_q_heads=16,
                n_kv_heads=2,
                head_dim=256,
                n_experts=256,
                top_k=8,
                moe_intermediate=512,
                linear_n_k_heads=16,
                linear_n_v_heads=32,
                linear_head_dim=128,
                vocab=248320,
            ),
        ),
    ]
    for cfg, expect in cases:
        text = cfg.to_json_string(use_diff=True) if diff else json.dumps(cfg.to_dict(), default=str)
        p = tmp_path / f"{cfg.model_type}.json"
        p.write_text(text)
        m = ModelSpec.from_hf_config(p)
        assert {k: getattr(m, k) for k in expect} == expect, cfg.model_type
        n_layers = expect["n_layers"]
        if cfg.model_type != "qwen3_moe":
            assert m.layer_types == tuple("linear" if (i + 1) % 4 else "full" for i in range(n_layers))


def _tiny_cases():
    T = transformers
    common = dict(
        hidden_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=48,
        vocab_size=100,
    )
    linear = dict(
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=3,
        shared_expert_intermediate_size=40,
        head_dim=32,
    )
    return [
        (
            "qwen3_moe",
            T.Qwen3MoeConfig(**common, head_dim=32, intermediate_size=96, mlp_only_layers=[1]),
            T.Qwen3MoeForCausalLM,
        ),
        (
            "qwen3_moe_tied",
            T.Qwen3MoeConfig(**common, intermediate_size=96, decoder_sparse_step=2, tie_word_embeddings=True),
            T.Qwen3MoeForCausalLM,
        ),
        (
            "qwen3_next",
            T.Qwen3NextConfig(**common, **linear, intermediate_size=96, mlp_only_layers=[2]),
            T.Qwen3NextForCausalLM,
        ),
        ("qwen3_5_moe_text", T.Qwen3_5MoeTextConfig(**common, **linear), T.Qwen3_5MoeForCausalLM),
    ]


@pytest.mark.parametrize("case", range(4))
def test_total_params_equals_transformers_count(tmp_path, case):
    import torch

    torch.manual_seed(0)
    name, cfg, cls = _tiny_cases()[case]
    p = tmp_path / f"{name}.json"
    p.write_text(cfg.to_json_string())
    m = ModelSpec.from_hf_config(p)
    assert m.total_params() == _hf_param_count(cls(cfg)), name
    assert m.n_mtp_layers == 0  # transformers does not build MTP modules (it drops mtp.* weights on load)
