"""Tiny random DeepSeek-V3 (MLA), gpt-oss (sliding window + sinks), GLM-4.5 (partial rotary, q/k/v bias) and
Qwen3.5-MoE (Gated DeltaNet layers between gated full-attention layers) models from transformers (no download), for
the real-engine family tests."""

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
    "qwen3_5_moe": dict(vocab_size=128, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                        linear_key_head_dim=16, linear_value_head_dim=8, linear_conv_kernel_dim=4,
                        layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
                        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                        shared_expert_intermediate_size=32, max_position_embeddings=512, tie_word_embeddings=False,
                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                         "partial_rotary_factor": 0.25}),
}


def tiny_hf_family(family: str, seed: int = 0, **over):
    """``(config, model)`` of ``family`` with seeded random weights: norms near 1, biases, sinks and the routing
    correction bias random too (so every term the engine implements moves the logits). ``over``: config keys
    changed from ``TINY``'s."""
    import torch
    import transformers as tf

    cls = {"deepseek_v3": (tf.DeepseekV3Config, tf.DeepseekV3ForCausalLM),
           "gpt_oss": (tf.GptOssConfig, tf.GptOssForCausalLM),
           "glm4_moe": (tf.Glm4MoeConfig, tf.Glm4MoeForCausalLM),
           "qwen3_5_moe": (tf.Qwen3_5MoeTextConfig, tf.Qwen3_5MoeForCausalLM)}[family]
    torch.manual_seed(seed)
    hc = cls[0](**{**TINY[family], **over})
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


# -- sharded runs (spawned ranks import this module, not the test's: no transformers import in the children) --------


def _table(pts):
    import torch

    width = max(len(pt) for pt in pts)
    return torch.tensor([pt + [pt[0]] * (width - len(pt)) for pt in pts])


def _prefill(cfg, shard, comm, seed):
    import torch

    from rackbed.engine.real.families import ShardedMoeLM

    m = ShardedMoeLM.random(cfg, shard, comm, seed=seed)
    g = torch.Generator().manual_seed(seed + 7)
    prompts = [torch.randint(0, cfg.vocab, (n,), generator=g) for n in (9, 4, 13)]
    cache = m.new_cache(32, 4)
    return m.forward_prefill(prompts, cache, [cache.alloc(len(p)) for p in prompts])


def _dp_ep_decode(cfg, rank, world, group, seed, steps=3):
    """Each DP rank decodes its own batch for ``steps`` steps with the EP-sharded model; returns the largest logit
    difference against the unsharded model and whether the greedy tokens agree."""
    import torch

    from rackbed.engine.real.comm import Comm
    from rackbed.engine.real.families import ShardedMoeLM
    from rackbed.engine.real.model import Shard

    m = ShardedMoeLM.random(cfg, Shard(attn_tp=1, ep=world, ep_rank=rank), Comm(ep_group=group), seed=seed)
    full = ShardedMoeLM.random(cfg, Shard(), Comm(), seed=seed)
    g = torch.Generator().manual_seed(seed + rank)
    prompts = [torch.randint(0, cfg.vocab, (5 + 3 * i,), generator=g) for i in range([3, 1][rank % 2])]
    err, same = 0.0, True
    caches = []
    for _ in range(2):
        cache = full.new_cache(32, 4)
        pts = [cache.alloc(len(p) + steps) for p in prompts]
        full.forward_prefill(prompts, cache, pts)
        caches.append((cache, _table(pts)))
    last = torch.tensor([int(p[-1]) for p in prompts])
    pos = torch.tensor([len(p) for p in prompts])
    ta = tb = last
    for _ in range(steps):
        a = m.forward_decode(ta, pos, caches[0][0], caches[0][1])
        b = full.forward_decode(tb, pos, caches[1][0], caches[1][1])
        err = max(err, (a - b).abs().max().item())
        ta, tb = a.argmax(-1), b.argmax(-1)
        same &= bool((ta == tb).all())
        pos = pos + 1
    return err, same


def _all_cases_rank(rank, world, cfgs, seed):
    import torch.distributed as dist

    from rackbed.engine.real.comm import Comm
    from rackbed.engine.real.model import Shard

    group = dist.new_group(list(range(world)))
    out = {}
    for fam, cfg in cfgs.items():
        for tp, ep in [(2, 2), (2, 1)] if fam == "deepseek_v3" else [(2, 2)]:
            shard = Shard(attn_tp=tp, attn_rank=rank % tp, ep=ep, ep_rank=rank % ep)
            comm = Comm(tp_group=group if tp > 1 else None, ep_group=group if ep > 1 else None)
            out[(fam, tp, ep)] = _prefill(cfg, shard, comm, seed)
        out[(fam, "decode")] = _dp_ep_decode(cfg, rank, world, group, seed)
    return out
