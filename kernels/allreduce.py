"""Peer-memory all-reduce (sum) for tensor-parallel layers and the prefill MoE combine.

    ar = PeerAllReduce(group, max_bytes=64 << 20, dtype=torch.bfloat16)   # collective: every rank calls it
    y = ar.all_reduce(x)              # new tensor, x unchanged; x: any shape, contiguous, bf16 or fp32, on GPU
    ar.all_reduce(x, out=x)           # in place
    ar.all_reduce(x, algo="two_shot") # force a schedule ("auto" picks by size: allreduce_schedule.select_algo)
    ar.close()                        # or `with PeerAllReduce(...) as ar:`

Every rank must make the same calls in the same order with the same shapes (as with any collective). Calls are
CUDA-graph capturable (the epoch lives in device memory, nothing on the host changes between replays) and run on
``torch.cuda.current_stream()``.

Backends: ``"cute"`` — the CuTe DSL kernels of ``allreduce_cute.py`` over a ``PeerBuffer`` (needs CUDA,
cuda-python, nvidia-cutlass-dsl and P2P between the ranks' GPUs); ``"torch"`` — ``torch.distributed.all_reduce``
on a copy (NCCL, gloo on the CPU). ``backend="auto"`` takes ``"cute"`` when it can and says why it did not in
``fallback_reason``. Peer access that is impossible raises ``PeerAccessError`` with ``backend="cute"``.
"""

from __future__ import annotations

import os

from rackbed.kernels.allreduce_schedule import ALGOS, TWO_SHOT_ALGO, launch_shape, make_layout, select_algo

# never NVLink multicast (NVLS): it can take a shared host's GPUs down; see kernels/README.md
for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ[_k] = _v

_DT_NAMES = {"torch.bfloat16": "bf16", "torch.float32": "fp32"}


def _dtype_name(dtype) -> str:
    name = _DT_NAMES.get(str(dtype))
    if name is None:
        raise ValueError(f"PeerAllReduce: dtype={dtype} must be torch.bfloat16 or torch.float32")
    return name


class PeerAllReduce:
    """Sum all-reduce over ``group`` for tensors of up to ``max_bytes`` bytes.

    Args:
        group: a torch.distributed process group (None = the default group); one GPU per rank.
        max_bytes: largest tensor (bytes) a call may pass; sets the peer buffer: about (2N + 2) * max_bytes
            per rank (one-shot slots for two parities, reduce-scatter slots, gather region).
        dtype: torch.bfloat16 or torch.float32; its kernels are compiled at construction (others on first use).
        backend: "auto" | "cute" | "torch".
        one_shot_max_bytes: crossover for algo="auto" (default: allreduce_schedule.ONE_SHOT_MAX_BYTES[N]).
        two_shot_algo: the two-shot variant "auto" uses above the crossover: "two_shot" (push the reduced chunk
            into the peers' gather regions) or "two_shot_pull" (peers load it from the owner).
        max_blocks: cap on CTAs per call (one flag set per CTA).
    """

    def __init__(self, group=None, max_bytes: int = 64 << 20, dtype=None, *, backend: str = "auto",
                 one_shot_max_bytes: int | None = None, max_blocks: int = 132, exchange: str = "auto",
                 two_shot_algo: str = TWO_SHOT_ALGO):
        import torch
        import torch.distributed as dist

        if backend not in ("auto", "cute", "torch"):
            raise ValueError(f"PeerAllReduce: backend={backend!r} must be 'auto', 'cute' or 'torch'")
        if max_bytes <= 0:
            raise ValueError(f"PeerAllReduce: max_bytes={max_bytes} must be > 0")
        if not dist.is_initialized():
            raise ValueError("PeerAllReduce: torch.distributed is not initialized (init_process_group first)")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.max_bytes = int(max_bytes)
        self.dtype = dtype if dtype is not None else torch.bfloat16
        _dtype_name(self.dtype)
        self.one_shot_max_bytes = one_shot_max_bytes
        self.two_shot_algo = two_shot_algo
        if two_shot_algo not in ("two_shot", "two_shot_pull"):
            raise ValueError(f"PeerAllReduce: two_shot_algo={two_shot_algo!r} must be 'two_shot' or 'two_shot_pull'")
        self.max_blocks = max_blocks
        self.fallback_reason: str | None = None
        self._buf = None
        self.backend = "torch"
        if backend == "torch":
            self.fallback_reason = "backend='torch' requested"
            return
        reason = self._cute_unavailable()
        # every rank must agree, or the collectives below would hang
        reasons = [None] * self.world_size
        dist.all_gather_object(reasons, reason, group=group)
        bad = [r for r in reasons if r]
        if bad:
            if backend == "cute":
                from rackbed.kernels.peer_memory import PeerAccessError

                raise PeerAccessError(f"PeerAllReduce: backend='cute' unavailable: {bad[0]}")
            self.fallback_reason = bad[0]
            return
        from rackbed.kernels import allreduce_cute
        from rackbed.kernels.peer_memory import PeerBuffer

        self.layout = make_layout(self.world_size, self.max_bytes, max_blocks)
        try:
            self._buf = PeerBuffer(group, self.layout.total_bytes, exchange=exchange)
        except Exception as exc:
            if backend == "cute":
                raise
            self.fallback_reason = f"peer buffer: {exc}"
            return
        self._cute = allreduce_cute
        # peer table in this rank's buffer: bases (global rank order), rank, own base
        import numpy as np

        from rackbed.kernels.peer_memory import check

        table = np.array(self._buf.ptrs + [self.rank, self._buf.local_ptr], dtype=np.int64)
        check(self._buf._drv.cuMemcpyHtoD(self._buf.local_ptr + self.layout.table_off, table, table.nbytes),
              "cuMemcpyHtoD")
        self._table = self._buf.local_ptr + self.layout.table_off
        self._err = np.zeros(1, dtype=np.int32)
        self._compiled: dict = {}
        self._plans: dict = {}
        self._device_index = torch.cuda.current_device()
        # the raw current-stream handle without building a torch.cuda.Stream object (~0.2 µs instead of ~2 µs)
        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        self._stream = raw if raw is not None else (lambda d: torch.cuda.current_stream(d).cuda_stream)
        self.backend = "cute"
        dist.barrier(group=group)
        for algo in ALGOS:  # compile up front: the first call of a collective should not take seconds
            self._kernel(algo, _dtype_name(self.dtype), 16 // self.dtype.itemsize)

    def _cute_unavailable(self) -> str | None:
        import torch

        if not torch.cuda.is_available():
            return "no CUDA device"
        try:
            import cuda.bindings.driver  # noqa: F401
            import cutlass.cute  # noqa: F401
        except Exception as exc:
            return f"cuda-python / CuTe DSL not importable ({type(exc).__name__}: {exc})"
        return None

    def _kernel(self, algo: str, dt: str, vec: int):
        """The compiled kernel; a first use compiles it on every rank (same call sequence), then barriers so no
        rank's kernel spins on a peer that is still compiling (not allowed inside graph capture)."""
        key = (algo, dt, vec)
        fn = self._compiled.get(key)
        if fn is None:
            import torch
            import torch.distributed as dist

            if torch.cuda.is_current_stream_capturing():
                raise ValueError(f"PeerAllReduce: variant {key} first used inside CUDA graph capture; "
                                 "call it once before capturing")
            fn = self._compiled[key] = self._cute.compiled(algo, dt, vec, self.world_size, 512, self.layout)
            dist.barrier(group=self.group)
        return fn

    def algo_for(self, n_bytes: int) -> str:
        """The schedule ``algo="auto"`` uses for a tensor of ``n_bytes`` bytes."""
        return select_algo(n_bytes, self.world_size, self.one_shot_max_bytes, self.two_shot_algo)

    def all_reduce(self, tensor, out=None, *, algo: str = "auto", use_jit: bool = False):
        """Sum ``tensor`` over the group; returns ``out`` (allocated like ``tensor`` when None).

        ``tensor`` and ``out``: same shape, dtype (bf16/fp32) and device, contiguous; ``out`` may be ``tensor``.
        ``use_jit`` launches through CuTe DSL's own call path instead of ``cuLaunchKernel`` (for comparison).
        A repeated call with the same size, dtype, algo and pointer alignment takes a cached plan: only the
        shape/dtype/contiguity checks run before the launch.
        """
        import torch

        if out is None:
            out = torch.empty_like(tensor, memory_format=torch.contiguous_format)
        if self.backend == "cute":
            key = (tensor.numel(), tensor.dtype, algo, tensor.data_ptr() & 15, out.data_ptr() & 15)
            plan = self._plans.get(key)
            if (plan is not None and out.shape == tensor.shape and out.dtype is tensor.dtype and tensor.is_cuda
                    and tensor.device == out.device and tensor.is_contiguous() and out.is_contiguous()):
                launcher, n_vec, grid = plan
                launcher(tensor.data_ptr(), out.data_ptr(), self._table, n_vec, grid,
                         self._stream(self._device_index), use_jit)
                return out
        if algo not in ("auto",) + ALGOS:
            raise ValueError(f"PeerAllReduce.all_reduce: algo={algo!r} must be 'auto' or one of {ALGOS}")
        if out.shape != tensor.shape or out.dtype != tensor.dtype or out.device != tensor.device:
            raise ValueError(f"PeerAllReduce.all_reduce: out {tuple(out.shape)} {out.dtype} {out.device} does not "
                             f"match tensor {tuple(tensor.shape)} {tensor.dtype} {tensor.device}")
        dt = _dtype_name(tensor.dtype)
        n_bytes = tensor.numel() * tensor.element_size()
        if n_bytes > self.max_bytes:
            raise ValueError(f"PeerAllReduce.all_reduce: tensor of {n_bytes} bytes exceeds max_bytes={self.max_bytes}")
        if not tensor.is_contiguous() or not out.is_contiguous():
            raise ValueError("PeerAllReduce.all_reduce: tensor and out must be contiguous")
        if self.backend == "torch":
            import torch.distributed as dist

            if out.data_ptr() != tensor.data_ptr():
                out.copy_(tensor)
            dist.all_reduce(out, group=self.group)
            return out
        if tensor.device != torch.device("cuda", self._device_index):
            raise ValueError(f"PeerAllReduce.all_reduce: tensor on {tensor.device}, expected cuda:{self._device_index}")
        if tensor.numel() == 0:
            return out
        a = algo if algo != "auto" else self.algo_for(n_bytes)
        shape = launch_shape(tensor.numel(), dt, self.world_size, a, self.max_blocks, tensor.data_ptr(),
                             out.data_ptr())
        launcher = self._kernel(a, dt, shape.vec)
        self._plans[(tensor.numel(), tensor.dtype, algo, tensor.data_ptr() & 15, out.data_ptr() & 15)] = (
            launcher, shape.n_vec, shape.grid)
        launcher(tensor.data_ptr(), out.data_ptr(), self._table, shape.n_vec, shape.grid,
                 self._stream(self._device_index), use_jit)
        return out

    def check_error(self) -> None:
        """Raise if a kernel timed out waiting for a peer (reads the error word; synchronizes the device)."""
        import torch

        if self.backend != "cute":
            return
        torch.cuda.synchronize()
        from rackbed.kernels.peer_memory import check

        check(self._buf._drv.cuMemcpyDtoH(self._err, self._buf.local_ptr + self.layout.err_off, 4), "cuMemcpyDtoH")
        if int(self._err[0]):
            raise RuntimeError(f"PeerAllReduce: rank {self.rank}: a peer did not answer within the spin timeout")

    def close(self) -> None:
        if self._buf is not None:
            self._buf.close()
            self._buf = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
