"""Grouped GEMMs for the MoE experts: a drop-in ``grouped_swiglu`` with a CuTe DSL decode kernel, torch elsewhere.

    from kernels.grouped_gemm import grouped_swiglu
    y = grouped_swiglu(x, gate_up, down, counts)      # same call and semantics as engine/real/model.py

Shapes (the engine's): ``x [R, D]`` rows sorted by expert, ``counts [E]`` rows per expert (int, on x's device,
sum = R), ``gate_up [E, 2F, D]`` (gate = first F rows), ``down [E, D, F]`` -> ``[R, D]`` in x's dtype.

Implementations (``impl=``):
  "cute_gemv"  kernels/grouped_gemm_cute.py: streams each active expert's weights once per <= 8 rows; the gate_up
               GEMM and SwiGLU are fused (one kernel writes ``silu(g) * u`` [R, F]), then the down GEMM. Needs CUDA,
               bf16, contiguous weights, D % 256 == 0, F % 256 == 0 (the K of each GEMM), and CuTe DSL.
  "torch"      two ``torch._grouped_mm`` calls (bf16 on CUDA) or a per-expert loop (CPU / other dtypes): the
               engine's implementation, kept as the fallback and as the benchmark baseline.
  "auto"       "cute_gemv" when :func:`use_decode_kernel` says so (mean rows per expert <= 2, where it measured
               faster),
               else "torch". No host synchronisation either way (counts stay on the device): CUDA-graph safe.

Reference for tests: :func:`grouped_swiglu_reference` (fp32 or fp64 loop over experts, any device).
"""

from __future__ import annotations

import os

DECODE_MAX_MEAN_ROWS = 2  # mean rows per expert up to which the weight-streaming kernel is used (measured:
# 1.2-1.5x over torch._grouped_mm at 1-2 rows/expert with >= 32 experts, 0.6x at 8 rows; kernels/MOE_KERNELS.md)
_GU_RW, _DOWN_RW, _WARPS = 1, 2, 8  # rows per warp (gate_up: 1 gate + 1 up row; down: 2 rows); warps per block

_cute_state: dict = {}


def cute_unavailable() -> str | None:
    """Why the CuTe DSL path cannot run here (None when it can). Cached."""
    if "reason" not in _cute_state:
        reason = None
        try:
            import torch

            if not torch.cuda.is_available():
                reason = "no CUDA device"
            elif os.environ.get("RACKBED_NO_CUTE") == "1":
                reason = "RACKBED_NO_CUTE=1"
            else:
                import cutlass.cute  # noqa: F401
                from kernels import grouped_gemm_cute  # noqa: F401
        except Exception as exc:  # ImportError, driver errors: fall back
            reason = f"CuTe DSL not importable ({type(exc).__name__}: {exc})"
        _cute_state["reason"] = reason
    return _cute_state["reason"]


def check_swiglu_args(x, gate_up, down, counts) -> tuple[int, int, int, int]:
    """Validate shapes; return (R, E, D, F). ValueError (one line) on a mismatch."""
    if x.dim() != 2:
        raise ValueError(f"grouped_swiglu: x must be [R, D], got {tuple(x.shape)}")
    R, D = x.shape
    if gate_up.dim() != 3 or gate_up.shape[2] != D or gate_up.shape[1] % 2:
        raise ValueError(f"grouped_swiglu: gate_up must be [E, 2F, D={D}], got {tuple(gate_up.shape)}")
    E, F = gate_up.shape[0], gate_up.shape[1] // 2
    if tuple(down.shape) != (E, D, F):
        raise ValueError(f"grouped_swiglu: down must be [E={E}, D={D}, F={F}], got {tuple(down.shape)}")
    if counts.dim() != 1 or counts.shape[0] != E:
        raise ValueError(f"grouped_swiglu: counts must be [E={E}], got {tuple(counts.shape)}")
    return R, E, D, F


def decode_kernel_unsupported(x, gate_up, down) -> str | None:
    """Why the CuTe decode kernel cannot take these tensors (None when it can); does not look at counts."""
    import torch

    if not x.is_cuda:
        return "not on CUDA"
    if not (x.dtype == gate_up.dtype == down.dtype == torch.bfloat16):
        return "dtypes must all be bf16"
    D, F = x.shape[1], down.shape[2]
    if D % 256 or F % 256:
        return f"D={D} and F={F} must be multiples of 256"
    if F % (_WARPS * _GU_RW) or D % (_WARPS * _DOWN_RW):
        return "output tiling does not divide"
    for name, t in (("x", x), ("gate_up", gate_up), ("down", down)):
        if not t.is_contiguous() or t.data_ptr() % 16:
            return f"{name} must be contiguous and 16-byte aligned"
    return None


def use_decode_kernel(n_rows: int, n_experts: int) -> bool:
    """Decode shapes: at most DECODE_MAX_MEAN_ROWS rows per expert on average (host-known sizes only).

    A skewed routing (many rows on one expert) stays correct but re-streams that expert's weights once per 8 rows.
    """
    return n_rows <= DECODE_MAX_MEAN_ROWS * n_experts


def grouped_swiglu_reference(x, gate_up, down, counts, dtype=None):
    """Per-expert loop in ``dtype`` (default float32; use float64 on the CPU for tests) -> [R, D] in ``dtype``."""
    import torch

    dt = dtype or torch.float32
    R, E, D, F = check_swiglu_args(x, gate_up, down, counts)
    out = torch.zeros(R, D, dtype=dt, device=x.device)
    start = 0
    for e, n in enumerate(counts.tolist()):
        if n:
            xe = x[start:start + n].to(dt)
            gu = xe @ gate_up[e].to(dt).T
            out[start:start + n] = (torch.nn.functional.silu(gu[:, :F]) * gu[:, F:]) @ down[e].to(dt).T
            start += n
    return out


def grouped_swiglu_torch(x, gate_up, down, counts):
    """The engine's implementation (two torch._grouped_mm on CUDA bf16, else a loop)."""
    import torch
    import torch.nn.functional as F_

    R, E, D, F = check_swiglu_args(x, gate_up, down, counts)
    if x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm"):
        offs = torch.cumsum(counts, 0).to(torch.int32)
        gu = torch._grouped_mm(x, gate_up.transpose(1, 2), offs=offs)  # [R, 2F]
        a = F_.silu(gu[:, :F]) * gu[:, F:]
        return torch._grouped_mm(a, down.transpose(1, 2), offs=offs)  # [R, D]
    out = torch.empty(R, D, dtype=x.dtype, device=x.device)
    start = 0
    for e, n in enumerate(counts.tolist()):
        if n:
            gu = x[start:start + n] @ gate_up[e].T
            out[start:start + n] = (F_.silu(gu[:, :F]) * gu[:, F:]) @ down[e].T
            start += n
    return out


def expert_offsets(counts, out=None):
    """int32 [E+1] prefix sums (0, c0, c0+c1, ...) on counts' device, without a host sync."""
    import torch

    E = counts.shape[0]
    if out is None:
        out = torch.empty(E + 1, dtype=torch.int32, device=counts.device)
    out[:1].zero_()
    torch.cumsum(counts, 0, dtype=torch.int32, out=out[1:])
    return out


def gemv_launch(x, w, offs, out, fuse: bool):
    """One launch of the CuTe kernel: x [R, K], w [E, N, K], offs int32 [E+1], out [R, N] or [R, N/2] (fuse)."""
    import torch

    from kernels import grouped_gemm_cute as gc

    E, N, K = w.shape
    rw = _GU_RW if fuse else _DOWN_RW
    n_out = N // 2 if fuse else N
    n_tiles = n_out // (_WARPS * rw)
    fn = gc.compiled(K, fuse, rw, _WARPS)
    stream = torch.cuda.current_stream().cuda_stream
    fn(x.data_ptr(), w.data_ptr(), offs.data_ptr(), out.data_ptr(), N, n_tiles, E, gc.cuda.CUstream(stream))
    return out


def grouped_swiglu_cute(x, gate_up, down, counts, *, act_out=None, out=None):
    """Decode kernel path: fused gate_up+SwiGLU, then down. Optional caller-allocated ``act_out [R, F]`` and
    ``out [R, D]`` (bf16) make it allocation-free (CUDA-graph friendly)."""
    import torch

    R, E, D, F = check_swiglu_args(x, gate_up, down, counts)
    why = decode_kernel_unsupported(x, gate_up, down) or cute_unavailable()
    if why:
        raise ValueError(f"grouped_swiglu(impl='cute_gemv'): {why}")
    if act_out is None:
        act_out = torch.empty(R, F, dtype=x.dtype, device=x.device)
    if out is None:
        out = torch.empty(R, D, dtype=x.dtype, device=x.device)
    if R == 0:
        return out
    offs = expert_offsets(counts)
    gemv_launch(x, gate_up, offs, act_out, fuse=True)
    gemv_launch(act_out, down, offs, out, fuse=False)
    return out


def grouped_swiglu(x, gate_up, down, counts, *, impl: str = "auto"):
    """Drop-in for engine.real.model.grouped_swiglu (see the module docstring for shapes and ``impl``)."""
    if impl not in ("auto", "cute_gemv", "torch"):
        raise ValueError(f"grouped_swiglu: impl={impl!r} must be 'auto', 'cute_gemv' or 'torch'")
    R, E, _, _ = check_swiglu_args(x, gate_up, down, counts)
    if impl == "auto":
        ok = (use_decode_kernel(R, E) and decode_kernel_unsupported(x, gate_up, down) is None
              and cute_unavailable() is None)
        impl = "cute_gemv" if ok else "torch"
    if impl == "cute_gemv":
        return grouped_swiglu_cute(x, gate_up, down, counts)
    return grouped_swiglu_torch(x, gate_up, down, counts)


def swiglu_weight_bytes(counts_list, D: int, F: int, elem_bytes: int = 2) -> int:
    """Fewest bytes a decode grouped SwiGLU must read: each active expert's gate_up [2F, D] and down [D, F] once."""
    active = sum(1 for c in counts_list if c)
    return active * 3 * F * D * elem_bytes


def swiglu_flops(n_rows: int, D: int, F: int) -> int:
    """FLOPs of the grouped SwiGLU on n_rows rows: 2*R*D*2F (gate_up) + 2*R*F*D (down)."""
    return 6 * n_rows * D * F
