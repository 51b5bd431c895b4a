"""Decode-shape grouped GEMM in CuTe DSL: a weight-streaming "grouped GEMV" for few rows per expert.

For decode MoE every active expert sees 1..8 rows (tokens); the GEMM is then a matrix-vector product whose cost
is reading the expert's weights once from HBM. This kernel streams each active expert's weight rows exactly once
per group of up to 8 input rows, with 16-byte coalesced loads (a warp reads 512 contiguous bytes of a weight row
per load), fp32 accumulation on the CUDA cores and a warp-shuffle reduction. Tensor cores are not needed: at <= 8
rows the arithmetic (2 FLOP per weight byte per row) is far below what the FMA units sustain at HBM speed.

Two kernels (same body, ``fuse`` selects the epilogue), ``w`` is ``[E, N, K]`` row-major bf16 (K contiguous),
``x`` is ``[R, K]`` bf16 rows sorted by expert, ``offs`` is int32 ``[E+1]`` (offs[e]..offs[e+1] = rows of e):
    fuse=False  out[r, n] = sum_k x[r, k] * w[e(r), n, k]                     out [R, N]   (down projection)
    fuse=True   g = x·w[e, n], u = x·w[e, n + N/2]; out[r, n] = silu(g) * u   out [R, N/2] (gate_up + SwiGLU)
Grid: (ceil(N_out / (warps * rows_per_warp)), E). A block whose expert has no rows returns at once. Inside a
block, the expert's rows are processed in chunks of 8 (then 4, 2, 1 for the tail: compiled variants, so one row
costs one row's FMAs); each chunk re-streams the block's weight tile (from L2 when it is still there), so the
kernel is meant for <= 8 rows per expert (see grouped_gemm.use_decode_kernel).

Requirements (checked by grouped_gemm.py): K % 256 == 0, N_out % (warps * rows_per_warp) == 0, bf16, contiguous,
16-byte aligned base addresses. Arguments are plain integers (device addresses), like kernels/allreduce_cute.py.
"""

from __future__ import annotations

import functools

import cutlass
import cutlass.cute as cute
from cuda.bindings import driver as cuda
from cutlass import Float32, Int32, Int64
from cutlass._mlir import ir
from cutlass._mlir.dialects import llvm

VEC = 8  # bf16 elements per 16-byte load
WARP = 32


@cute.jit
def _ld8(addr: Int64):
    """8 bf16 at ``addr`` (16-byte aligned) -> TensorSSA of 8 fp32."""
    ptr = cute.make_ptr(cutlass.BFloat16, addr, cute.AddressSpace.gmem, assumed_align=16)
    v = cute.arch.load(ptr, ir.VectorType.get([VEC], cutlass.BFloat16.mlir_type))
    return cute.TensorSSA(v, (VEC,), cutlass.BFloat16).to(Float32)


@cute.jit
def _ld_i32(addr: Int64) -> Int32:
    return cute.arch.load(cute.make_ptr(Int32, addr, cute.AddressSpace.gmem, assumed_align=4), Int32)


@cute.jit
def _st_bf16(addr: Int64, v: Float32):
    bits = cutlass.Int16(llvm.bitcast(cutlass.Int16.mlir_type, v.to(cutlass.BFloat16).ir_value()))
    cute.arch.store(cute.make_ptr(cutlass.Int16, addr, cute.AddressSpace.gmem, assumed_align=2), bits)


@cute.jit
def _chunk(x_addr: Int64, wrow_addrs, out_addr: Int64, row0: Int32, n_out_col: Int32, n_out: Int32,
           lane: Int32, mt: cutlass.Constexpr, nw: cutlass.Constexpr, k: cutlass.Constexpr,
           fuse: cutlass.Constexpr, rw: cutlass.Constexpr):
    """``mt`` rows starting at row0 against the ``nw`` weight rows at ``wrow_addrs``; writes rw outputs per row."""
    acc = []
    for i in cutlass.range_constexpr(mt * nw):
        acc.append(Float32(0.0))
    for it in cutlass.range_constexpr(k // (VEC * WARP)):
        koff = Int64((it * WARP) * VEC * 2) + Int64(lane) * (VEC * 2)
        ws = []
        for j in cutlass.range_constexpr(nw):
            ws.append(_ld8(wrow_addrs[j] + koff))
        for m in cutlass.range_constexpr(mt):
            xv = _ld8(x_addr + Int64(row0 + m) * (k * 2) + koff)
            for j in cutlass.range_constexpr(nw):
                a = acc[m * nw + j]
                for q in cutlass.range_constexpr(VEC):
                    a = a + ws[j][q] * xv[q]
                acc[m * nw + j] = a
    for i in cutlass.range_constexpr(mt * nw):
        acc[i] = cute.arch.warp_reduction(acc[i], lambda p, q: p + q)
    if lane == 0:
        for m in cutlass.range_constexpr(mt):
            for r in cutlass.range_constexpr(rw):
                if cutlass.const_expr(fuse):
                    g = acc[m * nw + r]
                    u = acc[m * nw + rw + r]
                    y = g / (Float32(1.0) + cute.arch.exp(-g)) * u
                else:
                    y = acc[m * nw + r]
                _st_bf16(out_addr + (Int64(row0 + m) * Int64(n_out) + Int64(n_out_col + r)) * 2, y)


@cute.kernel
def _gemv_kernel(x_addr: Int64, w_addr: Int64, offs_addr: Int64, out_addr: Int64, n_w: Int32,
                 k: cutlass.Constexpr, fuse: cutlass.Constexpr, rw: cutlass.Constexpr, warps: cutlass.Constexpr):
    tid, _, _ = cute.arch.thread_idx()
    tile, e, _ = cute.arch.block_idx()
    warp = tid // WARP
    lane = tid % WARP
    start = _ld_i32(offs_addr + Int64(e) * 4)
    end = _ld_i32(offs_addr + Int64(e) * 4 + 4)
    if end > start:
        n_out = n_w
        if cutlass.const_expr(fuse):
            n_out = n_w // 2
        col = (tile * warps + warp) * rw  # first output column of this warp
        wbase = w_addr + Int64(e) * Int64(n_w) * (k * 2)
        rows = []
        for r in cutlass.range_constexpr(rw):
            rows.append(wbase + Int64(col + r) * (k * 2))
        if cutlass.const_expr(fuse):
            for r in cutlass.range_constexpr(rw):
                rows.append(wbase + Int64(col + r + n_out) * (k * 2))
        nw = 2 * rw if fuse else rw
        row = start
        while row < end:
            left = end - row
            if left >= 8:
                _chunk(x_addr, rows, out_addr, row, col, n_out, lane, 8, nw, k, fuse, rw)
                row = row + 8
            elif left >= 4:
                _chunk(x_addr, rows, out_addr, row, col, n_out, lane, 4, nw, k, fuse, rw)
                row = row + 4
            elif left >= 2:
                _chunk(x_addr, rows, out_addr, row, col, n_out, lane, 2, nw, k, fuse, rw)
                row = row + 2
            else:
                _chunk(x_addr, rows, out_addr, row, col, n_out, lane, 1, nw, k, fuse, rw)
                row = row + 1


@cute.jit
def _gemv_launch(x_addr: Int64, w_addr: Int64, offs_addr: Int64, out_addr: Int64, n_w: Int32, n_tiles: Int32,
                 n_experts: Int32, stream: cuda.CUstream, k: cutlass.Constexpr, fuse: cutlass.Constexpr,
                 rw: cutlass.Constexpr, warps: cutlass.Constexpr):
    _gemv_kernel(x_addr, w_addr, offs_addr, out_addr, n_w, k, fuse, rw, warps).launch(
        grid=[n_tiles, n_experts, 1], block=[warps * WARP, 1, 1], stream=stream)


@functools.lru_cache(maxsize=32)
def compiled(k: int, fuse: bool, rw: int, warps: int):
    """Compile once per (K, fuse, rows per warp, warps per block); returns
    ``f(x_addr, w_addr, offs_addr, out_addr, n_w, n_tiles, n_experts, stream)``."""
    return cute.compile(_gemv_launch, Int64(0), Int64(0), Int64(0), Int64(0), Int32(1), Int32(1), Int32(1),
                        cuda.CUstream(0), k, fuse, rw, warps)
