"""Gated DeltaNet (the "linear" layers of Qwen3.5) in torch, as transformers' ``qwen3_5_moe`` computes them, and the
per-sequence state pool those layers keep instead of a KV cache.

One layer, for tokens ``h [T, D]`` of one sequence (Hk key heads of Dk, Hv value heads of Dv, C = 2*Hk*Dk + Hv*Dv
conv channels, K the conv width):

1. ``lin_in [C + Hv*Dv + 2*Hv, D]`` (``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a`` stacked) gives the
   q/k/v channels, the output gate z, b and a;
2. a causal depthwise conv of width K over the q/k/v channels (``conv [C, K]``, no bias), then SiLU; the conv reads
   the sequence's last K-1 inputs (its *conv state*; zeros before the first token);
3. q, k are L2-normalised per head (eps 1e-6) and q scaled by ``Dk^-0.5``; a key head serves ``Hv/Hk`` consecutive
   value heads; ``beta = sigmoid(b)``, the log decay ``g = -exp(A_log) * softplus(a + dt_bias)``;
4. the gated delta rule on the fp32 state ``S [Hv, Dk, Dv]`` per token: ``S <- exp(g) S``,
   ``S <- S + k (beta (v - S^T k))^T``, output ``o = S^T q``. Prefill runs transformers' chunked form (chunks of
   64 tokens: the in-chunk updates solved as one triangular system, then a scan over chunks); decode one step,
   batched over the running sequences;
5. the gated RMSNorm over Dv (``lin_norm``, weight as stored: not zero-centred) times ``silu(z)``, then
   ``out_proj [D, Hv*Dv]``.

State: :class:`GdnStatePool` holds, per linear layer, ``slots`` conv states ``[C, K-1]`` (model dtype) and
delta-rule states ``[Hv, Dk, Dv]`` (fp32), plus one scratch slot. A sequence takes a slot when its prefill starts and
gives it back with its KV pages; the full-attention layers keep the paged KV cache (:class:`HybridKvCache` is both).

Graph-capturable forms (no host synchronisation, no data-dependent shape; ``ShardedMoeLM.forward_decode_static`` /
``forward_chunk_static``): :func:`decode` takes its slots as a device tensor, and the rows a CUDA-graph runner pads a
batch with point at the pool's scratch slot, whose state nothing reads; :func:`prefill_static` runs one sequence's
chunk padded to a token bucket (padding rows get beta = g = 0 and zero q/k/v, so they leave the recurrent state as it
was, and the new conv state is gathered from the chunk's real rows by an index computed on the device).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F_

from rackbed.engine.real.model import PagedKvCache

#: tokens per chunk of the chunked delta rule (transformers' default)
CHUNK = 64


class GdnStatePool:
    """Per-sequence Gated DeltaNet state of one rank: ``conv [L, slots + 1, C, K-1]`` (``dtype``) and ``rec [L,
    slots + 1, Hv, Dk, Dv]`` (fp32), L = linear layers. ``alloc`` hands out a zeroed slot, ``free`` takes it back.
    Slot ``scratch`` (= ``slots``, never handed out) is where the padding rows of a graph-replayed decode step and
    the warm-up captures step their state: no sequence's state is ever written by them."""

    def __init__(self, cfg, slots: int, *, dtype, device) -> None:
        L = len(cfg.linear_layers)
        self.slots = slots
        self.scratch = slots
        self.conv = torch.zeros(L, slots + 1, cfg.lin_conv_channels, cfg.lin_conv - 1, dtype=dtype, device=device)
        self.rec = torch.zeros(L, slots + 1, cfg.lin_v_heads, cfg.lin_k_dim, cfg.lin_v_dim, dtype=torch.float32,
                               device=device)
        self.free_slots = list(range(slots - 1, -1, -1))
        self.used: set[int] = set()

    @property
    def nbytes(self) -> int:
        return self.conv.numel() * self.conv.element_size() + self.rec.numel() * self.rec.element_size()

    def alloc(self) -> int:
        if not self.free_slots:
            raise MemoryError(f"Gated DeltaNet state pool full: all {self.slots} slots in use")
        s = self.free_slots.pop()
        self.conv[:, s].zero_()
        self.rec[:, s].zero_()
        self.used.add(s)
        return s

    def free(self, slot: int) -> None:
        if slot not in self.used:
            raise ValueError(f"state slot {slot} is not in use")
        self.used.remove(slot)
        self.free_slots.append(slot)


@dataclass
class HybridKvCache(PagedKvCache):
    """The paged KV cache of a model's full-attention layers (``n_layers`` = those layers; the model maps its layer
    index through ``TorchModelConfig.kv_layers``) plus the linear layers' :class:`GdnStatePool` (``states``)."""

    states: GdnStatePool | None = field(default=None)


# ----------------------------------------------------------------------------------------------------------------
# pieces


def split_in(w, h: torch.Tensor, cfg):
    """``h [T, D]`` -> ``(qkv [T, C], z [T, Hv, Dv], b [T, Hv], a [T, Hv])``."""
    C, Hv, Dv = cfg.lin_conv_channels, cfg.lin_v_heads, cfg.lin_v_dim
    y = h @ w["lin_in"].T
    qkv, z, b, a = torch.split(y, [C, Hv * Dv, Hv, Hv], dim=-1)
    return qkv, z.reshape(-1, Hv, Dv), b, a


def gates(w, b: torch.Tensor, a: torch.Tensor):
    """``(beta, g)`` of ``b, a [..., Hv]``: ``sigmoid(b)`` and the log decay ``-exp(A_log) softplus(a + dt_bias)``
    (fp32)."""
    return b.sigmoid(), -w["A_log"].float().exp() * F_.softplus(a.float() + w["dt_bias"])


def heads(qkv: torch.Tensor, cfg):
    """Conv output ``[..., C]`` -> q, k ``[..., Hv, Dk]`` (key heads repeated over their value heads, L2-normalised,
    q scaled by Dk^-0.5; fp32) and v ``[..., Hv, Dv]`` (fp32)."""
    Hk, Dk, Hv, Dv = cfg.lin_k_heads, cfg.lin_k_dim, cfg.lin_v_heads, cfg.lin_v_dim
    q, k, v = torch.split(qkv, [Hk * Dk, Hk * Dk, Hv * Dv], dim=-1)
    lead = qkv.shape[:-1]
    q, k, v = q.reshape(*lead, Hk, Dk).float(), k.reshape(*lead, Hk, Dk).float(), v.reshape(*lead, Hv, Dv).float()
    if Hv != Hk:
        q, k = q.repeat_interleave(Hv // Hk, dim=-2), k.repeat_interleave(Hv // Hk, dim=-2)
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6)
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    return q * Dk ** -0.5, k, v


def gated_norm(w, o: torch.Tensor, z: torch.Tensor, cfg) -> torch.Tensor:
    """RMSNorm of ``o [..., Hv, Dv]`` over Dv (weight ``lin_norm``) times ``silu(z)``, flattened to ``[..., Hv*Dv]``."""
    dt = z.dtype
    of = o.to(dt).float()
    n = w["lin_norm"] * (of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + cfg.rms_eps)).to(dt)
    return (n * F_.silu(z.float())).to(dt).flatten(-2)


def delta_rule_chunked(q, k, v, g, beta, state: torch.Tensor, chunk: int = CHUNK):
    """The gated delta rule over one sequence in chunks: q, k ``[T, H, Dk]``, v ``[T, H, Dv]``, g, beta ``[T, H]``
    (fp32, q already scaled), ``state [H, Dk, Dv]`` before the first token -> ``(o [T, H, Dv], state after the
    last)``. The sequence is padded to whole chunks with beta = g = 0 (no update, no decay), so the final state is
    exact."""
    T = q.shape[0]
    pad = (chunk - T % chunk) % chunk
    q, k, v = (F_.pad(x, (0, 0, 0, 0, 0, pad)).transpose(0, 1) for x in (q, k, v))      # [H, T', D]
    beta, g = (F_.pad(x, (0, 0, 0, pad)).transpose(0, 1) for x in (beta, g))            # [H, T']
    H, Tp, Dk = k.shape
    n = Tp // chunk
    q, k, v = q.reshape(H, n, chunk, Dk), k.reshape(H, n, chunk, Dk), v.reshape(H, n, chunk, -1)
    beta, g = beta.reshape(H, n, chunk), g.reshape(H, n, chunk)
    kb, vb = k * beta[..., None], v * beta[..., None]
    cum = g.cumsum(-1)
    upper = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).triu(1)
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(upper, float("-inf")).exp()
    system = (kb @ k.transpose(-1, -2)) * decay
    intra = (q @ k.transpose(-1, -2)) * decay
    new_v = torch.linalg.solve_triangular(system, vb, upper=False, unitriangular=True)
    k_cum = torch.linalg.solve_triangular(system, kb * cum.exp()[..., None], upper=False, unitriangular=True)
    q = q * cum.exp()[..., None]
    k = k * (cum[..., -1:] - cum).exp()[..., None]
    step = cum[..., -1].exp()[..., None, None]
    S = state.float()
    out = torch.empty_like(new_v)
    for i in range(n):
        vn = new_v[:, i] - k_cum[:, i] @ S
        out[:, i] = q[:, i] @ S + intra[:, i] @ vn
        S = S * step[:, i] + k[:, i].transpose(-1, -2) @ vn
    return out.reshape(H, Tp, -1)[:, :T].transpose(0, 1), S


def delta_rule_step(q, k, v, g, beta, S: torch.Tensor):
    """One token per sequence: q, k ``[B, H, Dk]``, v ``[B, H, Dv]``, g, beta ``[B, H]``, ``S [B, H, Dk, Dv]``
    (fp32) -> ``(o [B, H, Dv], new S)``."""
    S = S * g.exp()[..., None, None]
    mem = (S * k[..., None]).sum(-2)
    S = S + k[..., None] * ((v - mem) * beta[..., None])[..., None, :]
    return (S * q[..., None]).sum(-2), S


def delta_rule_loop(q, k, v, g, beta, state: torch.Tensor):
    """:func:`delta_rule_chunked` token by token (the reference the chunked form is tested against)."""
    S, outs = state.float()[None], []
    for t in range(q.shape[0]):
        o, S = delta_rule_step(q[t:t + 1], k[t:t + 1], v[t:t + 1], g[t:t + 1], beta[t:t + 1], S)
        outs.append(o)
    return torch.cat(outs), S[0]


# ----------------------------------------------------------------------------------------------------------------
# the layer


def prefill(w, h: torch.Tensor, cfg, pool: GdnStatePool, j: int, slot: int) -> torch.Tensor:
    """One sequence's tokens ``h [T, D]`` through linear layer ``j`` of the pool (state slot ``slot``, read and
    updated) -> ``[T, D]``."""
    qkv, z, b, a = split_in(w, h, cfg)
    K1 = cfg.lin_conv - 1
    x = torch.cat((pool.conv[j, slot].to(qkv.dtype), qkv.T), -1)                 # [C, K-1+T]
    pool.conv[j, slot] = x[:, -K1:]
    y = F_.silu(F_.conv1d(x[None], w["conv"][:, None, :], groups=x.shape[0])[0]).T   # [T, C]
    q, k, v = heads(y, cfg)
    beta, g = gates(w, b, a)
    o, S = delta_rule_chunked(q, k, v, g, beta.float(), pool.rec[j, slot])
    pool.rec[j, slot] = S
    return gated_norm(w, o, z, cfg) @ w["out_proj"].T


def prefill_static(w, h: torch.Tensor, cfg, pool: GdnStatePool, j: int, slot: torch.Tensor, last: torch.Tensor,
                   fresh: torch.Tensor) -> torch.Tensor:
    """:func:`prefill` of one sequence's chunk padded to ``h [T, D]``, graph-capturable: rows ``0..last`` (``last
    [1]``, on the device) are the chunk's, the rest padding; ``slot [1]`` is the state slot (read and updated);
    ``fresh [1]`` (bool) starts from a zeroed state instead of the slot's (a chunk at position 0). Padding rows get
    beta = g = 0 and zero q/k/v -- what :func:`delta_rule_chunked` pads with -- so the recurrent state after the chunk
    is the real rows'; the new conv state is the last K-1 inputs up to row ``last`` (earlier ones from the old conv
    state when the chunk is shorter). Returns ``[T, D]`` (padding rows: garbage the caller drops)."""
    qkv, z, b, a = split_in(w, h, cfg)
    T, K1 = h.shape[0], cfg.lin_conv - 1
    pad = (torch.arange(T, device=h.device) > last)                                # [T]
    conv0 = pool.conv[j].index_select(0, slot)[0].masked_fill(fresh, 0)          # [C, K-1]
    x = torch.cat((conv0.to(qkv.dtype), qkv.T), -1)                               # [C, K-1+T]
    # real row t is column K-1+t: the K-1 inputs ending at row `last` are columns last+1 .. last+K-1
    keep = x.index_select(1, last + 1 + torch.arange(K1, device=h.device))
    pool.conv[j].index_copy_(0, slot, keep[None].to(pool.conv.dtype))
    y = F_.silu(F_.conv1d(x[None], w["conv"][:, None, :], groups=x.shape[0])[0]).T   # [T, C]
    q, k, v = (t.masked_fill(pad[:, None, None], 0) for t in heads(y, cfg))
    beta, g = (t.float().masked_fill(pad[:, None], 0) for t in gates(w, b, a))
    rec0 = pool.rec[j].index_select(0, slot)[0].masked_fill(fresh, 0)
    o, S = delta_rule_chunked(q, k, v, g, beta, rec0)
    pool.rec[j].index_copy_(0, slot, S[None])
    return gated_norm(w, o, z, cfg) @ w["out_proj"].T


def decode(w, h: torch.Tensor, cfg, pool: GdnStatePool, j: int, slots: torch.Tensor) -> torch.Tensor:
    """One token of each sequence ``h [B, D]`` (state slots ``slots [B]``, a device tensor) through linear layer
    ``j`` -> ``[B, D]``. No host synchronisation (graph-capturable); rows that share a slot (padding rows on the
    scratch slot) write it in an unspecified order."""
    qkv, z, b, a = split_in(w, h, cfg)
    x = torch.cat((pool.conv[j, slots].to(qkv.dtype), qkv[:, :, None]), -1)    # [B, C, K]
    pool.conv[j, slots] = x[:, :, 1:].to(pool.conv.dtype)
    y = F_.silu((x * w["conv"]).sum(-1))                                          # [B, C]
    q, k, v = heads(y, cfg)
    beta, g = gates(w, b, a)
    o, S = delta_rule_step(q, k, v, g, beta.float(), pool.rec[j, slots])
    pool.rec[j, slots] = S
    return gated_norm(w, o, z, cfg) @ w["out_proj"].T


def hf_weights(state, a: str) -> dict[str, torch.Tensor]:
    """A linear layer's weights from transformers' ``...linear_attn.`` tensors (prefix ``a``)."""
    return {"lin_in": torch.cat([state[a + f"in_proj_{x}.weight"] for x in ("qkv", "z", "b", "a")]),
            "conv": state[a + "conv1d.weight"][:, 0], "dt_bias": state[a + "dt_bias"], "A_log": state[a + "A_log"],
            "lin_norm": state[a + "norm.weight"], "out_proj": state[a + "out_proj.weight"]}


def shapes(cfg) -> dict[str, tuple[tuple[int, ...], str]]:
    """Name -> (shape, init) of a linear layer's weights (``families.layer_shapes``)."""
    D, C, Hv, Dv = cfg.hidden, cfg.lin_conv_channels, cfg.lin_v_heads, cfg.lin_v_dim
    return {"lin_in": ((C + Hv * Dv + 2 * Hv, D), "w"), "conv": ((C, cfg.lin_conv), "conv"),
            "dt_bias": ((Hv,), "norm"), "A_log": ((Hv,), "small"), "lin_norm": ((Dv,), "norm"),
            "out_proj": ((D, Hv * Dv), "w")}
