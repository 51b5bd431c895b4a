"""MX / NVFP4 / FP8 quantize and dequantize as torch tensor programs (GPU or CPU), bit-identical to
engine/core/formats.py.

    from rackbed.kernels import mx
    q = mx.quantize(x, "mxfp4", role="weight")   # x: float tensor (any device); q.codes uint8, q.scale_codes uint8
    y = mx.dequantize(q)                          # float64 tensor, same shape as x

Formats: bf16, fp8 (per-tensor), fp8_block (1x128 act / 128x128 weight), mxfp8, mxfp6, mxfp4, nvfp4 and the extras
fp8_e5m2, mxfp8_e5m2, mxfp6_e3m2, mxfp8_ceil. The arithmetic is the reference's, step for step, in float64 on the
device: the same minifloat grid, ``searchsorted`` bracketing and midpoint tie rule, the same order of divisions,
exact power-of-two scaling (built from exponent bits, never ``pow``). Divisions always take a tensor divisor:
PyTorch's CUDA ``a / python_scalar`` multiplies by a rounded reciprocal, which would break bit-identity.
Results: ``codes`` [shape] uint8 (uint16 bf16 patterns as int32 for bf16), ``scale_codes`` uint8 block grid,
``scales`` float64 block grid (decoded), ``tensor_scale`` float (fp8, nvfp4).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from rackbed.engine.core import formats as ref


@dataclass(frozen=True, eq=False)
class TorchQuantized:
    """Same fields as engine.core.formats.Quantized, as torch tensors on the input's device."""

    format: str
    role: str
    shape: tuple
    codes: object
    scales: object | None = None
    scale_codes: object | None = None
    tensor_scale: float | None = None

    def to_reference(self) -> ref.Quantized:
        """The numpy ``Quantized`` (for ``formats.get_format(fmt).dequantize`` and comparisons)."""
        f = ref.get_format(self.format)
        np_ = (lambda t: None if t is None else t.detach().cpu().numpy())
        codes = np_(self.codes)
        if self.format == "bf16":
            codes = codes.astype(np.uint16)
        eb = f.element_bits
        sb = 32 if self.format == "fp8_block" else (8 if self.scale_codes is not None else 0)
        return ref.Quantized(self.format, self.role, tuple(self.shape), codes, np_(self.scales),
                             np_(self.scale_codes), self.tensor_scale, element_bits=eb, scale_bits=sb)


def _t():
    import torch

    return torch


def _pow2(e):
    """Exact 2**e (float64) for an int tensor e in [-1022, 1023], from the exponent bits."""
    torch = _t()
    return ((e.to(torch.int64) + 1023) << 52).view(torch.float64)


def _div(a, b):
    """a / b with a tensor divisor (never a host scalar: see module docstring)."""
    torch = _t()
    if not isinstance(b, torch.Tensor):
        b = torch.tensor(float(b), dtype=torch.float64, device=a.device)
    return torch.div(a, b.expand_as(a) if b.dim() == 0 else b)


def _grid(elem: ref.Minifloat, device):
    torch = _t()
    return torch.tensor(elem.grid, dtype=torch.float64, device=device)


def _table(elem: ref.Minifloat, device):
    torch = _t()
    return torch.tensor(elem._table, dtype=torch.float64, device=device)


def encode(x, elem: ref.Minifloat | str, saturate: bool = True):
    """Round float tensor ``x`` to ``elem`` codes (uint8), RNE ties-to-even code, like ``Minifloat.encode``."""
    torch = _t()
    m = ref.MINIFLOATS[elem] if isinstance(elem, str) else elem
    x = x.to(torch.float64)
    nan = torch.isnan(x)
    if bool(nan.any()) and not m.has_nan:
        raise ValueError(f"{m.name} cannot encode NaN (no NaN code); handle NaN blocks before encoding")
    a = torch.where(nan, torch.zeros_like(x), x.abs())
    g = _grid(m, x.device)
    n = g.numel()
    idx = torch.searchsorted(g, a.contiguous())  # left: g[idx-1] < a <= g[idx]
    hi = idx.clamp(max=n - 1)
    lo = (idx - 1).clamp(min=0, max=n - 1)
    mid = (g[lo] + g[hi]) * 0.5  # exact (power-of-two factor)
    choose_hi = (a > mid) | ((a == mid) & (hi % 2 == 0))
    mag = torch.where(choose_hi, hi, lo)
    if not saturate:
        gl = m.grid
        thr = gl[-1] + (gl[-1] - gl[-2]) / 2
        over = (a > thr) | ((a == thr) & (n % 2 == 0))
        if m.has_inf:
            special = int(np.flatnonzero(np.isposinf(m._table))[0])
        elif m.has_nan:
            special = m.nan_code
        else:
            raise ValueError(f"{m.name} has no Inf/NaN: only saturating conversion is defined")
        mag = torch.where(over, torch.full_like(mag, special), mag)
    sign = torch.signbit(x).to(torch.int64) << (m.bits - 1)
    codes = (mag | sign).to(torch.uint8)
    if m.has_nan:
        codes = torch.where(nan, torch.full_like(codes, m.nan_code), codes)
    return codes


def decode(codes, elem: ref.Minifloat | str):
    """uint8 codes -> float64 values (table lookup)."""
    torch = _t()
    m = ref.MINIFLOATS[elem] if isinstance(elem, str) else elem
    return _table(m, codes.device)[codes.to(torch.int64)]


def _blocks(x, block: int):
    """[..., K] -> [..., ceil(K/block), block] zero padded (x at least 1-d)."""
    torch = _t()
    if x.dim() == 0:
        x = x.reshape(1)
    pad = (-x.shape[-1]) % block
    if pad:
        x = torch.cat([x, torch.zeros(*x.shape[:-1], pad, dtype=x.dtype, device=x.device)], dim=-1)
    return x.reshape(*x.shape[:-1], x.shape[-1] // block, block)


def _unblock(xb, shape):
    flat = xb.reshape(*xb.shape[:-2], -1)
    k = shape[-1] if len(shape) else 1
    return flat[..., :k].reshape(shape)


def _finite_amax(x, dim=None):
    torch = _t()
    v = torch.where(torch.isfinite(x), x.abs(), torch.zeros_like(x))
    if dim is None:
        return v.max() if v.numel() else torch.zeros((), dtype=x.dtype, device=x.device)
    return v.amax(dim=dim) if v.numel() else torch.zeros(v.shape[:-1], dtype=x.dtype, device=x.device)


def _f32_round(v):
    torch = _t()
    return v.to(torch.float32).to(torch.float64)


def _quant_mx(x, f: ref.MxFormat, role):
    torch = _t()
    xb = _blocks(x, f.block)
    finite = torch.isfinite(xb)
    bad = ~finite.all(dim=-1)
    amax = _finite_amax(xb, dim=-1)
    _, e = torch.frexp(amax)
    sh = e.to(torch.int64) - 1 - f.elem.emax
    if f.scale_rule == "ceil":
        sh = sh + (amax * _pow2(-sh) > f.elem.max).to(torch.int64)
    sh = torch.where(amax > 0, sh, torch.full_like(sh, -ref.E8M0_BIAS)).clamp(-ref.E8M0_BIAS, ref.E8M0_BIAS)
    scaled = torch.where(finite, xb, torch.zeros_like(xb)) * _pow2(-sh)[..., None]
    codes_b = encode(scaled, f.elem, saturate=True)
    codes_b = torch.where(bad[..., None], torch.zeros_like(codes_b), codes_b)
    sc = torch.where(bad, torch.full_like(sh, ref.E8M0_NAN), sh + ref.E8M0_BIAS).to(torch.uint8)
    return TorchQuantized(f.name, role, tuple(x.shape), _unblock(codes_b, tuple(x.shape)), e8m0_decode(sc), sc)


def e8m0_decode(codes):
    """E8M0 codes -> 2**(code-127) float64, 0xFF -> NaN."""
    torch = _t()
    c = codes.to(torch.int64)
    v = _pow2(c - ref.E8M0_BIAS)
    return torch.where(c == ref.E8M0_NAN, torch.full_like(v, float("nan")), v)


def _quant_nvfp4(x, f: ref.Nvfp4Format, role):
    torch = _t()
    xb = _blocks(x, f.block)
    finite = torch.isfinite(xb)
    bad = ~finite.all(dim=-1)
    ts = _f32_round(_div(_finite_amax(x), f.elem.max * f.scale_elem.max))  # both exact: 6 * 448
    bamax = _finite_amax(xb, dim=-1)
    if float(ts) > 0:
        sb = encode(_div(_div(bamax, f.elem.max), ts), f.scale_elem, saturate=True)
    else:
        sb = torch.zeros(bamax.shape, dtype=torch.uint8, device=x.device)
    denom = decode(sb, f.scale_elem)[..., None] * ts
    pos = denom > 0
    num = torch.where(finite, xb, torch.zeros_like(xb))
    scaled = torch.where(pos, _div(num, torch.where(pos, denom, torch.ones_like(denom)).expand_as(num)),
                         torch.zeros_like(num))
    codes_b = torch.where(bad[..., None], torch.zeros(1, dtype=torch.uint8, device=x.device),
                          encode(scaled, f.elem, saturate=True))
    sb = torch.where(bad, torch.full_like(sb, f.scale_elem.nan_code), sb)
    return TorchQuantized(f.name, role, tuple(x.shape), _unblock(codes_b, tuple(x.shape)), decode(sb, f.scale_elem),
                          sb, float(ts))


def _quant_per_tensor(x, f: ref.PerTensorFormat, role):
    torch = _t()
    scale = _f32_round(_div(_finite_amax(x), f.elem.max))
    if float(scale) > 0:
        scaled = _div(x, scale)
    else:
        scaled = torch.where(torch.isfinite(x), torch.zeros_like(x), x)
    return TorchQuantized(f.name, role, tuple(x.shape), encode(scaled, f.elem, saturate=True),
                          tensor_scale=float(scale))


def _quant_fp8_block(x, f: ref.Fp8BlockFormat, role):
    torch = _t()
    b = f.block
    if role == "activation":
        t = _blocks(x, b)[..., None, :]  # [..., nK, 1, B]
    else:
        x2 = x.reshape(1, -1) if x.dim() == 1 else (x.reshape(1, 1) if x.dim() == 0 else x)
        m, k = x2.shape[-2:]
        pm, pk = (-m) % b, (-k) % b
        x2 = torch.nn.functional.pad(x2, (0, pk, 0, pm))
        lead = x2.shape[:-2]
        t = x2.reshape(*lead, (m + pm) // b, b, (k + pk) // b, b).movedim(-3, -2)  # [..., nM, nK, B, B]
    s = _f32_round(_div(_finite_amax(t.flatten(-2), dim=-1), f.elem.max))
    sx = s[..., None, None]
    pos = sx > 0
    scaled = torch.where(pos, _div(t, torch.where(pos, sx, torch.ones_like(sx)).expand_as(t)),
                         torch.where(torch.isfinite(t), torch.zeros_like(t), t))
    codes_t = encode(scaled, f.elem, saturate=True)
    if role == "activation":
        codes = _unblock(codes_t[..., 0, :], tuple(x.shape))
    else:
        full = codes_t.movedim(-2, -3)
        full = full.reshape(*full.shape[:-4], full.shape[-4] * full.shape[-3], full.shape[-2] * full.shape[-1])
        if x.dim() == 0:
            codes = full[..., 0, 0].reshape(())
        elif x.dim() == 1:
            codes = full[0, : x.shape[0]]
        else:
            codes = full[..., : x.shape[-2], : x.shape[-1]].reshape(x.shape)
    return TorchQuantized(f.name, role, tuple(x.shape), codes, s)


def _bf16(x, role):
    torch = _t()
    x32 = x.to(torch.float32)
    bits = x32.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    qn = ((bits >> 16) & 0x8000) | 0x7FC0
    return TorchQuantized("bf16", role, tuple(x.shape), torch.where(torch.isnan(x32), qn, rounded) & 0xFFFF)


def quantize(x, fmt: str, role: str = "weight") -> TorchQuantized:
    """Quantize float tensor ``x`` (any shape, any device) into ``fmt``; bit-identical to
    ``engine.core.formats.get_format(fmt).quantize(x.cpu().double().numpy(), role)``."""
    torch = _t()
    ref._check_role(role)
    f = ref.get_format(fmt)
    if torch.is_complex(x) or x.dtype == torch.bool:
        raise ValueError(f"mx.quantize: need a real tensor, got {x.dtype}")
    x = x.to(torch.float64)
    if isinstance(f, ref.MxFormat):
        return _quant_mx(x, f, role)
    if isinstance(f, ref.Nvfp4Format):
        return _quant_nvfp4(x, f, role)
    if isinstance(f, ref.Fp8BlockFormat):
        return _quant_fp8_block(x, f, role)
    if isinstance(f, ref.PerTensorFormat):
        return _quant_per_tensor(x, f, role)
    return _bf16(x, role)


def dequantize(q: TorchQuantized):
    """float64 tensor of q's shape; bit-identical to the reference ``dequantize``."""
    torch = _t()
    f = ref.get_format(q.format)
    shape = tuple(q.shape)
    if isinstance(f, ref.MxFormat):
        vals = _blocks(decode(q.codes, f.elem), f.block)
        return _unblock(vals * e8m0_decode(q.scale_codes)[..., None], shape)
    if isinstance(f, ref.Nvfp4Format):
        vals = _blocks(decode(q.codes, f.elem), f.block)
        s = decode(q.scale_codes, f.scale_elem)[..., None] * q.tensor_scale
        return _unblock(vals * s, shape)
    if isinstance(f, ref.PerTensorFormat):
        return decode(q.codes, f.elem) * q.tensor_scale
    if isinstance(f, ref.Fp8BlockFormat):
        vals = decode(q.codes, f.elem)
        if q.role == "activation":
            return _unblock(_blocks(vals, f.block) * q.scales[..., None], shape)
        b = f.block
        v2 = vals.reshape(1, -1) if vals.dim() == 1 else (vals.reshape(1, 1) if vals.dim() == 0 else vals)
        m, k = v2.shape[-2:]
        s = q.scales.repeat_interleave(b, dim=-2).repeat_interleave(b, dim=-1)[..., :m, :k]
        return (v2 * s).reshape(shape)
    return (q.codes.to(torch.int64) << 16).to(torch.int32).view(torch.float32).to(torch.float64)
