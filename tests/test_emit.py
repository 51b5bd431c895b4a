"""``rackbed emit`` (sim/emit.py): the emitted files parse and say what the deployment is."""

from __future__ import annotations

import shlex

import pytest
import yaml

from rackbed import scenarios
from rackbed.engine.cli.main import main
from rackbed.sim.emit import ENGINES, emit_files, plan_of
from rackbed.sim.scenario import load_scenario

SCENARIOS = ("nvl72-default", "i_h200_mooncake")


@pytest.fixture(scope="module", params=SCENARIOS)
def case(request):
    sc = load_scenario(scenarios.resolve(request.param))
    return sc, {e: emit_files(sc, e) for e in ENGINES}


def _flags(argv: list[str]) -> dict[str, list[str]]:
    """``--flag value...`` -> {flag: [values]} (a bare flag maps to [])."""
    out: dict[str, list[str]] = {}
    key = None
    for a in argv:
        if a.startswith("--"):
            key = a
            out.setdefault(key, [])
        elif key is not None:
            out[key].append(a)
    return out


def _commands(script: str) -> list[list[str]]:
    """The engine command lines (not the comments, nor the line that defaults MODEL_PATH)."""
    cmds = [shlex.split(ln) for ln in script.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    cmds = [c[next(i for i, a in enumerate(c) if "=" not in a):] for c in cmds]  # the pinning assignment
    return [c for c in cmds if c[0] in ("python", "trtllm-serve")]


def _worker_flags(cmds, mode):
    return [_flags(c) for c in cmds if "sglang.launch_server" in c and _flags(c)["--disaggregation-mode"] == [mode]]


def test_sglang_commands_match_the_deployment(case):
    sc, files = case
    cmds = _commands(files["sglang"]["launch.sh"])
    pre, dec = _worker_flags(cmds, "prefill"), _worker_flags(cmds, "decode")
    gp, gd = max(sc.prefill.tp, sc.prefill.ep), sc.decode.ep
    # one command per group and node: each group's node ranks 0..n-1
    assert len({f["--port"][0] for f in pre}) == sc.prefill.replicas
    assert len({f["--port"][0] for f in dec}) == sc.decode.replicas
    for f in pre:
        assert f["--tp-size"] == [str(gp)]
        assert f.get("--ep-size", ["1"]) == [str(sc.prefill.ep)]
        assert f["--chunked-prefill-size"] == [str(sc.prefill.max_batch_tokens)]
        assert ("--attn-dp-size" in f) == (gp // sc.prefill.tp > 1)
    for f in dec:
        assert f["--tp-size"] == [str(gd)] and f["--attn-dp-size"] == [str(gd)]
        assert f["--max-running-requests"] == [str(sc.decode.max_batch_per_rank * gd)]
        assert f["--cuda-graph-max-bs-decode"] == [str(sc.decode.max_batch_per_rank)]
        assert f["--page-size"] == [str(sc.decode.page_tokens)]
        if sc.mtp.draft_k:
            assert f["--speculative-num-steps"] == [str(sc.mtp.draft_k)]
            assert f["--speculative-num-draft-tokens"] == [str(sc.mtp.draft_k + 1)]
        else:
            assert "--speculative-algorithm" not in f
        nodes = int(f.get("--nnodes", ["1"])[0])
        assert 0 <= int(f.get("--node-rank", ["0"])[0]) < nodes
    router = _flags(next(c for c in cmds if "sglang_router.launch_router" in c))
    assert "--pd-disaggregation" in router
    assert len(router["--prefill"]) == 2 * sc.prefill.replicas and len(router["--decode"]) == sc.decode.replicas


def test_trtllm_configs_match_the_deployment(case):
    sc, files = case
    t = files["trtllm"]
    ctx, gen, dis = (yaml.safe_load(t[f]) for f in ("ctx.yaml", "gen.yaml", "disagg.yaml"))
    gp, gd = max(sc.prefill.tp, sc.prefill.ep), sc.decode.ep
    assert (ctx["tensor_parallel_size"], ctx["moe_expert_parallel_size"]) == (gp, sc.prefill.ep)
    assert ctx["max_num_tokens"] == sc.prefill.max_batch_tokens
    assert ctx["enable_attention_dp"] == (gp // sc.prefill.tp > 1)
    assert (gen["tensor_parallel_size"], gen["moe_expert_parallel_size"], gen["enable_attention_dp"]) == (gd, gd, True)
    assert gen["max_batch_size"] == sc.decode.max_batch_per_rank
    assert gen["kv_cache_config"]["tokens_per_block"] == sc.decode.page_tokens
    # MTP only where the checkpoint has MTP layers (TensorRT-LLM's MTP reads them): Qwen3-235B has none
    has_mtp = bool(plan_of(sc).model_has_mtp)
    assert gen.get("speculative_config", {}).get("max_draft_len", 0) == (sc.mtp.draft_k if has_mtp else 0)
    assert dis["context_servers"]["num_instances"] == sc.prefill.replicas == len(dis["context_servers"]["urls"])
    assert dis["generation_servers"]["num_instances"] == sc.decode.replicas
    serve = [_flags(c) for c in _commands(t["launch.sh"]) if c[:2] != ["trtllm-serve", "disaggregated"]]
    assert len(serve) == sc.prefill.replicas + sc.decode.replicas
    assert any(c[:2] == ["trtllm-serve", "disaggregated"] for c in _commands(t["launch.sh"]))


def test_dynamo_graph_matches_the_deployment(case):
    sc, files = case
    g = yaml.safe_load(files["dynamo"]["graph.yaml"])
    assert g["kind"] == "DynamoGraphDeployment"
    s = g["spec"]["services"]
    pre, dec = s["SGLangPrefillWorker"], s["SGLangDecodeWorker"]
    assert (pre["replicas"], dec["replicas"]) == (sc.prefill.replicas, sc.decode.replicas)
    assert (pre["subComponentType"], dec["subComponentType"]) == ("prefill", "decode")
    gd = sc.decode.ep
    nodes = dec.get("multinode", {}).get("nodeCount", 1)
    assert int(dec["resources"]["limits"]["gpu"]) * nodes == gd
    args = _flags(dec["extraPodSpec"]["mainContainer"]["args"])
    assert args["--tp-size"] == [str(gd)] and args["--max-running-requests"] == [str(sc.decode.max_batch_per_rank * gd)]


def test_unmapped_settings_are_said(case):
    sc, files = case
    for e in ENGINES:
        text = "\n".join(files[e].values())
        assert f"no equivalent: prefill kv_streams={sc.prefill.kv_streams}" in text


def test_bad_engine_is_one_line_exit_2(capsys, tmp_path):
    assert main(["emit", "nvl72-default", "--engine", "vllm", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("rackbed: error: --engine vllm: unknown engine") and "\n" not in err
    assert not list(tmp_path.iterdir())


def test_cli_writes_the_files(capsys, tmp_path):
    assert main(["emit", "i_h200_mooncake", "--engine", "trtllm", "--out", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ctx.yaml", "disagg.yaml", "gen.yaml", "launch.sh"]


def test_scripts_are_valid_bash(case):
    import shutil
    import subprocess

    if shutil.which("bash") is None:
        pytest.skip("no bash")
    for e in ("sglang", "trtllm"):
        r = subprocess.run(["bash", "-n"], input=case[1][e]["launch.sh"], text=True, capture_output=True, check=False)
        assert r.returncode == 0, r.stderr


def test_wide_ep_decoder_emits_its_redundant_experts():
    """DeepSeek-V3 with an EP72 decoder and 32 redundant experts: SGLang's decode servers get
    ``--ep-num-redundant-experts 32`` (with EPLB), TensorRT-LLM's generation options 288 load-balancer slots; the
    prefill servers neither."""
    sc = load_scenario(scenarios.resolve("dsv3_nvl72_ep72"))
    assert sc.decode.redundant_experts == 32
    files = emit_files(sc, "sglang")
    cmds = _commands(files["launch.sh"])
    dec, pre = _worker_flags(cmds, "decode"), _worker_flags(cmds, "prefill")
    assert dec and all(f["--ep-num-redundant-experts"] == ["32"] and "--enable-eplb" in f for f in dec)
    assert pre and all("--ep-num-redundant-experts" not in f for f in pre)
    tr = emit_files(sc, "trtllm")
    gen, ctx = yaml.safe_load(tr["gen.yaml"]), yaml.safe_load(tr["ctx.yaml"])
    assert gen["moe_config"]["load_balancer"]["num_slots"] == 256 + 32 and "moe_config" not in ctx


def test_an_allgather_decoder_emits_no_all_to_all_backend():
    """``decode.moe_comm: allgather``: SGLang's decode servers run DP attention without an all-to-all MoE
    backend (they gather and scatter the ranks' tokens), and a decode overlap that needs the all-to-all is not
    switched on; with ``a2a`` they keep DeepEP's low-latency kernels."""
    sc = load_scenario(scenarios.resolve("nvl72-default"))
    for comm, backend in (("a2a", "deepep"), ("allgather", "none")):
        d = sc.decode.model_copy(update={"moe_comm": comm, "overlap": "two_batch"})
        files = emit_files(sc.model_copy(update={"decode": d}), "sglang")
        dec = _worker_flags(_commands(files["launch.sh"]), "decode")
        assert dec and all(f["--moe-a2a-backend"] == [backend] for f in dec)
        assert all(("--enable-two-batch-overlap" in f) == (comm == "a2a") for f in dec)
