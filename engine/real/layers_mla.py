"""Multi-head latent attention (DeepSeek-V3, Kimi-K2) in torch, with its latent paged cache.

Per token the cache keeps one row of ``kv_lora_rank + qk_rope_head_dim`` values: the RMS-normed latent ``c`` and
the rotated shared rope key ``k_rot`` (latent first). Per layer one plane ``[pages, page_tokens, kv_lora + rope]``
(no head axis) -- the layout ``engine.core.kv`` plans latent transfers for. A TP prefill group holds a whole
replica on every rank (each rank projects the same latent); a DP decode rank holds its own requests' pages.

Prefill runs the expanded form: ``kv_b_proj`` turns every context latent into per-head ``k_nope`` and ``v``, then
ordinary attention over ``qk_nope + qk_rope`` dims (the local heads of the TP place; the output projection is a
partial sum the caller all-reduces). Decode runs with absorbed weights: ``W_UK`` (the k-part of ``kv_b_proj``) folds
into the query, ``q_lat = q_nope W_UK``, so each head scores the cached rows directly,
``s = [q_lat, q_rot] . [c, k_rot]``; the probabilities read back ``c`` and ``W_UV`` lifts the result to ``v`` dims.
The latent is read once for all heads. The softmax scale is ``1/sqrt(qk_head_dim)`` times YaRN's mscale^2
(``TorchModelConfig.softmax_scale``).

Weights of one layer (full; ``weight_splits.SPLITS`` says how heads split them): ``q_a [q_lora, D]``,
``q_a_norm [q_lora]``, ``q_b [H*(nope+rope), q_lora]`` (or ``q_proj [H*(nope+rope), D]`` without q_lora),
``kv_a [kv_lora+rope, D]``, ``kv_a_norm [kv_lora]``, ``kv_b [H*(nope+v), kv_lora]``, ``o_proj [D, H*v]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F_

from rackbed.engine.real.model import PagedKvCache, rms_norm


@dataclass
class LatentKvCache(PagedKvCache):
    """Paged latent cache: ``storage[layer]`` is ``[P, S, kv_lora + rope]``. Same page allocator as the HND
    cache (``kv_heads`` = 1, ``head_dim`` = the row width)."""

    def __post_init__(self) -> None:
        self.storage = torch.zeros(self.n_layers, self.n_pages, self.page_tokens, self.head_dim, dtype=self.dtype,
                                   device=self.device)
        self.free_pages = list(range(self.n_pages - 1, -1, -1))
        self.refs = [0] * self.n_pages
        self.windows, self.window, self.ring_pages, self.free_rings, self.rings = (), 0, 0, [], {}

    def write_rows(self, layer: int, pages, start: int, rows: torch.Tensor) -> None:
        """Write latent rows ``[T, W]`` for positions start..start+T-1 of one sequence."""
        S = self.page_tokens
        pos = torch.arange(start, start + rows.shape[0], device=rows.device)
        st = self.storage[layer]
        st[torch.as_tensor(pages, device=rows.device)[pos // S], pos % S] = rows.to(st.dtype)

    def read_rows(self, layer: int, pages, n_tokens: int) -> torch.Tensor:
        """Latent rows ``[n_tokens, W]`` of positions 0..n_tokens-1 of one sequence (a cached prefix)."""
        S = self.page_tokens
        idx = torch.as_tensor(list(pages)[:-(-n_tokens // S)], device=self.storage.device)
        return self.storage[layer][idx].reshape(-1, self.head_dim)[:n_tokens]


def project(w, h: torch.Tensor, pos: torch.Tensor, cfg, rope) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """h [T, D] -> (q_nope [T, H, nope], q_rot [T, H, rope] rotated, latent rows [T, kv_lora + rope])."""
    T = h.shape[0]
    if "q_b" in w:
        q = rms_norm(h @ w["q_a"].T, w["q_a_norm"], cfg.rms_eps) @ w["q_b"].T
    else:
        q = h @ w["q_proj"].T
    q = q.view(T, -1, cfg.head_dim)
    nope = cfg.qk_nope_head_dim
    q_rot = rope.apply(q[..., nope:].transpose(0, 1), pos).transpose(0, 1)
    ckv = h @ w["kv_a"].T
    c = rms_norm(ckv[:, :cfg.kv_lora_rank], w["kv_a_norm"], cfg.rms_eps)
    k_rot = rope.apply(ckv[:, cfg.kv_lora_rank:], pos)
    return q[..., :nope], q_rot, torch.cat((c, k_rot), -1)


def prefill(w, q_nope: torch.Tensor, q_rot: torch.Tensor, rows: torch.Tensor, cfg,
            prefix: torch.Tensor | None = None) -> torch.Tensor:
    """Expanded attention of one sequence's new tokens over its latent rows ``[T, W]`` -> ``[T, H*v]`` (before
    o_proj). ``prefix``: the latent rows ``[c, W]`` of a cached prefix (positions 0..c-1) the new tokens follow:
    kv_b expands them too and query j attends to keys 0..c+j."""
    T = q_nope.shape[0]
    c = 0 if prefix is None else prefix.shape[0]
    if c:
        rows = torch.cat((prefix.to(rows.dtype), rows))
        n = rows.shape[0]
        mask = torch.arange(n, device=rows.device)[None, :] <= (c + torch.arange(T, device=rows.device))[:, None]
        return attend_rows(w, q_nope, q_rot, rows, mask, cfg)
    return attend_rows(w, q_nope, q_rot, rows, None, cfg)


def attend_rows(w, q_nope: torch.Tensor, q_rot: torch.Tensor, rows: torch.Tensor, mask: torch.Tensor | None,
                cfg) -> torch.Tensor:
    """Expanded attention of ``T`` queries over latent rows ``[n, W]`` -> ``[T, H*v]`` (before o_proj): kv_b expands
    every row to per-head ``k_nope`` and ``v``; ``mask [T, n]`` (True = attend), or None for causal with query j at
    row j. Static shapes (the graph-capturable chunk, ``ShardedMoeLM.forward_chunk_static``, passes the sequence's
    whole padded page row, masked by position)."""
    T, H, nope = q_nope.shape
    L = cfg.kv_lora_rank
    n = rows.shape[0]
    kv = (rows[:, :L] @ w["kv_b"].T).view(n, H, nope + cfg.v_head_dim)
    k = torch.cat((kv[..., :nope], rows[:, None, L:].expand(n, H, cfg.qk_rope_head_dim)), -1).transpose(0, 1)
    q = torch.cat((q_nope, q_rot), -1).transpose(0, 1)
    v = kv[..., nope:].transpose(0, 1)
    if mask is not None:
        o = F_.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=cfg.softmax_scale)
    else:
        o = F_.scaled_dot_product_attention(q, k, v, is_causal=True, scale=cfg.softmax_scale)   # [H, T, v]
    return o.transpose(0, 1).reshape(T, H * cfg.v_head_dim)


def absorbed(w, cfg) -> tuple[torch.Tensor, torch.Tensor]:
    """(W_UK [H, nope, kv_lora], W_UV [H, v, kv_lora]): views of ``kv_b`` split per head."""
    kvb = w["kv_b"].view(-1, cfg.qk_nope_head_dim + cfg.v_head_dim, cfg.kv_lora_rank)
    return kvb[:, :cfg.qk_nope_head_dim], kvb[:, cfg.qk_nope_head_dim:]


def decode(w, q_nope: torch.Tensor, q_rot: torch.Tensor, pages: torch.Tensor, mask: torch.Tensor, cfg) -> torch.Tensor:
    """Absorbed decode attention: q_nope ``[B, H, nope]``, q_rot ``[B, H, rope]``, the sequences' latent pages
    ``[B, P, S, W]``, ``mask [B, P*S]`` (True = attend) -> ``[B, H*v]`` (before o_proj)."""
    B, P, S, W = pages.shape
    L = cfg.kv_lora_rank
    w_uk, w_uv = absorbed(w, cfg)
    q = torch.cat((torch.einsum("bhn,hnc->bhc", q_nope, w_uk), q_rot), -1)       # [B, H, W]
    ctx = pages.reshape(B, P * S, W)
    s = torch.matmul(q, ctx.transpose(1, 2)).float() * cfg.softmax_scale            # [B, H, P*S]
    s = s.masked_fill(~mask[:, None, :], float("-inf"))
    o_lat = torch.matmul(torch.softmax(s, -1).to(ctx.dtype), ctx[..., :L])          # [B, H, kv_lora]
    return torch.einsum("bhc,hvc->bhv", o_lat, w_uv).reshape(B, -1)


def decode_paged(w, q_nope: torch.Tensor, q_rot: torch.Tensor, st: torch.Tensor, table: torch.Tensor,
                 positions: torch.Tensor, cfg) -> torch.Tensor:
    """Absorbed decode attention over one layer's latent pages ``st [N, S, W]`` up to each row's position ->
    ``[B, H*v]``: the Triton kernel that reads the pages in place (``kernels.paged_attention.mla_decode``) where
    it runs, else :func:`decode` over the gathered pages. Static shapes, no host synchronisation."""
    from rackbed.engine.real.model import paged_kernel_on

    if paged_kernel_on(q_nope.device, st.shape[1], cfg.kv_lora_rank, st.shape[2] - cfg.kv_lora_rank):
        from rackbed.kernels.paged_attention import mla_decode

        w_uk, w_uv = absorbed(w, cfg)
        q = torch.cat((torch.einsum("bhn,hnc->bhc", q_nope, w_uk), q_rot), -1)
        o_lat = mla_decode(q, st, table, positions, cfg.softmax_scale, cfg.kv_lora_rank)
        return torch.einsum("bhc,hvc->bhv", o_lat, w_uv).reshape(q.shape[0], -1)
    ctx = torch.arange(table.shape[1] * st.shape[1], device=q_nope.device)
    return decode(w, q_nope, q_rot, st[table], ctx[None, :] <= positions[:, None], cfg)
