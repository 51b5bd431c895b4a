"""TP=2 prefill of a Qwen3-235B-width model with NCCL vs the peer-memory all-reduce (``kernels.allreduce``) behind
``Comm.tp_allreduce_impl``: same logits, and the step time of each (``python -m rackbed.engine.bench.tp_allreduce``)."""

from __future__ import annotations

import argparse
import json
import statistics
import time

from rackbed.topology.outputs import add_force, entry_file, write_text


def _rank(rank, world, layers, tokens, reps):
    import torch
    import torch.distributed as dist

    from rackbed.engine.core.model import get_model
    from rackbed.engine.real.comm import Comm
    from rackbed.engine.real.model import Shard, ShardedQwen3Moe, TorchModelConfig
    from rackbed.kernels.allreduce import PeerAllReduce
    from rackbed.sim.scenario import truncate_model

    dev = torch.device("cuda", rank)
    group = dist.new_group(list(range(world)))
    cfg = TorchModelConfig.from_spec(truncate_model(get_model("qwen3-235b-a22b"), layers))
    comm = Comm(tp_group=group, ep_group=group)
    m = ShardedQwen3Moe.random(cfg, Shard(attn_tp=world, attn_rank=rank, ep=world, ep_rank=rank), comm, seed=0,
                               device=dev, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, cfg.vocab, (tokens,), generator=g).to(dev)]
    out = {}
    ar = PeerAllReduce(group, max_bytes=tokens * cfg.hidden * 2, dtype=torch.bfloat16)
    for name, impl in (("nccl", None), ("peer", lambda x: ar.all_reduce(x, out=x))):
        comm.tp_allreduce_impl = impl
        ts, logits = [], None
        for i in range(reps + 1):
            cache = m.new_cache(-(-tokens // 64) + 1, 64)
            pt = cache.alloc(tokens)
            torch.cuda.synchronize()
            dist.barrier(group)
            t0 = time.perf_counter()
            logits = m.forward_prefill(seqs, cache, [pt])
            torch.cuda.synchronize()
            if i:
                ts.append(time.perf_counter() - t0)
            del cache
        out[name] = {"prefill_s": statistics.median(ts), "logits": logits.float().cpu()}
    diff = (out["nccl"]["logits"] - out["peer"]["logits"]).abs().max().item()
    scale = out["nccl"]["logits"].abs().max().item()
    same_top = bool((out["nccl"]["logits"].argmax(-1) == out["peer"]["logits"].argmax(-1)).all())
    return {"rank": rank, "nccl_prefill_s": out["nccl"]["prefill_s"], "peer_prefill_s": out["peer"]["prefill_s"],
            "max_abs_logit_diff": diff, "max_abs_logit": scale, "same_argmax": same_top,
            "peer_backend": ar.backend, "fallback_reason": getattr(ar, "fallback_reason", "")}


def main(argv=None) -> int:
    from rackbed.engine.real.launch import spawn_local

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", default=None)
    add_force(ap, "replace an existing --out file")
    a = ap.parse_args(argv)
    if a.out:  # before the benchmark, not after it
        entry_file(a.out, force=a.force)
    res = spawn_local(_rank, 2, a.layers, a.tokens, a.reps, backend="nccl")
    for r in res:
        print(json.dumps(r))
    if a.out:
        doc = {"date": time.strftime("%Y-%m-%d"), "layers": a.layers, "tokens": a.tokens, "ranks": res}
        write_text(a.out, json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
