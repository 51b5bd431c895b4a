"""Cross-check the numpy element encoders against torch's casts (independent implementations of IEEE/OCP RNE).

torch (2.13, CPU): float32 -> float8_e4m3fn is round-to-nearest-even and saturates (overflow and ±inf -> ±448,
i.e. ``encode(saturate=True)``); float32 -> float8_e5m2 and -> bfloat16 are IEEE RNE with overflow to ±inf
(``encode(saturate=False)``).
"""

from __future__ import annotations

import numpy as np
import pytest

from rackbed.engine.core.formats import E4M3, E5M2, bf16_decode, bf16_encode

torch = pytest.importorskip("torch")


def _probe_values(m, rng) -> np.ndarray:
    """Grid points, exact ties, neighbours of ties, random values over the whole range (float32), ±."""
    g = m.grid.astype(np.float32)
    mids = ((m.grid[:-1] + m.grid[1:]) / 2).astype(np.float32)
    near = np.concatenate([np.nextafter(mids, np.float32(0)), np.nextafter(mids, np.float32(np.inf))])
    lo, hi = np.log2(m.grid[1]) - 2, np.log2(m.max) + 1
    rand = (2.0 ** rng.uniform(lo, hi, 5000)).astype(np.float32)
    x = np.concatenate([g, mids, near, rand, np.float32([m.max * 1.04, m.max * 1.1, 1e30])])
    return np.concatenate([x, -x])


@pytest.mark.parametrize("m, tdtype, saturate", [(E4M3, "float8_e4m3fn", True), (E5M2, "float8_e5m2", False)])
def test_fp8_encode_matches_torch(m, tdtype, saturate):
    x = _probe_values(m, np.random.default_rng(0))
    x = np.concatenate([x, np.float32([np.inf, -np.inf, np.nan])])
    ref = torch.from_numpy(x).to(getattr(torch, tdtype)).to(torch.float64).numpy()
    got = m.round(x, saturate=saturate)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(ref))
    ok = ~np.isnan(ref)
    np.testing.assert_array_equal(got[ok], ref[ok])
    codes = torch.from_numpy(x).to(getattr(torch, tdtype)).view(torch.uint8).numpy()
    np.testing.assert_array_equal(m.encode(x, saturate=saturate)[ok], codes[ok])


def test_bf16_matches_torch():
    rng = np.random.default_rng(1)
    bits = rng.integers(0, 2**32, 20000, dtype=np.uint64).astype(np.uint32)
    x = bits.view(np.float32)
    x = x[~np.isnan(x)]
    ref = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(bf16_encode(x), ref)
    np.testing.assert_array_equal(bf16_decode(ref), torch.from_numpy(x).to(torch.bfloat16).double().numpy())
