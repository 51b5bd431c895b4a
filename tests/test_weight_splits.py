"""The per-kind weight-split table (``engine.real.weight_splits.SPLITS``): every weight either weight path
makes has an entry, the random and state-dict paths name and shape a layer's weights alike, and slicing by the
table partitions each split weight over its group (the ranks' slices, in rank order, are the full tensor)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tiny_families import tiny_hf_family  # noqa: E402
from torch_config_cases import MODEL_TYPE, TINY_ALL  # noqa: E402

from rackbed.engine.real import families, model  # noqa: E402
from rackbed.engine.real.config import TorchModelConfig  # noqa: E402
from rackbed.engine.real.model import Shard  # noqa: E402
from rackbed.engine.real.weight_splits import SPLITS, WHOLE, Split, shard_weights, split_of, take  # noqa: E402


def _cfg(family: str, **over) -> TorchModelConfig:
    return TorchModelConfig.from_hf({"model_type": MODEL_TYPE[family], **TINY_ALL[family], **over})


def _layers(cfg: TorchModelConfig) -> range:
    return range(cfg.n_layers + (1 if cfg.runs_mtp else 0))


def _random(cfg: TorchModelConfig, li: int) -> dict:
    if cfg.family == "qwen3_moe":
        return model.random_layer_weights(cfg, li, 0, "cpu", torch.float32)
    return families.random_layer(cfg, li, 0, "cpu", torch.float32)


FAMILIES = sorted(TINY_ALL)


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_every_weight_of_both_paths_has_an_entry_and_both_paths_agree(family):
    """The random path and the state-dict path give layer weights of the same names and shapes, and the table
    covers every name (the MTP module's too)."""
    over = {"num_nextn_predict_layers": 1} if family in ("deepseek_v3", "glm4_moe") else {}
    cfg = _cfg(family, **over)
    if family == "qwen3_moe":
        from tiny_qwen3moe import tiny_hf_model

        state = tiny_hf_model()[1].state_dict()
        hf = lambda li: model.hf_layer_weights(state, cfg, li)  # noqa: E731
    else:
        state = tiny_hf_family(family, **over)[1].state_dict()
        hf = lambda li: families.hf_layer(state, cfg, li)  # noqa: E731
    for li in _layers(cfg):
        rnd = _random(cfg, li)
        assert set(rnd) <= set(SPLITS[cfg.kind(li)]), (li, set(rnd) - set(SPLITS[cfg.kind(li)]))
        if li < cfg.n_layers:       # transformers' models hold no MTP module
            ck = hf(li)
            shapes = {k: tuple(v.shape) for k, v in ck.items()}
            assert {k: tuple(v.shape) for k, v in rnd.items()} == shapes, li


def test_a_weight_the_table_lacks_is_an_error():
    cfg = _cfg("glm4_moe")
    with pytest.raises(KeyError, match="'mystery' has no entry"):
        split_of(cfg, 0, "mystery")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@pytest.mark.parametrize("family", FAMILIES)
@given(data=st.data())
def test_ranks_slices_partition_every_split_weight(family, data):
    """Over a TP group that divides the heads (and the KV heads) and an EP group that divides the experts,
    each weight split by heads, experts or F is the concatenation of the ranks' slices (a fused gate/up: per
    half); a whole weight is the full tensor on every rank."""
    cfg = _cfg(family)
    li = data.draw(st.sampled_from([i for i in _layers(cfg)]))
    full = _random(cfg, li)
    linear = cfg.kind(li) == "linear"
    heads = cfg.n_q_heads if cfg.is_mla else min(cfg.n_q_heads, cfg.n_kv_heads)
    ffn = [t.shape[-1] for k, t in full.items() if k in ("mlp_down", "shared_down")]
    tps = [d for d in _divisors(heads) if all(f % d == 0 for f in ffn)]
    tp = 1 if linear else data.draw(st.sampled_from(tps))
    ep = data.draw(st.sampled_from(_divisors(cfg.n_experts)))
    world = max(tp, ep)
    shards = [Shard(attn_tp=tp, attn_rank=r % tp, ep=ep, ep_rank=r % ep) for r in range(world)]
    parts = [shard_weights(full, cfg, s, li) for s in shards]
    for name, t in full.items():
        sp = split_of(cfg, li, name)
        if sp.over in ("whole", "one_rank"):
            assert all(p[name] is t for p in parts), name
            continue
        n = tp if sp.over != "experts" else ep
        got = [parts[r][name] for r in range(n)]
        halves = [torch.cat([g.chunk(sp.halves, sp.dim)[h] for g in got], sp.dim) for h in range(sp.halves)]
        assert torch.equal(torch.cat(halves, sp.dim), t), (name, tp, ep)


def test_kv_heads_replicate_beyond_the_kv_head_count():
    """tp = 8 over 2 KV heads: each rank's k_proj is the rows of the one KV head its query heads read."""
    cfg = _cfg("qwen3_moe")
    full = _random(cfg, 0)
    Dh = cfg.head_dim
    for r in range(8):
        k = shard_weights(full, cfg, Shard(attn_tp=8, attn_rank=r), 0)["k_proj"]
        h = r // 4
        assert torch.equal(k, full["k_proj"][h * Dh:(h + 1) * Dh])


def test_split_errors_are_one_line():
    cfg = _cfg("qwen3_5_moe")
    with pytest.raises(ValueError, match=r"Gated DeltaNet layers run on one attention rank \(attn_tp=2\)"):
        shard_weights(_random(cfg, 0), cfg, Shard(attn_tp=2, attn_rank=0), 0)
    gu = torch.zeros(2 * 6, 4)
    with pytest.raises(ValueError, match="tp=4 does not divide the MLP width 6"):
        take(gu, Split("ffn", 0, halves=2), cfg, Shard(attn_tp=4, attn_rank=1))
    assert take(gu, WHOLE, cfg, Shard(attn_tp=4)) is gu
