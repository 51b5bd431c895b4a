"""All-reduce algorithms as explicit schedules, their traffic counters, and a numpy executor.

Each algorithm is a list of :class:`Step` s — who reads or writes which element range of whose buffer, in which
phase — plus :class:`Traffic` counters derived *from the steps* (never from a formula), so a test that compares
a counter to the write-up's formula checks the schedule. :func:`execute` runs a schedule on per-rank numpy arrays
by following the steps one by one; a broken schedule gives a wrong result or an error, never the right sum by
accident. :func:`link_bytes` maps a schedule's traffic onto the links of a topology.

Memory model. Every rank ``r`` owns two symmetric buffers of ``n_elems`` elements: ``in[r]`` (its input, readable
by peers — cuMem / symmetric memory) and ``out[r]`` (the result; starts unwritten). A step in phase ``p`` reads
memory as it was at the end of phase ``p-1`` (steps of one phase run concurrently) and its writes are applied in
list order. Step kinds (``sl`` = ``[elem_offset, elem_offset + n_elems)``, ``src`` = ``src_buf`` of the named rank):

=======================  ===========================================================================  ==========
kind                     effect                                                                         traffic
=======================  ===========================================================================  ==========
``load``                 ``out[rank][sl] = src[peer][sl]`` (``peer == rank``: local copy)              peer→rank
``reduce_load``          ``out[rank][sl] += src[peer][sl]``                                             peer→rank
``store``                ``out[peer][sl] = src[rank][sl]``                                              rank→peer
``send``                 queue ``src[rank][sl]`` on channel ``(rank, peer)`` (a write into the peer's   rank→peer
                         receive buffer, NCCL-style)
``recv``                 ``out[rank][sl] = `` next message of channel ``(peer, rank)``                  (counted at
``recv_reduce``          ``out[rank][sl] = src[rank][sl] + `` next message of channel ``(peer, rank)``   the send)
``multimem_ld_reduce``   ``out[rank][sl] = Σ_g src[g][sl]`` over all ranks ``g``: the NVSwitch reads    g→switch,
                         the slice from every GPU, reduces, returns the sum (``peer == "switch"``)     switch→rank
``multimem_st``          ``out[g][sl] = src[rank][sl]`` for every rank ``g``: one store, the switch     rank→switch,
                         multicasts it (``peer == "switch"``)                                          switch→g
=======================  ===========================================================================  ==========

Algorithms (N ranks, B = ``n_elems * elem_bytes`` bytes per rank buffer; slices are the ``N`` contiguous parts of
the buffer, the first ``n_elems % N`` one element longer, so any size is covered exactly — ``|s_r|`` below):

- ``naive``    every rank independently loads every peer's *whole* buffer, one peer per phase (N-1 phases, the
               "loop of peer copies + add"), and sums into its own ``out``. ``total_read_bytes = N(N-1)B``
               (the write-up's "naive peer loading everything"). Rooted variants ("one peer loads from all, then
               broadcasts") move 2(N-1)B but serialise on the root; they are not modelled.
- ``one_shot`` the same bytes as ``naive`` (``total_read_bytes = N(N-1)B``) but fused: every rank loads all
               N-1 peers' buffers concurrently in ONE phase (vLLM/TRT-LLM one-shot custom all-reduce). It differs
               from ``naive`` in ``n_phases`` (1 vs N-1), which is what a latency model sees.
- ``two_shot`` reduce-scatter by loads (rank r reduces slice r, reading it from the N-1 peers), then all-gather
               by stores (rank r stores its reduced slice into the N-1 peers). ``total_read_bytes = (N-1)B``,
               ``total_write_bytes = (N-1)B``, ``total_peer_bytes = 2(N-1)B`` (the write-up's "moves 2(N-1)B");
               per rank ``read = send = (N-1)|s_r|`` (= (N-1)B/N when N divides ``n_elems``).
- ``ring``     the standard ring: N-1 reduce-scatter steps then N-1 all-gather steps (2(N-1) phases); at every
               step each rank sends one chunk to ``rank+1``. ``total_write_bytes = total_peer_bytes = 2(N-1)B``.
- ``nvls``     NVLink SHARP: rank r issues ``multimem.ld_reduce`` on slice r (the switch reads slice r from all N
               GPUs and returns the sum), then ``multimem.st`` of it (the switch writes it to all N GPUs).
               ``total_peer_bytes = 0``; all traffic is GPU↔switch.

The write-up's comparison (``per_rank_transaction_bytes``): without SHARP (two-shot) a GPU reads (N-1)B/N and
sends (N-1)B/N: **2(N-1)B/N**; with SHARP the switch takes from each GPU its own slice for its own ld_reduce
("B/N between GPU and switch") plus the (N-1) slices the peers' ld_reduces need ("(N-1)B/N with peers"):
**B**. Ratio N/(2(N-1)) (0.667 at N=4, i.e. the "33 %" cut: :func:`sharp_cut`). That accounting leaves out the
ld_reduce result coming back (|s_r|) and the multimem.st going up (|s_r|); the physical per-direction bytes on a
GPU's NVLink port are ``per_rank_tx_bytes = per_rank_rx_bytes = B + |s_r|`` for nvls against 2(N-1)B/N for
two-shot and ring, ratio (N+1)/(2(N-1)) (:func:`sharp_cut_per_direction`: 17 % at N=4, 36 % at N=8 — the
latter matches NCCL's measured 8xH100 NVLS ≈480 vs ring ≈370 GB/s bus bandwidth after its 0.85 NVLS efficiency).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from functools import lru_cache
from typing import Any, Literal, NamedTuple

import numpy as np

from rackbed.topology.errors import UserError

__all__ = [
    "ALGORITHMS",
    "Schedule",
    "Step",
    "Traffic",
    "count_traffic",
    "execute",
    "link_bytes",
    "make_schedule",
    "schedule",
    "sharp_cut",
    "sharp_cut_per_direction",
    "slices",
]

Algorithm = Literal["naive", "one_shot", "two_shot", "ring", "nvls"]
ALGORITHMS: tuple[str, ...] = ("naive", "one_shot", "two_shot", "ring", "nvls")
StepKind = Literal[
    "load", "reduce_load", "store", "send", "recv", "recv_reduce", "multimem_ld_reduce", "multimem_st"
]
STEP_KINDS: frozenset[str] = frozenset(StepKind.__args__)  # type: ignore[attr-defined]
SWITCH = "switch"
_MULTIMEM = frozenset({"multimem_ld_reduce", "multimem_st"})
_READS_PEER = frozenset({"load", "reduce_load"})  # data flows peer -> rank


class Step(NamedTuple):
    """One instruction of a schedule, issued by ``rank`` in ``phase`` (see the module docstring for effects).

    Immutable and hashable like a frozen dataclass; a NamedTuple because a 72-rank ring has 20k steps and a
    NamedTuple is built ~6x faster (``step._replace(...)`` replaces fields).

    peer:        the other side: a rank index (``== rank`` for a local copy, no traffic) or ``"switch"`` for the
                 multimem kinds.
    elem_offset: first element of the range (elements, not bytes); n_elems: its length (> 0).
    src_buf:     which buffer the data is read from: ``"in"`` (the input) or ``"out"`` (the result so far).
    """

    phase: int
    kind: StepKind
    rank: int
    peer: int | Literal["switch"]
    elem_offset: int
    n_elems: int
    src_buf: Literal["in", "out"] = "in"


@dataclass(frozen=True, slots=True)
class Traffic:
    """Byte counters of a schedule, summed over its steps. Tuples are indexed by rank.

    per_rank_read_bytes:        bytes rank r's loads fetch from peers' memory (load/reduce_load, peer != r).
    per_rank_send_bytes:        bytes rank r writes into peers' memory (store to a peer, send).
    per_rank_tx_bytes:          bytes leaving GPU r over its NVLink ports (peers reading r, r's stores/sends,
                                the switch reading r for any ld_reduce, r's multimem.st) — data direction only.
    per_rank_rx_bytes:          bytes entering GPU r over its NVLink ports.
    per_rank_gpu_switch_bytes:  multimem bytes on GPU r's GPU↔switch links, both directions (0 unless nvls).
    per_rank_transaction_bytes: the write-up's "transactions" per GPU: read + send + bytes of r's input read by
                                the switch for ld_reduce (two-shot: 2(N-1)B/N, nvls: B; module docstring).
    total_read_bytes / total_write_bytes: sums of per_rank_read_bytes / per_rank_send_bytes.
    total_peer_bytes:           total_read_bytes + total_write_bytes (GPU↔GPU data movement, the write-up's
                                "moves"); total_gpu_switch_bytes: sum of per_rank_gpu_switch_bytes.
    n_phases:                   phases (dependent rounds of concurrent steps).
    n_sync_points:              cross-rank synchronisations (barrier or flag wait) the steps need: one before
                                phase 0 if any step reads a peer's input, one after every phase that writes
                                into another GPU's memory, one before a phase that reads a peer's ``out``.
    """

    per_rank_read_bytes: tuple[int, ...]
    per_rank_send_bytes: tuple[int, ...]
    per_rank_tx_bytes: tuple[int, ...]
    per_rank_rx_bytes: tuple[int, ...]
    per_rank_gpu_switch_bytes: tuple[int, ...]
    per_rank_transaction_bytes: tuple[int, ...]
    total_read_bytes: int
    total_write_bytes: int
    total_peer_bytes: int
    total_gpu_switch_bytes: int
    n_phases: int
    n_sync_points: int


@dataclass(frozen=True, slots=True)
class Schedule:
    """An all-reduce of ``n_ranks`` buffers of ``n_elems`` elements of ``elem_bytes`` bytes each.

    steps are ordered by phase; ``traffic`` is computed from them by :func:`count_traffic`.
    ``buffer_bytes`` (= B of the write-up) is ``n_elems * elem_bytes``.
    """

    algo: str
    n_ranks: int
    n_elems: int
    elem_bytes: int
    steps: tuple[Step, ...]
    traffic: Traffic

    @property
    def buffer_bytes(self) -> int:
        return self.n_elems * self.elem_bytes


def slices(n_elems: int, n_parts: int) -> list[tuple[int, int]]:
    """Split ``[0, n_elems)`` into ``n_parts`` contiguous ``(offset, length)`` parts covering it exactly.

    The first ``n_elems % n_parts`` parts have ``ceil(n_elems / n_parts)`` elements, the rest the floor (which
    may be 0 when ``n_elems < n_parts``).
    """
    base, extra = divmod(n_elems, n_parts)
    out, off = [], 0
    for i in range(n_parts):
        length = base + (1 if i < extra else 0)
        out.append((off, length))
        off += length
    assert off == n_elems
    return out


def sharp_cut(n_ranks: int) -> float:
    """The write-up's theoretical SHARP saving: 1 - N/(2(N-1)) (1/3 at N=4, 0 at N=2).

    N/(2(N-1)) is the ratio of per-GPU transactions with SHARP (B) to without (2(N-1)B/N); see the module
    docstring for what it leaves out.
    """
    if n_ranks < 2:
        raise UserError(f"sharp_cut: n_ranks must be >= 2, got {n_ranks}")
    return float(1 - Fraction(n_ranks, 2 * (n_ranks - 1)))


def sharp_cut_per_direction(n_ranks: int) -> float:
    """Physical saving of NVLS over two-shot/ring in per-direction bytes per GPU port: 1 - (N+1)/(2(N-1)).

    nvls moves B + B/N each way per GPU (ld_reduce: B up, B/N down; st: B/N up, B down) against 2(N-1)B/N.
    Negative at N=2 (NVLS moves more bytes than a 2-rank exchange), 1/6 at N=4, 0.357 at N=8.
    """
    if n_ranks < 2:
        raise UserError(f"sharp_cut_per_direction: n_ranks must be >= 2, got {n_ranks}")
    return float(1 - Fraction(n_ranks + 1, 2 * (n_ranks - 1)))


# --------------------------------------------------------------------------------------------- builders


def _naive(n: int, n_elems: int, one_shot: bool) -> list[Step]:
    steps = []
    for r in range(n):
        steps.append(Step(0, "load", r, r, 0, n_elems))
        for i in range(1, n):  # peer r+i in phase i-1 (naive) or all in phase 0 (one-shot)
            steps.append(Step(0 if one_shot else i - 1, "reduce_load", r, (r + i) % n, 0, n_elems))
    return sorted(steps, key=lambda s: s.phase)


def _two_shot(n: int, n_elems: int) -> list[Step]:
    parts = slices(n_elems, n)
    steps = []
    for r, (off, length) in enumerate(parts):  # phase 0: reduce-scatter, rank r owns slice r
        if length:
            steps.append(Step(0, "load", r, r, off, length))
            steps += [Step(0, "reduce_load", r, (r + i) % n, off, length) for i in range(1, n)]
    for r, (off, length) in enumerate(parts):  # phase 1: all-gather by stores
        if length:
            steps += [Step(1, "store", r, (r + i) % n, off, length, "out") for i in range(1, n)]
    return steps


def _ring(n: int, n_elems: int) -> list[Step]:
    chunks = slices(n_elems, n)
    steps = []
    # reduce-scatter: at step s rank r sends chunk (r - s) and reduces chunk (r - 1 - s) received from r - 1;
    # after N-1 steps rank r holds the full sum of chunk (r + 1).
    for s in range(n - 1):
        for r in range(n):
            off, length = chunks[(r - s) % n]
            if length:
                steps.append(Step(s, "send", r, (r + 1) % n, off, length, "in" if s == 0 else "out"))
        for r in range(n):
            off, length = chunks[(r - 1 - s) % n]
            if length:
                steps.append(Step(s, "recv_reduce", r, (r - 1) % n, off, length, "in"))
    # all-gather: at step s rank r forwards chunk (r + 1 - s) and receives chunk (r - s).
    for s in range(n - 1):
        phase = n - 1 + s
        for r in range(n):
            off, length = chunks[(r + 1 - s) % n]
            if length:
                steps.append(Step(phase, "send", r, (r + 1) % n, off, length, "out"))
        for r in range(n):
            off, length = chunks[(r - s) % n]
            if length:
                steps.append(Step(phase, "recv", r, (r - 1) % n, off, length))
    return steps


def _nvls(n: int, n_elems: int) -> list[Step]:
    parts = slices(n_elems, n)
    steps = [Step(0, "multimem_ld_reduce", r, SWITCH, off, ln) for r, (off, ln) in enumerate(parts) if ln]
    steps += [Step(1, "multimem_st", r, SWITCH, off, ln, "out") for r, (off, ln) in enumerate(parts) if ln]
    return steps


@lru_cache(maxsize=256)
def schedule(algo: str, n_ranks: int, n_elems: int, elem_bytes: int = 2) -> Schedule:
    """Build the all-reduce schedule ``algo`` for ``n_ranks`` buffers of ``n_elems`` elements (``elem_bytes``
    bytes each). ``n_ranks == 1`` gives one local copy for every algorithm.

    Schedules are immutable, so results are cached (cost models may ask for the same one per step). Note that
    the number of steps grows like N^2 (naive, two-shot, ring) times 1, independent of ``n_elems``.
    """
    if algo not in ALGORITHMS:
        raise UserError(f"collectives.schedule: algo must be one of {', '.join(ALGORITHMS)}, got {algo!r}")
    if n_ranks < 1:
        raise UserError(f"collectives.schedule: n_ranks must be >= 1, got {n_ranks}")
    if n_elems < 0:
        raise UserError(f"collectives.schedule: n_elems must be >= 0, got {n_elems}")
    if elem_bytes < 1:
        raise UserError(f"collectives.schedule: elem_bytes must be >= 1, got {elem_bytes}")
    if n_ranks == 1 or n_elems == 0:
        steps = [Step(0, "load", r, r, 0, n_elems) for r in range(n_ranks)] if n_elems else []
    elif algo in ("naive", "one_shot"):
        steps = _naive(n_ranks, n_elems, one_shot=algo == "one_shot")
    elif algo == "two_shot":
        steps = _two_shot(n_ranks, n_elems)
    elif algo == "ring":
        steps = _ring(n_ranks, n_elems)
    else:
        steps = _nvls(n_ranks, n_elems)
    return make_schedule(algo, n_ranks, n_elems, elem_bytes, steps)


def make_schedule(algo: str, n_ranks: int, n_elems: int, elem_bytes: int, steps: Sequence[Step]) -> Schedule:
    """Validate hand-written ``steps`` (ranges, kinds, peers, phase order) and attach their traffic."""
    last_phase = 0
    for i, st in enumerate(steps):
        peer = st.peer
        multimem = st.kind in _MULTIMEM
        ok_peer = (peer == SWITCH) if multimem else (peer != SWITCH and 0 <= peer < n_ranks)  # type: ignore[operator]
        if (
            st.kind in STEP_KINDS
            and ok_peer
            and 0 <= st.rank < n_ranks
            and st.n_elems >= 1
            and 0 <= st.elem_offset <= n_elems - st.n_elems
            and st.phase >= last_phase
            and st.src_buf in ("in", "out")
        ):
            last_phase = st.phase
            continue
        where = f"schedule {algo!r} step {i}"
        if st.kind not in STEP_KINDS:
            raise UserError(f"{where}: unknown kind {st.kind!r}")
        if not 0 <= st.rank < n_ranks:
            raise UserError(f"{where}: rank {st.rank} outside 0..{n_ranks - 1}")
        if not ok_peer:
            raise UserError(
                f"{where}: peer must be 'switch' for multimem kinds, else a rank 0..{n_ranks - 1}; got {peer!r}"
            )
        if st.n_elems < 1 or st.elem_offset < 0 or st.elem_offset + st.n_elems > n_elems:
            raise UserError(f"{where}: range [{st.elem_offset}, +{st.n_elems}) outside [0, {n_elems})")
        if st.phase < last_phase:
            raise UserError(
                f"{where}: phase {st.phase} after phase {last_phase}; steps must be phase-ordered"
            )
        raise UserError(f"{where}: src_buf must be 'in' or 'out', got {st.src_buf!r}")
    steps = tuple(steps)
    return Schedule(algo, n_ranks, n_elems, elem_bytes, steps, count_traffic(n_ranks, elem_bytes, steps))


def count_traffic(n_ranks: int, elem_bytes: int, steps: Sequence[Step]) -> Traffic:
    """Sum the bytes each step moves (module docstring table) into a :class:`Traffic`."""
    read = [0] * n_ranks
    send = [0] * n_ranks
    tx = [0] * n_ranks
    rx = [0] * n_ranks
    gsw = [0] * n_ranks
    trans_extra = [0] * n_ranks  # input bytes the switch reads from r for ld_reduce
    n_phases = (steps[-1].phase + 1) if steps else 0
    remote_write_phases: set[int] = set()
    reads_remote_out_phases: set[int] = set()
    reads_remote_in = False
    for st in steps:
        nb = st.n_elems * elem_bytes
        r, p = st.rank, st.peer
        if st.kind in _READS_PEER and p != r:
            read[r] += nb
            tx[p] += nb  # type: ignore[index]
            rx[r] += nb
            if st.src_buf == "in":
                reads_remote_in = True
            else:
                reads_remote_out_phases.add(st.phase)
        elif (st.kind == "store" and p != r) or st.kind == "send":
            send[r] += nb
            tx[r] += nb
            rx[p] += nb  # type: ignore[index]
            remote_write_phases.add(st.phase)
        elif st.kind == "multimem_ld_reduce":
            for g in range(n_ranks):  # the switch reads the slice from every GPU
                tx[g] += nb
                gsw[g] += nb
                trans_extra[g] += nb
                if g != r:
                    reads_remote_in |= st.src_buf == "in"
                    if st.src_buf == "out":
                        reads_remote_out_phases.add(st.phase)
            rx[r] += nb  # and returns the sum
            gsw[r] += nb
        elif st.kind == "multimem_st":
            tx[r] += nb
            gsw[r] += nb
            for g in range(n_ranks):  # the switch writes it to every GPU
                rx[g] += nb
                gsw[g] += nb
            remote_write_phases.add(st.phase)
    syncs = 0
    for b in range(n_phases + 1):  # boundary b sits before phase b (b == n_phases: after the last phase)
        if (
            (b == 0 and reads_remote_in)
            or (b > 0 and (b - 1) in remote_write_phases)
            or (0 < b < n_phases and b in reads_remote_out_phases)
        ):
            syncs += 1
    trans = [read[r] + send[r] + trans_extra[r] for r in range(n_ranks)]
    return Traffic(
        per_rank_read_bytes=tuple(read),
        per_rank_send_bytes=tuple(send),
        per_rank_tx_bytes=tuple(tx),
        per_rank_rx_bytes=tuple(rx),
        per_rank_gpu_switch_bytes=tuple(gsw),
        per_rank_transaction_bytes=tuple(trans),
        total_read_bytes=sum(read),
        total_write_bytes=sum(send),
        total_peer_bytes=sum(read) + sum(send),
        total_gpu_switch_bytes=sum(gsw),
        n_phases=n_phases,
        n_sync_points=syncs,
    )


# --------------------------------------------------------------------------------------------- executor


def execute(sched: Schedule, arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Run ``sched`` on ``n_ranks`` arrays of ``n_elems`` elements each (any shape) and return each rank's
    ``out`` buffer, reshaped like the inputs.

    Follows the steps literally with the phase semantics of the module docstring. Raises ``RuntimeError`` if
    a step reads an ``out`` element no step has written yet, if a ``recv`` finds no matching message, if a
    message is left unreceived, or if any output element is left unwritten.
    """
    n = sched.n_ranks
    if len(arrays) != n:
        raise UserError(f"collectives.execute: got {len(arrays)} arrays for {n} ranks")
    shape = np.shape(arrays[0])
    dtype = np.result_type(*arrays)
    ins = []
    for i, a in enumerate(arrays):
        a = np.asarray(a, dtype=dtype)
        if a.shape != shape or a.size != sched.n_elems:
            raise UserError(
                f"collectives.execute: array {i} has shape {a.shape}, expected {shape} with {sched.n_elems} elements"
            )
        ins.append(a.reshape(-1))
    ins2 = np.stack(ins) if n else np.zeros((0, sched.n_elems), dtype=dtype)  # [N, n_elems]
    outs = np.zeros((n, sched.n_elems), dtype=dtype)  # [N, n_elems]
    written = np.zeros((n, sched.n_elems), dtype=bool)  # [N, n_elems]
    channels: dict[tuple[int, int], deque] = {}

    steps = sched.steps
    i = 0
    while i < len(steps):
        j = i
        while j < len(steps) and steps[j].phase == steps[i].phase:
            j += 1
        _run_phase(steps[i:j], ins2, outs, written, channels)
        i = j
    if any(channels.values()):
        raise RuntimeError(f"{sched.algo}: messages sent but never received")
    for r in range(n):
        if not written[r].all():
            raise RuntimeError(
                f"{sched.algo}: rank {r} output has {int((~written[r]).sum())} unwritten elements"
            )
    return [outs[r].reshape(shape) for r in range(n)]


def _run_phase(
    steps: Sequence[Step],
    ins: np.ndarray,
    outs: np.ndarray,
    written: np.ndarray,
    channels: dict[tuple[int, int], deque],
) -> None:
    """One phase: read every source from the state at the start of the phase, then apply writes in order."""
    snap_out = outs.copy()
    snap_written = written.copy()

    def src(rank: int, buf: str, a: int, b: int) -> np.ndarray:
        if buf == "in":
            return ins[rank, a:b]
        if not snap_written[rank, a:b].all():
            raise RuntimeError(f"rank {rank} out[{a}:{b}] read before it was written")
        return snap_out[rank, a:b]

    # sends of this phase are visible to the receives of this phase (the receiver waits on them)
    for st in steps:
        if st.kind == "send":
            a = st.elem_offset
            channels.setdefault((st.rank, st.peer), deque()).append(
                src(st.rank, st.src_buf, a, a + st.n_elems).copy()
            )

    for st in steps:
        r, p, k = st.rank, st.peer, st.kind
        a = st.elem_offset
        b = a + st.n_elems
        if k == "send":
            continue
        if k == "load":
            outs[r, a:b] = src(p, st.src_buf, a, b)
            written[r, a:b] = True
        elif k == "reduce_load":
            if not written[r, a:b].all():
                raise RuntimeError(f"rank {r}: reduce_load into out[{a}:{b}] before it was written")
            outs[r, a:b] += src(p, st.src_buf, a, b)
        elif k == "store":
            outs[p, a:b] = src(r, st.src_buf, a, b)
            written[p, a:b] = True
        elif k in ("recv", "recv_reduce"):
            queue = channels.get((p, r))
            if not queue:
                raise RuntimeError(f"rank {r}: recv from {p} with no message in flight")
            msg = queue.popleft()
            if msg.shape[0] != st.n_elems:
                raise RuntimeError(
                    f"rank {r}: recv of {st.n_elems} elements got a {msg.shape[0]}-element message"
                )
            outs[r, a:b] = msg if k == "recv" else src(r, st.src_buf, a, b) + msg
            written[r, a:b] = True
        elif k == "multimem_ld_reduce":
            acc = src(0, st.src_buf, a, b).copy()  # the switch reads the slice of every GPU of the group
            for g in range(1, ins.shape[0]):
                acc += src(g, st.src_buf, a, b)
            outs[r, a:b] = acc
            written[r, a:b] = True
        elif k == "multimem_st":
            val = src(r, st.src_buf, a, b).copy()
            for g in range(ins.shape[0]):  # the switch multicasts the store
                outs[g, a:b] = val
                written[g, a:b] = True
        else:  # pragma: no cover - make_schedule validates kinds
            raise AssertionError(k)


# --------------------------------------------------------------------------------------------- links


def link_bytes(sched: Schedule, topology: Any, gpus: Sequence[int]) -> dict[tuple[str, str], float]:
    """Bytes each directed link carries when ``sched`` runs with rank i on GPU ``gpus[i]``.

    ``topology`` is duck-typed: it needs ``path(a, b) -> list[hop]`` (hops with ``.src``/``.dst`` node ids,
    ``topology.graph.Topology`` in this project) and, for multimem steps, ``reducing_switches(gpus) ->
    list[str]``. Peer traffic (load, reduce_load: data peer→rank; store, send: rank→peer) is added to every hop of
    ``path(src_gpu, dst_gpu)``. Multimem traffic is spread evenly over the reducing switches (NVLS stripes over
    every switch plane) on the links ``("gpu:<g>", switch)`` / ``(switch, "gpu:<g>")``. Local copies move
    nothing. Returns ``{(src_node, dst_node): bytes}`` (floats, since multimem bytes are divided by the number of
    switches).
    """
    if len(gpus) != sched.n_ranks:
        raise UserError(f"collectives.link_bytes: {len(gpus)} gpus for a {sched.n_ranks}-rank schedule")
    if len(set(gpus)) != len(gpus):
        raise UserError(f"collectives.link_bytes: gpus {list(gpus)} repeat a GPU")
    out: dict[tuple[str, str], float] = {}
    path_cache: dict[tuple[int, int], list] = {}

    def add_path(a: int, b: int, nb: float) -> None:
        key = (gpus[a], gpus[b])
        if key not in path_cache:
            path_cache[key] = list(topology.path(*key))
        for hop in path_cache[key]:
            out[(hop.src, hop.dst)] = out.get((hop.src, hop.dst), 0.0) + nb

    switches: list[str] | None = None

    def add_switch(g: int, up: bool, nb: float) -> None:
        nonlocal switches
        if switches is None:
            switches = list(topology.reducing_switches(list(gpus)))
            if not switches:
                raise UserError(
                    f"collectives.link_bytes: no reducing switch for gpus {list(gpus)}; nvls impossible"
                )
        share = nb / len(switches)
        node = f"gpu:{gpus[g]}"
        for sw in switches:
            key = (node, sw) if up else (sw, node)
            out[key] = out.get(key, 0.0) + share

    for st in sched.steps:
        nb = st.n_elems * sched.elem_bytes
        r, p = st.rank, st.peer
        if st.kind in _READS_PEER and p != r:
            add_path(p, r, nb)  # type: ignore[arg-type]
        elif (st.kind == "store" and p != r) or st.kind == "send":
            add_path(r, p, nb)  # type: ignore[arg-type]
        elif st.kind == "multimem_ld_reduce":
            for g in range(sched.n_ranks):
                add_switch(g, True, nb)
            add_switch(r, False, nb)
        elif st.kind == "multimem_st":
            add_switch(r, True, nb)
            for g in range(sched.n_ranks):
                add_switch(g, False, nb)
    return out
