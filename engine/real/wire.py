"""What crosses hosts in a multi-node real run: typed, versioned, authenticated messages (no pickles).

Commands (driver -> rank), replies (rank -> driver) and heartbeats travel through the run's key-value store
(``engine.real.kvstore``, which serves only clients holding the run's token; ``engine.real.torchrun``). A
message is plain data in a small explicit encoding, checked before anything acts on it:

- **encoding**: JSON of ``None``/bool/int/float/str and lists; a tuple is ``{"T": [...]}``, a dict is ``{"D":
  [[key, value], ...]}`` (int or str keys). Any other JSON object is refused, so decoding builds plain values
  only — nothing is imported, constructed or called (a pickle payload is not JSON and is refused);
- **envelope**: ``{"v": VERSION, "r": run nonce, "q": queue name, "i": sequence number, "body": ...}``,
  preceded by an HMAC-SHA256 of the envelope under the run's token (:func:`run_token`). The run nonce is drawn
  by rank 0 at start and learned by every process from an announcement that carries a random hello of its own
  (``engine.real.torchrun.agree_run``), so two runs never share one even when they share the token. The reader
  checks the MAC, the version, that the message was written for this run, for its queue and at the index it
  expects (a message replayed from another run, or into another queue or slot, is refused; a heartbeat's index
  must grow), then the body's schema: a command's op and the names and types of its arguments
  (:data:`COMMANDS`), a reply's shape (:func:`check_reply`);
- a message that fails any check raises :class:`BadMessage` with one line; the reader refuses it (counted, the
  lines rate-limited: ``engine.real.kvstore.REFUSALS``) and nothing runs.

Trust model: the token is the run's one secret (it is never written to the store; the store's handshake and
the MACs prove it). Whoever knows it and can reach the store can command every rank. Whoever reaches the store
without it is refused at the handshake: it reads, writes and deletes nothing, and the store bounds what its
connections cost (``engine.real.kvstore``: time, memory, log lines). Messages recorded in another run that
shares the token are refused by the run nonce. Local runs (``engine.real.launch``,
:class:`engine.real.driver.RealRun`) pass pickled tuples over ``multiprocessing`` pipes between the driver and
the processes it spawned, which nothing else can write to; they need none of this.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import os
import secrets

#: bumped whenever a message's layout changes; a reader refuses any other version
VERSION = 2
TOKEN_ENV = "RACKBED_RUN_TOKEN"


class BadMessage(ValueError):
    """A message that failed a check (one line: the queue, the index, what was wrong)."""


def run_token(explicit: str | None = None) -> bytes:
    """The run's token: ``explicit``, else ``$RACKBED_RUN_TOKEN`` (hex or text), else a fresh random one."""
    tok = explicit if explicit is not None else os.environ.get(TOKEN_ENV)
    if tok:
        return tok.encode()
    return secrets.token_hex(32).encode()


# -- the value encoding ------------------------------------------------------------------------------------------
def _enc(x):
    if x is None or isinstance(x, (bool, str)):
        return x
    if isinstance(x, int):
        return int(x)
    if isinstance(x, float):
        return x
    if isinstance(x, list):
        return [_enc(v) for v in x]
    if isinstance(x, tuple):
        return {"T": [_enc(v) for v in x]}
    if isinstance(x, dict):
        for k in x:
            if not isinstance(k, (int, str)) or isinstance(k, bool):
                raise TypeError(f"wire: dict key {k!r} is not an int or str")
        return {"D": [[k, _enc(v)] for k, v in x.items()]}
    if hasattr(x, "item") and getattr(x, "ndim", 1) == 0:       # a numpy / torch scalar
        return _enc(x.item())
    raise TypeError(f"wire: cannot encode a {type(x).__name__}")


def _dec(x, depth: int = 0):
    if depth > 32:
        raise BadMessage("nested too deeply")
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    if isinstance(x, list):
        return [_dec(v, depth + 1) for v in x]
    if isinstance(x, dict) and len(x) == 1 and isinstance(x.get("T"), list):
        return tuple(_dec(v, depth + 1) for v in x["T"])
    if isinstance(x, dict) and len(x) == 1 and isinstance(x.get("D"), list):
        out = {}
        for kv in x["D"]:
            if not (isinstance(kv, list) and len(kv) == 2 and isinstance(kv[0], (int, str))
                    and not isinstance(kv[0], bool)):
                raise BadMessage("a dict entry is not an [int|str key, value] pair")
            out[kv[0]] = _dec(kv[1], depth + 1)
        return out
    raise BadMessage(f"a JSON object that is neither a tuple nor a dict ({sorted(x)[:3] if isinstance(x, dict) else x})")


# -- the envelope ------------------------------------------------------------------------------------------------
def seal(token: bytes, run: str, queue: str, index: int, body) -> bytes:
    """``body`` as the bytes stored under ``queue``'s ``index``-th key of run ``run`` (its nonce)."""
    env = json.dumps({"v": VERSION, "r": run, "q": queue, "i": index, "body": _enc(body)},
                     separators=(",", ":"), allow_nan=True).encode()
    return hmac.new(token, env, hashlib.sha256).hexdigest().encode() + b"." + env


def unseal(token: bytes, run: str, queue: str, index: int | None, data: bytes):
    """The body of a sealed message of run ``run`` after every check (module docstring); ``index`` None skips
    the index check and returns ``(index, body)`` (heartbeats: the reader checks that the number grew)."""
    where = f"{queue}#{index if index is not None else '?'}"
    mac, sep, env = bytes(data).partition(b".")
    if not sep or len(mac) != 64:
        raise BadMessage(f"{where}: not a sealed message ({len(data)} bytes, starts {bytes(data[:8])!r})")
    want = hmac.new(token, env, hashlib.sha256).hexdigest().encode()
    if not hmac.compare_digest(mac, want):
        raise BadMessage(f"{where}: bad MAC (not written with this run's token)")
    try:
        doc = json.loads(env)
    except ValueError as exc:
        raise BadMessage(f"{where}: malformed JSON ({exc})") from None
    if not isinstance(doc, dict) or "v" not in doc:
        raise BadMessage(f"{where}: the envelope has no version")
    if doc["v"] != VERSION:
        raise BadMessage(f"{where}: message version {doc['v']!r}, this build reads version {VERSION}")
    if set(doc) != {"v", "r", "q", "i", "body"}:
        raise BadMessage(f"{where}: the envelope must have exactly v, r, q, i, body")
    if doc["r"] != run:
        raise BadMessage(f"{where}: written for another run ({str(doc['r'])[:16]!r}, "
                         f"this run is {run[:16]!r})")
    if doc["q"] != queue or not isinstance(doc["i"], int) or (index is not None and doc["i"] != index):
        raise BadMessage(f"{where}: written for {doc['q']!r}#{doc['i']!r}, read from {queue!r}#{index}")
    body = _dec(doc["body"])
    return body if index is not None else (doc["i"], body)


# -- the schemas -------------------------------------------------------------------------------------------------
INT, FLOAT, STR, BOOL = "int", "float", "str", "bool"


def _ok(v, t) -> bool:
    """``v`` matches type spec ``t``: INT, FLOAT, STR, BOOL, ("list", t), ("tuple", t1, t2, ...), ("opt", t),
    ("any", t1, t2, ...)."""
    if t == BOOL:
        return isinstance(v, bool)
    if t == INT:
        return isinstance(v, int) and not isinstance(v, bool)
    if t == FLOAT:
        return isinstance(v, (int, float)) and not isinstance(v, bool)
    if t == STR:
        return isinstance(v, str)
    kind = t[0]
    if kind == "list":
        return isinstance(v, list) and all(_ok(x, t[1]) for x in v)
    if kind == "tuple":
        return isinstance(v, (tuple, list)) and len(v) == len(t) - 1 and all(_ok(x, s) for x, s in zip(v, t[1:]))
    if kind == "opt":
        return v is None or _ok(v, t[1])
    if kind == "any":
        return any(_ok(v, s) for s in t[1:])
    raise ValueError(f"bad type spec {t!r}")


_INTS = ("list", INT)
# prefill items: (rid, token ids), or with a prefix cache (rid, token ids, tokens the scheduler found cached)
_ITEMS = ("list", ("any", ("tuple", INT, _INTS), ("tuple", INT, _INTS, INT)))
_JOINED = ("list", ("tuple", INT, INT))                # (rid, rank in group)
#: every command's arguments and their types: nothing else is accepted
COMMANDS: dict[str, dict[str, object]] = {
    "prefill": {"items": _ITEMS},
    "decode": {"joined": _JOINED, "left": _INTS},
    "mixed": {"joined": _JOINED, "left": _INTS, "items": _ITEMS},
    "kv_send": {"rid": INT, "dst_global": INT, "seq_len": INT, "lose": BOOL},
    "kv_recv": {"rid": INT, "src_globals": _INTS, "seq_len": INT, "src_pages": ("opt", _INTS), "last_token": INT,
                "tokens": _INTS, "free": _INTS},
    "drop": {"rids": _INTS},
    "stop": {},
}
OPTIONAL_ARGS = {"kv_recv": {"free": []}, "kv_send": {"lose": False}}


def check_command(msg, where: str = "command"):
    """``(op, token, args)`` if ``msg`` is a well-formed command, else :class:`BadMessage`."""
    if not (isinstance(msg, (tuple, list)) and len(msg) == 3):
        raise BadMessage(f"{where}: a command is (op, token, args)")
    op, token, args = msg
    if op not in COMMANDS:
        raise BadMessage(f"{where}: unknown op {op!r}")
    if not _ok(token, INT) or not isinstance(args, dict):
        raise BadMessage(f"{where}: {op}: token must be an int and args a dict")
    spec = COMMANDS[op]
    args = {**OPTIONAL_ARGS.get(op, {}), **args}
    if set(args) != set(spec):
        raise BadMessage(f"{where}: {op}: arguments {sorted(args)}, expected {sorted(spec)}")
    for name, t in spec.items():
        if not _ok(args[name], t):
            raise BadMessage(f"{where}: {op}: argument {name!r} is not a {t}")
    return op, token, args


def _plain(v) -> bool:
    """A reply's ``out``: ints, finite floats, strings, None and lists / tuples / int-keyed dicts of them."""
    if v is None or isinstance(v, (bool, int, str)):
        return True
    if isinstance(v, float):
        return math.isfinite(v)
    if isinstance(v, (list, tuple)):
        return all(_plain(x) for x in v)
    if isinstance(v, dict):
        return all(_plain(k) and _plain(x) for k, x in v.items())
    return False


def check_reply(msg, world: int, where: str = "reply"):
    """``(token, rank, status, payload)`` if ``msg`` is a well-formed reply of one of ``world`` ranks."""
    if not (isinstance(msg, (tuple, list)) and len(msg) == 4):
        raise BadMessage(f"{where}: a reply is (token, rank, status, payload)")
    token, rank, status, payload = msg
    if not (_ok(token, ("opt", INT)) and _ok(rank, INT) and 0 <= rank < world):
        raise BadMessage(f"{where}: token must be an int or null and rank in [0, {world})")
    if status == "ready":
        good = payload is None
    elif status in ("error", "declined"):
        good = isinstance(payload, str)
    elif status == "ok":
        good = payload is None or (isinstance(payload, tuple) and len(payload) == 2 and _ok(payload[1], FLOAT)
                                   and _plain(payload[0]))
    else:
        raise BadMessage(f"{where}: unknown status {status!r}")
    if not good:
        raise BadMessage(f"{where}: rank {rank} {status}: payload of the wrong shape")
    return token, rank, status, payload
