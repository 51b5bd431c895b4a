"""A DP-EP rank's grouped expert GEMMs under skewed routing, on one GPU (``python -m rackbed.kernels.bench.moe_skew
--out FILE``).

A rank of an expert-parallel group holds ``E`` local experts and receives ``R`` (token, expert) rows; with skewed
routing a few hot experts take most of them. The simulator prices the busiest rank's GEMM from the histogram of its
experts' row counts (``sim.costs.gemm.grouped_gemm_time``); this benchmark measures that GEMM -- the engine's
``torch._grouped_mm`` gate_up ([R, D] x [E, 2F, D]) and down ([R, F] x [E, D, F]), bf16, CUDA-graph replay -- for
row counts drawn from a power law over the rank's experts (share of expert i ~ (i+1)^-alpha; alpha 0 = uniform),
so the busiest-rank term can be checked against measurements (price the same histograms with
``grouped_gemm_time`` and the shipped H200 calibration). Qwen3-235B width (D 4096, F 1536). Imports torch, numpy
and the output helpers only; the row counts (:func:`cases`) are checked on the CPU by ``tests/test_moe_skew.py``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np

from rackbed.topology.outputs import add_force, entry_file, write_text

D_MODEL, F_EXPERT = 4096, 1536


def skewed_counts(rows: int, n_experts: int, alpha: float, seed: int) -> list[int]:
    """``rows`` rows over ``n_experts`` experts, drawn multinomially with shares ~ (i+1)^-alpha (seeded)."""
    w = (np.arange(1, n_experts + 1, dtype=float)) ** -alpha
    return np.random.default_rng(seed).multinomial(rows, w / w.sum()).tolist()


def cases() -> list[dict]:
    """(experts per rank, rows, alpha) of the sweep: EP8 / EP4 ranks of a 128-expert model, decode to prefill rows."""
    out = []
    for e in (16, 32):
        for rows in (128, 512, 2048):
            for alpha in (0.0, 1.0, 1.2):
                out.append({"experts": e, "rows": rows, "alpha": alpha,
                            "counts": skewed_counts(rows, e, alpha, seed=rows + e)})
    return out


def main(argv=None) -> int:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", required=True)
    add_force(ap, "replace an existing --out file")
    a = ap.parse_args(argv)
    entry_file(a.out, force=a.force)   # before the benchmark, not after it
    dev = torch.device("cuda")
    D, F = D_MODEL, F_EXPERT
    g = torch.Generator(device=dev).manual_seed(0)
    rows_out = []
    weights = {}
    for c in cases():
        E, R = c["experts"], c["rows"]
        if E not in weights:
            weights[E] = ((torch.randn(E, 2 * F, D, device=dev, generator=g) * D ** -0.5).to(torch.bfloat16),
                          (torch.randn(E, D, F, device=dev, generator=g) * F ** -0.5).to(torch.bfloat16))
        gu, dn = weights[E]
        x = torch.randn(R, D, device=dev, generator=g).to(torch.bfloat16)
        act = torch.randn(R, F, device=dev, generator=g).to(torch.bfloat16)
        offs = torch.cumsum(torch.tensor(c["counts"], device=dev), 0).to(torch.int32)
        res = {}
        for name, fn in (("gate_up", lambda: torch._grouped_mm(x, gu.transpose(1, 2), offs=offs)),
                         ("down", lambda: torch._grouped_mm(act, dn.transpose(1, 2), offs=offs))):
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                fn()
            torch.cuda.current_stream().wait_stream(s)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                for _ in range(10):
                    fn()
            ts = []
            for _ in range(a.reps):
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                e0.record()
                graph.replay()
                e1.record()
                torch.cuda.synchronize()
                ts.append(e0.elapsed_time(e1) * 1e3 / 10)
            res[f"{name}_us"] = statistics.median(ts)
        rows_out.append({**c, **res, "max_rows": max(c["counts"]), "active": sum(1 for v in c["counts"] if v)})
        print(f"E={E:3d} R={R:5d} alpha={c['alpha']:.1f} max {max(c['counts']):5d}  gate_up {res['gate_up_us']:8.1f} us"
              f"  down {res['down_us']:8.1f} us", flush=True)
    doc = {"bench": "moe_skew", "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
           "cuda": torch.version.cuda, "date": time.strftime("%Y-%m-%d %H:%M:%S"), "D": D, "F": F,
           "command": " ".join([sys.executable, "-m", "rackbed.kernels.bench.moe_skew", *(argv or sys.argv[1:])]),
           "rows": rows_out}
    write_text(a.out, json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
