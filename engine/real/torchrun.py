"""Real runs under torchrun, the transport: commands, replies and liveness between hosts through a store.

The entry is ``engine/cli/torchrun.py`` (``torchrun ... -m rackbed.engine.cli.torchrun SCENARIO``): one
process per GPU of the topology, global rank = topology GPU id; global rank 0 also runs the driver. This
module holds what crosses hosts. Rank 0 hosts the store (``engine.real.kvstore``: served only to clients that
prove the run's token) at ``MASTER_PORT + 1``, listening only on the address it is told
(:func:`listen_socket`: ``$RACKBED_STORE_BIND``, else ``MASTER_ADDR`` — loopback for a single-host run). At
start every process agrees on the run's nonce (:func:`agree_run`). Commands and replies are sealed messages
(``engine.real.wire``: JSON values, a version, the run nonce, an HMAC under the run's token, a schema check;
never pickles) in :class:`StoreQueue` s (one writer counter per queue, one reader, a key taken out as it is
read). Liveness is a sealed heartbeat per rank carrying a number that grows (:func:`heartbeat`); the driver
notes on its own monotonic clock when each rank's number last grew, and a rank whose number has not grown for
``RACKBED_DEAD_AFTER_S`` (10 s) becomes a fault of its GPU, exactly as a dead local process does
(:func:`store_pool`: the driver's :class:`~engine.real.driver.RankPool` over the store). No host's wall clock
is compared with another's. A beat also carries its process's refusal counts, which rank 0 writes to the run's
report (``real.json``: ``store_refusals``).
"""

from __future__ import annotations

import os
import queue
import secrets
import socket
import sys
import threading
import time

from rackbed.engine.real.kvstore import REFUSALS, StoreClient, StoreError, StoreServer
from rackbed.engine.real.wire import TOKEN_ENV, BadMessage, check_command, check_reply, seal, unseal
from rackbed.topology.errors import UserError

DEAD_AFTER_S = float(os.environ.get("RACKBED_DEAD_AFTER_S", "10"))
#: the driver reads a rank's beat at most this often (one store request per rank each time)
READ_BEAT_EVERY_S = 0.1
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
        raise UserError(f"store: cannot listen on {bind}:{port} ({exc}); set ${BIND_ENV} to this host's "
                        "address on the network the other hosts reach it by") from None
    return s


def open_store(host: str, port: int, token: bytes, *, listen: socket.socket | None = None,
               timeout_s: float = 60.0):
    """A client of the store at ``host``:``port`` (``engine.real.kvstore``), or (``listen`` given, rank 0)
    first the store itself on that socket, served to clients holding ``token``, then a client of it (closing
    that client closes the store)."""
    server = StoreServer(listen, token) if listen is not None else None
    client = StoreClient(host, port, token, timeout_s=timeout_s)
    client.server = server
    return client


def _refuse(kind: str, msg: str) -> None:
    REFUSALS.note(kind, f"a store message: {msg}")


def agree_run(store, rank: int, world: int, token: bytes, timeout_s: float = 120.0) -> str:
    """The run's nonce, which every later message is bound to (``engine.real.wire``): each process writes a
    fresh random ``hello/<rank>``; rank 0 draws the nonce and writes ``run``: the nonce and every hello,
    sealed; a process takes the nonce only from a ``run`` that carries its own hello, so an announcement
    recorded in another run (or an earlier start) is refused. Raises :class:`~engine.real.wire.BadMessage`
    after ``timeout_s`` without one."""
    mine = secrets.token_hex(16)
    store.set(f"hello/{rank}", seal(token, "", f"hello/{rank}", 0, mine))
    deadline = time.monotonic() + timeout_s

    def read(key: str, check):
        while time.monotonic() < deadline:
            data = store.wait_get(key, min(1.0, max(0.0, deadline - time.monotonic())))
            if data is None:
                continue
            try:
                return check(unseal(token, "", key, 0, data))
            except BadMessage as exc:
                _refuse("messages_refused", str(exc))
                time.sleep(0.05)
        raise BadMessage(f"{key}: no valid message within {timeout_s:g} s (do all hosts share ${TOKEN_ENV}?)")

    def a_hello(v, key):
        if not (isinstance(v, str) and len(v) == 32):
            raise BadMessage(f"{key}: a hello is 32 hex characters")
        return v

    if rank == 0:
        hellos = [read(f"hello/{r}", lambda v, r=r: a_hello(v, f"hello/{r}")) for r in range(world)]
        store.set("run", seal(token, "", "run", 0, {"nonce": secrets.token_hex(16), "hello": hellos}))

    def announcement(doc):
        if not (isinstance(doc, dict) and isinstance(doc.get("nonce"), str)
                and isinstance(doc.get("hello"), list) and len(doc["hello"]) == world):
            raise BadMessage("run: an announcement is {nonce, hello: one per rank}")
        if doc["hello"][rank] != mine:
            raise BadMessage(f"run: announces another start (rank {rank}'s hello is not in it)")
        return doc["nonce"]

    return read("run", announcement)


_SKIP = object()


class StoreQueue:
    """A FIFO over the store: ``put`` from any process, ``get`` from one. Same interface as ``mp.Queue``.

    Messages are sealed for run ``run`` (its nonce, :func:`agree_run`), this queue and their slot. ``check``
    validates a decoded body (``wire.check_command`` / ``check_reply``); a message that fails the MAC,
    version, run, slot or schema check is refused (counted, one rate-limited line on stderr:
    ``kvstore.REFUSALS``): nothing acts on it. A refused message in a slot no writer has claimed yet (the
    queue's counter is below it) leaves the slot to the message still to come; in a claimed slot it is
    skipped. A reader holds one message at a time (at most ``kvstore.MAX_VALUE`` bytes) and takes it out of
    the store as it reads it."""

    def __init__(self, store, name: str, token: bytes, run: str, check, on_gone=None) -> None:
        self.store, self.name, self.token, self.run, self.check, self.read = store, name, token, run, check, 0
        self.refused = 0
        self.on_gone = on_gone      # what ``get`` returns once the store is gone (None: raise StoreError)

    def put(self, obj) -> None:
        i = self.store.add(f"{self.name}/n", 1)
        self.store.set(f"{self.name}/{i}", seal(self.token, self.run, self.name, i, obj))

    def get(self, timeout: float | None = None):
        try:
            return self._get(timeout)
        except StoreError as exc:
            if self.on_gone is None:
                raise
            print(f"rackbed: {self.name}: {exc}; stopping", file=sys.stderr, flush=True)
            return self.on_gone

    def _get(self, timeout: float | None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            i = self.read + 1
            left = 1.0 if deadline is None else max(0.0, deadline - time.monotonic())
            data = self.store.wait_get(f"{self.name}/{i}", left, take=True)
            if data is None:
                if deadline is not None and time.monotonic() >= deadline:
                    raise queue.Empty
                continue
            try:
                out = self.check(unseal(self.token, self.run, self.name, i, data), f"{self.name}#{i}")
            except BadMessage as exc:
                self.refused += 1
                _refuse("messages_refused", str(exc))
                if self.store.add(f"{self.name}/n", 0) < i:
                    continue        # written ahead of every writer: slot i's message is still to come
                out = _SKIP         # slot i was claimed: its message is this one, or lost under it
            self.read = i
            if out is not _SKIP:
                return out

    def get_nowait(self):
        return self.get(timeout=0.0)


def command_queue(store, rank: int, token: bytes, run: str) -> StoreQueue:
    """Rank ``rank``'s commands; once the store is gone (rank 0 ended) the rank reads a ``stop``."""
    return StoreQueue(store, f"cmd/{rank}", token, run, check_command, on_gone=("stop", 0, {}))


def reply_queue(store, world: int, token: bytes, run: str) -> StoreQueue:
    return StoreQueue(store, "res", token, run, lambda m, where: check_reply(m, world, where))


class _RemoteProc:
    """What the driver needs of a rank process it did not start: liveness from the heartbeat's number, timed
    on this process's monotonic clock (module docstring), and the rank's refusal counts the beat carries."""

    def __init__(self, store, rank: int, token: bytes, run: str, dead_after_s: float = DEAD_AFTER_S) -> None:
        self.store, self.rank, self.token, self.run, self.exitcode = store, rank, token, run, None
        self.dead_after_s = dead_after_s
        self.seq, self.seen = 0, time.monotonic()
        self.refusals: dict[str, int] = {}
        self._read_t = -float("inf")

    def check(self) -> None:
        if self.exitcode is not None:
            return
        now = time.monotonic()
        if now - self._read_t >= READ_BEAT_EVERY_S:
            self._read_t = now
            self._read_beat()
        if time.monotonic() - self.seen > self.dead_after_s:
            self.exitcode = -1

    def _read_beat(self) -> None:
        key = f"hb/{self.rank}"
        try:
            data = self.store.wait_get(key, 0.0)
            if data is not None:
                seq, body = unseal(self.token, self.run, key, None, data)
                if not (isinstance(body, dict) and all(isinstance(k, str) and isinstance(v, int)
                                                        for k, v in body.items())):
                    raise BadMessage(f"{key}#{seq}: a beat's body is {{kind: count}}")
                if seq > self.seq:
                    self.seq, self.seen, self.refusals = seq, time.monotonic(), body
        except BadMessage as exc:
            _refuse("heartbeats_refused", str(exc))

    def is_alive(self) -> bool:
        return self.exitcode is None

    def kill(self) -> None:  # cannot kill a remote process; the drill is for local runs
        pass

    def join(self, timeout=None) -> None:
        pass


def store_pool(store, world: int, token: bytes, run: str):
    """The driver's rank pool over the store: every rank's command queue, one reply queue, heartbeat
    liveness."""
    from rackbed.engine.real.driver import RankPool

    class StorePool(RankPool):
        def newly_dead(self) -> list[int]:
            for p in self.procs:
                p.check()
            return super().newly_dead()

        def stop(self) -> None:
            for r, q in enumerate(self.cmd_qs):
                q.put(("stop", 0, {}))

        def refusals(self) -> dict:
            """What was refused: by this process (the store's connections, the driver's queues and heartbeats)
            and by each rank as of its last beat (``kvstore.RefusalLog.report``)."""
            return {"rank0_process": REFUSALS.report(),
                    "ranks": {r: p.refusals for r, p in enumerate(self.procs) if p.refusals}}

    procs = [_RemoteProc(store, r, token, run) for r in range(world)]
    return StorePool(procs, [command_queue(store, r, token, run) for r in range(world)],
                     reply_queue(store, world, token, run), {r: r for r in range(world)})


def heartbeat(host: str, port: int, rank: int, token: bytes, run: str, stop: threading.Event,
              every_s: float = 1.0) -> None:
    """Write a sealed beat to ``hb/<rank>`` every ``every_s`` until ``stop`` is set: bound to the run,
    numbered 1, 2, ... (the reader counts only a number above the last it saw), carrying this process's
    refusal counts."""
    st = open_store(host, port, token, timeout_s=60)
    seq = 0
    key = f"hb/{rank}"
    while not stop.is_set():
        seq += 1
        try:
            st.set(key, seal(token, run, key, seq, REFUSALS.report()))
        except StoreError:
            return          # the store is gone (rank 0 ended): the command queue says so and stops
        stop.wait(every_s)
