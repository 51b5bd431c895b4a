"""DeepSeek-V3 / Kimi-K2 (MLA), gpt-oss (sliding window + sinks) and GLM-4.5 as ModelSpecs: presets against the
published facts, Hugging Face configs of each family, and parameter counts against transformers' own modules on
tiny configs (the transformers model is the reference for what a config means)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rackbed.engine.core.model import PUBLISHED_SIZES, ModelSpec, get_model
from rackbed.topology.errors import UserError

NEW = ("deepseek-v3", "kimi-k2", "gpt-oss-120b", "glm-4.5")


@pytest.mark.parametrize("name", PUBLISHED_SIZES)
def test_presets_match_published_sizes(name):
    """Computed totals within 1 % of what the publisher states; active within the stated counting difference
    (gpt-oss and GLM leave the input embedding out of "active")."""
    m = get_model(name)
    total, active, _ = PUBLISHED_SIZES[name]
    tol = 0.03 if name == "kimi-k2" else 0.01  # "1 trillion" is rounded to one digit
    assert abs(m.total_params() / total - 1) < tol or name == "glm-4.5" and \
        abs(m.total_params(include_mtp=True) / total - 1) < tol
    emb = m.vocab * m.hidden
    assert min(abs(m.active_params() / active - 1), abs((m.active_params() - emb) / active - 1)) < 0.04


def test_mla_kv_is_latent_per_layer():
    """(kv_lora_rank + qk_rope_head_dim) x layers x element size, whatever the head count."""
    for name in ("deepseek-v3", "kimi-k2"):
        m = get_model(name)
        assert m.kv_bytes_per_token(2) == (512 + 64) * 61 * 2 == 70272
        assert m.kv_bytes_per_token(1, include_mtp=True) == (512 + 64) * (61 + m.n_mtp_layers)
        assert m.mtp_layer.attention.kind == "mla"


def test_deepseek_structure():
    m = get_model("deepseek-v3")
    assert m.dense_layers == (0, 1, 2) and m.n_moe_layers == 58
    assert {layer.attention.kind for layer in m.layers} == {"mla"}
    moe = m.kinds.moe
    assert moe.shared_gate_params() == 0 and moe.n_shared == 1 and moe.shared_intermediate == 2048
    # DeepSeek-V3 technical report: 671B total, 37B activated (ours counts embedding and head: +1.5 %)
    assert m.total_params() == 671_026_419_200


def test_gpt_oss_sliding_window_caps_kv():
    m = get_model("gpt-oss-120b")
    assert m.layer_types[:2] == ("sliding", "full") and m.n_layers_of("sliding") == 18
    per_layer_tok = 2 * 8 * 64 * 2
    assert m.kv_bytes_per_token(2) == 36 * per_layer_tok
    # at 10,000 tokens: full layers keep all, sliding layers their 128-token window
    assert m.kv_bytes_per_seq(10_000, 2) == 18 * 10_000 * per_layer_tok + 18 * 128 * per_layer_tok
    assert m.kv_bytes_per_seq(100, 2) == 36 * 100 * per_layer_tok
    # decode attention core: sliding layers see at most the window
    f = m.flops_breakdown("decode", 10_000)["attn_core"]
    assert f == pytest.approx(18 * 4 * 64 * 64 * 10_000 + 18 * 4 * 64 * 64 * 128)


@given(q=st.integers(1, 3000), c=st.integers(0, 3000), w=st.integers(1, 512))
@settings(max_examples=200, deadline=None, derandomize=True)
def test_sliding_attended_pairs_brute_force(q, c, w):
    from rackbed.engine.core.layers import SlidingWindowAttention

    a = SlidingWindowAttention(hidden=64, n_q_heads=4, n_kv_heads=2, head_dim=16, window=w)
    assert a.attended_pairs(q, c) == sum(min(p, w) for p in range(c + 1, c + q + 1))


def test_mla_decode_absorbed_flops_and_reads():
    a = get_model("deepseek-v3").mixer("mla")
    # absorbed: each head scores kv_lora + rope dims and reads back kv_lora dims per cached token
    assert a.decode_core_flops(1000) == 2 * 128 * (2 * 512 + 64) * 1000
    assert a.kv_read_bytes(1000, tp=8, elem_bytes=1) == 1000 * 576  # the latent once, whatever tp
    assert a.decode_core_flops(1000, tp=8) == a.decode_core_flops(1000) / 8


def _hf_dicts():
    """config.json contents of each family (the published files' architecture keys)."""
    return {
        "deepseek-v3": dict(
            architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", hidden_size=7168,
            num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536,
            kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=256,
            num_experts_per_tok=8, moe_intermediate_size=2048, n_shared_experts=1, first_k_dense_replace=3,
            moe_layer_freq=1, intermediate_size=18432, vocab_size=129280, num_nextn_predict_layers=1,
            max_position_embeddings=163840, n_group=8, topk_group=4, routed_scaling_factor=2.5,
            scoring_func="sigmoid", topk_method="noaux_tc",
            rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096}),
        "kimi-k2": dict(
            architectures=["DeepseekV3ForCausalLM"], model_type="kimi_k2", hidden_size=7168, num_hidden_layers=61,
            num_attention_heads=64, num_key_value_heads=64, q_lora_rank=1536, kv_lora_rank=512,
            qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=384, num_experts_per_tok=8,
            moe_intermediate_size=2048, n_shared_experts=1, first_k_dense_replace=1, intermediate_size=18432,
            vocab_size=163840, num_nextn_predict_layers=0, max_position_embeddings=131072,
            rope_scaling={"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096}),
        "gpt-oss-120b": dict(
            architectures=["GptOssForCausalLM"], model_type="gpt_oss", num_hidden_layers=36, num_local_experts=128,
            vocab_size=201088, hidden_size=2880, intermediate_size=2880, head_dim=64, num_attention_heads=64,
            num_key_value_heads=8, sliding_window=128, num_experts_per_tok=4, attention_bias=True,
            max_position_embeddings=131072, layer_types=["sliding_attention", "full_attention"] * 18,
            rope_scaling={"rope_type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096}),
        "glm-4.5": dict(
            architectures=["Glm4MoeForCausalLM"], model_type="glm4_moe", hidden_size=5120, num_hidden_layers=92,
            num_attention_heads=96, num_key_value_heads=8, head_dim=128, attention_bias=True,
            intermediate_size=12288, moe_intermediate_size=1536, n_routed_experts=160, n_shared_experts=1,
            first_k_dense_replace=3, vocab_size=151552, num_nextn_predict_layers=1, use_qk_norm=True,
            num_experts_per_tok=8, max_position_embeddings=131072, partial_rotary_factor=0.5),
    }


@pytest.mark.parametrize("name", NEW)
def test_hf_config_of_each_family_loads_as_its_preset(tmp_path, name):
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(_hf_dicts()[name]))
    m = ModelSpec.from_hf_config(d / "config.json")
    p = get_model(name)
    keep = {"name", "source"}
    assert m.model_dump(exclude=keep) == p.model_dump(exclude=keep)
    assert m.max_context == p.max_context and m.name == name


@pytest.mark.parametrize("name,key,value,needle", [
    ("deepseek-v3", "kv_lora_rank", "512", "kv_lora_rank must be an integer"),
    ("deepseek-v3", "first_k_dense_replace", 99, "first_k_dense_replace must be in [0, num_hidden_layers=61]"),
    ("deepseek-v3", "attention_bias", True, "attention_bias=true is not supported for MLA"),
    ("gpt-oss-120b", "layer_types", ["sliding_attention", "chunked"] * 18, "layer_types entries must be"),
    ("gpt-oss-120b", "sliding_window", 0, "sliding_window must be > 0"),
    ("glm-4.5", "n_routed_experts", 10**9, "n_routed_experts must be at most"),
])
def test_malformed_family_config_is_one_line(tmp_path, name, key, value, needle):
    cfg = {**_hf_dicts()[name], key: value}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UserError) as e:
        ModelSpec.from_hf_config(tmp_path / "config.json")
    msg = str(e.value)
    assert needle in msg and "\n" not in msg and str(tmp_path) in msg


def _hf_param_count(model_type: str, **kw) -> int:
    """Parameters of transformers' own model for a config (built on the meta device: no memory)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    cfg = transformers.CONFIG_MAPPING[model_type](**kw)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(cfg)
    n = sum(p.numel() for p in model.parameters())
    # buffers that are weights of the checkpoint (DeepSeek/GLM e_score_correction_bias)
    n += sum(b.numel() for name, b in model.named_buffers() if "e_score_correction_bias" in name)
    return n


TINY = {
    "deepseek_v3": dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4,
                        q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=12,
                        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=20, n_shared_experts=2,
                        first_k_dense_replace=1, intermediate_size=48, vocab_size=97, n_group=2, topk_group=1,
                        num_nextn_predict_layers=0),
    "gpt_oss": dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                    num_local_experts=8, num_experts_per_tok=2, intermediate_size=24, vocab_size=97, sliding_window=8,
                    layer_types=["sliding_attention", "full_attention"] * 2),
    "glm4_moe": dict(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                     attention_bias=True, use_qk_norm=True, n_routed_experts=8, num_experts_per_tok=2,
                     moe_intermediate_size=20, n_shared_experts=1, first_k_dense_replace=1, intermediate_size=48,
                     vocab_size=97, num_nextn_predict_layers=0, n_group=1, topk_group=1),
}


@pytest.mark.parametrize("model_type", TINY)
def test_param_count_equals_transformers_model(tmp_path, model_type):
    """Every parameter transformers builds for a config, counted by ModelSpec from the same config.json."""
    kw = TINY[model_type]
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type, **kw}))
    m = ModelSpec.from_hf_config(tmp_path / "config.json")
    assert m.total_params() == _hf_param_count(model_type, **kw)
