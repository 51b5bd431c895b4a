"""GEMM and grouped (MoE) GEMM time: a tiled roofline with format-aware rates and bytes.

Shapes: a GEMM computes ``out[M, N] = act[M, K] @ weight[K, N]``; for MoE, M is the number of tokens routed to
one expert (``tokens per expert``), N / K are the expert's projection sizes (gate+up: N = 2 * moe_intermediate,
K = hidden; down: N = hidden, K = moe_intermediate). A grouped GEMM runs all experts' GEMMs in one kernel.

Model (per kernel, all experts together):

* **tiles**: every expert with ``m > 0`` tokens contributes ``ceil(m / BLOCK_M) * ceil(N / BLOCK_N)`` CTA tiles
  (``constants.GEMM_TILE``: M = 64 on Hopper wgmma, 128 on Blackwell tcgen05). Padding M up to BLOCK_M is the
  *tile quantisation* that makes tiny-M GEMMs waste tensor-core work;
* **compute**: tiles run in ``ceil(tiles / sm_count)`` waves (wave quantisation / tail), one tile taking
  ``2 * BLOCK_M * BLOCK_N * K`` FLOPs at ``peak * efficiency / sm_count`` — peak is the GPU's dense rate for the
  format *it actually executes* (see :func:`format_execution`), efficiency ``constants.MMA_EFFICIENCY``;
* **memory**: bytes = weights of every active expert (``N * K * bytes_per_element(fmt, "weight")``, scales
  included) + activations in (``M * K * bytes(act format)``) + outputs (``M * N * 2``, bf16), streamed at the
  achievable HBM rate — but no faster than one CTA per distinct weight slice (expert x N-tile) can pull it at
  ``PER_SM_BW_FACTOR x`` the fair per-SM share: a kernel over a handful of experts has too few slices to
  saturate HBM, so 2 experts per rank cost about as much as 4 (the "weight-streaming floor" of a few experts);
* **time** = max(compute, memory) + fixed cost (launch, pipeline fill, epilogue; grouped: + scheduler setup).

Efficiency therefore falls at small M by construction: tile padding, few CTAs, and the fixed cost — no fitted
curve. A calibration table (kind ``gemm_tflops``, key fmt / n / k, x = mean tokens per active expert) replaces
the whole estimate with ``flops / measured TFLOP/s``.

Formats. Blackwell runs MXFP8 / MXFP6 / MXFP4 / NVFP4 natively on its tensor cores. **Hopper has no MX or FP4
tensor cores**: MXFP8 runs on the FP8 tensor cores with its E8M0 block scales applied in the main loop, and the
4/6-bit formats run as weight-only quantisation (packed weights read from HBM — the byte saving stays —,
dequantised to FP8 in registers, FP8 activations): see ``constants.HOPPER_EMULATION``. The chosen execution is
reported in ``GemmCost.exec_format`` and ``GemmCost.note``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache

from rackbed.engine.core.formats import get_format
from rackbed.sim.costs import constants as C
from rackbed.sim.costs.calibration import CalibrationTable, kernel_fixed_us, lookup
from rackbed.topology.errors import UserError
from rackbed.topology.specs import GpuSpec

#: A compact per-expert token distribution: ``((m, n_experts_with_m_tokens), ...)``, m > 0. Counts may be
#: fractional (expected values from a routing distribution).
ExpertHistogram = tuple[tuple[int, float], ...]


@dataclass(frozen=True, slots=True)
class FormatExec:
    """How weight format ``fmt`` executes on a GPU: the tensor-core format, its dense peak (TFLOP/s), the MMA
    efficiency multiplier, the activation format of the GEMM input, and a note when emulated."""

    fmt: str
    exec_format: str
    peak_tflops: float
    efficiency: float
    act_format: str
    note: str


@dataclass(frozen=True, slots=True)
class GemmCost:
    """One (grouped) GEMM kernel. ``flops`` are useful FLOPs (2*M*N*K summed over experts, no padding);
    ``hbm_bytes`` the bytes read and written; ``compute_s`` / ``memory_s`` the two roofline legs; ``fixed_s`` the
    per-kernel cost; ``total_s = max(compute_s, memory_s) + fixed_s`` (or the calibrated time)."""

    flops: float
    hbm_bytes: float
    compute_s: float
    memory_s: float
    fixed_s: float
    total_s: float
    n_tiles: float
    exec_format: str
    calibrated: bool = False

    @property
    def achieved_tflops(self) -> float:
        return self.flops / self.total_s / 1e12 if self.total_s > 0 else 0.0

    @property
    def bound(self) -> str:
        """"compute" or "memory": the larger roofline leg."""
        return "compute" if self.compute_s >= self.memory_s else "memory"

    def __add__(self, other: GemmCost) -> GemmCost:
        return GemmCost(self.flops + other.flops, self.hbm_bytes + other.hbm_bytes,
                        self.compute_s + other.compute_s, self.memory_s + other.memory_s,
                        self.fixed_s + other.fixed_s, self.total_s + other.total_s, self.n_tiles + other.n_tiles,
                        self.exec_format if self.exec_format == other.exec_format else "mixed",
                        self.calibrated or other.calibrated)


ZERO_GEMM = GemmCost(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, "none")


@lru_cache(maxsize=256)
def format_execution(gpu: GpuSpec, fmt: str) -> FormatExec:
    """The execution of weight format ``fmt`` on ``gpu`` (native, or emulated on Hopper; module docstring)."""
    get_format(fmt)  # validates the name
    arch = gpu.arch
    native = gpu.dense_tflops.get(fmt)
    effs = C.MMA_EFFICIENCY[arch]
    if native is not None:
        return FormatExec(fmt, fmt, native, effs.get(fmt, effs["bf16"]), fmt, "native")
    if arch == "hopper" and fmt in C.HOPPER_EMULATION:
        exec_fmt, mult = C.HOPPER_EMULATION[fmt]
        peak = gpu.dense_tflops.get(exec_fmt)
        act = C.HOPPER_ACTIVATION_FORMAT[fmt]
        note = (f"{fmt} has no tensor-core support on {gpu.name} (Hopper): runs as {exec_fmt} after "
                f"dequantisation (x{mult} MMA efficiency), weights read as {fmt}")
        return FormatExec(fmt, exec_fmt, peak, effs[exec_fmt] * mult, act, note)
    raise UserError(f"format {fmt!r} is not supported on {gpu.name} and has no emulation path")


_FE: dict[tuple[int, str], tuple[GpuSpec, FormatExec]] = {}


def _format_exec(gpu: GpuSpec, fmt: str) -> FormatExec:
    """:func:`format_execution` keyed on the spec object's identity (its lru_cache hashes the pydantic spec)."""
    hit = _FE.get((id(gpu), fmt))
    if hit is not None and hit[0] is gpu:
        return hit[1]
    fe = format_execution(gpu, fmt)
    if len(_FE) > 256:
        _FE.clear()
    _FE[(id(gpu), fmt)] = (gpu, fe)
    return fe


@lru_cache(maxsize=64)
def _bpe(fmt: str, role: str) -> float:
    return get_format(fmt).bytes_per_element(role)


def hbm_rate_Bps(gpu: GpuSpec, n_bytes: float = 0.0, calib: CalibrationTable | None = None) -> float:
    """Achievable HBM bandwidth (B/s) for a streaming kernel moving ``n_bytes``: calibration kind ``hbm_GBps``
    when present, else datasheet × ``constants.HBM_EFFICIENCY``."""
    measured = lookup(calib, "hbm_GBps", gpu.name, max(n_bytes, 1.0))
    if measured is not None:
        return measured * 1e9
    return gpu.hbm_GBps * 1e9 * C.HBM_EFFICIENCY[gpu.arch]


def histogram(tokens_per_expert: Iterable[float]) -> ExpertHistogram:
    """``[5, 0, 5, 3]`` -> ``((3, 1), (5, 2))``: distinct nonzero token counts and how many experts have them."""
    out: dict[int, float] = {}
    for m in tokens_per_expert:
        if m < 0:
            raise UserError(f"tokens per expert must be >= 0, got {m}")
        if m:
            out[int(m)] = out.get(int(m), 0) + 1
    return tuple(sorted(out.items()))


def grouped_gemm_time(gpu: GpuSpec, tokens_per_expert: Sequence[int] | ExpertHistogram, n: int, k: int,
                      fmt: str = "bf16", *, calib: CalibrationTable | None = None,
                      grouped: bool = True) -> GemmCost:
    """One grouped GEMM kernel over experts: per expert ``out[m_e, n] = act[m_e, k] @ W_e[k, n]``.

    ``tokens_per_expert``: per-expert token counts (zeros = inactive experts, skipped: an inactive expert's weights
    are not read) or an :data:`ExpertHistogram`. ``fmt``: the weight format. Seconds and breakdown in the result.
    """
    if tokens_per_expert and isinstance(next(iter(tokens_per_expert)), tuple):
        hist = tuple(tokens_per_expert)  # type: ignore[arg-type]
    else:
        hist = histogram(tokens_per_expert)  # type: ignore[arg-type]
    return _grouped(gpu, hist, int(n), int(k), fmt, calib, grouped)


def gemm_time(gpu: GpuSpec, m: int, n: int, k: int, fmt: str = "bf16", *,
              calib: CalibrationTable | None = None) -> GemmCost:
    """A plain GEMM ``[m, k] @ [k, n]`` (``m`` tokens) with weights in ``fmt``."""
    if m <= 0:
        return ZERO_GEMM
    return _grouped(gpu, ((int(m), 1.0),), int(n), int(k), fmt, calib, False)


_FRONT: dict[tuple, tuple[GpuSpec, GemmCost]] = {}


def _grouped(gpu: GpuSpec, hist: ExpertHistogram, n: int, k: int, fmt: str, calib: CalibrationTable | None,
             grouped: bool) -> GemmCost:
    if n <= 0 or k <= 0:
        raise UserError(f"GEMM sizes must be > 0, got n={n}, k={k}")
    # _grouped_cached's lru_cache hashes the GpuSpec (a pydantic model: a recursive hash of all its fields, the
    # larger part of a cache hit); this front memo keys on the spec object's identity instead
    key = (id(gpu), hist, n, k, fmt, grouped)
    hit = _FRONT.get(key)
    if hit is not None and hit[0] is gpu:
        base = hit[1]
    else:
        base = _grouped_calc(gpu, hist, n, k, fmt, grouped)
        if len(_FRONT) > 65536:
            _FRONT.clear()
        _FRONT[key] = (gpu, base)
    if calib is None:
        return base
    n_exp = sum(c for _, c in hist)
    if not n_exp:
        return base
    mean_m = sum(m * c for m, c in hist) / n_exp
    tflops = calib.lookup("gemm_tflops", gpu.name, mean_m, fmt=fmt, n=n, k=k)
    if tflops is None:
        # the first-principles estimate, with the calibrated per-kernel fixed cost in place of KERNEL_FIXED_US
        d = (kernel_fixed_us(calib, gpu) - C.KERNEL_FIXED_US) * 1e-6
        if d == 0.0:
            return base
        return GemmCost(base.flops, base.hbm_bytes, base.compute_s, base.memory_s, base.fixed_s + d,
                        base.total_s + d, base.n_tiles, base.exec_format)
    t = base.flops / (tflops * 1e12)
    return GemmCost(base.flops, base.hbm_bytes, base.compute_s, base.memory_s, 0.0, t, base.n_tiles,
                    base.exec_format, calibrated=True)


def _grouped_calc(gpu: GpuSpec, hist: ExpertHistogram, n: int, k: int, fmt: str, grouped: bool) -> GemmCost:
    fe = _format_exec(gpu, fmt)
    # plain loops instead of three sum(generator) passes: the same additions in the same order (a new prefill
    # batch misses the memos with several GEMMs)
    n_exp = 0
    tokens = 0
    for m, c in hist:
        n_exp += c
        tokens += m * c
    if n_exp <= 0:
        return ZERO_GEMM
    bm, bn = C.GEMM_TILE[gpu.arch]
    tiles_n = math.ceil(n / bn)
    tiles = 0
    for m, c in hist:
        tiles += math.ceil(m / bm) * c
    tiles = tiles * tiles_n
    flops = 2.0 * tokens * n * k
    sm = gpu.sm_count
    # split-K for plain GEMMs with fewer tiles than SMs (cuBLAS / CUTLASS split-K or stream-K); grouped MoE
    # kernels (CUTLASS grouped GEMM, as the write-up uses) do not split K.
    split = 1 if grouped or tiles >= sm else max(1, min(sm // max(int(tiles), 1), k // C.SPLIT_K_MIN_K))
    per_sm_flops = fe.peak_tflops * 1e12 * fe.efficiency / sm
    tile_s = 2.0 * bm * bn * k / per_sm_flops / split
    compute_s = math.ceil(tiles * split / sm - 1e-9) * tile_s
    hbm_bytes = (n_exp * n * k * _bpe(fmt, "weight") + tokens * k * _bpe(fe.act_format, "activation")
                 + tokens * n * 2.0)
    hbm = gpu.hbm_GBps * 1e9 * C.HBM_EFFICIENCY[gpu.arch]
    # every distinct weight slice (expert, N-tile, K-split) is streamed by one CTA at most at PER_SM_BW_FACTOR x
    # the fair per-SM share of HBM: with few slices (a handful of experts) the kernel cannot saturate HBM
    slices = n_exp * tiles_n * split
    slice_bytes = bn * k * _bpe(fmt, "weight") / split
    per_sm_bw = C.PER_SM_BW_FACTOR * hbm / sm
    memory_s = max(hbm_bytes / hbm, math.ceil(slices / sm - 1e-9) * slice_bytes / per_sm_bw)
    fixed_s = (C.KERNEL_FIXED_US + (C.GROUPED_GEMM_EXTRA_US if grouped else 0.0)) * 1e-6
    return GemmCost(flops, hbm_bytes, compute_s, memory_s, fixed_s, max(compute_s, memory_s) + fixed_s, tiles,
                    fe.exec_format)


_grouped_cached = lru_cache(maxsize=65536)(_grouped_calc)  # the memo by value (_grouped's is by spec identity)


@dataclass(frozen=True, slots=True)
class ExpertMlpCost:
    """The routed-expert MLP of one MoE layer on one rank: gate+up grouped GEMM, then down grouped GEMM
    (SwiGLU fused into the first kernel's epilogue)."""

    gate_up: GemmCost
    down: GemmCost

    @property
    def total_s(self) -> float:
        return self.gate_up.total_s + self.down.total_s

    @property
    def flops(self) -> float:
        return self.gate_up.flops + self.down.flops

    @property
    def hbm_bytes(self) -> float:
        return self.gate_up.hbm_bytes + self.down.hbm_bytes


def expert_mlp_time(gpu: GpuSpec, hidden: int, intermediate: int,
                    tokens_per_expert: Sequence[int] | ExpertHistogram, fmt: str = "bf16", *,
                    calib: CalibrationTable | None = None) -> ExpertMlpCost:
    """Routed experts of one layer on one rank: ``[m_e, hidden] -> [m_e, 2*intermediate] -> [m_e, hidden]``."""
    if tokens_per_expert and isinstance(next(iter(tokens_per_expert)), tuple):
        hist = tuple(tokens_per_expert)  # type: ignore[arg-type]
    else:
        hist = histogram(tokens_per_expert)  # type: ignore[arg-type]
    return ExpertMlpCost(_grouped(gpu, hist, 2 * intermediate, hidden, fmt, calib, True),
                         _grouped(gpu, hist, hidden, intermediate, fmt, calib, True))


def binomial_histogram(n_tokens: float, p: float, n_experts: int, max_bins: int = 12) -> ExpertHistogram:
    """Expected per-expert token histogram (see :func:`_binomial_histogram`), memoised."""
    return _binomial_histogram(round(n_tokens), float(p), int(n_experts), int(max_bins))


@lru_cache(maxsize=8192)
def _binomial_histogram(n_tokens: int, p: float, n_experts: int, max_bins: int) -> ExpertHistogram:
    """Expected per-expert token histogram when each of ``n_tokens`` tokens lands on a given expert independently
    with probability ``p`` (uniform top-k routing: p = top_k / n_experts), over ``n_experts`` local experts.

    Small means: the exact binomial pmf for m = 1.. (tail mass folded into the last bin). Large means: ``max_bins``
    equal-probability bins at the normal quantiles (mean ± sd). Counts are expected numbers of experts.
    """
    if n_tokens <= 0 or n_experts <= 0 or p <= 0:
        return ()
    p = min(p, 1.0)
    mean = n_tokens * p
    if mean <= 8 or n_tokens <= 64:
        out, pm, cum = [], (1 - p) ** n_tokens, 0.0
        cum += pm
        for m in range(1, n_tokens + 1):
            pm = pm * (n_tokens - m + 1) / m * p / (1 - p) if p < 1 else (1.0 if m == n_tokens else 0.0)
            if m == max_bins * 2 or m == n_tokens or cum + pm > 1 - 1e-6:
                out.append((m, n_experts * (1 - cum)))
                break
            out.append((m, n_experts * pm))
            cum += pm
        return tuple((m, c) for m, c in out if c > 1e-9)
    sd = math.sqrt(n_tokens * p * (1 - p))
    from statistics import NormalDist

    nd = NormalDist()
    out: dict[int, float] = {}
    for i in range(max_bins):
        z = nd.inv_cdf((i + 0.5) / max_bins)
        m = max(1, round(mean + z * sd))
        out[m] = out.get(m, 0.0) + n_experts / max_bins
    return tuple(sorted(out.items()))
