"""Prefill MoE grouped GEMM benchmark (suite "moe_prefill_gemm", 1 GPU): the wgmma kernels of
kernels/grouped_gemm_wgmma.py (bf16; FP8 e4m3 with 1x128 / 128x128 block scales) against torch._grouped_mm bf16
and torch._scaled_grouped_mm rowwise FP8, in the same run.

    timeout 230 python -m rackbed.kernels.bench.moe_prefill --out $OUT/prefill.json    # JSON rewritten after every step
    timeout 235 python -u -m rackbed.kernels.bench.moe_prefill --sweep --out $OUT/prefill.json   # every variant (v4 sweep)
    timeout 90 python -u -m rackbed.kernels.bench.moe_prefill --diagnose --out $OUT/diag.json    # gap analysis (< 70 s)

Steps (each printed with flush): compile each (shape, variant) (a failing compile prints its full traceback and the
variant is skipped); small checks (8 experts, rows 0/1/127/128/129/300/0/5: empty experts, partial tiles, tiles
running into the next expert) against the fp32 reference with the output poisoned (NaN); then per benchmark
case: gate_up (128 experts x 375 rows, N=3072, K=4096), down (N=4096, K=1536), skewed (Zipf routing of 6000 tokens
top-8, same total rows, empty experts) — check on 4 experts, then CUDA-event medians. A launch that does not
finish within HANG_S is reported as a hang and the process exits (JSON written first).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
import traceback

for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ[_k] = _v

import numpy as np

from rackbed.kernels.bench.suites import register_suite
from rackbed.topology.outputs import entry_file, write_text

D_MODEL, F_EXPERT, N_EXPERTS, TOP_K, ROWS = 4096, 1536, 128, 8, 375
HANG_S = 20.0
REPS = 20
TOL = {"bf16": 1e-2, "fp8": 1e-2}  # relerr vs the fp32 reference on the same (dequantized) operands
_partial_path: str | None = None


def _write(res: dict) -> None:
    if _partial_path:
        write_text(_partial_path, json.dumps({"suites": {"moe_prefill_gemm": res}}, indent=1, default=str))


def _say(msg: str) -> None:
    print(f"[prefill {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _sync_bounded(res: dict, what: str) -> None:
    """Wait for the GPU at most HANG_S; on a hang, record it, write the JSON and exit the process."""
    import torch

    ev = torch.cuda.Event()
    ev.record()
    t0 = time.time()
    while not ev.query():
        if time.time() - t0 > HANG_S:
            res["errors"].append(f"{what}: HANG (no completion after {HANG_S} s)")
            _say(f"HANG in {what}; writing JSON and exiting")
            _write(res)
            sys.stdout.flush()
            os._exit(3)
        time.sleep(0.002)


def _time_us(fn, res, what, reps: int = 10, warmup: int = 2) -> float:
    import torch

    for _ in range(warmup):
        fn()
    _sync_bounded(res, what)
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        _sync_bounded(res, what)
        ts.append(a.elapsed_time(b) * 1e3)
    return statistics.median(ts)


def _relerr(out, ref, rows=None) -> float:
    o = out.double() if rows is None else out[rows].double()
    r = ref.double() if rows is None else ref[rows].double()
    if not bool(o.isfinite().all()):
        return float("nan")
    return float((o - r).norm() / r.norm().clamp_min(1e-30))


def _expert_rows(counts_l, experts):
    import torch

    offs = np.concatenate([[0], np.cumsum(counts_l)])
    return torch.cat([torch.arange(offs[e], offs[e + 1]) for e in experts]).tolist()


def _variants(sweep: bool) -> list[str]:
    from rackbed.kernels import grouped_gemm_wgmma as gw

    if sweep:
        return list(gw.VARIANTS)
    return [gw.default_variant(False), gw.default_variant(True)]


def _pick_best(row: dict) -> None:
    """Fill a case row's ``wgmma_<dtype>_*`` fields from its fastest correct variant of each dtype, and the ratios."""
    for kind, fp in (("bf16", False), ("fp8", True)):
        good = {v: d for v, d in row["variants"].items() if d.get("ok") and d.get("fp8") == fp}
        if good:
            best = min(good, key=lambda v: good[v]["us"])
            row[f"wgmma_{kind}_variant"] = best
            for f_ in ("us", "TFLOPs", "relerr", "all_rows_written"):
                row[f"wgmma_{kind}_{f_}"] = good[best].get(f_)
    if "wgmma_bf16_us" in row:
        row["wgmma_bf16_vs_torch_bf16"] = row["torch_bf16_us"] / row["wgmma_bf16_us"]
        if "wgmma_fp8_us" in row:
            row["wgmma_fp8_vs_wgmma_bf16"] = row["wgmma_bf16_us"] / row["wgmma_fp8_us"]


def run_prefill(cfg=None, sweep: bool = False, variants=None) -> dict:
    """``sweep``: every variant of kernels.grouped_gemm_wgmma.VARIANTS (v1 included), else the default ones."""
    import torch

    from rackbed.kernels import grouped_gemm as gg
    from rackbed.kernels import grouped_gemm_wgmma as gw
    from rackbed.kernels.moe_reference import route

    t_start = time.time()
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    from rackbed.kernels.bench.allreduce import _meta

    variants = list(variants or _variants(sweep))
    vfp8 = {v: gw.variant_config(v)["fp8"] for v in variants}
    res = {"meta": _meta(0), "errors": [], "compile": {}, "checks": [], "rows": [], "sweep": sweep,
           "variants": {v: gw.variant_config(v) for v in variants},
           "default_variant": {"bf16": gw.default_variant(False), "fp8": gw.default_variant(True)},
           "cute_unavailable": gg.cute_unavailable()}
    _write(res)
    shapes = {"gate_up": (2 * F_EXPERT, D_MODEL), "down": (D_MODEL, F_EXPERT)}
    ok = {}
    # 1. compile (a failure prints the whole traceback and disables that variant)
    for sname, (N, K) in shapes.items():
        for var in variants:
            t0 = time.time()
            why = gw.shape_unsupported(1, N, K, vfp8[var], var)
            if why:
                ok[(sname, var)] = False
                res["compile"][f"{sname}/{var}"] = {"ok": False, "error": f"unsupported: {why}"}
                continue
            try:
                from rackbed.kernels import grouped_gemm_wgmma_cute as gc

                gc.compiled(N, K, var)
                ok[(sname, var)] = True
                res["compile"][f"{sname}/{var}"] = {"ok": True, "s": time.time() - t0}
                _say(f"compiled {sname} {var} N={N} K={K} in {time.time() - t0:.1f} s")
            except Exception as exc:
                ok[(sname, var)] = False
                tb = traceback.format_exc()
                res["compile"][f"{sname}/{var}"] = {"ok": False, "error": f"{type(exc).__name__}: {exc}",
                                                   "traceback": tb[-4000:]}
                res["errors"].append(f"compile {sname}/{var}: {type(exc).__name__}: {str(exc)[:300]}")
                print(tb[-3000:], flush=True)
            _write(res)
    g = torch.Generator(device=dev).manual_seed(0)

    def operands(E, N, K):
        w = (torch.randn(E, N, K, device=dev, generator=g) * K ** -0.5).to(torch.bfloat16)
        wq, ws = gw.quantize_fp8_block(w, "weight")
        return w, wq.contiguous(), ws.contiguous()

    def run_variant(var, x, xq, xs, w, wq, ws, counts, out, n_ctas=None):
        if not vfp8[var]:
            return gw.grouped_mm(x, w, counts, out=out, n_ctas=n_ctas, variant=var)
        return gw.grouped_mm(xq, wq, counts, x_scale=xs, w_scale=ws, out=out, n_ctas=n_ctas, variant=var)

    # 2. small checks: partial tiles, empty experts, tiles crossing into the next expert; odd grid sizes
    small = [0, 1, 127, 128, 129, 300, 0, 5]
    for sname, (N, K) in shapes.items():
        w, wq, ws = operands(len(small), N, K)
        R = sum(small)
        counts = torch.tensor(small, device=dev)
        x = torch.randn(R, K, device=dev, generator=g).to(torch.bfloat16)
        xq, xs = gw.quantize_fp8_block(x, "activation")
        refs = {False: gw.grouped_mm_reference(x, w, counts),
                True: gw.grouped_mm_reference(xq, wq, counts, x_scale=xs, w_scale=ws)}
        for var in variants:
            if not ok.get((sname, var)):
                continue
            for n_ctas in (None, 1, 7):
                what = f"check small {sname} {var} ctas={n_ctas}"
                try:
                    out = torch.full((R, N), float("nan"), dtype=torch.bfloat16, device=dev)
                    run_variant(var, x, xq, xs, w, wq, ws, counts, out, n_ctas)
                    _sync_bounded(res, what)
                    err = _relerr(out, refs[vfp8[var]])
                    passed = err < TOL["fp8" if vfp8[var] else "bf16"]
                    res["checks"].append({"case": f"small_{sname}", "variant": var, "n_ctas": n_ctas,
                                          "relerr": err, "ok": passed})
                    _say(f"{what}: relerr {err:.2e} {'OK' if passed else 'FAIL'}")
                    if not passed:
                        ok[(sname, var)] = False
                        res["errors"].append(f"{what}: relerr {err:.2e} FAIL (variant skipped)")
                except Exception as exc:
                    res["errors"].append(f"{what}: {type(exc).__name__}: {exc}")
                    traceback.print_exc()
                    ok[(sname, var)] = False
                _write(res)
                if not ok.get((sname, var)):
                    break
        del w, wq, ws
    # 3. benchmark cases
    rng = np.random.default_rng(5)
    skew = route(N_EXPERTS * ROWS // TOP_K, N_EXPERTS, TOP_K, dist="zipf", zipf_s=1.2, rng=rng).tokens_per_expert
    cases = [("gate_up", "gate_up", [ROWS] * N_EXPERTS), ("down", "down", [ROWS] * N_EXPERTS),
             ("gate_up_skewed", "gate_up", [int(c) for c in skew])]
    weights = {}
    for cname, sname, counts_l in cases:
        N, K = shapes[sname]
        E = len(counts_l)
        try:
            if sname not in weights:
                weights.clear()
                torch.cuda.empty_cache()
                weights[sname] = operands(E, N, K)
            w, wq, ws = weights[sname]
            R = sum(counts_l)
            counts = torch.tensor(counts_l, device=dev)
            x = torch.randn(R, K, device=dev, generator=g).to(torch.bfloat16)
            xq, xs = gw.quantize_fp8_block(x, "activation")
            flops = 2 * R * N * K
            row = {"case": cname, "rows": R, "experts": E, "active_experts": sum(1 for c in counts_l if c),
                   "max_rows_per_expert": max(counts_l), "N": N, "K": K, "flops": flops, "variants": {}}
            nz = [e for e, c in enumerate(counts_l) if c]
            chk = sorted({nz[0], nz[len(nz) // 2], nz[-1], int(np.argmax(counts_l))})
            rows_chk = _expert_rows(counts_l, chk)
            offs = torch.cumsum(counts, 0).to(torch.int32)
            # baselines
            fn_t = lambda: torch._grouped_mm(x, w.transpose(1, 2), offs=offs)
            row["torch_bf16_us"] = _time_us(fn_t, res, f"{cname} torch bf16", reps=REPS)
            ref_bf16 = gw.grouped_mm_reference(x, w, counts, experts=set(chk))
            ref_fp8 = gw.grouped_mm_reference(xq, wq, counts, x_scale=xs, w_scale=ws, experts=set(chk))
            row["torch_bf16_relerr"] = _relerr(fn_t(), ref_bf16, rows_chk)
            try:
                sa = (x.float().abs().amax(1) / 448).clamp_min(1e-12)
                xrq = (x.float() / sa[:, None]).to(torch.float8_e4m3fn)
                sb = (w.float().abs().amax(2) / 448).clamp_min(1e-12)
                wrq = (w.float() / sb[:, :, None]).to(torch.float8_e4m3fn)
                fn_s = lambda: torch._scaled_grouped_mm(xrq, wrq.transpose(1, 2), sa, sb, offs=offs,
                                                        out_dtype=torch.bfloat16)
                row["torch_fp8_rowwise_us"] = _time_us(fn_s, res, f"{cname} torch fp8 rowwise", reps=REPS)
                row["torch_fp8_rowwise_relerr_vs_bf16ref"] = _relerr(fn_s(), ref_bf16, rows_chk)
                del xrq, wrq
            except Exception as exc:
                row["torch_fp8_error"] = f"{type(exc).__name__}: {exc}"
            _say(f"{cname}: torch bf16 {row['torch_bf16_us']:.0f} us, fp8 rowwise "
                 f"{row.get('torch_fp8_rowwise_us', float('nan')):.0f} us")
            for var in variants:
                if not ok.get((sname, var)):
                    row["variants"][var] = {"skipped": "unsupported, compile or small check failed"}
                    continue
                what = f"{cname} {var}"
                vr = row["variants"][var] = {"fp8": vfp8[var]}
                try:
                    out = torch.full((R, N), float("nan"), dtype=torch.bfloat16, device=dev)
                    run_variant(var, x, xq, xs, w, wq, ws, counts, out)
                    _sync_bounded(res, what)
                    ref = ref_fp8 if vfp8[var] else ref_bf16
                    vr["relerr"] = err = _relerr(out, ref, rows_chk)
                    vr["all_rows_written"] = bool(out.isfinite().all())
                    vr["relerr_vs_bf16ref"] = _relerr(out, ref_bf16, rows_chk)
                    vr["ok"] = bool(err < TOL["fp8" if vfp8[var] else "bf16"] and vr["all_rows_written"])
                    vr["us"] = t = _time_us(lambda: run_variant(var, x, xq, xs, w, wq, ws, counts, out), res,
                                            what, reps=REPS)
                    vr["TFLOPs"] = flops / t / 1e6
                    _say(f"{what}: {t:.0f} us = {flops / t / 1e6:.0f} TFLOP/s, relerr {err:.2e}"
                         f"{'' if vr['ok'] else ' WRONG'}")
                    if not vr["ok"]:
                        res["errors"].append(f"{what}: relerr {err:.2e}, all rows written "
                                             f"{vr['all_rows_written']}: WRONG (not eligible as best)")
                except Exception as exc:
                    vr["error"] = f"{type(exc).__name__}: {exc}"
                    res["errors"].append(f"{what}: {type(exc).__name__}: {exc}")
                    traceback.print_exc()
                _write(res)
            del out
            for key in ("torch_bf16", "torch_fp8_rowwise"):
                if f"{key}_us" in row:
                    row[f"{key}_TFLOPs"] = flops / row[f"{key}_us"] / 1e6
            _pick_best(row)
            if "wgmma_fp8_us" in row and "torch_fp8_rowwise_us" in row:
                row["wgmma_fp8_vs_torch_fp8_rowwise"] = row["torch_fp8_rowwise_us"] / row["wgmma_fp8_us"]
            res["rows"].append(row)
            del x, xq, xs
        except Exception as exc:
            res["errors"].append(f"{cname}: {type(exc).__name__}: {exc}")
            traceback.print_exc()
        _write(res)
    res["checks_ok"] = bool(res["checks"]) and all(c["ok"] for c in res["checks"])
    res["best_variant"] = _best_overall(res)
    res["elapsed_s"] = time.time() - t_start
    _write(res)
    return res


def _best_overall(res: dict) -> dict:
    """Per dtype: the variant with the least total time over the benchmark cases where every case ran correctly,
    and (bf16) whether it beats torch._grouped_mm on every case (the impl="auto" switch)."""
    out = {}
    rows = res.get("rows", [])
    for kind, fp in (("bf16", False), ("fp8", True)):
        tot = {}
        for v, cfg in res.get("variants", {}).items():
            if cfg["fp8"] != fp:
                continue
            ds = [r["variants"].get(v, {}) for r in rows]
            if rows and all(d.get("ok") for d in ds):
                tot[v] = sum(d["us"] for d in ds)
        if tot:
            best = min(tot, key=tot.get)
            out[kind] = {"variant": best, "total_us": tot[best],
                         "beats_torch_bf16_all_cases": all(r["variants"][best]["us"] < r["torch_bf16_us"]
                                                           for r in rows)}
    return out


def prefill_table(res: dict) -> str:
    f = (lambda v, s=".0f": "-" if v is None else format(v, s))
    nc = sum(1 for v in res.get("compile", {}).values() if v["ok"])
    lines = [f"compile ok {nc}/{len(res.get('compile', {}))}: "
             f"{', '.join(k for k, v in res.get('compile', {}).items() if not v['ok']) or 'no failures'} failed; "
             f"small checks ok={res.get('checks_ok')}; errors={len(res.get('errors', []))}"]
    rows = res.get("rows", [])
    variants = list(res.get("variants", {}))
    if variants and rows:
        lines.append("per variant (TFLOP/s; '-' = skipped, '!' = wrong result):")
        lines.append(f"{'variant':20s} " + " ".join(f"{r['case']:>15s}" for r in rows))
        for v in variants:
            cells = []
            for r in rows:
                d = r.get("variants", {}).get(v, {})
                cells.append("-" if "TFLOPs" not in d else f"{d['TFLOPs']:.0f}" + ("" if d.get("ok") else "!"))
            lines.append(f"{v:20s} " + " ".join(f"{c:>15s}" for c in cells))
    lines.append(f"{'case':15s} {'rows':>6s} {'N':>5s} {'K':>5s} {'torch_bf16':>10s} {'torch_fp8rw':>11s} "
                 f"{'best_bf16':>18s} {'TF':>5s} {'best_fp8':>15s} {'TF':>5s} {'bf16/torch':>10s} {'fp8/bf16':>8s} "
                 f"{'err_b':>7s} {'err_f':>7s}   (TFLOP/s)")
    for r in rows:
        lines.append(f"{r['case']:15s} {r['rows']:6d} {r['N']:5d} {r['K']:5d} {f(r.get('torch_bf16_TFLOPs')):>10s} "
                     f"{f(r.get('torch_fp8_rowwise_TFLOPs')):>11s} {r.get('wgmma_bf16_variant', '-'):>18s} "
                     f"{f(r.get('wgmma_bf16_TFLOPs')):>5s} {r.get('wgmma_fp8_variant', '-'):>15s} "
                     f"{f(r.get('wgmma_fp8_TFLOPs')):>5s} {f(r.get('wgmma_bf16_vs_torch_bf16'), '.2f'):>10s} "
                     f"{f(r.get('wgmma_fp8_vs_wgmma_bf16'), '.2f'):>8s} {f(r.get('wgmma_bf16_relerr'), '.1e'):>7s} "
                     f"{f(r.get('wgmma_fp8_relerr'), '.1e'):>7s}")
    for kind, b in res.get("best_variant", {}).items():
        lines.append(f"best {kind} over all cases: {b['variant']} ({b['total_us']:.0f} us total)"
                     + (f"; beats torch bf16 on every case: {b['beats_torch_bf16_all_cases']}"))
    for e in res.get("errors", []):
        lines.append(f"error: {e}")
    return "\n".join(lines)


register_suite("moe_prefill_gemm", "MoE prefill grouped GEMM: wgmma bf16 / FP8 block-scaled vs torch grouped_mm",
               prefill_table, min_gpus=1)(run_prefill)


def sweep_groups() -> list[list[str]]:
    """Variant groups of ``--sweep``, each run in its own fresh child process (a launch failure poisons that
    process's CUDA context, a hang ends it: either loses only its group). The variants verified correct on the GPU
    (SAFE_VARIANTS, v1 first) share the first group; every other variant gets a group of its own."""
    from rackbed.kernels import grouped_gemm_wgmma as gw

    safe = [v for v in SAFE_VARIANTS if v in gw.VARIANTS]
    return [safe] + [[v] for v in gw.VARIANTS if v not in SAFE_VARIANTS]


# correct in results/h200x2/moe/prefill_gemm_v3_sweep.json (small checks and all benchmark cases); the v4
# cluster variants (cluster_n > 1) and the v3 variants beaten there run each in their own child process
SAFE_VARIANTS = ("v1_bf16", "v1_fp8", "bf16_coop_smem", "fp8_smem", "fp8_dbuf_smem")


def merge_results(parts: list[dict]) -> dict:
    """One result from the group runs: union of compiles, checks, errors, variants; rows by case, their per-variant
    entries united (torch baselines from the first run), best variants recomputed."""
    out = {"meta": parts[0].get("meta"), "errors": [], "compile": {}, "checks": [], "rows": [], "sweep": True,
           "variants": {}, "default_variant": parts[0].get("default_variant"),
           "cute_unavailable": parts[0].get("cute_unavailable"), "groups": []}
    by_case = {}
    for p in parts:
        out["groups"].append({"variants": list(p.get("variants", {})), "elapsed_s": p.get("elapsed_s"),
                              "complete": "checks_ok" in p, "torch_bf16_us": {r["case"]: r.get("torch_bf16_us")
                                                                              for r in p.get("rows", [])}})
        for k in ("errors", "checks"):
            out[k] += p.get(k, [])
        for k in ("compile", "variants"):
            out[k].update(p.get(k, {}))
        for r in p.get("rows", []):
            if r["case"] not in by_case:
                by_case[r["case"]] = dict(r, variants=dict(r.get("variants", {})))
                out["rows"].append(by_case[r["case"]])
            else:
                by_case[r["case"]]["variants"].update(r.get("variants", {}))
    for row in out["rows"]:
        _pick_best(row)
    out["checks_ok"] = bool(out["checks"]) and all(c["ok"] for c in out["checks"])
    out["best_variant"] = _best_overall(out)
    return out


def _run_group(flag: str, grp, part: str, limit: float):
    """Run variant group ``grp`` in a fresh child process (``flag`` = --variants or --diag-child) bounded by
    ``limit`` s, and read the suite it wrote to ``part``: ``(return code or "timeout", suite dict)``; a missing
    JSON or a failed child becomes an error entry, never an exception."""
    try:
        rc = subprocess.run([sys.executable, "-u", "-m", "rackbed.kernels.bench.moe_prefill", flag, ",".join(grp),
                             "--out", part, "--force"], check=False, timeout=limit).returncode
    except subprocess.TimeoutExpired:
        rc = "timeout"
    try:
        with open(part) as f:
            res = json.load(f)["suites"]["moe_prefill_gemm"]
    except Exception as exc:
        res = {"errors": [f"group {grp}: no JSON ({type(exc).__name__})"], "rows": []}
    if rc != 0:
        res.setdefault("errors", []).append(f"group {','.join(grp)}: child exit {rc}")
    return rc, res


def _run_isolated(out_path: str, budget_s: float) -> dict:
    """--sweep: each group of sweep_groups() in a child process with its own timeout, then merged."""

    groups = sweep_groups()
    parts = []
    t0 = time.time()
    for i, grp in enumerate(groups):
        left = budget_s - (time.time() - t0)
        # share what is left between the remaining groups in proportion to their variants (+1: process start-up,
        # torch baselines), at least 30 s
        weight = (len(grp) + 1) / sum(len(g) + 1 for g in groups[i:])
        limit = max(30.0, left * weight)
        part = f"{out_path}.part{i}.json"
        _say(f"group {i + 1}/{len(groups)}: {','.join(grp)} (limit {limit:.0f} s)")
        rc, res = _run_group("--variants", grp, part, limit)
        parts.append(res)
        merged = merge_results(parts)
        merged["elapsed_s"] = time.time() - t0
        write_text(out_path, json.dumps({"suites": {"moe_prefill_gemm": merged}}, indent=1, default=str))
    return merged


# ------------------------------------------------------------------------------------------------ --diagnose
# Gap analysis: each real variant beside its diagnostic twins (kernels.grouped_gemm_wgmma.DIAG_VARIANTS,
# wrong results on purpose: timed WITHOUT the correctness gate, never eligible as a best/default variant), on
# gate_up and down at the benchmark shape and at a tail-free shape. Real variants keep their correctness check.
DIAG_GROUPS = (("bf16_coop_smem", "bf16_coop_smem__no_epilogue"),
               ("fp8_dbuf_smem", "fp8_dbuf_smem__no_epilogue", "fp8_dbuf_smem__no_promote"))


def tail_free_counts(n_experts: int = N_EXPERTS, rows: int = 3 * 128, extra: int = 12) -> list[int]:
    """Per-expert rows of the tail-free shape: every m-tile full (rows % 128 == 0) and 3 * n_experts + extra
    = 396 m-tiles = 33 * 12, so the tile count is a multiple of 132 (the H200's SMs) for N / tile_n = 12 (bf16
    gate_up), 16 (bf16 down), 24 (fp8 gate_up), 32 (fp8 down): every CTA of the persistent grid gets the same
    number of equal tiles."""
    return [rows + 128] * extra + [rows] * (n_experts - extra)


def diag_cases() -> list[tuple[str, str, list[int]]]:
    return [("gate_up", "gate_up", [ROWS] * N_EXPERTS), ("gate_up_tailfree", "gate_up", tail_free_counts()),
            ("down", "down", [ROWS] * N_EXPERTS), ("down_tailfree", "down", tail_free_counts())]


def run_diagnose_child(variants: list[str], out_path: str) -> dict:
    """One group of DIAG_GROUPS in this process: compile, check the real variant on 2 experts, time everything
    (real variant first, so its numbers are in the JSON before any diagnostic twin runs)."""
    global _partial_path
    import torch

    from rackbed.kernels import grouped_gemm_wgmma as gw
    from rackbed.kernels import grouped_gemm_wgmma_cute as gc

    _partial_path = out_path
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    t_start = time.time()
    res = {"errors": [], "compile": {}, "rows": [], "variants": {v: gw.variant_config(v) for v in variants}}
    _write(res)
    fp8 = gw.variant_config(variants[0])["fp8"]
    shapes = {"gate_up": (2 * F_EXPERT, D_MODEL), "down": (D_MODEL, F_EXPERT)}
    g = torch.Generator(device=dev).manual_seed(0)
    for cname, sname, counts_l in diag_cases():
        N, K = shapes[sname]
        if not cname.endswith("tailfree"):  # new weights per shape (the tail-free case reuses them)
            w = wq = ws = None
            torch.cuda.empty_cache()
            w = (torch.randn(N_EXPERTS, N, K, device=dev, generator=g) * K ** -0.5).to(torch.bfloat16)
            if fp8:
                wq, ws = gw.quantize_fp8_block(w, "weight")
                w = None
        R = sum(counts_l)
        counts = torch.tensor(counts_l, device=dev)
        x = torch.randn(R, K, device=dev, generator=g).to(torch.bfloat16)
        xq = xs = None
        if fp8:
            xq, xs = gw.quantize_fp8_block(x, "activation")
        offsets = gw.tile_offsets(counts)
        flops = 2 * R * N * K
        row = {"case": cname, "rows": R, "N": N, "K": K, "flops": flops, "fp8": fp8,
               "m_tiles": sum(-(-c // 128) for c in counts_l), "variants": {}}
        res["rows"].append(row)
        if not fp8:
            offs = torch.cumsum(counts, 0).to(torch.int32)
            row["torch_bf16_us"] = _time_us(lambda: torch._grouped_mm(x, w.transpose(1, 2), offs=offs), res,
                                            f"{cname} torch", reps=REPS)
            row["torch_bf16_TFLOPs"] = flops / row["torch_bf16_us"] / 1e6
        for var in variants:
            cfg = gw.variant_config(var)
            diag = cfg["diag"]
            what = f"{cname} {var}"
            vr = row["variants"][var] = {"diag": diag, "base": cfg["base"]}
            try:
                key = f"{sname}/{var}"
                if key not in res["compile"]:
                    t0 = time.time()
                    gc.compiled(N, K, var)
                    res["compile"][key] = {"ok": True, "s": time.time() - t0}
                    _say(f"compiled {key} in {time.time() - t0:.1f} s")
                out = torch.full((R, N), float("nan"), dtype=torch.bfloat16, device=dev)
                if fp8:
                    fn = lambda: gw.grouped_mm(xq, wq, counts, x_scale=xs, w_scale=ws, out=out, offsets=offsets,
                                               variant=var, diagnostic=True)
                else:
                    fn = lambda: gw.grouped_mm(x, w, counts, out=out, offsets=offsets, variant=var,
                                               diagnostic=True)
                fn()
                _sync_bounded(res, what)
                if diag is None:  # the real kernel keeps its correctness gate (2 experts vs the fp32 reference)
                    chk = [0, len(counts_l) - 1]
                    rows_chk = _expert_rows(counts_l, chk)
                    ref = (gw.grouped_mm_reference(xq, wq, counts, x_scale=xs, w_scale=ws, experts=set(chk)) if fp8
                           else gw.grouped_mm_reference(x, w, counts, experts=set(chk)))
                    vr["relerr"] = err = _relerr(out, ref, rows_chk)
                    vr["all_rows_written"] = bool(out.isfinite().all())
                    vr["ok"] = bool(err < TOL["fp8" if fp8 else "bf16"] and vr["all_rows_written"])
                    del ref
                else:
                    vr["ok"] = None  # diagnostic: wrong on purpose, not checked
                vr["us"] = t = _time_us(fn, res, what, reps=REPS)
                vr["TFLOPs"] = flops / t / 1e6
                _say(f"{what}: {t:.0f} us = {vr['TFLOPs']:.0f} TFLOP/s"
                     + (" (DIAGNOSTIC, unchecked)" if diag else f", relerr {vr['relerr']:.1e}"
                        + ("" if vr["ok"] else " WRONG")))
                del out
            except Exception as exc:
                vr["error"] = f"{type(exc).__name__}: {exc}"
                res["errors"].append(f"{what}: {vr['error']}")
                traceback.print_exc()
            _write(res)
        del x, xq, xs
    res["elapsed_s"] = time.time() - t_start
    _write(res)
    return res


def diag_shares(rows: list[dict]) -> list[dict]:
    """Per (case, real variant): TFLOP/s and the implied share of each cause: epilogue = 1 - t_noepi / t_full,
    promotion = 1 - t_nopromote / t_full, tail (benchmark case only) = 1 - TF_case / TF_tailfree of the same
    variant (the tail-free shape also has no partial m-tiles: both are what the tail costs)."""
    by_case = {(r["case"], r.get("fp8")): r for r in rows}  # bf16 and fp8 groups have rows of the same cases
    out = []
    for r in rows:
        for var, d in r["variants"].items():
            if d.get("diag") is not None or "us" not in d:
                continue
            s = {"case": r["case"], "variant": var, "TFLOPs": d["TFLOPs"], "ok": d.get("ok"),
                 "torch_bf16_TFLOPs": r.get("torch_bf16_TFLOPs")}
            for v2, d2 in r["variants"].items():
                if d2.get("base") == var and d2.get("diag") and "us" in d2:
                    s[f"{d2['diag']}_TFLOPs"] = d2["TFLOPs"]
                    s[f"{d2['diag'].replace('no_', '')}_share"] = 1 - d2["us"] / d["us"]
            tf = by_case.get((r["case"] + "_tailfree", r.get("fp8")), {}).get("variants", {}).get(var, {})
            if "TFLOPs" in tf:
                s["tailfree_TFLOPs"] = tf["TFLOPs"]
                s["tail_share"] = 1 - d["TFLOPs"] / tf["TFLOPs"]
            out.append(s)
    return out


def diag_table(res: dict) -> str:
    f = (lambda v, s=".0f": "-" if v is None else format(v, s))
    lines = ["DIAGNOSTIC (no_epilogue / no_promote twins compute wrong results on purpose; timed unchecked)",
             f"{'case':17s} {'variant':14s} {'ok':>5s} {'TF':>5s} {'torch':>5s} {'noepi':>5s} {'epi%':>5s} "
             f"{'noprm':>5s} {'prom%':>5s} {'tailfree':>8s} {'tail%':>5s}   (TFLOP/s; share = 1 - t_diag/t_full)"]
    for s in res.get("shares", []):
        pc = (lambda k: "-" if s.get(k) is None else f"{100 * s[k]:.1f}")
        lines.append(f"{s['case']:17s} {s['variant']:14s} {str(s['ok']):>5s} {f(s['TFLOPs']):>5s} "
                     f"{f(s.get('torch_bf16_TFLOPs')):>5s} {f(s.get('epilogue_TFLOPs')):>5s} "
                     f"{pc('epilogue_share'):>5s} {f(s.get('promote_TFLOPs')):>5s} {pc('promote_share'):>5s} "
                     f"{f(s.get('tailfree_TFLOPs')):>8s} {pc('tail_share'):>5s}")
    for e in res.get("errors", []):
        lines.append(f"error: {e}")
    return "\n".join(lines)


def run_diagnose(out_path: str, budget_s: float = 66.0) -> dict:
    """--diagnose: each DIAG_GROUPS group in a bounded child process (a hang or crash loses at most the rest of
    that group: the real variant runs and is written first), then the shares."""

    t0 = time.time()
    merged = {"diagnostic": True, "errors": [], "compile": {}, "rows": [], "variants": {}, "groups": []}
    for i, grp in enumerate(DIAG_GROUPS):
        left = budget_s - (time.time() - t0)
        # +1: process start-up (torch, CuTe DSL imports, weights); compiles ~2 s per variant and shape
        limit = max(15.0, left * (len(grp) + 1) / sum(len(g) + 1 for g in DIAG_GROUPS[i:]))
        part = f"{out_path}.diag{i}.json"
        _say(f"diag group {i + 1}/{len(DIAG_GROUPS)}: {','.join(grp)} (limit {limit:.0f} s)")
        rc, p = _run_group("--diag-child", grp, part, limit)
        merged["groups"].append({"variants": list(grp), "rc": rc, "elapsed_s": p.get("elapsed_s")})
        merged["errors"] += p.get("errors", [])
        merged["compile"].update(p.get("compile", {}))
        merged["variants"].update(p.get("variants", {}))
        merged["rows"] += p.get("rows", [])
        merged["shares"] = diag_shares(merged["rows"])
        merged["elapsed_s"] = time.time() - t0
        write_text(out_path, json.dumps({"suites": {"moe_prefill_gemm_diag": merged}}, indent=1, default=str))
    return merged


def main(argv=None) -> int:
    import argparse

    global _partial_path
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="JSON path (rewritten after every step)")
    p.add_argument("--sweep", action="store_true", help="every compile-time variant (VARIANTS), v1 included, in "
                   "process groups (sweep_groups), merged into --out")
    p.add_argument("--variants", default=None, help="comma-separated variant names, one process")
    p.add_argument("--budget", type=float, default=210.0, help="--sweep: seconds for all groups together")
    p.add_argument("--diagnose", action="store_true", help="gap analysis: the default variants beside their "
                   "diagnostic twins (no_epilogue, no_promote; wrong results on purpose, timed unchecked) and a "
                   "tail-free shape; about 60 s")
    p.add_argument("--diag-child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--force", action="store_true", help="replace an existing --out file")
    a = p.parse_args(argv)
    entry_file(a.out, force=a.force)  # before the benchmark, not after it
    t0 = time.time()
    if a.diag_child:
        run_diagnose_child(a.diag_child.split(","), a.out)
        return 0
    if a.diagnose:
        res = run_diagnose(a.out, min(a.budget, 66.0))
        print(diag_table(res), flush=True)
        _say(f"done in {time.time() - t0:.0f} s; wrote {a.out}")
        return 0
    if a.sweep and not a.variants:
        res = _run_isolated(a.out, a.budget)
    else:
        _partial_path = a.out
        res = run_prefill(variants=a.variants.split(",") if a.variants else None)
    print(prefill_table(res), flush=True)
    if a.sweep:
        for kind, b in res.get("best_variant", {}).items():
            print(f"to adopt: kernels/grouped_gemm_wgmma.py DEFAULT_VARIANT[{kind!r}] = {b['variant']!r}"
                  + (f"; kernels/grouped_gemm.py PREFILL_WGMMA_MIN_MEAN_ROWS (it beats torch on every case)"
                     if kind == "bf16" and b["beats_torch_bf16_all_cases"] else ""), flush=True)
    _say(f"done in {time.time() - t0:.0f} s; wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
