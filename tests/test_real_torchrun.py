"""Multi-node real runs on CPU: two torchrun "nodes" on this machine stand in for two hosts of a cluster topology.

The prefiller (TP=2) sits on host 0 and both decoders on host 1, so every KV transfer crosses "nodes"; commands
and replies travel through the store queues. The greedy tokens must equal transformers', and the simulator's
replay of the measured durations must make the same decisions.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_torchrun_nodes_serve_a_scenario_with_cross_node_kv(tmp_path):
    from tiny_qwen3moe import save_checkpoint, tiny_hf_model

    hc, hf = tiny_hf_model()
    ck = save_checkpoint(hc, hf, tmp_path / "ckpt")
    scen = tmp_path / "s.yaml"
    scen.write_text(f"""kind: serving
name: tiny-torchrun
topology: {REPO / 'scenarios/topologies/h200x2-pair-ib.yaml'}
model: {ck / 'config.json'}
weight_format: bf16
prefill: {{tp: 2, ep: 2, replicas: 1, max_batch_tokens: 256}}
decode: {{ep: 1, replicas: 2, max_batch_per_rank: 4, page_tokens: 4}}
mtp: {{draft_k: 0}}
workload: {{kind: synthetic, arrival: {{kind: poisson, rate_per_s: 20}}, prompt: {{kind: uniform, lo: 5, hi: 30}},
           output: {{kind: uniform, lo: 2, hi: 8}}, n_requests: 8, seed: 1}}
real: {{device: cpu, dtype: fp32, prefill_pages: 64, decode_pages: 64, weights: {ck}}}
""")
    port = _free_port()
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}

    def node(i):
        return subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=2", f"--node-rank={i}",
             "--master-addr=127.0.0.1", f"--master-port={port}", "-m", "rackbed.engine.cli.torchrun", str(scen),
             "--out", str(out)], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    nodes = [node(1), node(0)]
    logs = [p.communicate(timeout=240)[0] for p in nodes]
    assert all(p.returncode == 0 for p in nodes), logs[1][-3000:] + logs[0][-3000:]
    doc = json.loads((out / "real.json").read_text())
    assert doc["world"] == 4 and doc["metrics"]["requests"]["done"] == 8
    assert doc["replay_identical_decisions"] is True
    assert any(p["kind"] == "kv" for p in doc["plans"])          # KV crossed from host 0 to host 1
    refusals = doc["store_refusals"]                               # nothing refused, every rank reported
    assert refusals["rank0_process"] == {"log_lines_suppressed": 0}
    assert refusals["ranks"] == {str(r): {"log_lines_suppressed": 0} for r in range(4)}
    for rid, toks in doc["generated_tokens"].items():
        prompt = torch.tensor(doc["prompt_ids"][rid])[None]
        with torch.no_grad():
            ref = hf.generate(prompt, max_new_tokens=len(toks), do_sample=False)[0, prompt.shape[1]:]
        assert toks == ref.tolist(), rid
