"""gpt-oss on H200 from TensorRT-LLM's measured tables (sim.perf_tables, sim.perf_tables_attention): its 128-token
sliding-window layers (key ``window``), its full-attention layers (head dim 64) and its MXFP4 expert blocks
(``moe_us``, fmt ``mxfp4``) price the tables' own rows, read straight from the parquet files, through the cost
functions the simulator calls with the shipped calibration/h200-trtllm.json.gz."""

from __future__ import annotations

import statistics

import pytest

pytest.importorskip("aiconfigurator_core", reason="needs the tables extra: pip install 'rackbed[tables]'")
pq = pytest.importorskip("pyarrow.parquet")

from rackbed.engine.core.model import get_model
from rackbed.sim import perf_tables as pt
from rackbed.sim.calibrate import default_calibration_for
from rackbed.sim.costs.attention import (
    full_attention_decode,
    sliding_attention_decode,
    sliding_attention_prefill,
)
from rackbed.sim.costs.moe_block import moe_block_s
from rackbed.topology.specs import GPUS

GPU = GPUS["H200-SXM"]
ATT = "h200_sxm/attention/trtllm/1.3.0rc20/"


@pytest.fixture(scope="module")
def calib():
    return default_calibration_for("H200-SXM", stack="trtllm")


@pytest.fixture(scope="module")
def gptoss():
    return get_model("gpt-oss-120b")


def _rows(rel: str, **eq) -> list[dict]:
    """The parquet rows of ``rel`` whose columns equal ``eq`` (bf16 attention and KV where the table has them)."""
    import pyarrow.compute as pc

    t = pq.read_table(pt.data_root() / rel)
    mask = None
    for k, v in eq.items():
        m = pc.equal(t[k], v)
        mask = m if mask is None else pc.and_(mask, m)
    return t.filter(mask).to_pylist()


def _errs(pairs) -> list[float]:
    return sorted(abs(p / m - 1.0) for p, m in pairs)


def test_gptoss_sliding_prefill_prices_the_measured_rows(calib, gptoss):
    """One sequence of gpt-oss's TP1 sliding layer (64 / 8 heads of 64, window 128): every measured length."""
    rows = _rows(ATT + "context_attention_perf.parquet", head_dim=64, window_size=128, num_heads=64,
                 num_key_value_heads=8, batch_size=1, attn_dtype="bfloat16", kv_cache_dtype="bfloat16")
    assert len(rows) >= 15
    errs = _errs((sliding_attention_prefill(GPU, gptoss, [(int(r["isl"]), 0)], calib=calib).core_s,
                  r["latency"] * 1e-3) for r in rows)
    assert statistics.median(errs) <= 0.02 and errs[-1] <= 0.20, errs
    long = _errs((sliding_attention_prefill(GPU, gptoss, [(int(r["isl"]), 0)], calib=calib).core_s,
                  r["latency"] * 1e-3) for r in rows if r["isl"] >= 512)
    assert long[-1] <= 0.08, long  # fit rows to rounding, held-out rows (every third length) within 6 %


def test_gptoss_sliding_decode_prices_the_measured_rows(calib, gptoss):
    """gpt-oss's sliding layer at DP attention (64 / 8 heads per GPU), 16 and 64 sequences, every context: the
    measured kernel's time keeps growing past the window, and the curves follow it."""
    for b in (16, 64):
        rows = _rows(ATT + "generation_attention_perf.parquet", head_dim=64, window_size=128, num_heads=64,
                     num_key_value_heads=8, batch_size=b, kv_cache_dtype="bfloat16")
        assert len(rows) >= 8
        errs = _errs((sliding_attention_decode(GPU, gptoss, [int(r["step"]) + 1] * b, page_tokens=1,
                                               calib=calib).core_s, r["latency"] * 1e-3) for r in rows)
        assert statistics.median(errs) <= 0.03 and errs[-1] <= 0.35, (b, errs)  # held out: kernel switches


def test_gptoss_full_layers_price_the_measured_head_dim_64_rows(calib, gptoss):
    rows = _rows(ATT + "generation_attention_perf.parquet", head_dim=64, window_size=0, num_heads=64,
                 num_key_value_heads=8, batch_size=16, kv_cache_dtype="bfloat16")
    errs = _errs((full_attention_decode(GPU, gptoss, [int(r["step"]) + 1] * 16, page_tokens=1,
                                        calib=calib).core_s, r["latency"] * 1e-3) for r in rows)
    assert statistics.median(errs) <= 0.03 and errs[-1] <= 0.20, errs


def test_sliding_and_full_curves_never_price_each_other(calib, gptoss):
    """At a long context the sliding layer is priced by its own curves (far below the full layer's time) and the
    full layer by its own (the window's rows are not a short context of a full-attention kernel)."""
    m = {r["step"] + 1: r["latency"] * 1e-3 for r in _rows(
        ATT + "generation_attention_perf.parquet", head_dim=64, num_heads=64, num_key_value_heads=8,
        batch_size=16, kv_cache_dtype="bfloat16", window_size=0)}
    ctx = max(m)  # the table's longest context at 16 sequences
    sl = sliding_attention_decode(GPU, gptoss, [ctx] * 16, page_tokens=1, calib=calib).core_s
    fu = full_attention_decode(GPU, gptoss, [ctx] * 16, page_tokens=1, calib=calib).core_s
    assert 2 * sl < fu and abs(fu / m[ctx] - 1) < 0.02


def test_gptoss_moe_block_prices_the_measured_mxfp4_rows(calib, gptoss):
    """The H200 table's MXFP4 MoE (w4a16: bf16 activations, Hopper has no FP4 tensor cores) at gpt-oss's shape,
    every measured token count, at the EP sizes of the gpt-oss figure."""
    for ep in (1, 4, 8):
        rows = _rows("h200_sxm/moe/trtllm/1.3.0rc20/moe_perf.parquet", moe_dtype="w4a16_mxfp4", hidden_size=2880,
                     inter_size=2880, topk=4, num_experts=128, moe_tp_size=1, moe_ep_size=ep,
                     distribution="balanced")
        assert len(rows) >= 20
        errs = _errs((moe_block_s(calib, GPU, gptoss, "mxfp4", 1, ep, int(r["num_tokens"])),
                      r["latency"] * 1e-3) for r in rows)
        assert statistics.median(errs) <= 0.02 and errs[-1] <= 0.35, (ep, errs)  # held out: kernel switches


def test_gptoss_scenario_prints_no_sliding_or_moe_caveat():
    from rackbed import scenarios
    from rackbed.sim.scenario import build, load_scenario

    b = build(load_scenario(scenarios.resolve("gptoss_h200_node")))
    assert not [c for c in b.caveats if "sliding" in c or "MoE block" in c], b.caveats
