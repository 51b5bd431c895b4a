"""A tiny random Qwen3-MoE from transformers (no download), its checkpoint, and the scenario the real-engine
tests run on it (a helper module: the tests import it by name under `pytest` and `python -m pytest` alike)."""

from __future__ import annotations

from pathlib import Path


def tiny_hf_model(seed: int = 0):
    """``(config, model)``: 2 layers, hidden 64, 8 q / 2 kv heads, 8 experts top-2, vocab 128, random weights with
    norms near 1 (so layers do not collapse)."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    hc = Qwen3MoeConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                        head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                        intermediate_size=128, vocab_size=128, norm_topk_prob=True, max_position_embeddings=512,
                        tie_word_embeddings=False)
    hf = Qwen3MoeForCausalLM(hc).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            p.copy_(torch.randn_like(p) * 0.1 + (1.0 if "norm" in name else 0.0))
    return hc, hf


def save_checkpoint(hc, hf, directory: Path) -> Path:
    """config.json + model.safetensors in ``directory`` (what ``real.weights`` points at)."""
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    hc.save_pretrained(directory)
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, str(directory / "model.safetensors"))
    return directory


def tiny_checkpoint(directory: Path):
    """``(config, model, folder)``: :func:`tiny_hf_model` saved under ``directory/ckpt``."""
    hc, hf = tiny_hf_model()
    return hc, hf, save_checkpoint(hc, hf, directory / "ckpt")


def real_scenario(ckpt: Path, **over):
    """The scenario the real-engine tests run on a tiny checkpoint: one TP=2 prefiller and two decoders on an
    HGX H200's GPU ids (CPU processes here), 10 short requests; ``over`` replaces top-level fields."""
    from rackbed.sim.scenario import parse_scenario

    data = {"name": "cpu-real", "topology": "hgx-h200", "model": str(ckpt / "config.json"), "weight_format": "bf16",
            "prefill": {"tp": 2, "ep": 2, "replicas": 1, "max_batch_tokens": 256},
            "decode": {"ep": 1, "replicas": 2, "max_batch_per_rank": 4, "page_tokens": 4},
            "mtp": {"draft_k": 0},
            "workload": {"kind": "synthetic", "arrival": {"kind": "poisson", "rate_per_s": 20},
                         "prompt": {"kind": "uniform", "lo": 5, "hi": 30},
                         "output": {"kind": "uniform", "lo": 2, "hi": 8}, "n_requests": 10, "seed": 1}}
    data.update(over)
    return parse_scenario(data)
