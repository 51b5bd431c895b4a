"""Prefill wgmma grouped GEMM (kernels/grouped_gemm_wgmma.py): CPU-side checks, compile check, GPU checks.

CPU: the kernel's work loop (mirrored by ``schedule``) covers every (row, n-tile) exactly once for any routing,
including empty experts and odd grid sizes; device tile offsets; argument checks (one-line ValueErrors); the fp32
references (bf16 and FP8 block-scaled, against kernels.mx's "fp8_block" format); the ``impl="auto"`` switch.
With CuTe DSL importable: every variant (VARIANTS) compiles for sm_90a. GPU: NaN-poisoned outputs against the fp32 reference.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from rackbed.kernels import grouped_gemm as gg
from rackbed.kernels import grouped_gemm_wgmma as gw


@pytest.mark.slow
@settings(max_examples=200, deadline=None)
@given(counts=st.lists(st.integers(0, 400), min_size=1, max_size=12), fp8=st.sampled_from([False, True, *gw.VARIANTS]),
       n_ctas=st.integers(1, 40), n_tiles=st.integers(1, 3))
def test_schedule_covers_every_row_once(counts, fp8, n_ctas, n_tiles):
    cfg = gw.tile_config(fp8)
    N = n_tiles * cfg["tile_n"] * cfg["cluster_n"]
    offs = [0]
    for c in counts:
        offs.append(offs[-1] + c)
    seen = {}
    for items in gw.schedule(counts, N, fp8, n_ctas):
        for e, row0, rows, nt in items:
            assert counts[e] > 0 and 1 <= rows <= cfg["tile_m"]
            assert offs[e] <= row0 and row0 + rows <= offs[e + 1]  # never writes another expert's rows
            assert (row0 - offs[e]) % cfg["tile_m"] == 0
            for r in range(row0, row0 + rows):
                seen[(r, nt)] = seen.get((r, nt), 0) + 1
    assert seen == {(r, nt): 1 for r in range(offs[-1]) for nt in range(N // cfg["tile_n"])}


def test_schedule_per_cta_experts_nondecreasing():
    counts = [0, 5, 0, 300, 1, 0, 129]
    for items in gw.schedule(counts, 512, False, 3):
        es = [it[0] for it in items]
        assert es == sorted(es)  # the kernel's forward-only expert search relies on it


def test_tile_offsets():
    counts = torch.tensor([0, 1, 127, 128, 129, 300, 0, 5])
    o = gw.tile_offsets(counts)
    assert o.dtype == torch.int32 and o.shape == (2, 9)
    assert o[0].tolist() == [0, 0, 1, 128, 256, 385, 685, 685, 690]
    assert o[1].tolist() == [0, 0, 1, 2, 3, 5, 8, 8, 9]


def test_tile_config_fits_smem():
    for fp8 in (False, True):
        c = gw.tile_config(fp8)
        assert c["stages"] >= 4
        assert c["stages"] * c["stage_bytes"] + 1024 <= gw.SMEM_BYTES
        assert c["tile_k"] * (1 if fp8 else 2) == 128  # one 128-byte swizzle row of K per stage
    assert gw.tile_config(True)["tile_k"] == gw.SCALE_BLOCK  # one wgmma batch = one scale block (promotion)


def test_grid_size():
    assert gw.grid_size(48000, 128, 3072, False, 132) == 132
    assert gw.grid_size(5, 8, 256, False, 132) == 9  # (1 + 8) m-tiles x 1 n-tile upper bound
    assert gw.grid_size(1, 1, 256, True, 132) == 4


def test_check_args_errors():
    x = torch.zeros(10, 256, dtype=torch.bfloat16)
    w = torch.zeros(3, 512, 256, dtype=torch.bfloat16)
    c = torch.tensor([3, 0, 7])
    assert gw.check_args(x, w, c) == (10, 3, 512, 256, False)
    with pytest.raises(ValueError, match="K mismatch"):
        gw.check_args(x, torch.zeros(3, 512, 128, dtype=torch.bfloat16), c)
    with pytest.raises(ValueError, match="counts"):
        gw.check_args(x, w, torch.tensor([10]))
    with pytest.raises(ValueError, match="both"):
        gw.check_args(x, w, c, x_scale=torch.ones(10, 2))
    xq, wq = x.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="x_scale must be fp32"):
        gw.check_args(xq, wq, c, x_scale=torch.ones(10, 3), w_scale=torch.ones(3, 4, 2))
    with pytest.raises(ValueError, match="w_scale must be fp32"):
        gw.check_args(xq, wq, c, x_scale=torch.ones(10, 2), w_scale=torch.ones(3, 2, 2))
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        gw.check_args(x, w, c, x_scale=torch.ones(10, 2), w_scale=torch.ones(3, 4, 2))
    assert gw.check_args(xq, wq, c, x_scale=torch.ones(10, 2), w_scale=torch.ones(3, 4, 2))[4] is True
    assert gw.kernel_unsupported(x, w, c) == "not on CUDA"
    assert "multiple of 256" in gw.shape_unsupported(10, 384, 256, fp8=False)
    assert gw.shape_unsupported(10, 384, 256, fp8=True) is None
    assert "multiple of 128" in gw.shape_unsupported(10, 256, 192, fp8=False)
    assert gw.shape_unsupported(0, 256, 256, fp8=False) == "no rows"
    with pytest.raises(ValueError, match="not on CUDA"):
        gw.grouped_mm(x, w, c)


def test_reference_bf16_matches_loop():
    g = torch.Generator().manual_seed(0)
    counts = [4, 0, 9]
    x = torch.randn(13, 256, generator=g, dtype=torch.float64)
    w = torch.randn(3, 128, 256, generator=g, dtype=torch.float64)
    ref = gw.grouped_mm_reference(x, w, torch.tensor(counts), dtype=torch.float64)
    assert torch.allclose(ref[:4], x[:4] @ w[0].T) and torch.allclose(ref[4:], x[4:] @ w[2].T)
    part = gw.grouped_mm_reference(x, w, torch.tensor(counts), dtype=torch.float64, experts={2})
    assert torch.equal(part[4:], ref[4:]) and not part[:4].any()


def test_fp8_reference_equals_mx_dequantized_gemm():
    from rackbed.kernels import mx

    g = torch.Generator().manual_seed(1)
    counts = [3, 0, 5]
    x = torch.randn(8, 256, generator=g) * torch.exp(torch.randn(8, 1, generator=g))
    w = torch.randn(3, 256, 256, generator=g) * 0.05
    qx, qw = mx.quantize(x, "fp8_block", "activation"), mx.quantize(w, "fp8_block", "weight")
    xq, sx = gw.from_mx(qx)
    wq, sw = gw.from_mx(qw)
    assert sx.shape == (8, 2) and sw.shape == (3, 2, 2)
    ref = gw.grouped_mm_reference(xq, wq, torch.tensor(counts), x_scale=sx, w_scale=sw, dtype=torch.float64)
    dx, dw = mx.dequantize(qx), mx.dequantize(qw)
    want = torch.cat([dx[:3] @ dw[0].T, dx[3:] @ dw[2].T])
    assert torch.allclose(ref, want, rtol=1e-12, atol=1e-12)
    # and the block-scaled product is close to the unquantized one
    exact = torch.cat([x[:3].double() @ w[0].double().T, x[3:].double() @ w[2].double().T])
    assert float((ref - exact).norm() / exact.norm()) < 0.06


def test_fast_quantizer_matches_mx():
    from rackbed.kernels import mx

    g = torch.Generator().manual_seed(2)
    for role, shape in (("activation", (16, 384)), ("weight", (2, 256, 384))):
        t = (torch.randn(*shape, generator=g) * torch.exp(torch.randn(*shape[:-1], 1, generator=g))).bfloat16()
        q, s = gw.quantize_fp8_block(t, role)
        mq, ms = gw.from_mx(mx.quantize(t.float(), "fp8_block", role))
        assert torch.equal(s, ms)
        same = (q.view(torch.uint8) == mq.view(torch.uint8)).float().mean().item()
        assert same > 0.99, same  # fp32 vs float64 division: near-ties may round to the neighbouring code
        a, b = q.float(), mq.float()
        assert bool(((a - b).abs() <= b.abs().clamp_min(2 ** -6) * 2 ** -3 + 1e-12).all())  # at most one step


def test_auto_switch_off_by_default(monkeypatch):
    x = torch.randn(6, 256).bfloat16()
    gu = torch.randn(2, 512, 256).bfloat16()
    dn = torch.randn(2, 256, 256).bfloat16()
    counts = torch.tensor([4, 2])
    assert gg.PREFILL_WGMMA_MIN_MEAN_ROWS is None and not gg.use_prefill_wgmma(48000, 128)
    monkeypatch.setenv("RACKBED_PREFILL_WGMMA_MIN_ROWS", "64")
    assert gg.use_prefill_wgmma(48000, 128) and not gg.use_prefill_wgmma(100, 128)
    monkeypatch.setenv("RACKBED_PREFILL_WGMMA_MIN_ROWS", "1")
    # no CUDA here: auto must fall back to torch and stay correct
    y = gg.grouped_swiglu(x, gu, dn, counts)
    ref = gg.grouped_swiglu_reference(x, gu, dn, counts)
    assert float((y.float() - ref).norm() / ref.norm()) < 2e-2
    if not torch.cuda.is_available():
        assert gg.wgmma_unsupported(x, gu, dn, counts) is not None


_has_cute = importlib.util.find_spec("cutlass") is not None


@pytest.mark.skipif(not _has_cute, reason="CuTe DSL not importable")
@pytest.mark.parametrize("variant", list(gw.VARIANTS) + list(gw.DIAG_VARIANTS))
def test_compiles_for_sm90a(variant, monkeypatch):
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    from rackbed.kernels import grouped_gemm_wgmma_cute as gc

    assert gc.compiled(512 * gw.variant_config(variant)["cluster_n"], 256, variant) is not None


@settings(max_examples=100, deadline=None)
@given(counts=st.lists(st.integers(0, 400), min_size=1, max_size=10), n_ctas=st.integers(1, 20),
       variant=st.sampled_from([v for v in gw.VARIANTS if gw.VARIANTS[v]["pingpong"]]))
def test_pingpong_warpgroups_split_the_schedule(counts, n_ctas, variant):
    """The two consumer warpgroups of a pingpong CTA take alternate items: together exactly the CTA's items."""
    N = 2 * gw.variant_config(variant)["tile_n"]
    full = gw.schedule(counts, N, variant, n_ctas)
    w0 = gw.schedule(counts, N, variant, n_ctas, consumer=0)
    w1 = gw.schedule(counts, N, variant, n_ctas, consumer=1)
    for f, a, b in zip(full, w0, w1):
        assert a == f[0::2] and b == f[1::2]


def test_variant_configs_fit_smem():
    for name in gw.VARIANTS:
        cfg = gw.variant_config(name)
        assert cfg["stages"] >= 3, name
        assert cfg["stages"] * cfg["stage_bytes"] + cfg["epi_bytes"] + 4096 <= gw.SMEM_BYTES, name
        assert 512 % cfg["tile_n"] == 0
        assert gw.grid_size(48000, 128, 4096, name, 132) % cfg["cluster_n"] == 0
    assert gw.variant_config(False)["name"] == gw.default_variant(False)
    assert gw.variant_config(True)["fp8"] and not gw.variant_config(False)["fp8"]
    with pytest.raises(ValueError, match="unknown wgmma variant"):
        gw.variant_config("nope")
    assert "multiple of 256" in gw.shape_unsupported(10, 256, 384, True, "fp8_dbuf")
    assert gw.shape_unsupported(10, 256, 384, True, "v1_fp8") is None


needs_gpu = pytest.mark.skipif(not torch.cuda.is_available() or gg.cute_unavailable() is not None
                               or (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] != 9),
                               reason="needs a Hopper GPU and CuTe DSL")


@needs_gpu
@pytest.mark.parametrize("variant", list(gw.VARIANTS))
@pytest.mark.parametrize("n_ctas", [None, 1, 5])
def test_gpu_matches_reference(variant, n_ctas):
    fp8 = gw.VARIANTS[variant]["fp8"]
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(3)
    counts_l = [0, 1, 127, 128, 129, 300, 0, 5]
    R, N, K = sum(counts_l), 512, 256
    counts = torch.tensor(counts_l, device=dev)
    x = torch.randn(R, K, device=dev, generator=g).bfloat16()
    w = (torch.randn(len(counts_l), N, K, device=dev, generator=g) * K ** -0.5).bfloat16()
    out = torch.full((R, N), float("nan"), dtype=torch.bfloat16, device=dev)
    if fp8:
        xq, sx = gw.quantize_fp8_block(x, "activation")
        wq, sw = gw.quantize_fp8_block(w, "weight")
        gw.grouped_mm(xq, wq, counts, x_scale=sx, w_scale=sw, out=out, n_ctas=n_ctas, variant=variant)
        ref = gw.grouped_mm_reference(xq, wq, counts, x_scale=sx, w_scale=sw)
    else:
        gw.grouped_mm(x, w, counts, out=out, n_ctas=n_ctas, variant=variant)
        ref = gw.grouped_mm_reference(x, w, counts)
    torch.cuda.synchronize()
    assert out.isfinite().all()
    assert float((out.float() - ref).norm() / ref.norm()) < 1e-2


@pytest.mark.slow
@pytest.mark.parametrize("variant", [v for v in gw.VARIANTS if gw.VARIANTS[v]["epi"] == "smem"])
@pytest.mark.parametrize("rows", [128, 129 - 64, 64, 63, 5, 1])
def test_smem_epilogue_covers_tile(variant, rows):
    """The shared-memory epilogue (mirror: smem_epilogue_plan) stores every valid cell of a tile exactly once with
    its own value and no row past the expert's end (v2 bug: the second cooperative warpgroup indexed its 64-row
    staging buffer with the 0..255 consumer index, so tile rows 64..79 were never stored)."""
    rows = min(rows, gw.variant_config(variant)["tile_m"])
    stored = gw.smem_epilogue_plan(variant, rows)
    assert (stored[:rows] == 1).all()
    assert (stored[rows:] == 0).all()


def test_wgmma_c_coords_partition_tile():
    """Every accumulator cell of a tile belongs to exactly one (thread, element)."""
    for tile_n, n_wg in ((256, 2), (128, 2), (128, 1)):
        c = gw.wgmma_c_coords(tile_n, n_wg).reshape(-1, 2)
        assert len(c) == gw.TILE_M * tile_n
        assert len({(int(m), int(n)) for m, n in c}) == gw.TILE_M * tile_n


def _pingpong_pipeline(stages, k_tiles, items, ordered, seed):
    """mbarrier-parity model of the pingpong mainloop: one TMA producer, consumer warpgroups 0/1 taking alternate
    items of the CTA and skipping the other's k-tiles by advancing their pipeline state; random interleaving.
    'stale' = a consumer wait passed on an earlier phase of the same parity (the stage does not hold its data)."""
    import random

    rnd = random.Random(seed)
    full, empty, holder = [0] * stages, [0] * stages, [None] * stages  # completed phases, position held
    prod, total = 0, items * k_tiles
    cons = [{"j": c, "k": 0, "pend": []} for c in range(2)]
    done_item = -1  # last item whose mainloop finished (the order barrier)
    for _ in range(100000):
        ready = [w for w in (0, 1) if cons[w]["j"] < items]
        if prod < total and empty[prod % stages] % 2 != (prod // stages + 1) % 2:  # producer_acquire
            ready.append("P")
        if not ready:
            return "ok"
        a = rnd.choice(ready)
        if a == "P":
            holder[prod % stages] = prod
            full[prod % stages] += 1
            prod += 1
            continue
        st_ = cons[a]
        if ordered and st_["k"] == 0 and st_["j"] > 0 and done_item < st_["j"] - 1:
            continue
        q = st_["j"] * k_tiles + st_["k"]
        s, rnd_q = q % stages, q // stages
        if full[s] % 2 != rnd_q % 2:  # consumer_wait(parity) passes
            if holder[s] != q:
                return "stale"
            st_["pend"].append(q)
            if len(st_["pend"]) > 1:  # wait_group(1): release the previous stage
                empty[st_["pend"].pop(0) % stages] += 1
            st_["k"] += 1
            if st_["k"] == k_tiles:
                for qq in st_["pend"]:
                    empty[qq % stages] += 1
                st_["pend"] = []
                done_item = max(done_item, st_["j"])
                st_["j"] += 2
                st_["k"] = 0
    return "deadlock"


def test_pingpong_needs_the_order_barrier():
    """Why the pingpong kernel orders the warpgroups' mainloops (named barriers 3/4): without it the second
    warpgroup's first wait is k_tiles stages ahead and passes on a stale phase (v2: launch failure)."""
    cases = [(s, k, n, seed) for s in (4, 5, 6, 8) for k in (2, 24, 64) for n in (1, 2, 3, 7) for seed in range(5)]
    assert all(_pingpong_pipeline(s, k, n, True, seed) == "ok" for s, k, n, seed in cases)
    assert any(_pingpong_pipeline(s, k, n, False, seed) == "stale" for s, k, n, seed in cases)


def test_sweep_groups_isolate_unverified_variants():
    from rackbed.kernels.bench import moe_prefill as bp

    groups = bp.sweep_groups()
    flat = [v for g in groups for v in g]
    assert sorted(flat) == sorted(gw.VARIANTS)  # each variant in exactly one group
    assert groups[0][:2] == ["v1_bf16", "v1_fp8"] and set(groups[0]) <= set(bp.SAFE_VARIANTS)
    assert all(len(g) == 1 for g in groups[1:])  # a crash poisons only its own child process


@settings(max_examples=150, deadline=None)
@given(counts=st.lists(st.integers(0, 400), min_size=1, max_size=10), n_ctas=st.integers(1, 40),
       n_groups=st.integers(1, 3),
       variant=st.sampled_from([v for v in gw.VARIANTS if gw.variant_config(v)["cluster_n"] > 1]))
def test_cluster_ctas_walk_the_same_items(counts, n_ctas, n_groups, variant):
    """v4 clusters (A tile multicast along N): the CTAs of a cluster must walk the same sequence of (expert, rows)
    in lockstep (each stage's A halves come from every CTA of the cluster, each CTA's producer waits for every
    CTA's release), with adjacent n-tiles of one group; the grid is whole clusters."""
    cfg = gw.variant_config(variant)
    cn = cfg["cluster_n"]
    N = n_groups * cn * cfg["tile_n"]
    sched = gw.schedule(counts, N, variant, n_ctas)
    assert len(sched) % cn == 0 and len(sched) == gw.cluster_grid(n_ctas, cfg)
    for c in range(len(sched) // cn):
        members = sched[c * cn:(c + 1) * cn]
        for r, items in enumerate(members):
            assert [it[:3] for it in items] == [it[:3] for it in members[0]]
            assert all(it[3] % cn == r and it[3] // cn == it0[3] // cn for it, it0 in zip(items, members[0]))


def test_grid_whole_clusters():
    cfg = gw.variant_config("bf16_mc2_smem")
    assert gw.grid_size(48000, 128, 3072, "bf16_mc2_smem", 132) == 132
    assert gw.grid_size(48000, 128, 3072, "bf16_mc2_smem_g128", 132) == 128
    assert gw.grid_size(48000, 128, 3072, "bf16_mc2_smem", 131) == 130
    assert gw.cluster_grid(1, cfg) == 2 and gw.cluster_grid(7, cfg) == 6
    assert "multiple of 512" in gw.shape_unsupported(10, 256, 256, False, "bf16_mc2_smem")


# ---------------------------------------------------------------------------------------- diagnostic variants
def test_diagnostic_variants_never_selectable(monkeypatch):
    """Diagnostic twins (wrong results on purpose) are not in VARIANTS (so not in --sweep or the best pick), never a
    default (env override refused), and grouped_mm (what impl="auto" calls) refuses them without diagnostic=True."""
    import torch

    from rackbed.kernels.bench import moe_prefill as bp

    assert gw.DIAG_VARIANTS and not set(gw.DIAG_VARIANTS) & set(gw.VARIANTS)
    assert set(gw.DEFAULT_VARIANT.values()) <= set(gw.VARIANTS)
    assert not any(v in gw.DIAG_VARIANTS for g in bp.sweep_groups() for v in g)
    for name, cfg in gw.DIAG_VARIANTS.items():
        assert gw.is_diagnostic(name) and cfg["diag"] in gw.DIAG_KINDS and cfg["base"] in gw.VARIANTS
        assert gw.variant_config(name)["diag"] == cfg["diag"]
        key = "FP8" if cfg["fp8"] else "BF16"
        monkeypatch.setenv(f"RACKBED_WGMMA_VARIANT_{key}", name)
        with pytest.raises(ValueError, match="not a production"):
            gw.default_variant(cfg["fp8"])
        monkeypatch.delenv(f"RACKBED_WGMMA_VARIANT_{key}")
        assert not gw.is_diagnostic(gw.default_variant(cfg["fp8"]))
    for v in gw.VARIANTS:
        assert not gw.is_diagnostic(v) and gw.variant_config(v)["diag"] is None
    x = torch.zeros(4, 256, dtype=torch.bfloat16)
    w = torch.zeros(2, 512, 256, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="diagnostic"):
        gw.grouped_mm(x, w, torch.tensor([2, 2]), variant="bf16_coop_smem__no_epilogue")


def test_tail_free_shape_gives_every_cta_equal_full_tiles():
    from rackbed.kernels.bench import moe_prefill as bp

    counts = bp.tail_free_counts()
    assert len(counts) == bp.N_EXPERTS and all(c % 128 == 0 for c in counts)
    for var in ("bf16_coop_smem", "fp8_dbuf_smem"):
        for n in (2 * bp.F_EXPERT, bp.D_MODEL):
            sched = gw.schedule(counts, n, var, 132)
            assert len({len(items) for items in sched}) == 1  # no tail: same item count per CTA
            assert all(rows == 128 for items in sched for _, _, rows, _ in items)


def test_diag_shares():
    from rackbed.kernels.bench import moe_prefill as bp

    def v(us, diag=None, base="b"):
        return {"us": us, "TFLOPs": 1000 / us, "diag": diag, "base": base, "ok": True if diag is None else None}

    rows = [{"case": "gate_up", "variants": {"b": v(100), "b__ne": v(80, "no_epilogue"),
                                             "b__np": v(90, "no_promote")}},
            {"case": "gate_up_tailfree", "variants": {"b": v(95)}},
            {"case": "gate_up_tailfree", "fp8": True, "variants": {"f": v(50, base="f")}}]  # other dtype's row
    (s,) = [x for x in bp.diag_shares(rows) if x["case"] == "gate_up"]
    assert s["epilogue_share"] == pytest.approx(0.2) and s["promote_share"] == pytest.approx(0.1)
    assert s["tail_share"] == pytest.approx(0.05)
    assert "gate_up" in bp.diag_table({"shares": bp.diag_shares(rows)})
