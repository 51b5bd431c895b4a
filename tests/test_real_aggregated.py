"""Aggregated workers in the real engine on CPU processes (gloo): two one-GPU workers that prefill and decode in
mixed steps give Hugging Face's greedy tokens — the tokens of the disaggregated run of the same requests — and
replaying the measured durations through the simulator gives the identical decision log (cross-mode identity)."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tiny_qwen3moe import real_scenario

from rackbed.engine.core.workload import generate
from rackbed.engine.real.driver import replay, run_real
from rackbed.engine.real.model import TorchModelConfig
from rackbed.sim.driver import simulate
from rackbed.sim.scenario import build
from rackbed.topology.errors import UserError

#: requests arrive faster than they finish, so the workers' steps mix prompts into running batches
LOAD = {"kind": "synthetic", "arrival": {"kind": "poisson", "rate_per_s": 200}, "prompt": {"kind": "uniform", "lo": 5,
        "hi": 30}, "output": {"kind": "uniform", "lo": 2, "hi": 8}, "n_requests": 10, "seed": 1}
AGG = {"workers": 2, "tp": 1, "dp": 1, "ep": 1, "max_batch_per_rank": 4, "max_batch_tokens": 40,
       "chunk_tokens": None, "page_tokens": 4}


@pytest.fixture(scope="module")
def ckpt(tiny_qwen3moe_ckpt):
    return tiny_qwen3moe_ckpt


def _run(d, sc):
    b = build(sc)
    reqs = generate(sc.workload, sc.seed)
    res, run = run_real(b, reqs, simulate=simulate, device="cpu", dtype="fp32", weights=str(d), prefill_pages=256, decode_pages=256,
                        tiny_cfg=TorchModelConfig.from_hf(json.loads((d / "config.json").read_text())))
    return b, reqs, res, run


@pytest.mark.slow
def test_aggregated_greedy_tokens_equal_transformers_and_replay_is_identical(ckpt):
    _, hf, d = ckpt
    sc = real_scenario(d, deployment="aggregated", aggregated=AGG, workload=LOAD)
    b, reqs, res, run = _run(d, sc)
    assert res.metrics["requests"]["done"] == len(reqs)
    mixed = res.log.of_kind("mixed")
    assert mixed and not res.log.of_kind("kv_transfer") and {r[2] for r in mixed} == {"A0", "A1"}
    assert any(int(r[6]) > 0 and r[5] > 0 for r in mixed), "no step mixed prefill into a decode batch"
    for r in reqs:
        prompt = torch.tensor(run.prompt_ids[r.id])[None]
        with torch.no_grad():
            ref = hf.generate(prompt, max_new_tokens=r.output_tokens, do_sample=False)[0, prompt.shape[1]:]
        assert run.generated[r.id] == ref.tolist(), f"request {r.id}"
    rep = replay(b, reqs, run.records, simulate=simulate, seed=sc.seed, deaths=run.deaths)
    assert res.log.decisions() == rep.log.decisions()
    assert len(res.log.decisions()) > 50
    # the disaggregated run of the same requests generates the same tokens
    _, reqs2, res2, run2 = _run(d, real_scenario(d, workload=LOAD))
    assert [r.id for r in reqs2] == [r.id for r in reqs] and res2.metrics["requests"]["done"] == len(reqs)
    assert {r.id: run2.generated[r.id] for r in reqs} == {r.id: run.generated[r.id] for r in reqs}


def test_real_mode_names_what_it_cannot_run(ckpt):
    _, _, d = ckpt
    sc = real_scenario(d, deployment="aggregated", aggregated={**AGG, "dp": 2, "ep": 2})
    with pytest.raises(UserError, match="aggregated workers of one GPU only"):
        run_real(build(sc), generate(sc.workload, sc.seed), simulate=simulate, device="cpu", dtype="fp32", weights=str(d))
