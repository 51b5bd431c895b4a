"""Engine-level calibration: the real engine's measured step times drive the simulator for that engine.

The kernel calibration (``calibration/h200.yaml``) makes the first-principles cost models match the *kernels*;
the real engine adds what those models do not describe — Python and launch overheads, its own attention and MoE
glue, the KV transfer waiting behind compute in one command loop per rank. A real run (``rackbed real``) records
every plan's measured time; :func:`fit_engine` fits, from every plan not held out:

- ``decode_step_s(batch)``: robust line in the total batch (tabulated at the measured batch sizes);
- ``prefill_s(tokens)``: least-squares line ``a + b * tokens`` over prefill batches;
- ``kv_transfer_s(tokens)``: least-squares line over KV transfers (measured from dispatch to completion).

The file (``calibration/engine-<gpu>-<model>.yaml``) is used automatically by ``sim.scenario.build`` when the
scenario's model name (truncation included) and GPU match: :class:`EngineCalibratedCostModel` rescales the cost
model's StepTime so its total is the fitted value (the breakdown's proportions are the model's) and replaces the
KV transfer's fixed cost. :func:`validate_engine` reports per-plan errors on the held-out plans and TTFT/TPOT
p50/p90 of a re-simulation against the real run.
"""

from __future__ import annotations

import csv
import json
import statistics
from dataclasses import replace
from pathlib import Path

import numpy as np
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from topology.errors import UserError, from_validation

ENGINE_DIR = Path(__file__).resolve().parents[1] / "calibration"


class EngineCalibration(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    version: int = 1
    kind: str = "engine"
    gpu: str
    model: str
    source: str = ""
    date: str = ""
    holdout_every: int = 3
    decode_step_s: tuple[tuple[float, float], ...] = Field(min_length=1)   # (batch, seconds)
    prefill_s: tuple[float, float]                                          # (a, b): a + b * tokens
    kv_transfer_s: tuple[float, float]                                      # (a, b): a + b * tokens
    n_plans: dict[str, int] = Field(default_factory=dict)

    def decode(self, batch: float) -> float:
        xs, ys = zip(*self.decode_step_s)
        return float(np.interp(batch, xs, ys))

    def prefill(self, tokens: float) -> float:
        return max(self.prefill_s[0] + self.prefill_s[1] * tokens, 0.0)

    def kv(self, tokens: float) -> float:
        return max(self.kv_transfer_s[0] + self.kv_transfer_s[1] * tokens, 0.0)


def load_engine_calibration(path: str | Path) -> EngineCalibration:
    path = Path(path)
    try:
        return EngineCalibration.model_validate(yaml.safe_load(path.read_text()))
    except ValidationError as exc:
        raise from_validation(exc, path) from None


def find_engine_calibration(gpu: str, model: str, directory: Path | None = None) -> tuple[Path, EngineCalibration] | None:
    """The shipped engine calibration for this GPU model and model name, if any."""
    for p in sorted((directory or ENGINE_DIR).glob("engine-*.yaml")):
        try:
            cal = load_engine_calibration(p)
        except (UserError, OSError, yaml.YAMLError):
            continue
        if cal.gpu == gpu and cal.model == model:
            return p, cal
    return None


class EngineCalibratedCostModel:
    """Wraps a ``ScenarioCostModel``: step totals from the engine calibration, breakdown proportions from it."""

    def __init__(self, base, cal: EngineCalibration) -> None:
        self.base, self.cal = base, cal

    def __getattr__(self, name):
        return getattr(self.base, name)

    @staticmethod
    def _scaled(st, total: float):
        t = st.total_s
        if t <= 0:
            return replace(st, other_s=total)
        f = total / t
        return type(st)(attn_s=st.attn_s * f, moe_gemm_s=st.moe_gemm_s * f, a2a_s=st.a2a_s * f,
                        allreduce_s=st.allreduce_s * f, other_s=st.other_s * f)

    def prefill(self, plan, group):
        return self._scaled(self.base.prefill(plan, group), self.cal.prefill(plan.n_tokens))

    def decode(self, plan, group):
        return self._scaled(self.base.decode(plan, group), self.cal.decode(max(plan.rank_batch)))

    def decode_point(self, group, max_batch, max_context_tokens, draft_k):
        """The driver's fast-forward entry (see ``ScenarioCostModel.decode_point``), rescaled like ``decode``."""
        st, hi = self.base.decode_point(group, max_batch, max_context_tokens, draft_k)
        return self._scaled(st, self.cal.decode(max_batch)), hi

    def kv_transfer(self, plan):
        tc = self.base.kv_transfer(plan)
        return type(tc)(overhead_s=self.cal.kv(plan.tokens), latency_s=0.0, n_bytes=tc.n_bytes)

    def kv_chunks(self, prefiller, decoder, tokens):
        return self.base.kv_chunks(prefiller, decoder, tokens)


# ------------------------------------------------------------------------------------------------------------------
# Fitting and validation from a real run's files


def _plans(run_dir: Path, kv_bytes_per_token: int | None = None) -> list[dict]:
    """Each measured plan of a real run with its size: decode -> batch, prefill -> tokens, kv -> tokens."""
    real = json.loads((run_dir / "real.json").read_text())
    dec, pre, kv = {}, {}, {}
    with open(run_dir / "decisions.csv") as f:
        for row in csv.DictReader(f):
            if row["kind"] == "decode":
                dec[(row["worker"], int(row["a"]))] = int(row["b"])
            elif row["kind"] == "prefill":
                pre[(row["worker"], int(row["a"]))] = int(row["b"])
            elif row["kind"] == "kv_transfer":
                kv[(row["worker"], int(row["request_id"]))] = int(row["a"])
    kv_bpt = real.get("kv_bytes_per_token") or kv_bytes_per_token
    out = []
    for p in real["plans"]:
        if p["measured_s"] is None or not np.isfinite(p["measured_s"]):
            continue
        k = (p["worker"], p["key"])
        if p["kind"] == "decode" and k in dec:
            out.append({**p, "x": dec[k]})
        elif p["kind"] == "prefill" and k in pre:
            out.append({**p, "x": pre[k]})
        elif p["kind"] == "kv" and k in kv:
            out.append({**p, "x": kv[k] / kv_bpt if kv_bpt else kv[k]})
    return out


def _split(plans: list[dict], every: int) -> tuple[list[dict], list[dict]]:
    fit, hold = [], []
    counts: dict[str, int] = {}
    for p in plans:
        i = counts.get(p["kind"], 0)
        counts[p["kind"]] = i + 1
        (hold if every and i % every == every - 1 else fit).append(p)
    return fit, hold


def _line(xs, ys) -> tuple[float, float]:
    """Robust least-squares line ``a + b x``: fit, drop points beyond 3 MADs of the residuals (e.g. a decode step
    that captured a new CUDA graph), refit; a negative slope becomes the median (no trend)."""
    x, y = np.asarray(xs, float), np.asarray(ys, float)
    if len(x) < 3 or len(set(x.tolist())) < 2:
        return (float(np.median(y)) if len(y) else 0.0, 0.0)
    for _ in range(2):
        b, a = np.polyfit(x, y, 1)
        r = y - (a + b * x)
        mad = float(np.median(np.abs(r - np.median(r)))) or 1e-12
        keep = np.abs(r - np.median(r)) <= 3 * 1.4826 * mad
        if keep.all() or keep.sum() < 3:
            break
        x, y = x[keep], y[keep]
    b, a = np.polyfit(x, y, 1)
    if b < 0:
        return float(np.median(y)), 0.0
    return float(a), float(b)


def fit_engine(run_dir: str | Path, *, gpu: str, model: str, holdout_every: int = 3,
               kv_bytes_per_token: int | None = None) -> tuple[EngineCalibration, list[dict]]:
    """Fit the engine curves from a real run folder (real.json + decisions.csv); return them and the held-out
    plans. Decode uses the time the ranks measured (``worker_s``, the step itself); prefill and KV transfer use
    the driver's dispatch-to-completion time (``measured_s``), which includes waiting behind other commands."""
    run_dir = Path(run_dir)
    plans = _plans(run_dir, kv_bytes_per_token)
    if not plans:
        raise UserError(f"{run_dir}: no measured plans to fit (need real.json and decisions.csv)")
    fit, hold = _split(plans, holdout_every)
    dpts = [(p["x"], p["measured_s"]) for p in fit if p["kind"] == "decode"]
    if not dpts:
        raise UserError(f"{run_dir}: no decode steps among the fitted plans")
    da, db = _line(*zip(*dpts))
    dec = tuple((float(b), da + db * b) for b in sorted({int(x) for x, _ in dpts}))
    pre = [(p["x"], p["measured_s"]) for p in fit if p["kind"] == "prefill"]
    kvs = [(p["x"], p["measured_s"]) for p in fit if p["kind"] == "kv"]
    real = json.loads((run_dir / "real.json").read_text())
    cal = EngineCalibration(gpu=gpu, model=model, source=str(run_dir), date=real.get("versions", {}).get("date", ""),
                            holdout_every=holdout_every, decode_step_s=dec,
                            prefill_s=_line(*zip(*pre)) if pre else (0.0, 0.0),
                            kv_transfer_s=_line(*zip(*kvs)) if kvs else (0.0, 0.0),
                            n_plans={"fit": len(fit), "held_out": len(hold)})
    return cal, hold


def _err_stats(rows: list[dict]) -> dict:
    e = [abs(r["rel_error"]) for r in rows]
    return {"n": len(e), "median_abs": statistics.median(e) if e else None, "max_abs": max(e) if e else None}


def validate_engine_run(run_dir: str | Path, *, holdout_every: int = 3, write_calibration: Path | None = None) -> dict:
    """Engine-level validation of a real run: fit on the plans not held out, then (1) per-plan error on the
    held-out plans, (2) re-simulate the run's scenario with the engine-calibrated cost model and compare the
    serving metrics (TTFT/TPOT p50/p90, decode step and prefill medians) with the real run's."""
    from engine.core.workload import generate
    from sim.driver import simulate
    from sim.scenario import build, load_scenario

    run_dir = Path(run_dir)
    real = json.loads((run_dir / "real.json").read_text())
    sc = load_scenario(real["scenario"])
    b = build(sc, engine_calibration=False)
    gpu = b.topology.gpu_spec(b.deployment.decoders[0].gpus[0]).name
    cal, hold = fit_engine(run_dir, gpu=gpu, model=b.model.name, holdout_every=holdout_every,
                           kv_bytes_per_token=b.deployment.kv_bytes_per_token)
    rows = []
    for p in hold:
        pred = cal.decode(p["x"]) if p["kind"] == "decode" else cal.prefill(p["x"]) if p["kind"] == "prefill" \
            else cal.kv(p["x"])
        rows.append({"plan": f"{p['worker']}/{p['kind']}/{p['key']}", "kind": p["kind"], "x": p["x"],
                     "measured_s": p["measured_s"], "predicted_s": pred,
                     "rel_error": (pred - p["measured_s"]) / p["measured_s"]})
    per_kind = {k: _err_stats([r for r in rows if r["kind"] == k]) for k in ("decode", "prefill", "kv")}
    # (2) serving metrics: the scenario re-simulated with the engine calibration vs the real run
    from engine.core.metrics import Slo

    cm = EngineCalibratedCostModel(b.cost_model, cal)
    reqs = generate(sc.workload, sc.seed)
    res = simulate(b.deployment, reqs, cm, seed=sc.seed, progress=False, slo=Slo(sc.slo.ttft_s, sc.slo.tpot_s),
                   kv_chunks=b.cost_model.kv_chunks, decision_log=False)
    rm = real["metrics"]["latency_s"]
    sm = res.metrics["latency_s"]
    serving = []
    for key in ("ttft", "tpot", "itl", "e2e"):
        for q in ("p50", "p90"):
            m, s = rm[key][q], sm[key][q]
            serving.append({"metric": f"{key} {q}", "real_s": m, "sim_s": s, "rel_error": (s - m) / m})
    uncal = simulate(b.deployment, reqs, b.cost_model, seed=sc.seed, progress=False,
                     slo=Slo(sc.slo.ttft_s, sc.slo.tpot_s), kv_chunks=b.cost_model.kv_chunks,
                     decision_log=False).metrics["latency_s"]
    for r in serving:
        key, q = r["metric"].split()
        r["uncalibrated_sim_s"] = uncal[key][q]
    if write_calibration is not None:
        write_calibration.parent.mkdir(parents=True, exist_ok=True)
        write_calibration.write_text(yaml.safe_dump(json.loads(cal.model_dump_json()), sort_keys=False))
    return {"run": str(run_dir), "gpu": gpu, "model": b.model.name, "calibration": json.loads(cal.model_dump_json()),
            "held_out_plans": rows, "per_plan": per_kind, "serving": serving,
            "targets": {"step_time": 0.05, "ttft_tpot_p50": 0.05, "ttft_tpot_p90": 0.10}}
