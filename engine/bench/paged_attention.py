"""Decode attention alone: the Triton paged kernels (``kernels.paged_attention``) against the engine's torch gather
path, same inputs, same run (``python -m rackbed.engine.bench.paged_attention --out FILE``).

Shapes of the served models at full width (one layer, bf16, pages of 64): Qwen3-235B GQA (64 q / 4 kv heads, head
dim 128), gpt-oss sliding layer on its ring (64 / 8 heads, dim 64, window 128, sinks), DeepSeek-V3 MLA absorbed
(128 heads, latent 512 + rope 64). For each batch: median time of each path over CUDA-graph replays, the KV bytes
the step must read (the sequences' own tokens) over that time, and the largest difference of the outputs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from rackbed.topology.outputs import add_force, entry_file, write_text

MLA_VARIANTS = ((16, 32, 4), (32, 32, 8), (64, 32, 8), (64, 16, 8), (32, 64, 8), (64, 64, 8))


def _graph_time(fn, reps: int) -> float:
    """Median seconds of one replay of a CUDA graph of ``fn`` (warmed eagerly first)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    ts = []
    for _ in range(reps):
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        for _ in range(10):
            g.replay()
        e1.record()
        torch.cuda.synchronize()
        ts.append(e0.elapsed_time(e1) / 1e3 / 10)
    return statistics.median(ts)


def _cases(b: int, context: int, dev, dt, S: int) -> dict:
    """name -> (torch path, kernel, KV bytes the step must read) at batch ``b``."""
    from rackbed.engine.real import layers_gqa
    from rackbed.kernels import paged_attention as pa

    P = -(-(context + 1) // S)
    pos = torch.full((b,), context, device=dev)
    table = torch.arange(b * P, device=dev).view(b, P)
    cases = {}
    # Qwen3-235B full attention
    st = torch.randn(b * P, 2, 4, S, 128, device=dev, dtype=dt)
    q = torch.randn(b, 64, 128, device=dev, dtype=dt)

    class C:
        head_dim = 128
    mask = torch.arange(P * S, device=dev)[None, :] <= pos[:, None]
    cases["qwen3_gqa"] = (lambda: layers_gqa.decode({}, q.transpose(0, 1), st[table], pos, 0, C),
                          lambda: pa.gqa_decode(q, st, table, pos, 128 ** -0.5),
                          b * (context + 1) * 2 * 4 * 128 * 2)
    # gpt-oss sliding layer: a ring of window 128 in 3 pages, sinks
    rst = torch.randn(b * 3, 2, 8, S, 64, device=dev, dtype=dt)
    rq = torch.randn(b, 64, 64, device=dev, dtype=dt)
    rings = torch.arange(b * 3, device=dev).view(b, 3)
    sinks = torch.randn(64, device=dev, dtype=dt)

    class C2:
        head_dim = 64
    cases["gptoss_ring"] = (
        lambda: layers_gqa.decode_ring({"sinks": sinks}, rq.transpose(0, 1), rst[rings], pos, 128, C2),
        lambda: pa.gqa_decode(rq, rst, rings, pos, 64 ** -0.5, window=128, ring=True, sinks=sinks),
        b * 128 * 2 * 8 * 64 * 2)
    # DeepSeek-V3 MLA absorbed (the latent part; W_UK / W_UV einsums are the same on both paths)
    lst = torch.randn(b * P, S, 576, device=dev, dtype=dt)
    mq = torch.randn(b, 128, 576, device=dev, dtype=dt)

    def mla_torch():
        ctx = lst[table].reshape(b, P * S, 576)
        s = torch.matmul(mq, ctx.transpose(1, 2)).float() * 0.1
        s = s.masked_fill(~mask[:, None, :], float("-inf"))
        return torch.matmul(torch.softmax(s, -1).to(dt), ctx[..., :512])
    # heads per program (the latent is read H / bh times, from L2 when they run together), tokens per block, warps
    for bh, bn, nw in MLA_VARIANTS:
        cases[f"dsv3_mla_h{bh}_t{bn}_w{nw}"] = (
            mla_torch, lambda bh=bh, bn=bn, nw=nw: pa.mla_decode(mq, lst, table, pos, 0.1, 512, block_heads=bh,
                                                                 block_tokens=bn, num_warps=nw),
            b * (context + 1) * 576 * 2)
    return cases


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64, 128, 256])
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--only", default=None, help="run only the cases whose name starts with this")
    ap.add_argument("--out", default=None)
    add_force(ap, "replace an existing --out file")
    a = ap.parse_args(argv)
    if a.out:
        entry_file(a.out, force=a.force)
    dev, dt, S = torch.device("cuda"), torch.bfloat16, 64
    rows = []
    for b in a.batches:
        cases = _cases(b, a.context, dev, dt, S)
        for name, (ref_fn, ker_fn, kv_bytes) in cases.items():
            if a.only and not name.startswith(a.only):
                continue
            with torch.inference_mode():
                ref, got = ref_fn().float(), ker_fn().float()
                err = ((got - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()
                t_ref = _graph_time(ref_fn, a.reps)
                t_ker = _graph_time(ker_fn, a.reps)
            rows.append({"case": name, "batch": b, "context": a.context, "torch_us": t_ref * 1e6,
                         "triton_us": t_ker * 1e6, "speedup": t_ref / t_ker, "kv_bytes": kv_bytes,
                         "triton_GBps": kv_bytes / t_ker / 1e9, "max_rel_err": err})
            print(f"{name:12s} b={b:4d} torch {t_ref * 1e6:9.1f} us  triton {t_ker * 1e6:9.1f} us  "
                  f"x{t_ref / t_ker:5.2f}  {kv_bytes / t_ker / 1e9:7.0f} GB/s  err {err:.1e}", flush=True)
        del cases
        torch.cuda.empty_cache()
    doc = {"bench": "paged_attention", "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
           "triton": __import__("triton").__version__, "cuda": torch.version.cuda,
           "date": time.strftime("%Y-%m-%d %H:%M:%S"),
           "command": " ".join([sys.executable, "-m", "rackbed.engine.bench.paged_attention", *(argv or sys.argv[1:])]),
           "rows": rows}
    if a.out:
        write_text(a.out, json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
