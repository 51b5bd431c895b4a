"""Golden tests of the six kernel-figure scenarios (scenarios/fig_*.yaml): outputs exist, numbers match the
recorded goldens within tolerance (not exact floats), and the qualitative shape of each figure holds."""

from __future__ import annotations

import io
import itertools
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rich.console import Console

from rackbed import scenarios
from rackbed.sim.figures import load_figure, run_figure

REL = 0.03  # goldens are model outputs; a change in a constant or a formula must be a deliberate update
FIGS = ["fig_allreduce_nvls", "fig_ep_prefill_comm", "fig_decode_a2a", "fig_grouped_gemm", "fig_prefill_tp_ep",
        "fig_decode_ep_trade"]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    out = tmp_path_factory.mktemp("figs")
    console = Console(file=io.StringIO(), width=160)
    docs = {name: run_figure(scenarios.resolve(name), out, console=console) for name in FIGS}
    return docs, console.file.getvalue()


@pytest.mark.slow
def test_outputs_written(results):
    docs, text = results
    for name, d in docs.items():
        js, png = Path(d["json"]), Path(d["png"])
        assert js.exists() and png.exists() and png.stat().st_size > 5000
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        on_disk = json.loads(js.read_text())
        assert on_disk["name"] == name and on_disk["rows"] and on_disk["claims"]
        assert all(c["write_up"] and c["simulated"] for c in on_disk["claims"])
    assert text.count("write-up:") >= 6 and text.count("simulated:") >= 6


def test_allreduce_golden(results):
    s = results[0]["fig_allreduce_nvls"]["summary"]
    assert s["H200"]["nvlink_us"] == pytest.approx(551.2, rel=REL)
    assert s["H200"]["nvls_us"] == pytest.approx(540.6, rel=REL)
    assert s["GB200"]["nvlink_us"] == pytest.approx(286.6, rel=REL)
    assert s["GB200"]["nvls_us"] == pytest.approx(321.8, rel=REL)
    # GB200 is faster than H200; NVLS helps on Hopper (0.85 efficiency) and not on Blackwell (0.74 < 0.833)
    assert s["GB200"]["nvlink_us"] < s["H200"]["nvlink_us"]
    assert s["H200"]["nvls_cut_pct"] > 0 > s["GB200"]["nvls_cut_pct"]
    sweep = results[0]["fig_allreduce_nvls"]["sweep"]["H200"]
    assert sweep["bytes"][0] == 16384 and sweep["bytes"][-1] == 256 * 2 ** 20
    assert sweep["nvlink_us"] == sorted(sweep["nvlink_us"])  # more bytes never faster
    assert sweep["nvlink_us"][0] < 15  # latency floor of a symmetric-memory kernel: a few µs


def test_ep_prefill_golden(results):
    s = results[0]["fig_ep_prefill_comm"]["summary"]
    gold = {"H200/ep4": 279.8, "H200/ep8": 231.8, "GB200/ep4": 158.6, "GB200/ep8": 143.1}
    for k, v in gold.items():
        assert s[k] == pytest.approx(v, rel=REL), k
    assert s["GB200/ep4"] < s["H200/ep4"] and s["GB200/ep8"] < s["GB200/ep4"]  # the write-up's ordering
    rows = results[0]["fig_ep_prefill_comm"]["rows"]
    assert next(r for r in rows if r["hardware"] == "GB200" and r["ep"] == 8)["hosts"] == 2


def test_decode_a2a_golden(results):
    s = results[0]["fig_decode_a2a"]["summary"]
    gold = {"GB200/ep8/t1": (6.56, 5.08), "GB200/ep8/t128": (11.42, 13.89), "GB200/ep64/t1": (9.94, 6.80),
            "GB200/ep64/t128": (17.06, 20.26)}
    for k, (d, c) in gold.items():
        assert s[k][0] == pytest.approx(d, rel=REL) and s[k][1] == pytest.approx(c, rel=REL), k
    rows = results[0]["fig_decode_a2a"]["rows"]
    assert all(r["total_us"] < 100 for r in rows)  # tens of µs, latency-bound
    at128 = {r["ep"]: r["total_us"] for r in rows if r["tokens_per_rank"] == 128}
    assert at128[64] / at128[8] < 2.0  # nearly flat: x8 peers costs < 2x


def test_grouped_gemm_golden(results):
    s = results[0]["fig_grouped_gemm"]["summary"]
    gold = {"H200/fp8_block/ep16": 42.16, "GB200/mxfp8/ep16": 28.65, "GB200/mxfp8/ep32": 17.83,
            "GB200/mxfp4/ep32": 12.58, "H200/bf16/ep1": 1131.4, "GB200/nvfp4/ep8": 30.63}
    for k, v in gold.items():
        assert s[k] == pytest.approx(v, rel=REL), k
    for hw in ("H200", "GB200"):
        t = [s[f"{hw}/mxfp8/ep{e}"] for e in (1, 2, 4, 8, 16, 32)]
        speedup = [a / b for a, b in itertools.pairwise(t)]
        assert all(x > 1 for x in speedup) and speedup == sorted(speedup, reverse=True)  # diminishing return
        assert speedup[-1] < 1.8
    for f in ("bf16", "fp8_block", "mxfp8", "mxfp4", "nvfp4"):
        assert s[f"GB200/{f}/ep16"] < s[f"H200/{f}/ep16"]  # Blackwell beats Hopper per kernel
    assert s["GB200/mxfp8/ep16"] < s["H200/fp8_block/ep16"]


def test_prefill_parallelism_golden(results):
    s = results[0]["fig_prefill_tp_ep"]["summary"]
    assert s["GB200/TP=4/EP=4"][0] == pytest.approx(62.2, rel=REL)
    assert s["GB200/TP=8/EP=8"][0] == pytest.approx(47.6, rel=REL)
    for hw in ("GB200", "H200"):
        assert s[f"{hw}/TP=4/EP=4"][1] > 1.3 * s[f"{hw}/TP=8/EP=8"][1]  # TP=4 wins per GPU
    terms = results[0]["fig_prefill_tp_ep"]["terms_ms"]
    assert "cross_node_host" in terms["GB200/TP=8/EP=8"] and "cross_node_host" not in terms["GB200/TP=4/EP=4"]
    # the all-reduce does not shrink with TP: per rank it moves about the same bytes
    assert terms["GB200/TP=8/EP=8"]["attn_allreduce"] >= 0.95 * terms["GB200/TP=4/EP=4"]["attn_allreduce"]


def test_decode_ep_trade_golden(results):
    d = results[0]["fig_decode_ep_trade"]
    rows = {r["tokens_per_rank"]: r for r in d["rows"]}
    assert rows[128]["comm_added_us"] == pytest.approx(4.25, rel=REL)
    assert rows[32]["gemm_removed_us"] == pytest.approx(21.63, rel=REL)
    for t, r in rows.items():
        assert 0 < r["comm_added_us"] < 10  # a few µs of dispatch/combine added ...
        if t >= 4:
            assert r["gemm_removed_us"] > 10 and r["net_gain_us"] > 0  # ... >10 µs of GEMM removed
    steps = d["decode_step_ms"]
    assert steps[16]["step_ms"] < steps[8]["step_ms"]
    assert steps[8]["step_ms"] == pytest.approx(14.09, rel=REL)


@pytest.mark.slow
def test_cli_runs_a_figure(tmp_path, capsys):
    from rackbed.engine.cli.main import main

    rc = main(["run", str(scenarios.resolve("fig_ep_prefill_comm")), "--out", str(tmp_path)])
    assert rc == 0
    assert (tmp_path / "fig_ep_prefill_comm.json").exists() and (tmp_path / "fig_ep_prefill_comm.png").exists()
    assert "simulated:" in capsys.readouterr().out


@pytest.mark.parametrize("figure,patch,match", [
    *[("fig_allreduce_nvls", p, m) for p, m in [
        ({"tpp": 4}, r"bad\.yaml: allreduce_nvls\.tpp: unknown key"),
        ({"tp": 1}, r"bad\.yaml: allreduce_nvls\.tp: "),
        ({"figure": "nope"}, r"bad\.yaml: .*figure"),
        ({"claim": ""}, r"bad\.yaml: allreduce_nvls\.claim"),
    ]],
    # the decode-frontier figure (the wide-EP study)
    *[("fig_wide_ep_study", p, m) for p, m in [
        ({"eps": [16, 16]}, r"bad\.yaml: decode_frontier: .*eps: each value once"),
        ({"panels": [{"scenario": "no_such_scenario"}]}, r"bad\.yaml: panels\[0\]\.scenario: "),
        ({"batch_per_rank": [64]}, r"bad\.yaml: decode_frontier\.batch_per_rank"),
        ({"overlaps": ["tbo"]}, r"bad\.yaml: decode_frontier\.overlaps"),
    ]],
])
def test_schema_errors_are_one_line(tmp_path, figure, patch, match):
    import yaml

    data = yaml.safe_load(scenarios.resolve(figure).read_text())
    data.update(patch)
    p = tmp_path / "bad.yaml"
    p.write_text(yaml.safe_dump(data))
    with pytest.raises(ValueError, match=match) as e:
        load_figure(p)
    assert "\n" not in str(e.value)


def test_hardware_too_small_is_a_user_error(tmp_path):
    import yaml

    data = yaml.safe_load(scenarios.resolve("fig_decode_a2a").read_text())
    data["hardware"] = [{"topology": "hgx-h200", "weight_format": "fp8_block"}]
    p = tmp_path / "small.yaml"
    p.write_text(yaml.safe_dump(data))
    with pytest.raises(ValueError, match="needs 16 GPUs but topology hgx-h200 has 8"):
        run_figure(p, tmp_path, console=Console(file=io.StringIO()))


@settings(max_examples=200, deadline=None, derandomize=True)
@given(pts=st.lists(st.tuples(st.floats(1, 500), st.floats(1, 2e4), st.booleans()), min_size=1, max_size=8),
       slo=st.floats(1, 500), slo2=st.floats(1, 500))
def test_at_slo_reads_the_curve(pts, slo, slo2):
    """``at_slo`` (the decode_frontier figure's SLO table): never more than the curve's best fitting point,
    at least its best fitting point that meets the SLO, None only when no fitting point meets it, and a
    stricter SLO never gives more tokens/s per GPU."""
    from rackbed.sim.figures import at_slo

    rows = [{"batch_per_rank": i + 1, "tokens_per_s_per_user": u, "tokens_per_s_per_gpu": g, "fits_batch": f}
            for i, (u, g, f) in enumerate(pts)]
    fit = [r for r in rows if r["fits_batch"]]
    hit = at_slo(rows, slo)
    meets = [r["tokens_per_s_per_gpu"] for r in fit if r["tokens_per_s_per_user"] >= slo]
    assert (hit is None) == (not meets)
    tol = 0.05  # an interpolated point is rounded to 0.1 tokens/s
    if hit is not None:
        top = max(r["tokens_per_s_per_gpu"] for r in fit)
        assert max(meets) - tol <= hit["tokens_per_s_per_gpu"] <= top + tol
        lo, hi = sorted((slo, slo2))
        strict = at_slo(rows, hi)
        loose = at_slo(rows, lo)["tokens_per_s_per_gpu"]
        assert strict is None or strict["tokens_per_s_per_gpu"] <= loose + tol
