"""rackbed.kernels.moe_reference: routing, EP prefill and DP-EP decode plans, and the numpy references."""

from __future__ import annotations

import sys

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rackbed.kernels import moe_reference as moe
from rackbed.kernels.moe_reference import (
    ACTIVATION_BYTES_PER_ELEMENT_FALLBACK,
    DpEpDecodePlan,
    EpPrefillPlan,
    Routing,
    activation_bytes_per_element,
    expected_tokens_per_expert,
    reference_moe_dense,
    reference_moe_dp_ep_decode,
    reference_moe_ep_prefill,
    route,
)

MANY = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _random_counts(rng: np.random.Generator, T: int, E: int, k: int, concentrated: bool) -> np.ndarray:
    """Per-expert counts with sum T*k and each <= T: random, or packed onto as few experts as possible."""
    counts = np.zeros(E, dtype=np.int64)
    left = T * k
    for e in rng.permutation(E):
        take = min(T, left) if concentrated else int(rng.integers(0, min(T, left) + 1))
        counts[e] += take
        left -= take
    for e in rng.permutation(E):  # top up (always possible: E*T >= T*k)
        take = min(T - counts[e], left)
        counts[e] += take
        left -= take
    assert left == 0
    return counts


@st.composite
def routings(draw, max_tokens: int = 12, max_experts: int = 8):
    T = draw(st.integers(0, max_tokens))
    E = draw(st.integers(1, max_experts))
    k = draw(st.integers(1, min(E, 4)))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    dist = draw(st.sampled_from(["uniform", "zipf", "counts", "concentrated"]))
    if dist in ("counts", "concentrated"):
        counts = _random_counts(rng, T, E, k, dist == "concentrated")
        return route(T, E, k, dist="counts", counts=counts, rng=rng), counts
    return route(T, E, k, dist=dist, zipf_s=draw(st.floats(0, 3)), rng=rng), None


def _check_valid(r: Routing, T: int, E: int, k: int) -> None:
    assert r.topk_ids.shape == r.topk_weights.shape == (T, k)
    assert r.tokens_per_expert.shape == (E,)
    assert ((r.topk_ids >= 0) & (r.topk_ids < E)).all()
    for row in r.topk_ids:
        assert len(set(row.tolist())) == k  # distinct experts per token
    assert r.tokens_per_expert.sum() == T * k
    np.testing.assert_array_equal(r.tokens_per_expert, np.bincount(r.topk_ids.ravel(), minlength=E))
    assert (r.topk_weights > 0).all()
    np.testing.assert_allclose(r.topk_weights.sum(axis=1), 1.0)


# --------------------------------------------------------------------------------------------- routing


def test_expected_tokens_per_expert_prefill_example():
    assert expected_tokens_per_expert(6000, 128, 8) == 375
    r = route(6000, 128, 8, rng=np.random.default_rng(0))
    _check_valid(r, 6000, 128, 8)
    assert r.tokens_per_expert.mean() == 375
    # binomial(6000, 1/16): sd ~ 18.8; min/max within ~ 4 sd of 375 for this seed
    assert 300 < r.tokens_per_expert.min() <= 375 <= r.tokens_per_expert.max() < 450


@MANY
@given(case=routings())
def test_route_is_valid_and_counts_are_realised_exactly(case):
    r, counts = case
    _check_valid(r, r.n_tokens, r.n_experts, r.top_k)
    if counts is not None:
        np.testing.assert_array_equal(r.tokens_per_expert, counts)


def test_zipf_is_skewed_and_uniform_is_not():
    rng = np.random.default_rng(3)
    z = route(4000, 64, 4, dist="zipf", zipf_s=1.2, rng=rng).tokens_per_expert
    u = route(4000, 64, 4, dist="uniform", rng=rng).tokens_per_expert
    assert z[0] > 3 * expected_tokens_per_expert(4000, 64, 4) and z[0] > z[-1] * 5
    assert z[0] == z.max() and z[:8].sum() > z[-8:].sum() * 5
    assert u.max() < 2 * u.min()
    z0 = route(4000, 64, 4, dist="zipf", zipf_s=0.0, rng=rng).tokens_per_expert  # s=0 is uniform
    assert z0.max() < 2 * z0.min()


def test_route_is_deterministic_in_the_rng_and_rejects_bad_input():
    a = route(50, 16, 4, dist="zipf", rng=np.random.default_rng(7))
    b = route(50, 16, 4, dist="zipf", rng=np.random.default_rng(7))
    np.testing.assert_array_equal(a.topk_ids, b.topk_ids)
    np.testing.assert_array_equal(a.topk_weights, b.topk_weights)
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match="summing to T\\*k"):
        route(4, 4, 2, dist="counts", counts=[4, 4, 0, 1], rng=rng)
    with pytest.raises(ValueError, match="0..4"):
        route(4, 4, 2, dist="counts", counts=[5, 3, 0, 0], rng=rng)  # one expert cannot take 5 of 4 tokens
    with pytest.raises(ValueError, match="top_k"):
        route(4, 4, 5, rng=rng)
    with pytest.raises(ValueError, match="dist must be"):
        route(4, 4, 2, dist="gauss", rng=rng)
    with pytest.raises(ValueError, match="same expert twice"):
        Routing.from_ids([[1, 1]], [[0.5, 0.5]], 4)
    with pytest.raises(ValueError, match="ep must be"):
        EpPrefillPlan.build(a, 17)
    with pytest.raises(ValueError, match="read-only"):
        a.topk_ids[0, 0] = 3


# --------------------------------------------------------------------------------------------- plans


@pytest.mark.slow
@MANY
@given(case=routings(), data=st.data())
def test_plans_against_brute_force(case, data):
    r, _ = case
    T, E, k = r.n_tokens, r.n_experts, r.top_k
    ep = data.draw(st.integers(1, E))
    dp = data.draw(st.integers(1, 5))
    src = np.asarray(data.draw(st.lists(st.integers(0, dp - 1), min_size=T, max_size=T)), dtype=np.int64)
    starts = moe.expert_starts(E, ep)
    owner_of = {e: d for d in range(ep) for e in range(starts[d], starts[d + 1])}
    assert np.diff(starts).tolist() == [E // ep + 1] * (E % ep) + [E // ep] * (ep - E % ep)  # first ranks +1

    # prefill: every (token, slot) pair lands in exactly one GEMM row of the rank owning its expert
    pre = EpPrefillPlan.build(r, ep)
    seen = set()
    for d in range(ep):
        for le, (toks, slots) in enumerate(zip(pre.expert_token_ids[d], pre.expert_slots[d])):
            e = starts[d] + le
            assert (r.topk_ids[toks, slots] == e).all()
            seen |= {(int(t), int(s)) for t, s in zip(toks, slots)}
            assert pre.gemm_rows[d][le] == len(toks) == r.tokens_per_expert[e]
        want = sorted({t for t in range(T) for e in r.topk_ids[t] if owner_of[int(e)] == d})
        assert pre.token_ids[d].tolist() == want
    assert seen == {(t, s) for t in range(T) for s in range(k)}
    assert pre.combine_allreduce_bytes(hidden=4096) == T * 4096 * 2

    # decode: tokens[src, dst] counts each token once per destination rank (dedup)
    dec = DpEpDecodePlan.build(r, ep, dp, src)
    brute = np.zeros((dp, ep), dtype=np.int64)
    for t in range(T):
        for d in {owner_of[int(e)] for e in r.topk_ids[t]}:
            brute[src[t], d] += 1
    np.testing.assert_array_equal(dec.tokens, brute)
    assert dec.max_recv_tokens == brute.sum(axis=0).max() and dec.max_send_tokens == brute.sum(axis=1).max()
    np.testing.assert_array_equal(dec.recv_tokens, brute.sum(axis=0))
    for s in range(dp):
        for d in range(ep):
            assert len(dec.send_token_ids[s][d]) == brute[s, d]
            assert (src[dec.send_token_ids[s][d]] == s).all()
    assert sum(len(rows) for d in range(ep) for rows in dec.expert_rows[d]) == T * k
    np.testing.assert_allclose(dec.dispatch_bytes(64, "mxfp8"), brute * 64 * (1 + 1 / 32))
    np.testing.assert_allclose(dec.combine_bytes(64, "bf16"), brute.T * 64 * 2)


def test_decode_plan_by_hand():
    """T=4, E=4 (ep=2: experts {0,1} on rank 0, {2,3} on rank 1), dp=2 (tokens 0,1 on rank 0; 2,3 on rank 1).

    token 0 -> experts 0,1 (both rank 0: sent once), token 1 -> 1,2, token 2 -> 2,3 (rank 1 once), token 3 -> 0,3.
    """
    r = Routing.from_ids([[0, 1], [1, 2], [2, 3], [0, 3]], np.full((4, 2), 0.5), 4)
    dec = DpEpDecodePlan.build(r, ep=2, dp=2)
    np.testing.assert_array_equal(dec.tokens, [[2, 1], [1, 2]])
    np.testing.assert_array_equal(dec.remote_tokens(), [[0, 1], [1, 0]])
    assert dec.max_recv_tokens == 3 and dec.max_send_tokens == 3
    # Qwen3-235B hidden 4096: bf16 8192 B/token, fp8_block 4224 B/token (1 B + 4 B per 128), mxfp8 4224 B
    np.testing.assert_allclose(dec.dispatch_bytes(4096, "bf16"), [[16384, 8192], [8192, 16384]])
    np.testing.assert_allclose(dec.dispatch_bytes(4096, "fp8_block"), [[8448, 4224], [4224, 8448]])
    np.testing.assert_allclose(dec.dispatch_bytes(4096, "mxfp8"), [[8448, 4224], [4224, 8448]])
    # the list-of-routings form numbers tokens rank by rank and gives the same plan
    per_rank = [
        Routing.from_ids(r.topk_ids[:2], r.topk_weights[:2], 4),
        Routing.from_ids(r.topk_ids[2:], r.topk_weights[2:], 4),
    ]
    np.testing.assert_array_equal(DpEpDecodePlan.build(per_rank, ep=2).tokens, dec.tokens)
    pre = EpPrefillPlan.build(r, ep=2)
    assert [g.tolist() for g in pre.gemm_rows] == [[2, 2], [2, 2]]
    assert [t.tolist() for t in pre.token_ids] == [[0, 1, 3], [1, 2, 3]]


def test_activation_bytes_fallback_matches_formats(monkeypatch):
    for name, value in ACTIVATION_BYTES_PER_ELEMENT_FALLBACK.items():
        assert activation_bytes_per_element(name) == pytest.approx(value)
    from rackbed import engine

    monkeypatch.setitem(sys.modules, "rackbed.engine.core.formats", None)  # as if formats.py did not exist yet
    monkeypatch.delattr(engine.core, "formats", raising=False)
    assert activation_bytes_per_element("fp8_block") == 1 + 4 / 128
    with pytest.raises(ValueError, match="unknown activation format"):
        activation_bytes_per_element("int3")


# --------------------------------------------------------------------------------------------- references


@pytest.mark.slow
@MANY
@given(case=routings(max_tokens=10, max_experts=6), data=st.data())
def test_dispatch_gemm_combine_equals_dense_moe(case, data):
    r, _ = case
    T, E = r.n_tokens, r.n_experts
    D = data.draw(st.integers(1, 5))
    F = data.draw(st.integers(1, 4))
    ep = data.draw(st.integers(1, E))
    dp = data.draw(st.integers(1, 4))
    contiguous = data.draw(st.booleans())
    src = None if contiguous else data.draw(st.lists(st.integers(0, dp - 1), min_size=T, max_size=T))
    algo = data.draw(st.sampled_from(["two_shot", "ring", "nvls", "one_shot"]))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    x = rng.standard_normal((T, D))
    w_gate_up = rng.standard_normal((E, 2 * F, D))
    w_down = rng.standard_normal((E, D, F))

    dense = reference_moe_dense(x, r, w_gate_up, w_down)
    assert dense.shape == (T, D)
    for out in reference_moe_ep_prefill(x, r, w_gate_up, w_down, ep, allreduce=algo):
        np.testing.assert_allclose(out, dense, rtol=1e-10, atol=1e-10)
    dec = reference_moe_dp_ep_decode(x, r, w_gate_up, w_down, ep, dp, src)
    np.testing.assert_allclose(dec, dense, rtol=1e-10, atol=1e-10)


def test_dense_reference_by_hand():
    """One token, one expert, D=F=1: y = w * wd * silu(wg*x) * (wu*x)."""
    r = Routing.from_ids([[0]], [[1.0]], 2)
    x = np.array([[2.0]])
    w_gate_up = np.array([[[0.5], [3.0]], [[9.0], [9.0]]])  # expert 0: g = 1, u = 6; expert 1 unused
    w_down = np.array([[[0.25]], [[9.0]]])
    silu1 = 1 / (1 + np.exp(-1.0))
    assert reference_moe_dense(x, r, w_gate_up, w_down)[0, 0] == pytest.approx(0.25 * silu1 * 6)
    assert reference_moe_dp_ep_decode(x, r, w_gate_up, w_down, ep=2, dp=1)[0, 0] == pytest.approx(
        0.25 * silu1 * 6
    )


def test_all_tokens_on_one_expert_and_empty_experts():
    rng = np.random.default_rng(5)
    T, E, D, F = 7, 4, 3, 2
    r = route(T, E, 1, dist="counts", counts=[0, 0, T, 0], rng=rng)
    x = rng.standard_normal((T, D))
    wg, wd = rng.standard_normal((E, 2 * F, D)), rng.standard_normal((E, D, F))
    dense = reference_moe_dense(x, r, wg, wd)
    np.testing.assert_allclose(reference_moe_ep_prefill(x, r, wg, wd, ep=4)[3], dense, rtol=1e-12)
    np.testing.assert_allclose(reference_moe_dp_ep_decode(x, r, wg, wd, ep=4, dp=3), dense, rtol=1e-12)
    dec = DpEpDecodePlan.build(r, ep=4, dp=3)
    assert dec.tokens[:, [0, 1, 3]].sum() == 0 and dec.max_recv_tokens == T
