"""Attention tables of aiconfigurator-core as ``flash_tflops`` and ``decode_attn_GBps`` curves (:mod:`sim.perf_tables`).

What the two tables measure (columns ``batch_size, isl, num_heads, num_key_value_heads, head_dim, window_size,
attn_dtype, kv_cache_dtype, step, latency``; one row is the stack's whole attention op of one layer on one GPU,
replayed from a CUDA graph, latency in ms):

* ``context_attention_perf``: a prefill of ``batch_size`` sequences of ``isl`` new tokens each, with nothing cached
  (``step`` is always 0). ``num_heads`` / ``num_key_value_heads`` are the heads on that GPU (already divided by
  TP). Read from the data: above ~4k tokens the time is proportional to ``batch_size x isl^2`` (H200, 32 / 4 heads
  of 128: batch 8 at isl 8192 takes 8.04x batch 1; isl 16384 takes 3.75x isl 8192), so ``isl`` is each
  sequence's length and the batch is that many independent causal sequences.
* ``generation_attention_perf``: one decode step of ``batch_size`` sequences, one new token each (``isl`` is always
  1), over ``step`` tokens already cached per sequence: ``step`` runs over 2^k - 1 (1, 3, ..., 131071), so with its
  new token a sequence's KV cache holds ``step + 1`` = 2^k tokens, which is what the kernel reads. Read from the
  data: at long contexts the time is linear in ``batch_size x (step + 1) x num_key_value_heads`` (a bandwidth
  stream, ~3.4 TB/s on H200), and a configuration with ``g`` query heads per KV head takes the time of another with
  the same ``g`` and the same ``batch_size x num_key_value_heads`` (H200, 64 / 4 heads at batch b vs 16 / 1 at
  batch 4b: 0.93-1.06x, mostly within 2 %) — the kernel's parallel units are sequences x KV heads, rackbed's
  ``seq_heads``; ``g`` itself moves the time by a few per cent up to 16 (8 vs 16: mostly 0.93-1.0x).

What becomes a curve (full attention, ``window_size`` 0; sliding windows below; head dims ``HEAD_DIMS``; at each point the fastest kernel
source of the table):

* ``flash_tflops`` (key ``head_dim, n_q_heads, n_kv_heads``; a grid over the two head counts, so a head
  configuration between measured ones interpolates): x = ``isl``, y = the causal FLOPs of
  :func:`sim.costs.attention.full_attention_prefill` (``4 H D q (q + 1) / 2`` per sequence) over the time less the
  per-kernel fixed cost the cost function adds back (``KERNEL_FIXED_US``: imported tables carry no fitted one).
  The head counts are those the kernel runs over, summed across the batch: read from the data, a batch of ``b``
  sequences of ``h`` / ``kv`` heads takes the time of one sequence of ``b h`` / ``b kv`` heads (H200: the 3326
  batched rows whose ``b h`` / ``b kv`` were also measured as one sequence, median 1.2 %, p90 3.7 % apart; GB200 /
  B200 1.5 %, p90 7-8 %; the kernel's parallel units are sequences x heads x query tiles). So the ``batch_size`` 1
  rows are the curves of their head configuration, and the batched rows whose heads across the batch were not
  measured as one sequence become curves at ``b h`` / ``b kv`` (the fastest of the batches and head
  configurations that give the same product): they extend the grid to the table's largest batches (256 x 96
  heads). ``full_attention_prefill`` prices a sequence of a batch at ``copies x`` its heads (its module docstring
  says how mixed lengths are priced). ``group``: "one sequence" / "batched", whose held-out rows the batched
  curves' predictor prices as the fewest sequences of the table that give those heads (``meta.validation_groups``).
  Rows with ``attn_dtype`` fp8 (FP8 FMHA) or an fp8 KV cache are not imported: ``flash_tflops`` has no format key.
* ``decode_attn_GBps`` (key ``head_dim, n_q_heads, n_kv_heads, seq_heads, kv``; ``seq_heads`` =
  ``batch_size x num_key_value_heads``, which :meth:`~sim.costs.calibration.CalibrationTable.lookup_along`
  interpolates across; ``kv`` = ``bf16`` | ``fp8``, the cache's element format): the generation rows, x =
  ``step + 1`` (KV tokens per sequence), y = the KV bytes of :func:`sim.costs.attention.full_attention_decode`
  (``batch x x x 2 x Hkv x D x`` 2 or 1 bytes) over the time less the fixed cost. An fp8 cache is its own set of
  curves: the stack runs other kernels for it, whose time is not the bf16 kernels' at half the bytes (the bf16
  curves at 1 B per element were 13-38 % off the fp8 rows, median). Head configurations: ``DECODE_HEADS`` (GQA
  with 2-16 query heads per KV head, up to 8 KV heads per GPU: the per-GPU shapes of GQA MoE models at TP 1-8);
  the configuration ``GENERIC_DECODE_HEADS`` is written pinning only ``head_dim``, ``seq_heads`` and ``kv``, so a
  head configuration without curves of its own is priced by the measured kernel at its ``seq_heads`` instead of
  the datasheet rate (H200, bf16, the table's rows of such configurations with up to 16 query heads per KV head:
  median 1-3 % off per group size; with 24-32, 20 % low, with 48 or more, shapes the kernel runs compute-bound,
  85 % low — the datasheet rate is 70-97 % low).

Sliding-window rows (``window_size`` > 0: 128 at head dim 64 — gpt-oss —, 8192 at 128, 1024 at 256) become curves
of their own, pinning ``window`` (only sliding-window queries match them, and those match nothing else), built as
above with two changes: a prefill curve's y is ``4 H D x window`` FLOPs per sequence over the time (every query
against a whole window, :func:`sim.costs.attention.sliding_window_flops`: a power law in ``x``, where the attended
pairs kink at the window and log-log interpolation across the kink was ~30 % off), and a decode curve's x is the
sequence's whole context (``step + 1``: the measured time keeps growing past the window, H200 64 / 8 heads at 16
sequences 11 us at 256 tokens, 32 us at 32k) with y the bytes of its last ``window`` tokens over the time. Groups
``sliding window`` (prefill) and ``<kv> KV, sliding window`` (decode).

Not imported: head dims outside ``HEAD_DIMS`` (192: MLA-like shapes),
prefills with a cached prefix (the tables have none: rackbed prices ``q`` new after ``c`` cached tokens at the
rate of ``q + c``), beam search. (The package's collector runs head dim 64 with attention sinks, as gpt-oss has.)
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path

from rackbed.sim.costs import constants as C
from rackbed.sim.perf_tables_base import (
    Curve,
    Imported,
    _gpu,
    _pick,
    _sig,
    _source,
    _table_meta,
    cached_rows,
    find_tables,
)

#: head dims imported (GQA models: 64 gpt-oss, 128 Qwen3 / Llama / Mixtral, 256 Qwen3.5 / Qwen3-Next)
HEAD_DIMS = (64, 128, 256)
#: query heads per KV head of the decode curves, and KV heads per GPU
DECODE_GROUPS = (2, 4, 8, 16)
DECODE_KV_HEADS = (1, 2, 4, 8)
#: (query, KV heads per GPU) of the decode curves
DECODE_HEADS: tuple[tuple[int, int], ...] = tuple(sorted((g * kv, kv) for g in DECODE_GROUPS for kv in DECODE_KV_HEADS
                                                         if g * kv <= 64))
#: the decode head configuration written without head counts in its key (matches any configuration of its head dim)
GENERIC_DECODE_HEADS = (8, 1)
#: the per-kernel fixed cost imported rates are net of (the cost functions add ``kernel_fixed_us``; imported
#: calibrations carry none, so it is the constant)
FIXED_S = C.KERNEL_FIXED_US * 1e-6
#: as ``sim.calibration.measurements.NET_FLOOR``: a row's time less the fixed cost is never taken below this fraction of it
NET_FLOOR = 0.1

CTX_COLS = ("kernel_source", "batch_size", "isl", "num_heads", "num_key_value_heads", "head_dim", "window_size",
            "attn_dtype", "kv_cache_dtype", "step", "latency")
GEN_COLS = ("kernel_source", "batch_size", "isl", "num_heads", "num_key_value_heads", "head_dim", "window_size",
            "kv_cache_dtype", "step", "latency")
BF16 = ("bfloat16", "float16", "half")


def _net(seconds: float) -> float:
    return max(seconds - FIXED_S, NET_FLOOR * seconds)


def prefill_flops(n_q_heads: int, head_dim: int, seq: int, window: int = 0) -> float:
    """Causal attention FLOPs of one sequence of ``seq`` new tokens (``full_attention_prefill``'s count); with a
    ``window``, ``seq x window`` pairs: every query against a whole window, the work measure of the sliding-window
    curves (``sliding_window_flops``), a power law in ``seq``, so that the curves interpolate across the window
    (the attended pairs grow as ``seq^2`` below it and as ``seq`` above, a kink log-log interpolation misses by ~30 %)."""
    if window:
        return 4.0 * n_q_heads * head_dim * seq * window
    return 4.0 * n_q_heads * head_dim * seq * (seq + 1) / 2


def decode_kv_bytes(batch: int, ctx: int, n_kv_heads: int, head_dim: int, elem_bytes: float = 2.0) -> float:
    """KV bytes one decode step reads (``full_attention_decode`` with one-token pages)."""
    return batch * ctx * 2 * n_kv_heads * head_dim * elem_bytes


#: a model with sliding-window layers, whose copy with other heads and window prices a sliding-window row
WINDOW_MODEL = "gpt-oss-120b"


@lru_cache(maxsize=1024)
def _model(n_q_heads: int, n_kv_heads: int, head_dim: int, window: int = 0):
    from rackbed.sim.calibration.predict import attn_model

    if not window:
        return attn_model(None, {"n_q_heads": n_q_heads, "n_kv_heads": n_kv_heads, "head_dim": head_dim})
    from rackbed.engine.core.model import get_model

    return get_model(WINDOW_MODEL).model_copy(update={"n_q_heads": n_q_heads, "n_kv_heads": n_kv_heads,
                                                      "head_dim": head_dim, "sliding_window": window})


def _summary_pct(errs: list[float]) -> str:
    s = sorted(errs)
    p90 = s[min(len(s) - 1, math.ceil(0.9 * len(s)) - 1)]
    return f"median {100 * statistics.median(s):.1f} %, p90 {100 * p90:.1f} %"


# ------------------------------------------------------------------------------------------------ prefill


def _ctx_usable(r: dict) -> bool:
    return (int(r["head_dim"]) in HEAD_DIMS and int(r["window_size"]) >= 0 and int(r["step"]) == 0
            and str(r["attn_dtype"]) in BF16 and str(r["kv_cache_dtype"]) in BF16
            and int(r["num_heads"]) % int(r["num_key_value_heads"]) == 0)


def import_context_attention(root: Path, system: str, backend: str, gpu: str) -> Imported:
    out = Imported(grid={"flash_tflops": ("n_q_heads", "n_kv_heads")})
    cache: dict = {}
    tabs = find_tables(root, system, "attention", backend, "context_attention_perf.parquet")
    t = _pick(tabs, lambda t: sum(1 for r in cached_rows(t, CTX_COLS, cache) if _ctx_usable(r) and r["batch_size"] == 1))
    if t is None:
        out.notes.append(f"no context-attention table for {system}/{backend}")
        return out
    rows = cached_rows(t, CTX_COLS, cache)
    usable = [r for r in rows if _ctx_usable(r)]
    single = {(int(r["window_size"]), int(r["head_dim"]), int(r["num_heads"]), int(r["num_key_value_heads"]))
              for r in usable if int(r["batch_size"]) == 1}
    curves: dict[tuple, Curve] = {}
    #: batched curve -> (query heads, KV heads, sequences) of the rows it is priced as (the fewest sequences)
    rep: dict[tuple, tuple[int, int, int]] = {}
    paired: list[tuple[dict, tuple]] = []  # batched rows whose heads across the batch have one-sequence rows
    used = 0
    for r in usable:
        w, d, h, kv, q, b = (int(r[f]) for f in ("window_size", "head_dim", "num_heads", "num_key_value_heads",
                                                  "isl", "batch_size"))
        k = (w, d, b * h, b * kv)
        if b > 1 and k in single:
            if not w:
                paired.append((r, k))
            continue
        c = curves.get(k)
        if c is None:
            key = {"head_dim": d, "n_q_heads": b * h, "n_kv_heads": b * kv}
            if w:  # sliding window: curves of their own, x = the sequence's length, y = its windowed FLOPs / time
                key["window"] = w
                c = Curve("flash_tflops", key, _source(t) + f" (sliding window {w}, "
                          + ("batch 1" if b == 1 else "batched rows as sequences x heads") + ", bf16, fastest)",
                          group="sliding window")
            elif b == 1:
                c = Curve("flash_tflops", key, _source(t) + " (batch 1, bf16, fastest kernel source)",
                          group="one sequence")
            else:
                c = Curve("flash_tflops", key, _source(t) + " (bf16, batched rows as sequences x heads, fastest)",
                          group="batched")
            curves[k] = c
        if b > 1 and (k not in rep or b < rep[k][2]):
            rep[k] = (h, kv, b)
        s = r["latency"] * 1e-3
        c.add(float(q), _sig(prefill_flops(b * h, d, q, w) / _net(s) / 1e12), s)
        used += 1
    out.curves = [curves[k] for k in sorted(curves)]
    out.tables.append(_table_meta(t, len(rows), used))
    full = {k: c for k, c in curves.items() if not k[0]}
    dims = sorted({k[1] for k in full})
    out.notes.append(f"prefill attention: curves at head dims {', '.join(map(str, dims))} for "
                     f"{sum(1 for k in single if not k[0])} head configurations (query / KV heads per GPU, "
                     f"interpolated between) and {sum(1 for k in rep if not k[0])} more from batched rows: n "
                     f"sequences of h / kv heads run as one sequence of n h / n kv heads " + _pair_note(paired, curves))
    windows = sorted({(k[0], k[1]) for k in curves if k[0]})
    if windows:
        out.notes.append("prefill sliding-window attention (key window; x = the sequence's length, y = the FLOPs of "
                         "its attended pairs over the time): " + ", ".join(
                             f"window {w} at head dim {d} ({sum(1 for k in curves if k[:2] == (w, d))} curves)"
                             for w, d in windows))

    def predict(calib, c: Curve, x: float) -> float:
        from rackbed.sim.costs.attention import full_attention_prefill

        d, w = c.key["head_dim"], int(c.key.get("window", 0))
        h, kv, b = rep.get((w, d, c.key["n_q_heads"], c.key["n_kv_heads"]),
                           (c.key["n_q_heads"], c.key["n_kv_heads"], 1))
        return full_attention_prefill(_gpu(gpu), _model(h, kv, d, w), [(int(x), 0)] * b, tp=1, calib=calib,
                                      kind="sliding" if w else "full").core_s

    out.predict["flash_tflops"] = predict
    note = batch_note([r for r in usable if int(r["batch_size"]) > 1 and not int(r["window_size"])],
                      [c for c in out.curves if "window" not in c.key], gpu)
    if note:
        out.notes.append(note)
    return out


def _pair_note(paired: list[tuple[dict, tuple]], curves: dict[tuple, Curve]) -> str:
    """How far the table's batched rows are from its one-sequence rows of the heads across the batch (the reading
    the batched curves rest on): ``(the table's N such rows: median, p90 of |batched / one sequence - 1|)``."""
    errs = []
    for r, k in paired:
        c = curves[k]
        x = float(int(r["isl"]))
        if x in c.measured:
            errs.append(abs(r["latency"] * 1e-3 / c.measured[x] - 1.0))
    if not errs:
        return ""
    return f"(the table's {len(errs)} batched rows with one-sequence rows of their heads x sequences: {_summary_pct(errs)})"


#: the batched prefill rows ``batch_note`` prices: up to this many sequences of at least ``NOTE_MIN_ISL`` tokens
NOTE_MAX_BATCH, NOTE_MIN_ISL = 8, 512


def batch_note(batched: list[dict], curves: list[Curve], gpu: str) -> str | None:
    """How the curves (all their points) price the table's batched prefills of 2 to ``NOTE_MAX_BATCH`` sequences
    of at least ``NOTE_MIN_ISL`` tokens through ``full_attention_prefill`` (|predicted / measured - 1|, median and
    p90); the held-out rows of the batched curves are in ``meta.validation_groups``."""
    from rackbed.sim.costs.attention import full_attention_prefill
    from rackbed.sim.costs.calibration import CalibrationEntry, CalibrationTable

    entries = [CalibrationEntry(kind="flash_tflops", gpu=gpu, key=c.key,
                                points=tuple((x, c.points[x]) for x in sorted(c.points))) for c in curves]
    if not entries:
        return None
    table = CalibrationTable(entries=tuple(entries), grid={"flash_tflops": ("n_q_heads", "n_kv_heads")},
                             interpolation="log-log")
    errs: list[float] = []
    for r in batched:
        d, h, kv, q, b = (int(r[f]) for f in ("head_dim", "num_heads", "num_key_value_heads", "isl", "batch_size"))
        if q < NOTE_MIN_ISL or b > NOTE_MAX_BATCH:
            continue
        pred = full_attention_prefill(_gpu(gpu), _model(h, kv, d), [(q, 0)] * b, tp=1, calib=table).core_s
        errs.append(abs(pred / (r["latency"] * 1e-3) - 1.0))
    if not errs:
        return None
    return (f"prefill attention, one kernel over 2-{NOTE_MAX_BATCH} sequences of >= {NOTE_MIN_ISL} tokens: the "
            f"table's {len(errs)} rows priced within {_summary_pct(errs)} (every row fitted)")


# ------------------------------------------------------------------------------------------------ decode


def _gen_usable(r: dict) -> bool:
    return (int(r["head_dim"]) in HEAD_DIMS and int(r["window_size"]) >= 0 and int(r["isl"]) == 1
            and (int(r["num_heads"]), int(r["num_key_value_heads"])) in DECODE_HEADS)


#: the generation table's ``kv_cache_dtype`` -> (rackbed ``kv`` key, bytes per KV element)
KV_FORMATS = {**{n: ("bf16", 2.0) for n in BF16}, "fp8": ("fp8", 1.0)}


def import_generation_attention(root: Path, system: str, backend: str, gpu: str) -> Imported:
    out = Imported()
    cache: dict = {}
    tabs = find_tables(root, system, "attention", backend, "generation_attention_perf.parquet")
    t = _pick(tabs, lambda t: sum(1 for r in cached_rows(t, GEN_COLS, cache)
                                  if _gen_usable(r) and str(r["kv_cache_dtype"]) in BF16))
    if t is None:
        out.notes.append(f"no generation-attention table for {system}/{backend}")
        return out
    rows = cached_rows(t, GEN_COLS, cache)
    curves: dict[tuple, Curve] = {}
    used = 0
    for r in rows:
        fmt = KV_FORMATS.get(str(r["kv_cache_dtype"]))
        if not _gen_usable(r) or fmt is None:
            continue
        kvf, eb = fmt
        w, d, h, kv, b = (int(r[f]) for f in ("window_size", "head_dim", "num_heads", "num_key_value_heads",
                                               "batch_size"))
        ctx = int(r["step"]) + 1
        c = curves.get((w, kvf, d, h, kv, b))
        if c is None:
            key = {"head_dim": d, "seq_heads": b * kv, "kv": kvf}
            src = _source(t) + (f" (sliding window {w}, " if w else " (") + f"{kvf} KV, batch {b}, fastest kernel source"
            if (h, kv) == GENERIC_DECODE_HEADS:
                src += f"; {h} / {kv} heads, for any head counts of head dim {d} without curves of their own)"
            else:
                key |= {"n_q_heads": h, "n_kv_heads": kv}
                src += ")"
            if w:
                key["window"] = w
            c = curves[(w, kvf, d, h, kv, b)] = Curve("decode_attn_GBps", key, src,
                                                      group=f"{kvf} KV" + (", sliding window" if w else ""))
        s = r["latency"] * 1e-3
        # x = the sequence's context (the kernel's time keeps growing past the window); the bytes are the window's
        c.add(float(ctx), _sig(decode_kv_bytes(b, min(ctx, w) if w else ctx, kv, d, eb) / _net(s) / 1e9), s)
        used += 1
    out.curves = [curves[k] for k in sorted(curves)]
    out.tables.append(_table_meta(t, len(rows), used))
    dims = sorted({k[2] for k in curves if not k[0]})
    fmts = sorted({k[1] for k in curves})
    out.notes.append(f"decode attention: {' and '.join(fmts)} KV caches (key kv), head dims "
                     f"{', '.join(map(str, dims))}, head configurations "
                     f"{' '.join(f'{h}/{kv}' for h, kv in DECODE_HEADS)} (query / KV heads per GPU); others of these "
                     f"head dims priced by the {GENERIC_DECODE_HEADS[0]}/{GENERIC_DECODE_HEADS[1]} curves at their "
                     f"sequences x KV heads")
    windows = sorted({(k[0], k[2]) for k in curves if k[0]})
    if windows:
        out.notes.append("decode sliding-window attention (key window; x = the sequence's context, y = the bytes of "
                         "its last window tokens over the time): " + ", ".join(
                             f"window {w} at head dim {d} ({sum(1 for k in curves if (k[0], k[2]) == (w, d))} curves)"
                             for w, d in windows))

    def predict(calib, c: Curve, x: float) -> float:
        from rackbed.sim.costs.attention import full_attention_decode, sliding_attention_decode

        h = int(c.key.get("n_q_heads", GENERIC_DECODE_HEADS[0]))
        kv = int(c.key.get("n_kv_heads", GENERIC_DECODE_HEADS[1]))
        w = int(c.key.get("window", 0))
        m = _model(h, kv, c.key["head_dim"], w)
        batch = int(c.key["seq_heads"]) // kv
        eb = 1.0 if c.key["kv"] == "fp8" else 2.0
        decode = sliding_attention_decode if w else full_attention_decode
        return decode(_gpu(gpu), m, [int(x)] * batch, tp=1, page_tokens=1, kv_elem_bytes=eb, calib=calib).core_s

    out.predict["decode_attn_GBps"] = predict
    return out


IMPORTERS: tuple[Callable[..., Imported], ...] = (import_context_attention, import_generation_attention)
