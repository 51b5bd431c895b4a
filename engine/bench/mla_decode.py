"""One decode step of a DeepSeek-V3-width model on one GPU against its HBM roofline
(``python -m rackbed.engine.bench.mla_decode --out OUT.json``).

The model is the real engine's (``engine.real.families.ShardedMoeLM``) with random bf16 weights: ``--layers`` MoE
layers (no dense first layers) of DeepSeek-V3's width -- hidden 7168, MLA with 128 heads run as DP attention (all
heads on this GPU, absorbed decode over the latent paged cache, 576 values per token and layer), 256 routed experts
top-8 with grouped routing and the shared expert -- plus embedding and LM head. Each batch size runs at
``--context`` tokens per sequence, eagerly and as a CUDA graph of the static step (``DecodeGraphRunner``).

Bytes per step: every layer's MLA projections and norms, the router, the shared expert, the routed experts the
step's routing touched (counted from an eager step's routing), the LM head, and the latent cache read
(batch x (context+1) x 576 x 2 bytes per layer). The roofline is those bytes over the H200's HBM bandwidth as
specified (4.8 TB/s) and as measured in the same run (device-to-device copy, read + write). The JSON records the
device, torch version, date, command line, times and both ratios.

``--tiny --device cpu`` runs the same code on a tiny config (the smoke test; no graphs, no roofline meaning).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from rackbed.topology.outputs import add_force, entry_file, write_text

H200_HBM_SPEC_GBPS = 4800.0


def _config(a):
    from rackbed.engine.core.model import get_model
    from rackbed.engine.real.config import TorchModelConfig

    if a.tiny:
        n = a.layers
        return TorchModelConfig(hidden=64, n_layers=n, n_q_heads=4, n_kv_heads=4, head_dim=24, n_experts=16, top_k=4,
                                moe_intermediate=32, vocab=256, family="deepseek_v3", layer_kinds=("mla",) * n,
                                shared_intermediate=32, n_group=4, topk_group=2, routed_scaling=2.5, qk_norm=False,
                                q_lora_rank=48, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
                                v_head_dim=16, rope_interleave=True, rope_theta=10000.0)
    return TorchModelConfig.from_spec(get_model(a.model), n_layers=a.layers, dense_layers=())


def _bytes(cfg, experts_touched: float, batch: int, context: int, eb: int = 2) -> tuple[int, int]:
    """(weight bytes, latent KV bytes) one decode step reads."""
    D, E = cfg.hidden, cfg.n_experts
    att = cfg.attention
    layer = (att.proj_params() + att.small_params() + 2 * D + E * D + 3 * D * cfg.shared_intermediate) * eb + E * 4
    layer += experts_touched * 3 * D * cfg.moe_intermediate * eb
    weights = cfg.n_layers * layer + (cfg.vocab * D + D) * eb
    kv = cfg.n_layers * batch * (context + 1) * att.kv_values_per_token() * eb
    return int(weights), int(kv)


def _copy_GBps(dev) -> float:
    if dev.type == "cuda":
        from rackbed.engine.bench.decode import hbm_copy_GBps

        return hbm_copy_GBps(dev)
    a = torch.randn(1 << 22)
    b = torch.empty_like(a)
    t0 = time.perf_counter()
    b.copy_(a)
    return 2 * a.numel() * 4 / max(time.perf_counter() - t0, 1e-9) / 1e9


def _time(step, dev, reps: int) -> float:
    ts = []
    for _ in range(reps):
        if dev.type == "cuda":
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            step()
            e1.record()
            torch.cuda.synchronize()
            ts.append(e0.elapsed_time(e1) / 1e3)
        else:
            t0 = time.perf_counter()
            step()
            ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def main(argv=None) -> int:
    from rackbed.engine.real.comm import Comm
    from rackbed.engine.real.families import ShardedMoeLM
    from rackbed.engine.real.model import DecodeGraphRunner, Shard

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="deepseek-v3")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--context", type=int, default=4096)
    ap.add_argument("--batches", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--modes", nargs="+", default=None,
                    help="execution[:grouped-GEMM impl[:attention]]: eager|graph, impl auto|torch|cute_mma|..., "
                         "attention triton|torch (default: eager and graph on CUDA, auto, triton)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true", help="a tiny config (CPU smoke test)")
    ap.add_argument("--out", default=None)
    add_force(ap, "replace an existing --out file")
    ap.add_argument("--profile", action="store_true",
                    help="also record CUDA time per step by kernel (engine.bench.decode.profile_step) at the first batch size")
    a = ap.parse_args(argv)
    if a.out:  # before the benchmark, not after it
        entry_file(a.out, force=a.force)
    dev = torch.device(a.device)
    modes = a.modes or (["eager", "graph"] if dev.type == "cuda" else ["eager"])
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    cfg = _config(a)
    bw = _copy_GBps(dev)
    model = ShardedMoeLM.random(cfg, Shard(), Comm(), seed=0, device=dev, dtype=dtype)
    S = 64
    pages_per = -(-(a.context + 1) // S)
    cache = model.new_cache(max(a.batches) * pages_per + 8, S)          # pages 0..7: the graph runner's scratch
    cache.storage.normal_(0, 1)
    touched: list[int] = []
    orig_route = model._route

    def counting_route(w, h):
        ids, wts = orig_route(w, h)
        touched.append(int(torch.unique(ids).numel()))
        return ids, wts

    import rackbed.engine.real.model as M
    from rackbed.engine.bench.decode import attention_check, parse_mode, set_attention

    rows, checks = [], {}
    for mode in modes:
        execution, impl, attn = parse_mode(mode)
        M.GROUPED_IMPL = impl
        set_attention(attn)
        runner = DecodeGraphRunner(model, cache) if execution == "graph" else None
        for b in a.batches:
            table = torch.arange(8, 8 + b * pages_per, device=dev).view(b, pages_per)
            tok = torch.randint(0, cfg.vocab, (b,), device=dev)
            pos = torch.full((b,), a.context, device=dev)
            step = (lambda: runner(tok, pos, table)) if runner else (
                lambda: model.forward_decode(tok, pos, cache, table))
            with torch.inference_mode():
                for _ in range(2):
                    step()
                touched.clear()
                model._route = counting_route
                model.forward_decode(tok, pos, cache, table)
                model._route = orig_route
                step_s = _time(step, dev, a.reps)
            if str(b) not in checks and dev.type == "cuda":
                checks[str(b)] = attention_check(model, cache, tok, pos, table)
                set_attention(attn)
            experts = statistics.mean(touched)
            w_b, kv_b = _bytes(cfg, experts, b, a.context, torch.tensor([], dtype=dtype).element_size())
            spec_s, meas_s = (w_b + kv_b) / (H200_HBM_SPEC_GBPS * 1e9), (w_b + kv_b) / (bw * 1e9)
            rows.append({"mode": mode, "graph_mode": runner.mode if runner else "eager",
                         "graph_fallback_reason": runner.why if runner else "", "batch": b, "context": a.context,
                         "step_ms": step_s * 1e3, "experts_touched_per_layer": experts, "weight_bytes": w_b,
                         "kv_bytes": kv_b, "roofline_spec_ms": spec_s * 1e3, "roofline_measured_ms": meas_s * 1e3,
                         "ratio_to_spec_roofline": step_s / spec_s, "ratio_to_measured_roofline": step_s / meas_s})
            print(f"{mode:18s} b={b:4d} step {step_s * 1e3:8.3f} ms  roofline {spec_s * 1e3:7.3f} ms (spec) "
                  f"{meas_s * 1e3:7.3f} ms (copy)  x{step_s / spec_s:5.2f}  experts/layer {experts:5.1f}", flush=True)
    profile = None
    if a.profile and dev.type == "cuda":
        from rackbed.engine.bench.decode import profile_step

        with torch.inference_mode():
            profile = profile_step(model, cache, cfg, dev, a.batches[0], a.context, pages_per)
    M.GROUPED_IMPL = "auto"
    doc = {"bench": "mla_decode", "profile": profile, "attention_check": checks,
           "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
           "torch": torch.__version__, "cuda": torch.version.cuda, "date": time.strftime("%Y-%m-%d %H:%M:%S"),
           "command": " ".join([sys.executable, "-m", "rackbed.engine.bench.mla_decode", *(argv or sys.argv[1:])]),
           "model": "tiny" if a.tiny else a.model, "layers": cfg.n_layers, "hidden": cfg.hidden,
           "heads": cfg.n_q_heads, "kv_values_per_token": cfg.attention.kv_values_per_token(),
           "experts": cfg.n_experts, "top_k": cfg.top_k, "shared_intermediate": cfg.shared_intermediate,
           "dtype": str(dtype), "page_tokens": S, "hbm_spec_GBps": H200_HBM_SPEC_GBPS, "hbm_copy_GBps_rw": bw,
           "rows": rows,
           "bytes_model": "per layer: MLA projections + norms, router (+ correction bias), shared expert, routed "
                          "experts touched; + embedding row reads ignored, LM head; + latent KV read (batch x "
                          "(context+1) x kv_lora+rope x elem bytes x layers); roofline = bytes / bandwidth"}
    if a.out:
        write_text(a.out, json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
