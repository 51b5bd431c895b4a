"""The store of a multi-node real run against a client without the run's token, on loopback: it reads and
writes nothing; it cannot hold up a message, grow the store host's memory past its handshake buffers, or flood
the log (refusals are counted, at most ``LOG_LINES`` lines per window are printed); token holders are bounded
too. Messages replayed from another run that shares the token (its announcement, commands, replies,
heartbeats) are refused and nothing acts on them."""

from __future__ import annotations

import queue
import socket
import struct
import threading
import time

import pytest

from rackbed.engine.real import kvstore
from rackbed.engine.real.kvstore import REFUSALS, StoreError
from rackbed.engine.real.torchrun import (
    _RemoteProc,
    agree_run,
    command_queue,
    listen_socket,
    open_store,
    reply_queue,
)
from rackbed.engine.real.wire import BadMessage, seal

TOKEN = b"0123456789abcdef" * 4


@pytest.fixture(autouse=True)
def _fresh_refusal_log():
    REFUSALS.reset()
    yield
    REFUSALS.reset()


@pytest.fixture
def store():
    ls = listen_socket("127.0.0.1", 0)
    st = open_store("127.0.0.1", ls.getsockname()[1], TOKEN, listen=ls, timeout_s=5)
    yield st
    st.close()


def _port(st) -> int:
    return int(st.where.rsplit(":", 1)[1])


def _until(cond, timeout_s: float = 5.0) -> bool:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


def _raw(port: int) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    assert s.recv(64).startswith(kvstore.MAGIC)           # the challenge
    return s


def _closed(s: socket.socket) -> bool:
    """The server closed ``s`` (end of stream, or a reset because it left bytes unread)."""
    s.settimeout(5)
    try:
        return s.recv(64) == b""
    except ConnectionResetError:
        return True


def _unauthenticated_set(port: int, key: str, value: bytes) -> None:
    """What a client without the token can try: a wrong answer to the challenge, then a request."""
    s = _raw(port)
    try:
        s.sendall(b"\0" * kvstore.CHALLENGE_BYTES + struct.pack("!cHI", b"S", len(key), len(value))
                  + key.encode() + value)
        s.recv(16)
    except OSError:
        pass
    finally:
        s.close()


@pytest.mark.slow
def test_a_client_without_the_token_writes_and_reads_nothing(store):
    """It tries to overwrite a reply waiting in the store: the driver reads the genuine reply at once."""
    res = reply_queue(store, 2, TOKEN, "r1")
    res.put((7, 1, "ok", None))
    _unauthenticated_set(_port(store), "res/1", b"junk")
    with pytest.raises(StoreError, match="could not connect.*refused the handshake.*RACKBED_RUN_TOKEN"):
        kvstore.StoreClient("127.0.0.1", _port(store), b"not the token" * 4, timeout_s=0.5)
    t0 = time.monotonic()
    assert res.get(timeout=5) == (7, 1, "ok", None) and time.monotonic() - t0 < 1.0
    assert _until(lambda: REFUSALS.report().get("store_connections_refused", 0) >= 2)
    assert "messages_refused" not in REFUSALS.report()


@pytest.mark.slow
def test_flooding_connections_delays_no_message_and_a_connecting_rank_gets_in(store, monkeypatch):
    """Every handshake slot held by silent or trickling connections: a started run's queue still moves at
    once, a rank connecting meanwhile gets in at once (the oldest waiting connection is dropped), and a held
    connection is closed after HANDSHAKE_S however it trickles."""
    monkeypatch.setattr(kvstore, "HANDSHAKE_S", 1.5)
    monkeypatch.setattr(kvstore, "MAX_PENDING", 8)
    port = _port(store)
    cmd = command_queue(store, 0, TOKEN, "r1")
    held = [_raw(port) for _ in range(8)]
    assert _until(lambda: store.server.pending == 8)
    t0 = time.monotonic()
    for i in range(20):
        cmd.put(("drop", i, {"rids": [i]}))
        assert cmd.get(timeout=1) == ("drop", i, {"rids": [i]})
    late = kvstore.StoreClient("127.0.0.1", port, TOKEN, timeout_s=5)
    late.set("k", b"v")
    assert time.monotonic() - t0 < 1.0                     # no held handshake had to time out first
    assert _closed(held[0])                                # the oldest was dropped for the rank
    for _ in range(60):                                    # trickles one byte at a time: closed all the same
        try:
            held[1].sendall(b"\0")
        except OSError:
            break
        time.sleep(0.05)
    assert _closed(held[1]) and time.monotonic() - t0 < 1.5 + 1.0
    for s in held:
        s.close()


def test_junk_from_a_client_without_the_token_does_not_grow_the_store(store):
    """40 writes of 7 MiB each: the store reads the 32-byte answer, closes, and holds nothing of them."""
    def rss_kib() -> int:
        for line in open("/proc/self/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        return 0

    before = rss_kib()
    junk = b"x" * (7 << 20)
    for i in range(40):
        _unauthenticated_set(_port(store), f"junk/{i}", junk)
    del junk
    assert _until(lambda: REFUSALS.report().get("store_connections_refused", 0) == 40)
    assert store.server.held == 0 and not store.server.data
    assert rss_kib() - before < 32 << 10                   # well under the 280 MiB sent


def test_token_holders_are_bounded_too(store, monkeypatch):
    monkeypatch.setattr(kvstore, "MAX_HELD", 1 << 20)
    store.set("a", b"x" * (600 << 10))
    with pytest.raises(StoreError, match="refused"):
        store.set("b", b"x" * (600 << 10))
    with pytest.raises(StoreError, match="too large"):
        store.set("c", b"x" * (kvstore.MAX_VALUE + 1))
    store.delete_key("a")
    store.set("b", b"x" * (600 << 10))
    assert store.server.held == 600 << 10


def test_refusals_are_counted_and_the_log_is_rate_limited(store, capfd):
    for _ in range(60):
        _unauthenticated_set(_port(store), "hb/0", b"junk")
    assert _until(lambda: REFUSALS.report().get("store_connections_refused", 0) == 60)
    err = [ln for ln in capfd.readouterr().err.splitlines() if ln.startswith("rackbed:")]
    assert len(err) == kvstore.LOG_LINES
    assert REFUSALS.report()["log_lines_suppressed"] == 60 - kvstore.LOG_LINES


def test_the_log_says_how_many_lines_it_held_back(capfd):
    log = kvstore.RefusalLog(lines=2, window_s=0.2)
    for i in range(10):
        log.note("messages_refused", f"m{i}")
    time.sleep(0.25)
    log.note("messages_refused", "m10")
    err = capfd.readouterr().err.splitlines()
    assert err == ["rackbed: refused m0", "rackbed: refused m1",
                   "rackbed: 8 more refusals not shown in the last 0.2 s (counted in the run's report)",
                   "rackbed: refused m10"]
    assert log.report() == {"messages_refused": 11, "log_lines_suppressed": 8}


def _start_run(world: int = 2):
    """A store and the nonce its ranks agree on (each rank's agree_run in a thread, as on its own host)."""
    ls = listen_socket("127.0.0.1", 0)
    st = open_store("127.0.0.1", ls.getsockname()[1], TOKEN, listen=ls, timeout_s=5)
    got: dict[int, str] = {}
    ts = [threading.Thread(target=lambda r=r: got.__setitem__(r, agree_run(
        kvstore.StoreClient("127.0.0.1", _port(st), TOKEN, timeout_s=5), r, world, TOKEN, timeout_s=5)))
        for r in range(world)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=10)
    assert len(got) == world and len(set(got.values())) == 1
    return st, got[0]


@pytest.mark.slow
def test_recorded_messages_replayed_into_another_run_with_the_same_token_act_on_nothing():
    a, run_a = _start_run()
    b, run_b = _start_run()
    assert run_a != run_b
    # run A: the driver stops rank 0, rank 1 replies, rank 1 beats; a recorder copies every key as written
    cmd_a, res_a = command_queue(a, 0, TOKEN, run_a), reply_queue(a, 2, TOKEN, run_a)
    cmd_a.put(("stop", 0, {}))
    res_a.put((7, 1, "ok", ({3: 5}, 0.25)))
    a.set("hb/1", seal(TOKEN, run_a, "hb/1", 1000, {}))
    recorded = {k: a.get(k) for k in ("cmd/0/1", "res/1", "hb/1", "run")}
    # run B: the same keys, written with A's bytes by a token holder (the worst case: a client without the
    # token writes nothing at all)
    cmd_b, res_b = command_queue(b, 0, TOKEN, run_b), reply_queue(b, 2, TOKEN, run_b)
    for k, v in recorded.items():
        b.set(k, v)
    with pytest.raises(queue.Empty):
        cmd_b.get(timeout=0.3)                           # A's stop is refused: rank 0 of B keeps serving
    with pytest.raises(queue.Empty):
        res_b.get(timeout=0.3)                           # A's reply is refused
    p = _RemoteProc(b, 1, TOKEN, run_b, dead_after_s=0.3)
    t0 = time.monotonic()
    while time.monotonic() - t0 < 0.6:
        b.set("hb/1", recorded["hb/1"])                  # A's beat, numbered far above B's
        p.check()
        time.sleep(0.05)
    assert not p.is_alive() and p.seq == 0
    rep = REFUSALS.report()
    assert rep["messages_refused"] == 2 and rep["heartbeats_refused"] >= 3
    # A's announcement replayed to a rank of B that is starting: refused, the rank waits for its own
    c = kvstore.StoreClient("127.0.0.1", _port(b), TOKEN, timeout_s=5)
    c.set("run", recorded["run"])
    with pytest.raises(BadMessage, match="no valid message"):
        agree_run(c, 1, 2, TOKEN, timeout_s=0.5)
    # genuine messages of B still flow
    cmd_b.put(("drop", 1, {"rids": [2]}))
    assert cmd_b.get(timeout=1) == ("drop", 1, {"rids": [2]})
    for st in (a, b, c):
        st.close()


def test_a_rank_reads_a_stop_once_the_store_is_gone(capfd):
    """Rank 0 (the store's host) ends: a rank waiting for a command reads a stop at once, and the driver's
    side raises a one-line StoreError."""
    ls = listen_socket("127.0.0.1", 0)
    st = open_store("127.0.0.1", ls.getsockname()[1], TOKEN, listen=ls, timeout_s=5)
    rank_side = kvstore.StoreClient("127.0.0.1", _port(st), TOKEN, timeout_s=5)
    cmd = command_queue(rank_side, 1, TOKEN, "r1")
    res = reply_queue(st, 2, TOKEN, "r1")
    threading.Timer(0.2, st.close).start()
    t0 = time.monotonic()
    assert cmd.get() == ("stop", 0, {})
    assert time.monotonic() - t0 < 3
    assert "cmd/1: store 127.0.0.1" in capfd.readouterr().err
    with pytest.raises(StoreError, match="connection lost"):
        res.get(timeout=1)


def test_a_store_that_stops_answering_fails_a_request_after_the_answer_limit(monkeypatch):
    """Rank 0's host goes silent (no close, no reply): a request fails with one line after ANSWER_S."""
    ls = listen_socket("127.0.0.1", 0)
    port = ls.getsockname()[1]

    def silent_store():                    # answers the handshake, then nothing
        conn, _ = ls.accept()
        conn.sendall(kvstore.MAGIC + b"\0" * kvstore.CHALLENGE_BYTES)
        conn.recv(64)
        conn.sendall(bytes([kvstore.OK]))
        time.sleep(3)
        conn.close()

    threading.Thread(target=silent_store, daemon=True).start()
    monkeypatch.setattr(kvstore, "ANSWER_S", 0.3)
    c = kvstore.StoreClient("127.0.0.1", port, TOKEN, timeout_s=5)
    t0 = time.monotonic()
    with pytest.raises(StoreError, match="connection lost"):
        c.get("res/1")
    assert time.monotonic() - t0 < 2
    with pytest.raises(StoreError):                     # the connection is not used again
        c.get("res/1")
