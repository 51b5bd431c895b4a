"""kernels/moe_block.py (the engine's graph-capturable MoE block) and the FP8 block-scale helpers of
kernels/bench/measure.py, on the CPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rackbed.engine.core.formats import get_format
from rackbed.kernels.bench import measure
from rackbed.kernels.grouped_gemm import grouped_swiglu_reference
from rackbed.kernels.moe_block import moe_block, permute, route, unpermute


def _loop_swiglu(xs, gate_up, down, counts):
    return grouped_swiglu_reference(xs, gate_up, down, counts, dtype=torch.float64)


def _per_token(h, logits, gate_up, down, k):
    """The MoE as written in Qwen3-MoE: per token, softmax (in fp32, as the engine routes), top-k, renormalise,
    sum of weighted experts."""
    F = down.shape[-1]
    out = torch.zeros_like(h)
    probs = torch.softmax(logits.float(), -1)
    for t in range(h.shape[0]):
        w, e = torch.topk(probs[t], k)
        w = (w / w.sum()).to(h.dtype)
        for wj, ej in zip(w, e):
            gu = h[t] @ gate_up[ej].T
            out[t] += wj * ((torch.nn.functional.silu(gu[:F]) * gu[F:]) @ down[ej].T)
    return out


@settings(max_examples=25, deadline=None, derandomize=True)
@given(T=st.integers(1, 9), E=st.integers(2, 6), k=st.integers(1, 3), seed=st.integers(0, 2**16))
def test_moe_block_is_the_per_token_moe(T, E, k, seed):
    k = min(k, E)
    g = torch.Generator().manual_seed(seed)
    D, F = 8, 4
    h = torch.randn(T, D, generator=g, dtype=torch.float64)
    logits = torch.randn(T, E, generator=g, dtype=torch.float64)
    gu = torch.randn(E, 2 * F, D, generator=g, dtype=torch.float64)
    dn = torch.randn(E, D, F, generator=g, dtype=torch.float64)
    got = moe_block(h, logits, gu, dn, k, swiglu=_loop_swiglu)
    assert torch.allclose(got, _per_token(h, logits, gu, dn, k), rtol=1e-9, atol=1e-9)


def test_the_parts_compose_and_rows_are_grouped_by_expert():
    g = torch.Generator().manual_seed(1)
    T, E, k, D = 6, 5, 2, 4
    h = torch.randn(T, D, generator=g, dtype=torch.float64)
    topi, topw = route(torch.randn(T, E, generator=g, dtype=torch.float64), k)
    assert torch.allclose(topw.sum(-1), torch.ones(T, dtype=torch.float64))
    order, tok, counts, xs = permute(h, topi, E)
    ids = topi.reshape(-1)[order]
    assert torch.equal(ids, torch.sort(topi.reshape(-1), stable=True).values)  # sorted by expert
    assert torch.equal(counts, torch.bincount(topi.reshape(-1), minlength=E)) and int(counts.sum()) == T * k
    assert torch.equal(xs, h[tok])
    # unpermute of the identity "experts" gives back h (the weights of a token sum to 1)
    assert torch.allclose(unpermute(xs, tok, order, topw, h), h)


# ------------------------------------------------------------------------------------ FP8 block-scale helpers

@settings(max_examples=10, deadline=None, derandomize=True)
@given(m=st.sampled_from([1, 3, 8]), kb=st.integers(1, 3), nb=st.integers(1, 2), seed=st.integers(0, 2**16))
def test_block_quantisers_match_the_fp8_block_format(m, kb, nb, seed):
    """The measurement's quantisers are ``engine.core.formats``' fp8_block (1x128 activations, 128x128 weights):
    the same scales (fp32(amax / 448)) and the same values within one E4M3 rounding step; the activation scales
    are laid out column-major, as ``torch._scaled_mm`` reads them."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, 128 * kb, generator=g) * 3
    w = torch.randn(128 * nb, 128 * kb, generator=g)
    fmt = get_format("fp8_block")
    for t, (q, s), role in ((x, measure.quantize_1x128(x), "activation"),
                            (w, measure.quantize_128x128(w), "weight")):
        ref = fmt.quantize(t.numpy().astype(np.float64), role)
        np.testing.assert_allclose(s.numpy(), ref.scales.reshape(s.shape), rtol=1e-6)
        np.testing.assert_allclose(measure.dequant_block(q, s).numpy(), fmt.dequantize(ref), rtol=2**-3, atol=0)
    sa = measure.quantize_1x128(torch.randn(m + 1, 256, generator=g))[1]  # (a size-1 dim has no stride)
    assert sa.stride() == (1, m + 1) and measure.col_major(sa[:2]).stride() == (1, 2)


def test_block_m_align_pads_to_the_smallest_alignment_every_m_runs_at():
    """cuBLASLt's block-scaled kernels refuse m = 1, 2 (H200, CUDA 13.0): the rows are padded to a multiple of the
    smallest alignment at which every m runs (a call refusing only m % 4 != 0 gives 4)."""
    def call(a, sa, w, sw):
        if a.shape[0] % 4:
            raise RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED")
        return measure.dequant_block(a, sa) @ measure.dequant_block(w, sw).t()

    align, refused = measure.block_m_align("cpu", call, torch.Generator().manual_seed(0))
    assert align == 4 and refused == [m for m in range(1, 33) if m % 4]
    assert [measure._pad(m, 4) for m in (1, 2, 4, 5, 16)] == [4, 4, 4, 8, 16]
    assert measure.block_m_align("cpu", lambda *a: None, torch.Generator())[0] == 1


@pytest.mark.slow
def test_dry_run_measures_every_part_of_the_moe_block(tmp_path):
    doc = measure.run(dry_run=True, only=["moe_block", "fp8_block"], partial_out=tmp_path / "m.json",
                      echo=lambda *a: None)
    rows = [r for r in doc["rows"] if r["bench"] == "moe_block"]
    assert {r["part"] for r in rows} == set(measure.MOE_PARTS)
    assert all(r["median_us"] > 0 and r["relerr"] < 1e-2 and r["dist"] == "balanced" for r in rows)
    assert not [r for r in doc["rows"] if r["bench"] == "gemm"]  # no FP8 kernels on the CPU


@pytest.mark.parametrize("T", [1, 5])
def test_the_engine_static_decode_runs_the_block(T):
    """``forward_decode_static`` (the graph-captured step) runs kernels/moe_block.py and equals the eager step."""
    import rackbed.engine.real.model as M
    from rackbed.engine.real.comm import Comm

    cfg = M.TorchModelConfig(hidden=32, n_layers=2, n_q_heads=4, n_kv_heads=2, head_dim=8, n_experts=6, top_k=2,
                             moe_intermediate=16, vocab=50)
    model = M.ShardedQwen3Moe.random(cfg, M.Shard(), Comm(), seed=3, dtype=torch.float64)
    cache = model.new_cache(4 * T + 4, 4)
    tok, pos = torch.arange(T) % 50, torch.zeros(T, dtype=torch.long)
    table = torch.arange(1, 1 + 2 * T).view(T, 2)
    a = model.forward_decode(tok, pos, cache, table)
    b = model.forward_decode_static(tok, pos, cache, table)
    assert torch.allclose(a, b, rtol=1e-10, atol=1e-12)
