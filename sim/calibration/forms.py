"""Fitting one calibration curve from its fit points: a physical base form of the time times the interpolated
fit-point residual, tabulated densely for ``CalibrationEntry.interpolate`` (:func:`fit_curve`).

The base form (:class:`Form`) is ``t(x) = max(floor, c + s * w(x))`` with ``w`` the curve's work in quantised units
(waves of GEMM tiles, causal flash blocks, KV blocks, active experts, or a power of x). Which form (and whether the
curve follows the fit points or the form alone) is chosen by leave-one-out over the curve's *fit* points only
(:func:`choose_form` among :func:`candidate_forms`), so held-out rows never steer the fit.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, replace
from functools import lru_cache

RATE_KINDS = ("gemm_tflops", "flash_tflops", "hbm_GBps", "decode_attn_GBps", "nic_GBps")
#: work per unit x of a rate kind up to a constant, as a function of x (time = work(x) / y): GEMM FLOPs are
#: linear in tokens m, causal attention quadratic in the sequence, bytes linear
_WORK_EXP = {"gemm_tflops": 1.0, "flash_tflops": 2.0, "hbm_GBps": 1.0, "decode_attn_GBps": 1.0, "nic_GBps": 1.0}
#: tabulation density of a fitted curve (points per factor of 2 in x)
POINTS_PER_OCTAVE = 8
#: Whether a GEMM curve's *default* base form (:func:`form_for`: curves with fewer than 5 fit points, where no
#: leave-one-out choice is made) is the wave form. Off: with v1 data the bf16 curves were ∝ m at large m (stream-K
#: like). :func:`choose_form` always tries the wave and stream-K forms (:func:`candidate_forms`); on the /2
#: measurements it picks waves for every FP8 curve (an exact 128x128 wave staircase) and stream-K for bf16 ones.
GEMM_WAVES = False
#: CTA tiles (BLOCK_M, BLOCK_N) a GEMM curve's wave model may pick (cuBLAS / CUTLASS Hopper configurations)
GEMM_TILES = ((64, 128), (64, 256), (128, 128), (128, 256), (256, 128))
#: M-tile heights of the stream-K GEMM forms (:class:`Form` ``streamk``)
GEMM_STREAMK_BM = (64, 128, 256)
#: leave-one-out scores closer than this (|error| units, plus ``LOO_REL_TIE`` of the best score) are a tie
#: (:func:`choose_form`): the earlier candidate is kept. Relative part: on the v7 grouped bf16 gate+up curve the
#: form alone beat the same form through the fit points by 0.5 % of the score and missed a held-out dip by 13 %
LOO_TIE = 1e-4
LOO_REL_TIE = 0.02
#: smallest relative jump of a form's work that is tabulated as a step (both sides; smaller ones interpolate)
STEP_MIN_JUMP = 0.03
#: flash-attention query / key block (FA2/FA3 and SDPA's flash backend on Hopper)
FLASH_BLOCK = 128
#: the per-token work of an MoE block's form (``Form.per_token``, in active experts' weights per token) that
#: :func:`choose_form` may pick: the block streams each active expert's weights once, and every token copy also costs
#: its permute / unpermute and its rows of MMA work (v2 H200 measurement: ~0.5 µs per token against ~12 µs per expert)
MOE_PER_TOKEN = (1 / 128, 1 / 64, 1 / 32, 1 / 16, 1 / 8, 1 / 4, 1 / 2, 1.0)
#: KV block lengths a decode-attention curve's block form may pick (split-KV kernels walk the context in blocks:
#: SDPA at batch 16 takes as long at context 432 as at 512, then +50 % at 608)
DECODE_KV_BLOCKS = (64, 128, 256)


@dataclass(frozen=True)
class Form:
    """The physical base form of a curve's time, ``t(x) = max(floor, c + s * w(x))`` (:func:`fit_form`).

    ``w`` is the curve's work in *quantised* units: ``"linear"`` w = x (bytes, tokens of a collective);
    ``"gemm"`` w = waves of CTA tiles, ``ceil(n_experts * ceil(m / bm) * ceil(n / bn) / sm_count)`` (tile and wave
    quantisation: the time of an m that fills a partial wave is the time of the full wave); ``"flash"`` w = causal
    block-pairs per SM, ``max(heads * nb (nb + 1) / 2 / sm_count, nb)`` with ``nb = ceil(s / 128)`` (total work
    spread over the SMs, but never less than the longest CTA's ``nb`` blocks); ``"experts"`` (the ``moe_us`` block)
    w = the expected number of this rank's ``n`` experts that ``x`` uniformly routed tokens reach,
    ``n * (1 - (1 - top_k / experts) ** x)`` (each active expert streams its weights once: the block's time follows
    the active experts at small batch, then its per-token work); ``"power"`` w = x^e (no shape)."""

    work: str = "linear"
    exp: float = 1.0
    n: int = 0
    experts: int = 1
    heads: int = 0
    tile: tuple[int, int] = (128, 128)
    sm_count: int = 132
    #: weight of the interpolated fit-point residual (1: the curve passes through every fit point; 0: the base
    #: form alone, which averages the fit points' jitter instead of following it)
    lam: float = 1.0
    #: GEMM only: stream-K scheduling (the tiles' work is spread evenly over the SMs: no wave ceiling, only the
    #: tile quantisation of m)
    streamk: bool = False
    #: ``"experts"`` only: experts per token (``experts`` is then the model's expert count, ``n`` the rank's), and
    #: the work of one token in units of one active expert's (the block's per-token part: permute, unpermute,
    #: the rows' MMA work), a candidate of ``MOE_PER_TOKEN``
    top_k: int = 0
    per_token: float = 0.0

    def w(self, x: float) -> float:
        if self.work == "gemm":
            bm, bn = self.tile
            tiles = self.experts * math.ceil(x / bm - 1e-9) * math.ceil(self.n / bn)
            return float(tiles / self.sm_count if self.streamk else math.ceil(tiles / self.sm_count - 1e-9))
        if self.work == "loglog":
            return 1.0
        if self.work == "experts":
            return self.n * (1.0 - (1.0 - self.top_k / self.experts) ** x) + self.per_token * x
        if self.work == "kvblocks":  # the context in whole KV blocks of a split-KV decode kernel
            return float(math.ceil(x / self.tile[0] - 1e-9) * self.tile[0])
        if self.work == "flash":
            nb = math.ceil(x / FLASH_BLOCK - 1e-9)
            return max(self.heads * nb * (nb + 1) / 2 / self.sm_count, float(nb))
        return x ** self.exp

    def describe(self) -> str:
        """A short name of the form (recorded in each fitted entry's ``source``)."""
        if self.work == "gemm":
            w = (f"stream-K m-tiles of {self.tile[0]}" if self.streamk
                 else f"waves of {self.tile[0]}x{self.tile[1]} tiles")
        elif self.work == "flash":
            w = f"flash blocks of {FLASH_BLOCK}"
        elif self.work == "kvblocks":
            w = f"KV blocks of {self.tile[0]}"
        elif self.work == "loglog":
            return "form: log-log interpolation of the fit points"
        elif self.work == "experts":
            w = f"active experts of {self.n} (top-{self.top_k} of {self.experts}) + {self.per_token:g} per token"
        else:
            w = f"power x^{self.exp:g}"
        return f"form: {w}, " + ("through the fit points" if self.lam == 1.0 else "form alone")

    def steps(self, lo: float, hi: float) -> list[float]:
        """x values inside ``[lo, hi]`` where ``w`` jumps (tabulated on both sides so the table keeps the steps)."""
        if self.work == "gemm":
            bm = self.tile[0]
            out = []
            for j in range(max(1, int(lo // bm)), int(hi // bm) + 1):
                if self.w(j * bm + 1) > self.w(j * bm) * (1 + STEP_MIN_JUMP):
                    out += [float(j * bm), float(j * bm + 1)]
            return [x for x in out if lo < x < hi]
        if self.work == "kvblocks":
            b = self.tile[0]
            js = range(max(1, int(lo // b)), min(int(hi // b), int(1 / STEP_MIN_JUMP)) + 1)
            return [x for j in js for x in (float(j * b), float(j * b + 1)) if lo < x < hi]
        return []


def form_for(kind: str, shape: dict | None = None, sm_count: int = 132) -> Form:
    """The base form of a curve of ``kind`` (``shape``: GEMM ``n`` / ``n_experts``, attention ``heads``, MoE block
    ``n_experts`` / ``top_k`` / ``n_local``)."""
    shape = shape or {}
    if kind == "gemm_tflops" and shape.get("n") and GEMM_WAVES:
        return Form("gemm", n=int(shape["n"]), experts=int(shape.get("n_experts", 1)), sm_count=sm_count)
    if kind == "flash_tflops" and shape.get("heads"):
        return Form("flash", heads=int(shape["heads"]), sm_count=sm_count)
    if kind == "moe_us" and shape.get("n_experts") and shape.get("top_k"):
        return Form("experts", n=int(shape.get("n_local") or shape["n_experts"]), experts=int(shape["n_experts"]),
                    top_k=int(shape["top_k"]))
    return Form("power", exp=_WORK_EXP.get(kind, 1.0) if kind in RATE_KINDS else 1.0)


def _base(form: Form, p: tuple[float, float, float], x: float) -> float:
    floor, c, s = p
    return max(floor, c + s * form.w(x))


def fit_form(form: Form, xs: list[float], ts: list[float]) -> tuple[float, float, float]:
    """Least-squares fit (in log time) of ``(floor, c, s)`` of ``t = max(floor, c + s * w(x))`` to the points:
    the launch / latency floor, the fixed cost above it, and the time per unit of work (1 / rate)."""
    import numpy as np
    from scipy.optimize import least_squares

    w = np.array([form.w(x) for x in xs])
    t = np.array(ts)
    lt = np.log(t)

    def res(q):
        floor, c, s = np.exp(q)
        return np.log(np.maximum(floor, c + s * w)) - lt

    big = int(np.argmax(w))
    s0 = max(t[big] / max(w[big], 1e-300), 1e-300)
    starts = [(t.min(), 0.1 * t.min(), s0), (0.5 * t.min(), 0.5 * t.min(), s0)]
    order = np.argsort(w)
    if len(w) >= 2 and w[order[-1]] > w[order[-2]] and t[order[-1]] > t[order[-2]]:
        # the line through the two largest-work points (the bandwidth / compute regime), floor at the minimum
        i, j = order[-1], order[-2]
        sl = (t[i] - t[j]) / (w[i] - w[j])
        starts.append((t.min(), max(t[i] - sl * w[i], 1e-3 * t.min()), sl))
    best = None
    for f0, c0, s0 in starts:
        q0 = np.log([f0, max(c0, 1e-300), s0])
        r = least_squares(res, q0, method="trf", x_scale=1.0, max_nfev=400)
        if best is None or r.cost < best.cost:
            best = r
    floor, c, s = (float(v) for v in np.exp(best.x))
    return floor, c, s


def _hybrid(form: Form, p, xs: list[float], ts: list[float]):
    """``t(x) = base(x) * exp(rho(x))``: the fitted base form times its log-residual at the fit points,
    interpolated between neighbouring fit points (held at the end values outside): passes through every fit
    point, follows the form between them (floor / wave steps / knee), and the residual carries the smooth
    efficiency drift. The residual is linear in ``log x``, except across a step of a GEMM or KV-block form
    (neighbours with different quantised work): there it is linear in ``log w(x)``, so an ``x`` with the same
    waves / tiles / KV blocks as a fit point takes that point's residual (the staircase: same quantised work, same
    time)."""
    lx = [math.log(x) for x in xs]
    rho = [math.log(t / _base(form, p, x)) for x, t in zip(xs, ts)]
    quant = form.work in ("gemm", "kvblocks")
    lw = [math.log(max(form.w(x), 1e-300)) for x in xs] if quant else []

    def f(x: float) -> float:
        g = math.log(x)
        if g <= lx[0]:
            r = rho[0]
        elif g >= lx[-1]:
            r = rho[-1]
        else:
            j = bisect.bisect_right(lx, g) - 1
            j = min(j, len(lx) - 2)
            if quant and lw[j + 1] > lw[j] + 1e-12:
                u = min(1.0, max(0.0, (math.log(max(form.w(x), 1e-300)) - lw[j]) / (lw[j + 1] - lw[j])))
            else:
                u = (g - lx[j]) / (lx[j + 1] - lx[j])
            r = rho[j] + u * (rho[j + 1] - rho[j])
        return _base(form, p, x) * math.exp(form.lam * r)

    return f


@lru_cache(maxsize=4096)
def _fit_cached(form: Form, xs: tuple[float, ...], ts: tuple[float, ...]) -> tuple[float, float, float]:
    """:func:`fit_form` memoised (leave-one-out fits each subset once per form, for both ``lam``)."""
    return fit_form(form, list(xs), list(ts))


def _loo_error(form: Form, xs: list[float], ts: list[float]) -> float:
    """Leave-one-out median |error| of the hybrid over the inner fit points (model selection on fit rows only)."""
    errs = []
    for i in range(1, len(xs) - 1):
        xi, ti = xs[:i] + xs[i + 1:], ts[:i] + ts[i + 1:]
        f = _hybrid(form, _fit_cached(replace(form, lam=1.0), tuple(xi), tuple(ti)), xi, ti)
        errs.append(abs(f(xs[i]) / ts[i] - 1))
    errs.sort()
    return (errs[len(errs) // 2] + max(errs)) if errs else 0.0


def candidate_forms(kind: str, shape: dict | None = None, sm_count: int = 132) -> list[Form]:
    """The base forms :func:`choose_form` picks from for a curve of ``kind``: always the kind's power form and
    plain log-log interpolation (``loglog``: the fit points joined by straight lines in log-log space); GEMMs
    also the wave-quantised form per CTA tile of ``GEMM_TILES`` (``waves = ceil(tiles / SMs)``: a kernel that
    maps one tile per CTA) and the stream-K form per ``GEMM_STREAMK_BM`` (tile quantisation of m only);
    flash attention also its block form; decode attention the context in whole KV blocks (``DECODE_KV_BLOCKS``)."""
    shape = shape or {}
    base = form_for(kind, shape, sm_count)
    out = [base] if base.work != "power" else []
    out.append(Form("power", exp=_WORK_EXP.get(kind, 1.0) if kind in RATE_KINDS else 1.0))
    if kind == "gemm_tflops" and shape.get("n"):
        g = Form("gemm", n=int(shape["n"]), experts=int(shape.get("n_experts", 1)), sm_count=sm_count)
        out += [replace(g, tile=t) for t in GEMM_TILES]
        out += [replace(g, tile=(bm, 128), streamk=True) for bm in GEMM_STREAMK_BM]
    if kind == "decode_attn_GBps":
        out += [Form("kvblocks", tile=(b, 1)) for b in DECODE_KV_BLOCKS]
    if base.work == "experts":
        out += [replace(base, per_token=r) for r in MOE_PER_TOKEN]
    out.append(Form("loglog"))
    return list(dict.fromkeys(out))


def choose_form(kind: str, pts: list[tuple[float, float]], shape: dict | None = None,
                sm_count: int = 132) -> Form:
    """The base form for a curve, chosen by leave-one-out over the curve's *fit* points only (median + max
    |error|) among :func:`candidate_forms`, and for every form but ``loglog`` whether the fit-point residual is
    interpolated (``lam`` 1) or the form alone is used (``lam`` 0). Scores within ``LOO_TIE`` (+ ``LOO_REL_TIE``) of the best so far
    keep the earlier candidate (forms the fit rows cannot tell apart: the simpler / wave form wins)."""
    base = form_for(kind, shape, sm_count)
    if len(pts) < 5:
        return base
    xs, ts = _times(kind, pts)
    best = None
    for f in candidate_forms(kind, shape, sm_count):
        for lam in ((1.0,) if f.work == "loglog" else (1.0, 0.0)):
            g = replace(f, lam=lam)
            e = _loo_error(g, xs, ts)
            if best is None or e < best[0] * (1 - LOO_REL_TIE) - LOO_TIE:
                best = (e, g)
    return best[1]


def _times(kind: str, pts: list[tuple[float, float]]) -> tuple[list[float], list[float]]:
    rate = kind in RATE_KINDS
    e = _WORK_EXP.get(kind, 1.0)
    return [float(x) for x, _ in pts], [(float(x) ** e) / y if rate else float(y) for x, y in pts]


def fit_curve(kind: str, pts: list[tuple[float, float]], form: Form | None = None) -> tuple[tuple[float, float], ...]:
    """Fitted calibration points from measured ``(x, y)`` (x increasing):

    1. **physical base form** (:class:`Form`, :func:`fit_form`): the implied time ``t(x)`` (``work(x) / y`` for
       rate kinds, ``y`` for ``*_us``) is fitted with ``max(floor, c + s * w(x))`` — the launch / latency floor,
       a fixed cost and the time per unit of *quantised* work (GEMM: waves of CTA tiles; flash attention: causal
       block pairs per SM; bytes for copies and collectives);
    2. **residual**: the log-ratio of measured to base time at every fit point, interpolated linearly in log x, so
       the curve passes through every fit point (kernel-selection steps seen at a fitted x are kept) and between
       points follows the form (floor, knee, wave steps) times a smoothly varying efficiency;
    3. **tabulation** for ``CalibrationEntry.interpolate`` (linear in ``log x``): ``POINTS_PER_OCTAVE`` points per
       doubling of x, the fit points, and both sides of every wave step of the form.

    With fewer than 3 points the base form is not fitted (pure log-log interpolation of the time).
    """
    xs, ts = _times(kind, pts)
    if len(xs) == 1:
        return ((xs[0], float(pts[0][1])),)
    form = form or form_for(kind)
    if len(xs) >= 3:
        f = _hybrid(form, fit_form(form, xs, ts), xs, ts)
    else:
        lt = [math.log(t) for t in ts]  # two points: the log-log line through them
        a = (lt[1] - lt[0]) / (math.log(xs[1]) - math.log(xs[0]))
        f = (lambda x, a=a: ts[0] * (x / xs[0]) ** a)
    lx0, lx1 = math.log(xs[0]), math.log(xs[-1])
    n = max(1, math.ceil((lx1 - lx0) / math.log(2) * POINTS_PER_OCTAVE))
    grid = sorted({*(math.exp(lx0 + (lx1 - lx0) * j / n) for j in range(1, n)), *xs, *form.steps(xs[0], xs[-1])})
    rate = kind in RATE_KINDS
    e = _WORK_EXP.get(kind, 1.0)
    out = []
    for x in grid:
        t = ts[xs.index(x)] if x in xs else f(x)
        out.append((x, (x ** e) / t if rate else t))
    dedup = [out[0]]
    for x, y in out[1:]:
        if x > dedup[-1][0] * (1 + 1e-9):
            dedup.append((x, y))
    return tuple((float(sig(x, 9)), float(sig(y))) for x, y in dedup)


def sig(v: float, digits: int = 6) -> float:
    """``v`` rounded to ``digits`` significant digits (what the calibration files store)."""
    return float(f"{v:.{digits}g}")


def geomean(ys: list[float]) -> float:
    """The geometric mean of positive ``ys`` (repeats of one point, a fallback over shapes)."""
    return math.exp(sum(math.log(y) for y in ys) / len(ys))
