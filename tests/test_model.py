"""rackbed.engine.core.model: presets, parameter / byte / FLOP / KV / state arithmetic against hand calculations.

Hand calculations are written out term by term (sizes from the models' Hugging Face config.json files);
properties over random specs (hypothesis) tie the methods to each other.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from rackbed.engine.core.formats import FORMAT_NAMES, get_format
from rackbed.engine.core.model import DELTANET_FLOPS_PER_STATE_ELEM, PRESET_NAMES, ModelSpec, get_model

# ---- Qwen3-235B-A22B by hand
# ----------------------------------------------------------------------------------
H, L, V = 4096, 94, 151936
EMB = V * H  # 622,329,856
ATTN_PROJ = H * 64 * 128 + 2 * H * 4 * 128 + 64 * 128 * H  # q, k+v, o = 71,303,168
QK_NORM = 2 * 128
EXPERT = 3 * H * 1536  # 18,874,368
ROUTER = 128 * H
NORMS = 2 * H * L + H
TOTAL_235B = 2 * EMB + L * (ATTN_PROJ + QK_NORM + 128 * EXPERT + ROUTER) + NORMS
ACTIVE_235B = 2 * EMB + L * (ATTN_PROJ + QK_NORM + 8 * EXPERT + ROUTER) + NORMS

# ---- Qwen3.5-397B-A17B by hand (60 layers: 45 Gated DeltaNet + 15 gated attention)
# ------------------------------
H5, V5 = 4096, 248320
GATED_ATTN_PROJ = H5 * (32 * 256 * 2) + 2 * H5 * 2 * 256 + 32 * 256 * H5  # q+gate, k+v, o
GATED_ATTN = GATED_ATTN_PROJ + 2 * 256  # + q/k norm
KEY_DIM, VALUE_DIM = 16 * 128, 64 * 128
DELTANET_PROJ = H5 * (2 * KEY_DIM + 2 * VALUE_DIM) + H5 * 2 * 64 + VALUE_DIM * H5  # qkvz, ba, out
DELTANET = DELTANET_PROJ + (2 * KEY_DIM + VALUE_DIM) * 4 + 2 * 64 + 128  # conv1d, A_log + dt_bias, norm
EXPERT5 = 3 * H5 * 1024
MOE5 = 512 * EXPERT5 + 512 * H5 + (EXPERT5 + H5)  # routed + router + shared (+ its sigmoid gate)
TOTAL_397B = 2 * V5 * H5 + 15 * GATED_ATTN + 45 * DELTANET + 60 * MOE5 + 2 * H5 * 60 + H5
MTP_397B = 2 * H5 * H5 + 3 * H5 + 2 * H5 + GATED_ATTN + MOE5


def test_qwen3_235b_params_by_hand():
    m = get_model("qwen3-235b-a22b")
    assert m.params_attention_layer("full") == ATTN_PROJ + QK_NORM == 71_303_424
    assert m.params_expert() == EXPERT == 18_874_368
    assert m.params_moe_layer() == 128 * EXPERT + ROUTER
    assert m.total_params() == TOTAL_235B == 235_093_634_560
    assert m.active_params() == ACTIVE_235B == 22_190_763_520
    assert abs(m.total_params() / 235e9 - 1) < 0.001 and abs(m.active_params() / 22e9 - 1) < 0.01


def test_qwen3_235b_kv_bytes_exact():
    m = get_model("qwen3-235b-a22b")
    assert m.kv_bytes_per_token() == 94 * 2 * 4 * 128 * 2 == 192_512
    assert m.kv_bytes_per_token(elem_bytes=1) == 96_256
    assert m.linear_state_bytes_per_seq() == 0


def test_qwen35_397b_params_by_hand():
    m = get_model("qwen3.5-397b-a17b")
    assert m.layer_types[:4] == ("linear", "linear", "linear", "full") and m.n_full_layers == 15
    assert m.params_attention_layer("full") == GATED_ATTN
    assert m.params_attention_layer("linear") == DELTANET == 118_014_208
    assert m.params_moe_layer() == MOE5
    assert m.total_params() == TOTAL_397B
    assert m.params_mtp_layer() == MTP_397B
    assert m.total_params(include_mtp=True) == TOTAL_397B + MTP_397B
    active = TOTAL_397B - 60 * (512 - 10) * EXPERT5
    assert m.active_params() == active
    assert m.active_params(include_mtp=True) == active + MTP_397B - (512 - 10) * EXPERT5
    # published: 397B total (the vision encoder, not modelled, makes up most of the 0.16 % gap), 17B active
    assert abs(m.total_params() / 397e9 - 1) < 0.005 and abs(m.active_params() / 17e9 - 1) < 0.03


def test_qwen35_397b_kv_and_linear_state_by_hand():
    m = get_model("qwen3.5-397b-a17b")
    assert m.kv_bytes_per_token() == 15 * 2 * 2 * 256 * 2 == 30_720
    assert m.kv_bytes_per_token(include_mtp=True) == 16 * 2 * 2 * 256 * 2
    state = 64 * 128 * 128  # v_heads x k_dim x v_dim
    conv = (4 - 1) * (2 * KEY_DIM + VALUE_DIM)
    assert m.linear_state_bytes_per_seq() == 45 * (state + conv) * 2 == 97_689_600
    assert m.linear_state_bytes_per_seq(4, conv_elem_bytes=2) == 45 * (state * 4 + conv * 2)


@pytest.mark.parametrize(
    "name, total, active, total_tol, active_tol",
    [
        ("qwen3-235b-a22b", 235e9, 22e9, 0.001, 0.01),
        ("qwen3-30b-a3b", 30.5e9, 3.3e9, 0.002, 0.02),
        ("qwen3.5-397b-a17b", 397e9, 17e9, 0.005, 0.03),
        ("qwen3.5-122b-a10b", 122e9, 10e9, 0.002, 0.03),
    ],
)
def test_presets_match_published_counts(name, total, active, total_tol, active_tol):
    m = get_model(name)
    assert m.name == name
    assert abs(m.total_params() / total - 1) < total_tol
    assert abs(m.active_params() / active - 1) < active_tol


def test_qwen35_122b_and_30b_shapes():
    m = get_model("qwen3.5-122b-a10b")
    assert (m.n_layers, m.n_full_layers, m.n_linear_layers, m.n_mtp_layers) == (48, 12, 36, 1)
    assert m.kv_bytes_per_token() == 12 * 2 * 2 * 256 * 2
    assert get_model("qwen3-30b-a3b").kv_bytes_per_token() == 48 * 2 * 4 * 128 * 2


def test_preset_contexts_are_the_published_ones():
    """max_position_embeddings of each preset's config.json (Qwen3: 40,960 native, 131,072 only with YaRN)."""
    assert {n: get_model(n).max_context for n in PRESET_NAMES} == {
        "qwen3-235b-a22b": 40960, "qwen3-30b-a3b": 40960, "qwen3.5-397b-a17b": 262144, "qwen3.5-122b-a10b": 262144,
        "deepseek-v3": 163840, "deepseek-r1": 163840, "kimi-k2": 131072, "gpt-oss-120b": 131072, "glm-4.5": 131072}
    m = get_model("qwen3-30b-a3b")
    assert "max_context" not in m.model_dump() and "max_context" not in m.model_dump_json()
    # fields of the later families stay out of a Qwen spec's dumps (run records and sweep keys unchanged)
    assert "kv_lora_rank" not in m.model_dump() and "attn_sinks" not in m.model_dump_json()
    d = get_model("deepseek-v3").model_dump()
    assert d["kv_lora_rank"] == 512 and d["shared_expert_gate"] is False and "attn_sinks" not in d
    assert ModelSpec.model_validate(d) == get_model("deepseek-v3").model_copy(update={"max_context": None})
    from rackbed.sim.scenario import truncate_model

    assert truncate_model(m, 2).max_context == 40960  # rebuilt from model_dump, which leaves the field out


def test_weight_bytes_by_hand():
    m = get_model("qwen3-235b-a22b")
    quant = L * (ATTN_PROJ + 128 * EXPERT)
    rest = TOTAL_235B - quant  # embeddings, lm_head, norms, routers, qk norms stay bf16
    assert m.quantizable_params() == quant
    assert m.weight_bytes("bf16") == 2 * TOTAL_235B
    assert m.weight_bytes("mxfp8") == quant * (1 + 1 / 32) + rest * 2
    assert m.weight_bytes("nvfp4") == quant * (0.5 + 1 / 16) + rest * 2
    assert m.weight_bytes("fp8_block") == quant * (1 + 4 / 128**2) + rest * 2
    with pytest.raises(ValueError, match="unknown numeric format"):
        m.weight_bytes("int3")


def test_flops_by_hand_decode_and_prefill():
    m = get_model("qwen3-235b-a22b")
    d = m.flops_breakdown("decode", 1000)
    assert d["attn_proj"] == 2 * L * ATTN_PROJ
    assert d["attn_core"] == 4 * 64 * 128 * 1000 * L
    assert d["moe_experts"] == 2 * L * 8 * EXPERT
    assert d["router"] == 2 * L * ROUTER
    assert d["lm_head"] == 2 * V * H
    assert d["linear_core"] == d["linear_proj"] == d["moe_shared"] == d["dense_mlp"] == 0
    assert m.flops_per_token("decode", 1000) == sum(d.values())
    p = m.flops_breakdown("prefill", 6000)
    assert p["attn_core"] == 4 * 64 * 128 * (6000 + 1) / 2 * L  # average causal context
    assert p["lm_head"] == 2 * V * H / 6000  # logits for the last prompt token only
    assert p["moe_experts"] == d["moe_experts"]
    # ~2 x active params per token (embedding lookup is not a matmul), plus attention
    assert d["attn_proj"] + d["moe_experts"] + d["router"] + d["lm_head"] == 2 * (
        ACTIVE_235B - EMB - NORMS - L * QK_NORM
    )


def test_flops_deltanet_by_hand():
    m = get_model("qwen3.5-397b-a17b")
    d = m.flops_breakdown("decode", 4096)
    per_layer_state = DELTANET_FLOPS_PER_STATE_ELEM * 64 * 128 * 128 + 2 * 4 * (2 * KEY_DIM + VALUE_DIM)
    assert d["linear_core"] == 45 * per_layer_state
    assert d["linear_proj"] == 2 * 45 * DELTANET_PROJ
    assert d["attn_core"] == 4 * 32 * 256 * 4096 * 15
    assert d["attn_proj"] == 2 * 15 * GATED_ATTN_PROJ
    assert d["moe_shared"] == 2 * 60 * EXPERT5 and d["router"] == 2 * 60 * (512 * H5 + H5)
    assert m.flops_breakdown("prefill", 4096)["linear_core"] == d["linear_core"]  # no context dependence


def test_flops_argument_errors():
    m = get_model("qwen3-30b-a3b")
    for bad in [
        dict(phase="train", context_len=1),
        dict(phase="decode", context_len=0),
        dict(phase="prefill", context_len=1.5),
        dict(phase="prefill", context_len=8, prefix_len=-1),
        dict(phase="decode", context_len=8, prefix_len=4),
    ]:
        with pytest.raises(ValueError):
            m.flops_breakdown(**bad)


# ---- properties over random specs
# -----------------------------------------------------------------------------


@st.composite
def specs(draw) -> ModelSpec:
    n_layers = draw(st.integers(1, 12))
    n_kv = draw(st.integers(1, 4))
    linear = draw(st.booleans())
    n_experts = draw(st.integers(0, 16))
    layer_types = tuple(
        draw(
            st.lists(
                st.sampled_from(["full", "linear"] if linear else ["full"]),
                min_size=n_layers,
                max_size=n_layers,
            )
        )
    )
    dense = sorted(draw(st.sets(st.integers(0, n_layers - 1)))) if n_experts else []
    k_heads = draw(st.integers(1, 4))
    return ModelSpec(
        name="random",
        hidden=draw(st.integers(8, 256)),
        n_layers=n_layers,
        layer_types=layer_types,
        n_q_heads=n_kv * draw(st.integers(1, 4)),
        n_kv_heads=n_kv,
        head_dim=draw(st.sampled_from([16, 32, 64])),
        qk_norm=draw(st.booleans()),
        gated_attn=draw(st.booleans()),
        linear_n_k_heads=k_heads if linear else 0,
        linear_n_v_heads=k_heads * draw(st.integers(1, 3)) if linear else 0,
        linear_head_dim=draw(st.sampled_from([8, 16])) if linear else 0,
        linear_conv=4 if linear else 0,
        n_experts=n_experts,
        top_k=draw(st.integers(1, n_experts)) if n_experts else 0,
        moe_intermediate=draw(st.integers(1, 64)) if n_experts else 0,
        n_shared_experts=draw(st.integers(0, 2)) if n_experts else 0,
        shared_intermediate=32,
        dense_intermediate=draw(st.integers(1, 128)) if (dense or not n_experts) else 0,
        dense_layers=tuple(dense),
        vocab=draw(st.integers(1, 1000)),
        tie_embeddings=draw(st.booleans()),
        n_mtp_layers=draw(st.integers(0, 2)),
    )


@settings(max_examples=100, deadline=None)
@given(m=specs())
def test_param_accounting_is_consistent(m):
    b = m.params_breakdown(include_mtp=True)
    assert sum(b.values()) == m.total_params(include_mtp=True) == m.total_params() + b["mtp"]
    assert b["mtp"] == m.n_mtp_layers * m.params_mtp_layer()
    per_layer = sum(
        m.params_attention_layer(t)
        + 2 * m.hidden
        + (m.params_moe_layer() if m.is_moe_layer(i) else m.params_dense_mlp())
        for i, t in enumerate(m.layer_types)
    )
    assert m.total_params() == b["embedding"] + b["lm_head"] + per_layer + m.hidden
    assert m.active_params() <= m.total_params()
    assert m.active_params(include_mtp=True) <= m.total_params(include_mtp=True)
    inactive = m.n_moe_layers * (m.n_experts - m.top_k) * m.params_expert()
    assert m.total_params() - m.active_params() == inactive
    assert 0 < m.quantizable_params() < m.total_params()
    assert m.weight_bytes("bf16", include_mtp=True) == 2 * m.total_params(include_mtp=True)
    sizes = sorted(FORMAT_NAMES, key=lambda f: get_format(f).bytes_per_element("weight"))
    wb = [m.weight_bytes(f) for f in sizes]
    assert wb == sorted(wb)


@settings(max_examples=100, deadline=None)
@given(m=specs(), n=st.integers(1, 300), prefix=st.integers(0, 300))
def test_prefill_attention_is_the_sum_of_decode_steps(m, n, prefix):
    """n prefill tokens after `prefix` cached ones cost what n decode steps at contexts prefix+1..prefix+n do."""
    pre = m.flops_breakdown("prefill", n, prefix_len=prefix)
    steps = [m.flops_breakdown("decode", prefix + i) for i in range(1, n + 1)]
    for key in pre:
        if key == "lm_head":
            assert pre[key] * n == pytest.approx(steps[0][key])  # one logits row per prompt
        else:
            assert pre[key] * n == pytest.approx(sum(s[key] for s in steps), rel=1e-12)
    assert m.flops_per_token("decode", 10) <= m.flops_per_token("decode", 11)


def test_validation_errors_are_one_line():
    base = get_model("qwen3-30b-a3b").model_dump()
    for change, match in [
        (dict(layer_types=("full",) * 3), "layer_types has 3 entries"),
        (dict(top_k=200), "top_k"),
        (dict(n_q_heads=30), "multiple of n_kv_heads"),
        (dict(layer_types=("linear",) * 48), "linear_n_k_heads must be > 0"),
        (dict(dense_layers=(3, 1)), "sorted"),
        (dict(dense_layers=(1,), dense_intermediate=0), "dense_intermediate"),
        (dict(n_experts=0, top_k=0), "dense_intermediate"),
        (dict(unknown_key=1), "Extra inputs"),
    ]:
        with pytest.raises(ValidationError, match=match):
            ModelSpec(**{**base, **change})
    m = get_model("qwen3-30b-a3b")
    with pytest.raises(ValidationError):
        m.hidden = 1  # frozen
    with pytest.raises(ValueError, match="out of range"):
        m.is_moe_layer(48)


def test_get_model_errors():
    with pytest.raises(ValueError, match="unknown model 'qwen9'.*qwen3-235b-a22b"):
        get_model("qwen9")
    with pytest.raises(FileNotFoundError):
        get_model("/nonexistent/config.json")
    assert set(PRESET_NAMES) == {"qwen3-235b-a22b", "qwen3-30b-a3b", "qwen3.5-397b-a17b", "qwen3.5-122b-a10b",
                                 "deepseek-v3", "deepseek-r1", "kimi-k2", "gpt-oss-120b", "glm-4.5"}


# ---- CLI
# ------------------------------------------------------------------------------------------------------------


def test_cli_model_show_and_list(capsys):
    from rackbed.engine.cli.main import main

    assert main(["model", "show", "qwen3-235b-a22b", "--context", "6000"]) == 0
    out = capsys.readouterr().out
    assert "192,512 B" in out and "235.094 G" in out and "22.191 G" in out
    for f in FORMAT_NAMES:
        assert f"weights {f}" in out
    assert main(["model", "list"]) == 0
    out = capsys.readouterr().out
    assert all(n in out for n in PRESET_NAMES)


def test_cli_model_show_json_config_file(tmp_path, capsys):
    from rackbed.engine.cli.main import main

    cfg = tmp_path / "tiny" / "config.json"
    cfg.parent.mkdir()
    cfg.write_text(
        json.dumps(
            dict(
                model_type="qwen3_moe",
                hidden_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=16,
                num_experts=4,
                num_experts_per_tok=2,
                moe_intermediate_size=32,
                vocab_size=100,
            )
        )
    )
    assert main(["model", "show", str(cfg), "--json", "--context", "10"]) == 0
    s = json.loads(capsys.readouterr().out)
    m = ModelSpec.from_hf_config(cfg)
    assert s["name"] == "tiny" and s["params"]["total"] == m.total_params()
    assert s["kv_bytes_per_token"]["bf16"] == 2 * 2 * 2 * 16 * 2
    assert sum(s["flops_per_token"]["decode"].values()) == m.flops_per_token("decode", 10)


def test_cli_model_errors(capsys, tmp_path):
    from rackbed.engine.cli.main import main

    assert main(["model", "show", "qwen9"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("rackbed: error: unknown model") and err.count("\n") == 1
    bad = tmp_path / "config.json"
    bad.write_text(json.dumps({"model_type": "llama"}))
    assert main(["model", "show", str(bad)]) == 2
    err = capsys.readouterr().err
    assert str(bad) in err and "qwen3_moe" in err and err.count("\n") == 1
    assert main(["model", "show", "qwen3-30b-a3b", "--context", "0"]) == 2
