"""KV-cache transfer time, prefiller → decoder, over the NICs (the write-up ships KV over InfiniBand / EFA).

Input: the resharding plan of ``engine.core.kv`` — a ``TransferPlan`` (chunks) or its ``ChunkStats`` summary
(bytes and chunk counts per (source rank, destination rank)) — plus the GPU of every source and destination
rank (``ParallelPlan.gpus`` of each side). Each chunk is one RDMA write.

Model: every GPU sends through its own NICs (several per GPU on EFA p5en: the chunks of a pair are spread over
them evenly) and receives through the peer's NICs; NICs work in parallel. Per NIC, on either side,

    time = bytes / (line rate x KV_NIC_EFFICIENCY)  +  chunks x KV_CHUNK_OVERHEAD_US[kind] / KV_CHUNK_PIPELINE

and the transfer takes the slowest NIC plus one path latency (``topology.p2p_latency_us(src, dst, via="net")``)
and one un-overlapped chunk overhead. Chunks whose two ends are the same GPU cost nothing (no copy is modelled);
the network path is used even inside an NVLink domain (the write-up keeps NVLink for intra-deployment traffic).
A calibration table (kind ``nic_GBps``, key nic, x = mean chunk bytes) replaces the NIC rate.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from rackbed.sim.costs import constants as C
from rackbed.sim.costs.calibration import CalibrationTable, lookup
from rackbed.topology.errors import UserError


@dataclass(frozen=True, slots=True)
class KvTransferCost:
    """``total_s`` = ``nic_s`` (slowest NIC: bandwidth + exposed chunk overheads) + ``latency_s``;
    ``bytes`` / ``n_chunks`` moved over the network; ``busiest_nic``: its node id."""

    nic_s: float
    latency_s: float
    n_bytes: int
    n_chunks: int
    busiest_nic: str

    @property
    def total_s(self) -> float:
        return self.nic_s + self.latency_s


def _pairs(plan_or_stats) -> tuple[dict, dict]:
    """{(src_rank, dst_rank): bytes}, {(src_rank, dst_rank): chunks} from a TransferPlan, ChunkStats or an
    iterable of objects with src_rank / dst_rank / nbytes."""
    if hasattr(plan_or_stats, "bytes_by_pair"):
        return dict(plan_or_stats.bytes_by_pair), dict(plan_or_stats.chunks_by_pair)
    b: dict = defaultdict(int)
    n: dict = defaultdict(int)
    if hasattr(plan_or_stats, "src_rank") and hasattr(plan_or_stats, "nbytes") and \
            not isinstance(plan_or_stats.nbytes, int):
        for s, d, nb in zip(plan_or_stats.src_rank.tolist(), plan_or_stats.dst_rank.tolist(),
                            plan_or_stats.nbytes.tolist()):
            b[(s, d)] += nb
            n[(s, d)] += 1
        return dict(b), dict(n)
    for c in plan_or_stats:
        b[(c.src_rank, c.dst_rank)] += c.nbytes
        n[(c.src_rank, c.dst_rank)] += 1
    return dict(b), dict(n)


def kv_transfer_time(topo, plan_or_stats, src_gpus: Sequence[int], dst_gpus: Sequence[int], *,
                     calib: CalibrationTable | None = None) -> KvTransferCost:
    """Time to execute a KV resharding plan from ranks on ``src_gpus`` to ranks on ``dst_gpus`` (module
    docstring). ``plan_or_stats``: ``engine.core.kv.TransferPlan``, ``ChunkStats`` or an iterable of chunks."""
    by_bytes, by_chunks = _pairs(plan_or_stats)
    nic_bytes: dict[str, float] = defaultdict(float)
    nic_chunks: dict[str, float] = defaultdict(float)
    lat_us = 0.0
    total_b = total_c = 0
    for (s, d), nb in by_bytes.items():
        if not (0 <= s < len(src_gpus) and 0 <= d < len(dst_gpus)):
            raise UserError(f"KV plan names rank pair ({s}, {d}) but the sides have {len(src_gpus)} and "
                            f"{len(dst_gpus)} ranks")
        gs, gd = src_gpus[s], dst_gpus[d]
        nc = by_chunks.get((s, d), 0)
        if gs == gd or nb == 0:
            continue
        total_b += nb
        total_c += nc
        for g in (gs, gd):
            nics = topo.nics_of_gpu(g)
            if not nics:
                raise UserError(f"KV transfer from GPU {gs} to GPU {gd}: GPU {g} has no NIC")
            for x in nics:
                nic_bytes[x] += nb / len(nics)
                nic_chunks[x] += nc / len(nics)
        lat_us = max(lat_us, topo.p2p_latency_us(gs, gd, via="net"))
    if not nic_bytes:
        return KvTransferCost(0.0, 0.0, 0, 0, "")
    worst, worst_s, worst_over = "", -1.0, 0.0
    for x, nb in nic_bytes.items():
        spec = topo.nic_spec(x)
        mean_chunk = nb / max(nic_chunks[x], 1.0)
        measured = lookup(calib, "nic_GBps", topo.gpu_spec(src_gpus[0]).name, mean_chunk, nic=spec.name)
        rate = measured * 1e9 if measured is not None else spec.GBps * 1e9 * C.KV_NIC_EFFICIENCY
        over = C.KV_CHUNK_OVERHEAD_US[spec.kind] * 1e-6
        t = nb / rate + nic_chunks[x] * over / C.KV_CHUNK_PIPELINE
        if t > worst_s:
            worst, worst_s, worst_over = x, t, over
    return KvTransferCost(worst_s, lat_us * 1e-6 + worst_over, total_b, total_c, worst)
