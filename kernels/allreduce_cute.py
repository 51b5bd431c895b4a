"""The all-reduce kernels in CuTe DSL: one-shot and two-shot over peer-mapped buffers.

Written with CuTe DSL's `cute.arch` layer (raw global-memory pointers built from integer addresses with
``cute.make_ptr``, 16-byte vector loads/stores with ``cute.arch.load``/``store``, system-scope release/acquire
flags, ``%globaltimer`` for a spin timeout). Nothing here needs CUDA C: the CuTe DSL 4.8 API has every primitive
(``fence_acq_rel_sys``, ``load(sem="acquire", scope="sys")``, ``store(sem="release", scope="sys")``).

Shapes and units (V = elements per vector, 16 bytes / element size, or 1 for unaligned sizes):
    n_vec   number of V-element vectors in the tensor (the tensor has n_vec * V elements)
    cv      vectors per rank-chunk in two-shot, ceil(n_vec / N)
    block b handles the vector range ``block_range(count, b, nblk)`` of every region (allreduce_schedule.py)

The byte layout of each rank's peer allocation, the epochs and the flag protocol are defined (and emulated on
the CPU) in ``kernels/allreduce_schedule.py``; this file only turns that schedule into device code.

Arguments of the launched function (all runtime values are plain integers, so one call costs few conversions):
    in_addr, out_addr   device addresses of the caller's input / output (16-byte aligned when V > 1)
    table_addr          device address of the peer table: int64[N] peer bases (global rank order), then rank
    n_vec               int32, see above
"""

from __future__ import annotations

import ctypes
import functools
import os
import tempfile

# the cubin is kept (KeepCUBIN) to launch it through the driver; keep the dumped files out of the working dir
os.environ.setdefault("CUTE_DSL_DUMP_DIR", os.path.join(tempfile.gettempdir(), f"rackbed-cute-{os.getpid()}"))
os.makedirs(os.environ["CUTE_DSL_DUMP_DIR"], exist_ok=True)

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
from cuda.bindings import driver as cuda  # noqa: E402
from cutlass import Int32, Int64  # noqa: E402
from cutlass._mlir import ir  # noqa: E402
from cutlass._mlir.dialects import arith  # noqa: E402

from rackbed.kernels.allreduce_schedule import Layout  # noqa: E402

_SPIN_TIMEOUT_NS = 5_000_000_000  # a peer that does not answer within 5 s is reported, not waited for forever


def _dtype(name: str):
    return {"bf16": cutlass.BFloat16, "fp32": cutlass.Float32}[name]


@cute.jit
def _ld_i64(addr: Int64) -> Int64:
    return cute.arch.load(cute.make_ptr(Int64, addr, cute.AddressSpace.gmem, assumed_align=8), Int64)


@cute.jit
def _vload(addr: Int64, dtype: cutlass.Constexpr, vec: cutlass.Constexpr, cop: cutlass.Constexpr):
    """Load ``vec`` elements (16 bytes when vec*width == 128) from ``addr`` and widen them to fp32."""
    ptr = cute.make_ptr(dtype, addr, cute.AddressSpace.gmem, assumed_align=vec * dtype.width // 8)
    if cutlass.const_expr(vec == 1):  # scalar: load the bits as an integer (ld.ext has no bf16 scalar form)
        ity = cutlass.Uint16 if cutlass.const_expr(dtype.width == 16) else cutlass.Uint32
        iptr = cute.make_ptr(ity, addr, cute.AddressSpace.gmem, assumed_align=dtype.width // 8)
        bits = cute.arch.load(iptr, ity, cop=cop)
        return dtype(arith.bitcast(dtype.mlir_type, bits.ir_value()))
    v = cute.arch.load(ptr, ir.VectorType.get([vec], dtype.mlir_type), cop=cop)
    return cute.TensorSSA(v, (vec,), dtype)


@cute.jit
def _to(x, dtype: cutlass.Constexpr, vec: cutlass.Constexpr):
    """Convert a loaded value (TensorSSA, or a scalar when vec == 1) to ``dtype``."""
    if cutlass.const_expr(vec == 1):
        return dtype(x)
    return x.to(dtype)


@cute.jit
def _vstore(addr: Int64, x, dtype: cutlass.Constexpr, vec: cutlass.Constexpr):
    ptr = cute.make_ptr(dtype, addr, cute.AddressSpace.gmem, assumed_align=vec * dtype.width // 8)
    if cutlass.const_expr(vec == 1):
        ity = cutlass.Uint16 if cutlass.const_expr(dtype.width == 16) else cutlass.Uint32
        iptr = cute.make_ptr(ity, addr, cute.AddressSpace.gmem, assumed_align=dtype.width // 8)
        cute.arch.store(iptr, ity(arith.bitcast(ity.mlir_type, dtype(x).ir_value())))
    else:
        cute.arch.store(ptr, x.ir_value())


@cute.jit
def _signal(base: Int64, flag_off: Int64, value: Int32):
    """Release-store ``value`` to the flag at ``base + flag_off`` (system scope: the reader is another GPU)."""
    ptr = cute.make_ptr(Int32, base + flag_off, cute.AddressSpace.gmem, assumed_align=4)
    cute.arch.store(ptr, value, sem="release", scope="sys")


@cute.jit
def _wait(base: Int64, flag_off: Int64, epoch: Int32, err_off: Int64):
    """Spin (acquire, system scope) until the flag reaches ``epoch``; on timeout set the error word and go on."""
    ptr = cute.make_ptr(Int32, base + flag_off, cute.AddressSpace.gmem, assumed_align=4)
    t0 = cute.arch.globaltimer()
    state = Int32(0)
    while state == 0:
        f = cute.arch.load(ptr, Int32, sem="acquire", scope="sys")
        if f - epoch >= 0:
            state = Int32(1)
        elif cute.arch.globaltimer() - t0 > _SPIN_TIMEOUT_NS:
            state = Int32(2)
    if state == 2:
        eptr = cute.make_ptr(Int32, base + err_off, cute.AddressSpace.gmem, assumed_align=4)
        cute.arch.store(eptr, Int32(1))


@cute.jit
def _block_range(count: Int32, bid: Int32, nblk: Int32):
    """Contiguous share of ``count`` items for block ``bid`` of ``nblk`` (same rule as allreduce_schedule)."""
    per = (count + nblk - 1) // nblk
    lo = bid * per
    hi = lo + per
    if hi > count:
        hi = count
    if lo > count:
        lo = count
    return lo, hi


@cute.kernel
def _allreduce_kernel(
    in_addr: Int64,
    out_addr: Int64,
    table_addr: Int64,
    n_vec: Int32,
    algo: cutlass.Constexpr,
    dtype: cutlass.Constexpr,
    vec: cutlass.Constexpr,
    n_ranks: cutlass.Constexpr,
    lay: cutlass.Constexpr,
):
    tid, _, _ = cute.arch.thread_idx()
    bid, _, _ = cute.arch.block_idx()
    nthr, _, _ = cute.arch.block_dim()
    nblk, _, _ = cute.arch.grid_dim()
    vb = vec * dtype.width // 8  # bytes per vector

    bases = []
    for j in cutlass.range_constexpr(n_ranks):
        bases.append(_ld_i64(table_addr + 8 * j))
    rank = Int32(_ld_i64(table_addr + 8 * n_ranks))
    me = _ld_i64(table_addr + 8 * (n_ranks + 1))

    # epoch: per-block counters that every call advances together (block 0 bumps the blocks not launched)
    cptr = cute.make_ptr(Int32, me + lay.counters_off + 4 * bid, cute.AddressSpace.gmem, assumed_align=4)
    epoch = cute.arch.load(cptr, Int32, cop="cg") + 1
    if bid == 0:
        for b in range(nblk + tid, lay.max_blocks, nthr):
            p = cute.make_ptr(Int32, me + lay.counters_off + 4 * b, cute.AddressSpace.gmem, assumed_align=4)
            cute.arch.store(p, cute.arch.load(p, Int32, cop="cg") + 1)

    if cutlass.const_expr(algo == "one_shot"):
        par = Int64(epoch & 1)
        lo, hi = _block_range(n_vec, bid, nblk)
        # push my input to slot[rank] of every other rank (parity half `par`)
        for v in range(lo + tid, hi, nthr):
            x = _vload(in_addr + Int64(v) * vb, dtype, vec, None)
            for j in cutlass.range_constexpr(n_ranks):
                if j != rank:
                    dst = bases[j] + lay.os_off + (par * n_ranks + Int64(rank)) * lay.os_slot_bytes + Int64(v) * vb
                    _vstore(dst, x, dtype, vec)
        cute.arch.sync_threads()
        if tid == 0:
            cute.arch.fence_acq_rel_sys()
            for j in cutlass.range_constexpr(n_ranks):
                if j != rank:
                    _signal(bases[j], lay.flag_off(0, bid, rank), epoch)
            for j in cutlass.range_constexpr(n_ranks):
                if j != rank:
                    _wait(me, lay.flag_off(0, bid, j), epoch, lay.err_off)
        cute.arch.sync_threads()
        # reduce in global rank order (bitwise-identical results on every rank); my own term from my input
        for v in range(lo + tid, hi, nthr):
            own = in_addr + Int64(v) * vb
            acc = _to(_vload(Int64(cutlass.select_(rank == 0, own, me + lay.os_off + (par * n_ranks) *
                                                   lay.os_slot_bytes + Int64(v) * vb)), dtype, vec, "cg"),
                      cutlass.Float32, vec)
            for j in cutlass.range_constexpr(1, n_ranks):
                slot = me + lay.os_off + (par * n_ranks + j) * lay.os_slot_bytes + Int64(v) * vb
                src = Int64(cutlass.select_(rank == j, own, slot))
                acc = acc + _to(_vload(src, dtype, vec, "cg"), cutlass.Float32, vec)
            _vstore(out_addr + Int64(v) * vb, _to(acc, dtype, vec), dtype, vec)
    else:
        # algo "two_shot" (phase 2 by push into the peers' gather regions) or "two_shot_pull" (phase 2 by
        # loading the owners' gather regions over NVLink)
        cv = (n_vec + n_ranks - 1) // n_ranks
        # phase 1 (reduce-scatter by push): my part of chunk c -> rs slot[rank] of rank c (c != rank)
        for c in cutlass.range_constexpr(n_ranks):
            if c != rank:
                clen = n_vec - c * cv
                if clen > cv:
                    clen = cv
                if clen < 0:
                    clen = 0
                lo, hi = _block_range(clen, bid, nblk)
                for v in range(lo + tid, hi, nthr):
                    x = _vload(in_addr + (Int64(c) * Int64(cv) + Int64(v)) * vb, dtype, vec, None)
                    _vstore(bases[c] + lay.rs_off + Int64(rank) * lay.rs_slot_bytes + Int64(v) * vb, x, dtype, vec)
        cute.arch.sync_threads()
        if tid == 0:
            cute.arch.fence_acq_rel_sys()
            for j in cutlass.range_constexpr(n_ranks):
                if j != rank:
                    _signal(bases[j], lay.flag_off(0, bid, rank), epoch)
            for j in cutlass.range_constexpr(n_ranks):
                if j != rank:
                    _wait(me, lay.flag_off(0, bid, j), epoch, lay.err_off)
        cute.arch.sync_threads()
        # reduce my chunk (global rank order, my own term straight from my input); write it to my output and
        # to the gather regions (the peers' for push, my own for pull)
        mlen = n_vec - rank * cv
        if mlen > cv:
            mlen = cv
        if mlen < 0:
            mlen = 0
        lo, hi = _block_range(mlen, bid, nblk)
        for v in range(lo + tid, hi, nthr):
            gv = Int64(rank) * Int64(cv) + Int64(v)
            own = in_addr + gv * vb
            acc = _to(_vload(Int64(cutlass.select_(rank == 0, own, me + lay.rs_off + Int64(v) * vb)), dtype, vec,
                             "cg"), cutlass.Float32, vec)
            for j in cutlass.range_constexpr(1, n_ranks):
                src = Int64(cutlass.select_(rank == j, own, me + lay.rs_off + j * lay.rs_slot_bytes + Int64(v) * vb))
                acc = acc + _to(_vload(src, dtype, vec, "cg"), cutlass.Float32, vec)
            y = _to(acc, dtype, vec)
            _vstore(out_addr + gv * vb, y, dtype, vec)
            if cutlass.const_expr(algo == "two_shot_pull"):
                _vstore(me + lay.ag_off + gv * vb, y, dtype, vec)
            else:
                for j in cutlass.range_constexpr(n_ranks):
                    if j != rank:
                        _vstore(bases[j] + lay.ag_off + gv * vb, y, dtype, vec)
        cute.arch.sync_threads()
        if tid == 0:
            cute.arch.fence_acq_rel_sys()
            for j in cutlass.range_constexpr(n_ranks):
                if j != rank:
                    _signal(bases[j], lay.flag_off(1, bid, rank), epoch)
            for j in cutlass.range_constexpr(n_ranks):
                if j != rank:
                    _wait(me, lay.flag_off(1, bid, j), epoch, lay.err_off)
        cute.arch.sync_threads()
        # phase 2: the other ranks' reduced chunks -> my output
        for c in cutlass.range_constexpr(n_ranks):
            if c != rank:
                clen = n_vec - c * cv
                if clen > cv:
                    clen = cv
                if clen < 0:
                    clen = 0
                lo, hi = _block_range(clen, bid, nblk)
                src_base = me + lay.ag_off
                if cutlass.const_expr(algo == "two_shot_pull"):
                    src_base = bases[c] + lay.ag_off
                for v in range(lo + tid, hi, nthr):
                    gv = Int64(c) * Int64(cv) + Int64(v)
                    _vstore(out_addr + gv * vb, _vload(src_base + gv * vb, dtype, vec, "cg"), dtype, vec)
    if tid == 0:
        cute.arch.store(cptr, epoch)


@cute.jit
def _allreduce_launch(
    in_addr: Int64,
    out_addr: Int64,
    table_addr: Int64,
    n_vec: Int32,
    grid: Int32,
    stream: cuda.CUstream,
    algo: cutlass.Constexpr,
    dtype: cutlass.Constexpr,
    vec: cutlass.Constexpr,
    n_ranks: cutlass.Constexpr,
    threads: cutlass.Constexpr,
    lay: cutlass.Constexpr,
):
    _allreduce_kernel(in_addr, out_addr, table_addr, n_vec, algo, dtype, vec, n_ranks, lay).launch(
        grid=[grid, 1, 1], block=[threads, 1, 1], stream=stream
    )


class Launcher:
    """Launch a compiled all-reduce kernel with one ``cuLaunchKernel`` (cuda.bindings.driver).

    CuTe DSL's own call path converts every argument in Python (~44-65 µs per call measured on the H200 host, see
    docs/KERNELS.md), which would dominate small all-reduces without CUDA graphs. This loads the cubin that
    CuTe DSL produced (``KeepCUBIN``) as a module and keeps the four kernel parameters (int64 in, out, table;
    int32 n_vec) in a preallocated ctypes block, so a call only stores three integers and launches.
    ``jit`` is the CuTe DSL callable, kept as the reference path (``use_jit=True``).
    """

    def __init__(self, jit, threads: int):
        self.jit, self.threads = jit, threads
        cubin = jit.__cubin__
        if isinstance(cubin, str):  # with a dump directory set, CuTe DSL returns the file's path
            with open(cubin if os.path.isabs(cubin) else os.path.join(os.environ["CUTE_DSL_DUMP_DIR"], cubin),
                      "rb") as f:
                cubin = f.read()
        if not cubin:
            raise RuntimeError("CuTe DSL produced no cubin (KeepCUBIN)")
        err, self.module = cuda.cuModuleLoadData(cubin)
        if err != cuda.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuModuleLoadData failed: {err}")
        err, count = cuda.cuModuleGetFunctionCount(self.module)
        err2, funcs = cuda.cuModuleEnumerateFunctions(count, self.module)
        if err != cuda.CUresult.CUDA_SUCCESS or err2 != cuda.CUresult.CUDA_SUCCESS or count != 1:
            raise RuntimeError(f"expected one kernel in the cubin, found {count} ({err}, {err2})")
        self.func = funcs[0]
        self._addrs = (ctypes.c_uint64 * 3)()
        self._n = ctypes.c_int32()
        self._ptrs = (ctypes.c_void_p * 4)(ctypes.addressof(self._addrs), ctypes.addressof(self._addrs) + 8,
                                           ctypes.addressof(self._addrs) + 16, ctypes.addressof(self._n))
        self._params = ctypes.addressof(self._ptrs)

    def __call__(self, in_addr: int, out_addr: int, table_addr: int, n_vec: int, grid: int, stream: int,
                 use_jit: bool = False) -> None:
        if use_jit:
            self.jit(in_addr, out_addr, table_addr, n_vec, grid, cuda.CUstream(stream))
            return
        a = self._addrs
        a[0], a[1], a[2] = in_addr, out_addr, table_addr
        self._n.value = n_vec
        (err,) = cuda.cuLaunchKernel(self.func, grid, 1, 1, self.threads, 1, 1, 0, stream, self._params, 0)
        if err != cuda.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuLaunchKernel failed: {err}")


@functools.lru_cache(maxsize=64)
def compiled(algo: str, dtype: str, vec: int, n_ranks: int, threads: int, lay: Layout) -> Launcher:
    """Compile (once per configuration, in the current CUDA context) and return its ``Launcher``."""
    fn = cute.compile[cute.KeepCUBIN](
        _allreduce_launch,
        Int64(0),
        Int64(0),
        Int64(0),
        Int32(1),
        Int32(1),
        cuda.CUstream(0),
        algo,
        _dtype(dtype),
        vec,
        n_ranks,
        threads,
        lay,
    )
    return Launcher(fn, threads)
