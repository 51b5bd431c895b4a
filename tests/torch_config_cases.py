"""The inputs on which ``TorchModelConfig`` is held to recorded values
(``tests/data/torch_config_expected.json``): every family's tiny test config as a transformers object, as the
config.json ``save_pretrained`` writes, as a plain dict with variations, as a bare ``{"model_type": ...}``
(transformers' defaults throughout), and every shipped preset through ``from_spec`` (a helper module for
``test_torch_config_expected.py``; running it as a script re-records the data file)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from tiny_families import TINY

EXPECTED = Path(__file__).parent / "data" / "torch_config_expected.json"

#: the tiny Qwen3-MoE of ``tiny_qwen3moe.tiny_hf_model``
QWEN_TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                 head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                 intermediate_size=128, vocab_size=128, norm_topk_prob=True, max_position_embeddings=512,
                 tie_word_embeddings=False)
TINY_ALL = {"qwen3_moe": QWEN_TINY, **TINY}
#: the transformers model_type of each family's text model
MODEL_TYPE = {"qwen3_moe": "qwen3_moe", "deepseek_v3": "deepseek_v3", "gpt_oss": "gpt_oss",
              "glm4_moe": "glm4_moe", "qwen3_5_moe": "qwen3_5_moe_text"}
CONFIG_CLASS = {"qwen3_moe": "Qwen3MoeConfig", "deepseek_v3": "DeepseekV3Config", "gpt_oss": "GptOssConfig",
                "glm4_moe": "Glm4MoeConfig", "qwen3_5_moe": "Qwen3_5MoeTextConfig"}

#: config keys changed from the tiny config: each switches a feature the reader handles
VARIANTS = {
    "qwen3_moe": [{}, {"norm_topk_prob": False},
                  {"rope_parameters": {"rope_type": "yarn", "rope_theta": 5e5, "factor": 4.0,
                                       "original_max_position_embeddings": 128}},
                  {"num_local_experts": 8, "num_experts": None}, {"head_dim": None}, {"rms_norm_eps": 1e-5},
                  {"tie_word_embeddings": True}, {"rope_theta": 1e6, "rope_scaling": None},
                  {"rope_theta": 1e6, "rope_scaling": {"type": "yarn", "factor": 4.0,
                                                       "original_max_position_embeddings": 128}}],
    "deepseek_v3": [{}, {"num_nextn_predict_layers": 1}, {"q_lora_rank": None}, {"first_k_dense_replace": 0},
                    {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}},
                    {"rope_interleave": False},
                    {"tie_word_embeddings": True}, {"n_shared_experts": 2}, {"routed_scaling_factor": None},
                    {"rope_parameters": None, "rope_theta": 2e4,   # a transformers 4 config.json
                     "rope_scaling": {"type": "yarn", "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                                      "original_max_position_embeddings": 64, "beta_fast": 32,
                                      "beta_slow": 1}}],
    "gpt_oss": [{}, {"layer_types": ["full_attention", "sliding_attention"]}, {"swiglu_limit": 7.0},
                {"sliding_window": 4}, {"rope_parameters": {"rope_type": "default", "rope_theta": 150000.0}},
                {"rope_parameters": None}, {"swiglu_limit": None, "attention_bias": False}],
    "glm4_moe": [{}, {"num_nextn_predict_layers": 1}, {"use_qk_norm": False}, {"attention_bias": False},
                 {"head_dim": None}, {"tie_word_embeddings": True}, {"first_k_dense_replace": 2},
                 {"partial_rotary_factor": None,
                  "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}},
                 {"rope_parameters": None, "rope_theta": 1e6, "partial_rotary_factor": 0.25}],
    "qwen3_5_moe": [{}, {"layer_types": None, "full_attention_interval": 2}, {"mtp_num_hidden_layers": 1},
                    {"linear_value_head_dim": 16}, {"shared_expert_intermediate_size": 0},
                    {"rope_parameters": None, "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                     "rope_scaling": {"rope_type": "default", "mrope_section": [11, 11, 10]}}],
}


def _drop_none(d: dict) -> dict:
    return {k: v for k, v in d.items() if v is not None}


def cases() -> list[str]:
    """Case ids: ``family/how[/variant]``, ``bare/model_type``, ``preset/name[/n_layers]``."""
    out = []
    for fam in TINY_ALL:
        out += [f"{fam}/object", f"{fam}/saved", f"{fam}/spec"]
        out += [f"{fam}/dict/{i}" for i in range(len(VARIANTS[fam]))]
    out += ["deepseek_v3/kimi_k2", "qwen3_5_moe/multimodal", "qwen3_5_moe/multimodal-saved"]
    out += [f"bare/{t}" for t in ("qwen3_moe", "deepseek_v3", "kimi_k2", "gpt_oss", "glm4_moe", "qwen3_5_moe",
                                  "qwen3_5_moe_text")]
    from rackbed.engine.core.model import PRESET_NAMES

    out += [f"preset/{p}" for p in PRESET_NAMES] + [f"preset/{p}/4" for p in PRESET_NAMES]
    return out


def build(case: str, tmp: Path):
    """The ``TorchModelConfig`` of ``case`` (``tmp``: a folder for config.json files)."""
    from rackbed.engine.core.model import ModelSpec, get_model
    from rackbed.engine.real.config import TorchModelConfig

    parts = case.split("/")
    if parts[0] == "preset":
        n = int(parts[2]) if len(parts) > 2 else None
        return TorchModelConfig.from_spec(get_model(parts[1]), n_layers=n)
    if parts[0] == "bare":
        return TorchModelConfig.from_hf({"model_type": parts[1]})
    fam, how = parts[0], parts[1]
    if how == "dict":
        over = VARIANTS[fam][int(parts[2])]
        return TorchModelConfig.from_hf(_drop_none({"model_type": MODEL_TYPE[fam], **TINY_ALL[fam], **over}))
    if how == "kimi_k2":
        return TorchModelConfig.from_hf({"model_type": "kimi_k2", **TINY_ALL[fam]})
    import transformers

    hc = getattr(transformers, CONFIG_CLASS[fam])(**TINY_ALL[fam])
    saved = json.loads(hc.to_json_string(use_diff=True))
    if how == "object":
        return TorchModelConfig.from_hf(hc)
    if how == "saved":
        return TorchModelConfig.from_hf(saved)
    if how == "multimodal":
        return TorchModelConfig.from_hf({"model_type": "qwen3_5_moe", "text_config": TINY_ALL[fam]})
    if how == "multimodal-saved":
        return TorchModelConfig.from_hf({"model_type": "qwen3_5_moe", "text_config": saved})
    if how == "spec":
        if fam == "qwen3_5_moe":     # a ModelSpec has one linear head dim
            hc.linear_value_head_dim = hc.linear_key_head_dim
        sub = tmp / case.replace("/", "-")
        hc.save_pretrained(sub)
        return TorchModelConfig.from_spec(ModelSpec.from_hf_config(sub / "config.json"))
    raise ValueError(case)


def fields(cfg) -> dict:
    """Every dataclass field of ``cfg`` as JSON values (tuples as lists)."""
    return json.loads(json.dumps({f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}))


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        data = {c: fields(build(c, Path(d))) for c in cases()}
    EXPECTED.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    print(f"{len(data)} cases -> {EXPECTED}")
