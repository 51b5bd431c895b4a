"""Multi-node real runs on CPU: two torchrun "nodes" on this machine stand in for two hosts of a cluster topology.

The prefiller (TP=2) sits on host 0 and both decoders on host 1, so every KV transfer crosses "nodes"; commands
and replies travel through the store queues. The greedy tokens must equal transformers', and the simulator's
replay of the measured durations must make the same decisions. Meanwhile a client without the run's token keeps
connecting to the store and sending junk: the run is unaffected, its report counts the refusals, and rank 0's log
holds at most the rate limit's lines.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from rackbed.engine.real.kvstore import LOG_LINES, LOG_WINDOW_S

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
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

    stop, tries = threading.Event(), [0]

    def attacker() -> None:     # no token, on the store's port (MASTER_PORT + 1) for the whole run
        junk = b"x" * (1 << 20)
        while not stop.is_set():
            tries[0] += 1
            try:
                with socket.create_connection(("127.0.0.1", port + 1), timeout=1) as s:
                    s.sendall(junk)
            except OSError:
                pass
            stop.wait(0.02)

    t0 = time.monotonic()
    nodes = [node(1), node(0)]
    threading.Thread(target=attacker, daemon=True).start()
    try:
        logs = [p.communicate(timeout=240)[0] for p in nodes]
    finally:
        stop.set()
    took = time.monotonic() - t0
    assert all(p.returncode == 0 for p in nodes), logs[1][-3000:] + logs[0][-3000:]
    doc = json.loads((out / "real.json").read_text())
    assert doc["world"] == 4 and doc["metrics"]["requests"]["done"] == 8
    assert doc["replay_identical_decisions"] is True
    assert any(p["kind"] == "kv" for p in doc["plans"])          # KV crossed from host 0 to host 1
    refusals = doc["store_refusals"]          # rank 0's store refused the junk; no rank refused a message
    assert refusals["rank0_process"].get("store_connections_refused", 0) >= 1
    assert not {k for k in refusals["rank0_process"] if k.endswith("_refused")} - {"store_connections_refused"}
    assert {r: c for r, c in refusals["ranks"].items() if r != "0"} == {str(r): {"log_lines_suppressed": 0}
                                                                          for r in (1, 2, 3)}
    lines = [ln for ln in logs[1].splitlines() if "rackbed: " in ln and "refus" in ln]
    assert len(lines) <= (LOG_LINES + 1) * (took // LOG_WINDOW_S + 1), lines[:20]
    for rid, toks in doc["generated_tokens"].items():
        prompt = torch.tensor(doc["prompt_ids"][rid])[None]
        with torch.no_grad():
            ref = hf.generate(prompt, max_new_tokens=len(toks), do_sample=False)[0, prompt.shape[1]:]
        assert toks == ref.tolist(), rid
