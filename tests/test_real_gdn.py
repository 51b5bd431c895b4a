"""Qwen3.5-MoE (Gated DeltaNet layers between gated full-attention layers) in the torch engine: logits and greedy
tokens equal transformers' ``qwen3_5_moe`` on a tiny config (prompts of several lengths, one longer than a delta-rule
chunk, decoded as one batch), the chunked delta rule equals the token-by-token recurrence, the state pool hands out
clean slots, and the configs read the same from a transformers object, a config.json and a ModelSpec."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hypothesis import given
from hypothesis import strategies as st
from tiny_families import tiny_hf_family

from rackbed.engine.real import layers_gdn
from rackbed.engine.real.comm import Comm
from rackbed.engine.real.config import TorchModelConfig
from rackbed.engine.real.families import ShardedMoeLM, model_class
from rackbed.engine.real.model import Shard

#: fp32 on CPU: the engine's order of operations (grouped experts, the conv as a sum in decode) differs from
#: transformers' only by rounding
ATOL = 1e-4


def _table(pts):
    width = max(len(pt) for pt in pts)
    return torch.tensor([pt + [pt[0]] * (width - len(pt)) for pt in pts])


@pytest.fixture(scope="module")
def tiny():
    hc, hf = tiny_hf_family("qwen3_5_moe")
    cfg = TorchModelConfig.from_hf(hc)
    return cfg, hf, ShardedMoeLM.from_state_dict(hf.state_dict(), cfg, Shard(), Comm())


@pytest.mark.slow
def test_matches_transformers_logits_and_greedy_tokens(tiny):
    """Prompts of 11, 3 and 70 tokens (70 > one chunk of 64) prefilled together, then decoded as one batch of three
    (one recurrent step per token on each state slot): every step's logits and the greedy tokens equal
    transformers' (its ``generate`` runs its own recurrent decode)."""
    cfg, hf, m = tiny
    assert cfg.family == "qwen3_5_moe" and model_class(cfg) is ShardedMoeLM
    assert cfg.layer_kinds == ("linear", "full", "linear", "linear") and cfg.kv_layers == (1,)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, cfg.vocab, (n,), generator=g) for n in (11, 3, 70)]
    cache = m.new_cache(64, 4, state_slots=4)
    assert cache.storage.shape[0] == 1                 # pages for the one full-attention layer only
    pts = [cache.alloc(len(p)) for p in prompts]
    slots = [cache.states.alloc() for _ in prompts]
    steps = 5
    with torch.no_grad():
        logits = m.forward_prefill(prompts, cache, pts, slots=slots)
        for i, p in enumerate(prompts):
            ref = hf(p[None]).logits[0, -1]
            assert torch.allclose(logits[i], ref, atol=ATOL), (i, (logits[i] - ref).abs().max())
        toks = [[int(logits[i].argmax())] for i in range(len(prompts))]
        pos = [len(p) for p in prompts]
        for _ in range(steps):
            for i in range(len(prompts)):
                cache.grow(pts[i], pos[i] + 1)
            lo = m.forward_decode(torch.tensor([t[-1] for t in toks]), torch.tensor(pos), cache, _table(pts),
                                  slots=slots)
            for i in range(len(prompts)):
                ref = hf(torch.cat([prompts[i], torch.tensor(toks[i])])[None]).logits[0, -1]
                assert torch.allclose(lo[i], ref, atol=ATOL), (i, (lo[i] - ref).abs().max())
                toks[i].append(int(lo[i].argmax()))
                pos[i] += 1
        ref_tokens = [hf.generate(p[None], max_new_tokens=steps + 1, do_sample=False)[0, len(p):].tolist()
                      for p in prompts]
    assert toks == ref_tokens


@pytest.mark.slow
def test_a_sequence_decodes_alike_alone_and_in_a_batch(tiny):
    """A sequence's state is its own: decoding it alone or beside another sequence (other slots, other pages)
    gives the same logits; a freed and re-allocated slot starts from zero state."""
    cfg, _, m = tiny
    g = torch.Generator().manual_seed(3)
    a, b = torch.randint(0, cfg.vocab, (9,), generator=g), torch.randint(0, cfg.vocab, (14,), generator=g)
    outs = []
    with torch.no_grad():
        for batch in ([a], [b, a]):
            cache = m.new_cache(32, 4, state_slots=3)
            junk = cache.states.alloc()                  # dirty a slot, free it: the next alloc reuses it, zeroed
            cache.states.rec[:, junk] = 1.0
            cache.states.conv[:, junk] = 1.0
            cache.states.free(junk)
            pts = [cache.alloc(len(p) + 2) for p in batch]
            slots = [cache.states.alloc() for _ in batch]
            assert slots[0] == junk
            m.forward_prefill(batch, cache, pts, slots=slots)
            lo = m.forward_decode(torch.tensor([int(p[-1]) for p in batch]), torch.tensor([len(p) for p in batch]),
                                  cache, _table(pts), slots=slots)
            outs.append(lo[-1])
    assert torch.allclose(outs[0], outs[1], atol=1e-5)


def test_state_pool_refuses_when_full_and_double_free():
    hc, _ = tiny_hf_family("qwen3_5_moe")
    pool = layers_gdn.GdnStatePool(TorchModelConfig.from_hf(hc), 2, dtype=torch.float32, device="cpu")
    s = [pool.alloc(), pool.alloc()]
    with pytest.raises(MemoryError, match="all 2 slots in use"):
        pool.alloc()
    pool.free(s[0])
    with pytest.raises(ValueError, match="not in use"):
        pool.free(s[0])


def test_prefix_resume_is_refused(tiny):
    cfg, _, m = tiny
    cache = m.new_cache(8, 4, state_slots=1)
    with pytest.raises(ValueError, match="cached prefix"):
        m.forward_prefill([torch.zeros(3, dtype=torch.long)], cache, [cache.alloc(8)], starts=[4],
                          slots=[cache.states.alloc()])
    with pytest.raises(ValueError, match="state slot per sequence"):
        m.forward_prefill([torch.zeros(3, dtype=torch.long)], cache, [cache.alloc(4)])


@pytest.mark.slow
@given(T=st.integers(1, 19), H=st.integers(1, 3), dk=st.sampled_from([2, 4]), dv=st.sampled_from([3, 4]),
       chunk=st.sampled_from([1, 4, 8]), seed=st.integers(0, 2**16))
def test_chunked_delta_rule_equals_the_recurrence(T, H, dk, dv, chunk, seed):
    """The chunked form (one triangular solve per chunk, a scan over chunks, padding to whole chunks) gives the
    token-by-token recurrence's outputs and final state, from any initial state."""
    g = torch.Generator().manual_seed(seed)
    q, k = torch.randn(T, H, dk, generator=g), torch.randn(T, H, dk, generator=g)
    k = k / k.norm(dim=-1, keepdim=True)
    v = torch.randn(T, H, dv, generator=g)
    decay = -torch.rand(T, H, generator=g) * 2
    beta = torch.rand(T, H, generator=g)
    s0 = torch.randn(H, dk, dv, generator=g)
    o1, s1 = layers_gdn.delta_rule_chunked(q, k, v, decay, beta, s0, chunk=chunk)
    o2, s2 = layers_gdn.delta_rule_loop(q, k, v, decay, beta, s0)
    assert torch.allclose(o1, o2, atol=1e-4) and torch.allclose(s1, s2, atol=1e-4)


def test_config_from_object_json_and_model_spec_agree(tmp_path):
    """config.json (a dict, transformers' defaults filled in; also nested as the multimodal config's text_config)
    and the ModelSpec reader agree with the config object on what the engine runs."""
    import json

    from rackbed.engine.core.model import ModelSpec, get_model

    hc, _ = tiny_hf_family("qwen3_5_moe")
    a = TorchModelConfig.from_hf(hc)
    raw = json.loads(hc.to_json_string(use_diff=True))
    assert TorchModelConfig.from_hf(raw) == a
    assert TorchModelConfig.from_hf({"model_type": "qwen3_5_moe", "text_config": raw}) == a
    hc.linear_value_head_dim = hc.linear_key_head_dim     # the ModelSpec has one linear head dim
    a = TorchModelConfig.from_hf(hc)
    hc.save_pretrained(tmp_path)
    s = TorchModelConfig.from_spec(ModelSpec.from_hf_config(tmp_path / "config.json"))
    for f in ("family", "layer_kinds", "n_q_heads", "n_kv_heads", "head_dim", "n_experts", "top_k", "gated_attn",
              "shared_gate", "shared_intermediate", "lin_k_heads", "lin_v_heads", "lin_k_dim", "lin_v_dim", "lin_conv"):
        assert getattr(a, f) == getattr(s, f), f
    big = TorchModelConfig.from_spec(get_model("qwen3.5-397b-a17b"), n_layers=4)
    assert big.family == "qwen3_5_moe" and big.layer_kinds == ("linear", "linear", "linear", "full")
    assert big.kv_bytes_per_token(2) == 2 * 2 * 256 * 2       # one full layer: K and V of 2 heads of 256
    # per linear layer: fp32 [64, 128, 128] state + 3 tokens of (2*16 + 64) * 128 conv channels in bf16
    assert big.state_bytes_per_seq(2) == 3 * (64 * 128 * 128 * 4 + 3 * 96 * 128 * 2)


# ----------------------------------------------------------------------------------------------------------------
# aggregated real run (one CPU rank): mixed steps, state slots freed with the KV, tokens equal transformers'

#: requests arrive faster than they finish, so steps mix prompts into a running batch (and slots are reused)
LOAD = {"kind": "synthetic", "arrival": {"kind": "poisson", "rate_per_s": 200}, "prompt": {"kind": "uniform", "lo": 3,
        "hi": 30}, "output": {"kind": "uniform", "lo": 2, "hi": 6}, "n_requests": 8, "seed": 2}
AGG = {"workers": 1, "tp": 1, "dp": 1, "ep": 1, "max_batch_per_rank": 3, "max_batch_tokens": 40,
       "chunk_tokens": None, "page_tokens": 4}


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    """A tiny Qwen3.5-MoE checkpoint whose linear key and value heads have one dim (the ModelSpec reader's rule)."""
    from tiny_qwen3moe import save_checkpoint

    hc, hf = tiny_hf_family("qwen3_5_moe", linear_value_head_dim=16)
    return hf, save_checkpoint(hc, hf, tmp_path_factory.mktemp("real_gdn") / "ckpt")


def _run(d, decode_pages=256, agg=True, **over):
    import json

    from tiny_qwen3moe import real_scenario

    from rackbed.engine.core.workload import generate
    from rackbed.engine.real.driver import run_real
    from rackbed.sim.driver import simulate
    from rackbed.sim.scenario import build

    sc = real_scenario(d, **{"workload": LOAD, **({"deployment": "aggregated", "aggregated": AGG} if agg else {}), **over})
    b = build(sc)
    reqs = generate(sc.workload, sc.seed)
    res, run = run_real(b, reqs, simulate=simulate, device="cpu", dtype="fp32", weights=str(d), prefill_pages=256,
                        decode_pages=decode_pages,
                        tiny_cfg=TorchModelConfig.from_hf(json.loads((d / "config.json").read_text())))
    return sc, b, reqs, res, run


@pytest.mark.slow
def test_aggregated_run_real_tokens_equal_transformers_and_replay_is_identical(ckpt):
    """``run_real`` with one aggregated worker: every request finishes with transformers' greedy tokens, some step
    mixes a prompt into a running batch, the scheduler planned with the pages left after the state slots, and
    replaying the measured durations gives the identical decision log."""
    from rackbed.engine.core.deployment import kv_capacities
    from rackbed.engine.real.driver import replay
    from rackbed.engine.real.rank_setup import state_pages
    from rackbed.sim.driver import simulate

    hf, d = ckpt
    sc, b, reqs, res, run = _run(d)
    assert res.metrics["requests"]["done"] == len(reqs)
    mixed = res.log.of_kind("mixed")
    assert any(int(r[6]) > 0 and r[5] > 0 for r in mixed), "no step mixed prefill into a decode batch"
    for r in reqs:
        prompt = torch.tensor(run.prompt_ids[r.id])[None]
        with torch.no_grad():
            ref = hf.generate(prompt, max_new_tokens=r.output_tokens, do_sample=False)[0, prompt.shape[1]:]
        assert run.generated[r.id] == ref.tolist(), f"request {r.id}"
    held = state_pages(run.cfg, "fp32", 4, AGG["max_batch_per_rank"])
    assert held > 0 and kv_capacities(b.deployment)["rank_tokens"] == (256 - held) * 4
    rep = replay(b, reqs, run.records, simulate=simulate, seed=sc.seed, deaths=run.deaths)
    assert res.log.decisions() == rep.log.decisions()


def test_real_mode_names_what_it_does_not_run_for_gdn(ckpt):
    """Disaggregation, a prefix cache and a KV budget the state slots fill are one-line UserErrors naming the
    field, raised before any rank starts."""
    from rackbed.topology.errors import UserError

    _, d = ckpt
    with pytest.raises(UserError, match="^deployment: real mode runs Gated DeltaNet"):
        _run(d, agg=False)
    with pytest.raises(UserError, match="^prefix_cache: "):
        _run(d, prefix_cache={"enabled": True, "block_tokens": 4, "hbm_gb_per_gpu": 1e-5, "host_gb_per_gpu": 0})
    with pytest.raises(UserError, match=r"^real.decode_pages: 2 pages cannot hold"):
        _run(d, decode_pages=2)


@given(slots=st.integers(1, 64), page_tokens=st.sampled_from([1, 4, 16, 64]), dtype=st.sampled_from(["bf16", "fp32"]),
       v_heads=st.sampled_from([2, 4, 8]), dim=st.sampled_from([8, 16, 32]))
def test_state_pages_are_the_fewest_pages_holding_the_slots(slots, page_tokens, dtype, v_heads, dim):
    """The pages a rank gives up for its state slots hold those slots' bytes, and one page fewer would not."""
    from rackbed.engine.real.rank_setup import _ELEM, state_pages

    cfg = TorchModelConfig(hidden=64, n_layers=4, n_q_heads=4, n_kv_heads=2, head_dim=16, n_experts=4, top_k=2,
                           moe_intermediate=16, vocab=32, family="qwen3_5_moe",
                           layer_kinds=("linear", "linear", "linear", "full"), lin_k_heads=2, lin_v_heads=v_heads,
                           lin_k_dim=dim, lin_v_dim=dim, lin_conv=4)
    n = state_pages(cfg, dtype, page_tokens, slots)
    page = cfg.kv_bytes_per_token(_ELEM[dtype]) * page_tokens
    need = slots * cfg.state_bytes_per_seq(_ELEM[dtype])
    assert n * page >= need > (n - 1) * page


def test_published_checkpoint_layout_loads_the_same(tiny):
    """Qwen3.5's published checkpoints: the text model under ``model.language_model.`` and one tensor per expert
    (``mlp.experts.{e}.{gate,up,down}_proj``); loaded, the model gives the same logits."""
    import re

    cfg, hf, m = tiny
    state = {}
    for k, v in hf.state_dict().items():
        k = k.replace("model.", "model.language_model.", 1) if k.startswith("model.") else k
        x = re.match(r"(.*mlp\.experts\.)(gate_up_proj|down_proj)$", k)
        if x is None:
            state[k] = v
            continue
        for e in range(v.shape[0]):
            if x[2] == "down_proj":
                state[f"{x[1]}{e}.down_proj.weight"] = v[e]
            else:
                g, u = v[e].chunk(2)
                state[f"{x[1]}{e}.gate_proj.weight"], state[f"{x[1]}{e}.up_proj.weight"] = g, u
    assert not any(k.startswith("model.layers.") for k in state)
    m2 = ShardedMoeLM.from_state_dict(state, cfg, Shard(), Comm())
    p = [torch.arange(12) % cfg.vocab]
    outs = []
    with torch.no_grad():
        for mm in (m, m2):
            cache = mm.new_cache(8, 4, state_slots=1)
            outs.append(mm.forward_prefill(p, cache, [cache.alloc(12)], slots=[cache.states.alloc()]))
    assert torch.equal(outs[0], outs[1])
