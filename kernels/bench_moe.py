"""MoE kernel benchmarks and device checks: grouped GEMM (decode + prefill baselines), MX kernels, and the decode
dispatch/combine over peer memory. Registers suites "moe_gemm" (1 GPU) and "moe_a2a" (2+ GPUs) in kernels.bench.

    python -m kernels.bench_moe --out results/h200x2/moe.json      # both suites, one command, table printed last

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

from kernels.bench import register_suite

D_MODEL, F_EXPERT, N_EXPERTS, TOP_K = 4096, 1536, 128, 8


def _meta() -> dict:
    from kernels.allreduce_bench import _meta as ar_meta

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
    """(name, counts list) for 128 experts: m tokens on E_act experts (spread), and routed decode batches."""
    from engine.core.moe import route

    cases = []
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


def run_gemm(cfg=None) -> dict:
    import torch

    from kernels import grouped_gemm as gg

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    res = {"meta": _meta(), "rows": [], "errors": [], "cute_unavailable": gg.cute_unavailable()}
    g = torch.Generator(device=dev).manual_seed(0)
    D, F, E = D_MODEL, F_EXPERT, N_EXPERTS
    gate_up = (torch.randn(E, 2 * F, D, device=dev, generator=g) * D ** -0.5).to(torch.bfloat16)
    down = (torch.randn(E, D, F, device=dev, generator=g) * F ** -0.5).to(torch.bfloat16)
    # the copy ceiling, measured here (bytes read + written)
    big = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    big2 = torch.empty_like(big)
    t = _time_us(lambda: big2.copy_(big), reps=10)
    res["hbm_copy_GBps_rw"] = 2 * big.numel() / t / 1e3
    del big, big2
    for name, counts_l in _gemm_cases():
        try:
            R = sum(counts_l)
            counts = torch.tensor(counts_l, device=dev, dtype=torch.int64)
            x = torch.randn(R, D, device=dev, generator=g).to(torch.bfloat16)
            ref = gg.grouped_swiglu_reference(x, gate_up, down, counts)
            row = {"case": name, "rows": R, "active_experts": sum(1 for c in counts_l if c),
                   "max_rows_per_expert": max(counts_l),
                   "bytes": gg.swiglu_weight_bytes(counts_l, D, F) + R * (2 * D + 2 * F) * 2,
                   "flops": gg.swiglu_flops(R, D, F)}
            row["torch_us"] = _time_us(lambda: gg.grouped_swiglu_torch(x, gate_up, down, counts))
            row["torch_relerr"] = _relerr(gg.grouped_swiglu_torch(x, gate_up, down, counts), ref)
            if res["cute_unavailable"] is None:
                act = torch.full((R, F), float("nan"), dtype=torch.bfloat16, device=dev)
                out = torch.full((R, D), float("nan"), dtype=torch.bfloat16, device=dev)
                gg.grouped_swiglu_cute(x, gate_up, down, counts, act_out=act, out=out)
                torch.cuda.synchronize()
                row["cute_relerr"] = _relerr(out, ref)
                row["cute_us"] = _time_us(lambda: gg.grouped_swiglu_cute(x, gate_up, down, counts, act_out=act,
                                                                          out=out))
                # phases: gate_up alone (torch grouped_mm vs fused kernel)
                offs = torch.cumsum(counts, 0).to(torch.int32)
                offs1 = gg.expert_offsets(counts)
                row["torch_gate_up_us"] = _time_us(lambda: torch._grouped_mm(x, gate_up.transpose(1, 2), offs=offs))
                row["cute_gate_up_us"] = _time_us(lambda: gg.gemv_launch(x, gate_up, offs1, act, True))
                row["speedup"] = row["torch_us"] / row["cute_us"]
                row["cute_GBps"] = row["bytes"] / row["cute_us"] / 1e3
            row["torch_GBps"] = row["bytes"] / row["torch_us"] / 1e3
            res["rows"].append(row)
        except Exception as exc:
            res["errors"].append(f"{name}: {type(exc).__name__}: {exc}")
            traceback.print_exc()
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

    from engine.core import formats as ref
    from kernels import mx

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
    lines = [f"HBM copy {f(res.get('hbm_copy_GBps_rw'), '.0f')} GB/s (r+w); cute: "
             f"{res.get('cute_unavailable') or 'ok'}; errors={len(res.get('errors', []))}",
             f"{'case':12s} {'rows':>5s} {'act_e':>5s} {'torch_us':>9s} {'cute_us':>8s} {'x':>5s} {'torchGB/s':>9s} "
             f"{'cuteGB/s':>8s} {'gu_t_us':>8s} {'gu_c_us':>8s} {'err_c':>8s}"]
    for r in res.get("rows", []):
        lines.append(f"{r['case']:12s} {r['rows']:5d} {r['active_experts']:5d} {f(r.get('torch_us')):>9s} "
                     f"{f(r.get('cute_us')):>8s} {f(r.get('speedup'), '.2f'):>5s} {f(r.get('torch_GBps'), '.0f'):>9s} "
                     f"{f(r.get('cute_GBps'), '.0f'):>8s} {f(r.get('torch_gate_up_us')):>8s} "
                     f"{f(r.get('cute_gate_up_us')):>8s} {f(r.get('cute_relerr'), '.1e'):>8s}")
    p = res.get("prefill", {})
    lines.append(f"prefill gate_up 375 rows/expert: bf16 grouped_mm {f(p.get('bf16_TFLOPs'))} TFLOP/s; fp8 rowwise "
                 f"scaled_grouped_mm {f(p.get('fp8_rowwise_TFLOPs'))} TFLOP/s {p.get('fp8_error', '')}")
    mxr = res.get("mx", {})
    lines.append(f"mx: all bit-identical = {mxr.get('all_identical')}; mxfp4 quantize 16M elems "
                 f"{f(mxr.get('mxfp4_quantize_4096x4096_us'))} us")
    return "\n".join(lines)


register_suite("moe_gemm", "MoE grouped SwiGLU (CuTe decode kernel vs torch._grouped_mm), prefill baselines, MX",
               gemm_table, min_gpus=1)(run_gemm)


# ---------------------------------------------------------------------------------------------- dispatch/combine


def _a2a_worker(rank: int, world: int, port: int, path: str, tokens: list[int]) -> None:
    import torch
    import torch.distributed as dist

    from engine.core.moe import route
    from kernels.moe_a2a import PeerMoeAllToAll, emulate

    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            device_id=dev)
    res = {"rows": [], "errors": [], "checks": []}
    D, k, E, TM = D_MODEL, TOP_K, N_EXPERTS, 128
    try:
        a2a = PeerMoeAllToAll(None, max_tokens=TM, hidden=D, top_k=k, n_experts=E, backend="auto")
        ref_a2a = PeerMoeAllToAll(None, max_tokens=TM, hidden=D, top_k=k, n_experts=E, backend="torch")
        res["backend"], res["fallback_reason"] = a2a.backend, a2a.fallback_reason
        print(f"[rank {rank}] a2a backend {a2a.backend} ({a2a.fallback_reason})", flush=True)
        o1, o2 = a2a.alloc_outputs(), ref_a2a.alloc_outputs()
        for T in tokens:
            for trial, dist_kind in enumerate(("uniform", "zipf", "one")):
                rng = np.random.default_rng(100 * T + 10 * trial + rank)
                if dist_kind == "one":  # every token on experts 0..7 (all on rank 0)
                    ids = np.tile(np.arange(k), (T, 1))
                    w = np.full((T, k), 1 / k)
                else:
                    r = route(T, E, k, dist=dist_kind, zipf_s=1.2, rng=rng)
                    ids, w = r.topk_ids, r.topk_weights
                x = torch.randn(T, D, device=dev).to(torch.bfloat16)
                ti = torch.tensor(ids, dtype=torch.int32, device=dev).reshape(T, k)
                tw = torch.tensor(w, dtype=torch.float32, device=dev).reshape(T, k)
                for o in (o1, o2):
                    o["x"].fill_(float("nan"))
                    o["ids"].fill_(-7)
                a2a.dispatch(x, ti, tw, o1)
                ref_a2a.dispatch(x, ti, tw, o2)
                torch.cuda.synchronize()
                cnt = o2["counts"].cpu().tolist()
                ok = o1["counts"].cpu().tolist() == cnt and torch.equal(o1["ids"], o2["ids"]) \
                    and torch.equal(o1["weights"], o2["weights"])
                for s in range(world):
                    a, b = s * TM, s * TM + cnt[s]
                    ok = ok and torch.equal(o1["x"][a:b], o2["x"][a:b])
                # experts stand-in: y = x * (sum of the row's weights on local experts) (weighted, like the engine)
                per = E // world
                lw = torch.where((o2["ids"] >= rank * per) & (o2["ids"] < (rank + 1) * per), o2["weights"], 0).sum(1)
                xr = torch.nan_to_num(o2["x"].float(), nan=0.0)
                y = (xr * lw[:, None]).to(torch.bfloat16).contiguous()
                out1 = torch.full((T, D), float("nan"), dtype=torch.bfloat16, device=dev)
                out2 = torch.empty_like(out1)
                a2a.combine(y, out1, T)
                ref_a2a.combine(y, out2, T)
                torch.cuda.synchronize()
                ok_c = torch.equal(out1, out2)
                # the CPU emulation / engine reference on gathered inputs
                xs = [torch.empty(T, D, dtype=torch.bfloat16, device=dev) for _ in range(world)]
                dist.all_gather(xs, x)
                rel = _relerr(out2.float(), (x.float() * torch.tensor(w.sum(1), device=dev, dtype=torch.float32)[:, None]))
                print(f"[rank {rank}] check T={T} {dist_kind}: dispatch {ok} combine {ok_c} rel {rel:.1e}", flush=True)
                res["checks"].append({"T": T, "routing": dist_kind, "dispatch_equal_torch": bool(ok),
                                      "combine_equal_torch": bool(ok_c), "relerr_vs_x_times_wsum": rel})
        a2a.check_error()
        # timing: graphs of ITERS calls; dispatch-only and dispatch+combine; NCCL all_to_all_single baseline
        ITERS = 20
        for T in tokens:
            rng = np.random.default_rng(7 + rank)
            r = route(T, E, k, rng=rng)
            x = torch.randn(T, D, device=dev).to(torch.bfloat16)
            ti = torch.tensor(r.topk_ids, dtype=torch.int32, device=dev)
            tw = torch.tensor(r.topk_weights, dtype=torch.float32, device=dev)
            y = torch.randn(world * TM, D, device=dev).to(torch.bfloat16)
            outc = torch.empty(T, D, dtype=torch.bfloat16, device=dev)
            row = {"T": T}

            def disp():
                a2a.dispatch(x, ti, tw, o1)

            def both():
                a2a.dispatch(x, ti, tw, o1)
                a2a.combine(y, outc, T)

            for name, fn in (("dispatch", disp), ("dispatch_combine", both)):
                for _ in range(2):
                    fn()
                torch.cuda.synchronize()
                dist.barrier()
                gr = torch.cuda.CUDAGraph()
                with torch.cuda.graph(gr):
                    for _ in range(ITERS):
                        fn()
                dist.barrier()
                row[f"{name}_graph_us"] = _time_us(gr.replay, reps=10, warmup=2) / ITERS
                dist.barrier()
                row[f"{name}_eager_us"] = _time_us(fn, reps=10, warmup=2, iters=ITERS)
            row["combine_graph_us"] = row["dispatch_combine_graph_us"] - row["dispatch_graph_us"]
            # NCCL: the same x rows (dispatch payload bytes) with real splits, host counts known in advance
            from kernels.moe_a2a import destinations

            goes = destinations(r.topk_ids, world, E // world)
            send = [int(goes[:, j].sum()) for j in range(world)]
            sc = torch.tensor(send, device=dev)
            rc = torch.empty_like(sc)
            dist.all_to_all_single(rc, sc)
            recv = rc.cpu().tolist()
            rows_t = torch.tensor(np.concatenate([np.flatnonzero(goes[:, j]) for j in range(world)]), device=dev,
                                  dtype=torch.long)
            sendx = x[rows_t].contiguous()
            recvx = torch.empty(sum(recv), D, dtype=torch.bfloat16, device=dev)
            nccl = lambda: dist.all_to_all_single(recvx, sendx, recv, send)  # noqa: E731
            for _ in range(3):
                nccl()
            torch.cuda.synchronize()
            dist.barrier()
            row["nccl_a2a_eager_us"] = _time_us(nccl, reps=10, warmup=2, iters=ITERS)
            try:
                gr = torch.cuda.CUDAGraph()
                with torch.cuda.graph(gr):
                    for _ in range(ITERS):
                        nccl()
                dist.barrier()
                row["nccl_a2a_graph_us"] = _time_us(gr.replay, reps=10, warmup=2) / ITERS
            except Exception as exc:
                row["nccl_graph_error"] = str(exc)[:200]
            row["dispatch_bytes_per_rank"] = int(goes.sum()) * D * 2
            print(f"[rank {rank}] timed T={T}: {row}", flush=True)
            res["rows"].append(row)
        a2a.check_error()
    except Exception as exc:
        res["errors"].append(f"rank {rank}: {type(exc).__name__}: {exc}")
        traceback.print_exc()
    allres = [None] * world
    dist.all_gather_object(allres, res)
    if rank == 0:
        out = allres[0]
        out["meta"] = _meta()
        out["errors"] = sum((r["errors"] for r in allres), [])
        out["checks_ok"] = all(c["dispatch_equal_torch"] and c["combine_equal_torch"]
                               for r in allres for c in r["checks"]) and bool(allres[0]["checks"])
        for i, row in enumerate(out["rows"]):  # max over ranks
            for key in list(row):
                if key.endswith("_us"):
                    row[key] = max(r["rows"][i][key] for r in allres if i < len(r["rows"]) and key in r["rows"][i])
        with open(path, "w") as f:
            json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()


def run_a2a(cfg=None) -> dict:
    import torch
    import torch.multiprocessing as mp

    from kernels.bench import _free_port

    world = min(torch.cuda.device_count(), 2)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "a2a.json")
        mp.spawn(_a2a_worker, args=(world, _free_port(), path, [1, 8, 32, 64, 128]), nprocs=world, join=True)
        with open(path) as f:
            return json.load(f)


def a2a_table(res: dict) -> str:
    f = (lambda v, s=".1f": "-" if v is None else format(v, s))
    lines = [f"backend {res.get('backend')} ({res.get('fallback_reason') or 'ok'}); checks_ok={res.get('checks_ok')}; "
             f"errors={len(res.get('errors', []))}",
             f"{'T':>4s} {'disp_g_us':>9s} {'comb_g_us':>9s} {'d+c_g_us':>9s} {'d+c_e_us':>9s} {'nccl_g_us':>9s} "
             f"{'nccl_e_us':>9s} {'bytes':>8s}"]
    for r in res.get("rows", []):
        lines.append(f"{r['T']:4d} {f(r.get('dispatch_graph_us')):>9s} {f(r.get('combine_graph_us')):>9s} "
                     f"{f(r.get('dispatch_combine_graph_us')):>9s} {f(r.get('dispatch_combine_eager_us')):>9s} "
                     f"{f(r.get('nccl_a2a_graph_us')):>9s} {f(r.get('nccl_a2a_eager_us')):>9s} "
                     f"{r.get('dispatch_bytes_per_rank', 0):8d}")
    return "\n".join(lines)


register_suite("moe_a2a", "decode DP-EP dispatch/combine over peer memory vs NCCL all_to_all_single", a2a_table,
               min_gpus=2)(run_a2a)


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    p.add_argument("--suite", action="append", choices=["moe_gemm", "moe_a2a"])
    a = p.parse_args(argv)
    from kernels.bench import BenchConfig, run_suites

    t0 = time.time()
    base, ext = os.path.splitext(a.out)
    for name in a.suite or ["moe_gemm", "moe_a2a"]:  # one JSON per suite, written as soon as it is done
        run_suites([name], BenchConfig(sizes=()), out=f"{base}_{name}{ext or '.json'}")
        print(f"{name} done at {time.time() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
