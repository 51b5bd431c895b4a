"""DeepSeek-V3 / Kimi-K2 (MLA), gpt-oss, GLM-4.5 and Qwen3.5 in torch, sharded like Qwen3-MoE
(``engine.real.model``).

``ShardedMoeLM`` extends ``ShardedQwen3Moe`` with per-layer kinds: token mixer "mla" (``layers_mla``), "full" /
"sliding" GQA with biases, sinks, windows, partial rotary and Qwen3.5's sigmoid output gate (``layers_gqa``), or
"linear" Gated DeltaNet (``layers_gdn``); FFN dense (``dense_layers``) or MoE with the family's routing, expert
biases / clamped SwiGLU and a shared expert, ungated or (Qwen3.5) sigmoid-gated (``layers_moe``).

Prefill (TP attention, EP experts, replicated input): each rank runs its heads; the attention output, the dense
MLP and the shared expert are split over the TP group (heads / F slices) and summed by the TP all-reduce, the
routed experts over the expert group by the EP all-reduce (one all-reduce for both when the groups coincide). The
MLA latent cache is whole on every TP rank. Decode (DP attention, EP experts): every rank holds all heads, the dense
MLP and the shared expert whole, and the routed experts go through the sparse all-to-all of ``ShardedQwen3Moe``.

Caches: MLA models use ``layers_mla.LatentKvCache`` (``[L, P, S, kv_lora + rope]``), the others the HND
``PagedKvCache``: full layers in pages that grow with the sequence, sliding layers (gpt-oss) on a per-sequence ring
of the window (``model.ring_pages``), so a long prompt costs its full layers' pages plus one ring. Qwen3.5 uses
``layers_gdn.HybridKvCache``: pages for its full-attention layers only, plus a state slot per sequence for the
linear layers (``slots``: the sequences' slots, passed to ``forward_prefill`` / ``forward_decode``, and as device
tensors to the graph-capturable ``forward_chunk_static`` / ``forward_decode_static``). The paged
cache is indexed by the layer's place among the layers it holds (``TorchModelConfig.kv_layers``, then the MTP
module's layer ``n_layers`` when a DeepSeek-V3 / GLM-4.5 model runs it as the draft: ``ShardedMoeLM.kv_layers``,
``engine.real.mtp``). Qwen3.5's linear layers run on one attention rank (no prefill TP); transformers' zero-centred
RMSNorm weights (``1 + w``) are stored as ``1 + w`` on load.
"""

from __future__ import annotations

import torch

from rackbed.engine.real import layers_gdn, layers_gqa, layers_mla, layers_moe
from rackbed.engine.real.comm import Comm
from rackbed.engine.real.config import TorchModelConfig
from rackbed.engine.real.model import (
    PagedKvCache,
    Shard,
    ShardedQwen3Moe,
    _randn,
    random_global_weights,
    rms_norm,
)
from rackbed.engine.real.profiling import scoped
from rackbed.engine.real.rope import rope_of
from rackbed.engine.real.weight_splits import shard_weights


def layer_shapes(cfg: TorchModelConfig, li: int) -> dict[str, tuple[tuple[int, ...], str]]:
    """Name -> (full shape, init) of layer ``li``'s weights; init "w" (std ``init_std``), "norm" (1 + N(0, 0.1)),
    "small" (N(0, 0.1): biases, sinks, routing correction). The drawing order is this dict's. ``li = n_layers``
    is the MTP module: an MoE decoder layer of the model's global attention, then ``enorm`` / ``hnorm`` (RMSNorms
    of the next token's embedding and of the target's hidden state) and ``eh_proj [D, 2D]`` (their concatenation,
    embedding first, to the layer's input)."""
    D, H = cfg.hidden, cfg.n_q_heads
    out: dict[str, tuple[tuple[int, ...], str]] = {"input_norm": ((D,), "norm"), "post_norm": ((D,), "norm")}
    if cfg.kind(li) == "mla":
        qk = cfg.head_dim
        if cfg.q_lora_rank:
            out.update(q_a=((cfg.q_lora_rank, D), "w"), q_a_norm=((cfg.q_lora_rank,), "norm"),
                       q_b=((H * qk, cfg.q_lora_rank), "w"))
        else:
            out["q_proj"] = ((H * qk, D), "w")
        out.update(kv_a=((cfg.kv_lora_rank + cfg.qk_rope_head_dim, D), "w"), kv_a_norm=((cfg.kv_lora_rank,), "norm"),
                   kv_b=((H * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank), "w"),
                   o_proj=((D, H * cfg.v_head_dim), "w"))
    elif cfg.kind(li) == "linear":
        out.update(layers_gdn.shapes(cfg))
    else:
        Dh, Hk = cfg.head_dim, cfg.n_kv_heads
        out.update(q_proj=((H * Dh, D), "w"), k_proj=((Hk * Dh, D), "w"), v_proj=((Hk * Dh, D), "w"),
                   o_proj=((D, H * Dh), "w"))
        if cfg.qkv_bias:
            out.update(q_bias=((H * Dh,), "small"), k_bias=((Hk * Dh,), "small"), v_bias=((Hk * Dh,), "small"))
        if cfg.o_bias:
            out["o_bias"] = ((D,), "small")
        if cfg.qk_norm:
            out.update(q_norm=((Dh,), "norm"), k_norm=((Dh,), "norm"))
        if cfg.sinks:
            out["sinks"] = ((H,), "small")
        if cfg.gated_attn:
            out["gate_proj"] = ((H * Dh, D), "w")
    if cfg.is_dense(li):
        Fd = cfg.dense_intermediate
        return out | {"mlp_gate_up": ((2 * Fd, D), "w"), "mlp_down": ((D, Fd), "w")}
    if li >= cfg.n_layers:      # an MTP module: its decoder layer (above and below), then what feeds it
        return _moe_shapes(cfg, out) | {"enorm": ((D,), "norm"), "hnorm": ((D,), "norm"), "eh_proj": ((D, 2 * D), "w")}
    return _moe_shapes(cfg, out)


def _moe_shapes(cfg: TorchModelConfig, out: dict) -> dict[str, tuple[tuple[int, ...], str]]:
    D = cfg.hidden
    E, F = cfg.n_experts, cfg.moe_intermediate
    out.update(router=((E, D), "w"), gate_up=((E, 2 * F, D), "w"), down=((E, D, F), "w"))
    if cfg.routing == "sigmoid_group":
        out["e_bias"] = ((E,), "small")
    if cfg.family == "gpt_oss":
        out.update(router_bias=((E,), "small"), gate_up_bias=((E, 2 * F), "small"), down_bias=((E, D), "small"))
    if cfg.shared_intermediate:
        Fs = cfg.shared_intermediate
        out.update(shared_gate_up=((2 * Fs, D), "w"), shared_down=((D, Fs), "w"))
        if cfg.shared_gate:
            out["shared_gate"] = ((1, D), "w")
    return out


def random_layer(cfg: TorchModelConfig, li: int, seed: int, device, dtype) -> dict[str, torch.Tensor]:
    """Full weights of layer ``li`` from a generator seeded by (seed, layer), drawn on ``device``."""
    dev = torch.device(device)
    gen = torch.Generator(device=dev)
    gen.manual_seed(seed * 1_000_003 + li + 1)
    out = {}
    for name, (shape, init) in layer_shapes(cfg, li).items():
        std = {"w": cfg.init_std, "norm": 0.1, "small": 0.1, "conv": 0.3}[init]
        t = _randn(shape, gen, std, dev, dtype)
        out[name] = 1.0 + t if init == "norm" else t
    return out


def _hf_experts(state, p: str, cfg: TorchModelConfig, li: int) -> dict[str, torch.Tensor]:
    g = state.get
    if cfg.family == "gpt_oss":
        gu = state[p + "mlp.experts.gate_up_proj"].transpose(1, 2)              # [E, 2F, D], gate/up interleaved
        gub = state[p + "mlp.experts.gate_up_proj_bias"]
        return {"router": state[p + "mlp.router.weight"], "router_bias": state[p + "mlp.router.bias"],
                "gate_up": torch.cat((gu[:, 0::2], gu[:, 1::2]), 1).contiguous(),
                "gate_up_bias": torch.cat((gub[:, 0::2], gub[:, 1::2]), 1).contiguous(),
                "down": state[p + "mlp.experts.down_proj"].transpose(1, 2).contiguous(),
                "down_bias": state[p + "mlp.experts.down_proj_bias"]}
    out = {"router": state[p + "mlp.gate.weight"]}
    if cfg.routing == "sigmoid_group":
        out["e_bias"] = state[p + "mlp.gate.e_score_correction_bias"]
    if g(p + "mlp.experts.gate_up_proj") is not None:
        out.update(gate_up=state[p + "mlp.experts.gate_up_proj"], down=state[p + "mlp.experts.down_proj"])
    else:
        r = range(cfg.n_experts)
        out["gate_up"] = torch.stack([torch.cat([state[f"{p}mlp.experts.{e}.gate_proj.weight"],
                                                 state[f"{p}mlp.experts.{e}.up_proj.weight"]]) for e in r])
        out["down"] = torch.stack([state[f"{p}mlp.experts.{e}.down_proj.weight"] for e in r])
    if cfg.shared_intermediate:
        s = p + ("mlp.shared_expert." if cfg.shared_gate else "mlp.shared_experts.")
        out.update(shared_gate_up=torch.cat([state[s + "gate_proj.weight"], state[s + "up_proj.weight"]]),
                   shared_down=state[s + "down_proj.weight"])
        if cfg.shared_gate:
            out["shared_gate"] = state[p + "mlp.shared_expert_gate.weight"]
    return out


#: weights transformers stores zero-centred (the norm multiplies by ``1 + w``): Qwen3.5's RMSNorms
_CENTRED = ("input_norm", "post_norm", "q_norm", "k_norm")


def hf_layer(state: dict[str, torch.Tensor], cfg: TorchModelConfig, li: int) -> dict[str, torch.Tensor]:
    """Layer ``li``'s full weights from a transformers state dict of the family (fused or per-expert experts)."""
    p = f"model.layers.{li}."
    a = p + "self_attn."
    out = {"input_norm": state[p + "input_layernorm.weight"], "post_norm": state[p + "post_attention_layernorm.weight"]}
    if cfg.kind(li) == "linear":
        out |= layers_gdn.hf_weights(state, p + "linear_attn.")
    elif cfg.kind(li) == "mla":
        names = {"q_a": "q_a_proj.weight", "q_a_norm": "q_a_layernorm.weight", "q_b": "q_b_proj.weight",
                 "q_proj": "q_proj.weight", "kv_a": "kv_a_proj_with_mqa.weight", "kv_a_norm": "kv_a_layernorm.weight",
                 "kv_b": "kv_b_proj.weight", "o_proj": "o_proj.weight"}
    else:
        names = {f"{x}_proj": f"{x}_proj.weight" for x in "qkvo"} | {f"{x}_bias": f"{x}_proj.bias" for x in "qkvo"}
        names |= {"q_norm": "q_norm.weight", "k_norm": "k_norm.weight", "sinks": "sinks"}
    if cfg.kind(li) != "linear":
        out |= {k: state[a + v] for k, v in names.items() if a + v in state}
    if cfg.gated_attn and cfg.kind(li) == "full":     # per head: Dh query rows, then Dh output-gate rows
        Dh = cfg.head_dim
        qg = out["q_proj"].view(cfg.n_q_heads, 2 * Dh, -1)
        out["q_proj"], out["gate_proj"] = (qg[:, :Dh].reshape(-1, qg.shape[-1]),
                                           qg[:, Dh:].reshape(-1, qg.shape[-1]))
    if cfg.family == "qwen3_5_moe":
        out |= {k: 1.0 + out[k].float() for k in _CENTRED if k in out}
    if li >= cfg.n_layers:      # the MTP module's own pieces (its head norm when the checkpoint has one)
        out |= {"enorm": state[p + "enorm.weight"], "hnorm": state[p + "hnorm.weight"],
                "eh_proj": state[p + "eh_proj.weight"]}
        if p + "shared_head.norm.weight" in state:
            out["head_norm"] = state[p + "shared_head.norm.weight"]
    if cfg.is_dense(li):
        out.update(mlp_gate_up=torch.cat([state[p + "mlp.gate_proj.weight"], state[p + "mlp.up_proj.weight"]]),
                   mlp_down=state[p + "mlp.down_proj.weight"])
        return out
    return out | _hf_experts(state, p, cfg, li)


def shard_layer(full: dict[str, torch.Tensor], cfg: TorchModelConfig, shard: Shard, li: int) -> dict[str, torch.Tensor]:
    """Slice layer ``li``'s full weights to what ``shard`` holds (``weight_splits.SPLITS``): heads of its TP
    place, the dense MLP and shared expert's F slice (prefill TP), its experts."""
    return shard_weights(full, cfg, shard, li)


class ShardedMoeLM(ShardedQwen3Moe):
    """One rank's slice of a DeepSeek-V3 / gpt-oss / GLM-4.5 model (module docstring)."""

    def __init__(self, cfg: TorchModelConfig, shard: Shard, comm: Comm, layers, glob, mtp=None) -> None:
        super().__init__(cfg, shard, comm, layers, glob)
        self.rope = rope_of(cfg)
        #: the MTP module's weights (layer ``n_layers``: ``layer_shapes``), or None when it is not run
        self.mtp = mtp
        #: the layers of the paged cache, in order: the decoder's (``cfg.kv_layers``), then the MTP module's when it
        #: runs (it has global attention, so its KV is paged whole: window 0)
        self.kv_layers = cfg.kv_layers + ((cfg.n_layers,) if mtp is not None else ())
        self.kv_windows = cfg.kv_windows + (0,) * (len(self.kv_layers) - len(cfg.kv_layers))
        self.n_kv_layers = len(self.kv_layers)
        self._kvi = {li: j for j, li in enumerate(self.kv_layers)}       # layer -> its layer in the paged cache
        self._lini = {li: j for j, li in enumerate(cfg.linear_layers)}   # linear layer -> its layer in the pool

    @staticmethod
    def _check_mtp(cfg: TorchModelConfig, mtp: bool) -> None:
        if mtp and not cfg.runs_mtp:
            raise ValueError(f"{cfg.family} model with {cfg.mtp_layers} MTP layers: the torch engine runs the MTP "
                             "module of DeepSeek-V3 / GLM-4.5 models that have one")

    @classmethod
    def random(cls, cfg, shard, comm, *, seed: int = 0, device="cpu", dtype=torch.float32,
               mtp: bool = False, mtp_agree: float | None = None) -> ShardedMoeLM:
        """Seeded random weights; ``mtp``: the MTP module too (drawn like layer ``n_layers``). ``mtp_agree``
        p: the embedding, lm head and MTP ``eh_proj`` reshaped so the target's greedy tokens follow a fixed
        permutation and the MTP module's drafts agree with them on a fraction p of tokens
        (``engine.real.agreeing``); the target's weights depend on (seed, p) alone, with or without the
        module."""
        if mtp_agree is not None and not cfg.runs_mtp:
            raise ValueError(f"mtp_agree: the {cfg.family} model has no MTP module the torch engine runs")
        cls._check_mtp(cfg, mtp)
        n = cfg.n_layers + (1 if mtp else 0)
        layers = [shard_layer(random_layer(cfg, i, seed, device, dtype), cfg, shard, i) for i in range(n)]
        glob = random_global_weights(cfg, seed, device, dtype)
        module = layers[cfg.n_layers] if mtp else None
        if mtp_agree is not None:
            from rackbed.engine.real.agreeing import make_agreeing

            make_agreeing(cfg, glob, module, mtp_agree, seed)
        return cls(cfg, shard, comm, layers[:cfg.n_layers], glob, mtp=module)

    @classmethod
    def from_state_dict(cls, state, cfg, shard, comm, *, device="cpu", dtype=torch.float32,
                        mtp: bool = False) -> ShardedMoeLM:
        """From a transformers state dict of the family; ``mtp``: the MTP module too (keys
        ``model.layers.{n_layers}.*``, as DeepSeek-V3 checkpoints hold it). Qwen3.5's published (multimodal)
        checkpoints keep the text model under ``model.language_model.``: read as ``model.`` (the vision tower and
        MTP layers are not read: the engine runs no Qwen3.5 MTP module)."""
        from rackbed.engine.real.model import hf_global_weights

        cls._check_mtp(cfg, mtp)
        if cfg.family == "qwen3_5_moe":
            pre = "model.language_model."
            state = {("model." + k[len(pre):] if k.startswith(pre) else k): v for k, v in state.items()}
        conv = lambda t: t.to(device=device, dtype=dtype)
        n = cfg.n_layers + (1 if mtp else 0)
        if mtp and f"model.layers.{cfg.n_layers}.eh_proj.weight" not in state:
            raise ValueError(f"checkpoint has no MTP module (model.layers.{cfg.n_layers}.eh_proj.weight)")
        layers = [{k: conv(v) for k, v in shard_layer(hf_layer(state, cfg, i), cfg, shard, i).items()}
                  for i in range(n)]
        glob = hf_global_weights(state, cfg)
        if cfg.family == "qwen3_5_moe":
            glob["final_norm"] = 1.0 + glob["final_norm"].float()
        return cls(cfg, shard, comm, layers[:cfg.n_layers], {k: conv(v) for k, v in glob.items()},
                   mtp=layers[cfg.n_layers] if mtp else None)

    def new_cache(self, n_pages: int, page_tokens: int, *, device=None, dtype=None,
                  ring_seqs: int | None = None, state_slots: int = 0) -> PagedKvCache:
        """The rank's cache of every layer in ``kv_layers`` (the MTP module's, layer ``n_layers``, included when it
        runs): ``n_pages`` pages of the full layers and, with sliding layers, ``ring_seqs`` rings (None:
        ``n_pages``, one per page, so rings never run out before pages: every sequence holds a page); with linear
        layers (``layers_gdn.HybridKvCache``) pages for the full-attention layers only and ``state_slots``
        sequences' Gated DeltaNet state."""
        ref = self.glob["embed"]
        if self.cfg.has_linear:
            cfg = self.cfg
            cache = layers_gdn.HybridKvCache(self.n_kv_layers, n_pages, len(self.kv_heads), page_tokens,
                                             cfg.head_dim, dtype=dtype or ref.dtype, device=device or ref.device)
            cache.states = layers_gdn.GdnStatePool(cfg, state_slots, dtype=dtype or ref.dtype,
                                                   device=device or ref.device)
            return cache
        if self.cfg.is_mla:
            return layers_mla.LatentKvCache(self.n_kv_layers, n_pages, 1, page_tokens,
                                            self.cfg.kv_lora_rank + self.cfg.qk_rope_head_dim,
                                            dtype=dtype or ref.dtype, device=device or ref.device)
        return PagedKvCache(self.n_kv_layers, n_pages, len(self.kv_heads), page_tokens, self.cfg.head_dim,
                            dtype=dtype or ref.dtype, device=device or ref.device, windows=self.kv_windows,
                            ring_seqs=n_pages if ring_seqs is None else ring_seqs)

    def _window(self, li: int) -> int:
        return self.cfg.sliding_window if self.cfg.kind(li) == "sliding" else 0

    @scoped("moe_gemm_s")
    def _experts(self, w, xs, counts):
        return layers_moe.experts(w, xs, counts, self.cfg)

    @scoped("other_s")
    def _route(self, w, h):
        return layers_moe.route(w, h, self.cfg)

    # -- prefill --------------------------------------------------------------------------------------------------
    @scoped("attn_s")
    def _attn_prefill(self, li: int, w, h, pos, lens, starts, cache, page_tables, slots=None) -> torch.Tensor:
        """The rank's partial attention output ``[T, D]`` (o_proj of its heads; no o bias), KV written. A sequence
        with ``starts[i]`` > 0 follows a cached prefix whose KV (latent rows) is read from its pages. A linear layer
        runs each sequence's recurrence from its state slot ``slots[i]`` (updated)."""
        cfg, outs, off = self.cfg, [], 0
        if cfg.kind(li) == "linear":
            for si, n in enumerate(lens):
                outs.append(layers_gdn.prefill(w, h[off:off + n], cfg, cache.states, self._lini[li], slots[si]))
                off += n
            return torch.cat(outs)
        kl = self._kvi[li]
        if cfg.kind(li) == "mla":
            q_nope, q_rot, rows = layers_mla.project(w, h, pos, cfg, self.rope)
            for si, n in enumerate(lens):
                c = starts[si]
                prefix = cache.read_rows(kl, page_tables[si], c) if c else None
                cache.write_rows(kl, page_tables[si], c, rows[off:off + n])
                outs.append(layers_mla.prefill(w, q_nope[off:off + n], q_rot[off:off + n], rows[off:off + n], cfg,
                                               prefix))
                off += n
        else:
            q, k, v = layers_gqa.qkv(w, h, pos, cfg, self.rope)
            win = self._window(li)
            for si, n in enumerate(lens):        # local q heads of one local KV head are contiguous
                c = starts[si]
                ks, vs = k[:, off:off + n], v[:, off:off + n]
                k0 = max(0, c - win + 1) if win else 0     # a sliding layer's ring holds the window's prefix
                if c:                                      # read before the write: it may overwrite ring slots
                    kc, vc = cache.read(kl, page_tables[si], c, first=k0)
                    ks, vs = torch.cat([kc.to(ks.dtype), ks], 1), torch.cat([vc.to(vs.dtype), vs], 1)
                cache.write(kl, page_tables[si], c, k[:, off:off + n], v[:, off:off + n])
                outs.append(layers_gqa.prefill(w, q[:, off:off + n], ks, vs, win, cfg, c, k0 if c else 0))
                off += n
        o = torch.cat(outs)
        if "gate_proj" in w:                                  # Qwen3.5: per-head sigmoid output gate
            o = o * torch.sigmoid(h @ w["gate_proj"].T)
        return o @ w["o_proj"].T

    def _ffn_prefill(self, w, h: torch.Tensor) -> torch.Tensor:
        """Dense MLP (TP slice, all-reduced), or routed experts (EP all-reduce) + shared expert (TP slice)."""
        if "mlp_gate_up" in w:
            return self.comm.tp_all_reduce(layers_moe.mlp(h, w["mlp_gate_up"], w["mlp_down"]))
        topi, topw = self._route(w, h)
        y = self._local_experts(w, h, topi, topw)
        if "shared_gate_up" not in w:
            return self.comm.ep_all_reduce(y)
        s = self._shared(w, h)
        if self.comm.tp_group is not None and self.comm.tp_group is self.comm.ep_group:
            return self.comm.ep_all_reduce(y + s)                        # one all-reduce for both partial sums
        return self.comm.ep_all_reduce(y) + self.comm.tp_all_reduce(s)

    def _shared(self, w, h: torch.Tensor) -> torch.Tensor:
        """The shared expert of ``h`` (times ``sigmoid(h @ shared_gate)`` when gated)."""
        s = layers_moe.mlp(h, w["shared_gate_up"], w["shared_down"])
        return s * torch.sigmoid(h @ w["shared_gate"].T) if "shared_gate" in w else s

    def _slots(self, slots, n: int):
        if not self.cfg.has_linear:
            return None
        if slots is None or len(slots) != n:
            raise ValueError(f"a model with Gated DeltaNet layers needs one state slot per sequence ({n}), got "
                             f"{None if slots is None else len(slots)}")
        return slots

    def _prefill_layer(self, li, w, x, pos, lens, starts, cache, page_tables, slots=None):
        cfg = self.cfg
        h = rms_norm(x, w["input_norm"], cfg.rms_eps)
        a = self.comm.tp_all_reduce(self._attn_prefill(li, w, h, pos, lens, starts, cache, page_tables, slots))
        x = x + (a + w["o_bias"] if "o_bias" in w else a)
        return x + self._ffn_prefill(w, rms_norm(x, w["post_norm"], cfg.rms_eps))

    def forward_prefill(self, seqs, cache, page_tables, starts=None, slots=None, *, resume: bool = False):
        """As ``ShardedQwen3Moe.forward_prefill``: prompts, or prompt suffixes after a cached prefix of
        ``starts[i]`` tokens whose KV is already in ``page_tables[i]`` (read, never recomputed), or a later chunk
        of a prompt after the chunks before it. With linear layers, ``slots[i]`` is sequence i's state slot in
        ``cache.states``: zeroed for a prompt's first tokens; a sequence with ``starts[i] > 0`` continues the
        state its slot holds, which only a later chunk has (``resume``: the caller says the sequences with a start
        are later chunks; a cached prefix cannot be resumed, no state snapshot is kept).

        With the MTP module (``self.mtp``) its KV is written too, as the draft reads it in decode steps: position
        j's row is the module's input at j, the target's last hidden state there and the embedding of the token
        at j + 1 (the prompt's next token, or the greedy first token after the last position). After a cached
        prefix, the module's row of the prefix's last position is the cached one, computed with the next token of
        the prompt that cached it; a chunk's last row is computed with the greedy token after the chunk, not the
        next chunk's first (both only steer drafts, never the tokens emitted)."""
        lens = [int(s.numel()) for s in seqs]
        starts = list(starts) if starts is not None else [0] * len(seqs)
        slots = self._slots(slots, len(seqs))
        if slots is not None and any(starts) and not resume:
            raise ValueError("Gated DeltaNet layers cannot resume a cached prefix (no state snapshot is kept)")
        ids = torch.cat(seqs)
        pos = torch.cat([torch.arange(c, c + n, device=ids.device) for c, n in zip(starts, lens)])
        x = self.glob["embed"][ids]
        for li, w in enumerate(self.layers):
            x = self._prefill_layer(li, w, x, pos, lens, starts, cache, page_tables, slots)
        last = torch.tensor(lens, device=ids.device).cumsum(0) - 1
        logits = self._logits(x[last])
        if self.mtp is not None:
            nxt = torch.roll(ids, -1)
            nxt[last] = logits.argmax(-1)
            self._prefill_layer(self.cfg.n_layers, self.mtp, self._mtp_input(nxt, x), pos, lens, starts, cache,
                                page_tables)
        return logits

    # -- the MTP module (draft) --------------------------------------------------------------------------------------
    def _mtp_input(self, tokens: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """The MTP module's layer input: ``eh_proj([enorm(embed(next token)), hnorm(hidden)])``."""
        w, eps = self.mtp, self.cfg.rms_eps
        e = rms_norm(self.glob["embed"][tokens], w["enorm"], eps)
        return torch.cat((e, rms_norm(hidden, w["hnorm"], eps)), -1) @ w["eh_proj"].T

    def forward_mtp(self, tokens, hidden, positions, cache, page_table):
        """One draft forward of the MTP module for rows ``(tokens [R], hidden [R, D], positions [R])``: row r is
        the module at position ``positions[r]``, fed the hidden state there (the target's, or the module's own
        output for a recurrent draft) and ``tokens[r]``, the token at the next position. Its KV is written to
        layer ``n_layers`` of the rows' pages (``page_table [R, P]``; several rows of one sequence attend causally,
        as in ``forward_decode``). Every rank of the EP group calls it in the same step (R may be 0). Returns
        ``(logits [R, V], hidden [R, D])``: the draft's next-token logits (the shared final norm, or the module's
        own head norm when its checkpoint has one, then the shared lm head) and its output hidden state."""
        x = self._mtp_input(tokens, hidden)
        x = self._decode_layer(self.cfg.n_layers, self.mtp, x, positions, cache, page_table)
        w = self.mtp
        norm = w["head_norm"] if "head_norm" in w else self.glob["final_norm"]
        return rms_norm(x, norm, self.cfg.rms_eps) @ self.glob["lm_head"].T, x

    # -- decode ---------------------------------------------------------------------------------------------------
    @scoped("attn_s")
    def _attn_decode(self, li: int, w, h, positions, cache, page_table, slots=None) -> torch.Tensor:
        """All heads of this DP rank's batch: writes the new token's KV, attends over the pages (a sliding layer:
        over the sequence's ring, found through its first page), o_proj (+ bias). No host synchronisation. A linear
        layer steps each sequence's state (``slots [B]``) by one token."""
        cfg, S = self.cfg, cache.page_tokens
        if cfg.kind(li) == "linear":
            return layers_gdn.decode(w, h, cfg, cache.states, self._lini[li], slots)
        kl = self._kvi[li]
        if cache.is_ring(kl):
            q, k, v = layers_gqa.qkv(w, h, positions, cfg, self.rope)
            rings = cache.ring_table[page_table[:, 0]]                             # [B, Rp]
            R = cache.ring_tokens
            st = cache.ring_storage[cache.slot_of[kl]]
            page = rings.gather(1, ((positions % R) // S)[:, None])[:, 0]
            st[page, 0, :, positions % S] = k.transpose(0, 1).to(st.dtype)
            st[page, 1, :, positions % S] = v.transpose(0, 1).to(st.dtype)
            o = layers_gqa.decode_paged(w, q, st, rings, positions, self._window(li), cfg, ring=True) @ w["o_proj"].T
            return o + w["o_bias"] if "o_bias" in w else o
        st = cache.storage[kl] if cfg.kind(li) == "mla" else cache.storage[cache.slot_of[kl]]
        page = page_table.gather(1, (positions // S)[:, None])[:, 0]
        slot = positions % S
        if cfg.kind(li) == "mla":
            q_nope, q_rot, rows = layers_mla.project(w, h, positions, cfg, self.rope)
            st[page, slot] = rows.to(st.dtype)
            o = layers_mla.decode_paged(w, q_nope, q_rot, st, page_table, positions, cfg)
        else:
            q, k, v = layers_gqa.qkv(w, h, positions, cfg, self.rope)
            st[page, 0, :, slot] = k.transpose(0, 1).to(st.dtype)
            st[page, 1, :, slot] = v.transpose(0, 1).to(st.dtype)
            o = layers_gqa.decode_paged(w, q, st, page_table, positions, self._window(li), cfg)
            if "gate_proj" in w:
                o = o * torch.sigmoid(h @ w["gate_proj"].T)
        o = o @ w["o_proj"].T
        return o + w["o_bias"] if "o_bias" in w else o

    def _decode_layer(self, li, w, x, positions, cache, page_table, slots=None):
        """Layer ``li`` (weights ``w``) of a decode step on ``x [B, D]`` (B may be 0: the EP exchange still runs);
        ``slots``: the sequences' state slots (a linear layer)."""
        cfg = self.cfg
        B = x.shape[0]
        if B:
            x = x + self._attn_decode(li, w, rms_norm(x, w["input_norm"], cfg.rms_eps), positions, cache, page_table,
                                      slots)
        h = rms_norm(x, w["post_norm"], cfg.rms_eps)
        if "mlp_gate_up" in w:
            return x + layers_moe.mlp(h, w["mlp_gate_up"], w["mlp_down"])
        topi, topw = self._route(w, h) if B else (
            torch.zeros(0, cfg.top_k, dtype=torch.long, device=x.device),
            torch.zeros(0, cfg.top_k, dtype=x.dtype, device=x.device))
        y = self._moe_dp_ep(w, h, topi, topw)
        return x + (y + self._shared(w, h) if "shared_gate_up" in w else y)

    def forward_decode(self, tokens, positions, cache, page_table, slots=None, *, hidden: bool = False):
        """As ``ShardedQwen3Moe.forward_decode``; with linear layers ``slots [B]`` (a tensor on the tokens' device)
        are the sequences' state slots. Several rows of one sequence (consecutive positions, the same page-table
        row) form a verify step (MTP; not with linear layers, whose state steps once per row): each row's KV is
        written before any row attends, and row r attends to positions <= ``positions[r]``. ``hidden``: return
        ``(logits, last hidden state [B, D])``."""
        B = tokens.shape[0]
        if self.cfg.has_linear and B:
            slots = torch.as_tensor(self._slots(slots, B), device=tokens.device)
        x = self.glob["embed"][tokens]
        for li, w in enumerate(self.layers):
            x = self._decode_layer(li, w, x, positions, cache, page_table, slots)
        return (self._logits(x), x) if hidden else self._logits(x)

    def forward_decode_static(self, tokens, positions, cache, page_table, slots=None, *, hidden: bool = False):
        """``forward_decode`` without host synchronisation (one expert group; CUDA-graph capturable): the MoE sorts
        the B*k (token, expert) pairs by expert (``kernels.moe_block``) instead of selecting local ones. With
        linear layers ``slots [B]`` is a device tensor of state slots (a graph runner's static buffer; its padding
        rows name the pool's scratch slot). One row per sequence: an MTP verify (several rows of one sequence) is
        not run with linear layers, whose state steps once per row."""
        if self.shard.ep != 1:
            raise ValueError("forward_decode_static needs ep=1 (the all-to-all needs host-side split sizes)")
        cfg = self.cfg
        if cfg.has_linear and not (isinstance(slots, torch.Tensor) and slots.shape == tokens.shape):
            raise ValueError(f"forward_decode_static: a model with Gated DeltaNet layers needs its state slots as a "
                             f"device tensor [{tokens.shape[0]}], got {type(slots).__name__}")
        x = self.glob["embed"][tokens]
        for li, w in enumerate(self.layers):
            x = x + self._attn_decode(li, w, rms_norm(x, w["input_norm"], cfg.rms_eps), positions, cache, page_table,
                                      slots)
            x = x + self._ffn_static(w, rms_norm(x, w["post_norm"], cfg.rms_eps))
        return (self._logits(x), x) if hidden else self._logits(x)

    def _ffn_static(self, w, h: torch.Tensor) -> torch.Tensor:
        """The FFN of one expert group holding every expert, without host synchronisation: the dense MLP, or the
        routed experts with the (token, expert) pairs sorted by expert (``kernels.moe_block``) plus the shared
        expert."""
        from rackbed.kernels.moe_block import permute, unpermute

        if "mlp_gate_up" in w:
            return layers_moe.mlp(h, w["mlp_gate_up"], w["mlp_down"])
        topi, topw = self._route(w, h)
        order, tok, counts, xs = permute(h, topi, self.cfg.n_experts)
        y = unpermute(self._experts(w, xs, counts), tok, order, topw, h)
        return y + self._shared(w, h) if "shared_gate_up" in w else y

    # -- prefill of one sequence with static shapes (CUDA-graph capturable) ---------------------------------------
    def forward_chunk_static(self, tokens, positions, write_page, page_row, last, cache, slot=None):
        """``ShardedQwen3Moe.forward_chunk_static`` for these families: a prefill chunk of ONE sequence (a whole
        prompt, a later chunk, or the suffix after a cached prefix) padded to ``tokens [T]``, with no host
        synchronisation and no data-dependent shape, so :class:`~rackbed.engine.real.model.PrefillGraphRunner` can
        capture it. Rows ``0..last`` are the chunk's tokens at ``positions``; padding rows repeat the last position
        and write to the scratch page ``write_page`` names for them.

        * MLA layers write their latent rows at ``(write_page[t], positions[t] % S)`` and attend (expanded, as
          :meth:`forward_prefill`) over the latent rows of ``page_row [P]`` up to each query's position.
        * Full GQA layers do the same with K/V pages (biases, qk-norm, partial rotary, sinks as the eager path).
        * Sliding layers (gpt-oss) attend over the sequence's ring as it was before the chunk (each slot masked by
          the position it holds) and the chunk's own K/V, inside the window; then every ring slot whose latest
          position falls in the chunk is rewritten (the whole ring, gathered and written back: a chunk longer than
          the ring writes each slot once, never two rows to one slot). The ring is the one ``page_row[0]`` (the
          sequence's first page) names in ``cache.ring_table``.
        * The FFN is :meth:`_ffn_static` (as :meth:`forward_decode_static`).
        * With the MTP module, its layer's KV is written as :meth:`forward_prefill` writes it (row t's input is
          the hidden state at t and the next token: the chunk's own, or the greedy token after ``last``); the
          module's attention and FFN, whose output prefill discards, are not run.

        * Gated DeltaNet layers (Qwen3.5) run the chunk's recurrence on state slot ``slot [1]`` (a device tensor;
          ``layers_gdn.prefill_static``): a chunk at position 0 starts from a zeroed state, a later one continues
          the state the earlier chunks left in the slot (a cached prefix cannot be resumed: no state snapshot is
          kept, and ``rank_setup.check_gdn`` refuses prefix caching for these models). Padding rows change
          neither the recurrent nor the conv state.

        One rank only (tp = ep = 1). Returns the logits of row ``last`` ``[1, V]``."""
        if self.shard.ep != 1 or self.shard.attn_tp != 1:
            raise ValueError("forward_chunk_static needs one rank (tp = ep = 1)")
        cfg = self.cfg
        if cfg.has_linear and not (isinstance(slot, torch.Tensor) and slot.shape == (1,)):
            raise ValueError(f"forward_chunk_static: a model with Gated DeltaNet layers needs the sequence's state "
                             f"slot as a device tensor [1], got {type(slot).__name__}")
        geo = self._chunk_geometry(positions, page_row, last, cache)
        if cfg.has_linear:
            geo.update(slot=slot, last=last, fresh=positions[:1] == 0)
        x = self.glob["embed"][tokens]
        for li, w in enumerate(self.layers):
            a = self._attn_chunk(li, w, rms_norm(x, w["input_norm"], cfg.rms_eps), positions, write_page, page_row,
                                 cache, geo)
            x = x + (a + w["o_bias"] if "o_bias" in w else a)
            x = x + self._ffn_static(w, rms_norm(x, w["post_norm"], cfg.rms_eps))
        logits = self._logits(x.index_select(0, last))
        if self.mtp is not None:
            nxt = torch.roll(tokens, -1).index_copy(0, last, logits.argmax(-1))
            h = rms_norm(self._mtp_input(nxt, x), self.mtp["input_norm"], cfg.rms_eps)
            self._attn_chunk(cfg.n_layers, self.mtp, h, positions, write_page, page_row, cache, geo, kv_only=True)
        return logits

    def _chunk_geometry(self, positions, page_row, last, cache) -> dict:
        """What every layer of a static chunk shares: the page row's mask ``[T, P*S]`` (key slot j is position j)
        and, with sliding layers, the ring's (module docstring of ``layers_gqa``): its pages, the keys' positions
        and mask (the ring before the chunk, then the chunk), and which chunk row each slot takes afterwards."""
        dev, S = positions.device, cache.page_tokens      # (index with 1-d tensors only: a 0-d one syncs the host)
        geo = {"mask": torch.arange(page_row.shape[0] * S, device=dev)[None, :] <= positions[:, None]}
        if cache.window:
            T, R = positions.shape[0], cache.ring_tokens
            j = torch.arange(R, device=dev)
            start, end = positions[:1], positions.index_select(0, last) + 1          # [1] each
            old = start - 1 - torch.remainder(start - 1 - j, R)       # position slot j holds before the chunk
            new = end - 1 - torch.remainder(end - 1 - j, R)           # ... and after it
            k_pos = torch.cat((old, positions))
            k_ok = torch.cat((old >= 0, torch.arange(T, device=dev) <= last))
            geo.update(ring=cache.ring_table[page_row[:1]][0], take=new >= start,
                       src=(new - start).clamp(0, T - 1), ring_ok=k_ok[None, :] & layers_gqa.window_mask(
                           positions, k_pos, cache.window))
        return geo

    @scoped("attn_s")
    def _attn_chunk(self, li, w, h, positions, write_page, page_row, cache, geo, kv_only: bool = False):
        """Layer ``li``'s attention of a static chunk (:meth:`forward_chunk_static`) -> ``[T, D]`` (o_proj, no o
        bias); ``kv_only``: write the KV and stop (None)."""
        cfg, S = self.cfg, cache.page_tokens
        if cfg.kind(li) == "linear":
            return layers_gdn.prefill_static(w, h, cfg, cache.states, self._lini[li], geo["slot"], geo["last"],
                                             geo["fresh"])
        kl, slot = self._kvi[li], positions % S
        if cfg.kind(li) == "mla":
            q_nope, q_rot, rows = layers_mla.project(w, h, positions, cfg, self.rope)
            st = cache.storage[kl]
            st[write_page, slot] = rows.to(st.dtype)
            if kv_only:
                return None
            ctx = st[page_row].reshape(-1, st.shape[-1]).to(rows.dtype)                  # [P*S, W]
            o = layers_mla.attend_rows(w, q_nope, q_rot, ctx, geo["mask"], cfg)
            return o @ w["o_proj"].T
        q, k, v = layers_gqa.qkv(w, h, positions, cfg, self.rope)                         # k, v [Hkv, T, Dh]
        Hkv, Dh = k.shape[0], k.shape[2]
        if cache.is_ring(kl):
            R, ring = cache.ring_tokens, geo["ring"]
            st = cache.ring_storage[cache.slot_of[kl]]
            was = st[ring].permute(1, 2, 0, 3, 4).reshape(2, Hkv, R, Dh)                   # K|V by ring slot
            now = torch.where(geo["take"][None, None, :, None],
                              torch.stack((k, v)).index_select(2, geo["src"]).to(st.dtype), was)
            st[ring] = now.reshape(2, Hkv, -1, S, Dh).permute(2, 0, 1, 3, 4)
            if kv_only:
                return None
            ks, vs = torch.cat((was[0].to(k.dtype), k), 1), torch.cat((was[1].to(v.dtype), v), 1)
            o = layers_gqa.attend_keys(w, q, ks, vs, geo["ring_ok"], cfg)
        else:
            st = cache.storage[cache.slot_of[kl]]
            st[write_page, 0, :, slot] = k.transpose(0, 1).to(st.dtype)
            st[write_page, 1, :, slot] = v.transpose(0, 1).to(st.dtype)
            if kv_only:
                return None
            kv = st[page_row]                                                             # [P, 2, Hkv, S, Dh]
            K = kv[:, 0].permute(1, 0, 2, 3).reshape(Hkv, -1, Dh).to(q.dtype)
            V = kv[:, 1].permute(1, 0, 2, 3).reshape(Hkv, -1, Dh).to(q.dtype)
            o = layers_gqa.attend_keys(w, q, K, V, geo["mask"], cfg)
        if "gate_proj" in w:                                  # Qwen3.5: per-head sigmoid output gate
            o = o * torch.sigmoid(h @ w["gate_proj"].T)
        return o @ w["o_proj"].T


def model_class(cfg: TorchModelConfig) -> type[ShardedQwen3Moe]:
    """The torch model class of ``cfg``'s family."""
    return ShardedQwen3Moe if cfg.family == "qwen3_moe" else ShardedMoeLM
