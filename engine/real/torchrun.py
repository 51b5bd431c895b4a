"""Real runs under torchrun, the transport: commands, replies and liveness between hosts through a c10d store.

The entry is ``engine/cli/torchrun.py`` (``torchrun ... -m rackbed.engine.cli.torchrun SCENARIO``): one process per GPU of
the topology, global rank = topology GPU id; global rank 0 also runs the driver. This module holds what crosses
hosts: commands and replies are pickled messages in a TCPStore that rank 0 hosts at ``MASTER_PORT + 1``
(:class:`StoreQueue`: one writer counter per queue, one reader); liveness is a heartbeat key per rank
(:func:`heartbeat`), so a rank that stops beating for ``RACKBED_DEAD_AFTER_S`` (10 s) becomes a fault of its GPU,
exactly as a dead local process does (:func:`store_pool`: the driver's :class:`~engine.real.driver.RankPool` over
the store).
"""

from __future__ import annotations

import os
import pickle
import queue
import threading
import time
from datetime import timedelta

DEAD_AFTER_S = float(os.environ.get("RACKBED_DEAD_AFTER_S", "10"))


class StoreQueue:
    """A FIFO over a c10d store: ``put`` from any process, ``get`` from one. Same interface as ``mp.Queue``."""

    def __init__(self, store, name: str) -> None:
        self.store, self.name, self.read = store, name, 0

    def put(self, obj) -> None:
        i = self.store.add(f"{self.name}/n", 1)
        self.store.set(f"{self.name}/{i}", pickle.dumps(obj))

    def get(self, timeout: float | None = None):
        key = f"{self.name}/{self.read + 1}"
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.store.check([key]):
            if deadline is not None and time.monotonic() >= deadline:
                raise queue.Empty
            time.sleep(0.0005)
        obj = pickle.loads(self.store.get(key))
        self.read += 1
        return obj

    def get_nowait(self):
        return self.get(timeout=0.0)


class _RemoteProc:
    """What the driver needs of a rank process it did not start: liveness from the heartbeat."""

    def __init__(self, store, rank: int) -> None:
        self.store, self.rank, self.exitcode = store, rank, None

    def check(self) -> None:
        if self.exitcode is None:
            try:
                beat = float(self.store.get(f"hb/{self.rank}").decode())
            except Exception:
                return
            if time.time() - beat > DEAD_AFTER_S:
                self.exitcode = -1

    def is_alive(self) -> bool:
        return self.exitcode is None

    def kill(self) -> None:  # cannot kill a remote process; the drill is for local runs
        pass

    def join(self, timeout=None) -> None:
        pass


def store_pool(store, world: int):
    """The driver's rank pool over the store: every rank's command queue, one reply queue, heartbeat liveness."""
    from rackbed.engine.real.driver import RankPool

    class StorePool(RankPool):
        def newly_dead(self) -> list[int]:
            for p in self.procs:
                p.check()
            return super().newly_dead()

        def stop(self) -> None:
            for r, q in enumerate(self.cmd_qs):
                q.put(("stop", 0, {}))

    procs = [_RemoteProc(store, r) for r in range(world)]
    return StorePool(procs, [StoreQueue(store, f"cmd/{r}") for r in range(world)], StoreQueue(store, "res"),
                     {r: r for r in range(world)})


def heartbeat(host: str, port: int, rank: int, stop: threading.Event) -> None:
    """Beat ``hb/<rank>`` once a second until ``stop`` is set (:class:`_RemoteProc` reads it)."""
    import torch.distributed as dist

    st = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=60))
    while not stop.is_set():
        st.set(f"hb/{rank}", str(time.time()))
        stop.wait(1.0)
