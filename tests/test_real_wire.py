"""What crosses hosts in a multi-node real run is plain, checked data: a sealed message round-trips; anything
else — a pickle that would run code, malformed JSON, another version, another token, another run, a message
moved to another queue or slot, a command of the wrong shape — is refused with one line and nothing runs; the
store listens only on the address it is given; liveness counts heartbeat numbers on the reader's clock, so a
replayed or forged beat keeps no rank alive."""

from __future__ import annotations

import json
import pickle
import queue
import socket

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rackbed.engine.real.wire import VERSION, BadMessage, check_command, check_reply, seal, unseal

TOKEN = b"0123456789abcdef" * 4
RUN = "5eed" * 8


class _Boom:
    """Unpickling this writes a file: the proof that a pickle ran code."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.fixture(autouse=True)
def _fresh_refusal_log():
    from rackbed.engine.real.kvstore import REFUSALS

    REFUSALS.reset()
    yield
    REFUSALS.reset()


def _sealed_raw(env: bytes, token: bytes = TOKEN) -> bytes:
    import hashlib
    import hmac

    return hmac.new(token, env, hashlib.sha256).hexdigest().encode() + b"." + env


def test_a_command_round_trips_with_its_types():
    cmd = ("kv_recv", 7, {"rid": 3, "src_globals": [0, 1], "seq_len": 9, "src_pages": [4, 5, 6], "last_token": 11,
                          "tokens": [1, 2], "free": [8]})
    got = check_command(unseal(TOKEN, RUN, "cmd/2", 5, seal(TOKEN, RUN, "cmd/2", 5, cmd)))
    assert got == cmd and isinstance(got, tuple)
    reply = (7, 2, "ok", ({4: (17, [1, 2])}, 0.25))
    assert check_reply(unseal(TOKEN, RUN, "res", 1, seal(TOKEN, RUN, "res", 1, reply)), world=4) == reply


@pytest.mark.parametrize("make, why", [
    (lambda tmp: pickle.dumps(("prefill", 1, {"items": [_Boom(str(tmp / "ran"))]})), "not a sealed message"),
    (lambda tmp: _sealed_raw(pickle.dumps(_Boom(str(tmp / "ran")))), "malformed JSON"),
    (lambda tmp: _sealed_raw(b'{"v": 1, "q": "cmd/0", "i": 1, "body": ['), "malformed JSON"),
    (lambda tmp: _sealed_raw(json.dumps({"v": VERSION + 1, "q": "cmd/0", "i": 1, "body": None}).encode()),
     "version"),
    (lambda tmp: seal(b"another run's token" * 3, RUN, "cmd/0", 1, ("stop", 0, {})), "bad MAC"),
    (lambda tmp: seal(TOKEN, "another run", "cmd/0", 1, ("stop", 0, {})), "written for another run"),
    (lambda tmp: seal(TOKEN, RUN, "cmd/1", 1, ("stop", 0, {})), "written for 'cmd/1'"),
    (lambda tmp: seal(TOKEN, RUN, "cmd/0", 2, ("stop", 0, {})), "written for 'cmd/0'#2"),
    (lambda tmp: _sealed_raw(json.dumps({"v": VERSION, "r": RUN, "q": "cmd/0", "i": 1,
                                         "body": {"py/object": "os.system"}}).encode()), "neither a tuple nor a dict"),
])
def test_a_hostile_or_stale_message_is_refused_and_nothing_runs(tmp_path, make, why):
    with pytest.raises(BadMessage, match=why) as exc:
        unseal(TOKEN, RUN, "cmd/0", 1, make(tmp_path))
    assert "\n" not in str(exc.value)
    assert not (tmp_path / "ran").exists()


@pytest.mark.parametrize("cmd", [
    ("prefill", 4, {"items": [(3, [1, 2, 3]), (5, [4])]}),
    ("prefill", 4, {"items": [(3, [1, 2, 3], 2)]}),                # with a prefix cache: the cached tokens
    ("mixed", 4, {"joined": [(1, 0)], "left": [2], "items": [(3, [1, 2], 0)]}),
])
def test_prefill_items_with_and_without_a_prefix_cache_are_accepted(cmd):
    assert check_command(unseal(TOKEN, RUN, "cmd/0", 1, seal(TOKEN, RUN, "cmd/0", 1, cmd))) == cmd


@pytest.mark.parametrize("cmd, why", [
    (("prefill", 1, {"items": [(3, [1], 2, 9)]}), "'items'"),
    (("exec", 1, {}), "unknown op 'exec'"),
    (("decode", 1, {"joined": [(1, 0)]}), "arguments"),
    (("decode", 1, {"joined": [(1, 0)], "left": ["x"]}), "'left'"),
    (("kv_send", 1, {"rid": 1, "dst_global": 2, "seq_len": 3, "cmd": "rm -rf /"}), "arguments"),
    (("prefill", "1", {"items": []}), "token must be an int"),
])
def test_a_command_of_the_wrong_shape_is_refused(cmd, why):
    with pytest.raises(BadMessage, match=why):
        check_command(unseal(TOKEN, RUN, "cmd/0", 1, seal(TOKEN, RUN, "cmd/0", 1, cmd)))


_plain = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
                      lambda c: st.lists(c, max_size=4) | st.tuples(c, c)
                      | st.dictionaries(st.integers() | st.text(max_size=4), c, max_size=3), max_leaves=20)


@settings(max_examples=200, derandomize=True, deadline=None)
@given(_plain)
def test_plain_values_round_trip(v):
    assert unseal(TOKEN, RUN, "q", 3, seal(TOKEN, RUN, "q", 3, v)) == v


@settings(max_examples=300, derandomize=True, deadline=None)
@given(st.binary(max_size=200), st.booleans())
def test_any_bytes_are_refused_with_bad_message_only(data, mac_ok):
    """Random bytes (with or without a valid MAC over them) never raise anything but BadMessage."""
    with pytest.raises(BadMessage):
        unseal(TOKEN, RUN, "cmd/0", 1, _sealed_raw(data) if mac_ok else data)


def _store(listen):
    from rackbed.engine.real.torchrun import open_store

    return open_store("127.0.0.1", listen.getsockname()[1], TOKEN, listen=listen, timeout_s=5)


def test_the_store_queue_skips_a_refused_message_with_one_line(tmp_path, capfd):
    from rackbed.engine.real.torchrun import command_queue, listen_socket

    ls = listen_socket("127.0.0.1", 0)
    st_ = _store(ls)
    q = command_queue(st_, 0, TOKEN, RUN)
    st_.add("cmd/0/n", 1)                                               # a third party takes slot 1 ...
    st_.set("cmd/0/1", pickle.dumps(_Boom(str(tmp_path / "ran"))))    # ... and writes a pickle into it
    q.put(("drop", 5, {"rids": [3]}))
    assert q.get(timeout=5) == ("drop", 5, {"rids": [3]})
    assert not (tmp_path / "ran").exists()
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "refused a store message: cmd/0#1: not a sealed message" in err[0]
    assert not st_.check(["cmd/0/1"]) and not st_.check(["cmd/0/2"])   # read messages are deleted
    with pytest.raises(queue.Empty):
        q.get(timeout=0.05)


def _other_address() -> str | None:
    """An address of this host that is not loopback (None if there is none)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("192.0.2.1", 9))           # no packet is sent: this only picks the outgoing interface
            addr = s.getsockname()[0]
    except OSError:
        return None
    return None if addr.startswith("127.") or addr == "0.0.0.0" else addr


def test_the_store_listens_only_on_the_named_address():
    from rackbed.engine.real.torchrun import listen_socket

    ls = listen_socket("127.0.0.1", 0)
    host, port = ls.getsockname()[:2]
    store = _store(ls)
    assert host == "127.0.0.1"
    store.set("k", b"v")                      # it serves on the named address
    other = _other_address()
    if other is None:
        pytest.skip("this host has no non-loopback address to try")
    with socket.socket() as s:
        s.settimeout(2)
        with pytest.raises(OSError):
            s.connect((other, port))


def test_a_bind_that_cannot_work_is_one_line():
    from rackbed.engine.real.torchrun import listen_socket
    from rackbed.topology.errors import UserError

    with pytest.raises(UserError, match=r"cannot listen on 192\.0\.2\.77.*RACKBED_STORE_BIND"):
        listen_socket("192.0.2.77", 0)


@pytest.mark.slow
def test_liveness_counts_beats_on_the_readers_clock():
    """A rank is alive while its beat number grows; replaying its last beat, or forging one without the token,
    does not keep it alive; wall-clock values play no part."""
    import time

    from rackbed.engine.real.torchrun import _RemoteProc, listen_socket

    ls = listen_socket("127.0.0.1", 0)
    st_ = _store(ls)
    p = _RemoteProc(st_, 3, TOKEN, RUN, dead_after_s=0.3)
    for i in range(1, 4):
        st_.set("hb/3", seal(TOKEN, RUN, "hb/3", i, {}))
        p.check()
        time.sleep(0.15)
    assert p.is_alive() and p.seq == 3
    last = seal(TOKEN, RUN, "hb/3", 3, {})
    t0 = time.monotonic()
    while time.monotonic() - t0 < 0.6:
        st_.set("hb/3", last)                                   # the same beat again
        p.check()
        st_.set("hb/3", seal(b"x" * 64, RUN, "hb/3", 10**6, {}))    # a forged one
        p.check()
        time.sleep(0.05)
    assert not p.is_alive()


def test_the_multi_host_path_imports_no_deserialiser_that_runs_code():
    """No module on the multi-host path imports pickle (or its relatives)."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    for f in ("engine/real/torchrun.py", "engine/real/wire.py", "engine/cli/torchrun.py"):
        names = set()
        for node in ast.walk(ast.parse((root / f).read_text())):
            if isinstance(node, ast.Import):
                names.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module.split(".")[0])
        assert not names & {"pickle", "cPickle", "dill", "cloudpickle", "marshal", "shelve"}, f
