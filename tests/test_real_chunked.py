"""Chunked prefill and the graph-capturable prefill path of the real engine, on CPU.

* An aggregated worker whose prompts arrive in chunks (``aggregated.chunk_tokens``) generates Hugging Face's greedy
  tokens, the same as whole-prompt prefill, and its measured run replays to identical decisions.
* ``forward_chunk_static`` (what ``PrefillGraphRunner`` captures: one sequence, padded to a token bucket, KV
  written through a page per row) gives the eager ``forward_prefill``'s logits and KV for any split of a prompt
  into chunks (hypothesis)."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hypothesis import given, settings
from hypothesis import strategies as st
from test_real_aggregated import AGG, LOAD, _run
from tiny_qwen3moe import real_scenario

from rackbed.engine.real.comm import Comm
from rackbed.engine.real.driver import replay
from rackbed.engine.real.model import PrefillGraphRunner, Shard, ShardedQwen3Moe, TorchModelConfig
from rackbed.sim.driver import simulate


@pytest.fixture(scope="module")
def ckpt(tiny_qwen3moe_ckpt):
    return tiny_qwen3moe_ckpt


@pytest.mark.slow
def test_chunked_aggregated_tokens_equal_transformers_and_replay_is_identical(ckpt):
    _, hf, d = ckpt
    sc = real_scenario(d, deployment="aggregated", aggregated={**AGG, "chunk_tokens": 7}, workload=LOAD)
    b, reqs, res, run = _run(d, sc)
    assert res.metrics["requests"]["done"] == len(reqs)
    assert not run.chunk_open, "every chunked prompt reached its end"
    assert max(r.prompt_tokens for r in reqs) > 7, "the workload has prompts longer than a chunk"
    for r in reqs:
        prompt = torch.tensor(run.prompt_ids[r.id])[None]
        with torch.no_grad():
            ref = hf.generate(prompt, max_new_tokens=r.output_tokens, do_sample=False)[0, prompt.shape[1]:]
        assert run.generated[r.id] == ref.tolist(), f"request {r.id}"
    rep = replay(b, reqs, run.records, simulate=simulate, seed=sc.seed, deaths=run.deaths)
    assert res.log.decisions() == rep.log.decisions()


@pytest.fixture(scope="module")
def tiny_model(ckpt):
    _, _, d = ckpt
    cfg = TorchModelConfig.from_hf(json.loads((d / "config.json").read_text()))
    torch.manual_seed(0)
    model = ShardedQwen3Moe.random(cfg, Shard(), Comm(), seed=3)
    return cfg, model


@pytest.mark.slow
@settings(max_examples=12, deadline=None)
@given(n=st.integers(1, 40), cuts=st.lists(st.integers(1, 39), max_size=3, unique=True))
def test_static_chunks_equal_eager_prefill(tiny_model, n, cuts):
    cfg, model = tiny_model
    S = 4
    g = torch.Generator().manual_seed(n)
    ids = torch.randint(0, cfg.vocab, (n,), generator=g)
    eager = model.new_cache(64, S)
    pages = eager.alloc(n)
    ref = model.forward_prefill([ids], eager, [pages])
    static = model.new_cache(64, S)
    spages = static.alloc(n)
    runner = PrefillGraphRunner(model, static)          # capture is CUDA-only; its padded inputs are not
    bounds = [0] + sorted(c for c in cuts if c < n) + [n]
    for a, b in zip(bounds, bounds[1:]):
        T, P = runner.key(a, b - a, S)
        out = model.forward_chunk_static(*runner.inputs(ids[a:b], a, spages, T, P), static)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    for li in range(cfg.n_layers):     # the KV of every prompt token, in the same pages
        torch.testing.assert_close(static.storage[li][spages], eager.storage[li][pages], rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_prefill_graph_replay_equals_eager_on_cuda(ckpt):
    """On a GPU: prompts split into chunks and replayed through captured graphs (several token and page buckets,
    chunks after earlier chunks) give the eager prefill's logits and KV."""
    _, _, d = ckpt
    cfg = TorchModelConfig.from_hf(json.loads((d / "config.json").read_text()))
    # bf16, as timed runs are (the expert GEMMs' CUDA paths are bf16 kernels); the eager and the graph path sum the
    # experts in different orders, so equality is to bf16 rounding
    model = ShardedQwen3Moe.random(cfg, Shard(), Comm(), seed=3, device="cuda", dtype=torch.bfloat16)
    S = 4
    for n, cuts in ((37, [16]), (130, [64, 100]), (9, [])):
        ids = torch.randint(0, cfg.vocab, (n,), device="cuda")
        eager = model.new_cache(128, S)
        pages = eager.alloc(n)
        ref = model.forward_prefill([ids], eager, [pages])
        static = model.new_cache(128, S)
        runner = PrefillGraphRunner(model, static)
        sp = static.alloc(n)
        bounds = [0] + cuts + [n]
        for a, b in zip(bounds, bounds[1:]):
            out = runner(ids[a:b], a, sp)
        assert runner.mode == "graph", runner.why
        assert out.argmax(-1).tolist() == ref.argmax(-1).tolist()
        torch.testing.assert_close(out.float(), ref.float(), rtol=5e-2, atol=5e-2)
        for li in range(cfg.n_layers):
            torch.testing.assert_close(static.storage[li][sp].float(), eager.storage[li][pages].float(),
                                       rtol=5e-2, atol=5e-2)
