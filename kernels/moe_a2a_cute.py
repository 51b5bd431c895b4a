"""CuTe DSL kernels of the decode DP-EP dispatch/combine (kernels/moe_a2a.py) over peer-mapped buffers.

Four kernels, each one launch, grid = ``max_tokens`` blocks (fixed, so the arrival counters below count blocks):
    dispatch_send   block t: token t's destinations (ranks owning one of its top-k experts, deduplicated), its row in
                    each destination's slot (= tokens before t going there), copies the payload row, the k expert
                    ids and weights into ``dst.X/I/W[par][me][row]``; block 0 writes ``dst.count[par][me]``; every
                    block then signals every destination (atomic add, release, system scope).
    dispatch_recv   waits until every source's ``max_tokens`` blocks arrived, copies slot rows out to the caller's
                    tensors (rows past a slot's count get ids -1 and weight 0), writes the counts.
    combine_send    block b: row b of each source slot -> ``src.Y[par][me][b]`` (if b < count), then signals.
    combine_recv    block t: waits, then out[t] = sum over destinations j (ascending) of Y[par][j][row_of[t][j]].
The byte layout (offsets, parity double buffering, per-block epoch counters) is ``kernels.moe_a2a.A2aLayout``;
the CPU emulation ``kernels.moe_a2a.emulate`` runs the same index arithmetic for the tests.
Arguments are device addresses (plain integers) like kernels/allreduce_cute.py; ``lay`` is a Constexpr.

Protocol invariants (compare kernels/allreduce_schedule.py, the same epoch/flag scheme):
  * No kernel waits for anything on its own GPU: the sends never wait, the receives wait only for the peers' sends
    of the same call. Launch order between ranks, grid size and co-residency therefore cannot deadlock.
  * Every send block signals every destination, also blocks past n_tok and destinations that get zero rows, so
    the arrival target (epoch * max_tokens per source) never depends on routing.
  * Epochs live in device memory (advanced by each block), so graph replays advance them; nothing is reset.
  * The parity of a call is the parity of the *dispatch* epoch; both combine kernels take it from the dispatch
    kernels' counters (combine_send from dispatch_recv's, combine_recv from dispatch_send's), so extra
    dispatch-only calls (benchmarks) cannot make combine read the other half's counts.
  * Publishing: all threads write, ``bar.sync``, then thread 0 does ``fence.acq_rel.sys`` and the release atomics
    (the allreduce pattern). Waiting: thread 0 spins with ``ld.acquire.sys``, then ``bar.sync``, then the block
    reads the data with ``ld.global.cg``.
  * Bounded waits: a spin gives up after ``timeout_ns`` (globaltimer) and writes the error word of its own rank
    *and of every peer*; every spin also polls its own error word, so after one failure all later waits on all
    ranks return at once (no minutes of 5 s timeouts). ``PeerMoeAllToAll.check_error`` reads the word.
"""

from __future__ import annotations

import ctypes
import functools
import os
import re
import tempfile

# the cubin/PTX are kept to launch through the driver; keep the dumped files out of the working dir
os.environ.setdefault("CUTE_DSL_DUMP_DIR", os.path.join(tempfile.gettempdir(), f"rackbed-cute-{os.getpid()}"))
os.makedirs(os.environ["CUTE_DSL_DUMP_DIR"], exist_ok=True)

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
from cuda.bindings import driver as cuda  # noqa: E402
from cutlass import Float32, Int32, Int64  # noqa: E402
from cutlass._mlir import ir  # noqa: E402

SPIN_TIMEOUT_NS = 5_000_000_000  # default: a peer that does not answer within 5 s is reported, not waited for


def _p(dtype, addr, align):
    return cute.make_ptr(dtype, addr, cute.AddressSpace.gmem, assumed_align=align)


@cute.jit
def _ld_i64(addr: Int64) -> Int64:
    return cute.arch.load(_p(Int64, addr, 8), Int64)


@cute.jit
def _ld_i32(addr: Int64, cop: cutlass.Constexpr) -> Int32:
    return cute.arch.load(_p(Int32, addr, 4), Int32, cop=cop)


@cute.jit
def _copy_row(dst: Int64, src: Int64, n16: Int32, tid: Int32, nthr: Int32, cop: cutlass.Constexpr):
    """Copy n16 16-byte vectors (as 4 x i32) from src to dst, spread over the block's threads."""
    vt = ir.VectorType.get([4], Int32.mlir_type)
    for v in range(tid, n16, nthr):
        x = cute.arch.load(_p(Int32, src + Int64(v) * 16, 16), vt, cop=cop)
        cute.arch.store(_p(Int32, dst + Int64(v) * 16, 16), x)


@cute.jit
def _epoch(addr: Int64) -> Int32:
    return cute.arch.load(_p(Int32, addr, 4), Int32, cop="cg") + 1


@cute.jit
def _wait_ge(addr: Int64, target: Int32, me: Int64, bases, n: cutlass.Constexpr, lay: cutlass.Constexpr,
             timeout_ns: cutlass.Constexpr):
    """Spin (acquire, sys) until the counter at addr reaches target (wrap-safe). Gives up when this rank's error
    word is set (an earlier failure, here or reported by a peer) or after timeout_ns; on a timeout it sets the
    error word of this rank and of every peer, so every later wait everywhere returns at once."""
    t0 = cute.arch.globaltimer()
    state = Int32(0)
    while state == 0:
        f = cute.arch.load(_p(Int32, addr, 4), Int32, sem="acquire", scope="sys")
        if f - target >= 0:
            state = Int32(1)
        elif cute.arch.load(_p(Int32, me + lay.err_off, 4), Int32, sem="relaxed", scope="sys") != 0:
            state = Int32(3)
        elif cute.arch.globaltimer() - t0 > timeout_ns:
            state = Int32(2)
    if state == 2:
        for j in cutlass.range_constexpr(n):
            cute.arch.store(_p(Int32, bases[j] + lay.err_off, 4), Int32(1), sem="relaxed", scope="sys")


@cute.jit
def _bases(table: Int64, n: cutlass.Constexpr):
    b = []
    for j in cutlass.range_constexpr(n):
        b.append(_ld_i64(table + 8 * j))
    return b


@cute.kernel
def _dispatch_send(x_addr: Int64, ids_addr: Int64, w_addr: Int64, table: Int64, n_tok: Int32,
                   n: cutlass.Constexpr, lay: cutlass.Constexpr):
    tid, _, _ = cute.arch.thread_idx()
    t, _, _ = cute.arch.block_idx()
    nthr, _, _ = cute.arch.block_dim()
    lane = tid % 32
    bases = _bases(table, n)
    rank = Int32(_ld_i64(table + 8 * n))
    me = _ld_i64(table + 8 * (n + 1))
    ep_addr = me + lay.ep_off(0, t)
    epoch = _epoch(ep_addr)
    par = epoch & 1
    k = lay.top_k
    per = lay.experts_per_rank
    if t < n_tok:
        # every warp computes, for each destination j, how many tokens before t go there and whether t does
        # (fully unrolled over max_tokens / 32 lanes-steps; branch-free so the per-j sums stay in registers)
        before = []
        total = []
        for j in cutlass.range_constexpr(n):
            before.append(Int32(0))
            total.append(Int32(0))
        for it in cutlass.range_constexpr(lay.max_tokens // 32):
            s = Int32(it * 32) + lane
            sc = Int32(cutlass.select_(s < n_tok, s, Int32(0)))
            for j in cutlass.range_constexpr(n):
                hit = Int32(0)
                for q in cutlass.range_constexpr(k):
                    e = _ld_i32(ids_addr + (Int64(sc) * k + q) * 4, None)
                    hit = Int32(cutlass.select_(e // per == j, Int32(1), hit))
                hit = Int32(cutlass.select_(s < n_tok, hit, Int32(0)))
                total[j] = total[j] + hit
                before[j] = before[j] + Int32(cutlass.select_(s < t, hit, Int32(0)))
        for j in cutlass.range_constexpr(n):
            before[j] = cute.arch.warp_reduction(before[j], lambda a, b: a + b)
            total[j] = cute.arch.warp_reduction(total[j], lambda a, b: a + b)
        for j in cutlass.range_constexpr(n):
            mine = Int32(0)
            for q in cutlass.range_constexpr(k):
                e = _ld_i32(ids_addr + (Int64(t) * k + q) * 4, None)
                mine = Int32(cutlass.select_(e // per == j, Int32(1), mine))
            row = Int32(cutlass.select_(mine == 1, before[j], Int32(-1)))
            if mine == 1:
                slot = Int64(par * n + rank) * lay.max_tokens + Int64(row)
                _copy_row(bases[j] + lay.x_off + slot * lay.row_bytes, x_addr + Int64(t) * lay.row_bytes,
                          Int32(lay.row_bytes // 16), tid, nthr, None)
                if tid < k:
                    e = _ld_i32(ids_addr + (Int64(t) * k + tid) * 4, None)
                    cute.arch.store(_p(Int32, bases[j] + lay.i_off + (slot * k + Int64(tid)) * 4, 4), e)
                    wv = cute.arch.load(_p(Float32, w_addr + (Int64(t) * k + Int64(tid)) * 4, 4), Float32)
                    cute.arch.store(_p(Float32, bases[j] + lay.w_off + (slot * k + Int64(tid)) * 4, 4), wv)
            if tid == 0:
                cute.arch.store(_p(Int32, me + lay.rowof_off + (Int64(t) * n + j) * 4, 4), row)
                if t == 0:
                    cute.arch.store(_p(Int32, bases[j] + lay.count_off(par, rank), 4), total[j])
    elif t == 0:  # no tokens at all: block 0 still publishes zero counts
        if tid == 0:
            for j in cutlass.range_constexpr(n):
                cute.arch.store(_p(Int32, bases[j] + lay.count_off(par, rank), 4), Int32(0))
    cute.arch.sync_threads()
    if tid == 0:
        cute.arch.fence_acq_rel_sys()
        for j in cutlass.range_constexpr(n):
            cute.arch.atomic_add(_p(Int32, bases[j] + lay.arrive_off(0, rank), 4), Int32(1), sem="release",
                                 scope="sys")
        cute.arch.store(_p(Int32, ep_addr, 4), epoch)


@cute.kernel
def _dispatch_recv(ox_addr: Int64, oids_addr: Int64, ow_addr: Int64, ocnt_addr: Int64, table: Int64,
                   n: cutlass.Constexpr, lay: cutlass.Constexpr, timeout_ns: cutlass.Constexpr):
    tid, _, _ = cute.arch.thread_idx()
    b, _, _ = cute.arch.block_idx()
    nthr, _, _ = cute.arch.block_dim()
    bases = _bases(table, n)
    me = _ld_i64(table + 8 * (n + 1))
    ep_addr = me + lay.ep_off(1, b)
    epoch = _epoch(ep_addr)
    par = epoch & 1
    k = lay.top_k
    if tid == 0:
        for s in cutlass.range_constexpr(n):
            _wait_ge(me + lay.arrive_off(0, s), epoch * lay.max_tokens, me, bases, n, lay, timeout_ns)
    cute.arch.sync_threads()
    for s in cutlass.range_constexpr(n):
        cnt = _ld_i32(me + lay.count_off(par, s), "cg")
        orow = Int64(s * lay.max_tokens) + Int64(b)
        slot = Int64(par * n + s) * lay.max_tokens + Int64(b)
        if b < cnt:
            _copy_row(ox_addr + orow * lay.row_bytes, me + lay.x_off + slot * lay.row_bytes,
                      Int32(lay.row_bytes // 16), tid, nthr, "cg")
            if tid < k:
                e = _ld_i32(me + lay.i_off + (slot * k + Int64(tid)) * 4, "cg")
                cute.arch.store(_p(Int32, oids_addr + (orow * k + Int64(tid)) * 4, 4), e)
                wv = cute.arch.load(_p(Float32, me + lay.w_off + (slot * k + Int64(tid)) * 4, 4), Float32, cop="cg")
                cute.arch.store(_p(Float32, ow_addr + (orow * k + Int64(tid)) * 4, 4), wv)
        else:
            if tid < k:
                cute.arch.store(_p(Int32, oids_addr + (orow * k + Int64(tid)) * 4, 4), Int32(-1))
                cute.arch.store(_p(Float32, ow_addr + (orow * k + Int64(tid)) * 4, 4), Float32(0.0))
        if b == 0:
            if tid == 0:
                cute.arch.store(_p(Int32, ocnt_addr + s * 4, 4), cnt)
    cute.arch.sync_threads()
    if tid == 0:
        cute.arch.store(_p(Int32, ep_addr, 4), epoch)


@cute.kernel
def _combine_send(y_addr: Int64, table: Int64, n: cutlass.Constexpr, lay: cutlass.Constexpr):
    tid, _, _ = cute.arch.thread_idx()
    b, _, _ = cute.arch.block_idx()
    nthr, _, _ = cute.arch.block_dim()
    bases = _bases(table, n)
    rank = Int32(_ld_i64(table + 8 * n))
    me = _ld_i64(table + 8 * (n + 1))
    ep_addr = me + lay.ep_off(2, b)
    epoch = _epoch(ep_addr)
    par = _ld_i32(me + lay.ep_off(1, b), "cg") & 1  # the parity of the dispatch this combine answers
    for s in cutlass.range_constexpr(n):
        cnt = _ld_i32(me + lay.count_off(par, s), "cg")
        if b < cnt:
            src = y_addr + (Int64(s * lay.max_tokens) + Int64(b)) * lay.y_row_bytes
            dst = bases[s] + lay.y_off + (Int64(par * n + rank) * lay.max_tokens + Int64(b)) * lay.y_row_bytes
            _copy_row(dst, src, Int32(lay.y_row_bytes // 16), tid, nthr, None)
    cute.arch.sync_threads()
    if tid == 0:
        cute.arch.fence_acq_rel_sys()
        for s in cutlass.range_constexpr(n):
            cute.arch.atomic_add(_p(Int32, bases[s] + lay.arrive_off(1, rank), 4), Int32(1), sem="release",
                                 scope="sys")
        cute.arch.store(_p(Int32, ep_addr, 4), epoch)


@cute.kernel
def _combine_recv(out_addr: Int64, table: Int64, n_tok: Int32, n: cutlass.Constexpr, lay: cutlass.Constexpr,
                  timeout_ns: cutlass.Constexpr):
    tid, _, _ = cute.arch.thread_idx()
    t, _, _ = cute.arch.block_idx()
    nthr, _, _ = cute.arch.block_dim()
    bases = _bases(table, n)
    me = _ld_i64(table + 8 * (n + 1))
    ep_addr = me + lay.ep_off(3, t)
    epoch = _epoch(ep_addr)
    par = _ld_i32(me + lay.ep_off(0, t), "cg") & 1  # the parity of the dispatch (dispatch_send's epoch)
    if tid == 0:
        for s in cutlass.range_constexpr(n):
            _wait_ge(me + lay.arrive_off(1, s), epoch * lay.max_tokens, me, bases, n, lay, timeout_ns)
    cute.arch.sync_threads()
    if t < n_tok:
        rows = []
        for j in cutlass.range_constexpr(n):
            rows.append(_ld_i32(me + lay.rowof_off + (Int64(t) * n + j) * 4, "cg"))
        vt = ir.VectorType.get([8], cutlass.BFloat16.mlir_type)
        for v in range(tid, lay.hidden // 8, nthr):
            acc = cute.full((8,), 0.0, Float32)
            for j in cutlass.range_constexpr(n):
                real = me + lay.y_off + ((Int64(par * n + j) * lay.max_tokens + Int64(rows[j])) * lay.y_row_bytes
                                         + Int64(v) * 16)
                src = Int64(cutlass.select_(rows[j] >= 0, real, me + lay.zero_off))  # zero row: never written
                y = cute.arch.load(_p(cutlass.BFloat16, src, 16), vt, cop="cg")
                acc = acc + cute.TensorSSA(y, (8,), cutlass.BFloat16).to(Float32)
            cute.arch.store(_p(cutlass.BFloat16, out_addr + (Int64(t) * lay.hidden + Int64(v) * 8) * 2, 16),
                            acc.to(cutlass.BFloat16).ir_value())
    cute.arch.sync_threads()
    if tid == 0:
        cute.arch.store(_p(Int32, ep_addr, 4), epoch)


@cute.jit
def _launch(kind: cutlass.Constexpr, a0: Int64, a1: Int64, a2: Int64, a3: Int64, table: Int64, n_tok: Int32,
            stream: cuda.CUstream, n: cutlass.Constexpr, lay: cutlass.Constexpr, threads: cutlass.Constexpr,
            timeout_ns: cutlass.Constexpr):
    grid = [lay.max_tokens, 1, 1]
    block = [threads, 1, 1]
    if cutlass.const_expr(kind == "dispatch_send"):
        _dispatch_send(a0, a1, a2, table, n_tok, n, lay).launch(grid=grid, block=block, stream=stream)
    elif cutlass.const_expr(kind == "dispatch_recv"):
        _dispatch_recv(a0, a1, a2, a3, table, n, lay, timeout_ns).launch(grid=grid, block=block, stream=stream)
    elif cutlass.const_expr(kind == "combine_send"):
        _combine_send(a0, table, n, lay).launch(grid=grid, block=block, stream=stream)
    else:
        _combine_recv(a0, table, n_tok, n, lay, timeout_ns).launch(grid=grid, block=block, stream=stream)


KINDS = ("dispatch_send", "dispatch_recv", "combine_send", "combine_recv")
#: the kernel parameters of each kind, in order (names of ``Launcher.__call__``'s arguments); "n_tok" is 32-bit
PARAMS = {"dispatch_send": ("a0", "a1", "a2", "table", "n_tok"),
          "dispatch_recv": ("a0", "a1", "a2", "a3", "table"),
          "combine_send": ("a0", "table"),
          "combine_recv": ("a0", "table", "n_tok")}


def ptx_param_bits(ptx: str) -> list[int]:
    """Bit widths of the parameters of the (single) ``.entry`` in a PTX text, in order."""
    m = re.search(r"\.entry\s+\S+\s*\((.*?)\)", ptx, re.S)
    if not m:
        raise ValueError("no .entry in the PTX")
    return [int(b) for b in re.findall(r"\.param\s+\.[usb](\d+)\s", m.group(1))]


def _read_artifact(x, suffix: str) -> bytes:
    if isinstance(x, (bytes, bytearray)):
        return bytes(x)
    if isinstance(x, str) and (x.endswith(suffix) or os.path.sep in x) and len(x) < 4096:
        path = x if os.path.isabs(x) else os.path.join(os.environ["CUTE_DSL_DUMP_DIR"], x)
        if os.path.exists(path):
            with open(path, "rb") as f:
                return f.read()
    return x.encode() if isinstance(x, str) else b""


class Launcher:
    """One kind, launched with a single ``cuLaunchKernel`` from the cubin CuTe DSL produced (as
    kernels/allreduce_cute.Launcher does: CuTe DSL's own call path converts every argument in Python, tens of µs
    per call, which would dominate a ~10 µs dispatch outside CUDA graphs). The parameter list is checked against
    the PTX; on any mismatch ``direct`` is False and calls go through the CuTe DSL callable (``jit``)."""

    def __init__(self, kind: str, jit, grid: int, threads: int):
        self.kind, self.jit, self.grid, self.threads = kind, jit, grid, threads
        self.direct, self.reason = False, None
        try:
            bits = ptx_param_bits(_read_artifact(jit.__ptx__, ".ptx").decode())
            want = [32 if p == "n_tok" else 64 for p in PARAMS[kind]]
            if bits != want:
                raise ValueError(f"kernel parameters {bits} != expected {want}")
            cubin = _read_artifact(jit.__cubin__, ".cubin")
            if not cubin:
                raise ValueError("CuTe DSL produced no cubin")
            err, self.module = cuda.cuModuleLoadData(cubin)
            if err != cuda.CUresult.CUDA_SUCCESS:
                raise RuntimeError(f"cuModuleLoadData: {err}")
            err, count = cuda.cuModuleGetFunctionCount(self.module)
            err2, funcs = cuda.cuModuleEnumerateFunctions(count, self.module)
            if err != cuda.CUresult.CUDA_SUCCESS or err2 != cuda.CUresult.CUDA_SUCCESS or count != 1:
                raise RuntimeError(f"expected one kernel in the cubin, found {count}")
            self.func = funcs[0]
        except Exception as exc:  # the CuTe DSL call path still works
            self.reason = f"{type(exc).__name__}: {exc}"
            return
        self._vals = [ctypes.c_int32() if p == "n_tok" else ctypes.c_uint64() for p in PARAMS[kind]]
        self._ptrs = (ctypes.c_void_p * len(self._vals))(*[ctypes.addressof(v) for v in self._vals])
        self._params = ctypes.addressof(self._ptrs)
        self.direct = True

    def __call__(self, a0: int, a1: int, a2: int, a3: int, table: int, n_tok: int, stream: int,
                 use_jit: bool = False) -> None:
        if use_jit or not self.direct:
            self.jit(a0, a1, a2, a3, table, n_tok, cuda.CUstream(stream))
            return
        args = {"a0": a0, "a1": a1, "a2": a2, "a3": a3, "table": table, "n_tok": n_tok}
        for v, p in zip(self._vals, PARAMS[self.kind]):
            v.value = args[p]
        (err,) = cuda.cuLaunchKernel(self.func, self.grid, 1, 1, self.threads, 1, 1, 0, stream, self._params, 0)
        if err != cuda.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuLaunchKernel({self.kind}) failed: {err}")


def compile_jit(kind: str, n: int, lay, threads: int = 128, timeout_ns: int = SPIN_TIMEOUT_NS):
    """The CuTe DSL callable ``f(a0, a1, a2, a3, table, n_tok, stream)`` of one of KINDS (cubin and PTX kept)."""
    return cute.compile[cute.KeepCUBIN, cute.KeepPTX](
        _launch, kind, Int64(0), Int64(0), Int64(0), Int64(0), Int64(0), Int32(0), cuda.CUstream(0), n, lay,
        threads, int(timeout_ns))


@functools.lru_cache(maxsize=64)
def compiled(kind: str, n: int, lay, threads: int = 128, timeout_ns: int = SPIN_TIMEOUT_NS) -> Launcher:
    """Compile one of KINDS (once per configuration, in the current CUDA context); returns its ``Launcher``,
    called as ``f(a0, a1, a2, a3, table, n_tok, stream_handle)`` (unused addresses: 0)."""
    return Launcher(kind, compile_jit(kind, n, lay, threads, timeout_ns), lay.max_tokens, threads)
