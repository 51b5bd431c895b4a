"""The model-family scenarios (DeepSeek-V3 wide EP on GB200 NVL72 and over InfiniBand on H200, gpt-oss-120b on one
H200 node) and their decode-step figures: each shipped file runs in full, serves every request, and is searched by
``rackbed search`` with the plans it names. Each run takes a few seconds."""

from __future__ import annotations

import json
import time

import pytest
from lane import first_in_lane

from rackbed import scenarios
from rackbed.engine.cli.main import main
from rackbed.sim.figures import compute_figure, load_figure
from rackbed.sim.scenario import load_scenario, simulate_scenario

SERVING = ("dsv3_nvl72_ep32", "dsv3_nvl72_ep64", "dsv3_nvl72_ep72", "dsv3_h200_ib", "gptoss_h200_node")
FIGURES = ("fig_dsv3_decode_ep", "fig_gptoss_decode", "fig_dsv3_decode_overlap")
BUDGET_S = 30.0  # wall seconds per run on a loaded 2-core machine (each takes a few seconds alone)


@pytest.mark.parametrize("name", first_in_lane(SERVING))
def test_scenario_serves_every_request(name):
    sc = load_scenario(scenarios.resolve(name))
    t0 = time.perf_counter()
    b, res = simulate_scenario(sc)
    wall = time.perf_counter() - t0
    m = res.metrics
    assert m["requests"]["done"] == m["requests"]["total"] > 0, m["requests"]
    assert wall < BUDGET_S, f"{name} took {wall:.1f} s"
    assert m["throughput"]["output_tokens_per_s_per_gpu"] > 0
    assert m["latency_s"]["tpot"]["p50"] < sc.slo.tpot_s
    d = b.decode_plan
    assert (b.model.n_experts + d.redundant_experts) % d.ep == 0
    if name == "dsv3_nvl72_ep72":
        assert d.ep == 72 and d.redundant_experts == 32 and d.slots_per_rank(b.model) == 4
    # decoders on one NVLink domain, prefillers elsewhere: the KV crosses the network
    for g in b.deployment.decoders:
        dom = b.topology.nvlink_domain(g.gpus[0])
        assert all(x in dom for x in g.gpus)


def test_wide_ep_memory_counts_the_copies():
    """EP72 with 32 redundant experts stores 288 / 256 of EP64's expert bytes over 72 / 64 of the GPUs: the same
    per-GPU expert weights (4 experts each), so the same KV room (to the page)."""
    b64 = load_scenario(scenarios.resolve("dsv3_nvl72_ep64"))
    b72 = load_scenario(scenarios.resolve("dsv3_nvl72_ep72"))
    from rackbed.sim.scenario import build

    m64, m72 = build(b64).decode_budget, build(b72).decode_budget
    assert m72.expert_weight_bytes == pytest.approx(m64.expert_weight_bytes, rel=1e-6)
    assert m72.redundant_experts == 32


@pytest.mark.parametrize("name", FIGURES)
def test_decode_step_figure(name):
    sc = load_figure(scenarios.resolve(name))
    res = compute_figure(sc)
    for r in res.rows:
        parts = sum(r[c] for c in ("attention_ms", "moe_gemm_ms", "dispatch_combine_ms", "allreduce_ms", "other_ms"))
        assert parts == pytest.approx(r["step_ms"], rel=1e-3, abs=1e-3)
        assert r["tokens_per_s_per_gpu"] > 0 and r["fits_batch"]
    if name == "fig_dsv3_decode_ep":
        by = {(r["ep"], r["batch_per_rank"]): r for r in res.rows}
        # wider EP: fewer experts per GPU, less expert GEMM than EP8; attention is per DP rank and does not change
        assert max(by[32, 64]["moe_gemm_ms"], by[72, 64]["moe_gemm_ms"]) < by[8, 64]["moe_gemm_ms"]
        # EP72 with 288 slots is a rank of 4 experts at balanced load, as EP64's: the same measured block
        assert by[72, 64]["moe_gemm_ms"] == pytest.approx(by[64, 64]["moe_gemm_ms"], rel=1e-6)
        assert by[72, 64]["attention_ms"] == pytest.approx(by[8, 64]["attention_ms"], rel=1e-6)
        assert by[72, 64]["redundant_experts"] == 32
    if name == "fig_dsv3_decode_overlap":
        by = {(r["overlap"], r["batch_per_rank"]): r for r in res.rows}
        for b in sc.batch_per_rank:
            none, sbo, tbo = by["none", b], by["shared_expert", b], by["two_batch", b]
            # the shared expert hides under the dispatch: the same terms, a shorter step
            assert sbo["step_ms"] < none["step_ms"] and sbo["hidden_ms"] > 0 and none["hidden_ms"] == 0
            # two micro-batches hide nearly all of the all-to-all, but stream every weight twice
            assert tbo["dispatch_combine_ms"] < 0.1 * none["dispatch_combine_ms"]
            assert tbo["moe_gemm_ms"] > none["moe_gemm_ms"]
        assert by["two_batch", 16]["step_ms"] > by["none", 16]["step_ms"]
        assert by["two_batch", 512]["step_ms"] < by["none", 512]["step_ms"]


def test_search_enumerates_wide_ep_with_redundant_experts(tmp_path):
    """`rackbed search` on DeepSeek-V3 with decode EP 72: the candidate carries the 32 redundant experts that make
    72 divide the slots (in its label and its scenario overrides)."""
    from rackbed.sim.search import decode_options, parse_search, workload_load
    from rackbed.topology import load

    spec = parse_search({"model": "deepseek-v3", "space": {"topology": ["gb200-nvl72"], "weight_format": ["nvfp4"],
                                                          "decode_ep": [64, 72], "max_batch_per_rank": [32],
                                                          "draft_k": [1]},
                         "workload": {"kind": "synthetic", "arrival": {"kind": "poisson", "rate_per_s": 2},
                                      "prompt": {"kind": "fixed", "tokens": 2000},
                                      "output": {"kind": "fixed", "tokens": 200}, "n_requests": 20},
                         "slo": {"ttft_s": 2, "tpot_s": 0.05}}, "test")
    from rackbed.engine.core.model import get_model

    opts = decode_options(spec, workload_load(spec.workload), get_model("deepseek-v3"),
                          {"gb200-nvl72": load("gb200-nvl72")})
    by = {o.ep: o for o in opts}
    assert by[64].redundant_experts == 0 and by[72].redundant_experts == 32
    assert by[72].pruned is None and by[72].tpot_s > 0, by[72].pruned


def test_run_cli_prints_the_figure(tmp_path, capsys):
    assert main(["run", "fig_dsv3_decode_ep", "--out", str(tmp_path / "f")]) == 0
    doc = json.loads((tmp_path / "f" / "fig_dsv3_decode_ep.json").read_text())
    assert {r["config"] for r in doc["rows"]} == {"EP8", "EP32", "EP64", "EP72 +32 redundant"}
    assert "claim:" in capsys.readouterr().out
