"""One rank of the real engine: a process that owns one GPU (or a CPU stand-in) and executes plan commands.

The driver (``engine.real.driver``) sends commands on this rank's queue; every rank of a group gets the same
command and runs it together (collectives inside the group), then replies on the shared result queue with
``(token, rank, status, payload)``. Commands:

- ``prefill``  items ``[(rid, token_ids)]`` -> KV kept in this rank's cache; reply ``{rid: (first_token, pages)}``
- ``kv_alloc`` (decoder rank) reserve pages for ``n_tokens`` -> reply ``pages``
- ``kv_send``  (prefiller ranks) ship ``rid``'s KV along the resharding plan, free it -> reply bytes
- ``kv_recv``  (decoder rank) receive it into the reserved pages -> reply bytes
- ``decode``   (every decoder rank) apply ``joined`` / ``left`` then one synchronous DP-EP step -> ``{rid: token}``
- ``drop``     free a request's KV (after a failure elsewhere); ``stop`` ends the process.
"""

from __future__ import annotations

import os
import time
import traceback
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from engine.core.kv import KvLayout
from engine.real.comm import Comm
from engine.real.model import PagedKvCache, Shard, ShardedQwen3Moe, TorchModelConfig
from engine.real.transfer import TransferEngine


@dataclass(frozen=True)
class RankSpec:
    """What one rank is: its role, its group's global ranks, where it runs, and how the model is made."""

    rank: int
    world: int
    role: str                       # "prefill" | "decode"
    group_id: str
    group_ranks: tuple[int, ...]    # global ranks of this group, index = rank within the group
    all_groups: tuple[tuple[str, tuple[int, ...]], ...]  # every group, in creation order (for dist.new_group)
    device: str
    dtype: str
    cfg: TorchModelConfig
    tp: int
    ep: int
    n_pages: int
    page_tokens: int
    prefill_tp: int
    prefill_pages: int
    decode_pages: int
    seed: int
    weights: str | None = None      # HF safetensors directory, or None for seeded random weights
    init_file: str = ""
    backend: str = "gloo"


@dataclass
class _Seq:
    pages: list[int]
    length: int                     # tokens whose KV is in the cache
    last_token: int                 # next input token
    tokens: list[int] = field(default_factory=list)


def _nccl_all_reduce(x, group):
    dist.all_reduce(x, group=group)
    return x


def _dtype(name: str) -> torch.dtype:
    return {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}[name]


def _load_state(path: str) -> dict[str, torch.Tensor]:
    from pathlib import Path

    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    files = sorted(Path(path).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors files")
    for f in files:
        state.update(load_file(str(f)))
    return state


def rank_main(spec: RankSpec, cmd_q, res_q) -> None:
    """Process entry point."""
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")               # never NVLink multicast on shared hosts
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")
    torch.set_num_threads(1)
    try:
        if spec.device.startswith("cuda"):
            torch.cuda.set_device(torch.device(spec.device))
        from datetime import timedelta

        dist.init_process_group(spec.backend, init_method=f"file://{spec.init_file}", rank=spec.rank,
                                world_size=spec.world, timeout=timedelta(seconds=60))
        groups = {}
        for gid, ranks in spec.all_groups:            # every rank creates every group, in the same order
            groups[gid] = dist.new_group(list(ranks)) if len(ranks) > 1 else None
        r = Rank(spec, groups[spec.group_id])
        res_q.put((None, spec.rank, "ready", None))
        r.serve(cmd_q, res_q)
    except BaseException as exc:  # the driver sees the error and the process exit
        res_q.put((None, spec.rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        raise
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


class Rank:
    def __init__(self, spec: RankSpec, group) -> None:
        self.spec = spec
        me = spec.group_ranks.index(spec.rank)
        self.me = me
        dev, dt = torch.device(spec.device), _dtype(spec.dtype)
        if spec.role == "prefill":
            shard = Shard(attn_tp=spec.tp, attn_rank=me, ep=spec.ep, ep_rank=me % spec.ep)
            comm = Comm(tp_group=group if spec.tp > 1 else None, ep_group=group if spec.ep > 1 else None)
            if dev.type == "cuda" and spec.tp > 1 and os.environ.get("RACKBED_PEER_ALLREDUCE", "1") == "1":
                # the TP all-reduce and the prefill MoE combine through the peer-memory kernels (NCCL fallback)
                from kernels.allreduce import PeerAllReduce

                ar = PeerAllReduce(group, max_bytes=64 << 20, dtype=dt)
                comm.tp_allreduce_impl = lambda x, ar=ar: ar.all_reduce(x, out=x) if \
                    x.numel() * x.element_size() <= (64 << 20) else _nccl_all_reduce(x, group)
        else:
            shard = Shard(attn_tp=1, attn_rank=0, ep=spec.ep, ep_rank=me)
            comm = Comm(ep_group=group if spec.ep > 1 else None)
        if spec.weights:
            self.model = ShardedQwen3Moe.from_state_dict(_load_state(spec.weights), spec.cfg, shard, comm,
                                                         device=dev, dtype=dt)
        else:
            self.model = ShardedQwen3Moe.random(spec.cfg, shard, comm, seed=spec.seed, device=dev, dtype=dt)
        self.cache: PagedKvCache = self.model.new_cache(spec.n_pages, spec.page_tokens)
        cfg = spec.cfg
        eb = torch.tensor([], dtype=dt).element_size()
        src = KvLayout.tp_sharded(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, eb, spec.page_tokens, spec.prefill_tp,
                                  spec.prefill_pages)
        dst = KvLayout.tp_sharded(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, eb, spec.page_tokens, 1,
                                  spec.decode_pages)
        self.transfer = TransferEngine(src, dst)
        self.seqs: dict[int, _Seq] = {}        # prefiller: KV awaiting shipment; decoder: received / running
        self.running: list[int] = []           # decoder: request ids in the batch, in join order
        self.dev = dev
        self.graphs = None
        if dev.type == "cuda" and spec.role == "decode" and spec.ep == 1 and os.environ.get("RACKBED_NO_GRAPHS") != "1":
            from engine.real.model import DecodeGraphRunner

            self.graphs = DecodeGraphRunner(self.model, self.cache)
        self._warm_up()

    @torch.inference_mode()
    def _warm_up(self) -> None:
        """One throw-away forward of this rank's role, so JIT compilation (CuTe DSL kernels, cuBLAS handles)
        happens before the run instead of inside the first measured plan. Every rank of the group does it."""
        pages = self.cache.alloc(16)
        if self.spec.role == "prefill":
            self.model.forward_prefill([torch.zeros(16, dtype=torch.long, device=self.dev)], self.cache, [pages])
        else:
            args = (torch.zeros(1, dtype=torch.long, device=self.dev), torch.zeros(1, dtype=torch.long, device=self.dev))
            self.model.forward_decode(*args, self.cache, torch.tensor([pages[:1]], device=self.dev))
            if self.graphs is not None:
                self.graphs(*args, torch.tensor([pages[:1]], device=self.dev))
        self.cache.free(pages)
        self._sync()

    def _sync(self) -> None:
        if self.dev.type == "cuda":
            torch.cuda.synchronize()

    def serve(self, cmd_q, res_q) -> None:
        while True:
            msg = cmd_q.get()
            op, token, args = msg
            if op == "stop":
                res_q.put((token, self.spec.rank, "ok", None))
                return
            try:
                t0 = time.perf_counter()
                out = getattr(self, f"_op_{op}")(**args)
                self._sync()
                res_q.put((token, self.spec.rank, "ok", (out, time.perf_counter() - t0)))
            except Exception as exc:
                res_q.put((token, self.spec.rank, "error", f"{type(exc).__name__}: {exc}"))

    # -- prefill side ------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def _op_prefill(self, items):
        seqs, pts = [], []
        for rid, ids in items:
            if rid in self.seqs:                          # a stale copy (re-prefill after a failure)
                self.cache.free(self.seqs.pop(rid).pages)
            pages = self.cache.alloc(len(ids))
            pts.append(pages)
            seqs.append(torch.tensor(ids, dtype=torch.long, device=self.dev))
        logits = self.model.forward_prefill(seqs, self.cache, pts)
        first = logits.argmax(-1).tolist()
        out = {}
        for (rid, ids), pages, tok in zip(items, pts, first):
            self.seqs[rid] = _Seq(pages=pages, length=len(ids), last_token=tok)
            out[rid] = (tok, pages)
        return out

    def _op_kv_send(self, rid, dst_global, seq_len, dst_pages):
        s = self.seqs.pop(rid)
        n = self.transfer.send(self.cache.storage, self.me, dst_global, seq_len, s.pages, dst_pages)
        self.cache.free(s.pages)
        return n

    # -- decode side -------------------------------------------------------------------------------------------
    def _op_kv_alloc(self, rid, n_tokens):
        if rid in self.seqs:
            self._drop(rid)
        pages = self.cache.alloc(n_tokens + 1)
        self.seqs[rid] = _Seq(pages=pages, length=0, last_token=-1)
        return pages

    def _op_kv_recv(self, rid, src_globals, seq_len, src_pages, last_token, tokens):
        s = self.seqs[rid]
        n = self.transfer.recv(self.cache.storage, list(src_globals), seq_len, src_pages, s.pages)
        s.length, s.last_token, s.tokens = seq_len, last_token, list(tokens)
        return n

    def _drop(self, rid):
        s = self.seqs.pop(rid, None)
        if s is not None:
            self.cache.free(s.pages)
        if rid in self.running:
            self.running.remove(rid)

    def _op_drop(self, rids):
        for rid in rids:
            self._drop(rid)
        return len(rids)

    @torch.inference_mode()
    def _op_decode(self, joined, left):
        for rid in left:
            self._drop(rid)
        for rid, rank in joined:
            if rank == self.me:
                self.running.append(rid)
        batch = [rid for rid in self.running if rid in self.seqs]
        if batch:
            for rid in batch:
                s = self.seqs[rid]
                self.cache.grow(s.pages, s.length + 1)
            width = max(len(self.seqs[r].pages) for r in batch)
            table = torch.tensor([self.seqs[r].pages + [self.seqs[r].pages[0]] * (width - len(self.seqs[r].pages))
                                  for r in batch], device=self.dev)
            toks = torch.tensor([self.seqs[r].last_token for r in batch], device=self.dev)
            pos = torch.tensor([self.seqs[r].length for r in batch], device=self.dev)
        else:
            table = torch.zeros(0, 1, dtype=torch.long, device=self.dev)
            toks = torch.zeros(0, dtype=torch.long, device=self.dev)
            pos = torch.zeros(0, dtype=torch.long, device=self.dev)
        if self.graphs is not None and batch:
            logits = self.graphs(toks, pos, table)
        else:
            logits = self.model.forward_decode(toks, pos, self.cache, table)
        nxt = logits.argmax(-1).tolist() if batch else []
        out = {}
        for rid, tok in zip(batch, nxt):
            s = self.seqs[rid]
            s.tokens.append(s.last_token)
            s.length += 1
            s.last_token = tok
            out[rid] = tok
        return out
