"""What a real run is made of, derived from a built scenario: its process groups, each rank's ``RankSpec``, the
torch model's config, the KV capacities the scheduler plans with, and the prefilling ranks' prefix caches. Pure
functions of the scenario (every torchrun process computes the same tables); ``engine.real.driver`` runs them.

Gated DeltaNet models (Qwen3.5): an aggregated rank keeps one recurrent-state slot per request it may hold
(``max_batch_per_rank``, the scheduler's cap on a rank's requests), and those slots' bytes come out of the rank's
KV budget: ``real.decode_pages`` pages of the full-attention layers' KV, of which :func:`state_pages` go to the
state pool; the cache and the scheduler's KV capacity get the rest (:func:`gdn_rank_budget`). (The pool's one
scratch slot, which the padding rows of graph-replayed steps step, is not counted in it.) Disaggregated
deployments and prefix caching are refused for these models (:func:`check_gdn`): the state does not travel with
the KV transfer, and a cached prefix would need the state at the prefix's end."""

from __future__ import annotations

from pathlib import Path

from rackbed.topology.errors import UserError


def deployment_groups(dep) -> list[tuple[str, tuple[int, ...], str]]:
    """``(group id, GPUs, role)`` of every group, prefillers first — the order every rank creates groups in."""
    return [(g.id, tuple(g.gpus), "prefill") for g in dep.prefillers] + \
        [(g.id, tuple(g.gpus), "decode") for g in dep.decoders] + \
        [(g.id, tuple(g.gpus), "aggregated") for g in dep.aggregated]


def graph_pages(requests, page_tokens: int, draft_k: int = 0) -> tuple[int, int]:
    """Page-table widths (lo, hi) a decoder's steps can have for ``requests``: from the shortest prompt plus its
    first token to the longest prompt plus output plus a draft."""
    if not requests:
        return (0, 0)
    lo = min(-(-(r.prompt_tokens + 1) // page_tokens) for r in requests)
    hi = max(-(-(r.prompt_tokens + r.output_tokens + draft_k + 1) // page_tokens) for r in requests)
    return (lo, hi)


def real_prefix_cache(spec) -> tuple[int, int]:
    """``(blocks, block_tokens)`` of each prefilling rank's cache for a ``PrefixCacheSpec`` (``(0, 0)``: None). The
    ranks cache in their own KV pages only: lower tiers are simulated, not run."""
    if spec is None:
        return 0, 0
    if spec.lower or spec.shared is not None:
        raise UserError("prefix_cache: real mode caches in HBM only (set prefix_cache.host_gb_per_gpu: 0 and "
                        "storage_gb: 0; offload tiers are simulated only)")
    return spec.hbm_blocks, spec.block_tokens


def _cache_kw(spec) -> dict:
    """``simulate``'s prefix-cache argument (none without a cache: a loop without caches need not take it)."""
    return {"prefix_cache": spec} if spec is not None else {}


def prefix_cache_pages(built, *, prefix_blocks: int, prefix_block_tokens: int, prefill_pages: int,
                       decode_pages: int) -> int:
    """Pages per prefilling rank that a prefix cache of ``prefix_blocks`` blocks of ``prefix_block_tokens`` tokens
    sets aside (out of ``prefill_pages``, or ``decode_pages`` on an aggregated rank); 0 when off. Bad settings are
    a ``UserError`` naming the rule."""
    if prefix_blocks <= 0:
        return 0
    S = built.decode_plan.page_tokens
    if prefix_block_tokens < 1 or prefix_block_tokens % S:
        raise UserError(f"prefix cache: block_tokens ({prefix_block_tokens}) must be a positive multiple of "
                        f"decode.page_tokens ({S}) in real mode: a cached block is whole KV pages, shared read-only")
    n = prefix_blocks * (prefix_block_tokens // S)
    dep = built.deployment
    have = min([prefill_pages] * bool(dep.prefillers) + [decode_pages] * bool(dep.aggregated), default=prefill_pages)
    if n >= have:
        raise UserError(f"prefix cache: {prefix_blocks} blocks of {prefix_block_tokens} tokens take {n} KV pages, "
                        f"all of a rank's {have} (real.prefill_pages / real.decode_pages)")
    return n


_ELEM = {"bf16": 2, "fp16": 2, "fp32": 4}


def check_gdn(built, cfg, prefix_cache=None) -> None:
    """What the real engine does not run for a model with Gated DeltaNet layers, as one-line UserErrors:
    prefill/decode disaggregation (the recurrent state does not travel with the KV) and a prefix cache (no state
    snapshot at a prefix's end is kept)."""
    if not cfg.has_linear:
        return
    dep = built.deployment
    if dep.prefillers or dep.decoders:
        raise UserError("deployment: real mode runs Gated DeltaNet (linear-attention) models on aggregated workers "
                        "only (the recurrent state does not travel with the KV transfer; disaggregated runs are "
                        "simulated only)")
    spec = prefix_cache if prefix_cache is not None else getattr(built, "prefix_cache", None)
    if spec is not None:
        raise UserError("prefix_cache: real mode cannot reuse a cached prefix of a Gated DeltaNet (linear-attention) "
                        "model (no recurrent-state snapshot at the prefix's end is kept); remove prefix_cache")


def state_pages(cfg, dtype: str, page_tokens: int, slots: int) -> int:
    """KV pages (of the full-attention layers, ``page_tokens`` tokens each) whose bytes ``slots`` sequences'
    Gated DeltaNet state takes (``TorchModelConfig.state_bytes_per_seq``), rounded up; 0 without linear layers."""
    if not cfg.has_linear or slots <= 0:
        return 0
    eb = _ELEM[dtype]
    page = max(1, cfg.kv_bytes_per_token(eb) * page_tokens)
    return -(-slots * cfg.state_bytes_per_seq(eb) // page)


def gdn_rank_budget(built, cfg, dtype: str, decode_pages: int) -> tuple[int, int]:
    """``(state slots, pages they take)`` of each aggregated rank of a Gated DeltaNet model (``(0, 0)`` otherwise):
    one slot per request the rank may hold. A budget the slots fill is a ``UserError`` naming the field."""
    dep = built.deployment
    if not cfg.has_linear or not dep.aggregated:
        return 0, 0
    slots = dep.aggregated[0].template.max_batch_per_rank
    n = state_pages(cfg, dtype, built.decode_plan.page_tokens, slots)
    if n >= decode_pages:
        raise UserError(f"real.decode_pages: {decode_pages} pages cannot hold the Gated DeltaNet state of "
                        f"{slots} sequences (aggregated.max_batch_per_rank), which takes {n} pages' bytes")
    return slots, n


def real_capacities(dep, *, prefill_pages: int, decode_pages: int, page_tokens: int, min_prompt: int = 1):
    """``dep`` with the KV capacities the scheduler plans with set to what the real ranks hold (their caches'
    pages), not the simulated memory budget's: ``decode_pages`` pages per decoder or aggregated rank, and for a
    prefiller group ``prefill_pages`` pages per rank less the page rounding of its prompts (the scheduler counts a
    prefiller's KV in tokens, a rank allocates whole pages per prompt: a prompt of ``p >= min_prompt`` tokens takes
    at most ``p * (min_prompt + page_tokens - 1) / min_prompt`` tokens of pages)."""
    from rackbed.engine.core.deployment import with_kv_capacities

    dcap = decode_pages * page_tokens
    m = max(min_prompt, 1)
    pcap = max(1, prefill_pages * page_tokens * m // (m + page_tokens - 1))
    return with_kv_capacities(dep, prefill_tokens=pcap, rank_tokens=dcap)


def ring_seqs(n_pages: int, page_tokens: int, min_tokens: int) -> int:
    """Sliding-window rings a rank of ``n_pages`` pages needs: one per sequence it can hold at once. Every sequence
    holds at least ``ceil(min_tokens / page_tokens)`` of the pages (a prefiller's shortest prompt; on a decoder the
    shortest prompt plus its first token), so no more than ``n_pages`` over that many sequences fit; plus one for
    the graph runners' scratch sequence (a rank's decode and prefill runners share one) and one for the warm-up's. With these the rings never run out
    before the pages do: the pages stay the only capacity the scheduler plans with. The rings cost no more than
    whole pages of the sliding layers did while the shortest prompt is at least a ring long (``ring_pages`` pages);
    a run with much shorter prompts sizes more rings than that."""
    return n_pages // max(1, -(-max(min_tokens, 1) // page_tokens)) + 2


def kv_rings(built, cfg, prefill_pages: int, decode_pages: int, requests=None) -> dict:
    """The sliding-window rings of a real run's ranks: ``window``, ``ring_pages`` per sequence (per sliding layer)
    and the rings of a prefiller rank (``prefill_rings``) and of a decoder or aggregated rank (``decode_rings``),
    from the shortest of ``requests``' prompts (:func:`ring_seqs`); all 0 without sliding layers."""
    from rackbed.engine.real.model import ring_pages

    w = max(cfg.kv_windows, default=0)
    if not w:
        return {"window": 0, "ring_pages": 0, "prefill_rings": 0, "decode_rings": 0}
    S, m = built.decode_plan.page_tokens, min((r.prompt_tokens for r in requests or ()), default=1)
    dm = m if built.deployment.aggregated else m + 1         # an aggregated rank holds a prompt before its token
    return {"window": w, "ring_pages": ring_pages(w, S), "prefill_rings": ring_seqs(prefill_pages, S, m),
            "decode_rings": ring_seqs(decode_pages, S, dm)}


def rank_specs(built, cfg, gpu_rank: dict[int, int], world: int, *, use_cuda: bool, dtype: str, seed: int,
               weights: str | None, prefill_pages: int, decode_pages: int, init_file: str = "",
               backend: str = "gloo", local_device=None, requests=None, prefix_cache=None,
               mtp_agree: float | None = None) -> dict:
    """Every rank's ``RankSpec``, a pure function of the scenario and the GPU -> rank map (so each torchrun process
    computes the same table). ``local_device(gpu) -> str`` picks the device of a GPU's rank; ``requests`` (the
    run's) size the decode CUDA-graph buckets captured at warm-up; ``prefix_cache`` (None: ``built.prefix_cache``)
    sizes the prefilling ranks' prefix caches; ``mtp_agree`` (``real.mtp_agree``): the random weights' draft
    agreement (:func:`check_mtp_agree`)."""
    from rackbed.engine.real.worker import RankSpec

    check_mtp_agree(cfg, mtp_agree, weights)
    check_gdn(built, cfg, prefix_cache)
    prefix_blocks, prefix_block_tokens = real_prefix_cache(
        prefix_cache if prefix_cache is not None else getattr(built, "prefix_cache", None))
    if prefix_blocks and any(cfg.kv_windows):
        raise UserError("prefix_cache: real mode caches no prefix of a model with sliding-window layers (their KV "
                        "is a per-sequence ring of the window, not shareable pages); set prefix_cache: null")
    rings = {k: v for k, v in kv_rings(built, cfg, prefill_pages, decode_pages, requests).items()
             if k in ("prefill_rings", "decode_rings")}
    slots, slot_pages = gdn_rank_budget(built, cfg, dtype, decode_pages)

    dep = built.deployment
    groups = deployment_groups(dep)
    group_ranks = {gid: tuple(gpu_rank[x] for x in gs) for gid, gs, _ in groups}
    all_groups = tuple((gid, group_ranks[gid]) for gid, _, _ in groups)
    ptp = dep.prefillers[0].template.tp if dep.prefillers else 1
    p_ranks = sorted(gpu_rank[x] for gid, gs, role in groups if role == "prefill" for x in gs)
    d_ranks = sorted(gpu_rank[x] for gid, gs, role in groups if role == "decode" for x in gs)
    peers = tuple((p, d) for p in p_ranks for d in d_ranks)
    if len(peers) > 64:     # start-up cost grows with P x D: connect lazily, on first use, beyond that
        peers = ()
    dec = dep.decoders or dep.aggregated
    gmax = dec[0].template.max_batch_per_rank if dec and requests else 0
    gpages = graph_pages(requests, built.decode_plan.page_tokens, dep.mtp.draft_k) if gmax else (0, 0)
    plens = (min(r.prompt_tokens for r in requests), max(r.prompt_tokens for r in requests)) if requests else (0, 0)
    chunk = (dep.aggregated[0].template.chunk_tokens or 0) if dep.aggregated else 0
    draft_k = dep.mtp.draft_k if cfg.runs_mtp else 0   # real_model_config refused drafts without an MTP module
    out = {}
    for gid, gs, role in groups:
        tpl = {"prefill": dep.prefillers, "decode": dep.decoders, "aggregated": dep.aggregated}[role][0].template
        for gpu in gs:
            r = gpu_rank[gpu]
            dev = local_device(gpu) if local_device else ("cuda:0" if use_cuda else "cpu")
            out[r] = RankSpec(rank=r, world=world, role=role, group_id=gid, group_ranks=group_ranks[gid],
                              all_groups=all_groups, device=dev, dtype=dtype, cfg=cfg,
                              tp=tpl.tp if role == "prefill" else 1, ep=tpl.ep,
                              n_pages=prefill_pages if role == "prefill" else decode_pages - slot_pages,
                              page_tokens=built.decode_plan.page_tokens, prefill_tp=ptp,
                              prefill_pages=prefill_pages, decode_pages=decode_pages, seed=seed, weights=weights,
                              init_file=init_file, backend=backend, kv_peers=peers,
                              graph_max_batch=gmax * (1 + draft_k) if role != "prefill" else 0,
                              graph_pages=gpages if role != "prefill" else (0, 0),
                              prefill_lens=plens if role != "decode" else (0, 0),
                              chunk_tokens=chunk if role == "aggregated" else 0,
                              prefix_blocks=prefix_blocks if role != "decode" else 0,
                              prefix_block_tokens=prefix_block_tokens if role != "decode" else 0,
                              state_slots=slots if role == "aggregated" else 0, draft_k=draft_k,
                              mtp_agree=mtp_agree, **rings)
    return out


def real_model_config(built, n_layers=None, tiny_cfg=None, weights: str | None = None):
    """The torch model's config: a checkpoint's own config.json when ``weights`` is given (RoPE theta, norms),
    else derived from the scenario's ModelSpec."""
    import json

    from rackbed.engine.real.model import TorchModelConfig

    dep = built.deployment
    if dep.spare_gpus:
        raise UserError("real mode: autoscaling is simulated only (set autoscaler.enabled: false)")
    if dep.chunked_prefill:
        raise UserError("real mode: chunked prefill is simulated only (set sim.chunked_prefill: false)")
    if any(len(g.gpus) > 1 for g in dep.aggregated):
        raise UserError("real mode: aggregated workers of one GPU only (aggregated.tp, dp and ep = 1)")
    if dep.decoder_template.tp > 1 or any(g.template.tp > 1 for g in dep.decoders):
        raise UserError("decode.tp: real mode runs DP-attention decoders only (decode.tp: 1); attention TP in "
                        "decoders is simulated only")
    for role, tpl in (("prefill", dep.prefiller_template), ("decode", dep.decoder_template)):
        if tpl.span_nodes:
            raise UserError(f"{role}.span_nodes: real mode runs every group on this machine's devices; groups "
                            f"spanning nodes are simulated only (set {role}.span_nodes: false)")
    if getattr(built.decode_plan, "moe_comm", "a2a") != "a2a":
        raise UserError("decode.moe_comm: real mode moves a decoder's tokens by all-to-all; allgather is "
                        "simulated only (set decode.moe_comm: a2a)")
    for role, plan in (("prefill", built.prefill_plan), ("decode", built.decode_plan)):
        if getattr(plan, "overlap", "none") != "none":
            raise UserError(f"{role}.overlap: real mode runs its steps without compute / communication "
                            f"overlap; {plan.overlap} is simulated only (set {role}.overlap: none)")
    if tiny_cfg is None and weights:
        cfg_path = Path(weights) / "config.json"
        if not cfg_path.exists():
            raise FileNotFoundError(f"{cfg_path}: real.weights needs a Hugging Face checkpoint directory")
        tiny_cfg = TorchModelConfig.from_hf(json.loads(cfg_path.read_text()), source=str(cfg_path))
    cfg = tiny_cfg or TorchModelConfig.from_spec(built.model, n_layers=n_layers)
    k = dep.mtp.draft_k
    if k > 0 and not cfg.runs_mtp:
        raise UserError(f"mtp.draft_k: {k} drafts, but real mode drafts with the model's own MTP module and "
                        f"{built.model.name} ({cfg.family}) has none it runs; set mtp.draft_k: 0")
    if k > 0 and weights and not _has_mtp_weights(Path(weights), cfg.n_layers):
        raise UserError(f"mtp.draft_k: {k} drafts, but the checkpoint {weights} holds no MTP module "
                        f"(model.layers.{cfg.n_layers}.eh_proj.weight); set mtp.draft_k: 0")
    return cfg


def check_mtp_agree(cfg, mtp_agree: float | None, weights: str | None) -> None:
    """``real.mtp_agree`` shapes seeded random weights of a model whose MTP module real mode runs, with an
    untied lm head (``engine.real.agreeing``); anything else is refused in one line."""
    if mtp_agree is None:
        return
    if weights:
        raise UserError(f"real.mtp_agree: {mtp_agree} shapes random weights, but real.weights loads the "
                        f"checkpoint {weights}; set one of them to null")
    if not cfg.runs_mtp:
        raise UserError(f"real.mtp_agree: {mtp_agree}, but the {cfg.family} model has no MTP module real "
                        "mode runs; set real.mtp_agree: null")
    if cfg.tie_embeddings:
        raise UserError(f"real.mtp_agree: {mtp_agree} needs an lm head of its own; the model ties it to the "
                        "embedding (tie_word_embeddings)")


def _has_mtp_weights(path: Path, n_layers: int) -> bool:
    """Whether a safetensors checkpoint directory holds the MTP module (layer ``n_layers``, as DeepSeek-V3
    checkpoints do; transformers' own saves leave it out)."""
    from safetensors import safe_open

    key = f"model.layers.{n_layers}.eh_proj.weight"
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as h:
            if key in h.keys():
                return True
    return False
