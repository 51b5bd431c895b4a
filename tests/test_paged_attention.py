"""The Triton paged decode attention (``kernels.paged_attention``) equals the engine's torch attention over gathered
pages -- GQA with windows, rings and sinks, and MLA's absorbed form -- and the engine's decode steps give the same
logits with it as without it, for every family. On the CPU the kernels run under Triton's interpreter (fp32:
the interpreter has no bf16); on the GPU the decode benchmark checks bf16 against the torch path."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from lane import first_in_lane

from rackbed.engine.real import layers_gqa
from rackbed.kernels import paged_attention as pa


@pytest.fixture(autouse=True)
def interpreter(monkeypatch):
    """Triton's interpreter on the CPU (switched on by conftest.py before triton is imported); the kernels are
    (re)built under it and dropped after the test."""
    monkeypatch.setenv("RACKBED_PAGED_ATTENTION", "interpret")
    pa._kernels.cache_clear()
    yield
    pa._kernels.cache_clear()


class _Cfg:
    def __init__(self, head_dim):
        self.head_dim = head_dim


def _cache(gen, n_pages, hkv, S, D):
    return torch.randn(n_pages, 2, hkv, S, D, generator=gen)


@pytest.mark.slow
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), group=st.sampled_from([1, 3, 4, 16]), window=st.sampled_from([0, 5, 23]),
       sinks=st.booleans(), splits=st.integers(1, 5), P=st.integers(1, 4))
def test_gqa_equals_the_torch_path(seed, group, window, sinks, splits, P):
    g = torch.Generator().manual_seed(seed)
    B, Hkv, S, D, N = 3, 2, 16, 16, 12
    Hq = Hkv * group
    cache = _cache(g, N, Hkv, S, D)
    table = torch.randint(0, N, (B, P), generator=g)
    pos = torch.randint(0, P * S, (B,), generator=g)
    q = torch.randn(B, Hq, D, generator=g)
    w = {"sinks": torch.randn(Hq, generator=g)} if sinks else {}
    ref = layers_gqa.decode(w, q.transpose(0, 1), cache[table], pos, window, _Cfg(D))
    out = pa.gqa_decode(q, cache, table, pos, D ** -0.5, window=window, sinks=w.get("sinks"), splits=splits)
    assert torch.allclose(out, ref, atol=2e-6), (out - ref).abs().max()


@pytest.mark.slow
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), window=st.sampled_from([1, 6, 16, 30]), sinks=st.booleans(),
       splits=st.integers(1, 3))
def test_ring_equals_the_torch_path(seed, window, sinks, splits):
    """Ring slots are read by age, so every position (before and after the ring wraps) sees exactly its window."""
    g = torch.Generator().manual_seed(seed)
    B, Hkv, Hq, S, D, N, Rp = 4, 2, 4, 16, 16, 10, 2
    cache = _cache(g, N, Hkv, S, D)
    rings = torch.randint(0, N, (B, Rp), generator=g)
    pos = torch.randint(0, 200, (B,), generator=g)
    q = torch.randn(B, Hq, D, generator=g)
    w = {"sinks": torch.randn(Hq, generator=g)} if sinks else {}
    ref = layers_gqa.decode_ring(w, q.transpose(0, 1), cache[rings], pos, window, _Cfg(D))
    out = pa.gqa_decode(q, cache, rings, pos, D ** -0.5, window=window, ring=True, sinks=w.get("sinks"),
                        splits=splits)
    assert torch.allclose(out, ref, atol=2e-6), (out - ref).abs().max()


@pytest.mark.slow
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), H=st.integers(1, 20), splits=st.integers(1, 3), block=st.sampled_from([16, 32]))
def test_mla_equals_the_torch_path(seed, H, splits, block):
    g = torch.Generator().manual_seed(seed)
    B, S, L, R, N, P = 3, 16, 32, 16, 10, 3
    latent = torch.randn(N, S, L + R, generator=g)
    table = torch.randint(0, N, (B, P), generator=g)
    pos = torch.randint(0, P * S, (B,), generator=g)
    q = torch.randn(B, H, L + R, generator=g)
    ctx = latent[table].reshape(B, P * S, L + R)
    s = (q @ ctx.transpose(1, 2)) * 0.2
    s = s.masked_fill(~(torch.arange(P * S)[None, :] <= pos[:, None])[:, None, :], float("-inf"))
    ref = torch.softmax(s, -1) @ ctx[..., :L]
    out = pa.mla_decode(q, latent, table, pos, 0.2, L, block_heads=block, splits=splits)
    assert torch.allclose(out, ref, atol=2e-6), (out - ref).abs().max()


def test_a_position_past_the_table_reads_nothing_beyond_it_and_empty_splits_merge_to_the_same_answer():
    """More splits than pages: the surplus splits see no token and must not change the merge."""
    g = torch.Generator().manual_seed(3)
    cache = _cache(g, 4, 1, 16, 16)
    table = torch.tensor([[2, 0]])
    q = torch.randn(1, 2, 16, generator=g)
    pos = torch.tensor([5])
    one = pa.gqa_decode(q, cache, table, pos, 0.25, splits=1)
    many = pa.gqa_decode(q, cache, table, pos, 0.25, splits=7)
    assert torch.allclose(one, many, atol=1e-6)


def test_split_count_and_shape_rules():
    assert pa.n_splits(4, 64) == 64 and pa.n_splits(256, 64) == 2 and pa.n_splits(1000, 64) == 1
    assert pa.n_splits(4, 1) == 1 and pa.n_splits(0, 8) == 1
    assert pa.shape_unsupported(64, 128) is None and pa.shape_unsupported(64, 512, 64) is None
    assert "page_tokens=4" in pa.shape_unsupported(4, 128)
    assert "width=576" in pa.shape_unsupported(64, 576)


def test_off_switch_and_cpu_default(monkeypatch):
    monkeypatch.setenv("RACKBED_PAGED_ATTENTION", "torch")
    assert pa.unavailable(torch.device("cpu")) == "RACKBED_PAGED_ATTENTION=torch"
    monkeypatch.setenv("RACKBED_PAGED_ATTENTION", "triton")
    assert pa.unavailable(torch.device("cpu")) == "not a CUDA device"


def _decode_logits(model, cache, prompts, steps):
    pts = [cache.alloc(len(p)) for p in prompts]
    out = []
    with torch.no_grad():
        lo = model.forward_prefill(prompts, cache, pts)
        toks = [int(lo[i].argmax()) for i in range(len(prompts))]
        pos = [len(p) for p in prompts]
        for _ in range(steps):
            for i in range(len(prompts)):
                cache.grow(pts[i], pos[i] + 1)
            width = max(len(p) for p in pts)
            table = torch.tensor([p + [p[0]] * (width - len(p)) for p in pts])
            lo = model.forward_decode(torch.tensor(toks), torch.tensor(pos), cache, table)
            out.append(lo)
            toks = [int(lo[i].argmax()) for i in range(len(prompts))]
            pos = [p + 1 for p in pos]
    return torch.stack(out)


@pytest.mark.parametrize("family", first_in_lane(["gpt_oss", "qwen3_moe", "deepseek_v3", "glm4_moe"]))
def test_engine_decode_steps_equal_with_and_without_the_kernel(family, monkeypatch):
    """Whole decode steps of each family (MLA; sliding layers on their ring with sinks; GQA with biases), pages of
    16 slots, prompts past gpt-oss's window: logits with the kernel equal the torch path's."""
    pytest.importorskip("transformers")
    from tiny_families import tiny_hf_family
    from tiny_qwen3moe import tiny_hf_model

    from rackbed.engine.real.comm import Comm
    from rackbed.engine.real.config import TorchModelConfig
    from rackbed.engine.real.families import model_class
    from rackbed.engine.real.model import Shard, paged_kernel_on

    hc, hf = tiny_hf_model() if family == "qwen3_moe" else tiny_hf_family(
        family, **({"qk_rope_head_dim": 16} if family == "deepseek_v3" else {}))
    cfg = TorchModelConfig.from_hf(hc)
    m = model_class(cfg).from_state_dict(hf.state_dict(), cfg, Shard(), Comm())
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, cfg.vocab, (n,), generator=g) for n in (21, 9, 40)]
    got = {}
    for mode in ("interpret", "torch"):
        monkeypatch.setenv("RACKBED_PAGED_ATTENTION", mode)
        assert paged_kernel_on(torch.device("cpu"), 16, 16) == (mode == "interpret")
        got[mode] = _decode_logits(m, m.new_cache(48, 16), prompts, steps=4)
    assert torch.allclose(got["interpret"], got["torch"], atol=2e-5), (got["interpret"] - got["torch"]).abs().max()
