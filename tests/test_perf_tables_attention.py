"""Attention tables of aiconfigurator-core as flash_tflops / decode_attn_GBps curves (sim.perf_tables_attention),
and the attention cost functions' lookups by local head counts (the engine's H200 calibration unchanged)."""

from __future__ import annotations

import math
import statistics

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.core.model import get_model
from sim import perf_tables as pt
from sim import perf_tables_attention as pta
from sim.calibrate import default_calibration_for
from sim.costs.attention import (
    full_attention_decode,
    full_attention_decode_totals,
    full_attention_prefill,
    local_heads,
)
from sim.costs.calibration import CalibrationEntry, CalibrationTable
from topology.errors import UserError
from topology.specs import GPUS

pytest.importorskip("pyarrow")
pytest.importorskip("aiconfigurator_core")

GPU = "H200-SXM"
SYSTEM = "h200_sxm"


@pytest.fixture(scope="module")
def h200_doc():
    """The H200 TRT-LLM calibration built by the real pipeline from the attention importers alone."""
    mp = pytest.MonkeyPatch()
    mp.setattr(pt, "IMPORTERS", ())
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


# ------------------------------------------------------------------------------------------------ the import


def test_h200_holdout_meets_targets(h200_doc):
    v = h200_doc["meta"]["validation"]
    assert set(v) == {"flash_tflops", "decode_attn_GBps"}
    for kind, s in v.items():
        assert s["n"] > 300, kind
        assert s["median_pct"] <= 5.0 and s["p90_pct"] <= 15.0, (kind, s)
    assert h200_doc["grid"] == {"flash_tflops": ["n_q_heads", "n_kv_heads"]}
    files = {t["file"] for t in h200_doc["meta"]["tables"]}
    assert files == {"h200_sxm/attention/trtllm/1.3.0rc20/context_attention_perf.parquet",
                     "h200_sxm/attention/trtllm/1.3.0rc20/generation_attention_perf.parquet"}


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


def test_notes_name_what_is_not_a_curve(h200_parts):
    notes = " ".join(n for p in h200_parts for n in p.notes)
    assert "batches of 2-8 sequences" in notes and "fp8 KV cache" in notes


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
    assert cal.lookup_along("decode_attn_GBps", GPU, x, "seq_heads", sh, head_dim=128) == \
        cal.lookup_along("decode_attn_GBps", GPU, x, "seq_heads", sh, head_dim=128, n_q_heads=h, n_kv_heads=kv)
