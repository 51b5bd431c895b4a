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
``flash_tflops``        sequence length (tokens)          achieved TFLOP/s           head_dim, n_q_heads,
                                                                                     n_kv_heads
``hbm_GBps``            bytes read per kernel             achieved GB/s              (none)
``decode_attn_GBps``    context tokens per sequence       KV bytes read / time, GB/s head_dim, seq_heads,
                                                                                     n_q_heads, n_kv_heads, kv
``allreduce_us``        bytes per rank buffer             µs                         algo, n_ranks
``dispatch_us``         tokens per rank                   µs                         n_ranks, hidden, phase
``combine_us``          tokens per rank                   µs                         n_ranks, hidden, phase
``nic_GBps``            chunk bytes                       achieved GB/s per NIC      nic
``p2p_us``              bytes copied GPU to GPU           µs per copy                route (nvlink | net | host)
``moe_us``              tokens into the EP group's MoE    µs of the routed-expert    fmt, hidden, inter, top_k,
                        block (its whole batch)           block on one rank          n_experts, tp, ep, dist
``a2a_us``              payload bytes per rank            µs                         op (dispatch | combine),
                                                                                     n_ranks, payload
``step_us``             sequences per rank in the step    µs of framework work per   phase (decode | prefill)
                                                          step beyond its kernels
``mla_prefill_tflops``  sequence length (tokens)          achieved TFLOP/s           dims, n_heads, seqs, kv
``mla_decode_GBps``     context tokens per sequence       latent bytes / time, GB/s  dims, n_heads, seqs, kv
``mla_bmm_us``          tokens                            µs                         dims, op (pre | post),
                                                                                     n_heads, fmt
``allgather_us``        bytes of the whole buffer         µs                         n_ranks, payload
``reducescatter_us``    bytes of the whole buffer         µs                         n_ranks, payload
======================  ================================  =========================  ================================

The ``mla_*`` kinds are the MLA kernels (``sim.costs.mla``): ``dims`` = ``"kv_lora+rope/nope/v"``, ``n_heads``
the heads on one GPU, ``seqs`` the sequences in the kernel (interpolated in ``log seqs`` by ``lookup_along``).
``flash_tflops`` and ``decode_attn_GBps`` entries pinning ``window`` are sliding-window kernels; only
sliding-window queries use them, and those use nothing else.

``moe_us`` is the routed-expert block of one MoE layer as a serving stack runs it (routing / top-k, permute, the
expert GEMMs, unpermute and the weighted sum; not the router GEMM, not the dispatch / combine communication): when an
entry matches, it replaces the grouped-GEMM model, fixed costs at small batch included (``sim.costs.moe_block``).
``a2a_us`` is a DP-EP decode dispatch or combine kernel priced by the bytes it moves per rank (tokens per rank x
hidden x payload element bytes), so a table measured at one hidden size prices another at equal bytes.

``step_us`` is the serving framework's own time per step (the inputs of a graph-replayed step copied in, the
step's bookkeeping) that no kernel accounts for; without an entry the constant ``HOST_STEP_US`` applies.

``p2p_us`` is a whole GPU-to-GPU copy (``sim.costs.collective.p2p_copy_time``). Time kinds (``*_us``) keep the
smallest measured size's time below it (the latency floor) and above the largest continue at the rate of the
last measured interval (:meth:`CalibrationEntry.extend`: an all-reduce twice the largest measured one takes about
twice as long); rate kinds are clamped to their end values.

``flash_tflops`` is the causal prefill-attention kernel. ``n_q_heads`` / ``n_kv_heads`` are the heads the kernel
runs over: one sequence's local heads, times the sequences sharing the kernel (a prefill of ``n`` equal sequences
of ``h`` / ``hkv`` heads takes the time of one sequence of ``n h`` / ``n hkv`` heads: the imported tables' batched
rows, median 1-2 % apart; ``sim.costs.attention.full_attention_prefill`` says how a mixed batch is priced).

``decode_attn_GBps`` is the decode-attention kernel (one query token per sequence over its KV cache) per
``seq_heads`` = sequences x local KV heads (the kernel's parallel units); :meth:`CalibrationTable.lookup_along`
interpolates between the measured ``seq_heads`` curves (linear in ``log seq_heads``, clamped), so any batch and
TP degree gets a value. ``kv`` is the KV cache's element format (``bf16`` | ``fp8``: the fp8 cache runs other
kernels, not the bf16 ones at half the bytes); an entry without it matches either.

**Grids** (``grid``, imported tables): for a kind listed there, the named numeric key fields (e.g. ``n`` and ``k``
of ``gemm_tflops``) span a measured grid. A query whose values are not on the grid is interpolated between the
bracketing grid values (multilinear in the logarithms, clamped to the grid's edges) instead of falling back to a
less specific entry; :meth:`CalibrationTable.grid_position` says where a query fell (for the run's caveats).

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
import math
import operator
from pathlib import Path
from typing import Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

from rackbed.sim.costs import constants as C
from rackbed.topology.errors import UserError, from_validation

#: libyaml's loader where PyYAML has it (the shipped H200 file loads ~8x faster), else the pure-Python one
_YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_X = operator.itemgetter(0)  # a curve point's x

Kind = Literal["gemm_tflops", "flash_tflops", "hbm_GBps", "decode_attn_GBps", "allreduce_us", "dispatch_us",
               "combine_us", "nic_GBps", "p2p_us", "moe_us", "a2a_us", "step_us", "mla_prefill_tflops",
               "mla_decode_GBps", "mla_bmm_us", "allgather_us", "reducescatter_us"]

#: kind -> the key fields an entry may pin (anything else is a user error).
KINDS: dict[str, tuple[str, ...]] = {
    "gemm_tflops": ("fmt", "n", "k"),
    "flash_tflops": ("head_dim", "n_q_heads", "n_kv_heads", "window"),
    "hbm_GBps": (),
    "decode_attn_GBps": ("head_dim", "seq_heads", "n_q_heads", "n_kv_heads", "kv", "window"),
    "allreduce_us": ("algo", "n_ranks"),
    "dispatch_us": ("n_ranks", "hidden", "phase"),
    "combine_us": ("n_ranks", "hidden", "phase"),
    "nic_GBps": ("nic",),
    "p2p_us": ("route",),
    "moe_us": ("fmt", "hidden", "inter", "top_k", "n_experts", "tp", "ep", "dist"),
    "a2a_us": ("op", "n_ranks", "payload"),
    "step_us": ("phase",),
    "mla_prefill_tflops": ("dims", "n_heads", "seqs", "kv"),
    "mla_decode_GBps": ("dims", "n_heads", "seqs", "kv"),
    "mla_bmm_us": ("dims", "op", "n_heads", "fmt"),
    "allgather_us": ("n_ranks", "payload"),
    "reducescatter_us": ("n_ranks", "payload"),
}

#: (kind, key field) -> {other spelling: the value rackbed's cost functions query}. Entries are stored with the
#: canonical value (an alias in a file is rewritten when it loads) and queries are canonicalised the same way, so a
#: curve written under a stack's own name (TensorRT-LLM's ``oneshot`` / ``twoshot``) cannot go unread.
KEY_ALIASES: dict[tuple[str, str], dict[str, str]] = {
    ("allreduce_us", "algo"): {"oneshot": "one_shot", "one-shot": "one_shot", "twoshot": "two_shot",
                               "two-shot": "two_shot"},
}
_ALIASED_KINDS = frozenset(k for k, _ in KEY_ALIASES)


def canonical_key(kind: str, key: dict) -> dict:
    """``key`` with every aliased value (``KEY_ALIASES``) replaced by its canonical spelling."""
    if kind not in _ALIASED_KINDS:
        return key
    out = dict(key)
    for (k, f), names in KEY_ALIASES.items():
        if k == kind and isinstance(out.get(f), str):
            out[f] = names.get(out[f], out[f])
    return out


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

    @model_validator(mode="after")
    def _canonical(self) -> CalibrationEntry:
        key = canonical_key(self.kind, self.key)
        if key != self.key:
            object.__setattr__(self, "key", key)
        return self

    def matches(self, gpu: str, key: dict) -> int:
        """-1 if this entry does not apply to (gpu, key), else the number of key fields it pins."""
        if self.gpu != gpu:
            return -1
        for f, v in self.key.items():
            if f not in key or key[f] != v:
                return -1
        return len(self.key)

    def interpolate(self, x: float, loglog: bool = False) -> float:
        """y at ``x``: piecewise linear in log(x) (``loglog``: in log(x) and log(y), a power law between
        neighbouring points), clamped to the end points."""
        pts = self.points
        if x <= pts[0][0]:
            return pts[0][1]
        if x >= pts[-1][0]:
            return pts[-1][1]
        j = bisect.bisect_right(pts, x, key=_X)  # on the x values, without a list of them per call
        (x0, y0), (x1, y1) = pts[j - 1], pts[j]
        t = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
        if loglog:
            return y0 * (y1 / y0) ** t
        return y0 + t * (y1 - y0)


    def extend(self, x: float, loglog: bool = False) -> float:
        """y at ``x`` for a time curve that grows with ``x``: :meth:`interpolate` inside and below the measured
        range; above it, the last point plus the slope of the last interval, linear in ``x`` (a copy twice the
        largest measured one takes twice as long at the same rate, not the same time)."""
        (x0, y0), (x1, y1) = self.points[-2:] if len(self.points) > 1 else (self.points[0], self.points[0])
        if x <= x1 or x1 <= x0:
            return self.interpolate(x, loglog)
        return y1 + (x - x1) * max(y1 - y0, 0.0) / (x1 - x0)


class CalibrationTable(BaseModel):
    """A set of measured curves (see the module docstring); ``lookup`` finds and interpolates one."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    #: 2 added the optional ``kernel_fixed_us``; version-1 files load unchanged (default fixed cost)
    version: Literal[1, 2] = 2
    entries: tuple[CalibrationEntry, ...] = ()
    #: GPU model (``GpuSpec.name``) -> fitted per-kernel fixed cost in µs (:func:`kernel_fixed_us`)
    kernel_fixed_us: dict[str, float] = Field(default_factory=dict)
    #: kind -> numeric key fields measured on a grid and interpolated between (module docstring, "Grids")
    grid: dict[str, tuple[str, ...]] = Field(default_factory=dict)
    #: between measured points: ``log-x`` (linear in log x) or ``log-log`` (a power law; imported tables, whose
    #: points are sparse: exact for a constant floor and for a time linear in x alike)
    interpolation: Literal["log-x", "log-log"] = "log-x"

    # (kind, gpu) -> entries in file order; (kind, gpu, key) -> what entry() / the grid resolved it to
    _by_kind: dict = PrivateAttr(default_factory=dict)
    _resolved: dict = PrivateAttr(default_factory=dict)

    @field_validator("kernel_fixed_us")
    @classmethod
    def _fixed_ok(cls, v: dict[str, float]) -> dict[str, float]:
        for g, us in v.items():
            if not (math.isfinite(us) and us >= 0):
                raise ValueError(f"kernel_fixed_us[{g!r}] = {us}: must be a finite number of µs >= 0")
        return v

    @field_validator("grid")
    @classmethod
    def _grid_ok(cls, v: dict[str, tuple[str, ...]]) -> dict[str, tuple[str, ...]]:
        for kind, fields in v.items():
            if kind not in KINDS:
                raise ValueError(f"grid: {kind!r} is not a calibration kind (known: {', '.join(KINDS)})")
            bad = sorted(set(fields) - set(KINDS[kind]))
            if bad or not fields:
                raise ValueError(f"grid[{kind!r}]: field {bad[0] if bad else '(none)'!r} is not a key of kind "
                                 f"{kind!r} (allowed: {', '.join(KINDS[kind])})")
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

    def _entries_of(self, kind: str, gpu: str) -> list[CalibrationEntry]:
        if not self._by_kind:
            for e in self.entries:
                self._by_kind.setdefault((e.kind, e.gpu), []).append(e)
        return self._by_kind.get((kind, gpu), [])

    def lookup(self, kind: str, gpu: str, x: float, **key) -> float | None:
        """The measured ``y(x)`` of the most specific entry of ``kind`` for ``gpu`` and ``key`` (on a grid kind:
        interpolated between the bracketing grid entries); None if none matches (the caller then uses its default
        model)."""
        if kind not in KINDS:
            raise UserError(f"calibration kind must be one of {', '.join(KINDS)}, got {kind!r}")
        res = self._resolve(kind, gpu, key)
        if res is None:
            return None
        x = max(float(x), 1e-30)
        ll = self.interpolation == "log-log"
        # a time (``*_us``) keeps growing past the largest measured size; a rate holds its last value
        if kind.endswith("_us"):
            return sum(w * e.extend(x, ll) for w, e in res)
        return sum(w * e.interpolate(x, ll) for w, e in res)

    def entry(self, kind: str, gpu: str, **key) -> CalibrationEntry | None:
        """The most specific entry of ``kind`` matching ``gpu`` and ``key`` (ties: the first), or None. (On a grid
        kind, the grid entry with the most weight in :meth:`lookup`'s interpolation.)"""
        if kind not in KINDS:
            raise UserError(f"calibration kind must be one of {', '.join(KINDS)}, got {kind!r}")
        res = self._resolve(kind, gpu, key)
        return None if res is None else max(res, key=lambda we: we[0])[1]

    def _resolve(self, kind: str, gpu: str, key: dict) -> tuple[tuple[float, CalibrationEntry], ...] | None:
        """``((weight, entry), ...)`` whose weighted values are the lookup (one entry of weight 1 off the grid)."""
        mkey = (kind, gpu, tuple(sorted(key.items())))
        memo = self._memo()
        try:
            return memo[mkey]
        except KeyError:
            pass
        except TypeError:  # an unhashable key value: resolve without the memo
            return self._resolve_uncached(kind, gpu, key)
        res = memo[mkey] = self._resolve_uncached(kind, gpu, key)
        return res

    def _memo(self) -> dict:
        """``_resolved`` without pydantic's ``__getattr__`` (private attributes live in ``__pydantic_private__``;
        reading one the ordinary way costs a Python-level call per lookup)."""
        priv = self.__pydantic_private__
        if priv is not None:
            memo = priv.get("_resolved")
            if memo is not None:
                return memo
        return self._resolved

    def _resolve_uncached(self, kind, gpu, key):
        key = canonical_key(kind, key)
        cands = self._entries_of(kind, gpu)
        fields = self.grid.get(kind)
        if fields and all(isinstance(key.get(f), (int, float)) for f in fields):
            res = self._grid_resolve(cands, fields, key)
            if res is not None:
                return res
        best, best_score = None, -1
        for e in cands:
            s = e.matches(gpu, key)
            if s > best_score:
                best, best_score = e, s
        return None if best is None else ((1.0, best),)

    def _grid_points(self, cands, fields, key):
        """Entries pinning every grid field and matching ``key`` on all other fields: {grid values: entry} (per
        grid point the most specific entry, ties the first)."""
        other = {f: v for f, v in key.items() if f not in fields}
        # the points depend on the fields off the grid only: one scan of the entries per (kind, gpu, those fields)
        try:
            mkey = ("grid", id(cands), fields, tuple(sorted(other.items())))
            hit = self._resolved.get(mkey)
        except TypeError:  # an unhashable key value
            mkey, hit = None, None
        if hit is not None and hit[0] is cands:
            return hit[1]
        pts: dict[tuple, tuple[int, CalibrationEntry]] = {}
        for e in cands:
            if not all(f in e.key for f in fields):
                continue
            s = e.matches(e.gpu, {**other, **{f: e.key[f] for f in fields}})
            if s < 0:
                continue
            gv = tuple(float(e.key[f]) for f in fields)
            if gv not in pts or s > pts[gv][0]:
                pts[gv] = (s, e)
        out = {g: e for g, (s, e) in pts.items()}
        if mkey is not None:
            self._resolved[mkey] = (cands, out)
        return out

    def _grid_resolve(self, cands, fields, key):
        pts = self._grid_points(cands, fields, key)
        if not pts:
            return None
        axes = [sorted({g[i] for g in pts}) for i in range(len(fields))]
        brackets = []  # per field: ((value, weight), ...)
        for i, f in enumerate(fields):
            v, vs = float(key[f]), axes[i]
            if v <= vs[0] or len(vs) == 1:
                brackets.append(((vs[0], 1.0),))
            elif v >= vs[-1]:
                brackets.append(((vs[-1], 1.0),))
            else:
                j = bisect.bisect_left(vs, v)
                if vs[j] == v:
                    brackets.append(((v, 1.0),))
                else:
                    v0, v1 = vs[j - 1], vs[j]
                    t = (math.log(v) - math.log(v0)) / (math.log(v1) - math.log(v0))
                    brackets.append(((v0, 1.0 - t), (v1, t)))
        out: list[tuple[float, CalibrationEntry]] = []
        corners = [((), 1.0)]
        for br in brackets:
            corners = [(c + (v,), w * wv) for c, w in corners for v, wv in br]
        for c, w in corners:
            e = pts.get(c)
            if e is None:  # a hole in the grid: the nearest measured point (in log distance)
                e = pts[min(pts, key=lambda g: sum(abs(math.log(a) - math.log(b)) for a, b in zip(g, c)))]
            if w > 0:
                out.append((w, e))
        return tuple(out) if out else None

    def grid_position(self, kind: str, gpu: str, **key) -> str | None:
        """Where a grid-kind query falls: None when it is on a measured grid point (or ``kind`` has no grid);
        else a short phrase naming the interpolation or the clamp to the grid's edge, for the run's caveats."""
        fields = self.grid.get(kind)
        if not fields:
            return None
        pts = self._grid_points(self._entries_of(kind, gpu), fields, key)
        if not pts:
            return None
        out = []
        for i, f in enumerate(fields):
            vs = sorted({g[i] for g in pts})
            v = float(key[f])
            if v in vs:
                continue
            if v < vs[0] or v > vs[-1]:
                edge = vs[0] if v < vs[0] else vs[-1]
                out.append(f"{f}={v:g} outside the measured {vs[0]:g}..{vs[-1]:g} (held at {edge:g}, "
                           f"{abs(math.log2(v / edge)):.1f} octaves away)")
            else:
                j = bisect.bisect_left(vs, v)
                out.append(f"{f}={v:g} interpolated between {vs[j - 1]:g} and {vs[j]:g}")
        return "; ".join(out) or None

    def lookup_along(self, kind: str, gpu: str, x: float, field: str, value: float, **key) -> float | None:
        """``y(x)`` where ``field`` is a numeric key measured at a few values (curves pinning it): the two curves
        whose ``field`` brackets ``value`` are evaluated at ``x`` and interpolated linearly in ``log(value)``
        (clamped to the outermost curve). Curves must also match ``gpu`` and ``key`` (as :meth:`lookup`; per
        ``field`` value the most specific wins). Without any curve pinning ``field``: :meth:`lookup`."""
        if kind not in KINDS:
            raise UserError(f"calibration kind must be one of {', '.join(KINDS)}, got {kind!r}")
        key = canonical_key(kind, key)
        mkey = ("along", kind, gpu, field, tuple(sorted(key.items())))
        cands = self._resolved.get(mkey)
        if cands is None:
            cands = {}
            for e in self._entries_of(kind, gpu):
                if field not in e.key:
                    continue
                s = e.matches(gpu, {**key, field: e.key[field]})
                v = float(e.key[field])
                if s >= 0 and v > 0 and (v not in cands or s > cands[v][0]):
                    cands[v] = (s, e)
            self._resolved[mkey] = cands
        if not cands:
            return self.lookup(kind, gpu, x, **key, **{field: value})
        vs = sorted(cands)
        xv = max(float(x), 1e-30)
        if value <= vs[0]:
            return cands[vs[0]][1].interpolate(xv, self.interpolation == "log-log")
        if value >= vs[-1]:
            return cands[vs[-1]][1].interpolate(xv, self.interpolation == "log-log")
        j = bisect.bisect_right(vs, value)
        v0, v1 = vs[j - 1], vs[j]
        ll = self.interpolation == "log-log"
        y0, y1 = cands[v0][1].interpolate(xv, ll), cands[v1][1].interpolate(xv, ll)
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


def host_step_s(calib: CalibrationTable | None, gpu, phase: str, seqs_per_rank: float) -> float:
    """Seconds of framework work per step beyond its kernels (kind ``step_us``; else ``HOST_STEP_US``)."""
    if calib is not None:
        us = calib.lookup("step_us", gpu if isinstance(gpu, str) else gpu.name, max(seqs_per_rank, 1.0), phase=phase)
        if us is not None:
            return us * 1e-6
    return C.HOST_STEP_US * 1e-6


def load_calibration(path: str | Path) -> CalibrationTable:
    """Read a calibration table from YAML or JSON; one-line UserError naming the file and field on mistakes."""
    from rackbed.topology.yamlio import load_data

    p = Path(path)
    data = load_data(p, "calibration file")
    if not isinstance(data, dict):
        raise UserError(f"{p}: a calibration file must be a mapping with 'entries'")
    try:
        return CalibrationTable.model_validate(data)
    except ValidationError as exc:
        raise from_validation(exc, p) from exc
