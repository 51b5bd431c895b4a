"""TransferEngine: executes ``engine.core.kv``'s resharding plan between real KV caches.

Both sides compute the same plan (a pure function of the two layouts, the sequence length and both page lists),
so only payload crosses the wire: each source rank gathers the byte ranges of its chunks into one contiguous buffer
(one gather kernel), sends it to the destination rank, which scatters it to its chunks' offsets (one scatter).
Chunks are addressed in bytes of the rank's whole cache (``PagedKvCache.storage``, HND ``[L, P, 2, H, S, Dh]``), so
the gather/scatter works on ``storage`` viewed as rows of ``unit`` bytes, ``unit`` the gcd of every offset and size.

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

    ``src_layout`` / ``dst_layout`` describe the two sides' per-rank caches (``n_pages`` = pages per rank).
    ``src_ranks`` are the global ranks of the prefiller's TP ranks (index = TP rank), ``dst_rank`` the decoder's.
    """

    def __init__(self, src_layout: KvLayout, dst_layout: KvLayout, backend: KvBackend | None = None) -> None:
        self.src_layout, self.dst_layout = src_layout, dst_layout
        self.backend = backend or KvBackend()

    def dst_pages_for(self, seq_len: int) -> int:
        """Pages the destination reserves for a ``seq_len``-token sequence: its KV plus the first decoded token."""
        return -(-(seq_len + 1) // self.dst_layout.page_tokens)

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
        return reshard_plan(self.src_layout, self.dst_layout, seq_len, np.asarray(src_pages),
                            np.asarray(dst_pages))

    def decline(self, dst_global: int, device) -> None:
        """Source side, after a (non-refused) offer: tell the destination no payload follows (this source cannot
        ship), so the pair's next transfer starts in step."""
        self.backend.send(torch.tensor([-1], dtype=torch.long, device=device), dst_global)

    def send(self, storage: torch.Tensor, my_tp_rank: int, dst_global: int, seq_len: int, src_pages,
             dst_pages) -> int:
        """Called on each source rank after a (non-refused) offer: the header, then the payload; returns bytes
        sent. A failure before the header declines the transfer (the destination's receive fails, not hangs)."""
        try:
            p = self.plan(seq_len, src_pages, dst_pages)
            sel = np.asarray(p.src_rank) == my_tp_rank
            offs, sizes = np.asarray(p.src_offset)[sel], np.asarray(p.nbytes)[sel]
            if sizes.sum() == 0:
                buf = torch.zeros(0, dtype=torch.uint8, device=storage.device)
            else:
                unit = _unit(offs, sizes, storage.numel() * storage.element_size())
                idx = _row_index(offs, sizes, unit).to(storage.device)
                buf = _rows(storage, unit)[idx].reshape(-1).contiguous()
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
        p = self.plan(seq_len, src_pages, dst_pages)
        total = 0
        src_rank = np.asarray(p.src_rank)
        problems = []
        head = torch.empty(1, dtype=torch.long, device=storage.device)
        for r, g in enumerate(src_globals):
            sel = src_rank == r
            offs, sizes = np.asarray(p.dst_offset)[sel], np.asarray(p.nbytes)[sel]
            n = int(sizes.sum())
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
            if n == 0:
                continue
            unit = _unit(offs, sizes, storage.numel() * storage.element_size())
            idx = _row_index(offs, sizes, unit).to(storage.device)
            _rows(storage, unit)[idx] = buf.view(-1, unit)
            total += n
        if problems:
            msg = "KV transfer failed: " + "; ".join(problems)
            if all(x.endswith(" declined") for x in problems):
                raise KvDeclined(msg)
            raise RuntimeError(msg)
        return total
