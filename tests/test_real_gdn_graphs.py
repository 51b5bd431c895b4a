"""Qwen3.5's Gated DeltaNet layers on the CUDA-graph paths of the real engine, run eagerly on CPU.

* ``DecodeGraphRunner`` (its static step, ``forward_decode_static``, with the rows' state slots in a buffer) pads a
  batch of three to the bucket of four: the step's logits and the sequences' states equal the eager
  ``forward_decode``'s, the padding row steps only the state pool's scratch slot, and no other slot changes.
* Prompts prefilled in chunks through ``forward_chunk_static`` (one of them longer than a delta-rule chunk, padded to
  a token bucket) then decoded through the runner give transformers' greedy tokens.
* The static decode step has no host synchronisation and no data-dependent shape (what a capture refuses).
* An aggregated ``run_real`` whose prompts arrive in chunks continues each sequence's state across its chunks and
  generates transformers' tokens.

The static prefill chunk itself (logits, KV and state equal the eager prefill's for any split into chunks, no host
synchronisation) is tested with the other families in ``test_real_chunk_static_families``."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from test_real_chunk_static_families import _NoHostSync  # noqa: E402
from tiny_families import tiny_hf_family  # noqa: E402

from rackbed.engine.real.comm import Comm  # noqa: E402
from rackbed.engine.real.config import TorchModelConfig  # noqa: E402
from rackbed.engine.real.families import ShardedMoeLM  # noqa: E402
from rackbed.engine.real.model import DecodeGraphRunner, PrefillGraphRunner, Shard  # noqa: E402

S = 4          # tokens per page
ATOL = 1e-4    # fp32 on CPU: the static step's MoE sums the experts in another order than the eager one


@pytest.fixture(scope="module")
def tiny():
    hc, hf = tiny_hf_family("qwen3_5_moe")
    cfg = TorchModelConfig.from_hf(hc)
    return cfg, hf, ShardedMoeLM.from_state_dict(hf.state_dict(), cfg, Shard(), Comm())


def _table(pts):
    width = max(len(pt) for pt in pts)
    return torch.tensor([pt + [pt[0]] * (width - len(pt)) for pt in pts])


def _eager_runner(m, cache):
    """A decode runner that runs its padded static step without capturing (as after a failed capture)."""
    r = DecodeGraphRunner(m, cache)
    r.mode = "eager"
    return r


@pytest.mark.slow
def test_padded_static_decode_equals_eager_and_pads_on_the_scratch_slot(tiny):
    """Three sequences (one slot apart, a fourth slot holding another sequence's state) decode two steps eagerly and
    through the runner (bucket 4, page width 8): equal logits and states; the bystander's and the free slots' state
    are untouched, the scratch slot took the padding row's step."""
    cfg, _, m = tiny
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, cfg.vocab, (n,), generator=g) for n in (9, 3, 14)]
    caches = []
    with torch.no_grad():
        for _ in range(2):
            cache = m.new_cache(48, S, state_slots=6)
            bystander = cache.states.alloc()
            cache.states.rec[:, bystander] = torch.randn(cache.states.rec[:, bystander].shape, generator=g)
            cache.states.conv[:, bystander] = torch.randn(cache.states.conv[:, bystander].shape, generator=g)
            slots = [cache.states.alloc() for _ in prompts]
            cache.states.free(cache.states.alloc())         # slot 4 stays free
            pts = [cache.alloc(len(p) + 2) for p in prompts]
            m.forward_prefill(prompts, cache, pts, slots=slots)
            caches.append((cache, bystander, slots, pts))
        (ce, by, sl, pe), (cs, _, _, ps) = caches
        runner = _eager_runner(m, cs)
        before = cs.states.rec.clone(), cs.states.conv.clone()
        assert runner._bucket(len(prompts), runner.BATCH_BUCKETS) == 4 and cs.states.scratch == 6
        toks, pos = torch.tensor([int(p[-1]) for p in prompts]), torch.tensor([len(p) for p in prompts])
        for step in range(2):
            ref = m.forward_decode(toks, pos + step, ce, _table(pe), slots=torch.tensor(sl))
            out = runner(toks, pos + step, _table(ps), slots=torch.tensor(sl))
            torch.testing.assert_close(out, ref, rtol=ATOL, atol=ATOL)
            toks = ref.argmax(-1)
    for st in ("rec", "conv"):
        e, s, b = getattr(ce.states, st), getattr(cs.states, st), before[0 if st == "rec" else 1]
        torch.testing.assert_close(s[:, sl], e[:, sl], rtol=ATOL, atol=ATOL)
        assert not torch.equal(s[:, sl], b[:, sl]), "the sequences' state did not step"
        untouched = [by, 4, 5]
        assert torch.equal(s[:, untouched], b[:, untouched]), "the padding row wrote a slot other than the scratch"
        assert not torch.equal(s[:, 6], b[:, 6]), "the padding row did not step the scratch slot"


def test_static_decode_has_no_host_sync(tiny):
    """Through torch's dispatch on CPU: the static decode step of a hybrid model, slots included, neither syncs the
    host nor has a data-dependent shape (the experts' CPU loop stood in for, as in the chunk's test)."""
    cfg, _, m = tiny
    cache = m.new_cache(16, S, state_slots=2)
    slots = torch.tensor([cache.states.alloc(), cache.states.scratch])
    pages = cache.alloc(8)
    m._experts = lambda w, xs, counts: xs * 2
    try:
        with torch.no_grad(), _NoHostSync().mode:
            m.forward_decode_static(torch.tensor([3, 0]), torch.tensor([5, 0]), cache,
                                    torch.tensor([pages, pages]), slots)
    finally:
        del m._experts


def test_state_slots_are_required_exactly_with_linear_layers(tiny):
    cfg, _, m = tiny
    cache = m.new_cache(16, S, state_slots=2)
    t = torch.zeros(1, dtype=torch.long)
    table = torch.tensor([cache.alloc(4)])
    with pytest.raises(ValueError, match="needs its state slots as a device tensor"):
        m.forward_decode_static(t, t, cache, table)
    with pytest.raises(ValueError, match="state slots go with Gated DeltaNet layers"):
        _eager_runner(m, cache)(t, t, table)
    with pytest.raises(ValueError, match="state slot goes with Gated DeltaNet layers"):
        PrefillGraphRunner(m, cache)(torch.zeros(3, dtype=torch.long), 0, table[0].tolist())


@pytest.mark.slow
def test_static_chunks_and_padded_decode_give_transformers_tokens(tiny):
    """Prompts of 11, 3 and 70 tokens, prefilled in chunks through ``forward_chunk_static`` (the 70 as 30 + 40,
    the 40 padded to 64 tokens; the 11 as 4 + 7) on slots the pool hands out, then six decode steps of the three
    through the runner (bucket 4): the greedy tokens equal ``generate``'s."""
    cfg, hf, m = tiny
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, cfg.vocab, (n,), generator=g) for n in (11, 3, 70)]
    cuts = {0: [4], 2: [30]}
    cache = m.new_cache(64, S, state_slots=3)
    decode = _eager_runner(m, cache)
    prefill = PrefillGraphRunner(m, cache, scratch=decode.scratch)
    pts = [cache.alloc(len(p)) for p in prompts]
    slots = [cache.states.alloc() for _ in prompts]
    steps = 6
    toks = []
    with torch.no_grad():
        for i, p in enumerate(prompts):
            bounds = [0] + cuts.get(i, []) + [len(p)]
            for a, b in zip(bounds, bounds[1:]):
                T, P = prefill.key(a, b - a, S)
                out = m.forward_chunk_static(*prefill.inputs(p[a:b], a, pts[i], T, P), cache,
                                             slot=torch.tensor([slots[i]]))
            toks.append([int(out.argmax())])
        pos = [len(p) for p in prompts]
        for _ in range(steps):
            for i in range(len(prompts)):
                cache.grow(pts[i], pos[i] + 1)
            lo = decode(torch.tensor([t[-1] for t in toks]), torch.tensor(pos), _table(pts), slots=torch.tensor(slots))
            for i in range(len(prompts)):
                toks[i].append(int(lo[i].argmax()))
                pos[i] += 1
        ref = [hf.generate(p[None], max_new_tokens=steps + 1, do_sample=False)[0, len(p):].tolist() for p in prompts]
    assert toks == ref


@pytest.mark.slow
@pytest.mark.parametrize("static", [False, True])
def test_chunked_aggregated_run_real_tokens_equal_transformers(ckpt, static, monkeypatch):
    """An aggregated worker with ``chunk_tokens`` 7: a prompt's later chunks continue the state its earlier chunks
    left in its slot, and every request gets transformers' greedy tokens -- through the eager steps
    (``forward_prefill(resume=True)``, ``forward_decode``), and (``static``, ``RACKBED_STATIC_STEPS=1``) through the
    worker's graph runners running their static steps uncaptured: each chunk padded to its token bucket on the
    sequence's slot, each decode batch padded to its bucket with padding rows on the scratch slot."""
    from test_real_gdn import AGG, _run

    if static:
        monkeypatch.setenv("RACKBED_STATIC_STEPS", "1")
    hf, d = ckpt
    sc, b, reqs, res, run = _run(d, aggregated={**AGG, "chunk_tokens": 7})
    modes = {kind: r["mode"] for rep in run.pool.graph_reports.values() for kind, r in rep.items()}
    assert modes == ({"decode": "static", "prefill": "static"} if static else {"decode": "eager", "prefill": "eager"})
    assert res.metrics["requests"]["done"] == len(reqs)
    assert max(r.prompt_tokens for r in reqs) > 7 and not run.chunk_open
    for r in reqs:
        prompt = torch.tensor(run.prompt_ids[r.id])[None]
        with torch.no_grad():
            ref = hf.generate(prompt, max_new_tokens=r.output_tokens, do_sample=False)[0, prompt.shape[1]:]
        assert run.generated[r.id] == ref.tolist(), f"request {r.id}"


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from tiny_qwen3moe import save_checkpoint

    hc, hf = tiny_hf_family("qwen3_5_moe", linear_value_head_dim=16)
    return hf, save_checkpoint(hc, hf, tmp_path_factory.mktemp("real_gdn_graphs") / "ckpt")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_graph_replays_equal_eager_on_cuda():
    """On a GPU, bf16: three prompts prefilled through captured prefill graphs (one in two chunks, one longer than a
    delta-rule chunk), then decode steps of the three through captured decode graphs (bucket 4: a padding row on the
    scratch slot) give the eager path's logits and state; both runners stay in graph mode and the bystander slot is
    untouched."""
    from tiny_families import TINY

    cfg = TorchModelConfig.from_hf({"model_type": "qwen3_5_moe_text", **TINY["qwen3_5_moe"]})
    m = ShardedMoeLM.random(cfg, Shard(), Comm(), seed=5, device="cuda", dtype=torch.bfloat16)
    g = torch.Generator(device="cuda").manual_seed(2)
    prompts = [torch.randint(0, cfg.vocab, (n,), device="cuda", generator=g) for n in (37, 9, 130)]
    cuts = {0: [16]}
    eager, static = m.new_cache(256, S, state_slots=5), m.new_cache(256, S, state_slots=5)
    by = static.states.alloc()
    static.states.rec[:, by] = 1.0
    decode = DecodeGraphRunner(m, static)
    prefill = PrefillGraphRunner(m, static, scratch=decode.scratch)
    pe, ps = [eager.alloc(len(p) + 8) for p in prompts], [static.alloc(len(p) + 8) for p in prompts]
    se, ss = [eager.states.alloc() for _ in prompts], [static.states.alloc() for _ in prompts]
    tol = {"rtol": 5e-2, "atol": 5e-2}
    with torch.no_grad():
        for i, p in enumerate(prompts):
            bounds = [0] + cuts.get(i, []) + [len(p)]
            for a, b in zip(bounds, bounds[1:]):
                ref = m.forward_prefill([p[a:b]], eager, [pe[i]], [a], slots=[se[i]], resume=True)
                out = prefill(p[a:b], a, ps[i], ss[i])
                assert prefill.mode == "graph", prefill.why
                torch.testing.assert_close(out.float(), ref.float(), **tol)
        toks = torch.tensor([0, 1, 2], device="cuda")
        pos = torch.tensor([len(p) for p in prompts], device="cuda")
        for step in range(4):
            ref = m.forward_decode(toks, pos + step, eager, _table(pe).cuda(), slots=torch.tensor(se, device="cuda"))
            out = decode(toks, pos + step, _table(ps).cuda(), slots=torch.tensor(ss, device="cuda"))
            assert decode.mode == "graph", decode.why
            torch.testing.assert_close(out.float(), ref.float(), **tol)
            toks = ref.argmax(-1)
    assert len(decode.graphs) >= 1 and len(prefill.graphs) >= 3
    torch.testing.assert_close(static.states.rec[:, ss], eager.states.rec[:, se], **tol)
    torch.testing.assert_close(static.states.conv[:, ss].float(), eager.states.conv[:, se].float(), **tol)
    assert torch.equal(static.states.rec[:, by], torch.ones_like(static.states.rec[:, by]))
