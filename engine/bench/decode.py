"""Decode step of the real engine against its HBM roofline, on one GPU (``python -m rackbed.engine.bench.decode``).

For each batch size the step's bytes are counted from the model: attention projections and norms of every layer,
the router, the weights of every expert the step's routing actually touched (counted from the routing of the timed
steps), the LM head, and the KV cache read (batch x context x KV bytes per token). The roofline is those bytes over
the HBM bandwidth measured in the same run (device-to-device copy, read + write). The step runs once with each
grouped-GEMM implementation (torch._grouped_mm, and the CuTe DSL decode kernel through ``auto``) and each decode
attention (``triton``: ``kernels.paged_attention`` reading the pages in place; ``torch``: the gather path) — the
kernels' before/after on the engine's own decode step, in one run. ``attention_check`` compares one step's logits
of the two attention paths (bf16).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from rackbed.topology.outputs import add_force, entry_file, write_text


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


def profile_step(model, cache, cfg, dev, b: int, context: int, pages_per: int) -> dict:
    """CUDA time per decode step by kernel (torch.profiler over 3 eager steps): the gap to the roofline, term by
    term. Never raises: a failed profile is reported, the timings are kept."""
    try:
        from torch.profiler import ProfilerActivity, profile

        table = torch.arange(8, 8 + b * pages_per, device=dev).view(b, pages_per)
        tok = torch.randint(0, cfg.vocab, (b,), device=dev)
        pos = torch.full((b,), context, device=dev)
        model.forward_decode(tok, pos, cache, table)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(3):
                model.forward_decode(tok, pos, cache, table)
            torch.cuda.synchronize()
        rows = []
        for ev in prof.key_averages():
            dev_us = getattr(ev, "device_time_total", None) or getattr(ev, "cuda_time_total", 0) or 0
            if "CUDA" in str(getattr(ev, "device_type", "")) and dev_us > 0:
                rows.append({"kernel": ev.key[:120], "calls_per_step": ev.count / 3, "us_per_step": dev_us / 3})
        rows.sort(key=lambda r: -r["us_per_step"])
        busy = sum(r["us_per_step"] for r in rows)
        n = sum(r["calls_per_step"] for r in rows)
        print(f"profile b={b}: GPU busy {busy / 1e3:.2f} ms/step over {n:.0f} kernels", flush=True)
        for r in rows[:6]:
            print(f"   {r['us_per_step'] / 1e3:7.2f} ms  x{r['calls_per_step']:5.0f}  {r['kernel'][:70]}", flush=True)
        return {"gpu_busy_us_per_step": busy, "kernels_per_step": n, "top": rows[:15]}
    except Exception as exc:
        print(f"profile b={b} failed: {type(exc).__name__}: {exc}", flush=True)
        return {"error": f"{type(exc).__name__}: {exc}"}


def set_attention(attn: str) -> None:
    """Decode attention for the following steps: ``triton`` (``kernels.paged_attention``) or ``torch`` (gather)."""
    import os

    if attn not in ("triton", "torch"):
        raise SystemExit(f"attention {attn!r}: must be triton or torch")
    os.environ["RACKBED_PAGED_ATTENTION"] = attn


def parse_mode(mode: str, default_impl: str = "auto") -> tuple[str, str, str]:
    """``execution[:grouped-impl[:attention]]`` -> (execution, impl, attention); attention defaults to triton."""
    parts = mode.split(":")
    if parts[0] not in ("eager", "graph") or len(parts) > 3:
        raise SystemExit(f"mode {mode!r}: expected eager|graph[:impl[:triton|torch]]")
    return parts[0], parts[1] if len(parts) > 1 else default_impl, parts[2] if len(parts) > 2 else "triton"


def layer0_attention_errors(model, cache, tok, pos, table) -> dict:
    """The first layer's decode attention on the step's own queries and cache: each path (Triton kernel, torch
    gather) against an fp32 computation of the same attention, as the largest error relative to the output's
    scale. (Whole-step logits of a random-weight model amplify any rounding difference: this is the check.)"""
    from rackbed.engine.real import layers_mla
    from rackbed.engine.real.model import rms_norm
    from rackbed.kernels.paged_attention import gqa_decode, mla_decode

    cfg, w = model.cfg, model.layers[0]
    with torch.inference_mode():
        h = rms_norm(model.glob["embed"][tok], w["input_norm"], cfg.rms_eps)
        st = cache.storage[0]
        L = table.shape[1] * cache.page_tokens
        allowed = torch.arange(L, device=tok.device)[None, :] <= pos[:, None]          # [B, L]
        if hasattr(cfg, "kind") and cfg.kind(0) == "mla":
            q_nope, q_rot, _ = layers_mla.project(w, h, pos, cfg, model.rope)
            w_uk, _ = layers_mla.absorbed(w, cfg)
            q = torch.cat((torch.einsum("bhn,hnc->bhc", q_nope, w_uk), q_rot), -1)        # [B, H, W]
            ctx = st[table].reshape(q.shape[0], L, -1)
            C = cfg.kv_lora_rank
            s = torch.matmul(q.float(), ctx.float().transpose(1, 2)) * cfg.softmax_scale
            ref = torch.softmax(s.masked_fill(~allowed[:, None], float("-inf")), -1) @ ctx.float()[..., :C]
            s_t = torch.matmul(q, ctx.transpose(1, 2)).float() * cfg.softmax_scale
            torch_out = torch.softmax(s_t.masked_fill(~allowed[:, None], float("-inf")), -1).to(q.dtype) \
                @ ctx[..., :C]
            kern = mla_decode(q, st, table, pos, cfg.softmax_scale, C)
        else:
            q, _, _ = model._qkv(w, h, pos)                                              # [Hq, B, Dh]
            B, Hq, Dh = q.shape[1], q.shape[0], q.shape[2]
            Hkv = st.shape[2]
            K = st[table][:, :, 0].permute(0, 2, 1, 3, 4).reshape(B, Hkv, L, Dh).float()
            V = st[table][:, :, 1].permute(0, 2, 1, 3, 4).reshape(B, Hkv, L, Dh).float()
            qg = q.transpose(0, 1).reshape(B, Hkv, Hq // Hkv, Dh).float()
            s = torch.matmul(qg, K.transpose(-1, -2)) * model.scale
            ref = (torch.softmax(s.masked_fill(~allowed[:, None, None], float("-inf")), -1) @ V).reshape(B, -1)
            torch_out = model._paged_attention(q, st[table], allowed)
            kern = gqa_decode(q.transpose(0, 1), st, table, pos, model.scale)
        ref = ref.reshape(ref.shape[0], -1)
        scale = ref.abs().max().item() or 1.0
        return {"triton_vs_fp32": (kern.reshape(ref.shape).float() - ref).abs().max().item() / scale,
                "torch_vs_fp32": (torch_out.reshape(ref.shape).float() - ref).abs().max().item() / scale}


def attention_check(model, cache, tok, pos, table) -> dict:
    """One eager decode step's logits with the Triton attention against the torch gather path, same inputs (the
    step rewrites the same KV at ``pos``): largest difference relative to the logits' scale, and the share of rows
    whose greedy token agrees; plus the first layer's attention of each path against fp32
    (:func:`layer0_attention_errors`)."""
    out = {}
    for attn in ("torch", "triton"):
        set_attention(attn)
        with torch.inference_mode():
            out[attn] = model.forward_decode(tok, pos, cache, table).float()
    diff = (out["triton"] - out["torch"]).abs().max().item()
    scale = out["torch"].abs().max().item() or 1.0
    same = (out["triton"].argmax(-1) == out["torch"].argmax(-1)).float().mean().item()
    return {"max_abs_diff": diff, "max_rel_to_logit_scale": diff / scale, "argmax_agree": same,
            "layer0": layer0_attention_errors(model, cache, tok, pos, table)}


def graph_step_overhead(runner, tok, pos, table, reps: int = 20) -> dict:
    """Where a graph-replayed decode step's time goes beyond its kernels: ``replay_us`` (CUDA events around the
    captured graph's replay alone), ``kernels_us`` (the sum of the kernels' own durations in one replay, from the
    profiler's trace: ``n_kernels`` of them), ``gaps_us`` = replay - kernels (launch gaps inside the graph);
    ``call_us`` (events around the runner's whole call: the bucket's input copies + the replay), ``host_call_us``
    (host wall time until the call returns: what the host spends enqueueing a step; the device may still be busy)
    and ``host_step_us`` (call + wait for the device). Never raises: a failed profile is reported."""
    out: dict = {}
    try:
        from torch.profiler import ProfilerActivity, profile

        runner(tok, pos, table)
        torch.cuda.synchronize()
        key = (runner._bucket(tok.shape[0], runner.BATCH_BUCKETS), -(-table.shape[1] // runner.PAGE_ROUND) * runner.PAGE_ROUND)
        g = runner.graphs[key][0] if runner.mode == "graph" and key in runner.graphs else None
        ev = lambda: torch.cuda.Event(enable_timing=True)
        for what, fn in (("replay_us", g.replay if g is not None else None),
                         ("call_us", lambda: runner(tok, pos, table))):
            if fn is None:
                continue
            ts = []
            for _ in range(reps):
                e0, e1 = ev(), ev()
                e0.record()
                fn()
                e1.record()
                torch.cuda.synchronize()
                ts.append(e0.elapsed_time(e1) * 1e3)
            out[what] = statistics.median(ts)
        hc, hs = [], []
        for _ in range(reps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            runner(tok, pos, table)
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            hc.append((t1 - t0) * 1e6)
            hs.append((time.perf_counter() - t0) * 1e6)
        out.update(host_call_us=statistics.median(hc), host_step_us=statistics.median(hs))
        if g is not None:
            n = 3
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(n):
                    g.replay()
                torch.cuda.synchronize()
            ks = [e for e in prof.profiler.kineto_results.events()
                  if e.device_type() == torch.autograd.DeviceType.CUDA]
            out["kernels_us"] = sum(e.duration_ns() for e in ks) / 1e3 / n
            out["n_kernels"] = len(ks) / n
            out["gaps_us"] = out["replay_us"] - out["kernels_us"]
    except Exception as exc:  # noqa: BLE001 — reported, the timings are kept
        out["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
    return out


def main(argv=None) -> int:
    import rackbed.engine.real.model as M
    from rackbed.engine.core.model import get_model
    from rackbed.engine.real.comm import Comm
    from rackbed.sim.scenario import truncate_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen3-235b-a22b")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--modes", nargs="+", default=["graph:auto:torch", "graph:auto:triton"],
                    help="execution:grouped-GEMM impl[:attention], execution in eager|graph (CUDA graph of the static "
                         "step), attention triton (default) | torch")
    ap.add_argument("--profile-batches", type=int, nargs="*", default=[1, 64],
                    help="eager steps to profile with torch.profiler: CUDA time by kernel, the term-by-term gap")
    ap.add_argument("--overhead", action="store_true",
                    help="graph modes: per batch, the replay's time against the sum of its kernels and the host's "
                         "time per call (graph_step_overhead)")
    ap.add_argument("--out", default=None)
    add_force(ap, "replace an existing --out file")
    a = ap.parse_args(argv)
    if a.out:  # before the benchmark, not after it
        entry_file(a.out, force=a.force)
    dev = torch.device("cuda:0")
    spec = truncate_model(get_model(a.model), a.layers)
    cfg = M.TorchModelConfig.from_spec(spec)
    bw = hbm_copy_GBps(dev)
    model = M.ShardedQwen3Moe.random(cfg, M.Shard(), Comm(), seed=0, device=dev, dtype=torch.bfloat16)
    S = 64
    max_b = max(a.batches)
    pages_per = -(-(a.context + 1) // S)
    cache = model.new_cache(max_b * pages_per + 8, S)   # pages 0..7: graph runners' scratch pages
    cache.storage.normal_(0, 1)                         # KV values that make the attention check meaningful
    touched: list[int] = []
    orig_route = model._route

    def route(w, h):
        ids, wts = orig_route(w, h)
        touched.append(int(torch.unique(ids).numel()))
        return ids, wts

    model._route = route
    D, E = cfg.hidden, cfg.n_experts
    attn_b = (cfg.attention.params() + 2 * D) * 2  # q, k, v, o, qk norms + the layer's two RMSNorms, bf16
    expert_b = 3 * D * cfg.moe_intermediate * 2
    router_b = E * D * 2
    head_b = cfg.vocab * D * 2 + D * 2
    rows = []
    runner = None
    checks = {}
    for mode in a.modes:
        execution, impl, attn = parse_mode(mode)
        M.GROUPED_IMPL = impl
        set_attention(attn)
        if execution == "graph":
            runner = M.DecodeGraphRunner(model, cache)   # fresh graphs for this impl
            step = runner  # the graph runner takes (tokens, positions, page_table)
        else:
            step = lambda tok, pos, table: model.forward_decode(tok, pos, cache, table)
        for b in a.batches:
            table = torch.arange(8, 8 + b * pages_per, device=dev).view(b, pages_per)
            tok = torch.randint(0, cfg.vocab, (b,), device=dev)
            pos = torch.full((b,), a.context, device=dev)
            model._route = orig_route          # graph capture must not see the counting hook
            for _ in range(3):
                step(tok, pos, table)
            torch.cuda.synchronize()
            touched.clear()
            model._route = route
            model.forward_decode(tok, pos, cache, table)   # one eager step counts the experts touched
            torch.cuda.synchronize()
            model._route = orig_route
            ts = []
            for _ in range(a.reps):
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                step(tok, pos, table)
                e1.record()
                torch.cuda.synchronize()
                ts.append(e0.elapsed_time(e1) / 1e3)
            step_s = statistics.median(ts)
            if str(b) not in checks:
                checks[str(b)] = attention_check(model, cache, tok, pos, table)
                set_attention(attn)
            experts = statistics.mean(touched) if touched else float("nan")  # distinct experts per layer
            kv_b = b * (a.context + 1) * cfg.kv_bytes_per_token(2)
            w_b = cfg.n_layers * (attn_b + router_b + experts * expert_b) + head_b
            total = w_b + kv_b
            roof = total / (bw * 1e9)
            over = graph_step_overhead(runner, tok, pos, table) if a.overhead and execution == "graph" else None
            if over is not None:
                print(f"{mode:12s} b={b:3d} overhead: " + ", ".join(f"{k} {v:.1f}" if isinstance(v, float) else
                                                                   f"{k} {v}" for k, v in over.items()), flush=True)
            rows.append({"overhead": over} if over is not None else {})
            rows[-1].update({"mode": mode, "graph_mode": runner.mode if execution == "graph" else "eager",
                         "graph_fallback_reason": runner.why if execution == "graph" else "", "batch": b, "context": a.context, "step_ms": step_s * 1e3,
                         "experts_touched_per_layer": experts, "weight_bytes": w_b, "kv_bytes": kv_b,
                         "roofline_ms": roof * 1e3, "ratio_to_roofline": step_s / roof})
            print(f"{mode:12s} b={b:3d} step {step_s * 1e3:7.2f} ms  roofline {roof * 1e3:7.2f} ms  "
                  f"x{step_s / roof:4.2f}  experts/layer {experts:5.1f}", flush=True)
    M.GROUPED_IMPL = "auto"
    profiles = {str(b): profile_step(model, cache, cfg, dev, b, a.context, pages_per) for b in a.profile_batches}
    doc = {"attention_check": checks, "profiles": profiles, "device": torch.cuda.get_device_name(0), "torch": torch.__version__, "cuda": torch.version.cuda,
           "date": time.strftime("%Y-%m-%d"), "model": spec.name, "hbm_copy_GBps_rw": bw, "rows": rows,
           "bytes_model": "weights of every layer's attention/router + touched experts + LM head + KV read "
                          "(batch x (context+1) x KV bytes/token); roofline = bytes / measured copy bandwidth"}
    if a.out:
        write_text(a.out, json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
