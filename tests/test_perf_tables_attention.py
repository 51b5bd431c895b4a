"""Attention tables of aiconfigurator-core as flash_tflops / decode_attn_GBps curves (sim.perf_tables_attention):
batched prefills as heads across the batch, fp8 KV caches as curves of their own, and the attention cost functions'
lookups by head counts and KV format (the engine's H200 calibration unchanged)."""

from __future__ import annotations

import math
import statistics

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rackbed.engine.core.model import get_model
from rackbed.sim import perf_tables as pt
from rackbed.sim import perf_tables_attention as pta
from rackbed.sim.calibrate import default_calibration_for
from rackbed.sim.costs.attention import (
    flash_efficiency,
    flash_rate,
    full_attention_decode,
    full_attention_decode_totals,
    full_attention_prefill,
    kv_format,
    local_heads,
)
from rackbed.sim.costs.calibration import CalibrationEntry, CalibrationTable, kernel_fixed_us
from rackbed.topology.errors import UserError
from rackbed.topology.specs import GPUS

pytest.importorskip("pyarrow")
pytest.importorskip("aiconfigurator_core")

GPU = "H200-SXM"
SYSTEM = "h200_sxm"


@pytest.fixture(scope="module")
def h200_doc():
    """The H200 TRT-LLM calibration built by the real pipeline from the attention importers alone."""
    mp = pytest.MonkeyPatch()
    mp.setattr(pt, "IMPORTERS", ())
    mp.setattr(pt, "LATE_IMPORTERS", ())
    try:
        yield pt.build_calibration("h200", "trtllm")
    finally:
        mp.undo()


@pytest.fixture(scope="module")
def h200_parts():
    root = pt.data_root()
    return (pta.import_context_attention(root, SYSTEM, "trtllm", GPU),
            pta.import_generation_attention(root, SYSTEM, "trtllm", GPU))


def _fit_table(parts) -> CalibrationTable:
    """The table build_calibration fits (fit points only, the importers' grids, log-log)."""
    entries, grid = [], {}
    for p in parts:
        grid.update(p.grid)
        for c in p.curves:
            fit, _ = c.split()
            entries.append(CalibrationEntry(kind=c.kind, gpu=GPU, key=c.key, points=tuple(fit)))
    return CalibrationTable(entries=tuple(entries), grid=grid, interpolation="log-log")


@pytest.fixture(scope="module")
def h200_table(h200_parts):
    return _fit_table(h200_parts)


# ------------------------------------------------------------------------------------------------ what the tables say


def test_table_columns_read_as_documented():
    """The reading in the module docstring: context rows have nothing cached (step 0), generation rows one new
    token (isl 1) over step = 2^k - 1 cached tokens (so step + 1, the KV tokens read, is a power of two)."""
    root = pt.data_root()
    ctx = pt.find_tables(root, SYSTEM, "attention", "trtllm", "context_attention_perf.parquet")[-1]
    gen = pt.find_tables(root, SYSTEM, "attention", "trtllm", "generation_attention_perf.parquet")[-1]
    assert {r["step"] for r in pt.read_rows(ctx, ("step", "latency"))} == {0}
    rows = pt.read_rows(gen, ("isl", "step", "latency"))
    assert {r["isl"] for r in rows} == {1}
    steps = {r["step"] for r in rows}
    assert all((s + 1) & s == 0 for s in steps) and len(steps) >= 10
    # long prefills: time proportional to batch x isl^2 (sequences are independent, isl is each one's length)
    cols = ("batch_size", "isl", "num_heads", "num_key_value_heads", "head_dim", "window_size", "attn_dtype",
            "kv_cache_dtype", "latency")
    lat = {(r["batch_size"], r["isl"]): r["latency"] for r in pt.read_rows(ctx, cols)
           if (r["num_heads"], r["num_key_value_heads"], r["head_dim"], r["window_size"]) == (32, 4, 128, 0)
           and r["attn_dtype"] == r["kv_cache_dtype"] == "bfloat16"}
    assert lat[(8, 8192)] / lat[(1, 8192)] == pytest.approx(8, rel=0.1)
    assert lat[(1, 16384)] / lat[(1, 8192)] == pytest.approx(4, rel=0.1)


def test_a_batch_runs_as_one_sequence_of_its_heads_across_the_batch():
    """What the batched curves rest on: ``b`` sequences of ``h`` / ``kv`` heads take the time of one sequence of
    ``b h`` / ``b kv`` heads, wherever the table measured both (every length, every batch)."""
    root = pt.data_root()
    ctx = pt.find_tables(root, SYSTEM, "attention", "trtllm", "context_attention_perf.parquet")[-1]
    best: dict[tuple, float] = {}
    for r in pt.read_rows(ctx, pta.CTX_COLS):
        if pta._ctx_usable(r):
            k = tuple(int(r[f]) for f in ("head_dim", "num_heads", "num_key_value_heads", "batch_size", "isl"))
            best[k] = min(best.get(k, math.inf), r["latency"])
    ratios = [t / best[(d, b * h, b * kv, 1, q)] for (d, h, kv, b, q), t in best.items()
              if b > 1 and (d, b * h, b * kv, 1, q) in best]
    assert len(ratios) > 3000
    errs = sorted(abs(x - 1) for x in ratios)
    assert statistics.median(errs) < 0.02 and errs[int(0.9 * len(errs))] < 0.06
    # while pricing each sequence as a one-sequence kernel of its own heads is far off for short sequences
    assert best[(128, 8, 1, 64, 512)] / (64 * best[(128, 8, 1, 1, 512)]) < 0.25


# ------------------------------------------------------------------------------------------------ the import


@pytest.mark.slow
def test_h200_holdout_meets_targets(h200_doc):
    v = h200_doc["meta"]["validation"]
    assert set(v) == {"flash_tflops", "decode_attn_GBps"}
    groups = h200_doc["meta"]["validation_groups"]
    assert set(groups) == {"flash_tflops: one sequence", "flash_tflops: batched", "decode_attn_GBps: bf16 KV",
                           "decode_attn_GBps: fp8 KV", "flash_tflops: sliding window",
                           "decode_attn_GBps: bf16 KV, sliding window", "decode_attn_GBps: fp8 KV, sliding window"}
    for kind, s in (v | groups).items():
        assert s["n"] > 300, kind
        # sliding-window prefill: the held-out row at the window's length sits where the kernel's time steps up
        # (~15 % off); the other rows are within a few per cent
        p90 = 20.0 if kind == "flash_tflops: sliding window" else 15.0
        assert s["median_pct"] <= 5.0 and s["p90_pct"] <= p90, (kind, s)
    for kind in v:
        assert v[kind]["n"] == sum(g["n"] for k, g in groups.items() if k.startswith(kind + ": "))
    rows = pt.validation_table(h200_doc["meta"])
    assert [r.split(" |")[0] for r in rows[2:]] == ["| decode_attn_GBps", "| decode_attn_GBps: bf16 KV",
                                                    "| decode_attn_GBps: bf16 KV, sliding window",
                                                    "| decode_attn_GBps: fp8 KV",
                                                    "| decode_attn_GBps: fp8 KV, sliding window", "| flash_tflops",
                                                    "| flash_tflops: batched", "| flash_tflops: one sequence",
                                                    "| flash_tflops: sliding window"]
    assert h200_doc["grid"] == {"flash_tflops": ["n_q_heads", "n_kv_heads"]}
    files = {t["file"] for t in h200_doc["meta"]["tables"]}
    assert files == {"h200_sxm/attention/trtllm/1.3.0rc20/context_attention_perf.parquet",
                     "h200_sxm/attention/trtllm/1.3.0rc20/generation_attention_perf.parquet"}


@pytest.mark.slow
def test_h200_curves_cover_the_model_presets(h200_doc):
    """Every preset's per-GPU head configuration at TP 1-8 has its own prefill curve; every one of head dim 128
    or 256 its own decode curves (or the generic ones), from batch 1 to the table's largest."""
    flash = {(e["key"]["head_dim"], e["key"]["n_q_heads"], e["key"]["n_kv_heads"])
             for e in h200_doc["entries"] if e["kind"] == "flash_tflops"}
    decode = {(e["key"]["head_dim"], e["key"].get("n_q_heads"), e["key"].get("n_kv_heads"))
              for e in h200_doc["entries"] if e["kind"] == "decode_attn_GBps"}
    for name in ("qwen3-235b-a22b", "qwen3-30b-a3b", "qwen3.5-397b-a17b"):
        m = get_model(name)
        for tp in (1, 2, 4, 8):
            h, kv = local_heads(m.n_q_heads, tp), local_heads(m.n_kv_heads, tp)
            assert (m.head_dim, h, kv) in flash, (name, tp)
            assert (m.head_dim, h, kv) in decode or (h, kv) == pta.GENERIC_DECODE_HEADS, (name, tp)
    seq_heads = {e["key"]["seq_heads"] for e in h200_doc["entries"]
                 if e["kind"] == "decode_attn_GBps" and "n_q_heads" not in e["key"] and e["key"]["head_dim"] == 128}
    assert min(seq_heads) == 1 and max(seq_heads) >= 1024


@pytest.mark.slow
def test_fit_points_reproduce_the_table(h200_parts, h200_table):
    """At every fit point the cost function the simulator calls gives the table's latency (within 0.1 %)."""
    n = 0
    for p in h200_parts:
        for c in p.curves[:: max(1, len(p.curves) // 40)]:
            fit, _ = c.split()
            for x, _y in fit:
                pred = p.predict[c.kind](h200_table, c, x)
                assert pred == pytest.approx(c.measured[x], rel=1e-3), (c.label, x)
                n += 1
    assert n > 500


@settings(max_examples=60, deadline=None, derandomize=True)
@given(i=st.integers(0, 10**6), j=st.integers(0, 10**6), kind=st.sampled_from([0, 1]))
def test_fit_point_property(h200_parts, h200_table, i, j, kind):
    p = h200_parts[kind]
    c = p.curves[i % len(p.curves)]
    fit, held = c.split()
    x = fit[j % len(fit)][0]
    assert p.predict[c.kind](h200_table, c, x) == pytest.approx(c.measured[x], rel=1e-3)
    assert not set(held) & {f[0] for f in fit}


@settings(max_examples=60, deadline=None, derandomize=True)
@given(g=st.integers(1, 24), kv=st.sampled_from([1, 2, 4, 8]), seq=st.integers(1, 16384),
       d=st.sampled_from(pta.HEAD_DIMS))
def test_prefill_rate_between_measured_head_counts(h200_table, g, kv, seq, d):
    """A head configuration off the measured grid is priced between the measured configurations around it."""
    h = g * kv
    axis = sorted({e.key["n_q_heads"] for e in h200_table.entries
                   if e.kind == "flash_tflops" and e.key["head_dim"] == d and e.key["n_kv_heads"] == kv})
    lo, hi = max([a for a in axis if a <= h] or axis[:1]), min([a for a in axis if a >= h] or axis[-1:])
    ys = [h200_table.lookup("flash_tflops", GPU, seq, head_dim=d, n_q_heads=a, n_kv_heads=kv) for a in (lo, hi)]
    y = h200_table.lookup("flash_tflops", GPU, seq, head_dim=d, n_q_heads=h, n_kv_heads=kv)
    assert min(ys) * (1 - 1e-9) <= y <= max(ys) * (1 + 1e-9)


def test_generic_decode_curves_price_other_head_counts(h200_table):
    """A GQA configuration without curves of its own (groups up to 16) is priced by the generic curves at its
    sequences x KV heads: the table's measured rows of such configurations within a few per cent (median)."""
    root = pt.data_root()
    gen = pt.find_tables(root, SYSTEM, "attention", "trtllm", "generation_attention_perf.parquet")[-1]
    best: dict[tuple, float] = {}
    for r in pt.read_rows(gen, pta.GEN_COLS):
        h, kv = r["num_heads"], r["num_key_value_heads"]
        if (r["head_dim"] == 128 and r["window_size"] == 0 and r["kv_cache_dtype"] == "bfloat16" and h > kv
                and h // kv <= 16 and (h, kv) not in pta.DECODE_HEADS):
            k = (h, kv, r["batch_size"], r["step"] + 1)
            best[k] = min(best.get(k, math.inf), r["latency"] * 1e-3)
    gpu = GPUS[GPU]
    errs = []
    for i, ((h, kv, b, ctx), t) in enumerate(sorted(best.items())):
        if i % 4:
            continue
        a = full_attention_decode_totals(gpu, pta._model(h, kv, 128), b, b * ctx, page_tokens=1, calib=h200_table)
        errs.append(abs(a.core_s / t - 1))
    assert len(errs) > 200
    assert statistics.median(errs) < 0.05
    # the same kernel time as the generic configuration at equal sequences x KV heads
    m, g = pta._model(40, 8, 128), pta._model(*pta.GENERIC_DECODE_HEADS, 128)
    a = full_attention_decode(gpu, m, [3000] * 4, page_tokens=1, calib=h200_table)
    b = full_attention_decode(gpu, g, [3000] * 32, page_tokens=1, calib=h200_table)
    assert a.core_s == pytest.approx(b.core_s, rel=1e-9)


def test_notes_say_what_the_curves_are(h200_parts):
    """Batched prefills and fp8 KV caches are curves now: the notes say so, with the evidence, and none of them is
    the per-sequence note that ``sim.coverage`` turns into a caveat."""
    from rackbed.sim.coverage import PER_SEQUENCE_PREFILL_NOTE

    notes = [n for p in h200_parts for n in p.notes]
    text = " ".join(notes)
    assert "449 more from batched rows" in text and "bf16 and fp8 KV caches (key kv)" in text
    assert "one kernel over 2-8 sequences of >= 512 tokens: the table's 4924 rows" in text
    assert not any(n.startswith(PER_SEQUENCE_PREFILL_NOTE) for n in notes)


# ------------------------------------------------------------------------------------------------ batched prefill


def _old_prefill(table, gpu, m, seqs) -> float:
    """How full_attention_prefill priced a batch before sequences shared a kernel: each sequence at the rate of its
    own length and heads (the default model's where no entry matches), plus one fixed cost."""
    h, d, hkv = m.n_q_heads, m.head_dim, m.n_kv_heads
    core, any_q = 0.0, False
    for q, c in seqs:
        if q:
            f = 4.0 * h * d * (q * c + q * (q + 1) / 2)
            y = table.lookup("flash_tflops", gpu.name, q + c, head_dim=d, n_q_heads=h, n_kv_heads=hkv)
            core += f / (y * 1e12 if y is not None else gpu.dense_tflops.bf16 * 1e12 * flash_efficiency(gpu, q + c))
            any_q = True
    return core + (kernel_fixed_us(table, gpu) * 1e-6 if any_q else 0.0)


_seq = st.tuples(st.integers(0, 20000), st.sampled_from([0, 0, 0, 300, 4000]))
_heads = st.tuples(st.sampled_from([1, 2, 4, 8]), st.sampled_from([1, 2, 3, 4, 8, 16]), st.sampled_from(pta.HEAD_DIMS))


@settings(max_examples=60, deadline=None, derandomize=True)
@given(q=st.integers(1, 30000), c=st.integers(0, 30000), hd=_heads)
def test_one_sequence_is_priced_as_before(h200_table, q, c, hd):
    kv, g, d = hd
    m, gpu = pta._model(g * kv, kv, d), GPUS[GPU]
    assert full_attention_prefill(gpu, m, [(q, c)], calib=h200_table).core_s == \
        _old_prefill(h200_table, gpu, m, [(q, c)])


@settings(max_examples=40, deadline=None, derandomize=True)
@given(seqs=st.lists(_seq, min_size=0, max_size=8), tp=st.sampled_from([1, 2, 4, 8]),
       name=st.sampled_from(["qwen3-235b-a22b", "qwen3.5-397b-a17b"]))
def test_engine_calibration_prices_any_batch_per_sequence(engine_cal, seqs, tp, name):
    """The engine's H200 curves pin no head counts: every batch keeps its per-sequence price, to the last bit."""
    gpu, m = GPUS[GPU], get_model(name)
    h, hkv = local_heads(m.n_q_heads, tp), local_heads(m.n_kv_heads, tp)
    local = pta._model(h, hkv, m.head_dim)
    assert full_attention_prefill(gpu, m, seqs, tp=tp, calib=engine_cal).core_s == \
        _old_prefill(engine_cal, gpu, local, seqs)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(hd=_heads, n=st.sampled_from([2, 4, 8, 16, 64]), q=st.integers(16, 16384))
def test_equal_sequences_are_one_sequence_of_their_heads_across_the_batch(h200_table, hd, n, q):
    kv, g, d = hd
    gpu = GPUS[GPU]
    batch = full_attention_prefill(gpu, pta._model(g * kv, kv, d), [(q, 0)] * n, calib=h200_table)
    one = full_attention_prefill(gpu, pta._model(n * g * kv, n * kv, d), [(q, 0)], calib=h200_table)
    assert batch.core_s == pytest.approx(one.core_s, rel=1e-12) and batch.core_flops == pytest.approx(one.core_flops)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(hd=_heads, q=st.integers(16, 16384), copies=st.floats(1.0, 300.0))
def test_rate_between_the_powers_of_two_around_the_copies(h200_table, hd, q, copies):
    kv, g, d = hd
    gpu = GPUS[GPU]
    n0 = 2 ** math.floor(math.log2(copies))
    ys = [flash_rate(h200_table, gpu, q, d, g * kv, kv, float(n)) for n in (n0, 2 * n0)]
    y = flash_rate(h200_table, gpu, q, d, g * kv, kv, copies)
    assert min(ys) * (1 - 1e-12) <= y <= max(ys) * (1 + 1e-12)
    assert flash_rate(h200_table, gpu, q, d, g * kv, kv, 1.0) == \
        h200_table.lookup("flash_tflops", GPU, q, head_dim=d, n_q_heads=g * kv, n_kv_heads=kv)


@settings(max_examples=40, deadline=None, derandomize=True)
@given(seqs=st.lists(st.tuples(st.integers(1, 16384), st.just(0)), min_size=2, max_size=8), hd=_heads,
       data=st.data())
def test_a_mixed_batch_shares_one_kernel(h200_table, seqs, hd, data):
    """Order does not matter; sharing a kernel costs about what separate kernels cost at most (the tables' batched
    rows are up to ~10 % slower per FLOP than one sequence at long lengths) and never much less than the longest
    sequence alone."""
    kv, g, d = hd
    m, gpu = pta._model(g * kv, kv, d), GPUS[GPU]
    t = full_attention_prefill(gpu, m, seqs, calib=h200_table).core_s
    shuffled = data.draw(st.permutations(seqs))
    assert full_attention_prefill(gpu, m, shuffled, calib=h200_table).core_s == pytest.approx(t, rel=1e-12)
    alone = [full_attention_prefill(gpu, m, [s], calib=h200_table).core_s for s in seqs]
    assert 0.8 * max(alone) <= t <= 1.15 * sum(alone)


def test_batched_rows_priced_as_measured(h200_parts, h200_table):
    """The table's batches of 2-8 sequences of >= 512 tokens through full_attention_prefill and the fitted curves
    (fit and held-out rows): a few per cent, where the batch-1 curves per sequence were 16 % (median) slow."""
    root = pt.data_root()
    ctx = pt.find_tables(root, SYSTEM, "attention", "trtllm", "context_attention_perf.parquet")[-1]
    gpu = GPUS[GPU]
    new, old = [], []
    for i, r in enumerate(pt.read_rows(ctx, pta.CTX_COLS)):
        b, q = int(r["batch_size"]), int(r["isl"])
        if not pta._ctx_usable(r) or int(r["window_size"]) or not 2 <= b <= 8 or q < 512 or i % 5:
            continue
        m = pta._model(int(r["num_heads"]), int(r["num_key_value_heads"]), int(r["head_dim"]))
        t = r["latency"] * 1e-3
        new.append(abs(full_attention_prefill(gpu, m, [(q, 0)] * b, calib=h200_table).core_s / t - 1))
        old.append(_old_prefill(h200_table, gpu, m, [(q, 0)] * b) / t - 1)
    assert len(new) > 900
    assert statistics.median(new) < 0.03 and sorted(new)[int(0.9 * len(new))] < 0.12
    assert statistics.median(old) > 0.1


# ------------------------------------------------------------------------------------------------ fp8 KV decode


def test_fp8_kv_curves_price_the_fp8_rows(h200_parts, h200_table):
    """Every decode head configuration has fp8-KV curves of its own; through full_attention_decode at 1 B per
    element they price the table's fp8 rows, which the bf16 curves at 1 B per element miss by far more."""
    gen = h200_parts[1]
    fp8 = [c for c in gen.curves if c.key["kv"] == "fp8" and "window" not in c.key]
    bf16 = [c for c in gen.curves if c.key["kv"] == "bf16" and "window" not in c.key]
    assert len(fp8) == len(bf16) == 540
    bf16_only = CalibrationTable(entries=tuple(e for e in h200_table.entries if e.key.get("kv") != "fp8"),
                                 interpolation="log-log")
    unkeyed = CalibrationTable(entries=tuple(CalibrationEntry(kind=e.kind, gpu=e.gpu, points=e.points,
                                                              key={k: v for k, v in e.key.items() if k != "kv"})
                                             for e in bf16_only.entries if e.kind == "decode_attn_GBps"),
                               interpolation="log-log")
    ours, before = [], []
    for c in fp8[::7]:
        _, held = c.split()
        for x in held:
            ours.append(abs(gen.predict["decode_attn_GBps"](h200_table, c, x) / c.measured[x] - 1))
            before.append(abs(gen.predict["decode_attn_GBps"](unkeyed, c, x) / c.measured[x] - 1))
    assert len(ours) > 200
    assert statistics.median(ours) < 0.05 and statistics.median(before) > 0.1


def test_fp8_queries_never_take_bf16_curves(h200_table):
    """An fp8 cache of a head configuration without curves of its own takes the generic fp8 curves, not the
    specific bf16 ones; a bf16 cache is priced as before (the same value with or without fp8 curves)."""
    gpu = GPUS[GPU]
    m, gen = pta._model(40, 8, 128), pta._model(*pta.GENERIC_DECODE_HEADS, 128)
    a = full_attention_decode(gpu, m, [3000] * 4, page_tokens=1, kv_elem_bytes=1, calib=h200_table)
    b = full_attention_decode(gpu, gen, [3000] * 32, page_tokens=1, kv_elem_bytes=1, calib=h200_table)
    assert a.core_s == pytest.approx(b.core_s, rel=1e-9)
    m32 = pta._model(32, 4, 128)
    fp8 = h200_table.lookup_along("decode_attn_GBps", GPU, 4096, "seq_heads", 64, head_dim=128, n_q_heads=32,
                                  n_kv_heads=4, kv="fp8")
    assert fp8 == h200_table.lookup("decode_attn_GBps", GPU, 4096, head_dim=128, n_q_heads=32, n_kv_heads=4,
                                    seq_heads=64, kv="fp8")
    assert h200_table.entry("decode_attn_GBps", GPU, head_dim=128, n_q_heads=32, n_kv_heads=4, seq_heads=64,
                            kv="fp8").key["kv"] == "fp8"
    no_fp8 = CalibrationTable(entries=tuple(e for e in h200_table.entries if e.key.get("kv") != "fp8"),
                              grid=h200_table.grid, interpolation="log-log")
    for kvb in (2.0, 1.0):
        with_fp8 = full_attention_decode(gpu, m32, [1500, 37, 8000], kv_elem_bytes=kvb, calib=h200_table).core_s
        without = full_attention_decode(gpu, m32, [1500, 37, 8000], kv_elem_bytes=kvb, calib=no_fp8).core_s
        assert (with_fp8 == without) == (kvb == 2.0)
    assert kv_format(2) == "bf16" and kv_format(1) == "fp8" and kv_format(0.5) == "fp8"


# ------------------------------------------------------------------------------------------------ caveats


@pytest.mark.slow
def test_caveats_only_where_the_calibration_lacks_the_curves():
    """GB200 runs with an fp8 KV cache print no attention caveat (the shipped file has fp8-KV and batched prefill
    curves); a calibration without fp8-KV curves, or with the per-sequence prefill note, says so."""
    from rackbed import scenarios
    from rackbed.sim.calibrate import CalibrationFile
    from rackbed.sim.coverage import PER_SEQUENCE_PREFILL_NOTE, calibration_caveats
    from rackbed.sim.scenario import build, load_scenario

    sc = load_scenario(scenarios.resolve("nvl72-default"))
    b = build(sc.model_copy(update={"kv_dtype": "fp8", "weight_format": "fp8"}))
    assert b.decode_plan.kv_dtype == "fp8"
    assert not [c for c in b.caveats if c.startswith(("decode attention", "prefill attention"))], b.caveats
    full = b.calibration.model_dump()
    no_fp8 = CalibrationFile.model_validate({**full, "entries": [e for e in full["entries"]
                                                                 if e["key"].get("kv") != "fp8"]})
    lines = calibration_caveats(no_fp8, b.topology, b.model, b.prefill_plan, b.decode_plan)
    assert any(c.startswith("decode attention with an fp8 KV cache: the tables' bf16-KV curves") for c in lines)
    old = f"{PER_SEQUENCE_PREFILL_NOTE} 2-8 sequences of >= 512 tokens priced per sequence by the batch-1 curves"
    noted = CalibrationFile.model_validate({**full, "meta": {**full["meta"], "notes": [old]}})
    assert old in calibration_caveats(noted, b.topology, b.model, b.prefill_plan, b.decode_plan)


def test_missing_tables_and_bad_tables(tmp_path):
    empty = pta.import_context_attention(tmp_path, SYSTEM, "trtllm", GPU)
    assert not empty.curves and "no context-attention table" in empty.notes[0]
    assert not pta.import_generation_attention(tmp_path, SYSTEM, "trtllm", GPU).curves
    import pyarrow as pa
    import pyarrow.parquet as pq

    d = tmp_path / SYSTEM / "attention" / "trtllm" / "9.9"
    d.mkdir(parents=True)
    pq.write_table(pa.table({"batch_size": [1], "isl": [16], "latency": [0.01]}), d / "context_attention_perf.parquet")
    with pytest.raises(UserError, match=r"context_attention_perf.parquet: missing column 'kernel_source'"):
        pta.import_context_attention(tmp_path, SYSTEM, "trtllm", GPU)


# ------------------------------------------------------------------------------------------------ engine H200 file

#: (model, tp, prefill core_s, decode core_s, decode-totals core_s) with calibration/h200.yaml, computed before the
#: lookups passed the local head counts: the engine's entries (head_dim / head_dim + seq_heads) still match
ENGINE_H200 = (
    ('qwen3-235b-a22b', 1, 0.00040489854367680155, 1.2379810316844321e-05, 7.997755650031231e-05),
    ('qwen3-235b-a22b', 2, 0.00020299927183840076, 9.628057362310297e-06, 4.651991516481163e-05),
    ('qwen3-235b-a22b', 4, 0.00010204963591920038, 7.187597946164619e-06, 2.7869758578666168e-05),
    ('qwen3-235b-a22b', 8, 5.157481795960019e-05, 7.187597946164619e-06, 2.7869758578666168e-05),
    ('qwen3-30b-a3b', 1, 0.00020299927183840076, 1.2379810316844321e-05, 7.997755650031231e-05),
    ('qwen3-30b-a3b', 2, 0.00010204963591920038, 9.628057362310297e-06, 4.651991516481163e-05),
    ('qwen3-30b-a3b', 4, 5.157481795960019e-05, 7.187597946164619e-06, 2.7869758578666168e-05),
    ('qwen3-30b-a3b', 8, 2.6337408979800095e-05, 7.187597946164619e-06, 2.7869758578666168e-05),
    ('qwen3.5-397b-a17b', 1, 0.00041302774355053294, 6.543182178880478e-06, 7.92500216459231e-05),
    ('qwen3.5-397b-a17b', 2, 0.00020706387177526646, 4.1277901942216485e-06, 4.075173628834917e-05),
    ('qwen3.5-397b-a17b', 4, 0.00010408193588763323, 4.1277901942216485e-06, 4.075173628834917e-05),
    ('qwen3.5-397b-a17b', 8, 5.2590967943816614e-05, 4.1277901942216485e-06, 4.075173628834917e-05),
)


@pytest.fixture(scope="module")
def engine_cal():
    return default_calibration_for(GPU, stack="rackbed")


@pytest.mark.parametrize("name,tp,prefill,decode,totals", ENGINE_H200)
def test_engine_h200_numbers_unchanged(engine_cal, name, tp, prefill, decode, totals):
    cal = engine_cal
    gpu, m = GPUS[GPU], get_model(name)
    assert full_attention_prefill(gpu, m, [(3000, 0), (700, 1200)], tp=tp, calib=cal).core_s == \
        pytest.approx(prefill, rel=1e-12)
    assert full_attention_decode(gpu, m, [1500, 37, 8000], tp=tp, calib=cal).core_s == \
        pytest.approx(decode, rel=1e-12)
    assert full_attention_decode_totals(gpu, m, 64, 64 * 2500, tp=tp, calib=cal).core_s == \
        pytest.approx(totals, rel=1e-12)


@settings(max_examples=80, deadline=None, derandomize=True)
@given(h=st.integers(1, 128), kv=st.integers(1, 16), x=st.floats(1, 1e5), sh=st.floats(1, 5000))
def test_engine_entries_match_queries_with_head_counts(engine_cal, h, kv, x, sh):
    """An entry pinning fewer fields matches a query carrying the head counts too, with the same value."""
    cal = engine_cal
    assert cal.lookup("flash_tflops", GPU, x, head_dim=128) == \
        cal.lookup("flash_tflops", GPU, x, head_dim=128, n_q_heads=h, n_kv_heads=kv)
    for fmt in ("bf16", "fp8"):
        assert cal.lookup_along("decode_attn_GBps", GPU, x, "seq_heads", sh, head_dim=128) == \
            cal.lookup_along("decode_attn_GBps", GPU, x, "seq_heads", sh, head_dim=128, n_q_heads=h, n_kv_heads=kv,
                             kv=fmt)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(seqs=st.lists(st.tuples(st.integers(1, 8192), st.integers(0, 8192)), min_size=1, max_size=6),
       extra=st.tuples(st.integers(1, 4096), st.integers(0, 8192)))
def test_adding_a_sequence_never_makes_a_prefill_batch_faster(h200_table, seqs, extra):
    """More work in one kernel never takes less time (also for short and cached sequences, which the equal-
    sequence copies rule alone would let borrow a long neighbour's batch rate)."""
    from rackbed.engine.core.model import get_model
    from rackbed.sim.costs.attention import full_attention_prefill
    from rackbed.topology.specs import GPUS

    g, m = GPUS["H200-SXM"], get_model("qwen3-235b-a22b")
    base = full_attention_prefill(g, m, seqs, tp=4, calib=h200_table).core_s
    more = full_attention_prefill(g, m, [*seqs, extra], tp=4, calib=h200_table).core_s
    slowest = max(full_attention_prefill(g, m, [s], tp=4, calib=h200_table).core_s for s in [*seqs, extra])
    assert more >= slowest * (1 - 1e-9)
    assert more >= base * 0.999 or len(set(seqs)) == 1
