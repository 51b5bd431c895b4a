"""Torch microbenchmarks of the local GPU(s) for calibration (``rackbed calibrate``).

Every benchmark returns *rows* (plain dicts, JSON-ready) with the shape, the median time per call in µs
(``median_us``) and the derived rate (``tflops`` = 1e12 FLOP/s, ``GBps`` = 1e9 B/s). The FLOP and byte
conventions are the simulator's (``sim/costs``), so that a fitted rate reproduces the measured time exactly:

* ``hbm_copy``: ``dst.copy_(src)`` of ``size_bytes``; ``bytes`` = read + write = ``2 * size_bytes``.
* ``gemm`` (``op: dense``): ``A[m, k] @ W[n, k]^T`` bf16 (``torch.matmul``) or FP8 E4M3 with row-wise scales
  (``torch._scaled_mm``, ``fmt: fp8``); FLOPs ``2*m*n*k``.
* ``gemm`` (``op: grouped``): ``torch._grouped_mm`` over ``n_experts`` experts with ``m`` tokens each (what
  ``engine/real/model.py``'s ``grouped_swiglu`` calls); FLOPs ``2*m*E*n*k``.
* ``flash_prefill``: causal SDPA, one sequence of ``seq`` tokens, ``n_q_heads`` / ``n_kv_heads`` / ``head_dim``;
  FLOPs ``4*H*D*seq*(seq+1)/2`` (``sim.costs.attention``'s causal count).
* ``attn_decode``: SDPA with one query token per sequence over ``ctx`` cached tokens, ``batch`` sequences; KV
  bytes ``batch*ctx*2*Hkv*D*2`` (bf16), reported as ``GBps`` of KV read.
* ``allreduce``: NCCL ``all_reduce`` (bf16 sum) of ``size_bytes`` per rank over all local GPUs, one process per
  GPU; the median per rank, max over ranks.
* ``p2p_copy``: ``dst_on_gpu1.copy_(src_on_gpu0)`` of ``size_bytes`` (NVLink peer copy).

Timing (METHOD.md): CUDA events around ``inner`` back-to-back calls (so that tiny kernels are not timed with
an idle GPU waiting on the host), warm-up first, the median over ``reps`` repetitions; fresh random data per
shape (never zeros) and ``ceil(3 * L2 / set_bytes)`` rotating input sets so repeated calls do not hit L2.
``--dry-run`` runs tiny sizes on CPU tensors (host clock) to test the plumbing; its numbers mean nothing.

Usage: ``python -m kernels.measure --out measure.json [--quick] [--dry-run]``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

#: Qwen3-235B-A22B shapes (hidden 4096, 64 query heads / 4 KV heads of 128, experts 1536 wide, 128 experts)
HIDDEN, N_Q_HEADS, N_KV_HEADS, HEAD_DIM, MOE_INTER = 4096, 64, 4, 128, 1536
#: (name, n, k): grouped expert GEMMs (gate+up, down)
GROUPED_SHAPES = (("gate_up", 2 * MOE_INTER, HIDDEN), ("down", HIDDEN, MOE_INTER))
#: (name, n, k): dense GEMMs — attention projections at TP=1 (QKV, O) and TP=2 (QKV), shared-size square
DENSE_SHAPES = (("qkv_tp1", N_Q_HEADS * HEAD_DIM + 2 * N_KV_HEADS * HEAD_DIM, HIDDEN),
                ("o_tp1", HIDDEN, N_Q_HEADS * HEAD_DIM),
                ("qkv_tp2", N_Q_HEADS // 2 * HEAD_DIM + 2 * N_KV_HEADS // 2 * HEAD_DIM, HIDDEN))
GROUPED_EXPERTS = 32
L2_BYTES = 50 * 2**20  # H200 L2 (60 MB per torch; 50 MiB in topology.specs) — rotation target is 3x this


def _sizes(full: list, quick: bool, dry: bool, dry_list: list):
    if dry:
        return dry_list
    return full[::2] if quick else full


class Timer:
    """Median time per call (µs) of ``fns`` (a list of zero-arg callables, rotated) on ``device``."""

    def __init__(self, device: str, reps: int, warmup: int, host_sync_devices: tuple[int, ...] = ()):
        self.device, self.reps, self.warmup = device, reps, warmup
        #: when set: host clock around the calls, synchronising these devices (cross-device copies)
        self.host_sync = host_sync_devices

    def __call__(self, fns: list, target_us: float = 300.0) -> tuple[float, int]:
        import torch

        cuda = self.device.startswith("cuda") and not self.host_sync
        n = len(fns)
        for i in range(self.warmup):
            fns[i % n]()
        self._sync()
        # one timed probe to choose how many back-to-back calls one repetition holds
        t0 = self._elapsed_us(fns, 0, 1, cuda)
        inner = max(1, min(64, math.ceil(target_us / max(t0, 1e-3))))
        times = [self._elapsed_us(fns, r * inner, inner, cuda) / inner for r in range(self.reps)]
        return statistics.median(times), inner

    def _sync(self) -> None:
        import torch

        if self.host_sync:
            for d in self.host_sync:
                torch.cuda.synchronize(d)
        elif self.device.startswith("cuda"):
            torch.cuda.synchronize()

    def _elapsed_us(self, fns, start: int, inner: int, cuda: bool) -> float:
        import torch

        n = len(fns)
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for i in range(inner):
                fns[(start + i) % n]()
            b.record()
            b.synchronize()
            return a.elapsed_time(b) * 1e3
        self._sync()
        t = time.perf_counter()
        for i in range(inner):
            fns[(start + i) % n]()
        self._sync()
        return (time.perf_counter() - t) * 1e6


def _n_sets(set_bytes: float) -> int:
    return max(1, min(8, math.ceil(3 * L2_BYTES / max(set_bytes, 1))))


def _randn(shape, dtype, device, gen):
    import torch

    return torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(dtype)


def bench_hbm(device, timer, quick, dry, gen) -> list[dict]:
    import torch

    rows = []
    sizes = _sizes([2**p for p in range(20, 33)], quick, dry, [2**12, 2**16])
    for sz in sizes:
        n = sz // 2
        sets = _n_sets(2 * sz)
        src = [_randn((n,), torch.bfloat16, device, gen) for _ in range(sets)]
        dst = [torch.empty_like(s) for s in src]
        fns = [(lambda s=s, d=d: d.copy_(s)) for s, d in zip(src, dst)]
        us, inner = timer(fns)
        assert torch.equal(dst[0], src[0])
        rows.append({"bench": "hbm_copy", "size_bytes": sz, "bytes": 2 * sz, "median_us": us, "inner": inner,
                     "GBps": 2 * sz / us / 1e3})
        del src, dst
    return rows


def bench_gemm(device, timer, quick, dry, gen) -> list[dict]:
    import torch

    rows = []
    ms = _sizes([2**p for p in range(0, 15)], quick, dry, [1, 2, 4, 8])
    shapes = DENSE_SHAPES if not dry else (("tiny_a", 48, 32), ("tiny_b", 32, 64))
    for name, n, k in shapes:
        w_sets = _n_sets(n * k * 2)
        ws = [_randn((n, k), torch.bfloat16, device, gen) for _ in range(w_sets)]
        for m in ms:
            xs = [_randn((m, k), torch.bfloat16, device, gen) for _ in range(len(ws))]
            fns = [(lambda x=x, w=w: torch.matmul(x, w.t())) for x, w in zip(xs, ws)]
            us, inner = timer(fns)
            rows.append({"bench": "gemm", "op": "dense", "fmt": "bf16", "shape": name, "m": m, "n": n, "k": k,
                         "n_experts": 1, "median_us": us, "inner": inner, "tflops": 2 * m * n * k / us / 1e6})
        # FP8 E4M3, row-wise scales (torch._scaled_mm needs CUDA and dims divisible by 16)
        if device.startswith("cuda") and hasattr(torch, "_scaled_mm"):
            try:
                wq = [(w.float() / (w.float().abs().amax(1, keepdim=True) / 448)).to(torch.float8_e4m3fn) for w in ws]
                sw = [(w.float().abs().amax(1) / 448)[None, :].contiguous() for w in ws]  # [1, n]
                for m in [x for x in ms if x >= 16]:
                    xs = [_randn((m, k), torch.bfloat16, device, gen) for _ in range(len(ws))]
                    sx = [(x.float().abs().amax(1, keepdim=True) / 448).contiguous() for x in xs]  # [m, 1]
                    xq = [(x.float() / s).to(torch.float8_e4m3fn) for x, s in zip(xs, sx)]
                    fns = [(lambda a=a, sa=sa, b=b, sb=sb: torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb,
                                                                              out_dtype=torch.bfloat16))
                           for a, sa, b, sb in zip(xq, sx, wq, sw)]
                    ref = (xs[0].float() @ ws[0].float().t())
                    got = fns[0]().float()
                    rel = ((got - ref).norm() / ref.norm()).item()
                    us, inner = timer(fns)
                    rows.append({"bench": "gemm", "op": "dense", "fmt": "fp8", "shape": name, "m": m, "n": n, "k": k,
                                 "n_experts": 1, "median_us": us, "inner": inner,
                                 "tflops": 2 * m * n * k / us / 1e6, "relerr": rel})
            except Exception as exc:  # noqa: BLE001 — recorded, not fatal
                rows.append({"bench": "gemm", "op": "dense", "fmt": "fp8", "shape": name,
                             "error": f"{type(exc).__name__}: {str(exc)[:200]}"})
        del ws
    return rows


def bench_grouped(device, timer, quick, dry, gen) -> list[dict]:
    import torch

    rows = []
    E = GROUPED_EXPERTS if not dry else 4
    ms = _sizes([2**p for p in range(0, 12)], quick, dry, [1, 2, 4, 8])
    shapes = GROUPED_SHAPES if not dry else (("tiny_gu", 48, 32), ("tiny_dn", 32, 24))
    for name, n, k in shapes:
        w_sets = _n_sets(E * n * k * 2)
        ws = [_randn((E, n, k), torch.bfloat16, device, gen) for _ in range(w_sets)]
        for m in ms:
            offs = torch.arange(1, E + 1, device=device, dtype=torch.int32) * m
            xs = [_randn((m * E, k), torch.bfloat16, device, gen) for _ in range(len(ws))]
            fns = [(lambda x=x, w=w: torch._grouped_mm(x, w.transpose(1, 2), offs=offs)) for x, w in zip(xs, ws)]
            try:
                got = fns[0]()
                ref = torch.cat([xs[0][e * m:(e + 1) * m].float() @ ws[0][e].float().t() for e in range(E)])
                rel = ((got.float() - ref).norm() / ref.norm()).item()
                us, inner = timer(fns)
            except Exception as exc:  # noqa: BLE001 — recorded, the other sizes still run
                if dry:
                    raise
                rows.append({"bench": "gemm", "op": "grouped", "fmt": "bf16", "shape": name, "m": m,
                             "error": f"{type(exc).__name__}: {str(exc)[:200]}"})
                continue
            rows.append({"bench": "gemm", "op": "grouped", "fmt": "bf16", "shape": name, "m": m, "n": n, "k": k,
                         "n_experts": E, "median_us": us, "inner": inner,
                         "tflops": 2 * m * E * n * k / us / 1e6, "relerr": rel})
        del ws
    return rows


def bench_flash(device, timer, quick, dry, gen) -> list[dict]:
    import torch
    import torch.nn.functional as F

    rows = []
    H, Hkv, D = (N_Q_HEADS, N_KV_HEADS, HEAD_DIM) if not dry else (4, 2, 16)
    seqs = _sizes([2**p for p in range(8, 15)], quick, dry, [32, 64])
    for s in seqs:
        sets = _n_sets(s * (H + 2 * Hkv) * D * 2)
        qs = [_randn((1, H, s, D), torch.bfloat16, device, gen) for _ in range(sets)]
        ks = [_randn((1, Hkv, s, D), torch.bfloat16, device, gen) for _ in range(sets)]
        vs = [_randn((1, Hkv, s, D), torch.bfloat16, device, gen) for _ in range(sets)]
        fns = [(lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
               for q, k, v in zip(qs, ks, vs)]
        us, inner = timer(fns)
        flops = 4.0 * H * D * s * (s + 1) / 2
        rows.append({"bench": "flash_prefill", "seq": s, "n_q_heads": H, "n_kv_heads": Hkv, "head_dim": D,
                     "median_us": us, "inner": inner, "flops": flops, "tflops": flops / us / 1e6})
    # decode: one query token per sequence over ctx cached tokens
    ctxs = _sizes([2**p for p in range(8, 17)], quick, dry, [32, 128])
    for batch in ((16, 64) if not dry else (2,)):
        for c in ctxs:
            kv_bytes = batch * c * 2 * Hkv * D * 2
            if kv_bytes > 2**31:
                continue
            sets = _n_sets(kv_bytes)
            qs = [_randn((batch, H, 1, D), torch.bfloat16, device, gen) for _ in range(sets)]
            ks = [_randn((batch, Hkv, c, D), torch.bfloat16, device, gen) for _ in range(sets)]
            vs = [_randn((batch, Hkv, c, D), torch.bfloat16, device, gen) for _ in range(sets)]
            fns = [(lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
                   for q, k, v in zip(qs, ks, vs)]
            us, inner = timer(fns)
            rows.append({"bench": "attn_decode", "batch": batch, "ctx": c, "n_q_heads": H, "n_kv_heads": Hkv,
                         "head_dim": D, "kv_bytes": kv_bytes, "median_us": us, "inner": inner,
                         "GBps": kv_bytes / us / 1e3})
            del qs, ks, vs
    return rows


def bench_p2p(timer, quick, dry, gen) -> list[dict]:
    import torch

    rows = []
    if dry or torch.cuda.device_count() < 2:
        return rows
    timer = Timer("cuda:0", timer.reps, timer.warmup, host_sync_devices=(0, 1))
    for sz in _sizes([2**p for p in range(12, 31, 2)], quick, False, []):
        n = sz // 2
        sets = _n_sets(sz)
        src = [_randn((n,), torch.bfloat16, "cuda:0", gen) for _ in range(sets)]
        dst = [torch.empty(n, dtype=torch.bfloat16, device="cuda:1") for _ in range(sets)]
        fns = [(lambda s=s, d=d: d.copy_(s, non_blocking=True)) for s, d in zip(src, dst)]
        us, inner = timer(fns)
        torch.cuda.synchronize()
        assert torch.equal(dst[0].cpu(), src[0].cpu())
        rows.append({"bench": "p2p_copy", "src": 0, "dst": 1, "size_bytes": sz, "median_us": us, "inner": inner,
                     "GBps": sz / us / 1e3})
    return rows


def _allreduce_worker(rank: int, world: int, port: int, sizes: list[int], reps: int, path: str) -> None:
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            device_id=torch.device(f"cuda:{rank}"))
    gen = torch.Generator(device=f"cuda:{rank}").manual_seed(100 + rank)
    timer = Timer(f"cuda:{rank}", reps, 5)
    rows = []
    for sz in sizes:
        n = sz // 2
        sets = _n_sets(sz)
        bufs = [_randn((n,), torch.bfloat16, f"cuda:{rank}", gen) for _ in range(sets)]
        # AVG keeps values bounded over thousands of calls (SUM would overflow bf16 to inf)
        ref = bufs[0].float().clone()
        dist.all_reduce(ref, op=dist.ReduceOp.AVG)
        probe = bufs[0].clone()
        dist.all_reduce(probe, op=dist.ReduceOp.AVG)
        rel = ((probe.float() - ref).norm() / ref.norm()).item()
        fns = [(lambda b=b: dist.all_reduce(b, op=dist.ReduceOp.AVG)) for b in bufs]
        dist.barrier()
        us, inner = timer(fns, target_us=200.0)
        allv = [None] * world
        dist.all_gather_object(allv, us)
        rows.append({"bench": "allreduce", "algo": "ring", "impl": "nccl", "n_ranks": world, "size_bytes": sz,
                     "median_us": max(allv), "inner": inner, "GBps": sz / max(allv) / 1e3,
                     "busbw_GBps": 2 * (world - 1) / world * sz / max(allv) / 1e3, "relerr": rel})
    if rank == 0:
        with open(path, "w") as f:
            json.dump(rows, f)
    dist.barrier()
    dist.destroy_process_group()


def bench_allreduce(quick, dry, reps) -> list[dict]:
    import socket

    import torch
    import torch.multiprocessing as mp

    world = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if dry or world < 2:
        return []
    for k, v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
        os.environ[k] = v  # never NVLink multicast (KINDS.md)
    sizes = _sizes([2**p for p in range(12, 30)], quick, False, [])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ar.json")
        mp.spawn(_allreduce_worker, args=(world, port, sizes, reps, path), nprocs=world, join=True)
        with open(path) as f:
            return json.load(f)


BENCHES = ("hbm", "gemm", "grouped", "flash", "p2p", "allreduce")


def environment(device: str) -> dict:
    """Device, driver and library versions (the calibration file's provenance)."""
    import torch

    env = {"date": date.today().isoformat(), "python": platform.python_version(), "torch": str(torch.__version__),
           "cuda": torch.version.cuda, "host": platform.node(), "device": device}
    if device.startswith("cuda"):
        p = torch.cuda.get_device_properties(0)
        env.update(gpu_name=p.name, gpu_count=torch.cuda.device_count(), sm_count=p.multi_processor_count,
                   gpu_mem_bytes=p.total_memory)
        try:
            env["nccl"] = ".".join(str(x) for x in torch.cuda.nccl.version())
        except Exception:  # noqa: BLE001
            env["nccl"] = None
        try:
            import subprocess

            env["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                           capture_output=True, text=True, timeout=20).stdout.split()[0]
        except Exception:  # noqa: BLE001
            env["driver"] = None
    else:
        env.update(gpu_name="cpu (dry run)", gpu_count=0, driver=None, nccl=None)
    return env


def run(quick: bool = False, dry_run: bool = False, only: list[str] | None = None, echo=print,
        partial_out: str | Path | None = None) -> dict:
    """Run the benchmarks; returns ``{"schema": "rackbed.measure/1", "env": {...}, "rows": [...]}``."""
    import torch

    device = "cpu" if dry_run or not torch.cuda.is_available() else "cuda:0"
    if device == "cpu" and not dry_run:
        raise ValueError("measure: no CUDA GPU found; use --dry-run to test on the CPU")
    only = list(only or BENCHES)
    for b in only:
        if b not in BENCHES:
            raise ValueError(f"measure: unknown benchmark {b!r}; choose from {', '.join(BENCHES)}")
    reps = 3 if dry_run else (15 if quick else 30)
    timer = Timer(device, reps, 2 if dry_run else 5)
    gen = torch.Generator(device=device).manual_seed(0)
    doc = {"schema": "rackbed.measure/1", "env": environment(device), "rows": [], "quick": quick,
           "dry_run": dry_run, "timings_s": {}}
    for b in only:
        t0 = time.time()
        try:
            rows = _run_one(b, device, timer, quick, dry_run, gen, reps)
        except Exception as exc:  # noqa: BLE001 — one broken benchmark must not lose the others
            if dry_run:
                raise
            rows = [{"bench": b, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}]
        doc["rows"].extend(rows)
        doc["timings_s"][b] = round(time.time() - t0, 2)
        echo(f"measure: {b}: {len(rows)} rows in {time.time() - t0:.1f} s")
        if partial_out:  # what is done survives a time-out
            Path(partial_out).parent.mkdir(parents=True, exist_ok=True)
            Path(partial_out).write_text(json.dumps(doc, indent=1))
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    return doc


def _run_one(b, device, timer, quick, dry_run, gen, reps) -> list[dict]:
    if b == "hbm":
        return bench_hbm(device, timer, quick, dry_run, gen)
    if b == "gemm":
        return bench_gemm(device, timer, quick, dry_run, gen)
    if b == "grouped":
        return bench_grouped(device, timer, quick, dry_run, gen)
    if b == "flash":
        return bench_flash(device, timer, quick, dry_run, gen)
    if b == "p2p":
        return bench_p2p(timer, quick, dry_run, gen)
    return bench_allreduce(quick, dry_run, reps)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kernels.measure", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="measure.json")
    ap.add_argument("--quick", action="store_true", help="every other size, fewer repeats")
    ap.add_argument("--dry-run", action="store_true", help="tiny sizes on CPU tensors (plumbing test)")
    ap.add_argument("--only", nargs="*", choices=BENCHES)
    a = ap.parse_args(argv)
    doc = run(a.quick, a.dry_run, a.only, partial_out=a.out)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(doc, indent=1))
    print(f"wrote {a.out} ({len(doc['rows'])} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
