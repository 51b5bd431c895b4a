"""What a real run is made of, derived from a built scenario: its process groups, each rank's ``RankSpec``, the
torch model's config, the KV capacities the scheduler plans with, and the prefilling ranks' prefix caches. Pure
functions of the scenario (every torchrun process computes the same tables); ``engine.real.driver`` runs them."""

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


def rank_specs(built, cfg, gpu_rank: dict[int, int], world: int, *, use_cuda: bool, dtype: str, seed: int,
               weights: str | None, prefill_pages: int, decode_pages: int, init_file: str = "",
               backend: str = "gloo", local_device=None, requests=None, prefix_cache=None) -> dict:
    """Every rank's ``RankSpec``, a pure function of the scenario and the GPU -> rank map (so each torchrun process
    computes the same table). ``local_device(gpu) -> str`` picks the device of a GPU's rank; ``requests`` (the
    run's) size the decode CUDA-graph buckets captured at warm-up; ``prefix_cache`` (None: ``built.prefix_cache``)
    sizes the prefilling ranks' prefix caches."""
    from rackbed.engine.real.worker import RankSpec

    prefix_blocks, prefix_block_tokens = real_prefix_cache(
        prefix_cache if prefix_cache is not None else getattr(built, "prefix_cache", None))

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
    gmax = dep.decoders[0].template.max_batch_per_rank if dep.decoders and requests else 0
    gpages = graph_pages(requests, built.decode_plan.page_tokens, dep.mtp.draft_k) if gmax else (0, 0)
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
                              n_pages=prefill_pages if role == "prefill" else decode_pages,
                              page_tokens=built.decode_plan.page_tokens, prefill_tp=ptp,
                              prefill_pages=prefill_pages, decode_pages=decode_pages, seed=seed, weights=weights,
                              init_file=init_file, backend=backend, kv_peers=peers,
                              graph_max_batch=gmax * (1 + draft_k) if role == "decode" else 0,
                              graph_pages=gpages if role == "decode" else (0, 0),
                              prefix_blocks=prefix_blocks if role != "decode" else 0,
                              prefix_block_tokens=prefix_block_tokens if role != "decode" else 0,
                              draft_k=draft_k)
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
    if tiny_cfg is None and weights:
        cfg_path = Path(weights) / "config.json"
        if not cfg_path.exists():
            raise FileNotFoundError(f"{cfg_path}: real.weights needs a Hugging Face checkpoint directory")
        tiny_cfg = TorchModelConfig.from_hf(json.loads(cfg_path.read_text()))
    cfg = tiny_cfg or TorchModelConfig.from_spec(built.model, n_layers=n_layers)
    k = dep.mtp.draft_k
    if k > 0 and not cfg.runs_mtp:
        raise UserError(f"mtp.draft_k: {k} drafts, but real mode drafts with the model's own MTP module and "
                        f"{built.model.name} ({cfg.family}) has none it runs; set mtp.draft_k: 0")
    if k > 0 and weights and not _has_mtp_weights(Path(weights), cfg.n_layers):
        raise UserError(f"mtp.draft_k: {k} drafts, but the checkpoint {weights} holds no MTP module "
                        f"(model.layers.{cfg.n_layers}.eh_proj.weight); set mtp.draft_k: 0")
    return cfg


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
