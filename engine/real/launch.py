"""Process launch for the real engine: one process per rank under torch.distributed.

``spawn_local(fn, world_size, *args)`` starts ``world_size`` processes on this host (gloo on CPU, NCCL when each
rank has a GPU), rendezvous through a temporary file, and returns each rank's return value (pickled back through a
queue: a pipe between this process and the children it started, which nothing else writes to). The children end
with this process (``engine.loop.lifetime``). Multi-node launches go through torchrun's rendezvous instead (see the README); the rank function is the same.
"""

from __future__ import annotations

import os
import tempfile
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class RankFailed(RuntimeError):
    """A rank process raised or died; carries the rank and its error text."""


def _entry(rank: int, world: int, init_file: str, backend: str, fn, args, q, ack=None) -> None:
    from rackbed.engine.loop.lifetime import die_with_parent

    die_with_parent()   # ends with the launcher, even a killed one
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")               # never NVLink multicast (see kernels/README.md)
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world)
        out = fn(rank, world, *args)
        q.put((rank, "ok", out))
        # tensors in ``out`` cross as shared-memory file descriptors, fetched from this process when the parent
        # unpickles them: exiting before that makes the parent's get fail (EOFError on a loaded machine)
        if ack is not None:
            ack.wait(timeout=120)
    except BaseException as exc:  # report every failure to the parent, with its traceback
        q.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def spawn_local(fn, world_size: int, *args, backend: str | None = None, timeout_s: float = 300.0) -> list:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` processes; return the results by rank."""
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= world_size else "gloo"
    ctx = mp.get_context("spawn")
    q, ack = ctx.Queue(), ctx.Event()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = str(Path(tmp) / "rendezvous")
        procs = [ctx.Process(target=_entry, args=(r, world_size, init_file, backend, fn, args, q, ack), daemon=False)
                 for r in range(world_size)]
        for p in procs:
            p.start()
        results: dict[int, object] = {}
        errors: list[str] = []
        import queue as _q
        import time as _time

        deadline = _time.monotonic() + timeout_s
        while len(results) + len(errors) < world_size:
            try:
                rank, status, payload = q.get(timeout=1.0)
            except _q.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if dead or _time.monotonic() > deadline:
                    for p in procs:
                        p.kill()
                    why = f"rank(s) {dead} died" if dead else f"timed out after {timeout_s:.0f} s"
                    raise RankFailed(why) from None
                continue
            if status == "ok":
                results[rank] = payload
            else:
                errors.append(f"rank {rank}: {payload}")
        ack.set()
        for p in procs:
            p.join(timeout=30)
        if errors:
            raise RankFailed(errors[0])
        return [results[r] for r in range(world_size)]
