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


def _mla_case(seed, B, H, S, L, R, N, P):
    """Latent pages, a table, positions anywhere in it (mostly not on a page boundary), absorbed queries and
    the torch reference ``softmax(0.2 * q . row) @ c``."""
    g = torch.Generator().manual_seed(seed)
    latent = torch.randn(N, S, L + R, generator=g)
    table = torch.randint(0, N, (B, P), generator=g)
    pos = torch.randint(0, P * S, (B,), generator=g)
    q = torch.randn(B, H, L + R, generator=g)
    ctx = latent[table].reshape(B, P * S, L + R)
    s = (q @ ctx.transpose(1, 2)) * 0.2
    s = s.masked_fill(~(torch.arange(P * S)[None, :] <= pos[:, None])[:, None, :], float("-inf"))
    return q, latent, table, pos, torch.softmax(s, -1) @ ctx[..., :L]


@pytest.mark.slow
@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), H=st.integers(1, 20), splits=st.integers(1, 4),
       v_split=st.sampled_from([1, 2, 4]), block=st.sampled_from([16, 32]), tokens=st.sampled_from([16, 32]),
       qk_chunk=st.sampled_from([0, 16, 32]))
def test_mla_split_v_equals_the_torch_path_and_the_default_kernel(seed, H, splits, v_split, block, tokens,
                                                                   qk_chunk):
    """The latent-split variant: each of ``v_split`` programs owns a quarter/half/all of the output columns
    and recomputes the scores (whole query or in ``qk_chunk`` columns); head counts off the block, positions
    off the page, 1..4 splits of the pages."""
    L = 64
    q, latent, table, pos, ref = _mla_case(seed, B=2, H=H, S=32, L=L, R=16, N=8, P=3)
    out = pa.mla_decode(q, latent, table, pos, 0.2, L, block_heads=block, block_tokens=tokens, splits=splits,
                        variant="split_v", v_split=v_split, qk_chunk=qk_chunk)
    assert torch.allclose(out, ref, atol=2e-6), (out - ref).abs().max()
    base = pa.mla_decode(q, latent, table, pos, 0.2, L, block_heads=block, block_tokens=tokens, splits=splits)
    assert torch.allclose(out, base, atol=2e-6), (out - base).abs().max()


def test_mla_split_v_with_more_splits_than_blocks_and_a_first_token_only_sequence():
    """Position 0 (one token, every other split empty) and a split count past the page count: the chunks that
    write no max/sum still merge with the chunk that does."""
    q, latent, table, pos, ref = _mla_case(7, B=3, H=3, S=16, L=32, R=16, N=6, P=2)
    pos[0] = 0
    pos[1] = 31
    ctx = latent[table].reshape(3, 32, 48)
    seen = (torch.arange(32)[None, :] <= pos[:, None])[:, None, :]
    s = ((q @ ctx.transpose(1, 2)) * 0.2).masked_fill(~seen, float("-inf"))
    ref = torch.softmax(s, -1) @ ctx[..., :32]
    out = pa.mla_decode(q, latent, table, pos, 0.2, 32, block_heads=16, block_tokens=16, splits=5,
                        variant="split_v", v_split=2, num_stages=2)
    assert torch.allclose(out, ref, atol=2e-6), (out - ref).abs().max()


def test_mla_variant_and_v_split_errors_name_the_bad_value():
    q, latent, table, pos, _ = _mla_case(1, B=1, H=2, S=16, L=32, R=16, N=2, P=1)
    with pytest.raises(ValueError, match="variant 'fast' is not one of default, split_v"):
        pa.mla_decode(q, latent, table, pos, 0.2, 32, variant="fast")
    for bad in (0, 3, 4):  # 32 / 4 = 8 is under a 16-wide tile
        with pytest.raises(ValueError, match=f"v_split {bad} must split kv_lora 32"):
            pa.mla_decode(q, latent, table, pos, 0.2, 32, variant="split_v", v_split=bad)
    for bad, variant in ((8, "split_v"), (24, "split_v"), (64, "split_v"), (16, "default")):
        with pytest.raises(ValueError, match=f"qk_chunk {bad} needs variant='split_v'"):
            pa.mla_decode(q, latent, table, pos, 0.2, 32, variant=variant, qk_chunk=bad)


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


@pytest.mark.slow
def test_mla_sweep_rows_check_each_config_and_record_the_ones_that_do_not_build(monkeypatch, capsys):
    """The GPU sweep's loop on the CPU (interpreter, fp32, one page of context, a fake timer): a good config
    of each variant is checked against the torch path, a config the kernel refuses is an error row, not a
    crash."""
    from rackbed.engine.bench import paged_attention as bench

    monkeypatch.setattr(bench, "_graph_time", lambda fn, reps: (fn(), 1e-3)[1])
    configs = (("default", 1, 64, 64, 4, None, 0), ("split_v", 4, 64, 32, 4, 2, 128),
               ("split_v", 64, 64, 64, 4, 2, 0))
    rows = bench._mla_sweep([1], 40, 1, None, 1e9, configs=configs, dev=torch.device("cpu"), dt=torch.float32)
    assert [r["config"] for r in rows] == ["default_v1_h64_t64_w4_sd", "split_v_v4_h64_t32_w4_s2_c128",
                                           "split_v_v64_h64_t64_w4_s2"]
    assert all(r["ok"] and r["max_rel_err"] < 1e-5 for r in rows[:2]), rows
    assert rows[2]["error"].startswith("ValueError: mla_decode: v_split 64"), rows[2]
    assert "best b=   1: " in capsys.readouterr().out
    skipped = bench._mla_sweep([1], 40, 1, None, -1.0, configs=configs[:1], dev=torch.device("cpu"),
                               dt=torch.float32)
    assert skipped == [{"config": "default_v1_h64_t64_w4_sd", "skipped": "past --max-seconds -1"}]


def test_the_bench_says_in_one_line_that_it_needs_a_gpu(capsys):
    from rackbed.engine.bench import paged_attention as bench

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    assert bench.main(["--mla-sweep"]) == 2
    assert capsys.readouterr().err == "paged_attention bench: needs a CUDA GPU (none is visible)\n"
