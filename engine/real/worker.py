"""One rank of the real engine: a process that owns one GPU (or a CPU stand-in) and executes plan commands.

The driver (``engine.real.driver``) sends commands on this rank's queue; every rank of a group gets the same
command and runs it together (collectives inside the group), then replies on the shared result queue with
``(token, rank, status, payload)`` (status ``ok``, ``error``, or ``declined``: a KV transfer that failed only
because a source no longer holds the request's KV, ``declined: KV lost: ...``, or because the decoder has no
free pages for it, ``declined: no pages: ...``). Commands:

- ``prefill``  items ``[(rid, token_ids[, cached])]`` -> KV kept in this rank's cache (a cached prompt prefix
  reused from the rank's prefix cache, ``engine.real.prefix``); reply ``{rid: (first_token, pages, reused)}``
- ``kv_send``  (prefiller ranks) wait for the decoder's page list, ship ``rid``'s KV along the resharding plan
  -> reply bytes (the KV is freed by the ``drop`` the driver sends once the scheduler has seen the transfer
  complete)
- ``kv_recv``  (decoder rank) reserve pages, offer them to the sources, receive the KV into them -> reply bytes
- ``decode``   (every decoder rank) apply ``joined`` / ``left`` then one synchronous DP-EP step -> ``{rid: token}``;
  with MTP (``RankSpec.draft_k`` > 0) a speculative step (``engine.real.mtp``: drafts, one verify forward) ->
  ``{rid: [tokens]}``, ``1 + accepted`` tokens each
- ``mixed``    (an aggregated worker's rank) ``decode`` then ``prefill`` of ``items`` into the same cache ->
  ``{"decode": ..., "prefill": ...}``; a prefilled request joins a later step's batch from where it is
- ``drop``     free a request's KV (after a failure elsewhere); ``stop`` ends the process.
- ``profile``  after the run, re-run the model calls of the sampled plans ``keys`` under the profiler -> one
  ``{"terms", "unscoped_s", "kernels_s", "wall_s"}`` per key (``engine.real.profiling``); a ``prefill`` /
  ``decode`` / ``mixed`` command with ``profile_key`` ``[kind, key]`` records its model calls for it

A model with Gated DeltaNet layers (Qwen3.5) also keeps a recurrent-state slot per sequence
(``layers_gdn.GdnStatePool``, ``RankSpec.state_slots`` of them): taken at the sequence's prefill, stepped by every
decode step, freed with its pages; the CUDA-graph runners take the slots in static buffers and step their padding
rows on the pool's scratch slot. Such models run on aggregated ranks only (``rank_setup.check_gdn``).

Two lanes per rank, as in production engines: a router thread reads the command queue and hands compute commands
(``prefill``, ``decode``, ``drop``) to the compute loop (the main thread) and KV commands (``kv_send``,
``kv_recv``) to a transfer thread. The transfer thread has its own CUDA stream and its own process group (the KV
group, over every rank, created after the compute groups), so a transfer never waits for the compute command in
front of it on either side and never interleaves with the TP/EP collectives of the compute loop: the decoder keeps
stepping while a new request's KV lands, and a prefiller ships a batch's KV while it computes the next batch.
Transfers run one at a time per rank, in command order; since the driver puts every command on every queue in one
global order, each rank meets the transfers it takes part in in that order and they cannot deadlock. Shared state
(the page allocator, the sequences) is guarded by one lock; a sequence's pages are touched by one lane at a time
(the driver dispatches a KV transfer after its prefill has replied, and lets a request join a decode step only
after its transfer has replied; both lanes synchronise their own stream before replying).
"""

from __future__ import annotations

import functools
import os
import queue
import threading
import time
import traceback
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist

from rackbed.engine.core.kv import KvLayout
from rackbed.engine.core.sharding import ParallelPlan
from rackbed.engine.real.comm import Comm
from rackbed.engine.real.families import model_class
from rackbed.engine.real.model import PagedKvCache, Shard, TorchModelConfig
from rackbed.engine.real.mtp import draft_room, mtp_step
from rackbed.engine.real.prefix import RankPrefixCache
from rackbed.engine.real.transfer import KvBackend, KvDeclined, KvNoRoom, TransferEngine


@dataclass(frozen=True)
class RankSpec:
    """What one rank is: its role, its group's global ranks, where it runs, and how the model is made."""

    rank: int
    world: int
    role: str                       # "prefill" | "decode" | "aggregated" (one GPU: prefills and decodes)
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
    # decoder or aggregated rank: decode CUDA-graph buckets captured at warm-up (rows up to ``graph_max_batch``:
    # the batch times ``1 + draft_k`` with MTP, whose verify replays them; page-table widths ``graph_pages`` =
    # (lo, hi)); (0, 0) = none, capture on first use only
    graph_max_batch: int = 0
    graph_pages: tuple[int, int] = (0, 0)
    # prefilling ranks of one GPU (a TP1 prefiller, an aggregated worker): prefill CUDA graphs captured at warm-up
    # for prompts of ``prefill_lens`` = (lo, hi) tokens, in chunks of at most ``chunk_tokens`` (0: whole prompts),
    # and with a prefix cache the suffixes after its cached prefixes (``prefill_warm_plan``); (0, 0) = capture on
    # first use only
    prefill_lens: tuple[int, int] = (0, 0)
    chunk_tokens: int = 0
    kv_peers: tuple[tuple[int, int], ...] = ()   # (prefill rank, decode rank) pairs connected at start-up
    # prefix cache of a rank that prefills (prefiller, aggregated): blocks of ``prefix_block_tokens`` tokens (a
    # multiple of page_tokens), at most ``prefix_blocks`` of them (their pages come out of ``n_pages``); 0 = off
    prefix_blocks: int = 0
    prefix_block_tokens: int = 0
    # sliding-window rings (models with sliding layers): how many sequences a prefiller rank / a decoder or
    # aggregated rank holds at once, each owning one ring (``rank_setup.ring_seqs``); 0 = one per page
    prefill_rings: int = 0
    decode_rings: int = 0

    @property
    def n_rings(self) -> int:
        """Rings of this rank's cache (0: one per page)."""
        return self.prefill_rings if self.role == "prefill" else self.decode_rings
    # Gated DeltaNet models: sequences whose recurrent state the rank holds at once (``layers_gdn.GdnStatePool``)
    state_slots: int = 0
    # speculative decoding with the model's MTP module (``engine.real.mtp``): drafts per decode step (0 = off); every
    # rank of the run holds the module (a prefiller writes its KV, which the transfer ships with the other layers)
    draft_k: int = 0
    # random weights whose drafts agree with the target on this fraction of tokens (``engine.real.agreeing``)
    mtp_agree: float | None = None


@dataclass
class _Seq:
    pages: list[int]
    length: int                     # tokens whose KV is in the cache
    last_token: int                 # next input token
    tokens: list[int] = field(default_factory=list)
    busy: bool = False              # prefiller: the transfer lane is shipping it
    stale: bool = False             # prefiller: re-prefilled meanwhile; the sender frees these pages
    slot: int = -1                  # Gated DeltaNet models: its state slot (freed with its pages)
    mtp_h: torch.Tensor | None = None   # decoder with MTP: the target's hidden states of the positions whose MTP
    mtp_next: list[int] = field(default_factory=list)   # KV the next draft writes (mtp.py), and their next tokens


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


def kv_layouts(cfg, elem_bytes: int, page_tokens: int, prefill_tp: int, prefill_pages: int,
               decode_pages: int, mtp_layers: int = 0) -> tuple[KvLayout, KvLayout]:
    """``(prefiller, decoder)`` layouts of the KV transfer: the prefiller's TP group (MLA: the latent replicated
    on every rank; GQA: KV heads sharded) to one DP decode rank, every layer of the paged cache in model order
    (``TorchModelConfig.kv_layers``), then ``mtp_layers`` MTP module layers (their KV ships too, whole). Sliding
    layers carry their window (``TorchModelConfig.kv_windows``), so the plan ships only the window's latest tokens
    of them, from the prefiller's ring into the decoder's (``TransferEngine``'s ring part)."""
    def layout(tp: int, n_pages: int) -> KvLayout:
        lay = KvLayout.for_attention(cfg.attention, len(cfg.kv_layers) + mtp_layers, elem_bytes, page_tokens, tp,
                                     n_pages)
        return lay if lay.latent else replace(lay, windows=cfg.kv_windows + (0,) * mtp_layers)

    return layout(prefill_tp, prefill_pages), layout(1, decode_pages)


def rank_plan(spec: RankSpec) -> ParallelPlan:
    """The ``ParallelPlan`` of ``spec``'s group, ranks numbered within the group: a prefiller is ``tp`` attention
    ranks (dp = group / tp), a decoder or an aggregated worker ``len(group)`` DP ranks; ``ep`` as the spec says."""
    n = len(spec.group_ranks)
    tp = spec.tp if spec.role == "prefill" else 1
    return ParallelPlan(role="prefill" if spec.role == "prefill" else "decode", tp=tp, dp=n // tp, ep=spec.ep, gpus=tuple(range(n)),
                        kv_replication=spec.cfg.attention.kv_replication(tp) if not spec.cfg.is_mla else 1)


def make_groups(all_groups, world: int):
    """Every group's process group (None for a single rank), then the KV group over all ``world`` ranks. Every
    process of the job calls this with the same arguments (``new_group`` is collective, in creation order)."""
    groups = {}
    for gid, ranks in all_groups:
        groups[gid] = dist.new_group(list(ranks)) if len(ranks) > 1 else None
    kv_group = dist.new_group(list(range(world)))
    return groups, kv_group


#: seconds a KV receive waits for the compute lane to free pages before it refuses the transfer
KV_ROOM_WAIT_S = float(os.environ.get("RACKBED_KV_ROOM_WAIT_S", "5"))
#: seconds a collective or KV transfer may wait on a peer before it fails (every group inherits it)
PG_TIMEOUT_S = float(os.environ.get("RACKBED_PG_TIMEOUT_S", "60"))


def rank_main(spec: RankSpec, cmd_q, res_q) -> None:
    """Process entry point. The rank ends with its driver (``engine.loop.lifetime``); a collective or transfer
    blocked on a dead peer fails after the process group's timeout (gloo and NCCL alike; NCCL's async error
    handling turns it into an exception or an exit, both of which the driver sees)."""
    from rackbed.engine.loop.lifetime import die_with_parent

    die_with_parent()
    os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")               # never NVLink multicast on shared hosts
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")
    torch.set_num_threads(1)
    try:
        if spec.device.startswith("cuda"):
            torch.cuda.set_device(torch.device(spec.device))
        from datetime import timedelta

        dist.init_process_group(spec.backend, init_method=f"file://{spec.init_file}", rank=spec.rank,
                                world_size=spec.world, timeout=timedelta(seconds=PG_TIMEOUT_S))
        groups, kv_group = make_groups(spec.all_groups, spec.world)
        r = Rank(spec, groups[spec.group_id], kv_group)
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


def prefill_warm_plan(spec: RankSpec) -> tuple[list[tuple[int, int]], int]:
    """``(keys, reachable)`` of the prefill graphs a prefilling rank captures at warm-up
    (``PrefillGraphRunner.warm_plan``): its prompts' length range, chunks when it chunks, and, when it keeps a prefix
    cache, the suffix after every block-aligned prefix the cache can hold (a hit starts there)."""
    from rackbed.engine.real.model import PrefillGraphRunner

    prefix = {}
    if spec.prefix_blocks > 0 and spec.role in ("prefill", "aggregated"):
        prefix = {"block_tokens": spec.prefix_block_tokens,
                  "max_cached": spec.prefix_blocks * spec.prefix_block_tokens}
    return PrefillGraphRunner.warm_plan(*spec.prefill_lens, spec.chunk_tokens, spec.page_tokens, **prefix)


COMPUTE_OPS = frozenset({"prefill", "decode", "mixed", "drop", "profile"})
TRANSFER_OPS = frozenset({"kv_send", "kv_recv"})


class Rank:
    def __init__(self, spec: RankSpec, group, kv_group=None) -> None:
        self.spec = spec
        me = spec.group_ranks.index(spec.rank)
        self.me = me
        dev, dt = torch.device(spec.device), _dtype(spec.dtype)
        shard = Shard.of_plan(rank_plan(spec), me)
        if spec.role == "prefill":
            comm = Comm(tp_group=group if spec.tp > 1 else None, ep_group=group if spec.ep > 1 else None)
            if dev.type == "cuda" and spec.tp > 1 and os.environ.get("RACKBED_PEER_ALLREDUCE", "1") == "1":
                # the TP all-reduce and the prefill MoE combine through the peer-memory kernels (NCCL fallback)
                from rackbed.kernels.allreduce import PeerAllReduce

                ar = PeerAllReduce(group, max_bytes=64 << 20, dtype=dt)
                comm.tp_allreduce_impl = lambda x, ar=ar: ar.all_reduce(x, out=x) if \
                    x.numel() * x.element_size() <= (64 << 20) else _nccl_all_reduce(x, group)
        else:
            comm = Comm(ep_group=group if spec.ep > 1 else None)
        cls = model_class(spec.cfg)       # Qwen3-MoE, or the DeepSeek-V3 / gpt-oss / GLM-4.5 families
        if spec.weights:
            self.model = cls.from_state_dict(_load_state(spec.weights), spec.cfg, shard, comm,
                                             device=dev, dtype=dt, mtp=spec.draft_k > 0)
        else:
            agree = {} if spec.mtp_agree is None else {"mtp_agree": spec.mtp_agree}
            self.model = cls.random(spec.cfg, shard, comm, seed=spec.seed, device=dev, dtype=dt,
                                    mtp=spec.draft_k > 0, **agree)
        self.linear = spec.cfg.has_linear
        cache_kw = {"ring_seqs": spec.n_rings or None} if any(spec.cfg.kv_windows) else {}
        if self.linear:
            cache_kw["state_slots"] = spec.state_slots
        self.cache: PagedKvCache = self.model.new_cache(spec.n_pages, spec.page_tokens, **cache_kw)
        self.prefix: RankPrefixCache | None = None
        if spec.prefix_blocks > 0 and spec.role in ("prefill", "aggregated"):
            self.prefix = RankPrefixCache(self.cache, spec.prefix_blocks, spec.prefix_block_tokens)
        cfg = spec.cfg
        eb = torch.tensor([], dtype=dt).element_size()
        src, dst = kv_layouts(cfg, eb, spec.page_tokens, spec.prefill_tp, spec.prefill_pages, spec.decode_pages,
                              self.model.n_kv_layers - len(cfg.kv_layers))
        rp = self.cache.ring_pages if self.cache.window else 0
        self.transfer = TransferEngine(src, dst, KvBackend(kv_group), ring_pages=rp,
                                       src_ring_pool=rp * (spec.prefill_rings or spec.prefill_pages),
                                       dst_ring_pool=rp * (spec.decode_rings or spec.decode_pages))
        self.seqs: dict[int, _Seq] = {}        # prefiller: KV awaiting shipment; decoder: received / running
        self.running: list[int] = []           # decoder: request ids in the batch, in join order
        self.lock = threading.Lock()           # guards seqs, running and the cache's page allocator
        self.dev = dev
        # the transfer lane's stream (CUDA); the compute lane uses the thread's default stream
        self.kv_stream = torch.cuda.Stream(device=dev) if dev.type == "cuda" else None
        self.graphs = None
        self.prefill_graphs = None
        self.graph_info: dict = {}
        # a sampled plan's model calls (its inputs: re-run under the profiler after the run, ``_op_profile``)
        self.capture: list | None = None
        self.captured: dict[tuple, list] = {}
        # RACKBED_STATIC_STEPS=1: the graph runners on any device, running their static steps without capture
        # (mode "static"): the graph path's inputs and padding, checkable on the CPU
        static_steps = os.environ.get("RACKBED_STATIC_STEPS") == "1"
        graphs_on = static_steps or (dev.type == "cuda" and os.environ.get("RACKBED_NO_GRAPHS") != "1")
        if graphs_on and spec.role in ("decode", "aggregated") and spec.ep == 1:
            from rackbed.engine.real.model import DecodeGraphRunner

            self.graphs = DecodeGraphRunner(self.model, self.cache)
        # prefill graphs for every family (Gated DeltaNet layers: ``ShardedMoeLM.forward_chunk_static`` on the
        # sequence's state slot); the decode runner's scratch page (and ring) serves both runners, and both step
        # the state pool's scratch slot for their padding and captures
        if graphs_on and spec.role in ("prefill", "aggregated") and spec.tp == 1 and spec.ep == 1:
            from rackbed.engine.real.model import PrefillGraphRunner

            self.prefill_graphs = PrefillGraphRunner(self.model, self.cache,
                                                     pool=self.graphs.pool if self.graphs else None,
                                                     scratch=self.graphs.scratch if self.graphs else None)
        for runner in (self.graphs, self.prefill_graphs) if static_steps else ():
            if runner is not None:
                runner.mode, runner.why = "static", "RACKBED_STATIC_STEPS=1"
        self._warm_up()
        self._connect_kv_peers()

    @torch.inference_mode()
    def _warm_up(self) -> None:
        """One throw-away forward of this rank's role, so JIT compilation (CuTe DSL kernels, cuBLAS handles)
        happens before the run instead of inside the first measured plan. Every rank of the group does it."""
        pages = self.cache.alloc(16)
        slot = [self.cache.states.alloc()] if self.linear else None
        kw = {"slots": slot} if self.linear else {}
        if self.spec.role == "prefill":
            self.model.forward_prefill([torch.zeros(16, dtype=torch.long, device=self.dev)], self.cache, [pages], **kw)
        else:
            args = (torch.zeros(1, dtype=torch.long, device=self.dev), torch.zeros(1, dtype=torch.long, device=self.dev))
            self.model.forward_decode(*args, self.cache, torch.tensor([pages[:1]], device=self.dev), **kw)
            if self.graphs is not None:
                self.graphs(*args, torch.tensor([pages[:1]], device=self.dev),
                            slots=torch.tensor(slot, device=self.dev) if slot else None)
                self.graphs.n_captured_late = 0  # that capture is this throw-away step's, before any measured one
        self.cache.free(pages)
        if slot:
            self.cache.states.free(slot[0])
        if self.graphs is not None and self.graphs.mode == "graph" and self.spec.graph_max_batch > 0 \
                and self.spec.graph_pages[1] > 0:
            # capture the buckets the run will likely meet now, not inside a measured decode step
            self.graph_info = self.graphs.warm(self.spec.graph_max_batch, *self.spec.graph_pages,
                                               reserve_bytes=int(float(os.environ.get("RACKBED_GRAPH_RESERVE_GB", "8"))
                                                                 * (1 << 30)),
                                               budget_s=float(os.environ.get("RACKBED_GRAPH_WARMUP_S", "90")))
            print(f"rank {self.spec.rank}: decode graphs at warm-up: {self.graph_info}", flush=True)
        if self.prefill_graphs is not None and self.prefill_graphs.mode == "graph" and self.spec.prefill_lens[1] > 0:
            sp = self.spec
            keys, reachable = prefill_warm_plan(sp)
            if self.graphs is not None and self.graphs.pool is not None:
                self.prefill_graphs.pool = self.graphs.pool
            self.graph_info["prefill"] = self.prefill_graphs.warm(
                keys, reserve_bytes=int(float(os.environ.get("RACKBED_GRAPH_RESERVE_GB", "8")) * (1 << 30)),
                budget_s=float(os.environ.get("RACKBED_GRAPH_WARMUP_S", "90")))
            self.graph_info["prefill"]["reachable"] = reachable
            if reachable > len(keys):
                print(f"rank {sp.rank}: {reachable} prefill graph keys reachable, warming {len(keys)} "
                      f"(RACKBED_PREFILL_GRAPH_KEYS; the rest are captured on first use)", flush=True)
            print(f"rank {self.spec.rank}: prefill graphs at warm-up: {self.graph_info['prefill']}", flush=True)
        if self.dev.type == "cuda":
            torch.cuda.synchronize()

    def _connect_kv_peers(self) -> None:
        """One tiny message per (prefill rank, decode rank) pair over the KV group, in the same sorted order on
        every rank, so the point-to-point connections (NCCL communicators) exist before the first measured
        transfer."""
        me = self.spec.rank
        t = torch.zeros(1, dtype=torch.long, device=self.dev)
        for p, d in sorted(self.spec.kv_peers):
            if me == p:
                self.transfer.backend.send(t, d)
            elif me == d:
                self.transfer.backend.recv(t, p)
        if self.dev.type == "cuda":
            torch.cuda.synchronize()

    def _sync(self) -> None:
        """Wait for this thread's current stream (not the device: the other lane's work runs on)."""
        if self.dev.type == "cuda":
            torch.cuda.current_stream(self.dev).synchronize()

    def _run(self, op: str, token, args: dict, res_q) -> None:
        key = args.pop("profile_key", None)   # a plan sampled for profiling: record its model calls
        if key is not None:
            self.capture = self.captured.setdefault(tuple(key), [])
        try:
            t0 = time.perf_counter()
            out = getattr(self, f"_op_{op}")(**args)
            self._sync()
            res_q.put((token, self.spec.rank, "ok", (out, time.perf_counter() - t0)))
        except KvDeclined as exc:   # the KV is gone on a source, or the decoder has no pages: no rank's fault
            res_q.put((token, self.spec.rank, "declined", f"declined: {exc.why}: {exc}"))
        except Exception as exc:
            res_q.put((token, self.spec.rank, "error", f"{type(exc).__name__}: {exc}"))
        finally:
            if key is not None:   # (the transfer lane runs _run too: it leaves the compute lane's capture)
                self.capture = None

    def _transfer_loop(self, xfer_q: queue.Queue, res_q) -> None:
        if self.kv_stream is not None:
            torch.cuda.set_device(self.dev)
            torch.cuda.set_stream(self.kv_stream)
        torch.set_num_threads(1)
        while True:
            op, token, args = xfer_q.get()
            if op == "stop":
                return
            self._run(op, token, args, res_q)

    def _route(self, cmd_q, comp_q: queue.Queue, xfer_q: queue.Queue) -> None:
        while True:
            msg = cmd_q.get()
            op = msg[0]
            if op in TRANSFER_OPS:
                xfer_q.put(msg)
            else:
                comp_q.put(msg)
            if op == "stop":
                xfer_q.put(msg)
                return

    def serve(self, cmd_q, res_q) -> None:
        comp_q: queue.Queue = queue.Queue()
        xfer_q: queue.Queue = queue.Queue()
        xfer = threading.Thread(target=self._transfer_loop, args=(xfer_q, res_q), name="kv-transfer", daemon=True)
        router = threading.Thread(target=self._route, args=(cmd_q, comp_q, xfer_q), name="router", daemon=True)
        xfer.start()
        router.start()
        while True:
            op, token, args = comp_q.get()
            if op == "stop":
                xfer.join(timeout=10)   # a transfer stuck on a dead peer does not hold the stop up for long
                res_q.put((token, self.spec.rank, "ok", self.graph_report()))
                return
            if op not in COMPUTE_OPS:
                res_q.put((token, self.spec.rank, "error", f"unknown op {op!r}"))
                continue
            self._run(op, token, args, res_q)

    def graph_report(self) -> dict:
        """What ran as CUDA graphs: per step kind, the mode (graph / eager and why), graphs captured at warm-up
        and inside measured steps, and chunks too long for any bucket (run eagerly)."""
        out = {}
        for kind, r in (("decode", self.graphs), ("prefill", self.prefill_graphs)):
            if r is None:
                out[kind] = {"mode": "eager", "why": "no graph runner for this rank (CPU, EP > 1, TP > 1, or "
                                                       "RACKBED_NO_GRAPHS=1)"}
            else:
                out[kind] = {"mode": r.mode, "why": r.why, "captured": len(r.graphs),
                             "captured_late": r.n_captured_late, "eager_chunks": getattr(r, "n_eager", 0)}
        print(f"rank {self.spec.rank}: graphs: {out}", flush=True)
        return out

    # -- prefill side ------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def _op_prefill(self, items):
        """``items``: ``(rid, token_ids)`` or ``(rid, token_ids, cached)``. With a prefix cache, a prompt reuses
        ``cached`` tokens (the scheduler's count; None: as many as the cache holds) of the longest cached prefix of
        its blocks — fewer if the cache holds fewer, recomputed — and only the rest is computed; afterwards its
        full blocks are cached and unpinned (the scheduler's cache does the same in the same order, so the two
        evict alike). Reply ``{rid: (first token, pages, reused tokens)}``; the pages hold the whole prompt's KV
        (the shared prefix pages first), then come the sequence's ring pages (sliding layers), which the KV transfer
        ships."""
        seqs, pts, starts, pins, slots = [], [], [], [], []
        with self.lock:
            for item in items:
                rid, ids = item[0], item[1]
                if len(item) > 3 and item[3]:   # a later chunk of a prompt: continue the sequence held here
                    s = self.seqs.get(rid)
                    c = item[2]
                    if s is None or s.length != c:
                        raise RuntimeError(f"request {rid}: chunk at {c} but this rank holds "
                                           f"{None if s is None else s.length} tokens of it")
                    self.cache.grow(s.pages, len(ids))
                    pts.append(s.pages)
                    starts.append(c)
                    pins.append(None)
                    if self.linear:     # the recurrence continues from the state the earlier chunks left
                        slots.append(s.slot)
                    seqs.append(torch.tensor(ids[c:], dtype=torch.long, device=self.dev))
                    continue
                old = self.seqs.pop(rid, None)
                if old is not None and not old.busy:      # a stale copy (re-prefill after a failure)
                    self._let_go(old)
                elif old is not None:                     # still being shipped: the sender frees it
                    old.stale = True
                pin, c, pages = None, 0, []
                if self.prefix is not None:
                    pin, c, pages = self.prefix.acquire(ids, item[2] if len(item) > 2 else None)
                self.cache.grow(pages, len(ids))
                if self.linear:     # a fresh recurrent state (prefix caching is refused for these models)
                    try:
                        slots.append(self.cache.states.alloc())
                    except MemoryError:
                        self.cache.free(pages)
                        for p_, s_ in zip(pts, slots):
                            self.cache.free(p_)
                            self.cache.states.free(s_)
                        raise
                pts.append(pages)
                starts.append(c)
                pins.append(pin)
                seqs.append(torch.tensor(ids[c:], dtype=torch.long, device=self.dev))
        # linear layers: a sequence with a start is a later chunk (prefix caching is refused for these models), whose
        # recurrence resumes from its slot
        kw = {"slots": list(slots), "resume": True} if self.linear else {}
        if self.capture is not None:   # the inputs as they are now (the page lists grow later)
            self.capture.append(functools.partial(self.model.forward_prefill, seqs, self.cache,
                                                  [list(p) for p in pts], list(starts), **kw))
        if self.prefill_graphs is not None:
            sl = slots if self.linear else [None] * len(seqs)
            logits = torch.cat([self.prefill_graphs(q, c, pg, s_) for q, c, pg, s_ in zip(seqs, starts, pts, sl)])
        else:
            logits = self.model.forward_prefill(seqs, self.cache, pts, starts, **kw)
        first = logits.argmax(-1).tolist()
        out = {}
        with self.lock:
            for i, (item, pages, c, pin, tok) in enumerate(zip(items, pts, starts, pins, first)):
                rid, ids = item[0], item[1]
                if pin is not None:   # cached, then unpinned: as the scheduler's cache does at prefill end
                    self.prefix.insert(pin, ids, pages)
                    self.prefix.release(pin)
                self.seqs[rid] = _Seq(pages=pages, length=len(ids), last_token=tok,
                                      slot=slots[i] if self.linear else -1)
                out[rid] = (tok, pages + self.cache.ring_of(pages), c)
        return out

    def _let_go(self, s: _Seq) -> None:
        """Free a sequence's page references (the caller holds the lock): a page shared with the prefix cache
        stays until the cache evicts its block. A Gated DeltaNet model's state slot goes with the pages."""
        self.cache.free(s.pages)
        if s.slot >= 0:
            self.cache.states.free(s.slot)
            s.slot = -1

    def _op_kv_send(self, rid, dst_global, seq_len, lose=False):
        """Transfer lane: wait for the decoder's pages, ship. The KV stays here until the driver's ``drop``, sent
        once the scheduler has seen the whole transfer complete: a decoder that dies before that fails the
        transfer, and the scheduler's retry to another decoder ships this copy again. Whatever fails, the
        decoder's offer is received and answered (``transfer`` module docstring, "Framing"); a rank that holds no
        KV for ``rid`` declines (reply ``declined``). ``lose``: failure drill — free this rank's copy first, as if
        it had been lost (``run_real(lose_kv=...)``)."""
        with self.lock:
            if lose:
                self._drop(rid)
            s = self.seqs.get(rid)
            if s is not None:
                s.busy = True
        try:
            dst_pages = self.transfer.await_offer(dst_global, seq_len, self.dev)
            if dst_pages is None:     # refused: the decoder's cache is full (or it failed: it says which)
                raise KvNoRoom(f"decoder rank {dst_global} has no room for request {rid}")
            if s is None:
                self.transfer.decline(dst_global, self.dev)
                raise KvDeclined(f"request {rid}: no KV here to ship (already dropped?)")
            n = self.transfer.send(self._storages(), self.me, dst_global, seq_len,
                                   s.pages + self.cache.ring_of(s.pages), dst_pages)
            self._sync()                              # the gather has read the pages before the reply
            return n
        finally:
            if s is not None:
                with self.lock:
                    s.busy = False
                    if s.stale:                       # re-prefilled meanwhile: this copy is nobody's
                        self._let_go(s)

    # -- decode side -------------------------------------------------------------------------------------------
    def _op_kv_recv(self, rid, src_globals, seq_len, src_pages, last_token, tokens, free=()):
        """Transfer lane: reserve pages, offer them to the sources, receive the KV into them. The request is not
        in the running batch until a later decode step's ``joined`` names it. ``free``: requests the scheduler has
        finished on this rank whose ``left`` step has not run yet; their pages are freed first. A full cache is
        retried for up to ``KV_ROOM_WAIT_S``: a decode step already queued on the compute lane may be about to
        free a finished request's pages (the scheduler counted them free when the request finished); then the
        offer is refused and the reply is ``declined: no pages`` (:class:`transfer.KvNoRoom`): this rank is
        alive and well, the transfer is shipped again later."""
        pages, s, failure = None, None, None
        try:
            with self.lock:
                for old in free:
                    self._drop(old)
                if rid in self.seqs:
                    self._drop(rid)                   # a stale copy from before a failure
            deadline = time.monotonic() + KV_ROOM_WAIT_S
            while pages is None:
                with self.lock:
                    try:
                        pages = self.cache.alloc(seq_len + 1)
                        s = self.seqs[rid] = _Seq(pages=pages, length=0, last_token=-1)
                    except MemoryError:
                        pass
                if pages is None and time.monotonic() >= deadline:
                    failure = KvNoRoom(f"KV cache full: no room for request {rid} ({seq_len} tokens)")
                    break
                if pages is None:
                    time.sleep(0.002)
        except Exception as exc:  # noqa: BLE001 — the offer still goes out (refused): the sources wait for it
            failure = exc
        try:
            offered = None if failure is not None else pages + self.cache.ring_of(pages)
            self.transfer.offer(offered, seq_len, list(src_globals), self.dev)
            if failure is not None:
                raise failure
            n = self.transfer.recv(self._storages(), list(src_globals), seq_len, src_pages, offered)
        except BaseException:
            with self.lock:
                if s is not None and self.seqs.get(rid) is s:
                    self._drop(rid)
            raise
        with self.lock:
            s.length, s.last_token, s.tokens = seq_len, last_token, list(tokens)
        return n

    def _storages(self):
        """What a transfer reads / writes: the page buffer, and the ring buffer with sliding layers."""
        return (self.cache.storage, self.cache.ring_storage) if self.cache.window else self.cache.storage

    def _drop(self, rid):
        """Free a request's pages (the caller holds the lock)."""
        s = self.seqs.pop(rid, None)
        if s is not None and s.busy:          # the transfer lane is shipping it: the sender frees it
            s.stale = True
        elif s is not None:
            self._let_go(s)
        if rid in self.running:
            self.running.remove(rid)

    def _op_drop(self, rids):
        with self.lock:
            for rid in rids:
                self._drop(rid)
        return len(rids)

    @torch.inference_mode()
    def _op_decode(self, joined, left):
        """One decode step of the running batch -> ``{rid: token}``; with MTP (``spec.draft_k`` > 0) a speculative
        step (``engine.real.mtp``) -> ``{rid: [tokens]}``, ``1 + accepted`` tokens each."""
        with self.lock:
            for rid in left:
                self._drop(rid)
            for rid, rank in joined:
                if rank == self.me:
                    self.running.append(rid)
            batch = [rid for rid in self.running if rid in self.seqs]
            seqs = [self.seqs[rid] for rid in batch]
            if self.spec.draft_k > 0:
                rooms = draft_room(self.cache, seqs, self.spec.draft_k)
            for s in seqs:
                self.cache.grow(s.pages, s.length + 1)
            rows = [list(s.pages) for s in seqs]
        if self.spec.draft_k > 0:
            graphs = self.graphs if batch else None

            def verify(t, p, tab):      # the target's forward of the step's k + 1 rows per sequence
                if graphs is not None:
                    return graphs(t, p, tab, hidden=True)
                return self.model.forward_decode(t, p, self.cache, tab, hidden=True)

            return dict(zip(batch, mtp_step(self.model, self.cache, seqs, rooms, self.spec.draft_k, verify=verify)))
        if batch:
            width = max(len(p) for p in rows)
            table = torch.tensor([p + [p[0]] * (width - len(p)) for p in rows], device=self.dev)
            toks = torch.tensor([s.last_token for s in seqs], device=self.dev)
            pos = torch.tensor([s.length for s in seqs], device=self.dev)
        else:
            table = torch.zeros(0, 1, dtype=torch.long, device=self.dev)
            toks = torch.zeros(0, dtype=torch.long, device=self.dev)
            pos = torch.zeros(0, dtype=torch.long, device=self.dev)
        kw = {"slots": torch.tensor([s.slot for s in seqs], device=self.dev)} if self.linear and batch else {}
        if self.capture is not None:   # re-run eagerly (no CUDA graph) under the profiler
            self.capture.append(functools.partial(self.model.forward_decode, toks, pos, self.cache, table, **kw))
        if self.graphs is not None and batch:
            logits = self.graphs(toks, pos, table, **kw)
        elif kw:
            logits = self.model.forward_decode(toks, pos, self.cache, table, **kw)
        else:
            logits = self.model.forward_decode(toks, pos, self.cache, table)
        nxt = logits.argmax(-1).tolist() if batch else []
        out = {}
        for rid, s, tok in zip(batch, seqs, nxt):
            s.tokens.append(s.last_token)
            s.length += 1
            s.last_token = tok
            out[rid] = tok
        return out

    @torch.inference_mode()
    def _op_profile(self, keys):
        """After the run: re-run the recorded model calls of the sampled plans ``keys`` (``[kind, key]``, the
        same list in the same order on every rank of the group: collectives pair up) eagerly under the
        profiler (``engine.real.profiling``); one ``{"terms", "unscoped_s", "kernels_s", "wall_s"}`` per key.
        The KV they write lands in pages of finished requests (the run is over)."""
        from rackbed.engine.real.profiling import profile_calls

        plans = [self.captured[tuple(k)] for k in keys]
        self.captured.clear()
        return profile_calls(plans, self.dev)

    def _op_mixed(self, joined, left, items):
        """An aggregated worker's step: the running batch decodes, then the prompts of ``items`` are prefilled into
        the same cache (their KV and next token stay here for the decode steps they join later)."""
        return {"decode": self._op_decode(joined, left), "prefill": self._op_prefill(items) if items else {}}
