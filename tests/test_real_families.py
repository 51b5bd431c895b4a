"""The torch engine's DeepSeek-V3 (MLA), gpt-oss and GLM-4.5 equal transformers on tiny configs (logits of prefill
and of every decode step through the paged cache, greedy tokens), and their sharded forwards (TP/EP prefill, DP-EP
decode over 2 gloo ranks) equal the unsharded one."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tiny_families import _all_cases_rank, _prefill, tiny_hf_family

from rackbed.engine.real.comm import Comm
from rackbed.engine.real.config import TorchModelConfig
from rackbed.engine.real.families import ShardedMoeLM, model_class
from rackbed.engine.real.launch import spawn_local
from rackbed.engine.real.model import Shard

FAMILIES = ("deepseek_v3", "gpt_oss", "glm4_moe")
#: fp32 on CPU: the engine's order of operations differs from transformers' (absorbed MLA decode, grouped experts,
#: fused all-reduces) only by rounding
ATOL = 2e-5


def _table(pts):
    width = max(len(pt) for pt in pts)
    return torch.tensor([pt + [pt[0]] * (width - len(pt)) for pt in pts])


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_matches_transformers_logits_and_greedy_tokens(family):
    hc, hf = tiny_hf_family(family)
    cfg = TorchModelConfig.from_hf(hc)
    assert cfg.family == family and model_class(cfg) is ShardedMoeLM
    m = ShardedMoeLM.from_state_dict(hf.state_dict(), cfg, Shard(), Comm())
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, cfg.vocab, (n,), generator=g) for n in (11, 5)]    # 11 > gpt-oss's window of 6
    cache = m.new_cache(32, 4)
    pts = [cache.alloc(len(p)) for p in prompts]
    steps = 5
    with torch.no_grad():
        logits = m.forward_prefill(prompts, cache, pts)
        toks = [[int(logits[i].argmax())] for i in range(2)]
        for i, p in enumerate(prompts):
            ref = hf(p[None]).logits[0, -1]
            assert torch.allclose(logits[i], ref, atol=ATOL), (logits[i] - ref).abs().max()
        pos = [len(p) for p in prompts]
        for _ in range(steps):
            for i in range(2):
                cache.grow(pts[i], pos[i] + 1)
            lo = m.forward_decode(torch.tensor([t[-1] for t in toks]), torch.tensor(pos), cache, _table(pts))
            for i in range(2):
                ref = hf(torch.cat([prompts[i], torch.tensor(toks[i])])[None]).logits[0, -1]
                assert torch.allclose(lo[i], ref, atol=ATOL), (family, (lo[i] - ref).abs().max())
                toks[i].append(int(lo[i].argmax()))
                pos[i] += 1
        ref_tokens = [hf.generate(p[None], max_new_tokens=steps + 1, do_sample=False)[0, len(p):].tolist()
                      for p in prompts]
    assert toks == ref_tokens


def test_hf_dict_and_model_spec_give_the_same_structure():
    """config.json (a dict with transformers' defaults filled in) and the ModelSpec loader agree with the config
    object on what the engine runs: family, layer kinds, dense layers, widths."""
    import json

    from rackbed.engine.core.model import ModelSpec

    for family in FAMILIES:
        hc, _ = tiny_hf_family(family)
        a = TorchModelConfig.from_hf(hc)
        b = TorchModelConfig.from_hf(json.loads(hc.to_json_string(use_diff=True)))
        assert a == b, family
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        for family in FAMILIES:
            hc, _ = tiny_hf_family(family)
            hc.save_pretrained(d)
            spec = ModelSpec.from_hf_config(Path(d) / "config.json")
            a, s = TorchModelConfig.from_hf(hc), TorchModelConfig.from_spec(spec)
            for f in ("family", "layer_kinds", "dense_layers", "dense_intermediate", "shared_intermediate", "n_q_heads",
                      "n_kv_heads", "head_dim", "n_experts", "top_k", "qkv_bias", "o_bias", "sinks", "sliding_window",
                      "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "v_head_dim"):
                assert getattr(a, f) == getattr(s, f), (family, f)


def test_presets_load_as_their_families():
    from rackbed.engine.core.model import get_model

    for name, fam in (("deepseek-v3", "deepseek_v3"), ("kimi-k2", "deepseek_v3"), ("gpt-oss-120b", "gpt_oss"),
                      ("glm-4.5", "glm4_moe")):
        cfg = TorchModelConfig.from_spec(get_model(name), n_layers=4)
        assert cfg.family == fam and cfg.n_layers == 4 and len(cfg.layer_kinds) == 4
    ds = TorchModelConfig.from_spec(get_model("deepseek-v3"), n_layers=4)
    assert ds.dense_layers == (0, 1, 2) and ds.kv_lora_rank == 512 and ds.attention.kv_values_per_token() == 576


# ----------------------------------------------------------------------------------------------------------------
# sharded == unsharded, 2 gloo ranks


@pytest.fixture(scope="module")
def sharded():
    cfgs = {f: TorchModelConfig.from_hf(tiny_hf_family(f)[0]) for f in FAMILIES}
    return cfgs, spawn_local(_all_cases_rank, 2, cfgs, 3)


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_sharded_prefill_equals_unsharded(sharded, family):
    cfgs, results = sharded
    ref = _prefill(cfgs[family], Shard(), Comm(), 3)
    keys = [k for k in results[0] if k[0] == family and k[1] != "decode"]
    assert keys
    for res in results:
        for k in keys:
            assert torch.allclose(res[k], ref, atol=1e-5), (k, (res[k] - ref).abs().max())
            assert torch.equal(res[k].argmax(-1), ref.argmax(-1))


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_dp_ep_decode_equals_unsharded(sharded, family):
    _, results = sharded
    for res in results:
        err, same = res[(family, "decode")]
        assert err < 1e-5 and same, (family, err, same)


# ----------------------------------------------------------------------------------------------------------------
# disaggregated real run of each family: TP prefill -> KV transfer -> DP-EP decode, and its replay


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_disaggregated_tokens_equal_transformers_and_replay_is_identical(tmp_path, family):
    """Each tiny family through ``run_real``: prefill TP=2/EP=2, the KV shipped along ``engine.core.kv``'s plan to
    2 DP decode ranks (DeepSeek-V3: the latent, replicated on both prefill ranks; gpt-oss and GLM: KV heads sharded
    over them), greedy tokens equal transformers'; replaying the measured durations through the simulator gives
    the identical decision log (cross-mode identity). Prompts of 5-30 tokens are mostly longer than gpt-oss's
    window of 6: its sliding layers ship only the window's latest tokens (fewer bytes than the whole prompt),
    and the decoder's tokens still equal transformers'."""
    import json
    from dataclasses import replace

    from tiny_qwen3moe import save_checkpoint

    from rackbed.engine.core.kv import reshard_plan
    from rackbed.engine.core.workload import generate
    from rackbed.engine.real.driver import replay, run_real
    from rackbed.engine.real.worker import kv_layouts
    from rackbed.sim.driver import simulate
    from rackbed.sim.scenario import build, parse_scenario

    hc, hf = tiny_hf_family(family)
    d = save_checkpoint(hc, hf, tmp_path / "ckpt")
    sc = parse_scenario({
        "name": f"cpu-real-{family}", "topology": "hgx-h200", "model": str(d / "config.json"), "weight_format": "bf16",
        "prefill": {"tp": 2, "ep": 2, "replicas": 1, "max_batch_tokens": 256},
        "decode": {"ep": 1, "replicas": 2, "max_batch_per_rank": 4, "page_tokens": 4},
        "mtp": {"draft_k": 0},
        "workload": {"kind": "synthetic", "arrival": {"kind": "poisson", "rate_per_s": 20},
                     "prompt": {"kind": "uniform", "lo": 5, "hi": 30}, "output": {"kind": "uniform", "lo": 2, "hi": 8},
                     "n_requests": 8, "seed": 1}})
    b = build(sc)
    reqs = generate(sc.workload, sc.seed)
    cfg = TorchModelConfig.from_hf(json.loads((d / "config.json").read_text()))
    assert cfg.family == family
    res, run = run_real(b, reqs, simulate=simulate, device="cpu", dtype="fp32", weights=str(d), prefill_pages=256,
                        decode_pages=256, tiny_cfg=cfg)
    assert res.metrics["requests"]["done"] == len(reqs)
    for r in reqs:
        prompt = torch.tensor(run.prompt_ids[r.id])[None]
        with torch.no_grad():
            ref = hf.generate(prompt, max_new_tokens=r.output_tokens, do_sample=False)[0, prompt.shape[1]:]
        assert run.generated[r.id] == ref.tolist(), f"request {r.id}"
    # every transfer moved the plan's bytes: sliding layers (gpt-oss) only their window's latest tokens
    src, dst = kv_layouts(cfg, 4, 4, 2, 256, 256)
    assert bool(src.windows) == (family == "gpt_oss")
    for r in reqs:
        plan = reshard_plan(src, dst, r.prompt_tokens).total_bytes
        whole = reshard_plan(replace(src, windows=()), replace(dst, windows=()), r.prompt_tokens).total_bytes
        assert run.kv_bytes[r.id] == [plan], r.id
        assert plan < whole if src.windows and r.prompt_tokens > cfg.sliding_window else plan == whole
    if family == "gpt_oss":
        assert sum(r.prompt_tokens > cfg.sliding_window for r in reqs) >= len(reqs) // 2
    rep = replay(b, reqs, run.records, simulate=simulate, seed=sc.seed, deaths=run.deaths)
    assert res.log.decisions() == rep.log.decisions()
    assert len(res.log.decisions()) > 40


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_after_a_cached_prefix_equals_a_full_prefill(family):
    """A prompt's suffix prefilled after its cached prefix (latent rows for MLA; partial rotary for GLM) gives the
    full prefill's logits, and leaves the shared prefix pages as they were; batched with an uncached prompt.
    gpt-oss, whose sliding layers keep a ring per sequence (no shared pages): the suffix continues the prefix's own
    sequence (a prefill in two chunks), its sliding layers reading the window's prefix from the ring it wraps."""
    hc, hf = tiny_hf_family(family)
    cfg = TorchModelConfig.from_hf(hc)
    m = ShardedMoeLM.from_state_dict(hf.state_dict(), cfg, Shard(), Comm())
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, cfg.vocab, (n,), generator=g) for n in (15, 6, 11)]   # past gpt-oss's window of 6
    cached = [8, 0, 4]                                                                 # whole pages of 4 tokens
    cache = m.new_cache(64, 4)
    with torch.no_grad():
        full = m.forward_prefill(prompts, cache, [cache.alloc(len(p)) for p in prompts])
        if cache.window:
            assert cache.ring_tokens < len(prompts[0])                                 # the ring wraps
            own = [cache.alloc(len(p)) for p in prompts]
            m.forward_prefill([p[:c] for p, c in zip(prompts, cached) if c], cache,
                              [pt for pt, c in zip(own, cached) if c])
            part = m.forward_prefill([p[c:] for p, c in zip(prompts, cached)], cache, own, starts=cached)
            assert torch.allclose(part, full, atol=ATOL), (family, (part - full).abs().max())
            assert part.argmax(-1).tolist() == full.argmax(-1).tolist()
            return
        pre = [cache.alloc(c) for c in cached if c]
        m.forward_prefill([p[:c] for p, c in zip(prompts, cached) if c], cache, pre)
        used = [x for pt in pre for x in pt]
        snap = cache.storage[:, used].clone()
        shared, it = [], iter(pre)
        for p, c in zip(prompts, cached):
            pt = cache.share(next(it)) if c else []
            cache.grow(pt, len(p))
            shared.append(pt)
        part = m.forward_prefill([p[c:] for p, c in zip(prompts, cached)], cache, shared, starts=cached)
    assert torch.allclose(part, full, atol=ATOL), (family, (part - full).abs().max())
    assert part.argmax(-1).tolist() == full.argmax(-1).tolist()
    assert torch.equal(snap, cache.storage[:, used])
