"""The calibration hook: measured tables that override the first-principles curves.

A :class:`CalibrationTable` is a list of :class:`CalibrationEntry` — one measured curve ``y(x)`` for one
``kind`` of quantity on one GPU model, for one *shape* given as ``key`` fields. Cost functions take an optional
``calib: CalibrationTable | None`` and call :meth:`CalibrationTable.lookup`; when it returns a number the
measured value replaces the default model's value, otherwise (no table, no matching entry) the default model is
used. Nothing here is global: the table is passed in, so cost functions stay pure.

Kinds (``x`` → ``y``; key fields a matching entry may pin; see ``KINDS``):

======================  ================================  =========================  ================================
kind                    x                                 y                          key fields
======================  ================================  =========================  ================================
``gemm_tflops``         tokens per expert (M)             achieved TFLOP/s           fmt, n, k
``flash_tflops``        sequence length (tokens)          achieved TFLOP/s           head_dim
``hbm_GBps``            bytes read per kernel             achieved GB/s              (none)
``decode_attn_GBps``    context tokens per sequence       KV bytes read / time, GB/s head_dim, seq_heads
``allreduce_us``        bytes per rank buffer             µs                         algo, n_ranks
``dispatch_us``         tokens per rank                   µs                         n_ranks, hidden, phase
``combine_us``          tokens per rank                   µs                         n_ranks, hidden, phase
``nic_GBps``            chunk bytes                       achieved GB/s per NIC      nic
``p2p_us``              bytes copied GPU to GPU           µs per copy                route (nvlink | net | host)
======================  ================================  =========================  ================================

``p2p_us`` is a whole GPU-to-GPU copy (``sim.costs.collective.p2p_copy_time``). Time kinds (``*_us``) keep the
smallest measured size's time below it (the latency floor) and above the largest continue at the rate of the
last measured interval (:meth:`CalibrationEntry.extend`: an all-reduce twice the largest measured one takes about
twice as long); rate kinds are clamped to their end values.

``decode_attn_GBps`` is the decode-attention kernel (one query token per sequence over its KV cache) per
``seq_heads`` = sequences x local KV heads (the kernel's parallel units); :meth:`CalibrationTable.lookup_along`
interpolates between the measured ``seq_heads`` curves (linear in ``log seq_heads``, clamped), so any batch and
TP degree gets a value.

Matching: ``entry.gpu`` equals the GPU model name (``GpuSpec.name``, e.g. ``H200-SXM``); every key field the
entry gives must equal the query's value (fields the entry omits match anything); among matching entries the
one pinning the most fields wins (ties: the first in the file). Interpolation is piecewise linear in
``log(x)`` (values spread over decades), clamped to the end points outside the measured range — except above
the range of a time kind (above).

**Per-kernel fixed cost** (``kernel_fixed_us``, version 2): the time a graph-launched kernel takes beyond its
work (launch gap, pipeline fill, tail), per GPU model, in µs. Every cost function that adds a fixed cost per
kernel reads it through :func:`kernel_fixed_us` (``calib``, GPU): the table's value for that GPU model, else the
first-principles ``constants.KERNEL_FIXED_US``. ``sim.calibrate`` fits it from the measured rows (and subtracts
the same value from the rows it turns into rates, so fit and prediction agree).

File format (YAML or JSON)::

    version: 2                       # 1: no kernel_fixed_us (older files; the default fixed cost applies)
    kernel_fixed_us: {H200-SXM: 0.87}
    entries:
      - kind: allreduce_us
        gpu: H200-SXM
        key: {algo: nvls, n_ranks: 4}
        points: [[16384, 9.1], [1048576, 14.0], [134217728, 420.0]]
        source: "rackbed bench allreduce, 2026-11-30, NCCL 2.28"
"""

from __future__ import annotations

import bisect
import json
import math
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from sim.costs import constants as C
from topology.errors import UserError, from_validation

#: libyaml's loader where PyYAML has it (the shipped H200 file loads ~8x faster), else the pure-Python one
_YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

Kind = Literal["gemm_tflops", "flash_tflops", "hbm_GBps", "decode_attn_GBps", "allreduce_us", "dispatch_us",
               "combine_us", "nic_GBps", "p2p_us", "moe_us"]

#: kind -> the key fields an entry may pin (anything else is a user error).
KINDS: dict[str, tuple[str, ...]] = {
    "gemm_tflops": ("fmt", "n", "k"),
    "flash_tflops": ("head_dim",),
    "hbm_GBps": (),
    "decode_attn_GBps": ("head_dim", "seq_heads"),
    "allreduce_us": ("algo", "n_ranks"),
    "dispatch_us": ("n_ranks", "hidden", "phase"),
    "combine_us": ("n_ranks", "hidden", "phase"),
    "nic_GBps": ("nic",),
    "p2p_us": ("route",),
    "moe_us": ("fmt", "hidden", "inter", "top_k", "n_experts", "tp", "ep", "dist"),
}


class CalibrationEntry(BaseModel):
    """One measured curve: ``points`` are ``(x, y)`` pairs with strictly increasing ``x > 0`` and ``y > 0``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Kind
    gpu: str
    key: dict[str, str | int | float] = Field(default_factory=dict)
    points: tuple[tuple[float, float], ...] = Field(min_length=1)
    source: str = ""

    @field_validator("points")
    @classmethod
    def _increasing(cls, pts: tuple[tuple[float, float], ...]) -> tuple[tuple[float, float], ...]:
        for i, (x, y) in enumerate(pts):
            if not (x > 0 and y > 0 and math.isfinite(x) and math.isfinite(y)):
                raise ValueError(f"point {i} ({x}, {y}): x and y must be finite and > 0")
            if i and x <= pts[i - 1][0]:
                raise ValueError(f"point {i}: x values must be strictly increasing")
        return pts

    def matches(self, gpu: str, key: dict) -> int:
        """-1 if this entry does not apply to (gpu, key), else the number of key fields it pins."""
        if self.gpu != gpu:
            return -1
        for f, v in self.key.items():
            if f not in key or key[f] != v:
                return -1
        return len(self.key)

    def interpolate(self, x: float) -> float:
        """y at ``x``: piecewise linear in log(x), clamped to the end points."""
        xs = [p[0] for p in self.points]
        if x <= xs[0]:
            return self.points[0][1]
        if x >= xs[-1]:
            return self.points[-1][1]
        j = bisect.bisect_right(xs, x)
        (x0, y0), (x1, y1) = self.points[j - 1], self.points[j]
        t = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
        return y0 + t * (y1 - y0)


    def extend(self, x: float) -> float:
        """y at ``x`` for a time curve that grows with ``x``: :meth:`interpolate` inside and below the measured
        range; above it, the last point plus the slope of the last interval, linear in ``x`` (a copy twice the
        largest measured one takes twice as long at the same rate, not the same time)."""
        (x0, y0), (x1, y1) = self.points[-2:] if len(self.points) > 1 else (self.points[0], self.points[0])
        if x <= x1 or x1 <= x0:
            return self.interpolate(x)
        return y1 + (x - x1) * max(y1 - y0, 0.0) / (x1 - x0)


class CalibrationTable(BaseModel):
    """A set of measured curves (see the module docstring); ``lookup`` finds and interpolates one."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    #: 2 added the optional ``kernel_fixed_us``; version-1 files load unchanged (default fixed cost)
    version: Literal[1, 2] = 2
    entries: tuple[CalibrationEntry, ...] = ()
    #: GPU model (``GpuSpec.name``) -> fitted per-kernel fixed cost in µs (:func:`kernel_fixed_us`)
    kernel_fixed_us: dict[str, float] = Field(default_factory=dict)

    @field_validator("kernel_fixed_us")
    @classmethod
    def _fixed_ok(cls, v: dict[str, float]) -> dict[str, float]:
        for g, us in v.items():
            if not (math.isfinite(us) and us >= 0):
                raise ValueError(f"kernel_fixed_us[{g!r}] = {us}: must be a finite number of µs >= 0")
        return v

    @field_validator("entries")
    @classmethod
    def _known_keys(cls, entries: tuple[CalibrationEntry, ...]) -> tuple[CalibrationEntry, ...]:
        for i, e in enumerate(entries):
            bad = sorted(set(e.key) - set(KINDS[e.kind]))
            if bad:
                raise ValueError(f"entries[{i}].key: field {bad[0]!r} is not a key of kind {e.kind!r} "
                                 f"(allowed: {', '.join(KINDS[e.kind]) or 'none'})")
        return entries

    def lookup(self, kind: str, gpu: str, x: float, **key) -> float | None:
        """The measured ``y(x)`` of the most specific entry of ``kind`` for ``gpu`` and ``key``; None if none
        matches (the caller then uses its default model)."""
        best = self.entry(kind, gpu, **key)
        if best is None:
            return None
        x = max(float(x), 1e-30)
        # a time (``*_us``) keeps growing past the largest measured size; a rate holds its last value
        return best.extend(x) if kind.endswith("_us") else best.interpolate(x)

    def entry(self, kind: str, gpu: str, **key) -> CalibrationEntry | None:
        """The most specific entry of ``kind`` matching ``gpu`` and ``key`` (ties: the first), or None."""
        if kind not in KINDS:
            raise UserError(f"calibration kind must be one of {', '.join(KINDS)}, got {kind!r}")
        best, best_score = None, -1
        for e in self.entries:
            if e.kind != kind:
                continue
            s = e.matches(gpu, key)
            if s > best_score:
                best, best_score = e, s
        return best

    def lookup_along(self, kind: str, gpu: str, x: float, field: str, value: float, **key) -> float | None:
        """``y(x)`` where ``field`` is a numeric key measured at a few values (curves pinning it): the two curves
        whose ``field`` brackets ``value`` are evaluated at ``x`` and interpolated linearly in ``log(value)``
        (clamped to the outermost curve). Curves must also match ``gpu`` and ``key`` (as :meth:`lookup`; per
        ``field`` value the most specific wins). Without any curve pinning ``field``: :meth:`lookup`."""
        if kind not in KINDS:
            raise UserError(f"calibration kind must be one of {', '.join(KINDS)}, got {kind!r}")
        cands: dict[float, tuple[int, CalibrationEntry]] = {}
        for e in self.entries:
            if e.kind != kind or field not in e.key:
                continue
            s = e.matches(gpu, {**key, field: e.key[field]})
            v = float(e.key[field])
            if s >= 0 and v > 0 and (v not in cands or s > cands[v][0]):
                cands[v] = (s, e)
        if not cands:
            return self.lookup(kind, gpu, x, **key, **{field: value})
        vs = sorted(cands)
        xv = max(float(x), 1e-30)
        if value <= vs[0]:
            return cands[vs[0]][1].interpolate(xv)
        if value >= vs[-1]:
            return cands[vs[-1]][1].interpolate(xv)
        j = bisect.bisect_right(vs, value)
        v0, v1 = vs[j - 1], vs[j]
        y0, y1 = cands[v0][1].interpolate(xv), cands[v1][1].interpolate(xv)
        t = (math.log(value) - math.log(v0)) / (math.log(v1) - math.log(v0))
        return y0 + t * (y1 - y0)


def lookup(calib: CalibrationTable | None, kind: str, gpu: str, x: float, **key) -> float | None:
    """``calib.lookup(...)`` or None when there is no table."""
    return None if calib is None else calib.lookup(kind, gpu, x, **key)


def kernel_fixed_us(calib: CalibrationTable | None, gpu) -> float:
    """Fixed cost of one kernel in µs on ``gpu`` (a ``GpuSpec`` or its name): the calibrated value when ``calib``
    carries one for that GPU model, else the first-principles ``constants.KERNEL_FIXED_US``."""
    if calib is not None and calib.kernel_fixed_us:
        v = calib.kernel_fixed_us.get(gpu if isinstance(gpu, str) else gpu.name)
        if v is not None:
            return v
    return C.KERNEL_FIXED_US


def load_calibration(path: str | Path) -> CalibrationTable:
    """Read a calibration table from YAML or JSON; one-line UserError naming the file and field on mistakes."""
    p = Path(path)
    text = p.read_text()
    try:
        data = json.loads(text) if p.suffix == ".json" else yaml.load(text, Loader=_YAML_LOADER)
    except (json.JSONDecodeError, yaml.YAMLError) as exc:
        raise UserError(f"{p}: not valid {'JSON' if p.suffix == '.json' else 'YAML'}: "
                        f"{' '.join(str(exc).split())}") from exc
    if not isinstance(data, dict):
        raise UserError(f"{p}: a calibration file must be a mapping with 'entries'")
    try:
        return CalibrationTable.model_validate(data)
    except ValidationError as exc:
        raise from_validation(exc, p) from exc
