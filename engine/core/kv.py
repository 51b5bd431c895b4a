"""Paged KV-cache layout (HND, with NHD for comparison; the MLA latent plane) and the prefill -> decode resharding
planner.

Legend: L = KV layers (full-attention layers, MTP included), H = KV heads of the model, Hr = heads a rank holds,
P = tokens per page (``page_tokens``), D = head_dim, e = bytes per element, S = sequence length (tokens).

Byte layout of one rank's cache buffer (``KvLayout.offset``): one region per layer, pages inside it, and per page

    HND   [layer L][page n_pages][K|V 2][head Hr][token-in-page P][dim D]  x e bytes
    NHD   [layer L][page n_pages][K|V 2][token-in-page P][head Hr][dim D]  x e bytes

i.e. FlashInfer's paged layouts (``[num_pages, 2, H, P, D]`` "HND" / ``[num_pages, 2, P, H, D]`` "NHD") stacked
over layers; ``head`` is the rank-local index into ``shards[rank]``. Pages are addressed by id through a per-rank
page table (``pages[rank][i]`` = the page holding tokens ``i*P .. i*P+P-1``). The bytes of the unused tail of the
last page are not part of the sequence.

Why HND: inside a page, the tokens of one head are contiguous (P*D*e bytes). A prefiller sharded by heads
(TP) holds, per page, a head-block that lands contiguously inside the decoder's page whatever heads are next to it,
so a transfer is a few chunks per (layer, K/V, head, page). In NHD the heads of one token are adjacent instead, so
the same transfer splits into one chunk per (layer, K/V, token, source rank): ~P times more. (When heads are not
resharded and the page sizes differ, NHD merges better; ``SHARDING.md`` gives the counts and the exact conditions
``tests/test_kv.py`` checks.)

Resharding (``reshard_plan``): for every (destination rank, head it holds, layer, K/V) the planner copies the
sequence's tokens from one source rank holding that head. Replicated source heads are read once per destination
copy, from replica ``replicas[(head + layer) % n_replicas]`` (replicas sorted by rank): layers alternate between
replicas so every source GPU (and its NIC) sends an equal share. Elementary chunks are maximal token runs that stay
inside one source page and one destination page; chunks with the same (src_rank, dst_rank) that are adjacent on
both sides are merged. Ranks in a plan are layout-local indices (rank r of a TP group; map to GPUs through the
``ParallelPlan``). Everything is vectorised with numpy: O(L * H_dst * (S/Ps + S/Pd)) work for HND.

MLA latent cache (``latent=True``, ``KvLayout.for_attention`` of an ``MlaAttention``): per layer one plane

    latent   [layer L][page n_pages][token-in-page P][dim D = kv_lora_rank + qk_rope_head_dim]  x e bytes

(the latent first, then the shared rotary key; no head axis and no K/V axis). It is one cache unit
(``n_kv_heads = 1``) that every rank of an attention TP group holds whole (``shards = ((0,),) * tp``); a DP
decode rank (``tp = 1``) holds its own requests' pages whole. HND and NHD coincide for it. Replica rule: the
planner reads each destination copy's bytes once, numbering the units (destination copy, layer, source page of
the sequence) in that order (copies = destination ranks ascending, layers ascending, pages from the first the
layer needs) and reading unit ``u`` from replica ``replicas[u % n_replicas]``: page-interleaved, so every layer is
spread over all source GPUs (a layer-by-layer transfer uses every link) and over the whole transfer each replica
serves ``floor(U / n_replicas)`` or ``ceil(U / n_replicas)`` of the ``U`` source pages (``latent_source_ranks``).
Prefill TP a -> decode TP b writes every destination replica (b copies, each read once from the source);
prefill TP -> DP decode writes one.

Sliding-window layers (``windows[l] > 0``: ``SlidingWindowAttention``, HND like full attention): a sequence of
``S`` tokens keeps, and a transfer sends, only its latest ``min(S, window)`` tokens of such a layer (what
``SlidingWindowAttention.kv_tokens`` counts; the next token attends to ``window - 1`` of them and itself, so at
most one token per layer is sent that the decoder will not read). Full layers send all ``S``. Page tables stay
indexed by the sequence's page number (``token // P``): entries of pages wholly before every layer's window are
ignored (they may be -1, freed), so one page table serves a buffer that mixes full and sliding layers (gpt-oss:
``KvLayout.for_model``) as well as a buffer of sliding layers alone.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Literal

import numpy as np

from rackbed.engine.core.sharding import KV_DTYPE_BYTES, kv_window, tp_kv_head_shards

Order = Literal["HND", "NHD"]


def pages_needed(seq_len: int, page_tokens: int) -> int:
    """Pages a sequence of ``seq_len`` tokens occupies."""
    return -(-seq_len // page_tokens)


@dataclass(frozen=True)
class KvLayout:
    """The paged KV cache of one model instance spread over ``len(shards)`` ranks.

    n_layers:    KV layers (full-attention layers, MTP included).
    n_kv_heads:  KV heads of the model (H); every head must be held by at least one rank.
    head_dim:    D.       elem_bytes: e (2 for bf16, 1 for fp8).     page_tokens: P.
    shards:      shards[r] = global KV head ids rank r holds, in storage order; a head may sit on several
                 ranks (replicas) but only once per rank.
    n_pages:     page capacity of each rank's buffer (page ids are 0 .. n_pages-1).
    order:       "HND" (default) or "NHD" (see module docstring for the exact byte order).
    latent:      an MLA latent plane per layer (no K/V axis, ``n_kv_heads = 1``, ``head_dim`` = latent + rope).
    windows:     per layer, the sliding window in tokens (0 = the whole sequence); () = no sliding layer.
    """

    n_layers: int
    n_kv_heads: int
    head_dim: int
    elem_bytes: int
    page_tokens: int
    shards: tuple[tuple[int, ...], ...]
    n_pages: int
    order: Order = "HND"
    latent: bool = False
    windows: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "shards", tuple(tuple(int(h) for h in s) for s in self.shards))
        windows = tuple(int(w) for w in self.windows)
        if windows and len(windows) != self.n_layers:
            raise ValueError(f"KvLayout.windows has {len(windows)} entries for {self.n_layers} layers")
        if any(w < 0 for w in windows):
            raise ValueError(f"KvLayout.windows must be >= 0 (0 = no window), got {min(windows)}")
        object.__setattr__(self, "windows", windows if any(windows) else ())
        if self.latent and self.n_kv_heads != 1:
            raise ValueError(f"KvLayout: a latent cache is one unit (n_kv_heads=1), got {self.n_kv_heads}")
        for f in ("n_layers", "n_kv_heads", "head_dim", "elem_bytes", "page_tokens", "n_pages"):
            if getattr(self, f) < 1:
                raise ValueError(f"KvLayout.{f} must be >= 1, got {getattr(self, f)}")
        if self.order not in ("HND", "NHD"):
            raise ValueError(f"KvLayout.order must be 'HND' or 'NHD', got {self.order!r}")
        if not self.shards:
            raise ValueError("KvLayout.shards is empty")
        held: set[int] = set()
        for r, s in enumerate(self.shards):
            if not s:
                raise ValueError(f"KvLayout: rank {r} holds no heads")
            if len(set(s)) != len(s):
                raise ValueError(f"KvLayout: rank {r} lists a head twice: {s}")
            bad = [h for h in s if not 0 <= h < self.n_kv_heads]
            if bad:
                raise ValueError(f"KvLayout: rank {r} holds head {bad[0]}, outside 0..{self.n_kv_heads - 1}")
            held.update(s)
        missing = sorted(set(range(self.n_kv_heads)) - held)
        if missing:
            raise ValueError(f"KvLayout: head {missing[0]} is held by no rank")

    # --- construction -----------------------------------------------------------------------------------------

    @classmethod
    def tp_sharded(cls, n_layers: int, n_kv_heads: int, head_dim: int, elem_bytes: int, page_tokens: int,
                   tp: int, n_pages: int, order: Order = "HND") -> KvLayout:
        """A TP group of ``tp`` ranks: contiguous head blocks, or heads replicated when ``tp > n_kv_heads``
        (``tp = 1`` is a DP rank holding all heads)."""
        return cls(n_layers, n_kv_heads, head_dim, elem_bytes, page_tokens, tp_kv_head_shards(n_kv_heads, tp),
                   n_pages, order)

    @classmethod
    def for_attention(cls, attention, n_layers: int, elem_bytes: int, page_tokens: int, tp: int, n_pages: int,
                      order: Order = "HND") -> KvLayout:
        """The layout of ``n_layers`` layers of one token-mixer kind over a TP group of ``tp`` ranks: a
        head-sharded kind (``GqaAttention``; ``SlidingWindowAttention`` with its window on every layer) holds its
        KV heads as ``kv_shards(tp)`` places them; MLA holds its latent plane on every rank."""
        if attention.kv_tp_sharding == "replicated":
            return cls(n_layers, 1, attention.kv_values_per_token(), elem_bytes, page_tokens,
                       attention.kv_shards(tp), n_pages, "HND", latent=True)
        if attention.kv_tp_sharding != "heads":
            raise ValueError(f"attention kind {attention.kind!r} keeps no per-token KV cache")
        return cls(n_layers, attention.n_kv_units(), attention.head_dim, elem_bytes, page_tokens,
                   attention.kv_shards(tp), n_pages, order, windows=(kv_window(attention),) * n_layers)

    @classmethod
    def for_model(cls, model, tp: int, elem_bytes: int, page_tokens: int, n_pages: int, order: Order = "HND",
                  include_mtp: bool = True) -> KvLayout:
        """One buffer for every layer of ``model`` with a per-token cache, in model order (layout layer ``l`` is
        the ``l``-th such layer; MTP layers last): full and sliding layers share it (sliding ones carry their
        window), DeltaNet layers have none. Raises ``ValueError`` when those layers' caches differ in shape
        (heads, head_dim, latent)."""
        kinds = [layer.attention for layer in model.layers]
        if include_mtp:
            kinds += [model.mtp_layer.attention] * model.n_mtp_layers
        kinds = [a for a in kinds if a.kv_values_per_token()]
        if not kinds:
            raise ValueError(f"{model.name} keeps no per-token KV cache")
        one = [cls.for_attention(a, 1, elem_bytes, page_tokens, tp, n_pages, order) for a in kinds]
        shape = {(x.n_kv_heads, x.head_dim, x.shards, x.latent) for x in one}
        if len(shape) > 1:
            raise ValueError(f"{model.name}: layers with differently shaped KV caches need one layout per kind")
        return replace(one[0], n_layers=len(one), windows=tuple(x.windows[0] if x.windows else 0 for x in one))

    @classmethod
    def for_plan(cls, plan, model, n_pages: int, order: Order = "HND") -> KvLayout:
        """The layout of one DP group of a ``ParallelPlan`` (rank r = TP rank r, GPU ``plan.gpus[g*tp + r]``):
        every layer with a per-token cache, MTP included (``for_model``)."""
        return cls.for_model(model, plan.tp, KV_DTYPE_BYTES[plan.kv_dtype], plan.page_tokens, n_pages, order)

    def with_order(self, order: Order) -> KvLayout:
        return replace(self, order=order)

    def with_pages(self, n_pages: int) -> KvLayout:
        return replace(self, n_pages=n_pages)

    # --- sizes ------------------------------------------------------------------------------------------------

    @property
    def n_ranks(self) -> int:
        return len(self.shards)

    @property
    def n_planes(self) -> int:
        """Planes per page and head: 2 (K and V), 1 for the latent."""
        return 1 if self.latent else 2

    def first_token(self, layer: int, seq_len: int) -> int:
        """First token of a ``seq_len``-token sequence that ``layer`` keeps (its window's start; 0 without)."""
        w = self.windows[layer] if self.windows else 0
        return max(0, seq_len - w) if w else 0

    def page_bytes(self, rank: int) -> int:
        """Bytes of one page of one layer on ``rank`` (K and V, all its heads; or the latent)."""
        return self.n_planes * len(self.shards[rank]) * self.page_tokens * self.head_dim * self.elem_bytes

    def rank_nbytes(self, rank: int) -> int:
        """Size of ``rank``'s whole cache buffer."""
        return self.n_layers * self.n_pages * self.page_bytes(rank)

    def replicas(self, head: int) -> tuple[int, ...]:
        """Ranks holding ``head``, ascending."""
        return tuple(r for r, s in enumerate(self.shards) if head in s)

    @functools.cached_property
    def _local(self) -> np.ndarray:
        """[n_ranks, H] local index of each head on each rank, -1 where absent."""
        t = np.full((self.n_ranks, self.n_kv_heads), -1, dtype=np.int64)
        for r, s in enumerate(self.shards):
            t[r, list(s)] = np.arange(len(s))
        return t

    @functools.cached_property
    def _heads_per_rank(self) -> np.ndarray:
        return np.array([len(s) for s in self.shards], dtype=np.int64)

    # --- addressing -------------------------------------------------------------------------------------------

    def offset(self, rank, layer, head, token, kv, dim, pages) -> np.ndarray:
        """Byte offset inside ``rank``'s buffer of element (layer, global head, token, kv 0=K/1=V, dim); a latent
        layout has head 0 and kv 0 only.

        ``pages``: the page table, either a 1-D array (the same for every rank) or a sequence indexed by rank.
        All index arguments broadcast (numpy); ``rank`` may vary elementwise only with a per-rank page table.
        Raises ``ValueError`` if a rank does not hold a head or a page id is out of range.
        """
        rank, layer, head, token, kv, dim = np.broadcast_arrays(*(np.asarray(a, dtype=np.int64) for a in
                                                                  (rank, layer, head, token, kv, dim)))
        if (rank < 0).any() or (rank >= self.n_ranks).any() or (head < 0).any() or (head >= self.n_kv_heads).any():
            raise ValueError(f"rank must be in 0..{self.n_ranks - 1} and head in 0..{self.n_kv_heads - 1}")
        if (kv < 0).any() or (kv >= self.n_planes).any():
            raise ValueError(f"kv must be in 0..{self.n_planes - 1}")
        local = self._local[rank, head]
        if (local < 0).any():
            i = np.argmax(local < 0)
            raise ValueError(f"rank {rank.flat[i]} does not hold head {head.flat[i]}")
        P = self.page_tokens
        table = _page_table(pages, self.n_ranks)
        idx = token // P
        if (token < 0).any() or (idx >= table.shape[1]).any():
            raise ValueError("token outside the page table")
        page = table[rank, idx]
        if (page < 0).any() or (page >= self.n_pages).any():
            raise ValueError(f"page id outside 0..{self.n_pages - 1}")
        hr = self._heads_per_rank[rank]
        slot = token % P
        base = (layer * self.n_pages + page) * self.n_planes + kv
        if self.order == "HND":
            elem = ((base * hr + local) * P + slot) * self.head_dim + dim
        else:
            elem = ((base * P + slot) * hr + local) * self.head_dim + dim
        return elem * self.elem_bytes


def _page_table(pages, n_ranks: int) -> np.ndarray:
    """[n_ranks, max_pages] int64 page table (-1 padded) from a 1-D table or one table per rank."""
    if isinstance(pages, np.ndarray) and pages.ndim == 2:
        return pages.astype(np.int64, copy=False)
    one_table = (isinstance(pages, np.ndarray) and pages.ndim == 1) or len(pages) == 0 or np.isscalar(pages[0])
    if one_table:
        row = np.asarray(pages, dtype=np.int64)
        return np.broadcast_to(row, (n_ranks, row.shape[0]))
    if len(pages) != n_ranks:
        raise ValueError(f"expected one page table per rank ({n_ranks}), got {len(pages)}")
    width = max(len(p) for p in pages)
    t = np.full((n_ranks, width), -1, dtype=np.int64)
    for r, p in enumerate(pages):
        t[r, :len(p)] = np.asarray(p, dtype=np.int64)
    return t


# ----------------------------------------------------------------------------------------------------------------
# Transfer plans
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Chunk:
    """Copy ``nbytes`` from ``src_offset`` of source rank ``src_rank``'s buffer to ``dst_offset`` of destination
    rank ``dst_rank``'s buffer (layout-local ranks, byte offsets)."""

    src_rank: int
    src_offset: int
    dst_rank: int
    dst_offset: int
    nbytes: int


@dataclass(frozen=True, eq=False)
class TransferPlan:
    """A list of chunks held as parallel int64 arrays (sorted by src_rank, dst_rank, src_offset).

    Iterating yields ``Chunk`` objects; ``len`` is the chunk count.
    """

    src_rank: np.ndarray
    src_offset: np.ndarray
    dst_rank: np.ndarray
    dst_offset: np.ndarray
    nbytes: np.ndarray

    def __len__(self) -> int:
        return int(self.nbytes.shape[0])

    def __iter__(self) -> Iterator[Chunk]:
        for row in zip(self.src_rank.tolist(), self.src_offset.tolist(), self.dst_rank.tolist(),
                       self.dst_offset.tolist(), self.nbytes.tolist()):
            yield Chunk(*row)

    def chunks(self) -> list[Chunk]:
        return list(self)

    @property
    def total_bytes(self) -> int:
        return int(self.nbytes.sum())

    @classmethod
    def from_chunks(cls, chunks: Sequence[Chunk]) -> TransferPlan:
        cols = np.array([(c.src_rank, c.src_offset, c.dst_rank, c.dst_offset, c.nbytes) for c in chunks],
                        dtype=np.int64).reshape(-1, 5)
        return cls(*(cols[:, i].copy() for i in range(5)))


def merge_chunks(src_rank, src_offset, dst_rank, dst_offset, nbytes) -> TransferPlan:
    """Sort chunks by (src_rank, dst_rank, src_offset) and merge neighbours that are contiguous on both sides.

    Within one (src, dst) pair the source ranges must be disjoint (each destination byte has one source), so
    after sorting a chunk's only possible merge partner is the next one.
    """
    src_rank, src_offset, dst_rank, dst_offset, nbytes = (np.asarray(a, dtype=np.int64).ravel() for a in
                                                          (src_rank, src_offset, dst_rank, dst_offset, nbytes))
    if src_rank.size == 0:
        return TransferPlan(*(np.zeros(0, dtype=np.int64) for _ in range(5)))
    o = np.lexsort((src_offset, dst_rank, src_rank))
    sr, so, dr, do, n = src_rank[o], src_offset[o], dst_rank[o], dst_offset[o], nbytes[o]
    cont = np.zeros(sr.shape[0], dtype=bool)
    cont[1:] = ((sr[1:] == sr[:-1]) & (dr[1:] == dr[:-1])
                & (so[1:] == so[:-1] + n[:-1]) & (do[1:] == do[:-1] + n[:-1]))
    starts = np.flatnonzero(~cont)
    return TransferPlan(sr[starts], so[starts], dr[starts], do[starts], np.add.reduceat(n, starts))


def _token_runs(t0: int, seq_len: int, src: KvLayout, dst: KvLayout) -> tuple[np.ndarray, np.ndarray]:
    """Starts and lengths of the runs of tokens ``t0 .. seq_len-1`` that are contiguous in both layouts: split at
    every source and destination page boundary (HND, latent), or single tokens when either side is NHD."""
    if not src.latent and (src.order == "NHD" or dst.order == "NHD"):
        starts = np.arange(t0, seq_len, dtype=np.int64)
        return starts, np.ones(seq_len - t0, dtype=np.int64)
    cuts = np.union1d(np.arange(0, seq_len, src.page_tokens), np.arange(0, seq_len, dst.page_tokens))
    if t0:
        cuts = np.union1d(cuts[cuts > t0], [t0])
    lens = np.diff(np.append(cuts, seq_len))
    return cuts.astype(np.int64), lens.astype(np.int64)


@functools.lru_cache(maxsize=256)
def _source_ranks(src: KvLayout) -> np.ndarray:
    """[H, L] source rank read for (head, layer): replica ``(head + layer) % n_replicas`` of the head."""
    t = np.empty((src.n_kv_heads, src.n_layers), dtype=np.int64)
    for h in range(src.n_kv_heads):
        reps = np.asarray(src.replicas(h), dtype=np.int64)
        t[h] = reps[(h + np.arange(src.n_layers)) % reps.shape[0]]
    return t


def source_rank(src: KvLayout, head: int, layer) -> np.ndarray:
    """The source rank read for ``head`` at ``layer`` (array-valued): replica ``(head + layer) % n_replicas``."""
    return _source_ranks(src)[head, np.asarray(layer, dtype=np.int64)]


def latent_source_ranks(src: KvLayout, n_copies: int, seq_len: int) -> np.ndarray:
    """[n_copies, L, n_src_pages] source rank each destination copy reads a (layer, source page) of a latent
    sequence from, -1 for pages before the layer's window: unit ``u`` (numbered copy-major, then layer, then
    page) comes from replica ``replicas[u % n_replicas]`` (module docstring)."""
    if not src.latent:
        raise ValueError("latent_source_ranks: the layout is not a latent (MLA) cache")
    ns = pages_needed(seq_len, src.page_tokens)
    first = np.array([src.first_token(layer, seq_len) // src.page_tokens for layer in range(src.n_layers)],
                     dtype=np.int64)
    page = np.arange(ns, dtype=np.int64)[None, :]
    live = page >= first[:, None]  # [L, ns]
    unit = np.cumsum(live.ravel()).reshape(live.shape) - 1  # per copy: 0 .. U1-1 over live (layer, page)
    u1 = int(live.sum())
    reps = np.asarray(src.replicas(0), dtype=np.int64)
    u = np.arange(n_copies, dtype=np.int64)[:, None, None] * u1 + unit[None]
    return np.where(live[None], reps[u % reps.shape[0]], -1)


def _check_pages(name: str, layout: KvLayout, table: np.ndarray, need: int, first: int = 0) -> None:
    """Pages ``first .. need-1`` of the sequence must be valid, distinct page ids on every rank (earlier pages
    are outside every window and ignored)."""
    if table.shape[1] < need:
        raise ValueError(f"{name}: page table has {table.shape[1]} pages, the sequence needs {need}")
    t = table[:, first:need]
    if (t < 0).any() or (t >= layout.n_pages).any():
        raise ValueError(f"{name}: page ids must be in 0..{layout.n_pages - 1}")
    for r in range(t.shape[0]):
        if len(set(t[r].tolist())) != need - first:  # (np.unique would import numpy.ma on first use)
            raise ValueError(f"{name}: rank {r} uses a page twice")


def reshard_plan(src: KvLayout, dst: KvLayout, seq_len: int, src_pages=None, dst_pages=None,
                 merge: bool = True) -> TransferPlan:
    """Chunks that move one sequence's KV from layout ``src`` to layout ``dst``.

    src_pages / dst_pages: page table(s) of the sequence — a 1-D list shared by all ranks of the layout, or one
    list per rank; None = pages 0, 1, 2, ... on every rank. ``merge=False`` returns the elementary chunks
    (for tests and stats). Layouts must agree on n_layers, n_kv_heads, head_dim, elem_bytes, latent and windows.
    Sliding-window layers move only their window's tokens; a latent source is read page-interleaved over its
    replicas (module docstring).
    """
    for f in ("n_layers", "n_kv_heads", "head_dim", "elem_bytes", "latent", "windows"):
        if getattr(src, f) != getattr(dst, f):
            raise ValueError(f"reshard: src.{f}={getattr(src, f)} differs from dst.{f}={getattr(dst, f)}")
    if seq_len < 1:
        raise ValueError(f"reshard: seq_len must be >= 1, got {seq_len}")
    ns, nd = pages_needed(seq_len, src.page_tokens), pages_needed(seq_len, dst.page_tokens)
    st = _page_table(np.arange(ns) if src_pages is None else src_pages, src.n_ranks)
    dt = _page_table(np.arange(nd) if dst_pages is None else dst_pages, dst.n_ranks)
    starts = np.array([src.first_token(layer, seq_len) for layer in range(src.n_layers)], dtype=np.int64)
    t_min = int(starts.min())
    _check_pages("src_pages", src, st, ns, t_min // src.page_tokens)
    _check_pages("dst_pages", dst, dt, nd, t_min // dst.page_tokens)

    D, e = src.head_dim, src.elem_bytes
    pairs = [(d, h) for d in range(dst.n_ranks) for h in dst.shards[d]]  # every destination head copy
    d_rank = np.array([p[0] for p in pairs], dtype=np.int64)[:, None, None, None]  # [C,1,1,1]
    head = np.array([p[1] for p in pairs], dtype=np.int64)[:, None, None, None]
    kv = np.arange(src.n_planes, dtype=np.int64)[None, None, :, None]  # [1,1,planes,1]
    latent_ranks = latent_source_ranks(src, len(pairs), seq_len) if src.latent else None
    parts = []
    for t0 in np.unique(starts).tolist():  # layers whose kept tokens start at t0 (full layers: 0)
        layers = np.flatnonzero(starts == t0)
        run_start, run_len = _token_runs(t0, seq_len, src, dst)  # [R]
        layer = layers[None, :, None, None]  # [1,Lg,1,1]
        tok = run_start[None, None, None, :]  # [1,1,1,R]
        if latent_ranks is None:
            s_rank = _source_ranks(src)[head, layer]  # [C,Lg,1,1]
        else:
            copy = np.arange(len(pairs), dtype=np.int64)[:, None, None, None]
            s_rank = latent_ranks[copy, layer, tok // src.page_tokens]  # [C,Lg,1,R]
        so = src.offset(s_rank, layer, head, tok, kv, 0, st)  # [C,Lg,planes,R]
        do = dst.offset(d_rank, layer, head, tok, kv, 0, dt)
        shape = so.shape
        parts.append([np.broadcast_to(s_rank, shape), so, np.broadcast_to(d_rank, shape), do,
                      np.broadcast_to(run_len * D * e, shape)])
    cols = [np.concatenate([np.ascontiguousarray(p[i]).ravel() for p in parts]) for i in range(5)]
    if merge:
        return merge_chunks(*cols)
    return TransferPlan(*cols)


@functools.lru_cache(maxsize=4096)
def transfer_stats(src: KvLayout, dst: KvLayout, seq_len: int) -> ChunkStats:
    """``chunk_stats`` of resharding one ``seq_len``-token sequence, cached by (layouts, seq_len).

    Pages are assumed fragmented (page i of the sequence at id 2*i on every rank, so no two pages are adjacent),
    as in a long-running server's page pool; this is the worst case for chunk counts. Callers bucket seq_len.
    """
    ns, nd = pages_needed(seq_len, src.page_tokens), pages_needed(seq_len, dst.page_tokens)
    s2, d2 = src.with_pages(2 * ns), dst.with_pages(2 * nd)
    return chunk_stats(reshard_plan(s2, d2, seq_len, np.arange(ns) * 2, np.arange(nd) * 2))


@dataclass(frozen=True)
class ChunkStats:
    """Summary of a transfer plan for cost models.

    n_chunks, total_bytes; bytes_by_pair / chunks_by_pair: {(src_rank, dst_rank): ...}; bytes_by_src /
    bytes_by_dst: {rank: bytes}; max_chunk_bytes, min_chunk_bytes.
    """

    n_chunks: int
    total_bytes: int
    bytes_by_pair: dict
    chunks_by_pair: dict
    bytes_by_src: dict
    bytes_by_dst: dict
    max_chunk_bytes: int
    min_chunk_bytes: int

    @property
    def mean_chunk_bytes(self) -> float:
        return self.total_bytes / self.n_chunks if self.n_chunks else 0.0


def chunk_stats(plan: TransferPlan) -> ChunkStats:
    """Count, bytes, and per (src, dst) / per-rank bytes of a plan."""
    pairs: dict = {}
    counts: dict = {}
    if len(plan):
        key = np.stack([plan.src_rank, plan.dst_rank], axis=1)
        uniq, inv = np.unique(key, axis=0, return_inverse=True)
        inv = inv.ravel()
        b = np.bincount(inv, weights=plan.nbytes, minlength=uniq.shape[0])
        c = np.bincount(inv, minlength=uniq.shape[0])
        for (s, d), nb, nc in zip(uniq.tolist(), b.tolist(), c.tolist()):
            pairs[(s, d)] = int(nb)
            counts[(s, d)] = int(nc)
    by_src: dict = {}
    by_dst: dict = {}
    for (s, d), nb in pairs.items():
        by_src[s] = by_src.get(s, 0) + nb
        by_dst[d] = by_dst.get(d, 0) + nb
    return ChunkStats(
        n_chunks=len(plan), total_bytes=plan.total_bytes, bytes_by_pair=pairs, chunks_by_pair=counts,
        bytes_by_src=by_src, bytes_by_dst=by_dst,
        max_chunk_bytes=int(plan.nbytes.max()) if len(plan) else 0,
        min_chunk_bytes=int(plan.nbytes.min()) if len(plan) else 0,
    )


def execute_plan(plan: TransferPlan, src_buffers: Sequence[np.ndarray],
                 dst_buffers: Sequence[np.ndarray]) -> Sequence[np.ndarray]:
    """Reference executor: copy every chunk between 1-D uint8 buffers (caller-allocated ``dst_buffers``, written
    in place and returned). Raises ``ValueError`` on a chunk outside a buffer."""
    for sr, so, dr, do, n in zip(plan.src_rank.tolist(), plan.src_offset.tolist(), plan.dst_rank.tolist(),
                                 plan.dst_offset.tolist(), plan.nbytes.tolist()):
        s, d = src_buffers[sr], dst_buffers[dr]
        if n < 0 or so < 0 or do < 0 or so + n > s.shape[0] or do + n > d.shape[0]:
            raise ValueError(f"chunk {Chunk(sr, so, dr, do, n)} is outside the buffers")
        d[do:do + n] = s[so:so + n]
    return dst_buffers


def hnd_vs_nhd(src: KvLayout, dst: KvLayout, seq_len: int, src_pages=None, dst_pages=None) -> tuple[int, int]:
    """Chunk counts of the same transfer in HND and in NHD (both layouts switched)."""
    h = reshard_plan(src.with_order("HND"), dst.with_order("HND"), seq_len, src_pages, dst_pages)
    n = reshard_plan(src.with_order("NHD"), dst.with_order("NHD"), seq_len, src_pages, dst_pages)
    return len(h), len(n)


__all__ = [
    "Chunk",
    "ChunkStats",
    "KvLayout",
    "TransferPlan",
    "chunk_stats",
    "execute_plan",
    "hnd_vs_nhd",
    "latent_source_ranks",
    "merge_chunks",
    "pages_needed",
    "reshard_plan",
    "source_rank",
    "transfer_stats",
]
