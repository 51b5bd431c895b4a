"""Qwen3-MoE in torch, sharded the way the write-up shards it.

Prefill (``forward_prefill``): attention heads split over the TP group (KV heads replicated when tp > KV heads),
experts split over the same ranks (EP = TP), input replicated; attention output and MoE output are partial sums
reduced with an all-reduce — "local select, local accumulate, all-reduce".

Decode (``forward_decode``): data parallel attention (every rank holds all heads and its own requests' KV) and
expert parallel MoE through a sparse all-to-all: each rank sends every token once to each rank owning one of its
top-k experts (dispatch), the owner applies its experts, results come back to the source rank and are summed there
(combine).

The KV cache is paged and HND: per layer ``[pages, 2 (K|V), kv_heads, page_tokens, head_dim]`` — heads leading,
tokens contiguous — the layout ``engine.core.kv`` plans transfers for. Sliding-window layers (gpt-oss) keep the same
page shape on a per-sequence ring of the window instead (``PagedKvCache``).

Shape legend: T = tokens in the step, B = sequences, D = hidden, Hq / Hkv = local query / KV heads, Dh = head dim,
E = local experts, F = expert width (moe_intermediate), V = vocab, P = pages, S = tokens per page, L = layers.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F_

from rackbed.engine.core.graph_shapes import (
    DECODE_BATCH_BUCKETS,
    PAGE_ROUND,
    PREFILL_TOKEN_BUCKETS,
    prefill_key,
    prefill_reach,
    prefill_warm_order,
)
from rackbed.engine.real.comm import Comm
from rackbed.engine.real.config import TorchModelConfig
from rackbed.engine.real.profiling import scope, scoped
from rackbed.engine.real.weight_splits import shard_weights
from rackbed.kernels.moe_block import moe_block, route


@dataclass(frozen=True)
class Shard:
    """Which slice of the model one rank holds: its place in the attention TP group (``attn_tp`` ranks, 1 for a DP
    decoder rank) and in the expert group (``ep`` ranks). The heads and experts of that place are the layer kinds'
    (``GqaAttention.q_heads_of_tp_rank`` / ``kv_heads_of_tp_rank``, ``MoeFfn.experts_of_ep_rank``), the same
    derivation ``ParallelPlan`` uses; ``of_plan`` takes the place from a plan.
    """

    attn_tp: int = 1
    attn_rank: int = 0
    ep: int = 1
    ep_rank: int = 0

    @classmethod
    def of_plan(cls, plan, rank: int) -> Shard:
        """Rank ``rank`` of a ``ParallelPlan``. The torch engine holds whole experts, so the plan's expert group
        must be all ranks (``ep = world``) or none (``ep = 1``, experts replicated)."""
        if 1 < plan.ep < plan.world:
            raise ValueError(f"ep={plan.ep} over {plan.world} ranks splits experts {plan.expert_tp} ways; the torch "
                             "engine holds whole experts (use ep equal to the group size, or 1)")
        return cls(attn_tp=plan.tp, attn_rank=plan.tp_rank(rank), ep=plan.ep,
                   ep_rank=plan.ep_rank(rank) if plan.ep > 1 else 0)

    def q_heads(self, cfg: TorchModelConfig) -> range:
        if cfg.is_mla:
            return cfg.attention.heads_of_tp_rank(self.attn_tp, self.attn_rank)
        return cfg.attention.q_heads_of_tp_rank(self.attn_tp, self.attn_rank)

    def kv_heads(self, cfg: TorchModelConfig) -> range:
        """The KV heads this rank's query heads read (with tp > KV heads, a KV head replicated on tp / KV heads
        ranks). MLA: the one latent "head", whole on every rank."""
        if cfg.is_mla:
            return range(1)
        return cfg.attention.kv_heads_of_tp_rank(self.attn_tp, self.attn_rank)

    def experts(self, cfg: TorchModelConfig) -> range:
        return cfg.moe.experts_of_ep_rank(self.ep, self.ep_rank)


# ----------------------------------------------------------------------------------------------------------------
# Weights


_RANDN_WHOLE = 1 << 31  # elements drawn in one call; a larger tensor is drawn in slices of its first dimension


def _randn(shape, gen: torch.Generator, std: float, device, dtype) -> torch.Tensor:
    """``N(0, std)`` in ``dtype``, drawn in fp32 from ``gen``. Tensors over 2^31 elements (DeepSeek-V3's 256
    experts of a layer: 7.5 G) are drawn a slice of the first dimension at a time into the output, so the fp32
    draw never needs 30 GB beside the weights already made (values differ from one whole draw; a given shape is
    always drawn the same way)."""
    n = 1
    for d in shape:
        n *= int(d)
    if n <= _RANDN_WHOLE or len(shape) < 2 or shape[0] < 2:
        return (torch.randn(shape, generator=gen, device=gen.device, dtype=torch.float32) * std).to(device, dtype)
    out = torch.empty(shape, device=device, dtype=dtype)
    rows = max(1, (_RANDN_WHOLE // 8) // (n // shape[0]))
    for i in range(0, shape[0], rows):
        part = out[i:i + rows]
        part.copy_(torch.randn(part.shape, generator=gen, device=gen.device, dtype=torch.float32) * std)
    return out


def random_layer_weights(cfg: TorchModelConfig, layer: int, seed: int, device, dtype) -> dict[str, torch.Tensor]:
    """Full (unsharded) weights of one decoder layer, drawn from a generator seeded by (seed, layer).

    Drawn on ``device`` (a CUDA generator when the device is CUDA) so a Qwen3-235B-width layer (~4.8 GB bf16) is
    not generated on the host. The same (seed, layer, device type) always gives the same tensors, so every sharding
    of a model slices the same full weights.
    """
    dev = torch.device(device)
    gen = torch.Generator(device=dev)
    gen.manual_seed(seed * 1_000_003 + layer + 1)
    D, Dh, E, Fw = cfg.hidden, cfg.head_dim, cfg.n_experts, cfg.moe_intermediate
    s = cfg.init_std
    return {
        "q_proj": _randn((cfg.n_q_heads * Dh, D), gen, s, dev, dtype),
        "k_proj": _randn((cfg.n_kv_heads * Dh, D), gen, s, dev, dtype),
        "v_proj": _randn((cfg.n_kv_heads * Dh, D), gen, s, dev, dtype),
        "o_proj": _randn((D, cfg.n_q_heads * Dh), gen, s, dev, dtype),
        "q_norm": 1.0 + _randn((Dh,), gen, 0.1, dev, dtype),
        "k_norm": 1.0 + _randn((Dh,), gen, 0.1, dev, dtype),
        "input_norm": 1.0 + _randn((D,), gen, 0.1, dev, dtype),
        "post_norm": 1.0 + _randn((D,), gen, 0.1, dev, dtype),
        "router": _randn((E, D), gen, s, dev, dtype),
        "gate_up": _randn((E, 2 * Fw, D), gen, s, dev, dtype),
        "down": _randn((E, D, Fw), gen, s, dev, dtype),
    }


def random_global_weights(cfg: TorchModelConfig, seed: int, device, dtype) -> dict[str, torch.Tensor]:
    dev = torch.device(device)
    gen = torch.Generator(device=dev)
    gen.manual_seed(seed * 1_000_003)
    emb = _randn((cfg.vocab, cfg.hidden), gen, cfg.init_std, dev, dtype)
    out = {"embed": emb, "final_norm": 1.0 + _randn((cfg.hidden,), gen, 0.1, dev, dtype)}
    out["lm_head"] = emb if cfg.tie_embeddings else _randn((cfg.vocab, cfg.hidden), gen, cfg.init_std, dev, dtype)
    return out


def hf_layer_weights(state: dict[str, torch.Tensor], cfg: TorchModelConfig, layer: int) -> dict[str, torch.Tensor]:
    """One layer's full weights from a Hugging Face Qwen3-MoE state dict.

    Accepts both expert layouts: fused 3-D ``mlp.experts.gate_up_proj`` / ``down_proj`` (transformers >= 5) and
    per-expert ``mlp.experts.{e}.{gate,up,down}_proj.weight`` (the published safetensors checkpoints).
    """
    p = f"model.layers.{layer}."
    g = state.get
    out = {
        "q_proj": state[p + "self_attn.q_proj.weight"], "k_proj": state[p + "self_attn.k_proj.weight"],
        "v_proj": state[p + "self_attn.v_proj.weight"], "o_proj": state[p + "self_attn.o_proj.weight"],
        "q_norm": state[p + "self_attn.q_norm.weight"], "k_norm": state[p + "self_attn.k_norm.weight"],
        "input_norm": state[p + "input_layernorm.weight"], "post_norm": state[p + "post_attention_layernorm.weight"],
        "router": state[p + "mlp.gate.weight"],
    }
    if g(p + "mlp.experts.gate_up_proj") is not None:
        out["gate_up"] = state[p + "mlp.experts.gate_up_proj"]
        out["down"] = state[p + "mlp.experts.down_proj"]
    else:
        e_range = range(cfg.n_experts)
        out["gate_up"] = torch.stack([torch.cat([state[f"{p}mlp.experts.{e}.gate_proj.weight"],
                                                 state[f"{p}mlp.experts.{e}.up_proj.weight"]], 0) for e in e_range])
        out["down"] = torch.stack([state[f"{p}mlp.experts.{e}.down_proj.weight"] for e in e_range])
    return out


def hf_global_weights(state: dict[str, torch.Tensor], cfg: TorchModelConfig) -> dict[str, torch.Tensor]:
    emb = state["model.embed_tokens.weight"]
    lm = state.get("lm_head.weight", emb if cfg.tie_embeddings else None)
    if lm is None:
        raise ValueError("checkpoint has no lm_head.weight and tie_word_embeddings is false")
    return {"embed": emb, "final_norm": state["model.norm.weight"], "lm_head": lm}


def shard_layer(full: dict[str, torch.Tensor], cfg: TorchModelConfig, shard: Shard) -> dict[str, torch.Tensor]:
    """Slice a layer's full weights to what ``shard`` holds (``weight_splits.SPLITS``; copies, so the full
    tensors can be freed)."""
    return shard_weights(full, cfg, shard, 0)


# ----------------------------------------------------------------------------------------------------------------
# Paged HND KV cache


def ring_pages(window: int, page_tokens: int) -> int:
    """Pages of one sequence's ring in a sliding layer of ``window`` tokens: the window in whole pages plus one
    (``ceil(window / page_tokens) + 1``, what ``engine.core.sharding``'s memory model charges a sequence per
    sliding layer): the window rarely starts on a page boundary, and a step writes its tokens before it attends."""
    return -(-window // page_tokens) + 1


@dataclass
class PagedKvCache:
    """Paged KV cache, HND: ``storage[l]`` is ``[P, 2, Hkv, S, Dh]`` (K then V, heads leading, tokens
    contiguous inside a page) for the ``l``-th layer that keeps the whole sequence. Pages are handed out by the
    caller (the scheduler's block manager or a simple free list here).

    Pages are reference counted so a cached prompt prefix is shared, not copied: ``alloc`` hands out pages with one
    reference, ``share`` adds one (a prefix cache keeping a prompt's full blocks, a sequence mapping a cached
    prefix), ``free`` drops one and returns a page to the free list when its last reference goes. Shared pages are
    only ever read: a prefix is shared in whole pages (a prefix-cache block is a multiple of ``page_tokens``), and a
    sequence writes past its prefix into pages of its own, so no page needs copying on write.

    Sliding-window layers (``windows[l] > 0``, one window for all of them) do not take pages in proportion to the
    sequence: each sequence owns a ring of ``ring_pages(window, page_tokens)`` pages per sliding layer in
    ``ring_storage [Ls, ring_seqs * Rp, 2, Hkv, S, Dh]``, and token position ``p`` lives at ring slot ``p mod R``
    (``R = Rp * S`` tokens: ring page ``(p mod R) // S``, in-page slot ``p % S``). The ring is handed out with a
    sequence's first page (``alloc`` / ``grow`` of an empty list) and returned with it, and found through it
    (``ring_of``, and ``ring_table[first page]`` on the device for a graph-captured decode step), so a sequence
    is still named by its page list alone. A first page is never shared (``share`` refuses on a cache with
    rings: a prefix cache keeps no ring state). ``ring_seqs`` rings exist; a sequence that finds none is refused
    like a full cache (``MemoryError``)."""

    n_layers: int
    n_pages: int
    kv_heads: int
    page_tokens: int
    head_dim: int
    dtype: torch.dtype = torch.float32
    device: str | torch.device = "cpu"
    windows: tuple[int, ...] = ()
    ring_seqs: int = 0
    storage: torch.Tensor = field(init=False)
    free_pages: list[int] = field(init=False)
    refs: list[int] = field(init=False)

    def __post_init__(self) -> None:
        win = tuple(int(w) for w in self.windows) if any(self.windows) else ()
        if win and len(win) != self.n_layers:
            raise ValueError(f"PagedKvCache.windows has {len(win)} entries for {self.n_layers} layers")
        if len({w for w in win if w}) > 1:
            raise ValueError(f"PagedKvCache: one sliding window for every sliding layer, got {sorted(set(win))}")
        self.windows = win
        self.window = max(win, default=0)
        # layer -> index into storage (full layers) or ring_storage (sliding layers)
        self.full_layers = [li for li in range(self.n_layers) if not (win and win[li])]
        self.ring_layers = [li for li in range(self.n_layers) if win and win[li]]
        self.slot_of = {li: i for i, li in enumerate(self.full_layers)} | \
            {li: i for i, li in enumerate(self.ring_layers)}
        self.storage = torch.zeros(len(self.full_layers), self.n_pages, 2, self.kv_heads, self.page_tokens,
                                   self.head_dim, dtype=self.dtype, device=self.device)
        self.free_pages = list(range(self.n_pages - 1, -1, -1))
        self.refs = [0] * self.n_pages
        S = self.page_tokens
        self.ring_pages = ring_pages(self.window, S) if self.window else 0
        self.ring_tokens = self.ring_pages * S
        n_ring = self.ring_seqs * self.ring_pages if self.window else 0
        self.ring_storage = torch.zeros(len(self.ring_layers), n_ring, 2, self.kv_heads, S, self.head_dim,
                                        dtype=self.dtype, device=self.device)
        self.free_rings = list(range(self.ring_seqs - 1, -1, -1)) if self.window else []
        self.rings: dict[int, int] = {}        # first page of a sequence -> its ring
        # [P, Rp] ring pages of the sequence whose first page is p (0 for pages that start no sequence)
        self.ring_table = torch.zeros(self.n_pages, self.ring_pages, dtype=torch.long, device=self.device)

    # -- pages ---------------------------------------------------------------------------------------------------
    def is_ring(self, layer: int) -> bool:
        return bool(self.windows) and self.windows[layer] > 0

    def _take(self) -> int:
        p = self.free_pages.pop()
        self.refs[p] = 1
        return p

    def _take_first(self) -> int:
        """A sequence's first page, with its ring when the cache has sliding layers."""
        if self.window and not self.free_rings:
            raise MemoryError(f"KV cache full: all {self.ring_seqs} sliding-window rings in use")
        p = self._take()
        if self.window:
            r = self.free_rings.pop()
            self.rings[p] = r
            self.ring_table[p] = torch.arange(r * self.ring_pages, (r + 1) * self.ring_pages,
                                              device=self.ring_table.device)
        return p

    def alloc(self, n_tokens: int) -> list[int]:
        need = -(-n_tokens // self.page_tokens)
        if need > len(self.free_pages):
            raise MemoryError(f"KV cache full: need {need} pages, {len(self.free_pages)} free")
        return [self._take_first()] + [self._take() for _ in range(need - 1)] if need else []

    def grow(self, pages: list[int], n_tokens: int) -> None:
        """Make ``pages`` long enough for ``n_tokens`` tokens."""
        while len(pages) * self.page_tokens < n_tokens:
            if not self.free_pages:
                raise MemoryError("KV cache full")
            pages.append(self._take() if pages else self._take_first())

    def share(self, pages: list[int]) -> list[int]:
        """One more reference to each of ``pages`` (in use); returns a new list of them."""
        if self.window:
            raise ValueError("pages of a cache with sliding-window rings are not shared (a ring holds one "
                             "sequence's latest window, not a prefix's)")
        for p in pages:
            if self.refs[p] < 1:
                raise ValueError(f"page {p} is free: only a page in use can be shared")
            self.refs[p] += 1
        return list(pages)

    def free(self, pages: list[int]) -> None:
        """Drop one reference to each of ``pages``; a page whose last reference goes returns to the free list
        (a sequence's first page with its ring)."""
        for p in reversed(pages):
            if self.refs[p] < 1:
                raise ValueError(f"page {p} freed more often than it was allocated or shared")
            self.refs[p] -= 1
            if self.refs[p] == 0:
                self.free_pages.append(p)
                r = self.rings.pop(p, None)
                if r is not None:
                    self.free_rings.append(r)

    def ring_of(self, pages: list[int]) -> list[int]:
        """The ring pages (in ``ring_storage``) of the sequence whose page list is ``pages``; [] without rings."""
        if not self.window or not pages:
            return []
        r = self.rings[pages[0]]
        return list(range(r * self.ring_pages, (r + 1) * self.ring_pages))

    def pages_held(self) -> tuple[int, int]:
        """``(full-layer pages, ring pages)`` in use."""
        return (self.n_pages - len(self.free_pages),
                (self.ring_seqs - len(self.free_rings)) * self.ring_pages if self.window else 0)

    # -- K/V -------------------------------------------------------------------------------------------------------
    def write(self, layer: int, pages: list[int], start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write K, V ``[Hkv, T, Dh]`` for token positions start..start+T-1 of one sequence (a sliding layer keeps
        only the last ``ring_tokens`` of them, in its ring)."""
        S = self.page_tokens
        T = k.shape[1]
        if self.is_ring(layer):
            R = self.ring_tokens
            drop = max(T - R, 0)
            k, v, start, T = k[:, drop:], v[:, drop:], start + drop, T - drop
            pos = torch.arange(start, start + T, device=k.device) % R
            page_idx = torch.as_tensor(self.ring_of(pages), device=k.device)[pos // S]
            st = self.ring_storage[self.slot_of[layer]]
        else:
            pos = torch.arange(start, start + T, device=k.device)
            page_idx = torch.as_tensor(pages, device=k.device)[pos // S]
            st = self.storage[self.slot_of[layer]]
        slot = pos % S
        st[page_idx, 0, :, slot] = k.transpose(0, 1).to(st.dtype)
        st[page_idx, 1, :, slot] = v.transpose(0, 1).to(st.dtype)

    def read(self, layer: int, pages: list[int], n_tokens: int, first: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """K, V ``[Hkv, n_tokens - first, Dh]`` of token positions first..n_tokens-1 of one sequence (a sliding
        layer holds only the latest ``ring_tokens`` positions: ``first`` must not be older)."""
        S = self.page_tokens
        if self.is_ring(layer):
            R = self.ring_tokens
            if first < n_tokens - R:
                raise ValueError(f"ring of {R} tokens holds positions {n_tokens - R}.., asked from {first}")
            pos = torch.arange(first, n_tokens, device=self.ring_storage.device) % R
            rp = torch.as_tensor(self.ring_of(pages), device=pos.device)[pos // S]
            st = self.ring_storage[self.slot_of[layer]]
            return st[rp, 0, :, pos % S].transpose(0, 1), st[rp, 1, :, pos % S].transpose(0, 1)
        idx = torch.as_tensor(pages[:-(-n_tokens // S)], device=self.storage.device)
        kv = self.storage[self.slot_of[layer]][idx]                        # [P, 2, Hkv, S, Dh]
        P, _, H, _, Dh = kv.shape
        k = kv[:, 0].transpose(0, 1).reshape(H, P * S, Dh)[:, first:n_tokens]
        v = kv[:, 1].transpose(0, 1).reshape(H, P * S, Dh)[:, first:n_tokens]
        return k, v


# ----------------------------------------------------------------------------------------------------------------
# The model


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype))


def rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding (rotate-half form) of ``x [..., T, Dh]`` at positions ``pos [T]`` (or broadcastable)."""
    Dh = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, Dh, 2, device=x.device, dtype=torch.float32) / Dh))
    f = pos.to(torch.float32)[..., None] * inv
    emb = torch.cat((f, f), -1)
    cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
    x1, x2 = x[..., : Dh // 2], x[..., Dh // 2:]
    return x * cos + torch.cat((-x2, x1), -1) * sin


class ShardedQwen3Moe:
    """The sharded model of one rank. Not an ``nn.Module``: weights are plain tensors (inference only).

    ``comm`` provides the collectives (torch.distributed groups, or the peer-memory kernels on GPUs).
    """

    def __init__(self, cfg: TorchModelConfig, shard: Shard, comm: Comm, layers: list[dict[str, torch.Tensor]],
                 glob: dict[str, torch.Tensor]) -> None:
        self.cfg, self.shard, self.comm = cfg, shard, comm
        self.layers, self.glob = layers, glob
        self.q_heads, self.kv_heads, self.experts = shard.q_heads(cfg), shard.kv_heads(cfg), shard.experts(cfg)
        self.scale = 1.0 / math.sqrt(cfg.head_dim)
        self.mtp = None                 # Qwen3-MoE has no MTP module (``families.ShardedMoeLM`` runs one)
        self.n_kv_layers = cfg.n_layers

    # -- construction ------------------------------------------------------------------------------------------
    @classmethod
    def random(cls, cfg: TorchModelConfig, shard: Shard, comm: Comm, *, seed: int = 0, device="cpu",
               dtype=torch.float32, mtp: bool = False) -> ShardedQwen3Moe:
        if mtp:
            raise ValueError("Qwen3-MoE has no MTP module")
        layers = []
        for i in range(cfg.n_layers):
            full = random_layer_weights(cfg, i, seed, device, dtype)
            layers.append(shard_layer(full, cfg, shard))
            del full
        return cls(cfg, shard, comm, layers, random_global_weights(cfg, seed, device, dtype))

    @classmethod
    def from_state_dict(cls, state: dict[str, torch.Tensor], cfg: TorchModelConfig, shard: Shard, comm: Comm, *,
                        device="cpu", dtype=torch.float32, mtp: bool = False) -> ShardedQwen3Moe:
        if mtp:
            raise ValueError("Qwen3-MoE has no MTP module")
        conv = lambda t: t.to(device=device, dtype=dtype)
        layers = [{k: conv(v) for k, v in shard_layer(hf_layer_weights(state, cfg, i), cfg, shard).items()}
                  for i in range(cfg.n_layers)]
        glob = {k: conv(v) for k, v in hf_global_weights(state, cfg).items()}
        return cls(cfg, shard, comm, layers, glob)

    def new_cache(self, n_pages: int, page_tokens: int, *, device=None, dtype=None) -> PagedKvCache:
        ref = self.glob["embed"]
        return PagedKvCache(self.cfg.n_layers, n_pages, len(self.kv_heads), page_tokens, self.cfg.head_dim,
                            dtype=dtype or ref.dtype, device=device or ref.device)

    # -- pieces --------------------------------------------------------------------------------------------------
    @scoped("attn_s")
    def _qkv(self, w, h: torch.Tensor, pos: torch.Tensor):
        """h [T, D] -> q [Hq, T, Dh], k, v [Hkv, T, Dh] with qk-norm and RoPE applied."""
        cfg, Dh = self.cfg, self.cfg.head_dim
        T = h.shape[0]
        q = (h @ w["q_proj"].T).view(T, -1, Dh).transpose(0, 1)
        k = (h @ w["k_proj"].T).view(T, -1, Dh).transpose(0, 1)
        v = (h @ w["v_proj"].T).view(T, -1, Dh).transpose(0, 1)
        q = rope(rms_norm(q, w["q_norm"], cfg.rms_eps), pos, cfg.rope_theta)
        k = rope(rms_norm(k, w["k_norm"], cfg.rms_eps), pos, cfg.rope_theta)
        return q, k, v

    def _gqa_map(self) -> torch.Tensor:
        """For each local query head, the index of its KV head among the local KV heads."""
        att = self.cfg.attention
        group = att.n_q_heads // att.n_kv_heads
        return torch.tensor([h // group - self.kv_heads.start for h in self.q_heads])

    @scoped("other_s")
    def _route(self, w, h: torch.Tensor):
        """Top-k routing (softmax over all experts, top-k, optional renormalisation), as Qwen3-MoE does."""
        return route(h @ w["router"].T, self.cfg.top_k, self.cfg.norm_topk_prob, h.dtype)

    @scoped("a2a_s")  # select / pack / accumulate; the expert GEMMs inside are moe_gemm_s
    def _local_experts(self, w, x: torch.Tensor, ids: torch.Tensor, wts: torch.Tensor) -> torch.Tensor:
        """sum_j wts[t, j] * expert_{ids[t, j]}(x[t]) over the (t, j) whose expert is local; ids are global."""
        e0 = self.experts.start
        out = torch.zeros_like(x)
        local = (ids >= e0) & (ids < self.experts.stop)
        t_idx, j_idx = local.nonzero(as_tuple=True)
        if t_idx.numel() == 0:
            return out
        e_loc = ids[t_idx, j_idx] - e0
        order = torch.argsort(e_loc, stable=True)
        t_idx, j_idx, e_loc = t_idx[order], j_idx[order], e_loc[order]
        xs = x[t_idx]                                                     # [R, D]
        counts = torch.bincount(e_loc, minlength=len(self.experts))
        y = self._experts(w, xs, counts)                                   # [R, D]
        out.index_add_(0, t_idx, y * wts[t_idx, j_idx, None])
        return out

    @scoped("moe_gemm_s")
    def _experts(self, w, xs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The local experts on rows ``xs [R, D]`` grouped by local expert (``counts [E_local]``)."""
        return grouped_swiglu(xs, w["gate_up"], w["down"], counts)

    # -- prefill: TP attention + EP MoE on replicated input -------------------------------------------------------
    def forward_prefill(self, seqs: list[torch.Tensor], cache: PagedKvCache, page_tables: list[list[int]],
                        starts: list[int] | None = None):
        """Prefill prompts, or prompt suffixes after a cached prefix. ``seqs``: token ids ``[T_i]`` per sequence,
        the tokens at positions ``starts[i] .. starts[i] + T_i - 1`` (``starts``: None = all 0); their KV is written
        to ``page_tables[i]``, whose first ``starts[i]`` tokens already hold the prefix's KV (a prefix-cache hit:
        those tokens are read, never recomputed). Returns the logits of each sequence's last position ``[B, V]``."""
        cfg = self.cfg
        lens = [int(s.numel()) for s in seqs]
        starts = list(starts) if starts is not None else [0] * len(seqs)
        ids = torch.cat(seqs)
        pos = torch.cat([torch.arange(c, c + n, device=ids.device) for c, n in zip(starts, lens)])
        x = self.glob["embed"][ids]                                       # [T, D]
        gmap = self._gqa_map().to(ids.device)
        for li, w in enumerate(self.layers):
            h = rms_norm(x, w["input_norm"], cfg.rms_eps)
            with scope("attn_s"):
                q, k, v = self._qkv(w, h, pos)
                outs, off = [], 0
                for si, n in enumerate(lens):
                    qs, ks, vs = q[:, off:off + n], k[:, off:off + n], v[:, off:off + n]
                    c = starts[si]
                    cache.write(li, page_tables[si], c, ks, vs)
                    if c:   # attend over the cached prefix and the new tokens: query j sees keys 0 .. c + j
                        kc, vc = cache.read(li, page_tables[si], c)
                        ks, vs = torch.cat([kc.to(ks.dtype), ks], 1), torch.cat([vc.to(vs.dtype), vs], 1)
                        mask = torch.arange(c + n, device=ids.device)[None, :] <= \
                            (c + torch.arange(n, device=ids.device))[:, None]
                        o = F_.scaled_dot_product_attention(qs, ks[gmap], vs[gmap], attn_mask=mask,
                                                            scale=self.scale)
                    else:
                        o = F_.scaled_dot_product_attention(qs, ks[gmap], vs[gmap], is_causal=True,
                                                            scale=self.scale)
                    outs.append(o)
                    off += n
                attn = torch.cat(outs, 1).transpose(0, 1).reshape(len(ids), -1) @ w["o_proj"].T  # [T, D]
            x = x + self.comm.tp_all_reduce(attn)
            h = rms_norm(x, w["post_norm"], cfg.rms_eps)
            topi, topw = self._route(w, h)
            x = x + self.comm.ep_all_reduce(self._local_experts(w, h, topi, topw))
        last = torch.tensor(lens, device=ids.device).cumsum(0) - 1
        return self._logits(x[last])

    # -- decode: DP attention + DP-EP MoE via sparse all-to-all ----------------------------------------------------
    def forward_decode(self, tokens: torch.Tensor, positions: torch.Tensor, cache: PagedKvCache,
                       page_table: torch.Tensor, *, hidden: bool = False):
        """One decode step for this rank's batch. ``tokens [B]`` at ``positions [B]`` (0-based; the KV of earlier
        positions is in the cache), ``page_table [B, maxP]``. Every rank of the EP group must call this in the same
        step (B may be 0). Returns logits ``[B, V]`` (``hidden``: and the last hidden state ``[B, D]``). Rows of
        one sequence at consecutive positions (a speculative verify) attend causally: every row's KV is written
        before any row attends."""
        cfg = self.cfg
        B = tokens.shape[0]
        x = self.glob["embed"][tokens]                                    # [B, D]
        S = cache.page_tokens
        for li, w in enumerate(self.layers):
            h = rms_norm(x, w["input_norm"], cfg.rms_eps)
            if B:
                with scope("attn_s"):
                    q, k, v = self._qkv(w, h, positions)                     # q [Hq, B, Dh], k/v [Hkv, B, Dh]
                    st = cache.storage[li]
                    page = page_table.gather(1, (positions // S)[:, None])[:, 0]
                    st[page, 0, :, positions % S] = k.transpose(0, 1).to(st.dtype)
                    st[page, 1, :, positions % S] = v.transpose(0, 1).to(st.dtype)
                    o = self._decode_attention(q, st, page_table, positions)
                    x = x + o @ w["o_proj"].T
            h = rms_norm(x, w["post_norm"], cfg.rms_eps)
            topi, topw = self._route(w, h) if B else (
                torch.zeros(0, cfg.top_k, dtype=torch.long, device=x.device), torch.zeros(0, cfg.top_k, dtype=x.dtype,
                                                                                          device=x.device))
            x = x + self._moe_dp_ep(w, h, topi, topw)
        return (self._logits(x), x) if hidden else self._logits(x)

    @scoped("attn_s")
    def _decode_attention(self, q: torch.Tensor, st: torch.Tensor, page_table: torch.Tensor,
                          positions: torch.Tensor) -> torch.Tensor:
        """Decode attention of q ``[Hq, B, Dh]`` over one layer's pages ``st`` up to each row's position: the
        Triton kernel that reads the pages in place (``kernels.paged_attention``) where it runs, else the torch
        gather (:meth:`_paged_attention`). Static shapes either way (CUDA-graph safe)."""
        if paged_kernel_on(q.device, st.shape[3], st.shape[4]) and len(self.q_heads) == len(self.kv_heads) * (
                self.cfg.attention.n_q_heads // self.cfg.attention.n_kv_heads):
            from rackbed.kernels.paged_attention import gqa_decode

            return gqa_decode(q.transpose(0, 1), st, page_table, positions, self.scale)
        ctx = torch.arange(page_table.shape[1] * st.shape[3], device=q.device)
        return self._paged_attention(q, st[page_table], ctx[None, :] <= positions[:, None])

    @scoped("attn_s")
    def _paged_attention(self, q: torch.Tensor, pages: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """Decode attention read straight from gathered pages, without expanding KV heads for GQA.

        q ``[Hq, B, Dh]``; pages ``[B, P, 2, Hkv, S, Dh]`` (the sequences' pages of one layer); mask ``[B, P*S]``
        (True = attend). Query heads of one KV head are contiguous, so q is viewed ``[B, Hkv, G, Dh]`` and each KV
        byte is read once. Returns ``[B, Hq*Dh]``.
        """
        B, P, _, Hkv, S, Dh = pages.shape
        G = q.shape[0] // Hkv
        qg = q.transpose(0, 1).reshape(B, Hkv, G, Dh)
        K = pages[:, :, 0].permute(0, 2, 1, 3, 4).reshape(B, Hkv, P * S, Dh)
        V = pages[:, :, 1].permute(0, 2, 1, 3, 4).reshape(B, Hkv, P * S, Dh)
        scores = torch.matmul(qg, K.transpose(-1, -2)).float() * self.scale          # [B, Hkv, G, P*S]
        scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(V.dtype)
        return torch.matmul(probs, V).reshape(B, Hkv * G * Dh)

    def forward_decode_static(self, tokens: torch.Tensor, positions: torch.Tensor, cache: PagedKvCache,
                              page_table: torch.Tensor, slots: torch.Tensor | None = None, *, hidden: bool = False):
        """``forward_decode`` for a single-rank expert group without any host synchronisation or data-dependent
        shape, so the whole step can be captured in a CUDA graph (:class:`DecodeGraphRunner`). Same math: the
        MoE sorts the B*k (token, expert) pairs by expert instead of selecting the local ones. ``slots``: Gated
        DeltaNet state slots (``families.ShardedMoeLM``); this family has none."""
        if slots is not None:
            raise ValueError("forward_decode_static: Qwen3-MoE has no Gated DeltaNet layers (no state slots)")
        if self.shard.ep != 1:
            raise ValueError("forward_decode_static needs ep=1 (the all-to-all needs host-side split sizes)")
        cfg = self.cfg
        x = self.glob["embed"][tokens]
        S = cache.page_tokens
        page = page_table.gather(1, (positions // S)[:, None])[:, 0]
        slot = positions % S
        for li, w in enumerate(self.layers):
            h = rms_norm(x, w["input_norm"], cfg.rms_eps)
            q, kk, v = self._qkv(w, h, positions)
            st = cache.storage[li]
            st[page, 0, :, slot] = kk.transpose(0, 1).to(st.dtype)
            st[page, 1, :, slot] = v.transpose(0, 1).to(st.dtype)
            o = self._decode_attention(q, st, page_table, positions)
            x = x + o @ w["o_proj"].T
            h = rms_norm(x, w["post_norm"], cfg.rms_eps)
            # kernels.moe_block: the block kernels/bench/measure.py times (bench moe_block)
            x = x + moe_block(h, h @ w["router"].T, w["gate_up"], w["down"], cfg.top_k, swiglu=grouped_swiglu,
                              norm_topk_prob=cfg.norm_topk_prob)
        return (self._logits(x), x) if hidden else self._logits(x)

    def forward_chunk_static(self, tokens: torch.Tensor, positions: torch.Tensor, write_page: torch.Tensor,
                             page_row: torch.Tensor, last: torch.Tensor, cache: PagedKvCache,
                             slot: torch.Tensor | None = None) -> torch.Tensor:
        """A prefill chunk of ONE sequence without host synchronisation or data-dependent shapes, so it can be
        captured in a CUDA graph (:class:`PrefillGraphRunner`). ``tokens [T]`` at ``positions [T]``; their KV goes
        to page ``write_page[t]`` at slot ``positions[t] % S`` (padding rows name a scratch page); every query
        attends over the sequence's pages ``page_row [P]`` up to its own position (the cached prefix and earlier
        chunks included). Returns the logits of row ``last`` (``[1]``, the chunk's last real token) ``[1, V]``.
        Same math as :meth:`forward_prefill`; the MoE is ``moe_block`` as in :meth:`forward_decode_static`.
        ``slot``: a Gated DeltaNet state slot (``families.ShardedMoeLM``); this family has none."""
        if slot is not None:
            raise ValueError("forward_chunk_static: Qwen3-MoE has no Gated DeltaNet layers (no state slot)")
        if self.shard.ep != 1 or self.shard.attn_tp != 1:
            raise ValueError("forward_chunk_static needs one rank (tp = ep = 1)")
        cfg = self.cfg
        x = self.glob["embed"][tokens]
        S = cache.page_tokens
        slot = positions % S
        L = page_row.shape[0] * S
        mask = torch.arange(L, device=tokens.device)[None, :] <= positions[:, None]          # [T, L]
        gmap = self.__dict__.get("_gmap_dev")
        if gmap is None or gmap.device != tokens.device:   # made once, before any capture (no copy inside one)
            gmap = self._gmap_dev = self._gqa_map().to(tokens.device)
        for li, w in enumerate(self.layers):
            h = rms_norm(x, w["input_norm"], cfg.rms_eps)
            q, k, v = self._qkv(w, h, positions)                          # q [Hq, T, Dh], k/v [Hkv, T, Dh]
            st = cache.storage[li]
            st[write_page, 0, :, slot] = k.transpose(0, 1).to(st.dtype)
            st[write_page, 1, :, slot] = v.transpose(0, 1).to(st.dtype)
            kv = st[page_row]                                             # [P, 2, Hkv, S, Dh]
            K = kv[:, 0].permute(1, 0, 2, 3).reshape(kv.shape[2], L, -1).to(q.dtype)
            V = kv[:, 1].permute(1, 0, 2, 3).reshape(kv.shape[2], L, -1).to(q.dtype)
            o = F_.scaled_dot_product_attention(q, K[gmap], V[gmap], attn_mask=mask, scale=self.scale)
            x = x + o.transpose(0, 1).reshape(x.shape[0], -1) @ w["o_proj"].T
            h = rms_norm(x, w["post_norm"], cfg.rms_eps)
            x = x + moe_block(h, h @ w["router"].T, w["gate_up"], w["down"], cfg.top_k, swiglu=grouped_swiglu,
                              norm_topk_prob=cfg.norm_topk_prob)
        return self._logits(x.index_select(0, last))

    @scoped("a2a_s")
    def _moe_dp_ep(self, w, h: torch.Tensor, topi: torch.Tensor, topw: torch.Tensor) -> torch.Tensor:
        """Sparse all-to-all MoE: dispatch each token once per destination rank, apply local experts, combine."""
        ep = self.shard.ep
        if ep == 1:
            return self._local_experts(w, h, topi, topw)
        a2a = self._peer_a2a(h)
        if a2a is not None:
            return self._moe_dp_ep_peer(a2a, w, h, topi, topw)
        per = self.cfg.n_experts // ep
        k = self.cfg.top_k
        dst = topi // per                                                  # [B, k] owning rank of each choice
        B = h.shape[0]
        # one row per (token, destination rank) pair: token index and, per top-k slot, expert id or -1
        pair = torch.zeros(B, ep, dtype=torch.bool, device=h.device)
        if B:
            pair[torch.arange(B, device=h.device)[:, None].expand(B, k), dst] = True
        rows_d, rows_t = pair.T.nonzero(as_tuple=True)                    # sorted by destination, then token
        send_counts = torch.bincount(rows_d, minlength=ep)
        meta_ids = torch.where(dst[rows_t] == rows_d[:, None], topi[rows_t], torch.full_like(topi[rows_t], -1))
        meta_w = topw[rows_t]
        recv_counts = self.comm.ep_exchange_counts(send_counts)
        x_recv = self.comm.ep_all_to_all(h[rows_t], send_counts, recv_counts)
        ids_recv = self.comm.ep_all_to_all(meta_ids, send_counts, recv_counts)
        w_recv = self.comm.ep_all_to_all(meta_w, send_counts, recv_counts)
        masked_w = torch.where(ids_recv >= 0, w_recv, torch.zeros_like(w_recv))
        y_recv = self._local_experts(w, x_recv, ids_recv.clamp(min=0), masked_w)
        y_back = self.comm.ep_all_to_all(y_recv, recv_counts, send_counts)
        out = torch.zeros_like(h)
        out.index_add_(0, rows_t, y_back)
        return out

    # -- decode MoE communication over peer memory (kernels/moe_a2a.py) ---------------------------------------------
    def _peer_a2a(self, h: torch.Tensor):
        """The peer-memory dispatch/combine (``kernels.moe_a2a.PeerMoeAllToAll``, CuTe DSL kernels) for this EP
        group, made on first use, or None for the torch all-to-all path above. Used when the activations are bf16
        on CUDA, EP > 1 and RACKBED_PEER_A2A is not "0"; the object itself falls back (-> None here) when CuTe DSL
        or peer access is missing on any rank. Every rank of the group reaches the first call in the same step
        (forward_decode's contract), so the collective construction is matched. Capacity per call:
        RACKBED_A2A_MAX_TOKENS tokens per rank (default 256); larger batches go in agreed chunks."""
        a2a = getattr(self, "_a2a", None)
        if a2a is not None:
            return a2a or None
        self._a2a = False
        if (h.is_cuda and h.dtype == torch.bfloat16 and self.comm.ep_group is not None and
                os.environ.get("RACKBED_PEER_A2A", "1") != "0" and self.cfg.hidden % 128 == 0):
            from rackbed.kernels.moe_a2a import PeerMoeAllToAll

            tm = -(-int(os.environ.get("RACKBED_A2A_MAX_TOKENS", "256")) // 32) * 32
            obj = PeerMoeAllToAll(self.comm.ep_group, max_tokens=tm, hidden=self.cfg.hidden, top_k=self.cfg.top_k,
                                  n_experts=self.cfg.n_experts, payload="bf16", backend="auto")
            if obj.backend == "cute":
                self._a2a, self._a2a_out, self._a2a_chunks = obj, obj.alloc_outputs(), 1
            else:
                obj.close()
        return self._a2a or None

    def _moe_dp_ep_peer(self, a2a, w, h: torch.Tensor, topi: torch.Tensor, topw: torch.Tensor) -> torch.Tensor:
        """``_moe_dp_ep`` through the peer kernels: dispatch (rows land in fixed per-source slots, ids -1 past each
        source's count), the local experts on the slots, combine (fp32 sum per token over its destination ranks).
        The number of chunks of ``max_tokens`` is agreed once per decode step (at the first layer: one tiny
        all-reduce, which also surfaces a kernel timeout of the previous step)."""
        import torch.distributed as dist

        B = h.shape[0]
        tm = a2a.lay.max_tokens
        if w is self.layers[0]:
            nc = torch.tensor([-(-B // tm), 0], dtype=torch.int32, device=h.device)
            a2a.error_to(nc[1:])
            dist.all_reduce(nc, op=dist.ReduceOp.MAX, group=self.comm.ep_group)
            chunks, err = nc.tolist()
            if err:
                raise RuntimeError("peer MoE all-to-all: a kernel wait timed out on a rank of this EP group")
            self._a2a_chunks = max(1, chunks)
        out = torch.empty_like(h)
        o = self._a2a_out
        for c in range(self._a2a_chunks):
            lo, hi = min(c * tm, B), min((c + 1) * tm, B)
            a2a.dispatch(h[lo:hi].contiguous(), topi[lo:hi].to(torch.int32).contiguous(),
                         topw[lo:hi].float().contiguous(), o)
            y = self._local_experts(w, o["x"], o["ids"].long(), o["weights"].to(h.dtype))
            a2a.combine(y.contiguous(), out[lo:hi], hi - lo)
        return out

    @scoped("other_s")
    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.glob["final_norm"], self.cfg.rms_eps) @ self.glob["lm_head"].T


def paged_kernel_on(device, page_tokens: int, *widths: int) -> bool:
    """Whether decode attention on ``device`` over pages of ``page_tokens`` slots and rows of these widths runs
    ``kernels.paged_attention`` (Triton, pages read in place); ``RACKBED_PAGED_ATTENTION=torch`` keeps the torch
    gather (the reference)."""
    from rackbed.kernels.paged_attention import engine_uses, shape_unsupported

    return engine_uses(device) and shape_unsupported(page_tokens, *widths) is None


#: which grouped-GEMM implementation the experts use on CUDA: "auto" (the CuTe DSL decode kernel where it measured
#: faster, else torch._grouped_mm), "torch", or "cute_gemv". Set by RACKBED_GROUPED_IMPL or by benchmarks.
GROUPED_IMPL = os.environ.get("RACKBED_GROUPED_IMPL", "auto")


def grouped_swiglu(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """SwiGLU experts over rows grouped by expert: ``x [R, D]`` sorted by expert, ``counts [E]`` rows per expert,
    ``gate_up [E, 2F, D]``, ``down [E, D, F]`` -> ``[R, D]``.

    On CUDA: ``kernels.grouped_gemm.grouped_swiglu`` (the CuTe DSL weight-streaming kernel at decode shapes,
    ``torch._grouped_mm`` otherwise; it falls back to torch without CuTe DSL). Elsewhere a loop over the experts
    that have rows.
    """
    if x.is_cuda:
        from rackbed.kernels.grouped_gemm import grouped_swiglu as kernel

        return kernel(x, gate_up, down, counts, impl=GROUPED_IMPL)
    Fw = down.shape[-1]
    out = torch.empty(x.shape[0], down.shape[1], dtype=x.dtype, device=x.device)
    start = 0
    for e, n in enumerate(counts.tolist()):
        if n:
            xe = x[start:start + n]
            gu = xe @ gate_up[e].T
            out[start:start + n] = (F_.silu(gu[:, :Fw]) * gu[:, Fw:]) @ down[e].T
            start += n
    return out


def warm_graphs(runner, keys, reserve_bytes: int, budget_s: float) -> dict:
    """Capture ``runner``'s graphs for ``keys`` in order (``runner._capture(*key)``), while more than
    ``reserve_bytes`` of device memory stay free and within ``budget_s`` seconds; the first failed capture turns the
    runner eager and says why. Returns what was done."""
    import time

    t0, done, why = time.perf_counter(), 0, "all"
    dev = runner.cache.storage.device
    for key in keys:
        if runner.mode != "graph":
            why = "capture failed: " + runner.why
            break
        if time.perf_counter() - t0 > budget_s:
            why = f"time budget {budget_s:.0f} s"
            break
        free, _ = torch.cuda.mem_get_info(dev)
        if free < reserve_bytes:
            why = f"memory reserve ({free / 2**30:.1f} GiB free)"
            break
        if key not in runner.graphs:
            try:
                runner.graphs[key] = runner._capture(*key)
            except Exception as exc:  # fall back, once, and say why
                runner.mode, runner.why = "eager", f"{type(exc).__name__}: {exc}"[:300]
                continue
        done += 1
    torch.cuda.synchronize()
    return {"captured": done, "wanted": len(keys), "stopped_by": why, "seconds": round(time.perf_counter() - t0, 2),
            "free_gib": round(torch.cuda.mem_get_info(dev)[0] / 2**30, 1)}


class DecodeGraphRunner:
    """Replays CUDA graphs of ``forward_decode_static``, one per (batch bucket, page-table-width bucket).

    Batches are padded to the next bucket: padded rows read and write only a scratch page reserved here (and its
    ring, with sliding layers; and the state pool's scratch slot, with Gated DeltaNet layers), and their logits are
    dropped. Page tables are padded with each row's first page (the mask hides them); column 0 stays the sequence's
    first page, which names its sliding layers' ring. A model with Gated DeltaNet layers also gets the rows' state
    slots (``slots``), copied into a static buffer per replay. If capture fails (a kernel that is not capturable),
    the runner falls back to the eager static step and says why (``mode``); mode "static" runs that step from the
    start (no capture: the graph path's padding and inputs on any device).
    """

    BATCH_BUCKETS = DECODE_BATCH_BUCKETS

    PAGE_ROUND = PAGE_ROUND      # page-table widths are padded to a multiple of this

    def __init__(self, model: ShardedQwen3Moe, cache: PagedKvCache) -> None:
        self.model, self.cache = model, cache
        self.scratch = cache.alloc(1)[0]
        self.states = getattr(cache, "states", None)   # Gated DeltaNet state pool (``layers_gdn.HybridKvCache``)
        self.graphs: dict[tuple[int, int], tuple] = {}
        self.mode = "graph"
        self.why = ""
        self.pool = None            # one memory pool shared by every graph (they never replay concurrently)
        self.n_captured_late = 0    # captures that happened inside a decode step (not at warm-up)

    @classmethod
    def buckets(cls, max_batch: int, min_pages: int, max_pages: int) -> list[tuple[int, int]]:
        """The (batch bucket, padded page width) keys a run with at most ``max_batch`` sequences per step and
        page tables ``min_pages``..``max_pages`` wide can hit, largest first."""
        top = cls._bucket(max(max_batch, 1), cls.BATCH_BUCKETS)
        bs = [b for b in cls.BATCH_BUCKETS if b < top] + [top]
        r = cls.PAGE_ROUND
        ps = list(range(-(-max(min_pages, 1) // r) * r, -(-max(max_pages, 1) // r) * r + 1, r))
        return sorted(((b, p) for b in bs for p in ps), key=lambda k: (k[0] * k[1], k), reverse=True)

    @torch.inference_mode()
    def warm(self, max_batch: int, min_pages: int, max_pages: int, *, reserve_bytes: int = 8 << 30,
             budget_s: float = 90.0) -> dict:
        """Capture the likely buckets now (largest first, so the shared pool is sized once), while more than
        ``reserve_bytes`` of device memory stay free and within ``budget_s`` seconds. Returns what was done."""
        return warm_graphs(self, self.buckets(max_batch, min_pages, max_pages), reserve_bytes, budget_s)

    @staticmethod
    def _bucket(n: int, buckets) -> int:
        for b in buckets:
            if b >= n:
                return b
        return n

    def _capture(self, B: int, P: int):
        dev = self.cache.storage.device
        tok = torch.zeros(B, dtype=torch.long, device=dev)
        pos = torch.zeros(B, dtype=torch.long, device=dev)
        table = torch.full((B, P), self.scratch, dtype=torch.long, device=dev)
        slots = self._slots_buffer(B, dev)
        kw = {} if slots is None else {"slots": slots}
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                self.model.forward_decode_static(tok, pos, self.cache, table, hidden=True, **kw)
        torch.cuda.current_stream().wait_stream(s)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        g = torch.cuda.CUDAGraph()
        # thread_local: the rank's KV-transfer thread may be allocating and launching on its own stream meanwhile
        with torch.cuda.graph(g, pool=self.pool, capture_error_mode="thread_local"):
            out = self.model.forward_decode_static(tok, pos, self.cache, table, hidden=True, **kw)
        return g, tok, pos, table, slots, out

    def _slots_buffer(self, B: int, dev) -> torch.Tensor | None:
        """``[B]`` state slots, every row on the scratch slot (None without Gated DeltaNet layers)."""
        if self.states is None:
            return None
        return torch.full((B,), self.states.scratch, dtype=torch.long, device=dev)

    @torch.inference_mode()
    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, page_table: torch.Tensor, *,
                 slots: torch.Tensor | None = None, hidden: bool = False):
        """Logits ``[B, V]`` of the step (``hidden``: and the last hidden states ``[B, D]``). Rows of one sequence
        at consecutive positions (an MTP verify, ``engine.real.mtp``) are rows like any other: a bucket counts
        rows (not with Gated DeltaNet layers, whose state steps once per row). ``slots [B]``: the rows' state slots
        (a tensor on the device), for a model with Gated DeltaNet layers."""
        B, P = tokens.shape[0], page_table.shape[1]
        if (self.states is not None) != (slots is not None):
            raise ValueError("DecodeGraphRunner: state slots go with Gated DeltaNet layers, and only with them")
        Bb = self._bucket(B, self.BATCH_BUCKETS)
        Pb = -(-P // self.PAGE_ROUND) * self.PAGE_ROUND
        tab = torch.full((Bb, Pb), self.scratch, dtype=torch.long, device=page_table.device)
        tab[:B, :P] = page_table
        if Pb > P:
            tab[:B, P:] = page_table[:, :1]
        tk = torch.zeros(Bb, dtype=torch.long, device=tokens.device)
        ps = torch.zeros(Bb, dtype=torch.long, device=tokens.device)
        tk[:B], ps[:B] = tokens, positions
        sl = self._slots_buffer(Bb, tokens.device)
        if sl is not None and slots is not None:
            sl[:B] = slots
        if self.mode == "graph":
            key = (Bb, Pb)
            if key not in self.graphs:
                self.n_captured_late += 1
                try:
                    self.graphs[key] = self._capture(Bb, Pb)
                except Exception as exc:  # fall back, once, and say why
                    self.mode, self.why = "eager", f"{type(exc).__name__}: {exc}"[:300]
            if self.mode == "graph":
                g, tok_b, pos_b, tab_b, sl_b, out = self.graphs[key]
                tok_b.copy_(tk)
                pos_b.copy_(ps)
                tab_b.copy_(tab)
                if sl_b is not None:
                    sl_b.copy_(sl)
                g.replay()
                return (out[0][:B], out[1][:B]) if hidden else out[0][:B]
        kw = {} if sl is None else {"slots": sl}
        lo, x = self.model.forward_decode_static(tk, ps, self.cache, tab, hidden=True, **kw)
        return (lo[:B], x[:B]) if hidden else lo[:B]


class PrefillGraphRunner:
    """Replays CUDA graphs of ``forward_chunk_static``: a prompt (or a chunk of one, or the suffix after a cached
    prefix) per replay, one graph per (token bucket, page-table-width bucket).

    A chunk of ``n`` tokens is padded to the next token bucket; padding rows write their KV to a scratch page and
    their outputs are dropped, so only the bucket's extra compute is paid. Page rows are padded with the sequence's
    first page (masked by position). A batch of several prompts replays one graph per prompt. Capture failures
    fall back to the eager ``forward_prefill`` and say why (``mode``), as :class:`DecodeGraphRunner` does; mode
    "static" runs ``forward_chunk_static`` on the padded inputs without capture (chunks within the buckets).

    Every family's model has ``forward_chunk_static`` (Qwen3-MoE here; DeepSeek-V3 / Kimi-K2 / GLM-4.5 / gpt-oss /
    Qwen3.5 in ``families``). A model with Gated DeltaNet layers (Qwen3.5) also takes the sequence's state slot per
    chunk (``slot``, copied into a static buffer; captures run on the state pool's scratch slot); a chunk at
    position 0 starts from a zeroed state, a later chunk continues the slot's.
    ``scratch``: a scratch page to share (the decode runner's: the two never run at once), else one of its own.
    """

    TOKEN_BUCKETS = PREFILL_TOKEN_BUCKETS
    PAGE_ROUND = PAGE_ROUND

    def __init__(self, model: ShardedQwen3Moe, cache: PagedKvCache, pool=None, scratch: int | None = None) -> None:
        self.model, self.cache = model, cache
        self.scratch = cache.alloc(1)[0] if scratch is None else scratch
        self.states = getattr(cache, "states", None)   # Gated DeltaNet state pool (``layers_gdn.HybridKvCache``)
        self.graphs: dict[tuple[int, int], tuple] = {}
        self.mode = "graph"
        self.why = ""
        self.pool = pool
        self.n_captured_late = 0
        self.n_eager = 0            # chunks longer than the largest bucket (run eagerly)

    @classmethod
    def key(cls, start: int, n: int, page_tokens: int) -> tuple[int, int] | None:
        """The (token bucket, page bucket) of a chunk of ``n`` tokens after ``start``; None past the buckets."""
        return prefill_key(start, n, page_tokens)

    #: keys captured at warm-up at most (``RACKBED_PREFILL_GRAPH_KEYS``); the warm-up's time budget and memory
    #: reserve may stop it sooner
    MAX_WARM_KEYS = int(os.environ.get("RACKBED_PREFILL_GRAPH_KEYS", "1024"))

    @classmethod
    def warm_plan(cls, lo: int, hi: int, chunk: int, page_tokens: int, *, block_tokens: int = 0,
                  max_cached: int | None = None, limit: int | None = None) -> tuple[list[tuple[int, int]], int]:
        """``(keys to capture, keys reachable)`` of a run whose prompts are ``lo..hi`` tokens long: whole prompts
        (``chunk`` 0), or chunks of at most ``chunk`` tokens at any start; with a prefix cache of
        ``block_tokens``-token blocks (at most ``max_cached`` tokens), also the suffix after every block-aligned
        cached prefix (``engine.core.graph_shapes.prefill_reach``). At most ``limit`` keys (None:
        :attr:`MAX_WARM_KEYS`), in capture order (``prefill_warm_order``: the largest first, then those of chunks
        starting at token 0, then by how many chunks reach them); a caller compares the two counts to say how many
        keys were left to capture on first use."""
        reach, zero = prefill_reach(lo, hi, page_tokens, chunk=chunk, block_tokens=block_tokens,
                                    max_cached=max_cached)
        return prefill_warm_order(reach, zero, cls.MAX_WARM_KEYS if limit is None else limit), len(reach)

    @classmethod
    def warm_keys(cls, lo: int, hi: int, chunk: int, page_tokens: int, **kw) -> list[tuple[int, int]]:
        """The keys of :meth:`warm_plan`."""
        return cls.warm_plan(lo, hi, chunk, page_tokens, **kw)[0]

    @torch.inference_mode()
    def warm(self, keys, *, reserve_bytes: int = 8 << 30, budget_s: float = 90.0) -> dict:
        """Capture ``keys`` now (as :meth:`DecodeGraphRunner.warm`)."""
        return warm_graphs(self, keys, reserve_bytes, budget_s)

    def _capture(self, T: int, P: int):
        dev = self.cache.storage.device
        tok = torch.zeros(T, dtype=torch.long, device=dev)
        pos = torch.zeros(T, dtype=torch.long, device=dev)
        wpage = torch.full((T,), self.scratch, dtype=torch.long, device=dev)
        row = torch.full((P,), self.scratch, dtype=torch.long, device=dev)
        last = torch.zeros(1, dtype=torch.long, device=dev)
        slot = None if self.states is None else torch.full((1,), self.states.scratch, dtype=torch.long, device=dev)
        kw = {} if slot is None else {"slot": slot}
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                self.model.forward_chunk_static(tok, pos, wpage, row, last, self.cache, **kw)
        torch.cuda.current_stream().wait_stream(s)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self.pool, capture_error_mode="thread_local"):
            out = self.model.forward_chunk_static(tok, pos, wpage, row, last, self.cache, **kw)
        return g, tok, pos, wpage, row, last, slot, out

    def inputs(self, ids: torch.Tensor, start: int, pages: list[int], T: int, P: int):
        """The padded static inputs of a chunk: ``ids [n]`` at positions ``start..start+n-1`` of ``pages``."""
        dev, S, n = ids.device, self.cache.page_tokens, int(ids.numel())
        tok = torch.zeros(T, dtype=torch.long, device=dev)
        tok[:n] = ids
        p = list(range(start, start + n))
        pos_l = p + [p[-1]] * (T - n)
        wp = [pages[q // S] for q in p] + [self.scratch] * (T - n)
        row = list(pages[:P]) + [pages[0]] * (P - min(P, len(pages)))
        t = torch.tensor([pos_l, wp], dtype=torch.long).to(dev, non_blocking=True)
        return (tok, t[0], t[1], torch.tensor(row, dtype=torch.long).to(dev, non_blocking=True),
                torch.tensor([n - 1], dtype=torch.long).to(dev, non_blocking=True))

    @torch.inference_mode()
    def __call__(self, ids: torch.Tensor, start: int, pages: list[int], slot: int | None = None) -> torch.Tensor:
        """Logits ``[1, V]`` of the chunk's last token; its KV is written into ``pages``. ``slot``: the sequence's
        state slot, for a model with Gated DeltaNet layers (zeroed when ``start`` is 0: a freshly allocated one;
        else holding the state the earlier chunks left)."""
        if (self.states is not None) != (slot is not None):
            raise ValueError("PrefillGraphRunner: a state slot goes with Gated DeltaNet layers, and only with them")
        key = self.key(start, int(ids.numel()), self.cache.page_tokens)
        if key is not None and self.mode == "static":
            tok, pos, wp, row, last = self.inputs(ids, start, pages, *key)
            sl = None if slot is None else torch.tensor([slot], device=ids.device)
            return self.model.forward_chunk_static(tok, pos, wp, row, last, self.cache, sl)
        if key is None or self.mode != "graph":
            self.n_eager += key is None
            return self._eager(ids, start, pages, slot)
        if key not in self.graphs:
            self.n_captured_late += 1
            try:
                self.graphs[key] = self._capture(*key)
            except Exception as exc:  # fall back, once, and say why
                self.mode, self.why = "eager", f"{type(exc).__name__}: {exc}"[:300]
                return self._eager(ids, start, pages, slot)
        g, tok_b, pos_b, wp_b, row_b, last_b, slot_b, out = self.graphs[key]
        for dst, src in zip((tok_b, pos_b, wp_b, row_b, last_b), self.inputs(ids, start, pages, *key)):
            dst.copy_(src)
        if slot_b is not None:
            slot_b.fill_(slot)
        g.replay()
        return out

    def _eager(self, ids: torch.Tensor, start: int, pages: list[int], slot: int | None) -> torch.Tensor:
        """The chunk through the eager ``forward_prefill`` (a later chunk continues the slot's state)."""
        kw = {} if slot is None else {"slots": [slot], "resume": True}
        return self.model.forward_prefill([ids], self.cache, [pages], [start], **kw)
