"""Sweep points as Ray tasks on a cluster (``rackbed sweep --ray-address HOST:PORT``): the one optional dependency
of the sweep runner (``ray``, the ``cluster`` extra), kept apart from ``sim.sweep``'s local process pool."""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable

from rackbed.topology.errors import UserError, one_line


def import_ray():
    try:
        import ray
    except ImportError:
        raise UserError("--ray-address: ray is not installed here (the cluster extra: pip install 'ray>=2.40'), "
                        "or drop --ray-address to run in local processes") from None
    return ray


def ray_precheck(address: str) -> None:
    """ray importable and, unless this process is already connected, something listening at ``host:port``:
    ``ray.init`` on a dead address retries for minutes before it gives up, so a typo fails here in seconds."""
    import socket

    ray = import_ray()
    if ray.is_initialized() or address in ("auto", "local"):
        return
    hostport = address.split("://", 1)[-1].rstrip("/")
    host, sep, port = hostport.rpartition(":")
    if not sep or not port.isdigit():
        raise UserError(f"--ray-address {address}: expected HOST:PORT (the head's GCS port, e.g. 10.0.0.1:6379) "
                        "or ray://HOST:PORT (Ray client)")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=5).close()
    except OSError as exc:
        raise UserError(f"--ray-address {address}: nothing answers there ({exc.strerror or exc}); start the "
                        "cluster (ray start --head) or fix the address") from None


def run_ray(payloads: list[dict], address: str, emit: Callable[[dict], None], run_point: Callable) -> None:
    """``run_point`` as Ray tasks (one CPU each) on the cluster at ``address``; records are emitted as tasks
    finish.

    A bounded window of tasks is in flight (four per cluster CPU, re-read as nodes join), so ``ray.wait`` stays
    cheap on a long sweep. On any exception, Ctrl-C included, the tasks in flight stop occupying the cluster: the
    connection opened here is shut down, which ends the job and its tasks; on a caller's connection they are
    cancelled (not forced: a forced cancel racing a finishing task can abort the driver in Ray 2.60). A task Ray
    itself fails (its worker died, e.g. out of memory, after Ray's retries; rackbed not importable on a node)
    becomes an ``error`` record, retried on the next run, not the end of the sweep. A Ray connection this process
    already has is used as is; one opened here is closed again."""
    import logging

    ray = import_ray()
    owned = not ray.is_initialized()
    if owned:
        try:
            ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING)
        except ConnectionError as exc:
            raise UserError(f"--ray-address {address}: {one_line(exc)}") from None
    try:
        task = ray.remote(num_cpus=1, max_retries=2)(run_point)
        it = iter(payloads)
        inflight: dict = {}
        window, checked = 0, -math.inf
        try:
            while True:
                if time.monotonic() - checked > 10.0:
                    window = max(8, 4 * int(ray.cluster_resources().get("CPU", 1)))
                    checked = time.monotonic()
                while len(inflight) < window:
                    pl = next(it, None)
                    if pl is None:
                        break
                    inflight[task.remote(pl)] = pl
                if not inflight:
                    break
                ready, _ = ray.wait(list(inflight), num_returns=1)
                for ref in ready:
                    pl = inflight.pop(ref)
                    try:
                        rec = ray.get(ref)
                    except ray.exceptions.RayError as exc:
                        rec = {"key": pl["key"], "index": pl["index"], "label": pl["label"],
                               "overrides": pl["overrides"], "status": "error",
                               "reason": f"ray: {type(exc).__name__}: {one_line(exc)}"[:2000], "wall_s": 0.0,
                               "pid": None}
                    emit(rec)
        except BaseException:
            if not owned:  # an owned connection is shut down below, which ends the job's tasks with it
                for ref in inflight:
                    with contextlib.suppress(Exception):  # best effort: the task may have finished meanwhile
                        ray.cancel(ref)
            raise
    finally:
        if owned:
            ray.shutdown()
