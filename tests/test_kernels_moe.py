"""MoE kernels: CPU-side checks (MX bit-identity, a2a layout/emulation vs kernels.moe_reference, grouped SwiGLU torch
path and argument checks, fp8 row packing, the torch a2a backend over gloo); GPU checks skip without CUDA/CuTe DSL."""

from __future__ import annotations

import socket

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rackbed.engine.core import formats as ref
from rackbed.kernels import grouped_gemm as gg
from rackbed.kernels import moe_a2a, mx
from rackbed.kernels.moe_reference import DpEpDecodePlan, Routing, reference_moe_dp_ep_decode, route

ALL_FMTS = ref.FORMAT_NAMES + ref.EXTRA_FORMAT_NAMES


def _same_quant(q, t) -> bool:
    r = t.to_reference()
    ok = np.array_equal(q.codes.astype(np.int64), r.codes.astype(np.int64))
    for a, b in ((q.scale_codes, r.scale_codes), (q.scales, r.scales)):
        if a is not None:
            ok = ok and np.array_equal(a, b, equal_nan=True)
    return ok and (q.tensor_scale is None or q.tensor_scale == r.tensor_scale)


@settings(max_examples=60, deadline=None)
@given(fmt=st.sampled_from(ALL_FMTS), role=st.sampled_from(["weight", "activation"]),
       rows=st.integers(1, 5), cols=st.integers(1, 300), log_scale=st.floats(-30, 30), seed=st.integers(0, 2**31),
       specials=st.booleans())
def test_mx_bit_identical_to_reference(fmt, role, rows, cols, log_scale, seed, specials):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, cols)) * np.exp(log_scale)
    if specials:
        x.flat[rng.integers(x.size)] = rng.choice([np.nan, np.inf, -np.inf, 0.0, -0.0])
    q = ref.get_format(fmt).quantize(x, role)
    t = mx.quantize(torch.from_numpy(x), fmt, role)
    assert _same_quant(q, t)
    assert np.array_equal(ref.get_format(fmt).dequantize(q), mx.dequantize(t).numpy(), equal_nan=True)


def test_mx_ties_and_edges():
    # exact midpoints between E2M1 values (ties to even code), saturation, an all-zero block
    x = np.array([[0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, 6.5, -0.25, -5.0] + [0.0] * 21 + [4.0] + [0.0] * 31])
    for fmt in ("mxfp4", "nvfp4", "mxfp6", "mxfp8"):
        q = ref.get_format(fmt).quantize(x)
        assert _same_quant(q, mx.quantize(torch.from_numpy(x), fmt))
    codes = mx.encode(torch.tensor([0.25, 0.75, 1.25, 2.5, 5.0, 100.0]), "e2m1").tolist()
    assert codes == [0, 2, 2, 4, 6, 7]  # 0.25->0 (even), 0.75->1.0, 1.25->1.0, 2.5->2.0, 5->4, saturate to 6
    assert mx.quantize(torch.tensor([1.0]), "fp8").tensor_scale == float(np.float32(1 / 448))


def test_mx_rejects_bad_input():
    with pytest.raises(ValueError):
        mx.quantize(torch.zeros(4, dtype=torch.complex64), "mxfp4")
    with pytest.raises(ValueError):
        mx.quantize(torch.zeros(4), "fp7")


# ---------------------------------------------------------------------------------------------- dispatch/combine


def _check_emulation(routings, ep, D=8, tm=32, E=16, seed=0):
    rng = np.random.default_rng(seed)
    k = routings[0].top_k
    lay = moe_a2a.A2aLayout(ep, tm, 128, k, E // ep, 256)
    xs = [rng.standard_normal((r.n_tokens, D)) for r in routings]
    gu = rng.standard_normal((E, 2 * 4, D)) * 0.3
    dn = rng.standard_normal((E, D, 4)) * 0.3

    def experts(rank, x, ids, w):
        y = np.zeros_like(x)
        per = E // ep
        for row in range(x.shape[0]):
            for j in range(k):
                e = ids[row, j]
                if e >= 0 and rank * per <= e < (rank + 1) * per:
                    h = gu[e] @ x[row]
                    y[row] += w[row, j] * (dn[e] @ (h[:4] / (1 + np.exp(-h[:4])) * h[4:]))
        return y

    recv, outs = moe_a2a.emulate(xs, [r.topk_ids for r in routings], [r.topk_weights for r in routings], lay, experts)
    plan = DpEpDecodePlan.build(routings, ep)
    for j in range(ep):
        for s in range(ep):
            assert recv[j]["counts"][s] == plan.tokens[s, j]
            ids_sent = plan.send_token_ids[s][j] - sum(r.n_tokens for r in routings[:s])
            np.testing.assert_array_equal(recv[j]["x"][s * tm: s * tm + len(ids_sent)], xs[s][ids_sent])
            assert (recv[j]["ids"][s * tm + len(ids_sent): (s + 1) * tm] == -1).all()
    allx = np.concatenate(xs)
    big = Routing.from_ids(np.concatenate([r.topk_ids for r in routings]),
                           np.concatenate([r.topk_weights for r in routings]), E)
    want = reference_moe_dp_ep_decode(allx, big, gu, dn, ep, ep,
                                      np.repeat(np.arange(ep), [r.n_tokens for r in routings]))
    np.testing.assert_allclose(np.concatenate(outs), want, rtol=1e-10, atol=1e-12)


@settings(max_examples=40, deadline=None)
@given(ep=st.sampled_from([1, 2, 4]), tokens=st.lists(st.integers(0, 32), min_size=4, max_size=4),
       dist=st.sampled_from(["uniform", "zipf"]), seed=st.integers(0, 2**31))
def test_a2a_emulation_matches_engine_reference(ep, tokens, dist, seed):
    rng = np.random.default_rng(seed)
    routings = [route(tokens[i], 16, 4, dist=dist, zipf_s=1.5, rng=rng) for i in range(ep)]
    _check_emulation(routings, ep, seed=seed)


def test_a2a_emulation_edge_routings():
    rng = np.random.default_rng(1)
    # all tokens on experts of rank 0 (the other rank's experts empty), and a rank with no tokens at all
    one = Routing.from_ids(np.tile(np.arange(4), (32, 1)), np.full((32, 4), 0.25), 16)
    empty = route(0, 16, 4, rng=rng)
    _check_emulation([one, empty], 2)
    _check_emulation([one, one], 2)


def test_a2a_layout_offsets_are_disjoint_and_aligned():
    lay = moe_a2a.A2aLayout(2, 128, 4096, 8, 64, moe_a2a.row_bytes_for(4096, "fp8"))
    regions = [(lay.zero_off, 16), (lay.ep_off(0, 0), 16 * 128), (lay.rowof_off, 4 * 128 * 2),
               (lay.table_off, 8 * 4), (lay.x_off, 2 * 2 * 128 * lay.row_bytes), (lay.i_off, 2 * 2 * 128 * 32),
               (lay.w_off, 2 * 2 * 128 * 32), (lay.y_off, 2 * 2 * 128 * 8192)]
    assert lay.count_off(1, 1) + 4 <= lay.err_off < lay.zero_off
    for (a, n), (b, _) in zip(regions, regions[1:]):
        assert a + n <= b and b % 16 == 0
    assert regions[-1][0] + regions[-1][1] <= lay.total_bytes
    assert moe_a2a.row_bytes_for(4096, "bf16") == 8192 and lay.row_bytes == 4096 + 128
    for bad in (dict(max_tokens=48), dict(hidden=100), dict(top_k=0)):
        args = dict(n=2, max_tokens=128, hidden=4096, top_k=8, experts_per_rank=64, row_bytes=8192) | bad
        with pytest.raises(ValueError):
            moe_a2a.A2aLayout(**args)
    with pytest.raises(ValueError):
        moe_a2a.row_bytes_for(4096, "fp4")


def test_pack_fp8_rows_matches_fp8_block_reference():
    rng = np.random.default_rng(2)
    x = torch.from_numpy(rng.standard_normal((6, 512)) * 3).to(torch.bfloat16)
    x[2, :128] = 0  # an all-zero block: scale 0, codes 0
    rows = moe_a2a.pack_fp8_rows(x)
    assert rows.shape == (6, 512 + 16) and rows.dtype == torch.uint8
    q = ref.get_format("fp8_block").quantize(x.double().numpy(), "activation")
    codes = rows[:, :512].numpy()
    scales = rows[:, 512:].contiguous().view(torch.float32).numpy()
    np.testing.assert_array_equal(scales, q.scales.astype(np.float32))
    diff = codes != q.codes  # fast path: fp32 x/s can land on an E4M3 tie: one code step off, rarely
    assert diff.mean() < 1e-2
    assert (np.abs(codes[diff].astype(int) - q.codes[diff].astype(int)) == 1).all()
    exact = moe_a2a.pack_fp8_rows(x, exact=True)
    np.testing.assert_array_equal(exact[:, :512].numpy(), q.codes)
    np.testing.assert_array_equal(exact[:, 512:].numpy(), rows[:, 512:].numpy())
    deq = ref.get_format("fp8_block").dequantize(q)
    np.testing.assert_allclose(moe_a2a.unpack_fp8_rows(exact, 512).numpy(), deq, rtol=1e-6, atol=0)
    np.testing.assert_allclose(moe_a2a.unpack_fp8_rows(rows, 512).numpy(), deq, rtol=0.13, atol=0)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gloo_worker(rank, world, port, q):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        rng = np.random.default_rng(10 + rank)
        T, D, k, E, tm = [5, 32][rank], 128, 4, 8, 32
        r = route(T, E, k, dist="zipf", rng=rng)
        a2a = moe_a2a.PeerMoeAllToAll(None, max_tokens=tm, hidden=D, top_k=k, n_experts=E, backend="torch")
        a2a.device = torch.device("cpu")
        out = a2a.alloc_outputs()
        x = torch.randn(T, D).to(torch.bfloat16)
        a2a.dispatch(x, torch.tensor(r.topk_ids, dtype=torch.int32), torch.tensor(r.topk_weights, dtype=torch.float32),
                     out)
        y = (out["x"].float() * 2).to(torch.bfloat16)
        res = torch.empty(T, D, dtype=torch.bfloat16)
        a2a.combine(y, res, T)
        goes = moe_a2a.destinations(r.topk_ids, world, E // world)
        want = (x.float() * 2 * torch.tensor(goes.sum(1), dtype=torch.float32)[:, None]).to(torch.bfloat16)
        q.put((rank, bool(torch.equal(res, want)), out["counts"].tolist()))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_torch_backend_over_gloo():
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_gloo_worker, args=(r, 2, port, q)) for r in range(2)]
    for p in procs:
        p.start()
    got = sorted(q.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(60)
    assert all(ok for _, ok, _ in got), got
    assert all(len(c) == 2 for _, _, c in got)


# ---------------------------------------------------------------------------------------------- grouped GEMM


def test_grouped_swiglu_torch_path_matches_reference():
    g = torch.Generator().manual_seed(0)
    for counts in ([3, 0, 7, 0], [0, 0, 0, 0], [0, 0, 0, 9], [1, 1, 1, 1]):
        R = sum(counts)
        x = torch.randn(R, 256, generator=g)
        gu = torch.randn(4, 512, 256, generator=g) * 0.06
        dn = torch.randn(4, 256, 256, generator=g) * 0.06
        c = torch.tensor(counts)
        y = gg.grouped_swiglu(x, gu, dn, c)
        want = gg.grouped_swiglu_reference(x, gu, dn, c, dtype=torch.float64)
        assert y.shape == (R, 256)
        if R:
            assert float((y.double() - want).norm() / want.norm()) < 1e-5
    x = torch.tensor([[1.0, 2.0]])
    gu = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])  # F=1: g = x0 = 1, u = x1 = 2
    dn = torch.tensor([[[1.0], [3.0]]])
    y = gg.grouped_swiglu(x, gu, dn, torch.tensor([1]))
    s = 1 / (1 + np.exp(-1.0)) * 2.0
    np.testing.assert_allclose(y.numpy(), [[s, 3 * s]], rtol=1e-6)


def test_grouped_swiglu_argument_checks():
    x, gu, dn, c = torch.zeros(4, 256), torch.zeros(2, 512, 256), torch.zeros(2, 256, 256), torch.tensor([2, 2])
    with pytest.raises(ValueError, match="gate_up"):
        gg.grouped_swiglu(x, torch.zeros(2, 511, 256), dn, c)
    with pytest.raises(ValueError, match="down"):
        gg.grouped_swiglu(x, gu, torch.zeros(2, 256, 255), c)
    with pytest.raises(ValueError, match="counts"):
        gg.grouped_swiglu(x, gu, dn, torch.tensor([4]))
    with pytest.raises(ValueError, match="impl"):
        gg.grouped_swiglu(x, gu, dn, c, impl="triton")
    assert gg.decode_kernel_unsupported(x, gu, dn) == "not on CUDA"
    assert gg.use_decode_kernel(256, 128) and not gg.use_decode_kernel(257, 128)
    assert gg.swiglu_weight_bytes([1, 0, 3], 4096, 1536) == 2 * 3 * 1536 * 4096 * 2
    off = gg.expert_offsets(torch.tensor([2, 0, 5]))
    assert off.tolist() == [0, 2, 2, 7] and off.dtype == torch.int32


needs_gpu = pytest.mark.skipif(not torch.cuda.is_available() or gg.cute_unavailable() is not None,
                               reason="needs CUDA and CuTe DSL")


@needs_gpu
def test_gpu_cute_grouped_swiglu():  # pragma: no cover - GPU only
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    gu = (torch.randn(16, 1024, 512, device=dev, generator=g) * 0.04).to(torch.bfloat16)
    dn = (torch.randn(16, 512, 512, device=dev, generator=g) * 0.04).to(torch.bfloat16)
    for counts in ([1] * 16, [0] * 15 + [13], [3, 0, 9, 0] * 4):
        c = torch.tensor(counts, device=dev)
        x = torch.randn(sum(counts), 512, device=dev, generator=g).to(torch.bfloat16)
        out = torch.full((x.shape[0], 512), float("nan"), dtype=torch.bfloat16, device=dev)
        gg.grouped_swiglu_cute(x, gu, dn, c, out=out)
        want = gg.grouped_swiglu_reference(x, gu, dn, c)
        assert not torch.isnan(out).any()
        assert float((out.float() - want).norm() / want.norm()) < 2e-2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_mx_bit_identical():  # pragma: no cover - GPU only
    x = np.random.default_rng(0).standard_normal((64, 320))
    for fmt in ALL_FMTS:
        q = ref.get_format(fmt).quantize(x)
        assert _same_quant(q, mx.quantize(torch.from_numpy(x).cuda(), fmt))
