"""All-reduce benchmark and device correctness check: one process per GPU, run by ``kernels.bench.suites``.

Per rank (``worker``): init torch.distributed (gloo for objects, NCCL for tensors), build ``PeerAllReduce``,
check it (fresh random inputs, poisoned output, odd sizes, both schedules, eager and CUDA-graph replay), measure
P2P copy bandwidth (copy engine, one direction alone and both at once) and local HBM copy bandwidth, then time
every implementation at every size with and without CUDA graphs. Rank 0 writes the result dict as JSON.

Implementations timed (all sum, in the same process, same sizes):
  nccl            torch.distributed.all_reduce in place (NCCL_NVLS_ENABLE=0)
  symm_two_shot   torch.ops.symm_mem.two_shot_all_reduce_ in place on a symmetric buffer (copy-in not timed)
  symm_one_shot   torch.ops.symm_mem.one_shot_all_reduce on a symmetric buffer (returns a new tensor)
  peer            PeerAllReduce.all_reduce(x, out) with algo auto / one_shot / two_shot (input and output are
                  ordinary torch tensors; any copy into peer memory is inside the timed kernel)
Timing: CUDA events around ``iters`` back-to-back calls (or one replay of a graph holding ``iters`` calls),
repeated ``reps`` times after warm-up; the per-call median over reps, max over ranks.
"""

from __future__ import annotations

import json
import os
import statistics
import time
import traceback
from datetime import timedelta

from rackbed.topology.outputs import write_text

for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ[_k] = _v

CHECK_ELEMS = (1, 7, 8, 1000, 4099, 8 * 1001, 3 * 65536 + 8, 1_000_003, (1 << 21) + 24)


def _log(rank, *msg):
    print(f"[rank {rank}]", *msg, flush=True)


def check_correctness(ar, dtypes=("bf16", "fp32"), elems=CHECK_ELEMS, seed=0, graph=True) -> list[dict]:
    """Check ``ar`` against a float64 reference on fresh random inputs; returns one record per case.

    A case passes when no output element is left poisoned (NaN), ‖out − ref‖/‖ref‖ is under the dtype's
    tolerance (bf16 1e-2, fp32 1e-5), and every rank's output is bitwise identical.
    """
    import torch
    import torch.distributed as dist

    tdt = {"bf16": torch.bfloat16, "fp32": torch.float32}
    tol = {"bf16": 1e-2, "fp32": 1e-5}
    dev = torch.device("cuda", torch.cuda.current_device())
    world, rank = ar.world_size, ar.rank
    gen = torch.Generator(device=dev)
    results = []
    case = 0

    def one(x, out, dt, n, algo, mode):
        xs = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(xs, x, group=ar.group)
        ref = torch.stack([t.double() for t in xs]).sum(0)
        outs = [torch.empty_like(out) for _ in range(world)]
        dist.all_gather(outs, out, group=ar.group)
        unwritten = int(torch.isnan(out).sum())
        rel = float((out.double() - ref).norm() / ref.norm().clamp_min(1e-30))
        same = all(torch.equal(outs[0].view(torch.uint8), o.view(torch.uint8)) for o in outs)
        ok = unwritten == 0 and rel < tol[dt] and same
        return {"dtype": dt, "n_elems": n, "algo": algo, "mode": mode, "unwritten": unwritten, "rel_err": rel,
                "identical_across_ranks": same, "ok": ok}

    for dt in dtypes:
        for n in elems:
            if n * tdt[dt].itemsize > ar.max_bytes:
                continue
            for algo in ("one_shot", "two_shot", "two_shot_pull", "auto"):
                case += 1
                gen.manual_seed(seed * 1_000_003 + case * 101 + rank)
                x = torch.randn(n, device=dev, generator=gen).to(tdt[dt])
                out = torch.full_like(x, float("nan"))
                ar.all_reduce(x, out, algo=algo)
                results.append(one(x, out, dt, n, algo, "eager"))
                if algo == "auto" and n == elems[-3]:  # in place
                    y = x.clone()
                    ar.all_reduce(y, y)
                    results.append(one(x, y, dt, n, algo, "in_place"))
                if graph and algo != "auto" and n in (elems[4], elems[-1]):
                    xg = torch.empty_like(x)
                    og = torch.empty_like(x)
                    s = torch.cuda.Stream()
                    s.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(s):
                        ar.all_reduce(xg, og, algo=algo)  # warm
                    torch.cuda.current_stream().wait_stream(s)
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g):
                        ar.all_reduce(xg, og, algo=algo)
                    for rep in range(3):  # fresh inputs each replay: the graph must not bake in the epoch
                        gen.manual_seed(seed * 7 + case * 13 + rep * 5 + rank)
                        xg.copy_(torch.randn(n, device=dev, generator=gen).to(tdt[dt]))
                        og.fill_(float("nan"))
                        g.replay()
                        results.append(one(xg, og, dt, n, algo, f"graph_replay{rep}"))
                    del g
    ar.check_error()
    return results


def _time(fn, iters: int, reps: int, graph: bool) -> float:
    """Median per-call time (µs) of ``fn`` over ``reps`` timed runs of ``iters`` calls (or graph replays)."""
    import torch

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    run = None
    if graph:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            fn()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(iters):
                fn()
        g.replay()
        run = g.replay
    times = []
    for _ in range(reps):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        if run is not None:
            run()
        else:
            for _ in range(iters):
                fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3 / iters)
    return statistics.median(times)


def _p2p_copy_GBps(rank: int, world: int, nbytes: int = 256 << 20) -> dict:
    """Copy-engine P2P bandwidth (GB/s, 1e9 B/s, bytes copied / time): rank 0 -> 1 alone, then all at once."""
    import torch
    import torch.distributed as dist

    peer = (rank + 1) % world
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=f"cuda:{rank}")
    dst = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{peer}")
    out = {}
    for mode in ("uni", "bi"):
        active = rank == 0 or mode == "bi"
        if active:
            dst.copy_(src)
        torch.cuda.synchronize(rank)
        torch.cuda.synchronize(peer)
        dist.barrier()
        t0 = time.perf_counter()
        reps = 10
        if active:
            for _ in range(reps):
                dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize(rank)
        torch.cuda.synchronize(peer)
        dt = time.perf_counter() - t0
        vals = [None] * world
        dist.all_gather_object(vals, nbytes * reps / dt / 1e9 if active else None)
        got = [v for v in vals if v is not None]
        out[f"p2p_copy_{mode}_GBps_per_dir"] = min(got)
    # local HBM copy, bytes read + written
    a = torch.empty(1 << 30, dtype=torch.uint8, device=f"cuda:{rank}")
    b = torch.empty_like(a)
    us = _time(lambda a=a, b=b: b.copy_(a), 5, 5, False)
    out["hbm_copy_GBps_rw"] = 2 * a.numel() / (us * 1e-6) / 1e9
    del a, b, src, dst
    torch.cuda.empty_cache()
    return out


def _iters_for(n_bytes: int) -> int:
    est_us = 20 + n_bytes / 300e3  # ~300 GB/s
    return max(5, min(100, int(2000 / est_us)))


def _meta(rank: int) -> dict:
    import platform
    import subprocess

    import torch

    meta = {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "host": platform.node(),
            "device": torch.cuda.get_device_name(rank), "n_gpus": torch.cuda.device_count(),
            "torch": torch.__version__, "cuda_runtime": torch.version.cuda,
            "nccl": ".".join(map(str, torch.cuda.nccl.version())) if isinstance(torch.cuda.nccl.version(), tuple)
            else str(torch.cuda.nccl.version()),
            "env": {k: os.environ.get(k) for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST",
                                                   "NVSHMEM_DISABLE_NVLS")}}
    try:
        meta["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                        capture_output=True, text=True, timeout=20).stdout.split()[0]
        meta["nvlink"] = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True,
                                        timeout=20).stdout.splitlines()[:4]
    except Exception as exc:
        meta["driver"] = f"unknown ({exc})"
    try:
        from importlib.metadata import version

        meta["cutlass_dsl"] = version("nvidia-cutlass-dsl")
        meta["cuda_bindings"] = version("cuda-bindings")
    except Exception as exc:
        meta["cutlass_dsl"] = f"unknown ({exc})"
    return meta


def worker(rank: int, world: int, port: int, cfg: dict, result_path: str) -> None:
    """One rank of the benchmark; ``cfg``: sizes (bytes), dtypes, check (bool), reps, impls."""
    import torch
    import torch.distributed as dist

    from rackbed.kernels.allreduce import PeerAllReduce
    from rackbed.kernels.allreduce_schedule import bound_us, predicted_us

    torch.cuda.set_device(rank)
    dist.init_process_group("cpu:gloo,cuda:nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=180), device_id=torch.device("cuda", rank))
    res: dict = {"suite": "allreduce", "world_size": world, "errors": []}
    if rank == 0:
        res["meta"] = _meta(rank)
    sizes = sorted(cfg["sizes"])
    t_start = time.perf_counter()
    ar = None
    try:
        t0 = time.perf_counter()
        ar = PeerAllReduce(None, max_bytes=max(sizes + [(1 << 21) * 4 + 256]), dtype=torch.bfloat16,
                           backend=cfg.get("backend", "auto"))
        res["peer"] = {"backend": ar.backend, "fallback_reason": ar.fallback_reason,
                       "exchange": getattr(ar._buf, "exchange", None), "setup_s": time.perf_counter() - t0,
                       "buffer_bytes": getattr(ar._buf, "nbytes", 0)}
        _log(rank, "peer all-reduce:", res["peer"])
    except Exception as exc:
        res["errors"].append(f"PeerAllReduce: {type(exc).__name__}: {exc}")
        _log(rank, traceback.format_exc())
    if ar is not None and ar.backend == "cute" and cfg.get("check", True):
        try:
            t0 = time.perf_counter()
            checks = check_correctness(ar)
            res["checks"] = checks
            res["checks_ok"] = all(c["ok"] for c in checks)
            res["checks_s"] = time.perf_counter() - t0
            _log(rank, f"correctness: {sum(c['ok'] for c in checks)}/{len(checks)} ok "
                       f"in {res['checks_s']:.1f}s")
            for c in checks:
                if not c["ok"]:
                    _log(rank, "FAILED", c)
        except Exception as exc:
            res["errors"].append(f"check: {type(exc).__name__}: {exc}")
            _log(rank, traceback.format_exc())
    bw = _p2p_copy_GBps(rank, world)
    res["bandwidth"] = bw
    _log(rank, "bandwidth:", bw)

    import torch.distributed._symmetric_memory as symm_mem

    gname = dist.group.WORLD.group_name
    tdt = {"bf16": torch.bfloat16, "fp32": torch.float32}
    rows = []
    dev = torch.device("cuda", rank)
    impls = cfg.get("impls") or ["nccl", "symm_two_shot", "symm_one_shot", "peer_auto", "peer_one_shot",
                                 "peer_two_shot", "peer_two_shot_pull", "peer_one_shot_jit"]
    for dt in cfg["dtypes"]:
        for nb in sizes:
            n = nb // tdt[dt].itemsize
            iters = _iters_for(nb)
            x = torch.randn(n, device=dev).to(tdt[dt])
            out = torch.empty_like(x)
            sbuf = None
            for impl in impls:
                fn = None
                try:
                    if impl == "nccl":
                        y = x.clone()
                        fn = lambda y=y: dist.all_reduce(y)  # noqa: E731
                    elif impl.startswith("symm"):
                        if sbuf is None:
                            sbuf = symm_mem.empty(n, dtype=tdt[dt], device=dev)
                            symm_mem.rendezvous(sbuf, gname)
                            sbuf.copy_(x)
                        if impl == "symm_two_shot":
                            fn = lambda s=sbuf: torch.ops.symm_mem.two_shot_all_reduce_(s, "sum", gname)  # noqa: E731
                        else:
                            fn = lambda s=sbuf: torch.ops.symm_mem.one_shot_all_reduce(s, "sum", gname)  # noqa: E731
                    elif impl == "peer_one_shot_jit":  # CuTe DSL's own launch path, to show its host cost
                        if ar is None or ar.backend != "cute" or nb > (1 << 20):
                            continue
                        fn = lambda: ar.all_reduce(x, out, algo="one_shot", use_jit=True)  # noqa: E731
                    elif impl.startswith("peer"):
                        if ar is None or ar.backend != "cute" or nb > ar.max_bytes:
                            continue
                        algo = impl[len("peer_"):]
                        fn = lambda algo=algo: ar.all_reduce(x, out, algo=algo)  # noqa: E731
                except Exception as exc:
                    res["errors"].append(f"{impl} {dt} {nb}: setup: {type(exc).__name__}: {exc}")
                    fn = None
                for graph in (False, True):
                    us, err = None, None
                    if fn is not None:
                        try:
                            us = _time(fn, iters, cfg.get("reps", 15), graph)
                        except Exception as exc:
                            err = f"{type(exc).__name__}: {str(exc)[:200]}"
                    # every rank must agree, else the next collective would mismatch
                    allv = [None] * world
                    dist.all_gather_object(allv, (us, err))
                    errs = [e for _, e in allv if e]
                    us = None if errs or any(u is None for u, _ in allv) else max(u for u, _ in allv)
                    if errs:
                        res["errors"].append(f"{impl} {dt} {nb} graph={graph}: {errs[0]}")
                        torch.cuda.synchronize()
                    algo = (ar.algo_for(nb) if impl == "peer_auto" and ar is not None
                            else impl.split("_", 1)[1] if "_" in impl else "ring/tree")
                    row = {"impl": impl, "algo": algo, "dtype": dt, "size_bytes": nb, "graph": graph,
                           "median_us": us, "GBps": (nb / us / 1e3) if us else None,
                           "bound_us": bound_us(nb, world, bw["p2p_copy_bi_GBps_per_dir"]),
                           "predicted_us": predicted_us(algo, nb, world) if algo in ("one_shot", "two_shot", "two_shot_pull")
                           else None}
                    rows.append(row)
                    if fn is not None and rank == 0 and us is not None:
                        _log(rank, f"{impl:14s} {dt} {nb:>10d} graph={int(graph)} {us:9.2f} us")
                dist.barrier()
            if ar is not None and ar.backend == "cute":
                err = None
                try:
                    ar.check_error()
                except RuntimeError as exc:
                    err = str(exc)
                errs = [None] * world
                dist.all_gather_object(errs, err)
                if any(errs):  # a timed-out wait on any rank: stop timing the peer kernels everywhere
                    res["errors"].extend(e for e in errs if e)
                    ar = None
            del sbuf
            partial = os.environ.get("RACKBED_BENCH_PARTIAL")
            if partial and rank == 0:
                write_text(partial, json.dumps(dict(res, rows=rows)))
    res["tune"] = _tune(rank, world, sizes, cfg) if (ar is not None and cfg.get("tune", True)) else []
    _add_ratios(rows)
    res["rows"] = rows
    res["wall_s"] = time.perf_counter() - t_start
    if ar is not None:
        ar.close()
    dist.barrier()
    if rank == 0:
        write_text(result_path, json.dumps(res, indent=1))
    dist.destroy_process_group()


def _tune(rank: int, world: int, sizes: list[int], cfg: dict) -> list[dict]:
    """CTA-count sweep for the two-shot kernels at sizes >= 16 MiB (bf16, CUDA graphs): max_blocks 66/132/264."""
    import torch
    import torch.distributed as dist

    from rackbed.kernels.allreduce import PeerAllReduce

    out_rows = []
    big = [nb for nb in sizes if nb >= 16 << 20]
    if not big:
        return out_rows
    for mb in (66, 132, 264):
        ar = PeerAllReduce(None, max_bytes=max(big), dtype=torch.bfloat16, backend="cute", max_blocks=mb)
        for nb in big:
            x = torch.randn(nb // 2, device=f"cuda:{rank}").to(torch.bfloat16)
            o = torch.empty_like(x)
            for algo in ("two_shot", "two_shot_pull", "one_shot"):
                us = _time(lambda: ar.all_reduce(x, o, algo=algo), _iters_for(nb), cfg.get("reps", 15), True)
                allv = [None] * world
                dist.all_gather_object(allv, us)
                out_rows.append({"max_blocks": mb, "algo": algo, "size_bytes": nb, "graph": True,
                                 "median_us": max(allv)})
                if rank == 0:
                    _log(rank, f"tune blocks={mb} {algo} {nb} {max(allv):.1f} us")
        ar.check_error()
        ar.close()
    return out_rows


def _add_ratios(rows: list[dict]) -> None:
    """ratio_vs_nccl = t_nccl / t (>1: faster than NCCL), same for symm two-shot; same dtype, size, graph mode."""
    key = lambda r: (r["dtype"], r["size_bytes"], r["graph"])  # noqa: E731
    base = {}
    for r in rows:
        if r["impl"] in ("nccl", "symm_two_shot") and r["median_us"]:
            base[(r["impl"],) + key(r)] = r["median_us"]
    for r in rows:
        for b, name in (("nccl", "ratio_vs_nccl"), ("symm_two_shot", "ratio_vs_symm_two_shot")):
            t0 = base.get((b,) + key(r))
            r[name] = (t0 / r["median_us"]) if (t0 and r["median_us"]) else None
        r["frac_of_bound"] = (r["bound_us"] / r["median_us"]) if r["median_us"] else None
