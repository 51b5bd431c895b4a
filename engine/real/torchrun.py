"""Real runs under torchrun, the transport: commands, replies and liveness between hosts through a c10d store.

The entry is ``engine/cli/torchrun.py`` (``torchrun ... -m rackbed.engine.cli.torchrun SCENARIO``): one process per GPU of
the topology, global rank = topology GPU id; global rank 0 also runs the driver. This module holds what crosses
hosts. Rank 0 hosts a TCPStore at ``MASTER_PORT + 1``, listening only on the address it is told
(:func:`listen_socket`: ``$RACKBED_STORE_BIND``, else ``MASTER_ADDR`` — loopback for a single-host run).
Commands and replies are sealed messages (``engine.real.wire``: JSON values, a version, an HMAC under the run's
token, a schema check; never pickles) in :class:`StoreQueue` s (one writer counter per queue, one reader, a key
deleted once read). Liveness is a sealed heartbeat per rank carrying a sequence number (:func:`heartbeat`); the
driver notes on its own monotonic clock when each rank's number last grew, and a rank whose number has not grown
for ``RACKBED_DEAD_AFTER_S`` (10 s) becomes a fault of its GPU, exactly as a dead local process does
(:func:`store_pool`: the driver's :class:`~engine.real.driver.RankPool` over the store). No host's wall clock is
compared with another's.
"""

from __future__ import annotations

import os
import queue
import socket
import sys
import threading
import time
from datetime import timedelta

from rackbed.engine.real.wire import BadMessage, check_command, check_reply, seal, unseal
from rackbed.topology.errors import UserError

DEAD_AFTER_S = float(os.environ.get("RACKBED_DEAD_AFTER_S", "10"))
BIND_ENV = "RACKBED_STORE_BIND"


def listen_socket(bind: str, port: int) -> socket.socket:
    """A listening socket on ``bind``:``port`` only (not every interface) for rank 0's store."""
    try:
        fam, _, _, _, addr = socket.getaddrinfo(bind, port, type=socket.SOCK_STREAM)[0]
        s = socket.socket(fam, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(addr)
        s.listen(1024)
    except OSError as exc:
        raise UserError(f"store: cannot listen on {bind}:{port} ({exc}); set ${BIND_ENV} to this host's address "
                        "on the network the other hosts reach it by") from None
    return s


def open_store(host: str, port: int, *, world: int | None = None, listen: socket.socket | None = None,
               timeout_s: float = 120.0):
    """A client of the store at ``host``:``port``, or (``listen`` given, rank 0) the store itself on that socket
    (the store takes the socket over: ``listen`` is detached and must not be used again)."""
    import torch.distributed as dist

    if listen is None:
        return dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))
    return dist.TCPStore(host, port, world, True, timedelta(seconds=timeout_s), wait_for_workers=False,
                         master_listen_fd=listen.detach())


def _refuse(msg: str) -> None:
    print(f"rackbed: refused a store message: {msg}", file=sys.stderr, flush=True)


class StoreQueue:
    """A FIFO over a c10d store: ``put`` from any process, ``get`` from one. Same interface as ``mp.Queue``.

    ``check`` validates a decoded body (``wire.check_command`` / ``check_reply``); a message that fails the MAC,
    version, index or schema check is refused with one line on stderr and skipped (nothing acts on it)."""

    def __init__(self, store, name: str, token: bytes, check) -> None:
        self.store, self.name, self.token, self.check, self.read = store, name, token, check, 0
        self.refused = 0

    def put(self, obj) -> None:
        i = self.store.add(f"{self.name}/n", 1)
        self.store.set(f"{self.name}/{i}", seal(self.token, self.name, i, obj))

    def get(self, timeout: float | None = None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            i = self.read + 1
            key = f"{self.name}/{i}"
            while not self.store.check([key]):
                if deadline is not None and time.monotonic() >= deadline:
                    raise queue.Empty
                time.sleep(0.0005)
            data = self.store.get(key)
            self.store.delete_key(key)
            self.read = i
            try:
                return self.check(unseal(self.token, self.name, i, data), f"{self.name}#{i}")
            except BadMessage as exc:
                self.refused += 1
                _refuse(str(exc))

    def get_nowait(self):
        return self.get(timeout=0.0)


def command_queue(store, rank: int, token: bytes) -> StoreQueue:
    return StoreQueue(store, f"cmd/{rank}", token, check_command)


def reply_queue(store, world: int, token: bytes) -> StoreQueue:
    return StoreQueue(store, "res", token, lambda m, where: check_reply(m, world, where))


class _RemoteProc:
    """What the driver needs of a rank process it did not start: liveness from the heartbeat's sequence number,
    timed on this process's monotonic clock (module docstring)."""

    def __init__(self, store, rank: int, token: bytes, dead_after_s: float = DEAD_AFTER_S) -> None:
        self.store, self.rank, self.token, self.exitcode = store, rank, token, None
        self.dead_after_s = dead_after_s
        self.seq, self.seen = 0, time.monotonic()

    def check(self) -> None:
        if self.exitcode is not None:
            return
        key = f"hb/{self.rank}"
        try:
            if self.store.check([key]):
                seq, _ = unseal(self.token, key, None, self.store.get(key))
                if seq > self.seq:
                    self.seq, self.seen = seq, time.monotonic()
        except BadMessage as exc:
            _refuse(str(exc))
        if time.monotonic() - self.seen > self.dead_after_s:
            self.exitcode = -1

    def is_alive(self) -> bool:
        return self.exitcode is None

    def kill(self) -> None:  # cannot kill a remote process; the drill is for local runs
        pass

    def join(self, timeout=None) -> None:
        pass


def store_pool(store, world: int, token: bytes):
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

    procs = [_RemoteProc(store, r, token) for r in range(world)]
    return StorePool(procs, [command_queue(store, r, token) for r in range(world)], reply_queue(store, world, token),
                     {r: r for r in range(world)})


def heartbeat(host: str, port: int, rank: int, token: bytes, stop: threading.Event, every_s: float = 1.0) -> None:
    """Write a sealed, numbered beat to ``hb/<rank>`` every ``every_s`` until ``stop`` is set."""
    st = open_store(host, port, timeout_s=60)
    seq = 0
    key = f"hb/{rank}"
    while not stop.is_set():
        seq += 1
        st.set(key, seal(token, key, seq, None))
        stop.wait(every_s)
