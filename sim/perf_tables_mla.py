"""MLA tables of aiconfigurator-core as ``mla_prefill_tflops``, ``mla_decode_GBps`` and ``mla_bmm_us`` curves
(:mod:`sim.perf_tables`, :mod:`sim.costs.mla`).

What the tables measure (``mla/<backend>/<version>/``, TensorRT-LLM 1.3.0rc20 on GB200, B200 and H200; latency in
ms; columns ``kernel_source, mla_dtype, kv_cache_dtype, num_heads, batch_size, isl, tp_size, step, latency``; one
row is the stack's MLA attention op of one layer on one GPU at DeepSeek-V3's dimensions — latent 512 + rotary 64,
nope 128, v 128 — whose ``num_heads`` are the heads on that GPU, 128 / ``tp_size``, and also 64 heads at tp 1):

* ``context_mla_perf``: a prefill of ``batch_size`` sequences of ``isl`` new tokens each, nothing cached (``step``
  0), expanded attention. Read from the data: above ~4k tokens the time is that of ``2 H (192 + 128)`` FLOPs per
  causal (query, key) pair at ~570 TFLOP/s on H200 with 128 heads — the count :func:`sim.costs.mla.mla_prefill`
  prices. Curves: key ``dims, n_heads, seqs`` (= ``batch_size``), ``kv``; x = ``isl``; y = the batch's FLOPs
  over the time less the per-kernel fixed cost (``KERNEL_FIXED_US``; the cost function adds it back).
* ``generation_mla_perf``: one decode step of ``batch_size`` sequences, one new token each, over ``step`` cached
  tokens (``step + 1`` read with the new one: 2^k), absorbed weights. Read from the data: at long contexts the time
  is the latent stream, ``batch x (step + 1) x 576 x`` 2 bytes, at ~2.7 TB/s on H200 with 128 heads (compute-bound:
  ~240 FLOP per latent byte) and ~3.4 TB/s with 64 or fewer (bandwidth-bound). Curves: key ``dims, n_heads, seqs``
  (= ``batch_size``), ``kv``; x = ``step + 1``; y = latent bytes over the time less the fixed cost.
* ``mla_bmm_perf`` (``mla_bmm/<backend>/``): the absorbed batched GEMMs of decode, ``mla_gen_pre`` (W_UK: per head
  ``[T, 128] @ [128, 512]``) and ``mla_gen_post`` (W_UV: ``[T, 512] @ [512, 128]``) per ``num_tokens`` and
  ``num_heads``, ``bmm_dtype`` bf16 or fp8 (block-scaled). Curves: key ``dims, op`` (pre | post), ``n_heads``,
  ``fmt``; x = tokens; y = µs (the fastest kernel source).

Rows of ``mla_dtype`` other than bf16 are not imported. Every curve pins ``dims = "512+64/128/128"`` (the
collector's DeepSeek-V3 shapes; a model with other MLA dimensions is priced by the first-principles rates).
Not imported: the ``mla_*_module_perf`` tables (the whole attention module of DeepSeek-V3, projections included:
rackbed prices projections as GEMMs from the GEMM tables), SGLang's ``wideep_*`` tables.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import lru_cache
from pathlib import Path

from rackbed.sim.perf_tables_attention import FIXED_S, KV_FORMATS, _net
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

#: the MLA dimensions the tables are collected at (DeepSeek-V3: kv_lora + rope / nope / v)
DIMS = "512+64/128/128"
KV_LORA, ROPE, NOPE, V = 512, 64, 128, 128
MLA_COLS = ("kernel_source", "mla_dtype", "kv_cache_dtype", "num_heads", "batch_size", "isl", "step", "latency")
BMM_COLS = ("op_name", "kernel_source", "bmm_dtype", "num_tokens", "num_heads", "latency")
BMM_OPS = {"mla_gen_pre": "pre", "mla_gen_post": "post"}
BMM_FMT = {"bfloat16": "bf16", "fp8": "fp8"}

__all__ = ["DIMS", "FIXED_S", "IMPORTERS", "import_context_mla", "import_generation_mla", "import_mla_bmm"]


def prefill_flops(n_heads: int, batch: int, isl: int) -> float:
    """Expanded causal MLA FLOPs of ``batch`` sequences of ``isl`` new tokens (``mla_prefill``'s count)."""
    return batch * 2.0 * n_heads * (NOPE + ROPE + V) * isl * (isl + 1) / 2


def latent_bytes(batch: int, ctx: int, elem_bytes: float) -> float:
    """Latent bytes one absorbed decode step reads (``mla_decode`` with one-token pages)."""
    return batch * ctx * (KV_LORA + ROPE) * elem_bytes


@lru_cache(maxsize=64)
def _model(n_heads: int):
    """A DeepSeek-V3 spec with ``n_heads`` heads: the MLA kind the predictors price (tp = 1)."""
    from rackbed.engine.core.model import get_model

    return get_model("deepseek-v3").model_copy(update={"n_q_heads": n_heads, "n_kv_heads": n_heads})


def _mla_usable(r: dict) -> bool:
    return str(r["mla_dtype"]) == "bfloat16" and str(r["kv_cache_dtype"]) in KV_FORMATS


def _mla_curves(t, rows, kind: str, x_of, y_of, what: str) -> tuple[dict, int]:
    curves: dict[tuple, Curve] = {}
    used = 0
    for r in rows:
        if not _mla_usable(r):
            continue
        kvf, eb = KV_FORMATS[str(r["kv_cache_dtype"])]
        h, b = int(r["num_heads"]), int(r["batch_size"])
        c = curves.get((kvf, h, b))
        if c is None:
            key = {"dims": DIMS, "n_heads": h, "seqs": b, "kv": kvf}
            c = curves[(kvf, h, b)] = Curve(kind, key, _source(t) + f" ({what}, {kvf} KV, fastest kernel source)",
                                            group=f"{kvf} KV")
        s = r["latency"] * 1e-3
        x = x_of(r)
        c.add(float(x), _sig(y_of(h, b, x, eb) / _net(s)), s)
        used += 1
    return curves, used


def import_context_mla(root: Path, system: str, backend: str, gpu: str) -> Imported:
    out = Imported()
    cache: dict = {}
    tabs = find_tables(root, system, "mla", backend, "context_mla_perf.parquet")
    t = _pick(tabs, lambda t: sum(1 for r in cached_rows(t, MLA_COLS, cache) if _mla_usable(r) and r["step"] == 0))
    if t is None:
        out.notes.append(f"no context-MLA table for {system}/{backend}")
        return out
    rows = [r for r in cached_rows(t, MLA_COLS, cache) if int(r["step"]) == 0]
    curves, used = _mla_curves(t, rows, "mla_prefill_tflops", lambda r: int(r["isl"]),
                               lambda h, b, x, eb: prefill_flops(h, b, x) / 1e12, "expanded prefill")
    out.curves = [curves[k] for k in sorted(curves)]
    out.tables.append(_table_meta(t, len(cached_rows(t, MLA_COLS, cache)), used))
    heads = sorted({k[1] for k in curves})
    out.notes.append(f"MLA prefill (dims {DIMS}): heads per GPU {', '.join(map(str, heads))}, "
                     f"{len({k[2] for k in curves})} batch sizes, {' and '.join(sorted({k[0] for k in curves}))} KV")

    def predict(calib, c: Curve, x: float) -> float:
        from rackbed.sim.costs.mla import mla_prefill

        eb = 1.0 if c.key["kv"] == "fp8" else 2.0
        return mla_prefill(_gpu(gpu), _model(int(c.key["n_heads"])), [(int(x), 0)] * int(c.key["seqs"]), tp=1,
                           kv_elem_bytes=eb, calib=calib).core_s

    out.predict["mla_prefill_tflops"] = predict
    return out


def import_generation_mla(root: Path, system: str, backend: str, gpu: str) -> Imported:
    out = Imported()
    cache: dict = {}
    tabs = find_tables(root, system, "mla", backend, "generation_mla_perf.parquet")
    t = _pick(tabs, lambda t: sum(1 for r in cached_rows(t, MLA_COLS, cache) if _mla_usable(r) and r["isl"] == 1))
    if t is None:
        out.notes.append(f"no generation-MLA table for {system}/{backend}")
        return out
    rows = [r for r in cached_rows(t, MLA_COLS, cache) if int(r["isl"]) == 1]
    curves, used = _mla_curves(t, rows, "mla_decode_GBps", lambda r: int(r["step"]) + 1,
                               lambda h, b, x, eb: latent_bytes(b, x, eb) / 1e9, "absorbed decode")
    out.curves = [curves[k] for k in sorted(curves)]
    out.tables.append(_table_meta(t, len(cached_rows(t, MLA_COLS, cache)), used))
    out.notes.append(f"MLA decode (dims {DIMS}): heads per GPU {', '.join(map(str, sorted({k[1] for k in curves})))}"
                     f", batches {min(k[2] for k in curves)}-{max(k[2] for k in curves)} (interpolated in log "
                     f"sequences), {' and '.join(sorted({k[0] for k in curves}))} KV")

    def predict(calib, c: Curve, x: float) -> float:
        from rackbed.sim.costs.mla import mla_decode

        eb = 1.0 if c.key["kv"] == "fp8" else 2.0
        return mla_decode(_gpu(gpu), _model(int(c.key["n_heads"])), [int(x)] * int(c.key["seqs"]), tp=1,
                          page_tokens=1, kv_elem_bytes=eb, calib=calib).core_s

    out.predict["mla_decode_GBps"] = predict
    return out


def import_mla_bmm(root: Path, system: str, backend: str, gpu: str) -> Imported:
    out = Imported()
    cache: dict = {}
    tabs = find_tables(root, system, "mla_bmm", backend, "mla_bmm_perf.parquet")

    def usable(r) -> bool:
        return str(r["op_name"]) in BMM_OPS and str(r["bmm_dtype"]) in BMM_FMT

    t = _pick(tabs, lambda t: sum(1 for r in cached_rows(t, BMM_COLS, cache) if usable(r)))
    if t is None:
        out.notes.append(f"no MLA BMM table for {system}/{backend}")
        return out
    rows = cached_rows(t, BMM_COLS, cache)
    curves: dict[tuple, Curve] = {}
    used = 0
    for r in rows:
        if not usable(r):
            continue
        op, fmt, h = BMM_OPS[str(r["op_name"])], BMM_FMT[str(r["bmm_dtype"])], int(r["num_heads"])
        c = curves.get((op, fmt, h))
        if c is None:
            c = curves[(op, fmt, h)] = Curve("mla_bmm_us", {"dims": DIMS, "op": op, "n_heads": h, "fmt": fmt},
                                             _source(t) + " (absorbed W_UK / W_UV batched GEMM, fastest kernel "
                                                          "source)")
        s = r["latency"] * 1e-3
        c.add(float(int(r["num_tokens"])), _sig(s * 1e6), s)
        used += 1
    out.curves = [curves[k] for k in sorted(curves)]
    out.tables.append(_table_meta(t, len(rows), used))
    out.notes.append(f"MLA absorbed BMMs (dims {DIMS}): {', '.join(sorted({k[1] for k in curves}))}, heads per GPU "
                     f"{', '.join(map(str, sorted({k[2] for k in curves})))}")

    def predict(calib, c: Curve, x: float) -> float:
        return calib.lookup("mla_bmm_us", gpu, x, **c.key) * 1e-6

    out.predict["mla_bmm_us"] = predict
    return out


IMPORTERS: tuple[Callable[..., Imported], ...] = (import_context_mla, import_generation_mla, import_mla_bmm)
