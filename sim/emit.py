"""A deployable answer: a serving scenario's deployment as the launch settings of real engines.

:func:`emit_files` turns a scenario (prefiller / decoder counts, TP / EP / attention DP per group, batch caps,
the prefill token budget, MTP draft tokens, model, KV dtype, weight format, where each group's GPUs are) into
files a user starts from; :func:`write_emit` writes them. Engines (:data:`ENGINES`), each at a pinned version
(:data:`SGLANG_VERSION` ...):

* ``sglang``: ``launch.sh`` — one ``python -m sglang.launch_server`` line per group and host, pinned to the
  group's GPUs on that host (``CUDA_VISIBLE_DEVICES``, as the deployment placed them), with its own port
  (``--disaggregation-mode prefill|decode``, ``--disaggregation-transfer-backend``, ``--tp-size``,
  ``--attn-dp-size``, ``--ep-size`` + ``--moe-a2a-backend`` (the priced exchange: :func:`sglang_moe_a2a`),
  ``--max-running-requests``, ``--chunked-prefill-size``, ``--page-size``, ``--kv-cache-dtype``, speculative
  flags, ``--ep-num-redundant-experts`` + ``--enable-eplb`` for a decoder with redundant experts,
  ``--enable-two-batch-overlap`` / ``--enable-single-batch-overlap`` for a role priced with that overlap
  (``decode.overlap`` / ``prefill.overlap``; DeepEP groups only, :func:`sglang_overlap`); ``--nnodes`` /
  ``--node-rank`` / ``--dist-init-addr`` for a group across hosts) and the PD router.
* ``trtllm``: ``ctx.yaml`` / ``gen.yaml`` (LLM API options of the context and generation servers; the cache
  transceiver backend; DP-EP decode as attention DP with EP, redundant experts as
  ``moe_config.load_balancer.num_slots``; MTP only for a checkpoint with MTP layers), ``disagg.yaml``
  (``trtllm-serve disaggregated``: ``context_servers`` / ``generation_servers``) and ``launch.sh`` (one-host
  servers pinned as above; a group across hosts is one MPI job whose launcher places its ranks).
* ``dynamo``: ``graph.yaml`` — a ``DynamoGraphDeployment`` (frontend, prefill and decode worker services on the
  SGLang backend, the same engine arguments as ``sglang``).
* ``k8s``: ``k8s.yaml`` — plain Kubernetes objects (a ``v1`` ``List``): per group a headless Service and a
  StatefulSet of one pod per host it spans, each asking the device plugin for the group's GPUs there, and the
  router as a Deployment behind a Service (:func:`k8s_items`).

An **aggregated** scenario (``deployment: aggregated``: workers that prefill and decode on the same GPUs) is
emitted as plain servers, no disaggregation: SGLang ``launch_server`` per worker (``--tp-size`` = the worker's
GPUs, ``--attn-dp-size`` for DP-attention ranks, ``--ep-size``, ``--chunked-prefill-size`` = the chunk,
``--max-prefill-tokens`` = the per-rank token budget, ``--max-running-requests``) and the router over the
workers (``--worker-urls``); TensorRT-LLM ``trtllm-serve`` per worker with ``agg.yaml``
(``tensor_parallel_size``, ``moe_expert_parallel_size``, ``enable_attention_dp``, ``max_batch_size``,
``max_num_tokens``, ``enable_chunked_prefill``); Dynamo a graph of a frontend and one worker service (no
``subComponentType``); Kubernetes one StatefulSet per worker.

Flag names are the pinned engines' own: ``tests/test_emit_flags.py`` parses every emitted SGLang, router,
Dynamo worker and ``trtllm-serve`` command line with their parsers and checks every TensorRT-LLM option set
against the LLM API argument classes (``sim/data/engine_flags.json``, written by ``tools/engine_flags.py``;
TensorRT-LLM at :data:`TRTLLM_SOURCES`). A setting rackbed prices that an engine has no flag for is named in
a ``# no equivalent:`` comment at the top of the file, with what the difference costs in rackbed's model
(:func:`unmapped`). Hosts are placeholders (``${HOST_<n>}``, the topology's host numbers) and the checkpoint is
``${MODEL_PATH}``: a script keeps ``MODEL_PATH`` when it is set, else sets it to the model (a preset's Hugging
Face id, or the checkpoint folder: the scenario's ``model`` path, or the folder of its ``config.json``).

Scenario text reaches the files in three fields: ``name`` (comments; the Dynamo object name), ``model`` and a draft
model's ``mtp.draft.model`` (comments; ``model`` also the ``MODEL_PATH`` default). :func:`emit_files` refuses, in
one line naming the field, any of them that holds a control, format or line-break character
(:func:`check_emittable`); whatever the text, :func:`render` quotes it for where it lands:

* a shell word is single-quoted (:func:`shlex.quote`): ``$(...)``, backticks, quotes and newlines stay text;
  only ``${HOST_<n>}``, ``${MODEL_PATH}`` and ``${DRAFT_MODEL_PATH}`` (:data:`PLACEHOLDER`) stay expandable;
* a ``#`` comment line of a script or a YAML file shows every non-printable character as its Python escape
  (``\\n``, ``\\u2028``), so that nothing ends the comment and starts a command or a YAML key;
* YAML values are written by ``yaml.safe_dump``; the Dynamo ``metadata.name`` keeps only ``a-z``, ``0-9`` and
  ``-`` of the name (an RFC 1123 label, :func:`dns_label`).
"""

from __future__ import annotations

import os
import re
import shlex
import unicodedata
from dataclasses import dataclass
from pathlib import Path

import yaml

from rackbed.topology.errors import UserError
from rackbed.topology.outputs import write_text

ENGINES = ("sglang", "trtllm", "dynamo", "k8s")
PREFILL_PORT, DECODE_PORT, BOOTSTRAP_PORT, DIST_PORT, ROUTER_PORT = 30000, 31000, 8998, 20000, 8000

SGLANG_VERSION, SGLANG_ROUTER_VERSION, DYNAMO_VERSION = "0.5.23", "0.3.2", "1.6.1"
#: the TensorRT-LLM sources the ``trtllm`` files are checked against (main-branch commits of
#: NVIDIA/TensorRT-LLM; no release is stated at them: ``sim/data/engine_flags.json``'s ``trtllm`` provenance)
TRTLLM_SOURCES = {"tensorrt_llm/commands/serve.py": "00209af149e7774406881a37283dce303571eb11",
                  "tensorrt_llm/llmapi/llm_args.py": "0004396720054fd8e205cbf616f21f0b57c6b412"}
#: the SGLang router's choice of a server: the least loaded of two sampled (rackbed's prefiller and worker picks
#: are least-loaded ones; the router has no queued-token measure, see :func:`unmapped`)
ROUTER_POLICY = "power_of_two"
#: the KV-cache transfer backend of disaggregated SGLang servers (RDMA over the hosts' NICs, as priced)
TRANSFER_BACKEND = "mooncake"
#: TensorRT-LLM's cache transceiver backend (``cache_transceiver_config.backend``)
TRTLLM_TRANSFER_BACKEND = "UCX"

#: rackbed weight formats -> SGLang's --quantization (None: the checkpoint's own; absent: no flag known)
SGLANG_QUANT = {"bf16": None, "fp8": "fp8", "fp8_block": "fp8", "mxfp8": "mxfp8", "nvfp4": "modelopt_fp4",
                "mxfp4": "mxfp4"}


@dataclass(frozen=True)
class Group:
    """One placed group as an engine sees it: its id, GPUs per host (in host order) and parallelism."""

    id: str
    role: str                       # "prefill" | "decode" | "aggregated"
    hosts: tuple[int, ...]
    gpus_per_host: int
    tp: int                         # attention tensor parallelism (decode: 1, one DP rank per GPU)
    ep: int
    dp: int                         # attention data-parallel ranks: GPUs / tp (1 = none)
    #: the group's GPUs on each of its hosts (host order), as that host numbers them (0 .. GPUs per host - 1):
    #: what ``CUDA_VISIBLE_DEVICES`` pins a server to
    local_gpus: tuple[tuple[int, ...], ...] = ()

    @property
    def n_gpus(self) -> int:
        return self.gpus_per_host * len(self.hosts)


@dataclass(frozen=True)
class Plan:
    """What every engine file is made of (from a scenario; :func:`plan_of`)."""

    name: str
    model_id: str
    weight_format: str
    kv_dtype: str
    prefill: tuple[Group, ...]
    decode: tuple[Group, ...]
    prefill_tokens: int             # token budget of one prefill batch = chunk size
    decode_batch_per_rank: int
    page_tokens: int
    draft_k: int
    model_has_mtp: bool
    #: what drafts (``mtp.draft``): ``mtp`` (MTP layers: the model's own, or a trained head it lacks) or ``model``
    draft_kind: str = "mtp"
    draft_model: str | None = None  # the draft model's name or config (draft_kind ``model``)
    aggregated: tuple[Group, ...] = ()  # deployment: aggregated (then no prefill / decode groups)
    chunk_tokens: int | None = None     # aggregated: the most prompt tokens of one request in a step
    n_experts: int = 0                  # routed experts of the model
    decode_redundant_experts: int = 0   # decode.redundant_experts: extra expert slots (wide EP)
    prefill_overlap: str = "none"       # prefill.overlap / decode.overlap (sim.costs.overlap)
    decode_overlap: str = "none"
    decode_moe_comm: str = "a2a"        # decode.moe_comm (sim.costs.moe_comm)

    @property
    def is_aggregated(self) -> bool:
        return bool(self.aggregated)


def plan_of(sc) -> Plan:
    """The :class:`Plan` of a :class:`~sim.scenario.ServingScenario` (built: its groups placed on GPUs)."""
    from rackbed.sim.scenario import build

    if sc.autoscaler is not None and sc.autoscaler.enabled:
        sc = sc.model_copy(update={"autoscaler": None})  # the starting counts are what gets launched
    b = build(sc, engine_calibration=False)
    dep, p, d = b.deployment, sc.prefill, sc.decode

    local = {}  # global GPU id -> its index among its host's GPUs
    for h in set(dep.gpu_host.values()):
        for i, x in enumerate(sorted(x for x, hx in dep.gpu_host.items() if hx == h)):
            local[x] = i

    def group(g, role, tp, ep) -> Group:
        hosts = tuple(sorted({dep.gpu_host[x] for x in g.gpus}))
        n = len(g.gpus)
        per_host = tuple(tuple(sorted(local[x] for x in g.gpus if dep.gpu_host[x] == h)) for h in hosts)
        return Group(g.id, role, hosts, n // len(hosts), tp, ep, max(1, n // tp), per_host)

    src = model_path_of(sc, b.model)
    dr = sc.mtp.draft
    kind, dmodel = (dr.kind, getattr(dr, "model", None)) if dr is not None else ("mtp", None)
    if sc.deployment == "aggregated":
        a = sc.aggregated
        return Plan(sc.name, src, sc.weight_format, sc.kv_dtype, (), (), a.max_batch_tokens, a.max_batch_per_rank,
                    a.page_tokens, sc.mtp.draft_k, bool(b.model.n_mtp_layers), kind, dmodel,
                    aggregated=tuple(group(g, "aggregated", a.tp, a.ep) for g in dep.aggregated),
                    chunk_tokens=a.chunk_tokens)
    return Plan(sc.name, src, sc.weight_format, sc.kv_dtype,
                tuple(group(g, "prefill", p.tp, p.ep) for g in dep.prefillers),
                tuple(group(g, "decode", d.tp, d.ep) for g in dep.decoders),
                p.max_batch_tokens, d.max_batch_per_rank, d.page_tokens, sc.mtp.draft_k, bool(b.model.n_mtp_layers),
                kind, dmodel, n_experts=b.model.n_experts, decode_redundant_experts=d.redundant_experts,
                prefill_overlap=p.overlap, decode_overlap=d.overlap, decode_moe_comm=d.moe_comm)


def model_path_of(sc, model) -> str:
    """The default checkpoint (``${MODEL_PATH}``): a preset's Hugging Face id (the first word of its ``source``),
    else the checkpoint folder as the scenario gives it: the ``model`` path itself when it names a folder, the
    folder that holds it when it names a ``.json`` file (a config.json; the engines load a folder or a hub id,
    never the config file). The text is kept as written (a path may hold spaces)."""
    from rackbed.engine.core.model import PRESET_NAMES

    source = model.source or ""
    if sc.model in PRESET_NAMES:
        return source.split()[0] if "/" in source else sc.model
    if sc.model.lower().endswith(".json"):
        return os.path.dirname(sc.model) or "."
    return sc.model


#: Unicode categories no text written by emit may hold: controls (newline, carriage return, NUL ...), format
#: characters (bidirectional overrides, zero-width marks), surrogates, line and paragraph separators
REFUSED_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp"})


def check_text(field: str, value: str, source: str | Path | None = None) -> None:
    """One-line :class:`UserError` when ``value`` (the scenario's ``field``) holds a character of
    :data:`REFUSED_CATEGORIES`: such text has no business in a name or a path, and in a launch file it would end a
    comment or a line."""
    for c in value:
        if unicodedata.category(c) in REFUSED_CATEGORIES:
            shown = repr(value if len(value) <= 60 else value[:57] + "...")
            raise UserError(f"{f'{source}: ' if source else ''}{field}: {shown} holds {c!r}, a control or "
                            "line-break character; rackbed emit writes this field into launch files and refuses it")


def check_emittable(sc, source: str | Path | None = None) -> None:
    """Refuse (:func:`check_text`) the scenario text that reaches the emitted files: ``name``, ``model`` and a
    draft model's ``mtp.draft.model``. Everything else written is rackbed's own (numbers, validated names)."""
    check_text("name", sc.name, source)
    check_text("model", sc.model, source)
    dmodel = getattr(sc.mtp.draft, "model", None)
    if dmodel is not None:
        check_text("mtp.draft.model", dmodel, source)


def unmapped(sc, engine: str, pl: Plan) -> list[str]:
    """Settings of the scenario the engine's files cannot express (one comment line each, saying what the
    difference costs in rackbed's own model where it has a price)."""
    notes = []
    e = sc.mtp.expected_tokens_per_step() if pl.draft_k else 1.0
    if pl.draft_k and pl.draft_kind == "model":
        notes.append(f"draft model {pl.draft_model} (mtp.draft), draft_k={pl.draft_k}: its checkpoint is "
                     "${DRAFT_MODEL_PATH}")
    elif engine == "trtllm" and pl.draft_k and not pl.model_has_mtp:
        notes.append(f"MTP draft_k={pl.draft_k} (a trained MTP head): TensorRT-LLM's MTP needs the checkpoint's own "
                     f"MTP layers, which {pl.model_id} lacks; decode runs without drafting: rackbed priced "
                     f"{e:.2f} tokens per sequence per step, so TPOT rises up to {e:.2f}x")
    elif pl.draft_k and not pl.model_has_mtp:
        notes.append(f"MTP draft_k={pl.draft_k}: {pl.model_id} has no MTP layers; the trained MTP head the scenario "
                     "drafts with runs as an EAGLE draft from ${DRAFT_MODEL_PATH} (without one: no drafting, TPOT "
                     f"up to {e:.2f}x rackbed's)")
    if pl.draft_k:
        curve = f"curve {list(sc.mtp.acceptance[:pl.draft_k])}" if sc.mtp.acceptance else f"{sc.mtp.accept_p}"
        notes.append(f"MTP acceptance {curve} is a simulation input (rackbed priced {e:.2f} tokens per step): the "
                     "engine's measured acceptance sets the real TPOT")
    q, rep = ((sc.aggregated.max_queue_requests, sc.aggregated.kv_replication) if pl.is_aggregated else
              (sc.prefill.max_queue_requests, sc.prefill.kv_replication))
    role = "aggregated" if pl.is_aggregated else "prefill"
    if not pl.is_aggregated:
        notes.append(f"prefill kv_streams={sc.prefill.kv_streams}: no flag; the transfer backend sets its own "
                     "concurrency (rackbed's KV-transfer time, part of TTFT, assumes this many streams per prefiller)")
        if engine == "sglang" and sc.sim.policies.prefiller == "least_queued_tokens":
            notes.append(f"prefiller pick least_queued_tokens: the router has no queued-token policy; {ROUTER_POLICY} "
                         "balances by load, so prefill queueing (TTFT) can exceed rackbed's")
    if q is not None:
        notes.append(f"{role} max_queue_requests={q}: no flag; the router queues")
    if rep:
        notes.append(f"{role} kv_replication={rep}: the engine replicates KV heads itself")
    if sc.sim.policies.model_dump() != type(sc.sim.policies)().model_dump():
        notes.append(f"scheduler policies {sc.sim.policies.model_dump()}: no equivalent; the engine's own apply")
    if engine in ("sglang", "dynamo", "k8s") and sc.weight_format not in SGLANG_QUANT:
        notes.append(f"weight_format {sc.weight_format}: no --quantization value; a checkpoint not quantised so runs "
                     "other GEMMs and memory than rackbed priced")
    if engine == "trtllm" and pl.is_aggregated and pl.chunk_tokens is not None:
        notes.append(f"aggregated chunk_tokens={pl.chunk_tokens}: TensorRT-LLM chunks a prompt by max_num_tokens "
                     f"({pl.prefill_tokens})")
    if engine == "trtllm" and pl.is_aggregated and len(pl.aggregated) > 1:
        notes.append(f"{len(pl.aggregated)} workers: trtllm-serve has no router over aggregated servers; put an HTTP "
                     "load balancer in front (or use the Dynamo graph)")
    if engine == "trtllm" and not pl.is_aggregated:
        notes.append(f"a prefill batch is capped by tokens only ({sc.prefill.max_batch_tokens}): the context "
                     "servers' max_batch_size is set to that budget")
    if engine == "trtllm" and any(g.dp > 1 and g.ep > 1 for g in (*pl.decode, *pl.aggregated)):
        notes.append("DP-EP MoE exchange: no backend option for it at the pinned TensorRT-LLM "
                     "(moe_config.backend has no wide-EP value); the engine picks the MoE backend and its "
                     "token exchange, which may cost other than the sparse all-to-all rackbed priced")
    if engine == "trtllm" and sc.weight_format != "bf16":
        notes.append(f"weight_format {sc.weight_format}: TensorRT-LLM reads it from the checkpoint; one not quantised "
                     "so runs other GEMMs and memory than rackbed priced")
    if sc.autoscaler is not None and sc.autoscaler.enabled:
        notes.append("autoscaler: not emitted; the files launch the starting group counts")
    notes += _overlap_notes(engine, pl)
    return notes


def _overlap_notes(engine: str, pl: Plan) -> list[str]:
    """What of the priced compute / communication overlap an engine's files cannot switch on."""
    out = []
    for role, groups in (("prefill", pl.prefill), ("decode", pl.decode)):
        mode = pl.prefill_overlap if role == "prefill" else pl.decode_overlap
        if mode == "none" or not groups:
            continue
        if engine == "trtllm":
            out.append(f"{role}.overlap {mode}: the LLM API options here set no {mode.replace('_', '-')} "
                       f"overlap; the servers run their own schedule, so the {role} step can be longer than "
                       "rackbed's overlapped one")
        elif not sglang_overlap(pl, groups[0]):
            out.append(f"{role}.overlap {mode}: SGLang overlaps only an all-to-all MoE exchange and these "
                       f"groups have none (--moe-a2a-backend none); they run without it, so the {role} step "
                       "can be longer than rackbed's overlapped one")
    return out


# ------------------------------------------------------------------------------------------------ SGLang


def sglang_args(pl: Plan, g: Group) -> list[str]:
    """``sglang.launch_server`` arguments of a group (no host, port, GPU pinning or node placement), in the flag
    names of the pinned SGLang (:data:`SGLANG_VERSION`; ``tests/test_emit_flags.py`` parses them with its
    parser)."""
    a = ["--model-path", "${MODEL_PATH}"]
    if g.role != "aggregated":
        a += ["--disaggregation-mode", g.role, "--disaggregation-transfer-backend", TRANSFER_BACKEND]
    a += ["--tp-size", str(g.n_gpus)]
    if g.dp > 1:  # attention data parallelism: g.dp ranks of attention TP g.tp
        a += ["--attn-dp-size", str(g.dp)]
    if g.ep > 1:
        a += ["--ep-size", str(g.ep), *sglang_moe_a2a(g, pl.decode_moe_comm)]
    if g.role == "decode" and pl.decode_redundant_experts:
        # wide EP: the redundant expert slots (EPLB places and rebalances them)
        a += ["--ep-num-redundant-experts", str(pl.decode_redundant_experts), "--enable-eplb"]
    a += sglang_overlap(pl, g)
    a += ["--page-size", str(pl.page_tokens),
          "--kv-cache-dtype", "fp8_e4m3" if pl.kv_dtype == "fp8" else "auto"]
    quant = SGLANG_QUANT.get(pl.weight_format)
    if quant:
        a += ["--quantization", quant]
    if g.role == "prefill":
        a += ["--chunked-prefill-size", str(pl.prefill_tokens), "--max-prefill-tokens", str(pl.prefill_tokens)]
    if g.role == "aggregated":  # chunks of one prompt within a per-rank step budget of prompt + decode tokens
        a += ["--chunked-prefill-size", str(pl.chunk_tokens or pl.prefill_tokens),
              "--max-prefill-tokens", str(pl.prefill_tokens)]
    if g.role != "prefill":
        a += ["--max-running-requests", str(pl.decode_batch_per_rank * g.dp),
              "--cuda-graph-max-bs-decode", str(pl.decode_batch_per_rank)]
        if pl.draft_k:
            a += ["--speculative-algorithm", sglang_speculative_algorithm(pl),
                  "--speculative-num-steps", str(pl.draft_k),
                  "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", str(pl.draft_k + 1)]
            if pl.draft_kind == "model" or not pl.model_has_mtp:
                a += ["--speculative-draft-model-path", "${DRAFT_MODEL_PATH}"]
    return a


def sglang_moe_a2a(g: Group, decode_moe_comm: str = "a2a") -> list[str]:
    """The MoE token exchange rackbed priced for an EP group, as SGLang's flags: DP-attention ranks (decoders,
    aggregated DP ranks) exchange tokens by a sparse all-to-all (``sim.costs.moe_comm``: DP-EP dispatch /
    combine, DeepEP-style; ``low_latency`` kernels for decode, ``auto`` for mixed prefill + decode steps); a TP
    group (prefillers, an aggregated TP worker) holds every token on every rank, selects its experts' tokens
    locally and all-reduces the outputs: no all-to-all (``none``). A decoder priced with ``decode.moe_comm:
    allgather`` gathers its DP ranks' tokens and scatters the outputs back, as SGLang's DP attention does
    without an all-to-all backend (``none``)."""
    if g.role == "decode" and decode_moe_comm == "allgather":
        return ["--moe-a2a-backend", "none"]
    if g.dp > 1:
        return ["--moe-a2a-backend", "deepep", "--deepep-mode", "low_latency" if g.role == "decode" else "auto"]
    return ["--moe-a2a-backend", "none"]


#: SGLang's switch for each overlap mode rackbed prices (``sim.costs.overlap``)
SGLANG_OVERLAP = {"two_batch": "--enable-two-batch-overlap", "shared_expert": "--enable-single-batch-overlap"}


def _overlap_of(pl: Plan, g: Group) -> str:
    return {"prefill": pl.prefill_overlap, "decode": pl.decode_overlap}.get(g.role, "none")


def sglang_overlap(pl: Plan, g: Group) -> list[str]:
    """The overlap a group's role was priced with, as SGLang's switch: two-batch or single-batch overlap. Both
    overlap the all-to-all, so SGLang takes them only with an all-to-all MoE backend (DeepEP: DP-attention
    groups); a group without one (a TP=EP prefiller) gets nothing and :func:`unmapped` says so."""
    mode = _overlap_of(pl, g)
    if mode == "none" or g.dp <= 1 or g.ep <= 1 or sglang_moe_a2a(g, pl.decode_moe_comm)[1] == "none":
        return []
    return [SGLANG_OVERLAP[mode]]


def sglang_speculative_algorithm(pl: Plan) -> str:
    """``NEXTN``: the model's own MTP layers; ``EAGLE``: a trained MTP head the checkpoint lacks, loaded as a draft
    (``--speculative-draft-model-path``); ``STANDALONE``: a separate small draft model."""
    if pl.draft_kind == "model":
        return "STANDALONE"
    return "NEXTN" if pl.model_has_mtp else "EAGLE"


def _sglang_lines(pl: Plan) -> list[str]:
    lines = []
    for role, groups in (("prefill", pl.prefill), ("decode", pl.decode)):
        for i, g in enumerate(groups):
            port = (PREFILL_PORT if role == "prefill" else DECODE_PORT) + i
            head = _host(g.hosts[0])
            for rank, h in enumerate(g.hosts):
                lines.append(_comment(f"{g.id}: {role}, {g.n_gpus} GPUs (attention TP={g.tp} x DP={g.dp}, EP={g.ep}), "
                                      f"node {rank} of {len(g.hosts)}: run on {_host(h)}"))
                a = [pin(g, rank), "python", "-m", "sglang.launch_server", *sglang_args(pl, g),
                     "--host", "0.0.0.0", "--port", str(port)]
                if role == "prefill":
                    a += ["--disaggregation-bootstrap-port", str(BOOTSTRAP_PORT + i)]
                if len(g.hosts) > 1:
                    a += ["--nnodes", str(len(g.hosts)), "--node-rank", str(rank),
                          "--dist-init-addr", f"{head}:{DIST_PORT + i + (100 if role == 'decode' else 0)}"]
                lines.append(_shell(a))
    router = ["python", "-m", "sglang_router.launch_router", "--pd-disaggregation"]
    for i, g in enumerate(pl.prefill):
        router += ["--prefill", f"http://{_host(g.hosts[0])}:{PREFILL_PORT + i}", str(BOOTSTRAP_PORT + i)]
    for i, g in enumerate(pl.decode):
        router += ["--decode", f"http://{_host(g.hosts[0])}:{DECODE_PORT + i}"]
    router += ["--prefill-policy", ROUTER_POLICY, "--decode-policy", ROUTER_POLICY, "--host", "0.0.0.0",
               "--port", str(ROUTER_PORT)]
    return [*lines, _comment("the PD router (the OpenAI-compatible endpoint)"), _shell(router)]


def _sglang_agg_lines(pl: Plan) -> list[str]:
    lines, urls = [], []
    for i, g in enumerate(pl.aggregated):
        head = _host(g.hosts[0])
        urls.append(f"http://{head}:{DECODE_PORT + i}")
        for rank, h in enumerate(g.hosts):
            lines.append(_comment(f"{g.id}: aggregated, {g.n_gpus} GPUs (attention TP={g.tp} x DP={g.dp}, EP={g.ep}), "
                                  f"node {rank} of {len(g.hosts)}: run on {_host(h)}"))
            a = [pin(g, rank), "python", "-m", "sglang.launch_server", *sglang_args(pl, g), "--host", "0.0.0.0",
                 "--port", str(DECODE_PORT + i)]
            if len(g.hosts) > 1:
                a += ["--nnodes", str(len(g.hosts)), "--node-rank", str(rank),
                      "--dist-init-addr", f"{head}:{DIST_PORT + i}"]
            lines.append(_shell(a))
    router = ["python", "-m", "sglang_router.launch_router", "--worker-urls", *urls, "--policy", ROUTER_POLICY,
              "--host", "0.0.0.0", "--port", str(ROUTER_PORT)]
    return [*lines, _comment("the router over the workers (the OpenAI-compatible endpoint)"), _shell(router)]


#: the variables an emitted argument may leave to the shell (``${HOST_<n>}``, the checkpoints); nothing else expands
PLACEHOLDER = re.compile(r"\$\{(?:HOST_\d+|MODEL_PATH|DRAFT_MODEL_PATH)\}")
_PLAIN = re.compile(r"[\w@%+=:,./-]*", re.ASCII)  # what shlex.quote leaves bare (nothing special in "...")


def pin(g: Group, rank: int) -> str:
    """The shell assignment that pins the server of ``g`` on its ``rank``-th host to that host's GPUs of the
    group (``CUDA_VISIBLE_DEVICES``: the server numbers them from 0, so two servers on one host never share
    one)."""
    return "CUDA_VISIBLE_DEVICES=" + ",".join(map(str, g.local_gpus[rank]))


def _pins(g: Group) -> list[str]:
    """The pinning of a one-host server (:func:`pin`); none for an MPI job across hosts (its launcher places the
    ranks: the comment above the line says so)."""
    return [pin(g, 0)] if len(g.hosts) == 1 else []


def _host(h: int) -> str:
    return f"${{HOST_{int(h)}}}"


def _sh(text: str) -> str:
    """``text`` as one shell word that is exactly ``text`` (single quotes: ``$``, backticks, newlines are inert)."""
    if "\0" in text:
        raise UserError(f"{text!r}: a NUL character cannot be written into a shell script")
    return shlex.quote(text)


def _shell_word(arg: str) -> str:
    """One argument as a shell word: quoted, except its :data:`PLACEHOLDER` variables, which stay expandable (in
    double quotes: a value with spaces stays one argument)."""
    holes = PLACEHOLDER.findall(arg)
    if not holes:
        return _sh(arg)
    texts = PLACEHOLDER.split(arg)
    if all(_PLAIN.fullmatch(t) for t in texts):  # nothing else special: the whole word in double quotes
        return f'"{arg}"'
    out = [_sh(t) if t else "" for t in texts[:1]]
    for hole, t in zip(holes, texts[1:], strict=True):
        out += [f'"{hole}"', _sh(t) if t else ""]
    return "".join(out)


def _shell(args: list[str]) -> str:
    """One shell command line (:func:`_shell_word` each argument)."""
    return " ".join(_shell_word(a) for a in args)


def _comment(text: str) -> str:
    """``text`` as one ``#`` comment line of a shell script or a YAML file: every character that is not printable
    (a line break of either language, a control, a format character) is written as its Python escape (``\\n``),
    so that no text ends the comment and starts a command or a YAML key."""
    return "# " + "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _comments(notes: list[str]) -> str:
    """The ``# no equivalent:`` lines of the settings an engine cannot express (:func:`unmapped`)."""
    return "".join(_comment(f"no equivalent: {n}") + "\n" for n in notes)


def _script(pl: Plan, notes: list[str], lines: list[str]) -> str:
    """``launch.sh``: the title, the checkpoint (``MODEL_PATH`` if set, else the model: a quoted default, so that
    no text of it runs), the settings without a flag, then ``lines``."""
    shape = (f"{len(pl.aggregated)} aggregated workers" if pl.is_aggregated else
             f"{len(pl.prefill)} prefill + {len(pl.decode)} decode groups")
    title = _comment(f"{pl.name}: {shape} (emitted by `rackbed emit`). "
                     "Run each command on the host it names; set HOST_<n> to the topology's hosts.")
    head = ["#!/usr/bin/env bash", title, f'[ -n "${{MODEL_PATH:-}}" ] || MODEL_PATH={_sh(pl.model_id)}']
    return "\n".join(head) + "\n" + _comments(notes) + "\n" + "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------ TensorRT-LLM


def trtllm_options(pl: Plan, role: str) -> dict:
    """The LLM API options (``--extra_llm_api_options``) of the context (prefill) or generation (decode) servers."""
    g = (pl.prefill if role == "prefill" else pl.decode)[0]
    kv = {"dtype": "fp8" if pl.kv_dtype == "fp8" else "auto", "tokens_per_block": pl.page_tokens}
    o = {"tensor_parallel_size": g.n_gpus, "moe_expert_parallel_size": g.ep, "enable_attention_dp": g.dp > 1,
         "kv_cache_config": kv, "cache_transceiver_config": {"backend": TRTLLM_TRANSFER_BACKEND}}
    if role == "prefill":
        # rackbed caps a prefill batch by tokens only; one token per request is the equivalent request cap
        o.update(max_num_tokens=pl.prefill_tokens, max_batch_size=pl.prefill_tokens, disable_overlap_scheduler=True)
    else:
        o.update(max_batch_size=pl.decode_batch_per_rank,
                 max_num_tokens=pl.decode_batch_per_rank * (pl.draft_k + 1))
        # DP-EP decode is attention DP with EP; the pinned MoeConfig has no wide-EP backend value, so the
        # engine picks the MoE backend and its token exchange (:func:`unmapped` names the difference)
        if pl.decode_redundant_experts:   # wide EP: expert slots = experts + redundant copies, load-balanced
            o["moe_config"] = {"load_balancer": {"num_slots": pl.n_experts + pl.decode_redundant_experts,
                                                 "layer_updates_per_iter": 1}}
        spec = trtllm_speculative(pl)
        if spec:
            o["speculative_config"] = spec
    return o


def trtllm_speculative(pl: Plan) -> dict | None:
    """TensorRT-LLM's ``speculative_config``: ``MTP`` only for a model with MTP layers (its MTP serves
    DeepSeek-style checkpoints), ``Draft_Target`` for a draft model (``speculative_model``); nothing for a
    trained MTP head the checkpoint lacks (:func:`unmapped` says what that costs). The draft length is
    ``max_draft_len`` for both: the pinned ``MTPDecodingConfig`` reads the older ``num_nextn_predict_layers``
    only as a deprecated alias of it."""
    if not pl.draft_k:
        return None
    if pl.draft_kind == "model":
        return {"decoding_type": "Draft_Target", "max_draft_len": pl.draft_k,
                "speculative_model": "${DRAFT_MODEL_PATH}"}
    if pl.model_has_mtp:
        return {"decoding_type": "MTP", "max_draft_len": pl.draft_k}
    return None


def trtllm_agg_options(pl: Plan) -> dict:
    """The LLM API options of an aggregated worker (``trtllm-serve`` without disaggregation): per-rank batch cap
    and step token budget, chunked prefill on."""
    g = pl.aggregated[0]
    o = {"tensor_parallel_size": g.n_gpus, "moe_expert_parallel_size": g.ep, "enable_attention_dp": g.dp > 1,
         "max_batch_size": pl.decode_batch_per_rank, "max_num_tokens": pl.prefill_tokens,
         "enable_chunked_prefill": pl.chunk_tokens is not None,
         "kv_cache_config": {"dtype": "fp8" if pl.kv_dtype == "fp8" else "auto", "tokens_per_block": pl.page_tokens}}
    spec = trtllm_speculative(pl)
    if spec:
        o["speculative_config"] = spec
    return o


def _trtllm_agg_files(pl: Plan, notes: list[str]) -> dict[str, str]:
    lines = []
    for i, g in enumerate(pl.aggregated):
        lines.append(_comment(f"{g.id}: aggregated, {g.n_gpus} GPUs on hosts {', '.join(map(_host, g.hosts))}"
                              + (" (one MPI job across the nodes, e.g. srun/mpirun with trtllm-llmapi-launch)"
                                 if len(g.hosts) > 1 else "")))
        lines.append(_shell([*_pins(g), "trtllm-serve", "${MODEL_PATH}", "--host", "0.0.0.0",
                             "--port", str(DECODE_PORT + i),
                             "--backend", "pytorch", "--tp_size", str(g.n_gpus), "--ep_size", str(g.ep),
                             "--extra_llm_api_options", "agg.yaml"]))
    return {"agg.yaml": _comments(notes) + yaml.safe_dump(trtllm_agg_options(pl), sort_keys=False),
            "launch.sh": _script(pl, notes, lines)}


def _trtllm_files(pl: Plan, notes: list[str]) -> dict[str, str]:
    opts = {r: trtllm_options(pl, r) for r in ("prefill", "decode")}
    servers = {}
    for key, role, groups, port in (("context_servers", "prefill", pl.prefill, PREFILL_PORT),
                                    ("generation_servers", "decode", pl.decode, DECODE_PORT)):
        servers[key] = {"num_instances": len(groups), **opts[role],
                        "urls": [f"{_host(g.hosts[0])}:{port + i}" for i, g in enumerate(groups)]}
    disagg = {"hostname": "0.0.0.0", "port": ROUTER_PORT, "backend": "pytorch", **servers}
    lines = []
    for role, groups, port, f in (("prefill", pl.prefill, PREFILL_PORT, "ctx.yaml"),
                                  ("decode", pl.decode, DECODE_PORT, "gen.yaml")):
        for i, g in enumerate(groups):
            lines.append(_comment(f"{g.id}: {role}, {g.n_gpus} GPUs on hosts {', '.join(map(_host, g.hosts))}"
                                  + (" (one MPI job across the nodes, e.g. srun/mpirun with trtllm-llmapi-launch)"
                                     if len(g.hosts) > 1 else "")))
            lines.append(_shell([*_pins(g), "trtllm-serve", "${MODEL_PATH}", "--host", "0.0.0.0",
                                 "--port", str(port + i),
                                 "--backend", "pytorch", "--tp_size", str(g.n_gpus), "--ep_size", str(g.ep),
                                 "--extra_llm_api_options", f]))
    lines += [_comment("the disaggregated front end"), _shell(["trtllm-serve", "disaggregated", "-c", "disagg.yaml"])]
    comment = _comments(notes)
    return {"ctx.yaml": comment + yaml.safe_dump(opts["prefill"], sort_keys=False),
            "gen.yaml": comment + yaml.safe_dump(opts["decode"], sort_keys=False),
            "disagg.yaml": comment + yaml.safe_dump(disagg, sort_keys=False),
            "launch.sh": _script(pl, notes, lines)}


# ------------------------------------------------------------------------------------------------ Dynamo


def _dynamo_graph(pl: Plan, notes: list[str]) -> str:
    name = dns_label(pl.name)
    services: dict = {"Frontend": {"componentType": "frontend", "replicas": 1, "extraPodSpec": {"mainContainer": {
        "image": "${DYNAMO_IMAGE}", "command": ["python3", "-m", "dynamo.frontend"]}}}}
    for label, groups in (("Prefill", pl.prefill), ("Decode", pl.decode), ("", pl.aggregated)):
        if not groups:
            continue
        g = groups[0]
        sub = {} if g.role == "aggregated" else {"subComponentType": g.role}
        svc = {"componentType": "worker", **sub, "replicas": len(groups),
               "resources": {"limits": {"gpu": str(g.gpus_per_host)}},
               "extraPodSpec": {"mainContainer": {"image": "${DYNAMO_IMAGE}",
                                                  "command": ["python3", "-m", "dynamo.sglang"],
                                                  "args": sglang_args(pl, g)}}}
        if len(g.hosts) > 1:
            svc["multinode"] = {"nodeCount": len(g.hosts)}
        services[f"SGLang{label}Worker"] = svc
    doc = {"apiVersion": "nvidia.com/v1alpha1", "kind": "DynamoGraphDeployment", "metadata": {"name": name},
           "spec": {"services": services}}
    kind = "aggregated" if pl.is_aggregated else "disaggregated"
    return (_comment(f"{pl.name} as a Dynamo {kind} graph on the SGLang backend (emitted by `rackbed emit`); set "
                     f"${{DYNAMO_IMAGE}} and ${{MODEL_PATH}} (e.g. {pl.model_id})") + "\n" + _comments(notes)
            + yaml.safe_dump(doc, sort_keys=False))


def dns_label(name: str) -> str:
    """A Kubernetes object name from a scenario name: lower case, every character but ``a-z`` / ``0-9`` a ``-``,
    no ``-`` at either end, at most 63 characters (an RFC 1123 label); ``rackbed`` when nothing is left."""
    label = "".join(c if c in "abcdefghijklmnopqrstuvwxyz0123456789" else "-" for c in name.lower())
    return label.strip("-")[:63].rstrip("-") or "rackbed"


# ------------------------------------------------------------------------------------------------ Kubernetes

#: the label every object of the plain Kubernetes form carries (and the prefix of its names)
K8S_APP = "rackbed"
POD_INDEX = "$(POD_INDEX)"  # Kubernetes expands $(VAR) in a container's args from its env


def _k8s_server(pl: Plan, g: Group, port: int, extra: list[str], dist_port: int) -> list[dict]:
    """A headless Service and a StatefulSet of one group: one pod per host it spans (``replicas``), each asking
    the device plugin for the group's GPUs on that host (``nvidia.com/gpu``: two pods on one node never share a
    GPU), on the host network (the RDMA NICs of the KV transfer; every server has its own ports)."""
    name = f"{K8S_APP}-{dns_label(g.id)}"
    n = len(g.hosts)
    args = [*sglang_args(pl, g), "--host", "0.0.0.0", "--port", str(port), *extra]
    env = []
    if n > 1:
        args += ["--nnodes", str(n), "--node-rank", POD_INDEX, "--dist-init-addr", f"{name}-0.{name}:{dist_port}"]
        env = [{"name": "POD_INDEX", "valueFrom": {"fieldRef": {
            "fieldPath": "metadata.labels['apps.kubernetes.io/pod-index']"}}}]
    labels = {"app.kubernetes.io/part-of": K8S_APP, "app.kubernetes.io/name": name}
    container = {"name": "sglang", "image": "${SGLANG_IMAGE}", "command": ["python3", "-m", "sglang.launch_server"],
                 "args": args, **({"env": env} if env else {}),
                 "ports": [{"containerPort": port, "name": "http"}],
                 "resources": {"limits": {"nvidia.com/gpu": str(g.gpus_per_host)}},
                 "securityContext": {"capabilities": {"add": ["IPC_LOCK"]}},
                 "volumeMounts": [{"name": "shm", "mountPath": "/dev/shm"}]}
    pod = {"hostNetwork": True, "dnsPolicy": "ClusterFirstWithHostNet", "containers": [container],
           "volumes": [{"name": "shm", "emptyDir": {"medium": "Memory"}}]}
    service = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "labels": labels},
               "spec": {"clusterIP": "None", "selector": labels,
                        "ports": [{"name": "http", "port": port, "targetPort": port}]}}
    sts = {"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": {"name": name, "labels": labels},
           "spec": {"serviceName": name, "replicas": n, "podManagementPolicy": "Parallel",
                    "selector": {"matchLabels": labels},
                    "template": {"metadata": {"labels": labels}, "spec": pod}}}
    return [service, sts]


def k8s_items(pl: Plan) -> list[dict]:
    """The plain Kubernetes form of the deployment: per group a headless Service and a StatefulSet running the
    ``sglang`` arguments, and the router as a Deployment behind a Service (the endpoint)."""
    items, router = [], ["python3", "-m", "sglang_router.launch_router"]
    url = "http://{0}-0.{0}:{1}".format
    if pl.is_aggregated:
        urls = []
        for i, g in enumerate(pl.aggregated):
            items += _k8s_server(pl, g, DECODE_PORT + i, [], DIST_PORT + i)
            urls.append(url(f"{K8S_APP}-{dns_label(g.id)}", DECODE_PORT + i))
        router += ["--worker-urls", *urls, "--policy", ROUTER_POLICY]
    else:
        router.append("--pd-disaggregation")
        for i, g in enumerate(pl.prefill):
            items += _k8s_server(pl, g, PREFILL_PORT + i, ["--disaggregation-bootstrap-port", str(BOOTSTRAP_PORT + i)],
                                 DIST_PORT + i)
            router += ["--prefill", url(f"{K8S_APP}-{dns_label(g.id)}", PREFILL_PORT + i), str(BOOTSTRAP_PORT + i)]
        for i, g in enumerate(pl.decode):
            items += _k8s_server(pl, g, DECODE_PORT + i, [], DIST_PORT + 100 + i)
            router += ["--decode", url(f"{K8S_APP}-{dns_label(g.id)}", DECODE_PORT + i)]
        router += ["--prefill-policy", ROUTER_POLICY, "--decode-policy", ROUTER_POLICY]
    router += ["--host", "0.0.0.0", "--port", str(ROUTER_PORT)]
    name = f"{K8S_APP}-router"
    labels = {"app.kubernetes.io/part-of": K8S_APP, "app.kubernetes.io/name": name}
    items.append({"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": name, "labels": labels},
                  "spec": {"replicas": 1, "selector": {"matchLabels": labels}, "template": {
                      "metadata": {"labels": labels}, "spec": {"containers": [{
                          "name": "router", "image": "${SGLANG_IMAGE}", "command": router[:3], "args": router[3:],
                          "ports": [{"containerPort": ROUTER_PORT, "name": "http"}]}]}}}})
    items.append({"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "labels": labels},
                  "spec": {"selector": labels, "ports": [{"name": "http", "port": ROUTER_PORT,
                                                          "targetPort": ROUTER_PORT}]}})
    return items


def _k8s_file(pl: Plan, notes: list[str]) -> str:
    kind = "aggregated" if pl.is_aggregated else "disaggregated"
    doc = {"apiVersion": "v1", "kind": "List", "items": k8s_items(pl)}
    return (_comment(f"{pl.name} as plain Kubernetes objects, {kind} SGLang servers (emitted by `rackbed emit`): "
                     "StatefulSets per group, the router a Deployment; set ${SGLANG_IMAGE} and ${MODEL_PATH} "
                     f"(e.g. {pl.model_id}), then kubectl apply -f k8s.yaml") + "\n" + _comments(notes)
            + yaml.safe_dump(doc, sort_keys=False))


# ------------------------------------------------------------------------------------------------ entry points


def emit_files(sc, engine: str, source: str | Path | None = None) -> dict[str, str]:
    """``{file name: text}`` of the launch settings of ``sc`` for ``engine`` (module docstring). Text a launch file
    cannot carry is refused first (:func:`check_emittable`; ``source``, the scenario file, prefixes the error)."""
    if engine not in ENGINES:
        raise UserError(f"--engine {engine}: unknown engine; one of {', '.join(ENGINES)}")
    check_emittable(sc, source)
    return render(sc, plan_of(sc), engine)


def render(sc, pl: Plan, engine: str) -> dict[str, str]:
    """The files of :func:`emit_files` from ``sc``'s plan ``pl``. Every text is quoted for where it lands,
    whatever it holds: a shell word (single quotes), a ``#`` comment line (non-printable characters escaped), a
    YAML value (``yaml.safe_dump``)."""
    notes = unmapped(sc, engine, pl)
    if engine == "sglang":
        return {"launch.sh": _script(pl, notes, _sglang_agg_lines(pl) if pl.is_aggregated else _sglang_lines(pl))}
    if engine == "trtllm":
        return _trtllm_agg_files(pl, notes) if pl.is_aggregated else _trtllm_files(pl, notes)
    if engine == "k8s":
        return {"k8s.yaml": _k8s_file(pl, notes)}
    return {"graph.yaml": _dynamo_graph(pl, notes)}


def write_emit(sc, engine: str, out: str | Path, source: str | Path | None = None) -> list[Path]:
    """Write :func:`emit_files` into ``out`` (created); returns the paths. ``rackbed emit`` and, with the
    configuration it chose, ``rackbed search`` call this."""
    files = emit_files(sc, engine, source)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, text in files.items():
        p = write_text(out / name, text)
        if name.endswith(".sh"):
            p.chmod(0o755)
        paths.append(p)
    return paths
