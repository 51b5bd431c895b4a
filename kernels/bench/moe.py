"""MoE kernel benchmarks and device checks: grouped GEMM (decode + prefill baselines), MX kernels, and the decode
dispatch/combine over peer memory. Registers suites "moe_gemm" (1 GPU) and "moe_a2a" (2+ GPUs) in kernels.bench.suites.

    python -m rackbed.kernels.bench.moe --out results/h200x2/moe.json      # both suites, one command, table printed last

Shapes (Qwen3-235B-A22B MoE layer): D = 4096, F = 1536 (gate_up 4096 -> 3072, down 1536 -> 4096), 128 experts,
top-8. Each case: fresh random inputs, outputs poisoned (NaN) before the checked run, ‖out − ref‖/‖ref‖ against an
fp32 reference (bf16 tolerance 2e-2), then CUDA-event timing (median of reps; weights 4.8 GB >> 60 MB L2).
Rows carry the two numbers of METHOD.md: ``bytes`` (weights of active experts read once + activations) and
``flops``; ``GBps`` and ``TFLOPs`` are those over the measured time.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
import traceback

for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ[_k] = _v

import numpy as np

from rackbed.kernels.bench.suites import register_suite

D_MODEL, F_EXPERT, N_EXPERTS, TOP_K = 4096, 1536, 128, 8


def _shape() -> tuple[int, int, int]:
    """(D, F, E) of the sweep: Qwen3-235B's, or ``RACKBED_MOE_SHAPE=D,F,E`` (e.g. ``7168,2048,256``: DeepSeek-V3)."""
    env = os.environ.get("RACKBED_MOE_SHAPE")
    if not env:
        return D_MODEL, F_EXPERT, N_EXPERTS
    D, F, E = (int(v) for v in env.split(","))
    return D, F, E


def _meta() -> dict:
    from rackbed.kernels.bench.allreduce import _meta as ar_meta

    m = ar_meta(0)
    try:
        import cutlass

        m["cutlass_dsl_file"] = cutlass.__file__
    except Exception as exc:
        m["cutlass_dsl_file"] = f"unavailable ({exc})"
    return m


def _time_us(fn, reps: int = 20, warmup: int = 3, iters: int = 1) -> float:
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(iters):
            fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3 / iters)
    return statistics.median(ts)


def _relerr(out, ref) -> float:
    import torch

    o = out.double()
    if torch.isnan(o).any():
        return float("nan")
    return float((o - ref.double()).norm() / ref.double().norm().clamp_min(1e-30))


# ---------------------------------------------------------------------------------------------- grouped GEMM


def _gemm_cases():
    """(name, counts list) for 128 experts: m tokens on E_act experts (spread), and routed decode batches. Another
    shape (:func:`_shape`): the experts a decode batch of 32-256 sequences touches with 3-16 rows each, and routed
    batches of that width."""
    from rackbed.kernels.moe_reference import route

    cases = []
    _, _, E = _shape()
    if E != N_EXPERTS:
        for e_act, m in ((96, 3), (112, 5), (124, 8), (136, 15)):
            c = [0] * E
            for i in range(e_act):
                c[(i * E) // e_act] = m
            cases.append((f"{e_act}x{m}", c))
        rng = np.random.default_rng(1)
        for T in (32, 64, 128, 256):
            cases.append((f"route{T}", route(T, E, TOP_K, rng=rng).tokens_per_expert.tolist()))
        return cases
    for e_act in (8, 32, 128):
        for m in (1, 2, 4, 8):
            c = [0] * N_EXPERTS
            for i in range(e_act):
                c[i * (N_EXPERTS // e_act)] = m
            cases.append((f"{e_act}x{m}", c))
    rng = np.random.default_rng(1)
    for T in (16, 128):
        r = route(T, N_EXPERTS, TOP_K, rng=rng)
        cases.append((f"route{T}", r.tokens_per_expert.tolist()))
    c = [0] * N_EXPERTS
    c[5] = 8
    cases.append(("one_expert8", c))
    return cases


# Tensor-core kernel variants swept by run_gemm (name -> config as grouped_gemm.MMA_V2); "v2" is the measured v2.
def _mma_variants() -> dict:
    def c(rb, warps, ctas, depth, hint, tn=1):
        return {"rb": rb, "warps": warps, "ctas": ctas, "depth": depth, "hint": hint, "tn": tn}

    gu = {"v2": c(1, 8, 2, 0, 0), "h1": c(1, 8, 2, 0, 1), "d4h1": c(1, 8, 2, 4, 1), "d4h2": c(1, 8, 2, 4, 2),
          "d8h1c1": c(1, 8, 1, 8, 1), "d2h1c4": c(1, 8, 4, 2, 1), "d4h1c3": c(1, 8, 3, 4, 1),
          "w4d4h1c4": c(1, 4, 4, 4, 1), "w16d4h1c1": c(1, 16, 1, 4, 1), "rb2d2h1": c(2, 8, 2, 2, 1),
          "d4h1tn2": c(1, 8, 2, 4, 1, 2), "w4d8h1c2": c(1, 4, 2, 8, 1),
          "w4d8h1c2tn2": c(1, 4, 2, 8, 1, 2), "d8h1c1tn2": c(1, 8, 1, 8, 1, 2), "w16d4h1c1tn2": c(1, 16, 1, 4, 1, 2)}
    dn = {"v2": c(2, 8, 2, 0, 0), "h1": c(2, 8, 2, 0, 1), "d3h1": c(2, 8, 2, 3, 1), "d6h1": c(2, 8, 2, 6, 1),
          "d3h2": c(2, 8, 2, 3, 2), "rb1d3h1c4": c(1, 8, 4, 3, 1), "w4d4h1c4": c(2, 4, 4, 4, 1),
          "rb4d2h1": c(4, 8, 2, 2, 1), "d3h1c3": c(2, 8, 3, 3, 1), "rb1w4d6h1c4": c(1, 4, 4, 6, 1),
          "d3h1tn2": c(2, 8, 2, 3, 1, 2), "rb1d3h1c4tn2": c(1, 8, 4, 3, 1, 2), "d6h1tn2": c(2, 8, 2, 6, 1, 2),
          "rb1w4d6h1c4tn2": c(1, 4, 4, 6, 1, 2)}
    only = os.environ.get("RACKBED_MMA_VARIANTS")  # optional comma list of names to keep (v2 always kept)
    if only:
        keep = set(only.split(",")) | {"v2"}
        gu = {k: v for k, v in gu.items() if k in keep}
        dn = {k: v for k, v in dn.items() if k in keep}
    return {"gate_up": gu, "down": dn}


_GRAPH_FALLBACKS: list[str] = []


def _time_graph_us(fns, reps: int = 8, budget_us: float = 4000.0) -> float:
    """Kernel time without host launch overhead: ``fns`` (a list, called round-robin, e.g. one per weight rotation)
    captured back to back into one CUDA graph, replayed ``reps`` times; median per call. The number of calls per
    graph is chosen from one eager call so that a replay takes about ``budget_us``."""
    import torch

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for f in fns:
            f()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fns[0]()
        b.record()
    torch.cuda.synchronize()
    est = max(a.elapsed_time(b) * 1e3, 1.0)
    n = max(len(fns), min(40, int(budget_us / est)))
    try:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for i in range(n):
                fns[i % len(fns)]()
        g.replay()
        torch.cuda.synchronize()
    except Exception as exc:  # not capturable: back-to-back eager calls (host overhead may show), noted in the JSON
        torch.cuda.synchronize()
        _GRAPH_FALLBACKS.append(f"{type(exc).__name__}: {str(exc)[:200]}")
        return _time_us(lambda: [f() for f in fns], reps=reps, iters=max(1, n // len(fns))) / len(fns)
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3 / n)
    del g
    return statistics.median(ts)


def _ref_act(x, gate_up, counts_l, F):
    """fp32 silu(x Wg^T) * (x Wu^T) per expert -> [R, F] fp32."""
    import torch

    out = torch.zeros(x.shape[0], F, dtype=torch.float32, device=x.device)
    s0 = 0
    for e, n in enumerate(counts_l):
        if n:
            y = x[s0:s0 + n].float() @ gate_up[e].float().T
            out[s0:s0 + n] = torch.nn.functional.silu(y[:, :F]) * y[:, F:]
            s0 += n
    return out


def _ref_down(a, down, counts_l):
    import torch

    out = torch.zeros(a.shape[0], down.shape[1], dtype=torch.float32, device=a.device)
    s0 = 0
    for e, n in enumerate(counts_l):
        if n:
            out[s0:s0 + n] = a[s0:s0 + n].float() @ down[e].float().T
            s0 += n
    return out


def _suggest_tuned(rows: list[dict], variants: dict) -> list:
    """MMA_TUNED rules from the sweep: for each measured mean rows per expert (ascending), the gate_up and the down
    variant with the least summed kernel time over that mean's cases; consecutive equal choices merged."""
    by_mean: dict[float, list[dict]] = {}
    for r in rows:
        by_mean.setdefault(r["rows"] / r["experts"], []).append(r)
    rules: list = []
    for mean in sorted(by_mean):
        pick = []
        for part in ("gate_up", "down"):
            tot: dict[str, float] = {}
            for r in by_mean[mean]:
                for name, t in r.get(f"sweep_{part}_us", {}).items():
                    tot[name] = tot.get(name, 0.0) + t
            ok = [n for n in tot if all(n in r.get(f"sweep_{part}_us", {}) for r in by_mean[mean])]
            pick.append(min(ok, key=tot.get) if ok else "v2")
        if rules and rules[-1][2:] == tuple(pick):
            rules[-1] = (mean, 1, *pick)
        else:
            rules.append((mean, 1, *pick))
    return [(m, e, variants["gate_up"][g], variants["down"][d], g, d) for m, e, g, d in rules]


def run_gemm(cfg=None) -> dict:
    """Decode grouped SwiGLU: torch._grouped_mm, the CuTe GEMV, and a sweep of tensor-core kernel variants (each
    checked on NaN-poisoned outputs before it is timed; compile or check failures are reported and skipped).
    Times: eager CUDA events (host launch overhead included, as v1/v2 measured) and CUDA-graph replay (kernel time;
    weights rotated over experts so a case never runs out of L2)."""
    import torch

    from rackbed.kernels import grouped_gemm as gg

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    res = {"meta": _meta(), "rows": [], "errors": [], "cute_unavailable": gg.cute_unavailable()}
    g = torch.Generator(device=dev).manual_seed(0)
    D, F, E = _shape()
    res["shape"] = {"D": D, "F": F, "E": E}
    gate_up = (torch.randn(E, 2 * F, D, device=dev, generator=g) * D ** -0.5).to(torch.bfloat16)
    down = (torch.randn(E, D, F, device=dev, generator=g) * F ** -0.5).to(torch.bfloat16)
    # the copy ceiling, measured here (bytes read + written)
    big = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    big2 = torch.empty_like(big)
    t = _time_us(lambda: big2.copy_(big), reps=10)
    res["hbm_copy_GBps_rw"] = 2 * big.numel() / t / 1e3
    del big, big2
    partial = os.environ.get("RACKBED_MOE_PARTIAL")  # optional: JSON rewritten after every case (survives timeout)
    mma_why = None
    if res["cute_unavailable"] is None:
        mma_why = gg.mma_unsupported(torch.empty(1, D, dtype=torch.bfloat16, device=dev), gate_up, down)
    res["mma_unavailable"] = res["cute_unavailable"] or mma_why
    t_start = time.time()
    variants = _mma_variants()
    res["mma_variants"] = variants
    ok_var = {"gate_up": {}, "down": {}}
    if res["mma_unavailable"] is None:  # compile every variant up front (bounded: each ~1-10 s), failures skipped
        from rackbed.kernels import grouped_gemm_mma as gm

        for part, (n_w, k, fuse) in (("gate_up", (2 * F, D, True)), ("down", (D, F, False))):
            for name, c in variants[part].items():
                t0 = time.time()
                try:
                    gm.compiled(E, n_w, k, fuse, c["rb"], c["warps"], c["ctas"], c["depth"], c["hint"], c["tn"])
                    ok_var[part][name] = c
                except Exception as exc:
                    res["errors"].append(f"compile {part}/{name}: {type(exc).__name__}: {str(exc)[:300]}")
                print(f"[moe_gemm {time.time() - t_start:5.0f} s] compiled {part}/{name} in {time.time() - t0:.1f} s"
                      f"{'' if name in ok_var[part] else ' FAILED'}", flush=True)
    for name, counts_l in _gemm_cases():
        R = sum(counts_l)
        row = {"case": name, "rows": R, "experts": E, "active_experts": sum(1 for c in counts_l if c),
               "max_rows_per_expert": max(counts_l),
               "bytes": gg.swiglu_weight_bytes(counts_l, D, F) + R * (2 * D + 2 * F) * 2,
               "flops": gg.swiglu_flops(R, D, F)}
        # rotations: the same case on disjoint expert sets, called round-robin in the graph so that consecutive calls
        # never find their weights in L2 (50 MB) when one call's weights would fit there
        wbytes = max(gg.swiglu_weight_bytes(counts_l, D, F), 1)
        n_rot = min(8, -(-150_000_000 // wbytes))
        rots = [torch.tensor(list(np.roll(counts_l, 5 * i)), device=dev, dtype=torch.int64) for i in range(n_rot)]
        offs_r = [gg.expert_offsets(c) for c in rots]
        try:
            counts = rots[0]
            x = torch.randn(R, D, device=dev, generator=g).to(torch.bfloat16)
            ref = gg.grouped_swiglu_reference(x, gate_up, down, counts)
            row["torch_us"] = _time_us(lambda: gg.grouped_swiglu_torch(x, gate_up, down, counts))
            row["torch_relerr"] = _relerr(gg.grouped_swiglu_torch(x, gate_up, down, counts), ref)
            row["torch_GBps"] = row["bytes"] / row["torch_us"] / 1e3
        except Exception as exc:
            res["errors"].append(f"{name} torch: {type(exc).__name__}: {exc}")
            traceback.print_exc()
            res["rows"].append(row)
            continue
        try:
            row["torch_graph_us"] = _time_graph_us([lambda c=c: gg.grouped_swiglu_torch(x, gate_up, down, c)
                                                    for c in rots])
            row["torch_graph_GBps"] = row["bytes"] / row["torch_graph_us"] / 1e3
            offs = torch.cumsum(counts, 0).to(torch.int32)
            row["torch_gate_up_us"] = _time_graph_us([lambda: torch._grouped_mm(x, gate_up.transpose(1, 2),
                                                                                offs=offs)])
        except Exception as exc:
            res["errors"].append(f"{name} torch graph: {type(exc).__name__}: {exc}")
            traceback.print_exc()
        act = torch.empty(R, F, dtype=torch.bfloat16, device=dev)
        out = torch.empty(R, D, dtype=torch.bfloat16, device=dev)
        full = []
        if res["cute_unavailable"] is None:
            full.append(("cute", lambda c, o, **kw: gg.grouped_swiglu_cute(x, gate_up, down, c, act_out=act, out=o)))
        # kernel sweep: each variant checked (NaN-poisoned output vs fp32 reference) before it is timed (graph)
        if ok_var["gate_up"]:
            ref_a = _ref_act(x, gate_up, counts_l, F)
            a_in = ref_a.to(torch.bfloat16)
            ref_d = _ref_down(a_in, down, counts_l)
            for part, n_w_ref in (("gate_up", ref_a), ("down", ref_d)):
                times, errs = {}, {}
                for vname, c in ok_var[part].items():
                    try:
                        if part == "gate_up":
                            dst, launch = act, (lambda o, c=c, of=offs_r[0]: gg.mma_launch(x, gate_up, of, o, True, R, c))
                            fns = [lambda c=c, of=of: gg.mma_launch(x, gate_up, of, act, True, R, c) for of in offs_r]
                        else:
                            dst, launch = out, (lambda o, c=c, of=offs_r[0]: gg.mma_launch(a_in, down, of, o, False, R, c))
                            fns = [lambda c=c, of=of: gg.mma_launch(a_in, down, of, out, False, R, c) for of in offs_r]
                        dst.fill_(float("nan"))
                        launch(dst)
                        torch.cuda.synchronize()
                        errs[vname] = _relerr(dst, n_w_ref)
                        if not errs[vname] < 2e-2:
                            res["errors"].append(f"{name} {part}/{vname}: relerr {errs[vname]}")
                            continue
                        times[vname] = _time_graph_us(fns)
                    except Exception as exc:
                        res["errors"].append(f"{name} {part}/{vname}: {type(exc).__name__}: {str(exc)[:300]}")
                row[f"sweep_{part}_us"], row[f"sweep_{part}_relerr"] = times, errs
                if times:
                    row[f"best_{part}"] = min(times, key=times.get)
            if row.get("best_gate_up") and row.get("best_down"):
                bg, bd = ok_var["gate_up"][row["best_gate_up"]], ok_var["down"][row["best_down"]]
                full.append(("mma_best", lambda c, o, of=None, bg=bg, bd=bd: gg.grouped_swiglu_mma(
                    x, gate_up, down, c, act_out=act, out=o, gu_cfg=bg, dn_cfg=bd, offs=of)))
            if "v2" in ok_var["gate_up"] and "v2" in ok_var["down"]:
                v2g, v2d = ok_var["gate_up"]["v2"], ok_var["down"]["v2"]
                full.append(("mma", lambda c, o, of=None: gg.grouped_swiglu_mma(
                    x, gate_up, down, c, act_out=act, out=o, gu_cfg=v2g, dn_cfg=v2d, offs=of)))
        for tag, fn in full:  # full SwiGLU: checked, then eager and graph timings
            try:
                out.fill_(float("nan"))
                fn(counts, out)
                torch.cuda.synchronize()
                row[f"{tag}_relerr"] = _relerr(out, ref)
                if not row[f"{tag}_relerr"] < 2e-2:
                    res["errors"].append(f"{name} {tag}: relerr {row[f'{tag}_relerr']}")
                    continue
                row[f"{tag}_us"] = _time_us(lambda: fn(counts, out))
                row[f"{tag}_speedup"] = row["torch_us"] / row[f"{tag}_us"]
                row[f"{tag}_GBps"] = row["bytes"] / row[f"{tag}_us"] / 1e3
                # each impl computes its own expert offsets inside (as in use), so no precomputed ``of`` here
                row[f"{tag}_graph_us"] = _time_graph_us([lambda c=c: fn(c, out) for c in rots])
                if row.get("torch_graph_us"):
                    row[f"{tag}_graph_speedup"] = row["torch_graph_us"] / row[f"{tag}_graph_us"]
                row[f"{tag}_graph_GBps"] = row["bytes"] / row[f"{tag}_graph_us"] / 1e3
            except Exception as exc:
                res["errors"].append(f"{name} {tag}: {type(exc).__name__}: {str(exc)[:300]}")
                traceback.print_exc()
        if "cute_speedup" in row:
            row["speedup"] = row["cute_speedup"]
        res["rows"].append(row)
        nan = float("nan")
        print(f"[moe_gemm {time.time() - t_start:5.0f} s] {name}: graph us: torch {row.get('torch_graph_us', nan):.1f}"
              f" gemv {row.get('cute_graph_us', nan):.1f} mma_v2 {row.get('mma_graph_us', nan):.1f} best "
              f"{row.get('mma_best_graph_us', nan):.1f} ({row.get('best_gate_up')}+{row.get('best_down')}, "
              f"{row.get('mma_best_graph_speedup', nan):.2f}x); eager: torch {row.get('torch_us', nan):.1f} "
              f"v2 {row.get('mma_us', nan):.1f} best {row.get('mma_best_us', nan):.1f}", flush=True)
        if partial:
            from rackbed.topology.outputs import write_text

            write_text(partial, json.dumps(res))
    # rules for grouped_gemm.DECODE_DISPATCH, by the host-known mean rows per expert, from the graph (kernel) times
    alias = (("cute", "cute_gemv"), ("mma_best", "cute_mma"))
    rows_alias = [{**r, "torch_us": r.get("torch_graph_us"),
                   **{f"{k2}_us": r.get(f"{k1}_graph_us") for k1, k2 in alias},
                   **{f"{k2}_relerr": r.get(f"{k1}_relerr", 1.0) for k1, k2 in alias}} for r in res["rows"]]
    res["suggested_dispatch"] = gg.suggest_dispatch(rows_alias)
    res["suggested_dispatch_1p25"] = gg.suggest_dispatch(rows_alias, min_gain=1.25)
    res["suggested_mma_tuned"] = _suggest_tuned(res["rows"], variants)
    print(f"suggested DECODE_DISPATCH = {tuple(res['suggested_dispatch'])}", flush=True)
    print("suggested MMA_TUNED = (" + "".join(f"\n    ({m}, {e}, {gcfg}, {dcfg}),  # {gn} + {dn_}"
                                              for m, e, gcfg, dcfg, gn, dn_ in res["suggested_mma_tuned"]) + ")",
          flush=True)
    res["graph_fallbacks"] = list(_GRAPH_FALLBACKS)
    if (D, F, E) == (D_MODEL, F_EXPERT, N_EXPERTS):
        res["prefill"] = _prefill_baselines(gate_up, dev, g)
        res["mx"] = _mx_check(dev)
    return res


def _prefill_baselines(gate_up, dev, g) -> dict:
    """torch._grouped_mm bf16 and torch._scaled_grouped_mm rowwise FP8 at 375 rows/expert (gate_up GEMM)."""
    import torch

    E, N, K = gate_up.shape
    m = 375
    out = {"rows_per_expert": m, "experts": E, "N": N, "K": K}
    R = m * E
    x = torch.randn(R, K, device=dev, generator=g).to(torch.bfloat16)
    offs = torch.arange(1, E + 1, device=dev, dtype=torch.int32) * m
    flops = 2 * R * N * K
    try:
        t = _time_us(lambda: torch._grouped_mm(x, gate_up.transpose(1, 2), offs=offs), reps=10)
        out["bf16_grouped_mm_us"], out["bf16_TFLOPs"] = t, flops / t / 1e6
    except Exception as exc:
        out["bf16_error"] = f"{type(exc).__name__}: {exc}"
    try:
        xa = x.float()
        sa = (xa.abs().amax(1) / 448).clamp_min(1e-12)
        xq = (xa / sa[:, None]).to(torch.float8_e4m3fn)
        wf = gate_up.float()
        sb = (wf.abs().amax(2) / 448).clamp_min(1e-12)  # [E, N]
        wq = (wf / sb[:, :, None]).to(torch.float8_e4m3fn)  # [E, N, K] -> B = [E, K, N] column-major view
        del wf
        bq = wq.transpose(1, 2)
        fn = lambda: torch._scaled_grouped_mm(xq, bq, sa, sb, offs=offs, out_dtype=torch.bfloat16)  # noqa: E731
        y = fn()
        ref = torch._grouped_mm(x, gate_up.transpose(1, 2), offs=offs)
        out["fp8_rowwise_relerr_vs_bf16"] = _relerr(y[: 4 * m], ref[: 4 * m].float())
        t = _time_us(fn, reps=10)
        out["fp8_rowwise_scaled_grouped_mm_us"], out["fp8_rowwise_TFLOPs"] = t, flops / t / 1e6
    except Exception as exc:
        out["fp8_error"] = f"{type(exc).__name__}: {exc}"
    return out


def _mx_check(dev) -> dict:
    """GPU quantize/dequantize vs the numpy reference, bit for bit; plus GPU time for a 4096x4096 tensor."""
    import torch

    from rackbed.engine.core import formats as ref
    from rackbed.kernels import mx

    out = {"formats": {}}
    rng = np.random.default_rng(3)
    for fmt in ref.FORMAT_NAMES + ref.EXTRA_FORMAT_NAMES:
        for role in ("weight", "activation"):
            x = rng.standard_normal((96, 320)) * np.exp(rng.uniform(-6, 6, (96, 320)))
            x[0, :7] = [0, np.nan, np.inf, -np.inf, 1e-30, -0.0, 3.0]
            x[5, 32:64] = 0.0
            q = ref.get_format(fmt).quantize(x, role)
            tq = mx.quantize(torch.from_numpy(x).to(dev), fmt, role)
            rq = tq.to_reference()
            same = bool(np.array_equal(q.codes.astype(np.int64), rq.codes.astype(np.int64)))
            for a, b in ((q.scale_codes, rq.scale_codes), (q.scales, rq.scales)):
                if a is not None:
                    same = same and bool(np.array_equal(a, b, equal_nan=True))
            same = same and (q.tensor_scale == rq.tensor_scale or q.tensor_scale is None)
            deq = bool(np.array_equal(ref.get_format(fmt).dequantize(q), mx.dequantize(tq).cpu().numpy(),
                                      equal_nan=True))
            out["formats"][f"{fmt}/{role}"] = {"codes_identical": same, "dequant_identical": deq}
    xt = torch.randn(4096, 4096, device=dev)
    out["mxfp4_quantize_4096x4096_us"] = _time_us(lambda: mx.quantize(xt, "mxfp4"), reps=5)
    out["all_identical"] = all(v["codes_identical"] and v["dequant_identical"] for v in out["formats"].values())
    return out


def gemm_table(res: dict) -> str:
    f = (lambda v, s=".1f": "-" if v is None else format(v, s))
    lines = [f"HBM copy {f(res.get('hbm_copy_GBps_rw'), '.0f')} GB/s (r+w); gemv: "
             f"{res.get('cute_unavailable') or 'ok'}; mma: {res.get('mma_unavailable') or 'ok'}; "
             f"errors={len(res.get('errors', []))}; graph fallbacks={len(res.get('graph_fallbacks', []))}",
             "full SwiGLU, CUDA-graph replay (kernel time) | eager events (host launch overhead included); "
             "x = torch / impl",
             f"{'case':12s} {'rows':>5s} {'act_e':>5s} {'torch_g':>8s} {'gemv_g':>8s} {'x':>5s} {'v2_g':>8s} "
             f"{'x':>5s} {'best_g':>8s} {'x':>5s} {'bestGB/s':>8s} | {'torch_e':>8s} {'v2_e':>8s} {'best_e':>8s} "
             f"{'x':>5s} {'err':>8s}  best gate_up + down"]
    for r in res.get("rows", []):
        lines.append(f"{r['case']:12s} {r['rows']:5d} {r['active_experts']:5d} {f(r.get('torch_graph_us')):>8s} "
                     f"{f(r.get('cute_graph_us')):>8s} {f(r.get('cute_graph_speedup'), '.2f'):>5s} "
                     f"{f(r.get('mma_graph_us')):>8s} {f(r.get('mma_graph_speedup'), '.2f'):>5s} "
                     f"{f(r.get('mma_best_graph_us')):>8s} {f(r.get('mma_best_graph_speedup'), '.2f'):>5s} "
                     f"{f(r.get('mma_best_graph_GBps'), '.0f'):>8s} | {f(r.get('torch_us')):>8s} "
                     f"{f(r.get('mma_us')):>8s} {f(r.get('mma_best_us')):>8s} {f(r.get('mma_best_speedup'), '.2f'):>5s} "
                     f"{f(r.get('mma_best_relerr'), '.1e'):>8s}  {r.get('best_gate_up')} + {r.get('best_down')}")
    for part in ("gate_up", "down"):
        names = list(res.get("mma_variants", {}).get(part, {}))
        lines.append(f"{part} kernel sweep, graph us per call (torch gate_up alone in the first column):")
        lines.append(f"{'case':12s} {'torch':>7s} " + " ".join(f"{n[:9]:>9s}" for n in names))
        for r in res.get("rows", []):
            sw = r.get(f"sweep_{part}_us", {})
            lines.append(f"{r['case']:12s} {f(r.get('torch_gate_up_us') if part == 'gate_up' else None):>7s} "
                         + " ".join(f"{f(sw.get(n)):>9s}" for n in names))
    lines.append(f"suggested DECODE_DISPATCH (graph times, fastest > torch): {res.get('suggested_dispatch')}; "
                 f"(>= 1.25x): {res.get('suggested_dispatch_1p25')}")
    for m, e, gcfg, dcfg, gn, dn_ in res.get("suggested_mma_tuned", []):
        lines.append(f"suggested MMA_TUNED rule: ({m}, {e}, {gcfg}, {dcfg})  # {gn} + {dn_}")
    for e in res.get("errors", []):
        lines.append(f"error: {e}")
    p = res.get("prefill", {})
    lines.append(f"prefill gate_up 375 rows/expert: bf16 grouped_mm {f(p.get('bf16_TFLOPs'))} TFLOP/s; fp8 rowwise "
                 f"scaled_grouped_mm {f(p.get('fp8_rowwise_TFLOPs'))} TFLOP/s {p.get('fp8_error', '')}")
    mxr = res.get("mx", {})
    lines.append(f"mx: all bit-identical = {mxr.get('all_identical')}; mxfp4 quantize 16M elems "
                 f"{f(mxr.get('mxfp4_quantize_4096x4096_us'))} us")
    return "\n".join(lines)


register_suite("moe_gemm", "MoE grouped SwiGLU (CuTe GEMV + tensor-core decode kernels vs torch._grouped_mm), "
               "prefill baselines, MX",
               gemm_table, min_gpus=1)(run_gemm)


# ---------------------------------------------------------------------------------------------- dispatch/combine


def run_a2a(cfg=None) -> dict:
    """The dispatch/combine suite: kernels/bench/moe_a2a.py (watchdog parent, bounded waits, one JSON per case).
    Case files go to $RACKBED_A2A_OUT (default: a fresh temporary directory); returns the summary."""
    from rackbed.kernels.bench import moe_a2a as moe_a2a_bench

    out = os.environ.get("RACKBED_A2A_OUT") or tempfile.mkdtemp(prefix="rackbed-a2a-")
    return moe_a2a_bench.run(out, echo=lambda *a, **k: print(*a, flush=True))


def a2a_table(res: dict) -> str:
    return res.get("table", "")


register_suite("moe_a2a", "decode DP-EP dispatch/combine over peer memory vs NCCL all_to_all_single", a2a_table,
               min_gpus=2)(run_a2a)

from rackbed.kernels.bench.suites import SUITES  # noqa: E402

if "moe_prefill_gemm" not in SUITES:  # kernels/bench/moe_prefill.py registers it (unless it is __main__)
    import rackbed.kernels.bench.moe_prefill  # noqa: E402,F401



def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="results JSON; one file per suite: OUT_<suite>.json")
    p.add_argument("--suite", action="append", choices=["moe_gemm", "moe_a2a", "moe_prefill_gemm"])
    p.add_argument("--force", action="store_true", help="replace existing OUT_<suite>.json files")
    a = p.parse_args(argv)
    from rackbed.kernels.bench.suites import BenchConfig, run_suites
    from rackbed.topology.outputs import entry_file

    t0 = time.time()
    base, ext = os.path.splitext(a.out)
    names = a.suite or ["moe_gemm", "moe_a2a"]
    outs = {n: f"{base}_{n}{ext or '.json'}" for n in names}
    for f in outs.values():  # before the benchmarks, not after them
        entry_file(f, force=a.force, default=True)
    for name in names:  # one JSON per suite, written as soon as it is done
        run_suites([name], BenchConfig(sizes=()), out=outs[name])
        print(f"{name} done at {time.time() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
