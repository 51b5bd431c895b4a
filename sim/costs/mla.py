"""Multi-head latent attention (MLA: DeepSeek-V3, Kimi-K2) per layer and rank: expanded prefill, absorbed decode.

Dimensions come from the model's MLA kind (``engine.core.layers.mla.MlaAttention``): H = the rank's heads
(``n_heads / tp``; a DP-attention rank holds all of them), latent ``kv_lora_rank`` + rotary ``qk_rope_head_dim``
values per cached token, ``qk_nope_head_dim`` / ``v_head_dim`` per head.

* **projections** (GEMMs in the deployment's weight format, :mod:`sim.costs.gemm`): q_a (hidden -> q_lora, every
  rank whole), q_b (q_lora -> H (nope + rope)), kv_a (hidden -> kv_lora + rope, every rank whole: each needs the
  whole latent), o (H v -> hidden); in prefill also kv_b (kv_lora -> H (nope + v)) on the new tokens.
* **prefill** (expanded, term ``mla_core``): per sequence ``2 H (nope + rope + v)`` FLOPs per attended (query, key)
  pair (QK^T over nope + rope dims, PV over v dims), causal. Calibration kind ``mla_prefill_tflops`` (the measured
  context-MLA kernel per local heads, sequences in the kernel and KV format; looked up like full attention's
  ``flash_tflops``: a sequence of a batch at the rate of ``F / f_i`` copies of itself, interpolated in
  ``log seqs``) replaces the default rate ``bf16 peak x flash efficiency(sequence length)``. The cached tokens of a
  chunk (prefix hits, earlier chunks) are stored as latents: their K and V are rebuilt by kv_b before the kernel,
  a GEMM of ``cached tokens x kv_lora -> H (nope + v)`` (term ``mla_kv_up``).
* **decode** (absorbed weights, term ``mla_core``): W_UK folds into the query and W_UV into the output, so each
  head scores the latent directly; the latent is read **once per rank for all its heads**, whatever the TP degree
  (``ctx x (kv_lora + rope) x elem`` bytes per sequence, whole pages), and the FLOPs are ``2 H (2 kv_lora + rope)``
  per context token and query token — at 128 heads (DP attention) that is ~240 FLOP per byte of bf16 latent,
  above H200's ridge (~206), so the kernel is compute-bound there and bandwidth-bound at a few heads per rank.
  Calibration kind ``mla_decode_GBps`` (the measured generation-MLA kernel: latent bytes over time per local
  heads, sequences and KV format; interpolated in ``log seqs``) replaces the rate; without it ``hbm_GBps``, else
  the datasheet rate x ``DECODE_ATTN_BW_EFFICIENCY``; compute is a roofline leg at ``FLASH_EFFICIENCY`` of the
  bf16 peak. The tables measure one query token per sequence: with ``q_per_seq > 1`` (MTP verification) the
  measured time grows with the FLOPs where the measured kernel was compute-bound (``t1 x F(q) / max(F(1) leg,
  t1)``), else it stays (bandwidth-bound: the latent is read once for all query tokens).
* **absorbed GEMMs** (term ``mla_absorb``): W_UK ``[T, nope] -> [T, kv_lora]`` and W_UV ``[T, kv_lora] -> [T, v]``
  batched over the rank's heads. Calibration kind ``mla_bmm_us`` (the measured ``mla_gen_pre`` / ``mla_gen_post``
  batched GEMMs per heads and format, x = tokens) replaces them; otherwise each is priced as one GEMM with the
  heads' weights side by side (``n = H x kv_lora``, ``k = nope``; ``n = H x v``, ``k = kv_lora``): the same FLOPs
  and weight bytes.

Measured MLA curves pin the MLA dimensions (key ``dims`` = ``"kv_lora+rope/nope/v"``, DeepSeek-V3's
``"512+64/128/128"``), so a model with other dimensions falls back to the first-principles rates.
"""

from __future__ import annotations

from collections.abc import Sequence

from rackbed.sim.costs import constants as C
from rackbed.sim.costs.attention import (
    AttentionCost,
    _check_seqs,
    _copies,
    _gemms,
    flash_efficiency,
    kv_format,
)
from rackbed.sim.costs.calibration import CalibrationTable, kernel_fixed_us, lookup
from rackbed.sim.costs.gemm import ZERO_GEMM, gemm_time, hbm_rate_Bps
from rackbed.topology.errors import UserError
from rackbed.topology.specs import GpuSpec


def _mla(model):
    att = model.mixer("mla")
    if att is None:
        raise UserError(f"{model.name} has no MLA layers")
    return att


def mla_dims(att) -> str:
    """The ``dims`` key of measured MLA curves: ``"kv_lora+rope/nope/v"``."""
    return f"{att.kv_lora_rank}+{att.qk_rope_head_dim}/{att.qk_nope_head_dim}/{att.v_head_dim}"


def bmm_format(fmt: str) -> str:
    """The format the absorbed batched GEMMs run in: bf16 weights stay bf16, every quantized deployment runs
    them in FP8 (TensorRT-LLM's block-scaled FP8 BMM; the tables measure bf16 and fp8)."""
    return "bf16" if fmt == "bf16" else "fp8"


def _split(att, tp: int, phase: str):
    """(projection shapes, absorbed shapes) of ``proj_gemms``: decode's two absorbed GEMMs sit before o_proj."""
    shapes = att.proj_gemms(tp, phase)
    if phase == "decode":
        return shapes[:-3] + shapes[-1:], shapes[-3:-1]
    return shapes, ()


def mla_projections(gpu: GpuSpec, model, n_tokens: int, *, tp: int = 1, fmt: str = "bf16", phase: str = "prefill",
                    calib: CalibrationTable | None = None):
    """q_a, q_b, kv_a (+ kv_b on the new tokens in prefill) and o GEMMs of one MLA layer on one rank."""
    if n_tokens <= 0:
        return ZERO_GEMM
    return _gemms(gpu, _split(_mla(model), tp, phase)[0], n_tokens, fmt, calib)


def mla_absorb_s(gpu: GpuSpec, model, n_tokens: int, *, tp: int = 1, fmt: str = "bf16",
                 calib: CalibrationTable | None = None) -> float:
    """The absorbed W_UK and W_UV batched GEMMs of one decode layer on one rank (module docstring)."""
    if n_tokens <= 0:
        return 0.0
    att = _mla(model)
    h = att.local_heads(tp)
    bf = bmm_format(fmt)
    total = 0.0
    for op, (n, k) in zip(("pre", "post"), _split(att, tp, "decode")[1]):
        s = mla_bmm_s(calib, gpu, att, n_tokens, op, h, bf)
        total += s if s is not None else gemm_time(gpu, n_tokens, n, k, bf, calib=calib).total_s
    return total


def mla_bmm_s(calib: CalibrationTable | None, gpu: GpuSpec, att, n_tokens: float, op: str, n_heads: int,
              fmt: str) -> float | None:
    """Measured seconds of one absorbed batched GEMM (kind ``mla_bmm_us``; ``op`` pre = W_UK, post = W_UV) over
    ``n_heads`` local heads in ``fmt`` (bf16 | fp8); None without a curve."""
    us = lookup(calib, "mla_bmm_us", gpu.name, n_tokens, op=op, n_heads=n_heads, fmt=fmt, dims=mla_dims(att))
    return None if us is None else us * 1e-6


def mla_decode_rate(calib: CalibrationTable | None, gpu: GpuSpec, att, ctx: float, seqs: float, n_heads: int,
                    kv: str) -> float | None:
    """Measured absorbed-decode MLA rate (GB/s of latent bytes, kind ``mla_decode_GBps``) at ``ctx`` tokens per
    sequence for ``seqs`` sequences (interpolated in ``log seqs``); None without a curve."""
    if calib is None:
        return None
    return _pinned_along(calib, "mla_decode_GBps", gpu.name, ctx, seqs, n_heads=n_heads, kv=kv, dims=mla_dims(att))


def mla_prefill_rate(calib: CalibrationTable | None, gpu: GpuSpec, att, seq_tokens: float, n_heads: int,
                     copies: float, kv: str) -> float | None:
    """Measured context-MLA rate (TFLOP/s, kind ``mla_prefill_tflops``) of a sequence of ``seq_tokens`` whose
    kernel holds the work of ``copies`` sequences like it (interpolated in ``log seqs``); None without a curve."""
    if calib is None:
        return None
    return _pinned_along(calib, "mla_prefill_tflops", gpu.name, seq_tokens, copies, n_heads=n_heads, kv=kv,
                         dims=mla_dims(att))


def _pinned_along(calib: CalibrationTable, kind: str, gpu: str, x: float, seqs: float, **key) -> float | None:
    """``lookup_along`` over ``seqs`` among curves pinning every field of ``key`` (None when there are none)."""
    e = calib.entry(kind, gpu, **key, seqs=1)
    if e is None or any(e.key.get(f) != v for f, v in key.items()):
        return None
    return calib.lookup_along(kind, gpu, x, "seqs", seqs, **key)


def mla_prefill(gpu: GpuSpec, model, seqs: Sequence[tuple[int, int]], *, tp: int = 1, fmt: str = "bf16",
                kv_elem_bytes: float = 2.0, calib: CalibrationTable | None = None) -> AttentionCost:
    """One MLA layer on one rank for a prefill batch (``(new_tokens, cached_tokens)`` per sequence): projections,
    expanded attention core, kv_b up-projection of the cached tokens (part ``kv_up``)."""
    _check_seqs(seqs)
    att = _mla(model)
    h = att.local_heads(tp)
    per_pair = 2.0 * h * (att.qk_head_dim + att.v_head_dim)
    peak = gpu.dense_tflops.bf16 * 1e12
    kv = kv_format(kv_elem_bytes)
    work = [(q, c, per_pair * att.attended_pairs(q, c)) for q, c in seqs if q]
    total = sum(f for _, _, f in work)
    core_s, alone_s = 0.0, 0.0
    mixed = len({(q, c) for q, c, _ in work}) > 1
    for q, c, f in work:
        measured = mla_prefill_rate(calib, gpu, att, q + c, h, _copies(total, f), kv)
        rate = measured * 1e12 if measured is not None else peak * flash_efficiency(gpu, q + c)
        core_s += f / rate
        if measured is not None and mixed:  # as full attention: never faster than the slowest sequence alone
            alone_s = max(alone_s, f / (mla_prefill_rate(calib, gpu, att, q + c, h, 1.0, kv) * 1e12))
    core_s = max(core_s, alone_s)
    core_s += kernel_fixed_us(calib, gpu) * 1e-6 if total else 0.0
    n_tokens = sum(q for q, _ in seqs)
    cached = sum(c for q, c in seqs if q)
    kv_bytes = sum(att.kv_read_bytes(c, tp, kv_elem_bytes) for q, c in seqs if q)
    up_s = 0.0
    if cached:
        n, k = h * (att.qk_nope_head_dim + att.v_head_dim), att.kv_lora_rank
        up_s = gemm_time(gpu, cached, n, k, fmt, calib=calib).total_s
    proj = mla_projections(gpu, model, n_tokens, tp=tp, fmt=fmt, phase="prefill", calib=calib)
    return AttentionCost(proj.total_s, core_s, total, kv_bytes, (("kv_up", up_s),))


def mla_decode(gpu: GpuSpec, model, context_lens: Sequence[int], *, tp: int = 1, fmt: str = "bf16",
               q_per_seq: int = 1, kv_elem_bytes: float = 2.0, page_tokens: int = C.KV_PAGE_TOKENS,
               calib: CalibrationTable | None = None) -> AttentionCost:
    """One MLA layer on one rank for a decode step: ``context_lens[i]`` latent tokens per sequence (whole pages
    read), ``q_per_seq`` query tokens each."""
    pages = 0
    for ctx in context_lens:
        if ctx < 0:
            raise UserError(f"context length must be >= 0, got {ctx}")
        pages += -(-ctx // page_tokens)
    return _mla_decode(gpu, model, len(context_lens), pages * page_tokens, sum(context_lens), tp, fmt, q_per_seq,
                       kv_elem_bytes, calib)


def mla_decode_totals(gpu: GpuSpec, model, n_seqs: int, context_tokens: float, *, tp: int = 1, fmt: str = "bf16",
                      q_per_seq: int = 1, kv_elem_bytes: float = 2.0, page_tokens: int = C.KV_PAGE_TOKENS,
                      calib: CalibrationTable | None = None) -> AttentionCost:
    """As :func:`mla_decode` from totals (the last page of each sequence half empty on average)."""
    if n_seqs < 0 or context_tokens < 0:
        raise UserError(f"n_seqs and context_tokens must be >= 0, got {n_seqs}, {context_tokens}")
    paged = context_tokens + n_seqs * (page_tokens - 1) / 2
    return _mla_decode(gpu, model, n_seqs, paged, context_tokens, tp, fmt, q_per_seq, kv_elem_bytes, calib)


def _mla_decode(gpu: GpuSpec, model, n_seqs: int, paged_tokens: float, total_ctx: float, tp: int, fmt: str,
                q_per_seq: int, kv_elem_bytes: float, calib: CalibrationTable | None) -> AttentionCost:
    if q_per_seq < 1:
        raise UserError(f"q_per_seq must be >= 1, got {q_per_seq}")
    if n_seqs <= 0:
        return AttentionCost(0.0, 0.0, 0.0, 0.0)
    att = _mla(model)
    h = att.local_heads(tp)
    kv_bytes = att.kv_read_bytes(paged_tokens, tp, kv_elem_bytes)
    flops = att.decode_core_flops(total_ctx, tp, q_per_seq)
    compute_rate = gpu.dense_tflops.bf16 * 1e12 * C.FLASH_EFFICIENCY[gpu.arch]
    compute_s = flops / compute_rate
    measured = mla_decode_rate(calib, gpu, att, max(paged_tokens / n_seqs, 1.0), float(n_seqs), h,
                               kv_format(kv_elem_bytes))
    if measured is not None:
        # the measured one-query kernel, scaled by the extra query tokens' FLOPs where it was compute-bound
        t1 = kv_bytes / (measured * 1e9)
        one_s = compute_s / q_per_seq
        core_s = max(t1, t1 * compute_s / max(one_s, t1)) if q_per_seq > 1 else t1
    else:
        rate = lookup(calib, "hbm_GBps", gpu.name, max(kv_bytes, 1.0))
        bw = rate * 1e9 if rate is not None else hbm_rate_Bps(gpu) * C.DECODE_ATTN_BW_EFFICIENCY
        core_s = max(kv_bytes / bw, compute_s)
    core_s += kernel_fixed_us(calib, gpu) * 1e-6
    t = n_seqs * q_per_seq
    proj = mla_projections(gpu, model, t, tp=tp, fmt=fmt, phase="decode", calib=calib)
    absorb = mla_absorb_s(gpu, model, t, tp=tp, fmt=fmt, calib=calib)
    return AttentionCost(proj.total_s, core_s, flops, kv_bytes, (("absorb", absorb),))


def mla_roofline_intensity(att, tp: int = 1, elem_bytes: float = 2.0) -> float:
    """Decode-core FLOPs per latent byte on one rank (one query token): ``2 H (2 kv_lora + rope) / ((kv_lora +
    rope) x elem)`` — compare with a GPU's bf16 FLOP/s over its HBM bytes/s."""
    return att.decode_core_flops(1.0, tp) / att.kv_read_bytes(1.0, tp, elem_bytes)


__all__ = ["bmm_format", "mla_absorb_s", "mla_decode", "mla_decode_totals", "mla_dims", "mla_prefill",
           "mla_prefill_rate", "mla_projections", "mla_roofline_intensity"]
