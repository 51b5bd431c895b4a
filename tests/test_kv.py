"""KV layout addressing and the resharding planner: property tests (hypothesis) + mutation checks.

The checker ``check_plan`` is independent of the planner: it places a random logical KV tensor
X[layer, K/V, head, token, dim] into the source buffers with ``KvLayout.offset`` alone, executes the plan with
numpy, and compares with the destination buffers built the same way. The tests at the bottom break correct plans
on purpose (swap offsets, split a chunk, read a replica twice, ...) and require ``check_plan`` to notice.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rackbed.engine.core.kv import (
    KvLayout,
    TransferPlan,
    chunk_stats,
    execute_plan,
    hnd_vs_nhd,
    latent_source_ranks,
    merge_chunks,
    pages_needed,
    reshard_plan,
    source_rank,
    transfer_stats,
)
from rackbed.engine.core.sharding import tp_kv_head_shards

N_EXAMPLES = 300
SETTINGS = settings(max_examples=N_EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def valid_tps(n_heads: int) -> list[int]:
    return [t for t in range(1, 9) if (t <= n_heads and n_heads % t == 0) or (t > n_heads and t % n_heads == 0)]


@st.composite
def shards_st(draw, n_heads: int, allow_arbitrary: bool = True):
    """TP shards (split / replicated) or an arbitrary covering assignment (any order, replicas allowed)."""
    if allow_arbitrary and draw(st.booleans()):
        n_ranks = draw(st.integers(1, 4))
        shards = [list(draw(st.permutations(range(n_heads))))[:draw(st.integers(1, n_heads))]
                  for _ in range(n_ranks)]
        held = {h for s in shards for h in s}
        for h in range(n_heads):  # cover every head
            if h not in held:
                shards[draw(st.integers(0, n_ranks - 1))].append(h)
                held.add(h)
        return tuple(tuple(s) for s in shards)
    return tp_kv_head_shards(n_heads, draw(st.sampled_from(valid_tps(n_heads))))


@st.composite
def page_tables(draw, n_ranks: int, need: int, n_pages: int, rng_seed: int):
    rng = np.random.default_rng(rng_seed)
    if draw(st.booleans()):  # one table for all ranks
        return rng.permutation(n_pages)[:need]
    return [rng.permutation(n_pages)[:need] for _ in range(n_ranks)]


@st.composite
def transfers(draw, orders=("HND",)):
    """(src, dst, seq_len, src_pages, dst_pages, seed)."""
    n_heads = draw(st.sampled_from([1, 2, 4, 8]))
    L = draw(st.integers(1, 3))
    D = draw(st.sampled_from([1, 2, 4]))
    e = draw(st.sampled_from([1, 2]))
    seq_len = draw(st.integers(1, 80))
    ps, pd = draw(st.integers(1, 16)), draw(st.integers(1, 16))
    src_order, dst_order = draw(st.sampled_from(orders)), draw(st.sampled_from(orders))
    src_shards = draw(shards_st(n_heads))
    kind = draw(st.sampled_from(["dp", "tp", "any"]))
    if kind == "dp":
        dst_shards = (tuple(range(n_heads)),)
    else:
        dst_shards = draw(shards_st(n_heads, allow_arbitrary=kind == "any"))
    ns, nd = pages_needed(seq_len, ps), pages_needed(seq_len, pd)
    src = KvLayout(L, n_heads, D, e, ps, src_shards, ns + draw(st.integers(0, 3)), src_order)
    dst = KvLayout(L, n_heads, D, e, pd, dst_shards, nd + draw(st.integers(0, 3)), dst_order)
    seed = draw(st.integers(0, 2**32 - 1))
    sp = draw(page_tables(src.n_ranks, ns, src.n_pages, seed))
    dp = draw(page_tables(dst.n_ranks, nd, dst.n_pages, seed + 1))
    return src, dst, seq_len, sp, dp, seed


def element_offsets(layout: KvLayout, rank: int, seq_len: int, pages) -> tuple[np.ndarray, np.ndarray]:
    """(byte offsets [n_elem, e], logical byte ids [n_elem, e]) of every element of the sequence on ``rank``:
    logical tensor X[layer, plane (K/V, or 1 for a latent), head, token, dim]; a sliding layer holds only its
    latest ``window`` tokens (computed here from ``windows`` alone, not with the layout's helpers)."""
    heads = np.array(layout.shards[rank])
    L, H, D, e = layout.n_layers, layout.n_kv_heads, layout.head_dim, layout.elem_bytes
    planes = 1 if layout.latent else 2
    offs, ids = [], []
    for layer in range(L):
        w = layout.windows[layer] if layout.windows else 0
        t0 = seq_len - min(seq_len, w) if w else 0
        l, kv, h, t, d = np.meshgrid([layer], np.arange(planes), heads, np.arange(t0, seq_len), np.arange(D),
                                     indexing="ij")
        offs.append(layout.offset(rank, l, h, t, kv, d, pages).ravel())
        ids.append(((((l * planes + kv) * H + h) * seq_len + t) * D + d).ravel())
    off, elem_id = np.concatenate(offs), np.concatenate(ids)
    b = np.arange(e)
    return off[:, None] + b, elem_id[:, None] * e + b


def n_logical_bytes(layout: KvLayout, seq_len: int) -> int:
    return layout.n_layers * (1 if layout.latent else 2) * layout.n_kv_heads * seq_len * layout.head_dim \
        * layout.elem_bytes


def build_buffers(layout: KvLayout, seq_len: int, pages, logical: np.ndarray, rng):
    """Random-garbage buffers with the sequence's bytes placed; also the logical-id map and validity mask."""
    bufs, ids = [], []
    for r in range(layout.n_ranks):
        buf = rng.integers(0, 256, layout.rank_nbytes(r), dtype=np.uint8)
        idmap = np.full(layout.rank_nbytes(r), -1, dtype=np.int64)
        off, lid = element_offsets(layout, r, seq_len, pages)
        assert np.unique(off).size == off.size, "offset() maps two elements to one byte"
        buf[off] = logical[lid]
        idmap[off] = lid
        bufs.append(buf)
        ids.append(idmap)
    return bufs, ids


def check_plan(plan: TransferPlan, src, dst, seq_len, sp, dp, seed) -> None:
    """Assert every property the planner guarantees (AssertionError names the broken one)."""
    rng = np.random.default_rng(seed)
    n_logical = n_logical_bytes(src, seq_len)
    logical = rng.integers(0, 256, n_logical, dtype=np.uint8)
    src_bufs, src_ids = build_buffers(src, seq_len, sp, logical, rng)
    dst_init, dst_ids = build_buffers(dst, seq_len, dp, logical, rng)  # expected result: garbage + sequence
    dst_bufs = [rng.integers(0, 256, b.shape[0], dtype=np.uint8) for b in dst_init]
    for exp, got, idm in zip(dst_init, dst_bufs, dst_ids):  # same garbage outside the sequence
        exp[idm < 0] = got[idm < 0]
    src_before = [b.copy() for b in src_bufs]
    execute_plan(plan, src_bufs, dst_bufs)
    # 1. exact reproduction of the destination layout (and nothing else written)
    for r, (exp, got) in enumerate(zip(dst_init, dst_bufs)):
        assert np.array_equal(exp, got), f"destination rank {r} differs from the expected layout"
    assert all(np.array_equal(a, b) for a, b in zip(src_before, src_bufs)), "source modified"
    # 2. every destination byte of the sequence written exactly once, no other byte written
    for r in range(dst.n_ranks):
        cnt = np.zeros(dst.rank_nbytes(r) + 1, dtype=np.int64)
        m = plan.dst_rank == r
        np.add.at(cnt, plan.dst_offset[m], 1)
        np.add.at(cnt, plan.dst_offset[m] + plan.nbytes[m], -1)
        writes = np.cumsum(cnt)[:-1]
        assert np.array_equal(writes, (dst_ids[r] >= 0).astype(np.int64)), \
            f"destination rank {r}: bytes written {writes.max()} times / sequence bytes not written"
    # 3. every source byte read exists (is part of the sequence); 4. each logical byte read once per
    #    destination copy (replicated source heads are not read N times)
    reads = [src_ids[c.src_rank][c.src_offset:c.src_offset + c.nbytes] for c in plan]
    reads = np.concatenate(reads) if reads else np.zeros(0, dtype=np.int64)
    assert (reads >= 0).all(), "plan reads source bytes that are not part of the sequence"
    per_head_copies = np.bincount(np.concatenate([np.array(s) for s in dst.shards]), minlength=dst.n_kv_heads)
    L, H, S, D, e = src.n_layers, src.n_kv_heads, seq_len, src.head_dim, src.elem_bytes
    kept = np.zeros((L, S), dtype=np.int64)  # tokens each layer keeps (sliding layers: the window)
    for layer in range(L):
        w = src.windows[layer] if src.windows else 0
        kept[layer, S - min(S, w) if w else 0:] = 1
    expected_reads = (per_head_copies[None, None, :, None, None, None] * kept[:, None, None, :, None, None]
                      * np.ones((L, 1 if src.latent else 2, H, S, D, e), dtype=np.int64)).ravel()
    assert np.array_equal(np.bincount(reads, minlength=n_logical), expected_reads), \
        "a logical KV byte is read more (or less) often than destinations hold it"
    assert plan.total_bytes == sum(int((i >= 0).sum()) for i in dst_ids), "bytes moved != bytes needed"
    # 5. adjacent chunks merged: no two chunks of one (src, dst) pair continue each other on both sides
    ends = set(zip(plan.src_rank.tolist(), plan.dst_rank.tolist(), (plan.src_offset + plan.nbytes).tolist(),
                   (plan.dst_offset + plan.nbytes).tolist()))
    starts = set(zip(plan.src_rank.tolist(), plan.dst_rank.tolist(), plan.src_offset.tolist(),
                     plan.dst_offset.tolist()))
    assert not (ends & starts), "two chunks are contiguous on both sides but not merged"
    assert (plan.nbytes > 0).all(), "empty chunk"


# ---------------------------------------------------------------------------------------------------------------
# properties
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.slow
@SETTINGS
@given(transfers())
def test_hnd_reshard_reproduces_destination(t):
    src, dst, seq_len, sp, dp, seed = t
    check_plan(reshard_plan(src, dst, seq_len, sp, dp), src, dst, seq_len, sp, dp, seed)


@pytest.mark.slow
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(transfers(orders=("HND", "NHD")))
def test_any_order_reshard_reproduces_destination(t):
    """NHD and mixed HND/NHD layouts obey the same properties."""
    src, dst, seq_len, sp, dp, seed = t
    check_plan(reshard_plan(src, dst, seq_len, sp, dp), src, dst, seq_len, sp, dp, seed)


def n_token_runs(seq_len: int, ps: int, pd: int) -> int:
    """Token runs that stay inside one source page and one destination page (computed independently)."""
    return len(set(range(0, seq_len, ps)) | set(range(0, seq_len, pd)))


@pytest.mark.slow
@SETTINGS
@given(transfers(), st.integers(1, 6))
def test_hnd_needs_no_more_chunks_than_nhd_with_equal_full_pages(t, n_pages):
    """Same page size on both sides and whole pages: HND never needs more chunks than NHD (any shards, any page
    tables)."""
    src, dst, _, _, _, seed = t
    dst = KvLayout(dst.n_layers, dst.n_kv_heads, dst.head_dim, dst.elem_bytes, src.page_tokens, dst.shards,
                   n_pages + 2)
    src = src.with_pages(n_pages + 2)
    rng = np.random.default_rng(seed)
    sp = [rng.permutation(n_pages + 2)[:n_pages] for _ in range(src.n_ranks)]
    dp = rng.permutation(n_pages + 2)[:n_pages]
    hnd, nhd = hnd_vs_nhd(src, dst, n_pages * src.page_tokens, sp, dp)
    assert hnd <= nhd, (hnd, nhd)


@pytest.mark.slow
@SETTINGS
@given(transfers(), st.sampled_from([1, 2, 4]))
def test_hnd_far_fewer_chunks_for_head_sharded_sources(t, n_heads):
    """Source ranks holding one head each (TP >= KV heads), any page sizes, partial pages, any destination:
    HND needs no more chunks than NHD, and where a destination rank gathers >= 2 heads NHD needs at least
    seq_len / n_runs times more (~ the page size: one chunk per token and head instead of per page and head)."""
    _, dst, seq_len, _, _, seed = t
    rng = np.random.default_rng(seed)
    n_heads = min(n_heads, dst.n_kv_heads)
    shards = tuple(tuple(h for h in s if h < n_heads) or (0,) for s in dst.shards)
    dst = KvLayout(dst.n_layers, n_heads, dst.head_dim, dst.elem_bytes, dst.page_tokens, shards, dst.n_pages)
    tp = int(rng.choice([t for t in valid_tps(n_heads) if t >= n_heads]))
    src = KvLayout.tp_sharded(dst.n_layers, n_heads, dst.head_dim, dst.elem_bytes, int(rng.integers(1, 17)), tp,
                              seq_len)
    sp = rng.permutation(src.n_pages)[:pages_needed(seq_len, src.page_tokens)]
    dp = rng.permutation(dst.n_pages)[:pages_needed(seq_len, dst.page_tokens)]
    hnd = reshard_plan(src, dst, seq_len, sp, dp)
    nhd = reshard_plan(src.with_order("NHD"), dst.with_order("NHD"), seq_len, sp, dp)
    assert len(hnd) <= len(nhd), (len(hnd), len(nhd))
    runs = n_token_runs(seq_len, src.page_tokens, dst.page_tokens)
    for d in range(dst.n_ranks):  # per destination rank that gathers >= 2 heads
        if len(dst.shards[d]) >= 2:
            h_d, n_d = int((hnd.dst_rank == d).sum()), int((nhd.dst_rank == d).sum())
            assert n_d * runs >= h_d * seq_len, (d, h_d, n_d)


def test_nhd_wins_when_heads_stay_together_and_page_sizes_differ():
    """The exception: a source rank holding the same heads as the destination (no head resharding) with
    different page sizes. NHD keeps each token's heads contiguous and merges whole token runs; HND splits every
    run per head, so it needs n_heads times more chunks. Equal page sizes remove the difference."""
    src = KvLayout.tp_sharded(2, 4, 8, 2, 16, 1, 8)
    dst = KvLayout.tp_sharded(2, 4, 8, 2, 32, 1, 8)
    hnd, nhd = hnd_vs_nhd(src, dst, 100, np.arange(7), np.arange(4) * 2)
    assert hnd == 4 * nhd
    same = KvLayout.tp_sharded(2, 4, 8, 2, 16, 1, 8)
    assert hnd_vs_nhd(src, same, 96) == (2, 2)  # contiguous whole pages: one chunk per layer either way


def test_writeup_case_counts():
    """Qwen3-235B (94 layers, 4 KV heads), TP=4 prefiller -> DP decode rank, 64-token pages, 6000 tokens:
    HND = 94 layers x K/V x 4 heads x 94 pages chunks; NHD = one chunk per (layer, K/V, token, head)."""
    src = KvLayout.tp_sharded(94, 4, 128, 2, 64, 4, 100)
    dst = KvLayout.tp_sharded(94, 4, 128, 2, 64, 1, 100)
    plan = reshard_plan(src, dst, 6000)
    assert len(plan) == 94 * 2 * 4 * 94
    assert plan.total_bytes == 6000 * 192_512
    assert plan.nbytes.max() == 64 * 128 * 2  # one head's page of K or V
    two = KvLayout.tp_sharded(2, 4, 128, 2, 64, 4, 100)  # NHD on 2 layers (94 would take seconds)
    assert hnd_vs_nhd(two, KvLayout.tp_sharded(2, 4, 128, 2, 64, 1, 100), 6000) == \
        (2 * 2 * 4 * 94, 2 * 2 * 6000 * 4)


def test_replicas_spread_round_robin_by_layer():
    """TP=8 over 4 KV heads: each head is read once, layers alternating between its two replicas."""
    src = KvLayout.tp_sharded(6, 4, 8, 2, 16, 8, 8)
    dst = KvLayout.tp_sharded(6, 4, 8, 2, 16, 1, 8)
    stats = chunk_stats(reshard_plan(src, dst, 100))
    per_head_layer = 2 * 100 * 8 * 2  # K+V, tokens, dim, bytes
    assert stats.bytes_by_src == {r: 3 * per_head_layer for r in range(8)}
    assert stats.total_bytes == 4 * 6 * per_head_layer
    assert [int(source_rank(src, 0, layer)) for layer in range(4)] == [0, 1, 0, 1]
    assert [int(source_rank(src, 1, layer)) for layer in range(4)] == [3, 2, 3, 2]


def test_same_layout_contiguous_pages_is_one_chunk_per_layer_and_rank():
    """Identical TP layouts with identical contiguous page tables and full pages: one chunk per (rank, layer)
    region (the layer regions are n_pages apart, so they do not merge unless the cache is exactly full)."""
    lay = KvLayout.tp_sharded(3, 4, 8, 2, 16, 2, 10)
    plan = reshard_plan(lay, lay, 64)
    assert len(plan) == 2 * 3
    full = lay.with_pages(4)  # exactly full: the whole buffer is one chunk per rank
    assert len(reshard_plan(full, full, 64)) == 2


def test_transfer_stats_cached_and_fragmented():
    src = KvLayout.tp_sharded(2, 4, 8, 2, 16, 1, 10)
    a = transfer_stats(src, src, 64)
    assert transfer_stats(src, src, 64) is a
    assert a.n_chunks == 2 * 4  # fragmented pages: one chunk per (layer, page), K/V and heads merged in a page
    assert a.total_bytes == 2 * 2 * 4 * 64 * 8 * 2


def test_offset_hand_computed():
    """HND: ((((layer*n_pages + page)*2 + kv)*Hr + head_local)*P + slot)*D + dim) * e; NHD swaps head and slot."""
    lay = KvLayout(2, 4, 8, 2, 16, ((2, 3), (0, 1)), 5)
    pages = [[4, 1], [3, 0]]
    # rank 0 holds heads (2, 3): head 3 is local 1; token 20 -> page index 1 -> page id 1, slot 4
    assert int(lay.offset(0, 1, 3, 20, 1, 5, pages)) == (((((1 * 5 + 1) * 2 + 1) * 2 + 1) * 16 + 4) * 8 + 5) * 2
    nhd = lay.with_order("NHD")
    assert int(nhd.offset(0, 1, 3, 20, 1, 5, pages)) == (((((1 * 5 + 1) * 2 + 1) * 16 + 4) * 2 + 1) * 8 + 5) * 2
    with pytest.raises(ValueError, match="does not hold head"):
        lay.offset(0, 0, 0, 0, 0, 0, pages)


def test_invalid_inputs_raise_one_line():
    lay = KvLayout.tp_sharded(1, 4, 8, 2, 16, 2, 4)
    with pytest.raises(ValueError, match="held by no rank"):
        KvLayout(1, 4, 8, 2, 16, ((0, 1), (1, 2)), 4)
    with pytest.raises(ValueError, match="twice"):
        KvLayout(1, 4, 8, 2, 16, ((0, 1, 1), (2, 3)), 4)
    with pytest.raises(ValueError, match="page ids must be in 0..3"):
        reshard_plan(lay, lay, 80)  # 5 pages, capacity 4
    with pytest.raises(ValueError, match="needs 2"):
        reshard_plan(lay, lay, 20, [0], None)
    with pytest.raises(ValueError, match="differs"):
        reshard_plan(lay, KvLayout.tp_sharded(2, 4, 8, 2, 16, 2, 4), 10)
    with pytest.raises(ValueError, match="page twice"):
        reshard_plan(lay, lay, 20, [0, 0], None)


# ---------------------------------------------------------------------------------------------------------------
# MLA latent cache and sliding-window layers
# ---------------------------------------------------------------------------------------------------------------


def _free_before(pages, n: int):
    """The page table(s) with the first ``n`` entries freed (-1): pages before every layer's window."""
    if isinstance(pages, np.ndarray) and pages.ndim == 1:
        out = pages.copy()
        out[:n] = -1
        return out
    return [_free_before(np.asarray(p), n) for p in pages]


def _first_kept_page(layout: KvLayout, seq_len: int, page_tokens: int) -> int:
    if not layout.windows or not all(layout.windows):
        return 0
    return min(seq_len - min(seq_len, w) for w in layout.windows) // page_tokens


@st.composite
def windows_st(draw, n_layers: int, allow_none: bool = True):
    if allow_none and draw(st.booleans()):
        return ()
    return tuple(draw(st.lists(st.sampled_from([0, 1, 5, 16, 33, 100]), min_size=n_layers, max_size=n_layers)))


@st.composite
def with_windows(draw, t):
    """A transfer with sliding windows on some layers; sometimes the pages before every window are freed."""
    src, dst, seq_len, sp, dp, seed = t
    windows = draw(windows_st(src.n_layers, allow_none=False))
    src, dst = replace(src, windows=windows), replace(dst, windows=windows)
    if draw(st.booleans()):
        sp = _free_before(sp, _first_kept_page(src, seq_len, src.page_tokens))
        dp = _free_before(dp, _first_kept_page(dst, seq_len, dst.page_tokens))
    return src, dst, seq_len, sp, dp, seed


@st.composite
def windowed_transfers(draw, orders=("HND",)):
    return draw(with_windows(draw(transfers(orders))))


@st.composite
def latent_transfers(draw):
    """Latent (MLA) layouts: a prefill TP group of 1..8 replicas -> a DP decode rank or a decode TP group."""
    L = draw(st.integers(1, 3))
    D = draw(st.sampled_from([1, 3, 8]))
    e = draw(st.sampled_from([1, 2]))
    seq_len = draw(st.integers(1, 80))
    ps, pd = draw(st.integers(1, 16)), draw(st.integers(1, 16))
    src_tp, dst_tp = draw(st.integers(1, 8)), draw(st.sampled_from([1, 1, 2, 3, 4]))
    ns, nd = pages_needed(seq_len, ps), pages_needed(seq_len, pd)
    src = KvLayout(L, 1, D, e, ps, ((0,),) * src_tp, ns + draw(st.integers(0, 3)), latent=True)
    dst = KvLayout(L, 1, D, e, pd, ((0,),) * dst_tp, nd + draw(st.integers(0, 3)), latent=True)
    seed = draw(st.integers(0, 2**32 - 1))
    sp = draw(page_tables(src.n_ranks, ns, src.n_pages, seed))
    dp = draw(page_tables(dst.n_ranks, nd, dst.n_pages, seed + 1))
    t = (src, dst, seq_len, sp, dp, seed)
    return draw(with_windows(t)) if draw(st.integers(0, 3)) == 0 else t


@pytest.mark.slow
@SETTINGS
@given(latent_transfers())
def test_latent_reshard_reproduces_destination_and_spreads_reads(t):
    """Latent KV, prefill TP -> decode DP / TP: the GQA properties (every destination byte written once, nothing
    read outside the sequence, each byte read once per destination copy), and the reads are page-interleaved:
    each (destination copy, layer, source page) comes from one replica, every replica serves floor or ceil of
    U / replicas of the U such pages (so at most ceil(U / replicas) pages of bytes), and within each
    (destination copy, layer) floor or ceil of that layer's pages."""
    src, dst, seq_len, sp, dp, seed = t
    check_plan(reshard_plan(src, dst, seq_len, sp, dp), src, dst, seq_len, sp, dp, seed)
    elementary = reshard_plan(src, dst, seq_len, sp, dp, merge=False)  # each chunk inside one source page
    page_b = src.page_bytes(0)
    R, ns = src.n_ranks, pages_needed(seq_len, src.page_tokens)
    live = [ns - (seq_len - min(seq_len, w) if w else 0) // src.page_tokens
            for w in (src.windows or (0,) * src.n_layers)]
    served: dict = {}  # replica -> {(dst rank, layer, page id on that replica)}
    for c in elementary:
        served.setdefault(c.src_rank, set()).add((c.dst_rank, c.src_offset // page_b // src.n_pages,
                                                  c.src_offset // page_b % src.n_pages))
    U = dst.n_ranks * sum(live)
    counts = [len(served.get(r, ())) for r in range(R)]
    assert sum(counts) == U, "a source page is read from two replicas (or not at all)"
    assert U // R <= min(counts) and max(counts) <= -(-U // R), counts
    assert max(chunk_stats(elementary).bytes_by_src.values()) <= -(-U // R) * page_b
    for d in range(dst.n_ranks):
        for layer, n_l in enumerate(live):
            per = [sum(1 for x in served.get(r, ()) if x[:2] == (d, layer)) for r in range(R)]
            assert n_l // R <= min(per) and max(per) <= -(-n_l // R), (d, layer, per)


@pytest.mark.slow
@SETTINGS
@given(windowed_transfers(orders=("HND", "NHD")))
def test_sliding_layers_send_only_the_window(t):
    """Sliding-window layers move only their latest ``window`` tokens (``check_plan`` counts the bytes a layer
    keeps from ``windows`` alone), whatever the other layers, orders, shards, and with the pages before every
    window freed."""
    src, dst, seq_len, sp, dp, seed = t
    plan = reshard_plan(src, dst, seq_len, sp, dp)
    check_plan(plan, src, dst, seq_len, sp, dp, seed)
    copies = sum(len(s) for s in dst.shards)
    kept = sum(min(seq_len, w) if w else seq_len for w in (src.windows or (0,) * src.n_layers))
    assert plan.total_bytes == copies * kept * 2 * src.head_dim * src.elem_bytes


@pytest.mark.slow
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(transfers(orders=("HND", "NHD")), latent_transfers(), windowed_transfers()), st.integers(0, 2**16))
def test_round_trip_restores_the_source(t, seed2):
    """src -> dst -> src (other page tables on the way back) restores every byte of the sequence."""
    src, dst, seq_len, sp, dp, seed = t
    rng = np.random.default_rng(seed)
    logical = rng.integers(0, 256, n_logical_bytes(src, seq_len), dtype=np.uint8)
    src_bufs, _ = build_buffers(src, seq_len, sp, logical, rng)
    dst_bufs = [rng.integers(0, 256, dst.rank_nbytes(r), dtype=np.uint8) for r in range(dst.n_ranks)]
    execute_plan(reshard_plan(src, dst, seq_len, sp, dp), src_bufs, dst_bufs)
    back_rng = np.random.default_rng(seed2)
    ns = pages_needed(seq_len, src.page_tokens)
    sp2 = [back_rng.permutation(src.n_pages)[:ns] for _ in range(src.n_ranks)]
    back = [back_rng.integers(0, 256, src.rank_nbytes(r), dtype=np.uint8) for r in range(src.n_ranks)]
    execute_plan(reshard_plan(dst, src, seq_len, dp, sp2), dst_bufs, back)
    expected, ids = build_buffers(src, seq_len, sp2, logical, back_rng)
    for r in range(src.n_ranks):
        m = ids[r] >= 0
        assert np.array_equal(back[r][m], expected[r][m]), f"rank {r}: the round trip changed the sequence"


def test_deepseek_v3_tp8_prefill_to_dp_decode():
    """DeepSeek-V3 (61 MLA layers + 1 MTP, latent 512 + rope 64, bf16), TP=8 prefill -> DP decode rank, 6000
    tokens in 64-token pages: the whole latent moves once; 62 x 94 = 5828 source pages over 8 replicas -> 728 or
    729 pages each; one chunk per (layer, page) with fragmented pages."""
    from rackbed.engine.core.model import get_model
    from rackbed.engine.core.sharding import ParallelPlan

    model = get_model("deepseek-v3")
    pre = ParallelPlan(role="prefill", tp=8, ep=8, gpus="0-7")
    dec = ParallelPlan(role="decode", tp=1, ep=8, dp=8, gpus="8-15")
    src, dst = KvLayout.for_plan(pre, model, 1), KvLayout.for_plan(dec, model, 1)
    assert (src.latent, src.n_layers, src.head_dim, src.shards, dst.shards) == (True, 62, 576, ((0,),) * 8, ((0,),))
    st_ = transfer_stats(src, dst, 6000)
    assert st_.total_bytes == 6000 * 62 * 576 * 2 == 6000 * model.kv_bytes_per_token(2, include_mtp=True)
    assert st_.n_chunks == 62 * 94
    full_page = 64 * 576 * 2
    pages = np.bincount(latent_source_ranks(src, 1, 6000).ravel(), minlength=8)
    assert sorted(set(pages.tolist())) == [728, 729] and pages.sum() == 62 * 94
    by_src = st_.bytes_by_src.values()
    assert max(by_src) <= 729 * full_page and min(by_src) >= 728 * full_page - 62 * 16 * 576 * 2  # 6000 % 64 = 48
    assert latent_source_ranks(src, 1, 6000)[0, 0, :9].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 0]
    # decode TP 2 -> 2 copies, each read once
    tp2 = KvLayout.for_model(model, 2, 2, 64, 1)
    assert transfer_stats(src, tp2, 6000).total_bytes == 2 * 6000 * 62 * 576 * 2


def test_gpt_oss_window_only():
    """gpt-oss-120b (18 sliding layers with a 128-token window + 18 full, 8 KV heads x 64, bf16), TP=4 -> DP rank,
    6000 tokens in 64-token pages: full layers move 6000 tokens, sliding layers 128 (tokens 5872..5999 over
    pages 91..93), in one buffer sharing one page table."""
    from rackbed.engine.core.model import get_model
    from rackbed.engine.core.sharding import ParallelPlan

    model = get_model("gpt-oss-120b")
    src = KvLayout.for_plan(ParallelPlan(role="prefill", tp=4, ep=4, gpus="0-3"), model, 1)
    dst = KvLayout.for_plan(ParallelPlan(role="decode", tp=1, ep=4, dp=4, gpus="4-7"), model, 1)
    assert src.windows == tuple(128 if t == "sliding" else 0 for t in model.layer_types)
    per_tok_layer = 2 * 8 * 64 * 2
    st_ = transfer_stats(src, dst, 6000)
    assert st_.total_bytes == 18 * 6000 * per_tok_layer + 18 * 128 * per_tok_layer
    # per (layer, K/V, source rank): one chunk per whole page (its two heads are contiguous on both sides), one
    # per head in a partial page (the last page; the window's first page, tokens 48..63 of it)
    assert st_.n_chunks == 18 * 2 * 4 * (93 + 2) + 18 * 2 * 4 * (2 + 1 + 2)
    sliding = KvLayout.for_attention(model.mixer("sliding"), 18, 2, 64, 4, 100)
    assert sliding.windows == (128,) * 18
    freed = np.arange(94)
    freed[:91] = -1  # pages before the window freed
    plan = reshard_plan(sliding, sliding.with_pages(100), 6000, freed, freed)
    assert plan.total_bytes == 18 * 128 * per_tok_layer


def test_latent_and_window_invalid_inputs():
    lat = KvLayout(2, 1, 8, 2, 16, ((0,), (0,)), 4, latent=True)
    gqa = KvLayout.tp_sharded(2, 1, 8, 2, 16, 2, 4)
    with pytest.raises(ValueError, match="latent"):
        reshard_plan(lat, gqa, 10)
    with pytest.raises(ValueError, match="one unit"):
        KvLayout(2, 2, 8, 2, 16, ((0, 1),), 4, latent=True)
    with pytest.raises(ValueError, match="windows has 1 entries for 2 layers"):
        KvLayout(2, 1, 8, 2, 16, ((0,),), 4, windows=(4,))
    with pytest.raises(ValueError, match="kv must be in 0..0"):
        lat.offset(0, 0, 0, 0, 1, 0, [0])
    with pytest.raises(ValueError, match="not a latent"):
        latent_source_ranks(gqa, 1, 10)
    win = replace(gqa, windows=(8, 8))
    with pytest.raises(ValueError, match="page ids must be in 0..3"):
        reshard_plan(win, win, 40, [-1, 0, -1], [0, 1, 2])  # page 2 holds the window: it must be valid
    # 2 destination ranks (the head replicated) x 2 layers x K/V x the window's 8 tokens x 8 dims x 2 B
    assert reshard_plan(win, win, 40, [-1, 0, 1], [0, 1, 2]).total_bytes == 2 * 2 * 2 * 8 * 8 * 2
    assert KvLayout(2, 1, 8, 2, 16, ((0,),), 4, windows=(0, 0)).windows == ()  # no window: the plain layout


def test_latent_offset_hand_computed():
    """Latent: (((layer*n_pages + page)*P + slot)*D + dim) * e, the same in HND and NHD."""
    lat = KvLayout(2, 1, 576, 2, 64, ((0,), (0,)), 5, latent=True)
    assert int(lat.offset(1, 1, 0, 70, 0, 7, [[3, 4], [2, 1]])) == (((1 * 5 + 1) * 64 + 6) * 576 + 7) * 2
    assert int(lat.with_order("NHD").offset(1, 1, 0, 70, 0, 7, [[3, 4], [2, 1]])) == \
        (((1 * 5 + 1) * 64 + 6) * 576 + 7) * 2
    assert lat.page_bytes(0) == 64 * 576 * 2


# ---------------------------------------------------------------------------------------------------------------
# the checker catches broken plans (each mutation must trip a named property)
# ---------------------------------------------------------------------------------------------------------------


def _example(kind: str):
    """'replicated': TP=8 over 4 heads (replicas on ranks 2h, 2h+1) -> DP rank, mismatched pages, scattered page
    tables. 'mergeable': TP=2 -> DP rank, equal pages, whole pages (head pairs and pages merge)."""
    rng = np.random.default_rng(7)
    if kind == "replicated":
        src = KvLayout(2, 4, 4, 2, 8, tp_kv_head_shards(4, 8), 6)
        dst = KvLayout(2, 4, 4, 2, 4, ((0, 1, 2, 3),), 12)
        seq_len, sp, dp = 37, [rng.permutation(6)[:5] for _ in range(8)], rng.permutation(12)[:10]
    else:
        src = KvLayout(2, 4, 4, 2, 8, tp_kv_head_shards(4, 2), 6)
        dst = KvLayout(2, 4, 4, 2, 8, ((0, 1, 2, 3),), 6)
        seq_len, sp, dp = 32, np.arange(4), np.array([1, 2, 3, 5])
    plan = reshard_plan(src, dst, seq_len, sp, dp)
    check_plan(plan, src, dst, seq_len, sp, dp, 1)  # the unmutated plan passes
    return plan, (src, dst, seq_len, sp, dp, 1)


def _cols(plan):
    return [a.copy() for a in (plan.src_rank, plan.src_offset, plan.dst_rank, plan.dst_offset, plan.nbytes)]


def _mut_swap_offsets(plan, args):
    c = _cols(plan)
    c[1], c[3] = c[3], c[1]
    return TransferPlan(*c)


def _mut_unmerged(plan, args):
    src, dst, seq_len, sp, dp, _ = args
    bad = reshard_plan(src, dst, seq_len, sp, dp, merge=False)
    assert len(bad) > len(plan)
    return bad


def _mut_split_chunk(plan, args):
    c = _cols(plan)
    i = int(np.argmax(c[4]))
    half = c[4][i] // 2
    extra = [c[0][i], c[1][i] + half, c[2][i], c[3][i] + half, c[4][i] - half]
    c[4][i] = half
    return TransferPlan(*(np.append(a, x) for a, x in zip(c, extra)))


def _mut_read_both_replicas(plan, args):
    """Also read chunk 0 again from the other replica of its head (into the same destination bytes)."""
    src = args[0]
    c = _cols(plan)
    r = int(c[0][0])
    other = r ^ 1  # replicas sit on ranks (2h, 2h+1)
    assert src.shards[other] == src.shards[r]
    extra = [other, c[1][0], c[2][0], c[3][0], c[4][0]]
    return TransferPlan(*(np.append(a, x) for a, x in zip(c, extra)))


def _mut_drop_chunk(plan, args):
    return TransferPlan(*(a[1:] for a in _cols(plan)))


def _mut_off_by_one_element(plan, args):
    c = _cols(plan)
    c[1] = c[1] + 8  # one element (4 dims x 2 B) later in the source
    return TransferPlan(*c)


MUTATIONS = [(m, k) for m in (_mut_swap_offsets, _mut_split_chunk, _mut_drop_chunk, _mut_off_by_one_element)
             for k in ("replicated", "mergeable")] + [(_mut_read_both_replicas, "replicated"),
                                                      (_mut_unmerged, "mergeable")]


@pytest.mark.parametrize("mutate, kind", MUTATIONS, ids=[f"{m.__name__[5:]}-{k}" for m, k in MUTATIONS])
def test_checker_catches_broken_plans(mutate, kind):
    plan, args = _example(kind)
    bad = mutate(plan, args)
    with pytest.raises((AssertionError, ValueError)):
        check_plan(bad, *args)


def test_merge_chunks_merges_only_double_contiguity():
    p = merge_chunks([0, 0, 0, 1], [0, 10, 30, 20], [0, 0, 0, 0], [100, 110, 120, 130], [10, 10, 5, 5])
    assert [(c.src_rank, c.src_offset, c.dst_offset, c.nbytes) for c in p] == \
        [(0, 0, 100, 20), (0, 30, 120, 5), (1, 20, 130, 5)]
