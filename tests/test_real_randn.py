"""Random weights of the real engine: a tensor over the one-draw limit is drawn a slice at a time (so DeepSeek-V3's
expert weights fit beside the layers already made), the same way for the same seed, with the same distribution;
one under the limit is the plain draw."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import rackbed.engine.real.model as M


@settings(max_examples=30, deadline=None)
@given(shape=st.lists(st.integers(1, 9), min_size=1, max_size=3), limit=st.integers(1, 400), seed=st.integers(0, 9))
def test_sliced_draw_deterministic_and_shaped(shape, limit, seed):
    old, M._RANDN_WHOLE = M._RANDN_WHOLE, limit
    try:
        draws = [M._randn(tuple(shape), torch.Generator().manual_seed(seed), 0.5, "cpu", torch.float32)
                 for _ in range(2)]
    finally:
        M._RANDN_WHOLE = old
    assert draws[0].shape == tuple(shape) and draws[0].dtype == torch.float32
    assert torch.equal(draws[0], draws[1])
    g = torch.Generator().manual_seed(seed)
    whole = torch.randn(tuple(shape), generator=g) * 0.5
    n = whole.numel()
    if n <= limit or len(shape) < 2 or shape[0] < 2:
        assert torch.equal(draws[0], whole)


def test_sliced_draw_has_the_distribution(monkeypatch):
    monkeypatch.setattr(M, "_RANDN_WHOLE", 10_000)
    t = M._randn((64, 100, 50), torch.Generator().manual_seed(3), 0.02, "cpu", torch.bfloat16)
    assert t.dtype == torch.bfloat16 and abs(float(t.float().std()) - 0.02) < 0.001
    assert abs(float(t.float().mean())) < 0.001
    # every slice drawn, none left at torch.empty's contents
    assert bool((t.float().reshape(64, -1).std(dim=1) > 0.015).all())
