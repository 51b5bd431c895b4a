"""Tensor-core decode grouped GEMM (kernels/grouped_gemm_mma.py): CPU-side checks and GPU checks.

CPU: a numpy emulation of the kernel's work split and register choices (active-expert compaction, persistent
item loop, split-K over warps, each lane's 16-byte loads fed to mma.sync m16n8k16 whose fragment layout is taken
from the PTX ISA, clamped padding tokens, the epilogue's (row, token) mapping) must equal the fp64 reference;
the tiling checks and the ``impl="auto"`` dispatch rules. With CuTe DSL importable (any machine): the kernel
compiles for sm_90a and its PTX holds the expected number of MMAs. GPU: NaN-poisoned outputs against fp32.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rackbed.kernels import grouped_gemm as gg

# ------------------------------------------------------------------------------------- emulation of the kernel


def _mma_ptx(a_regs, b_regs, c):
    """m16n8k16 per the PTX ISA fragment layout. a_regs[lane] = 4 regs of 2 values, b_regs[lane] = 2 regs,
    c[lane] = 4 floats. Returns the new c per lane."""
    A = np.zeros((16, 16))
    B = np.zeros((16, 8))
    C = np.zeros((16, 8))
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for i in range(8):  # a_i: row g (i in 0,1,4,5) or g+8; col 2t + (i & 1) (+8 for i >= 4)
            A[g + 8 * ((i // 2) % 2), 2 * t + (i % 2) + 8 * (i // 4)] = a_regs[lane][i // 2][i % 2]
        for i in range(4):  # b_i: k = 2t + (i & 1) (+8 for i >= 2), n = g
            B[2 * t + (i % 2) + 8 * (i // 2), g] = b_regs[lane][i // 2][i % 2]
        for i in range(4):  # c_i: row g (+8 for i >= 2), col 2t + (i & 1)
            C[g + 8 * (i // 2), 2 * t + i % 2] = c[lane][i]
    D = A @ B + C
    return [[D[lane // 4 + 8 * (i // 2), 2 * (lane % 4) + i % 2] for i in range(4)] for lane in range(32)]


def emulate(x, w, offs, fuse: bool, rb: int, warps: int, n_ctas: int, tn: int = 1):
    """The kernel's arithmetic in float64, step for step (see grouped_gemm_mma's docstring); ``tn`` token groups of
    8 per weight pass, results spread over the CTA's threads as the kernel's epilogue loop does."""
    E, N, K = w.shape
    n_out = N // 2 if fuse else N
    out = np.full((x.shape[0], n_out), np.nan)
    tiles = n_out // (16 * rb)
    nb = 2 * rb if fuse else rb
    kw = K // warps
    n_thr, n_res = 32 * warps, rb * 4 * 32 * tn
    act = [e for e in range(E) if offs[e + 1] > offs[e]]  # ballot compaction keeps expert order
    for bid in range(n_ctas):
        for item in range(bid, len(act) * tiles, n_ctas):
            e, tile = act[item // tiles], item % tiles
            start, end = offs[e], offs[e + 1]
            n0 = tile * 16 * rb
            r0s = [n0 + 16 * j if j < rb else n0 + n_out + 16 * (j - rb) for j in range(nb)]
            for tok0 in range(start, end, 8 * tn):
                red = np.zeros((warps, tn * nb, 32, 4))
                for warp in range(warps):
                    acc = [[[0.0] * 4 for _ in range(32)] for _ in range(tn * nb)]
                    for c in range(kw // 32):
                        k0 = [warp * kw + c * 32 + (lane % 4) * 8 for lane in range(32)]
                        for j in range(nb):
                            lo = [w[e, r0s[j] + ln // 4, k0[ln]:k0[ln] + 8].reshape(4, 2) for ln in range(32)]
                            hi = [w[e, r0s[j] + ln // 4 + 8, k0[ln]:k0[ln] + 8].reshape(4, 2) for ln in range(32)]
                            for tg in range(tn):
                                xr = [min(tok0 + 8 * tg + lane // 4, end - 1) for lane in range(32)]
                                b = [x[xr[ln], k0[ln]:k0[ln] + 8].reshape(4, 2) for ln in range(32)]  # 4 regs of 2
                                v = tg * nb + j
                                acc[v] = _mma_ptx([[lo[ln][0], hi[ln][0], lo[ln][1], hi[ln][1]] for ln in range(32)],
                                                  [[b[ln][0], b[ln][1]] for ln in range(32)], acc[v])
                                acc[v] = _mma_ptx([[lo[ln][2], hi[ln][2], lo[ln][3], hi[ln][3]] for ln in range(32)],
                                                  [[b[ln][2], b[ln][3]] for ln in range(32)], acc[v])
                    red[warp] = np.array(acc)
                for i in range(-(-n_res // n_thr)):
                    for tid in range(n_thr):
                        o = tid + i * n_thr
                        if o >= n_res:
                            continue
                        ln, q, jj, tg = o % 32, (o // 32) % 4, (o // 128) % rb, o // (128 * rb)
                        row = n0 + 16 * jj + ln // 4 + 8 * (q // 2)
                        tok = tok0 + 8 * tg + 2 * (ln % 4) + q % 2
                        vg = tg * nb + jj
                        gsum = red[:, vg, ln, q].sum()
                        y = gsum / (1 + np.exp(-gsum)) * red[:, vg + rb, ln, q].sum() if fuse else gsum
                        if tok < end:
                            assert np.isnan(out[tok, row])  # each (token, row) written once
                            out[tok, row] = y
    return out


@settings(max_examples=12, deadline=None)
@given(counts=st.lists(st.integers(0, 10), min_size=1, max_size=4).filter(lambda c: sum(c) > 0),
       fuse=st.booleans(), rb=st.sampled_from([1, 2, 4]), warps=st.sampled_from([1, 2, 4]),
       n_ctas=st.integers(1, 5), tn=st.sampled_from([1, 2]), seed=st.integers(0, 2**31))
def test_emulated_kernel_equals_reference(counts, fuse, rb, warps, n_ctas, tn, seed):
    rng = np.random.default_rng(seed)
    E, K = len(counts), 32 * warps
    n_out = 16 * rb * 2
    N = 2 * n_out if fuse else n_out
    assert gg.mma_tiling_unsupported(E, N, K, fuse, rb, warps, tn) is None
    w = rng.standard_normal((E, N, K))
    x = rng.standard_normal((sum(counts), K))
    offs = np.concatenate([[0], np.cumsum(counts)])
    got = emulate(x, w, offs, fuse, rb, warps, n_ctas, tn)
    want = np.zeros_like(got)
    for e in range(E):
        y = x[offs[e]:offs[e + 1]] @ w[e].T
        want[offs[e]:offs[e + 1]] = y[:, :n_out] / (1 + np.exp(-y[:, :n_out])) * y[:, n_out:] if fuse else y
    assert not np.isnan(got).any()  # every (row, output) written exactly by the item that owns it
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-9)


def test_emulated_kernel_layout_is_not_trivially_symmetric():
    """A wrong register order (hi/lo swapped in the A operand) must give a different answer."""
    rng = np.random.default_rng(1)
    a = [[rng.standard_normal(2) for _ in range(4)] for _ in range(32)]
    b = [[rng.standard_normal(2) for _ in range(2)] for _ in range(32)]
    c0 = [[0.0] * 4 for _ in range(32)]
    swapped = [[r[1], r[0], r[3], r[2]] for r in a]
    assert not np.allclose(_mma_ptx(a, b, c0), _mma_ptx(swapped, b, c0))


# ------------------------------------------------------------------------------------- tiling and dispatch


def test_tiling_checks():
    c = gg.mma_config(True)
    assert gg.mma_tiling_unsupported(128, 3072, 4096, True, c["rb"], c["warps"]) is None
    c = gg.mma_config(False)
    assert gg.mma_tiling_unsupported(128, 4096, 1536, False, c["rb"], c["warps"]) is None
    assert "multiple of 256" in gg.mma_tiling_unsupported(8, 64, 4000, False, 1, 8)
    assert "output width" in gg.mma_tiling_unsupported(8, 40, 256, False, 1, 8)
    assert "even N" in gg.mma_tiling_unsupported(8, 33, 256, True, 1, 8)
    assert "shared memory" in gg.mma_tiling_unsupported(8, 256, 256, True, 4, 8, 2)
    assert gg.mma_tiling_unsupported(8, 64, 128, False, 2, 4) is None  # epilogue loops when threads < results
    assert "tn" in gg.mma_tiling_unsupported(8, 64, 256, False, 1, 8, 3)
    assert "E=" in gg.mma_tiling_unsupported(2000, 64, 256, False, 1, 8)
    assert gg.mma_items(3, 3072, True, 1) == 3 * 96 and gg.mma_items(1, 4096, False, 2) == 128


def test_dispatch_rules():
    rules = ((0.5, 1, "cute_gemv"), (8, 1, "cute_mma"))
    assert gg.pick_decode_impl(64, 128, rules) == "cute_gemv"
    assert gg.pick_decode_impl(65, 128, rules) == "cute_mma"
    assert gg.pick_decode_impl(1025, 128, rules) == "torch"
    assert gg.pick_decode_impl(8, 8, ((8, 16, "cute_mma"),)) == "torch"  # below the expert minimum
    assert gg.pick_decode_impl(256, 128) == gg.DECODE_DISPATCH[0][2]  # the shipped table: first rule covers 2 rows
    x, gu, dn, c = torch.randn(4, 256), torch.randn(2, 512, 256), torch.randn(2, 256, 256), torch.tensor([2, 2])
    y = gg.grouped_swiglu(x, gu, dn, c, impl="auto")  # CPU: auto falls back to torch
    torch.testing.assert_close(y, gg.grouped_swiglu_reference(x, gu, dn, c, dtype=torch.float32))
    assert gg.mma_unsupported(x, gu, dn) == "not on CUDA"
    with pytest.raises(ValueError, match="cute_mma"):
        gg.grouped_swiglu(x, gu, dn, c, impl="cute_mma")


def test_suggest_dispatch():
    def row(r, torch_us, gemv, mma):
        return {"rows": r, "experts": 128, "torch_us": torch_us, "cute_gemv_us": gemv, "cute_mma_us": mma,
                "cute_gemv_relerr": 1e-3, "cute_mma_relerr": 1e-3}

    rows = [row(8, 200, 100, 120), row(128, 1800, 1200, 1300), row(256, 1700, 1400, 1200),
            row(1024, 1700, 2600, 1300), row(4096, 100, 500, 400)]
    assert gg.suggest_dispatch(rows) == [(1.0, 1, "cute_gemv"), (8.0, 1, "cute_mma")]
    bad = [{**rows[0], "cute_gemv_relerr": 0.5}]  # a wrong kernel is never suggested
    assert gg.suggest_dispatch(bad) == [(0.0625, 1, "cute_mma")]
    assert gg.suggest_dispatch(rows, min_gain=1.6) == [(0.0625, 1, "cute_gemv")]  # 1.5x at 1 row: torch


# ------------------------------------------------------------------------------------- CuTe DSL compile (CPU ok)


def _cutlass_importable() -> bool:
    r = subprocess.run([sys.executable, "-c", "import cutlass.cute"], capture_output=True, timeout=120)
    return r.returncode == 0


@pytest.mark.skipif(not _cutlass_importable(), reason="CuTe DSL not importable")
@pytest.mark.parametrize("fuse,rb,warps,K,depth,hint,tn", [(True, 1, 8, 512, 0, 0, 1), (False, 2, 8, 256, 0, 0, 1),
                                                         (False, 1, 4, 256, 0, 0, 1), (True, 1, 4, 512, 2, 1, 2),
                                                         (False, 2, 2, 256, 8, 2, 1)])
def test_kernel_compiles_with_expected_mma_count(tmp_path, fuse, rb, warps, K, depth, hint, tn):
    code = (f"from kernels import grouped_gemm_mma as gm; gm.compiled(8, {128 if fuse else 64}, {K}, {fuse}, "
            f"{rb}, {warps}, 0, {depth}, {hint}, {tn})")
    env = {**os.environ, "CUTE_DSL_ARCH": "sm_90a", "CUTE_DSL_KEEP_PTX": "1", "CUTE_DSL_DUMP_DIR": str(tmp_path),
           "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    ptx = [p for p in tmp_path.iterdir() if p.suffix == ".ptx"]
    assert len(ptx) == 1
    text = ptx[0].read_text()
    nb = 2 * rb if fuse else rb
    nch = K // warps // 32
    assert text.count("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32") == 2 * nb * tn * nch
    n_w_loads = 2 * nb * nch  # weight loads per pass: lo and hi rows per 16-row block per chunk
    assert text.count("ld.global.nc.L1::no_allocate.L2::256B.v4") == (n_w_loads if hint == 1 else 0)
    assert text.count("ld.global.nc.L1::no_allocate.v4") == (n_w_loads if hint == 2 else 0)
    assert "vote.sync.ballot" in text and "bar.sync" in text


# ------------------------------------------------------------------------------------- GPU


needs_gpu = pytest.mark.skipif(not torch.cuda.is_available() or gg.cute_unavailable() is not None,
                               reason="needs CUDA and CuTe DSL")


@needs_gpu
def test_gpu_mma_grouped_swiglu():  # pragma: no cover - GPU only
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    E, D, F = 16, 512, 512
    gu = (torch.randn(E, 2 * F, D, device=dev, generator=g) * 0.04).to(torch.bfloat16)
    dn = (torch.randn(E, D, F, device=dev, generator=g) * 0.04).to(torch.bfloat16)
    assert gg.mma_unsupported(torch.empty(1, D, dtype=torch.bfloat16, device=dev), gu, dn) is None
    for counts in ([1] * E, [0] * (E - 1) + [13], [3, 0, 9, 0] * 4, [8] * E, [0] * E):
        c = torch.tensor(counts, device=dev)
        x = torch.randn(sum(counts), D, device=dev, generator=g).to(torch.bfloat16)
        act = torch.full((x.shape[0], F), float("nan"), dtype=torch.bfloat16, device=dev)
        out = torch.full((x.shape[0], D), float("nan"), dtype=torch.bfloat16, device=dev)
        gg.grouped_swiglu_mma(x, gu, dn, c, act_out=act, out=out)
        if not sum(counts):
            continue
        want = gg.grouped_swiglu_reference(x, gu, dn, c)
        assert not torch.isnan(out).any()
        assert float((out.float() - want).norm() / want.norm()) < 2e-2
