"""All-reduce time over a topology: alpha-beta per algorithm, NCCL-style algorithm choice, NVLS (NVLink SHARP).

For a group of GPUs and a buffer of ``B`` bytes per rank, each algorithm's time is

    latency (fixed + synchronisations + phases)  +  per-direction bytes on the busiest GPU port / bandwidth

where the per-direction bytes, the number of phases and of cross-rank synchronisations come from the explicit
schedules of :mod:`engine.core.collectives` (traffic counters, not formulas): one-shot ``(N-1)B``, two-shot and
ring ``2(N-1)B/N``, NVLS ``B + B/N`` — with NVLink SHARP the *switch* reduces, so a GPU sends its buffer once
and receives the result once instead of exchanging ``2(N-1)/N`` of it with peers (the write-up's "B instead of
2(N-1)B/N" counts the GPU's transactions; the per-direction bytes add the B/N result / multicast slice).

Algorithms:

* ``one_shot`` / ``two_shot`` / ``nvls``: symmetric-memory kernels (cuMem / multicast mappings, as the write-up's
  CuTe DSL kernels and vLLM / TRT-LLM custom all-reduce). Latency = the per-kernel fixed cost
  (``KERNEL_FIXED_US``, or a calibration's ``kernel_fixed_us``) + per synchronisation
  (``SIGNAL_US[arch]`` + link latency + ``PER_PEER_US`` per peer) + per phase one round trip over the link.
  Only inside one NVLink domain; ``nvls`` only where ``topology.reducing_switches(group)`` has NVSwitches.
* ``ring``: NCCL's ring with its own latency model (``NCCL_BASE_LAT_US`` + ``2(N-1)`` steps of
  ``NCCL_RING_STEP_US``), the best of the LL / LL128 / Simple protocols (bandwidth factors
  ``NCCL_PROTO_BW_FACTOR``). The only algorithm across NVLink domains (then over the NICs; hierarchical and IB
  SHARP variants are not modelled).

Bandwidth per GPU and direction: inside an NVLink domain the GPU's NCCL-effective NVLink rate
(``GpuSpec.nvlink_effective_GBps_per_dir``: 18 links x 20.6 / 40.1 GB/s), times ``NVLS_EFFICIENCY[arch]`` for
NVLS; across domains the sum of the GPU's NIC line rates (capped by NVLink).

``algo="auto"`` picks the fastest candidate, as NCCL's tuner does from its own cost table; any algorithm can be
forced. A calibration table (kind ``allreduce_us``, key algo / n_ranks, x = bytes) replaces the estimate of the
algorithms it covers. Where it measures a symmetric-memory kernel (``one_shot`` / ``two_shot`` / ``nvls``) for the
group's GPU and size, it measured the serving stack's own all-reduce (TensorRT-LLM's custom all-reduce, which picks
one- or two-shot itself, beside NCCL, which picks ring, tree or NVLS itself): "auto" then chooses among the measured
algorithms only, since an estimate of a kernel the stack does not run would undercut the measured ones (the NVLS
estimate, 10-20 % below the measured TP4 curves on H200 and B200, e.g.). A calibration measuring NCCL only (the
``rackbed`` stack's ``h200.yaml``) leaves the symmetric kernels, which rackbed's engine runs, to the model. In a
calibration that measures its stack's own all-reduce, a group size it did not measure (GB200 TP8: measured at 2
and 4 GPUs) takes each algorithm's curve at the nearest measured size, scaled by the model's ratio between the
two sizes, so that a measured TP4 is not compared with a first-principles TP8.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import lru_cache

from rackbed.engine.core.collectives import schedule
from rackbed.sim.costs import constants as C
from rackbed.sim.costs.calibration import CalibrationTable, kernel_fixed_us, lookup
from rackbed.topology.errors import UserError
from rackbed.topology.specs import GpuSpec

ALGOS: tuple[str, ...] = ("one_shot", "two_shot", "ring", "nvls")
#: the symmetric-memory kernels: a calibration measuring one of them for a group measured its stack's own
#: all-reduce, and "auto" then picks among the measured algorithms only (module docstring)
SYMMETRIC: frozenset[str] = frozenset(("one_shot", "two_shot", "nvls"))


@dataclass(frozen=True, slots=True)
class GroupLinks:
    """What the cost models need to know about a GPU group, computed once per (topology, group).

    ``one_domain``: all GPUs in one NVLink domain. ``bw_GBps``: per-GPU per-direction bandwidth for collective
    traffic (NCCL-effective NVLink, or NIC line rate across domains). ``latency_us``: worst one-way GPU↔GPU
    latency in the group (over NVLink inside a domain, over the network across). ``nvls``: NVLink SHARP switches
    serve the group. ``n_hosts``: distinct hosts (nodes / trays). ``nic_kind`` / ``gpu_initiated``: the NICs
    used across domains (None inside one domain)."""

    n_ranks: int
    gpu: GpuSpec
    one_domain: bool
    bw_GBps: float
    nvlink_bw_GBps: float
    net_bw_GBps: float
    latency_us: float
    net_latency_us: float
    nvls: bool
    n_hosts: int
    n_domains: int
    nic_kind: str | None
    gpu_initiated: bool

    @property
    def arch(self) -> str:
        return self.gpu.arch


_GROUP_CACHE: dict[tuple[int, tuple[int, ...]], tuple[weakref.ref, GroupLinks]] = {}


def group_links(topo, gpus: Sequence[int]) -> GroupLinks:
    """:class:`GroupLinks` of ``gpus`` (global GPU indices) in ``topo`` (cached per topology object)."""
    raw = gpus if isinstance(gpus, tuple) else tuple(gpus)
    hit = _GROUP_CACHE.get((id(topo), raw))
    if hit is not None and hit[0]() is topo:
        return hit[1]
    group = tuple(sorted({int(g) for g in raw}))
    if not group:
        raise UserError("a GPU group needs at least one GPU")
    key = (id(topo), raw)
    info = _group_links(topo, group)
    if len(_GROUP_CACHE) > 4096:
        _GROUP_CACHE.clear()
    _GROUP_CACHE[key] = (weakref.ref(topo), info)
    return info


def _group_links(topo, group: tuple[int, ...]) -> GroupLinks:
    gpu = topo.gpu_spec(group[0])
    for g in group[1:]:
        if topo.gpu_spec(g).name != gpu.name:
            raise UserError(f"GPU group {list(group)} mixes GPU models ({gpu.name}, {topo.gpu_spec(g).name})")
    domains = {topo.nvlink_domain(g) for g in group}
    one_domain = len(domains) == 1
    nvlink_bw = gpu.nvlink_effective_GBps_per_dir
    lat = net_lat = 0.0
    net_bw = 0.0
    nic_kind, gpu_initiated = None, True
    a = group[0]
    for b in group[1:]:
        lat = max(lat, topo.p2p_latency_us(a, b))
    if not one_domain:
        nics = topo.nics_of_gpu(a)
        if not nics:
            raise UserError(f"GPU group {list(group)} spans NVLink domains but GPU {a} has no NIC")
        specs = [topo.nic_spec(x) for x in nics]
        net_bw = sum(s.GBps for s in specs)
        nic_kind = specs[0].kind
        gpu_initiated = all(s.gpu_initiated_rdma for s in specs)
        for b in group[1:]:
            if topo.nvlink_domain(b) != topo.nvlink_domain(a):
                net_lat = max(net_lat, topo.p2p_latency_us(a, b))
    elif len(group) > 1 and gpu.nvlink_links == 0:
        raise UserError(f"GPU group {list(group)}: {gpu.name} has no NVLink")
    sw = topo.reducing_switches(group) if len(group) > 1 and one_domain else []
    nvls = any(s.startswith("nvsw:") for s in sw)
    bw = nvlink_bw if one_domain else min(nvlink_bw, net_bw)
    return GroupLinks(len(group), gpu, one_domain, bw, nvlink_bw, net_bw, lat, net_lat, nvls,
                      len({topo.host_of(g) for g in group}), len(domains), nic_kind, gpu_initiated)


@lru_cache(maxsize=256)
def algo_shape(algo: str, n_ranks: int) -> tuple[float, int, int]:
    """(per-direction bytes on the busiest GPU port per byte of buffer, phases, synchronisations) of ``algo`` for
    ``n_ranks``, read from the explicit schedule's traffic counters (:mod:`engine.core.collectives`)."""
    n_elems = n_ranks * 64
    t = schedule(algo, n_ranks, n_elems, 1).traffic
    per_dir = max(max(t.per_rank_tx_bytes), max(t.per_rank_rx_bytes)) / n_elems
    return per_dir, t.n_phases, t.n_sync_points


@dataclass(frozen=True, slots=True)
class CollectiveCost:
    """One all-reduce: ``algo`` (and NCCL ``protocol`` for ring), ``latency_s`` + ``bandwidth_s`` = ``total_s``,
    ``link_bytes`` per direction on the busiest GPU port. ``calibrated``: from a measured table."""

    algo: str
    protocol: str
    n_ranks: int
    n_bytes: float
    latency_s: float
    bandwidth_s: float
    total_s: float
    link_bytes: float
    calibrated: bool = False

    @property
    def alg_GBps(self) -> float:
        """Algorithm bandwidth B / t (nccl-tests "algbw")."""
        return self.n_bytes / self.total_s / 1e9 if self.total_s > 0 else 0.0

    @property
    def bus_GBps(self) -> float:
        """nccl-tests "busbw" = algbw * 2(N-1)/N."""
        n = self.n_ranks
        return self.alg_GBps * 2 * (n - 1) / n if n > 1 else 0.0


def available_algos(g: GroupLinks) -> tuple[str, ...]:
    """Algorithms that can run on the group (module docstring)."""
    if g.n_ranks < 2:
        return ()
    if not g.one_domain:
        return ("ring",)
    return ("one_shot", "two_shot", "ring") + (("nvls",) if g.nvls else ())


def _terms(g: GroupLinks, algo: str, fixed_us: float = C.KERNEL_FIXED_US) -> list[tuple[str, str, float, float, float]]:
    """The size-independent terms of ``algo`` on group ``g``: per protocol ``(algo, protocol, latency_s,
    per-direction link bytes per byte, bandwidth B/s)`` — NCCL's ring in its three protocols, the symmetric
    algorithms (one-shot, two-shot, NVLS) one each. :func:`_cost` adds the bytes."""
    per_dir, phases, syncs = algo_shape(algo, g.n_ranks)
    if algo == "ring":
        route = "nvlink" if g.one_domain else "net"
        out = []
        for proto in ("LL", "LL128", "Simple"):
            lat_us = C.NCCL_BASE_LAT_US[proto] + 2 * (g.n_ranks - 1) * C.NCCL_RING_STEP_US[route][proto]
            if not g.one_domain:
                lat_us += C.NIC_POST_US + (0.0 if g.gpu_initiated else C.CPU_PROXY_US)
            out.append(("ring", proto, lat_us * 1e-6, per_dir, g.bw_GBps * 1e9 * C.NCCL_PROTO_BW_FACTOR[proto]))
        return out
    lat_us = (fixed_us
              + syncs * (C.SIGNAL_US[g.arch] + g.latency_us + C.PER_PEER_US * (g.n_ranks - 1))
              + phases * 2 * g.latency_us)
    bw = g.bw_GBps * 1e9 * (C.NVLS_EFFICIENCY[g.arch] if algo == "nvls" else 1.0)
    return [(algo, "symmetric", lat_us * 1e-6, per_dir, bw)]


def _cost(g: GroupLinks, t: tuple[str, str, float, float, float], n_bytes: float) -> CollectiveCost:
    link_bytes = t[3] * n_bytes
    bw_s = link_bytes / t[4]
    return CollectiveCost(t[0], t[1], g.n_ranks, n_bytes, t[2], bw_s, t[2] + bw_s, link_bytes)


def _symmetric(g: GroupLinks, algo: str, n_bytes: float, fixed_us: float = C.KERNEL_FIXED_US) -> CollectiveCost:
    return _cost(g, _terms(g, algo, fixed_us)[0], n_bytes)


def _ring(g: GroupLinks, n_bytes: float) -> CollectiveCost:
    best = None
    for t in _terms(g, "ring"):
        cost = _cost(g, t, n_bytes)
        if best is None or cost.total_s < best.total_s:
            best = cost
    return best


def allreduce_candidates(topo, gpus: Sequence[int], n_bytes: float, *,
                         calib: CalibrationTable | None = None) -> dict[str, CollectiveCost]:
    """Estimated cost of every algorithm available to the group (empty for a single GPU)."""
    g = group_links(topo, gpus)
    return {a: _estimate(g, a, n_bytes, calib) for a in available_algos(g)}


def _estimate(g: GroupLinks, algo: str, n_bytes: float, calib: CalibrationTable | None) -> CollectiveCost:
    if n_bytes < 0:
        raise UserError(f"all-reduce size must be >= 0 bytes, got {n_bytes}")
    est = _ring(g, n_bytes) if algo == "ring" else _symmetric(g, algo, n_bytes, kernel_fixed_us(calib, g.gpu))
    # measured all-reduces ran inside one NVLink domain: a group spanning domains is priced by the model
    measured = lookup(calib, "allreduce_us", g.gpu.name, max(n_bytes, 1.0), algo=algo, n_ranks=g.n_ranks) \
        if g.one_domain else None
    if measured is None:
        n2 = _nearest_measured(calib, g, algo)
        if n2 is None:
            return est
        # a stack calibration measured this algorithm at other group sizes: the nearest one, scaled by the model
        g2 = replace(g, n_ranks=n2)
        est2 = _ring(g2, n_bytes) if algo == "ring" else _symmetric(g2, algo, n_bytes, kernel_fixed_us(calib, g.gpu))
        m2 = lookup(calib, "allreduce_us", g.gpu.name, max(n_bytes, 1.0), algo=algo, n_ranks=n2)
        measured = m2 * est.total_s / est2.total_s if est2.total_s > 0 else m2
    return CollectiveCost(algo, est.protocol, g.n_ranks, n_bytes, 0.0, 0.0, measured * 1e-6, est.link_bytes, True)


def _nearest_measured(calib: CalibrationTable | None, g: GroupLinks, algo: str) -> int | None:
    """The measured group size nearest ``g``'s (in log ratio; ties: the larger) at which ``calib`` has ``algo``,
    when ``calib`` measures its stack's own all-reduce on the GPU (a symmetric kernel at any size) and the group is
    one NVLink domain; else None (module docstring)."""
    if calib is None or not g.one_domain:
        return None
    sizes: dict[str, set[int]] = {}
    for e in calib._entries_of("allreduce_us", g.gpu.name):
        n = e.key.get("n_ranks")
        if isinstance(n, int) and n > 1 and isinstance(e.key.get("algo"), str):
            sizes.setdefault(e.key["algo"], set()).add(n)
    if not any(a in SYMMETRIC for a in sizes) or not sizes.get(algo):
        return None
    return min(sizes[algo], key=lambda n: (abs(math.log(n / g.n_ranks)), -n))


def allreduce_time(topo, gpus: Sequence[int], n_bytes: float, *, algo: str = "auto",
                   calib: CalibrationTable | None = None) -> CollectiveCost:
    """Time of an all-reduce of ``n_bytes`` per rank over ``gpus``. ``algo``: "auto" (fastest available, as
    NCCL's tuner), "auto_no_nvls" (fastest without NVLink SHARP), or one of ``ALGOS`` (UserError if the group
    cannot run it). A single GPU costs nothing."""
    g = group_links(topo, gpus)
    if g.n_ranks < 2 or n_bytes == 0:
        return CollectiveCost("none", "none", g.n_ranks, n_bytes, 0.0, 0.0, 0.0, 0.0)
    if n_bytes > 0 and (algo == "auto" or algo == "auto_no_nvls"):
        terms = _auto_terms(g, algo, calib)
        if terms is not None:
            return _auto_fast(g, terms, n_bytes)
    avail = available_algos(g)
    if algo in ("auto", "auto_no_nvls"):
        return min((_estimate(g, a, n_bytes, calib) for a in auto_names(g, algo, calib)), key=lambda c: c.total_s)
    if algo not in ALGOS:
        raise UserError(f"all-reduce algo must be auto, auto_no_nvls or one of {', '.join(ALGOS)}, got {algo!r}")
    if algo not in avail:
        why = ("no NVLink SHARP switch serves the group" if algo == "nvls" and g.one_domain
               else "the group spans NVLink domains (only ring over the network)")
        raise UserError(f"all-reduce algo {algo!r} not available on GPUs {sorted(set(gpus))}: {why}")
    return _estimate(g, algo, n_bytes, calib)


def _measured(calib: CalibrationTable | None, g: GroupLinks, algo: str) -> bool:
    """``calib`` prices ``algo`` on ``g`` from a measured curve (of the group's size, or scaled from another)."""
    return calib is not None and g.one_domain and (
        calib.entry("allreduce_us", g.gpu.name, algo=algo, n_ranks=g.n_ranks) is not None
        or _nearest_measured(calib, g, algo) is not None)


# auto_names per (group, algo, calibration), kept with the objects it was computed for (ids can be reused)
_NAMES: dict[tuple[int, str, int], tuple] = {}


def auto_names(g: GroupLinks, algo: str = "auto", calib: CalibrationTable | None = None) -> list[str]:
    """The algorithms ``algo`` ("auto" / "auto_no_nvls") chooses between on group ``g``: those available, and
    where ``calib`` measures a symmetric-memory kernel for the group, only the measured ones (module docstring)."""
    key = (id(g), algo, id(calib))
    hit = _NAMES.get(key)
    if hit is not None and hit[0] is g and hit[1] is calib:
        return hit[2]
    names = [a for a in available_algos(g) if not (algo == "auto_no_nvls" and a == "nvls")]
    measured = [a for a in names if _measured(calib, g, a)]
    out = measured if any(a in SYMMETRIC for a in measured) else names
    if len(_NAMES) > 4096:
        _NAMES.clear()
    _NAMES[key] = (g, calib, out)
    return out


# "auto" without calibrated all-reduce entries, per (group, algo, calibration): every candidate's _terms, so a
# call prices only the n_bytes term (one per prefill batch and all-reduce; the full path built ~6 CollectiveCosts)
_AUTO: dict[tuple[int, str, int], tuple] = {}


def _auto_terms(g: GroupLinks, algo: str, calib: CalibrationTable | None) -> tuple | None:
    key = (id(g), algo, id(calib))
    hit = _AUTO.get(key)
    if hit is not None and hit[0] is g and hit[1] is calib:
        return hit[2]
    names = auto_names(g, algo, calib)
    if calib is not None and g.one_domain and any(_measured(calib, g, a) for a in names):
        terms = None  # measured entries depend on n_bytes: the general path
    else:
        fixed_us = kernel_fixed_us(calib, g.gpu)
        terms = tuple(t for a in names for t in _terms(g, a, fixed_us)) or None
    if len(_AUTO) > 4096:
        _AUTO.clear()
    _AUTO[key] = (g, calib, terms)
    return terms


def _auto_fast(g: GroupLinks, terms: tuple, n_bytes: float) -> CollectiveCost:
    """``allreduce_time(algo="auto"...)`` from :func:`_auto_terms`: the same arithmetic and the same winner (the
    first candidate with the least total, as min() over algorithms of _ring's strict-< best protocol)."""
    best = None
    best_t = 0.0
    for t in terms:
        link_bytes = t[3] * n_bytes
        bw_s = link_bytes / t[4]
        total = t[2] + bw_s
        if best is None or total < best_t:
            best, best_t, best_bw, best_lb = t, total, bw_s, link_bytes
    return CollectiveCost(best[0], best[1], g.n_ranks, n_bytes, best[2], best_bw, best_t, best_lb)


@dataclass(frozen=True, slots=True)
class P2pCost:
    """One GPU-to-GPU copy of ``n_bytes``: ``total_s``; ``route`` (``topology.route_kind``); ``calibrated``: from
    a ``p2p_us`` table entry (else line rate + path latency)."""

    route: str
    n_bytes: float
    total_s: float
    calibrated: bool = False


def p2p_copy_time(topo, src: int, dst: int, n_bytes: float, *,
                  calib: CalibrationTable | None = None) -> P2pCost:
    """Time of one copy of ``n_bytes`` from GPU ``src`` to GPU ``dst`` (e.g. a KV block or a weight shard moved
    over NVLink). First principles: ``n_bytes / p2p_GBps + p2p_latency_us`` (the route's bottleneck line rate and
    its link / switch latencies). A ``p2p_us`` calibration entry for the route (key ``route``) replaces it: the
    measured curve inside its range, the smallest copy's time below it, the last interval's rate above it."""
    if n_bytes < 0:
        raise UserError(f"p2p copy size must be >= 0 bytes, got {n_bytes}")
    if src == dst or n_bytes == 0:
        return P2pCost("local", n_bytes, 0.0)
    route = topo.route_kind(src, dst)
    measured = lookup(calib, "p2p_us", topo.gpu_spec(src).name, n_bytes, route=route)
    if measured is not None:
        return P2pCost(route, n_bytes, measured * 1e-6, True)
    t = n_bytes / (topo.p2p_GBps(src, dst) * 1e9) + topo.p2p_latency_us(src, dst) * 1e-6
    return P2pCost(route, n_bytes, t)
