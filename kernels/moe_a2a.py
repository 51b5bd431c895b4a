"""Decode DP-EP MoE dispatch / combine over peer-mapped memory (pplx-kernels-like, caller-allocated outputs).

    a2a = PeerMoeAllToAll(group, max_tokens=128, hidden=4096, top_k=8, n_experts=128)   # collective
    out = a2a.alloc_outputs()                        # x [ep*Tmax, row], ids int32 [ep*Tmax, k], weights f32, counts
    a2a.dispatch_send(x, topk_ids, topk_weights)     # x [T, D] bf16 (or uint8 rows from pack_fp8_rows), T <= Tmax
    a2a.dispatch_recv(out["x"], out["ids"], out["weights"], out["counts"])
    ... experts on out["x"] (slot s*Tmax + r = row r sent by rank s; rows past counts[s] have ids -1, weight 0) ...
    a2a.combine_send(y)                              # y [ep*Tmax, D] bf16 in the receive layout (already weighted)
    a2a.combine_recv(out_tokens, T)                  # out_tokens [T, D] bf16 = sum of the returned rows per token

Semantics are those of ``kernels.moe_reference.DpEpDecodePlan`` with dp == ep (rank i is dp rank i and ep rank i): a
token goes once to each rank owning at least one of its top-k experts (experts split contiguously, ``E % ep == 0``),
in token order within a source's slot; the ids travel unchanged (global expert ids; the receiver keeps the local
ones), the weights with them; combine sums, per token, the rows returned by its destination ranks in rank order (fp32
sum, one rounding to bf16). Each dispatch must be followed by exactly one combine (they share the parity).

Send and receive halves are separate launches (overlap work between them); all four run on
``torch.cuda.current_stream()``, need no host synchronisation and are CUDA-graph capturable (epochs live in
device memory; T is a launch argument, fixed inside a captured graph). The torch backend is capturable too (fixed
slot shapes, no data-dependent sizes). Waits are bounded: a kernel that waits longer than ``spin_timeout_s`` for a
peer gives up, flags the error on every rank (all later waits return at once) and ``check_error()`` raises. Backends: "cute" (kernels/moe_a2a_cute.py
over kernels.peer_memory.PeerBuffer) and "torch" (``all_to_all_single`` on fixed-size slots; same outputs).
Payloads: "bf16" rows (D*2 bytes) or "fp8" rows (D E4M3 bytes + D/128 fp32 scales, 1x128 blocks, from
:func:`pack_fp8_rows`). No NVLink multicast anywhere.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ[_k] = _v

PAYLOADS = ("bf16", "fp8")
FP8_BLOCK = 128


def row_bytes_for(hidden: int, payload: str) -> int:
    """Bytes of one dispatched token row: bf16 2*D; fp8 D codes + 4*D/128 fp32 scales."""
    if payload == "bf16":
        return 2 * hidden
    if payload == "fp8":
        return hidden + 4 * (hidden // FP8_BLOCK)
    raise ValueError(f"moe_a2a: payload={payload!r} must be one of {PAYLOADS}")


def _up(x: int, a: int = 128) -> int:
    return -(-x // a) * a


@dataclass(frozen=True)
class A2aLayout:
    """Byte layout of each rank's peer buffer (offsets from its base). n ranks, Tmax tokens per rank per call.

    counters  arrive[kind 0 dispatch / 1 combine][src] int32, counts[parity][src] int32, err int32
    zero      16 zero bytes (combine reads them for 'no row')
    epochs    [4 kernels][Tmax] int32 per-block call counters
    rowof     [Tmax][n] int32: row of my token t in destination j's slot, -1 if not sent (local use)
    table     int64[n] peer bases, rank, own base
    x / i / w [2 parity][n src][Tmax] rows of row_bytes / k int32 ids / k fp32 weights
    y         [2 parity][n dst][Tmax] rows of y_row_bytes (combine payload, bf16 D)
    """

    n: int
    max_tokens: int
    hidden: int
    top_k: int
    experts_per_rank: int
    row_bytes: int

    def __post_init__(self):
        if self.max_tokens < 32 or self.max_tokens % 32:
            raise ValueError(f"moe_a2a: max_tokens={self.max_tokens} must be a positive multiple of 32")
        if self.hidden % FP8_BLOCK:
            raise ValueError(f"moe_a2a: hidden={self.hidden} must be a multiple of {FP8_BLOCK}")
        if self.row_bytes % 16:
            raise ValueError(f"moe_a2a: row_bytes={self.row_bytes} must be a multiple of 16")
        if not 1 <= self.top_k <= 128:
            raise ValueError(f"moe_a2a: top_k={self.top_k} must be in 1..128 (one thread per slot)")

    @property
    def y_row_bytes(self) -> int:
        return 2 * self.hidden

    def arrive_off(self, kind: int, src) -> int:
        return 4 * (kind * self.n + src)

    def count_off(self, par, src):
        return 8 * self.n + 4 * (par * self.n + src)

    @property
    def err_off(self) -> int:
        return 16 * self.n

    @property
    def zero_off(self) -> int:
        return _up(16 * self.n + 4, 16)

    @property
    def _ep_base(self) -> int:
        return _up(self.zero_off + 16)

    def ep_off(self, kernel: int, blk):
        return self._ep_base + 4 * (kernel * self.max_tokens + blk)

    @property
    def rowof_off(self) -> int:
        return _up(self._ep_base + 16 * self.max_tokens)

    @property
    def table_off(self) -> int:
        return _up(self.rowof_off + 4 * self.max_tokens * self.n)

    @property
    def x_off(self) -> int:
        return _up(self.table_off + 8 * (self.n + 2))

    @property
    def _slots(self) -> int:
        return 2 * self.n * self.max_tokens

    @property
    def i_off(self) -> int:
        return _up(self.x_off + self._slots * self.row_bytes)

    @property
    def w_off(self) -> int:
        return _up(self.i_off + self._slots * self.top_k * 4)

    @property
    def y_off(self) -> int:
        return _up(self.w_off + self._slots * self.top_k * 4)

    @property
    def total_bytes(self) -> int:
        return _up(self.y_off + self._slots * self.y_row_bytes)


# ------------------------------------------------------------------------------------------------ CPU emulation


def destinations(topk_ids: np.ndarray, n: int, experts_per_rank: int) -> np.ndarray:
    """[T, n] bool: token t goes to rank j (owns one of its experts)."""
    ids = np.asarray(topk_ids, dtype=np.int64)
    goes = np.zeros((ids.shape[0], n), dtype=bool)
    if ids.size:
        goes[np.repeat(np.arange(ids.shape[0]), ids.shape[1]), (ids // experts_per_rank).ravel()] = True
    return goes


def emulate(xs: list[np.ndarray], ids: list[np.ndarray], ws: list[np.ndarray], lay: A2aLayout, expert_fn):
    """Run the kernels' index arithmetic on the CPU. Per rank r: xs[r] [T_r, D] rows, ids[r] [T_r, k], ws[r] [T_r, k].
    ``expert_fn(rank, x_recv [n*Tmax, D], ids_recv, w_recv)`` -> y [n*Tmax, D] (weighted expert sums).
    Returns (per-rank dispatch outputs dicts, per-rank combined [T_r, D])."""
    n, tm, k = lay.n, lay.max_tokens, lay.top_k
    D = xs[0].shape[1]
    rowof = []
    recv = [dict(x=np.full((n * tm, D), np.nan), ids=np.full((n * tm, k), -1, np.int64), w=np.zeros((n * tm, k)),
                 counts=np.zeros(n, np.int64)) for _ in range(n)]
    for s in range(n):
        T = xs[s].shape[0]
        if T > tm:
            raise ValueError(f"moe_a2a: {T} tokens > max_tokens={tm}")
        goes = destinations(ids[s], n, lay.experts_per_rank)  # [T, n]
        before = np.cumsum(goes, axis=0) - goes  # tokens before t going to j
        rowof.append(np.where(goes, before, -1))
        for j in range(n):
            recv[j]["counts"][s] = goes[:, j].sum()
            for t in np.flatnonzero(goes[:, j]):
                r = s * tm + before[t, j]
                recv[j]["x"][r], recv[j]["ids"][r], recv[j]["w"][r] = xs[s][t], ids[s][t], ws[s][t]
    ys = [expert_fn(j, recv[j]["x"], recv[j]["ids"], recv[j]["w"]) for j in range(n)]
    outs = []
    for s in range(n):
        T = xs[s].shape[0]
        out = np.zeros((T, D))
        for t in range(T):
            for j in range(n):
                if rowof[s][t, j] >= 0:
                    out[t] += ys[j][s * tm + rowof[s][t, j]]
        outs.append(out)
    return recv, outs


# ------------------------------------------------------------------------------------------------ fp8 payload


def pack_fp8_rows(x, exact: bool = False):
    """x [T, D] (D % 128 == 0) -> uint8 [T, D + 4*D/128]: E4M3 codes of x / s then the fp32 scales s = amax/448
    of each 1x128 block (the fp8_block activation format of engine/core/formats.py).

    exact=False (fast, fp32): x / s is rounded to fp32 before the E4M3 rounding, so where x / s lies within an fp32
    rounding of an E4M3 tie (common: x and amax are short bf16 numbers, e.g. x/s = 84.0000011 between 80 and 88)
    the code can be one step off the float64 reference (0.16% of codes on random bf16 rows). exact=True encodes
    with kernels.mx (float64, bit-identical to the reference; several more kernels)."""
    import torch

    T, D = x.shape
    xb = x.float().reshape(T, D // FP8_BLOCK, FP8_BLOCK)
    amax = torch.where(torch.isfinite(xb), xb.abs(), torch.zeros_like(xb)).amax(-1, keepdim=True)
    s = amax / torch.full_like(amax, 448.0)
    if exact:
        from rackbed.kernels import mx

        q = mx.quantize(x.reshape(T, D), "fp8_block", "activation")
        codes = q.codes.reshape(T, D)
        s = q.scales.to(torch.float32).reshape(T, -1, 1)
    else:
        q = torch.where(s > 0, xb / torch.where(s > 0, s, torch.ones_like(s)), torch.zeros_like(xb))
        codes = q.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8).reshape(T, D)
    return torch.cat([codes, s.reshape(T, D // FP8_BLOCK).contiguous().view(torch.uint8)], dim=1)  # T may be 0


def unpack_fp8_rows(rows, hidden: int):
    """uint8 [T, D + 4*D/128] -> float32 [T, D] (codes times their block scale)."""
    import torch

    T = rows.shape[0]
    q = rows[:, :hidden].contiguous().view(torch.float8_e4m3fn).float().reshape(T, hidden // FP8_BLOCK, FP8_BLOCK)
    s = rows[:, hidden:].contiguous().view(torch.float32).reshape(T, hidden // FP8_BLOCK, 1)
    return (q * s).reshape(T, hidden)


# ------------------------------------------------------------------------------------------------ the object


class PeerMoeAllToAll:
    """Dispatch/combine for decode DP-EP over ``group`` (one GPU per rank; dp == ep == group size).

    Args: max_tokens (Tmax, tokens per rank per call, multiple of 32), hidden (D), top_k, n_experts (E % ep == 0),
    payload "bf16" | "fp8", backend "auto" | "cute" | "torch", spin_timeout_s (device-side bound of every wait).
    """

    def __init__(self, group=None, *, max_tokens: int, hidden: int, top_k: int, n_experts: int,
                 payload: str = "bf16", backend: str = "auto", spin_timeout_s: float = 5.0):
        import torch
        import torch.distributed as dist

        if backend not in ("auto", "cute", "torch"):
            raise ValueError(f"PeerMoeAllToAll: backend={backend!r} must be 'auto', 'cute' or 'torch'")
        if not dist.is_initialized():
            raise ValueError("PeerMoeAllToAll: torch.distributed is not initialized")
        self.group = group
        self.rank = dist.get_rank(group)
        self.n = dist.get_world_size(group)
        if n_experts % self.n:
            raise ValueError(f"PeerMoeAllToAll: n_experts={n_experts} must divide by ep={self.n}")
        if payload not in PAYLOADS:
            raise ValueError(f"PeerMoeAllToAll: payload={payload!r} must be one of {PAYLOADS}")
        if not 0 < spin_timeout_s <= 60:
            raise ValueError(f"PeerMoeAllToAll: spin_timeout_s={spin_timeout_s} must be in (0, 60]")
        self.payload = payload
        self.hidden = hidden
        self._last_T = None
        self.lay = A2aLayout(self.n, max_tokens, hidden, top_k, n_experts // self.n, row_bytes_for(hidden, payload))
        self.fallback_reason = None
        self._buf = None
        self.backend = "torch"
        self.device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
        if backend != "torch":
            reason = None
            try:
                import cutlass.cute  # noqa: F401

                from rackbed.kernels import moe_a2a_cute  # noqa: F401
                if not torch.cuda.is_available():
                    reason = "no CUDA device"
            except Exception as exc:
                reason = f"CuTe DSL not importable ({type(exc).__name__}: {exc})"
            reasons = [None] * self.n
            dist.all_gather_object(reasons, reason, group=group)
            bad = [r for r in reasons if r]
            if bad and backend == "cute":
                raise RuntimeError(f"PeerMoeAllToAll: backend='cute' unavailable: {bad[0]}")
            if bad:
                self.fallback_reason = bad[0]
            else:
                from rackbed.kernels.peer_memory import PeerBuffer, check

                self._buf = PeerBuffer(group, self.lay.total_bytes)
                table = np.array(self._buf.ptrs + [self.rank, self._buf.local_ptr], dtype=np.int64)
                check(self._buf._drv.cuMemcpyHtoD(self._buf.local_ptr + self.lay.table_off, table.ctypes.data,
                                                  table.nbytes), "cuMemcpyHtoD")
                self._table = self._buf.local_ptr + self.lay.table_off
                from rackbed.kernels import moe_a2a_cute

                tns = int(spin_timeout_s * 1e9)
                self._k = {kind: moe_a2a_cute.compiled(kind, self.n, self.lay, 128, tns)
                           for kind in moe_a2a_cute.KINDS}
                self.direct_launch = all(f.direct for f in self._k.values())
                self.direct_launch_reason = next((f.reason for f in self._k.values() if f.reason), None)
                self.backend = "cute"
                dist.barrier(group=group)
        self._state = {}

    # -- helpers ------------------------------------------------------------------------------------------------
    def _row_dtype(self):
        import torch

        return torch.bfloat16 if self.payload == "bf16" else torch.uint8

    def row_elems(self) -> int:
        return self.hidden if self.payload == "bf16" else self.lay.row_bytes

    def alloc_outputs(self) -> dict:
        """Caller-side receive tensors: x [n*Tmax, row], ids int32 [n*Tmax, k], weights f32, counts int32 [n]."""
        import torch

        nt, k = self.n * self.lay.max_tokens, self.lay.top_k
        return dict(x=torch.empty(nt, self.row_elems(), dtype=self._row_dtype(), device=self.device),
                    ids=torch.empty(nt, k, dtype=torch.int32, device=self.device),
                    weights=torch.empty(nt, k, dtype=torch.float32, device=self.device),
                    counts=torch.empty(self.n, dtype=torch.int32, device=self.device))

    def _check_send(self, x, topk_ids, topk_weights):
        import torch

        T = x.shape[0]
        if T > self.lay.max_tokens:
            raise ValueError(f"PeerMoeAllToAll: {T} tokens > max_tokens={self.lay.max_tokens}")
        if x.dtype != self._row_dtype() or x.dim() != 2 or x.shape[1] != self.row_elems() or not x.is_contiguous():
            raise ValueError(f"PeerMoeAllToAll: x must be contiguous [T, {self.row_elems()}] {self._row_dtype()}, "
                             f"got {tuple(x.shape)} {x.dtype}")
        if topk_ids.dtype != torch.int32 or tuple(topk_ids.shape) != (T, self.lay.top_k) or not topk_ids.is_contiguous():
            raise ValueError(f"PeerMoeAllToAll: topk_ids must be contiguous int32 [T={T}, k={self.lay.top_k}]")
        if topk_weights.dtype != torch.float32 or topk_weights.shape != topk_ids.shape or not topk_weights.is_contiguous():
            raise ValueError("PeerMoeAllToAll: topk_weights must be contiguous float32 like topk_ids")

    @staticmethod
    def _stream() -> int:
        import torch

        return torch.cuda.current_stream().cuda_stream

    # -- the four halves ----------------------------------------------------------------------------------------
    def dispatch_send(self, x, topk_ids, topk_weights) -> None:
        self._check_send(x, topk_ids, topk_weights)
        self._last_T = x.shape[0]
        if self.backend == "cute":
            self._k["dispatch_send"](x.data_ptr(), topk_ids.data_ptr(), topk_weights.data_ptr(), 0, self._table,
                                     x.shape[0], self._stream())
        else:
            self._state["send"] = (x, topk_ids, topk_weights)

    def dispatch_recv(self, out_x, out_ids, out_w, out_counts) -> None:
        if self.backend == "cute":
            self._k["dispatch_recv"](out_x.data_ptr(), out_ids.data_ptr(), out_w.data_ptr(), out_counts.data_ptr(),
                                     self._table, 0, self._stream())
            return
        self._torch_dispatch(out_x, out_ids, out_w, out_counts)

    def combine_send(self, y) -> None:
        import torch

        nt = self.n * self.lay.max_tokens
        if y.dtype != torch.bfloat16 or tuple(y.shape) != (nt, self.hidden) or not y.is_contiguous():
            raise ValueError(f"PeerMoeAllToAll.combine_send: y must be contiguous bf16 [{nt}, {self.hidden}]")
        if self.backend == "cute":
            self._k["combine_send"](y.data_ptr(), 0, 0, 0, self._table, 0, self._stream())
        else:
            self._state["y"] = y

    def combine_recv(self, out, n_tokens: int) -> None:
        import torch

        if out.dtype != torch.bfloat16 or out.dim() != 2 or out.shape[0] < n_tokens or out.shape[1] != self.hidden \
                or not out.is_contiguous():
            raise ValueError(f"PeerMoeAllToAll.combine_recv: out must be contiguous bf16 [>= {n_tokens}, {self.hidden}]")
        if n_tokens != self._last_T:
            raise ValueError(f"PeerMoeAllToAll.combine_recv: n_tokens={n_tokens} must equal the token count of the "
                             f"last dispatch ({self._last_T})")
        if self.backend == "cute":
            self._k["combine_recv"](out.data_ptr(), 0, 0, 0, self._table, n_tokens, self._stream())
        else:
            self._torch_combine(out, n_tokens)

    def dispatch(self, x, topk_ids, topk_weights, out: dict) -> dict:
        self.dispatch_send(x, topk_ids, topk_weights)
        self.dispatch_recv(out["x"], out["ids"], out["weights"], out["counts"])
        return out

    def combine(self, y, out, n_tokens: int):
        self.combine_send(y)
        self.combine_recv(out, n_tokens)
        return out

    # -- torch backend (same outputs, NCCL/gloo all_to_all_single on fixed-size slots) --------------------------
    def _torch_dispatch(self, out_x, out_ids, out_w, out_counts):
        """Fixed-size slots and index_copy_ into a dump row instead of data-dependent selections: no host sync,
        so this path is CUDA-graph capturable like the kernels."""
        import torch
        import torch.distributed as dist

        x, ids, w = self._state.pop("send")
        n, tm, k = self.n, self.lay.max_tokens, self.lay.top_k
        T = x.shape[0]
        dev = x.device
        goes = torch.zeros(T, n, dtype=torch.int32, device=dev)
        if T:
            goes.scatter_(1, ids.long() // self.lay.experts_per_rank, 1)
        before = torch.cumsum(goes, 0, dtype=torch.int32) - goes
        rowof = torch.where(goes > 0, before, torch.full_like(before, -1))
        dump = n * tm  # the extra row every (token, rank) pair that is not sent is copied to
        dest = torch.where(goes > 0, before + torch.arange(n, device=dev, dtype=torch.int32) * tm,
                           torch.full_like(before, dump)).reshape(-1).long()
        sx = torch.zeros(dump + 1, x.shape[1], dtype=x.dtype, device=dev)
        si = torch.full((dump + 1, k), -1, dtype=torch.int32, device=dev)
        sw = torch.zeros(dump + 1, k, dtype=torch.float32, device=dev)
        for buf, src in ((sx, x), (si, ids), (sw, w)):
            buf.index_copy_(0, dest, src[:, None].expand(T, n, src.shape[1]).reshape(T * n, src.shape[1]))
        cnt = goes.sum(0, dtype=torch.int32)
        for src, dst in ((sx[:dump], out_x), (si[:dump], out_ids), (sw[:dump], out_w), (cnt, out_counts)):
            dist.all_to_all_single(dst.view(-1), src.reshape(-1), group=self.group)
        self._state["rowof"] = rowof

    def _torch_combine(self, out, n_tokens):
        import torch
        import torch.distributed as dist

        y = self._state.pop("y")
        rowof = self._state.pop("rowof")
        tm, nt = self.lay.max_tokens, self.n * self.lay.max_tokens
        back = torch.zeros(nt + 1, self.hidden, dtype=y.dtype, device=y.device)  # row nt stays zero
        dist.all_to_all_single(back[:nt].view(-1), y.reshape(-1).contiguous(), group=self.group)
        acc = torch.zeros(n_tokens, self.hidden, dtype=torch.float32, device=y.device)
        for j in range(self.n):  # fp32 sum in rank order, one rounding (what combine_recv does)
            r = rowof[:n_tokens, j]
            acc += back[torch.where(r >= 0, r + j * tm, torch.full_like(r, nt)).long()].float()
        out[:n_tokens] = acc.to(out.dtype)

    def check_error(self) -> None:
        """Raise if a kernel timed out waiting for a peer (synchronizes the device)."""
        import torch

        if self.backend != "cute":
            return
        torch.cuda.synchronize()
        from rackbed.kernels.peer_memory import check

        err = np.zeros(1, dtype=np.int32)
        check(self._buf._drv.cuMemcpyDtoH(err.ctypes.data, self._buf.local_ptr + self.lay.err_off, 4), "cuMemcpyDtoH")
        if int(err[0]):
            raise RuntimeError(f"PeerMoeAllToAll: rank {self.rank}: a wait timed out (here or on a peer; the "
                               "protocol state is lost, make a new object)")

    def error_to(self, t) -> None:
        """Copy the error word (int32; nonzero = a wait timed out here or on a peer) into ``t[0]`` (an int32 CUDA
        tensor) on the current stream, without a host synchronisation (fold it into a collective you do anyway)."""
        import torch

        if t.dtype != torch.int32 or t.numel() < 1:
            raise ValueError("PeerMoeAllToAll.error_to: t must be an int32 tensor")
        if self.backend != "cute":  # the torch backend has no device-side waits
            t[:1].zero_()
            return
        if not t.is_cuda:
            raise ValueError("PeerMoeAllToAll.error_to: t must be on the GPU")
        from rackbed.kernels.peer_memory import check

        drv = self._buf._drv
        check(drv.cuMemcpyDtoDAsync(t.data_ptr(), self._buf.local_ptr + self.lay.err_off, 4,
                                    drv.CUstream(self._stream())), "cuMemcpyDtoDAsync")

    def close(self) -> None:
        if self._buf is not None:
            self._buf.close()
            self._buf = None
