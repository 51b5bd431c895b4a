"""Paged decode attention that reads the KV pages in place (Triton): GQA (full, sliding window, ring, sinks) and
MLA's absorbed latent form.

    from rackbed.kernels.paged_attention import gqa_decode, mla_decode, unavailable
    o = gqa_decode(q, storage, table, positions, scale)                    # [B, Hq*Dh]
    o_lat = mla_decode(q, storage, table, positions, scale, kv_lora)     # [B, H, kv_lora]

Why: the engine's torch decode attention gathers the sequences' pages (``storage[table]``, a copy of every KV byte
of the padded page-table bucket), computes fp32 scores for the whole bucket, masks, softmaxes and casts them back
-- five or six passes over a ``[B, H, P*S]`` tensor per layer, and one kernel each. This module reads each KV page
of a sequence once, straight from the cache, only up to the sequence's own position (the padding pages of a
CUDA-graph bucket are never read), keeps scores in registers (fp32) and writes ``[B, H, Dh]``.

Shapes (the engine's caches, ``engine/real/model.py`` and ``layers_mla.py``):

* GQA: ``q [B, Hq, Dh]`` (any strides), ``storage [N, 2, Hkv, S, Dh]`` (one layer's pages: K then V, heads, slots),
  ``table [B, P]`` int page ids, ``positions [B]`` (the query's position; its own K/V already written). Query
  heads of one KV head are contiguous (head ``h`` reads KV head ``h // (Hq/Hkv)``). Token ``t`` of the sequence
  sits at page ``table[b, t // S]``, slot ``t % S``; it is attended when ``t <= pos`` and, with ``window`` > 0,
  ``t > pos - window``. ``ring=True``: ``table`` is the sequence's ring of ``Rp`` pages, ring slot ``j`` holds the
  latest position congruent to ``j`` modulo ``R = Rp*S``, attended when its age ``(pos - j) mod R`` is below the
  window and not past the sequence's start (``engine.real.layers_gqa.ring_mask``). ``sinks [Hq]``: one logit per
  query head that joins the softmax and is dropped after it.
* MLA: ``q [B, H, W]`` (``W = kv_lora + rope``: the absorbed query ``[q_nope W_UK, q_rot]``), ``storage [N, S, W]``
  (latent rows ``[c, k_rot]``), same ``table`` / ``positions``; returns ``softmax(scale * q . row) @ c``
  ``[B, H, kv_lora]`` in fp32-accumulated bf16.

The work is split over the sequence's pages (flash decoding): grid (heads, batch, splits), each split keeps a
running max / sum / accumulator and a second kernel merges the splits (and the sink). The split count depends only
on the host-known shapes (B, heads, P), so a CUDA graph captures one launch configuration per bucket; the page
loop bounds come from ``positions`` on the device (no host synchronisation).

Needs Triton and CUDA (or ``TRITON_INTERPRET=1`` on the CPU, which is how the tests run it); :func:`unavailable`
says why not. The torch paths in ``engine/real`` stay the reference and the fallback.
"""

from __future__ import annotations

import functools
import os

SM_TARGET = 264  # programs to aim for (2 per SM of an H200) when choosing the split count


def unavailable(device=None) -> str | None:
    """Why the engine does not run these kernels on ``device`` (None if it does): switched off by
    ``RACKBED_PAGED_ATTENTION=torch``, no Triton, or not a CUDA device. On the CPU they run only under Triton's
    interpreter when asked for (``TRITON_INTERPRET=1`` and ``RACKBED_PAGED_ATTENTION=interpret``: the tests)."""
    mode = os.environ.get("RACKBED_PAGED_ATTENTION", "triton")
    if mode == "torch":
        return "RACKBED_PAGED_ATTENTION=torch"
    try:
        import triton  # noqa: F401
    except ImportError as exc:  # depends on the install
        return f"triton not importable ({type(exc).__name__})"
    if mode == "interpret" and os.environ.get("TRITON_INTERPRET") == "1":
        return None
    if getattr(device, "type", str(device)) != "cuda":
        return "not a CUDA device"
    return None


def shape_unsupported(page_tokens: int, *widths: int) -> str | None:
    """Why the kernels cannot take a cache of ``page_tokens`` slots per page and these row widths (head dim; or
    latent and rope widths): ``tl.dot`` tiles need powers of two of at least 16."""
    for name, n in (("page_tokens", page_tokens),) + tuple(("width", w) for w in widths):
        if n < 16 or _next_pow2(n) != n:
            return f"{name}={n} is not a power of two >= 16"
    return None


def engine_uses(device) -> bool:
    """Whether the engine's decode attention on ``device`` goes through this module (:func:`unavailable`)."""
    return unavailable(device) is None


def n_splits(n_programs: int, max_pages: int, target: int = SM_TARGET) -> int:
    """Splits of a sequence's pages so that ``n_programs * splits`` reaches ``target`` programs, at most one split
    per page (and at least 1). Host-side shapes only."""
    if n_programs <= 0 or max_pages <= 1:
        return 1
    return max(1, min(max_pages, -(-target // n_programs)))


def _next_pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


@functools.cache
def _kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def gqa_split_kernel(q_ptr, kv_ptr, tab_ptr, pos_ptr, mo_ptr, mm_ptr, ml_ptr,
                         sq_b, sq_h, s_n, s_kv, s_h, s_s, s_tb, n_split, scale, window, P,
                         G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, S: tl.constexpr,
                         BN: tl.constexpr, RING: tl.constexpr):
        h = tl.program_id(0)          # KV head
        b = tl.program_id(1)
        sp = tl.program_id(2)
        Hq = tl.num_programs(0) * G
        pos = tl.load(pos_ptr + b).to(tl.int32)
        if RING:
            lo = pos * 0
            hi = lo + P * S
        else:
            lo = tl.where(window > 0, tl.maximum(pos - window + 1, 0), 0)
            hi = pos + 1
        lo = (lo // BN) * BN
        n_blk = tl.cdiv(hi - lo, BN)
        per = tl.cdiv(n_blk, n_split)
        b0 = lo + sp * per * BN
        b1 = tl.minimum(b0 + per * BN, hi)
        g = tl.arange(0, GP)
        d = tl.arange(0, D)
        n = tl.arange(0, BN)
        gm = g < G
        q = tl.load(q_ptr + b * sq_b + (h * G + g)[:, None] * sq_h + d[None, :], mask=gm[:, None], other=0.0)
        m_i = tl.full([GP], float("-inf"), tl.float32)
        l_i = tl.zeros([GP], tl.float32)
        acc = tl.zeros([GP, D], tl.float32)
        for t0 in range(b0, b1, BN):
            page = tl.load(tab_ptr + b * s_tb + t0 // S).to(tl.int64)
            t = t0 + n
            base = kv_ptr + page * s_n + h * s_h + ((t0 % S) + n)[:, None] * s_s + d[None, :]
            k = tl.load(base)
            v = tl.load(base + s_kv)
            s = tl.dot(q, tl.trans(k)) * scale
            if RING:
                R = P * S
                age = ((pos - t) % R + R) % R
                ok = (age < window) & (age <= pos)
            else:
                ok = (t <= pos) & (t >= lo)
                if window > 0:
                    ok = ok & (t > pos - window)
            s = tl.where(ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(s - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new
        row = (b * Hq + h * G + g) * n_split + sp
        tl.store(mo_ptr + row[:, None] * D + d[None, :], acc, mask=gm[:, None])
        tl.store(mm_ptr + row, m_i, mask=gm)
        tl.store(ml_ptr + row, l_i, mask=gm)

    @triton.jit
    def mla_split_kernel(q_ptr, kv_ptr, tab_ptr, pos_ptr, mo_ptr, mm_ptr, ml_ptr,
                         sq_b, sq_h, s_n, s_s, s_tb, n_split, scale, H,
                         BH: tl.constexpr, L: tl.constexpr, RD: tl.constexpr, S: tl.constexpr, BN: tl.constexpr):
        hb = tl.program_id(0)         # block of BH heads
        b = tl.program_id(1)
        sp = tl.program_id(2)
        pos = tl.load(pos_ptr + b).to(tl.int32)
        hi = pos + 1
        n_blk = tl.cdiv(hi, BN)
        per = tl.cdiv(n_blk, n_split)
        b0 = sp * per * BN
        b1 = tl.minimum(b0 + per * BN, hi)
        hh = hb * BH + tl.arange(0, BH)
        hm = hh < H
        c = tl.arange(0, L)
        r = tl.arange(0, RD)
        n = tl.arange(0, BN)
        qrow = q_ptr + b * sq_b + hh[:, None] * sq_h
        q_lat = tl.load(qrow + c[None, :], mask=hm[:, None], other=0.0)
        q_pe = tl.load(qrow + L + r[None, :], mask=hm[:, None], other=0.0)
        m_i = tl.full([BH], float("-inf"), tl.float32)
        l_i = tl.zeros([BH], tl.float32)
        acc = tl.zeros([BH, L], tl.float32)
        for t0 in range(b0, b1, BN):
            page = tl.load(tab_ptr + b * s_tb + t0 // S).to(tl.int64)
            t = t0 + n
            rows = kv_ptr + page * s_n + ((t0 % S) + n)[:, None] * s_s
            kc = tl.load(rows + c[None, :])
            kr = tl.load(rows + L + r[None, :])
            s = (tl.dot(q_lat, tl.trans(kc)) + tl.dot(q_pe, tl.trans(kr))) * scale
            s = tl.where((t <= pos)[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            p = tl.exp(s - m_safe[:, None])
            alpha = tl.exp(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(kc.dtype), kc)
            m_i = m_new
        row = (b * H + hh) * n_split + sp
        tl.store(mo_ptr + row[:, None] * L + c[None, :], acc, mask=hm[:, None])
        tl.store(mm_ptr + row, m_i, mask=hm)
        tl.store(ml_ptr + row, l_i, mask=hm)

    @triton.jit
    def merge_kernel(mo_ptr, mm_ptr, ml_ptr, sink_ptr, out_ptr, n_split, Hq,
                     D: tl.constexpr, SP: tl.constexpr, HAS_SINK: tl.constexpr):
        row = tl.program_id(0)        # b * Hq + head
        sp = tl.arange(0, SP)
        d = tl.arange(0, D)
        spm = sp < n_split
        m = tl.load(mm_ptr + row * n_split + sp, mask=spm, other=float("-inf"))
        lsum = tl.load(ml_ptr + row * n_split + sp, mask=spm, other=0.0)
        m_tot = tl.max(m, 0)
        if HAS_SINK:
            sink = tl.load(sink_ptr + row % Hq).to(tl.float32)
            m_tot = tl.maximum(m_tot, sink)
        m_safe = tl.where(m_tot == float("-inf"), 0.0, m_tot)
        wgt = tl.exp(m - m_safe)
        den = tl.sum(lsum * wgt, 0)
        if HAS_SINK:
            den += tl.exp(sink - m_safe)
        o = tl.load(mo_ptr + (row * n_split + sp)[:, None] * D + d[None, :], mask=spm[:, None], other=0.0)
        o = tl.sum(o * wgt[:, None], 0) / tl.where(den > 0, den, 1.0)
        tl.store(out_ptr + row * D + d, o.to(out_ptr.dtype.element_ty))

    return gqa_split_kernel, mla_split_kernel, merge_kernel


def _merge(mo, mm, ml, sinks, out, n_split: int, Hq: int, D: int) -> None:
    merge = _kernels()[2]
    rows = mm.shape[0] // n_split
    merge[(rows,)](mo, mm, ml, sinks if sinks is not None else mm, out, n_split, Hq, D=D,
                   SP=max(2, _next_pow2(n_split)), HAS_SINK=sinks is not None)


def gqa_decode(q, storage, table, positions, scale: float, *, window: int = 0, ring: bool = False, sinks=None,
               splits: int | None = None):
    """Decode attention of ``q [B, Hq, Dh]`` over the paged KV ``storage [N, 2, Hkv, S, Dh]`` (module docstring)
    -> ``[B, Hq*Dh]`` in ``q``'s dtype."""
    import torch

    B, Hq, D = q.shape
    _, two, Hkv, S, D2 = storage.shape
    if two != 2 or D2 != D or Hq % Hkv:
        raise ValueError(f"gqa_decode: q {tuple(q.shape)} does not fit storage {tuple(storage.shape)}")
    if ring and window <= 0:
        raise ValueError("gqa_decode: a ring needs window > 0")
    G = Hq // Hkv
    P = table.shape[1]
    BN = min(S, 64)
    out = torch.empty(B, Hq, D, dtype=q.dtype, device=q.device)
    if B == 0:
        return out.view(B, Hq * D)
    if q.stride(2) != 1:
        q = q.contiguous()
    storage = storage if storage.stride(4) == 1 else storage.contiguous()
    table = table.contiguous()
    ns = splits or n_splits(Hkv * B, P * S // BN)
    mo = torch.empty(B * Hq * ns, D, dtype=torch.float32, device=q.device)
    mm = torch.empty(B * Hq * ns, dtype=torch.float32, device=q.device)
    ml = torch.empty_like(mm)
    _kernels()[0][(Hkv, B, ns)](
        q, storage, table, positions, mo, mm, ml,
        q.stride(0), q.stride(1), storage.stride(0), storage.stride(1), storage.stride(2), storage.stride(3),
        table.stride(0), ns, float(scale), int(window), P,
        G=G, GP=max(16, _next_pow2(G)), D=D, S=S, BN=BN, RING=bool(ring), num_warps=4)
    _merge(mo, mm, ml, None if sinks is None else sinks.contiguous(), out, ns, Hq, D)
    return out.view(B, Hq * D)


def mla_decode(q, storage, table, positions, scale: float, kv_lora: int, *, block_heads: int = 64,
               block_tokens: int = 64, num_warps: int = 8, splits: int | None = None):
    """Absorbed MLA decode of ``q [B, H, kv_lora + rope]`` over the latent pages ``storage [N, S, kv_lora +
    rope]`` -> ``[B, H, kv_lora]`` in ``q``'s dtype (module docstring). Tiling default: 64 heads x 64 tokens per
    step, 8 warps -- the fastest of six tilings measured on an H200 at DeepSeek-V3 width (128 heads, context 4096,
    batch 32-256: 1.9-2.7x the torch path; ``engine.bench.paged_attention``); the block is compute-bound there
    (~225 TFLOP/s at batch 256), which a 64-row tensor-core tile serves best."""
    import torch

    B, H, W = q.shape
    _, S, W2 = storage.shape
    RD = W - kv_lora
    if W2 != W or RD <= 0 or _next_pow2(kv_lora) != kv_lora or _next_pow2(RD) != RD:
        raise ValueError(f"mla_decode: q {tuple(q.shape)}, storage {tuple(storage.shape)}, kv_lora {kv_lora}: "
                         "needs matching row widths and power-of-two latent and rope widths")
    P = table.shape[1]
    BN = min(S, block_tokens)
    out = torch.empty(B, H, kv_lora, dtype=q.dtype, device=q.device)
    if B == 0:
        return out
    if q.stride(2) != 1:
        q = q.contiguous()
    table = table.contiguous()
    nhb = -(-H // block_heads)
    ns = splits or n_splits(nhb * B, P * S // BN)
    mo = torch.empty(B * H * ns, kv_lora, dtype=torch.float32, device=q.device)
    mm = torch.empty(B * H * ns, dtype=torch.float32, device=q.device)
    ml = torch.empty_like(mm)
    _kernels()[1][(nhb, B, ns)](
        q, storage, table, positions, mo, mm, ml,
        q.stride(0), q.stride(1), storage.stride(0), storage.stride(1), table.stride(0), ns, float(scale), H,
        BH=block_heads, L=kv_lora, RD=RD, S=S, BN=BN, num_warps=num_warps)
    _merge(mo, mm, ml, None, out, ns, H, kv_lora)
    return out
