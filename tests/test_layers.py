"""Layer kinds (engine.core.layers): each kind's facts against hand counts and published dimensions, the kinds a
ModelSpec builds against its flat fields, and sharding properties (partitioned KV sums to the whole; replicated KV
is whole on every rank)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rackbed.engine.core.kv import KvLayout
from rackbed.engine.core.layers import (
    DenseFfn,
    GdnAttention,
    GqaAttention,
    Layer,
    MlaAttention,
    MoeFfn,
    SlidingWindowAttention,
)
from rackbed.engine.core.model import get_model
from rackbed.engine.core.sharding import ParallelPlan
from rackbed.topology.errors import UserError

# DeepSeek-V3 (config.json): hidden 7168, 128 heads, q_lora_rank 1536, kv_lora_rank 512, qk_nope 128, qk_rope 64,
# v_head_dim 128
DSV3 = MlaAttention(hidden=7168, n_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128,
                    qk_rope_head_dim=64, v_head_dim=128)


def test_mla_deepseek_v3_facts():
    assert DSV3.kv_values_per_token() == 576                     # 512 latent + 64 shared rope key
    assert DSV3.kv_bytes_per_token(2) == 1152
    assert DSV3.kv_bytes_per_token(1) == 576
    # q_a 7168*1536 + q_b 1536*128*192 + kv_a 7168*576 + kv_b 512*128*256 + o 128*128*7168
    assert DSV3.proj_params() == 11_010_048 + 37_748_736 + 4_128_768 + 16_777_216 + 117_440_512 == 187_105_280
    assert DSV3.small_params() == 1536 + 512                      # q_a and kv_a RMSNorms
    assert DSV3.kv_tokens(10_000) == 10_000
    assert DSV3.state_bytes_per_seq() == 0
    # without q compression (DeepSeek-V2-Lite style) q_proj is hidden -> H * 192
    lite = MlaAttention(**{**DSV3.model_dump(), "q_lora_rank": 0})
    assert lite.proj_params() == 7168 * 128 * 192 + 4_128_768 + 16_777_216 + 117_440_512


def test_mla_is_replicated_under_attention_tp():
    assert DSV3.kv_tp_sharding == "replicated"
    for tp in (1, 2, 8, 16):
        assert DSV3.kv_shards(tp) == ((0,),) * tp
        assert DSV3.kv_bytes_per_token_per_rank(tp, 2) == 1152    # every TP rank holds the whole latent
        assert DSV3.kv_read_bytes(1000, tp, 2) == 1000 * 1152     # read once for all local heads
    DSV3.check_tp(8, 1, "dsv3")
    with pytest.raises(UserError, match="does not divide 128 attention heads"):
        DSV3.check_tp(3, 1, "dsv3")
    with pytest.raises(UserError, match="kv_replication"):
        DSV3.check_tp(8, 2, "dsv3")
    lay = KvLayout.for_attention(DSV3, 61, 2, 64, 8, 16)   # one latent plane per layer, whole on every rank
    assert lay.latent and lay.n_kv_heads == 1 and len(set(lay.shards)) == 1


def test_mla_flops_absorbed_decode_and_expanded_prefill():
    # decode: per context token and head, scores over 512 + 64 dims and values over 512 dims (2 FLOPs per MAC)
    assert DSV3.decode_core_flops(1000) == 2.0 * 128 * (2 * 512 + 64) * 1000
    assert DSV3.decode_core_flops(1000, tp=8, q_per_seq=2) == 2.0 * 16 * (2 * 512 + 64) * 1000 * 2
    # prefill (no cache): causal pairs x 2 * H * (192 + 128)
    assert DSV3.prefill_core_flops(4, 0) == 2.0 * 128 * (192 + 128) * 10
    # a cached prefix is up-projected by kv_b (2 * 512 * H * (128 + 128) per cached token)
    assert DSV3.prefill_core_flops(1, 5) == 2.0 * 128 * 320 * 6 + 2.0 * 5 * 512 * 128 * 256
    # the decode GEMMs swap kv_b for the absorbed per-head W_UK / W_UV products, with the same FLOPs per token
    dec = DSV3.proj_gemms(1, "decode")
    pre = DSV3.proj_gemms(1, "prefill")
    assert sum(n * k for n, k in dec) == sum(n * k for n, k in pre) == DSV3.proj_params()


def test_gqa_kinds_of_presets_match_the_flat_fields():
    m = get_model("qwen3-235b-a22b")
    full = m.mixer("full")
    assert isinstance(full, GqaAttention) and m.mixer("linear") is None
    assert (full.n_q_heads, full.n_kv_heads, full.head_dim, full.gated) == (64, 4, 128, False)
    assert full.kv_values_per_token() == 2 * 4 * 128
    assert m.kv_bytes_per_token(2) == 94 * full.kv_bytes_per_token(2) == 192_512
    assert full.kv_shards(8) == ((0,), (0,), (1,), (1,), (2,), (2,), (3,), (3,))
    assert full.kv_replication(8) == 2 and full.kv_replication(4) == 1
    assert len(m.layers) == 94 and {type(x.ffn) for x in m.layers} == {MoeFfn}
    assert m.layers[0] is m.layers[93]                     # layers of one kind share one object


def test_hybrid_preset_layers():
    m = get_model("qwen3.5-397b-a17b")
    kinds = [x.attention.kind for x in m.layers]
    assert kinds[:4] == ["linear", "linear", "linear", "full"] and kinds.count("full") == 15
    lin = m.mixer("linear")
    assert isinstance(lin, GdnAttention) and lin.kv_values_per_token() == 0
    assert m.n_linear_layers * lin.state_bytes_per_seq(4, 2) == m.linear_state_bytes_per_seq(4, conv_elem_bytes=2)
    assert m.attention_counts() == ((lin, 45), (m.mixer("full"), 15))
    assert m.attention_counts(include_mtp=True)[1] == (m.mixer("full"), 16)
    dec = m.flops_breakdown("decode", 1000)
    assert dec["attn_core"] == 15 * m.mixer("full").decode_core_flops(1000)
    assert dec["linear_core"] == 45 * lin.model_core_flops_per_token()
    # the cost model's recurrence is the state update only (the conv is priced with the projections' bytes)
    assert lin.decode_core_flops(1000) == 7 * 64 * 128 * 128
    moe = m.layers[0].ffn
    assert isinstance(moe, MoeFfn) and moe.n_shared == 1
    assert moe.params() == m.params_moe_layer()
    assert m.params_mtp_layer() == 2 * 4096 ** 2 + 5 * 4096 + m.mtp_layer.attention.params() + moe.params()
    # the per-layer kinds add up to the published breakdown
    per_layer = sum(x.attention.params() + x.ffn.params() for x in m.layers) + 2 * m.hidden * m.n_layers
    b = m.params_breakdown()
    assert per_layer == m.total_params() - b["embedding"] - b["lm_head"] - m.hidden


def test_layer_is_data():
    layer = Layer.model_validate({"attention": DSV3.model_dump(),
                                  "ffn": {"kind": "moe", "hidden": 7168, "n_experts": 256, "top_k": 8,
                                          "intermediate": 2048, "n_shared": 1, "shared_intermediate": 2048}})
    assert layer.attention == DSV3 and isinstance(layer.ffn, MoeFfn)
    assert layer.ffn.active_params() == (8 + 1) * 3 * 7168 * 2048 + 256 * 7168 + 7168
    dense = Layer(attention=DSV3, ffn=DenseFfn(hidden=7168, intermediate=18432))
    assert dense.ffn.params() == dense.ffn.active_params() == 3 * 7168 * 18432
    with pytest.raises(ValueError):
        MoeFfn(hidden=8, n_experts=4, top_k=5, intermediate=8)


def _gqa(n_q, n_kv, d=64, **kw):
    return GqaAttention(hidden=256, n_q_heads=n_q, n_kv_heads=n_kv, head_dim=d, **kw)


@settings(max_examples=60, deadline=None)
@given(n_kv=st.sampled_from([1, 2, 4, 8]), group=st.sampled_from([1, 2, 4]), tp_exp=st.integers(0, 4),
       elem=st.sampled_from([1, 2]))
def test_head_sharded_kv_sums_to_the_whole(n_kv, group, tp_exp, elem):
    """GQA KV split by heads: ranks' shares sum to the whole once per replica, and each rank holds exactly the heads
    its query heads read."""
    tp = 2 ** tp_exp
    a = _gqa(n_kv * group, n_kv)
    if (n_kv * group) % tp:
        with pytest.raises(UserError, match="does not divide"):
            a.q_heads_of_tp_rank(tp, 0)
        return
    shards = a.kv_shards(tp)
    per_rank = [a.kv_bytes_per_token_per_rank(tp, elem)] * tp
    assert sum(per_rank) == a.kv_bytes_per_token(elem) * a.kv_replication(tp)
    assert sorted(h for s in shards for h in s) == sorted(list(range(n_kv)) * a.kv_replication(tp))
    # query heads split evenly: the ranks' attention FLOPs add up to the whole layer's
    assert tp * a.decode_core_flops(1000, tp) == a.decode_core_flops(1000)
    assert tp * a.prefill_core_flops(100, 50, tp) == a.prefill_core_flops(100, 50)
    for r in range(tp):
        assert tuple(a.kv_heads_of_tp_rank(tp, r)) == shards[r]
        assert len(a.q_heads_of_tp_rank(tp, r)) == n_kv * group // tp


@settings(max_examples=40, deadline=None)
@given(tp_exp=st.integers(0, 5), ctx=st.integers(1, 100_000))
def test_replicated_kv_is_whole_on_every_rank(tp_exp, ctx):
    tp = 2 ** tp_exp
    assert [DSV3.kv_bytes_per_token_per_rank(tp) for _ in range(tp)] == [DSV3.kv_bytes_per_token()] * tp
    assert DSV3.kv_bytes_per_seq(ctx) == ctx * 1152


@pytest.mark.slow
@settings(max_examples=200, deadline=None)
@given(q=st.integers(0, 300), c=st.integers(0, 300), window=st.integers(1, 256))
def test_sliding_window_pairs_match_a_brute_count(q, c, window):
    a = SlidingWindowAttention(hidden=256, n_q_heads=8, n_kv_heads=2, head_dim=64, window=window)
    assert a.attended_pairs(q, c) == sum(min(p, window) for p in range(c + 1, c + q + 1))
    assert a.kv_tokens(c + q) == min(c + q, window)
    full = _gqa(8, 2)
    assert a.attended_pairs(q, c) <= full.attended_pairs(q, c)
    if c + q <= window:  # the window never bites: exactly full attention
        assert a.attended_pairs(q, c) == full.attended_pairs(q, c)
        assert a.prefill_core_flops(q, c, 2) == full.prefill_core_flops(q, c, 2)


def test_sliding_window_facts():
    a = SlidingWindowAttention(hidden=2880, n_q_heads=64, n_kv_heads=8, head_dim=64, window=128, qk_norm=False,
                               learned_sinks=True)
    g = GqaAttention(hidden=2880, n_q_heads=64, n_kv_heads=8, head_dim=64, qk_norm=False)
    assert a.kind == "sliding" and a.proj_params() == g.proj_params()
    assert a.small_params() == 64                                    # one sink logit per query head
    assert a.kv_bytes_per_seq(10_000, 2) == 128 * 2 * 8 * 64 * 2     # capped at the window
    assert a.kv_shards(4) == g.kv_shards(4)


@settings(max_examples=60, deadline=None)
@given(ep_exp=st.integers(0, 7), n_exp=st.sampled_from([8, 64, 128, 256]))
def test_experts_partition_over_ep_ranks(ep_exp, n_exp):
    ep = 2 ** ep_exp
    moe = MoeFfn(hidden=64, n_experts=n_exp, top_k=2, intermediate=32)
    if n_exp % ep:
        with pytest.raises(UserError, match="does not divide"):
            moe.experts_of_ep_rank(ep, 0)
        return
    held = [e for r in range(ep) for e in moe.experts_of_ep_rank(ep, r)]
    assert held == list(range(n_exp))


def test_plan_and_real_shard_share_one_derivation():
    torch = pytest.importorskip("torch")  # noqa: F841
    from rackbed.engine.real.model import Shard, TorchModelConfig

    m = get_model("qwen3-30b-a3b")
    cfg = TorchModelConfig.from_spec(m, n_layers=1)
    prefill = ParallelPlan(role="prefill", tp=8, ep=8, kv_replication=2, gpus="0-7")
    decode = ParallelPlan(role="decode", tp=1, dp=4, ep=4, gpus="0-3")
    for plan in (prefill, decode):
        for r in range(plan.world):
            s = Shard.of_plan(plan, r)
            assert s.q_heads(cfg) == plan.q_heads_of_rank(m, r)
            assert s.kv_heads(cfg) == plan.kv_heads_of_rank(m, r)
            assert tuple(s.kv_heads(cfg)) == plan.kv_heads_of_tp_rank(m, plan.tp_rank(r))
            assert s.experts(cfg) == plan.experts_of_rank(m, r)
    with pytest.raises(ValueError, match="whole experts"):
        Shard.of_plan(ParallelPlan(role="prefill", tp=4, ep=2, gpus="0-3"), 0)
