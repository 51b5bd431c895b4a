"""GQA attention of gpt-oss and GLM-4.5 in torch: q/k/v (and o) biases, optional qk-norm, partial rotary,
sliding windows and learned sinks, over the paged HND cache of ``engine.real.model``.

Sliding window (gpt-oss, transformers' mask): query position q sees key positions k with ``q - window < k <= q``.
Sinks: one learned logit per query head joins the softmax and is dropped after it (the head may attend to
"nothing"). Sliding layers keep a sequence's latest ``R`` positions on a ring of pages (``PagedKvCache``: position
``p`` at ring slot ``p mod R``, ``R`` the window in whole pages plus one page): prefill attends over the prompt's
own K/V with the exact window mask and leaves only the last ``R`` positions in the ring; decode reads the whole
ring and masks each slot by the position it holds (``ring_mask``).

Weights of one layer (names as ``families`` stores them; local heads of the rank's TP place): ``q_proj [Hq*Dh, D]``,
``k_proj``/``v_proj [Hkv*Dh, D]``, ``o_proj [D, Hq*Dh]``, optional ``q_bias``/``k_bias``/``v_bias``, ``o_bias [D]``
(added once, after the TP all-reduce), ``q_norm``/``k_norm [Dh]``, ``sinks [Hq]``.
"""

from __future__ import annotations

import torch

from rackbed.engine.real.model import rms_norm

GQA_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj")


def qkv(w, h: torch.Tensor, pos: torch.Tensor, cfg, rope) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """h [T, D] -> q [Hq, T, Dh], k, v [Hkv, T, Dh]: projections (+ biases), qk-norm, rotary."""
    Dh, T = cfg.head_dim, h.shape[0]

    def proj(name):
        y = h @ w[name + "_proj"].T
        b = w.get(name + "_bias")
        return (y if b is None else y + b).view(T, -1, Dh)

    q, k, v = proj("q"), proj("k"), proj("v")
    if cfg.qk_norm:
        q, k = rms_norm(q, w["q_norm"], cfg.rms_eps), rms_norm(k, w["k_norm"], cfg.rms_eps)
    q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    return rope.apply(q, pos), rope.apply(k, pos), v


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float,
           sinks: torch.Tensor | None) -> torch.Tensor:
    """Grouped attention: q ``[..., Hkv, G, Tq, Dh]``, k/v ``[..., Hkv, 1, Tk, Dh]``, ``allowed`` broadcastable to
    ``[..., Hkv, G, Tq, Tk]``; ``sinks`` ``[Hkv, G]`` or None. Softmax in fp32 (with the sink logit, then
    dropped). Returns ``[..., Hkv, G, Tq, Dh]``."""
    s = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    s = s.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        sk = sinks.float()[..., None, None].expand(*s.shape[:-1], 1)
        s = torch.cat((s, sk), -1)
        p = torch.softmax(s - s.amax(-1, keepdim=True), -1)[..., :-1]
    else:
        p = torch.softmax(s, -1)
    return torch.matmul(p.to(v.dtype), v)


def window_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int) -> torch.Tensor:
    """``[Tq, Tk]`` (or batched): causal, and inside the sliding window when ``window`` > 0."""
    ok = k_pos[..., None, :] <= q_pos[..., :, None]
    if window:
        ok &= k_pos[..., None, :] > q_pos[..., :, None] - window
    return ok


def prefill(w, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int, cfg, start: int = 0,
            k_start: int = 0) -> torch.Tensor:
    """One sequence's prefill attention: q ``[Hq, T, Dh]`` at positions start..start+T-1, k/v ``[Hkv, start+T-
    k_start, Dh]`` of positions k_start..start+T-1 (a cached prefix's keys first when ``start`` > 0; a sliding
    layer's ring gives its prefix from ``k_start`` = the window's start) -> ``[T, Hq*Dh]``."""
    T = q.shape[1]
    q_pos = torch.arange(start, start + T, device=q.device)
    k_pos = torch.arange(k_start, start + T, device=q.device)
    return attend_keys(w, q, k, v, window_mask(q_pos, k_pos, window), cfg)


def attend_keys(w, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, cfg) -> torch.Tensor:
    """q ``[Hq, T, Dh]`` over keys k/v ``[Hkv, n, Dh]`` with ``allowed [T, n]`` (True = attend; the sinks join the
    softmax) -> ``[T, Hq*Dh]``. Static shapes: the graph-capturable chunk (``ShardedMoeLM.forward_chunk_static``)
    passes a page row or a ring plus the chunk, masked by position."""
    Hq, T, Dh = q.shape
    Hkv = k.shape[0]
    qg = q.view(Hkv, Hq // Hkv, T, Dh)
    sinks = w.get("sinks")
    o = attend(qg, k[:, None], v[:, None], allowed, cfg.head_dim ** -0.5,
               None if sinks is None else sinks.view(Hkv, -1))
    return o.reshape(Hq, T, Dh).transpose(0, 1).reshape(T, Hq * Dh)


def decode(w, q: torch.Tensor, pages: torch.Tensor, positions: torch.Tensor, window: int, cfg) -> torch.Tensor:
    """Decode attention from gathered HND pages ``[B, P, 2, Hkv, S, Dh]``; q ``[Hq, B, Dh]`` -> ``[B, Hq*Dh]``."""
    B, P, _, Hkv, S, Dh = pages.shape
    Hq = q.shape[0]
    qg = q.transpose(0, 1).reshape(B, Hkv, Hq // Hkv, 1, Dh)
    K = pages[:, :, 0].permute(0, 2, 1, 3, 4).reshape(B, Hkv, 1, P * S, Dh)
    V = pages[:, :, 1].permute(0, 2, 1, 3, 4).reshape(B, Hkv, 1, P * S, Dh)
    ctx = torch.arange(P * S, device=q.device)
    ok = window_mask(positions[:, None], ctx[None, :].expand(B, -1), window)     # [B, 1, P*S]
    sinks = w.get("sinks")
    o = attend(qg, K, V, ok[:, None, None], cfg.head_dim ** -0.5, None if sinks is None else sinks.view(Hkv, -1))
    return o.reshape(B, Hq * Dh)


def ring_mask(positions: torch.Tensor, ring_tokens: int, window: int) -> torch.Tensor:
    """``[B, R]``: which ring slots a query at ``positions [B]`` attends to, once its own K/V is written. Slot
    ``j`` holds position ``p - ((p - j) mod R)`` (the latest position congruent to ``j``); it is read when that
    position is inside the window (``(p - j) mod R < window``) and not before the sequence (``<= p``)."""
    j = torch.arange(ring_tokens, device=positions.device)
    age = (positions[:, None] - j[None, :]) % ring_tokens
    return (age < window) & (age <= positions[:, None])


def decode_ring(w, q: torch.Tensor, ring: torch.Tensor, positions: torch.Tensor, window: int, cfg) -> torch.Tensor:
    """Decode attention of a sliding layer from its gathered rings ``[B, Rp, 2, Hkv, S, Dh]`` (the new token's
    K/V already written); q ``[Hq, B, Dh]`` -> ``[B, Hq*Dh]``. Static shapes, no host synchronisation."""
    B, P, _, Hkv, S, Dh = ring.shape
    Hq = q.shape[0]
    qg = q.transpose(0, 1).reshape(B, Hkv, Hq // Hkv, 1, Dh)
    K = ring[:, :, 0].permute(0, 2, 1, 3, 4).reshape(B, Hkv, 1, P * S, Dh)
    V = ring[:, :, 1].permute(0, 2, 1, 3, 4).reshape(B, Hkv, 1, P * S, Dh)
    ok = ring_mask(positions, P * S, window)[:, None, None, None, :]             # [B, 1, 1, 1, R]
    sinks = w.get("sinks")
    o = attend(qg, K, V, ok, cfg.head_dim ** -0.5, None if sinks is None else sinks.view(Hkv, -1))
    return o.reshape(B, Hq * Dh)


def decode_paged(w, q: torch.Tensor, st: torch.Tensor, table: torch.Tensor, positions: torch.Tensor, window: int,
                 cfg, *, ring: bool = False) -> torch.Tensor:
    """Decode attention over one layer's pages ``st [N, 2, Hkv, S, Dh]`` (``table``: the sequences' pages, or
    their rings when ``ring``); q ``[Hq, B, Dh]`` -> ``[B, Hq*Dh]``. The Triton kernel that reads the pages in
    place (``kernels.paged_attention``) where it runs, else :func:`decode` / :func:`decode_ring` over the gathered
    pages. Static shapes, no host synchronisation."""
    from rackbed.engine.real.model import paged_kernel_on

    if paged_kernel_on(q.device, st.shape[3], st.shape[4]):
        from rackbed.kernels.paged_attention import gqa_decode

        return gqa_decode(q.transpose(0, 1), st, table, positions, cfg.head_dim ** -0.5, window=window, ring=ring,
                          sinks=w.get("sinks"))
    if ring:
        return decode_ring(w, q, st[table], positions, window, cfg)
    return decode(w, q, st[table], positions, window, cfg)
