"""Numeric formats for weights, activations and KV: reference quantize / dequantize in pure numpy.

Every format the GPU specs carry a rate for (``topology.specs.FormatRates``) has an entry here, keyed by the
same string: ``bf16``, ``fp8`` (E4M3, one fp32 scale per tensor), ``fp8_block`` (E4M3, fp32 scale per 1x128
activation block / 128x128 weight tile, DeepSeek-V3 style), ``mxfp8`` / ``mxfp6`` / ``mxfp4`` (OCP
Microscaling v1.0: E4M3 / E2M3 / E2M1 elements, 32 elements share one E8M0 power-of-two scale) and ``nvfp4``
(E2M1 elements, 16 elements share one E4M3 scale, plus one fp32 scale per tensor). ``fp8_e5m2``,
``mxfp8_e5m2``, ``mxfp6_e3m2`` and ``mxfp8_ceil`` (MXFP8 with the clipping-free scale rule ``X =
ceil(log2(amax / 448))``) are provided for completeness (``get_format`` accepts them; they are not in
``FORMAT_NAMES``).

    fmt = get_format("mxfp4")
    q = fmt.quantize(x, role="weight")      # Quantized(codes, scales, ...)
    y = fmt.dequantize(q)                    # float64, same shape as x
    fmt.bytes_per_element("weight")          # 0.53125 = 4 bits + one 8-bit scale per 32 elements

Conventions (shapes: ``x`` is any float array; blocks run along the LAST axis, the GEMM reduction axis K for
both activations ``[T, K]`` and weights ``[N, K]``; ``fp8_block`` weights use 128x128 tiles over the last two
axes):

* Element encoding is generic over minifloats (``Minifloat``): exponent bits, mantissa bits, bias and which
  codes are special. Rounding is round-to-nearest, ties-to-even, done exactly: the non-negative representable
  values are enumerated once, ``np.searchsorted`` brackets ``|x|`` between two neighbours, and ``|x|`` is
  compared with their midpoint (exact in float64: all values are short dyadic rationals); a tie picks the even
  code (mantissa LSB 0).
* MX scales follow OCP MX v1.0 §6.3: ``X = floor(log2(amax)) - emax_elem`` (emax_elem: E4M3 8, E5M2 15, E2M3
  2, E3M2 4, E2M1 2), clamped to the E8M0 range [-127, 127]; elements ``x / 2**X`` are rounded to nearest-even
  and saturate at the element max (so values of the top binade above the max, e.g. 7.5 in E2M1, clip to the
  max). An all-zero block gets the smallest scale (E8M0 code 0, 2**-127) and zero codes. **NaN/Inf**: if a
  block contains NaN or ±Inf its scale is NaN (E8M0 0xFF) and the whole block dequantizes to NaN (§6.3: "if X
  is NaN, all P_i are NaN"); E2M1/E2M3 have no NaN/Inf encodings, so the element codes of such a block are
  stored as 0. The same rule is used for nvfp4 (block scale = E4M3 NaN code 0x7F).
* NVFP4 follows NVIDIA's recipe: per-tensor fp32 scale ``s_t = amax / (6 * 448)``, block scale ``s_b =
  E4M3(block_amax / 6 / s_t)`` (round-to-nearest-even, saturating), elements ``E2M1(x / (s_b * s_t))``. Amaxes
  are taken over finite values. If ``s_b`` underflows to 0 the block is stored as zeros.
* fp8 / fp8_block: scale = ``fp32(amax / 448)`` over finite values; elements saturate (CUDA "satfinite"): NaN
  stays NaN (E4M3 code S.1111.111), ±Inf becomes ±448 x scale. A zero amax gives scale 0 and zero codes.
* bf16: the input is first cast to float32 (IEEE RNE), then rounded to bf16 by round-to-nearest-even of the
  fp32 bit pattern; NaN stays (quiet) NaN, overflow rounds to Inf as IEEE does.
* Arithmetic is float64. Hardware quantizers multiply by an fp32 reciprocal of the scale; for the fp32-scaled
  formats (fp8, fp8_block, nvfp4) that can move an element across a rounding tie in rare cases. For the MX
  formats (power-of-two scales) this reference is bit-exact.

``bytes_per_element`` includes block scales (per-tensor fp32 scales amortise to 0 and are not counted).
Sources: OCP Microscaling Formats (MX) v1.0 (2023), OCP 8-bit Floating Point Specification (OFP8) rev 1.0,
NVIDIA "Introducing NVFP4" (2025) / Transformer Engine docs, DeepSeek-V3 technical report §3.3 (fine-grained
FP8).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Literal

import numpy as np

Role = Literal["weight", "activation"]
ROLES = ("weight", "activation")

# ------------------------------------------------------------------------------------------------------------
# Minifloat element formats
# ------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Minifloat:
    """A small sign-exponent-mantissa float format (OCP naming).

    specials: "ieee" — top exponent is Inf (mantissa 0) / NaN (mantissa != 0), like E5M2;
              "fn"   — only S.1..1.1..1 is NaN, no Inf (E4M3, "finite + NaN");
              "none" — every code is a finite number (E2M1, E2M3, E3M2).
    Codes are ``sign << (exp_bits + man_bits) | exponent << man_bits | mantissa`` in a uint8.
    """

    name: str
    exp_bits: int
    man_bits: int
    bias: int
    specials: Literal["ieee", "fn", "none"]

    @property
    def bits(self) -> int:
        return 1 + self.exp_bits + self.man_bits

    @property
    def has_nan(self) -> bool:
        return self.specials != "none"

    @property
    def has_inf(self) -> bool:
        return self.specials == "ieee"

    @property
    def unit_roundoff(self) -> float:
        """u = 2**-(man_bits+1): the relative error bound of round-to-nearest for normal values."""
        return 2.0 ** -(self.man_bits + 1)

    @property
    def emin(self) -> int:
        """Exponent of the smallest normal value (1 - bias)."""
        return 1 - self.bias

    @functools.cached_property
    def _table(self) -> np.ndarray:
        """Value of every code 0 .. 2**bits - 1 (float64; ±inf / nan for specials)."""
        n_code = 1 << self.bits
        out = np.empty(n_code, dtype=np.float64)
        top_exp = (1 << self.exp_bits) - 1
        for code in range(n_code):
            sign = -1.0 if code >> (self.exp_bits + self.man_bits) else 1.0
            exp = (code >> self.man_bits) & top_exp
            man = code & ((1 << self.man_bits) - 1)
            if self.specials == "ieee" and exp == top_exp:
                out[code] = sign * math.inf if man == 0 else math.nan
            elif self.specials == "fn" and exp == top_exp and man == (1 << self.man_bits) - 1:
                out[code] = math.nan
            elif exp == 0:
                out[code] = sign * math.ldexp(man, self.emin - self.man_bits)
            else:
                out[code] = sign * math.ldexp((1 << self.man_bits) + man, exp - self.bias - self.man_bits)
        return out

    @functools.cached_property
    def grid(self) -> np.ndarray:
        """The non-negative finite values, ascending; ``grid[k]`` is the value of code ``k``."""
        half = self._table[: 1 << (self.bits - 1)]
        n_finite = int(np.argmax(~np.isfinite(half))) if not np.isfinite(half).all() else half.size
        g = half[:n_finite]
        assert np.all(np.diff(g) > 0), "positive codes must be monotonic"
        return g

    @property
    def max(self) -> float:
        """Largest finite value (E4M3 448, E5M2 57344, E2M3 7.5, E3M2 28, E2M1 6)."""
        return float(self.grid[-1])

    @property
    def emax(self) -> int:
        """Exponent of the largest binade, floor(log2(max)) — OCP's emax_elem."""
        return math.frexp(self.max)[1] - 1

    @property
    def nan_code(self) -> int:
        if not self.has_nan:
            raise ValueError(f"{self.name} has no NaN encoding")
        return int(np.flatnonzero(np.isnan(self._table))[0])

    def encode(self, x: np.ndarray, saturate: bool = True) -> np.ndarray:
        """Round ``x`` (any shape, float) to this format: uint8 codes, round-to-nearest, ties to even code.

        saturate=True: |x| beyond the max (and ±Inf) gives ±max ("satfinite").
        saturate=False: overflow gives ±Inf (IEEE-like formats) or NaN ("fn" formats), as RNE would.
        NaN gives the NaN code; a format without NaN raises ValueError (callers handle NaN blocks first).
        """
        x = np.asarray(x, dtype=np.float64)
        nan = np.isnan(x)
        if nan.any() and not self.has_nan:
            raise ValueError(f"{self.name} cannot encode NaN (no NaN code); handle NaN blocks first")
        a = np.where(nan, 0.0, np.abs(x))
        g = self.grid
        n = g.size
        idx = np.searchsorted(g, a, side="left")  # g[idx-1] < a <= g[idx]
        hi = np.minimum(idx, n - 1)
        lo = np.maximum(np.minimum(idx - 1, n - 1), 0)
        mid = (g[lo] + g[hi]) * 0.5  # exact: neighbours are short dyadic rationals
        choose_hi = (a > mid) | ((a == mid) & (hi % 2 == 0))
        mag = np.where(choose_hi, hi, lo).astype(np.uint16)
        if not saturate:
            ulp_top = g[-1] - g[-2]
            thr = g[-1] + ulp_top / 2  # the tie to the (virtual) next code, which has index n
            over = (a > thr) | ((a == thr) & (n % 2 == 0))
            if self.has_inf:
                inf_code = int(np.flatnonzero(np.isposinf(self._table))[0])
                mag = np.where(over, inf_code, mag)
            elif self.has_nan:
                mag = np.where(over, self.nan_code, mag)
            else:
                raise ValueError(f"{self.name} has no Inf/NaN: only saturating conversion is defined")
        sign = np.signbit(x).astype(np.uint16) << (self.bits - 1)
        codes = (mag | sign).astype(np.uint8)
        if nan.any():
            codes = np.where(nan, np.uint8(self.nan_code), codes)
        return codes

    def decode(self, codes: np.ndarray) -> np.ndarray:
        """Values (float64) of uint8 codes."""
        codes = np.asarray(codes)
        if codes.size and int(codes.max(initial=0)) >= (1 << self.bits):
            raise ValueError(f"{self.name}: code out of range (>= 2**{self.bits})")
        return self._table[codes.astype(np.intp)]

    def round(self, x: np.ndarray, saturate: bool = True) -> np.ndarray:
        """``decode(encode(x))``: x rounded to the nearest representable value (float64)."""
        return self.decode(self.encode(x, saturate=saturate))


E4M3 = Minifloat("e4m3", exp_bits=4, man_bits=3, bias=7, specials="fn")
E5M2 = Minifloat("e5m2", exp_bits=5, man_bits=2, bias=15, specials="ieee")
E2M3 = Minifloat("e2m3", exp_bits=2, man_bits=3, bias=1, specials="none")
E3M2 = Minifloat("e3m2", exp_bits=3, man_bits=2, bias=3, specials="none")
E2M1 = Minifloat("e2m1", exp_bits=2, man_bits=1, bias=1, specials="none")
MINIFLOATS = {m.name: m for m in (E4M3, E5M2, E2M3, E3M2, E2M1)}

E8M0_NAN = 0xFF
E8M0_BIAS = 127


def e8m0_decode(codes: np.ndarray) -> np.ndarray:
    """E8M0 scale codes -> 2**(code - 127) as float64; code 0xFF is NaN."""
    codes = np.asarray(codes).astype(np.int64)
    out = np.ldexp(1.0, codes - E8M0_BIAS)
    return np.where(codes == E8M0_NAN, np.nan, out)


def bf16_encode(x: np.ndarray) -> np.ndarray:
    """x -> float32 (IEEE RNE) -> bf16 bit patterns (uint16) by round-to-nearest-even of the fp32 bits."""
    bits = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
    nan = np.isnan(np.asarray(x, dtype=np.float32))
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    quiet_nan = ((bits >> 16) & 0x8000) | 0x7FC0
    return np.where(nan, quiet_nan, rounded).astype(np.uint16)


def bf16_decode(codes: np.ndarray) -> np.ndarray:
    """bf16 bit patterns (uint16) -> float64 (exact)."""
    return (np.asarray(codes, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32).astype(np.float64)


# ------------------------------------------------------------------------------------------------------------
# Quantized tensors and formats
# ------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class Quantized:
    """A quantized tensor.

    format:       format name (``get_format(format)`` dequantizes it).
    role:         "weight" | "activation" (only fp8_block tiles them differently).
    shape:        shape of the original tensor.
    codes:        element codes, same shape as the tensor (uint8; uint16 bit patterns for bf16). Stored
                  one per byte here; ``nbytes`` counts them packed at the format's element width.
    scales:       decoded block scales (float64, NaN for a NaN block), shape = block grid:
                  ``shape[:-1] + (ceil(K / block),)``, or ``shape[:-2] + (ceil(M/128), ceil(K/128))`` for
                  fp8_block weights; None for per-tensor formats and bf16.
    scale_codes:  uint8 codes of 8-bit scales (E8M0 for MX, E4M3 for nvfp4); None for fp32 / no scales.
    tensor_scale: the per-tensor fp32 scale (fp8, nvfp4), else None.
    """

    format: str
    role: str
    shape: tuple[int, ...]
    codes: np.ndarray
    scales: np.ndarray | None = None
    scale_codes: np.ndarray | None = None
    tensor_scale: float | None = None
    element_bits: int = 8
    scale_bits: int = 0

    @property
    def nbytes(self) -> float:
        """Storage bytes with elements packed at their width, block scales at their width (fp32 = 32 bits),
        plus 4 B for a per-tensor fp32 scale."""
        n = self.codes.size * self.element_bits / 8
        if self.scales is not None:
            n += self.scales.size * self.scale_bits / 8
        if self.tensor_scale is not None:
            n += 4
        return n


def _check_role(role: str) -> None:
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")


def _as_float(x) -> np.ndarray:
    arr = np.asarray(x)
    if not (np.issubdtype(arr.dtype, np.floating) or np.issubdtype(arr.dtype, np.integer)):
        raise ValueError(f"quantize needs a real numeric array, got dtype {arr.dtype}")
    return arr.astype(np.float64)


def _blocks_last_axis(x: np.ndarray, block: int) -> np.ndarray:
    """[..., K] -> [..., ceil(K/block), block], zero padded."""
    if x.ndim == 0:
        x = x.reshape(1)
    k = x.shape[-1]
    pad = (-k) % block
    if pad:
        x = np.concatenate([x, np.zeros(x.shape[:-1] + (pad,), dtype=x.dtype)], axis=-1)
    return x.reshape(x.shape[:-1] + (x.shape[-1] // block, block))


def _unblock_last_axis(xb: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    flat = xb.reshape(xb.shape[:-2] + (-1,))
    k = shape[-1] if shape else 1
    return flat[..., :k].reshape(shape)


def _finite_amax(x: np.ndarray, axis=None) -> np.ndarray:
    return np.max(np.where(np.isfinite(x), np.abs(x), 0.0), axis=axis, initial=0.0)


class Format:
    """A numeric format. Subclasses implement ``quantize`` / ``dequantize`` / ``bytes_per_element``."""

    name: str
    element_bits: int
    description: str

    def bytes_per_element(self, role: Role = "weight") -> float:
        raise NotImplementedError

    def quantize(self, x, role: Role = "weight") -> Quantized:
        raise NotImplementedError

    def dequantize(self, q: Quantized) -> np.ndarray:
        raise NotImplementedError

    def roundtrip(self, x, role: Role = "weight") -> np.ndarray:
        """dequantize(quantize(x)): what the tensor looks like after a trip through this format (float64)."""
        return self.dequantize(self.quantize(x, role))

    def _check(self, q: Quantized) -> None:
        if q.format != self.name:
            raise ValueError(f"cannot dequantize a {q.format!r} tensor as {self.name!r}")


@dataclass(frozen=True)
class Bf16Format(Format):
    name: str = "bf16"
    element_bits: int = 16
    description: str = "bfloat16, no scales"

    def bytes_per_element(self, role: Role = "weight") -> float:
        _check_role(role)
        return 2.0

    def quantize(self, x, role: Role = "weight") -> Quantized:
        _check_role(role)
        x = _as_float(x)
        return Quantized(self.name, role, x.shape, bf16_encode(x), element_bits=16)

    def dequantize(self, q: Quantized) -> np.ndarray:
        self._check(q)
        return bf16_decode(q.codes)


@dataclass(frozen=True)
class PerTensorFormat(Format):
    """Minifloat elements, one fp32 scale per tensor: scale = fp32(amax / elem.max), finite amax."""

    name: str
    elem: Minifloat
    description: str = ""

    @property
    def element_bits(self) -> int:
        return self.elem.bits

    def bytes_per_element(self, role: Role = "weight") -> float:
        _check_role(role)
        return self.elem.bits / 8

    def quantize(self, x, role: Role = "weight") -> Quantized:
        _check_role(role)
        x = _as_float(x)
        scale = float(np.float32(_finite_amax(x) / self.elem.max))
        scaled = x / scale if scale > 0 else np.where(np.isfinite(x), 0.0, x)
        codes = self.elem.encode(scaled, saturate=True)
        return Quantized(self.name, role, x.shape, codes, tensor_scale=scale, element_bits=self.elem.bits)

    def dequantize(self, q: Quantized) -> np.ndarray:
        self._check(q)
        return self.elem.decode(q.codes) * q.tensor_scale


@dataclass(frozen=True)
class Fp8BlockFormat(Format):
    """E4M3, fp32 block scales: 1x``block`` along K for activations, ``block``x``block`` tiles for weights."""

    name: str = "fp8_block"
    elem: Minifloat = E4M3
    block: int = 128
    description: str = "E4M3, fp32 scale per 1x128 (act) / 128x128 (weight)"

    @property
    def element_bits(self) -> int:
        return self.elem.bits

    def bytes_per_element(self, role: Role = "weight") -> float:
        _check_role(role)
        per_scale = self.block * self.block if role == "weight" else self.block
        return self.elem.bits / 8 + 4 / per_scale

    def _tiles(self, x: np.ndarray, role: str) -> np.ndarray:
        """activation: [..., K] -> [..., nK, 1, B]; weight: [..., M, K] -> [..., nM, nK, B, B] (zero pad)."""
        b = self.block
        if role == "activation":
            xb = _blocks_last_axis(x, b)
            return xb[..., None, :]
        x2 = x.reshape((1,) + x.shape) if x.ndim == 1 else x.reshape((1, 1)) if x.ndim == 0 else x
        m, k = x2.shape[-2:]
        pm, pk = (-m) % b, (-k) % b
        x2 = np.pad(x2, [(0, 0)] * (x2.ndim - 2) + [(0, pm), (0, pk)])
        lead = x2.shape[:-2]
        t = x2.reshape(lead + ((m + pm) // b, b, (k + pk) // b, b))
        return np.moveaxis(t, -3, -2)  # [..., nM, nK, B, B]

    def _untile(self, t: np.ndarray, shape: tuple[int, ...], role: str) -> np.ndarray:
        if role == "activation":
            return _unblock_last_axis(t[..., 0, :], shape)
        t = np.moveaxis(t, -2, -3)
        lead = t.shape[:-4]
        full = t.reshape(lead + (t.shape[-4] * t.shape[-3], t.shape[-2] * t.shape[-1]))
        if len(shape) == 0:
            return full[..., 0, 0].reshape(shape)
        if len(shape) == 1:
            return full[0, : shape[0]]
        return full[..., : shape[-2], : shape[-1]].reshape(shape)

    def quantize(self, x, role: Role = "weight") -> Quantized:
        _check_role(role)
        x = _as_float(x)
        t = self._tiles(x, role)
        scales = _finite_amax(t, axis=(-2, -1)) / self.elem.max
        scales = scales.astype(np.float32).astype(np.float64)
        s = scales[..., None, None]
        scaled = np.where(s > 0, t / np.where(s > 0, s, 1.0), np.where(np.isfinite(t), 0.0, t))
        codes_t = self.elem.encode(scaled, saturate=True)
        codes = self._untile(codes_t, x.shape, role)
        return Quantized(self.name, role, x.shape, codes, scales=scales, element_bits=8, scale_bits=32)

    def dequantize(self, q: Quantized) -> np.ndarray:
        self._check(q)
        vals = self.elem.decode(q.codes)
        t = self._tiles(vals, q.role)
        return self._untile(t * q.scales[..., None, None], q.shape, q.role)


@dataclass(frozen=True)
class MxFormat(Format):
    """OCP MX: ``block`` elements of ``elem`` share one E8M0 scale 2**X, X = floor(log2(amax)) - elem.emax."""

    name: str
    elem: Minifloat
    block: int = 32
    description: str = ""
    scale_rule: Literal["ocp", "ceil"] = "ocp"
    """"ocp": X = floor(log2(amax)) - emax_elem (the spec; the top binade may clip at the element max).
    "ceil": the smallest X with amax <= elem.max * 2**X (no clipping; some MXFP8 training recipes use it).
    The registered formats use "ocp"; construct ``MxFormat(..., scale_rule="ceil")`` to compare."""

    @property
    def element_bits(self) -> int:
        return self.elem.bits

    def bytes_per_element(self, role: Role = "weight") -> float:
        _check_role(role)
        return self.elem.bits / 8 + 1 / self.block

    def shared_exponent(self, amax: np.ndarray) -> np.ndarray:
        """Block scale exponent X (int64, clamped to [-127, 127]) for block amaxes (finite, >= 0)."""
        amax = np.asarray(amax, dtype=np.float64)
        _, e = np.frexp(amax)  # amax = m * 2**e, m in [0.5, 1) -> floor(log2 amax) = e - 1
        x = (e - 1 - self.elem.emax).astype(np.int64)
        if self.scale_rule == "ceil":
            x = x + (np.ldexp(amax, -x) > self.elem.max)
        elif self.scale_rule != "ocp":
            raise ValueError(f"{self.name}: scale_rule must be 'ocp' or 'ceil', got {self.scale_rule!r}")
        x = np.where(amax > 0, x, -E8M0_BIAS)
        return np.clip(x, -E8M0_BIAS, E8M0_BIAS).astype(np.int64)

    def quantize(self, x, role: Role = "weight") -> Quantized:
        _check_role(role)
        x = _as_float(x)
        xb = _blocks_last_axis(x, self.block)  # [..., nb, B]
        finite = np.isfinite(xb)
        bad = ~finite.all(axis=-1)  # block holds NaN or Inf
        shared = self.shared_exponent(_finite_amax(xb, axis=-1))
        scaled = np.ldexp(np.where(finite, xb, 0.0), -shared[..., None])  # exact: power-of-two scale
        codes_b = self.elem.encode(scaled, saturate=True)
        codes_b = np.where(bad[..., None], np.uint8(0), codes_b)
        scale_codes = np.where(bad, E8M0_NAN, shared + E8M0_BIAS).astype(np.uint8)
        codes = _unblock_last_axis(codes_b, x.shape)
        return Quantized(self.name, role, x.shape, codes, scales=e8m0_decode(scale_codes),
                         scale_codes=scale_codes, element_bits=self.elem.bits, scale_bits=8)

    def dequantize(self, q: Quantized) -> np.ndarray:
        self._check(q)
        vals = _blocks_last_axis(self.elem.decode(q.codes), self.block)
        out = vals * e8m0_decode(q.scale_codes)[..., None]  # NaN scale -> NaN block
        return _unblock_last_axis(out, q.shape)


@dataclass(frozen=True)
class Nvfp4Format(Format):
    """NVFP4: E2M1 elements, one E4M3 scale per 16 elements, one fp32 scale per tensor (amax / (6 * 448))."""

    name: str = "nvfp4"
    elem: Minifloat = E2M1
    scale_elem: Minifloat = E4M3
    block: int = 16
    description: str = "E2M1, E4M3 scale per 16, fp32 per tensor"

    @property
    def element_bits(self) -> int:
        return self.elem.bits

    def bytes_per_element(self, role: Role = "weight") -> float:
        _check_role(role)
        return self.elem.bits / 8 + self.scale_elem.bits / 8 / self.block

    def quantize(self, x, role: Role = "weight") -> Quantized:
        _check_role(role)
        x = _as_float(x)
        xb = _blocks_last_axis(x, self.block)
        finite = np.isfinite(xb)
        bad = ~finite.all(axis=-1)
        tensor_scale = float(np.float32(_finite_amax(x) / (self.elem.max * self.scale_elem.max)))
        bamax = _finite_amax(xb, axis=-1)
        if tensor_scale > 0:
            sb_codes = self.scale_elem.encode(bamax / self.elem.max / tensor_scale, saturate=True)
        else:
            sb_codes = np.zeros(bamax.shape, dtype=np.uint8)
        denom = self.scale_elem.decode(sb_codes)[..., None] * tensor_scale
        scaled = np.where(denom > 0, np.where(finite, xb, 0.0) / np.where(denom > 0, denom, 1.0), 0.0)
        codes_b = np.where(bad[..., None], np.uint8(0), self.elem.encode(scaled, saturate=True))
        sb_codes = np.where(bad, np.uint8(self.scale_elem.nan_code), sb_codes).astype(np.uint8)
        codes = _unblock_last_axis(codes_b, x.shape)
        return Quantized(self.name, role, x.shape, codes, scales=self.scale_elem.decode(sb_codes),
                         scale_codes=sb_codes, tensor_scale=tensor_scale, element_bits=4, scale_bits=8)

    def dequantize(self, q: Quantized) -> np.ndarray:
        self._check(q)
        vals = _blocks_last_axis(self.elem.decode(q.codes), self.block)
        out = vals * (self.scale_elem.decode(q.scale_codes)[..., None] * q.tensor_scale)
        return _unblock_last_axis(out, q.shape)


_FORMATS: dict[str, Format] = {
    "bf16": Bf16Format(),
    "fp8": PerTensorFormat("fp8", E4M3, "E4M3, fp32 scale per tensor"),
    "fp8_block": Fp8BlockFormat(),
    "mxfp8": MxFormat("mxfp8", E4M3, 32, "E4M3, E8M0 scale per 32"),
    "mxfp6": MxFormat("mxfp6", E2M3, 32, "E2M3, E8M0 scale per 32"),
    "mxfp4": MxFormat("mxfp4", E2M1, 32, "E2M1, E8M0 scale per 32"),
    "nvfp4": Nvfp4Format(),
    # completeness (not in FORMAT_NAMES: no GPU rate field of their own)
    "fp8_e5m2": PerTensorFormat("fp8_e5m2", E5M2, "E5M2, fp32 scale per tensor"),
    "mxfp8_e5m2": MxFormat("mxfp8_e5m2", E5M2, 32, "E5M2, E8M0 scale per 32"),
    "mxfp6_e3m2": MxFormat("mxfp6_e3m2", E3M2, 32, "E3M2, E8M0 scale per 32"),
    "mxfp8_ceil": MxFormat("mxfp8_ceil", E4M3, 32, "E4M3, E8M0 scale per 32, ceil rule (no clipping)",
                           scale_rule="ceil"),
}

#: The format names every layer uses (scenarios, plans, calibration keys; the same strings as
#: ``topology.specs.FormatRates`` fields; docs/ARCHITECTURE.md "Conventions").
FORMAT_NAMES: tuple[str, ...] = ("bf16", "fp8", "fp8_block", "mxfp8", "mxfp6", "mxfp4", "nvfp4")
#: Extra variants accepted by ``get_format``.
EXTRA_FORMAT_NAMES: tuple[str, ...] = ("fp8_e5m2", "mxfp8_e5m2", "mxfp6_e3m2", "mxfp8_ceil")


def get_format(name: str) -> Format:
    """The format called ``name`` (see ``FORMAT_NAMES`` / ``EXTRA_FORMAT_NAMES``); ValueError if unknown."""
    try:
        return _FORMATS[name]
    except (KeyError, TypeError):
        known = ", ".join(FORMAT_NAMES + EXTRA_FORMAT_NAMES)
        raise ValueError(f"unknown numeric format {name!r}; known: {known}") from None


def relative_error(x, fmt: str | Format, role: Role = "weight") -> float:
    """||x - dequantize(quantize(x))||_2 / ||x||_2 for a finite array x (what ``rackbed formats`` prints)."""
    f = get_format(fmt) if isinstance(fmt, str) else fmt
    x = _as_float(x)
    y = f.roundtrip(x, role)
    den = float(np.linalg.norm(x))
    return float(np.linalg.norm(x - y)) / den if den > 0 else 0.0


__all__ = [
    "E2M1", "E2M3", "E3M2", "E4M3", "E5M2", "EXTRA_FORMAT_NAMES", "FORMAT_NAMES", "MINIFLOATS", "ROLES",
    "Bf16Format", "Format", "Fp8BlockFormat", "Minifloat", "MxFormat", "Nvfp4Format", "PerTensorFormat",
    "Quantized", "bf16_decode", "bf16_encode", "e8m0_decode", "get_format", "relative_error",
]
