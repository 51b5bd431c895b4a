"""The model-family scenarios (DeepSeek-V3 wide EP on GB200 NVL72 and over InfiniBand on H200, gpt-oss-120b on one
H200 node) and their decode-step figures: each shipped file runs in full, serves every request, and is searched by
``rackbed search`` with the plans it names. Each run takes a few seconds."""

from __future__ import annotations

import io
import json
import time
from pathlib import Path

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


# ------------------------------------------------------------------------------------ the wide-EP study

STUDY_JSON = Path(__file__).resolve().parents[1] / "results" / "models" / "fig_wide_ep_study.json"


def _study_rows() -> tuple[dict[tuple, dict], dict]:
    doc = json.loads(STUDY_JSON.read_text())
    return {(r["panel"], r["case"], r["ep"], r["overlap"], r["batch_per_rank"]): r for r in doc["rows"]}, doc


def test_wide_ep_study_moves_the_expected_ways():
    """The recorded study (``rackbed run fig_wide_ep_study``, docs/MODELS.md "Wide-EP study"), every panel:
    the power law lowers tokens/s per GPU below uniform routing at wide EP, more the wider; EPLB with its
    redundant slots recovers part of it; overlap changes the step (two micro-batches hide dispatch / combine);
    at each SLO the winning EP under the power law is no wider than under uniform routing, and EPLB's no
    narrower."""
    rows, doc = _study_rows()
    sc = doc["scenario_config"]
    panels = [p["label"] for p in sc["panels"]]
    grid = [b for b in sc["batch_per_rank"] if b >= 32]
    for panel in panels:
        for b in grid:
            loss = {}
            for ep in (32, 64, 72):
                uni, pl, eplb = (rows[panel, c, ep, "none", b]
                                 for c in ("uniform", "power law", "power law + EPLB"))
                assert pl["tokens_per_s_per_gpu"] < uni["tokens_per_s_per_gpu"], (panel, ep, b)
                assert pl["tokens_per_s_per_gpu"] < eplb["tokens_per_s_per_gpu"], (panel, ep, b)
                # the busiest rank: its dispatch / combine and GEMM, not attention, carry the loss
                assert pl["attention_ms"] == uni["attention_ms"]
                assert pl["dispatch_combine_ms"] > uni["dispatch_combine_ms"]
                assert pl["moe_gemm_ms"] > uni["moe_gemm_ms"]
                loss[ep] = 1 - pl["tokens_per_s_per_gpu"] / uni["tokens_per_s_per_gpu"]
            assert loss[32] < loss[64] < loss[72], (panel, b, loss)
            for case in ("uniform", "power law"):
                none, tbo = rows[panel, case, 64, "none", b], rows[panel, case, 64, "two_batch", b]
                assert tbo["step_ms"] != none["step_ms"] and tbo["hidden_ms"] > 0 == none["hidden_ms"]
                assert tbo["dispatch_combine_ms"] < 0.2 * none["dispatch_combine_ms"]
    wins = {(g["panel"], g["case"], g["overlap"], g["slo_tokens_per_s_per_user"]): g["ep"]
            for g in doc["slo"] if g["wins"]}
    for (panel, case, mode, slo), ep in wins.items():
        if case == "power law":
            assert ep <= wins[panel, "uniform", mode, slo]
            assert ep <= wins[panel, "power law + EPLB", mode, slo]


def test_wide_ep_study_row_reproduces():
    """One EP of the study priced again (DeepSeek-V3 EP64, every case, no overlap and two micro-batches, two
    batches per GPU and the batch that fills KV memory) gives exactly the recorded rows, in under 20 s."""
    from rackbed.sim.figures import frontier_rows

    rows, _ = _study_rows()
    sc = load_figure(scenarios.resolve("fig_wide_ep_study"))
    quick = sc.model_copy(update={"panels": sc.panels[:1], "eps": (64,), "overlaps": ("none", "two_batch"),
                                  "batch_per_rank": (32, 128)})
    t0 = time.perf_counter()
    got = frontier_rows(quick)
    assert time.perf_counter() - t0 < 20.0
    assert {r["batch_per_rank"] for r in got} > {32, 128}  # and where each curve ends
    for r in got:
        assert r == rows[r["panel"], r["case"], r["ep"], r["overlap"], r["batch_per_rank"]]


@pytest.mark.slow
def test_wide_ep_study_reproduces(tmp_path):
    """The whole study run again (about a minute) gives the recorded rows and SLO table."""
    from rich.console import Console

    from rackbed.sim.figures import run_figure

    doc = run_figure(scenarios.resolve("fig_wide_ep_study"), tmp_path, console=Console(file=io.StringIO()))
    _, want = _study_rows()
    assert doc["rows"] == want["rows"] and doc["slo"] == want["slo"]
    assert (tmp_path / "fig_wide_ep_study.png").stat().st_size > 0


def test_wide_ep_search_prices_skew():
    """The study's search specs (scenarios/sweeps/wide-ep-search-dsv3*.yaml), analytic stage only: under
    uniform routing every decode option meets the TPOT SLO; under the power law the busiest rank slows every
    step, the more the wider the EP (at the same batch cap), and EP64 fails the SLO from 128 sequences per GPU
    while EP8 meets it at every cap."""
    from rackbed.engine.core.model import get_model
    from rackbed.sim.search import decode_options, load_search, workload_load
    from rackbed.topology import load

    topo, model = {"gb200-nvl72": load("gb200-nvl72")}, get_model("deepseek-v3")
    opts = {}
    for name in ("wide-ep-search-dsv3", "wide-ep-search-dsv3-skew"):
        spec = load_search(name)
        opts[name] = {(o.ep, o.max_batch_per_rank): o
                      for o in decode_options(spec, workload_load(spec.workload), model, topo)}
    uni, skew = opts["wide-ep-search-dsv3"], opts["wide-ep-search-dsv3-skew"]
    assert all(o.pruned is None for o in uni.values())
    slow = [skew[ep, 64].tpot_at_cap_s / uni[ep, 64].tpot_at_cap_s for ep in (8, 16, 32, 64)]
    assert 1 < slow[0] < slow[1] < slow[2] < slow[3], slow
    assert all(skew[8, cap].pruned is None for cap in (64, 128, 256))
    assert skew[64, 64].pruned is None
    assert all("TPOT" in (skew[64, cap].pruned or "") for cap in (128, 256))
