"""Decode-shape grouped GEMM on the tensor cores (CuTe DSL, ``mma.sync m16n8k16`` bf16 -> fp32), persistent grid.

Same job and byte stream as kernels/grouped_gemm_cute.py (each active expert's weights read once per <= 8 rows),
but the arithmetic runs on the tensor cores with the *weights as the M = 16 side* and the *tokens as the N = 8
side* (swap-AB), so 8 rows cost one MMA instead of 8 FMA + convert per weight element (the GEMV's bottleneck at
>= 4 rows, docs/KERNELS.md, decode grouped SwiGLU).

Operands straight from global memory into the MMA fragments (no shared-memory staging): lane (g = lane/4,
t = lane%4) of a warp loads 16 bytes = 8 bf16 of weight rows g and g+8 and of token row g at physical K offset
``32*c + 8*t``. A dot product does not care which physical k goes to which logical k slot as long as A and B use
the same assignment, so those 8 elements feed two MMAs: elements 0-3 -> logical k {2t, 2t+1, 2t+8, 2t+9} of the
first, 4-7 of the second. A warp-load thus reads 8 rows x 64 contiguous bytes of weights (whole 32-byte sectors).
Token columns past the expert's rows read a clamped (valid) row; MMA columns are independent, so those columns
are computed and never stored.

Work decomposition: a *work item* is (active expert, tile of 16*rb output rows); for the fused gate_up the tile
holds gate rows n0.. and up rows n0+F.. so ``silu(g)*u`` is formed in the CTA. The CTA's ``warps`` warps split K
(split-K inside the CTA: item size 16*rb rows x K), and reduce their fp32 fragments through shared memory. The
grid is persistent (about ``ctas_per_sm`` CTAs per SM): each CTA first compacts the list of non-empty experts
(warp ballot over ``offs``, in shared memory), then loops ``item = blockIdx.x, += gridDim.x`` over
n_active * tiles, so empty experts cost nothing and few experts still spread over every SM (tiles x split-K).
An expert with more than 8 rows loops over token chunks of 8 inside the item (the second pass re-reads the tile
from L2).

Compile-time knobs (v3, swept by ``python -m rackbed.kernels.bench.moe --suite moe_gemm``; chosen by
``grouped_gemm.MMA_TUNED``): ``depth`` K chunks of loads issued ahead of the MMAs (register prefetch; 0 = chunk by
chunk as v2), ``hint`` weight-load flavour (0 plain, 1 ``ld.global.nc.L1::no_allocate.L2::256B``, 2
``ld.global.nc.L1::no_allocate``), ``tn`` token groups of 8 per weight pass (2: an expert with 9-16 rows streams its
tile once), ``min_blocks`` CTAs per SM for ptxas. The epilogue loops over the (row, token) results, so any rb and tn
fit any warp count.

    fuse=False  out[r, n] = sum_k x[r, k] * w[e(r), n, k]                     out [R, N]   (down projection)
    fuse=True   g = x.w[e, n], u = x.w[e, n + N/2]; out[r, n] = silu(g) * u   out [R, N/2] (gate_up + SwiGLU)

``w`` is ``[E, N, K]`` bf16 row-major (K contiguous), ``x`` ``[R, K]`` bf16 rows sorted by expert, ``offs`` int32
``[E+1]``. Requirements (checked by ``grouped_gemm.mma_tiling_unsupported``): K % (32 * warps) == 0, N_out % (16 * rb) == 0, shared
memory <= 48 KB, 16-byte aligned contiguous tensors, E <= 1024. Arguments are device addresses (plain integers) like the GEMV kernel.
"""

from __future__ import annotations

import functools

import cutlass
from cuda.bindings import driver as cuda
from cutlass import Float32, Int32, Int64, cute
from cutlass._mlir import ir

from rackbed.kernels.grouped_gemm import MMA_KC as KC
from rackbed.kernels.grouped_gemm import mma_config as config  # noqa: F401  (re-exported)
from rackbed.kernels.grouped_gemm import mma_items as n_items  # noqa: F401
from rackbed.kernels.grouped_gemm import mma_tiling_unsupported as unsupported
from rackbed.kernels.grouped_gemm_cute import _ld_i32, _st_bf16  # the GEMV kernel's scalar load / bf16 store

WARP = 32
TOK = 8  # tokens per MMA (the N side)

_MMA = ("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{{$w0}, {$w1}, {$w2}, {$w3}}, {{$r0}, {$r1}, {$r2}, {$r3}}, {{$r4}, {$r5}}, "
        "{{$r6}, {$r7}, {$r8}, {$r9}};")


@cute.jit
def _ld4(addr: Int64):
    """16 bytes at ``addr`` (16-byte aligned) -> TensorSSA of 4 Int32 (bf16 pairs, low half = lower address)."""
    ptr = cute.make_ptr(Int32, addr, cute.AddressSpace.gmem, assumed_align=16)
    v = cute.arch.load(ptr, ir.VectorType.get([4], Int32.mlir_type))
    return cute.TensorSSA(v, (4,), Int32)


@cute.jit
def _mma(a0: Int32, a1: Int32, a2: Int32, a3: Int32, b0: Int32, b1: Int32, acc):
    """D = A(16x16 bf16) B(16x8 bf16) + C, fp32; ``acc`` a list of 4 Float32 (c0..c3), returns the new list."""
    d = cute.arch.inline_ptx(_MMA, write_only_types=[Float32, Float32, Float32, Float32],
                             read_only_args=[a0, a1, a2, a3, b0, b1, acc[0], acc[1], acc[2], acc[3]])
    return [d[0], d[1], d[2], d[3]]


_LDW = "ld.global.nc.L1::no_allocate.L2::256B.v4.b32 {{$w0}, {$w1}, {$w2}, {$w3}}, [{$r0}];"
_LDW_NA = "ld.global.nc.L1::no_allocate.v4.b32 {{$w0}, {$w1}, {$w2}, {$w3}}, [{$r0}];"


@cute.jit
def _ldw(addr: Int64, hint: cutlass.Constexpr):
    """A weight load (16 bytes): hint 0 = plain ld.global, 1 = non-coherent, no L1 allocation, 256-byte L2
    prefetch, 2 = non-coherent, no L1 allocation. Indexable [0..3] either way."""
    if cutlass.const_expr(hint == 0):
        return _ld4(addr)
    if cutlass.const_expr(hint == 1):
        return cute.arch.inline_ptx(_LDW, write_only_types=[Int32, Int32, Int32, Int32], read_only_args=[addr])
    return cute.arch.inline_ptx(_LDW_NA, write_only_types=[Int32, Int32, Int32, Int32], read_only_args=[addr])


def _load_chunk(xrows, wrows, c, row_bytes, hint):
    """Plain-Python trace helper: the loads of K chunk ``c`` -> (x fragments per token group, (lo, hi) weight
    fragments per 16-row block). Runs at trace time inside the kernel (ordinary Python loops, nothing dynamic)."""
    bs = [_ld4(xr + c * KC * 2) for xr in xrows]
    ws = [(_ldw(wr + c * KC * 2, hint), _ldw(wr + 8 * row_bytes + c * KC * 2, hint)) for wr in wrows]
    return bs, ws


@cute.kernel
def _mma_kernel(x_addr: Int64, w_addr: Int64, offs_addr: Int64, out_addr: Int64, n_e: cutlass.Constexpr,
                n_w: cutlass.Constexpr, k: cutlass.Constexpr, fuse: cutlass.Constexpr, rb: cutlass.Constexpr,
                warps: cutlass.Constexpr, depth: cutlass.Constexpr, hint: cutlass.Constexpr,
                tn: cutlass.Constexpr):
    tid, _, _ = cute.arch.thread_idx()
    bid, _, _ = cute.arch.block_idx()
    nblk, _, _ = cute.arch.grid_dim()
    warp = tid // WARP
    lane = tid % WARP
    g = lane // 4
    t = lane % 4
    n_out = n_w // 2 if fuse else n_w
    rows_item = 16 * rb
    tiles = n_out // rows_item
    nb = 2 * rb if fuse else rb  # 16-row MMA blocks per item
    nv = 4 * nb * tn  # fp32 accumulators per lane (tn token groups of 8)
    kw = k // warps  # this warp's K slice
    nch = kw // KC  # 32-element K chunks per warp
    row_bytes = k * 2
    n_thr = warps * WARP
    n_res = rb * 4 * WARP * tn  # (row, token) results per pass, spread over the CTA's threads
    tpp = TOK * tn  # tokens per pass

    smem = cutlass.utils.SmemAllocator()
    act = smem.allocate_tensor(Int32, cute.make_layout(n_e + 1), byte_alignment=16)
    red = smem.allocate_tensor(Float32, cute.make_layout(warps * nv * WARP), byte_alignment=16)

    # 1. compact the non-empty experts into act[0..n_act) (warp 0, ballot + popc prefix); act[n_e] = n_act
    if warp == 0:
        base = Int32(0)
        below = (Int32(1) << lane) - Int32(1)
        for c in cutlass.range_constexpr((n_e + WARP - 1) // WARP):
            e = Int32(c * WARP) + lane
            ec = cutlass.min(e, Int32(n_e - 1))
            s = _ld_i32(offs_addr + Int64(ec) * 4)
            f = _ld_i32(offs_addr + Int64(ec) * 4 + 4)
            ok = (f > s) & (e < Int32(n_e))
            mask = cute.arch.vote_ballot_sync(ok)
            if ok:
                act[base + cute.arch.popc(mask & below)] = e
            base = base + cute.arch.popc(mask)
        if lane == 0:
            act[n_e] = base
    cute.arch.sync_threads()

    # 2. persistent loop over (active expert, tile)
    total = act[n_e] * tiles
    item = bid
    while item < total:
        e = act[item // tiles]
        tile = item - (item // tiles) * tiles
        start = _ld_i32(offs_addr + Int64(e) * 4)
        end = _ld_i32(offs_addr + Int64(e) * 4 + 4)
        n0 = tile * rows_item
        koff = Int64(warp * kw + t * 8) * 2
        wrows = []  # address of weight row (block row g) at this lane's K offset, per 16-row block
        for j in cutlass.range_constexpr(nb):
            r0 = n0 + 16 * j
            if cutlass.const_expr(fuse and j >= rb):
                r0 = n0 + n_out + 16 * (j - rb)
            wrows.append(w_addr + (Int64(e) * n_w + Int64(r0 + g)) * row_bytes + koff)
        tok0 = start
        while tok0 < end:
            xrows = []  # padded token columns read a valid (clamped) row, computed and never stored
            for tg in cutlass.range_constexpr(tn):
                xr = cutlass.min(tok0 + 8 * tg + g, end - 1)
                xrows.append(x_addr + Int64(xr) * row_bytes + koff)
            acc = []
            for v in cutlass.range_constexpr(tn * nb):
                acc.append([Float32(0.0), Float32(0.0), Float32(0.0), Float32(0.0)])
            # K loop, fully unrolled; with depth > 0 the loads of chunk c + depth are issued before chunk c's MMAs
            pend = []
            for c in cutlass.range_constexpr(min(depth, nch)):
                pend.append(_load_chunk(xrows, wrows, c, row_bytes, hint))
            for c in cutlass.range_constexpr(nch):
                if cutlass.const_expr(depth == 0):
                    bs, ws = _load_chunk(xrows, wrows, c, row_bytes, hint)
                else:
                    if cutlass.const_expr(c + depth < nch):
                        pend.append(_load_chunk(xrows, wrows, c + depth, row_bytes, hint))
                    bs, ws = pend.pop(0)
                for j in cutlass.range_constexpr(nb):
                    lo, hi = ws[j]
                    for tg in cutlass.range_constexpr(tn):
                        b = bs[tg]
                        v = tg * nb + j
                        acc[v] = _mma(lo[0], hi[0], lo[1], hi[1], b[0], b[1], acc[v])
                        acc[v] = _mma(lo[2], hi[2], lo[3], hi[3], b[2], b[3], acc[v])
            # split-K reduction over the warps through shared memory, then the epilogue
            for v in cutlass.range_constexpr(tn * nb):
                for q in cutlass.range_constexpr(4):
                    red[(warp * nv + v * 4 + q) * WARP + lane] = acc[v][q]
            cute.arch.sync_threads()
            for i in cutlass.range_constexpr((n_res + n_thr - 1) // n_thr):
                o = tid + i * n_thr  # o = ((tg * rb + jj) * 4 + q) * 32 + ln
                if o < n_res:
                    ln = o % WARP
                    q = (o // WARP) % 4
                    jj = (o // (4 * WARP)) % rb
                    tg = o // (4 * WARP * rb)
                    row = n0 + 16 * jj + ln // 4 + 8 * (q // 2)
                    tok = tok0 + 8 * tg + 2 * (ln % 4) + q % 2
                    vg = tg * nb + jj
                    y = Float32(0.0)
                    gsum = Float32(0.0)
                    for w in cutlass.range_constexpr(warps):
                        gsum = gsum + red[(w * nv + vg * 4 + q) * WARP + ln]
                    if cutlass.const_expr(fuse):
                        usum = Float32(0.0)
                        for w in cutlass.range_constexpr(warps):
                            usum = usum + red[(w * nv + (vg + rb) * 4 + q) * WARP + ln]
                        y = gsum / (Float32(1.0) + cute.arch.exp(-gsum)) * usum
                    else:
                        y = gsum
                    if tok < end:
                        _st_bf16(out_addr + (Int64(tok) * n_out + Int64(row)) * 2, y)
            cute.arch.sync_threads()
            tok0 = tok0 + tpp
        item = item + nblk


@cute.jit
def _mma_launch(x_addr: Int64, w_addr: Int64, offs_addr: Int64, out_addr: Int64, n_ctas: Int32,
                stream: cuda.CUstream, n_e: cutlass.Constexpr, n_w: cutlass.Constexpr, k: cutlass.Constexpr,
                fuse: cutlass.Constexpr, rb: cutlass.Constexpr, warps: cutlass.Constexpr,
                min_blocks: cutlass.Constexpr, depth: cutlass.Constexpr, hint: cutlass.Constexpr,
                tn: cutlass.Constexpr):
    _mma_kernel(x_addr, w_addr, offs_addr, out_addr, n_e, n_w, k, fuse, rb, warps, depth, hint, tn).launch(
        grid=[n_ctas, 1, 1], block=[warps * WARP, 1, 1], stream=stream, min_blocks_per_mp=min_blocks)


@functools.lru_cache(maxsize=128)
def compiled(n_e: int, n_w: int, k: int, fuse: bool, rb: int, warps: int, min_blocks: int = 0, depth: int = 0,
             hint: int = 0, tn: int = 1):
    """Compile once per shape and tiling; returns ``f(x_addr, w_addr, offs_addr, out_addr, n_ctas, stream)``.
    ``min_blocks`` > 0 asks ptxas to fit that many CTAs per SM (needs a device to query shared memory); ``depth``
    K chunks of loads issued ahead of the MMAs (0: load and use chunk by chunk, the v2 order); ``hint`` the weight
    load flavour (see :func:`_ldw`); ``tn`` token groups of 8 per weight pass (2: experts with 9-16 rows read their
    weights once)."""
    why = unsupported(n_e, n_w, k, fuse, rb, warps, tn)
    if why:
        raise ValueError(f"grouped_gemm_mma: {why}")
    return cute.compile(_mma_launch, Int64(0), Int64(0), Int64(0), Int64(0), Int32(1), cuda.CUstream(0),
                        n_e, n_w, k, fuse, rb, warps, min_blocks, depth, hint, tn)
