"""``rackbed emit`` of an aggregated scenario (sim/emit.py): plain servers per worker, no disaggregation, with the
worker's parallelism, batch cap, step token budget and chunk; the router over the workers; the Dynamo graph's one
worker service."""

from __future__ import annotations

import shlex

import pytest
import yaml

from rackbed import scenarios
from rackbed.engine.cli.main import main
from rackbed.sim.emit import ENGINES, emit_files, plan_of
from rackbed.sim.scenario import parse_scenario
from rackbed.topology.yamlio import load_yaml

#: (name, aggregated section overrides, mtp draft_k): DP-attention ranks, one TP group, DP ranks with MTP
SHAPES = (
    ("dp4", {}, 0),
    ("tp8", {"workers": 1, "tp": 8, "dp": 1, "ep": 8, "max_batch_per_rank": 32, "chunk_tokens": None}, 0),
    ("dp8-mtp", {"workers": 1, "tp": 1, "dp": 8, "ep": 8, "max_batch_tokens": 16384, "chunk_tokens": 4096}, 2),
)


@pytest.fixture(scope="module", params=SHAPES, ids=[s[0] for s in SHAPES])
def case(request):
    _, agg, k = request.param
    d = load_yaml(scenarios.resolve("agg_h200_node"))
    d["aggregated"] = {**d["aggregated"], **agg}
    d["mtp"] = {"draft_k": k, "draft": {"kind": "mtp", "layers": 1}} if k else {"draft_k": 0}
    sc = parse_scenario(d, "test")
    return sc, {e: emit_files(sc, e) for e in ENGINES}


def _flags(argv):
    out, key = {}, None
    for a in argv:
        if a.startswith("--"):
            key = a
            out.setdefault(key, [])
        elif key is not None:
            out[key].append(a)
    return out


def _commands(script):
    """The engine command lines (not the comments, nor the line that defaults MODEL_PATH)."""
    cmds = [shlex.split(ln) for ln in script.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    cmds = [c[next(i for i, a in enumerate(c) if "=" not in a):] for c in cmds]  # the pinning assignment
    return [c for c in cmds if c[0] in ("python", "trtllm-serve")]


def test_sglang_workers_and_router(case):
    sc, files = case
    a = sc.aggregated
    cmds = _commands(files["sglang"]["launch.sh"])
    workers = [_flags(c) for c in cmds if "sglang.launch_server" in c]
    assert len({f["--port"][0] for f in workers}) == a.workers
    for f in workers:
        assert "--disaggregation-mode" not in f
        assert f["--tp-size"] == [str(a.tp * a.dp)]
        assert ("--attn-dp-size" in f) == (a.dp > 1)
        if a.dp > 1:
            assert f["--attn-dp-size"] == [str(a.dp)]
        assert f.get("--ep-size", ["1"]) == [str(a.ep)]
        assert f["--chunked-prefill-size"] == [str(a.chunk_tokens or a.max_batch_tokens)]
        assert f["--max-prefill-tokens"] == [str(a.max_batch_tokens)]
        assert f["--max-running-requests"] == [str(a.max_batch_per_rank * a.dp)]
        assert f["--page-size"] == [str(a.page_tokens)]
        assert ("--speculative-num-steps" in f) == (sc.mtp.draft_k > 0)
    router = _flags(next(c for c in cmds if "sglang_router.launch_router" in c))
    assert "--pd-disaggregation" not in router
    assert len(router["--worker-urls"]) == a.workers
    ports = {f"{c[c.index('--port') + 1]}" for c in cmds if "sglang.launch_server" in c}
    assert {u.rsplit(":", 1)[1] for u in router["--worker-urls"]} == ports


def test_trtllm_agg_yaml(case):
    sc, files = case
    a = sc.aggregated
    t = files["trtllm"]
    assert sorted(t) == ["agg.yaml", "launch.sh"]
    o = yaml.safe_load(t["agg.yaml"])
    assert (o["tensor_parallel_size"], o["moe_expert_parallel_size"]) == (a.tp * a.dp, a.ep)
    assert o["enable_attention_dp"] == (a.dp > 1)
    assert o["max_batch_size"] == a.max_batch_per_rank and o["max_num_tokens"] == a.max_batch_tokens
    assert o["enable_chunked_prefill"] == (a.chunk_tokens is not None)
    # MTP only where the checkpoint has MTP layers (Qwen3-30B-A3B has none: no speculative_config, a note)
    has_mtp = bool(plan_of(sc).model_has_mtp)
    assert o.get("speculative_config", {}).get("max_draft_len", 0) == (sc.mtp.draft_k if has_mtp else 0)
    assert ("TensorRT-LLM's MTP needs the checkpoint's own MTP layers" in files["trtllm"]["agg.yaml"]) == (
        bool(sc.mtp.draft_k) and not has_mtp)
    serve = [c for c in _commands(t["launch.sh"]) if c[0] == "trtllm-serve"]
    assert len(serve) == a.workers and all("disaggregated" not in c for c in serve)
    assert all(_flags(c)["--extra_llm_api_options"] == ["agg.yaml"] for c in serve)


def test_dynamo_aggregated_graph(case):
    sc, files = case
    a = sc.aggregated
    s = yaml.safe_load(files["dynamo"]["graph.yaml"])["spec"]["services"]
    assert sorted(s) == ["Frontend", "SGLangWorker"]
    w = s["SGLangWorker"]
    assert w["replicas"] == a.workers and "subComponentType" not in w
    assert int(w["resources"]["limits"]["gpu"]) * w.get("multinode", {}).get("nodeCount", 1) == a.tp * a.dp
    args = _flags(w["extraPodSpec"]["mainContainer"]["args"])
    assert "--disaggregation-mode" not in args and args["--tp-size"] == [str(a.tp * a.dp)]


def test_scripts_are_valid_bash(case):
    import shutil
    import subprocess

    if shutil.which("bash") is None:
        pytest.skip("no bash")
    for e in ("sglang", "trtllm"):
        r = subprocess.run(["bash", "-n"], input=case[1][e]["launch.sh"], text=True, capture_output=True, check=False)
        assert r.returncode == 0, r.stderr


def test_cli_emits_an_aggregated_scenario(tmp_path):
    assert main(["emit", "agg_h200_node", "--engine", "sglang", "--out", str(tmp_path)]) == 0
    assert "sglang.launch_server" in (tmp_path / "launch.sh").read_text()
