"""The fidelity tools on CPU runs: an aggregated engine calibration fitted from ``rackbed real`` runs (mixed steps),
and a held-out run checked against the simulation of its own scenario file with that calibration."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")


def _scenario(tmp_path, ck, name: str, seed: int, rate: float, chunk) -> str:
    p = tmp_path / f"{name}.yaml"
    p.write_text(f"""kind: serving
name: {name}
topology: hgx-h200
model: {ck / 'config.json'}
weight_format: bf16
deployment: aggregated
aggregated: {{workers: 1, tp: 1, dp: 1, ep: 1, max_batch_per_rank: 4, max_batch_tokens: 40, chunk_tokens: {chunk},
             page_tokens: 4}}
mtp: {{draft_k: 0}}
workload: {{kind: synthetic, arrival: {{kind: poisson, rate_per_s: {rate}}},
           prompt: {{kind: uniform, lo: 5, hi: 30}}, output: {{kind: uniform, lo: 4, hi: 12}},
           n_requests: 12, seed: {seed}}}
real: {{device: cpu, dtype: fp32, weights: {ck}, prefill_pages: 16, decode_pages: 128}}
""")
    return str(p)


@pytest.mark.slow
def test_fit_aggregated_runs_then_check_a_held_out_run(tmp_path, capsys):
    from tiny_qwen3moe import save_checkpoint, tiny_hf_model

    from rackbed.engine.cli.main import main
    from rackbed.sim import fidelity
    from rackbed.sim.engine_calibration import load_engine_calibration

    ck = save_checkpoint(*tiny_hf_model(), tmp_path / "ckpt")
    runs = {}
    for name, seed, rate, chunk in (("fit-whole", 1, 100, "null"), ("fit-chunked", 2, 100, 8),
                                    ("heldout", 5, 60, "null")):
        runs[name] = tmp_path / name
        assert main(["real", _scenario(tmp_path, ck, name, seed, rate, chunk), "--out", str(runs[name])]) == 0
        real = json.loads((runs[name] / "real.json").read_text())
        assert real["replay_identical_decisions"] and set(real["graphs"]) == {"0"}
        assert real["graphs"]["0"]["decode"]["mode"] == "eager"      # CPU: no graphs, and the run says so
    cal_file = tmp_path / "cal.yaml"
    assert fidelity.main(["fit", str(runs["fit-whole"]), str(runs["fit-chunked"]), "--out", str(cal_file)]) == 0
    cal = load_engine_calibration(cal_file)
    from rackbed.sim.engine_calibration import MIXED_TERMS

    assert cal.mode == "aggregated" and set(cal.mixed_s) == set(MIXED_TERMS) and cal.mixed_s["step"] > 0
    assert fidelity.main(["fit", str(runs["fit-whole"]), "--out", str(cal_file)]) == 2   # exists: --force
    out = tmp_path / "check.json"
    assert fidelity.main(["check", str(runs["heldout"]), "--calibration", str(cal_file), "--out", str(out)]) == 0
    check = json.loads(out.read_text())["checks"][0]
    tpot = next(r for r in check["rows"] if r["metric"] == "tpot p50")
    # the CPU engine is far slower than the H200 kernels the base cost model prices: the calibrated simulation is
    # nearer the measurement than the kernel-only one
    assert abs(tpot["sim_s"] - tpot["real_s"]) < abs(tpot["kernel_only_sim_s"] - tpot["real_s"])
    assert "heldout" in capsys.readouterr().out
    assert fidelity.main(["check", str(tmp_path / "nope")]) == 2
    assert fidelity.main(["fit", str(tmp_path / "nope"), "--out", str(tmp_path / "c2.yaml")]) == 2
