"""Device check and benchmark of the decode DP-EP dispatch/combine (kernels/moe_a2a.py), safe against hangs.

    timeout 240 python -m rackbed.kernels.bench.moe_a2a --out $OUT/a2a        # 2 GPUs; < 4 min even if a kernel hangs

Also registered as suite "moe_a2a" of ``python -m rackbed.kernels.bench.moe`` (through kernels/bench/moe.py).

Structure: a parent process (no CUDA) starts one worker process per GPU and watches them. Every step is a *case*
that both workers run in the same order; a worker announces each case (name, time budget) before starting it and
reports its record when done. The parent kills the workers (its own children, by pid) when a case overruns its
budget or the overall deadline passes, and records which case that was. Inside the workers every wait is bounded:
the kernels' spins give up after ``SPIN_S`` (error word set on every rank, later waits return at once), host waits
poll a CUDA event with a deadline instead of ``synchronize()``, and every agreement between the ranks (skip the
CuTe cases after a failure, ...) goes over a gloo group with a timeout, never over the GPU.

Outputs in ``--out`` DIR: ``cases/NNN_<name>.json`` (one per case, written as soon as it is done, rank 0's record
with the per-rank timings merged: max over ranks), ``cases.jsonl`` (the same, appended), ``a2a.json`` (summary:
meta, all cases, table rows, target verdicts, watchdog events). Progress lines go to stdout, flushed.

Order: setup (compile) -> a 4-token bf16 smoke check -> correctness (bf16 and fp8, 1..128 tokens, uniform / Zipf /
all tokens on rank 0's experts / rank 1 sending nothing; CuTe vs the torch backend bit for bit and vs the CPU
emulation) -> timing (CUDA graphs of ITERS calls, median of REPS replays; eager; NCCL all_to_all_single with the
real splits, eager and graphed, in the same run).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
import traceback

for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ[_k] = _v

import numpy as np

from rackbed.topology.outputs import entry_dir, open_append, write_text

D, K, E, TM = 4096, 8, 128, 128  # hidden, top-k, experts, max tokens per rank (the shape)
TOKENS = (1, 8, 32, 64, 128)
ROUTINGS = ("uniform", "zipf", "one", "asym")
SPIN_S = 2.0           # device-side bound of every wait in the benchmark
ITERS, REPS = 10, 25   # calls per captured graph, timed replays
TARGET_US = 30.0


# ------------------------------------------------------------------------------------------------ worker helpers


class CaseTimeout(RuntimeError):
    pass


class Desync(RuntimeError):
    """The ranks reached different agreement points (one rank failed half-way through a case): stop."""


def _bounded_sync(seconds: float) -> None:
    """Wait for the current stream's work with a deadline (a hung kernel must not hang the host)."""
    import torch

    ev = torch.cuda.Event()
    ev.record()
    t_end = time.monotonic() + seconds
    while not ev.query():
        if time.monotonic() > t_end:
            raise CaseTimeout(f"GPU work did not finish within {seconds:.0f} s")
        time.sleep(0.0002)


def _time_graph(gr, iters: int, reps: int = REPS, warm: int = 3, limit_s: float = 20.0) -> float:
    """Median over reps of one replay's time / iters (µs); each replay waited for with a deadline."""
    import torch

    for _ in range(warm):
        gr.replay()
    _bounded_sync(limit_s)
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        gr.replay()
        b.record()
        _bounded_sync(limit_s)
        ts.append(a.elapsed_time(b) * 1e3 / iters)
    return statistics.median(ts)


def _time_eager(fn, iters: int, reps: int = REPS, warm: int = 2, limit_s: float = 20.0) -> float:
    import torch

    for _ in range(warm):
        fn()
    _bounded_sync(limit_s)
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(iters):
            fn()
        b.record()
        _bounded_sync(limit_s)
        ts.append(a.elapsed_time(b) * 1e3 / iters)
    return statistics.median(ts)


def _routing(kind: str, T: int, rank: int, seed: int):
    """(ids [T, K] int64, weights [T, K] float) for one rank."""
    from rackbed.kernels.moe_reference import route

    rng = np.random.default_rng(seed)
    if kind == "one":  # every token on experts 0..K-1 (all on rank 0): the other rank receives nothing
        return np.tile(np.arange(K), (T, 1)), np.full((T, K), 1.0 / K)
    if kind == "asym" and rank == 1:
        return np.zeros((0, K), np.int64), np.zeros((0, K))
    r = route(T, E, K, dist="zipf" if kind == "zipf" else "uniform", zipf_s=1.2, rng=rng)
    return np.asarray(r.topk_ids).reshape(T, K), np.asarray(r.topk_weights).reshape(T, K)


def _rows(payload: str, T: int, dev, gen):
    import torch

    from rackbed.kernels.moe_a2a import pack_fp8_rows

    x = torch.randn(T, D, device=dev, generator=gen).to(torch.bfloat16)
    return x if payload == "bf16" else pack_fp8_rows(x)


def _expert_standin(payload: str, xr, ids, w, rank: int, world: int):
    """y = dequant(x) * (sum of the row's weights on this rank's experts), bf16 (weighted, like the engine)."""
    import torch

    from rackbed.kernels.moe_a2a import unpack_fp8_rows

    per = E // world
    lw = torch.where((ids >= rank * per) & (ids < (rank + 1) * per), w, torch.zeros_like(w)).sum(1)
    xf = xr.float() if payload == "bf16" else unpack_fp8_rows(xr, D)
    xf = torch.nan_to_num(xf, nan=0.0, posinf=0.0, neginf=0.0)
    return (xf * lw[:, None]).to(torch.bfloat16).contiguous()


class _Ctx:
    def __init__(self, rank, world, q, ctrl, dev):
        self.rank, self.world, self.q, self.ctrl, self.dev = rank, world, q, ctrl, dev
        self.n = 0

    def agree(self, obj, tag: str = ""):
        """Every rank's obj, over gloo (bounded by the group's timeout), never through the GPU. The call site's
        tag travels along; ranks at different points raise Desync instead of pairing up the wrong calls."""
        import torch.distributed as dist

        out = [None] * self.world
        dist.all_gather_object(out, (f"{self.n}:{tag}", obj), group=self.ctrl)
        tags = {t for t, _ in out}
        if len(tags) > 1:
            raise Desync(f"ranks at different points: {sorted(tags)}")
        return [o for _, o in out]

    def case(self, name: str, budget_s: float, fn):
        """Run fn() -> dict as a case; report start/done to the parent; merge the ranks' records on rank 0."""
        self.n += 1
        self.q.put(("start", self.rank, self.n, name, budget_s, time.time()))
        print(f"[rank {self.rank}] case {self.n} {name} ...", flush=True)
        t0 = time.time()
        try:
            rec = dict(fn() or {})
            rec.setdefault("ok", True)
        except (CaseTimeout, Desync) as exc:
            rec = {"ok": False, "error": f"{type(exc).__name__}: {exc}", "fatal": True}
        except Exception as exc:
            rec = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
            traceback.print_exc()
        rec["wall_s"] = round(time.time() - t0, 3)
        if rec.get("fatal"):  # the GPU may be stuck: report and stop; the parent ends the other rank
            self.q.put(("done", self.rank, self.n, name, {"case": name, "ranks": {self.rank: rec}}))
            print(f"[rank {self.rank}] case {self.n} {name} FATAL {rec['error']}", flush=True)
            raise SystemExit(3)
        try:
            allrec = self.agree(rec, "end")
        except Desync as exc:
            rec.update(ok=False, fatal=True, error=f"{rec.get('error', '')} / Desync: {exc}")
            self.q.put(("done", self.rank, self.n, name, {"case": name, "ranks": {self.rank: rec}}))
            print(f"[rank {self.rank}] case {self.n} {name} FATAL {rec['error']}", flush=True)
            raise SystemExit(3) from None
        merged = {"case": name, "ok": all(r.get("ok") for r in allrec)}
        for key in dict.fromkeys(k for r in allrec for k in r):  # union of the ranks' keys, in order
            if key.endswith("_us"):
                vals = [r[key] for r in allrec if isinstance(r.get(key), (int, float))]
                merged[key] = max(vals) if vals else None
                merged[key + "_by_rank"] = [r.get(key) for r in allrec]
            elif key not in ("ok",):
                vals = [r.get(key) for r in allrec]
                merged[key] = vals[0] if all(v == vals[0] for v in vals) else vals
        if self.rank == 0:
            self.q.put(("done", self.rank, self.n, name, merged))
        print(f"[rank {self.rank}] case {self.n} {name} ok={merged['ok']} {rec.get('summary', '')} "
              f"({rec['wall_s']:.1f} s)", flush=True)
        return merged


# ------------------------------------------------------------------------------------------------ the worker


def _worker(rank: int, world: int, port: int, q, opts: dict) -> None:
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dev = torch.device("cuda", rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            device_id=dev, timeout=timedelta(seconds=60))
    ctrl = dist.new_group(backend="gloo", timeout=timedelta(seconds=60))
    cx = _Ctx(rank, world, q, ctrl, dev)
    tokens = tuple(opts["tokens"])
    state = {"cute_ok": True, "nccl_graph_ok": True, "a2a": {}, "ref": {}}
    try:
        _run_cases(cx, state, tokens, opts)
    finally:  # no PeerBuffer.close(): its group barrier could wait for a dead peer; process exit frees it all
        q.put(("exit", rank))


def _run_cases(cx, state, tokens, opts) -> None:
    import torch
    import torch.distributed as dist

    from rackbed.kernels.moe_a2a import A2aLayout, PeerMoeAllToAll, emulate, row_bytes_for

    rank, world, dev = cx.rank, cx.world, cx.dev
    gen = torch.Generator(device=dev).manual_seed(1234 + rank)

    def setup(payload):
        def fn():
            t0 = time.time()
            a = PeerMoeAllToAll(None, max_tokens=TM, hidden=D, top_k=K, n_experts=E, payload=payload,
                                backend="auto", spin_timeout_s=SPIN_S)
            r = PeerMoeAllToAll(None, max_tokens=TM, hidden=D, top_k=K, n_experts=E, payload=payload,
                                backend="torch")
            state["a2a"][payload], state["ref"][payload] = a, r
            state["out"] = state.get("out", {})
            state["out"][payload] = (a.alloc_outputs(), r.alloc_outputs())
            return {"backend": a.backend, "fallback_reason": a.fallback_reason,
                    "direct_launch": getattr(a, "direct_launch", None),
                    "direct_launch_reason": getattr(a, "direct_launch_reason", None),
                    "setup_s": round(time.time() - t0, 2), "summary": f"backend={a.backend}"}
        rec = cx.case(f"setup_{payload}", 150, fn)
        ok = rec["ok"] and rec.get("backend") == "cute"
        if not ok:
            state["cute_ok"] = False
        return rec

    def check(payload, T_all, routing, seed):
        """One dispatch + combine through both backends on fresh inputs, outputs poisoned first."""
        def fn():
            a, r = state["a2a"][payload], state["ref"][payload]
            (o1, o2) = state["out"][payload]
            T = T_all[rank]
            ids, w = _routing(routing, T, rank, seed)
            x = _rows(payload, T, dev, gen)
            ti = torch.tensor(ids, dtype=torch.int32, device=dev).reshape(T, K).contiguous()
            tw = torch.tensor(w, dtype=torch.float32, device=dev).reshape(T, K).contiguous()
            for o in (o1, o2):
                o["x"].fill_(255 if payload == "fp8" else float("nan"))
                o["ids"].fill_(-7)
                o["weights"].fill_(float("nan"))
                o["counts"].fill_(-9)
            a.dispatch(x, ti, tw, o1)
            r.dispatch(x, ti, tw, o2)
            _bounded_sync(15)
            a.check_error()
            cnt = o2["counts"].cpu().tolist()
            d_ok = o1["counts"].cpu().tolist() == cnt and torch.equal(o1["ids"], o2["ids"]) \
                and torch.equal(o1["weights"], o2["weights"])
            for s in range(world):
                lo = s * TM
                d_ok = d_ok and torch.equal(o1["x"][lo:lo + cnt[s]], o2["x"][lo:lo + cnt[s]])
            y = _expert_standin(payload, o2["x"], o2["ids"], o2["weights"], rank, world)
            out1 = torch.full((T, D), float("nan"), dtype=torch.bfloat16, device=dev)
            out2 = torch.full((T, D), float("nan"), dtype=torch.bfloat16, device=dev)
            a.combine(y, out1, T)
            r.combine(y, out2, T)
            _bounded_sync(15)
            a.check_error()
            c_ok = torch.equal(out1, out2)
            # independent reference: the CPU emulation of engine.core's DP-EP plan on everybody's inputs
            mine = (x.view(torch.int16).cpu().numpy() if payload == "bf16" else x.cpu().numpy(), ids, w)
            allin = cx.agree(mine, "inputs")
            lay = A2aLayout(world, TM, D, K, E // world, row_bytes_for(D, payload))
            xs = [m[0].astype(np.float64) for m in allin]
            recv, _ = emulate(xs, [m[1] for m in allin], [m[2] for m in allin], lay,
                                 lambda j, xr, ir, wr: np.zeros_like(xr))
            e_cnt = recv[rank]["counts"].tolist() == o1["counts"].cpu().tolist()
            e_rows = True
            got_x = o1["x"].cpu()
            got_x = (got_x.view(torch.int16) if payload == "bf16" else got_x).numpy().astype(np.float64)
            for s in range(world):
                lo, c = s * TM, int(recv[rank]["counts"][s])
                e_rows = e_rows and np.array_equal(got_x[lo:lo + c], recv[rank]["x"][lo:lo + c]) and \
                    np.array_equal(o1["ids"].cpu().numpy()[lo:lo + c], recv[rank]["ids"][lo:lo + c])
            ok = bool(d_ok and c_ok and e_cnt and e_rows and not torch.isnan(out1).any())
            return {"ok": ok, "T": T, "routing": routing, "payload": payload, "counts": cnt,
                    "dispatch_equal_torch": bool(d_ok), "combine_equal_torch": bool(c_ok),
                    "counts_equal_emulation": bool(e_cnt), "rows_equal_emulation": bool(e_rows),
                    "summary": f"d={d_ok} c={c_ok} emu={e_cnt and e_rows}"}
        name = f"check_{payload}_T{max(T_all)}_{routing}"
        rec = cx.case(name, 30, fn)
        if not rec["ok"]:
            state["cute_ok"] = False
        return rec

    def timing(payload, T):
        def fn():
            from rackbed.kernels.moe_a2a import destinations

            a = state["a2a"][payload]
            o1 = state["out"][payload][0]
            ids, w = _routing("uniform", T, 0, 7 + rank)
            x = _rows(payload, T, dev, gen)
            ti = torch.tensor(ids, dtype=torch.int32, device=dev).contiguous()
            tw = torch.tensor(w, dtype=torch.float32, device=dev).contiguous()
            y = torch.randn(world * TM, D, device=dev, generator=gen).to(torch.bfloat16)
            outc = torch.empty(T, D, dtype=torch.bfloat16, device=dev)
            goes = destinations(ids, world, E // world)
            rb = row_bytes_for(D, payload)
            rec = {"T": T, "payload": payload, "rows_sent": int(goes.sum()),
                   "dispatch_bytes_per_rank": int(goes.sum()) * rb,
                   "combine_bytes_per_rank": int(goes.sum()) * 2 * D}

            def disp():
                a.dispatch(x, ti, tw, o1)

            def both():
                a.dispatch(x, ti, tw, o1)
                a.combine(y, outc, T)

            if state["cute_ok"]:
                for name, f in (("dispatch", disp), ("dispatch_combine", both)):
                    f()
                    _bounded_sync(10)
                    cx.agree(0, f"{name}:pre")
                    gr = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(gr):
                        for _ in range(ITERS):
                            f()
                    cx.agree(0, f"{name}:captured")  # both ranks captured: replays meet each other
                    rec[f"{name}_graph_us"] = _time_graph(gr, ITERS)
                    cx.agree(0, f"{name}:eager")
                    rec[f"{name}_eager_us"] = _time_eager(f, ITERS)
                    del gr
                a.check_error()
                rec["combine_graph_us"] = rec["dispatch_combine_graph_us"] - rec["dispatch_graph_us"]
                rec["combine_eager_us"] = rec["dispatch_combine_eager_us"] - rec["dispatch_eager_us"]
            # NCCL all_to_all_single with the real split sizes (host-known): dispatch rows there, bf16 rows back
            send = [int(goes[:, j].sum()) for j in range(world)]
            allsend = cx.agree(send, "splits")
            recv = [int(allsend[j][rank]) for j in range(world)]
            order = np.concatenate([np.flatnonzero(goes[:, j]) for j in range(world)]).astype(np.int64)
            rows_t = torch.tensor(order, device=dev, dtype=torch.long)
            sx = x[rows_t].contiguous()
            rx = torch.empty((sum(recv), x.shape[1]), dtype=x.dtype, device=dev)
            sy = torch.randn(sum(recv), D, device=dev, generator=gen).to(torch.bfloat16)
            ry = torch.empty(sum(send), D, dtype=torch.bfloat16, device=dev)
            nd = lambda: dist.all_to_all_single(rx, sx, recv, send)  # noqa: E731
            nc = lambda: dist.all_to_all_single(ry, sy, send, recv)  # noqa: E731
            for name, f in (("nccl_dispatch", nd), ("nccl_combine", nc)):
                cx.agree(0, f"{name}:eager")
                rec[f"{name}_eager_us"] = _time_eager(f, ITERS)
            if state["nccl_graph_ok"]:
                for name, f in (("nccl_dispatch", nd), ("nccl_combine", nc)):
                    cx.agree(0, f"{name}:pre")
                    gr = torch.cuda.CUDAGraph()
                    err = None
                    try:
                        with torch.cuda.graph(gr):
                            for _ in range(ITERS):
                                f()
                    except Exception as exc:
                        err = f"{type(exc).__name__}: {str(exc)[:200]}"
                    if any(cx.agree(err, f"{name}:captured")):
                        state["nccl_graph_ok"] = False
                        rec["nccl_graph_error"] = err
                        break
                    rec[f"{name}_graph_us"] = _time_graph(gr, ITERS)
                    del gr
            s = ", ".join(f"{k}={v:.1f}" for k, v in rec.items() if k.endswith("_us"))
            rec["summary"] = s
            return rec
        return cx.case(f"time_{payload}_T{T}", 60, fn)

    # -- the sequence -------------------------------------------------------------------------------------------
    setup("bf16")
    if state["cute_ok"]:  # the small smoke check first: a broken protocol shows here in seconds
        check("bf16", (4, 4), "uniform", 1)
    for payload in ("bf16", "fp8"):
        if payload == "fp8":
            setup("fp8")
        for T in tokens:
            for i, routing in enumerate(ROUTINGS):
                if not opts.get("full") and payload == "fp8" and routing in ("zipf", "asym") and T not in (1, 128):
                    continue
                if not state["cute_ok"]:
                    break
                check(payload, (T, 0 if routing == "asym" else T), routing, 100 * T + 10 * i + rank)
    for payload in ("bf16", "fp8"):
        for T in tokens:
            timing(payload, T)


# ------------------------------------------------------------------------------------------------ the parent


def _max_bytes(v) -> float:
    """A case's bytes per rank: one number, or one per rank once the parent has merged the ranks (the larger)."""
    if isinstance(v, (list, tuple)):
        return float(max(v, default=0))
    return float(v or 0)


def _table(summary: dict) -> str:
    f = (lambda v, s=".1f": "-" if v is None else format(v, s))
    lines = [f"checks: {summary.get('checks_passed')}/{summary.get('checks_run')} passed; cute={summary.get('cute')}; "
             f"watchdog: {summary.get('watchdog') or 'quiet'}",
             f"{'payload':7s} {'T':>4s} {'disp_g':>7s} {'comb_g':>7s} {'disp_e':>7s} {'comb_e':>7s} {'ncclD_g':>8s} "
             f"{'ncclC_g':>8s} {'ncclD_e':>8s} {'ncclC_e':>8s} {'KiB':>6s}   (us; _g CUDA graph, _e eager)"]
    for r in summary.get("timing", []):
        lines.append(f"{r.get('payload', ''):7s} {r.get('T', 0):4d} {f(r.get('dispatch_graph_us')):>7s} "
                     f"{f(r.get('combine_graph_us')):>7s} {f(r.get('dispatch_eager_us')):>7s} "
                     f"{f(r.get('combine_eager_us')):>7s} {f(r.get('nccl_dispatch_graph_us')):>8s} "
                     f"{f(r.get('nccl_combine_graph_us')):>8s} {f(r.get('nccl_dispatch_eager_us')):>8s} "
                     f"{f(r.get('nccl_combine_eager_us')):>8s} {_max_bytes(r.get('dispatch_bytes_per_rank')) / 1024:6.0f}")
    for v in summary.get("verdicts", []):
        lines.append(v)
    return "\n".join(lines)


def _summarize(cases: list[dict], watchdog: list[str], meta: dict) -> dict:
    checks = [c for c in cases if c["case"].startswith("check_")]
    timing = [c for c in cases if c["case"].startswith("time_")]
    setups = [c for c in cases if c["case"].startswith("setup_")]
    s = {"meta": meta, "cases": cases, "watchdog": watchdog, "checks_run": len(checks),
         "checks_passed": sum(1 for c in checks if c.get("ok")), "timing": timing,
         "cute": [(c["case"], c.get("backend"), c.get("direct_launch"), c.get("error")) for c in setups]}
    s["checks_ok"] = bool(checks) and s["checks_passed"] == len(checks)
    verdicts = []
    for r in timing:
        if r.get("T") == 128:
            for half in ("dispatch", "combine"):
                v = r.get(f"{half}_graph_us")
                if v is not None:
                    verdicts.append(f"target {r['payload']} {half} at 128 tokens: {v:.1f} us (graph) "
                                    f"{'<=' if v <= TARGET_US else '>'} {TARGET_US:.0f} us; NCCL "
                                    f"{r.get(f'nccl_{half}_graph_us') or r.get(f'nccl_{half}_eager_us') or float('nan'):.1f} us")
    s["verdicts"] = verdicts
    s["table"] = _table(s)
    return s


def run(out_dir: str, deadline_s: float = 200.0, tokens=TOKENS, full: bool = False, echo=print,
        worker=None) -> dict:
    """Start the workers, watch them, write the case files and the summary; returns the summary dict.
    ``worker`` (default ``_worker``) is the per-rank target ``(rank, world, port, queue, opts)``; tests pass one
    that hangs to check the watchdog."""
    import multiprocessing as mp
    import queue as queue_mod

    from rackbed.kernels.bench.suites import _free_port

    os.makedirs(os.path.join(out_dir, "cases"), exist_ok=True)
    t_start = time.time()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    world = 2
    port = _free_port()
    opts = {"tokens": list(tokens), "full": full}
    procs = [ctx.Process(target=worker or _worker, args=(r, world, port, q, opts), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    current: dict[int, tuple] = {}
    cases: list[dict] = []
    watchdog: list[str] = []
    exited: set[int] = set()
    first_dead = None
    jsonl = open_append(os.path.join(out_dir, "cases.jsonl"))

    def save(rec):
        cases.append(rec)
        i = len(cases)
        write_text(os.path.join(out_dir, "cases", f"{i:03d}_{rec['case']}.json"), json.dumps(rec, indent=1))
        jsonl.write(json.dumps(rec) + "\n")
        jsonl.flush()

    while True:
        try:
            msg = q.get(timeout=0.5)
        except queue_mod.Empty:
            msg = None
        now = time.time()
        if msg:
            if msg[0] == "start":
                _, r, n, name, budget, _t = msg
                current[r] = (n, name, budget, now)
            elif msg[0] == "done":
                _, r, n, name, rec = msg
                for rr in [rr for rr, c in current.items() if c[0] == n]:
                    current.pop(rr)
                save(rec)
            elif msg[0] == "exit":
                exited.add(msg[1])
        alive = [p for p in procs if p.is_alive()]
        if not alive:
            break
        if len(alive) < world and first_dead is None:
            first_dead = now
        reason = None
        if now - t_start > deadline_s:
            reason = f"overall deadline {deadline_s:.0f} s"
        for r, (n, name, budget, t0) in current.items():
            if now - t0 > budget:
                reason = f"rank {r} case {n} {name} over its {budget:.0f} s budget"
        if first_dead is not None and now - first_dead > 10:
            reason = reason or "a worker exited, the other did not follow within 10 s"
        if reason:
            watchdog.append(reason + f" (at {now - t_start:.0f} s; running: "
                            f"{ {r: c[1] for r, c in current.items()} })")
            echo(f"[parent] WATCHDOG: {watchdog[-1]}; killing the workers", flush=True)
            for p in procs:
                if p.is_alive():
                    p.kill()  # our own child, by its handle
            for p in procs:
                p.join(5)
            for r, (n, name, budget, t0) in current.items():
                save({"case": name, "ok": False, "error": f"killed by the watchdog: {reason}", "rank": r})
            break
    for p in procs:
        p.join(5)
    while True:  # records that arrived after the last poll
        try:
            msg = q.get_nowait()
        except Exception:
            break
        if msg and msg[0] == "done":
            save(msg[4])
    jsonl.close()
    codes = [p.exitcode for p in procs]
    if any(c not in (0, None) for c in codes) and not watchdog:
        watchdog.append(f"worker exit codes {codes}")
    meta = {"argv": sys.argv, "elapsed_s": round(time.time() - t_start, 1), "shape": {"hidden": D, "top_k": K,
            "experts": E, "ep": world, "max_tokens": TM}, "spin_timeout_s": SPIN_S, "iters_per_graph": ITERS,
            "reps": REPS, "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    try:
        import torch

        meta["torch"] = torch.__version__
    except Exception:
        pass
    summary = _summarize(cases, watchdog, meta)
    write_text(os.path.join(out_dir, "a2a.json"), json.dumps(summary, indent=1))
    echo(summary["table"])
    echo(f"wrote {os.path.join(out_dir, 'a2a.json')} ({len(cases)} cases, {meta['elapsed_s']} s)")
    return summary


def main(argv=None) -> int:
    import argparse

    p = argparse.ArgumentParser(description="decode DP-EP dispatch/combine: device checks and benchmark (2 GPUs)")
    p.add_argument("--out", required=True, help="output directory (created; an existing one must be empty)")
    p.add_argument("--force", action="store_true", help="write into an existing, non-empty --out folder")
    p.add_argument("--deadline", type=float, default=200.0, help="seconds before the watchdog stops everything")
    p.add_argument("--tokens", default=",".join(map(str, TOKENS)), help="tokens per rank, comma separated")
    p.add_argument("--full", action="store_true", help="every routing for fp8 too")
    p.add_argument("--from-cases", metavar="JSONL", help="no GPU: rebuild a2a.json and the table from a run's cases.jsonl")
    a = p.parse_args(argv)
    entry_dir(a.out, force=a.force)  # before the benchmark, not after it
    if a.from_cases:
        with open(a.from_cases) as fh:
            cases = [json.loads(line) for line in fh if line.strip()]
        s = _summarize(cases, [], {"rebuilt_from": a.from_cases})
        write_text(os.path.join(a.out, "a2a.json"), json.dumps(s, indent=1))
        print(s["table"])
        return 0 if s["checks_ok"] else 1
    s = run(a.out, a.deadline, tuple(int(t) for t in a.tokens.split(",")), a.full,
            echo=lambda *x, **k: print(*x, flush=True))
    return 0 if s["checks_ok"] and not s["watchdog"] else 1


if __name__ == "__main__":
    sys.exit(main())
