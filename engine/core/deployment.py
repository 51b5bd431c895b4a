"""The serving side of a scenario as pure data: prefiller groups, decoder groups, their GPUs, NICs and capacities.

A :class:`Deployment` is what the scheduler serves with. It carries no behaviour beyond validation and a builder
(:func:`place`) that lays groups out on a topology:

- a **prefiller group** is ``tp × ep`` GPUs in one node (the write-up: TP=4/EP=4 in one GB200 tray); it prefills a
  batch of prompts per step within ``max_batch_tokens``, keeps their KV (at most ``kv_capacity_tokens``) until it
  has been shipped, and ships it over the node's NICs with ``kv_streams`` concurrent transfers;
- a **decoder group** is one DP-EP deployment of ``ep`` GPUs: ``ep / tp`` DP attention ranks of ``tp`` GPUs each
  (attention TP inside a rank, ``tp = 1`` by default: one GPU per rank), each with its own batch
  (``max_batch_per_rank``) and KV cache (``kv_capacity_tokens_per_rank`` tokens, allocated in pages of
  ``kv_page_tokens``); KV arrives at a rank through the NIC of its first GPU; the experts span all ``ep`` GPUs;
- ``spare_gpus`` is the pool the autoscaler may grow into, using ``prefiller_template`` / ``decoder_template``;
- an **aggregated worker** (a deployment of kind aggregated, instead of prefillers and decoders) is ``tp × dp``
  GPUs of one NVLink domain that prefill and decode together: ``dp`` ranks (DP attention, each with its own batch
  and KV cache; ``tp`` GPUs each) share the experts (EP over the worker's GPUs); every step runs the ranks' decode
  batches plus prefill chunks up to a per-rank token budget, and KV never leaves the rank that prefilled it;
- a prefiller or decoder whose template says ``span_nodes`` (wide EP across nodes: DeepSeek-V3 served over many
  8-GPU nodes) takes whole NVLink domains instead, ``n_gpus / domain size`` of them, the lowest wholly free ones
  (:func:`place_spanning`); each GPU keeps its own NIC (``gpu_nic``), which carries its share of the EP
  all-to-all and, for a decoder rank, the rank's KV.

GPU ids are the topology's global ints; NIC ids its strings (``"nic:<k>"``). ``gpu_host``, ``gpu_nic``,
``gpu_domain`` (NVLink domain index) and ``nic_GBps`` (per direction, 1e9 B/s) are the slice of the topology
the scheduler and network model need, copied so that ``engine.core`` stays free of graph lookups in hot paths.
"""

from __future__ import annotations

import bisect
from collections import Counter
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Protocol

from rackbed.topology.errors import UserError


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise UserError(msg)


@dataclass(frozen=True)
class PrefillerTemplate:
    """Shape of one prefiller group (also used by the autoscaler to create new ones).

    max_batch_tokens:   token budget of one prefill batch.
    kv_capacity_tokens: prompt KV the group can hold while it waits to be shipped (tokens).
    max_queue_requests: queued requests beyond which new arrivals are not routed here (None = unbounded).
    kv_streams:         concurrent KV transfers out of the node (each a worker ``P<i>.kv<j>``).
    span_nodes:         the group takes whole NVLink domains (nodes) and may span several (module docstring).
    """

    tp: int = 4
    ep: int = 4
    max_batch_tokens: int = 16384
    kv_capacity_tokens: int = 1_000_000
    max_queue_requests: int | None = None
    kv_streams: int = 1
    span_nodes: bool = False

    @property
    def n_gpus(self) -> int:
        """GPUs of the group: attention TP and expert EP span the same GPUs (TP=4/EP=4 is 4 GPUs)."""
        return max(self.tp, self.ep)

    def __post_init__(self) -> None:
        for name in ("tp", "ep", "max_batch_tokens", "kv_capacity_tokens", "kv_streams"):
            _need(getattr(self, name) >= 1, f"prefiller.{name}: must be >= 1, got {getattr(self, name)}")
        _need(self.max_queue_requests is None or self.max_queue_requests >= 1,
              f"prefiller.max_queue_requests: must be >= 1 or null, got {self.max_queue_requests}")


@dataclass(frozen=True)
class DecoderTemplate:
    """Shape of one decoder group: ``ep`` GPUs forming ``ep / tp`` DP ranks of ``tp`` GPUs each (attention TP
    inside a rank), with a batch cap and a KV capacity per rank (``kv_capacity_tokens_per_rank``: tokens of the
    whole sequence, every KV head, that the rank's TP group holds together). ``span_nodes``: the group takes whole
    NVLink domains (nodes) and may span several (module docstring)."""

    ep: int = 16
    max_batch_per_rank: int = 64
    kv_capacity_tokens_per_rank: int = 400_000
    kv_page_tokens: int = 1
    tp: int = 1
    span_nodes: bool = False

    @property
    def n_gpus(self) -> int:
        return self.ep

    @property
    def ranks(self) -> int:
        """DP ranks of a group (each its own batch and KV cache)."""
        return self.ep // self.tp

    def __post_init__(self) -> None:
        for name in ("ep", "max_batch_per_rank", "kv_capacity_tokens_per_rank", "kv_page_tokens", "tp"):
            _need(getattr(self, name) >= 1, f"decoder.{name}: must be >= 1, got {getattr(self, name)}")
        _need(self.ep % self.tp == 0, f"decoder.tp: {self.tp} does not divide the group's ep = {self.ep} GPUs")

    def rank_nics(self, gpus, gpu_nic) -> tuple[str, ...]:
        """The NIC each DP rank receives KV through: that of the rank's first GPU."""
        return tuple(gpu_nic[g] for g in gpus[::self.tp])


@dataclass(frozen=True)
class AggregatedTemplate:
    """Shape of one aggregated worker (prefill and decode on the same GPUs, mixed steps).

    tp, dp, ep:                  attention TP within a rank, DP attention ranks, expert parallelism over the
                                 worker's ``tp * dp`` GPUs (the cost models cover ``tp == 1`` or ``dp == 1``).
    max_batch_per_rank:          sequences a rank holds at once, prefilling or decoding (``max_num_seqs``).
    max_batch_tokens:            a rank's token budget per step (``max_num_batched_tokens``): its decode tokens
                                 (``1 + draft_k`` per sequence) first, prefill chunks in the rest.
    chunk_tokens:                most prompt tokens of one request per step; None: no chunked prefill (a prompt
                                 is prefilled whole in one step, alone if it exceeds the room left).
    kv_capacity_tokens_per_rank: KV tokens a rank holds (pages of ``kv_page_tokens``).
    max_queue_requests:          queued requests beyond which new arrivals are not routed here (None = unbounded).
    """

    tp: int = 1
    dp: int = 8
    ep: int = 8
    max_batch_per_rank: int = 64
    max_batch_tokens: int = 8192
    chunk_tokens: int | None = 2048
    kv_capacity_tokens_per_rank: int = 400_000
    kv_page_tokens: int = 1
    max_queue_requests: int | None = None

    @property
    def n_gpus(self) -> int:
        return self.tp * self.dp

    def __post_init__(self) -> None:
        for name in ("tp", "dp", "ep", "max_batch_per_rank", "max_batch_tokens", "kv_capacity_tokens_per_rank",
                     "kv_page_tokens"):
            _need(getattr(self, name) >= 1, f"aggregated.{name}: must be >= 1, got {getattr(self, name)}")
        _need(self.chunk_tokens is None or self.chunk_tokens >= 1,
              f"aggregated.chunk_tokens: must be >= 1 or null, got {self.chunk_tokens}")
        _need(self.max_queue_requests is None or self.max_queue_requests >= 1,
              f"aggregated.max_queue_requests: must be >= 1 or null, got {self.max_queue_requests}")
        _need(self.n_gpus % self.ep == 0, f"aggregated.ep: {self.ep} does not divide the worker's "
                                          f"tp*dp = {self.n_gpus} GPUs")


@dataclass(frozen=True)
class AggregatedGroup:
    """One placed aggregated worker: DP rank ``r`` is GPUs ``gpus[r*tp:(r+1)*tp]``."""

    id: str
    gpus: tuple[int, ...]
    template: AggregatedTemplate = field(default_factory=AggregatedTemplate)

    def __post_init__(self) -> None:
        _need(len(self.gpus) == self.template.n_gpus,
              f"aggregated {self.id}: {len(self.gpus)} GPUs for tp*dp = {self.template.n_gpus}")
        _need(len(set(self.gpus)) == len(self.gpus), f"aggregated {self.id}: repeated GPU in {self.gpus}")

    @property
    def ranks(self) -> int:
        """DP ranks (each its own batch and KV cache)."""
        return self.template.dp


@dataclass(frozen=True)
class PrefillerGroup:
    """One placed prefiller group. ``gpus`` are in one node (``host``; with ``span_nodes`` whole nodes, ``host``
    the first); ``nics`` are its GPUs' NICs, used for KV."""

    id: str
    gpus: tuple[int, ...]
    host: int
    nics: tuple[str, ...]
    template: PrefillerTemplate = field(default_factory=PrefillerTemplate)

    def __post_init__(self) -> None:
        _need(len(self.gpus) >= 1, f"prefiller {self.id}: needs at least one GPU")
        _need(len(set(self.gpus)) == len(self.gpus), f"prefiller {self.id}: repeated GPU in {self.gpus}")
        _need(len(self.nics) >= 1, f"prefiller {self.id}: needs at least one NIC for KV transfer")


@dataclass(frozen=True)
class DecoderGroup:
    """One placed decoder group: DP rank ``r`` is GPUs ``gpus[r*tp:(r+1)*tp]`` (``tp = template.tp``; one GPU
    with the default ``tp = 1``) receiving KV through ``rank_nics[r]``."""

    id: str
    gpus: tuple[int, ...]
    rank_nics: tuple[str, ...]
    template: DecoderTemplate = field(default_factory=DecoderTemplate)

    def __post_init__(self) -> None:
        _need(len(self.gpus) >= 1, f"decoder {self.id}: needs at least one GPU")
        _need(len(set(self.gpus)) == len(self.gpus), f"decoder {self.id}: repeated GPU in {self.gpus}")
        _need(len(self.gpus) % self.template.tp == 0,
              f"decoder {self.id}: {len(self.gpus)} GPUs are not whole DP ranks of tp = {self.template.tp}")
        _need(len(self.rank_nics) == self.ranks,
              f"decoder {self.id}: rank_nics has {len(self.rank_nics)} entries for {self.ranks} ranks")

    @property
    def ep(self) -> int:
        return len(self.gpus)

    @property
    def ranks(self) -> int:
        """DP ranks (each its own batch and KV cache): ``ep / tp``."""
        return len(self.gpus) // self.template.tp


@dataclass(frozen=True)
class MtpSpec:
    """Speculative decoding: ``draft_k`` drafted tokens per step, each accepted with probability ``accept_p``
    given all earlier ones were (the write-up assumes 0.8), or — ``acceptance`` given — draft token ``i`` with
    probability ``acceptance[i-1]`` given all earlier ones were (:mod:`engine.core.specdec`). ``draft_k = 0``
    disables it. What drafts the tokens (MTP layers, a draft model) only matters to the cost model."""

    draft_k: int = 0
    accept_p: float = 0.8
    acceptance: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        _need(0 <= self.draft_k <= 16, f"mtp.draft_k: must be in [0, 16], got {self.draft_k}")
        _need(0.0 <= self.accept_p <= 1.0, f"mtp.accept_p: must be in [0, 1], got {self.accept_p}")
        if self.acceptance is not None:
            _need(len(self.acceptance) >= self.draft_k,
                  f"mtp.acceptance: {len(self.acceptance)} entries for draft_k = {self.draft_k}; "
                  "give one per draft token")
            _need(all(0.0 <= a <= 1.0 for a in self.acceptance), "mtp.acceptance: every entry must be in [0, 1]")

    def expected_tokens_per_step(self) -> float:
        """Mean tokens a sequence gains per decode step (:func:`engine.core.specdec.expected_tokens_per_step`)."""
        from rackbed.engine.core.specdec import expected_tokens_per_step

        return expected_tokens_per_step(self.draft_k, self.accept_p, self.acceptance)


@dataclass(frozen=True)
class Deployment:
    """Everything the scheduler needs to know about the serving system (see module docstring).

    kv_bytes_per_token: KV bytes a transfer moves per prompt token: every layer that keeps the whole sequence
                        (full attention; MLA's latent, once, from one replica) — ``kv_transfer_sizes``.
    kv_window_bytes:    ``(window, bytes per token)`` of the sliding-window layers: a transfer moves only their
                        latest ``min(tokens, window)`` tokens (``kv_transfer_bytes``); () without such layers.
    chunked_prefill:    split prompts across prefill batches to fill the token budget exactly.
    shed_ttft_s:        if set, reject at arrival a request whose estimated TTFT already exceeds this bound.
    """

    prefillers: tuple[PrefillerGroup, ...]
    decoders: tuple[DecoderGroup, ...]
    kv_bytes_per_token: int
    gpu_host: dict[int, int]
    gpu_nic: dict[int, str]
    nic_GBps: dict[str, float]
    gpu_domain: dict[int, int] = field(default_factory=dict)
    mtp: MtpSpec = field(default_factory=MtpSpec)
    chunked_prefill: bool = False
    shed_ttft_s: float | None = None
    spare_gpus: tuple[int, ...] = ()
    prefiller_template: PrefillerTemplate = field(default_factory=PrefillerTemplate)
    decoder_template: DecoderTemplate = field(default_factory=DecoderTemplate)
    name: str = "deployment"
    aggregated: tuple[AggregatedGroup, ...] = ()
    kv_window_bytes: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        _need(self.kv_bytes_per_token >= 1 or (self.kv_bytes_per_token == 0 and bool(self.kv_window_bytes)),
              f"kv_bytes_per_token: must be >= 1, got {self.kv_bytes_per_token}")
        _need(self.shed_ttft_s is None or self.shed_ttft_s > 0,
              f"shed_ttft_s: must be > 0 or null, got {self.shed_ttft_s}")
        _need(not (self.aggregated and (self.prefillers or self.decoders)),
              "deployment: aggregated workers cannot be combined with prefillers and decoders")
        _need(not (self.aggregated and self.spare_gpus), "deployment: aggregated workers have no spare pool")
        ids = [g.id for g in (*self.prefillers, *self.decoders, *self.aggregated)]
        _need(len(set(ids)) == len(ids), f"deployment: duplicate group id in {ids}")
        seen: dict[int, str] = {}
        for g in (*self.prefillers, *self.decoders, *self.aggregated):
            for gpu in g.gpus:
                _need(gpu not in seen, f"deployment: GPU {gpu} is in both {seen.get(gpu)} and {g.id}")
                seen[gpu] = g.id
                _need(gpu in self.gpu_host, f"deployment: GPU {gpu} of {g.id} has no gpu_host entry")
        for gpu in self.spare_gpus:
            _need(gpu not in seen, f"deployment.spare_gpus: GPU {gpu} is already used by {seen.get(gpu)}")
            _need(gpu in self.gpu_host, f"deployment.spare_gpus: GPU {gpu} has no gpu_host entry")
        for g in self.prefillers:
            for nic in g.nics:
                _need(nic in self.nic_GBps, f"prefiller {g.id}: NIC {nic} has no nic_GBps entry")
        for g in self.decoders:
            for nic in g.rank_nics:
                _need(nic in self.nic_GBps, f"decoder {g.id}: NIC {nic} has no nic_GBps entry")

    def kv_transfer_bytes(self, tokens: int) -> int:
        """Bytes of KV one ``tokens``-token prompt ships: the whole sequence of full / MLA layers, the latest
        ``min(tokens, window)`` tokens of sliding-window layers."""
        n = tokens * self.kv_bytes_per_token
        for w, b in self.kv_window_bytes:
            n += (min(w, tokens)) * b
        return n

    @property
    def n_gpus(self) -> int:
        """GPUs in use at the start plus the spare pool."""
        return sum(len(g.gpus) for g in (*self.prefillers, *self.decoders, *self.aggregated)) + len(self.spare_gpus)

    def host_nics(self, host: int) -> tuple[str, ...]:
        """The NICs of a host (those of its GPUs), sorted, deduplicated."""
        return tuple(sorted({self.gpu_nic[g] for g, h in self.gpu_host.items() if h == host and g in self.gpu_nic}))


class TopologyView(Protocol):
    """The part of ``topology.graph.Topology`` :func:`place` needs."""

    @property
    def gpu_ids(self) -> list[int]: ...

    def host_of(self, i: int) -> int: ...

    def nic_of_gpu(self, i: int) -> str: ...

    def nic_spec(self, nic_id: str): ...  # -> NicSpec with .GBps

    def nvlink_domain(self, i: int) -> frozenset[int]: ...


def with_kv_capacities(dep: Deployment, *, prefill_tokens: int, rank_tokens: int) -> Deployment:
    """``dep`` with every prefiller's KV capacity set to ``prefill_tokens`` and every decoder or aggregated
    rank's to ``rank_tokens`` (templates included, so workers made later have them too): what a real run's
    scheduler plans with (``engine.real.rank_setup.real_capacities``, recorded in its ``real.json``)."""
    import dataclasses

    def tpl(t, **kw):
        return dataclasses.replace(t, **kw)

    def grp(g, **kw):
        return dataclasses.replace(g, template=tpl(g.template, **kw))

    return dataclasses.replace(
        dep,
        prefillers=tuple(grp(g, kv_capacity_tokens=prefill_tokens) for g in dep.prefillers),
        decoders=tuple(grp(g, kv_capacity_tokens_per_rank=rank_tokens) for g in dep.decoders),
        aggregated=tuple(grp(g, kv_capacity_tokens_per_rank=rank_tokens) for g in dep.aggregated),
        prefiller_template=tpl(dep.prefiller_template, kv_capacity_tokens=prefill_tokens),
        decoder_template=tpl(dep.decoder_template, kv_capacity_tokens_per_rank=rank_tokens))


def kv_capacities(dep: Deployment) -> dict[str, int]:
    """``{"prefill_tokens", "rank_tokens"}``: the KV capacities :func:`with_kv_capacities` sets (a
    prefiller's, a decoder or aggregated rank's), read from ``dep``'s templates and groups."""
    ranks = [g.template for g in (*dep.decoders, *dep.aggregated)] or [dep.decoder_template]
    return {"prefill_tokens": dep.prefiller_template.kv_capacity_tokens,
            "rank_tokens": ranks[0].kv_capacity_tokens_per_rank}


def kv_transfer_sizes(model, elem_bytes: int) -> tuple[int, tuple[tuple[int, int], ...]]:
    """``(kv_bytes_per_token, kv_window_bytes)`` of a :class:`Deployment` for ``model`` (MTP layers excluded, as
    ``ModelSpec.kv_bytes_per_token``): the per-token bytes of the layers that keep the whole sequence, and
    ``(window, bytes per token)`` per sliding-window kind. For models without sliding layers the first is
    ``ModelSpec.kv_bytes_per_token(elem_bytes)``."""
    per_token, windows = 0, []
    for a, n in model.attention_counts():
        if not a.kv_values_per_token():
            continue
        w = int(getattr(a, "window", 0) or 0)
        if w:
            windows.append((w, int(n * a.kv_bytes_per_token(elem_bytes))))
        else:
            per_token += n * a.kv_bytes_per_token(elem_bytes)
    return int(per_token), tuple(windows)


def place(
    topo: TopologyView,
    *,
    n_prefillers: int,
    n_decoders: int,
    kv_bytes_per_token: int,
    kv_window_bytes: tuple[tuple[int, int], ...] = (),
    prefiller: PrefillerTemplate | None = None,
    decoder: DecoderTemplate | None = None,
    mtp: MtpSpec | None = None,
    chunked_prefill: bool = False,
    shed_ttft_s: float | None = None,
    spare: str = "rest",
    name: str = "deployment",
    prefill_gpus: Collection[int] | None = None,
    decode_gpus: Collection[int] | None = None,
) -> Deployment:
    """Lay out ``n_prefillers`` and ``n_decoders`` groups on ``topo`` and return the :class:`Deployment`.
    ``prefill_gpus`` / ``decode_gpus``: the GPUs a role's groups may use (whole NVLink domains of them: a pool
    of one GPU kind in a joined topology); None: any.

    Two packings, the first that places every group wins:

    1. *in order*: prefillers take whole hosts first (lowest host index first, each group's GPUs on one host);
       decoders then take the lowest free GPUs of one NVLink domain each. A layout that fits so keeps it.
    2. *widest first* (:func:`_pack`), when the in-order packing fragments the NVLink domains (many racks, the
       prefillers spread over every one of them before the decoders come): the widest groups (the decoders, as
       a rule) go first, each into the fullest domain that still holds it, then the narrower ones into the
       fullest node that holds them, preferring the domains that already hold groups of the other role
       (prefillers beside the decoders they feed) and else the nearest ones. With group widths that divide one
       another (powers of two) it places every layout that fits at all.

    ``spare="rest"`` puts every GPU left into the spare pool, ``spare="none"`` leaves it out. Raises a
    one-line ``UserError`` naming the group that does not fit and the smallest change that fits (fewer groups,
    narrower groups, another NVLink domain). Templates with ``span_nodes`` are laid out by :func:`place_spanning`.
    """
    ptpl = prefiller or PrefillerTemplate()
    dtpl = decoder or DecoderTemplate()
    if ptpl.span_nodes or dtpl.span_nodes:
        if prefill_gpus is not None or decode_gpus is not None:
            raise UserError("deployment: span_nodes groups take any whole NVLink domains; not with prefill.gpu / "
                            "decode.gpu pools")
        return place_spanning(topo, n_prefillers=n_prefillers, n_decoders=n_decoders,
                              kv_bytes_per_token=kv_bytes_per_token, kv_window_bytes=kv_window_bytes, prefiller=ptpl,
                              decoder=dtpl, mtp=mtp, chunked_prefill=chunked_prefill, shed_ttft_s=shed_ttft_s,
                              spare=spare, name=name)
    if spare not in ("rest", "none"):
        raise UserError(f"deployment.spare: must be 'rest' or 'none', got {spare!r}")
    gpus, gpu_host, gpu_nic, nic_GBps, gpu_domain = _topology_slice(topo)
    ponly, donly = _domains_within(prefill_gpus, gpu_domain), _domains_within(decode_gpus, gpu_domain)
    wants = [_Want("prefiller", i, ptpl.n_gpus, "host", ponly) for i in range(n_prefillers)] + \
            [_Want("decoder", i, dtpl.ep, "domain", donly) for i in range(n_decoders)]
    in_order = _pack_in_order(gpus, gpu_host, gpu_domain, wants)
    got = in_order if in_order is not None else _pack(gpus, gpu_host, gpu_domain, wants)
    if isinstance(got, _Want):
        raise UserError(_no_fit(got, gpus, gpu_host, gpu_domain, wants,
                                f"n_prefillers={n_prefillers}, n_decoders={n_decoders}, {len(gpus)} GPUs",
                                narrower_ok=lambda w: w.role == "decoder" and w.width % dtpl.tp == 0))
    pgpus = sorted((got[w] for w in wants if w.role == "prefiller"), key=min)
    dgpus = sorted((got[w] for w in wants if w.role == "decoder"), key=min)
    used = {g for mine in got.values() for g in mine}
    pgroups = [PrefillerGroup(id=f"P{i}", gpus=mine, host=gpu_host[mine[0]],
                              nics=tuple(sorted({gpu_nic[g] for g in mine})), template=ptpl)
               for i, mine in enumerate(pgpus)]
    dgroups = [DecoderGroup(id=f"D{i}", gpus=mine, rank_nics=dtpl.rank_nics(mine, gpu_nic), template=dtpl)
               for i, mine in enumerate(dgpus)]
    return Deployment(
        prefillers=tuple(pgroups), decoders=tuple(dgroups), kv_bytes_per_token=int(kv_bytes_per_token),
        kv_window_bytes=tuple(kv_window_bytes),
        gpu_host=gpu_host, gpu_nic=gpu_nic, nic_GBps=nic_GBps, gpu_domain=gpu_domain, mtp=mtp or MtpSpec(),
        chunked_prefill=chunked_prefill, shed_ttft_s=shed_ttft_s,
        spare_gpus=tuple(g for g in gpus if g not in used) if spare == "rest" else (),
        prefiller_template=ptpl, decoder_template=dtpl, name=name)


def _domains_within(pool: Collection[int] | None, gpu_domain: dict[int, int]) -> frozenset[int] | None:
    """The NVLink domains all of whose GPUs are in ``pool`` (None: no restriction)."""
    if pool is None:
        return None
    pool = set(pool)
    return frozenset(d for d in set(gpu_domain.values())
                     if all(g in pool for g, e in gpu_domain.items() if e == d))


def place_spanning(topo: TopologyView, *, n_prefillers: int, n_decoders: int, kv_bytes_per_token: int,
                   kv_window_bytes: tuple[tuple[int, int], ...], prefiller: PrefillerTemplate,
                   decoder: DecoderTemplate, mtp: MtpSpec | None, chunked_prefill: bool, shed_ttft_s: float | None,
                   spare: str, name: str) -> Deployment:
    """:func:`place` for templates of which at least one has ``span_nodes``: prefillers first, then decoders; a
    spanning group takes whole NVLink domains (:func:`whole_domains`), any other the lowest free GPUs of one node
    (prefiller) or one NVLink domain (decoder), as :func:`place` does. A group's GPUs keep their own NICs."""
    gpus, gpu_host, gpu_nic, nic_GBps, gpu_domain = _topology_slice(topo)
    if spare not in ("rest", "none"):
        raise UserError(f"deployment.spare: must be 'rest' or 'none', got {spare!r}")
    free = list(gpus)
    pgroups, dgroups = [], []
    for i in range(n_prefillers):
        ctx = f"n_prefillers={n_prefillers}, {len(gpus)} GPUs"
        if prefiller.span_nodes:
            mine = whole_domains(free, gpu_domain, prefiller.n_gpus, f"prefiller {i}", ctx)
        else:
            mine = next((tuple(c[: prefiller.n_gpus]) for h in sorted(set(gpu_host.values()))
                         if len(c := [g for g in free if gpu_host[g] == h]) >= prefiller.n_gpus), ())
            _need(bool(mine), f"deployment: prefiller {i} needs {prefiller.n_gpus} free GPUs in one node; none "
                              f"left ({ctx})")
        free = [g for g in free if g not in mine]
        pgroups.append(PrefillerGroup(id=f"P{i}", gpus=mine, host=gpu_host[mine[0]],
                                      nics=tuple(sorted({gpu_nic[g] for g in mine})), template=prefiller))
    for i in range(n_decoders):
        pick = whole_domains if decoder.span_nodes else _in_one_domain
        mine = pick(free, gpu_domain, decoder.ep, f"decoder {i}", f"n_decoders={n_decoders}, {len(gpus)} GPUs")
        free = [g for g in free if g not in mine]
        dgroups.append(DecoderGroup(id=f"D{i}", gpus=mine, rank_nics=decoder.rank_nics(mine, gpu_nic),
                                    template=decoder))
    return Deployment(
        prefillers=tuple(pgroups), decoders=tuple(dgroups), kv_bytes_per_token=int(kv_bytes_per_token),
        kv_window_bytes=tuple(kv_window_bytes), gpu_host=gpu_host, gpu_nic=gpu_nic, nic_GBps=nic_GBps,
        gpu_domain=gpu_domain, mtp=mtp or MtpSpec(), chunked_prefill=chunked_prefill, shed_ttft_s=shed_ttft_s,
        spare_gpus=tuple(free) if spare == "rest" else (), prefiller_template=prefiller, decoder_template=decoder,
        name=name)


def _in_one_domain(free: list[int], gpu_domain: dict[int, int], n: int, what: str, ctx: str) -> tuple[int, ...]:
    """The lowest ``n`` free GPUs of the first NVLink domain that has that many; a one-line UserError if none."""
    for d in sorted(set(gpu_domain.values())):
        cand = [g for g in free if gpu_domain[g] == d]
        if len(cand) >= n:
            return tuple(cand[:n])
    raise UserError(f"deployment: {what} needs {n} free GPUs in one NVLink domain; none left ({ctx})")


def whole_domains(free: list[int], gpu_domain: dict[int, int], n: int, what: str, ctx: str) -> tuple[int, ...]:
    """The GPUs of the lowest ``n / size`` wholly free NVLink domains (``size`` GPUs each); a one-line UserError
    when ``n`` is not a whole number of domains or too few are free."""
    members: dict[int, list[int]] = {}
    for g, d in gpu_domain.items():
        members.setdefault(d, []).append(g)
    sizes = {len(m) for m in members.values()}
    if len(sizes) != 1:
        raise UserError(f"deployment: {what} spans nodes, which needs NVLink domains of one size; the topology's "
                        f"are {sorted(sizes)} GPUs")
    size = sizes.pop()
    if n % size:
        raise UserError(f"deployment: {what} spans nodes: its {n} GPUs are not whole {size}-GPU NVLink domains "
                        f"(use a multiple of {size})")
    free_set = set(free)
    whole = [d for d in sorted(members) if all(g in free_set for g in members[d])]
    if len(whole) < n // size:
        raise UserError(f"deployment: {what} needs {n // size} wholly free {size}-GPU NVLink domains; "
                        f"{len(whole)} left ({ctx})")
    return tuple(sorted(g for d in whole[: n // size] for g in members[d]))


def _topology_slice(topo: TopologyView):
    """``(gpus, gpu_host, gpu_nic, nic_GBps, gpu_domain)``: what a :class:`Deployment` copies of the topology."""
    gpus = sorted(topo.gpu_ids)
    gpu_host = {g: topo.host_of(g) for g in gpus}
    gpu_nic = {g: topo.nic_of_gpu(g) for g in gpus}
    nic_GBps = {n: float(topo.nic_spec(n).GBps) for n in sorted(set(gpu_nic.values()))}
    domains: dict[frozenset[int], int] = {}
    gpu_domain: dict[int, int] = {}
    for g in gpus:
        d = topo.nvlink_domain(g)
        gpu_domain[g] = domains.setdefault(d, len(domains))
    return gpus, gpu_host, gpu_nic, nic_GBps, gpu_domain


@dataclass(frozen=True)
class _Want:
    """A group to place: ``width`` GPUs in one ``scope`` (``"host"``: one node; ``"domain"``: one NVLink
    domain), within the NVLink domains ``only`` (None: any). ``role`` and ``index`` name it in errors
    (``decoder 27``)."""

    role: str
    index: int
    width: int
    scope: str
    only: frozenset[int] | None = None

    def may_use(self, domain: int) -> bool:
        return self.only is None or domain in self.only

    def what(self) -> str:
        return f"{self.role} {self.index}"

    def where(self) -> str:
        return "node" if self.scope == "host" else "NVLink domain"


def _pack_in_order(gpus, gpu_host, gpu_domain, wants: list[_Want]) -> dict[_Want, tuple[int, ...]] | None:
    """The in-order packing of :func:`place`: each group in turn takes the lowest free GPUs of the lowest node
    / NVLink domain with room for it; None when one finds none."""
    free: dict[str, dict[int, list[int]]] = {"host": {}, "domain": {}}
    for g in gpus:
        free["host"].setdefault(gpu_host[g], []).append(g)
        free["domain"].setdefault(gpu_domain[g], []).append(g)
    out = {}
    for w in wants:
        pool = free[w.scope]
        k = next((k for k in sorted(pool) if len(pool[k]) >= w.width and w.may_use(gpu_domain[pool[k][0]])),
                 None)
        if k is None:
            return None
        mine = out[w] = tuple(pool[k][: w.width])
        taken = set(mine)
        for h in {gpu_host[g] for g in mine}:
            free["host"][h] = [g for g in free["host"][h] if g not in taken]
        for d in {gpu_domain[g] for g in mine}:
            free["domain"][d] = [g for g in free["domain"][d] if g not in taken]
    return out


class _Free:
    """Free GPUs by node and NVLink domain, and the roles each domain holds already (for :func:`_pack`). A
    node here is the GPUs of one host in one NVLink domain (a host whose GPUs share no NVLink is several)."""

    def __init__(self, gpus, gpu_host, gpu_domain) -> None:
        self.free: dict[tuple[int, int], list[int]] = {}
        self.hosts: dict[int, list[tuple[int, int]]] = {}
        self.node_of = {g: (gpu_domain[g], gpu_host[g]) for g in gpus}
        for g in gpus:
            h = self.node_of[g]
            if h not in self.free:
                self.hosts.setdefault(h[0], []).append(h)
            self.free.setdefault(h, []).append(g)
        self.size = {h: len(f) for h, f in self.free.items()}
        self.dom_size = {d: sum(self.size[h] for h in hs) for d, hs in self.hosts.items()}
        self.dom_free = dict(self.dom_size)
        self.roles: dict[int, set[str]] = {d: set() for d in self.hosts}
        self.counts = {d: Counter(self.size[h] for h in hs) for d, hs in self.hosts.items()}  # free per node

    def largest(self, w: _Want) -> int:
        """The most free GPUs of one node (``w.scope == "host"``) or one NVLink domain ``w`` may use."""
        if w.scope == "host":
            return max((len(f) for h, f in self.free.items() if w.may_use(h[0])), default=0)
        return max((n for d, n in self.dom_free.items() if w.may_use(d)), default=0)

    def _near(self, role: str) -> dict[int, tuple[int, int]]:
        """Per domain ``(0 if it holds a group of another role else 1, its distance to the nearest one)``:
        domains are numbered rack by rack along the fabric, so a nearer index is a nearer rack."""
        others = sorted(e for e, rs in self.roles.items() if rs - {role})
        if not others:
            return {d: (0, 0) for d in self.hosts}
        near = {}
        for d in self.hosts:
            i = bisect.bisect_left(others, d)
            near[d] = (0 if i < len(others) and others[i] == d else 1,
                       min(abs(d - others[j]) for j in (i - 1, i) if 0 <= j < len(others)))
        return near

    def take(self, w: _Want) -> tuple[int, ...] | None:
        """Place ``w`` (see :func:`place`) and return its GPUs, or None when no node / domain holds it."""
        near = self._near(w.role)
        if w.scope == "host":  # the node with the fewest free GPUs that holds it, then by its domain
            sizes = sorted({c for d, n in self.counts.items() if w.may_use(d)
                            for c, k in n.items() if k and c >= w.width})
            if not sizes:
                return None
            c = sizes[0]
            d = min((d for d, n in self.counts.items() if n[c] and w.may_use(d)),
                    key=lambda d: (*near[d], self.dom_free[d], d))
            h = next(h for h in self.hosts[d] if len(self.free[h]) == c)
            mine = self.free[h][: w.width]
        else:
            fits = [d for d, n in self.dom_free.items() if n >= w.width and w.may_use(d)]
            if not fits:
                return None
            d = min(fits, key=lambda d: (self.dom_free[d], *near[d], d))
            mine = self._in_domain(d, w.width)
        taken = set(mine)
        d = self.node_of[mine[0]][0]
        for h in {self.node_of[g] for g in mine}:
            self.counts[d][len(self.free[h])] -= 1
            self.free[h] = [g for g in self.free[h] if g not in taken]
            self.counts[d][len(self.free[h])] += 1
        self.dom_free[d] -= len(mine)
        self.roles[d].add(w.role)
        return tuple(sorted(mine))

    def _in_domain(self, d: int, n: int) -> list[int]:
        """``n`` free GPUs of domain ``d``: whole free nodes first (the others stay whole for narrower
        groups), the rest from the node that holds it most tightly, else from the fullest nodes."""
        mine: list[int] = []
        rest = []
        for h in self.hosts[d]:
            if len(self.free[h]) == self.size[h] and self.size[h] <= n - len(mine):
                mine += self.free[h]
            elif self.free[h]:
                rest.append(h)
        need = n - len(mine)
        fit = [h for h in rest if len(self.free[h]) >= need]
        if need and fit:
            mine += self.free[min(fit, key=lambda h: (len(self.free[h]), h))][:need]
        elif need:
            for h in sorted(rest, key=lambda h: (len(self.free[h]), h)):
                mine += self.free[h][: n - len(mine)]
        return mine[:n]


def _widest_first(w: _Want):
    return -w.width, w.scope != "domain", w.role, w.index


def _pack(gpus, gpu_host, gpu_domain, wants: list[_Want]) -> dict[_Want, tuple[int, ...]] | _Want:
    """The widest-first packing of :func:`place`: groups by decreasing width (decoders before prefillers of
    the same width, then by index), each where :meth:`_Free.take` puts it. Returns the GPUs of every group, or
    the first group that finds no room."""
    free = _Free(gpus, gpu_host, gpu_domain)
    out = {}
    for w in sorted(wants, key=_widest_first):
        mine = free.take(w)
        if mine is None:
            return w
        out[w] = mine
    return out


def _fewest(ok, hi: int) -> int | None:
    """The least ``k`` in ``1..hi`` with ``ok(k)`` (``ok`` monotone), None when ``ok(hi)`` is false."""
    if hi < 1 or not ok(hi):
        return None
    lo = 1
    while lo < hi:
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def _with_domains(gpus, gpu_host, gpu_domain, like: int, extra: int):
    """``(gpus, gpu_host, gpu_domain)`` with ``extra`` more NVLink domains shaped like domain ``like``."""
    src = [g for g in gpus if gpu_domain[g] == like]
    more, host, dom = list(gpus), dict(gpu_host), dict(gpu_domain)
    g0, h0, d0 = max(gpus) + 1, max(gpu_host.values()) + 1, max(gpu_domain.values()) + 1
    hosts: dict[tuple[int, int], int] = {}
    for k in range(extra):
        for j, g in enumerate(src):
            new = g0 + k * len(src) + j
            more.append(new)
            host[new] = hosts.setdefault((k, gpu_host[g]), h0 + len(hosts))
            dom[new] = d0 + k
    return more, host, dom


def _no_fit(bad: _Want, gpus, gpu_host, gpu_domain, wants: list[_Want], ctx: str,
            narrower_ok=lambda w: w.scope == "domain") -> str:
    """The one-line error for ``bad`` not fitting: what it needs, the largest free block the packing had left
    for it, and the smallest changes that fit — fewer groups of its role (or of the other role), narrower
    groups of its role (halving the width while ``narrower_ok``), more NVLink domains like the largest one."""
    free = _Free(gpus, gpu_host, gpu_domain)
    for w in sorted(wants, key=_widest_first):
        if w == bad:
            break
        free.take(w)
    head = f"deployment: {bad.what()} needs {bad.width} free GPUs in one {bad.where()}"
    if bad.scope == "host":
        whole = max((n for h, n in free.size.items() if bad.may_use(h[0])), default=0)
    else:
        whole = max((n for d, n in free.dom_size.items() if bad.may_use(d)), default=0)
    if bad.width > whole:
        return f"{head}; no {bad.where()} has more than {whole} GPUs ({ctx})"

    def fits(ws, topo=None) -> bool:
        g, h, d = topo or (gpus, gpu_host, gpu_domain)
        return not isinstance(_pack(g, h, d, ws), _Want)

    fixes = []
    roles = [bad.role] + sorted({w.role for w in wants} - {bad.role})
    for role in roles:
        mine = [w for w in wants if w.role == role]
        rest = [w for w in wants if w.role != role]
        k = _fewest(lambda k: fits(rest + mine[: len(mine) - k]), len(mine))
        if k is not None:
            fixes.append(f"{k} fewer {role}{'s' if k > 1 else ''}")
    mine = [w for w in wants if w.role == bad.role]
    rest = [w for w in wants if w.role != bad.role]
    width = bad.width // 2
    while width >= 1:
        narrow = [_Want(w.role, w.index, width, w.scope, w.only) for w in mine]
        if narrower_ok(narrow[0]) and fits(rest + narrow):
            fixes.append(f"{bad.role}s of {width} GPU{'s' if width > 1 else ''}")
            break
        width //= 2
    like = max((d for d in free.dom_size if bad.may_use(d)), key=lambda d: (free.dom_size[d], -d))
    first = max(gpu_domain.values()) + 1  # the domains _with_domains adds are numbered from here

    def more(k: int) -> bool:
        new = frozenset(range(first, first + k))
        ws = [w if w.only is None or like not in w.only else
              _Want(w.role, w.index, w.width, w.scope, w.only | new) for w in wants]
        return fits(ws, _with_domains(gpus, gpu_host, gpu_domain, like, k))

    k = _fewest(more, len(wants))
    if k is not None:
        fixes.append(f"{k} more NVLink domain{'s' if k > 1 else ''} of {free.dom_size[like]} GPUs")
    tail = f" — fits with {', or '.join(fixes)}" if fixes else ""
    return f"{head}; the largest free block is {free.largest(bad)} ({ctx}){tail}"


def place_aggregated(topo: TopologyView, *, n_workers: int, kv_bytes_per_token: int, template: AggregatedTemplate,
                     mtp: MtpSpec | None = None, shed_ttft_s: float | None = None,
                     name: str = "deployment") -> Deployment:
    """Lay out ``n_workers`` aggregated workers (``A0``, ``A1``, ...) on ``topo``: each takes the lowest free
    GPUs of one NVLink domain (its TP and EP collectives stay on NVLink; workers of one width fill domain
    after domain without fragmenting them). Raises a one-line ``UserError`` when they do not fit, naming the
    smallest change that does."""
    gpus, gpu_host, gpu_nic, nic_GBps, gpu_domain = _topology_slice(topo)
    _need(n_workers >= 1, f"aggregated.workers: must be >= 1, got {n_workers}")
    wants = [_Want("aggregated worker", i, template.n_gpus, "domain") for i in range(n_workers)]
    in_order = _pack_in_order(gpus, gpu_host, gpu_domain, wants)
    got = in_order if in_order is not None else _pack(gpus, gpu_host, gpu_domain, wants)
    if isinstance(got, _Want):
        raise UserError(_no_fit(got, gpus, gpu_host, gpu_domain, wants,
                                f"aggregated.workers={n_workers}, {len(gpus)} GPUs",
                                narrower_ok=lambda w: False))
    groups = [AggregatedGroup(id=f"A{i}", gpus=mine, template=template)
              for i, mine in enumerate(sorted(got.values(), key=min))]
    return Deployment(
        prefillers=(), decoders=(), kv_bytes_per_token=int(kv_bytes_per_token), gpu_host=gpu_host,
        gpu_nic=gpu_nic, nic_GBps=nic_GBps, gpu_domain=gpu_domain, mtp=mtp or MtpSpec(),
        shed_ttft_s=shed_ttft_s, name=name, aggregated=tuple(groups))
