"""Grouped GEMMs for the MoE experts: a drop-in ``grouped_swiglu`` with a CuTe DSL decode kernel, torch elsewhere.

    from rackbed.kernels.grouped_gemm import grouped_swiglu
    y = grouped_swiglu(x, gate_up, down, counts)      # same call and semantics as engine/real/model.py

Shapes (the engine's): ``x [R, D]`` rows sorted by expert, ``counts [E]`` rows per expert (int, on x's device,
sum = R), ``gate_up [E, 2F, D]`` (gate = first F rows), ``down [E, D, F]`` -> ``[R, D]`` in x's dtype.

Implementations (``impl=``):
  "cute_gemv"  kernels/grouped_gemm_cute.py: streams each active expert's weights once per <= 8 rows; the gate_up
               GEMM and SwiGLU are fused (one kernel writes ``silu(g) * u`` [R, F]), then the down GEMM. Needs CUDA,
               bf16, contiguous weights, D % 256 == 0, F % 256 == 0 (the K of each GEMM), and CuTe DSL.
  "torch"      two ``torch._grouped_mm`` calls (bf16 on CUDA) or a per-expert loop (CPU / other dtypes): the
               engine's implementation, kept as the fallback and as the benchmark baseline.
  "cute_mma"   kernels/grouped_gemm_mma.py: the same byte stream on the tensor cores (mma.sync m16n8k16, weights
               as M, tokens as N = 8), persistent grid over (active expert, tile) with split-K inside the CTA, fused
               SwiGLU. Needs CUDA, bf16, contiguous 16-byte aligned tensors, D % 256 == 0, F % 256 == 0, CuTe DSL.
  "auto"       the first rule of DECODE_DISPATCH whose mean-rows-per-expert bound (R / E, host-known) and
               minimum expert count match, if that kernel can take the tensors; else "torch" (the lead sets the
               rules from the measured table: ``python -m rackbed.kernels.bench.moe --suite moe_gemm`` prints a suggestion).
               No host synchronisation either way (counts stay on the device): CUDA-graph safe.

Reference for tests: :func:`grouped_swiglu_reference` (fp32 or fp64 loop over experts, any device).
"""

from __future__ import annotations

import os

DECODE_MAX_MEAN_ROWS = 2  # mean rows per expert up to which the weight-streaming kernel is used (measured:
# 1.2-1.5x over torch._grouped_mm at 1-2 rows/expert with >= 32 experts, 0.6x at 8 rows; docs/KERNELS.md)
# impl="auto": (max mean rows per expert R/E, min experts E, impl), first match wins, else "torch". The GEMV rule is
# the measured one; "cute_mma" enters once it is measured (bench_moe's moe_gemm suite prints suggested rules).
# Measured 2026-11-29 on one H200 (results/h200x2/moe/decode_gemm_v3_sweep.json, CUDA-graph replay, same run as
# torch._grouped_mm): the tuned tensor-core kernel is 1.32-1.74x torch at every case up to 8 rows per expert.
# At DeepSeek-V3 width (D 7168, F 2048, 256 experts) the Qwen3-width tilings lost to torch above 2 rows per expert
# (results/h200/kernels/mla_decode_h200_v2.json); with the tilings swept at that width (MMA_TUNED_BY_WIDTH) the
# kernel streams ~4.0 TB/s at 1-8 mean rows per expert vs torch's 3.0-3.2 (results/h200/kernels/
# dsv3_decode_gemm_moe_gemm.json). In the engine's whole step (results/h200/kernels/mla_decode_h200_v4.json) that
# holds up to 4 mean rows (batch 128: 9.45 ms vs 10.42 with torch in mla_decode_h200_v3.json); at 8 (batch 256, 136
# experts with ~15 rows each) the step took 14.20 ms vs 13.03 with torch, so 256+ experts take torch above 4 rows.
DECODE_DISPATCH: tuple[tuple[float, int, str], ...] = (
    (4.0, 256, "cute_mma"), (float("inf"), 256, "torch"), (8.0, 1, "cute_mma"))
IMPLS = ("auto", "cute_gemv", "cute_mma", "wgmma", "torch")
# impl="auto" at prefill shapes: the wgmma/TMA grouped GEMM (kernels/grouped_gemm_wgmma.py) is taken when the mean
# rows per expert R/E is >= this bound. None = off until the GPU benchmark shows it faster than torch._grouped_mm
# (``python -m rackbed.kernels.bench.moe_prefill``); the lead flips it here or with RACKBED_PREFILL_WGMMA_MIN_ROWS=<rows>.
PREFILL_WGMMA_MIN_MEAN_ROWS: float | None = None
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

                from rackbed.kernels import grouped_gemm_cute  # noqa: F401
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


def pick_decode_impl(n_rows: int, n_experts: int, rules=None) -> str:
    """The impl ``auto`` wants for R rows over E experts by the dispatch rules (before checking the tensors)."""
    mean = n_rows / max(n_experts, 1)
    for max_mean, min_e, impl in (DECODE_DISPATCH if rules is None else rules):
        if mean <= max_mean and n_experts >= min_e:
            return impl
    return "torch"


def suggest_dispatch(rows: list[dict], impls=("cute_gemv", "cute_mma"), min_gain: float = 1.0) -> list:
    """Dispatch rules from benchmark rows (``rows``, ``experts``, ``torch_us``, ``<impl>_us``): for each measured mean
    rows per expert (ascending), the fastest impl if it beats torch by ``min_gain``; consecutive equal choices are
    merged. Rows of one mean with different winners take the one with the larger total time saved."""
    by_mean: dict[float, dict[str, float]] = {}
    for r in rows:
        if not r.get("torch_us"):
            continue
        mean = r["rows"] / r["experts"]
        save = by_mean.setdefault(mean, {})
        for impl in ("torch",) + tuple(impls):
            t = r.get(f"{impl}_us")
            if t is None or (impl != "torch" and r.get(f"{impl}_relerr", 1.0) > 2e-2):
                continue
            if impl != "torch" and r["torch_us"] / t < min_gain:
                continue
            save[impl] = save.get(impl, 0.0) + (r["torch_us"] - t)
    rules: list[tuple[float, int, str]] = []
    for mean in sorted(by_mean):
        best = max(by_mean[mean].items(), key=lambda kv: kv[1], default=("torch", 0.0))[0]
        if rules and rules[-1][2] == best:
            rules[-1] = (mean, 1, best)
        else:
            rules.append((mean, 1, best))
    while rules and rules[-1][2] == "torch":  # torch is the fallback anyway
        rules.pop()
    return rules


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

    from rackbed.kernels import grouped_gemm_cute as gc

    E, N, K = w.shape
    rw = _GU_RW if fuse else _DOWN_RW
    n_out = N // 2 if fuse else N
    n_tiles = n_out // (_WARPS * rw)
    fn = gc.compiled(K, fuse, rw, _WARPS)
    stream = torch.cuda.current_stream().cuda_stream
    fn(x.data_ptr(), w.data_ptr(), offs.data_ptr(), out.data_ptr(), N, n_tiles, E, gc.cuda.CUstream(stream))
    return out


MMA_KC, MMA_MAX_EXPERTS = 32, 1024  # physical K per lane-chunk of the tensor-core kernel; experts it can list
MMA_SMEM_MAX = 48 * 1024  # static shared memory a CTA may use (expert list + split-K reduction buffer)

# Tensor-core kernel configurations. Keys: rb = 16-row MMA blocks per work item (gate_up: rb gate + rb up blocks),
# warps = split-K ways inside the CTA, ctas = CTAs per SM (persistent grid size and the ptxas register bound),
# depth = K chunks of loads issued ahead of the MMAs (0 = chunk by chunk), hint = weight-load flavour (0 plain,
# 1 ld.global.nc.L1::no_allocate.L2::256B, 2 ld.global.nc.L1::no_allocate), tn = token groups of 8 per weight pass.
MMA_V2 = {"gate_up": {"rb": 1, "warps": 8, "ctas": 2, "depth": 0, "hint": 0, "tn": 1},
          "down": {"rb": 2, "warps": 8, "ctas": 2, "depth": 0, "hint": 0, "tn": 1}}
# (max mean rows per expert R/E, min experts E, gate_up config, down config): first match wins, else MMA_V2. Set from
# the sweep of ``python -m rackbed.kernels.bench.moe --suite moe_gemm`` (it prints a suggestion); empty until measured.
# From the same sweep's suggestion (best gate_up + down variant per mean-rows bucket).
_MMA_DOWN_H1 = {"rb": 2, "warps": 8, "ctas": 2, "depth": 0, "hint": 1, "tn": 1}
MMA_TUNED: tuple[tuple[float, int, dict, dict], ...] = (
    (0.5, 1, {"rb": 1, "warps": 4, "ctas": 2, "depth": 8, "hint": 1, "tn": 1}, _MMA_DOWN_H1),   # w4d8h1c2 + h1
    (1.0, 1, {"rb": 1, "warps": 8, "ctas": 1, "depth": 8, "hint": 1, "tn": 1}, _MMA_DOWN_H1),   # d8h1c1 + h1
    (4.0, 1, {"rb": 1, "warps": 4, "ctas": 2, "depth": 8, "hint": 1, "tn": 1}, _MMA_DOWN_H1),   # w4d8h1c2 + h1
    (8.0, 1, {"rb": 1, "warps": 8, "ctas": 2, "depth": 4, "hint": 1, "tn": 2}, _MMA_DOWN_H1),   # d4h1tn2 + h1
)


# Tilings swept at other model widths (hidden size D -> rules as MMA_TUNED), measured 2026-12-04 on one H200 with
# ``RACKBED_MOE_SHAPE=7168,2048,256 python -m rackbed.kernels.bench.moe --suite moe_gemm``
# (results/h200/kernels/dsv3_decode_gemm_moe_gemm.json: DeepSeek-V3 / Kimi-K2 width, 16 tokens per tile above 3.9
# rows per expert).
_W4D8 = {"rb": 1, "warps": 4, "ctas": 2, "depth": 8, "hint": 1, "tn": 1}
_DOWN_V2 = {"rb": 2, "warps": 8, "ctas": 2, "depth": 0, "hint": 0, "tn": 1}
MMA_TUNED_BY_WIDTH: dict[int, tuple[tuple[float, int, dict, dict], ...]] = {
    7168: (
        (2.1875, 1, _W4D8, _DOWN_V2),                                                          # w4d8h1c2 + v2
        (3.875, 1, {"rb": 1, "warps": 8, "ctas": 1, "depth": 8, "hint": 1, "tn": 1}, _DOWN_V2),   # d8h1c1 + v2
        (4.0, 1, {**_W4D8, "tn": 2}, _DOWN_V2),                                                 # w4d8h1c2tn2 + v2
        (8.0, 1, {**_W4D8, "tn": 2}, {"rb": 1, "warps": 4, "ctas": 4, "depth": 6, "hint": 1, "tn": 1}),
    ),
}


def mma_config(fuse: bool, n_rows: int | None = None, n_experts: int | None = None, width: int | None = None) -> dict:
    """The tensor-core kernel's configuration for the gate_up (``fuse``) or down GEMM at R rows over E experts, for a
    model of hidden size ``width`` (its own sweep in MMA_TUNED_BY_WIDTH when there is one, else MMA_TUNED)."""
    if n_rows is not None and n_experts:
        mean = n_rows / n_experts
        for max_mean, min_e, gu, dn in MMA_TUNED_BY_WIDTH.get(width, MMA_TUNED):
            if mean <= max_mean and n_experts >= min_e:
                return dict(gu if fuse else dn)
    return dict(MMA_V2["gate_up" if fuse else "down"])


def mma_tiling_unsupported(E: int, N: int, K: int, fuse: bool, rb: int, warps: int, tn: int = 1) -> str | None:
    """Why the tensor-core kernel cannot take ``w [E, N, K]`` with this tiling (None when it can)."""
    if fuse and N % 2:
        return f"fused gate_up needs an even N, got {N}"
    n_out = N // 2 if fuse else N
    if K % (MMA_KC * warps):
        return f"K={K} must be a multiple of {MMA_KC * warps} ({MMA_KC} x {warps} warps)"
    if n_out % (16 * rb):
        return f"output width {n_out} must be a multiple of {16 * rb}"
    if tn not in (1, 2) or rb < 1 or warps < 1:
        return f"rb={rb}, warps={warps}, tn={tn}: need rb >= 1, warps >= 1, tn in (1, 2)"
    if E > MMA_MAX_EXPERTS:
        return f"E={E} > {MMA_MAX_EXPERTS}"
    smem = 4 * (E + 1) + 16 + 4 * warps * 4 * (2 * rb if fuse else rb) * tn * 32
    if smem > MMA_SMEM_MAX:
        return f"shared memory {smem} B > {MMA_SMEM_MAX} (fewer warps, rb or tn)"
    return None


def mma_items(n_active: int, N: int, fuse: bool, rb: int) -> int:
    """Work items of the tensor-core kernel for ``n_active`` non-empty experts (the grid never needs more CTAs)."""
    n_out = N // 2 if fuse else N
    return n_active * (n_out // (16 * rb))


def mma_unsupported(x, gate_up, down, n_rows: int | None = None) -> str | None:
    """Why the tensor-core decode kernel cannot take these tensors with the configurations picked for ``n_rows``
    rows (default x's row count) (None when it can); does not look at counts."""
    why = decode_kernel_unsupported(x, gate_up, down)
    if why:
        return why
    E, N, D = gate_up.shape
    R = x.shape[0] if n_rows is None else n_rows
    for n, k, fuse in ((N, D, True), (D, N // 2, False)):
        c = mma_config(fuse, R, E, D)
        why = mma_tiling_unsupported(E, n, k, fuse, c["rb"], c["warps"], c.get("tn", 1))
        if why:
            return why
    try:
        from rackbed.kernels import grouped_gemm_mma  # noqa: F401
    except Exception as exc:  # a CuTe DSL version without what this kernel uses: the other paths stay usable
        return f"rackbed.kernels.grouped_gemm_mma not importable ({type(exc).__name__}: {exc})"
    return None


_sm_count: dict = {}


def mma_launch(x, w, offs, out, fuse: bool, n_rows: int, cfg: dict | None = None):
    """One launch of the tensor-core kernel: x [R, K], w [E, N, K], offs int32 [E+1], out [R, N] or [R, N/2].
    ``cfg`` (default :func:`mma_config`) as in MMA_V2. The persistent grid is min(ctas x SMs, items of min(E, R)
    active experts) CTAs."""
    import torch

    from rackbed.kernels import grouped_gemm_mma as gm

    E, N, K = w.shape
    c = cfg or mma_config(fuse, n_rows, E, K if fuse else N)
    dev = x.device.index if x.device.index is not None else torch.cuda.current_device()
    if dev not in _sm_count:
        _sm_count[dev] = torch.cuda.get_device_properties(dev).multi_processor_count
    n_ctas = max(1, min(c["ctas"] * _sm_count[dev], mma_items(min(E, n_rows), N, fuse, c["rb"])))
    fn = gm.compiled(E, N, K, fuse, c["rb"], c["warps"], c["ctas"], c.get("depth", 0), c.get("hint", 0),
                     c.get("tn", 1))
    stream = torch.cuda.current_stream().cuda_stream
    fn(x.data_ptr(), w.data_ptr(), offs.data_ptr(), out.data_ptr(), n_ctas, gm.cuda.CUstream(stream))
    return out


def grouped_swiglu_mma(x, gate_up, down, counts, *, act_out=None, out=None, gu_cfg=None, dn_cfg=None, offs=None):
    """Tensor-core decode path: fused gate_up+SwiGLU, then down; optional caller-allocated ``act_out [R, F]`` and
    ``out [R, D]`` (bf16), as :func:`grouped_swiglu_cute`; ``gu_cfg``/``dn_cfg`` override :func:`mma_config`;
    ``offs`` a precomputed :func:`expert_offsets` (saves two small launches)."""
    import torch

    R, E, D, F = check_swiglu_args(x, gate_up, down, counts)
    why = cute_unavailable() or mma_unsupported(x, gate_up, down)
    if why:
        raise ValueError(f"grouped_swiglu(impl='cute_mma'): {why}")
    if act_out is None:
        act_out = torch.empty(R, F, dtype=x.dtype, device=x.device)
    if out is None:
        out = torch.empty(R, D, dtype=x.dtype, device=x.device)
    if R == 0:
        return out
    if offs is None:
        offs = expert_offsets(counts)
    mma_launch(x, gate_up, offs, act_out, True, R, gu_cfg)
    mma_launch(act_out, down, offs, out, False, R, dn_cfg)
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


def use_prefill_wgmma(n_rows: int, n_experts: int) -> bool:
    """Prefill switch for impl="auto" (PREFILL_WGMMA_MIN_MEAN_ROWS, env RACKBED_PREFILL_WGMMA_MIN_ROWS overrides)."""
    env = os.environ.get("RACKBED_PREFILL_WGMMA_MIN_ROWS")
    bound = float(env) if env else PREFILL_WGMMA_MIN_MEAN_ROWS
    return bound is not None and n_rows >= bound * max(n_experts, 1)


def wgmma_unsupported(x, gate_up, down, counts) -> str | None:
    """Why the wgmma prefill kernel cannot run both GEMMs of the SwiGLU here (None when it can)."""
    from rackbed.kernels import grouped_gemm_wgmma as gw

    why = cute_unavailable() or gw.kernel_unsupported(x, gate_up, counts)
    if why:
        return why
    _, D, F = down.shape
    why = gw.shape_unsupported(x.shape[0], D, F, fp8=False)
    if why is None and (not down.is_contiguous() or down.data_ptr() % 16):
        why = "down must be contiguous and 16-byte aligned"
    return why


def grouped_swiglu_wgmma(x, gate_up, down, counts):
    """Prefill path: gate_up on the wgmma kernel, SwiGLU in torch, down on the wgmma kernel (bf16)."""
    import torch.nn.functional as F_

    from rackbed.kernels import grouped_gemm_wgmma as gw

    R, E, D, F = check_swiglu_args(x, gate_up, down, counts)
    offs = gw.tile_offsets(counts)
    gu = gw.grouped_mm(x, gate_up, counts, offsets=offs)  # [R, 2F]
    a = (F_.silu(gu[:, :F]) * gu[:, F:]).contiguous()
    return gw.grouped_mm(a, down, counts, offsets=offs)  # [R, D]


def grouped_swiglu(x, gate_up, down, counts, *, impl: str = "auto"):
    """Drop-in for engine.real.model.grouped_swiglu (see the module docstring for shapes and ``impl``)."""
    if impl not in IMPLS:
        raise ValueError(f"grouped_swiglu: impl={impl!r} must be one of {', '.join(IMPLS)}")
    R, E, _, _ = check_swiglu_args(x, gate_up, down, counts)
    if impl == "auto":
        impl = pick_decode_impl(R, E)
        if impl != "torch":
            if cute_unavailable() is not None:
                impl = "torch"
            elif (mma_unsupported if impl == "cute_mma" else decode_kernel_unsupported)(x, gate_up, down):
                impl = "torch"
        if impl == "torch" and use_prefill_wgmma(R, E) and wgmma_unsupported(x, gate_up, down, counts) is None:
            impl = "wgmma"
    if impl == "wgmma":
        return grouped_swiglu_wgmma(x, gate_up, down, counts)
    if impl == "cute_gemv":
        return grouped_swiglu_cute(x, gate_up, down, counts)
    if impl == "cute_mma":
        return grouped_swiglu_mma(x, gate_up, down, counts)
    return grouped_swiglu_torch(x, gate_up, down, counts)


def swiglu_weight_bytes(counts_list, D: int, F: int, elem_bytes: int = 2) -> int:
    """Fewest bytes a decode grouped SwiGLU must read: each active expert's gate_up [2F, D] and down [D, F] once."""
    active = sum(1 for c in counts_list if c)
    return active * 3 * F * D * elem_bytes


def swiglu_flops(n_rows: int, D: int, F: int) -> int:
    """FLOPs of the grouped SwiGLU on n_rows rows: 2*R*D*2F (gate_up) + 2*R*F*D (down)."""
    return 6 * n_rows * D * F
