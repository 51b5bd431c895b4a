"""Decode step of the real engine against its HBM roofline, on one GPU (``python -m engine.real.bench_decode``).

For each batch size the step's bytes are counted from the model: attention projections and norms of every layer,
the router, the weights of every expert the step's routing actually touched (counted from the routing of the timed
steps), the LM head, and the KV cache read (batch x context x KV bytes per token). The roofline is those bytes over
the HBM bandwidth measured in the same run (device-to-device copy, read + write). The step runs once with each
grouped-GEMM implementation (torch._grouped_mm, and the CuTe DSL decode kernel through ``auto``) — the kernels'
before/after on the engine's own decode step.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def hbm_copy_GBps(device, n_bytes: int = 4 << 30, reps: int = 10) -> float:
    a = torch.empty(n_bytes // 2, dtype=torch.bfloat16, device=device).normal_()
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        b.copy_(a)
        e1.record()
        torch.cuda.synchronize()
        ts.append(e0.elapsed_time(e1) / 1e3)
    del a, b
    return 2 * n_bytes / statistics.median(ts) / 1e9


def main(argv=None) -> int:
    import engine.real.model as M
    from engine.core.model import get_model
    from engine.real.comm import Comm
    from sim.scenario import truncate_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3-235b-a22b")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--impls", nargs="+", default=["torch", "auto"])
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    dev = torch.device("cuda:0")
    spec = truncate_model(get_model(a.model), a.layers)
    cfg = M.TorchModelConfig.from_spec(spec)
    bw = hbm_copy_GBps(dev)
    model = M.ShardedQwen3Moe.random(cfg, M.Shard(), Comm(), seed=0, device=dev, dtype=torch.bfloat16)
    S = 64
    max_b = max(a.batches)
    pages_per = -(-(a.context + 1) // S)
    cache = model.new_cache(max_b * pages_per + 1, S)
    touched: list[int] = []
    orig_route = model._route

    def route(w, h):
        ids, wts = orig_route(w, h)
        touched.append(int(torch.unique(ids).numel()))
        return ids, wts

    model._route = route
    Dh, D, E = cfg.head_dim, cfg.hidden, cfg.n_experts
    attn_b = (cfg.n_q_heads * Dh * D * 2 + cfg.n_kv_heads * Dh * D * 2 + 2 * Dh + 2 * D) * 2
    expert_b = 3 * D * cfg.moe_intermediate * 2
    router_b = E * D * 2
    head_b = cfg.vocab * D * 2 + D * 2
    rows = []
    for impl in a.impls:
        M.GROUPED_IMPL = impl
        for b in a.batches:
            table = torch.arange(b * pages_per, device=dev).view(b, pages_per)
            tok = torch.randint(0, cfg.vocab, (b,), device=dev)
            pos = torch.full((b,), a.context, device=dev)
            for _ in range(3):
                model.forward_decode(tok, pos, cache, table)
            torch.cuda.synchronize()
            touched.clear()
            ts = []
            for _ in range(a.reps):
                t0 = time.perf_counter()
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                model.forward_decode(tok, pos, cache, table)
                e1.record()
                torch.cuda.synchronize()
                ts.append(e0.elapsed_time(e1) / 1e3)
            step_s = statistics.median(ts)
            experts = statistics.mean(touched)  # distinct experts per layer per step
            kv_b = b * (a.context + 1) * cfg.kv_bytes_per_token(2)
            w_b = cfg.n_layers * (attn_b + router_b + experts * expert_b) + head_b
            total = w_b + kv_b
            roof = total / (bw * 1e9)
            rows.append({"impl": impl, "batch": b, "context": a.context, "step_ms": step_s * 1e3,
                         "experts_touched_per_layer": experts, "weight_bytes": w_b, "kv_bytes": kv_b,
                         "roofline_ms": roof * 1e3, "ratio_to_roofline": step_s / roof})
            print(f"{impl:6s} b={b:3d} step {step_s * 1e3:7.2f} ms  roofline {roof * 1e3:7.2f} ms  "
                  f"x{step_s / roof:4.2f}  experts/layer {experts:5.1f}", flush=True)
    doc = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "cuda": torch.version.cuda,
           "date": time.strftime("%Y-%m-%d"), "model": spec.name, "hbm_copy_GBps_rw": bw, "rows": rows,
           "bytes_model": "weights of every layer's attention/router + touched experts + LM head + KV read "
                          "(batch x (context+1) x KV bytes/token); roofline = bytes / measured copy bandwidth"}
    if a.out:
        with open(a.out, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
