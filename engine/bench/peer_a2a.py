"""The real engine's DP-EP decode MoE (``ShardedQwen3Moe._moe_dp_ep``) on 2 GPUs with the peer-memory dispatch/combine
(``kernels.moe_a2a.PeerMoeAllToAll``, CuTe DSL) against the existing NCCL ``all_to_all_single`` path: same outputs
(both also against the unsharded experts on one GPU), and the time of a decode-step MoE layer of each, in one run.

    python -m rackbed.engine.bench.peer_a2a --out peer_a2a.json

Model: Qwen3-235B-A22B MoE width (hidden 4096, 128 experts, top-8, moe_intermediate 1536), ``--layers`` layers,
bf16, EP=2 (rank i holds experts 64i..64i+63; DP attention is not run). Per batch size B (tokens per rank, the same
on both ranks) and per path, eagerly (see GRAPH_NOTE), medians of ``--reps`` repeats of ``--inner`` calls:

    route_us   router GEMM + softmax + top-k of one layer
    layer_us   route + ``_moe_dp_ep`` of a layer other than the first (dispatch, local experts, combine)
    comm_us    the same with the local experts replaced by the identity: route + communication + bookkeeping
    step_us    route + MoE of every layer in order (the peer path agrees its chunk count once per step, at layer 0)

a2a_us = comm_us - route_us, experts_us = layer_us - comm_us, a2a share = a2a_us / layer_us; the saving per layer
(all_to_all minus peer) is compared with what the kernel benchmark (``results/h200x2/moe/a2a/cases.jsonl``,
``python -m rackbed.kernels.bench.moe_a2a``) measured for dispatch + combine alone, NCCL on fixed slots minus peer, under
CUDA graphs and eagerly. A machine without 2 CUDA GPUs gets one line and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rackbed.topology.outputs import add_force, entry_file, write_text

SIZES = (1, 8, 32, 64, 128)
#: extra correctness cases, tokens per rank: a batch needing two chunks of max_tokens (256) on one rank only, and a
#: rank with no tokens
EXTRA_CASES = ((300, 5), (0, 16))
MEASURES = ("route", "layer", "comm", "step")
MULTICAST_OFF = (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1"))
BENCH_CASES = Path(__file__).resolve().parents[2] / "results" / "h200x2" / "moe" / "a2a" / "cases.jsonl"
FULL_DEPTH = 94  # Qwen3-235B-A22B layers, for the per-step estimate
TOL = 2e-2       # max |out - ref| / max |ref|: bf16 rounding of the weighted expert sums (as tests/test_moe_a2a.py)
GRAPH_NOTE = ("eager: the engine's DP-EP decode MoE (ep > 1) is not CUDA-graph capturable (_local_experts takes "
              "nonzero() of the routed pairs, the all_to_all path needs host split sizes, the peer path agrees its "
              "chunk count with .tolist() at layer 0; forward_decode_static / DecodeGraphRunner refuse ep > 1), so "
              "both paths are timed as the engine runs them")


# ------------------------------------------------------------------------------------------------ pure helpers


def bench_prediction(path, sizes) -> dict:
    """Dispatch + combine of the kernel benchmark per T in ``sizes`` (bf16 rows; slowest rank): ``{T: {"graph" |
    "eager": {"peer_us", "nccl_us", "saving_us"}}}``; T missing from the file (or the file) are left out."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError:
        return {}
    by_t = {}
    for line in lines:
        try:
            r = json.loads(line)
        except ValueError:
            continue
        if isinstance(r, dict) and r.get("ok") and r.get("case", "").startswith("time_bf16_T"):
            by_t[r.get("T")] = r
    out = {}
    for T in sizes:
        r = by_t.get(T)
        if r is None:
            continue
        row = {}
        for mode in ("graph", "eager"):
            vals = [r.get(f"{p}_{mode}_us") for p in ("dispatch", "combine", "nccl_dispatch", "nccl_combine")]
            if all(isinstance(v, (int, float)) for v in vals):
                peer, nccl = vals[0] + vals[1], vals[2] + vals[3]
                row[mode] = {"peer_us": round(peer, 2), "nccl_us": round(nccl, 2), "saving_us": round(nccl - peer, 2)}
        if row:
            out[T] = row
    return out


def summarize(ranks: list[dict], prediction: dict, n_layers: int, full_depth: int = FULL_DEPTH) -> dict:
    """Merge the ranks' results: correctness per case (all ranks ok), timing per batch size (slowest rank's
    median per measure and path), derived a2a / expert shares, savings and the prediction beside them."""
    cases = []
    for i, c0 in enumerate(ranks[0]["correctness"]):
        per = [r["correctness"][i] for r in ranks]
        cases.append({"batch_per_rank": c0["batch_per_rank"], "ok": all(c["ok"] for c in per),
                      "chunks": max(c["chunks"] for c in per),
                      **{k: max(c[k] for c in per) for k in ("peer_err", "a2a_err", "peer_vs_a2a")}})
    timing = []
    for i, t0 in enumerate(ranks[0]["timing"]):
        B = t0["B"]
        row = {"B": B}
        for path in ("peer", "a2a"):
            if path not in t0:
                continue
            med = {m: max(r["timing"][i][path][m]["median_us"] for r in ranks) for m in MEASURES}
            p = {f"{m}_us": round(v, 1) for m, v in med.items()}
            p["a2a_us"] = round(med["comm"] - med["route"], 1)
            p["experts_us"] = round(med["layer"] - med["comm"], 1)
            p["a2a_share"] = round(p["a2a_us"] / med["layer"], 3) if med["layer"] > 0 else None
            p["step_overhead_us"] = round(med["step"] - n_layers * med["layer"], 1)
            row[path] = p
        if "peer" in row and "a2a" in row:
            a, p = row["a2a"], row["peer"]
            row["saving_layer_us"] = round(a["layer_us"] - p["layer_us"], 1)
            row["saving_comm_us"] = round(a["comm_us"] - p["comm_us"], 1)
            row["saving_step_us"] = round(a["step_us"] - p["step_us"], 1)
            row["speedup_layer"] = round(a["layer_us"] / p["layer_us"], 3) if p["layer_us"] > 0 else None
            # a full-depth step: the measured step (its first layer carries the per-step costs) plus the rest
            row[f"est_saving_step_{full_depth}_layers_us"] = round(
                row["saving_step_us"] + (full_depth - n_layers) * row["saving_layer_us"], 1)
        pred = prediction.get(B)
        if pred:
            row["predicted"] = pred
        timing.append(row)
    return {"ok": all(c["ok"] for c in cases) and all(r.get("peer_backend") == "cute" for r in ranks),
            "correctness": cases, "timing": timing}


def format_table(summary: dict) -> str:
    """Human-readable lines of :func:`summarize`'s timing (us per layer; slowest rank)."""
    lines = [(f"{'B':>4s} {'a2a layer':>9s} {'peer layer':>10s} {'save':>6s} {'a2a comm':>8s} {'peer comm':>9s} "
              f"{'share a2a/peer':>14s} {'pred graph':>10s} {'pred eager':>10s}")]
    for r in summary["timing"]:
        if "peer" not in r or "a2a" not in r:
            continue
        a, p, pr = r["a2a"], r["peer"], r.get("predicted", {})
        g = pr.get("graph", {}).get("saving_us")
        e = pr.get("eager", {}).get("saving_us")
        lines.append(f"{r['B']:>4d} {a['layer_us']:>9.1f} {p['layer_us']:>10.1f} {r['saving_layer_us']:>6.1f} "
                     f"{a['a2a_us']:>8.1f} {p['a2a_us']:>9.1f} {a['a2a_share']:>6.2f}/{p['a2a_share']:<7.2f} "
                     f"{'-' if g is None else f'{g:.1f}':>10s} {'-' if e is None else f'{e:.1f}':>10s}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------ rank process


def _config(o: dict):
    from rackbed.engine.core.model import get_model
    from rackbed.engine.real.model import TorchModelConfig
    from rackbed.sim.scenario import truncate_model

    if o.get("tiny"):  # the CPU test's model
        return TorchModelConfig(hidden=128, n_layers=o["layers"], n_q_heads=4, n_kv_heads=2, head_dim=32,
                                n_experts=8, top_k=2, moe_intermediate=64, vocab=64, rope_theta=10000.0)
    return TorchModelConfig.from_spec(truncate_model(get_model("qwen3-235b-a22b"), o["layers"]))


def _rank(rank: int, world: int, o: dict) -> dict:
    """One rank: build the model, check both paths, time both; returns this rank's results (JSON-able)."""
    try:
        return _rank_body(rank, world, o)
    except BaseException:  # print now: the peer rank may be stuck in a collective until the parent's timeout
        import traceback

        print(f"[check_peer_a2a r{rank}] FAILED:\n{traceback.format_exc()}", flush=True)
        raise


def _rank_body(rank: int, world: int, o: dict) -> dict:
    import torch

    os.environ["RACKBED_PEER_A2A"] = "1"
    r = _RankRun.start(rank, world, o)
    info = r.attach_peer()
    correctness = _check_paths(r)
    timing = _time_paths(r)
    if r.peer is not None and r.cuda:
        r.peer.check_error()
        r.barrier()
        r.peer.close()
    r.m._a2a = False
    info.update(correctness=correctness, timing=timing, wall_s=round(time.perf_counter() - r.t_start, 1))
    if r.cuda:
        info.update(device_name=torch.cuda.get_device_name(r.dev),
                    max_memory_gib=round(torch.cuda.max_memory_allocated(r.dev) / 2**30, 1))
    return info


@dataclass
class _RankRun:
    """One rank of the check: the EP-sharded model ``m`` and the unsharded reference ``full`` (same random weights),
    the peer object (None when the engine fell back to all_to_all), the paths to compare, and the helpers the
    correctness and timing stages share (log line, device sync, barrier, inputs, routing)."""

    rank: int
    o: dict
    cfg: Any
    dev: Any
    group: Any
    flag: Any
    t_start: float
    m: Any = None
    full: Any = None
    peer: Any = None
    paths: tuple[str, ...] = ("a2a",)

    @classmethod
    def start(cls, rank: int, world: int, o: dict) -> _RankRun:
        """The rank's group and its model sharded over ``world`` expert-parallel ranks."""
        import torch
        import torch.distributed as dist

        from rackbed.engine.real.comm import Comm
        from rackbed.engine.real.model import Shard, ShardedQwen3Moe, shard_layer

        t_start = time.perf_counter()
        cuda = o["device"] == "cuda"
        dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
        group = dist.new_group(list(range(world)))
        r = cls(rank, o, None, dev, group, torch.zeros(1, device=dev), t_start)
        cfg = r.cfg = _config(o)
        r.full = ShardedQwen3Moe.random(cfg, Shard(), Comm(), seed=o["seed"], device=dev, dtype=torch.bfloat16)
        shard = Shard(attn_tp=1, ep=world, ep_rank=rank)
        r.m = m = ShardedQwen3Moe(cfg, shard, Comm(ep_group=group),
                                  [shard_layer(w, cfg, shard) for w in r.full.layers], r.full.glob)
        r.sync()
        r.say(f"weights ready ({cfg.n_layers} layers, hidden {cfg.hidden}, {cfg.n_experts} experts, "
              f"top-{cfg.top_k}, F {cfg.moe_intermediate}, experts {m.experts.start}..{m.experts.stop - 1} here)",
              all_ranks=True)
        return r

    @property
    def cuda(self) -> bool:
        return self.o["device"] == "cuda"

    def say(self, msg: str, all_ranks: bool = False) -> None:
        if self.rank == 0 or all_ranks:
            print(f"[check_peer_a2a r{self.rank} {time.perf_counter() - self.t_start:6.1f} s] {msg}", flush=True)

    def sync(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize(self.dev)

    def barrier(self) -> None:
        import torch.distributed as dist

        self.sync()
        dist.all_reduce(self.flag, group=self.group)
        self.sync()

    def attach_peer(self) -> dict:
        """The peer object: built by the engine itself on its first bf16 CUDA call (collective), or injected on the
        CPU (the torch backend). Returns the rank's ``info`` (backend, or why the engine fell back)."""
        import torch

        from rackbed.kernels.moe_a2a import PeerMoeAllToAll

        cfg, m, dev, o = self.cfg, self.m, self.dev, self.o
        info = {"rank": self.rank, "peer_backend": None, "fallback_reason": None}
        if self.cuda:
            m._peer_a2a(torch.zeros(1, cfg.hidden, dtype=torch.bfloat16, device=dev))
            peer = m._a2a or None
            if peer is None:  # ask the object why (collective, like the engine's attempt)
                probe = PeerMoeAllToAll(self.group, max_tokens=32, hidden=cfg.hidden, top_k=cfg.top_k,
                                        n_experts=cfg.n_experts, payload="bf16", backend="auto")
                info["fallback_reason"] = probe.fallback_reason or f"engine declined backend {probe.backend!r}"
                probe.close()
        else:
            peer = PeerMoeAllToAll(self.group, max_tokens=o["max_tokens"], hidden=cfg.hidden, top_k=cfg.top_k,
                                   n_experts=cfg.n_experts, backend="torch")
            peer.device = dev
            m._a2a, m._a2a_out, m._a2a_chunks = peer, peer.alloc_outputs(), 1
        if peer is not None:
            info.update(peer_backend=peer.backend, max_tokens=peer.lay.max_tokens,
                        direct_launch=getattr(peer, "direct_launch", None))
        self.say(f"peer path: backend={info['peer_backend']} fallback={info['fallback_reason']}")
        self.peer = peer
        self.paths = ("peer", "a2a") if peer is not None else ("a2a",)
        return info

    def use(self, path: str) -> None:
        self.m._a2a = self.peer if path == "peer" else False

    def hidden_states(self, B: int, tag: int, li: int):
        import torch

        g = torch.Generator().manual_seed(self.o["seed"] * 7919 + tag * 101 + li * 13 + self.rank)
        return torch.randn(B, self.cfg.hidden, generator=g).to(self.dev, torch.bfloat16)

    def route(self, li: int, h):
        import torch

        if h.shape[0]:
            return self.m._route(self.m.layers[li], h)
        return (torch.zeros(0, self.cfg.top_k, dtype=torch.long, device=self.dev),
                torch.zeros(0, self.cfg.top_k, dtype=torch.bfloat16, device=self.dev))


def _check_paths(r: _RankRun) -> list[dict]:
    """(1) correctness: peer vs all_to_all vs the unsharded experts, every layer in order, per case of tokens per
    rank (the timed sizes on both ranks, then the extra cases)."""
    import torch

    cfg, m, o = r.cfg, r.m, r.o
    cases = [(B, B) for B in o["sizes"]] + [tuple(c) for c in o["extra_cases"]]
    correctness = []
    with torch.inference_mode():
        for ci, batches in enumerate(cases):
            B = batches[r.rank]
            rec = {"batch_per_rank": list(batches), "ok": True, "chunks": 0, "peer_err": 0.0, "a2a_err": 0.0,
                   "peer_vs_a2a": 0.0, "layers": []}
            for li in range(cfg.n_layers):
                h = r.hidden_states(B, 1000 + ci, li)
                topi, topw = r.route(li, h)
                outs = {}
                for path in r.paths:
                    r.use(path)
                    outs[path] = m._moe_dp_ep(m.layers[li], h, topi, topw)
                    if path == "peer" and li == 0:
                        rec["chunks"] = m._a2a_chunks
                ref = r.full._local_experts(r.full.layers[li], h, topi, topw)
                scale = ref.float().abs().max().item() if B else 0.0

                def err(a, b, scale=scale, B=B):
                    return (a.float() - b.float()).abs().max().item() / scale if B else 0.0

                lay = {"scale": scale, "a2a_err": err(outs["a2a"], ref)}
                ok = tuple(outs["a2a"].shape) == (B, cfg.hidden)
                if "peer" in outs:
                    p = outs["peer"]
                    lay.update(peer_err=err(p, ref), peer_vs_a2a=err(p, outs["a2a"]),
                               finite=bool(torch.isfinite(p).all().item()) if B else True)
                    ok = ok and tuple(p.shape) == (B, cfg.hidden) and lay["finite"] and lay["peer_err"] < TOL \
                        and lay["peer_vs_a2a"] < TOL
                    rec["peer_err"] = max(rec["peer_err"], lay["peer_err"])
                    rec["peer_vs_a2a"] = max(rec["peer_vs_a2a"], lay["peer_vs_a2a"])
                else:
                    ok = False
                ok = ok and (B == 0 or scale > 0) and lay["a2a_err"] < TOL
                rec["a2a_err"] = max(rec["a2a_err"], lay["a2a_err"])
                rec["ok"] = rec["ok"] and ok
                rec["layers"].append(lay)
            correctness.append(rec)
            r.say(f"check {batches}: ok={rec['ok']} chunks={rec['chunks']} peer_err={rec['peer_err']:.2e} "
                  f"a2a_err={rec['a2a_err']:.2e} peer_vs_a2a={rec['peer_vs_a2a']:.2e}")
    if r.peer is not None and r.cuda:
        r.peer.check_error()
    return correctness


def _time_paths(r: _RankRun) -> list[dict]:
    """(2) timing: eager, both paths interleaved in the same run; per size, the medians (and range) of each of
    ``MEASURES`` per path."""
    import torch

    cfg, m, o = r.cfg, r.m, r.o

    def identity(w, x, ids, wts):  # the local experts replaced by nothing: communication and bookkeeping only
        return x

    last = cfg.n_layers - 1

    def run(measure: str, hs: list) -> None:
        if measure == "route":
            r.route(last, hs[last])
            return
        if measure == "comm":
            m._local_experts = identity
        try:
            for li in (range(cfg.n_layers) if measure == "step" else (last,)):
                topi, topw = r.route(li, hs[li])
                m._moe_dp_ep(m.layers[li], hs[li], topi, topw)
        finally:
            m.__dict__.pop("_local_experts", None)

    def timed(measure: str, hs: list) -> float:
        r.barrier()
        t0 = time.perf_counter()
        for _ in range(o["inner"]):
            run(measure, hs)
        r.sync()
        return (time.perf_counter() - t0) / o["inner"] * 1e6

    paths = r.paths
    timing = []
    with torch.inference_mode():
        for B in o["sizes"]:
            hs = [r.hidden_states(B, B, li) for li in range(cfg.n_layers)]
            for path in paths:  # warm-up (compiles the expert kernels picked for these row counts); step first
                r.use(path)
                for measure in ("step", "layer", "comm", "route"):
                    for _ in range(2):
                        run(measure, hs)
            samples = {path: {ms: [] for ms in MEASURES} for path in paths}
            for rep in range(o["reps"]):
                for path in (paths if rep % 2 == 0 else paths[::-1]):
                    r.use(path)
                    run("step", hs)  # agree the chunk count for this B before timing single layers
                    for measure in MEASURES:
                        samples[path][measure].append(timed(measure, hs))
            row = {"B": B}
            for path in paths:
                row[path] = {ms: {"median_us": statistics.median(v), "min_us": min(v), "max_us": max(v)}
                             for ms, v in samples[path].items()}
            timing.append(row)
            r.say(f"time B={B}: " + "  ".join(
                f"{path} layer {row[path]['layer']['median_us']:.0f} comm {row[path]['comm']['median_us']:.0f} "
                f"route {row[path]['route']['median_us']:.0f} step {row[path]['step']['median_us']:.0f} us"
                for path in paths))
    return timing


# ------------------------------------------------------------------------------------------------ main


def _sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(s) for s in text.split(",") if s.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"--sizes: {text!r} is not a comma-separated list of integers") from None
    if not sizes or any(not 1 <= s <= 256 for s in sizes):
        raise argparse.ArgumentTypeError(f"--sizes: {text!r}: each batch must be in 1..256 (one chunk)")
    return sizes


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m rackbed.engine.bench.peer_a2a", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="results JSON path")
    add_force(ap, "replace an existing --out file")
    ap.add_argument("--layers", type=int, default=2, choices=range(2, 9), metavar="2..8")
    ap.add_argument("--sizes", type=_sizes, default=SIZES, help="tokens per rank, comma-separated (default "
                    f"{','.join(map(str, SIZES))})")
    ap.add_argument("--reps", type=int, default=25)
    ap.add_argument("--inner", type=int, default=5, help="calls per timed repeat")
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds before the rank processes are killed")
    ap.add_argument("--bench-cases", default=str(BENCH_CASES), help="kernel benchmark cases.jsonl (prediction)")
    a = ap.parse_args(argv)
    if a.reps < 1 or a.inner < 1:
        ap.error("--reps and --inner must be >= 1")
    entry_file(a.out, force=a.force)  # before the benchmark, not after it
    return a


def _write(path: str, doc: dict) -> None:
    write_text(path, json.dumps(doc, indent=1))  # rewritten as it goes: the file checked at the start


def main(argv=None) -> int:
    a = parse_args(argv)
    for k, v in MULTICAST_OFF:  # never NVLink multicast (inherited by the rank processes)
        os.environ[k] = v
    try:
        import torch
    except ImportError:
        print("check_peer_a2a: needs torch and 2 CUDA GPUs; torch is not installed", flush=True)
        return 2
    n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n_gpus < 2:
        print(f"check_peer_a2a: needs 2 CUDA GPUs, found {n_gpus}; nothing run", flush=True)
        return 2
    from rackbed.engine.real.launch import RankFailed, spawn_local

    opts = {"device": "cuda", "layers": a.layers, "sizes": list(a.sizes), "extra_cases": [list(c) for c in EXTRA_CASES],
            "reps": a.reps, "inner": a.inner, "seed": 0}
    doc = {"date": time.strftime("%Y-%m-%d %H:%M"), "torch": torch.__version__, "options": opts,
           "model": f"qwen3-235b-a22b[:{a.layers}] MoE, bf16, ep=2", "mode": GRAPH_NOTE,
           "grouped_impl": os.environ.get("RACKBED_GROUPED_IMPL", "auto"),
           "a2a_max_tokens": int(os.environ.get("RACKBED_A2A_MAX_TOKENS", "256")),
           "prediction_source": a.bench_cases}
    t0 = time.perf_counter()
    print(f"check_peer_a2a: {n_gpus} GPUs, spawning 2 ranks (timeout {a.timeout:.0f} s)", flush=True)
    try:
        ranks = spawn_local(_rank, 2, opts, backend="nccl", timeout_s=a.timeout)
    except RankFailed as exc:
        doc.update(ok=False, error=str(exc), wall_s=round(time.perf_counter() - t0, 1))
        _write(a.out, doc)
        print(f"check_peer_a2a: FAILED: {exc}", flush=True)
        return 1
    pred = bench_prediction(a.bench_cases, a.sizes)
    summary = summarize(ranks, pred, a.layers)
    doc.update(summary, wall_s=round(time.perf_counter() - t0, 1), ranks=ranks)
    _write(a.out, doc)
    print(format_table(summary), flush=True)
    for c in summary["correctness"]:
        print(f"  {c['batch_per_rank']}: ok={c['ok']} peer_err={c['peer_err']:.2e} a2a_err={c['a2a_err']:.2e}",
              flush=True)
    print(f"check_peer_a2a: ok={summary['ok']} backend={ranks[0].get('peer_backend')} "
          f"({ranks[0].get('fallback_reason') or 'no fallback'}); wrote {a.out} in {doc['wall_s']} s", flush=True)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
