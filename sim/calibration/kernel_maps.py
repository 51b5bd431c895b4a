"""Curves priced per kernel: dense GEMMs and decode attention whose measurement recorded which kernel the library
runs at each x (``gemm_kernels`` / ``attn_kernels`` rows of ``kernels/bench/measure.py``, and ``gemm_forced`` rows: a
kernel the library picks at one or two m, timed by choice at neighbouring m).

A dense GEMM is priced per (kernel, M tiles) block from its fit points (:func:`kernel_block_times`,
:func:`fit_dense_with_map`); decode attention per kernel run, piecewise linear in the context it works on
(:func:`decode_run_times`, :func:`fit_decode_with_map`). Both tabulate the result so that
``CalibrationEntry.interpolate`` reproduces it (:func:`tabulate_exact`) and fall back to the curve's form
(:mod:`sim.calibration.forms`) where the map has no fit point to go by.
"""

from __future__ import annotations

import bisect
import math
import re
from collections import defaultdict
from dataclasses import dataclass

from rackbed.sim.calibration.forms import choose_form, fit_curve, geomean, sig
from rackbed.sim.costs.calibration import CalibrationEntry
from rackbed.topology.errors import UserError

# ---------------------------------------------------------------------------------------- dense GEMMs by kernel

#: the tile of a cuBLAS (nvjet) / CUTLASS Hopper kernel name, ``..._{BN}x{BM}_{BK}x{stages}_...``: in the TN calls
#: of ``kernels/bench/measure.py`` the second number tiles the token dimension m (``192x8`` runs m <= 8, ``192x16`` m 9-16)
_TILE_RE = re.compile(r"_(\d+)x(\d+)_(\d+)x(\d+)_")
#: fit points of a dense GEMM curve with a kernel map that its fallback form is fitted on: the fit point nearest to
#: each of this many targets per octave (the leave-one-out form choice is quadratic in the points)
KERNEL_FALLBACK_PER_OCTAVE = 4
#: the tabulated kernel-map curve reproduces the block model within this relative error at every integer m
KERNEL_TAB_TOL = 0.005


def kernel_tile(name: str) -> tuple[int, int] | None:
    """``(BN, BM)`` of a GEMM kernel's name (the first of ``" + "``-joined kernels), or None if it names none."""
    m = _TILE_RE.search(name.split(" + ")[0])
    return (int(m.group(1)), int(m.group(2))) if m else None


@dataclass(frozen=True)
class KernelMap:
    """Which kernel a dense GEMM runs at each token count ``m`` (a ``gemm_kernels`` row of ``kernels/bench/measure.py``:
    ``runs = [[m_first, m_last, kernels], ...]``), for ``m = 1 .. full`` (every m recorded)."""

    runs: tuple[tuple[int, int, str], ...]

    @property
    def full(self) -> int:
        """The largest L with every m in 1..L inside a run (0 if m = 1 is not). A run spans the m between the
        recorded ends it joins (one kernel at both): FP8's single kernel covers 1..16384 from a map recorded at
        every m to 1024 and every 64 above, so its blocks above 1024 are priced from the same kernel's fit points."""
        top = 0
        for a, b, _ in self.runs:
            if a > top + 1:
                break
            top = max(top, b)
        return top

    def kernel(self, m: int) -> str | None:
        i = bisect.bisect_right([a for a, _, _ in self.runs], m) - 1
        if i < 0 or m > self.runs[i][1]:
            return None
        return self.runs[i][2]

    def block(self, m: int) -> tuple[str, int] | None:
        """``(kernel, M tiles)``: the m with equal blocks run the same kernel over the same number of M tiles."""
        k = self.kernel(m)
        return None if k is None else (k, m_tiles(k, m))


def m_tiles(kernel: str, m: int) -> int:
    """How many M tiles ``kernel`` (its name, :func:`kernel_tile`) covers at ``m`` tokens (0: no tile in the name)."""
    t = kernel_tile(kernel)
    return math.ceil(m / t[1]) if t else 0


def kernel_maps(rows: list[dict]) -> dict[tuple, KernelMap]:
    """The ``gemm_kernels`` rows (``kernels/bench/measure.py``) by their dense curve's key ``(fmt, n, k)`` (as
    :func:`~sim.calibration.measurements.curve_of` keys it)."""
    out = {}
    for r in rows:
        if r.get("bench") == "gemm_kernels" and not r.get("error") and r.get("runs"):
            key, runs = _map_row(r, f"gemm_kernels row {r.get('fmt')}/{r.get('shape')}", "fmt, n, k", "m",
                                 lambda: (("fmt", r["fmt"]), ("n", int(r["n"])), ("k", int(r["k"]))))
            out[key] = KernelMap(runs)
    return out


def _map_row(r: dict, label: str, fields: str, x: str, key_of) -> tuple[tuple, tuple[tuple[int, int, str], ...]]:
    """``(key_of(), runs)`` of a kernel-map row (``gemm_kernels`` / ``attn_kernels``), or one UserError naming the
    row when a field is missing or the runs are not increasing, non-overlapping ``[x_first, x_last, kernels]``."""
    try:
        key = key_of()
        runs = tuple((int(a), int(b), str(kn)) for a, b, kn in r["runs"])
    except (KeyError, TypeError, ValueError) as exc:
        raise UserError(f"{label}: needs {fields} and runs of [{x}_first, {x}_last, kernel] "
                        f"({type(exc).__name__}: {exc})") from exc
    if any(a > b for a, b, _ in runs) or any(r0[1] >= r1[0] for r0, r1 in zip(runs, runs[1:])):
        raise UserError(f"{label}: runs must be increasing, non-overlapping [{x}_first, {x}_last] ranges")
    return key, runs


def forced_points(rows: list[dict]) -> dict[tuple, dict[tuple[str, tuple[int, ...]], dict[int, float]]]:
    """The ``gemm_forced`` rows (``kernels/bench/measure.py``: the kernel of a choice the library makes at one or two m,
    timed at other m by choice) as ``{curve key (fmt, n, k): {(kernels, library m): {m: seconds}}}``. Rows with
    errors and the ``check`` rows (the forced kernel where the library itself runs it, a duplicate of the library's
    own row) are not read; a merged file's repeats of one point are averaged geometrically."""
    acc: dict[tuple, dict[tuple, dict[int, list[float]]]] = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    for r in rows:
        if r.get("bench") != "gemm_forced" or r.get("error") or r.get("check") or not r.get("median_us"):
            continue
        try:
            key = (("fmt", r["fmt"]), ("n", int(r["n"])), ("k", int(r["k"])))
            cfg = (str(r["kernel"]), tuple(sorted(int(x) for x in r["library_m"])))
            acc[key][cfg][int(r["m"])].append(float(r["median_us"]) * 1e-6)
        except (KeyError, TypeError, ValueError) as exc:
            raise UserError(f"gemm_forced row {r.get('shape')}/m{r.get('m')}: needs fmt, n, k, m, kernel, "
                            f"library_m and median_us ({type(exc).__name__}: {exc})") from exc
    return {key: {cfg: {m: geomean(ts) for m, ts in by_m.items()} for cfg, by_m in cfgs.items()}
            for key, cfgs in acc.items()}


def kernel_block_times(kmap: KernelMap, n: int, pts: dict[int, float], fallback, sm_count: int = 132,
                       forced: dict[tuple[str, tuple[int, ...]], dict[int, float]] | None = None) -> list[float]:
    """The time (s) of a dense GEMM at every ``m = 1 .. kmap.full`` from its timed fit points ``pts`` (m -> s) and
    the kernel each m runs (index 0 is m = 1). A GEMM's time is set by its kernel and how many M tiles that kernel
    covers (its *block*, :meth:`KernelMap.block`); within a block it varies smoothly with m (FP8's 128-row tiles run
    a saw-tooth: time falls as the last tile fills).

    ``forced`` (:func:`forced_points`: ``(kernels, library m) -> {m: s}``): the kernel of a choice the library makes
    at the m of ``library m`` only, timed by choice at other m. Such a choice is a configuration of its own (the same
    kernel can run with other launch parameters at its other m): the library's points at ``library m`` and the
    forced points form its blocks, and price nothing else (never the library's time at a forced point's m, even where
    the library runs the same kernel there). Below, "kernel" is the configuration. In order:

    1. fit points in the same block: linear in m between the two around it; beyond the block's fit points the
       least-squares line through them (three or more) or the nearest one's time (v7: a line through the two
       nearest of an alternating +-3 % block missed a held-out end by 13 %);
    2. fit points of the same kernel in other blocks: the nearest one's time scaled by the ratio of waves,
       ``ceil(ceil(n / BN) * ceil(m / BM) / sm_count)``;
    3. ``fallback(m)``: the curve's form fitted without the map (``fit_curve``). (A kernel no fit point ran, priced
       by its waves of tiles at the nearest fit points' speed per tile, was tried: worse, up to +130 %; split-K
       and memory-bound kernels do not scale with tile area. The two fit points either side of m, whatever their
       kernels, were tried on v7: the worst held-out row went from 18 % to 31 % (m = 152 of the TP2 QKV GEMM).)
    """
    L = kmap.full
    forced = forced or {}
    cfg_at = {m: cfg for cfg in forced for m in cfg[1] if kmap.kernel(m) == cfg[0]}

    def config(m: int) -> tuple[str, tuple[int, ...]]:
        return cfg_at.get(m) or (kmap.kernel(m), ())

    def block(cfg, m: int) -> tuple:  # KernelMap.block, per configuration
        return (cfg, m_tiles(cfg[0], m))

    timed: dict[tuple, float] = {}  # (configuration, m) -> s
    for m in pts:
        if 1 <= m <= L:
            timed[(config(m), m)] = pts[m]
    for cfg, by_m in forced.items():
        for m, t in by_m.items():
            if 1 <= m <= L and m not in cfg[1]:
                timed[(cfg, m)] = t
    by_block: dict[tuple, list[int]] = defaultdict(list)
    by_kernel: dict[tuple, list[int]] = defaultdict(list)
    for cfg, m in sorted(timed, key=lambda cm: (cm[1], cm[0])):
        by_block[block(cfg, m)].append(m)
        by_kernel[cfg].append(m)

    def waves(m: int, tile) -> int:
        return math.ceil(math.ceil(n / tile[0]) * math.ceil(m / tile[1]) / sm_count)

    out = []
    for m in range(1, L + 1):
        kn = config(m)
        b = block(kn, m)
        same = by_block.get(b, ())
        if len(same) >= 2 and same[0] <= m <= same[-1]:
            j = min(max(bisect.bisect_left(same, m), 1), len(same) - 1)  # the bracketing pair
            m0, m1 = same[j - 1], same[j]
            t0, t1 = timed[(kn, m0)], timed[(kn, m1)]
            out.append(t0 + (t1 - t0) * (m - m0) / (m1 - m0))
        elif len(same) >= 3:  # beyond the block's fit points: the least-squares line through them
            out.append(_ls_line(same, [timed[(kn, x)] for x in same], m))
        elif same:  # one or two: the nearest (a line through two noisy neighbours amplifies their noise)
            out.append(timed[(kn, min(same, key=lambda x: (abs(x - m), x)))])
        elif by_kernel.get(kn) and (tile := kernel_tile(kn[0])):
            mk = min(by_kernel[kn], key=lambda x: (abs(x - m), x))
            out.append(timed[(kn, mk)] * waves(m, tile) / waves(mk, tile))
        else:
            out.append(fallback(m))
    return out


def _ls_line(xs: list[float], ys: list[float], x: float) -> float:
    """The least-squares line through ``(xs, ys)`` at ``x``, kept within a factor 2 of the ``ys``."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((a - mx) ** 2 for a in xs)
    slope = sum((a - mx) * (b - my) for a, b in zip(xs, ys)) / sxx if sxx > 0 else 0.0
    return min(max(my + slope * (x - mx), 0.5 * min(ys)), 2.0 * max(ys))


def tabulate_exact(ys: list[float], tol: float = KERNEL_TAB_TOL, keep: set[int] = frozenset(),
                   xs: list[float] | None = None) -> list[int]:
    """Indices of ``ys`` (values at ``xs``, default x = index + 1) to tabulate so that linear interpolation in
    log x between them (``CalibrationEntry.interpolate``) reproduces every value within ``tol``: both sides of
    every change of slope sign or jump, then the worst-reproduced index until none is off by more than ``tol``."""
    n = len(ys)
    lx = [math.log(i + 1) for i in range(n)] if xs is None else [math.log(x) for x in xs]
    kept = {0, n - 1, *(i for i in keep if 0 <= i < n)}
    for i in range(1, n):
        if abs(ys[i] - ys[i - 1]) > tol * ys[i - 1]:
            kept.update((i - 1, i))
    while True:
        ks = sorted(kept)
        worst, wi = tol, None
        for a, b in zip(ks, ks[1:]):
            la, lb = lx[a], lx[b]
            for i in range(a + 1, b):
                y = ys[a] + (ys[b] - ys[a]) * (lx[i] - la) / (lb - la)
                e = abs(y - ys[i]) / ys[i]
                if e > worst:
                    worst, wi = e, i
        if wi is None:
            return ks
        kept.add(wi)


def thin(xs: list[float], per_octave: int = KERNEL_FALLBACK_PER_OCTAVE) -> set[float]:
    """The x values nearest to a geometric grid of ``per_octave`` targets per octave over ``xs`` (and both ends)."""
    lo, hi = xs[0], xs[-1]
    keep = {lo, hi}
    j = 0
    while (t := lo * 2 ** (j / per_octave)) <= hi:
        keep.add(min(xs, key=lambda x: (abs(math.log(x / t)), x)))
        j += 1
    return keep


def fit_dense_with_map(kind: str, xy: list[tuple[float, float]], kmap: KernelMap, n: int, k: int, shape: dict,
                       sm_count: int = 132, forced: dict[tuple[str, tuple[int, ...]], dict[int, float]] | None = None,
                       ) -> tuple[tuple[tuple[float, float], ...], str]:
    """Tabulated ``gemm_tflops`` points of a dense GEMM curve with a kernel map: :func:`kernel_block_times` at every
    m up to the map's ``full``, the form fitted on a thinned set of fit points (:func:`thin`) above it and as the
    last resort inside. Returns ``(points, description)``."""
    flops = lambda m: 2.0 * m * n * k
    xs = [x for x, _ in xy]
    keep = thin(xs)
    sub = [(x, y) for x, y in xy if x in keep]
    form = choose_form(kind, sub, shape, sm_count)
    fb_pts = fit_curve(kind, sub, form)
    fb = CalibrationEntry(kind="gemm_tflops", gpu="-", points=fb_pts)
    pts = {int(x): flops(x) / (y * 1e12) for x, y in xy if float(x).is_integer()}
    L = kmap.full
    forced = {cfg: used for cfg, by_m in (forced or {}).items() if any(kmap.kernel(m) == cfg[0] for m in cfg[1])
              if (used := {m: t for m, t in by_m.items() if 1 <= m <= L and m not in cfg[1]})}
    ts = kernel_block_times(kmap, n, pts, lambda m: flops(m) / (fb.interpolate(m) * 1e12), sm_count, forced)
    ys = [flops(m) / t / 1e12 for m, t in zip(range(1, L + 1), ts)]  # tflops, tabulated as the rate
    idx = tabulate_exact(ys, keep={int(x) - 1 for x in pts if x <= L})
    points = [(float(i + 1), sig(ys[i])) for i in idx] + [(x, y) for x, y in fb_pts if x > L]
    nf = sum(len(v) for v in forced.values())
    desc = (f"kernel map: {len(kmap.runs)} kernel runs over m = 1..{L}, per (kernel, M tiles) block "
            f"through the fit points{f' and {nf} forced-kernel points of {len(forced)} short runs' if nf else ''}; "
            f"above and without a block: {form.describe()}")
    return tuple((float(sig(x, 9)), float(y)) for x, y in points), desc


# ------------------------------------------------------------------------------- decode attention by kernel

#: the tile of a cuDNN / flash SDPA kernel name, ``_{Br}x{Bc}x{D}_``: Bc is the KV block a CTA walks
_ATTN_TILE_RE = re.compile(r"_(\d+)x(\d+)x(\d+)_")
#: the launch grid ``kernels/bench/measure.py`` appends to each kernel name of an ``attn_kernels`` row
_GRID_RE = re.compile(r"<<<(\d+),(\d+),(\d+)>>>")


def attn_maps(rows: list[dict]) -> dict[tuple, tuple[tuple[int, int, str], ...]]:
    """The ``attn_kernels`` rows (``kernels/bench/measure.py``) by their decode curve's key ``(head_dim, seq_heads)``
    (as :func:`~sim.calibration.measurements.curve_of` keys it): runs ``(ctx_first, ctx_last, kernels with
    grids)``."""
    out = {}
    for r in rows:
        if r.get("bench") == "attn_kernels" and not r.get("error") and r.get("runs"):
            key, runs = _map_row(r, f"attn_kernels row b{r.get('batch')}", "batch, n_kv_heads, head_dim", "ctx",
                                 lambda: (("head_dim", int(r["head_dim"])),
                                          ("seq_heads", int(r["batch"]) * int(r["n_kv_heads"]))))
            out[key] = runs
    return out


def decode_work_x(kernels: str, ctx: float, sm_count: int = 132) -> float:
    """The context a decode-attention kernel's time is piecewise linear in, within one kernel run (same kernels,
    same grid): with no more CTAs than SMs (one wave; a CTA's time is its KV blocks) the context rounded up to
    whole KV blocks ``Bc`` of the kernel's tile — SDPA at batch 1 takes as long at 432 as at 512 tokens; with more,
    the context itself (the partial last block is partial work). Measured (v7): the rule is what keeps the run's
    held-out rows within 8 % at batch 1-256."""
    g = _GRID_RE.search(kernels)
    t = _ATTN_TILE_RE.search(kernels.split(" + ")[0])
    if g and t and int(g.group(1)) * int(g.group(2)) * int(g.group(3)) <= sm_count:
        bc = int(t.group(2))
        return float(math.ceil(ctx / bc) * bc)
    return float(ctx)


def decode_map_grid(runs: tuple[tuple[int, int, str], ...]) -> list[int]:
    """The contexts a decode kernel map recorded inside its runs (``kernels/bench/measure.py`` ``DECODE_MAP_CTX``: every
    16 up to 4096, every 128 above) and the runs' ends."""
    out = set()
    for a, b, _ in runs:
        out.update((a, b))
        out.update(x for x in range(-(-a // 16) * 16, min(b, 4096) + 1, 16))
        out.update(x for x in range(max(-(-a // 128) * 128, 4224), b + 1, 128))
    return sorted(out)


def decode_run_times(runs: tuple[tuple[int, int, str], ...], xs: list[int], pts: dict[int, float], fallback,
                     sm_count: int = 132) -> list[float]:
    """Net time (s) of a decode-attention curve at every context of ``xs`` from its fit points ``pts`` (ctx -> s)
    and the kernel runs of its map: fit points in the same run, piecewise linear in :func:`decode_work_x` (exact at
    a fit point's x, extrapolated from the two nearest at the ends, within a factor 2); a run with fewer than two
    distinct x among its fit points, and a context outside every run: ``fallback(ctx)``."""
    starts = [a for a, _, _ in runs]

    def run_of(x: float) -> int | None:
        i = bisect.bisect_right(starts, x) - 1
        return i if i >= 0 and x <= runs[i][1] else None

    per_run: dict[int, dict[float, list[float]]] = defaultdict(lambda: defaultdict(list))
    for x, t in pts.items():
        i = run_of(x)
        if i is not None:
            per_run[i][decode_work_x(runs[i][2], x, sm_count)].append(t)
    curves = {i: sorted((w, sum(ts) / len(ts)) for w, ts in d.items()) for i, d in per_run.items()}
    out = []
    for x in xs:
        i = run_of(x)
        c = curves.get(i) if i is not None else None
        if not c or len(c) < 2:
            out.append(fallback(x))
            continue
        w = decode_work_x(runs[i][2], x, sm_count)
        ws = [a for a, _ in c]
        j = bisect.bisect_left(ws, w)
        if j < len(ws) and ws[j] == w:
            out.append(c[j][1])
            continue
        j = min(max(j, 1), len(c) - 1)
        (w0, t0), (w1, t1) = c[j - 1], c[j]
        t = t0 + (t1 - t0) * (w - w0) / (w1 - w0)
        out.append(min(max(t, 0.5 * min(t0, t1)), 2.0 * max(t0, t1)))
    return out


def fit_decode_with_map(kind: str, xy: list[tuple[float, float]], runs: tuple[tuple[int, int, str], ...],
                        key: dict, shape: dict, sm_count: int = 132) -> tuple[tuple[tuple[float, float], ...], str]:
    """Tabulated ``decode_attn_GBps`` points of a decode curve with a kernel map: :func:`decode_run_times` at every
    context the map recorded, the curve's form (fitted on all its fit points) outside the map and as the fallback
    inside. Returns ``(points, description)``."""
    kv = lambda x: 4.0 * key["seq_heads"] * key["head_dim"] * x
    form = choose_form(kind, xy, shape, sm_count)
    fb_pts = fit_curve(kind, xy, form)
    fb = CalibrationEntry(kind="decode_attn_GBps", gpu="-", points=fb_pts)
    pts = {int(x): kv(x) / (y * 1e9) for x, y in xy if float(x).is_integer()}
    xs = decode_map_grid(runs)
    ts = decode_run_times(runs, xs, pts, lambda x: kv(x) / (fb.interpolate(x) * 1e9), sm_count)
    ys = [kv(x) / t / 1e9 for x, t in zip(xs, ts)]
    pos = {x: i for i, x in enumerate(xs)}
    idx = tabulate_exact(ys, keep={pos[x] for x in pts if x in pos}, xs=[float(x) for x in xs])
    points = ([(x, y) for x, y in fb_pts if x < xs[0]] + [(float(xs[i]), sig(ys[i])) for i in idx]
              + [(x, y) for x, y in fb_pts if x > xs[-1]])
    desc = (f"kernel map: {len(runs)} kernel runs over ctx = {xs[0]}..{xs[-1]}, per run piecewise linear in the "
            f"context (whole KV blocks when one wave) through the fit points; outside: {form.describe()}")
    return tuple((float(sig(x, 9)), float(y)) for x, y in points), desc

