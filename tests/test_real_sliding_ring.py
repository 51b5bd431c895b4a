"""gpt-oss's sliding-window layers on a per-sequence ring (``PagedKvCache``'s ring buffer, position ``p`` at slot
``p mod R``): greedy tokens equal transformers' with prompts 3-5 windows long and decodes that wrap the ring several
times (batched, eager and static step), the ring's decode attention equals attention over the whole history masked
to the window (property), a long request holds its full layers' pages plus one ring, the rank's ring count never
runs out before its pages, and a disaggregated ``run_real`` ships the window into the decoder's ring."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from tiny_families import TINY, tiny_hf_family  # noqa: E402

from rackbed.engine.real import layers_gqa  # noqa: E402
from rackbed.engine.real.comm import Comm  # noqa: E402
from rackbed.engine.real.config import TorchModelConfig  # noqa: E402
from rackbed.engine.real.families import ShardedMoeLM  # noqa: E402
from rackbed.engine.real.model import PagedKvCache, Shard, ring_pages  # noqa: E402
from rackbed.engine.real.rank_setup import ring_seqs  # noqa: E402

WINDOW, PAGE = 8, 4          # ring: ceil(8 / 4) + 1 = 3 pages = 12 tokens


@pytest.fixture(scope="module")
def tiny():
    """The tiny gpt-oss family's random weights (``tiny_families``) with a window of 8."""
    import transformers as tf

    _, hf = tiny_hf_family("gpt_oss")
    hc = tf.GptOssConfig(**{**TINY["gpt_oss"], "sliding_window": WINDOW})
    hc._attn_implementation = "eager"
    hf2 = tf.GptOssForCausalLM(hc).eval()
    hf2.load_state_dict(hf.state_dict())
    cfg = TorchModelConfig.from_hf(hc)
    assert cfg.sliding_window == WINDOW and "sliding" in cfg.layer_kinds and "full" in cfg.layer_kinds
    return hc, hf2, cfg


def _table(pts):
    width = max(len(pt) for pt in pts)
    return torch.tensor([pt + [pt[0]] * (width - len(pt)) for pt in pts])


@pytest.mark.slow
@pytest.mark.parametrize("static", [False, True])
def test_greedy_tokens_equal_transformers_past_several_ring_wraps(tiny, static):
    """Prompts of 24, 40 and 33 tokens (3-5 windows) prefilled together, then 30 decode steps as one batch
    (different lengths: each row's ring wraps at its own step); every step's logits match transformers' and the
    greedy tokens equal ``generate``'s. ``static``: the graph-capturable step ``forward_decode_static``."""
    hc, hf, cfg = tiny
    m = ShardedMoeLM.from_state_dict(hf.state_dict(), cfg, Shard(), Comm())
    cache = m.new_cache(64, PAGE, ring_seqs=4)
    assert cache.ring_tokens == 12 and cache.ring_storage.shape[:2] == (cfg.layer_kinds.count("sliding"), 12)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, cfg.vocab, (n,), generator=g) for n in (24, 40, 33)]
    steps = 30                                                  # 30 + 40 tokens: 5 wraps of the 12-token ring
    pts = [cache.alloc(len(p)) for p in prompts]
    step = m.forward_decode_static if static else m.forward_decode
    with torch.no_grad():
        logits = m.forward_prefill(prompts, cache, pts)
        toks = [[int(x)] for x in logits.argmax(-1)]
        pos = [len(p) for p in prompts]
        for s in range(steps):
            for i, pt in enumerate(pts):
                cache.grow(pt, pos[i] + 1)
            lo = step(torch.tensor([t[-1] for t in toks]), torch.tensor(pos), cache, _table(pts))
            if s in (0, steps - 1):
                for i, p in enumerate(prompts):
                    ref = hf(torch.cat([p, torch.tensor(toks[i])])[None]).logits[0, -1]
                    assert torch.allclose(lo[i], ref, atol=2e-5), (s, i, (lo[i] - ref).abs().max())
            for i in range(len(prompts)):
                toks[i].append(int(lo[i].argmax()))
                pos[i] += 1
        ref = [hf.generate(p[None], max_new_tokens=steps + 1, do_sample=False)[0, len(p):].tolist() for p in prompts]
    assert toks == ref


@settings(max_examples=60, derandomize=True, deadline=None)
@given(window=st.integers(1, 20), page=st.sampled_from([1, 2, 4, 8]),
       lengths=st.lists(st.integers(1, 70), min_size=1, max_size=4), sinks=st.booleans(), seed=st.integers(0, 9))
def test_ring_decode_attention_equals_windowed_attention_over_the_whole_history(window, page, lengths, sinks, seed):
    """For random windows, page sizes and sequence lengths: prefill writes a history into the ring (keeping the
    last R positions), decode writes the next token's K/V at slot ``p mod R`` and attends over the ring; the output
    equals attention over the whole history with transformers' window mask (``q - window < k <= q``) and sinks."""
    Hkv, G, Dh = 2, 2, 4
    gen = torch.Generator().manual_seed(seed)

    class Cfg:
        head_dim = Dh

    cache = PagedKvCache(1, sum(-(-(n + 1) // page) for n in lengths), Hkv, page, Dh, windows=(window,),
                         ring_seqs=len(lengths))
    R = cache.ring_tokens
    assert R == ring_pages(window, page) * page and R >= window + 1
    w = {"sinks": torch.randn(Hkv * G, generator=gen)} if sinks else {}
    hist = [(torch.randn(Hkv, n + 1, Dh, generator=gen), torch.randn(Hkv, n + 1, Dh, generator=gen))
            for n in lengths]
    q = torch.randn(Hkv * G, len(lengths), Dh, generator=gen)
    pts = []
    for (k, v), n in zip(hist, lengths):
        pt = cache.alloc(n + 1)
        cache.write(0, pt, 0, k[:, :n], v[:, :n])            # the prompt: only its last R positions stay
        cache.write(0, pt, n, k[:, n:], v[:, n:])            # the decoded token, at slot n mod R
        pts.append(pt)
    table = _table(pts)
    pos = torch.tensor(lengths)
    rings = cache.ring_table[table[:, 0]]
    out = layers_gqa.decode_ring(w, q, cache.ring_storage[0][rings], pos, window, Cfg)
    for i, ((k, v), n) in enumerate(zip(hist, lengths)):
        qg = q[:, i].reshape(Hkv, G, 1, Dh)
        ok = layers_gqa.window_mask(torch.tensor([n]), torch.arange(n + 1), window)
        ref = layers_gqa.attend(qg, k[:, None], v[:, None], ok, Dh ** -0.5,
                                w["sinks"].view(Hkv, G) if sinks else None).reshape(-1)
        assert torch.allclose(out[i], ref, atol=1e-5), (i, (out[i] - ref).abs().max())


def test_a_long_request_holds_its_full_layers_pages_plus_one_ring(tiny):
    """A 200-token sequence (25 windows) holds ceil(200 / 4) = 50 pages of the full layers and 3 ring pages of
    the sliding layers, whatever its length; freeing it returns both. The ring buffer is sized by sequences, the
    page buffer by tokens."""
    _, hf, cfg = tiny
    m = ShardedMoeLM.from_state_dict(hf.state_dict(), cfg, Shard(), Comm())
    cache = m.new_cache(60, PAGE, ring_seqs=5)
    Lf, Ls = cfg.layer_kinds.count("full"), cfg.layer_kinds.count("sliding")
    assert cache.storage.shape[:2] == (Lf, 60) and cache.ring_storage.shape[:2] == (Ls, 5 * 3)
    assert cache.pages_held() == (0, 0)
    pt = cache.alloc(200)
    assert cache.pages_held() == (50, 3)
    cache.grow(pt, 240)
    assert cache.pages_held() == (60, 3)                        # longer: full pages only
    with torch.no_grad():
        m.forward_prefill([torch.zeros(200, dtype=torch.long)], cache, [pt])
    cache.free(pt)
    assert cache.pages_held() == (0, 0)
    with pytest.raises(ValueError, match="not shared"):
        cache.share(cache.alloc(4))
    with pytest.raises(MemoryError, match="rings"):             # one ring per sequence, 5 of them
        [cache.alloc(1) for _ in range(5)]


@settings(max_examples=50, derandomize=True, deadline=None)
@given(n_pages=st.integers(1, 200), page=st.sampled_from([1, 4, 16]), min_tokens=st.integers(1, 100),
       data=st.data())
def test_a_ranks_rings_never_run_out_before_its_pages(n_pages, page, min_tokens, data):
    """``rank_setup.ring_seqs``: sequences of at least ``min_tokens`` tokens (and the decode graph runner's
    one-page scratch) allocated until the pages run out: the cache is refused for pages, never for a ring."""
    cache = PagedKvCache(2, n_pages, 1, page, 1, windows=(4, 0), ring_seqs=ring_seqs(n_pages, page, min_tokens))
    cache.alloc(1)                                               # the graph runner's scratch
    with pytest.raises(MemoryError) as exc:
        for _ in range(n_pages + 1):
            cache.alloc(data.draw(st.integers(min_tokens, min_tokens + 3 * page)))
    assert "rings" not in str(exc.value)
    assert cache.free_rings                                      # one left over at least (the warm-up's)


@pytest.mark.slow
def test_disaggregated_run_ships_the_window_into_the_decoders_ring(tiny, tmp_path):
    """``run_real`` of the tiny gpt-oss (window 8, pages of 4): prompts of 24-40 tokens (3-5 windows), prefill
    TP=2 -> 2 DP decode ranks; the sliding layers' last window crosses into the decoder's ring and every request's
    tokens equal transformers' greedy decoding (outputs of 12-16 tokens: the ring wraps on the decoder). Each
    transfer moved the plan's bytes: the full layers' whole prompt and the sliding layers' window only."""
    from tiny_qwen3moe import save_checkpoint

    from rackbed.engine.core.kv import reshard_plan
    from rackbed.engine.core.workload import generate
    from rackbed.engine.real.driver import run_real
    from rackbed.engine.real.worker import kv_layouts
    from rackbed.sim.driver import simulate
    from rackbed.sim.scenario import build, parse_scenario

    hc, hf, cfg = tiny
    d = save_checkpoint(hc, hf, tmp_path / "ckpt")
    sc = parse_scenario({
        "name": "cpu-real-gpt-oss-ring", "topology": "hgx-h200", "model": str(d / "config.json"),
        "weight_format": "bf16", "prefill": {"tp": 2, "ep": 2, "replicas": 1, "max_batch_tokens": 256},
        "decode": {"ep": 1, "replicas": 2, "max_batch_per_rank": 4, "page_tokens": PAGE}, "mtp": {"draft_k": 0},
        "workload": {"kind": "synthetic", "arrival": {"kind": "poisson", "rate_per_s": 20},
                     "prompt": {"kind": "uniform", "lo": 24, "hi": 40},
                     "output": {"kind": "uniform", "lo": 12, "hi": 16}, "n_requests": 4, "seed": 2}})
    b = build(sc)
    reqs = generate(sc.workload, sc.seed)
    cfg = TorchModelConfig.from_hf(json.loads((d / "config.json").read_text()))
    res, run = run_real(b, reqs, simulate=simulate, device="cpu", dtype="fp32", weights=str(d), prefill_pages=128,
                        decode_pages=128, tiny_cfg=cfg)
    assert res.metrics["requests"]["done"] == len(reqs)
    assert all(r.prompt_tokens >= 3 * WINDOW for r in reqs)
    for r in reqs:
        prompt = torch.tensor(run.prompt_ids[r.id])[None]
        with torch.no_grad():
            ref = hf.generate(prompt, max_new_tokens=r.output_tokens, do_sample=False)[0, prompt.shape[1]:]
        assert run.generated[r.id] == ref.tolist(), f"request {r.id}"
    src, dst = kv_layouts(cfg, 4, PAGE, 2, 128, 128)
    for r in reqs:
        plan = reshard_plan(src, dst, r.prompt_tokens)
        assert run.kv_bytes[r.id] == [plan.total_bytes], r.id
        per_token = 2 * 2 * 16 * 4                      # per layer: K and V, 2 KV heads of 16, fp32
        assert plan.total_bytes == (r.prompt_tokens + WINDOW) * per_token     # 1 full layer, 1 sliding layer


def test_prefix_cache_is_refused_for_sliding_window_models(tiny, tmp_path):
    from tiny_qwen3moe import save_checkpoint

    from rackbed.engine.core.prefix_cache import PrefixCacheSpec
    from rackbed.engine.core.request import Request
    from rackbed.engine.real.driver import run_real
    from rackbed.sim.driver import simulate
    from rackbed.sim.scenario import build, parse_scenario
    from rackbed.topology.errors import UserError

    hc, hf, cfg = tiny
    d = save_checkpoint(hc, hf, tmp_path / "ckpt")
    sc = parse_scenario({
        "name": "cpu-real-gpt-oss-prefix", "topology": "hgx-h200", "model": str(d / "config.json"),
        "weight_format": "bf16", "prefill": {"tp": 1, "ep": 1, "replicas": 1, "max_batch_tokens": 256},
        "decode": {"ep": 1, "replicas": 1, "max_batch_per_rank": 4, "page_tokens": PAGE}, "mtp": {"draft_k": 0},
        "workload": {"kind": "synthetic", "arrival": {"kind": "poisson", "rate_per_s": 1},
                     "prompt": {"kind": "uniform", "lo": 20, "hi": 20}, "output": {"kind": "uniform", "lo": 3, "hi": 3},
                     "n_requests": 1, "seed": 1}})
    with pytest.raises(UserError, match="^prefix_cache: .*sliding-window"):
        run_real(build(sc), [Request(0, 0.0, 20, 3, (1,))], simulate=simulate, device="cpu", dtype="fp32",
                 weights=str(d), prefill_pages=64, decode_pages=64, tiny_cfg=cfg,
                 prefix_cache=PrefixCacheSpec(hbm_blocks=4, block_tokens=PAGE, unit_tokens=PAGE))


@pytest.mark.slow
def test_aggregated_run_with_a_tight_cache_keeps_windows_on_rings(tiny, tmp_path):
    """One aggregated worker (prefill and decode in mixed steps, one cache) with 40 pages of 4 tokens: the
    scheduler's 160 tokens hold at most four of these requests (prompts of 24-40 tokens, outputs of 12-16) at once,
    and ``rank_setup.ring_seqs`` gives the rank a ring for every sequence its pages can hold; every request's
    tokens equal transformers' greedy decoding."""
    from tiny_qwen3moe import save_checkpoint

    from rackbed.engine.core.workload import generate
    from rackbed.engine.real.driver import run_real
    from rackbed.engine.real.rank_setup import kv_rings
    from rackbed.sim.driver import simulate
    from rackbed.sim.scenario import build, parse_scenario

    hc, hf, cfg = tiny
    d = save_checkpoint(hc, hf, tmp_path / "ckpt")
    sc = parse_scenario({
        "name": "cpu-real-gpt-oss-ring-agg", "topology": "hgx-h200", "model": str(d / "config.json"),
        "weight_format": "bf16", "deployment": "aggregated", "mtp": {"draft_k": 0},
        "aggregated": {"workers": 1, "tp": 1, "dp": 1, "ep": 1, "max_batch_per_rank": 4, "max_batch_tokens": 80,
                       "chunk_tokens": None, "page_tokens": PAGE},
        "workload": {"kind": "synthetic", "arrival": {"kind": "poisson", "rate_per_s": 200},
                     "prompt": {"kind": "uniform", "lo": 24, "hi": 40},
                     "output": {"kind": "uniform", "lo": 12, "hi": 16}, "n_requests": 5, "seed": 3}})
    b = build(sc)
    reqs = generate(sc.workload, sc.seed)
    cfg = TorchModelConfig.from_hf(json.loads((d / "config.json").read_text()))
    rings = kv_rings(b, cfg, 40, 40, reqs)
    assert rings["ring_pages"] == 3 and rings["decode_rings"] == 40 // -(-min(r.prompt_tokens for r in reqs) // 4) + 2
    res, run = run_real(b, reqs, simulate=simulate, device="cpu", dtype="fp32", weights=str(d), prefill_pages=40,
                        decode_pages=40, tiny_cfg=cfg)
    assert res.metrics["requests"]["done"] == len(reqs)
    for r in reqs:
        prompt = torch.tensor(run.prompt_ids[r.id])[None]
        with torch.no_grad():
            ref = hf.generate(prompt, max_new_tokens=r.output_tokens, do_sample=False)[0, prompt.shape[1]:]
        assert run.generated[r.id] == ref.tolist(), f"request {r.id}"


@pytest.mark.parametrize("page", [16, 64])
def test_a_rank_holds_what_the_memory_budget_charges_per_layer_kind(page):
    """gpt-oss-120b (18 sliding layers of window 128 + 18 full) on a DP decode rank, bf16: one sequence's ring in
    every sliding layer is exactly the simulator's ``window_bytes_per_seq_per_rank`` (``ceil(128 / page) + 1``
    pages per layer), and one page of every full layer is ``page`` tokens of ``kv_bytes_per_token_per_rank``:
    the real rank and the scheduler's memory model charge a request alike. (Shapes only: the meta device.)"""
    from rackbed.engine.core.model import get_model
    from rackbed.engine.core.sharding import ParallelPlan

    m = get_model("gpt-oss-120b")
    cfg = TorchModelConfig.from_spec(m)
    cache = PagedKvCache(cfg.n_layers, 1, cfg.n_kv_heads, page, cfg.head_dim, dtype=torch.bfloat16, device="meta",
                         windows=cfg.kv_windows, ring_seqs=1)
    p = ParallelPlan(role="decode", tp=1, ep=4, dp=4, gpus=(0, 1, 2, 3), page_tokens=page, weight_format="mxfp4")
    assert cache.ring_storage.shape[0] == cache.storage.shape[0] == 18
    assert cache.ring_storage.numel() * 2 == p.window_bytes_per_seq_per_rank(m)
    assert cache.storage.numel() * 2 == page * p.kv_bytes_per_token_per_rank(m)
