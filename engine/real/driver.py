"""The real (wall-clock) driver: the simulator's own loop, with GPUs instead of cost models.

``run_real`` runs the loop it is given — ``simulate``, the caller passes :func:`sim.driver.simulate`: the same
scheduler, the same per-worker processes, the same run loop merging arrivals with events
(:mod:`engine.loop.runloop`) and the same fault handling — and swaps two things (the clock is swapped, the model
code is not):

- the executor: :class:`RealExecutor` sends each plan to the rank processes that own its GPUs
  (``engine.real.worker``) and returns a SimPy event that fires when all of them have replied; its value is the
  **measured** duration (wall time from dispatch to the last reply, so IPC and host overheads are included);
- the environment: :class:`MeasuredClockEnv` (an :class:`engine.loop.simenv.SimEnv`) advances the clock by measured
  durations; a plan's completion event succeeds at its measured end (``SimEnv.trigger``). Before it processes an event
  at time ``t`` it makes sure no plan still running could finish earlier: a plan dispatched at clock time ``s``
  and wall time ``w`` finishes no earlier than ``s + (wall_now - w)``, so the loop waits for replies until that
  bound passes ``t``. Events are therefore processed in the order of their measured times, exactly as the
  simulator would process them given the same durations — which is what the cross-mode identity test checks
  (``replay``: the simulator with an executor that returns the recorded durations gives the same decision log).

Worker processes that die are detected (exit code) and turned into a fault of their GPU at the current time: the
scheduler re-queues their requests; the group's other ranks are stopped. A live rank that fails a plan with no dead
peer to explain it is declared dead the same way (:meth:`RealRun._fail_plan`), so no plan waits forever — unless
the failure is a decline: a KV source no longer holds the request's KV (the request is prefilled again),
or the decoder has no free pages for it (``declined: no pages``: the transfer is shipped again later); then
no rank is blamed (:meth:`RealRun._decline_plan`). A prefiller frees the KV of requests the scheduler gave up
on before its next prefill (:meth:`RealExecutor._given_up_on`). The
scheduler plans with the ranks' real KV caches (:func:`real_capacities`). docs/ARCHITECTURE.md ("Failure
behaviour") has the whole list.

KV transfers are asynchronous on both ends (``engine.real.worker``: a transfer thread, CUDA stream and process
group per rank, beside the compute loop): the driver sends ``kv_send`` to the prefiller's ranks and ``kv_recv`` to
the decoder rank in one go — the decoder reserves its pages and offers them to the sources itself — and the plan
completes when the last of them replies, while the decoder keeps stepping and the prefiller keeps prefilling. A
rank runs its transfers one at a time, in dispatch order (several KV streams of one prefiller share its lane).

The loop is passed in rather than imported because it is the simulator's: ``engine/real`` owns the ranks, the
measured clock and the executor and builds on the layers below it (``engine/core``, the event loop in
``engine/loop``, ``kernels``), not on ``sim``; the caller (``engine/cli/real.py``, ``engine/cli/torchrun.py``), which
may import both, hands over ``sim.driver.simulate`` and the scenario ``sim.scenario.build`` made. Any loop with
``simulate``'s signature and use of ``env`` / ``executor_factory`` would do.

Aggregated workers (``deployment: aggregated``) run as one rank each: a mixed step is one ``mixed`` command (the
batch decodes, then the step's prompts are prefilled into the same cache); no KV moves.

Prefix caching (``built.prefix_cache``): a prefill item's start is the prefix the scheduler found cached; the rank
maps those tokens' pages from its own cache (``engine.real.prefix``, keys from token content) and prefills the rest;
docs/PREFIX_CACHE.md ("In the real engine").

Speculative decoding (``mtp.draft_k`` = k > 0) runs for real with the model's own MTP module (``engine.real.mtp``):
a decode step (or a mixed step's decode part) is k draft forwards and one verify forward of k + 1 tokens per
sequence; each rank replies every request's ``1 + accepted`` tokens, the completion event carries the accepted
counts (``plans.Accepted``) so the scheduler counts the real tokens (``Result.accepted``), and each such step's
record carries them too, so :class:`ReplayExecutor` answers the replay's step with the same counts.

Limits (documented, not hidden): MTP runs for models with an MTP module the engine implements (DeepSeek-V3 /
Kimi-K2, GLM-4.5; others are refused, ``real_model_config``), with greedy acceptance only, eager draft forwards and
no draft for a sequence's first step on a decoder; autoscaling is simulated only; chunked prefill runs on
aggregated workers (a later chunk continues the sequence its rank holds; a re-prefill chunked past its prompt is
refused) and is simulated only for prefillers (``sim.chunked_prefill``); aggregated workers are one GPU each
(``tp = dp = ep = 1``).
"""

from __future__ import annotations

import queue
import signal
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import simpy

from rackbed.engine.core.plans import (
    KV_LOST,
    KV_NO_ROOM,
    Accepted,
    DecodeStep,
    Failed,
    KvTransfer,
    MixedStep,
    PrefillBatch,
)
from rackbed.engine.loop.simenv import SimEnv
from rackbed.engine.real.rank_setup import (  # noqa: F401  (re-exported: callers import them from the driver)
    _cache_kw,
    check_mtp_agree,
    deployment_groups,
    gdn_rank_budget,
    graph_pages,
    prefix_cache_pages,
    rank_specs,
    real_capacities,
    real_model_config,
    real_prefix_cache,
)
from rackbed.topology.errors import UserError


class RankDied(RuntimeError):
    pass


#: how a rank's ``declined`` reply starts when a decoder refused a KV transfer for lack of free pages
#: (``engine.real.transfer.KvNoRoom``); any other decline is a source that lost the KV
NO_PAGES = "declined: no pages"


@dataclass
class _Inflight:
    ev: simpy.Event
    start_v: float
    start_w: float
    waiting: set[int]
    worker: str
    kind: str
    key: int
    replies: dict[int, object] = field(default_factory=dict)
    declined: dict[int, str] = field(default_factory=dict)  # rank -> its ``declined`` reply
    worker_s: float = 0.0
    dst: int | None = None          # a KV plan's decoder rank (blamed first when the transfer fails)
    srcs: tuple[int, ...] = ()      # a KV plan's prefiller ranks (told to drop the KV once it has landed)


#: seconds without any rank reply (or death) while work is in flight after which a real run stops with
#: :class:`RealRunStalled` instead of waiting forever (a rank blocked on a dead peer; ``run_real(stall_s=...)``)
STALL_S = 300.0
#: seconds a plan that a rank failed waits for a peer's death to be noticed before the failing rank is blamed
DEATH_GRACE_S = 1.0


class RealRunStalled(TimeoutError):
    """The ranks stopped answering (:attr:`MeasuredClockEnv.stall_s`): the run ends with this one-line error."""


class RankPool:
    """The rank processes, their command queues and their reply queue(s).

    ``res_q``: one reply queue per rank (a list: :class:`RealRun`'s processes) or one shared queue (torchrun's store
    queue). Local ranks reply on queues of their own: the writers of one ``multiprocessing.Queue`` share a lock, and a
    rank killed while sending a reply (the failure drill, or a real crash) holds it forever, so every other rank's
    replies stop and the run stalls (``tests/test_real_driver.py``'s killed-decoder run, about one run in ten)."""

    def __init__(self, procs, cmd_qs, res_q, rank_gpu: dict[int, int]) -> None:
        self.procs, self.cmd_qs = procs, cmd_qs
        self.res_qs = list(res_q) if isinstance(res_q, (list, tuple)) else None
        self.res_q = None if self.res_qs is not None else res_q
        self.rank_gpu = rank_gpu
        self.inflight: dict[int, _Inflight] = {}
        self._tok = 0
        self.dead: set[int] = set()
        self.errors: list[str] = []
        self.graph_reports: dict[int, dict] = {}

    def token(self) -> int:
        self._tok += 1
        return self._tok

    def send(self, rank: int, op: str, token: int, **args) -> None:
        if rank in self.dead:
            raise RankDied(f"rank {rank} is dead")
        self.cmd_qs[rank].put((op, token, args))

    def poll(self, timeout_s: float) -> list[tuple]:
        """Replies received within ``timeout_s`` (waiting for the first one at most that long)."""
        if self.res_qs is not None:
            out = self._drain_rank_queues()
            if not out and timeout_s > 0:
                from multiprocessing.connection import wait

                readers = [q._reader for r, q in self._live_queues()]
                if readers:
                    wait(readers, timeout_s)
                else:
                    time.sleep(timeout_s)
                out = self._drain_rank_queues()
            return out
        out = []
        try:
            out.append(self.res_q.get(timeout=max(timeout_s, 0.0)) if timeout_s > 0 else self.res_q.get_nowait())
            while True:
                out.append(self.res_q.get_nowait())
        except queue.Empty:
            pass
        return out

    def _live_queues(self) -> list:
        """``(rank, reply queue)`` of the ranks still to be read: running, or exited on their own (their last replies,
        e.g. a start-up error, are complete) and not yet reported dead. A rank killed by a signal may have left half a
        message, which would block the reader: its queue is not read again."""
        return [(r, q) for r, q in enumerate(self.res_qs)
                if r not in self.dead and (self.procs[r].exitcode is None or self.procs[r].exitcode >= 0)]

    def _drain_rank_queues(self) -> list[tuple]:
        out = []
        for _, q in self._live_queues():
            try:
                while True:
                    out.append(q.get_nowait())
            except queue.Empty:
                pass
        return out

    def newly_dead(self) -> list[int]:
        died = [r for r, p in enumerate(self.procs) if r not in self.dead and p.exitcode is not None]
        self.dead.update(died)
        return died

    def stop(self) -> None:
        """Stop every live rank; each one's last reply (token 0) says what ran as CUDA graphs (``graph_reports``)."""
        live = [r for r in range(len(self.cmd_qs)) if r not in self.dead and self.procs[r].is_alive()]
        for r in live:
            self.cmd_qs[r].put(("stop", 0, {}))
        deadline = time.monotonic() + 20
        want = set(live)
        while want and time.monotonic() < deadline:
            for tok, rank, status, payload in self.poll(0.2):
                if tok == 0 and status == "ok":
                    want.discard(rank)
                    if isinstance(payload, dict):
                        self.graph_reports[rank] = payload
            want = {r for r in want if self.procs[r].is_alive()}
        for p in self.procs:
            p.join(timeout=20)
            if p.is_alive():
                p.kill()


class MeasuredClockEnv(SimEnv):
    """SimPy environment whose clock advances by measured durations (module docstring)."""

    def __init__(self, pool: RankPool, on_reply, stall_s: float = STALL_S) -> None:
        super().__init__()
        self.pool = pool
        self.on_reply = on_reply          # (token, rank, status, payload, wall) -> None
        self.on_fault = None              # set by the loop (sim.driver.simulate): inject_fault(target)
        self.on_death = None              # (rank) -> None, set by the executor
        self.stall_s = stall_s
        self._progress_w = time.perf_counter()  # wall time of the last reply or death

    def _drain(self, timeout_s: float) -> None:
        for token, rank, status, payload in self.pool.poll(timeout_s):
            self._progress_w = time.perf_counter()
            self.on_reply(token, rank, status, payload, time.perf_counter())
        for r in self.pool.newly_dead():
            self._progress_w = time.perf_counter()
            if self.on_death is not None:
                self.on_death(r)
        if self.pool.inflight and time.perf_counter() - self._progress_w > self.stall_s:
            raise RealRunStalled(self._stall_message())

    def _stall_message(self) -> str:
        ops = sorted(self.pool.inflight.values(), key=lambda f: f.start_w)
        desc = "; ".join(f"{f.kind} {f.key} of {f.worker} (waiting for ranks {sorted(f.waiting)})" for f in ops[:4])
        more = f" and {len(ops) - 4} more" if len(ops) > 4 else ""
        return (f"real run stalled: no rank replied for {self.stall_s:g} s with {len(ops)} operations in flight: "
                f"{desc}{more} (a rank blocked on a dead peer? raise stall_s for very long steps)")

    def peek(self) -> float:
        self._drain(0.0)
        while True:
            t = super().peek()
            if not self.pool.inflight:
                return t
            now_w = time.perf_counter()
            lb = min(f.start_v + (now_w - f.start_w) for f in self.pool.inflight.values())
            if t <= lb:
                return t
            self._drain(min(t - lb, 0.05) if t != float("inf") else 0.05)


class RealExecutor:
    """``duration(plan, now)`` -> a SimPy event fired with the measured duration when the ranks are done."""

    def __init__(self, run: RealRun, sched_group) -> None:
        self.run = run
        self.env = run.env
        self.pool = run.pool
        self.group_of = sched_group
        self.breakdown_s = {"prefill": {}, "decode": {}}
        # prefix-cache copies up from lower tiers (sim.executor.Executor's): none in real mode, HBM only
        self.load_s = None
        self.load_total_s = 0.0
        self._faults_at: dict[float, list[tuple[str, int]]] = {}
        self.env.on_death = self._on_death

    # the sim.executor.Executor interface the driver also reads
    def breakdown(self) -> dict:
        return self.breakdown_s

    def _dispatch(self, plan, kind: str, key: int, sends: list[tuple[int, str, dict]], now_v: float,
                  start_w: float | None = None, dst: int | None = None, srcs: tuple[int, ...] = ()) -> simpy.Event:
        ev = self.env.event()
        tok = self.pool.token()
        ranks = {r for r, _, _ in sends}
        if ranks & self.pool.dead:   # dispatched to a lost group before its fault lands: never completes
            self.run.records.append((plan.worker, kind, key, float("inf"), 0.0))
            return ev
        fl = _Inflight(ev=ev, start_v=now_v, start_w=start_w if start_w is not None else time.perf_counter(),
                       waiting=set(ranks), worker=plan.worker, kind=kind, key=key, dst=dst, srcs=srcs)
        self.pool.inflight[tok] = fl
        try:
            for r, op, args in sends:
                self.pool.send(r, op, tok, **args)
        except RankDied:
            pass  # the death handler fails this plan's worker
        return ev

    def _sample(self, plan, kind: str, key: int, args: dict, **size) -> dict:
        """``args``, marked for profiling (its ranks record the plan's model calls) when the run profiles
        plans and the sampler takes this one (``engine.real.profiling.PlanSampler``)."""
        if self.run.sampler is not None and self.run.sampler.take(plan.worker, kind, key, **size):
            args["profile_key"] = [kind, key]
        return args

    def _prefill_items(self, items) -> list[tuple]:
        """The rank commands' items for ``(rid, start, n)`` prefill items: ``(rid, token ids)`` for a whole prompt;
        with a prefix cache ``(rid, token ids, start)``, ``start > 0`` being the prefix the scheduler found cached on
        the worker, which the rank reuses from its own cache instead of computing it; ``(rid, token ids, start,
        True)`` for a later chunk of a prompt whose first ``start`` tokens an earlier chunk prefilled on the same
        rank (chunked prefill). A chunk that ends before its prompt does yields no token: its reply is not absorbed
        (``chunk_open``)."""
        run = self.run
        out = []
        for rid, start, n in items:
            cont = start > 0 and run.chunk_end.get(rid) == start
            if cont and start > run.prompt_len[rid]:
                # the previous chunk ended past the prompt (a re-prefill of generated tokens after a failure) and was
                # taken as the last one: its token and the truncation of the generated tokens would be wrong
                raise UserError(f"real mode: request {rid}: a re-prefill chunked past its prompt's end is simulated "
                                "only (set aggregated.chunk_tokens: null for fault drills)")
            run.chunk_end[rid] = start + n
            if start + n < run.prompt_len[rid]:
                run.chunk_open[rid] = start + n
            else:
                run.chunk_open.pop(rid, None)
            if cont:
                out.append((rid, run.token_ids(rid, start + n), start, True))
            elif run.prefix_blocks:
                out.append((rid, run.token_ids(rid, start + n), start))
                run.prefix_planned.setdefault(rid, []).append(start)
            elif start != 0:
                raise UserError(f"real mode: request {rid}'s prefill starts at token {start} with no earlier chunk "
                                "or prefix cache on its rank")
            else:
                out.append((rid, run.token_ids(rid, n)))
            run.prefill_n[rid] = start + n
        return out

    def duration(self, plan, now_s: float):
        tp = type(plan)
        run = self.run
        if tp is PrefillBatch:
            g = self.group_of(plan.worker)
            items = self._prefill_items(plan.items)
            ranks = [run.gpu_rank[gpu] for gpu in g.gpus]
            gone = self._given_up_on(plan.worker)
            for r in ranks:      # a compute command: the rank runs it before the prefill
                if gone and r not in self.pool.dead:
                    self.pool.send(r, "drop", self.pool.token(), rids=gone)
            args = self._sample(plan, "prefill", plan.batch, {"items": items}, tokens=plan.n_tokens,
                                n_seqs=len(plan.items))
            return self._dispatch(plan, "prefill", plan.batch, [(r, "prefill", args) for r in ranks], now_s)
        if tp is MixedStep:
            g = self.group_of(plan.worker)
            args = {"joined": list(plan.joined), "left": list(plan.left),
                    "items": self._prefill_items([(rid, start, n) for rid, _, start, n in plan.prefill])}
            self._sample(plan, "mixed", plan.step, args, batch=sum(plan.rank_batch),
                         tokens=sum(n for _, _, _, n in plan.prefill), n_seqs=len(plan.prefill))
            return self._dispatch(plan, "mixed", plan.step, [(run.gpu_rank[gpu], "mixed", args) for gpu in g.gpus],
                                  now_s)
        if tp is KvTransfer:
            start_w = time.perf_counter()
            src = self.group_of(plan.src)
            dst = self.group_of(plan.dst)
            src_ranks = [run.gpu_rank[gpu] for gpu in src.gpus]
            dst_rank = run.gpu_rank[dst.gpus[plan.dst_rank]]
            rid = plan.request_id
            if ({dst_rank, *src_ranks} & self.pool.dead):
                return self._dispatch(plan, "kv", rid, [(dst_rank, "kv_recv", {})], now_s, start_w)
            src_pages = run.src_pages.get(rid)
            gen = run.generated.get(rid, [])
            n_prompt = run.prompt_len[rid]
            last = gen[plan.tokens - n_prompt] if gen and plan.tokens - n_prompt < len(gen) else gen[-1]
            sends = [(r, "kv_send", {"rid": rid, "dst_global": dst_rank, "seq_len": plan.tokens})
                     for r in src_ranks]
            if rid in run.lose_kv:       # failure drill: the prefiller's last rank loses its copy first
                run.lose_kv.discard(rid)
                sends[-1][2]["lose"] = True
            sends.append((dst_rank, "kv_recv", {"rid": rid, "src_globals": src_ranks, "seq_len": plan.tokens,
                                                "src_pages": src_pages, "last_token": last,
                                                "tokens": gen[:plan.tokens - n_prompt],
                                                "free": self._finished_on(plan.dst, dst_rank)}))
            run.kv_rank[rid] = dst_rank
            return self._dispatch(plan, "kv", rid, sends, now_s, start_w, dst=dst_rank, srcs=tuple(src_ranks))
        if tp is DecodeStep:
            g = self.group_of(plan.worker)
            ranks = [run.gpu_rank[gpu] for gpu in g.gpus]
            args = {"joined": list(plan.joined), "left": list(plan.left)}
            self._sample(plan, "decode", plan.step, args, batch=sum(plan.rank_batch),
                         rank_batch=max(plan.rank_batch, default=0),
                         context_tokens=max(plan.rank_context_tokens, default=0))
            ev = self._dispatch(plan, "decode", plan.step, [(r, "decode", args) for r in ranks], now_s)
            for n, gpu in run.kill_after_steps:          # failure drill: kill mid-step, deterministically
                if gpu in g.gpus and plan.step + 1 == n and sum(plan.rank_batch) > 0:
                    p = run.pool.procs[run.gpu_rank[gpu]]
                    if p.is_alive():
                        p.kill()
            return ev
        raise TypeError(f"real executor cannot run {tp.__name__}")

    def _given_up_on(self, prefiller: str) -> list[int]:
        """Requests whose KV ``prefiller``'s ranks still hold although the scheduler is done with them: it
        rejected them while they waited for a decoder (e.g. when the last decoder died) and counts their KV
        free already, so the ranks drop it before the next prefill — else that prefill would
        find the cache full and its healthy prefiller would be declared dead. The scheduler is the bound
        ``group_of``'s owner (as in :meth:`_finished_on`); another ``group_of`` gives none."""
        held = self.run.pf_held.get(prefiller)
        sched = getattr(self.group_of, "__self__", None)
        reqs = getattr(sched, "reqs", None)
        if not held or reqs is None:
            return []
        gone = sorted(rid for rid in held if rid not in reqs)
        held.difference_update(gone)
        return gone

    def _finished_on(self, worker: str, rank: int) -> list[int]:
        """Requests the scheduler has finished on decoder ``worker`` whose pages ``rank`` still holds: a rank
        frees a finished request's pages with the decoder's next step (its ``left``), which an idle decoder does
        not run until a new request joins — so the ``kv_recv`` that brings that request frees them first. The
        scheduler is the bound ``group_of``'s owner; another ``group_of`` gives none (the rank then frees them
        with the next step only)."""
        sched = getattr(self.group_of, "__self__", None)
        d = getattr(sched, "workers", {}).get(worker)
        if d is None:
            return []
        left = list(getattr(d, "left", ()))
        delta = getattr(d, "delta", None)
        if delta:
            left += list(delta[1])
        return sorted({rid for rid in left if self.run.kv_rank.get(rid) == rank})

    def _on_death(self, rank: int) -> None:
        """A rank process exited. Its group is lost; the scheduler hears of it as a fault of that GPU one ULP after
        the current time — after every event already due now — which is also where a replay puts the fault, so the
        two runs order it identically."""
        import math

        run = self.run
        gpu = run.rank_gpu[rank]
        at = math.nextafter(self.env.now, math.inf)
        run.deaths.append((at, rank, gpu))
        run.deaths.sort(key=lambda d: (d[0], d[2]))
        # every rank of the dead rank's group is lost with it (its collectives cannot complete)
        group_ranks = next(rs for rs in run.group_ranks.values() if rank in rs)
        for r in group_ranks:
            if r != rank and run.pool.procs[r].is_alive():
                run.pool.procs[r].kill()
        run.pool.dead.update(group_ranks)
        for tok in [t for t, f in self.pool.inflight.items() if f.waiting & set(group_ranks)]:
            f = self.pool.inflight.pop(tok)
            # never completes: a replay gives it an infinite duration, so the same fault interrupts it there too
            run.records.append((f.worker, f.kind, f.key, float("inf"), 0.0))
        if self.env.on_fault is not None:
            # deaths at the same instant reach the scheduler in the order a replay's fault list has them
            # (sorted by time, then target: sim.faults.parse_faults), whatever order they were detected in
            pend = self._faults_at.get(at)
            if pend is None:
                pend = self._faults_at[at] = []
                ev = self.env.event()
                ev.callbacks.append(lambda _e, at=at: self._deliver_faults(at))
                self.env.trigger(ev, None, at - self.env.now)
            pend.append((f"gpu:{gpu}", rank))

    def _deliver_faults(self, at: float) -> None:
        for target, rank in sorted(self._faults_at.pop(at)):
            self.run.faulted.add(rank)
            self.env.on_fault(target)


class RealRun:
    """Spawns the ranks for a built scenario (or takes a pool of ranks started by torchrun) and runs it through the
    simulator's loop (module docstring)."""

    def __init__(self, built, *, device: str, dtype: str, n_layers: int | None, seed: int, weights: str | None,
                 prefill_pages: int, decode_pages: int, tiny_cfg=None, pool: RankPool | None = None,
                 requests=None, prefix_cache=None, follows=None, profile_plans: int = 0,
                 mtp_agree: float | None = None) -> None:
        import torch
        import torch.multiprocessing as mp

        from rackbed.engine.real.worker import rank_main

        self.built = built
        dep = built.deployment
        cfg = real_model_config(built, n_layers, tiny_cfg, weights)
        check_mtp_agree(cfg, mtp_agree, weights)
        self.cfg = cfg
        self.draft_k = dep.mtp.draft_k if cfg.runs_mtp else 0     # drafts per decode step, run (engine.real.mtp)
        groups = deployment_groups(dep)
        gpus = [gpu for _, gs, _ in groups for gpu in gs]
        self.tmp = tempfile.TemporaryDirectory()
        if pool is None:
            self.gpu_rank = {gpu: r for r, gpu in enumerate(gpus)}
            world = len(gpus)
            use_cuda = device == "cuda" or (device == "auto" and torch.cuda.is_available())
            if use_cuda and torch.cuda.device_count() < world:
                raise UserError(f"real mode: the deployment needs {world} GPUs, {torch.cuda.device_count()} visible")
            n_cuda = max(torch.cuda.device_count(), 1)
            specs = rank_specs(built, cfg, self.gpu_rank, world, use_cuda=use_cuda, dtype=dtype, seed=seed,
                               weights=weights, prefill_pages=prefill_pages, decode_pages=decode_pages,
                               init_file=str(Path(self.tmp.name) / "rdzv"), backend="nccl" if use_cuda else "gloo",
                               local_device=lambda gpu: f"cuda:{gpu % n_cuda}" if use_cuda else "cpu",
                               requests=requests, prefix_cache=prefix_cache, mtp_agree=mtp_agree)
            ctx = mp.get_context("spawn")
            res_qs = [ctx.Queue() for _ in range(world)]  # one per rank (RankPool)
            cmd_qs = [ctx.Queue() for _ in range(world)]
            procs = []
            for r in range(world):
                p = ctx.Process(target=rank_main, args=(specs[r], cmd_qs[r], res_qs[r]), daemon=True)
                p.start()
                procs.append(p)
            pool = RankPool(procs, cmd_qs, res_qs, {r: g for g, r in self.gpu_rank.items()})
        else:  # torchrun: global rank = topology GPU id, the ranks are already running
            self.gpu_rank = {gpu: gpu for gpu in gpus}
        self.rank_gpu = {r: gpu for gpu, r in self.gpu_rank.items()}
        self.group_ranks = {gid: tuple(self.gpu_rank[x] for x in gs) for gid, gs, _ in groups}
        self.pool = pool
        self.env = MeasuredClockEnv(self.pool, self._on_reply)
        self.seed = seed
        self.prompt_ids: dict[int, list[int]] = {}
        self.prompt_len: dict[int, int] = {}
        self.output_len: dict[int, int] = {}
        self.follows: dict[int, int] = dict(follows or {})   # a conversation's later turn -> the turn before it
        self.prefix_blocks, self.prefix_block_tokens = real_prefix_cache(
            prefix_cache if prefix_cache is not None else getattr(built, "prefix_cache", None))
        self.prefix_hits: dict[int, list[int]] = {}           # request -> prompt tokens reused, per prefill
        self.prefix_planned: dict[int, list[int]] = {}        # request -> the scheduler's cached tokens, per prefill
        self.generated: dict[int, list[int]] = {}
        self.src_pages: dict[int, list[int]] = {}
        self.prefill_n: dict[int, int] = {}
        self.chunk_open: dict[int, int] = {}      # request -> tokens its chunks so far prefilled (not all)
        self.chunk_end: dict[int, int] = {}       # request -> where its last prefill chunk ended
        # (worker, kind, key, measured_s, worker_s), and for a speculative decode step ``{rid: accepted drafts}``
        self.records: list[tuple] = []
        self.kill_after_steps: list[tuple[int, int]] = []
        self.lose_kv: set[int] = set()      # failure drill: requests whose first KV transfer finds the KV gone
        self.kv_declined: list[int] = []    # requests whose KV transfer a source declined (prefilled again)
        self.kv_refused: list[int] = []     # requests whose KV transfer found no free pages (shipped again)
        self.deaths: list[tuple] = []       # (t, rank, gpu), sorted by (t, gpu)
        self.faulted: set[int] = set()      # ranks whose death the scheduler has been told of (on the clock)
        self.kv_rank: dict[int, int] = {}   # request -> the decoder rank its last KV went to
        self.kv_bytes: dict[int, list[int]] = {}  # request -> bytes each of its landed KV transfers moved
        self.pf_held: dict[str, set[int]] = {}    # prefiller -> requests whose KV its ranks still hold
        from rackbed.engine.real.profiling import PlanSampler

        self.sampler = PlanSampler(profile_plans) if profile_plans > 0 else None
        self.term_profile: list[dict] = []      # the sampled plans' per-term times (profile_plans_of)
        self.term_profile_error: str | None = None
        self._wait_ready(len(gpus))
        self.env._progress_w = time.perf_counter()  # the stall clock starts once every rank is ready

    def _wait_ready(self, world: int, timeout_s: float = 600.0) -> None:
        ready, t0 = set(), time.perf_counter()
        while len(ready) < world:
            for token, rank, status, payload in self.pool.poll(1.0):
                if status == "ready":
                    ready.add(rank)
                elif status == "error":
                    self.pool.stop()
                    raise RuntimeError(f"rank {rank} failed to start: {payload}")
            if self.pool.newly_dead() or time.perf_counter() - t0 > timeout_s:
                self.pool.stop()
                raise RuntimeError("a rank died or timed out while starting")

    # -- token bookkeeping ---------------------------------------------------------------------------------------
    def register(self, requests) -> None:
        """Each request's prompt token ids, drawn from ``(seed, request id)``, or block by block from its trace block
        ids when it has them (:meth:`_ids_of_blocks`); a later turn of a conversation (``follows``) gets its ids when
        its prefill starts (:meth:`token_ids`)."""
        import numpy as np

        for r in requests:
            self.prompt_len[r.id] = r.prompt_tokens
            self.output_len[r.id] = r.output_tokens
            if r.id in self.follows:
                continue
            if r.prefix_hash_ids:
                self.prompt_ids[r.id] = self._ids_of_blocks(r)
                continue
            rng = np.random.default_rng([self.seed, r.id])
            self.prompt_ids[r.id] = rng.integers(0, self.cfg.vocab, size=r.prompt_tokens).tolist()

    def _ids_of_blocks(self, r) -> list[int]:
        """A trace request's prompt from its block ids (Mooncake: one id per 512 tokens): block ``j`` is drawn from
        ``(seed, id)``, so requests whose ids agree share their tokens there and the ranks' content-keyed prefix
        caches find what the trace says is shared (a partial last block is the head of its id's 512 tokens)."""
        import numpy as np

        unit, out = 512, []
        for j, h in enumerate(r.prefix_hash_ids):
            n = min(unit, r.prompt_tokens - j * unit)
            if n <= 0:
                break
            out += np.random.default_rng([self.seed, 1 << 32, h]).integers(0, self.cfg.vocab, size=unit)[:n].tolist()
        if len(out) < r.prompt_tokens:      # ids short of the prompt (not in a valid trace): the rest per request
            rng = np.random.default_rng([self.seed, r.id])
            out += rng.integers(0, self.cfg.vocab, size=r.prompt_tokens - len(out)).tolist()
        return out

    def _next_turn_ids(self, rid: int) -> list[int]:
        """A conversation's next turn: the previous turn's prompt and generated output, then new tokens (drawn
        from ``(seed, request id)``) up to its prompt length. The previous turn must be done by then."""
        import numpy as np

        prev = self.follows[rid]
        head = self.token_ids(prev, self.prompt_len[prev]) + self.generated.get(prev, [])
        if len(self.generated.get(prev, [])) < self.output_len[prev]:
            raise UserError(f"request {rid} continues request {prev}, which has not finished when {rid}'s prefill "
                            "starts (a later turn must arrive after the previous one is done)")
        new = self.prompt_len[rid] - len(head)
        if new < 0:
            raise UserError(f"request {rid}: prompt_tokens {self.prompt_len[rid]} is shorter than the turn it "
                            f"continues (request {prev}: {len(head)} tokens with its output)")
        rng = np.random.default_rng([self.seed, rid])
        return head + rng.integers(0, self.cfg.vocab, size=new).tolist()

    def token_ids(self, rid: int, n: int) -> list[int]:
        if rid not in self.prompt_ids:
            self.prompt_ids[rid] = self._next_turn_ids(rid)
        ids = self.prompt_ids[rid] + self.generated.get(rid, [])
        return ids[:n]

    def prefix_hit_tokens(self) -> int:
        """Prompt tokens the ranks reused from their prefix caches (first prefills and re-prefills)."""
        return sum(sum(v) for v in self.prefix_hits.values())

    def prefix_shortfall_tokens(self) -> int:
        """Prompt tokens the scheduler counted as cached that a rank's cache did not hold (it recomputed them:
        same KV, more work); 0 when the ranks' caches track the scheduler's, as they do without failures."""
        return sum(p - h for rid, ps in self.prefix_planned.items() for p, h in zip(ps, self.prefix_hits.get(rid, ())))

    def _on_reply(self, token, rank, status, payload, wall) -> None:
        fl = self.pool.inflight.get(token)
        if fl is None:     # a late reply of a plan already failed by a death (e.g. a send to the dead rank)
            if status == "error":
                self.pool.errors.append(f"rank {rank}: {payload}")
            return
        if status == "declined":        # a source lost the KV, or the decoder has no pages: no rank's fault
            fl.declined[rank] = str(payload)
            fl.replies[rank] = None
        elif status != "ok":
            self.pool.errors.append(f"rank {rank} {fl.kind}: {payload}")
            fl.replies[rank] = None
        else:
            fl.replies[rank] = payload[0]
            fl.worker_s = max(fl.worker_s, payload[1])
        fl.waiting.discard(rank)
        if fl.waiting:
            return
        del self.pool.inflight[token]
        measured = wall - fl.start_w
        if any(v is None for v in fl.replies.values()):
            if fl.declined and all(v is not None or r in fl.declined for r, v in fl.replies.items()):
                no_room = any(p.startswith(NO_PAGES) for p in fl.declined.values())
                self._decline_plan(fl, measured, KV_NO_ROOM if no_room else KV_LOST)
            else:
                self._fail_plan(fl)
            return
        accepted = self._absorb(fl)
        if accepted is None:
            self.records.append((fl.worker, fl.kind, fl.key, measured, fl.worker_s))
            value = measured
        else:   # a speculative step: the scheduler counts the real tokens, and the replay is fed the same counts
            self.records.append((fl.worker, fl.kind, fl.key, measured, fl.worker_s, accepted))
            value = Accepted(measured, accepted)
        self.env.trigger(fl.ev, value, max(fl.start_v + measured - self.env.now, 0.0))

    def _decline_plan(self, fl: _Inflight, measured: float, reason: str) -> None:
        """A KV transfer failed only because of declines (every failing rank replied ``declined``; the decoder
        holds no pages for it). No rank is at fault and none is declared dead: the plan fails at its measured
        clock time with ``reason``, and the record's kind says so (``kv:kv_lost``), so a replay fails it the
        same way.

        - :data:`KV_LOST`: a source no longer held the request's KV. The scheduler prefills the request
          again; the prefiller ranks that still hold their shards drop them now — the scheduler will not ship
          this copy again (a decoder death that reaches it first re-sends the request, which then declines
          again).
        - :data:`KV_NO_ROOM`: the decoder had no free pages (``declined: no pages``). The prefiller keeps its
          copy and the scheduler ships it again later, to this decoder or another."""
        self.records.append((fl.worker, f"{fl.kind}:{reason}", fl.key, measured, fl.worker_s))
        if reason == KV_NO_ROOM:
            self.kv_refused.append(fl.key)
        else:
            self.kv_declined.append(fl.key)
            self._drop_shipped(fl)
        self.env.trigger(fl.ev, Failed(measured, reason), max(fl.start_v + measured - self.env.now, 0.0))

    def _fail_plan(self, fl: _Inflight) -> None:
        """Every rank of ``fl`` replied and one at least with an error. If a peer died (seen within
        :data:`DEATH_GRACE_S`: a transfer from a dead peer fails before its exit is noticed), that death's fault
        interrupts the plan. Otherwise the rank that failed is declared dead — a KV plan's decoder first (a transfer
        whose only failures are declines goes to :meth:`_decline_plan` instead, which blames nobody), else the
        lowest failing rank: its process is stopped and its GPU fails like a dead one's, so the scheduler requeues
        the plan's requests and a replay meets the same fault at the same time. The plan never completes (an
        infinite duration on record: the fault interrupts it in the replay too)."""
        self.records.append((fl.worker, fl.kind, fl.key, float("inf"), 0.0))
        ranks = set(fl.replies)
        deadline = time.perf_counter() + DEATH_GRACE_S
        while True:
            for r in self.pool.newly_dead():
                self.env.on_death(r)
            if ranks & self.pool.dead:
                return
            if time.perf_counter() >= deadline:
                break
            time.sleep(0.05)
        failed = sorted(r for r, v in fl.replies.items() if v is None)
        blame = fl.dst if fl.dst in failed else failed[0]
        p = self.pool.procs[blame]
        if p.is_alive():
            p.kill()
            p.join(timeout=10)
        self.pool.dead.add(blame)
        self.env.on_death(blame)

    def _absorb(self, fl: _Inflight) -> dict[int, int] | None:
        """Take a completed plan's replies in; a decode (or mixed) step with MTP returns ``{rid: accepted
        drafts}`` (else None)."""
        if fl.kind == "kv":   # landed: the prefiller's copy goes once the scheduler sees it land
            if fl.dst in fl.replies:
                self.kv_bytes.setdefault(fl.key, []).append(int(fl.replies[fl.dst]))
            fl.ev.callbacks.insert(0, lambda _e, fl=fl: self._release_shipped(fl))
        elif fl.kind == "prefill":
            reply = next(v for v in fl.replies.values() if v is not None)
            self._absorb_prefill(reply)
            self.pf_held.setdefault(fl.worker, set()).update(reply)
        elif fl.kind == "decode":
            return self._absorb_decode(fl.replies.values())
        elif fl.kind == "mixed":  # one rank: its decode tokens, then its prompts' first tokens
            (v,) = fl.replies.values()
            accepted = self._absorb_decode([v["decode"]])
            self._absorb_prefill(v["prefill"])
            return accepted
        return None

    def _release_shipped(self, fl: _Inflight) -> None:
        """A KV transfer's completion reaches the scheduler (its event is processed at its measured clock time):
        the prefiller ranks drop their copy of the request's KV (a reply to this drop has no plan: ignored) —
        unless the decoder's group died before that on the clock. Then the fault has interrupted the transfer and
        the scheduler ships the request again from the prefiller, which must still hold it: dropping it when the
        reply arrives (wall time, earlier) would leave the retry nothing to ship."""
        if fl.dst is not None and set(next(rs for rs in self.group_ranks.values() if fl.dst in rs)) & self.faulted:
            return
        self._drop_shipped(fl)

    def _drop_shipped(self, fl: _Inflight) -> None:
        """The KV plan ``fl``'s prefiller ranks drop their copy of its request's KV."""
        gid = next((g for g, rs in self.group_ranks.items() if fl.srcs and fl.srcs[0] in rs), None)
        if gid in self.pf_held:
            self.pf_held[gid].discard(fl.key)
        for r in fl.srcs:
            if r not in self.pool.dead:
                self.pool.send(r, "drop", self.pool.token(), rids=[fl.key])

    def _absorb_prefill(self, reply: dict) -> None:
        for rid, (tok, pages, reused) in reply.items():
            if rid in self.chunk_open:      # a chunk that does not end its prompt: no token yet
                continue
            self.src_pages[rid] = pages
            self.prefix_hits.setdefault(rid, []).append(reused)
            gen = self.generated.setdefault(rid, [])
            # a re-prefill covers the prompt and the first g generated tokens; its output is token g+1
            del gen[self.prefill_n[rid] - self.prompt_len[rid]:]
            gen.append(tok)

    def _absorb_decode(self, replies) -> dict[int, int] | None:
        """A decode step's tokens: one per request (``{rid: token}``), or with MTP ``1 + accepted`` of them
        (``{rid: [tokens]}``; returns ``{rid: accepted}``). A request keeps no more than its output's tokens (a
        speculative step can run past its end)."""
        accepted = None
        for v in replies:
            if v:
                for rid, tok in v.items():
                    gen = self.generated.setdefault(rid, [])
                    if type(tok) is list:
                        accepted = {} if accepted is None else accepted
                        accepted[rid] = len(tok) - 1
                        gen += tok
                        del gen[self.output_len.get(rid, len(gen)):]
                    else:
                        gen.append(tok)
        if accepted is None and self.draft_k > 0:
            accepted = {}           # a speculative step with no request in it
        return accepted


def run_real(built, requests, *, simulate, device="auto", dtype="bf16", n_layers=None, weights=None, seed=0,
             prefill_pages=4096, decode_pages=4096, kill=(), kill_after_steps=(), lose_kv=(), progress=False,
             tiny_cfg=None, pool=None, stall_s: float = STALL_S, prefix_cache=None, follows=None,
             profile_plans: int = 0, mtp_agree: float | None = None):
    """Run ``built`` (``sim.scenario.build``) for real on ``requests`` through ``simulate`` (``sim.driver.simulate``,
    module docstring). Failure drills: ``kill`` ``[(at_s, gpu)]`` kills that GPU's rank process at clock time
    ``at_s``; ``kill_after_steps`` ``[(n, gpu)]`` kills it while its decoder's n-th step (with a non-empty batch) is
    in flight; ``lose_kv`` ``[request id]``: that request's first KV transfer finds its copy gone on the
    prefiller's last rank (the rank frees it just before), so the source declines. ``stall_s``: no rank reply for
    that long with work in flight raises :class:`RealRunStalled` (the ranks are stopped). ``prefix_cache`` (an ``engine.core.prefix_cache.PrefixCacheSpec``; None: the scenario's,
    ``built.prefix_cache``): the scheduler's cache per prefiller / aggregated worker, and each of its ranks keeps the
    KV of those blocks (``engine.real.prefix``: ``hbm_blocks`` blocks, their pages out of ``prefill_pages``, or
    ``decode_pages`` on an aggregated rank) and reuses the prefix each prefill item starts at. ``follows`` ``{request id: previous turn's id}``: a later turn's prompt is the previous turn's
    prompt and output followed by new tokens (a conversation). ``profile_plans`` N > 0: after the run, each
    rank re-runs up to N sampled plans of each kind of its worker under the profiler
    (:func:`profile_plans_of`, ``run.term_profile``; a failure there is kept in ``run.term_profile_error``,
    the run's results stand). ``mtp_agree`` p (``real.mtp_agree``): random weights whose MTP drafts the target
    accepts with probability p each (``engine.real.agreeing``).
    Returns ``(result of simulate, RealRun)``."""
    from rackbed.engine.core.metrics import Slo

    spec = prefix_cache if prefix_cache is not None else getattr(built, "prefix_cache", None)
    prefix_blocks, prefix_block_tokens = real_prefix_cache(spec)
    cache_pages = prefix_cache_pages(built, prefix_blocks=prefix_blocks, prefix_block_tokens=prefix_block_tokens,
                                     prefill_pages=prefill_pages, decode_pages=decode_pages)
    run = RealRun(built, device=device, dtype=dtype, n_layers=n_layers, seed=seed, weights=weights,
                  prefill_pages=prefill_pages, decode_pages=decode_pages, tiny_cfg=tiny_cfg, pool=pool,
                  requests=requests, prefix_cache=spec, follows=follows, profile_plans=profile_plans,
                  mtp_agree=mtp_agree)
    run.register(requests)
    # the scheduler plans with the ranks' real caches (less the prefix cache's pages and a Gated DeltaNet model's
    # state slots); a replay of the same ``built`` then does too
    _, slot_pages = gdn_rank_budget(built, run.cfg, dtype, decode_pages)
    built.deployment = real_capacities(built.deployment, prefill_pages=prefill_pages - cache_pages,
                                       decode_pages=decode_pages - cache_pages - slot_pages
                                       if built.deployment.aggregated else decode_pages,
                                       page_tokens=built.decode_plan.page_tokens,
                                       min_prompt=min((r.prompt_tokens for r in requests), default=1))
    run.kill_after_steps = list(kill_after_steps)
    run.lose_kv = set(lose_kv)
    env = run.env
    env.stall_s = stall_s

    def killer(at_s: float, gpu: int):
        yield env.timeout(at_s)
        p = run.pool.procs[run.gpu_rank[gpu]]
        if p.is_alive():
            p.kill()
            p.join(timeout=10)

    for at_s, gpu in kill:
        env.process(killer(at_s, gpu))
    sc = built.scenario
    prev_term = _kill_ranks_on_sigterm(run.pool)
    try:
        res = simulate(built.deployment, requests, built.cost_model, seed=sc.seed,
                       slo=Slo(ttft_s=sc.slo.ttft_s, tpot_s=sc.slo.tpot_s), progress=progress,
                       kv_chunks=built.cost_model.kv_chunks, env=env, policies=sc.sim.policies.build(),
                       closed_loop=sc.workload.closed_loop(), **_cache_kw(spec),
                       executor_factory=lambda cm, net, group_of: RealExecutor(run, group_of))
        if run.sampler is not None:
            try:
                run.term_profile = profile_plans_of(run)
            except RuntimeError as exc:   # the measured run stands; the profile says why it is missing
                run.term_profile_error = str(exc)
    finally:
        if prev_term is not None:
            signal.signal(signal.SIGTERM, prev_term)
        run.pool.stop()
        run.tmp.cleanup()
    return res, run


def profile_plans_of(run: RealRun, timeout_s: float = 600.0) -> list[dict]:
    """After the measured run: each worker's sampled plans (``run.sampler``) re-run under the profiler on its
    ranks (``Rank._op_profile``), one worker at a time. Per plan: its worker, kind, key and size, the
    measured time from the run (``measured_s``), and the busiest rank's (largest ``kernels_s``) time per
    cost-model term (``terms``), outside every term (``unscoped_s``) and in all (``kernels_s``);
    ``overhead_s`` = measured - kernels, the engine's host and launch time; ``profiled_wall_s``: the wall time
    of that profiled re-run (profiler overhead included; the kernels always fit in it, while the measured time
    comes from another run of the plan — on a CPU shared with other work a re-run can be the slower one). A
    worker with a dead rank, and plans that never completed, are left out."""
    measured: dict[tuple, float] = {}
    for w, k, key, m, _ in run.records:
        if m == m and m != float("inf"):
            measured.setdefault((w, k, key), m)
    out = []
    for worker, samples in run.sampler.chosen().items():
        ranks = run.group_ranks.get(worker)
        samples = [s for s in samples if (worker, s["kind"], s["key"]) in measured]
        if not ranks or not samples or set(ranks) & run.pool.dead:
            continue
        tok = run.pool.token()
        keys = [[s["kind"], s["key"]] for s in samples]
        for r in ranks:
            run.pool.send(r, "profile", tok, keys=keys)
        replies: dict[int, list] = {}
        t0 = time.perf_counter()
        while len(replies) < len(ranks):
            for token, rank, status, payload, *_ in run.pool.poll(1.0):
                if token != tok:
                    continue
                if status != "ok":
                    raise RuntimeError(f"rank {rank}: profiling {worker}'s plans failed: {payload}")
                replies[rank] = payload[0]
            if run.pool.newly_dead() or time.perf_counter() - t0 > timeout_s:
                raise RuntimeError(f"profiling {worker}'s plans: a rank died or did not answer")
        for i, s in enumerate(samples):
            busiest = max((replies[r][i] for r in ranks), key=lambda p: p["kernels_s"])
            m = measured[(worker, s["kind"], s["key"])]
            out.append({**s, "measured_s": m, "terms": busiest["terms"], "unscoped_s": busiest["unscoped_s"],
                        "kernels_s": busiest["kernels_s"], "overhead_s": m - busiest["kernels_s"],
                        "profiled_wall_s": busiest["wall_s"], "ranks": len(ranks)})
    return out


def _kill_ranks_on_sigterm(pool):
    """On SIGTERM (main thread only) kill the local rank processes at once, then exit 143 through the usual
    clean-up; returns the handler it replaced (None if none was installed). A SIGKILL'ed driver's ranks end by
    themselves (``engine.loop.lifetime``)."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def on_term(signum, _frame):
        for p in pool.procs:
            if p.is_alive():
                p.kill()
        raise SystemExit(128 + signum)

    return signal.signal(signal.SIGTERM, on_term)


#: how a request may end in a real run: done, or rejected for one of the scheduler's reasons — not ``stalled``
#: (open with nothing left to happen) and not missing from the results
BAD_END_REASONS = frozenset({"stalled"})


def bad_endings(metrics: dict) -> dict[str, int]:
    """``{reason: count}`` of requests that ended without an acceptable reason (``BAD_END_REASONS``, and ``lost``:
    neither done nor rejected); empty when every request is accounted for."""
    m = metrics["requests"]
    out = {r: n for r, n in m.get("rejected_by_reason", {}).items() if r in BAD_END_REASONS and n}
    lost = m["total"] - m["done"] - m["rejected"]
    if lost:
        out["lost"] = lost
    return out


class ReplayExecutor:
    """The simulator's executor for the cross-mode identity test: returns a real run's measured durations."""

    def __init__(self, records) -> None:
        self.table: dict[tuple, list] = {}
        for w, k, key, m, _, *acc in records:     # a key can repeat (a KV shipped again after a failure)
            k, _, failed = k.partition(":")       # "kv:kv_lost": failed without a fault (RealRun._decline_plan)
            # a speculative step answers with its real MTP outcomes, as the real run's completion did
            self.table.setdefault((w, k, key), []).append(Failed(m, failed) if failed else
                                                          Accepted(m, acc[0]) if acc else m)
        self.breakdown_s = {"prefill": {}, "decode": {}}
        self.load_s = None          # a real run has no lower-tier copies (its measured prefill durations are it)
        self.load_total_s = 0.0

    def breakdown(self) -> dict:
        return self.breakdown_s

    def duration(self, plan, now_s: float) -> float:
        tp = type(plan)
        if tp is PrefillBatch:
            k = (plan.worker, "prefill", plan.batch)
        elif tp is KvTransfer:
            k = (plan.worker, "kv", plan.request_id)
        elif tp is MixedStep:
            k = (plan.worker, "mixed", plan.step)
        else:
            k = (plan.worker, "decode", plan.step)
        if not self.table.get(k):
            raise KeyError(f"replay: the real run has no duration for {k} (decisions diverged)")
        v = self.table[k].pop(0)
        return v if type(v) is Failed or type(v) is Accepted else float(v)


def replay(built, requests, records, *, simulate, seed: int, deaths=(), prefix_cache=None):
    """Simulate ``built`` through ``simulate`` (``sim.driver.simulate``) with the recorded durations of a real run
    (same scheduler, simulated clock); ``deaths`` (``RealRun.deaths``: ``(t, rank, gpu)``) become faults at the same
    times; ``prefix_cache`` as the real run had it (None: ``built.prefix_cache``)."""
    from rackbed.engine.core.metrics import Slo

    sc = built.scenario
    faults = [{"at_s": t, "target": f"gpu:{gpu}"} for t, _, gpu in deaths]
    return simulate(built.deployment, requests, built.cost_model, seed=seed, progress=False, faults=faults,
                    slo=Slo(ttft_s=sc.slo.ttft_s, tpot_s=sc.slo.tpot_s), kv_chunks=built.cost_model.kv_chunks,
                    policies=sc.sim.policies.build(),
                    **_cache_kw(prefix_cache if prefix_cache is not None else getattr(built, "prefix_cache", None)),
                    executor_factory=lambda cm, net, group_of: ReplayExecutor(records))

