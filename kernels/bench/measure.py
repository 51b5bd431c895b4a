"""Torch microbenchmarks of the local GPU(s) for calibration (``rackbed calibrate``).

Every benchmark returns *rows* (plain dicts, JSON-ready) with the shape, the median time per call in µs
(``median_us``) and the derived rate (``tflops`` = 1e12 FLOP/s, ``GBps`` = 1e9 B/s). The FLOP and byte
conventions are the simulator's (``sim/costs``), so that a fitted rate reproduces the measured time exactly:

* ``hbm_copy``: ``dst.copy_(src)`` of ``size_bytes`` (the driver's device-to-device memcpy) and, with
  ``kernel: elementwise``, ``torch.neg(src, out=dst)`` (an elementwise kernel, the same traffic); ``bytes`` = read +
  write = ``2 * size_bytes``.
* ``gemm`` (``op: dense``): ``A[m, k] @ W[n, k]^T`` bf16 (``torch.matmul``) or FP8 E4M3 with row-wise scales
  (``torch._scaled_mm``, ``fmt: fp8``); FLOPs ``2*m*n*k``; bf16 at every ``m`` up to 1024 (``DENSE_M_BF16``), FP8
  (one kernel) at every multiple of 8 (``DENSE_M``).
* ``gemm_kernels`` (not timed): per dense shape and format, the CUDA kernels the same call launches at every ``m``
  up to 1024 and every multiple of 64 up to 16384, run-length encoded as ``runs: [[m_first, m_last, kernels]]``
  (the profiler's activity trace, :func:`kernel_names`); ``sim.calibrate`` reads the kernel and its M tile.
* ``gemm_forced``: per bf16 dense shape, the kernel of each run of its map over at most ``FORCED_RUN_M`` m, timed at
  a few other m with that kernel run by choice through cuBLASLt (``kernels/cublaslt.py``, :func:`gemm_forced_cases`), in
  the same interleaved curve as the library's rows, so that ``sim.calibrate`` can price the kernel from points of
  its own.
* ``gemm`` (``op: grouped``): ``torch._grouped_mm`` over ``n_experts`` experts with ``m`` tokens each (what
  ``engine/real/model.py``'s ``grouped_swiglu`` calls); FLOPs ``2*m*E*n*k``.
* ``gemm`` with ``fmt: fp8_block`` (:func:`bench_fp8_block`): FP8 E4M3 with DeepSeek-style block scales (fp32, one
  per 1x128 activations and 128x128 weights) through the block-scaled call torch has here (:func:`block_scaled_api`;
  on H200 with torch 2.11 / CUDA 13.0 ``torch._scaled_mm``, cuBLASLt): the dense shapes at the FP8 grid with a
  kernel map, and the expert shapes at the grouped grid — one grouped kernel if torch has one (none on sm90 here),
  else one block-scaled GEMM per expert (``impl``). m is padded to the multiple the library takes
  (:func:`block_m_align`: 4; ``m_run``). FLOPs as above, of the row's m.
* ``moe_block`` (:func:`bench_moe_block`): the engine's routed-expert block (``kernels/moe_block.py``) at
  Qwen3-235B width, one curve per part (``part``: ``routed`` = routing + permute + experts + unpermute, the
  ``moe_us`` calibration kind; ``layer`` = the router GEMM + ``routed``; ``router`` = router GEMM + top-k;
  ``router_gemm``, ``topk``, ``permute``, ``experts``, ``unpermute``), x = ``tokens`` entering the block.
* ``fp8_block_api`` (not timed): which block-scaled calls were tried and what each did.
* ``flash_prefill``: causal SDPA, one sequence of ``seq`` tokens, ``n_q_heads`` / ``n_kv_heads`` / ``head_dim``;
  FLOPs ``4*H*D*seq*(seq+1)/2`` (``sim.costs.attention``'s causal count).
* ``attn_decode``: SDPA (flash-decode style) with one query token per sequence over ``ctx`` cached tokens,
  ``batch`` sequences; KV bytes ``batch*ctx*2*Hkv*D*2`` (bf16), reported as ``GBps`` of KV read.
* ``attn_kernels`` (not timed): per decode batch, the kernels and launch grids the same SDPA call runs at every
  context of ``DECODE_MAP_CTX`` (``runs`` as for ``gemm_kernels``, each name followed by ``<<<grid>>>``).
* ``allreduce``: NCCL ``all_reduce`` (bf16 avg) of ``size_bytes`` per rank over all local GPUs, one process per
  GPU; per round the max over ranks.
* ``p2p_copy``: ``dst_on_gpu1.copy_(src_on_gpu0)`` of ``size_bytes`` (NVLink peer copy).

Timing (schema ``rackbed.measure/2``): per case, ``inner`` back-to-back calls (rotating over
``ceil(3 * L2 / set_bytes)`` input sets of fresh random data, so repeated calls do not hit L2) are captured in a
**CUDA graph**; a *round* is a spin kernel (``torch.cuda._sleep``: the host enqueues the round while the GPU is
still busy, so no launch gap is timed), one untimed replay, then CUDA events around ``replays`` replays. The
``rounds`` rounds of all cases of a curve are **interleaved** (round 1 of every size, then round 2, … alternating
direction), so a slow period of the GPU (clocks, a neighbour) spreads over the curve instead of biasing one size.
Each row reports ``median_us`` (median of the rounds), ``min_us`` / ``max_us`` / ``q1_us`` / ``q3_us`` and all
``rounds_us``, and ``timing``: ``graph``, ``events`` (CUDA events around eager calls after the same spin kernel:
used when capture fails, and for cross-device copies, whose stream hand-off cannot be captured) or ``host`` (CPU
dry run). Every device wait polls with a deadline (no unbounded synchronize); ``--budget-s`` skips what does not
fit; the JSON is rewritten after every curve, so a time-out keeps what was measured.
``--dry-run`` runs tiny sizes on CPU tensors (host clock) to test the plumbing; its numbers mean nothing.

Usage: ``python -m rackbed.kernels.bench.measure --out measure.json [--quick] [--dry-run] [--only ...] [--budget-s 210]``
(the command line is kept in the file's ``env.command``).
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
from collections import defaultdict
from datetime import date
from pathlib import Path

from rackbed.topology.outputs import entry_file, write_text

SCHEMA = "rackbed.measure/2"
#: Qwen3-235B-A22B shapes (hidden 4096, 64 query heads / 4 KV heads of 128, experts 1536 wide, 128 experts)
HIDDEN, N_Q_HEADS, N_KV_HEADS, HEAD_DIM, MOE_INTER = 4096, 64, 4, 128, 1536
#: (name, n, k): grouped expert GEMMs (gate+up, down)
GROUPED_SHAPES = (("gate_up", 2 * MOE_INTER, HIDDEN), ("down", HIDDEN, MOE_INTER))
#: (name, n, k): dense GEMMs — attention projections at TP=1 and TP=2 (QKV, O) and TP=4 (QKV)
DENSE_SHAPES = (("qkv_tp1", N_Q_HEADS * HEAD_DIM + 2 * N_KV_HEADS * HEAD_DIM, HIDDEN),
                ("o_tp1", HIDDEN, N_Q_HEADS * HEAD_DIM),
                ("qkv_tp2", N_Q_HEADS // 2 * HEAD_DIM + 2 * N_KV_HEADS // 2 * HEAD_DIM, HIDDEN),
                ("o_tp2", HIDDEN, N_Q_HEADS // 2 * HEAD_DIM),
                ("qkv_tp4", N_Q_HEADS // 4 * HEAD_DIM + 2 * N_KV_HEADS // 4 * HEAD_DIM, HIDDEN))
GROUPED_EXPERTS = 32
#: FP8 block scales (``fmt: fp8_block``): one fp32 scale per 1 x FP8_BLOCK activations and FP8_BLOCK x FP8_BLOCK
#: weights; a block-scaled product may differ from the fp32 product of the dequantised operands by this much
#: (relative Frobenius norm: bf16 output rounding)
FP8_BLOCK, FP8_BLOCK_MAX_RELERR = 128, 2e-2
#: the MoE block (``moe_block`` rows): Qwen3-235B's 128 experts, top-8, at these token counts, over MOE_SETS
#: rotating input sets (routings)
MOE_EXPERTS, MOE_TOP_K, MOE_SETS = 128, 8, 8
MOE_TOKENS = [2**p for p in range(11)]
L2_BYTES = 50 * 2**20  # H200 L2 (60 MB per torch; 50 MiB in topology.specs) — rotation target is 3x this
#: decode attention batches (sequences); the KV read per case is capped at DECODE_MAX_KV_BYTES
DECODE_BATCHES = (1, 4, 16, 64, 256)
DECODE_MAX_KV_BYTES = 2**31
#: all-reduce workers: how long the final barrier may take before a worker exits anyway, and how long the parent
#: waits for the workers to exit once the rows file exists before terminating them (s)
EXIT_BARRIER_S, EXIT_GRACE_S = 10.0, 20.0
#: the longest a single device wait may take before the case is abandoned (s)
WAIT_S = 60.0
#: GPU clock used to convert a spin length into torch.cuda._sleep cycles (H200 boost ~1.98 GHz)
SPIN_CYCLES_PER_US = 2000


def pow2(lo: int, hi: int) -> list[int]:
    """Powers of two from ``lo`` to ``hi`` inclusive."""
    return [2**p for p in range(int(math.log2(lo)), int(math.log2(hi)) + 1)]


def geo(lo: int, hi: int, per_octave: int = 2, mult: int = 1) -> list[int]:
    """Sizes from ``lo`` to ``hi`` spaced by ``2 ** (1 / per_octave)``, rounded to multiples of ``mult`` (used where
    curves have knees or kernel / protocol switches: a switch between two grid points is a step no fitted form
    can place, so the grid is dense where the library changes kernels)."""
    out, k = [], 0
    while lo * 2 ** (k / per_octave) <= hi * 1.0001:
        out.append(int(max(mult, round(lo * 2 ** (k / per_octave) / mult) * mult)))
        k += 1
    return sorted(set(out))


def sqrt2(lo: int, hi: int, mult: int = 1) -> list[int]:
    """Sizes from ``lo`` to ``hi`` spaced by sqrt(2), rounded to multiples of ``mult``."""
    return geo(lo, hi, 2, mult)


def grid(*parts: list[int]) -> list[int]:
    return sorted({x for p in parts for x in p})


#: the measured grids (full run); ``--quick`` takes every other point. Quarter-octave (2^(1/4)) spacing where the
#: /2 measurements showed kernel switches between √2 points: bf16 GEMM m = 176 vs 256 (cuBLAS), SDPA decode at
#: 256-1024 context, the 1-8 MiB copy regime; √2 elsewhere in the knee regions, doubling in the linear regimes.
GEMM_M = grid(pow2(1, 32), [48], geo(64, 1024, 4, 8), pow2(2048, 16384))
#: dense GEMMs (the /3 grid): every multiple of 8 up to 1024. cuBLAS changes kernel (tile, split-K, cluster) from
#: one multiple of 8 to the next and FP8's single 128x128 kernel runs a saw-tooth over each 128-row tile
#: (kernels/bench/probe.py, results/h200x2/probe/): no sparse grid can place that, so the curve is measured densely and
#: the kernel each m runs is recorded (``gemm_kernels`` rows, :func:`kernel_names`)
DENSE_M = grid([1, 2, 4], range(8, 1025, 8), pow2(2048, 16384))
#: bf16 dense GEMMs are timed at every m up to 1024: cuBLAS runs some kernels over fewer than 8 consecutive m
#: (``384x104`` at m = 513..520 on QKV), so a grid of multiples of 8 leaves kernels with no timed point and lands
#: on the single-m choices cuBLAS makes at multiples of 16 (v6: 5 held-out rows off by 12-25 %)
DENSE_M_BF16 = grid(range(1, 1025), pow2(2048, 16384))
#: decode-attention contexts whose kernels and launch grids are recorded (``attn_kernels`` rows): every 16 up to
#: 4096, every 128 above (SDPA's split-KV kernel changes its number of splits, not its name, with the context)
DECODE_MAP_CTX = list(range(16, 4097, 16)) + list(range(4224, 65537, 128))
#: a choice cuBLAS makes at no more than ``FORCED_RUN_M`` consecutive m (up to ``FORCED_TOP_M``) is also timed at
#: other m, its kernel run by choice through cuBLASLt (``gemm_forced`` rows, :func:`gemm_forced_cases`): from the
#: library's curve alone no held-out m of such a choice can be priced (v7: 37 kernels at one m each, up to 44 % off
#: their neighbours; v8: a kernel run at one m with other launch parameters than at its other m, 15 % slower)
FORCED_RUN_M, FORCED_TOP_M = 2, 1024
#: where a short run's kernel is forced: at the run's m plus these offsets (the M tile of the kernels concerned is
#: 16-384 rows, so some of the points share the run's block of M tiles)
FORCED_OFFSETS = (-24, -16, -8, 8, 16, 24)
#: a forced kernel's product may differ from ``torch.matmul``'s by this much (relative Frobenius norm; bf16 output
#: rounding and another split-K order: v10's largest was below 1e-3)
FORCED_MAX_RELERR = 1e-2
#: token counts whose kernel choice is recorded: every m up to 1024, then every multiple of 64 up to 16384
KERNEL_MAP_M = list(range(1, 1025)) + list(range(1088, 16385, 64))
GROUPED_M = grid(pow2(1, 16), [24], geo(32, 512, 4, 8), pow2(1024, 2048))
FLASH_SEQ = grid([256, 512], sqrt2(1024, 16384, 128))
DECODE_CTX = grid(geo(256, 4096, 4, 16), sqrt2(4096, 65536, 256))
#: copies: quarter-octave through the small-copy regime change (0.25-16 MiB), √2 above, 4 GiB last
HBM_SIZES = grid(geo(2**18, 2**24, 4, 4096), sqrt2(2**24, 2**31, 4096), [2**32])

P2P_SIZES = grid(sqrt2(2**12, 2**26, 256), pow2(2**27, 2**30))
ALLREDUCE_SIZES = grid(pow2(4096, 16384), sqrt2(32768, 8 * 2**20, 256), pow2(16 * 2**20, 256 * 2**20))


def _sizes(full: list, quick: bool, dry: bool, dry_list: list):
    if dry:
        return dry_list
    return full[::2] if quick else full


class Budget:
    """Wall-clock budget of the whole run: benchmarks check ``left()`` and skip what would not fit."""

    def __init__(self, seconds: float | None):
        self.t0, self.s = time.time(), seconds

    def left(self) -> float:
        return math.inf if self.s is None else self.s - (time.time() - self.t0)


def wait_event(ev, what: str = "", limit_s: float = WAIT_S) -> None:
    """Poll a CUDA event until it completes; TimeoutError after ``limit_s`` (never an unbounded wait)."""
    t0 = time.time()
    while not ev.query():
        if time.time() - t0 > limit_s:
            raise TimeoutError(f"device wait over {limit_s:.0f} s ({what})")
        time.sleep(2e-5)


def sync(device: str | int | None = None, limit_s: float = WAIT_S) -> None:
    """A bounded ``torch.cuda.synchronize`` of the current stream of ``device`` (event + poll)."""
    import torch

    if isinstance(device, str) and not device.startswith("cuda"):
        return
    with torch.cuda.device(device if device is not None else torch.cuda.current_device()):
        ev = torch.cuda.Event()
        ev.record()
        wait_event(ev, "sync", limit_s)


class Prepared:
    """One case ready to time: ``fns`` (rotated), ``inner`` calls per graph / timed block, ``replays``."""

    def __init__(self, fns, inner, replays, graph, mode, est_us):
        self.fns, self.inner, self.replays, self.graph, self.mode, self.est_us = fns, inner, replays, graph, mode, est_us


class Timer:
    """Graph-replay / event / host timing of a list of zero-arg callables (see the module docstring).

    ``prepare(fns)`` warms up, probes the time per call, picks ``inner`` (one graph ~ ``graph_us`` of work, at
    most 64 calls) and ``replays`` (one round ~ ``round_us``) and captures the graph; ``round(p)`` returns the
    time per call (µs) of one round."""

    def __init__(self, device: str, rounds: int = 9, warmup: int = 3, graph_us: float = 250.0,
                 round_us: float = 1500.0, graphs: bool = True):
        self.device, self.rounds, self.warmup = device, rounds, warmup
        self.graph_us, self.round_us, self.graphs = graph_us, round_us, graphs
        self.cuda = device.startswith("cuda")

    # ------------------------------------------------------------------ preparation
    def prepare(self, fns: list, *, graph: bool | None = None, inner: int | None = None,
                replays: int | None = None) -> Prepared:
        import torch

        n = len(fns)
        for i in range(max(self.warmup, n)):
            fns[i % n]()
        self._sync()
        if inner is None or replays is None:
            est = self._eager(fns, 0, n) / n  # probe: one pass over the sets
            est = min(est, self._eager(fns, 0, n) / n)
        else:
            est = 0.0
        if inner is None:
            inner = max(1, min(64, math.ceil(self.graph_us / max(est, 1e-3))))
        if replays is None:
            replays = max(1, min(50, math.ceil(self.round_us / max(inner * est, 1e-3))))
        g, mode = None, ("events" if self.cuda else "host")
        capture = self.cuda and self.graphs and graph is not False
        if not capture and self.cuda and inner * replays > 256:  # eager rounds: keep the host ahead of the spin
            replays = max(1, 256 // inner)
        if capture:
            try:
                s = torch.cuda.Stream()
                s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):
                    for i in range(n):
                        fns[i]()
                torch.cuda.current_stream().wait_stream(s)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    for i in range(inner):
                        fns[i % n]()
                g.replay()
                self._sync()
                mode = "graph"
            except Exception:  # noqa: BLE001 — not capturable: time eager calls after the spin kernel instead
                g = None
                self._sync()
        return Prepared(fns, inner, replays, g, mode, est)

    # ------------------------------------------------------------------ timing
    def round(self, p: Prepared) -> float:
        """Time per call (µs) of one round of ``p``."""
        import torch

        if not self.cuda:
            return self._eager(p.fns, 0, p.inner * p.replays) / (p.inner * p.replays)
        launches = p.replays + 1 if p.graph is not None else (p.replays + 1) * p.inner
        torch.cuda._sleep(int(SPIN_CYCLES_PER_US * min(20000.0, 50.0 + 25.0 * launches)))
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if p.graph is not None:
            p.graph.replay()  # untimed: lines up collectives' ranks, settles the first replay
            a.record()
            for _ in range(p.replays):
                p.graph.replay()
            b.record()
        else:
            n = len(p.fns)
            for i in range(p.inner):
                p.fns[i % n]()
            a.record()
            for r in range(p.replays):
                for i in range(p.inner):
                    p.fns[i % n]()
            b.record()
        wait_event(b, "timed round")
        return a.elapsed_time(b) * 1e3 / (p.inner * p.replays)

    def _sync(self) -> None:
        if self.cuda:
            sync(self.device)

    def _eager(self, fns, start: int, calls: int) -> float:
        import torch

        n = len(fns)
        if self.cuda:
            torch.cuda._sleep(int(SPIN_CYCLES_PER_US * min(20000.0, 50.0 + 12.0 * calls)))
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for i in range(calls):
                fns[(start + i) % n]()
            b.record()
            wait_event(b, "probe")
            return a.elapsed_time(b) * 1e3
        t = time.perf_counter()
        for i in range(calls):
            fns[(start + i) % n]()
        return (time.perf_counter() - t) * 1e6


def round_stats(times: list[float]) -> dict:
    """Median of the rounds and their spread (min / max / quartiles), µs."""
    s = sorted(times)
    q = statistics.quantiles(s, n=4, method="inclusive") if len(s) > 1 else [s[0]] * 3
    return {"median_us": statistics.median(s), "min_us": s[0], "max_us": s[-1], "q1_us": q[0], "q3_us": q[2],
            "rounds": len(s), "rounds_us": [round(t, 4) for t in times]}


def measure_curve(timer: Timer, cases: list[tuple[dict, list]], echo=print, label: str = "",
                  budget: Budget | None = None, graph: bool | None = None) -> list[dict]:
    """Time every ``(row, fns)`` case of one curve with interleaved rounds; returns the rows with the timing
    fields filled in (rows whose case failed carry ``error``)."""
    preps: list[Prepared | None] = []
    out = []
    for row, fns in cases:
        try:
            preps.append(timer.prepare(fns, graph=graph))
        except Exception as exc:
            if not timer.cuda:
                raise
            preps.append(None)
            row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    times: list[list[float]] = [[] for _ in cases]
    for r in range(timer.rounds):
        if budget is not None and budget.left() < 5 and r >= 3:
            echo(f"measure: {label}: budget nearly spent, stopping after {r} rounds")
            break
        order = range(len(cases)) if r % 2 == 0 else range(len(cases) - 1, -1, -1)
        for i in order:
            if preps[i] is None:
                continue
            try:
                times[i].append(timer.round(preps[i]))
            except Exception as exc:
                if not timer.cuda:
                    raise
                preps[i] = None
                cases[i][0]["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    for (row, _), p, ts in zip(cases, preps, times):
        if p is not None and ts:
            row.update(round_stats(ts))
            row.update(inner=p.inner, replays=p.replays, timing=p.mode)
        out.append(row)
    ok = [r for r in out if "median_us" in r]
    spread = [(r["max_us"] - r["min_us"]) / r["median_us"] for r in ok]
    echo(f"measure: {label}: {len(ok)}/{len(out)} cases, {timer.rounds} rounds, max round spread "
         f"{max(spread) * 100 if spread else 0:.1f}% ({ok[0]['timing'] if ok else '-'})")
    return out


def _n_sets(set_bytes: float) -> int:
    return max(1, min(8, math.ceil(3 * L2_BYTES / max(set_bytes, 1))))


def _randn(shape, dtype, device, gen):
    import torch

    return torch.randn(shape, generator=gen, device=device, dtype=torch.float32).to(dtype)


def _rates(row: dict, work: float | None = None, rate: str = "GBps") -> dict:
    """Add the derived rate (``GBps`` or ``tflops``) of ``work`` bytes / FLOPs to a timed row."""
    if "median_us" in row and work is not None:
        row[rate] = work / row["median_us"] / (1e6 if rate == "tflops" else 1e3)
    return row


def kernel_names(calls, marker_fn, is_marker, grid: bool = False) -> list[tuple[str, ...]]:
    """The CUDA kernels each zero-arg callable in ``calls`` launches, in launch order: one profiled pass with
    ``marker_fn`` (a tiny kernel whose name ``is_marker`` recognises) before every call and after the last.
    ``grid``: each name followed by its launch grid, ``name<<<x,y,z>>>`` (from the profiler's trace export: a
    split-KV attention kernel keeps its name when its number of splits changes)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    for c in calls[:4]:
        c()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for c in calls:
            marker_fn()
            c()
        marker_fn()
        torch.cuda.synchronize()
    evs = []
    if grid:
        fd, path = tempfile.mkstemp(suffix=".json")
        os.close(fd)
        try:
            prof.export_chrome_trace(path)
            with open(path) as f:
                trace = json.load(f)
        finally:
            os.unlink(path)
        for e in trace.get("traceEvents", []):
            if str(e.get("cat", "")).lower() != "kernel" or e.get("ph") != "X":
                continue
            g = e.get("args", {}).get("grid")
            gs = ",".join(str(v) for v in g) if isinstance(g, (list, tuple)) else "?"
            evs.append((float(e["ts"]), f"{e['name']}<<<{gs}>>>"))
    else:
        for e in prof.profiler.kineto_results.events():
            if e.device_type() != torch.autograd.DeviceType.CUDA:
                continue
            name = e.name()
            if name.startswith(("Memcpy", "Memset", "[memory]")):
                continue
            evs.append((e.start_ns(), name))
    evs.sort()
    out: list[list[str]] = []
    cur: list[str] | None = None
    for _, name in evs:
        if is_marker(name):
            if cur is not None:
                out.append(cur)
            cur = []
        elif cur is not None:
            cur.append(name)
    if len(out) != len(calls):
        raise RuntimeError(f"kernel_names: {len(out)} marker intervals for {len(calls)} calls")
    return [tuple(x) for x in out]


def runs_of(ms: list[int], names: list[tuple[str, ...]]) -> list[list]:
    """Run-length encoding ``[[m_first, m_last, kernels], ...]`` of a kernel choice over increasing ``ms``."""
    out: list[list] = []
    for m, k in zip(ms, names):
        key = " + ".join(k)
        if out and out[-1][2] == key:
            out[-1][1] = m
        else:
            out.append([m, m, key])
    return out



def gemm_kernel_map(device, name: str, n: int, k: int, fmt: str, w, gen) -> dict:
    """The ``gemm_kernels`` row of one dense curve: the kernels ``A[m, k] @ w[n, k]^T`` launches at every ``m`` of
    ``KERNEL_MAP_M`` (run-length encoded, :func:`runs_of`), the same calls as the timed rows (bf16 ``matmul``, FP8
    ``_scaled_mm`` with row-wise scales), on slices of one input."""
    import torch

    x = _randn((max(KERNEL_MAP_M), k), torch.bfloat16, device, gen)
    if fmt == "fp8":
        sx = (x.float().abs().amax(1, keepdim=True) / 448).contiguous()
        xq = (x.float() / sx).to(torch.float8_e4m3fn)
        wq = (w.float() / (w.float().abs().amax(1, keepdim=True) / 448)).to(torch.float8_e4m3fn)
        sw = (w.float().abs().amax(1) / 448)[None, :].contiguous()

    def call(m):
        if fmt == "bf16":
            a = x[:m].contiguous()
            return lambda: torch.matmul(a, w.t())
        a, sa = xq[:m].contiguous(), sx[:m].contiguous()
        return lambda: torch._scaled_mm(a, wq.t(), scale_a=sa, scale_b=sw, out_dtype=torch.bfloat16)

    marker = torch.zeros(1, device=device, dtype=torch.int32)
    names = kernel_names([call(m) for m in KERNEL_MAP_M], lambda: marker.fill_(7), lambda s: "FillFunctor" in s)
    return {"bench": "gemm_kernels", "op": "dense", "fmt": fmt, "shape": name, "n": n, "k": k,
            "runs": runs_of(KERNEL_MAP_M, names)}


def short_runs(runs: list, top: int = FORCED_TOP_M, longest: int = FORCED_RUN_M) -> list[tuple[str, list[int]]]:
    """``[(kernels, [m, ...]), ...]``: the runs of a ``gemm_kernels`` map (``runs``) over at most ``longest``
    consecutive m, all up to ``top`` — choices the library makes at one or two m. A kernel it also runs elsewhere
    may run there with other launch parameters (v8, 4096 x 4096: ``128x64_64x8_1x2_h`` at m = 224 is 15 % slower
    than at m = 240, the same kernel over the same M tiles), so each run is forced on its own."""
    return [(str(kn), list(range(int(a), int(b) + 1))) for a, b, kn in runs
            if int(b) <= top and int(b) - int(a) + 1 <= longest]


def forced_ms(at: list[int], top: int = FORCED_TOP_M, offsets=FORCED_OFFSETS) -> list[int]:
    """The m where a run at ``at`` is forced: ``at`` plus ``offsets``, within 1..``top``, without ``at`` (those rows
    would time what the library's own rows time). The m where the library runs the same kernel in another run are
    kept: it may run it there with other launch parameters (v9, 4096 x 4096: ``64x64_64x13_2x1_v`` forced with
    m = 128's choice runs 16.3 µs at m = 104 and 13.9 µs at 128, in the same M tiles; skipping 112 and 120 left
    m = 128 priced from 104 alone, 18 % off)."""
    return sorted({m + d for m in at for d in offsets if 1 <= m + d <= top} - set(at))


def gemm_forced_cases(device, name: str, n: int, k: int, runs: list, ws: list, xs: list) -> tuple[list, list]:
    """``(error_rows, cases)``: the ``gemm_forced`` cases of one bf16 dense shape, to be timed in the same
    interleaved curve as the library's own rows (so both see the same clocks: timed in a short curve of their own
    after the library's, v8's forced kernels ran up to 17 % faster than the library's call of the same kernel at
    the same m). The kernel of every short run of the shape's map (:func:`short_runs`) at :func:`forced_ms`, run by choice
    (``kernels/cublaslt.py``: the heuristic's candidate at the kernel's m that launches the same kernels, found
    under the profiler), on the library rows' rotating weight sets ``ws`` and inputs ``xs`` (slices of their
    first rows). Each row names the kernel, the run's m (``library_m``) and what the library runs at the row's m
    (``library_kernel``); a run no candidate reproduces is an ``error`` row. One case per run at its first m
    (``check: true``) times the forced kernel where the library picks it, to show that the two agree: calibration
    never reads those."""
    import torch

    from rackbed.kernels.cublaslt import CublasLt

    groups = short_runs(runs)
    if not groups:
        return [], []
    lt = CublasLt.shared()
    top = FORCED_TOP_M
    ys = [torch.empty((top, n), dtype=torch.bfloat16, device=device) for _ in ws]
    lib_kernel = {m: kn for a, b, kn in runs for m in range(int(a), min(int(b), top) + 1)}
    calls, owners = [], []
    for g, (kn, at) in enumerate(groups):
        for m0 in at:
            for rank, algo in enumerate(lt.candidates(n, k, m0)):
                calls.append(lambda x=xs[0][:m0], y=ys[0][:m0], a=algo: lt.matmul(x, ws[0], y, a))
                owners.append((g, m0, rank, algo))
    marker = torch.zeros(1, device=device, dtype=torch.int32)
    names = kernel_names(calls, lambda: marker.fill_(7), lambda s: "FillFunctor" in s) if calls else []
    chosen: dict[int, tuple[int, int, object]] = {}
    tried: dict[int, int] = defaultdict(int)
    seen: dict[int, list[str]] = defaultdict(list)
    for (g, m0, rank, algo), nm in zip(owners, names):
        tried[g] += 1
        if " + ".join(nm) not in seen[g]:
            seen[g].append(" + ".join(nm))
        if g not in chosen and " + ".join(nm) == groups[g][0]:
            chosen[g] = (m0, rank, algo)
    errors, cases = [], []
    for g, (kn, at) in enumerate(groups):
        base = {"bench": "gemm_forced", "op": "dense", "fmt": "bf16", "shape": name, "n": n, "k": k, "kernel": kn,
                "library_m": at, "n_experts": 1}
        if g not in chosen:
            errors.append({**base, "error": f"none of the {tried[g]} cuBLASLt heuristic candidates at m = "
                                            f"{', '.join(map(str, at))} launches this kernel",
                           "candidates": [c[:120] for c in seen[g][:8]]})
            continue
        m0, rank, algo = chosen[g]
        for m in [m0, *forced_ms(at)]:
            row = {**base, "m": m, "library_kernel": lib_kernel.get(m), "heuristic_rank": rank}
            if m == m0:
                row["check"] = True
            if not lt.supports(algo, n, k, m):
                errors.append({**row, "error": "cuBLASLt: the algorithm does not run this size"})
                continue
            fns = [(lambda x=x[:m], w=w, y=y[:m], a=algo: lt.matmul(x, w, y, a)) for x, w, y in zip(xs, ws, ys)]
            fns[0]()
            ref = torch.matmul(xs[0][:m], ws[0].t()).float()
            row["relerr"] = ((ys[0][:m].float() - ref).norm() / ref.norm()).item()
            if not row["relerr"] <= FORCED_MAX_RELERR:  # a wrong product is not a timing of this GEMM
                errors.append({**row, "error": f"forced result differs from torch.matmul by {row['relerr']:.2g}"})
                continue
            cases.append((row, fns))
    return errors, cases


# ------------------------------------------------------------------------------------------------ benchmarks

def bench_hbm(device, timer, quick, dry, gen, echo, budget) -> list[dict]:
    import torch

    cases = []
    for sz in _sizes(HBM_SIZES, quick, dry, [2**12, 2**16]):
        n = sz // 2
        src = [_randn((n,), torch.bfloat16, device, gen) for _ in range(_n_sets(2 * sz))]
        dst = [torch.empty_like(s) for s in src]
        fns = [(lambda s=s, d=d: d.copy_(s)) for s, d in zip(src, dst)]
        fns[0]()
        assert torch.equal(dst[0], src[0])
        cases.append(({"bench": "hbm_copy", "kernel": "memcpy", "size_bytes": sz, "bytes": 2 * sz}, fns))
        # the same traffic through an elementwise kernel (what memory-bound model ops run), not the driver's
        # device-to-device memcpy that ``copy_`` calls: the memcpy runs at 2.75 or 4.25 TB/s by size above 512 MiB
        # (results/h200x2/probe/probe_v2_copy.json)
        efns = [(lambda s=s, d=d: torch.neg(s, out=d)) for s, d in zip(src, dst)]
        cases.append(({"bench": "hbm_copy", "kernel": "elementwise", "size_bytes": sz, "bytes": 2 * sz}, efns))
    rows = measure_curve(timer, cases, echo, "hbm_copy", budget)
    return [_rates(r, work=r["bytes"]) for r in rows]


def bench_gemm(device, timer, quick, dry, gen, echo, budget) -> list[dict]:
    import torch

    rows = []
    ms = _sizes(DENSE_M, quick, dry, [1, 2, 4, 8])
    ms_bf16 = _sizes(DENSE_M_BF16, quick, dry, [1, 2, 3, 4, 8])
    shapes = DENSE_SHAPES if not dry else (("tiny_a", 48, 32), ("tiny_b", 32, 64))
    for name, n, k in shapes:
        if budget.left() < 10:
            rows.append({"bench": "gemm", "op": "dense", "shape": name, "error": "skipped: time budget"})
            continue
        ws = [_randn((n, k), torch.bfloat16, device, gen) for _ in range(_n_sets(n * k * 2))]
        # inputs: the first m rows of one buffer per weight set (contiguous views; a tensor per m would need
        # ~70 GB at every m up to 1024)
        big = [_randn((max(ms_bf16), k), torch.bfloat16, device, gen) for _ in range(len(ws))]
        cases = []
        for m in ms_bf16:
            fns = [(lambda x=b[:m], w=w: torch.matmul(x, w.t())) for b, w in zip(big, ws)]
            cases.append(({"bench": "gemm", "op": "dense", "fmt": "bf16", "shape": name, "m": m, "n": n, "k": k,
                           "n_experts": 1}, fns))
        # the kernel map first: the kernels of its short runs are forced in the same curve (gemm_forced_cases)
        maps = _kernel_map_rows(device, name, n, k, ("bf16", "fp8"), ws[0], gen, quick, echo)
        rows.extend(maps)
        for mp in maps:
            if mp["fmt"] == "bf16" and mp.get("runs"):
                t0 = time.time()
                try:
                    errors, forced = gemm_forced_cases(device, name, n, k, mp["runs"], ws, big)
                except Exception as exc:  # noqa: BLE001 — recorded, not fatal
                    errors, forced = [{"bench": "gemm_forced", "op": "dense", "fmt": "bf16", "shape": name, "n": n,
                                       "k": k, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}], []
                echo(f"measure: gemm forced bf16 {name}: {len(forced)} cases, {len(errors)} errors "
                     f"({time.time() - t0:.1f} s)")
                rows.extend(errors)
                cases.extend(forced)
        cases.sort(key=lambda c: c[0]["m"])  # a forced case is timed between the library's cases next to it
        for r in measure_curve(timer, cases, echo, f"gemm bf16 {name}", budget):
            rows.append(_rates(r, work=2.0 * r["m"] * n * k, rate="tflops"))
        del cases, big
        # FP8 E4M3, row-wise scales (torch._scaled_mm needs CUDA and dims divisible by 16)
        if device.startswith("cuda") and hasattr(torch, "_scaled_mm"):
            try:
                wq = [(w.float() / (w.float().abs().amax(1, keepdim=True) / 448)).to(torch.float8_e4m3fn) for w in ws]
                sw = [(w.float().abs().amax(1) / 448)[None, :].contiguous() for w in ws]  # [1, n]
                cases = []
                for m in [x for x in ms if x >= 16]:
                    xs = [_randn((m, k), torch.bfloat16, device, gen) for _ in range(len(ws))]
                    sx = [(x.float().abs().amax(1, keepdim=True) / 448).contiguous() for x in xs]  # [m, 1]
                    xq = [(x.float() / s).to(torch.float8_e4m3fn) for x, s in zip(xs, sx)]
                    fns = [(lambda a=a, sa=sa, b=b, sb=sb: torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb,
                                                                              out_dtype=torch.bfloat16))
                           for a, sa, b, sb in zip(xq, sx, wq, sw)]
                    ref = xs[0].float() @ ws[0].float().t()
                    rel = ((fns[0]().float() - ref).norm() / ref.norm()).item()
                    cases.append(({"bench": "gemm", "op": "dense", "fmt": "fp8", "shape": name, "m": m, "n": n,
                                   "k": k, "n_experts": 1, "relerr": rel}, fns))
                for r in measure_curve(timer, cases, echo, f"gemm fp8 {name}", budget):
                    rows.append(_rates(r, work=2.0 * r["m"] * n * k, rate="tflops"))
                del cases
            except Exception as exc:  # noqa: BLE001 — recorded, not fatal
                rows.append({"bench": "gemm", "op": "dense", "fmt": "fp8", "shape": name,
                             "error": f"{type(exc).__name__}: {str(exc)[:200]}"})
        del ws
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    return rows


def _kernel_map_rows(device, name, n, k, fmts, w, gen, quick, echo) -> list[dict]:
    """``gemm_kernels`` rows (:func:`gemm_kernel_map`) of a dense shape; none on the CPU or with ``--quick``; a
    failure (no profiler) is an ``error`` row, not fatal."""
    if not device.startswith("cuda") or quick:
        return []
    out = []
    for fmt in fmts:
        t0 = time.time()
        try:
            row = gemm_kernel_map(device, name, n, k, fmt, w, gen)
            echo(f"measure: gemm kernels {fmt} {name}: {len(row['runs'])} runs over m = 1..{KERNEL_MAP_M[-1]} "
                 f"({time.time() - t0:.1f} s)")
        except Exception as exc:  # noqa: BLE001 — recorded, not fatal
            row = {"bench": "gemm_kernels", "op": "dense", "fmt": fmt, "shape": name, "n": n, "k": k,
                   "error": f"{type(exc).__name__}: {str(exc)[:200]}"}
        out.append(row)
    return out


def bench_grouped(device, timer, quick, dry, gen, echo, budget) -> list[dict]:
    import torch

    rows = []
    E = GROUPED_EXPERTS if not dry else 4
    ms = _sizes(GROUPED_M, quick, dry, [1, 2, 4, 8])
    shapes = GROUPED_SHAPES if not dry else (("tiny_gu", 48, 32), ("tiny_dn", 32, 24))
    for name, n, k in shapes:
        if budget.left() < 10:
            rows.append({"bench": "gemm", "op": "grouped", "shape": name, "error": "skipped: time budget"})
            continue
        ws = [_randn((E, n, k), torch.bfloat16, device, gen) for _ in range(_n_sets(E * n * k * 2))]
        cases = []
        for m in ms:
            offs = torch.arange(1, E + 1, device=device, dtype=torch.int32) * m
            xs = [_randn((m * E, k), torch.bfloat16, device, gen) for _ in range(len(ws))]
            fns = [(lambda x=x, w=w, o=offs: torch._grouped_mm(x, w.transpose(1, 2), offs=o)) for x, w in zip(xs, ws)]
            row = {"bench": "gemm", "op": "grouped", "fmt": "bf16", "shape": name, "m": m, "n": n, "k": k,
                   "n_experts": E}
            try:
                got = fns[0]()
                ref = torch.cat([xs[0][e * m:(e + 1) * m].float() @ ws[0][e].float().t() for e in range(E)])
                row["relerr"] = ((got.float() - ref).norm() / ref.norm()).item()
            except Exception as exc:
                if dry:
                    raise
                rows.append({**row, "error": f"{type(exc).__name__}: {str(exc)[:200]}"})
                continue
            cases.append((row, fns))
        for r in measure_curve(timer, cases, echo, f"grouped bf16 {name}", budget):
            rows.append(_rates(r, work=2.0 * r["m"] * E * n * k, rate="tflops"))
        del ws, cases
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    return rows


# ------------------------------------------------------------------------------------- FP8 with block scales

def quantize_1x128(x):
    """FP8 E4M3 with one fp32 scale per row and 128-wide K block (DeepSeek-style activations): ``(q [m, k],
    s [m, k/128])``, value = q * s; ``s`` column-major (stride ``(1, m)``, the layout ``torch._scaled_mm`` reads
    1x128 scales in)."""
    import torch

    m, k = x.shape
    xf = x.float().view(m, k // FP8_BLOCK, FP8_BLOCK)
    s = (xf.abs().amax(-1) / 448.0).clamp(min=1e-12)
    q = (xf / s[..., None]).view(m, k).to(torch.float8_e4m3fn)
    return q, s.t().contiguous().t()


def quantize_128x128(w):
    """FP8 E4M3 with one fp32 scale per 128x128 block (DeepSeek-style weights): ``(q [n, k], s [n/128, k/128])``,
    ``s`` row-major."""
    import torch

    n, k = w.shape
    wf = w.float().view(n // FP8_BLOCK, FP8_BLOCK, k // FP8_BLOCK, FP8_BLOCK)
    s = (wf.abs().amax(dim=(1, 3)) / 448.0).clamp(min=1e-12)
    q = (wf / s[:, None, :, None]).view(n, k).to(torch.float8_e4m3fn)
    return q, s.contiguous()


def col_major(s):
    """``s`` with the same values, column-major (1x128 scales of a row slice must be laid out for their own m)."""
    return s.t().contiguous().t()


def dequant_block(q, s):
    """fp32 value of a block-quantised tensor (either scale layout; the block shape is read off the shapes)."""
    m, k = q.shape
    return q.float() * s.float().repeat_interleave(m // s.shape[0], 0).repeat_interleave(k // s.shape[1], 1)


def _block_calls() -> list[tuple[str, object]]:
    """The block-scaled GEMM calls :func:`block_scaled_api` tries, in order: ``(name, call(a, sa, w, sw))`` with
    ``a [m, k]`` / ``sa`` from :func:`quantize_1x128`, ``w [n, k]`` / ``sw`` from :func:`quantize_128x128`."""
    import torch
    import torch.nn.functional as F

    bf = torch.bfloat16
    calls = [("torch._scaled_mm(scale_b=sw.t())",
              lambda a, sa, w, sw: torch._scaled_mm(a, w.t(), scale_a=sa, scale_b=sw.t(), out_dtype=bf)),
             ("torch._scaled_mm(scale_b=sw)",
              lambda a, sa, w, sw: torch._scaled_mm(a, w.t(), scale_a=sa, scale_b=sw, out_dtype=bf))]
    st = getattr(F, "ScalingType", None)
    if hasattr(F, "scaled_mm") and hasattr(st, "BlockWise1x128"):
        calls += [("F.scaled_mm(BlockWise1x128, BlockWise128x128, sw.t())",
                   lambda a, sa, w, sw: F.scaled_mm(a, w.t(), sa, st.BlockWise1x128, sw.t(), st.BlockWise128x128,
                                                    output_dtype=bf)),
                  ("F.scaled_mm(BlockWise1x128, BlockWise128x128, sw)",
                   lambda a, sa, w, sw: F.scaled_mm(a, w.t(), sa, st.BlockWise1x128, sw, st.BlockWise128x128,
                                                    output_dtype=bf))]
    return calls


def _relerr(out, ref) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()


def block_scaled_api(device, gen, echo=print) -> tuple[str | None, object, list[dict]]:
    """``(name, call, tried)``: the first of :func:`_block_calls` that runs here and matches the fp32 product of
    the dequantised operands (relative error <= ``FP8_BLOCK_MAX_RELERR``) at m = 256 and at m = 16; ``tried``: what
    each candidate did (kept in the measurement file). ``(None, None, tried)`` when none works."""
    import torch

    w, sw = quantize_128x128(_randn((384, 512), torch.bfloat16, device, gen))
    probes = []
    for m in (256, 16):
        a, sa = quantize_1x128(_randn((m, 512), torch.bfloat16, device, gen))
        probes.append((a, sa, dequant_block(a, sa) @ dequant_block(w, sw).t()))
    tried = []
    for name, call in _block_calls():
        try:
            rel = max(_relerr(call(a, sa, w, sw), ref) for a, sa, ref in probes)
            sync(device)
            tried.append({"call": name, "relerr": rel})
            if rel <= FP8_BLOCK_MAX_RELERR:
                echo(f"measure: fp8_block: {name} (relerr {rel:.1e})")
                return name, call, tried
        except Exception as exc:  # noqa: BLE001 — the next candidate
            tried.append({"call": name, "error": f"{type(exc).__name__}: {str(exc)[:200]}"})
    echo(f"measure: fp8_block: no block-scaled GEMM call runs here: {tried}")
    return None, None, tried


def block_m_align(device, call, gen) -> tuple[int, list[int]]:
    """``(align, refused)``: the smallest of 1, 2, 4, 8, 16 such that ``call`` (:func:`block_scaled_api`) runs at
    every multiple of it up to 32 rows, and the m in 1..32 it refuses. (H200, torch 2.11 / CUDA 13.0: cuBLASLt's
    block-scaled kernels have no heuristic for m = 1, 2 — ``CUBLAS_STATUS_NOT_SUPPORTED`` — so an engine pads the
    rows; the measurement pads each m to the next multiple of ``align`` and reports the m it ran, ``m_run``.)"""
    import torch

    w, sw = quantize_128x128(_randn((256, 256), torch.bfloat16, device, gen))
    a, sa = quantize_1x128(_randn((32, 256), torch.bfloat16, device, gen))
    refused = []
    for m in range(1, 33):
        try:
            call(a[:m], col_major(sa[:m]), w, sw)
            sync(device)
        except Exception:  # noqa: BLE001 — refused: recorded
            refused.append(m)
    align = next((g for g in (1, 2, 4, 8, 16) if not any(m % g == 0 for m in refused)), 32)
    return align, refused


def _pad(m: int, align: int) -> int:
    return -(-m // align) * align


def grouped_block_api(device, gen, echo=print) -> tuple[str | None, object, list[dict]]:
    """``(name, call(x, sx, wq, sw, offs), tried)``: a grouped block-scaled kernel of torch that runs here and
    matches the fp32 reference (``x [R, k]`` / ``sx [R, k/128]`` as :func:`quantize_1x128`, ``wq [E, n, k]``,
    ``sw [E, n/128, k/128]``, ``offs`` int32 end rows), or ``(None, None, tried)``: then the experts are timed as
    one block-scaled GEMM per expert (:func:`bench_fp8_block`)."""
    import torch
    import torch.nn.functional as F

    st = getattr(F, "ScalingType", None)
    tried: list[dict] = []
    cands = []
    if hasattr(F, "scaled_grouped_mm") and hasattr(st, "BlockWise1x128"):
        cands += [("F.scaled_grouped_mm(BlockWise1x128, BlockWise128x128)",
                   lambda x, sx, wq, sw, offs: F.scaled_grouped_mm(x, wq.transpose(1, 2), sx, st.BlockWise1x128, sw,
                                                                   st.BlockWise128x128, offs=offs,
                                                                   output_dtype=torch.bfloat16)),
                  ("F.scaled_grouped_mm(BlockWise1x128, BlockWise128x128, sw.transpose(1, 2))",
                   lambda x, sx, wq, sw, offs: F.scaled_grouped_mm(x, wq.transpose(1, 2), sx, st.BlockWise1x128,
                                                                   sw.transpose(1, 2), st.BlockWise128x128,
                                                                   offs=offs, output_dtype=torch.bfloat16))]
    if hasattr(torch, "_scaled_grouped_mm"):
        cands += [("torch._scaled_grouped_mm(1x128, 128x128)",
                   lambda x, sx, wq, sw, offs: torch._scaled_grouped_mm(x, wq.transpose(1, 2), sx, sw, offs=offs,
                                                                        out_dtype=torch.bfloat16))]
    if not cands:
        return None, None, tried
    E, m, n, k = 4, 128, 256, 512
    x, sx = quantize_1x128(_randn((E * m, k), torch.bfloat16, device, gen))
    wq, sw = (torch.stack(t) for t in zip(*[quantize_128x128(_randn((n, k), torch.bfloat16, device, gen))
                                            for _ in range(E)]))
    offs = torch.arange(1, E + 1, device=device, dtype=torch.int32) * m
    ref = torch.cat([dequant_block(x[e * m:(e + 1) * m], sx[e * m:(e + 1) * m]) @ dequant_block(wq[e], sw[e]).t()
                     for e in range(E)])
    for name, call in cands:
        try:
            rel = _relerr(call(x, sx, wq, sw, offs), ref)
            sync(device)
            tried.append({"call": name, "relerr": rel})
            if rel <= FP8_BLOCK_MAX_RELERR:
                echo(f"measure: fp8_block grouped: {name} (relerr {rel:.1e})")
                return name, call, tried
        except Exception as exc:  # noqa: BLE001 — the next candidate, else the per-expert loop
            tried.append({"call": name, "error": f"{type(exc).__name__}: {str(exc)[:200]}"})
    echo(f"measure: fp8_block grouped: no grouped block-scaled kernel runs here ({len(tried)} tried): one "
         "block-scaled GEMM per expert")
    return None, None, tried


def bench_fp8_block(device, timer, quick, dry, gen, echo, budget) -> list[dict]:
    """FP8 E4M3 GEMMs with block scales (``fmt: fp8_block``: 1x128 activation scales, 128x128 weight scales, fp32):
    the dense shapes of the fp8 rows (``DENSE_SHAPES``, m >= 16 of ``DENSE_M``, with a kernel map) and the grouped
    expert shapes (``GROUPED_SHAPES``, ``GROUPED_EXPERTS`` experts, ``GROUPED_M``) — one grouped torch kernel if
    torch has one here (:func:`grouped_block_api`), else one block-scaled GEMM per expert over its rows (``impl``
    says which). FLOPs as the fp8 / grouped rows (``2*m*E*n*k``). Quantisation is not timed (the operands are
    quantised ahead, as an engine's weights are; the activation quantisation kernel is a separate cost)."""
    import torch

    if not device.startswith("cuda"):
        return []  # no FP8 kernels on the CPU (dry run)
    rows: list[dict] = []
    name, call, tried = block_scaled_api(device, gen, echo)
    if call is None:
        return rows + [{"bench": "fp8_block_api", "call": name, "tried": tried},
                       {"bench": "gemm", "op": "dense", "fmt": "fp8_block",
                        "error": "no block-scaled GEMM call runs here"}]
    align, refused = block_m_align(device, call, gen)
    rows.append({"bench": "fp8_block_api", "call": name, "tried": tried, "m_align": align, "m_refused": refused})
    echo(f"measure: fp8_block: rows padded to multiples of {align} (refused m: {refused})")
    ms = [m for m in _sizes(DENSE_M, quick, False, []) if m >= 16]
    for shape, n, k in DENSE_SHAPES:
        if budget.left() < 10:
            rows.append({"bench": "gemm", "op": "dense", "fmt": "fp8_block", "shape": shape,
                         "error": "skipped: time budget"})
            continue
        try:
            sets = _n_sets(n * k)
            wq, sw = zip(*[quantize_128x128(_randn((n, k), torch.bfloat16, device, gen)) for _ in range(sets)])
            if not quick:
                rows.append(_block_kernel_map(device, shape, n, k, call, align, wq[0], sw[0], gen, echo))
            cases = []
            for m in ms:
                mp = _pad(m, align)
                xs = [quantize_1x128(_randn((mp, k), torch.bfloat16, device, gen)) for _ in range(sets)]
                fns = [(lambda a=a, sa=sa, w=w, s=s: call(a, sa, w, s)) for (a, sa), w, s in zip(xs, wq, sw)]
                rel = _relerr(fns[0](), dequant_block(*xs[0]) @ dequant_block(wq[0], sw[0]).t())
                row = {"bench": "gemm", "op": "dense", "fmt": "fp8_block", "shape": shape, "m": m, "n": n, "k": k,
                       "n_experts": 1, "impl": name, "relerr": rel}
                cases.append(({**row, "m_run": mp} if mp != m else row, fns))
            for r in measure_curve(timer, cases, echo, f"gemm fp8_block {shape}", budget):
                rows.append(_rates(r, work=2.0 * r["m"] * n * k, rate="tflops"))
            del cases, wq, sw
        except Exception as exc:  # noqa: BLE001 — recorded, not fatal
            rows.append({"bench": "gemm", "op": "dense", "fmt": "fp8_block", "shape": shape,
                         "error": f"{type(exc).__name__}: {str(exc)[:200]}"})
        torch.cuda.empty_cache()
    gname, gcall, gtried = grouped_block_api(device, gen, echo)
    rows.append({"bench": "fp8_block_api", "op": "grouped", "call": gname or "per-expert loop", "tried": gtried})
    impl = gname or f"{name} per expert"
    E = GROUPED_EXPERTS
    for shape, n, k in GROUPED_SHAPES:
        if budget.left() < 10:
            rows.append({"bench": "gemm", "op": "grouped", "fmt": "fp8_block", "shape": shape,
                         "error": "skipped: time budget"})
            continue
        try:
            sets = _n_sets(E * n * k)
            ws = []
            for _ in range(sets):
                q, s = zip(*[quantize_128x128(_randn((n, k), torch.bfloat16, device, gen)) for _ in range(E)])
                ws.append((torch.stack(q), torch.stack(s)))
            cases = []
            for m in _sizes(GROUPED_M, quick, False, []):
                mp = m if gcall is not None else _pad(m, align)  # the loop pads each expert's rows
                row = {"bench": "gemm", "op": "grouped", "fmt": "fp8_block", "shape": shape, "m": m, "n": n, "k": k,
                       "n_experts": E, "impl": impl, **({"m_run": mp} if mp != m else {})}
                offs = torch.arange(1, E + 1, device=device, dtype=torch.int32) * m
                fns, first = [], None
                for wq, sw in ws:
                    x, sx = quantize_1x128(_randn((mp * E, k), torch.bfloat16, device, gen))
                    if gcall is not None:
                        fns.append(lambda x=x, sx=sx, wq=wq, sw=sw, o=offs: gcall(x, sx, wq, sw, o))
                    else:  # each expert's rows and their scales laid out for its own m
                        per = [(x[e * mp:(e + 1) * mp], col_major(sx[e * mp:(e + 1) * mp])) for e in range(E)]
                        fns.append(lambda per=per, wq=wq, sw=sw: [call(a, sa, wq[e], sw[e])
                                                                  for e, (a, sa) in enumerate(per)])
                    first = first or (x, sx, wq, sw)
                try:
                    got = fns[0]()
                    got = torch.cat(got) if isinstance(got, list) else got
                    x, sx, wq, sw = first
                    ref = torch.cat([dequant_block(x[e * mp:(e + 1) * mp], sx[e * mp:(e + 1) * mp])
                                     @ dequant_block(wq[e], sw[e]).t() for e in range(E)])
                    row["relerr"] = _relerr(got, ref)
                except Exception as exc:  # noqa: BLE001 — this m fails, the curve goes on
                    rows.append({**row, "error": f"{type(exc).__name__}: {str(exc)[:200]}"})
                    continue
                cases.append((row, fns))
            for r in measure_curve(timer, cases, echo, f"grouped fp8_block {shape}", budget):
                rows.append(_rates(r, work=2.0 * r["m"] * E * n * k, rate="tflops"))
            del ws, cases
        except Exception as exc:  # noqa: BLE001 — recorded, not fatal
            rows.append({"bench": "gemm", "op": "grouped", "fmt": "fp8_block", "shape": shape,
                         "error": f"{type(exc).__name__}: {str(exc)[:200]}"})
        torch.cuda.empty_cache()
    return rows


def _block_kernel_map(device, shape: str, n: int, k: int, call, align: int, wq, sw, gen, echo) -> dict:
    """The ``gemm_kernels`` row of a block-scaled dense curve (:func:`gemm_kernel_map` for ``fmt: fp8_block``): the
    kernels the timed call launches at every m of ``KERNEL_MAP_M`` (run, as timed, on m padded to a multiple of
    ``align``: :func:`block_m_align`), on row slices of one quantised input (each with its scales laid out for its
    m). A failure is an ``error`` row."""
    import torch

    t0 = time.time()
    row = {"bench": "gemm_kernels", "op": "dense", "fmt": "fp8_block", "shape": shape, "n": n, "k": k,
           "m_align": align}
    try:
        xq, sx = quantize_1x128(_randn((_pad(max(KERNEL_MAP_M), align), k), torch.bfloat16, device, gen))
        ops = [(xq[:_pad(m, align)], col_major(sx[:_pad(m, align)])) for m in KERNEL_MAP_M]
        calls = [(lambda a=a, sa=sa: call(a, sa, wq, sw)) for a, sa in ops]
        marker = torch.zeros(1, device=device, dtype=torch.int32)
        names = kernel_names(calls, lambda: marker.fill_(7), lambda s: "FillFunctor" in s)
        row["runs"] = runs_of(KERNEL_MAP_M, names)
        echo(f"measure: gemm kernels fp8_block {shape}: {len(row['runs'])} runs over m = 1..{KERNEL_MAP_M[-1]} "
             f"({time.time() - t0:.1f} s)")
    except Exception as exc:  # noqa: BLE001 — recorded, not fatal
        row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    return row


# ------------------------------------------------------------------------------------------------ MoE block

#: the parts of the MoE block timed (``moe_block`` rows, :func:`bench_moe_block`), each a curve over ``MOE_TOKENS``
MOE_PARTS = ("routed", "layer", "router", "router_gemm", "topk", "permute", "experts", "unpermute")


def bench_moe_block(device, timer, quick, dry, gen, echo, budget) -> list[dict]:
    """The engine's routed-expert block (``kernels/moe_block.py``, what ``engine/real/model.py``'s graph-captured
    decode step runs) at Qwen3-235B width on one expert group holding all experts (EP = 1), bf16, the experts
    through ``torch._grouped_mm`` (``kernels.grouped_gemm`` impl ``torch``), one curve per part over ``tokens``
    (the tokens entering the block):

    * ``routed``: softmax/top-k of given router logits + permute + grouped SwiGLU + unpermute (the ``moe_us``
      calibration kind: everything of the block but the router GEMM and any dispatch / combine communication);
    * ``layer``: the router GEMM ``h @ router.T`` + ``routed`` (the whole MoE layer of a one-rank decode step, less
      the residual add);
    * ``router``: the router GEMM + softmax / top-k (what the simulator's ``router`` term prices);
    * ``router_gemm``, ``topk``, ``permute``, ``experts``, ``unpermute``: the pieces alone, on routings made ahead.

    Routing: router logits drawn N(0, 1) per token and expert, fresh for each of the rotating input sets (``routed``,
    ``topk`` and the pieces; ``layer`` / ``router`` compute them from random hidden states and router weights):
    uniform in expectation (``dist: balanced``), with the multinomial spread of a real batch (``experts_active``:
    mean distinct experts per set). Weights: one set (``n_experts`` x 37.7 MB, far above L2); the input sets rotate
    the routing, so consecutive calls touch different experts."""
    import functools

    import torch

    from rackbed.kernels.grouped_gemm import grouped_swiglu, grouped_swiglu_reference
    from rackbed.kernels.moe_block import moe_block, permute, route, unpermute

    D, F, E, K = (HIDDEN, MOE_INTER, MOE_EXPERTS, MOE_TOP_K) if not dry else (64, 32, 8, 2)
    tokens = _sizes(MOE_TOKENS, quick, dry, [1, 4, 16])
    swiglu = functools.partial(grouped_swiglu, impl="torch")
    gu = _randn((E, 2 * F, D), torch.bfloat16, device, gen) * 0.02
    dn = _randn((E, D, F), torch.bfloat16, device, gen) * 0.02
    router = _randn((E, D), torch.bfloat16, device, gen) * 0.02
    base = {"bench": "moe_block", "fmt": "bf16", "hidden": D, "inter": F, "top_k": K, "n_experts": E, "tp": 1,
            "ep": 1, "dist": "balanced", "routing": "random logits N(0,1)", "impl": "torch._grouped_mm"}
    sets = 1 if dry else MOE_SETS
    cases: dict[str, list] = {p: [] for p in MOE_PARTS}
    for T in tokens:
        hs = [_randn((T, D), torch.bfloat16, device, gen) for _ in range(sets)]
        logits = [_randn((T, E), torch.bfloat16, device, gen) for _ in range(sets)]
        routed = [route(lg, K, True, torch.bfloat16) for lg in logits]
        perm = [permute(h, ti, E) for h, (ti, _) in zip(hs, routed)]
        ys = [swiglu(xs, gu, dn, c) for _, _, c, xs in perm]
        active = statistics.mean(int((c > 0).sum()) for _, _, c, _ in perm)
        # the block against the fp32 reference of the same routing (set 0)
        tw = routed[0][1]
        order, tok, counts, xs = perm[0]
        ref = torch.zeros(T, D, dtype=torch.float32, device=device).index_add_(
            0, tok, grouped_swiglu_reference(xs, gu, dn, counts).float() * tw.reshape(-1)[order, None].float())
        got = moe_block(hs[0], logits[0], gu, dn, K, swiglu=swiglu)
        rel = _relerr(got, ref)
        row = {**base, "tokens": T, "experts_active": active, "relerr": rel}
        calls = {
            "routed": [lambda h=h, lg=lg: moe_block(h, lg, gu, dn, K, swiglu=swiglu) for h, lg in zip(hs, logits)],
            "layer": [lambda h=h: moe_block(h, h @ router.T, gu, dn, K, swiglu=swiglu) for h in hs],
            "router": [lambda h=h: route(h @ router.T, K, True, torch.bfloat16) for h in hs],
            "router_gemm": [lambda h=h: h @ router.T for h in hs],
            "topk": [lambda lg=lg: route(lg, K, True, torch.bfloat16) for lg in logits],
            "permute": [lambda h=h, ti=ti: permute(h, ti, E) for h, (ti, _) in zip(hs, routed)],
            "experts": [lambda xs=xs, c=c: swiglu(xs, gu, dn, c) for _, _, c, xs in perm],
            "unpermute": [lambda y=y, p=p, h=h, tw=tw: unpermute(y, p[1], p[0], tw, h)
                          for y, p, h, (_, tw) in zip(ys, perm, hs, routed)]}
        for part in MOE_PARTS:
            cases[part].append(({**row, "part": part}, calls[part]))
    rows = []
    for part in MOE_PARTS:
        if budget.left() < 10:
            rows.append({**base, "part": part, "error": "skipped: time budget"})
            continue
        rows += measure_curve(timer, cases[part], echo, f"moe_block {part}", budget)
    return rows


def bench_flash(device, timer, quick, dry, gen, echo, budget) -> list[dict]:
    import torch
    import torch.nn.functional as F

    H, Hkv, D = (N_Q_HEADS, N_KV_HEADS, HEAD_DIM) if not dry else (4, 2, 16)
    cases = []
    for s in _sizes(FLASH_SEQ, quick, dry, [32, 64]):
        sets = _n_sets(s * (H + 2 * Hkv) * D * 2)
        qs = [_randn((1, H, s, D), torch.bfloat16, device, gen) for _ in range(sets)]
        ks = [_randn((1, Hkv, s, D), torch.bfloat16, device, gen) for _ in range(sets)]
        vs = [_randn((1, Hkv, s, D), torch.bfloat16, device, gen) for _ in range(sets)]
        fns = [(lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))
               for q, k, v in zip(qs, ks, vs)]
        cases.append(({"bench": "flash_prefill", "seq": s, "n_q_heads": H, "n_kv_heads": Hkv, "head_dim": D,
                       "flops": 4.0 * H * D * s * (s + 1) / 2}, fns))
    rows = measure_curve(timer, cases, echo, "flash_prefill", budget)
    return [_rates(r, work=r["flops"], rate="tflops") for r in rows]


def bench_decode(device, timer, quick, dry, gen, echo, budget) -> list[dict]:
    """Decode attention: one query token per sequence over ``ctx`` cached tokens, ``batch`` sequences (one curve
    over ``ctx`` per batch)."""
    import torch
    import torch.nn.functional as F

    H, Hkv, D = (N_Q_HEADS, N_KV_HEADS, HEAD_DIM) if not dry else (4, 2, 16)
    rows = []
    for batch in (DECODE_BATCHES if not dry else (2,)):
        if budget.left() < 10:
            rows.append({"bench": "attn_decode", "batch": batch, "error": "skipped: time budget"})
            continue
        cases = []
        for c in _sizes(DECODE_CTX, quick, dry, [32, 128]):
            kv_bytes = batch * c * 2 * Hkv * D * 2
            if kv_bytes > DECODE_MAX_KV_BYTES:
                continue
            sets = _n_sets(kv_bytes)
            qs = [_randn((batch, H, 1, D), torch.bfloat16, device, gen) for _ in range(sets)]
            ks = [_randn((batch, Hkv, c, D), torch.bfloat16, device, gen) for _ in range(sets)]
            vs = [_randn((batch, Hkv, c, D), torch.bfloat16, device, gen) for _ in range(sets)]
            fns = [(lambda q=q, k=k, v=v: F.scaled_dot_product_attention(q, k, v, enable_gqa=True))
                   for q, k, v in zip(qs, ks, vs)]
            cases.append(({"bench": "attn_decode", "batch": batch, "ctx": c, "n_q_heads": H, "n_kv_heads": Hkv,
                           "head_dim": D, "kv_bytes": kv_bytes}, fns))
        rows += [_rates(r, work=r["kv_bytes"]) for r in measure_curve(timer, cases, echo, f"attn_decode b{batch}",
                                                                      budget)]
        if device.startswith("cuda") and not quick:
            rows.append(_decode_kernel_map(device, batch, H, Hkv, D, gen, cases, echo))
        del cases
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    return rows


def _decode_kernel_map(device, batch: int, H: int, Hkv: int, D: int, gen, cases, echo) -> dict:
    """The ``attn_kernels`` row of one decode-attention curve: the kernels and launch grids (:func:`kernel_names`
    with ``grid``) SDPA runs at every context of ``DECODE_MAP_CTX`` within the KV cap (run-length encoded,
    :func:`runs_of`), on context slices of one cache; ``timed``: ``[ctx, kernels]`` of the timed calls (their own
    contiguous tensors), to check that the slices launch what the timed rows ran. A failure is an ``error`` row."""
    import torch
    import torch.nn.functional as F

    row = {"bench": "attn_kernels", "batch": batch, "n_q_heads": H, "n_kv_heads": Hkv, "head_dim": D}
    t0 = time.time()
    try:
        ctxs = [c for c in DECODE_MAP_CTX if batch * c * 2 * Hkv * D * 2 <= DECODE_MAX_KV_BYTES]
        q = _randn((batch, H, 1, D), torch.bfloat16, device, gen)
        k = _randn((batch, Hkv, ctxs[-1], D), torch.bfloat16, device, gen)
        v = torch.randn_like(k)
        marker = torch.zeros(1, device=device, dtype=torch.int32)
        mark, is_mark = (lambda: marker.fill_(7)), (lambda s: "FillFunctor" in s)
        calls = [(lambda c=c: F.scaled_dot_product_attention(q, k[:, :, :c], v[:, :, :c], enable_gqa=True))
                 for c in ctxs]
        sigs = kernel_names(calls, mark, is_mark, grid=True)
        timed = [(r["ctx"], fns[0]) for r, fns in cases if "median_us" in r]
        tsigs = kernel_names([f for _, f in timed], mark, is_mark, grid=True)
        row.update(runs=runs_of(ctxs, sigs), timed=[[c, " + ".join(sg)] for (c, _), sg in zip(timed, tsigs)])
        echo(f"measure: attn kernels b{batch}: {len(row['runs'])} runs over ctx = {ctxs[0]}..{ctxs[-1]} "
             f"({time.time() - t0:.1f} s)")
        del q, k, v
    except Exception as exc:  # noqa: BLE001 — recorded, not fatal
        row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    return row


def bench_p2p(device, timer, quick, dry, gen, echo, budget) -> list[dict]:
    """Peer copies GPU 0 -> GPU 1: CUDA events on GPU 0's stream around eager copies after the spin kernel (the
    copy's cross-device stream hand-off is not capturable)."""
    import torch

    if dry or torch.cuda.device_count() < 2:
        return []
    cases = []
    g1 = torch.Generator(device="cuda:0").manual_seed(7)
    for sz in _sizes(P2P_SIZES, quick, False, []):
        n = sz // 2
        sets = _n_sets(sz)
        src = [_randn((n,), torch.bfloat16, "cuda:0", g1) for _ in range(sets)]
        dst = [torch.empty(n, dtype=torch.bfloat16, device="cuda:1") for _ in range(sets)]
        fns = [(lambda s=s, d=d: d.copy_(s, non_blocking=True)) for s, d in zip(src, dst)]
        fns[0]()
        sync("cuda:0")
        sync("cuda:1")
        assert torch.equal(dst[0].cpu(), src[0].cpu())
        cases.append(({"bench": "p2p_copy", "src": 0, "dst": 1, "size_bytes": sz}, fns))
    rows = measure_curve(timer, cases, echo, "p2p_copy", budget, graph=False)
    sync("cuda:1")
    return [_rates(r, work=r["size_bytes"]) for r in rows]


def _ar_plan(sz: int) -> tuple[int, int]:
    """``(inner, replays)`` of an all-reduce size — deterministic, so that every rank captures the same graph."""
    est = 12.0 + sz / 150e3  # µs: latency + bytes at ~150 GB/s algorithm bandwidth
    inner = max(1, min(64, math.ceil(250.0 / est)))
    return inner, max(1, min(50, math.ceil(1500.0 / (inner * est))))


def _allreduce_worker(rank: int, world: int, port: int, sizes: list[int], rounds: int, path: str,
                      deadline: float) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            device_id=torch.device(f"cuda:{rank}"), timeout=timedelta(seconds=60))
    gen = torch.Generator(device=f"cuda:{rank}").manual_seed(100 + rank)
    timer = Timer(f"cuda:{rank}", rounds=rounds)
    say = (lambda *m: print("measure: allreduce:", *m, flush=True)) if rank == 0 else (lambda *m: None)
    cases, rows = [], []
    for sz in sizes:
        n = sz // 2
        bufs = [_randn((n,), torch.bfloat16, f"cuda:{rank}", gen) for _ in range(_n_sets(sz))]
        # AVG keeps values bounded over thousands of calls (SUM would overflow bf16 to inf)
        ref = bufs[0].float().clone()
        dist.all_reduce(ref, op=dist.ReduceOp.AVG)
        probe = bufs[0].clone()
        dist.all_reduce(probe, op=dist.ReduceOp.AVG)
        rel = ((probe.float() - ref).norm() / ref.norm()).item()
        fns = [(lambda b=b: dist.all_reduce(b, op=dist.ReduceOp.AVG)) for b in bufs]
        inner, replays = _ar_plan(sz)
        p = timer.prepare(fns, inner=inner, replays=replays)
        modes = [None] * world
        dist.all_gather_object(modes, p.mode)
        if len(set(modes)) != 1:
            raise RuntimeError(f"allreduce {sz}: ranks disagree on graph capture: {modes}")
        cases.append((sz, p, rel))
    say(f"{len(cases)} sizes prepared ({cases[0][1].mode if cases else '-'})")
    times: list[list[float]] = [[] for _ in cases]
    for r in range(rounds):
        if time.time() > deadline and r >= 3:
            say(f"deadline: stopping after {r} rounds")
            break
        order = range(len(cases)) if r % 2 == 0 else range(len(cases) - 1, -1, -1)
        for i in order:
            dist.barrier()
            times[i].append(timer.round(cases[i][1]))
        say(f"round {r + 1}/{rounds} done")
    for (sz, p, rel), ts in zip(cases, times):
        allv = [None] * world
        dist.all_gather_object(allv, ts)
        per_round = [max(v[j] for v in allv) for j in range(len(ts))]  # a round is as slow as its slowest rank
        st = round_stats(per_round)
        rows.append({"bench": "allreduce", "algo": "ring", "impl": "nccl", "n_ranks": world, "size_bytes": sz,
                     **st, "inner": p.inner, "replays": p.replays, "timing": p.mode,
                     "GBps": sz / st["median_us"] / 1e3,
                     "busbw_GBps": 2 * (world - 1) / world * sz / st["median_us"] / 1e3, "relerr": rel})
    if rank == 0:
        write_text(path, json.dumps(rows))
        say(f"{len(rows)} rows written")
    _worker_exit(dist, cases)


def _worker_exit(dist, cases: list) -> None:
    """End an all-reduce worker without NCCL tear-down: drop the captured graphs (they hold NCCL work), sync,
    meet the other ranks once more, then ``os._exit(0)``. ``destroy_process_group`` (and the interpreter's own
    exit, which finalises NCCL communicators still referenced by graphs) hung for the whole 120 s limit on 2xH200
    after every row was written; nothing is left to communicate, so the process skips it. Bounded: the barrier
    runs on a side thread and the worker exits after ``EXIT_BARRIER_S`` either way."""
    import contextlib
    import gc
    import threading

    import torch

    cases.clear()
    gc.collect()
    with contextlib.suppress(Exception):  # exiting anyway
        torch.cuda.synchronize()
    done = threading.Event()

    def _barrier() -> None:
        try:
            dist.barrier()
        finally:
            done.set()

    threading.Thread(target=_barrier, daemon=True).start()
    done.wait(EXIT_BARRIER_S)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _stop(procs) -> None:
    """Terminate (then kill) the worker processes this module started that are still alive; bounded."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(5)
        if p.is_alive():
            p.kill()
            p.join(2)


def bench_allreduce(device, timer, quick, dry, gen, echo, budget) -> list[dict]:
    import socket

    import torch
    import torch.multiprocessing as mp

    world = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if dry or world < 2:
        return []
    for k, v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
        os.environ[k] = v  # never NVLink multicast (KINDS.md)
    sizes = _sizes(ALLREDUCE_SIZES, quick, False, [])
    limit = min(120.0, max(20.0, budget.left() - 5))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ar.json")
        # by its importable name (not __main__'s), so spawned children find it under `python -m rackbed.kernels.bench.measure`
        from rackbed.kernels.bench.measure import _allreduce_worker as worker

        ctx = mp.start_processes(worker, args=(world, port, sizes, timer.rounds, path,
                                                          time.time() + limit - 25),
                                 nprocs=world, join=False, start_method="spawn")
        t0, written = time.time(), None
        while not ctx.join(timeout=2):
            if written is None and os.path.exists(path):
                written = time.time()
            if written is not None and time.time() - written > EXIT_GRACE_S:
                # the rows are on disk: a worker stuck in tear-down must not cost the rest of the limit
                _stop(ctx.processes)
                echo(f"measure: allreduce: workers still exiting {EXIT_GRACE_S:.0f} s after writing their rows; "
                     "terminated")
                with open(path) as f:
                    return json.load(f)
            if time.time() - t0 > limit:
                _stop(ctx.processes)
                if os.path.exists(path):  # rows were written; a hang at tear-down must not lose them
                    echo(f"measure: allreduce: workers hung after writing their rows ({limit:.0f} s); terminated")
                    with open(path) as f:
                        return json.load(f)
                raise TimeoutError(f"all-reduce workers still running after {limit:.0f} s; terminated")
        with open(path) as f:
            return json.load(f)


BENCHES = ("allreduce", "gemm", "grouped", "moe_block", "fp8_block", "flash", "decode", "hbm", "p2p")
_FUNCS = {"allreduce": bench_allreduce, "gemm": bench_gemm, "grouped": bench_grouped, "fp8_block": bench_fp8_block,
          "moe_block": bench_moe_block, "flash": bench_flash, "decode": bench_decode, "hbm": bench_hbm,
          "p2p": bench_p2p}


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


def _warm_clocks(device: str, seconds: float = 0.5) -> None:
    """A short burst of large matmuls so the first curve is not timed at idle clocks."""
    import torch

    a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    t0 = time.time()
    while time.time() - t0 < seconds:
        for _ in range(20):
            a @ a
        sync(device)


def run(quick: bool = False, dry_run: bool = False, only: list[str] | None = None, echo=print,
        partial_out: str | Path | None = None, budget_s: float | None = None, rounds: int | None = None,
        command: str | None = None) -> dict:
    """Run the benchmarks; returns ``{"schema": "rackbed.measure/2", "env": {...}, "rows": [...]}`` (``command``:
    the command line, kept in ``env``)."""
    import torch

    device = "cpu" if dry_run or not torch.cuda.is_available() else "cuda:0"
    if device == "cpu" and not dry_run:
        raise ValueError("measure: no CUDA GPU found; use --dry-run to test on the CPU")
    only = list(only or BENCHES)
    for b in only:
        if b not in BENCHES:
            raise ValueError(f"measure: unknown benchmark {b!r}; choose from {', '.join(BENCHES)}")
    only = [b for b in BENCHES if b in only]  # all-reduce first: it needs both GPUs before GPU 0 fills up
    rounds = rounds or (3 if dry_run else (5 if quick else 9))
    budget = Budget(budget_s)
    timer = Timer(device, rounds=rounds, warmup=2 if dry_run else 3)
    gen = torch.Generator(device=device).manual_seed(0)
    env = environment(device)
    if command:
        env["command"] = command
    doc = {"schema": SCHEMA, "env": env, "rows": [], "quick": quick, "dry_run": dry_run,
           "timing": {"method": "graph replay" if device != "cpu" else "host clock", "rounds": rounds,
                      "interleaved": True, "statistic": "median of rounds"},
           "timings_s": {}, "complete": False}
    if device != "cpu":
        with torch.cuda.device(0):
            _warm_clocks(device)

    def flush():
        if partial_out:  # what is done survives a time-out
            Path(partial_out).parent.mkdir(parents=True, exist_ok=True)
            write_text(partial_out, json.dumps(doc, indent=1))

    flush()
    for b in only:
        t0 = time.time()
        if budget.left() < 10:
            doc["rows"].append({"bench": b, "error": "skipped: time budget"})
            echo(f"measure: {b}: skipped (budget)")
            continue
        echo(f"measure: {b}: start ({budget.left():.0f} s left)")
        try:
            with torch.cuda.device(0) if device != "cpu" else _null():
                rows = _FUNCS[b](device, timer, quick, dry_run, gen, echo, budget)
        except Exception as exc:
            if dry_run:
                raise
            rows = [{"bench": b, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}]
        doc["rows"].extend(rows)
        doc["timings_s"][b] = round(time.time() - t0, 2)
        echo(f"measure: {b}: {len(rows)} rows in {time.time() - t0:.1f} s")
        flush()
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    doc["complete"] = True
    flush()
    return doc


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rackbed.kernels.bench.measure", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="measure.json")
    ap.add_argument("--force", action="store_true", help="replace an existing --out file")
    ap.add_argument("--quick", action="store_true", help="every other size, fewer rounds")
    ap.add_argument("--dry-run", action="store_true", help="tiny sizes on CPU tensors (plumbing test)")
    ap.add_argument("--only", nargs="*", choices=BENCHES)
    ap.add_argument("--rounds", type=int, help="timed rounds per case (default 9; quick 5)")
    ap.add_argument("--budget-s", type=float, default=None,
                    help="wall-clock budget: later curves are skipped / cut short to fit (default: none)")
    a = ap.parse_args(argv)
    entry_file(a.out, force=a.force)  # before the measurements, not after them
    echo = lambda *m: print(*m, flush=True)
    doc = run(a.quick, a.dry_run, a.only, echo=echo, partial_out=a.out, budget_s=a.budget_s, rounds=a.rounds,
              command=" ".join(["python -m rackbed.kernels.bench.measure", *(argv if argv is not None else sys.argv[1:])]))
    print(f"wrote {a.out} ({len(doc['rows'])} rows)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
