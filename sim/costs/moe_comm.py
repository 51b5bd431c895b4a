"""MoE dispatch / combine time: EP prefill (replicated input, local select + all-reduce), DP-EP decode (sparse
all-to-all over NVLink) and EP groups spanning nodes (DeepEP's normal and low-latency kernels over each GPU's NIC).

**EP prefill** (the write-up's prefillers, TP = EP inside one node): after the attention all-reduce every EP rank
holds all ``T`` tokens, so

* *dispatch* is local: one kernel aggregates the routing (``T * top_k`` expert ids → per-expert counts/offsets),
  one gathers the ``A`` token copies routed to this rank's experts into the grouped-GEMM input buffer (reads
  ``A * hidden * 2`` B of bf16 hidden state, writes ``A * hidden * act_bytes`` in the GEMM's activation format);
* *combine* accumulates locally over this rank's experts (reads ``A * hidden * 2``, writes a ``T * hidden`` bf16
  partial sum) and then **all-reduces** the partial sums over the EP group (:func:`sim.costs.collective.
  allreduce_time`, NVLS where available).
``A`` defaults to its expectation ``T * top_k / ep``; pass the busiest rank's count from an ``EpPrefillPlan`` to
model imbalanced routing.

**DP-EP decode** (one fused kernel each for dispatch and combine, pplx-kernels / DeepEP style): every rank owns
``b`` tokens; a token is sent once to each *rank* holding at least one of its ``top_k`` experts (dedupe) —
expected ``d = R * (1 - C(E - E/R, k) / C(E, k))`` ranks for uniform routing (:func:`expected_dest_ranks`).
The time is latency-dominated at decode sizes:

    fixed (KERNEL_FIXED_US or the calibration's kernel_fixed_us, + GRID_SYNC_US)
    + sync rounds x (SIGNAL_US[arch] + link latency + PER_PEER_US x peers)      dispatch: counts + done = 2 rounds;
                                                                                  combine: done = 1 round
    + bytes over NVLink / bandwidth   (+ bytes over NICs / NIC bandwidth for peers outside the NVLink domain,
                                       NIC_POST_US per message batch, CPU_PROXY_US per message without
                                       GPU-initiated RDMA, i.e. EFA)
    + local packing / accumulation bytes / HBM bandwidth.

Dispatch carries activations in the GEMM's activation format (``bytes_per_element(fmt, "activation")``) plus
routing metadata (``top_k`` x (4 B id + 4 B weight) + 4 B index per copy); combine returns bf16 expert outputs,
already summed over the destination's local experts. A calibration table (kinds ``dispatch_us`` /
``combine_us``, key n_ranks / hidden / phase, x = tokens per rank) replaces the estimate; an imported per-operator
table (kind ``a2a_us``, key op / n_ranks / payload, x = payload bytes per rank) replaces the DP-EP decode kernels,
priced at equal bytes when the table was measured at another hidden size.

**Across nodes** (an EP group spanning NVLink domains: ``span_nodes`` groups on 8-GPU nodes). Dispatch and combine
are priced as DeepEP's two kernel families do them, per GPU and its own NIC(s) (:func:`ep_traffic`,
:func:`ep_comm`). With ``N`` nodes of ``G`` GPUs (``R = N G`` ranks), ``b`` tokens per GPU, ``top_k = k`` of ``E``
experts spread evenly, ``D_node = expected_dest_ranks(E, k, N)`` and ``D_rank = expected_dest_ranks(E, k, R)``
(distinct nodes / GPUs a token reaches under uniform routing):

* *low-latency mode* (decode: a DP-EP decoder spanning nodes, ``dpep_decode_*`` without a ``send_matrix``): one
  record per (token, expert), straight to the expert's GPU — ``b k (N-1)/N`` records over RDMA, ``b k (G-1)/R``
  over NVLink to the other GPUs of the node, no forwarding;
* *normal mode* (prefill with DP attention across nodes, ``sim.costs.step.dp_prefill_step_breakdown``): a token
  crosses once to each other node holding one of its experts, to the GPU with its own local index there, which
  forwards it over NVLink to every GPU of that node holding one of its experts — ``b (N-1)/N D_node`` records over
  RDMA, ``b (G-1)/G D_rank`` over NVLink.

A dispatch record is the hidden state in the activation format (FP8 with one fp32 scale per 128 channels: 1 + 4/128
B per element) plus a 16 B header (low-latency) or 8 B of source metadata and ``k x 8`` B of expert ids and weights,
padded to 16 B (normal); a combine record is the bf16 hidden state (normal mode: the node's partial sum, reduced
on the relay GPU). The time on the busiest GPU is

    fixed (kernel + grid barrier; normal-mode dispatch adds its layout-notify kernel)
    + rounds x (network latency + signal + NIC_POST_US per NIC_PARALLEL_POSTS RDMA peers
                [+ CPU_PROXY_US per peer without GPU-initiated RDMA, i.e. EFA])   (+ one NVLink hop in normal mode)
    + max(RDMA bytes / (NIC line rate x EP_NIC_EFFICIENCY), NVLink bytes / NVLink rate)   (busier direction)
    + local packing / accumulation bytes / HBM bandwidth.

RDMA peers are the GPUs on other nodes (low-latency) or the same-index GPU of each other node (normal). Skewed
routing scales the received side (``recv_scale`` / ``copy_scale``: in low-latency mode a GPU receives expert
copies). Groups inside one NVLink domain, and any group given a ``send_matrix``, keep the model above.
:func:`ep_rdma_busy_s` gives the NIC seconds of a dispatch + combine, the share of a NIC the simulator's network
leaves to KV transfers less (``sim.network``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

from rackbed.sim.costs import constants as C
from rackbed.sim.costs.calibration import CalibrationTable, kernel_fixed_us, lookup
from rackbed.sim.costs.collective import CollectiveCost, allreduce_time, group_links
from rackbed.sim.costs.gemm import _bpe, _format_exec, hbm_rate_Bps
from rackbed.topology.errors import UserError

#: Routing metadata per token copy: 4 B token index (the expert ids and weights ride along: top_k x (4 + 4) B).
META_BYTES_PER_COPY = 4


@dataclass(frozen=True, slots=True)
class CommCost:
    """One dispatch or combine on the busiest rank, in seconds by term:
    ``fixed_s`` (kernel launches, grid barriers), ``sync_s`` (signalling rounds, per-peer and per-message costs),
    ``transfer_s`` (bytes over NVLink / NICs), ``local_s`` (HBM work: pack, unpack, accumulate), ``allreduce_s``
    (EP prefill combine's all-reduce). ``calibrated_s``: a measured total that replaces the sum (None: model)."""

    fixed_s: float = 0.0
    sync_s: float = 0.0
    transfer_s: float = 0.0
    local_s: float = 0.0
    allreduce_s: float = 0.0
    calibrated_s: float | None = None
    allreduce: CollectiveCost | None = None

    @property
    def total_s(self) -> float:
        if self.calibrated_s is not None:
            return self.calibrated_s
        return self.fixed_s + self.sync_s + self.transfer_s + self.local_s + self.allreduce_s


@lru_cache(maxsize=1024)
def expected_dest_ranks(n_experts: int, top_k: int, ep: int) -> float:
    """Expected number of distinct EP ranks a token's ``top_k`` experts (uniform, without replacement) fall on,
    with ``n_experts / ep`` contiguous experts per rank: ``ep * (1 - C(E - E/ep, k) / C(E, k))``. When ``ep`` does
    not divide the experts (wide EP with redundant expert slots: a rank serves ``E / ep`` experts' worth of
    load on average) the same product with a fractional ``E / ep``: ``ep * (1 - prod_i (E - E/ep - i) / (E - i))``."""
    if ep < 1 or not 0 < top_k <= n_experts:
        raise UserError(f"need 0 < top_k <= n_experts and ep >= 1 (E={n_experts}, k={top_k}, ep={ep})")
    if n_experts % ep == 0:
        per = n_experts // ep
        miss = math.comb(n_experts - per, top_k) / math.comb(n_experts, top_k)
        return ep * (1.0 - miss)
    per_f = n_experts / ep
    miss = 1.0
    for i in range(top_k):
        miss *= max(0.0, (n_experts - per_f - i) / (n_experts - i))
    return ep * (1.0 - miss)


def _act_bpe(gpu, fmt: str) -> float:
    return _bpe(_format_exec(gpu, fmt).act_format, "activation")  # identity-keyed format_execution


def payload_name(bytes_per_elem: float) -> str:
    """The ``a2a_us`` payload key of activations of ``bytes_per_elem`` bytes: bf16, fp8 or fp4 (scales included)."""
    return "bf16" if bytes_per_elem >= 2 else "fp8" if bytes_per_elem >= 1 else "fp4"


def _a2a_measured(calib, g, op: str, tokens_per_rank: float, hidden: int, bpe: float) -> float | None:
    """Seconds of a measured DP-EP ``op`` (dispatch / combine) kernel moving ``tokens_per_rank`` x ``hidden``
    elements of ``bpe`` bytes per rank (calibration kind ``a2a_us``), or None. The tables were measured inside one
    NVLink domain: a group spanning domains (EP over InfiniBand / EFA) is priced by the model."""
    if calib is None or not g.one_domain:
        return None
    us = calib.lookup("a2a_us", g.gpu.name, tokens_per_rank * hidden * bpe, op=op, n_ranks=g.n_ranks,
                      payload=payload_name(bpe))
    return None if us is None else us * 1e-6


# ------------------------------------------------------------------------------------------------ EP prefill


def ep_prefill_dispatch(topo, gpus: Sequence[int], n_tokens: int, model, fmt: str = "bf16", *,
                        local_copies: float | None = None, calib: CalibrationTable | None = None) -> CommCost:
    """EP prefill dispatch on the busiest rank: routing aggregation + local gather of ``local_copies`` token
    copies (default ``n_tokens * top_k / ep``) into the grouped-GEMM input (module docstring)."""
    g = group_links(topo, gpus)
    ep = g.n_ranks
    if n_tokens <= 0:
        return CommCost()
    a = n_tokens * model.top_k / ep if local_copies is None else float(local_copies)
    measured = lookup(calib, "dispatch_us", g.gpu.name, n_tokens, n_ranks=ep, hidden=model.hidden,
                      phase="prefill")
    routing_bytes = n_tokens * model.top_k * 8 * 2  # read ids + weights, write offsets / permutation
    pack_bytes = a * model.hidden * (2 + _act_bpe(g.gpu, fmt))
    local = (routing_bytes + pack_bytes) / hbm_rate_Bps(g.gpu, pack_bytes, calib)
    return CommCost(fixed_s=2 * kernel_fixed_us(calib, g.gpu) * 1e-6, local_s=local,
                    calibrated_s=None if measured is None else measured * 1e-6)


def ep_prefill_combine(topo, gpus: Sequence[int], n_tokens: int, model, *, local_copies: float | None = None,
                       algo: str = "auto", calib: CalibrationTable | None = None) -> CommCost:
    """EP prefill combine on the busiest rank: local weighted accumulation over this rank's experts, then an
    all-reduce of the ``n_tokens x hidden`` bf16 partial sums over the EP group (``algo`` as in
    :func:`sim.costs.collective.allreduce_time`)."""
    g = group_links(topo, gpus)
    ep = g.n_ranks
    if n_tokens <= 0:
        return CommCost()
    a = n_tokens * model.top_k / ep if local_copies is None else float(local_copies)
    acc_bytes = a * model.hidden * 2 + n_tokens * model.hidden * 2
    local = acc_bytes / hbm_rate_Bps(g.gpu, acc_bytes, calib)
    ar = allreduce_time(topo, gpus, n_tokens * model.hidden * 2, algo=algo, calib=calib)
    measured = lookup(calib, "combine_us", g.gpu.name, n_tokens, n_ranks=ep, hidden=model.hidden,
                      phase="prefill")
    return CommCost(fixed_s=kernel_fixed_us(calib, g.gpu) * 1e-6, local_s=local, allreduce_s=ar.total_s, allreduce=ar,
                    calibrated_s=None if measured is None else measured * 1e-6)


# ------------------------------------------------------------------------------------------------ DP-EP decode


@dataclass(frozen=True, slots=True)
class A2aVolume:
    """Token copies the busiest rank sends to / receives from remote ranks, split by path, and how many peers
    it exchanges with over each path."""

    send_nvlink: float
    recv_nvlink: float
    send_net: float
    recv_net: float
    peers_nvlink: int
    peers_net: int
    local_copies: float

    @property
    def send(self) -> float:
        return self.send_nvlink + self.send_net

    @property
    def recv(self) -> float:
        return self.recv_nvlink + self.recv_net


def a2a_volume(topo, gpus: Sequence[int], tokens_per_rank: float, model, *,
               send_matrix: Sequence[Sequence[float]] | None = None) -> A2aVolume:
    """Token copies for one DP-EP dispatch (combine is the reverse). ``send_matrix[s][d]``: copies rank ``s``
    (``gpus[s]``) sends to rank ``d`` after dedupe (e.g. from a ``DpEpDecodePlan``); None = uniform-routing
    expectation with ``tokens_per_rank`` tokens on every rank. Returns the busiest rank's volumes."""
    ranks = list(gpus)
    r = len(ranks)
    if send_matrix is None:
        nv, net = _worst_peer_split(topo, tuple(ranks))
        d = expected_dest_ranks(model.n_experts, model.top_k, r)
        per_peer = tokens_per_rank * d / r
        return A2aVolume(per_peer * nv, per_peer * nv, per_peer * net, per_peer * net, nv, net, per_peer)
    dom = [topo.nvlink_domain(x) for x in ranks]
    if len(send_matrix) != r or any(len(row) != r for row in send_matrix):
        raise UserError(f"send_matrix must be {r}x{r} (one row and column per EP rank)")
    best, best_key = None, None
    for i in range(r):
        sn = rn = snet = rnet = 0.0
        pn = pnet = 0
        for j in range(r):
            if j == i:
                continue
            if ranks[j] in dom[i]:
                sn += send_matrix[i][j]
                rn += send_matrix[j][i]
                pn += 1
            else:
                snet += send_matrix[i][j]
                rnet += send_matrix[j][i]
                pnet += 1
        v = A2aVolume(sn, rn, snet, rnet, pn, pnet, float(send_matrix[i][i]))
        key = (v.send_net + v.recv_net, max(v.send, v.recv))
        if best_key is None or key > best_key:
            best, best_key = v, key
    return best


_PEER_CACHE: dict[tuple[int, tuple[int, ...]], tuple[object, tuple[int, int]]] = {}


def _worst_peer_split(topo, ranks: tuple[int, ...]) -> tuple[int, int]:
    """(NVLink peers, network peers) of the rank with the most network peers (cached per topology object)."""
    key = (id(topo), ranks)
    hit = _PEER_CACHE.get(key)
    if hit is not None and hit[0] is topo:
        return hit[1]
    best = (0, -1)
    for i, a in enumerate(ranks):
        dom = topo.nvlink_domain(a)
        nv = sum(1 for j, b in enumerate(ranks) if j != i and b in dom)
        net = len(ranks) - 1 - nv
        if net > best[1]:
            best = (nv, net)
    if len(_PEER_CACHE) > 4096:
        _PEER_CACHE.clear()
    _PEER_CACHE[key] = (topo, best)
    return best


def _a2a(topo, gpus, tokens_per_rank, model, copy_bytes_out: float, copy_bytes_back: float, rounds: int,
         local_bytes: float, send_matrix, calib, recv_scale: float = 1.0) -> CommCost:
    g = group_links(topo, gpus)
    v = a2a_volume(topo, gpus, tokens_per_rank, model, send_matrix=send_matrix)
    if recv_scale != 1.0 and send_matrix is None:  # skewed routing: the busiest rank's incoming copies
        v = dataclasses.replace(v, recv_nvlink=v.recv_nvlink * recv_scale, recv_net=v.recv_net * recv_scale)
    sig = C.SIGNAL_US[g.arch]
    sync_us = 0.0
    if v.peers_nvlink:
        sync_us += rounds * (sig + g.latency_us + C.PER_PEER_US * v.peers_nvlink)
    transfer = 0.0
    nv_bytes = max(v.send_nvlink * copy_bytes_out, v.recv_nvlink * copy_bytes_back)
    if nv_bytes:
        transfer += nv_bytes / (g.nvlink_bw_GBps * 1e9)
    if v.peers_net:
        per_msg = C.NIC_POST_US * math.ceil(v.peers_net / C.NIC_PARALLEL_POSTS)
        if not g.gpu_initiated:
            per_msg += C.CPU_PROXY_US * v.peers_net  # one proxy thread posts every message
        sync_us += rounds * (g.net_latency_us + per_msg + sig)
        net_bytes = max(v.send_net * copy_bytes_out, v.recv_net * copy_bytes_back)
        transfer += net_bytes / (g.net_bw_GBps * 1e9)
    local = local_bytes / hbm_rate_Bps(g.gpu, local_bytes, calib) if local_bytes else 0.0
    fixed = (kernel_fixed_us(calib, g.gpu) + C.GRID_SYNC_US) * 1e-6
    return CommCost(fixed_s=fixed, sync_s=sync_us * 1e-6, transfer_s=transfer, local_s=local)


def dpep_decode_dispatch(topo, gpus: Sequence[int], tokens_per_rank: float, model, fmt: str = "bf16", *,
                         send_matrix: Sequence[Sequence[float]] | None = None,
                         calib: CalibrationTable | None = None, recv_scale: float = 1.0,
                         copy_scale: float | None = None) -> CommCost:
    """DP-EP decode dispatch on the busiest rank (module docstring): ``tokens_per_rank`` tokens per rank, each
    sent once to every rank holding one of its experts; activations in ``fmt``'s activation format.
    Skewed routing (``engine.core.expert_load.BusiestRank``; 1: uniform): ``recv_scale``, the busiest rank's
    incoming (deduplicated) tokens over the mean rank's, scales its received bytes, and a measured kernel is read
    at ``tokens_per_rank * recv_scale``; ``copy_scale`` (None: ``recv_scale``), its expert copies over the mean
    rank's, scales the unpacking into its experts' inputs."""
    g = group_links(topo, gpus)
    if g.n_ranks < 2 or tokens_per_rank <= 0:
        return CommCost()
    cs = recv_scale if copy_scale is None else copy_scale
    if (recv_scale != 1.0 or cs != 1.0) and send_matrix is None:
        return _skewed(dpep_decode_dispatch, topo, gpus, tokens_per_rank, model, recv_scale, calib,
                       lambda: _dispatch_model(g, topo, gpus, tokens_per_rank, model, fmt, None, calib, recv_scale,
                                               cs), fmt=fmt)
    measured = lookup(calib, "dispatch_us", g.gpu.name, tokens_per_rank, n_ranks=g.n_ranks, hidden=model.hidden,
                      phase="decode")
    if measured is not None:
        return CommCost(calibrated_s=measured * 1e-6)
    table = _a2a_measured(calib, g, "dispatch", tokens_per_rank, model.hidden, _act_bpe(g.gpu, fmt))
    if table is not None:
        return CommCost(calibrated_s=table)
    return _dispatch_model(g, topo, gpus, tokens_per_rank, model, fmt, send_matrix, calib, 1.0, 1.0)


def _dispatch_model(g, topo, gpus, tokens_per_rank, model, fmt, send_matrix, calib, recv_scale,
                    copy_scale) -> CommCost:
    if not g.one_domain and send_matrix is None:  # across nodes: DeepEP low-latency (module docstring)
        return ep_comm(topo, gpus, tokens_per_rank, model, "low_latency", "dispatch", fmt, calib=calib,
                       recv_scale=copy_scale, copy_scale=copy_scale)
    copy = model.hidden * _act_bpe(g.gpu, fmt) + model.top_k * 8 + META_BYTES_PER_COPY
    v_recv = tokens_per_rank * model.top_k  # expert assignments landing on a rank (expected)
    if copy_scale != 1.0:
        v_recv *= copy_scale
    local = tokens_per_rank * model.hidden * 2 + v_recv * model.hidden * _act_bpe(g.gpu, fmt) * 2
    return _a2a(topo, gpus, tokens_per_rank, model, copy, copy, 2, local, send_matrix, calib, recv_scale)


def _skewed(fn, topo, gpus, tokens_per_rank, model, recv_scale, calib, modelled, **kw) -> CommCost:
    """A DP-EP kernel on the busiest rank under skewed routing: a measured kernel (calibration) at
    ``tokens_per_rank * recv_scale`` tokens per rank, else the model with the scaled incoming volume."""
    if calib is not None:
        measured = fn(topo, gpus, tokens_per_rank * recv_scale, model, calib=calib, **kw)
        if measured.calibrated_s is not None:
            return measured
    return modelled()


def dpep_decode_combine(topo, gpus: Sequence[int], tokens_per_rank: float, model, *,
                        send_matrix: Sequence[Sequence[float]] | None = None,
                        calib: CalibrationTable | None = None, recv_scale: float = 1.0,
                        copy_scale: float | None = None) -> CommCost:
    """DP-EP decode combine on the busiest rank: bf16 expert outputs (summed over the destination's local experts)
    return to the token's rank, which accumulates them with the routing weights. ``recv_scale`` / ``copy_scale``:
    as in :func:`dpep_decode_dispatch` (the busiest expert rank sends back that many more summed outputs, and
    accumulates that many more expert outputs)."""
    g = group_links(topo, gpus)
    if g.n_ranks < 2 or tokens_per_rank <= 0:
        return CommCost()
    cs = recv_scale if copy_scale is None else copy_scale
    if (recv_scale != 1.0 or cs != 1.0) and send_matrix is None:
        return _skewed(dpep_decode_combine, topo, gpus, tokens_per_rank, model, recv_scale, calib,
                       lambda: _combine_model(g, topo, gpus, tokens_per_rank, model, None, calib, recv_scale, cs))
    measured = lookup(calib, "combine_us", g.gpu.name, tokens_per_rank, n_ranks=g.n_ranks, hidden=model.hidden,
                      phase="decode")
    if measured is not None:
        return CommCost(calibrated_s=measured * 1e-6)
    table = _a2a_measured(calib, g, "combine", tokens_per_rank, model.hidden, 2.0)
    if table is not None:
        return CommCost(calibrated_s=table)
    return _combine_model(g, topo, gpus, tokens_per_rank, model, send_matrix, calib, 1.0, 1.0)


def _combine_model(g, topo, gpus, tokens_per_rank, model, send_matrix, calib, recv_scale, copy_scale) -> CommCost:
    if not g.one_domain and send_matrix is None:  # across nodes: DeepEP low-latency (module docstring)
        return ep_comm(topo, gpus, tokens_per_rank, model, "low_latency", "combine", calib=calib,
                       recv_scale=copy_scale, copy_scale=copy_scale)
    copy = model.hidden * 2
    d = expected_dest_ranks(model.n_experts, model.top_k, g.n_ranks)
    acc = tokens_per_rank * model.top_k * model.hidden * 2  # local accumulation over local experts
    if copy_scale != 1.0:
        acc *= copy_scale
    local = acc + tokens_per_rank * d * model.hidden * 2 + tokens_per_rank * model.hidden * 2  # weighted sum
    return _a2a(topo, gpus, tokens_per_rank, model, copy, copy, 1, local, send_matrix, calib, recv_scale)


# ------------------------------------------------------------------------------- all-gather / reduce-scatter

#: ``decode.moe_comm``: how a DP-EP decoder moves tokens to its experts and back — ``a2a`` (the sparse
#: all-to-all above) or ``allgather`` (every GPU gathers every GPU's tokens, runs its experts on all of them,
#: and a reduce-scatter returns each GPU the sums for its own tokens: TensorRT-LLM's MoE communication inside
#: one NVLink domain when its all-to-all kernels are not enabled)
MOE_COMMS = ("a2a", "allgather")


def _gather_scatter(kind: str, topo, gpus: Sequence[int], buffer_bytes: float, pay: str, calib) -> CommCost:
    """An NCCL all-gather (``kind`` ``allgather_us``) or reduce-scatter (``reducescatter_us``) of a buffer of
    ``buffer_bytes`` over ``gpus``: the calibration's measured curve for the group size and payload (one
    NVLink domain), else the model — half an all-reduce of the buffer (``collective.allreduce_time``): an
    all-reduce is a reduce-scatter followed by an all-gather, each moving ``(n - 1) / n`` of the buffer per
    GPU."""
    g = group_links(topo, gpus)
    if g.n_ranks < 2 or buffer_bytes <= 0:
        return CommCost()
    if calib is not None and g.one_domain:
        us = calib.lookup(kind, g.gpu.name, buffer_bytes, n_ranks=g.n_ranks, payload=pay)
        if us is not None:
            return CommCost(calibrated_s=us * 1e-6)
    ar = allreduce_time(topo, list(gpus), buffer_bytes, calib=calib)
    return CommCost(allreduce_s=0.5 * ar.total_s, allreduce=ar)


def allgather_decode_dispatch(topo, gpus: Sequence[int], tokens_per_rank: float, model, fmt: str = "bf16", *,
                              calib: CalibrationTable | None = None) -> CommCost:
    """``decode.moe_comm: allgather`` dispatch: every GPU of the EP group gathers the ``tokens_per_rank``
    tokens of every GPU — their hidden states in the activation format of ``fmt`` and their routing (``top_k``
    x (4 B id + 4 B weight)) — a buffer of ``n x tokens_per_rank x (hidden x act bytes + top_k x 8)``
    bytes."""
    g = group_links(topo, gpus)
    bpe = _act_bpe(g.gpu, fmt)
    buf = g.n_ranks * tokens_per_rank * (model.hidden * bpe + model.top_k * 8)
    return _gather_scatter("allgather_us", topo, gpus, buf, "bf16" if bpe >= 2 else "fp8", calib)


def reducescatter_decode_combine(topo, gpus: Sequence[int], tokens_per_rank: float, model, *,
                                 calib: CalibrationTable | None = None) -> CommCost:
    """``decode.moe_comm: allgather`` combine: each GPU holds its experts' weighted bf16 outputs for every
    gathered token; a reduce-scatter of ``n x tokens_per_rank x hidden x 2`` bytes sums them and leaves each
    GPU its own tokens'."""
    g = group_links(topo, gpus)
    return _gather_scatter("reducescatter_us", topo, gpus, g.n_ranks * tokens_per_rank * model.hidden * 2,
                           "bf16", calib)


# ------------------------------------------------------------------------------------------------ across nodes


#: DeepEP's per-message header in low-latency mode (an ``int4``: the source token index and bookkeeping).
LL_HEADER_BYTES = 16
#: Normal-mode per-token metadata besides the hidden state and its scales: the source meta (8 B) and, per top-k
#: slot, the expert id and the routing weight (4 + 4 B); a token's record is padded to ``RECORD_ALIGN`` bytes.
NORMAL_META_BYTES = 8
RECORD_ALIGN = 16

MODES = ("normal", "low_latency")


@dataclass(frozen=True, slots=True)
class EpTraffic:
    """Expected bytes one GPU moves in one dispatch or combine of an EP group spread over ``nodes`` NVLink domains
    (``gpus_per_node`` GPUs of the group in each), by path and direction, under uniform routing (module section
    "Across nodes"). ``rdma_*``: over the GPU's own NIC(s), ``nics_per_gpu`` of them sharing it evenly;
    ``nvlink_*``: over NVLink inside the GPU's node. ``rdma_copies`` / ``nvlink_copies``: the token records
    behind the bytes (per direction); ``rdma_peers``: GPUs on other nodes the GPU exchanges RDMA messages with."""

    mode: str
    op: str
    nodes: int
    gpus_per_node: int
    record_bytes: float
    rdma_copies: float
    nvlink_copies: float
    rdma_send_bytes: float
    rdma_recv_bytes: float
    nvlink_send_bytes: float
    nvlink_recv_bytes: float
    rdma_peers: int
    nics_per_gpu: int = 1

    @property
    def nic_send_bytes(self) -> float:
        """Bytes one NIC sends (the GPU's RDMA bytes over its NICs)."""
        return self.rdma_send_bytes / self.nics_per_gpu

    @property
    def nic_recv_bytes(self) -> float:
        """Bytes one NIC receives."""
        return self.rdma_recv_bytes / self.nics_per_gpu

    @property
    def nic_bytes(self) -> float:
        """The busier direction of one NIC."""
        return max(self.nic_send_bytes, self.nic_recv_bytes)


def _aligned(n: float) -> float:
    return float(math.ceil(n / RECORD_ALIGN) * RECORD_ALIGN)


def record_bytes(mode: str, op: str, hidden: int, top_k: int, dispatch_bpe: float) -> float:
    """Bytes of one token record on the wire. Dispatch: the hidden state in the dispatch format (``dispatch_bpe``
    bytes per element, block scales included: FP8 with one fp32 scale per 128 channels is 1 + 4/128), plus in
    low-latency mode a ``LL_HEADER_BYTES`` header, in normal mode ``NORMAL_META_BYTES`` + ``top_k x 8`` B of
    expert ids and weights, padded to ``RECORD_ALIGN``. Combine: the bf16 hidden state (``hidden x 2``)."""
    if mode not in MODES:
        raise UserError(f"EP all-to-all mode must be one of {', '.join(MODES)}, got {mode!r}")
    if op == "combine":
        return float(hidden * 2)
    if op != "dispatch":
        raise UserError(f"EP all-to-all op must be dispatch or combine, got {op!r}")
    if mode == "low_latency":
        return LL_HEADER_BYTES + hidden * dispatch_bpe
    return _aligned(hidden * dispatch_bpe + NORMAL_META_BYTES + top_k * 8)


def ep_traffic(mode: str, op: str, *, n_experts: int, top_k: int, hidden: int, nodes: int, gpus_per_node: int,
               tokens_per_gpu: float, dispatch_bpe: float = 2.0, nics_per_gpu: int = 1,
               recv_scale: float = 1.0) -> EpTraffic:
    """Expected per-GPU traffic of one DeepEP-style ``op`` (``dispatch`` / ``combine``) in ``mode`` for an EP group
    of ``nodes x gpus_per_node`` GPUs, every GPU holding ``tokens_per_gpu`` tokens, the ``n_experts`` experts (or
    expert slots) spread evenly, each token routed to ``top_k`` distinct experts uniformly at random.

    With ``R = nodes x gpus_per_node`` ranks, ``N = nodes``, ``G = gpus_per_node``, ``b = tokens_per_gpu``:

    * ``low_latency`` — every (token, expert) pair is one message, straight to the expert's GPU: ``b k (N-1)/N``
      records over RDMA (the experts on other nodes), ``b k (G-1)/R`` over NVLink (other GPUs of the node);
    * ``normal`` — a token crosses to each other node holding one of its experts once, over RDMA to the GPU with
      its own local index there, which forwards it over NVLink to every GPU of that node holding one of its
      experts: ``b (N-1)/N x D_node`` records over RDMA, ``b (G-1)/G x D_rank`` over NVLink, with
      ``D_node = expected_dest_ranks(E, k, N)`` distinct nodes and ``D_rank = expected_dest_ranks(E, k, R)``
      distinct GPUs a token reaches (:func:`expected_dest_ranks`; ``1 - (1 - 1/N)^k`` per node for ``k << E``).

    Combine moves the same records back (normal mode: the node's partial sum, reduced on the relay GPU, crosses
    once). Sent and received bytes are equal under uniform routing; ``recv_scale`` multiplies the received side
    (the busiest GPU of a skewed routing)."""
    if nodes < 1 or gpus_per_node < 1:
        raise UserError(f"an EP group needs nodes >= 1 and gpus_per_node >= 1, got {nodes} x {gpus_per_node}")
    rec = record_bytes(mode, op, hidden, top_k, dispatch_bpe)
    r = nodes * gpus_per_node
    b = max(0.0, float(tokens_per_gpu))
    if mode == "low_latency":
        rdma = b * top_k * (nodes - 1) / nodes
        nvl = b * top_k * (gpus_per_node - 1) / r
    else:
        rdma = b * (nodes - 1) / nodes * expected_dest_ranks(n_experts, top_k, nodes)
        nvl = b * (gpus_per_node - 1) / gpus_per_node * expected_dest_ranks(n_experts, top_k, r)
    peers = r - gpus_per_node if mode == "low_latency" else nodes - 1
    return EpTraffic(mode, op, nodes, gpus_per_node, rec, rdma, nvl, rdma * rec, rdma * rec * recv_scale,
                     nvl * rec, nvl * rec * recv_scale, peers, max(1, int(nics_per_gpu)))


def direct_rdma_copies(n_experts: int, top_k: int, nodes: int, gpus_per_node: int, tokens_per_gpu: float) -> float:
    """Records a GPU would send over RDMA if every token went once to every GPU on another node holding one of its
    experts (deduplicated per GPU, no NVLink forwarding): ``b x D_rank x (R - G) / R``; what normal mode's
    forwarding saves against."""
    r = nodes * gpus_per_node
    return tokens_per_gpu * expected_dest_ranks(n_experts, top_k, r) * (r - gpus_per_node) / r


def group_shape(topo, gpus: Sequence[int]) -> tuple[int, int, int]:
    """``(nodes, gpus_per_node, nics_per_gpu)`` of an EP group: the NVLink domains it spans, the most of its GPUs
    in one of them (the closed forms assume equal shares: placement gives whole nodes) and the NICs of its first
    GPU."""
    counts: dict[frozenset[int], int] = {}
    for x in gpus:
        d = topo.nvlink_domain(x)
        counts[d] = counts.get(d, 0) + 1
    nics = len(topo.nics_of_gpu(gpus[0])) if len(counts) > 1 else 1
    return len(counts), max(counts.values()), max(1, nics)


def _nvlink_latency_us(topo, gpus: Sequence[int]) -> float:
    a = gpus[0]
    dom = topo.nvlink_domain(a)
    peer = next((x for x in gpus if x != a and x in dom), None)
    return topo.p2p_latency_us(a, peer) if peer is not None else 0.0


def ep_comm(topo, gpus: Sequence[int], tokens_per_gpu: float, model, mode: str, op: str, fmt: str = "bf16", *,
            calib: CalibrationTable | None = None, recv_scale: float = 1.0, copy_scale: float = 1.0) -> CommCost:
    """One DeepEP-style dispatch or combine on the busiest GPU of an EP group spanning NVLink domains (module
    section "Across nodes"): ``transfer_s = max(RDMA bytes / (NIC rate x EP_NIC_EFFICIENCY), NVLink bytes /
    NVLink rate)`` on the busier direction, ``sync_s`` the signalling rounds (dispatch: counts + done, combine:
    done) each paying the network latency, a signal and the message posts (``NIC_POST_US`` per
    ``NIC_PARALLEL_POSTS`` RDMA peers, ``CPU_PROXY_US`` per peer without GPU-initiated RDMA), plus one NVLink hop in
    normal mode (the forward); ``local_s`` the HBM packing / accumulation. Dispatch carries activations in
    ``fmt``'s activation format (scales included), combine bf16. ``recv_scale`` / ``copy_scale``: the busiest
    GPU's received records / expert copies over the mean GPU's (skewed routing; 1 = uniform)."""
    g = group_links(topo, gpus)
    if g.n_ranks < 2 or tokens_per_gpu <= 0:
        return CommCost()
    nodes, per_node, nics = group_shape(topo, gpus)
    bpe = _act_bpe(g.gpu, fmt) if op == "dispatch" else 2.0
    tr = ep_traffic(mode, op, n_experts=model.n_experts, top_k=model.top_k,
                    hidden=model.hidden, nodes=nodes, gpus_per_node=per_node, tokens_per_gpu=tokens_per_gpu,
                    dispatch_bpe=bpe, nics_per_gpu=nics, recv_scale=recv_scale)
    return _ep_comm_cost(g, topo, gpus, tr, tokens_per_gpu, model, bpe, calib, copy_scale)


def _ep_comm_cost(g, topo, gpus, tr: EpTraffic, tokens_per_gpu, model, bpe, calib, copy_scale) -> CommCost:
    rdma_s = max(tr.rdma_send_bytes, tr.rdma_recv_bytes) / (g.net_bw_GBps * 1e9 * C.EP_NIC_EFFICIENCY) \
        if g.net_bw_GBps else 0.0
    nvl_s = max(tr.nvlink_send_bytes, tr.nvlink_recv_bytes) / (g.nvlink_bw_GBps * 1e9)
    rounds = 2 if tr.op == "dispatch" else 1
    sig = C.SIGNAL_US[g.arch]
    per_msg = C.NIC_POST_US * math.ceil(tr.rdma_peers / C.NIC_PARALLEL_POSTS) if tr.rdma_peers else 0.0
    if not g.gpu_initiated:
        per_msg += C.CPU_PROXY_US * tr.rdma_peers
    sync_us = rounds * (g.net_latency_us + sig + per_msg) if tr.rdma_peers else 0.0
    if tr.mode == "normal" and tr.gpus_per_node > 1:
        sync_us += sig + _nvlink_latency_us(topo, gpus)  # the relay GPU's NVLink forward
    copies = tokens_per_gpu * model.top_k * copy_scale  # expert copies landing on / leaving the GPU
    if tr.op == "dispatch":
        local = tokens_per_gpu * model.hidden * 2 + copies * model.hidden * bpe * 2  # quantise + unpack
    else:
        local = copies * model.hidden * 2 * 2  # read the expert outputs, accumulate them weighted
    local_s = local / hbm_rate_Bps(g.gpu, local, calib)
    kernels = 2 if (tr.mode == "normal" and tr.op == "dispatch") else 1  # normal mode: notify + dispatch
    fixed = (kernels * kernel_fixed_us(calib, g.gpu) + C.GRID_SYNC_US) * 1e-6
    return CommCost(fixed_s=fixed, sync_s=sync_us * 1e-6, transfer_s=max(rdma_s, nvl_s), local_s=local_s)


def ep_rdma_busy_s(topo, gpus: Sequence[int], tokens_per_gpu: float, model, mode: str, fmt: str = "bf16") -> float:
    """Seconds one dispatch plus one combine keep a GPU's NIC busy (the busier direction of its RDMA bytes at
    ``NIC rate x EP_NIC_EFFICIENCY``) for an EP group spanning NVLink domains; 0 inside one domain. What the
    simulator's network takes off the NICs' rate for KV transfers (``ScenarioCostModel.ep_nic_share``)."""
    g = group_links(topo, gpus)
    if g.one_domain or g.n_ranks < 2 or tokens_per_gpu <= 0 or not g.net_bw_GBps:
        return 0.0
    nodes, per_node, nics = group_shape(topo, gpus)
    out = 0.0
    for op, bpe in (("dispatch", _act_bpe(g.gpu, fmt)), ("combine", 2.0)):
        tr = ep_traffic(mode, op, n_experts=model.n_experts, top_k=model.top_k, hidden=model.hidden, nodes=nodes,
                        gpus_per_node=per_node, tokens_per_gpu=tokens_per_gpu, dispatch_bpe=bpe, nics_per_gpu=nics)
        out += max(tr.rdma_send_bytes, tr.rdma_recv_bytes)
    return out / (g.net_bw_GBps * 1e9 * C.EP_NIC_EFFICIENCY)
