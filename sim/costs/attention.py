"""Token-mixer time per layer and rank: full (softmax, GQA) attention and Gated DeltaNet, prefill and decode.

Sharding: ``tp`` ranks split the query heads (and DeltaNet heads) evenly; KV heads are split too but never below
one per rank — with ``tp > n_kv_heads`` (Qwen3-235B has 4 KV heads, TP=8) the K/V projections and the KV cache
are *replicated* on ``tp / n_kv_heads`` ranks each (the write-up's "KV-projection replication").

Full attention (per layer, per rank; H = local query heads, D = head_dim, Hkv = local KV heads):

* projections: fused QKV ``[T, hidden] @ [hidden, H*D*(2 if gated) + 2*Hkv*D]`` and O ``[T, H*D] @ [H*D, hidden]``
  as GEMMs (:mod:`sim.costs.gemm`, in the deployment's weight format);
* prefill core (flash attention, causal): ``4 * H * D * (q*c + q*(q+1)/2)`` FLOPs for a sequence of ``q`` new
  tokens after ``c`` cached ones (QK^T and PV, 2 FLOPs per MAC, causal mask halves the square), at the bf16 peak
  times a flash efficiency that rises with sequence length (``constants.FLASH_EFFICIENCY``,
  ``FLASH_HALF_SEQ_TOKENS``; calibration kind ``flash_tflops`` replaces it). The sequences of a batch share one
  kernel, whose parallel units are sequences x heads: ``n`` equal sequences of ``H`` heads run like one sequence
  of ``n H`` heads (the imported tables' batched rows, median 1-2 % apart). A sequence of a batch is priced at its
  own length (``q + c``) and at the rate of ``n_i = F / f_i`` copies of itself, ``F`` the batch's FLOPs and
  ``f_i`` its own: equal sequences are ``n`` copies, a long sequence beside short ones runs nearly alone (its
  rate is that of one sequence) and a short one beside long ones fills the kernel at a high rate. The measured
  rate at ``n_i`` is interpolated linearly in ``log n_i`` between the powers of two around it (the tables
  measure batches of 1, 2, 4, ... sequences);
* decode core (paged): reads the KV cache — ``ceil(ctx / page) * page * 2 * Hkv * D * kv_elem_bytes`` per
  sequence — at the achievable HBM rate times ``DECODE_ATTN_BW_EFFICIENCY``; compute (``4 * H * D * ctx`` per
  query token, ``q_per_seq`` query tokens for MTP verification) is checked as a roofline leg. Calibration kind
  ``decode_attn_GBps`` (the measured decode kernel's KV-read rate per ``seq_heads`` = sequences x local KV heads
  and mean context) replaces the rate; without it ``hbm_GBps``;
* both calibrated lookups carry ``head_dim`` and the head counts (prefill: H and Hkv times the sequences, above;
  decode: ``n_q_heads`` = H, ``n_kv_heads`` = Hkv), decode also the KV cache format (``kv``: ``fp8`` at <= 1 B
  per element, else ``bf16``): imported tables measured per head configuration and format match on them, entries
  pinning only ``head_dim`` (the engine's own calibration) match any, with the same value for every batch.

Gated DeltaNet (Qwen3.5 "linear" layers; Hv value heads, Dk = Dv = linear_head_dim, chunk C):

* projections: in_proj_qkvz + in_proj_ba ``[T, hidden] @ [hidden, (2*Hk*Dk + 2*Hv*Dv + 2*Hv) / tp]`` and
  out_proj ``[T, Hv*Dv/tp] @ [., hidden]`` as GEMMs;
* prefill core (chunked delta rule): per token and value head ``2 * (2*C*Dk + C*Dv + 3*Dk*Dv)`` FLOPs (intra-chunk
  K K^T and Q K^T, the chunk's attention-like A V, and the three state products Q S, K^T U, W S) plus the causal
  conv, at ``GDN_EFFICIENCY`` of the bf16 peak; the final state of each sequence is written once;
* decode core: the fp32 state ``Hv * Dk * Dv * 4`` B per sequence is read and written once per step
  (memory-bound), plus the conv state.

All functions return an :class:`AttentionCost` for ONE layer on ONE rank, in seconds. The dimensions come from the
model's layer kinds (``model.mixer("full")`` / ``("linear")``, :mod:`engine.core.layers`): head counts per rank,
projection GEMM shapes, core FLOPs and KV / state bytes; ``MIXER_COSTS`` maps each kind's tag to its functions.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from rackbed.sim.costs import constants as C
from rackbed.sim.costs.calibration import CalibrationTable, kernel_fixed_us, lookup
from rackbed.sim.costs.gemm import ZERO_GEMM, GemmCost, gemm_time, hbm_rate_Bps
from rackbed.topology.errors import UserError
from rackbed.topology.specs import GpuSpec


@dataclass(frozen=True, slots=True)
class AttentionCost:
    """One token mixer layer on one rank: ``proj_s`` (projection GEMMs), ``core_s`` (attention / recurrence
    kernel), ``total_s``; ``core_flops`` and ``core_bytes`` of the core kernel. ``parts``: further named kernels
    of the kind beyond projections and core (MLA: ``kv_up``, the kv_b up-projection of cached tokens in prefill;
    ``absorb``, the absorbed W_UK / W_UV batched GEMMs in decode), each its own breakdown term
    ``<prefix>_<name>``; empty for the other kinds."""

    proj_s: float
    core_s: float
    core_flops: float
    core_bytes: float
    parts: tuple[tuple[str, float], ...] = ()

    @property
    def total_s(self) -> float:
        return self.proj_s + self.core_s + sum(s for _, s in self.parts)


def local_heads(n_heads: int, tp: int) -> int:
    """Heads per rank when ``tp`` ranks share ``n_heads`` (at least 1: replication when tp > n_heads)."""
    if tp < 1:
        raise UserError(f"tp must be >= 1, got {tp}")
    return max(1, math.ceil(n_heads / tp))


def _check_seqs(seqs: Sequence[tuple[int, int]]) -> None:
    for q, c in seqs:
        if q < 0 or c < 0:
            raise UserError(f"sequence (new_tokens={q}, cached={c}): counts must be >= 0")


def flash_efficiency(gpu: GpuSpec, seq_tokens: float) -> float:
    """Default flash-attention efficiency (fraction of bf16 peak) for a sequence of ``seq_tokens``."""
    return C.FLASH_EFFICIENCY[gpu.arch] * seq_tokens / (seq_tokens + C.FLASH_HALF_SEQ_TOKENS)


def full_attention_projections(gpu: GpuSpec, model, n_tokens: int, *, tp: int = 1, fmt: str = "bf16",
                               calib: CalibrationTable | None = None, kind: str = "full") -> GemmCost:
    """QKV + O projection GEMMs of one full-attention (``kind="sliding"``: sliding-window) layer on one rank for
    ``n_tokens`` tokens."""
    if n_tokens <= 0:
        return ZERO_GEMM
    return _gemms(gpu, _gqa(model, kind).proj_gemms(tp), n_tokens, fmt, calib)


def _gqa(model, kind: str):
    """The model's GQA-family kind ``kind`` ("full" | "sliding"; ``UserError`` without one)."""
    att = model.mixer(kind)
    if att is None:
        raise UserError(f"{model.name} has no {kind!r} attention layers")
    return att


def _gemms(gpu: GpuSpec, shapes, n_tokens: int, fmt: str, calib: CalibrationTable | None) -> GemmCost:
    """The sum of a kind's projection GEMMs (``AttentionKind.proj_gemms``: ``(n, k)`` each) for ``n_tokens``."""
    (n0, k0), *rest = shapes
    out = gemm_time(gpu, n_tokens, n0, k0, fmt, calib=calib)
    for n, k in rest:
        out = out + gemm_time(gpu, n_tokens, n, k, fmt, calib=calib)
    return out


def _copies(total: float, own: float) -> float:
    """``total / own`` (>= 1), snapped to the integer it is within rounding of (equal sequences: exactly ``n``)."""
    n = max(total / own, 1.0)
    r = round(n)
    return float(r) if abs(n - r) <= 1e-9 * n else n


def flash_rate(calib: CalibrationTable | None, gpu: GpuSpec, seq_tokens: float, head_dim: int, n_q_heads: int,
               n_kv_heads: int, copies: float = 1.0, window: int = 0) -> float | None:
    """Measured prefill-attention rate (TFLOP/s, kind ``flash_tflops``) of a sequence of ``seq_tokens`` whose
    kernel holds the work of ``copies`` sequences like it: looked up at ``copies x`` the heads, interpolated
    linearly in ``log copies`` between the powers of two around it (module docstring); None without an entry."""
    if calib is None:
        return None
    n0 = 2 ** math.floor(math.log2(copies)) if copies > 1 else 1

    def at(n: int) -> float | None:
        if window:  # sliding-window curves only (full-attention curves pin no window and would match)
            e = calib.entry("flash_tflops", gpu.name, head_dim=head_dim, n_q_heads=n_q_heads * n,
                            n_kv_heads=n_kv_heads * n, window=window)
            if e is None or e.key.get("window") != window:
                return None
            return calib.lookup("flash_tflops", gpu.name, seq_tokens, head_dim=head_dim, n_q_heads=n_q_heads * n,
                                n_kv_heads=n_kv_heads * n, window=window)
        return calib.lookup("flash_tflops", gpu.name, seq_tokens, head_dim=head_dim, n_q_heads=n_q_heads * n,
                            n_kv_heads=n_kv_heads * n)

    y0 = at(n0)
    if y0 is None or copies <= n0:
        return y0
    y1 = at(2 * n0)
    return y0 if y1 is None else y0 + math.log2(copies / n0) * (y1 - y0)


def sliding_window_flops(att, new_tokens: int, tp: int = 1) -> float:
    """The work measure of the measured sliding-window prefill curves: every new token against a whole window
    (``new_tokens x window`` pairs), whatever it attends (a power law in the length, which the curves
    interpolate smoothly across the window; :mod:`sim.perf_tables_attention`)."""
    return att.core_flops_per_pair(tp) * new_tokens * att.window


def full_attention_prefill(gpu: GpuSpec, model, seqs: Sequence[tuple[int, int]], *, tp: int = 1,
                           fmt: str = "bf16", calib: CalibrationTable | None = None,
                           kind: str = "full") -> AttentionCost:
    """One full-attention layer on one rank for a prefill batch. ``seqs``: ``(new_tokens, cached_tokens)`` per
    sequence (chunked prefill / prefix-cache hits have ``cached_tokens > 0``); the sequences share one kernel
    (module docstring: each is priced at the rate of ``F / f_i`` copies of itself)."""
    _check_seqs(seqs)
    att = _gqa(model, kind)
    (h, hkv), d = att.local_heads(tp), att.head_dim
    peak = gpu.dense_tflops.bf16 * 1e12
    work = [(q, c, att.prefill_core_flops(q, c, tp)) for q, c in seqs if q]
    total = sum(f for _, _, f in work)
    flops, core_s, kv_bytes, alone_s = 0.0, 0.0, 0.0, 0.0
    mixed = len({(q, c) for q, c, _ in work}) > 1
    window = getattr(att, "window", 0)
    for q, c, f in work:
        copies = _copies(total, f)
        # a sliding-window layer: its measured curves (key ``window``, x = the sequence's length) where the
        # calibration has them, else the rate of a causal sequence with as many keys per query (2 x window)
        seq = q + c
        measured = flash_rate(calib, gpu, seq, d, h, hkv, copies, window)
        rate = measured * 1e12 if measured is not None else \
            peak * flash_efficiency(gpu, min(seq, 2 * window) if window else seq)
        work = sliding_window_flops(att, q, tp) if window and measured is not None else f
        core_s += work / rate
        flops += f
        kv_bytes += att.kv_read_bytes(att.kv_tokens(q + c), tp, 2)
        if measured is not None and mixed:
            # a mixed batch is never faster than its slowest sequence alone (the copies rule is measured on
            # equal sequences only; a short sequence beside a long cached one would otherwise borrow a batch's rate)
            alone_s = max(alone_s, work / (flash_rate(calib, gpu, seq, d, h, hkv, 1.0, window) * 1e12))
    core_s = max(core_s, alone_s)
    core_s += kernel_fixed_us(calib, gpu) * 1e-6 if flops else 0.0
    n_tokens = sum(q for q, _ in seqs)
    proj = full_attention_projections(gpu, model, n_tokens, tp=tp, fmt=fmt, calib=calib, kind=kind)
    return AttentionCost(proj.total_s, core_s, flops, kv_bytes)


def full_attention_decode(gpu: GpuSpec, model, context_lens: Sequence[int], *, tp: int = 1,
                          fmt: str = "bf16", q_per_seq: int = 1, kv_elem_bytes: float = 2.0,
                          page_tokens: int = C.KV_PAGE_TOKENS,
                          calib: CalibrationTable | None = None) -> AttentionCost:
    """One full-attention layer on one rank for a decode step: ``context_lens[i]`` tokens of KV per sequence
    (including the new ones), ``q_per_seq`` query tokens each (1; k+1 when verifying k MTP drafts). Pages are
    rounded up exactly per sequence."""
    pages = 0
    for ctx in context_lens:
        if ctx < 0:
            raise UserError(f"context length must be >= 0, got {ctx}")
        pages += -(-ctx // page_tokens)
    return _full_decode(gpu, model, len(context_lens), pages * page_tokens, sum(context_lens), tp, fmt,
                        q_per_seq, kv_elem_bytes, calib)


def sliding_attention_decode(gpu: GpuSpec, model, context_lens: Sequence[int], *, tp: int = 1,
                             fmt: str = "bf16", q_per_seq: int = 1, kv_elem_bytes: float = 2.0,
                             page_tokens: int = C.KV_PAGE_TOKENS,
                             calib: CalibrationTable | None = None) -> AttentionCost:
    """One sliding-window layer on one rank for a decode step: as :func:`full_attention_decode` over each
    sequence's last ``window`` tokens (``min(ctx, window)``), read as whole pages: a window that starts inside a
    page reads that page from its start (``ceil``-many pages from the window's first page)."""
    att = _gqa(model, "sliding")
    tokens, kept = 0, 0
    for ctx in context_lens:
        if ctx < 0:
            raise UserError(f"context length must be >= 0, got {ctx}")
        k = att.kv_tokens(ctx)
        first = (ctx - k) // page_tokens  # the page holding the window's first token
        tokens += (-(-ctx // page_tokens) - first) * page_tokens
        kept += k
    mean = sum(context_lens) / len(context_lens) if context_lens else 0.0
    return _full_decode(gpu, model, len(context_lens), tokens, kept, tp, fmt, q_per_seq, kv_elem_bytes, calib,
                        att, mean)


def sliding_attention_decode_totals(gpu: GpuSpec, model, n_seqs: int, context_tokens: float, *, tp: int = 1,
                                    fmt: str = "bf16", q_per_seq: int = 1, kv_elem_bytes: float = 2.0,
                                    page_tokens: int = C.KV_PAGE_TOKENS,
                                    calib: CalibrationTable | None = None) -> AttentionCost:
    """As :func:`sliding_attention_decode` from totals: each of the ``n_seqs`` sequences is taken to hold the mean
    context ``context_tokens / n_seqs`` (exact for equal contexts; with unequal ones ``sum(min(c_i, w))`` is at
    most this, so the estimate errs slow), capped at the window; a window spanning pages reads on average
    ``window + page_tokens - 1`` tokens of whole pages (the mean over where it starts in its first page), a
    shorter context its own tokens plus half a page."""
    if n_seqs < 0 or context_tokens < 0:
        raise UserError(f"n_seqs and context_tokens must be >= 0, got {n_seqs}, {context_tokens}")
    att = _gqa(model, "sliding")
    if n_seqs == 0:
        return AttentionCost(0.0, 0.0, 0.0, 0.0)
    mean = context_tokens / n_seqs
    kept = n_seqs * min(mean, att.window)
    paged = n_seqs * min(mean + (page_tokens - 1) / 2, att.window + page_tokens - 1)
    return _full_decode(gpu, model, n_seqs, paged, kept, tp, fmt, q_per_seq, kv_elem_bytes, calib, att, mean)


def full_attention_decode_totals(gpu: GpuSpec, model, n_seqs: int, context_tokens: float, *, tp: int = 1,
                                 fmt: str = "bf16", q_per_seq: int = 1, kv_elem_bytes: float = 2.0,
                                 page_tokens: int = C.KV_PAGE_TOKENS,
                                 calib: CalibrationTable | None = None) -> AttentionCost:
    """As :func:`full_attention_decode` from totals (what ``DecodeStep`` carries): ``n_seqs`` sequences holding
    ``context_tokens`` KV tokens together; the last page of each sequence is on average half empty, so
    ``n_seqs * (page_tokens - 1) / 2`` padding tokens are read on top."""
    if n_seqs < 0 or context_tokens < 0:
        raise UserError(f"n_seqs and context_tokens must be >= 0, got {n_seqs}, {context_tokens}")
    paged = context_tokens + n_seqs * (page_tokens - 1) / 2
    return _full_decode(gpu, model, n_seqs, paged, context_tokens, tp, fmt, q_per_seq, kv_elem_bytes, calib)


def kv_format(kv_elem_bytes: float) -> str:
    """The ``kv`` key of a decode-attention lookup: ``fp8`` for a cache of <= 1 B per element, else ``bf16``."""
    return "fp8" if kv_elem_bytes <= 1 else "bf16"


def _full_decode(gpu: GpuSpec, model, n_seqs: int, paged_tokens: float, total_ctx: float, tp: int, fmt: str,
                 q_per_seq: int, kv_elem_bytes: float, calib: CalibrationTable | None, att=None,
                 mean_ctx: float = 0.0) -> AttentionCost:
    """The decode core and projections of a full or sliding-window (``att``) layer. ``total_ctx``: the tokens the
    sequences attend (a sliding layer's windows); ``mean_ctx``: a sliding layer's mean context per sequence, the x
    of its measured curves, which price the window's bytes (``total_ctx``) at the measured kernel's time."""
    if q_per_seq < 1:
        raise UserError(f"q_per_seq must be >= 1, got {q_per_seq}")
    if n_seqs <= 0:
        return AttentionCost(0.0, 0.0, 0.0, 0.0)
    att = att if att is not None else model.mixer("full")
    window = getattr(att, "window", 0)
    (h, hkv), d = att.local_heads(tp), att.head_dim
    kv_bytes = att.kv_read_bytes(paged_tokens, tp, kv_elem_bytes)
    flops = att.decode_core_flops(total_ctx, tp, q_per_seq)
    # calibration kind decode_attn_GBps (the measured decode kernel per sequences x KV heads, context and KV
    # format), else hbm_GBps (a streaming copy of the same bytes), else the datasheet rate times
    # DECODE_ATTN_BW_EFFICIENCY
    # sliding-window curves are read at the sequence's whole context (the measured kernel's time keeps growing past
    # the window) and their rate is over the window's tokens (no page rounding: the measured time is the kernel's)
    ctx = max(mean_ctx, 1.0) if window else max(paged_tokens / n_seqs, 1.0)
    measured = decode_attn_rate(calib, gpu, ctx, float(n_seqs * hkv), d, h, hkv, kv_format(kv_elem_bytes), window)
    read_bytes = kv_bytes
    if measured is not None and window:
        read_bytes = att.kv_read_bytes(total_ctx, tp, kv_elem_bytes)
    if measured is None:
        measured = lookup(calib, "hbm_GBps", gpu.name, max(kv_bytes, 1.0))
    bw = measured * 1e9 if measured is not None else hbm_rate_Bps(gpu) * C.DECODE_ATTN_BW_EFFICIENCY
    memory_s = read_bytes / bw
    compute_s = flops / (gpu.dense_tflops.bf16 * 1e12 * C.FLASH_EFFICIENCY[gpu.arch])
    core_s = max(memory_s, compute_s) + kernel_fixed_us(calib, gpu) * 1e-6
    proj = full_attention_projections(gpu, model, n_seqs * q_per_seq, tp=tp, fmt=fmt, calib=calib, kind=att.kind)
    return AttentionCost(proj.total_s, core_s, flops, kv_bytes)


def decode_attn_rate(calib: CalibrationTable | None, gpu: GpuSpec, ctx: float, seq_heads: float, head_dim: int,
                     n_q_heads: int, n_kv_heads: int, kv: str, window: int = 0) -> float | None:
    """Measured decode-attention rate (GB/s, kind ``decode_attn_GBps``) at ``ctx`` tokens per sequence and
    ``seq_heads`` sequences x local KV heads (interpolated in ``log seq_heads``); a sliding layer (``window``) reads
    only the curves pinning its window (a short context of a full-attention curve is another kernel). None
    without a curve."""
    if calib is None:
        return None
    if not window:
        return calib.lookup_along("decode_attn_GBps", gpu.name, ctx, "seq_heads", seq_heads, head_dim=head_dim,
                                  n_q_heads=n_q_heads, n_kv_heads=n_kv_heads, kv=kv)
    return _along_pinned(calib, "decode_attn_GBps", gpu.name, ctx, "seq_heads", seq_heads, "window", window,
                         head_dim=head_dim, n_q_heads=n_q_heads, n_kv_heads=n_kv_heads, kv=kv)


def _along_pinned(calib: CalibrationTable, kind: str, gpu: str, x: float, field: str, value: float, pin: str,
                  pin_value, **key) -> float | None:
    """``calib.lookup_along`` restricted to entries pinning ``pin = pin_value`` (None when there are none), so
    that entries which leave ``pin`` out (and would match anything) never price the query."""
    e = calib.entry(kind, gpu, **key, **{field: value, pin: pin_value})
    if e is None or e.key.get(pin) != pin_value:
        return None
    return calib.lookup_along(kind, gpu, x, field, value, **key, **{pin: pin_value})


def linear_attention_projections(gpu: GpuSpec, model, n_tokens: int, *, tp: int = 1, fmt: str = "bf16",
                                 calib: CalibrationTable | None = None) -> GemmCost:
    """in_proj_qkvz + in_proj_ba and out_proj GEMMs of one Gated DeltaNet layer on one rank."""
    if n_tokens <= 0:
        return ZERO_GEMM
    return _gemms(gpu, _gdn(model).proj_gemms(tp), n_tokens, fmt, calib)


def _gdn(model):
    """The model's Gated DeltaNet kind (``UserError`` without one)."""
    att = model.mixer("linear")
    if att is None:
        raise UserError(f"{model.name} has no linear-attention layers")
    return att


def _gdn_state_bytes(model, tp: int) -> float:
    """Recurrent state (``GDN_STATE_ELEM_BYTES`` per element) + bf16 conv state of one sequence in one DeltaNet
    layer on one rank."""
    return _gdn(model).local_state_bytes(tp, C.GDN_STATE_ELEM_BYTES, 2)


def linear_attention_prefill(gpu: GpuSpec, model, seqs: Sequence[tuple[int, int]], *, tp: int = 1,
                             fmt: str = "bf16", calib: CalibrationTable | None = None) -> AttentionCost:
    """One Gated DeltaNet layer on one rank for a prefill batch (``(new_tokens, cached_tokens)`` per sequence;
    cached tokens only matter through the stored state, read once)."""
    _check_seqs(seqs)
    att = _gdn(model)
    per_tok = att.prefill_flops_per_token(tp, C.GDN_CHUNK_TOKENS)
    n_tokens = sum(q for q, _ in seqs)
    n_seqs = sum(1 for q, _ in seqs if q)
    flops = per_tok * n_tokens
    state_bytes = n_seqs * _gdn_state_bytes(model, tp) * 2  # read initial + write final state
    act_bytes = n_tokens * att.prefill_act_bytes_per_token(tp)  # q, k, v in; o out (bf16)
    compute_s = flops / (gpu.dense_tflops.bf16 * 1e12 * C.GDN_EFFICIENCY)
    memory_s = (state_bytes + act_bytes) / hbm_rate_Bps(gpu, state_bytes + act_bytes, calib)
    core_s = (max(compute_s, memory_s) + kernel_fixed_us(calib, gpu) * 1e-6) if n_tokens else 0.0
    proj = linear_attention_projections(gpu, model, n_tokens, tp=tp, fmt=fmt, calib=calib)
    return AttentionCost(proj.total_s, core_s, flops, state_bytes + act_bytes)


def linear_attention_decode(gpu: GpuSpec, model, n_seqs: int, *, tp: int = 1, fmt: str = "bf16",
                            q_per_seq: int = 1, calib: CalibrationTable | None = None) -> AttentionCost:
    """One Gated DeltaNet layer on one rank for a decode step of ``n_seqs`` sequences (``q_per_seq`` tokens each,
    processed recurrently with the state held on chip): state read + written once per sequence."""
    att = _gdn(model)
    if n_seqs <= 0:
        return AttentionCost(0.0, 0.0, 0.0, 0.0)
    state = n_seqs * _gdn_state_bytes(model, tp) * 2
    flops = n_seqs * q_per_seq * att.decode_flops_per_token(tp)  # decay, S^T k, rank-1 update, S^T q
    memory_s = state / hbm_rate_Bps(gpu, state, calib)
    compute_s = flops / (gpu.dense_tflops.bf16 * 1e12 * C.GDN_EFFICIENCY)
    core_s = max(memory_s, compute_s) + kernel_fixed_us(calib, gpu) * 1e-6
    proj = linear_attention_projections(gpu, model, n_seqs * q_per_seq, tp=tp, fmt=fmt, calib=calib)
    return AttentionCost(proj.total_s, core_s, flops, state)


# ------------------------------------------------------------------------------------------------ per-kind registry


@dataclass(frozen=True)
class MixerCosts:
    """How the step cost model (:mod:`sim.costs.step`) prices one token-mixer kind (``AttentionKind.kind``).

    prefix:  the breakdown terms' prefix (``<prefix>_proj``, ``<prefix>_core``).
    prefill: ``(gpu, model, seqs, tp=, fmt=, calib=) -> AttentionCost`` of one layer on one rank.
    decode:  ``(gpu, model, rank_batch, front, kw) -> AttentionCost`` of one layer on the slowest DP rank;
             ``front`` = the (sequences, context tokens) pairs that can be slowest (``step.pareto_ranks``),
             ``kw`` = fmt, q_per_seq, kv_elem_bytes, page_tokens, calib, and tp (a DP rank's attention TP) when > 1.
    """

    prefix: str
    prefill: Callable[..., AttentionCost]
    decode: Callable[..., AttentionCost]


def _full_decode_slowest(gpu: GpuSpec, model, rank_batch, front, kw: dict) -> AttentionCost:
    return max((full_attention_decode_totals(gpu, model, n, ctx, **kw) for n, ctx in front),
               key=lambda a: a.total_s)


def _linear_decode_slowest(gpu: GpuSpec, model, rank_batch, front, kw: dict) -> AttentionCost:
    return linear_attention_decode(gpu, model, max(rank_batch), tp=kw.get("tp", 1), fmt=kw["fmt"],
                                   q_per_seq=kw["q_per_seq"], calib=kw["calib"])


def sliding_attention_prefill(gpu: GpuSpec, model, seqs: Sequence[tuple[int, int]], *, tp: int = 1,
                              fmt: str = "bf16", calib: CalibrationTable | None = None) -> AttentionCost:
    """One sliding-window layer on one rank for a prefill batch: :func:`full_attention_prefill` with the window's
    attended pairs (``SlidingWindowAttention.attended_pairs``) at the rate of the window's curves (or of a causal
    sequence of ``2 x window`` tokens: as many keys per query)."""
    return full_attention_prefill(gpu, model, seqs, tp=tp, fmt=fmt, calib=calib, kind="sliding")


def _sliding_decode_slowest(gpu: GpuSpec, model, rank_batch, front, kw: dict) -> AttentionCost:
    return max((sliding_attention_decode_totals(gpu, model, n, ctx, **kw) for n, ctx in front),
               key=lambda a: a.total_s)


def _mla_decode_slowest(gpu: GpuSpec, model, rank_batch, front, kw: dict) -> AttentionCost:
    from rackbed.sim.costs.mla import mla_decode_totals

    return max((mla_decode_totals(gpu, model, n, ctx, **kw) for n, ctx in front), key=lambda a: a.total_s)


def _mla_prefill(gpu: GpuSpec, model, seqs, *, tp: int = 1, fmt: str = "bf16",
                 calib: CalibrationTable | None = None) -> AttentionCost:
    from rackbed.sim.costs.mla import mla_prefill

    return mla_prefill(gpu, model, seqs, tp=tp, fmt=fmt, calib=calib)


#: kind tag -> its costs, in the order the step adds their terms (``sim.costs.mla`` for MLA)
MIXER_COSTS: dict[str, MixerCosts] = {
    "full": MixerCosts("attn", full_attention_prefill, _full_decode_slowest),
    "linear": MixerCosts("linear_attn", linear_attention_prefill, _linear_decode_slowest),
    "sliding": MixerCosts("sliding_attn", sliding_attention_prefill, _sliding_decode_slowest),
    "mla": MixerCosts("mla", _mla_prefill, _mla_decode_slowest),
}


def mixer_counts(model) -> list[tuple[MixerCosts, int]]:
    """(costs, layer count) of each token-mixer kind of ``model`` in ``MIXER_COSTS`` order; ``UserError`` for a
    kind without a cost model."""
    counts = {a.kind: n for a, n in model.attention_counts()}
    missing = sorted(set(counts) - set(MIXER_COSTS))
    if missing:
        raise UserError(f"{model.name}: no cost model for attention kind {missing[0]!r} "
                        f"(sim.costs.attention.MIXER_COSTS has {', '.join(MIXER_COSTS)})")
    return [(c, counts[k]) for k, c in MIXER_COSTS.items() if counts.get(k)]


def mtp_costs(model) -> MixerCosts:
    """The costs of an MTP module's token mixer (``ModelSpec.mtp_layer``: MLA in an MLA model, else full)."""
    return MIXER_COSTS[model.kinds.mtp_attention.kind]
