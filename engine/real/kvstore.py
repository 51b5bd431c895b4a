"""The key-value store of a multi-node real run: a TCP server serving only clients that hold the run's token.

Rank 0 runs :class:`StoreServer` on the socket ``engine.real.torchrun.listen_socket`` gives it; every process
(rank 0's driver too) talks to it through a :class:`StoreClient`. A connection is served only after a
handshake: the server sends a fresh random challenge, the client answers with HMAC-SHA256(token, challenge); a
wrong answer, or none within :data:`HANDSHAKE_S`, closes the connection. A client without the token therefore
reads, writes and deletes nothing, and what it can cost the run is bounded:

- **time**: nothing it does touches a key, so it cannot delay a message of a started run. Its connections wait
  for their handshake at most :data:`HANDSHAKE_S` (2 s) each and at most :data:`MAX_PENDING` (64) at once: a
  new connection beyond them drops the oldest waiting one, so a rank connecting at start is kept out only by a
  client opening more than ``MAX_PENDING`` connections per handshake round trip (a millisecond on a LAN), and
  a rank that cannot get in fails after its connect timeout (``timeout_s``, 60 s) with one line;
- **memory**: the server reads at most :data:`CHALLENGE_BYTES` (32) from a connection before its handshake, so
  such a client holds at most ``MAX_PENDING`` sockets, threads and 32-byte buffers on rank 0. Token holders
  are bounded too: a key at most :data:`MAX_KEY` bytes, a value at most :data:`MAX_VALUE` (16 MiB), at most
  :data:`MAX_KEYS` keys and :data:`MAX_HELD` (256 MiB) of values held (a write past them is refused with an
  error), at most :data:`MAX_CLIENTS` connections;
- **logs**: every refused connection (and every message ``engine.real.torchrun`` refuses) is counted in
  :data:`REFUSALS`, which prints at most :data:`LOG_LINES` (5) lines per :data:`LOG_WINDOW_S` (10 s) per
  process and counts the rest (the run's report carries the counts).

Requests after the handshake: one byte op (``S`` set, ``G`` get, ``C`` check, ``D`` delete, ``A`` add; ``W``
wait for a key and get it, ``T`` wait for a key and take it, both for at most the milliseconds the value gives
and at most :data:`MAX_WAIT_S`), a 2-byte key length, a 4-byte value length, the key, the value; the reply is
a status byte (0 ok, 1 absent, 2 refused), a 4-byte length and the data. A client gives up on a request not
answered within :data:`ANSWER_S` (60 s) and does not use that connection again. The values are sealed messages
(``engine.real.wire``): the store decides who may write, the seal binds each message to its run, queue and
slot.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import socket
import struct
import sys
import threading
import time

from rackbed.engine.real.wire import TOKEN_ENV

MAGIC = b"RKBS1"
CHALLENGE_BYTES = 32
#: seconds a connection has to answer the challenge (the whole answer, however it trickles in)
HANDSHAKE_S = 2.0
#: connections waiting for their handshake; a new one beyond them drops the oldest
MAX_PENDING = 64
#: authenticated connections (a run opens about three per rank)
MAX_CLIENTS = 1024
MAX_KEY = 256
MAX_VALUE = 16 << 20
MAX_KEYS = 65536
MAX_HELD = 256 << 20
#: the longest one wait request blocks (a client waiting longer asks again)
MAX_WAIT_S = 1.0
#: a client gives up on a request the store has not answered in this long (rank 0's host gone silent)
ANSWER_S = 60.0
#: at most LOG_LINES refusal lines per LOG_WINDOW_S seconds per process; the rest are counted
LOG_LINES, LOG_WINDOW_S = 5, 10.0

_HEAD = struct.Struct("!cHI")
_REPLY = struct.Struct("!BI")
OK, ABSENT, REFUSED = 0, 1, 2


class StoreError(ConnectionError):
    """The store refused a request or the connection to it failed (one line)."""


class RefusalLog:
    """Counts what was refused (connections, messages) and prints at most ``lines`` lines per ``window_s``."""

    def __init__(self, lines: int = LOG_LINES, window_s: float = LOG_WINDOW_S, stream=None) -> None:
        self.lines, self.window_s, self.stream = lines, window_s, stream
        self.counts: dict[str, int] = {}
        self.suppressed = 0
        self._lock = threading.Lock()
        self._window_t, self._printed, self._held_back = -float("inf"), 0, 0

    def note(self, kind: str, msg: str) -> None:
        now = time.monotonic()
        with self._lock:
            self.counts[kind] = self.counts.get(kind, 0) + 1
            out = []
            if now - self._window_t >= self.window_s:
                if self._held_back:
                    out.append(f"rackbed: {self._held_back} more refusals not shown in the last "
                               f"{self.window_s:g} s (counted in the run's report)")
                self._window_t, self._printed, self._held_back = now, 0, 0
            if self._printed < self.lines:
                self._printed += 1
                out.append(f"rackbed: refused {msg}")
            else:
                self._held_back += 1
                self.suppressed += 1
        for line in out:
            print(line, file=self.stream or sys.stderr, flush=True)

    def reset(self) -> None:
        with self._lock:
            self.counts.clear()
            self.suppressed = 0
            self._window_t, self._printed, self._held_back = -float("inf"), 0, 0

    def report(self) -> dict:
        """``{kind: count, ..., "log_lines_suppressed": n}`` (every kind seen, and the lines not printed)."""
        with self._lock:
            return {**dict(sorted(self.counts.items())), "log_lines_suppressed": self.suppressed}


#: this process's refusals: the store server's connections, the queues' and heartbeats' messages
REFUSALS = RefusalLog()


def _answer(token: bytes, challenge: bytes) -> bytes:
    return hmac.new(token, b"rackbed-store|" + challenge, hashlib.sha256).digest()


def _recv_exact(conn: socket.socket, n: int, deadline: float | None = None) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("timed out")
            conn.settimeout(left)
        chunk = conn.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            raise ConnectionError("connection closed")
        buf += chunk
    return bytes(buf)


class StoreServer:
    """The store, served on ``listen`` (a listening socket) to clients that answer the handshake with
    ``token``."""

    def __init__(self, listen: socket.socket, token: bytes, log: RefusalLog = REFUSALS) -> None:
        self.listen, self.token, self.log = listen, token, log
        self.data: dict[str, bytes] = {}
        self.held = 0
        self._pending: dict[socket.socket, None] = {}   # connections before their handshake, oldest first
        self.clients = 0
        self._lock = threading.Lock()
        self._waiters: dict[str, list[threading.Event]] = {}   # key -> requests waiting for it
        self._closed = False
        self._conns: set[socket.socket] = set()
        threading.Thread(target=self._accept, name="store-accept", daemon=True).start()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            for evs in self._waiters.values():
                for ev in evs:
                    ev.set()
            conns = list(self._conns)
        for c in [self.listen, *conns]:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            c.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, addr = self.listen.accept()
            except OSError:
                return
            with self._lock:
                full = self.clients >= MAX_CLIENTS
                oldest = next(iter(self._pending)) if len(self._pending) >= MAX_PENDING and not full else None
                if oldest is not None:
                    del self._pending[oldest]
                if not full:
                    self._pending[conn] = None
                    self._conns.add(conn)
            if full:
                conn.close()
                self.log.note("store_connections_refused",
                              f"a store connection from {addr[0]}: {MAX_CLIENTS} clients already")
                continue
            if oldest is not None:          # its thread sees the shutdown, refuses it and closes it
                try:
                    oldest.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            threading.Thread(target=self._serve, args=(conn, addr), name="store-conn", daemon=True).start()

    @property
    def pending(self) -> int:
        """Connections waiting for their handshake."""
        with self._lock:
            return len(self._pending)

    def _serve(self, conn: socket.socket, addr) -> None:
        authed = False
        try:
            challenge = secrets.token_bytes(CHALLENGE_BYTES)
            try:
                conn.settimeout(HANDSHAKE_S)
                conn.sendall(MAGIC + challenge)
                got = _recv_exact(conn, CHALLENGE_BYTES, time.monotonic() + HANDSHAKE_S)
            except (OSError, TimeoutError):
                self.log.note("store_connections_refused",
                              f"a store connection from {addr[0]}: no handshake answer "
                              f"(at most {HANDSHAKE_S:g} s, "
                              f"{MAX_PENDING} waiting at once)")
                return
            if not hmac.compare_digest(got, _answer(self.token, challenge)):
                self.log.note("store_connections_refused",
                              f"a store connection from {addr[0]}: wrong handshake (not this run's token)")
                return
            with self._lock:
                if self._pending.pop(conn, "gone") is not None:
                    return                  # dropped for a newer connection while it answered
                self.clients += 1
                authed = True
            conn.settimeout(None)
            conn.sendall(bytes([OK]))
            while not self._closed:
                op, klen, vlen = _HEAD.unpack(_recv_exact(conn, _HEAD.size))
                if klen > MAX_KEY or vlen > MAX_VALUE:
                    conn.sendall(_REPLY.pack(REFUSED, 0))
                    return
                key = _recv_exact(conn, klen).decode("utf-8", "replace")
                value = _recv_exact(conn, vlen) if vlen else b""
                status, out = self._do(op, key, value)
                conn.sendall(_REPLY.pack(status, len(out)) + out)
        except (OSError, ConnectionError, struct.error):
            return
        finally:
            with self._lock:
                if authed:
                    self.clients -= 1
                self._pending.pop(conn, None)
                self._conns.discard(conn)
            conn.close()

    def _do(self, op: bytes, key: str, value: bytes) -> tuple[int, bytes]:
        with self._lock:
            old = self.data.get(key)
            if op in (b"W", b"T"):
                if len(value) != 4:
                    return REFUSED, b""
                wait_s = min(struct.unpack("!I", value)[0] / 1000, MAX_WAIT_S)
                if old is None and wait_s > 0 and not self._closed:
                    ev = threading.Event()          # set by the write of this key (only its waiters wake)
                    self._waiters.setdefault(key, []).append(ev)
                    self._lock.release()
                    try:
                        ev.wait(wait_s)
                    finally:
                        self._lock.acquire()
                        evs = self._waiters[key]
                        evs.remove(ev)
                        if not evs:
                            del self._waiters[key]
                    old = self.data.get(key)
                if old is None:
                    return ABSENT, b""
                if op == b"T":
                    self.held -= len(self.data.pop(key))
                return OK, old
            if op == b"G":
                return (OK, old) if old is not None else (ABSENT, b"")
            if op == b"C":
                return (OK, b"") if old is not None else (ABSENT, b"")
            if op == b"D":
                if old is None:
                    return ABSENT, b""
                self.held -= len(self.data.pop(key))
                return OK, b""
            if op == b"A":
                if len(value) != 8 or (old is not None and len(old) != 8):
                    return REFUSED, b""
                base = struct.unpack("!q", old)[0] if old else 0
                value = struct.pack("!q", base + struct.unpack("!q", value)[0])
            elif op != b"S":
                return REFUSED, b""
            grow = len(value) - (len(old) if old is not None else 0)
            if self.held + grow > MAX_HELD or (old is None and len(self.data) >= MAX_KEYS):
                return REFUSED, b""
            self.data[key] = value
            self.held += grow
            for ev in self._waiters.get(key, ()):
                ev.set()
            return OK, value if op == b"A" else b""


class StoreClient:
    """A connection to the store at ``host``:``port`` (``set``, ``get``, ``wait_get``, ``check``,
    ``delete_key``, ``add``); connecting retries until ``timeout_s`` (the server may start later)."""

    def __init__(self, host: str, port: int, token: bytes, timeout_s: float = 60.0) -> None:
        self.where = f"{host}:{port}"
        self._lock = threading.Lock()
        self.server: StoreServer | None = None
        deadline = time.monotonic() + timeout_s
        last = None
        while True:
            try:
                self.sock = self._connect(host, port, token, deadline)
                return
            except (OSError, ConnectionError) as exc:
                last = exc
            if time.monotonic() >= deadline:
                raise StoreError(f"store {self.where}: could not connect within {timeout_s:g} s ({last})")
            time.sleep(0.1)

    @staticmethod
    def _connect(host: str, port: int, token: bytes, deadline: float) -> socket.socket:
        s = socket.create_connection((host, port), timeout=max(0.1, min(5.0, deadline - time.monotonic())))
        try:
            hello = _recv_exact(s, len(MAGIC) + CHALLENGE_BYTES, time.monotonic() + HANDSHAKE_S)
            if not hello.startswith(MAGIC):
                raise ConnectionError("not a rackbed store")
            s.sendall(_answer(token, hello[len(MAGIC):]))
            try:
                ok = _recv_exact(s, 1, time.monotonic() + HANDSHAKE_S) == bytes([OK])
            except (OSError, ConnectionError):
                ok = False
            if not ok:
                raise ConnectionError(f"the store refused the handshake (is ${TOKEN_ENV} the same on every "
                                      "host?)")
        except BaseException:
            s.close()
            raise
        s.settimeout(ANSWER_S)
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return s

    def _call(self, op: bytes, key: str, value: bytes = b"") -> tuple[int, bytes]:
        k = key.encode()
        if len(k) > MAX_KEY or len(value) > MAX_VALUE:
            raise StoreError(f"store {self.where}: {op.decode()} {key!r}: key or value too large "
                             f"({len(k)} / {len(value)} bytes; at most {MAX_KEY} / {MAX_VALUE})")
        with self._lock:
            try:
                self.sock.sendall(_HEAD.pack(op, len(k), len(value)) + k + value)
                status, n = _REPLY.unpack(_recv_exact(self.sock, _REPLY.size))
                out = _recv_exact(self.sock, n) if n else b""
            except (OSError, ConnectionError, struct.error) as exc:
                self.sock.close()           # a request half answered leaves the stream out of step
                why = str(exc) or type(exc).__name__
                raise StoreError(f"store {self.where}: connection lost ({why})") from None
        if status == REFUSED:
            raise StoreError(f"store {self.where}: {op.decode()} {key!r} refused (store full: at most "
                             f"{MAX_KEYS} keys and {MAX_HELD >> 20} MiB)")
        return status, out

    def set(self, key: str, value) -> None:
        self._call(b"S", key, value.encode() if isinstance(value, str) else bytes(value))

    def get(self, key: str) -> bytes:
        status, out = self._call(b"G", key)
        if status == ABSENT:
            raise KeyError(key)
        return out

    def wait_get(self, key: str, timeout_s: float, take: bool = False) -> bytes | None:
        """``key``'s value once it is there (deleted from the store if ``take``), or None after
        ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while True:
            ms = max(0, min(int((deadline - time.monotonic()) * 1000), int(MAX_WAIT_S * 1000)))
            status, out = self._call(b"T" if take else b"W", key, struct.pack("!I", ms))
            if status == OK:
                return out
            if time.monotonic() >= deadline:
                return None

    def check(self, keys: list[str]) -> bool:
        return all(self._call(b"C", k)[0] == OK for k in keys)

    def delete_key(self, key: str) -> bool:
        return self._call(b"D", key)[0] == OK

    def add(self, key: str, n: int) -> int:
        return struct.unpack("!q", self._call(b"A", key, struct.pack("!q", n))[1])[0]

    def close(self) -> None:
        try:
            self.sock.close()
        finally:
            if self.server is not None:
                self.server.close()
