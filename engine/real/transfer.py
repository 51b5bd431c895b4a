"""TransferEngine: executes ``engine.core.kv``'s resharding plan between real KV caches.

Both sides compute the same plan (a pure function of the two layouts, the sequence length and both page lists),
so only payload crosses the wire: each source rank gathers the byte ranges of its chunks into one contiguous buffer
(one gather kernel), sends it to the destination rank, which scatters it to its chunks' offsets (one scatter).
Chunks are addressed in bytes of the rank's whole cache (``PagedKvCache.storage``, HND ``[L, P, 2, H, S, Dh]``), so
the gather/scatter works on ``storage`` viewed as rows of ``unit`` bytes, ``unit`` the gcd of every offset and size.

Sliding-window layers on rings (``PagedKvCache.ring_storage``, a second buffer) are a second part of the same
transfer: the plan of the sliding layers alone (their window's latest tokens) between the two sides' ring buffers,
with a page table that maps the sequence's page ``i`` to its ring page ``i mod Rp`` (position ``p`` at ring slot
``p mod R`` on both sides), after the plan of the full layers between the page buffers. A page list that crosses
(the offer, a source's pages) is the sequence's pages followed by its ``Rp`` ring pages; the payload is the parts'
bytes in order, under one header.

The destination allocates its pages itself (:meth:`TransferEngine.offer`): it sends the page list to every source
rank, which waits for it (:meth:`TransferEngine.await_offer`) before shipping — the pull-style handshake of
production engines, so neither side needs a round trip through the driver.

Framing. Every transfer exchanges the same messages on each (source, destination) pair whatever fails: the offer
(destination -> source; all ``-1`` = refused), then, unless refused, a one-number header (source -> destination:
the payload's byte count, or ``-1`` = the source cannot ship, e.g. it no longer holds the request's KV) and the
payload of exactly that many bytes. Point-to-point messages of one pair are matched in order, by size, with no
per-transfer tag, and gloo aborts the process (``EnforceNotMet``, not an exception) when a message is larger than
the receive posted for it — so a side that skipped its half of one transfer would hand its peer's next receive the
wrong message and kill it. Hence both sides always complete their half (:meth:`TransferEngine.decline`,
``offer(None, ...)``) and fail the transfer afterwards, and the destination receives whatever size the header
announces before it checks it against the plan. The worker runs all of this on a
dedicated transfer thread, CUDA stream and process group (``engine.real.worker``), beside its compute loop.

Backends: ``torch.distributed`` point-to-point (gloo on CPU, NCCL on GPUs — NCCL rides NVLink inside a node and
InfiniBand across nodes), over the process group given to :class:`KvBackend` (the worker's KV-only group, so KV
traffic never shares a communicator with the compute loop's collectives). A NIXL/RDMA backend would implement :class:`KvBackend` with one-sided writes: register
each rank's ``storage`` once, then post one RDMA write per chunk (or per merged run of chunks) from the source's
registered region to the destination's, with no receiver-side scatter and no matching ``recv``; the plan is the
same.
"""

from __future__ import annotations

import math
from dataclasses import replace
from functools import reduce

import numpy as np
import torch
import torch.distributed as dist

from rackbed.engine.core.kv import KvLayout, reshard_plan


class KvDeclined(RuntimeError):
    """A transfer failed only because a source no longer holds the request's KV (it declined): no rank is at
    fault, the KV is gone. The worker replies ``"declined"`` rather than ``"error"`` (its text starts with
    ``"declined: "`` and :attr:`why`), so the driver has the request prefilled again instead of declaring a
    rank dead."""

    why = "KV lost"


class KvNoRoom(KvDeclined):
    """The decoder has no free pages for the request's KV (its cache is full): it refuses the offer, and the
    sources, which see the refusal, decline too. No rank is at fault and the KV is still on the prefiller: the
    replies read ``"declined: no pages: ..."``, and the driver fails the transfer with ``KV_NO_ROOM`` so the
    scheduler ships it again later, to this decoder or another."""

    why = "no pages"


def _unit(offsets: np.ndarray, sizes: np.ndarray, total: int) -> int:
    g = reduce(math.gcd, (int(x) for x in np.unique(np.concatenate([offsets, sizes]))), int(total))
    return max(g, 1)


def _row_index(offsets: np.ndarray, sizes: np.ndarray, unit: int) -> torch.Tensor:
    """Row ids (rows of ``unit`` bytes) covering each chunk in order."""
    starts = offsets // unit
    counts = sizes // unit
    if counts.sum() == 0:
        return torch.zeros(0, dtype=torch.long)
    base = np.repeat(starts - np.concatenate([[0], np.cumsum(counts)[:-1]]), counts)
    return torch.from_numpy(base + np.arange(int(counts.sum())))


def _rows(storage: torch.Tensor, unit: int) -> torch.Tensor:
    return storage.view(-1).view(torch.uint8).view(-1, unit)


class KvBackend:
    """How bytes move: ``send(buf, dst_rank)`` / ``recv(buf, src_rank)`` (global ranks) over ``group`` (None: the
    default group)."""

    def __init__(self, group=None) -> None:
        self.group = group

    def send(self, buf: torch.Tensor, dst: int) -> None:
        dist.send(buf, dst, group=self.group)

    def recv(self, buf: torch.Tensor, src: int) -> None:
        dist.recv(buf, src, group=self.group)


class TransferEngine:
    """Ships one sequence's KV from a TP-sharded prefiller to one DP decoder rank along the core plan.

    ``src_layout`` / ``dst_layout`` describe the two sides' per-rank caches (``n_pages`` = pages per rank), every
    layer in model order. ``ring_pages`` > 0: the layouts' sliding layers (``windows``) live on rings of that many
    pages per sequence, in a second buffer of ``src_ring_pool`` / ``dst_ring_pool`` pages per rank (module
    docstring); the storages passed to ``send`` / ``recv`` are then ``(pages buffer, ring buffer)``.
    """

    def __init__(self, src_layout: KvLayout, dst_layout: KvLayout, backend: KvBackend | None = None, *,
                 ring_pages: int = 0, src_ring_pool: int = 0, dst_ring_pool: int = 0) -> None:
        self.src_layout, self.dst_layout = src_layout, dst_layout
        self.backend = backend or KvBackend()
        self.ring_pages = ring_pages if src_layout.windows else 0
        if self.ring_pages:
            full = [i for i, w in enumerate(src_layout.windows) if not w]
            ring = [w for w in src_layout.windows if w]

            def part(lay, n, windows, pool=None):
                return replace(lay, n_layers=n, windows=windows, n_pages=pool or lay.n_pages)

            self.parts = [(part(src_layout, len(ring), tuple(ring), src_ring_pool),
                           part(dst_layout, len(ring), tuple(ring), dst_ring_pool))]
            if full:
                self.parts.insert(0, (part(src_layout, len(full), ()), part(dst_layout, len(full), ())))
        else:
            self.parts = [(src_layout, dst_layout)]

    def dst_pages_for(self, seq_len: int) -> int:
        """Entries of the destination's page list for a ``seq_len``-token sequence: pages for its KV plus the
        first decoded token, then its ring pages."""
        return -(-(seq_len + 1) // self.dst_layout.page_tokens) + self.ring_pages

    def _tables(self, pages) -> list:
        """Per part, the page table of a page list (sequence pages, then ``ring_pages`` ring pages)."""
        pages = list(pages)
        if not self.ring_pages:
            return [pages]
        own, ring = pages[:-self.ring_pages], pages[-self.ring_pages:]
        rt = [ring[i % self.ring_pages] for i in range(len(own))]
        return [own, rt] if len(self.parts) == 2 else [rt]

    def offer(self, dst_pages: list[int] | None, seq_len: int, src_globals: list[int], device) -> None:
        """Destination side: send the reserved page list to every source rank (all ``-1`` = refused, e.g. the
        cache is full: the sources then fail the transfer instead of waiting forever)."""
        n = self.dst_pages_for(seq_len)
        bad = dst_pages is not None and len(dst_pages) != n
        t = torch.tensor(dst_pages if dst_pages is not None and not bad else [-1] * n, dtype=torch.long,
                         device=device)
        for g in src_globals:
            self.backend.send(t, g)
        if bad:   # refused above, so the sources are not left waiting
            raise ValueError(f"offer: {len(dst_pages)} pages for a {seq_len}-token sequence, expected {n}")

    def await_offer(self, dst_global: int, seq_len: int, device) -> list[int] | None:
        """Source side: the destination's page list (None if it refused)."""
        t = torch.empty(self.dst_pages_for(seq_len), dtype=torch.long, device=device)
        self.backend.recv(t, dst_global)
        pages = t.tolist()
        return None if pages and pages[0] < 0 else pages

    def plan(self, seq_len: int, src_pages, dst_pages):
        """The plan of every part, in order (one part without rings)."""
        return [reshard_plan(s, d, seq_len, np.asarray(sp), np.asarray(dp))
                for (s, d), sp, dp in zip(self.parts, self._tables(src_pages), self._tables(dst_pages))]

    def decline(self, dst_global: int, device) -> None:
        """Source side, after a (non-refused) offer: tell the destination no payload follows (this source cannot
        ship), so the pair's next transfer starts in step."""
        self.backend.send(torch.tensor([-1], dtype=torch.long, device=device), dst_global)

    def send(self, storage: torch.Tensor, my_tp_rank: int, dst_global: int, seq_len: int, src_pages,
             dst_pages) -> int:
        """Called on each source rank after a (non-refused) offer: the header, then the payload; returns bytes
        sent. A failure before the header declines the transfer (the destination's receive fails, not hangs)."""
        storages = [storage] if isinstance(storage, torch.Tensor) else list(storage)
        storage = storages[0]
        try:
            bufs = []
            for p, st in zip(self.plan(seq_len, src_pages, dst_pages), storages):
                sel = np.asarray(p.src_rank) == my_tp_rank
                offs, sizes = np.asarray(p.src_offset)[sel], np.asarray(p.nbytes)[sel]
                if sizes.sum():
                    unit = _unit(offs, sizes, st.numel() * st.element_size())
                    idx = _row_index(offs, sizes, unit).to(st.device)
                    bufs.append(_rows(st, unit)[idx].reshape(-1))
            buf = torch.cat(bufs) if bufs else torch.zeros(0, dtype=torch.uint8, device=storage.device)
        except BaseException:
            self.decline(dst_global, storage.device)
            raise
        self.backend.send(torch.tensor([buf.numel()], dtype=torch.long, device=storage.device), dst_global)
        if buf.numel():
            self.backend.send(buf, dst_global)
        return int(buf.numel())

    def recv(self, storage: torch.Tensor, src_globals: list[int], seq_len: int, src_pages, dst_pages) -> int:
        """Called on the destination rank after a (non-refused) offer; returns bytes received. Every source's
        header and announced payload are received before a declined or mis-sized one fails the transfer
        (:class:`KvDeclined` when every problem is a decline)."""
        storages = [storage] if isinstance(storage, torch.Tensor) else list(storage)
        storage = storages[0]
        plans = self.plan(seq_len, src_pages, dst_pages)
        total = 0
        problems = []
        head = torch.empty(1, dtype=torch.long, device=storage.device)
        for r, g in enumerate(src_globals):
            chunks = []          # per part: (storage, dst offsets, sizes) of this source's chunks
            for p, st in zip(plans, storages):
                sel = np.asarray(p.src_rank) == r
                chunks.append((st, np.asarray(p.dst_offset)[sel], np.asarray(p.nbytes)[sel]))
            n = int(sum(sz.sum() for _, _, sz in chunks))
            self.backend.recv(head, g)
            got = int(head.item())
            if got < 0:
                problems.append(f"source rank {g} declined")
                continue
            buf = torch.empty(got, dtype=torch.uint8, device=storage.device)
            if got:
                self.backend.recv(buf, g)
            if got != n:
                problems.append(f"source rank {g} sent {got} bytes, the plan says {n}")
                continue
            at = 0
            for st, offs, sizes in chunks:
                m = int(sizes.sum())
                if m:
                    unit = _unit(offs, sizes, st.numel() * st.element_size())
                    idx = _row_index(offs, sizes, unit).to(st.device)
                    _rows(st, unit)[idx] = buf[at:at + m].view(-1, unit)
                    at += m
            total += n
        if problems:
            msg = "KV transfer failed: " + "; ".join(problems)
            if all(x.endswith(" declined") for x in problems):
                raise KvDeclined(msg)
            raise RuntimeError(msg)
        return total
