"""The graph-capturable prefill chunk of the DeepSeek-V3 (MLA), GLM-4.5, gpt-oss and Qwen3.5 families on CPU.

``ShardedMoeLM.forward_chunk_static`` (what ``PrefillGraphRunner`` captures on a GPU: one sequence padded to a
token bucket, its pages padded to a page bucket) gives the eager ``forward_prefill``'s logits and cache contents --
latent rows (MLA), K/V pages (full GQA layers), the ring of each sliding layer (gpt-oss), the MTP module's KV, the
Gated DeltaNet conv and recurrent state of the sequence's slot (Qwen3.5) -- for a whole prompt and for any split of
it into chunks, each continuing the sequence (hypothesis). A chunk after a cached prefix is the same call as a later
chunk (its start is the prefix's length; Qwen3.5 runs no prefix cache)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from tiny_families import TINY  # noqa: E402

from rackbed.engine.real.comm import Comm  # noqa: E402
from rackbed.engine.real.config import TorchModelConfig  # noqa: E402
from rackbed.engine.real.families import ShardedMoeLM  # noqa: E402
from rackbed.engine.real.model import PrefillGraphRunner, Shard  # noqa: E402

S = 4          # tokens per page
#: name -> (family, config changes, run the MTP module); gpt-oss with a window of 6 tokens: ring of 3 pages = 12
CASES = {
    "deepseek_v3": ("deepseek_v3", {}, False),
    "deepseek_v3_mtp": ("deepseek_v3", {"num_nextn_predict_layers": 1}, True),
    "glm4_moe_mtp": ("glm4_moe", {"num_nextn_predict_layers": 1}, True),
    "gpt_oss": ("gpt_oss", {}, False),
    "qwen3_5_moe": ("qwen3_5_moe", {}, False),
}
#: transformers' model_type of a TINY family's text model, where it differs from the family's name
MODEL_TYPE = {"qwen3_5_moe": "qwen3_5_moe_text"}
_MODELS: dict = {}


def _model(name):
    if name not in _MODELS:
        fam, over, mtp = CASES[name]
        cfg = TorchModelConfig.from_hf({"model_type": MODEL_TYPE.get(fam, fam), **TINY[fam], **over})
        _MODELS[name] = cfg, ShardedMoeLM.random(cfg, Shard(), Comm(), seed=5, mtp=mtp)
    return _MODELS[name]


def _contents(cache, pages, slot=None):
    """What the cache holds for a sequence of ``pages``: its pages of every full / latent layer, its ring of every
    sliding layer, and its Gated DeltaNet state (``slot``)."""
    out = [cache.storage[i][pages] for i in range(cache.storage.shape[0])]
    ring = cache.ring_of(pages)
    if ring:
        out += [cache.ring_storage[i][ring] for i in range(cache.ring_storage.shape[0])]
    if slot is not None:
        out += [cache.states.conv[:, slot], cache.states.rec[:, slot]]
    return out


def _new_cache(m):
    return m.new_cache(64, S, state_slots=2) if m.cfg.has_linear else m.new_cache(64, S)


def _slots(cache):
    """The eager and the static call's state-slot arguments of a new sequence (none without linear layers)."""
    if getattr(cache, "states", None) is None:
        return None, {}, {}
    s = cache.states.alloc()
    return s, {"slots": [s], "resume": True}, {"slot": torch.tensor([s])}


def _check(name, n, cuts):
    cfg, m = _model(name)
    g = torch.Generator().manual_seed(n)
    ids = torch.randint(0, cfg.vocab, (n,), generator=g)
    bounds = [0] + sorted(c for c in set(cuts) if 0 < c < n) + [n]
    eager, static = _new_cache(m), _new_cache(m)
    pages, spages = eager.alloc(n), static.alloc(n)
    (slot, ekw, _), (sslot, _, skw) = _slots(eager), _slots(static)
    runner = PrefillGraphRunner(m, static)          # capture is CUDA-only; its padded inputs are not
    assert runner.scratch not in spages
    with torch.no_grad():
        for a, b in zip(bounds, bounds[1:]):       # every chunk continues the sequence the earlier ones wrote
            ref = m.forward_prefill([ids[a:b]], eager, [pages], [a], **ekw)
            T, P = runner.key(a, b - a, S)
            out = m.forward_chunk_static(*runner.inputs(ids[a:b], a, spages, T, P), static, **skw)
            torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
            for x, y in zip(_contents(static, spages, sslot), _contents(eager, pages, slot)):
                torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4)
        if len(bounds) > 2 and m.mtp is None:      # and the chunks' last logits are the whole prompt's
            whole = _new_cache(m)
            wpages, (wslot, wkw, _) = whole.alloc(n), _slots(whole)
            torch.testing.assert_close(out, m.forward_prefill([ids], whole, [wpages], **wkw), rtol=1e-4, atol=1e-4)
            if wslot is not None:                  # ... and so is the state they leave
                for x, y in zip(_contents(static, [], sslot), _contents(whole, [], wslot)):
                    torch.testing.assert_close(x, y, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", list(CASES))
def test_static_whole_prompt_and_continued_chunk_equal_eager(name):
    """A whole prompt two rings long (gpt-oss: the ring wraps inside one chunk), then a prompt of 27 tokens in three
    chunks whose second starts mid-page and whose third is longer than the ring."""
    _check(name, 26, [])
    _check(name, 27, [5, 11])


@pytest.mark.parametrize("name", list(CASES))
@settings(max_examples=6, deadline=None)
@given(n=st.integers(1, 40), cuts=st.lists(st.integers(1, 39), max_size=3))
def test_static_chunks_equal_eager_prefill(name, n, cuts):
    _check(name, n, cuts)


def test_gated_deltanet_without_a_state_slot_is_refused_with_the_reason():
    _, m = _model("qwen3_5_moe")
    z = torch.zeros(16, dtype=torch.long)
    with pytest.raises(ValueError, match="Gated DeltaNet layers needs the sequence's state slot"):
        m.forward_chunk_static(z, z, z, torch.zeros(8, dtype=torch.long), torch.zeros(1, dtype=torch.long),
                               _new_cache(m))


class _NoHostSync:
    """Fails on an op that reads a device value back to the host or whose output shape depends on data (what a
    CUDA graph capture refuses), seen through torch's dispatch on CPU."""

    BAD = ("_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique")

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        bad = self.BAD

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                name = func.__name__.split(".")[0]
                assert name not in bad, f"{func} in the static chunk"
                if name == "repeat_interleave":
                    assert (kwargs or {}).get("output_size") is not None, f"{func} without output_size"
                return func(*args, **(kwargs or {}))

        self.mode = Mode()


@pytest.mark.parametrize("name", list(CASES))
def test_static_chunk_has_no_host_sync(name):
    """On CPU, through torch's dispatch: no op of the static chunk syncs the host or has a data-dependent shape,
    except the experts' CPU loop (on CUDA they are the grouped-GEMM kernels), stood in for here."""
    cfg, m = _model(name)
    static = _new_cache(m)
    runner = PrefillGraphRunner(m, static)
    pages = static.alloc(30)
    _, _, skw = _slots(static)
    ids = torch.arange(30) % cfg.vocab
    inputs = runner.inputs(ids[11:30], 11, pages, *runner.key(11, 19, S))
    m._experts = lambda w, xs, counts: xs * 2          # the CPU experts loop over counts.tolist()
    try:
        with torch.no_grad(), _NoHostSync().mode:
            m.forward_chunk_static(*inputs, static, **skw)
    finally:
        del m._experts


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("name", list(CASES))
def test_prefill_graph_replay_equals_eager_on_cuda(name):
    """On a GPU, bf16: prompts split into chunks (a chunk at a page-aligned start is what a prefix-cache hit
    replays) through captured graphs of several token and page buckets give the eager prefill's logits and cache."""
    fam, over, mtp = CASES[name]
    cfg = TorchModelConfig.from_hf({"model_type": MODEL_TYPE.get(fam, fam), **TINY[fam], **over})
    m = ShardedMoeLM.random(cfg, Shard(), Comm(), seed=5, mtp=mtp, device="cuda", dtype=torch.bfloat16)
    kw = {"state_slots": 2} if cfg.has_linear else {}
    for n, cuts in ((37, [16]), (130, [64, 100]), (9, [])):
        ids = torch.randint(0, cfg.vocab, (n,), device="cuda")
        eager, static = m.new_cache(128, S, **kw), m.new_cache(128, S, **kw)
        pages = eager.alloc(n)
        runner = PrefillGraphRunner(m, static)
        sp = static.alloc(n)
        slot = eager.states.alloc() if cfg.has_linear else None
        sslot = static.states.alloc() if cfg.has_linear else None
        ekw = {"slots": [slot], "resume": True} if cfg.has_linear else {}
        bounds = [0] + cuts + [n]
        for a, b in zip(bounds, bounds[1:]):
            ref = m.forward_prefill([ids[a:b]], eager, [pages], [a], **ekw)
            out = runner(ids[a:b], a, sp, sslot)
            assert runner.mode == "graph", runner.why
            torch.testing.assert_close(out.float(), ref.float(), rtol=5e-2, atol=5e-2)
        assert runner.n_captured_late == len(runner.graphs) > 0
        for x, y in zip(_contents(static, sp, sslot), _contents(eager, pages, slot)):
            torch.testing.assert_close(x.float(), y.float(), rtol=5e-2, atol=5e-2)
