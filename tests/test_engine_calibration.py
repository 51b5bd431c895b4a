"""Engine calibration (sim.engine_calibration): the prefill form a + b*tokens + c*attention pairs; a real run
that had a rank death is read (its failure records left out of the fit and reported)."""

import os
from itertools import pairwise
from pathlib import Path

import numpy as np
import pytest
import yaml
from hypothesis import given
from hypothesis import strategies as st

from rackbed.engine.core.plans import PrefillBatch
from rackbed.sim.costs.steptime import StepTime
from rackbed.sim.engine_calibration import (
    EngineCalibratedCostModel,
    EngineCalibration,
    _lstsq_nonneg,
    attn_pairs,
    load_engine_calibration,
)

ROOT = Path(__file__).resolve().parents[1]


@given(n=st.integers(1, 5000), cuts=st.lists(st.integers(1, 4999), max_size=6))
def test_attn_pairs_chunking_adds_up(n, cuts):
    """Prefilling a prompt in chunks does the same causal attention work as in one go."""
    bounds = sorted({c for c in cuts if c < n} | {0, n})
    chunks = [(0, a, b - a) for a, b in pairwise(bounds)]
    assert sum(attn_pairs([c]) for c in chunks) == pytest.approx(attn_pairs([(0, 0, n)]))
    assert attn_pairs([(0, 0, n)]) == n * (n + 1) / 2


def test_fit_recovers_quadratic_prefill_and_drops_warmup():
    rng = np.random.default_rng(1)
    batches = [[int(x) for x in rng.integers(500, 3000, size=rng.integers(1, 3))] for _ in range(20)]
    N = [sum(b) for b in batches]
    Q = [attn_pairs([(0, 0, n) for n in b]) for b in batches]
    y = [0.03 + 3e-5 * n + 5e-8 * q + rng.normal(0, 2e-3) for n, q in zip(N, Q)]
    y[0] += 0.08                                      # a warm-up batch
    _, b, c = _lstsq_nonneg([[1.0] * len(y), N, Q], y)
    assert c == pytest.approx(5e-8, rel=0.15) and b == pytest.approx(3e-5, rel=0.5)
    # coefficients never go negative, even when the data pull one down
    a2, b2, c2 = _lstsq_nonneg([[1.0] * 20, N, Q], [0.3 - 1e-9 * q for q in Q])
    assert min(a2, b2, c2) >= 0.0


def test_cost_model_prices_two_halves_below_one_whole():
    """With an attention term, two 1500-token prompts prefill faster than one 3000-token prompt (the line alone
    prices them the same)."""
    cal = EngineCalibration(gpu="g", model="m", decode_step_s=((1.0, 0.01),), prefill_s=(0.03, 3e-5),
                            prefill_attn_s=5e-8, kv_transfer_s=(0.01, 0.0))

    class Base:
        def prefill(self, plan, group):
            return StepTime(attn_s=1.0, moe_gemm_s=1.0, a2a_s=0.0, allreduce_s=0.0, other_s=0.0)

    cm = EngineCalibratedCostModel(Base(), cal)
    one = cm.prefill(PrefillBatch("P0", 0, ((0, 0, 3000),), 3000), None).total_s
    two = cm.prefill(PrefillBatch("P0", 0, ((0, 0, 1500), (1, 0, 1500)), 3000), None).total_s
    assert two < one
    assert one == pytest.approx(0.03 + 3e-5 * 3000 + 5e-8 * 3000 * 3001 / 2)
    flat = EngineCalibratedCostModel(Base(), cal.model_copy(update={"prefill_attn_s": 0.0}))
    assert flat.prefill(PrefillBatch("P0", 0, ((0, 0, 1500), (1, 0, 1500)), 3000), None).total_s == \
        pytest.approx(flat.prefill(PrefillBatch("P0", 0, ((0, 0, 3000),), 3000), None).total_s)


def test_old_file_without_attention_term_loads(tmp_path):
    d = yaml.safe_load((ROOT / "calibration/engine-H200-SXM-qwen3-235b-a22b-16l.yaml").read_text())
    assert d["prefill_attn_s"] > 0
    del d["prefill_attn_s"]
    p = tmp_path / "engine-old.yaml"
    p.write_text(yaml.safe_dump(d))
    assert load_engine_calibration(p).prefill_attn_s == 0.0


RUN = ROOT / "results/h200x2/real_lab"


@pytest.mark.skipif(not (RUN / "real.json").exists(), reason="no committed real run")
def test_held_out_prefills_of_the_h200_run():
    """The committed 2xH200 run: the attention term predicts held-out prefill batches within 10 %."""
    from rackbed.sim.engine_calibration import validate_engine_run

    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        res = validate_engine_run("results/h200x2/real_lab")
    finally:
        os.chdir(cwd)
    assert res["calibration"]["prefill_attn_s"] > 0
    assert res["per_plan"]["prefill"]["max_abs"] <= 0.10


def test_failed_and_interrupted_plans_are_replayed_and_left_out_of_the_fit():
    """A real run's records: a KV transfer refused for lack of pages (``kv:kv_no_room``) and shipped again, a
    decode step a rank death interrupted (no time: ``inf``), a KV transfer whose source lost the KV
    (``kv:kv_lost``); deaths as ``real.json`` writes them. The replay fails the failed ones with their reason
    and lets the fault interrupt the other; all three are counted, not fitted."""
    import types

    from rackbed.engine.core.plans import Failed, KvTransfer
    from rackbed.sim.engine_calibration import _Replayed, run_faults, skipped_plans

    real = {"deaths": [{"t_s": 0.5, "rank": 2, "gpu": 3}], "plans": [
        {"worker": "P0.kv0", "kind": "kv:kv_no_room", "key": 3, "measured_s": 0.01, "worker_s": 0.0},
        {"worker": "P0.kv0", "kind": "kv", "key": 3, "measured_s": 0.02, "worker_s": 0.01},
        {"worker": "D0", "kind": "decode", "key": 4, "measured_s": float("inf"), "worker_s": 0.0},
        {"worker": "P0.kv1", "kind": "kv:kv_lost", "key": 5, "measured_s": 0.03, "worker_s": 0.0}]}
    assert run_faults(real) == [{"at_s": 0.5, "target": "gpu:3"}]
    assert skipped_plans(real) == {"interrupted": 1, "failed": {"kv_no_room": 1, "kv_lost": 1},
                                   "deaths": [{"t_s": 0.5, "rank": 2, "gpu": 3}]}
    ex = _Replayed(real["plans"])
    kv = KvTransfer("P0.kv0", 3, "P0", "D0", 0, 20, 100, 1, ())
    assert ex.duration(kv, 0.0) == Failed(0.01, "kv_no_room")
    assert ex.duration(kv, 0.1) == 0.02
    assert ex.duration(types.SimpleNamespace(worker="D0", step=4), 0.2) == 1e9
    assert ex.duration(KvTransfer("P0.kv1", 5, "P0", "D0", 0, 20, 100, 1, ()), 0.3) == Failed(0.03, "kv_lost")


@pytest.mark.slow
def test_validate_reads_a_real_run_that_had_a_rank_death(tmp_path, capsys):
    """``rackbed real`` with a decoder killed, then ``rackbed validate --engine`` on its folder: no traceback
    (it used to stop at ``could not convert string to float: 't_s'``, reading the deaths' objects as
    triples); the death and the plans left out are reported, the held-out plans and serving metrics are
    compared, the replay planning with the KV capacities the real run recorded."""
    import argparse
    import json

    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from tiny_qwen3moe import save_checkpoint, tiny_hf_model

    from rackbed.engine.cli.main import main
    from rackbed.engine.cli.validate import validate_engine

    ck = save_checkpoint(*tiny_hf_model(), tmp_path / "ckpt")
    scen = tmp_path / "s.yaml"
    scen.write_text(f"""kind: serving
name: killed
topology: hgx-h200
model: {ck / 'config.json'}
weight_format: bf16
prefill: {{tp: 1, ep: 1, replicas: 1, max_batch_tokens: 256}}
decode: {{ep: 1, replicas: 2, max_batch_per_rank: 4, page_tokens: 4}}
mtp: {{draft_k: 0}}
workload: {{kind: synthetic, arrival: {{kind: poisson, rate_per_s: 40}},
           prompt: {{kind: uniform, lo: 5, hi: 30}}, output: {{kind: uniform, lo: 10, hi: 30}},
           n_requests: 12, seed: 1}}
real: {{device: cpu, dtype: fp32, weights: {ck}, prefill_pages: 64, decode_pages: 40,
       kill: [{{at_s: 0.1, gpu: 1}}]}}
""")
    out = tmp_path / "run"
    assert main(["real", str(scen), "--out", str(out)]) == 0
    real = json.loads((out / "real.json").read_text())
    assert [d["gpu"] for d in real["deaths"]] == [1] and real["kv_capacity"]["rank_tokens"] == 40 * 4
    capsys.readouterr()
    res = validate_engine(None, None, argparse.Namespace(engine=str(out), holdout_every=3,
                                                          write_engine_calibration=None))
    text = capsys.readouterr().out
    assert "rank deaths: GPU 1 (rank 1)" in text, text
    assert res["skipped"]["deaths"] == real["deaths"]
    assert res["skipped"]["interrupted"] == sum(1 for p in real["plans"] if p["measured_s"] == float("inf"))
    assert res["per_plan"]["decode"]["n"] > 0 and res["serving"]
