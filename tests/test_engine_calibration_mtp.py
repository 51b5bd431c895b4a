"""The MTP terms of an aggregated engine calibration: steps with drafts are fitted after the plain steps, so a
model's plain fit is the same with or without MTP runs beside it, and the draft terms come back from steps made
with known coefficients; a file written before the terms existed loads with them at 0."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rackbed.sim.engine_calibration import (
    MIXED_TERMS,
    MTP_TERMS,
    EngineCalibration,
    _fit_mixed,
    touched_experts,
)

SPEC = SimpleNamespace(n_experts=256, top_k=8)


def _steps(coef: dict, n: int, rng: random.Random, *, drafts: bool) -> list[dict]:
    out = []
    for _ in range(n):
        b = rng.randint(1, 48) if drafts or rng.random() < 0.8 else 0  # a step with drafts decodes
        k = rng.randint(1, 3) if drafts and b else 0
        chunks = rng.randint(0, 2) if b else rng.randint(1, 2)
        toks = chunks * rng.choice([512, 1024, 2048])
        shape = {"step": 1.0, "touched_experts": touched_experts(b * (1 + k), 256, 8), "seqs": float(b),
                 "context": float(b * rng.randint(500, 3000)), "prefill_tokens": float(toks),
                 "pairs": float(toks * rng.randint(200, 2000)), "chunks": float(chunks), "drafts": float(k),
                 "draft_tokens": float(b * k)}
        noise = 1.0 + rng.uniform(-0.01, 0.01)  # measured steps scatter; a joint fit would move the plain terms
        out.append({"kind": "mixed", "shape": shape, "prefill_graphs": True,
                    "measured_s": noise * sum(coef[t] * shape[t] for t in MIXED_TERMS)})
    return out


@settings(max_examples=20, deadline=None)
@given(seed=st.integers(0, 10_000), per_draft=st.floats(1e-4, 5e-3), per_token=st.floats(0.0, 1e-4))
def test_draft_terms_recovered_and_plain_fit_kept(seed, per_draft, per_token):
    rng = random.Random(seed)
    coef = {"step": 4e-3, "touched_experts": 4e-5, "seqs": 2e-5, "context": 1e-8, "prefill_tokens": 1.5e-5,
            "pairs": 2e-8, "chunks": 2e-3, "drafts": per_draft, "draft_tokens": per_token}
    plain, drafted = _steps(coef, 120, rng, drafts=False), _steps(coef, 80, rng, drafts=True)
    alone, _ = _fit_mixed("plain", {}, plain, [], gpu="H200", model="m", holdout_every=3, spec=SPEC)
    both, _ = _fit_mixed("both", {}, plain + drafted, [], gpu="H200", model="m", holdout_every=3, spec=SPEC)
    assert all(alone.mixed_s[t] == 0.0 for t in MTP_TERMS)
    for t in MIXED_TERMS:
        if t not in MTP_TERMS:
            assert both.mixed_s[t] == pytest.approx(alone.mixed_s[t], rel=1e-9, abs=1e-15)
    # what the drafts add to a typical drafted step (k = 2, 24 sequences), within the scatter
    typical = {"drafts": 2.0, "draft_tokens": 48.0}
    got = sum(both.mixed_s[t] * typical[t] for t in MTP_TERMS)
    assert got == pytest.approx(per_draft * 2 + per_token * 48, rel=0.25, abs=5e-4)


def test_file_without_mtp_terms_prices_them_zero():
    old = {t: 1e-3 for t in MIXED_TERMS if t not in MTP_TERMS}
    cal = EngineCalibration(gpu="H200", model="m", decode_step_s=((1.0, 0.01),), prefill_s=(0.0, 0.0),
                            kv_transfer_s=(0.0, 0.0), mode="aggregated", mixed_s=old)
    assert list(cal.mixed_s) == list(MIXED_TERMS) and all(cal.mixed_s[t] == 0.0 for t in MTP_TERMS)
    with pytest.raises(ValueError, match="mixed_s"):
        EngineCalibration(gpu="H200", model="m", decode_step_s=((1.0, 0.01),), prefill_s=(0.0, 0.0),
                          kv_transfer_s=(0.0, 0.0), mode="aggregated", mixed_s={"step": 1e-3})
