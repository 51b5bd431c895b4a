"""engine/bench/mla_decode.py on the CPU with a tiny config: it runs the engine's MLA decode step end to end and
writes the JSON the device run writes (times, byte counts, both rooflines)."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from rackbed.engine.bench import mla_decode


@pytest.mark.slow
def test_tiny_run_writes_the_json(tmp_path):
    out = tmp_path / "mla.json"
    assert mla_decode.main(["--tiny", "--device", "cpu", "--context", "20", "--batches", "1", "3", "--reps", "1",
                            "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["bench"] == "mla_decode" and doc["device"] == "cpu" and doc["torch"] == torch.__version__
    assert "--tiny" in doc["command"] and doc["kv_values_per_token"] == 40
    assert [r["batch"] for r in doc["rows"]] == [1, 3]
    for r in doc["rows"]:
        assert r["step_ms"] > 0 and 1 <= r["experts_touched_per_layer"] <= 16
        assert r["kv_bytes"] == 2 * r["batch"] * 21 * 40 * 4                  # layers x batch x (ctx+1) x 576-analogue x fp32
        assert r["ratio_to_spec_roofline"] == pytest.approx(r["step_ms"] / r["roofline_spec_ms"])


def test_full_width_byte_count_matches_deepseek_v3():
    """DeepSeek-V3 width: 2 MoE layers read ~2 x (187 M MLA + 8 x 44 M routed + 44 M shared + 1.8 M router) bf16
    params, the LM head 129,280 x 7,168, and the latent: 576 values per token and layer."""
    from argparse import Namespace

    cfg = mla_decode._config(Namespace(tiny=False, model="deepseek-v3", layers=2))
    assert cfg.dense_layers == () and cfg.hidden == 7168 and cfg.n_experts == 256 and cfg.top_k == 8
    w, kv = mla_decode._bytes(cfg, 8, 64, 4096)
    assert kv == 2 * 64 * 4097 * 576 * 2
    layer = 187_105_280 + 9 * 3 * 7168 * 2048 + 256 * 7168
    assert w == pytest.approx(2 * (2 * layer) + 2 * 129_280 * 7168, rel=1e-3)
