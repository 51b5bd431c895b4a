"""Serving metrics from the scheduler's per-request rows and counters (pure; numpy only).

Definitions (seconds unless noted):

- **TTFT** = first-token time − arrival, where the first token exists when the request's (first) prefill
  completes; the prefiller delivers it to the user at that moment (a later re-prefill after a failure does not
  move it).
- **TPOT** = (e2e − TTFT) / (output_tokens − 1), requests with ``output_tokens > 1``; **tokens/s/user** = 1/TPOT.
- **e2e** = completion − arrival.
- **ITL**: the decode step durations (each step delivers 1 + accepted MTP tokens to every sequence in it),
  one sample per step of every decoder group.
- **queueing delays**: ``prefill_queue`` = first prefill start − arrival; ``decode_queue`` = admission into a decode
  batch − KV arrival (last attempt); ``kv_transfer`` = KV arrival − transfer start.
- **throughput**: output (input) tokens of completed requests per second of the run; *per GPU* divides by the
  mean number of GPUs allocated (GPU-seconds of every group, starting ones included, / run time).
- **utilisation per role** = busy GPU-seconds (steps running × group GPUs) / allocated GPU-seconds of that role
  (roles ``prefill``, ``decode``, and ``aggregated`` when the run has aggregated workers; their mixed steps with a
  decode batch are ITL samples, and a request's ``kv_transfer`` is 0: its KV never moves).
- **goodput**: completed requests meeting both SLO bounds (a missing bound always holds), per second and as a
  fraction of all requests; ``goodput_tokens_per_s`` counts their output tokens.

Percentile summaries are ``{"n", "mean", "p50", "p90", "p99", "max"}`` (numpy's linear interpolation).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from rackbed.topology.errors import UserError


@dataclass(frozen=True)
class Slo:
    """Service-level bounds from the scenario (None = no bound)."""

    ttft_s: float | None = None
    tpot_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("ttft_s", "tpot_s"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise UserError(f"slo.{name}: must be > 0 or null, got {v}")


def dist(x: Iterable[float] | np.ndarray) -> dict[str, float | int | None]:
    """Percentile summary of a sample (NaNs dropped); empty → counts 0 and None values."""
    a = np.asarray(list(x) if not isinstance(x, np.ndarray) else x, dtype=np.float64)
    a = a[~np.isnan(a)]
    if a.size == 0:
        return {"n": 0, "mean": None, "p50": None, "p90": None, "p99": None, "max": None}
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    return {"n": int(a.size), "mean": float(a.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99),
            "max": float(a.max())}


_TEXT_FIELDS = ("status", "reason", "prefiller", "decoder")
_INT_FIELDS = ("id", "prompt_tokens", "output_tokens", "decode_steps", "requeues")


def _field_dtype(name: str):
    return object if name in _TEXT_FIELDS else np.int64 if name in _INT_FIELDS else np.float64


def request_arrays(rows: Sequence[tuple], fields: Sequence[str], block: int = 1024) -> dict[str, np.ndarray]:
    """Column arrays of the per-request rows (numeric columns float64/int64, text columns object)."""
    # Transposed ``block`` rows at a time (each block's columns converted as np.asarray converts them, into
    # preallocated columns): the same values and about the same instructions as one zip(*rows) over all rows,
    # but the block's tuples and items stay in cache across its columns; one zip over a bench hour's 72 k rows
    # (a 72 k-argument call, every row touched once per column) ran ~3x slower, waiting on memory.
    n = len(rows)
    dts = [_field_dtype(f) for f in fields]
    out = [np.empty(n, dtype=dt) for dt in dts]
    for i in range(0, n, block):
        cols = list(zip(*rows[i:i + block]))
        if len(cols) < len(fields):  # a short row: the column-by-column conversion decides, as it always did
            break
        for o, col, dt in zip(out, cols, dts):
            o[i:i + len(col)] = np.asarray(col, dtype=dt)
    else:
        return dict(zip(fields, out))
    cols = list(zip(*rows)) if rows else [[] for _ in fields]
    return {name: np.asarray(col, dtype=_field_dtype(name)) for name, col in zip(fields, cols)}


def summarize(
    rows: Sequence[tuple],
    fields: Sequence[str],
    *,
    duration_s: float,
    slo: Slo | None,
    groups: Sequence[tuple[str, str, int, float, float, str]],
    busy_gpu_s: Mapping[str, float],
    step_durations: Sequence[float],
    decode_tokens: int,
    draft_k: int,
    accept_p: float,
    acceptance: Sequence[float] | None = None,
) -> dict:
    """The metrics dictionary (see module docstring). ``groups``: ``(id, role, n_gpus, created_s, ended_s, status)``;
    ``acceptance``: the MTP acceptance curve, when one replaces ``accept_p`` (reported as ``decode.acceptance``)."""
    slo = slo or Slo()
    a = request_arrays(rows, fields)
    n = len(rows)
    status = a["status"]
    done = status == "done"
    arrival = a["arrival_s"]
    out_tok = a["output_tokens"]
    ttft = a["first_token_s"] - arrival
    e2e = a["end_s"] - arrival
    multi = done & (out_tok > 1)
    tpot = np.full(n, np.nan)
    tpot[multi] = (e2e[multi] - ttft[multi]) / (out_tok[multi] - 1)
    with np.errstate(divide="ignore"):
        tps_user = np.where(tpot > 0, 1.0 / tpot, np.nan)
    good = done.copy()
    if slo.ttft_s is not None:
        good &= ttft <= slo.ttft_s
    if slo.tpot_s is not None:
        good &= ~(tpot > slo.tpot_s)  # NaN (single-token outputs) passes
    dur = max(duration_s, 1e-12)

    rejected = status == "rejected"
    reasons: dict[str, int] = {}
    for r in a["reason"][rejected].tolist():  # the rejected rows only (few of a loaded hour's)
        reasons[r] = reasons.get(r, 0) + 1

    alloc: dict[str, float] = {"prefill": 0.0, "decode": 0.0}
    for _gid, role, n_gpus, created, ended, _st in groups:
        end = ended if not math.isnan(ended) else duration_s
        alloc[role] = alloc.get(role, 0.0) + max(0.0, min(end, duration_s) - created) * n_gpus
    gpu_s = sum(alloc.values())
    mean_gpus = gpu_s / dur
    out_total = int(out_tok[done].sum())
    in_total = int(a["prompt_tokens"][done].sum())
    seq_steps = int(a["decode_steps"].sum())

    sel = lambda m, x: x[m]
    roles = ("prefill", "decode", "aggregated") if "aggregated" in alloc else ("prefill", "decode")
    return {
        "requests": {
            "total": n,
            "done": int(done.sum()),
            "rejected": int(rejected.sum()),
            "rejected_by_reason": dict(sorted(reasons.items())),
            "requeued": int((a["requeues"] > 0).sum()),
        },
        "latency_s": {
            "ttft": dist(sel(done, ttft)),
            "tpot": dist(sel(multi, tpot)),
            "e2e": dist(sel(done, e2e)),
            "itl": dist(np.asarray(step_durations, dtype=np.float64)),
        },
        "queueing_s": {
            "prefill_queue": dist(sel(done, a["prefill_start_s"] - arrival)),
            "kv_transfer": dist(sel(multi, a["kv_done_s"] - a["kv_start_s"])),
            "decode_queue": dist(sel(multi, a["decode_start_s"] - a["kv_done_s"])),
        },
        "throughput": {
            "duration_s": duration_s,
            "output_tokens_per_s": out_total / dur,
            "input_tokens_per_s": in_total / dur,
            "requests_per_s": int(done.sum()) / dur,
            "mean_gpus": mean_gpus,
            "output_tokens_per_s_per_gpu": out_total / gpu_s if gpu_s > 0 else None,
            "input_tokens_per_s_per_prefill_gpu": in_total / alloc["prefill"] if alloc["prefill"] > 0 else None,
            "output_tokens_per_s_per_decode_gpu": out_total / alloc["decode"] if alloc["decode"] > 0 else None,
            "tokens_per_s_per_user": dist(sel(multi, tps_user)),
        },
        "utilisation": {
            role: (busy_gpu_s.get(role, 0.0) / alloc[role] if alloc.get(role, 0.0) > 0 else None)
            for role in roles
        },
        "gpu_seconds": {role: alloc[role] for role in roles},
        "goodput": {
            "slo_ttft_s": slo.ttft_s,
            "slo_tpot_s": slo.tpot_s,
            "requests": int(good.sum()),
            "requests_per_s": int(good.sum()) / dur,
            "fraction": int(good.sum()) / n if n else None,
            "tokens_per_s": int(out_tok[good].sum()) / dur,
        },
        "decode": {
            "steps": len(step_durations),
            "sequence_steps": seq_steps,
            "tokens": int(decode_tokens),
            "tokens_per_sequence_step": decode_tokens / seq_steps if seq_steps else None,
            "draft_k": draft_k,
            "accept_p": accept_p,
            **({"acceptance": list(acceptance[:draft_k])} if acceptance is not None else {}),
        },
    }


def clean(obj, sig: int = 10):
    """JSON-ready copy with floats rounded to ``sig`` significant digits and NaN/inf → None (byte-stable)."""
    if isinstance(obj, dict):
        return {str(k): clean(v, sig) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [clean(v, sig) for v in obj]
    if isinstance(obj, (bool, np.bool_)):
        return bool(obj)
    if isinstance(obj, (int, np.integer)):
        return int(obj)
    if isinstance(obj, (float, np.floating)):
        x = float(obj)
        if not math.isfinite(x):
            return None
        return float(f"{x:.{sig}g}")
    return obj
