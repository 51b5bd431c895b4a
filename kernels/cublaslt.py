"""Run a chosen cuBLAS kernel on a bf16 GEMM of any size: a small ctypes binding of cuBLASLt.

``torch.matmul`` lets cuBLAS pick the kernel for each problem size, and on Hopper it picks some kernels at a single
token count (``64x224`` at m = 416 of the 4096 x 8192 output projection, 15 % slower than its neighbours). A
simulator that interpolates the measured curve cannot price such a kernel from the other sizes: no other size ran
it. This module runs that kernel *by choice* at other sizes, so that ``kernels/bench/measure.py`` can time it there
(``gemm_forced`` rows) and ``sim/calibrate.py`` can price it like any other kernel, from its own timed points.

How a kernel is chosen: cuBLASLt's heuristic is asked for its candidate algorithms at the size where the library
picks the kernel (:meth:`CublasLt.candidates`), each candidate is run once under the profiler
(``kernels.bench.measure.kernel_names``) and the one that launches the same kernels is kept. An algorithm is a
configuration (tile, stages, cluster, split-K), not a size, so it runs at other sizes: :meth:`CublasLt.supports`
asks cuBLASLt first (``cublasLtMatmulAlgoCheck``).

The problem is the one ``torch.matmul(x, w.t())`` hands cuBLAS for ``x[m, k]`` and ``w[n, k]`` (row-major): the
column-major product ``y^T[n, m] = op_T(w) @ x^T`` with ``A = w`` transposed, ``B = x`` as is, fp32 accumulation,
bf16 in and out. Everything runs on torch's current stream (capturable in a CUDA graph: the workspace is
preallocated).
"""

from __future__ import annotations

import ctypes

CUBLAS_COMPUTE_32F = 68
CUDA_R_32F, CUDA_R_16BF = 0, 14
MATMUL_DESC_TRANSA, MATMUL_DESC_TRANSB = 3, 4
PREF_MAX_WORKSPACE_BYTES = 1
OP_N, OP_T = 0, 1
#: workspace offered to every call (bytes): what split-K kernels need for their partial sums
WORKSPACE_BYTES = 32 * 2**20


class CublasError(RuntimeError):
    pass


class Algo(ctypes.Structure):
    """``cublasLtMatmulAlgo_t``: an opaque configuration."""
    _fields_ = [("data", ctypes.c_uint64 * 8)]


class HeuristicResult(ctypes.Structure):
    """``cublasLtMatmulHeuristicResult_t``."""
    _fields_ = [("algo", Algo), ("workspaceSize", ctypes.c_size_t), ("state", ctypes.c_int),
                ("wavesCount", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


def _library() -> ctypes.CDLL:
    """The cuBLASLt that torch loaded (found in this process's memory map after a bf16 matmul), else the soname."""
    import torch

    a = torch.ones(16, 16, device="cuda", dtype=torch.bfloat16)
    (a @ a).sum().item()
    with open("/proc/self/maps") as f:
        paths = sorted({ln.split()[-1] for ln in f if "libcublasLt.so" in ln})
    for name in [*paths, "libcublasLt.so.13", "libcublasLt.so.12", "libcublasLt.so"]:
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise CublasError("cuBLASLt: no libcublasLt found in this process or on the library path")


_vp, _sz = ctypes.c_void_p, ctypes.c_size_t
_SIGNATURES = {
    "cublasLtCreate": [ctypes.POINTER(_vp)],
    "cublasLtMatmulDescCreate": [ctypes.POINTER(_vp), ctypes.c_int, ctypes.c_int],
    "cublasLtMatmulDescSetAttribute": [_vp, ctypes.c_int, _vp, _sz],
    "cublasLtMatrixLayoutCreate": [ctypes.POINTER(_vp), ctypes.c_int, ctypes.c_uint64, ctypes.c_uint64,
                                   ctypes.c_int64],
    "cublasLtMatmulPreferenceCreate": [ctypes.POINTER(_vp)],
    "cublasLtMatmulPreferenceSetAttribute": [_vp, ctypes.c_int, _vp, _sz],
    "cublasLtMatmulAlgoGetHeuristic": [_vp, _vp, _vp, _vp, _vp, _vp, _vp, ctypes.c_int,
                                       ctypes.POINTER(HeuristicResult), ctypes.POINTER(ctypes.c_int)],
    "cublasLtMatmulAlgoCheck": [_vp, _vp, _vp, _vp, _vp, _vp, ctypes.POINTER(Algo),
                                ctypes.POINTER(HeuristicResult)],
    "cublasLtMatmul": [_vp, _vp, _vp, _vp, _vp, _vp, _vp, _vp, _vp, _vp, _vp, _vp, ctypes.POINTER(Algo), _vp, _sz,
                       _vp],
}


class CublasLt:
    """One cuBLASLt handle, the bf16 ``x @ w^T`` descriptor and a workspace on the current CUDA device.
    :meth:`shared` gives one per process (the handle, descriptors and layouts live as long as the process)."""

    _shared: "CublasLt | None" = None

    @classmethod
    def shared(cls) -> "CublasLt":
        if cls._shared is None:
            cls._shared = cls()
        return cls._shared

    def __init__(self, workspace_bytes: int = WORKSPACE_BYTES):
        import torch

        self.lib = _library()
        for name, args in _SIGNATURES.items():
            fn = getattr(self.lib, name)
            fn.argtypes, fn.restype = args, ctypes.c_int
        self.handle, self.desc, self.pref = _vp(), _vp(), _vp()
        self._call("cublasLtCreate", ctypes.byref(self.handle))
        self._call("cublasLtMatmulDescCreate", ctypes.byref(self.desc), CUBLAS_COMPUTE_32F, CUDA_R_32F)
        for attr, op in ((MATMUL_DESC_TRANSA, OP_T), (MATMUL_DESC_TRANSB, OP_N)):
            v = ctypes.c_int32(op)
            self._call("cublasLtMatmulDescSetAttribute", self.desc, attr, ctypes.byref(v), 4)
        self._call("cublasLtMatmulPreferenceCreate", ctypes.byref(self.pref))
        ws = ctypes.c_uint64(workspace_bytes)
        self._call("cublasLtMatmulPreferenceSetAttribute", self.pref, PREF_MAX_WORKSPACE_BYTES, ctypes.byref(ws), 8)
        self.workspace_bytes = workspace_bytes
        self.workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device="cuda")
        self.alpha, self.beta = ctypes.c_float(1.0), ctypes.c_float(0.0)
        self._layouts: dict[tuple[int, int, int], tuple[_vp, _vp, _vp]] = {}

    def _call(self, name: str, *args) -> None:
        st = getattr(self.lib, name)(*args)
        if st != 0:
            raise CublasError(f"{name}: cuBLAS status {st}")

    def layouts(self, n: int, k: int, m: int) -> tuple[_vp, _vp, _vp]:
        """``(A, B, C)`` layouts: ``A`` = w as k x n (ld k), ``B`` = x as k x m (ld k), ``C = D`` = n x m (ld n)."""
        key = (n, k, m)
        if key not in self._layouts:
            out = []
            for rows, cols, ld in ((k, n, k), (k, m, k), (n, m, n)):
                lay = _vp()
                self._call("cublasLtMatrixLayoutCreate", ctypes.byref(lay), CUDA_R_16BF, rows, cols, ld)
                out.append(lay)
            self._layouts[key] = tuple(out)
        return self._layouts[key]

    def candidates(self, n: int, k: int, m: int, count: int = 32) -> list[Algo]:
        """The heuristic's algorithms for ``m x k @ (n x k)^T``, best first (those that fit the workspace)."""
        res = (HeuristicResult * count)()
        got = ctypes.c_int(0)
        a, b, c = self.layouts(n, k, m)
        self._call("cublasLtMatmulAlgoGetHeuristic", self.handle, self.desc, a, b, c, c, self.pref, count, res,
                   ctypes.byref(got))
        return [Algo.from_buffer_copy(res[i].algo) for i in range(got.value)
                if res[i].state == 0 and res[i].workspaceSize <= self.workspace_bytes]

    def supports(self, algo: Algo, n: int, k: int, m: int) -> bool:
        """Whether ``algo`` runs this size within the workspace (``cublasLtMatmulAlgoCheck``)."""
        out = HeuristicResult()
        a, b, c = self.layouts(n, k, m)
        st = self.lib.cublasLtMatmulAlgoCheck(self.handle, self.desc, a, b, c, c, ctypes.byref(algo),
                                              ctypes.byref(out))
        return st == 0 and out.workspaceSize <= self.workspace_bytes

    def matmul(self, x, w, y, algo: Algo) -> None:
        """``y[m, n] = x[m, k] @ w[n, k]^T`` (bf16, contiguous) with ``algo``, on torch's current stream."""
        import torch

        m, k = x.shape
        n = w.shape[0]
        a, b, c = self.layouts(n, k, m)
        self._call("cublasLtMatmul", self.handle, self.desc, ctypes.byref(self.alpha), _vp(w.data_ptr()), a,
                   _vp(x.data_ptr()), b, ctypes.byref(self.beta), _vp(y.data_ptr()), c, _vp(y.data_ptr()), c,
                   ctypes.byref(algo), _vp(self.workspace.data_ptr()), self.workspace_bytes,
                   _vp(torch.cuda.current_stream().cuda_stream))
