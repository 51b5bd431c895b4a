"""Rotary embeddings of the model families, as transformers computes them.

``inv_freq`` comes from the default formula or YaRN (``rope_type: yarn``: NTK-by-parts interpolation between the
extrapolated and interpolated frequencies over the ``beta_fast``/``beta_slow`` correction range, and an attention
factor that scales cos/sin). Two ways to rotate: rotate-half (Qwen, GLM, gpt-oss; on the first ``rope_dim`` dims
when the rotary is partial) and DeepSeek's interleaved pairs ``(x0, x1), (x2, x3), ...``, whose result transformers
lays out de-interleaved (evens' rotation then odds'); q and k get the same layout, so their dot product is the
pairwise rotation's.
"""

from __future__ import annotations

import math

import torch


def inv_freq(dim: int, theta: float, scaling: dict, max_position: int) -> tuple[torch.Tensor, float]:
    """``(inv_freq [dim/2] fp32, attention factor)`` for ``dim`` rotary dims (transformers' default / YaRN)."""
    base = theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    if kind == "default":
        return 1.0 / base, 1.0
    if kind != "yarn":
        raise ValueError(f"rope_type {kind!r}: the torch engine implements default and yarn")
    factor = float(scaling.get("factor") or max_position / scaling["original_max_position_embeddings"])
    orig = scaling["original_max_position_embeddings"]

    def mscale(s: float, m: float = 1.0) -> float:
        return 1.0 if s <= 1 else 0.1 * m * math.log(s) + 1.0

    att = scaling.get("attention_factor")
    if att is None:
        m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        att = mscale(factor, m) / mscale(factor, m_all) if (m and m_all) else mscale(factor)
    fast, slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def corr_dim(rot: float) -> float:
        return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(theta))

    lo, hi = corr_dim(fast), corr_dim(slow)
    if scaling.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    if lo == hi:
        hi += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - lo) / (hi - lo), 0, 1)
    extra = 1 - ramp
    return (1.0 / (factor * base)) * (1 - extra) + (1.0 / base) * extra, float(att)


class Rope:
    """cos/sin tables of one model, cached per device; ``apply(x, pos)`` rotates the first ``dim`` dims of
    ``x [..., T, Dh]`` (positions ``pos [T]``, or ``[B]`` with ``x [..., B, Dh]``)."""

    def __init__(self, dim: int, theta: float, scaling: dict, max_position: int, interleave: bool = False) -> None:
        self.dim, self.interleave = dim, interleave
        self.inv, self.factor = inv_freq(dim, theta, scaling, max_position)
        self._inv_on: dict = {}

    def cos_sin(self, pos: torch.Tensor, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        inv = self._inv_on.get(pos.device)
        if inv is None:
            inv = self._inv_on[pos.device] = self.inv.to(pos.device)
        f = pos.to(torch.float32)[..., None] * inv
        return (f.cos() * self.factor).to(dtype), (f.sin() * self.factor).to(dtype)

    def apply(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        cos, sin = self.cos_sin(pos, x.dtype)
        d = self.dim
        xr = x[..., :d]
        if self.interleave:
            x1, x2 = xr[..., 0::2], xr[..., 1::2]
        else:
            x1, x2 = xr[..., : d // 2], xr[..., d // 2:]
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1)
        return out if d == x.shape[-1] else torch.cat((out, x[..., d:]), -1)


def rope_of(cfg) -> Rope:
    """The Rope of a ``TorchModelConfig``."""
    return Rope(cfg.rope_dim, cfg.rope_theta, cfg.rope, cfg.max_position, cfg.rope_interleave)
