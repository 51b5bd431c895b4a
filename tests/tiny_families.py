"""Tiny random DeepSeek-V3 (MLA), gpt-oss (sliding window + sinks) and GLM-4.5 (partial rotary, q/k/v bias) models
from transformers (no download), for the real-engine family tests."""

from __future__ import annotations

#: transformers config kwargs of each family: small enough for CPU, every feature the real models use switched on
#: (DeepSeek: q_lora, YaRN with mscale, interleaved rope, grouped routing, dense first layer, shared expert;
#: gpt-oss: alternating sliding/full layers, sinks, biases, clamped SwiGLU, YaRN; GLM: partial rotary, q/k/v bias,
#: qk-norm, sigmoid routing with scaling, dense first layer, shared expert).
TINY = {
    "deepseek_v3": dict(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
                        n_routed_experts=8, routed_scaling_factor=2.5, kv_lora_rank=32, q_lora_rank=48,
                        qk_rope_head_dim=8, v_head_dim=16, qk_nope_head_dim=16, n_group=4, topk_group=2,
                        num_experts_per_tok=2, first_k_dense_replace=1, norm_topk_prob=True,
                        max_position_embeddings=512, rope_interleave=True, tie_word_embeddings=False, eos_token_id=None,
                        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0,
                                         "original_max_position_embeddings": 64, "beta_fast": 32.0,
                                         "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}),
    "gpt_oss": dict(vocab_size=128, hidden_size=64, intermediate_size=32, num_hidden_layers=2, head_dim=16,
                    num_attention_heads=8, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2,
                    sliding_window=6, max_position_embeddings=512, tie_word_embeddings=False, swiglu_limit=1.5,
                    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "beta_fast": 32.0,
                                     "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64}),
    "glm4_moe": dict(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                     num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2, head_dim=16,
                     n_shared_experts=1, n_routed_experts=8, routed_scaling_factor=1.5, n_group=2, topk_group=1,
                     num_experts_per_tok=2, first_k_dense_replace=1, norm_topk_prob=True, use_qk_norm=True,
                     attention_bias=True, partial_rotary_factor=0.5, max_position_embeddings=512,
                     tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                                 "partial_rotary_factor": 0.5}),
}


def tiny_hf_family(family: str, seed: int = 0):
    """``(config, model)`` of ``family`` with seeded random weights: norms near 1, biases, sinks and the routing
    correction bias random too (so every term the engine implements moves the logits)."""
    import torch
    import transformers as tf

    cls = {"deepseek_v3": (tf.DeepseekV3Config, tf.DeepseekV3ForCausalLM),
           "gpt_oss": (tf.GptOssConfig, tf.GptOssForCausalLM),
           "glm4_moe": (tf.Glm4MoeConfig, tf.Glm4MoeForCausalLM)}[family]
    torch.manual_seed(seed)
    hc = cls[0](**TINY[family])
    hc._attn_implementation = "eager"
    hf = cls[1](hc).eval()
    with torch.no_grad():
        for name, p in list(hf.named_parameters()) + list(hf.named_buffers()):
            if not p.is_floating_point() or "inv_freq" in name:
                continue
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif "e_score_correction_bias" in name:
                p.copy_(0.05 * torch.randn_like(p))
            elif "sinks" in name:
                p.copy_(torch.randn_like(p))
            else:
                p.copy_(0.1 * torch.randn_like(p))
    return hc, hf
