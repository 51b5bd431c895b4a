"""``rackbed emit`` command lines against the pinned engines' own argument definitions, and the placement they pin.

``sim/data/engine_flags.json`` holds the argparse actions of SGLang's ``launch_server``, the SGLang router and
Dynamo's SGLang worker at the pinned versions (extracted from the wheels by ``tools/engine_flags.py``). Every
command line of every emitted ``launch.sh`` and every worker of a Dynamo graph is parsed with a parser rebuilt from
that data (exact option names, no abbreviations, the engines' value types and choices): a flag renamed or removed
at the pinned version fails here. The cases are the shipped serving scenarios and the search's best answers
(GB200 Qwen3-235B, H200 Qwen3-235B; the shipped H200 DeepSeek-V3 and aggregated H200 scenarios among the shipped).

TensorRT-LLM: ``trtllm-serve``'s click options (``serve`` and ``disaggregated``) and the LLM API argument
classes are in the manifest's ``trtllm`` entry (read by ``tools/engine_flags.py`` from TensorRT-LLM's source
text at the commits its provenance names). Every emitted ``trtllm-serve`` line parses with a strict parser
rebuilt from the options, and every emitted option set (``ctx.yaml``, ``gen.yaml``, ``agg.yaml``, the server
lists of ``disagg.yaml``) is checked against the class tree: an unknown or deprecated key at any level, a wrong
scalar type, a value outside a ``Literal`` fails; a renamed key anywhere in an emitted file is caught (mutation
check).

The pinning: on every host, no two servers share a GPU or a port, and each server's ``CUDA_VISIBLE_DEVICES`` is
exactly its group's GPUs on that host as the deployment placed them. MTP: SGLang's ``NEXTN`` and TensorRT-LLM's
``decoding_type: MTP`` appear only for a model with MTP layers.
"""

from __future__ import annotations

import argparse
import json
import re
import shlex
from functools import cache
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from lane import first_in_lane

from rackbed import scenarios
from rackbed.sim import emit
from rackbed.sim.emit import emit_files, plan_of
from rackbed.sim.scenario import build, load_scenario, parse_scenario
from rackbed.topology.yamlio import load_yaml

MANIFEST = Path(emit.__file__).resolve().parent / "data" / "engine_flags.json"


def _shipped_serving() -> list[str]:
    names = []
    for p in sorted(scenarios.HERE.glob("*.yaml")):
        if load_yaml(p).get("kind") == "serving":
            names.append(p.stem)
    return names


def _best_gb200() -> dict:
    """``rackbed search --gpus 72`` on GB200 NVL72, Qwen3-235B fp8 (docs/CAPACITY.md): 26 x TP2 prefill +
    5 x DP-EP4 decode, batch <= 128, MTP k=2: two prefill servers per compute tray."""
    d = load_yaml(scenarios.resolve("nvl72-default"))
    d.update(name="best-gb200-qwen3", weight_format="fp8", prefill={"tp": 2, "ep": 2, "replicas": 26},
             decode={"ep": 4, "replicas": 5, "max_batch_per_rank": 128},
             mtp={"draft_k": 2, "accept_p": 0.8, "draft": {"kind": "mtp", "layers": 1}})
    return d


def _best_h200() -> dict:
    """The 64-GPU H200 answer (docs/CAPACITY.md): 22 x TP2 prefill + 2 x DP-EP8 decode, batch <= 128, MTP k=2."""
    d = _best_gb200()
    d.update(name="best-h200-qwen3", topology="hgx-h200*8", prefill={"tp": 2, "ep": 2, "replicas": 22},
             decode={"ep": 8, "replicas": 2, "max_batch_per_rank": 128})
    return d


def _search_gb200() -> dict:
    """The best of ``rackbed search --model qwen3-235b-a22b --gpus 72 --topology gb200-nvl72 --isl 6000 --osl 500
    --ttft 2 --tpot 0.03`` (docs/DEPLOY.md's worked example): 20 x TP2/EP2 prefill + 1 x DP-EP32 decode across
    eight trays, batch <= 64, no MTP."""
    d = _best_gb200()
    d.update(name="search-gb200-qwen3", prefill={"tp": 2, "ep": 2, "replicas": 20},
             decode={"ep": 32, "replicas": 1, "max_batch_per_rank": 64}, mtp={"draft_k": 0})
    return d


def _draft_model_h200() -> dict:
    """The H200 answer drafting with a separate small model (``mtp.draft.kind: model``, k=2)."""
    d = _best_h200()
    d.update(name="draft-model-h200-qwen3", mtp={"draft_k": 2, "accept_p": 0.7,
                                                 "draft": {"kind": "model", "model": "qwen3-30b-a3b"}})
    return d


def _dsv3_overlap() -> dict:
    """The shipped DeepSeek-V3 EP32 scenario priced with two-batch overlap in both roles (the decoders get
    SGLang's switch; the TP=EP prefillers cannot, and the files say so)."""
    d = load_yaml(scenarios.resolve("dsv3_nvl72_ep32"))
    d.update(name="dsv3-nvl72-ep32-tbo", prefill={**d["prefill"], "overlap": "two_batch"},
             decode={**d["decode"], "overlap": "two_batch"})
    return d


CASES = {**{n: None for n in _shipped_serving()}, "best-gb200-qwen3": _best_gb200, "best-h200-qwen3": _best_h200,
         "search-gb200-qwen3": _search_gb200, "draft-model-h200-qwen3": _draft_model_h200,
         "dsv3-nvl72-ep32-tbo": _dsv3_overlap}


@cache
def _case(key: str):
    make = CASES[key]
    sc = load_scenario(scenarios.resolve(key)) if make is None else parse_scenario(make(), key)
    return sc, {e: emit_files(sc, e) for e in emit.ENGINES}


# ------------------------------------------------------------------------------------------------ parsers


class _Refused(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise _Refused(message)


@cache
def _manifest() -> dict:
    return json.loads(MANIFEST.read_text())


@cache
def _parser(name: str) -> _Parser:
    """``name``'s parser from the manifest: its options exactly (no abbreviations), ``nargs``, types, choices."""
    p = _Parser(prog=name, allow_abbrev=False, add_help=False)
    for a in _manifest()["parsers"][name]["actions"]:
        kind, flags = a["kind"], a["flags"]
        if kind == "help":
            continue
        if kind == "boolean_optional":  # --x / --no-x
            for f in flags:
                p.add_argument(f, action="store_true", dest=f)
            continue
        if kind in ("store_true", "store_false", "store_const", "count"):
            p.add_argument(*flags, action="store_true" if kind != "count" else "count", dest=a["dest"])
            continue
        kw = {"dest": a["dest"], "action": "append" if kind == "append" else "store"}
        if a["nargs"] is not None:
            kw["nargs"] = a["nargs"]
        if a["type"] in ("int", "float"):
            kw["type"] = {"int": int, "float": float}[a["type"]]
        if a["choices"] is not None:
            kw["choices"] = a["choices"]
        p.add_argument(*flags, **kw)
    return p


def parse(name: str, argv: list[str]) -> argparse.Namespace:
    """``argv`` parsed by ``name``'s pinned parser; every argument must be known (``_Refused`` otherwise)."""
    ns, rest = _parser(name).parse_known_args(argv)
    if rest:
        raise _Refused(f"unrecognized arguments: {' '.join(rest)}")
    return ns


def _servers(script: str) -> list[tuple[str, dict[str, str], list[str]]]:
    """``(comment above, environment assignments, argv)`` of every command line of a launch script."""
    out, comment = [], ""
    for ln in script.splitlines()[3:]:  # after the shebang, title and MODEL_PATH default
        if ln.startswith("#"):
            comment = ln
        elif ln.strip():
            words = shlex.split(ln)
            env = {}
            while "=" in words[0] and not words[0].startswith("-"):
                k, v = words.pop(0).split("=", 1)
                env[k] = v
            out.append((comment, env, words))
    return out


# ------------------------------------------------------------------------------------------------ the flags


def test_manifest_has_its_provenance():
    m = _manifest()
    pk = m["provenance"]["packages"]
    assert (pk["sglang"]["version"], pk["sglang-router"]["version"], pk["ai-dynamo"]["version"]) == (
        emit.SGLANG_VERSION, emit.SGLANG_ROUTER_VERSION, emit.DYNAMO_VERSION)
    assert all(re.fullmatch(r"[0-9a-f]{64}", p["sha256"]) for p in pk.values())
    assert len(m["parsers"]["sglang.launch_server"]["actions"]) > 300


def test_the_pinned_parsers_refuse_what_they_should():
    """The rebuilt parser is strict: a removed flag, an abbreviation, a bad choice, a non-integer all fail."""
    ok = ["--model-path", "m", "--tp-size", "4", "--moe-a2a-backend", "deepep"]
    parse("sglang.launch_server", ok)
    for bad in (["--tp", "4"], ["--cuda-graph-max-bs", "8"], ["--model-path", "m", "--tp-size", "four"],
                ["--moe-a2a-backend", "alltoall"], ["--dp", "4"], ["--no-such-flag"]):
        with pytest.raises(_Refused):
            parse("sglang.launch_server", bad)


@pytest.mark.parametrize("key", first_in_lane(sorted(CASES)))
def test_every_sglang_command_parses_with_the_pinned_sglang(key):
    sc, files = _case(key)
    pl = plan_of(sc)
    n_server = 0
    for _, _, argv in _servers(files["sglang"]["launch.sh"]):
        assert argv[:2] == ["python", "-m"]
        if argv[2] == "sglang.launch_server":
            ns = parse("sglang.launch_server", argv[3:])
            n_server += 1
            if ns.speculative_algorithm is not None:
                assert ns.speculative_algorithm in _manifest()["values"]["sglang.speculative_algorithm"]
                # MTP (the checkpoint's own layers) only where the model has them
                assert (ns.speculative_algorithm == "NEXTN") == (pl.model_has_mtp and pl.draft_kind == "mtp")
            if ns.ep_size and ns.ep_size > 1:
                assert ns.moe_a2a_backend == ("deepep" if ns.attn_dp_size else "none")
        else:
            assert argv[2] == "sglang_router.launch_router"
            ns = parse("sglang_router.launch_router", argv[3:])
            if pl.is_aggregated:
                assert len(ns.worker_urls) == len(pl.aggregated)
            else:
                assert len(ns.prefill) == len(pl.prefill) and len(ns.decode) == len(pl.decode)
    groups = pl.aggregated or (*pl.prefill, *pl.decode)
    assert n_server == sum(len(g.hosts) for g in groups)


@pytest.mark.parametrize("key", sorted(CASES))
def test_every_dynamo_worker_parses_with_the_pinned_dynamo_and_sglang(key):
    """Dynamo's SGLang worker reads its own flags, then hands the rest to SGLang's parser."""
    sc, files = _case(key)
    g = yaml.safe_load(files["dynamo"]["graph.yaml"])
    workers = [s for s in g["spec"]["services"].values() if s["componentType"] == "worker"]
    assert workers
    for s in workers:
        c = s["extraPodSpec"]["mainContainer"]
        assert c["command"] == ["python3", "-m", "dynamo.sglang"]
        _, rest = _parser("dynamo.sglang").parse_known_args(c["args"])
        parse("sglang.launch_server", rest)


# ------------------------------------------------------------------------------------------------ the placement


def _local_placement(sc) -> dict[int, list[tuple[int, ...]]]:
    """host -> each group's GPUs there as the host numbers them (the deployment's own placement)."""
    dep = build(sc, engine_calibration=False).deployment
    order = {h: sorted(x for x, hx in dep.gpu_host.items() if hx == h) for h in set(dep.gpu_host.values())}
    out: dict[int, list[tuple[int, ...]]] = {}
    for g in (*dep.prefillers, *dep.decoders, *getattr(dep, "aggregated", ())):
        for h in sorted({dep.gpu_host[x] for x in g.gpus}):
            out.setdefault(h, []).append(tuple(sorted(order[h].index(x) for x in g.gpus if dep.gpu_host[x] == h)))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["sglang", "trtllm"])
@pytest.mark.parametrize("key", sorted(CASES))
def test_no_two_servers_on_a_host_share_a_gpu_or_a_port(key, engine):
    sc, files = _case(key)
    placed = _local_placement(sc)
    pinned: dict[int, list[tuple[int, ...]]] = {}
    ports: dict[int, list[int]] = {}
    for comment, env, argv in _servers(files[engine]["launch.sh"]):
        if "sglang_router.launch_router" in argv or argv[:2] == ["trtllm-serve", "disaggregated"]:
            continue
        hosts = [int(h) for h in re.findall(r"\$\{HOST_(\d+)\}", comment.rsplit(":", 1)[-1])]
        if "CUDA_VISIBLE_DEVICES" not in env:  # a TensorRT-LLM MPI job across hosts: its launcher places ranks
            assert engine == "trtllm" and len(hosts) > 1, comment
            continue
        (h,) = hosts
        gpus = tuple(int(x) for x in env["CUDA_VISIBLE_DEVICES"].split(","))
        pinned.setdefault(h, []).append(gpus)
        for f in ("--port", "--disaggregation-bootstrap-port"):
            if f in argv:
                ports.setdefault(h, []).append(int(argv[argv.index(f) + 1]))
    for h, sets in pinned.items():
        flat = [x for s in sets for x in s]
        assert len(flat) == len(set(flat)), f"host {h}: servers share a GPU: {sets}"
        assert len(ports[h]) == len(set(ports[h])), f"host {h}: servers share a port: {ports[h]}"
        assert sorted(sets) == sorted(placed[h]) or engine == "trtllm", (h, sets, placed[h])
    if engine == "sglang":  # every group on every host it spans is pinned to exactly its placed GPUs
        assert {h: sorted(s) for h, s in pinned.items()} == {h: sorted(s) for h, s in placed.items()}


def test_two_prefill_servers_per_tray_take_different_gpus():
    """The GB200 answer's TP2 prefillers: two per 4-GPU compute tray, pinned to 0,1 and 2,3."""
    sc, files = _case("best-gb200-qwen3")
    pins = [env["CUDA_VISIBLE_DEVICES"] for _, env, argv in _servers(files["sglang"]["launch.sh"])
            if "prefill" in argv]
    assert sorted(set(pins)) == ["0,1", "2,3"] and len(pins) == 26


@pytest.mark.parametrize("key", sorted(CASES))
def test_trtllm_mtp_only_for_models_with_mtp_layers(key):
    sc, files = _case(key)
    pl = plan_of(sc)
    for name, text in files["trtllm"].items():
        if not name.endswith(".yaml"):
            continue
        spec = [o.get("speculative_config") for o in _option_sets(yaml.safe_load(text))]
        for s in filter(None, spec):
            assert s["decoding_type"] != "MTP" or pl.model_has_mtp, (key, name)
        if pl.draft_k and pl.draft_kind == "mtp" and not pl.model_has_mtp:
            assert "TensorRT-LLM's MTP needs the checkpoint's own MTP layers" in text


def _option_sets(doc: dict) -> list[dict]:
    return [doc, *(doc[k] for k in ("context_servers", "generation_servers") if k in doc)]


def test_model_path_is_the_checkpoint_folder(tmp_path):
    """A scenario whose model is a config.json path defaults MODEL_PATH to the folder that holds it (the engines
    load a folder or a hub id); a folder stays the folder."""
    from test_emit_safety import QWEN3_235B

    sc, _ = _case("i_h200_mooncake")
    cfg = tmp_path / "ckpt" / "config.json"
    cfg.parent.mkdir()
    cfg.write_text(json.dumps(QWEN3_235B))
    for model in (str(cfg), str(cfg.parent)):
        text = emit_files(sc.model_copy(update={"model": model}), "sglang")["launch.sh"]
        assert text.splitlines()[2] == f'[ -n "${{MODEL_PATH:-}}" ] || MODEL_PATH={cfg.parent}'


@pytest.mark.slow
@settings(max_examples=15, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
@given(topo=st.sampled_from(["gb200-nvl72", "hgx-h200*4"]),
       model_tp=st.sampled_from([("qwen3-235b-a22b", 2), ("qwen3-235b-a22b", 4), ("deepseek-v3", 8)]),
       pep=st.sampled_from([1, 2, 4]), prep=st.integers(1, 6), dep=st.sampled_from([4, 8, 16]),
       drep=st.integers(1, 2), k=st.integers(0, 2))
def test_any_placement_is_pinned_and_parses(topo, model_tp, pep, prep, dep, drep, k):
    """For any disaggregated shape the topology places: every SGLang server parses with the pinned parser, is
    pinned to exactly its group's GPUs on its host, and no two servers on a host share a GPU or a port; every
    ``trtllm-serve`` line parses with the pinned TensorRT-LLM options and every option set it writes is valid
    under the pinned LLM API classes (MTP only for a model with MTP layers)."""
    from rackbed.topology.errors import UserError

    model, ptp = model_tp
    d = load_yaml(scenarios.resolve("nvl72-default"))
    d.update(name="prop", topology=topo, model=model, weight_format="fp8",
             prefill={"tp": ptp, "ep": min(pep, ptp), "replicas": prep}, decode={"ep": dep, "replicas": drep},
             mtp={"draft_k": k, "accept_p": 0.8, "draft": {"kind": "mtp", "layers": 1}} if k else {"draft_k": 0})
    try:
        sc = parse_scenario(d, "prop")
        placed = _local_placement(sc)
        text = emit_files(sc, "sglang")["launch.sh"]
    except UserError:
        assume(False)
        return
    pinned: dict[int, list[tuple[int, ...]]] = {}
    ports: dict[int, list[int]] = {}
    for comment, env, argv in _servers(text):
        if "sglang.launch_server" not in argv:
            parse("sglang_router.launch_router", argv[3:])
            continue
        parse("sglang.launch_server", argv[3:])
        (h,) = [int(x) for x in re.findall(r"\$\{HOST_(\d+)\}", comment.rsplit(":", 1)[-1])]
        pinned.setdefault(h, []).append(tuple(int(x) for x in env["CUDA_VISIBLE_DEVICES"].split(",")))
        ports.setdefault(h, []).append(int(argv[argv.index("--port") + 1]))
    for h, sets in pinned.items():
        flat = [x for s in sets for x in s]
        assert len(flat) == len(set(flat)) and len(ports[h]) == len(set(ports[h]))
    assert {h: sorted(s) for h, s in pinned.items()} == {h: sorted(s) for h, s in placed.items()}
    trt = emit_files(sc, "trtllm")
    for _, _, argv in _servers(trt["launch.sh"]):
        trt_parse(argv[1:])
    for name, doc in _trt_yaml_options(trt).items():
        assert llm_options_errors(doc) == [], name
        spec = doc.get("speculative_config") or {}
        assert spec.get("decoding_type") != "MTP" or plan_of(sc).model_has_mtp


# --------------------------------------------------------------------------------------------- TensorRT-LLM


@cache
def _trt() -> dict:
    """The ``trtllm`` entry: ``trtllm-serve``'s click commands and the LLM API argument classes (read by
    ``tools/engine_flags.py`` from TensorRT-LLM's source text)."""
    return _manifest()["trtllm"]


@cache
def _trt_parser(command: str) -> _Parser:
    """``trtllm-serve COMMAND``'s options as an argparse parser: exact option names (no abbreviations),
    click's value types and literal choices (a ``ChoiceWithAlias``'s aliases accepted too), flags take no
    value."""
    spec = _trt()["commands"][command]
    p = _Parser(prog=f"trtllm-serve {command}", allow_abbrev=False, add_help=False)
    for name in spec["arguments"]:
        p.add_argument(name)
    for o in spec["options"]:
        if o["kind"] == "flag":
            p.add_argument(*o["flags"], dest=o["dest"], action="store_true")
            continue
        kw = {"dest": o["dest"], "action": "append" if o["kind"] == "multiple" else "store"}
        if o["type"] in ("int", "float"):
            kw["type"] = {"int": int, "float": float}[o["type"]]
        if o["choices"] is not None:
            kw["choices"] = [*o["choices"], *(o["aliases"] or {})]
        p.add_argument(*o["flags"], **kw)
    return p


def trt_parse(argv: list[str]) -> tuple[str, argparse.Namespace]:
    """A ``trtllm-serve`` command line (after the program name) parsed by the pinned command it names
    (``serve`` when the first word is not a command, as ``trtllm-serve``'s default group resolves it)."""
    command = argv[0] if argv and argv[0] in _trt()["commands"] else "serve"
    rest = argv[1:] if command != "serve" or argv[:1] == ["serve"] else argv
    ns, extra = _trt_parser(command).parse_known_args(rest)
    if extra:
        raise _Refused(f"unrecognized arguments: {' '.join(extra)}")
    return command, ns


_JSON_KIND = {bool: "bool", int: "int", float: "float", str: "str", list: "list", dict: "dict",
              type(None): "null"}


def llm_options_errors(doc, cls: str = "TorchLlmArgs", where: str = "") -> list[str]:
    """Where ``doc`` (a YAML mapping) breaks the pinned LLM API class ``cls``: a key the class does not
    declare (its models forbid extra keys) or declares deprecated, a value of a type the field does not take
    (an int where a float is taken is fine, as pydantic reads it; a bool is not an int), a value outside a
    ``Literal``'s choices, a discriminated union without its key or with an unknown one; nested mappings are
    checked against their class."""
    classes = _trt()["classes"]
    if not isinstance(doc, dict):
        return [f"{where or cls}: not a mapping"]
    fields, errors = classes[cls]["fields"], []
    for key, value in doc.items():
        at = f"{where}.{key}" if where else key
        if key not in fields:
            errors.append(f"{at}: not a field of {cls}")
            continue
        f = fields[key]
        if f.get("deprecated"):
            errors.append(f"{at}: deprecated at the pinned version")
        kind = _JSON_KIND.get(type(value), "other")
        ok = kind in f["types"] or "any" in f["types"] or (kind == "int" and "float" in f["types"])
        if kind == "dict" and "model" in f["types"]:
            ok = True
            disc = f.get("discriminator")
            if disc is not None:
                model = disc["models"].get(value.get(disc["key"]))
                if model is None:
                    errors.append(f"{at}.{disc['key']}: {value.get(disc['key'])!r} is none of "
                                  f"{sorted(disc['models'])}")
                    continue
            else:
                (model,) = f["models"]
            errors += llm_options_errors(value, model, at)
            continue
        if not ok and f.get("unchecked"):
            continue  # a type this manifest does not describe
        if not ok:
            errors.append(f"{at}: {value!r} is {kind}, the field takes {f['types']}")
        elif "choices" in f and kind == "str" and value not in f["choices"]:
            errors.append(f"{at}: {value!r} is none of {f['choices']}")
    return errors


def _trt_yaml_options(files: dict) -> dict[str, dict]:
    """Every LLM API option set of the emitted TensorRT-LLM files: ``ctx.yaml`` / ``gen.yaml`` / ``agg.yaml``
    whole, and each server list of ``disagg.yaml`` without the keys the disaggregated front end itself reads
    (``num_instances``, ``urls``)."""
    out = {}
    for name, text in files.items():
        if not name.endswith(".yaml"):
            continue
        doc = yaml.safe_load(text)
        if name == "disagg.yaml":
            for k in ("context_servers", "generation_servers"):
                out[f"{name}:{k}"] = {x: v for x, v in doc[k].items() if x not in ("num_instances", "urls")}
        else:
            out[name] = doc
    return out


def test_trtllm_manifest_has_its_provenance():
    t = _trt()
    prov = t["provenance"]
    assert prov["repository"] == "NVIDIA/TensorRT-LLM"
    assert all(re.fullmatch(r"[0-9a-f]{40}", s["commit"]) for s in prov["sources"].values())
    assert all(re.fullmatch(r"[0-9a-f]{64}", h) for h in prov["sha256"].values())
    assert {s["path"]: s["commit"] for s in prov["sources"].values()} == emit.TRTLLM_SOURCES
    assert {"serve", "disaggregated"} <= set(t["commands"]) and t["root"] in t["classes"]
    assert len(t["classes"]["TorchLlmArgs"]["fields"]) > 100
    assert "MTP" in t["classes"]["TorchLlmArgs"]["fields"]["speculative_config"]["discriminator"]["models"]


def test_the_trtllm_checks_refuse_what_they_should():
    """The rebuilt ``trtllm-serve`` parser and the option check are strict: an unknown option, an
    abbreviation, a bad choice, a non-integer, a misspelt key at any level, a wrong scalar type, an unknown
    choice or decoding type, a deprecated key all fail."""
    trt_parse(["m", "--backend", "pytorch", "--tp_size", "4", "--ep_size", "4",
               "--extra_llm_api_options", "x"])
    trt_parse(["disaggregated", "-c", "disagg.yaml"])
    for bad in (["m", "--tp", "4"], ["m", "--backend", "trtllm"], ["m", "--tp_size", "four"], ["m", "--nope"],
                ["m", "--tensor-parallel-size", "2"], ["disaggregated", "--config", "d.yaml"]):
        with pytest.raises(_Refused):
            trt_parse(bad)
    good = {"tensor_parallel_size": 4, "enable_attention_dp": True, "kv_cache_config": {"dtype": "fp8"},
            "moe_config": {"load_balancer": {"num_slots": 288}},
            "speculative_config": {"decoding_type": "MTP", "max_draft_len": 2}}
    assert llm_options_errors(good) == []
    for bad in ({"tensor_parallel_sizes": 4}, {"kv_cache_config": {"tokens_per_blok": 64}},
                {"max_batch_size": "64"}, {"enable_attention_dp": 1}, {"moe_config": {"backend": "WIDEEP"}},
                {"moe_config": {"load_balancer": {"num_slot": 288}}},
                {"speculative_config": {"decoding_type": "Medusa"}},
                {"speculative_config": {"max_draft_len": 2}},
                {"speculative_config": {"decoding_type": "MTP", "num_draft": 2}},
                {"speculative_config": {"decoding_type": "MTP", "num_nextn_predict_layers": 2}},
                {"cache_transceiver_config": {"backend": "RDMA"}}):
        assert llm_options_errors(bad), bad


@pytest.mark.parametrize("key", sorted(CASES))
def test_every_trtllm_command_parses_with_the_pinned_trtllm_serve(key):
    sc, files = _case(key)
    pl = plan_of(sc)
    n_serve = 0
    for _, _, argv in _servers(files["trtllm"]["launch.sh"]):
        assert argv[0] == "trtllm-serve"
        command, ns = trt_parse(argv[1:])
        if command == "disaggregated":
            assert ns.config_file == "disagg.yaml"
            continue
        n_serve += 1
        assert ns.model == "${MODEL_PATH}" and ns.backend == "pytorch"
        assert ns.extra_llm_api_options in files["trtllm"]
    assert n_serve == len(pl.aggregated or (*pl.prefill, *pl.decode))


@pytest.mark.parametrize("key", sorted(CASES))
def test_every_trtllm_yaml_is_valid_under_the_pinned_llm_args(key):
    sc, files = _case(key)
    options = _trt_yaml_options(files["trtllm"])
    assert options
    for name, doc in options.items():
        assert llm_options_errors(doc) == [], name


def _key_paths(doc, prefix=()):
    for k, v in doc.items():
        yield (*prefix, k)
        if isinstance(v, dict):
            yield from _key_paths(v, (*prefix, k))


def _renamed(doc, path):
    out = dict(doc)
    if len(path) == 1:
        out[path[0] + "_x"] = out.pop(path[0])
    else:
        out[path[0]] = _renamed(out[path[0]], path[1:])
    return out


@pytest.mark.parametrize("key", ["best-gb200-qwen3", "i_h200_mooncake"])
def test_a_renamed_key_anywhere_in_an_emitted_yaml_is_caught(key):
    """Mutation check: every key of every emitted option set, renamed, is refused where it stands."""
    _, files = _case(key)
    n = 0
    for name, doc in _trt_yaml_options(files["trtllm"]).items():
        for path in _key_paths(doc):
            errors = llm_options_errors(_renamed(doc, path))
            renamed = ".".join((*path[:-1], path[-1] + "_x"))
            # a renamed union key (decoding_type) leaves its union without one: refused where the key was
            assert any(e.startswith((f"{renamed}:", f"{'.'.join(path)}: None is none of")) for e in errors), (
                name, path, errors)
            n += 1
    assert n > 10


def test_the_trtllm_extractor_reads_declarations():
    """``tools/engine_flags.py``'s readers on a small source text: click flags, types, literal choices and
    aliases; pydantic fields with Optional / Literal / union / inheritance / discriminated unions, private and
    ClassVar names skipped, a ``json_schema_extra`` type read for an ``object`` annotation."""
    import importlib.util

    path = Path(__file__).parents[1] / "tools" / "engine_flags.py"
    spec = importlib.util.spec_from_file_location("engine_flags", path)
    ef = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ef)
    cli = ef.trtllm_click_commands('''
@click.command("serve")
@click.argument("model", type=str)
@click.option("--a", "--aa", type=int, default=1)
@click.option("--b", type=ChoiceWithAlias(["x", "y"], {"z": "x"}))
@click.option("--c", is_flag=True)
@click.option("--d", type=click.Choice(REG.keys()))
@click.option("--config", "--e", "e_dest", type=str)
def serve(): ...
''')["serve"]
    assert cli["arguments"] == ["model"]
    a, b, c, d, e = cli["options"]
    assert (a["flags"], a["type"], a["dest"]) == (["--a", "--aa"], "int", "aa")
    assert (b["choices"], b["aliases"]) == (["x", "y"], {"z": "x"})
    assert c["kind"] == "flag" and d["choices"] is None and e["dest"] == "e_dest"
    cls = ef.trtllm_model_fields('''
class A(StrictBaseModel):
    x: Optional[int]
    y: Literal["p", "q"] = Field(default="p")
    _priv: int = PrivateAttr(1)
    k: ClassVar[str] = "k"
    old: int = Field(deprecated=True)
    lb: Optional[Union[object, str]] = Field(json_schema_extra={"type": "Union[B, dict]"})
class B(A):
    y: bool | Literal["auto"]
    kind: Literal["b"]
class C(StrictBaseModel):
    kind: Literal["c"]
U: TypeAlias = Annotated[Union[B, C], Field(discriminator="kind")]
class D(StrictBaseModel):
    u: Optional[U]
    w: Foo
''')
    assert set(cls["A"]["fields"]) == {"x", "y", "old", "lb"} and cls["A"]["fields"]["old"]["deprecated"]
    assert cls["A"]["fields"]["x"] == {"types": ["int", "null"]}
    assert cls["A"]["fields"]["y"]["choices"] == ["p", "q"]
    assert cls["A"]["fields"]["lb"] == {"types": ["dict", "model", "null"], "models": ["B"]}
    assert cls["B"]["fields"]["y"] == {"types": ["bool", "str"], "choices": ["auto"]}
    assert "x" in cls["B"]["fields"]
    assert cls["D"]["fields"]["u"]["discriminator"] == {"key": "kind", "models": {"b": "B", "c": "C"}}
    assert cls["D"]["fields"]["w"] == {"types": [], "unchecked": ["Foo"]}
