"""Verdicts of the ``kind: figure`` scenarios: does the simulated figure reproduce the claim it carries?

A figure scenario states its criterion next to its claim (``verdict`` in the YAML)::

    verdict:
      criterion: "NVLS cuts the prefill step by 5-15 % on H200 and on GB200"
      checks:
        - {measure: "H200.prefill_cut_pct", min: 5, max: 15}
        - {measure: "GB200/mxfp8/ep16.gemm_us", over: "GB200/fp8_block/ep16.gemm_us", max: 0.99}

Each check reads one number the figure computed (a *measure*, ``<row>.<column>``: see
:func:`figure_measures`), divided by another where ``over`` names one, and is met when it lies in
``[min, max]`` (bounds inclusive; either may be left out, not both). The verdict is ``reproduced`` when every
check is met, else ``not reproduced``; a value that is not a finite number (a missing NVLS time, a division by
zero) meets no check. Nothing is fitted to the criterion: it is the claim's statement made precise, and the
figure's numbers come from the cost models.

Measures per figure type (``<row>`` is built from the row's identifying columns, ``<column>`` is any numeric
column of that row):

======================= =====================================================================================
``allreduce_nvls``      ``<hardware>.<column>`` (``nvls_cut_pct``, ``prefill_cut_pct``, ``nvlink_us`` ...)
``ep_prefill_comm``     ``<hardware>/ep<EP>.<column>``
``decode_a2a``          ``<hardware>/ep<EP>/t<tokens per rank>.<column>``
``grouped_gemm``        ``<hardware>/<format>/ep<EP>.<column>``
``prefill_parallelism`` ``<hardware>/<config>.<column>``
``decode_ep_trade``     ``t<tokens per rank>.<column>``, and the whole steps: ``step/ep<EP>.<category>``
``decode_step``         ``<config>@<batch per rank>.<column>``
``decode_frontier``     ``<panel> | <case> | <overlap> | <slo>.ep``: the EP that gives the most tokens/s per
                        GPU at that tokens/s-per-user SLO (overlap ``none`` or ``best``), and its
                        ``.tokens_per_s_per_gpu``; per EP ``<panel> | <case> | <overlap> | <slo> |
                        EP<ep>.tokens_per_s_per_gpu``
======================= =====================================================================================
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rackbed.topology.errors import UserError

REPRODUCED = "reproduced"
NOT_REPRODUCED = "not reproduced"


class Check(BaseModel):
    """One condition: ``measure`` (divided by ``over`` when given) within ``[min, max]``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    measure: str = Field(min_length=1)
    over: str | None = Field(None, min_length=1)
    min: float | None = None
    max: float | None = None

    @model_validator(mode="after")
    def _bounds(self):
        if self.min is None and self.max is None:
            raise ValueError("a check needs min, max or both")
        if self.min is not None and self.max is not None and self.min > self.max:
            raise ValueError(f"min ({self.min:g}) must be <= max ({self.max:g})")
        for b in (self.min, self.max):
            if b is not None and not math.isfinite(b):
                raise ValueError("min and max must be finite numbers")
        return self

    @property
    def label(self) -> str:
        return self.measure if self.over is None else f"{self.measure} / {self.over}"

    @property
    def band(self) -> str:
        if self.min is not None and self.max is not None:
            return f"{self.min:g} to {self.max:g}"
        return f">= {self.min:g}" if self.min is not None else f"<= {self.max:g}"


class Verdict(BaseModel):
    """A figure's criterion: the sentence (``criterion``) and the checks that make it precise."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    criterion: str = Field(min_length=1)
    checks: tuple[Check, ...] = Field(min_length=1)


def met(value: float, lo: float | None, hi: float | None) -> bool:
    """``value`` lies in ``[lo, hi]`` (a bound of None is open); a non-finite value never does."""
    if not isinstance(value, int | float) or isinstance(value, bool) or not math.isfinite(value):
        return False
    return (lo is None or value >= lo) and (hi is None or value <= hi)


def check_value(check: Check, measures: dict[str, float], where: str = "verdict") -> float:
    """The number ``check`` reads from ``measures``; UserError naming the check when a measure is unknown."""
    vals = []
    for field in ("measure", "over"):
        name = getattr(check, field)
        if name is None:
            continue
        if name not in measures:
            near = [k for k in measures if k.split(".")[0] == name.split(".")[0]][:6] or list(measures)[:6]
            raise UserError(f"{where}.{field}: {name!r} is not a measure of this figure "
                            f"(e.g. {', '.join(repr(k) for k in near)})")
        vals.append(measures[name])
    if len(vals) == 1:
        return float(vals[0])
    num, den = vals
    return float(num) / float(den) if den else math.inf


def judge(verdict: Verdict, measures: dict[str, float], where: str = "verdict") -> dict[str, Any]:
    """The verdict on ``measures``: ``{"verdict", "criterion", "checks": [{check, value, min, max, met}]}``
    (``value`` None where it is not a finite number)."""
    rows = []
    for i, c in enumerate(verdict.checks):
        v = check_value(c, measures, f"{where}.checks[{i}]")
        rows.append({"check": c.label, "value": round(v, 4) if math.isfinite(v) else None, "min": c.min,
                     "max": c.max, "met": met(v, c.min, c.max)})
    ok = all(r["met"] for r in rows)
    return {"verdict": REPRODUCED if ok else NOT_REPRODUCED, "criterion": verdict.criterion, "checks": rows}


# ------------------------------------------------------------------------------------------------ measures


def _numeric(row: dict) -> dict[str, float]:
    return {k: float(v) for k, v in row.items()
            if isinstance(v, int | float) and not isinstance(v, bool)}


def _by_rows(rows: list[dict], key) -> dict[str, float]:
    out: dict[str, float] = {}
    for r in rows:
        k = key(r)
        for col, v in _numeric(r).items():
            out[f"{k}.{col}"] = v
    return out


def figure_measures(figure: str, rows: list[dict], extra: dict[str, Any]) -> dict[str, float]:
    """The named numbers of a figure's table (module docstring): from its rows and its extra tables
    (``extra``: ``decode_step_ms`` of ``decode_ep_trade``, ``slo`` of ``decode_frontier``), as computed or as
    read back from the figure's JSON."""
    if figure == "allreduce_nvls":
        return _by_rows(rows, lambda r: r["hardware"])
    if figure == "ep_prefill_comm":
        return _by_rows(rows, lambda r: f"{r['hardware']}/ep{r['ep']}")
    if figure == "decode_a2a":
        return _by_rows(rows, lambda r: f"{r['hardware']}/ep{r['ep']}/t{r['tokens_per_rank']}")
    if figure == "grouped_gemm":
        return _by_rows(rows, lambda r: f"{r['hardware']}/{r['format']}/ep{r['ep']}")
    if figure == "prefill_parallelism":
        return _by_rows(rows, lambda r: f"{r['hardware']}/{r['config']}")
    if figure == "decode_ep_trade":
        out = _by_rows(rows, lambda r: f"t{r['tokens_per_rank']}")
        for ep, cats in (extra.get("decode_step_ms") or {}).items():
            out.update({f"step/ep{ep}.{k}": float(v) for k, v in cats.items()})
        return out
    if figure == "decode_step":
        return _by_rows(rows, lambda r: f"{r['config']}@{r['batch_per_rank']}")
    if figure == "decode_frontier":
        out = {}
        for g in extra.get("slo") or []:
            head = f"{g['panel']} | {g['case']} | {g['overlap']} | {g['slo_tokens_per_s_per_user']:g}"
            tps = g["tokens_per_s_per_gpu"]
            if tps is not None:
                out[f"{head} | EP{g['ep']}.tokens_per_s_per_gpu"] = float(tps)
            if g["wins"]:
                out[f"{head}.ep"] = float(g["ep"])
                out[f"{head}.tokens_per_s_per_gpu"] = float(tps)
        return out
    raise UserError(f"no measures defined for figure type {figure!r}")
